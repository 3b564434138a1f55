"""jvitals: a JAX/Flax training run's vital signs, measured in the step, acted on by the host.

See METRICS.md for every metric, DESIGN.md for the architecture.
"""

from jvitals.host import StepTimer, device_memory_metrics
from jvitals.stats import Summary, reduce, summarize
from jvitals.writers import write

__version__ = "0.1.0"

__all__ = [
    "StepTimer",
    "Summary",
    "device_memory_metrics",
    "reduce",
    "summarize",
    "write",
]
