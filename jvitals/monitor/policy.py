"""The monitor's policy: the composition of one small config per rule family.

``Policy()`` gives METRICS.md §5's defaults. Each family's thresholds live in its own
frozen config (:mod:`jvitals.monitor.config`): ``Policy(spike=SpikeConfig(z=5.0))``. The
old flat names (``Policy(spike_z=5.0)``, ``policy.spike_z``) still work for one release,
with a ``DeprecationWarning`` naming the new place; :meth:`Policy.state_dict` writes the
flat dict checkpoints have always held and :meth:`Policy.from_state_dict` reads it.
docs/MONITOR_POLICY.md has every field and the calibration behind it.

Imports nothing from the other monitor modules but the configs and the codec: the rules and trackers
read a :class:`Policy`, it never reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Mapping

from jvitals.monitor.codec import LegacyDict
from jvitals.monitor.config import (
    BASELINE_KINDS,
    OLD_NAMES,
    AlertConfig,
    BandConfig,
    BaselineConfig,
    BetweenConfig,
    HealthConfig,
    LocalizeConfig,
    RatioConfig,
    ReplicaConfig,
    SpikeConfig,
    SystemConfig,
    ValidationConfig,
)

__all__ = ["BASELINE_KINDS", "Policy"]

# The old flat field -> (config, field), in the order of the flat dict ``state_dict`` writes.
_FLAT: Mapping[str, tuple[str, str]] = {
    "warmup_steps": ("baselines", "warmup_steps"), "lr_metric": ("baselines", "lr_metric"),
    "lr_plateau_tol": ("baselines", "lr_plateau_tol"), "settle_metric": ("baselines", "settle_metric"),
    "settle_window": ("baselines", "settle_window"), "settle_min_samples": ("baselines", "settle_min_samples"),
    "settle_tolerance": ("baselines", "settle_tolerance"),
    "settle_max_steps": ("baselines", "settle_max_steps"), "baseline_steps": ("baselines", "steps"),
    "baseline_min_samples": ("baselines", "min_samples"), "baseline": ("baselines", "kind"),
    "drift_halflife": ("baselines", "drift_halflife"), "ratio_rules": ("ratio", "thresholds"),
    "schedule_metrics": ("ratio", "schedule_metrics"), "jump_metrics": ("ratio", "jump_metrics"),
    "lr_exponent": ("ratio", "lr_exponent"), "weight_decay": ("ratio", "weight_decay"),
    "ratio_noise_z": ("ratio", "noise_z"), "confirm_checks": ("ratio", "confirm_checks"),
    "confirm_steps": ("ratio", "confirm_steps"), "hysteresis": ("alerts", "hysteresis"),
    "clear_steps": ("alerts", "clear_steps"), "episode_gap": ("alerts", "episode_gap"),
    "rolling_window": ("baselines", "rolling_window"), "rolling_k": ("baselines", "rolling_k"),
    "ema_alpha": ("baselines", "ema_alpha"), "ema_z": ("baselines", "ema_z"),
    "adaptive_min_samples": ("baselines", "adaptive_min_samples"),
    "nonfinite_metrics": ("system", "nonfinite_metrics"),
    "nonfinite_count_metrics": ("system", "nonfinite_count_metrics"),
    "throughput_metrics": ("system", "throughput_metrics"), "throughput_drop": ("system", "throughput_drop"),
    "throughput_z": ("system", "throughput_z"),
    "throughput_noise_halflife": ("system", "throughput_noise_halflife"),
    "throughput_hold_steps": ("system", "throughput_hold_steps"), "early_jumps": ("between", "early_jumps"),
    "early_min_samples": ("between", "early_min_samples"), "early_min_span": ("between", "early_min_span"),
    "skip_orange_checks": ("between", "skip_orange_checks"),
    "window_min_steps": ("between", "window_min_steps"), "data_window": ("between", "data_window"),
    "data_rise": ("between", "data_rise"), "data_z": ("between", "data_z"),
    "data_band": ("between", "data_band"), "data_confirm": ("between", "data_confirm"),
    "loss_scale_metric": ("system", "loss_scale_metric"), "loss_scale_drop": ("system", "loss_scale_drop"),
    "event_hold_steps": ("system", "event_hold_steps"), "val_gap_window": ("validation", "gap_window"),
    "val_gap_ratio": ("validation", "gap_ratio"), "val_gap_min_growth": ("validation", "gap_min_growth"),
    "val_gap_halflife": ("validation", "gap_halflife"), "spike_metrics": ("spike", "metrics"),
    "spike_alert_metrics": ("spike", "alert_metrics"), "spike_z": ("spike", "z"),
    "spike_min_ratio": ("spike", "min_ratio"), "spike_recover_z": ("spike", "recover_z"),
    "spike_recover_ratio": ("spike", "recover_ratio"), "trend_halflife": ("spike", "trend_halflife"),
    "scale_halflife": ("spike", "scale_halflife"), "spike_min_samples": ("spike", "min_samples"),
    "physiological_steps": ("spike", "physiological_steps"),
    "pathological_steps": ("spike", "pathological_steps"), "post_window": ("spike", "post_window"),
    "spike_forget_steps": ("spike", "forget_steps"), "periodic_metrics": ("spike", "periodic_metrics"),
    "periodic_min_spikes": ("spike", "periodic_min_spikes"),
    "periodic_tolerance": ("spike", "periodic_tolerance"),
    "periodic_min_interval": ("spike", "periodic_min_interval"),
    "periodic_escalate_min_spikes": ("spike", "periodic_escalate_min_spikes"),
    "periodic_shrink": ("spike", "periodic_shrink"), "trend_metrics": ("ratio", "trend_metrics"),
    "trend_window": ("ratio", "trend_window"), "trend_buckets": ("ratio", "trend_buckets"),
    "trend_drift_k": ("ratio", "trend_drift_k"), "group_bands": ("bands", "group_bands"),
    "group_z": ("bands", "group_z"), "group_jump": ("bands", "group_jump"),
    "group_window": ("bands", "group_window"), "group_drift_k": ("bands", "group_drift_k"),
    "drift_memory": ("bands", "drift_memory"), "group_confirm": ("bands", "group_confirm"),
    "group_min_share": ("bands", "group_min_share"), "group_global_ratio": ("bands", "group_global_ratio"),
    "logit_bands": ("bands", "logit_bands"), "router_bands": ("bands", "router_bands"),
    "router_z": ("bands", "router_z"), "router_steps": ("bands", "router_steps"),
    "vocab_size": ("health", "vocab_size"), "vocab_metric": ("health", "vocab_metric"),
    "broken_chance_frac": ("health", "broken_chance_frac"),
    "broken_param_jump": ("health", "broken_param_jump"),
    "broken_jump_window": ("health", "broken_jump_window"), "broken_steps": ("health", "broken_steps"),
    "broken_loss_steps": ("health", "broken_loss_steps"), "gap_z": ("validation", "gap_z"),
    "gap_confirm": ("validation", "gap_confirm"), "val_rise_window": ("validation", "rise_window"),
    "val_rise_min_samples": ("validation", "rise_min_samples"), "val_rise_z": ("validation", "rise_z"),
    "val_rise_min": ("validation", "rise_min"), "divergence_loss_ratio": ("health", "divergence_loss_ratio"),
    "red_after": ("health", "red_after"), "red_min_steps": ("health", "red_min_steps"),
    "score_window": ("spike", "score_window"), "localize_pattern": ("localize", "pattern"),
    "localize_window": ("localize", "window"), "localize_rows": ("localize", "rows"),
    "localize_lookback": ("localize", "lookback"), "localize_reference": ("localize", "reference"),
    "localize_z": ("localize", "z"), "localize_min_ratio": ("localize", "min_ratio"),
    "localize_drift_slack": ("localize", "drift_slack"), "localize_top": ("localize", "top"),
    "localize_max_metrics": ("localize", "max_metrics"), "history_size": ("alerts", "history_size"),
    "spikes_size": ("alerts", "spikes_size"), "replica_z": ("replica", "z"),
    "replica_min_ratio": ("replica", "min_ratio"), "replica_rel_floor": ("replica", "rel_floor"),
    "replica_spread_halflife": ("replica", "spread_halflife"), "replica_confirm": ("replica", "confirm"),
    "replica_min_replicas": ("replica", "min_replicas"),
}

# The old Policy properties -> (config, property).
_MOVED: Mapping[str, tuple[str, str]] = {"settle_span": ("baselines", "settle_span"),
                                         "settle_cap": ("baselines", "settle_cap")}

_CONFIGS: Mapping[str, type] = {
    "baselines": BaselineConfig, "ratio": RatioConfig, "alerts": AlertConfig, "system": SystemConfig,
    "between": BetweenConfig, "validation": ValidationConfig, "spike": SpikeConfig, "bands": BandConfig,
    "health": HealthConfig, "localize": LocalizeConfig, "replica": ReplicaConfig,
}
for _old, (_sub, _new) in _FLAT.items():
    OLD_NAMES.setdefault(_CONFIGS[_sub].__name__, {})[_new] = _old


def _new_place(old: str) -> str:
    sub, new = _FLAT[old]
    return f"Policy({sub}={_CONFIGS[sub].__name__}({new}=...)) / policy.{sub}.{new}"


def _plain(v: Any) -> Any:
    """A config value in the flat dict's JSON form (mappings -> dicts, tuples -> lists)."""
    if isinstance(v, Mapping):
        return {k: list(x) if isinstance(x, tuple) else x for k, x in v.items()}
    return list(v) if isinstance(v, tuple) else v


def _grouped(flat: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` configs with the flat fields applied (``dataclasses.replace``)."""
    changes: dict[str, dict[str, Any]] = {}
    for old, v in flat.items():
        sub, new = _FLAT[old]
        changes.setdefault(sub, {})[new] = v
    out = dict(given)
    for sub, kw in changes.items():
        base = out.get(sub)
        out[sub] = dataclasses.replace(base if base is not None else _CONFIGS[sub](), **kw)
    return out


@dataclasses.dataclass(frozen=True)
class Policy(LegacyDict):
    """Alert thresholds and windows: one config per rule family (defaults: METRICS.md §5).

    Every window is in steps, so the same policy works at any host cadence; ``red_after``
    counts checks, as §5 does. The rule table is in docs/MONITOR.md, every field and its
    calibration in docs/MONITOR_POLICY.md. The old flat keywords (``Policy(spike_z=...)``)
    are still accepted, with a ``DeprecationWarning``.

    Args:
      baselines: when the baselines start and what the ratio rules judge against.
      ratio: the ratio, creep (trend) and jump rules.
      alerts: hysteresis, clearing, episodes and the monitor's bounded memory.
      system: non-finite figures, throughput, the loss scale.
      between: the rules on the steps between checks (early, skip, data).
      validation: the val-gap and val-rise rules.
      spike: spike anatomy, periodicity and scores.
      bands: the group, logits and router rules.
      health: the broken-model and divergence rules.
      localize: localization of the earliest sign.
      replica: the per-replica rule.
    """

    baselines: BaselineConfig = dataclasses.field(default_factory=BaselineConfig)
    ratio: RatioConfig = dataclasses.field(default_factory=RatioConfig)
    alerts: AlertConfig = dataclasses.field(default_factory=AlertConfig)
    system: SystemConfig = dataclasses.field(default_factory=SystemConfig)
    between: BetweenConfig = dataclasses.field(default_factory=BetweenConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    spike: SpikeConfig = dataclasses.field(default_factory=SpikeConfig)
    bands: BandConfig = dataclasses.field(default_factory=BandConfig)
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)
    localize: LocalizeConfig = dataclasses.field(default_factory=LocalizeConfig)
    replica: ReplicaConfig = dataclasses.field(default_factory=ReplicaConfig)

    def __post_init__(self) -> None:
        for sub, cls in _CONFIGS.items():
            v = getattr(self, sub)
            if not isinstance(v, cls):
                raise TypeError(f"Policy.{sub} expects a {cls.__name__}, got {type(v).__name__}")

    def __getattr__(self, name: str) -> Any:
        # Only called when the normal lookup fails: the old flat names.
        if name in _FLAT or name in _MOVED:
            sub, new = _FLAT.get(name) or _MOVED[name]
            warnings.warn(f"Policy.{name} is deprecated: read policy.{sub}.{new}", DeprecationWarning,
                          stacklevel=2)
            return getattr(object.__getattribute__(self, sub), new)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def state_dict(self) -> dict[str, Any]:
        """The flat JSON-serialisable dict checkpoints hold (:meth:`from_state_dict` inverts it)."""
        return {old: _plain(getattr(getattr(self, sub), new)) for old, (sub, new) in _FLAT.items()}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "Policy":
        """Builds a policy from :meth:`state_dict`'s flat dict (any subset of its fields).

        Raises:
          ValueError: on a field the flat dict never had.
        """
        unknown = sorted(set(d) - set(_FLAT))
        if unknown:
            raise ValueError(f"Policy.from_state_dict got unknown fields {unknown}; expected a subset of "
                             f"{sorted(_FLAT)}")
        return cls(**_grouped(d, {}))


_dataclass_init = Policy.__init__


@functools.wraps(_dataclass_init)
def _init(self: Policy, *args: Any, **kw: Any) -> None:
    """The dataclass's ``__init__``, also taking the old flat field names (deprecated)."""
    flat = {k: kw.pop(k) for k in list(kw) if k in _FLAT}
    unknown = sorted(set(kw) - set(_CONFIGS))
    if unknown:
        raise TypeError(f"Policy got unexpected keyword arguments {unknown}")
    if flat:
        warnings.warn("Policy's flat fields are deprecated: " + ", ".join(
            f"{k} -> {_new_place(k)}" for k in flat), DeprecationWarning, stacklevel=2)
        kw = _grouped(flat, {**dict(zip(_CONFIGS, args)), **kw})
        args = ()
    _dataclass_init(self, *args, **kw)


Policy.__init__ = _init  # type: ignore[method-assign]
