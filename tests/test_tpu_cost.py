"""What a TPU pays, read off the TPU compiler here (ahead of time; no TPU needed): the README's
steps and each family compiled for a TPU v5e chip, their extra bytes against their one-read
limits (benchmarks/tpu_cost.py). Skipped where libtpu is absent: it is found on ``sys.path``,
through ``$TPU_LIBRARY_PATH``, or in ``$JVITALS_LIBTPU_DIR`` (default ``~/.cache/jvitals/libtpu``;
``python benchmarks/tpu_cost.py --install`` puts it there, ``.ci/run`` too)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow   # the slow tier (README): end-to-end runs in fresh processes

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_cost.py"
TOPOLOGY = "v5e:2x2"


def _load():
    spec = importlib.util.spec_from_file_location("jvitals_bench_tpu_cost", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    mod = _load()
    if mod.use_libtpu() is None:
        pytest.skip(f"no libtpu (python benchmarks/tpu_cost.py --install puts it in {mod.libtpu_dir()})")
    return mod


@pytest.fixture(scope="module")
def rows(bench):
    """The families of the issue's table on the benchmark's Llama-like step (d256, 4 layers,
    grouped K/V, vocabulary 4096, 4 x 64 tokens, full tensors sown), compiled for one v5e chip."""
    families = ("sow", "attn", "light", "heavy", "opt", "readme", "full")
    got = bench.measure(TOPOLOGY, bench.sizes()["d256"], (4, 64), families, bench.tpu_sharding(TOPOLOGY))
    return {r.family: r for r in got}


# The bounds below are on each family's own reads (``Row.own_mb``: memory-space assignment's
# prefetches set aside, which move tens of MB in or out of a small model's step as its schedule
# shifts; benchmarks/tpu_cost.py's docstring).


@pytest.mark.parametrize("family", ["sow", "attn", "light", "heavy"])
def test_every_family_within_one_and_a_half_reads_of_its_limit(rows, family):
    r = rows[family]
    assert r.own_mb <= 1.5 * r.limit_mb, (family, r.own_mb, r.limit_mb)


def test_the_readme_light_step_is_nearly_free(rows):
    """The light step's sums ride as more outputs on the kernels that apply the update and
    take the clip's norm (0.11x of its one-read limit on d256, docs/COST.md)."""
    r = rows["readme"]
    assert r.own_mb <= 0.2 * r.limit_mb, (r.own_mb, r.limit_mb)
    assert r.own_step_x <= 1.02 and r.memory_x <= 1.06, (r.own_step_x, r.memory_x)


def test_the_optimizer_statistics_within_one_and_a_half_reads(rows):
    """Adam ``nu``'s maximum and median (``window_quantile``: a sample of slices taken along
    each leaf's major dimension, then one kernel per leaf): 1.34x of one read of ``nu`` on
    d256 (docs/COST.md)."""
    r = rows["opt"]
    assert r.own_mb <= 1.5 * r.limit_mb, (r.own_mb, r.limit_mb)


@pytest.fixture(scope="module")
def mha_rows(bench):
    """The issue's own model (d256 with 8 K/V heads), compiled for one v5e chip."""
    families = ("sow", "attn", "light", "heavy", "readme")
    got = bench.measure(TOPOLOGY, bench.sizes()["d256mha"], (4, 64), families, bench.tpu_sharding(TOPOLOGY))
    return {r.family: r for r in got}


@pytest.mark.parametrize("family", ["sow", "attn", "light", "heavy", "readme"])
def test_bytes_accessed_on_the_issues_own_model(mha_rows, family):
    """``bytes accessed`` itself, memory-space assignment's prefetches included, on the
    issue's own model: each family within 1.5x of its one-read limit, the README's light
    step within 0.2x."""
    r = mha_rows[family]
    bound = 0.2 if family == "readme" else 1.5
    assert r.extra_mb <= bound * r.limit_mb, (family, r.extra_mb, r.limit_mb)


@pytest.fixture(scope="module")
def moe_rows(bench):
    """The scan-stacked MoE config (MLA, 8 experts, one MTP depth, layers under ``nn.scan``),
    compiled for one v5e chip: every sown tensor, the families that summarise inside the scan,
    the optimizer statistics and the README's light step."""
    families = ("sow", "probes", "instrument", "attn_probe", "opt", "readme")
    got = bench.measure(TOPOLOGY, bench.sizes()["moe"], (4, 64), families, bench.tpu_sharding(TOPOLOGY))
    return {r.family: r for r in got}


@pytest.mark.parametrize("family", ["sow", "probes", "instrument", "attn_probe"])
def test_the_scan_stacked_moe_families_within_one_and_a_half_reads(moe_rows, family):
    """Probes, ``instrument()`` and the attention-logit probe summarise each layer's tensors
    inside the scan's body (0.80-0.97x of one read on the MoE config, docs/COST.md); raw sown
    tensors are written out of it, stacked, and read again (0.71x with the MTP logits' argmax)."""
    r = moe_rows[family]
    assert r.own_mb <= 1.5 * r.limit_mb, (family, r.own_mb, r.limit_mb)


def test_the_raw_mtp_logits_argmax_is_read_in_the_mtp_loss_kernels(moe_rows):
    """The raw MTP logits are read only for their argmax (``row_argmax``: the row statistics'
    plain reductions), which the TPU compiler reads in the kernels of the MTP loss's own
    log-sum-exp: every sown tensor of the MoE config, the MTP logits among them, within 0.9x
    of one read (0.71x, docs/COST.md; an argmax reduction of its own reads the MTP logits
    once more, 1.16x)."""
    r = moe_rows["sow"]
    assert r.own_mb <= 0.9 * r.limit_mb, (r.own_mb, r.limit_mb)


def test_the_moe_optimizer_statistics_within_one_and_a_half_reads(moe_rows):
    """Adam ``nu``'s median on the MoE config, whose ``[d, vocab]`` head has 128 rows: its
    sample is the head's first 8 rows, not the whole head (1.36x of one read as counted, 1.50x
    less prefetch, docs/COST.md)."""
    r = moe_rows["opt"]
    assert r.extra_mb <= 1.5 * r.limit_mb, (r.extra_mb, r.limit_mb)
    assert r.own_mb <= 1.55 * r.limit_mb, (r.own_mb, r.limit_mb)


def test_the_readme_light_step_on_the_moe_config(moe_rows):
    """The README's light step on the scan-stacked MoE config within 0.2x of its one-read limit
    as counted (0.16x; own reads 0.21x, docs/COST.md): the gradients' non-finite count is read
    in the norm's kernel, not from a relaid-out copy of an expert's gradient."""
    r = moe_rows["readme"]
    assert r.extra_mb <= 0.2 * r.limit_mb, (r.extra_mb, r.limit_mb)
    assert r.own_mb <= 0.25 * r.limit_mb and r.own_step_x <= 1.025, (r.own_mb, r.limit_mb, r.own_step_x)


def test_bf16_logits_rows_read_beside_the_loss(bench):
    """A bf16 model whose loss upcasts the logits to float32 (scan-stacked, d 256, 2 layers,
    vocabulary 16384, 4 x 128 tokens): the logits' row statistics are plain reductions the
    compiler fuses with the loss's own over that float32 copy, so ``instrument()`` and the
    sown logits stay within 1.5x of one read of what they measure (docs/COST.md, "Held-out
    models": a reduction in a kernel of its own reads the float32 copy again, and so does a
    count of the non-finite entries)."""
    import jax.numpy as jnp

    cfg = bench.oh._llama(256, n_layers=2, vocab=16384, scan_layers=True, dtype=jnp.bfloat16)
    size = bench.oh.Size("bf16", cfg, ((4, 128),))
    got = bench.measure(TOPOLOGY, size, (4, 128), ("sow", "instrument"), bench.tpu_sharding(TOPOLOGY))
    for r in got:
        assert r.own_mb <= 1.5 * r.limit_mb, (r.family, r.own_mb, r.limit_mb)


def test_the_attention_probe_rides_in_the_score_kernel_of_an_unrolled_model(bench):
    """On an unrolled model (xl's shapes, 3 layers: d 1024, 16 heads of 64, 8 x 1024 tokens) the
    attention-logit probe of the README's model (``attn_softmax_probe``) takes the softmax's own
    row maximum and the row minimum beside it in each layer's score kernel: no read of the
    scores of its own (a separate reduction, ``attn_logits_probe``, was merged across layers and
    read them again: 1.35x; -2.41x now, docs/COST.md), and no memory held for it."""
    import dataclasses

    xl = bench.sizes()["xl"]
    size = dataclasses.replace(xl, name="xl3", cfg=dataclasses.replace(xl.cfg, n_layers=3))
    (r,) = bench.measure(TOPOLOGY, size, (8, 1024), ("attn_probe",), bench.tpu_sharding(TOPOLOGY))
    assert r.own_mb <= 0.2 * r.limit_mb and r.memory_x <= 1.05, (r.own_mb, r.limit_mb, r.memory_x)


@pytest.mark.parametrize("model", [dict(), dict(linen=True), dict(linen=True, dtype="bfloat16")],
                         ids=["nnx", "linen", "linen_bf16"])
def test_instrument_reads_flax_attention_logits_beside_the_softmax(bench, model):
    """``instrument(attn_logits=True)`` on the README's NNX model (``nnx.MultiHeadAttention``:
    ``jax.nn.dot_product_attention``, run as ``attention_with_summary``) and its Linen twin
    (flax's ``dot_product_attention_weights``, the summary from the input it hands the softmax):
    the summary from the softmax's own row maximum and the row minimum beside it: 0.19-0.29x of
    one read of the scores on these steps, where recomputing ``q.k`` beside the model's attention
    reads 2.5-8.6x (docs/COST.md)."""
    got = bench.nnx_attention(bench.NnxAttention(**model), bench.tpu_sharding(TOPOLOGY))
    assert got["own_mb"] <= 0.5 * got["limit_mb"] and got["memory_x"] <= 1.05, got


def test_the_readme_heavy_step_as_a_whole(rows):
    """The heavy step (every family: per-role gradients, every activation, the optimizer
    statistics) as a whole (1.10 on d256 less prefetch, docs/COST.md)."""
    r = rows["full"]
    assert r.own_step_x <= 1.12 and r.step_x <= 1.25, (r.own_step_x, r.step_x)


def test_libtpu_pin_follows_jax(bench):
    import importlib.metadata

    pin = bench.libtpu_pin()
    assert pin.startswith("libtpu") and any(pin in req.replace(" ", "") for req in importlib.metadata.requires("jax"))


def test_prefetches_set_aside_a_plain_max_reads_each_leaf_once(bench):
    """The calibration of ``own``: a plain ``jnp.max`` of each of a 1B model's large leaves
    (its 128 MB embedding, MLP kernels of 2752 columns, laid out column-major) compiled for a
    v5e chip, ``bytes accessed`` less :func:`prefetch_bytes` (the ``copy-start`` and sliced
    ``slice-start`` prefetches the compiler schedules into on-chip memory for them) is the
    leaves' bytes, read once."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sharding = bench.tpu_sharding(TOPOLOGY)
    shapes = [(32768, 1024), (2752, 1024), (1024, 2752), (1024, 2752), (1024, 1536), (1024, 1024)] * 2
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
    compiled = jax.jit(lambda *xs: [jnp.max(x) for x in xs]).lower(*args).compile()
    counted = bench.bytes_accessed(compiled)
    prefetch = bench.prefetch_bytes(compiled.as_text())
    one_read = sum(4 * int(np.prod(s)) for s in shapes)
    assert prefetch > 0.5 * one_read, (prefetch, one_read)   # the compiler prefetches them
    assert abs(counted - prefetch - one_read) <= 0.01 * one_read, (counted, prefetch, one_read)


def test_msa_off_counts_the_families_own_reads(bench, tmp_path):
    """``--msa off`` compiles with memory-space assignment off (a fresh process: libtpu reads
    the flag when it loads): no prefetch is scheduled, so ``bytes accessed`` is each family's own
    reads, and the prefetch-aside figure equals it (docs/COST.md, "Held-out models")."""
    import json
    import os
    import subprocess

    out = tmp_path / "rows.json"
    env = {**os.environ, "JVITALS_LIBTPU_DIR": str(bench.libtpu_dir())}
    run = subprocess.run([sys.executable, str(BENCH), "--topologies", TOPOLOGY, "--configs", "tiny",
                          "--families", "light,opt", "--msa", "off", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "memory-space assignment off" in run.stdout and "(0.0 of them prefetch)" in run.stdout, run.stdout
    rows = json.loads(out.read_text())
    assert {r["family"] for r in rows} == {"light", "opt"}
    for r in rows:
        assert r["own_mb"] == pytest.approx(r["extra_mb"], abs=1e-9), r
