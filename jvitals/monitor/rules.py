"""The monitor's rules: one small class per condition.

A rule reads one check's :class:`Figures` and returns the alert
:class:`Change` s it makes (open/update at a level, release, close). Its
parameters come from the :class:`~jvitals.monitor.policy.Policy`; its state
has ``state_dict`` / ``load_state_dict`` (plain JSON). ``Monitor.update``
runs the rules in order and applies each one's changes before the next
runs, so a later rule sees what an earlier one published in
``Figures.notes`` (the loss trend, the global ratios) and the divergence
rule, last, sees the check's divergent alerts.

A user rule is any object with a ``name`` (unique) and ``check(figures) ->
list[Change]``; ``state_dict``/``load_state_dict``/``rollback`` are optional.

Rule table (every number a Policy field)::

    class               rule id          level    condition
    NonFiniteRule       nonfinite        ORANGE   loss / grad norm non-finite, nonfinite count > 0,
      (between.py)                                a non-finite step in the window since the last check
    SpikeRule           loss_spike       YELLOW   a loss spike not back in its band after 300 steps
                        periodic_spike   YELLOW/  >= 3 loss spikes at near-regular intervals
                                         ORANGE   (intervals shrinking)
    RatioRule           grad_norm,       YELLOW,  x / (reference x the schedule's factor) > 2, > 3,
                        ratio            ORANGE   confirmed over 3 checks; the reference follows the
                                                  run's own slow drift (DriftBaseline)
    TrendRule           grad_trend,      YELLOW   a rise over 1000 (4000) steps beyond 1.3x (1.5x)
                        param_norm                and 3x the run's own (grad norm: net of the
                                                  schedule, while the loss falls)
    JumpRule            jump             YELLOW   update/param_ratio per unit LR x5 in one check
    GroupRule           group            YELLOW   a group figure jumped x5, stepped beyond its band,
                                                  or drifted beyond 3x its own drift, while the
                                                  global figures did not move
    LogitRule           logits           YELLOW   attention / output logits rising beyond their drift
    RouterRule          router           YELLOW   moe/maxvio.max (+0.5) or moe/dead_expert_ratio
                                                  (+0.2) above its baseline for 50 steps
    ThroughputRule      throughput       YELLOW   tokens/s (else steps/s) down beyond the run's own
      (between.py)                                band (>= 20%, 5 sd of its noise) for 40 steps
    SkipRule, EarlyRule, skip, early,    see   an update skipped in the step; a jump before the
    DataRule (between)  data             between.py  baselines are armed; the loss rising with the
                                                  optimizer calm (the data)
    LossScaleRule       loss_scale       YELLOW   loss scale falls >= 2**4 between two checks or
                                                  from its recent peak
    GapRule             val_gap          YELLOW   gap growth > 1.5x the growth before, above the
                                                  noise (4 sd), 5% of the loss and its earlier high
    ValRiseRule         val_rise         YELLOW   val loss rising (Mann-Kendall z > 3, Theil-Sen rise
                                                  >= 2% over 500 steps) while the loss trend falls
    BrokenModelRule     broken_model     YELLOW,  loss at chance level (log vocab) or param norm
                                         ORANGE,  1.5x its value 100 steps before; RED when not
                                         RED      recovered after 50 (param) / 100 (loss) steps
    DivergenceRule      divergence       RED      red_after consecutive checks with an ORANGE
                                                  condition (or the loss > 1.25x its pre-spike trend
                                                  after the pathological window)
    ReplicaRule         replica          YELLOW,  one replica's figure a robust outlier (median/MAD
      (monitor/replicas.py)              ORANGE   across replicas) on consecutive checks; one
                                                  replica non-finite while the others are finite
"""

from __future__ import annotations

import collections
import math
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from jvitals.monitor.between import (DataRule, EarlyRule, NonFiniteRule, SkipRule, ThroughputRule, WindowSpikes,
                                     window_peak)
from jvitals.monitor.policy import Policy
from jvitals.monitor.replicas import ReplicaRule
from jvitals.monitor.trackers import (
    BASELINES,
    BucketSeries,
    DriftBand,
    DriftBaseline,
    FixedBaseline,
    GapSeries,
    RollingBaseline,
    SpikeTracker,
    mann_kendall_z,
    median,
    theil_sen,
)
from jvitals.monitor.types import (
    Alert,
    Change,
    Level,
    RuleBase,
    Spike,
    clear,
    release,
    set_,
    split_group,
)

__all__ = [
    "BrokenModelRule",
    "Change",
    "DataRule",
    "DivergenceRule",
    "EarlyRule",
    "Figures",
    "GapRule",
    "GroupRule",
    "JumpRule",
    "LogitRule",
    "LossScaleRule",
    "NonFiniteRule",
    "RatioRule",
    "RouterRule",
    "Rule",
    "SkipRule",
    "SpikeRule",
    "ThroughputRule",
    "TrendRule",
    "ValRiseRule",
    "WindowSpikes",
    "default_rules",
]

_NAN = math.nan
_RATIO_RULE_IDS = {"grad/global_norm": "grad_norm", "param/global_norm": "param_norm"}
_SCORE_NAMES = {"loss": "monitor/loss_spike_score",
                "grad/global_norm": "monitor/grad_norm_spike_score"}


# --------------------------------------------------------------------------
# What rules read and return.
# --------------------------------------------------------------------------


class Plan:
    """Where each name sits in one key set (cached per key set).

    ``vals`` of a check is a list of Python floats in ``keys`` order.
    """

    __slots__ = ("keys", "named", "pos", "cols", "cache")

    def __init__(self, keys: tuple, named: dict[str, int], pos: np.ndarray, cols: np.ndarray):
        self.keys, self.named, self.pos, self.cols = keys, named, pos, cols
        self.cache: dict[str, Any] = {}  # per-rule data derived from the key set


class Figures:
    """One check's figures as the rules see them.

    Attributes:
      step: the caller's step ``s``.
      t: model time (``s`` minus the steps abandoned by rollbacks).
      start: model time at which the baselines started (``None`` before).
      warm: ``start is None or t < start``.
      plan: the key set's :class:`Plan` (``plan.keys``, ``plan.cache`` for a
        rule's own per-key-set data).
      vals: the values as Python floats, in ``plan.keys`` order.
      get: ``get(name)``, the value of ``name`` at this check (``None`` when not
        logged).
      open: the open alerts, ``{(rule, key): Alert}`` (read only).
      notes: what earlier rules published this check.
      diverging: ``[(key, alert)]`` of this check's divergent alerts.
      touched: the ``(rule, key)`` pairs some change named this check.
      scores: floats to log, filled by the rules.
      spikes: spikes completed this check (the monitor keeps them).
      policy: the :class:`Policy`.
    """

    __slots__ = ("step", "t", "start", "warm", "plan", "vals", "open", "notes", "diverging",
                 "touched", "scores", "spikes", "policy", "get")

    def __init__(self, step: int, t: int, start: int | None, plan: Plan, vals: list[float],
                 open_: Mapping[tuple[str, str], Alert], policy: Policy) -> None:
        # ``get(name)``: the value of ``name`` at this check (``None`` when not logged).
        self.get = dict(zip(plan.keys, vals)).get
        self.step, self.t, self.start = step, t, start
        self.warm = start is None or t < start
        self.plan, self.vals, self.open, self.policy = plan, vals, open_, policy
        self.notes: dict[str, Any] = {}
        self.diverging: list[tuple[tuple[str, str], Alert]] = []
        self.touched: set[tuple[str, str]] = set()
        self.scores: dict[str, float] = {}
        self.spikes: list[Spike] = []

    def active(self, rule: str, key: str) -> Alert | None:
        """The open alert ``(rule, key)`` of the current episode: ``None`` when there is
        none or when its condition has been clear for ``Policy.episode_gap`` steps or
        more (it only waits out ``Policy.clear_steps``). A rule treats such an alert as
        closed: a new crossing needs its own confirmation and is a new episode with
        its own onset (``Monitor`` closes the old alert when the rule sets it again);
        within the gap the alert's hysteresis still holds it (a dip is noise)."""
        a = self.open.get((rule, key))
        if a is None or (a.clearing_since is not None
                         and self.step - a.clearing_since >= self.policy.episode_gap):
            return None
        return a


@runtime_checkable
class Rule(Protocol):
    """What the monitor needs of a rule (the others are optional)."""

    name: str

    def check(self, f: Figures) -> list[Change]:
        ...


# --------------------------------------------------------------------------
# Rules.
# --------------------------------------------------------------------------


class SpikeRule(RuleBase):
    """Spike anatomy, the unrecovered-spike YELLOW, periodic spikes, scores.

    Publishes ``notes['loss_trend']`` (the loss EMA trend) and
    ``notes['loss_pre']`` (the pre-spike trend while a loss spike is open or
    its elevated reference holds, else the trend).
    """

    name = "spike"
    state_fields = ("trackers",)
    state_types = {"trackers": SpikeTracker}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.trackers = {m: SpikeTracker(m, policy) for m in policy.spike_metrics}
        self.score_names = {m: _SCORE_NAMES.get(m, "monitor/" + m.replace("/", "_") + "_spike_score")
                            for m in policy.spike_metrics}

    def check(self, f: Figures) -> list[Change]:
        p, s, out = self.p, f.step, []
        seen: dict[str, float] = {}
        for m, tr in self.trackers.items():
            v = f.get(m)
            if v is None or not math.isfinite(v):
                continue
            seen[m] = v
            peak = window_peak(f, m)   # a spike between the checks, at its own step
            if peak is not None and (tr.last_step is None or peak[0] > tr.last_step) and \
                    tr.beyond(peak[1], f.warm, p):
                f.spikes.extend(tr.observe(peak[0], peak[1], f.warm, p))
            f.spikes.extend(tr.observe(s, v, f.warm, p))
        for m in p.spike_alert_metrics:
            tr = self.trackers.get(m)
            if tr is None or m not in seen:
                continue
            v = seen[m]
            o, e = tr.open, tr.elevated
            if o is not None and s - o["onset"] >= p.physiological_steps:
                ref, onset = o["pre_trend"], o["onset"]
            elif o is None and e is not None:
                ref, onset = e["pre_trend"], e["onset"]
            else:
                if o is None:
                    out.append(clear("loss_spike", m))
                continue
            if f.notes.get("data"):      # the data rule holds: the loss is the data's, not the LR's
                out.append(release("loss_spike", m))
                continue
            ratio = v / ref if ref > 0 else _NAN
            out.append(set_(
                "loss_spike", m, Level.YELLOW, v, ref, ratio,
                f"{m} spike at step {onset} not back to trend after {s - onset} steps: "
                f"{v:.4g} vs pre-spike trend {ref:.4g} ({ratio:.2f}x).", f"{m} spiked",
                onset=onset,
                diverging=bool(o is None and ref > 0 and v > p.divergence_loss_ratio * ref)))
        for m, tr in self.trackers.items():
            f.scores[self.score_names[m]] = tr.score.score
            if m not in seen or m not in p.periodic_metrics:
                continue
            per = tr.periodic
            if per is None:
                out.append(clear("periodic_spike", m))
                continue
            lvl = Level.ORANGE if per["shrinking"] else Level.YELLOW
            shrink = ", intervals shrinking" if per["shrinking"] else ""
            out.append(set_(
                "periodic_spike", m, lvl, float(per["period"]), _NAN, _NAN,
                f"{per['count']} {m} spikes at near-regular intervals, period ~"
                f"{per['period']:.0f} steps{shrink} (intervals {per['intervals']}); last onset at "
                f"step {per['last_onset']}.", f"{m} spikes turned periodic",
                onset=per["first_onset"], diverging=False,
                details={"period": float(per["period"]), "count": per["count"],
                         "intervals": list(per["intervals"]), "shrinking": per["shrinking"],
                         "last_onset": per["last_onset"]}))
        tr = self.trackers.get("loss")
        if tr is not None:
            f.notes["loss_trend"] = tr.trend
            ref = tr.trend
            if tr.open is not None:
                ref = tr.open["pre_trend"]
            elif tr.elevated is not None:
                ref = tr.elevated["pre_trend"]
            f.notes["loss_pre"] = ref
        return out

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        super().load_state_dict(d)
        self.trackers = {m: self.trackers.get(m) or SpikeTracker(m, self.p)
                         for m in self.p.spike_metrics}

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        done = []
        for tr in self.trackers.values():
            done.extend(tr.rollback(step, self.p))
        return done


def _level(ratio: float, y: float, o: float | None) -> Level:
    if o is not None and ratio > o:
        return Level.ORANGE
    if ratio > y:
        return Level.YELLOW
    return Level.GREEN


def _hysteresis_level(ratio: float, y: float, o: float | None, cur: Level, gate: bool,
                      h: float) -> Level:
    """Level of a ratio rule: opens/escalates on the thresholds (and the
    gate), steps down only below ``1 + h * (threshold - 1)``."""
    raw = _level(ratio, y, o) if gate else Level.GREEN
    if raw >= cur:
        return raw
    held = _level(ratio, 1.0 + h * (y - 1.0), None if o is None else 1.0 + h * (o - 1.0))
    return max(raw, min(cur, held))


def schedule_factor(lr: float | None, lr_ref: float | None, pn: float | None,
                    pn_ref: float | None, p: Policy) -> tuple[float, str]:
    """What the schedule predicts for the gradient norm, relative to its baseline.

    ``(lr_ref / lr) ** lr_exponent`` (the LR decayed from its baseline level
    ``lr_ref``; capped at 100x, i.e. 10x for the default exponent): for weights
    under normalization with decoupled weight decay the steady state is ``||g|| /
    ||w|| ~ sqrt(2 lambda / lr)`` (Defazio 2025, arXiv 2506.02285), so a cosine to
    0.1x raises a healthy grad norm ~3x; off with ``weight_decay=0``. And
    ``pn_ref / pn`` (the param norm shrank: gradients of scale-invariant weights
    scale as ``1 / ||w||``). The larger of the two, never below 1.

    Returns:
      ``(factor, why)``: ``why`` (a callable: formatted only for a message) says which
      term and its figures ("" for a factor of 1).
    """
    sched = pnf = 1.0
    if lr is not None and lr_ref is not None and lr > 0 and lr_ref > 0 and p.weight_decay != 0 \
            and p.lr_exponent > 0:
        sched = min(max(lr_ref / lr, 1.0), 100.0) ** p.lr_exponent
    if pn is not None and pn_ref is not None and pn > 0 and pn_ref > 0:
        pnf = max(pn_ref / pn, 1.0)
    if sched <= 1.0 and pnf <= 1.0:
        return 1.0, _no_why
    if sched >= pnf:
        return sched, lambda: (f"(lr at baseline {lr_ref:.3g} / lr now {lr:.3g}) ** "
                               f"{p.lr_exponent:g}, Policy.lr_exponent")
    return pnf, lambda: f"param norm at baseline {pn_ref:.4g} / now {pn:.4g}"


def _no_why() -> str:
    return ""


class RatioRule(RuleBase):
    """``x / reference`` against ``(yellow, orange)`` per ``Policy.ratio_rules``.

    The reference is the metric's baseline; for ``Policy.schedule_metrics`` (the
    grad norm) it is the baseline times what the schedule predicts
    (:func:`schedule_factor`: the LR and the param norm against their own
    baselines), so the healthy rise of the gradient norm as the LR decays is no
    alert; the metric is divided by that factor before its baseline learns or
    judges it. A new alert needs ``confirm_checks`` consecutive checks above the
    yellow ratio (onset = the first of them; it opens at the level of the last
    one), an escalation to ORANGE as many above the orange ratio: one noisy
    check is no alert. Publishes ``notes['ratio']`` = ``{metric: latest x /
    reference}`` and ``notes['schedule']`` = ``{metric: factor}``.
    """

    name = "ratio"
    state_fields = ("baselines", "above", "last_ratio", "refs")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.state_types = {"baselines": BASELINES[policy.baseline], "refs": FixedBaseline}
        self.baselines = {m: BASELINES[policy.baseline]() for m in policy.ratio_rules}
        self.refs = {"lr": FixedBaseline(), "pn": FixedBaseline()}  # the schedule's references
        self.above: dict[str, dict[str, list[int]]] = {}  # metric -> {"y"/"o": [checks, first step]}
        self.orange_run: dict[str, list[int]] = {}         # this check's confirmed ORANGE runs
        self.last_ratio: dict[str, float] = {}

    def _schedule(self, f: Figures) -> tuple[float, Any]:
        """:func:`schedule_factor` at this check (the references learn here)."""
        p, refs = self.p, self.refs
        lr, pn = f.get(p.lr_metric), f.get("param/global_norm")
        lr_ref = pn_ref = None
        if lr is not None and lr > 0 and math.isfinite(lr):
            b = refs["lr"]
            lr_ref = b.mean if b.mean == b.mean else b.step(f.t, f.step, lr, p, f.start)[0]
        if pn is not None and pn > 0 and math.isfinite(pn):
            b = refs["pn"]
            pn_ref = b.mean if b.mean == b.mean else b.step(f.t, f.step, pn, p, f.start)[0]
        if (lr_ref is None or lr >= lr_ref) and (pn_ref is None or pn >= pn_ref):
            return 1.0, _no_why          # the LR and the param norm at or above their baselines
        return schedule_factor(lr, lr_ref, pn, pn_ref, p)

    def check(self, f: Figures) -> list[Change]:
        p, s, out = self.p, f.step, []
        sched = None
        self.orange_run = {}
        for m, (y0, o0) in p.ratio_rules.items():
            v = f.get(m)
            if v is None or not math.isfinite(v):
                continue
            b = self.baselines[m]
            # A metric whose own check-to-check spread is wide (single steps of a
            # mixture-of-experts on mixed text: 2-3x) needs more than y0 to be a departure.
            widen = max(1.0, math.exp(p.ratio_noise_z * b.noise) / y0) if isinstance(
                b, DriftBaseline) else 1.0
            y, o = y0 * widen, None if o0 is None else o0 * widen
            factor, why = 1.0, ""
            if m in p.schedule_metrics:
                if sched is None:
                    sched = self._schedule(f)
                    f.notes["schedule"] = dict.fromkeys(p.schedule_metrics, sched[0])
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
            wide = (f"; widened {widen:.2f}x: ratio_noise_z = {p.ratio_noise_z:g} x its "
                    f"check-to-check spread {b.noise:.2f} in log" if widen > 1.0 else "")
            out.append(set_(rule, m, lvl, v, ref * factor, ratio,
                            f"{m} = {v:.4g} is {ratio:.2f}x {what} (yellow > {y:.3g}x{orange}: "
                            f"Policy.ratio_rules[{m!r}]{wide}; confirmed over confirm_checks = "
                            f"{p.confirm_checks} checks).", f"{m} crossed {thr:.3g}x", onset=onset,
                            details={"schedule_factor": factor, "baseline": ref, "widen": widen}))
        f.notes["ratio"] = self.last_ratio
        f.notes["orange_run"] = self.orange_run
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
                                                     1.0 + p.hysteresis * (thr - 1.0)):
                if run is None:
                    run = runs[name] = [0, s]
                run[0] += 1
            else:
                runs.pop(name, None)
        ok = {k for k, (c, first) in runs.items() if c >= p.confirm_checks and s - first >= p.confirm_steps}
        if "o" in ok:
            self.orange_run[m] = list(runs["o"])
        if cur is None:
            lvl = Level.ORANGE if "o" in ok else Level.YELLOW if "y" in ok else Level.GREEN
            return lvl, runs["y"][1] if lvl > Level.GREEN else None
        held = _hysteresis_level(ratio, y, o, cur.level, gate, p.hysteresis)
        return (Level.ORANGE if "o" in ok else min(held, cur.level) if held else held), None

    def baseline(self, metric: str) -> float | None:
        """The learned baseline of ``metric`` (``None`` while learning)."""
        b = self.baselines.get(metric)
        if b is None:
            return None
        if isinstance(b, RollingBaseline) and len(b.vals) < self.p.adaptive_min_samples:
            return None
        m = b.mean
        return None if m != m else float(m)

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        super().load_state_dict(d)
        fresh = BASELINES[self.p.baseline]
        self.baselines = {m: self.baselines.get(m) or fresh() for m in self.p.ratio_rules}
        self.above = {m: v for m, v in self.above.items() if m in self.baselines}
        self.last_ratio = {m: r for m, r in self.last_ratio.items() if m in self.baselines}

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        self.above = {}
        return []


_TREND_RULE_IDS = {"grad/global_norm": "grad_trend", "param/global_norm": "param_norm"}


class TrendRule(RuleBase):
    """Creep: a figure rising beyond the run's own drift (the grad norm net of the
    schedule, while the loss still falls).

    For each ``(metric, rise)`` of ``Policy.trend_metrics``: bucket means (width
    ``trend_window // trend_buckets`` steps, from ``baseline_steps`` after the start
    on; one sample per ``width // 8`` steps) of ``log(x / factor)`` (``factor``:
    :func:`schedule_factor` for ``schedule_metrics``, else 1) and of the loss; each
    closed bucket's mean,
    smoothed (``y += 0.3 (mean - y)``: one noisy check a bucket at a sparse
    cadence), feeds a
    :class:`~jvitals.monitor.trackers.DriftBand` (drift departures only, windows
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
        if f.warm or f.t < f.start + p.baseline_steps:
            return out
        width = max(1, p.trend_window // p.trend_buckets)
        if 0 <= f.t - self.last_t < max(1, width // 8):
            return out      # checked more often than width / 8: a sample per width / 8 is enough
        self.last_t = f.t
        loss = f.get("loss")
        loss = loss if loss is not None and math.isfinite(loss) else _NAN
        for m, rise in p.trend_metrics.items():
            x = f.get(m)
            if x is None or not (math.isfinite(x) and x > 0):
                continue
            factor = f.notes.get("schedule", {}).get(m, 1.0) if m in p.schedule_metrics else 1.0
            bs = self.buckets.get(m)
            if bs is None:
                bs = self.buckets[m] = BucketSeries(width, p.trend_buckets, 2)
            if not bs.add(f.t, [math.log(x / factor), loss]):     # model time
                continue
            ids, means = bs.arrays()
            band = self.bands.get(m)
            if band is None:
                band = self.bands[m] = DriftBand()
            y = float(means[-1, 0])
            prev = self.smooth.get(m)   # the bucket means, EMA-smoothed over ~2 buckets
            y = self.smooth[m] = y if prev is None else prev + 0.3 * (y - prev)
            held = band.observe(f.step, int(ids[-1]), y, rise, math.inf, 0.0,
                                p.trend_drift_k, (p.trend_window, 4 * p.trend_window),
                                p.drift_memory, 2, p.hysteresis, abrupt=False) and band.sign > 0
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
        i = 0 if band.window == p.trend_window else 1
        nat = band.natural(i, (p.trend_window, 4 * p.trend_window)) or 0.0
        r = math.exp(band.stat)
        net = f" (net of the schedule's factor {factor:.2f})" if factor != 1.0 else ""
        loss = " while the loss still falls" if lslope == lslope else ""
        return set_(rule, m, Level.YELLOW, x, x / r, r,
                    f"{m} = {x:.4g}{net} rose {r:.2f}x over the last {band.window} steps{loss}: "
                    f"beyond trend_metrics[{m!r}] = {rise:g}x and trend_drift_k = "
                    f"{p.trend_drift_k:g} x the largest rise over {band.window} steps this run "
                    f"showed before ({math.exp(nat):.2f}x).", f"{m} started climbing",
                    onset=None if f.active(rule, m) is not None else band.onset,
                    details={"rise": r, "window": band.window, "natural": math.exp(nat),
                             "loss_slope_per_step": lslope})

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        for bs in self.buckets.values():
            bs.clear()
        for band in self.bands.values():
            band.rollback(t_to)
        self.smooth, self.last_t = {}, -(10 ** 9)
        return []


class JumpRule(RuleBase):
    """An unmistakable departure: a figure ``jump`` x or more in one check, per unit LR.

    For each ``(metric, jump)`` of ``Policy.jump_metrics`` (default: the global
    ``update/param_ratio``, the update applied at that very step), with ``r = x /
    lr`` (``lr`` the ``lr_metric`` when logged, else 1; a schedule moves ``r``
    little between two checks) at consecutive checks after the baseline start::

        YELLOW at once when r >= jump * r_prev          (no second check: the
                                                         loss has not seen it yet)
        held while r >= jump / 2 * r_prev(at the jump); released otherwise

    A moderate change is left to the rules that confirm over two checks.
    """

    name = "jump"
    state_fields = ("prev", "anchor")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.items = tuple(policy.jump_metrics.items())
        self.prev: dict[str, float] = {}
        self.anchor: dict[str, list] = {}   # metric -> [r before the jump, onset step]

    def check(self, f: Figures) -> list[Change]:
        p, out = self.p, []
        if f.warm:
            return out
        lr = f.get(p.lr_metric)
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
            out.append(set_("jump", m, Level.YELLOW, x, ref, x / ref,
                            f"{m} = {x:.4g} is {x / ref:.1f}x its value at the check before the "
                            f"jump ({ref:.4g} at this LR), an unmistakable departure in one check "
                            f"(>= Policy.jump_metrics[{m!r}] = {jump:g}x per unit LR); the loss has "
                            "not seen this update yet.", f"{m} jumped {x / ref:.0f}x", onset=a[1],
                            details={"per_lr_before": a[0], "per_lr": r}))
        return out

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        self.prev, self.anchor = {}, {}
        return []


_GLOBAL_OF = {"update/param_ratio": "update/param_ratio", "param/norm": "param/global_norm"}


class GroupRule(RuleBase):
    """One group's figure departed from its own history while the global figures did not.

    Groups: ``embedding``, ``lm_head``, ``layer_{i}``; figures ``{family}/{group}``
    for the families of ``Policy.group_bands``. Each value is divided by the trunk's
    median of the family at the same check (the global figure where no layer figure
    is logged; the embedding's and the LM head's update ratios by the learning rate
    where ``lr_metric`` is logged, so that every layer's update moving together, as
    an attention LR fault makes them, is not read as theirs), so a schedule moving
    every group together is not a departure, and
    ``y = log(x / trunk)`` is judged against its own history by a
    :class:`~jvitals.monitor.trackers.DriftBand` (``band`` = the family's
    ``group_bands`` ratio, ``W = group_window``)::

        jump   |y - y_prev| >= max(log(group_jump), group_z * noise)     YELLOW at once
        step   |y - y_prev| >  max(log(band), group_z * noise)           2 samples
        drift  |y - y(t - W)| > max(log(band), group_drift_k * D_W)      2 samples
               for W = group_window or 4 x group_window

    (``noise``: the RMS of its one-sample changes; ``D_W``: the largest change over
    ``W`` steps it showed earlier in the run, up to ``W`` steps ago, fading with
    half-life ``drift_memory``). Gradient shares are judged for drift only: one
    batch of real text moves them 5x and back (the update ratios and the param
    norms show an abrupt fault; the shares follow). So the natural drift of a group (shares moving
    between layers as the model learns, the head's share rising) is no alert; an
    abrupt departure, or a drift well beyond the group's own, is. The YELLOW names
    the group (embedding / LM head: "0.5x trunk LR"; a layer: "layer-wise LR
    decay") and opens only while ``grad/global_norm`` (against the schedule's
    prediction) and ``param/global_norm`` are below ``group_global_ratio`` x their
    baselines; it is released when the figure is back within ``hysteresis x
    log(band)`` of the level it left.
    """

    name = "group"
    state_fields = ("bands",)
    state_types = {"bands": DriftBand}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.bands: dict[str, DriftBand] = {}

    def _plan(self, f: Figures):
        got = f.plan.cache.get(self.name)
        if got is None:
            fams: dict[str, list[tuple[str, str, bool, int]]] = {}
            for i, k in enumerate(f.plan.keys):
                sg = split_group(k)
                if sg and sg[0] in self.p.group_bands:
                    fams.setdefault(sg[0], []).append((k, sg[1], sg[2] is not None, i))
            got = f.plan.cache[self.name] = fams
        return got

    def _observe(self, f: Figures, fams) -> tuple[dict[str, tuple], set[str]]:
        """Feeds every group figure to its band; ``({group: strongest hit}, groups seen)``."""
        p, s = self.p, f.step
        windows = (p.group_window, 4 * p.group_window)
        hits: dict[str, tuple] = {}
        seen: set[str] = set()
        for fam, items in fams.items():
            vals = [(k, g, is_layer, float(f.vals[i])) for k, g, is_layer, i in items]
            layer_vals = [v for _, _, is_layer, v in vals if is_layer and v > 0 and math.isfinite(v)]
            if fam == "grad/share":
                trunk = 1.0     # shares are relative already (a tiny trunk share makes any ratio huge)
            elif len(layer_vals) >= 2:
                trunk = median(layer_vals)
            elif fam in _GLOBAL_OF:
                trunk = f.get(_GLOBAL_OF[fam]) or _NAN
            else:
                trunk = 1.0
            if not (trunk > 0 and math.isfinite(trunk)):
                continue
            band = p.group_bands[fam]
            lr = f.get(p.lr_metric) if fam == "update/param_ratio" else None
            per_lr = lr is not None and math.isfinite(lr) and lr > 0
            floor = p.group_min_share if fam == "grad/share" else 0.0
            for k, g, is_layer, v in vals:
                if not (v > 0 and math.isfinite(v)):
                    continue
                seen.add(g)
                b = self.bands.get(k)
                if b is None:
                    b = self.bands[k] = DriftBand()
                # The embedding's and the head's update ratios per unit LR (the schedule
                # cancels; a change of every layer's, e.g. the attention's LR, does not
                # read as theirs); a layer's relative to the trunk.
                norm = lr if per_lr and not is_layer else trunk
                rel = ("per unit LR" if norm is lr else "as it is" if trunk == 1.0
                       else "relative to the trunk's median")
                y = math.log(v / norm)
                if b.observe(s, f.t, y, band, p.group_jump, p.group_z, p.group_drift_k,
                             windows, p.drift_memory, p.group_confirm, p.hysteresis,
                             abrupt=fam != "grad/share"):
                    if max(v, norm * math.exp(b.anchor)) < floor:
                        continue   # a share below group_min_share before and after: noise
                    size = abs(y - b.anchor) / math.log(band)
                    if g not in hits or size > hits[g][0]:
                        hits[g] = (size, k, fam, v, norm * math.exp(b.anchor), math.exp(y - b.anchor), b,
                                   rel)
        return hits, seen

    def _headline(self, g: str, k: str, fam: str, v: float, ref: float, r: float,
                  b: DriftBand, rel: str) -> str:
        p = self.p
        band = p.group_bands[fam]
        if b.kind == "drift":
            i = 0 if b.window == p.group_window else 1
            nat = b.natural(i, (p.group_window, 4 * p.group_window), b.last_t) or 0.0
            why = (f"it changed {math.exp(abs(b.stat)):.2f}x over the last {b.window} steps, "
                   f"beyond group_drift_k = {p.group_drift_k:g} x the largest change over "
                   f"{b.window} steps it showed before in this run ({math.exp(nat):.2f}x) and "
                   f"its band group_bands[{fam!r}] = {band:g}x (windows: group_window and 4x it)")
        else:
            noise = b.noise
            nz = f" and > group_z = {p.group_z:g} x its sample-to-sample noise ({noise:.2g} in log)" \
                if noise is not None else ""
            lim = (f"an unmistakable departure: >= group_jump = {p.group_jump:g}x" if b.kind == "jump"
                   else f"beyond its band group_bands[{fam!r}] = {band:g}x")
            why = f"it moved {math.exp(abs(b.stat)):.2f}x in one sample ({lim}{nz})"
        layer = g.startswith("layer_")
        what = "layer-wise LR decay" if layer else "embedding and LM head at 0.5x trunk LR"
        return (f"the {g} group left its own band while the global figures did not: {k} = {v:.4g} "
                f"is {r:.2f}x the level it left ({ref:.4g}; judged {rel}); {why}. "
                f"Suggests {what}.")

    def check(self, f: Figures) -> list[Change]:
        fams = self._plan(f)
        if not fams or f.warm:
            return []
        p = self.p
        hits, seen = self._observe(f, fams)
        changes = []
        ratios = f.notes.get("ratio", {})
        calm = all(ratios.get(m, 1.0) < p.group_global_ratio
                   for m in ("grad/global_norm", "param/global_norm"))
        for g in sorted(seen):
            hit = hits.get(g)
            active = f.active("group", g) is not None
            if hit is None:
                if ("group", g) in f.open:
                    changes.append(release("group", g))
                continue
            if not active and not calm:
                continue
            _, k, fam, v, ref, r, b, rel = hit
            layer = g.startswith("layer_")
            changes.append(set_(
                "group", k, Level.YELLOW, v, ref, r, self._headline(g, k, fam, v, ref, r, b, rel),
                f"{k} left its band", key=g, onset=None if active else b.onset,
                prescription="group_layer_lr" if layer else "group_embedding_lr",
                details={"group": g, "family": fam, "kind": b.kind}))
        return changes

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        for b in self.bands.values():
            b.rollback(t_to)
        return []


class LogitRule(RuleBase):
    """Logits growing beyond their own drift: the attention's (no QK-norm, Wq/Wk LR
    too high) and the output's (logit drift).

    For each ``(metric, band)`` of ``Policy.logit_bands`` (``act/attn_logits_abs.max``,
    ``act/output_layer_logits_abs.max``), the metric and its per-layer figures
    (``{metric}/layer_{i}``) are judged as the group rule judges a group figure, on
    ``y = log(x)`` with a :class:`~jvitals.monitor.trackers.DriftBand` (its
    ``group_*`` settings): a one-sample jump ``>= group_jump`` x (and ``group_z`` x
    its noise) opens at once; a step beyond ``band`` or a rise over
    ``group_window`` (or 4x it) beyond ``group_drift_k`` x the rise the figure
    showed before opens after ``group_confirm`` samples. Only rises count (logits
    shrinking is no fault). Attention logits grow 10-50x over a healthy run's
    first thousand steps: that is the figure's own drift (cold start, fading with
    ``drift_memory``). A figure logged more often is judged once per ``group_window
    // 16`` steps. YELLOW; the guard's default remedies turn QK-clip (attention) or
    z-loss (output) on.
    """

    name = "logits"
    state_fields = ("bands", "last_t")
    state_types = {"bands": DriftBand}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.bands: dict[str, DriftBand] = {}
        self.last_t = -(10 ** 9)

    def _plan(self, f: Figures) -> list[tuple[str, str, int]]:
        got = f.plan.cache.get(self.name)
        if got is None:
            got = []
            for i, k in enumerate(f.plan.keys):
                for m in self.p.logit_bands:
                    if k == m or (k.startswith(m + "/layer_") and k[len(m) + 7:].isdigit()):
                        got.append((m, k, i))
            got = f.plan.cache[self.name] = got
        return got

    def check(self, f: Figures) -> list[Change]:
        items = self._plan(f)
        p = self.p
        stride = max(1, p.group_window // 16)
        if f.warm or not items or 0 <= f.t - self.last_t < stride:
            return []       # logged more often than a stride: judged once per stride
        self.last_t = f.t
        s, out = f.step, []
        windows = (p.group_window, 4 * p.group_window)
        hits: dict[str, tuple] = {}
        for m, k, i in items:
            v = float(f.vals[i])
            if not (v > 0 and math.isfinite(v)):
                continue
            b = self.bands.get(k)
            if b is None:
                b = self.bands[k] = DriftBand()
            band = p.logit_bands[m]
            if b.observe(s, f.t, math.log(v), band, p.group_jump, p.group_z, p.group_drift_k,
                         windows, p.drift_memory, p.group_confirm, p.hysteresis) and b.sign > 0:
                size = (math.log(v) - b.anchor) / math.log(band)
                if m not in hits or size > hits[m][0]:
                    hits[m] = (size, k, v, math.exp(b.anchor), b)
        for m in p.logit_bands:
            hit = hits.get(m)
            if hit is None:
                if ("logits", m) in f.open:
                    out.append(release("logits", m))
                continue
            _, k, v, ref, b = hit
            attn = "attn" in m
            how = (f"moved {math.exp(abs(b.stat)):.2f}x in one sample (>= group_jump = {p.group_jump:g}x)"
                   if b.kind == "jump" else
                   f"moved {math.exp(abs(b.stat)):.2f}x in one sample (beyond its band "
                   f"logit_bands[{m!r}] = {p.logit_bands[m]:g}x)" if b.kind == "step" else
                   f"rose {math.exp(abs(b.stat)):.2f}x over the last {b.window} steps, beyond "
                   f"group_drift_k = {p.group_drift_k:g} x the rise it showed before and its band "
                   f"logit_bands[{m!r}] = {p.logit_bands[m]:g}x")
            out.append(set_("logits", k, Level.YELLOW, v, ref, v / ref,
                            f"{k} = {v:.4g} is {v / ref:.2f}x the level it left ({ref:.4g}): it {how}.",
                            f"{k} started growing", key=m,
                            onset=None if f.active("logits", m) is not None else b.onset,
                            prescription="attn_logit_growth" if attn else "logit_drift",
                            details={"kind": b.kind}))
        return out

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        for b in self.bands.values():
            b.rollback(t_to)
        self.last_t = -(10 ** 9)
        return []


class RouterRule(RuleBase):
    """MoE router collapse: a router figure far above its own baseline.

    For each ``(metric, excess)`` of ``Policy.router_bands`` (e.g.
    ``moe/maxvio.max``, ``moe/dead_expert_ratio``): baseline ``b`` = median
    over the baseline window, spread ``mad`` = 1.4826 x its median absolute
    deviation; out when ``x - b > max(router_z * mad, excess)`` at every check
    for ``router_steps`` steps -> YELLOW (METRICS.md §6 has no row: the
    prescription is the §2 router one). Released when back within the band.
    """

    name = "router"
    state_fields = ("cols",)

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.cols: dict[str, list] = {}  # metric -> [samples, b, mad, first out step]

    def check(self, f: Figures) -> list[Change]:
        present = f.plan.cache.get(self.name)
        if present is None:
            present = f.plan.cache[self.name] = any(m in f.plan.named for m in self.p.router_bands)
        if f.warm or not present:
            return []
        p, s, out = self.p, f.step, []
        end = f.start + p.baseline_steps
        for m, excess in p.router_bands.items():
            v = f.get(m)
            if v is None or not math.isfinite(v):
                continue
            c = self.cols.get(m)
            if c is None:
                c = self.cols[m] = [[], _NAN, _NAN, None]
            if c[1] != c[1]:
                if f.t < end or len(c[0]) < p.baseline_min_samples:
                    c[0].append(v)
                if len(c[0]) >= p.baseline_min_samples and f.t >= end - 1:
                    b = median(c[0])
                    c[1], c[2] = b, 1.4826 * median([abs(z - b) for z in c[0]])
                    c[0] = []
                continue
            band = max(p.router_z * c[2], excess)
            is_open = f.active("router", m) is not None
            if v - c[1] > (p.hysteresis * band if is_open else band):
                if c[3] is None:
                    c[3] = s
                if is_open or s - c[3] >= p.router_steps:
                    out.append(set_("router", m, Level.YELLOW, v, c[1], v / c[1] if c[1] else _NAN,
                                    f"{m} = {v:.4g} has been above its baseline {c[1]:.4g} by more "
                                    f"than {band:.3g} since step {c[3]}: the router is collapsing "
                                    "onto a few experts.", f"{m} rose", onset=c[3],
                                    prescription="router_collapse"))
            else:
                c[3] = None
                out.append(release("router", m))
        return out

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        for c in self.cols.values():
            c[3] = None
        return []


class LossScaleRule(RuleBase):
    """YELLOW when the loss scale falls ``>= loss_scale_drop`` x between two
    consecutive checks, or collapses: ``>= loss_scale_drop`` x below its peak,
    ``peak = max(peak * 0.5 ** (dt / event_hold_steps), x)`` (a dynamic scale
    halves at each overflow and doubles after a run of finite steps: a healthy
    fp16 run swings 2-4x around its level, a collapse falls step after step);
    closes ``event_hold_steps`` after the last drop."""

    name = "loss_scale"
    state_fields = ("prev", "drop", "peak")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.prev = _NAN
        self.drop: dict[str, Any] | None = None
        self.peak = [_NAN, 0]   # the decaying peak, its step

    def check(self, f: Figures) -> list[Change]:
        p, s, out = self.p, f.step, []
        m = p.loss_scale_metric
        v = f.get(m)
        if v is not None and math.isfinite(v) and v > 0:
            prev, (peak, t0) = self.prev, self.peak
            if peak != peak or v >= peak:
                peak = v
            else:
                peak = max(peak * 0.5 ** ((s - t0) / max(p.event_hold_steps, 1)), v)
            self.peak = [peak, s]
            one = prev == prev and prev / v >= p.loss_scale_drop
            if not f.warm and (one or peak / v >= p.loss_scale_drop):
                first = self.drop["onset"] if self.drop else s
                self.drop = {"step": s, "onset": first}
                ref, how = (prev, "in one check") if one else (peak, "from its recent peak")
                out.append(set_("loss_scale", m, Level.YELLOW, v, ref, v / ref,
                                f"{m} fell {ref / v:g}x {how} ({ref:g} -> {v:g}) at step {s} "
                                f"(>= Policy.loss_scale_drop = {p.loss_scale_drop:g}x): gradients "
                                "overflow float16 again and again.", f"{m} fell {ref / v:g}x",
                                onset=first))
            self.prev = v
        if self.drop is not None and s - self.drop["step"] >= p.event_hold_steps:
            out.append(clear("loss_scale", m))
            self.drop = None
        return out

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        self.prev, self.drop, self.peak = _NAN, None, [_NAN, 0]
        return []


class GapRule(RuleBase):
    """Train/val gap growing faster than before, beyond its noise.

    The gap ``g`` is ``val/gap`` or ``val/loss`` minus the train loss's level:
    ``2 e1 - e2`` with ``e1`` an EMA of the loss (half-life ``trend_halflife``,
    each sample clipped to 1.5x the spike tracker's trend) and ``e2`` an EMA of
    ``e1`` (Brown's double smoothing: no lag on a falling loss, which would
    otherwise read as a growing gap as the fall slows); its samples (from
    ``start + baseline_steps`` on) are smoothed by an EMA of half-life
    ``val_gap_halflife`` steps. With ``W = val_gap_window``::

        recent = g(t) - g(t-W),  before = g(t-W) - g(t-2W)  (0 before 2W of history)
        excess = recent - val_gap_ratio * max(before, 0)
        YELLOW when excess > floor = max(val_gap_min_growth * |loss|, gap_z * sd(excess))
               and g(t) > floor + the highest gap of the samples kept before t - W
               at gap_confirm consecutive samples

    (the second condition: a gap that dipped and came back, as healthy runs'
    gaps wander, is no growth).

    ``sd(excess)``: the raw samples' noise ``var = EMA((g_i - 2 g_{i-1} +
    g_{i-2})^2 / 6)`` (second differences: blind to a steady trend; learned
    while the rule does not hold) through the EMA, ``var_e = var * (1 - a) / (1 + a)`` (``a``
    its per-sample decay), and the three independent window ends,
    ``var_e * (1 + (1 + r)^2 + r^2)`` (``r = val_gap_ratio`` when ``before >
    0``, else ``2 var_e``).
    """

    name = "val_gap"
    state_fields = ("gap", "ema", "t_last", "raw_prev", "var", "decay", "run", "onset", "last_loss",
                    "level")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.gap = GapSeries()
        self.ema = _NAN
        self.t_last = 0
        self.raw_prev = [_NAN, _NAN]
        self.var = _NAN
        self.decay = _NAN
        self.run = 0
        self.onset: int | None = None
        self.last_loss = _NAN
        self.level = [_NAN, _NAN, 0]   # e1, e2, t of the last loss

    def _train_level(self, f: Figures) -> float:
        """``2 e1 - e2`` of the loss (see the class doc); NaN before any loss."""
        loss = f.get("loss")
        e1, e2, t0 = self.level
        if e1 == e1 and 0 <= f.t - t0 < max(1, self.p.trend_halflife / 10) and f.get("val/loss") is None \
                and f.get("val/gap") is None:
            return 2.0 * e1 - e2      # a sample per trend_halflife / 10 steps is enough
        if loss is not None and math.isfinite(loss):
            self.last_loss = loss
            trend = f.notes.get("loss_trend", _NAN)
            x = min(loss, 1.5 * trend) if trend == trend and trend > 0 else loss
            if e1 != e1:
                e1 = e2 = x
            else:
                a = 0.5 ** (max(f.t - t0, 1) / self.p.trend_halflife)
                e1 = a * e1 + (1.0 - a) * x
                e2 = a * e2 + (1.0 - a) * e1
            self.level = [e1, e2, f.t]
        return 2.0 * e1 - e2

    def check(self, f: Figures) -> list[Change]:
        p, s, t = self.p, f.step, f.t
        loss_ref = self._train_level(f)
        g = f.get("val/gap")
        vl = f.get("val/loss")
        if g is None and vl is not None:
            g = vl - loss_ref if loss_ref == loss_ref else None
        if g is None or not math.isfinite(g) or f.start is None or t < f.start + p.baseline_steps:
            return []
        w = p.val_gap_window
        r0, r1 = self.raw_prev
        if r1 == r1 and self.run == 0:  # the noise: learned while the rule does not hold
            d2 = (g - 2.0 * r0 + r1) ** 2 / 6.0
            self.var = d2 if self.var != self.var else 0.9 * self.var + 0.1 * d2
        self.raw_prev = [g, r0]
        if self.ema != self.ema or p.val_gap_halflife == 0:
            self.ema = g
            a = 0.0
        else:
            a = 0.5 ** (max(t - self.t_last, 1) / p.val_gap_halflife)
            self.ema = a * self.ema + (1.0 - a) * g
        self.decay = a
        self.t_last = t
        g = self.ema
        self.gap.add(t, g, 2 * w)
        if not self.gap.covers(t - w):
            return []
        g1 = self.gap.at(t - w)
        # Before 2W of history, the growth before counts as none: the rule then asks for
        # a growth beyond its floor alone (a gap that grew from the start, as a repeated
        # data shard makes it).
        before = g1 - self.gap.at(t - 2 * w) if self.gap.covers(t - 2 * w) else 0.0
        recent = g - g1
        level_ref = abs(loss_ref) if loss_ref == loss_ref else (
            abs(vl) if vl is not None and math.isfinite(vl) else 0.0)
        var_e = (self.var if self.var == self.var else 0.0) * (1.0 - a) / (1.0 + a)
        r = p.val_gap_ratio
        var_x = var_e * (1.0 + (1.0 + r) ** 2 + r * r) if before > 0 else 2.0 * var_e
        floor = max(p.val_gap_min_growth * level_ref, p.gap_z * math.sqrt(var_x))
        high = self.gap.max_before(t - w)       # the highest gap of the history kept before t - W
        if recent > r * max(before, 0.0) + floor and g - high > floor:
            self.run += 1
            if self.run == 1:
                self.onset = s
            if self.run < p.gap_confirm and f.active("val_gap", "val/gap") is None:
                return []
            ratio = recent / before if before > 0 else math.inf
            return [set_("val_gap", "val/gap", Level.YELLOW, g, g1, ratio,
                         f"the train/val gap grew by {recent:.4g} over the last {w} steps vs "
                         f"{before:.4g} over the {w} before (> val_gap_ratio = {r:g}x, plus a floor "
                         f"{floor:.2g}: val_gap_min_growth = {p.val_gap_min_growth:g} x the loss, "
                         f"gap_z = {p.gap_z:g} noise sd {math.sqrt(var_x):.2g}); gap now {g:.4g}, "
                         f"above its earlier high {high:.4g} by more than that floor.",
                         "the train/val gap accelerated", onset=self.onset,
                         details={"recent_growth": recent, "previous_growth": before,
                                  "noise_sd": math.sqrt(var_x)})]
        self.run = 0
        return [clear("val_gap", "val/gap")]

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        self.gap.drop_after(t_to)
        self.ema = self.gap.gs[-1] if self.gap.gs else _NAN
        self.t_last = self.gap.ts[-1] if self.gap.ts else 0
        self.raw_prev, self.run, self.onset = [_NAN, _NAN], 0, None
        return []


class ValRiseRule(RuleBase):
    """Val loss rising while the train loss falls (METRICS.md §6, fourth row).

    Over the ``val_rise_window`` steps before each ``val/loss`` sample (at
    least ``val_rise_min_samples`` samples, after the baseline start)::

        YELLOW when Mann-Kendall z(val) > val_rise_z, the val loss's Theil-Sen
               rise over the window >= val_rise_min (relative), and the loss
               trend (``notes['loss_trend']`` at those samples) has a negative
               Theil-Sen slope

    at ``gap_confirm`` consecutive val samples. Quicker than the gap rule's
    two 1000-step windows, which an early overfit outruns. Released when the
    condition fails.
    """

    name = "val_rise"
    state_fields = ("ts", "val", "trend", "run", "onset")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.ts: collections.deque[int] = collections.deque()
        self.val: collections.deque[float] = collections.deque()
        self.trend: collections.deque[float] = collections.deque()
        self.run = 0
        self.onset: int | None = None

    def check(self, f: Figures) -> list[Change]:
        p = self.p
        v = f.get("val/loss")
        trend = f.notes.get("loss_trend", _NAN)
        if f.warm or v is None or not math.isfinite(v) or trend != trend:
            return []
        t, s = f.t, f.step
        self.ts.append(t)
        self.val.append(v)
        self.trend.append(trend)
        while self.ts and self.ts[0] < t - p.val_rise_window:
            self.ts.popleft()
            self.val.popleft()
            self.trend.popleft()
        n = len(self.ts)
        if n < p.val_rise_min_samples:
            return []
        u = np.fromiter(self.ts, np.float64, n)
        y = np.fromiter(self.val, np.float64, n)
        z = mann_kendall_z(y)
        rise = theil_sen(u, y) * (u[-1] - u[0]) / abs(float(np.median(y)))
        lslope = theil_sen(u, np.fromiter(self.trend, np.float64, n))
        is_open = ("val_rise", "val/loss") in f.open
        active = f.active("val_rise", "val/loss") is not None
        if z > p.val_rise_z and rise >= p.val_rise_min and lslope < 0:
            self.run += 1
            if self.run == 1:
                self.onset = s
            if self.run < p.gap_confirm and not active:
                return []
            return [set_("val_rise", "val/loss", Level.YELLOW, v, float(y[0]), v / float(y[0]),
                         f"val/loss has been rising ({100 * rise:.1f}% over the last "
                         f"{int(u[-1] - u[0])} steps, Mann-Kendall z = {z:.1f}) while the train "
                         "loss still falls.", "val/loss started rising", onset=self.onset,
                         details={"mann_kendall_z": z, "rise": rise})]
        self.run = 0
        return [release("val_rise", "val/loss")] if is_open else []

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        while self.ts and self.ts[-1] > t_to:
            self.ts.pop()
            self.val.pop()
            self.trend.pop()
        self.run, self.onset = 0, None
        return []


class BrokenModelRule(RuleBase):
    """A broken model goes RED fast (METRICS.md §5 red tier, fast path).

    Broken at a check (after the baseline start) when

    - the loss is at chance level: ``loss >= broken_chance_frac * C`` while
      its pre-spike trend was below ``broken_chance_frac ** 2 * C``, with
      ``C = log(V)`` (``V`` = ``Policy.vocab_size`` or the ``vocab_metric``
      figure) or, without ``V``, the first loss the monitor saw (a run from
      scratch starts at chance; a resumed one at its starting point, which a
      broken model also falls back to); or
    - the param norm jumped: ``>= broken_param_jump`` x its value
      ``broken_jump_window`` steps earlier.

    A param-norm jump is ORANGE at once and RED once it has held at every
    check for ``broken_steps`` steps; a chance-level loss alone is YELLOW at
    once when it is at least 1.5x its pre-spike trend (the loss rule of OLMo-core
    fires there too; one such batch then recovers: it closes), ORANGE once
    it has held ``broken_steps // 2`` steps (a physiological spike recovers
    sooner) and RED after ``broken_loss_steps`` (a stretch of bad data, whose
    loss is at chance however healthy the model, is over sooner; the weights
    did not move). It clears when the loss is back
    below its threshold and the param norm below ``1 + (broken_param_jump -
    1) / 2`` x its pre-jump value.
    """

    name = "broken_model"
    state_fields = ("pn", "vocab", "first_loss", "state")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.pn: collections.deque[tuple[int, float]] = collections.deque()
        self.vocab = _NAN
        self.first_loss = _NAN
        self.state: dict[str, Any] | None = None  # {"since", "checks", "pn_ref", "kind"}

    def check(self, f: Figures) -> list[Change]:
        p, s = self.p, f.step
        if p.vocab_size is None:
            v = f.get(p.vocab_metric)
            if v is not None and v > 1 and math.isfinite(v):
                self.vocab = v
        vocab = float(p.vocab_size) if p.vocab_size is not None else self.vocab
        loss, pn = f.get("loss"), f.get("param/global_norm")
        if loss is not None and math.isfinite(loss) and self.first_loss != self.first_loss:
            self.first_loss = loss
        if f.warm:
            return []
        chance = math.log(vocab) if vocab == vocab else self.first_loss
        st = self.state
        pre = st["pre"] if st is not None else f.notes.get("loss_pre", _NAN)
        loss_bad = None
        if loss is not None and math.isfinite(loss) and chance == chance and chance > 0:
            loss_bad = (loss >= p.broken_chance_frac * chance
                        and pre < p.broken_chance_frac ** 2 * chance)
        pn_bad, pn_ref = None, _NAN
        if pn is not None and math.isfinite(pn) and pn > 0:
            if st is not None and st["pn_ref"] is not None:
                pn_bad = pn >= (1.0 + 0.5 * (p.broken_param_jump - 1.0)) * st["pn_ref"]
            else:
                q = self.pn
                while len(q) > 1 and q[1][0] <= s - p.broken_jump_window:
                    q.popleft()
                if q:
                    pn_ref = q[0][1]
                    pn_bad = pn >= p.broken_param_jump * pn_ref
                q.append((s, pn))
        if st is None:
            if not (loss_bad or pn_bad):
                return [release("broken_model", "")] if ("broken_model", "") in f.open else []
            st = self.state = {"since": s, "checks": 0, "pn_ref": pn_ref if pn_bad else None,
                               "kind": "param" if pn_bad else "loss", "pre": pre}
        else:
            if pn_bad and st["pn_ref"] is None:
                st["pn_ref"], st["kind"] = pn_ref, "param"
            seen = [x for x in (loss_bad, pn_bad) if x is not None]
            if not seen:
                return []  # neither figure at this check: hold
            if not any(seen):
                self.state = None
                return [release("broken_model", "")]
        st["checks"] += 1
        held = s - st["since"]
        if held >= (p.broken_steps if st["kind"] == "param" else p.broken_loss_steps):
            lvl = Level.RED
        elif st["kind"] == "param" or held >= p.broken_steps // 2:
            lvl = Level.ORANGE
        elif loss is not None and loss >= 1.5 * st["pre"]:
            lvl = Level.YELLOW   # at chance from well below: garbage data or a broken model, at once
        else:
            return []  # a loss at chance level must hold a while (a physiological spike does not)
        if st["kind"] == "param":
            metric, value, ref = "param/global_norm", pn, st["pn_ref"]
            what = (f"param/global_norm jumped to {value:.4g} from {ref:.4g} "
                    f"({value / ref:.2f}x within {p.broken_jump_window} steps)"
                    if value is not None else "param/global_norm jumped")
        else:
            metric, value, ref = "loss", loss, chance
            src_ = "log vocab" if vocab == vocab else "the first loss seen"
            what = ("loss is at chance level" if value is None else
                    f"loss {value:.4g} is back at chance level ({src_} = {ref:.4g}; pre-spike "
                    f"trend {st['pre']:.4g})")
        value = _NAN if value is None else float(value)
        ratio = value / ref if ref and ref == ref else _NAN
        red_at = st["since"] + (p.broken_steps if st["kind"] == "param" else p.broken_loss_steps)
        tail = (f"not recovered after {held} steps: the model is broken, roll back."
                if lvl == Level.RED else f"RED if it has not recovered by step {red_at}.")
        if lvl == Level.YELLOW:
            tail = (f"a batch of garbage, or a broken model: ORANGE if it holds until step "
                    f"{st['since'] + p.broken_steps // 2}, {tail} (Policy.broken_chance_frac, "
                    "broken_steps, broken_loss_steps)")
        return [set_("broken_model", metric, lvl, value, ref, ratio, f"{what}; {tail}",
                     f"{metric} broke", key="", onset=st["since"], diverging=False,
                     details={"since": st["since"], "kind": st["kind"]})]

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        self.pn.clear()
        self.state = None
        return []


class DivergenceRule(RuleBase):
    """RED after ``red_after`` consecutive divergent checks lasting at least
    ``red_min_steps`` steps. A check is divergent when it confirmed an ORANGE
    condition (or the loss far above its pre-spike trend); it breaks the run
    only if it re-observed every condition that was divergent and found none
    (a check that did not see them holds). The RED is released once those
    conditions are back in their bands (their alerts closed or clearing)."""

    name = "divergence"
    state_fields = ("consecutive", "start", "keys")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.consecutive = 0
        self.start: int | None = None
        self.keys: set[tuple[str, str]] = set()

    def check(self, f: Figures) -> list[Change]:
        p, s = self.p, f.step
        recovered = False
        div = f.diverging
        if div:
            self.consecutive += 1
            if self.consecutive == 1:
                self.start = s
            # An ORANGE confirmed over a run of checks counts that run (its checks were
            # above the orange ratio: divergent before the confirmation said so).
            for checks, first in f.notes.get("orange_run", {}).values():
                if checks > self.consecutive:
                    self.consecutive, self.start = checks, first
            self.keys = {k for k, _ in div}
        elif self.keys and self.keys <= f.touched:
            self.consecutive, self.start = 0, None
            # Recovered once every divergent condition is back in its band (its alert
            # closed or clearing), not merely below ORANGE: the RED episode holds.
            if all(a is None or a.clearing_since is not None
                   for a in (f.open.get(k) for k in self.keys)):
                self.keys, recovered = set(), True
        red_open = f.active("divergence", "") is not None
        if div and (red_open or (self.consecutive >= p.red_after
                                 and s - self.start >= p.red_min_steps)):
            lead = min((a for _, a in div), key=lambda a: (a.onset_step, a.id))
            return [set_("divergence", lead.metric, Level.RED, lead.value, lead.baseline,
                         lead.ratio,
                         f"unrecovered divergence for {self.consecutive} consecutive checks since "
                         f"step {self.start} (lead: {lead.rule} on {lead.metric}, onset step "
                         f"{lead.onset_step}).", f"{lead.metric} diverged",
                         onset=lead.onset_step, key="",
                         details={"consecutive_checks": self.consecutive,
                                  "first_divergent_step": self.start,
                                  "lead_alert": lead.id, "lead_rule": lead.rule})]
        if red_open and not div and (recovered or not self.keys):
            return [release("divergence", "")]
        return []

    def rollback(self, step: int, t_to: int) -> list[Spike]:
        self.consecutive, self.start, self.keys = 0, None, set()
        return []


def default_rules(policy: Policy) -> list[Any]:
    """The default rule list, in the order ``Monitor.update`` runs it."""
    return [NonFiniteRule(policy), EarlyRule(policy), DataRule(policy), WindowSpikes(policy), SpikeRule(policy),
            RatioRule(policy),
            TrendRule(policy), JumpRule(policy), GroupRule(policy), LogitRule(policy), RouterRule(policy),
            ThroughputRule(policy), SkipRule(policy), LossScaleRule(policy), GapRule(policy), ValRiseRule(policy),
            BrokenModelRule(policy), DivergenceRule(policy), ReplicaRule(policy)]
