"""jvitals: a JAX/Flax training run's vital signs, measured in the step, acted on by the host.

Device side (pure, traceable under ``jit``/``shard_map``/``pmap``): :func:`summarize`,
:func:`reduce`, the ``*_metrics`` functions, the probes and the optax recorder
:func:`record`. Host side: :class:`Monitor` (verdicts), :class:`Rollback`
(orbax checkpoints, pause, roll back), :func:`write` (clu writers), :class:`StepTimer`.
See ``docs/METRICS.md`` for every metric.
"""

from jvitals.activations import activation_metrics, bos_value_grad_metrics, mtp_metrics
from jvitals.gradients import global_norm, global_norm_metrics, gradient_metrics, update_metrics
from jvitals.host import StepTimer, device_memory_metrics
from jvitals.moe import MoEWindowState, moe_metrics, moe_window_init, moe_window_update
from jvitals.monitor import Alert, Level, Localization, Monitor, Policy, Spike, Verdict
from jvitals.optimizer import optimizer_metrics
from jvitals.probes import (
    LogitsSummary,
    attn_logits_probe,
    logits_probe,
    perturb_values,
    sow_summary,
    summarize_logits,
)
from jvitals.packed import PackedMetrics
from jvitals.record import RecordState, record, recorded, recorded_steps
from jvitals.lr_scale import get_lr_scale, set_lr_scale, with_lr_scale
from jvitals.rollback import (
    Action,
    CheckpointSaveError,
    Response,
    Rollback,
    RollbackError,
    RollbackLimitError,
    TrainingPaused,
)
from jvitals.roles import LeafRole, QKVSplit, Roles, RolesExplanation, assign_roles, explain_roles
from jvitals.stats import Summary, reduce, summarize
from jvitals.writers import write

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Alert",
    "CheckpointSaveError",
    "LeafRole",
    "Level",
    "Localization",
    "LogitsSummary",
    "MoEWindowState",
    "Monitor",
    "Policy",
    "QKVSplit",
    "RecordState",
    "Response",
    "Roles",
    "RolesExplanation",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "Spike",
    "StepTimer",
    "Summary",
    "TrainingPaused",
    "Verdict",
    "activation_metrics",
    "assign_roles",
    "attn_logits_probe",
    "bos_value_grad_metrics",
    "device_memory_metrics",
    "explain_roles",
    "get_lr_scale",
    "global_norm",
    "global_norm_metrics",
    "gradient_metrics",
    "logits_probe",
    "moe_metrics",
    "moe_window_init",
    "moe_window_update",
    "mtp_metrics",
    "optimizer_metrics",
    "perturb_values",
    "PackedMetrics",
    "record",
    "recorded",
    "recorded_steps",
    "reduce",
    "set_lr_scale",
    "sow_summary",
    "summarize",
    "summarize_logits",
    "update_metrics",
    "with_lr_scale",
    "write",
]
