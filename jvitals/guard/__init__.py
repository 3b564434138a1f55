"""The response: the only part of jvitals that acts on a verdict.

``rollback`` (the response policy: :class:`Rollback` decides to save, pause or
roll back), ``restore`` (its restores: a rollback's steps and a resume),
``target`` (the rollback target, a pure function of the alerts seen and the
checkpoints on disk: :func:`choose_target`), ``alertlog`` (the guard's record of
the monitor's alerts, by id), ``actions`` (the actions after a restore: LR scale,
Adam moments, data position), ``response`` (what the guard returns and raises),
``preemption`` (the notice that the machine goes away, and the save it
triggers: :class:`Preemption`), ``stores`` (the checkpoints and the snapshots as one), ``checkpoints`` (the orbax
store: levels, pins, quarantine, retention, resume), ``remedies`` (the table of
causes and the remedy the guard applies) and ``events`` (the names the guard
writes). Imports ``jvitals.monitor`` (levels, alerts) and ``jvitals.optim`` (the
LR scales it turns).
"""

from jvitals.guard.events import (
    EVENTS_TAG,
    json_default,
    ROLLBACK_COUNT,
    ROLLBACK_LR_SCALE,
    write_events,
)
from jvitals.guard.checkpoints import (
    CADENCE,
    CheckpointInfo,
    CheckpointSaveError,
    CheckpointStore,
    MANUAL,
    ORANGE_SAVE,
    QUARANTINE_FILE,
    quiet_orbax,
    ROLLBACK_SAVE,
    SNAPSHOT,
)
from jvitals.guard.configs import Actions, RestorePolicy, Retention, Saving
from jvitals.guard.preemption import PREEMPT, Preemption
from jvitals.guard.remedies import (
    applied_text,
    apply_remedies,
    Cause,
    causes_of,
    DEFAULT_REMEDIES,
    parse_remedies,
    reapply_lr_groups,
    REMEDY_NAMES,
    RemedyTable,
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
from jvitals.guard.target import AlertRecord, choose_target, Target

__all__ = [
    "Action",
    "Actions",
    "AlertRecord",
    "applied_text",
    "apply_remedies",
    "CADENCE",
    "Cause",
    "causes_of",
    "CheckpointInfo",
    "CheckpointSaveError",
    "CheckpointStore",
    "choose_target",
    "DEFAULT_REMEDIES",
    "EVENTS_TAG",
    "json_default",
    "MANUAL",
    "ORANGE_SAVE",
    "parse_remedies",
    "PREEMPT",
    "Preemption",
    "QUARANTINE_FILE",
    "quiet_orbax",
    "reapply_lr_groups",
    "REMEDY_NAMES",
    "RemedyTable",
    "Response",
    "RestorePolicy",
    "Retention",
    "Rollback",
    "ROLLBACK_COUNT",
    "ROLLBACK_LR_SCALE",
    "ROLLBACK_SAVE",
    "RollbackError",
    "RollbackLimitError",
    "Saving",
    "SNAPSHOT",
    "Snapshots",
    "Target",
    "TrainingPaused",
    "write_events",
]
