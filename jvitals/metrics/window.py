"""What happens between two host reads: the recorder's window over the updates since the last one.

The host reads the device once per check; the device sees every step. The recorder keeps,
beside each update's figures, a window over the updates since the host last read it, so
that a NaN step, a one-step spike or a skipped update between two checks reaches the next
check with the step it happened at: per figure of :data:`WINDOW_FIGURES`
``window/{f}.max``, ``.min``, ``.max_ago``, ``.mean``, ``.std`` (Welford), ``.n``; for the
window ``window/steps``, ``window/nonfinite_steps``, ``window/first_nonfinite_ago``... Steps
are kept as "updates ago" (exact in float32, right after a rollback too): the host takes
``step of the event = step of the check - ago``. A few dozen scalars, updated with scalar
arithmetic on every update (no read of any tensor, no host sync); pure functions.

Every entry and when the window restarts: docs/RECORDER.md, "The window, in the code's
words".
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

__all__ = ["WINDOW_FIGURES", "WINDOW_PREFIX", "empty_window", "update_window", "window_names"]

WINDOW_PREFIX = "window/"
WINDOW_FIGURES = ("loss", "grad/global_norm", "grad/global_norm_post_clip", "update/param_ratio")
"""The figures a window keeps extremes, mean and spread of (those the step has)."""

_PER_FIGURE = ("max", "min", "max_ago", "mean", "std", "n")
_EVENTS = ("steps", "nonfinite_steps", "first_nonfinite_ago", "skipped_steps", "first_skipped_ago")
_F32 = jnp.float32


def window_names(figures: Sequence[str]) -> tuple[str, ...]:
    """The window's entries for the ``figures`` the step has (in :data:`WINDOW_FIGURES` order)."""
    names = [f"{WINDOW_PREFIX}{e}" for e in _EVENTS]
    for f in WINDOW_FIGURES:
        if f in figures:
            names += [f"{WINDOW_PREFIX}{f}.{k}" for k in _PER_FIGURE]
    return tuple(names)


def empty_window(names: Sequence[str]) -> dict[str, jax.Array]:
    """A window holding no update: "ago" entries -1, everything else 0 (``n = 0`` says the
    extremes and moments are empty; no NaN, so a checkpoint of the state stays finite)."""
    out = {}
    for n in names:
        k = n.rsplit(".", 1)[-1] if "." in n else n[len(WINDOW_PREFIX):]
        out[n] = jnp.asarray(-1.0 if k.endswith("ago") else 0.0, _F32)
    return out


def _ago(prev: jax.Array, hit: jax.Array) -> jax.Array:
    """The first event's "ago": 0 where it happens now and none was before, else one more."""
    return jnp.where(prev >= 0, prev + 1.0, jnp.where(hit, 0.0, -1.0))


def _figure(p: Mapping[str, jax.Array], x: jax.Array, key: str) -> dict[str, jax.Array]:
    """One figure's window entries after the value ``x`` (skipped where not finite)."""
    g = lambda k: p[f"{key}.{k}"]  # noqa: E731
    x = jnp.asarray(x, _F32).reshape(())
    ok = jnp.isfinite(x)
    n0 = g("n")
    first = n0 < 0.5
    n = n0 + ok.astype(_F32)
    up = ok & (first | (x > g("max")))
    mean0 = jnp.where(first, 0.0, g("mean"))
    var0 = jnp.where(first, 0.0, jnp.square(g("std")))
    d = x - mean0
    mean = mean0 + d / jnp.maximum(n, 1.0)
    var = ((n - 1.0) * var0 + d * (x - mean)) / jnp.maximum(n, 1.0)
    return {
        f"{key}.max": jnp.where(up, x, g("max")),
        f"{key}.min": jnp.where(ok & (first | (x < g("min"))), x, g("min")),
        f"{key}.max_ago": jnp.where(up, 0.0, jnp.where(g("max_ago") >= 0, g("max_ago") + 1.0, -1.0)),
        f"{key}.mean": jnp.where(ok, mean, g("mean")),
        f"{key}.std": jnp.where(ok, jnp.sqrt(jnp.maximum(var, 0.0)), g("std")),
        f"{key}.n": n,
    }


def update_window(prev: Mapping[str, jax.Array], new: jax.Array, values: Mapping[str, jax.Array],
                  nonfinite: jax.Array, skipped: jax.Array) -> dict[str, jax.Array]:
    """The window after one more update.

    ``max`` and ``min`` replace on a strictly larger (smaller) finite value, whose
    ``max_ago`` restarts at 0 (others age by one); ``mean`` and ``std`` follow
    Welford's update over the finite values (``n`` of them)::

        d = x - mean;  mean += d / n;  var = ((n - 1) var + d (x - mean)) / n

    Args:
      prev: the window so far (``{name: float32 scalar}``, the names of
        :func:`window_names`).
      new: a boolean scalar: this update starts a new window (``prev`` is dropped).
      values: ``{figure: scalar}`` of this update, for the figures in ``prev``.
      nonfinite: a boolean scalar: the loss or the gradients were not finite.
      skipped: a boolean scalar: the update was skipped.

    Returns:
      ``{name: float32 scalar}``, the names of ``prev``.
    """
    empty = empty_window(prev)
    p = {k: jnp.where(new, empty[k], v) for k, v in prev.items()}
    nonfinite = jnp.asarray(nonfinite, bool).reshape(())
    skipped = jnp.asarray(skipped, bool).reshape(())
    w = WINDOW_PREFIX
    out = {f"{w}steps": p[f"{w}steps"] + 1.0,
           f"{w}nonfinite_steps": p[f"{w}nonfinite_steps"] + nonfinite.astype(_F32),
           f"{w}first_nonfinite_ago": _ago(p[f"{w}first_nonfinite_ago"], nonfinite),
           f"{w}skipped_steps": p[f"{w}skipped_steps"] + skipped.astype(_F32),
           f"{w}first_skipped_ago": _ago(p[f"{w}first_skipped_ago"], skipped)}
    for f in WINDOW_FIGURES:
        key = f"{w}{f}"
        if f"{key}.n" in p:
            out.update(_figure(p, values[f], key))
    return out
