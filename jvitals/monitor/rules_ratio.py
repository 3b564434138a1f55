"""A global figure against its reference: the ratio (:class:`RatioRule`), its slow creep
(:class:`TrendRule`) and a one-check jump (:class:`JumpRule`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.robust import theil_sen
from jvitals.monitor.rules_base import Figures, hysteresis_level, no_why, schedule_factor
from jvitals.monitor.trackers_bands import BandSettings, BucketSeries, DriftBand
from jvitals.monitor.trackers_baselines import BASELINES, DriftBaseline, FixedBaseline, RollingBaseline
from jvitals.monitor.types import Alert, Change, Level, Reading, RuleBase, Spike, release, set_

__all__ = ["JumpRule", "RatioRule", "TrendRule"]

_RATIO_RULE_IDS = {"grad/global_norm": "grad_norm", "param/global_norm": "param_norm"}


class RatioRule(RuleBase):
    """``x / reference`` against ``(yellow, orange)`` per ``Policy.ratio.thresholds``.

    The reference is the metric's baseline; for ``Policy.ratio.schedule_metrics`` (the
    grad norm) it is the baseline times what the schedule predicts
    (:func:`schedule_factor`: the LR and the param norm against their own
    baselines), so the healthy rise of the gradient norm as the LR decays is no
    alert; the metric is divided by that factor before its baseline learns or
    judges it. A new alert needs ``confirm_checks`` consecutive checks above the
    yellow ratio (onset = the first of them; it opens at the level of the last
    one), an escalation to ORANGE as many above the orange ratio: one noisy
    check is no alert. Publishes ``notes.ratio`` = ``{metric: latest x /
    reference}`` and ``notes.schedule`` = ``{metric: factor}``.
    """

    name = "ratio"
    alert_ids = ("grad_norm", "param_norm", "ratio")   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW, Level.ORANGE)
    state_fields = ("baselines", "above", "last_ratio", "refs")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.state_types = {"baselines": BASELINES[policy.baselines.kind], "refs": FixedBaseline}
        self.baselines = {m: BASELINES[policy.baselines.kind]() for m in policy.ratio.thresholds}
        self.refs = {"lr": FixedBaseline(), "pn": FixedBaseline()}  # the schedule's references
        self.above: dict[str, dict[str, list[int]]] = {}  # metric -> {"y"/"o": [checks, first step]}
        self.orange_run: dict[str, list[int]] = {}         # this check's confirmed ORANGE runs
        self.last_ratio: dict[str, float] = {}

    def _schedule(self, f: Figures) -> tuple[float, Any]:
        """:func:`schedule_factor` at this check (the references learn here)."""
        p, refs = self.p, self.refs
        lr, pn = f.get(p.baselines.lr_metric), f.get("param/global_norm")
        lr_ref = pn_ref = None
        if lr is not None and lr > 0 and math.isfinite(lr):
            b = refs["lr"]
            lr_ref = b.mean if b.mean == b.mean else b.step(f.t, f.step, lr, p, f.start)[0]
        if pn is not None and pn > 0 and math.isfinite(pn):
            b = refs["pn"]
            pn_ref = b.mean if b.mean == b.mean else b.step(f.t, f.step, pn, p, f.start)[0]
        if (lr_ref is None or lr >= lr_ref) and (pn_ref is None or pn >= pn_ref):
            return 1.0, no_why          # the LR and the param norm at or above their baselines
        return schedule_factor(lr, lr_ref, pn, pn_ref, p)

    def check(self, f: Figures) -> list[Change]:
        p, s, out = self.p, f.step, []
        sched = None
        self.orange_run = {}
        for m, (y0, o0) in p.ratio.thresholds.items():
            v = f.get(m)
            if v is None or not math.isfinite(v):
                continue
            b = self.baselines[m]
            # A metric whose own check-to-check spread is wide (single steps of a
            # mixture-of-experts on mixed text: 2-3x) needs more than y0 to be a departure.
            widen = max(1.0, math.exp(p.ratio.noise_z * b.noise) / y0) if isinstance(
                b, DriftBaseline) else 1.0
            y, o = y0 * widen, None if o0 is None else o0 * widen
            factor, why = 1.0, ""
            if m in p.ratio.schedule_metrics:
                if sched is None:
                    sched = self._schedule(f)
                    f.notes.schedule = dict.fromkeys(p.ratio.schedule_metrics, sched[0])
                factor, why = sched
            rule = _RATIO_RULE_IDS.get(m, "ratio")
            cur = f.active(rule, m)
            ref, gate = b.step(f.t, s, v / factor, p, f.start, hold=0.0 if cur is not None else y)
            if ref is None or not ref > 0:
                continue
            ratio = v / (ref * factor)
            self.last_ratio[m] = ratio
            if cur is None and not self.above.get(m) and not (gate and ratio > y):
                out.append(release(rule, m))      # the common case: nothing under way
                continue
            lvl, onset = self._level(m, s, ratio, y, o, cur, gate)
            if lvl == Level.GREEN:
                out.append(release(rule, m))
                continue
            thr = o if lvl == Level.ORANGE else y
            orange = f", orange > {o:.3g}x" if o is not None else ""
            why_ = why() if callable(why) else why
            what = (f"what the schedule predicts, {ref * factor:.4g} = its baseline {ref:.4g} x "
                    f"{factor:.2f} ({why_})" if why_ else f"its baseline {ref:.4g}")
            wide = (f"; widened {widen:.2f}x: ratio_noise_z = {p.ratio.noise_z:g} x its "
                    f"check-to-check spread {b.noise:.2f} in log" if widen > 1.0 else "")
            out.append(set_(rule, m, lvl, Reading(v, ref * factor, ratio),
                            f"{m} = {v:.4g} is {ratio:.2f}x {what} (yellow > {y:.3g}x{orange}: "
                            f"Policy.ratio_rules[{m!r}]{wide}; confirmed over confirm_checks = "
                            f"{p.ratio.confirm_checks} checks).", f"{m} crossed {thr:.3g}x", onset=onset,
                            details={"schedule_factor": factor, "baseline": ref, "widen": widen}))
        f.notes.ratio = self.last_ratio
        f.notes.orange_run = self.orange_run
        return out

    orange_run: dict[str, list[int]]

    def _level(self, m: str, s: int, ratio: float, y: float, o: float | None, cur: Alert | None,
               gate: bool) -> tuple[Level, int | None]:
        """The level at this check and, for a new alert, its onset.

        A level is confirmed once its run lasted ``confirm_checks`` checks spanning
        ``confirm_steps`` steps: a run starts at a check above the level's ratio and
        goes on while above ``1 + hysteresis * (ratio - 1)`` (on real text 1-5% of
        the batches have a grad norm 2x their neighbours'; two of them at
        consecutive checks are no fault). A new alert opens at the highest confirmed
        level (onset: the start of the yellow run); an open one escalates to ORANGE
        when that run is confirmed, and steps down by the hysteresis.
        """
        p = self.p
        runs = self.above.setdefault(m, {})
        for name, thr in (("y", y), ("o", o)):
            run = runs.get(name)
            if thr is not None and gate and ratio > (thr if run is None else
                                                     1.0 + p.alerts.hysteresis * (thr - 1.0)):
                if run is None:
                    run = runs[name] = [0, s]
                run[0] += 1
            else:
                runs.pop(name, None)
        ok = {k for k, (c, first) in runs.items() if c >= p.ratio.confirm_checks and s - first >= p.ratio.confirm_steps}
        if "o" in ok:
            self.orange_run[m] = list(runs["o"])
        if cur is None:
            lvl = Level.ORANGE if "o" in ok else Level.YELLOW if "y" in ok else Level.GREEN
            return lvl, runs["y"][1] if lvl > Level.GREEN else None
        held = hysteresis_level(ratio, y, o, cur.level, gate, p.alerts.hysteresis)
        return (Level.ORANGE if "o" in ok else min(held, cur.level) if held else held), None

    def baseline(self, metric: str) -> float | None:
        """The learned baseline of ``metric`` (``None`` while learning)."""
        b = self.baselines.get(metric)
        if b is None:
            return None
        if isinstance(b, RollingBaseline) and len(b.vals) < self.p.baselines.adaptive_min_samples:
            return None
        m = b.mean
        return None if m != m else float(m)

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        super().load_state_dict(d)
        fresh = BASELINES[self.p.baselines.kind]
        self.baselines = {m: self.baselines.get(m) or fresh() for m in self.p.ratio.thresholds}
        self.above = {m: v for m, v in self.above.items() if m in self.baselines}
        self.last_ratio = {m: r for m, r in self.last_ratio.items() if m in self.baselines}

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.above = {}
        return []


_TREND_RULE_IDS = {"grad/global_norm": "grad_trend", "param/global_norm": "param_norm"}


class TrendRule(RuleBase):
    """Creep: a figure rising beyond the run's own drift (the grad norm net of the
    schedule, while the loss still falls).

    For each ``(metric, rise)`` of ``Policy.ratio.trend_metrics``: bucket means (width
    ``trend_window // trend_buckets`` steps, from ``baseline_steps`` after the start
    on; one sample per ``width // 8`` steps) of ``log(x / factor)`` (``factor``:
    :func:`schedule_factor` for ``schedule_metrics``, else 1) and of the loss; each
    closed bucket's mean,
    smoothed (``y += 0.3 (mean - y)``: one noisy check a bucket at a sparse
    cadence), feeds a
    :class:`~jvitals.monitor.trackers_bands.DriftBand` (drift departures only, windows
    ``W`` = ``trend_window`` and 4x it)::

        YELLOW when log(x / factor) rose over the last W steps by more than
             max(log(rise), trend_drift_k * D_W)   at 2 buckets running

    (``D_W``: the largest rise over ``W`` steps the metric showed up to ``W``
    steps before, fading with half-life ``drift_memory``); for the grad norm also
    while the loss's Theil-Sen slope over the last ``trend_buckets`` buckets is
    negative (the loss looks fine: METRICS.md §6 "grad norm climbing while loss
    still falls"). Healthy real-text runs creep 1.25-1.5x per 1000 steps from the
    start: that is their own drift, no alert; the same figure flat for thousands
    of steps and then rising 1.3x is. Released when the metric is back within
    ``hysteresis * log(rise)`` of the level it rose from. Rule ids:
    ``grad_trend`` (the grad norm), ``param_norm`` (the param norm), ``trend``.
    """

    name = "trend"
    alert_ids = ("grad_trend", "param_norm", "trend")   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("buckets", "bands", "smooth", "last_t")
    state_types = {"buckets": BucketSeries, "bands": DriftBand}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.buckets: dict[str, BucketSeries] = {}
        self.bands: dict[str, DriftBand] = {}
        self.smooth: dict[str, float] = {}
        self.last_t = -(10 ** 9)

    def check(self, f: Figures) -> list[Change]:
        p, out = self.p, []
        if f.warm or f.t < f.start + p.baselines.steps:
            return out
        width = max(1, p.ratio.trend_window // p.ratio.trend_buckets)
        if 0 <= f.t - self.last_t < max(1, width // 8):
            return out      # checked more often than width / 8: a sample per width / 8 is enough
        self.last_t = f.t
        loss = f.get("loss")
        loss = loss if loss is not None and math.isfinite(loss) else _NAN
        for m, rise in p.ratio.trend_metrics.items():
            x = f.get(m)
            if x is None or not (math.isfinite(x) and x > 0):
                continue
            factor = f.notes.schedule.get(m, 1.0) if m in p.ratio.schedule_metrics else 1.0
            bs = self.buckets.get(m)
            if bs is None:
                bs = self.buckets[m] = BucketSeries(width, p.ratio.trend_buckets, 2)
            if not bs.add(f.t, [math.log(x / factor), loss]):     # model time
                continue
            ids, means = bs.arrays()
            band = self.bands.get(m)
            if band is None:
                band = self.bands[m] = DriftBand()
            y = float(means[-1, 0])
            prev = self.smooth.get(m)   # the bucket means, EMA-smoothed over ~2 buckets
            y = self.smooth[m] = y if prev is None else prev + 0.3 * (y - prev)
            settings = BandSettings(rise, jump=math.inf, z=0.0, k=p.ratio.trend_drift_k,
                                    windows=(p.ratio.trend_window, 4 * p.ratio.trend_window),
                                    memory=p.bands.drift_memory, confirm=2, hysteresis=p.alerts.hysteresis,
                                    abrupt=False)
            held = band.observe(f.step, int(ids[-1]), y, settings) and band.sign > 0
            rule = _TREND_RULE_IDS.get(m, "trend")
            lslope = _NAN
            if held and m == "grad/global_norm":
                lslope = theil_sen(ids, means[:, 1])
                held = lslope < 0
            if not held:
                if (rule, m) in f.open:
                    out.append(release(rule, m))
                continue
            out.append(self._change(f, rule, m, x, factor, rise, band, lslope))
        return out

    def _change(self, f: Figures, rule: str, m: str, x: float, factor: float, rise: float,
                band: DriftBand, lslope: float) -> Change:
        p = self.p
        i = 0 if band.window == p.ratio.trend_window else 1
        nat = band.natural(i, (p.ratio.trend_window, 4 * p.ratio.trend_window)) or 0.0
        r = math.exp(band.stat)
        net = f" (net of the schedule's factor {factor:.2f})" if factor != 1.0 else ""
        loss = " while the loss still falls" if lslope == lslope else ""
        return set_(rule, m, Level.YELLOW, Reading(x, x / r, r),
                    f"{m} = {x:.4g}{net} rose {r:.2f}x over the last {band.window} steps{loss}: "
                    f"beyond trend_metrics[{m!r}] = {rise:g}x and trend_drift_k = "
                    f"{p.ratio.trend_drift_k:g} x the largest rise over {band.window} steps this run "
                    f"showed before ({math.exp(nat):.2f}x).", f"{m} started climbing",
                    onset=None if f.active(rule, m) is not None else band.onset,
                    details={"rise": r, "window": band.window, "natural": math.exp(nat),
                             "loss_slope_per_step": lslope})

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        for bs in self.buckets.values():
            bs.clear()
        for band in self.bands.values():
            band.rewind(t_to)
        self.smooth, self.last_t = {}, -(10 ** 9)
        return []


class JumpRule(RuleBase):
    """An unmistakable departure: a figure ``jump`` x or more in one check, per unit LR.

    For each ``(metric, jump)`` of ``Policy.ratio.jump_metrics`` (default: the global
    ``update/param_ratio``, the update applied at that very step), with ``r = x /
    lr`` (``lr`` the ``lr_metric`` when logged, else 1; a schedule moves ``r``
    little between two checks) at consecutive checks after the baseline start::

        YELLOW at once when r >= jump * r_prev          (no second check: the
                                                         loss has not seen it yet)
        held while r >= jump / 2 * r_prev(at the jump); released otherwise

    A moderate change is left to the rules that confirm over two checks.
    """

    name = "jump"
    alert_ids = ("jump",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("prev", "anchor")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.items = tuple(policy.ratio.jump_metrics.items())
        self.prev: dict[str, float] = {}
        self.anchor: dict[str, list] = {}   # metric -> [r before the jump, onset step]

    def check(self, f: Figures) -> list[Change]:
        p, out = self.p, []
        if f.warm:
            return out
        lr = f.get(p.baselines.lr_metric)
        lr = lr if lr is not None and lr > 0 and math.isfinite(lr) else 1.0
        for m, jump in self.items:
            x = f.get(m)
            if x is None or not (x > 0 and math.isfinite(x)):
                continue
            r, prev = x / lr, self.prev.get(m)
            self.prev[m] = r
            a = self.anchor.get(m)
            if a is not None and f.active("jump", m) is None:
                a = None
            if a is None and prev is not None and r >= jump * prev:
                a = self.anchor[m] = [prev, f.step]
            if a is None or r < 0.5 * jump * a[0]:
                self.anchor.pop(m, None)
                if ("jump", m) in f.open:
                    out.append(release("jump", m))
                continue
            ref = a[0] * lr
            out.append(set_("jump", m, Level.YELLOW, Reading(x, ref, x / ref),
                            f"{m} = {x:.4g} is {x / ref:.1f}x its value at the check before the "
                            f"jump ({ref:.4g} at this LR), an unmistakable departure in one check "
                            f"(>= Policy.jump_metrics[{m!r}] = {jump:g}x per unit LR); the loss has "
                            "not seen this update yet.", f"{m} jumped {x / ref:.0f}x", onset=a[1],
                            details={"per_lr_before": a[0], "per_lr": r}))
        return out

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.prev, self.anchor = {}, {}
        return []
