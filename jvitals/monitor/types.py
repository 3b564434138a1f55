"""Value types of the host-side monitor: levels, alerts, spikes, verdicts.

Plain dataclasses with a lossless JSON form (``state_dict`` / ``from_state_dict``):
non-finite floats are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` so that ``json.dumps(..., allow_nan=False)`` accepts them and a
round trip gives back the same bits.

The symptom -> cause -> prescription table of METRICS.md §6 lives here as
immutable data (:data:`PRESCRIPTIONS`), keyed by the monitor's rule ids
(:data:`RULE_PRESCRIPTION`).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
from typing import Any, Mapping, NamedTuple

__all__ = [
    "Alert",
    "Level",
    "Localization",
    "Prescription",
    "PRESCRIPTIONS",
    "RULE_PRESCRIPTION",
    "Spike",
    "Verdict",
    "split_group",
]

from jvitals.monitor.codec import NAN, dec_float, dec_state, enc_float, enc_state

_GROUP = re.compile(r"^(?P<fam>.+)/(?P<g>embedding|lm_head|layer_(?P<i>\d+))$")


def split_group(name: str) -> tuple[str, str, int | None] | None:
    """A per-group metric name split as ``(family, group, layer index or None)``:
    ``"update/param_ratio/layer_3"`` -> ``("update/param_ratio", "layer_3", 3)``,
    ``"grad/share/embedding"`` -> ``("grad/share", "embedding", None)``; None for a
    name that does not end in a group (``embedding``, ``lm_head``, ``layer_{i}``)."""
    m = _GROUP.match(name)
    if m is None:
        return None
    return m["fam"], m["g"], None if m["i"] is None else int(m["i"])


# --------------------------------------------------------------------------
# Levels and the §6 table.
# --------------------------------------------------------------------------


class Level(enum.IntEnum):
    """Alert tiers of METRICS.md §5; ordered, so ``max()`` and ``>=`` work.

    GREEN: nothing to report. YELLOW: warn, take no action. ORANGE: save a
    checkpoint and pause. RED: roll back to the latest healthy checkpoint.
    """

    GREEN = 0
    YELLOW = 1
    ORANGE = 2
    RED = 3


@dataclasses.dataclass(frozen=True)
class Prescription:
    """One row of METRICS.md §6: symptom -> likely cause -> prescription."""

    symptom: str
    cause: str
    prescription: str


PRESCRIPTIONS: Mapping[str, Prescription] = types.MappingProxyType({
    "grad_norm_climb": Prescription(
        "grad norm climbing while loss still falls",
        "shallow layers' LR too high; embedding/LM-head LR mismatched with "
        "the trunk",
        "layer-wise LR decay (lr_i = lr_base * decay ** (N - 1 - i), decay "
        "0.85-0.95, start at 0.95); embedding and LM head at 0.5x trunk LR"),
    "loss_spike_unrecovered": Prescription(
        "loss spike that does not recover",
        "LR beyond the stable region",
        "roll back; LR down 20-50%"),
    "nan_loss": Prescription(
        "NaN loss",
        "overflow; fp16 loss scale",
        "check loss scale; prefer bf16; check activation extremes (> 1e4)"),
    "val_up_train_down": Prescription(
        "val loss up, train loss down",
        "early overfitting, or the val set changed",
        "early stop, dropout/weight decay; verify the val set's version"),
    "param_norm_jump": Prescription(
        "param norm jump",
        "oversized update",
        "check clipping; check that gradient accumulation does not bypass "
        "the clip"),
    "outputs_poor": Prescription(
        "every vital fine, outputs poor",
        "objective/data mix/eval mismatch",
        "revisit data mix and evaluation"),
    "low_throughput": Prescription(
        "low throughput",
        "input pipeline, throttling, interconnect",
        "profile; more loader workers; check interconnect"),
    # Not in the §6 table; from the source guide (003, §4.4).
    "periodic_spikes": Prescription(
        "periodic spikes (>= 3 at near-regular intervals)",
        "a data source refreshed on a schedule that injects off-distribution "
        "samples, or learning-rate restarts (non-smooth schedule points)",
        "check which data sources refresh on that period; lengthen the "
        "warm-up of each restart"),
    # §6 first row, split by the group that moved (the group rule).
    "group_embedding_lr": Prescription(
        "one group (embedding / LM head) left its band while the global figures did not",
        "embedding/LM-head LR mismatched with the trunk",
        "embedding and LM head at 0.5x trunk LR (check their LR multiplier and weight decay)"),
    "group_layer_lr": Prescription(
        "one layer left its band while the global figures did not",
        "shallow layers' LR too high",
        "layer-wise LR decay (lr_i = lr_base * decay ** (N - 1 - i), decay 0.85-0.95, start "
        "at 0.95)"),
    # §6 "param norm jump" seen at its cause: the update itself, one check.
    "update_jump": Prescription(
        "the update/param ratio jumped in one check",
        "an oversized update: an LR far above the schedule's (a multiplier, a restart, a "
        "unit error) or a step the clip did not bound",
        "check the learning rate actually applied and the clipping; the param-norm, grad-norm "
        "and loss alerts that follow say whether it did damage"),
    # METRICS.md §2 activation rows (no §6 row): logits growing.
    "attn_logit_growth": Prescription(
        "the attention logits growing into softmax saturation (the attention entropy collapses)",
        "the query/key weights growing unchecked: no qk-layernorm at a high learning rate "
        "(attention logit growth, Dehghani et al. 2023; Wortsman et al. 2023), or their LR too high",
        "add qk-layernorm (an RMSNorm on each head's queries and keys), or QK-clip (MuonClip: "
        "scale Wq, Wk so the largest logit stays at tau; vitals.qk_clip, applied in flight by "
        "the guard's default remedies); lower the LR of Wq/Wk"),
    "logit_divergence": Prescription(
        "the output logits growing out of the range their precision holds",
        "the normalizer log Z drifting unchecked (no z-loss, no weight decay on the LM head) at "
        "a high learning rate: output-logit divergence (Chowdhery et al. 2022; Wortsman et al. 2023)",
        "add the z-loss (1e-4 x mean log Z^2; vitals.z_loss, turned on in flight by the guard's "
        "default remedies) or a logit soft-cap (c * tanh(logits / c)); weight decay on the head"),
    "no_warmup": Prescription(
        "one update moved the weights by a large fraction of their norm, at the run's start",
        "no warm-up (or one too short) at this learning rate: Adam's first updates are sign-like "
        "and move every weight by the full learning rate",
        "add a linear warm-up of the learning rate (a few hundred to a few thousand steps; "
        "Wortsman et al. 2023: warm-up lowers the sensitivity to the learning rate), or lower the "
        "peak learning rate"),
    "adam_epsilon": Prescription(
        "Adam's update per unit learning rate far below Adam's own scale: the updates vanish",
        "Adam's epsilon too large for the gradients' scale (it sets the step where sqrt(v) "
        "falls to it: Wortsman et al. 2023, section 3.4)",
        "lower Adam's epsilon well below the gradients' RMS (1e-8, or 1e-15 at scale); check "
        "that the loss is not scaled down (a mean over too many tokens, a loss scale left in)"),
    "lr_too_high": Prescription(
        "one update moved the weights by a large fraction of their norm",
        "a learning rate too high for the weights' scale (or an update the clip did not bound)",
        "lower the learning rate (or the group's whose update is that large); check the clip"),
    "logit_drift": Prescription(
        "the output logits growing beyond their own drift",
        "the LM head's weights growing unchecked (its LR or weight decay)",
        "z-loss (1e-4); embedding and LM head at 0.5x trunk LR; check the head's weight decay"),
    # METRICS.md §2 router rows (no §6 row).
    "router_collapse": Prescription(
        "router load concentrating on a few experts",
        "the expert-selection bias or router logits drifting (balancing too weak or its "
        "update rate too high), or a data shift",
        "check the aux-loss-free bias update rate / the balancing loss weight; inspect the "
        "per-expert counts"),
    # §5 red tier, fast path: the model is broken, not drifting.
    "broken_model": Prescription(
        "loss at chance level or param norm jumped, not recovering",
        "one oversized update (an LR spike, a bad batch through an unclipped step) broke the "
        "weights",
        "restore the latest healthy checkpoint (params and optimizer state), cut the learning "
        "rate by 10% (20-50% if it recurs); check clipping"),
    # §5 red tier.
    "divergence": Prescription(
        "divergence that does not recover for N consecutive checks",
        "LR beyond the stable region (or a numerical overflow that persists)",
        "restore the latest healthy checkpoint (params and optimizer state), "
        "cut the learning rate by 10% (20-50% if it recurs), keep the data "
        "position"),
    # The replica rule (monitor/rules_replicas.py), by what it suspects.
    "replica_device": Prescription(
        "one replica's figures off the others' while its data moves",
        "a sick device (a chip returning wrong numbers or NaN)",
        "restart without that host from the healthy checkpoint; do not lower the learning rate"),
    "replica_data": Prescription(
        "one replica's figures off the others', following a data shard across replicas",
        "a bad data shard (corrupt or off-distribution)",
        "skip or repair that shard; keep the learning rate and the hosts"),
    "replica_unknown": Prescription(
        "one replica's figures off the others' (device or data not yet told apart)",
        "a sick device or the data shard it read",
        "rotate the data shards between replicas to tell; if it stays on the replica, restart "
        "without its host"),
    # What a check sees in the window since the previous one, and before the baselines.
    "data_quality": Prescription(
        "loss rising while the gradient, update and parameter figures stay in their bands",
        "the data: a degrading pipeline (corrupt, duplicated or off-distribution batches), not "
        "the optimizer",
        "inspect the recent batches and the data pipeline (sources, shuffling, tokenization); a "
        "rollback does not help while the data stays bad: fix the data, then resume"),
    "data_repeat": Prescription(
        "the train loss collapsing far below its recent level",
        "the data repeats: a shard on a loop, a broken shuffle, an epoch of a tiny set; the model "
        "memorises those batches (the loss jumps back when fresh data resumes)",
        "inspect the loader's order and shard boundaries (the batches since the alert's onset); "
        "a rollback does not help while the data repeats"),
    "skipped_update": Prescription(
        "an update skipped in the step (loss or gradient norm far outside the recent history, "
        "or non-finite)",
        "an outlying batch, or the first sign of an instability",
        "inspect the batch at the skip's step; if skips recur, treat it as a divergence (lower "
        "the learning rate, roll back)"),
    "early_jump": Prescription(
        "the loss or the gradient norm jumped before the baselines were armed",
        "an oversized update or a broken batch early in the run (an LR spike, bad data, an "
        "overflow)",
        "restore the latest healthy checkpoint (or restart), check the learning rate, the "
        "clipping and the batch"),
    "generic": Prescription(
        "a metric left its baseline",
        "see the localization for the earliest departing metric",
        "inspect the metric and the metrics that left their baselines first"),
})
"""METRICS.md §6 (plus the §4.4 periodic-spike and §5 red entries) as data."""

RULE_PRESCRIPTION: Mapping[str, str] = types.MappingProxyType({
    "grad_norm": "grad_norm_climb",
    "grad_trend": "grad_norm_climb",
    "group": "group_embedding_lr",
    "jump": "update_jump",
    "logits": "attn_logit_growth",
    "attn_logits": "attn_logit_growth",
    "update_size": "no_warmup",
    "output_logits": "logit_divergence",
    "broken_model": "broken_model",
    "router": "router_collapse",
    "param_norm": "param_norm_jump",
    "ratio": "generic",
    "nonfinite": "nan_loss",
    "loss_scale": "nan_loss",
    "loss_spike": "loss_spike_unrecovered",
    "periodic_spike": "periodic_spikes",
    "val_gap": "val_up_train_down",
    "val_rise": "val_up_train_down",
    "throughput": "low_throughput",
    "divergence": "divergence",
    "rollback": "divergence",
    "replica": "replica_unknown",
    "data": "data_quality",
    "repeat": "data_repeat",
    "skip": "skipped_update",
    "early": "early_jump",
})
"""Rule id -> key of :data:`PRESCRIPTIONS`."""


# --------------------------------------------------------------------------
# Dataclasses.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Localization:
    """One ranked entry of an alert's localization.

    Attributes:
        metric: the candidate metric, e.g. ``"grad/share/layer_1"``,
            ``"update/param_ratio/embedding"``.
        departure_step: the change point of the metric's own recent history:
            the first step from which it stayed off the extrapolation of its
            earlier samples (see ``jvitals.monitor.localize``).
        baseline: the value that extrapolation predicted at the departure.
        value: its latest value when the alert was localized.
        ratio: ``value / baseline`` (``inf`` when the baseline is 0).
        lead_steps: ``alert.onset_step - departure_step``; positive = it left
            its baseline before the anomaly.
        line: a readable sentence, e.g. ``"grad/share/layer_1 rose from 8% to
            19% starting at step 6500, 1500 steps before grad/global_norm crossed
            2x"``.
    """

    metric: str
    departure_step: int
    baseline: float
    value: float
    ratio: float
    lead_steps: int
    line: str

    def state_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "departure_step": self.departure_step,
            "baseline": enc_float(self.baseline),
            "value": enc_float(self.value),
            "ratio": enc_float(self.ratio),
            "lead_steps": self.lead_steps,
            "line": self.line,
        }

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "Localization":
        return cls(
            metric=d["metric"],
            departure_step=int(d["departure_step"]),
            baseline=dec_float(d["baseline"]),
            value=dec_float(d["value"]),
            ratio=dec_float(d["ratio"]),
            lead_steps=int(d["lead_steps"]),
            line=d["line"],
        )


@dataclasses.dataclass
class Alert:
    """One anomaly: a condition on a metric, opened once and updated in place.

    An ongoing condition is one ``Alert`` object (same ``id``) whose ``step``,
    ``value``, ``level`` etc. are updated at every check that sees the metric;
    when the condition clears, ``closed_step`` is set and the alert moves to
    ``Monitor.history``.

    Attributes:
        id: unique per monitor, in opening order (kept across ``state_dict``).
        rule: short rule id: ``'grad_norm'``, ``'param_norm'``, ``'ratio'``
            (a user-configured ratio rule), ``'grad_trend'``, ``'group'``,
            ``'broken_model'``, ``'nonfinite'``, ``'loss_spike'``,
            ``'periodic_spike'``, ``'val_gap'``, ``'throughput'``,
            ``'loss_scale'``, ``'divergence'``, ``'rollback'``.
        metric: the metric the rule watches (for ``'divergence'``: the metric
            of the earliest contributing alert).
        level: current level.
        step: step of the last update of this alert.
        value: the metric's value at ``step`` (for ``'periodic_spike'``: the
            period in steps).
        baseline: the reference the value is compared with (NaN if none).
        ratio: ``value / baseline`` (NaN if not meaningful).
        onset_step: step at which the condition began (for spikes: the spike's
            onset, not the step the alert opened).
        opened_step: step at which this alert opened.
        message: headline + likely cause + prescription (+ the lead line of the
            localization).
        cause: likely cause (METRICS.md §6).
        prescription: what to do (METRICS.md §6).
        localization: ranked :class:`Localization` entries (earliest departure
            first), computed when the alert opens or escalates.
        peak_level: highest level reached.
        closed_step: step at which it closed; ``None`` while open.
        details: rule-specific numbers (e.g. ``period``, ``consecutive_checks``).
        clearing_since: first step of the current run of checks at which the
            condition no longer held; the alert closes once that run lasts
            ``Policy.alerts.clear_steps`` steps (``None`` while the condition holds).
    """

    id: int
    rule: str
    metric: str
    level: Level
    step: int
    value: float
    baseline: float
    ratio: float
    onset_step: int
    opened_step: int
    message: str
    cause: str
    prescription: str
    localization: list[Localization]
    peak_level: Level
    closed_step: int | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    clearing_since: int | None = None

    @property
    def is_open(self) -> bool:
        return self.closed_step is None

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (non-finite floats as strings)."""
        return {
            "id": self.id,
            "rule": self.rule,
            "metric": self.metric,
            "level": int(self.level),
            "step": self.step,
            "value": enc_float(self.value),
            "baseline": enc_float(self.baseline),
            "ratio": enc_float(self.ratio),
            "onset_step": self.onset_step,
            "opened_step": self.opened_step,
            "message": self.message,
            "cause": self.cause,
            "prescription": self.prescription,
            "localization": [x.state_dict() for x in self.localization],
            "peak_level": int(self.peak_level),
            "closed_step": self.closed_step,
            "details": {
                k: (enc_float(v) if isinstance(v, float) else v)
                for k, v in self.details.items()
            },
            "clearing_since": self.clearing_since,
        }

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "Alert":
        """Inverse of :meth:`state_dict`."""
        details = {}
        for k, v in d["details"].items():
            if isinstance(v, str) and v in ("nan", "inf", "-inf"):
                v = float(v)
            details[k] = v
        return cls(
            id=int(d["id"]),
            rule=d["rule"],
            metric=d["metric"],
            level=Level(d["level"]),
            step=int(d["step"]),
            value=dec_float(d["value"]),
            baseline=dec_float(d["baseline"]),
            ratio=dec_float(d["ratio"]),
            onset_step=int(d["onset_step"]),
            opened_step=int(d["opened_step"]),
            message=d["message"],
            cause=d["cause"],
            prescription=d["prescription"],
            localization=[Localization.from_state_dict(x) for x in d["localization"]],
            peak_level=Level(d["peak_level"]),
            closed_step=None if d["closed_step"] is None else int(d["closed_step"]),
            details=details,
            clearing_since=d.get("clearing_since"),
        )


@dataclasses.dataclass(frozen=True)
class Spike:
    """Anatomy of one completed spike of ``loss`` or ``grad/global_norm``.

    The band: a spike starts when ``x > trend + max(spike_z * scale,
    (spike_min_ratio - 1) * |trend|)`` (the onset band), with ``trend`` an
    exponential moving average of the metric (half-life ``trend_halflife``
    steps) and ``scale`` the EMA standard deviation of its residual; both are
    frozen at the onset (``pre_trend``). It has recovered when ``x <=
    pre_trend + max(spike_recover_z * scale, (spike_recover_ratio - 1) *
    |pre_trend|)`` (the recovery band).

    Attributes:
        metric: ``"loss"`` or ``"grad/global_norm"`` (any of
            ``Policy.spike.metrics``).
        onset_step: first step above the onset band.
        peak_step: step of the peak.
        peak: peak value.
        pre_trend: trend at the onset.
        height: ``peak / pre_trend``.
        width: steps above the onset band: ``last_step_above - onset_step + 1``.
        recovery_steps: ``recovery_step - onset_step`` (back within the recovery
            band); ``None`` if it did not recover.
        recovered: whether it came back within the recovery band.
        post_level: mean of the metric over ``post_window`` steps after the
            recovery (recovered spikes), or over the last ``post_window`` steps
            before it was declared pathological (unrecovered ones).
        post_ratio: ``post_level / pre_trend`` (> 1: settled higher).
        kind: ``'physiological'`` (recovered within ``physiological_steps``),
            ``'slow'`` (recovered within ``pathological_steps``) or
            ``'pathological'`` (not recovered after ``pathological_steps``).
        end_step: step at which the record was completed.
        rolled_back: the spike was still open when a rollback was noted.
    """

    metric: str
    onset_step: int
    peak_step: int
    peak: float
    pre_trend: float
    height: float
    width: int
    recovery_steps: int | None
    recovered: bool
    post_level: float
    post_ratio: float
    kind: str
    end_step: int
    rolled_back: bool = False

    def state_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("peak", "pre_trend", "height", "post_level", "post_ratio"):
            d[k] = enc_float(d[k])
        return d

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "Spike":
        d = dict(d)
        for k in ("peak", "pre_trend", "height", "post_level", "post_ratio"):
            d[k] = dec_float(d[k])
        return cls(**d)


@dataclasses.dataclass
class Verdict:
    """What :meth:`Monitor.update` returns for one step.

    Attributes:
        step: the step checked.
        level: ``max`` of the open alerts' levels (GREEN when none).
        alerts: open alerts after this check, most severe first (the monitor's
            live objects: they keep updating at later steps; take
            ``dataclasses.replace(a)`` to freeze one).
        new_alerts: the alerts opened at this check.
        closed_alerts: the alerts closed at this check.
        scores: floats to log: ``monitor/level``, ``monitor/open_alerts`` and,
            per spike metric, the OLMo-style spike score (fraction of checks over
            the last ``score_window`` steps that were above the spike band), e.g.
            ``monitor/loss_spike_score``, ``monitor/grad_norm_spike_score``.
    """

    step: int
    level: Level
    alerts: list[Alert]
    new_alerts: list[Alert]
    closed_alerts: list[Alert]
    scores: dict[str, float]

    @property
    def onset_step(self) -> int | None:
        """Earliest ``onset_step`` among the alerts at the verdict's level."""
        onsets = [a.onset_step for a in self.alerts if a.level == self.level]
        return min(onsets) if onsets else None


# --------------------------------------------------------------------------
# The changes a rule returns (the rules_<topic> modules build them).
# --------------------------------------------------------------------------




class Change(NamedTuple):
    """One alert change a rule returns.

    ``op``: ``"set"`` opens or updates the alert ``(rule, key)`` at
    ``level``; ``"release"`` says its condition did not hold (it closes after
    ``Policy.alerts.clear_steps`` clear steps); ``"clear"`` closes it now.
    ``diverging``: counts toward the divergence rule (``None``: every
    ORANGE-or-worse set does). ``prescription``: a key of ``PRESCRIPTIONS``
    overriding the rule's own.
    """

    op: str
    rule: str
    key: str
    metric: str = ""
    level: Level = Level.GREEN
    value: float = NAN
    baseline: float = NAN
    ratio: float = NAN
    headline: str = ""
    event: str = ""
    onset: int | None = None
    details: dict[str, Any] | None = None
    diverging: bool | None = None
    prescription: str | None = None


class Reading(NamedTuple):
    """The figures of a ``"set"`` change: the value, the reference it was judged against
    and their ratio (``NAN`` where it has none)."""

    value: float
    baseline: float = NAN
    ratio: float = NAN


def set_(rule: str, metric: str, level: Level, *fields: Any, key: str | None = None, **kw: Any) -> Change:
    """A ``"set"`` change (``key`` defaults to the metric).

    Args:
      rule, metric, level: the alert's rule, metric and level.
      *fields: ``(reading, headline, event)`` with ``reading`` a :class:`Reading`; the older
        flat form ``(value, baseline, ratio, headline, event)`` is accepted too.
      key: the alert's key (default: ``metric``).
      **kw: the other :class:`Change` fields (``onset``, ``details``, ...).
    """
    if len(fields) == 3:
        reading, headline, event = fields
        value, baseline, ratio = reading
    else:
        value, baseline, ratio, headline, event = fields
    return Change("set", rule, metric if key is None else key, metric, level, value, baseline,
                  ratio, headline, event, **kw)


_CACHED: dict[tuple[str, str, str], Change] = {}


def _cached(op: str, rule: str, key: str) -> Change:
    c = _CACHED.get((op, rule, key))
    if c is None:
        if len(_CACHED) > 4096:
            _CACHED.clear()
        c = _CACHED[(op, rule, key)] = Change(op, rule, key)
    return c


def release(rule: str, key: str) -> Change:
    """A ``"release"`` change (immutable, so one object per (rule, key) is reused)."""
    return _cached("release", rule, key)


def clear(rule: str, key: str) -> Change:
    """A ``"clear"`` change."""
    return _cached("clear", rule, key)


class RuleBase:
    """What every default rule shares: its policy, its state, a no-op rewind.

    A rule's state is the attributes named in ``state_fields``: ``state_dict``
    writes each with :func:`~jvitals.monitor.types.enc_state` (plain JSON) and
    ``load_state_dict`` reads each back shaped like the fresh rule's own value
    (:func:`~jvitals.monitor.types.dec_state`; ``state_types[name]`` names the
    tracker class of a dict-of-trackers field). A field missing from the saved
    dict keeps its fresh value.
    """

    name = ""
    alert_ids: tuple[str, ...] = ()          # the ``rule`` of the alerts it makes
    levels: tuple[Level, ...] = ()           # the levels it can set
    state_fields: tuple[str, ...] = ()
    state_types: Mapping[str, type] = {}

    def __init__(self, policy: Any) -> None:
        self.p = policy

    def state_dict(self) -> dict[str, Any]:
        return {k: enc_state(getattr(self, k)) for k in self.state_fields}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        for k in self.state_fields:
            if k in d:
                setattr(self, k, dec_state(d[k], getattr(self, k), self.state_types.get(k)))

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        del step, t_to
        return []
