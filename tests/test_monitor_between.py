"""The rules for what a sparse cadence sees (jvitals/monitor/rules_window.py): the early rule
on real training (a jump 250 steps into a run, checked every 5 steps), the data rule on the
tuning corpus' degrading-pipeline streams (real training), the throughput rule on a steady
run and on this machine's healthy runs."""

from __future__ import annotations

import functools
import importlib.util
import math
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


cp = _load("jvitals_bench_corpus_b", ROOT / "benchmarks" / "corpus.py")
fs, win = cp.fs, cp.win
CFG = rm.ModelConfig(vocab=64, d_model=32, n_layers=2)


class State(NamedTuple):
    params: Any
    opt_state: Any


@pytest.mark.slow
def test_a_jump_250_steps_in_is_seen_at_once_and_goes_red():
    """Real training checked every 5 steps; the learning rate x300 at step 250 (before the
    baselines are armed): ORANGE at the first check after it, RED while it does not recover."""
    tx = vitals.with_lr_scale(vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)),
                                            schedule=3e-3))

    @jax.jit
    def step(state, batch, read):
        (loss, _), grads = jax.value_and_grad(lambda p: rm.loss_fn(p, batch, CFG), has_aux=True)(state.params)
        updates, opt = tx.update(grads, state.opt_state, state.params, loss=loss, vitals_heavy=False,
                                 vitals_read=read)
        return State(optax.apply_updates(state.params, updates), opt), loss

    params = rm.init_params(CFG, jax.random.key(1))
    state = State(params, tx.init(params))
    mon, verdicts, losses = vitals.Monitor(), {}, {}
    for i in range(300):
        if i == 250:
            state = State(state.params, vitals.set_lr_scale(state.opt_state, 300.0))
        state, loss = step(state, rm.make_batch(i, CFG, batch=4, seq=16), jnp.asarray(i % 5 == 0))
        if i % 5 == 0:
            host = jax.device_get({"loss": loss, **vitals.recorded(state.opt_state)})
            losses[i] = float(host["loss"])
            verdicts[i] = mon.update(i, host)
    assert all(verdicts[s].level == vitals.Level.GREEN for s in verdicts if s < 250)
    assert mon.baseline_start is not None and 250 < mon.baseline_start + mon.policy.baselines.steps
    jumped = losses[255] / np.median([losses[s] for s in range(205, 250, 5)])
    assert jumped >= 2.0, jumped
    v = verdicts[255]
    assert v.level >= vitals.Level.ORANGE, [(a.rule, a.metric, a.level) for a in v.alerts]
    assert any(a.rule == "early" and a.onset_step == 255 for a in v.alerts)
    red = [s for s in sorted(verdicts) if verdicts[s].level == vitals.Level.RED]
    assert red and red[0] <= 270, red


@functools.lru_cache(maxsize=None)
def _replay(name: str, cadence: int, heavy: int):
    st = next(s for s in cp.load_split("tuning") if s.name == name)
    st = win.thin(st, heavy)
    mon = vitals.Monitor()
    out = [mon.update(s, m) for s, m in win.replay(st, cadence)]
    return st, mon, out


DEGRADE = ("data_degrade.ref-dense.pystdlib.adamw.cosine.s94", "data_degrade.gpt2.pystdlib.adamw.constant.s95")


@pytest.mark.parametrize("name", DEGRADE)
@pytest.mark.parametrize("cadence,heavy", [(50, 500), (10, 0)])
def test_a_degrading_pipeline_is_data_not_divergence(name, cadence, heavy):
    """The share of random-token sequences ramping 0 -> 60% over 2,000 steps (real training,
    tuning corpus): a YELLOW that says "data", no RED, no rollback-prescribing loss alert."""
    st, mon, verdicts = _replay(name, cadence, heavy)
    f = st.meta["fault_step"]
    alerts = {a.id: a for v in verdicts for a in v.alerts}
    assert not [a for a in alerts.values() if a.opened_step < f], "an alert before the fault"
    data = [a for a in alerts.values() if a.rule == "data"]
    assert data and data[0].prescription == vitals.monitor.PRESCRIPTIONS["data_quality"].prescription
    assert data[0].opened_step - f <= 1000
    assert max(v.level for v in verdicts) == vitals.Level.YELLOW
    assert not [a for a in alerts.values() if a.rule in ("loss_spike", "divergence")]


def test_an_lr_blow_up_is_not_called_data():
    st, mon, verdicts = _replay("lr_x100.gpt2.pystdlib.adamw.constant.s30", 50, 500)
    rules = {a.rule for v in verdicts for a in v.alerts}
    assert "data" not in rules and rules


def _steady(noise: float, drop_at: int | None, drop: float = 0.4, steps: int = 6000, seed: int = 0):
    rng = np.random.default_rng(seed)

    def figures(s: int) -> dict:
        rate = 4e4 * math.exp(noise * rng.standard_normal())
        if drop_at is not None and s >= drop_at:
            rate *= 1.0 - drop
        return {"sys/tokens_per_sec": rate, "opt/learning_rate": 1e-3, "loss": 2.0}

    mon = vitals.Monitor()
    return [mon.update(s, figures(s)) for s in range(0, steps, 50)]


def test_a_steady_runs_40pc_throughput_drop_is_yellow():
    """4% noise (checks every 50 steps): a steady 40% drop is a YELLOW within 100 steps; the
    same run without the drop is quiet."""
    vs = _steady(0.04, 3000)
    first = next(v.step for v in vs if v.level > vitals.Level.GREEN)
    (a,) = [a for v in vs for a in v.alerts if v.step == first]
    assert a.rule == "throughput" and 3000 <= first <= 3100 and a.onset_step >= 3000
    assert all(v.level == vitals.Level.GREEN for v in _steady(0.04, None))


def test_this_machines_healthy_throughput_dips_are_not_alerts():
    """The tuning corpus' healthy runs (measured CPU time on this shared machine: dips of
    25-50% for 100-200 steps) at checks every 10 and 50: no throughput alert."""
    for st in cp.load_split("tuning"):
        if st.meta.get("fault"):
            continue
        for cadence in (10, 50):
            p = vitals.Policy()
            mon = vitals.Monitor(p, rules=[vitals.monitor.ThroughputRule(p)])
            for s, m in fs.replay(st, cadence):
                v = mon.update(s, {k: x for k, x in m.items() if k.startswith("sys/") or k == "opt/learning_rate"})
                assert not v.alerts, (st.name, cadence, s, v.alerts[0].message)
