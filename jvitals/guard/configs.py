"""The guard's settings, one frozen config per idea (see docs/GUARD.md, "Settings").

:class:`jvitals.Rollback` is built from parts; each part's settings are a small
frozen dataclass with its own fields, defaults and validation (an error names
the config and the field): :class:`Retention` (which checkpoints are kept),
:class:`RestorePolicy` (which one a rollback or a resume restores),
:class:`Recovery` (what a rollback does after the restore) and
:class:`Saving` (when and how checkpoints are written). A keyword ``Rollback``
no longer takes is a TypeError naming its config (:data:`MOVED`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jvitals.guard.after_restore import parse_reset
from jvitals.guard.preemption import Preemption
from jvitals.guard.remedies import parse_remedies
from jvitals.guard.response import Snapshots
from jvitals.guard.target import RestorePolicy, fail as _fail

__all__ = ["MOVED", "Recovery", "RestorePolicy", "Retention", "Saving", "check_config", "refuse_moved"]


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which checkpoints the store keeps (orbax's preservation policy; pins aside).

    Attributes:
      keep_last: the newest checkpoints kept (of any kind, and the newest regular
        ones: cadence, rollback, manual). At least 1.
      keep_every: cadence checkpoints on multiples of this (or the first past one)
        are kept for good (None: none).
      keep_green: the newest healthy GREEN checkpoints kept beyond ``keep_last``.
      keep_quarantined: the newest quarantined (sick) checkpoints kept for a
        post-mortem (0: deleted at the next retention).
    """

    keep_last: int = 5
    keep_every: int | None = 5000
    keep_green: int = 1
    keep_quarantined: int = 3

    def __post_init__(self) -> None:
        if int(self.keep_last) < 1:
            _fail("Retention", "keep_last", ">= 1", self.keep_last)
        if self.keep_every is not None and int(self.keep_every) < 1:
            _fail("Retention", "keep_every", ">= 1 or None", self.keep_every)
        if int(self.keep_green) < 0:
            _fail("Retention", "keep_green", ">= 0", self.keep_green)
        if int(self.keep_quarantined) < 0:
            _fail("Retention", "keep_quarantined", ">= 0", self.keep_quarantined)


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What a rollback does after the restore, and how many it may do.

    Attributes:
      lr_factor: LR scale multiplier per rollback, compounding (1.0: leave the LR
        alone, and no :func:`~jvitals.with_lr_scale` is needed). In (0, 1].
      max_rollbacks: rollbacks allowed in the run (None: no limit); one more red
        raises :class:`jvitals.RollbackLimitError`.
      skip_data: ``False`` (keep the data position, the guide's default), ``True``
        (skip as many batches again as were consumed between the target and the
        red step) or an int ``N`` (skip ``N`` batches); the position must be an int.
      reset_optimizer: Adam moments to zero after the restore: ``('nu',)``,
        ``('mu', 'nu')`` (every parameter), or per parameter group
        ``{path_regex: ('mu', 'nu')}`` (``re.search`` on the ``/``-joined path).
        None: keep them.
      remedies: None (only the LR x ``lr_factor``), ``"default"``
        (:data:`jvitals.guard.remedies.DEFAULT_REMEDIES`) or a dict ``{rule id or
        metric regex: remedy name or callable}``
        (:func:`jvitals.guard.remedies.parse_remedies`); applied on top of ``lr_factor``.
      save_on_rollback: checkpoint the restored state at the red step (kind ``'rollback'``).
      step_attr: the train state's step field kept forward by a rollback (None:
        leave the restored one).
    """

    lr_factor: float = 0.9
    max_rollbacks: int | None = 3
    skip_data: bool | int = False
    reset_optimizer: Any = None
    remedies: Any = None
    save_on_rollback: bool = True
    step_attr: str | None = "step"

    def __post_init__(self) -> None:
        if not 0.0 < float(self.lr_factor) <= 1.0:
            _fail("Recovery", "lr_factor", "in (0, 1]", self.lr_factor)
        if self.max_rollbacks is not None and int(self.max_rollbacks) < 0:
            _fail("Recovery", "max_rollbacks", ">= 0 or None", self.max_rollbacks)
        skip = self.skip_data
        if not (isinstance(skip, bool) or (isinstance(skip, int) and skip >= 0)):
            _fail("Recovery", "skip_data", "False, True or an int >= 0", skip)
        parse_reset(self.reset_optimizer)       # raises a ValueError naming reset_optimizer
        parse_remedies(self.remedies)           # raises a ValueError naming the remedy


@dataclasses.dataclass(frozen=True)
class Saving:
    """How checkpoints are written (the cadence is ``Rollback(save_every=)``), and what
    follows the saves that stop the loop: the orange pause and the preemption save.

    Attributes:
      sync: wait for each save to land (errors at the save call; slower).
      on_save_error: a save that fails (full disk, permissions, I/O error):
        ``'continue'`` (one error line, a ``checkpoint_save_failed`` alert and
        event; training goes on; the next cadence save tries again) or ``'raise'``
        (:class:`jvitals.guard.CheckpointSaveError`: the loop stops).
      snapshots: a :class:`jvitals.Snapshots` for light recent snapshots between
        the cadence checkpoints (None: none).
      pause: on orange, after its save: ``'return'`` (the action PAUSE; the loop
        decides), ``'raise'`` (:class:`jvitals.TrainingPaused`) or a callable taking
        the :class:`jvitals.Response`.
      preemption: what :meth:`jvitals.Rollback.preempted` watches before its save:
        True (SIGTERM on one process, JAX's preemption notice under
        ``jax.distributed``), a :class:`jvitals.Preemption` (other signals), or
        False (never preempted).
    """

    sync: bool = False
    on_save_error: str = "continue"
    snapshots: Snapshots | None = None
    pause: Any = "return"
    preemption: bool | Preemption = True

    def __post_init__(self) -> None:
        if not (self.pause in ("return", "raise") or callable(self.pause)):
            _fail("Saving", "pause", "'return', 'raise' or a callable", self.pause)
        if self.on_save_error not in ("continue", "raise"):
            _fail("Saving", "on_save_error", "'continue' or 'raise'", self.on_save_error)
        snap = self.snapshots
        if snap is not None and (int(snap.every) < 1 or int(snap.keep) < 1):
            _fail("Saving", "snapshots", "Snapshots(every >= 1, keep >= 1)", snap)
        if not isinstance(self.preemption, (bool, Preemption)):
            raise TypeError(f"Saving expects preemption= True, False or a Preemption, got "
                            f"{type(self.preemption).__name__} {self.preemption!r}")


MOVED: dict[str, str] = {
    **{k: f"retention=Retention({k}=...)" for k in ("keep_last", "keep_every", "keep_green", "keep_quarantined")},
    **{k: f"restore=RestorePolicy({k}=...)" for k in ("healthy_levels", "check_finite", "onset_margin",
                                                       "rewind_steps")},
    **{k: f"recovery=Recovery({k}=...)" for k in ("lr_factor", "max_rollbacks", "skip_data",
                                                   "reset_optimizer", "remedies", "save_on_rollback",
                                                   "step_attr")},
    "actions": "recovery=Recovery(...)",
    "sync_save": "saving=Saving(sync=...)",
    **{k: f"saving=Saving({k}=...)" for k in ("on_save_error", "snapshots", "pause", "preemption")},
}
"""``{keyword Rollback no longer takes: where it is now}``: the text of the TypeError it raises."""


def refuse_moved(keywords: Mapping[str, Any]) -> None:
    """Raises a TypeError naming where each keyword of ``keywords`` that ``Rollback`` no
    longer takes is now (:data:`MOVED`); the others are left to Python's own check."""
    moved = [k for k in keywords if k in MOVED]
    if moved:
        raise TypeError("Rollback() no longer takes " + "; ".join(
            f"{k}=: pass {MOVED[k]}" for k in moved) + " (the configs are in docs/GUARD.md, \"Settings\")")


def check_config(name: str, value: Any, cls: type) -> None:
    """Raises a TypeError when ``Rollback``'s ``name=`` is not a ``cls``."""
    if not isinstance(value, cls):
        raise TypeError(f"Rollback expects {name}= a {cls.__name__}, got {type(value).__name__} {value!r:.80}")
