"""Preemption in one process, the guard's own state across a restart, and the rollback's
quarantine on disk before its restore.

Real signals sent to this process (SIGUSR1 here, so that a handler not installed could
not be mistaken for pytest's; SIGTERM itself in a child process and in
tests/test_survive.py), real orbax checkpoints on disk, real verdicts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest

from jvitals.guard.preemption import PREEMPT, Preemption
from jvitals.guard.rollback import Action, Rollback
from jvitals.monitor.types import Alert, Level, Verdict
from jvitals.optim.lr_scale import get_lr_scale, with_lr_scale
from jvitals.guard import Retention, Saving

REPO = Path(__file__).resolve().parents[1]
TX = with_lr_scale(optax.adam(1e-2))
USR1 = signal.SIGUSR1


def make_state(value: float) -> dict:
    """A dict train state whose params all equal ``value``; its step is ``value + 1``."""
    params = {"w": jnp.full((4, 3), float(value), jnp.float32)}
    return {"params": params, "opt_state": TX.init(params), "step": jnp.asarray(int(value) + 1, jnp.int32)}


def verdict(step: int, level: int, onset: int | None = None, id_: int = 7) -> Verdict:
    """A real Verdict with one alert at ``level`` (none for GREEN)."""
    alerts = []
    if level > Level.GREEN:
        onset = step if onset is None else onset
        alerts.append(Alert(id=id_, rule="grad_norm", metric="grad/global_norm", level=Level(level),
                            step=step, value=9.0, baseline=1.0, ratio=9.0, onset_step=onset,
                            opened_step=onset, message=f"[{Level(level).name}] grad norm 9x",
                            cause="c", prescription="p", localization=[], peak_level=Level(level)))
    return Verdict(step, Level(level), alerts, list(alerts), [], {})


def value_of(state) -> float:
    return float(state["params"]["w"][0, 0])


def names_on_disk(directory) -> list[str]:
    return sorted(os.listdir(directory))


# ----------------------------------------------------------------------------
# The notice, in this process.
# ----------------------------------------------------------------------------


def test_a_signal_saves_at_the_next_step_boundary_and_resume_continues_from_it(tmp_path):
    before = signal.getsignal(USR1)
    guard = Rollback(tmp_path, save_every=100, saving=Saving(preemption=Preemption(signals=(USR1,))))
    state, position = guard.resume(make_state(0), 0)
    assert signal.getsignal(USR1) is before            # no handler before the loop asks
    stopped = None
    for step in range(0, 40):
        state, position = make_state(step), step + 1
        if step % 10 == 0:
            guard.respond(step, state, verdict(step, 0), position)
        if step == 13:
            os.kill(os.getpid(), USR1)                 # arrives while the step "runs"
        if guard.preempted(step, state, position):
            stopped = step
            break
    assert stopped == 13                               # the boundary right after the signal
    assert guard.preempted(14, make_state(14), 15)     # and stays True
    rec = guard.store.records[13]
    assert rec.kind == PREEMPT and rec.level == Level.GREEN
    assert "13" in names_on_disk(tmp_path) and not [n for n in names_on_disk(tmp_path) if "tmp" in n]
    assert guard.preemption.notice == "SIGUSR1"
    assert [e for e in guard.events if e["event"] == "preempt"][0]["saved_step"] == 13
    guard.close()
    assert signal.getsignal(USR1) is before            # put back
    again = Rollback(tmp_path, save_every=100)
    restored, position = again.resume(make_state(-1), 0)
    assert again.resumed_step == 13 and position == 14 and value_of(restored) == 13.0
    assert int(restored["step"]) == 14                 # the loop goes on at step 14: nothing recomputed
    again.close()


def test_a_previous_python_handler_is_still_called_and_comes_back(tmp_path):
    seen = []
    previous = signal.signal(USR1, lambda signum, frame: seen.append(signum))
    try:
        guard = Rollback(tmp_path, save_every=100, saving=Saving(preemption=Preemption(signals=(USR1,))))
        assert not guard.preempted(0, make_state(0), 1)
        os.kill(os.getpid(), USR1)
        assert guard.preempted(1, lambda: make_state(1), 2)   # the state built on the notice only
        assert seen == [USR1] and value_of(guard.restore(1, make_state(0))[0]) == 1.0
        guard.close()
        os.kill(os.getpid(), USR1)                     # the user's handler alone again
        assert seen == [USR1, USR1]
    finally:
        signal.signal(USR1, previous)


def test_notify_and_a_step_already_saved_by_respond(tmp_path):
    guard = Rollback(tmp_path, save_every=10)
    guard.respond(0, make_state(0), verdict(0, 0), 1)
    assert not guard.preempted(0, make_state(0), 1)
    guard.respond(10, make_state(10), verdict(10, 0), 11)  # a cadence checkpoint at 10 ...
    guard.preemption.notify("maintenance event")
    assert guard.preempted(10, make_state(10), 11)        # ... is the one: waited for, not saved again
    assert guard.store.records[10].kind == "cadence" and 10 in [c.step for c in guard.checkpoints]
    assert guard.events[-1] == {"event": "preempt", "step": 10, "notice": "maintenance event",
                                "saved_step": 10, "seconds": guard.events[-1]["seconds"]}
    guard.close()
    off = Rollback(tmp_path / "off", save_every=10, saving=Saving(preemption=False))
    assert not off.preempted(0, make_state(0), 1)
    off.close()


# ----------------------------------------------------------------------------
# What a preemption checkpoint is: a resume point, never a rollback target.
# ----------------------------------------------------------------------------


def test_a_preemption_checkpoint_is_resumed_but_never_a_rollback_target(tmp_path):
    guard = Rollback(tmp_path, save_every=20, retention=Retention(keep_last=10))
    for s in (0, 10, 20):
        guard.respond(s, make_state(s), verdict(s, 0), s + 1)
    guard.preemption.notify()
    assert guard.preempted(25, make_state(25), 26)
    guard.close()
    guard = Rollback(tmp_path, save_every=20, retention=Retention(keep_last=10))
    state, pos = guard.resume(make_state(-1), 0)
    assert guard.resumed_step == 25 and pos == 26
    acts = {s: guard.act(s, make_state(s), verdict(s, 0), s + 1).action for s in (30, 40)}
    assert acts == {30: Action.CONTINUE, 40: Action.SAVED}  # the cadence of the uninterrupted run
    r = guard.act(50, make_state(50), verdict(50, Level.RED, onset=45), 51)
    # The cutoff is the check before the sign 45, 40; below it the preemption checkpoint
    # 25 is the newest healthy one, but the target is the cadence checkpoint 20.
    assert r.action is Action.ROLLBACK and r.target_step == 20 and value_of(r.state) == 20.0
    assert sorted(guard.quarantined) == [25, 40] and guard.quarantined[25].startswith("sick")
    guard.close()


def test_a_preemption_during_an_open_orange_resumes_exactly_there(tmp_path):
    guard = Rollback(tmp_path, save_every=10, retention=Retention(keep_last=10))
    for s in (0, 10, 20):
        guard.respond(s, make_state(s), verdict(s, 0), s + 1)
    guard.respond(30, make_state(30), verdict(30, Level.ORANGE, onset=25), 31)   # orange save at 30
    guard.preemption.notify()
    assert guard.preempted(33, make_state(33), 34)
    assert guard.store.records[33].level == Level.ORANGE
    guard.close()
    guard = Rollback(tmp_path, save_every=10, retention=Retention(keep_last=10))
    state, pos = guard.resume(make_state(-1), 0)
    # Not the newest healthy checkpoint (20): the continuation, whose guard knows the open
    # orange alert, so the red that follows restores what the uninterrupted run restores.
    assert guard.resumed_step == 33 and pos == 34 and value_of(state) == 33.0
    assert guard.level == Level.ORANGE                         # the level it last acted on, back
    r = guard.act(40, make_state(40), verdict(40, Level.RED, onset=25), 41)
    assert r.target_step == 10 and sorted(guard.quarantined) == [20, 30, 33]
    guard.close()


def verdict_of(step: int, alerts: list[tuple[int, int, int]]) -> Verdict:
    """A real Verdict with the alerts ``(id, level, onset)``; its level is their highest."""
    made = [verdict(step, level, onset, id_).alerts[0] for id_, level, onset in alerts]
    return Verdict(step, Level(max([0] + [a[1] for a in alerts])), made, list(made), [], {})


# Two alerts: #8 (ORANGE from onset 35) closes at 90, #7 (onset 75) goes RED at 100. The
# chain of the red holds #8 (an ORANGE alert that closed since the last calm check), so
# the sign is 35 and the target 0: only a guard that remembers #8 finds it.
STORY = {80: [(7, Level.ORANGE, 75), (8, Level.ORANGE, 35)], 90: [(7, Level.ORANGE, 75)],
         100: [(7, Level.RED, 75)]}


def run_story(directory: Path, stop_after: int | None = None) -> tuple[list, Rollback]:
    """Checks every 10 steps to 120 (from the resumed step on); with ``stop_after``, a
    preemption 5 steps after that check."""
    guard = Rollback(directory, save_every=30, retention=Retention(keep_last=20, keep_quarantined=5))
    guard.resume(make_state(-1), 0)
    out = []
    for s in range(0, 130, 10):
        if guard.resumed_step is not None and s <= guard.resumed_step:
            continue
        r = guard.act(s, make_state(s), verdict_of(s, STORY.get(s, [])), s + 1)
        out.append((s, r.action.value, r.saved_step, r.target_step))
        if s == stop_after:
            guard.preemption.notify()
            assert guard.preempted(s + 5, make_state(s + 5), s + 6)
            break
    guard.close()
    return out, guard


def test_resume_gives_back_the_guards_own_state(tmp_path):
    """The alert records, the checks, the cadence and the orange episode after a restart
    are the uninterrupted guard's: both take the same decisions."""
    whole, g1 = run_story(tmp_path / "a")
    first, _ = run_story(tmp_path / "b", stop_after=90)
    second, g2 = run_story(tmp_path / "b")
    assert whole[8:11] == [(80, "pause", 80, None), (90, "pause", None, None), (100, "rollback", 100, 0)]
    assert first + second == whole
    assert g2.history[0]["to_step"] == g1.history[0]["to_step"] == 0
    assert sorted(g2.quarantined) == sorted(set(g1.quarantined) | {95}) == [30, 60, 80, 95]


# ----------------------------------------------------------------------------
# SIGTERM for real, in a child: the default handler, the exit code.
# ----------------------------------------------------------------------------

SIGTERM_CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp, optax
    from jvitals.guard.rollback import Rollback
    from jvitals.guard import Retention
    from jvitals.optim.lr_scale import with_lr_scale
    tx = with_lr_scale(optax.sgd(0.1))
    def state(v):
        p = {{"w": jnp.full((8,), float(v))}}
        return {{"params": p, "opt_state": tx.init(p), "step": jnp.asarray(v + 1)}}
    guard = Rollback({directory!r}, save_every=1000)
    s0, pos = guard.resume(state(-1), 0)
    start = int(s0["step"])
    print("START", start, flush=True)
    for step in range(start, 10**9):
        time.sleep(0.01)                                   # the step
        if guard.preempted(step, state(step), step + 1):
            print("STOPPED", step, flush=True)
            break
        if step == start:
            print("STEPPING", flush=True)
    guard.close()
""")


def test_sigterm_is_a_clean_exit_and_the_restart_recomputes_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(SIGTERM_CHILD.format(repo=str(REPO), directory=str(tmp_path / "ck")))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    stops = []
    for round_ in range(2):
        child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
        try:
            start = int(child.stdout.readline().split()[1])
            assert child.stdout.readline().strip() == "STEPPING"
            time.sleep(0.2 + 0.3 * round_)
            t0 = time.monotonic()
            child.send_signal(signal.SIGTERM)
            out, err = child.communicate(timeout=60)
            took = time.monotonic() - t0
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0, err[-3000:]
        assert took < 60
        stopped = int(out.split("STOPPED")[1].split()[0])
        stops.append((start, stopped))
        line = [ln for ln in err.splitlines() if "preemption notice" in ln]
        assert len(line) == 1 and "(SIGTERM)" in line[0] and f"checkpoint {stopped}" in line[0], err[-2000:]
    assert stops[0][0] == 0 and stops[1][0] == stops[0][1] + 1     # 0 steps recomputed


# ----------------------------------------------------------------------------
# SIGKILL during a rollback: in its restore, or while its save is in flight.
# ----------------------------------------------------------------------------

ROLLBACK_CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp, optax
    from jvitals.guard.rollback import Rollback
    from jvitals.guard import Retention
    from jvitals.monitor.monitor import Alert, Level, Verdict
    from jvitals.optim.lr_scale import with_lr_scale
    tx = with_lr_scale(optax.sgd(0.1))
    def state(v):
        p = {{"w": jnp.full((4000, 4000), float(v))}}         # 64 MB: a restore takes a while
        return {{"params": p, "opt_state": tx.init(p), "step": jnp.asarray(v + 1)}}
    guard = Rollback({directory!r}, save_every=10, retention=Retention(keep_last=10))
    if {prepare!r}:                                         # checks 0..30, all GREEN
        for s in (0, 10, 20, 30):
            guard.respond(s, state(s), None, s + 1)
        guard.close()
        sys.exit(0)
    guard.resume(state(-1), 0)                              # the guard's checks and alerts come back
    a = Alert(id=1, rule="grad_norm", metric="grad/global_norm", level=Level.RED, step=40, value=9.0,
              baseline=1.0, ratio=9.0, onset_step=25, opened_step=25, message="[RED] x", cause="c",
              prescription="p", localization=[], peak_level=Level.RED)
    now = state(40)
    print("RED", flush=True)
    guard.respond(40, now, Verdict(40, Level.RED, [a], [a], [], {{}}), 41)   # target 10
    print("ROLLED", flush=True)
    guard.wait()
    print("SAVED", flush=True)
    time.sleep(120)
""")


def rollback_child(tmp_path: Path, directory: Path, prepare: bool) -> subprocess.Popen:
    script = tmp_path / f"rollback_child_{int(prepare)}.py"
    script.write_text(ROLLBACK_CHILD.format(repo=str(REPO), directory=str(directory), prepare=prepare))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)


def big_like() -> dict:
    w = jnp.zeros((4000, 4000))
    return {"params": {"w": w}, "opt_state": with_lr_scale(optax.sgd(0.1)).init({"w": w}),
            "step": jnp.asarray(0)}


@pytest.mark.slow
def test_a_kill_during_a_rollback_never_resumes_a_sick_checkpoint(tmp_path):
    """Checks 0..30 are GREEN; the red at 40 (sign 25) restores 10: 20 and 30 are sick,
    though saved GREEN. Killed during the rollback, before its save began (the restore
    takes most of that time), a restart resumes 10, not 30: the quarantine reached the
    disk before the restore began. Killed while the rollback's save is in flight, 10 or
    (had it landed) the rollback's checkpoint 40, each with its own data position and
    LR scale. Never 20 or 30."""
    import shutil

    template = tmp_path / "template"
    assert rollback_child(tmp_path, template, True).wait(timeout=300) == 0

    def run(when: float | str | None) -> tuple[dict, list[str], float]:
        """Kills ``when`` seconds after the red (``'save'``: once its save is seen);
        returns what a restart resumes, the ``40*`` entries left, and when the save began."""
        directory = tmp_path / f"ck_{when}"
        shutil.copytree(template, directory)
        child = rollback_child(tmp_path, directory, False)
        began = None
        try:
            assert child.stdout.readline().startswith("RED")
            t0 = time.monotonic()
            while child.poll() is None and time.monotonic() - t0 < 120 and began is None:
                if isinstance(when, float) and time.monotonic() - t0 >= when:
                    child.send_signal(signal.SIGKILL)
                    break
                if any(n.startswith("40.") for n in os.listdir(directory)):
                    began = time.monotonic() - t0
                    if when == "save":
                        child.send_signal(signal.SIGKILL)
                time.sleep(0.001)
            if when is None:
                assert [child.stdout.readline()[:6] for _ in range(2)] == ["ROLLED", "SAVED\n"]
        finally:
            child.kill()
            child.wait(timeout=60)
        left = sorted(n for n in os.listdir(directory) if n.startswith("40"))
        guard = Rollback(directory, save_every=10)
        state, pos = guard.resume(big_like(), 0)
        got = {"resumed": guard.resumed_step, "position": pos, "value": float(state["params"]["w"][0, 0]),
               "lr_scale": get_lr_scale(state), "quarantined": sorted(guard.quarantined)}
        guard.close()
        return got, left, began

    target = {"resumed": 10, "position": 11, "value": 10.0, "lr_scale": 1.0, "quarantined": [20, 30]}
    whole, _, began = run(None)
    assert whole == {**target, "resumed": 40, "position": 41, "lr_scale": pytest.approx(0.9)}
    before_save = 0
    for frac in (0.1, 0.3, 0.6):   # one early kill at least: a loaded machine moves the save's start
        got, left, _ = run(frac * began)
        before_save += not left
        assert got == target if not left else got in (target, whole), (frac, began, left, got)
    assert before_save >= 1, "no kill landed before the rollback's save began"
    got, left, _ = run("save")
    assert left and got in (target, whole), (left, got)
