"""vitals.write through a real clu writer, read back from the TensorBoard event files."""

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jvitals as vitals

metric_writers = pytest.importorskip("clu.metric_writers")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
tensor_util = pytest.importorskip("tensorboard.util.tensor_util")


def read_events(logdir):
    """{tag: {step: value}} for tensor events (TF2 summaries), from every event file."""
    out = {}
    for path in Path(logdir).rglob("*tfevents*"):
        acc = event_accumulator.EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            for ev in acc.Tensors(tag):
                out.setdefault(tag, {})[ev.step] = tensor_util.make_ndarray(ev.tensor_proto)
    return out


def drive_monitor_to_an_alert():
    monitor = vitals.Monitor(vitals.Policy(baselines=vitals.BaselineConfig(steps=20),
                                           health=vitals.HealthConfig(red_after=3)))
    verdict = None
    for step in range(60):
        gnorm = 1.0 if step < 40 else 5.0
        verdict = monitor.update(step, {"loss": 2.0, "grad/global_norm": gnorm})
    assert verdict.level >= vitals.Level.ORANGE and verdict.alerts
    return verdict


def test_scalars_histograms_alerts_and_events_round_trip(tmp_path):
    writer = metric_writers.create_default_writer(str(tmp_path), asynchronous=False)
    verdict = drive_monitor_to_an_alert()
    metrics = {
        "loss": jnp.float32(2.5),
        "grad/global_norm": np.float32(3.25),
        "grad/nonfinite_count": jnp.int32(0),
        "grad/share/layer_0": 0.25, "grad/share/layer_1": 0.75,
        "act/output_layer_logits_abs.max": jnp.float32(float("nan")),
    }
    vitals.write(writer, 60, metrics, verdict, events=[{"event": "rollback", "step": 60, "to_step": 20}])
    vitals.write(writer, 61, {"loss": 2.0})
    writer.flush()
    ev = read_events(tmp_path)
    assert float(ev["loss"][60]) == 2.5 and float(ev["loss"][61]) == 2.0
    assert float(ev["grad/global_norm"][60]) == 3.25
    assert float(ev["grad/share/layer_1"][60]) == 0.75
    assert math.isnan(float(ev["act/output_layer_logits_abs.max"][60]))
    assert float(ev["vitals/level"][60]) == int(verdict.level)
    # per-layer family as a histogram: TF stores [left, right, count] buckets
    hist = np.asarray(ev["grad/share/by_layer"][60])
    assert hist.shape[-1] == 3 and hist[:, 2].sum() == 2
    assert hist[:, 0].min() == pytest.approx(0.25) and hist[:, 1].max() == pytest.approx(0.75)
    alerts = json.loads(ev["vitals/alerts_json"][60].item().decode())
    assert {a["metric"] for a in alerts} >= {"grad/global_norm"}
    assert {a["level"] for a in alerts} <= {"YELLOW", "ORANGE", "RED"}
    first = next(a for a in alerts if a["rule"] == "grad_norm")
    src = next(a for a in verdict.alerts if a.rule == "grad_norm")
    assert first["id"] == src.id and first["onset_step"] == src.onset_step
    assert first["value"] == pytest.approx(src.value)
    assert "grad/global_norm" in ev["vitals/alerts"][60].item().decode()
    events = json.loads(ev["vitals/events_json"][60].item().decode())
    assert events == [{"event": "rollback", "step": 60, "to_step": 20}]


class RecordingWriter:
    """Checks clu's rule: each name at most once per step, across all write_* calls."""

    def __init__(self):
        self.seen = set()

    def _add(self, step, names):
        for n in names:
            assert (step, n) not in self.seen, f"{n} written twice at step {step}"
            self.seen.add((step, n))

    def write_scalars(self, step, scalars):
        self._add(step, scalars)

    def write_texts(self, step, texts):
        self._add(step, texts)

    def write_histograms(self, step, arrays, num_buckets=None):
        self._add(step, arrays)


def test_one_write_per_name_per_step():
    w = RecordingWriter()
    verdict = drive_monitor_to_an_alert()
    vitals.write(w, 5, {"loss": 1.0, "grad/norm/layer_0": 1.0, "grad/norm/layer_1": 2.0}, verdict,
                 events=[{"event": "save", "step": 5}, {"event": "pause", "step": 5}])
    names = {n for _, n in w.seen}
    assert {"loss", "vitals/level", "grad/norm/by_layer", "vitals/alerts_json", "vitals/events_json"} <= names


def test_non_numeric_metric_is_a_clear_error():
    with pytest.raises(TypeError, match="metric 'note' must be numeric"):
        vitals.write(RecordingWriter(), 0, {"note": "hello"})


def test_events_none_and_the_guard_writes_its_figures(tmp_path):
    """``write(..., events=None)`` works; ``Rollback(writer=)`` writes ``rollback/count``,
    ``rollback/lr_scale`` and its events at each call, read back from the event files."""
    import optax

    from jvitals.monitor.types import Alert, Level, Verdict
    from jvitals.guard.rollback import Rollback
    from jvitals.report.writers import EVENTS_TAG, ROLLBACK_COUNT, ROLLBACK_LR_SCALE

    tx = vitals.with_lr_scale(optax.sgd(0.1))

    def state(v):
        p = {"w": jnp.full((3,), float(v))}
        return {"params": p, "opt_state": tx.init(p), "step": jnp.asarray(v)}

    logdir = tmp_path / "logs"
    w = metric_writers.create_default_writer(str(logdir), asynchronous=False)
    vitals.write(w, 0, {"loss": 1.0}, None, events=None)
    guard = Rollback(tmp_path / "ck", save_every=10, writer=w)
    for s in (0, 5, 10, 15):
        guard.act(s, state(s), None, s + 1)
    red = Alert(id=1, rule="divergence", metric="loss", level=Level.RED, step=20, value=9.0, baseline=1.0,
                ratio=9.0, onset_step=20, opened_step=20, message="[RED] diverged", cause="c",
                prescription="p", localization=[], peak_level=Level.RED)
    r = guard.act(20, state(20), Verdict(20, Level.RED, [red], [red], [], {}), 21)
    guard.act(25, r.state, None, 26)
    guard.close()
    w.close()
    got = read_events(logdir)
    assert {s: float(v) for s, v in got[ROLLBACK_COUNT].items()} == {0: 0.0, 5: 0.0, 10: 0.0, 15: 0.0,
                                                                    20: 1.0, 25: 1.0}
    np.testing.assert_allclose([float(got[ROLLBACK_LR_SCALE][s]) for s in (15, 20, 25)], [1.0, 0.9, 0.9],
                               rtol=1e-6)
    events = {s: json.loads(v.item().decode()) for s, v in got[EVENTS_TAG].items()}
    assert [e["event"] for e in events[0]] == ["save"] and [e["event"] for e in events[10]] == ["save"]
    rb = [e for e in events[20] if e["event"] == "rollback"][0]
    assert rb["to_step"] == 10 and rb["lr_scale"] == pytest.approx(0.9)     # older than the check of 15
    assert "save" in [e["event"] for e in events[20]]                      # the rollback checkpoint
    assert [a["kind"] for a in rb["recovery"]] == ["restore", "lr_scale"]
    assert got["loss"][0] == 1.0
