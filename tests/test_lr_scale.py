"""Tests of jvitals.lr_scale: a learning-rate scale that works with any optax schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from jvitals.optim.lr_scale import LR_SCALE, LR_SCALE_ARG, get_lr_scale, has_lr_scale, set_lr_scale, with_lr_scale


def _params():
    return {"w": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 10, "b": jnp.ones(4)}


def _grads(i):
    return jax.tree.map(lambda x: jnp.sin(x + i), _params())


def _run(tx, steps=6, scale=None):
    params = _params()
    state = tx.init(params)
    if scale is not None:
        state = set_lr_scale(state, scale)
    out = []
    for i in range(steps):
        upd, state = tx.update(_grads(i), state, params)
        params = optax.apply_updates(params, upd)
        out.append(upd)
    return out, params, state


@pytest.mark.parametrize("make", [
    lambda lr: optax.sgd(lr),
    lambda lr: optax.adam(lr),
    lambda lr: optax.adamw(lr, weight_decay=0.1),
])
def test_scale_equals_a_scaled_schedule_at_every_step(make):
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-3)
    got, p_got, _ = _run(with_lr_scale(make(sched)), scale=0.9)
    want, p_want, _ = _run(make(lambda c: 0.9 * sched(c)))
    for g, w in zip(got, want):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), g, w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), p_got, p_want)


def test_default_scale_is_identity_and_float32_with_bf16_params():
    got, _, state = _run(with_lr_scale(optax.adam(1e-2)))
    want, _, _ = _run(optax.adam(1e-2))
    for g, w in zip(got, want):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), g, w)
    assert get_lr_scale(state) == 1.0
    tx = with_lr_scale(optax.adam(1e-2))
    bf = tx.init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params()))
    assert bf.hyperparams[LR_SCALE].dtype == jnp.float32
    bf = set_lr_scale(bf, 0.9 ** 3)
    assert bf.hyperparams[LR_SCALE].dtype == jnp.float32
    assert get_lr_scale(bf) == pytest.approx(0.729, rel=1e-7)


def test_found_anywhere_in_nested_states():
    inner = with_lr_scale(optax.adam(1e-3))
    tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
    opt_state = tx.init(_params())
    ts = train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx)
    as_dict = {"params": _params(), "opt_state": opt_state, "step": 0}
    for tree in (opt_state, ts, as_dict):
        assert has_lr_scale(tree)
        new = set_lr_scale(tree, 0.5)
        assert type(new) is type(tree)
        assert get_lr_scale(new) == 0.5
        assert get_lr_scale(tree) == 1.0          # the input is not modified
    # Inside another inject_hyperparams state (which has no lr_scale of its own).
    outer = optax.inject_hyperparams(lambda learning_rate: with_lr_scale(optax.sgd(learning_rate)))(
        learning_rate=0.1)
    st = outer.init(_params())
    assert get_lr_scale(set_lr_scale(st, 0.25)) == 0.25
    assert get_lr_scale(set_lr_scale(st, 0.25).inner_state) == 0.25


def test_errors_say_what_to_do():
    st = optax.adam(1e-3).init(_params())
    assert not has_lr_scale(st)
    with pytest.raises(ValueError, match="with_lr_scale"):
        get_lr_scale(st)
    with pytest.raises(ValueError, match="with_lr_scale"):
        set_lr_scale(st, 0.9)
    a = with_lr_scale(optax.sgd(0.1)).init(_params())
    b = set_lr_scale(with_lr_scale(optax.sgd(0.1)).init(_params()), 0.5)
    with pytest.raises(ValueError, match="differ"):
        get_lr_scale((a, b))


def test_setting_the_scale_does_not_retrace():
    tx = with_lr_scale(optax.adam(1e-2))
    traces = []

    @jax.jit
    def step(params, opt_state, grads):
        traces.append(1)
        upd, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    params = jax.device_put(_params())
    opt_state = jax.device_put(tx.init(params))
    grads = jax.device_put(_grads(0))
    params, opt_state = step(params, opt_state, grads)
    params, opt_state = step(params, opt_state, grads)
    for v in (0.9, 0.81, 1.0):
        opt_state = set_lr_scale(opt_state, v)
        params, opt_state = step(params, opt_state, grads)
    assert len(traces) == 1
    assert get_lr_scale(opt_state) == 1.0


@pytest.mark.parametrize("built_by", ["init", "step"])
def test_a_state_set_lr_scale_returns_never_recompiles_the_step(built_by, count_compiles):
    """On one device ``tx.init`` and a jitted step leave the scales uncommitted; the
    scale ``set_lr_scale`` puts in keeps that (a committed one is a new cache key)."""
    params = jax.tree.map(jnp.asarray, hf_trees.llama())
    tx = with_lr_scale(optax.adam(1e-2), groups="roles")

    @jax.jit
    def step(params, opt_state):
        upd, opt_state = tx.update(_llama_grads(params, 0), opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    state = tx.init(params)
    p1, stepped = step(params, state)
    jax.block_until_ready(step(p1, stepped))
    base = state if built_by == "init" else stepped
    with count_compiles() as c:
        for i, (value, group) in enumerate([(0.9, None), (0.5, "embedding"), (0.81, None), (0.25, "layer_1")]):
            base = set_lr_scale(base, value, group=group)
            jax.block_until_ready(step(p1, base))
    assert c.count == 0, f"{c.count} compiles for 4 scale changes (state built by {built_by})"
    leaves = jax.tree.leaves(base)
    assert not any(x.committed for x in leaves), [x.committed for x in leaves]
    assert get_lr_scale(base) == pytest.approx(0.81) and get_lr_scale(base, "embedding") == 0.5


def test_keeps_sharding_on_a_mesh(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tx = with_lr_scale(optax.adam(1e-2))
    opt_state = jax.device_put(tx.init(_params()), rep)
    new = set_lr_scale(opt_state, 0.9)
    assert new.hyperparams[LR_SCALE].sharding == rep and new.hyperparams[LR_SCALE].committed
    assert get_lr_scale(new) == pytest.approx(0.9)


def test_set_inside_jit():
    tx = with_lr_scale(optax.sgd(1.0))
    st = tx.init(_params())
    out = jax.jit(lambda s: set_lr_scale(s, 0.5))(st)
    assert get_lr_scale(out) == 0.5


def _probe(seen):
    """A transform that records the extra arguments its update receives."""
    def update(updates, state, params=None, **extra):
        seen.append(dict(extra))
        return updates, state
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_inner_update_receives_the_global_scale_in_force():
    seen = []
    tx = with_lr_scale(optax.chain(_probe(seen), optax.sgd(0.1)), 0.5)
    st = tx.init(_params())
    tx.update(_grads(0), st, loss=1.25)
    assert seen[-1]["loss"] == 1.25
    assert seen[-1][LR_SCALE_ARG].dtype == np.float32 and seen[-1][LR_SCALE_ARG] == np.float32(0.5)
    st = set_lr_scale(st, 0.8)
    jax.jit(lambda g, s: tx.update(g, s))(_grads(0), st)
    assert seen[-1][LR_SCALE_ARG].dtype == jnp.float32 and seen[-1][LR_SCALE_ARG].shape == ()
    # Nested wrappers: the inner one sees the product of both scales.
    seen.clear()
    tx2 = with_lr_scale(with_lr_scale(optax.chain(_probe(seen), optax.sgd(0.1)), 0.5), 0.25)
    tx2.update(_grads(0), tx2.init(_params()))
    assert seen[-1][LR_SCALE_ARG] == np.float32(0.125)
    # Plain GradientTransformations (no extra args) inside still work.
    plain = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
    tx3 = with_lr_scale(optax.chain(plain, optax.sgd(1.0)), 0.5)
    upd, _ = tx3.update(_grads(0), tx3.init(_params()))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, -0.5 * np.asarray(b), rtol=1e-6), upd, _grads(0))
    tx4 = with_lr_scale(plain, 0.5)
    upd, _ = tx4.update(_grads(0), tx4.init(_params()))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 0.5 * np.asarray(b), rtol=1e-6), upd, _grads(0))


# ----------------------------------------------------------------------------------
# Per-group scales.

import re  # noqa: E402
import sys  # noqa: E402
import os  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import hf_trees  # noqa: E402

from jvitals.optim.lr_scale import LRGroupScaleState, get_lr_scales  # noqa: E402
from jvitals.metrics.paths import path_str  # noqa: E402


def _labels(params):
    """Group of each leaf, by hand from the HF-Llama paths (independent of jvitals.roles)."""
    def label(p, _):
        s = path_str(p)
        if "embed_tokens" in s:
            return "embedding"
        if s.startswith("lm_head/"):
            return "lm_head"
        m = re.search(r"/layers/(\d+)/", s)
        return f"layer_{m.group(1)}" if m else "other"
    return jax.tree_util.tree_map_with_path(label, params)


def _llama_grads(params, i):
    return jax.tree.map(lambda x: jnp.sin(x * (i + 1)) + 0.05 * i, params)


def _steps(tx, params, n=2, prepare=lambda s: s):
    @jax.jit
    def run(params, state):
        outs, p0 = [], params
        for i in range(n):   # gradients of the initial params: the same whatever the scales
            upd, state = tx.update(_llama_grads(p0, i), state, params)
            params = optax.apply_updates(params, upd)
            outs.append(upd)
        return outs, state
    return run(params, prepare(tx.init(params)))


def test_a_group_scale_changes_only_that_groups_updates_like_multi_transform():
    params = jax.tree.map(jnp.asarray, hf_trees.llama())
    scales = {"embedding": 0.5, "layer_1": 0.25, "lm_head": 2.0}
    glob = 0.8

    def prepare(s):
        s = set_lr_scale(s, glob)
        for g, v in scales.items():
            s = set_lr_scale(s, v, group=g)
        return s

    got, state = _steps(with_lr_scale(optax.adam(1e-2), groups="roles"), params, prepare=prepare)
    names = ("embedding", "lm_head", "layer_0", "layer_1", "layer_2", "other")
    ref = optax.multi_transform({g: optax.chain(optax.adam(1e-2), optax.scale(glob * scales.get(g, 1.0)))
                                 for g in names}, _labels)
    want, _ = _steps(ref, params)
    for g_step, w_step in zip(got, want):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), g_step, w_step)
    assert get_lr_scale(state) == pytest.approx(glob)
    assert get_lr_scales(state) == pytest.approx({**{g: 1.0 for g in names}, **scales})


def test_scan_stacked_leaves_scale_per_slice():
    params = jax.tree.map(jnp.asarray, hf_trees.maxtext())   # layers stacked along axis 1
    got, state = _steps(with_lr_scale(optax.adam(1e-2), groups="roles"), params,
                        prepare=lambda s: set_lr_scale(set_lr_scale(s, 0.5, group="layer_1"), 0.1, "embedding"))
    assert sorted(get_lr_scales(state)) == ["embedding", "layer_0", "layer_1", "layer_2", "lm_head", "other"]
    want, _ = _steps(optax.adam(1e-2), params)  # adam is per element: scale its updates by hand
    per_slice = np.array([1.0, 0.5, 1.0])
    for g_step, w_step in zip(got, want):
        for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(g_step)[0], jax.tree.leaves(w_step)):
            s = path_str(p)
            if "/decoder/layers/" in s:
                f = per_slice.reshape((1, 3) + (1,) * (b.ndim - 2))
            else:
                f = 0.1 if "token_embedder" in s else 1.0
            np.testing.assert_allclose(a, np.asarray(b) * f, rtol=1e-6, atol=1e-9, err_msg=s)


def test_groups_from_a_function_and_initial_scales_from_a_mapping():
    params = jax.tree.map(jnp.asarray, hf_trees.gpt2())

    def by_rank(p):
        return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", p)

    got, state = _steps(with_lr_scale(optax.sgd(0.1), groups=by_rank), params,
                        prepare=lambda s: set_lr_scale(s, 0.3, group="vector"))
    ref = optax.multi_transform({"matrix": optax.sgd(0.1), "vector": optax.chain(optax.sgd(0.1), optax.scale(0.3))},
                                by_rank)
    want, _ = _steps(ref, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got[-1], want[-1])
    assert get_lr_scales(state) == pytest.approx({"matrix": 1.0, "vector": 0.3})
    # A mapping: the roles groups, these starting at the given scales.
    tx = with_lr_scale(optax.sgd(0.1), groups={"embedding": 0.5, "layer_0": 0.25})
    st = tx.init(params)
    assert get_lr_scale(st, "embedding") == 0.5 and get_lr_scale(st, "layer_0") == 0.25
    assert get_lr_scale(st, "layer_2") == 1.0 and get_lr_scale(st) == 1.0


def test_global_set_leaves_group_scales_and_multiplies_them():
    params = jax.tree.map(jnp.asarray, hf_trees.llama())
    tx = with_lr_scale(optax.sgd(1.0), groups="roles")
    st = set_lr_scale(tx.init(params), 0.5, group="embedding")
    st = set_lr_scale(st, 0.9)                       # what the rollback does
    assert get_lr_scale(st) == pytest.approx(0.9) and get_lr_scale(st, "embedding") == 0.5
    assert has_lr_scale(st) and has_lr_scale(st, "embedding") and not has_lr_scale(st, "embeding")
    g = _llama_grads(params, 0)
    upd, _ = tx.update(g, st, params)
    np.testing.assert_allclose(upd["model"]["embed_tokens"]["embedding"],
                               -0.45 * np.asarray(g["model"]["embed_tokens"]["embedding"]), rtol=1e-6)
    np.testing.assert_allclose(upd["lm_head"]["kernel"], -0.9 * np.asarray(g["lm_head"]["kernel"]), rtol=1e-6)
    assert st.hyperparams[LR_SCALE].dtype == jnp.float32
    assert all(v.dtype == jnp.float32 and v.shape == () for v in jax.tree.leaves(st.inner_state[1].scales))
    assert isinstance(st.inner_state[1], LRGroupScaleState)


def test_group_errors_name_the_value_and_what_is_allowed():
    params = jax.tree.map(jnp.asarray, hf_trees.gpt2())    # tied head: no lm_head group
    st = with_lr_scale(optax.sgd(0.1), groups="roles").init(params)
    with pytest.raises(ValueError, match=r"'lm_head'.*groups are \['embedding', 'layer_0', 'layer_1', 'layer_2', 'other'\]"):
        set_lr_scale(st, 0.5, group="lm_head")
    with pytest.raises(ValueError, match=r"'layer_7'.*layer_2"):
        get_lr_scale(st, "layer_7")
    with pytest.raises(ValueError, match=r"group\(s\) \['lm_head'\] have no parameter.*'layer_0'"):
        with_lr_scale(optax.sgd(0.1), groups={"lm_head": 0.5}).init(params)
    with pytest.raises(ValueError, match=r"groups='layers'.*'roles'"):
        with_lr_scale(optax.sgd(0.1), groups="layers")
    plain = with_lr_scale(optax.sgd(0.1)).init(params)
    with pytest.raises(ValueError, match=r"no per-group scales.*groups='roles'"):
        set_lr_scale(plain, 0.5, group="embedding")
    with pytest.raises(ValueError, match=r"transformer/h/0/attn/c_attn/bias.*is 3"):
        with_lr_scale(optax.sgd(0.1), groups=lambda p: jax.tree.map(lambda x: 3 if x.ndim == 1 else "a", p)
                      ).init(params)


def test_group_scales_under_jit_on_a_mesh_without_recompiling(devices, count_compiles):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    params = hf_trees.llama()
    shard = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, P("data") if x.shape[0] % 8 == 0 else P()),
                         params)
    params = jax.device_put(params, shard)
    tx = with_lr_scale(optax.adam(1e-2), groups="roles")
    rep = jax.sharding.NamedSharding(mesh, P())
    opt_state = jax.device_put(tx.init(params), rep)

    @jax.jit
    def step(params, opt_state):
        upd, opt_state = tx.update(_llama_grads(params, 0), opt_state, params)
        return optax.apply_updates(params, upd), opt_state, upd

    p1, s1, u1 = step(params, opt_state)
    p1, s1, u1 = step(p1, s1)
    with count_compiles() as c:
        s2 = set_lr_scale(set_lr_scale(s1, 0.5, group="embedding"), 0.8)
        s2 = set_lr_scale(s2, 0.25, group="layer_2")
        _, s3, u2 = step(p1, s2)
        _, _, u_ref = step(p1, s1)
        jax.block_until_ready((s3, u2, u_ref))
    assert c.count == 0
    assert s2.inner_state[1].scales["embedding"].sharding == rep
    assert get_lr_scale(s3, "embedding") == 0.5 and get_lr_scale(s3) == pytest.approx(0.8)
    np.testing.assert_allclose(np.asarray(u2["model"]["embed_tokens"]["embedding"]),
                               0.4 * np.asarray(u_ref["model"]["embed_tokens"]["embedding"]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(u2["model"]["layers"]["2"]["self_attn"]["q_proj"]["kernel"]),
                               0.2 * np.asarray(u_ref["model"]["layers"]["2"]["self_attn"]["q_proj"]["kernel"]),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(u2["lm_head"]["kernel"]), 0.8 * np.asarray(u_ref["lm_head"]["kernel"]),
                               rtol=1e-5)


def test_grouped_state_round_trips_through_an_orbax_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    params = jax.tree.map(jnp.asarray, hf_trees.llama())
    tx = with_lr_scale(optax.adam(1e-2), groups="roles")
    st = set_lr_scale(tx.init(params), 0.5, group="layer_0")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "s", st)
        ckpt.wait_until_finished()
        back = ckpt.restore(tmp_path / "s", jax.tree.map(ocp.utils.to_shape_dtype_struct, st))
    assert isinstance(back.inner_state[1], LRGroupScaleState)
    assert get_lr_scale(back, "layer_0") == 0.5 and get_lr_scale(back, "layer_1") == 1.0
