"""Adaptive gradient clipping (ZClip): clip the global norm at ``mu + z * sigma``.

ZClip (Kumar et al., 2025, arXiv:2504.02507) keeps an exponential moving average of the
gradient's global norm and of its variance, and clips a norm that is a ``z``-sigma outlier
of it. :func:`adaptive_clip` is its "percentile" form as an optax transformation; after
``warmup_steps`` updates (plain mean and variance, clipped at ``max_norm`` only)::

    threshold_t = min(mu + z * sqrt(var), max_norm)    update_t = g_t * min(1, threshold_t / x_t)
    c_t = min(x_t, mu + z * sqrt(var));  mu <- alpha mu + (1 - alpha) c_t;  var likewise

A non-finite norm leaves the statistics unchanged. The state holds float32/int32 scalars
(checkpointed with the optimizer state); ``clip_threshold`` is what :func:`jvitals.record`
reports as ``grad/clip_threshold``. The full recurrence, warm-up and ``max_norm``:
docs/REMEDIES.md, "adaptive_clip: the recurrence".
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["AdaptiveClipState", "adaptive_clip", "global_norm_f32"]

_F32 = jnp.float32


class AdaptiveClipState(NamedTuple):
    """State of :func:`adaptive_clip` (scalars only).

    Attributes:
      count: updates seen (int32).
      num_finite: finite norms in the warm-up statistics (int32).
      mean: the warm-up mean, then the EMA mean ``mu`` of the clipped norms (float32).
      var: the warm-up population variance, then the EMA variance (float32).
      clip_threshold: the threshold applied at the latest update (float32; +inf
        when no clip was in force, e.g. warm-up without ``max_norm``).
    """

    count: jax.Array
    num_finite: jax.Array
    mean: jax.Array
    var: jax.Array
    clip_threshold: jax.Array


def global_norm_f32(tree: Any) -> jax.Array:
    """``sqrt(sum of squares of every leaf)``, accumulated in float32."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), _F32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.asarray(x).astype(_F32))) for x in leaves))


def _check(alpha: Any, z: Any, warmup_steps: Any, max_norm: Any) -> None:
    def real(x: Any) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

    if not (real(alpha) and 0.0 < alpha < 1.0):
        raise ValueError(f"adaptive_clip: alpha={alpha!r} must be a number in (0, 1) (the EMA's "
                         "decay; ZClip's default 0.97)")
    if not (real(z) and z > 0):
        raise ValueError(f"adaptive_clip: z={z!r} must be a positive number (the clip is at "
                         "mu + z * sigma; ZClip's default 2.5)")
    if not (isinstance(warmup_steps, numbers.Integral) and not isinstance(warmup_steps, bool)
            and warmup_steps >= 1):
        raise ValueError(f"adaptive_clip: warmup_steps={warmup_steps!r} must be an int >= 1 (the "
                         "updates whose norms start the statistics; ZClip's default 25)")
    if max_norm is not None and not (real(max_norm) and max_norm > 0):
        raise ValueError(f"adaptive_clip: max_norm={max_norm!r} must be None or a positive number")


def adaptive_clip(alpha: float = 0.97, z: float = 2.5, warmup_steps: int = 25,
                  max_norm: float | None = None) -> optax.GradientTransformation:
    """ZClip: clips the gradient's global norm to ``mu + z * sigma`` of its recent history.

    See the module docstring for the exact recursion. Place it where
    ``optax.clip_by_global_norm`` would go (before the optimizer); ``vitals.record``
    recognises it as a clip by its state's ``clip_threshold``.

    Args:
      alpha: EMA decay of the mean and variance, in (0, 1).
      z: the threshold in standard deviations, > 0.
      warmup_steps: updates (>= 1) whose norms start the statistics; during them
        the clip is at ``max_norm`` (or off).
      max_norm: an optional fixed cap on the threshold (warm-up and after).

    Returns:
      An ``optax.GradientTransformation`` with an :class:`AdaptiveClipState`.

    Raises:
      ValueError: if an argument is out of range (naming it and what is allowed).

    Example::

      tx = optax.chain(vitals.adaptive_clip(max_norm=10.0), optax.adamw(3e-4))
    """
    _check(alpha, z, warmup_steps, max_norm)
    cap = jnp.inf if max_norm is None else float(max_norm)
    alpha, z, warmup_steps = float(alpha), float(z), int(warmup_steps)

    def init_fn(params):
        del params
        return AdaptiveClipState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                                 jnp.zeros((), _F32), jnp.zeros((), _F32), jnp.asarray(jnp.inf, _F32))

    def update_fn(updates, state, params=None):
        del params
        x = global_norm_f32(updates)
        finite = jnp.isfinite(x)
        warm = (state.count < warmup_steps) | (state.num_finite == 0)
        # Warm-up: Welford's running mean and population variance of the finite norms.
        n1 = state.num_finite + 1
        d = x - state.mean
        w_mean = state.mean + d / n1
        w_var = state.var + (d * (x - w_mean) - state.var) / n1
        # After: the z-sigma threshold from the statistics so far, then the EMA.
        z_thr = state.mean + z * jnp.sqrt(jnp.maximum(state.var, 0.0))
        c = jnp.minimum(x, z_thr)
        e_mean = alpha * state.mean + (1 - alpha) * c
        e_var = alpha * state.var + (1 - alpha) * jnp.square(c - e_mean)
        threshold = jnp.where(warm, jnp.asarray(cap, _F32), jnp.minimum(z_thr, cap))
        new_mean = jnp.where(finite, jnp.where(warm, w_mean, e_mean), state.mean)
        new_var = jnp.where(finite, jnp.where(warm, w_var, e_var), state.var)
        num_finite = jnp.where(warm & finite, n1, state.num_finite)

        keep = x <= threshold         # as optax.clip_by_global_norm (and 0 <= 0 keeps a zero gradient)
        factor = threshold / x

        def clip(t):
            return jnp.where(keep, t, (t.astype(_F32) * factor).astype(t.dtype))

        out = jax.tree.map(clip, updates)
        return out, AdaptiveClipState(optax.safe_increment(state.count), num_finite.astype(jnp.int32),
                                      new_mean.astype(_F32), new_var.astype(_F32), threshold.astype(_F32))

    return optax.GradientTransformation(init_fn, update_fn)
