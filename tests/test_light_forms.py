"""The light step's update figures (plain sums of the change the step applies, ``(p + u) - p``,
beside the parameters the step holds anyway: every backend) against NumPy, and against the
figures of the updates themselves (``light._update_groups``, where the step gives no
parameters) where the updates are far above float32's resolution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jvitals.metrics import gradients as G
from jvitals.metrics import light as L
from jvitals.metrics.roles import Roles

from test_record import applied_change, np_norm, tree


def _forms(params, updates):
    plan, _, _ = G.plan_leaves(params, roles=Roles(), specs=None, axes=(), need_roles=True, split_qkv=False,
                               what="grads")
    p_norm = jnp.asarray(np_norm(params), jnp.float32)
    pn = {g: jnp.asarray(np_norm(params[k]), jnp.float32)
          for g, k in (("layer_0", "layers_0"), ("layer_1", "layers_1"), ("embedding", "embed_tokens"),
                       ("lm_head", "lm_head"))}
    one_read = jax.jit(lambda u: L._update_groups(u, Roles(), p_norm, pn))(updates)
    cpu = jax.jit(lambda u, p: L._applied_groups(u, p, plan, p_norm, pn))(updates, params)   # p: not a constant
    return jax.device_get(one_read), jax.device_get(cpu), pn


@pytest.mark.parametrize("ratio", [1e-2, 1e-4])
def test_both_forms_against_numpy(ratio):
    params = tree(0)
    updates = jax.tree.map(lambda p: p * 0 + ratio * jnp.asarray(
        np.random.default_rng(1).normal(size=p.shape).astype(np.float32)), params)
    one_read, cpu, pn = _forms(params, updates)
    assert set(one_read) == set(cpu)                 # one output structure for platform_dependent
    applied = jax.tree.map(applied_change, params, updates)
    np.testing.assert_allclose(one_read["update/global_norm"], np_norm(updates), rtol=5e-6)   # float32 sums
    np.testing.assert_allclose(cpu["update/global_norm"], np_norm(applied), rtol=5e-6)
    for g, k in (("layer_0", "layers_0"), ("layer_1", "layers_1"), ("embedding", "embed_tokens"),
                 ("lm_head", "lm_head")):
        np.testing.assert_allclose(one_read[f"update/param_ratio/{g}"],
                                   np_norm(updates[k]) / float(pn[g]), rtol=1e-5)
        np.testing.assert_allclose(cpu[f"update/param_ratio/{g}"], np_norm(applied[k]) / float(pn[g]), rtol=1e-5)
        # The two measure the same update up to float32's rounding of p + u: ~1e-7 / ratio.
        np.testing.assert_allclose(cpu[f"update/param_ratio/{g}"], one_read[f"update/param_ratio/{g}"],
                                   rtol=30 * 6e-8 / ratio)
    assert int(cpu["update/nonfinite_count"]) == int(one_read["update/nonfinite_count"]) == 0


def test_a_non_finite_update_is_counted_by_both():
    params = tree(0)
    updates = jax.tree.map(lambda p: 1e-3 * p, params)
    updates["layers_1"]["mlp"]["up_proj"]["kernel"] = updates["layers_1"]["mlp"]["up_proj"]["kernel"].at[0, :3].set(
        jnp.nan)
    one_read, cpu, _ = _forms(params, updates)
    for f in (one_read, cpu):
        assert np.isnan(f["update/global_norm"]) and int(f["update/nonfinite_count"]) == 3
        assert np.isnan(f["update/param_ratio/layer_1"])
        assert np.isfinite(f["update/param_ratio/layer_0"])


def test_the_recorder_on_the_cpu_takes_the_applied_change():
    """record(chain(clip, adamw)) under jit on this backend: the light step's update norm is
    the change the step applies (NumPy float32), and the compiled step holds no more reductions
    over a parameter-sized array than the forms need."""
    import jvitals as vitals
    params, grads = tree(0), tree(1)
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    updates, state = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=False))(grads, tx.init(params), params)
    m = jax.device_get(vitals.recorded(state))
    applied = jax.tree.map(applied_change, params, updates)
    np.testing.assert_allclose(float(m["update/global_norm"]), np_norm(applied), rtol=1e-6)
    np.testing.assert_allclose(float(m["update/param_ratio"]), np_norm(applied) / np_norm(params), rtol=1e-6)
    np.testing.assert_allclose(float(m["update/global_norm"]), np_norm(updates), rtol=1e-3)
