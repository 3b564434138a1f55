"""The monitor's policy: every rule's thresholds and windows (METRICS.md §5).

Imports nothing from the other monitor modules: the rules and trackers read
a :class:`Policy`, it never reads them.
"""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any, Mapping

__all__ = ["BASELINE_KINDS", "Policy"]

BASELINE_KINDS = ("drift", "fixed", "rolling", "ema")
"""Values of ``Policy.baseline``."""


def _default_group_bands() -> Mapping[str, float]:
    return {"update/param_ratio": 2.0, "grad/share": 2.0, "param/norm": 1.5}


def _default_logit_bands() -> Mapping[str, float]:
    return {"act/attn_logits_abs.max": 2.0, "act/output_layer_logits_abs.max": 2.0}


def _default_router_bands() -> Mapping[str, float]:
    return {"moe/maxvio.max": 0.5, "moe/dead_expert_ratio": 0.2}


def _default_jump_metrics() -> Mapping[str, float]:
    return {"update/param_ratio": 5.0}


def _default_early_jumps() -> Mapping[str, float]:
    return {"loss": 2.0, "grad/global_norm": 10.0}


def _default_ratio_rules() -> Mapping[str, tuple[float, float | None]]:
    return {"grad/global_norm": (2.0, 3.0)}


def _default_trend_metrics() -> Mapping[str, float]:
    return {"grad/global_norm": 1.3, "param/global_norm": 1.5}


def _bands(field: str, mapping: Mapping[str, Any], what: str, above: float) -> Mapping[str, float]:
    """``mapping`` as a read-only ``{name: float}`` whose values all exceed ``above``.

    Raises:
      ValueError: naming the field, the entry and what was expected.
    """
    out = {}
    for k, r in dict(mapping).items():
        if not isinstance(k, str) or not float(r) > above:
            raise ValueError(f"Policy.{field} expects {what} > {above:g}, got {k!r}: {r!r}")
        out[k] = float(r)
    return types.MappingProxyType(out)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Alert thresholds and windows; defaults are METRICS.md §5.

    Every window is in steps (not in number of checks), so the same policy
    works at any host cadence; ``red_after`` counts checks, as §5 does.

    Attributes:
      warmup_steps: baselines start at this step (model time); ``None``
        (default): found from the run. With ``lr_metric`` logged, at the
        first check where the learning rate stopped rising (``lr <= prev *
        (1 + lr_plateau_tol)``: the warm-up's peak plateau was reached);
        without it, once ``settle_metric`` has settled: the Theil-Sen slope
        of its log over the last ``settle_window`` steps (at least
        ``settle_min_samples`` samples) implies a change below
        ``settle_tolerance`` over that window. Before the start only
        ``nonfinite`` judges. ``settle_max_steps`` caps the wait; a run that
        logs neither metric starts at its first check.
      lr_metric, lr_plateau_tol: see ``warmup_steps``.
      settle_metric, settle_window, settle_min_samples, settle_tolerance,
        settle_max_steps: see ``warmup_steps`` (``settle_window`` ``None``:
        ``baseline_steps // 2``; ``settle_max_steps`` ``None``: ``4 *
        baseline_steps``).
      baseline_steps: fixed baseline = median over the first
        ``baseline_steps`` steps after the start, per metric (robust to a few
        outliers).
      baseline_min_samples: at least this many samples make a fixed
        baseline (a sparse metric extends its window until it has them).
      baseline: reference of the ratio rules: ``"drift"`` (default: the
        fixed median, then an EMA of ``log x`` with half-life
        ``drift_halflife`` steps that learns only from samples below the
        yellow ratio while no alert of that metric holds: it follows the
        run's own slow drift, as healthy real-text runs creep 1.25-1.5x per
        1000 steps, and a fault never becomes its own reference), ``"fixed"``
        (§5: the median over the first ``baseline_steps`` after the start),
        ``"rolling"`` (OLMo-core: ``x > mean + rolling_k * std`` over the
        last ``rolling_window`` steps) or ``"ema"`` (ZClip: EMA mean/var
        with ``ema_alpha`` per step, ``x > mean + ema_z * std``). With the
        adaptive ones an alert opens (or escalates) when the ratio to the
        adaptive mean crosses the threshold *and* the z-gate holds.
      drift_halflife: see ``baseline``.
      ratio_rules: metric -> ``(yellow_ratio, orange_ratio or None)``:
        yellow when ``x / reference > yellow_ratio``, orange when
        ``> orange_ratio``; the reference is the baseline, times the
        schedule's factor for ``schedule_metrics``.
      schedule_metrics: ratio-rule metrics judged against what the schedule
        predicts: baseline x ``max((lr_b / lr) ** lr_exponent, pn_b / pn, 1)``
        (``lr`` = ``lr_metric``, ``pn`` = ``param/global_norm``, ``_b`` their
        baselines; the LR term capped at 100x). Default: the grad norm, whose
        steady state under normalization and decoupled weight decay is
        ``||g|| / ||w|| ~ sqrt(2 lambda / lr)`` (Defazio 2025,
        arXiv:2506.02285): a healthy run's grad norm rises ~3x as a cosine
        decays the LR to 0.1x.
      jump_metrics: metric -> ratio of the jump rule: YELLOW at the very check
        where ``x / lr`` is at least this ratio times its value at the check
        before (an unmistakable departure needs no second check); held while at
        least half that. Default: the global ``update/param_ratio`` x5.
      lr_exponent: the exponent of that LR term (0 turns it off).
      weight_decay: the optimizer's decoupled weight decay where you know it;
        ``0`` (no weight decay: no equilibrium, the LR term is off; the
        param-norm term stays); ``None`` (default) or a positive value: the
        LR term applies.
      ratio_noise_z: with the drift reference, a ratio rule's thresholds widen to
        ``exp(ratio_noise_z * noise)`` where that exceeds the yellow ratio
        (``noise``: the metric's check-to-check spread in log, learned with the
        reference), the orange ratio by as much.
      confirm_checks, confirm_steps: a ratio rule's alert opens (or escalates
        to ORANGE) only after its condition held at this many consecutive
        checks spanning at least this many steps (above the threshold at the
        first, above its hysteresis level after): one noisy check is not an
        alert, nor two spiky batches that happen to fall on consecutive checks
        (1-5% of real-text batches have a grad norm 2x their neighbours'). At a
        cadence of a few steps, ``confirm_steps=20`` keeps a cluster of spiky
        batches from confirming. The divergence rule counts a confirmed ORANGE's
        run of checks as divergent checks.
      hysteresis: an open ratio/throughput alert steps down only once the
        excess falls below ``hysteresis`` x its threshold's excess (e.g.
        grad norm: closes below ``1 + (2 - 1) * 0.9 = 1.9x``). 1 disables.
      clear_steps: a ratio, throughput, non-finite or divergence alert
        closes once its condition has been clear at every check for this
        many steps (it keeps its level meanwhile; 0 closes at once), so a
        noisy value near a threshold does not open and close alerts.
      episode_gap: a condition that has been clear (the rule released its alert:
        the figure back in its band) for at least this many steps has ended; when
        it holds again, that is a new episode: the clearing alert closes and a new
        one opens with its own onset (the guard's earliest sign comes from the
        episode that escalated). A shorter dip is noise within one episode.
      rolling_window, rolling_k: OLMo-core rolling baseline (128 steps, 6).
      ema_alpha, ema_z: ZClip EMA baseline (0.97 per step, 2.5).
      adaptive_min_samples: samples before an adaptive baseline judges; also
        the least memory of the rolling window / EMA at sparse cadences.
      nonfinite_metrics: a non-finite value is ORANGE.
      nonfinite_count_metrics: a value > 0 (or non-finite) is ORANGE.
      throughput_metrics: the first present one is judged, in this order.
      throughput_drop, throughput_z, throughput_noise_halflife, throughput_hold_steps:
        YELLOW when ``log(x / baseline) < -band`` at every check for
        ``throughput_hold_steps`` steps, ``band = max(-log(1 - throughput_drop),
        throughput_z * sd)``, ``sd`` the run's own noise (an EMA of the squared log
        deviation, half-life ``throughput_noise_halflife`` steps): the least drop is
        §5's 30%; a steady run (4% noise) flags a 40% drop; healthy runs on this shared
        2-core machine dip 25-50% for 100-200 steps (tuned on the tuning corpus: 0
        alerts in its 78,000 healthy steps at a check every 10 or 50 steps).
      early_jumps, early_min_samples, early_min_span: before the baselines are armed,
        a figure at least its ratio x the median of its last 8 checks (at least
        ``early_min_samples`` of them spanning ``early_min_span`` steps) is ORANGE at
        once (the early rule; healthy tuning runs moved 1.28x / 5.4x at most).
      window_min_steps: the spikes between checks (``WindowSpikes``): a window's maximum is
        judged against the per-step mean and sd pooled from the windows of the last
        ``rolling_window`` steps once they hold this many steps (``spike_z`` sd: OLMo-core's
        loss rule on every step).
      skip_orange_checks: an update skipped in the step (``skip_step``,
        ``apply_if_finite``) is a YELLOW at the next check; skips at this many
        consecutive checks are ORANGE.
      data_window, data_rise, data_z, data_band, data_confirm: the data rule: the windows'
        mean loss over the last ``data_window`` steps rising (Mann-Kendall z > ``data_z``,
        a Theil-Sen rise >= ``data_rise`` - 1 of its median) at ``data_confirm`` checks
        running while the grad norm, the update per unit LR and the param norm
        stay within ``data_band`` x their own slow levels.
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
      val_gap_min_growth: floor of that rule, relative to the loss: healthy
        real-text runs' gaps wander by up to ~3% of the loss per 1000 steps.
        Before ``2W`` of gap history the growth before counts as 0.
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
      spike_min_samples: samples after warm-up before spikes are detected
        (or 5 samples spanning ``scale_halflife`` steps, at a sparse cadence).
      physiological_steps: recovered within this: physiological; not yet
        recovered after this: the ``loss_spike`` YELLOW.
      pathological_steps: not recovered after this: pathological.
      post_window: steps averaged for a spike's post-spike level.
      spike_forget_steps: an unrecovered spike's reference is dropped this
        many steps after its onset (the new level is accepted).
      periodic_metrics: spike metrics whose spike onsets make periodic patterns
        (the loss: on real text 1-5% of the batches spike the grad norm 2x, and
        three of them fall near-regularly by chance).
      periodic_min_spikes: spikes making a periodic pattern (3).
      periodic_tolerance: neighbouring intervals may differ by this
        fraction.
      periodic_min_interval: shorter intervals are not a pattern.
      periodic_escalate_min_spikes, periodic_shrink: ORANGE when at least
        this many spikes have strictly shrinking intervals and the last is
        ``<= periodic_shrink`` x the first.
      trend_metrics, trend_window, trend_buckets, trend_drift_k: the creep
        rule: metric -> least rise. Each metric (net of the schedule's factor
        for ``schedule_metrics``) is averaged into buckets of ``trend_window
        // trend_buckets`` steps from ``baseline_steps`` after the start on;
        YELLOW when the log of the bucket means rose over the last ``W`` steps
        by more than ``max(log(least rise), trend_drift_k * D_W)`` at two
        buckets running (``W`` = ``trend_window`` or 4x it; ``D_W`` the
        largest rise over ``W`` steps the metric showed up to ``W`` steps
        before: a creep beyond the run's own), and for the grad norm while the
        loss's Theil-Sen slope over the last ``trend_buckets`` buckets is
        negative (the loss looks fine).
      group_bands: family -> band ratio of the group rule. Each group's
        figure (``{family}/{group}``, group ``embedding``, ``lm_head`` or
        ``layer_{i}``) is divided by the trunk's median of that family at the
        same step (the global figure where no layer figure is logged), and
        ``y = log(x / trunk)`` judged against its own history: a one-sample
        change ``>= max(log(group_jump), group_z * noise)`` (an unmistakable
        jump: YELLOW at once), a one-sample change ``> max(log(band), group_z *
        noise)`` that holds, or a change over the last ``group_window`` steps
        ``> max(log(band), group_drift_k * D)`` that holds (``noise``: the RMS
        of its one-sample changes; ``D``: the largest change over
        ``group_window`` steps it showed before in the run, fading with
        half-life ``drift_memory``).
      group_z, group_jump, group_window, group_drift_k: see ``group_bands``.
      drift_memory: half-life (steps) with which ``D_W``, a figure's own
        largest change over a window, fades (the group and creep rules).
      group_confirm: samples a step or drift departure must hold before the
        YELLOW (a jump opens at once).
      group_min_share: a ``grad/share`` figure below this share both before and
        after its departure is not judged (a layer with 0.1% of the gradient
        swings 25x in healthy runs). Shares are judged as they are, not
        relative to the trunk.
      group_global_ratio: the group rule fires only while
        ``grad/global_norm`` and ``param/global_norm`` are below this x their
        baselines (the global figures "have not moved").
      logit_bands: metric -> band ratio of the logits rule: the metric and its
        ``/layer_{i}`` figures judged as the group rule judges a group figure
        (its ``group_*`` settings) on ``log x``, rises only.
      router_bands, router_z, router_steps: the router rule: metric -> least
        excess over its baseline (median of the baseline window); YELLOW when
        ``x - b > max(router_z * 1.4826 * MAD, excess)`` at every check for
        ``router_steps`` steps.
      vocab_size, vocab_metric: the vocabulary size (``None``: read
        ``vocab_metric`` if logged), for the broken-model rule's chance level
        ``log(vocab_size)``.
      broken_chance_frac: the loss counts as "at chance" when ``loss >=
        broken_chance_frac * log(vocab_size)`` while its pre-spike trend was
        below ``broken_chance_frac ** 2 * log(vocab_size)``; without a
        vocabulary size the first loss seen stands for the chance level.
      broken_param_jump, broken_jump_window: the param norm "jumped" when it
        is ``>= broken_param_jump`` x its value ``broken_jump_window`` steps
        earlier (a recent reference, so slow healthy growth never counts).
      broken_steps: a param-norm jump is ORANGE at once and RED when it has
        not recovered after this many steps (below ``1 + (broken_param_jump -
        1) / 2`` x its pre-jump value); a chance-level loss alone is ORANGE
        after ``broken_steps // 2`` steps.
      broken_loss_steps: ... and RED after this many (a bad-data stretch puts
        a healthy model's loss at chance too, and is over sooner).
      gap_z: noise model of the gap rule: the growth excess must also be
        ``> gap_z`` x its standard deviation, from the gap's own first
        second differences (``var(g) = E[(g_i - 2 g_{i-1} + g_{i-2})^2] / 6``,
        propagated through the EMA and the three-point comparison).
      gap_confirm: consecutive gap (and val-rise) samples meeting the rule
        before the YELLOW.
      val_rise_window, val_rise_min_samples, val_rise_z, val_rise_min: the
        val-rise rule (§6 "val loss up, train loss down"): over the
        ``val/loss`` samples of the last ``val_rise_window`` steps (at least
        ``val_rise_min_samples``), Mann-Kendall z > ``val_rise_z``, a
        Theil-Sen rise >= ``val_rise_min`` of its median, and the loss trend's
        Theil-Sen slope < 0.
      divergence_loss_ratio: "far above its pre-spike trend".
      red_after: consecutive divergent checks before RED.
      red_min_steps: and the divergence must have lasted this many steps.
      score_window: the spike scores' window (10,000 steps).
      localize_pattern: regex selecting the candidate metrics of
        localization (per layer, embedding, LM head, router).
      localize_window, localize_rows: candidate history: ``localize_rows``
        rows, one per ``localize_window // localize_rows`` steps.
      localize_lookback, localize_reference, localize_z, localize_min_ratio,
        localize_drift_slack:
        a candidate departed when its own recent history changed: a line is
        fitted to its samples in the ``localize_reference`` steps before the
        lookback window ``[onset - localize_lookback, now]``, and the
        departure is the first sample of the final run of same-sign samples
        off that line's extrapolation by more than ``max(localize_z *
        prediction sd, localize_min_ratio * |prediction|,
        localize_drift_slack * |extrapolated change|)``, the latest sample
        included. Drift that the line extrapolates (slowing to a stop or
        running up to twice as fast, with the default slack 1) is no
        departure.
      localize_top: entries kept per alert.
      localize_max_metrics: per-layer metrics tracked at most.
      history_size, spikes_size: bounded lengths of ``Monitor.history``
        and ``Monitor.spikes``.
    """

    warmup_steps: int | None = None
    lr_metric: str = "opt/learning_rate"
    lr_plateau_tol: float = 1e-3
    settle_metric: str = "grad/global_norm"
    settle_window: int | None = None
    settle_min_samples: int = 4
    settle_tolerance: float = 0.15
    settle_max_steps: int | None = None
    baseline_steps: int = 500
    baseline_min_samples: int = 3
    baseline: str = "drift"
    drift_halflife: float = 500.0
    ratio_rules: Mapping[str, tuple[float, float | None]] = dataclasses.field(
        default_factory=_default_ratio_rules, hash=False)
    schedule_metrics: tuple[str, ...] = ("grad/global_norm",)
    jump_metrics: Mapping[str, float] = dataclasses.field(
        default_factory=_default_jump_metrics, hash=False)
    lr_exponent: float = 0.5
    weight_decay: float | None = None
    ratio_noise_z: float = 3.0
    confirm_checks: int = 3
    confirm_steps: int = 0
    hysteresis: float = 0.9
    clear_steps: int = 100
    episode_gap: int = 20
    rolling_window: int = 128
    rolling_k: float = 6.0
    ema_alpha: float = 0.97
    ema_z: float = 2.5
    adaptive_min_samples: int = 16
    nonfinite_metrics: tuple[str, ...] = ("loss", "grad/global_norm")
    nonfinite_count_metrics: tuple[str, ...] = ("grad/nonfinite_count",)
    throughput_metrics: tuple[str, ...] = ("sys/tokens_per_sec", "sys/steps_per_sec")
    throughput_drop: float = 0.3
    throughput_z: float = 5.0
    throughput_noise_halflife: float = 1000.0
    throughput_hold_steps: int = 40
    early_jumps: Mapping[str, float] = dataclasses.field(
        default_factory=_default_early_jumps, hash=False)
    early_min_samples: int = 4
    early_min_span: int = 20
    skip_orange_checks: int = 3
    window_min_steps: int = 64
    data_window: int = 1000
    data_rise: float = 1.15
    data_z: float = 3.0
    data_band: float = 2.0
    data_confirm: int = 2
    loss_scale_metric: str = "opt/loss_scale"
    loss_scale_drop: float = 16.0
    event_hold_steps: int = 300
    val_gap_window: int = 1000
    val_gap_ratio: float = 1.5
    val_gap_min_growth: float = 0.05
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
    periodic_metrics: tuple[str, ...] = ("loss",)
    periodic_min_spikes: int = 3
    periodic_tolerance: float = 0.25
    periodic_min_interval: int = 100
    periodic_escalate_min_spikes: int = 4
    periodic_shrink: float = 0.9
    trend_metrics: Mapping[str, float] = dataclasses.field(
        default_factory=_default_trend_metrics, hash=False)
    trend_window: int = 1000
    trend_buckets: int = 24
    trend_drift_k: float = 3.0
    group_bands: Mapping[str, float] = dataclasses.field(
        default_factory=_default_group_bands, hash=False)
    group_z: float = 6.0
    group_jump: float = 5.0
    group_window: int = 500
    group_drift_k: float = 3.0
    drift_memory: float = 500.0
    group_confirm: int = 2
    group_min_share: float = 0.01
    group_global_ratio: float = 1.5
    logit_bands: Mapping[str, float] = dataclasses.field(
        default_factory=_default_logit_bands, hash=False)
    router_bands: Mapping[str, float] = dataclasses.field(
        default_factory=_default_router_bands, hash=False)
    router_z: float = 6.0
    router_steps: int = 50
    vocab_size: int | None = None
    vocab_metric: str = "model/vocab_size"
    broken_chance_frac: float = 0.9
    broken_param_jump: float = 1.5
    broken_jump_window: int = 100
    broken_steps: int = 50
    broken_loss_steps: int = 100
    gap_z: float = 4.0
    gap_confirm: int = 2
    val_rise_window: int = 500
    val_rise_min_samples: int = 8
    val_rise_z: float = 3.0
    val_rise_min: float = 0.02
    divergence_loss_ratio: float = 1.25
    red_after: int = 3
    red_min_steps: int = 0
    score_window: int = 10_000
    localize_pattern: str = r"/(?:layer_\d+|embedding|lm_head)$|^moe/"
    localize_window: int = 5000
    localize_rows: int = 512
    localize_lookback: int = 250
    localize_reference: int = 1000
    localize_z: float = 8.0
    localize_min_ratio: float = 0.25
    localize_drift_slack: float = 1.0
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
        object.__setattr__(self, "group_bands", _bands("group_bands", self.group_bands, "family name -> ratio", 1))
        object.__setattr__(self, "router_bands", _bands("router_bands", self.router_bands, "metric name -> excess", 0))
        object.__setattr__(self, "logit_bands", _bands("logit_bands", self.logit_bands, "metric name -> ratio", 1))
        object.__setattr__(self, "jump_metrics", _bands("jump_metrics", self.jump_metrics, "metric name -> ratio", 1))
        object.__setattr__(self, "trend_metrics", _bands("trend_metrics", self.trend_metrics, "metric name -> rise", 1))
        object.__setattr__(self, "early_jumps", _bands("early_jumps", self.early_jumps, "metric name -> ratio", 1))
        for f in ("data_rise", "data_band"):
            if not getattr(self, f) > 1:
                raise ValueError(f"Policy.{f} expects a ratio > 1, got {getattr(self, f)!r}")
        if not self.throughput_z > 0 or not self.throughput_noise_halflife > 0:
            raise ValueError(f"Policy.throughput_z and throughput_noise_halflife expect positive values, got "
                             f"{self.throughput_z} and {self.throughput_noise_halflife}")
        for f in ("warmup_steps", "settle_window", "settle_max_steps", "vocab_size"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or int(v) < (1 if f == "vocab_size" else 0)):
                raise ValueError(f"Policy.{f} expects None or an integer >= "
                                 f"{1 if f == 'vocab_size' else 0}, got {v!r}")
        for f in ("nonfinite_metrics", "nonfinite_count_metrics", "throughput_metrics",
                  "spike_metrics", "spike_alert_metrics", "schedule_metrics", "periodic_metrics"):
            v = getattr(self, f)
            if isinstance(v, str):
                raise TypeError(f"Policy.{f} expects a sequence of metric names, got the string {v!r}")
            object.__setattr__(self, f, tuple(v))
        if self.baseline not in BASELINE_KINDS:
            raise ValueError(f"Policy.baseline expects one of {sorted(BASELINE_KINDS)}, got {self.baseline!r}")
        for f in ("baseline_steps", "baseline_min_samples", "rolling_window", "adaptive_min_samples",
                  "val_gap_window", "red_after", "score_window", "localize_rows", "localize_window",
                  "history_size", "spikes_size", "periodic_min_spikes", "localize_top",
                  "localize_max_metrics", "confirm_checks", "trend_window", "group_confirm",
                  "gap_confirm", "settle_min_samples", "broken_jump_window",
                  "localize_lookback", "localize_reference", "val_rise_window", "group_window",
                  "val_rise_min_samples", "early_min_samples", "skip_orange_checks", "data_window",
                  "window_min_steps",
                  "data_confirm"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"Policy.{f} expects an integer >= 1, got {getattr(self, f)!r}")
        if self.trend_buckets < 8:
            raise ValueError(f"Policy.trend_buckets expects >= 8, got {self.trend_buckets}")
        for f in ("broken_param_jump", "group_jump", "group_drift_k", "trend_drift_k"):
            if not getattr(self, f) > 1:
                raise ValueError(f"Policy.{f} expects a ratio > 1, got {getattr(self, f)!r}")
        if not 0 <= self.group_min_share < 1:
            raise ValueError(f"Policy.group_min_share expects a share in [0, 1), got {self.group_min_share}")
        if not 0 < self.broken_chance_frac <= 1:
            raise ValueError(f"Policy.broken_chance_frac expects a fraction in (0, 1], got "
                             f"{self.broken_chance_frac}")
        for f in ("event_hold_steps", "physiological_steps", "pathological_steps",
                  "post_window", "spike_forget_steps", "periodic_min_interval", "red_min_steps",
                  "clear_steps", "episode_gap", "throughput_hold_steps", "confirm_steps",
                  "spike_min_samples", "broken_steps", "router_steps", "broken_loss_steps", "early_min_span"):
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
        if self.lr_exponent < 0 or (self.weight_decay is not None and self.weight_decay < 0):
            raise ValueError(f"Policy.lr_exponent and weight_decay expect values >= 0, got "
                             f"{self.lr_exponent} and {self.weight_decay}")
        if not self.drift_memory > 0 or not self.drift_halflife > 0:
            raise ValueError(f"Policy.drift_memory and drift_halflife expect positive "
                             f"steps, got {self.drift_memory} and {self.drift_halflife}")
        if not self.data_z > 0:
            raise ValueError(f"Policy.data_z expects a positive z-score, got {self.data_z}")
        if self.trend_halflife <= 0 or self.scale_halflife <= 0 or self.val_gap_halflife < 0:
            raise ValueError("Policy.trend_halflife and scale_halflife expect positive steps, got "
                             f"{self.trend_halflife} and {self.scale_halflife}")
        re.compile(self.localize_pattern)

    @property
    def settle_span(self) -> int:
        """``settle_window``, or ``max(baseline_steps // 2, 1)``."""
        return self.settle_window if self.settle_window is not None else max(self.baseline_steps // 2, 1)

    @property
    def settle_cap(self) -> int:
        """``settle_max_steps``, or ``4 * baseline_steps``."""
        return self.settle_max_steps if self.settle_max_steps is not None else 4 * self.baseline_steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``Policy.from_dict`` inverts it)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["ratio_rules"] = {k: list(v) for k, v in self.ratio_rules.items()}
        d["group_bands"] = dict(self.group_bands)
        d["router_bands"] = dict(self.router_bands)
        d["logit_bands"] = dict(self.logit_bands)
        d["jump_metrics"] = dict(self.jump_metrics)
        d["trend_metrics"] = dict(self.trend_metrics)
        d["early_jumps"] = dict(self.early_jumps)
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

    # -- Per-replica figures (jvitals.monitor.replicas.ReplicaRule; docs/REPLICAS.md). --
    # replica_z: a replica is an outlier when |robust z| against the others exceeds it
    #   (z = (x - median) / max(1.4826 MAD, replica_rel_floor |median|)) ...
    # replica_min_ratio: ... and its ratio to the median is beyond this (either way).
    # replica_rel_floor: the least scale of the z-score, as a fraction of |median|.
    # replica_spread_halflife: half-life, in checks, of each figure's typical spread between
    #   replicas (an EMA of scale / |median|); the z-score's scale is at least that spread,
    #   so a check whose replicas happen to agree closely does not make a noisy one an outlier.
    # replica_confirm: consecutive checks (same replica or same data shard) -> YELLOW.
    # replica_min_replicas: fewer finite replicas than this name no outlier.
    replica_z: float = 8.0
    replica_min_ratio: float = 1.5
    replica_rel_floor: float = 0.02
    replica_spread_halflife: float = 20.0
    replica_confirm: int = 2
    replica_min_replicas: int = 3
