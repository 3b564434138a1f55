"""The default rule list, in the order ``Monitor.update`` runs it, and the check of that order.

A rule reads one check's :class:`~jvitals.monitor.rules_base.Figures` and returns the alert
changes it makes; a later rule sees what an earlier one published in ``Figures.notes``, so
the order matters (:func:`check_order` asserts it). The rule classes live in the
``rules_<topic>`` modules: ``rules_window`` (the steps between checks), ``rules_ratio``,
``rules_bands``, ``rules_scale``, ``rules_health``, ``rules_validation`` and
``rules_replicas``; ``rules_base`` holds what they share. The rules, their order, alert ids
and levels: the table in docs/MONITOR.md (checked against :func:`default_rules` by
tests/test_monitor_docs.py).
"""

from __future__ import annotations

from typing import Any

from jvitals.monitor.policy import Policy
from jvitals.monitor.rules_bands import GroupRule, LogitRule, RouterRule
from jvitals.monitor.rules_base import NOTE_WRITERS
from jvitals.monitor.rules_health import BrokenModelRule, DivergenceRule, LossScaleRule, SpikeRule
from jvitals.monitor.rules_ratio import JumpRule, RatioRule, TrendRule
from jvitals.monitor.rules_replicas import ReplicaRule
from jvitals.monitor.rules_scale import AttnLogitRule, OutputLogitRule, UpdateSizeRule
from jvitals.monitor.rules_validation import GapRule, ValRiseRule
from jvitals.monitor.rules_window import (
    DataRule,
    EarlyRule,
    NonFiniteRule,
    RepeatRule,
    SkipRule,
    ThroughputRule,
    WindowSpikes,
)

__all__ = ["check_order", "default_rules"]


def check_order(rules: list[Any]) -> None:
    """Raises ``ValueError`` when a rule that reads a :class:`Notes` field runs before the
    rule that writes it (:data:`NOTE_WRITERS`; rules not in the list are not checked)."""
    pos = {getattr(r, "name", None): i for i, r in enumerate(rules)}
    for note, (writer, readers) in NOTE_WRITERS.items():
        for reader in readers:
            if writer in pos and reader in pos and pos[reader] < pos[writer]:
                raise ValueError(f"rule {reader!r} reads Figures.notes.{note}, written by {writer!r}: "
                                 f"it must run after it")


def default_rules(policy: Policy) -> list[Any]:
    """The default rule list, in the order ``Monitor.update`` runs it.

    The order matters where a rule reads a note another publishes (:data:`NOTE_WRITERS`:
    ``window_spikes`` and ``data`` before ``spike``; ``spike`` before ``val_gap``,
    ``val_rise`` and ``broken_model``; ``ratio`` before ``trend``, ``group`` and
    ``divergence``), and the divergence rule sees the divergent alerts of the rules before
    it. The table: docs/MONITOR.md.
    """
    rules = [NonFiniteRule(policy), EarlyRule(policy), RepeatRule(policy), DataRule(policy), WindowSpikes(policy),
             SpikeRule(policy),
             RatioRule(policy),
             TrendRule(policy), JumpRule(policy), GroupRule(policy), LogitRule(policy), AttnLogitRule(policy),
             OutputLogitRule(policy), UpdateSizeRule(policy), RouterRule(policy),
             ThroughputRule(policy), SkipRule(policy), LossScaleRule(policy), GapRule(policy), ValRiseRule(policy),
             BrokenModelRule(policy), DivergenceRule(policy), ReplicaRule(policy)]
    check_order(rules)
    return rules
