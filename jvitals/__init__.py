"""jvitals: a JAX/Flax training run's vital signs, measured in the step, acted on by the host.

The package is laid out as the data flows (imports run the same way, never back):

- :mod:`jvitals.metrics`, the device side (pure, traceable under ``jit``/``shard_map``/``pmap``):
  :func:`summarize`, :func:`reduce`, the ``*_metrics`` functions, the probes,
  :func:`instrument` (the activation summaries of any Flax Linen model), the optax
  recorder :func:`record`, :class:`StepTimer`.
- :mod:`jvitals.optim`, the optax remedies beside it: :func:`with_lr_scale` per group,
  :func:`layerwise_lr_decay`, :func:`adaptive_clip`, :func:`z_loss`, :func:`qk_clip`,
  :func:`skip_step`.
- :mod:`jvitals.monitor`, the host's judgement: :class:`Monitor` (a list of rules;
  verdicts), :class:`Policy`.
- :mod:`jvitals.guard`, the response: :class:`Rollback` (with ``remedies="default"`` it
  applies the alert's remedy at a rollback) over a :class:`CheckpointStore` (orbax
  checkpoints, pins, quarantine).
- :mod:`jvitals.report`, what a person reads: :func:`write` (clu writers), the HTML
  report and ``jvitals report LOGDIR``.

Every public name is re-exported here, flat, as optax does. See ``docs/METRICS.md``
for every metric and ``docs/LAYOUT.md`` for the layout.
"""

from jvitals.metrics import (
    activation_metrics,
    assign_roles,
    attn_logits_probe,
    bos_value_grad_metrics,
    device_memory_metrics,
    ExpertChoices,
    explain_roles,
    global_norm,
    global_norm_metrics,
    gradient_metrics,
    instrument,
    InstrumentReport,
    LeafRole,
    logits_probe,
    LogitsSummary,
    moe_metrics,
    moe_window_init,
    moe_window_update,
    MoEWindowState,
    mtp_metrics,
    optimizer_metrics,
    PackedMetrics,
    perturb_values,
    QKVSplit,
    record,
    recorded,
    recorded_steps,
    RecordState,
    reduce,
    replica_layout,
    replica_metrics,
    ReplicaLayout,
    ReplicaPlace,
    replica_window_init,
    replica_window_metrics,
    replica_window_update,
    ReplicaWindow,
    Roles,
    RolesExplanation,
    sow_summary,
    StepTimer,
    summarize,
    summarize_logits,
    Summary,
    update_metrics,
)
from jvitals.optim import (
    adaptive_clip,
    AdaptiveClipState,
    get_lr_scale,
    get_lr_scales,
    layer_decay_factors,
    layerwise_lr_decay,
    LRGroupScaleState,
    qk_clip,
    set_lr_scale,
    skip_step,
    SkipStepState,
    with_lr_scale,
    z_loss,
)
from jvitals.monitor import (
    Alert,
    Change,
    default_rules,
    Figures,
    flat_replicas,
    Level,
    Localization,
    Monitor,
    Policy,
    ReplicaRule,
    Spike,
    Verdict,
)
from jvitals.guard import (
    Action,
    Cause,
    CheckpointSaveError,
    CheckpointStore,
    DEFAULT_REMEDIES,
    Preemption,
    REMEDY_NAMES,
    Response,
    Rollback,
    RollbackError,
    RollbackLimitError,
    Snapshots,
    TrainingPaused,
)
from jvitals.report import (
    write,
)

__version__ = "0.1.0"

# Code written against 0.1's flat layout keeps working: each old module path
# (``jvitals.stats``, ``from jvitals.rollback import Rollback``, ...) is its new module.
_FLAT_MODULES = {
    "activations": "metrics.activations", "gradients": "metrics.gradients", "host": "metrics.host",
    "moe": "metrics.moe", "optimizer": "metrics.optimizer", "packed": "metrics.packed",
    "probes": "metrics.probes", "qkv": "metrics.qkv", "roles": "metrics.roles", "stats": "metrics.stats",
    "clipping": "optim.clipping", "layer_decay": "optim.layer_decay", "losses": "optim.losses",
    "lr_scale": "optim.lr_scale", "qk_clip": "optim.qk_clip",
    "_monitor_localize": "monitor.localize", "_monitor_policy": "monitor.policy",
    "_monitor_rules": "monitor.rules", "_monitor_trackers": "monitor.trackers", "_monitor_types": "monitor.types",
    "checkpoints": "guard.checkpoints", "remedies": "guard.remedies", "rollback": "guard.rollback",
    "cli": "report.cli", "writers": "report.writers",
    # ``jvitals.record`` and ``jvitals.instrument`` stay the functions; their modules import by path.
    "record": "metrics.record", "instrument": "metrics.instrument",
}


def _alias_flat_modules() -> None:
    import importlib
    import sys

    for old, new in _FLAT_MODULES.items():
        module = importlib.import_module(f"jvitals.{new}")
        sys.modules.setdefault(f"jvitals.{old}", module)
        globals().setdefault(old, module)


_alias_flat_modules()

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
    "flat_replicas",
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
    "Preemption",
    "qk_clip",
    "QKVSplit",
    "record",
    "recorded",
    "recorded_steps",
    "RecordState",
    "reduce",
    "REMEDY_NAMES",
    "replica_layout",
    "replica_metrics",
    "ReplicaLayout",
    "ReplicaPlace",
    "ReplicaRule",
    "replica_window_init",
    "replica_window_metrics",
    "replica_window_update",
    "ReplicaWindow",
    "Response",
    "Roles",
    "RolesExplanation",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "set_lr_scale",
    "skip_step",
    "SkipStepState",
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
