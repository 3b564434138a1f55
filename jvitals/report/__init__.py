"""What a person reads: writers to clu-style writers, the offline HTML report, the CLI.

``writers`` writes a step's figures, verdict and events through any clu
``MetricWriter``; ``run`` reads a run's TensorBoard event files back (by the same tag
constants); ``plots`` and ``guide`` (the training guide's check-up table) draw from it;
``page`` builds the self-contained HTML report; ``cli`` is ``jvitals report LOGDIR``.
``__all__`` is the public API: the writer, the report, the run reader, the
check-up, the plots and the TensorBoard tags jvitals writes under (one door each:
the guard writes its events under these tags and does not export them).
The top layer: it imports ``jvitals.guard`` for names only, and no other subpackage
imports it. matplotlib and tensorboard are imported only when a plot is drawn or a
run read.
"""

from jvitals.report.writers import (
    ALERTS_MD_TAG,
    ALERTS_TAG,
    EVENTS_TAG,
    LEVEL_TAG,
    REPLICAS_TAG,
    ROLLBACK_COUNT,
    ROLLBACK_LR_SCALE,
    write,
)
from jvitals.report.run import (
    read_run,
    Run,
)
from jvitals.report.plots import (
    plot_family,
    plot_layer_heatmap,
    plot_replica_heatmap,
    plot_timeline,
)
from jvitals.report.guide import (
    CheckItem,
    checkup,
)
from jvitals.report.page import (
    write_report,
)

__all__ = [
    "ALERTS_MD_TAG",
    "ALERTS_TAG",
    "CheckItem",
    "checkup",
    "EVENTS_TAG",
    "LEVEL_TAG",
    "plot_family",
    "plot_layer_heatmap",
    "plot_replica_heatmap",
    "plot_timeline",
    "read_run",
    "REPLICAS_TAG",
    "ROLLBACK_COUNT",
    "ROLLBACK_LR_SCALE",
    "Run",
    "write",
    "write_report",
]
