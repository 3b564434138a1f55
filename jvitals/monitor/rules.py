"""The monitor's rules: one small class per condition.

A rule reads one check's :class:`Figures` and returns the alert
:class:`Change` s it makes (open/update at a level, release, close). Its
parameters come from its config in the :class:`~jvitals.monitor.policy.Policy`; its state
has ``state_dict`` / ``load_state_dict`` (plain JSON). ``Monitor.update``
runs the rules in order and applies each one's changes before the next
runs, so a later rule sees what an earlier one published in
``Figures.notes`` (a typed :class:`Notes`: the loss trend, the global ratios) and the divergence
rule sees the divergent alerts of the rules before it.

A user rule is any object with a ``name`` (unique) and ``check(figures) ->
list[Change]``; ``state_dict``/``load_state_dict``/``rollback`` are optional.

The rules, their order, alert ids and levels: the table in docs/MONITOR.md (checked
against :func:`default_rules` by tests/test_monitor_docs.py). The rule classes live in
``rules_ratio`` (ratio, trend, jump), ``rules_bands`` (group, logits, router),
``rules_health`` (spike, loss scale, broken model, divergence), ``rules_scale`` (the
attention logits' absolute scale), ``rules_validation`` (val
gap, val rise), ``between`` (the window rules) and ``replicas``; this module re-exports them.
"""

from __future__ import annotations

from typing import Any

from jvitals.monitor.between import (DataRule, EarlyRule, NonFiniteRule, RepeatRule, SkipRule, ThroughputRule,
                                     WindowSpikes)
from jvitals.monitor.policy import Policy
from jvitals.monitor.replicas import ReplicaRule
from jvitals.monitor.rules_bands import GroupRule, LogitRule, RouterRule
from jvitals.monitor.rules_base import NOTE_WRITERS, Figures, Notes, Plan, Rule, schedule_factor  # noqa: F401  (Plan, schedule_factor: re-exported)
from jvitals.monitor.rules_health import BrokenModelRule, DivergenceRule, LossScaleRule, SpikeRule
from jvitals.monitor.rules_ratio import JumpRule, RatioRule, TrendRule
from jvitals.monitor.rules_scale import AttnLogitRule, OutputLogitRule, UpdateSizeRule
from jvitals.monitor.rules_validation import GapRule, ValRiseRule
from jvitals.monitor.types import Change, set_  # noqa: F401  (set_: re-exported)

__all__ = [
    "AttnLogitRule",
    "BrokenModelRule",
    "Change",
    "DataRule",
    "DivergenceRule",
    "EarlyRule",
    "Figures",
    "Notes",
    "GapRule",
    "GroupRule",
    "JumpRule",
    "LogitRule",
    "LossScaleRule",
    "NonFiniteRule",
    "OutputLogitRule",
    "RatioRule",
    "RepeatRule",
    "RouterRule",
    "Rule",
    "SkipRule",
    "SpikeRule",
    "ThroughputRule",
    "TrendRule",
    "UpdateSizeRule",
    "ValRiseRule",
    "WindowSpikes",
    "check_order",
    "default_rules",
]


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
