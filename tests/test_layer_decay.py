"""Tests of jvitals.layer_decay: the LLRD factor of every leaf, from hand-written tables."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jvitals.optim.layer_decay import layer_decay_factors, layerwise_lr_decay
from jvitals.reference_model import ModelConfig, init_params
from jvitals.metrics.paths import path_str

import hf_trees

D_ = 0.9


def _table_factor(table, path, shape):
    """The expected factor of ``path`` from ``table``: ``[(regex, factor or (axis, [per-layer]))]``."""
    for rx, want in table:
        if re.search(rx, path):
            if isinstance(want, tuple):
                axis, per = want
                b = [1] * len(shape)
                b[axis] = len(per)
                return np.broadcast_to(np.asarray(per, np.float64).reshape(b), shape)
            return np.full(shape, want, np.float64)
    raise AssertionError(f"no table row for {path}")


# N = 3 layers, decay 0.9: layer i -> 0.9 ** (2 - i); embedding 0.9 ** 3; head, final norm 1.
DENSE = [(r"^embed/", 0.729), (r"^layers_0/", 0.81), (r"^layers_1/", 0.9), (r"^layers_2/", 1.0),
         (r"^final_layernorm/", 1.0), (r"^lm_head/", 1.0)]
SCAN = [(r"^embed/", 0.729), (r"^layers/", (0, [0.81, 0.9, 1.0])),
        (r"^final_layernorm/", 1.0), (r"^lm_head/", 1.0)]
GPT2 = [(r"/wte/", 0.729), (r"/wpe/", 0.729), (r"/h/0/", 0.81), (r"/h/1/", 0.9), (r"/h/2/", 1.0),
        (r"/ln_f/", 1.0)]
LLAMA = [(r"/embed_tokens/", 0.729), (r"/layers/0/", 0.81), (r"/layers/1/", 0.9), (r"/layers/2/", 1.0),
         (r"^model/norm/", 1.0), (r"^lm_head/", 1.0)]
MAXTEXT = [(r"/token_embedder/", 0.729), (r"/decoder/layers/", (1, [0.81, 0.9, 1.0])),
           (r"/decoder_norm/", 1.0), (r"/logits_dense/", 1.0)]


def _shapes(cfg):
    """The reference model's parameter shapes (no compile, no device work)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _trees():
    dense = _shapes(ModelConfig(n_layers=3))
    scan = _shapes(ModelConfig(n_layers=3, scan_layers=True, moe=True))
    return [("dense fused-QKV", dense, DENSE), ("nn.scan MoE", scan, SCAN), ("HF GPT-2", hf_trees.gpt2(), GPT2),
            ("HF Llama", hf_trees.llama(), LLAMA), ("MaxText scan axis 1", hf_trees.maxtext(), MAXTEXT)]


@pytest.mark.parametrize("name,params,table", _trees(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_leaf_gets_its_table_factor(name, params, table):
    tx = layerwise_lr_decay(D_)
    state = tx.init(params)
    got, _ = jax.jit(lambda s: tx.update(jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params), s))(state)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    assert len(flat) == len(jax.tree.leaves(params))
    for p, g in flat:
        path = path_str(p)
        np.testing.assert_allclose(np.asarray(g), _table_factor(table, path, g.shape), rtol=1e-6,
                                   err_msg=f"{name}: {path}")
    # The same factors, as layer_decay_factors reports them.
    for (p, x), f in zip(jax.tree_util.tree_flatten_with_path(params)[0], layer_decay_factors(params, D_)):
        np.testing.assert_allclose(np.broadcast_to(f, x.shape), _table_factor(table, path_str(p), x.shape),
                                   rtol=1e-6)


def test_after_adam_scales_each_layers_updates():
    params = hf_trees.maxtext()
    grads = jax.tree.map(lambda x: np.cos(3 * x) + 0.1, params)
    tx = optax.chain(optax.adam(1e-2), layerwise_lr_decay(D_))
    ref = optax.adam(1e-2)

    @jax.jit
    def run(params, grads):
        s, r = tx.init(params), ref.init(params)
        for _ in range(3):
            got, s = tx.update(grads, s, params)
            want, r = ref.update(grads, r, params)
        return got, want

    got, want = run(params, grads)
    for (p, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        f = _table_factor(MAXTEXT, path_str(p), g.shape)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w) * f, rtol=1e-6, atol=1e-12)


def test_bf16_updates_keep_their_dtype():
    params = _shapes(ModelConfig(n_layers=2, param_dtype=jnp.bfloat16))
    out, _ = jax.jit(lambda: layerwise_lr_decay(0.5).update(
        jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params), optax.EmptyState()))()
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
    assert float(out["embed"]["embedding"][0, 0]) == 0.25 and float(out["layers_0"]["attn"]["qkv"]["kernel"][0, 0]) == 0.5


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, float("nan"), True, "0.9", None])
def test_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ValueError, match=r"decay=.*\(0, 1\]"):
        layerwise_lr_decay(decay)


def test_a_tree_without_layers_is_refused():
    with pytest.raises(ValueError, match="no parameter lies in a layer"):
        layerwise_lr_decay(0.9).init({"w": jnp.ones((3, 3))})


def test_decay_one_is_the_identity():
    params = hf_trees.llama()
    g = jax.tree.map(lambda x: x * 3.0, params)
    out, _ = layerwise_lr_decay(1.0).update(g, optax.EmptyState())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), out, g)
