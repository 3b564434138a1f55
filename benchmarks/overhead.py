"""What jvitals adds to a training step: XLA's bytes per family beside their one-read limit, and time.

On an accelerator the statistics are bandwidth-bound, so what a family costs is the
bytes it makes the step read and write; the physical limit is **one read** of each
tensor it measures. This benchmark compiles the reference model's training step
(``chain(clip_by_global_norm(1.0), adamw(1e-3))``) once without vitals and once per
family of vitals, each compiled apart (no ``lax.cond`` holds two of them), and reports:

- **bytes**: ``compiled.cost_analysis()["bytes accessed"]`` of the step with the
  family minus the step without, beside the family's one-read limit (below), for the
  one-read form every statistic takes on a GPU or TPU (compiled here inside
  ``fold.one_read()``; the logits' row statistics are plain reductions on every backend,
  which the TPU compiler fuses into one read with the loss's and XLA:CPU, without
  multi-output fusion, counts once each: their TPU bytes are ``tpu_cost.py``'s); beside
  it, column "cpu form", the bytes of the form this backend
  compiles and runs (on the CPU its own forms: plain reductions XLA:CPU vectorises, a
  sampled Adam-``nu`` median; more bytes or fewer, less time: docs/COST.md). XLA
  counts a ``while`` loop's body once; the loops left (the CPU's Adam-``nu``
  histogram, in chunks of 2^18) are counted here with their trip counts, read from
  the HLO (column "loops"); a ``conditional`` is counted as its dearest branch, and
  the only ones left here are non-finite counts, which run only on a step with a NaN
  or Inf, so their dear branch is taken out of "extra" (column "non-finite branch":
  what such a step reads besides).
- **temp**: compiled temporary memory (``memory_analysis()``) of the form run here, against
  the step's.
- **time**: the steps run interleaved in a random order each round, each timed to
  ``block_until_ready``; the median of the per-round ratios to the step without
  vitals (paired: load on a shared machine hits both sides alike).

Families (the step without vitals still sows what the model sows; nothing reads it,
so XLA drops it):

=============  ===========================================================  ==============================
family         what the step adds                                           one-read limit
=============  ===========================================================  ==============================
``sow``        ``activation_metrics`` of the full tensors the model sows    the sown tensors' bytes
               (``self.sow('intermediates', ...)``: logits, MTP logits,
               hidden states, attention outputs, logits and gates)
``probes``     the same figures from the model's probes (``use_probes``)    the same tensors
``instrument`` ``activation_metrics`` of what ``jvitals.instrument()``      the tensors it summarises
               sows around the model's ``apply``                            (recorded while tracing)
``light``      ``record(chain(clip, adamw), schedule=...)`` with            params + updates (the grad
               ``vitals_heavy=False``: global norms, post-clip, update      norm is the clip's: XLA
               norm and ratio, learning rate, every layer's and group's     computes it once)
               norms and ratios, the window (``loss=``, ``vitals_read``)
``heavy``      the same with ``vitals_heavy=True``: + every per-role        gradients + params + updates
               figure
``skip``       ``light`` around ``skip_step(chain(clip, adamw))``: the      params + updates
               in-step skip's cost
``ce``         ``light`` with the loss by ``vitals.cross_entropy``: the     params + updates (the logits'
               output logits' figures from the loss's pass, every step      rows are read by the loss)
``attn``       ``light`` with ``act/attn_logits_abs.max`` from the sown        params + updates (the
               attention scores (the README's Linen loop, every step)       scores are the model's)
``opt``        ``optimizer_metrics``: Adam ``nu`` max, median, spread       Adam ``nu``
``moe``        ``moe_metrics`` of the sown expert counts (MoE configs)      the counts
=============  ===========================================================  ==============================

Beside them, timed only: **all** (every family every step: ``heavy`` + ``sow`` +
``opt`` + ``moe``) and the README's **cadence** (``light`` every step, ``all`` 1 in
500: ``light + (all - light) / 500``).

Run: ``python benchmarks/overhead.py [--quick] [--configs d128,d256] [--tokens 256,1024]
[--families sow,light,...] [--placement chain|clip] [--min-seconds S] [--no-time]``
(``--quick``: the tiny config, four families, three rounds: a smoke test). Configs: ``d128``, ``d256``,
``d512``, ``d1024`` (Llama-like: 4 layers, vocabulary 4096, fused QKV with grouped
K/V), ``moe`` (MoE MLA, gated attention, one MTP depth, scan-stacked), and for an
accelerator ``xl`` and ``xl_moe`` (bf16, vocabulary 32768, d=1024, 8 layers; their
token count is their own, 8 x 1024): ``python benchmarks/overhead.py --configs
xl,xl_moe --min-seconds 20``. ``--configs xl_dry`` runs that code path at a tiny
size (bf16 MoE, MTP, scan), to check it compiles and runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from typing import Any, Callable, Iterable, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jvitals as vitals  # noqa: E402
from jvitals import reference_model as rm  # noqa: E402
from jvitals.metrics import fold  # noqa: E402
from jvitals.metrics.instrument import ExpertChoices  # noqa: E402
from jvitals.metrics.probes import LogitsRows  # noqa: E402
from jvitals.metrics.stats import TokenSummary  # noqa: E402

MB = 1e6
HEAVY_EVERY = 500  # METRICS.md §5: per-layer figures every 500 steps (the README's cadence)
TARGET_BYTES, TARGET_TEMP = 1.5, 1.05
FAMILIES = ("sow", "probes", "instrument", "light", "heavy", "opt", "moe", "skip", "ce", "attn")


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    cfg: rm.ModelConfig
    tokens: tuple[tuple[int, int], ...] | None = None  # fixed (B, T) pairs; None: --tokens

    def describe(self) -> str:
        c = self.cfg
        kind = ("MoE " if c.moe else "") + c.attention
        extra = (f" MTP{c.n_mtp}" if c.n_mtp else "") + (" scan" if c.scan_layers else "") + (
            " bf16" if c.dtype == jnp.bfloat16 else "")
        return f"{self.name}: {kind} L{c.n_layers} d{c.d_model} V{c.vocab}{extra}"


def _llama(d: int, **kw: Any) -> rm.ModelConfig:
    """Llama-like: 4 layers, V=4096, head_dim 32 (64 from d=1024), 4 K/V groups, F = 8d/3."""
    hd = 64 if d >= 1024 else 32
    base = dict(vocab=4096, d_model=d, n_layers=4, n_heads=d // hd, n_kv_heads=max(1, d // hd // 4),
                head_dim=hd, d_ff=64 * round(8 * d / 3 / 64), attention="fused_qkv")
    return rm.ModelConfig(**{**base, **kw})


def _moe(d: int, vocab: int, layers: int, **kw: Any) -> rm.ModelConfig:
    return rm.ModelConfig(vocab=vocab, d_model=d, n_layers=layers, n_heads=max(2, d // 64), head_dim=64,
                          d_ff=4 * d, attention="mla", q_lora_rank=d // 2, kv_lora_rank=d // 4,
                          attn_gate=True, moe=True, n_experts=8, top_k=2, d_expert=d, n_mtp=1,
                          scan_layers=True, **kw)


def sizes() -> dict[str, Size]:
    bf16 = dict(dtype=jnp.bfloat16)
    return {s.name: s for s in (
        Size("tiny", _llama(64, vocab=512, n_layers=2), ((2, 32),)),
        Size("d128", _llama(128)), Size("d256", _llama(256)), Size("d512", _llama(512)),
        Size("d1024", _llama(1024)),
        Size("moe", _moe(128, 4096, 2)),
        # For an accelerator: minutes per step on the CPU.
        Size("xl", _llama(1024, vocab=32768, n_layers=8, **bf16), ((8, 1024),)),
        Size("xl_moe", _moe(1024, 32768, 8, **bf16), ((8, 1024),)),
        # The accelerator configs' code path (bf16, MoE, MTP, scan) at a CPU size.
        Size("xl_dry", _moe(64, 512, 2, **bf16), ((2, 32),)),
    )}


# ----------------------------------------------------------------------------------
# The steps.


def base_tx() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def recorded_tx(placement: str) -> optax.GradientTransformation:
    """The recorder as the README places it (``chain``: around the whole optimizer, with
    the learning rate) or around the clip only (``clip``: no update figures)."""
    if placement == "chain":
        return vitals.record(base_tx(), schedule=1e-3)
    return optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.adamw(1e-3))


def _keep(tree: Any, pred: Callable[[Any], bool]) -> Any:
    """The entries of a sown tree whose values satisfy ``pred`` (empty branches dropped)."""
    if isinstance(tree, dict):
        out = {k: _keep(v, pred) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v not in ({}, ())}
    return tuple(x for x in tree if pred(x))


def _instrumented(tree: Any) -> Any:
    """What ``instrument()`` sowed (its per-token structs), not the model's own raw sows."""
    return _keep(tree, lambda x: isinstance(x, (TokenSummary, LogitsRows, ExpertChoices)))


def _loss(cfg: rm.ModelConfig, fams: frozenset[str]) -> Callable:
    """``params, batch -> (loss, sown)``: the model's loss, inside ``instrument()`` if asked;
    with ``ce``, the main logits' loss by ``vitals.cross_entropy`` and its figures in the sown
    tree (``"logit_figures"``)."""
    def loss_of(params: Any, batch: dict) -> tuple[jax.Array, Any]:
        ctx = vitals.instrument() if "instrument" in fams else contextlib.nullcontext()
        with ctx:
            if "ce" in fams:
                return _ce_loss(params, batch, cfg)
            return rm.loss_fn(params, batch, cfg)

    return loss_of


def _ce_loss(params: Any, batch: dict, cfg: rm.ModelConfig, mtp_weight: float = 0.3) -> tuple[jax.Array, Any]:
    """``rm.loss_fn`` with the main logits' loss and figures from ``vitals.cross_entropy``."""
    (logits, mtp), state = rm.Decoder(cfg).apply({"params": params}, batch["tokens"], mask=batch["mask"],
                                                 return_mtp=True, mutable=["intermediates"])
    labels, mask = batch["labels"], batch["mask"]
    loss, figs = vitals.cross_entropy(logits, labels, mask)
    if mtp:
        extra = [rm.mtp_cross_entropy(lk, labels, mask, k) for k, lk in enumerate(mtp, start=1)]
        loss = loss + mtp_weight * sum(extra) / len(extra)
    return loss, {**state.get("intermediates", {}), "logit_figures": figs}


def _family_metrics(cfg: rm.ModelConfig, fams: frozenset[str], inter: Any, opt_state: Any,
                    batch: dict) -> dict[str, jax.Array]:
    """The figures of the activation, MoE and optimizer families the step returns."""
    m: dict[str, jax.Array] = dict(inter.pop("logit_figures", {})) if isinstance(inter, dict) else {}
    sown = _keep(inter, lambda x: not isinstance(x, (TokenSummary, LogitsRows, ExpertChoices)))
    if fams & {"sow", "probes"}:
        m.update(vitals.activation_metrics(sown, mask=batch["mask"], labels=batch["labels"]))
    if "instrument" in fams:
        m.update({f"i/{k}": v for k, v in vitals.activation_metrics(
            _instrumented(inter), mask=batch["mask"], labels=batch["labels"]).items()})
    if "moe" in fams and cfg.moe:
        m.update(vitals.moe_metrics(_counts(inter), top_k=cfg.top_k))
    if "opt" in fams:
        m.update(vitals.optimizer_metrics(opt_state))
    if "attn" in fams and "sow" not in fams:
        m.update(vitals.activation_metrics(sown, mask=batch["mask"], names=("attn_logits",)))
    return m


def make_step(cfg: rm.ModelConfig, tx: optax.GradientTransformation, fams: Iterable[str] = (),
              heavy: bool | None = None, extra: Callable[[Any, dict], dict] | None = None,
              probes: bool | None = None) -> Callable:
    """A train step with the families ``fams``; ``heavy`` is the recorder's ``vitals_heavy``
    (None: not passed); ``extra(sown, batch)``: more figures; ``probes``: the model's
    ``use_probes`` (None: whether ``"probes"`` is among ``fams``). Without families it returns
    the loss only (the sown tensors are dead)."""
    fams = frozenset(fams)
    cfg = dataclasses.replace(cfg, use_probes="probes" in fams if probes is None else probes)
    loss_of = _loss(cfg, fams)

    def step(state: TrainState, batch: dict):
        (loss, inter), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params, batch)
        # As the README's loop calls it: the loss (into the recorder's window, or judged by
        # skip_step) and whether the host reads after this step (traced: no recompile).
        args = {"loss": loss, "vitals_read": state.step % 50 == 0}
        if heavy is not None:
            args["vitals_heavy"] = heavy
        updates, opt_state = tx.update(grads, state.opt_state, state.params, **args)
        params = optax.apply_updates(state.params, updates)
        if cfg.moe:  # aux-loss-free balancing: training, not vitals; every step does it
            params = rm.update_expert_bias(params, _counts(inter), rate=1e-3)
        metrics = {"loss": loss, **_family_metrics(cfg, fams, inter, opt_state, batch)}
        if extra is not None:
            metrics.update(extra(inter, batch))
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


def _counts(inter: Any) -> dict:
    """The model's ``expert_counts`` sows, as a nested dict by module path."""
    nested: dict = {}
    if isinstance(inter, dict):   # the loss's logit figures (family ce) are no sown values
        inter = {k: v for k, v in inter.items() if k != "logit_figures"}
    for p, v in jax.tree_util.tree_flatten_with_path(_keep(inter, lambda x: not isinstance(x, ExpertChoices)))[0]:
        s = jax.tree_util.keystr(p, simple=True, separator="/")
        if "expert_counts" in s:
            d = nested
            parts = s.split("/")
            for part in parts[:-1]:
                d = d.setdefault(part, {})
            d[parts[-1]] = v
    return nested


def variants(cfg: rm.ModelConfig, placement: str, families: Iterable[str] = FAMILIES + ("all",)
             ) -> dict[str, tuple[Callable, optax.GradientTransformation]]:
    """``{name: (step, tx)}``: the step without vitals (``none``), one per family asked
    for (``moe`` on MoE configs only), and ``all`` (every family every step)."""
    families = set(families)
    plain, rec = base_tx(), recorded_tx(placement)
    out = {"none": (make_step(cfg, plain), plain)}
    for fam in ("sow", "probes", "instrument", "opt", "moe"):
        if fam in families and (fam != "moe" or cfg.moe):
            out[fam] = (make_step(cfg, plain, [fam]), plain)
    for fam, flag in (("light", False), ("heavy", True)):
        if fam in families:
            out[fam] = (make_step(cfg, rec, heavy=flag), rec)
    if "ce" in families and placement == "chain":     # the light step with the loss's logit figures
        out["ce"] = (make_step(cfg, rec, ["ce"], heavy=False), rec)
    if "attn" in families and placement == "chain":   # ... and with the largest attention logit
        out["attn"] = (make_step(cfg, rec, ["attn"], heavy=False), rec)
    if "skip" in families and placement == "chain":   # the light step with the in-step skip
        skip = vitals.record(vitals.skip_step(base_tx()), schedule=1e-3)
        out["skip"] = (make_step(cfg, skip, heavy=False), skip)
    if "all" in families:
        out["all"] = (make_step(cfg, rec, ["sow", "opt", "moe"], heavy=True), rec)
    return out


# ----------------------------------------------------------------------------------
# One-read limits.


def _nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _by_name(sown: Any) -> dict[str, list]:
    """The sown values by their leaf NAME (``hidden_states``, ``logits``, ...)."""
    out: dict[str, list] = {}
    for p, v in jax.tree_util.tree_flatten_with_path(sown)[0]:
        name = next((k.key for k in reversed(p) if isinstance(k, jax.tree_util.DictKey)), "")
        out.setdefault(str(name), []).append(v)
    return out


def limits(cfg: rm.ModelConfig, params: Any, batch: dict, placement: str = "chain") -> dict[str, int]:
    """The bytes each family must read at least once (see the module docstring): the
    light step's gradient norm is the clip's (no read of its own); around the clip
    only, the recorder has no updates to read."""
    raw = dataclasses.replace(cfg, use_probes=False)
    _, sown = jax.eval_shape(lambda p: rm.loss_fn(p, batch, raw), params)
    counts = _counts(sown)
    act = _nbytes(sown) - _nbytes(counts)
    p = _nbytes(params)
    upd = p if placement == "chain" else 0
    return {"sow": act, "probes": act, "instrument": _instrument_reads(raw, params, batch), "light": p + upd,
            "skip": p + upd, "ce": p + upd, "attn": p + upd,
            "heavy": 2 * p + upd, "opt": p, "moe": _nbytes(counts)}


def _instrument_reads(cfg: rm.ModelConfig, params: Any, batch: dict) -> int:
    """Bytes of the tensors ``instrument()`` summarises, recorded while tracing its apply."""
    seen: list[Any] = []
    mod = importlib.import_module("jvitals.metrics.instrument")  # the module, not the function
    names = ("summarize_tokens", "logits_rows")
    saved = {n: getattr(mod, n) for n in names}

    def hook(fn: Callable) -> Callable:
        def wrapped(x: Any, *a: Any, **k: Any) -> Any:
            seen.append(x)
            return fn(x, *a, **k)
        return wrapped

    try:
        for n, fn in saved.items():
            setattr(mod, n, hook(fn))
        jax.eval_shape(lambda p: _loss(cfg, frozenset({"instrument"}))(p, batch), params)
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)
    return _nbytes(seen)


# ----------------------------------------------------------------------------------
# XLA's accounting.


_WHILE = re.compile(r"%(\S+) = .* while\(.*body=%?([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")
_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|s16|u16|s8|u8|pred)\[([\d,]*)\]")
_SIZE = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
         "s8": 1, "u8": 1, "pred": 1}


def _shape_bytes(text: str) -> int:
    return sum(_SIZE[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text))


def _computation(hlo: str, name: str) -> list[str]:
    start = re.search(rf"^(?:ENTRY )?%?{re.escape(name)} \(", hlo, re.M)
    if start is None:
        return []
    body = hlo[start.end():hlo.index("\n}", start.end())]
    return [ln.strip() for ln in body.splitlines()[1:] if " = " in ln]


def _parse(line: str) -> tuple[str, str, str, list[str]]:
    """``(name, result shape, opcode, operand names)`` of one HLO instruction line."""
    lhs, rhs = line.split(" = ", 1)
    shape, _, rest = rhs.partition(" ")
    if shape.startswith("("):  # a tuple shape holds spaces
        depth, i = 0, 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rhs[:i + 1], rhs[i + 2:]
    op, _, args = rest.partition("(")
    return lhs.replace("ROOT ", "").strip().lstrip("%"), shape, op, re.findall(r"%([\w.\-]+)", args.split("), ", 1)[0])


def _fusion_io(hlo: str, fused: str) -> tuple[dict[int, int], int | None]:
    """What a fusion reads of the parameters it only slices (the slices; a buffer it
    updates in place: nothing), and its result's bytes when its root is an in-place
    ``dynamic-update-slice`` (the update's), as XLA's cost analysis counts them."""
    params: dict[str, int] = {}
    sizes: dict[str, int] = {}
    sliced: dict[int, int] = {}
    whole: set[int] = set()
    root_bytes = None
    for ln in _computation(hlo, fused):
        name, shape, op, args = _parse(ln)
        sizes[name] = _shape_bytes(shape)
        if op == "parameter":
            params[name] = int(re.search(r"parameter\((\d+)\)", ln).group(1))
            continue
        if op == "dynamic-update-slice" and ln.startswith("ROOT"):
            root_bytes = sizes.get(args[1], 0)
        for j, a in enumerate(args):
            if a not in params:
                continue
            if op in ("slice", "dynamic-slice") and j == 0:
                sliced[params[a]] = sliced.get(params[a], 0) + _shape_bytes(shape)
            elif op == "dynamic-update-slice" and j == 0:
                sliced.setdefault(params[a], 0)
            else:
                whole.add(params[a])
    return {i: b for i, b in sliced.items() if i not in whole}, root_bytes


def _body_bytes(hlo: str, name: str) -> int:
    """Approximately what XLA's cost analysis counts for one run of a computation:
    results and operands of its top-level instructions (an operand a fusion only
    slices: the slices; a buffer updated in place: the update)."""
    sizes: dict[str, int] = {}
    total = 0
    for ln in _computation(hlo, name):
        var, shape, op, args = _parse(ln)
        sizes[var] = _shape_bytes(shape)
        if op in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            continue
        fused = re.search(r"calls=%?([\w.\-]+)", ln)
        reads, out = _fusion_io(hlo, fused.group(1)) if op == "fusion" and fused else ({}, None)
        total += (sizes[var] if out is None else out) + sum(
            reads.get(j, sizes.get(a, 0)) for j, a in enumerate(dict.fromkeys(args)))
    return total


def loop_bytes(hlo: str) -> int:
    """The bytes of the loop iterations XLA's cost analysis leaves out (it counts a
    ``while`` body once): ``(trip count - 1) x body`` for every loop with a known count."""
    return sum((int(n) - 1) * _body_bytes(hlo, body) for _, body, n in _WHILE.findall(hlo))


_COND = re.compile(r"conditional\(.*branch_computations=\{([^}]*)\}")


def branch_bytes(hlo: str) -> int:
    """The bytes of the conditional branches a healthy step does not run: XLA's cost
    analysis counts a ``conditional`` as its dearest branch, and the conditionals left
    in these steps (compiled apart, no cadence ``lax.cond``) are the non-finite counts,
    whose dear branch runs only on a step with a NaN or Inf; a healthy step runs the
    cheapest. Per conditional: ``max - min`` of its branches' bytes."""
    total = 0
    for names in _COND.findall(hlo):
        costs = [_body_bytes(hlo, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
        total += max(costs) - min(costs) if costs else 0
    return total


# ----------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Variant:
    name: str
    run: Callable[[], None]
    bytes: float
    loops: float
    temp: int
    branches: float = 0.0
    here: float = float("nan")   # healthy bytes of the form this backend compiles (the CPU's forms)
    times: list = dataclasses.field(default_factory=list)

    @property
    def healthy(self) -> float:
        """Bytes a healthy step accesses: XLA's count, plus the loops' iterations it
        leaves out, less the non-finite branches it counts but a healthy step skips."""
        return self.bytes + self.loops - self.branches


def inputs(cfg: rm.ModelConfig, batch_shape: tuple[int, int]) -> tuple[Any, list[dict]]:
    """The parameters and two batches of a config, on the first device."""
    dev = jax.devices()[0]
    params = jax.device_put(rm.init_params(cfg, jax.random.key(0)), dev)
    batches = [jax.device_put(rm.make_batch(i, cfg, *batch_shape, pad_fraction=0.1), dev) for i in range(2)]
    return params, batches


def _bytes(compiled: Any) -> tuple[float, float, float]:
    """``(XLA's bytes accessed, the loops' bytes it leaves out, the non-finite branches')``."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    hlo = compiled.as_text()
    return float(ca["bytes accessed"]), float(loop_bytes(hlo)), float(branch_bytes(hlo))


def compile_variant(name: str, step: Callable, tx: optax.GradientTransformation, params: Any,
                    batches: list[dict]) -> Variant:
    """One step compiled twice: in the one-read form every statistic takes on a GPU or TPU
    (``fold.one_read()``: its bytes, loops, non-finite branches) and as this backend
    compiles it (the CPU's forms on the CPU: its bytes, temp, and a ``run`` that takes the
    next step, alternating the batches)."""
    state = jax.device_put(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), jax.devices()[0])
    with fold.one_read():   # a fresh function: jit's trace cache does not see the context
        one = jax.jit(lambda s, b: step(s, b)).lower(state, batches[0]).compile()
    compiled = jax.jit(step).lower(state, batches[0]).compile()
    box = {"state": state, "i": 0}

    def run() -> None:
        box["state"], m = compiled(box["state"], batches[box["i"] % len(batches)])
        box["i"] += 1
        jax.block_until_ready((box["state"], m))

    b, lp, br = _bytes(one)
    here = _bytes(compiled)
    return Variant(name, run, b, lp, int(compiled.memory_analysis().temp_size_in_bytes), br,
                   here=here[0] + here[1] - here[2])


def build(size: Size, batch_shape: tuple[int, int], placement: str,
          families: Iterable[str]) -> tuple[list[Variant], dict[str, int]]:
    """Compile every variant of one config at one token count; their limits."""
    params, batches = inputs(size.cfg, batch_shape)
    out = [compile_variant(name, step, tx, params, batches)
           for name, (step, tx) in variants(size.cfg, placement, families).items()]
    return out, limits(size.cfg, params, batches[0], placement)


def measure(vs: list[Variant], rounds: int, min_seconds: float, max_rounds: int) -> int:
    """Rounds of one step per variant, in a fresh random order each round (after two
    warm-up steps each)."""
    for v in vs:
        v.run()
        v.run()
    rng = random.Random(0)
    t0 = time.perf_counter()
    n = 0
    while n < rounds or (time.perf_counter() - t0 < min_seconds and n < max_rounds):
        for v in rng.sample(vs, len(vs)):
            t = time.perf_counter()
            v.run()
            v.times.append(time.perf_counter() - t)
        n += 1
    return n


def paired(v: Variant, base: Variant) -> float:
    return statistics.median(a / b for a, b in zip(v.times, base.times)) if v.times else float("nan")


def load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# ----------------------------------------------------------------------------------
# Reporting.


@dataclasses.dataclass
class Row:
    config: str
    tokens: int
    family: str
    extra_mb: float
    limit_mb: float | None
    temp: float
    time: float
    here_mb: float = float("nan")

    @property
    def x_limit(self) -> float:
        return self.extra_mb / self.limit_mb if self.limit_mb else float("nan")


def rows_of(desc: str, tokens: int, vs: list[Variant], lim: dict[str, int]) -> list[Row]:
    by = {v.name: v for v in vs}
    a = by["none"]
    out = []
    for v in vs:
        if v.name == "none":
            continue
        limit = lim.get(v.name)
        out.append(Row(desc, tokens, v.name, (v.healthy - a.healthy) / MB,
                       None if limit is None else limit / MB, v.temp / max(a.temp, 1), paired(v, a),
                       (v.here - a.here) / MB))
    if "light" in by and "all" in by:
        light, full = by["light"], by["all"]
        cadence = paired(light, a) + (paired(full, a) - paired(light, a)) / HEAVY_EVERY
        out.append(Row(desc, tokens, "cadence", float("nan"), None, max(light.temp, full.temp) / max(a.temp, 1),
                       cadence))
    return out


def print_config(desc: str, tokens: int, vs: list[Variant], rows: list[Row], n: int) -> None:
    a = next(v for v in vs if v.name == "none")
    ms = statistics.median(a.times) * 1e3 if a.times else float("nan")
    print(f"\n### {desc}, {tokens} tokens a step: step without vitals {a.bytes / MB:,.1f} MB accessed, "
          f"temp {a.temp / MB:.2f} MB, {ms:.1f} ms ({n} timed rounds, load {load()})\n")
    print("| family | extra MB | of which loops | non-finite branch MB | one-read limit MB | x limit | temp x "
          f"| {jax.devices()[0].platform} form: extra MB | time x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    loops = {v.name: (v.loops - a.loops) / MB for v in vs}
    branches = {v.name: (v.branches - a.branches) / MB for v in vs}
    for r in rows:
        lim = "" if r.limit_mb is None else f"{r.limit_mb:,.2f}"
        xl = "" if r.limit_mb is None else f"{r.x_limit:.2f}"
        extra = "" if math.isnan(r.extra_mb) else f"{r.extra_mb:,.2f}"
        lp = f"{loops[r.family]:,.2f}" if r.family in loops else ""
        br = f"{branches[r.family]:,.2f}" if r.family in branches else ""
        here = "" if math.isnan(r.here_mb) else f"{r.here_mb:,.2f}"
        print(f"| {r.family} | {extra} | {lp} | {br} | {lim} | {xl} | {r.temp:.3f} | {here} | {r.time:.3f} |",
              flush=True)


def print_summary(rows: list[Row]) -> None:
    print("\n## Summary: bytes within 1.5x of the one-read limit, temp <= 1.05x, time (every family every "
          "step: `all`; the README's cadence)\n")
    print("| config | tokens | worst bytes x limit (family) | families over 1.5x | all: time x | "
          "cadence: time x | worst temp x |")
    print("|---|---:|---:|---|---:|---:|---:|")
    keys = list(dict.fromkeys((r.config, r.tokens) for r in rows))
    for c, t in keys:
        rs = [r for r in rows if (r.config, r.tokens) == (c, t)]
        fam = [r for r in rs if r.limit_mb and r.limit_mb > 0.05]
        worst = max(fam, key=lambda r: r.x_limit)
        over = ", ".join(f"{r.family} {r.x_limit:.2f}" for r in fam if r.x_limit > TARGET_BYTES) or "none"
        by = {r.family: r for r in rs}
        nan = Row(c, t, "", float("nan"), None, float("nan"), float("nan"))
        print(f"| {c} | {t} | {worst.x_limit:.2f} ({worst.family}) | {over} | {by.get('all', nan).time:.3f} | "
              f"{by.get('cadence', nan).time:.3f} | {max(r.temp for r in rs):.3f} |")


# ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="d128,d256,d512,d1024,moe",
                    help="comma-separated; also xl, xl_moe (accelerators) and xl_dry")
    ap.add_argument("--tokens", default="256,1024", help="tokens a step: 256 = 4 x 64, 1024 = 8 x 128, ...")
    ap.add_argument("--placement", choices=("chain", "clip"), default="chain")
    ap.add_argument("--families", default=",".join(FAMILIES + ("all",)),
                    help="which families to compile (the step without vitals always)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per config (at least)")
    ap.add_argument("--min-seconds", type=float, default=30.0, help="keep timing a config this long")
    ap.add_argument("--max-rounds", type=int, default=200)
    ap.add_argument("--no-time", action="store_true", help="bytes and memory only")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="smoke run: the tiny config, 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.configs, args.rounds, args.min_seconds = "tiny", 3, 0.0
        args.families = "sow,instrument,light,opt"
    table = sizes()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {sorted(table)}")
    shapes = {256: (4, 64), 1024: (8, 128), 4096: (16, 256), 8192: (8, 1024)}
    tokens = [shapes.get(int(t), (max(1, int(t) // 128), 128)) for t in args.tokens.split(",")]
    print(f"# jvitals overhead: {platform.machine()}, {os.cpu_count()} CPU(s), jax {jax.__version__} on "
          f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}); recorder around the "
          f"{'whole optimizer' if args.placement == 'chain' else 'clip'}; load {load()}", flush=True)
    rows: list[Row] = []
    for name in names:
        size = table[name]
        for bt in size.tokens or tokens:
            vs, lim = build(size, bt, args.placement, args.families.split(","))
            n = 0 if args.no_time else measure(vs, args.rounds, args.min_seconds, args.max_rounds)
            rs = rows_of(size.describe(), bt[0] * bt[1], vs, lim)
            print_config(size.describe(), bt[0] * bt[1], vs, rs, n)
            rows += rs
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
