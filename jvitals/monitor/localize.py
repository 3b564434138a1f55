"""Localization: which candidate metric changed first, from its own history.

A service the monitor calls when an alert opens or escalates (not a rule). A candidate
(a column of a :class:`LayerHistory`: ``grad/share/layer_3``, ...) *departed* when its
recent samples leave the prediction interval of a robust line fitted to its own reference
window before the onset, so a metric drifting as it did before has no departure and the
earliest real change is named first; none before the onset reads "no earlier sign found".
The formula and the ranking: docs/MONITOR.md, "Localization: the earliest sign".
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from jvitals.monitor.policy import Policy
from jvitals.monitor.trackers_history import LayerHistory
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

    Vectorized over the candidate columns (one least-squares fit each), in steps:
    the window and the reference samples (:func:`_windows`), the candidates with
    enough of them (:func:`_candidates`), the reference line of each
    (:func:`_fit_reference`), the band around its extrapolation (:func:`_band`),
    the departures (:func:`_departures`), and the ranked sentences (:func:`_rank`,
    :func:`_entry`).

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
    sel = _windows(ts, onset if t_onset is None else t_onset, p, start)
    if sel is None:
        return []
    wr, rr = sel
    W, R = data[wr], data[rr]
    uw, ur = ts[wr].astype(np.float64), ts[rr].astype(np.float64)
    cand, logs = _candidates(R, W, hist.index[exclude] if exclude in hist.index else None)
    if not cand.size:
        return []
    R, W = R[:, cand], W[:, cand]
    with np.errstate(invalid="ignore"):
        Rt, Wt = _fit_space(R, logs), _fit_space(W, logs, window=True)
        fit = _fit_reference(Rt, ur)
        pred, band = _band(fit, uw, logs, p)
        ok, first, last = _departures(Wt, pred, band, fit.level)
        col = np.arange(len(cand))
        dl, bl = (Wt - pred)[last, col], band[last, col]
    wsteps = steps[wr]
    departed = [(hist.names[cand[j]], int(wsteps[first[j]]),
                 float(abs(dl[j]) / bl[j]) if bl[j] > 0 else math.inf, j) for j in np.flatnonzero(ok)]
    res = []
    for name, dep_s, _, j in _rank(departed, group)[: p.localize.top]:
        k = int(first[j])
        before = float(np.exp(pred[k, j]) if logs[j] else pred[k, j])
        res.append(_entry(name, dep_s, before, float(W[last[j], j]), onset, event))
    return res


class _Fit(NamedTuple):
    """The reference line of each candidate (in fit space; see :func:`_fit_reference`)."""

    n: np.ndarray       # finite reference samples
    u_mean: np.ndarray  # their mean time
    level: np.ndarray   # their mean value: the line's value at u_mean
    slope: np.ndarray   # 0 where the slope is not significant
    suu: np.ndarray     # sum of (u - u_mean)^2 (0 with no slope: a level)
    sigma: np.ndarray   # 1.4826 x the median absolute residual (floored)
    u_last: np.ndarray  # the last reference sample's time


def _windows(ts: np.ndarray, t_onset: int, p: Policy,
             start: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """``(window rows, reference rows)`` of the history's model times ``ts``.

    The window is ``[t_onset - localize_lookback, now]``; the reference the
    ``localize_reference`` steps before it, none before ``start`` (the warm-up's
    dynamics are not a reference). None when either is empty.
    """
    lo = t_onset - p.localize.lookback
    ref_lo = max(lo - p.localize.reference, -math.inf if start is None else start)
    wr = ts >= lo
    rr = (ts >= ref_lo) & ~wr
    if not wr.any() or not rr.any():
        return None
    return wr, rr


def _candidates(R: np.ndarray, W: np.ndarray, excluded: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(columns, log space)``: the columns with at least 3 finite reference samples
    and a window sample (``excluded`` left out), and for each whether it is judged in
    log space (every finite sample positive: norms, ratios, shares; a decay then
    extrapolates as a decay, never below 0, and the band is relative)."""
    with np.errstate(invalid="ignore"):
        finite_r = np.isfinite(R)
        valid_w = ~np.isnan(W)
        logs = (np.where(finite_r, R > 0, True).all(axis=0)
                & np.where(valid_w & np.isfinite(W), W > 0, True).all(axis=0))
        cand = np.flatnonzero((finite_r.sum(axis=0) >= 3) & valid_w.any(axis=0))
    if excluded is not None:
        cand = cand[cand != excluded]
    return cand, logs[cand]


def _fit_space(X: np.ndarray, logs: np.ndarray, window: bool = False) -> np.ndarray:
    """``X`` where it is fitted: the log of log-space columns. A non-finite reference
    sample is left out (NaN); a non-finite window sample counts as off (+inf), a
    missing one (NaN) stays missing."""
    with np.errstate(invalid="ignore"):
        fx = np.where(logs, np.log(np.where(X > 0, X, 1.0)), X)
        return np.where(np.isfinite(X), fx, np.where(window & ~np.isnan(X), np.inf, np.nan))


def _fit_reference(Rt: np.ndarray, ur: np.ndarray) -> _Fit:
    """The least-squares line of each column's reference samples ``Rt`` at times ``ur``.

    The slope is kept only when significant (``|b| sqrt(S_uu) / sigma >= 3``);
    otherwise the reference is the mean level and ``sigma`` the median absolute
    deviation from it.
    """
    with np.errstate(invalid="ignore"):
        finite_r = ~np.isnan(Rt)
        n = finite_r.sum(axis=0)
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
        return _Fit(n, um, xm, b, suu, sig, np.nanmax(uu, axis=0))


def _band(fit: _Fit, uw: np.ndarray, logs: np.ndarray, p: Policy) -> tuple[np.ndarray, np.ndarray]:
    """``(prediction, band)`` at the window's times ``uw`` (rows) for each column.

    The band is the widest of ``localize_z`` x the least-squares prediction
    interval, ``localize_min_ratio`` of the prediction (``log1p`` of it in log
    space), and ``localize_drift_slack`` x the drift since the last reference sample
    (the extrapolated drift may stop or run twice as fast: a decelerating drift
    overshoots its line, and that is no departure).
    """
    with np.errstate(invalid="ignore"):
        dw = uw[:, None] - fit.u_mean
        pred = fit.level + fit.slope * dw
        psd = fit.sigma * np.sqrt(1.0 + 1.0 / fit.n + np.where(
            fit.suu > 0, dw * dw / np.where(fit.suu > 0, fit.suu, 1.0), 0.0))
        rel = np.where(logs, math.log1p(p.localize.min_ratio), p.localize.min_ratio * np.abs(pred))
        slack = p.localize.drift_slack * np.abs(fit.slope) * np.maximum(uw[:, None] - fit.u_last, 0.0)
        return pred, np.maximum(np.maximum(p.localize.z * psd, rel), slack)


def _departures(Wt: np.ndarray, pred: np.ndarray, band: np.ndarray,
                level: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(departed, first row, last row)`` of each column of the window ``Wt``.

    A column departed when its latest sample is off the band, on the side it moved
    to from the reference's ``level`` (a drift that merely stopped is no departure);
    the departure is the first sample of that final run of off samples (on that
    side). Missing samples (NaN) are skipped; the last row is the latest sample.
    """
    with np.errstate(invalid="ignore"):
        valid_w = ~np.isnan(Wt)
        dev = Wt - pred
        rows = np.arange(len(Wt))[:, None]
        last = np.where(valid_w, rows, -1).max(axis=0)
        col = np.arange(Wt.shape[1])
        dl, bl = dev[last, col], band[last, col]
        sign = np.where(dl > 0, 1.0, -1.0)
        ok = (np.abs(dl) > bl) & ((Wt[last, col] - level) * sign > 0)  # moved away from the reference
        out = dev * sign > band
        back = np.where(valid_w & ~out, rows, -1).max(axis=0)
        first = np.where(valid_w & (rows > back), rows, len(Wt)).min(axis=0)
    return ok, first, last


def _rank(departed: list[tuple[str, int, float, Any]], group: str | None) -> list[tuple[str, int, float, Any]]:
    """The departed candidates ``(name, departure step, size, ...)`` ranked: the alert's
    own ``group`` first (:func:`group_of`), then the earliest departure, then the larger
    (``size``: the latest sample's distance from the prediction, in bands), then by name."""
    own = [group is not None and group_of(d[0]) == group for d in departed]
    order = sorted(range(len(departed)), key=lambda i: (not own[i], departed[i][1], -departed[i][2],
                                                        departed[i][0]))
    return [departed[i] for i in order]


def _entry(name: str, dep_s: int, before: float, vj: float, onset: int, event: str) -> Localization:
    """One :class:`Localization`: departed at step ``dep_s`` from the prediction
    ``before`` to the latest value ``vj``, with its sentence."""
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
    return Localization(name, dep_s, before, vj, ratio, lead, line)


def lead_phrase(loc: list[Localization], lookback: int) -> str:
    """The message's lead sentence: the earliest departure, or "no earlier
    sign found" when no candidate departed before the onset."""
    if loc and loc[0].lead_steps >= 0:
        return f" Lead: {loc[0].line}."
    tail = f" First change: {loc[0].line}." if loc else ""
    return (f" Lead: {NO_EARLIER_SIGN} (no per-group metric changed within {lookback} steps "
            f"before the onset).{tail}")
