"""One small frozen configuration per rule family; :class:`~jvitals.monitor.policy.Policy`
composes them.

Every window is in steps (not checks), so a config works at any host cadence. Each
config checks its own fields: an error names the field (``SpikeConfig.z``, with its key
in the checkpoint's flat policy dict beside it) and what it expected. The calibration behind the defaults
(the tuning corpus, the papers) is in docs/MONITOR_POLICY.md.

Imports nothing from the other monitor modules but the flat names.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
import types
from typing import Any, Iterable, Mapping

from jvitals.monitor.flat_names import FLAT_KEY

__all__ = [
    "AlertConfig",
    "BandConfig",
    "BASELINE_KINDS",
    "BaselineConfig",
    "BetweenConfig",
    "HealthConfig",
    "LocalizeConfig",
    "RatioConfig",
    "ReplicaConfig",
    "ScaleConfig",
    "SpikeConfig",
    "SystemConfig",
    "ValidationConfig",
]

BASELINE_KINDS = ("drift", "fixed", "rolling", "ema")
"""Values of ``BaselineConfig.kind``."""



def _name(obj: Any, field: str) -> str:
    """``Cls.field``, with its key in the checkpoint's flat dict beside it:
    ``SpikeConfig.z (Policy.state_dict key 'spike_z')``."""
    cls = type(obj).__name__
    key = FLAT_KEY.get(cls, {}).get(field, field)
    return f"{cls}.{field} (Policy.state_dict key {key!r})"


def _set(obj: Any, field: str, value: Any) -> None:
    object.__setattr__(obj, field, value)


def _number(obj: Any, field: str, integer: bool = False) -> None:
    """TypeError unless the field holds a real number (an integer where ``integer``)."""
    v = getattr(obj, field)
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(v, bool) or not isinstance(v, kind) and not (integer and isinstance(v, float) and v.is_integer()):
        raise TypeError(f"{_name(obj, field)} expects {'an integer' if integer else 'a number'}, "
                        f"got {type(v).__name__} {v!r}")


def _typed(obj: Any) -> None:
    """TypeError naming a field whose value is not of its annotated scalar type (``float``,
    ``int`` or ``str``, each perhaps ``| None``): ``z="6"`` is a mistake, not a threshold.
    First in every config's ``__post_init__``, so the range checks below compare numbers."""
    for f in dataclasses.fields(obj):
        ann = str(f.type).replace(" ", "")
        base = ann[:-5] if ann.endswith("|None") else ann
        v = getattr(obj, f.name)
        if base not in ("float", "int", "str") or v is None and base != ann:
            continue
        if base != "str":
            _number(obj, f.name, integer=base == "int")
        elif not isinstance(v, str):
            raise TypeError(f"{_name(obj, f.name)} expects a str, got {type(v).__name__} {v!r}")


def _ints(obj: Any, fields: tuple[str, ...], least: int) -> None:
    for f in fields:
        if int(getattr(obj, f)) < least:
            raise ValueError(f"{_name(obj, f)} expects an integer >= {least}, got {getattr(obj, f)!r}")


def _optional_ints(obj: Any, fields: tuple[str, ...], least: int) -> None:
    for f in fields:
        v = getattr(obj, f)
        if v is not None and int(v) < least:
            raise ValueError(f"{_name(obj, f)} expects None or an integer >= {least}, got {v!r}")


def _above(obj: Any, fields: tuple[str, ...], least: float, what: str) -> None:
    for f in fields:
        if not getattr(obj, f) > least:
            raise ValueError(f"{_name(obj, f)} expects {what} > {least:g}, got {getattr(obj, f)!r}")


def _within(obj: Any, field: str, lo: float, hi: float, closed: str, what: str) -> None:
    """``closed``: which ends are included, ``""``, ``"lo"``, ``"hi"``."""
    v = getattr(obj, field)
    ok = (v >= lo if closed == "lo" else v > lo) and (v <= hi if closed == "hi" else v < hi)
    if not ok:
        span = ("[" if closed == "lo" else "(") + f"{lo:g}, {hi:g}" + ("]" if closed == "hi" else ")")
        raise ValueError(f"{_name(obj, field)} expects {what} in {span}, got {v!r}")


def _names(obj: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        v = getattr(obj, f)
        if isinstance(v, str) or not isinstance(v, Iterable):
            raise TypeError(f"{_name(obj, f)} expects a sequence of metric names, e.g. ('loss',), "
                            f"got {'the string' if isinstance(v, str) else type(v).__name__} {v!r}")
        _set(obj, f, tuple(v))


def _bands(obj: Any, field: str, what: str, above: float) -> None:
    """The mapping field as a read-only ``{name: float}`` whose values all exceed ``above``."""
    out = {}
    for k, r in dict(getattr(obj, field)).items():
        if not isinstance(k, str) or not float(r) > above:
            raise ValueError(f"{_name(obj, field)} expects {what} > {above:g}, got {k!r}: {r!r}")
        out[k] = float(r)
    _set(obj, field, types.MappingProxyType(out))


def _regex(obj: Any, field: str) -> None:
    pattern = getattr(obj, field)
    try:
        re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"{_name(obj, field)} expects a regular expression, got {pattern!r}: {e}") from None


KNOWN_FIGURES: tuple[str, ...] = (
    "loss", "val/loss", "grad/global_norm", "grad/global_norm_post_clip", "grad/clip_ratio",
    "grad/nonfinite_count", "param/global_norm", "update/global_norm", "update/param_ratio", "update/rms",
    "opt/learning_rate", "opt/loss_scale", "opt/skipped_steps", "opt/adam_nu_abs.max",
    "opt/adam_nu_log10_spread", "act/attn_logits_abs.max", "act/output_layer_logits_abs.max",
    "act/output_layer_logits_rms.avg", "act/output_layer_logsumexp.mean", "act/hidden_states_abs.max",
    "moe/maxvio.max", "moe/dead_expert_ratio", "sys/tokens_per_sec", "sys/steps_per_sec")
"""The figures the recorder and ``activation_metrics`` give that the configs name (a name
within a typo of one of these, but not one of them, is an error)."""


def _metric_names(obj: Any, field: str, names: Any) -> None:
    """Raises a ValueError for a metric name one typo from a known figure (``grad/gloabl_norm``):
    the rule would read a figure nobody logs and stay silent."""
    import difflib

    for n in names:
        if n in KNOWN_FIGURES or not isinstance(n, str):
            continue
        close = difflib.get_close_matches(n, KNOWN_FIGURES, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"{_name(obj, field)} names {n!r}, which no figure is called; did you mean "
                             f"{close[0]!r}? (a name nobody logs leaves its rule without input)")


def _mapping(factory: Any) -> Any:
    return dataclasses.field(default_factory=factory, hash=False)


@dataclasses.dataclass(frozen=True)
class BaselineConfig:
    """When the baselines start and what a ratio rule judges against (``Policy.baselines``).

    Args:
      warmup_steps: baselines start at this step (model time); ``None``: found from the
        run (the LR's plateau via ``lr_metric``, else ``settle_metric`` settled).
      lr_metric: the learning rate's metric (also the schedule's and the jump rule's).
      lr_plateau_tol: the LR stopped rising once ``lr <= prev * (1 + tol)``.
      settle_metric, settle_window, settle_min_samples, settle_tolerance, settle_max_steps:
        the run settled when the Theil-Sen slope of ``log settle_metric`` over
        ``settle_window`` steps (``None``: ``steps // 2``) implies a change below
        ``settle_tolerance``; ``settle_max_steps`` (``None``: ``4 * steps``) caps the wait.
      steps, min_samples: the fixed baseline is the median of the first ``steps`` steps
        after the start (at least ``min_samples`` samples).
      kind: ``"drift"`` (default), ``"fixed"``, ``"rolling"`` or ``"ema"``.
      drift_halflife: half-life (steps) of the drift reference's EMA of ``log x``.
      rolling_window, rolling_k: the rolling baseline (OLMo-core: mean + k std).
      ema_alpha, ema_z: the EMA baseline (ZClip).
      adaptive_min_samples: samples before an adaptive baseline judges.
    """

    warmup_steps: int | None = None
    lr_metric: str = "opt/learning_rate"
    lr_plateau_tol: float = 1e-3
    settle_metric: str = "grad/global_norm"
    settle_window: int | None = None
    settle_min_samples: int = 4
    settle_tolerance: float = 0.15
    settle_max_steps: int | None = None
    steps: int = 500
    min_samples: int = 3
    kind: str = "drift"
    drift_halflife: float = 500.0
    rolling_window: int = 128
    rolling_k: float = 6.0
    ema_alpha: float = 0.97
    ema_z: float = 2.5
    adaptive_min_samples: int = 16

    def __post_init__(self) -> None:
        _typed(self)
        _optional_ints(self, ("warmup_steps", "settle_window", "settle_max_steps"), 0)
        if self.kind not in BASELINE_KINDS:
            raise ValueError(f"{_name(self, 'kind')} expects one of {sorted(BASELINE_KINDS)}, got {self.kind!r}")
        _ints(self, ("steps", "min_samples", "rolling_window", "adaptive_min_samples", "settle_min_samples"), 1)
        _within(self, "ema_alpha", 0, 1, "", "an alpha")
        _above(self, ("drift_halflife",), 0, "positive steps")

    @property
    def settle_span(self) -> int:
        """``settle_window``, or ``max(steps // 2, 1)``."""
        return self.settle_window if self.settle_window is not None else max(self.steps // 2, 1)

    @property
    def settle_cap(self) -> int:
        """``settle_max_steps``, or ``4 * steps``."""
        return self.settle_max_steps if self.settle_max_steps is not None else 4 * self.steps


def _default_ratio_thresholds() -> Mapping[str, tuple[float, float | None]]:
    return {"grad/global_norm": (2.0, 3.0)}


@dataclasses.dataclass(frozen=True)
class RatioConfig:
    """The ratio, creep (trend) and jump rules on global figures (``Policy.ratio``).

    Args:
      thresholds: metric -> ``(yellow_ratio, orange_ratio or None)`` of ``x / reference``.
      schedule_metrics: metrics whose reference is scaled by the schedule's factor
        ``max((lr_b / lr) ** lr_exponent, pn_b / pn, 1)``.
      jump_metrics: metric -> ratio: YELLOW when ``x / lr`` jumps by it in one check.
      lr_exponent: the LR term's exponent (0: off).
      weight_decay: the optimizer's decoupled weight decay; ``0`` turns the LR term off.
      noise_z: the drift reference's thresholds widen to ``exp(noise_z * noise)``.
      confirm_checks, confirm_steps: consecutive checks (spanning at least this many
        steps) before an alert opens or escalates.
      trend_metrics: metric -> least rise of the creep rule.
      trend_window, trend_buckets, trend_drift_k: its window, buckets per window and the
        multiple of the run's own drift it must exceed.
    """

    thresholds: Mapping[str, tuple[float, float | None]] = _mapping(_default_ratio_thresholds)
    schedule_metrics: tuple[str, ...] = ("grad/global_norm",)
    jump_metrics: Mapping[str, float] = _mapping(lambda: {"update/param_ratio": 5.0})
    lr_exponent: float = 0.5
    weight_decay: float | None = None
    noise_z: float = 3.0
    confirm_checks: int = 3
    confirm_steps: int = 0
    trend_metrics: Mapping[str, float] = _mapping(lambda: {"grad/global_norm": 1.3, "param/global_norm": 1.5})
    trend_window: int = 1000
    trend_buckets: int = 24
    trend_drift_k: float = 3.0

    def __post_init__(self) -> None:
        _typed(self)
        for f in ("thresholds", "schedule_metrics", "jump_metrics", "trend_metrics"):
            _metric_names(self, f, getattr(self, f))
        rules = {}
        for name, thr in dict(self.thresholds).items():
            if not isinstance(name, str):
                raise TypeError(f"{_name(self, 'thresholds')} keys must be metric names (str), got {name!r}")
            try:
                y, o = thr
            except (TypeError, ValueError):
                raise TypeError(f"{_name(self, 'thresholds')}[{name!r}] must be (yellow_ratio, orange_ratio or "
                                f"None), got {thr!r}") from None
            y, o = float(y), None if o is None else float(o)
            if not y > 0 or (o is not None and not o > y):
                raise ValueError(f"{_name(self, 'thresholds')}[{name!r}] expects 0 < yellow < orange, got ({y}, {o})")
            rules[name] = (y, o)
        _set(self, "thresholds", types.MappingProxyType(rules))
        _bands(self, "jump_metrics", "metric name -> ratio", 1)
        _bands(self, "trend_metrics", "metric name -> rise", 1)
        _names(self, ("schedule_metrics",))
        _ints(self, ("confirm_checks", "trend_window"), 1)
        _ints(self, ("confirm_steps",), 0)
        if self.trend_buckets < 8:
            raise ValueError(f"{_name(self, 'trend_buckets')} expects >= 8, got {self.trend_buckets}")
        _above(self, ("trend_drift_k",), 1, "a ratio")
        for f in ("lr_exponent", "weight_decay"):
            v = getattr(self, f)
            if v is not None and v < 0:
                raise ValueError(f"{_name(self, f)} expects a value >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class AlertConfig:
    """How an alert holds, ends and is remembered (``Policy.alerts``).

    Args:
      hysteresis: an open ratio/throughput/band alert steps down only below this fraction
        of its threshold's excess (1 disables).
      clear_steps: a condition clear for this many steps closes its alert.
      episode_gap: a condition clear this long has ended: holding again is a new episode.
      history_size, spikes_size: lengths of ``Monitor.history`` and ``Monitor.spikes``.
    """

    hysteresis: float = 0.9
    clear_steps: int = 100
    episode_gap: int = 20
    history_size: int = 256
    spikes_size: int = 256

    def __post_init__(self) -> None:
        _typed(self)
        _within(self, "hysteresis", 0, 1, "hi", "a value")
        _ints(self, ("clear_steps", "episode_gap"), 0)
        _ints(self, ("history_size", "spikes_size"), 1)


@dataclasses.dataclass(frozen=True)
class SystemConfig:
    """Non-finite figures, throughput and the loss scale (``Policy.system``).

    Args:
      nonfinite_metrics: a non-finite value is ORANGE.
      nonfinite_count_metrics: a value > 0 (or non-finite) is ORANGE.
      throughput_metrics: the first present one is judged.
      throughput_drop, throughput_z, throughput_noise_halflife, throughput_hold_steps:
        YELLOW when ``log(x / baseline) < -max(-log(1 - drop), z * sd)`` for
        ``hold_steps`` steps (``sd``: the run's own noise, an EMA with that half-life).
      loss_scale_metric, loss_scale_drop: YELLOW when the scale falls by this factor.
      event_hold_steps: the loss-scale alert stays open this long after the last drop.
    """

    nonfinite_metrics: tuple[str, ...] = ("loss", "grad/global_norm")
    nonfinite_count_metrics: tuple[str, ...] = ("grad/nonfinite_count",)
    throughput_metrics: tuple[str, ...] = ("sys/tokens_per_sec", "sys/steps_per_sec")
    throughput_drop: float = 0.3
    throughput_z: float = 5.0
    throughput_noise_halflife: float = 1000.0
    throughput_hold_steps: int = 40
    loss_scale_metric: str = "opt/loss_scale"
    loss_scale_drop: float = 16.0
    event_hold_steps: int = 300

    def __post_init__(self) -> None:
        _typed(self)
        _names(self, ("nonfinite_metrics", "nonfinite_count_metrics", "throughput_metrics"))
        _above(self, ("throughput_z", "throughput_noise_halflife"), 0, "a positive value")
        _ints(self, ("throughput_hold_steps", "event_hold_steps"), 0)
        _within(self, "throughput_drop", 0, 1, "", "a fraction")


@dataclasses.dataclass(frozen=True)
class BetweenConfig:
    """The rules on what happened between two checks (``Policy.between``; rules_window.py).

    Args:
      early_jumps, early_min_samples, early_min_span: before the baselines are armed, a
        figure at least its ratio x the median of its last 8 checks is ORANGE.
      skip_orange_checks: skipped updates at this many consecutive checks are ORANGE.
      window_min_steps: steps of pooled windows before a window's maximum is judged.
      data_window, data_rise, data_z, data_band, data_confirm: the data rule (the loss
        rising while the optimizer's figures stay within ``data_band`` of their levels).
      repeat_window, repeat_collapse: the repeat rule (the loss this many times below its
        median over this many steps: repeated batches).
    """

    early_jumps: Mapping[str, float] = _mapping(lambda: {"loss": 2.0, "grad/global_norm": 10.0})
    early_min_samples: int = 4
    early_min_span: int = 20
    skip_orange_checks: int = 3
    window_min_steps: int = 64
    data_window: int = 1000
    data_rise: float = 1.15
    data_z: float = 3.0
    data_band: float = 2.0
    data_confirm: int = 2
    repeat_window: int = 200
    repeat_collapse: float = 3.0

    def __post_init__(self) -> None:
        _typed(self)
        _bands(self, "early_jumps", "metric name -> ratio", 1)
        _above(self, ("repeat_collapse",), 1, "a ratio")
        _ints(self, ("repeat_window",), 1)
        _above(self, ("data_rise", "data_band"), 1, "a ratio")
        _above(self, ("data_z",), 0, "a positive z-score")
        _ints(self, ("early_min_samples", "skip_orange_checks", "data_window", "window_min_steps",
                     "data_confirm"), 1)
        _ints(self, ("early_min_span",), 0)


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """The val-loss rules: gap growth and val rise (``Policy.validation``).

    Args:
      gap_window: ``W`` of the gap growth rule.
      gap_ratio, gap_min_growth: YELLOW when ``g(t) - g(t-W) > gap_ratio * max(g(t-W) -
        g(t-2W), 0) + gap_min_growth * |loss|``.
      gap_halflife: EMA half-life (steps) smoothing the gap samples (>= 0).
      gap_z: the growth excess must exceed this many of its standard deviations.
      gap_confirm: consecutive samples meeting a rule before the YELLOW.
      rise_window, rise_min_samples, rise_z, rise_min: the val-rise rule (Mann-Kendall
        z > ``rise_z`` and a Theil-Sen rise >= ``rise_min`` while the loss falls, over the
        last ``rise_window`` steps, reaching back to hold ``rise_min_samples`` samples).
      rise_sparse_run: where ``val/loss`` is sparse (its last ``rise_sparse_run`` intervals
        span ``rise_window`` steps or more, as at the README's heavy cadence of 500), a val
        loss that rose at each of its last ``rise_sparse_run`` samples, by ``rise_min``
        (relative) in all, while the loss falls, is the rise (0: off).
    """

    gap_window: int = 1000
    gap_ratio: float = 1.5
    gap_min_growth: float = 0.05
    gap_halflife: float = 250.0
    gap_z: float = 4.0
    gap_confirm: int = 2
    rise_window: int = 500
    rise_min_samples: int = 8
    rise_z: float = 3.0
    rise_min: float = 0.02
    rise_sparse_run: int = 2

    def __post_init__(self) -> None:
        _typed(self)
        _ints(self, ("gap_window", "gap_confirm", "rise_window", "rise_min_samples"), 1)
        _ints(self, ("rise_sparse_run",), 0)
        if not self.gap_halflife >= 0:
            raise ValueError(f"{_name(self, 'gap_halflife')} expects a half-life >= 0 steps, got "
                             f"{self.gap_halflife!r}")


@dataclasses.dataclass(frozen=True)
class SpikeConfig:
    """Spike anatomy, periodicity and the spike scores (``Policy.spike``).

    Args:
      metrics: metrics with spike anatomy, periodicity and a score.
      alert_metrics: metrics with the unrecovered-spike YELLOW and divergence RED.
      z, min_ratio: onset band ``trend + max(z * scale, (min_ratio - 1) * |trend|)``.
      recover_z, recover_ratio: the recovery band, same form.
      trend_halflife, scale_halflife: EMA half-lives (steps) of the trend and variance.
      min_samples: samples after warm-up before spikes are detected.
      physiological_steps, pathological_steps: recovered within the first: physiological;
        not recovered after the second: pathological.
      post_window: steps averaged for a spike's post-spike level.
      forget_steps: an unrecovered spike's reference is dropped this long after onset.
      periodic_metrics, periodic_min_spikes, periodic_tolerance, periodic_min_interval:
        near-regular spike onsets make a periodic pattern.
      periodic_escalate_min_spikes, periodic_shrink: ORANGE when the intervals shrink.
      score_window: the spike scores' window (steps).
    """

    metrics: tuple[str, ...] = ("loss", "grad/global_norm")
    alert_metrics: tuple[str, ...] = ("loss",)
    z: float = 6.0
    min_ratio: float = 1.1
    recover_z: float = 3.0
    recover_ratio: float = 1.05
    trend_halflife: float = 100.0
    scale_halflife: float = 500.0
    min_samples: int = 20
    physiological_steps: int = 300
    pathological_steps: int = 500
    post_window: int = 100
    forget_steps: int = 5000
    periodic_metrics: tuple[str, ...] = ("loss",)
    periodic_min_spikes: int = 3
    periodic_tolerance: float = 0.25
    periodic_min_interval: int = 100
    periodic_escalate_min_spikes: int = 4
    periodic_shrink: float = 0.9
    score_window: int = 10_000

    def __post_init__(self) -> None:
        _typed(self)
        _names(self, ("metrics", "alert_metrics", "periodic_metrics"))
        _above(self, ("trend_halflife", "scale_halflife"), 0, "positive steps")
        _ints(self, ("physiological_steps", "pathological_steps", "post_window", "forget_steps",
                     "periodic_min_interval", "min_samples"), 0)
        _ints(self, ("score_window",), 1)
        _ints(self, ("periodic_min_spikes",), 3)


@dataclasses.dataclass(frozen=True)
class BandConfig:
    """Figures against their own band: groups, logits, the router (``Policy.bands``).

    Args:
      group_bands: family -> band ratio of the group rule (``y = log(x / trunk)``).
      group_z, group_jump, group_window, group_drift_k: a one-sample change beyond
        ``group_z`` x its noise or ``group_jump``, or a drift over ``group_window`` steps
        beyond ``group_drift_k`` x its own drift.
      drift_memory: half-life (steps) with which a figure's own largest drift fades.
      group_confirm: samples a step or drift departure must hold.
      group_min_share: ``grad/share`` figures below this share are not judged.
      group_global_ratio: fires only while the global norms stay below this x baseline.
      group_growth: families also judged for a growth that does not slow
        (:class:`~jvitals.monitor.trackers_bands.DriftBand`'s growth departure).
      logit_bands: metric -> band ratio of the logits rule (rises only).
      router_bands, router_z, router_steps: metric -> least excess over its baseline;
        YELLOW when beyond ``max(router_z * 1.4826 MAD, excess)`` for ``router_steps``.
    """

    group_bands: Mapping[str, float] = _mapping(
        lambda: {"update/param_ratio": 2.0, "grad/share": 2.0, "param/norm": 1.5})
    group_z: float = 6.0
    group_jump: float = 5.0
    group_window: int = 500
    group_drift_k: float = 3.0
    drift_memory: float = 500.0
    group_confirm: int = 2
    group_min_share: float = 0.01
    group_global_ratio: float = 1.5
    group_growth: tuple[str, ...] = ("param/norm",)
    logit_bands: Mapping[str, float] = _mapping(
        lambda: {"act/attn_logits_abs.max": 2.0, "act/output_layer_logits_abs.max": 2.0})
    router_bands: Mapping[str, float] = _mapping(lambda: {"moe/maxvio.max": 0.5, "moe/dead_expert_ratio": 0.2})
    router_z: float = 6.0
    router_steps: int = 50

    def __post_init__(self) -> None:
        _typed(self)
        _bands(self, "group_bands", "family name -> ratio", 1)
        _names(self, ("group_growth",))
        _bands(self, "router_bands", "metric name -> excess", 0)
        _bands(self, "logit_bands", "metric name -> ratio", 1)
        _ints(self, ("group_window", "group_confirm"), 1)
        _ints(self, ("router_steps",), 0)
        _above(self, ("group_jump", "group_drift_k"), 1, "a ratio")
        _within(self, "group_min_share", 0, 1, "lo", "a share")
        _above(self, ("drift_memory",), 0, "positive steps")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """A broken model and the divergence (``Policy.health``).

    Args:
      vocab_size, vocab_metric: the vocabulary size (``None``: read ``vocab_metric``) for
        the chance level ``log(vocab_size)``.
      broken_chance_frac: the loss is "at chance" at this fraction of the chance level.
      broken_param_jump, broken_jump_window: the param norm jumped by this ratio over
        this many steps ...
      broken_param_loss: ... while the loss is at least this x what it was then.
      broken_steps, broken_loss_steps: RED when a param jump (a chance-level loss) has
        not recovered after this many steps.
      divergence_loss_ratio: "far above its pre-spike trend".
      red_after, red_min_steps: consecutive divergent checks (lasting at least this
        many steps) before RED.
    """

    vocab_size: int | None = None
    vocab_metric: str = "model/vocab_size"
    broken_chance_frac: float = 0.9
    broken_param_jump: float = 1.5
    broken_jump_window: int = 100
    broken_param_loss: float = 1.0
    broken_steps: int = 50
    broken_loss_steps: int = 100
    divergence_loss_ratio: float = 1.25
    red_after: int = 3
    red_min_steps: int = 0

    def __post_init__(self) -> None:
        _typed(self)
        _optional_ints(self, ("vocab_size",), 1)
        _ints(self, ("red_after", "broken_jump_window"), 1)
        _ints(self, ("broken_steps", "broken_loss_steps", "red_min_steps"), 0)
        _above(self, ("broken_param_jump",), 1, "a ratio")
        _above(self, ("broken_param_loss",), 0, "a ratio")
        _within(self, "broken_chance_frac", 0, 1, "hi", "a fraction")


@dataclasses.dataclass(frozen=True)
class LocalizeConfig:
    """Localization: which figure departed first (``Policy.localize``).

    Args:
      pattern: regex selecting the candidate metrics (per layer, embedding, LM head, router).
      window, rows: candidate history, ``rows`` rows over ``window`` steps.
      lookback, reference: the departure is looked for in ``[onset - lookback, now]``
        against a line fitted to the ``reference`` steps before.
      z, min_ratio, drift_slack: off that line by more than ``max(z * sd, min_ratio *
        |prediction|, drift_slack * |extrapolated change|)``.
      top: entries kept per alert.
      max_metrics: per-layer metrics tracked at most.
    """

    pattern: str = r"/(?:layer_\d+|embedding|lm_head)$|^moe/"
    window: int = 5000
    rows: int = 512
    lookback: int = 250
    reference: int = 1000
    z: float = 8.0
    min_ratio: float = 0.25
    drift_slack: float = 1.0
    top: int = 5
    max_metrics: int = 4096

    def __post_init__(self) -> None:
        _typed(self)
        _regex(self, "pattern")
        _ints(self, ("window", "rows", "lookback", "reference", "top", "max_metrics"), 1)


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """Per-replica figures: the rule naming a sick device or data shard (``Policy.replica``).

    See docs/REPLICAS.md.

    Args:
      z: a replica is an outlier when ``|robust z|`` against the others exceeds this ...
      min_ratio: ... and its ratio to the median is beyond this (either way).
      rel_floor: the least scale of the z-score, as a fraction of ``|median|``.
      spread_halflife: half-life (checks) of each figure's typical spread between replicas.
      confirm: consecutive checks (same replica or shard) before the YELLOW.
      min_replicas: fewer finite replicas than this name no outlier.
    """

    z: float = 8.0
    min_ratio: float = 1.5
    rel_floor: float = 0.02
    spread_halflife: float = 20.0
    confirm: int = 2
    min_replicas: int = 3

    def __post_init__(self) -> None:
        _typed(self)
        _above(self, ("z",), 0, "a value")
        _above(self, ("min_ratio",), 1, "a value")
        _within(self, "rel_floor", 0, 1, "lo", "a fraction")
        _ints(self, ("confirm",), 1)
        if int(self.min_replicas) < 3:
            raise ValueError(f"{_name(self, 'min_replicas')} expects an integer >= 3 (a median of fewer than 3 "
                             f"replicas names no outlier), got {self.min_replicas!r}")
        _above(self, ("spread_halflife",), 0, "a number of checks")


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """Figures judged against what their scale means on its own (``Policy.scale``).

    Args:
      attn_metric: the largest attention logit (per-layer figures: ``{attn_metric}/layer_{i}``).
      attn_level: a logit at which a softmax row is one-hot (every other key below
        ``e^-attn_level``, under float32's precision, 2^-23 = e^-15.9).
      attn_growth, attn_window: rising at least this many times its minimum over this
        many steps.
      attn_orange: ORANGE past this (MuonClip's QK-clip threshold, tau = 100).
      qk_clip_tau: the tau the guard's ``qk_clip`` remedy applies for this alert: below
        ``hysteresis x attn_level``, so a clipped attention (whose largest logit overshoots tau
        by a step's update before the next clip) neither reopens nor holds the alert.
      out_metric, out_level, out_growth, out_window: the output logits' largest value rising
        this many times within this many steps into the level where bfloat16's spacing is
        half a nat.
      update_level: one update's ``update/param_ratio`` at which the update rule fires.
      update_hold: steps the update rule holds after the last such update.
      warmup_frac: "no warm-up" when the learning rate at the first check was at least this
        x its peak so far.
      vanish_level, vanish_checks: Adam's update per element and per unit learning rate
        (``update/rms / opt/learning_rate``) below this at this many checks running: its
        epsilon sets the step.
    """

    attn_metric: str = "act/attn_logits_abs.max"
    attn_level: float = 20.0
    attn_growth: float = 3.0
    attn_window: int = 200
    attn_orange: float = 100.0
    qk_clip_tau: float = 15.0
    out_metric: str = "act/output_layer_logits_abs.max"
    out_level: float = 100.0
    out_growth: float = 3.0
    out_window: int = 500
    update_level: float = 0.1
    update_hold: int = 200
    warmup_frac: float = 0.5
    vanish_level: float = 0.05
    vanish_checks: int = 1

    def __post_init__(self) -> None:
        _typed(self)
        _above(self, ("update_level",), 0, "a ratio")
        _ints(self, ("update_hold",), 0)
        _ints(self, ("vanish_checks",), 1)
        _above(self, ("vanish_level",), 0, "an update per unit learning rate")
        _within(self, "warmup_frac", 0, 1, "hi", "a fraction")
        _above(self, ("attn_level", "qk_clip_tau"), 0, "a logit")
        _above(self, ("attn_growth", "out_growth"), 1, "a ratio")
        _above(self, ("out_level",), 0, "a logit")
        _ints(self, ("attn_window", "out_window"), 1)
        if not self.attn_orange >= self.attn_level:
            raise ValueError(f"{_name(self, 'attn_orange')} expects a logit >= attn_level = {self.attn_level!r}, "
                             f"got {self.attn_orange!r}")
