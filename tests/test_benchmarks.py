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
import optax
from jax import lax

import jvitals as vitals
import pytest

pytestmark = pytest.mark.slow   # the slow tier (README): end-to-end runs in fresh processes

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
    assert len(header.strip("|").split("|")) == 9 and "cpu form: extra MB" in header
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")]
            for ln in text.splitlines() if re.match(r"\| (sow|instrument|light|opt) \|", ln)}
    assert set(rows) == {"sow", "instrument", "light", "opt"}, text
    for fam, cells in rows.items():
        extra, loops, branch, limit, x, temp, here, t = (float(c) for c in cells[1:])
        assert extra > 0 and limit > 0 and loops >= 0 and branch >= 0 and here > 0, (fam, cells)
        # the printed MB are rounded to 0.01: on the tiny config that moves their ratio by 5%
        assert math.isclose(x, extra / limit, rel_tol=0.02, abs_tol=0.01 + 0.006 * x / limit), (fam, cells)
        assert temp > 0 and t > 0 and math.isfinite(t), (fam, cells)
    # The activation families: their logits' row statistics are seven plain reductions, one
    # read each on XLA:CPU (no multi-output fusion; the TPU compiler fuses them with the
    # loss's: tests/test_tpu_cost.py), the rest of the sown tensors once.
    assert float(rows["sow"][4]) < 10 and float(rows["instrument"][4]) < 10, text
    assert float(rows["light"][4]) < 2, text
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


def _step_bytes(bench, tx, p, g, **kw):
    """``(bytes a healthy step accesses, bytes of the non-finite branches)`` of an
    optimizer step that applies its updates."""
    def step(p, s, g):
        u, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, u), s

    c = jax.jit(step).lower(p, tx.init(p), g).compile()
    ca = c.cost_analysis()
    skipped = bench.branch_bytes(c.as_text())
    return (ca[0] if isinstance(ca, (list, tuple)) else ca)["bytes accessed"] - skipped, skipped


def test_light_step_shares_the_clips_norm_and_counts_non_finite_only_when_needed():
    """The recorder's light step (vitals_heavy=False): its gradient norm is the clip's
    (optax's own expression: XLA computes it once), so around the clip it reads only
    the parameters; the non-finite count sits in a branch a healthy step skips (on the
    CPU); around the whole optimizer it adds the updates' read, and XLA:CPU (no
    multi-output fusion) writes the Adam direction out for it and apply_updates."""
    bench = _load()
    p = {"w": jnp.ones((256, 512)), "v": jnp.ones((512, 256)), "b": jnp.ones((512,))}
    g = jax.tree.map(lambda x: x * 0.01, p)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(p))
    clip = optax.clip_by_global_norm(1.0)
    base, none_skipped = _step_bytes(bench, optax.chain(clip, optax.adam(1e-3)), p, g)
    assert none_skipped == 0
    around_clip, skipped = _step_bytes(bench, optax.chain(vitals.record(clip), optax.adam(1e-3)), p, g,
                                       vitals_heavy=False)
    assert around_clip - base <= 1.1 * nbytes, (around_clip - base) / nbytes  # the params' read
    assert nbytes <= skipped <= 3.1 * nbytes, skipped / nbytes               # the count: 1 read (+ a cast)
    whole, _ = _step_bytes(bench, vitals.record(optax.chain(clip, optax.adam(1e-3))), p, g, vitals_heavy=False)
    assert whole - base <= 5.1 * nbytes, (whole - base) / nbytes


def test_branch_bytes_takes_out_the_dear_branch_of_a_conditional():
    """XLA counts a conditional as its dearest branch; branch_bytes is that less the cheapest."""
    bench = _load()
    x = jnp.ones((1 << 16,))

    def f(x):
        return lax.cond(jnp.isfinite(x[0]), lambda: jnp.zeros(()), lambda: jnp.sum(x * x))

    skipped = bench.branch_bytes(jax.jit(f).lower(x).compile().as_text())
    assert 0.9 * x.nbytes <= skipped <= 3.1 * x.nbytes, skipped / x.nbytes
    assert bench.branch_bytes(jax.jit(lambda x: jnp.sum(x * x)).lower(x).compile().as_text()) == 0


def test_light_forms_compares_the_ways_of_taking_the_light_steps_norms():
    """benchmarks/light_forms.py: every form compiled beside the step without vitals; the
    shipped one (the clip's gradient norm) reads no gradient, and dropping the update
    norm leaves only the parameters' read (a smoke test: no timing asserted)."""
    spec = importlib.util.spec_from_file_location("jvitals_bench_light_forms", BENCH.parent / "light_forms.py")
    forms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forms)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert forms.main(["--config", "tiny", "--min-seconds", "0", "--rounds", "2"]) == 0
    rows = {ln.split("|")[1].strip(): [float(c) for c in ln.strip("|").split("|")[1:]]
            for ln in out.getvalue().splitlines() if ln.startswith("| ") and not ln.startswith("| light")}
    assert set(rows) == set(forms.FORMS), out.getvalue()
    assert 0.9 <= rows["no_update"][0] <= 1.1  # the parameters, once
    assert rows["pu_fold"][0] < rows["fold"][0]  # the clip's gradient norm: one read fewer
    assert all(t > 0 for _, _, t in rows.values())
