"""gradient_metrics / update_metrics / global_norm_metrics against an independent NumPy reference.

Every tree is built by hand with its role and layer written next to each leaf; the
NumPy reference reads those labels, not jvitals' Roles, so a wrong default pattern
shows up as a wrong figure or a missing name.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiers import tiered
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_second_calls_compile_nothing

from jvitals.metrics.gradients import global_norm, global_norm_metrics, gradient_metrics, update_metrics
from jvitals.metrics.roles import QKVSplit, Roles

D, F, V, E = 8, 16, 24, 4


def build(entries, seed=0):
    """entries: (path, shape, base, layer). base: None | name | ('qkv', sizes, axis);
    layer: None | int | ('stack', axis, first). Returns (tree, metas)."""
    rng = np.random.default_rng(seed)
    tree, metas = {}, []
    for path, shape, base, layer in entries:
        arr = (rng.normal(size=shape) * rng.uniform(0.1, 3.0)).astype(np.float32)
        node = tree
        parts = path.split("/")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = arr
        metas.append([path, arr, base, layer])
    return tree, metas


def set_leaf(tree, metas, path, arr):
    node = tree
    parts = path.split("/")
    for k in parts[:-1]:
        node = node[k]
    node[parts[-1]] = arr
    for m in metas:
        if m[0] == path:
            m[1] = arr


def _pieces(arr, base, layer):
    """(name, layer or None, array) pieces of one leaf."""
    parts = [(base, arr)]
    if isinstance(base, tuple):
        _, (nq, nk, _), axis = base
        q, k, v = np.split(arr, [nq, nq + nk], axis=axis)
        parts = [("Wq", q), ("Wk", k), ("Wv", v)]
    out = []
    for name, a in parts:
        if isinstance(layer, tuple):
            _, ax, first = layer
            for j in range(a.shape[ax]):
                out.append((name, first + j, np.take(a, j, axis=ax)))
        else:
            out.append((name, layer, a))
    return out


def _flat(arrs):
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrs]) if arrs else np.zeros(0)


GROUP_OF_BASE = {"word_embeddings": "embedding", "output_layer": "lm_head"}  # the non-layer groups


def _by_layer_and_group(metas):
    by_layer, by_group = {}, {}
    for _, arr, base, layer in metas:
        for _, i, a in _pieces(arr, None, layer):
            if i is not None:
                by_layer.setdefault(i, []).append(a)
        g = GROUP_OF_BASE.get(base) if isinstance(base, str) else None
        if g is not None:
            by_group.setdefault(g, []).append(arr)
    return by_layer, by_group


def reference(metas, prefix="grad", param_metas=None, update_metas=None):
    """Every figure from NumPy on the labelled arrays (the labels, not jvitals' roles)."""
    out = {}
    all_x = _flat([m[1] for m in metas])
    sq = np.sum(all_x ** 2)
    out[f"{prefix}/global_norm"] = np.sqrt(sq)
    out[f"{prefix}/nonfinite_count"] = np.sum(~np.isfinite(all_x))
    by_layer, by_role, by_role_layer = {}, {}, {}
    for _, arr, base, layer in metas:
        for name, i, a in _pieces(arr, base, layer):
            if i is not None:
                by_layer.setdefault(i, []).append(a)
            if name is not None:
                by_role.setdefault(name, []).append(a)
                if i is not None:
                    by_role_layer.setdefault((name, i), []).append(a)
    for i, arrs in by_layer.items():
        x = _flat(arrs)
        out[f"{prefix}/norm/layer_{i}"] = np.sqrt(np.sum(x ** 2))
        out[f"{prefix}/share/layer_{i}"] = np.sum(x ** 2) / sq
        out[f"{prefix}/nonfinite_count/layer_{i}"] = np.sum(~np.isfinite(x))
    for g, arrs in _by_layer_and_group(metas)[1].items():
        x = _flat(arrs)
        out[f"{prefix}/norm/{g}"] = np.sqrt(np.sum(x ** 2))
        out[f"{prefix}/share/{g}"] = np.sum(x ** 2) / sq
    for name, arrs in by_role.items():
        x = _flat(arrs)
        out[f"{prefix}/{name}_abs.max"] = np.max(np.abs(x))
        out[f"{prefix}/{name}_rms"] = np.sqrt(np.mean(x ** 2))
        out[f"{prefix}/{name}.nonfinite"] = np.sum(~np.isfinite(x))
    for (name, i), arrs in by_role_layer.items():
        x = _flat(arrs)
        out[f"{prefix}/{name}_rms/layer_{i}"] = np.sqrt(np.mean(x ** 2))
        out[f"{prefix}/{name}_abs.max/layer_{i}"] = np.max(np.abs(x))
    if param_metas is not None:
        px = _flat([m[1] for m in param_metas])
        out["param/global_norm"] = np.sqrt(np.sum(px ** 2))
        pl = {}
        for _, arr, base, layer in param_metas:
            for _, i, a in _pieces(arr, None, layer):
                if i is not None:
                    pl.setdefault(i, []).append(a)
        for i, arrs in pl.items():
            out[f"param/norm/layer_{i}"] = np.sqrt(np.sum(_flat(arrs) ** 2))
        p_layer, p_group = _by_layer_and_group(param_metas)
        for g, arrs in p_group.items():
            out[f"param/norm/{g}"] = np.sqrt(np.sum(_flat(arrs) ** 2))
    if update_metas is not None:
        ux = _flat([m[1] for m in update_metas])
        out["update/global_norm"] = np.sqrt(np.sum(ux ** 2))
        out["update/param_ratio"] = out["update/global_norm"] / out["param/global_norm"]
        u_layer, u_group = _by_layer_and_group(update_metas)
        for i, arrs in u_layer.items():
            out[f"update/param_ratio/layer_{i}"] = np.sqrt(np.sum(_flat(arrs) ** 2)) / out[f"param/norm/layer_{i}"]
        for g, arrs in u_group.items():
            out[f"update/param_ratio/{g}"] = np.sqrt(np.sum(_flat(arrs) ** 2)) / out[f"param/norm/{g}"]
    return out


def assert_matches(got, want, rtol=2e-5):
    got = jax.device_get(got)
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=rtol, atol=1e-6, err_msg=k)


# ---------------------------------------------------------------------------------- trees


def reference_unscanned(num_layers=11, H=4, KVH=2, Dh=2):
    nq, nk = H * Dh, KVH * Dh
    ents = [("params/embed/embedding", (V, D), "word_embeddings", None)]
    for i in range(num_layers):
        p = f"params/layers_{i}"
        ents += [
            (f"{p}/input_layernorm/scale", (D,), "input_layernorm", i),
            (f"{p}/attn/qkv/kernel", (D, nq + 2 * nk), ("qkv", (nq, nk, nk), 1), i),
            (f"{p}/attn/o_proj/kernel", (nq, D), "Wo", i),
            (f"{p}/pre_mlp_layernorm/scale", (D,), "pre_mlp_layernorm", i),
            (f"{p}/mlp/gate_proj/kernel", (D, F), "W_gate", i),
            (f"{p}/mlp/up_proj/kernel", (D, F), "W_up", i),
            (f"{p}/mlp/down_proj/kernel", (F, D), "W_down", i),
        ]
    ents += [("params/final_layernorm/scale", (D,), "final_layernorm", None),
             ("params/lm_head/kernel", (D, V), "output_layer", None)]
    return ents


def reference_scanned_mla_moe(L=3, H=2, Dh=4, Rq=6, Rkv=4):
    st = ("stack", 0, 0)
    p = "params/layers"
    return [
        ("params/embed/embedding", (V, D), "word_embeddings", None),
        (f"{p}/input_layernorm/scale", (L, D), "input_layernorm", st),
        (f"{p}/attn/q_down/kernel", (L, D, Rq), "mla_Q_down", st),
        (f"{p}/attn/q_norm/scale", (L, Rq), "q_norm", st),
        (f"{p}/attn/q_up/kernel", (L, Rq, H * Dh), "mla_Q_up", st),
        (f"{p}/attn/kv_down/kernel", (L, D, Rkv), "mla_KV_down", st),
        (f"{p}/attn/kv_norm/scale", (L, Rkv), "kv_norm", st),
        (f"{p}/attn/kv_up/kernel", (L, Rkv, 2 * H * Dh), "mla_KV_up", st),
        (f"{p}/attn/gate/kernel", (L, D, H * Dh), "attn_gate", st),
        (f"{p}/attn/o_proj/kernel", (L, H * Dh, D), "Wo", st),
        (f"{p}/pre_mlp_layernorm/scale", (L, D), "pre_mlp_layernorm", st),
        (f"{p}/moe/router/kernel", (L, D, E), "router", st),
        (f"{p}/moe/expert_bias", (L, E), "expert_bias", st),
        (f"{p}/moe/experts/gate_proj", (L, E, D, F), "W_gate", st),
        (f"{p}/moe/experts/up_proj", (L, E, D, F), "W_up", st),
        (f"{p}/moe/experts/down_proj", (L, E, F, D), "W_down", st),
        ("params/final_layernorm/scale", (D,), "final_layernorm", None),
        ("params/lm_head/kernel", (D, V), "output_layer", None),
        ("params/mtp_0/input_layernorm/scale", (D,), "mtp_input_layernorm", None),
        ("params/mtp_0/proj/kernel", (2 * D, D), "mtp_proj", None),
    ]


def gpt2_like(num_layers=3, conv1d=True):
    """HF-Flax GPT-2: c_attn/c_proj/c_fc are Conv1D with [out, in] kernels (conv1d=True)
    or Linen Dense [in, out] kernels."""
    def k(i, o):
        return (o, i) if conv1d else (i, o)
    ents = [("transformer/wte/embedding", (V, D), "word_embeddings", None),
            ("transformer/wpe/embedding", (12, D), "position_embeddings", None)]
    for i in range(num_layers):
        p = f"transformer/h/{i}"
        ents += [
            (f"{p}/ln_1/scale", (D,), "ln_1", i), (f"{p}/ln_1/bias", (D,), None, i),
            (f"{p}/attn/c_attn/kernel", k(D, 3 * D), ("qkv", (D, D, D), 0 if conv1d else 1), i),
            (f"{p}/attn/c_attn/bias", (3 * D,), None, i),
            (f"{p}/attn/c_proj/kernel", k(D, D), "Wo", i),
            (f"{p}/ln_2/scale", (D,), "ln_2", i),
            (f"{p}/mlp/c_fc/kernel", k(D, 4 * D), "W_up", i),
            (f"{p}/mlp/c_proj/kernel", k(4 * D, D), "W_down", i),
        ]
    ents += [("transformer/ln_f/scale", (D,), "ln_f", None), ("transformer/ln_f/bias", (D,), None, None)]
    return ents


def llama_like(num_layers=3, H=4, KVH=2, Dh=2):
    ents = [("model/embed_tokens/embedding", (V, D), "word_embeddings", None)]
    for i in range(num_layers):
        p = f"model/layers/{i}"
        ents += [
            (f"{p}/self_attn/q_proj/kernel", (D, H * Dh), "Wq", i),
            (f"{p}/self_attn/k_proj/kernel", (D, KVH * Dh), "Wk", i),
            (f"{p}/self_attn/v_proj/kernel", (D, KVH * Dh), "Wv", i),
            (f"{p}/self_attn/o_proj/kernel", (H * Dh, D), "Wo", i),
            (f"{p}/mlp/gate_proj/kernel", (D, F), "W_gate", i),
            (f"{p}/mlp/up_proj/kernel", (D, F), "W_up", i),
            (f"{p}/mlp/down_proj/kernel", (F, D), "W_down", i),
            (f"{p}/input_layernorm/weight", (D,), "input_layernorm", i),
            (f"{p}/post_attention_layernorm/weight", (D,), "post_attention_layernorm", i),
        ]
    ents += [("model/norm/weight", (D,), "final_norm", None), ("lm_head/kernel", (D, V), "output_layer", None)]
    return ents


def maxtext_like(L=3, H=2, Dh=4):
    st = ("stack", 1, 0)
    p = "params/decoder/layers"
    return [
        ("params/token_embedder/embedding", (V, D), "word_embeddings", None),
        (f"{p}/self_attention/query/kernel", (D, L, H, Dh), "Wq", st),
        (f"{p}/self_attention/key/kernel", (D, L, H, Dh), "Wk", st),
        (f"{p}/self_attention/value/kernel", (D, L, H, Dh), "Wv", st),
        (f"{p}/self_attention/out/kernel", (H, L, Dh, D), "Wo", st),
        (f"{p}/mlp/wi_0/kernel", (D, L, F), "W_gate", st),
        (f"{p}/mlp/wi_1/kernel", (D, L, F), "W_up", st),
        (f"{p}/mlp/wo/kernel", (F, L, D), "W_down", st),
        (f"{p}/pre_self_attention_layer_norm/scale", (D, L), "pre_self_attention_layer_norm", st),
        (f"{p}/post_self_attention_layer_norm/scale", (D, L), "post_self_attention_layer_norm", st),
        ("params/decoder/decoder_norm/scale", (D,), "decoder_norm", None),
        ("params/decoder/logits_dense/kernel", (D, V), "output_layer", None),
    ]


TREES = {
    "reference_unscanned_fused_qkv_gqa": (lambda: reference_unscanned(num_layers=11), Roles(qkv_split=QKVSplit(num_heads=4, num_kv_heads=2))),
    # default roles: the GQA split is inferred from o_proj's width (H * Dh)
    "reference_unscanned_default_roles": (lambda: reference_unscanned(num_layers=2), Roles()),
    "reference_scanned_mla_moe": (reference_scanned_mla_moe, Roles()),
    # one head: the fused kernel is [D, 3*Dh] = [8, 6], whose shape alone points at axis 0;
    # the output projection's size (and the head counts) say axis 1
    "reference_one_head_fused_default_roles": (lambda: reference_unscanned(num_layers=2, H=1, KVH=1), Roles()),
    "reference_one_head_fused_head_counts": (lambda: reference_unscanned(num_layers=2, H=1, KVH=1),
                                             Roles(qkv_split=QKVSplit(num_heads=1, num_kv_heads=1))),
    "gpt2_hf_conv1d": (lambda: gpt2_like(conv1d=True), Roles()),
    "gpt2_linen_dense": (lambda: gpt2_like(conv1d=False), Roles()),
    "llama_like": (llama_like, Roles()),
    "maxtext_scanned_axis1": (maxtext_like, Roles()),
}


@pytest.mark.parametrize("name", tiered(TREES, ("reference_unscanned_fused_qkv_gqa", "reference_scanned_mla_moe")))
def test_matches_numpy(name):
    make, roles = TREES[name]
    grads, gm = build(make(), seed=1)
    params, pm = build(make(), seed=2)
    got = jax.jit(lambda g, p: gradient_metrics(g, params=p, roles=roles))(grads, params)
    assert_matches(got, reference(gm, param_metas=pm))


def test_table_names_present():
    grads, _ = build(reference_unscanned(num_layers=2))
    roles = TREES["reference_unscanned_fused_qkv_gqa"][1]
    m = jax.eval_shape(lambda g: gradient_metrics(g, roles=roles), grads)
    for k in ["grad/global_norm", "grad/nonfinite_count", "grad/word_embeddings_abs.max", "grad/output_layer_abs.max",
              "grad/Wq_abs.max", "grad/Wk_abs.max", "grad/Wv_abs.max", "grad/Wo_abs.max", "grad/W_gate_rms",
              "grad/W_up_rms", "grad/W_down_rms", "grad/W_gate_rms/layer_1", "grad/input_layernorm_rms",
              "grad/pre_mlp_layernorm_rms", "grad/final_layernorm_rms", "grad/norm/layer_1", "grad/share/layer_0"]:
        assert k in m, k
    g2, _ = build(reference_scanned_mla_moe())
    m2 = jax.eval_shape(gradient_metrics, g2)
    for k in ["grad/mla_Q_down_abs.max", "grad/mla_Q_up_abs.max", "grad/mla_KV_down_abs.max", "grad/mla_KV_up_abs.max"]:
        assert k in m2, k


def test_nan_gradient_is_reported_not_hidden():
    grads, gm = build(llama_like(), seed=3)
    path = "model/layers/1/mlp/up_proj/kernel"
    bad = [m for m in gm if m[0] == path][0][1].copy()
    bad[0, 3] = np.nan
    set_leaf(grads, gm, path, bad)
    got = jax.device_get(jax.jit(gradient_metrics)(grads))
    assert np.isnan(got["grad/global_norm"]) and got["grad/nonfinite_count"] == 1
    assert got["grad/nonfinite_count/layer_1"] == 1 and got["grad/nonfinite_count/layer_0"] == 0
    assert np.isnan(got["grad/norm/layer_1"]) and np.isfinite(got["grad/norm/layer_0"])
    assert np.isnan(got["grad/W_up_abs.max"]) and np.isnan(got["grad/W_up_rms/layer_1"])
    assert np.isfinite(got["grad/W_up_rms/layer_2"]) and got["grad/W_up.nonfinite"] == 1
    assert_matches(got, reference(gm))
    gn = jax.jit(global_norm_metrics)(grads)
    assert np.isnan(gn["grad/global_norm"]) and int(gn["grad/nonfinite_count"]) == 1


def test_bf16_equals_float32_upcast():
    grads, _ = build(llama_like(num_layers=1), seed=4)
    g16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), grads)
    g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g16)
    a, b = jax.jit(gradient_metrics)(g16), jax.jit(gradient_metrics)(g32)
    # Same float32 figures up to the order XLA sums in (it may tile a fused bf16
    # convert differently): a bf16 accumulation would be off by ~1e-2, not 1e-7.
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=2e-6, atol=0, err_msg=k)


def test_update_and_global_norm_metrics_match_optax():
    grads, _ = build(llama_like(num_layers=1), seed=5)
    params, _ = build(llama_like(num_layers=1), seed=6)
    m = jax.jit(update_metrics)(grads, params)
    np.testing.assert_allclose(m["update/global_norm"], optax.tree.norm(grads), rtol=1e-6)
    np.testing.assert_allclose(m["update/param_ratio"], optax.tree.norm(grads) / optax.tree.norm(params), rtol=1e-5)
    assert int(m["update/nonfinite_count"]) == 0
    g = jax.jit(lambda t: global_norm_metrics(t, suffix="_post_clip"))(grads)
    assert set(g) == {"grad/global_norm_post_clip", "grad/nonfinite_count_post_clip"}
    np.testing.assert_allclose(g["grad/global_norm_post_clip"], optax.tree.norm(grads), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(global_norm)(grads), optax.tree.norm(grads), rtol=1e-6)
    m2 = jax.eval_shape(lambda t: gradient_metrics(t, per=()), grads)
    assert set(m2) == {"grad/global_norm", "grad/nonfinite_count"}


@pytest.mark.parametrize("name", ["reference_unscanned_default_roles", "reference_scanned_mla_moe",
                                  "maxtext_scanned_axis1", "gpt2_hf_conv1d"])
def test_group_and_update_ratio_figures_match_numpy(name):
    """grad/norm|share/{embedding,lm_head}, param/norm/{group}, update/param_ratio/{layer_i,group}
    from NumPy on the labelled arrays; scan-stacked leaves per slice (axis 0 and MaxText's axis 1);
    GPT-2's head is tied (no lm_head leaf): no lm_head figures."""
    fn, roles = TREES[name]
    grads, gm = build(fn(), seed=11)
    params, pm = build(fn(), seed=12)
    updates, um = build(fn(), seed=13)
    got = jax.jit(lambda g, p, u: gradient_metrics(g, params=p, updates=u, roles=roles))(grads, params, updates)
    assert_matches(got, reference(gm, param_metas=pm, update_metas=um))
    assert ("grad/norm/lm_head" in got) == (name != "gpt2_hf_conv1d")
    assert "update/param_ratio/embedding" in got and "update/param_ratio/layer_1" in got
    # cross-check the group norms against optax.global_norm on the sub-trees
    emb = [m[1] for m in gm if m[2] == "word_embeddings"]
    np.testing.assert_allclose(float(got["grad/norm/embedding"]), float(optax.tree.norm(emb)), rtol=1e-6)
    with pytest.raises(ValueError, match="pass params= too"):
        gradient_metrics(grads, updates=updates)


def test_bad_inputs():
    grads, _ = build(reference_unscanned(num_layers=1))  # 16 columns
    with pytest.raises(ValueError, match=r"has 16 entries on axis 1.*\(H \+ 2\*KVH\) = \(4 \+ 2\*3\) = 10"):
        gradient_metrics(grads, roles=Roles(qkv_split=QKVSplit(num_heads=4, num_kv_heads=3)))
    with pytest.raises(ValueError, match="required role 'router' matched no parameter"):
        gradient_metrics(grads, roles=Roles(required=("router",)))
    with pytest.raises(ValueError, match="not bound here"):
        gradient_metrics(grads, axes=("data",))
    with pytest.raises(ValueError, match="specs must be a pytree of PartitionSpec"):
        gradient_metrics(grads, specs={"nope": P()})


# ---------------------------------------------------------------------------------- sharded


def _mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _specs_for(tree):
    """Expert weights sharded over 'expert' along E; fused QKV columns sharded over
    'expert' too (tensor-parallel style); everything else replicated."""
    def spec(path, x):
        s = jax.tree_util.keystr(path, simple=True, separator="/")
        if "/experts/" in s:
            return P(None, "expert")
        if s.endswith("expert_bias"):
            return P(None, "expert")
        if s.endswith("qkv/kernel"):
            return P(None, None, "expert")
        return P()
    return jax.tree_util.tree_map_with_path(spec, tree)


def _scanned_moe_with_qkv():
    ents = reference_scanned_mla_moe(L=2)
    # fused QKV [L, D, (H + 2 KVH) Dh] with H=4, KVH=2, Dh=2: 16 columns, 4 per 'expert' shard,
    # so shards straddle the Q|K|V boundaries.
    ents.append(("params/layers/attn/qkv/kernel", (2, D, 16), ("qkv", (8, 4, 4), 2), ("stack", 0, 0)))
    return ents


@pytest.mark.slow
def test_shard_map_expert_parallel_equals_one_device():
    mesh = _mesh()
    grads, gm = build(_scanned_moe_with_qkv(), seed=7)
    params, pm = build(_scanned_moe_with_qkv(), seed=8)
    updates, um = build(_scanned_moe_with_qkv(), seed=9)
    # one NaN in an expert shard that is not the first: pmax must not drop it
    path = "params/layers/moe/experts/down_proj"
    bad = [m for m in gm if m[0] == path][0][1].copy()
    bad[1, 3, 1, 1] = np.nan
    set_leaf(grads, gm, path, bad)
    roles = Roles()  # the GQA split of the column-sharded QKV is inferred from o_proj
    specs = _specs_for(grads)
    want = reference(gm, param_metas=pm)
    want_u = reference(gm, param_metas=pm, update_metas=um)

    put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)
    gs, ps, us = put(grads), put(params), put(updates)

    def body(use_specs):
        def f(g, p):
            return gradient_metrics(g, params=p, roles=roles, specs=specs if use_specs else None,
                                    axes=("data", "expert"))
        return f

    with_specs = jax.jit(jax.shard_map(body(True), mesh=mesh, in_specs=(specs, specs), out_specs=P()))(gs, ps)
    assert_matches(with_specs, want)
    # Group and per-layer update figures, expert leaves sharded: psum-ed where sharded only.
    upd = jax.jit(jax.shard_map(
        lambda g, p, u: gradient_metrics(g, params=p, updates=u, roles=roles, specs=specs, axes=("data", "expert")),
        mesh=mesh, in_specs=(specs, specs, specs), out_specs=P()))(gs, ps, us)
    assert_matches(upd, want_u)
    # Without specs, JAX's varying-axes types drive the reduction (a column-sharded
    # fused QKV needs specs to be split right, so leave it out here).
    no_qkv = lambda t: {"params": {k: v for k, v in t["params"].items() if k != "layers"} |
                        {"layers": {k: v for k, v in t["params"]["layers"].items() if k != "attn"}}}
    g2, p2, s2 = no_qkv(gs), no_qkv(ps), no_qkv(specs)
    gm2 = [m for m in gm if "/attn/" not in m[0]]
    pm2 = [m for m in pm if "/attn/" not in m[0]]
    typed = jax.jit(jax.shard_map(body(False), mesh=mesh, in_specs=(s2, s2), out_specs=P()))(g2, p2)
    assert_matches(typed, reference(gm2, param_metas=pm2))
    # jit over NamedSharding arrays (global view): same figures, no axes.
    glob = jax.jit(lambda g, p, u: gradient_metrics(g, params=p, updates=u, roles=roles))(gs, ps, us)
    assert_matches(glob, want_u)


def test_second_call_does_not_recompile():
    grads, _ = build(llama_like(), seed=9)
    grads = jax.device_put(grads)
    f = jax.jit(gradient_metrics)
    f(grads)
    n = f._cache_size()
    f(jax.tree.map(lambda x: x * 2, grads))
    assert f._cache_size() == n


def _label_reference_model(params, cfg):
    """NumPy labels from the reference model's naming contract (not from Roles)."""
    base = {"embedding": "word_embeddings", "o_proj": "Wo", "q_down": "mla_Q_down", "q_up": "mla_Q_up",
            "kv_down": "mla_KV_down", "kv_up": "mla_KV_up", "gate_proj": "W_gate", "up_proj": "W_up",
            "down_proj": "W_down", "router": "router", "expert_bias": "expert_bias", "lm_head": "output_layer"}
    metas = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        s = jax.tree_util.keystr(path, simple=True, separator="/")
        parts = s.split("/")
        x = np.asarray(x)
        layer = None
        if parts[0].startswith("layers_"):
            layer = int(parts[0][len("layers_"):])
        elif parts[0] == "layers":
            layer = ("stack", 0, 0)
        leaf_mod = parts[-2] if parts[-1] in ("kernel", "scale") else parts[-1]
        if parts[-1] == "scale":
            b = ("mtp_" if parts[0].startswith("mtp_") else "") + parts[-2]
        elif leaf_mod == "qkv":
            nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            b = ("qkv", (nq, nk, nk), x.ndim - 1)
        elif leaf_mod == "gate":
            b = "attn_gate"
        elif leaf_mod == "proj":
            b = "mtp_proj"
        else:
            b = base[leaf_mod]
        metas.append([s, x, b, layer])
    return metas


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(attention="fused_qkv", n_layers=3),
                                dict(attention="mla", attn_gate=True, moe=True, n_mtp=1, scan_layers=True)],
                         ids=["fused_qkv_unscanned", "mla_moe_mtp_scanned"])
def test_reference_model_init_params_default_roles(kw):
    rm = pytest.importorskip("jvitals.reference_model")
    cfg = rm.ModelConfig(d_model=16, head_dim=4, d_ff=32, d_expert=8, vocab=32, **kw)
    params = jax.jit(lambda k: rm.init_params(cfg, k))(jax.random.key(0))
    grads = jax.tree.map(lambda x: x * 1.5 + 0.01, params)
    got = jax.jit(lambda g, p: gradient_metrics(g, params=p))(grads, params)
    assert_matches(got, reference(_label_reference_model(grads, cfg),
                                  param_metas=_label_reference_model(params, cfg)))


def test_eager_calls_compile_once(count_compiles):
    """Issue 20 item 7 for the gradient side: a second eager call with the same shapes
    compiles nothing and gives the same figures (checked against NumPy once)."""
    grads, gm = build(reference_unscanned(num_layers=2), seed=1)
    params, pm = build(reference_unscanned(num_layers=2), seed=2)
    calls = [lambda: gradient_metrics(grads, params=params), lambda: global_norm(grads)]
    first = assert_second_calls_compile_nothing(calls, count_compiles)
    assert_matches(first[0], reference(gm, param_metas=pm))
    np.testing.assert_allclose(first[1], optax.tree.norm(grads), rtol=1e-6)


def test_add_leaf_counts_a_leaf_in_its_layer_group_and_role_keys():
    """Where one leaf's summary goes: 'all' always; its layer (or stack) and group when
    the tree is layered; its role (and role x layer) for the role tree only."""
    from jvitals.metrics import gradients as g
    from jvitals.metrics.roles import LeafRole
    from jvitals.metrics.stats import summarize

    s = summarize(jnp.arange(6.0))
    stacked = summarize(jnp.arange(12.0).reshape(3, 4), axis=0)
    cases = [
        (None, False, False, {"all"}),
        (LeafRole("layers_1/q/kernel", (2, 3), "q", "Wq", 1), True, True,
         {"all", ("layer", 1), ("role", "Wq"), ("role_layer", "Wq", 1)}),
        (LeafRole("layers_1/q/kernel", (2, 3), "q", "Wq", 1), True, False, {"all", ("layer", 1)}),
        (LeafRole("layers_1/q/kernel", (2, 3), "q", "Wq", 1), False, True, {"all", ("role", "Wq")}),
        (LeafRole("embed/embedding", (2, 3), "embedding", "word_embeddings", None), True, True,
         {"all", ("group", "embedding"), ("role", "word_embeddings")}),
        (LeafRole("layers/q/kernel", (3, 4), "q", "Wq", None, "layers", 0, 0, 3), True, True,
         {"all", ("stack", "layers"), ("role", "Wq"), ("role_stack", "Wq", "layers")}),
    ]
    for lr, layered, by_role, want in cases:
        acc = g.Accumulator()
        g._add_leaf(acc, (), lr, [(None if lr is None else lr.name, stacked if lr and lr.stack else s)],
                    layered=layered, by_role=by_role)
        assert set(acc.result()) == want, (lr, layered, by_role)


def test_tree_stats_reads_trees_of_one_structure_together_and_others_apart():
    """Grads, params and updates of one structure: one pass, the same figures as each
    tree alone; a tree of another structure is measured on its own."""
    from jvitals.metrics.gradients import tree_stats

    rng = np.random.default_rng(3)
    mk = lambda: {"a": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),  # noqa: E731
                  "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}
    g, p, u = mk(), mk(), mk()
    other = {"c": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
    joint = tree_stats({"g": g, "p": p, "u": u, "o": other})
    for name, t in (("g", g), ("p", p), ("u", u), ("o", other)):
        alone = tree_stats({name: t})[name]
        np.testing.assert_allclose(float(joint[name].all.norm), float(alone.all.norm), rtol=1e-6)
        want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(t)))
        np.testing.assert_allclose(float(joint[name].all.norm), want, rtol=1e-6)
    hlo = jax.jit(lambda a, b, c: {k: v.all.sumsq for k, v in tree_stats({"g": a, "p": b, "u": c}).items()}).lower(
        g, p, u).compile().as_text()
    assert hlo.count(" reduce(") <= 2 * 2  # one reduction per leaf position (each in at most 2 levels)
