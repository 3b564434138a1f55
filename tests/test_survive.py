"""The README's loop survives the machine: SIGKILL anywhere (half of them inside an
asynchronous save) and SIGTERM, each followed by a restart, ends bitwise where the
uninterrupted run ends.

The README's Usage block runs as written (as tests/test_readme.py runs it), with three
edits a user would make: a shorter run (``num_steps``), a
checkpoint at each check (``save_every=50``), and a loader that prints the position it
is asked for (so the test knows which step runs). One run goes through uninterrupted (a
fresh ``python usage.py``); another is interrupted at seeded points by real signals and
restarted each time (each run a process of its own, forked from one that has imported the
libraries: see :data:`ZYGOTE`). The
test checks that every restart resumes from the newest committed checkpoint (never a
partial one: a kill inside a save leaves orbax's temporary directory, which is never
restored), that a SIGTERM is a clean exit (code 0) within 60 s with no step computed
twice, that the final train state is bitwise the uninterrupted one, and that every
figure the interrupted run logged equals the uninterrupted run's at that step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from test_readme import usage_block
import pytest

pytestmark = pytest.mark.slow   # the slow tier (README): end-to-end runs in fresh processes

REPO = Path(__file__).resolve().parents[1]
NUM_STEPS = 300
LAST_SAVE = 250                     # the last check (every 50 steps) with a save
SEED = 34
KILLS_IN_SAVE, KILLS_AT_STEP, TERMS = 6, 6, 3
TMP = ".orbax-checkpoint-tmp"


def survive_block(nnx: bool = False, num_steps: int = NUM_STEPS) -> str:
    """The README block (its Flax NNX one with ``nnx``) with the three edits of the module
    doc, and the final state written to ``final.npz`` when the run is complete."""
    code = usage_block(nnx=nnx)
    edits = [("num_steps, logdir, ckpt_dir = 600,", f"num_steps, logdir, ckpt_dir = {num_steps},"),
             ("save_every=100", "save_every=50"),
             ("def loader(position):", "def loader(position):\n    print('POS', position, flush=True)")]
    for old, new in edits:
        assert old in code, f"the README block changed: {old!r} is gone"
        code = code.replace(old, new, 1)
    done, state = (("int(optimizer.step[...])", "nnx.state((model, optimizer))") if nnx
                   else ("int(state.step)", "state"))
    return code + (f"\nif {done} == num_steps:\n"
                   "    import numpy as _np\n"
                   f"    _np.savez('final.npz', *[_np.asarray(x) for x in jax.tree.leaves({state})])\n")


def assert_bitwise(ref: Path, run: Path) -> int:
    """The two ``final.npz`` hold the same arrays, bit for bit; returns how many."""
    a, b = np.load(ref), np.load(run)
    assert len(a.files) == len(b.files) > 10
    for k in a.files:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    return len(a.files)


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # one CPU device, as a user has
    env.update({"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    return env


class Child:
    """The block run as ``python usage.py`` in a fresh interpreter; its ``POS`` lines read
    by a thread."""

    def __init__(self, script: Path, cwd: Path) -> None:
        self.started = time.time()
        self.proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=child_env(), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        self.positions: list[int] = []
        self._err: list[str] = []
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=lambda: self._err.extend(self.proc.stderr), daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("POS "):
                self.positions.append(int(line.split()[1]))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def err(self) -> str:
        return "".join(self._err)

    def poll(self) -> None:
        """Reads the positions printed since the last call (here a thread does)."""

    def wait_position(self, at_least: int, timeout: float = 300.0) -> int:
        """Blocks until the run asked for position ``at_least``."""
        deadline = time.monotonic() + timeout
        self.poll()
        while not (self.positions and self.positions[-1] >= at_least):
            assert self.alive(), f"the run exited early:\n{self.err()[-3000:]}"
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.005)
            self.poll()
        return self.positions[-1]

    def finish(self, timeout: float = 120.0) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return code


# The interrupted runs start from a process that has imported what the block imports
# (JAX, Flax, optax, orbax, clu with TensorFlow: 6-7 s of CPU a start, 26 starts), without
# starting JAX's backend: each run is a fork of it that runs the block as __main__ (its
# imports are then cache hits), with its own stdout and stderr, and exits as an
# interpreter does (atexit hooks, thread joins). The uninterrupted run is a fresh
# `python usage.py`: the two agree bitwise only if the forked runs compute what a fresh
# interpreter computes.
ZYGOTE = """
import os, runpy, sys
import jax, flax, optax, orbax.checkpoint
from clu import metric_writers
import jvitals, jvitals.reference_model
print("READY", flush=True)
for line in sys.stdin:
    cmd, *args = line.rstrip("\\n").split("\\t")
    if cmd == "WAIT":
        _, status = os.waitpid(int(args[0]), 0)
        print("EXIT", os.waitstatus_to_exitcode(status), flush=True)
        continue
    cwd, script, out, err = args
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin, sys.argv = open(os.devnull), [script]
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    print("PID", pid, flush=True)
"""


class Forker:
    """The process the interrupted runs are forked from (see :data:`ZYGOTE`)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=child_env(), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "READY"
        self.count = 0
        self.runs: list[Forked] = []

    def ask(self, *words: str) -> str:
        self.proc.stdin.write("\t".join(words) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()[1]

    def run(self, script: Path, cwd: Path) -> "Forked":
        self.count += 1
        out, err = cwd / f"run_{self.count}.out", cwd / f"run_{self.count}.err"
        started = time.time()
        self.runs.append(Forked(self, int(self.ask("RUN", str(cwd), str(script), str(out), str(err))),
                                out, err, started))
        return self.runs[-1]

    def close(self) -> None:
        """Ends the runs still going (a failed test) and the forking process."""
        for run in self.runs:
            if run.alive():
                os.kill(run.pid, signal.SIGKILL)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Forked(Child):
    """A run forked by a :class:`Forker`: :class:`Child`'s methods, read from its files."""

    def __init__(self, forker: Forker, pid: int, out: Path, err: Path, started: float) -> None:
        self.forker, self.pid, self._out, self._errfile, self.started = forker, pid, out, err, started
        self.positions, self._seen, self.code = [], 0, None

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    def err(self) -> str:
        return self._errfile.read_text() if self._errfile.exists() else ""

    def poll(self) -> None:
        lines = self._out.read_text().splitlines(keepends=True) if self._out.exists() else []
        done = [ln for ln in lines[self._seen:] if ln.endswith("\n")]
        self._seen += len(done)
        self.positions += [int(ln.split()[1]) for ln in done if ln.startswith("POS ")]

    def finish(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while self.code is None and self.alive():
            assert time.monotonic() < deadline, f"run {self.pid} still going after {timeout} s"
            time.sleep(0.01)
        if self.code is None:
            self.code = int(self.forker.ask("WAIT", str(self.pid)))
        self.poll()                                # the last lines
        return self.code


def new_tmp_dirs(ckpt: Path, since: float) -> list[str]:
    """orbax's temporary directories of saves started after ``since`` (leftovers of a
    killed run are older; a restart removes them)."""
    out = []
    try:
        for entry in os.scandir(ckpt):
            if TMP in entry.name and entry.stat().st_ctime >= since:
                out.append(entry.name)
    except FileNotFoundError:
        pass
    return out


def committed(ckpt: Path) -> dict[int, dict]:
    """``{step: metadata}`` of the committed checkpoints (orbax renamed them from tmp)."""
    out = {}
    for name in os.listdir(ckpt) if ckpt.exists() else []:
        if name.isdigit():
            out[int(name)] = json.loads((ckpt / name / "meta" / "metadata").read_text())
    return out


def expected_resume(ckpt: Path) -> int:
    """The position a restart must resume from: the newest committed checkpoint's (every
    checkpoint of this healthy run is healthy: checked here)."""
    metas = committed(ckpt)
    for step, m in metas.items():
        assert m["level"] in (0, 1) and m["open_peak"] < 2, f"checkpoint {step} is not healthy: {m['level']}"
    return metas[max(metas)]["position"] if metas else 0


def interrupt(child: Child, kind: str, at: int, ckpt: Path) -> dict:
    """Interrupts ``child`` once it asked for position ``at``: ``'term'`` (SIGTERM),
    ``'kill'`` (SIGKILL there), ``'kill_in_save'`` (SIGKILL as soon as a save that
    started after that is seen in flight). Returns what happened."""
    child.wait_position(at)
    saw = None
    if kind == "kill_in_save":
        deadline = time.monotonic() + 120
        while not saw:
            assert child.alive() and time.monotonic() < deadline, "no save seen"
            saw = new_tmp_dirs(ckpt, child.started)
            time.sleep(0.002)
    t0 = time.monotonic()
    os.kill(child.pid, signal.SIGTERM if kind == "term" else signal.SIGKILL)
    code = child.finish()
    return {"kind": kind, "at": at, "code": code, "exit_s": time.monotonic() - t0,
            "last": child.positions[-1], "in_save": bool(new_tmp_dirs(ckpt, child.started)),
            "err": child.err()}


def schedule(rng: random.Random) -> list[str]:
    kinds = ["kill_in_save"] * KILLS_IN_SAVE + ["kill"] * KILLS_AT_STEP + ["term"] * TERMS
    rng.shuffle(kinds)
    return kinds


def run_interrupted(cwd: Path, script: Path, forker: Forker) -> tuple[list[dict], list[int]]:
    """The chain of interrupted runs and the restart after each; returns the interruptions
    and each run's first position."""
    rng = random.Random(SEED)
    ckpt = cwd / "runs" / "usage" / "ckpt"
    events, starts = [], []
    for kind in schedule(rng):
        resume = expected_resume(ckpt)
        child = forker.run(script, cwd)
        starts.append(child.wait_position(0))
        assert child.positions[0] == resume, (child.positions[0], resume, sorted(committed(ckpt)))
        at = resume + rng.randint(1, 45)
        assert at < (LAST_SAVE if kind == "kill_in_save" else NUM_STEPS - 1), "the seed ran too far"
        events.append(interrupt(child, kind, at, ckpt))
        if kind == "term":     # the preemption's checkpoint is the step the run stopped after
            assert committed(ckpt)[events[-1]["last"]]["position"] == events[-1]["last"] + 1
    resume = expected_resume(ckpt)
    child = forker.run(script, cwd)
    starts.append(child.wait_position(0))
    assert child.positions[0] == resume
    assert child.finish(timeout=600) == 0, child.err()[-3000:]
    return events, starts


def logged(logdir: Path) -> dict[str, dict[int, set[float]]]:
    """Every scalar the run logged: ``{tag: {step: {values}}}`` (a restart may log a
    step again: both values are kept; a NaN as the string ``"nan"``, equal to itself)."""
    from jvitals import report

    run = report.read_run(str(logdir))
    out: dict[str, dict[int, set[float]]] = {}
    for source in (run.scalars, run.superseded):
        for tag, (steps, values) in source.items():
            for s, v in zip(steps.tolist(), values.tolist()):
                out.setdefault(tag, {}).setdefault(int(s), set()).add("nan" if v != v else v)
    return out


def test_the_readme_loop_survives_kills_and_preemptions_bitwise(tmp_path):
    code = survive_block()
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"
    for d in (ref_dir, run_dir):
        d.mkdir()
        (d / "usage.py").write_text(code)
    ref = Child(ref_dir / "usage.py", ref_dir)          # alongside the interrupted runs
    forker = Forker()
    try:
        events, starts = run_interrupted(run_dir, run_dir / "usage.py", forker)
        assert ref.finish(timeout=600) == 0, ref.err()[-3000:]
    finally:
        forker.close()
        ref.proc.kill()

    kills = [e for e in events if e["kind"] != "term"]
    assert len(kills) == KILLS_IN_SAVE + KILLS_AT_STEP
    assert all(e["code"] == -signal.SIGKILL for e in kills)
    assert sum(e["in_save"] for e in kills) >= KILLS_IN_SAVE, [(e["kind"], e["in_save"]) for e in kills]
    for i, e in enumerate(events):
        if e["kind"] == "term":        # a clean exit in time, the save at the step it stopped at
            assert e["code"] == 0 and e["exit_s"] < 60, e["err"][-3000:]
            assert starts[i + 1] == e["last"] + 1, "steps recomputed after a SIGTERM"
            assert "preemption notice (SIGTERM)" in e["err"]
    assert_bitwise(ref_dir / "final.npz", run_dir / "final.npz")
    ref_logs, logs = logged(ref_dir / "runs/usage/logs"), logged(run_dir / "runs/usage/logs")
    both = [(tag, s) for tag in ref_logs for s in ref_logs[tag] if s in logs.get(tag, {})]
    assert len(both) > 50 and "loss" in logs
    for tag, s in both:
        assert logs[tag][s] == ref_logs[tag][s], (tag, s, logs[tag][s], ref_logs[tag][s])
    print(json.dumps({"interruptions": [{k: v for k, v in e.items() if k != "err"} for e in events],
                      "starts": starts, "figures_compared": len(both),
                      "kills_in_save": sum(e["in_save"] for e in kills),
                      "term_exit_s": [round(e["exit_s"], 2) for e in events if e["kind"] == "term"]}))


def test_the_readme_nnx_loop_survives_a_sigterm_bitwise(tmp_path):
    """The Flax NNX block: a SIGTERM half-way is a clean exit; the restart recomputes no
    step and ends bitwise where the uninterrupted run ends."""
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"
    for d in (ref_dir, run_dir):
        d.mkdir()
        (d / "usage.py").write_text(survive_block(nnx=True, num_steps=120))
    ref = Child(ref_dir / "usage.py", ref_dir)
    forker = Forker()
    try:
        first = forker.run(run_dir / "usage.py", run_dir)
        assert first.wait_position(0) == 0
        e = interrupt(first, "term", 60, run_dir / "runs" / "usage-nnx" / "ckpt")
        assert e["code"] == 0 and e["exit_s"] < 60 and "preemption notice (SIGTERM)" in e["err"], e["err"][-3000:]
        again = forker.run(run_dir / "usage.py", run_dir)
        assert again.wait_position(0) == e["last"] + 1                # nothing recomputed
        assert again.finish(timeout=600) == 0, again.err()[-3000:]
        assert ref.finish(timeout=600) == 0, ref.err()[-3000:]
    finally:
        forker.close()
        ref.proc.kill()
    assert_bitwise(ref_dir / "final.npz", run_dir / "final.npz")
