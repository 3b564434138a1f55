"""optimizer_metrics: Adam nu anywhere in the chain, the log-histogram median, loss scale, skips."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale
from jax.sharding import NamedSharding, PartitionSpec as P

from jvitals.metrics.optimizer import NU_BINS, histogram_quantile, log_histogram, optimizer_metrics, search_quantile

# |log10(estimate) - log10(exact)| bound of the 2^-7-relative bins (midpoint rule).
BIN_DECADES = np.log10(1 + 2.0 ** -7)


def params_tree():
    rng = np.random.default_rng(0)
    return {"embed": {"embedding": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)},
            "layers": {"mlp": {"up_proj": {"kernel": jnp.asarray(rng.normal(size=(2, 8, 12)), jnp.float32)}},
                       "moe": {"experts": {"gate_proj": jnp.asarray(rng.normal(size=(2, 4, 8, 6)), jnp.float32)}}}}


def grads_like(params, seed):
    rng = np.random.default_rng(seed)
    # gradients spanning many orders of magnitude, so nu does too
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10.0 ** rng.uniform(-6, 1, size=p.shape),
                                              jnp.float32), params)


def np_nu_stats(nus):
    x = np.concatenate([np.abs(np.asarray(n, np.float64)).ravel() for n in jax.tree.leaves(nus)])
    return x.max(), np.median(x), np.log10(x.max()) - np.log10(np.median(x))


def run(tx, params, steps=3):
    state = tx.init(params)
    upd = jax.jit(tx.update)
    for s in range(steps):
        _, state = upd(grads_like(params, s), state, params)
    return state


CHAINS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw_chain_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-3), 3),
    "multisteps_all": lambda: optax.MultiSteps(
        optax.apply_if_finite(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), 3), 1),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_adam_nu_anywhere_in_the_chain(name):
    params = params_tree()
    state = run(CHAINS[name](), params)
    nus = [n.nu for n in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(n, optax.ScaleByAdamState)]
    assert len(nus) == 1
    mx, med, spread = np_nu_stats(nus)
    got = jax.jit(optimizer_metrics)(state)
    np.testing.assert_allclose(got["opt/adam_nu_abs.max"], mx, rtol=1e-6)
    assert abs(np.log10(got["opt/adam_nu_median"]) - np.log10(med)) <= BIN_DECADES
    assert abs(got["opt/adam_nu_log10_spread"] - spread) <= BIN_DECADES
    assert spread > 3  # the test spans orders of magnitude
    if "inject" in name:
        assert "opt/learning_rate" in got
    if name in ("apply_if_finite", "multisteps_all"):
        assert int(got["opt/skipped_steps"]) == 0


_median = jax.jit(lambda x: histogram_quantile(log_histogram(x)))


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1001])
def test_histogram_median_within_bin_of_numpy(n):
    rng = np.random.default_rng(n)
    x = (10.0 ** rng.uniform(-30, 30, size=n)).astype(np.float32)
    med = float(_median(jnp.asarray(x)))
    assert abs(np.log10(med) - np.log10(np.median(x.astype(np.float64)))) <= BIN_DECADES
    h = jax.jit(log_histogram)(jnp.asarray(np.array([1.0, np.nan, np.inf, -2.0], np.float32)))
    assert h.shape == (NU_BINS,) and int(h.sum()) == 2  # non-finite not counted; |x| used


def test_mostly_zero_nu_gives_infinite_spread_and_nan_propagates():
    st = optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu={"a": jnp.zeros(5)},
                                nu={"a": jnp.array([0, 0, 0, 1e-3, 1e-1], jnp.float32)})
    om = jax.jit(optimizer_metrics)
    got = om(st)
    assert got["opt/adam_nu_median"] == 0 and np.isinf(got["opt/adam_nu_log10_spread"])
    st = st._replace(nu={"a": jnp.array([1.0, jnp.nan, 2.0])})
    got = om(st)
    assert np.isnan(got["opt/adam_nu_abs.max"]) and np.isnan(got["opt/adam_nu_log10_spread"])


def test_skipped_steps_from_apply_if_finite():
    params = params_tree()
    # (Not under MultiSteps here: its accumulator keeps a NaN micro-gradient into the next step.)
    tx = optax.apply_if_finite(optax.adam(1e-3), 5)
    state = tx.init(params)
    upd = jax.jit(tx.update)
    for s in range(4):
        g = grads_like(params, s)
        if s in (1, 2):
            g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), g)
        _, state = upd(g, state, params)
    got = jax.jit(optimizer_metrics)(state)
    assert int(got["opt/skipped_steps"]) == 2 and int(got["opt/consecutive_nonfinite"]) == 0
    assert np.isfinite(got["opt/adam_nu_abs.max"])  # skipped updates left nu clean


def test_loss_scale_from_state_or_argument():
    ds = DynamicScale(scale=jnp.float32(2.0 ** 15))
    state = (optax.adam(1e-3).init({"w": jnp.ones(3)}), ds)
    got = optimizer_metrics(state)
    assert got["opt/loss_scale"] == 2.0 ** 15
    got = optimizer_metrics(optax.sgd(0.1).init({"w": jnp.ones(3)}), loss_scale=jnp.float32(128.0))
    assert got == {"opt/loss_scale": 128.0}
    assert "opt/loss_scale" not in optimizer_metrics(optax.adam(1e-3).init({"w": jnp.ones(3)}))
    got = optimizer_metrics({"inner": optax.sgd(0.1).init({}), "loss_scale": jnp.float32(4.0)})
    assert got["opt/loss_scale"] == 4.0


@pytest.mark.parametrize("median", ["auto", "search"])
def test_shard_map_nu_sharded_over_expert_equals_one_device(median):
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = params_tree()
    state = run(optax.adam(1e-3), params)
    specs = {"embed": {"embedding": P()}, "layers": {"mlp": {"up_proj": {"kernel": P()}},
                                                      "moe": {"experts": {"gate_proj": P(None, "expert")}}}}
    adam_specs = (optax.ScaleByAdamState(count=P(), mu=specs, nu=specs), optax.EmptyState())
    one = jax.jit(optimizer_metrics)(state)
    put = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, adam_specs,
                       is_leaf=lambda x: isinstance(x, P))
    f = jax.shard_map(lambda s: optimizer_metrics(s, specs=specs, axes=("data", "expert"), median=median),
                      mesh=mesh, in_specs=(adam_specs,), out_specs=P())
    sharded = jax.jit(f)(put)
    for k in one:
        np.testing.assert_allclose(sharded[k], one[k], rtol=1e-6, err_msg=k)


def test_log_histogram_in_chunks_equals_numpy_bincount(monkeypatch):
    from jvitals.metrics import optimizer as opt_mod

    monkeypatch.setattr(opt_mod, "_HIST_CHUNK", 1000)  # 2503 elements: 2 whole chunks and a remainder
    x = np.abs(np.random.default_rng(5).normal(size=(2503,)).astype(np.float32)) * 1e-3
    x[5], x[2000] = np.nan, np.inf
    hist = np.asarray(opt_mod.log_histogram(x))
    finite = x[np.isfinite(x)]
    ref = np.bincount(finite.view(np.uint32) >> 16, minlength=opt_mod.NU_BINS)
    np.testing.assert_array_equal(hist, ref)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.73, 1.0])
def test_histogram_quantile_equals_the_running_count_search(q):
    """The two-level search gives the bins a search over the whole running count gives (NumPy)."""
    rng = np.random.default_rng(int(q * 100))
    x = (10.0 ** rng.uniform(-20, 20, size=5001)).astype(np.float32)
    x[:300] = 0.0  # bin 0 reads as 0
    hist = np.bincount(x.view(np.uint32) >> 16, minlength=NU_BINS).astype(np.float64)
    cum = np.cumsum(hist)
    pos = q * (cum[-1] - 1)
    lo, hi = np.searchsorted(cum, np.floor(pos), side="right"), np.searchsorted(cum, np.ceil(pos), side="right")

    def mid(b):
        return 0.0 if b == 0 else float(np.array([(b << 16) | 0x8000], np.uint32).view(np.float32)[0])

    frac = pos - np.floor(pos)
    want = mid(lo) * (1 - frac) + mid(hi) * frac
    got = float(jax.jit(histogram_quantile, static_argnums=1)(jnp.asarray(hist, jnp.int32), q))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    ref = np.quantile(x.astype(np.float64), q)
    assert ref == 0 or abs(np.log10(got) - np.log10(ref)) <= BIN_DECADES


def _groups_from(xs):
    return {(): [jnp.asarray(x) for x in xs]}


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.73, 1.0])
def test_search_quantile_gives_the_histogram_bins(q):
    """The scatter-free search finds the bins the histogram finds, over several leaves."""
    rng = np.random.default_rng(7 + int(q * 100))
    xs = [(10.0 ** rng.uniform(-20, 20, size=s)).astype(np.float32) for s in [(3001,), (40, 50), ()]]
    xs[0][:200] = 0.0  # bin 0 reads as 0
    xs[1][3, :] = 7.5e-3  # a run of one bin (what serialises a scatter on a GPU)
    allx = np.concatenate([x.ravel() for x in xs])
    hist = np.bincount(allx.view(np.uint32) >> 16, minlength=NU_BINS)
    want = float(jax.jit(histogram_quantile, static_argnums=1)(jnp.asarray(hist, jnp.int32), q))
    got = float(jax.jit(lambda *a: search_quantile(_groups_from(a), q))(*xs))
    assert got == want
    ref = np.quantile(allx.astype(np.float64), q)
    assert ref == 0 or abs(np.log10(got) - np.log10(ref)) <= BIN_DECADES


def test_search_quantile_extremes_and_empty():
    # the largest and smallest finite bins, denormals (bin 0), one element, none
    big = np.array([3.0e38, 3.3e38, 1.0e-45, 2.0e-38], np.float32)
    for x in (big, big[:1], np.array([5.0], np.float32), np.float32(2.5)):
        x = np.atleast_1d(x)
        for q in (0.0, 0.5, 1.0):
            hist = np.bincount(x.view(np.uint32) >> 16, minlength=NU_BINS)
            want = float(histogram_quantile(jnp.asarray(hist, jnp.int32), q))
            assert float(search_quantile(_groups_from([x]), q)) == want, (x, q)
    assert np.isnan(search_quantile(_groups_from([np.zeros((0,), np.float32)]), 0.5))


@pytest.mark.parametrize("name", ["adam", "multisteps_all"])
def test_median_methods_agree(name):
    params = params_tree()
    state = run(CHAINS[name](), params)
    got = {m: jax.jit(lambda s, m=m: optimizer_metrics(s, median=m))(state) for m in ("auto", "histogram", "search")}
    for k in got["auto"]:
        assert float(got["search"][k]) == float(got["histogram"][k]) == float(got["auto"][k]), k
    with pytest.raises(ValueError, match="median='sort'"):
        optimizer_metrics(state, median="sort")


def test_learning_rate_includes_the_lr_scale():
    """opt/learning_rate = the injected learning rate x every with_lr_scale scale, as the recorder logs it."""
    import jvitals as vitals

    params = {"w": jnp.ones((3,))}
    schedule = optax.linear_schedule(1e-3, 2e-3, 4)
    tx = vitals.with_lr_scale(optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))
    state = vitals.set_lr_scale(tx.init(params), 0.5)
    for k in range(2):
        _, state = tx.update({"w": jnp.ones((3,))}, state, params)
        np.testing.assert_allclose(float(optimizer_metrics(state)["opt/learning_rate"]),
                                   0.5 * float(schedule(k)), rtol=1e-6)


def test_find_loss_scale_prefers_the_argument_then_objects_then_a_named_leaf():
    from jvitals.metrics.optimizer import _find_loss_scale

    ds = DynamicScale(scale=jnp.asarray(512.0))
    named = {"opt": (), "loss_scale": jnp.asarray(8.0)}
    assert _find_loss_scale({}, None) is None
    assert float(_find_loss_scale(named, None)) == 8.0
    assert float(_find_loss_scale({"a": ds, **named}, None)) == 512.0      # an object before a leaf
    assert float(_find_loss_scale({"a": ds}, jnp.asarray(2.0))) == 2.0    # the argument first
    with pytest.raises(ValueError, match="an array or an object with .loss_scale or .scale"):
        _find_loss_scale({}, object())


def test_median_method_is_chosen_by_the_argument_or_the_backend():
    from jvitals.metrics import optimizer as opt_mod

    x = jnp.asarray(np.random.default_rng(0).random(5000).astype(np.float32))
    groups = {(): [x]}
    hist, search, auto = (float(opt_mod._median(groups, m)) for m in ("histogram", "search", "auto"))
    assert hist == search == auto  # the same bins either way
    assert "scatter" in jax.jit(lambda a: opt_mod._median({(): [a]}, "auto")).lower(x).as_text()
    assert "scatter" not in jax.jit(lambda a: opt_mod._median({(): [a]}, "search")).lower(x).as_text()


@pytest.mark.slow
def test_the_cpus_median_of_many_nu_reads_a_systematic_sample():
    """Above NU_SAMPLE values (2.4 M here) 'auto' on the CPU takes the median of every k-th
    value (k odd): exact to the bin on that sample (NumPy on the same slices), and on real
    Adam nu (the reference model after 10 steps of chain(clip, adamw)) within 0.005 decades
    of NumPy's median of every value."""
    from jvitals import reference_model as rm
    from jvitals.metrics import optimizer as opt_mod

    cfg = rm.ModelConfig(vocab=4096, d_model=192, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32, d_ff=512,
                         attention="fused_qkv")
    params = rm.init_params(cfg, jax.random.key(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = tx.init(params)

    @jax.jit
    def step(p, s, b):
        g = jax.grad(lambda p: rm.loss_fn(p, b, cfg)[0])(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for i in range(10):
        params, state = step(params, state, rm.make_batch(i, cfg, 4, 32))
    nu = jax.tree.leaves(state[1][0].nu)
    n = sum(x.size for x in nu)
    assert n > 2 * opt_mod.NU_SAMPLE
    k = (n // opt_mod.NU_SAMPLE) | 1
    sample = np.concatenate([np.asarray(x).ravel()[::k] for x in nu]).astype(np.float64)
    every = np.concatenate([np.asarray(x).ravel() for x in nu]).astype(np.float64)
    got = jax.device_get(jax.jit(optimizer_metrics)(state))
    med = float(got["opt/adam_nu_median"])
    assert med == float(jax.jit(lambda s: optimizer_metrics(s, median="sample"))(state)["opt/adam_nu_median"])
    assert abs(np.log10(med) - np.log10(np.median(sample))) <= BIN_DECADES
    assert abs(np.log10(med) - np.log10(np.median(every))) <= 0.005
    np.testing.assert_allclose(got["opt/adam_nu_abs.max"], every.max(), rtol=1e-6)   # the maximum reads every value
    exact = float(jax.jit(lambda s: optimizer_metrics(s, median="histogram"))(state)["opt/adam_nu_median"])
    assert abs(np.log10(exact) - np.log10(np.median(every))) <= BIN_DECADES


def test_systematic_sample_keeps_small_trees_whole_and_walks_every_column():
    from jvitals.metrics.optimizer import systematic_sample

    small = {(): [jnp.ones((8, 16)), jnp.ones((3,))]}
    assert [x.shape for x in systematic_sample(small)[()]] == [(8, 16), (3,)]
    x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64)
    got = np.asarray(systematic_sample({(): [x]}, size=512)[()][0])   # k = 8 | 1 = 9
    np.testing.assert_array_equal(got, np.arange(0, 64 * 64, 9))
    assert len(set(got.astype(int) % 64)) == 64                        # every column, across the rows


@pytest.mark.slow
@pytest.mark.parametrize("q", [0.5, pytest.param(0.3, marks=pytest.mark.slow)])
def test_window_quantile_reads_the_bins_of_numpy_around_a_sample(q):
    """window_quantile (the GPU/TPU form): max |x| exact, the quantile within the 4-bin
    interval its docstring bounds (one bin where the sample's bin is within 4 of the true one)
    of NumPy's, on leaves whose rows differ in scale (the sample: every 32nd block of 8 rows)."""
    from jvitals.metrics.optimizer import window_quantile
    rng = np.random.default_rng(3)
    xs = [np.exp(rng.normal(-10, 3, size=(512, 384))).astype(np.float32),
          np.exp(rng.normal(-14, 2, size=(4096, 1)) + rng.normal(0, 1, size=(4096, 256))).astype(np.float32),
          np.exp(rng.normal(-8, 1, size=(256,))).astype(np.float32)]
    amax, got = jax.jit(lambda *a: window_quantile({(): list(a)}, q))(*xs)
    every = np.concatenate([x.ravel() for x in xs]).astype(np.float64)
    assert float(amax) == every.max()
    assert abs(np.log10(float(got)) - np.log10(np.quantile(every, q))) <= 4 * BIN_DECADES
    bad = xs[0].copy()
    bad[3, 3] = np.nan
    assert all(np.isnan(v) for v in jax.jit(lambda a: window_quantile({(): [a]}))(bad))


def test_window_median_in_optimizer_metrics_is_near_numpys():
    state = optax.adam(1e-3).init({"w": jnp.zeros((1024, 256)), "b": jnp.zeros((256,))})
    rng = np.random.default_rng(4)
    nu = {"w": jnp.asarray(np.exp(rng.normal(-12, 2, size=(1024, 256))), jnp.float32),
          "b": jnp.asarray(np.exp(rng.normal(-9, 1, size=(256,))), jnp.float32)}
    state = (state[0]._replace(nu=nu),) + tuple(state[1:])
    win = jax.jit(lambda s: optimizer_metrics(s, median="window"))(state)
    exact = jax.jit(lambda s: optimizer_metrics(s, median="search"))(state)
    assert float(win["opt/adam_nu_abs.max"]) == float(exact["opt/adam_nu_abs.max"])
    every = np.concatenate([np.ravel(v) for v in nu.values()]).astype(np.float64)
    assert abs(np.log10(float(win["opt/adam_nu_median"])) - np.log10(np.median(every))) <= 4 * BIN_DECADES
    assert abs(float(win["opt/adam_nu_log10_spread"]) - float(exact["opt/adam_nu_log10_spread"])) <= 4 * BIN_DECADES


@pytest.mark.parametrize("shape", [(4096, 256), (704, 256), (256, 704), (2, 256, 352)])
def test_block_sample_takes_every_32nd_block_of_8_along_the_major_dimension(shape):
    """The sample's blocks against NumPy's slices of the same leaf: rows where the last
    dimension is a multiple of 128 (a prefix of 512 rows taken whole: 2 blocks of [704, 256]),
    columns where only the one before is ([256, 704]: the TPU lays it out column-major)."""
    from jvitals.metrics.optimizer import block_sample

    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    got = np.asarray(jax.jit(block_sample)(x))
    m = np.swapaxes(x, -1, -2) if shape[-1] % 128 and shape[-2] % 128 == 0 else x
    m = m.reshape(-1, m.shape[-1])
    want = np.stack([m[i:i + 8] for i in range(0, m.shape[0] - 255, 256)])
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    assert 1 / 48 <= got.size / x.size <= 1 / 32


@pytest.mark.parametrize("rows", [32 * 256 + 8, 65_536, 100_000])
def test_block_sample_takes_at_most_32_blocks_spread_over_every_row(rows):
    """Past 32 blocks of every 32nd (8,192 rows) the stride grows to ceil(rows / 256) blocks:
    8,200 rows -> every 33rd block of 8 (31 blocks, the last at row 7,920); 65,536 -> every
    256th (32, one reshape); 100,000 -> every 391st (31, the last at row 93,840)."""
    from jvitals.metrics.optimizer import WINDOW_BLOCKS, block_sample

    assert WINDOW_BLOCKS == 32
    x = np.arange(rows * 128, dtype=np.float32).reshape(rows, 128)
    got = np.asarray(jax.jit(block_sample)(x))
    stride = {32 * 256 + 8: 33 * 8, 65_536: 256 * 8, 100_000: 391 * 8}[rows]
    want = np.stack([x[i:i + 8] for i in range(0, rows - stride + 1, stride)])
    assert len(want) == {32 * 256 + 8: 31, 65_536: 32, 100_000: 31}[rows]
    assert want[-1][0, 0] == {32 * 256 + 8: 7920, 65_536: 63488, 100_000: 93840}[rows] * 128
    np.testing.assert_array_equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("shape", [(128, 4096), (2, 128, 64), (16, 128), (15, 256), (2, 8)])
def test_block_sample_of_a_short_leaf_is_its_first_block_of_8_rows(shape):
    """16 to 255 rows (a [d, vocab] head of d = 128, a scan-stacked [2, 128, 64] read as
    [2, 64, 128]): the first 8 rows, every column, against NumPy's slice; fewer than 16 rows,
    or one dimension: the leaf whole."""
    from jvitals.metrics.optimizer import block_sample

    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    got = np.asarray(jax.jit(block_sample)(x))
    m = np.swapaxes(x, -1, -2) if shape[-1] % 128 and shape[-2] % 128 == 0 else x
    m = m.reshape(-1, m.shape[-1])
    if m.shape[0] < 16:
        np.testing.assert_array_equal(got.reshape(m.shape), m)
    else:
        np.testing.assert_array_equal(got.reshape(8, m.shape[1]), m[:8])


@pytest.mark.slow
def test_window_quantile_on_a_leaf_sampled_at_32_blocks_is_near_numpys():
    """A 32,768-row leaf (sampled at every 128th block, the cap) whose rows differ in scale by
    1.5 e-folds: the median within the one-bin window of NumPy's over every value."""
    from jvitals.metrics.optimizer import window_quantile
    rng = np.random.default_rng(0)
    xs = [np.exp(rng.normal(-14, 1.5, size=(32768, 1)) + rng.normal(0, 1, size=(32768, 128))).astype(np.float32),
          np.exp(rng.normal(-10, 3, size=(512, 384))).astype(np.float32)]
    amax, got = jax.jit(lambda *a: window_quantile({(): list(a)}))(*xs)
    every = np.concatenate([x.ravel() for x in xs]).astype(np.float64)
    assert float(amax) == every.max()
    assert abs(np.log10(float(got)) - np.log10(np.median(every))) <= BIN_DECADES
