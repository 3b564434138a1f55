"""The README loop's view of a recorded stream: what the host reads at each check once the
light step carries its windows and its free per-group figures (issue 35).

The corpus streams (``tests/data/corpus``, ``tests/data/streams``) hold every step's light
figures (the loss and the recorder's light family) and the heavy family every 50 steps.
From them this module rebuilds, with NumPy, what the device would hand the host at a check
every ``cadence`` steps:

- the step's own light figures (as :func:`fault_suite.replay` gives them);
- the **window** over the steps since the previous check, as
  :mod:`jvitals.metrics.window` keeps it on the device: for ``loss``,
  ``grad/global_norm`` (before and after the clip) and ``update/param_ratio`` the max, min, mean, std of the finite
  values and how many updates before the check the max was (``window/{f}.max_ago``); the
  number of updates (``window/steps``), of updates with a non-finite loss or gradient
  (``window/nonfinite_steps``) and how long ago the first was
  (``window/first_nonfinite_ago``, -1: none). Skips: the corpus trainers' fp16 loss-scale
  skip reverts the whole optimizer state, the recorder's window with it, so no skip reaches
  a window here (``opt/skipped_steps`` stays the trainer's own figure, as recorded);
- the **free per-group figures** (per-layer and per-group gradient, parameter and update
  norms, shares and update/param ratios: from the per-leaf sums the light step computes
  anyway) at every check where the stream has them, i.e. every 50 steps as recorded (at a
  cadence of 50 that is every check; at 10, a conservative subset of what the loop sees),
  and the output logits' figures ``jvitals.cross_entropy`` takes from the loss's pass
  (``act/output_layer_logits_rms.avg``, ``_abs.max``, ``act/output_layer_logsumexp.*``)
  and the largest attention logit the README's Linen loop reads every step
  (``act/attn_logits_abs.max`` and per layer) at the same steps.
  A scan-stacked model's per-layer *gradient* figures are kept on the heavy cadence here
  (the light step has them, per slice, at +0.8% of that step's bytes: the replay stays
  on the conservative side, as it was scored);
- the rest of the heavy family (per-role gradient figures, activations, the optimizer's
  statistics, ``val/loss``) only at multiples of ``heavy_every``;
- ``update/rms``, the light step's per-element RMS of the update, from ``update/global_norm``
  and the stream's parameter count (streams recorded before the recorder had it).

Pure NumPy: the scorer and its tests need no JAX.
"""

from __future__ import annotations

import re
from typing import Iterator

import numpy as np

import fault_suite as fs

WINDOW_FIGURES = ("loss", "grad/global_norm", "grad/global_norm_post_clip", "update/param_ratio")
"""The figures the recorder's window keeps (``jvitals.metrics.window.WINDOW_FIGURES``)."""

_FREE = re.compile(r"^(grad/norm|grad/share|param/norm|update/param_ratio)/(layer_\d+|embedding|lm_head)$"
                   r"|^act/output_layer_(logits_rms\.avg|logits_abs\.max|logsumexp\.mean|logsumexp\.max)$"
                   r"|^act/attn_logits_abs\.max(/layer_\d+)?$")
_LAYER_GRAD = re.compile(r"^grad/(norm|share)/layer_\d+$")


def stacked(stream: fs.Stream) -> bool:
    """Whether the stream's model stacks its layers (``nn.scan``): its per-layer gradient
    figures then stay on the heavy cadence in this replay (the module docstring)."""
    cfg = stream.meta.get("model_config") or {}
    return bool(cfg.get("scan_layers"))


def is_free(name: str, is_stacked: bool) -> bool:
    """Whether ``name`` rides on every light step (from the per-leaf sums it computes anyway,
    or from the loss's pass over the logits)."""
    if not _FREE.match(name):
        return False
    return not (is_stacked and _LAYER_GRAD.match(name))


def thin(stream: fs.Stream, heavy_every: int) -> fs.Stream:
    """``stream`` as the README loop records it: every-step figures and the free per-group
    figures as recorded; the rest of the heavy family only at multiples of ``heavy_every``
    (0: as recorded)."""
    if not heavy_every:
        return stream
    every = int(stream.meta.get("layers_every", 50))
    st = stacked(stream)
    series = {}
    for n, (idx, v) in stream.series.items():
        heavy = len(idx) <= stream.steps // every + 1 and np.all(idx % every == 0)
        keep = idx % heavy_every == 0 if heavy and not is_free(n, st) else np.ones(len(idx), bool)
        series[n] = (idx[keep], v[keep])
    return fs.Stream(meta=stream.meta, steps=stream.steps, series=series)


def _nonfinite(stream: fs.Stream) -> np.ndarray:
    """Per step: the loss or the gradient norm non-finite, or a non-finite gradient element."""
    bad = np.zeros(stream.steps, bool)
    for n in ("loss", "grad/global_norm"):
        if n in stream.series:
            x = stream.dense(n)
            idx = stream.series[n][0]
            bad[idx] |= ~np.isfinite(x[idx])
    if "grad/nonfinite_count" in stream.series:
        idx, v = stream.series["grad/nonfinite_count"]
        bad[idx] |= v > 0
    return bad


def window(dense: dict[str, np.ndarray], bad: np.ndarray, a: int, b: int) -> dict[str, float]:
    """The window over steps ``a..b`` (inclusive), as the device keeps it (NumPy)."""
    out: dict[str, float] = {"window/steps": float(b - a + 1)}
    for f, x in dense.items():
        w = x[a:b + 1]
        ok = np.isfinite(w)
        if not ok.any():
            continue
        v = w[ok]
        at = np.flatnonzero(ok)[int(np.argmax(v))]
        out |= {f"window/{f}.max": float(v.max()), f"window/{f}.min": float(v.min()),
                f"window/{f}.mean": float(v.mean()), f"window/{f}.std": float(v.std()),
                f"window/{f}.max_ago": float(b - a - at), f"window/{f}.n": float(len(v))}
    nb = bad[a:b + 1]
    out["window/nonfinite_steps"] = float(nb.sum())
    out["window/first_nonfinite_ago"] = float(b - a - int(np.argmax(nb))) if nb.any() else -1.0
    return out


def n_params(stream: fs.Stream) -> int | None:
    """The stream's parameter count (its generator's facts), if recorded."""
    n = (stream.meta.get("facts") or {}).get("n_params") or stream.meta.get("n_params")
    return int(n) if n else None


def replay(stream: fs.Stream, cadence: int = 50) -> Iterator[tuple[int, dict[str, float]]]:
    """:func:`fault_suite.replay`'s checks, each with the window since the previous one, and the
    light step's ``update/rms`` (``update/global_norm / sqrt(parameter count)``, the recorder's
    own arithmetic) where the stream records its parameter count."""
    dense = {f: stream.dense(f) for f in WINDOW_FIGURES if f in stream.series}
    bad = _nonfinite(stream)
    n = n_params(stream)
    prev = -1
    for s, m in fs.replay(stream, cadence):
        out = {**m, **window(dense, bad, prev + 1, s)}
        if n and "update/global_norm" in m and "update/rms" not in m:
            out["update/rms"] = float(m["update/global_norm"]) / float(np.sqrt(n))
        yield s, out
        prev = s
