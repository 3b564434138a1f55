"""Two real JAX processes (gloo, 4 CPU devices each) share one rollback decision.

Host-local figures differ between the processes (process 1's throughput collapses,
process 1 alone sees a red verdict); every process must still take process 0's
decision at the same step, restore onto the caller's mesh with the caller's
shardings, and get its own data position back on resume.
"""

import json

import pytest

from multiprocess_util import run_workers

WORKER = """
import json, os
import numpy as np
import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from jvitals.optim.lr_scale import get_lr_scale, with_lr_scale
from jvitals.monitor.config import BaselineConfig, SystemConfig
from jvitals.monitor.monitor import Monitor
from jvitals.monitor.policy import Policy
from jvitals.monitor.types import Alert, Level, Verdict
from jvitals.guard.rollback import Action, Rollback
from jvitals.guard import Retention

assert jax.process_count() == 2 and jax.device_count() == 8
pid = jax.process_index()
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
shard, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
tx = with_lr_scale(optax.sgd(0.1))
init = jax.jit(tx.init, out_shardings=rep)

def state(v):
    w = jax.make_array_from_callback((16, 4), shard, lambda idx: np.full((16, 4), v, np.float32)[idx])
    return {"params": {"w": w}, "opt_state": init({"w": w}),
            "step": jax.device_put(np.int32(v + 1), rep)}

def red(step, on, onset):
    if not on:
        return Verdict(step, Level.GREEN, [], [], [], {})
    a = Alert(id=1, rule="divergence", metric="loss", level=Level.RED, step=step, value=9.0,
              baseline=1.0, ratio=9.0, onset_step=onset, opened_step=onset,
              message=f"[RED] loss diverged on process {pid}", cause="c", prescription="p",
              localization=[], peak_level=Level.RED)
    return Verdict(step, Level.RED, [a], [a], [], {})

def local(x):
    return float(np.asarray(x.addressable_shards[0].data).ravel()[0])

directory = os.environ["CKPT_DIR"]
# A drop held 10 steps (the default 40 is for long runs): process 1's throughput falls at 30.
monitor = Monitor(Policy(baselines=BaselineConfig(warmup_steps=0, steps=20),
                         system=SystemConfig(throughput_hold_steps=10)))
guard = Rollback(directory, save_every=10, retention=Retention(keep_last=10))
_, pos = guard.resume(state(0), {"pid": pid, "i": 0}, monitor)
out = {"levels": [], "actions": []}
for step in range(0, 60, 5):
    tput = 1000.0 if (pid == 0 or step < 30) else 300.0     # host-local figure
    v = monitor.update(step, {"loss": 2.0 - step / 1000, "grad/global_norm": 1.0,
                              "sys/steps_per_sec": tput})
    r = guard.act(step, state(step), v, {"pid": pid, "i": step + 1})
    out["levels"].append(int(v.level))
    out["actions"].append(r.action.value)
out["saved_levels"] = {c.step: c.level for c in guard.checkpoints}
r = guard.act(60, state(60), red(60, pid == 1, 47), {"pid": pid, "i": 61})    # only process 1 red
out["a60"] = r.action.value
r = guard.act(65, state(65), red(65, pid == 0, 47), {"pid": pid, "i": 66})    # only process 0 red
out["a65"] = [r.action.value, r.target_step, local(r.state["params"]["w"]),
              get_lr_scale(r.state), r.state["params"]["w"].sharding == shard,
              int(np.asarray(r.state["step"].addressable_shards[0].data))]
out["a70"] = guard.act(70, r.state, red(70, False, 0), {"pid": pid, "i": 71}).action.value
guard.close()

guard2 = Rollback(directory, save_every=10)
s, pos = guard2.resume(state(0), None, Monitor(Policy(baselines=BaselineConfig(warmup_steps=0, steps=20))))
out["resume"] = [guard2.resumed_step, pos, local(s["params"]["w"]), get_lr_scale(s),
                 s["params"]["w"].sharding == shard, sorted(guard2.quarantined)]
guard2.close()

# The earliest sign is each process's own (its alert chain), but process 0's decides:
# process 1 saw an extra ORANGE alert from step 12, process 0's chain starts at 22.
def alert(id_, level, step, onset):
    return Alert(id=id_, rule="grad_norm", metric="grad/global_norm", level=Level(level), step=step,
                 value=9.0, baseline=1.0, ratio=9.0, onset_step=onset, opened_step=onset,
                 message=f"[{Level(level).name}] #{id_}", cause="c", prescription="p",
                 localization=[], peak_level=Level(level))

guard3 = Rollback(os.environ["CKPT_DIR"] + "_chain", save_every=10, retention=Retention(keep_last=10))
for step in range(0, 30, 5):
    guard3.act(step, state(step), None, {"pid": pid, "i": step + 1})
mine = [alert(1, Level.ORANGE, 25, 22)] + ([alert(2, Level.ORANGE, 25, 12)] if pid == 1 else [])
guard3.act(25, state(25), Verdict(25, Level.ORANGE, mine, mine, [], {}), {"pid": pid, "i": 26})
red_alerts = [alert(3, Level.RED, 30, 22)] + mine
r = guard3.act(30, state(30), Verdict(30, Level.RED, red_alerts, [], [], {}), {"pid": pid, "i": 31})
out["chain"] = [r.target_step, guard3.history[0]["onset_step"], local(r.state["params"]["w"]),
                sorted(guard3.pins)]
guard3.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_take_process_0s_decision(tmp_path):
    outs = run_workers(WORKER, nproc=2, devices_per_process=4, timeout=240,
                       extra_env={"CKPT_DIR": str(tmp_path / "ck")}, tmp_path=tmp_path)
    res = [json.loads(next(line for line in o.splitlines() if line.startswith("RESULT "))[7:])
           for o in outs]
    p0, p1 = res
    # The monitors disagree: process 1's throughput fell, so it alone is YELLOW ...
    assert set(p0["levels"]) == {0}
    assert p1["levels"][-1] == 1 and p1["levels"][:6] == [0] * 6
    # ... but both processes saved the same checkpoints, at process 0's level.
    assert p0["actions"] == p1["actions"] == ["saved", "continue"] * 6
    assert p0["saved_levels"] == p1["saved_levels"] == {str(s): 0 for s in range(0, 60, 10)}
    # A red seen by process 1 alone is not acted on; one seen by process 0 is, everywhere.
    assert p0["a60"] == p1["a60"] == "saved"
    for r in (p0, p1):
        action, target, value, lr, same_sharding, step = r["a65"]
        assert (action, target, value, same_sharding, step) == ("rollback", 40, 40.0, True, 66)
        assert abs(lr - 0.9) < 1e-6
    # Steps went forward: the save after the rollback landed.
    assert p0["a70"] == p1["a70"] == "saved"
    # Restart: the newest checkpoint (step 70, the rolled-back params), each process's own
    # data position, the LR scale, the quarantine.
    for pid, r in enumerate(res):
        step, pos, value, lr, same_sharding, quarantined = r["resume"]
        assert (step, value, same_sharding) == (70, 40.0, True)
        assert pos == {"pid": pid, "i": 71}
        assert abs(lr - 0.9) < 1e-6 and quarantined == [50, 60]
    # The same target from process 0's chain (sign 22: older than the check of 20), on both.
    assert p0["chain"] == p1["chain"]
    assert p0["chain"][:3] == [10, 22, 10.0]
