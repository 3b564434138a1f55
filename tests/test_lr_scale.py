"""Tests of jvitals.lr_scale: a learning-rate scale that works with any optax schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from jvitals.lr_scale import LR_SCALE, LR_SCALE_ARG, get_lr_scale, has_lr_scale, set_lr_scale, with_lr_scale


def _params():
    return {"w": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 10, "b": jnp.ones(4)}


def _grads(i):
    return jax.tree.map(lambda x: jnp.sin(x + i), _params())


def _run(tx, steps=6, scale=None):
    params = _params()
    state = tx.init(params)
    if scale is not None:
        state = set_lr_scale(state, scale)
    out = []
    for i in range(steps):
        upd, state = tx.update(_grads(i), state, params)
        params = optax.apply_updates(params, upd)
        out.append(upd)
    return out, params, state


@pytest.mark.parametrize("make", [
    lambda lr: optax.sgd(lr),
    lambda lr: optax.adam(lr),
    lambda lr: optax.adamw(lr, weight_decay=0.1),
])
def test_scale_equals_a_scaled_schedule_at_every_step(make):
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-3)
    got, p_got, _ = _run(with_lr_scale(make(sched)), scale=0.9)
    want, p_want, _ = _run(make(lambda c: 0.9 * sched(c)))
    for g, w in zip(got, want):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), g, w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), p_got, p_want)


def test_default_scale_is_identity_and_float32_with_bf16_params():
    got, _, state = _run(with_lr_scale(optax.adam(1e-2)))
    want, _, _ = _run(optax.adam(1e-2))
    for g, w in zip(got, want):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), g, w)
    assert get_lr_scale(state) == 1.0
    tx = with_lr_scale(optax.adam(1e-2))
    bf = tx.init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params()))
    assert bf.hyperparams[LR_SCALE].dtype == jnp.float32
    bf = set_lr_scale(bf, 0.9 ** 3)
    assert bf.hyperparams[LR_SCALE].dtype == jnp.float32
    assert get_lr_scale(bf) == pytest.approx(0.729, rel=1e-7)


def test_found_anywhere_in_nested_states():
    inner = with_lr_scale(optax.adam(1e-3))
    tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
    opt_state = tx.init(_params())
    ts = train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx)
    as_dict = {"params": _params(), "opt_state": opt_state, "step": 0}
    for tree in (opt_state, ts, as_dict):
        assert has_lr_scale(tree)
        new = set_lr_scale(tree, 0.5)
        assert type(new) is type(tree)
        assert get_lr_scale(new) == 0.5
        assert get_lr_scale(tree) == 1.0          # the input is not modified
    # Inside another inject_hyperparams state (which has no lr_scale of its own).
    outer = optax.inject_hyperparams(lambda learning_rate: with_lr_scale(optax.sgd(learning_rate)))(
        learning_rate=0.1)
    st = outer.init(_params())
    assert get_lr_scale(set_lr_scale(st, 0.25)) == 0.25
    assert get_lr_scale(set_lr_scale(st, 0.25).inner_state) == 0.25


def test_errors_say_what_to_do():
    st = optax.adam(1e-3).init(_params())
    assert not has_lr_scale(st)
    with pytest.raises(ValueError, match="with_lr_scale"):
        get_lr_scale(st)
    with pytest.raises(ValueError, match="with_lr_scale"):
        set_lr_scale(st, 0.9)
    a = with_lr_scale(optax.sgd(0.1)).init(_params())
    b = set_lr_scale(with_lr_scale(optax.sgd(0.1)).init(_params()), 0.5)
    with pytest.raises(ValueError, match="differ"):
        get_lr_scale((a, b))


def test_setting_the_scale_does_not_retrace():
    tx = with_lr_scale(optax.adam(1e-2))
    traces = []

    @jax.jit
    def step(params, opt_state, grads):
        traces.append(1)
        upd, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    params = jax.device_put(_params())
    opt_state = jax.device_put(tx.init(params))
    grads = jax.device_put(_grads(0))
    params, opt_state = step(params, opt_state, grads)
    params, opt_state = step(params, opt_state, grads)
    for v in (0.9, 0.81, 1.0):
        opt_state = set_lr_scale(opt_state, v)
        params, opt_state = step(params, opt_state, grads)
    assert len(traces) == 1
    assert get_lr_scale(opt_state) == 1.0


def test_keeps_sharding_on_a_mesh(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tx = with_lr_scale(optax.adam(1e-2))
    opt_state = jax.device_put(tx.init(_params()), rep)
    new = set_lr_scale(opt_state, 0.9)
    assert new.hyperparams[LR_SCALE].sharding == rep
    assert get_lr_scale(new) == pytest.approx(0.9)


def test_set_inside_jit():
    tx = with_lr_scale(optax.sgd(1.0))
    st = tx.init(_params())
    out = jax.jit(lambda s: set_lr_scale(s, 0.5))(st)
    assert get_lr_scale(out) == 0.5


def _probe(seen):
    """A transform that records the extra arguments its update receives."""
    def update(updates, state, params=None, **extra):
        seen.append(dict(extra))
        return updates, state
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def test_inner_update_receives_the_global_scale_in_force():
    seen = []
    tx = with_lr_scale(optax.chain(_probe(seen), optax.sgd(0.1)), 0.5)
    st = tx.init(_params())
    tx.update(_grads(0), st, loss=1.25)
    assert seen[-1]["loss"] == 1.25
    assert seen[-1][LR_SCALE_ARG].dtype == np.float32 and seen[-1][LR_SCALE_ARG] == np.float32(0.5)
    st = set_lr_scale(st, 0.8)
    jax.jit(lambda g, s: tx.update(g, s))(_grads(0), st)
    assert seen[-1][LR_SCALE_ARG].dtype == jnp.float32 and seen[-1][LR_SCALE_ARG].shape == ()
    # Nested wrappers: the inner one sees the product of both scales.
    seen.clear()
    tx2 = with_lr_scale(with_lr_scale(optax.chain(_probe(seen), optax.sgd(0.1)), 0.5), 0.25)
    tx2.update(_grads(0), tx2.init(_params()))
    assert seen[-1][LR_SCALE_ARG] == np.float32(0.125)
    # Plain GradientTransformations (no extra args) inside still work.
    plain = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
    tx3 = with_lr_scale(optax.chain(plain, optax.sgd(1.0)), 0.5)
    upd, _ = tx3.update(_grads(0), tx3.init(_params()))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, -0.5 * np.asarray(b), rtol=1e-6), upd, _grads(0))
    tx4 = with_lr_scale(plain, 0.5)
    upd, _ = tx4.update(_grads(0), tx4.init(_params()))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 0.5 * np.asarray(b), rtol=1e-6), upd, _grads(0))
