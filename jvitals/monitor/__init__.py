"""The host side's judgement: a ``Monitor`` made of rules, turning figures into verdicts.

Plain Python and NumPy, no JAX: ``types`` (``Level``, ``Alert``, ``Verdict``, the
prescriptions), ``config`` (one small config per rule family) and ``policy`` (their
composition), ``robust`` and the ``trackers_<topic>`` modules (baselines, bands, spikes,
the per-layer history), the ``rules_<topic>`` modules (one small class per rule: window,
ratio, bands, scale, health, validation, replicas; ``rules_base`` what they share,
``rules`` the default list), ``localize`` (the earliest sign) and ``monitor`` (runs the
rules, builds the verdict). A verdict never acts by itself. The rule table and the
modules' long explanations: docs/MONITOR.md.
"""

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
from jvitals.monitor.coverage import Coverage
from jvitals.monitor.monitor import Monitor
from jvitals.monitor.policy import Policy
from jvitals.monitor.rules import default_rules
from jvitals.monitor.rules_bands import GroupRule, LogitRule, RouterRule
from jvitals.monitor.rules_base import Figures, Notes, Rule
from jvitals.monitor.rules_health import BrokenModelRule, DivergenceRule, LossScaleRule, SpikeRule
from jvitals.monitor.rules_ratio import JumpRule, RatioRule, TrendRule
from jvitals.monitor.rules_replicas import ReplicaRule, flat_replicas
from jvitals.monitor.rules_scale import AttnLogitRule, OutputLogitRule, UpdateSizeRule
from jvitals.monitor.rules_validation import GapRule, ValRiseRule
from jvitals.monitor.rules_window import NonFiniteRule, ThroughputRule
from jvitals.monitor.types import (
    PRESCRIPTIONS,
    RULE_PRESCRIPTION,
    Alert,
    Change,
    Level,
    Localization,
    Prescription,
    Spike,
    Verdict,
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
