"""The monitor's rules: one small class per condition.

A rule reads one check's :class:`Figures` and returns the alert
:class:`Change` s it makes (open/update at a level, release, close). Its
parameters come from the :class:`~jvitals.monitor.policy.Policy`; its state
has ``state_dict`` / ``load_state_dict`` (plain JSON). ``Monitor.update``
runs the rules in order and applies each one's changes before the next
runs, so a later rule sees what an earlier one published in
``Figures.notes`` (the loss trend, the global ratios) and the divergence
rule, last, sees the check's divergent alerts.

A user rule is any object with a ``name`` (unique) and ``check(figures) ->
list[Change]``; ``state_dict``/``load_state_dict``/``rollback`` are optional.

Rule table (every number a Policy field)::

    class               rule id          level    condition
    NonFiniteRule       nonfinite        ORANGE   loss / grad norm non-finite, nonfinite count > 0,
      (between.py)                                a non-finite step in the window since the last check
    SpikeRule           loss_spike       YELLOW   a loss spike not back in its band after 300 steps
                        periodic_spike   YELLOW/  >= 3 loss spikes at near-regular intervals
                                         ORANGE   (intervals shrinking)
    RatioRule           grad_norm,       YELLOW,  x / (reference x the schedule's factor) > 2, > 3,
                        ratio            ORANGE   confirmed over 3 checks; the reference follows the
                                                  run's own slow drift (DriftBaseline)
    TrendRule           grad_trend,      YELLOW   a rise over 1000 (4000) steps beyond 1.3x (1.5x)
                        param_norm                and 3x the run's own (grad norm: net of the
                                                  schedule, while the loss falls)
    JumpRule            jump             YELLOW   update/param_ratio per unit LR x5 in one check
    GroupRule           group            YELLOW   a group figure jumped x5, stepped beyond its band,
                                                  or drifted beyond 3x its own drift, while the
                                                  global figures did not move
    LogitRule           logits           YELLOW   attention / output logits rising beyond their drift
    RouterRule          router           YELLOW   moe/maxvio.max (+0.5) or moe/dead_expert_ratio
                                                  (+0.2) above its baseline for 50 steps
    ThroughputRule      throughput       YELLOW   tokens/s (else steps/s) down beyond the run's own
      (between.py)                                band (>= 20%, 5 sd of its noise) for 40 steps
    SkipRule, EarlyRule, skip, early,    see   an update skipped in the step; a jump before the
    DataRule (between)  data             between.py  baselines are armed; the loss rising with the
                                                  optimizer calm (the data)
    LossScaleRule       loss_scale       YELLOW   loss scale falls >= 2**4 between two checks or
                                                  from its recent peak
    GapRule             val_gap          YELLOW   gap growth > 1.5x the growth before, above the
                                                  noise (4 sd), 5% of the loss and its earlier high
    ValRiseRule         val_rise         YELLOW   val loss rising (Mann-Kendall z > 3, Theil-Sen rise
                                                  >= 2% over 500 steps) while the loss trend falls
    BrokenModelRule     broken_model     YELLOW,  loss at chance level (log vocab) or param norm
                                         ORANGE,  1.5x its value 100 steps before; RED when not
                                         RED      recovered after 50 (param) / 100 (loss) steps
    DivergenceRule      divergence       RED      red_after consecutive checks with an ORANGE
                                                  condition (or the loss > 1.25x its pre-spike trend
                                                  after the pathological window)
    ReplicaRule         replica          YELLOW,  one replica's figure a robust outlier (median/MAD
      (monitor/replicas.py)              ORANGE   across replicas) on consecutive checks; one
                                                  replica non-finite while the others are finite
"""

from __future__ import annotations

from typing import Any

from jvitals.monitor.between import (DataRule, EarlyRule, NonFiniteRule, SkipRule, ThroughputRule, WindowSpikes)
from jvitals.monitor.policy import Policy
from jvitals.monitor.replicas import ReplicaRule
from jvitals.monitor.rules_bands import GroupRule, LogitRule, RouterRule
from jvitals.monitor.rules_base import NOTE_WRITERS, Figures, Notes, Plan, Rule, schedule_factor  # noqa: F401  (Plan, schedule_factor: re-exported)
from jvitals.monitor.rules_health import BrokenModelRule, DivergenceRule, LossScaleRule, SpikeRule
from jvitals.monitor.rules_ratio import JumpRule, RatioRule, TrendRule
from jvitals.monitor.rules_validation import GapRule, ValRiseRule
from jvitals.monitor.types import Change, set_  # noqa: F401  (set_: re-exported)

__all__ = [
    "BrokenModelRule",
    "Change",
    "DataRule",
    "DivergenceRule",
    "EarlyRule",
    "Figures",
    "GapRule",
    "GroupRule",
    "JumpRule",
    "LogitRule",
    "LossScaleRule",
    "NonFiniteRule",
    "RatioRule",
    "RouterRule",
    "Rule",
    "SkipRule",
    "SpikeRule",
    "ThroughputRule",
    "TrendRule",
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
    rules = [NonFiniteRule(policy), EarlyRule(policy), DataRule(policy), WindowSpikes(policy), SpikeRule(policy),
             RatioRule(policy),
             TrendRule(policy), JumpRule(policy), GroupRule(policy), LogitRule(policy), RouterRule(policy),
             ThroughputRule(policy), SkipRule(policy), LossScaleRule(policy), GapRule(policy), ValRiseRule(policy),
             BrokenModelRule(policy), DivergenceRule(policy), ReplicaRule(policy)]
    check_order(rules)
    return rules
