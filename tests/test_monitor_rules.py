"""Tests of the rule-based monitor's new parts on seeded synthetic streams:
baseline start, user rules, group / trend / broken-model rules, quiet checks,
localization by change point, module layering. Every expected number is
computed here from the stream's own definition (not read off the monitor)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from jvitals.monitor import config as C
from jvitals.monitor.localize import localize
from jvitals.monitor.types import Change, Level, set_
from jvitals.monitor.rules_base import Figures
from jvitals.monitor.rules import default_rules
from jvitals.monitor.trackers_history import LayerHistory
from jvitals.monitor.robust import mann_kendall_z, theil_sen
from jvitals.monitor.monitor import Monitor
from jvitals.monitor.policy import Policy


def power_loss(s):
    return 1.8 + 6.0 * (1.0 + s / 200.0) ** -0.6


def gn_shape(s, warm, shape):
    """Grad norm level: ``"warmup"``: 2x during the LR warm-up, back to 1x
    within ~100 steps after it (the issue's case); ``"decay"``: 1 + 2
    exp(-s / 200) from the first step (no plateau)."""
    if shape == "decay":
        return 1.0 + 2.0 * math.exp(-s / 200.0)
    return 1.0 + math.exp(-max(s - warm, 0) / 30.0)


def warmup_stream(seed, warm=300, with_lr=True, layers=4, layer_every=50, shape="warmup"):
    """LR warm-up (linear to ``warm``) then constant; the grad norm per
    :func:`gn_shape`, log-normal noise 5%; group figures every
    ``layer_every`` steps."""
    rng = np.random.default_rng(seed)

    def stream(s):
        n = rng.standard_normal(8)
        lr = 1e-3 * min(1.0, (s + 1) / warm)
        gn = gn_shape(s, warm, shape)
        d = {"loss": power_loss(s) * (1 + 0.01 * n[0]),
             "grad/global_norm": gn * math.exp(0.05 * n[1]),
             "param/global_norm": 100.0 * (1 + 1e-5 * s) * (1 + 1e-4 * n[2]),
             "update/param_ratio": lr * (1 + 0.05 * n[3])}
        if with_lr:
            d["opt/learning_rate"] = np.float32(lr)
        if s % layer_every == 0:
            for i in range(layers):
                d[f"update/param_ratio/layer_{i}"] = lr * (1 + 0.05 * rng.standard_normal())
                d[f"grad/share/layer_{i}"] = 0.7 / layers * (1 + 0.05 * rng.standard_normal())
                d[f"param/norm/layer_{i}"] = (20.0 + i) * (1 + 1e-5 * s)
            d["update/param_ratio/embedding"] = lr * (1 + 0.05 * rng.standard_normal())
            d["grad/share/embedding"] = 0.3 * (1 + 0.05 * rng.standard_normal())
            d["param/norm/embedding"] = 5.5 * (1 + 1e-5 * s)
        return d

    return stream


def feed(m, stream, steps):
    out = []
    for s in steps:
        out.append(m.update(s, stream(s)))
    return out


# --------------------------------------------------------------------------
# Baseline start.
# --------------------------------------------------------------------------


def test_baseline_starts_at_the_lr_plateau():
    m = Monitor(Policy(baselines=C.BaselineConfig(kind="fixed")))
    feed(m, warmup_stream(0, warm=300), range(0, 1000))
    # lr(s) = 1e-3 * min(1, (s + 1) / 300): the first step with lr <= lr(s-1) is 300.
    assert m.baseline_start == 300 and "learning rate" in m.baseline_start_reason
    # The grad-norm baseline: median over steps 300..799 of the stream's own values.
    ref = warmup_stream(0, warm=300)
    vals = [ref(s)["grad/global_norm"] for s in range(0, 800)][300:800]
    assert m.baseline("grad/global_norm") == pytest.approx(float(np.median(vals)), rel=1e-12)


def test_baseline_starts_when_the_grad_norm_settles_without_an_lr():
    m = Monitor()
    feed(m, warmup_stream(1, with_lr=False, shape="decay"), range(0, 1600))
    start = m.baseline_start
    assert "settled" in m.baseline_start_reason
    # Settled: the log grad norm changes by <= 15% over the last 250 steps. On the
    # clean curve 1 + 2 exp(-s/200): the first s with g(s - 250) / g(s) - 1 <= 0.15.
    clean = next(s for s in range(250, 2000) if gn_shape(s - 250, 0, "decay") / gn_shape(s, 0, "decay")
                 - 1 <= 0.15)
    assert abs(start - clean) <= 100, (start, clean)
    # The baseline is the settled level, not the early 2-3x.
    lo, hi = gn_shape(start + 500, 0, "decay"), gn_shape(start, 0, "decay")
    assert 0.97 * lo <= m.baseline("grad/global_norm") <= 1.03 * hi


def test_explicit_warmup_steps_wins():
    m = Monitor(Policy(baselines=C.BaselineConfig(warmup_steps=50)))
    feed(m, warmup_stream(2, warm=300), range(0, 600))
    assert m.baseline_start == 50 and m.baseline_start_reason == "Policy.warmup_steps"


def test_a_creep_after_warmup_is_judged_against_the_post_warmup_level():
    """The issue's case: a warm-up with a 2x grad norm, then a creep to 2x of
    the post-warm-up level: the 2x rule fires near the 2x crossing (the
    baseline no longer swallows the warm-up)."""
    base = warmup_stream(3, warm=200)

    def stream(s):
        d = base(s)
        d["grad/global_norm"] *= 1.0 + max(0, s - 2000) / 2000.0  # 2x of the settled level at 4000
        return d

    vs = feed(Monitor(Policy(baselines=C.BaselineConfig(kind="fixed"),
                             ratio=C.RatioConfig(confirm_checks=2))), stream, range(0, 5000))
    y = next(v.step for v in vs if any(a.rule == "grad_norm" for a in v.alerts))
    assert 3600 <= y <= 4100, y


# --------------------------------------------------------------------------
# Rules as objects; a user's own rule.
# --------------------------------------------------------------------------


class LossAbove:
    """A user rule: YELLOW while the loss is above a fixed value."""

    name = "loss_above"

    def __init__(self, limit):
        self.limit = limit
        self.count = 0

    def check(self, f: Figures) -> list[Change]:
        v = f.get("loss")
        if v is None:
            return []
        self.count += 1
        if v > self.limit:
            return [set_("loss_above", "loss", Level.YELLOW, v, self.limit, v / self.limit,
                         f"loss {v:.3g} > {self.limit}", "loss went above the limit")]
        return [Change("release", "loss_above", "loss")]  # closes after clear_steps

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, d):
        self.count = d["count"]


def test_user_rule_objects_run_and_resume():
    p = Policy(baselines=C.BaselineConfig(warmup_steps=0))
    rule = LossAbove(7.0)
    m = Monitor(p, rules=default_rules(p) + [rule])
    stream = warmup_stream(4)
    feed(m, stream, range(0, 250))  # power_loss(s) > 7 for s < 54.3
    hits = [a for a in m.history + m.alerts if a.rule == "loss_above"]
    assert len(hits) == 1 and hits[0].onset_step == 0 and hits[0].closed_step is not None
    # loss(s) = power_loss(s) * (1 + 0.01 n): it closed clear_steps (100) after the last
    # check above 7 (1% noise moves that by ~+-15 steps around 54).
    assert 135 <= hits[0].closed_step <= 175
    assert rule.count == 250 and m.rule("loss_above") is rule
    state = json.loads(json.dumps(m.state_dict()))
    assert state["rules"]["loss_above"] == {"count": 250}
    rule2 = LossAbove(7.0)
    m2 = Monitor.from_state_dict(state, rules=default_rules(p) + [rule2])
    assert m2.rule("loss_above") is rule2
    assert rule2.count == 250
    with pytest.raises(ValueError, match="unique names"):
        Monitor(p, rules=[LossAbove(1), LossAbove(2)])
    with pytest.raises(TypeError, match="name"):
        Monitor(p, rules=[object()])


# --------------------------------------------------------------------------
# The group rule.
# --------------------------------------------------------------------------


def _group_y(d, fam, group):
    """log(figure / the trunk's median of its family), as the group rule reads it."""
    layers = [v for k, v in d.items() if k.startswith(fam + "/layer_")]
    return math.log(d[f"{fam}/{group}"] / float(np.median(layers)))


@pytest.mark.parametrize("mult,share", [(6.0, 0.3), (3.0, 1.0)])
def test_embedding_lr_mismatch_is_a_group_yellow_naming_the_embedding(mult, share):
    """Its LR 30x: the update ratio x6 in one sample (the issue's case) opens at that
    sample; x3 (a moderate step beyond the 2x band) needs a second sample."""
    base = warmup_stream(5, warm=200)

    def stream(s):
        d = base(s)
        if s >= 2000 and "update/param_ratio/embedding" in d:
            d["update/param_ratio/embedding"] *= mult
            d["param/norm/embedding"] *= 1.0 + (s - 2000) / 1000.0
            d["grad/share/embedding"] *= share
        return d

    # The one-sample change of the update ratio (relative to the trunk) at 2000, from
    # the stream itself: >= log(5) (policy.bands.group_jump) opens at once, else at 2050.
    ref = warmup_stream(5, warm=200)
    before = after = None
    for s in range(0, 2001):
        d = ref(s)
        if s in (1950, 2000):
            y = _group_y(d, "update/param_ratio", "embedding") + (math.log(mult) if s == 2000 else 0)
            before, after = (y, after) if s == 1950 else (before, y)
    jump = after - before >= math.log(5.0)
    assert jump == (mult == 6.0)

    vs = feed(Monitor(), stream, range(0, 3000))
    alerts = [a for v in vs for a in v.new_alerts]
    assert [a.rule for a in alerts] == ["group"], [(a.rule, a.metric) for a in alerts]
    (a,) = alerts
    # Out of band from the group sample 2000: at once for a jump (an unmistakable
    # departure), else confirmed at 2050 (2 samples).
    assert a.details["group"] == "embedding" and a.onset_step == 2000
    assert a.opened_step == (2000 if jump else 2050)
    assert a.details["kind"] == ("jump" if jump else "step")
    assert a.metric in ("update/param_ratio/embedding", "grad/share/embedding")
    assert "embedding and LM head at 0.5x trunk LR" in a.prescription
    assert a.level == Level.YELLOW
    assert a.localization and a.localization[0].metric.endswith("/embedding")
    assert a.localization[0].departure_step == 2000
    assert max(v.level for v in vs) == Level.YELLOW


def test_a_schedule_moving_every_group_together_is_not_a_group_alert():
    """Cosine decay of the LR: every group's update ratio falls 10x together. (The
    logged opt/learning_rate is the schedule's, as the recorder logs it: the group
    rule reads the embedding's and the head's update ratios per unit LR.)"""
    base = warmup_stream(6, warm=200)

    def stream(s):
        d = base(s)
        f = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(s - 200, 0) / 6000, 1)))
        for k in list(d):
            if k.startswith("update/param_ratio") or k == "opt/learning_rate":
                d[k] *= f
        return d

    vs = feed(Monitor(), stream, range(0, 6500, 5))
    assert all(not v.alerts for v in vs), {a.rule for v in vs for a in v.alerts}


def _tied_embedding_stream(seed, creep_at=None):
    """:func:`warmup_stream` with a tied embedding that is most of the parameters (a small
    GPT-2's): its norm grows 6x and slows, 4.2x over the first 500 steps and 1.1x from 1000
    to 1500 (healthy, as a real run's embedding); from ``creep_at`` on it compounds,
    ``x exp(1e-6 (s - creep_at)^2)`` (a weight decay turning negative, ramping to -2e-3 a
    step over 1000 steps: the corpus' ``emb_wd_creep``). ``param/global_norm`` is the
    root sum of squares of the groups."""
    base = warmup_stream(seed, warm=200)
    rng = np.random.default_rng(seed + 1)

    def stream(s):
        d = base(s)
        if "param/norm/embedding" not in d:
            return d
        emb = 10.0 * (1.0 + 5.0 * (1.0 - math.exp(-s / 500.0))) * (1 + 0.005 * rng.standard_normal())
        if creep_at is not None and s > creep_at:
            emb *= math.exp(1e-6 * min(s - creep_at, 1000) ** 2)
        d["param/norm/embedding"] = emb
        layers = [d[f"param/norm/layer_{i}"] for i in range(4)]
        d["param/global_norm"] = math.sqrt(emb ** 2 + sum(x * x for x in layers))
        return d

    return stream


def test_a_compounding_creep_of_a_tied_embedding_is_a_group_growth_yellow():
    """The embedding's norm, relative to the trunk, rising more than 1.5x (``group_bands``)
    over 500 steps without slowing is the group rule's ``growth`` YELLOW; a healthy growth
    that slows (6x over the run, 4.2x in its first 500 steps) is none; without
    ``group_growth`` the drift test alone sees it later (here by 50 steps; in the corpus'
    runs, where the early growth set a larger drift of its own, not at all)."""
    from jvitals.monitor.config import BandConfig

    steps = range(0, 3001, 10)
    healthy = feed(Monitor(), _tied_embedding_stream(8), steps)
    assert not [a for v in healthy for a in v.new_alerts], [(a.rule, a.metric) for v in healthy for a in v.new_alerts]

    creep = _tied_embedding_stream(8, creep_at=1500)
    vs = feed(Monitor(), creep, steps)
    group = [a for v in vs for a in v.new_alerts if a.rule == "group"]
    assert len(group) == 1, [(a.rule, a.metric, a.opened_step) for a in group]
    (a,) = group
    assert a.metric == "param/norm/embedding" and a.details["kind"] == "growth", a.details
    # NumPy on the same stream: y = log(embedding / the layers' median) every 50 steps; the
    # first t with y(t) - y(t-500) > log(1.5) and >= y(t-500) - y(t-1000) opens, the sample
    # after it confirms (group_confirm = 2).
    ref = _tied_embedding_stream(8, creep_at=1500)
    ts = np.arange(0, 3001, 50)
    rows = {}
    for s_ in range(0, 3001, 10):
        d = ref(s_)
        if s_ % 50 == 0:
            rows[s_] = d
    y = np.array([_group_y(rows[t], "param/norm", "embedding") for t in ts])
    first = next(int(ts[j]) for j in range(20, len(ts))
                 if y[j] - y[j - 10] > math.log(1.5) and y[j] - y[j - 10] >= y[j - 10] - y[j - 20])
    assert a.onset_step == first and a.opened_step == first + 50, (a.onset_step, a.opened_step, first)
    assert 1500 < first <= 2300
    # Without the growth departure: no growth alert; the drift test, if it sees it, not sooner.
    off = feed(Monitor(Policy(bands=BandConfig(group_growth=()))), _tied_embedding_stream(8, creep_at=1500), steps)
    late = [b for v in off for b in v.new_alerts if b.rule == "group"]
    assert all(b.details["kind"] != "growth" and b.opened_step > a.opened_step for b in late), late


# --------------------------------------------------------------------------
# Trend rule (robust statistics against plain references).
# --------------------------------------------------------------------------


def test_theil_sen_and_mann_kendall_against_plain_python():
    rng = np.random.default_rng(7)
    x = np.arange(20, dtype=float) * 3.0
    y = 0.5 * x + rng.standard_normal(20)
    slopes = sorted((y[j] - y[i]) / (x[j] - x[i]) for i in range(20) for j in range(i + 1, 20))
    n = len(slopes)
    med = slopes[n // 2] if n % 2 else 0.5 * (slopes[n // 2 - 1] + slopes[n // 2])
    assert theil_sen(x, y) == pytest.approx(med, rel=1e-12)
    s = sum(np.sign(y[j] - y[i]) for i in range(20) for j in range(i + 1, 20))
    var = 20 * 19 * 45 / 18
    assert mann_kendall_z(y) == pytest.approx((s - 1) / math.sqrt(var), rel=1e-12)


def test_flat_noisy_grad_norm_has_no_trend_alert():
    base = warmup_stream(8, warm=200)
    vs = feed(Monitor(), base, range(0, 8000, 2))
    assert not any(a.rule == "grad_trend" for v in vs for a in v.alerts)


# --------------------------------------------------------------------------
# Quiet when healthy: confirmation of one-check excursions, the gap noise model.
# --------------------------------------------------------------------------


def test_one_check_grad_norm_excursion_is_not_an_alert():
    base = warmup_stream(9, warm=200)

    def stream(s):
        d = base(s)
        if s in (2000, 3000, 3500):
            d["grad/global_norm"] *= 2.6     # one check above 2x, below 3x
        if s == 3700:
            d["grad/global_norm"] *= 4.0     # one check above 3x (one bad batch)
        return d

    vs = feed(Monitor(), stream, range(0, 4000))
    assert all(v.level == Level.GREEN for v in vs)


def test_noisy_healthy_gap_is_quiet():
    """val/loss with noise 0.01 nats every 250 steps, the gap growing linearly
    (no acceleration): no val_gap alert over 40,000 steps."""
    rng = np.random.default_rng(10)

    def stream(s):
        d = {"loss": power_loss(s) * (1 + 0.01 * rng.standard_normal()), "grad/global_norm": 1.0}
        if s % 250 == 0:
            d["val/loss"] = power_loss(s) + 0.05 + 2e-6 * s + 0.01 * rng.standard_normal()
        return d

    vs = feed(Monitor(Policy(baselines=C.BaselineConfig(warmup_steps=0))), stream, range(0, 40_000, 10))
    assert not any(a.rule == "val_gap" for v in vs for a in v.alerts)


# --------------------------------------------------------------------------
# Broken model: RED fast.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", ["policy", "metric", "first_loss"])
def test_loss_at_chance_goes_red_within_100_steps(vocab):
    V = 50_000
    base = warmup_stream(11, warm=200)

    def stream(s):
        d = base(s)
        if vocab == "metric":
            d["model/vocab_size"] = V
        if s == 0 and vocab == "first_loss":
            d["loss"] = math.log(V)        # a model from scratch starts at chance
        if s >= 3000:
            d["loss"] = math.log(V) * (1 + 0.01 * math.sin(s))   # broken: at chance, stays
        return d

    m = Monitor(Policy(health=C.HealthConfig(vocab_size=V)) if vocab == "policy" else Policy())
    vs = feed(m, stream, range(0, 3300, 5))
    red = next(v.step for v in vs if v.level == Level.RED)
    assert red == 3100   # broken_loss_steps after the onset (checks every 5 steps)
    orange = next(v.step for v in vs if v.level == Level.ORANGE)
    assert orange == 3025
    (a,) = [a for a in m.alerts if a.rule == "broken_model"]
    assert a.level == Level.RED and a.onset_step == 3000 and a.metric == "loss"
    assert "chance level" in a.message


def test_a_spike_that_recovers_is_not_broken():
    V = 50_000
    base = warmup_stream(12, warm=200)

    def stream(s):
        d = base(s)
        if 3000 <= s < 3020:
            d["loss"] = math.log(V)        # 20 steps at chance, then back
        return d

    vs = feed(Monitor(Policy(health=C.HealthConfig(vocab_size=V))), stream, range(0, 3500))
    assert max(v.level for v in vs) <= Level.YELLOW


# --------------------------------------------------------------------------
# Localization: change points of the candidates' own histories.
# --------------------------------------------------------------------------


def test_localization_ignores_drift_and_finds_the_change_point():
    p = Policy(localize=C.LocalizeConfig(lookback=500, reference=1000))
    h = LayerHistory(p.localize.rows, max(1, p.localize.window // p.localize.rows))
    names = ["param/norm/layer_0", "grad/share/layer_1", "grad/share/layer_2"]
    cols = np.asarray([h.column(n, 10) for n in names], np.intp)
    rng = np.random.default_rng(13)
    for s in range(0, 4000, 50):
        drift = 10.0 * (1 + 2e-4 * s)                 # steady +2%/100 steps since the start
        step_ = 0.1 * (1.6 if s >= 3600 else 1.0)     # a level shift at 3600
        flat = 0.1 * (1 + 0.02 * rng.standard_normal())
        h.observe(s, s, cols, np.asarray([drift, step_ * (1 + 0.02 * rng.standard_normal()), flat]),
                  p, 0)
    loc = localize(h, 3700, "the anomaly", p)
    assert [x.metric for x in loc] == ["grad/share/layer_1"]
    assert loc[0].departure_step == 3600 and loc[0].lead_steps == 100
    assert re.match(r"grad/share/layer_1 rose from 10% to 1[5-7]% starting at step 3600, 100 steps "
                    r"before the anomaly$", loc[0].line), loc[0].line
    # Nothing changed before an onset at 3300: nothing named.
    h2 = LayerHistory(p.localize.rows, max(1, p.localize.window // p.localize.rows))
    cols2 = np.asarray([h2.column(n, 10) for n in names[:1]], np.intp)
    for s in range(0, 3400, 50):
        h2.observe(s, s, cols2, np.asarray([10.0 * (1 + 2e-4 * s)]), p, 0)
    assert localize(h2, 3300, "the anomaly", p) == []


# --------------------------------------------------------------------------
# Val rise (overfitting) and the router.
# --------------------------------------------------------------------------


def test_val_loss_rising_while_train_falls_is_a_yellow_within_a_few_hundred_steps():
    rng = np.random.default_rng(14)
    base = warmup_stream(14, warm=200)

    def stream(s):
        d = base(s)
        if s % 50 == 0:
            over = 0.0 if s < 1500 else 2e-3 * (s - 1500)     # net +0.7 nats per 500 steps
            d["val/loss"] = power_loss(s) + 0.1 + over + 0.01 * rng.standard_normal()
        return d

    vs = feed(Monitor(), stream, range(0, 2600, 10))
    hits = [a for v in vs for a in v.new_alerts]
    # val_rise; the gap rule may see it as well (it judges from one window of gap history
    # on, not two: the gap grows 0.7 nats per 500 steps here).
    assert {a.rule for a in hits} <= {"val_rise", "val_gap"}, [(a.rule, a.opened_step) for a in hits]
    hits = [a for a in hits if a.rule == "val_rise"]
    assert len(hits) == 1, hits
    assert 1500 < hits[0].opened_step <= 1900, hits[0].opened_step
    assert "early stop" in hits[0].prescription


def test_val_loss_every_500_steps_still_reaches_the_val_rise_rule():
    """At the README's heavy cadence (``val/loss`` every 500 steps): a val loss rising at two
    samples running while the train loss falls is a YELLOW at the second (the sparse form);
    with that form off, the window holds the last ``rise_min_samples`` samples and
    Mann-Kendall's test fires later; a healthy val loss (falling, noisy) or one on a noisy
    plateau never is."""
    def run(kind, policy):
        rng = np.random.default_rng(21)
        base = warmup_stream(21, warm=200)

        def stream(s):
            d = base(s)
            if s % 500 == 0 and s > 0:
                over = 0.2 * max(0, s - 2000) / 500 if kind == "overfit" else 0.0   # net rise from 2000
                level = power_loss(min(s, 2000)) if kind == "plateau" else power_loss(s)
                noise = 0.01 if kind == "plateau" else 0.005
                d["val/loss"] = level + 0.1 + over + noise * rng.standard_normal()
            return d

        vs = feed(Monitor(policy), stream, range(0, 9050, 50))
        return [a for v in vs for a in v.new_alerts if a.rule == "val_rise"]

    for kind in ("healthy", "plateau"):
        hits = run(kind, Policy())
        assert hits == [], (kind, [(a.rule, a.opened_step) for a in hits])
    # The val loss turns up after 2000: it rose at 2500 and at 3000, by 0.4 nats (> 2%).
    hits = run("overfit", Policy())
    assert [a.opened_step for a in hits] == [3000], hits
    assert hits[0].details["samples"] == 3 and 0.02 <= hits[0].details["rise"]
    assert "early stop" in hits[0].prescription
    # Without the sparse form: 8 rising samples of 500 steps (z > 3 needs nearly all 28 pairs
    # rising) and a second one to confirm.
    hits = run("overfit", Policy(validation=C.ValidationConfig(rise_sparse_run=0)))
    assert len(hits) == 1, hits
    assert 5500 <= hits[0].opened_step <= 7000, hits[0].opened_step


def test_router_collapse_is_a_yellow():
    rng = np.random.default_rng(15)
    base = warmup_stream(15, warm=200)

    def stream(s):
        d = base(s)
        push = max(0.0, (s - 1500) / 200.0)
        d["moe/maxvio.max"] = 0.15 + 0.03 * rng.standard_normal() + push
        d["moe/dead_expert_ratio"] = 0.0 if push < 1.0 else 0.5
        return d

    vs = feed(Monitor(), stream, range(0, 2200, 10))
    hits = [a for v in vs for a in v.new_alerts]
    assert {a.rule for a in hits} == {"router"}, [(a.rule, a.metric, a.opened_step) for a in hits]
    first = min(hits, key=lambda a: a.opened_step)
    # maxvio 0.5 above its ~0.15 baseline from step 1600 (push 0.5), held 50 steps.
    assert 1640 <= first.opened_step <= 1700 and first.metric == "moe/maxvio.max"
    assert first.localization and first.localization[0].metric.startswith("moe/")
