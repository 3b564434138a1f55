"""The loss's own health: spikes (:class:`SpikeRule`), the loss scale, a broken model and
the divergence that ends them (:class:`DivergenceRule`, last of the default rules).
"""

from __future__ import annotations

import collections
import math
from typing import Any, Mapping

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.rules_base import Figures
from jvitals.monitor.rules_window import window_peak
from jvitals.monitor.trackers_spikes import SpikeTracker
from jvitals.monitor.types import Change, Level, Reading, RuleBase, Spike, clear, release, set_

__all__ = ["BrokenModelRule", "DivergenceRule", "LossScaleRule", "SpikeRule"]

_SCORE_NAMES = {"loss": "monitor/loss_spike_score",
                "grad/global_norm": "monitor/grad_norm_spike_score"}


class SpikeRule(RuleBase):
    """Spike anatomy, the unrecovered-spike YELLOW, periodic spikes, scores.

    Publishes ``notes.loss_trend`` (the loss EMA trend) and
    ``notes.loss_pre`` (the pre-spike trend while a loss spike is open or
    its elevated reference holds, else the trend).
    """

    name = "spike"
    alert_ids = ("loss_spike", "periodic_spike")   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW, Level.ORANGE)
    state_fields = ("trackers",)
    state_types = {"trackers": SpikeTracker}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.trackers = {m: SpikeTracker(m, policy) for m in policy.spike.metrics}
        self.score_names = {m: _SCORE_NAMES.get(m, "monitor/" + m.replace("/", "_") + "_spike_score")
                            for m in policy.spike.metrics}

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
        for m in p.spike.alert_metrics:
            tr = self.trackers.get(m)
            if tr is None or m not in seen:
                continue
            v = seen[m]
            o, e = tr.open, tr.elevated
            if o is not None and s - o["onset"] >= p.spike.physiological_steps:
                ref, onset = o["pre_trend"], o["onset"]
            elif o is None and e is not None:
                ref, onset = e["pre_trend"], e["onset"]
            else:
                if o is None:
                    out.append(clear("loss_spike", m))
                continue
            if f.notes.data:      # the data rule holds: the loss is the data's, not the LR's
                out.append(release("loss_spike", m))
                continue
            ratio = v / ref if ref > 0 else _NAN
            out.append(set_(
                "loss_spike", m, Level.YELLOW, Reading(v, ref, ratio),
                f"{m} spike at step {onset} not back to trend after {s - onset} steps: "
                f"{v:.4g} vs pre-spike trend {ref:.4g} ({ratio:.2f}x).", f"{m} spiked",
                onset=onset,
                diverging=bool(o is None and ref > 0 and v > p.health.divergence_loss_ratio * ref)))
        for m, tr in self.trackers.items():
            f.scores[self.score_names[m]] = tr.score.score
            if m not in seen or m not in p.spike.periodic_metrics:
                continue
            per = tr.periodic
            if per is None:
                out.append(clear("periodic_spike", m))
                continue
            lvl = Level.ORANGE if per["shrinking"] else Level.YELLOW
            shrink = ", intervals shrinking" if per["shrinking"] else ""
            out.append(set_(
                "periodic_spike", m, lvl, Reading(float(per["period"]), _NAN, _NAN),
                f"{per['count']} {m} spikes at near-regular intervals, period ~"
                f"{per['period']:.0f} steps{shrink} (intervals {per['intervals']}); last onset at "
                f"step {per['last_onset']}.", f"{m} spikes turned periodic",
                onset=per["first_onset"], diverging=False,
                details={"period": float(per["period"]), "count": per["count"],
                         "intervals": list(per["intervals"]), "shrinking": per["shrinking"],
                         "last_onset": per["last_onset"]}))
        tr = self.trackers.get("loss")
        if tr is not None:
            f.notes.loss_trend = tr.trend
            ref = tr.trend
            if tr.open is not None:
                ref = tr.open["pre_trend"]
            elif tr.elevated is not None:
                ref = tr.elevated["pre_trend"]
            f.notes.loss_pre = ref
        return out

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        super().load_state_dict(d)
        self.trackers = {m: self.trackers.get(m) or SpikeTracker(m, self.p)
                         for m in self.p.spike.metrics}

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        done = []
        for tr in self.trackers.values():
            done.extend(tr.rewind(step, self.p))
        return done



class LossScaleRule(RuleBase):
    """YELLOW when the loss scale falls ``>= loss_scale_drop`` x between two
    consecutive checks, or collapses: ``>= loss_scale_drop`` x below its peak,
    ``peak = max(peak * 0.5 ** (dt / event_hold_steps), x)`` (a dynamic scale
    halves at each overflow and doubles after a run of finite steps: a healthy
    fp16 run swings 2-4x around its level, a collapse falls step after step);
    closes ``event_hold_steps`` after the last drop."""

    name = "loss_scale"
    alert_ids = ("loss_scale",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("prev", "drop", "peak")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.prev = _NAN
        self.drop: dict[str, Any] | None = None
        self.peak = [_NAN, 0]   # the decaying peak, its step

    def check(self, f: Figures) -> list[Change]:
        p, s, out = self.p, f.step, []
        m = p.system.loss_scale_metric
        v = f.get(m)
        if v is not None and math.isfinite(v) and v > 0:
            prev, (peak, t0) = self.prev, self.peak
            if peak != peak or v >= peak:
                peak = v
            else:
                peak = max(peak * 0.5 ** ((s - t0) / max(p.system.event_hold_steps, 1)), v)
            self.peak = [peak, s]
            one = prev == prev and prev / v >= p.system.loss_scale_drop
            if not f.warm and (one or peak / v >= p.system.loss_scale_drop):
                first = self.drop["onset"] if self.drop else s
                self.drop = {"step": s, "onset": first}
                ref, how = (prev, "in one check") if one else (peak, "from its recent peak")
                out.append(set_("loss_scale", m, Level.YELLOW, Reading(v, ref, v / ref),
                                f"{m} fell {ref / v:g}x {how} ({ref:g} -> {v:g}) at step {s} "
                                f"(>= Policy.loss_scale_drop = {p.system.loss_scale_drop:g}x): gradients "
                                "overflow float16 again and again.", f"{m} fell {ref / v:g}x",
                                onset=first))
            self.prev = v
        if self.drop is not None and s - self.drop["step"] >= p.system.event_hold_steps:
            out.append(clear("loss_scale", m))
            self.drop = None
        return out

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.prev, self.drop, self.peak = _NAN, None, [_NAN, 0]
        return []


class BrokenModelRule(RuleBase):
    """A broken model goes RED fast (METRICS.md §5 red tier, fast path).

    Broken at a check (after the baseline start) when

    - the loss is at chance level: ``loss >= broken_chance_frac * C`` while
      its pre-spike trend was below ``broken_chance_frac ** 2 * C``, with
      ``C = log(V)`` (``V`` = ``Policy.health.vocab_size`` or the ``vocab_metric``
      figure) or, without ``V``, the first loss the monitor saw (a run from
      scratch starts at chance; a resumed one at its starting point, which a
      broken model also falls back to); or
    - the param norm jumped: ``>= broken_param_jump`` x its value
      ``broken_jump_window`` steps earlier, while the loss (the window's mean where there
      is one) is at least ``broken_param_loss`` x what it was then (the weights moved and
      the model got no better), or with 3/4 of that rise's log since the previous check (a
      jump, not a growth). A param norm growing that fast, steadily, while the loss falls is
      the warm-up or a high learning rate early in a run, not a broken model.

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
    alert_ids = ("broken_model",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW, Level.ORANGE, Level.RED)
    state_fields = ("pn", "vocab", "first_loss", "state")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.pn: collections.deque[tuple[int, float, float]] = collections.deque()
        self.vocab = _NAN
        self.first_loss = _NAN
        self.state: dict[str, Any] | None = None  # {"since", "checks", "pn_ref", "kind"}

    def check(self, f: Figures) -> list[Change]:
        p, s = self.p, f.step
        if p.health.vocab_size is None:
            v = f.get(p.health.vocab_metric)
            if v is not None and v > 1 and math.isfinite(v):
                self.vocab = v
        vocab = float(p.health.vocab_size) if p.health.vocab_size is not None else self.vocab
        loss, pn = f.get("loss"), f.get("param/global_norm")
        wl = f.get("window/loss.mean") if (f.get("window/loss.n") or 0) >= 1 else None
        level = wl if wl is not None and math.isfinite(wl) else loss   # the loss over the window
        if loss is not None and math.isfinite(loss) and self.first_loss != self.first_loss:
            self.first_loss = loss
        if f.warm:
            return []
        chance = math.log(vocab) if vocab == vocab else self.first_loss
        st = self.state
        pre = st["pre"] if st is not None else f.notes.loss_pre
        loss_bad = None
        if loss is not None and math.isfinite(loss) and chance == chance and chance > 0:
            loss_bad = (loss >= p.health.broken_chance_frac * chance
                        and pre < p.health.broken_chance_frac ** 2 * chance)
        pn_bad, pn_ref = self._param_jump(s, pn, level, st)
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
        if held >= (p.health.broken_steps if st["kind"] == "param" else p.health.broken_loss_steps):
            lvl = Level.RED
        elif st["kind"] == "param" or held >= p.health.broken_steps // 2:
            lvl = Level.ORANGE
        elif loss is not None and loss >= 1.5 * st["pre"]:
            lvl = Level.YELLOW   # at chance from well below: garbage data or a broken model, at once
        else:
            return []  # a loss at chance level must hold a while (a physiological spike does not)
        if st["kind"] == "param":
            metric, value, ref = "param/global_norm", pn, st["pn_ref"]
            what = (f"param/global_norm jumped to {value:.4g} from {ref:.4g} "
                    f"({value / ref:.2f}x within {p.health.broken_jump_window} steps)"
                    if value is not None else "param/global_norm jumped")
        else:
            metric, value, ref = "loss", loss, chance
            src_ = "log vocab" if vocab == vocab else "the first loss seen"
            what = ("loss is at chance level" if value is None else
                    f"loss {value:.4g} is back at chance level ({src_} = {ref:.4g}; pre-spike "
                    f"trend {st['pre']:.4g})")
        value = _NAN if value is None else float(value)
        ratio = value / ref if ref and ref == ref else _NAN
        red_at = st["since"] + (p.health.broken_steps if st["kind"] == "param" else p.health.broken_loss_steps)
        tail = (f"not recovered after {held} steps: the model is broken, roll back."
                if lvl == Level.RED else f"RED if it has not recovered by step {red_at}.")
        if lvl == Level.YELLOW:
            tail = (f"a batch of garbage, or a broken model: ORANGE if it holds until step "
                    f"{st['since'] + p.health.broken_steps // 2}, {tail} (Policy.broken_chance_frac, "
                    "broken_steps, broken_loss_steps)")
        return [set_("broken_model", metric, lvl, Reading(value, ref, ratio), f"{what}; {tail}",
                     f"{metric} broke", key="", onset=st["since"], diverging=False,
                     details={"since": st["since"], "kind": st["kind"]})]

    def _param_jump(self, s: int, pn: float | None, level: float | None, st: dict[str, Any] | None
                    ) -> tuple[bool | None, float]:
        """``(jumped, the reference it jumped from)``: None when the check has no param norm."""
        p = self.p
        if pn is None or not (math.isfinite(pn) and pn > 0):
            return None, _NAN
        if st is not None and st["pn_ref"] is not None:     # open: holds until half the jump is undone
            return pn >= (1.0 + 0.5 * (p.health.broken_param_jump - 1.0)) * st["pn_ref"], _NAN
        q, bad, ref = self.pn, None, _NAN
        while len(q) > 1 and q[1][0] <= s - p.health.broken_jump_window:
            q.popleft()
        if q:
            ref = q[0][1]
            ref_loss = q[0][2] if len(q[0]) > 2 else _NAN
            # Broken, not grown: the loss no better than where the jump began (a warm-up's or
            # a high LR's early growth comes with a falling loss), or the rise concentrated
            # since the previous check (a jump, not a growth: 3/4 of the jump's log in one
            # interval).
            worse = (level is None or not math.isfinite(level) or ref_loss != ref_loss
                     or level >= p.health.broken_param_loss * ref_loss)
            sudden = pn >= p.health.broken_param_jump ** 0.75 * q[-1][1]
            bad = pn >= p.health.broken_param_jump * ref and (worse or sudden)
        q.append((s, pn, _NAN if level is None or not math.isfinite(level) else level))
        return bad, ref

    def rewind(self, step: int, t_to: int) -> list[Spike]:
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
    alert_ids = ("divergence",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.RED,)
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
            for checks, first in f.notes.orange_run.values():
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
        if div and (red_open or (self.consecutive >= p.health.red_after
                                 and s - self.start >= p.health.red_min_steps)):
            lead = min((a for _, a in div), key=lambda a: (a.onset_step, a.id))
            return [set_("divergence", lead.metric, Level.RED, Reading(lead.value, lead.baseline,
                         lead.ratio),
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

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.consecutive, self.start, self.keys = 0, None, set()
        return []
