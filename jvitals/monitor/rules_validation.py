"""The validation loss: the train/val gap's growth (:class:`GapRule`) and a rising val
loss while the train loss falls (:class:`ValRiseRule`).
"""

from __future__ import annotations

import collections
import itertools
import math

import numpy as np

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.robust import mann_kendall_z, theil_sen
from jvitals.monitor.rules_base import Figures
from jvitals.monitor.trackers_bands import GapSeries
from jvitals.monitor.types import Change, Level, Reading, RuleBase, Spike, clear, release, set_

__all__ = ["GapRule", "ValRiseRule"]

class GapRule(RuleBase):
    """Train/val gap growing faster than before, beyond its noise.

    The gap ``g`` is ``val/gap`` or ``val/loss`` minus the train loss's level:
    ``2 e1 - e2`` with ``e1`` an EMA of the loss (half-life ``trend_halflife``,
    each sample clipped to 1.5x the spike tracker's trend) and ``e2`` an EMA of
    ``e1`` (Brown's double smoothing: no lag on a falling loss, which would
    otherwise read as a growing gap as the fall slows); its samples (from
    ``start + baseline_steps`` on) are smoothed by an EMA of half-life
    ``val_gap_halflife`` steps. With ``W = val_gap_window``::

        recent = g(t) - g(t-W),  before = g(t-W) - g(t-2W)  (0 before 2W of history)
        excess = recent - val_gap_ratio * max(before, 0)
        YELLOW when excess > floor = max(val_gap_min_growth * |loss|, gap_z * sd(excess))
               and g(t) > floor + the highest gap of the samples kept before t - W
               at gap_confirm consecutive samples

    (the second condition: a gap that dipped and came back, as healthy runs'
    gaps wander, is no growth).

    ``sd(excess)``: the raw samples' noise ``var = EMA((g_i - 2 g_{i-1} +
    g_{i-2})^2 / 6)`` (second differences: blind to a steady trend; learned
    while the rule does not hold) through the EMA, ``var_e = var * (1 - a) / (1 + a)`` (``a``
    its per-sample decay), and the three independent window ends,
    ``var_e * (1 + (1 + r)^2 + r^2)`` (``r = val_gap_ratio`` when ``before >
    0``, else ``2 var_e``).
    """

    name = "val_gap"
    alert_ids = ("val_gap",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("gap", "ema", "t_last", "raw_prev", "var", "decay", "run", "onset", "last_loss",
                    "level")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.gap = GapSeries()
        self.ema = _NAN
        self.t_last = 0
        self.raw_prev = [_NAN, _NAN]
        self.var = _NAN
        self.decay = _NAN
        self.run = 0
        self.onset: int | None = None
        self.last_loss = _NAN
        self.level = [_NAN, _NAN, 0]   # e1, e2, t of the last loss

    def _train_level(self, f: Figures) -> float:
        """``2 e1 - e2`` of the loss (see the class doc); NaN before any loss."""
        loss = f.get("loss")
        e1, e2, t0 = self.level
        if e1 == e1 and 0 <= f.t - t0 < max(1, self.p.spike.trend_halflife / 10) and f.get("val/loss") is None \
                and f.get("val/gap") is None:
            return 2.0 * e1 - e2      # a sample per trend_halflife / 10 steps is enough
        if loss is not None and math.isfinite(loss):
            self.last_loss = loss
            trend = f.notes.loss_trend
            x = min(loss, 1.5 * trend) if trend == trend and trend > 0 else loss
            if e1 != e1:
                e1 = e2 = x
            else:
                a = 0.5 ** (max(f.t - t0, 1) / self.p.spike.trend_halflife)
                e1 = a * e1 + (1.0 - a) * x
                e2 = a * e2 + (1.0 - a) * e1
            self.level = [e1, e2, f.t]
        return 2.0 * e1 - e2

    def check(self, f: Figures) -> list[Change]:
        p, s, t = self.p, f.step, f.t
        loss_ref = self._train_level(f)
        g = f.get("val/gap")
        vl = f.get("val/loss")
        if g is None and vl is not None:
            g = vl - loss_ref if loss_ref == loss_ref else None
        if g is None or not math.isfinite(g) or f.start is None or t < f.start + p.baselines.steps:
            return []
        w = p.validation.gap_window
        r0, r1 = self.raw_prev
        if r1 == r1 and self.run == 0:  # the noise: learned while the rule does not hold
            d2 = (g - 2.0 * r0 + r1) ** 2 / 6.0
            self.var = d2 if self.var != self.var else 0.9 * self.var + 0.1 * d2
        self.raw_prev = [g, r0]
        if self.ema != self.ema or p.validation.gap_halflife == 0:
            self.ema = g
            a = 0.0
        else:
            a = 0.5 ** (max(t - self.t_last, 1) / p.validation.gap_halflife)
            self.ema = a * self.ema + (1.0 - a) * g
        self.decay = a
        self.t_last = t
        g = self.ema
        self.gap.add(t, g, 2 * w)
        if not self.gap.covers(t - w):
            return []
        g1 = self.gap.at(t - w)
        # Before 2W of history, the growth before counts as none: the rule then asks for
        # a growth beyond its floor alone (a gap that grew from the start, as a repeated
        # data shard makes it).
        before = g1 - self.gap.at(t - 2 * w) if self.gap.covers(t - 2 * w) else 0.0
        recent = g - g1
        level_ref = abs(loss_ref) if loss_ref == loss_ref else (
            abs(vl) if vl is not None and math.isfinite(vl) else 0.0)
        var_e = (self.var if self.var == self.var else 0.0) * (1.0 - a) / (1.0 + a)
        r = p.validation.gap_ratio
        var_x = var_e * (1.0 + (1.0 + r) ** 2 + r * r) if before > 0 else 2.0 * var_e
        floor = max(p.validation.gap_min_growth * level_ref, p.validation.gap_z * math.sqrt(var_x))
        high = self.gap.max_before(t - w)       # the highest gap of the history kept before t - W
        if recent > r * max(before, 0.0) + floor and g - high > floor:
            self.run += 1
            if self.run == 1:
                self.onset = s
            if self.run < p.validation.gap_confirm and f.active("val_gap", "val/gap") is None:
                return []
            ratio = recent / before if before > 0 else math.inf
            return [set_("val_gap", "val/gap", Level.YELLOW, Reading(g, g1, ratio),
                         f"the train/val gap grew by {recent:.4g} over the last {w} steps vs "
                         f"{before:.4g} over the {w} before (> val_gap_ratio = {r:g}x, plus a floor "
                         f"{floor:.2g}: val_gap_min_growth = {p.validation.gap_min_growth:g} x the loss, "
                         f"gap_z = {p.validation.gap_z:g} noise sd {math.sqrt(var_x):.2g}); gap now {g:.4g}, "
                         f"above its earlier high {high:.4g} by more than that floor.",
                         "the train/val gap accelerated", onset=self.onset,
                         details={"recent_growth": recent, "previous_growth": before,
                                  "noise_sd": math.sqrt(var_x)})]
        self.run = 0
        return [clear("val_gap", "val/gap")]

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.gap.drop_after(t_to)
        self.ema = self.gap.gs[-1] if self.gap.gs else _NAN
        self.t_last = self.gap.ts[-1] if self.gap.ts else 0
        self.raw_prev, self.run, self.onset = [_NAN, _NAN], 0, None
        return []


class ValRiseRule(RuleBase):
    """Val loss rising while the train loss falls (METRICS.md §6, fourth row).

    Over the ``val_rise_window`` steps before each ``val/loss`` sample, extended back to
    hold ``val_rise_min_samples`` samples where they are sparser (``val/loss`` every 500
    steps, as at the README's heavy cadence: the last 8 samples, 3,500 steps; a fixed
    500-step window would never hold 8 of them, and the rule would never fire), after
    the baseline start::

        YELLOW when Mann-Kendall z(val) > val_rise_z, the val loss's Theil-Sen
               rise over the window >= val_rise_min (relative), and the loss
               trend (``notes.loss_trend`` at those samples) has a negative
               Theil-Sen slope

    at ``gap_confirm`` consecutive val samples. Quicker than the gap rule's
    two 1000-step windows, which an early overfit outruns.

    Where the samples are sparse (the last ``k = val_rise_sparse_run`` intervals span
    ``val_rise_window`` steps or more: ``val/loss`` every 500 steps), Mann-Kendall's z
    > 3 would need 7 rising samples (3,000 steps after the turn), so there::

        YELLOW when v[-k-1] < ... < v[-2] < v[-1] (a rise at each of the last k samples),
               (v[-1] - v[-k-1]) / |v[-k-1]| >= val_rise_min, and the loss trend at
               those k + 1 samples has a negative Theil-Sen slope

    at once (the k consecutive rises are the confirmation). Released when neither
    condition holds.
    """

    name = "val_rise"
    alert_ids = ("val_rise",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("ts", "val", "trend", "run", "onset")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.ts: collections.deque[int] = collections.deque()
        self.val: collections.deque[float] = collections.deque()
        self.trend: collections.deque[float] = collections.deque()
        self.run = 0
        self.onset: int | None = None

    def check(self, f: Figures) -> list[Change]:
        p = self.p
        v = f.get("val/loss")
        trend = f.notes.loss_trend
        if f.warm or v is None or not math.isfinite(v) or trend != trend:
            return []
        t, s = f.t, f.step
        self.ts.append(t)
        self.val.append(v)
        self.trend.append(trend)
        k = p.validation.rise_sparse_run
        keep = max(p.validation.rise_min_samples, k + 1)
        while self.ts and self.ts[0] < t - p.validation.rise_window and len(self.ts) > keep:
            self.ts.popleft()
            self.val.popleft()
            self.trend.popleft()
        n = len(self.ts)
        is_open = ("val_rise", "val/loss") in f.open
        sparse = self._sparse_rise(k)
        if sparse is not None:
            self.run = 0
            rise, span, v0 = sparse
            if not is_open:
                self.onset = s
            return [set_("val_rise", "val/loss", Level.YELLOW, Reading(v, v0, v / v0),
                         f"val/loss rose at each of its last {k} samples ({100 * rise:.1f}% over "
                         f"{span} steps) while the train loss still falls.", "val/loss started rising",
                         onset=self.onset, details={"rise": rise, "samples": k + 1})]
        if n < p.validation.rise_min_samples:
            return [release("val_rise", "val/loss")] if is_open else []
        u = np.fromiter(self.ts, np.float64, n)
        y = np.fromiter(self.val, np.float64, n)
        z = mann_kendall_z(y)
        rise = theil_sen(u, y) * (u[-1] - u[0]) / abs(float(np.median(y)))
        lslope = theil_sen(u, np.fromiter(self.trend, np.float64, n))
        active = f.active("val_rise", "val/loss") is not None
        if z > p.validation.rise_z and rise >= p.validation.rise_min and lslope < 0:
            self.run += 1
            if self.run == 1:
                self.onset = s
            if self.run < p.validation.gap_confirm and not active:
                return []
            return [set_("val_rise", "val/loss", Level.YELLOW, Reading(v, float(y[0]), v / float(y[0])),
                         f"val/loss has been rising ({100 * rise:.1f}% over the last "
                         f"{int(u[-1] - u[0])} steps, Mann-Kendall z = {z:.1f}) while the train "
                         "loss still falls.", "val/loss started rising", onset=self.onset,
                         details={"mann_kendall_z": z, "rise": rise})]
        self.run = 0
        return [release("val_rise", "val/loss")] if is_open else []

    def _sparse_rise(self, k: int) -> tuple[float, int, float] | None:
        """``(relative rise, span in steps, first value)`` where the last ``k`` intervals are
        sparse (span ``>= val_rise_window``) and the val loss rose at each of them by
        ``val_rise_min`` in all while the loss trend fell (the class doc); else None."""
        p = self.p.validation
        if k < 1 or len(self.ts) < k + 1:
            return None
        ts, val, trend = (list(d)[-(k + 1):] for d in (self.ts, self.val, self.trend))
        span = ts[-1] - ts[0]
        if span < p.rise_window or any(b <= a for a, b in itertools.pairwise(val)):
            return None
        rise = (val[-1] - val[0]) / abs(val[0]) if val[0] else math.inf
        if rise < p.rise_min or theil_sen(np.asarray(ts, np.float64), np.asarray(trend, np.float64)) >= 0:
            return None
        return rise, span, val[0]

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        while self.ts and self.ts[-1] > t_to:
            self.ts.pop()
            self.val.pop()
            self.trend.pop()
        self.run, self.onset = 0, None
        return []
