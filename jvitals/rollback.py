"""The red response: orbax-backed checkpoints, pause, and automatic rollback.

:class:`Rollback` is the one place in jvitals that acts on a verdict. Each call
of :meth:`Rollback.respond` (at the host's check cadence) does one of::

    verdict level      action     what happens
    GREEN / YELLOW     SAVED      save on the cadence (first call, then each time the
                                  step crosses a multiple of ``save_every``)
                       CONTINUE   otherwise
    ORANGE             PAUSE      save now (off-cadence too; once per orange episode),
                                  then pause as asked: 'return' (the loop decides),
                                  'raise' (:class:`TrainingPaused`) or a callable
    RED                ROLLBACK   restore the newest healthy checkpoint saved before
                                  the anomaly's onset, learning rate x ``lr_factor``,
                                  data position unchanged

Checkpoints are orbax ``CheckpointManager`` steps (async saves) holding two items:
``state`` (the whole train state pytree: params, optimizer state including the
recorder's, step; ``StandardSave``) and ``meta`` (JSON: the health level at save
time, the kind of save, the monitor's ``state_dict``, every process's data
position, the LR scale, the rollback history and the quarantine list).

Decisions (each is tested):

- **Checkpoint numbers** are the ``step`` passed to ``respond`` (the loop's step
  counter; the state inside holds whatever the user's step field says, usually
  ``step + 1`` after ``train_step``). After a rollback the numbering keeps going
  forward: the params and optimizer state come from the old checkpoint, but the
  step counter and the data position do not go back. With ``step_attr`` (default
  ``"step"``) the restored state's step field is set back to the current one, so
  ``for step in range(int(state.step), ...)`` never replays numbers. Orbax
  silently skips a save at a step <= its latest and refuses an existing step;
  forward numbering avoids both, and every save is checked to have landed.
- **The rollback is itself checkpointed** (``save_on_rollback=True``): the
  restored state, with the lower LR scale and the *current* data position, is
  saved as step ``S`` (the red step, kind ``"rollback"``). A crash right after a
  rollback therefore resumes rolled back, with the data position kept.
- **Rollback target**: the newest checkpoint with ``step < onset - onset_margin``,
  and older than the previous check when the onset is one of the guard's checks
  and the host checks every ``k > 1`` steps (an onset seen at a check may come
  from any update since the previous check, that check's own update included)
  (``onset`` = ``verdict.onset_step``, or the red step when the verdict has none;
  ``onset_margin=1`` by default: the checkpoint of step ``s`` holds the update of
  step ``s``, first visible in the metrics of step ``s + 1``, so the checkpoint of
  ``onset - 1`` may hold the very update that caused the anomaly), whose saved
  level is in
  ``healthy_levels`` (GREEN, YELLOW), that is not quarantined, that restores
  without error on every process and whose floating-point leaves are finite.
  Corrupt candidates are quarantined, reported as ``checkpoint_corrupt`` alerts,
  and the next older one is tried.
- **Quarantine**: the checkpoints after the target (``target < step <= S``) are
  sick. They are *kept* on disk for a post-mortem (normal retention ages them out)
  but listed in ``<directory>/jvitals_quarantine.json`` (and in the metadata of
  every later checkpoint) and never restored again, neither by a rollback nor by
  :meth:`Rollback.resume`. A step number that is quarantined and reached again
  (only after a resume from an older checkpoint) is deleted and re-saved.
- **Relapse**: if the run goes red again without a single healthy check since the
  previous rollback, the previous target itself is suspect: it and the rollback
  checkpoints restored from it are quarantined (reason ``relapse``) and an older
  healthy checkpoint is used; if there is none, the suspect is used anyway.
- **Learning rate**: the optimizer must be wrapped with
  :func:`jvitals.with_lr_scale`; each rollback multiplies the scale by
  ``lr_factor`` (compounding: 0.9, 0.81, ...), writes it into the restored
  ``opt_state`` (same dtype and sharding: no retrace) and saves it in the
  metadata. The optimizer's own counts (schedule position, Adam bias correction)
  roll back with its moments.
- **Retention** (a custom orbax ``PreservationPolicy``): the newest ``keep_last``
  regular (cadence, rollback, manual) checkpoints; every cadence checkpoint on a
  multiple of ``keep_every`` (or the first one past it), for good; the newest
  ``keep_last`` checkpoints of any kind (orange saves); and the newest
  ``keep_green`` checkpoints saved at GREEN and not quarantined, so that a slow
  divergence that stayed yellow for long still has a healthy target.
- **Multi-host**: every process calls ``respond`` with its own verdict; process
  0's level and onset are used by all (``process_allgather``, which also checks
  that all processes are at the same step), so host-local figures such as
  throughput can never split a run. Restores are agreed on (one failure anywhere
  is a failure everywhere). Each process's data position is saved and given back
  to it on resume.
- **Faults**: a save killed midway leaves an orbax temporary directory that is
  never listed (and is cleaned when the next ``Rollback`` opens the directory); an
  unwritable directory or a full disk raises :class:`CheckpointSaveError` naming
  the directory and step, before orbax starts (a write probe), or, for an
  asynchronous write that fails later, at the next save, :meth:`Rollback.wait`
  or :meth:`Rollback.close` (``sync_save=True`` raises in the save call itself).
  The caller's train state is never modified.

Example (the loop of USER-LOOP.md)::

    tx = vitals.with_lr_scale(optax.chain(vitals.record(optax.clip_by_global_norm(1.0)),
                                          optax.adamw(schedule)))
    monitor = vitals.Monitor()
    guard = vitals.Rollback(ckpt_dir)
    state, position = guard.resume(state, position, monitor)
    for step in range(int(state.step), num_steps):
        state, metrics = train_step(state, loader.batch(position)); position += 1
        if step % 50 == 0:
            verdict = monitor.update(step, jax.device_get(metrics))
            state = guard.respond(step, state, verdict, position)
            if guard.last_action is vitals.Action.PAUSE:
                ...   # the loop decides what pausing means
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import datetime
import enum
import json
import logging
import math
import os
import weakref
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jvitals._monitor_types import PRESCRIPTIONS, RULE_PRESCRIPTION, Alert, Level
from jvitals.lr_scale import has_lr_scale, set_lr_scale

__all__ = [
    "Action",
    "CheckpointInfo",
    "CheckpointSaveError",
    "Response",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "TrainingPaused",
]

_log = logging.getLogger("jvitals.rollback")

QUARANTINE_FILE = "jvitals_quarantine.json"
_META_FORMAT = "jvitals.Rollback"
_META_VERSION = 1

CADENCE, ORANGE_SAVE, ROLLBACK_SAVE, MANUAL = "cadence", "orange", "rollback", "manual"
_REGULAR = (CADENCE, ROLLBACK_SAVE, MANUAL)


class Action(enum.Enum):
    """What :meth:`Rollback.act` did."""

    CONTINUE = "continue"   # nothing to do at this step
    SAVED = "saved"         # a cadence checkpoint was written
    PAUSE = "pause"         # orange: a checkpoint was written; the loop should pause
    ROLLBACK = "rollback"   # red: the returned state is a restored healthy one
    RESUMED = "resumed"     # resume() restored a checkpoint


class Response(NamedTuple):
    """The result of :meth:`Rollback.act`.

    Attributes:
      action: what happened.
      state: the train state to continue with (the input one unless ROLLBACK or
        RESUMED).
      step: the step the call was made at.
      saved_step: the checkpoint written by this call, or None.
      target_step: the checkpoint restored (ROLLBACK, RESUMED), or None.
      lr_scale: the learning-rate scale in force after the call.
      alerts: alerts raised by the guard at this call (``rule`` ``'rollback'``,
        ``'checkpoint_corrupt'``).
      metrics: ``rollback/*`` scalars to log (see :meth:`Rollback.metrics`).
    """

    action: Action
    state: Any
    step: int
    saved_step: int | None
    target_step: int | None
    lr_scale: float
    alerts: tuple[Alert, ...]
    metrics: dict[str, float]


@dataclasses.dataclass
class CheckpointInfo:
    """What the guard knows about one checkpoint on disk.

    Attributes:
      step: the checkpoint's step number.
      level: the verdict level when it was saved (-1: unknown, unreadable).
      kind: ``'cadence'``, ``'orange'``, ``'rollback'`` or ``'manual'``.
      lr_scale: the LR scale saved with it.
      restored_from: for a ``'rollback'`` checkpoint, the step whose params it holds.
      quarantined: why it must never be restored (None: usable).
    """

    step: int
    level: int
    kind: str
    lr_scale: float = 1.0
    restored_from: int | None = None
    quarantined: str | None = None


class RollbackError(RuntimeError):
    """A red verdict that cannot be answered with a rollback."""


class RollbackLimitError(RollbackError):
    """The run went red again after ``max_rollbacks`` rollbacks.

    Attributes:
      step: the step of the red verdict.
      history: the previous rollbacks (dicts with ``step``, ``to_step``, ``onset_step``,
        ``lr_scale``, ``alerts``).
      alerts: the red verdict's alerts.
      position: the data position at the red step.
    """

    def __init__(self, message: str, *, step: int, history: list[dict[str, Any]],
                 alerts: Sequence[Any], position: Any) -> None:
        super().__init__(message)
        self.step, self.history, self.alerts, self.position = step, history, list(alerts), position


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (unwritable directory, full disk, ...).

    The caller's train state is untouched. Attributes: ``directory``, ``step``.
    """

    def __init__(self, message: str, *, directory: str, step: int | None) -> None:
        super().__init__(message)
        self.directory, self.step = directory, step


class TrainingPaused(Exception):
    """Raised by ``respond`` on orange when ``pause='raise'``, after the save.

    Attributes: ``step``, ``saved_step`` (the checkpoint written, or None if this
    orange episode was already saved), ``alerts`` (the verdict's), ``response``.
    """

    def __init__(self, message: str, *, step: int, saved_step: int | None,
                 alerts: Sequence[Any], response: Response) -> None:
        super().__init__(message)
        self.step, self.saved_step, self.alerts, self.response = step, saved_step, list(alerts), response


# ----------------------------------------------------------------------------
# Multi-process helpers (no-ops on one process).
# ----------------------------------------------------------------------------


def _allgather_ints(values: Sequence[int]) -> np.ndarray:
    """``[process_count, len(values)]`` int32: every process's ``values``."""
    row = np.asarray(values, np.int32)
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def _agree(ok: bool) -> bool:
    """True only if ``ok`` is true on every process."""
    return bool(_allgather_ints([int(bool(ok))]).min())


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _allgather_json(obj: Any) -> list[Any]:
    """Every process's ``obj`` (JSON-serialisable), in process order."""
    text = json.dumps(obj, default=_json_default)
    if jax.process_count() == 1:
        return [json.loads(text)]
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    n = int(_allgather_ints([data.size]).max())
    rows = _allgather_ints(np.pad(data, (0, n - data.size), constant_values=-1).tolist())
    return [json.loads(bytes(r[r >= 0].astype(np.uint8).tolist()).decode()) for r in rows]


# ----------------------------------------------------------------------------
# Pytree helpers.
# ----------------------------------------------------------------------------


def _abstract(tree: Any) -> Any:
    """Restore target: jax.Arrays become ShapeDtypeStructs with their sharding."""
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(leaf, tree)


def _all_finite(tree: Any) -> bool:
    """True if every floating-point leaf of ``tree`` is finite (one host read)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)]
    if not flags:
        return True
    return bool(jax.device_get(jnp.all(jnp.stack(flags))))


def _get_field(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(name, None)
    return getattr(state, name, None)


def _set_field(state: Any, name: str, value: Any) -> Any:
    if isinstance(state, Mapping):
        if name not in state:
            return state
        out = dict(state)
        out[name] = value
        return type(state)(out) if type(state) is not dict else out
    if not hasattr(state, name):
        return state
    if hasattr(state, "_replace"):          # NamedTuple
        return state._replace(**{name: value})
    if hasattr(state, "replace"):           # flax.struct / TrainState
        return state.replace(**{name: value})
    if dataclasses.is_dataclass(state):
        return dataclasses.replace(state, **{name: value})
    return state


def _level_name(level: int) -> str:
    try:
        return Level(level).name
    except ValueError:
        return "UNKNOWN"


def _alert_lines(alerts: Iterable[Any], limit: int = 5) -> str:
    lines = [getattr(a, "message", str(a)).split("\n")[0] for a in list(alerts)[:limit]]
    return "; ".join(lines) if lines else "(no alerts)"


# ----------------------------------------------------------------------------
# Retention.
# ----------------------------------------------------------------------------


class _Retention:
    """Orbax ``PreservationPolicy`` reading the guard's checkpoint records."""

    def __init__(self, guard: "Rollback") -> None:
        self._guard = guard

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
        del context
        g = self._guard
        steps = [int(c.step) for c in checkpoints]
        return [s in g._steps_to_keep(steps) for s in steps]


# ----------------------------------------------------------------------------
# The guard.
# ----------------------------------------------------------------------------


class Rollback:
    """Saves on a cadence, pauses on orange, rolls back on red (see module doc).

    Args:
      directory: the checkpoint directory (created if missing; any path orbax
        accepts).
      save_every: cadence in steps: a checkpoint at the first call and whenever
        ``step // save_every`` grows (exact multiples when ``respond`` is called at
        a divisor of it).
      keep_last: the newest cadence/rollback checkpoints kept (and the newest of
        any kind).
      keep_every: cadence checkpoints on multiples of this are kept for good
        (None: none).
      keep_green: the newest checkpoints saved at GREEN (not quarantined) kept
        beyond ``keep_last``.
      lr_factor: LR scale multiplier per rollback (1.0: leave the LR alone, and no
        :func:`~jvitals.with_lr_scale` is needed).
      max_rollbacks: rollbacks allowed in the run (None: no limit); one more red
        raises :class:`RollbackLimitError`.
      healthy_levels: saved levels a rollback may restore.
      pause: on orange: ``'return'`` (action PAUSE), ``'raise'``
        (:class:`TrainingPaused`) or a callable taking the :class:`Response`.
      monitor: the Monitor whose ``state_dict`` is saved and whose
        ``note_rollback`` is called (also set by :meth:`resume`).
      save_on_rollback: checkpoint the restored state at the red step (see module
        doc).
      step_attr: the train state's step field kept forward by a rollback (None:
        leave the restored one).
      sync_save: wait for each save to land (errors at the save call; slower).
      check_finite: reject rollback targets holding non-finite values.
      onset_margin: a rollback target's step must be ``< onset - onset_margin``.

    Attributes:
      last_action: the :class:`Action` of the latest call (None before any).
      last_response: the latest :class:`Response`.
      lr_scale: the LR scale in force (compounded over rollbacks).
      history: the rollbacks so far (dicts; saved in the metadata).
      alerts: every alert the guard raised, oldest first.
      resumed_step: the checkpoint :meth:`resume` restored (None: fresh start).

    Raises:
      CheckpointSaveError: the directory cannot be created or written.
      ValueError: an argument is out of range.
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 500,
                 keep_last: int = 5, keep_every: int | None = 5000, keep_green: int = 1,
                 lr_factor: float = 0.9, max_rollbacks: int | None = 3,
                 healthy_levels: Iterable[int] = (Level.GREEN, Level.YELLOW),
                 pause: str | Callable[[Response], Any] = "return", monitor: Any = None,
                 save_on_rollback: bool = True, step_attr: str | None = "step",
                 sync_save: bool = False, check_finite: bool = True,
                 onset_margin: int = 1) -> None:
        if int(save_every) < 1:
            raise ValueError(f"Rollback expects save_every >= 1, got {save_every}")
        if int(keep_last) < 1:
            raise ValueError(f"Rollback expects keep_last >= 1, got {keep_last}")
        if keep_every is not None and int(keep_every) < 1:
            raise ValueError(f"Rollback expects keep_every >= 1 or None, got {keep_every}")
        if not 0.0 < float(lr_factor) <= 1.0:
            raise ValueError(f"Rollback expects 0 < lr_factor <= 1, got {lr_factor}")
        if max_rollbacks is not None and int(max_rollbacks) < 0:
            raise ValueError(f"Rollback expects max_rollbacks >= 0 or None, got {max_rollbacks}")
        if not (pause in ("return", "raise") or callable(pause)):
            raise ValueError(f"Rollback expects pause='return', 'raise' or a callable, got {pause!r}")
        self.save_every = int(save_every)
        self.keep_last = int(keep_last)
        self.keep_every = None if keep_every is None else int(keep_every)
        self.keep_green = int(keep_green)
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

        self.last_action: Action | None = None
        self.last_response: Response | None = None
        self.lr_scale = 1.0
        self.history: list[dict[str, Any]] = []
        self.alerts: list[Alert] = []
        self.resumed_step: int | None = None
        self._pending: list[Alert] = []
        self._last_regular: int | None = None
        self._last_healthy_check: int | None = None
        self._orange_saved = False
        self._lr_checked = False
        self._resumed = False
        self._warned_no_resume = False
        self._unsaved_step: int | None = None   # the async save not yet known to have landed
        self._checks: collections.deque[int] = collections.deque(maxlen=4096)  # steps of act()

        self.directory = epath.Path(directory)
        try:
            self._mngr = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    create=True,
                    cleanup_tmp_directories=True,
                    enable_async_checkpointing=True,
                    async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                    preservation_policy=_Retention(self),
                ),
            )
        except Exception as e:  # noqa: BLE001 - reported with the directory
            raise CheckpointSaveError(
                f"Rollback: cannot use {str(self.directory)!r} as a checkpoint directory "
                f"({type(e).__name__}: {e}). Expected a writable directory (or a path where "
                "one can be created); pass another directory.",
                directory=str(self.directory), step=None) from e
        self._records: dict[int, CheckpointInfo] = {}
        self._load_records()
        self._found_at_open = max(self._records) if self._records else None
        atexit.register(_wait_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------
    # Public API.
    # ------------------------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Records of the checkpoints on disk, oldest first."""
        return [self._records[s] for s in sorted(self._records)]

    @property
    def quarantined(self) -> dict[int, str]:
        """``{step: reason}`` of the checkpoints that are never restored."""
        return {s: r.quarantined for s, r in sorted(self._records.items()) if r.quarantined}

    def metrics(self) -> dict[str, float]:
        """Scalars to log at any step: ``rollback/count`` and ``rollback/lr_scale``."""
        return {"rollback/count": float(len(self.history)), "rollback/lr_scale": float(self.lr_scale)}

    def resume(self, state: Any, position: Any = None, monitor: Any = None) -> tuple[Any, Any]:
        """Restores the newest usable checkpoint, if any (after a crash or a restart).

        Picks the newest checkpoint that is not quarantined and restores on every
        process (a corrupt one is quarantined, reported in :attr:`alerts`, and the
        previous one tried); whatever its level (a paused orange run resumes where it
        paused). Loads the monitor's state from it into ``monitor``, and the LR scale
        and rollback history into the guard.

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
        self._wait_saves()
        found = None
        for rec in sorted(self._usable(), key=lambda r: -r.step):
            got = self._try_restore(rec.step, state, finite=False)
            if got is not None:
                found = (rec, *got)
                break
        if found is None:
            self._respond_done(Response(Action.CONTINUE, state, -1, None, None, self.lr_scale,
                                        tuple(self._drain()), self.metrics()))
            return state, position
        rec, restored, meta = found
        if self.monitor is not None and meta.get("monitor") is not None:
            _load_monitor(self.monitor, meta["monitor"])
        self.lr_scale = float(meta.get("lr_scale", 1.0))
        self.history = list(meta.get("rollbacks", []))
        self.resumed_step = rec.step
        self._last_regular = rec.step
        # A checkpoint saved at a healthy level is a healthy check (for relapse detection).
        checks = [r.step for r in self._records.values() if r.step <= rec.step
                  and r.level in self.healthy_levels and r.kind != ROLLBACK_SAVE]
        self._last_healthy_check = max(checks) if checks else None
        self._orange_saved = rec.kind == ORANGE_SAVE
        positions = meta.get("positions")
        if isinstance(positions, list) and len(positions) == jax.process_count():
            position = positions[jax.process_index()]
        else:
            position = meta.get("position")
        self._respond_done(Response(Action.RESUMED, restored, rec.step, None, rec.step,
                                    self.lr_scale, tuple(self._drain()), self.metrics()))
        return restored, position

    def respond(self, step: int, state: Any, verdict: Any, position: Any = None) -> Any:
        """Acts on ``verdict`` and returns the state to continue with.

        See :meth:`act`; this returns only ``act(...).state`` (the action is in
        :attr:`last_action`).
        """
        return self.act(step, state, verdict, position).state

    def act(self, step: int, state: Any, verdict: Any, position: Any = None) -> Response:
        """Saves, pauses or rolls back according to ``verdict``.

        Args:
          step: the loop's step (the checkpoint number); same on every process,
            increasing.
          state: the current train state (any pytree; never modified).
          verdict: this process's ``Monitor.update`` result (None: GREEN). On
            several processes, process 0's level and onset decide for all.
          position: the data position after this step (JSON-serialisable); saved,
            and kept through a rollback.

        Returns:
          A :class:`Response`; its ``state`` is the restored one on ROLLBACK.

        Raises:
          RollbackLimitError: red after ``max_rollbacks`` rollbacks.
          RollbackError: red and no healthy checkpoint before the onset.
          TrainingPaused: orange with ``pause='raise'`` (after the save).
          CheckpointSaveError: a save failed (the state is untouched).
        """
        step = int(step)
        _check_position(position)
        level, onset = self._decide(step, verdict)
        self._checks.append(step)
        self._check_lr_scale(state)
        if not self._resumed and self._found_at_open is not None and not self._warned_no_resume:
            self._warned_no_resume = True
            _log.warning("Rollback: %s already held checkpoints up to step %d but resume() "
                         "was not called; starting fresh alongside them.",
                         self.directory, self._found_at_open)
        self._poll_saves()
        alerts = self._drain()
        if level >= Level.RED:
            response = self._rollback(step, state, verdict, position, onset, alerts)
        elif level == Level.ORANGE:
            saved = None
            if not self._orange_saved:
                saved = self._save(step, state, position, level, ORANGE_SAVE)
                self._orange_saved = True
            response = Response(Action.PAUSE, state, step, saved, None, self.lr_scale,
                                tuple(alerts + self._drain()), self.metrics())
        else:
            self._orange_saved = False
            saved = None
            if self._cadence_due(step):
                saved = self._save(step, state, position, level, CADENCE)
            response = Response(Action.SAVED if saved is not None else Action.CONTINUE, state,
                                step, saved, None, self.lr_scale, tuple(alerts + self._drain()),
                                self.metrics())
        if level in self.healthy_levels:
            self._last_healthy_check = step
        self._respond_done(response)
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
        """Restores checkpoint ``step`` onto ``state``'s structure and shardings.

        For inspection (a post-mortem of a quarantined checkpoint too); the guard's
        own bookkeeping is not changed.

        Returns:
          ``(state, metadata)``.
        """
        self._wait_saves()
        out = self._mngr.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(state)), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def wait(self) -> None:
        """Blocks until pending saves have landed.

        Raises:
          CheckpointSaveError: an asynchronous save failed.
        """
        self._wait_saves()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        try:
            self._wait_saves()
        finally:
            self._mngr.close()

    def __enter__(self) -> "Rollback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------
    # Decisions.
    # ------------------------------------------------------------------

    def _decide(self, step: int, verdict: Any) -> tuple[int, int]:
        """Process 0's (level, onset), the same on every process."""
        level = int(getattr(verdict, "level", Level.GREEN)) if verdict is not None else int(Level.GREEN)
        onset = getattr(verdict, "onset_step", None) if verdict is not None else None
        onset = step if onset is None else int(onset)
        rows = _allgather_ints([step, level, onset])
        if (rows[:, 0] != rows[0, 0]).any():
            raise RuntimeError(
                f"Rollback: processes called respond at different steps {rows[:, 0].tolist()}; "
                "expected every process at the same step. Call respond at the same steps on "
                "every process.")
        return int(rows[0, 1]), int(rows[0, 2])

    def _cadence_due(self, step: int) -> bool:
        last = self._last_regular
        return last is None or step // self.save_every > last // self.save_every

    def _usable(self, allow_suspect: bool = False) -> list[CheckpointInfo]:
        return [r for r in self._records.values()
                if r.quarantined is None or (allow_suspect and r.quarantined.startswith("relapse"))]

    def _steps_to_keep(self, steps: Sequence[int]) -> set[int]:
        ordered = sorted(steps)
        rec = self._records
        keep = set(ordered[-self.keep_last:])
        regular = [s for s in ordered if s in rec and rec[s].kind in _REGULAR]
        keep |= set(regular[-self.keep_last:])
        if self.keep_every:
            prev = None
            for s in (s for s in ordered if s in rec and rec[s].kind == CADENCE):
                if s % self.keep_every == 0 or (prev is not None and s // self.keep_every > prev // self.keep_every):
                    keep.add(s)
                prev = s
        if self.keep_green > 0:
            green = [s for s in ordered if s in rec and rec[s].level == Level.GREEN
                     and rec[s].quarantined is None]
            keep |= set(green[-self.keep_green:])
        return keep

    # ------------------------------------------------------------------
    # Red.
    # ------------------------------------------------------------------

    def _cutoff(self, onset: int) -> int:
        """A rollback target's step must be below this.

        The checkpoint of step ``s`` holds the update of step ``s``, first seen in
        the metrics of the next *check*. When the onset is itself one of this
        guard's checks and the host checks every ``k > 1`` steps, the anomaly may
        come from any update since the previous check (that check's own update
        included), so the target must be older than the previous check. Otherwise
        (the monitor is fed more often than the guard acts, or no earlier check is
        known): ``onset - onset_margin``.
        """
        cutoff = onset - self.onset_margin
        if onset in self._checks:
            before = [c for c in self._checks if c < onset]
            if before:
                cutoff = min(cutoff, max(before))
        return cutoff

    def _rollback(self, step: int, state: Any, verdict: Any, position: Any, onset: int,
                  alerts: list[Alert]) -> Response:
        verdict_alerts = list(getattr(verdict, "alerts", []) or [])
        if self.max_rollbacks is not None and len(self.history) >= self.max_rollbacks:
            done = ", ".join(f"{h['step']}->{h['to_step']}" for h in self.history) or "none"
            raise RollbackLimitError(
                f"Rollback: {len(self.history)} rollback(s) already (steps {done}; LR scale now "
                f"{self.lr_scale:.4g}) and the run went red again at step {step} (onset "
                f"{onset}): {_alert_lines(verdict_alerts)}. max_rollbacks={self.max_rollbacks} "
                f"reached: lower the learning rate further or inspect the data at position "
                f"{position!r}; the healthy checkpoints are in {str(self.directory)!r} "
                f"(quarantined: {sorted(self.quarantined)}).",
                step=step, history=list(self.history), alerts=verdict_alerts, position=position)
        self._wait_saves()
        if self.history and (self._last_healthy_check is None
                             or self._last_healthy_check <= self.history[-1]["step"]):
            prev = self.history[-1]
            reason = (f"relapse: red again at step {step} without a healthy check since the "
                      f"rollback at step {prev['step']} to step {prev['to_step']}")
            for r in self._records.values():
                if r.quarantined is None and (r.step == prev["to_step"]
                                              or r.restored_from == prev["to_step"]):
                    r.quarantined = reason
        found = None
        cutoff = self._cutoff(onset)
        for allow_suspect in (False, True):
            candidates = [r for r in self._usable(allow_suspect)
                          if r.step < cutoff and r.level in self.healthy_levels]
            for rec in sorted(candidates, key=lambda r: -r.step):
                got = self._try_restore(rec.step, state, finite=self.check_finite)
                if got is not None:
                    found = (rec, *got)
                    break
            if found is not None:
                break
        if found is None:
            listing = ", ".join(f"{r.step}:{_level_name(r.level)}"
                                + (f" (quarantined: {r.quarantined})" if r.quarantined else "")
                                for r in self.checkpoints) or "none"
            self._write_quarantine()
            raise RollbackError(
                f"Rollback: red at step {step} (onset {onset}) but no healthy checkpoint before "
                f"step {cutoff} in {str(self.directory)!r}; expected one saved at a level in "
                f"{sorted(_level_name(x) for x in self.healthy_levels)} that restores. On disk: "
                f"{listing}. Alerts: {_alert_lines(verdict_alerts)}. Save earlier (a smaller "
                "save_every, or a larger keep_last) or restart from an older run.")
        rec, restored, _meta = found
        alerts.extend(self._drain())            # corrupt candidates skipped on the way
        target = rec.step
        for r in self._records.values():
            if target < r.step <= step and r.quarantined is None:
                r.quarantined = (f"sick: after rollback target {target}; red at step {step} "
                                 f"(onset {onset})")
        new_scale = self.lr_scale * self.lr_factor
        if self.lr_factor != 1.0:
            restored = set_lr_scale(restored, new_scale)
        if self.step_attr is not None:
            current = _get_field(state, self.step_attr)
            if current is not None:
                restored = _set_field(restored, self.step_attr, current)
        self.lr_scale = new_scale
        self.history.append({"step": step, "to_step": target, "onset_step": onset,
                             "lr_scale": new_scale, "position": _jsonable(position),
                             "alerts": [_alert_lines([a]) for a in verdict_alerts[:5]]})
        note = None
        if self.monitor is not None and hasattr(self.monitor, "note_rollback"):
            note = self.monitor.note_rollback(step, target)
        alert = note if isinstance(note, Alert) else None
        message = (f"[RED] rolled back at step {step} (onset {onset}) to the healthy checkpoint "
                   f"of step {target}; LR scale {new_scale:.4g} (x{self.lr_factor} per rollback, "
                   f"{len(self.history)} so far); data position kept at {position!r}; "
                   f"quarantined: {sorted(self.quarantined)}. Cause: {_alert_lines(verdict_alerts, 2)}")
        alert = _make_alert("rollback", "rollback/count", Level.RED, step, len(self.history),
                            onset, message, {"to_step": target, "lr_scale": new_scale,
                                             "monitor_alert_id": getattr(alert, "id", None)})
        alerts.append(alert)
        self._write_quarantine()
        self._orange_saved = False
        saved = None
        if self.save_on_rollback:
            saved = self._save(step, restored, position, rec.level, ROLLBACK_SAVE, restored_from=target)
        metrics = {**self.metrics(), "rollback/from_step": float(step), "rollback/to_step": float(target)}
        return Response(Action.ROLLBACK, restored, step, saved, target, new_scale,
                        tuple(alerts + self._drain()), metrics)

    # ------------------------------------------------------------------
    # Orange.
    # ------------------------------------------------------------------

    def _pause(self, response: Response, verdict: Any) -> None:
        if self.pause == "return":
            return
        if self.pause == "raise":
            where = (f"checkpoint saved as step {response.saved_step}" if response.saved_step is not None
                     else "this orange episode was already saved")
            raise TrainingPaused(
                f"Rollback: training paused at step {response.step} on ORANGE "
                f"({_alert_lines(getattr(verdict, 'alerts', []) or [])}); {where} in "
                f"{str(self.directory)!r}. Fix the cause, then restart and call guard.resume().",
                step=response.step, saved_step=response.saved_step,
                alerts=getattr(verdict, "alerts", []) or [], response=response)
        self.pause(response)

    # ------------------------------------------------------------------
    # Saving.
    # ------------------------------------------------------------------

    def _save(self, step: int, state: Any, position: Any, level: int, kind: str,
              restored_from: int | None = None) -> int | None:
        existing = self._records.get(step)
        if existing is not None and existing.quarantined is None:
            _log.warning("Rollback: a usable checkpoint of step %d exists in %s; not saving it "
                         "again.", step, self.directory)
            return None
        position = _check_position(position)
        self._wait_saves()
        self._probe(step)
        if existing is not None or step in self._mngr.all_steps():
            self._mngr.delete(step)   # a quarantined step reached again: replace it
            self._records.pop(step, None)
        positions = _allgather_json(position)
        meta = {
            "format": _META_FORMAT, "version": _META_VERSION,
            "step": step, "level": int(level), "level_name": _level_name(level), "kind": kind,
            "position": positions[0], "positions": positions,
            "monitor": self.monitor.state_dict() if self.monitor is not None and hasattr(
                self.monitor, "state_dict") else None,
            "lr_scale": self.lr_scale, "rollback_count": len(self.history),
            "rollbacks": self.history, "restored_from": restored_from,
            "quarantine": {str(s): r for s, r in self.quarantined.items()},
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "process_count": jax.process_count(),
        }
        json.dumps(meta, default=_json_default)  # fail here, not in orbax's thread
        self._records[step] = CheckpointInfo(step, int(level), kind, self.lr_scale, restored_from)
        try:
            ok = self._mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - reported with the directory and step
            self._records.pop(step, None)
            raise self._save_error(step, e) from e
        if not ok:
            self._records.pop(step, None)
            raise CheckpointSaveError(
                f"Rollback: orbax did not save step {step} in {str(self.directory)!r} (latest "
                f"step {self._mngr.latest_step()}); expected every save to land. The train "
                "state is unchanged.", directory=str(self.directory), step=step)
        self._unsaved_step = step
        self._sync_records()
        if kind in _REGULAR:
            self._last_regular = step
        if self.sync_save:
            self._wait_saves()
        return step

    def _probe(self, step: int) -> None:
        """Fails fast (on every process) when the directory cannot take a checkpoint."""
        err = None
        probe = self.directory / f".jvitals_probe_{step}_{jax.process_index()}"
        try:
            if not self.directory.is_dir():
                raise NotADirectoryError(f"{str(self.directory)!r} is not a directory")
            probe.write_bytes(b"\0" * 4096)
        except Exception as e:  # noqa: BLE001
            err = e
        finally:
            try:
                if probe.exists():
                    probe.unlink()
            except Exception:  # noqa: BLE001
                pass
        if not _agree(err is None):
            raise self._save_error(step, err or RuntimeError("another process could not write"))

    def _save_error(self, step: int | None, e: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"Rollback: could not save the checkpoint of step {step} in "
            f"{str(self.directory)!r}: {type(e).__name__}: {e}. Expected a writable directory "
            "with free space; the in-memory train state is unchanged (nothing was restored or "
            "modified), so you can free space or fix permissions and keep training, or pass "
            "another directory.", directory=str(self.directory), step=step)

    def _wait_saves(self) -> None:
        err = None
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            err = e
        failed = self._unsaved_step
        if not _agree(err is None):
            if failed is not None:
                self._records.pop(failed, None)
            self._unsaved_step = None
            self._sync_records()
            if failed is not None and self._last_regular == failed:
                self._last_regular = None
            raise CheckpointSaveError(
                f"Rollback: the asynchronous save of step {failed} in {str(self.directory)!r} "
                f"failed: {type(err).__name__ if err else 'error on another process'}: {err}. "
                "Expected a writable directory with free space; the in-memory train state is "
                "unchanged; that checkpoint does not exist.",
                directory=str(self.directory), step=failed) from err
        self._unsaved_step = None

    def _poll_saves(self) -> None:
        """Surfaces a failed asynchronous save without blocking (single process)."""
        if jax.process_count() == 1 and self._unsaved_step is not None \
                and not self._mngr.is_saving_in_progress():
            self._wait_saves()

    def _sync_records(self) -> None:
        on_disk = set(int(s) for s in self._mngr.all_steps())
        for s in list(self._records):
            if s not in on_disk:
                del self._records[s]

    # ------------------------------------------------------------------
    # Restoring and the index.
    # ------------------------------------------------------------------

    def _try_restore(self, step: int, like: Any, *, finite: bool) -> tuple[Any, dict] | None:
        """Restores ``step`` (agreed by every process), or quarantines it and returns None."""
        err, out = None, None
        try:
            got = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()))
            out = (got["state"], dict(got["meta"]))
            if finite and not _all_finite(out[0]):
                raise ValueError("it holds non-finite values")
        except Exception as e:  # noqa: BLE001 - any failure makes the checkpoint unusable
            err = e
        if _agree(err is None):
            return out
        reason = (f"corrupt: {type(err).__name__}: {str(err)[:300]}" if err is not None
                  else "corrupt: failed to restore on another process")
        if err is not None and str(err) == "it holds non-finite values":
            reason = "non-finite values"
        self._records[step].quarantined = reason
        self._write_quarantine()
        self._pending.append(_make_alert(
            "checkpoint_corrupt", "checkpoint/corrupt", Level.YELLOW, step, step, step,
            f"[YELLOW] checkpoint of step {step} in {str(self.directory)!r} cannot be used "
            f"({reason}); skipped and quarantined, trying the previous one.", {"reason": reason}))
        _log.warning("Rollback: checkpoint %d skipped: %s", step, reason)
        return None

    def _load_records(self) -> None:
        quarantine = self._read_quarantine()
        for step in sorted(int(s) for s in self._mngr.all_steps()):
            try:
                meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                if not isinstance(meta, Mapping) or meta.get("format") != _META_FORMAT:
                    raise ValueError(f"not a jvitals checkpoint (metadata {str(meta)[:80]!r})")
                rec = CheckpointInfo(step, int(meta["level"]), str(meta["kind"]),
                                     float(meta.get("lr_scale", 1.0)), meta.get("restored_from"))
                for s, reason in (meta.get("quarantine") or {}).items():
                    quarantine.setdefault(int(s), reason)
            except Exception as e:  # noqa: BLE001 - unreadable metadata = unusable checkpoint
                rec = CheckpointInfo(step, -1, "unknown", quarantined=(
                    f"corrupt: metadata unreadable: {type(e).__name__}: {str(e)[:200]}"))
                self._pending.append(_make_alert(
                    "checkpoint_corrupt", "checkpoint/corrupt", Level.YELLOW, step, step, step,
                    f"[YELLOW] checkpoint of step {step} in {str(self.directory)!r} has unreadable "
                    f"metadata ({type(e).__name__}); it is never restored.", {"reason": rec.quarantined}))
            self._records[step] = rec
        for s, reason in quarantine.items():
            if s in self._records and self._records[s].quarantined is None:
                self._records[s].quarantined = reason
        regular = [s for s, r in self._records.items() if r.kind in _REGULAR and r.quarantined is None]
        self._last_regular = max(regular) if regular else None

    def _read_quarantine(self) -> dict[int, str]:
        path = self.directory / QUARANTINE_FILE
        try:
            if path.exists():
                data = json.loads(path.read_text())
                return {int(s): str(r) for s, r in data.get("steps", {}).items()}
        except Exception as e:  # noqa: BLE001
            _log.warning("Rollback: cannot read %s (%s); relying on checkpoint metadata", path, e)
        return {}

    def _write_quarantine(self) -> None:
        if jax.process_index() != 0:
            return
        steps = dict(self._read_quarantine())
        steps.update(self.quarantined)
        data = {"format": "jvitals.quarantine", "version": 1,
                "note": "checkpoints jvitals never restores (kept for a post-mortem)",
                "steps": {str(s): r for s, r in sorted(steps.items())}}
        path = self.directory / QUARANTINE_FILE
        tmp = self.directory / (QUARANTINE_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except Exception as e:  # noqa: BLE001 - the metadata keeps the list too
            _log.warning("Rollback: cannot write %s (%s)", path, e)

    # ------------------------------------------------------------------
    # Small helpers.
    # ------------------------------------------------------------------

    def _check_lr_scale(self, state: Any) -> None:
        if self._lr_checked or self.lr_factor == 1.0:
            return
        if not has_lr_scale(state):
            raise ValueError(
                f"Rollback(lr_factor={self.lr_factor}) expects the train state's optimizer to be "
                "wrapped with jvitals.with_lr_scale(tx) (an inject_hyperparams state holding "
                f"'lr_scale'), found none in the {type(state).__name__}. Build the optimizer as "
                "tx = jvitals.with_lr_scale(tx), or pass lr_factor=1.0 to keep the LR.")
        self._lr_checked = True

    def _drain(self) -> list[Alert]:
        out, self._pending = self._pending, []
        return out

    def _respond_done(self, response: Response) -> None:
        self.alerts.extend(response.alerts)
        self.last_response = response
        self.last_action = response.action


def _wait_at_exit(ref: "weakref.ref[Rollback]") -> None:
    """Lets an in-flight asynchronous save land when the program exits normally."""
    guard = ref()
    if guard is not None:
        try:
            guard._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - nothing left to raise to
            _log.error("Rollback: the last asynchronous save failed at exit: %s", e)


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=_json_default))


def _check_position(position: Any) -> Any:
    """``position`` as plain JSON types, or a TypeError saying what is accepted."""
    try:
        return _jsonable(position)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "Rollback: the data position must be JSON-serialisable (an int, or a dict/list of "
            f"ints, floats and strings), got {type(position).__name__}: {e}") from e


def _load_monitor(monitor: Any, d: Mapping[str, Any]) -> None:
    """Loads a monitor's saved state into ``monitor`` in place."""
    if hasattr(monitor, "load_state_dict"):
        monitor.load_state_dict(d)
        return
    fresh = type(monitor).from_state_dict(d)
    monitor.__dict__.update(fresh.__dict__)


def _make_alert(rule: str, metric: str, level: Level, step: int, value: float, onset: int,
                message: str, details: dict[str, Any]) -> Alert:
    pres = PRESCRIPTIONS[RULE_PRESCRIPTION.get(rule, "generic")]
    return Alert(id=-1, rule=rule, metric=metric, level=Level(level), step=int(step),
                 value=float(value), baseline=math.nan, ratio=math.nan, onset_step=int(onset),
                 opened_step=int(step), message=message, cause=pres.cause,
                 prescription=pres.prescription, localization=[], peak_level=Level(level),
                 closed_step=int(step), details=details)
