"""moe_metrics and the MoE window against NumPy; sharded counts; bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jvitals.metrics.moe import MoEWindowState, moe_metrics, moe_window_init, moe_window_update


def np_moe(c, top_k, bias=None, ids=None):
    c = np.asarray(c, np.float64)
    L, E = c.shape
    ids = list(range(L)) if ids is None else ids
    out = {}
    mean, mx = c.mean(1), c.max(1)
    valid = mean > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        maxvio = np.where(valid, (mx - mean) / mean, np.nan)
        imb = np.where(valid, mx / mean, np.nan)
        cv = np.where(valid, c.std(1) / mean, np.nan)
    dead = (c == 0).mean(1)
    out["moe/dead_expert_ratio"] = (c == 0).mean()
    agg = lambda f, x: f(x[valid]) if valid.any() else np.nan
    out["moe/maxvio.mean"] = agg(np.mean, maxvio)
    out["moe/maxvio.max"] = agg(np.max, maxvio)
    out["moe/load_imbalance"] = out["moe/load_imbalance.max"] = agg(np.max, imb)
    out["moe/load_imbalance.mean"] = agg(np.mean, imb)
    out["moe/load_cv.mean"] = agg(np.mean, cv)
    out["moe/load_cv.max"] = agg(np.max, cv)
    tokens = c.sum() / (L * top_k)  # tokens routed per MoE layer, mean over layers
    out["moe/window_tokens"] = tokens
    out["moe/expected_tokens_per_expert"] = tokens * top_k / E
    if bias is not None:
        out["moe/ep_bias_abs_sum"] = np.abs(np.asarray(bias, np.float64)).sum()
    for j, i in enumerate(ids):
        out[f"moe/maxvio/layer_{i}"] = maxvio[j]
        out[f"moe/load_imbalance/layer_{i}"] = imb[j]
        out[f"moe/load_cv/layer_{i}"] = cv[j]
        out[f"moe/dead_expert_ratio/layer_{i}"] = dead[j]
    return out


def check(got, want):
    got = jax.device_get(got)
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        np.testing.assert_allclose(np.float64(got[k]), want[k], rtol=1e-6, err_msg=k)


def routed_counts(rng, L, E, tokens, top_k, dead=()):
    """Counts as a router makes them: each token picks top_k distinct experts."""
    c = np.zeros((L, E), np.int32)
    for l in range(L):
        alive = np.array([e for e in range(E) if (l, e) not in dead])
        p = rng.dirichlet(np.ones(len(alive)) * 0.5)
        for _ in range(tokens):
            c[l, rng.choice(alive, size=top_k, replace=False, p=p)] += 1
    return c


def test_stacked_counts_match_numpy():
    rng = np.random.default_rng(0)
    c = routed_counts(rng, 3, 8, 50, 2, dead={(0, 1), (2, 5), (2, 6)})
    bias = rng.normal(size=(3, 8)).astype(np.float32)
    got = jax.jit(lambda c, b: moe_metrics(c, expert_bias=b, top_k=2))(c, bias)
    check(got, np_moe(c, 2, bias))
    assert got["moe/dead_expert_ratio"] >= 3 / 24


def test_pytree_of_layers_in_model_order_and_zero_mean_layer_excluded():
    rng = np.random.default_rng(1)
    ids = [1, 2, 10]
    c = routed_counts(rng, 3, 4, 20, 1)
    c[1] = 0  # layer 2 routed nothing in the window: excluded from maxvio/imbalance/cv
    sown = {f"layers_{i}": {"moe": {"expert_counts": (jnp.asarray(c[j]),)}} for j, i in enumerate(ids)}
    params = {f"layers_{i}": {"moe": {"expert_bias": jnp.full((4,), 0.5 * i), "router": {"kernel": jnp.ones((2, 4))}}}
              for i in ids}
    got = jax.jit(lambda s, p: moe_metrics(s, expert_bias=p, top_k=1))(sown, params)
    want = np_moe(c, 1, np.concatenate([np.full(4, 0.5 * i) for i in ids]), ids=ids)
    want["moe/window_tokens"] = c.sum() / 3  # mean over layers, zero layer included
    want["moe/expected_tokens_per_expert"] = want["moe/window_tokens"] / 4
    check(got, want)
    assert np.isnan(got["moe/maxvio/layer_2"]) and np.isfinite(got["moe/maxvio.max"])


def test_all_layers_empty_gives_nan_not_error():
    got = jax.jit(lambda c: moe_metrics(c, top_k=2))(jnp.zeros((2, 4), jnp.int32))
    assert np.isnan(got["moe/maxvio.mean"]) and got["moe/dead_expert_ratio"] == 1.0
    assert got["moe/window_tokens"] == 0


def test_window_accumulates_resets_and_checkpoints(tmp_path):
    rng = np.random.default_rng(2)
    steps = [routed_counts(rng, 2, 4, 10, 2) for _ in range(3)]
    upd = jax.jit(moe_window_update)
    w = moe_window_init(2, 4)
    for s in steps:
        w = upd(w, s)
    assert int(w.steps) == 3 and w.counts.dtype == jnp.int32
    np.testing.assert_array_equal(w.counts, sum(steps))
    m = moe_metrics(w, top_k=2)
    want = np_moe(sum(steps), 2)
    want["moe/window_steps"] = 3
    check(m, want)
    w2 = jax.jit(moe_window_update)(w, steps[0], reset=jnp.array(True))
    np.testing.assert_array_equal(w2.counts, steps[0])
    assert int(w2.steps) == 1
    # checkpoint round trip (non-default values) with orbax
    import orbax.checkpoint as ocp
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "w", w)
    ckpt.wait_until_finished()
    back = ckpt.restore(tmp_path / "w", jax.tree.map(jnp.zeros_like, w))
    assert isinstance(back, MoEWindowState)
    np.testing.assert_array_equal(back.counts, w.counts)
    assert int(back.steps) == 3


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"top_k=5 exceeds the number of experts E=4"):
        moe_metrics(jnp.ones((2, 4)), top_k=5)
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\) \(rank 3\): expected \[E\]"):
        moe_metrics(jnp.ones((2, 3, 4)), top_k=1)
    with pytest.raises(ValueError, match="positive int"):
        moe_metrics(jnp.ones((4,)), top_k=0)
    with pytest.raises(ValueError, match="has 3 experts, earlier layers 4"):
        moe_metrics({"layers_0": jnp.ones(4), "layers_1": jnp.ones(3)}, top_k=1)
    with pytest.raises(ValueError, match=r"window holds \(2, 4\)"):
        moe_window_update(moe_window_init(2, 4), jnp.ones((3, 4)))


def test_shard_map_counts_psummed_over_token_axes():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(3)
    per_dev = np.stack([routed_counts(rng, 2, 8, 6, 2) for _ in range(8)])  # [devices, L, E]
    per_dev[:, 1, 3] = 0  # an expert dead on every shard
    bias = rng.normal(size=(2, 8)).astype(np.float32)
    total = per_dev.sum(0)

    def f(c, b, w):
        c = c[0]  # this device's [L, E]
        m = moe_metrics(c, expert_bias=b, top_k=2, axes=("data", "expert"))
        w = moe_window_update(w, c, axes=("data", "expert"))
        return m, w

    cs = jax.device_put(per_dev, NamedSharding(mesh, P(("data", "expert"))))
    bs = jax.device_put(bias, NamedSharding(mesh, P(None, "expert")))
    w0 = moe_window_init(2, 8)
    m, w = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(("data", "expert")), P(None, "expert"), P()),
                                 out_specs=(P(), P())))(cs, bs, w0)
    check(m, np_moe(total, 2, bias))
    np.testing.assert_array_equal(w.counts, total)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unscanned", "scanned"])
def test_reference_model_sown_intermediates(scan):
    rm = pytest.importorskip("jvitals.reference_model")
    cfg = rm.ModelConfig(d_model=16, head_dim=4, d_expert=8, vocab=32, n_layers=3, moe=True, scan_layers=scan)
    params = jax.jit(lambda k: rm.init_params(cfg, k))(jax.random.key(0))
    batch = rm.make_batch(0, cfg, 2, 8)
    inter = jax.jit(lambda p, b: rm.loss_fn(p, b, cfg)[1])(params, batch)
    got = jax.jit(lambda i, p: moe_metrics(i, expert_bias=p, top_k=cfg.top_k))(inter, params)
    leaves = [(jax.tree_util.keystr(p, simple=True, separator="/"), np.asarray(x))
              for p, x in jax.tree_util.tree_flatten_with_path(inter)[0]
              if "expert_counts" in jax.tree_util.keystr(p, simple=True, separator="/")]
    if scan:
        c = leaves[0][1].reshape(cfg.n_layers, cfg.n_experts)
    else:
        leaves.sort(key=lambda t: int(t[0].split("layers_")[1].split("/")[0]))
        c = np.stack([x.reshape(-1) for _, x in leaves])
    bias = np.concatenate([np.asarray(x).ravel() for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                           if jax.tree_util.keystr(p, simple=True, separator="/").endswith("expert_bias")])
    check(got, np_moe(c, cfg.top_k, bias))
    assert np.isclose(got["moe/window_tokens"], np.asarray(batch["mask"]).sum())


def test_layer_loads_leave_out_layers_that_routed_nothing():
    from jvitals.metrics.moe import _check_top_k, _layer_loads

    c = jnp.asarray([[4.0, 0.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    loads = _layer_loads(c)
    np.testing.assert_array_equal(loads["valid"], [True, False, True])
    np.testing.assert_allclose(loads["maxvio"], [1.0, np.nan, 0.0])
    np.testing.assert_allclose(loads["load_imbalance"], [2.0, np.nan, 1.0])
    np.testing.assert_allclose(loads["load_cv"], [np.std([4, 0, 2, 2]) / 2, np.nan, 0.0], rtol=1e-6)
    np.testing.assert_allclose(loads["dead_expert_ratio"], [0.25, 1.0, 0.0])
    _check_top_k(2, (3, 4))
    with pytest.raises(ValueError, match="exceeds the number of experts E=4"):
        _check_top_k(5, (3, 4))
    with pytest.raises(ValueError, match="positive int"):
        _check_top_k(True, (3, 4))
