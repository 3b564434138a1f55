"""When the baselines start (:class:`BaselineStart`) and the four references a ratio rule
can judge against: fixed median, rolling (OLMo-core), EMA (ZClip) and drift (default).

Times: ``t`` is the monitor's model clock (the caller's step minus the steps abandoned by
rollbacks).
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.codec import dec_float, dec_floats, enc_float, enc_floats
from jvitals.monitor.policy import Policy
from jvitals.monitor.robust import median, theil_sen

__all__ = ["BASELINES", "BaselineStart", "DriftBaseline", "EmaBaseline", "FixedBaseline", "RollingBaseline"]


class BaselineStart:
    """Model time at which the baselines start (``start``; ``None`` before).

    ``Policy.baselines.warmup_steps`` set: that step. Else, with ``Policy.baselines.lr_metric``
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
        if p.baselines.warmup_steps is not None:
            if t >= p.baselines.warmup_steps:
                self.start, self.reason = p.baselines.warmup_steps, "Policy.warmup_steps"
            return self.start
        if lr is not None and math.isfinite(lr):
            prev, self.lr_prev = self.lr_prev, lr
            if prev == prev and lr <= prev * (1.0 + p.baselines.lr_plateau_tol):
                self.start, self.reason = t, "the learning rate stopped rising"
            return self.start
        if self.lr_prev == self.lr_prev:  # LR logged, not at this check: wait for it
            return self._cap(t, p)
        w = p.baselines.settle_span
        if x is not None and math.isfinite(x) and x > 0:
            self.steps.append(t)
            self.vals.append(math.log(x))
            while len(self.steps) > p.baselines.settle_min_samples and self.steps[0] < t - w:
                self.steps.popleft()
                self.vals.popleft()
            n = len(self.steps)
            if (n >= p.baselines.settle_min_samples and t - self.steps[0] >= w // 2
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
                if b == b and abs(math.expm1(b * w)) <= p.baselines.settle_tolerance:
                    self.start, self.reason = t, f"{p.baselines.settle_metric} settled"
                    return self.start
        elif not self.steps and t - self.first >= w:
            self.start, self.reason = self.first, "no learning rate or settle metric logged"
            return self.start
        return self._cap(t, p)

    def _cap(self, t: int, p: Policy) -> int | None:
        if t - self.first >= p.baselines.settle_cap:
            self.start, self.reason = t, f"settle_max_steps ({p.baselines.settle_cap}) reached"
        return self.start

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "first": self.first, "lr_prev": enc_float(self.lr_prev),
                "steps": list(self.steps), "vals": enc_floats(self.vals),
                "last_eval": self.last_eval, "reason": self.reason}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "BaselineStart":
        b = cls()
        b.start, b.first, b.last_eval, b.reason = d["start"], d["first"], d["last_eval"], d["reason"]
        b.lr_prev = dec_float(d["lr_prev"])
        b.steps.extend(int(x) for x in d["steps"])
        b.vals.extend(dec_floats(d["vals"]))
        return b


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
            end = start + p.baselines.steps
            if t < end or len(self.vals) < p.baselines.min_samples:
                self.vals.append(v)
            if len(self.vals) >= p.baselines.min_samples and t >= end - 1:
                self.mean = median(self.vals)
                self.vals = []
        return None, False

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "vals": enc_floats(self.vals), "mean": enc_float(self.mean)}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "FixedBaseline":
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
        if n >= p.baselines.adaptive_min_samples:
            mean = math.fsum(self.vals) / n
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.vals) / n)
            ref, gate = mean, v > mean + p.baselines.rolling_k * std
            v = min(v, mean + p.baselines.rolling_k * std)
        self.steps.append(s)
        self.vals.append(v)
        while len(self.vals) > p.baselines.adaptive_min_samples and self.steps[0] <= s - p.baselines.rolling_window:
            self.steps.popleft()
            self.vals.popleft()
        return ref, gate

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "rolling", "steps": list(self.steps), "vals": enc_floats(self.vals)}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "RollingBaseline":
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
            if len(self.init) >= p.baselines.adaptive_min_samples:
                n = len(self.init)
                self.mean = math.fsum(self.init) / n
                self.var = math.fsum((x - self.mean) ** 2 for x in self.init) / n
                self.init = []
            return None, False
        std = math.sqrt(self.var)
        ref, gate = self.mean, v > self.mean + p.baselines.ema_z * std
        x = min(v, self.mean + p.baselines.ema_z * std)
        a = max(p.baselines.ema_alpha ** max(s - self.last_step, 1), 1.0 - 1.0 / p.baselines.adaptive_min_samples)
        self.mean = a * self.mean + (1.0 - a) * x
        self.var = a * self.var + (1.0 - a) * (x - self.mean) ** 2
        self.last_step = s
        return ref, gate

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "ema", "init": enc_floats(self.init), "mean": enc_float(self.mean),
                "var": enc_float(self.var), "last_step": self.last_step}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "EmaBaseline":
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
            if dt < 0 or dt >= p.baselines.drift_halflife / 50:     # learns once per drift_halflife / 50 steps
                if v > 0 and hold != 0.0 and (floor is None or v > floor * ref):
                    c = self._decay
                    if c[0] != dt or c[2] != p.baselines.drift_halflife:
                        c = self._decay = (dt, 0.5 ** (max(dt, 0) / p.baselines.drift_halflife), p.baselines.drift_halflife)
                    x = math.log(v if hold is None else min(v, hold * ref))
                    d = x - self.log_mean
                    self.var = c[1] * self.var + (1.0 - c[1]) * d * d
                    self.log_mean += (1.0 - c[1]) * d
                    self.ref = math.exp(self.log_mean)
                self.last_t = t
            return ref, True
        if start is not None and t >= start and v > 0:
            end = start + p.baselines.steps
            if t < end or len(self.vals) < p.baselines.min_samples:
                self.vals.append(v)
            if len(self.vals) >= p.baselines.min_samples and t >= end - 1:
                self.log_mean, self.last_t = math.log(median(self.vals)), t
                self.ref = math.exp(self.log_mean)
                self.var = median([(math.log(x) - self.log_mean) ** 2 for x in self.vals])
                self.vals = []
        return None, False

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "drift", "vals": enc_floats(self.vals), "log_mean": enc_float(self.log_mean),
                "last_t": self.last_t, "var": enc_float(self.var)}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "DriftBaseline":
        b = cls()
        b.vals, b.log_mean, b.last_t = dec_floats(d["vals"]), dec_float(d["log_mean"]), int(d["last_t"])
        b.var = dec_float(d["var"])
        b.ref = math.exp(b.log_mean) if b.log_mean == b.log_mean else _NAN
        return b


BASELINES = {"fixed": FixedBaseline, "rolling": RollingBaseline, "ema": EmaBaseline,
             "drift": DriftBaseline}
