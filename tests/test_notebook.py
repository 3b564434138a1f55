"""The Colab TPU demo notebook, executed as CI executes it: 8 forced CPU devices, the small config.

The notebook must run top to bottom without an error, see the 8 devices (the kernel is a
separate process: it gets the environment of this one when it starts), build the 4 x 2
mesh, roll back once the injected fault turns RED, and draw its plots.
"""

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # the slow tier (README): end-to-end runs in fresh processes

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "colab_tpu_demo.ipynb"


def _texts(nb) -> str:
    """Every stream and text/plain output of the executed notebook, concatenated."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o.get("text", ""))
            elif "data" in o:
                out.append(o["data"].get("text/plain", ""))
    return "\n".join(out)


def test_notebook_is_stored_clean():
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "store the notebook without outputs"


def test_notebook_runs_on_8_cpu_devices_and_rolls_back(tmp_path, monkeypatch):
    # The kernel inherits os.environ when it starts.
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    monkeypatch.setenv("XLA_FLAGS", (flags + " --xla_force_host_platform_device_count=8").strip())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JVITALS_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")

    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # pragma: no cover - the message is the point
        pytest.fail(f"a notebook cell failed:\n{str(e)[-4000:]}\n--- outputs so far ---\n{_texts(nb)[-4000:]}")

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = _texts(nb)
    assert "devices: 8 x" in text, text[:2000]
    assert "mesh shape: {'data': 4, 'expert': 2}" in text, text[:2000]
    assert "P(None, 'expert', None, None)" in text          # the scan-stacked expert weights split over E
    assert "ROLLBACK at step" in text and "rollback: at step" in text, text[-4000:]
    pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(pngs) >= 3, "expected the timeline, the metric families and the heat map as images"
    assert any("text/html" in o.get("data", {}) and "<table>" in o["data"]["text/html"]
               for c in nb.cells for o in c.get("outputs", [])), "expected the alerts table"
