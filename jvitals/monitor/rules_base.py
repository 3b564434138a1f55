"""What the monitor's rules read and return: :class:`Figures`, :class:`Plan`, the
:class:`Rule` protocol, and the threshold helpers the ratio-like rules share.

Imports only the policy and the types, so every rule module can import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from jvitals.monitor.codec import NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.types import Alert, Change, Level, Spike

__all__ = ["Figures", "NOTE_WRITERS", "Notes", "Plan", "Rule", "hysteresis_level", "level_of", "no_why",
           "schedule_factor"]


# --------------------------------------------------------------------------
# What rules read and return.
# --------------------------------------------------------------------------


class Plan:
    """Where each name sits in one key set (cached per key set).

    ``vals`` of a check is a list of Python floats in ``keys`` order.
    """

    __slots__ = ("keys", "named", "pos", "cols", "cache")

    def __init__(self, keys: tuple, named: dict[str, int], pos: np.ndarray, cols: np.ndarray):
        self.keys, self.named, self.pos, self.cols = keys, named, pos, cols
        self.cache: dict[str, Any] = {}  # per-rule data derived from the key set


@dataclasses.dataclass(slots=True)
class Notes:
    """What earlier rules published this check, one typed field each.

    A rule that reads a note must run after the rule that writes it
    (:data:`NOTE_WRITERS`); ``default_rules`` asserts that order. Before the writer
    ran (or when it has nothing to say) a field holds its default.

    Attributes:
      window_peaks: ``{metric: (step, value)}``, the window's maximum where it is a
        spike between the checks (``window_spikes``; read by ``spike``).
      data: the data rule holds this check (``data``; read by ``spike``).
      loss_trend: the loss EMA trend (``spike``; read by ``val_gap``, ``val_rise``).
      loss_pre: the loss's pre-spike trend while a loss spike is open or
        pending (``spike``; read by ``broken_model``).
      schedule: ``{metric: factor}`` the schedule predicts (``ratio``; read by ``trend``).
      ratio: ``{metric: latest x / reference}`` (``ratio``; read by ``group``).
      orange_run: ``{metric: (checks, first step)}`` of a confirmed ORANGE run
        (``ratio``; read by ``divergence``).
      extra: free for user rules (``{name: value}``).
    """

    window_peaks: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    data: bool = False
    loss_trend: float = NAN
    loss_pre: float = NAN
    schedule: dict[str, float] = dataclasses.field(default_factory=dict)
    ratio: dict[str, float] = dataclasses.field(default_factory=dict)
    orange_run: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


NOTE_WRITERS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "window_peaks": ("window_spikes", ("spike",)),
    "data": ("data", ("spike",)),
    "loss_trend": ("spike", ("val_gap", "val_rise")),
    "loss_pre": ("spike", ("broken_model",)),
    "schedule": ("ratio", ("trend",)),
    "ratio": ("ratio", ("group",)),
    "orange_run": ("ratio", ("divergence",)),
}
"""``{note: (writer rule, reader rules)}``: each reader runs after the writer."""


class Figures:
    """One check's figures as the rules see them.

    Attributes:
      step: the caller's step ``s``.
      t: model time (``s`` minus the steps abandoned by rollbacks).
      start: model time at which the baselines started (``None`` before).
      warm: ``start is None or t < start``.
      plan: the key set's :class:`Plan` (``plan.keys``, ``plan.cache`` for a
        rule's own per-key-set data).
      vals: the values as Python floats, in ``plan.keys`` order.
      get: ``get(name)``, the value of ``name`` at this check (``None`` when not
        logged).
      open: the open alerts, ``{(rule, key): Alert}`` (read only).
      notes: what earlier rules published this check (:class:`Notes`).
      diverging: ``[(key, alert)]`` of this check's divergent alerts.
      touched: the ``(rule, key)`` pairs some change named this check.
      scores: floats to log, filled by the rules.
      spikes: spikes completed this check (the monitor keeps them).
      policy: the :class:`Policy`.
    """

    __slots__ = ("step", "t", "start", "warm", "plan", "vals", "open", "notes", "diverging",
                 "touched", "scores", "spikes", "policy", "get")

    def __init__(self, step: int, t: int, start: int | None, plan: Plan, vals: list[float],
                 open_: Mapping[tuple[str, str], Alert], policy: Policy) -> None:
        # ``get(name)``: the value of ``name`` at this check (``None`` when not logged).
        self.get = dict(zip(plan.keys, vals)).get
        self.step, self.t, self.start = step, t, start
        self.warm = start is None or t < start
        self.plan, self.vals, self.open, self.policy = plan, vals, open_, policy
        self.notes = Notes()
        self.diverging: list[tuple[tuple[str, str], Alert]] = []
        self.touched: set[tuple[str, str]] = set()
        self.scores: dict[str, float] = {}
        self.spikes: list[Spike] = []

    def active(self, rule: str, key: str) -> Alert | None:
        """The open alert ``(rule, key)`` of the current episode: ``None`` when there is
        none or when its condition has been clear for ``Policy.alerts.episode_gap`` steps or
        more (it only waits out ``Policy.alerts.clear_steps``). A rule treats such an alert as
        closed: a new crossing needs its own confirmation and is a new episode with
        its own onset (``Monitor`` closes the old alert when the rule sets it again);
        within the gap the alert's hysteresis still holds it (a dip is noise)."""
        a = self.open.get((rule, key))
        if a is None or (a.clearing_since is not None
                         and self.step - a.clearing_since >= self.policy.alerts.episode_gap):
            return None
        return a


@runtime_checkable
class Rule(Protocol):
    """What the monitor needs of a rule (the others are optional)."""

    name: str

    def check(self, f: Figures) -> list[Change]:
        ...


def level_of(ratio: float, y: float, o: float | None) -> Level:
    if o is not None and ratio > o:
        return Level.ORANGE
    if ratio > y:
        return Level.YELLOW
    return Level.GREEN


def hysteresis_level(ratio: float, y: float, o: float | None, cur: Level, gate: bool,
                      h: float) -> Level:
    """Level of a ratio rule: opens/escalates on the thresholds (and the
    gate), steps down only below ``1 + h * (threshold - 1)``."""
    raw = level_of(ratio, y, o) if gate else Level.GREEN
    if raw >= cur:
        return raw
    held = level_of(ratio, 1.0 + h * (y - 1.0), None if o is None else 1.0 + h * (o - 1.0))
    return max(raw, min(cur, held))


def schedule_factor(lr: float | None, lr_ref: float | None, pn: float | None,
                    pn_ref: float | None, p: Policy) -> tuple[float, str]:
    """What the schedule predicts for the gradient norm, relative to its baseline.

    ``(lr_ref / lr) ** lr_exponent`` (the LR decayed from its baseline level
    ``lr_ref``; capped at 100x, i.e. 10x for the default exponent): for weights
    under normalization with decoupled weight decay the steady state is ``||g|| /
    ||w|| ~ sqrt(2 lambda / lr)`` (Defazio 2025, arXiv 2506.02285), so a cosine to
    0.1x raises a healthy grad norm ~3x; off with ``weight_decay=0``. And
    ``pn_ref / pn`` (the param norm shrank: gradients of scale-invariant weights
    scale as ``1 / ||w||``). The larger of the two, never below 1.

    Returns:
      ``(factor, why)``: ``why`` (a callable: formatted only for a message) says which
      term and its figures ("" for a factor of 1).
    """
    sched = pnf = 1.0
    if lr is not None and lr_ref is not None and lr > 0 and lr_ref > 0 and p.ratio.weight_decay != 0 \
            and p.ratio.lr_exponent > 0:
        sched = min(max(lr_ref / lr, 1.0), 100.0) ** p.ratio.lr_exponent
    if pn is not None and pn_ref is not None and pn > 0 and pn_ref > 0:
        pnf = max(pn_ref / pn, 1.0)
    if sched <= 1.0 and pnf <= 1.0:
        return 1.0, no_why
    if sched >= pnf:
        return sched, lambda: (f"(lr at baseline {lr_ref:.3g} / lr now {lr:.3g}) ** "
                               f"{p.ratio.lr_exponent:g}, Policy.lr_exponent")
    return pnf, lambda: f"param norm at baseline {pn_ref:.4g} / now {pn:.4g}"


def no_why() -> str:
    return ""
