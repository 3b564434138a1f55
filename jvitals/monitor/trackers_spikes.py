"""Spike anatomy: :class:`SpikeTracker` (trend / band, spike onsets and recoveries,
periodicity) and :class:`ScoreWindow` (the fraction of checks flagged over N steps).
"""

from __future__ import annotations

import collections
import math
from typing import Any

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.codec import dec_float, dec_floats, enc_float, enc_floats
from jvitals.monitor.policy import Policy
from jvitals.monitor.robust import median
from jvitals.monitor.types import Spike

__all__ = ["ScoreWindow", "SpikeTracker"]


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

    def state_dict(self) -> dict[str, Any]:
        return {"width": self.width, "ids": self.ids, "obs": self.obs, "flags": self.flags,
                "tot_obs": self.tot_obs, "tot_flags": self.tot_flags, "cur": self.cur}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "ScoreWindow":
        w = cls(1, len(d["ids"]))
        w.width = int(d["width"])
        w.ids, w.obs, w.flags = list(d["ids"]), list(d["obs"]), list(d["flags"])
        w.tot_obs, w.tot_flags, w.cur = int(d["tot_obs"]), int(d["tot_flags"]), d["cur"]
        return w


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
        self.score = ScoreWindow(p.spike.score_window)
        self.last_value = _NAN

    @property
    def scale(self) -> float:
        return math.sqrt(self.var / self.wsum) if self.wsum > 0 else 0.0

    def _learn(self, s: int, v: float, p: Policy, warm: bool = False) -> None:
        if self.trend != self.trend:
            self.trend = self.prev_learned = v
            return
        dt = max(s - self.last_step, 1) if self.last_step is not None else 1
        a = 0.5 ** (dt / p.spike.trend_halflife)
        prev, self.prev_learned = self.prev_learned, v
        if not warm and prev == prev:  # the noise scale is a baseline: learned after warm-up
            b = 0.5 ** (dt / p.spike.scale_halflife)
            d = v - prev
            self.var = b * self.var + (1.0 - b) * 0.5 * d * d
            self.wsum = b * self.wsum + (1.0 - b)
        self.trend = a * self.trend + (1.0 - a) * v

    def beyond(self, v: float, warm: bool, p: Policy) -> bool:
        """Whether ``v`` would be above the onset band now (of the open spike, or of the
        trend once the band is ready), without learning from it."""
        o = self.open
        if o is not None:
            return v > o["pre_trend"] + _margin(o["pre_trend"], o["pre_scale"], p.spike.z, p.spike.min_ratio)
        ready = self.n_active >= p.spike.min_samples or (self.n_active >= 5 and self.wsum >= 0.5)
        trend = self.trend
        return (not warm and ready and trend == trend
                and v > trend + _margin(trend, self.scale, p.spike.z, p.spike.min_ratio))

    def observe(self, s: int, v: float, warm: bool, p: Policy) -> list[Spike]:
        """Feeds one finite sample; returns the spikes completed at this sample."""
        done: list[Spike] = []
        self.last_value = v
        recent = self.recent
        recent.append((s, v))
        while recent[0][0] <= s - p.spike.post_window and len(recent) > 1:
            recent.popleft()
        if self.pending:
            keep = []
            for q in self.pending:
                end = q["recovery_step"] + p.spike.post_window
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
            if v > pre + _margin(pre, sc, p.spike.z, p.spike.min_ratio):
                o["last_above"] = s
                flag = True
            if v <= pre + _margin(pre, sc, p.spike.recover_z, p.spike.recover_ratio):
                self.open = None
                q = dict(o, recovery_step=s, post_sum=v, post_n=1)
                if p.spike.post_window <= 0:
                    done.append(self._finish(q, s, p))
                else:
                    self.pending.append(q)
                self._learn(s, v, p)
            elif s - o["onset"] >= p.spike.pathological_steps:
                self.open = None
                settle = math.fsum(x for _, x in recent) / len(recent)
                done.append(self._spike(o, None, settle, s, "pathological"))
                self.elevated = {"pre_trend": pre, "pre_scale": sc, "onset": o["onset"], "since": s}
                self.trend = settle
        else:
            trend = self.trend
            ready = self.n_active >= p.spike.min_samples or (
                self.n_active >= 5 and self.wsum >= 0.5)  # sparse cadence: >= 1 scale half-life
            if (not warm and ready and trend == trend
                    and v > trend + _margin(trend, self.scale, p.spike.z, p.spike.min_ratio)):
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
            if (v <= e["pre_trend"] + _margin(e["pre_trend"], e["pre_scale"], p.spike.recover_z,
                                              p.spike.recover_ratio)
                    or s - e["onset"] > p.spike.forget_steps):
                self.elevated = None
        per = self.periodic
        if per is not None and s - per["last_onset"] > (1.0 + 2.0 * p.spike.periodic_tolerance) * per["last_interval"]:
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
        kind = ("physiological" if rec <= p.spike.physiological_steps
                else "slow" if rec <= p.spike.pathological_steps else "pathological")
        return self._spike(q, q["recovery_step"], q["post_sum"] / q["post_n"], s, kind)

    def _check_periodic(self, p: Policy) -> None:
        ons = list(self.onsets)
        iv = [b - a for a, b in zip(ons, ons[1:])]
        need = p.spike.periodic_min_spikes - 1
        if len(iv) < need or iv[-1] < p.spike.periodic_min_interval:
            self.periodic = None
            return
        # Longest run of recent intervals whose neighbours differ by <= tolerance.
        m = 1
        while m < len(iv):
            a, b = iv[-m - 1], iv[-m]
            if a < p.spike.periodic_min_interval or abs(b - a) > p.spike.periodic_tolerance * max(a, b):
                break
            m += 1
        if m < need:
            self.periodic = None
            return
        run = iv[-m:]
        shrinking = (m >= p.spike.periodic_escalate_min_spikes - 1
                     and all(b < a for a, b in zip(run, run[1:]))
                     and run[-1] <= p.spike.periodic_shrink * run[0])
        self.periodic = {"period": median(run), "last_interval": run[-1], "count": m + 1,
                         "shrinking": shrinking, "last_onset": ons[-1], "first_onset": ons[-m - 1],
                         "intervals": run}

    def rewind(self, s: int, p: Policy) -> list[Spike]:
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

    def state_dict(self) -> dict[str, Any]:
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
            "score": self.score.state_dict(),
            "last_value": enc_float(self.last_value),
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, Any], p: Policy | None = None) -> "SpikeTracker":
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
        t.score = ScoreWindow.from_state_dict(d["score"])
        t.last_value = dec_float(d["last_value"])
        return t
