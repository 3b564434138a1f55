"""The rules that judge a figure by what its scale means (``rules_scale``), the broken-model
rule's loss condition, and the remedies' in-flight settings, on seeded synthetic streams and
real optimizer states. Every expected step and value is computed here from the stream's own
definition or with NumPy, not read off the code under test."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jvitals as vitals
from jvitals.monitor.types import Level
from jvitals.monitor.monitor import Monitor
from jvitals.monitor.policy import Policy
from jvitals.monitor.config import ScaleConfig

LAYERS = 3


def attn_stream(seed: int, peak: float, rise_steps: int, start: int = 0, steps: int = 1500,
                warm: int = 200, clip_at: int | None = None):
    """A run whose layer-1 attention logit grows geometrically from 5 to ``peak`` over
    ``rise_steps`` steps from ``start`` (the other layers stay near 5); the loss falls as a
    power law; an LR warm-up over ``warm`` steps. ``clip_at``: from this step layer 1 is held
    at 15 (a QK-clip at the guard's tau)."""
    rng = np.random.default_rng(seed)

    def logit(s: int) -> float:
        if clip_at is not None and s >= clip_at:
            return 15.0
        u = min(max(s - start, 0) / rise_steps, 1.0)
        return 5.0 * (peak / 5.0) ** u

    def row(s: int) -> dict[str, float]:
        n = rng.standard_normal(6)
        lr = 1e-3 * min(1.0, (s + 1) / warm)
        d = {"loss": (2.0 + 4.0 * (1 + s / 100) ** -0.7) * (1 + 0.01 * n[0]),
             "grad/global_norm": 1.0 * math.exp(0.05 * n[1]), "param/global_norm": 50.0 + 0.01 * s,
             "update/param_ratio": lr * (1 + 0.05 * n[2]), "opt/learning_rate": lr}
        per = [5.0 * math.exp(0.03 * n[3]), logit(s) * math.exp(0.03 * n[4]), 5.0 * math.exp(0.03 * n[5])]
        for i, v in enumerate(per):
            d[f"act/attn_logits_abs.max/layer_{i}"] = v
        d["act/attn_logits_abs.max"] = max(per)
        return d

    return [row(s) for s in range(steps)], logit


def run(rows, cadence: int, policy: Policy | None = None):
    mon = Monitor(policy or Policy())
    events = []
    seen: dict[int, int] = {}
    for s in range(0, len(rows), cadence):
        v = mon.update(s, rows[s])
        for a in v.alerts:
            if int(a.level) > seen.get(a.id, 0):
                seen[a.id] = int(a.level)
                events.append((s, a.level, a.rule, dataclasses.replace(a, details=dict(a.details or {}))))
    return events, mon


@pytest.mark.parametrize("cadence", [10, 50])
def test_attention_logits_growing_into_saturation_yellow_orange_then_red(cadence):
    rows, logit = attn_stream(0, peak=800.0, rise_steps=400)
    events, _ = run(rows, cadence)
    c = ScaleConfig()
    checks = list(range(0, len(rows), cadence))
    # The first check where layer 1 is >= 30 and >= 3x its minimum over the last 200 steps.
    def cond(s):
        lo = min(rows[t]["act/attn_logits_abs.max/layer_1"] for t in checks if s - c.attn_window <= t <= s)
        x = rows[s]["act/attn_logits_abs.max/layer_1"]
        return x >= c.attn_level and x >= c.attn_growth * lo
    want_y = next(s for s in checks if cond(s))
    want_o = next(s for s in checks if s >= want_y and rows[s]["act/attn_logits_abs.max"] >= c.attn_orange)
    attn = [(s, lv) for s, lv, rule, _ in events if rule == "attn_logits"]
    assert attn[0] == (want_y, Level.YELLOW)
    assert (want_o, Level.ORANGE) in attn
    first = events[0]
    assert first[2] == "attn_logits" and first[0] == want_y
    assert first[3].details["layers"] == [1]
    assert "qk-layernorm" in first[3].prescription and "QK-clip" in first[3].prescription
    red = [s for s, lv, rule, _ in events if lv == Level.RED]
    assert red and red[0] == checks[checks.index(want_o) + 2]     # divergence: 3 checks running
    assert all(rule not in ("broken_model",) for _, _, rule, _ in events)


@pytest.mark.parametrize("peak, rise", [(60.0, 1500), (17.0, 200)])
def test_logits_rising_slowly_or_staying_below_the_level_are_quiet(peak, rise):
    # 5 -> 60 over 1,500 steps: at most 1.8x over any 200 steps (healthy runs, 10-50x over a
    # thousand steps); 5 -> 17 at once: below the level where a softmax row is one-hot.
    rows, _ = attn_stream(1, peak=peak, rise_steps=rise)
    for cadence in (10, 50):
        events, _ = run(rows, cadence)
        assert [e for e in events if e[2] == "attn_logits"] == []


def test_a_model_whose_logits_sit_high_from_the_start_is_quiet():
    rows, _ = attn_stream(2, peak=150.0, rise_steps=1)   # at 150 from step 1: no growth
    events, _ = run(rows, 10)
    assert [e for e in events if e[2] == "attn_logits" and e[0] > 10] == []


def test_a_clipped_attention_closes_the_alert():
    rows, _ = attn_stream(3, peak=800.0, rise_steps=400, clip_at=300, steps=900)
    mon = Monitor(Policy())
    opened = closed = None
    for s in range(0, len(rows), 10):
        v = mon.update(s, rows[s])
        if opened is None and any(a.rule == "attn_logits" for a in v.new_alerts):
            opened = s
        if opened is not None and any(a.rule == "attn_logits" for a in v.closed_alerts):
            closed = s
    assert opened is not None and opened < 300
    assert closed is not None and 300 <= closed <= 300 + Policy().alerts.clear_steps + 10
    assert not any(a.rule == "attn_logits" for a in v.alerts)


def _broken_rows(loss_rises: bool, steps: int = 600):
    """The param norm 1.6x between steps 300 and 360 (after a 200-step warm-up); the loss
    falling throughout, or rising 30% over the same steps."""
    rows = []
    for s in range(steps):
        lr = 1e-3 * min(1.0, (s + 1) / 200)
        pn = 50.0 * (1.0 + 0.6 * min(max(s - 300, 0) / 60, 1.0))
        loss = 2.0 + 4.0 * (1 + s / 100) ** -0.7
        if loss_rises:
            loss *= 1.0 + 0.3 * min(max(s - 300, 0) / 60, 1.0)
        rows.append({"loss": loss, "param/global_norm": pn, "grad/global_norm": 1.0,
                     "update/param_ratio": lr, "opt/learning_rate": lr})
    return rows


def test_a_param_norm_growing_while_the_loss_falls_is_not_a_broken_model():
    events, _ = run(_broken_rows(False), 10)
    assert [e for e in events if e[2] == "broken_model"] == []


def test_a_param_norm_jump_with_the_loss_rising_is_orange_broken_model():
    events, _ = run(_broken_rows(True), 10)
    broken = [(s, lv) for s, lv, rule, _ in events if rule == "broken_model"]
    assert broken and broken[0][1] == Level.ORANGE
    # 1.5x of the value 100 steps before: pn(s) >= 1.5 pn(s - 100) first at s = 350 (NumPy).
    s = np.arange(0, 600, 10)
    pn = 50.0 * (1.0 + 0.6 * np.clip((s - 300) / 60, 0, 1))
    ref = 50.0 * (1.0 + 0.6 * np.clip((s - 100 - 300) / 60, 0, 1))
    assert broken[0][0] == int(s[np.argmax(pn >= 1.5 * ref)])


# ----------------------------------------------------------------------------------
# The remedies' settings in the optimizer state, and QK-clip read from the metrics.


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {"layers_0": {"self_attn": {"q_proj": {"kernel": jax.random.normal(k[0], (8, 8))},
                                       "k_proj": {"kernel": jax.random.normal(k[1], (8, 8))},
                                       "v_proj": {"kernel": jax.random.normal(k[2], (8, 8))}}},
            "layers_1": {"self_attn": {"q_proj": {"kernel": jax.random.normal(k[3], (8, 8))},
                                       "k_proj": {"kernel": jax.random.normal(k[0], (8, 8)) * 2},
                                       "v_proj": {"kernel": jax.random.normal(k[1], (8, 8))}}}}


def test_remedy_settings_round_trip_and_read_as_off_without_them():
    tx = vitals.with_lr_scale(optax.adamw(1e-3))
    st = tx.init(_params())
    assert vitals.get_remedy(st, "qk_clip_tau") == math.inf and vitals.get_remedy(st, "z_loss") == 0.0
    # Stored finite (0 for "off"), so a checkpoint of it passes the guard's finiteness check in any dtype.
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(st))
    st2 = vitals.set_remedy(st, "qk_clip_tau", 25.0)
    assert vitals.get_remedy(st2, "qk_clip_tau") == 25.0 and vitals.get_remedy(st, "qk_clip_tau") == math.inf
    assert vitals.get_remedy(vitals.set_remedy(st2, "qk_clip_tau", math.inf), "qk_clip_tau") == math.inf
    assert jax.tree.structure(st2) == jax.tree.structure(st)
    assert vitals.get_lr_scale(st2) == 1.0
    plain = optax.adamw(1e-3).init(_params())
    assert float(vitals.remedy(plain, "z_loss")) == 0.0
    with pytest.raises(ValueError, match="with_lr_scale"):
        vitals.set_remedy(plain, "z_loss", 1e-4)
    with pytest.raises(ValueError, match="qk_clip_tau must be > 0"):
        vitals.set_remedy(st, "qk_clip_tau", -1.0)
    with pytest.raises(ValueError, match="unknown remedy setting 'qk_tau'"):
        vitals.get_remedy(st, "qk_tau")


def test_qk_clip_from_the_metrics_at_the_guards_tau_matches_numpy():
    params = _params()
    tx = vitals.with_lr_scale(optax.sgd(0.0))
    st = tx.init(params)
    metrics = {"act/attn_logits_abs.max/layer_0": jnp.float32(10.0),
               "act/attn_logits_abs.max/layer_1": jnp.float32(100.0)}
    step = jax.jit(lambda p, m, s: vitals.qk_clip(p, m, vitals.remedy(s, "qk_clip_tau")))
    off = step(params, metrics, st)
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    on = step(params, metrics, vitals.set_remedy(st, "qk_clip_tau", 25.0))
    g = math.sqrt(25.0 / 100.0)    # layer 1's logits x 25/100: Wq and Wk each x sqrt of it
    for name in ("q_proj", "k_proj"):
        np.testing.assert_allclose(np.asarray(on["layers_1"]["self_attn"][name]["kernel"]),
                                   g * np.asarray(params["layers_1"]["self_attn"][name]["kernel"]), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(on["layers_0"]["self_attn"][name]["kernel"]),
                                      np.asarray(params["layers_0"]["self_attn"][name]["kernel"]))
    np.testing.assert_array_equal(np.asarray(on["layers_1"]["self_attn"]["v_proj"]["kernel"]),
                                  np.asarray(params["layers_1"]["self_attn"]["v_proj"]["kernel"]))
    with pytest.raises(ValueError, match="act/attn_logits_abs.max"):
        vitals.qk_clip(params, {"loss": 1.0}, 25.0)


def test_the_guards_qk_clip_remedy_sets_the_tau_in_flight():
    from jvitals.guard.remedies import apply_remedies, parse_remedies, reapply_remedies

    st = vitals.with_lr_scale(optax.adamw(1e-3)).init(_params())
    alert = {"id": 3, "rule": "attn_logits", "metric": "act/attn_logits_abs.max/layer_1", "level": 2,
             "value": 500.0, "baseline": 5.0, "details": {"qk_clip_tau": 25.0}}
    new, flags, acts = apply_remedies(st, [alert], parse_remedies("default"), {})
    assert vitals.get_remedy(new, "qk_clip_tau") == 25.0 and flags["qk_clip_tau"] == 25.0
    assert "in flight" in acts[0]["text"]
    # A restore brings back a checkpoint written before the remedy: set again.
    assert vitals.get_remedy(reapply_remedies(st, flags), "qk_clip_tau") == 25.0


def _repeat_rows(collapse_at: int | None, steps: int = 1600):
    """A healthy run (power-law loss, warm-up 200); from ``collapse_at`` for 300 steps the
    loader repeats a few batches: the loss falls to 3% of its level within 50 steps."""
    rows = []
    for s in range(steps):
        lr = 1e-3 * min(1.0, (s + 1) / 200)
        loss = 1.6 + 4.0 * (1 + s / 50) ** -0.8
        if collapse_at is not None and collapse_at <= s < collapse_at + 300:
            loss *= max(0.03, 1.0 - (s - collapse_at) / 50)
        rows.append({"loss": loss, "grad/global_norm": 1.0, "param/global_norm": 50.0,
                     "update/param_ratio": lr, "opt/learning_rate": lr})
    return rows


@pytest.mark.parametrize("cadence", [10, 50])
def test_a_collapsing_loss_is_a_repeat_yellow(cadence):
    rows = _repeat_rows(1000)
    events, _ = run(rows, cadence)
    rep = [(s, lv) for s, lv, rule, _ in events if rule == "repeat"]
    assert rep and rep[0][1] == Level.YELLOW
    # The first check whose loss is 3x below the median of the checks of the 200 steps before.
    checks = list(range(0, len(rows), cadence))
    want = next(s for s in checks if s >= 1000 and rows[s]["loss"] * 3.0
                <= float(np.median([rows[t]["loss"] for t in checks if s - 200 <= t < s])))
    assert rep[0][0] == want
    assert "memorising" in [a for s, lv, rule, a in events if rule == "repeat"][0].message


def test_a_healthy_loss_curve_never_collapses():
    for cadence in (10, 50):
        events, _ = run(_repeat_rows(None), cadence)
        assert [e for e in events if e[2] == "repeat"] == []


@pytest.mark.slow
def test_the_recorder_gives_the_updates_rms_and_adams_scale_with_a_small_epsilon():
    """``update/rms = ||u|| / sqrt(n)`` (NumPy on the applied update); per unit LR it is
    Adam's 0.1-1 with eps 1e-8, and far below it with an epsilon above the gradients' scale."""
    params = _params()
    grads = jax.tree.map(lambda x: 1e-3 * jnp.sin(x), params)
    n = sum(x.size for x in jax.tree.leaves(params))
    got = {}
    for eps in (1e-8, 1.0):
        tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2, eps=eps)))
        st = tx.init(params)
        u, st = tx.update(grads, st, params)
        m = jax.device_get(dict(vitals.recorded(st)))
        want = math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(u)) / n)
        np.testing.assert_allclose(m["update/rms"], want, rtol=1e-5)
        got[eps] = want / 1e-2
    assert got[1e-8] > 0.1 and got[1.0] < 0.05 * got[1e-8]


@pytest.mark.parametrize("every", [1, None], ids=["heavy", "light"])
def test_update_rms_counts_the_global_parameters_inside_shard_map(every):
    """Inside ``shard_map`` a leaf's shape is its shard's: ``n`` is the global count (a
    leaf sharded 4 ways counts 4 shards), so ``update/rms`` equals NumPy's on the
    gathered update, on the light and the per-layer (heavy) step alike."""
    from functools import partial

    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("expert", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(3)
    params = {"layers_0": {"experts": {"up_proj": jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)},
                           "router": {"kernel": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}}}
    grads = jax.tree.map(lambda p: 1e-3 * jnp.sin(p), params)
    specs = {"layers_0": {"experts": {"up_proj": P("expert")}, "router": {"kernel": P()}}}
    kw = {"every": {"heavy": 1}} if every else {}
    tx = vitals.record(optax.sgd(0.1), axes=("expert", "data"), specs=specs, post="update", **kw)
    state_specs = jax.tree.map(lambda _: P(), tx.init(params))
    put = lambda t: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), t, specs)  # noqa: E731

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, state_specs, specs), out_specs=state_specs)
    def step(g, s, p):
        return tx.update(g, s, p)[1]

    m = jax.device_get(dict(vitals.recorded(step(put(grads), tx.init(params), put(params)))))
    u = [0.1 * np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    want = math.sqrt(sum(float(np.sum(x * x)) for x in u) / sum(x.size for x in u))
    np.testing.assert_allclose(m["update/rms"], want, rtol=1e-5)
