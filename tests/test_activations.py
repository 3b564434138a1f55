"""activation_metrics / bos_value_grad_metrics against independent NumPy references."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_second_calls_compile_nothing
from jvitals.metrics.activations import activation_metrics, bos_value_grad_metrics, mtp_metrics
from jvitals.reference_model import (ModelConfig, init_params, init_perturbations, loss_fn,
                                     make_batch)

HUGE = 1e30
B, T = 8, 16

CFG_A = ModelConfig(vocab=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
CFG_B = ModelConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, head_dim=8, attention="mla",
                    q_lora_rank=16, kv_lora_rank=16, attn_gate=True, moe=True, n_experts=4,
                    top_k=2, d_expert=32, n_mtp=2, scan_layers=True)
CONFIGS = {"dense_fused_list": CFG_A, "moe_mla_gate_mtp_scan": CFG_B}


# ----------------------------------------------------------------------------------
# Running the model once per config (session-scoped: compiles are the cost).


def _step(cfg):
    def f(params, batch, pert):
        (loss, inter), g = jax.value_and_grad(loss_fn, argnums=3, has_aux=True)(params, batch, cfg, pert)
        return inter, g
    return jax.jit(f)


@pytest.fixture(scope="session")
def runs():
    out = {}
    for key, cfg in CONFIGS.items():
        params = init_params(cfg, jax.random.key(0))
        batch = make_batch(1, cfg, B, T, pad_fraction=0.3)
        pert = init_perturbations(cfg, batch["tokens"])
        inter, grads = _step(cfg)(params, batch, pert)
        out[key] = dict(cfg=cfg, params=params, batch=batch, pert=pert, inter=inter, grads=grads)
    return out


def _layers(cfg, inter, *path):
    """Gather a per-layer sown value in model order, knowing the model's layout."""
    if cfg.scan_layers:
        node = inter["layers"]
        for p in path:
            node = node[p]
        (stacked,) = node
        return [np.asarray(x) for x in stacked]
    res = []
    for i in range(cfg.n_layers):
        node = inter[f"layers_{i}"]
        for p in path:
            node = node[p]
        (x,) = node
        res.append(np.asarray(x))
    return res


def _grad_layers(cfg, grads):
    if cfg.scan_layers:
        return [np.asarray(x) for x in grads["layers"]["attn"]["bos_value"]]
    return [np.asarray(grads[f"layers_{i}"]["attn"]["bos_value"]) for i in range(cfg.n_layers)]


# ----------------------------------------------------------------------------------
# Poisoning padding with huge values and the NumPy reference.


def _attn_valid(mask):
    t = mask.shape[1]
    return np.tril(np.ones((t, t), bool))[None] & mask[:, :, None] & mask[:, None, :]


def _poison_tokens(x, mask, stacked):
    m = mask[None] if stacked else mask
    m = m.reshape(m.shape + (1,) * (x.ndim - m.ndim))
    return jnp.where(m, x, jnp.asarray(HUGE, x.dtype))


def _poison(cfg, inter, mask):
    """Every padded (or causally masked) entry of every raw sown tensor := 1e30."""
    mask = np.asarray(mask)
    valid4 = _attn_valid(mask)[:, None]

    def fix(path, x):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        name = [k for k in keys if isinstance(k, str)][-1]
        stacked = cfg.scan_layers and keys[0] == "layers"
        if name == "expert_counts":
            return x
        if name == "attn_logits":
            v = valid4[None] if stacked else valid4
            return jnp.where(v, x, HUGE)
        return _poison_tokens(x, mask, stacked)

    return jax.tree_util.tree_map_with_path(fix, inter)


def _rms(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean(x * x)))


def _amax(x):
    return float(np.max(np.abs(np.asarray(x, np.float64))))


def _lse(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def numpy_reference(cfg, inter, mask, labels):
    """Every act/* figure from the gathered arrays, in float64 NumPy."""
    mask = np.asarray(mask)
    labels = np.asarray(labels)
    ref = {}

    def per_layer(base, arrays, stats):
        vals = {"rms": [_rms(a[mask]) for a in arrays], "abs.max": [_amax(a[mask]) for a in arrays]}
        for stat, suffix in stats:
            for i, v in enumerate(vals[stat]):
                ref[f"{base}_{stat}/layer_{i}"] = v
            ref[f"{base}_{stat}{suffix}"] = max(vals[stat]) if stat == "abs.max" else float(np.mean(vals[stat]))
        for i in range(len(arrays)):
            ref[f"{base}.nonfinite/layer_{i}"] = 0.0
        ref[f"{base}.nonfinite"] = 0.0

    per_layer("act/hidden_states", _layers(cfg, inter, "hidden_states"), (("rms", ".avg"), ("abs.max", "")))
    per_layer("act/attn_out_before_proj", _layers(cfg, inter, "attn", "attn_out_before_proj"), (("rms", ".avg"),))
    if cfg.attn_gate:
        per_layer("act/gate_scores", _layers(cfg, inter, "attn", "gate_scores"), (("rms", ".avg"),))
    valid = _attn_valid(mask)
    attn = [_amax(a.transpose(0, 2, 3, 1)[valid]) for a in _layers(cfg, inter, "attn", "attn_logits")]
    for i, v in enumerate(attn):
        ref[f"act/attn_logits_abs.max/layer_{i}"] = v
        ref[f"act/attn_logits.nonfinite/layer_{i}"] = 0.0
    ref["act/attn_logits_abs.max"] = max(attn)
    ref["act/attn_logits.nonfinite"] = 0.0

    logits = np.asarray(inter["logits"][0], np.float64)
    x = logits[mask]
    srt = np.sort(x, axis=-1)
    ref["act/output_layer_logits_rms.avg"] = _rms(x)
    ref["act/output_layer_logits_abs.max"] = _amax(x)
    ref["act/output_layer_logits_top2_diff.avg"] = float(np.mean(srt[:, -1] - srt[:, -2]))
    ref["act/output_layer_logits_top2_equal_ratio"] = float(np.mean(srt[:, -1] == srt[:, -2]))
    ref["act/output_layer_logsumexp.mean"] = float(np.mean(_lse(x)))
    ref["act/output_layer_logsumexp.max"] = float(np.max(_lse(x)))
    ref["act/output_layer_logits.nonfinite"] = 0.0
    main = logits.argmax(-1)
    ref["act/lm_head_top1_accuracy"] = float(np.mean(main[mask] == labels[mask]))
    for k in range(1, cfg.n_mtp + 1):
        mtp = np.asarray(inter["mtp_logits"][k - 1]).argmax(-1)
        agree, acc, n = 0, 0, 0
        for b in range(mask.shape[0]):
            for t in range(mask.shape[1] - k):
                if mask[b, t] and mask[b, t + k]:
                    n += 1
                    agree += main[b, t + k] == mtp[b, t]
                    acc += mtp[b, t] == labels[b, t + k]
        ref[f"act/mtp_{k}_lm_head_top1_agreement"] = agree / n
        ref[f"act/mtp_{k}_top1_accuracy"] = acc / n
    return ref


def numpy_bos_reference(cfg, grads, tokens, mask):
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    bos = (tokens == cfg.bos_id) & mask
    rest = ~(tokens == cfg.bos_id) & mask
    ref = {}
    gs = _grad_layers(cfg, grads)
    for i, g in enumerate(gs):
        ref[f"diag/bos_value_grad_rms/layer_{i}"] = _rms(g[bos])
        ref[f"diag/bos_value_grad_abs.max/layer_{i}"] = _amax(g[bos])
        ref[f"diag/bos_value_grad_ratio/layer_{i}"] = _rms(g[bos]) / _rms(g[rest])
        ref[f"diag/bos_value_grad.nonfinite/layer_{i}"] = 0.0
    allb = np.concatenate([g[bos].ravel() for g in gs])
    allr = np.concatenate([g[rest].ravel() for g in gs])
    ref["diag/bos_value_grad_rms"] = _rms(allb)
    ref["diag/bos_value_grad_abs.max"] = _amax(allb)
    ref["diag/bos_value_grad_ratio"] = _rms(allb) / _rms(allr)
    ref["diag/bos_value_grad.nonfinite"] = 0.0
    return ref


def assert_metrics_close(got, ref, rtol=2e-5, atol=1e-6, exact_keys=True):
    got = jax.device_get(got)
    if exact_keys:
        assert set(got) == set(ref), (sorted(set(got) - set(ref)), sorted(set(ref) - set(got)))
    for k, v in ref.items():
        np.testing.assert_allclose(np.asarray(got[k], np.float64), v, rtol=rtol, atol=atol, err_msg=k)


# ----------------------------------------------------------------------------------
# One device.


@pytest.fixture(scope="session")
def metrics_fn():
    return jax.jit(lambda inter, mask, labels: activation_metrics(inter, mask=mask, labels=labels))


@pytest.mark.parametrize("key", list(CONFIGS))
def test_against_numpy_with_poisoned_padding(runs, metrics_fn, key):
    r = runs[key]
    cfg, batch = r["cfg"], r["batch"]
    assert not bool(np.all(batch["mask"])), "the batch must have padding"
    inter = _poison(cfg, r["inter"], batch["mask"])
    got = metrics_fn(inter, batch["mask"], batch["labels"])
    ref = numpy_reference(cfg, inter, batch["mask"], batch["labels"])
    assert_metrics_close(got, ref)
    for v in jax.device_get(got).values():
        assert abs(float(v)) < 1e6, "padding leaked into a statistic"


@pytest.mark.parametrize("key", list(CONFIGS))
def test_bos_value_grads_against_numpy(runs, key):
    r = runs[key]
    cfg, batch = r["cfg"], r["batch"]
    grads = jax.tree.map(lambda g: _poison_tokens(g, np.asarray(batch["mask"]), cfg.scan_layers), r["grads"])
    got = jax.jit(lambda g, t, m: bos_value_grad_metrics(g, t, bos_id=cfg.bos_id, mask=m))(
        grads, batch["tokens"], batch["mask"])
    assert_metrics_close(got, numpy_bos_reference(cfg, grads, batch["tokens"], batch["mask"]), rtol=1e-4)
    # BOS = position 0 when no bos_id: the same here (BOS is at position 0 only).
    got0 = bos_value_grad_metrics({"perturbations": grads}, mask=batch["mask"])
    assert_metrics_close(got0, numpy_bos_reference(cfg, grads, batch["tokens"], batch["mask"]), rtol=1e-4)


def test_exact_metric_names(runs, metrics_fn):
    got_a = metrics_fn(runs["dense_fused_list"]["inter"], runs["dense_fused_list"]["batch"]["mask"],
                       runs["dense_fused_list"]["batch"]["labels"])
    agg_a = {k for k in got_a if "/layer_" not in k}
    assert agg_a == {
        "act/hidden_states_rms.avg", "act/hidden_states_abs.max", "act/hidden_states.nonfinite",
        "act/attn_out_before_proj_rms.avg", "act/attn_out_before_proj.nonfinite",
        "act/attn_logits_abs.max", "act/attn_logits.nonfinite",
        "act/output_layer_logits_rms.avg", "act/output_layer_logits_abs.max",
        "act/output_layer_logits_top2_diff.avg", "act/output_layer_logits_top2_equal_ratio",
        "act/output_layer_logsumexp.mean", "act/output_layer_logsumexp.max",
        "act/output_layer_logits.nonfinite", "act/lm_head_top1_accuracy"}
    r = runs["moe_mla_gate_mtp_scan"]
    got_b = metrics_fn(r["inter"], r["batch"]["mask"], r["batch"]["labels"])
    extra = {k for k in got_b if "/layer_" not in k} - agg_a
    assert extra == {"act/gate_scores_rms.avg", "act/gate_scores.nonfinite",
                     "act/mtp_1_lm_head_top1_agreement", "act/mtp_2_lm_head_top1_agreement",
                     "act/mtp_1_top1_accuracy", "act/mtp_2_top1_accuracy"}
    assert "act/hidden_states_rms/layer_1" in got_b and "act/hidden_states_rms/layer_2" not in got_b
    assert all(np.ndim(v) == 0 and v.dtype == jnp.float32 for v in got_b.values())


@pytest.mark.parametrize("key", ["dense_fused_list", pytest.param("moe_mla_gate_mtp_scan", marks=pytest.mark.slow)])
def test_probes_equal_raw_path(runs, metrics_fn, key):
    r = runs[key]
    cfg = dataclasses.replace(r["cfg"], use_probes=True)
    _, inter = jax.jit(lambda p, b: loss_fn(p, b, cfg))(r["params"], r["batch"])
    leaves = jax.tree.leaves(inter)
    assert max(x.size for x in leaves) <= B * T, "a probe sowed a large tensor"
    got = metrics_fn(inter, r["batch"]["mask"], r["batch"]["labels"])
    raw = metrics_fn(r["inter"], r["batch"]["mask"], r["batch"]["labels"])
    assert set(got) == set(raw)
    assert_metrics_close(got, {k: float(v) for k, v in jax.device_get(raw).items()}, rtol=1e-5)


def test_bf16_model_close_to_float32(runs, metrics_fn):
    r = runs["dense_fused_list"]
    cfg16 = dataclasses.replace(r["cfg"], dtype=jnp.bfloat16)
    _, inter16 = jax.jit(lambda p, b: loss_fn(p, b, cfg16))(r["params"], r["batch"])
    assert inter16["logits"][0].dtype == jnp.bfloat16
    m16 = jax.device_get(metrics_fn(inter16, r["batch"]["mask"], r["batch"]["labels"]))
    m32 = jax.device_get(metrics_fn(r["inter"], r["batch"]["mask"], r["batch"]["labels"]))
    for k in m32:
        if "_rms" in k or "abs.max" in k or "logsumexp" in k:
            np.testing.assert_allclose(m16[k], m32[k], rtol=5e-2, err_msg=k)
    # The figures of bf16 values are those of their float32 upcast, exactly.
    up = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, inter16)
    m_up = jax.device_get(metrics_fn(up, r["batch"]["mask"], r["batch"]["labels"]))
    for k in m16:
        np.testing.assert_allclose(m16[k], m_up[k], rtol=1e-6, err_msg=k)


def test_top2_ties_constructed():
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 4, size=(4, 6, 16)).astype(np.float32)  # many ties
    logits[0, 0] = np.arange(16)                                     # unique max
    logits[0, 1] = 3.0                                               # all equal
    logits[1, 2, :2] = 9.0                                           # tie at the top
    mask = np.ones((4, 6), bool)
    mask[3, 4:] = False
    logits[3, 4:] = HUGE
    got = jax.device_get(activation_metrics({"logits": (jnp.asarray(logits),)}, mask=jnp.asarray(mask)))
    x = logits[mask].astype(np.float64)
    srt = np.sort(x, -1)
    ties = srt[:, -1] == srt[:, -2]
    assert 0 < ties.mean() < 1
    np.testing.assert_allclose(got["act/output_layer_logits_top2_equal_ratio"], ties.mean(), rtol=1e-6)
    np.testing.assert_allclose(got["act/output_layer_logits_top2_diff.avg"],
                               np.mean(srt[:, -1] - srt[:, -2]), rtol=1e-6)
    # lax.top_k semantics: ties count twice.
    top = jax.lax.top_k(jnp.asarray(logits), 2)[0]
    np.testing.assert_array_equal(np.asarray(top[..., 0] == top[..., 1])[mask], ties)


def test_nonfinite_is_reported_not_hidden():
    h = np.ones((2, B, T, 4), np.float32)
    h[1, 0, 3, 2] = np.nan
    got = jax.device_get(activation_metrics({"hidden_states": (jnp.asarray(h),)},
                                            mask=jnp.ones((B, T), bool)))
    assert np.isnan(got["act/hidden_states_rms.avg"]) and np.isnan(got["act/hidden_states_abs.max"])
    assert got["act/hidden_states_rms/layer_0"] == 1.0
    assert got["act/hidden_states.nonfinite/layer_1"] == 1 and got["act/hidden_states.nonfinite"] == 1


# ----------------------------------------------------------------------------------
# Sow conventions.


def test_layer_order_numeric_and_list_equals_stacked():
    n = 12
    layers = {f"layers_{i}": {"hidden_states": (jnp.full((2, 3, 4), float(i + 1)),)} for i in range(n)}
    got = jax.jit(lambda t: activation_metrics(t, mask=jnp.ones((2, 3), bool)))({"intermediates": layers})
    for i in range(n):
        assert float(got[f"act/hidden_states_abs.max/layer_{i}"]) == i + 1
    stacked = {"blocks": {"hidden_states": (jnp.stack([layers[f"layers_{i}"]["hidden_states"][0]
                                                       for i in range(n)]),)}}
    got2 = activation_metrics(stacked, mask=jnp.ones((2, 3), bool))
    assert set(got2) == set(got)
    for k in got:
        assert float(got[k]) == float(got2[k]), k
    # Two sows from one module: sow order; then a scan-stacked pair after them by path.
    mixed = {"a": {"hidden_states": (jnp.full((2, 3, 4), 1.0), jnp.full((2, 3, 4), 2.0))},
             "b": {"hidden_states": (jnp.stack([jnp.full((2, 3, 4), 3.0), jnp.full((2, 3, 4), 4.0)]),)}}
    got3 = activation_metrics(mixed, mask=jnp.ones((2, 3), bool))
    assert [float(got3[f"act/hidden_states_abs.max/layer_{i}"]) for i in range(4)] == [1, 2, 3, 4]


def test_generic_names_and_no_mask():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(2, 5, 3)).astype(np.float32) + 0.5
    c = rng.normal(size=(2, 5, 3)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    a_p = np.where(mask[..., None], a, HUGE)
    tree = {"l0": {"block_input": (a_p,)}, "l1": {"block_input": (c,)}, "scale": (np.float32(7.0),),
            "moe": {"expert_counts": (np.array([1, 2], np.int32),)}}
    got = jax.device_get(activation_metrics(tree, mask=jnp.asarray(mask)))
    both = np.concatenate([a[mask], c[mask]]).astype(np.float64)
    np.testing.assert_allclose(got["act/block_input_rms"], np.sqrt(np.mean(both ** 2)), rtol=1e-6)
    np.testing.assert_allclose(got["act/block_input_mean"], both.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["act/block_input_std"], both.std(), rtol=1e-4)
    np.testing.assert_allclose(got["act/block_input_abs.max"], np.abs(both).max(), rtol=1e-6)
    np.testing.assert_allclose(got["act/block_input_rms/layer_0"], np.sqrt(np.mean(a[mask] ** 2)), rtol=1e-6)
    assert got["act/scale_rms"] == 7.0 and "act/scale_rms/layer_0" not in got
    assert not any("expert_counts" in k for k in got)


def test_nnx_state_capture():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d, rngs):
            self.lin = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            y = x + jnp.tanh(self.lin(x))
            self.sow(nnx.Intermediate, "hidden_states", y)
            return y

    class Tiny(nnx.Module):
        def __init__(self, v, d, n, rngs):
            self.embed = nnx.Embed(v, d, rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(n)])
            self.head = nnx.Linear(d, v, rngs=rngs)

        def __call__(self, tokens):
            h = self.embed(tokens)
            for blk in self.blocks:
                h = blk(h)
            logits = self.head(h)
            self.sow(nnx.Intermediate, "logits", logits)
            return logits

    model = Tiny(32, 8, 11, nnx.Rngs(0))
    batch = make_batch(3, ModelConfig(vocab=32), 4, 8, pad_fraction=0.3)

    @nnx.jit
    def run(model, tokens, mask, labels):
        _, state = nnx.capture(lambda m: m(tokens), nnx.Intermediate)(model)
        return activation_metrics(state, mask=mask, labels=labels), state

    got, state = run(model, batch["tokens"], batch["mask"], batch["labels"])
    pure = nnx.to_pure_dict(state)
    mask = np.asarray(batch["mask"])
    hs = [np.asarray(pure["blocks"][i]["hidden_states"][0]) for i in range(11)]
    for i, h in enumerate(hs):
        np.testing.assert_allclose(got[f"act/hidden_states_rms/layer_{i}"], _rms(h[mask]), rtol=1e-5)
    np.testing.assert_allclose(got["act/hidden_states_rms.avg"], np.mean([_rms(h[mask]) for h in hs]), rtol=1e-5)
    logits = np.asarray(pure["logits"][0])[mask]
    np.testing.assert_allclose(got["act/output_layer_logits_rms.avg"], _rms(logits), rtol=1e-5)
    acc = np.mean(logits.argmax(-1) == np.asarray(batch["labels"])[mask])
    np.testing.assert_allclose(got["act/lm_head_top1_accuracy"], acc, rtol=1e-6)


def test_mtp_metrics_alignment_by_hand():
    main = jnp.array([[5, 6, 7, 8]])
    mtp1 = jnp.array([[6, 0, 8, 9]])          # vs main[t+1]: agrees at t=0 and t=2
    labels = jnp.array([[5, 6, 0, 8]])
    mask = jnp.array([[True, True, True, False]])
    got = mtp_metrics(main, [mtp1], labels=labels, mask=mask)
    # valid pairs (t, t+1): (0,1), (1,2); t=2 excluded since t+1=3 is padding.
    assert float(got["act/mtp_1_lm_head_top1_agreement"]) == 0.5
    assert float(got["act/mtp_1_top1_accuracy"]) == 1.0      # mtp1[0]=6==labels[1]; mtp1[1]=0==labels[2]
    assert float(got["act/lm_head_top1_accuracy"]) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------
# Sharded: shard_map over 'data' and jit over NamedSharding, equal to one device.


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("probes", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_shard_map_equals_one_device(runs, metrics_fn, probes):
    r = runs["moe_mla_gate_mtp_scan"]
    cfg = dataclasses.replace(r["cfg"], use_probes=probes)
    mesh = _mesh()
    batch = jax.device_put(r["batch"], NamedSharding(mesh, P("data")))
    params = jax.device_put(r["params"], NamedSharding(mesh, P()))
    pert_spec = jax.tree.map(lambda _: P("data") if not cfg.scan_layers else P(None, "data"), r["pert"])
    # The perturbation gradients of one device, sharded: inside shard_map a local loss
    # would be normalised by the local token count, so its gradients differ.
    grads = jax.device_put(r["grads"], jax.tree.map(lambda s: NamedSharding(mesh, s), pert_spec))

    def local(params, batch, grads):
        _, inter = loss_fn(params, batch, cfg)
        m = activation_metrics(inter, mask=batch["mask"], labels=batch["labels"], axes=("data",))
        m.update(bos_value_grad_metrics(grads, batch["tokens"], bos_id=cfg.bos_id, mask=batch["mask"],
                                        axes="data"))
        m["act/lm_head_top1_accuracy_unmasked"] = activation_metrics(
            {"logits": inter["logits"]}, labels=batch["labels"], axes=("data",))["act/lm_head_top1_accuracy"]
        return m

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), pert_spec), out_specs=P()))
    got = jax.device_get(f(params, batch, grads))
    ref = jax.device_get(metrics_fn(r["inter"], r["batch"]["mask"], r["batch"]["labels"]))
    ref.update(jax.device_get(bos_value_grad_metrics(r["grads"], r["batch"]["tokens"], bos_id=cfg.bos_id,
                                                     mask=r["batch"]["mask"])))
    main = np.asarray(r["inter"]["logits"][0]).argmax(-1)
    ref["act/lm_head_top1_accuracy_unmasked"] = np.mean(main == np.asarray(r["batch"]["labels"]))
    assert set(got) == set(ref)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-7, err_msg=k)


def test_jit_named_sharding_equals_one_device(runs, metrics_fn):
    r = runs["dense_fused_list"]
    mesh = _mesh()
    sh = lambda t, spec: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), t)
    inter = jax.tree_util.tree_map_with_path(
        lambda p, x: sh(x, P(None, "data") if x.ndim >= 5 else P("data")), r["inter"])
    got = jax.device_get(metrics_fn(inter, sh(r["batch"]["mask"], P("data")), sh(r["batch"]["labels"], P("data"))))
    ref = jax.device_get(metrics_fn(r["inter"], r["batch"]["mask"], r["batch"]["labels"]))
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, err_msg=k)


# ----------------------------------------------------------------------------------
# Bad inputs.


def test_mask_shape_mismatch_message(runs):
    r = runs["dense_fused_list"]
    with pytest.raises(ValueError, match=r"mask has shape \(8, 32\).*'hidden_states'.*\(8, 16, 32\).*\[B, T, \.\.\.\] = \(8, 32"):
        activation_metrics(r["inter"], mask=jnp.ones((8, 32), bool))
    with pytest.raises(ValueError, match=r"labels have shape \(8, 15\).*mask has shape \(8, 16\)"):
        activation_metrics(r["inter"], mask=r["batch"]["mask"], labels=jnp.ones((8, 15), jnp.int32))


def test_accuracy_requires_labels(runs):
    r = runs["moe_mla_gate_mtp_scan"]
    with pytest.raises(ValueError, match=r"accuracy=True needs labels=\[B, T\].*got labels=None"):
        activation_metrics(r["inter"], mask=r["batch"]["mask"], accuracy=True)
    got = activation_metrics(r["inter"], mask=r["batch"]["mask"])
    assert "act/mtp_1_lm_head_top1_agreement" in got and "act/mtp_1_top1_accuracy" not in got
    with pytest.raises(ValueError, match=r"MTP agreement needs the main output logits sown as 'logits'"):
        activation_metrics({"mtp_logits": r["inter"]["mtp_logits"]}, mask=r["batch"]["mask"])


def test_requested_name_absent(runs):
    r = runs["dense_fused_list"]
    with pytest.raises(ValueError, match=r"requested sow name\(s\) \['gate_scores'\] absent.*'hidden_states'"):
        activation_metrics(r["inter"], mask=r["batch"]["mask"], names=["hidden_states", "gate_scores"])
    got = activation_metrics(r["inter"], mask=r["batch"]["mask"], names=["hidden_states"])
    assert {k.split("/")[1].split("_abs")[0].split("_rms")[0].split(".")[0] for k in got} == {"hidden_states"}


def test_other_bad_inputs(runs):
    r = runs["dense_fused_list"]
    two = {"a": {"logits": r["inter"]["logits"]}, "b": {"logits": r["inter"]["logits"]}}
    with pytest.raises(ValueError, match=r"found 2 sown 'logits' values \(at \['a/logits', 'b/logits'\]\)"):
        activation_metrics(two)
    with pytest.raises(ValueError, match=r"pass tokens=\[B, T\] or mask=\[B, T\]"):
        bos_value_grad_metrics(r["grads"])
    with pytest.raises(ValueError, match=r"no perturbation named 'bos_v'.*\['bos_value'\]"):
        bos_value_grad_metrics(r["grads"], r["batch"]["tokens"], name="bos_v")
    with pytest.raises(ValueError, match=r"mesh axis 'data' is not bound"):
        activation_metrics(r["inter"], mask=r["batch"]["mask"], axes=("data",))
    with pytest.raises(TypeError, match=r"expected the sown 'intermediates' dict"):
        activation_metrics([1, 2])


def test_eager_metrics_compile_once(count_compiles):
    """activation_metrics, summarize_logits and moe_metrics called eagerly twice with
    the same shapes: the second call compiles nothing (issue 20 item 7)."""
    from jvitals.metrics.moe import moe_metrics
    from jvitals.metrics.probes import summarize_logits

    rng = np.random.default_rng(0)
    inter = {"layers_0": {"hidden_states": (jax.device_put(jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)),)},
             "logits": (jax.device_put(jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)),)}
    mask = jax.device_put(jnp.array([[True] * 4, [True, True, False, False]]))
    counts = jax.device_put(jnp.array([[4, 0, 2, 2]], jnp.int32))
    calls = [lambda: activation_metrics(inter, mask=mask), lambda: summarize_logits(inter["logits"][0], mask),
             lambda: moe_metrics(counts, top_k=2)]
    first = assert_second_calls_compile_nothing(calls, count_compiles)
    h = np.asarray(inter["layers_0"]["hidden_states"][0], np.float64)[np.asarray(mask)]
    np.testing.assert_allclose(first[0]["act/hidden_states_rms/layer_0"], np.sqrt(np.mean(h ** 2)), rtol=1e-6)


def test_check_inputs_decides_the_accuracies_and_checks_shapes():
    from jvitals.metrics.activations import _check_inputs

    m, lab = jnp.ones((2, 3), bool), jnp.zeros((2, 3), jnp.int32)
    assert _check_inputs(None, None, None)[2] is False
    assert _check_inputs(m, lab, None)[2] is True       # labels given: accuracies by default
    assert _check_inputs(m, lab, False)[2] is False
    with pytest.raises(ValueError, match="accuracy=True needs labels"):
        _check_inputs(m, None, True)
    with pytest.raises(ValueError, match=r"labels have shape \(2, 4\) but the mask has shape \(2, 3\)"):
        _check_inputs(m, jnp.zeros((2, 4), jnp.int32), None)


def test_bos_positions_from_a_bos_id_or_position_zero():
    from jvitals.metrics.activations import _bos_positions

    tokens = jnp.array([[1, 5, 1, 7], [4, 1, 6, 0]])
    mask = tokens != 0
    tok, valid, bos = _bos_positions(tokens, mask, 1)
    assert tok.shape == (2, 4)
    np.testing.assert_array_equal(bos, tokens == 1)
    np.testing.assert_array_equal(valid, mask)
    _, valid, bos = _bos_positions(None, mask, None)   # no tokens: position 0
    np.testing.assert_array_equal(bos, [[True, False, False, False]] * 2)
    _, _, bos = _bos_positions(tokens, None, None)     # no bos id: position 0
    np.testing.assert_array_equal(bos, [[True, False, False, False]] * 2)
    with pytest.raises(ValueError, match="pass tokens"):
        _bos_positions(None, None, 1)
    with pytest.raises(ValueError, match="both must be"):
        _bos_positions(tokens, mask[:, :3], 1)
