"""What a person reads: writers to clu-style writers, the offline HTML report, the CLI.

``writers`` writes a step's figures, verdict and events through any clu
``MetricWriter``; ``page`` reads a run's TensorBoard event files back (by the same tag
constants) and draws the report; ``cli`` is ``jvitals report LOGDIR``. The top layer:
it imports ``jvitals.guard`` for names only, and no other subpackage imports it.
"""

from jvitals.report.writers import (
    alerts_markdown,
    ALERTS_MD_TAG,
    ALERTS_TAG,
    EVENTS_TAG,
    LEVEL_TAG,
    MetricWriterLike,
    ROLLBACK_COUNT,
    ROLLBACK_LR_SCALE,
    write,
)
from jvitals.report.page import (
    build_html,
    CheckItem,
    checkup,
    FAMILIES,
    Family,
    LEVEL_NAMES,
    PHASES,
    plot_family,
    plot_layer_heatmap,
    plot_timeline,
    read_run,
    remedy_texts,
    Run,
    run_phase,
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
    "plot_timeline",
    "read_run",
    "remedy_texts",
    "ROLLBACK_COUNT",
    "ROLLBACK_LR_SCALE",
    "Run",
    "run_phase",
    "write",
    "write_report",
]
