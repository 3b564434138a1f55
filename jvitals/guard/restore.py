"""The restoring half of :class:`jvitals.Rollback`: a rollback on red, and a resume.

:class:`Restores` is a base class of :class:`jvitals.guard.rollback.Rollback`; the
decisions (which action for which verdict, what to save and pin) are in
:mod:`jvitals.guard.rollback`, this module carries them out when a checkpoint is
read back:

- **a rollback** (:meth:`Restores._rollback`, on red): the target
  (:func:`jvitals.guard.target.pick_target`, a pure function of the alerts and
  the checkpoints on disk), its restore (the first candidate that restores on
  every process, :meth:`jvitals.guard.stores.Stores.restore_first`), the sick
  checkpoints quarantined, the actions after the restore
  (:mod:`jvitals.guard.actions`, then the remedies), the record of it (history,
  alert, event) and its save; or, past ``max_rollbacks``, the limit
  (:class:`RollbackLimitError`);
- **a resume** (:meth:`Restores.resume`): the newest healthy checkpoint, and the
  guard's record (LR scale, history, remedies, monitor, position) read back from
  its metadata.

It reads and writes the guard's state set by ``Rollback.__init__``: the stores
(``_disk``), the settings (``healthy_levels``, ``check_finite``, ``lr_factor``,
``step_attr``, ``reset_optimizer``, ``remedy_table``, ``skip_data``,
``rewind_steps``, ``max_rollbacks``, ``save_on_rollback``), the record
(``history``, ``lr_scale``, ``remedies``, ``position``, ``monitor``) and the
bookkeeping (``_last_healthy_check``, ``_orange_saved``, ``_resumed``,
``_last_regular``, ``_last_snapshot``); it calls the decisions' ``_save``,
``_update_pins``, ``_event``, ``_drain``, ``_drain_events``, ``_done``,
``_collect_failures`` and ``_check_lr_scale``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from jvitals.monitor.types import Alert, Level
from jvitals.guard.actions import action_text, keep_step, reset_moments, scale_lr, skip_batches
from jvitals.guard.checkpoints import ROLLBACK_SAVE
from jvitals.guard.events import ROLLBACK_COUNT
from jvitals.guard.preemption import PREEMPT
from jvitals.guard.remedies import applied_text, apply_remedies, reapply_lr_groups
from jvitals.guard.response import (
    Action,
    Response,
    RollbackError,
    RollbackLimitError,
    alert_lines,
    jsonable,
    make_alert,
)
from jvitals.guard.stores import own_position
from jvitals.guard.target import (
    CheckpointInfo,
    Target,
    is_healthy,
    level_name,
    no_target_message,
    pick_target,
    restore_order,
    sick_after,
    why_not,
)

__all__ = ["Restores", "resume_order"]

_log = logging.getLogger("jvitals.guard.rollback")


def resume_order(records: list[CheckpointInfo], healthy_levels: Iterable[int]) -> list[CheckpointInfo]:
    """What :meth:`Restores.resume` tries, in order: a preemption checkpoint that is
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


class Restores:
    """The restores of :class:`jvitals.Rollback` (see module doc); not used on its own."""

    def resume(self, state: Any, position: Any = None, monitor: Any = None) -> tuple[Any, Any]:
        """Restores the newest healthy checkpoint, if any (after a crash or a restart).

        Picks, among the checkpoints and snapshots, the newest healthy one (saved
        at a healthy level with no open ORANGE/RED alert, not quarantined, restores
        on every process and is finite); logs which and why the newer ones were
        skipped. Loads the monitor's state from it into ``monitor``, and the LR
        scale and rollback history into the guard. Without a healthy checkpoint
        a relapse suspect is used; without any, the inputs are returned.

        Args:
          state: a train state of the right structure, shapes, dtypes and shardings
            (the freshly initialised one): the restore target.
          position: the data position to use when there is no checkpoint.
          monitor: the Monitor to restore (in place) and to use from now on.

        Returns:
          ``(state, position)``: restored from the checkpoint (this process's
          position), or the inputs unchanged when the directory has none.
        """
        if monitor is not None:
            self.monitor = monitor
        self._resumed = True
        self._check_lr_scale(state)
        self._settle()
        found = self._restore_first(resume_order(self._disk.records(), self.healthy_levels), state)
        skipped = [f"{r.step} ({why_not(r, self.healthy_levels)})" for r in self._disk.records()
                   if found is None or r.step > found[0].step]
        if found is None:
            if skipped:
                _log.warning("Rollback: resume found no healthy checkpoint in %s (skipped: %s); "
                             "starting fresh.", self.directory, ", ".join(skipped))
            self.position = position
            self._done(Response(Action.CONTINUE, state, -1, None, None, self.lr_scale,
                                tuple(self._drain()), self.metrics(), tuple(self._drain_events()),
                                position))
            return state, position
        rec, restored, meta = found
        _log.info("Rollback: resumed from %s %d (%s, %s)%s.", rec.store, rec.step, rec.kind,
                  level_name(rec.level), f"; skipped newer: {', '.join(skipped)}" if skipped else "")
        if self.monitor is not None and meta.get("monitor") is not None:
            _load_monitor(self.monitor, meta["monitor"])
        self.lr_scale = float(meta.get("lr_scale", 1.0))
        self.history = list(meta.get("rollbacks", []))
        self.remedies = dict(meta.get("remedies") or {})
        self.resumed_step = rec.step
        self._load_guard_state(rec, meta.get("guard"))
        self.position = position = own_position(meta)
        self._update_pins(None)
        self._event({"event": "resume", "step": rec.step, "store": rec.store, "kind": rec.kind,
                     "skipped": skipped})
        self._done(Response(Action.RESUMED, restored, rec.step, None, rec.step, self.lr_scale,
                            tuple(self._drain()), self.metrics(), tuple(self._drain_events(keep=True)),
                            position))
        return restored, position

    def _load_guard_state(self, rec: CheckpointInfo, saved: Mapping[str, Any] | None) -> None:
        """The guard's own state as it was when ``rec`` was saved (``Rollback._guard_state``);
        for a checkpoint written before it was saved, the closest guess from the disk."""
        if saved is None:
            checks = [r.step for r in self._disk.records() if r.step <= rec.step
                      and r.level in self.healthy_levels and r.kind != ROLLBACK_SAVE]
            saved = {"last_regular": rec.step, "last_snapshot": rec.step,
                     "last_healthy_check": max(checks) if checks else None}
        self._last_regular, self._last_snapshot = saved.get("last_regular"), saved.get("last_snapshot")
        self._last_healthy_check = saved.get("last_healthy_check")
        self._orange_saved = bool(saved.get("orange_saved", False))
        self._level = int(saved.get("level", rec.level if rec.level >= 0 else Level.GREEN))
        self._open_peak = int(saved.get("open_peak", rec.open_peak))
        self._checks.clear()
        self._checks.extend(int(c) for c in saved.get("checks", []))
        self._log.load_state_dict(saved.get("alerts") or {})

    def _restore_first(self, candidates: Iterable[CheckpointInfo],
                       like: Any) -> tuple[CheckpointInfo, Any, dict] | None:
        """:meth:`Stores.restore_first`; the candidates skipped become alerts and events."""
        found = self._disk.restore_first(candidates, like, finite=self.check_finite)
        self._collect_failures()
        return found

    def _rollback(self, step: int, state: Any, verdict: Any, position: Any, sign: int,
                  cutoff: int, alerts: list[Alert]) -> Response:
        """Red: the target (:func:`jvitals.guard.target.pick_target`), its restore, the
        sick checkpoints quarantined, the actions, the record of it, and its save."""
        verdict_alerts = list(getattr(verdict, "alerts", []) or [])
        self._settle()
        if self.max_rollbacks is not None and len(self.history) >= self.max_rollbacks:
            self._limit(step, verdict_alerts, position, sign, cutoff)
        target = pick_target([r for r in self._disk.records() if r.kind != PREEMPT], sign=sign,
                             cutoff=cutoff, step=step, healthy_levels=self.healthy_levels,
                             rewind_steps=self.rewind_steps, history=self.history,
                             last_healthy_check=self._last_healthy_check)
        self._disk.quarantine(target.suspects, str(target.relapse_reason))
        if target.step is not None:     # on disk before the restore: a kill in it never resumes a sick one
            self._disk.quarantine(sick_after(self._disk.records(), target.step, step),
                                  f"sick: after rollback target {target.step}; red at step {step} "
                                  f"(earliest sign {sign})")
            self._disk.write_quarantine()
        found = self._restore_first(target.candidates, state)
        if found is None:
            self._no_target(step, target, verdict_alerts)
        rec, restored, meta = found
        alerts.extend(self._drain())            # corrupt candidates skipped on the way
        source = rec.restored_from if rec.restored_from is not None else rec.step   # whose params
        self._disk.quarantine(sick_after(self._disk.records(), rec.step, step),
                              f"sick: after rollback target {rec.step}; red at step {step} (earliest sign {sign})")
        restored, new_scale, new_position, actions = self._actions(rec, restored, meta, state, verdict,
                                                                   position)
        self.lr_scale = new_scale
        self.position = new_position
        self.history.append({"step": step, "to_step": rec.step, "source_step": source,
                             "onset_step": sign, "cutoff": cutoff,
                             "lr_scale": new_scale, "position": jsonable(new_position),
                             "actions": actions,
                             "alerts": [alert_lines([a]) for a in verdict_alerts[:5]]})
        alerts.append(self._announce(step, rec, sign, actions, verdict_alerts))
        self._disk.write_quarantine()
        self._orange_saved = False
        saved = None
        if self.save_on_rollback:
            saved = self._save(step, restored, new_position, rec.level, ROLLBACK_SAVE, restored_from=source)
        metrics = {**self.metrics(), "rollback/from_step": float(step), "rollback/to_step": float(rec.step)}
        return Response(Action.ROLLBACK, restored, step, saved, rec.step, new_scale,
                        tuple(alerts + self._drain()), metrics, tuple(self._drain_events()), new_position)

    def _no_target(self, step: int, target: Target, verdict_alerts: list[Any]) -> None:
        """Raises :class:`RollbackError`: nothing restorable below the target's bound."""
        self._disk.write_quarantine()
        text = no_target_message(target, self._disk.records(), step=step, healthy_levels=self.healthy_levels,
                                 where=f" in {str(self.directory)!r}")
        raise RollbackError(
            f"Rollback: {text} Alerts: {alert_lines(verdict_alerts)}. Save earlier (a smaller "
            "save_every, snapshots=, or a larger keep_last) or restart from an older run.")

    def _actions(self, rec: CheckpointInfo, restored: Any, meta: Mapping[str, Any], state: Any,
                 verdict: Any, position: Any) -> tuple[Any, float, Any, list[dict[str, Any]]]:
        """The actions after the restore (:mod:`jvitals.guard.actions`), in order:
        ``(state, LR scale, data position, actions)``."""
        actions: list[dict[str, Any]] = [{"action": "restore", "to_step": rec.step, "store": rec.store}]
        restored, new_scale, did = scale_lr(restored, self.lr_scale, self.lr_factor)
        actions += did
        restored = keep_step(restored, state, self.step_attr)
        restored, did = reset_moments(restored, self.reset_optimizer)
        actions += did
        if self.remedy_table:
            restored = reapply_lr_groups(restored, self.remedies)
            seen = list(getattr(verdict, "alerts", []) or []) + list(getattr(verdict, "closed_alerts", []) or [])
            restored, self.remedies, did = apply_remedies(restored, seen, self.remedy_table, self.remedies,
                                                          lr_factor=self.lr_factor)
            actions += did
        new_position, did = skip_batches(position, meta, self.skip_data)
        return restored, new_scale, new_position, actions + did

    def _announce(self, step: int, rec: CheckpointInfo, sign: int, actions: list[dict[str, Any]],
                  verdict_alerts: list[Any]) -> Alert:
        """The rollback's alert (RED, rule ``'rollback'``) and event; tells the monitor."""
        note = None
        if self.monitor is not None and hasattr(self.monitor, "note_rollback"):
            note = self.monitor.note_rollback(step, rec.step)
        did = ", ".join(action_text(a) for a in actions[1:] if a["action"] != "remedy") or "no other action"
        cure = applied_text(actions)
        did += f"; {cure}" if cure else ""
        message = (f"[RED] rolled back at step {step} (earliest sign {sign}) to the healthy {rec.store[:-1]} "
                   f"of step {rec.step}; {did}; data position {self.position!r}; "
                   f"{len(self.history)} rollback(s) so far; quarantined: {sorted(self.quarantined)}. "
                   f"Cause: {alert_lines(verdict_alerts, 2)}")
        self._event({"event": "rollback", "step": step, "to_step": rec.step, "onset_step": sign,
                     "lr_scale": self.lr_scale, "position": jsonable(self.position), "actions": actions,
                     "remedies": [a["text"] for a in actions if a["action"] == "remedy"],
                     "reason": alert_lines(verdict_alerts, 1)})
        return make_alert("rollback", ROLLBACK_COUNT, Level.RED, step, len(self.history), sign,
                           message, {"to_step": rec.step, "lr_scale": self.lr_scale, "actions": actions,
                                     "monitor_alert_id": getattr(note, "id", None)})

    def _limit(self, step: int, verdict_alerts: list[Any], position: Any, sign: int, cutoff: int) -> None:
        """Raises :class:`RollbackLimitError` after quarantining what was saved since the sign."""
        self._disk.quarantine(sick_after(self._disk.records(), cutoff - 1, step),
                              f"sick: saved after the earliest sign {sign} of the red at step {step} "
                              "(rollback limit reached)")
        healthy = [r.step for r in self._disk.records() if is_healthy(r, self.healthy_levels)]
        self._disk.write_quarantine()
        self._update_pins(None)
        done = ", ".join(f"{h['step']}->{h['to_step']}" for h in self.history) or "none"
        self._event({"event": "rollback_limit", "step": step, "onset_step": sign, "healthy": healthy})
        raise RollbackLimitError(
            f"Rollback: {len(self.history)} rollback(s) already (steps {done}; LR scale now "
            f"{self.lr_scale:.4g}) and the run went red again at step {step} (earliest sign "
            f"{sign}): {alert_lines(verdict_alerts)}. max_rollbacks={self.max_rollbacks} "
            f"reached: lower the learning rate further or inspect the data at position "
            f"{position!r}. Healthy checkpoints on disk in {str(self.directory)!r}, newest first: "
            f"{healthy or 'none'}; a restart (Rollback(..., max_rollbacks=N).resume()) continues "
            f"from {healthy[0] if healthy else 'nothing'}; quarantined: {sorted(self.quarantined)}.",
            step=step, history=list(self.history), alerts=verdict_alerts, position=position,
            healthy=healthy)
