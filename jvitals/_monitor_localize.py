"""Localization: which candidate metric changed first, from its own history.

A service the monitor calls when an alert opens or escalates (not a rule).
The candidates are the columns of a :class:`~jvitals._monitor_trackers.LayerHistory`
(per-layer and per-group metrics: ``grad/share/layer_3``,
``update/param_ratio/embedding``, ...).

A candidate *departed* when its own recent history changed: a line is
fitted (least squares) to its samples in the ``localize_reference`` steps
before the lookback window ``[onset - localize_lookback, now]`` (at least
its last 3 samples); the slope is kept only when significant (``|b|
sqrt(S_uu) / sigma > 3``), else the reference is its mean level. A window
sample is off when::

    |x - prediction| > max(localize_z * sigma * sqrt(1 + 1/n + (u - u_mean)^2 / S_uu),
                           localize_min_ratio * |prediction|)

(``sigma``: 1.4826 x the median absolute residual, ``n`` the reference
samples; the root is the least-squares prediction interval). The latest
sample must be off, on the side it moved to from the reference's level
(a drift that merely stopped is no departure); the departure is the first
sample of that final run of off samples. So a metric drifting as it did
before (growth the line extrapolates) has no departure, however far it is
from a baseline frozen at the start, and a change older than the window is
not named. Non-finite samples count as off. Times are model time (after a
rollback the abandoned steps do not count).

Entries are ranked by departure step, then by size (``|x - prediction| /
band`` of the latest sample). An alert whose candidates departed only after
its onset (or none did) has "no earlier sign found" (:func:`lead_phrase`).
"""

from __future__ import annotations

import math

import numpy as np

from jvitals._monitor_policy import Policy
from jvitals._monitor_trackers import LayerHistory
from jvitals._monitor_types import Localization

__all__ = ["NO_EARLIER_SIGN", "lead_phrase", "localize"]

NO_EARLIER_SIGN = "no earlier sign found"
_SLOPE_T = 3.0  # a reference slope counts (is extrapolated) when |b| / se(b) > this


def _fmt(name: str, x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if "share" in name or "fraction" in name:
        pct = 100.0 * x
        if abs(pct) >= 10:
            return f"{pct:.0f}%"
        return f"{pct:.1f}".rstrip("0").rstrip(".") + "%"
    return f"{x:.4g}"


def _departure(u: np.ndarray, x: np.ndarray, lo: float, p: Policy) -> tuple[int, float, float] | None:
    """(index of the departure sample, prediction there, size) of one
    column's samples ``x`` (finite or inf) at model times ``u``, or None."""
    finite = np.isfinite(x)
    ref = np.flatnonzero((u < lo) & finite)
    ref = ref[max(0, min(len(ref) - 3, int(np.searchsorted(u[ref], lo - p.localize_reference)))):]
    m = len(ref)
    win = np.flatnonzero(u >= lo)
    if m < 3 or not len(win):
        return None
    ur, xr = u[ref], x[ref]
    um, xm = ur.mean(), xr.mean()
    suu = float(((ur - um) ** 2).sum())
    b = float(((ur - um) * (xr - xm)).sum() / suu) if suu > 0 else 0.0
    floor = 1e-12 * max(abs(xm), 1.0)
    sigma = max(1.4826 * float(np.median(np.abs(xr - (xm + b * (ur - um))))), floor)
    if suu > 0 and abs(b) * math.sqrt(suu) < _SLOPE_T * sigma:
        b, suu = 0.0, 0.0  # no significant drift: the reference is a level
        sigma = max(1.4826 * float(np.median(np.abs(xr - xm))), floor)
    uw = u[win]
    pred = xm + b * (uw - um)
    psd = sigma * np.sqrt(1.0 + 1.0 / m + ((uw - um) ** 2 / suu if suu > 0 else 0.0))
    band = np.maximum(p.localize_z * psd, p.localize_min_ratio * np.abs(pred))
    with np.errstate(invalid="ignore"):
        dev = x[win] - pred
    last = dev[-1]
    if not abs(last) > band[-1]:
        return None
    sign = 1.0 if last > 0 else -1.0
    if (x[win][-1] - xm) * sign <= 0:
        return None  # a drift that slowed or stopped, not a move away from the reference
    out = dev * sign > band
    back = np.flatnonzero(~out)
    k = int(back[-1]) + 1 if len(back) else 0
    size = float(abs(last) / band[-1]) if band[-1] > 0 else math.inf
    return int(win[k]), float(pred[k]), size


def localize(hist: LayerHistory, onset: int, event: str, p: Policy, exclude: str = "",
             t_onset: int | None = None) -> list[Localization]:
    """Ranks the candidates of ``hist`` that departed (see the module doc).

    Args:
      hist: the candidate history.
      onset: the alert's onset step (leads are measured to it).
      event: the phrase ending each line, e.g. ``"grad/global_norm crossed 2x"``.
      p: the policy (``localize_*`` fields).
      exclude: a metric name left out.
      t_onset: the onset in model time (``None``: ``onset``); the windows are
        in model time, so after a rollback the abandoned steps do not count.

    Returns:
      Up to ``localize_top`` :class:`Localization` entries, earliest
      departure first.
    """
    steps, ts, data = hist.chrono()
    if not len(steps) or not data.shape[1]:
        return []
    lo = (onset if t_onset is None else t_onset) - p.localize_lookback
    if not (ts >= lo).any():
        return []
    valid = ~np.isnan(data)
    win = ts >= lo
    has_win = (valid & win[:, None]).any(axis=0)
    last_i = len(steps) - 1 - np.argmax(valid[::-1], axis=0)
    latest = data[last_i, np.arange(data.shape[1])]
    # Prefilter: the latest value moved by localize_min_ratio of the level the
    # window opened at (or went non-finite).
    first_i = np.argmax(valid & win[:, None], axis=0)
    opening = data[first_i, np.arange(data.shape[1])]
    with np.errstate(invalid="ignore"):
        moved = ~np.isfinite(latest) | (np.abs(latest - opening) > p.localize_min_ratio * np.abs(opening))
    cand = np.flatnonzero(has_win & moved)
    entries = []
    u_all = ts.astype(np.float64)
    for c in cand:
        name = hist.names[c]
        if name == exclude:
            continue
        ok = valid[:, c]
        got = _departure(u_all[ok], data[ok, c], lo, p)
        if got is None:
            continue
        k, pred, size = got
        entries.append((int(steps[ok][k]), -size, name, pred, float(data[ok, c][-1])))
    entries.sort()
    res = []
    for dep_s, _, name, before, vj in entries[: p.localize_top]:
        lead = onset - dep_s
        when = (f"{lead} steps before" if lead > 0 else f"{-lead} steps after" if lead < 0
                else "at the step")
        if math.isfinite(vj):
            verb = "rose" if vj > before else "fell"
            line = (f"{name} {verb} from {_fmt(name, before)} to {_fmt(name, vj)} starting at "
                    f"step {dep_s}, {when} {event}")
        else:
            line = (f"{name} went non-finite (was {_fmt(name, before)}) starting at step "
                    f"{dep_s}, {when} {event}")
        ratio = vj / before if before != 0 else math.inf
        res.append(Localization(name, dep_s, before, vj, ratio, lead, line))
    return res


def lead_phrase(loc: list[Localization], lookback: int) -> str:
    """The message's lead sentence: the earliest departure, or "no earlier
    sign found" when no candidate departed before the onset."""
    if loc and loc[0].lead_steps >= 0:
        return f" Lead: {loc[0].line}."
    tail = f" First change: {loc[0].line}." if loc else ""
    return (f" Lead: {NO_EARLIER_SIGN} (no per-group metric changed within {lookback} steps "
            f"before the onset).{tail}")
