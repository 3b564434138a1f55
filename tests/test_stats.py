"""summarize / Summary on one device, checked against NumPy."""

import warnings

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_second_calls_compile_nothing
import jvitals as vitals


def np_stats(x, mask=None):
    """The reference: NumPy in float64 over the valid elements."""
    x = np.asarray(x, np.float64)
    valid = np.ones(x.shape, bool) if mask is None else np.broadcast_to(mask, x.shape)
    v = x[valid]
    n = v.size
    if n == 0:
        return dict(count=0, mean=np.nan, rms=np.nan, std=np.nan, abs_max=np.nan, nonfinite=0)
    nonfinite = int(np.sum(~np.isfinite(v)))
    if nonfinite:
        return dict(count=n, mean=np.nan, rms=np.nan, std=np.nan, abs_max=np.nan, nonfinite=nonfinite)
    return dict(count=n, mean=v.mean(), rms=np.sqrt(np.mean(v * v)), std=v.std(),
                abs_max=np.abs(v).max(), nonfinite=0)


def check(s, ref, rtol=1e-6, atol=0.0):
    assert float(s.count) == ref["count"]
    assert float(s.nonfinite) == ref["nonfinite"]
    for k in ("mean", "rms", "abs_max"):
        np.testing.assert_allclose(float(getattr(s, k)), ref[k], rtol=rtol, atol=atol, equal_nan=True, err_msg=k)
    # std by the one-pass formula loses precision when |mean| >> std.
    np.testing.assert_allclose(float(s.std), ref["std"], rtol=1e-4, atol=1e-5 * max(1.0, abs(ref["mean"])),
                               equal_nan=True, err_msg="std")


def test_matches_numpy_with_mask_and_huge_padding():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 16, 8)).astype(np.float32)
    mask = rng.random((4, 16)) > 0.3
    x[~mask] = 1e30  # a leak of padding would show
    check(vitals.summarize(x, mask), np_stats(x, mask[..., None]))


def test_rms_is_not_std():
    x = jnp.full((10,), 3.0)
    s = vitals.summarize(x)
    assert float(s.rms) == pytest.approx(3.0)
    assert float(s.std) == pytest.approx(0.0, abs=1e-6)
    assert float(s.mean) == pytest.approx(3.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_makes_statistics_nan_and_is_counted(bad):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x[1, 2] = bad
    x[2, 3] = bad
    s = vitals.summarize(x)
    assert float(s.nonfinite) == 2
    assert float(s.count) == 12
    for k in ("mean", "rms", "std", "abs_max"):
        assert np.isnan(float(getattr(s, k))), k


def test_nonfinite_in_padding_is_ignored():
    x = np.ones((2, 3), np.float32)
    x[1, :] = np.nan
    s = vitals.summarize(x, mask=np.array([True, False]))
    assert float(s.nonfinite) == 0
    assert float(s.rms) == 1.0


def test_empty_mask_gives_nan_without_warning():
    x = jnp.ones((4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = vitals.summarize(x, mask=jnp.zeros((4,), bool))
        vals = [float(getattr(s, k)) for k in ("mean", "rms", "std", "abs_max")]
    assert float(s.count) == 0
    assert all(np.isnan(v) for v in vals)
    assert float(s.norm) == 0.0


def test_empty_and_merge_identity():
    rng = np.random.default_rng(1)
    s = vitals.summarize(rng.normal(size=(5, 7)).astype(np.float32))
    e = vitals.Summary.empty()
    for merged in (s.merge(e), e.merge(s)):
        for k in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
            assert float(getattr(merged, k)) == float(getattr(s, k)), k
    assert np.isnan(float(e.rms)) and float(e.count) == 0


def test_merge_is_associative_and_equals_concatenation():
    rng = np.random.default_rng(2)
    parts = [rng.normal(size=(n,)).astype(np.float32) * (i + 1) for i, n in enumerate((3, 0, 11, 6))]
    ss = [vitals.summarize(p) for p in parts]
    left = ss[0].merge(ss[1]).merge(ss[2]).merge(ss[3])
    right = ss[0].merge(ss[1].merge(ss[2].merge(ss[3])))
    whole = np.concatenate(parts)
    for m in (left, right):
        check(m, np_stats(whole))
    for k in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
        np.testing.assert_allclose(np.asarray(getattr(left, k)), np.asarray(getattr(right, k)), rtol=1e-6)


def test_merge_keeps_nonfinite():
    a = vitals.summarize(jnp.array([1.0, jnp.nan]))
    b = vitals.summarize(jnp.array([5.0]))
    m = b.merge(a)
    assert float(m.nonfinite) == 1 and np.isnan(float(m.abs_max)) and np.isnan(float(m.rms))


def test_axis_gives_per_layer_summaries():
    rng = np.random.default_rng(3)
    L, B, T, D = 3, 2, 5, 4
    x = rng.normal(size=(L, B, T, D)).astype(np.float32) * np.arange(1, L + 1)[:, None, None, None]
    mask = rng.random((B, T)) > 0.4
    s = vitals.summarize(x, mask, axis=0)  # [B, T] mask against [L, B, T, D]
    assert s.rms.shape == (L,)
    for i in range(L):
        ref = np_stats(x[i], mask[..., None])
        np.testing.assert_allclose(float(s.rms[i]), ref["rms"], rtol=1e-6)
        np.testing.assert_allclose(float(s.abs_max[i]), ref["abs_max"], rtol=1e-6)
        assert float(s.count[i]) == ref["count"]
    check(s.total(), np_stats(x, np.broadcast_to(mask[None, ..., None], x.shape)))


def test_axis_in_the_middle_and_negative():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    s = vitals.summarize(x, axis=-2)
    np.testing.assert_allclose(np.asarray(s.sum), x.sum(axis=(0, 2)))
    s1 = vitals.summarize(x, axis=1)
    np.testing.assert_allclose(np.asarray(s1.sumsq), (x.astype(np.float64) ** 2).sum(axis=(0, 2)), rtol=1e-6)


def test_bf16_equals_its_float32_upcast():
    rng = np.random.default_rng(4)
    x32 = rng.normal(size=(8, 32, 64)).astype(np.float32) * 50
    xb = jnp.asarray(x32, jnp.bfloat16)
    up = np.asarray(xb.astype(jnp.float32))
    sb, su = vitals.summarize(xb), vitals.summarize(up)
    for k in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
        assert getattr(sb, k).dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(getattr(sb, k)), np.asarray(getattr(su, k)), rtol=1e-6)
    check(sb, np_stats(up))


def test_integer_input():
    s = vitals.summarize(jnp.arange(5, dtype=jnp.int32))
    check(s, np_stats(np.arange(5)))


def test_mask_of_wrong_shape_is_a_clear_error():
    with pytest.raises(ValueError, match=r"mask of shape \(4, 3\) does not broadcast against x of shape \(4, 16, 8\)"):
        vitals.summarize(jnp.ones((4, 16, 8)), mask=jnp.ones((4, 3), bool))


def test_axis_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        vitals.summarize(jnp.ones((2, 3)), axis=3)


def test_no_recompile_on_second_call(count_compiles):
    f = jax.jit(lambda x, m: vitals.summarize(x, m).rms)
    x = jax.device_put(jnp.ones((4, 8)))
    x2 = jax.device_put(jnp.full((4, 8), 2.0, jnp.float32))
    m = jax.device_put(jnp.ones((4,), bool))
    f(x, m).block_until_ready()
    with count_compiles() as c:
        out = f(x2, m)
        out.block_until_ready()
    assert c.count == 0
    assert float(out) == 2.0


finite_floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_property_matches_numpy(data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6))
    x = data.draw(hnp.arrays(np.float32, shape, elements=finite_floats))
    mrank = data.draw(st.integers(0, len(shape)))
    mask = None if mrank == 0 else data.draw(hnp.arrays(bool, shape[:mrank]))
    s = vitals.summarize(x, mask)
    m = None if mask is None else mask.reshape(mask.shape + (1,) * (len(shape) - mrank))
    ref = np_stats(x, m)
    assert float(s.count) == ref["count"]
    for k in ("mean", "rms", "abs_max"):
        np.testing.assert_allclose(float(getattr(s, k)), ref[k], rtol=1e-5, atol=1e-3, equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_property_merge_of_split_equals_whole(data):
    n = data.draw(st.integers(0, 40))
    x = data.draw(hnp.arrays(np.float32, (n,), elements=st.one_of(finite_floats, st.just(np.nan))))
    mask = data.draw(hnp.arrays(bool, (n,)))
    cut = data.draw(st.integers(0, n))
    a = vitals.summarize(x[:cut], mask[:cut])
    b = vitals.summarize(x[cut:], mask[cut:])
    whole = vitals.summarize(x, mask)
    m = a.merge(b)
    for k in ("count", "nonfinite"):
        assert float(getattr(m, k)) == float(getattr(whole, k))
    for k in ("sum", "sumsq", "abs_max"):
        np.testing.assert_allclose(float(getattr(m, k)), float(getattr(whole, k)), rtol=1e-5, atol=1e-2, equal_nan=True)
    np.testing.assert_allclose(float(m.rms), np_stats(x, mask)["rms"], rtol=1e-5, atol=1e-3, equal_nan=True)


def test_summarize_max_measures_count_max_and_nonfinite_only():
    rng = np.random.default_rng(12)
    x = rng.normal(size=(2, 3, 5, 5)).astype(np.float32) * 4
    valid = np.tril(np.ones((5, 5), bool))[None, None] & (rng.random((2, 1, 5, 1)) > 0.3)
    x_pad = np.where(valid, x, 1e30).astype(np.float32)
    s = vitals.metrics.stats.summarize_max(x_pad, valid)
    full = np.broadcast_to(valid, x.shape)
    assert float(s.count) == full.sum() and float(s.nonfinite) == 0
    np.testing.assert_allclose(float(s.abs_max), np.abs(x[full]).max(), rtol=1e-6)
    assert np.isnan(float(s.rms)) and np.isnan(float(s.mean))  # not measured, never a wrong number
    per = vitals.metrics.stats.summarize_max(x_pad, valid, axis=1)
    for h in range(3):
        np.testing.assert_allclose(float(per.abs_max[h]), np.abs(x[:, h][full[:, h]]).max(), rtol=1e-6)
    x_pad[0, 0, 3, 1] = np.inf if valid[0, 0, 3, 1] else x_pad[0, 0, 3, 1]
    x_pad[1, 2, 4, 0] = np.nan if valid[1, 0, 4, 0] else x_pad[1, 2, 4, 0]
    bad = int((~np.isfinite(x_pad) & full).sum())
    s = vitals.metrics.stats.summarize_max(x_pad, valid)
    assert float(s.nonfinite) == bad
    if bad:
        assert np.isnan(float(s.abs_max))
    jitted = jax.jit(lambda a, m: vitals.metrics.stats.summarize_max(a, m))(x_pad, valid)
    assert float(jitted.nonfinite) == bad


def test_summarize_max_of_a_list_is_one_maximum_and_one_count():
    rng = np.random.default_rng(14)
    xs = [rng.normal(size=s).astype(np.float32) * k for k, s in enumerate([(3, 4), (7,), (2, 2, 5)], 1)]
    s = jax.jit(lambda a: vitals.metrics.stats.summarize_max(a))(xs)
    assert float(s.count) == sum(x.size for x in xs) and float(s.nonfinite) == 0
    np.testing.assert_allclose(float(s.abs_max), max(np.abs(x).max() for x in xs), rtol=1e-6)
    xs[1][3], xs[2][1, 1, 4] = np.nan, -np.inf
    s = jax.jit(lambda a: vitals.metrics.stats.summarize_max(a))(xs)
    assert float(s.nonfinite) == 2 and np.isnan(float(s.abs_max))
    with pytest.raises(ValueError, match="no mask or axis"):
        vitals.metrics.stats.summarize_max(xs, axis=0)


def test_summarize_sumsq_gives_the_norm_and_counts_nonfinite_only_when_needed():
    x = np.random.default_rng(13).normal(size=(7, 9)).astype(np.float32) * 3
    s = vitals.metrics.stats.summarize_sumsq(jnp.asarray(x, jnp.bfloat16))
    up = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(float(s.norm), np.sqrt((up ** 2).sum()), rtol=1e-6)
    np.testing.assert_allclose(float(s.rms), np.sqrt((up ** 2).mean()), rtol=1e-6)
    assert float(s.count) == x.size and float(s.nonfinite) == 0 and np.isnan(float(s.mean))
    x[2, 3], x[4, 4] = np.nan, -np.inf
    s = jax.jit(vitals.metrics.stats.summarize_sumsq)(x)
    assert float(s.nonfinite) == 2 and np.isnan(float(s.norm))
    # A list of arrays is summarised together (one tree's leaves), as by optax.
    parts = [x[:3], jnp.asarray(x[3:], jnp.bfloat16), np.ones((5,), np.float32)]
    many = jax.jit(vitals.metrics.stats.summarize_sumsq)(parts)
    assert float(many.nonfinite) == 2 and float(many.count) == x.size + 5 and np.isnan(float(many.norm))
    parts[0] = np.nan_to_num(x[:3], posinf=0.0, neginf=0.0, nan=0.0)
    parts[1] = np.nan_to_num(x[3:], posinf=0.0, neginf=0.0, nan=0.0)
    many = jax.jit(vitals.metrics.stats.summarize_sumsq)(parts)
    np.testing.assert_allclose(float(many.norm), float(optax.tree.norm([jnp.asarray(p) for p in parts])),
                               rtol=1e-6)
    assert float(many.nonfinite) == 0


def test_summarize_many_equals_summarize_item_by_item_without_a_conditional():
    rng = np.random.default_rng(15)
    xs = [rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(3, 5, 2)).astype(np.float32) * 7,
          rng.normal(size=(9,)).astype(np.float32)]
    mask = rng.random((4,)) > 0.3
    items = [(xs[0], mask, None), (xs[1], None, 0), (xs[2], None, None)]
    for bad in (False, True):
        if bad:
            xs[1][2, 3, 1] = np.nan  # only the second item's figures go NaN
            items[1] = (xs[1], None, 0)
        many = jax.jit(lambda a, b, c: vitals.metrics.stats.summarize_many([(a, mask, None), (b, None, 0), (c, None, None)]))(
            *[x for x, _, _ in items])
        for (x, m, ax), s in zip(items, many):
            one = vitals.metrics.stats.summarize(x, m, axis=ax)
            for f in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
                np.testing.assert_allclose(np.asarray(getattr(s, f)), np.asarray(getattr(one, f)), rtol=1e-6,
                                           equal_nan=True, err_msg=f)
        assert float(jnp.sum(many[1].nonfinite)) == (1 if bad else 0)
        assert np.isnan(np.asarray(many[1].rms)[2]) == bad and np.isfinite(float(many[0].rms))
        np.testing.assert_allclose(float(many[0].rms), np.sqrt(np.mean(xs[0][mask] ** 2)), rtol=1e-6)
    hlo = jax.jit(lambda a, b, c: vitals.metrics.stats.summarize_many([(a, mask, None), (b, None, 0), (c, None, None)])).lower(
        *xs).compile().as_text()
    assert hlo.count(" conditional(") == 0 and hlo.count(" while(") == 0


def test_summarize_sumsq_keeps_a_layer_axis():
    rng = np.random.default_rng(16)
    xs = [rng.normal(size=(3, 4, 5)).astype(np.float32), rng.normal(size=(3, 7)).astype(np.float32)]
    s = vitals.metrics.stats.summarize_sumsq(xs, axis=0)
    want = sum(np.sum(x.astype(np.float64) ** 2, axis=tuple(range(1, x.ndim))) for x in xs)
    np.testing.assert_allclose(np.asarray(s.norm), np.sqrt(want), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(s.count), [27.0] * 3)
    xs[1][1, 2] = np.inf
    s = jax.jit(lambda a: vitals.metrics.stats.summarize_sumsq(a, axis=0))(xs)
    np.testing.assert_array_equal(np.asarray(s.nonfinite), [0, 1, 0])
    assert np.isnan(np.asarray(s.norm)[1]) and np.isfinite(np.asarray(s.norm)[[0, 2]]).all()


def test_eager_calls_compile_once(count_compiles):
    """A second eager call with the same shapes compiles nothing (issue 20 item 7)."""
    from jvitals.metrics.stats import summarize, summarize_many, summarize_max, summarize_sumsq, summarize_tokens

    x = jax.device_put(jnp.arange(24.0).reshape(2, 3, 4))
    m = jax.device_put(jnp.array([[True, True, False], [True, False, False]]))
    calls = [lambda: summarize(x, m), lambda: summarize(x, axis=0), lambda: summarize_max(x, m),
             lambda: summarize_sumsq([x, x]), lambda: summarize_tokens(x),
             lambda: summarize_many([(x, m, None), (x, None, 1)])]
    assert_second_calls_compile_nothing(calls, count_compiles)
    # The eager (jitted) path gives what the traced one gives.
    np.testing.assert_allclose(summarize(x, m).rms, jax.jit(lambda a, b: summarize(a, b).rms)(x, m))
    np.testing.assert_allclose(summarize(x, m).rms, np.sqrt(np.mean(np.asarray(x)[np.asarray(m)] ** 2)))


def test_token_summary_masked_equals_summarize():
    """Per-token partial sums masked later give summarize(x, mask): a NaN in a padded
    row counts nowhere; one in a valid row makes the figures NaN and is counted."""
    from jvitals.metrics.stats import summarize_tokens

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 6)).astype(np.float32)
    m = np.array([[True] * 5, [True, True, True, False, False]])
    x[1, 4, 2] = np.nan  # padded position
    ts = summarize_tokens(jnp.asarray(x))
    assert ts.shape == (2, 5)
    s = ts.masked(m)
    xv = x[m].astype(np.float64)
    np.testing.assert_allclose(s.rms, np.sqrt(np.mean(xv ** 2)), rtol=1e-6)
    np.testing.assert_allclose(s.abs_max, np.abs(xv).max(), rtol=1e-6)
    np.testing.assert_allclose(s.count, xv.size)
    assert float(s.nonfinite) == 0
    x[0, 1, 0] = np.inf  # a valid position
    s2 = summarize_tokens(jnp.asarray(x)).masked(m)
    assert np.isnan(s2.rms) and np.isnan(s2.abs_max) and float(s2.nonfinite) == 1
    # Stacked [L, B, T] fields with axis=0, and the attention form (valid keys, max only).
    st = summarize_tokens(jnp.asarray(np.stack([x, 2 * x]))[:, :, :, :3], token_ndim=3)
    assert st.shape == (2, 2, 5)
    xc = rng.normal(size=(2, 5, 6)).astype(np.float32)
    mx = summarize_tokens(jnp.asarray(xc), jnp.asarray(xc > 0), max_only=True).masked(m)
    sel = (xc > 0) & m[..., None]
    assert np.isnan(mx.rms)
    np.testing.assert_allclose(mx.abs_max, xc[sel].max(), rtol=1e-6)
    np.testing.assert_allclose(mx.count, sel.sum())


def bytes_accessed(fn, *args):
    """XLA's cost analysis of the compiled ``fn``: bytes read and written."""
    ca = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((ca[0] if isinstance(ca, (list, tuple)) else ca)["bytes accessed"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_statistic_in_one_read(dtype):
    """count, sum, sumsq, max|x| and the non-finite count read x once (issue 26): the
    compiled program's bytes are x's, the mask's and the partials' (< 3% more). On the CPU
    outside ``fold.cpu_plain()`` that is the variadic form (XLA:CPU has no multi-output
    fusion); GPUs and TPUs fuse the plain form's sibling reductions into one read
    (tests/test_tpu_cost.py reads it off the TPU compiler)."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 32, 512)), dtype)
    mask = jnp.asarray(np.random.default_rng(4).random((64, 32)) > 0.2)
    nbytes = x.size * x.dtype.itemsize
    for fn in (lambda a, m: vitals.metrics.stats.summarize(a, m),
               lambda a, m: vitals.metrics.stats.summarize(a, m, axis=0),
               lambda a, m: vitals.metrics.stats.summarize_max(a, m),
               lambda a, m: vitals.metrics.stats.summarize_sumsq(a),
               lambda a, m: vitals.metrics.stats.summarize_tokens(a, m[..., None])):
        got = bytes_accessed(fn, x, mask)
        # + the mask, and each token's four partials written and read (stats._masked_groups)
        assert nbytes <= got <= 1.03 * nbytes + 16 * mask.size * 4, (got / nbytes)
    # Three arrays of one shape: one reduction reading each once.
    many = lambda a, b, c: vitals.metrics.stats.summarize_many([(a, None, None), (b, None, None), (c, None, 0)])
    hlo = jax.jit(many).lower(x, x + 1, x * 2).compile().as_text()
    got = bytes_accessed(many, x, x + 1, x * 2)
    assert got <= 3 * 1.03 * nbytes, got / nbytes
    assert hlo.count(" conditional(") == 0


@pytest.mark.parametrize("masked", [False, True])
def test_both_forms_against_numpy(masked):
    """The plain form (what accelerators compile, and a CPU inside ``cpu_plain``) and the
    CPU's variadic form give NumPy's figures, NaN and Inf included."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(16, 8, 64)).astype(np.float32) * 3
    x[2, 3, 5], x[7, 1, 9] = np.nan, np.inf
    mask = rng.random((16, 8)) > 0.3 if masked else np.ones((16, 8), bool)
    m = jnp.asarray(mask) if masked else None
    fold = vitals.metrics.fold
    forms = {"one read": jax.jit(lambda a: vitals.metrics.stats.summarize(a, m, axis=0)).lower(x).compile()}
    with fold.cpu_plain():
        forms["plain"] = jax.jit(lambda a: vitals.metrics.stats.summarize(a, m, axis=0)).lower(x).compile()
    assert forms["plain"].as_text().count(" reduce(") > forms["one read"].as_text().count(" reduce(")
    xm = np.where(mask[..., None], x, 0.0).astype(np.float64)
    fin = np.isfinite(xm)
    for name, fn in forms.items():
        s = fn(x)
        np.testing.assert_allclose(np.asarray(s.count), mask.sum(1) * 64, err_msg=name)
        np.testing.assert_allclose(np.asarray(s.sum), np.where(fin, xm, 0).sum((1, 2)), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(s.sumsq), np.where(fin, xm, 0).__pow__(2).sum((1, 2)), rtol=1e-5,
                                   err_msg=name)
        bad = (~fin & mask[..., None]).sum((1, 2))
        np.testing.assert_array_equal(np.asarray(s.nonfinite), bad, err_msg=name)
        amax = np.where(bad > 0, np.nan, np.abs(np.where(fin, xm, 0)).max((1, 2)))
        np.testing.assert_allclose(np.asarray(s.abs_max), amax, err_msg=name)


def test_long_reductions_keep_float32_accuracy():
    """Reduced in two levels (rows of fold.ROW): 2^22 squares within 1e-6 of float64."""
    x = np.random.default_rng(5).normal(size=(1 << 22,)).astype(np.float32)
    s = jax.jit(vitals.metrics.stats.summarize)(x)
    np.testing.assert_allclose(float(s.sumsq), np.sum(x.astype(np.float64) ** 2), rtol=1e-6)
    np.testing.assert_allclose(float(s.sum), np.sum(x.astype(np.float64)), rtol=1e-4, atol=1e-2)


def test_two_dimensional_reductions_keep_float32_accuracy():
    """A [2048, 1024] tensor (summarised whole and per row block) within 2e-6 of float64
    (one serial float32 loop over it: 4e-4)."""
    x = np.random.default_rng(6).normal(size=(2048, 1024)).astype(np.float32) * 3
    s = jax.jit(vitals.metrics.stats.summarize)(x)
    np.testing.assert_allclose(float(s.sumsq), np.sum(x.astype(np.float64) ** 2), rtol=2e-6)
    np.testing.assert_allclose(float(s.abs_max), np.abs(x).max(), rtol=0)
    per = jax.jit(lambda a: vitals.metrics.stats.summarize(a.reshape(4, 512, 1024), axis=0))(x)
    np.testing.assert_allclose(np.asarray(per.sumsq),
                               (x.astype(np.float64) ** 2).reshape(4, -1).sum(1), rtol=2e-6)


# ----------------------------------------------------------------------------------
# fold.py: the one-read reduction's own decisions.


def test_fold_levels_lanes_and_custom_combiners_match_numpy():
    """Lanes (last axis % 4 == 0), two levels (long blocks), neither (odd sizes, a kept
    middle axis): the same figures as NumPy; a max and a min combined with sums."""
    from jvitals.metrics import fold

    rng = np.random.default_rng(7)
    for shape, axes in [((3, 5), None), ((8, 4096), (1,)), ((6, 7, 515), (1, 2)), ((5, 12, 64), (0, 2)),
                        ((2, 3000), None), ((64, 4, 1000), (1, 2))]:
        x = rng.normal(size=shape).astype(np.float32)
        inits, combine = fold.kinds(("sum", "max", "min", "sum"))
        got = jax.jit(lambda a: fold.fold_map(lambda v: (v, v, v, v * v), (a,), inits, combine, axes))(x)
        ax = tuple(range(x.ndim)) if axes is None else axes
        x64 = x.astype(np.float64)
        for g, want in zip(got, (x64.sum(ax), x.max(ax), x.min(ax), (x64 ** 2).sum(ax))):
            np.testing.assert_allclose(np.asarray(g), want, rtol=2e-6, atol=3e-4, err_msg=str(shape))


def test_fold_two_levels_only_when_the_partials_are_cheap():
    """The CPU's variadic form: a trailing run long enough that its partials add <= 5% of
    the input's bytes; a short block stays one reduction. The plain form: one plain
    reduction per operand."""
    from jvitals.metrics import fold

    def reduces(shape, n_ops):
        f = lambda a: fold.fold_map(lambda v: (v,) * n_ops, (a,), (0.0,) * n_ops, fold.kinds(("sum",) * n_ops)[1])
        return jax.jit(f).lower(jnp.ones(shape)).compile().as_text().count(" reduce(")

    cpu = lambda a: fold.fold_map(lambda v: (v, v * v, v + 1), (a,), (0.0,) * 3, fold.kinds(("sum",) * 3)[1])
    with fold.cpu_plain():   # the plain form: a vectorised reduction per operand
        assert jax.jit(cpu).lower(jnp.ones((512, 1024))).compile().as_text().count(" reduce(") == 3
    assert reduces((8, 64), 4) == 1            # 512 elements: one level
    assert reduces((512, 1024), 4) == 2        # rows of 256 (after lanes), then the 512 partials
    assert reduces((1 << 20,), 2) == 2         # one long axis split in rows
    x = jnp.ones((512, 1024))
    ca = jax.jit(lambda a: fold.fold((a, a * a), (0.0, 0.0), fold.kinds(("sum", "sum"))[1])).lower(
        x).compile().cost_analysis()
    assert (ca[0] if isinstance(ca, (list, tuple)) else ca)["bytes accessed"] <= 1.05 * x.nbytes


def test_fold_kinds_are_cached_so_eager_calls_reuse_their_compilation():
    from jvitals.metrics import fold

    assert fold.kinds(("sum", "max"))[1] is fold.kinds(["sum", "max"])[1]
