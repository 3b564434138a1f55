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
from jvitals.monitor.flat_names import FLAT as _FLAT
from jvitals.monitor.config import (
    BASELINE_KINDS,
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

__all__ = ["BASELINE_KINDS", "Policy"]

# The old Policy properties -> (config, property).
_MOVED: Mapping[str, tuple[str, str]] = {"settle_span": ("baselines", "settle_span"),
                                         "settle_cap": ("baselines", "settle_cap")}

_CONFIGS: Mapping[str, type] = {
    "baselines": BaselineConfig, "ratio": RatioConfig, "alerts": AlertConfig, "system": SystemConfig,
    "between": BetweenConfig, "validation": ValidationConfig, "spike": SpikeConfig, "bands": BandConfig,
    "health": HealthConfig, "localize": LocalizeConfig, "replica": ReplicaConfig, "scale": ScaleConfig,
}


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
