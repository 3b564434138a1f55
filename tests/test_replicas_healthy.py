"""10,000 healthy steps of a real 8-device run raise no replica alert; the same stream with
a fault injected is named within 2 checks (the stored stream: tests/data/replicas/README.md)."""

import pathlib

import numpy as np
import pytest

import jvitals as vitals

pytestmark = pytest.mark.slow   # the slow tier: a 10,000-step soak

DATA = pathlib.Path(__file__).parent / "data" / "replicas" / "healthy_8dev.npz"


@pytest.fixture(scope="module")
def stream():
    with np.load(DATA) as f:
        z = {k: f[k] for k in f.files}
    assert z["replica/loss"].shape == (10_000, 8) and z["replica/nonfinite"].sum() == 0
    assert (z["data"][1] == (z["data"][0] + 1) % 8).all(), "the data shards rotate over the replicas"
    return z


def replay(z, steps, inject=None, policy=None):
    """Every step checked: the replica rule's alerts opened, as ``(step, alert)``."""
    rule = vitals.ReplicaRule(policy or vitals.Policy())
    monitor = vitals.Monitor(rules=[rule])
    figs = [k for k in z if k.startswith("replica/")]
    opened = []
    for i in steps:
        vectors = {k: z[k][i].astype(np.float64) for k in figs}
        if inject is not None:
            inject(i, vectors, z["data"][i])
        v = monitor.update(int(i), vitals.flat_replicas(vectors, data=z["data"][i]))
        opened += [(int(i), a) for a in v.new_alerts]
    return opened, rule


def test_ten_thousand_healthy_steps_raise_no_replica_alert(stream):
    opened, rule = replay(stream, range(10_000))
    assert opened == [], [(s, a.message) for s, a in opened[:3]]
    assert set(rule.spread) == {"loss", "hidden_states_rms", "hidden_states_abs.max",
                                "output_layer_logits_abs.max"}


@pytest.mark.parametrize("fault, figure, suspect", [
    ("device", "replica/hidden_states_rms", "device"),
    ("data", "replica/loss", "data"),
])
def test_the_same_stream_with_a_fault_is_named_within_two_checks(stream, fault, figure, suspect):
    start = 6000

    def inject(i, v, shards):
        if i < start:
            return
        if fault == "device":
            v["replica/hidden_states_rms"][3] *= 1e3
        else:
            r = int(np.flatnonzero(shards == 5)[0])
            v["replica/loss"][r] = 4.5           # random tokens: about log(vocab) and more
    opened, _ = replay(stream, range(start - 100, start + 5), inject)
    assert opened, "not named"
    step, a = opened[0]
    assert step <= start + 1 and a.metric == figure and a.details["suspect"] == suspect
