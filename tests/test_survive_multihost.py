"""Preemption on two real JAX processes (gloo, 4 CPU devices each): SIGTERM to one of them.

JAX's preemption service (started by ``jax.distributed.initialize``) hears the SIGTERM on
process 1 and tells process 0; ``guard.preempted`` is True on both at the same step, both
save that step together and exit with code 0. Restarted, they resume from it and end
bitwise where the uninterrupted two-process run ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from multiprocess_util import REPO, WORKER_PRELUDE, free_port, run_workers
import pytest

pytestmark = pytest.mark.slow   # the slow tier (README): end-to-end runs in fresh processes

NUM_STEPS = 400

WORKER = """
import os, time
import numpy as np
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import jvitals as vitals

pid = jax.process_index()
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
tx = vitals.with_lr_scale(optax.adam(1e-2))
num_steps = int(os.environ["NUM_STEPS"])

@jax.jit
def init_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 1)) * 0.3}
    return {"step": jnp.zeros([], jnp.int32), "params": params, "opt_state": tx.init(params)}

@jax.jit
def batch_at(position):                  # the batch is a pure function of the data position
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), position), (64, 16))
    return jax.lax.with_sharding_constraint(x, shard)

@jax.jit
def train_step(state, x):
    def loss_fn(p):
        y = jnp.tanh(x @ p["w1"]) @ p["w2"]
        return jnp.mean((y - jnp.sin(x.sum(-1, keepdims=True))) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, loss

def local(x):                            # this process's copy of a replicated array
    return np.asarray(x.addressable_shards[0].data)

state = jax.jit(init_state, out_shardings=rep)()
monitor = vitals.Monitor()
guard = vitals.Rollback(os.environ["CKPT_DIR"], save_every=50)
state, position = guard.resume(state, 0, monitor)
print("START", int(local(state["step"])), position, flush=True)
for step in range(int(local(state["step"])), num_steps):
    state, loss = train_step(state, batch_at(position)); position += 1
    time.sleep(0.01)                     # the rest of a real step
    print("STEP", step, flush=True)
    if step % 10 == 0:
        verdict = monitor.update(step, {"loss": float(local(loss))})
        state = guard.respond(step, state, verdict, position)
    if guard.preempted(step, state, position):
        print("PREEMPTED", step, position, flush=True)
        break
guard.close()
if int(local(state["step"])) == num_steps:
    np.savez(os.environ["OUT"] + f"_{pid}.npz", *[local(x) for x in jax.tree.leaves(state)])
print("DONE", flush=True)
"""


def start_workers(tmp_path: Path, env_extra: dict[str, str], nproc: int = 2) -> tuple[list, list[Path]]:
    """Starts the worker on ``nproc`` processes (as :func:`multiprocess_util.run_workers`,
    without waiting); returns the processes and their log files."""
    script = tmp_path / "worker_preempt.py"
    script.write_text(WORKER_PRELUDE % {"devices": 4, "repo": str(REPO)} + WORKER)
    port = free_port()
    procs, logs = [], [tmp_path / f"preempt_{i}.log" for i in range(nproc)]
    for i in range(nproc):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update({"JVITALS_COORD": f"127.0.0.1:{port}", "JVITALS_NPROC": str(nproc),
                    "JVITALS_PID": str(i), "TF_CPP_MIN_LOG_LEVEL": "3", **env_extra})
        with open(logs[i], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, str(script)], stdout=log,
                                          stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path)))
    return procs, logs


def lines(log: Path, word: str) -> list[list[str]]:
    return [ln.split()[1:] for ln in log.read_text().splitlines() if ln.startswith(word + " ")]


def preempt_one(tmp_path: Path, env: dict[str, str], at: int) -> tuple[list[int], float, list[Path]]:
    """Runs both workers and sends SIGTERM to process 1 alone once it has done step ``at``.
    Returns the exit codes, the seconds from the signal to the last exit, and the logs."""
    procs, logs = start_workers(tmp_path, env)
    try:
        deadline = time.monotonic() + 300
        while not any(int(s[0]) >= at for s in lines(logs[1], "STEP")):
            assert all(p.poll() is None for p in procs), "\n".join(p.read_text()[-3000:] for p in logs)
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
        return codes, time.monotonic() - t0, logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def finals(prefix: Path) -> list[list[np.ndarray]]:
    out = []
    for pid in range(2):
        with np.load(f"{prefix}_{pid}.npz") as f:
            out.append([f[k] for k in f.files])
    return out


def test_a_sigterm_on_one_process_saves_on_both_at_one_step_and_resumes_bitwise(tmp_path):
    env = {"NUM_STEPS": str(NUM_STEPS), "CKPT_DIR": str(tmp_path / "ref_ck"), "OUT": str(tmp_path / "ref")}
    run_workers(WORKER, nproc=2, devices_per_process=4, timeout=300, extra_env=env, tmp_path=tmp_path)
    reference = finals(tmp_path / "ref")

    env = {"NUM_STEPS": str(NUM_STEPS), "CKPT_DIR": str(tmp_path / "ck"), "OUT": str(tmp_path / "run")}
    codes, took, logs = preempt_one(tmp_path, env, at=30)
    text = "\n".join(p.read_text()[-3000:] for p in logs)
    assert codes == [0, 0], text
    assert took < 60, took
    stopped = [lines(p, "PREEMPTED") for p in logs]
    assert len(stopped[0]) == len(stopped[1]) == 1 and stopped[0] == stopped[1], text
    step = int(stopped[0][0][0])
    assert 30 <= step < NUM_STEPS - 1
    assert (tmp_path / "ck" / str(step)).is_dir()            # committed, one checkpoint for both
    assert not [n for n in os.listdir(tmp_path / "ck") if "tmp" in n]

    outs = run_workers(WORKER, nproc=2, devices_per_process=4, timeout=300, extra_env=env, tmp_path=tmp_path)
    for out in outs:                                          # both resume right after it
        start = [ln.split() for ln in out.splitlines() if ln.startswith("START ")][0]
        assert start[1:] == [str(step + 1), str(step + 1)], out[-2000:]
    print(f"SIGTERM to process 1 after step 30: both saved step {step}, exited {codes} in {took:.1f} s")
    resumed = finals(tmp_path / "run")
    for pid in range(2):
        assert len(resumed[pid]) == len(reference[pid]) > 3
        for a, b in zip(resumed[pid], reference[pid]):
            assert a.tobytes() == b.tobytes()
