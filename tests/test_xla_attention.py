"""attention_with_summary: jax.nn.dot_product_attention's XLA computation run by jvitals (what
instrument(attn_logits=True) runs in its place) gives jax's output and gradients, and the
summary of its valid scores equals NumPy's on scores built by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvitals.metrics.xla_attention import attention_with_summary

B, T, H = 2, 8, 8


def _inputs(n, k, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, kk, v = (jnp.asarray(rng.normal(size=(B, T, m, H)) * 2, dtype) for m in (n, k, k))
    return q, kk, v


def _np_scores(q, k, scale):
    q = np.asarray(q, np.float64)
    k = np.repeat(np.asarray(k, np.float64), q.shape[2] // k.shape[2], axis=2)
    return np.einsum("bqhd,bkhd->bhqk", q, k) * scale


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "mask": dict(mask="full"),
    "mask_one_head": dict(mask="one", is_causal=True),
    "bias": dict(bias=True),
    "lengths": dict(is_causal=True, query_seq_lengths=[8, 5], key_value_seq_lengths=[8, 6]),
    "window": dict(is_causal=True, local_window_size=(2, 0)),
    "window_int": dict(local_window_size=1, scale=0.3),
}


def _kwargs(case, n, rng):
    kw = dict(CASES[case])
    if kw.get("mask") == "full":
        kw["mask"] = jnp.asarray(rng.random((B, n, T, T)) < 0.7)
    elif kw.get("mask") == "one":
        kw["mask"] = jnp.asarray(np.arange(T)[None, None, None, :] < np.array([8, 5])[:, None, None, None])
        kw["mask"] = jnp.broadcast_to(kw["mask"], (B, 1, T, T))
    if kw.pop("bias", False):
        kw["bias"] = jnp.asarray(rng.normal(size=(B, n, T, T)), jnp.float32)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    return kw


def _np_valid(kw, n):
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = np.ones((B, n, T, T), bool)
    if kw.get("mask") is not None:
        ok &= np.broadcast_to(np.asarray(kw["mask"]), ok.shape)
    if kw.get("is_causal"):
        ok &= j <= i
    w = kw.get("local_window_size")
    if w is not None:
        left, right = (w, w) if isinstance(w, int) else w
        ok &= (i <= j + left) & (i >= j - right)
    if kw.get("query_seq_lengths") is not None:
        ok &= i[None, None] < np.asarray(kw["query_seq_lengths"])[:, None, None, None]
    if kw.get("key_value_seq_lengths") is not None:
        ok &= j[None, None] < np.asarray(kw["key_value_seq_lengths"])[:, None, None, None]
    return ok


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_output_gradients_and_summary_match_jax_and_numpy(case, heads):
    n, k = heads
    q, kk, v = _inputs(n, k)
    kw = _kwargs(case, n, np.random.default_rng(1))
    want = jax.nn.dot_product_attention(q, kk, v, **kw)
    got, summary = attention_with_summary(q, kk, v, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    cot = jnp.asarray(np.random.default_rng(2).normal(size=want.shape), jnp.float32)
    g_want = jax.grad(lambda a: jnp.sum(jax.nn.dot_product_attention(*a, **kw) * cot))((q, kk, v))
    g_got = jax.grad(lambda a: jnp.sum(attention_with_summary(*a, **kw)[0] * cot))((q, kk, v))
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

    s = _np_scores(q, kk, kw.get("scale", 1 / np.sqrt(H)))
    if kw.get("bias") is not None:
        s = s + np.asarray(kw["bias"], np.float64)
    ok = _np_valid(kw, n)
    count = ok.sum(axis=(1, 3))
    amax = np.where(ok, np.abs(s), -1.0).max(axis=(1, 3))
    np.testing.assert_array_equal(np.asarray(summary.count), count)
    np.testing.assert_allclose(np.asarray(summary.abs_max)[count > 0], amax[count > 0], rtol=1e-5)
    assert np.isnan(np.asarray(summary.abs_max)[count == 0]).all()
    np.testing.assert_array_equal(np.asarray(summary.nonfinite), 0)
    assert np.isnan(np.asarray(summary.sum)).all() and np.isnan(np.asarray(summary.sumsq)).all()


def test_a_bias_that_masks_leaves_its_keys_out_of_the_summary():
    """HF-Flax's convention: finfo.min added where a key is masked; those keys are not scores."""
    q, kk, v = _inputs(4, 4)
    big_key = np.zeros((B, 1, T, T), np.float32)
    big_key[..., -1] = np.finfo(np.float32).min
    got, summary = attention_with_summary(q, kk, v, bias=jnp.asarray(big_key))
    want = jax.nn.dot_product_attention(q, kk, v, bias=jnp.asarray(big_key))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    s = _np_scores(q, kk, 1 / np.sqrt(H))[..., :-1]
    np.testing.assert_allclose(np.asarray(summary.abs_max), np.abs(s).max(axis=(1, 3)), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(summary.count), 4 * (T - 1))


def test_unbatched_and_bfloat16():
    q, kk, v = _inputs(4, 2, jnp.bfloat16)
    want = jax.nn.dot_product_attention(q[0], kk[0], v[0], is_causal=True)
    got, summary = attention_with_summary(q[0], kk[0], v[0], is_causal=True)
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    s = _np_scores(q[:1], kk[:1], 1 / np.sqrt(H))[0]
    causal = np.tril(np.ones((T, T), bool))
    want_max = np.where(causal[None], np.abs(s), -1.0).max(axis=(0, 2))
    assert summary.abs_max.shape == (T,)
    np.testing.assert_allclose(np.asarray(summary.abs_max), want_max, rtol=1e-5)


def test_non_finite_scores_are_counted_by_head_and_poison_the_token():
    """A NaN or Inf query makes its heads' rows non-finite: ``nonfinite`` counts those rows,
    ``abs_max`` of the token is NaN; a NaN in a key that is masked counts nowhere."""
    q, kk, v = _inputs(4, 4)
    q = q.at[0, 3, 1, 0].set(jnp.nan).at[1, 2, 0, 0].set(jnp.inf).at[1, 2, 2, 0].set(jnp.inf)
    kk = kk.at[0, 7, 0, 0].set(jnp.nan)       # key 7 of head 0: above the diagonal of every query but the last
    _, summary = attention_with_summary(q, kk, v, is_causal=True)
    bad = np.zeros((B, T))
    bad[0, 3], bad[1, 2], bad[0, 7] = 1, 2, 1  # query 7 attends to key 7: its head 0
    np.testing.assert_array_equal(np.asarray(summary.nonfinite), bad)
    am = np.asarray(summary.abs_max)
    assert np.isnan(am[bad > 0]).all() and np.isfinite(am[bad == 0]).all()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_flax_weights_summary_from_the_softmax_input_matches_numpy(dtype):
    """Under instrument(attn_logits=True), flax's dot_product_attention_weights (Linen's) hands
    jax.nn.softmax its masked scores; the summary taken from them is NumPy's max |q.k / sqrt(H) +
    bias| over the valid pairs, keys masked by the mask or by a finfo.min bias left out, and the
    weights are flax's own."""
    import flax.linen as nn

    import jvitals as vitals

    rng = np.random.default_rng(3)
    q, kk = (jnp.asarray(rng.normal(size=(B, T, 4, H)) * 2, dtype) for _ in range(2))
    mask = np.tril(np.ones((T, T), bool))[None, None] & (np.arange(T) < np.array([[8], [6]]))[:, None, None, :]
    bias = np.where(np.arange(T) == 2, np.finfo(np.float32).min, 0.0).astype(np.float32)
    bias = jnp.asarray(np.broadcast_to(bias, (B, 1, T, T)), dtype)

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, q, k):
            return nn.dot_product_attention_weights(q, k, bias=bias, mask=jnp.asarray(mask))

    want = Attn().apply({}, q, kk)
    with vitals.instrument(attn_logits=True):
        got, state = Attn().apply({}, q, kk, mutable=["intermediates"])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6)
    (summary,) = state["intermediates"]["attn_logits"]
    qs = np.asarray(q / jnp.sqrt(H).astype(dtype), np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", qs, np.asarray(kk, np.float64))
    ok = np.broadcast_to(mask & (np.arange(T) != 2), s.shape)
    np.testing.assert_array_equal(np.asarray(summary.count), ok.sum(axis=(1, 3)))
    want_max = np.where(ok, np.abs(s), -1.0).max(axis=(1, 3))
    rtol = 1e-5 if dtype == np.float32 else 2e-2      # bf16: the model's own bf16 scores
    np.testing.assert_allclose(np.asarray(summary.abs_max), want_max, rtol=rtol)
    np.testing.assert_array_equal(np.asarray(summary.nonfinite), 0)


def test_softmax_input_summary_rows_without_a_key_and_non_finite_rows():
    from jvitals.metrics.xla_attention import softmax_input_summary

    x = np.random.default_rng(4).normal(size=(2, 3, 4, 5)).astype(np.float32) * 3
    ok = np.ones((2, 1, 4, 5), bool)
    ok[0, 0, 1] = False                              # query 1 of batch 0: no key
    x = np.where(ok, x, np.finfo(np.float32).min)
    x[1, 2, 3, 0] = np.nan                           # one head of query 3, batch 1
    x[1, 0, 3, 4] = -np.inf                          # another head of it
    got = softmax_input_summary(jnp.asarray(x), jnp.asarray(ok))
    okb = np.broadcast_to(ok, x.shape)
    np.testing.assert_array_equal(np.asarray(got.count), okb.sum(axis=(1, 3)))
    np.testing.assert_array_equal(np.asarray(got.nonfinite), [[0, 0, 0, 0], [0, 0, 0, 2]])
    am = np.asarray(got.abs_max)
    want = np.where(okb, np.abs(x), -1.0).max(axis=(1, 3))
    assert np.isnan(am[0, 1]) and np.isnan(am[1, 3])  # no valid pair; a non-finite one
    keep = np.ones((2, 4), bool)
    keep[0, 1] = keep[1, 3] = False
    np.testing.assert_allclose(am[keep], want[keep], rtol=1e-6)
