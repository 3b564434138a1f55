"""The training guide's check-up table (``seeds/003``, §6.2) for a run's phase.

Phase rule (:func:`run_phase`), from the guide's check-up table: *start-up* is
steps 0-1000; *middle* is from step 1000 to the middle of training; *late* is
the second half of training. With ``total_steps`` (the planned length, from
``--total-steps`` or a logged hparam ``total_steps``/``num_steps``/
``num_train_steps``/``train_steps``) a run whose last logged step is past
``total_steps / 2`` is *late*; without it, a run past step 1000 is *middle*
(its length so far is all we know). ``--phase`` overrides the rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np

from jvitals.report.writers import (
    EVENTS_TAG,
)
from jvitals.report.run import Run
from jvitals.report.plots import share_matrix

__all__ = [
    "CheckItem",
    "checkup",
    "PHASES",
    "run_phase",
]


PHASES = ("start-up", "middle", "late")
STARTUP_END = 1000  # the guide: start-up is steps 0-1000.
_TOTAL_STEP_HPARAMS = ("total_steps", "num_steps", "num_train_steps", "train_steps", "steps")

PASSED, FAILED, NOT_MEASURED = "PASSED", "FAILED", "NOT MEASURED"


@dataclasses.dataclass(frozen=True)
class CheckItem:
    """One line of the guide's check-up table, decided from the logged figures.

    Attributes:
        phase: ``"start-up"``, ``"middle"`` or ``"late"``.
        text: the checklist item (English; ``source`` holds the guide's wording).
        status: ``"PASSED"``, ``"FAILED"`` or ``"NOT MEASURED"``.
        figure: the figure that decided it, e.g. ``"last/second quarter median
            ratio 1.05 (limit 2)"``, or why it could not be measured.
        metrics: the tags it read.
        window: ``(first, last)`` step of the window it was judged over.
        source: the guide's original wording (Chinese).
    """

    phase: str
    text: str
    status: str
    figure: str
    metrics: tuple[str, ...]
    window: tuple[int, int]
    source: str


def planned_total_steps(run: Run, total_steps: int | None) -> int | None:
    if total_steps:
        return int(total_steps)
    for k in _TOTAL_STEP_HPARAMS:
        v = run.hparams.get(k)
        if isinstance(v, (int, float)) and v > 0:
            return int(v)
    return None


def run_phase(run: Run, total_steps: int | None = None) -> str:
    """The run's phase by the guide's boundaries (see the module docstring).

    ``last_step <= 1000``: start-up; else, with the planned ``total_steps``
    (argument or logged hparam), late once ``last_step > total_steps / 2``;
    otherwise middle.
    """
    last = run.last_step or 0
    if last <= STARTUP_END:
        return "start-up"
    total = planned_total_steps(run, total_steps)
    if total is not None and last > total / 2:
        return "late"
    return "middle"


def _phase_window(run: Run, phase: str, total: int | None) -> tuple[int, int]:
    first, last = run.first_step or 0, run.last_step or 0
    if phase == "start-up":
        return first, min(last, STARTUP_END)
    mid = (total if total is not None else last) / 2
    if phase == "middle":
        lo = STARTUP_END if last > STARTUP_END else first
        hi = last if total is None else int(min(last, max(mid, lo)))
        return lo, hi
    return int(mid if mid < last else last / 2), last


def _window(run: Run, tag: str, win: tuple[int, int], finite: bool = True):
    s = run.series(tag)
    if s is None:
        return None
    steps, vals = s
    m = (steps >= win[0]) & (steps <= win[1])
    if finite:
        m &= np.isfinite(vals)
    return steps[m], vals[m]


def _quarters(vals: np.ndarray) -> list[float]:
    parts = np.array_split(vals, 4)
    return [float(np.median(p)) for p in parts]


def fmt(x: float) -> str:
    if x is None or not np.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


_MIN_POINTS = 8


def _first_tag(run: Run, tags: Iterable[str]) -> str | None:
    return next((t for t in tags if t in run.scalars), None)


def _check_grad_stable(run, win):
    tag = "grad/global_norm"
    w = _window(run, tag, win)
    if w is None or len(w[1]) < _MIN_POINTS:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} finite points of {tag} in the window", (tag,)
    q = _quarters(w[1])
    ratio = q[3] / q[1] if q[1] > 0 else math.inf
    status = PASSED if ratio <= 2 else FAILED
    return status, (f"median of the last quarter / second quarter = {fmt(ratio)} (limit 2, the "
                    f"yellow factor); {fmt(q[0])} -> {fmt(q[3])}"), (tag,)


def _check_loss_falls(run, win):
    tag = "loss"
    w = _window(run, tag, win)
    if w is None or len(w[1]) < _MIN_POINTS:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} finite points of {tag} in the window", (tag,)
    q = _quarters(w[1])
    change = (q[3] - q[0]) / abs(q[0]) if q[0] else math.nan
    status = PASSED if q[3] < q[0] else FAILED
    return status, (f"median of the first quarter {fmt(q[0])} -> last quarter {fmt(q[3])} "
                    f"({change:+.1%}); no expected rate was logged, so 'falling' is the test"), (tag,)


def _check_nonfinite(run, win):
    tags = [t for t in run.scalars if t in ("loss", "ppl", "grad/global_norm", "grad/global_norm_post_clip",
                                             "param/global_norm", "update/global_norm")
            or t == "grad/nonfinite_count" or t.endswith(".nonfinite") or t.endswith("_nonfinite")]
    if not tags:
        return NOT_MEASURED, "none of loss, grad/global_norm, grad/nonfinite_count logged", ()
    firsts = []
    for t in tags:
        w = _window(run, t, win, finite=False)
        steps, vals = w
        bad = ~np.isfinite(vals)
        if "nonfinite" in t:
            bad |= np.nan_to_num(vals, nan=1.0) > 0
        if bad.any():
            firsts.append((int(steps[bad][0]), t, int(bad.sum())))
    if firsts:
        firsts.sort()
        s, t, n = firsts[0]
        return FAILED, f"first at step {s} in {t} ({n} step(s)); {len(firsts)} tag(s) affected", tuple(tags)
    return PASSED, f"all finite in {len(tags)} tag(s)", tuple(tags)


def _check_activation_range(run, win, limit=1e4):
    tags = [t for t in run.scalars if t.startswith("act/") and ("abs.max" in t or "abs_max" in t)]
    if not tags:
        return NOT_MEASURED, "no act/*_abs.max activation maxima logged", ()
    worst = (-math.inf, "", 0)
    nonfinite = None
    for t in tags:
        steps, vals = _window(run, t, win, finite=False)
        if (~np.isfinite(vals)).any() and nonfinite is None:
            nonfinite = (int(steps[~np.isfinite(vals)][0]), t)
        fin = np.isfinite(vals)
        if fin.any():
            i = int(np.argmax(np.where(fin, np.abs(vals), -np.inf)))
            if abs(vals[i]) > worst[0]:
                worst = (float(abs(vals[i])), t, int(steps[i]))
    if nonfinite:
        return FAILED, f"non-finite at step {nonfinite[0]} in {nonfinite[1]}", tuple(tags)
    if worst[1] == "":
        return NOT_MEASURED, "no activation maxima in the window", tuple(tags)
    status = PASSED if worst[0] <= limit else FAILED
    return status, (f"largest |activation| {fmt(worst[0])} ({worst[1]} at step {worst[2]}); "
                    f"limit {limit:.0e} (the guide's overflow mark)"), tuple(tags)


def _check_throughput(run, win):
    tag = _first_tag(run, ("sys/tokens_per_sec", "sys/steps_per_sec"))
    if tag is None:
        return NOT_MEASURED, "no sys/tokens_per_sec or sys/steps_per_sec logged", ()
    steps, vals = _window(run, tag, win)
    if len(vals) < 4:
        return NOT_MEASURED, f"needs >= 4 finite points of {tag} in the window", (tag,)
    vals = vals[1:]  # the first reading includes compilation
    base = float(np.median(vals[: max(1, len(vals) // 2)]))
    last = float(np.median(vals[-max(1, len(vals) // 4):]))
    ratio = last / base if base > 0 else math.nan
    status = PASSED if ratio >= 0.7 else FAILED
    return status, (f"{tag}: last-quarter median {fmt(last)} = {fmt(ratio)}x its early median "
                    f"{fmt(base)} (fail below 0.7x: the guide's 30% drop); no expected figure was logged"), (tag,)


def _check_grad_with_loss(run, win):
    g, lo = _window(run, "grad/global_norm", win), _window(run, "loss", win)
    if g is None or lo is None or len(g[1]) < _MIN_POINTS or len(lo[1]) < _MIN_POINTS:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} finite points of loss and grad/global_norm", (
                "loss", "grad/global_norm")
    gq, lq = _quarters(g[1]), _quarters(lo[1])
    gr = gq[3] / gq[0] if gq[0] > 0 else math.inf
    lchange = (lq[3] - lq[0]) / abs(lq[0]) if lq[0] else math.nan
    status = FAILED if gr > 1.25 else PASSED
    return status, (f"grad norm x{fmt(gr)} (first -> last quarter median) while loss {lchange:+.1%}; "
                    f"fail if grad norm climbs > 1.25x"), ("loss", "grad/global_norm")


def _check_layer_shares(run, win):
    got = share_matrix(run)
    if got is None:
        return NOT_MEASURED, "no grad/share/layer_* or grad/norm/layer_* logged", ()
    layers, steps, mat, source = got
    m = (steps >= win[0]) & (steps <= win[1])
    mat = mat[:, m]
    cols = np.isfinite(mat).all(axis=0)
    mat = mat[:, cols]
    if mat.shape[1] < 4:
        return NOT_MEASURED, f"needs >= 4 steps with every layer's share in the window ({source})", ()
    k = max(1, mat.shape[1] // 4)
    a, b = np.median(mat[:, :k], axis=1), np.median(mat[:, -k:], axis=1)
    rel = np.maximum(b, a) / np.maximum(np.minimum(a, b), 1e-12)
    moved = (rel > 1.5) & (np.abs(b - a) > 0.02)
    i = int(np.argmax(np.abs(b - a)))
    status = FAILED if moved.any() else PASSED
    return status, (f"largest shift: layer {layers[i]} {a[i]:.1%} -> {b[i]:.1%} (first -> last quarter); "
                    f"fail if a layer's share changes > 1.5x and > 2 points"), ("grad/share/layer_*",)


def _check_val_gap(run, win):
    w = _window(run, "val/gap", win)
    tag = "val/gap"
    if w is None or len(w[1]) == 0:
        v, lo = run.series("val/loss"), run.series("loss")
        if v is None or lo is None:
            return NOT_MEASURED, "neither val/gap nor val/loss with loss logged", ("val/gap",)
        vs, vv = _window(run, "val/loss", win)
        ls, lv = run.series("loss")
        ok = np.isfinite(lv)
        gap = vv - np.interp(vs, ls[ok], lv[ok]) if ok.any() else vv * np.nan
        w, tag = (vs, gap), "val/loss - loss"
    steps, gap = w
    if len(gap) < 3:
        return NOT_MEASURED, f"needs >= 3 validation points in the window (got {len(gap)})", ("val/gap",)
    span = min(1000, (steps[-1] - steps[0]) / 2)
    end = steps[-1]
    g = lambda s: float(np.interp(s, steps, gap))  # noqa: E731
    recent, before = g(end) - g(end - span), g(end - span) - g(end - 2 * span)
    bad = recent > 0 and recent > 1.5 * max(before, 0)
    status = FAILED if bad else PASSED
    return status, (f"{tag} grew {fmt(recent)} over the last {int(span)} steps vs {fmt(before)} over the "
                    f"{int(span)} before (fail if > 1.5x and growing); now {fmt(gap[-1])}"), ("val/gap",)


def _spikes(steps, vals, w=10):
    """Simple spike finder: above median(prev w) + max(4 MAD-sigma, 10%); recovered within 5%/2 sigma."""
    out, i = [], w
    while i < len(vals):
        prev = vals[i - w:i]
        trend = float(np.median(prev))
        sigma = 1.4826 * float(np.median(np.abs(prev - trend)))
        if vals[i] > trend + max(4 * sigma, 0.1 * abs(trend)):
            band = trend + max(2 * sigma, 0.05 * abs(trend))
            j = i + 1
            while j < len(vals) and vals[j] > band:
                j += 1
            rec = int(steps[j] - steps[i]) if j < len(vals) else None
            out.append((int(steps[i]), float(vals[i:j].max() / trend) if trend else math.inf, rec,
                        int(steps[-1] - steps[i])))
            i = j + w
        else:
            i += 1
    return out


def _check_spike_recovery(run, win):
    w = _window(run, "loss", win)
    monitor = [a for a in run.alerts if a["rule"] in ("loss_spike", "divergence")
               and win[0] <= a["step"] <= win[1]]
    if (w is None or len(w[1]) < 12) and not monitor:
        return NOT_MEASURED, "needs >= 12 finite loss points in the window (or the monitor's spike alerts)", ("loss",)
    spikes = _spikes(*w) if w is not None and len(w[1]) >= 12 else []
    slow = [s for s in spikes if (s[2] if s[2] is not None else s[3]) > 300]
    parts = []
    if spikes:
        recs = [s[2] for s in spikes if s[2] is not None]
        parts.append(f"{len(spikes)} loss spike(s), slowest recovery "
                     f"{max(recs) if recs else '-'} steps" + (f", {len(spikes) - len(recs)} not recovered"
                                                              if len(recs) < len(spikes) else ""))
    else:
        parts.append("no loss spikes found")
    if monitor:
        parts.append(f"monitor: {len(monitor)} spike/divergence alert(s)")
    status = FAILED if slow or monitor else PASSED
    return status, "; ".join(parts) + " (normal: back within 100-300 steps)", ("loss",)


def _check_param_norm(run, win):
    tag = "param/global_norm"
    s = run.series(tag)
    w = _window(run, tag, win)
    if s is None or w is None or len(w[1]) < 2:
        return NOT_MEASURED, f"needs >= 2 finite points of {tag} in the window", (tag,)
    steps, vals = s
    ok = np.isfinite(vals)
    base_m = ok & (steps <= steps[ok][0] + 500)
    base = float(np.mean(vals[base_m]))
    ratio = float(np.max(w[1]) / base) if base > 0 else math.inf
    jumps = np.abs(np.diff(w[1])) / np.maximum(np.abs(w[1][:-1]), 1e-12)
    jump = float(jumps.max()) if len(jumps) else 0.0
    status = PASSED if ratio <= 1.5 and jump <= 0.1 else FAILED
    return status, (f"max {fmt(ratio)}x the first-500-step baseline {fmt(base)} (limit 1.5x); largest "
                    f"jump between logged points {jump:.1%} (limit 10%)"), (tag,)


def _check_checkpoints(run, win, every=500):
    saves = sorted(e["step"] for e in run.events if e.get("event") == "save")
    if not saves:
        return NOT_MEASURED, "no 'save' events logged in vitals/events_json", (EVENTS_TAG,)
    inwin = [s for s in saves if win[0] <= s <= win[1]]
    pts = [win[0]] + inwin + [win[1]]
    gap = max(b - a for a, b in zip(pts, pts[1:]))
    status = PASSED if gap <= every * 1.1 else FAILED
    return status, (f"{len(inwin)} save(s) in the window; longest stretch without one {gap} steps "
                    f"(expected every {every})"), (EVENTS_TAG,)


def _check_val_rising(run, win):
    tag = "val/loss"
    s = run.series(tag)
    w = _window(run, tag, win)
    if s is None or w is None or len(w[1]) < 2:
        return NOT_MEASURED, f"needs >= 2 finite {tag} points in the window", (tag,)
    steps, vals = s
    ok = np.isfinite(vals) & (steps <= w[0][-1])
    best_i = int(np.argmin(np.where(ok, vals, np.inf)))
    best, now = float(vals[best_i]), float(w[1][-1])
    rise = (now - best) / abs(best) if best else math.nan
    status = FAILED if rise > 0.01 else PASSED
    extra = "; consider stopping early" if status == FAILED else ""
    return status, (f"val loss now {fmt(now)} vs best {fmt(best)} at step {int(steps[best_i])} "
                    f"({rise:+.1%}; fail above +1%){extra}"), (tag,)


def _check_loss_vs_lr(run, win):
    lr = _first_tag(run, ("opt/learning_rate", "learning_rate", "lr", "opt/lr"))
    if lr is None:
        return NOT_MEASURED, "no learning-rate series logged (opt/learning_rate)", ("loss",)
    lo, lw = _window(run, "loss", win), _window(run, lr, win)
    if lo is None or len(lo[1]) < _MIN_POINTS or len(lw[1]) < 2:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} loss points and 2 {lr} points in the window", ("loss", lr)
    q = _quarters(lo[1])
    change = (q[3] - q[0]) / abs(q[0]) if q[0] else math.nan
    lr_change = lw[1][-1] / lw[1][0] if lw[1][0] else math.nan
    status = PASSED if q[3] <= q[0] else FAILED
    return status, (f"loss {change:+.1%} (first -> last quarter median) while {lr} x{fmt(lr_change)}; "
                    f"fail if the loss stopped falling while the LR still drives it"), ("loss", lr)


def _check_loss_scale(run, win):
    tag = "opt/loss_scale"
    w = _window(run, tag, win)
    if w is None or len(w[1]) < 2:
        return NOT_MEASURED, f"{tag} not logged (no dynamic loss scaling)", (tag,)
    vals = w[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        falls = vals[:-1] / vals[1:]
    worst = float(np.nanmax(falls)) if len(falls) else 1.0
    status = FAILED if worst >= 16 else PASSED
    return status, (f"largest one-step fall x{fmt(worst)} (fail at >= 2^4); range {fmt(vals.min())} - "
                    f"{fmt(vals.max())}"), (tag,)


def _check_final_eval(run, win):
    evals = [e for e in run.events if e.get("event") in ("eval", "evaluation", "final_eval")]
    saves = [e["step"] for e in run.events if e.get("event") == "save"]
    if not evals:
        return NOT_MEASURED, "not in the logged figures: run a full evaluation of the final checkpoint", ()
    last_eval = max(e["step"] for e in evals)
    if saves and last_eval < max(saves):
        return FAILED, f"last evaluation at step {last_eval}, before the last save at {max(saves)}", (EVENTS_TAG,)
    return PASSED, f"evaluation logged at step {last_eval}", (EVENTS_TAG,)


# (phase, English item, the guide's wording, check function)
CHECKLIST = (
        ("start-up", "Grad norm settles into a stable range (not diverging)",
         "grad norm是否收敛在一个稳定范围（不是持续发散）", _check_grad_stable),
        ("start-up", "Loss is falling at the expected rate",
         "loss是否在按预期的速度下降", _check_loss_falls),
        ("start-up", "No NaN or Inf at any step",
         "有没有在某个特定step出现NaN或者Inf", _check_nonfinite),
        ("start-up", "Every layer's activation range is within a reasonable interval",
         "各层的激活值范围是否在合理区间", _check_activation_range),
        ("start-up", "Data-loading throughput reaches the expected level",
         "数据加载吞吐是否达到预期", _check_throughput),
        ("middle", "Grad norm falls together with the loss",
         "grad norm是否随loss同步下降", _check_grad_with_loss),
        ("middle", "The layer-wise grad norm distribution stays stable",
         "layer-wise grad norm分布是否保持稳定", _check_layer_shares),
        ("middle", "The train/val gap is within a reasonable range",
         "train/val gap是否在合理范围", _check_val_gap),
        ("middle", "Loss spikes recover at a normal speed",
         "loss spike的恢复速度是否正常", _check_spike_recovery),
        ("middle", "Param norm grows slowly rather than jumping",
         "param norm是否在缓慢增长而不是突变", _check_param_norm),
        ("middle", "Checkpoints are being saved as expected",
         "checkpoints是否按预期保存", _check_checkpoints),
        ("late", "Validation loss has not started to rise (if it has, consider stopping early)",
         "val loss是否已经出现回升（如果是，考虑提前终止）", _check_val_rising),
        ("late", "The loss descent rate matches the learning-rate schedule",
         "loss曲线的下降速率是否与学习率调度匹配", _check_loss_vs_lr),
        ("late", "The loss scale is stable",
         "loss scale是否稳定", _check_loss_scale),
        ("late", "The final checkpoint has had a full evaluation",
         "是否做过最终checkpoint的完整评测", _check_final_eval),
)


def checkup(run: Run, phase: str | None = None, *, total_steps: int | None = None,
            all_phases: bool = False, checkpoint_every: int = 500) -> list[CheckItem]:
    """Marks each item of the guide's check-up table PASSED / FAILED / NOT MEASURED.

    Each phase's items are judged over that phase's window of steps (start-up:
    up to step 1000; middle: 1000 to the middle of training; late: the second
    half; see :func:`run_phase`).

    Args:
        run: from :func:`read_run`.
        phase: one of :data:`PHASES`; default the run's phase.
        total_steps: the planned number of training steps, if known.
        all_phases: judge the items of every phase, not only ``phase``'s
            (phases the run has not reached are NOT MEASURED).
        checkpoint_every: the expected checkpoint interval (steps).

    Returns:
        The items, in the guide's order.

    Raises:
        ValueError: an unknown ``phase``.
    """
    if phase is None:
        phase = run_phase(run, total_steps)
    if phase not in PHASES:
        raise ValueError(f"Expected phase to be one of {PHASES}, got {phase!r} instead")
    total = planned_total_steps(run, total_steps)
    current = run_phase(run, total_steps)
    out = []
    for ph, text, source, fn in CHECKLIST:
        if ph != phase and not all_phases:
            continue
        win = _phase_window(run, ph, total)
        reached = ph == phase or PHASES.index(ph) <= PHASES.index(current)
        if run.last_step is None:
            status, fig, tags = NOT_MEASURED, "nothing logged", ()
        elif not reached:
            status, fig, tags = NOT_MEASURED, f"the run has not reached the {ph} phase", ()
        else:
            try:
                if fn is _check_checkpoints:
                    status, fig, tags = fn(run, win, checkpoint_every)
                else:
                    status, fig, tags = fn(run, win)
            except Exception as e:  # noqa: BLE001 - one bad figure must not sink the report
                status, fig, tags = NOT_MEASURED, f"could not be computed ({type(e).__name__}: {e})", ()
        out.append(CheckItem(ph, text, status, fig, tuple(tags), (int(win[0]), int(win[1])), source))
    return out
