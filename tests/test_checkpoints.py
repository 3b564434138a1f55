"""Tests of jvitals.guard.checkpoints.CheckpointStore alone (no verdicts, no policy).

Real orbax checkpoints on disk; what is kept is read back from the directory.
"""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jvitals.guard.checkpoints import (
    CADENCE,
    ORANGE_SAVE,
    QUARANTINE_FILE,
    ROLLBACK_SAVE,
    CheckpointStore,
)
from jvitals.monitor.types import Level


def tree(v: float) -> dict:
    return {"w": jnp.full((3, 2), float(v)), "step": jnp.asarray(int(v))}


def on_disk(directory) -> list[int]:
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def save(store, step, level=Level.GREEN, kind=CADENCE, open_peak=0):
    store.save(step, tree(step), {"position": step + 1}, level=level, kind=kind, open_peak=open_peak)


def test_pins_outlive_retention_and_the_log_says_why(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=None, keep_green=0)
    caplog.set_level(logging.INFO, logger="jvitals.guard.checkpoints")
    for s in (0, 10, 20):
        save(store, s)
    store.set_pins({10: "rollback target (restored at step 25)"})
    for s in (30, 40, 50):
        save(store, s)
    store.wait()
    # Without the pin only the newest 2 would stay: 40, 50.
    assert on_disk(tmp_path) == [10, 40, 50]
    lines = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    assert lines and any("deleting [0]" in ln or "deleting [0," in ln for ln in lines)
    assert "10 (pinned: rollback target (restored at step 25))" in lines[-1]
    assert "50 (newest 2" in lines[-1]
    # A new store on the directory keeps the pins from the newest metadata.
    store.close()
    again = CheckpointStore(tmp_path, keep_last=2, keep_every=None, keep_green=0)
    assert again.pins == {10: "rollback target (restored at step 25)"}
    save(again, 60)
    again.wait()
    assert on_disk(tmp_path) == [10, 50, 60]
    again.close()


def test_quarantine_is_kept_bounded_and_never_healthy(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=10, keep_every=None, keep_green=0, keep_quarantined=3)
    for s in range(0, 60, 10):
        save(store, s)
    for s in (10, 20, 30, 40):
        store.quarantine(s, "sick: test")
    store.write_quarantine()
    store.keep_last = 2
    save(store, 60)
    store.wait()
    # The newest 3 quarantined (20, 30, 40) kept for a post-mortem, 10 deleted; 50, 60 newest.
    assert on_disk(tmp_path) == [20, 30, 40, 50, 60]
    assert [r.step for r in store.healthy()] == [60, 50]
    assert set(store.quarantined) == {20, 30, 40}
    on_file = json.loads((tmp_path / QUARANTINE_FILE).read_text())["steps"]
    assert {20, 30, 40} <= {int(s) for s in on_file}
    store.close()


def test_healthy_means_level_and_no_open_orange(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=10, keep_every=None)
    save(store, 0)
    save(store, 10, level=Level.YELLOW)
    save(store, 20, level=Level.ORANGE, kind=ORANGE_SAVE, open_peak=Level.ORANGE)
    save(store, 30, level=Level.YELLOW, open_peak=Level.ORANGE)     # an ORANGE alert still open
    save(store, 40, kind=ROLLBACK_SAVE)
    store.wait()
    assert [r.step for r in store.healthy()] == [40, 10, 0]
    assert [r.step for r in store.healthy(before=40)] == [10, 0]
    store.close()
    # Levels and open peaks survive a reopen (from the metadata).
    again = CheckpointStore(tmp_path, keep_last=10, keep_every=None)
    assert [(r.step, r.level, r.open_peak, r.kind) for r in again.checkpoints] == [
        (0, 0, 0, "cadence"), (10, 1, 0, "cadence"), (20, 2, 2, "orange"), (30, 1, 2, "cadence"),
        (40, 0, 0, "rollback")]
    restored, meta = again.restore(10, tree(0))
    np.testing.assert_array_equal(np.asarray(restored["w"]), 10.0)
    assert meta["position"] == 11 and meta["level_name"] == "YELLOW"
    again.close()


def test_a_failed_restore_is_one_line_and_quarantines(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=10, keep_every=None)
    save(store, 0)
    save(store, 10)
    store.wait()
    for p in (tmp_path / "10").rglob("*"):
        if p.is_file() and "/d/" in str(p) and p.stat().st_size:
            p.write_bytes(b"\0" * 3)
    caplog.set_level(logging.WARNING)
    assert store.try_restore(10, tree(0), finite=True) is None
    assert store.quarantined[10].startswith("corrupt")
    assert store.failures == [(10, store.quarantined[10])]
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "checkpoint 10" in warned[0].getMessage()
    assert "\n" not in warned[0].getMessage() and warned[0].exc_info is None
    got, _ = store.try_restore(0, tree(5), finite=True)
    np.testing.assert_array_equal(np.asarray(got["w"]), 0.0)
    with pytest.raises(ValueError, match="keep_last >= 1"):
        CheckpointStore(tmp_path / "x", keep_last=0)
    store.close()


def test_a_late_read_on_a_closed_loop_is_held_back_and_other_errors_are_not(monkeypatch, capfd):
    """What a failed orbax restore leaves behind, with tensorstore's own future.

    A task awaiting a tensorstore future is pending when the loop is closed (orbax's
    run_until_complete + close after a read failed); when the future completes,
    tensorstore's callback calls ``call_soon_threadsafe`` on the closed loop and
    reports the RuntimeError through ``sys.unraisablehook``.
    """
    import asyncio
    import sys

    import tensorstore as ts

    from jvitals.guard import checkpoints

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    checkpoints._install_unraisablehook()
    before = checkpoints._NOISE.late_reads

    promise, future = ts.Promise.new()
    loop = asyncio.new_event_loop()

    async def start():
        async def read():
            return await future
        task = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        return task

    task = loop.run_until_complete(start())
    loop.close()
    assert not task.done()
    promise.set_result(1)                       # the late read completes
    assert checkpoints._NOISE.late_reads == before + 1 and seen == []

    # Any other error a tensorstore callback raises still reaches the previous hook.
    promise, future = ts.Promise.new()
    future.add_done_callback(lambda f: 1 / 0)
    promise.set_result(1)
    assert len(seen) == 1 and isinstance(seen[0], ZeroDivisionError)
    assert "Event loop is closed" not in capfd.readouterr().err


def test_a_late_reads_unretrieved_future_is_held_back_and_others_are_not(caplog):
    """A restore whose read failed leaves its sibling reads' futures with exceptions
    nobody reads; asyncio logs each as 'Future exception was never retrieved' when it
    is collected. Those carrying a tensorstore error are dropped (counted); any other
    unretrieved future's log still goes through."""
    import asyncio
    import gc

    from jvitals.guard import checkpoints

    checkpoints._install_log_filter()
    caplog.set_level("ERROR", logger="asyncio")
    before = checkpoints._NOISE.dropped

    def unretrieved(message):
        loop = asyncio.new_event_loop()
        fut = loop.create_future()
        fut.set_exception(ValueError(message))
        del fut
        gc.collect()
        loop.close()

    unretrieved('OUT_OF_RANGE: Error opening "zarr" driver: ... [tensorstore_spec=\'{"driver":"zarr"}\']')
    assert checkpoints._NOISE.dropped == before + 1
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    unretrieved("a user's own error")
    assert [r for r in caplog.records if "never retrieved" in r.getMessage()]
