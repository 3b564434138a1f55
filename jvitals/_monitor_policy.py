"""The monitor's policy: every threshold and window, defaults = METRICS.md §5."""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any, Mapping

from jvitals._monitor_trackers import BASELINES

__all__ = ["Policy"]


def _default_ratio_rules() -> Mapping[str, tuple[float, float | None]]:
    return {"grad/global_norm": (2.0, 3.0), "param/global_norm": (1.5, None)}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Alert thresholds and windows; defaults are METRICS.md §5.

    Every window is in steps (not in number of checks), so the same policy
    works at any host cadence; ``red_after`` counts checks, as §5 does.

    Attributes:
      warmup_steps: steps ignored by every rule but ``nonfinite``.
      baseline_steps: fixed baseline = mean over the first ``baseline_steps``
        steps after warm-up, per metric.
      baseline_min_samples: at least this many samples make a fixed
        baseline (a sparse metric extends its window until it has them).
      baseline: baseline of the ratio rules: ``"fixed"`` (§5),
        ``"rolling"`` (OLMo-core: ``x > mean + rolling_k * std`` over the
        last ``rolling_window`` steps) or ``"ema"`` (ZClip: EMA mean/var
        with ``ema_alpha`` per step, ``x > mean + ema_z * std``). With the
        adaptive ones an alert opens (or escalates) when the ratio to the
        adaptive mean crosses the threshold *and* the z-gate holds.
      ratio_rules: metric -> ``(yellow_ratio, orange_ratio or None)``:
        yellow when ``x / baseline > yellow_ratio``, orange when
        ``> orange_ratio``.
      hysteresis: an open ratio/throughput alert steps down only once the
        excess falls below ``hysteresis`` x its threshold's excess (e.g.
        grad norm: closes below ``1 + (2 - 1) * 0.9 = 1.9x``). 1 disables.
      clear_steps: a ratio, throughput, non-finite or divergence alert
        closes once its condition has been clear at every check for this
        many steps (it keeps its level meanwhile; 0 closes at once), so a
        noisy value near a threshold does not open and close alerts.
      rolling_window, rolling_k: OLMo-core rolling baseline (128 steps, 6).
      ema_alpha, ema_z: ZClip EMA baseline (0.97 per step, 2.5).
      adaptive_min_samples: samples before an adaptive baseline judges; also
        the least memory of the rolling window / EMA at sparse cadences.
      nonfinite_metrics: a non-finite value is ORANGE.
      nonfinite_count_metrics: a value > 0 (or non-finite) is ORANGE.
      throughput_metrics: the first present one is judged, in this order.
      throughput_drop: YELLOW when ``1 - x / baseline > throughput_drop``.
      loss_scale_metric, loss_scale_drop: YELLOW when ``prev / x >=
        loss_scale_drop`` between two consecutive checks.
      event_hold_steps: a loss-scale alert stays open this many steps after
        the last drop.
      val_gap_window: ``W`` of the gap growth rule. The gap is ``val/gap``
        or else ``val/loss`` minus the loss trend (the EMA of the spike
        tracker: far less noisy than one step's loss; its lag on a decaying
        loss only shrinks, which never looks like an accelerating gap).
        Samples count from ``warmup_steps + baseline_steps`` on.
      val_gap_ratio: YELLOW when ``g(t) - g(t-W) > val_gap_ratio *
        max(g(t-W) - g(t-2W), 0) + val_gap_min_growth * |train loss|``.
      val_gap_min_growth: noise floor of that rule, relative to the loss.
      val_gap_halflife: the gap samples are smoothed by an EMA with this
        half-life in steps before the rule reads them (the three-point
        growth comparison is otherwise dominated by noise).
      spike_metrics: metrics with spike anatomy, periodicity and a score.
      spike_alert_metrics: metrics with the unrecovered-spike YELLOW and
        the loss-divergence RED condition.
      spike_z, spike_min_ratio: onset band ``trend + max(spike_z * scale,
        (spike_min_ratio - 1) * |trend|)``.
      spike_recover_z, spike_recover_ratio: recovery band, same form.
      trend_halflife, scale_halflife: EMA half-lives (steps) of the trend
        and of the residual variance.
      spike_min_samples: samples after warm-up before spikes are detected.
      physiological_steps: recovered within this: physiological; not yet
        recovered after this: the ``loss_spike`` YELLOW.
      pathological_steps: not recovered after this: pathological.
      post_window: steps averaged for a spike's post-spike level.
      spike_forget_steps: an unrecovered spike's reference is dropped this
        many steps after its onset (the new level is accepted).
      periodic_min_spikes: spikes making a periodic pattern (3).
      periodic_tolerance: neighbouring intervals may differ by this
        fraction.
      periodic_min_interval: shorter intervals are not a pattern.
      periodic_escalate_min_spikes, periodic_shrink: ORANGE when at least
        this many spikes have strictly shrinking intervals and the last is
        ``<= periodic_shrink`` x the first.
      divergence_loss_ratio: "far above its pre-spike trend".
      red_after: consecutive divergent checks before RED.
      red_min_steps: and the divergence must have lasted this many steps.
      score_window: the spike scores' window (10,000 steps).
      localize_pattern: regex selecting per-layer metrics for localization.
      localize_window, localize_rows: per-layer history: ``localize_rows``
        rows, one per ``localize_window // localize_rows`` steps.
      localize_z, localize_min_ratio: a metric has left its baseline when
        ``|x - b| > max(localize_z * sd_b, localize_min_ratio * |b|)``.
      localize_top: entries kept per alert.
      localize_max_metrics: per-layer metrics tracked at most.
      history_size, spikes_size: bounded lengths of ``Monitor.history``
        and ``Monitor.spikes``.
    """

    warmup_steps: int = 0
    baseline_steps: int = 500
    baseline_min_samples: int = 3
    baseline: str = "fixed"
    ratio_rules: Mapping[str, tuple[float, float | None]] = dataclasses.field(
        default_factory=_default_ratio_rules, hash=False)
    hysteresis: float = 0.9
    clear_steps: int = 100
    rolling_window: int = 128
    rolling_k: float = 6.0
    ema_alpha: float = 0.97
    ema_z: float = 2.5
    adaptive_min_samples: int = 16
    nonfinite_metrics: tuple[str, ...] = ("loss", "grad/global_norm")
    nonfinite_count_metrics: tuple[str, ...] = ("grad/nonfinite_count",)
    throughput_metrics: tuple[str, ...] = ("sys/tokens_per_sec", "sys/steps_per_sec")
    throughput_drop: float = 0.30
    loss_scale_metric: str = "opt/loss_scale"
    loss_scale_drop: float = 16.0
    event_hold_steps: int = 300
    val_gap_window: int = 1000
    val_gap_ratio: float = 1.5
    val_gap_min_growth: float = 0.01
    val_gap_halflife: float = 250.0
    spike_metrics: tuple[str, ...] = ("loss", "grad/global_norm")
    spike_alert_metrics: tuple[str, ...] = ("loss",)
    spike_z: float = 6.0
    spike_min_ratio: float = 1.1
    spike_recover_z: float = 3.0
    spike_recover_ratio: float = 1.05
    trend_halflife: float = 100.0
    scale_halflife: float = 500.0
    spike_min_samples: int = 20
    physiological_steps: int = 300
    pathological_steps: int = 500
    post_window: int = 100
    spike_forget_steps: int = 5000
    periodic_min_spikes: int = 3
    periodic_tolerance: float = 0.25
    periodic_min_interval: int = 100
    periodic_escalate_min_spikes: int = 4
    periodic_shrink: float = 0.9
    divergence_loss_ratio: float = 1.25
    red_after: int = 3
    red_min_steps: int = 0
    score_window: int = 10_000
    localize_pattern: str = r"/layer_\d+$"
    localize_window: int = 5000
    localize_rows: int = 512
    localize_z: float = 3.0
    localize_min_ratio: float = 0.2
    localize_top: int = 5
    localize_max_metrics: int = 4096
    history_size: int = 256
    spikes_size: int = 256

    def __post_init__(self) -> None:
        rules = {}
        for name, thr in dict(self.ratio_rules).items():
            if not isinstance(name, str):
                raise TypeError(f"Policy.ratio_rules keys must be metric names (str), got {name!r}")
            try:
                y, o = thr
            except (TypeError, ValueError):
                raise TypeError(
                    f"Policy.ratio_rules[{name!r}] must be (yellow_ratio, orange_ratio or None), "
                    f"got {thr!r}") from None
            y = float(y)
            o = None if o is None else float(o)
            if not y > 0 or (o is not None and not o > y):
                raise ValueError(
                    f"Policy.ratio_rules[{name!r}] expects 0 < yellow < orange, got ({y}, {o})")
            rules[name] = (y, o)
        object.__setattr__(self, "ratio_rules", types.MappingProxyType(rules))
        for f in ("nonfinite_metrics", "nonfinite_count_metrics", "throughput_metrics",
                  "spike_metrics", "spike_alert_metrics"):
            v = getattr(self, f)
            if isinstance(v, str):
                raise TypeError(f"Policy.{f} expects a sequence of metric names, got the string {v!r}")
            object.__setattr__(self, f, tuple(v))
        if self.baseline not in BASELINES:
            raise ValueError(f"Policy.baseline expects one of {sorted(BASELINES)}, got {self.baseline!r}")
        for f in ("baseline_steps", "baseline_min_samples", "rolling_window", "adaptive_min_samples",
                  "val_gap_window", "red_after", "score_window", "localize_rows", "localize_window",
                  "history_size", "spikes_size", "periodic_min_spikes", "localize_top",
                  "localize_max_metrics"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"Policy.{f} expects an integer >= 1, got {getattr(self, f)!r}")
        for f in ("warmup_steps", "event_hold_steps", "physiological_steps", "pathological_steps",
                  "post_window", "spike_forget_steps", "periodic_min_interval", "red_min_steps",
                  "clear_steps",
                  "spike_min_samples"):
            if int(getattr(self, f)) < 0:
                raise ValueError(f"Policy.{f} expects an integer >= 0, got {getattr(self, f)!r}")
        if self.periodic_min_spikes < 3:
            raise ValueError(f"Policy.periodic_min_spikes expects >= 3, got {self.periodic_min_spikes}")
        if not 0 < self.ema_alpha < 1:
            raise ValueError(f"Policy.ema_alpha expects 0 < alpha < 1, got {self.ema_alpha}")
        if not 0 < self.throughput_drop < 1:
            raise ValueError(f"Policy.throughput_drop expects a fraction in (0, 1), got {self.throughput_drop}")
        if not 0 < self.hysteresis <= 1:
            raise ValueError(f"Policy.hysteresis expects a value in (0, 1], got {self.hysteresis}")
        if self.trend_halflife <= 0 or self.scale_halflife <= 0 or self.val_gap_halflife < 0:
            raise ValueError("Policy.trend_halflife and scale_halflife expect positive steps, got "
                             f"{self.trend_halflife} and {self.scale_halflife}")
        re.compile(self.localize_pattern)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``Policy.from_dict`` inverts it)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["ratio_rules"] = {k: list(v) for k, v in self.ratio_rules.items()}
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Policy":
        """Builds a policy from :meth:`to_dict`'s output."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Policy.from_dict got unknown fields {unknown}; expected a subset of "
                             f"{sorted(names)}")
        kw = dict(d)
        if "ratio_rules" in kw:
            kw["ratio_rules"] = {k: tuple(v) for k, v in kw["ratio_rules"].items()}
        return cls(**kw)
