"""The overhead benchmark runs end to end and prints its table (a smoke test: no timing is asserted)."""

import contextlib
import importlib.util
import io
import math
import pathlib
import re
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def _load():
    spec = importlib.util.spec_from_file_location("jvitals_bench_overhead", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_overhead_quick_prints_every_variant_and_the_table():
    bench = _load()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--quick", "--breakdown"]) == 0
    text = out.getvalue()
    labels = ["(a) none", "(b) all every step", "(b) + optimizer stats", "(c) default cadence, light",
              f"(c) default, 1 in {bench.HEAVY_EVERY}", "(c) light, lax.cond cadence", "(d) naive logger",
              "(b) without attn_probe", "(b) without probes", "(b) without record"]
    for label in labels:
        line = next((ln for ln in text.splitlines() if ln.startswith(f"#   {label}")), None)
        assert line is not None, f"variant {label!r} missing from:\n{text}"
        ratio = float(re.search(r"paired ratio\s+([\d.]+)", line).group(1))
        temp = float(re.search(r"temp\s+([\d.]+) MiB", line).group(1))
        assert ratio > 0 and math.isfinite(ratio) and temp > 0, line
    header = next(ln for ln in text.splitlines() if ln.startswith("| config |"))
    row = next(ln for ln in text.splitlines() if ln.startswith("| small:"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(header.strip("|").split("|")) == 11
    assert all(float(c) > 0 for c in cells[1:])
    assert "(d) vs (b) + optimizer stats" in text
