"""Issue 35: nothing between two checks goes unseen.

The recorder's window (jvitals/metrics/window.py) against NumPy over the per-step figures of
real training, and against the corpus' NumPy simulation of it (benchmarks/windows.py); an
in-step skip (jvitals.skip_step) against a NumPy re-implementation of its rule; and, on real
training of the reference model checked every 10 steps, a NaN step, a one-step loss spike
and a skipped update between two checks each reaching the next check with their step.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jvitals as vitals
from jvitals import reference_model as rm
from jvitals.metrics import window as W

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("jvitals_bench_windows", ROOT / "benchmarks" / "windows.py")
bench_windows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_windows)

CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2)


class State(NamedTuple):
    params: Any
    opt_state: Any


def _tx(lr: float = 3e-3, skip: bool = False, finite: bool = False) -> optax.GradientTransformation:
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))
    if finite:
        opt = optax.apply_if_finite(opt, max_consecutive_errors=3)
    if skip:
        opt = vitals.skip_step(opt, window=64)
    return vitals.with_lr_scale(vitals.record(opt, schedule=lr))


@functools.lru_cache(maxsize=None)
def _step_fn(skip: bool, finite: bool):
    tx = _tx(skip=skip, finite=finite)

    @jax.jit
    def step(state: State, batch: dict, read: jax.Array, weight: jax.Array):
        def loss_of(p):
            loss, _ = rm.loss_fn(p, batch, CFG)
            return loss * weight
        loss, grads = jax.value_and_grad(loss_of)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=loss, vitals_heavy=False,
                                       vitals_read=read)
        return State(optax.apply_updates(state.params, updates), opt_state), loss

    return tx, step


def _batch(i: int, corrupt: bool = False) -> dict:
    b = rm.make_batch(i, CFG, batch=4, seq=16)
    if corrupt:   # random tokens and labels: the loss jumps to chance level for this batch
        rng = np.random.default_rng(10_000 + i)
        b = dict(b, tokens=jnp.asarray(rng.integers(2, CFG.vocab, b["tokens"].shape), jnp.int32),
                 labels=jnp.asarray(rng.integers(2, CFG.vocab, b["labels"].shape), jnp.int32))
    return b


def train(steps: int, cadence: int, *, skip: bool = False, finite: bool = False, nan_at: int | None = None,
          corrupt_at: tuple[int, ...] = (), monitor: vitals.Monitor | None = None, every_step: bool = False):
    """Real training of the reference model; the host reads the recorder every ``cadence``
    steps (``vitals_read``). Returns per-step records, the checks' host figures and verdicts."""
    tx, step = _step_fn(skip, finite)
    params = rm.init_params(CFG, jax.random.key(0))
    state = State(params, tx.init(params))
    per_step, checks, verdicts = [], [], []
    for i in range(steps):
        read = i % cadence == 0
        weight = jnp.float32(np.nan if i == nan_at else 1.0)
        before = state.params
        state, loss = step(state, _batch(i, i in corrupt_at), jnp.asarray(read), weight)
        if every_step or read:
            rec = jax.device_get(vitals.recorded(state.opt_state))
            if every_step:
                same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                                 jax.tree.leaves(state.params)))
                per_step.append({"loss": float(loss), **{k: float(v) for k, v in rec.latest().items()},
                                 "unchanged": same})
            if read:
                host = {"loss": float(loss), **{k: float(v) for k, v in rec.items()}}
                checks.append((i, host))
                if monitor is not None:
                    verdicts.append(monitor.update(i, host))
    return per_step, checks, verdicts


# ----------------------------------------------------------------------------------------------
# The window against NumPy.


def test_window_names_are_the_monitor_and_the_corpus_contract():
    names = W.window_names(["loss", "grad/global_norm", "grad/global_norm_post_clip", "update/param_ratio"])
    assert tuple(bench_windows.WINDOW_FIGURES) == W.WINDOW_FIGURES
    got = bench_windows.window({f: np.arange(5.0) + 1 for f in W.WINDOW_FIGURES}, np.zeros(5, bool), 0, 4)
    # the corpus' trainers revert the recorder with their loss-scale skip: no skip reaches a window there
    assert set(got) == set(names) - {"window/skipped_steps", "window/first_skipped_ago"}
    from jvitals.monitor import rules_window
    assert rules_window.WINDOW == W.WINDOW_PREFIX


def test_window_on_real_training_matches_numpy_and_the_corpus_simulation():
    cadence = 7
    per_step, checks, _ = train(40, cadence, every_step=True, corrupt_at=(17,))
    assert checks and per_step
    dense = {f: np.array([r[f] for r in per_step]) for f in W.WINDOW_FIGURES}
    bad = np.zeros(len(per_step), bool)
    prev = -1
    for s, host in checks:
        a = prev + 1
        want = bench_windows.window(dense, bad, a, s)
        for f in W.WINDOW_FIGURES:
            x = dense[f][a:s + 1]
            np.testing.assert_allclose(host[f"window/{f}.max"], x.max(), rtol=1e-6)
            np.testing.assert_allclose(host[f"window/{f}.min"], x.min(), rtol=1e-6)
            np.testing.assert_allclose(host[f"window/{f}.mean"], x.mean(), rtol=1e-5)
            np.testing.assert_allclose(host[f"window/{f}.std"], x.std(), rtol=1e-3, atol=1e-6)
            assert host[f"window/{f}.max_ago"] == s - (a + int(np.argmax(x)))
            assert host[f"window/{f}.n"] == len(x)
        for k, v in want.items():
            np.testing.assert_allclose(host[k], v, rtol=1e-3, atol=1e-6, err_msg=k)
        assert host["window/steps"] == s - a + 1 and host["window/nonfinite_steps"] == 0
        prev = s
    # The corrupt batch at 17 is the loss's maximum of the window that holds it.
    (s17, h17), = [(s, h) for s, h in checks if s - cadence < 17 <= s]
    assert s17 - h17["window/loss.max_ago"] == 17


@pytest.mark.slow
def test_without_vitals_read_each_update_is_its_own_window():
    tx = _tx()
    params = rm.init_params(CFG, jax.random.key(0))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for i in range(3):
        _, state = tx.update(grads, state, params, loss=jnp.float32(i + 1.0))
    m = jax.device_get(vitals.recorded(state))
    assert m["window/steps"] == 1 and m["window/loss.max"] == 3.0 and m["window/loss.max_ago"] == 0
    # no loss given: the loss entries are not fresh, so not shown (and the state holds no NaN)
    _, state = tx.update(grads, state, params)
    m = jax.device_get(vitals.recorded(state))
    assert "window/loss.max" not in m and "window/steps" in m
    assert np.all(np.isfinite(np.asarray(vitals.recorded(state).vector)))


def test_update_window_against_a_numpy_loop():
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(30, len(W.WINDOW_FIGURES))).astype(np.float32)
    xs[5, 0] = np.nan
    xs[11, 1] = np.inf
    names = W.window_names(list(W.WINDOW_FIGURES))
    w = W.empty_window(names)
    step = jax.jit(W.update_window)
    resets = {0, 9, 20}
    start = 0
    for i in range(30):
        if i in resets:
            start = i
        vals = dict(zip(W.WINDOW_FIGURES, xs[i]))
        bad = not np.all(np.isfinite(xs[i]))
        w = step(w, jnp.asarray(i in resets), vals, jnp.asarray(bad), jnp.asarray(i % 7 == 3))
        seg = xs[start:i + 1]
        for j, f in enumerate(W.WINDOW_FIGURES):
            col = seg[:, j]
            ok = np.isfinite(col)
            v = col[ok]
            np.testing.assert_allclose(float(w[f"window/{f}.max"]), v.max(), rtol=1e-6)
            np.testing.assert_allclose(float(w[f"window/{f}.min"]), v.min(), rtol=1e-6)
            np.testing.assert_allclose(float(w[f"window/{f}.mean"]), v.mean(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(float(w[f"window/{f}.std"]), v.std(), rtol=1e-4, atol=1e-6)
            assert float(w[f"window/{f}.max_ago"]) == i - (start + np.flatnonzero(ok)[np.argmax(v)])
        badrows = [k for k in range(start, i + 1) if not np.all(np.isfinite(xs[k]))]
        skips = [k for k in range(start, i + 1) if k % 7 == 3]
        assert float(w["window/nonfinite_steps"]) == len(badrows)
        assert float(w["window/first_nonfinite_ago"]) == (i - badrows[0] if badrows else -1)
        assert float(w["window/skipped_steps"]) == len(skips)
        assert float(w["window/first_skipped_ago"]) == (i - skips[0] if skips else -1)


# ----------------------------------------------------------------------------------------------
# The in-step skip against NumPy.


def _np_skip(losses, norms, window, sigma, warm):
    """The skip decisions of skip_step, re-implemented in NumPy."""
    out, hl, hg = [], [], []
    for l, g in zip(losses, norms):
        fin = np.isfinite(l) and np.isfinite(g)
        hist_l, hist_g = np.array(hl[-window:]), np.array(hg[-window:])
        skip = not fin
        if fin and len(hist_l) >= warm:
            tl = hist_l.mean() + sigma * max(hist_l.std(), 1e-6)
            tg = hist_g.mean() + sigma * max(hist_g.std(), 1e-6)
            skip = l > tl or g > tg
        out.append(skip)
        if fin:
            hl.append(l)
            hg.append(g)
    return out


def test_skip_step_against_numpy_and_the_bare_optimizer():
    rng = np.random.default_rng(0)
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    inner = optax.adam(1e-2)
    tx = vitals.skip_step(inner, window=8, sigma=6.0, warmup=4)
    n = 24
    losses = (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)
    scale = (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)
    losses[10], scale[15], losses[19] = 5.0, 40.0, np.nan   # a loss outlier, a gradient outlier, a NaN
    base = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape).astype(np.float32)), params)
    grads = [jax.tree.map(lambda g: g * float(scale[i]), base) for i in range(n)]
    norms = [float(optax.tree.norm(g)) for g in grads]
    want = _np_skip(losses, norms, 8, 6.0, 4)
    assert want[10] and want[15] and want[19] and sum(want) == 3
    state, ref_state = tx.init(params), inner.init(params)
    update = jax.jit(lambda g, s, p, l: tx.update(g, s, p, loss=l))
    for i in range(n):
        out, state = update(grads[i], state, params, jnp.float32(losses[i]))
        assert bool(state.last_skipped) == want[i], i
        if want[i]:
            assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(out))
        else:
            ref, ref_state = inner.update(grads[i], ref_state, params)
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(ref_state)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert int(state.skipped) == 3


def test_skip_step_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="window of at least 2"):
        vitals.skip_step(optax.sgd(0.1), window=1)
    with pytest.raises(ValueError, match="warmup"):
        vitals.skip_step(optax.sgd(0.1), window=8, warmup=9)
    tx = vitals.skip_step(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="loss=loss"):
        tx.update(params, tx.init(params), params)


@pytest.mark.slow
def test_recorder_sees_the_clip_through_the_skip():
    C = importlib.import_module("jvitals.metrics.chain")
    path, max_norm, whole = C.leading_clip(vitals.skip_step(optax.chain(optax.clip_by_global_norm(2.0),
                                                                         optax.adamw(1e-3))))
    assert path == ("inner_state", 0) and max_norm == 2.0 and not whole
    tx = _tx(skip=True)
    params = rm.init_params(CFG, jax.random.key(0))
    state = tx.init(params)
    grads = jax.tree.map(lambda p: 3.0 * jnp.ones_like(p), params)
    _, state = tx.update(grads, state, params, loss=jnp.float32(2.0))
    m = vitals.recorded(state)
    g = float(optax.tree.norm(grads))
    np.testing.assert_allclose(float(m["grad/global_norm_post_clip"]), min(g, 1.0), rtol=1e-6)
    assert "update/param_ratio" in m


# ----------------------------------------------------------------------------------------------
# Between two checks, on real training: each reaches the next check with its step.


def _alerts(verdicts, rule):
    return [(v.step, a) for v in verdicts for a in v.alerts if a.rule == rule]


@pytest.mark.slow
def test_a_nan_step_between_checks_is_orange_at_the_next_check_with_its_step():
    mon = vitals.Monitor()
    _, checks, verdicts = train(45, 10, finite=True, nan_at=23, monitor=mon)
    by_step = {v.step: v for v in verdicts}
    assert by_step[20].level == vitals.Level.GREEN
    v30 = by_step[30]
    assert v30.level == vitals.Level.ORANGE
    (a,) = [a for a in v30.alerts if a.rule == "nonfinite"]
    assert a.onset_step == 23 and "step 23" in a.message
    # the check's own figures are finite: apply_if_finite skipped the update; the skip is seen too
    host30 = dict(checks)[30]
    assert np.isfinite(host30["loss"]) and host30["window/skipped_steps"] == 1
    (s,) = [a for a in v30.alerts if a.rule == "skip"]
    assert s.onset_step == 23
    # and the next window is clean: the non-finite condition is released
    assert host30["window/nonfinite_steps"] == 1 and dict(checks)[40]["window/nonfinite_steps"] == 0


def test_a_one_step_loss_spike_between_checks_reaches_the_next_check_with_its_step():
    mon = vitals.Monitor()
    _, checks, verdicts = train(300, 10, corrupt_at=(255,), monitor=mon)
    host = dict(checks)[260]
    assert host["window/loss.max_ago"] == 5 and host["loss"] < host["window/loss.max"]
    (v,) = [v for v in verdicts if v.step == 260]
    assert v.scores["monitor/loss_window_peak_step"] == 255
    np.testing.assert_allclose(v.scores["monitor/loss_window_peak"], host["window/loss.max"])
    assert not any("monitor/loss_window_peak" in w.scores for w in verdicts if w.step != 260)
    # the loss's spike tracker took it at its own step (recovered by 260; its record completes
    # after policy.spike.post_window)
    tr = mon.rule("spike").trackers["loss"]
    assert [q["onset"] for q in tr.pending] == [255] and tr.pending[0]["recovery_step"] == 260
    # one recovered spike is physiological: no alert
    assert all(w.level == vitals.Level.GREEN for w in verdicts)


@pytest.mark.slow
def test_a_skipped_update_between_checks_is_yellow_at_the_next_check_with_its_step():
    mon = vitals.Monitor()
    per_step, checks, verdicts = train(200, 10, skip=True, corrupt_at=(175,), monitor=mon, every_step=True)
    assert per_step[175]["unchanged"] and not per_step[174]["unchanged"]   # the update never landed
    skipped = [i for i, r in enumerate(per_step) if r["unchanged"]]
    assert 175 in skipped and len(skipped) <= 2, skipped    # (an early gradient outlier may be skipped too)
    assert dict(checks)[180]["window/skipped_steps"] == 1
    (v,) = [v for v in verdicts if v.step == 180]
    (a,) = [a for a in v.alerts if a.rule == "skip"]
    assert a.level == vitals.Level.YELLOW and a.details["first_step"] == 175 and "step 175" in a.message
    assert a.onset_step in skipped
