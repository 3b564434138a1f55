"""The rollback target: which checkpoint a red verdict restores, as a pure function.

:func:`choose_target` takes the alerts the guard has seen (:class:`AlertRecord`, kept
by :class:`jvitals.guard.alertlog.AlertLog`) and the checkpoints on disk
(:class:`CheckpointInfo`) and returns a :class:`Target`: the fault's earliest sign,
the step a target must be older than, and the checkpoints to try in order. It reads
no file and imports neither orbax nor JAX, so a test calls it with hand-built
histories. Its three steps, :func:`earliest_sign`, :func:`cutoff_before` and
:func:`pick_target` (on several processes the guard agrees on process 0's sign and
cutoff between the second and the third), and the pins (:func:`pins`) are in
docs/GUARD.md, "Decisions".
"""


from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Collection, Iterable, Mapping, NamedTuple, Sequence

from jvitals.monitor.types import Level

__all__ = [
    "AlertRecord",
    "CheckpointInfo",
    "Past",
    "RestorePolicy",
    "Target",
    "choose_target",
    "cutoff_before",
    "chain",
    "earliest_sign",
    "is_healthy",
    "level_name",
    "newest_first",
    "no_target_message",
    "pick_target",
    "pins",
    "relapse",
    "restore_order",
    "sick_after",
    "why_not",
]

HEALTHY_LEVELS = frozenset((int(Level.GREEN), int(Level.YELLOW)))


def fail(config: str, field: str, expected: str, got: Any) -> None:
    """Raises the ValueError of a config's field out of range (it names both)."""
    raise ValueError(f"{config} expects {field} {expected}, got {got!r}")


@dataclasses.dataclass(frozen=True)
class RestorePolicy:
    """Which checkpoint a rollback (or a resume) restores.

    Attributes:
      healthy_levels: saved levels a rollback may restore (stored as a frozenset of ints).
      check_finite: reject targets holding non-finite values (quarantined, the next tried).
      onset_margin: the least margin in steps before the earliest sign (one host
        cadence, back to the last check before it, is used when larger).
      rewind_steps: restore a checkpoint at least this many steps before the
        earliest sign (the guide: "roll back 10-100 steps before the spike";
        None: the newest healthy one).
    """

    healthy_levels: frozenset[int] = frozenset((int(Level.GREEN), int(Level.YELLOW)))
    check_finite: bool = True
    onset_margin: int = 1
    rewind_steps: int | None = None

    def __post_init__(self) -> None:
        levels = self.healthy_levels
        if isinstance(levels, (int, str)) or not isinstance(levels, collections.abc.Iterable):
            fail("RestorePolicy", "healthy_levels", "an iterable of levels", levels)
        bad = [x for x in levels if isinstance(x, (str, bool, float)) or int(x) not in {int(v) for v in Level}]
        if bad:
            fail("RestorePolicy", "healthy_levels", "Levels, e.g. {Level.GREEN, Level.YELLOW}", bad[0])
        object.__setattr__(self, "healthy_levels", frozenset(int(x) for x in levels))
        if int(self.onset_margin) < 0:
            fail("RestorePolicy", "onset_margin", ">= 0", self.onset_margin)
        if self.rewind_steps is not None and int(self.rewind_steps) < 0:
            fail("RestorePolicy", "rewind_steps", ">= 0 or None", self.rewind_steps)


class Past(NamedTuple):
    """What the guard has seen before a red (the inputs of the cutoff and of a relapse).

    Attributes:
      checks: the guard's check steps so far (this one included).
      calm: the last check with no open alert that had reached ORANGE.
      history: the previous rollbacks (dicts with ``step``, ``to_step``, ``source_step``).
      last_healthy_check: the guard's last check at a healthy level.
    """

    checks: Iterable[int] = ()
    calm: int | None = None
    history: Sequence[Mapping[str, Any]] = ()
    last_healthy_check: int | None = None


@dataclasses.dataclass
class CheckpointInfo:
    """What the store knows about one checkpoint on disk.

    Attributes:
      step: the checkpoint's step number.
      level: the verdict level when it was saved (-1: unknown, unreadable).
      kind: ``'cadence'``, ``'orange'``, ``'rollback'``, ``'manual'`` or ``'snapshot'``.
      lr_scale: the LR scale saved with it.
      restored_from: for a ``'rollback'`` checkpoint, the step whose params it holds.
      quarantined: why it must never be restored (None: usable).
      open_peak: the highest peak level of the alerts open when it was saved.
      store: the name of the store holding it (``'checkpoints'``, ``'snapshots'``).
    """

    step: int
    level: int
    kind: str
    lr_scale: float = 1.0
    restored_from: int | None = None
    quarantined: str | None = None
    open_peak: int = 0
    store: str = "checkpoints"


@dataclasses.dataclass
class AlertRecord:
    """One monitor alert (one id) as the guard saw it across its checks.

    Attributes:
      id: the monitor's alert id.
      rule: the rule that raised it (``'loss_spike'``, ``'update_ratio'``, ...).
      onset: its onset step (the first step of the condition).
      departures: the change points of its localization (``departure_step``).
      peak: the highest level it reached (an ``int`` of :class:`Level`).
      first_check: the guard's check at which it was first seen.
      revived: the check at which it held again after the guard saw it clearing.
      clearing: it was clearing (``clearing_since`` set) at the latest check.
      closed: the check at which it was seen closed (None: open).
      lead: the id of the alert it names as its lead (``details['lead_alert']``).
    """

    id: int
    rule: str
    onset: int
    departures: tuple[int, ...] = ()
    peak: int = int(Level.YELLOW)
    first_check: int = 0
    revived: int | None = None
    clearing: bool = False
    closed: int | None = None
    lead: int | None = None

    def sign(self) -> int:
        """The alert's earliest sign: its onset or a change point of its localization,
        not before the check at which it held again (a revived alert counts from there)."""
        e = min((self.onset, *self.departures))
        return e if self.revived is None else max(e, self.revived)


@dataclasses.dataclass(frozen=True)
class Target:
    """What :func:`pick_target` chose.

    Attributes:
      sign: the fault's earliest sign.
      cutoff: a target's step is below this.
      not_after: a target's step is at most this (``rewind_steps``; None: no bound).
      candidates: the checkpoints to try, in order: the healthy ones below the bounds,
        newest first, then the relapse suspects (quarantined, reason ``relapse``).
      suspects: the checkpoints a relapse makes suspect (to quarantine, newest first).
      relapse_reason: why they are suspect (None: no relapse).
    """

    sign: int
    cutoff: int
    not_after: int | None = None
    candidates: tuple[CheckpointInfo, ...] = ()
    suspects: tuple[CheckpointInfo, ...] = ()
    relapse_reason: str | None = None

    @property
    def step(self) -> int | None:
        """The first candidate's step (the target if it restores); None: nothing to restore."""
        return self.candidates[0].step if self.candidates else None

    def bound(self) -> str:
        """The bound in words: ``'step C'`` or ``'step C and at most step N'``."""
        return f"step {self.cutoff}" + (f" and at most step {self.not_after}"
                                        if self.not_after is not None else "")


# ----------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------


def level_name(level: int) -> str:
    """``'GREEN'``... for a level, ``'UNKNOWN'`` for anything else (-1: unreadable)."""
    try:
        return Level(level).name
    except ValueError:
        return "UNKNOWN"


def is_healthy(rec: CheckpointInfo, healthy_levels: Collection[int] = HEALTHY_LEVELS, *,
               allow_suspect: bool = False) -> bool:
    """Saved at a healthy level, with no open ORANGE/RED alert, and not quarantined
    (``allow_suspect``: a relapse suspect, quarantined with reason ``relapse...``, counts)."""
    usable = rec.quarantined is None or (allow_suspect and rec.quarantined.startswith("relapse"))
    return usable and rec.level in healthy_levels and rec.open_peak < Level.ORANGE


def why_not(rec: CheckpointInfo, healthy_levels: Collection[int] = HEALTHY_LEVELS) -> str:
    """Why ``rec`` is not restored, in words (``'not needed'`` for a healthy one)."""
    if rec.quarantined:
        return f"quarantined: {rec.quarantined}"
    if rec.level not in healthy_levels:
        return f"saved at {level_name(rec.level)}"
    if rec.open_peak >= Level.ORANGE:
        return f"saved during an open {level_name(rec.open_peak)} alert"
    return "not needed"


def newest_first(checkpoints: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    """Newest first; at one step, a checkpoint before a snapshot."""
    return sorted(checkpoints, key=lambda r: (-r.step, r.store != "checkpoints"))


def restore_order(checkpoints: Iterable[CheckpointInfo], *,
                  healthy_levels: Collection[int] = HEALTHY_LEVELS, before: int | None = None,
                  not_after: int | None = None) -> list[CheckpointInfo]:
    """The checkpoints to try restoring, in order: the healthy ones (``step < before``,
    ``step <= not_after``) newest first, then the relapse suspects newest first (used
    only when no healthy one restores)."""
    inside = [r for r in newest_first(checkpoints)
              if (before is None or r.step < before) and (not_after is None or r.step <= not_after)]
    healthy = [r for r in inside if is_healthy(r, healthy_levels)]
    return healthy + [r for r in inside if r.quarantined is not None
                      and is_healthy(r, healthy_levels, allow_suspect=True)]


def sick_after(checkpoints: Iterable[CheckpointInfo], target: int, step: int) -> list[CheckpointInfo]:
    """The checkpoints saved after the target up to the red step, not yet quarantined
    (sick: the fault may be in them)."""
    return [r for r in newest_first(checkpoints) if target < r.step <= step and r.quarantined is None]


def disk_listing(checkpoints: Iterable[CheckpointInfo],
                 healthy_levels: Collection[int] = HEALTHY_LEVELS) -> str:
    """``'30:ORANGE (saved at ORANGE), 20:GREEN, ...'``, newest first (``'none'``)."""
    return ", ".join(f"{r.step}:{level_name(r.level)}" + (
        f" ({why_not(r, healthy_levels)})" if not is_healthy(r, healthy_levels) else "")
        for r in newest_first(checkpoints)) or "none"


def no_target_message(target: Target, checkpoints: Iterable[CheckpointInfo], *, step: int,
                      healthy_levels: Collection[int] = HEALTHY_LEVELS, where: str = "") -> str:
    """What a red without a restorable checkpoint says: the sign, the bound, what was
    expected, and every checkpoint on disk (newest first) with why it is not used."""
    levels = sorted(level_name(x) for x in healthy_levels)
    return (f"red at step {step} (earliest sign {target.sign}) but no healthy checkpoint "
            f"before {target.bound()}{where}; expected one saved at a level in {levels} with "
            f"no open ORANGE/RED alert that restores. On disk: "
            f"{disk_listing(checkpoints, healthy_levels)}.")


# ----------------------------------------------------------------------------
# The three steps.
# ----------------------------------------------------------------------------


def is_spike(rule: str) -> bool:
    """A spike alert (its onset is the spike's first step); periodic patterns are not."""
    return "spike" in rule and rule != "periodic_spike"


def _by_id(alerts: Iterable[AlertRecord] | Mapping[int, AlertRecord]) -> dict[int, AlertRecord]:
    return dict(alerts) if isinstance(alerts, Mapping) else {int(a.id): a for a in alerts}


def chain(alerts: Iterable[AlertRecord] | Mapping[int, AlertRecord], *, calm: int | None = None,
          remedied: Iterable[int] = ()) -> set[int]:
    """The ids of the alerts that escalated to the red.

    Args:
      alerts: every alert the guard has seen (open ones have ``closed`` None).
      calm: the last check with no open alert that had reached ORANGE (None: none).
      remedied: ids of the alerts whose remedy the guard applies at this red.

    Returns:
      The open alerts whose peak reached ORANGE or RED, the open spike alerts, the
      remedied ones, the ORANGE+ alerts that closed after ``calm``, and the alerts
      any of these name as their lead. An alert that closed without escalating is
      not in it (a closed noise YELLOW never moves the target).
    """
    seen = _by_id(alerts)
    ids = {i for i, r in seen.items() if r.closed is None and (r.peak >= Level.ORANGE or is_spike(r.rule))}
    ids |= {int(i) for i in remedied if int(i) in seen}
    after = calm if calm is not None else -1
    ids |= {i for i, r in seen.items() if r.peak >= Level.ORANGE and r.closed is not None and r.closed > after}
    for i in list(ids):
        lead = seen[i].lead
        if lead is not None and lead in seen:
            ids.add(lead)
    return ids


def earliest_sign(alerts: Iterable[AlertRecord] | Mapping[int, AlertRecord], *, step: int,
                  calm: int | None = None, remedied: Iterable[int] = (),
                  onset: int | None = None) -> int:
    """``E``: the earliest :meth:`AlertRecord.sign` of the :func:`chain`.

    Without a chain: ``onset`` (the verdict's onset step) if given, else ``step``.
    """
    seen = _by_id(alerts)
    signs = [seen[i].sign() for i in chain(seen, calm=calm, remedied=remedied)]
    if not signs and onset is not None:
        signs.append(int(onset))
    return min(signs) if signs else int(step)


def cutoff_before(sign: int, checks: Iterable[int], onset_margin: int = 1) -> int:
    """A target's step must be below this: one host cadence before the earliest sign.

    The metrics seen at a check may come from any update since the previous
    check, that check's own included (its effect shows from the next step), so
    the target must be older than the last check before ``sign``: with ``sign``
    at a check, the previous check; with ``sign`` between checks (a change
    point, or a monitor fed more often than the guard acts), the check before
    it. Without an earlier check: ``sign - onset_margin``. Also never above
    ``sign - onset_margin``.
    """
    before = [c for c in checks if c < sign]
    cutoff = sign - int(onset_margin)
    if before:
        cutoff = min(cutoff, max(before))
    return cutoff


def relapse(history: Sequence[Mapping[str, Any]], checkpoints: Iterable[CheckpointInfo], *,
            step: int, last_healthy_check: int | None) -> tuple[str | None, list[CheckpointInfo]]:
    """The relapse suspects: red again without a healthy check since the previous rollback.

    Returns:
      ``(reason, records)``: the previous rollback's target, and the checkpoints
      holding its params (restored from it or from its source), not yet quarantined;
      ``(None, [])`` when this red is not a relapse.
    """
    if not history or (last_healthy_check is not None and last_healthy_check > history[-1]["step"]):
        return None, []
    prev = history[-1]
    reason = (f"relapse: red again at step {step} without a healthy check since the "
              f"rollback at step {prev['step']} to step {prev['to_step']}")
    source = prev.get("source_step", prev["to_step"])
    return reason, [r for r in newest_first(checkpoints) if r.quarantined is None and (
        r.step == prev["to_step"] or r.restored_from in (prev["to_step"], source))]


def pick_target(checkpoints: Iterable[CheckpointInfo], *, sign: int, cutoff: int, step: int,
                healthy_levels: Collection[int] = HEALTHY_LEVELS, rewind_steps: int | None = None,
                history: Sequence[Mapping[str, Any]] = (),
                last_healthy_check: int | None = None) -> Target:
    """The checkpoints a red restores, in the order to try them (the third step).

    Args:
      checkpoints: every checkpoint and snapshot on disk (any order).
      sign: the fault's earliest sign (:func:`earliest_sign`).
      cutoff: a target's step is below this (:func:`cutoff_before`).
      step: the red check's step.
      healthy_levels: the levels a target may have been saved at.
      rewind_steps: a target's step is also at most ``sign - rewind_steps``.
      history: the previous rollbacks (dicts with ``step``, ``to_step``, ``source_step``).
      last_healthy_check: the guard's last check at a healthy level.

    Returns:
      A :class:`Target`: the relapse suspects (:func:`relapse`) count as quarantined,
      then the candidates are :func:`restore_order`'s below the bounds: the newest
      healthy checkpoint first, the suspects last.
    """
    not_after = None if rewind_steps is None else sign - int(rewind_steps)
    reason, suspects = relapse(history, checkpoints, step=step, last_healthy_check=last_healthy_check)
    marked = {(r.store, r.step) for r in suspects}
    view = [dataclasses.replace(r, quarantined=reason) if (r.store, r.step) in marked else r
            for r in checkpoints]
    order = restore_order(view, healthy_levels=healthy_levels, before=cutoff, not_after=not_after)
    return Target(int(sign), int(cutoff), not_after, tuple(order), tuple(suspects), reason)


def choose_target(alerts: Iterable[AlertRecord] | Mapping[int, AlertRecord],
                  checkpoints: Iterable[CheckpointInfo], *, step: int, past: Past = Past(),
                  remedied: Iterable[int] = (), onset: int | None = None,
                  policy: RestorePolicy = RestorePolicy()) -> Target:
    """The rollback target of a red at ``step``: newest healthy checkpoint before ``E - k``.

    ``E`` is :func:`earliest_sign` (the earliest onset or change point of the chain
    of alerts that escalated to the red), ``k`` one host cadence
    (:func:`cutoff_before`: the target is older than the last check before ``E``),
    and the target is the newest checkpoint that is healthy (:func:`is_healthy`:
    saved at a healthy level with no open ORANGE/RED alert, not quarantined, not a
    relapse suspect) with ``step < cutoff`` and ``step <= E - rewind_steps``; a
    relapse suspect is the last resort.

    Args:
      alerts: the alerts the guard has seen (:class:`AlertRecord`, open ones with
        ``closed`` None), or ``{id: record}``.
      checkpoints: the checkpoints and snapshots on disk (:class:`CheckpointInfo`).
      step: the red check's step.
      past: what the guard saw before (:class:`Past`: its checks, the last calm
        check, the previous rollbacks and its last healthy check).
      remedied: ids of the alerts whose remedy the guard applies (in the chain too).
      onset: the verdict's onset step, the sign when no alert is in the chain.
      policy: the :class:`RestorePolicy` (``onset_margin``, ``healthy_levels``,
        ``rewind_steps``; ``check_finite`` is the restore's, not used here).
    Returns:
      A :class:`Target` (``target.step`` is None when nothing qualifies: the guard
      raises :class:`jvitals.RollbackError` with :func:`no_target_message`).
    """
    sign = earliest_sign(alerts, step=step, calm=past.calm, remedied=remedied, onset=onset)
    cutoff = cutoff_before(sign, past.checks, policy.onset_margin)
    return pick_target(checkpoints, sign=sign, cutoff=cutoff, step=step, healthy_levels=policy.healthy_levels,
                       rewind_steps=policy.rewind_steps, history=past.history,
                       last_healthy_check=past.last_healthy_check)


def pins(history: Sequence[Mapping[str, Any]], checkpoints: Iterable[CheckpointInfo], *,
         open_alerts: Mapping[int, AlertRecord] | Iterable[AlertRecord] = (), checks: Sequence[int] = (),
         onset_margin: int = 1, healthy_levels: Collection[int] = HEALTHY_LEVELS,
         rewind_steps: int | None = None) -> dict[int, str]:
    """``{step: why}`` of the checkpoints retention must keep.

    The rollback targets (and the steps whose params they hold), the newest
    healthy checkpoint, with ``rewind_steps=N`` the healthy ones of the last ``N``
    steps and the newest before them, and for each open alert the newest healthy
    checkpoint a red from it would restore (below :func:`cutoff_before` its sign).
    """
    out: dict[int, str] = {}
    for h in history:
        out.setdefault(int(h["to_step"]), f"rollback target (restored at step {h['step']})")
        if h.get("source_step") is not None:
            out.setdefault(int(h["source_step"]), f"params of a rollback target (step {h['step']})")
    recs = [r for r in newest_first(checkpoints) if is_healthy(r, healthy_levels)]
    if recs:
        out.setdefault(recs[0].step, "newest healthy")
    if rewind_steps is not None and checks:
        now = max(checks)
        # Any later onset is >= now: keep the newest healthy checkpoint at least N
        # steps back, and the newer healthy ones that will take its place.
        reserve = [r for r in recs if r.step <= now - rewind_steps]
        floor = reserve[0].step if reserve else -1
        for r in recs:
            if r.step >= floor:
                out.setdefault(r.step, f"rewind_steps={rewind_steps} reserve (step {now})")
    for i, rec in sorted(_by_id(open_alerts).items()):
        sign = rec.sign()
        cut = cutoff_before(sign, checks, onset_margin)
        before = [r for r in recs if r.step < cut and (rewind_steps is None or r.step <= sign - rewind_steps)]
        if before:
            out.setdefault(before[0].step, f"newest healthy before the onset {sign} of open alert "
                                           f"#{i} ({rec.rule})")
    return out
