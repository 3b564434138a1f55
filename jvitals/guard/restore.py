"""The restoring part of :class:`jvitals.Rollback`: a rollback on red, and a resume.

:class:`Restorer` carries out what the guard decided (:mod:`jvitals.guard.rollback`)
when a checkpoint is read back, and returns what it found for the guard to apply:

- **a rollback** (:meth:`Restorer.restore_target`, on red): the target
  (:func:`jvitals.guard.target.pick_target`), its restore, the sick checkpoints
  quarantined, the steps after the restore (:mod:`jvitals.guard.after_restore`, then
  the remedies), or, past ``max_rollbacks``, :class:`RollbackLimitError`;
- **a resume** (:meth:`Restorer.resume`): the newest healthy checkpoint and the
  guard's record read back from its metadata;
- **the pins** (:meth:`Restorer.update_pins`): what retention never deletes, so
  the checkpoint a later red would restore is still on disk.
"""


from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from jvitals.monitor.types import Alert, Level
from jvitals.guard.after_restore import keep_step, parse_reset, reset_moments, scale_lr, skip_batches, step_text
from jvitals.guard.events import ROLLBACK_COUNT
from jvitals.guard.preemption import PREEMPT
from jvitals.guard.configs import Recovery, RestorePolicy
from jvitals.guard.remedies import applied_text, apply_remedies, parse_remedies, reapply_remedies
from jvitals.guard.response import (
    RollbackError,
    RollbackLimitError,
    alert_lines,
    jsonable,
    make_alert,
)
from jvitals.guard.state import GuardState, Outbox
from jvitals.guard.target import (
    CheckpointInfo,
    Target,
    is_healthy,
    level_name,
    no_target_message,
    pick_target,
    pins,
    restore_order,
    sick_after,
    why_not,
)
from jvitals.guard.verdict import VerdictLike

__all__ = ["Record", "Restored", "Restorer", "Resumed", "load_monitor", "resume_order"]

_log = logging.getLogger("jvitals.guard.rollback")


def resume_order(records: list[CheckpointInfo], healthy_levels: Iterable[int]) -> list[CheckpointInfo]:
    """What :meth:`Restorer.resume` tries, in order: a preemption checkpoint that is
    the newest on disk (the run's exact continuation: its guard and monitor state
    carry any open alert, so it is taken whatever its level), then
    :func:`jvitals.guard.target.restore_order` (the healthy ones, newest first)."""
    order = restore_order(records, healthy_levels=healthy_levels)
    newest = records[0] if records else None
    if newest is not None and newest.kind == PREEMPT and newest.quarantined is None:
        order = [newest] + [r for r in order if r is not newest]
    return order


def load_monitor(monitor: Any, d: Mapping[str, Any]) -> None:
    """Loads a monitor's saved state into ``monitor`` in place."""
    if hasattr(monitor, "load_state_dict"):
        monitor.load_state_dict(d)
        return
    fresh = type(monitor).from_state_dict(d)
    monitor.__dict__.update(fresh.__dict__)


class Record(NamedTuple):
    """The guard's record a restore reads (:class:`jvitals.Rollback`'s attributes).

    Attributes:
      lr_scale: the LR scale in force.
      history: the rollbacks so far (dicts).
      remedies: the remedies' flags (a plain JSON dict).
    """

    lr_scale: float
    history: Sequence[Mapping[str, Any]]
    remedies: Mapping[str, Any]


class Restored(NamedTuple):
    """What a rollback decided, for :class:`jvitals.Rollback` to apply.

    Attributes:
      state: the restored train state, after the steps that follow the restore.
      target: the checkpoint restored.
      lr_scale: the new LR scale.
      position: the data position to continue from.
      remedies: the new remedies' flags.
      entry: the rollback's history entry (``step``, ``to_step``, ``source_step``,
        ``onset_step``, ``cutoff``, ``lr_scale``, ``position``, ``recovery``, ``alerts``).
      alerts: the alerts raised on the way (corrupt candidates skipped).
    """

    state: Any
    target: CheckpointInfo
    lr_scale: float
    position: Any
    remedies: dict[str, Any]
    entry: dict[str, Any]
    alerts: list[Alert]


class Resumed(NamedTuple):
    """What a resume found: the checkpoint, its state and metadata (``target`` None:
    none restores), and the newer ones skipped, with why."""

    target: CheckpointInfo | None
    state: Any
    meta: Mapping[str, Any]
    skipped: list[str]


class Restorer:
    """The restores of :class:`jvitals.Rollback` (see module doc). It reads and writes
    the stores and the guard's bookkeeping (``state``, ``outbox``) it is given, and
    returns what it decided; the guard applies it.

    Args:
      disk: the guard's :class:`jvitals.guard.stores.Stores`.
      state: the guard's :class:`jvitals.guard.state.GuardState`.
      outbox: the guard's :class:`jvitals.guard.state.Outbox`.
      saver: the guard's :class:`jvitals.guard.saver.Saver` (its waits).
      policy: the :class:`jvitals.guard.configs.RestorePolicy`.
      recovery: the :class:`jvitals.guard.configs.Recovery`.
    """

    def __init__(self, disk: Any, state: GuardState, outbox: Outbox, saver: Any, policy: RestorePolicy,
                 recovery: Recovery) -> None:
        self.disk, self.state, self.outbox, self.saver = disk, state, outbox, saver
        self.policy, self.recovery = policy, recovery
        self.reset = parse_reset(recovery.reset_optimizer)
        self.remedy_table = parse_remedies(recovery.remedies)

    def resume(self, tree: Any) -> Resumed:
        """The newest healthy checkpoint restored onto ``tree`` (see :meth:`jvitals.Rollback.resume`)."""
        self.saver.settle()
        records = self.disk.records()
        found = self.restore_first(resume_order(records, self.policy.healthy_levels), tree)
        skipped = [f"{r.step} ({why_not(r, self.policy.healthy_levels)})" for r in self.disk.records()
                   if found is None or r.step > found[0].step]
        if found is None:
            if skipped:
                _log.warning("Rollback: resume found no healthy checkpoint in %s (skipped: %s); "
                             "starting fresh.", self.disk.main.directory, ", ".join(skipped))
            return Resumed(None, tree, {}, skipped)
        rec, restored, meta = found
        _log.info("Rollback: resumed from %s %d (%s, %s)%s.", rec.store, rec.step, rec.kind,
                  level_name(rec.level), f"; skipped newer: {', '.join(skipped)}" if skipped else "")
        self.state.load(rec, meta.get("guard"), self.disk.records(), self.policy.healthy_levels)
        return Resumed(rec, restored, meta, skipped)

    def update_pins(self, history: Sequence[Mapping[str, Any]], verdict: VerdictLike | None) -> None:
        """Sets the stores' pins (:func:`jvitals.guard.target.pins`), process 0's for all
        (preemption checkpoints are never rollback targets: not pinned as one)."""
        keep = pins(history, [r for r in self.disk.records() if r.kind != PREEMPT],
                    open_alerts=self.state.alerts.open_records(verdict), checks=list(self.state.checks),
                    onset_margin=self.policy.onset_margin, healthy_levels=self.policy.healthy_levels,
                    rewind_steps=self.policy.rewind_steps)
        self.disk.set_pins(keep)

    def restore_first(self, candidates: Iterable[CheckpointInfo],
                      like: Any) -> tuple[CheckpointInfo, Any, dict] | None:
        """:meth:`Stores.restore_first`; the candidates skipped become alerts and events."""
        try:
            return self.disk.restore_first(candidates, like, finite=self.policy.check_finite)
        finally:    # a CheckpointMismatchError too: the candidates skipped before it are reported
            self.outbox.collect_failures(self.disk)

    def restore_target(self, step: int, tree: Any, verdict: VerdictLike, position: Any,
                       sign_cutoff: tuple[int, int], record: Record) -> Restored:
        """Red: the target (:func:`jvitals.guard.target.pick_target`), its restore, the
        sick checkpoints quarantined, the steps after the restore; what it decided.

        Raises:
          RollbackLimitError: ``record`` holds ``max_rollbacks`` rollbacks already.
          RollbackError: nothing restorable below the target's bound.
        """
        sign, cutoff = sign_cutoff
        verdict_alerts = list(verdict.alerts)
        self.saver.settle()
        limit = self.recovery.max_rollbacks
        if limit is not None and len(record.history) >= int(limit):
            self._limit(step, verdict_alerts, position, sign_cutoff, record)
        target = pick_target([r for r in self.disk.records() if r.kind != PREEMPT], sign=sign,
                             cutoff=cutoff, step=step, healthy_levels=self.policy.healthy_levels,
                             rewind_steps=self.policy.rewind_steps, history=record.history,
                             last_healthy_check=self.state.last_healthy_check)
        self.disk.quarantine(target.suspects, str(target.relapse_reason))
        if target.step is not None:     # on disk before the restore: a kill in it never resumes a sick one
            self.disk.quarantine(sick_after(self.disk.records(), target.step, step),
                                 f"sick: after rollback target {target.step}; red at step {step} "
                                 f"(earliest sign {sign})")
            self.disk.write_quarantine()
        found = self.restore_first(target.candidates, tree)
        if found is None:
            self._no_target(step, target, verdict_alerts)
        rec, restored, meta = found
        alerts = self.outbox.take_alerts(self.disk)     # corrupt candidates skipped on the way
        source = rec.restored_from if rec.restored_from is not None else rec.step   # whose params
        self.disk.quarantine(sick_after(self.disk.records(), rec.step, step),
                             f"sick: after rollback target {rec.step}; red at step {step} (earliest sign {sign})")
        restored, new_scale, new_position, remedies, steps = self._after_restore(
            rec, (restored, meta, tree), verdict, position, record)
        entry = {"step": step, "to_step": rec.step, "source_step": source, "onset_step": sign, "cutoff": cutoff,
                 "lr_scale": new_scale, "position": jsonable(new_position), "recovery": steps,
                 "alerts": [alert_lines([a]) for a in verdict_alerts[:5]]}
        self.disk.write_quarantine()
        self.state.orange_saved = False
        return Restored(restored, rec, new_scale, new_position, remedies, entry, alerts)

    def _no_target(self, step: int, target: Target, verdict_alerts: list[Alert]) -> None:
        """Raises :class:`RollbackError`: nothing restorable below the target's bound."""
        self.disk.write_quarantine()
        text = no_target_message(target, self.disk.records(), step=step,
                                 healthy_levels=self.policy.healthy_levels,
                                 where=f" in {str(self.disk.main.directory)!r}")
        raise RollbackError(
            f"Rollback: {text} Alerts: {alert_lines(verdict_alerts)}. Save earlier (a smaller "
            "save_every, Saving(snapshots=...), or a larger Retention(keep_last=...)) or restart from an "
            "older run.")

    def _after_restore(self, rec: CheckpointInfo, got: tuple[Any, Mapping[str, Any], Any],
                       verdict: VerdictLike, position: Any, record: Record
                       ) -> tuple[Any, float, Any, dict[str, Any], list[dict[str, Any]]]:
        """The steps after the restore (:mod:`jvitals.guard.after_restore`), in order, on
        ``got = (restored, metadata, current state)``: ``(state, LR scale, data position,
        remedies' flags, steps done)``."""
        restored, meta, current = got
        cfg = self.recovery
        steps: list[dict[str, Any]] = [{"kind": "restore", "to_step": rec.step, "store": rec.store}]
        restored, new_scale, did = scale_lr(restored, record.lr_scale, float(cfg.lr_factor))
        steps += did
        restored = keep_step(restored, current, cfg.step_attr)
        restored, did = reset_moments(restored, self.reset)
        steps += did
        remedies = dict(record.remedies)
        if self.remedy_table:
            restored = reapply_remedies(restored, remedies)
            seen = list(verdict.alerts) + list(verdict.closed_alerts)
            restored, remedies, did = apply_remedies(restored, seen, self.remedy_table, remedies,
                                                     lr_factor=float(cfg.lr_factor))
            steps += did
        new_position, did = skip_batches(position, meta, cfg.skip_data)
        return restored, new_scale, new_position, remedies, steps + did

    def announce(self, step: int, done: Restored, count: int, monitor_alert_id: int | None,
                 verdict_alerts: Sequence[Alert]) -> Alert:
        """The rollback's alert (RED, rule ``'rollback'``) and event, once ``done`` is
        applied (``count``: the rollbacks so far; ``monitor_alert_id``: the monitor's note of it)."""
        rec, steps, sign = done.target, done.entry["recovery"], done.entry["onset_step"]
        did = ", ".join(step_text(a) for a in steps[1:] if a["kind"] != "remedy") or "no other action"
        cure = applied_text(steps)
        did += f"; {cure}" if cure else ""
        message = (f"[RED] rolled back at step {step} (earliest sign {sign}) to the healthy {rec.store[:-1]} "
                   f"of step {rec.step}; {did}; data position {done.position!r}; "
                   f"{count} rollback(s) so far; quarantined: {sorted(self.disk.main.quarantined)}. "
                   f"Cause: {alert_lines(verdict_alerts, 2)}")
        self.outbox.event({"event": "rollback", "step": step, "to_step": rec.step, "onset_step": sign,
                           "lr_scale": done.lr_scale, "position": jsonable(done.position),
                           "recovery": steps, "remedies": [a["text"] for a in steps if a["kind"] == "remedy"],
                           "reason": alert_lines(verdict_alerts, 1)})
        return make_alert("rollback", ROLLBACK_COUNT, Level.RED, step, count, sign,
                          message, {"to_step": rec.step, "lr_scale": done.lr_scale, "recovery": steps,
                                    "monitor_alert_id": monitor_alert_id})

    def _limit(self, step: int, verdict_alerts: list[Alert], position: Any, sign_cutoff: tuple[int, int],
               record: Record) -> None:
        """Raises :class:`RollbackLimitError` after quarantining what was saved since the sign."""
        sign, cutoff = sign_cutoff
        self.disk.quarantine(sick_after(self.disk.records(), cutoff - 1, step),
                             f"sick: saved after the earliest sign {sign} of the red at step {step} "
                             "(rollback limit reached)")
        healthy = [r.step for r in self.disk.records() if is_healthy(r, self.policy.healthy_levels)]
        self.disk.write_quarantine()
        self.update_pins(record.history, None)
        done = ", ".join(f"{h['step']}->{h['to_step']}" for h in record.history) or "none"
        self.outbox.event({"event": "rollback_limit", "step": step, "onset_step": sign, "healthy": healthy})
        raise RollbackLimitError(
            f"Rollback: {len(record.history)} rollback(s) already (steps {done}; LR scale now "
            f"{record.lr_scale:.4g}) and the run went red again at step {step} (earliest sign "
            f"{sign}): {alert_lines(verdict_alerts)}. max_rollbacks={self.recovery.max_rollbacks} "
            f"reached: lower the learning rate further or inspect the data at position "
            f"{position!r}. Healthy checkpoints on disk in {str(self.disk.main.directory)!r}, newest "
            f"first: {healthy or 'none'}; a restart (Rollback(..., recovery=Recovery(max_rollbacks=N))"
            f".resume()) continues from {healthy[0] if healthy else 'nothing'}; quarantined: "
            f"{sorted(self.disk.main.quarantined)}.",
            step=step, history=list(record.history), alerts=verdict_alerts, position=position,
            healthy=healthy)
