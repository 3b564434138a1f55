"""Per-metric state machines of the host-side monitor (plain helpers).

Each tracker is a small bounded-memory object with ``state_dict``/``from_state_dict``
(JSON-safe, lossless) so that a resumed monitor continues bit-for-bit. They
import nothing from ``jvitals.monitor`` or the rules (no import circle):

- :func:`theil_sen`, :func:`mann_kendall_z`: robust slope and trend test.
- :class:`BaselineStart`: when the baselines start (the end of the LR
  warm-up, or the run having settled; an explicit ``warmup_steps`` wins).
- :class:`FixedBaseline`: median over the first ``baseline_steps`` after the
  start (METRICS.md §5, robust to a few outliers).
- :class:`RollingBaseline`: OLMo-core style mean + k * std over a rolling
  window of steps.
- :class:`EmaBaseline`: ZClip style EMA mean / variance with a z-score gate.
- :class:`DriftBaseline`: the fixed median, then an EMA of the log that follows
  the run's own slow drift (the default reference of the ratio rules).
- :class:`BucketSeries`: bucket means over a window of steps (the trend rule).
- :class:`ScoreWindow`: fraction of checks flagged over the last N steps, in
  fixed buckets.
- :class:`SpikeTracker`: trend / band, spike anatomy, periodicity.
- :class:`DriftBand`: a figure's departures from its own history (a jump
  against its noise, a drift beyond the drift it showed): the group rule.
- :class:`GapSeries`: train/val gap history for the growth-rate rule.
- :class:`LayerHistory`: NumPy ring buffer of the localization candidates
  (per-layer / per-group metrics) with their own median baselines.

Times: ``s`` is the caller's step; ``t`` is the monitor's model clock
(``s`` minus the steps abandoned by rollbacks, see ``Monitor.note_rollback``).
Warm-up and baseline windows, the gap windows and the per-layer history use
``t``; trends, spikes and scores use ``s``.
"""


from jvitals.monitor.bands import BucketSeries, DriftBand, GapSeries
from jvitals.monitor.baselines import (BASELINES, BaselineStart, DriftBaseline, EmaBaseline, FixedBaseline,
                                       RollingBaseline)
from jvitals.monitor.history import LayerHistory
from jvitals.monitor.robust import mann_kendall_z, median, theil_sen
from jvitals.monitor.spikes import ScoreWindow, SpikeTracker

__all__ = ["BASELINES", "BaselineStart", "BucketSeries", "DriftBand", "DriftBaseline", "EmaBaseline",
           "FixedBaseline", "GapSeries", "LayerHistory", "RollingBaseline", "ScoreWindow", "SpikeTracker",
           "mann_kendall_z", "median", "theil_sen"]
