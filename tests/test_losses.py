"""Tests of jvitals.optim.losses.z_loss against NumPy (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvitals.optim.losses import z_loss


def _np_lse(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def _logits(dtype=jnp.float32, scale=30.0):
    return (scale * jax.random.normal(jax.random.key(0), (3, 5, 17))).astype(dtype)


def test_matches_numpy_with_and_without_a_mask():
    x = _logits()
    mask = np.random.default_rng(1).random((3, 5)) > 0.4
    lse = _np_lse(x)
    np.testing.assert_allclose(float(z_loss(x)), 1e-4 * np.mean(lse ** 2), rtol=1e-6)
    np.testing.assert_allclose(float(z_loss(x, mask, weight=0.01)), 0.01 * np.mean(lse[mask] ** 2), rtol=1e-6)
    assert float(z_loss(x, np.zeros((3, 5), bool))) == 0.0


def test_bf16_logits_are_computed_in_float32():
    x = _logits(jnp.bfloat16, scale=60.0)
    got = z_loss(x, weight=1.0)
    assert got.dtype == jnp.float32
    # The bf16 values themselves, upcast exactly: float32 accuracy, not bf16's.
    want = np.mean(_np_lse(np.asarray(x.astype(jnp.float32))) ** 2)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    g = jax.grad(lambda y: z_loss(y, weight=1.0))(x)
    assert g.dtype == jnp.bfloat16


def test_gradient_matches_numpy_and_ignores_masked_tokens():
    x = _logits().at[0, 0].set(jnp.inf)           # a masked token with garbage logits
    mask = np.ones((3, 5), bool)
    mask[0, 0] = False
    g = np.asarray(jax.jit(jax.grad(lambda y: z_loss(y, mask, weight=0.5)))(x), np.float64)
    # d/dx [w/n * sum lse^2] = w/n * 2 * lse * softmax(x)
    xn = np.asarray(x, np.float64)
    lse = np.where(mask, _np_lse(np.where(mask[..., None], xn, 0.0)), 0.0)
    soft = np.exp(np.where(mask[..., None], xn, 0.0) - lse[..., None])
    want = 0.5 / mask.sum() * 2 * lse[..., None] * soft * mask[..., None]
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-12)
    assert np.all(np.isfinite(g)) and np.all(g[0, 0] == 0)


def test_bad_input_names_the_value():
    x = _logits()
    with pytest.raises(ValueError, match=r"mask has shape \(3, 4\), expected .*\(3, 5\)"):
        z_loss(x, np.ones((3, 4), bool))
    with pytest.raises(ValueError, match=r"weight=-0.1 must be >= 0"):
        z_loss(x, weight=-0.1)
