"""Probes: compact sown summaries equal the raw-tensor path."""

from __future__ import annotations

import flax.linen as nn
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from jvitals.metrics import probes
from jvitals.metrics.activations import activation_metrics
from jvitals.metrics.stats import summarize


class _Probed(nn.Module):
    """Sows every probe and the raw tensor it summarises (under another name)."""

    @nn.compact
    def __call__(self, x, logits, scores, mask):
        probes.sow_summary(self, "hidden_states", x, mask)
        self.sow("raw", "hidden_states", x)
        probes.logits_probe(self, logits, mask)
        self.sow("raw", "logits", logits)
        probes.attn_logits_probe(self, scores, mask)
        self.sow("raw", "attn_logits", scores)
        return x


def _data(seed=0, b=4, t=6, v=16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, 8)).astype(np.float32)
    logits = rng.integers(0, 5, size=(b, t, v)).astype(np.float32)  # ties on purpose
    scores = rng.normal(size=(b, 2, t, t)).astype(np.float32) * 3
    mask = np.ones((b, t), bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    x[~mask] = 1e30
    logits[~mask] = 1e30
    return jnp.asarray(x), jnp.asarray(logits), jnp.asarray(scores), jnp.asarray(mask)


def test_probes_equal_raw_tensors():
    x, logits, scores, mask = _data()
    _, sown = _Probed().apply({}, x, logits, scores, mask, mutable=["intermediates", "raw"])
    metrics = jax.jit(lambda t, m: activation_metrics(t, mask=m))
    probe = metrics(sown["intermediates"], mask)
    raw = metrics(sown["raw"], mask)
    assert set(probe) == set(raw)
    for k in raw:
        np.testing.assert_allclose(probe[k], raw[k], rtol=1e-6, err_msg=k)
    assert 0 < float(raw["act/output_layer_logits_top2_equal_ratio"]) < 1
    assert float(raw["act/hidden_states_abs.max"]) < 1e6


def test_sow_summary_is_summarize():
    x, _, _, mask = _data()
    _, sown = _Probed().apply({}, *_data(), mutable=["intermediates", "raw"])
    (s,) = sown["intermediates"]["hidden_states"]
    ref = summarize(x, mask)
    for f in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
        np.testing.assert_allclose(getattr(s, f), getattr(ref, f), rtol=1e-6, err_msg=f)


def test_logits_summary_against_numpy():
    _, logits, _, mask = _data(3)
    ls = probes.summarize_logits(logits, mask)
    x = np.asarray(logits, np.float64)[np.asarray(mask)]
    srt = np.sort(x, -1)
    lse = srt[:, -1] + np.log(np.exp(x - srt[:, -1:]).sum(-1))
    np.testing.assert_allclose(ls.logits.rms, np.sqrt(np.mean(x ** 2)), rtol=1e-6)
    np.testing.assert_allclose(ls.top2_diff.mean, np.mean(srt[:, -1] - srt[:, -2]), rtol=1e-6)
    np.testing.assert_allclose(ls.top2_tie.mean, np.mean(srt[:, -1] == srt[:, -2]), rtol=1e-6)
    np.testing.assert_allclose(ls.lse.mean, lse.mean(), rtol=1e-6)
    np.testing.assert_allclose(ls.lse_max, lse.max(), rtol=1e-6)
    assert ls.argmax.shape == mask.shape and ls.argmax.dtype == jnp.int32
    chunked = probes.summarize_logits(logits, mask, chunk_elements=3 * 16)  # 8 chunks of 3 rows
    whole = probes.summarize_logits(logits, mask, chunk_elements=0)  # one pass
    for a, b, c in zip(jax.tree.leaves(chunked), jax.tree.leaves(ls), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(c, b, rtol=1e-6)
    assert probes._chunk_rows(1024, 2048, None) == 1024  # one pass unless chunks are asked for
    assert probes._chunk_rows(8, 512, 0) == 8 and probes._chunk_rows(4096, 4096, 1 << 20) == 256
    with pytest.raises(ValueError, match=r"mask must have their leading shape \(4, 6\), got \(4, 5\)"):
        probes.summarize_logits(logits, mask[:, :5])


def test_logits_summary_ties_and_argmax_against_top_k():
    """Coarse logits (many ties): argmax is NumPy's first index, top-2 is lax.top_k's."""
    for v in (9, 384):  # XLA:CPU reduces 384-wide rows through YNNPACK, 9-wide ones not
        _ties_and_argmax(v)


def _ties_and_argmax(v):
    rng = np.random.default_rng(11)
    logits = np.round(rng.normal(size=(4, 6, v)), 0).astype(np.float32)
    mask = rng.random((4, 6)) > 0.2
    ls = probes.summarize_logits(jnp.asarray(logits), jnp.asarray(mask))
    np.testing.assert_array_equal(ls.argmax, np.argmax(logits, -1))
    top = np.asarray(jax.lax.top_k(jnp.asarray(logits), 2)[0])[mask]
    assert np.any(top[:, 0] == top[:, 1])  # ties do occur here
    np.testing.assert_allclose(ls.top2_diff.mean, np.mean(top[:, 0] - top[:, 1]), rtol=1e-6)
    np.testing.assert_allclose(ls.top2_tie.mean, np.mean(top[:, 0] == top[:, 1]), rtol=1e-6)
    # A NaN in a masked-out position: the same figures for the valid ones.
    poisoned = logits.copy()
    poisoned[~mask] = np.nan
    for chunk in (None, v * 6):  # the default, and chunks of 6 positions
        poisoned_ls = probes.summarize_logits(jnp.asarray(poisoned), jnp.asarray(mask), chunk_elements=chunk)
        np.testing.assert_array_equal(np.asarray(poisoned_ls.argmax)[mask], np.asarray(ls.argmax)[mask])
        for a, b in zip(jax.tree.leaves(poisoned_ls.replace(argmax=ls.argmax)), jax.tree.leaves(ls)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert probes._chunk_rows(24, v, v * 6) == 6


def test_logits_summary_nonfinite_is_nan():
    logits = jnp.zeros((1, 3, 4)).at[0, 1, 2].set(jnp.nan)
    ls = probes.summarize_logits(logits)
    assert int(ls.logits.nonfinite) == 1
    for v in (ls.logits.rms, ls.top2_diff.mean, ls.top2_tie.mean, ls.lse.mean, ls.lse_max):
        assert np.isnan(v)
    # ... unless the position is masked out.
    ls = probes.summarize_logits(logits, jnp.array([[True, False, True]]))
    assert float(ls.top2_tie.mean) == 1.0 and np.isfinite(ls.lse_max)


def test_logits_summary_of_nonfinite_rows_against_numpy():
    """+inf, -inf, a row of -inf and NaN: per-row figures as NumPy and jax.nn.logsumexp give them;
    ``nonfinite`` counts the rows holding a NaN or an infinity, and a row holding a NaN has
    argmax -1 and NaN top-1 / top-2."""
    rng = np.random.default_rng(5)
    b, t, v = 3, 8, 384  # wide enough for XLA:CPU's YNNPACK reductions, whose max drops NaN
    logits = rng.normal(size=(b, t, v)).astype(np.float32)
    logits[0, 1, 300] = np.inf                      # +inf: argmax 300, lse +inf
    logits[0, 2, [200, 9]] = np.inf                 # two +inf: the first one
    logits[0, 3, 5] = -np.inf                       # -inf: finite lse, one non-finite
    logits[1, 0, :] = -np.inf                       # a row of -inf: lse -inf
    logits[1, 4, [250, 270]] = np.nan               # NaN: argmax -1 ...
    logits[1, 4, 3] = 50.0                          # ... even with a larger value
    logits[1, 5, 130] = 50.0                        # a tie, far apart: top2 == top1
    logits[1, 5, 383] = 50.0
    logits[2, 5, [1, 6]] = [np.inf, np.nan]
    logits[2, 6, 0] = np.nan                        # NaN, masked out: counts nowhere
    mask = np.ones((b, t), bool)
    mask[2, 6] = False
    ref_lse = np.asarray(jax.nn.logsumexp(jnp.asarray(logits), axis=-1))
    valid_x = logits[mask]
    has_nan = np.isnan(logits).any(-1)
    ref_argmax = np.where(has_nan, -1, np.argmax(logits, -1))
    for chunk in (None, 0, 2 * v):  # the default, one pass, chunks of two positions
        ls = probes.summarize_logits(jnp.asarray(logits), jnp.asarray(mask), chunk_elements=chunk)
        np.testing.assert_array_equal(ls.argmax, ref_argmax)
        assert float(ls.logits.nonfinite) == np.sum(~np.isfinite(valid_x).all(-1)) == 6
        assert float(ls.lse.nonfinite) == np.sum(~np.isfinite(ref_lse[mask])) == 5
        assert float(ls.lse.count) == mask.sum()
        assert np.isnan(ls.lse_max) and np.isnan(ls.logits.rms) and np.isnan(ls.logits.abs_max)
        # Per row: top-1 minus top-2 is finite exactly where NumPy's is.
        srt = np.sort(valid_x, -1)   # NumPy sorts NaN last: a NaN row's difference is NaN
        with np.errstate(invalid="ignore"):
            diff = srt[:, -1] - srt[:, -2]
        assert float(ls.top2_diff.nonfinite) == np.sum(~np.isfinite(diff))
    # The per-row reductions themselves, row by row.
    rows = jnp.asarray(logits.reshape(-1, v))
    top1, top2, lse, r_sum, r_sumsq, r_amax, r_bad, argmax = map(np.asarray, probes._row_stats(rows))
    x = logits.reshape(-1, v)
    np.testing.assert_array_equal(argmax, ref_argmax.reshape(-1))
    np.testing.assert_array_equal(r_bad, ~np.isfinite(x).all(-1))
    np.testing.assert_array_equal(top1, np.max(x, -1))   # NumPy's max is NaN with a NaN
    np.testing.assert_allclose(lse, ref_lse.reshape(-1), rtol=1e-6)
    no_nan = ~np.isnan(x).any(-1)
    np.testing.assert_array_equal(top2[no_nan], np.sort(x, -1)[no_nan, -2])
    finite = np.isfinite(x).all(-1)
    np.testing.assert_allclose(r_sum[finite], x[finite].sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r_sumsq[finite], (x[finite] ** 2).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(r_amax[finite], np.abs(x[finite]).max(-1))


def test_logits_statistics_and_argmax_take_no_loop_and_no_conditional():
    """The argmax alone (the raw MTP logits of the sow path) and the row statistics are
    plain reductions with no loop and no conditional (their one read on the TPU:
    tests/test_tpu_cost.py): the first maximum's column where the row holds no NaN (NumPy's,
    ties and infinities too) and -1 where it does, the same from either."""
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(4, 16, 512)).astype(np.float32)
    logits[0, 3, [7, 300]] = [np.nan, 9.0]   # a NaN before the maximum
    logits[1, 2, [5, 400]] = [9.0, np.nan]   # a NaN after it
    logits[2, 1, [8, 9]] = 9.0               # a tie: the first index
    logits[3, 5, [200, 40, 90]] = np.nan     # three NaNs
    logits[3, 6, [1, 511]] = [np.inf, np.nan]
    logits[3, 7, [2, 3, 4]] = [-np.inf, np.inf, np.inf]   # +inf twice beside -inf: the first +inf
    logits[2, 9, :] = -np.inf                # a row of -inf: its first column
    x = jnp.asarray(logits)
    want = np.where(np.isnan(logits).any(-1), -1, np.argmax(logits, -1))
    arg = jax.jit(probes.row_argmax)
    hlo = arg.lower(x).compile().as_text()
    assert " while(" not in hlo and " conditional(" not in hlo
    got = arg(x)
    assert got.dtype == jnp.int32 and got.shape == (4, 16)
    np.testing.assert_array_equal(got, want)
    for chunk in (None, 0, 2 * 512):
        full = probes.summarize_logits(x, chunk_elements=chunk)
        np.testing.assert_array_equal(full.argmax, want)
    text = jax.jit(probes.summarize_logits).lower(x).compile().as_text()
    assert " while(" not in text and " conditional(" not in text


@pytest.mark.slow
def test_rows_past_2_23_columns():
    """Rows wider than 2^23: the argmax near the row's end, after a tie, is NumPy's (a
    float32 column index is exact to 2^24); a row holding a NaN has -1, from the row
    statistics and from ``row_argmax`` alike."""
    v = (1 << 23) + 3
    x = np.random.default_rng(12).normal(size=(3, v)).astype(np.float32)
    x[0, [5, v - 2]] = [np.nan, 9.0]   # the first NaN, before a larger value
    x[1, [v - 7, v - 1]] = 9.0         # a tie near the end: the first of the two
    x[2, v - 1] = 9.0                  # the last column
    _, top2, *_, argmax = probes._row_stats(jnp.asarray(x))
    np.testing.assert_array_equal(argmax, [-1] + list(np.argmax(x[1:], -1)))
    np.testing.assert_array_equal(probes.row_argmax(jnp.asarray(x)), argmax)
    np.testing.assert_array_equal(top2[1:], [9.0, np.sort(x[2])[-2]])


@pytest.mark.slow
def test_rows_of_2_24_columns_and_more_take_an_int32_column():
    """From 2^24 columns a float32 no longer holds every column index: the row statistics'
    first maximum takes an int32 one (``probes._first_max``), so a maximum in the last
    column, one column past another equal to it, is found where NumPy finds it."""
    v = (1 << 24) + 3
    x = np.zeros((1, v), np.float32)
    x[0, [v - 1, v - 2]] = [7.0, 5.0]
    top1, top2, *_, argmax = probes._row_stats(jnp.asarray(x))
    assert int(argmax[0]) == v - 1 == int(np.argmax(x[0])) and float(top1[0]) == 7.0 and float(top2[0]) == 5.0
    x[0, v - 2] = 7.0                  # a tie: the first of the two, top2 == top1
    top1, top2, *_, argmax = probes._row_stats(jnp.asarray(x))
    assert int(argmax[0]) == v - 2 and float(top2[0]) == 7.0


def test_attn_logits_probe_masks_causal_and_padding():
    _, _, scores, mask = _data(5)
    valid = np.tril(np.ones((6, 6), bool))[None, None] & np.asarray(mask)[:, None, :, None] \
        & np.asarray(mask)[:, None, None, :]
    poisoned = jnp.where(valid, scores, 1e30)
    _, sown = _Probed().apply({}, *_data(5)[:2], poisoned, mask, mutable=["intermediates", "raw"])
    (s,) = sown["intermediates"]["attn_logits"]
    ref = np.abs(np.asarray(scores)[np.broadcast_to(valid, scores.shape)]).max()
    np.testing.assert_allclose(s.abs_max, ref, rtol=1e-6)
    assert float(s.count) == valid.sum() * 2


def test_perturb_values_gradient_is_value_gradient():
    class Att(nn.Module):
        @nn.compact
        def __call__(self, v):
            v = probes.perturb_values(self, v)
            return jnp.sum(jnp.sin(v) * jnp.arange(v.shape[-1])[None, None, :])

    v = jnp.linspace(-1, 1, 24).reshape(2, 3, 4)
    variables = Att().init(jax.random.key(0), v)
    assert variables["perturbations"]["bos_value"].shape == v.shape
    g = jax.grad(lambda pert: Att().apply({"perturbations": pert}, v))(variables["perturbations"])
    np.testing.assert_allclose(g["bos_value"], jnp.cos(v) * jnp.arange(4)[None, None, :], rtol=1e-6)
    assert float(Att().apply({}, v)) == float(Att().apply(variables, v))  # identity without grads


def test_logits_summary_reduce_inside_shard_map_without_mask():
    """A count that is the same on every shard (no mask) is still summed over shards."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    logits = jax.random.normal(jax.random.key(1), (8, 5, 16))
    f = jax.jit(jax.shard_map(lambda x: probes.summarize_logits(x).reduce(("data",)).logits.count,
                              mesh=mesh, in_specs=P("data"), out_specs=P()))
    assert float(f(jax.device_put(logits, NamedSharding(mesh, P("data"))))) == 8 * 5 * 16


def test_logits_rows_then_mask_equals_summarize_logits():
    """LogitsRows (what instrument sows) masked afterwards == summarize_logits with the mask."""
    from jvitals.metrics.probes import logits_rows

    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 6, 40)).astype(np.float32)
    x[1, 5] = np.nan  # a padded row holding NaN counts nowhere
    m = np.ones((2, 6), bool)
    m[1, 4:] = False
    a = probes.summarize_logits(jnp.asarray(x), jnp.asarray(m))
    b = logits_rows(jnp.asarray(x)).summary(jnp.asarray(m))
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):  # two compiles: sums may round apart
        np.testing.assert_allclose(u, v, rtol=1e-6)
    np.testing.assert_array_equal(a.argmax, b.argmax)
    xv = x[m].astype(np.float64)
    np.testing.assert_allclose(b.logits.rms, np.sqrt(np.mean(xv ** 2)), rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_row_argmax_is_numpys_on_rows_of_nans_infinities_and_ties(data):
    """On any row of values, infinities and ties, float32 or bfloat16: NumPy's index where
    the row holds no NaN, -1 where it does, as the row statistics give it."""
    v = data.draw(st.integers(1, 300))
    pool = st.sampled_from([0.0, 1.0, -1.0, 9.0, np.inf, -np.inf, np.nan])
    rows = data.draw(hnp.arrays(np.float32, (3, v), elements=pool))
    for x in (rows, rows.astype(jnp.bfloat16)):
        xf = np.asarray(x, np.float32)
        want = np.where(np.isnan(xf).any(-1), -1, np.argmax(xf, -1))
        alone, rows_ = jax.jit(lambda a: (probes.row_argmax(a), probes._row_stats(a)[-1]))(jnp.asarray(x))
        np.testing.assert_array_equal(alone, want)
        np.testing.assert_array_equal(rows_, want)


class _SoftmaxProbed(nn.Module):
    causal: bool = True

    @nn.compact
    def __call__(self, scores, mask):
        return probes.attn_softmax_probe(self, scores, mask, causal=self.causal)


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("causal", [True, False])
def test_attn_softmax_probe_against_numpy(causal):
    """Probabilities as NumPy's masked softmax; the summary as NumPy's max |s| over the valid
    entries (padding rows and keys poisoned, so a leak shows)."""
    _, _, scores, mask = _data(7)
    m = np.asarray(mask)
    tri = np.tril(np.ones((6, 6), bool)) if causal else np.ones((6, 6), bool)
    keys_ok = tri[None, None] & m[:, None, None, :]
    valid = np.broadcast_to(keys_ok & m[:, None, :, None], scores.shape)
    poisoned = np.where(valid, np.asarray(scores), -1e31)
    probs, sown = _SoftmaxProbed(causal).apply({}, jnp.asarray(poisoned), mask, mutable=["intermediates"])
    (s,) = sown["intermediates"]["attn_logits"]
    ref = _np_softmax(np.where(keys_ok, poisoned, -1e30))
    np.testing.assert_allclose(probs, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(s.abs_max, np.abs(poisoned[valid]).max(), rtol=1e-6)
    assert float(s.count) == valid.sum() == (tri[None] & m[:, None, :] & m[:, :, None]).sum() * 2
    assert float(s.nonfinite) == 0


def test_attn_softmax_probe_counts_nonfinite_rows_and_keeps_gradients():
    _, _, scores, mask = _data(8)
    x = np.asarray(scores).copy()
    x[0, 1, 3, 2] = np.nan      # valid: row (0, 1, 3) flagged
    x[0, 1, 3, 1] = np.inf      # same row: still one row
    x[2, 0, 5, 5] = -np.inf     # valid: row (2, 0, 5)
    x[1, 0, 5, 0] = np.nan      # a padded query (mask[1, 4:] False): not counted
    x[0, 0, 1, 4] = np.nan      # above the diagonal: not counted
    _, sown = _SoftmaxProbed().apply({}, jnp.asarray(x), mask, mutable=["intermediates"])
    (s,) = sown["intermediates"]["attn_logits"]
    assert float(s.nonfinite) == 2 and np.isnan(float(s.abs_max))

    # The gradient through the probabilities is the plain masked softmax's.
    m = np.asarray(mask)
    keys_ok = jnp.asarray(np.tril(np.ones((6, 6), bool))[None, None] & m[:, None, None, :])
    w = jax.random.normal(jax.random.key(0), scores.shape)
    g = jax.grad(lambda sc: jnp.sum(_SoftmaxProbed().apply({}, sc, mask) * w))(scores)
    g_ref = jax.grad(lambda sc: jnp.sum(jax.nn.softmax(jnp.where(keys_ok, sc, -1e30), -1) * w))(scores)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-7)


def test_attn_softmax_probe_full_rank_mask_is_used_as_is():
    _, _, scores, _ = _data(9)
    valid = np.random.default_rng(9).random(scores.shape) < 0.6
    valid[..., 0] = True
    probs, sown = _SoftmaxProbed().apply({}, scores, jnp.asarray(valid), mutable=["intermediates"])
    (s,) = sown["intermediates"]["attn_logits"]
    np.testing.assert_allclose(probs, _np_softmax(np.where(valid, np.asarray(scores), -1e30)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(s.abs_max, np.abs(np.asarray(scores)[valid]).max(), rtol=1e-6)
    assert float(s.count) == valid.sum()


def test_attn_softmax_probe_of_bf16_scores():
    """bf16 scores: the probabilities in bf16, as the softmax of the masked bf16 scores; the
    maximum that of the bf16 values."""
    _, _, scores, mask = _data(10)
    sb = scores.astype(jnp.bfloat16)
    m = np.asarray(mask)
    keys_ok = np.tril(np.ones((6, 6), bool))[None, None] & m[:, None, None, :]
    valid = np.broadcast_to(keys_ok & m[:, None, :, None], scores.shape)
    probs, sown = _SoftmaxProbed().apply({}, sb, mask, mutable=["intermediates"])
    (s,) = sown["intermediates"]["attn_logits"]
    assert probs.dtype == jnp.bfloat16
    ref = _np_softmax(np.where(keys_ok, np.asarray(sb, np.float32), -1e30))
    np.testing.assert_allclose(np.asarray(probs, np.float32), ref, atol=1e-2)
    np.testing.assert_allclose(s.abs_max, np.abs(np.asarray(sb, np.float32)[valid]).max(), rtol=1e-6)


@pytest.mark.parametrize("probe", ["attn_logits_probe", "attn_softmax_probe"])
def test_attention_probes_name_a_mask_that_does_not_fit(probe):
    class M(nn.Module):
        @nn.compact
        def __call__(self, s, m):
            return getattr(probes, probe)(self, s, m)

    s = jnp.zeros((4, 2, 6, 6))
    for mask, says in ((jnp.ones((4, 5), bool), r"token mask of shape \(4, 5\).*\(4, 6\)"),
                       (jnp.ones((3, 6), bool), r"token mask of shape \(3, 6\)"),
                       (jnp.ones((4, 6, 6), bool), r"token mask of shape \(4, 6, 6\)"),
                       (jnp.ones((4, 2, 6, 5), bool), r"mask of shape \(4, 2, 6, 5\) does not broadcast")):
        with pytest.raises(ValueError, match=f"{probe}: a {says}"):
            M().apply({}, s, mask, mutable=["intermediates"])
    with pytest.raises(ValueError, match=rf"{probe}: scores of shape \(6, 6\)"):
        M().apply({}, jnp.zeros((6, 6)), None, mutable=["intermediates"])
    M().apply({}, s, jnp.ones((1, 6), bool), mutable=["intermediates"])     # a mask for every row: fine
    M().apply({}, s, jnp.ones((4, 1, 6, 6), bool), mutable=["intermediates"])


def test_attn_softmax_probe_of_float16_scores_with_a_query_of_no_valid_key():
    """float16 scores (where -1e30 is -inf): a row with no valid key attends uniformly and is
    not a non-finite score; the maximum is NumPy's over the valid entries."""
    _, _, scores, _ = _data(11)
    s16 = scores.astype(jnp.float16)
    valid = np.ones(scores.shape, bool)
    valid[0, 1, 2, :] = False                       # no valid key in this row
    valid[1, :, :, 3] = False
    probs, sown = _SoftmaxProbed().apply({}, s16, jnp.asarray(valid), mutable=["intermediates"])
    (s,) = sown["intermediates"]["attn_logits"]
    np.testing.assert_allclose(np.asarray(probs[0, 1, 2], np.float32), np.full(6, 1 / 6), rtol=1e-3)
    assert np.isfinite(np.asarray(probs, np.float32)).all() and float(s.nonfinite) == 0
    np.testing.assert_allclose(s.abs_max, np.abs(np.asarray(s16, np.float32)[valid]).max(), rtol=1e-6)
