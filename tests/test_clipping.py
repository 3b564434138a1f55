"""Tests of jvitals.optim.clipping.adaptive_clip against a plain-Python ZClip."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jvitals.optim.clipping import AdaptiveClipState, adaptive_clip


class PlainZClip:
    """ZClip's "percentile" mode in plain Python floats, structured as the paper's code:
    a warm-up buffer, then an EMA of the clipped norm; non-finite norms skipped."""

    def __init__(self, alpha, z, warmup_steps, max_norm=None):
        self.alpha, self.z, self.warmup, self.cap = alpha, z, warmup_steps, max_norm
        self.buffer, self.mean, self.var, self.seen = [], None, None, 0

    def step(self, x):
        """The threshold applied to norm ``x`` (inf: none)."""
        cap = math.inf if self.cap is None else self.cap
        if self.mean is None:
            if math.isfinite(x):
                self.buffer.append(x)
            self.seen += 1
            if self.seen >= self.warmup and self.buffer:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((b - self.mean) ** 2 for b in self.buffer) / len(self.buffer)
            return cap
        adaptive = self.mean + self.z * self.var ** 0.5
        if math.isfinite(x):
            clipped = adaptive if x > adaptive else x
            self.mean = self.alpha * self.mean + (1 - self.alpha) * clipped
            self.var = self.alpha * self.var + (1 - self.alpha) * (clipped - self.mean) ** 2
        return min(adaptive, cap)


def _norms():
    rng = np.random.default_rng(0)
    x = list(1.0 + 0.1 * rng.standard_normal(40))
    x[3] = math.nan        # in the warm-up: not counted
    x[14] = 40.0           # a spike: clipped, and only its clipped value enters the EMA
    x[15] = 25.0           # a second one right after
    x[22] = math.nan       # leaves the EMA unchanged
    x[23] = math.inf
    x[30] = 0.2            # a dip: not clipped
    return x


DIRECTION = {"a": np.arange(1.0, 13.0, dtype=np.float32).reshape(3, 4), "b": -np.ones(5, np.float32)}


def _grads(norm):
    n = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in DIRECTION.values()))
    return {k: v * np.float32(norm / n) for k, v in DIRECTION.items()}


def _run(tx, norms, state=None):
    step = jax.jit(tx.update)
    state = tx.init(DIRECTION) if state is None else state
    out = []
    for x in norms:
        upd, state = step(_grads(x), state)
        post = float(np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(upd))))
        out.append((float(state.clip_threshold), post, float(state.mean), float(state.var), upd))
    return out, state


@pytest.mark.parametrize("max_norm", [None, 1.15])
def test_matches_plain_python_zclip_over_spikes_and_nans(max_norm):
    norms = _norms()
    ref = PlainZClip(0.9, 2.0, 10, max_norm)
    got, state = _run(adaptive_clip(alpha=0.9, z=2.0, warmup_steps=10, max_norm=max_norm), norms)
    assert isinstance(state, AdaptiveClipState)
    clipped_any = False
    for t, (x, (thr, post, mean, var, upd)) in enumerate(zip(norms, got)):
        want = ref.step(x)
        if math.isinf(want):
            assert math.isinf(thr), t
        else:
            assert thr == pytest.approx(want, rel=2e-6), t
        if ref.mean is not None:
            assert mean == pytest.approx(ref.mean, rel=2e-6), t
            assert var == pytest.approx(ref.var, rel=2e-5), t
        if math.isfinite(x):
            assert post == pytest.approx(min(x, want), rel=2e-6), t
            clipped_any |= x > want
            # The direction is kept: the update is the gradient times min(1, thr / x).
            for k, v in DIRECTION.items():
                np.testing.assert_allclose(np.asarray(upd[k]), _grads(min(x, want))[k], rtol=2e-6, atol=1e-7)
        else:
            assert not np.isfinite(post), t   # as optax.clip_by_global_norm
    assert clipped_any
    # The spike at 14 was clipped at the threshold from the updates before it.
    assert got[14][1] == pytest.approx(got[14][0], rel=1e-6) and got[14][0] < 2.0
    assert int(state.count) == len(norms) and int(state.num_finite) == 9


def test_warmup_without_max_norm_does_not_clip_and_threshold_is_inf():
    tx = adaptive_clip(warmup_steps=3)
    got, state = _run(tx, [1.0, 100.0, 2.0])
    for thr, post, *_ in got:
        assert math.isinf(thr)
    assert [g[1] for g in got] == pytest.approx([1.0, 100.0, 2.0], rel=1e-6)
    assert state.clip_threshold.dtype == jnp.float32 and state.clip_threshold.shape == ()
    # Warm-up norms all non-finite: the warm-up goes on until a finite one arrives.
    got, state = _run(adaptive_clip(warmup_steps=2), [math.nan, math.nan, math.nan, 3.0, 9.0])
    assert all(math.isinf(g[0]) for g in got[:4])
    assert got[4][0] == pytest.approx(3.0) and got[4][1] == pytest.approx(3.0, rel=1e-6)


def test_state_round_trips_through_orbax_and_continues_identically(tmp_path):
    import orbax.checkpoint as ocp

    norms = _norms()
    tx = adaptive_clip(alpha=0.9, z=2.0, warmup_steps=10, max_norm=5.0)
    whole, _ = _run(tx, norms)
    first, state = _run(tx, norms[:17])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "clip", state)
        ckpt.wait_until_finished()
        back = ckpt.restore(tmp_path / "clip", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert isinstance(back, AdaptiveClipState)
    rest, _ = _run(tx, norms[17:], back)
    for a, b in zip(whole, first + rest):
        np.testing.assert_array_equal(np.asarray(a[:4]), np.asarray(b[:4]))


def test_in_a_chain_on_a_mesh_with_bf16_grads(devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    g = {"w": jax.device_put(jnp.ones((16, 4), jnp.bfloat16), sh), "b": jnp.ones((3,), jnp.float32)}
    tx = optax.chain(adaptive_clip(warmup_steps=1, max_norm=2.0), optax.sgd(1.0))
    state = tx.init(g)
    upd, state = jax.jit(tx.update)(g, state)
    assert upd["w"].dtype == jnp.bfloat16
    want = optax.clip_by_global_norm(2.0).update(g, optax.EmptyState())[0]
    np.testing.assert_allclose(np.asarray(upd["w"], np.float32), -np.asarray(want["w"], np.float32), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(upd["b"]), -np.asarray(want["b"]), rtol=1e-6)
    assert float(state[0].clip_threshold) == 2.0 and float(state[0].mean) == pytest.approx(math.sqrt(67))


@pytest.mark.parametrize("kw,match", [
    (dict(alpha=1.0), r"alpha=1.0 must be a number in \(0, 1\)"),
    (dict(alpha=0), r"alpha=0 must"),
    (dict(z=0.0), r"z=0.0 must be a positive number"),
    (dict(z=-1), r"z=-1 must"),
    (dict(warmup_steps=0), r"warmup_steps=0 must be an int >= 1"),
    (dict(warmup_steps=2.5), r"warmup_steps=2.5 must"),
    (dict(max_norm=0.0), r"max_norm=0.0 must be None or a positive number"),
    (dict(max_norm=float("nan")), r"max_norm=nan must"),
])
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        adaptive_clip(**kw)
