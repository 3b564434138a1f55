"""The install's promises: the base package imports neither clu nor TensorFlow, and
`jvitals report` without its extra says which extra to install."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys


def test_base_import_needs_neither_clu_nor_tensorflow():
    code = ("import sys, jvitals, jvitals.monitor, jvitals.guard.rollback, jvitals.report.writers, jvitals.metrics.instrument; "
            "print(sorted(m for m in ('clu', 'tensorflow', 'tensorboard', 'matplotlib', 'transformers') "
            "if m in sys.modules))")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_report_without_its_extra_names_the_extra(tmp_path, monkeypatch, capsys):
    from jvitals.report import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "matplotlib") else real(name, *a))
    rc = cli.main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "pip install 'jvitals[report]'" in err and "tensorboard and matplotlib" in err, err
    assert not (tmp_path / "r.html").exists()
