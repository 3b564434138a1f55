"""A float32 tree's global norm under ``jit`` written as optax (a clip) writes it.

``optax.tree.norm`` takes one ``sum(x^2)`` per leaf. Written the same way, the norm a
clip (``optax.clip_by_global_norm``) takes of the gradients and the recorder's
``grad/global_norm`` are one computation to XLA: the figure costs no read of its own.
The non-finite count is 0 while the norm is finite and is counted only where it is not
(docs/RECORDER.md, "The light step: every group's figures from the clip's sums"). The
recorder's light step (:func:`~jvitals.metrics.gradients.norm_metrics`,
:mod:`jvitals.metrics.light`) and its choice of the CPU's heavy form
(:mod:`jvitals.metrics.record`) share these functions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__: list[str] = []   # the recorder's helpers: nothing a user calls

_F32 = jnp.float32


def optax_form(tree: Any, axes: tuple[str, ...]) -> bool:
    """Whether ``tree``'s norm is taken as optax takes it: no mesh axes bound, and
    every leaf a float32 array (other dtypes are measured in float32 by the fold)."""
    leaves = jax.tree.leaves(tree)
    return not axes and bool(leaves) and all(getattr(x, "dtype", None) == _F32 for x in leaves)


def nonfinite_where(bad: jax.Array, tree: Any) -> jax.Array:
    """``#(x is NaN or Inf)`` over ``tree`` where ``bad``, else 0: on the CPU under a
    ``lax.cond`` (no host round trip there; a healthy step skips the count's read), on
    other backends computed beside the norm and selected (XLA:GPU and TPU fuse the count
    with the norm's reduction of the same tensor; a conditional would make a GPU step
    wait on the host for its predicate). The count is the plain ``sum(~isfinite(x))``, which
    the TPU compiler reads in the norm's kernel; for a count from the bits (as the fold takes
    it) it writes a scan-stacked expert gradient out in another layout first (docs/COST.md)."""
    def count() -> jax.Array:  # counted in float32, as the fold counts (XLA:CPU splits an int sum)
        n = sum((jnp.sum(~jnp.isfinite(x), dtype=_F32) for x in jax.tree.leaves(tree)), jnp.zeros((), _F32))
        return n.astype(jnp.int32)

    def zero() -> jax.Array:
        return jnp.zeros((), jnp.int32)

    return lax.platform_dependent(cpu=lambda: lax.cond(bad, count, zero),
                                  default=lambda: jnp.where(bad, count(), zero()))


def norm_as_optax(tree: Any) -> tuple[jax.Array, jax.Array]:
    """``(||x||, finite)``: ``optax.tree.norm(tree)`` (the clip's own expression), NaN
    where it is not finite (a non-finite element, or a float32 overflow of the sum)."""
    n = optax.tree.norm(tree).astype(_F32)
    finite = jnp.isfinite(n)
    return jnp.where(finite, n, jnp.nan), finite


def norm_and_count(tree: Any) -> tuple[jax.Array, jax.Array]:
    """``(||x||, #non-finite)`` of a float32 tree under ``jit``: the norm as optax (a
    clip) writes it, the count only where that norm is not finite."""
    n, finite = norm_as_optax(tree)
    return n, nonfinite_where(~finite, tree)
