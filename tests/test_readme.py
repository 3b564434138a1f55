"""The README's first "Usage" block runs as written (dense), and as its MoE variant.

The block is extracted from README.md as a new user would copy it and run in a
fresh interpreter (a subprocess, so nothing of the test session leaks in) in a
temporary working directory; it must train, write TensorBoard event files that
the report reads back, and leave checkpoints on disk.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def usage_block(nnx: bool = False) -> str:
    """The Usage section's first ``python`` block (Linen), or its Flax NNX one."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Usage", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md's Usage section has no ```python block"
    if nnx:
        found = [b for b in blocks if "from flax import nnx" in b]
        assert found, "README.md's Usage section has no Flax NNX block"
        return found[0]
    return blocks[0]


def run_block(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a new user has
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    script = cwd / "usage.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def check_run(proc: subprocess.CompletedProcess, cwd: Path, name: str = "usage") -> None:
    assert proc.returncode == 0, f"the README block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    from jvitals import report

    run = report.read_run(str(cwd / "runs" / name / "logs"))
    steps, values = run.scalars["loss"]
    assert len(steps) >= 5 and all(int(s) % 50 == 0 for s in steps), steps
    assert all(v == v for v in values), values
    # the window since the last check: 50 steps at every check after the first
    wsteps, wvals = run.scalars["window/steps"]
    assert list(wvals[1:]) == [50.0] * (len(wvals) - 1) and wvals[0] == 1.0, wvals
    assert "window/loss.max" in run.scalars and "grad/norm/layer_0" in run.scalars
    ckpts = [p for p in (cwd / "runs" / name / "ckpt").iterdir() if p.name.isdigit()]
    assert ckpts, "the guard saved no checkpoint"


@pytest.mark.parametrize("variant", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_readme_usage_block_runs_as_written(tmp_path, variant):
    code = usage_block()
    if variant == "moe":
        assert "MOE = False" in code, "the block's MoE switch (MOE = False) is gone"
        code = code.replace("MOE = False", "MOE = True", 1)
    proc = run_block(code, tmp_path)
    check_run(proc, tmp_path)
    if variant == "moe":
        from jvitals import report

        run = report.read_run(str(tmp_path / "runs" / "usage" / "logs"))
        assert "moe/dead_expert_ratio" in run.scalars


@pytest.mark.slow
def test_readme_nnx_block_runs_as_written(tmp_path):
    """The Flax NNX loop: trains, writes the light figures every 50 steps and the heavy
    family (per-role gradients, instrument()'s activations) at step 0 and 500, saves."""
    proc = run_block(usage_block(nnx=True), tmp_path)
    check_run(proc, tmp_path, "usage-nnx")
    from jvitals import report

    run = report.read_run(str(tmp_path / "runs" / "usage-nnx" / "logs"))
    for name in ("grad/global_norm", "grad/Wq_rms", "grad/W_down_abs.max", "grad/output_layer_abs.max",
                 "act/hidden_states_rms.avg", "act/output_layer_logits_abs.max", "opt/adam_nu_abs.max"):
        assert name in run.scalars, name
    steps, _ = run.scalars["act/hidden_states_rms.avg"]
    assert [int(s) for s in steps] == [0, 500]
    assert "level GREEN" in proc.stdout
