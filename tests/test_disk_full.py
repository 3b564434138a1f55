"""A full or read-only disk under the guard: one clear line, training goes on, nothing on disk lost.

A real small filesystem (a tmpfs of a few MB, mounted here: the tests run as root, as
CI does) holds real orbax checkpoints of an incompressible state; the disk fills
while an asynchronous save writes, or is remounted read-only.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jvitals.guard.rollback import Rollback
from jvitals.optim.lr_scale import with_lr_scale
from jvitals.guard import Retention

TX = with_lr_scale(optax.sgd(0.1))


def big(v: int) -> dict:
    """A 1.44 MB incompressible train state (a checkpoint takes about that on disk)."""
    p = {"w": jax.random.normal(jax.random.key(v), (600, 600))}
    return {"params": p, "opt_state": TX.init(p), "step": jnp.asarray(v + 1)}


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MB tmpfs at ``tmp_path / 'mnt'`` (unmounted afterwards)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {res.stderr.decode()[:200]}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt: Path, leave: int) -> None:
    """Writes ``mnt/filler`` so that ``leave`` bytes stay free."""
    free = shutil.disk_usage(mnt).free
    (mnt / "filler").write_bytes(b"\0" * max(0, free - leave))


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_run_keeps_its_last_good_checkpoint(
        small_disk, caplog):
    directory = small_disk / "ck"
    # keep_last=1: orbax's retention, run when the save of 20 starts, drops 0 from its list
    # (10 is pinned as the newest healthy); the save fails, so 0 stays on disk and in the guard.
    guard = Rollback(directory, save_every=10, retention=Retention(keep_last=1, keep_green=0, keep_every=None))
    guard.respond(0, big(0), None, 1)
    guard.respond(10, big(10), None, 11)
    guard.wait()
    fill(small_disk, leave=400_000)                             # the save of 20 fails half-way
    caplog.set_level(logging.WARNING)
    live = big(20)
    assert guard.respond(20, live, None, 21) is live            # asynchronous: no error yet
    guard.respond(25, big(25), None, 26)
    guard._saver.settle()                                       # the failure, wherever it surfaces
    lines = errors(caplog)
    assert len(lines) == 1, lines
    line = lines[0]
    assert "step 20" in line and str(directory) in line and "the disk is full (errno 28, ENOSPC)" in line
    assert "Training continues" in line and "step 10" in line and "on_save_error='raise'" in line
    alert = [a for a in guard.alerts + list(guard._pending) if a.rule == "checkpoint_save_failed"]
    assert len(alert) == 1 and alert[0].details["newest_good"] == 10
    assert [e for e in guard.events if e["event"] == "save_failed"][0]["step"] == 20
    # Nothing on disk lost or left half-written: 0 and 10 listed, on disk, restorable; no tmp.
    assert [c.step for c in guard.checkpoints] == [0, 10]
    assert sorted(n for n in os.listdir(directory) if n[0].isdigit()) == ["0", "10"]   # no 20.orbax-...-tmp
    for s in (0, 10):
        assert same(guard.restore(s, big(0))[0], big(s))
    # A preemption while the disk is full: reported, the loop is told to stop all the same.
    guard.preemption.notify()
    assert guard.preempted(27, big(27), 28)
    assert len(errors(caplog)) == 2 and "step 27" in errors(caplog)[1]
    assert "could not be saved" in [r.getMessage() for r in caplog.records if "preemption" in r.getMessage()][0]
    guard.close()
    # Space freed: a restart resumes from the last good checkpoint; the next cadence save lands.
    (small_disk / "filler").unlink()
    guard = Rollback(directory, save_every=10, retention=Retention(keep_last=1, keep_green=0, keep_every=None))
    state, pos = guard.resume(big(-1), 0)
    assert guard.resumed_step == 10 and pos == 11 and same(state, big(10))
    guard.respond(30, big(30), None, 31)
    guard.wait()
    assert 30 in [c.step for c in guard.checkpoints] and len(errors(caplog)) == 2
    guard.close()


def test_a_read_only_disk_is_one_line_per_save_and_training_goes_on(small_disk, caplog):
    directory = small_disk / "ck"
    guard = Rollback(directory, save_every=10)
    guard.respond(0, big(0), None, 1)
    guard.wait()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        caplog.set_level(logging.WARNING)
        live = big(10)
        r = guard.act(10, live, None, 11)               # fails at once: nothing written
        assert r.state is live and r.saved_step is None
        assert [a.rule for a in r.alerts] == ["checkpoint_save_failed"]
        lines = errors(caplog)
        assert len(lines) == 1 and "step 10" in lines[0] and "Read-only file system" in lines[0]
        guard.act(15, big(15), None, 16)                # between cadence saves: nothing tried
        assert len(errors(caplog)) == 1
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    r = guard.act(20, big(20), None, 21)                # the next cadence save lands
    guard.wait()
    assert r.saved_step == 20 and [c.step for c in guard.checkpoints] == [0, 20]
    guard.close()


@pytest.mark.parametrize("cause", [
    OSError(28, "No space left on device"),
    ValueError("Error writing local file \"/ck/20/d/0\": [OS error code 28] os_error_code='28' No space left on device"),
])
def test_a_full_disk_is_named_whichever_layer_met_it(cause):
    """Python's ``OSError`` (a metadata file's write) and TensorStore's text (an array's write):
    the alert line says the disk is full either way; another OS error is not called that."""
    from jvitals.guard.checkpoints import CheckpointSaveError
    from jvitals.guard.response import save_failed_alert

    def raised(c):
        try:
            raise CheckpointSaveError("could not save", directory="/ck", step=20) from c
        except CheckpointSaveError as e:
            return e

    line = save_failed_alert(raised(cause), newest_good=10, every=10).message
    assert "the disk is full (errno 28, ENOSPC)" in line and "step 20" in line and "'/ck'" in line, line
    other = save_failed_alert(raised(PermissionError(13, "Permission denied")), newest_good=10, every=10).message
    assert "disk is full" not in other and "Permission denied" in other, other
