"""The monitor's policy: the composition of one small config per rule family.

``Policy()`` gives METRICS.md §5's defaults. Each family's thresholds live in its own
frozen config (:mod:`jvitals.monitor.config`): ``Policy(spike=SpikeConfig(z=5.0))``.
:meth:`Policy.state_dict` writes the flat dict checkpoints hold (one key per field, named
by :mod:`jvitals.monitor.flat_names`) and :meth:`Policy.from_state_dict` reads it.
docs/MONITOR_POLICY.md has every field and the calibration behind it.

Imports nothing from the other monitor modules but the configs and the flat names: the
rules and trackers read a :class:`Policy`, it never reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jvitals.monitor.config import (
    AlertConfig,
    BandConfig,
    BaselineConfig,
    BetweenConfig,
    HealthConfig,
    LocalizeConfig,
    RatioConfig,
    ReplicaConfig,
    ScaleConfig,
    SpikeConfig,
    SystemConfig,
    ValidationConfig,
)
from jvitals.monitor.flat_names import FLAT as _FLAT

__all__ = ["Policy"]

_CONFIGS: Mapping[str, type] = {
    "baselines": BaselineConfig, "ratio": RatioConfig, "alerts": AlertConfig, "system": SystemConfig,
    "between": BetweenConfig, "validation": ValidationConfig, "spike": SpikeConfig, "bands": BandConfig,
    "health": HealthConfig, "localize": LocalizeConfig, "replica": ReplicaConfig, "scale": ScaleConfig,
}


def _unknown_keyword(key: str) -> str:
    """The error for a keyword ``Policy`` does not take; a flat dict key names its config field."""
    if key in _FLAT:
        sub, new = _FLAT[key]
        return (f"Policy got unknown keyword {key!r}: it lives in Policy({sub}={_CONFIGS[sub].__name__}({new}=...)) "
                f"(read as policy.{sub}.{new})")
    return f"Policy got unknown keyword {key!r}; its keywords are the configs {list(_CONFIGS)}"


def _plain(v: Any) -> Any:
    """A config value in the flat dict's JSON form (mappings -> dicts, tuples -> lists)."""
    if isinstance(v, Mapping):
        return {k: list(x) if isinstance(x, tuple) else x for k, x in v.items()}
    return list(v) if isinstance(v, tuple) else v


@dataclasses.dataclass(frozen=True)
class Policy:
    """Alert thresholds and windows: one config per rule family (defaults: METRICS.md §5).

    Every window is in steps, so the same policy works at any host cadence; ``red_after``
    counts checks, as §5 does. The rule table is in docs/MONITOR.md, every field and its
    calibration in docs/MONITOR_POLICY.md. A keyword other than the configs' names (the
    flat dict's ``spike_z``, say) raises a ``TypeError`` naming the config field it is.

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
      scale: figures whose scale means something on their own (the attention logits).
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
    scale: ScaleConfig = dataclasses.field(default_factory=ScaleConfig)

    def __new__(cls, *args: Any, **kw: Any) -> "Policy":
        # Runs before the dataclass's __init__: an unknown keyword gets an error naming its place.
        for key in kw:
            if key not in _CONFIGS:
                raise TypeError(_unknown_keyword(key))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for sub, cls in _CONFIGS.items():
            v = getattr(self, sub)
            if not isinstance(v, cls):
                raise TypeError(f"Policy.{sub} expects a {cls.__name__}, got {type(v).__name__}")

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
        kw: dict[str, dict[str, Any]] = {}
        for key, v in d.items():
            sub, new = _FLAT[key]
            kw.setdefault(sub, {})[new] = v
        return cls(**{sub: _CONFIGS[sub](**fields) for sub, fields in kw.items()})
