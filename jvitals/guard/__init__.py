"""The response: the only part of jvitals that acts on a verdict (design: docs/GUARD.md).

``rollback`` (the response policy: :class:`Rollback` decides to save, pause or
roll back, composed of the parts below), ``configs`` (its settings, one frozen
config per idea: :class:`Retention`, :class:`RestorePolicy`, :class:`RollbackActions`,
:class:`Saving`, and the old keywords' map), ``state`` (its bookkeeping and
outbox), ``saver`` (its saves), ``restore`` (its restores: a rollback's steps, a
resume, the pins), ``target`` (the rollback target, a pure function of the alerts
seen and the checkpoints on disk: :func:`choose_target`), ``alertlog`` (the
guard's record of the monitor's alerts, by id), ``actions`` (the actions after a
restore: LR scale, Adam moments, data position), ``response`` (what the guard
returns and raises, and its orange pause), ``preemption`` (the notice that the
machine goes away, and the save it triggers: :class:`Preemption`), ``stores``
(the checkpoints and the snapshots as one), ``checkpoints`` (the orbax store:
levels, pins, quarantine, retention, resume), ``orbax_noise``,
``multiprocess`` and ``pytrees`` (the store's helpers), ``remedies`` (the table
of causes and the remedy the guard applies) and ``events`` (the names the guard
writes). Imports ``jvitals.monitor`` (levels, alerts) and ``jvitals.optim`` (the
LR scales it turns).
"""

from jvitals.guard.checkpoints import (
    CADENCE,
    CheckpointInfo,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointStore,
    MANUAL,
    ORANGE_SAVE,
    ROLLBACK_SAVE,
    SNAPSHOT,
)
from jvitals.guard.configs import RollbackActions, RestorePolicy, Retention, Saving
from jvitals.guard.preemption import PREEMPT, Preemption
from jvitals.guard.remedies import (
    Cause,
    DEFAULT_REMEDIES,
    REMEDY_NAMES,
)
from jvitals.guard.response import (
    Action,
    Response,
    RollbackError,
    RollbackLimitError,
    Snapshots,
    TrainingPaused,
)
from jvitals.guard.rollback import Rollback
from jvitals.guard.target import choose_target, Past, Target

__all__ = [
    "Action",
    "RollbackActions",
    "CADENCE",
    "Cause",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointStore",
    "choose_target",
    "DEFAULT_REMEDIES",
    "MANUAL",
    "ORANGE_SAVE",
    "Past",
    "PREEMPT",
    "Preemption",
    "REMEDY_NAMES",
    "Response",
    "RestorePolicy",
    "Retention",
    "Rollback",
    "ROLLBACK_SAVE",
    "RollbackError",
    "RollbackLimitError",
    "Saving",
    "SNAPSHOT",
    "Snapshots",
    "Target",
    "TrainingPaused",
]
