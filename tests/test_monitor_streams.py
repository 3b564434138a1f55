"""The monitor on real-training streams (tests/data/streams, made by
benchmarks/fault_suite.py): resuming from a JSON state mid-run gives the
uninterrupted run's verdicts exactly."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from jvitals.monitor.monitor import Monitor

ROOT = pathlib.Path(__file__).resolve().parents[1]
STREAMS = ROOT / "tests" / "data" / "streams"


def _fs():
    spec = importlib.util.spec_from_file_location("jvitals_bench_fault_suite",
                                                  ROOT / "benchmarks" / "fault_suite.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _stream(name):
    path = STREAMS / f"{name}.npz"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python benchmarks/fault_suite.py generate --only {name}`")
    fs = _fs()
    return fs, fs.load_stream(path)


def snapshot(v):
    return (v.step, int(v.level), [a.state_dict() for a in v.alerts],
            [a.id for a in v.new_alerts], [a.id for a in v.closed_alerts], dict(v.scores),
            v.onset_step)


@pytest.mark.parametrize("name,cadence", [("lr_x1000_once", 10), ("emb_lr_x30", 10),
                                          ("corrupt_data", 50)])
def test_resume_mid_stream_gives_identical_verdicts(name, cadence):
    fs, st = _stream(name)
    checks = list(fs.replay(st, cadence))
    ref = Monitor()
    expect = [snapshot(ref.update(s, d)) for s, d in checks]
    assert any(e[1] > 0 for e in expect), "the stream should raise something to compare"
    half = len(checks) // 2
    m = Monitor()
    got = [snapshot(m.update(s, d)) for s, d in checks[:half]]
    state = json.loads(json.dumps(m.state_dict(), allow_nan=False))
    m = Monitor.from_state_dict(state)
    got += [snapshot(m.update(s, d)) for s, d in checks[half:]]
    for i, (g, e) in enumerate(zip(got, expect)):
        assert g == e, f"verdicts diverge at step {checks[i][0]}"
    assert json.dumps(m.state_dict()) == json.dumps(ref.state_dict())
