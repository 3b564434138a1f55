"""The overhead benchmark runs end to end and prints its tables (a smoke test: no timing
is asserted), and its loop accounting adds what XLA's cost analysis leaves out."""

import contextlib
import importlib.util
import io
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
from jax import lax

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def _load():
    spec = importlib.util.spec_from_file_location("jvitals_bench_overhead", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_overhead_quick_prints_bytes_limits_memory_and_time_per_family():
    bench = _load()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--quick"]) == 0
    text = out.getvalue()
    header = next(ln for ln in text.splitlines() if ln.startswith("| family |"))
    assert len(header.strip("|").split("|")) == 7
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")]
            for ln in text.splitlines() if re.match(r"\| (sow|instrument|light|opt) \|", ln)}
    assert set(rows) == {"sow", "instrument", "light", "opt"}, text
    for fam, cells in rows.items():
        extra, loops, limit, x, temp, t = (float(c) for c in cells[1:])
        assert extra > 0 and limit > 0 and loops >= 0, (fam, cells)
        assert math.isclose(x, extra / limit, rel_tol=0.02, abs_tol=0.01), (fam, cells)
        assert temp > 0 and t > 0 and math.isfinite(t), (fam, cells)
    # The activation families read their tensors once (within the partials' few %).
    assert float(rows["sow"][4]) < 1.2 and float(rows["instrument"][4]) < 1.2, text
    assert "## Summary" in text and "| tiny:" in text


def test_loop_bytes_adds_the_iterations_cost_analysis_counts_once():
    """A lax.scan of 8 chunks: cost analysis + loop_bytes ~ the unrolled program's bytes."""
    bench = _load()
    x = jnp.ones((8, 1 << 16))

    def scanned(x):
        return lax.scan(lambda c, r: (c + jnp.sum(r * r), None), 0.0, x)[0]

    def unrolled(x):
        return sum(jnp.sum(x[i] * x[i]) for i in range(8))

    def cost(f):
        c = jax.jit(f).lower(x).compile()
        ca = c.cost_analysis()
        return (ca[0] if isinstance(ca, (list, tuple)) else ca)["bytes accessed"], c.as_text()

    b_scan, hlo = cost(scanned)
    b_flat, _ = cost(unrolled)
    assert b_scan < 0.5 * b_flat  # XLA counts the body once
    corrected = b_scan + bench.loop_bytes(hlo)
    assert 0.8 * b_flat <= corrected <= 1.3 * b_flat, (b_scan, corrected, b_flat)
