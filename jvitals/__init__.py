"""jvitals: a JAX/Flax training run's vital signs, measured in the step, acted on by the host.

See METRICS.md for every metric, DESIGN.md for the architecture.
"""

from jvitals.stats import Summary, reduce, summarize

__version__ = "0.1.0"

__all__ = [
    "Summary",
    "reduce",
    "summarize",
]
