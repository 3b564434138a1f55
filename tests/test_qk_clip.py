"""Tests of jvitals.qk_clip against NumPy, and of the logits a forward pass gives after it."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvitals.optim.qk_clip import qk_clip
from jvitals.reference_model import Decoder, ModelConfig, init_params, make_batch
from jvitals.metrics.paths import path_str

import hf_trees


def _params(cfg, seed):
    """Reference-model params of the right shapes, filled by NumPy (no init compile):
    norm scales 1, other leaves N(0, 1 / fan_in)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(seed)

    def fill(p, s):
        if path_str(p).endswith("scale"):
            return np.ones(s.shape, np.float32)
        fan_in = s.shape[-2] if len(s.shape) >= 2 else 1
        return (rng.standard_normal(s.shape) / math.sqrt(fan_in)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(fill, shapes)


def _f(m, tau):
    return np.array([math.sqrt(tau / v) if v > tau else 1.0 for v in m])


def _assert_only(got, want_changed, params):
    """Leaves named in ``want_changed`` (path -> expected array) match; all others are unchanged."""
    for (p, g), x in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(params)):
        s = path_str(p)
        assert g.dtype == x.dtype and g.shape == x.shape, s
        if s in want_changed:
            np.testing.assert_allclose(np.asarray(g, np.float64), want_changed.pop(s), rtol=1e-6, err_msg=s)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(x), err_msg=s)
    assert not want_changed, f"not found: {sorted(want_changed)}"


def test_fused_gqa_kernel_q_and_k_columns_only():
    cfg = ModelConfig(n_layers=3)                      # qkv [D, (4 + 2*2) * 8]: Q 32, K 16, V 16 columns
    params = _params(cfg, 0)
    m, tau = np.array([250.0, 80.0, 120.0]), 100.0
    got = jax.jit(qk_clip)(params, jnp.asarray(m), tau)
    want = {}
    for i, f in enumerate(_f(m, tau)):
        k = np.asarray(params[f"layers_{i}"]["attn"]["qkv"]["kernel"], np.float64).copy()
        k[:, :48] *= f                                  # Q (32) and K (16) columns
        if f != 1.0:
            want[f"layers_{i}/attn/qkv/kernel"] = k
    _assert_only(got, want, params)


def test_scan_stacked_fused_kernel_per_slice():
    cfg = ModelConfig(n_layers=3, scan_layers=True, n_kv_heads=4)   # MHA: Q, K, V thirds of 96
    params = _params(cfg, 1)
    m, tau = np.array([10.0, 40.0, 20.0]), 10.0
    got = qk_clip(params, m, tau)
    k = np.asarray(params["layers"]["attn"]["qkv"]["kernel"], np.float64).copy()   # [L, D, 96]
    k[:, :, :64] *= _f(m, tau)[:, None, None]
    _assert_only(got, {"layers/attn/qkv/kernel": k}, params)


def test_unfused_q_k_kernels_and_biases():
    params = hf_trees.llama()                           # q_proj, k_proj with biases, v_proj, o_proj
    m, tau = np.array([3.0, 1.0, 8.0]), 2.0
    got = qk_clip(params, m, tau)
    want = {}
    for i, f in enumerate(_f(m, tau)):
        if f == 1.0:
            continue
        for name in ("q_proj", "k_proj"):
            for leaf in ("kernel", "bias"):
                want[f"model/layers/{i}/self_attn/{name}/{leaf}"] = params["model"]["layers"][str(i)]["self_attn"][name][leaf] * f
    _assert_only(got, want, params)


def test_gpt2_fused_kernel_along_axis_0_with_its_bias():
    params = hf_trees.gpt2()                            # c_attn kernel [3D, D], bias [3D]: Q, K, V thirds
    m, tau = np.array([5.0, 5.0, 1.0]), 4.0
    got = qk_clip(params, m, tau)
    d = hf_trees.D
    want = {}
    for i, f in enumerate(_f(m, tau)):
        if f == 1.0:
            continue
        a = params["transformer"]["h"][str(i)]["attn"]["c_attn"]
        k, b = a["kernel"].astype(np.float64), a["bias"].astype(np.float64)
        k[: 2 * d] *= f
        b[: 2 * d] *= f
        want[f"transformer/h/{i}/attn/c_attn/kernel"] = k
        want[f"transformer/h/{i}/attn/c_attn/bias"] = b
    _assert_only(got, want, params)


@functools.cache
def _apply(cfg):
    return jax.jit(lambda p, t, k: Decoder(cfg).apply({"params": p}, t, mask=k, mutable=["intermediates"]))


def _max_logits(cfg, params, batch, per_head=False):
    """NumPy max |pre-softmax logit| over valid (causal, real-token) entries, per layer (and head)."""
    _, sown = _apply(cfg)(params, batch["tokens"], batch["mask"])
    mask = np.asarray(batch["mask"])
    t = mask.shape[1]
    valid = np.tril(np.ones((t, t), bool))[None, None] & mask[:, None, :, None] & mask[:, None, None, :]
    out = []
    for i in range(cfg.n_layers):
        s = np.abs(np.asarray(sown["intermediates"][f"layers_{i}"]["attn"]["attn_logits"][0], np.float64))
        s = np.where(valid, s, -np.inf)
        out.append(s.max(axis=(0, 2, 3)) if per_head else s.max())
    return np.array(out)


@pytest.mark.parametrize("attention,heads", [("fused_qkv", 1), ("fused_qkv", 4), ("mla", 1)])
def test_the_max_logit_after_one_forward_pass_is_tau(attention, heads):
    cfg = ModelConfig(n_layers=2, n_heads=heads, n_kv_heads=min(heads, 2), head_dim=8, attention=attention)
    params = _params(cfg, 2)
    params = jax.tree.map(lambda x: 3.0 * x, params)   # large logits
    batch = make_batch(0, cfg, batch=2, seq=12, pad_fraction=0.2)
    m = _max_logits(cfg, params, batch)
    tau = 0.5 * float(m[0])
    after = _max_logits(cfg, jax.jit(qk_clip)(params, m, tau), batch)
    # Layer 0's inputs do not depend on the clip, so its max is tau (float tolerance).
    assert after[0] <= tau * (1 + 1e-5) and after[0] == pytest.approx(tau, rel=1e-5)


def test_one_head_fused_kernel_with_head_counts_given():
    """[D, 3*Dh] = [32, 24]: the shape alone points at the wrong axis; the counts (or O) fix it."""
    from jvitals.metrics.roles import QKVSplit, Roles

    cfg = ModelConfig(n_layers=1, n_heads=1, n_kv_heads=1)
    params = _params(cfg, 4)
    k = np.asarray(params["layers_0"]["attn"]["qkv"]["kernel"], np.float64).copy()
    k[:, :16] *= 0.5
    for roles in (None, Roles(qkv_split=QKVSplit(num_heads=1, num_kv_heads=1))):
        _assert_only(qk_clip(params, np.array([4.0]), 1.0, roles=roles), {"layers_0/attn/qkv/kernel": k.copy()},
                     params)


def test_per_head_form_clips_each_head_to_tau_and_leaves_the_others():
    cfg = ModelConfig(n_layers=1, n_heads=4, n_kv_heads=2)
    params = jax.tree.map(lambda x: 3.0 * x, _params(cfg, 3))
    batch = make_batch(1, cfg, batch=2, seq=12)
    m = _max_logits(cfg, params, batch, per_head=True)          # [1, 4]
    tau = float(np.median(m))
    new = jax.jit(qk_clip)(params, m, tau)
    after = _max_logits(cfg, new, batch, per_head=True)
    np.testing.assert_allclose(after, np.minimum(m, tau), rtol=1e-5)
    # K (shared by two Q heads) and V are untouched; each Q head scaled by tau / m_h (or 1).
    k0, k1 = (np.asarray(p["layers_0"]["attn"]["qkv"]["kernel"], np.float64) for p in (params, new))
    np.testing.assert_array_equal(k1[:, 32:], k0[:, 32:])
    g = np.where(m[0] > tau, tau / m[0], 1.0)
    np.testing.assert_allclose(k1[:, :32], k0[:, :32] * np.repeat(g, 8)[None], rtol=1e-6)


def test_traced_maxima_and_tau_under_jit_and_nonfinite_left_alone():
    params = hf_trees.llama()
    m = jnp.array([jnp.nan, jnp.inf, 3.0])
    got = jax.jit(qk_clip)(params, m, jnp.float32(1.5))
    want = {f"model/layers/2/self_attn/{n}/{leaf}": params["model"]["layers"]["2"]["self_attn"][n][leaf] * math.sqrt(0.5)
            for n in ("q_proj", "k_proj") for leaf in ("kernel", "bias")}
    _assert_only(got, want, params)


def test_bad_input_names_the_value():
    params = hf_trees.llama()
    for tau in (-1.0, 0.0, float("nan"), "big"):
        with pytest.raises(ValueError, match=r"tau=.* must be a positive"):
            qk_clip(params, np.ones(3), tau)
    with pytest.raises(ValueError, match=r"attn_logits_max has shape \(2,\); expected \[3\]"):
        qk_clip(params, np.ones(2), 1.0)
    with pytest.raises(ValueError, match=r"shape \(3, 2, 2\)"):
        qk_clip(params, np.ones((3, 2, 2)), 1.0)
    with pytest.raises(ValueError, match="no Q/K projection found"):
        qk_clip({"layers_0": {"mlp": {"up_proj": {"kernel": np.ones((2, 2))}}}}, np.ones(1), 1.0)
    with pytest.raises(ValueError, match=r"per-head maxima for 3 heads.*8 output entries"):
        qk_clip(params, np.ones((3, 3)), 1.0)


def test_sharded_params_on_a_mesh(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    params = hf_trees.llama()
    shard = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, P("data") if x.shape[0] % 8 == 0 else P()),
                         params)
    got = jax.jit(qk_clip, out_shardings=shard)(jax.device_put(params, shard), jnp.array([4.0, 1.0, 1.0]), 1.0)
    q = got["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding == shard["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_allclose(np.asarray(q), 0.5 * params["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"],
                               rtol=1e-6)


def test_interleaved_per_head_fused_kernel_bloom_layout():
    """Bloom/GPT-NeoX ``query_key_value``: columns ``[H, 3, Dh]`` (jvitals.qkv's interleaved split)."""
    from jvitals.metrics.roles import QKVSplit, Roles

    h, dh, d = 2, 4, 8
    rng = np.random.default_rng(5)
    params = {"transformer": {"h": {str(i): {"self_attention": {
        "query_key_value": {"kernel": rng.standard_normal((d, 3 * h * dh)).astype(np.float32),
                            "bias": rng.standard_normal((3 * h * dh,)).astype(np.float32)},
        "dense": {"kernel": rng.standard_normal((h * dh, d)).astype(np.float32)}}} for i in range(2)}}}
    roles = Roles(qkv_split=QKVSplit(num_heads=h))
    m, tau = np.array([9.0, 1.0]), 4.0
    got = qk_clip(params, m, tau, roles=roles)
    a = params["transformer"]["h"]["0"]["self_attention"]["query_key_value"]
    k = a["kernel"].astype(np.float64).reshape(d, h, 3, dh).copy()
    b = a["bias"].astype(np.float64).reshape(h, 3, dh).copy()
    k[:, :, :2] *= 2 / 3
    b[:, :2] *= 2 / 3
    _assert_only(got, {"transformer/h/0/self_attention/query_key_value/kernel": k.reshape(d, -1),
                       "transformer/h/0/self_attention/query_key_value/bias": b.reshape(-1)}, params)


def test_the_factor_decision_per_layer_per_head_and_shared_k():
    """``_QKPlan.factors`` (the step that decides who shrinks by how much), against
    the rule written out in NumPy: per layer sqrt(gamma) on Q and K where the layer
    has K, gamma on Q where it has none; per head with one K head per Q head
    sqrt(gamma) each; with a K head shared by 2 Q heads, K kept and Q by gamma."""
    from jvitals.metrics.roles import Roles, assign_roles
    from jvitals.optim.qk_clip import _QKPlan, layer_gammas

    def plan(q_width, k_width, has_k):
        params = {"layers_0": {"attn": {"q_proj": {"kernel": np.ones((8, q_width), np.float32)},
                                        "k_proj": {"kernel": np.ones((8, k_width), np.float32)},
                                        "o_proj": {"kernel": np.ones((q_width, 8), np.float32)}}},
                  "layers_1": {"attn": {"q_proj": {"kernel": np.ones((8, q_width), np.float32)},
                                        "o_proj": {"kernel": np.ones((q_width, 8), np.float32)}}}}
        if not has_k:
            del params["layers_0"]["attn"]["k_proj"]
        return _QKPlan.build(assign_roles(params, Roles()), Roles())

    m = np.array([[200.0, 50.0, 400.0, 100.0], [50.0, 50.0, 50.0, 50.0]], np.float32)
    g = np.where(m > 100.0, 100.0 / m, 1.0)
    gamma, per_head = layer_gammas(m.max(axis=1), 100.0, 2)
    assert not per_head and gamma.shape == (2, 1)
    q, k, _ = plan(16, 16, True).factors("layers_0/attn", gamma, False)
    np.testing.assert_allclose(np.asarray(q)[:, 0], [np.sqrt(100 / 400), 1.0], rtol=1e-6)  # layer 1: no K
    np.testing.assert_allclose(np.asarray(k)[:, 0], [np.sqrt(100 / 400), 1.0], rtol=1e-6)
    q, _, _ = plan(16, 16, False).factors("layers_0/attn", gamma, False)
    np.testing.assert_allclose(np.asarray(q)[:, 0], [100 / 400, 1.0], rtol=1e-6)          # Q takes all
    gamma, per_head = layer_gammas(m, 100.0, 2)
    q, k, groups = plan(16, 16, True).factors("layers_0/attn", gamma, True)     # 4 Q, 4 K heads
    np.testing.assert_allclose(np.asarray(q), np.sqrt(g), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(k), np.sqrt(g), rtol=1e-6)
    assert groups == 1
    q, k, groups = plan(16, 8, True).factors("layers_0/attn", gamma, True)      # 2 K heads shared by 2 Q each
    np.testing.assert_allclose(np.asarray(q), g, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(k), np.ones((2, 2)))
    assert groups == 2
