"""A checkpoint an older jvitals wrote, read back by today's guard (jvitals.guard.pytrees.fit).

The recorder's state (``RecordState``) lives in the optax state and its layout follows
the jvitals version: issue 35 added the window's entries to its figure vector and the
``"read"`` family to ``last_step``, issue 43 renamed its ``"global"`` and ``"layers"`` keys
``"light"`` and ``"heavy"``. A checkpoint of 0.1 (tests/data/ckpt_0_1, written by
that version's code) must still resume (the figures taken from today's fresh state,
everything else bitwise from disk, one warning, nothing quarantined); a model whose arrays
changed shape must not be patched: a clear error naming the path, the shapes and the
step, and the checkpoint left alone.

Real training (``vitals.record`` on the reference model), real orbax checkpoints on disk.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jvitals as vitals
from jvitals import reference_model as rm
from jvitals.guard.checkpoints import QUARANTINE_FILE, CheckpointMismatchError, CheckpointStore
from jvitals.metrics.paths import path_str
from jvitals.metrics.record import RecordState

CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2)
OWN = "opt_state/inner_state/0"    # the recorder inside with_lr_scale's chain
OLD = pathlib.Path(__file__).resolve().parent / "data" / "ckpt_0_1"


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def make_run(cfg: rm.ModelConfig):
    """``(train_step, fresh_state, loader)`` of the README's loop (without the probes)."""
    tx = vitals.with_lr_scale(vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))))
    model = rm.Decoder(cfg)

    @functools.partial(jax.jit, static_argnames="full")
    def train_step(state, batch, full=False, read=True):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["tokens"], mask=batch["mask"])
            return rm.cross_entropy(logits, batch["labels"], batch["mask"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=loss,
                                       vitals_heavy=full, vitals_read=read)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), {"loss": loss}

    def fresh() -> TrainState:
        params = rm.init_params(cfg, jax.random.key(0))
        return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))

    return train_step, fresh, (lambda position: rm.make_batch(position, cfg, batch=4, seq=16))


def recorder_own(name: str) -> bool:
    """The recorder's figures (its ``metrics`` and ``last_step``) and the remedies' settings
    0.1 did not have: from today's state."""
    return ("/metrics/vector" in name or "/last_step/" in name
            or name.endswith(("hyperparams/qk_clip_tau", "hyperparams/z_loss")))


def recorder(opt_state: Any) -> RecordState:
    (found,) = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, RecordState))
                if isinstance(x, RecordState)]
    return found


def leaves(tree: Any) -> dict[str, np.ndarray]:
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def assert_bitwise(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.dtype, want.shape)
    assert got.tobytes() == want.tobytes(), name


def train(train_step, state, loader, position: int, steps: int, monitor=None, guard=None):
    """``steps`` steps of the README's loop from ``position``, checking every step; the
    guard (if any) acts at each check."""
    for _ in range(steps):
        step = int(state.step)
        state, metrics = train_step(state, loader(position))
        position += 1
        if monitor is not None:
            host = jax.device_get({**metrics, **vitals.recorded(state.opt_state)})
            verdict = monitor.update(step, host)
            if guard is not None:
                state = guard.respond(step, state, verdict, position)
    return state, position


def quarantine_on_file(directory) -> dict:
    path = directory / QUARANTINE_FILE
    return json.loads(path.read_text())["steps"] if path.exists() else {}


def sha(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def test_a_checkpoint_jvitals_0_1_wrote_resumes_at_its_step_with_one_warning(tmp_path, caplog):
    """tests/data/ckpt_0_1: a checkpoint an older jvitals wrote (its README says which and how):
    step 5 of the reference model, data position 6, its ``leaves.json`` the SHA-256 of each
    array it saved."""
    train_step, fresh, loader = make_run(CFG)
    shutil.copytree(OLD / "checkpoints", tmp_path, dirs_exist_ok=True)     # the guard writes beside it
    saved = json.loads((OLD / "leaves.json").read_text())
    vector, read = f"{OWN}/metrics/vector", f"{OWN}/last_step/read"
    assert saved[vector][1][0] < len(leaves(fresh())[vector]) and read not in saved

    caplog.set_level(logging.INFO)
    like = fresh()
    monitor = vitals.Monitor()
    guard = vitals.Rollback(tmp_path, save_every=1)
    restored, pos = guard.resume(like, 0, monitor)
    assert guard.resumed_step == 5 and pos == 6 and int(restored.step) == 6
    assert isinstance(recorder(restored.opt_state), RecordState)
    got, today = leaves(restored), leaves(like)
    assert set(got) == set(today)
    assert {n for n in saved if not recorder_own(n)} == {n for n in got if not recorder_own(n)}
    for name, (dtype, shape, digest) in saved.items():      # params, Adam's moments, counts: from disk, bitwise
        if not recorder_own(name):
            assert (str(got[name].dtype), list(got[name].shape), sha(got[name])) == (dtype, shape, digest), name
    for name, want in today.items():                        # the recorder's figures: today's fresh ones
        if recorder_own(name):
            assert_bitwise(got[name], want, name)
    assert int(recorder(restored.opt_state).count) == 6 and vitals.recorded_steps(restored.opt_state)["read"] == -1
    # 0.1 named the families "global" and "layers" (last_step's keys on disk): today's names, fresh
    assert {k: int(v) for k, v in vitals.recorded_steps(restored.opt_state).items()} == {
        "light": -1, "heavy": -1, "read": -1}
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert "checkpoint 5" in msg and str(tmp_path) in msg and "older jvitals" in msg
    assert vector in msg and read in msg and "\n" not in msg
    assert "opt_state/hyperparams/qk_clip_tau" not in saved and vitals.get_remedy(restored, "z_loss") == 0.0
    assert guard.quarantined == {} and quarantine_on_file(tmp_path) == {}

    # The recorder works from the next step: fresh figures, its window, a checkpoint of today's form.
    state, position = train(train_step, restored, loader, pos, 2, monitor, guard)
    host = jax.device_get(vitals.recorded(state.opt_state))
    assert np.isfinite(host["grad/global_norm"]) and np.isfinite(host["window/loss.max"])
    assert int(recorder(state.opt_state).count) == 8 and guard.level.name in ("GREEN", "YELLOW")
    guard.close()
    assert {"5", "6", "7"} <= set(os.listdir(tmp_path))
    caplog.clear()
    again = vitals.Rollback(tmp_path)
    resumed, pos = again.resume(fresh(), 0, vitals.Monitor())
    assert again.resumed_step == 7 and pos == 8 and int(recorder(resumed.opt_state).count) == 8
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_bitwise(leaves(resumed)[vector], leaves(state)[vector], "vector")
    again.close()


@pytest.mark.slow
@pytest.mark.parametrize("change", [pytest.param("vocab", marks=pytest.mark.slow), "layers"])
def test_a_model_that_changed_shape_is_a_clear_error_not_a_quarantine(tmp_path, change):
    train_step, fresh, loader = make_run(CFG)
    state, position = train(train_step, fresh(), loader, 0, 2)
    guard = vitals.Rollback(tmp_path, save_every=100)
    guard.respond(1, state, None, position)
    guard.close()

    changed = CFG.__class__(**{**CFG.__dict__, **({"vocab": 80} if change == "vocab" else {"n_layers": 3})})
    _, fresh_changed, _ = make_run(changed)
    guard = vitals.Rollback(tmp_path, save_every=100)
    with pytest.raises(CheckpointMismatchError) as info:
        guard.resume(fresh_changed(), 0, vitals.Monitor())
    msg, err = str(info.value), info.value
    assert "checkpoint 1" in msg and str(tmp_path) in msg and "not quarantined" in msg
    if change == "vocab":           # the first path that differs, with both shapes
        assert "params/embed/embedding is float32[64, 32] on disk but float32[80, 32] in the train state" in msg
        assert (err.path, err.on_disk, err.expected) == ("params/embed/embedding", "float32[64, 32]", "float32[80, 32]")
    else:                           # a layer the checkpoint does not have
        assert "params/layers_2/" in msg and "is absent on disk" in msg
    assert err.step == 1 and "Resume with the model and optimizer it was saved with" in msg
    assert guard.quarantined == {} and quarantine_on_file(tmp_path) == {}
    guard.close()
    # The checkpoint is intact: the model it was saved with resumes it.
    guard = vitals.Rollback(tmp_path, save_every=100)
    restored, pos = guard.resume(fresh(), 0)
    assert guard.resumed_step == 1 and pos == position
    assert_bitwise(leaves(restored)["params/lm_head/kernel"], leaves(state)["params/lm_head/kernel"], "lm_head")
    guard.close()


def test_the_store_raises_a_mismatch_and_quarantines_a_corrupt_one(tmp_path, caplog):
    """At the store: a changed array is raised from ``try_restore`` (not quarantined); a
    checkpoint whose metadata is torn is still quarantined as corrupt."""
    store = CheckpointStore(tmp_path, keep_last=10, keep_every=None)
    for s in (0, 10):
        store.save(s, {"w": jnp.full((3, 2), float(s)), "step": jnp.asarray(s)}, {"position": s},
                   level=0, kind="cadence")
    store.wait()
    with pytest.raises(CheckpointMismatchError, match=r"checkpoints: checkpoint 10 in .* w is float32\[3, 2\] "
                                                      r"on disk but float32\[4, 2\] in the train state"):
        store.try_restore(10, {"w": jnp.zeros((4, 2)), "step": jnp.asarray(0)}, finite=True)
    with pytest.raises(CheckpointMismatchError, match=r"extra is absent on disk"):
        store.try_restore(10, {"w": jnp.zeros((3, 2)), "step": jnp.asarray(0), "extra": jnp.zeros(())}, finite=True)
    assert store.quarantined == {} and store.failures == []
    (tmp_path / "10" / "state" / "_METADATA").write_bytes(b"\x00garbage")
    caplog.set_level(logging.WARNING)
    assert store.try_restore(10, {"w": jnp.zeros((3, 2)), "step": jnp.asarray(0)}, finite=True) is None
    assert store.quarantined[10].startswith("corrupt")
    got, meta = store.try_restore(0, {"w": jnp.zeros((3, 2)), "step": jnp.asarray(5)}, finite=True)
    np.testing.assert_array_equal(np.asarray(got["w"]), 0.0)
    assert meta["position"] == 0
    store.close()
