"""Fused-QKV layouts: contiguous [Q | K | V] and interleaved per head / per KV group.

Every grad/W{q,k,v} figure is checked against NumPy on the unfused projection, cut
out of the fused kernel the way each family's own modeling code cuts it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jvitals.metrics.gradients import gradient_metrics
from jvitals.metrics.qkv import merge_qkv, qkv_layout, qkv_part_ids, split_qkv
from jvitals.metrics.roles import QKVSplit, Roles

D = 16


def _neox_parts(w, h):
    """GPT-NeoX / Bloom: y = x @ W [D, 3D]; y.view(..., H, 3 * Dh); q, k, v = split(3, -1)."""
    dh = w.shape[-1] // (3 * h)
    r = w.reshape(w.shape[:-1] + (h, 3 * dh))
    return r[..., :dh], r[..., dh:2 * dh], r[..., 2 * dh:]


def _falcon_parts(w, h, kvh):
    """Falcon new_decoder_architecture: y.view(..., KVH, H/KVH + 2, Dh): q = [:, :-2], k = [:, -2], v = [:, -1]."""
    per = h // kvh
    dh = w.shape[-1] // (h + 2 * kvh)
    r = w.reshape(w.shape[:-1] + (kvh, per + 2, dh))
    return r[..., :per, :], r[..., per:per + 1, :], r[..., per + 1:, :]


def _gpt2_parts(w):
    """GPT-2 Conv1D [3D, D]: y = x @ W.T, split into thirds of y."""
    n = w.shape[0] // 3
    return w[:n], w[n:2 * n], w[2 * n:]


def _check(m, parts, prefix="grad"):
    for name, p in zip(("Wq", "Wk", "Wv"), parts):
        p = np.asarray(p, np.float64)
        np.testing.assert_allclose(m[f"{prefix}/{name}_abs.max"], np.abs(p).max(), rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(m[f"{prefix}/{name}_rms"], np.sqrt(np.mean(p ** 2)), rtol=1e-6, err_msg=name)


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


@pytest.mark.parametrize("h,kvh", [(4, None), (4, 4), (4, 2), (8, 1)])
def test_split_merge_roundtrip_and_numpy(h, kvh):
    kvh_ = kvh or h
    dh = 4
    n = (h + 2 * kvh_) * dh
    w = _rand((D, n))
    split = QKVSplit(num_heads=h, num_kv_heads=kvh, layout="interleaved")
    q, k, v = split_qkv(w, split)
    ref = _falcon_parts(np.asarray(w), h, kvh_)
    for got, want in zip((q, k, v), ref):
        np.testing.assert_array_equal(got, want.reshape(D, -1))
    np.testing.assert_array_equal(merge_qkv((q, k, v), split, fused_shape=w.shape), w)
    ids = qkv_part_ids(qkv_layout(w.shape, split))
    for j, want in enumerate(ref):
        np.testing.assert_array_equal(np.asarray(w)[:, ids == j], want.reshape(D, -1))


def test_split_contiguous_and_stacked():
    w = _rand((3, D, 3 * D))  # scan-stacked [L, D, 3D]
    q, k, v = split_qkv(w, QKVSplit(), stack_axis=0)
    np.testing.assert_array_equal(q, w[..., :D])
    np.testing.assert_array_equal(v, w[..., 2 * D:])
    np.testing.assert_array_equal(merge_qkv((q, k, v), QKVSplit(), stack_axis=0, fused_shape=w.shape), w)
    with pytest.raises(ValueError, match="fused_shape"):
        merge_qkv((q, k, v))
    w2 = _rand((3 * D, D))  # GPT-2 Conv1D [3D, D]: split axis 0
    for got, want in zip(split_qkv(w2), _gpt2_parts(np.asarray(w2))):
        np.testing.assert_array_equal(got, want)
    assert jax.jit(lambda x: split_qkv(x)[1])(w2).shape == (D, D)


def test_default_layout_by_family():
    r = Roles()
    assert r.qkv_layout_of("transformer/h/0/self_attention/query_key_value/kernel") == "interleaved"
    assert r.qkv_layout_of("gpt_neox/layers/0/attention/query_key_value/kernel") == "interleaved"
    assert r.qkv_layout_of("transformer/h/0/attn/c_attn/kernel") == "contiguous"
    assert r.qkv_layout_of("params/layers_0/attn/qkv/kernel") == "contiguous"
    assert Roles(qkv_split=QKVSplit(layout="contiguous")).qkv_layout_of("x/query_key_value/kernel") == "contiguous"
    with pytest.raises(ValueError, match="layout"):
        QKVSplit(layout="thirds")


def _neox_tree(layers=2, h=4, dh=4, seed=0):
    return {"gpt_neox": {"layers": {str(i): {"attention": {
        "query_key_value": {"kernel": _rand((D, 3 * h * dh), seed + i)},
        "dense": {"kernel": _rand((h * dh, D), seed + 10 + i)}}} for i in range(layers)}}}


def test_gpt_neox_layout_against_numpy():
    g = _neox_tree()
    m = gradient_metrics(g, roles=Roles(qkv_split=QKVSplit(num_heads=4)))
    ws = [np.asarray(g["gpt_neox"]["layers"][str(i)]["attention"]["query_key_value"]["kernel"]) for i in range(2)]
    parts = [np.concatenate([_neox_parts(w, 4)[j].ravel() for w in ws]) for j in range(3)]
    _check(m, parts)
    for i, w in enumerate(ws):
        q = _neox_parts(w, 4)[0]
        np.testing.assert_allclose(m[f"grad/Wq_rms/layer_{i}"], np.sqrt(np.mean(q.astype(np.float64) ** 2)),
                                   rtol=1e-6)
    # Contiguous thirds would be a different (wrong) figure here: the test can tell them apart.
    wrong = np.concatenate([w[:, :16].ravel() for w in ws])
    assert not np.isclose(m["grad/Wq_abs.max"], np.abs(wrong).max()) or not np.isclose(
        m["grad/Wq_rms"], np.sqrt(np.mean(wrong.astype(np.float64) ** 2)))


def test_interleaved_without_head_count_raises():
    with pytest.raises(ValueError, match=r"Roles\(qkv_split=QKVSplit\(num_heads=H"):
        gradient_metrics(_neox_tree())


def test_falcon_grouped_layout_stacked():
    h, kvh, dh, layers = 4, 2, 4, 3
    n = (h + 2 * kvh) * dh
    w = _rand((layers, D, n), 5)
    g = {"params": {"layers": {"self_attention": {"query_key_value": {"kernel": w}}}}}
    m = gradient_metrics(g, roles=Roles(qkv_split=QKVSplit(num_heads=h, num_kv_heads=kvh)))
    ref = _falcon_parts(np.asarray(w), h, kvh)
    _check(m, ref)
    for i in range(layers):
        np.testing.assert_allclose(m[f"grad/Wk_abs.max/layer_{i}"], np.abs(ref[1][i]).max(), rtol=1e-6)


def test_interleaved_split_axis_sharded(devices):
    """The fused axis sharded over 8 devices inside shard_map: the part of every
    global column comes from qkv_part_ids, figures equal NumPy's."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    h, dh = 8, 2
    g = {"h": {"0": {"self_attention": {"query_key_value": {"kernel": _rand((D, 3 * h * dh), 3)}}}}}
    spec = {"h": {"0": {"self_attention": {"query_key_value": {"kernel": P(None, "model")}}}}}
    g = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), g, spec)
    roles = Roles(qkv_split=QKVSplit(num_heads=h))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec,), out_specs=P())
    def f(gl):
        return gradient_metrics(gl, roles=roles, specs=spec, axes=("model",), per=("role",))

    m = jax.device_get(f(g))
    w = np.asarray(g["h"]["0"]["self_attention"]["query_key_value"]["kernel"])
    _check(m, _neox_parts(w, h))
