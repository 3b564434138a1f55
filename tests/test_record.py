"""The optax recorder, checked against optax.global_norm, NumPy and the bare transforms."""

import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jvitals as vitals
from jvitals.reference_model import ModelConfig, init_params
from jvitals.metrics.checks import check_cadence

record_module = importlib.import_module("jvitals.metrics.record")
chain_module = importlib.import_module("jvitals.metrics.chain")


def tree(seed=0, scale=1.0):
    """A small Llama-like tree with two layers (roles: Wq, W_up, norms, embedding)."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * scale)  # noqa: E731
    return {
        "embed_tokens": {"embedding": f(16, 8)},
        "layers_0": {"self_attn": {"q_proj": {"kernel": f(8, 8)}}, "mlp": {"up_proj": {"kernel": f(8, 12)}},
                     "input_layernorm": {"scale": f(8)}},
        "layers_1": {"self_attn": {"q_proj": {"kernel": f(8, 8) * 3}}, "mlp": {"up_proj": {"kernel": f(8, 12)}},
                     "input_layernorm": {"scale": f(8)}},
        "lm_head": {"kernel": f(8, 16)},
    }


def np_norm(t):
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(t))))


def applied_change(p, u):
    """What a float32 step applies: ``(p + u) - p`` in float32 (IEEE rounding, as XLA's)."""
    p32 = np.asarray(p, np.float32)
    return (p32 + np.asarray(u, np.float32)) - p32


@pytest.mark.slow
def test_first_in_chain_records_pre_clip_and_params():
    params, grads = tree(0), tree(1, scale=5.0)
    tx = optax.chain(vitals.record(every={"heavy": 1}), optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads, state, params)
    m = vitals.recorded(state)
    np.testing.assert_allclose(float(m["grad/global_norm"]), float(optax.tree.norm(grads)), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad/global_norm"]), np_norm(grads), rtol=1e-6)
    np.testing.assert_allclose(float(m["param/global_norm"]), np_norm(params), rtol=1e-6)
    assert float(m["grad/nonfinite_count"]) == 0
    # per-role and per-layer figures, from NumPy
    np.testing.assert_allclose(float(m["grad/Wq_abs.max"]),
                               max(np.abs(grads[f"layers_{i}"]["self_attn"]["q_proj"]["kernel"]).max() for i in (0, 1)),
                               rtol=1e-6)
    n0 = np_norm(grads["layers_0"])
    np.testing.assert_allclose(float(m["grad/norm/layer_0"]), n0, rtol=1e-6)
    np.testing.assert_allclose(float(m["grad/share/layer_0"]), n0 ** 2 / np_norm(grads) ** 2, rtol=1e-5)
    np.testing.assert_allclose(float(m["param/norm/layer_1"]), np_norm(params["layers_1"]), rtol=1e-6)
    assert "grad/global_norm_post_clip" not in m  # nothing wrapped: nothing post


def test_wrapped_clip_records_pre_and_post_and_is_bit_identical():
    params, grads = tree(0), tree(2, scale=5.0)
    clip = optax.clip_by_global_norm(1.0)
    wrapped = vitals.record(clip)
    out_bare, state_bare = jax.jit(clip.update)(grads, clip.init(params), params)
    state = wrapped.init(params)
    out, state = jax.jit(wrapped.update)(grads, state, params)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out_bare)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(state.inner_state) == jax.tree.structure(state_bare)
    m = vitals.recorded(state)
    pre, post = float(optax.tree.norm(grads)), float(optax.tree.norm(out_bare))
    np.testing.assert_allclose(float(m["grad/global_norm"]), pre, rtol=1e-6)
    np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), post, rtol=1e-6)
    np.testing.assert_allclose(float(m["grad/clip_ratio"]), post / pre, rtol=1e-6)
    assert float(m["grad/clipped"]) == 1.0
    # below the threshold the clip does not fire
    small = jax.tree.map(lambda g: g * 1e-3, grads)
    _, state = jax.jit(wrapped.update)(small, state, params)
    m = vitals.recorded(state)
    assert float(m["grad/clipped"]) == 0.0
    np.testing.assert_allclose(float(m["grad/clip_ratio"]), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_optax_tree_get_reads_the_recorder():
    params = tree(0)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.adamw(1e-3))
    state = tx.init(params)
    _, state = tx.update(tree(3), state, params)
    np.testing.assert_allclose(float(optax.tree.get(state, "grad/global_norm")),
                               float(optax.tree.norm(tree(3))), rtol=1e-6)


@pytest.mark.slow
def test_wrapping_the_whole_optimizer_records_the_update():
    params, grads = tree(0), tree(4)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    tx = vitals.record(opt)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    ref_updates, _ = opt.update(grads, opt.init(params), params)
    m = vitals.recorded(state)
    np.testing.assert_allclose(float(m["update/global_norm"]), float(optax.tree.norm(ref_updates)), rtol=1e-6)
    np.testing.assert_allclose(float(m["update/param_ratio"]), np_norm(ref_updates) / np_norm(params), rtol=1e-5)
    # The clip first in the chain is recognised: its post-clip figures come out too.
    pre = np_norm(grads)
    np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), min(pre, 1.0), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad/clip_ratio"]), min(pre, 1.0) / pre, rtol=1e-6)
    assert float(m["grad/clipped"]) == float(pre > 1.0)
    # A chain without a leading clip (adamw first) gives the update figures only.
    tx = vitals.record(optax.chain(optax.adamw(1e-2), optax.clip_by_global_norm(1.0)))
    _, state = tx.update(grads, tx.init(params), params)
    assert "update/global_norm" in vitals.recorded(state)
    assert "grad/global_norm_post_clip" not in vitals.recorded(state)


@pytest.mark.slow
def test_post_kind_can_be_forced_for_stateless_sgd():
    params, grads = tree(0), tree(5)
    tx = vitals.record(optax.sgd(0.1), post="update")
    _, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(float(vitals.recorded(state)["update/global_norm"]),
                               0.1 * float(optax.tree.norm(grads)), rtol=1e-6)
    with pytest.raises(ValueError, match="post='sideways'"):
        bad = vitals.record(optax.sgd(0.1), post="sideways")
        bad.update(grads, bad.init(params), params)


def test_nonfinite_gradients_are_recorded_not_raised():
    params, grads = tree(0), tree(6)
    grads["layers_1"]["mlp"]["up_proj"]["kernel"] = grads["layers_1"]["mlp"]["up_proj"]["kernel"].at[0, :3].set(jnp.nan)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0), every={"heavy": 1}), optax.adamw(1e-3))
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    m = vitals.recorded(state)
    assert np.isnan(float(m["grad/global_norm"]))
    assert float(m["grad/nonfinite_count"]) == 3
    assert float(m["grad/nonfinite_count/layer_1"]) == 3 and float(m["grad/nonfinite_count/layer_0"]) == 0
    assert np.isnan(float(m["grad/W_up_rms"]))


@pytest.mark.slow
def test_apply_if_finite_placement_keeps_the_nan_visible():
    params, grads = tree(0), tree(7)
    bad = jax.tree.map(lambda g: g.at[..., 0].set(jnp.inf), grads)
    tx = vitals.record(optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 3))
    state = tx.init(params)
    updates, state = tx.update(bad, state, params)
    m = vitals.recorded(state)
    assert np.isnan(float(m["grad/global_norm"])) and float(m["grad/nonfinite_count"]) > 0
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))  # the step was skipped
    assert int(vitals.optimizer_metrics(state)["opt/skipped_steps"]) == 1


def test_inject_hyperparams_nesting_is_found():
    params, grads = tree(0), tree(8)
    tx = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.adam(learning_rate))
    )(learning_rate=1e-3)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(float(vitals.recorded(state)["grad/global_norm"]), np_norm(grads), rtol=1e-6)


def test_multisteps_inside_records_the_accumulated_gradient_at_the_boundary():
    params = tree(0)
    micro = [tree(10 + i) for i in range(3)]
    inner = optax.chain(vitals.record(optax.clip_by_global_norm(100.0)), optax.sgd(0.1))
    tx = optax.MultiSteps(inner, every_k_schedule=3)
    state = tx.init(params)
    step = jax.jit(tx.update)
    norms = []
    for g in micro:
        _, state = step(g, state, params)
        m = jax.device_get(vitals.recorded(state))
        norms.append(float(m.latest()["grad/global_norm"]))
        assert ("grad/global_norm" in m) == (len(norms) == 3)  # fresh only once an update is applied
    mean_grad = jax.tree.map(lambda *g: sum(g) / 3, *micro)
    assert np.isnan(norms[0]) and np.isnan(norms[1])  # nothing applied yet: nothing recorded
    np.testing.assert_allclose(norms[2], np_norm(mean_grad), rtol=1e-5)
    assert int(vitals.recorded_steps(state)["light"]) == 0


@pytest.mark.slow
def test_multisteps_outside_records_every_micro_batch():
    params = tree(0)
    tx = optax.chain(vitals.record(), optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3))
    state = tx.init(params)
    for i in range(2):
        g = tree(20 + i)
        _, state = tx.update(g, state, params)
        np.testing.assert_allclose(float(vitals.recorded(state)["grad/global_norm"]), np_norm(g), rtol=1e-6)


def test_cadence_values_and_last_steps():
    """Per-role figures at the heavy cadence; per-layer and per-group norms (from the light
    step's per-leaf sums) and the global figures at the global one; NumPy references."""
    params = tree(0)
    tx = vitals.record(optax.clip_by_global_norm(1.0), every={"light": 2, "heavy": 3})
    state = tx.init(params)
    step = jax.jit(tx.update)
    seen = []

    def wq_max(g):
        return max(float(np.abs(np.asarray(g[f"layers_{i}"]["self_attn"]["q_proj"]["kernel"])).max()) for i in (0, 1))

    for i in range(7):
        g = tree(30 + i)
        _, state = step(g, state, params)
        rec, last = jax.device_get(vitals.recorded(state)), vitals.recorded_steps(state)
        m = rec.latest()
        seen.append((i, float(m["grad/global_norm"]), float(m["grad/norm/layer_0"]), float(m["grad/Wq_abs.max"]),
                     int(last["light"]), int(last["heavy"])))
        # only what was computed at this update is shown
        assert ("grad/Wq_abs.max" in rec) == (i % 3 == 0), i
        assert ("grad/global_norm" in rec) == ("grad/norm/layer_0" in rec) == (i % 2 == 0 or i % 3 == 0), i
    grads = [tree(30 + i) for i in range(7)]
    for i, gnorm, l0, wq, last_light, last_heavy in seen:
        lg = max(j for j in range(i + 1) if j % 2 == 0 or j % 3 == 0)  # heavy steps refresh the light figures too
        ll = max(j for j in range(i + 1) if j % 3 == 0)
        assert (last_light, last_heavy) == (lg, ll), i
        np.testing.assert_allclose(gnorm, np_norm(grads[lg]), rtol=1e-6)
        np.testing.assert_allclose(l0, np_norm(grads[lg]["layers_0"]), rtol=1e-6)
        np.testing.assert_allclose(wq, wq_max(grads[ll]), rtol=1e-6)


def test_off_cadence_steps_do_not_compute_the_heavy_family(monkeypatch):
    """A test-only build: a host callback counts how often the heavy family runs."""
    calls = []
    original = record_module._heavy_figures

    def counting(*args, **kwargs):
        jax.debug.callback(lambda: calls.append(1))
        return original(*args, **kwargs)

    monkeypatch.setattr(record_module, "_heavy_figures", counting)
    params = tree(0)
    tx = vitals.record(every={"heavy": 4})
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(9):
        _, state = step(tree(40 + i), state, params)
    jax.effects_barrier()
    assert len(calls) == 3  # steps 0, 4, 8
    hlo = step.lower(tree(0), state, params).compile().as_text()
    assert "conditional" in hlo


def test_second_step_does_not_recompile(count_compiles):
    params = tree(0)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.adamw(1e-3))
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state = jax.device_put(tx.init(params))
    g1, g2 = jax.device_put(tree(50)), jax.device_put(tree(51))
    params = jax.device_put(params)
    _, state = step(g1, state, params)
    with count_compiles() as c:
        _, state = step(g2, state, params)
        jax.block_until_ready(state)
    assert c.count == 0


@pytest.mark.slow
def test_sharded_equals_unsharded():
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(60)
    params = {"layers_0": {"moe": {"experts": {"up_proj": jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)},
                                   "router": {"kernel": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}}},
              "lm_head": {"kernel": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}}
    grads = jax.tree.map(lambda p: p * 2.5 + 0.1, params)
    specs = {"layers_0": {"moe": {"experts": {"up_proj": P("expert")}, "router": {"kernel": P()}}},
             "lm_head": {"kernel": P()}}
    # optax's clip is not mesh-aware: inside shard_map it would clip each expert
    # shard by its local norm. A threshold that does not fire keeps both views equal.
    clip = optax.clip_by_global_norm(1e3)

    one = vitals.record(clip, every={"heavy": 1})
    _, s1 = one.update(grads, one.init(params), params)
    ref = vitals.recorded(s1)

    # specs: the clip's outputs vary (by type) along `expert` through its norm, so
    # only the specs can say that the replicated leaves are still replicated.
    sharded = vitals.record(clip, every={"heavy": 1}, axes=("data", "expert"), specs=specs)
    put = lambda t: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), t, specs)  # noqa: E731
    state_specs = jax.tree.map(lambda _: P(), sharded.init(params))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, state_specs, specs), out_specs=state_specs)
    def step(g, s, p):
        return sharded.update(g, s, p)[1]

    s2 = step(put(grads), sharded.init(params), put(params))
    got = vitals.recorded(s2)
    for k in ("grad/global_norm", "grad/global_norm_post_clip", "param/global_norm", "grad/norm/layer_0",
              "grad/norm/lm_head", "grad/share/lm_head", "param/norm/lm_head"):
        np.testing.assert_allclose(float(got[k]), float(ref[k]), rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(got["grad/global_norm"]), np_norm(grads), rtol=1e-6)
    np.testing.assert_allclose(float(got["grad/share/lm_head"]),
                               np_norm(grads["lm_head"]) ** 2 / np_norm(grads) ** 2, rtol=1e-5)

    # GSPMD: jit over NamedSharding arrays, axes=()
    g3 = jax.jit(lambda g, s, p: one.update(g, s, p)[1])(put(grads), one.init(params), put(params))
    np.testing.assert_allclose(float(vitals.recorded(g3)["grad/global_norm"]), np_norm(grads), rtol=1e-6)


@pytest.mark.slow
def test_reference_model_tree_and_orbax_round_trip(tmp_path):
    cfg = ModelConfig(moe=True, attention="mla", attn_gate=True, n_mtp=1, scan_layers=True)
    params = init_params(cfg, jax.random.key(0))
    grads = jax.tree.map(lambda p: p * 0.5, params)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0), every={"heavy": 1}), optax.adamw(1e-3))
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    m = vitals.recorded(state)
    np.testing.assert_allclose(float(m["grad/global_norm"]), np_norm(grads), rtol=1e-6)
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda a: a[i], params["layers"])
        np.testing.assert_allclose(float(m[f"param/norm/layer_{i}"]), np_norm(layer), rtol=1e-5)
    assert "grad/mla_Q_down_abs.max" in m and "grad/mla_KV_up_abs.max" in m

    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(7, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = mngr.restore(7, args=ocp.args.StandardRestore(abstract))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    back = vitals.recorded(restored)
    assert set(back) == set(m)
    for k in m:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(m[k]))


def test_bad_cadence_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown family 'activations'"):
        vitals.record(every={"activations": 10})
    with pytest.raises(ValueError, match="a cadence must be >= 1"):
        vitals.record(every={"heavy": 0})


def test_two_recorders_with_the_same_names_are_an_error():
    params = tree(0)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), vitals.record(optax.clip_by_global_norm(1.0)))
    state = tx.init(params)
    with pytest.raises(ValueError, match="two recorders"):
        vitals.recorded(state)


def test_packed_metrics_reads_as_a_flat_dict_and_is_one_leaf():
    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros((2,))}}
    grads = jax.tree.map(lambda x: jnp.full_like(x, 2.0), params)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.sgd(0.1))
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads, state, params)
    rec = state[0]
    assert isinstance(rec.metrics, vitals.PackedMetrics)
    assert len(jax.tree.leaves(rec.metrics)) == 1
    assert rec.metrics.vector.shape == (len(rec.metrics.names) + len(rec.metrics.flags),)
    # no layer, no role: the heavy family is empty; the window's flags, no loss given
    assert rec.metrics.flags == ("light", "window", "window_loss")
    shown = {n for n, f in zip(rec.metrics.names, rec.metrics.families) if f != "window_loss"}
    want = float(optax.tree.norm(grads))
    on_device = vitals.recorded(state)
    on_host = vitals.recorded(jax.device_get(state))  # NumPy-backed after device_get
    for got in (on_device, on_host, dict(rec.metrics), {**rec.metrics}):
        np.testing.assert_allclose(float(got["grad/global_norm"]), want, rtol=1e-6)
        assert set(got) == shown
    np.testing.assert_allclose(float(optax.tree.get(state, "grad/global_norm_post_clip")), 1.0, rtol=1e-6)
    assert "grad/clip_ratio" in rec.metrics and "nope" not in rec.metrics and rec.metrics.get("nope") is None
    # Abstract and spec trees keep the structure (what orbax and sharding code build).
    shapes = jax.eval_shape(lambda s: s, state)
    assert shapes[0].metrics["grad/global_norm"].shape == ()
    specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)
    assert jax.tree.structure(specs) == jax.tree.structure(state)
    assert jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(rec)[0][1][0]) == ".metrics.vector"


def test_static_vitals_heavy_flag_picks_the_family_at_trace_time(monkeypatch):
    """``vitals_heavy`` as a Python bool: no heavy pass traced when False; values as NumPy says."""
    traced = []
    original = record_module._gradients.plain_grad_figures   # the per-role pass under jit (float32)

    def counting(*args, **kwargs):
        traced.append(1)  # at trace time only
        return original(*args, **kwargs)

    monkeypatch.setattr(record_module._gradients, "plain_grad_figures", counting)
    params = tree(0)
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.adamw(1e-3))
    step = jax.jit(lambda g, s, p, full: tx.update(g, s, p, vitals_heavy=full), static_argnames="full")
    state = tx.init(params)
    traced.clear()  # init traces it once (abstractly) for the names
    flags = [True, False, False, True, False]
    grads = [tree(60 + i, scale=0.3) for i in range(len(flags))]
    for i, (g, full) in enumerate(zip(grads, flags)):
        _, state = step(g, state, params, full=full)
        rec, last = vitals.recorded(state), vitals.recorded_steps(state)
        m = rec.latest()
        assert ("grad/W_up_rms/layer_1" in rec) == full and "grad/norm/layer_1" in rec
        ll = max(j for j in range(i + 1) if flags[j])
        assert (int(last["light"]), int(last["heavy"])) == (i, ll), i
        np.testing.assert_allclose(float(m["grad/global_norm"]), np_norm(g), rtol=1e-6)
        np.testing.assert_allclose(float(m["grad/norm/layer_1"]), np_norm(g["layers_1"]), rtol=1e-6)
        up = np.asarray(grads[ll]["layers_1"]["mlp"]["up_proj"]["kernel"], np.float64)
        np.testing.assert_allclose(float(m["grad/W_up_rms/layer_1"]), np.sqrt(np.mean(up ** 2)), rtol=1e-6)
        np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), min(np_norm(g), 1.0), rtol=1e-6)
    assert len(traced) == 1  # the True variant only; the False one never traces the heavy pass
    # A traced flag is the conditional's predicate.
    dyn = jax.jit(lambda g, s, p, full: tx.update(g, s, p, vitals_heavy=full))
    _, state = dyn(grads[0], state, params, jnp.asarray(False))
    assert int(vitals.recorded_steps(state)["heavy"]) == 3
    _, state = dyn(grads[1], state, params, jnp.asarray(True))
    assert int(vitals.recorded_steps(state)["heavy"]) == 6
    np.testing.assert_allclose(float(vitals.recorded(state)["grad/norm/layer_0"]),
                               np_norm(grads[1]["layers_0"]), rtol=1e-6)
    _, state = dyn(grads[0], state, params, jnp.asarray(False))
    rec = vitals.recorded(state)
    assert "grad/Wq_abs.max" not in rec and "grad/global_norm" in rec and "grad/norm/layer_0" in rec


def test_wrapped_optax_clip_post_norm_is_known_without_a_pass():
    """optax.clip_by_global_norm is recognised: its post-clip figures equal the measured ones."""
    assert chain_module.clip_max_norm(optax.clip_by_global_norm(2.5)) == 2.5
    for other in (optax.clip(1.0), optax.adamw(1e-3), optax.scale(0.5), None):
        assert chain_module.clip_max_norm(other) is None
    clip = optax.clip_by_global_norm(1.0)
    disguised = optax.GradientTransformation(clip.init, lambda u, s, p=None: clip.update(u, s, p))
    assert chain_module.clip_max_norm(disguised) is None  # measured: one more pass over its outputs
    params = tree(0)
    known, measured = vitals.record(clip), vitals.record(disguised, post="clip")
    nan_grads = tree(9)
    nan_grads["lm_head"]["kernel"] = nan_grads["lm_head"]["kernel"].at[1, 1].set(jnp.nan)
    for grads in (tree(8, scale=5.0), tree(8, scale=1e-3), nan_grads):
        out, s_known = jax.jit(known.update)(grads, known.init(params), params)
        _, s_measured = jax.jit(measured.update)(grads, measured.init(params), params)
        a, b = vitals.recorded(s_known), vitals.recorded(s_measured)
        post = float(optax.tree.norm(out))
        for k in ("grad/global_norm_post_clip", "grad/clip_ratio", "grad/clipped"):
            np.testing.assert_allclose(float(a[k]), float(b[k]), rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(float(a["grad/global_norm_post_clip"]), post, rtol=1e-6)


def test_light_step_shares_the_clip_sum_of_squares():
    """With vitals_heavy=False the recorder reads the gradients only in its cold path.

    Reductions in the compiled update, branches included: the clip's sum of
    squares (one per leaf) is the recorder's too; the recorder adds ||params||
    (one per leaf) and the non-finite counts of its two cold paths (a
    ``lax.cond`` each, taken only when a sum is non-finite: one per leaf each).
    """
    params, grads = tree(0), tree(1, scale=5.0)
    n = len(jax.tree.leaves(params))
    bare = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    rec = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.sgd(0.1))

    def reductions(tx, **extra):
        f = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra))
        return f.lower(grads, tx.init(params), params).compile().as_text().count(" reduce(")

    n_bare = reductions(bare)
    assert n_bare >= n  # the clip's own sum of squares, one per leaf
    assert reductions(rec, vitals_heavy=False) <= n_bare + 3 * n


# ---------------------------------------------------------------------------------- group figures, LR


def _np_layer(tree, i, scan):
    return jax.tree.map(lambda a: np.asarray(a)[i], tree["layers"]) if scan else tree[f"layers_{i}"]


def _np_group_and_layer_figures(grads, params, updates, n_layers, scan):
    """update/param_ratio per layer and group, grad/param group figures, from NumPy."""
    out = {}
    for i in range(n_layers):
        out[f"update/param_ratio/layer_{i}"] = (np_norm(_np_layer(updates, i, scan))
                                                / np_norm(_np_layer(params, i, scan)))
    for g, key in (("embedding", "embed"), ("lm_head", "lm_head")):
        out[f"grad/norm/{g}"] = np_norm(grads[key])
        out[f"grad/share/{g}"] = np_norm(grads[key]) ** 2 / np_norm(grads) ** 2
        out[f"param/norm/{g}"] = np_norm(params[key])
        out[f"update/param_ratio/{g}"] = np_norm(updates[key]) / np_norm(params[key])
    out["update/global_norm"] = np_norm(updates)
    out["update/param_ratio"] = np_norm(updates) / np_norm(params)
    return out


@pytest.mark.parametrize("scan", [pytest.param(True, marks=pytest.mark.slow), False])
def test_readme_placement_gives_group_update_figures_and_the_learning_rate(scan):
    """with_lr_scale(record(chain(clip, adamw(schedule)), schedule=schedule)): every figure
    against NumPy on the updates the step really applies (lr_scale included)."""
    cfg = ModelConfig(scan_layers=scan)
    params = init_params(cfg, jax.random.key(0))
    schedule = optax.linear_schedule(1e-3, 3e-3, 4)
    tx = vitals.with_lr_scale(vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)),
                                            schedule=schedule))
    step = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=True))
    state = vitals.set_lr_scale(tx.init(params), 0.5)
    for k in range(2):
        grads = jax.tree.map(lambda p: p * (0.3 + k) + 0.01, params)
        updates, state = step(grads, state, params)
        m = jax.device_get(vitals.recorded(state))
        want = _np_group_and_layer_figures(grads, params, updates, cfg.n_layers, scan)
        for name, v in want.items():
            np.testing.assert_allclose(float(m[name]), v, rtol=2e-5, err_msg=name)
        pre = np_norm(grads)
        np.testing.assert_allclose(float(m["grad/global_norm"]), pre, rtol=1e-6)
        np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), min(pre, 1.0), rtol=1e-6)
        np.testing.assert_allclose(float(m["opt/learning_rate"]), 0.5 * float(schedule(k)), rtol=1e-6)
        params = optax.apply_updates(params, updates)
    # The light step (vitals_heavy=False): no per-role pass, but the every-update figures,
    # every layer's and group's from the per-leaf (per-slice, scan) sums it takes anyway.
    light = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=False))
    updates, state = light(grads, state, params)
    m = jax.device_get(vitals.recorded(state))
    np.testing.assert_allclose(float(m["update/global_norm"]), np_norm(updates), rtol=1e-5)
    np.testing.assert_allclose(float(m["opt/learning_rate"]), 0.5 * float(schedule(2)), rtol=1e-6)
    want = _np_group_and_layer_figures(grads, params, updates, cfg.n_layers, scan)
    for i in range(cfg.n_layers):
        gi, pi = _np_layer(grads, i, scan), _np_layer(params, i, scan)
        want[f"grad/norm/layer_{i}"] = np_norm(gi)
        want[f"grad/share/layer_{i}"] = np_norm(gi) ** 2 / np_norm(grads) ** 2
        want[f"param/norm/layer_{i}"] = np_norm(pi)
    for name, v in want.items():
        np.testing.assert_allclose(float(m[name]), v, rtol=2e-5, err_msg=name)
    assert "grad/W_up_rms" not in m


def test_tied_head_has_no_lm_head_figures():
    params = tree(0)
    del params["lm_head"]
    tx = vitals.record(optax.adamw(1e-3), every={"heavy": 1})
    grads = {k: v for k, v in tree(1).items() if k != "lm_head"}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    m = vitals.recorded(state)
    assert "grad/norm/embedding" in m and not [k for k in m if k.endswith("/lm_head")]
    np.testing.assert_allclose(float(m["update/param_ratio/embedding"]),
                               np_norm(updates["embed_tokens"]) / np_norm(params["embed_tokens"]), rtol=1e-5)
    np.testing.assert_allclose(float(m["grad/share/embedding"]),
                               np_norm(grads["embed_tokens"]) ** 2 / np_norm(grads) ** 2, rtol=1e-5)


@pytest.mark.slow
def test_learning_rate_from_inject_hyperparams_and_the_scale_argument():
    params, grads = tree(0), tree(1)
    schedule = optax.cosine_decay_schedule(2e-3, 10)
    tx = vitals.record(optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, scale: tx.update(g, s, p, vitals_lr_scale=scale))
    for k, scale in enumerate([1.0, 0.25, 0.25]):
        _, state = step(grads, state, params, jnp.float32(scale))
        np.testing.assert_allclose(float(vitals.recorded(state)["opt/learning_rate"]),
                                   scale * float(schedule(k)), rtol=1e-6)
    # absent: a factor 1; a constant schedule=
    tx = vitals.record(optax.sgd(0.1), post="update", schedule=0.1)
    _, state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(float(vitals.recorded(state)["opt/learning_rate"]), 0.1, rtol=1e-6)
    # nothing to read it from: no figure
    tx = vitals.record(optax.adamw(1e-3))
    assert "opt/learning_rate" not in tx.init(params).metrics.names


@pytest.mark.slow
def test_group_and_update_figures_on_a_mesh():
    """jit over NamedSharding arrays (8 devices): the figures of the gathered arrays."""
    cfg = ModelConfig(scan_layers=True)
    params = init_params(cfg, jax.random.key(1))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def spec(path, x):
        s = jax.tree_util.keystr(path, simple=True, separator="/")
        if s.endswith("embed/embedding"):
            return P("data", None)
        if s.endswith("lm_head/kernel"):
            return P(None, "data")
        return P()

    specs = jax.tree_util.tree_map_with_path(spec, params)
    put = lambda t: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), t, specs)  # noqa: E731
    grads = jax.tree.map(lambda p: p * 2.0 + 0.05, params)
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), every={"heavy": 1})
    updates, state = jax.jit(tx.update)(put(grads), tx.init(put(params)), put(params))
    m = jax.device_get(vitals.recorded(state))
    updates = jax.device_get(updates)
    for name, v in _np_group_and_layer_figures(grads, params, updates, cfg.n_layers, True).items():
        np.testing.assert_allclose(float(m[name]), v, rtol=2e-5, err_msg=name)


# ---------------------------------------------------------------------------------- freshness


def test_only_fresh_figures_reach_the_host_and_a_real_writer(tmp_path):
    """Per-role figures appear exactly at the cadence updates, per-layer and per-group norms at
    every update: in dict(device_get(recorded)) and in what vitals.write sends through a real
    clu writer (read back from the event files)."""
    metric_writers = pytest.importorskip("clu.metric_writers")
    from test_writers import read_events

    params = tree(0)
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), every={"heavy": 4})
    state = tx.init(params)
    step = jax.jit(tx.update)  # the lax.cond cadence
    fam = dict(zip(state.metrics.names, state.metrics.families))
    layer_names = {k for k, f in fam.items() if f == "heavy"}
    assert {"grad/Wq_abs.max", "grad/W_up_rms/layer_1"} <= layer_names
    assert {fam[k] for k in ("grad/norm/layer_0", "update/param_ratio/layer_1", "grad/share/embedding")} == {"light"}
    writer = metric_writers.create_default_writer(str(tmp_path), asynchronous=False)
    for i in range(9):
        grads = tree(70 + i)
        updates, state = step(grads, state, params)
        rec = vitals.recorded(state)
        host = dict(jax.device_get(rec))
        due = i % 4 == 0
        assert (set(host) & layer_names) == (layer_names if due else set()), i
        assert "grad/global_norm" in host and "update/param_ratio" in host
        np.testing.assert_allclose(float(host["grad/global_norm"]), np_norm(grads), rtol=1e-6)
        np.testing.assert_allclose(float(host["grad/norm/layer_0"]), np_norm(grads["layers_0"]), rtol=1e-6)
        # On the CPU the light step measures the change it applies, float32 p + u less p
        # (tests/test_light_forms.py: both forms against NumPy).
        applied = jax.tree.map(applied_change, params["layers_1"], updates["layers_1"])
        np.testing.assert_allclose(float(host["update/param_ratio/layer_1"]),
                                   np_norm(applied) / np_norm(params["layers_1"]), rtol=1e-5)
        # the device-side PackedMetrics (write fetches it) and the host copy say the same
        vitals.write(writer, i, rec if i % 2 else jax.device_get(rec))
    writer.flush()
    ev = read_events(tmp_path)
    assert sorted(ev["grad/Wq_abs.max"]) == [0, 4, 8]
    assert sorted(ev["grad/W_up_rms/layer_1"]) == [0, 4, 8]
    assert sorted(ev["grad/norm/layer_0"]) == list(range(9))
    assert sorted(ev["update/param_ratio/embedding"]) == list(range(9))
    assert sorted(ev["grad/global_norm"]) == list(range(9))
    assert sorted(ev["grad/norm/by_layer"]) == list(range(9))


def test_packed_metrics_freshness_survives_jit_device_get_pickle_and_merge():
    import pickle

    from jvitals.metrics.packed import PackedMetrics

    names = ("a", "b/layer_0", "c")
    fams = ("light", "heavy", "light")
    vec = np.array([1.0, 2.0, 3.0, 1.0, 0.0], np.float32)  # figures, then flags: light, heavy
    m = PackedMetrics(names, vec, fams)
    assert m.flags == ("light", "heavy") and m.fresh == {"light": True, "heavy": False}
    assert dict(m) == {"a": 1.0, "c": 3.0} and len(m) == 2 and "b/layer_0" not in m and m.get("b/layer_0") is None
    assert m.latest()["b/layer_0"] == 2.0
    with pytest.raises(KeyError, match="not computed at the latest update"):
        m["b/layer_0"]
    on_device = jax.jit(lambda x: x)(PackedMetrics(names, jnp.asarray(vec), fams))
    assert isinstance(on_device, PackedMetrics) and on_device.families == fams
    assert sorted(on_device) == ["a", "c"]
    back = jax.device_get(on_device)
    assert isinstance(back.vector, np.ndarray) and dict(back) == {"a": 1.0, "c": 3.0}
    assert dict(pickle.loads(pickle.dumps(m))) == dict(m)
    inside = jax.jit(lambda x: jnp.stack([x[k] for k in x]))(on_device)  # traced: every name
    assert inside.shape == (3,)
    other = PackedMetrics(("d",), np.array([4.0, 0.0], np.float32), ("light",))  # not fresh
    merged = PackedMetrics.merge([m, other])
    assert dict(merged) == {"a": 1.0, "c": 3.0} and merged.latest()["d"] == 4.0
    assert {**merged, "loss": 1.0} == {"a": 1.0, "c": 3.0, "loss": 1.0}
    with pytest.raises(ValueError, match="one family label per name"):
        PackedMetrics(names, vec, fams[:2])


# ---------------------------------------------------------------------------------- clips with a threshold state


class _StandInClipState(NamedTuple):
    count: jax.Array
    clip_threshold: jax.Array


def _stand_in_clip(thresholds):
    """Clips the global norm to thresholds[count % len] (inf: no clip); its state names the threshold."""
    table = jnp.asarray(thresholds, jnp.float32)

    def init(params):
        return _StandInClipState(jnp.zeros([], jnp.int32), jnp.full([], jnp.inf, jnp.float32))

    def update(updates, state, params=None):
        thr = table[state.count % table.shape[0]]
        norm = optax.tree.norm(updates)
        scale = jnp.where(norm > thr, thr / norm, 1.0)
        return jax.tree.map(lambda g: g * scale, updates), _StandInClipState(state.count + 1, thr)

    return optax.GradientTransformation(init, update)



def _check_threshold_clip(tx, grads_seq, params, *, clip_state_of):
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in grads_seq:
        out, state = step(g, state, params)
        m = jax.device_get(vitals.recorded(state))
        thr = float(clip_state_of(state).clip_threshold)
        pre = np_norm(g)
        want_post = min(pre, thr) if np.isfinite(pre) else np.nan
        np.testing.assert_allclose(float(m["grad/clip_threshold"]), thr, rtol=1e-6)
        np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), want_post, rtol=1e-5)
        if np.isfinite(pre):
            np.testing.assert_allclose(float(m["grad/clip_ratio"]), want_post / pre, rtol=1e-5)
            assert float(m["grad/clipped"]) == float(pre > thr * (1 + 1e-5))
    return state


@pytest.mark.slow
def test_a_clip_with_a_threshold_state_is_recognised_alone_and_first_in_a_chain():
    params = tree(0)
    grads_seq = [tree(80 + i, scale=s) for i, s in enumerate([5.0, 0.1, 5.0, 0.1])]
    clip = _stand_in_clip([2.0, 2.0, np.inf, 0.5])
    # alone: its outputs are the clipped gradients; check them against optax.tree.norm too
    rec = vitals.record(clip)
    state = rec.init(params)
    assert "grad/clip_threshold" in state.metrics.names and "update/global_norm" not in state.metrics.names
    for g in grads_seq:
        out, state = jax.jit(rec.update)(g, state, params)
        np.testing.assert_allclose(float(vitals.recorded(state)["grad/global_norm_post_clip"]),
                                   float(optax.tree.norm(out)), rtol=1e-5)
    _check_threshold_clip(rec, grads_seq, params, clip_state_of=lambda s: s.inner_state)
    # first in the whole optimizer: clip figures and update figures
    tx = vitals.record(optax.chain(clip, optax.adamw(1e-3)))
    st = _check_threshold_clip(tx, grads_seq, params, clip_state_of=lambda s: s.inner_state[0])
    assert "update/param_ratio" in vitals.recorded(st)
    # a NaN gradient: the post-clip norm is NaN, never the threshold
    bad = tree(90)
    bad["lm_head"]["kernel"] = bad["lm_head"]["kernel"].at[0, 0].set(jnp.nan)
    _, st = jax.jit(tx.update)(bad, st, params)
    assert np.isnan(float(vitals.recorded(st)["grad/global_norm_post_clip"]))


@pytest.mark.slow
def test_the_real_adaptive_clip_is_recognised_as_a_clip():
    clipping = pytest.importorskip("jvitals.optim.clipping")
    params = tree(0)
    scales = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 20.0, 1.0, 1.0]  # a spike after the warm-up
    grads_seq = [tree(100 + i, scale=s) for i, s in enumerate(scales)]
    tx = vitals.with_lr_scale(vitals.record(optax.chain(clipping.adaptive_clip(warmup_steps=4),
                                                        optax.adamw(1e-3)), schedule=1e-3))
    inner = lambda s: record_module._states(s)[0].inner_state[0]  # noqa: E731
    state = _check_threshold_clip(tx, grads_seq, params, clip_state_of=inner)
    m = jax.device_get(vitals.recorded(state))
    assert float(m["grad/clipped"]) == 0.0  # the last step is back to normal
    # the spike was clipped: replay up to it and look
    state = _check_threshold_clip(tx, grads_seq[:8], params, clip_state_of=inner)
    m = jax.device_get(vitals.recorded(state))
    assert float(m["grad/clipped"]) == 1.0 and np.isfinite(float(m["grad/clip_threshold"]))
    np.testing.assert_allclose(float(m["opt/learning_rate"]), 1e-3, rtol=1e-6)


# ----------------------------------------------------------------------------------
# The recorder's named steps, each decision on its own.


def _cfg(post="auto", inner=None, schedule=None, every=None):
    r = record_module
    return r._Config(roles=vitals.Roles(), specs=None, axes=(), cadence=check_cadence(every, r.DEFAULT_EVERY, "record"), schedule=schedule,
                     lead=chain_module.leading_clip(inner), post=post)


def test_plan_decides_the_post_clip_update_and_lr_figures():
    r = record_module
    p = tree()
    clip = optax.clip_by_global_norm(1.0)
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    adam = optax.adam(1e-3)
    cases = [  # (inner, post, schedule) -> (clip, update, lr)
        (None, "auto", None, (None, False, False)),
        (clip, "auto", None, ("max_norm", False, False)),     # a recognised clip alone
        (chain, "auto", 1e-3, ("max_norm", True, True)),      # clip first, then the optimizer
        (adam, "auto", None, (None, True, False)),            # stateful: an optimizer
        (optax.scale(-1e-3), "auto", None, ("measured", False, False)),  # stateless: a clip-like
        (optax.scale(-1e-3), "update", None, (None, True, False)),
        (chain, "clip", None, ("measured", False, False)),    # forced: the chain's outputs measured
    ]
    for inner, post, schedule, want in cases:
        cfg = _cfg(post, inner, schedule)
        wrapped = optax.with_extra_args_support(inner) if inner is not None else None
        state = inner.init(p) if inner is not None else optax.EmptyState()
        assert tuple(r._plan(cfg, wrapped, state)) == want, (inner, post)
    with pytest.raises(ValueError, match="post='x'"):
        r._plan(_cfg("x", clip), optax.with_extra_args_support(clip), clip.init(p))


def test_due_decides_the_families_at_trace_time_or_in_the_graph():
    r = record_module
    cadence = {"light": 1, "heavy": 50}
    due, static = r._due(cadence, jnp.asarray(100), None)
    assert static is None and bool(due["heavy"]) and bool(due["light"])
    due, static = r._due(cadence, jnp.asarray(7), None)
    assert static is None and not bool(due["heavy"])
    due, static = r._due(cadence, jnp.asarray(7), True)       # a Python bool: decided at trace time
    assert static is True and bool(due["heavy"])
    due, static = r._due(cadence, jnp.asarray(100), np.bool_(False))
    assert static is False and not bool(due["heavy"])
    due, static = r._due(cadence, jnp.asarray(7), jnp.asarray(True))  # traced: the predicate
    assert static is None and bool(due["heavy"])


def test_needs_out_norm_only_where_no_pass_gives_it():
    r = record_module
    p = tree()

    def step(plan, params=p):
        return r._Step(grads=p, out=p, params=params, count=jnp.asarray(0), inner_state=None, plan=plan,
                       outer=None, names=())

    upd = r._Plan(None, True, False)
    assert r._needs_out_norm(step(upd), heavy_static=False)          # the light step measures ||u||
    assert not r._needs_out_norm(step(upd), heavy_static=True)       # the heavy pass gives it
    assert r._needs_out_norm(step(upd, params=None), heavy_static=True)  # no params: no per-layer update
    assert r._needs_out_norm(step(r._Plan("measured", False, False)), heavy_static=True)
    assert not r._needs_out_norm(step(r._Plan("max_norm", False, False)), heavy_static=False)


@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_light_step_norms_and_nonfinite_count_match_numpy(bad):
    """The light step (vitals_heavy=False, around the whole optimizer): the gradient
    norm is the clip's expression, the count taken only when it is not finite (a
    lax.cond on the CPU); figures against NumPy on the same arrays."""
    params, grads = tree(0), tree(8)
    if bad is not None:
        k = grads["layers_1"]["mlp"]["up_proj"]["kernel"]
        grads["layers_1"]["mlp"]["up_proj"]["kernel"] = k.at[0, :5].set(jnp.nan if bad == "nan" else jnp.inf)
        q = grads["layers_0"]["self_attn"]["q_proj"]["kernel"]
        grads["layers_0"]["self_attn"]["q_proj"]["kernel"] = q.at[1, 1].set(-jnp.inf)
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    step = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=False))
    updates, state = step(grads, tx.init(params), params)
    m = vitals.recorded(state)
    g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    p = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
    count = sum(int((~np.isfinite(x)).sum()) for x in g)
    assert int(m["grad/nonfinite_count"]) == count == (0 if bad is None else 6)
    p_norm = np.sqrt(sum((x * x).sum() for x in p))
    np.testing.assert_allclose(float(m["param/global_norm"]), p_norm, rtol=1e-5)
    if bad is None:
        g_norm = np.sqrt(sum((x * x).sum() for x in g))
        np.testing.assert_allclose(float(m["grad/global_norm"]), g_norm, rtol=1e-5)
        u_norm = np.sqrt(sum((np.asarray(x, np.float64) ** 2).sum() for x in jax.tree.leaves(updates)))
        np.testing.assert_allclose(float(m["update/global_norm"]), u_norm, rtol=1e-5)
        np.testing.assert_allclose(float(m["update/param_ratio"]), u_norm / p_norm, rtol=1e-5)
        np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), min(g_norm, 1.0), rtol=1e-5)
    else:
        assert np.isnan(float(m["grad/global_norm"])) and np.isnan(float(m["update/global_norm"]))
