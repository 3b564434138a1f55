"""Host-side monitor: baselines, spikes, gap tracking, tiered verdicts.

The monitor reads the flat metric dict the host fetched at its cadence and
returns a :class:`Verdict` (a :class:`Level` and the open :class:`Alert` s,
each with a likely cause, a prescription from METRICS.md §6 and a ranked
localization). It never acts: saving, pausing and rolling back are the
rollback module's job. Plain Python + NumPy; memory is bounded and
``update`` is O(1) amortized in the number of steps.

Rules (METRICS.md §5 defaults; every number is a :class:`Policy` field)::

    rule            metric(s)                         level
    nonfinite       loss, grad/global_norm non-finite;   ORANGE
                    grad/nonfinite_count > 0
    grad_norm       grad/global_norm / baseline > 2, > 3 YELLOW, ORANGE
    param_norm      param/global_norm / baseline > 1.5   YELLOW
    throughput      sys/tokens_per_sec (else             YELLOW
                    sys/steps_per_sec) down > 30%
    loss_scale      opt/loss_scale falls >= 2**4 between YELLOW
                    two consecutive checks
    val_gap         val/gap (or val/loss - loss trend):  YELLOW
                    g(t) - g(t-W) > 1.5 (g(t-W) - g(t-2W)), W = 1000
                    (samples after warm-up + baseline window)
    loss_spike      a loss spike not back within its     YELLOW
                    recovery band after 300 steps
    periodic_spike  >= 3 spikes at near-regular           YELLOW (ORANGE
                    intervals (loss or grad norm)         when shrinking)
    divergence      red_after consecutive checks with an  RED
                    ORANGE grad-norm/non-finite condition
                    or the loss > 1.25x its pre-spike
                    trend after 500 steps

Example::

    monitor = Monitor()                       # Policy() = METRICS.md §5
    for step in range(num_steps):
        ...
        if step % 50 == 0:
            verdict = monitor.update(step, jax.device_get(metrics))
            if verdict.level >= Level.ORANGE:
                print(verdict.alerts[0].message)
    ckpt["monitor"] = monitor.state_dict()     # JSON-safe, resumes exactly
"""

from __future__ import annotations

import collections
import math
import operator
import re
from typing import Any, Mapping

import numpy as np

from jvitals._monitor_policy import Policy
from jvitals._monitor_trackers import (
    BASELINES,
    FixedBaseline,
    GapSeries,
    LayerHistory,
    SpikeTracker,
    baseline_from_dict,
)
from jvitals._monitor_types import (
    PRESCRIPTIONS,
    RULE_PRESCRIPTION,
    Alert,
    Level,
    Localization,
    Prescription,
    Spike,
    Verdict,
    dec_float,
    enc_float,
)

__all__ = [
    "Alert",
    "Level",
    "Localization",
    "Monitor",
    "PRESCRIPTIONS",
    "Policy",
    "Prescription",
    "RULE_PRESCRIPTION",
    "Spike",
    "Verdict",
]

_NAN = math.nan
_RATIO_RULE_IDS = {"grad/global_norm": "grad_norm", "param/global_norm": "param_norm"}
_SCORE_NAMES = {"loss": "monitor/loss_spike_score",
                "grad/global_norm": "monitor/grad_norm_spike_score"}
_FORMAT_VERSION = 1


def _as_step(step: Any, what: str = "step") -> int:
    if isinstance(step, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, got the bool {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(step).__name__} {step!r}") from None


def _check_value(name: Any, v: Any) -> None:
    """Raises a TypeError naming the metric if ``v`` is not a real scalar."""
    if not isinstance(name, str):
        raise TypeError(f"metric names must be str, got {type(name).__name__} {name!r}")
    if isinstance(v, (int, float)):
        return
    dtype = getattr(v, "dtype", None)
    shape = getattr(v, "shape", None)
    if dtype is not None and shape is not None:
        if tuple(shape) != ():
            raise TypeError(f"metric {name!r}: expected a scalar (0-d) value, got an array of shape "
                            f"{tuple(shape)}; reduce it or log one name per element")
        if np.dtype(dtype).kind not in "biuf":
            raise TypeError(f"metric {name!r}: expected a real number, got dtype {dtype}")
        return
    raise TypeError(f"metric {name!r}: expected a real number (Python float/int, NumPy scalar or "
                    f"0-d array), got {type(v).__name__} {v!r:.60}")


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


class Monitor:
    """Learns baselines from the run and turns metrics into verdicts.

    ``update(step, metrics)`` reads the metrics it knows (see
    :class:`Policy` and the module docstring) and every per-layer metric
    matching ``Policy.localize_pattern`` (e.g. ``grad/share/layer_1``,
    ``grad/norm/layer_3``, ``param/norm/layer_0``,
    ``act/hidden_states_rms/layer_2``); other names are ignored.

    Alerts: one object per ongoing condition ``(rule, metric)``, updated in
    place (same ``id``); level changes within it; it closes when the
    condition has been clear for ``Policy.clear_steps`` steps (ratio,
    throughput, non-finite, divergence) or at once (spike, periodic, gap;
    the loss-scale alert after ``event_hold_steps``), then moves to
    :attr:`history`.

    Missing metrics: a rule whose metric is absent at a step keeps its
    state (its alert neither updates nor closes). Steps must increase;
    gaps are fine (trends decay with the steps elapsed).

    Rollbacks: see :meth:`note_rollback`. Resuming: :meth:`state_dict` /
    :meth:`from_state_dict`.

    Attributes:
      policy: the :class:`Policy`.
      alerts: the open alerts (most severe first).
      history: closed alerts, oldest first (``Policy.history_size`` kept).
      spikes: completed :class:`Spike` records (``Policy.spikes_size``).
      step: the last step seen (``None`` before the first update).
    """

    def __init__(self, policy: Policy | None = None) -> None:
        if policy is None:
            policy = Policy()
        if not isinstance(policy, Policy):
            raise TypeError(f"Monitor expects a jvitals Policy, got {type(policy).__name__}")
        p = self.policy = policy
        self._pattern = re.compile(p.localize_pattern)
        self._last_step: int | None = None
        self._offset = 0
        self._segments: list[tuple[int, int]] = []
        self._next_id = 0
        self._open: dict[tuple[str, str], Alert] = {}
        self._events: dict[int, str] = {}  # open alert id -> onset event phrase
        self._history: collections.deque[Alert] = collections.deque(maxlen=p.history_size)
        self._spikes: collections.deque[Spike] = collections.deque(maxlen=p.spikes_size)
        self._consecutive = 0
        self._div_start: int | None = None
        self._div_keys: set[tuple[str, str]] = set()  # divergent at the last divergent check
        self._ratio = {m: BASELINES[p.baseline]() for m in p.ratio_rules}
        self._throughput = {m: FixedBaseline() for m in p.throughput_metrics}
        self._spike = {m: SpikeTracker(m, p) for m in p.spike_metrics}
        self._ls_prev = _NAN
        self._ls_drop: dict[str, Any] | None = None
        self._gap = GapSeries()
        self._gap_ema = _NAN
        self._gap_t = 0
        self._last_loss = _NAN
        self._layers = LayerHistory(p.localize_rows, max(1, p.localize_window // p.localize_rows))
        self._score_names = {m: _SCORE_NAMES.get(m, "monitor/" + m.replace("/", "_") + "_spike_score")
                             for m in p.spike_metrics}
        self._watched = (set(p.nonfinite_metrics) | set(p.nonfinite_count_metrics)
                         | set(p.ratio_rules) | set(p.throughput_metrics) | set(p.spike_metrics)
                         | {p.loss_scale_metric, "loss", "val/loss", "val/gap"})
        self._plan_keys: tuple | None = None
        self._plan_named: dict[str, int] = {}
        self._plan_pos = np.zeros(0, np.intp)
        self._plan_cols = np.zeros(0, np.intp)
        # Per-check scratch.
        self._new: list[Alert] = []
        self._closed: list[Alert] = []
        self._div: list[tuple[tuple[str, str], Alert]] = []
        self._touched: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------
    # Public read-only views.
    # ------------------------------------------------------------------

    @property
    def alerts(self) -> list[Alert]:
        return sorted(self._open.values(), key=lambda a: (-a.level, a.onset_step, a.id))

    @property
    def history(self) -> list[Alert]:
        return list(self._history)

    @property
    def spikes(self) -> list[Spike]:
        return list(self._spikes)

    @property
    def step(self) -> int | None:
        return self._last_step

    def baseline(self, metric: str) -> float | None:
        """The learned baseline of a ratio-rule, throughput or per-layer
        metric (``None`` while it is still being learned or unknown)."""
        b = self._ratio.get(metric) or self._throughput.get(metric)
        if b is not None:
            m = getattr(b, "mean", None)
            if m is None:  # rolling
                vals = getattr(b, "vals", ())
                m = math.fsum(vals) / len(vals) if len(vals) >= self.policy.adaptive_min_samples else _NAN
            return None if m != m else float(m)
        c = self._layers.index.get(metric)
        if c is not None and not np.isnan(self._layers.mean[c]):
            return float(self._layers.mean[c])
        return None

    # ------------------------------------------------------------------
    # Reading metrics.
    # ------------------------------------------------------------------

    def _make_plan(self, keys: tuple, metrics: Mapping[str, Any]) -> None:
        for k in keys:
            _check_value(k, metrics[k])
        named, pos, cols = {}, [], []
        for i, k in enumerate(keys):
            if k in self._watched:
                named[k] = i
            if self._pattern.search(k):
                c = self._layers.column(k, self.policy.localize_max_metrics)
                if c >= 0:
                    pos.append(i)
                    cols.append(c)
        self._plan_named = named
        self._plan_pos = np.asarray(pos, np.intp)
        self._plan_cols = np.asarray(cols, np.intp)
        self._plan_keys = keys

    def _read(self, metrics: Mapping[str, Any]) -> np.ndarray:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"Monitor.update expects a mapping of metric name -> scalar, got "
                            f"{type(metrics).__name__}")
        keys = tuple(metrics)
        if keys != self._plan_keys:
            self._make_plan(keys, metrics)
        try:
            vals = np.fromiter(metrics.values(), np.float64, len(keys))
        except (TypeError, ValueError) as e:
            for k in keys:
                _check_value(k, metrics[k])
            raise TypeError(f"Monitor.update could not read the metrics as floats: {e}") from e
        if np.isnan(vals).any():  # NumPy reads None as NaN: check those values.
            for i in np.flatnonzero(np.isnan(vals)):
                _check_value(keys[i], metrics[keys[i]])
        return vals

    # ------------------------------------------------------------------
    # Alert bookkeeping.
    # ------------------------------------------------------------------

    def _set(self, rule: str, metric: str, level: Level, s: int, value: float, baseline: float,
             ratio: float, headline: str, event: str, onset: int | None = None,
             details: dict[str, Any] | None = None, key: str | None = None) -> Alert:
        """Opens or updates the alert ``(rule, key or metric)``."""
        k = (rule, metric if key is None else key)
        self._touched.add(k)
        pres = PRESCRIPTIONS[RULE_PRESCRIPTION.get(rule, "generic")]
        a = self._open.get(k)
        if a is None:
            a = Alert(id=self._next_id, rule=rule, metric=metric, level=level, step=s,
                      value=value, baseline=baseline, ratio=ratio,
                      onset_step=s if onset is None else onset, opened_step=s, message="",
                      cause=pres.cause, prescription=pres.prescription, localization=[],
                      peak_level=level, details=dict(details or {}))
            self._next_id += 1
            self._open[k] = a
            self._new.append(a)
            self._events[a.id] = event
            a.localization = self._localize(a, event)
        else:
            a.metric, a.level, a.step, a.value, a.baseline, a.ratio = (
                metric, level, s, value, baseline, ratio)
            if onset is not None:
                a.onset_step = onset
            if details is not None:
                a.details = dict(details)
            a.clearing_since = None
            if level > a.peak_level:
                a.peak_level = level
                # Leads are measured to the onset, so keep the onset's event.
                a.localization = self._localize(a, self._events.get(a.id, event))
        lead = f" Lead: {a.localization[0].line}." if a.localization else ""
        a.message = (f"[{a.level.name}] {headline} Likely cause: {pres.cause}. "
                     f"Prescription: {pres.prescription}.{lead}")
        if level >= Level.ORANGE and rule not in ("periodic_spike", "divergence"):
            self._div.append((k, a))
        return a

    def _clear(self, rule: str, key: str, s: int) -> None:
        self._touched.add((rule, key))
        a = self._open.pop((rule, key), None)
        if a is not None:
            self._events.pop(a.id, None)
            a.closed_step = s
            self._history.append(a)
            self._closed.append(a)

    def _release(self, rule: str, key: str, s: int) -> None:
        """The condition of ``(rule, key)`` did not hold at this check: close
        its alert once that has lasted ``Policy.clear_steps`` steps."""
        self._touched.add((rule, key))
        a = self._open.get((rule, key))
        if a is None:
            return
        if a.clearing_since is None:
            a.clearing_since = s
        if s - a.clearing_since >= self.policy.clear_steps:
            self._clear(rule, key, s)

    def _localize(self, a: Alert, event: str) -> list[Localization]:
        if a.rule == "divergence":
            lead = a.details.get("lead_alert")
            for b in self._open.values():
                if b.id == lead:
                    return list(b.localization)
            return []
        return self._layers.rank(a.onset_step, event, a.metric, self.policy)

    # ------------------------------------------------------------------
    # The check.
    # ------------------------------------------------------------------

    def update(self, step: int, metrics: Mapping[str, Any]) -> Verdict:
        """Checks the metrics of one step and returns the verdict.

        Args:
          step: the training step (an int; must be larger than the previous
            ``step`` and than any rollback step noted).
          metrics: flat ``{name: scalar}`` (Python/NumPy scalars, 0-d arrays;
            non-finite values allowed; any subset of names per step).

        Returns:
          A :class:`Verdict`: ``level = max(open alerts' levels)``, the open
          alerts (one object per ongoing condition, updated in place),
          those opened / closed at this step, and the scores to log.

        Raises:
          TypeError: a metric value is not a real scalar (the message names
            the metric), or ``step`` is not an integer.
          ValueError: ``step`` does not increase.
        """
        s = _as_step(step)
        if self._last_step is not None and s <= self._last_step:
            raise ValueError(f"Monitor.update expects increasing steps: got step {s} after step "
                             f"{self._last_step}. Merge metrics of one step into one dict; after a "
                             "restart restore the monitor saved with the checkpoint "
                             "(Monitor.from_state_dict).")
        vals = self._read(metrics)
        p = self.policy
        t = s - self._offset
        warm = t < p.warmup_steps
        self._new, self._closed, self._div = [], [], []
        self._touched = set()
        named = self._plan_named

        def get(name: str) -> float | None:
            i = named.get(name)
            return None if i is None else float(vals[i])

        if self._plan_pos.size:
            self._layers.observe(s, t, self._plan_cols, vals[self._plan_pos], p)

        # Non-finite loss / gradients.
        for m in p.nonfinite_metrics:
            v = get(m)
            if v is None:
                continue
            if math.isfinite(v):
                self._release("nonfinite", m, s)
            else:
                self._set("nonfinite", m, Level.ORANGE, s, v, _NAN, _NAN,
                          f"{m} is non-finite ({v}).", f"{m} went non-finite")
        for m in p.nonfinite_count_metrics:
            v = get(m)
            if v is None:
                continue
            if v == 0:
                self._release("nonfinite", m, s)
            else:
                self._set("nonfinite", m, Level.ORANGE, s, v, 0.0, _NAN,
                          f"{m} = {v:g}: gradients hold non-finite elements.",
                          "gradients went non-finite")

        # Spike trackers (trend, anatomy, periodicity, score).
        seen: dict[str, float] = {}
        for m, tr in self._spike.items():
            v = get(m)
            if v is None or not math.isfinite(v):
                continue
            seen[m] = v
            self._spikes.extend(tr.observe(s, v, warm, p))
        for m in p.spike_alert_metrics:
            tr = self._spike.get(m)
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
                    self._clear("loss_spike", m, s)
                continue
            ratio = v / ref if ref > 0 else _NAN
            a = self._set("loss_spike", m, Level.YELLOW, s, v, ref, ratio,
                          f"{m} spike at step {onset} not back to trend after {s - onset} steps: "
                          f"{v:.4g} vs pre-spike trend {ref:.4g} ({ratio:.2f}x).",
                          f"{m} spiked", onset=onset)
            if o is None and ref > 0 and v > p.divergence_loss_ratio * ref:
                self._div.append((("loss_spike", m), a))
        for m, tr in self._spike.items():
            if m not in seen:
                continue
            per = tr.periodic
            if per is None:
                self._clear("periodic_spike", m, s)
                continue
            lvl = Level.ORANGE if per["shrinking"] else Level.YELLOW
            shrink = ", intervals shrinking" if per["shrinking"] else ""
            self._set("periodic_spike", m, lvl, s, float(per["period"]), _NAN, _NAN,
                      f"{per['count']} {m} spikes at near-regular intervals, period ~"
                      f"{per['period']:.0f} steps{shrink} (intervals {per['intervals']}); last "
                      f"onset at step {per['last_onset']}.",
                      f"{m} spikes turned periodic", onset=per["first_onset"],
                      details={"period": float(per["period"]), "count": per["count"],
                               "intervals": list(per["intervals"]),
                               "shrinking": per["shrinking"], "last_onset": per["last_onset"]})

        # Ratio rules (grad norm, param norm, user-configured).
        for m, (y, o) in p.ratio_rules.items():
            v = get(m)
            if v is None:
                continue
            if not math.isfinite(v):
                continue
            ref, gate = self._ratio[m].step(t, s, v, p)
            if ref is None or not ref > 0:
                continue
            ratio = v / ref
            rule = _RATIO_RULE_IDS.get(m, "ratio")
            cur = self._open.get((rule, m))
            lvl = _hysteresis_level(ratio, y, o, cur.level if cur else Level.GREEN, gate,
                                    p.hysteresis)
            if lvl == Level.GREEN:
                self._release(rule, m, s)
                continue
            thr = o if lvl == Level.ORANGE else y
            orange = f", orange > {o:g}x" if o is not None else ""
            self._set(rule, m, lvl, s, v, ref, ratio,
                      f"{m} = {v:.4g} is {ratio:.2f}x its baseline {ref:.4g} (yellow > {y:g}x"
                      f"{orange}).", f"{m} crossed {thr:g}x")

        # Throughput.
        judged = False
        for m in p.throughput_metrics:
            v = get(m)
            if v is None or not math.isfinite(v):
                continue
            ref, _ = self._throughput[m].step(t, s, v, p)
            if judged or ref is None or not ref > 0:
                continue
            judged = True
            drop = 1.0 - v / ref
            is_open = ("throughput", m) in self._open
            if drop > p.throughput_drop or (is_open and drop > p.hysteresis * p.throughput_drop):
                self._set("throughput", m, Level.YELLOW, s, v, ref, v / ref,
                          f"{m} = {v:.4g} is {100 * drop:.0f}% below its baseline {ref:.4g} "
                          f"(yellow when down > {100 * p.throughput_drop:.0f}%).",
                          f"{m} fell {100 * p.throughput_drop:.0f}%")
            else:
                self._release("throughput", m, s)

        # Loss scale.
        m = p.loss_scale_metric
        v = get(m)
        if v is not None and math.isfinite(v) and v > 0:
            prev = self._ls_prev
            if not warm and prev == prev and prev / v >= p.loss_scale_drop:
                first = self._ls_drop["onset"] if self._ls_drop else s
                self._ls_drop = {"step": s, "onset": first}
                self._set("loss_scale", m, Level.YELLOW, s, v, prev, v / prev,
                          f"{m} fell {prev / v:g}x in one check ({prev:g} -> {v:g}) at step {s}: "
                          "gradients overflowed.", f"{m} fell {prev / v:g}x", onset=first)
            self._ls_prev = v
        if self._ls_drop is not None and s - self._ls_drop["step"] >= p.event_hold_steps:
            self._clear("loss_scale", m, s)
            self._ls_drop = None

        # Train/val gap growth.
        loss = get("loss")
        if loss is not None and math.isfinite(loss):
            self._last_loss = loss
        tr = self._spike.get("loss")
        loss_ref = tr.trend if tr is not None and tr.trend == tr.trend else self._last_loss
        g = get("val/gap")
        vl = get("val/loss")
        if g is None and vl is not None:
            g = vl - loss_ref if loss_ref == loss_ref else None
        if g is not None and math.isfinite(g) and t >= p.warmup_steps + p.baseline_steps:
            w = p.val_gap_window
            if self._gap_ema != self._gap_ema or p.val_gap_halflife == 0:
                self._gap_ema = g
            else:
                a = 0.5 ** (max(t - self._gap_t, 1) / p.val_gap_halflife)
                self._gap_ema = a * self._gap_ema + (1.0 - a) * g
            self._gap_t = t
            g = self._gap_ema
            self._gap.add(t, g, 2 * w)
            if self._gap.covers(t - 2 * w):
                g1, g2 = self._gap.at(t - w), self._gap.at(t - 2 * w)
                recent, before = g - g1, g1 - g2
                level_ref = abs(loss_ref) if loss_ref == loss_ref else (
                    abs(vl) if vl is not None and math.isfinite(vl) else 0.0)
                floor = p.val_gap_min_growth * level_ref
                if recent > p.val_gap_ratio * max(before, 0.0) + floor:
                    ratio = recent / before if before > 0 else math.inf
                    self._set("val_gap", "val/gap", Level.YELLOW, s, g, g1, ratio,
                              f"the train/val gap grew by {recent:.4g} over the last {w} steps vs "
                              f"{before:.4g} over the {w} before (> {p.val_gap_ratio:g}x); gap now "
                              f"{g:.4g}.", "the train/val gap accelerated",
                              details={"recent_growth": recent, "previous_growth": before})
                else:
                    self._clear("val_gap", "val/gap", s)

        # Divergence -> RED. A check counts as divergent when it confirmed an
        # ORANGE condition (or the loss far above its pre-spike trend); it
        # breaks the run only if it re-observed every condition that was
        # divergent and found none (a check that did not see them holds).
        recovered = False
        if self._div:
            self._consecutive += 1
            if self._consecutive == 1:
                self._div_start = s
            self._div_keys = {k for k, _ in self._div}
        elif self._div_keys and self._div_keys <= self._touched:
            self._consecutive = 0
            self._div_start = None
            self._div_keys = set()
            recovered = True
        red_open = ("divergence", "") in self._open
        if self._div and (red_open or (self._consecutive >= p.red_after
                                       and s - self._div_start >= p.red_min_steps)):
            lead = min((a for _, a in self._div), key=lambda a: (a.onset_step, a.id))
            self._set("divergence", lead.metric, Level.RED, s, lead.value, lead.baseline,
                      lead.ratio,
                      f"unrecovered divergence for {self._consecutive} consecutive checks since "
                      f"step {self._div_start} (lead: {lead.rule} on {lead.metric}, onset step "
                      f"{lead.onset_step}).", f"{lead.metric} diverged",
                      onset=lead.onset_step, key="",
                      details={"consecutive_checks": self._consecutive,
                               "first_divergent_step": self._div_start,
                               "lead_alert": lead.id, "lead_rule": lead.rule})
        elif red_open and not self._div and (recovered or not self._div_keys):
            self._release("divergence", "", s)

        self._last_step = s
        alerts = self.alerts
        level = alerts[0].level if alerts else Level.GREEN
        scores = {"monitor/level": float(level), "monitor/open_alerts": float(len(alerts))}
        for m, tr in self._spike.items():
            scores[self._score_names[m]] = tr.score.score
        return Verdict(s, level, alerts, self._new, self._closed, scores)

    # ------------------------------------------------------------------
    # Rollback.
    # ------------------------------------------------------------------

    def _offset_at(self, u: int) -> int:
        off = 0
        for start, o in self._segments:
            if u > start:
                off = o
        return off

    def note_rollback(self, step: int, to_step: int) -> Alert:
        """Records that the model was restored to its checkpoint of ``to_step``.

        Decision: steps keep increasing after a rollback (the data position
        and the step numbering go forward), but the model is back to its
        state at ``to_step``. So the monitor:

        - closes every open alert (``details['closed_by'] = 'rollback'``),
          records a ``'rollback'`` alert in :attr:`history`, resets the
          consecutive-divergence count, and ends open spikes (recorded as
          ``rolled_back``) and periodic patterns;
        - keeps every baseline (fixed, rolling, EMA, per-layer) and the
          loss/grad-norm trends (frozen at their pre-spike values while a
          spike was open);
        - moves its model clock back: later steps ``s`` are treated as model
          time ``t(to_step) + (s - step)`` by the windowed rules (warm-up and
          baseline windows, the train/val gap windows, the per-layer history),
          and drops the gap and per-layer samples of the abandoned trajectory
          (model time after ``t(to_step)``), so a later localization cannot
          cite them. Alert/spike steps stay in the caller's numbering.

        Args:
          step: the step at which the rollback happened (>= the last step
            checked); the next :meth:`update` must use a larger step.
          to_step: the step (same numbering) of the restored checkpoint.

        Returns:
          The ``'rollback'`` record added to :attr:`history`.

        Raises:
          ValueError: ``to_step > step`` or ``step`` precedes the last check.
        """
        s = _as_step(step)
        to = _as_step(to_step, "to_step")
        if to > s:
            raise ValueError(f"note_rollback expects to_step <= step, got to_step={to} > step={s}")
        if self._last_step is not None and s < self._last_step:
            raise ValueError(f"note_rollback expects step >= the last checked step "
                             f"{self._last_step}, got {s}")
        p = self.policy
        closed_ids, lead_metric = [], ""
        red = self._open.get(("divergence", ""))
        if red is not None:
            lead_metric = red.metric
        for a in self.alerts:
            a.closed_step = s
            a.details = {**a.details, "closed_by": "rollback"}
            self._history.append(a)
            closed_ids.append(a.id)
        self._open.clear()
        self._events.clear()
        for tr in self._spike.values():
            self._spikes.extend(tr.rollback(s, p))
        self._consecutive = 0
        self._div_start = None
        self._div_keys = set()
        self._ls_drop = None
        self._ls_prev = _NAN
        t_to = to - self._offset_at(to)
        self._gap.drop_after(t_to)
        self._gap_ema = self._gap.gs[-1] if self._gap.gs else _NAN
        self._gap_t = self._gap.ts[-1] if self._gap.ts else 0
        self._layers.drop_after(t_to)
        self._offset = s - t_to
        self._segments.append((s, self._offset))
        del self._segments[:-64]
        pres = PRESCRIPTIONS["divergence"]
        rec = Alert(id=self._next_id, rule="rollback", metric=lead_metric, level=Level.RED, step=s,
                    value=float(to), baseline=_NAN, ratio=_NAN, onset_step=s, opened_step=s,
                    message=(f"[RED] rolled back at step {s} to the checkpoint of step {to}: open "
                             f"alerts {closed_ids} closed, divergence count reset, samples after "
                             f"step {to} dropped from the gap and per-layer histories; baselines "
                             "kept."),
                    cause=pres.cause, prescription=pres.prescription, localization=[],
                    peak_level=Level.RED, closed_step=s,
                    details={"to_step": to, "closed_alerts": closed_ids})
        self._next_id += 1
        self._history.append(rec)
        self._last_step = s if self._last_step is None else max(self._last_step, s)
        return rec

    # ------------------------------------------------------------------
    # Persistence.
    # ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The monitor's whole state as plain JSON types.

        Only str/int/float/bool/list/dict/None; non-finite floats are the
        strings ``"nan"``, ``"inf"``, ``"-inf"``. ``json.dumps`` /
        ``json.loads`` / :meth:`from_state_dict` give a monitor whose
        following verdicts equal the uninterrupted one's exactly.
        """
        return {
            "format": "jvitals.Monitor",
            "version": _FORMAT_VERSION,
            "policy": self.policy.to_dict(),
            "last_step": self._last_step,
            "offset": self._offset,
            "segments": [list(x) for x in self._segments],
            "next_id": self._next_id,
            "open": [[k[0], k[1], a.to_dict(), self._events.get(a.id, "")]
                     for k, a in self._open.items()],
            "history": [a.to_dict() for a in self._history],
            "spikes": [x.to_dict() for x in self._spikes],
            "consecutive": self._consecutive,
            "div_start": self._div_start,
            "div_keys": sorted([list(k) for k in self._div_keys]),
            "ratio": {m: b.to_dict() for m, b in self._ratio.items()},
            "throughput": {m: b.to_dict() for m, b in self._throughput.items()},
            "spike": {m: tr.to_dict() for m, tr in self._spike.items()},
            "ls_prev": enc_float(self._ls_prev),
            "ls_drop": self._ls_drop,
            "gap": self._gap.to_dict(),
            "gap_ema": enc_float(self._gap_ema),
            "gap_t": self._gap_t,
            "last_loss": enc_float(self._last_loss),
            "layers": self._layers.to_dict(),
        }

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any], policy: Policy | None = None) -> "Monitor":
        """Rebuilds a monitor from :meth:`state_dict` (after a JSON round trip).

        Args:
          d: the state dict.
          policy: overrides the saved policy (``None``: use the saved one).
            Trackers of metrics the new policy no longer watches are dropped;
            new ones start empty; a changed ``baseline`` kind restarts the
            ratio baselines.

        Raises:
          ValueError: ``d`` is not a monitor state of a known version.
        """
        if not isinstance(d, Mapping) or d.get("format") != "jvitals.Monitor":
            raise ValueError("Monitor.from_state_dict expects the dict of Monitor.state_dict(), got "
                             f"{type(d).__name__} with keys {sorted(d)[:8] if isinstance(d, Mapping) else '-'}")
        if d.get("version") != _FORMAT_VERSION:
            raise ValueError(f"Monitor state version {d.get('version')!r} is not supported "
                             f"(expected {_FORMAT_VERSION})")
        p = policy if policy is not None else Policy.from_dict(d["policy"])
        m = cls(p)
        m._last_step = d["last_step"]
        m._offset = int(d["offset"])
        m._segments = [(int(a), int(b)) for a, b in d["segments"]]
        m._next_id = int(d["next_id"])
        for rule, key, a, event in d["open"]:
            alert = m._open[(rule, key)] = Alert.from_dict(a)
            m._events[alert.id] = event
        m._history.extend(Alert.from_dict(a) for a in d["history"])
        m._spikes.extend(Spike.from_dict(x) for x in d["spikes"])
        m._consecutive = int(d["consecutive"])
        m._div_start = d["div_start"]
        m._div_keys = {(a, b) for a, b in d["div_keys"]}
        for name, b in d["ratio"].items():
            if name in m._ratio and b["kind"] == p.baseline:
                m._ratio[name] = baseline_from_dict(b)
        for name, b in d["throughput"].items():
            if name in m._throughput:
                m._throughput[name] = FixedBaseline.from_dict(b)
        for name, tr in d["spike"].items():
            if name in m._spike:
                m._spike[name] = SpikeTracker.from_dict(tr, p)
        m._ls_prev = dec_float(d["ls_prev"])
        m._ls_drop = None if d["ls_drop"] is None else dict(d["ls_drop"])
        m._gap = GapSeries.from_dict(d["gap"])
        m._gap_ema = dec_float(d["gap_ema"])
        m._gap_t = int(d["gap_t"])
        m._last_loss = dec_float(d["last_loss"])
        m._layers = LayerHistory.from_dict(d["layers"], p.localize_rows,
                                           max(1, p.localize_window // p.localize_rows))
        return m
