"""What :class:`jvitals.Rollback` returns and raises, and the text of its alerts.

:class:`Action` and :class:`Response` (the result of each call), :class:`Snapshots`
(its light snapshots' settings), the errors (:class:`RollbackError`,
:class:`RollbackLimitError`, :class:`TrainingPaused`), and the small helpers its
halves share (:mod:`jvitals.guard.rollback`, the decisions; :mod:`jvitals.guard.restore`,
the restores): an alert's one-line text, a position as JSON, the guard's own alerts.
"""

from __future__ import annotations

import enum
import errno
import json
import math
import operator
import os
import re
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from jvitals.monitor.types import PRESCRIPTIONS, RULE_PRESCRIPTION, Alert, Level
from jvitals.guard.checkpoints import CheckpointSaveError, json_default
from jvitals.guard.orbax_noise import one_line
from jvitals.guard.verdict import VerdictLike

__all__ = [
    "Action",
    "PauseOnOrange",
    "Response",
    "RollbackError",
    "RollbackLimitError",
    "Snapshots",
    "TrainingPaused",
    "alert_lines",
    "check_position",
    "check_step",
    "jsonable",
    "make_alert",
    "save_failed_alert",
]


class Action(enum.Enum):
    """What :meth:`Rollback.act` did."""

    CONTINUE = "continue"   # nothing to do at this step
    SAVED = "saved"         # a cadence checkpoint (or a snapshot) was written
    PAUSE = "pause"         # orange: a checkpoint was written; the loop should pause
    ROLLBACK = "rollback"   # red: the returned state is a restored healthy one
    RESUMED = "resumed"     # resume() restored a checkpoint


class Response(NamedTuple):
    """The result of :meth:`Rollback.act`.

    Attributes:
      action: what happened.
      state: the train state to continue with (the input one unless ROLLBACK or RESUMED).
      step: the step the call was made at.
      saved_step: the checkpoint written by this call, or None.
      target_step: the checkpoint restored (ROLLBACK, RESUMED), or None.
      lr_scale: the learning-rate scale in force after the call.
      alerts: alerts raised by the guard at this call (``rule`` ``'rollback'``,
        ``'checkpoint_corrupt'``).
      metrics: ``rollback/*`` scalars to log (see :meth:`Rollback.metrics`).
      events: the guard's events at this call (dicts with ``event`` and ``step``).
      position: the data position to continue from (the input one unless
        ``skip_data`` moved it, or RESUMED).
      snapshot_step: the snapshot written by this call, or None.
    """

    action: Action
    state: Any
    step: int
    saved_step: int | None
    target_step: int | None
    lr_scale: float
    alerts: tuple[Alert, ...]
    metrics: dict[str, float]
    events: tuple[dict[str, Any], ...] = ()
    position: Any = None
    snapshot_step: int | None = None


class Snapshots(NamedTuple):
    """Light recent snapshots between the cadence checkpoints.

    Attributes:
      every: steps between snapshots (a snapshot when ``step // every`` grows and
        no cadence checkpoint is written at that call).
      keep: snapshots kept (the newest; rollback targets are pinned beyond it).
      directory: where (a local disk is best); default ``<directory>/snapshots``.
    """

    every: int = 50
    keep: int = 2
    directory: str | os.PathLike | None = None


class RollbackError(RuntimeError):
    """A red verdict that cannot be answered with a rollback."""


class RollbackLimitError(RollbackError):
    """The run went red again after ``max_rollbacks`` rollbacks.

    Attributes:
      step: the step of the red verdict.
      history: the previous rollbacks (dicts with ``step``, ``to_step``, ``onset_step``,
        ``lr_scale``, ``recovery``, ``alerts``).
      alerts: the red verdict's alerts.
      position: the data position at the red step.
      healthy: the healthy checkpoints on disk a restart can continue from, newest first.
    """

    def __init__(self, message: str, *, step: int, history: list[dict[str, Any]],
                 alerts: Sequence[Any], position: Any, healthy: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step, self.history, self.alerts, self.position = step, history, list(alerts), position
        self.healthy = list(healthy)


class TrainingPaused(Exception):
    """Raised by ``respond`` on orange when ``Saving(pause='raise')``, after the save.

    Attributes: ``step``, ``saved_step`` (the checkpoint written, or None if this
    orange episode was already saved), ``alerts`` (the verdict's), ``response``.
    """

    def __init__(self, message: str, *, step: int, saved_step: int | None,
                 alerts: Sequence[Any], response: Response) -> None:
        super().__init__(message)
        self.step, self.saved_step, self.alerts, self.response = step, saved_step, list(alerts), response


class PauseOnOrange:
    """The response to ORANGE after its save: ``Saving(pause=)``.

    Args:
      how: ``'return'`` (the action PAUSE; the loop decides), ``'raise'``
        (:class:`TrainingPaused`) or a callable taking the :class:`Response`.

    (``Saving`` checks it.)
    """

    def __init__(self, how: Any = "return") -> None:
        self.how = how

    def __call__(self, response: "Response", verdict: VerdictLike | None, directory: Any) -> None:
        """Pauses as asked after ``response`` (a PAUSE) on ``verdict``."""
        if self.how == "return":
            return
        if self.how == "raise":
            alerts = list(verdict.alerts) if verdict is not None else []
            where = (f"checkpoint saved as step {response.saved_step}" if response.saved_step is not None
                     else "this orange episode was already saved")
            raise TrainingPaused(
                f"Rollback: training paused at step {response.step} on ORANGE "
                f"({alert_lines(alerts)}); {where} in "
                f"{str(directory)!r}. Fix the cause, then restart and call guard.resume() "
                "(it resumes from the newest healthy checkpoint).",
                step=response.step, saved_step=response.saved_step, alerts=alerts, response=response)
        self.how(response)


def alert_lines(alerts: Iterable[Any], limit: int = 5) -> str:
    lines = [getattr(a, "message", str(a)).split("\n")[0] for a in list(alerts)[:limit]]
    return "; ".join(lines) if lines else "(no alerts)"


def jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=json_default))


def check_position(position: Any) -> Any:
    """``position`` as plain JSON types, or a TypeError saying what is accepted."""
    try:
        return jsonable(position)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "Rollback: the data position must be JSON-serialisable (an int, or a dict/list of "
            f"ints, floats and strings), got {type(position).__name__}: {e}") from e


def check_step(step: Any, last: int | None, where: str = "Rollback.act") -> int:
    """``step`` as an int >= 0 that does not go back past ``last`` (the previous check's step;
    None after a rollback or a resume, which rewind the loop); else an error saying why."""
    try:
        if isinstance(step, (bool, np.bool_)):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"{where}: step must be an int (the loop's step, e.g. int(state.step)), got "
                        f"{type(step).__name__} {step!r:.40}; the step comes first: {where}(step, state, ...)") from None
    if step < 0:
        raise ValueError(f"{where}: step={step} must be >= 0 (it numbers the checkpoints)")
    if last is not None and step < last:
        raise ValueError(f"{where}: step {step} after step {last} goes back without a rollback or a resume; "
                         f"the guard numbers checkpoints by step. After a restart call guard.resume(state, "
                         f"position, monitor) first; else pass the loop's increasing step")
    return step


def make_alert(rule: str, metric: str, level: Level, step: int, value: float, onset: int,
                message: str, details: dict[str, Any]) -> Alert:
    pres = PRESCRIPTIONS[RULE_PRESCRIPTION.get(rule, "generic")]
    return Alert(id=-1, rule=rule, metric=metric, level=Level(level), step=int(step),
                 value=float(value), baseline=math.nan, ratio=math.nan, onset_step=int(onset),
                 opened_step=int(step), message=message, cause=pres.cause,
                 prescription=pres.prescription, localization=[], peak_level=Level(level),
                 closed_step=int(step), details=details)


_TS_OS_ERROR = re.compile(r"os_error_code='(\d+)'")   # how TensorStore names an OS error


def _os_error_number(err: BaseException | None) -> int | None:
    """The OS error number behind ``err`` along its causes: an ``OSError``'s ``errno``, or
    TensorStore's ``os_error_code='N'`` in an error's text (None: no OS error found)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno:
            return int(err.errno)
        m = _TS_OS_ERROR.search(str(err))
        if m:
            return int(m.group(1))
        err = err.__cause__ or err.__context__
    return None


def save_failed_alert(err: CheckpointSaveError, *, newest_good: int | None, every: int) -> Alert:
    """The guard's alert (YELLOW, rule ``'checkpoint_save_failed'``) for a save that
    failed while training goes on: the directory, the step, the error, the last good
    checkpoint and what to do, in one line (its ``message``; ``details['error']``).

    Args:
      err: the store's error (``directory``, ``step``; the OS or orbax error as its cause).
      newest_good: the newest healthy checkpoint on disk (None: none).
      every: the guard's ``save_every`` (when the next cadence save tries again).

    Returns:
      The :class:`Alert` (its ``details``: ``error``, ``directory``, ``newest_good``).
    """
    cause = err.__cause__
    error = f"{type(cause).__name__}: {one_line(cause)}" if cause is not None else one_line(err)
    # A full disk in the same words whichever write met it first (an array's, in TensorStore,
    # or a metadata file's, in Python).
    full = "the disk is full (errno 28, ENOSPC): " if _os_error_number(err) == errno.ENOSPC else ""
    good = (f"the last good checkpoint, step {newest_good}, is what a rollback or a restart uses"
            if newest_good is not None else "there is no good checkpoint yet (a restart starts over)")
    message = (f"[YELLOW] Rollback: could not save the checkpoint of step {err.step} in "
               f"{err.directory!r}: {full}{error}. Training continues; {good}; the next cadence save "
               f"(every {every} steps) tries again. Expected a writable directory with free space: "
               "free space or fix the permissions (Rollback(saving=Saving(on_save_error='raise')) stops the run "
               "instead).")
    step = -1 if err.step is None else int(err.step)
    return make_alert("checkpoint_save_failed", "checkpoint/save_failed", Level.YELLOW, step, step, step,
                      message, {"error": error, "directory": err.directory,
                                "newest_good": newest_good})
