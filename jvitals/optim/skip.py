"""Skip an update whose loss or gradient norm is far outside the run's recent history.

As OLMo-core's ``SkipStepOptimizer`` and Levanter's ``skipstep`` do, :func:`skip_step` skips,
inside the step, an update whose loss or gradient norm is more than ``sigma`` standard
deviations above the mean of the last ``window`` steps (an optax wrapper with an on-device
rolling baseline), so a catastrophic update never lands while the host waits for its next
check::

    skip_t = armed and (l_t > mean(l) + sigma * sd(l) or g_t > mean(g) + sigma * sd(g))
             or (skip_nonfinite and l_t or g_t is not finite)

A skipped update is 0 and keeps the inner state. The choice is a select, not a conditional
(no host round trip). Put the recorder outside it, ``vitals.record(vitals.skip_step(...))``,
and pass the loss: ``tx.update(grads, state, params, loss=loss)``. The baseline, the cost
and the recorder's window: docs/REMEDIES.md, "skip_step, in detail".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jvitals.metrics.checks import check_transform

__all__ = ["SkipStepState", "skip_step"]

_F32 = jnp.float32


class SkipStepState(NamedTuple):
    """State of :func:`skip_step`.

    Attributes:
      count: updates seen (int32).
      losses: the last ``window`` finite losses, a ring (NaN: empty slot; float32).
      grad_norms: the last ``window`` finite gradient norms, the same ring.
      skipped: updates skipped so far (int32).
      last_skipped: whether the latest update was skipped (bool); the recorder reads it.
      inner_state: the wrapped transform's state (as of the last update not skipped).
    """

    count: jax.Array
    losses: jax.Array
    grad_norms: jax.Array
    skipped: jax.Array
    last_skipped: jax.Array
    inner_state: Any


def _threshold(ring: jax.Array, sigma: float) -> tuple[jax.Array, jax.Array]:
    """``(mean + sigma * max(sd, 1e-6), finite samples)`` of a ring (NaN slots left out)."""
    ok = jnp.isfinite(ring)
    n = jnp.sum(ok.astype(_F32))
    x = jnp.where(ok, ring, 0.0)
    mean = jnp.sum(x) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.where(ok, jnp.square(ring - mean), 0.0)) / jnp.maximum(n, 1.0)
    return mean + sigma * jnp.maximum(jnp.sqrt(var), 1e-6), n


def skip_step(inner: optax.GradientTransformation, *, window: int = 128, sigma: float = 6.0,
              warmup: int | None = None, skip_nonfinite: bool = True) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so an outlying update is skipped inside the step (module docstring).

    Args:
      inner: the transform to wrap (the optimizer, e.g. ``chain(clip_by_global_norm(1.0),
        adamw(lr))``).
      window: how many recent updates the baseline holds (OLMo-core: 128).
      sigma: skip above ``mean + sigma * sd`` of the loss or of the gradient norm (6).
      warmup: finite samples the baseline needs before it skips anything
        (default ``window // 2``, as Levanter).
      skip_nonfinite: also skip an update whose loss or gradient norm is not finite
        (from the first update on).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`SkipStepState`; its update needs ``loss=`` (a scalar) and passes every
      extra argument on to ``inner``.

    Raises:
      TypeError: ``inner`` is not a transform (an uncalled factory such as ``optax.adamw``).
      ValueError: ``window < 2``, ``sigma <= 0`` or ``warmup`` outside ``[1, window]``
        (at construction); no ``loss=`` given to the update (at trace time).

    Example:
      >>> tx = vitals.record(vitals.skip_step(optax.chain(optax.clip_by_global_norm(1.0),
      ...                                                 optax.adamw(1e-3))))  # doctest: +SKIP
      >>> updates, state = tx.update(grads, state, params, loss=loss)  # doctest: +SKIP
    """
    check_transform(inner, "skip_step")
    if int(window) < 2:
        raise ValueError(f"skip_step(window={window}): the baseline needs a window of at least 2 updates")
    if not float(sigma) > 0:
        raise ValueError(f"skip_step(sigma={sigma}): expected a positive number of standard deviations")
    warm = int(window) // 2 if warmup is None else int(warmup)
    if not 1 <= warm <= int(window):
        raise ValueError(f"skip_step(warmup={warmup}): expected 1 <= warmup <= window = {window}")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> SkipStepState:
        ring = jnp.full((int(window),), jnp.nan, _F32)
        return SkipStepState(jnp.zeros([], jnp.int32), ring, ring, jnp.zeros([], jnp.int32),
                             jnp.zeros([], bool), inner.init(params))

    def update_fn(updates: Any, state: SkipStepState, params: Any = None, **extra: Any):
        loss = extra.get("loss")
        if loss is None:
            raise ValueError("skip_step: the update needs the step's loss to judge it; call "
                             "tx.update(grads, opt_state, params, loss=loss)")
        loss = jnp.asarray(loss, _F32).reshape(())
        g = optax.tree.norm(updates).astype(_F32)          # the clip's own expression
        l_thr, n = _threshold(state.losses, float(sigma))
        g_thr, _ = _threshold(state.grad_norms, float(sigma))
        finite = jnp.isfinite(loss) & jnp.isfinite(g)
        skip = ((n >= warm) & finite & ((loss > l_thr) | (g > g_thr))) | (bool(skip_nonfinite) & ~finite)
        out, new_inner = inner.update(updates, state.inner_state, params, **extra)
        out = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), out)
        new_inner = jax.tree.map(lambda old, new: jnp.where(skip, old, new), state.inner_state, new_inner)
        i = state.count % int(window)
        keep = lambda ring, x: ring.at[i].set(jnp.where(finite, x, ring[i]))  # noqa: E731
        return out, SkipStepState(state.count + 1, keep(state.losses, loss), keep(state.grad_norms, g),
                                  state.skipped + skip.astype(jnp.int32), skip, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
