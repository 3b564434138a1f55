"""The response: the only part of jvitals that acts on a verdict (design: docs/GUARD.md).

:class:`Rollback` (``rollback``) decides to save, pause or roll back; it is composed of
parts, one module per idea: its settings (``configs``), its bookkeeping (``state``),
its saves (``saver``), its restores (``restore``, ``after_restore``, ``remedies``), the
rollback target (``target``: :func:`choose_target`, a pure function), the record of
the monitor's alerts (``alertlog``), what it returns and raises (``response``), the
preemption save (``preemption``: :class:`Preemption`), the stores (``stores``,
``checkpoints`` and its helpers) and the names it writes (``events``). The table of
parts is in docs/GUARD.md, "Parts". Imports ``jvitals.monitor`` (levels, alerts) and
``jvitals.optim`` (the LR scales it turns).
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
from jvitals.guard.configs import Recovery, RestorePolicy, Retention, Saving
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
    "Recovery",
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
