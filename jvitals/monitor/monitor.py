"""The host-side monitor: a list of rules turning the fetched figures into tiered verdicts.

:meth:`Monitor.update` reads the flat metric dict the host fetched at its cadence, finds
when the baselines start, runs its rules in order (the table in docs/MONITOR.md) and
returns a :class:`~jvitals.monitor.types.Verdict`: a level and the open alerts, each with
a likely cause, a prescription (METRICS.md §6) and a ranked localization. It never acts:
saving, pausing and rolling back are the guard's job. Plain Python and NumPy; memory is
bounded, so a run of any length can be watched, and ``state_dict`` resumes it exactly.
How an update runs, an alert's episodes and an example: docs/MONITOR.md, "The monitor's
update".
"""

from __future__ import annotations

import collections
import logging
import math
import operator
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.coverage import Coverage, coverage
from jvitals.monitor.localize import group_of, lead_phrase, localize
from jvitals.monitor.policy import Policy
from jvitals.monitor.rules import default_rules
from jvitals.monitor.rules_base import Figures, Plan
from jvitals.monitor.rules_ratio import RatioRule
from jvitals.monitor.rules_window import ThroughputRule
from jvitals.monitor.trackers_baselines import BaselineStart
from jvitals.monitor.trackers_history import LayerHistory
from jvitals.monitor.types import PRESCRIPTIONS, RULE_PRESCRIPTION, Alert, Change, Level, Localization, Spike, Verdict

__all__ = ["Monitor"]

_FORMAT_VERSION = 3
_PLANS = 8  # key sets remembered (a loop alternates a few: per-layer families every N steps)


_log = logging.getLogger("jvitals.monitor")


def _check_names(names: Mapping[str, str] | None) -> dict[str, str]:
    """``Monitor(names=)``: ``{name your loop logs: name the rules read}``."""
    if names is None:
        return {}
    if not isinstance(names, Mapping):
        raise TypeError(f"Monitor(names=...) expects a mapping {{name your loop logs: jvitals name}}, e.g. "
                        f"{{'train/loss': 'loss'}}; got {type(names).__name__}")
    for k, v in names.items():
        if not (isinstance(k, str) and isinstance(v, str) and k and v):
            raise TypeError(f"Monitor(names=...) maps names to names (non-empty str -> str); got {k!r}: {v!r}")
    targets = list(names.values())
    twice = sorted({v for v in targets if targets.count(v) > 1})
    if twice:
        raise ValueError(f"Monitor(names=...) maps several of your names onto {twice}; map one name to each")
    return dict(names)


def _renamed(metrics: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        n = names.get(k, k)
        if n in out or (n != k and n in metrics):
            src = k if n != k else next(a for a, b in names.items() if b == n and a in metrics)
            raise ValueError(f"Monitor.update: {src!r} maps to {n!r} (Monitor(names=...)), which the figures "
                             f"hold already; drop one of the two")
        out[n] = v
    return out


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


class Monitor:
    """Learns baselines from the run and turns metrics into verdicts.

    ``update(step, metrics)`` reads the metrics its rules know (see
    :class:`Policy` and the module docstring) and every candidate metric
    matching ``Policy.localize.pattern`` (e.g. ``grad/share/layer_1``,
    ``update/param_ratio/embedding``, ``param/norm/lm_head``); other names
    are ignored.

    Alerts: one object per episode of a condition ``(rule, key)``, updated
    in place (same ``id``); level changes within it; it closes when the
    condition has been clear for ``Policy.alerts.clear_steps`` steps (ratio,
    throughput, non-finite, group, trend, broken model, divergence) or at
    once (spike, periodic, gap; the loss-scale alert after
    ``event_hold_steps``), then moves to :attr:`history`; a condition that
    holds again after ``Policy.alerts.episode_gap`` clear steps is a new alert
    (``details['closed_by'] == 'new episode'`` on the old one).

    Missing metrics: a rule whose metric is absent at a step keeps its
    state (its alert neither updates nor closes). Steps must increase;
    gaps are fine (trends decay with the steps elapsed).

    Rollbacks: see :meth:`note_rollback`. Resuming: :meth:`state_dict` /
    :meth:`from_state_dict` / :meth:`load_state_dict`.

    Args:
      policy: the :class:`Policy` (default: METRICS.md §5).
      rules: the rule objects, run in this order (default:
        ``default_rules(policy)``); names must be unique.
      names: ``{name your loop logs: name the rules read}``, applied to every check's
        figures (``{"train/loss": "loss", "grad_norm": "grad/global_norm"}``): a loop's own
        names, unmapped, leave the rules that read them blind. The first check says, once
        (a WARNING of ``jvitals.monitor``), which rules a missing ``loss`` or
        ``grad/global_norm`` leaves without input and which of the loop's names look like
        them.

    Attributes:
      policy: the :class:`Policy`.
      rules: the rule objects.
      coverage: what the first check's figures let the rules watch (a
        :class:`~jvitals.monitor.coverage.Coverage`; None before it).
      alerts: the open alerts (most severe first).
      history: closed alerts, oldest first (``Policy.alerts.history_size`` kept).
      spikes: completed :class:`Spike` records (``Policy.alerts.spikes_size``).
      step: the last step seen (``None`` before the first update).
      baseline_start: model step at which the baselines started (``None``
        before), and :attr:`baseline_start_reason`.
    """

    def __init__(self, policy: Policy | None = None, rules: Sequence[Any] | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        if policy is None:
            policy = Policy()
        self.names = _check_names(names)
        self.coverage: Coverage | None = None
        if not isinstance(policy, Policy):
            raise TypeError(f"Monitor expects a jvitals Policy, got {type(policy).__name__}")
        p = self.policy = policy
        if rules is not None and (isinstance(rules, (str, Mapping)) or not isinstance(rules, Iterable)):
            raise TypeError(f"Monitor(rules=...) expects a list of rule objects, e.g. "
                            f"[*vitals.default_rules(policy), MyRule()], got {type(rules).__name__} {rules!r:.60}"
                            + ("; default_rules is a function: call it with the policy" if callable(rules) else ""))
        self.rules = list(default_rules(p) if rules is None else rules)
        names = [getattr(r, "name", None) for r in self.rules]
        for r, n in zip(self.rules, names):
            if not isinstance(n, str) or not n or not callable(getattr(r, "check", None)):
                raise TypeError(f"Monitor rules need a non-empty str `name` and a `check(figures)` "
                                f"method; {type(r).__name__} has name={n!r}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"Monitor rules must have unique names; repeated: {dup}")
        self._pattern = re.compile(p.localize.pattern)
        self._last_step: int | None = None
        self._offset = 0
        self._segments: list[tuple[int, int]] = []
        self._next_id = 0
        self._open: dict[tuple[str, str], Alert] = {}
        self._events: dict[int, str] = {}  # open alert id -> onset event phrase
        self._history: collections.deque[Alert] = collections.deque(maxlen=p.alerts.history_size)
        self._spikes: collections.deque[Spike] = collections.deque(maxlen=p.alerts.spikes_size)
        self._start = BaselineStart()
        self._layers = LayerHistory(p.localize.rows, max(1, p.localize.window // p.localize.rows))
        self._watched = {p.baselines.lr_metric, p.baselines.settle_metric}
        self._plans: collections.OrderedDict[tuple, Plan] = collections.OrderedDict()
        # Per-check scratch.
        self._new: list[Alert] = []
        self._closed: list[Alert] = []

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

    @property
    def baseline_start(self) -> int | None:
        return self._start.start

    @property
    def baseline_start_reason(self) -> str:
        return self._start.reason

    def rule(self, name: str) -> Any:
        """The rule object called ``name`` (KeyError naming the known ones)."""
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(f"no rule named {name!r}; rules: {[r.name for r in self.rules]}")

    def baseline(self, metric: str) -> float | None:
        """The learned baseline of a ratio-rule, throughput or candidate
        metric (``None`` while it is still being learned or unknown)."""
        for r in self.rules:
            if isinstance(r, RatioRule) and metric in r.baselines:
                return r.baseline(metric)
            if isinstance(r, ThroughputRule) and metric in r.baselines:
                m = r.baselines[metric].mean
                return None if m != m else float(m)
        c = self._layers.index.get(metric)
        if c is not None and not np.isnan(self._layers.mean[c]):
            return float(self._layers.mean[c])
        return None

    # ------------------------------------------------------------------
    # Reading metrics.
    # ------------------------------------------------------------------

    def _make_plan(self, keys: tuple, metrics: Mapping[str, Any]) -> Plan:
        for k in keys:
            _check_value(k, metrics[k])
        named, pos, cols = {}, [], []
        for i, k in enumerate(keys):
            named[k] = i
            if self._pattern.search(k):
                c = self._layers.column(k, self.policy.localize.max_metrics)
                if c >= 0:
                    pos.append(i)
                    cols.append(c)
        plan = Plan(keys, named, np.asarray(pos, np.intp), np.asarray(cols, np.intp))
        self._plans[keys] = plan
        while len(self._plans) > _PLANS:
            self._plans.popitem(last=False)
        return plan

    def _read(self, metrics: Mapping[str, Any]) -> tuple[Plan, np.ndarray]:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"Monitor.update expects a mapping of metric name -> scalar, got "
                            f"{type(metrics).__name__}")
        keys = tuple(metrics)
        plan = self._plans.get(keys)
        if plan is None:
            plan = self._make_plan(keys, metrics)
        try:
            vals = np.fromiter(metrics.values(), np.float64, len(keys))
        except (TypeError, ValueError) as e:
            for k in keys:
                _check_value(k, metrics[k])
            raise TypeError(f"Monitor.update could not read the metrics as floats: {e}") from e
        if np.isnan(vals).any():  # NumPy reads None as NaN: check those values.
            for i in np.flatnonzero(np.isnan(vals)):
                _check_value(keys[i], metrics[keys[i]])
        return plan, vals

    # ------------------------------------------------------------------
    # Alert bookkeeping.
    # ------------------------------------------------------------------

    def _apply(self, c: Change, f: Figures) -> None:
        k = (c.rule, c.key)
        f.touched.add(k)
        s = f.step
        if c.op == "release":
            a = self._open.get(k)
            if a is None:
                return
            if a.clearing_since is None:
                a.clearing_since = s
            if s - a.clearing_since >= self.policy.alerts.clear_steps:
                self._close(k, s)
            return
        if c.op == "clear":
            self._close(k, s)
            return
        if c.op != "set":
            raise ValueError(f"rule change {c!r}: op must be 'set', 'release' or 'clear'")
        level = Level(c.level)
        pres = PRESCRIPTIONS[c.prescription or RULE_PRESCRIPTION.get(c.rule, "generic")]
        a = self._open.get(k)
        onset = c.onset
        if a is not None and a.clearing_since is not None:
            if s - a.clearing_since >= self.policy.alerts.episode_gap:
                # Its condition had cleared (the figure back in band that long): this
                # crossing is a new episode, with its own onset and localization.
                a.details = {**a.details, "closed_by": "new episode"}
                self._close(k, s)
                a = None
            else:
                onset = None  # a dip shorter than episode_gap: the same episode goes on
        if a is None:
            a = Alert(id=self._next_id, rule=c.rule, metric=c.metric, level=level, step=s,
                      value=c.value, baseline=c.baseline, ratio=c.ratio,
                      onset_step=s if onset is None else onset, opened_step=s, message="",
                      cause=pres.cause, prescription=pres.prescription, localization=[],
                      peak_level=level, details=dict(c.details or {}))
            self._next_id += 1
            self._open[k] = a
            self._new.append(a)
            self._events[a.id] = c.event
            a.localization = self._localize(a, c.event)
        else:
            a.metric, a.level, a.step, a.value, a.baseline, a.ratio = (
                c.metric, level, s, c.value, c.baseline, c.ratio)
            if onset is not None:
                a.onset_step = onset
            if c.details is not None:
                a.details = dict(c.details)
            a.clearing_since = None
            if level > a.peak_level:
                a.peak_level = level
                # Leads are measured to the onset, so keep the onset's event.
                a.localization = self._localize(a, self._events.get(a.id, c.event))
        lead = lead_phrase(a.localization, self.policy.localize.lookback) if (
            a.localization or self._layers.names) else ""
        a.message = (f"[{a.level.name}] {c.headline} Likely cause: {pres.cause}. "
                     f"Prescription: {pres.prescription}.{lead}")
        diverging = c.diverging
        if diverging is None:
            diverging = level >= Level.ORANGE and c.rule not in ("periodic_spike", "divergence")
        if diverging:
            f.diverging.append((k, a))

    def _close(self, k: tuple[str, str], s: int) -> None:
        a = self._open.pop(k, None)
        if a is not None:
            self._events.pop(a.id, None)
            a.closed_step = s
            self._history.append(a)
            self._closed.append(a)

    def _localize(self, a: Alert, event: str) -> list[Localization]:
        lead = a.details.get("lead_alert")
        if lead is not None:
            for b in self._open.values():
                if b.id == lead:
                    return list(b.localization)
            return []
        group = group_of(a.metric)
        loc = localize(self._layers, a.onset_step, event, self.policy,
                       t_onset=a.onset_step - self._offset_at(a.onset_step),
                       start=self._start.start, group=group)
        if group is not None and not any(group_of(x.metric) == group for x in loc):
            # A group's own alert (the router, a group band) names its group first,
            # from its own metric, when no member departed by the change-point test
            # (a noisy figure whose rule needed a held excursion to fire).
            ratio = a.value / a.baseline if a.baseline else math.inf
            loc.insert(0, Localization(
                a.metric, a.onset_step, a.baseline, a.value, ratio, 0,
                f"{a.metric} left its band at step {a.onset_step} (from {a.baseline:.4g} to "
                f"{a.value:.4g}); no member of {group} changed earlier"))
            del loc[self.policy.localize.top:]
        return loc

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
        if self.names:
            metrics = _renamed(metrics, self.names)
        if self._last_step is not None and s <= self._last_step:
            raise ValueError(f"Monitor.update expects increasing steps: got step {s} after step "
                             f"{self._last_step}. Merge metrics of one step into one dict; after a "
                             "restart restore the monitor saved with the checkpoint "
                             "(Monitor.from_state_dict).")
        plan, vals = self._read(metrics)
        if self.coverage is None:
            self.coverage = coverage(plan.keys, [getattr(r, "name", "") for r in self.rules])
            said = self.coverage.summary(s)
            if said:
                _log.warning(said)
        p = self.policy
        t = s - self._offset
        named = plan.named
        start = self._start.start
        if start is None:
            i, j = named.get(p.baselines.lr_metric), named.get(p.baselines.settle_metric)
            start = self._start.observe(t, None if i is None else float(vals[i]),
                                        None if j is None else float(vals[j]), p)
        self._new, self._closed = [], []
        if plan.pos.size:
            self._layers.observe(s, t, plan.cols, vals[plan.pos], p, start)
        f = Figures(s, t, start, plan, vals.tolist(), self._open, p)
        for rule in self.rules:
            for c in rule.check(f):
                if c.op != "set" and (c.rule, c.key) not in self._open:
                    f.touched.add((c.rule, c.key))     # nothing to release: only re-observed
                    continue
                self._apply(c, f)
        self._spikes.extend(f.spikes)
        self._last_step = s
        alerts = self.alerts
        level = alerts[0].level if alerts else Level.GREEN
        scores = {"monitor/level": float(level), "monitor/open_alerts": float(len(alerts))}
        scores.update(f.scores)
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
          ``rolled_back``) and periodic patterns (each rule's ``rewind``, if it has one);
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
        closed_ids, lead_metric = [], ""
        red = self._open.get(("divergence", "")) or self._open.get(("broken_model", ""))
        if red is not None:
            lead_metric = red.metric
        for a in self.alerts:
            a.closed_step = s
            a.details = {**a.details, "closed_by": "rollback"}
            self._history.append(a)
            closed_ids.append(a.id)
        self._open.clear()
        self._events.clear()
        t_to = to - self._offset_at(to)
        for r in self.rules:
            fn = getattr(r, "rewind", None)
            if fn is not None:
                self._spikes.extend(fn(s, t_to) or [])
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
        following verdicts equal the uninterrupted one's exactly. Each rule's
        state is under ``rules[name]`` (``None`` for a rule without
        ``state_dict``).
        """
        rules = {}
        for r in self.rules:
            fn = getattr(r, "state_dict", None)
            rules[r.name] = fn() if fn is not None else None
        return {
            "format": "jvitals.Monitor",
            "version": _FORMAT_VERSION,
            "policy": self.policy.state_dict(),
            "last_step": self._last_step,
            "offset": self._offset,
            "segments": [list(x) for x in self._segments],
            "next_id": self._next_id,
            "open": [[k[0], k[1], a.state_dict(), self._events.get(a.id, "")]
                     for k, a in self._open.items()],
            "history": [a.state_dict() for a in self._history],
            "spikes": [x.state_dict() for x in self._spikes],
            "start": self._start.state_dict(),
            "layers": self._layers.state_dict(),
            "rules": rules,
        }

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any], policy: Policy | None = None,
                        rules: Sequence[Any] | None = None) -> "Monitor":
        """Rebuilds a monitor from :meth:`state_dict` (after a JSON round trip).

        Args:
          d: the state dict.
          policy: overrides the saved policy (``None``: use the saved one).
            Trackers of metrics the new policy no longer watches are dropped;
            new ones start empty; a changed ``baseline`` kind restarts the
            ratio baselines.
          rules: the rule objects (``None``: ``default_rules(policy)``); each
            loads the saved state of the rule of its name, if any.

        Raises:
          ValueError: ``d`` is not a monitor state of a known version.
        """
        _check_state(d)
        p = policy if policy is not None else Policy.from_state_dict(d["policy"])
        m = cls(p, rules)
        m._load(d)
        return m

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output into this monitor (its policy and
        rule objects kept)."""
        _check_state(d)
        fresh = type(self)(self.policy, self.rules)
        fresh._load(d)
        self.__dict__.update(fresh.__dict__)

    def _load(self, d: Mapping[str, Any]) -> None:
        p = self.policy
        self._last_step = d["last_step"]
        self._offset = int(d["offset"])
        self._segments = [(int(a), int(b)) for a, b in d["segments"]]
        self._next_id = int(d["next_id"])
        self._open, self._events = {}, {}
        for rule, key, a, event in d["open"]:
            alert = self._open[(rule, key)] = Alert.from_state_dict(a)
            self._events[alert.id] = event
        self._history.clear()
        self._history.extend(Alert.from_state_dict(a) for a in d["history"])
        self._spikes.clear()
        self._spikes.extend(Spike.from_state_dict(x) for x in d["spikes"])
        self._start = BaselineStart.from_state_dict(d["start"])
        self._layers = LayerHistory.from_state_dict(d["layers"], p.localize.rows,
                                              max(1, p.localize.window // p.localize.rows))
        self._plans.clear()
        saved = d["rules"]
        for r in self.rules:
            st = saved.get(r.name)
            fn = getattr(r, "load_state_dict", None)
            if st is not None and fn is not None:
                fn(st)


def _check_state(d: Any) -> None:
    if not isinstance(d, Mapping) or d.get("format") != "jvitals.Monitor":
        raise ValueError("Monitor.from_state_dict expects the dict of Monitor.state_dict(), got "
                         f"{type(d).__name__} with keys {sorted(d)[:8] if isinstance(d, Mapping) else '-'}")
    if d.get("version") != _FORMAT_VERSION:
        raise ValueError(f"Monitor state version {d.get('version')!r} is not supported (expected "
                         f"{_FORMAT_VERSION}; version 1 states (before the rule-based monitor) and "
                         "version 2 states (before the drift-aware rules: their baselines, group "
                         "bands and creep windows are not this version's) "
                         "cannot be resumed: start a fresh Monitor)")
