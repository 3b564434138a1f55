"""The response policy: which action for which verdict, over a checkpoint store.

:class:`Rollback` is the one place in jvitals that acts on a verdict: each call of
:meth:`Rollback.respond` saves (GREEN/YELLOW, on the cadence), pauses (ORANGE) or
rolls back (RED). It is built from parts, each in a module of its own: its
settings (:mod:`jvitals.guard.configs`: :class:`Retention`, :class:`RestorePolicy`,
:class:`Recovery`, :class:`Saving`), its state and outbox (:mod:`jvitals.guard.state`),
its saves (:mod:`jvitals.guard.saver`), its restores (:mod:`jvitals.guard.restore`),
the target (:mod:`jvitals.guard.target`), the stores (:mod:`jvitals.guard.stores`,
:mod:`jvitals.guard.checkpoints`) and the preemption save
(:mod:`jvitals.guard.preemption`). Each part returns what it decided and the
``Rollback`` applies it; it reads a verdict through :class:`jvitals.guard.verdict.VerdictLike`.
The design, the decisions and the settings are in docs/GUARD.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from jvitals.monitor.types import Level
from jvitals.guard.after_restore import check_lr_scale, parse_reset, reset_adam_moments  # noqa: F401 - re-exported
from jvitals.guard.checkpoints import (
    CADENCE,
    MANUAL,
    ORANGE_SAVE,
    QUARANTINE_FILE,
    ROLLBACK_SAVE,
    SNAPSHOT,
    CheckpointInfo,
    CheckpointSaveError,
    Provenance,
    allgather_ints,
)
from jvitals.guard.configs import Recovery, RestorePolicy, Retention, Saving, check_config, refuse_moved
from jvitals.guard.events import ROLLBACK_COUNT, ROLLBACK_LR_SCALE, write_events
from jvitals.guard.preemption import PREEMPT, Preemption, save_on_notice
from jvitals.guard.remedies import remedied_ids
from jvitals.guard.response import (
    Action,
    PauseOnOrange,
    Response,
    RollbackError,
    RollbackLimitError,
    Snapshots,
    TrainingPaused,
    check_position,
    check_step,
)
from jvitals.guard.restore import Record, Restorer, load_monitor
from jvitals.guard.saver import Saver
from jvitals.guard.state import REGULAR_KINDS, GuardState, Outbox
from jvitals.guard.stores import Stores, own_position
from jvitals.guard.target import cutoff_before
from jvitals.guard.verdict import VerdictLike, check_verdict

__all__ = [
    "Action",
    "CheckpointInfo",
    "CheckpointSaveError",
    "QUARANTINE_FILE",
    "Recovery",
    "Response",
    "RestorePolicy",
    "Retention",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "Saving",
    "Snapshots",
    "TrainingPaused",
]

_log = logging.getLogger("jvitals.guard.rollback")


def _check_init(directory: Any, save_every: Any, monitor: Any, writer: Any) -> None:
    """``Rollback``'s plain arguments, each a clear error."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"Rollback expects a directory (str or path) for its checkpoints, got "
                        f"{type(directory).__name__} {directory!r:.40}; e.g. Rollback('/tmp/run/ckpt')")
    if isinstance(save_every, bool) or not isinstance(save_every, (int, np.integer)):
        raise TypeError(f"Rollback expects save_every= an int number of steps, got {type(save_every).__name__} "
                        f"{save_every!r}")
    if save_every < 1:
        raise ValueError(f"Rollback expects save_every >= 1, got {save_every}")
    for name, x in (("monitor", monitor), ("writer", writer)):
        if isinstance(x, type):
            raise TypeError(f"Rollback({name}=...) got the class {x.__name__}, not an instance: "
                            f"pass {name}={x.__name__}(...)")


def _remedied(verdict: VerdictLike | None, table: Any) -> set[int]:
    """Ids of the verdict's alerts (open, and closed at this check) whose cause has a
    remedy in ``table``: the alerts :func:`apply_remedies` acts on."""
    if not table or verdict is None:
        return set()
    return remedied_ids(list(verdict.alerts) + list(verdict.closed_alerts), table)


class Rollback:
    """Saves on a cadence, pauses on orange, rolls back on red (docs/GUARD.md).

    Args:
      directory: the checkpoint directory (created if missing; any path orbax accepts).
      save_every: cadence in steps: a checkpoint at the first call and whenever
        ``step // save_every`` grows.
      monitor: the Monitor whose ``state_dict`` is saved and whose
        ``note_rollback`` is called (also set by :meth:`resume`).
      writer: a clu ``MetricWriter`` (or anything with its ``write_*`` methods):
        the guard writes its figures and events through :func:`jvitals.write`.
      retention: a :class:`Retention`: which checkpoints are kept (``keep_last=5``,
        ``keep_every=5000``, ``keep_green=1``, ``keep_quarantined=3``).
      restore: a :class:`RestorePolicy`: which checkpoint a rollback restores
        (``healthy_levels``, ``check_finite``, ``onset_margin``, ``rewind_steps``).
      recovery: a :class:`Recovery`: what a rollback does after the restore
        (``lr_factor=0.9``, ``max_rollbacks=3``, ``skip_data``, ``reset_optimizer``,
        ``remedies``, ``save_on_rollback``, ``step_attr``).
      saving: a :class:`Saving`: how checkpoints are written (``sync``,
        ``on_save_error``, ``snapshots``) and what follows the saves that stop the
        loop (``pause`` on orange: ``'return'``, ``'raise'`` or a callable;
        ``preemption``: what :meth:`preempted` watches).

    Attributes:
      last_action: the :class:`Action` of the latest call (None before any).
      last_response: the latest :class:`Response`.
      lr_scale: the LR scale in force (compounded over rollbacks).
      history: the rollbacks so far (dicts; saved in the metadata).
      alerts: every alert the guard raised, oldest first.
      events: every event the guard recorded, oldest first.
      position: the data position to continue from after the latest call.
      resumed_step: the checkpoint :meth:`resume` restored (None: fresh start).
      preemption: the :class:`Preemption` :meth:`preempted` asks (None: never).
      level: the level the guard last acted on (GREEN before any check).
      store: the :class:`~jvitals.guard.checkpoints.CheckpointStore` of the checkpoints.
      snapshot_store: the store of the snapshots (None without snapshots).
      retention, restore_policy, recovery, saving: the settings (frozen configs).
      remedies: the remedies' flags for the loop (a plain JSON dict, saved with
        each checkpoint, restored by :meth:`resume`): ``"qk_clip_tau"`` (call
        :func:`jvitals.qk_clip` with it), ``"z_loss"`` (the weight of
        :func:`jvitals.z_loss`), ``"layer_decay"`` and ``"lr_groups"`` (the
        group LR scales the guard set, kept in force over later restores).

    Raises:
      CheckpointSaveError: the directory cannot be created or written.
      ValueError: a setting is out of range (the error names the config and field).
      TypeError: a config of the wrong type, or a keyword of 0.1 (``keep_last=``,
        ``pause=``, ...; the error names its config: :data:`jvitals.guard.configs.MOVED`).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Rollback":
        """Refuses a keyword ``Rollback`` no longer takes with where it is now (Python's
        own error would name only the keyword)."""
        refuse_moved(kwargs)
        return super().__new__(cls)

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 500, monitor: Any = None,
                 writer: Any = None, retention: Retention = Retention(), restore: RestorePolicy = RestorePolicy(),
                 recovery: Recovery = Recovery(), saving: Saving = Saving()) -> None:
        for name, value, cls in (("retention", retention, Retention), ("restore", restore, RestorePolicy),
                                 ("recovery", recovery, Recovery), ("saving", saving, Saving)):
            check_config(name, value, cls)
        _check_init(directory, save_every, monitor, writer)
        self.retention, self.restore_policy, self.recovery, self.saving = retention, restore, recovery, saving
        self.save_every, self.monitor, self.writer = int(save_every), monitor, writer
        self._pause = PauseOnOrange(saving.pause)
        self.pause = self._pause.how
        preemption = saving.preemption
        self.preemption = preemption if isinstance(preemption, Preemption) else (
            Preemption() if preemption else None)
        self.last_action: Action | None = None
        self.last_response: Response | None = None
        self.lr_scale = 1.0
        self.history: list[dict[str, Any]] = []
        self.remedies: dict[str, Any] = {}
        self.alerts: list[Any] = []
        self.position: Any = None
        self.resumed_step: int | None = None
        self._state, self._outbox = GuardState(), Outbox()
        self.events, self._pending = self._outbox.events, self._outbox.alerts
        self._lr_checked = self._resumed = self._warned_no_resume = self._rewound = False
        self._last_check: int | None = None     # the step of the last act(): a later one may not go back
        levels = self.restore_policy.healthy_levels
        self._disk = Stores(directory, self.saving.snapshots, healthy_levels=levels, retention=self.retention)
        self.store, self.snapshot_store = self._disk.main, self._disk.snapshots
        self.directory = self.store.directory
        self._saver = Saver(self._disk, self.save_every, self.saving, self._state, self._outbox, levels)
        self._restorer = Restorer(self._disk, self._state, self._outbox, self._saver, self.restore_policy,
                                  self.recovery)
        self._outbox.collect_failures(self._disk)
        regular = [r.step for r in self.store.checkpoints if r.kind in REGULAR_KINDS and r.quarantined is None]
        self._state.last_regular = max(regular) if regular else None
        self._found_at_open = self._disk.latest_step()

    # -- Public API. -------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Records of the checkpoints on disk (not the snapshots), oldest first."""
        return self.store.checkpoints

    @property
    def snapshot_checkpoints(self) -> list[CheckpointInfo]:
        """Records of the snapshots on disk, oldest first (empty without snapshots)."""
        return self.snapshot_store.checkpoints if self.snapshot_store is not None else []

    @property
    def quarantined(self) -> dict[int, str]:
        """``{step: reason}`` of the checkpoints (not snapshots) that are never restored."""
        return self.store.quarantined

    @property
    def level(self) -> Level:
        """The level the guard last acted on (process 0's; :meth:`resume` brings it back)."""
        return Level(self._state.level)

    @property
    def pins(self) -> dict[int, str]:
        """``{step: why}`` of the checkpoints retention never deletes."""
        return dict(self.store.pins)

    def metrics(self) -> dict[str, float]:
        """Scalars to log at any step: ``rollback/count`` and ``rollback/lr_scale``."""
        return {ROLLBACK_COUNT: float(len(self.history)), ROLLBACK_LR_SCALE: float(self.lr_scale)}

    def respond(self, step: int, state: Any, verdict: VerdictLike | None, position: Any = None) -> Any:
        """Acts on ``verdict`` and returns the state to continue with.

        See :meth:`act`; this returns only ``act(...).state`` (the action is in
        :attr:`last_action`, the data position to continue from in :attr:`position`).
        """
        return self.act(step, state, verdict, position).state

    def act(self, step: int, state: Any, verdict: VerdictLike | None, position: Any = None) -> Response:
        """Saves, pauses or rolls back according to ``verdict``.

        Args:
          step: the loop's step (the checkpoint number); same on every process, increasing.
          state: the current train state (any pytree; never modified).
          verdict: this process's ``Monitor.update`` result (None: GREEN). On
            several processes, process 0's decides for all.
          position: the data position after this step (JSON-serialisable).

        Returns:
          A :class:`Response`; its ``state`` is the restored one on ROLLBACK.

        Raises:
          TypeError: ``verdict`` is not what ``Monitor.update`` returns (not a
            :class:`~jvitals.guard.verdict.VerdictLike`: a level, an alert, a dict; a RED
            handed over as its level alone would be handled as GREEN); ``step``
            not an int (a str, a float; the arguments swapped).
          ValueError: ``step`` < 0, or before the last check's without a rollback or a
            :meth:`resume` between them (a restarted loop that forgot ``resume``).
          RollbackLimitError: red after ``max_rollbacks`` rollbacks.
          RollbackError: red and no healthy checkpoint before the earliest sign.
          TrainingPaused: orange with ``pause='raise'`` (after the save).
          CheckpointSaveError: a save failed, with ``on_save_error='raise'`` (the state
            is untouched; by default the failure is one error line and an alert).
        """
        step = check_step(step, None if self._rewound else self._last_check)
        self._last_check, self._rewound = step, False
        check_verdict(verdict)
        check_position(position)
        skip = self.recovery.skip_data
        if skip is not False and not isinstance(position, (int, np.integer)):
            raise TypeError(f"Rollback(recovery=Recovery(skip_data={skip!r})) expects an int data position "
                            f"(batches consumed), got {type(position).__name__} {position!r}; pass "
                            "an int, or skip_data=False and skip in your loader.")
        self._state.alerts.observe(step, verdict)
        self._state.checks.append(step)
        level, sign, cutoff = self._decide(step, verdict)
        self._state.level = level
        self._check_lr_scale(state)
        if not self._resumed and self._found_at_open is not None and not self._warned_no_resume:
            self._warned_no_resume = True
            _log.warning("Rollback: %s already held checkpoints up to step %d but resume() "
                         "was not called; starting fresh alongside them.",
                         self.directory, self._found_at_open)
        self._saver.settle(poll=True)
        alerts = self._outbox.take_alerts(self._disk)
        open_peak = max(self._state.open_peak, level)
        self.position = position
        if level in self.restore_policy.healthy_levels:
            self._state.last_healthy_check = step
        if level >= Level.RED:
            response = self._roll_back(step, state, verdict, position, (sign, cutoff), alerts)
        else:
            response = self._on_orange_or_calm(step, state, position, (level, open_peak), alerts)
        self._restorer.update_pins(self.history, verdict)
        self._finish(step, response)
        if response.action is Action.PAUSE:
            self._pause(response, verdict, self.directory)
        return response

    def save(self, step: int, state: Any, position: Any = None, *, level: int = Level.GREEN) -> int | None:
        """Saves a checkpoint now (kind ``'manual'``), e.g. at the end of training.

        Returns:
          The step saved, or None if a usable checkpoint of that step exists.
        """
        return self._save(check_step(step, None, "Rollback.save"), state, position, int(level), MANUAL)

    def restore(self, step: int, state: Any) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint (or snapshot) ``step`` onto ``state``'s structure and shardings.

        For inspection (a post-mortem of a quarantined checkpoint too); the guard's
        own bookkeeping is not changed.

        Returns:
          ``(state, metadata)``.

        Raises:
          CheckpointMismatchError: its arrays do not fit ``state`` (see :meth:`resume`).
        """
        return self._disk.holding(int(step)).restore(int(step), state)

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

        Raises:
          CheckpointMismatchError: the newest healthy checkpoint's arrays do not fit
            ``state`` (another shape, a path absent on one side: the model or the
            optimizer changed); the message names the first path, both shapes and
            the step; nothing is quarantined. (A checkpoint an older jvitals recorder
            wrote is not one: its recorder's figures are taken from ``state``, with
            one warning line.)
        """
        if isinstance(monitor, type):
            raise TypeError(f"Rollback.resume(monitor=...) got the class {monitor.__name__}: pass the instance "
                            f"the loop uses, monitor={monitor.__name__}(...)")
        if monitor is not None:
            self.monitor = monitor
        self._resumed = self._rewound = True
        self._check_lr_scale(state)
        response = self._resume(state, position)
        self._finish(None, response)
        return response.state, response.position

    def preempted(self, step: int, state: Any, position: Any = None) -> bool:
        """Called at the end of every step: on a preemption notice, saves and says stop.

        Cheap without a notice (a flag read; on several processes JAX's local
        sync-point check, no collective). On a notice (SIGTERM; under
        ``jax.distributed``, JAX's preemption notice from any process, acted on by
        every process at one step; see :mod:`jvitals.guard.preemption`) it saves
        ``state``, ``position`` and the monitor's state as checkpoint ``step`` (kind
        ``'preempt'``), waits until it is committed, logs one line, and returns True,
        then and at every later call: leave the loop. A restart's :meth:`resume`
        continues from that checkpoint (step ``step + 1``: nothing recomputed), with
        the guard's and the monitor's state as they were, whatever the level.

        Args:
          step: the step just done (the same on every process, consecutive).
          state: the train state after it, or a function that returns it, called only
            on a notice (``lambda: nnx.state((model, optimizer))``: nothing built per step).
          position: the data position after it (JSON-serialisable).

        Returns:
          True: stop the loop (the checkpoint is committed, or its save failed and
          was reported: a restart then resumes from the last good checkpoint).

        Raises:
          CheckpointSaveError: the save failed, with ``on_save_error='raise'``.
        """
        if self._state.preempted_at is not None:
            return True
        if self.preemption is None or not self.preemption.reached(int(step)):
            return False
        step = self._state.preempted_at = int(step)
        level = self._state.level
        event = save_on_notice(
            step, lambda: self._save(step, state() if callable(state) else state, position, level, PREEMPT,
                                     open_peak=max(self._state.open_peak, level)),
            self._saver.settle, store=self.store, notice=self.preemption.notice, position=position)
        self._outbox.event(event)
        if self.writer is not None:
            write_events(self.writer, step, {}, self._outbox.take_events())
        return True

    def wait(self) -> None:
        """Blocks until pending saves have landed.

        Raises:
          CheckpointSaveError: an asynchronous save failed.
        """
        self._disk.wait()

    def close(self) -> None:
        """Waits for pending saves (a failed one: see ``on_save_error``), puts back the
        signal handlers :meth:`preempted` installed and releases orbax's resources."""
        try:
            self._saver.settle()
        finally:
            if self.preemption is not None:
                self.preemption.close()
            self._disk.close()

    def __enter__(self) -> "Rollback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- Decisions. --------------------------------------------------

    def _decide(self, step: int, verdict: VerdictLike | None) -> tuple[int, int, int]:
        """Process 0's (level, earliest sign, cutoff), the same on every process (and its
        open peak level, in the state's ``open_peak``)."""
        level = int(verdict.level) if verdict is not None else int(Level.GREEN)
        log = self._state.alerts
        remedied = _remedied(verdict, self._restorer.remedy_table)
        sign = log.chain_sign(verdict, step, remedied) if level >= Level.RED else step
        rows = allgather_ints([step, level, sign,
                               cutoff_before(sign, self._state.checks, self.restore_policy.onset_margin),
                               log.open_peak(verdict)])
        if (rows[:, 0] != rows[0, 0]).any():
            raise RuntimeError(
                f"Rollback: processes called respond at different steps {rows[:, 0].tolist()}; "
                "expected every process at the same step. Call respond at the same steps on "
                "every process.")
        self._state.open_peak = int(rows[0, 4])
        return int(rows[0, 1]), int(rows[0, 2]), int(rows[0, 3])

    def _on_orange_or_calm(self, step: int, state: Any, position: Any, levels: tuple[int, int],
                           alerts: list[Any]) -> Response:
        """ORANGE: save once per episode, then PAUSE; GREEN/YELLOW: the cadence save or
        a snapshot (``levels = (level, open peak)``)."""
        level, open_peak = levels
        take = self._outbox.take_alerts
        if level == Level.ORANGE:
            saved = None
            if not self._state.orange_saved:
                self._state.orange_saved = True
                saved = self._save(step, state, position, level, ORANGE_SAVE, open_peak=open_peak)
                self._outbox.event({"event": "pause", "step": step, "saved_step": saved})
            return Response(Action.PAUSE, state, step, saved, None, self.lr_scale,
                            tuple(alerts + take(self._disk)), self.metrics(),
                            tuple(self._outbox.take_events()), position)
        self._state.orange_saved = False
        saved = snap = None
        if self._saver.cadence_due(step):
            saved = self._save(step, state, position, level, CADENCE, open_peak=open_peak)
        elif self._saver.snapshot_due(step) and open_peak < Level.ORANGE:
            snap = self._save(step, state, position, level, SNAPSHOT, open_peak=open_peak)
        return Response(Action.SAVED if saved is not None or snap is not None else Action.CONTINUE,
                        state, step, saved, None, self.lr_scale, tuple(alerts + take(self._disk)),
                        self.metrics(), tuple(self._outbox.take_events()), position, snap)

    # -- Restores: the Restorer decides, the guard applies. -----------

    def _roll_back(self, step: int, state: Any, verdict: VerdictLike, position: Any,
                   sign_cutoff: tuple[int, int], alerts: list[Any]) -> Response:
        """Red: the :class:`Restorer`'s rollback applied to the guard's record, told to
        the monitor, announced and saved."""
        done = self._restorer.restore_target(step, state, verdict, position, sign_cutoff,
                                             Record(self.lr_scale, self.history, self.remedies))
        self.lr_scale, self.position, self.remedies = done.lr_scale, done.position, done.remedies
        self.history.append(done.entry)
        note = None
        if self.monitor is not None and hasattr(self.monitor, "note_rollback"):
            note = self.monitor.note_rollback(step, done.target.step)
        alerts = alerts + done.alerts + [self._restorer.announce(step, done, len(self.history),
                                                                 None if note is None else note.id,
                                                                 list(verdict.alerts))]
        rec, saved = done.target, None
        if self.recovery.save_on_rollback:
            source = done.entry["source_step"]
            saved = self._save(step, done.state, done.position, rec.level, ROLLBACK_SAVE, source)
        metrics = {**self.metrics(), "rollback/from_step": float(step), "rollback/to_step": float(rec.step)}
        return Response(Action.ROLLBACK, done.state, step, saved, rec.step, self.lr_scale,
                        tuple(alerts + self._outbox.take_alerts(self._disk)), metrics,
                        tuple(self._outbox.take_events()), self.position)

    def _resume(self, state: Any, position: Any) -> Response:
        """The :class:`Restorer`'s resume applied: the guard's record and the monitor read
        back from the checkpoint's metadata (RESUMED), or the inputs (CONTINUE)."""
        found = self._restorer.resume(state)
        rec, meta = found.target, found.meta
        if rec is None:
            self.position = position
            return Response(Action.CONTINUE, state, -1, None, None, self.lr_scale,
                            tuple(self._outbox.take_alerts(self._disk)), self.metrics(),
                            tuple(self._outbox.take_events()), position)
        if self.monitor is not None and meta.get("monitor") is not None:
            load_monitor(self.monitor, meta["monitor"])
        self.lr_scale = float(meta.get("lr_scale", 1.0))
        self.history = list(meta.get("rollbacks", []))
        self.remedies = dict(meta.get("remedies") or {})
        self.resumed_step = rec.step
        self.position = own_position(meta)
        self._restorer.update_pins(self.history, None)
        self._outbox.event({"event": "resume", "step": rec.step, "store": rec.store, "kind": rec.kind,
                            "skipped": found.skipped})
        return Response(Action.RESUMED, found.state, rec.step, None, rec.step, self.lr_scale,
                        tuple(self._outbox.take_alerts(self._disk)), self.metrics(),
                        tuple(self._outbox.take_events(keep=True)), self.position)

    # -- Saving. -----------------------------------------------------

    def _save(self, step: int, state: Any, position: Any, level: int, kind: str,
              restored_from: int | None = None, open_peak: int = 0) -> int | None:
        """Saves through the :class:`Saver`, with the guard's record in the metadata."""
        record = {
            "monitor": self.monitor.state_dict() if self.monitor is not None and hasattr(
                self.monitor, "state_dict") else None,
            "rollback_count": len(self.history), "rollbacks": self.history, "remedies": self.remedies,
        }
        return self._saver.save(step, state, position, record, level=level, kind=kind, open_peak=open_peak,
                                provenance=Provenance(restored_from, self.lr_scale))


    # -- Small helpers. ----------------------------------------------

    def _check_lr_scale(self, state: Any) -> None:
        if not self._lr_checked:
            check_lr_scale(state, float(self.recovery.lr_factor))
            self._lr_checked = True

    def _finish(self, step: int | None, response: Response) -> None:
        """Records ``response`` (and writes it at ``step``; None: not written)."""
        self.alerts.extend(response.alerts)
        self.last_response = response
        self.last_action = response.action
        self._rewound = self._rewound or response.action is Action.ROLLBACK
        if step is not None and self.writer is not None:
            write_events(self.writer, step, response.metrics, response.events)
