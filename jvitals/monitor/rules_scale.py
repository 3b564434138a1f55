"""Figures whose scale means something on its own, judged against that meaning.

The other rules judge a figure against the run's own history, which learns a growth that
starts before the baselines do (the warm-up) as the figure's drift. These rules judge what
a number means regardless of the run (:class:`~jvitals.monitor.config.ScaleConfig`):

- :class:`AttnLogitRule`: a pre-softmax attention logit of 30 gives every other key of its
  row a weight below ``e^-30``, under float32's precision: the row is one-hot (the
  attention-logit growth of Dehghani et al. 2023 and Wortsman et al. 2023).
- :class:`OutputLogitRule`: output logits of 100 have a bfloat16 spacing of half a nat:
  PaLM's output-logit divergence, which the z-loss prevents.
- :class:`UpdateSizeRule`: ``update/param_ratio`` is the fraction of the weights' norm one
  update moves; a tenth in one step is what Adam's sign-like first updates do at the full
  learning rate without a warm-up.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from jvitals.monitor.policy import Policy
from jvitals.monitor.rules_base import Figures
from jvitals.monitor.types import Change, Level, Reading, RuleBase, Spike, release, set_

__all__ = ["AttnLogitRule", "OutputLogitRule", "UpdateSizeRule"]


def _layer_figures(f: Figures, rule: str, metric: str) -> list[tuple[str, int]]:
    """``[(name, index in the check's values)]`` of ``metric`` and its ``/layer_{i}`` figures
    (cached per key set)."""
    got = f.plan.cache.get(rule)
    if got is None:
        head = metric + "/layer_"
        got = f.plan.cache[rule] = [(k, i) for i, k in enumerate(f.plan.keys)
                                    if k == metric or (k.startswith(head) and k[len(head):].isdigit())]
    return got


class _Range(NamedTuple):
    """What a rising-into-range rule judges: a metric (and its ``/layer_{i}`` figures)."""

    metric: str
    level: float       # the level whose meaning the rule judges
    growth: float      # rising at least this many times its minimum over ``window`` steps
    window: int
    orange: float      # ORANGE past this while open (inf: YELLOW only)
    meaning: str       # what the level means, for the message
    prescription: str  # the PRESCRIPTIONS key
    event: str


class _RisingIntoRange(RuleBase):
    """A figure rising several-fold into a range whose meaning is absolute (the shared body
    of :class:`AttnLogitRule` and :class:`OutputLogitRule`).

    For each figure ``x`` (the metric and its per-layer figures) it keeps its samples over
    the last ``window`` steps, from the first check (no baseline: it needs none)::

        YELLOW  x >= level, x >= growth x min(x over the window) and x >= sqrt(growth) x
                its value half a window ago (still rising)
        ORANGE  open, and x >= orange; divergent, so the divergence rule makes it RED when
                it holds

    Once open the alert holds while the largest figure stays at or above ``hysteresis x
    level`` and closes when below. It names the layers whose own figure satisfies the
    condition; its onset (the earliest sign a rollback goes back before) is the first sample
    after the window's minimum that reached both ``hysteresis x level`` and ``sqrt(growth)``
    x that minimum.
    """

    levels = (Level.YELLOW, Level.ORANGE)
    state_fields = ("hist", "onset")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.hist: dict[str, list[list[float]]] = {}   # figure -> [[t, step, x], ...] over the window
        self.onset: int | None = None                   # the open alert's onset step

    def _range(self) -> _Range:
        raise NotImplementedError

    def _details(self) -> dict[str, Any]:
        return {}

    def check(self, f: Figures) -> list[Change]:
        c = self._range()
        items = _layer_figures(f, self.name, c.metric)
        if not items:
            return []
        hold = self.p.alerts.hysteresis * c.level
        rising: list[tuple[str, float, float, int]] = []   # (figure, x, window min, onset step)
        high: list[str] = []                                # figures at or above the hold level
        top, top_name = -math.inf, c.metric
        for k, i in items:
            x = float(f.vals[i])
            if not (math.isfinite(x) and x > 0):
                continue
            h = self.hist.setdefault(k, [])
            h.append([f.t, f.step, x])
            while len(h) > 1 and h[0][0] < f.t - c.window:
                h.pop(0)
            i_lo = min(range(len(h)), key=lambda j: h[j][2])
            lo = h[i_lo][2]
            # Still rising: the second half of the window alone rose sqrt(growth) x (a healthy
            # head sharpening to its level slows down as it gets there; the growth does not).
            half = next((r[2] for r in reversed(h) if r[0] <= f.t - c.window // 2), lo)
            if x >= c.level and x >= c.growth * lo and x >= math.sqrt(c.growth) * half:
                # The onset: the first sample after the minimum that had risen sqrt(growth) x
                # above it and reached the hold level (not the minimum itself: a growth from
                # the run's first step would leave no checkpoint before it).
                bar = max(hold, math.sqrt(c.growth) * lo)
                rising.append((k, x, lo, next(int(r[1]) for r in h[i_lo:] if r[2] >= bar)))
            if x >= hold:
                high.append(k)
            if x > top:
                top, top_name = x, k
        key = c.metric
        is_open = f.active(self.name, key) is not None
        if not rising and not (is_open and top >= hold):
            self.onset = None
            return [release(self.name, key)] if (self.name, key) in f.open else []
        named = [r[0] for r in rising] or high
        layers = sorted({k.rsplit("_", 1)[-1] for k in named if "/layer_" in k}, key=int)
        if rising and not is_open:
            self.onset = min(r[3] for r in rising)
        lvl = Level.ORANGE if top >= c.orange else Level.YELLOW
        grown = max(rising, key=lambda r: r[1] / r[2]) if rising else None
        where = f" (layers {', '.join(layers)})" if layers else ""
        how = (f"rose {grown[1] / grown[2]:.1f}x over the last {c.window} steps (from {grown[2]:.3g}; "
               f"rising since step {grown[3]})" if grown else f"holds at or above {c.level:g}")
        tail = ("" if c.orange == math.inf else
                f" Past {c.orange:g}: RED if it holds." if lvl == Level.ORANGE else f" ORANGE at {c.orange:g}.")
        msg = f"{top_name} = {top:.4g}{where} {how}, into the range where {c.meaning} (>= {c.level:g}).{tail}"
        ref = grown[2] if grown else c.level
        return [set_(self.name, top_name, lvl, Reading(top, ref, top / ref), msg, f"{c.event}{where}", key=key,
                     onset=self.onset, diverging=lvl >= Level.ORANGE, prescription=c.prescription,
                     details={"layers": [int(x) for x in layers], "level": c.level, **self._details()})]

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        for h in self.hist.values():
            h[:] = [r for r in h if r[0] <= t_to]
        self.onset = None
        return []


class AttnLogitRule(_RisingIntoRange):
    """The largest attention logit growing into softmax saturation (``ScaleConfig.attn_*``).

    ``act/attn_logits_abs.max`` and its per-layer figures, judged as
    :class:`_RisingIntoRange` judges them: YELLOW at ``attn_level`` (30: a softmax row
    one-hot) after rising ``attn_growth`` (3) x within ``attn_window`` (200) steps; ORANGE
    past ``attn_orange`` (100, MuonClip's tau). Its prescription (``attn_logit_growth``) is
    qk-layernorm or QK-clip; the guard's default ``qk_clip`` remedy applies QK-clip in flight
    at ``qk_clip_tau`` (in the alert's details).
    """

    name = "attn_logits"
    alert_ids = ("attn_logits",)   # the alerts' ``rule`` (docs/MONITOR.md)

    def _range(self) -> _Range:
        c = self.p.scale
        return _Range(c.attn_metric, c.attn_level, c.attn_growth, c.attn_window, c.attn_orange,
                      f"a softmax row is one-hot (every other key's weight below e^-{c.attn_level:g}; "
                      "ScaleConfig.attn_level): the attention entropy collapses",
                      "attn_logit_growth", "attention logits growing into saturation")

    def _details(self) -> dict[str, Any]:
        return {"orange": self.p.scale.attn_orange, "qk_clip_tau": self.p.scale.qk_clip_tau}


class OutputLogitRule(_RisingIntoRange):
    """The output logits growing into the range where their precision fails (``ScaleConfig.out_*``).

    ``act/output_layer_logits_abs.max`` (``vitals.cross_entropy`` gives it every step): YELLOW
    at ``out_level`` (100: bfloat16's spacing there is 0.5, so logits a nat apart round
    together, and ``exp`` of them is far past any probability's scale) after rising
    ``out_growth`` x within ``out_window`` steps: PaLM's output-logit divergence (no z-loss,
    no weight decay on the head). Its prescription (``logit_divergence``) is the z-loss or a
    logit soft-cap; the guard's default ``z_loss`` remedy turns the z-loss on in flight.
    """

    name = "output_logits"
    alert_ids = ("output_logits",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)

    def _range(self) -> _Range:
        c = self.p.scale
        return _Range(c.out_metric, c.out_level, c.out_growth, c.out_window, math.inf,
                      "the output logits' low-precision spacing exceeds half a nat (bfloat16 at "
                      f"{c.out_level:g}: 0.5; ScaleConfig.out_level)", "logit_divergence",
                      "output logits growing out of range")


class UpdateSizeRule(RuleBase):
    """Updates whose size means trouble on its own: one that moves the weights by a large
    fraction of their norm, or Adam's updates vanishing.

    **Too large** (key ``update/param_ratio``). ``update/param_ratio`` is ``||u|| / ||p||`` of
    one update: healthy runs stay near 1e-3 (1e-2 at the highest learning rates). Adam's first
    updates are sign-like (``m / sqrt(v) = +-1`` per element), so at the full learning rate
    from step 0 they move each weight by the learning rate itself, a large fraction of the
    weights at their initial scale: what a warm-up prevents (Liu et al. 2019; Wortsman et al.
    2023). The check's ratio and the window's largest (``window/update/param_ratio.max``)::

        YELLOW  the largest ratio >= update_level (0.1)

    named "no warm-up" when the learning rate at the run's first check was already at least
    ``warmup_frac`` x the largest it has been (nothing ramped up), else "a learning rate too
    high"; held ``update_hold`` steps after the last such update.

    **Vanishing** (key ``update/rms``). Adam's update per element and per unit learning rate,
    ``|m| / (sqrt(v) + eps)``, is 0.1-0.3 whatever the gradient's scale, as long as ``eps``
    is small beside ``sqrt(v)``; where the gradients' scale falls to ``eps`` or below, the
    update shrinks with it (Wortsman et al. 2023, section 3.4). For a run whose optimizer
    state holds Adam's second moment (an ``opt/adam_nu_*`` figure seen)::

        YELLOW  update/rms / opt/learning_rate < vanish_level (0.05) at vanish_checks (1)
                checks running, the learning rate above zero
    """

    name = "update_size"
    alert_ids = ("update_size",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW,)
    state_fields = ("first_lr", "max_lr", "last", "onset", "adam", "low")

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self.first_lr = math.nan     # the learning rate at the first check
        self.max_lr = 0.0            # the largest learning rate seen
        self.last: int | None = None  # the step of the last update at or above the level
        self.onset: int | None = None
        self.adam = False            # an Adam second moment seen in the figures
        self.low: list[int] = []     # the checks running with a vanishing update

    def check(self, f: Figures) -> list[Change]:
        lr = f.get(self.p.baselines.lr_metric)
        if lr is not None and math.isfinite(lr) and lr > 0:
            if self.first_lr != self.first_lr:
                self.first_lr = lr
            self.max_lr = max(self.max_lr, lr)
        if not self.adam:
            self.adam = any(k.startswith("opt/adam_nu") for k in f.plan.named)
        return self._large(f) + self._vanishing(f, lr)

    def _large(self, f: Figures) -> list[Change]:
        c, m = self.p.scale, "update/param_ratio"
        r, at = f.get(m), f.step
        wmax = f.get("window/" + m + ".max") if (f.get("window/" + m + ".n") or 0) >= 1 else None
        if wmax is not None and math.isfinite(wmax) and (r is None or not r >= wmax):
            r, at = wmax, f.step - int(f.get("window/" + m + ".max_ago") or 0)
        if r is not None and math.isfinite(r) and r >= c.update_level:
            if self.last is None:
                self.onset = at
            self.last = at
        elif self.last is None or f.step - self.last > c.update_hold:
            self.last = self.onset = None
            return [release(self.name, m)] if (self.name, m) in f.open else []
        else:
            return []      # held: an earlier update was that large
        no_warmup = self.first_lr == self.first_lr and self.first_lr >= c.warmup_frac * self.max_lr
        cause = ("no warm-up: the learning rate was already at "
                 f"{self.first_lr / max(self.max_lr, 1e-30):.0%} of its peak at the first check"
                 if no_warmup else "a learning rate too high for the weights' scale")
        msg = (f"{m} = {r:.3g} at step {at}: one update moved the weights by {r:.1%} of their norm (>= "
               f"ScaleConfig.update_level = {c.update_level:g}; healthy runs stay near 1e-3); {cause}.")
        return [set_(self.name, m, Level.YELLOW, Reading(r, c.update_level, r / c.update_level), msg,
                     "an update moved the weights by a large fraction", key=m, onset=self.onset,
                     prescription="no_warmup" if no_warmup else "lr_too_high",
                     details={"step": at, "no_warmup": no_warmup})]

    def _vanishing(self, f: Figures, lr: float | None) -> list[Change]:
        c, m = self.p.scale, "update/rms"
        u = f.get(m)
        if not self.adam or u is None or lr is None or not (math.isfinite(u) and math.isfinite(lr) and lr > 0):
            return []
        per = u / lr
        if per >= c.vanish_level:
            self.low = []
            return [release(self.name, m)] if (self.name, m) in f.open else []
        self.low.append(f.step)
        if len(self.low) < c.vanish_checks:
            return []
        msg = (f"{m} / opt/learning_rate = {per:.3g}: Adam's update is {per:.3g} per element and per unit "
               f"learning rate since step {self.low[0]} (below ScaleConfig.vanish_level = {c.vanish_level:g}; "
               "Adam gives 0.1-0.3 whatever the gradients' scale while eps is small beside sqrt(v)): the "
               "gradients' scale has fallen to Adam's epsilon, which now sets the step.")
        return [set_(self.name, m, Level.YELLOW, Reading(per, c.vanish_level, per / c.vanish_level), msg,
                     "Adam's updates vanish", key=m, onset=self.low[0], prescription="adam_epsilon",
                     details={"since": self.low[0]})]

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        self.last = self.onset = None
        self.low = []
        return []
