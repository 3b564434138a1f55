"""The README's main job, run as a new user runs it: it must catch the fault and recover."""

import os
import re
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow   # the slow tier (README): end-to-end runs in fresh processes

REPO = Path(__file__).resolve().parents[1]


def run_quickstart(tmp_path, *args):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)          # one CPU device, as on a user's machine
    return subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), "--workdir",
                           str(tmp_path / "run"), *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=str(tmp_path))


def test_quickstart_catches_the_fault_rolls_back_and_recovers(tmp_path):
    proc = run_quickstart(tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "RECOVERED" in out
    assert "ROLLBACK -> checkpoint" in out
    assert "ORANGE" in out and "RED" in out
    report = tmp_path / "run" / "report.html"
    assert report.exists() and report.stat().st_size > 10_000
    assert list((tmp_path / "run" / "logs").rglob("*tfevents*"))
    # the data position kept going: the rollback was saved at the red step with it
    assert any(p.name.isdigit() for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert_one_line_per_event(out, tmp_path / "run" / "logs")
    # Quiet before the fault (the LR blow-up at data position 150): no alert on the model's
    # vitals opens earlier. Throughput (sys/*) is the machine's, and a loaded CI machine
    # may slow the loop; on an idle one the demo prints nothing before the fault either.
    early = [ln for ln in out.splitlines()
             if (m := re.match(r"  (YELLOW|ORANGE|RED) +step (\d+): (\S+)", ln)) and int(m[2]) < 150
             and not m[3].startswith("sys/")]
    assert not early, early


def assert_one_line_per_event(out, logdir):
    """Each save/rollback is printed once, and each alert on one line cut at a word
    of a message the run wrote (read back from the event files)."""
    import json

    from jvitals.report import ALERTS_TAG, read_run

    rollbacks = [ln for ln in out.splitlines() if "ROLLBACK -> checkpoint" in ln]
    summary = [ln for ln in out.splitlines() if "restored checkpoint" in ln]
    assert len(rollbacks) == len(summary) >= 1, (rollbacks, summary)
    saves = [ln for ln in out.splitlines() if "ORANGE: checkpoint" in ln]
    assert len(saves) == len(set(saves)), saves
    written = [a for _, text in read_run(str(logdir)).texts[ALERTS_TAG] for a in json.loads(text)]
    messages = {" ".join(a["message"].splitlines()[0].removeprefix(f"[{a['level']}] ").split()) for a in written}
    placeholder = " ... (full text in the report)"
    alert_lines = [(ln, m[2]) for ln in out.splitlines() if (m := re.match(r"  (YELLOW|ORANGE|RED) +step \d+: (.*)$", ln))]
    assert alert_lines, out[-3000:]
    for line, text in alert_lines:
        assert len(line) <= 2 + 160 and not text.startswith("["), line
        cut = text.endswith(placeholder)
        text = text[: -len(placeholder)] if cut else text
        assert any(m == text or (cut and m.startswith(text) and m[len(text)] == " ") for m in messages), line


def test_quickstart_without_a_fault_stays_healthy(tmp_path):
    proc = run_quickstart(tmp_path, "--fault", "none", "--steps", "120", "--no-report")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "HEALTHY" in proc.stdout and "ROLLBACK" not in proc.stdout
