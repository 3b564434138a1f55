"""The host side's judgement: a ``Monitor`` made of rules, turning figures into verdicts.

Plain Python and NumPy, no JAX: ``types`` (``Level``, ``Alert``, ``Verdict``, the
prescriptions), ``config`` (one small config per rule family) and ``policy`` (their
composition), ``robust`` / ``baselines`` / ``spikes`` / ``bands`` / ``history`` (the
trackers; ``trackers`` re-exports them), ``rules`` (one small class each, in
``rules_ratio``, ``rules_bands``, ``rules_health``, ``rules_validation`` and ``between``),
``localize`` (the earliest sign) and ``monitor`` (runs the rules, builds the verdict);
``replicas`` (the per-replica figures' host side and the rule that names a sick device or
data shard). A verdict never acts by itself. The rule table: docs/MONITOR.md.
"""

from jvitals.monitor.types import (
    Alert,
    Level,
    Localization,
    Prescription,
    PRESCRIPTIONS,
    RULE_PRESCRIPTION,
    Spike,
    Verdict,
)
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
from jvitals.monitor.policy import (
    BASELINE_KINDS,
    Policy,
)
from jvitals.monitor.rules import (
    AttnLogitRule,
    BrokenModelRule,
    Change,
    default_rules,
    DivergenceRule,
    Figures,
    GapRule,
    Notes,
    GroupRule,
    JumpRule,
    LogitRule,
    LossScaleRule,
    NonFiniteRule,
    OutputLogitRule,
    RatioRule,
    RouterRule,
    Rule,
    SpikeRule,
    ThroughputRule,
    TrendRule,
    UpdateSizeRule,
    ValRiseRule,
)
from jvitals.monitor.coverage import Coverage
from jvitals.monitor.monitor import (
    Monitor,
)
from jvitals.monitor.replicas import (
    flat_replicas,
    ReplicaRule,
)

__all__ = [
    "Alert",
    "AlertConfig",
    "BandConfig",
    "BaselineConfig",
    "BetweenConfig",
    "HealthConfig",
    "LocalizeConfig",
    "Notes",
    "RatioConfig",
    "ReplicaConfig",
    "ScaleConfig",
    "SpikeConfig",
    "SystemConfig",
    "ValidationConfig",
    "flat_replicas",
    "ReplicaRule",
    "BASELINE_KINDS",
    "AttnLogitRule",
    "BrokenModelRule",
    "Coverage",
    "Change",
    "default_rules",
    "DivergenceRule",
    "Figures",
    "GapRule",
    "GroupRule",
    "JumpRule",
    "LogitRule",
    "Level",
    "Localization",
    "LossScaleRule",
    "Monitor",
    "NonFiniteRule",
    "OutputLogitRule",
    "Policy",
    "Prescription",
    "PRESCRIPTIONS",
    "RatioRule",
    "RouterRule",
    "Rule",
    "RULE_PRESCRIPTION",
    "Spike",
    "SpikeRule",
    "ThroughputRule",
    "TrendRule",
    "UpdateSizeRule",
    "ValRiseRule",
    "Verdict",
]
