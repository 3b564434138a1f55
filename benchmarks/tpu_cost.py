"""What a TPU pays for jvitals, read off the TPU compiler ahead of time (no TPU needed).

libtpu compiles for a TPU topology on any machine (``jax.experimental.topologies``, as
MaxText's ``train_compile.py`` does): the training steps of ``benchmarks/overhead.py`` are
compiled for one chip of a topology from their shapes alone (``jax.ShapeDtypeStruct``:
nothing is allocated, so a 1B-parameter step costs no memory here), the state donated as a
training loop donates it, and each compiled program reports

- **bytes**: ``cost_analysis()["bytes accessed"]``, after the TPU compiler's own fusion;
  a family's **extra** bytes are its step's less the step without vitals', beside the
  family's **one-read limit** (each tensor it measures read once: ``overhead.limits``);
- **memory**: ``memory_analysis()``: what the program holds in HBM at once, arguments,
  outputs and temporaries (less what donation aliases), against the step without vitals;
- **prefetch**: the bytes of the asynchronous copies memory-space assignment schedules
  between HBM and on-chip memory (``copy-start``, which ``bytes accessed`` counts four times
  their size, and the sliced ``slice-start`` of a large leaf, three times). Which tensors it
  prefetches turns on the whole program's schedule: a kernel that gains one scalar output can
  move tens of MB of them in or out on a small model. ``x limit`` is the family's extra bytes
  as ``bytes accessed`` counts them; ``less prefetch`` is the same with the prefetches set
  aside on both sides, the family's own reads (what a compile with memory-space assignment
  off, ``LIBTPU_INIT_ARGS=--xla_msa_enable=false``, counts, within 0.01x): forms are compared
  on it.

Families: those of ``overhead.py`` (``sow``, ``probes``, ``instrument``, ``light``,
``heavy``, ``opt``, ``moe``) and

=============  ===========================================================  ==============================
family         what the step adds                                           one-read limit
=============  ===========================================================  ==============================
``attn``       ``act/attn_logits_abs.max`` of the sown attention scores     the scores
``attn_probe`` the same figure from ``attn_softmax_probe`` (its summary    the scores
               sown inside the block, as the README's model does)
``replicas``   ``replica_metrics`` of the sown hidden states and logits     those tensors
               (``R`` = 4 replicas of the batch or fewer, the global view)
``readme``     the README's light step: ``light`` with the loss by          ``light`` + the logits + the
               ``vitals.cross_entropy`` and the largest attention logit     scores (+ the expert counts)
               (the model's probes, as the README's ``use_probes=True``;
               + ``moe_metrics`` on an MoE config)
``full``       the README's heavy step: ``readme`` with                     ``heavy`` + every sown tensor
               ``vitals_heavy=True``, ``activation_metrics`` of every       + Adam ``nu``
               probe's summary and ``optimizer_metrics``
=============  ===========================================================  ==============================

Beside ``x limit``, column ``step x`` is the family's step's bytes over the step without
vitals' (the README's steps as a whole).

libtpu is what jax's ``tpu`` extra pins (``pip install --no-deps --target DIR``), found in
``$JVITALS_LIBTPU_DIR`` (default ``~/.cache/jvitals/libtpu``) or wherever ``import libtpu``
finds it, and installed there on demand with ``--install`` (about 680 MB; never into the
environment itself). Without a TPU library, ``--platform`` compiles for the machine's own
devices instead (``gpu``: the same table from the GPU compiler), and ``--time S`` runs each
step there for S seconds, interleaved, and reports the median of the paired ratios.

Run: ``python benchmarks/tpu_cost.py --install`` (the bench configs and the ~1B one on
v5e and v4), ``--topologies v5e:2x2,v6e:2x2 --configs d256,moe --families light,heavy``,
``--platform gpu --configs d256,moe,b1 --time 10``; ``--configs h384,h512bf,hmoe --msa off``: the
held-out models with memory-space assignment off (``held_out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MB = 1e6
MSA_OFF = "--xla_msa_enable=false"   # libtpu's flag: no memory-space assignment (no on-chip placement)
TOPOLOGIES = ("v5e:2x2", "v4:2x2x1")
FAMILIES = ("sow", "probes", "instrument", "attn", "attn_probe", "light", "heavy", "opt", "moe", "replicas", "readme", "full")
REPLICAS = 4


# ----------------------------------------------------------------------------------
# libtpu: found, or installed into a folder of its own.


def libtpu_dir() -> pathlib.Path:
    """Where libtpu is installed (``$JVITALS_LIBTPU_DIR``, default ``~/.cache/jvitals/libtpu``)."""
    return pathlib.Path(os.environ.get("JVITALS_LIBTPU_DIR", "~/.cache/jvitals/libtpu")).expanduser()


def libtpu_pin() -> str:
    """The libtpu requirement of jax's ``tpu`` extra (``libtpu==0.0.42.*`` for jax 0.10.2)."""
    for req in importlib.metadata.requires("jax") or ():
        name, _, marker = req.partition(";")
        if name.strip().startswith("libtpu") and "tpu" in marker:
            return name.strip().replace(" ", "")
    return "libtpu"


def find_libtpu() -> str | None:
    """The path of ``libtpu.so``: ``$TPU_LIBRARY_PATH``, the ``libtpu`` package on
    ``sys.path``, or the one in :func:`libtpu_dir`; None when there is none."""
    env = os.environ.get("TPU_LIBRARY_PATH")
    if env and os.path.isfile(env):
        return env
    spec = importlib.util.find_spec("libtpu")
    roots = [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    roots.append(libtpu_dir() / "libtpu")
    return next((str(r / "libtpu.so") for r in roots if (r / "libtpu.so").is_file()), None)


def install_libtpu(target: pathlib.Path | None = None) -> str | None:
    """``pip install --no-deps --target`` the pinned libtpu into ``target`` (default
    :func:`libtpu_dir`); the path of its ``libtpu.so``, None if the install failed."""
    target = libtpu_dir() if target is None else target
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), libtpu_pin()]
    if subprocess.run(cmd, check=False).returncode != 0:
        return None
    so = target / "libtpu" / "libtpu.so"
    return str(so) if so.is_file() else None


def use_libtpu(install: bool = False) -> str | None:
    """Point JAX at libtpu (``TPU_LIBRARY_PATH``, read when a TPU topology is first asked
    for: the process's own backends, the CPU's, are left as they are); the path, or None."""
    path = find_libtpu() or (install_libtpu() if install else None)
    if path:
        os.environ["TPU_LIBRARY_PATH"] = path
        # Compiling only, no chip is opened: several processes (pytest's workers, a
        # benchmark beside a test) may load it at once, past libtpu's one-process lockfile.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return path


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jvitals as vitals  # noqa: E402
import overhead as oh  # noqa: E402
from jvitals import reference_model as rm  # noqa: E402


# ----------------------------------------------------------------------------------
# Configs: the bench configs and a ~1B one.


def sizes() -> dict[str, oh.Size]:
    """``overhead.sizes()`` and ``b1``: a model of 0.99B parameters (d 3072, 8 layers
    scan-stacked, 12 heads of 256, vocabulary 32768, bf16 parameters and Adam state),
    sequence 2048, batch 1: what a 16 GiB v5e chip holds (15.9 GB compiled) with the
    reference model's materialised attention scores and no rematerialisation."""
    out = oh.sizes()
    b1 = oh._llama(3072, vocab=32768, n_layers=8, head_dim=256, n_heads=12, n_kv_heads=3, d_ff=8192,
                   scan_layers=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    out["b1"] = oh.Size("b1", b1, ((1, 2048),))
    out["d256mha"] = oh.Size("d256mha", oh._llama(256, n_kv_heads=8))
    out.update(held_out())
    return out


def held_out() -> dict[str, oh.Size]:
    """Models checked against the targets and never used to choose a form (docs/COST.md,
    "Held-out models"): ``h384`` (dense, unrolled, float32: d 384, 6 layers, 12 heads of 32 in
    4 groups, vocabulary 8192, 2 x 128 tokens), ``h512bf`` (scan-stacked, bf16: d 512, 4 layers,
    8 heads of 64 in 2 groups, vocabulary 16384, 4 x 256) and ``hmoe`` (MoE MLA, MTP,
    scan-stacked: d 256, 3 layers, vocabulary 8192, 4 x 128)."""
    h384 = oh._llama(384, n_layers=6, n_heads=12, n_kv_heads=4, head_dim=32, vocab=8192, d_ff=1024)
    h512bf = oh._llama(512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, vocab=16384, d_ff=1408,
                       scan_layers=True, dtype=jnp.bfloat16)
    return {"h384": oh.Size("h384", h384, ((2, 128),)), "h512bf": oh.Size("h512bf", h512bf, ((4, 256),)),
            "hmoe": oh.Size("hmoe", oh._moe(256, 8192, 3), ((4, 128),))}


# ----------------------------------------------------------------------------------
# The steps: overhead.py's, and the README's.


def _replica_metrics(inter: Any, batch: dict) -> dict[str, jax.Array]:
    sown = {k: v for k, v in inter.items() if k != "logit_figures"} if isinstance(inter, dict) else inter
    replicas = math.gcd(batch["mask"].shape[0], REPLICAS)   # R divides the batch
    return vitals.replica_metrics(mask=batch["mask"], intermediates=sown, replicas=replicas)


def make_batches(cfg: rm.ModelConfig, bt: tuple[int, int], n: int = 2) -> list[dict]:
    """``n`` batches of ``bt = (B, T)``: ``rm.make_batch``'s, or for a large vocabulary (whose
    bigram table would not fit here) uniform random tokens, about 10% padding."""
    if cfg.vocab <= 8192:
        return [rm.make_batch(i, cfg, *bt, pad_fraction=0.1) for i in range(n)]
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        tokens = rng.integers(2, cfg.vocab, size=(bt[0], bt[1] + 1))
        mask = np.arange(bt[1])[None, :] < bt[1] - rng.integers(0, bt[1] // 5 + 1, size=(bt[0], 1))
        out.append(dict(tokens=jnp.asarray(np.where(mask, tokens[:, :-1], cfg.pad_id), jnp.int32),
                        labels=jnp.asarray(np.where(mask, tokens[:, 1:], cfg.pad_id), jnp.int32),
                        mask=jnp.asarray(mask)))
    return out


def variants(cfg: rm.ModelConfig, families: Iterable[str]) -> dict[str, tuple[Callable, optax.GradientTransformation]]:
    """``{name: (step, tx)}``: ``none`` and each family asked for (``moe`` on MoE configs)."""
    fams = set(families)
    plain, rec = oh.base_tx(), oh.recorded_tx("chain")
    out = oh.variants(cfg, "chain", [f for f in fams if f in ("sow", "probes", "instrument", "light", "heavy",
                                                             "opt", "moe")])
    if "attn" in fams:
        out["attn"] = (oh.make_step(cfg, plain, ["attn"]), plain)
    if "attn_probe" in fams:
        out["attn_probe"] = (oh.make_step(cfg, plain, ["attn"], probes=True), plain)
    if "replicas" in fams:
        out["replicas"] = (oh.make_step(cfg, plain, extra=_replica_metrics), plain)
    moe = ["moe"] if cfg.moe else []
    if "readme" in fams:
        out["readme"] = (oh.make_step(cfg, rec, ["ce", "attn"] + moe, heavy=False, probes=True), rec)
    if "full" in fams:
        out["full"] = (oh.make_step(cfg, rec, ["ce", "sow", "opt"] + moe, heavy=True, probes=True), rec)
    return out


def limits(cfg: rm.ModelConfig, params: Any, batch: dict) -> dict[str, int]:
    """One-read limits: ``overhead.limits`` and the families above."""
    lim = oh.limits(cfg, params, batch)
    raw = dataclasses.replace(cfg, use_probes=False)
    _, sown = jax.eval_shape(lambda p: rm.loss_fn(p, batch, raw), params)
    named = oh._by_name(sown)
    attn, logits = oh._nbytes(named.get("attn_logits", [])), oh._nbytes(named.get("logits", []))
    counts = lim["moe"] if cfg.moe else 0
    lim["attn"] = lim["attn_probe"] = attn
    lim["replicas"] = oh._nbytes([named.get(n, []) for n in ("hidden_states", "logits")])
    lim["readme"] = lim["light"] + logits + attn + counts
    lim["full"] = lim["heavy"] + lim["sow"] + lim["opt"] + counts
    return lim


# ----------------------------------------------------------------------------------
# Compiling.


@dataclasses.dataclass
class Cost:
    name: str
    bytes: float
    memory: int          # arguments + outputs + temporaries - aliased (donated) bytes
    temp: int
    seconds: float       # compile time
    prefetch: float = 0.0   # bytes accessed by memory-space assignment's async copies
    run: Callable[[], None] | None = None
    times: list = dataclasses.field(default_factory=list)


def tpu_sharding(topology: str) -> NamedSharding:
    """A replicated sharding on one chip of ``topology`` (compile-only devices)."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    return NamedSharding(Mesh(np.array(topo.devices[:1]), ("chip",)), P())


def local_sharding() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("chip",)), P())


def shapes(tree: Any, sharding: NamedSharding) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=sharding), tree)


def memory(compiled: Any) -> tuple[int, int]:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return int(total), int(m.temp_size_in_bytes)


_COPY_START = re.compile(r"= \((\w+\[[\d,]*\])[^\n]*? copy-start\(")
_SLICE_START = re.compile(r"= \(\([^\n]*?\), (\w+\[[\d,]*\])\{[^}\n]*S\(1\)\}[^\n]*? slice-start\(")
PREFETCH_COUNT = 4
"""How many times ``bytes accessed`` counts an async copy's size (its start and done each
read and write it)."""
SLICE_PREFETCH_COUNT = 3
"""How many times it counts a sliced prefetch's size (a ``slice-start`` into on-chip memory,
``S(1)``, its pieces joined by a ``ConcatBitcast``): what the TPU compiler schedules for a
large leaf a kernel reads whole (xl's 128 MB embedding, 2752-column MLP kernels)."""


def prefetch_bytes(hlo: str) -> float:
    """``bytes accessed`` of memory-space assignment's prefetches in compiled HLO text: each
    ``copy-start``'s destination :data:`PREFETCH_COUNT` times its bytes, each ``slice-start``
    into on-chip memory :data:`SLICE_PREFETCH_COUNT` times. Set aside, what is left is what a
    compile with memory-space assignment off counts (``tests/test_tpu_cost.py`` checks it)."""
    return float(PREFETCH_COUNT * sum(oh._shape_bytes(shape) for shape in _COPY_START.findall(hlo))
                 + SLICE_PREFETCH_COUNT * sum(oh._shape_bytes(shape) for shape in _SLICE_START.findall(hlo)))


def compile_step(name: str, step: Callable, tx: optax.GradientTransformation, params: Any, batch: dict,
                 sharding: NamedSharding) -> tuple[Cost, Any]:
    """The step compiled from shapes for ``sharding``'s devices, its state donated."""
    state = oh.TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding), shapes(params, sharding),
                          shapes(jax.eval_shape(tx.init, params), sharding))
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, shapes(batch, sharding)).compile()
    total, temp = memory(compiled)
    return Cost(name, bytes_accessed(compiled), total, temp, time.perf_counter() - t0,
                prefetch_bytes(compiled.as_text())), compiled


def bytes_accessed(compiled: Any) -> float:
    """``cost_analysis()["bytes accessed"]`` of a compiled program (one per program)."""
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, (list, tuple)) else ca)["bytes accessed"])


def attach_runner(cost: Cost, compiled: Any, tx: optax.GradientTransformation, params: Any,
                  batches: list[dict]) -> None:
    """``cost.run``: one step on the machine's own device (a fresh state, donated each step)."""
    dev = jax.devices()[0]
    own = jax.tree.map(jnp.copy, params)   # each variant's own: its steps donate them
    box = {"state": jax.device_put(oh.TrainState(jnp.zeros([], jnp.int32), own, tx.init(own)), dev), "i": 0}

    def run() -> None:
        box["state"], m = compiled(box["state"], batches[box["i"] % len(batches)])
        box["i"] += 1
        jax.block_until_ready((box["state"], m))

    cost.run = run


# ----------------------------------------------------------------------------------
# Reporting.


@dataclasses.dataclass
class Row:
    target: str
    config: str
    tokens: int
    family: str
    extra_mb: float
    limit_mb: float | None
    step_x: float
    memory_x: float
    temp_mb: float
    time_x: float = float("nan")
    own_mb: float = float("nan")    # extra MB less the change in prefetch bytes
    own_step_x: float = float("nan")   # step x, prefetches aside on both sides

    @property
    def x_limit(self) -> float:
        return self.extra_mb / self.limit_mb if self.limit_mb else float("nan")

    @property
    def own_x_limit(self) -> float:
        """The family's own reads over its limit, memory-space assignment's prefetches aside."""
        return self.own_mb / self.limit_mb if self.limit_mb else float("nan")


def rows_of(target: str, desc: str, tokens: int, costs: list[Cost], lim: dict[str, int]) -> list[Row]:
    by = {c.name: c for c in costs}
    a = by["none"]
    out = []
    for c in costs:
        if c.name == "none":
            continue
        limit = lim.get(c.name)
        tx = oh.paired(c, a) if c.times else float("nan")  # type: ignore[arg-type]
        own = (c.bytes - c.prefetch - (a.bytes - a.prefetch)) / MB
        out.append(Row(target, desc, tokens, c.name, (c.bytes - a.bytes) / MB, None if not limit else limit / MB,
                       c.bytes / a.bytes, c.memory / max(a.memory, 1), c.temp / MB, tx, own,
                       (c.bytes - c.prefetch) / (a.bytes - a.prefetch)))
    return out


def print_rows(target: str, desc: str, tokens: int, costs: list[Cost], rows: list[Row]) -> None:
    a = next(c for c in costs if c.name == "none")
    ms = f", {np.median(a.times) * 1e3:.2f} ms a step" if a.times else ""
    print(f"\n### {target}: {desc}, {tokens} tokens a step: step without vitals {a.bytes / MB:,.1f} MB accessed "
          f"({a.prefetch / MB:,.1f} of them prefetch), memory {a.memory / MB:,.1f} MB (temp {a.temp / MB:,.1f}){ms}\n")
    print("| family | extra MB | one-read limit MB | x limit | less prefetch | step x | less prefetch | memory x "
          "| temp MB | time x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lim = "" if r.limit_mb is None else f"{r.limit_mb:,.2f}"
        xl = "" if r.limit_mb is None else f"{r.x_limit:.2f}"
        ol = "" if r.limit_mb is None else f"{r.own_x_limit:.2f}"
        t = "" if r.time_x != r.time_x else f"{r.time_x:.3f}"
        print(f"| {r.family} | {r.extra_mb:,.2f} | {lim} | {xl} | {ol} | {r.step_x:.3f} | {r.own_step_x:.3f} | "
              f"{r.memory_x:.3f} | "
              f"{r.temp_mb:,.1f} | {t} |", flush=True)


def measure(target: str, size: oh.Size, bt: tuple[int, int], families: Iterable[str], sharding: NamedSharding,
            seconds: float = 0.0) -> list[Row]:
    """Every variant of one config compiled for ``sharding``'s devices; with ``seconds``,
    run there too (the machine's own devices only)."""
    cfg = size.cfg
    params = jax.eval_shape(lambda: rm.init_params(cfg, jax.random.key(0)))
    batches = make_batches(cfg, bt)
    costs = []
    real = None
    for name, (step, tx) in variants(cfg, families).items():
        try:
            cost, compiled = compile_step(name, step, tx, params, batches[0], sharding)
        except jax.errors.JaxRuntimeError as e:   # RESOURCE_EXHAUSTED: it does not fit the chip
            print(f"{name}: not compiled ({str(e).splitlines()[0][:160]})", flush=True)
            continue
        if seconds:
            if real is None:
                real = jax.device_put(rm.init_params(cfg, jax.random.key(0)), jax.devices()[0])
                batches = [jax.device_put(b, jax.devices()[0]) for b in batches]
            attach_runner(cost, compiled, tx, real, batches)
        costs.append(cost)
    if not any(c.name == "none" for c in costs):   # nothing to compare with: no row of this config
        print(f"{target}: {size.name} at {bt[0]} x {bt[1]} tokens skipped: the step without vitals does not "
              f"compile there (a chip with more memory: --topologies v5p:2x2x1, or fewer tokens)", flush=True)
        return []
    if seconds:
        oh.measure(costs, 3, seconds, 10_000)  # type: ignore[arg-type]
    rows = rows_of(target, size.describe(), bt[0] * bt[1], costs, limits(cfg, params, batches[0]))
    print_rows(target, size.describe(), bt[0] * bt[1], costs, rows)
    return rows


# ----------------------------------------------------------------------------------
# instrument(attn_logits=True) on flax's own attention: the README's NNX model
# (nnx.MultiHeadAttention, which calls jax.nn.dot_product_attention) and its Linen twin
# (nn.MultiHeadDotProductAttention: flax's dot_product_attention_weights). Not the reference
# model's attention, so steps of their own.


@dataclasses.dataclass(frozen=True)
class NnxAttention:
    """The README's NNX model scaled up (``linen=True``: the same blocks in Linen), its
    attention logits sown by ``instrument``."""

    d: int = 256
    layers: int = 4
    heads: int = 8
    vocab: int = 4096
    batch: int = 4
    seq: int = 64
    dtype: str = "float32"
    linen: bool = False

    def describe(self) -> str:
        return (f"the README's {'Linen twin of its ' if self.linen else ''}NNX model, d {self.d}, {self.layers} layers, {self.heads} heads, vocabulary "
                f"{self.vocab}, {self.dtype}, {self.batch} x {self.seq} tokens")


def _nnx_lm(c: NnxAttention) -> Any:
    from flax import nnx

    dt = jnp.dtype(c.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.input_layernorm = nnx.RMSNorm(c.d, rngs=rngs)
            self.self_attn = nnx.MultiHeadAttention(c.heads, c.d, decode=False, dtype=dt, rngs=rngs)
            self.post_attention_layernorm = nnx.RMSNorm(c.d, rngs=rngs)
            self.up_proj = nnx.Linear(c.d, 4 * c.d, dtype=dt, rngs=rngs)
            self.down_proj = nnx.Linear(4 * c.d, c.d, dtype=dt, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.self_attn(self.input_layernorm(x), mask=mask)
            return x + self.down_proj(nnx.gelu(self.up_proj(self.post_attention_layernorm(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed_tokens = nnx.Embed(c.vocab, c.d, rngs=rngs)
            self.layers = nnx.List([Block(rngs) for _ in range(c.layers)])
            self.norm = nnx.RMSNorm(c.d, rngs=rngs)
            self.lm_head = nnx.Linear(c.d, c.vocab, dtype=dt, rngs=rngs)

        def __call__(self, tokens, valid):
            mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
            x = self.embed_tokens(tokens)
            for layer in self.layers:
                x = layer(x, mask)
            return self.lm_head(self.norm(x))

    return nnx.eval_shape(lambda: LM(nnx.Rngs(0)))


def _linen_lm(c: NnxAttention) -> Any:
    import flax.linen as nn

    dt = jnp.dtype(c.dtype)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.RMSNorm(name="input_layernorm")(x)
            x = x + nn.MultiHeadDotProductAttention(c.heads, dtype=dt, name="self_attn")(h, mask=mask)
            h = nn.gelu(nn.Dense(4 * c.d, dtype=dt, name="up_proj")(nn.RMSNorm(name="post_attention_layernorm")(x)))
            return x + nn.Dense(c.d, dtype=dt, name="down_proj")(h)

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens, valid):
            mask = nn.combine_masks(nn.make_causal_mask(tokens), nn.make_attention_mask(valid, valid))
            x = nn.Embed(c.vocab, c.d, name="embed_tokens")(tokens)
            for i in range(c.layers):
                x = Block(name=f"layers_{i}")(x, mask)
            return nn.Dense(c.vocab, dtype=dt, name="lm_head")(nn.RMSNorm(name="norm")(x))

    return LM()


def nnx_attention(c: NnxAttention, sharding: NamedSharding) -> dict[str, float]:
    """The README's NNX step (loss by ``vitals.cross_entropy``, AdamW) compiled for
    ``sharding``'s devices with and without ``instrument(attn_logits=True)`` and the
    ``attn_logits`` figures: ``{"extra_mb", "own_mb", "limit_mb", "memory_x"}``. The limit is one
    read of the scores as ``jax.nn.dot_product_attention`` computes them (float32 logits,
    ``[B, H, T, T]`` per layer, whatever the inputs' dtype); in Linen as flax's
    ``dot_product_attention_weights`` does (the model's dtype)."""
    import contextlib

    from flax import nnx

    tx = optax.adamw(1e-3)
    if c.linen:
        lm = _linen_lm(c)
        tok0 = jnp.zeros((c.batch, c.seq), jnp.int32)
        params = jax.eval_shape(lambda: lm.init(jax.random.key(0), tok0, tok0 >= 0)["params"])

        def apply(p, batch):
            logits, st = lm.apply({"params": p}, batch["tokens"], batch["mask"], mutable=["intermediates"])
            return logits, st.get("intermediates", {})
    else:
        gdef, params = nnx.split(_nnx_lm(c), nnx.Param)

        def apply(p, batch):
            return nnx.capture(lambda m: m(batch["tokens"], batch["mask"]), nnx.Intermediate)(nnx.merge(gdef, p))

    def make(sown_logits: bool) -> Callable:
        def step(state, batch):
            p, opt = state

            def loss_fn(p):
                logits, sown = apply(p, batch)
                loss, _ = vitals.cross_entropy(logits, batch["labels"], batch["mask"])
                return loss, sown

            ctx = vitals.instrument(attn_logits=True, probes=False) if sown_logits else contextlib.nullcontext()
            with ctx:
                (loss, sown), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
            upd, opt = tx.update(g, opt, p)
            metrics = {"loss": loss}
            if sown_logits:
                metrics |= vitals.activation_metrics(sown, mask=batch["mask"], names=("attn_logits",))
            return (optax.apply_updates(p, upd), opt), metrics
        return step

    state = (shapes(params, sharding), shapes(jax.eval_shape(tx.init, params), sharding))
    tok = jax.ShapeDtypeStruct((c.batch, c.seq), jnp.int32, sharding=sharding)
    batch = {"tokens": tok, "labels": tok, "mask": jax.ShapeDtypeStruct((c.batch, c.seq), bool, sharding=sharding)}
    got = []
    for sown_logits in (False, True):
        compiled = jax.jit(make(sown_logits), donate_argnums=0).lower(state, batch).compile()
        got.append((bytes_accessed(compiled), prefetch_bytes(compiled.as_text()), memory(compiled)[0]))
    (b0, p0, m0), (b1, p1, m1) = got
    limit = c.layers * c.batch * c.heads * c.seq * c.seq * (jnp.dtype(c.dtype).itemsize if c.linen else 4)
    return {"extra_mb": (b1 - b0) / MB, "own_mb": ((b1 - p1) - (b0 - p0)) / MB, "limit_mb": limit / MB,
            "memory_x": m1 / m0}


def print_summary(rows: list[Row]) -> None:
    if not rows:
        print("\nNo rows: no config compiled for these topologies.")
        return
    print("\n## Summary: every family's extra bytes x its one-read limit (target <= 1.5; the README's "
          "light step <= 0.2), as bytes accessed counts them / memory-space assignment's prefetches "
          "aside; memory x the step without vitals (target <= 1.05)\n")
    keys = list(dict.fromkeys((r.target, r.config) for r in rows))
    fams = list(dict.fromkeys(r.family for r in rows))
    print("| target | config | " + " | ".join(fams) + " | worst memory x |")
    print("|---|---|" + "---:|" * (len(fams) + 1))
    for t, c in keys:
        by = {r.family: r for r in rows if (r.target, r.config) == (t, c)}
        cells = [f"{by[f].x_limit:.2f} / {by[f].own_x_limit:.2f}" if f in by and by[f].limit_mb else ""
                 for f in fams]
        worst = max(r.memory_x for r in by.values())
        print(f"| {t} | {c.split(':')[0]} | " + " | ".join(cells) + f" | {worst:.3f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES), help="TPU topologies to compile for")
    ap.add_argument("--platform", choices=("tpu", "local"), default="tpu",
                    help="tpu: ahead of time for --topologies; local: this machine's own devices (a GPU)")
    ap.add_argument("--configs", default="d256,moe,b1", help=f"comma-separated, of {sorted(sizes())}")
    ap.add_argument("--tokens", default="256", help="tokens a step of the bench configs (256 = 4 x 64, ...)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--install", action="store_true", help="install libtpu into $JVITALS_LIBTPU_DIR if absent")
    ap.add_argument("--install-only", action="store_true",
                    help="only make sure libtpu is there (installing it if absent); exit 1 if it is not")
    ap.add_argument("--time", type=float, default=0.0, help="--platform local: time each config S seconds")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--msa", choices=("on", "off"), default="on",
                    help="off: compile with memory-space assignment off (LIBTPU_INIT_ARGS=--xla_msa_enable=false; "
                         "nothing placed in on-chip memory, so bytes and memory count the families' own reads "
                         "and buffers exactly, on scan-stacked models too); only before libtpu is first loaded")
    args = ap.parse_args(argv)
    if args.msa == "off":
        os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {MSA_OFF}".strip()
    if args.install_only:
        path = use_libtpu(install=True)
        print(path or f"libtpu not installed in {libtpu_dir()}")
        return 0 if path else 1
    table = sizes()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {sorted(table)}")
    shapes_bt = {256: (4, 64), 1024: (8, 128), 4096: (16, 256), 8192: (8, 1024)}
    tokens = [shapes_bt.get(int(t), (max(1, int(t) // 128), 128)) for t in args.tokens.split(",")]
    if args.platform == "tpu":
        path = use_libtpu(args.install)
        if path is None:
            print(f"no libtpu: pass --install (pip install --no-deps --target {libtpu_dir()} "
                  f"'{libtpu_pin()}'), or set JVITALS_LIBTPU_DIR", file=sys.stderr)
            return 2
        targets = [(t, tpu_sharding(t)) for t in args.topologies.split(",")]
    else:
        dev = jax.devices()[0]
        targets = [(f"{dev.platform} ({dev.device_kind})", local_sharding())]
    print(f"# jvitals on the {args.platform} compiler: jax {jax.__version__}"
          + (f", {os.path.basename(os.path.dirname(os.environ['TPU_LIBRARY_PATH']))} "
             f"{_libtpu_version()}" if args.platform == "tpu" else "")
          + (", memory-space assignment off" if args.msa == "off" else ""), flush=True)
    rows: list[Row] = []
    for target, sharding in targets:
        for name in names:
            size = table[name]
            for bt in size.tokens or tokens:
                rows += measure(target, size, bt, args.families.split(","), sharding,
                                args.time if args.platform == "local" else 0.0)
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


def _libtpu_version() -> str:
    so = pathlib.Path(os.environ["TPU_LIBRARY_PATH"])
    found = sorted(so.parent.parent.glob("libtpu-*.dist-info"))
    return re.sub(r"^libtpu-|\.dist-info$", "", found[0].name) if found else ""


if __name__ == "__main__":
    sys.exit(main())
