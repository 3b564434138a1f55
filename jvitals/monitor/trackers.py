"""Per-metric state machines of the host-side monitor (plain helpers).

Each tracker is a small bounded-memory object with ``to_dict``/``from_dict``
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

from __future__ import annotations

import bisect
import collections
import math
import warnings
from typing import Any

import numpy as np

from jvitals.monitor.policy import Policy
from jvitals.monitor.types import (
    Spike,
    dec_float,
    dec_floats,
    dec_state,
    enc_float,
    enc_floats,
    enc_state,
)

_NAN = math.nan


# --------------------------------------------------------------------------
# Robust slope and trend test.
# --------------------------------------------------------------------------


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.triu_indices(n, 1)``, cached (a pure function of ``n``)."""
    got = _PAIRS.get(n)
    if got is None:
        if len(_PAIRS) > 64:
            _PAIRS.clear()
        got = _PAIRS[n] = np.triu_indices(n, 1)
    return got


def theil_sen(x: np.ndarray, y: np.ndarray) -> float:
    """Theil-Sen slope: ``median((y_j - y_i) / (x_j - x_i))`` over ``i < j``
    with ``x_i != x_j`` (NaN with fewer than two distinct ``x``)."""
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        return _NAN
    return float(np.median((y[j] - y[i])[ok] / dx[ok]))


def mann_kendall_z(y: np.ndarray) -> float:
    """Mann-Kendall trend statistic (no ties correction)::

        S = sum_{i<j} sign(y_j - y_i),  var = n (n - 1) (2n + 5) / 18
        z = (S - sign(S)) / sqrt(var)

    ``z > 0``: rising; ``|z| > 3`` is significant at p ~ 0.003 for
    independent samples. 0 for fewer than 3 samples.
    """
    n = len(y)
    if n < 3:
        return 0.0
    i, j = _pairs(n)
    s = float(np.sign(y[j] - y[i]).sum())
    var = n * (n - 1) * (2 * n + 5) / 18.0
    return (s - math.copysign(1.0, s)) / math.sqrt(var) if s else 0.0


def median(xs) -> float:
    """Median of a small sequence in plain Python (faster than NumPy below ~100)."""
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


# --------------------------------------------------------------------------
# Baseline start.
# --------------------------------------------------------------------------


class BaselineStart:
    """Model time at which the baselines start (``start``; ``None`` before).

    ``Policy.warmup_steps`` set: that step. Else, with ``Policy.lr_metric``
    logged: the first check where the learning rate stopped rising, ``lr <=
    lr_prev * (1 + lr_plateau_tol)`` (the warm-up's peak plateau reached; a
    schedule without warm-up starts at its second check). Else the run has
    settled: over the samples of ``settle_metric`` of the last
    ``settle_span`` steps (>= ``settle_min_samples`` of them, spanning at
    least half the window), the Theil-Sen slope ``b`` of ``log(x)`` gives
    ``|exp(b * settle_span) - 1| <= settle_tolerance``. ``settle_cap`` steps
    after the first check it starts regardless; a run with neither metric
    after ``settle_span`` steps starts at its first check.
    """

    def __init__(self) -> None:
        self.start: int | None = None
        self.first: int | None = None
        self.lr_prev = _NAN
        self.steps: collections.deque[int] = collections.deque()
        self.vals: collections.deque[float] = collections.deque()
        self.last_eval: int | None = None
        self.reason = ""

    def observe(self, t: int, lr: float | None, x: float | None, p: Policy) -> int | None:
        """Feeds one check (``lr`` / ``x`` ``None`` when not logged)."""
        if self.start is not None:
            return self.start
        if self.first is None:
            self.first = t
        if p.warmup_steps is not None:
            if t >= p.warmup_steps:
                self.start, self.reason = p.warmup_steps, "Policy.warmup_steps"
            return self.start
        if lr is not None and math.isfinite(lr):
            prev, self.lr_prev = self.lr_prev, lr
            if prev == prev and lr <= prev * (1.0 + p.lr_plateau_tol):
                self.start, self.reason = t, "the learning rate stopped rising"
            return self.start
        if self.lr_prev == self.lr_prev:  # LR logged, not at this check: wait for it
            return self._cap(t, p)
        w = p.settle_span
        if x is not None and math.isfinite(x) and x > 0:
            self.steps.append(t)
            self.vals.append(math.log(x))
            while len(self.steps) > p.settle_min_samples and self.steps[0] < t - w:
                self.steps.popleft()
                self.vals.popleft()
            n = len(self.steps)
            if (n >= p.settle_min_samples and t - self.steps[0] >= w // 2
                    and (self.last_eval is None or t - self.last_eval >= max(1, w // 8))):
                self.last_eval = t
                xs = np.fromiter(self.steps, np.float64, n)
                ys = np.fromiter(self.vals, np.float64, n)
                if n > 32:  # bucket means: Theil-Sen on <= 32 points
                    k = -(-n // 32)
                    m = n // k * k
                    xs = xs[n - m:].reshape(-1, k).mean(1)
                    ys = ys[n - m:].reshape(-1, k).mean(1)
                b = theil_sen(xs, ys)
                if b == b and abs(math.expm1(b * w)) <= p.settle_tolerance:
                    self.start, self.reason = t, f"{p.settle_metric} settled"
                    return self.start
        elif not self.steps and t - self.first >= w:
            self.start, self.reason = self.first, "no learning rate or settle metric logged"
            return self.start
        return self._cap(t, p)

    def _cap(self, t: int, p: Policy) -> int | None:
        if t - self.first >= p.settle_cap:
            self.start, self.reason = t, f"settle_max_steps ({p.settle_cap}) reached"
        return self.start

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "first": self.first, "lr_prev": enc_float(self.lr_prev),
                "steps": list(self.steps), "vals": enc_floats(self.vals),
                "last_eval": self.last_eval, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BaselineStart":
        b = cls()
        b.start, b.first, b.last_eval, b.reason = d["start"], d["first"], d["last_eval"], d["reason"]
        b.lr_prev = dec_float(d["lr_prev"])
        b.steps.extend(int(x) for x in d["steps"])
        b.vals.extend(dec_floats(d["vals"]))
        return b


# --------------------------------------------------------------------------
# Baselines.
# --------------------------------------------------------------------------


_median = median


class FixedBaseline:
    """Median over the first ``baseline_steps`` steps after the start.

    ``baseline = median(x_t for start <= t < start + baseline_steps)``; if
    fewer than ``baseline_min_samples`` finite samples fell in that window
    (sparse cadence), the first ``baseline_min_samples`` samples after the
    start are used. Ready once the window has passed and enough samples were
    seen. The median ignores a few outliers (a spike in the window).
    """

    __slots__ = ("vals", "mean")
    kind = "fixed"

    def __init__(self) -> None:
        self.vals: list[float] = []
        self.mean = _NAN

    @property
    def ready(self) -> bool:
        return self.mean == self.mean

    def step(self, t: int, s: int, v: float, p: Policy, start: int | None,
             hold: float | None = None) -> tuple[float | None, bool]:
        """Returns ``(baseline or None, gate)`` for ``v``, then learns from it."""
        del s, hold
        if self.mean == self.mean:
            return self.mean, True
        if start is not None and t >= start:
            end = start + p.baseline_steps
            if t < end or len(self.vals) < p.baseline_min_samples:
                self.vals.append(v)
            if len(self.vals) >= p.baseline_min_samples and t >= end - 1:
                self.mean = _median(self.vals)
                self.vals = []
        return None, False

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "vals": enc_floats(self.vals), "mean": enc_float(self.mean)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FixedBaseline":
        b = cls()
        b.vals, b.mean = dec_floats(d["vals"]), dec_float(d["mean"])
        return b


class RollingBaseline:
    """OLMo-core style: mean and std over a rolling window of steps.

    ``gate = x > mean + rolling_k * std`` over the samples of the last
    ``rolling_window`` steps (at least ``adaptive_min_samples`` samples are
    kept, so a sparse cadence still has a usable window). Samples enter the
    window clipped to ``mean + rolling_k * std`` so an anomaly does not
    become its own baseline at once.
    """

    __slots__ = ("steps", "vals")
    kind = "rolling"

    def __init__(self) -> None:
        self.steps: collections.deque[int] = collections.deque()
        self.vals: collections.deque[float] = collections.deque()

    @property
    def mean(self) -> float:
        return math.fsum(self.vals) / len(self.vals) if self.vals else _NAN

    def step(self, t: int, s: int, v: float, p: Policy, start: int | None,
             hold: float | None = None) -> tuple[float | None, bool]:
        del hold
        if start is None or t < start:
            return None, False
        n = len(self.vals)
        ref, gate = None, False
        if n >= p.adaptive_min_samples:
            mean = math.fsum(self.vals) / n
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.vals) / n)
            ref, gate = mean, v > mean + p.rolling_k * std
            v = min(v, mean + p.rolling_k * std)
        self.steps.append(s)
        self.vals.append(v)
        while len(self.vals) > p.adaptive_min_samples and self.steps[0] <= s - p.rolling_window:
            self.steps.popleft()
            self.vals.popleft()
        return ref, gate

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "rolling", "steps": list(self.steps), "vals": enc_floats(self.vals)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RollingBaseline":
        b = cls()
        b.steps.extend(int(x) for x in d["steps"])
        b.vals.extend(dec_floats(d["vals"]))
        return b


class EmaBaseline:
    """ZClip style: EMA of the mean and variance, z-score gate.

    After ``adaptive_min_samples`` samples (their plain mean and variance
    start the EMA)::

        gate  = x > mu + ema_z * sigma
        x'    = min(x, mu + ema_z * sigma)          # clipped, as ZClip
        a     = max(ema_alpha ** dt, 1 - 1 / adaptive_min_samples)
        mu    = a * mu + (1 - a) * x'
        var   = a * var + (1 - a) * (x' - mu) ** 2

    with ``dt`` the steps since the previous sample (``ema_alpha`` is per
    step; the floor keeps a sparse cadence from forgetting everything).
    """

    __slots__ = ("init", "mean", "var", "last_step")
    kind = "ema"

    def __init__(self) -> None:
        self.init: list[float] = []
        self.mean = _NAN
        self.var = _NAN
        self.last_step = 0

    def step(self, t: int, s: int, v: float, p: Policy, start: int | None,
             hold: float | None = None) -> tuple[float | None, bool]:
        del hold
        if start is None or t < start:
            return None, False
        if self.mean != self.mean:
            self.init.append(v)
            self.last_step = s
            if len(self.init) >= p.adaptive_min_samples:
                n = len(self.init)
                self.mean = math.fsum(self.init) / n
                self.var = math.fsum((x - self.mean) ** 2 for x in self.init) / n
                self.init = []
            return None, False
        std = math.sqrt(self.var)
        ref, gate = self.mean, v > self.mean + p.ema_z * std
        x = min(v, self.mean + p.ema_z * std)
        a = max(p.ema_alpha ** max(s - self.last_step, 1), 1.0 - 1.0 / p.adaptive_min_samples)
        self.mean = a * self.mean + (1.0 - a) * x
        self.var = a * self.var + (1.0 - a) * (x - self.mean) ** 2
        self.last_step = s
        return ref, gate

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "ema", "init": enc_floats(self.init), "mean": enc_float(self.mean),
                "var": enc_float(self.var), "last_step": self.last_step}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmaBaseline":
        b = cls()
        b.init = dec_floats(d["init"])
        b.mean, b.var, b.last_step = dec_float(d["mean"]), dec_float(d["var"]), int(d["last_step"])
        return b


class DriftBaseline:
    """A reference that follows the run's own slow drift (the default).

    Starts as :class:`FixedBaseline` (the median over the first ``baseline_steps``
    after the start), then follows ``log x`` with an EMA of half-life
    ``drift_halflife`` steps::

        ref = exp(m);  m = a * m + (1 - a) * log(x),  a = 0.5 ** (dt / drift_halflife)

    at most once per ``drift_halflife / 50`` steps (a finer cadence adds nothing but
    cost), each sample clipped at ``hold`` x the reference (an excursion above the
    alert threshold counts as that much: excluding it would bias the reference low
    where single steps are heavy-tailed, as a mixture-of-experts on mixed text is),
    none while the caller's alert holds (``hold=0``: a fault never becomes its own
    reference), none below ``floor`` x the reference where given (a drop). It also
    keeps ``var``, the EMA of the squared log residual: ``noise = sqrt(var)``, the
    figure's own check-to-check spread. A healthy run whose figure
    creeps at a rate ``r`` (log per step) sits ``exp(r * drift_halflife / ln 2)``
    above it: 1.3x for a grad norm rising 1.25x per 1000 steps at the default 500.
    """

    __slots__ = ("vals", "log_mean", "last_t", "var", "ref", "_decay")
    kind = "drift"

    def __init__(self) -> None:
        self.vals: list[float] = []
        self.log_mean = _NAN
        self.last_t = 0
        self.var = 0.0
        self.ref = _NAN                  # exp(log_mean), kept (not state)
        self._decay = (0, 1.0, 0.0)      # (dt, halflife) -> a, cached (not state)

    @property
    def mean(self) -> float:
        return math.exp(self.log_mean) if self.log_mean == self.log_mean else _NAN

    @property
    def noise(self) -> float:
        return math.sqrt(self.var)

    def step(self, t: int, s: int, v: float, p: Policy, start: int | None,
             hold: float | None = None, floor: float | None = None) -> tuple[float | None, bool]:
        """Returns ``(reference or None, True)`` for ``v``, then learns from it (only
        from ``floor x ref < v < hold x ref`` where given)."""
        del s
        if self.log_mean == self.log_mean:
            ref = self.ref
            if ref != ref:
                ref = self.ref = math.exp(self.log_mean)
            dt = t - self.last_t
            if dt < 0 or dt >= p.drift_halflife / 50:     # learns once per drift_halflife / 50 steps
                if v > 0 and hold != 0.0 and (floor is None or v > floor * ref):
                    c = self._decay
                    if c[0] != dt or c[2] != p.drift_halflife:
                        c = self._decay = (dt, 0.5 ** (max(dt, 0) / p.drift_halflife), p.drift_halflife)
                    x = math.log(v if hold is None else min(v, hold * ref))
                    d = x - self.log_mean
                    self.var = c[1] * self.var + (1.0 - c[1]) * d * d
                    self.log_mean += (1.0 - c[1]) * d
                    self.ref = math.exp(self.log_mean)
                self.last_t = t
            return ref, True
        if start is not None and t >= start and v > 0:
            end = start + p.baseline_steps
            if t < end or len(self.vals) < p.baseline_min_samples:
                self.vals.append(v)
            if len(self.vals) >= p.baseline_min_samples and t >= end - 1:
                self.log_mean, self.last_t = math.log(_median(self.vals)), t
                self.ref = math.exp(self.log_mean)
                self.var = _median([(math.log(x) - self.log_mean) ** 2 for x in self.vals])
                self.vals = []
        return None, False

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "drift", "vals": enc_floats(self.vals), "log_mean": enc_float(self.log_mean),
                "last_t": self.last_t, "var": enc_float(self.var)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DriftBaseline":
        b = cls()
        b.vals, b.log_mean, b.last_t = dec_floats(d["vals"]), dec_float(d["log_mean"]), int(d["last_t"])
        b.var = dec_float(d["var"])
        b.ref = math.exp(b.log_mean) if b.log_mean == b.log_mean else _NAN
        return b


BASELINES = {"fixed": FixedBaseline, "rolling": RollingBaseline, "ema": EmaBaseline,
             "drift": DriftBaseline}


def baseline_from_dict(d: dict[str, Any]):
    return BASELINES[d["kind"]].from_dict(d)


# --------------------------------------------------------------------------
# Bucket means over a window (trend rule).
# --------------------------------------------------------------------------


class BucketSeries:
    """Means of ``k`` parallel series in fixed step buckets, last ``n`` kept.

    Bucket ``b = s // width``; ``add`` returns True when it closed a bucket
    (the first sample of a later bucket arrived), so a caller recomputes its
    statistics once per bucket, not per check.
    """

    def __init__(self, width: int, n: int, k: int) -> None:
        self.width, self.n, self.k = max(1, width), n, k
        self.ids: collections.deque[int] = collections.deque(maxlen=n)
        self.means: collections.deque[list[float]] = collections.deque(maxlen=n)
        self.cur: int | None = None
        self.sums = [0.0] * k
        self.cnt = 0

    def add(self, s: int, xs: list[float]) -> bool:
        b = s // self.width
        closed = False
        if b != self.cur:
            if self.cur is not None and self.cnt:
                self.ids.append(self.cur)
                self.means.append([x / self.cnt for x in self.sums])
                closed = True
            self.sums, self.cnt = list(xs), 1
            self.cur = b
            return closed
        sums = self.sums
        for i, x in enumerate(xs):
            sums[i] += x
        self.cnt += 1
        return False

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bucket start steps, means[n, k])`` of the closed buckets."""
        ids = np.fromiter(self.ids, np.float64, len(self.ids)) * self.width
        return ids, np.asarray(list(self.means), np.float64).reshape(len(self.ids), self.k)

    def clear(self) -> None:
        self.ids.clear()
        self.means.clear()
        self.cur, self.sums, self.cnt = None, [0.0] * self.k, 0

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "n": self.n, "k": self.k, "ids": list(self.ids),
                "means": [enc_floats(m) for m in self.means], "cur": self.cur,
                "sums": enc_floats(self.sums), "cnt": self.cnt}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BucketSeries":
        b = cls(int(d["width"]), int(d["n"]), int(d["k"]))
        b.ids.extend(int(x) for x in d["ids"])
        b.means.extend(dec_floats(m) for m in d["means"])
        b.cur, b.sums, b.cnt = d["cur"], dec_floats(d["sums"]), int(d["cnt"])
        return b


# --------------------------------------------------------------------------
# Spike score window.
# --------------------------------------------------------------------------


class ScoreWindow:
    """Fraction of flagged checks over the last ``window`` steps.

    The window is cut into ``buckets`` fixed buckets of
    ``ceil(window / buckets)`` steps, so memory and per-check cost are O(1):
    ``score = sum(flagged) / sum(checks)`` over the buckets of the window.
    """

    __slots__ = ("width", "ids", "obs", "flags", "tot_obs", "tot_flags", "cur")

    def __init__(self, window: int, buckets: int = 100) -> None:
        self.width = max(1, -(-window // buckets))
        self.ids = [None] * buckets
        self.obs = [0] * buckets
        self.flags = [0] * buckets
        self.tot_obs = 0
        self.tot_flags = 0
        self.cur: int | None = None

    def add(self, s: int, flag: bool) -> None:
        nb = len(self.ids)
        b = s // self.width
        if b != self.cur:
            if self.cur is None or b - self.cur >= nb or b < self.cur:
                lo = b - nb + 1
            else:
                lo = self.cur + 1
            for bid in range(max(lo, b - nb + 1), b + 1):
                i = bid % nb
                if self.ids[i] is not None:
                    self.tot_obs -= self.obs[i]
                    self.tot_flags -= self.flags[i]
                self.ids[i], self.obs[i], self.flags[i] = bid, 0, 0
            self.cur = b
        i = b % nb
        self.obs[i] += 1
        self.tot_obs += 1
        if flag:
            self.flags[i] += 1
            self.tot_flags += 1

    @property
    def score(self) -> float:
        return self.tot_flags / self.tot_obs if self.tot_obs else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "ids": self.ids, "obs": self.obs, "flags": self.flags,
                "tot_obs": self.tot_obs, "tot_flags": self.tot_flags, "cur": self.cur}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ScoreWindow":
        w = cls(1, len(d["ids"]))
        w.width = int(d["width"])
        w.ids, w.obs, w.flags = list(d["ids"]), list(d["obs"]), list(d["flags"])
        w.tot_obs, w.tot_flags, w.cur = int(d["tot_obs"]), int(d["tot_flags"]), d["cur"]
        return w


# --------------------------------------------------------------------------
# Spikes.
# --------------------------------------------------------------------------


def _margin(trend: float, scale: float, z: float, ratio: float) -> float:
    return max(z * scale, (ratio - 1.0) * abs(trend))


class SpikeTracker:
    """Trend, band, spike anatomy and periodicity of one metric.

    Trend and scale (between spikes, ``dt`` = steps since the last sample)::

        d      = x - x_prev                       (the previous learned sample)
        trend  = a * trend + (1 - a) * x,        a = 0.5 ** (dt / trend_halflife)
        var    = b * var + (1 - b) * d ** 2 / 2,  b = 0.5 ** (dt / scale_halflife)
        scale  = sqrt(var / w),  w = b * w + (1 - b)   (bias-corrected EMA)

    The scale comes from first differences (``E[d^2] = 2 sigma^2`` for noise of
    std ``sigma``), not from residuals to the trend: a lagging trend on a
    falling loss would read the fall itself as noise and hide spikes. It is
    learned after warm-up only, like every baseline.

    Onset (after warm-up and ``spike_min_samples`` samples, or at a sparse
    cadence 5 samples spanning one ``scale_halflife``)::

        x > trend + max(spike_z * scale, (spike_min_ratio - 1) * |trend|)

    The trend is frozen while a spike is open. The spike closes *recovered*
    at the first sample within the recovery band (see :class:`Spike`), or
    *unrecovered* (pathological) ``pathological_steps`` after the onset; an
    unrecovered spike leaves an *elevated* reference (its pre-spike trend)
    that stays until the metric is back within that band or
    ``spike_forget_steps`` have passed since the onset; the trend is re-based
    to the settled level so new spikes are measured from there.
    """

    def __init__(self, metric: str, p: Policy) -> None:
        self.metric = metric
        self.last_step: int | None = None
        self.trend = _NAN
        self.prev_learned = _NAN
        self.var = 0.0
        self.wsum = 0.0
        self.n_active = 0
        self.open: dict[str, Any] | None = None
        self.elevated: dict[str, Any] | None = None
        self.pending: list[dict[str, Any]] = []
        self.onsets: collections.deque[int] = collections.deque(maxlen=8)
        self.periodic: dict[str, Any] | None = None
        self.recent: collections.deque[tuple[int, float]] = collections.deque()
        self.score = ScoreWindow(p.score_window)
        self.last_value = _NAN

    @property
    def scale(self) -> float:
        return math.sqrt(self.var / self.wsum) if self.wsum > 0 else 0.0

    def _learn(self, s: int, v: float, p: Policy, warm: bool = False) -> None:
        if self.trend != self.trend:
            self.trend = self.prev_learned = v
            return
        dt = max(s - self.last_step, 1) if self.last_step is not None else 1
        a = 0.5 ** (dt / p.trend_halflife)
        prev, self.prev_learned = self.prev_learned, v
        if not warm and prev == prev:  # the noise scale is a baseline: learned after warm-up
            b = 0.5 ** (dt / p.scale_halflife)
            d = v - prev
            self.var = b * self.var + (1.0 - b) * 0.5 * d * d
            self.wsum = b * self.wsum + (1.0 - b)
        self.trend = a * self.trend + (1.0 - a) * v

    def beyond(self, v: float, warm: bool, p: Policy) -> bool:
        """Whether ``v`` would be above the onset band now (of the open spike, or of the
        trend once the band is ready), without learning from it."""
        o = self.open
        if o is not None:
            return v > o["pre_trend"] + _margin(o["pre_trend"], o["pre_scale"], p.spike_z, p.spike_min_ratio)
        ready = self.n_active >= p.spike_min_samples or (self.n_active >= 5 and self.wsum >= 0.5)
        trend = self.trend
        return (not warm and ready and trend == trend
                and v > trend + _margin(trend, self.scale, p.spike_z, p.spike_min_ratio))

    def observe(self, s: int, v: float, warm: bool, p: Policy) -> list[Spike]:
        """Feeds one finite sample; returns the spikes completed at this sample."""
        done: list[Spike] = []
        self.last_value = v
        recent = self.recent
        recent.append((s, v))
        while recent[0][0] <= s - p.post_window and len(recent) > 1:
            recent.popleft()
        if self.pending:
            keep = []
            for q in self.pending:
                end = q["recovery_step"] + p.post_window
                if s <= end:
                    q["post_sum"] += v
                    q["post_n"] += 1
                if s >= end:
                    done.append(self._finish(q, s, p))
                else:
                    keep.append(q)
            self.pending = keep

        flag = False
        o = self.open
        if o is not None:
            pre, sc = o["pre_trend"], o["pre_scale"]
            if v > o["peak"]:
                o["peak"], o["peak_step"] = v, s
            if v > pre + _margin(pre, sc, p.spike_z, p.spike_min_ratio):
                o["last_above"] = s
                flag = True
            if v <= pre + _margin(pre, sc, p.spike_recover_z, p.spike_recover_ratio):
                self.open = None
                q = dict(o, recovery_step=s, post_sum=v, post_n=1)
                if p.post_window <= 0:
                    done.append(self._finish(q, s, p))
                else:
                    self.pending.append(q)
                self._learn(s, v, p)
            elif s - o["onset"] >= p.pathological_steps:
                self.open = None
                settle = math.fsum(x for _, x in recent) / len(recent)
                done.append(self._spike(o, None, settle, s, "pathological"))
                self.elevated = {"pre_trend": pre, "pre_scale": sc, "onset": o["onset"], "since": s}
                self.trend = settle
        else:
            trend = self.trend
            ready = self.n_active >= p.spike_min_samples or (
                self.n_active >= 5 and self.wsum >= 0.5)  # sparse cadence: >= 1 scale half-life
            if (not warm and ready and trend == trend
                    and v > trend + _margin(trend, self.scale, p.spike_z, p.spike_min_ratio)):
                self.open = {"onset": s, "peak": v, "peak_step": s, "pre_trend": trend,
                             "pre_scale": self.scale, "last_above": s}
                flag = True
                self.onsets.append(s)
                self._check_periodic(p)
            else:
                self._learn(s, v, p, warm)
            if not warm:
                self.n_active += 1
        e = self.elevated
        if e is not None and self.open is None:
            if (v <= e["pre_trend"] + _margin(e["pre_trend"], e["pre_scale"], p.spike_recover_z,
                                              p.spike_recover_ratio)
                    or s - e["onset"] > p.spike_forget_steps):
                self.elevated = None
        per = self.periodic
        if per is not None and s - per["last_onset"] > (1.0 + 2.0 * p.periodic_tolerance) * per["last_interval"]:
            self.periodic = None
        self.last_step = s
        self.score.add(s, flag)
        return done

    def _spike(self, o: dict[str, Any], recovery_step: int | None, post: float, end: int,
               kind: str, rolled_back: bool = False) -> Spike:
        pre = o["pre_trend"]
        return Spike(
            metric=self.metric,
            onset_step=o["onset"],
            peak_step=o["peak_step"],
            peak=o["peak"],
            pre_trend=pre,
            height=o["peak"] / pre if pre > 0 else _NAN,
            width=o["last_above"] - o["onset"] + 1,
            recovery_steps=None if recovery_step is None else recovery_step - o["onset"],
            recovered=recovery_step is not None,
            post_level=post,
            post_ratio=post / pre if pre > 0 else _NAN,
            kind=kind,
            end_step=end,
            rolled_back=rolled_back,
        )

    def _finish(self, q: dict[str, Any], s: int, p: Policy) -> Spike:
        rec = q["recovery_step"] - q["onset"]
        kind = ("physiological" if rec <= p.physiological_steps
                else "slow" if rec <= p.pathological_steps else "pathological")
        return self._spike(q, q["recovery_step"], q["post_sum"] / q["post_n"], s, kind)

    def _check_periodic(self, p: Policy) -> None:
        ons = list(self.onsets)
        iv = [b - a for a, b in zip(ons, ons[1:])]
        need = p.periodic_min_spikes - 1
        if len(iv) < need or iv[-1] < p.periodic_min_interval:
            self.periodic = None
            return
        # Longest run of recent intervals whose neighbours differ by <= tolerance.
        m = 1
        while m < len(iv):
            a, b = iv[-m - 1], iv[-m]
            if a < p.periodic_min_interval or abs(b - a) > p.periodic_tolerance * max(a, b):
                break
            m += 1
        if m < need:
            self.periodic = None
            return
        run = iv[-m:]
        shrinking = (m >= p.periodic_escalate_min_spikes - 1
                     and all(b < a for a, b in zip(run, run[1:]))
                     and run[-1] <= p.periodic_shrink * run[0])
        self.periodic = {"period": _median(run), "last_interval": run[-1], "count": m + 1,
                         "shrinking": shrinking, "last_onset": ons[-1], "first_onset": ons[-m - 1],
                         "intervals": run}

    def rollback(self, s: int, p: Policy) -> list[Spike]:
        """Closes what a rollback abandons; returns the spikes it completes."""
        done = [self._finish(q, s, p) for q in self.pending]
        self.pending = []
        if self.open is not None:
            o = self.open
            post = math.fsum(x for _, x in self.recent) / len(self.recent)
            done.append(self._spike(o, None, post, s, "pathological", rolled_back=True))
            self.open = None
        self.elevated = None
        self.periodic = None
        return done

    def to_dict(self) -> dict[str, Any]:
        def enc_map(m):
            if m is None:
                return None
            return {k: (enc_float(v) if isinstance(v, float) else v) for k, v in m.items()}

        return {
            "metric": self.metric,
            "last_step": self.last_step,
            "trend": enc_float(self.trend),
            "prev_learned": enc_float(self.prev_learned),
            "var": enc_float(self.var),
            "wsum": enc_float(self.wsum),
            "n_active": self.n_active,
            "open": enc_map(self.open),
            "elevated": enc_map(self.elevated),
            "pending": [enc_map(q) for q in self.pending],
            "onsets": list(self.onsets),
            "periodic": enc_map(self.periodic),
            "recent_steps": [x for x, _ in self.recent],
            "recent_vals": enc_floats(v for _, v in self.recent),
            "score": self.score.to_dict(),
            "last_value": enc_float(self.last_value),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], p: Policy | None = None) -> "SpikeTracker":
        float_keys = {"peak", "pre_trend", "pre_scale", "post_sum", "period", "last_interval"}

        def dec_map(m):
            if m is None:
                return None
            return {k: (dec_float(v) if k in float_keys else v) for k, v in m.items()}

        t = cls(d["metric"], p if p is not None else Policy())
        t.last_step = d["last_step"]
        t.trend, t.var, t.wsum = dec_float(d["trend"]), dec_float(d["var"]), dec_float(d["wsum"])
        t.prev_learned = dec_float(d.get("prev_learned", "nan"))
        t.n_active = int(d["n_active"])
        t.open = dec_map(d["open"])
        t.elevated = dec_map(d["elevated"])
        t.pending = [dec_map(q) for q in d["pending"]]
        t.onsets.extend(int(x) for x in d["onsets"])
        t.periodic = dec_map(d["periodic"])
        t.recent.extend(zip((int(x) for x in d["recent_steps"]), dec_floats(d["recent_vals"])))
        t.score = ScoreWindow.from_dict(d["score"])
        t.last_value = dec_float(d["last_value"])
        return t


# --------------------------------------------------------------------------
# A figure's own band: jumps against its noise, drift against its own drift.
# --------------------------------------------------------------------------


class DriftBand:
    """Departures of one figure ``y`` (a log) from its own recent history.

    At each sample ``(t, y)`` (model time), for each window ``W`` of ``windows``::

        d     = y - y_prev                                 one-sample change
        noise = sqrt(EMA of d^2)                           its sample-to-sample noise
        c_W   = y - y(t - W)                               change over the last W steps
        D_W   = max(D_W * 0.5 ** (dt / memory), |c_W(u)|)  the largest change over W
                                                           steps it showed up to W steps
                                                           ago (u <= t - W; fading)

    A departure opens (``anchor`` = the level it left, ``sign`` its direction):

    - **jump**: ``|d| >= max(log(jump), z * noise)``: confirmed at once (from the
      second change on: the first one only teaches ``noise``; until 3 changes were learned
      the ``z * noise`` term is left out: a sparse figure's first changes say little);
    - **step**: ``|d| > max(log(band), z * noise)``: a candidate;
    - **drift**: ``|c_W| > max(log(band), k * D_W, z * noise)`` for some ``W``: a
      candidate (``anchor = y(t - W)``; the noise term matters where samples are
      sparse, ``c_W`` then being one noisy change).

    It holds while ``sign * (y - anchor) > hold`` (``log(band)`` for a candidate,
    ``hysteresis * log(band)`` once confirmed) and is confirmed after ``confirm``
    samples; otherwise it ends. ``noise`` and ``D_W`` learn only from samples in
    band (a fault never widens the band it is judged by); a change enters ``D_W``
    only ``W`` steps after it was seen, so a creep is judged against the drift
    before it, not against its own growth; until 3 changes have entered it, ``D_W``
    is the largest change seen so far once those span ``W / 2`` steps (a cold
    start: a creep already under way is learned as the figure's own drift). Two windows
    (``W`` and ``4 W`` by default) see a fast creep early and a slow one once it
    has outgrown the group's drift. History: one sample per ``max(windows) // 32``
    steps (the latest kept), spanning the longest window.
    """

    __slots__ = ("ts", "ys", "last_t", "last_y", "var", "nvar", "drift", "ndrift", "drift_t",
                 "fresh", "dh_t", "dh_d", "anchor", "sign", "onset", "run", "kind", "stat", "window")

    def __init__(self, nwin: int = 2) -> None:
        self.ts: list[int] = []
        self.ys: list[float] = []
        self.last_t: int | None = None
        self.last_y = _NAN
        self.var = 0.0
        self.nvar = 0
        self.drift = [0.0] * nwin               # D_W per window
        self.ndrift = [0] * nwin
        self.drift_t = [0] * nwin
        self.fresh: list[list[list]] = [[] for _ in range(nwin)]   # [t, |c|] not yet W old
        self.dh_t: list[int] = []      # D_W0 once matured (3 samples), and when: spanning the
        self.dh_d: list[float] = []    # longest window
        self.anchor: float | None = None
        self.sign = 0
        self.onset = 0
        self.run = 0
        self.kind = ""
        self.stat = _NAN   # the one-sample change (jump/step) or the W-step change (drift)
        self.window = 0    # the window of a drift departure

    @property
    def noise(self) -> float | None:
        return math.sqrt(self.var) if self.nvar >= 3 else None

    def natural(self, i: int = 0, windows: tuple[int, ...] = (), t: int | None = None) -> float | None:
        """``D_W`` of window ``i``: the largest change over it the figure showed
        (``None`` before 3 samples matured). A longer window not matured yet takes
        the first window's as it was when the longer window now judged began (``t -
        W_i + W_0``: before a creep that started within it), scaled by the windows'
        ratio (a steady drift's)."""
        if self.ndrift[i] >= 3:
            return self.drift[i]
        if i and len(windows) > i and t is not None:
            then = t - windows[i] + windows[0]
            k = bisect.bisect_right(self.dh_t, then) - 1
            if k >= 0:
                return self.dh_d[k] * windows[i] / windows[0]
        fresh = self.fresh[i]
        if fresh and len(windows) > i and fresh[-1][0] - fresh[0][0] >= windows[i] // 2:
            return max(c for _, c in fresh)   # cold start: the largest change so far, unlagged
        return None

    def _at(self, x: int) -> float | None:
        """``y`` at model time ``x`` (linear between the samples around it; None before them)."""
        ts, ys = self.ts, self.ys
        if not ts or ts[0] > x:
            return None
        i = bisect.bisect_right(ts, x) - 1
        if i + 1 >= len(ts) or ts[i] == x:
            return ys[i]
        return ys[i] + (ys[i + 1] - ys[i]) * (x - ts[i]) / (ts[i + 1] - ts[i])

    def _keep(self, t: int, y: float, span: int) -> None:
        if len(self.ts) >= 2 and t - self.ts[-2] < max(1, span // 32):
            self.ts[-1], self.ys[-1] = t, y     # the last slot floats until a stride past the one before
        else:
            self.ts.append(t)
            self.ys.append(y)
        k = bisect.bisect_left(self.ts, t - span) - 1   # one sample at or before t - span
        if k > 0:
            del self.ts[:k], self.ys[:k]
        k = bisect.bisect_left(self.dh_t, t - span) - 1
        if k > 0:
            del self.dh_t[:k], self.dh_d[:k]

    def observe(self, s: int, t: int, y: float, band: float, jump: float, z: float, k: float,
                windows: tuple[int, ...], memory: float, confirm: int, hysteresis: float,
                abrupt: bool = True) -> bool:
        """Feeds one sample; True while a confirmed departure holds (see the class doc;
        ``abrupt=False``: drift departures only)."""
        lband = math.log(band)
        prev = self.last_y if self.last_t is not None else None
        past = [self._at(t - w) for w in windows]
        if self.anchor is not None:
            dev = (y - self.anchor) * self.sign
            if dev > lband * (hysteresis if self.run >= confirm else 1.0):
                self.run = min(self.run + 1, confirm)
            else:
                self.anchor, self.run, self.kind = None, 0, ""
        elif prev is not None:
            d = y - prev
            noise = self.noise
            zn = z * (noise if noise is not None else math.sqrt(self.var))
            # Before 3 changes were learned (sparse samples: a heavy family every 500 steps)
            # their spread says little: a jump needs only to be one.
            zj = zn if noise is not None else 0.0
            if abrupt and self.nvar and abs(d) >= max(math.log(jump), zj):
                self._open(s, prev, d, "jump", confirm)
            elif abrupt and noise is not None and abs(d) > max(lband, zn):
                self._open(s, prev, d, "step", 1)
            else:
                for i, (w, yp) in enumerate(zip(windows, past)):
                    nat = self.natural(i, windows, t)
                    if yp is not None and nat is not None and abs(y - yp) > max(lband, k * nat, zn):
                        self._open(s, yp, y - yp, "drift", 1)
                        self.window = w
                        break
                else:                                    # in band: learn
                    self.var += (d * d - self.var) / min(self.nvar + 1, 16)
                    self.nvar += 1
                    for i, (w, yp) in enumerate(zip(windows, past)):
                        if yp is not None:
                            self._learn_drift(i, t, abs(y - yp), w, memory)
        self.last_t, self.last_y = t, y
        self._keep(t, y, max(windows))
        return self.anchor is not None and self.run >= confirm

    def _learn_drift(self, i: int, t: int, c: float, window: int, memory: float) -> None:
        fresh = self.fresh[i]
        if fresh and t - fresh[-1][0] < max(1, window // 16):
            fresh[-1][1] = max(fresh[-1][1], c)
        else:
            fresh.append([t, c])
        while fresh and fresh[0][0] <= t - window:
            u, cu = fresh.pop(0)
            dt = max(u - self.drift_t[i], 0) if self.ndrift[i] else 0
            self.drift[i] = max(self.drift[i] * 0.5 ** (dt / memory), cu)
            self.drift_t[i] = u
            self.ndrift[i] += 1
            if i == 0 and self.ndrift[0] >= 3:
                self.dh_t.append(u)
                self.dh_d.append(self.drift[0])

    def _open(self, s: int, anchor: float, change: float, kind: str, run: int) -> None:
        self.anchor, self.sign, self.onset, self.run = anchor, 1 if change > 0 else -1, s, run
        self.kind, self.stat, self.window = kind, change, 0

    def rollback(self, t_to: int) -> None:
        """Forgets samples after model time ``t_to`` and any open departure."""
        k = bisect.bisect_right(self.ts, t_to)
        del self.ts[k:], self.ys[k:]
        for fresh in self.fresh:
            fresh[:] = [x for x in fresh if x[0] <= t_to]
        k = bisect.bisect_right(self.dh_t, t_to)
        del self.dh_t[k:], self.dh_d[k:]
        self.last_t = self.ts[-1] if self.ts else None
        self.last_y = self.ys[-1] if self.ys else _NAN
        self.anchor, self.run, self.kind = None, 0, ""

    def to_dict(self) -> dict[str, Any]:
        return {k: enc_state(getattr(self, k)) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DriftBand":
        b = cls(len(d["drift"]))
        for k in cls.__slots__:
            setattr(b, k, dec_state(d[k], getattr(b, k)))
        b.drift = dec_floats(d["drift"])
        return b


# --------------------------------------------------------------------------
# Train/val gap.
# --------------------------------------------------------------------------


class GapSeries:
    """(t, gap) samples covering the last ``2 * val_gap_window`` steps.

    Keeps one sample at or before ``t - 2W`` so both window ends can be
    linearly interpolated: ``g(x)`` between the samples around ``x``.
    """

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.gs: list[float] = []
        self.head = 0

    def add(self, t: int, g: float, span: int) -> None:
        self.ts.append(t)
        self.gs.append(g)
        while self.head + 1 < len(self.ts) and self.ts[self.head + 1] <= t - span:
            self.head += 1
        if self.head > 64 and self.head * 2 > len(self.ts):
            del self.ts[: self.head]
            del self.gs[: self.head]
            self.head = 0

    def covers(self, x: int) -> bool:
        return self.head < len(self.ts) and self.ts[self.head] <= x

    def at(self, x: int) -> float:
        i = bisect.bisect_right(self.ts, x, self.head) - 1
        if i + 1 >= len(self.ts) or self.ts[i] == x:
            return self.gs[i]
        t0, t1 = self.ts[i], self.ts[i + 1]
        return self.gs[i] + (self.gs[i + 1] - self.gs[i]) * (x - t0) / (t1 - t0)

    def max_before(self, x: int) -> float:
        """The largest gap of the samples kept at or before ``x`` (-inf if none)."""
        hi = bisect.bisect_right(self.ts, x, self.head)
        return max(self.gs[self.head:hi], default=-math.inf)

    def drop_after(self, t: int) -> None:
        keep = [i for i in range(self.head, len(self.ts)) if self.ts[i] <= t]
        self.ts = [self.ts[i] for i in keep]
        self.gs = [self.gs[i] for i in keep]
        self.head = 0

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts[self.head:], "gs": enc_floats(self.gs[self.head:])}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GapSeries":
        g = cls()
        g.ts = [int(x) for x in d["ts"]]
        g.gs = dec_floats(d["gs"])
        return g


# --------------------------------------------------------------------------
# Per-layer history for localization.
# --------------------------------------------------------------------------


class LayerHistory:
    """Fixed-size NumPy history of the localization candidates.

    One row per ``stride`` steps of model time (later samples within a stride
    are merged into the row), ``rows`` rows in a ring, one column per metric
    (at most ``max_columns``). Missing values are NaN; non-finite values are
    stored as ``+inf``. Each column gets a median baseline over its baseline
    window (from the rows, when the window closes; ``mean``), for
    ``Monitor.baseline``.
    """

    def __init__(self, rows: int, stride: int) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.stride = max(1, stride)
        cap = 16
        self.data = np.full((rows, cap), np.nan)
        self.steps = np.zeros(rows, np.int64)
        self.ts = np.zeros(rows, np.int64)
        self.pos = 0
        self.n = 0
        self.mean = np.full(cap, np.nan)
        self.pending = 0

    def column(self, name: str, max_columns: int) -> int:
        """Column of ``name``, created if new (``-1`` once full)."""
        c = self.index.get(name)
        if c is not None:
            return c
        if len(self.names) >= max_columns:
            return -1
        c = len(self.names)
        if c >= self.data.shape[1]:
            cap = 2 * self.data.shape[1]
            data = np.full((self.data.shape[0], cap), np.nan)
            data[:, :c] = self.data
            self.data = data
            mean = np.full(cap, np.nan)
            mean[:c] = self.mean[:c]
            self.mean = mean
        self.names.append(name)
        self.index[name] = c
        self.pending += 1
        return c

    def observe(self, s: int, t: int, cols: np.ndarray, vals: np.ndarray, p: Policy,
                start: int | None) -> None:
        """Records one sample of the columns ``cols`` (values ``vals``)."""
        finite = np.isfinite(vals)
        if not finite.all():
            vals = np.where(finite, vals, np.inf)
        if self.n and 0 <= t - int(self.ts[self.pos - 1]) < self.stride:
            self.data[self.pos - 1, cols] = vals
        else:
            row = self.data[self.pos]
            row.fill(np.nan)
            row[cols] = vals
            self.steps[self.pos] = s
            self.ts[self.pos] = t
            self.pos = (self.pos + 1) % self.data.shape[0]
            self.n = min(self.n + 1, self.data.shape[0])
        if self.pending and start is not None and t >= start + p.baseline_steps - 1:
            self._baselines(start, p)

    def _baselines(self, start: int, p: Policy) -> None:
        ncol = len(self.names)
        todo = np.flatnonzero(np.isnan(self.mean[:ncol]))
        order = self._chrono()
        order = order[self.ts[order] >= start]
        h = self.data[order][:, todo]
        h = np.where(np.isfinite(h), h, np.nan)
        ok = ~np.isnan(h)
        rank = np.cumsum(ok, axis=0)
        in_win = (self.ts[order] < start + p.baseline_steps)[:, None] | (rank <= p.baseline_min_samples)
        h = np.where(in_win & ok, h, np.nan)
        cnt = (~np.isnan(h)).sum(axis=0)
        ready = cnt >= p.baseline_min_samples
        if ready.any():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med = np.nanmedian(h[:, ready], axis=0)
            self.mean[todo[ready]] = med
            self.pending = int(np.isnan(self.mean[:ncol]).sum())

    def _chrono(self) -> np.ndarray:
        r = self.data.shape[0]
        return (np.arange(self.pos - self.n, self.pos) % r)

    def chrono(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, model times, data[rows, columns])`` oldest first."""
        order = self._chrono()
        return self.steps[order], self.ts[order], self.data[order, :len(self.names)]

    def drop_after(self, t: int) -> None:
        """Forgets rows of model time > ``t`` (an abandoned trajectory)."""
        order = self._chrono()
        keep = order[self.ts[order] <= t]
        data, steps, ts = self.data[keep].copy(), self.steps[keep].copy(), self.ts[keep].copy()
        self.data.fill(np.nan)
        k = len(keep)
        self.data[:k], self.steps[:k], self.ts[:k] = data, steps, ts
        self.n = k
        self.pos = k % self.data.shape[0]

    def to_dict(self) -> dict[str, Any]:
        order = self._chrono()
        ncol = len(self.names)
        return {
            "names": list(self.names),
            "stride": self.stride,
            "rows": self.data.shape[0],
            "steps": self.steps[order].tolist(),
            "ts": self.ts[order].tolist(),
            "data": [enc_floats(r) for r in self.data[order, :ncol].tolist()],
            "mean": enc_floats(self.mean[:ncol].tolist()),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], rows: int, stride: int) -> "LayerHistory":
        h = cls(rows, stride)
        for name in d["names"]:
            h.column(name, len(d["names"]))
        ncol = len(h.names)
        h.mean[:ncol] = dec_floats(d["mean"])
        h.pending = int(np.isnan(h.mean[:ncol]).sum())
        data = [dec_floats(r) for r in d["data"]][-rows:]
        k = len(data)
        if k:
            h.data[:k, :ncol] = np.asarray(data, dtype=np.float64).reshape(k, ncol)
        h.steps[:k] = d["steps"][len(d["steps"]) - k:]
        h.ts[:k] = d["ts"][len(d["ts"]) - k:]
        h.n = k
        h.pos = k % rows
        return h
