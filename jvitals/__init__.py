"""jvitals: a JAX/Flax training run's vital signs, measured in the step, acted on by the host.

Device side (pure, traceable under ``jit``/``shard_map``/``pmap``): :func:`summarize`,
:func:`reduce`, the ``*_metrics`` functions, the probes, :func:`instrument` (the
activation summaries of any Flax Linen model), the optax recorder :func:`record`
and the remedies (:func:`with_lr_scale` per group, :func:`layerwise_lr_decay`,
:func:`adaptive_clip`, :func:`z_loss`, :func:`qk_clip`). Host side: :class:`Monitor`
(a list of rules; verdicts), :class:`Rollback` (the response policy; with
``remedies="default"`` it applies the alert's remedy at a rollback) over a
:class:`CheckpointStore` (orbax checkpoints, pins, quarantine), :func:`write`
(clu writers), :class:`StepTimer`.
See ``docs/METRICS.md`` for every metric.
"""

from jvitals.activations import activation_metrics, bos_value_grad_metrics, mtp_metrics
from jvitals.checkpoints import CheckpointStore
from jvitals.clipping import AdaptiveClipState, adaptive_clip
from jvitals.gradients import global_norm, global_norm_metrics, gradient_metrics, update_metrics
from jvitals.host import StepTimer, device_memory_metrics
from jvitals.instrument import ExpertChoices, InstrumentReport, instrument
from jvitals.layer_decay import layer_decay_factors, layerwise_lr_decay
from jvitals.losses import z_loss
from jvitals.moe import MoEWindowState, moe_metrics, moe_window_init, moe_window_update
from jvitals.monitor import (
    Alert,
    Change,
    Figures,
    Level,
    Localization,
    Monitor,
    Policy,
    Spike,
    Verdict,
    default_rules,
)
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
from jvitals.qk_clip import qk_clip
from jvitals.record import RecordState, record, recorded, recorded_steps
from jvitals.lr_scale import LRGroupScaleState, get_lr_scale, get_lr_scales, set_lr_scale, with_lr_scale
from jvitals.remedies import DEFAULT_REMEDIES, REMEDY_NAMES, Cause
from jvitals.rollback import (
    Action,
    CheckpointSaveError,
    Response,
    Rollback,
    RollbackError,
    RollbackLimitError,
    Snapshots,
    TrainingPaused,
)
from jvitals.roles import LeafRole, QKVSplit, Roles, RolesExplanation, assign_roles, explain_roles
from jvitals.stats import Summary, reduce, summarize
from jvitals.writers import write

__version__ = "0.1.0"

__all__ = [
    "Action",
    "activation_metrics",
    "adaptive_clip",
    "AdaptiveClipState",
    "Alert",
    "assign_roles",
    "Cause",
    "attn_logits_probe",
    "bos_value_grad_metrics",
    "Change",
    "CheckpointSaveError",
    "CheckpointStore",
    "DEFAULT_REMEDIES",
    "default_rules",
    "device_memory_metrics",
    "ExpertChoices",
    "explain_roles",
    "Figures",
    "get_lr_scale",
    "get_lr_scales",
    "global_norm",
    "global_norm_metrics",
    "gradient_metrics",
    "instrument",
    "InstrumentReport",
    "layer_decay_factors",
    "layerwise_lr_decay",
    "LeafRole",
    "Level",
    "Localization",
    "logits_probe",
    "LogitsSummary",
    "LRGroupScaleState",
    "moe_metrics",
    "moe_window_init",
    "moe_window_update",
    "MoEWindowState",
    "Monitor",
    "mtp_metrics",
    "optimizer_metrics",
    "PackedMetrics",
    "perturb_values",
    "Policy",
    "qk_clip",
    "QKVSplit",
    "record",
    "recorded",
    "recorded_steps",
    "RecordState",
    "reduce",
    "REMEDY_NAMES",
    "Response",
    "Roles",
    "RolesExplanation",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "set_lr_scale",
    "Snapshots",
    "sow_summary",
    "Spike",
    "StepTimer",
    "summarize",
    "summarize_logits",
    "Summary",
    "TrainingPaused",
    "update_metrics",
    "Verdict",
    "with_lr_scale",
    "write",
    "z_loss",
]
