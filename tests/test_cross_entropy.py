"""jvitals.cross_entropy: the loss against optax and NumPy (float64), its figures against
NumPy and against activation_metrics on the same logits, its gradient against optax's,
under jit, on a (data, model) mesh and inside shard_map, and on the README's training step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jvitals as vitals
from jvitals import reference_model as rm
from jvitals.optim.losses import LOGIT_FIGURES


def _case(seed=0, shape=(4, 16, 50), scale=3.0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) * scale).astype(np.float32)
    labels = rng.integers(0, shape[-1], size=shape[:-1])
    mask = rng.random(shape[:-1]) > 0.25
    return x, labels, mask


def _np_figures(x, labels, mask):
    """The loss and the figures in float64, over the valid positions only."""
    v = np.asarray(x, np.float64)[mask]                     # [n, V]
    m = v.max(-1)
    lse = m + np.log(np.exp(v - m[:, None]).sum(-1))
    nll = lse - v[np.arange(len(v)), np.asarray(labels)[mask]]
    return nll.mean(), {
        "act/output_layer_logits_rms.avg": np.sqrt(np.mean(v ** 2)),
        "act/output_layer_logits_abs.max": np.abs(v).max(),
        "act/output_layer_logsumexp.mean": lse.mean(),
        "act/output_layer_logsumexp.max": lse.max(),
    }, lse


def test_loss_and_figures_match_numpy_optax_and_activation_metrics():
    x, labels, mask = _case()
    x[~mask] = np.nan                                       # garbage where masked reaches nothing
    loss, figs = jax.jit(vitals.cross_entropy)(x, labels, mask)
    want_loss, want, _ = _np_figures(x, labels, mask)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    ox = optax.softmax_cross_entropy_with_integer_labels(np.where(mask[..., None], x, 0.0), labels)
    np.testing.assert_allclose(float(loss), float(np.sum(np.where(mask, ox, 0.0)) / mask.sum()), rtol=1e-6)
    assert set(figs) == set(LOGIT_FIGURES)
    for k in LOGIT_FIGURES:
        np.testing.assert_allclose(float(figs[k]), want[k], rtol=2e-6, err_msg=k)
    am = vitals.activation_metrics({"logits": (jnp.asarray(np.where(mask[..., None], x, 0.0)),)}, mask=mask)
    for k in LOGIT_FIGURES:
        np.testing.assert_allclose(float(figs[k]), float(am[k]), rtol=2e-6, err_msg=k)


def test_without_a_mask_and_with_the_z_loss():
    x, labels, _ = _case(1)
    loss, figs = vitals.cross_entropy(x, labels)
    every = np.ones(labels.shape, bool)
    want_loss, want, lse = _np_figures(x, labels, every)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(float(figs["act/output_layer_logsumexp.mean"]), want["act/output_layer_logsumexp.mean"],
                               rtol=1e-6)
    zl, _ = vitals.cross_entropy(x, labels, z_loss_weight=1e-2)
    np.testing.assert_allclose(float(zl), want_loss + 1e-2 * np.mean(lse ** 2), rtol=1e-6)
    np.testing.assert_allclose(float(zl), float(loss + vitals.z_loss(x, weight=1e-2)), rtol=1e-6)


def test_gradient_is_optax_s_and_masked_positions_get_none():
    x, labels, mask = _case(2)

    def ours(y):
        return vitals.cross_entropy(y, labels, mask)[0]

    def ref(y):
        ce = optax.softmax_cross_entropy_with_integer_labels(y, labels)
        return jnp.sum(jnp.where(mask, ce, 0.0)) / mask.sum()

    g, want = jax.grad(ours)(jnp.asarray(x)), jax.grad(ref)(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert not np.any(np.asarray(g)[~mask])
    # The figures carry no gradient: the loss's gradient is the same with them returned as aux.
    g_aux = jax.grad(lambda y: vitals.cross_entropy(y, labels, mask), has_aux=True)(jnp.asarray(x))[0]
    np.testing.assert_array_equal(np.asarray(g_aux), np.asarray(g))


def test_bf16_logits_are_computed_in_float32():
    x, labels, mask = _case(3, scale=20.0)
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    loss, figs = vitals.cross_entropy(xb, labels, mask)
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in figs.values())
    want_loss, want, _ = _np_figures(np.asarray(xb.astype(jnp.float32)), labels, mask)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(float(figs["act/output_layer_logits_abs.max"]), want["act/output_layer_logits_abs.max"],
                               rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_valid_logit_makes_the_figures_nan(bad):
    x, labels, mask = _case(4)
    i = tuple(np.argwhere(mask)[3])
    x[i + (7,)] = bad
    loss, figs = vitals.cross_entropy(x, labels, mask)
    assert all(np.isnan(float(v)) for v in figs.values()), figs
    assert not np.isfinite(float(loss)) or bad == -np.inf     # -inf in a row that is not the label's: finite loss
    _, none = vitals.cross_entropy(x, labels, np.zeros_like(mask))
    assert all(np.isnan(float(v)) for v in none.values())      # no valid position: NaN, not 0


def test_bad_input_names_the_shapes():
    x, labels, mask = _case(5)
    with pytest.raises(ValueError, match=r"labels have shape \(4, 15\), expected .*\(4, 16\)"):
        vitals.cross_entropy(x, labels[:, :15])
    with pytest.raises(ValueError, match=r"mask has shape \(16, 4\), expected .*\(4, 16\)"):
        vitals.cross_entropy(x, labels, mask.T)
    with pytest.raises(ValueError, match="z_loss_weight=-1"):
        vitals.cross_entropy(x, labels, z_loss_weight=-1.0)
    with pytest.raises(ValueError, match="mesh axis 'data' is not bound"):
        vitals.cross_entropy(x, labels, axes="data")


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def test_sharded_under_jit_and_inside_shard_map_equal_the_whole_batch():
    x, labels, mask = _case(6, shape=(8, 16, 64))
    want_loss, want, _ = _np_figures(x, labels, mask)
    mesh = _mesh()
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
    ls = jax.device_put(labels, NamedSharding(mesh, P("data")))
    ms = jax.device_put(mask, NamedSharding(mesh, P("data")))
    loss, figs = jax.jit(vitals.cross_entropy)(xs, ls, ms)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    for k in LOGIT_FIGURES:
        np.testing.assert_allclose(float(figs[k]), want[k], rtol=2e-6, err_msg=k)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data"), P("data")), out_specs=P())
    def inside(a, b, c):
        loss, figs = vitals.cross_entropy(a, b, c, axes=("data",))
        return loss, figs

    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    loss, figs = jax.jit(inside)(put(x), put(labels), put(mask))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    for k in LOGIT_FIGURES:
        np.testing.assert_allclose(float(figs[k]), want[k], rtol=2e-6, err_msg=k)


@pytest.mark.slow
def test_on_the_readme_step_the_figures_equal_the_heavy_step_s():
    """A training step with the loss's figures every step: at the step where the sown
    logits are read too, both give the same figures; training is unchanged (the same
    loss and gradients as rm.cross_entropy)."""
    cfg = rm.ModelConfig(vocab=64, d_model=32, n_layers=2, use_probes=False)
    model = rm.Decoder(cfg)
    params = rm.init_params(cfg, jax.random.key(0))
    batch = rm.make_batch(3, cfg, batch=8, seq=32)

    def ours(p):
        logits, sown = model.apply({"params": p}, batch["tokens"], mask=batch["mask"], mutable=["intermediates"])
        loss, figs = vitals.cross_entropy(logits, batch["labels"], batch["mask"])
        return loss, (figs, sown["intermediates"])

    def theirs(p):
        logits = model.apply({"params": p}, batch["tokens"], mask=batch["mask"])
        return rm.cross_entropy(logits, batch["labels"], batch["mask"])

    (loss, (figs, inter)), g = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    want_loss, want_g = jax.jit(jax.value_and_grad(theirs))(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(float(optax.tree.norm(g)), float(optax.tree.norm(want_g)), rtol=1e-5)
    am = vitals.activation_metrics(inter, mask=batch["mask"])
    for k in LOGIT_FIGURES:
        np.testing.assert_allclose(float(figs[k]), float(am[k]), rtol=1e-5, err_msg=k)
