"""What a person reads: writers to clu-style writers, the offline HTML report, the CLI.

``writers`` writes a step's figures, verdict and events through any clu
``MetricWriter``; ``run`` reads a run's TensorBoard event files back (by the same tag
constants); ``plots`` and ``guide`` (the training guide's check-up table) draw from it;
``page`` builds the self-contained HTML report; ``cli`` is ``jvitals report LOGDIR``.
The top layer: it imports ``jvitals.guard`` for names only, and no other subpackage
imports it. matplotlib and tensorboard are imported only when a plot is drawn or a
run read.
"""

from jvitals.report.writers import (
    alerts_markdown,
    ALERTS_MD_TAG,
    ALERTS_TAG,
    EVENTS_TAG,
    LEVEL_TAG,
    MetricWriterLike,
    REPLICAS_TAG,
    ROLLBACK_COUNT,
    ROLLBACK_LR_SCALE,
    write,
)
from jvitals.report.run import (
    LEVEL_NAMES,
    read_run,
    Run,
    run_name,
)
from jvitals.report.plots import (
    FAMILIES,
    Family,
    plot_family,
    plot_layer_heatmap,
    plot_replica_heatmap,
    plot_timeline,
    replica_matrices,
    share_matrix,
)
from jvitals.report.guide import (
    CheckItem,
    checkup,
    PHASES,
    run_phase,
)
from jvitals.report.page import (
    build_html,
    remedy_texts,
    write_report,
)

__all__ = [
    "alerts_markdown",
    "ALERTS_MD_TAG",
    "ALERTS_TAG",
    "build_html",
    "CheckItem",
    "checkup",
    "EVENTS_TAG",
    "FAMILIES",
    "Family",
    "LEVEL_NAMES",
    "LEVEL_TAG",
    "MetricWriterLike",
    "PHASES",
    "plot_family",
    "plot_layer_heatmap",
    "plot_replica_heatmap",
    "plot_timeline",
    "read_run",
    "remedy_texts",
    "replica_matrices",
    "REPLICAS_TAG",
    "ROLLBACK_COUNT",
    "ROLLBACK_LR_SCALE",
    "Run",
    "run_name",
    "run_phase",
    "share_matrix",
    "write",
    "write_report",
]
