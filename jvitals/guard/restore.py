"""The restoring part of :class:`jvitals.Rollback`: a rollback on red, and a resume.

:class:`Restorer` carries out what the guard decided (:mod:`jvitals.guard.rollback`)
when a checkpoint is read back, and returns what it found for the guard to apply:

- **a rollback** (:meth:`Restorer.roll_back`, on red): the target
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
from typing import Any, Callable, Iterable, Mapping, Sequence

from jvitals.monitor.types import Alert, Level
from jvitals.guard.actions import action_text, keep_step, parse_reset, reset_moments, scale_lr, skip_batches
from jvitals.guard.checkpoints import ROLLBACK_SAVE
from jvitals.guard.events import ROLLBACK_COUNT
from jvitals.guard.preemption import PREEMPT
from jvitals.guard.configs import RollbackActions, RestorePolicy
from jvitals.guard.remedies import applied_text, apply_remedies, parse_remedies, reapply_remedies
from jvitals.guard.response import (
    Action,
    Response,
    RollbackError,
    RollbackLimitError,
    alert_lines,
    jsonable,
    make_alert,
)
from jvitals.guard.state import GuardState, Outbox
from jvitals.guard.stores import own_position
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

__all__ = ["Restorer", "resume_order"]

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


def _load_monitor(monitor: Any, d: Mapping[str, Any]) -> None:
    """Loads a monitor's saved state into ``monitor`` in place."""
    if hasattr(monitor, "load_state_dict"):
        monitor.load_state_dict(d)
        return
    fresh = type(monitor).from_state_dict(d)
    monitor.__dict__.update(fresh.__dict__)


class Restorer:
    """The restores of :class:`jvitals.Rollback` (see module doc).

    Args:
      disk: the guard's :class:`jvitals.guard.stores.Stores`.
      state: the guard's :class:`jvitals.guard.state.GuardState`.
      outbox: the guard's :class:`jvitals.guard.state.Outbox`.
      saver: the guard's :class:`jvitals.guard.saver.Saver` (its waits).
      policy: the :class:`jvitals.guard.configs.RestorePolicy`.
      actions: the :class:`jvitals.guard.configs.RollbackActions`.
      save: the guard's save, ``save(step, tree, position, level, kind, restored_from)``
        (it adds the guard's record to the metadata).
    """

    def __init__(self, disk: Any, state: GuardState, outbox: Outbox, saver: Any, policy: RestorePolicy,
                 actions: RollbackActions, save: Callable[..., int | None]) -> None:
        self.disk, self.state, self.outbox, self.saver = disk, state, outbox, saver
        self.policy, self.actions, self._save = policy, actions, save
        self.reset = parse_reset(actions.reset_optimizer)
        self.remedy_table = parse_remedies(actions.remedies)

    def resume(self, guard: Any, tree: Any, position: Any) -> Response:
        """Restores the newest healthy checkpoint (see :meth:`jvitals.Rollback.resume`)
        into ``guard``'s record; the :class:`Response` (RESUMED, or CONTINUE with the
        inputs when no checkpoint restores)."""
        self.saver.settle()
        records = self.disk.records()
        found = self.restore_first(resume_order(records, self.policy.healthy_levels), tree)
        skipped = [f"{r.step} ({why_not(r, self.policy.healthy_levels)})" for r in self.disk.records()
                   if found is None or r.step > found[0].step]
        if found is None:
            if skipped:
                _log.warning("Rollback: resume found no healthy checkpoint in %s (skipped: %s); "
                             "starting fresh.", self.disk.main.directory, ", ".join(skipped))
            guard.position = position
            return Response(Action.CONTINUE, tree, -1, None, None, guard.lr_scale,
                            tuple(self.outbox.take_alerts(self.disk)), guard.metrics(),
                            tuple(self.outbox.take_events()), position)
        rec, restored, meta = found
        _log.info("Rollback: resumed from %s %d (%s, %s)%s.", rec.store, rec.step, rec.kind,
                  level_name(rec.level), f"; skipped newer: {', '.join(skipped)}" if skipped else "")
        if guard.monitor is not None and meta.get("monitor") is not None:
            _load_monitor(guard.monitor, meta["monitor"])
        guard.lr_scale = float(meta.get("lr_scale", 1.0))
        guard.history = list(meta.get("rollbacks", []))
        guard.remedies = dict(meta.get("remedies") or {})
        guard.resumed_step = rec.step
        self.state.load(rec, meta.get("guard"), self.disk.records(), self.policy.healthy_levels)
        guard.position = position = own_position(meta)
        self.update_pins(guard.history, None)
        self.outbox.event({"event": "resume", "step": rec.step, "store": rec.store, "kind": rec.kind,
                           "skipped": skipped})
        return Response(Action.RESUMED, restored, rec.step, None, rec.step, guard.lr_scale,
                        tuple(self.outbox.take_alerts(self.disk)), guard.metrics(),
                        tuple(self.outbox.take_events(keep=True)), position)

    def update_pins(self, history: Sequence[Mapping[str, Any]], verdict: Any) -> None:
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

    def rollback(self, guard: Any, step: int, tree: Any, verdict: Any, position: Any,
                 sign_cutoff: tuple[int, int], alerts: list[Alert]) -> Response:
        """Red: the target (:func:`jvitals.guard.target.pick_target`), its restore, the
        sick checkpoints quarantined, the actions, the record of it (in ``guard``'s
        ``history``, ``lr_scale``, ``position``, ``remedies``), and its save."""
        sign, cutoff = sign_cutoff
        verdict_alerts = list(getattr(verdict, "alerts", []) or [])
        self.saver.settle()
        limit = self.actions.max_rollbacks
        if limit is not None and len(guard.history) >= int(limit):
            self._limit(guard, step, verdict_alerts, position, sign_cutoff)
        target = pick_target([r for r in self.disk.records() if r.kind != PREEMPT], sign=sign,
                             cutoff=cutoff, step=step, healthy_levels=self.policy.healthy_levels,
                             rewind_steps=self.policy.rewind_steps, history=guard.history,
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
        alerts.extend(self.outbox.take_alerts(self.disk))   # corrupt candidates skipped on the way
        source = rec.restored_from if rec.restored_from is not None else rec.step   # whose params
        self.disk.quarantine(sick_after(self.disk.records(), rec.step, step),
                             f"sick: after rollback target {rec.step}; red at step {step} (earliest sign {sign})")
        restored, new_scale, new_position, actions = self._act(guard, rec, (restored, meta, tree), verdict,
                                                                position)
        guard.lr_scale = new_scale
        guard.position = new_position
        guard.history.append({"step": step, "to_step": rec.step, "source_step": source,
                              "onset_step": sign, "cutoff": cutoff,
                              "lr_scale": new_scale, "position": jsonable(new_position),
                              "actions": actions,
                              "alerts": [alert_lines([a]) for a in verdict_alerts[:5]]})
        alerts.append(self._announce(guard, step, rec, sign, (actions, verdict_alerts)))
        self.disk.write_quarantine()
        self.state.orange_saved = False
        saved = None
        if self.actions.save_on_rollback:
            saved = self._save(step, restored, new_position, rec.level, ROLLBACK_SAVE, source)
        metrics = {**guard.metrics(), "rollback/from_step": float(step), "rollback/to_step": float(rec.step)}
        return Response(Action.ROLLBACK, restored, step, saved, rec.step, new_scale,
                        tuple(alerts + self.outbox.take_alerts(self.disk)), metrics,
                        tuple(self.outbox.take_events()), new_position)

    def _no_target(self, step: int, target: Target, verdict_alerts: list[Any]) -> None:
        """Raises :class:`RollbackError`: nothing restorable below the target's bound."""
        self.disk.write_quarantine()
        text = no_target_message(target, self.disk.records(), step=step,
                                 healthy_levels=self.policy.healthy_levels,
                                 where=f" in {str(self.disk.main.directory)!r}")
        raise RollbackError(
            f"Rollback: {text} Alerts: {alert_lines(verdict_alerts)}. Save earlier (a smaller "
            "save_every, Saving(snapshots=...), or a larger Retention(keep_last=...)) or restart from an "
            "older run.")

    def _act(self, guard: Any, rec: CheckpointInfo, got: tuple[Any, Mapping[str, Any], Any], verdict: Any,
             position: Any) -> tuple[Any, float, Any, list[dict[str, Any]]]:
        """The actions after the restore (:mod:`jvitals.guard.actions`), in order, on
        ``got = (restored, metadata, current state)``: ``(state, LR scale, data position, actions)``."""
        restored, meta, current = got
        cfg = self.actions
        actions: list[dict[str, Any]] = [{"action": "restore", "to_step": rec.step, "store": rec.store}]
        restored, new_scale, did = scale_lr(restored, guard.lr_scale, float(cfg.lr_factor))
        actions += did
        restored = keep_step(restored, current, cfg.step_attr)
        restored, did = reset_moments(restored, self.reset)
        actions += did
        if self.remedy_table:
            restored = reapply_remedies(restored, guard.remedies)
            seen = list(getattr(verdict, "alerts", []) or []) + list(getattr(verdict, "closed_alerts", []) or [])
            restored, guard.remedies, did = apply_remedies(restored, seen, self.remedy_table, guard.remedies,
                                                           lr_factor=float(cfg.lr_factor))
            actions += did
        new_position, did = skip_batches(position, meta, cfg.skip_data)
        return restored, new_scale, new_position, actions + did

    def _announce(self, guard: Any, step: int, rec: CheckpointInfo, sign: int,
                  why: tuple[list[dict[str, Any]], list[Any]]) -> Alert:
        """The rollback's alert (RED, rule ``'rollback'``) and event, for ``why = (actions,
        the verdict's alerts)``; tells the monitor."""
        actions, verdict_alerts = why
        note = None
        if guard.monitor is not None and hasattr(guard.monitor, "note_rollback"):
            note = guard.monitor.note_rollback(step, rec.step)
        did = ", ".join(action_text(a) for a in actions[1:] if a["action"] != "remedy") or "no other action"
        cure = applied_text(actions)
        did += f"; {cure}" if cure else ""
        message = (f"[RED] rolled back at step {step} (earliest sign {sign}) to the healthy {rec.store[:-1]} "
                   f"of step {rec.step}; {did}; data position {guard.position!r}; "
                   f"{len(guard.history)} rollback(s) so far; quarantined: {sorted(guard.quarantined)}. "
                   f"Cause: {alert_lines(verdict_alerts, 2)}")
        self.outbox.event({"event": "rollback", "step": step, "to_step": rec.step, "onset_step": sign,
                           "lr_scale": guard.lr_scale, "position": jsonable(guard.position),
                           "actions": actions, "remedies": [a["text"] for a in actions if a["action"] == "remedy"],
                           "reason": alert_lines(verdict_alerts, 1)})
        return make_alert("rollback", ROLLBACK_COUNT, Level.RED, step, len(guard.history), sign,
                          message, {"to_step": rec.step, "lr_scale": guard.lr_scale, "actions": actions,
                                    "monitor_alert_id": getattr(note, "id", None)})

    def _limit(self, guard: Any, step: int, verdict_alerts: list[Any], position: Any,
               sign_cutoff: tuple[int, int]) -> None:
        """Raises :class:`RollbackLimitError` after quarantining what was saved since the sign."""
        sign, cutoff = sign_cutoff
        self.disk.quarantine(sick_after(self.disk.records(), cutoff - 1, step),
                             f"sick: saved after the earliest sign {sign} of the red at step {step} "
                             "(rollback limit reached)")
        healthy = [r.step for r in self.disk.records() if is_healthy(r, self.policy.healthy_levels)]
        self.disk.write_quarantine()
        self.update_pins(guard.history, None)
        done = ", ".join(f"{h['step']}->{h['to_step']}" for h in guard.history) or "none"
        self.outbox.event({"event": "rollback_limit", "step": step, "onset_step": sign, "healthy": healthy})
        raise RollbackLimitError(
            f"Rollback: {len(guard.history)} rollback(s) already (steps {done}; LR scale now "
            f"{guard.lr_scale:.4g}) and the run went red again at step {step} (earliest sign "
            f"{sign}): {alert_lines(verdict_alerts)}. max_rollbacks={self.actions.max_rollbacks} "
            f"reached: lower the learning rate further or inspect the data at position "
            f"{position!r}. Healthy checkpoints on disk in {str(self.disk.main.directory)!r}, newest "
            f"first: {healthy or 'none'}; a restart (Rollback(..., actions=RollbackActions(max_rollbacks=N))"
            f".resume()) continues from {healthy[0] if healthy else 'nothing'}; quarantined: "
            f"{sorted(guard.quarantined)}.",
            step=step, history=list(guard.history), alerts=verdict_alerts, position=position,
            healthy=healthy)
