"""The device side: what is measured inside the compiled step.

Pure functions over pytrees, traceable under ``jit``, ``shard_map`` and ``pmap``; nothing
here syncs with the host, logs or checkpoints. One module per idea, each listed with what
it holds in docs/LAYOUT.md's ``metrics`` row: ``stats`` (the one-pass ``Summary``) and
``axes`` (which mesh axes a value is reduced over) are the floor every other module stands
on; ``roles`` names a leaf's role; ``activations``, ``gradients``, ``moe`` and
``optimizer`` turn what is measured into METRICS.md's figures; ``record`` is the optax
recorder. How each module measures: docs/DEVICE.md.

``__all__`` is this subpackage's public API (what docs/METRICS.md documents); the helpers
the modules share are importable from their modules and are not part of it. Imports: jax,
flax, optax and this package only.
"""

from jvitals.metrics.stats import (
    reduce,
    summarize,
    Summary,
)
from jvitals.metrics.roles import (
    assign_roles,
    DEFAULT_LAYER_PATTERNS,
    DEFAULT_PATTERNS,
    DEFAULT_QKV_LAYOUTS,
    DEFAULT_STACKS,
    LeafRole,
    QKVSplit,
    ROLE_METRIC_NAMES,
    Roles,
)
from jvitals.metrics.explain import (
    explain_roles,
    RolesExplanation,
)
from jvitals.metrics.qkv import (
    LAYOUTS,
    QKVLayout,
)
from jvitals.metrics.probes import (
    attn_logits_probe,
    attn_softmax_probe,
    logits_probe,
    LogitsSummary,
    perturb_values,
    sow_summary,
    summarize_logits,
)
from jvitals.metrics.instrument import (
    ExpertChoices,
    instrument,
    InstrumentReport,
)
from jvitals.metrics.activations import (
    activation_metrics,
    bos_value_grad_metrics,
    mtp_metrics,
)
from jvitals.metrics.gradients import (
    global_norm,
    global_norm_metrics,
    gradient_metrics,
    GROUP_ROLES,
    update_metrics,
)
from jvitals.metrics.moe import (
    moe_metrics,
    moe_window_init,
    moe_window_update,
    MoEWindowState,
)
from jvitals.metrics.optimizer import (
    optimizer_metrics,
)
from jvitals.metrics.packed import (
    PackedMetrics,
)
from jvitals.metrics.record import (
    DEFAULT_EVERY,
    record,
    recorded,
    recorded_steps,
    RecordState,
)
from jvitals.metrics.host import (
    device_memory_metrics,
    StepTimer,
)
from jvitals.metrics.replicas import (
    REPLICA_FIGURES,
    replica_metrics,
    replica_window_init,
    replica_window_metrics,
    replica_window_update,
    ReplicaWindow,
)
from jvitals.metrics.placement import (
    replica_layout,
    ReplicaLayout,
    ReplicaPlace,
)

__all__ = [
    "activation_metrics",
    "assign_roles",
    "attn_logits_probe",
    "attn_softmax_probe",
    "bos_value_grad_metrics",
    "DEFAULT_EVERY",
    "DEFAULT_LAYER_PATTERNS",
    "DEFAULT_PATTERNS",
    "DEFAULT_QKV_LAYOUTS",
    "DEFAULT_STACKS",
    "device_memory_metrics",
    "ExpertChoices",
    "explain_roles",
    "global_norm",
    "global_norm_metrics",
    "gradient_metrics",
    "GROUP_ROLES",
    "instrument",
    "InstrumentReport",
    "LAYOUTS",
    "LeafRole",
    "logits_probe",
    "LogitsSummary",
    "moe_metrics",
    "moe_window_init",
    "moe_window_update",
    "MoEWindowState",
    "mtp_metrics",
    "optimizer_metrics",
    "PackedMetrics",
    "perturb_values",
    "QKVLayout",
    "QKVSplit",
    "record",
    "recorded",
    "recorded_steps",
    "RecordState",
    "reduce",
    "REPLICA_FIGURES",
    "replica_layout",
    "replica_metrics",
    "replica_window_init",
    "replica_window_metrics",
    "replica_window_update",
    "ReplicaLayout",
    "ReplicaPlace",
    "ReplicaWindow",
    "ROLE_METRIC_NAMES",
    "Roles",
    "RolesExplanation",
    "sow_summary",
    "StepTimer",
    "summarize",
    "summarize_logits",
    "Summary",
    "update_metrics",
]
