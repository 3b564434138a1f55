"""The offline report: reading event files back, the HTML's content, the CLI, and a headless render."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")
metric_writers = pytest.importorskip("clu.metric_writers")

from jvitals.report import cli

from jvitals import report  # noqa: E402
from jvitals.report import guide  # noqa: E402

EVIL = "<script>alert(1)</script> & <b>bold</b>"
NUM_LAYERS = 4
STEPS = list(range(0, 1601, 20))
NAN_STEP = 300
ROLLBACK_STEP, ROLLBACK_TO = 1200, 1000


def _share(step):
    """Layer 0's share grows from 8% to ~20% after step 1000 (the guide's case)."""
    s0 = 0.08 if step < 1000 else 0.08 + 0.12 * min(1.0, (step - 1000) / 400)
    rest = (1 - s0) / (NUM_LAYERS - 1)
    return [s0] + [rest] * (NUM_LAYERS - 1)


def _level(step):
    if 800 <= step < 1000:
        return 1
    if 1100 <= step < 1180:
        return 2
    if 1180 <= step < 1200:
        return 3
    return 0


def _scalars(step):
    loss = 4.0 * math.exp(-step / 800) + 2.0
    gn = 1.0 + 0.1 * math.sin(step / 50)
    if step == NAN_STEP:
        gn = float("nan")
    d = {
            "loss": loss,
            "ppl": math.exp(loss),
            "grad/global_norm": gn,
            "grad/global_norm_post_clip": min(gn, 1.0) if gn == gn else gn,
            "grad/clip_ratio": min(1.0, 1.0 / gn) if gn == gn else gn,
            "grad/nonfinite_count": 0.0,
            "param/global_norm": 100.0 + step * 0.002,
            "act/output_layer_logits_rms.avg": 2.0 + step / 1000,
            "act/output_layer_logits_abs.max": 12.0 + step / 200,
            "act/hidden_states_abs.max": 30.0,
            "moe/maxvio.mean": 0.3,
            "moe/maxvio.max": 0.6,
            "moe/dead_expert_ratio": 0.0 if step < 1000 else 0.125,
            "vitals/level": float(_level(step)),
            "rollback/count": 0.0 if step < ROLLBACK_STEP else 1.0,
            "rollback/lr_scale": 1.0 if step < ROLLBACK_STEP else 0.9,
            "custom/unknown_tag": 7.0,
    }
    for i, s in enumerate(_share(step)):
        d[f"grad/share/layer_{i}"] = s
        d[f"grad/norm/layer_{i}"] = math.sqrt(s) * 1.0
    if step % 200 == 0:
        d["val/loss"] = loss + 0.05
        d["val/gap"] = 0.05
    return d


ALERT_YELLOW = {
        "level": "YELLOW", "rule": "grad_norm", "metric": "grad/global_norm", "step": 820,
        "onset_step": 800, "value": 2.2, "baseline": 1.0, "ratio": 2.2,
        "message": "grad norm 2.2x baseline " + EVIL, "cause": "shallow layers' LR too high & co",
        "prescription": "layer-wise LR decay", "localization": ["grad/share/layer_0 rose from 8% to 19%"],
}
ALERT_ORANGE = {
        "level": 2, "rule": "nonfinite", "metric": "loss", "step": 1100, "onset_step": None,
        "value": "nan", "baseline": None, "ratio": None, "message": "loss non-finite",
        "cause": "overflow", "prescription": "check loss scale; prefer bf16",
        "localization": [{"metric": "act/hidden_states_abs.max", "line": "hidden states left first <i>"}],
}
EVENTS = [
        {"event": "save", "step": 500, "level": "GREEN"},
        {"event": "save", "step": 1000, "level": "GREEN"},
        {"event": "pause", "step": 1180},
        {"event": "rollback", "step": ROLLBACK_STEP, "to_step": ROLLBACK_TO, "lr_scale": 0.9,
         "reason": "diverged </td><script>x()</script>"},
        {"event": "save", "step": 1500, "level": "GREEN"},
]


def write_synthetic_run(logdir):
    """A 1600-step run: a NaN, a yellow/orange/red episode, a rollback, per-layer shares."""
    w = metric_writers.create_default_writer(os.path.join(logdir, "train"), asynchronous=False)
    for step in STEPS:
        w.write_scalars(step, _scalars(step))
    w.write_texts(820, {"vitals/alerts_json": json.dumps([ALERT_YELLOW])})
    w.write_texts(900, {"vitals/alerts_json": json.dumps([dict(ALERT_YELLOW, step=900, value=2.4)])})
    w.write_texts(1100, {"vitals/alerts_json": json.dumps([ALERT_ORANGE]),
                         "vitals/alerts": "**ORANGE** loss non-finite " + EVIL,
                         "notes/config": "lr=3e-4 " + EVIL})
    for e in EVENTS:
        w.write_texts(e["step"], {"vitals/events_json": json.dumps([e])})
    w.write_histograms(1000, {"grad/hist/layer_0": np.linspace(-1, 1, 64)})
    w.flush()
    w.close()
    return logdir


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    return write_synthetic_run(str(tmp_path_factory.mktemp("run")))


@pytest.fixture(scope="module")
def run(logdir):
    return report.read_run(logdir)


@pytest.fixture(scope="module")
def html_path(logdir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out") / "report.html")
    assert cli.main(["report", logdir, "--out", out, "--title", "synthetic & <run>"]) == 0
    return out


@pytest.fixture(scope="module")
def doc(html_path):
    with open(html_path, encoding="utf-8") as f:
        return f.read()


def test_read_back_scalars_equal_what_was_written(run):
    expected = {s: _scalars(s) for s in STEPS}
    for tag in ("loss", "grad/global_norm", "param/global_norm", "grad/share/layer_0", "val/loss", "vitals/level"):
        steps, vals = run.scalars[tag]
        want_steps = [s for s in STEPS if tag in expected[s]]
        np.testing.assert_array_equal(steps, want_steps)
        want = np.array([expected[s][tag] for s in want_steps], dtype=np.float32)
        np.testing.assert_array_equal(vals.astype(np.float32), want)  # NaN == NaN here
    steps, vals = run.scalars["grad/global_norm"]
    assert np.isnan(vals[list(steps).index(NAN_STEP)])
    assert run.first_step == 0 and run.last_step == 1600
    assert [i for i, _ in run.layer_tags("grad/share/")] == list(range(NUM_LAYERS))
    assert "grad/hist/layer_0" not in run.scalars  # histograms are skipped


def test_read_back_alerts_and_events(run):
    assert len(run.alerts) == 2  # the yellow alert logged twice is merged
    yellow = next(a for a in run.alerts if a["rule"] == "grad_norm")
    assert yellow["message"] == ALERT_YELLOW["message"]
    assert yellow["step"] == 900 and yellow["value"] == 2.4 and yellow["logged_step"] == 820
    orange = next(a for a in run.alerts if a["rule"] == "nonfinite")
    assert orange["level"] == "ORANGE" and math.isnan(orange["value"])
    assert orange["localization"] == ["hidden states left first <i>"]
    assert [e["event"] for e in run.events] == ["save", "save", "pause", "rollback", "save"]
    rb = run.rollbacks()
    assert len(rb) == 1 and rb[0]["step"] == ROLLBACK_STEP and rb[0]["to_step"] == ROLLBACK_TO
    assert run.num_rollbacks == 1
    assert run.final_level == "GREEN"
    levels = {name for _, _, name in run.level_periods()}
    assert levels == {"GREEN", "YELLOW", "ORANGE", "RED"}


def test_rewritten_step_keeps_the_last_value(tmp_path):
    w = metric_writers.create_default_writer(str(tmp_path), asynchronous=False)
    for step in range(5):
        w.write_scalars(step, {"loss": float(step)})
    for step in range(3, 6):  # restarted from a checkpoint at step 3
        w.write_scalars(step, {"loss": 10.0 + step})
    w.write_texts(1, {"vitals/alerts_json": "not json <b>"})
    w.close()
    run = report.read_run(str(tmp_path))
    np.testing.assert_array_equal(run.scalars["loss"][0], [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(run.scalars["loss"][1], [0, 1, 2, 13, 14, 15])
    np.testing.assert_array_equal(run.superseded["loss"][1], [3, 4])
    assert run.alerts == [] and any("not valid JSON" in x for x in run.warnings)
    doc = report.page.build_html(run)
    assert "<b>" not in doc and "not json &lt;b&gt;" in doc


def test_report_content(doc, run):
    # Families present as embedded images, absent ones listed as not measured.
    for title in ("Loss (train / validation)", "Gradient global norm, pre / post clip", "Parameter global norm",
                  "Output-layer logits", "MoE load", "per-layer gradient share heat map", "level timeline"):
        assert f'alt="{title}"' in doc, title
    assert "Not measured (no tags logged)" in doc and "Throughput" in doc
    # Header.
    assert "synthetic &amp; &lt;run&gt;" in doc
    assert "0 - 1600" in doc
    # Alert rows, escaped.
    assert "<script" not in doc.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in doc
    assert "shallow layers&#x27; LR too high &amp; co" in doc
    assert "grad/share/layer_0 rose from 8% to 19%" in doc
    assert "hidden states left first &lt;i&gt;" in doc
    assert doc.count("<td><span class='lv YELLOW'>YELLOW</span>") == 1
    assert doc.count("<td><span class='lv ORANGE'>ORANGE</span>") == 1
    # Rollback marked.
    assert "<th>rollback at step</th>" in doc
    assert f"<td class='num'>{ROLLBACK_STEP}</td><td class='num'>{ROLLBACK_TO}</td>" in doc
    assert "diverged &lt;/td&gt;&lt;script&gt;x()&lt;/script&gt;" in doc
    # Check-up table with all three outcomes.
    assert "<h2>Check-up</h2>" in doc
    for status in ("PASSED", "FAILED", "NOT MEASURED"):
        assert f">{status}</td>" in doc, status
    # Self-contained: images as data URIs, no external references.
    srcs = re.findall(r'src="([^"]*)"', doc)
    assert len(srcs) >= 8 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:|//)', doc, re.I)
    assert "<link" not in doc and "@import" not in doc
    # Unknown tags are listed, not dropped; other texts are shown escaped; the markdown alerts are
    # not repeated when the JSON ones exist.
    assert "custom/unknown_tag" in doc
    assert "lr=3e-4 &lt;script&gt;" in doc and "**ORANGE**" not in doc
    # The guide's own wording is kept beside each translated item.
    assert "grad norm是否随loss同步下降" in doc


def test_checkup_items(run):
    assert report.guide.run_phase(run) == "middle"
    assert report.guide.run_phase(run, total_steps=2000) == "late"
    assert report.guide.run_phase(run, total_steps=10_000) == "middle"
    items = {(it.phase, it.text): it for it in report.checkup(run, all_phases=True)}
    assert len(items) == len(guide.CHECKLIST)
    by_text = {t: it for (_, t), it in items.items()}
    nan = by_text["No NaN or Inf at any step"]
    assert nan.status == "FAILED" and f"step {NAN_STEP}" in nan.figure
    assert by_text["Grad norm settles into a stable range (not diverging)"].status == "PASSED"
    assert by_text["Loss is falling at the expected rate"].status == "PASSED"
    assert by_text["Data-loading throughput reaches the expected level"].status == "NOT MEASURED"
    shares = by_text["The layer-wise grad norm distribution stays stable"]
    assert shares.status == "FAILED" and "layer 0" in shares.figure
    assert by_text["Checkpoints are being saved as expected"].status == "PASSED"
    assert by_text["Param norm grows slowly rather than jumping"].status == "PASSED"
    assert all(it.status == "NOT MEASURED" for it in items.values() if it.phase == "late")
    # Only the requested phase by default; an override is honoured.
    assert {it.phase for it in report.checkup(run)} == {"middle"}
    late = report.checkup(run, "late")
    assert {it.phase for it in late} == {"late"}
    assert next(it for it in late if "loss scale" in it.text).status == "NOT MEASURED"
    with pytest.raises(ValueError, match="Expected phase"):
        report.checkup(run, "adolescence")


def test_plot_helpers_for_notebooks(run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1)
    assert report.plot_family(run, "grad_norm", ax=axes[0]) is axes[0]
    assert report.plot_layer_heatmap(run, ax=axes[1]) is axes[1]
    assert report.plot_timeline(run, ax=axes[2]) is axes[2]
    assert report.plot_family(run, "throughput", ax=axes[0]) is None  # not logged
    with pytest.raises(KeyError, match="Expected a family key"):
        report.plot_family(run, "nope")
    plt.close(fig)


@pytest.mark.slow
def test_console_script(logdir, tmp_path):
    out = str(tmp_path / "sub" / "r.html")
    exe = shutil.which("jvitals")
    cmd = [exe] if exe else [sys.executable, "-m", "jvitals.report.cli"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    res = subprocess.run([*cmd, "report", logdir, "--out", out, "--phase", "start-up"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    with open(out, encoding="utf-8") as f:
        doc = f.read()
    assert "start-up <span class='muted'>(this run&#x27;s phase" in doc
    assert "<script" not in doc.lower()
    res = subprocess.run([sys.executable, "-m", "jvitals.report.cli", "report", str(tmp_path / "missing"), "--out", out],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "expected LOGDIR to be a directory" in res.stderr


def test_empty_logdir(tmp_path):
    out = str(tmp_path / "r.html")
    assert cli.main(["report", str(tmp_path), "--out", out]) == 0
    with open(out, encoding="utf-8") as f:
        assert "No metrics were found" in f.read()


@pytest.mark.slow
def test_chromium_renders_non_blank(html_path, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("headless Chromium not installed (Debian package 'chromium'; .ci/run installs it)")
    png = tmp_path / "shot.png"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
           "--window-size=1280,2000", "file://" + os.path.abspath(html_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert png.exists(), f"no screenshot (rc {res.returncode}): {res.stderr[-2000:]}"
    import matplotlib.image

    img = matplotlib.image.imread(str(png))[..., :3].astype(np.float64)
    if img.max() > 1.0:
        img /= 255.0
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000
    assert img.var() > 0.005, "screenshot is (nearly) uniform"
    non_white = (img.min(axis=-1) < 0.95).mean()
    assert 0.03 < non_white < 0.97, f"fraction of non-white pixels {non_white:.3f}"
    if os.environ.get("JVITALS_SCREENSHOT"):  # keep a copy to look at
        shutil.copy(png, os.environ["JVITALS_SCREENSHOT"])


def _run(scalars, events=()):
    sc = {k: (np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64)) for k, (s, v) in scalars.items()}
    return report.Run(logdir=".", files=[], scalars=sc, superseded={}, texts={}, alerts=[],
                      events=list(events), hparams={}, warnings=[])


def test_checkup_failures_late_phase():
    steps = np.arange(0, 4001, 20)
    loss = 3.0 - steps / 4000
    loss[(steps >= 1800) & (steps < 2300)] += 2.0  # a (middle-phase) spike that takes 500 steps to come back
    scale = np.where(steps < 3000, 2.0 ** 24, 2.0 ** 16)  # falls by 2^8 in one step
    val_steps = np.arange(0, 4001, 500)
    val = np.array([3.0, 2.8, 2.6, 2.5, 2.45, 2.5, 2.6, 2.7, 2.8])
    run = _run({"loss": (steps, loss), "opt/loss_scale": (steps, scale), "val/loss": (val_steps, val)},
               events=[{"event": "save", "step": 500}])
    assert report.guide.run_phase(run) == "middle" and report.guide.run_phase(run, total_steps=5000) == "late"
    items = {it.text: it for it in report.checkup(run, total_steps=5000, all_phases=True)}
    assert items["The loss scale is stable"].status == "FAILED"
    assert items["Validation loss has not started to rise (if it has, consider stopping early)"].status == "FAILED"
    assert items["Loss spikes recover at a normal speed"].status == "FAILED"
    assert items["Checkpoints are being saved as expected"].status == "FAILED"
    assert items["The final checkpoint has had a full evaluation"].status == "NOT MEASURED"
    assert items["The loss descent rate matches the learning-rate schedule"].status == "NOT MEASURED"
    doc = report.page.build_html(run, total_steps=5000)
    assert "late <span class='muted'>(this run&#x27;s phase; window steps 2500-4000)" in doc


# ----------------------------------------------------------------------------
# Issue 18/20: the guard's figures, peak messages, the run's name, own cadences.
# ----------------------------------------------------------------------------


def test_alert_row_shows_its_peak_message_and_the_title_names_the_run(tmp_path):
    logdir = tmp_path / "my_run" / "logs"
    w = metric_writers.create_default_writer(str(logdir), asynchronous=False)
    a = {"id": 4, "rule": "grad_norm", "metric": "grad/global_norm", "onset_step": 10}
    steps = {10: ("YELLOW", "[YELLOW] 2.2x"), 15: ("ORANGE", "[ORANGE] 3.5x"), 20: ("YELLOW", "[YELLOW] 2.1x")}
    for step, (lvl, msg) in steps.items():
        w.write_scalars(step, {"loss": 1.0})
        w.write_texts(step, {"vitals/alerts_json": json.dumps([dict(a, step=step, level=lvl, message=msg,
                                                                    peak_level="ORANGE" if step > 10 else lvl)])})
    w.close()
    run = report.read_run(str(logdir))
    (alert,) = run.alerts
    assert alert["peak_level"] == "ORANGE" and alert["message"] == "[ORANGE] 3.5x"
    assert alert["step"] == 20 and alert["logged_step"] == 10
    doc = report.page.build_html(run)
    assert "<title>jvitals report: my_run</title>" in doc
    assert "[ORANGE] 3.5x" in doc and "[YELLOW] 2.1x" not in doc
    assert report.run.run_name("/x/runs/quickstart/logs") == "quickstart"
    assert report.run.run_name("/x/exp7") == "exp7"


def test_per_layer_figures_drawn_at_their_own_steps(tmp_path):
    """Per-layer figures written every 10 steps beside a loss written every step: each
    is drawn at exactly its own steps (points), never filled in between."""
    import matplotlib

    matplotlib.use("Agg")
    from jvitals.report.writers import write

    w = metric_writers.create_default_writer(str(tmp_path), asynchronous=False)
    for step in range(0, 101):
        m = {"loss": 3.0 - step / 100}
        if step % 10 == 0:
            m |= {f"grad/norm/layer_{i}": 1.0 + i + step / 100 for i in range(3)}
        write(w, step, m, events=None)
    w.close()
    run = report.read_run(str(tmp_path))
    ax = report.plot_family(run, "layer_grad_norm")
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("grad/norm/")]
    assert len(lines) == 3
    for i, ln in enumerate(sorted(lines, key=lambda ln: ln.get_label())):
        np.testing.assert_array_equal(ln.get_xdata(), np.arange(0, 101, 10))
        np.testing.assert_allclose(ln.get_ydata(), [1.0 + i + s / 100 for s in range(0, 101, 10)])
        assert ln.get_marker() == "."
    layers, steps, mat, _ = report.plots.share_matrix(run)
    np.testing.assert_array_equal(steps, np.arange(0, 101, 10))
    norms = np.array([[1.0 + i + s / 100 for s in range(0, 101, 10)] for i in range(3)])
    np.testing.assert_allclose(mat, norms ** 2 / (norms ** 2).sum(0), rtol=1e-6)
    loss = [ln for ln in report.plot_family(run, "loss").get_lines() if ln.get_label() == "loss"][0]
    assert len(loss.get_xdata()) == 101 and loss.get_marker() in (None, "None", "")


README_LOOP = """
import functools, jax, jax.numpy as jnp, optax
import jvitals as vitals
from clu import metric_writers
from jvitals import reference_model as rm
from jvitals.guard.rollback import Rollback

cfg = rm.ModelConfig(vocab=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                     moe=True, n_experts=4, top_k=2, d_expert=16, sow_attn_logits=False)
model = rm.Decoder(cfg)
schedule = optax.constant_schedule(3e-3)
num_steps, FAULT = 90, 60

class State(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any
    def replace(self, **kw):
        return self._replace(**kw)

class Loader:
    def batch(self, position):
        return rm.make_batch(position, cfg, 4, 8)
loader = Loader()

def cross_entropy(logits, batch):
    return rm.cross_entropy(logits, batch["labels"], batch["mask"])

tx = vitals.with_lr_scale(optax.chain(            # the scale a rollback turns down, any schedule
    vitals.record(optax.clip_by_global_norm(1.0)),  # grad vitals before and after the clip
    optax.adamw(schedule)))

@functools.partial(jax.jit, static_argnames="full")
def train_step(state, batch, full=False, fault=1.0):
    def loss_fn(params):
        logits, sown = model.apply({"params": params}, batch["tokens"], mutable=["intermediates"])
        return cross_entropy(logits, batch), sown["intermediates"]
    (loss, inter), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, vitals_heavy=full)
    updates = jax.tree.map(lambda u: u * fault, updates)          # the injected fault
    metrics = {"loss": loss, **vitals.moe_metrics(inter, top_k=2)}
    if full:
        metrics |= vitals.activation_metrics(inter, mask=batch["mask"]) | vitals.optimizer_metrics(opt_state)
    return state.replace(params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, step=state.step + 1), metrics

params = rm.init_params(cfg, jax.random.key(0))
state = State(jnp.zeros([], jnp.int32), params, tx.init(params))
position = 0

writer = metric_writers.create_default_writer(logdir)
monitor = vitals.Monitor(vitals.Policy(baselines=vitals.BaselineConfig(warmup_steps=10, steps=20)))
guard = Rollback(ckpt_dir, writer=writer, save_every=20)
state, position = guard.resume(state, position, monitor)   # after a crash or a restart
for step in range(int(state.step), num_steps):
    fault = 300.0 if step == FAULT else 1.0
    state, metrics = train_step(state, loader.batch(position), full=step % 10 == 0, fault=fault); position += 1
    if step % 2 == 0:                             # the host looks only at its cadence
        host = jax.device_get({**metrics, **vitals.recorded(state.opt_state)})  # one packed vector
        verdict = monitor.update(step, host)
        vitals.write(writer, step, host, verdict)
        state = guard.respond(step, state, verdict, position)   # save / pause / roll back
guard.close()
writer.close()
print("ROLLBACKS", len(guard.history), guard.lr_scale)
"""


@pytest.mark.slow
def test_readme_loop_as_written_report_shows_the_rollback_and_lr_scale(tmp_path):
    """The README's Usage loop (its lines, with a tiny reference model and a fault at
    step 60) in a fresh process; the report of its log directory shows the rollback
    and the LR scale the guard wrote."""
    logdir, ckpt = tmp_path / "readme_run" / "logs", tmp_path / "ckpt"
    script = tmp_path / "loop.py"
    script.write_text("from typing import Any, NamedTuple\n"
                      f"logdir, ckpt_dir = {str(logdir)!r}, {str(ckpt)!r}\n" + README_LOOP)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROLLBACKS")][0]
    n, scale = int(line.split()[1]), float(line.split()[2])
    assert n >= 1 and scale == pytest.approx(0.9 ** n)
    run = report.read_run(str(logdir))
    steps, counts = run.scalars["rollback/count"]
    assert counts.max() == n and run.num_rollbacks == n
    s_lr, lr = run.scalars["rollback/lr_scale"]
    assert lr[0] == 1.0 and lr[-1] == pytest.approx(0.9 ** n, rel=1e-6)
    rb = run.rollbacks()
    assert len(rb) == n and all(r.get("to_step") is not None and r["to_step"] < 60 for r in rb)
    assert rb[0]["step"] > 60 and steps[np.argmax(counts > 0)] == rb[0]["step"]
    doc = report.page.build_html(run)
    assert "<td>rollbacks</td><td>%d</td>" % n in doc
    assert "LR scale</td><td>1 -&gt; 0.9 from step %d" % rb[0]["step"] in doc
    assert "not measured (no rollback/lr_scale" not in doc
    assert f"<td class='num'>{rb[0]['step']}</td><td class='num'>{rb[0]['to_step']}</td>" in doc
    assert "<title>jvitals report: readme_run</title>" in doc
