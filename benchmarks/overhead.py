"""Overhead of jvitals on the reference model's jitted train step, side by side.

Four variants of one training step (same model, data and optimizer,
``chain(clip_by_global_norm(1.0), adamw(1e-3))``), run in one process:

- **(a) none**: no vitals. The model sows raw tensors that nothing reads
  (``use_probes=False``; XLA drops them), the step returns only the loss. MoE
  configs still read ``expert_counts`` for aux-loss-free balancing
  (``update_expert_bias``): that is training, not vitals, and all variants do it.
- **(b) all, every step**: ``record()`` with every family every step plus
  the activation probes --
  ``record(clip, every={'global': 1, 'layers': 1})``, the model's probes
  (``use_probes=True``: logits, MTP logits, attention logits, hidden states,
  attention outputs, gate scores), ``activation_metrics`` and ``moe_metrics``
  (MoE configs), returned from the step as one dict; the recorder's figures
  stay in the optimizer state (one packed vector), where the host reads them
  (``vitals.recorded(opt_state)``), as a loop with a cadence would, only at
  the end. Beside it, **(b) + optimizer statistics**: the same step with
  ``optimizer_metrics`` too (Adam ``nu`` max and histogram median, a
  scatter-add of every ``nu`` element on the CPU), which earlier tables
  counted in (b); (d) is compared with this one, the same figures.
- **(c) default cadence** (METRICS.md §5), as the README's step runs it: a
  static flag ``full``, true every ``HEAVY_EVERY`` = 500 steps (the per-layer
  cadence of METRICS.md §5; activation statistics, 1000 there, ride along),
  so the step is compiled twice. The light step records the global figures
  (``record(clip)``, ``tx.update(..., vitals_layers=False)``) and
  ``moe_metrics``; the heavy step also the per-layer family
  (``vitals_layers=True``), the probes, ``activation_metrics`` and
  ``optimizer_metrics``. Both are timed; (c) is the light step's ratio plus
  1/500 of the heavy step's excess, and its memory that of the larger of the
  two. Beside it, **(c, lax.cond)**: the light step with the recorder's own
  in-graph cadence instead (no ``vitals_layers``: a ``lax.cond`` on the update
  count, per-layer family every 50 updates), what a step without the static
  flag pays.
- **(d) naive**: step (a) that also returns the gradients, then on the host,
  after every step, one separately jitted call per figure (gradient and
  parameter norms, per-layer norms, per-leaf abs-max and RMS, Adam ``nu`` max, a
  second forward pass for the logits, hidden states and attention logits, their
  per-layer statistics, MoE loads), each followed by ``jax.device_get`` -- what
  a hand-rolled logger does.

Each variant is compiled once (``jit(...).lower(...).compile()``, which also
gives XLA's ``memory_analysis()``: temporary and output bytes), run twice to
warm up, then the variants are interleaved step by step (in a fresh random
order each round) and each step is timed to ``block_until_ready``. Reported: median
ms per step, and per variant the median of the per-step ratios against (a)
(paired: the noise of a shared machine hits both sides of a pair alike).

Run: ``python benchmarks/overhead.py [--quick] [--steps N] [--configs small,moe]
[--breakdown]``. ``--breakdown`` adds variants of (b) with one family removed
each (the probes, the attention-logit probe alone, the recorder), to see where
its cost goes. The step runs on JAX's default backend: the
CPU here; on an accelerator, add the bf16 configs ``xl`` and ``xl_moe`` (8k
tokens a step, 189M and 302M parameters; too slow for the CPU), e.g.
``--configs small,moe,xl,xl_moe --min-seconds 6 --max-steps 200``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import jvitals as vitals  # noqa: E402
from jvitals import reference_model as rm  # noqa: E402

MIB = float(1 << 20)
# METRICS.md §5: per-layer gradient norms every 500 steps (activation statistics
# every 1000). (c) runs its heavy step (the recorder's per-layer family, probes,
# activation and optimizer figures) that often, its light step otherwise.
HEAVY_EVERY = 500


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    cfg: rm.ModelConfig
    batch: int
    seq: int


def sizes() -> dict[str, Size]:
    dense = dict(n_kv_heads=2, attention="fused_qkv")
    return {s.name: s for s in (
        Size("small", rm.ModelConfig(vocab=512, d_model=64, n_layers=2, n_heads=4, head_dim=16, d_ff=256,
                                     **dense), batch=8, seq=64),
        Size("medium", rm.ModelConfig(vocab=2048, d_model=128, n_layers=4, n_heads=4, head_dim=32,
                                      d_ff=512, **dense), batch=8, seq=128),
        Size("moe", rm.ModelConfig(vocab=1024, d_model=64, n_layers=2, n_heads=4, head_dim=16, d_ff=256,
                                   attention="mla", q_lora_rank=32, kv_lora_rank=32, attn_gate=True,
                                   moe=True, n_experts=4, top_k=2, d_expert=128, n_mtp=1,
                                   scan_layers=True), batch=8, seq=64),
        Size("large", rm.ModelConfig(vocab=4096, d_model=256, n_layers=4, n_heads=8, head_dim=32,
                                     d_ff=1024, **dense), batch=8, seq=128),
        # For an accelerator (not in the default list: minutes per step on the CPU).
        # bf16 compute, a 32k vocabulary and 8k tokens per step.
        Size("xl", rm.ModelConfig(vocab=32768, d_model=1024, n_layers=8, n_heads=16, head_dim=64,
                                  d_ff=4096, n_kv_heads=4, attention="fused_qkv", dtype=jnp.bfloat16),
             batch=8, seq=1024),
        Size("xl_moe", rm.ModelConfig(vocab=32768, d_model=1024, n_layers=8, n_heads=16, head_dim=64,
                                      d_ff=4096, attention="mla", q_lora_rank=512, kv_lora_rank=256,
                                      attn_gate=True, moe=True, n_experts=8, top_k=2, d_expert=1024,
                                      n_mtp=1, scan_layers=True, dtype=jnp.bfloat16),
             batch=8, seq=1024),
    )}


# ----------------------------------------------------------------------------------
# The steps.


def base_tx() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


PLACEMENT = {"placement": "clip"}  # set by --placement


def recorded_tx(every: dict | None) -> optax.GradientTransformation:
    """The recorder in the chosen placement: ``clip`` (wrapping the clip, first in the
    chain: pre-/post-clip figures) or ``chain`` (wrapping the whole chain, with the
    learning rate: + ``update/*`` every step and per layer, ``opt/learning_rate``)."""
    if PLACEMENT["placement"] == "chain":
        return vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), every=every,
                             schedule=1e-3)
    return optax.chain(vitals.record(optax.clip_by_global_norm(1.0), every=every), optax.adamw(1e-3))


def make_plain_step(cfg: rm.ModelConfig, tx: optax.GradientTransformation, return_grads: bool) -> Callable:
    """(a), and (d)'s device part: no vitals (``return_grads``: also the gradients)."""
    cfg = dataclasses.replace(cfg, use_probes=False)

    def step(state: TrainState, batch: dict):
        def loss_of(params):
            loss, inter = rm.loss_fn(params, batch, cfg)
            # Only the MoE loads leave the loss (for balancing); the raw sown
            # tensors are dead and XLA removes them.
            return loss, (_counts(inter) if cfg.moe else {})

        (loss, counts), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if cfg.moe:
            params = rm.update_expert_bias(params, counts, rate=1e-3)
        new = TrainState(state.step + 1, params, opt_state)
        return (new, loss, grads) if return_grads else (new, loss)

    return step


def _counts(inter: Any) -> dict:
    """The ``expert_counts`` entries of a sown tree, keeping their module paths."""
    flat = jax.tree_util.tree_flatten_with_path(inter)[0]
    out = {}
    for p, v in flat:
        s = jax.tree_util.keystr(p, simple=True, separator="/")
        if "expert_counts" in s:
            out[s] = v
    # update_expert_bias matches ".../moe/expert_counts(/i)" paths of a nested dict.
    nested: dict = {}
    for s, v in out.items():
        d = nested
        parts = s.split("/")
        for part in parts[:-1]:
            d = d.setdefault(part, {})
        d[parts[-1]] = v
    return nested


def make_vitals_step(cfg: rm.ModelConfig, tx: optax.GradientTransformation, *, probes: bool = True,
                     attn_probe: bool = True, optimizer: bool = True, layers: bool | None = None) -> Callable:
    """(b) and (c)'s two steps: the recorder's figures and MoE metrics, one metrics dict out.

    ``probes``: the model's activation probes and ``activation_metrics``;
    ``attn_probe``: the attention-logit probe among them; ``optimizer``:
    ``optimizer_metrics``; ``layers``: passed to the recorder as
    ``vitals_layers`` (None: not passed, its ``every`` cadence decides). (c)
    compiles this twice, without and with them (a static flag, as a user's step
    would take it), and calls the second every ``HEAVY_EVERY`` steps;
    ``--breakdown`` turns them off one at a time in (b).
    """
    cfg = dataclasses.replace(cfg, use_probes=probes, sow_attn_logits=cfg.sow_attn_logits and attn_probe)

    def step(state: TrainState, batch: dict):
        (loss, inter), grads = jax.value_and_grad(rm.loss_fn, has_aux=True)(state.params, batch, cfg)
        extra = {} if layers is None else {"vitals_layers": layers}
        updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
        params = optax.apply_updates(state.params, updates)
        if cfg.moe:
            params = rm.update_expert_bias(params, inter, rate=1e-3)
        metrics = {"loss": loss}
        if probes:
            metrics.update(vitals.activation_metrics(inter, mask=batch["mask"], labels=batch["labels"]))
        if cfg.moe:
            metrics.update(vitals.moe_metrics(inter, expert_bias=state.params, top_k=cfg.top_k))
        if optimizer:
            metrics.update(vitals.optimizer_metrics(opt_state))
        # The recorder's figures stay in opt_state (one packed buffer); the host
        # reads them with vitals.recorded(state.opt_state) at its cadence.
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


# ----------------------------------------------------------------------------------
# (d): the hand-rolled logger.


def _leaves(tree: Any) -> list[tuple[str, jax.Array]]:
    return [(jax.tree_util.keystr(p, simple=True, separator="/"), x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


class NaiveLogger:
    """Every figure of (b) as its own jitted call and ``device_get``, after the step."""

    def __init__(self, cfg: rm.ModelConfig):
        self.cfg = dataclasses.replace(cfg, use_probes=False)
        cfg_raw = self.cfg
        self.norm = jax.jit(optax.tree.norm)
        self.nonfinite = jax.jit(lambda t: sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(t)))
        self.abs_max = jax.jit(lambda x: jnp.max(jnp.abs(x)))
        self.rms = jax.jit(lambda x: jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))
        self.stacked_norm = jax.jit(lambda t, i: optax.tree.norm(jax.tree.map(lambda x: x[i], t)))
        self.stacked_abs_max = jax.jit(lambda x, i: jnp.max(jnp.abs(x[i])))
        self.stacked_rms = jax.jit(lambda x, i: jnp.sqrt(jnp.mean(jnp.square(x[i]))))
        self.nu_max = jax.jit(lambda nu: jnp.max(jnp.stack([jnp.max(x) for x in jax.tree.leaves(nu)])))

        def forward(params, batch):
            (logits, mtp), st = rm.Decoder(cfg_raw).apply(
                {"params": params}, batch["tokens"], mask=batch["mask"], return_mtp=True,
                mutable=["intermediates"])
            return logits, mtp, st["intermediates"]

        self.forward = jax.jit(forward)
        self.masked_rms = jax.jit(lambda x, m: jnp.sqrt(
            jnp.sum(jnp.where(m[..., None], jnp.square(x), 0.0)) / (jnp.sum(m) * x.shape[-1])))
        self.masked_abs_max = jax.jit(lambda x, m: jnp.max(jnp.where(m[..., None], jnp.abs(x), 0.0)))
        self.lse_mean = jax.jit(lambda x, m: jnp.sum(jnp.where(m, jax.nn.logsumexp(x, -1), 0.0)) / jnp.sum(m))
        self.top2_diff = jax.jit(self._top2)
        self.accuracy = jax.jit(lambda x, y, m: jnp.sum((jnp.argmax(x, -1) == y) & m) / jnp.sum(m))

    @staticmethod
    def _top2(x: jax.Array, m: jax.Array) -> jax.Array:
        top1 = jnp.max(x, -1, keepdims=True)
        top2 = jnp.max(jnp.where(x < top1, x, -jnp.inf), -1)
        return jnp.sum(jnp.where(m, top1[..., 0] - top2, 0.0)) / jnp.sum(m)

    def log(self, params: Any, grads: Any, opt_state: Any, batch: dict) -> dict[str, float]:
        get = lambda x: float(jax.device_get(x))  # noqa: E731
        out: dict[str, float] = {}
        out["grad/global_norm"] = get(self.norm(grads))
        out["grad/nonfinite_count"] = get(self.nonfinite(grads))
        out["param/global_norm"] = get(self.norm(params))
        # Per layer: listed layers (layers_i) or one stacked subtree (layers).
        if self.cfg.scan_layers:
            for i in range(self.cfg.n_layers):
                out[f"grad/norm/layer_{i}"] = get(self.stacked_norm(grads["layers"], i))
                out[f"param/norm/layer_{i}"] = get(self.stacked_norm(params["layers"], i))
        else:
            for i in range(self.cfg.n_layers):
                out[f"grad/norm/layer_{i}"] = get(self.norm(grads[f"layers_{i}"]))
                out[f"param/norm/layer_{i}"] = get(self.norm(params[f"layers_{i}"]))
        # Per leaf (role x layer): abs max and RMS.
        for path, g in _leaves(grads):
            if self.cfg.scan_layers and path.startswith("layers/"):
                for i in range(self.cfg.n_layers):
                    out[f"grad/{path}_abs.max/layer_{i}"] = get(self.stacked_abs_max(g, i))
                    out[f"grad/{path}_rms/layer_{i}"] = get(self.stacked_rms(g, i))
            else:
                out[f"grad/{path}_abs.max"] = get(self.abs_max(g))
                out[f"grad/{path}_rms"] = get(self.rms(g))
        nus = [s.nu for s in jax.tree.leaves(opt_state, is_leaf=lambda s: hasattr(s, "nu")) if hasattr(s, "nu")]
        out["opt/adam_nu_abs.max"] = get(self.nu_max(nus))
        # A second forward for the activations.
        mask, labels = batch["mask"], batch["labels"]
        logits, mtp, inter = self.forward(params, batch)
        out["act/output_layer_logits_rms.avg"] = get(self.masked_rms(logits, mask))
        out["act/output_layer_logits_abs.max"] = get(self.masked_abs_max(logits, mask))
        out["act/output_layer_logsumexp.mean"] = get(self.lse_mean(logits, mask))
        out["act/output_layer_logits_top2_diff.avg"] = get(self.top2_diff(logits, mask))
        out["act/lm_head_top1_accuracy"] = get(self.accuracy(logits, labels, mask))
        for k, lk in enumerate(mtp, start=1):
            out[f"act/mtp_{k}_rms"] = get(self.masked_rms(lk, mask))
        for path, x in _leaves(inter):
            name = path.split("/")[-2] if path.split("/")[-1].isdigit() else path.split("/")[-1]
            if name in ("logits", "mtp_logits"):
                continue
            if name == "expert_counts":
                c = np.asarray(jax.device_get(x), np.float64).reshape(-1, x.shape[-1])
                for i, row in enumerate(c):
                    out[f"moe/maxvio/{path}/{i}"] = float(row.max() / max(row.mean(), 1e-9) - 1)
                continue
            layers = range(x.shape[0]) if self.cfg.scan_layers else [None]
            for i in layers:
                xi = x if i is None else x[i]  # (a slice: one more dispatch, as a logger would do)
                if name == "attn_logits":
                    out[f"act/{path}_abs.max/{i}"] = get(self.abs_max(xi))
                else:
                    out[f"act/{path}_rms/{i}"] = get(self.masked_rms(xi, mask))
                    if name == "hidden_states":
                        out[f"act/{path}_abs.max/{i}"] = get(self.masked_abs_max(xi, mask))
        return out


# ----------------------------------------------------------------------------------
# Measuring.


@dataclasses.dataclass
class Variant:
    key: str
    label: str
    run: Callable[[], None]
    temp: int
    out: int
    extra_temp: int = 0  # (d): the temp of its logger's separate forward pass
    compile_s: float = 0.0
    times: list = dataclasses.field(default_factory=list)


def _mem(compiled: Any) -> tuple[int, int]:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes), int(m.output_size_in_bytes)


def build(size: Size, breakdown: bool) -> tuple[list[Variant], float]:
    """Compile every variant of ``size``; returns them and the compile seconds."""
    cfg = size.cfg
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    params = jax.device_put(rm.init_params(cfg, jax.random.key(0)), dev)
    batches = [jax.device_put(rm.make_batch(i, cfg, size.batch, size.seq, pad_fraction=0.1), dev)
               for i in range(4)]
    variants: list[Variant] = []

    def add(key: str, label: str, step_fn: Callable, tx: optax.GradientTransformation,
            post: Callable | None = None) -> None:
        state = jax.device_put(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), dev)
        tc = time.perf_counter()
        compiled = jax.jit(step_fn).lower(state, batches[0]).compile()
        tc = time.perf_counter() - tc
        temp, out = _mem(compiled)
        box = {"state": state, "i": 0, "last": None}

        def run() -> None:
            batch = batches[box["i"] % len(batches)]
            box["i"] += 1
            res = compiled(box["state"], batch)
            if post is None:
                box["state"], box["last"] = res[0], res[1]
                jax.block_until_ready(box["state"])
            else:
                old = box["state"]
                box["state"] = res[0]
                box["last"] = post(old.params, res[2], res[0].opt_state, batch)
                jax.block_until_ready(box["state"])

        variants.append(Variant(key, label, run, temp, out, compile_s=tc))

    tx_a, tx_b, tx_c = base_tx(), recorded_tx({"global": 1, "layers": 1}), recorded_tx(None)
    add("a", "(a) none", make_plain_step(cfg, tx_a, False), tx_a)
    add("b", "(b) all every step", make_vitals_step(cfg, tx_b, optimizer=False), tx_b)
    add("b+", "(b) + optimizer stats", make_vitals_step(cfg, tx_b), tx_b)
    add("c", "(c) default cadence, light",
        make_vitals_step(cfg, tx_c, probes=False, optimizer=False, layers=False), tx_c)
    add("c+", f"(c) default, 1 in {HEAVY_EVERY}", make_vitals_step(cfg, tx_c, layers=True), tx_c)
    add("c~", "(c) light, lax.cond cadence", make_vitals_step(cfg, tx_c, probes=False, optimizer=False), tx_c)
    logger = NaiveLogger(cfg)
    add("d", "(d) naive logger", make_plain_step(cfg, tx_a, True), tx_a, post=logger.log)
    fwd_temp, _ = _mem(logger.forward.lower(params, batches[0]).compile())
    variants[-1].extra_temp = fwd_temp
    if breakdown:
        add("b-attn_probe", "(b) without attn_probe",
            make_vitals_step(cfg, tx_b, attn_probe=False, optimizer=False), tx_b)
        add("b-probes", "(b) without probes", make_vitals_step(cfg, tx_b, probes=False, optimizer=False), tx_b)
        add("b-record", "(b) without record", make_vitals_step(cfg, tx_a, optimizer=False), tx_a)
    for v in variants:  # warm-up: first calls (and (d)'s logger compiles)
        v.run()
        v.run()
    return variants, time.perf_counter() - t0


def measure(variants: list[Variant], steps: int, min_seconds: float, max_steps: int) -> int:
    """Rounds of one step per variant, in a fresh random order each round.

    Not a rotation: rotating keeps the cyclic order, so the same variant always
    runs right after (d)'s host-side logging (which leaves the CPU's caches in
    another state), biasing its ratio by several percent.
    """
    rng = random.Random(0)
    t_start = time.perf_counter()
    n = 0
    while n < steps or (time.perf_counter() - t_start < min_seconds and n < max_steps):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            t0 = time.perf_counter()
            v.run()
            v.times.append(time.perf_counter() - t0)
        n += 1
    return n


def paired_ratio(v: Variant, base: Variant) -> float:
    return statistics.median(x / y for x, y in zip(v.times, base.times))


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="measured steps per variant (at least)")
    ap.add_argument("--min-seconds", type=float, default=60.0,
                    help="keep measuring a config (beyond --steps) for this long")
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--configs", default="small,medium,moe,large",
                    help="comma-separated; also xl and xl_moe (bf16, 8k tokens: for an accelerator)")
    ap.add_argument("--quick", action="store_true", help="smoke run: the small config, 10 steps")
    ap.add_argument("--breakdown", action="store_true", help="also (b) with one family left out at a time")
    ap.add_argument("--placement", choices=("clip", "chain"), default="clip",
                    help="the recorder wraps the clip (chain(record(clip), adamw)) or the whole chain "
                         "(record(chain(clip, adamw), schedule=...): + update and LR figures)")
    args = ap.parse_args(argv)
    PLACEMENT["placement"] = args.placement
    if args.quick:
        args.configs, args.steps, args.min_seconds = "small", 10, 0.0
    table = sizes()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {sorted(table)}")

    print(f"# jvitals overhead: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, python {platform.python_version()}")
    print(f"# load average at start: {load()}; recorder placement: {args.placement}", flush=True)
    rows, details, d_vs_b = [], [], []
    for name in names:
        size = table[name]
        cfg = size.cfg
        variants, t_compile = build(size, args.breakdown)
        n = measure(variants, args.steps, args.min_seconds, args.max_steps)
        by = {v.key: v for v in variants}
        a = by["a"]
        med = {k: statistics.median(v.times) * 1e3 for k, v in by.items()}
        ratio = {k: paired_ratio(v, a) for k, v in by.items()}
        desc = (f"{name}: {'MoE ' if cfg.moe else ''}{cfg.attention}, L{cfg.n_layers} d{cfg.d_model} "
                f"V{cfg.vocab} B{size.batch} T{size.seq}" + (f" MTP{cfg.n_mtp}" if cfg.n_mtp else "")
                + (" scan" if cfg.scan_layers else ""))
        # (c) over a cycle of HEAVY_EVERY steps: the light step but once; its peak
        # memory is that of the larger of its two compiled steps.
        c = ratio["c"] + (ratio["c+"] - ratio["c"]) / HEAVY_EVERY
        rows.append((desc, med["a"], ratio["b"], ratio["b+"], c, ratio["c+"], ratio["c~"], ratio["d"],
                     by["b"].temp / a.temp, by["b+"].temp / a.temp, max(by["c"].temp, by["c+"].temp) / a.temp))
        d_vs_b.append((name, med["d"] / med["b+"], ratio["d"] / ratio["b+"]))
        details.append((desc, n, t_compile, load(), by, med, ratio))
        print(f"# {desc}: {n} measured steps/variant, compile+warm-up {t_compile:.0f} s, load {load()}",
              flush=True)
        for v in variants:
            print(f"#   {v.label:<26} median {med[v.key]:9.2f} ms  paired ratio {ratio[v.key]:6.3f}  "
                  f"(ratio of medians {med[v.key] / med['a']:6.3f})  temp {v.temp / MIB:8.2f} MiB  "
                  f"out {v.out / MIB:7.2f} MiB  compile {v.compile_s:5.1f} s" + (f"  + separate forward temp {v.extra_temp / MIB:.2f} MiB"
                                                   if v.extra_temp else ""), flush=True)

    print()
    print(f"| config | step (a) ms | (b)/(a) | (b) + optimizer stats | (c)/(a) | (c) heavy step, 1 in "
          f"{HEAVY_EVERY} | (c) light, lax.cond cadence | (d)/(a) | temp mem (b)/(a) | temp mem (b) + opt "
          "| temp mem (c)/(a) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for desc, ms, rb, rbo, rc, rch, rcc, rd, mb, mbo, mc in rows:
        print(f"| {desc} | {ms:.1f} | {rb:.3f} | {rbo:.3f} | {rc:.3f} | {rch:.3f} | {rcc:.3f} | {rd:.2f} "
              f"| {mb:.3f} | {mbo:.3f} | {mc:.3f} |")
    print()
    print("Ratios: median over steps of (variant step time / (a) step time of the same round). "
          "(c): its light step, and its heavy step once every "
          f"{HEAVY_EVERY} (METRICS.md §5). Targets: (b) <= 1.05, (c) <= 1.02, memory <= 1.05.")
    print("(d) vs (b) + optimizer stats, the same figures every step: " + "; ".join(
        f"{name} {r:.1f}x slower" for name, r, _ in d_vs_b) + ".")
    print(f"Load average at the end: {load()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
