"""The CPU's forms of the statistics: plain reductions, which XLA:CPU vectorises.

XLA:CPU runs a variadic reduction (the one-read form every statistic takes on GPUs and TPUs,
:mod:`jvitals.metrics.fold`), and any reduction fed by a comparison or a select, as a serial
loop. So :func:`plain_summaries` (the heavy step's per-piece gradient summaries) takes the
healthy case in arithmetic only and leaves non-finite values to a ``lax.cond`` that a healthy
step does not run; it is chosen by :func:`~jvitals.metrics.fold.on_cpu` beside the one-read
form of the same figures, and tested against it and NumPy (tests/test_cpu_forms.py).
Timings: docs/COST.md, "The CPU's forms: plain reductions".
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jvitals.metrics import fold
from jvitals.metrics.stats import Summary, nan_rule

__all__ = ["plain_summaries"]

_F32 = jnp.float32

def plain_summaries(items: Sequence[tuple]) -> list[Summary]:
    """:func:`~jvitals.metrics.stats.summarize_fields` of unmasked items under ``jit``, in
    XLA:CPU's fastest form: plain reductions, which it vectorises (a variadic one runs as
    a serial loop).

    Per item ``(x, None, axis, fields, tag)``: ``sumsq = sum x^2`` written as optax writes a
    leaf's (``optax.tree.norm``: XLA computes a whole gradient leaf's once for this and the
    clip), ``abs_max = max |x|``; the non-finite counts only where the items' sums of squares
    are not all finite, under one ``lax.cond`` (a healthy step reads nothing for them). A
    non-finite element makes ``sumsq`` NaN or Inf here where the fold leaves it out; every
    figure read from a summary with ``nonfinite > 0`` is NaN either way (``Summary.norm``,
    ``rms``, ``_share``), so the figures are the fold's.

    Returns:
      One :class:`~jvitals.metrics.stats.Summary` per item (``sum`` NaN: not measured).
    """
    def dims(x: jax.Array, axis: int | None) -> tuple[int, ...]:
        return tuple(d for d in range(x.ndim) if d != axis)

    def square(x: jax.Array) -> jax.Array:
        return jnp.square(x.real) + jnp.square(x.imag)

    xs = [jnp.asarray(it[0]).astype(_F32) for it in items]
    sumsq = [jnp.sum(square(x), axis=dims(x, it[2])) for x, it in zip(xs, items)]
    amax = [jnp.max(jnp.abs(x), axis=dims(x, it[2])) if "abs_max" in it[3] else None for x, it in zip(xs, items)]
    bad = ~jnp.isfinite(sum((jnp.sum(s) for s in sumsq), jnp.zeros((), _F32)))

    def count() -> list[jax.Array]:
        return [jnp.sum(fold.finite_parts(x)[1], axis=dims(x, it[2])) for x, it in zip(xs, items)]

    def zero() -> list[jax.Array]:
        return [jnp.zeros(s.shape, _F32) for s in sumsq]

    # The CPU counts under a cond a healthy step skips; GPUs and TPUs beside the sums (a
    # sibling reduction they fuse with them; a GPU conditional waits on the host).
    nonfinite = fold.on_cpu(lambda: lax.cond(bad, count, zero), count) if items else []
    out = []
    for x, it, sq, am, nf in zip(xs, items, sumsq, amax, nonfinite):
        n = jnp.full(sq.shape, float(x.size // max(int(np.prod(sq.shape)), 1)), _F32)
        nan = jnp.full(sq.shape, jnp.nan, _F32)
        out.append(Summary(count=n, sum=nan, sumsq=sq, abs_max=nan if am is None else nan_rule(am, n, nf),
                           nonfinite=nf))
    return out
