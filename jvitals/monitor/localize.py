"""Localization: which candidate metric changed first, from its own history.

A service the monitor calls when an alert opens or escalates (not a rule).
The candidates are the columns of a :class:`~jvitals.monitor.trackers.LayerHistory`
(per-layer and per-group metrics: ``grad/share/layer_3``,
``update/param_ratio/embedding``, ...).

A candidate *departed* when its own recent history changed: a line is
fitted (least squares; to the log of a positive figure) to its samples in
the ``localize_reference`` steps before the lookback window ``[onset -
localize_lookback, now]`` (at least 3 samples, none from before the
baselines' start: the warm-up's dynamics are not a reference); the slope is kept only when significant (``|b|
sqrt(S_uu) / sigma > 3``), else the reference is its mean level. A window
sample is off when::

    |x - prediction| > max(localize_z * sigma * sqrt(1 + 1/n + (u - u_mean)^2 / S_uu),
                           localize_min_ratio * |prediction|,     (log space: log1p(min_ratio))
                           localize_drift_slack * |b| * (u - u_last))

(``sigma``: 1.4826 x the median absolute residual, ``n`` the reference
samples; the root is the least-squares prediction interval; the last term
lets the extrapolated drift stop or run twice as fast, ``u_last`` the last
reference sample: a decelerating drift overshoots its line, and that is no
departure). The latest
sample must be off, on the side it moved to from the reference's level
(a drift that merely stopped is no departure); the departure is the first
sample of that final run of off samples. So a metric drifting as it did
before (growth the line extrapolates) has no departure, however far it is
from a baseline frozen at the start, and a change older than the window is
not named. Non-finite samples count as off. Times are model time (after a
rollback the abandoned steps do not count).

Entries are ranked by departure step, then by size (``|x - prediction| /
band`` of the latest sample); for a group's own alert (the router, a group
band, logits), that group's members first. An alert whose candidates departed only after
its onset (or none did) has "no earlier sign found" (:func:`lead_phrase`).
"""

from __future__ import annotations

import math

import numpy as np

from jvitals.monitor.policy import Policy
from jvitals.monitor.trackers import LayerHistory
from jvitals.monitor.types import Localization, split_group

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


def group_of(name: str) -> str | None:
    """The candidate group of a metric name: ``"router"`` (``moe/*``), ``"embedding"``,
    ``"lm_head"``, ``"layer_{i}"``, or None (a global figure)."""
    if name.startswith("moe/"):
        return "router"
    sg = split_group(name)
    return sg[1] if sg else None


def localize(hist: LayerHistory, onset: int, event: str, p: Policy, exclude: str = "",
             t_onset: int | None = None, start: int | None = None,
             group: str | None = None) -> list[Localization]:
    """Ranks the candidates of ``hist`` that departed (see the module doc).

    Vectorized over the candidate columns (one least-squares fit each).

    Args:
      hist: the candidate history.
      onset: the alert's onset step (leads are measured to it).
      event: the phrase ending each line, e.g. ``"grad/global_norm crossed 2x"``.
      p: the policy (``localize_*`` fields).
      exclude: a metric name left out.
      t_onset: the onset in model time (``None``: ``onset``); the windows are
        in model time, so after a rollback the abandoned steps do not count.
      start: the baselines' start (model time): reference samples from before
        it (the warm-up's dynamics) are not used.
      group: the alert's own group (:func:`group_of` of its metric): its
        members that departed rank first (a router alert names the router's
        figures before a gradient that moved with them), then the others.

    Returns:
      Up to ``localize_top`` :class:`Localization` entries, earliest
      departure first.
    """
    steps, ts, data = hist.chrono()
    if not len(steps) or not data.shape[1]:
        return []
    lo = (onset if t_onset is None else t_onset) - p.localize_lookback
    ref_lo = max(lo - p.localize_reference, -math.inf if start is None else start)
    wr = ts >= lo
    rr = (ts >= ref_lo) & ~wr
    if not wr.any() or not rr.any():
        return []
    W, R = data[wr], data[rr]
    uw, ur = ts[wr].astype(np.float64), ts[rr].astype(np.float64)
    with np.errstate(invalid="ignore"):
        finite_r = np.isfinite(R)
        n = finite_r.sum(axis=0)
        valid_w = ~np.isnan(W)
        has_w = valid_w.any(axis=0)
        # Positive figures (norms, ratios, shares) are judged in log space: a decay
        # extrapolates as a decay, never below 0, and the band is relative.
        logs = (np.where(finite_r, R > 0, True).all(axis=0)
                & np.where(valid_w & np.isfinite(W), W > 0, True).all(axis=0))
        cand = np.flatnonzero((n >= 3) & has_w)
        if exclude in hist.index:
            cand = cand[cand != hist.index[exclude]]
        if not cand.size:
            return []
        R, W, finite_r, valid_w, logs, n = (R[:, cand], W[:, cand], finite_r[:, cand],
                                            valid_w[:, cand], logs[cand], n[cand])
        Rt = np.where(finite_r, np.where(logs, np.log(np.where(R > 0, R, 1.0)), R), np.nan)
        Wt = np.where(np.isfinite(W), np.where(logs, np.log(np.where(W > 0, W, 1.0)), W),
                      np.where(valid_w, np.inf, np.nan))
        uu = np.where(finite_r, ur[:, None], np.nan)
        um = np.nanmean(uu, axis=0)
        xm = np.nanmean(Rt, axis=0)
        du = uu - um
        suu = np.nansum(du * du, axis=0)
        b = np.where(suu > 0, np.nansum(du * (Rt - xm), axis=0) / np.where(suu > 0, suu, 1.0), 0.0)
        floor = 1e-12 * np.maximum(np.abs(xm), 1.0)
        sig = np.maximum(1.4826 * np.nanmedian(np.abs(Rt - (xm + b * du)), axis=0), floor)
        flat = ~(np.abs(b) * np.sqrt(suu) >= _SLOPE_T * sig)  # no significant drift: a level
        b = np.where(flat, 0.0, b)
        suu = np.where(flat, 0.0, suu)
        sig = np.where(flat, np.maximum(1.4826 * np.nanmedian(np.abs(Rt - xm), axis=0), floor), sig)
        dw = uw[:, None] - um
        pred = xm + b * dw
        psd = sig * np.sqrt(1.0 + 1.0 / n + np.where(suu > 0, dw * dw / np.where(suu > 0, suu, 1.0),
                                                      0.0))
        rel = np.where(logs, math.log1p(p.localize_min_ratio), p.localize_min_ratio * np.abs(pred))
        # The drift the line extrapolates may stop or run twice as fast (a decelerating
        # drift overshoots its line): only a change beyond that is a departure.
        u_end = np.nanmax(uu, axis=0)
        slack = p.localize_drift_slack * np.abs(b) * np.maximum(uw[:, None] - u_end, 0.0)
        band = np.maximum(np.maximum(p.localize_z * psd, rel), slack)
        dev = Wt - pred
        rows = np.arange(len(uw))[:, None]
        last = np.where(valid_w, rows, -1).max(axis=0)
        col = np.arange(len(cand))
        dl, bl = dev[last, col], band[last, col]
        sign = np.where(dl > 0, 1.0, -1.0)
        ok = (np.abs(dl) > bl) & ((Wt[last, col] - xm) * sign > 0)  # moved away from the reference
        out = dev * sign > band
        back = np.where(valid_w & ~out, rows, -1).max(axis=0)
        first = np.where(valid_w & (rows > back), rows, len(uw)).min(axis=0)
    entries = []
    wsteps = steps[wr]
    for j in np.flatnonzero(ok):
        k = int(first[j])
        c = cand[j]
        before = float(np.exp(pred[k, j]) if logs[j] else pred[k, j])
        size = float(abs(dl[j]) / bl[j]) if bl[j] > 0 else math.inf
        name = hist.names[c]
        own = group is not None and group_of(name) == group
        entries.append((not own, int(wsteps[k]), -size, name, before, float(W[last[j], j])))
    entries.sort()
    res = []
    for _, dep_s, _, name, before, vj in entries[: p.localize_top]:
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
