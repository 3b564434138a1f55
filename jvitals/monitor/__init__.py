"""The host side's judgement: a ``Monitor`` made of rules, turning figures into verdicts.

Plain Python and NumPy, no JAX: ``types`` (``Level``, ``Alert``, ``Verdict``, the
prescriptions), ``policy`` (every threshold), ``trackers`` (baselines, spikes, change
points), ``rules`` (one small class each), ``localize`` (the earliest sign) and
``monitor`` (runs the rules, builds the verdict); ``replicas`` (the per-replica figures'
host side and the rule that names a sick device or data shard). A verdict never acts by
itself.
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
from jvitals.monitor.policy import (
    BASELINE_KINDS,
    Policy,
)
from jvitals.monitor.rules import (
    BrokenModelRule,
    Change,
    default_rules,
    DivergenceRule,
    Figures,
    GapRule,
    GroupRule,
    JumpRule,
    LogitRule,
    LossScaleRule,
    NonFiniteRule,
    RatioRule,
    RouterRule,
    Rule,
    SpikeRule,
    ThroughputRule,
    TrendRule,
    ValRiseRule,
)
from jvitals.monitor.localize import (
    lead_phrase,
    localize,
    NO_EARLIER_SIGN,
)
from jvitals.monitor.monitor import (
    Monitor,
)
from jvitals.monitor.replicas import (
    flat_replicas,
    replica_summaries,
    replica_vectors,
    ReplicaRule,
    robust_z,
)

__all__ = [
    "Alert",
    "flat_replicas",
    "replica_summaries",
    "replica_vectors",
    "ReplicaRule",
    "robust_z",
    "BASELINE_KINDS",
    "BrokenModelRule",
    "Change",
    "default_rules",
    "DivergenceRule",
    "Figures",
    "GapRule",
    "GroupRule",
    "JumpRule",
    "lead_phrase",
    "LogitRule",
    "Level",
    "Localization",
    "localize",
    "LossScaleRule",
    "Monitor",
    "NO_EARLIER_SIGN",
    "NonFiniteRule",
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
    "ValRiseRule",
    "Verdict",
]
