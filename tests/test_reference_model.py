"""The reference model: parameter-name contract, batches, training, MoE helpers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jvitals.reference_model import (Decoder, ModelConfig, cross_entropy, init_params, loss_fn,
                                     make_batch, mtp_cross_entropy, update_expert_bias)

DENSE = ModelConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                    attn_gate=True)
MOE = ModelConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, head_dim=8, attention="mla",
                  q_lora_rank=12, kv_lora_rank=20, moe=True, n_experts=4, top_k=2, d_expert=24,
                  n_mtp=2, scan_layers=True)


def _shapes(cfg):
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(x.shape) for p, x in flat}


def test_param_names_dense_fused_list():
    s = _shapes(DENSE)
    d, h, kvh, dh, f, v = 32, 4, 2, 8, 48, 64
    expect = {"embed/embedding": (v, d), "final_layernorm/scale": (d,), "lm_head/kernel": (d, v)}
    for i in range(2):
        p = f"layers_{i}/"
        expect.update({
            p + "input_layernorm/scale": (d,), p + "attn/qkv/kernel": (d, (h + 2 * kvh) * dh),
            p + "attn/gate/kernel": (d, h * dh), p + "attn/o_proj/kernel": (h * dh, d),
            p + "pre_mlp_layernorm/scale": (d,), p + "mlp/gate_proj/kernel": (d, f),
            p + "mlp/up_proj/kernel": (d, f), p + "mlp/down_proj/kernel": (f, d)})
    assert s == expect


def test_param_names_moe_mla_scan_mtp():
    s = _shapes(MOE)
    L, d, h, dh, rq, rkv, e, fe, v = 2, 32, 4, 8, 12, 20, 4, 24, 64
    p = "layers/"
    expect = {
        "embed/embedding": (v, d), "final_layernorm/scale": (d,), "lm_head/kernel": (d, v),
        p + "input_layernorm/scale": (L, d), p + "pre_mlp_layernorm/scale": (L, d),
        p + "attn/q_down/kernel": (L, d, rq), p + "attn/q_norm/scale": (L, rq),
        p + "attn/q_up/kernel": (L, rq, h * dh), p + "attn/kv_down/kernel": (L, d, rkv),
        p + "attn/kv_norm/scale": (L, rkv), p + "attn/kv_up/kernel": (L, rkv, 2 * h * dh),
        p + "attn/o_proj/kernel": (L, h * dh, d), p + "moe/router/kernel": (L, d, e),
        p + "moe/expert_bias": (L, e), p + "moe/experts/gate_proj": (L, e, d, fe),
        p + "moe/experts/up_proj": (L, e, d, fe), p + "moe/experts/down_proj": (L, e, fe, d)}
    for k in range(2):
        expect[f"mtp_{k}/input_layernorm/scale"] = (d,)
        expect[f"mtp_{k}/proj/kernel"] = (2 * d, d)
    assert s == expect


def test_fused_qkv_column_order():
    """Columns are [Q heads | K heads | V heads]: zeroing the V block zeroes the values."""
    cfg = dataclasses.replace(DENSE, n_layers=1, attn_gate=False)
    params = init_params(cfg, jax.random.key(1))
    qkv = params["layers_0"]["attn"]["qkv"]["kernel"]
    params["layers_0"]["attn"]["qkv"]["kernel"] = qkv.at[:, (4 + 2) * 8:].set(0.0)
    b = make_batch(0, cfg, 2, 8)
    _, sown = jax.jit(lambda p: Decoder(cfg).apply({"params": p}, b["tokens"], mask=b["mask"],
                                                    mutable=["intermediates"]))(params)
    assert float(jnp.abs(sown["intermediates"]["layers_0"]["attn"]["attn_out_before_proj"][0]).max()) == 0.0


def test_make_batch():
    b = make_batch(7, DENSE, 6, 20, pad_fraction=0.3)
    tokens, labels, mask = (np.asarray(b[k]) for k in ("tokens", "labels", "mask"))
    assert tokens.shape == labels.shape == mask.shape == (6, 20) and tokens.dtype == np.int32
    assert (tokens[:, 0] == DENSE.bos_id).all()
    np.testing.assert_array_equal(labels[:, :-1][mask[:, 1:]], tokens[:, 1:][mask[:, 1:]])
    assert (tokens[~mask] == DENSE.pad_id).all() and (labels[~mask] == DENSE.pad_id).all()
    assert 0 < (~mask).mean() < 0.6 and mask[:, :2].all()
    assert (np.diff(mask.astype(int), axis=1) <= 0).all()  # right padding
    np.testing.assert_array_equal(make_batch(7, DENSE, 6, 20, 0.3)["tokens"], tokens)  # deterministic
    make_batch(jax.random.key(3), DENSE, 2, 8)


def test_cross_entropy_masked():
    logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
    loss = cross_entropy(logits, jnp.array([[0, 0]]), jnp.array([[True, False]]))
    np.testing.assert_allclose(loss, np.log(2), rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_cross_entropy_scores_position_t_against_label_t_plus_k(k):
    rng = np.random.default_rng(k)
    b, t, v = 3, 9, 7
    logits = rng.normal(size=(b, t, v)).astype(np.float32) * 3
    labels = rng.integers(0, v, size=(b, t))
    mask = np.arange(t)[None, :] < np.array([[9], [6], [2]])
    got = mtp_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask), k)
    nll = []   # NumPy: every t with t and t + k valid, against labels[t + k]
    for i in range(b):
        for j in range(t - k):
            if mask[i, j] and mask[i, j + k]:
                z = logits[i, j].astype(np.float64)
                nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[labels[i, j + k]])
    np.testing.assert_allclose(got, np.mean(nll) if nll else 0.0, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_training_reduces_loss(cfg):
    params = init_params(cfg, jax.random.key(0))
    tx = optax.adam(5e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        (loss, inter), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss, inter

    losses = []
    for i in range(40):
        params, opt, loss, inter = step(params, opt, make_batch(i, cfg, 8, 24, 0.2))
        losses.append(float(loss))
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses
    if cfg.moe:
        counts = np.asarray(inter["layers"]["moe"]["expert_counts"][0])
        assert counts.shape == (cfg.n_layers, cfg.n_experts)


@pytest.mark.slow
def test_expert_counts_and_bias_update():
    b = make_batch(0, MOE, 4, 12, pad_fraction=0.3)
    params = init_params(MOE, jax.random.key(0))
    apply = jax.jit(lambda p: Decoder(MOE).apply({"params": p}, b["tokens"], mask=b["mask"],
                                                 mutable=["intermediates"]))
    logits, sown = apply(params)
    inter = sown["intermediates"]
    (counts,) = inter["layers"]["moe"]["expert_counts"]
    n_valid = int(np.asarray(b["mask"]).sum())
    np.testing.assert_array_equal(np.asarray(counts).sum(-1), [n_valid * MOE.top_k] * MOE.n_layers)
    assert len(inter["mtp_logits"]) == MOE.n_mtp and logits.shape == (4, 12, MOE.vocab)
    new = update_expert_bias(params, inter, rate=0.1)
    c = np.asarray(counts, np.float64)
    np.testing.assert_allclose(new["layers"]["moe"]["expert_bias"],
                               0.1 * np.sign(c.mean(-1, keepdims=True) - c), rtol=1e-6)
    again = update_expert_bias(params, counts, rate=0.1)
    np.testing.assert_allclose(again["layers"]["moe"]["expert_bias"], new["layers"]["moe"]["expert_bias"])
    with pytest.raises(ValueError, match="not an MoE model"):
        update_expert_bias(jax.eval_shape(lambda: init_params(DENSE, jax.random.key(0))), counts, 0.1)
    # The bias steers selection: a large bias on expert 0 routes every token there.
    biased = jax.tree.map(lambda x: x, params)
    biased["layers"]["moe"]["expert_bias"] = jnp.array([[100.0, 0, 0, 0]] * MOE.n_layers)
    _, sown = apply(biased)
    assert (np.asarray(sown["intermediates"]["layers"]["moe"]["expert_counts"][0])[:, 0] == n_valid).all()


@pytest.mark.slow
def test_mtp_return_and_padding_invariance():
    cfg = dataclasses.replace(MOE, scan_layers=False)
    params = init_params(cfg, jax.random.key(2))
    b = make_batch(1, cfg, 2, 10, pad_fraction=0.3)
    apply = jax.jit(lambda t: Decoder(cfg).apply({"params": params}, t, mask=b["mask"], return_mtp=True))
    logits, mtp = apply(b["tokens"])
    assert len(mtp) == 2 and all(m.shape == logits.shape for m in mtp)
    # Changing padded tokens does not change valid positions' main logits.
    logits2, _ = apply(jnp.where(b["mask"], b["tokens"], 5))
    m = np.asarray(b["mask"])
    np.testing.assert_allclose(np.asarray(logits)[m], np.asarray(logits2)[m], rtol=1e-5, atol=1e-6)
