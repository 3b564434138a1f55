"""The device side: what is measured inside the compiled step.

Pure functions over pytrees, traceable under ``jit``, ``shard_map`` and ``pmap``;
nothing here syncs with the host, logs or checkpoints. ``stats`` (the one-pass
``Summary`` and the mesh reductions) is the floor every other module stands on;
``roles``/``qkv`` name the parameters; ``probes``/``instrument`` capture activations
(``nnx_intercept`` wraps Flax NNX module calls; ``variables`` sees through NNX
Variables);
``activations``, ``gradients``, ``moe`` and ``optimizer`` turn them into METRICS.md's
figures; ``record`` is the optax recorder; ``host`` measures step time and memory;
``replicas`` keeps a few figures per data-parallel replica and maps each replica to its
devices, process and host.
Imports: jax, flax, optax and this package only.
"""

from jvitals.metrics.stats import (
    bound_axes,
    check_axes,
    eager_jit,
    make_varying,
    pmax_over,
    psum_over,
    reduce,
    reduction_axes,
    sharded_axes,
    summarize,
    summarize_many,
    summarize_max,
    summarize_sumsq,
    summarize_tokens,
    Summary,
    TokenSummary,
    varying_axes,
)
from jvitals.metrics.roles import (
    assign_roles,
    DEFAULT_LAYER_PATTERNS,
    DEFAULT_PATTERNS,
    DEFAULT_QKV_LAYOUTS,
    DEFAULT_STACKS,
    explain_roles,
    LeafRole,
    path_str,
    QKVSplit,
    ROLE_METRIC_NAMES,
    Roles,
    RolesExplanation,
)
from jvitals.metrics.qkv import (
    LAYOUTS,
    merge_qkv,
    qkv_layout,
    qkv_part_ids,
    QKVLayout,
    split_qkv,
)
from jvitals.metrics.probes import (
    attention_valid_mask,
    attn_logits_probe,
    logits_probe,
    logits_rows,
    LogitsRows,
    LogitsSummary,
    perturb_values,
    sow_summary,
    summarize_logits,
    vary_along,
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
    histogram_quantile,
    injected_hyperparams,
    log_histogram,
    LR_SCALE,
    LR_SCALE_ARG,
    NU_BINS,
    optimizer_metrics,
    search_quantile,
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
    process_hostnames,
    REPLICA_FIGURES,
    replica_layout,
    replica_metrics,
    ReplicaLayout,
    ReplicaPlace,
    replica_window_init,
    replica_window_metrics,
    replica_window_update,
    ReplicaWindow,
)

__all__ = [
    "activation_metrics",
    "process_hostnames",
    "REPLICA_FIGURES",
    "replica_layout",
    "replica_metrics",
    "ReplicaLayout",
    "ReplicaPlace",
    "replica_window_init",
    "replica_window_metrics",
    "replica_window_update",
    "ReplicaWindow",
    "assign_roles",
    "attention_valid_mask",
    "attn_logits_probe",
    "bos_value_grad_metrics",
    "bound_axes",
    "check_axes",
    "DEFAULT_EVERY",
    "DEFAULT_LAYER_PATTERNS",
    "DEFAULT_PATTERNS",
    "DEFAULT_QKV_LAYOUTS",
    "DEFAULT_STACKS",
    "device_memory_metrics",
    "eager_jit",
    "ExpertChoices",
    "explain_roles",
    "global_norm",
    "global_norm_metrics",
    "gradient_metrics",
    "GROUP_ROLES",
    "histogram_quantile",
    "injected_hyperparams",
    "instrument",
    "InstrumentReport",
    "LAYOUTS",
    "LeafRole",
    "log_histogram",
    "logits_probe",
    "logits_rows",
    "LogitsRows",
    "LogitsSummary",
    "LR_SCALE",
    "LR_SCALE_ARG",
    "make_varying",
    "merge_qkv",
    "moe_metrics",
    "moe_window_init",
    "moe_window_update",
    "MoEWindowState",
    "mtp_metrics",
    "NU_BINS",
    "optimizer_metrics",
    "PackedMetrics",
    "path_str",
    "perturb_values",
    "pmax_over",
    "psum_over",
    "qkv_layout",
    "qkv_part_ids",
    "QKVLayout",
    "QKVSplit",
    "record",
    "recorded",
    "recorded_steps",
    "RecordState",
    "reduce",
    "reduction_axes",
    "ROLE_METRIC_NAMES",
    "Roles",
    "RolesExplanation",
    "search_quantile",
    "sharded_axes",
    "sow_summary",
    "split_qkv",
    "StepTimer",
    "summarize",
    "summarize_logits",
    "summarize_many",
    "summarize_max",
    "summarize_sumsq",
    "summarize_tokens",
    "Summary",
    "TokenSummary",
    "update_metrics",
    "vary_along",
    "varying_axes",
]
