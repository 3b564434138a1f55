"""The response: the only part of jvitals that acts on a verdict.

``rollback`` (the response policy: save, pause, roll back with remedies),
``checkpoints`` (the orbax store: levels, pins, quarantine, retention, resume),
``remedies`` (the table of causes and the remedy the guard applies) and ``events``
(the names the guard writes). Imports ``jvitals.monitor`` (levels, alerts) and
``jvitals.optim`` (the LR scales it turns).
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
from jvitals.guard.rollback import (
    Action,
    Response,
    Rollback,
    RollbackError,
    RollbackLimitError,
    Snapshots,
    TrainingPaused,
)

__all__ = [
    "Action",
    "applied_text",
    "apply_remedies",
    "CADENCE",
    "Cause",
    "causes_of",
    "CheckpointInfo",
    "CheckpointSaveError",
    "CheckpointStore",
    "DEFAULT_REMEDIES",
    "EVENTS_TAG",
    "json_default",
    "MANUAL",
    "ORANGE_SAVE",
    "parse_remedies",
    "QUARANTINE_FILE",
    "quiet_orbax",
    "reapply_lr_groups",
    "REMEDY_NAMES",
    "RemedyTable",
    "Response",
    "Rollback",
    "ROLLBACK_COUNT",
    "ROLLBACK_LR_SCALE",
    "ROLLBACK_SAVE",
    "RollbackError",
    "RollbackLimitError",
    "SNAPSHOT",
    "Snapshots",
    "TrainingPaused",
    "write_events",
]
