"""vitals.reduce on real 8-device CPU meshes, checked against NumPy on the gathered arrays."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jvitals as vitals
from test_stats import np_stats

AUTO = jax.sharding.AxisType.Auto
MESHES = {
    "8": ((8,), ("data",)),
    "4x2": ((4, 2), ("data", "expert")),
    "2x2x2": ((2, 2, 2), ("data", "seq", "expert")),
}


def mesh_of(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names))


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def token_spec(mesh):
    """Tokens [B, T, D]: batch over data, sequence over seq when the mesh has it."""
    return P("data", "seq" if "seq" in mesh.axis_names else None)


def padded_tokens(mesh, seed, B=8, T=12, D=6):
    """Activations with a different number of valid tokens on every shard; padding = 1e30."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D)).astype(np.float32) * 3 + 1
    n_data = mesh.shape["data"]
    per = B // n_data
    mask = np.zeros((B, T), bool)
    for shard in range(n_data):  # every shard (and every seq half) valid, in unequal numbers
        keep = min(T, T // 2 + 1 + shard)
        mask[shard * per:(shard + 1) * per, :keep] = True
        x[shard * per:(shard + 1) * per] *= shard + 1  # and with unequal local RMS
    x[~mask] = 1e30
    return x, mask


def assert_summary(s, ref, rtol=1e-6):
    assert float(s.count) == ref["count"]
    assert float(s.nonfinite) == ref["nonfinite"]
    for k in ("mean", "rms", "abs_max"):
        np.testing.assert_allclose(float(getattr(s, k)), ref[k], rtol=rtol, equal_nan=True, err_msg=k)
    np.testing.assert_allclose(float(s.std), ref["std"], rtol=1e-4, equal_nan=True, err_msg="std")


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_tokens_equal_numpy_on_gathered(mesh_name):
    mesh = mesh_of(mesh_name)
    x, mask = padded_tokens(mesh, seed=0)
    spec = token_spec(mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec), out_specs=P())
    def f(xl, ml):
        return vitals.reduce(vitals.summarize(xl, ml), mesh.axis_names)

    s = f(put(mesh, x, spec), put(mesh, mask, spec))
    assert_summary(s, np_stats(x, mask[..., None]))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_pmean_of_local_rms_would_be_wrong(mesh_name):
    mesh = mesh_of(mesh_name)
    x, mask = padded_tokens(mesh, seed=1)
    spec = token_spec(mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec), out_specs=(P(), P()))
    def f(xl, ml):
        local = vitals.summarize(xl, ml)
        naive = lax.pmean(local.rms, tuple(a for a in ("data", "seq") if a in mesh.axis_names))
        return vitals.reduce(local, mesh.axis_names).rms, naive

    ours, naive = f(put(mesh, x, spec), put(mesh, mask, spec))
    ref = np_stats(x, mask[..., None])["rms"]
    np.testing.assert_allclose(float(ours), ref, rtol=1e-6)
    assert abs(float(naive) - ref) / ref > 1e-3, "unequal shards must make pmean(local rms) wrong"


def test_replicated_leaf_is_not_double_counted():
    mesh = mesh_of("4x2")
    w = np.random.default_rng(2).normal(size=(5, 7)).astype(np.float32)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
    def f(wl):
        return vitals.reduce(vitals.summarize(wl), ("data", "expert"))

    s = f(put(mesh, w, P()))
    assert_summary(s, np_stats(w))
    assert float(s.count) == w.size


def test_expert_sharded_leaf_is_summed_over_expert_only():
    mesh = mesh_of("4x2")
    rng = np.random.default_rng(3)
    w = rng.normal(size=(4, 6, 8)).astype(np.float32)  # [E, D, F], experts over `expert`
    w[1] *= 10

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("expert"), out_specs=P())
    def f(wl):
        return vitals.reduce(vitals.summarize(wl), ("data", "expert"))

    s = f(put(mesh, w, P("expert")))
    assert_summary(s, np_stats(w))
    assert float(s.count) == w.size  # psum-ed over expert (x2), not over data (x4)


def test_specs_drive_the_reduction_where_jax_cannot_tell():
    """With check_vma=False JAX tracks nothing: specs say what is sharded."""
    mesh = mesh_of("4x2")
    rng = np.random.default_rng(4)
    x, mask = padded_tokens(mesh, seed=4)
    w_exp = rng.normal(size=(4, 3, 5)).astype(np.float32)
    w_rep = rng.normal(size=(9,)).astype(np.float32)
    in_specs = (P("data"), P("data"), P("expert"), P())
    specs = {"act": P("data"), "experts": P("expert"), "rep": P()}

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
    def f(xl, ml, we, wr):
        tree = {"act": vitals.summarize(xl, ml), "experts": vitals.summarize(we), "rep": vitals.summarize(wr)}
        return vitals.reduce(tree, ("data", "expert"), specs=specs)

    out = f(*(put(mesh, a, s) for a, s in zip((x, mask, w_exp, w_rep), in_specs)))
    assert_summary(out["act"], np_stats(x, mask[..., None]))
    assert_summary(out["experts"], np_stats(w_exp))
    assert_summary(out["rep"], np_stats(w_rep))


def test_specs_with_vma_tracking_agree():
    mesh = mesh_of("2x2x2")
    rng = np.random.default_rng(5)
    w = rng.normal(size=(4, 6)).astype(np.float32)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("expert", "seq"), out_specs=P())
    def f(wl):
        s = vitals.summarize(wl)
        return vitals.reduce({"w": s}, mesh.axis_names, specs={"w": P("expert", "seq")})

    assert_summary(f(put(mesh, w, P("expert", "seq")))["w"], np_stats(w))


def test_bf16_sharded_equals_float32_upcast():
    mesh = mesh_of("4x2")
    x, mask = padded_tokens(mesh, seed=6)
    x[~mask] = 0.0
    xb = jnp.asarray(x, jnp.bfloat16)
    up = np.asarray(xb.astype(jnp.float32))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    def f(xl, ml):
        return vitals.reduce(vitals.summarize(xl, ml), ("data", "expert"))

    sb = f(put(mesh, xb, P("data")), put(mesh, mask, P("data")))
    su = f(put(mesh, up, P("data")), put(mesh, mask, P("data")))
    for k in ("count", "sum", "sumsq", "abs_max", "nonfinite"):
        np.testing.assert_allclose(float(getattr(sb, k)), float(getattr(su, k)), rtol=1e-6)
    assert_summary(sb, np_stats(up, mask[..., None]))


def test_nan_on_one_shard_is_not_lost_by_pmax():
    mesh = mesh_of("8")
    x = np.ones((8, 4), np.float32)
    x[5, 2] = np.nan
    x[6, 1] = np.inf

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
    def f(xl):
        return vitals.reduce(vitals.summarize(xl), ("data",))

    s = f(put(mesh, x, P("data")))
    assert float(s.nonfinite) == 2 and float(s.count) == 32
    assert np.isnan(float(s.abs_max)) and np.isnan(float(s.rms)) and np.isnan(float(s.mean))


@pytest.mark.parametrize("which", ["summarize", "summarize_max"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_on_a_late_shard_under_gspmd(which, bad):
    """jit over NamedSharding arrays: the partitioner's all-reduce max may drop a NaN."""
    mesh = mesh_of("8")
    x = np.ones((8, 4), np.float32)
    x[6, 1] = bad
    x[7, 3] = -bad
    mask = np.ones((8,), bool)
    mask[7] = False  # a non-finite value in padding counts nowhere
    fn = getattr(vitals.metrics.stats, which)
    s = jax.jit(lambda a, m: fn(a, m))(put(mesh, x, P("data")), put(mesh, mask, P("data")))
    assert float(s.nonfinite) == 1 and float(s.count) == 28
    assert np.isnan(float(s.abs_max))
    healthy = jax.jit(lambda a, m: fn(a, m))(put(mesh, np.where(np.isfinite(x), x, 2.0), P("data")),
                                             put(mesh, mask, P("data")))
    assert float(healthy.nonfinite) == 0 and float(healthy.abs_max) == 2.0


def test_empty_shards_and_empty_everywhere():
    mesh = mesh_of("8")
    x = np.random.default_rng(7).normal(size=(8, 4)).astype(np.float32)
    mask = np.zeros((8,), bool)
    mask[3] = True  # only one shard has a valid row

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    def f(xl, ml):
        return vitals.reduce(vitals.summarize(xl, ml), ("data",))

    assert_summary(f(put(mesh, x, P("data")), put(mesh, mask, P("data"))), np_stats(x, mask[:, None]))
    empty = f(put(mesh, x, P("data")), put(mesh, np.zeros((8,), bool), P("data")))
    assert float(empty.count) == 0
    assert all(np.isnan(float(getattr(empty, k))) for k in ("mean", "rms", "std", "abs_max"))


def test_per_layer_summaries_reduce_per_layer():
    mesh = mesh_of("4x2")
    rng = np.random.default_rng(8)
    L = 3
    h = rng.normal(size=(L, 8, 5, 4)).astype(np.float32) * np.arange(1, L + 1)[:, None, None, None]
    mask = rng.random((8, 5)) > 0.3

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "data"), P("data")), out_specs=P())
    def f(hl, ml):
        return vitals.reduce(vitals.summarize(hl, ml, axis=0), ("data", "expert"))

    s = f(put(mesh, h, P(None, "data")), put(mesh, mask, P("data")))
    for i in range(L):
        np.testing.assert_allclose(float(s.rms[i]), np_stats(h[i], mask[..., None])["rms"], rtol=1e-6)
        assert float(s.count[i]) == mask.sum() * 4


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_global_view_jit_over_named_sharding(mesh_name, count_compiles):
    mesh = mesh_of(mesh_name)
    x, mask = padded_tokens(mesh, seed=9)
    spec = token_spec(mesh)
    f = jax.jit(lambda a, m: vitals.reduce(vitals.summarize(a, m), ()))
    xs, ms = put(mesh, x, spec), put(mesh, mask, spec)
    assert_summary(f(xs, ms), np_stats(x, mask[..., None]))
    x2 = put(mesh, x * 2, spec)
    with count_compiles() as c:
        s2 = f(x2, ms)
    assert c.count == 0
    np.testing.assert_allclose(float(s2.rms), np_stats(x * 2, mask[..., None])["rms"], rtol=1e-6)


def test_shard_map_second_call_does_not_recompile(count_compiles):
    mesh = mesh_of("4x2")
    x, mask = padded_tokens(mesh, seed=10)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    def f(xl, ml):
        return vitals.reduce(vitals.summarize(xl, ml), ("data", "expert")).rms

    xs, ms = put(mesh, x, P("data")), put(mesh, mask, P("data"))
    f(xs, ms).block_until_ready()
    x2 = put(mesh, x + 1, P("data"))
    with count_compiles() as c:
        f(x2, ms).block_until_ready()
    assert c.count == 0


def test_pmap_reduces_over_its_axis():
    x = np.random.default_rng(11).normal(size=(8, 3, 4)).astype(np.float32)
    mask = np.ones((8, 3), bool)
    mask[2, 1:] = False
    out = jax.pmap(lambda a, m: vitals.reduce(vitals.summarize(a, m), "i"), axis_name="i")(x, mask)
    assert_summary(jax.tree.map(lambda a: a[0], out), np_stats(x, mask[..., None]))


def test_unbound_axis_is_a_clear_error():
    mesh = mesh_of("4x2")

    def f(xl):
        return vitals.reduce(vitals.summarize(xl), ("data", "model"))

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))
    with pytest.raises(ValueError, match=r"mesh axis 'model' is not bound here; bound axes: \['data', 'expert'\]"):
        g(put(mesh, np.ones((8, 2), np.float32), P("data")))
    with pytest.raises(ValueError, match=r"mesh axis 'data' is not bound here; bound axes: \[\]"):
        jax.jit(lambda a: vitals.reduce(vitals.summarize(a), ("data",)))(jnp.ones(3))


def test_specs_of_the_wrong_structure_are_a_clear_error():
    mesh = mesh_of("8")

    def f(xl):
        return vitals.reduce({"a": vitals.summarize(xl)}, ("data",), specs={"b": P("data")})

    with pytest.raises(ValueError, match="specs must be a pytree of PartitionSpec"):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))(put(mesh, np.ones((8,), np.float32), P("data")))


def test_non_summary_leaves_pass_through():
    mesh = mesh_of("8")

    def f(xl):
        out = vitals.reduce({"s": vitals.summarize(xl), "tag": jnp.float32(3.0)}, ("data",))
        return out["s"].count, out["tag"]

    count, tag = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))(
        put(mesh, np.ones((16,), np.float32), P("data")))
    assert float(count) == 16 and float(tag) == 3.0


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_property_sharded_equals_numpy(data):
    mesh = mesh_of("4x2")
    B = 4 * data.draw(st.integers(1, 2))
    T = data.draw(st.integers(1, 5))
    D = data.draw(st.integers(1, 4))
    x = data.draw(hnp.arrays(np.float32, (B, T, D), elements=st.floats(-100, 100, width=32)))
    mask = data.draw(hnp.arrays(bool, (B, T)))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    def f(xl, ml):
        return vitals.reduce(vitals.summarize(xl, ml), ("data", "expert"))

    s = jax.jit(f)(put(mesh, x, P("data")), put(mesh, mask, P("data")))
    ref = np_stats(x, mask[..., None])
    assert float(s.count) == ref["count"]
    for k in ("mean", "rms", "abs_max"):
        np.testing.assert_allclose(float(getattr(s, k)), ref[k], rtol=1e-5, atol=1e-4, equal_nan=True)
