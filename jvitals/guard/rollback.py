"""The red response: which action for which verdict, over a checkpoint store.

:class:`Rollback` is the one place in jvitals that acts on a verdict. Each call
of :meth:`Rollback.respond` (at the host's check cadence) does one of::

    verdict level      action     what happens
    GREEN / YELLOW     SAVED      save on the cadence (first call, then each time the
                                  step crosses a multiple of ``save_every``); a light
                                  snapshot between them with ``snapshots=``
                       CONTINUE   otherwise
    ORANGE             PAUSE      save now (off-cadence too; once per orange episode),
                                  then pause as asked: 'return' (the loop decides),
                                  'raise' (:class:`TrainingPaused`) or a callable
    RED                ROLLBACK   restore the newest healthy checkpoint from before the
                                  fault's earliest sign, then the actions: learning rate
                                  x ``lr_factor``; optionally skip data, reset Adam
                                  moments; data position kept by default

The checkpoints live in a :class:`jvitals.guard.checkpoints.CheckpointStore` (save,
levels, pins, quarantine, retention; the checkpoints and the snapshots together in
:class:`jvitals.guard.stores.Stores`); this module decides what to save and what to
pin, and knows nothing about orbax. Its parts, each in a module of its own: the
target of a rollback is a pure function of the alerts seen and the checkpoints on
disk (:mod:`jvitals.guard.target`, over the records of :mod:`jvitals.guard.alertlog`);
the restores (the rollback's steps, the resume) are in :mod:`jvitals.guard.restore`
(a base class of :class:`Rollback`); the actions after a restore in
:mod:`jvitals.guard.actions`; the types it returns and raises in
:mod:`jvitals.guard.response`.

Decisions (each is tested):

- **Checkpoint numbers** are the ``step`` passed to ``respond``. After a
  rollback the numbering keeps going forward: params and optimizer state come
  from the old checkpoint, the step counter (``step_attr``) and the data position
  do not go back. Orbax silently skips a save at a step <= its latest and refuses
  an existing step; forward numbering avoids both.
- **The rollback is itself checkpointed** (``save_on_rollback=True``): the
  restored state, after the actions, with the data position to continue from, is
  saved as the red step (kind ``"rollback"``); a crash right after it resumes
  rolled back.
- **The target** is the newest *healthy* checkpoint (saved at a level in
  ``healthy_levels`` with no open alert that had reached ORANGE, not quarantined,
  restores on every process, finite) saved before the fault's **earliest sign**
  minus one host cadence ``k``. ``E`` is the earliest of the onsets
  and localization change points (``Localization.departure_step``) of the chain
  of alerts that escalated to the red: the open alerts whose peak reached ORANGE
  or RED, the open spike alerts (a spike's onset), the alerts they name (``details['lead_alert']``),
  the ORANGE+ alerts that closed since the last calm check, and, with ``remedies=``,
  the alerts whose remedy the guard applies (a group YELLOW that names the cause the
  remedy treats: its onset is the fault's). An alert that closed without
  escalating is not in the chain; the monitor opens a new alert (a new episode,
  with its own onset) when a condition that had cleared holds again, and an alert
  the guard saw stop holding (its ``clearing_since`` set) and hold again counts
  from the check it held again, so a closed noise YELLOW never moves the target. ``k``, the margin of one host
  cadence, takes the target older than the last check before ``E``: the metrics
  seen at a check may come from any update since the previous check (that
  check's own included: its effect shows from the next step), so the checkpoint
  of that check may hold a faulty update and the one before is taken; this also
  holds when ``E`` lies between the guard's checks (a change point, or a monitor
  fed more often than the guard acts). ``rewind_steps=N`` also requires
  ``step <= E - N``. Corrupt candidates are quarantined (one log line each,
  ``checkpoint_corrupt`` alerts) and the next older one is tried.
- **Pins**: the newest healthy checkpoint, every rollback target, and the newest
  healthy checkpoint before each open alert's earliest sign (and, with
  ``rewind_steps=N``, the healthy ones of the last ``N`` steps and the newest
  before them) are pinned: retention never deletes them (the store logs what it keeps and why).
- **Quarantine**: the checkpoints after the target up to the red step are sick:
  quarantined, kept for a post-mortem (the newest ``keep_quarantined``), never
  restored by a rollback or :meth:`resume`.
- **Relapse**: red again without a healthy check since the previous rollback:
  the previous target is suspect (quarantined, reason ``relapse``) and an older
  healthy checkpoint is used; if there is none, the suspect is used anyway.
- **Actions after the restore**, each recorded in :attr:`history` (``actions``)
  and in the ``rollback`` event: the LR scale x ``lr_factor`` (compounding; the
  optimizer must be wrapped with :func:`jvitals.with_lr_scale`); ``skip_data``
  (``True``: advance the data position by as many batches as were consumed
  between the target and the red step, i.e. past a bad stretch as long again;
  an int ``N``: by ``N`` batches; the position must then be an int); and
  ``reset_optimizer`` (zero the Adam moments ``mu``/``nu`` of the named
  parameter groups; the count is reset too when every moment of every
  parameter is reset: a fresh Adam); then, with ``remedies=``, the remedy of each
  alert's cause (:mod:`jvitals.guard.remedies`: the alert's group LR x0.5, layer-wise
  LR decay, the QK-clip and z-loss flags in :attr:`Rollback.remedies`), each an
  action ``{"action": "remedy", "text": ...}`` named in the rollback alert's
  message ("applied: embedding LR x0.5"). The flags are saved with every
  checkpoint and restored by :meth:`resume`.
- **The limit**: red after ``max_rollbacks`` rollbacks raises
  :class:`RollbackLimitError` after quarantining the checkpoints saved from the
  fault's earliest sign on; the error names the healthy checkpoints on disk,
  which a restart (:meth:`resume`, a larger ``max_rollbacks``) continues from.
- **Resume** restores the newest healthy checkpoint (of the checkpoints and the
  snapshots), skipping quarantined ones and ones saved during an open ORANGE/RED
  period, and logs which and why.
- **Snapshots** (``snapshots=Snapshots(every=50, keep=2)``): light, frequent,
  asynchronous checkpoints in a second store (local disk, the newest ``keep``
  plus pinned ones) between the cadence checkpoints; they are candidates for a
  rollback and a resume like any other healthy checkpoint.
- **The guard's figures**: with ``writer=`` every call writes
  ``rollback/count`` and ``rollback/lr_scale`` and the guard's events
  (``vitals/events_json``: rollback, save, pause, checkpoint_skipped) through
  :func:`jvitals.write`, at the call's step.
- **Multi-host**: every process calls ``respond``; process 0's level, earliest
  sign and cutoff decide for all (``process_allgather``, which also checks that
  all processes are at the same step). Restores are agreed on. Each process's
  data position is saved and given back to it.

Example (the loop of USER-LOOP.md)::

    tx = vitals.with_lr_scale(optax.chain(vitals.record(optax.clip_by_global_norm(1.0)),
                                          optax.adamw(schedule)))
    monitor = vitals.Monitor()
    guard = vitals.Rollback(ckpt_dir, writer=writer)
    state, position = guard.resume(state, position, monitor)
    for step in range(int(state.step), num_steps):
        state, metrics = train_step(state, loader.batch(position)); position += 1
        if step % 50 == 0:
            verdict = monitor.update(step, jax.device_get(metrics))
            vitals.write(writer, step, host, verdict)
            state = guard.respond(step, state, verdict, position)
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any, Callable, Iterable

import numpy as np

from jvitals.monitor.types import Alert, Level
from jvitals.guard.actions import check_lr_scale, parse_reset, reset_adam_moments  # noqa: F401 - re-exported
from jvitals.guard.alertlog import AlertLog
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
    allgather_json,
)
from jvitals.guard.events import ROLLBACK_COUNT, ROLLBACK_LR_SCALE, write_events
from jvitals.guard.preemption import PREEMPT, Preempts, Preemption
from jvitals.guard.remedies import parse_remedies, remedied_ids
from jvitals.guard.response import (
    Action,
    Response,
    RollbackError,
    RollbackLimitError,
    Snapshots,
    TrainingPaused,
    alert_lines,
    check_position,
    make_alert,
    save_failed_alert,
)
from jvitals.guard.restore import Restores
from jvitals.guard.stores import Stores
from jvitals.guard.target import cutoff_before, is_healthy, level_name, pins

__all__ = [
    "Action",
    "CheckpointInfo",
    "CheckpointSaveError",
    "QUARANTINE_FILE",
    "Response",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "Snapshots",
    "TrainingPaused",
]

_log = logging.getLogger("jvitals.guard.rollback")


# ----------------------------------------------------------------------------
# Small helpers.
# ----------------------------------------------------------------------------


def _check_args(*, save_every: int, lr_factor: float, max_rollbacks: int | None, pause: Any,
                onset_margin: int, rewind_steps: int | None, skip_data: Any,
                snapshots: "Snapshots | None", on_save_error: str = "continue") -> None:
    """Raises a ValueError naming the first :class:`Rollback` argument out of range."""
    if on_save_error not in ("continue", "raise"):
        raise ValueError(f"Rollback expects on_save_error='continue' or 'raise', got {on_save_error!r}")
    if int(save_every) < 1:
        raise ValueError(f"Rollback expects save_every >= 1, got {save_every}")
    if not 0.0 < float(lr_factor) <= 1.0:
        raise ValueError(f"Rollback expects 0 < lr_factor <= 1, got {lr_factor}")
    if max_rollbacks is not None and int(max_rollbacks) < 0:
        raise ValueError(f"Rollback expects max_rollbacks >= 0 or None, got {max_rollbacks}")
    if not (pause in ("return", "raise") or callable(pause)):
        raise ValueError(f"Rollback expects pause='return', 'raise' or a callable, got {pause!r}")
    if int(onset_margin) < 0:
        raise ValueError(f"Rollback expects onset_margin >= 0, got {onset_margin}")
    if rewind_steps is not None and int(rewind_steps) < 0:
        raise ValueError(f"Rollback expects rewind_steps >= 0 or None, got {rewind_steps}")
    if not (isinstance(skip_data, bool) or (isinstance(skip_data, int) and skip_data >= 0)):
        raise ValueError(f"Rollback expects skip_data=False, True or an int >= 0, got {skip_data!r}")
    if snapshots is not None and (int(snapshots.every) < 1 or int(snapshots.keep) < 1):
        raise ValueError(f"Rollback expects Snapshots(every >= 1, keep >= 1), got {snapshots}")


# ----------------------------------------------------------------------------
# The guard.
# ----------------------------------------------------------------------------


class Rollback(Restores, Preempts):
    """Saves on a cadence, pauses on orange, rolls back on red (see module doc).

    Args:
      directory: the checkpoint directory (created if missing; any path orbax accepts).
      save_every: cadence in steps: a checkpoint at the first call and whenever
        ``step // save_every`` grows.
      keep_last: the newest cadence/rollback checkpoints kept (and the newest of any kind).
      keep_every: cadence checkpoints on multiples of this are kept for good (None: none).
      keep_green: the newest healthy GREEN checkpoints kept beyond ``keep_last``.
      keep_quarantined: the newest quarantined (sick) checkpoints kept for a post-mortem.
      lr_factor: LR scale multiplier per rollback (1.0: leave the LR alone, and no
        :func:`~jvitals.with_lr_scale` is needed).
      max_rollbacks: rollbacks allowed in the run (None: no limit); one more red
        raises :class:`RollbackLimitError`.
      healthy_levels: saved levels a rollback may restore.
      pause: on orange: ``'return'`` (action PAUSE), ``'raise'``
        (:class:`TrainingPaused`) or a callable taking the :class:`Response`.
      monitor: the Monitor whose ``state_dict`` is saved and whose
        ``note_rollback`` is called (also set by :meth:`resume`).
      save_on_rollback: checkpoint the restored state at the red step.
      step_attr: the train state's step field kept forward by a rollback (None:
        leave the restored one).
      sync_save: wait for each save to land (errors at the save call; slower).
      check_finite: reject targets holding non-finite values.
      onset_margin: the least margin in steps before the earliest sign (one host
        cadence, back to the last check before it, is used when larger).
      rewind_steps: restore a checkpoint at least this many steps before the
        earliest sign (the guide: "roll back 10-100 steps before the spike"; None:
        the newest healthy one).
      skip_data: ``False`` (default, the guide: keep the data position), ``True``
        (skip as many batches again as were consumed between the target and the
        red step) or an int ``N`` (skip ``N`` batches); the position must be an int.
        Read the new position from ``guard.position`` (or ``Response.position``).
      reset_optimizer: Adam moments to zero after the restore: ``('nu',)``,
        ``('mu', 'nu')`` (every parameter), or per parameter group
        ``{path_regex: ('mu', 'nu')}`` (matched with ``re.search`` against the
        ``/``-joined parameter path, e.g. ``'embed'``). None: keep them.
      snapshots: a :class:`Snapshots` for light recent snapshots (None: none).
      writer: a clu ``MetricWriter`` (or anything with its ``write_*`` methods):
        the guard writes its figures and events through :func:`jvitals.write`.
      remedies: None (only the LR x ``lr_factor``), ``"default"`` (the table of
        :data:`jvitals.guard.remedies.DEFAULT_REMEDIES`: a group's update-ratio or
        grad-share alert -> that group's LR x0.5; a layer's -> layer-wise LR decay
        0.9; attention logits -> QK-clip at their pre-fault value; output logits
        -> z-loss), or a dict ``{rule id or metric regex: remedy name or
        callable}`` (see :func:`jvitals.guard.remedies.parse_remedies`). Applied at
        each rollback after the restore, on top of ``lr_factor`` (pass
        ``lr_factor=1.0`` for the remedy alone).
      on_save_error: a save that fails (full disk, permissions, I/O error):
        ``'continue'`` (one error line naming the directory, step and error, a
        ``checkpoint_save_failed`` alert and event; training goes on and the last
        good checkpoint stays the one a rollback or restart uses; the next cadence
        save tries again) or ``'raise'`` (:class:`CheckpointSaveError`: the loop stops).
      preemption: what :meth:`preempted` watches: True (SIGTERM on one process, JAX's
        preemption notice under ``jax.distributed``), a :class:`Preemption` (other
        signals), or False (never preempted).

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
      snapshot_store: the store of the snapshots (None without ``snapshots``).
      remedies: the remedies' flags for the loop (a plain JSON dict, saved with
        each checkpoint, restored by :meth:`resume`): ``"qk_clip_tau"`` (call
        :func:`jvitals.qk_clip` with it), ``"z_loss"`` (the weight of
        :func:`jvitals.z_loss`), ``"layer_decay"`` and ``"lr_groups"`` (the
        group LR scales the guard set, kept in force over later restores).

    Raises:
      CheckpointSaveError: the directory cannot be created or written.
      ValueError: an argument is out of range.
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 500,
                 keep_last: int = 5, keep_every: int | None = 5000, keep_green: int = 1,
                 keep_quarantined: int = 3, lr_factor: float = 0.9,
                 max_rollbacks: int | None = 3,
                 healthy_levels: Iterable[int] = (Level.GREEN, Level.YELLOW),
                 pause: str | Callable[[Response], Any] = "return", monitor: Any = None,
                 save_on_rollback: bool = True, step_attr: str | None = "step",
                 sync_save: bool = False, check_finite: bool = True, onset_margin: int = 1,
                 rewind_steps: int | None = None, skip_data: bool | int = False,
                 reset_optimizer: Any = None, snapshots: Snapshots | None = None,
                 writer: Any = None, remedies: Any = None, on_save_error: str = "continue",
                 preemption: Preemption | bool = True) -> None:
        self.remedy_table = parse_remedies(remedies)
        _check_args(save_every=save_every, lr_factor=lr_factor, max_rollbacks=max_rollbacks, pause=pause,
                    onset_margin=onset_margin, rewind_steps=rewind_steps, skip_data=skip_data,
                    snapshots=snapshots, on_save_error=on_save_error)
        self.on_save_error = on_save_error
        self.preemption = preemption if isinstance(preemption, Preemption) else (
            Preemption() if preemption else None)
        self.save_every = int(save_every)
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = None if max_rollbacks is None else int(max_rollbacks)
        self.healthy_levels = frozenset(int(x) for x in healthy_levels)
        self.pause = pause
        self.monitor = monitor
        self.save_on_rollback = bool(save_on_rollback)
        self.step_attr = step_attr
        self.sync_save = bool(sync_save)
        self.check_finite = bool(check_finite)
        self.onset_margin = int(onset_margin)
        self.rewind_steps = None if rewind_steps is None else int(rewind_steps)
        self.skip_data = skip_data
        self.reset_optimizer = parse_reset(reset_optimizer)
        self.snapshots = snapshots
        self.writer = writer
        self._init_bookkeeping()
        self._disk = Stores(directory, snapshots, healthy_levels=self.healthy_levels, keep_last=keep_last,
                            keep_every=keep_every, keep_green=keep_green, keep_quarantined=keep_quarantined)
        self.store, self.snapshot_store = self._disk.main, self._disk.snapshots
        self.directory = self.store.directory
        self._collect_failures()
        regular = [r.step for r in self.store.checkpoints if r.kind in (CADENCE, ROLLBACK_SAVE, MANUAL)
                   and r.quarantined is None]
        self._last_regular = max(regular) if regular else None
        self._found_at_open = self._disk.latest_step()

    def _init_bookkeeping(self) -> None:
        """The public record (actions, history, alerts, events) and the guard's own state."""
        self.last_action: Action | None = None
        self.last_response: Response | None = None
        self.lr_scale = 1.0
        self.history: list[dict[str, Any]] = []
        self.remedies: dict[str, Any] = {}
        self.alerts: list[Alert] = []
        self.events: list[dict[str, Any]] = []
        self.position: Any = None
        self.resumed_step: int | None = None
        self._pending: list[Alert] = []
        self._pending_events: list[dict[str, Any]] = []
        self._last_regular: int | None = None
        self._last_snapshot: int | None = None
        self._last_healthy_check: int | None = None
        self._orange_saved = False
        self._level = int(Level.GREEN)
        self._preempted_at: int | None = None
        self._lr_checked = False
        self._resumed = False
        self._warned_no_resume = False
        self._checks: collections.deque[int] = collections.deque(maxlen=4096)
        self._log = AlertLog()
        self._open_peak = int(Level.GREEN)

    # -- Public API. -------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Records of the checkpoints on disk (not the snapshots), oldest first."""
        return self.store.checkpoints

    @property
    def snapshot_checkpoints(self) -> list[CheckpointInfo]:
        """Records of the snapshots on disk, oldest first (empty without ``snapshots``)."""
        return self.snapshot_store.checkpoints if self.snapshot_store is not None else []

    @property
    def quarantined(self) -> dict[int, str]:
        """``{step: reason}`` of the checkpoints (not snapshots) that are never restored."""
        return self.store.quarantined

    @property
    def level(self) -> Level:
        """The level the guard last acted on (process 0's; :meth:`resume` brings it back)."""
        return Level(self._level)

    @property
    def pins(self) -> dict[int, str]:
        """``{step: why}`` of the checkpoints retention never deletes."""
        return dict(self.store.pins)

    def metrics(self) -> dict[str, float]:
        """Scalars to log at any step: ``rollback/count`` and ``rollback/lr_scale``."""
        return {ROLLBACK_COUNT: float(len(self.history)), ROLLBACK_LR_SCALE: float(self.lr_scale)}

    def respond(self, step: int, state: Any, verdict: Any, position: Any = None) -> Any:
        """Acts on ``verdict`` and returns the state to continue with.

        See :meth:`act`; this returns only ``act(...).state`` (the action is in
        :attr:`last_action`, the data position to continue from in :attr:`position`).
        """
        return self.act(step, state, verdict, position).state

    def act(self, step: int, state: Any, verdict: Any, position: Any = None) -> Response:
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
          RollbackLimitError: red after ``max_rollbacks`` rollbacks.
          RollbackError: red and no healthy checkpoint before the earliest sign.
          TrainingPaused: orange with ``pause='raise'`` (after the save).
          CheckpointSaveError: a save failed, with ``on_save_error='raise'`` (the state
            is untouched; by default the failure is one error line and an alert).
        """
        step = int(step)
        check_position(position)
        if self.skip_data is not False and not isinstance(position, (int, np.integer)):
            raise TypeError(f"Rollback(skip_data={self.skip_data!r}) expects an int data position "
                            f"(batches consumed), got {type(position).__name__} {position!r}; pass "
                            "an int, or skip_data=False and skip in your loader.")
        self._log.observe(step, verdict)
        self._checks.append(step)
        level, sign, cutoff = self._decide(step, verdict)
        self._level = level
        self._check_lr_scale(state)
        if not self._resumed and self._found_at_open is not None and not self._warned_no_resume:
            self._warned_no_resume = True
            _log.warning("Rollback: %s already held checkpoints up to step %d but resume() "
                         "was not called; starting fresh alongside them.",
                         self.directory, self._found_at_open)
        self._settle(poll=True)
        alerts = self._drain()
        open_peak = max(self._open_peak, level)
        self.position = position
        if level in self.healthy_levels:
            self._last_healthy_check = step
        if level >= Level.RED:
            response = self._rollback(step, state, verdict, position, sign, cutoff, alerts)
        elif level == Level.ORANGE:
            saved = None
            if not self._orange_saved:
                self._orange_saved = True
                saved = self._save(step, state, position, level, ORANGE_SAVE, open_peak=open_peak)
                self._event({"event": "pause", "step": step, "saved_step": saved})
            response = Response(Action.PAUSE, state, step, saved, None, self.lr_scale,
                                tuple(alerts + self._drain()), self.metrics(),
                                tuple(self._drain_events()), position)
        else:
            self._orange_saved = False
            saved = snap = None
            if self._cadence_due(step):
                saved = self._save(step, state, position, level, CADENCE, open_peak=open_peak)
            elif self._snapshot_due(step) and open_peak < Level.ORANGE:
                snap = self._save(step, state, position, level, SNAPSHOT, open_peak=open_peak)
            response = Response(Action.SAVED if saved is not None or snap is not None else Action.CONTINUE,
                                state, step, saved, None, self.lr_scale, tuple(alerts + self._drain()),
                                self.metrics(), tuple(self._drain_events()), position, snap)
        self._update_pins(verdict)
        self._done(response)
        self._write(step, response)
        if response.action is Action.PAUSE:
            self._pause(response, verdict)
        return response

    def save(self, step: int, state: Any, position: Any = None, *, level: int = Level.GREEN) -> int | None:
        """Saves a checkpoint now (kind ``'manual'``), e.g. at the end of training.

        Returns:
          The step saved, or None if a usable checkpoint of that step exists.
        """
        return self._save(int(step), state, position, int(level), MANUAL)

    def restore(self, step: int, state: Any) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint (or snapshot) ``step`` onto ``state``'s structure and shardings.

        For inspection (a post-mortem of a quarantined checkpoint too); the guard's
        own bookkeeping is not changed.

        Returns:
          ``(state, metadata)``.
        """
        return self._disk.holding(int(step)).restore(int(step), state)

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
            self._settle()
        finally:
            if self.preemption is not None:
                self.preemption.close()
            self._disk.close()

    def __enter__(self) -> "Rollback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- Decisions. --------------------------------------------------

    def _decide(self, step: int, verdict: Any) -> tuple[int, int, int]:
        """Process 0's (level, earliest sign, cutoff), the same on every process (and its
        open peak level, in ``_open_peak``)."""
        level = int(getattr(verdict, "level", Level.GREEN)) if verdict is not None else int(Level.GREEN)
        sign = self._log.chain_sign(verdict, step, self._remedied(verdict)) if level >= Level.RED else step
        rows = allgather_ints([step, level, sign, cutoff_before(sign, self._checks, self.onset_margin),
                             self._log.open_peak(verdict)])
        if (rows[:, 0] != rows[0, 0]).any():
            raise RuntimeError(
                f"Rollback: processes called respond at different steps {rows[:, 0].tolist()}; "
                "expected every process at the same step. Call respond at the same steps on "
                "every process.")
        self._open_peak = int(rows[0, 4])
        return int(rows[0, 1]), int(rows[0, 2]), int(rows[0, 3])

    def _remedied(self, verdict: Any) -> set[int]:
        """Ids of the verdict's alerts (open, and closed at this check) whose cause has a
        remedy in the guard's table: the alerts :func:`apply_remedies` acts on."""
        if not self.remedy_table or verdict is None:
            return set()
        return remedied_ids(list(getattr(verdict, "alerts", None) or []) + list(
            getattr(verdict, "closed_alerts", None) or []), self.remedy_table)

    def _cadence_due(self, step: int) -> bool:
        last = self._last_regular
        return last is None or step // self.save_every > last // self.save_every

    def _snapshot_due(self, step: int) -> bool:
        if self.snapshot_store is None:
            return False
        every = int(self.snapshots.every)  # type: ignore[union-attr]
        last = max((x for x in (self._last_snapshot, self._last_regular) if x is not None), default=None)
        return last is None or step // every > last // every

    def _update_pins(self, verdict: Any) -> None:
        """Sets the stores' pins (:func:`jvitals.guard.target.pins`), process 0's for all
        (preemption checkpoints are never rollback targets: not pinned as one)."""
        keep = pins(self.history, [r for r in self._disk.records() if r.kind != PREEMPT],
                    open_alerts=self._log.open_records(verdict),
                    checks=list(self._checks), onset_margin=self.onset_margin,
                    healthy_levels=self.healthy_levels, rewind_steps=self.rewind_steps)
        self._disk.set_pins(keep)

    # -- Orange. -----------------------------------------------------

    def _pause(self, response: Response, verdict: Any) -> None:
        if self.pause == "return":
            return
        if self.pause == "raise":
            where = (f"checkpoint saved as step {response.saved_step}" if response.saved_step is not None
                     else "this orange episode was already saved")
            raise TrainingPaused(
                f"Rollback: training paused at step {response.step} on ORANGE "
                f"({alert_lines(getattr(verdict, 'alerts', []) or [])}); {where} in "
                f"{str(self.directory)!r}. Fix the cause, then restart and call guard.resume() "
                "(it resumes from the newest healthy checkpoint).",
                step=response.step, saved_step=response.saved_step,
                alerts=getattr(verdict, "alerts", []) or [], response=response)
        self.pause(response)

    # -- Saving. -----------------------------------------------------

    def _save(self, step: int, state: Any, position: Any, level: int, kind: str,
              restored_from: int | None = None, open_peak: int = 0) -> int | None:
        position = check_position(position)
        store = self.snapshot_store if kind == SNAPSHOT else self.store
        assert store is not None
        positions = allgather_json(position)
        meta = {
            "position": positions[0], "positions": positions,
            "monitor": self.monitor.state_dict() if self.monitor is not None and hasattr(
                self.monitor, "state_dict") else None,
            "rollback_count": len(self.history), "rollbacks": self.history,
            "remedies": self.remedies, "guard": self._guard_state(step, kind),
        }
        self._settle([store])              # an earlier save's failure first: this one is still tried
        saved, failed = None, False
        try:
            saved = store.save(step, state, meta, level=level, kind=kind, open_peak=open_peak,
                               provenance=Provenance(restored_from, self.lr_scale), sync=self.sync_save)
        except CheckpointSaveError as e:
            failed = True
            self._save_failed(e)
        if saved is not None or failed:    # failed: the next try is at the next cadence
            if kind in (CADENCE, ROLLBACK_SAVE, MANUAL):
                self._last_regular = step
            if kind == SNAPSHOT:
                self._last_snapshot = step
        if saved is not None:
            self._event({"event": "save" if kind != SNAPSHOT else "snapshot", "step": step,
                         "kind": kind, "level": level_name(level)})
        return saved

    def _guard_state(self, step: int, kind: str) -> dict[str, Any]:
        """The guard's own state once a save of ``kind`` at ``step`` is done, for the
        metadata: :meth:`resume` reads it back, so a resumed run saves, pins and picks
        rollback targets as the uninterrupted run would."""
        return {"last_regular": step if kind in (CADENCE, ROLLBACK_SAVE, MANUAL) else self._last_regular,
                "last_snapshot": step if kind == SNAPSHOT else self._last_snapshot,
                "last_healthy_check": self._last_healthy_check, "orange_saved": self._orange_saved,
                "level": self._level, "open_peak": self._open_peak, "checks": list(self._checks),
                "alerts": self._log.state_dict()}

    def _settle(self, stores: Iterable[Any] | None = None, poll: bool = False) -> None:
        """Waits for the stores' pending saves (``poll``: only finished ones, without
        blocking); a failed one goes to :meth:`_save_failed`."""
        for s in list(stores) if stores is not None else self._disk.all():
            try:
                s.poll() if poll else s.wait()
            except CheckpointSaveError as e:
                self._save_failed(e)

    def _save_failed(self, e: CheckpointSaveError) -> None:
        """A save that failed: raised (``on_save_error='raise'``), or one error line, an
        alert and an event, and training goes on from the in-memory state."""
        if self.on_save_error == "raise":
            raise e
        good = [r.step for r in self._disk.records() if is_healthy(r, self.healthy_levels)]
        alert = save_failed_alert(e, newest_good=max(good) if good else None, every=self.save_every)
        _log.error("%s", alert.message)
        self._pending.append(alert)
        self._event({"event": "save_failed", "step": e.step, "directory": e.directory,
                     "error": alert.details["error"]})

    # -- Small helpers. ----------------------------------------------

    def _check_lr_scale(self, state: Any) -> None:
        if not self._lr_checked:
            check_lr_scale(state, self.lr_factor)
            self._lr_checked = True

    def _collect_failures(self) -> None:
        """Turns the stores' skipped checkpoints into alerts and events (one each)."""
        for s, step, reason in self._disk.failures():
            self._pending.append(make_alert(
                "checkpoint_corrupt", "checkpoint/corrupt", Level.YELLOW, step, step, step,
                f"[YELLOW] {s.name[:-1]} of step {step} in {str(s.directory)!r} cannot be used "
                f"({reason}); skipped and quarantined.", {"reason": reason}))
            self._event({"event": "checkpoint_skipped", "step": step, "store": s.name, "reason": reason})

    def _event(self, e: dict[str, Any]) -> None:
        self._pending_events.append(e)
        self.events.append(e)

    def _drain(self) -> list[Alert]:
        self._collect_failures()
        out, self._pending = self._pending, []
        return out

    def _drain_events(self, keep: bool = False) -> list[dict[str, Any]]:
        out = list(self._pending_events)
        if not keep:
            self._pending_events = []
        return out

    def _done(self, response: Response) -> None:
        self.alerts.extend(response.alerts)
        self.last_response = response
        self.last_action = response.action

    def _write(self, step: int, response: Response) -> None:
        if self.writer is None:
            return
        write_events(self.writer, step, response.metrics, response.events)
