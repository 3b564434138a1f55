"""Rules for what the cadence leaves between two checks: the window since the last check,
the first checks before the baselines are armed, a degrading data pipeline, the run's own
throughput.

The host checks once per ``cadence`` steps and the recorder's window
(:mod:`jvitals.metrics.window`) hands it what happened in between: a non-finite or skipped
step is dated to its own step, not to the check that saw it. The rules, their ids and
levels: the rule table in docs/MONITOR.md; the window's names and why each rule judges
the way it does: docs/MONITOR.md, "The window rules (between the checks)".
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.robust import mann_kendall_z, median, theil_sen
from jvitals.monitor.rules_base import Figures
from jvitals.monitor.trackers_baselines import DriftBaseline
from jvitals.monitor.types import Change, Level, Reading, RuleBase, Spike, release, set_

__all__ = ["DataRule", "EarlyRule", "NonFiniteRule", "SkipRule", "ThroughputRule", "WINDOW", "WindowSpikes",
           "window_peak"]

WINDOW = "window/"
_SHORT = {"loss": "loss", "grad/global_norm": "grad_norm"}


def _ago_step(f: Figures, name: str) -> int | None:
    """The step of a window event (``check step - ago``), None when there was none."""
    ago = f.get(WINDOW + name)
    if ago is None or not ago >= 0:
        return None
    return f.step - int(round(ago))


def window_peak(f: Figures, metric: str) -> tuple[int, float] | None:
    """``(step, value)`` of the window's maximum of ``metric`` when :class:`WindowSpikes`
    found it an outlier of the steps before it (None otherwise)."""
    return f.notes.window_peaks.get(metric)


class WindowSpikes(RuleBase):
    """Finds the spikes between two checks in the windows, for the spike rule (no alert).

    For each ``spike_metrics`` figure, the windows of the last ``rolling_window`` steps or
    more (at least ``window_min_steps`` of them) are pooled into the per-step mean ``mu``
    and standard deviation ``sd`` (``sum n (std^2 + (mean - mu)^2) / sum n``), so the
    test is OLMo-core's loss rule applied to every step between the checks::

        peak = window max, at step check - max_ago (before the check, above its value)
        an outlier when peak > mu + spike_z * sd

    Such a peak is published in ``notes.window_peaks`` and in the verdict's scores
    (``monitor/loss_window_peak`` and ``monitor/loss_window_peak_step``; ``grad_norm`` for
    the gradient norm); the spike rule feeds it to the metric's spike tracker at its own
    step before the check's value (its anatomy, the periodic-spike rule and the spike
    scores see it). In the tuning corpus' 78,000 healthy steps
    this test, fed every step, fires once.
    """

    name = "window_spikes"
    alert_ids = ()   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = ()
    state_fields = ("pools",)

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.pools: dict[str, list] = {}        # metric -> [[t, n, mean, var], ...]

    def check(self, f: Figures) -> list[Change]:
        p, peaks = self.p, {}
        for m in p.spike.metrics:
            n, mean, sd = (f.get(f"{WINDOW}{m}.{k}") for k in ("n", "mean", "std"))
            if n is None or mean is None or sd is None or not (n >= 1 and math.isfinite(mean) and math.isfinite(sd)):
                continue
            pool = self.pools.setdefault(m, [])
            tot = sum(x[1] for x in pool)
            if tot >= p.between.window_min_steps:
                mu = sum(x[1] * x[2] for x in pool) / tot
                var = sum(x[1] * (x[3] + (x[2] - mu) ** 2) for x in pool) / tot
                peak = self._peak(f, m)
                if peak is not None and peak[1] > mu + p.spike.z * math.sqrt(var):
                    peaks[m] = peak
                    short = _SHORT.get(m, m.replace("/", "_"))
                    f.scores[f"monitor/{short}_window_peak"] = peak[1]
                    f.scores[f"monitor/{short}_window_peak_step"] = float(peak[0])
            pool.append([f.t, n, mean, sd * sd])
            while len(pool) > 1 and sum(x[1] for x in pool[1:]) >= p.baselines.rolling_window:
                pool.pop(0)
        if peaks:
            f.notes.window_peaks = peaks
        return []

    @staticmethod
    def _peak(f: Figures, metric: str) -> tuple[int, float] | None:
        mx, ago = f.get(f"{WINDOW}{metric}.max"), f.get(f"{WINDOW}{metric}.max_ago")
        v = f.get(metric)
        if mx is None or ago is None or not ago >= 1 or not math.isfinite(mx):
            return None
        if v is not None and math.isfinite(v) and mx <= v:
            return None
        return f.step - int(round(ago)), mx

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.pools = {m: [x for x in pool if x[0] <= t_to] for m, pool in self.pools.items()}
        return []


class NonFiniteRule(RuleBase):
    """ORANGE while ``nonfinite_metrics`` are non-finite or ``nonfinite_count_metrics`` are
    > 0 at the check (judged from the first check), or when the window since the last check
    held a step whose loss or gradient was non-finite (key ``window``; onset: the first such
    step). Under a dynamic loss scale (``loss_scale_metric`` logged) non-finite gradients
    with a finite loss are the scale's overflow, the loss-scale rule's to judge."""

    name = "nonfinite"
    alert_ids = ("nonfinite",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.ORANGE,)

    def check(self, f: Figures) -> list[Change]:
        out, seen_bad = [], False
        for m in self.p.system.nonfinite_metrics:
            v = f.get(m)
            if v is None:
                continue
            if math.isfinite(v):
                out.append(release("nonfinite", m))
            else:
                seen_bad = True
                out.append(set_("nonfinite", m, Level.ORANGE, Reading(v, _NAN, _NAN),
                                f"{m} is non-finite ({v}).", f"{m} went non-finite"))
        for m in self.p.system.nonfinite_count_metrics:
            v = f.get(m)
            if v is None:
                continue
            if v == 0:
                out.append(release("nonfinite", m))
            else:
                seen_bad = True
                out.append(set_("nonfinite", m, Level.ORANGE, Reading(v, 0.0, _NAN),
                                f"{m} = {v:g}: gradients hold non-finite elements.",
                                "gradients went non-finite"))
        out += self._window(f, seen_bad)
        return out

    def _window(self, f: Figures, seen_bad: bool) -> list[Change]:
        n = f.get(WINDOW + "nonfinite_steps")
        if n is None:
            return []
        first = _ago_step(f, "first_nonfinite_ago")
        steps, loss_n = f.get(WINDOW + "steps"), f.get(WINDOW + "loss.n")
        overflow = (f.get(self.p.system.loss_scale_metric) is not None and loss_n is not None
                    and steps is not None and loss_n >= steps)
        if not n > 0 or first is None or seen_bad or overflow:
            return [release("nonfinite", "window")]
        return [set_("nonfinite", WINDOW + "nonfinite_steps", Level.ORANGE, Reading(n, 0.0, _NAN),
                     f"{n:g} update(s) since the last check had a non-finite loss or gradient, the "
                     f"first at step {first} (the recorder's window; this check's own figures are "
                     "finite).", "a step went non-finite", key="window", onset=first,
                     details={"steps": n, "first_step": first})]


class SkipRule(RuleBase):
    """An update skipped inside the step (``jvitals.skip_step``, ``optax.apply_if_finite``)
    since the last check: YELLOW at the next check with the skip's step as onset; ORANGE
    (divergent) once skips were seen at ``skip_orange_checks`` consecutive checks. Skips
    that non-finite gradients explain under a dynamic loss scale are the scale's."""

    name = "skip"
    alert_ids = ("skip",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW, Level.ORANGE)
    state_fields = ("run",)

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.run = 0

    def check(self, f: Figures) -> list[Change]:
        k = f.get(WINDOW + "skipped_steps")
        if k is None:
            return []
        first = _ago_step(f, "first_skipped_ago")
        expected = (f.get(self.p.system.loss_scale_metric) is not None
                    and (f.get(WINDOW + "nonfinite_steps") or 0.0) >= k)
        if not k > 0 or first is None or expected:
            self.run = 0
            return [release("skip", "skip")] if ("skip", "skip") in f.open else []
        self.run += 1
        p = self.p
        lvl = Level.ORANGE if self.run >= p.between.skip_orange_checks else Level.YELLOW
        again = (f" (skips at {self.run} checks running: >= skip_orange_checks = {p.between.skip_orange_checks})"
                 if lvl == Level.ORANGE else "")
        active = f.active("skip", "skip") is not None
        return [set_("skip", WINDOW + "skipped_steps", lvl, Reading(k, 0.0, _NAN),
                     f"{k:g} update(s) skipped in the step since the last check, the first at step "
                     f"{first}{again}: a loss or gradient norm far outside the run's recent history "
                     "(jvitals.skip_step) or a non-finite update (optax.apply_if_finite).",
                     "an update was skipped", key="skip", onset=None if active else first,
                     diverging=lvl >= Level.ORANGE, details={"skipped": k, "first_step": first})]

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.run = 0
        return []


class EarlyRule(RuleBase):
    """Before the baselines are armed (``baseline_steps`` after their start, or before it):
    a figure of ``early_jumps`` at least its ratio x the median of its last 8 checks
    (``early_min_samples`` of them at least, spanning ``early_min_span`` steps) is ORANGE at
    that check (onset: that check); it holds while at least half that ratio of the same
    reference, so the divergence rule turns an unrecovered jump RED. In the tuning corpus'
    first 800 steps healthy runs moved 1.28x (loss) and 5.4x (grad norm) at most."""

    name = "early"
    alert_ids = ("early",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.ORANGE,)
    state_fields = ("hist", "anchor", "armed_at")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.hist: dict[str, list] = {m: [] for m in policy.between.early_jumps}
        self.anchor: dict[str, list] = {}       # metric -> [reference, onset step]
        self.armed_at: int | None = None        # the step the regular baselines took over

    def check(self, f: Figures) -> list[Change]:
        p, out = self.p, []
        armed = f.start is not None and f.t >= f.start + p.baselines.steps
        for m, jump in p.between.early_jumps.items():
            v = f.get(m)
            if v is None or not (math.isfinite(v) and v > 0):
                continue
            a = self.anchor.get(m)
            if armed and a is None:
                self.hist[m] = []
                self.armed_at = f.step if self.armed_at is None else self.armed_at
                continue
            h = self.hist.setdefault(m, [])
            ref = (median([x for _, x in h]) if len(h) >= p.between.early_min_samples
                   and f.t - h[0][0] >= p.between.early_min_span else None)
            if a is None and ref is not None and ref > 0 and v >= jump * ref:
                a = self.anchor[m] = [ref, f.step]
            if a is not None:
                if v >= 0.5 * jump * a[0]:
                    out.append(set_("early", m, Level.ORANGE, Reading(v, a[0], v / a[0]),
                                    f"{m} = {v:.4g} is {v / a[0]:.1f}x the median of the checks before it "
                                    f"({a[0]:.4g}), before the run's baselines were armed (>= "
                                    f"Policy.early_jumps[{m!r}] = {jump:g}x); RED if it does not recover.",
                                    f"{m} jumped {v / a[0]:.0f}x", onset=a[1]))
                    continue
                self.anchor.pop(m, None)
                out.append(release("early", m))
            h.append([f.t, v])
            del h[:-8]
        return out

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.anchor = {}
        for h in self.hist.values():
            h[:] = [x for x in h if x[0] <= t_to]
        return []


class RepeatRule(RuleBase):
    """The train loss collapsing: the data repeats.

    A model trained on fresh batches lowers its loss by percents per thousand steps once
    past its first steps; a loss that falls ``repeat_collapse`` (3) x below the median of the
    checks of the last ``repeat_window`` (200) steps, after the baselines are armed, is the
    loss of batches the model has seen before (a shard on a loop, a broken shuffle, an epoch
    of a tiny set: it memorises them) and will not hold on fresh data. The sample is the
    window's mean loss (the check's loss without a window)::

        YELLOW  sample <= median(samples over the last repeat_window steps) / repeat_collapse

    held while the sample stays below ``hysteresis`` x that reference, then released (the
    loss jumps back up when the stream resumes: the spike rule sees that).
    """

    name = "repeat"
    alert_ids = ("repeat",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("hist", "ref")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.hist: list[list[float]] = []   # [t, sample]
        self.ref = _NAN                     # the open alert's reference

    def check(self, f: Figures) -> list[Change]:
        p, m = self.p, "loss"
        x = f.get(WINDOW + "loss.mean") if (f.get(WINDOW + "loss.n") or 0) >= 1 else None
        x = f.get(m) if x is None else x
        if x is None or not (math.isfinite(x) and x > 0):
            return []
        armed = f.start is not None and f.t >= f.start + p.baselines.steps
        past = [v for t, v in self.hist if t >= f.t - p.between.repeat_window]
        self.hist.append([f.t, x])
        self.hist = [r for r in self.hist if r[0] >= f.t - p.between.repeat_window]
        if self.ref == self.ref:               # open: held while far below its reference
            if x <= self.ref / p.between.repeat_collapse / p.alerts.hysteresis:
                return [self._set(f, x)]
            self.ref = _NAN
            return [release(self.name, m)]
        if not armed or len(past) < 3:
            return []
        ref = median(past)
        if x > ref / p.between.repeat_collapse:
            return []
        self.ref = ref
        return [self._set(f, x)]

    def _set(self, f: Figures, x: float) -> Change:
        p = self.p
        return set_(self.name, "loss", Level.YELLOW, Reading(x, self.ref, x / self.ref),
                    f"loss = {x:.4g} is {self.ref / x:.1f}x below its median over the last "
                    f"{p.between.repeat_window} steps ({self.ref:.4g}; >= BetweenConfig.repeat_collapse = "
                    f"{p.between.repeat_collapse:g}x): a model does not learn that fast from fresh batches; it "
                    "is memorising batches it has seen.", "the loss collapsed", key="loss")

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.hist = [r for r in self.hist if r[0] <= t_to]
        self.ref = _NAN
        return []


class DataRule(RuleBase):
    """The loss rising while the optimizer's figures stay in their bands: the data, not the model.

    Samples: each check's window mean loss (the check's loss without a window), averaged
    into buckets of ``data_window // 32`` steps, over the last ``data_window`` steps. Each of
    the gradient norm, the update/param ratio per unit learning rate (their window means
    where there are windows) and the parameter norm is held against its own slow reference
    (an EMA of its log, half-life ``drift_halflife``, learned while the rule does not hold)::

        rising  Mann-Kendall z of the samples > data_z and their Theil-Sen rise over the
                window >= (data_rise - 1) x their median             (>= 8 samples spanning
                                                                      half the window)
        YELLOW  rising at data_confirm checks running (after the baselines' start +
                baseline_steps), every optimizer figure within data_band x its
                reference, no ORANGE alert open

    While it holds it publishes ``notes.data``: the loss-spike rule then leaves the loss
    to it (no "LR beyond the stable region" prescription, no divergence counted from the
    loss), so a rollback that cannot help (the data stays bad) is not looped into. Once open
    it holds on the loss alone, while the latest bucket stays above ``1 + hysteresis
    (data_rise - 1)`` x the median of the window it opened on.
    """

    name = "data"
    alert_ids = ("data",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("buckets", "refs", "run", "onset", "anchor")
    _FIGS = ("grad/global_norm", "update/param_ratio", "param/global_norm")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.buckets: list[list] = []          # [bucket id, sum, count]
        self.refs: dict[str, list] = {}        # figure -> [EMA of log x, last t]
        self.run = 0
        self.onset: int | None = None
        self.anchor = _NAN                     # the window's median when the alert opened

    def _sample(self, f: Figures) -> None:
        x = f.get(WINDOW + "loss.mean") if (f.get(WINDOW + "loss.n") or 0) >= 1 else None
        x = f.get("loss") if x is None else x
        if x is None or not math.isfinite(x):
            return
        width = max(1, self.p.between.data_window // 32)
        i = f.t // width
        if self.buckets and self.buckets[-1][0] == i:
            self.buckets[-1][1] += x
            self.buckets[-1][2] += 1
        else:
            self.buckets.append([i, x, 1])
        while self.buckets and self.buckets[0][0] < i - 32:
            self.buckets.pop(0)

    def _calm(self, f: Figures, learn: bool) -> bool:
        """Whether every optimizer figure is logged and within ``data_band`` of its
        reference (without all three there is no telling the data from the optimizer)."""
        p, calm = self.p, True
        lr = f.get(p.baselines.lr_metric)
        for m in self._FIGS:
            x = f.get(m)       # the window's mean where there is one: far less noisy than one step
            if (f.get(f"{WINDOW}{m}.n") or 0) >= 1:
                x = f.get(f"{WINDOW}{m}.mean")
            if x is None or not (math.isfinite(x) and x > 0):
                calm = False
                continue
            if m == "update/param_ratio" and lr is not None and lr > 0:
                x /= lr
            y = math.log(x)
            r = self.refs.get(m)
            if r is None:
                self.refs[m] = [y, f.t]
                continue
            if abs(y - r[0]) > math.log(p.between.data_band):
                calm = False
            if learn:
                r[0] += (1.0 - 0.5 ** (max(f.t - r[1], 1) / p.baselines.drift_halflife)) * (y - r[0])
                r[1] = f.t
        return calm

    def _rising(self) -> tuple[bool, float, float]:
        """``(rising, Theil-Sen rise relative to the median, median)`` of the closed buckets."""
        p = self.p
        b = self.buckets[:-1]
        if len(b) < 8 or b[-1][0] - b[0][0] < 16:
            return False, _NAN, _NAN
        ts = np.array([x[0] for x in b], np.float64)
        ys = np.array([x[1] / x[2] for x in b], np.float64)
        med = float(np.median(ys))
        rise = theil_sen(ts, ys) * (ts[-1] - ts[0]) / med if med > 0 else _NAN
        return bool(mann_kendall_z(ys) > p.between.data_z and rise >= p.between.data_rise - 1.0), rise, med

    def check(self, f: Figures) -> list[Change]:
        p = self.p
        self._sample(f)
        active = f.active("data", "loss") is not None
        calm = self._calm(f, learn=not active)
        if f.warm or f.t < f.start + p.baselines.steps:
            return []
        rising, rise, med = self._rising()
        last = self.buckets[-2][1] / self.buckets[-2][2] if len(self.buckets) > 1 else _NAN
        worse = any(a.level >= Level.ORANGE and a.rule not in ("data", "loss_spike") for a in f.open.values())
        held = active and last >= (1.0 + p.alerts.hysteresis * (p.between.data_rise - 1.0)) * self.anchor
        if held or (rising and calm and not worse):
            self.run += 1
            self.onset = f.step if self.run == 1 else self.onset
            if self.run < p.between.data_confirm and not active:
                return []
            if not active:
                self.anchor = med
            f.notes.data = True
            return [set_("data", "loss", Level.YELLOW, Reading(last, self.anchor, last / self.anchor),
                         f"the loss has been rising over the last {p.between.data_window} steps (Mann-Kendall z > "
                         f"data_z = {p.between.data_z:g}; +{100 * rise:.0f}% over the window, >= data_rise = "
                         f"{p.between.data_rise:g}; now {last:.4g}) while the gradient norm, the update per unit "
                         f"LR and the parameter norm stayed within data_band = {p.between.data_band:g}x of their "
                         "own levels: the data, not the optimizer.",
                         "the loss rose with the optimizer calm", onset=self.onset, diverging=False,
                         details={"rise": rise, "anchor": self.anchor})]
        self.run, self.onset = 0, None
        return [release("data", "loss")] if ("data", "loss") in f.open else []

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        width = max(1, self.p.between.data_window // 32)
        self.buckets = [x for x in self.buckets if x[0] <= t_to // width]
        self.run, self.onset = 0, None
        return []


class ThroughputRule(RuleBase):
    """Throughput down beyond the run's own variability.

    The first present ``throughput_metrics`` ``x`` against a
    :class:`~jvitals.monitor.trackers_baselines.DriftBaseline` reference (learning only from checks
    within the band: it follows a machine's slow changes, not a drop), with the run's own
    noise ``sd``: the root of an EMA (half-life ``throughput_noise_halflife`` steps) of
    ``d^2``, ``d = log(x / ref)`` clipped at twice the band, learned while no alert holds
    (it starts from the baseline window's spread)::

        band   = max(-log(1 - throughput_drop), throughput_z * sd)
        YELLOW when d < -band at every check for throughput_hold_steps steps

    (onset: the first check of the drop), held while ``d < -hysteresis * band``. The least
    drop is METRICS.md §5's 30%: a steady run (4% noise) flags a 40% drop; a run whose rate
    swings widens its own band (this shared 2-core machine's healthy runs dip 25-50% for
    100-200 steps: none of the tuning corpus' 78,000 healthy steps alerts, at a check every
    10 or 50 steps).
    """

    name = "throughput"
    alert_ids = ("throughput",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("baselines", "since", "var")
    state_types = {"baselines": DriftBaseline}

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.baselines = {m: DriftBaseline() for m in policy.system.throughput_metrics}
        self.since: dict[str, int] = {}
        self.var: dict[str, list] = {}          # metric -> [EMA of d^2, weight, last t]

    def _band(self, m: str) -> tuple[float, float]:
        """``(band in log, sd)``."""
        v = self.var.get(m)
        sd = math.sqrt(v[0] / v[1]) if v and v[1] > 0 else 0.0
        return max(-math.log(1.0 - self.p.system.throughput_drop), self.p.system.throughput_z * sd), sd

    def _learn(self, m: str, t: int, d: float, band: float) -> None:
        v = self.var.setdefault(m, [0.0, 0.0, t])
        a = 0.5 ** (max(t - v[2], 1) / self.p.system.throughput_noise_halflife)
        c = max(min(d, 2.0 * band), -2.0 * band)
        v[0], v[1], v[2] = a * v[0] + (1.0 - a) * c * c, a * v[1] + (1.0 - a), t

    def check(self, f: Figures) -> list[Change]:
        p, out, judged = self.p, [], False
        for m in p.system.throughput_metrics:
            v = f.get(m)
            if v is None or not (math.isfinite(v) and v > 0):
                continue
            band, sd = self._band(m)
            is_open = f.active("throughput", m) is not None
            ref, _ = self.baselines[m].step(f.t, f.step, v, p, f.start,
                                            hold=0.0 if is_open else None,
                                            floor=math.exp(-p.alerts.hysteresis * band))
            if judged or ref is None or not ref > 0:
                continue
            judged = True
            if m not in self.var:   # cold start: the baseline window's spread (a median of d^2)
                self.var[m] = [self.baselines[m].var / 0.6745 ** 2, 1.0, f.t]
                band, sd = self._band(m)
            d = math.log(v / ref)
            if d < -band or (is_open and d < -p.alerts.hysteresis * band):
                since = self.since.setdefault(m, f.step)
                if not is_open and f.step - since < p.system.throughput_hold_steps:
                    continue
                drop = 1.0 - v / ref
                out.append(set_("throughput", m, Level.YELLOW, Reading(v, ref, v / ref),
                                f"{m} = {v:.4g} is {100 * drop:.0f}% below its baseline {ref:.4g} since "
                                f"step {since}, beyond the run's own band ({100 * (1 - math.exp(-band)):.0f}%: "
                                f"max(throughput_drop = {p.system.throughput_drop:g}, throughput_z = "
                                f"{p.system.throughput_z:g} x its noise {sd:.3f} in log)) for "
                                f"{p.system.throughput_hold_steps} steps (throughput_hold_steps).",
                                f"{m} fell {100 * drop:.0f}%", onset=since))
            else:
                self.since.pop(m, None)
                if not is_open:
                    self._learn(m, f.t, d, band)
                out.append(release("throughput", m))
        return out

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        super().load_state_dict(d)
        self.baselines = {m: self.baselines.get(m) or DriftBaseline() for m in self.p.system.throughput_metrics}

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.since = {}
        return []
