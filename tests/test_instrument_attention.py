"""instrument(attn_logits=True) on attention that is not flax.linen's: Flax NNX's
MultiHeadAttention (which calls jax.nn.dot_product_attention without dropout) and a module
calling jax.nn.dot_product_attention itself (causal, grouped K/V heads, key lengths, a
local window). Every figure against NumPy scores built from the modules' own projections."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jvitals as vitals


def _np_max_abs(s, valid, token_valid):
    """max |s| over valid (query, key) pairs of valid query tokens; s, valid: [B, H, T, S]."""
    v = valid & token_valid[:, None, :, None]
    return float(np.abs(np.where(v, s, 0.0)).max())


class _Block(nnx.Module):
    def __init__(self, d, rngs):
        self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)
        self.self_attn = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)

    def __call__(self, x, mask):
        return x + self.self_attn(self.input_layernorm(x), mask=mask)


class _LM(nnx.Module):
    def __init__(self, vocab, d, n_layers, rngs):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([_Block(d, rngs) for _ in range(n_layers)])
        self.lm_head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, valid):
        mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(x)


@pytest.mark.slow
def test_nnx_multi_head_attention_under_nnx_jit_matches_numpy():
    model = _LM(vocab=32, d=16, n_layers=2, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 8)))
    valid = jnp.asarray(np.arange(8)[None, :] < np.array([[8], [5]]))

    @nnx.jit
    def run(model):
        with vitals.instrument(attn_logits=True):
            _, sown = nnx.capture(lambda m: m(tokens, valid), nnx.Intermediate)(model)
        return vitals.activation_metrics(sown, mask=valid, names=("attn_logits",))

    got = run(model)
    # NumPy: each layer's scores from its own query/key projections, run by hand.
    mask = np.asarray(nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid)))
    x = model.embed_tokens(tokens)
    want = []
    for layer in model.layers:
        h = layer.input_layernorm(x)
        q, k = (np.asarray(p(h), np.float64) for p in (layer.self_attn.query, layer.self_attn.key))
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        want.append(_np_max_abs(s, mask.astype(bool), np.asarray(valid)))
        x = layer(x, jnp.asarray(mask))
    for i, w in enumerate(want):
        np.testing.assert_allclose(float(got[f"act/attn_logits_abs.max/layer_{i}"]), w, rtol=1e-4)
    np.testing.assert_allclose(float(got["act/attn_logits_abs.max"]), max(want), rtol=1e-4)


class _JaxAttention(nnx.Module):
    """A block calling jax.nn.dot_product_attention itself: 4 query heads, 2 K/V heads."""

    def __init__(self, d, rngs, **attn):
        self.q_proj = nnx.Linear(d, 4 * 8, rngs=rngs)
        self.k_proj = nnx.Linear(d, 2 * 8, rngs=rngs)
        self.v_proj = nnx.Linear(d, 2 * 8, rngs=rngs)
        self.attn = attn

    def __call__(self, x, lengths):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, 4, 8)
        k = self.k_proj(x).reshape(b, t, 2, 8)
        v = self.v_proj(x).reshape(b, t, 2, 8)
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, **self.attn).reshape(b, t, -1)


@pytest.mark.parametrize("attn", [dict(is_causal=True), dict(is_causal=True, local_window_size=(2, 0)),
                                  dict(scale=0.5)])
def test_a_module_calling_jax_nn_dot_product_attention(attn):
    mod = _JaxAttention(16, nnx.Rngs(1), **attn)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 16)).astype(np.float32))
    lengths = jnp.asarray([8, 6], jnp.int32)

    with vitals.instrument(attn_logits=True):
        out, sown = nnx.capture(lambda m: m(x, lengths), nnx.Intermediate)(mod)
    np.testing.assert_allclose(np.asarray(out), np.asarray(mod(x, lengths)), rtol=1e-5, atol=1e-6)  # the output kept
    got = vitals.activation_metrics(sown, names=("attn_logits",))
    q = np.asarray(mod.q_proj(x), np.float64).reshape(2, 8, 4, 8)
    k = np.repeat(np.asarray(mod.k_proj(x), np.float64).reshape(2, 8, 2, 8), 2, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * attn.get("scale", 1 / np.sqrt(8))
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    ok = np.ones((8, 8), bool)
    if attn.get("is_causal"):
        ok &= j <= i
    if "local_window_size" in attn:
        left, right = attn["local_window_size"]
        ok &= (j >= i - left) & (j <= i + right)
    valid = ok[None, None] & (j[None, None] < np.asarray(lengths)[:, None, None, None])
    want = _np_max_abs(s, np.broadcast_to(valid, s.shape), np.ones((2, 8), bool))
    np.testing.assert_allclose(float(got["act/attn_logits_abs.max"]), want, rtol=1e-4)


def test_the_patch_is_undone_on_exit():
    import flax.nnx.nn.attention as nxa
    before = (jax.nn.dot_product_attention, nxa.dot_product_attention_weights)
    with vitals.instrument(attn_logits=True):
        assert jax.nn.dot_product_attention is not before[0]
    assert (jax.nn.dot_product_attention, nxa.dot_product_attention_weights) == before


@pytest.mark.parametrize("mistake, match", [
    (dict(heads=3), "multiple of key/value heads"),
    (dict(mask=jnp.ones((2, 1, 8, 8), jnp.float32)), "mask dtype should be bool"),
    (dict(value_dtype=jnp.bfloat16), "value dtype should be"),
])
def test_a_mistaken_call_to_jax_attention_reads_as_jax_words_it(mistake, match):
    """Under instrument(attn_logits=True) jvitals runs jax.nn.dot_product_attention's XLA
    computation itself; a call jax refuses is refused with jax's own message, not a reshape
    error from inside jvitals."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 8, mistake.get("heads", 4), 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 8, 2, 8)), jnp.float32)
    v = k.astype(mistake.get("value_dtype", jnp.float32))
    with pytest.raises(ValueError, match=match):
        jax.nn.dot_product_attention(q, k, v, mask=mistake.get("mask"))

    class M(nnx.Module):
        def __call__(self, q, k, v):
            return jax.nn.dot_product_attention(q, k, v, mask=mistake.get("mask"))

    with vitals.instrument(attn_logits=True):
        with pytest.raises(ValueError, match=match):
            nnx.capture(lambda m: m(q, k, v), nnx.Intermediate)(M())


@pytest.mark.parametrize("attn", [dict(is_causal=True, local_window_size=(2, 0)),
                                  dict(query_seq_lengths=[8, 5], key_value_seq_lengths=[6, 8]),
                                  dict(unbatched=True, is_causal=True, local_window_size=1)])
def test_a_call_jvitals_does_not_run_itself_is_summarised_alike(attn):
    """``return_residual=True`` (as cuDNN, jax's own call, not run by jvitals): the scores are
    recomputed beside it, and their summary is the one the XLA path gives (checked against NumPy
    above), with the same masks."""
    attn = dict(attn)
    unbatched = attn.pop("unbatched", False)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in attn:
            attn[name] = jnp.asarray(attn[name], jnp.int32)
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, n, 8)) * 2, jnp.float32) for n in (4, 2, 2))
    if unbatched:
        q, k, v = q[0], k[0], v[0]

    class M(nnx.Module):
        def __init__(self, **kw):
            self.kw = kw

        def __call__(self, q, k, v):
            return jax.nn.dot_product_attention(q, k, v, **attn, **self.kw)

    got = {}
    for residual in (False, True):
        with vitals.instrument(attn_logits=True):
            out, sown = nnx.capture(lambda m: m(q, k, v), nnx.Intermediate)(M(return_residual=residual))
        got[residual] = vitals.activation_metrics(sown, names=("attn_logits",))
        if residual:
            assert isinstance(out, tuple)
    np.testing.assert_allclose(float(got[True]["act/attn_logits_abs.max"]),
                               float(got[False]["act/attn_logits_abs.max"]), rtol=1e-5)
