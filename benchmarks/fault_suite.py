"""The fault suite: real training streams of the reference model, faults injected, and a scorer.

::

    python benchmarks/fault_suite.py generate --out tests/data/streams     # CPU, ~15-40 min
    python benchmarks/fault_suite.py generate --only lr_x100 --out /tmp/s  # one run
    python benchmarks/fault_suite.py score [--streams tests/data/streams] [--cadence 10 50]

``generate`` trains the reference model (:mod:`jvitals.reference_model`: a dense
2-layer config and the MoE config with MLA, an output gate and an MTP head) on
the CPU with the real recorder, ``vitals.record(optax.clip_by_global_norm(1.0))``
in a chain with ``optax.adamw`` on a warm-up (200 steps) + cosine schedule, and
records EVERY step the figures the step returns (``loss``, the recorder's global
family, ``update/*``, ``opt/learning_rate``, ``moe/*``, ``sys/*`` from a real
:class:`jvitals.StepTimer`) and, every 50 steps, the per-layer and group
families (``grad/norm/layer_i`` ..., ``grad/norm/embedding``, ``lm_head``
likewise), the activation probes and ``val/loss`` (a fixed held-out set of 4
batches). Each fault is a real change to the training from a known step
(:data:`RUNS`); healthy runs are several seeds of both models.

``score`` replays every stream through ``jvitals.Monitor()`` (default policy) at a
host cadence, and feeds the same checks to two baselines a user would otherwise
trust:

- OLMo-core's loss-spike rule: ``loss > mean + 6 sd`` of the last 128 loss values
  checked (at least 16 of them), or a non-finite loss;
- Megatron-LM's rerun state machine (``RerunStateMachine.is_unexpectedly_large``,
  threshold 10): ``|x| >= 10 * max |x|`` over the first 100 values of ``x`` (the
  loss, and the gradient norm as with ``--check-for-large-grads``), or a
  non-finite loss or gradient norm.

The lead over a baseline is ``(baseline step - fault step) / (jvitals step - fault
step)``, jvitals' step being its first alert (any level) at or after the fault and
the baseline's its first firing at or after it, each delay floored at one cadence;
a fault the baseline never catches has an infinite lead. The baselines are scored
twice: fed the same checks as the monitor (the table's lead), and fed every step (in
brackets), as they run inside their own trainers. A markdown table (per fault: levels, baselines, leads, the
first alert's top localization item and its departure step, PASS/FAIL) goes to
stdout and ``--table``.

Stream files and their loader: see ``tests/data/streams/README.md`` and
:func:`load_stream` / :func:`replay`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

STREAMS = Path(__file__).resolve().parents[1] / "tests" / "data" / "streams"
FORMAT_VERSION = 1
LEVELS = ("GREEN", "YELLOW", "ORANGE", "RED")

# ----------------------------------------------------------------------------------
# What is generated.

#: The two reference-model configurations (``jvitals.reference_model.ModelConfig`` kwargs):
#: the reference model's default (small dense) size, and the same size as an MoE with MLA, an
#: output gate and an MTP head (scan-stacked), with the activation probes on. Small enough for
#: ~30-60 ms a step on one contended CPU core.
MODELS: dict[str, dict[str, Any]] = {
    "dense": dict(vocab=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                  use_probes=True, sow_attn_logits=False),
    "moe": dict(vocab=128, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=64,
                attention="mla", q_lora_rank=16, kv_lora_rank=16, attn_gate=True,
                moe=True, n_experts=4, top_k=2, d_expert=32, n_mtp=1, scan_layers=True,
                use_probes=True, sow_attn_logits=False),
}
BATCH, SEQ, PAD_FRACTION = 8, 64, 0.1
PEAK_LR, END_LR_FRACTION, WARMUP, WEIGHT_DECAY = 3e-3, 0.1, 200, 0.01
HORIZON = 10_000            # cosine decay length (steps) unless a run says otherwise
LAYERS_EVERY = 50           # per-layer / group / activation families and val/loss
VAL_BATCHES = 4
#: The recorder's every-step family (record.py's "light"); its other figures are fresh only
#: on the steps that compute the heavy family.
RECORDER_GLOBAL = frozenset({"grad/global_norm", "grad/nonfinite_count", "param/global_norm",
                             "grad/global_norm_post_clip", "grad/clip_ratio", "grad/clipped",
                             "update/global_norm", "update/param_ratio", "update/nonfinite_count"})
def _heavy_family(name: str) -> bool:
    """A recorder figure computed only on the steps that compute the heavy family."""
    return name.startswith(("grad/", "param/")) and name not in RECORDER_GLOBAL


FAULT_STEP = 1000           # 200 warm-up + 800: a baseline window exists before every fault


@dataclasses.dataclass(frozen=True)
class Run:
    """One stream to generate.

    Attributes:
      name: file stem (``tests/data/streams/{name}.npz``).
      model: key of :data:`MODELS`.
      seed: parameter init and data seed.
      steps: steps trained.
      fault: fault kind (None: healthy); see :func:`_controls`.
      fault_step: first faulty step.
      group: where the fault is: ``embedding``, ``lm_head``, ``layer_i``, ``router``
        (group-specific: the localization must name it), or ``lr``, ``data``,
        ``throughput`` (global: any group, but its departure must not precede the
        fault by more than 50 steps).
      level: the level the monitor is expected to reach (YELLOW/ORANGE/RED).
      max_delay: steps after ``fault_step`` by which the expected level must be reached.
      horizon: cosine decay length.
      params: fault parameters.
      description: what the fault does, in words.
    """

    name: str
    model: str
    seed: int
    steps: int
    fault: str | None = None
    fault_step: int | None = None
    group: str | None = None
    level: str | None = None
    max_delay: int | None = None
    horizon: int = HORIZON
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)
    description: str = "healthy"


F = FAULT_STEP
RUNS: tuple[Run, ...] = (
    Run("lr_x100", "dense", 11, F + 500, "lr_mult", F, "lr", "RED", 150, params={"mult": 100.0},
        description="every update x100 from the fault step on (an LR blow-up the logged schedule does not show)"),
    Run("lr_x1000_once", "dense", 12, F + 500, "lr_once", F, "lr", "RED", 150, params={"mult": 1000.0},
        description="one update x1000 at the fault step, then the normal LR"),
    Run("nan_batch", "dense", 13, F + 300, "nan_batch", F, "data", "ORANGE", 10,
        description="one batch whose loss weight is NaN: NaN gradients reach the params"),
    Run("corrupt_data", "dense", 14, F + 500, "corrupt", F, "data", "ORANGE", 100, params={"length": 60},
        description="60 batches of uniformly random tokens and labels"),
    Run("emb_lr_x30", "dense", 15, F + 1500, "emb_lr", F, "embedding", "YELLOW", 800, params={"mult": 30.0},
        description="the embedding's updates x30 (a per-group LR mismatch)"),
    Run("emb_wd_creep", "dense", 16, F + 1500, "emb_growth", F, "embedding", "YELLOW", 800,
        params={"rate": 2e-3, "ramp": 1000},
        description="negative weight decay creeping in on the embedding: emb *= 1 + r(t), r ramping 0 -> 2e-3 over 1000 steps"),
    Run("periodic_shocks", "dense", 17, F + 800, "periodic", F, "data", "YELLOW", 600, params={"period": 150},
        description="a batch of random tokens and labels every 150 steps"),
    Run("overfit", "dense", 18, F + 1000, "overfit", F, "data", "YELLOW", 900, params={"n_batches": 2},
        description="training on 2 repeated batches from the fault step: val loss rises while train loss falls"),
    Run("throughput_drop", "dense", 19, F + 300, "sleep", F, "throughput", "YELLOW", 100, params={"factor": 1.5},
        description="a slow loader: ~1.5x the step's measured CPU time of extra host work in every step"),
    Run("logit_drift", "dense", 20, F + 1500, "head_growth", F, "lm_head", "YELLOW", 800,
        params={"rate": 2e-3},
        description="the LM head's kernel scaled by 1.002 per step (logits drift up)"),
    Run("router_collapse", "moe", 21, F + 700, "bias_push", F, "router", "YELLOW", 500,
        params={"rate": 0.01, "experts": 2},
        description="the expert-selection bias of experts 0 and 1 pushed up 0.01 per step: the other experts starve"),
    # Healthy runs, one per model (8,000 steps; with the 11,000 steps before the faults,
    # 19,000 healthy steps). On this shared 2-core machine (load ~20) that is what generation
    # could afford (steps took 0.3-0.6 s); EXTRA_RUNS are defined (one decays fully) but not
    # cached: `generate --only healthy_dense_s1`.
    Run("healthy_dense_s0", "dense", 100, 4000),
    Run("healthy_moe_s0", "moe", 200, 4000),
)
#: Defined, not in the cached suite (CPU time): more seeds, a fully decaying schedule.
EXTRA_RUNS: tuple[Run, ...] = (
    Run("healthy_dense_s2", "dense", 102, 4000),
    Run("healthy_dense_s1", "dense", 101, 4000, horizon=4000),
    Run("healthy_moe_s1", "moe", 201, 4000, horizon=4000),
)


def run_by_name(name: str) -> Run:
    for r in RUNS + EXTRA_RUNS:
        if r.name == name:
            return r
    raise KeyError(f"no run {name!r}; known: {[r.name for r in RUNS]}")


# ----------------------------------------------------------------------------------
# Metric name -> group (localization scoring).

_LAYER = re.compile(r"/layer_(\d+)$")


def group_of(metric: str | None) -> str:
    """The group a metric name belongs to: ``embedding``, ``lm_head``, ``layer_i``,
    ``router``, ``throughput``, ``data`` (loss, val), ``global`` (global norms, LR) or
    ``none`` (no metric)."""
    if not metric:
        return "none"
    if metric.startswith("moe/") or "router" in metric or "expert" in metric:
        return "router"
    if metric.endswith("/embedding") or "word_embeddings" in metric:
        return "embedding"
    if metric.endswith("/lm_head") or "output_layer" in metric:
        return "lm_head"
    m = _LAYER.search(metric)
    if m:
        return f"layer_{m.group(1)}"
    if metric.startswith("sys/"):
        return "throughput"
    if metric in ("loss", "ppl") or metric.startswith("val/"):
        return "data"
    return "global"


# ----------------------------------------------------------------------------------
# Stream files.


@dataclasses.dataclass
class Stream:
    """One recorded run.

    Attributes:
      meta: the run's metadata (``Run`` fields, model config, vocab, ...).
      steps: number of steps recorded (0 .. steps-1).
      series: ``{name: (step indices int32 [k], values float64 [k])}``.
    """

    meta: dict[str, Any]
    steps: int
    series: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def name(self) -> str:
        return self.meta["name"]

    def dense(self, name: str) -> np.ndarray:
        """``name`` as a length-``steps`` array, NaN where not recorded."""
        idx, v = self.series[name]
        out = np.full(self.steps, np.nan)
        out[idx] = v
        return out


def save_stream(path: Path, meta: Mapping[str, Any], rows: Sequence[Mapping[str, float]]) -> None:
    """Write one stream: ``rows[s]`` holds the figures recorded at step ``s``.

    Names sharing the same set of steps are stored together as one float32 matrix
    (``g{j}_steps`` int32 [k], ``g{j}_names``, ``g{j}_values`` [n, k]);
    ``meta`` is JSON in ``meta``.
    """
    by_name: dict[str, list[tuple[int, float]]] = {}
    for s, row in enumerate(rows):
        for k, v in row.items():
            by_name.setdefault(k, []).append((s, float(v)))
    groups: dict[tuple[int, ...], list[str]] = {}
    for k, pts in by_name.items():
        groups.setdefault(tuple(p[0] for p in pts), []).append(k)
    arrays: dict[str, np.ndarray] = {
        "meta": np.asarray(json.dumps(dict(meta, format_version=FORMAT_VERSION, steps=len(rows)), sort_keys=True))}
    for j, (steps, names) in enumerate(sorted(groups.items(), key=lambda kv: (-len(kv[0]), kv[1][0]))):
        names = sorted(names)
        arrays[f"g{j}_steps"] = np.asarray(steps, np.int32)
        arrays[f"g{j}_names"] = np.asarray(names)
        arrays[f"g{j}_values"] = np.asarray([[p[1] for p in by_name[n]] for n in names], np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_stream(path: str | Path) -> Stream:
    """Read a stream written by :func:`save_stream` (``.npz``)."""
    path = Path(path)
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: stream format {meta.get('format_version')!r}, this loader reads "
                             f"{FORMAT_VERSION}; regenerate with `python benchmarks/fault_suite.py generate`")
        series: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        j = 0
        while f"g{j}_steps" in z:
            idx = z[f"g{j}_steps"].astype(np.int64)
            vals = z[f"g{j}_values"].astype(np.float64)
            for n, v in zip(z[f"g{j}_names"].tolist(), vals):
                series[str(n)] = (idx, v)
            j += 1
    return Stream(meta=meta, steps=int(meta["steps"]), series=series)


def load_streams(directory: str | Path = STREAMS, names: Sequence[str] | None = None) -> list[Stream]:
    """Every ``*.npz`` stream in ``directory`` (sorted by name), or only ``names``."""
    directory = Path(directory)
    paths = sorted(directory.glob("*.npz")) if names is None else [directory / f"{n}.npz" for n in names]
    return [load_stream(p) for p in paths if not p.name.endswith(".tmp.npz")]


_RATE = ("sys/steps_per_sec", "sys/tokens_per_sec")


def replay(stream: Stream, cadence: int = 10, *, stale: bool = False) -> Iterator[tuple[int, dict[str, float]]]:
    """The host's view of the run at a cadence: ``(step, metrics)`` at steps
    ``0, cadence, 2*cadence, ...`` (and the last step).

    Every-step figures are the step's own. Figures recorded every 50 steps (per
    layer, group, activations, ``val/loss``) appear at the checks that fall on a step
    where they were computed (``stale=True``: at every check after their first
    computation, with the latest value, as ``vitals.recorded`` returns them on light
    steps). ``sys/steps_per_sec`` and ``sys/tokens_per_sec`` are what a
    :class:`jvitals.StepTimer` read at this cadence returns: the rate over the steps
    since the previous check (``n / sum(1 / rate_i)`` of the per-step rates the
    generator's timer measured), absent at the first check.
    """
    names = list(stream.series)
    pos = {n: 0 for n in names}
    last_val: dict[str, float] = {}
    rate = {n: stream.dense(n) for n in _RATE if n in stream.series}
    prev = None
    checks = list(range(0, stream.steps, cadence))
    if checks[-1] != stream.steps - 1:
        checks.append(stream.steps - 1)
    for s in checks:
        out: dict[str, float] = {}
        for n in names:
            if n in rate:
                continue
            idx, v = stream.series[n]
            p = pos[n]
            while p < len(idx) and idx[p] <= s:
                last_val[n] = v[p]
                p += 1
            pos[n] = p
            if p and idx[p - 1] == s:
                out[n] = float(v[p - 1])
            elif stale and n in last_val:
                out[n] = float(last_val[n])
        if prev is not None:
            for n, r in rate.items():
                w = r[prev + 1: s + 1]
                w = w[np.isfinite(w) & (w > 0)]
                if len(w):
                    out[n] = float(len(w) / np.sum(1.0 / w))
        prev = s
        yield s, out


# ----------------------------------------------------------------------------------
# Generation (imports JAX lazily: the scorer and the tests need only NumPy).


def _controls(run: Run, step: int) -> dict[str, float]:
    """Per-step fault controls (the jitted step's float inputs) and host-side flags."""
    c = dict(lr_mult=1.0, emb_mult=1.0, emb_growth=0.0, head_growth=0.0, bias_push=0.0, loss_weight=1.0)
    host = dict(corrupt=False, overfit=False, sleep=False)
    f, p = run.fault, run.params
    if f is None or step < run.fault_step:
        return {**c, **host}
    t = step - run.fault_step
    if f == "lr_mult":
        c["lr_mult"] = p["mult"]
    elif f == "lr_once":
        c["lr_mult"] = p["mult"] if t == 0 else 1.0
    elif f == "nan_batch":
        c["loss_weight"] = float("nan") if t == 0 else 1.0
    elif f == "corrupt":
        host["corrupt"] = t < p["length"]
    elif f == "periodic":
        host["corrupt"] = t % int(p["period"]) == 0
    elif f == "overfit":
        host["overfit"] = True
    elif f == "sleep":
        host["sleep"] = True
    elif f == "emb_lr":
        c["emb_mult"] = p["mult"]
    elif f == "emb_growth":
        c["emb_growth"] = p["rate"] * min(1.0, (t + 1) / p["ramp"])
    elif f == "head_growth":
        c["head_growth"] = p["rate"]
    elif f == "bias_push":
        c["bias_push"] = p["rate"]
    else:
        raise ValueError(f"unknown fault {f!r} in run {run.name}")
    return {**c, **host}


def _group_figures(grads: Any, params: Any, updates: Any, n_layers: int) -> dict[str, Any]:
    """STOPGAP (until the recorder/gradient_metrics emit them): the group figures.

    For each group ``g`` in ``embedding`` (``embed/...``), ``lm_head`` (``lm_head/...``)
    and ``layer_i`` (``layers_i/...``, or slice ``i`` of the scan-stacked ``layers/...``):
    ``grad/norm/g = ||grad_g||``, ``grad/share/g = ||grad_g||^2 / ||grad||^2``,
    ``param/norm/g = ||p_g||``, ``update/param_ratio/g = ||u_g|| / ||p_g||``; grads are
    the pre-clip gradients, ``u`` the final updates, ``p`` the params they apply to.
    """
    import jax
    import jax.numpy as jnp

    def sums(tree):
        out: dict[str, Any] = {}
        total = jnp.zeros((), jnp.float32)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            ps = jax.tree_util.keystr(path, simple=True, separator="/")
            x = jnp.asarray(x, jnp.float32)
            total = total + jnp.sum(x * x)
            head = ps.split("/")[0]
            if head == "embed":
                out["embedding"] = out.get("embedding", 0.0) + jnp.sum(x * x)
            elif head == "lm_head":
                out["lm_head"] = out.get("lm_head", 0.0) + jnp.sum(x * x)
            elif head == "layers":       # scan-stacked: leading axis = layer
                per = jnp.sum(x * x, axis=tuple(range(1, x.ndim)))
                for i in range(n_layers):
                    out[f"layer_{i}"] = out.get(f"layer_{i}", 0.0) + per[i]
            elif head.startswith("layers_"):
                k = f"layer_{int(head.split('_')[1])}"
                out[k] = out.get(k, 0.0) + jnp.sum(x * x)
        return out, total

    g, gt = sums(grads)
    p, _ = sums(params)
    u, _ = sums(updates)
    out = {}
    for k in g:
        out[f"grad/norm/{k}"] = jnp.sqrt(g[k])
        out[f"grad/share/{k}"] = g[k] / gt
        out[f"param/norm/{k}"] = jnp.sqrt(p[k])
        out[f"update/param_ratio/{k}"] = jnp.sqrt(u[k]) / jnp.sqrt(p[k])
    return out


_TRAINERS: dict[tuple[str, int], Any] = {}


def _trainer(model: str, horizon: int) -> Any:
    """The jitted step, the val loss and the optimizer for one (model, schedule): built once per
    process and shared by every run with the same key (no recompilation between runs)."""
    key = (model, horizon)
    if key in _TRAINERS:
        return _TRAINERS[key]
    import functools
    import types

    import jax
    import jax.numpy as jnp
    import optax

    import jvitals as vitals
    from jvitals import reference_model as rm

    cfg = rm.ModelConfig(**MODELS[model])
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, warmup_steps=WARMUP, decay_steps=horizon,
                                                  end_value=PEAK_LR * END_LR_FRACTION)
    tx = vitals.with_lr_scale(optax.chain(
        vitals.record(optax.clip_by_global_norm(1.0)),
        optax.adamw(schedule, weight_decay=WEIGHT_DECAY),
    ))

    def is_moe_bias(path):
        return jax.tree_util.keystr(path, simple=True, separator="/").endswith("moe/expert_bias")

    @functools.partial(jax.jit, static_argnames="full")
    def train_step(params, opt_state, batch, ctl, full):
        def loss_of(p):
            loss, inter = rm.loss_fn(p, batch, cfg)
            return loss * ctl["loss_weight"], inter

        (loss, inter), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params, vitals_heavy=full)
        # The faults' update multipliers: global (an LR the logged schedule does not show) and
        # the embedding's (a per-group LR).
        updates = {k: jax.tree.map(lambda u: u * ctl["lr_mult"] * (ctl["emb_mult"] if k == "embed" else 1.0), v)
                   for k, v in updates.items()}
        new = optax.apply_updates(params, updates)
        # Multiplicative growth (negative weight decay) of the embedding / the LM head.
        new = dict(new, embed=jax.tree.map(lambda w: w * (1.0 + ctl["emb_growth"]), new["embed"]),
                   lm_head=jax.tree.map(lambda w: w * (1.0 + ctl["head_growth"]), new["lm_head"]))
        metrics = {"loss": loss, **vitals.recorded(opt_state),
                   **{k: v for k, v in vitals.update_metrics(updates, params).items()
                      if k != "update/nonfinite_count"}}
        if cfg.moe:
            new = rm.update_expert_bias(new, inter, rate=1e-3)       # aux-loss-free balancing
            new = jax.tree_util.tree_map_with_path(                    # the router fault's push
                lambda p, w: w + jnp.broadcast_to(ctl["bias_push"], w.shape) if is_moe_bias(p) else w, new)
            metrics |= vitals.moe_metrics(inter, expert_bias=params, top_k=cfg.top_k)
        if full:
            metrics |= vitals.activation_metrics(inter, mask=batch["mask"], labels=batch["labels"])
            metrics |= {k: v for k, v in _group_figures(grads, params, updates, cfg.n_layers).items()
                        if k not in metrics}   # the recorder's own, where it emits them
        return new, opt_state, metrics

    @jax.jit
    def val_loss(params, batches):
        losses = [rm.cross_entropy(rm.Decoder(cfg).apply({"params": params}, b["tokens"], mask=b["mask"]),
                                   b["labels"], b["mask"]) for b in batches]
        return sum(losses) / len(losses)

    t = types.SimpleNamespace(cfg=cfg, schedule=schedule, tx=tx, train_step=train_step, val_loss=val_loss)
    _TRAINERS[key] = t
    return t


def _busy(seconds: float) -> None:
    """Spend ``seconds`` of this process's CPU time on host work (NumPy matrix products)."""
    a = np.random.default_rng(0).standard_normal((64, 64))
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        a = np.tanh(a @ a.T * 1e-2)


def generate_run(run: Run, out_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Train ``run`` and write ``out_dir/{run.name}.npz``; returns the path."""
    import jax
    import jax.numpy as jnp

    import jvitals as vitals
    from jvitals import reference_model as rm

    tr = _trainer(run.model, run.horizon)
    cfg = tr.cfg
    params = rm.init_params(cfg, jax.random.key(run.seed))
    opt_state = tr.tx.init(params)
    push = np.zeros(cfg.n_experts, np.float32)
    push[: int(run.params.get("experts", 0))] = 1.0

    val_batches = [rm.make_batch(10_000_000 + 7919 * run.seed + i, cfg, BATCH, SEQ, pad_fraction=PAD_FRACTION)
                   for i in range(VAL_BATCHES)]

    def batch_at(step: int, host: Mapping[str, bool]) -> dict:
        pos = step
        if host["overfit"]:
            pos = run.fault_step + (step - run.fault_step) % int(run.params["n_batches"])
        b = rm.make_batch(1_000_003 * run.seed + pos, cfg, BATCH, SEQ, pad_fraction=PAD_FRACTION)
        if host["corrupt"]:
            rng = np.random.default_rng(99_000 + 31 * run.seed + step)
            m = np.asarray(b["mask"])
            b = dict(b, tokens=jnp.asarray(np.where(m, rng.integers(2, cfg.vocab, m.shape), cfg.pad_id), jnp.int32),
                     labels=jnp.asarray(np.where(m, rng.integers(2, cfg.vocab, m.shape), cfg.pad_id), jnp.int32))
        return b

    # Throughput on the process's CPU clock: on a CPU shared by other jobs, wall time per step
    # swings 10x with the neighbours' load (seen: 3 to 48 steps/s), which says nothing about this
    # run; the CPU time the process spends per step does not. XLA runs single-threaded (see
    # cmd_generate), so the CPU time is the step's work. The throughput fault is real host work
    # (a slow loader), which this clock sees.
    timer = vitals.StepTimer(tokens_per_step=BATCH * SEQ, clock=time.process_time)
    rows: list[dict[str, float]] = []
    step_times: list[float] = []
    cpu_times: list[float] = []
    sleep_s = 0.0
    t0 = time.perf_counter()
    recorder_has_lr = None
    for step in range(run.steps):
        ctl = _controls(run, step)
        host = {k: ctl.pop(k) for k in ("corrupt", "overfit", "sleep")}
        if host["sleep"] and sleep_s == 0.0:
            base = cpu_times[-300:] if cpu_times else [0.02]
            sleep_s = float(np.median(base)) * float(run.params["factor"])
            log(f"  {run.name}: {sleep_s * 1e3:.1f} ms of extra host work per step from step {step}")
        full = step % LAYERS_EVERY == 0
        batch = batch_at(step, host)
        dev_ctl = {k: jnp.float32(v) for k, v in ctl.items()}
        dev_ctl["bias_push"] = jnp.asarray(push * ctl["bias_push"])
        ts, cs = time.perf_counter(), time.process_time()
        params, opt_state, metrics = tr.train_step(params, opt_state, batch, dev_ctl, full)
        if host["sleep"]:
            _busy(sleep_s)   # the throughput fault: a slow loader's extra host work in the loop
        host_m = jax.device_get(metrics)   # this step's host sync
        # On a light step the recorder still returns its heavy family's previous values
        # (stale): keep only what was computed this step.
        row = {k: float(v) for k, v in host_m.items() if full or not _heavy_family(k)}
        step_times.append(time.perf_counter() - ts)
        cpu_times.append(time.process_time() - cs)
        timer.step()
        row.update(timer.metrics())
        if recorder_has_lr is None:
            recorder_has_lr = "opt/learning_rate" in row
        if not recorder_has_lr:   # until the recorder logs it: the schedule x the rollback scale
            row["opt/learning_rate"] = float(tr.schedule(step)) * vitals.get_lr_scale(opt_state)
        if full:
            row["val/loss"] = float(tr.val_loss(params, val_batches))
        rows.append(row)
        if step % 500 == 0:
            log(f"  {run.name} step {step}/{run.steps} loss {row['loss']:.3f} "
                f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.1f} ms/step")
    landed = any("param/norm/embedding" in Path(sys.modules[m].__file__).read_text()
                 for m in ("jvitals.metrics.gradients", "jvitals.metrics.record"))
    meta = dict(
        name=run.name, model=run.model, model_config=dict(MODELS[run.model]),
        seed=run.seed, fault=run.fault, fault_step=run.fault_step, group=run.group, level=run.level,
        max_delay=run.max_delay, params=dict(run.params), description=run.description,
        vocab=cfg.vocab, log_vocab=math.log(cfg.vocab), batch=BATCH, seq=SEQ, pad_fraction=PAD_FRACTION,
        peak_lr=PEAK_LR, warmup_steps=WARMUP, horizon=run.horizon, weight_decay=WEIGHT_DECAY, clip=1.0,
        layers_every=LAYERS_EVERY, val_every=LAYERS_EVERY, val_batches=VAL_BATCHES, default_cadence=10,
        group_figures="recorder" if landed and "grad/norm/embedding" in rows[0] else "stopgap",
        opt_learning_rate="recorder" if recorder_has_lr else "generator",
        sleep_s=sleep_s, wall_s=time.perf_counter() - t0,
        median_step_ms=float(np.median(step_times)) * 1e3,
        median_step_cpu_ms=float(np.median(cpu_times)) * 1e3, throughput_clock="process_time",
    )
    path = out_dir / f"{run.name}.npz"
    save_stream(path, meta, rows)
    log(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB, {run.steps} steps, "
        f"{meta['median_step_ms']:.1f} ms/step median, {meta['wall_s']:.0f} s)")
    return path


def drop_stale(path: Path) -> bool:
    """Rewrite a stream whose recorder per-layer figures were kept on light steps (stale copies
    of the last computed value): keep them only on the steps that computed them. Returns True
    if the file changed. (Streams generated while the recorder's figures came back as one
    packed vector, whose light-step names the generator's filter did not see.)"""
    st = load_stream(path)
    every = int(st.meta["layers_every"])
    changed = False
    rows: list[dict[str, float]] = [{} for _ in range(st.steps)]
    for n, (idx, v) in st.series.items():
        keep = np.ones(len(idx), bool)
        if _heavy_family(n) and len(idx) == st.steps:
            keep = idx % every == 0
            changed = True
        for i, x in zip(idx[keep], v[keep]):
            rows[int(i)][n] = float(x)
    if changed:
        meta = {k: v for k, v in st.meta.items() if k not in ("format_version", "steps")}
        meta["group_figures"] = "stopgap"   # the generator's figures overrode the recorder's then
        save_stream(Path(path), meta, rows)
    return changed


def cmd_generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # One thread for XLA:CPU: the step's CPU time is then its work (the throughput clock), and
    # on a shared machine one thread was as fast as the thread pool.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    import jax

    if args.cache:   # compiled steps reused across processes and reruns
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    out = Path(args.out)
    runs = [run_by_name(n) for n in args.only] if args.only else list(RUNS)
    if args.fault_step:
        runs = [dataclasses.replace(r, fault_step=args.fault_step) if r.fault else r for r in runs]
    if args.steps:
        runs = [dataclasses.replace(r, steps=args.steps) for r in runs]
    for r in runs:
        if args.skip_existing and (out / f"{r.name}.npz").exists():
            print(f"skip {r.name} (exists)", flush=True)
            continue
        generate_run(r, out, log=lambda s: print(s, flush=True))
    return 0


# ----------------------------------------------------------------------------------
# Baselines.


class OlmoLossSpike:
    """OLMo-core's loss-only rule: ``loss > mean + k sd`` of the last ``window`` loss
    values checked (at least ``min_samples``), or a non-finite loss."""

    def __init__(self, window: int = 128, k: float = 6.0, min_samples: int = 16) -> None:
        self.window, self.k, self.min_samples = window, k, min_samples
        self.values: list[float] = []

    def update(self, step: int, m: Mapping[str, float]) -> bool:
        x = m.get("loss")
        if x is None:
            return False
        if not math.isfinite(x):
            return True
        hit = False
        if len(self.values) >= self.min_samples:
            mu = statistics.fmean(self.values)
            sd = statistics.pstdev(self.values)
            hit = x > mu + self.k * sd
        self.values.append(x)
        del self.values[:-self.window]
        return hit


class MegatronLarge:
    """Megatron-LM's rerun state machine checks: ``|x| >= 10 x max|x|`` over the first
    100 values (``is_unexpectedly_large``, for the loss and the gradient norm), and a
    non-finite loss or gradient norm."""

    def __init__(self, threshold: float = 10.0, num_samples: int = 100,
                 names: Sequence[str] = ("loss", "grad/global_norm")) -> None:
        self.threshold, self.num_samples, self.names = threshold, num_samples, tuple(names)
        self.count = {n: 0 for n in self.names}
        self.max = {n: 0.0 for n in self.names}

    def update(self, step: int, m: Mapping[str, float]) -> bool:
        hit = False
        for n in self.names:
            x = m.get(n)
            if x is None:
                continue
            if not math.isfinite(x):
                hit = True
                continue
            v = abs(x)
            if self.count[n] < self.num_samples:
                self.count[n] += 1
                self.max[n] = max(self.max[n], v)
            elif v >= self.max[n] * self.threshold:
                hit = True
        return hit


# ----------------------------------------------------------------------------------
# Scoring.


@dataclasses.dataclass
class Score:
    """What one replay of one stream found (steps are training steps; None: never)."""

    name: str
    cadence: int
    fault_step: int | None
    first: dict[str, int | None]            # level -> first check at/after the fault at that level or above
    peak: str
    olmo: int | None                        # the baselines fed the same checks as jvitals (first firing
                                            # at/after the fault)
    megatron: int | None
    olmo_every_step: int | None             # ... fed every step, as they run in their own trainers
    megatron_every_step: int | None
    loc_metric: str | None                  # the first post-fault alert's top localization item
    loc_departure: int | None
    loc_group: str
    loc_line: str
    early_departures: list[tuple[str, int]]  # localization items departing > 50 steps before the fault
    pre_fault_alerts: list[tuple[int, str, str, str]]   # (step, peak level, rule, metric) opened before the fault
    alerts: list[tuple[int, str, str, str]]             # every alert: (opening step, peak level, rule, metric)
    update_us: float


def _level_name(level: Any) -> str:
    return getattr(level, "name", str(level))


def score_stream(stream: Stream, cadence: int = 10, monitor_factory: Callable[[], Any] | None = None,
                 replay_fn: Callable[[Stream, int], Iterator[tuple[int, dict[str, float]]]] | None = None) -> Score:
    """Replay ``stream`` through a fresh ``jvitals.Monitor()`` and the two baselines
    (``replay_fn``: how the host sees the stream, default :func:`replay`; the baselines
    read only the loss and the grad norm of the check's own step)."""
    if monitor_factory is None:
        from jvitals.monitor.monitor import Monitor

        monitor_factory = Monitor
    mon = monitor_factory()
    olmo, mega = OlmoLossSpike(), MegatronLarge()
    fs = stream.meta.get("fault_step")
    first: dict[str, int | None] = {lv: None for lv in LEVELS[1:]}
    peak = 0
    o_step = m_step = None
    loc: tuple[str | None, int | None, str] = (None, None, "")
    loc_set = False
    early: list[tuple[str, int]] = []
    pre: list[tuple[int, str, str, str]] = []
    opened: list[tuple[int, str, str, str]] = []
    seen_levels: dict[int, int] = {}
    where: dict[int, tuple[int, int | None]] = {}
    cost = 0.0
    n = 0
    for s, m in (replay_fn or replay)(stream, cadence):
        t = time.perf_counter()
        v = mon.update(s, m)
        cost += time.perf_counter() - t
        n += 1
        lv = int(v.level)
        peak = max(peak, lv)
        after = fs is None or s >= fs      # steps before the fault are false alarms, not detections
        for i in range(1, lv + 1):
            if after and first[LEVELS[i]] is None:
                first[LEVELS[i]] = s
        # The baselines see every check (their state needs it); their detection is the first
        # firing at or after the fault.
        if olmo.update(s, m) and after and o_step is None:
            o_step = s
        if mega.update(s, m) and after and m_step is None:
            m_step = s
        # Every alert at every level it reaches: its localization (if any) is judged.
        for a in v.alerts:
            key = getattr(a, "id", id(a))
            alv = int(a.level)
            if seen_levels.get(key, 0) >= alv:
                continue
            new = key not in seen_levels
            seen_levels[key] = alv
            rec = (s, _level_name(a.level), str(getattr(a, "rule", "")), str(getattr(a, "metric", "")))
            if new:
                where[key] = (len(opened), len(pre) if fs is not None and s < fs else None)
                opened.append(rec)
                if fs is not None and s < fs:
                    pre.append(rec)
            else:   # escalated: the alert is recorded at its opening step with its peak level
                i, j = where[key]
                opened[i] = (opened[i][0], rec[1], *opened[i][2:])
                if j is not None:
                    pre[j] = (pre[j][0], rec[1], *pre[j][2:])
            if fs is not None and s < fs:
                continue
            locs = list(getattr(a, "localization", []) or [])
            for item in locs:
                d = getattr(item, "departure_step", None)
                if fs is not None and d is not None and d < fs - 50:
                    early.append((item.metric, int(d)))
            if not loc_set:
                loc_set = True
                if locs:
                    loc = (locs[0].metric, int(locs[0].departure_step), getattr(locs[0], "line", ""))
                else:
                    loc = (None, None, "no earlier sign found")
    o_every, m_every = _baselines_every_step(stream)
    return Score(name=stream.name, cadence=cadence, fault_step=fs, first=first, peak=LEVELS[peak],
                 olmo=o_step, megatron=m_step, olmo_every_step=o_every, megatron_every_step=m_every, loc_metric=loc[0], loc_departure=loc[1],
                 loc_group=group_of(loc[0]), loc_line=loc[2], early_departures=early,
                 pre_fault_alerts=pre, alerts=opened, update_us=cost / max(n, 1) * 1e6)


def _baselines_every_step(stream: Stream) -> tuple[int | None, int | None]:
    """First step OLMo-core's and Megatron's rules fire when fed every step's figures."""
    loss, gn = stream.dense("loss"), stream.dense("grad/global_norm")
    olmo, mega = OlmoLossSpike(), MegatronLarge()
    o = m = None
    f = stream.meta.get("fault_step") or 0
    for s in range(stream.steps):
        fig = {"loss": float(loss[s]), "grad/global_norm": float(gn[s])}
        if olmo.update(s, fig) and o is None and s >= f:
            o = s
        if mega.update(s, fig) and m is None and s >= f:
            m = s
        if o is not None and m is not None:
            break
    return o, m


def lead(baseline_step: int | None, jv_step: int | None, fault_step: int, cadence: int) -> float:
    """``baseline delay / jvitals delay``, delays from the fault floored at one cadence;
    inf when only jvitals caught it, 0 when jvitals did not, NaN when neither."""
    if jv_step is None:
        return float("nan") if baseline_step is None else 0.0
    if baseline_step is None:
        return float("inf")
    return max(baseline_step - fault_step, cadence) / max(jv_step - fault_step, cadence)


def judge(stream: Stream, sc: Score) -> tuple[bool, list[str]]:
    """PASS/FAIL of one fault stream against the acceptance criteria, with the reasons."""
    meta = stream.meta
    why: list[str] = []
    fs, want = meta["fault_step"], meta["level"]
    got = sc.first.get(want)
    if got is None:
        why.append(f"never reached {want} after the fault (peak {sc.peak})")
    elif meta.get("max_delay") is not None and got - fs > meta["max_delay"]:
        why.append(f"{want} {got - fs} steps after the fault (> {meta['max_delay']})")
    if sc.pre_fault_alerts:
        why.append(f"{len(sc.pre_fault_alerts)} alert(s) before the fault")
    g = meta["group"]
    if g not in ("lr", "data", "throughput"):
        if sc.loc_group != g:
            why.append(f"localization names {sc.loc_group} ({sc.loc_metric}), not {g}")
    if sc.early_departures:
        m, d = sc.early_departures[0]
        why.append(f"{len(sc.early_departures)} localization item(s) departing > 50 steps before the fault "
                   f"(e.g. {m} at {d})")
    return not why, why


def _fmt(x: int | None) -> str:
    return "-" if x is None else str(x)


def _fmt_lead(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "inf" if math.isinf(x) else f"{x:.1f}x"


def score_all(streams: Sequence[Stream], cadence: int) -> tuple[str, bool, dict[str, Any]]:
    """The markdown table for one cadence, overall PASS, and the numbers behind it."""
    faults = [s for s in streams if s.meta.get("fault")]
    healthy = [s for s in streams if not s.meta.get("fault")]
    lines = [f"### Host cadence {cadence}", "",
             "| fault | group | expected | jvitals Y / O / R | OLMo-core (every step) | Megatron (every step) "
             "| lead vs OLMo (every step) | lead vs Megatron | localization (top item, departure) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    leads: list[float] = []
    leads_every: list[float] = []
    ok_all = True
    numbers: dict[str, Any] = {"faults": {}, "healthy": {}}
    for st in faults:
        sc = score_stream(st, cadence)
        fs = st.meta["fault_step"]
        want = st.meta["level"]
        jv = sc.first["YELLOW"]            # detection: the first alert of any level after the fault
        lo, lm = lead(sc.olmo, jv, fs, cadence), lead(sc.megatron, jv, fs, cadence)
        leads.append(lo)
        ok, why = judge(st, sc)
        ok_all &= ok
        ylr = " / ".join(_fmt(sc.first[l]) for l in LEVELS[1:])
        loc = "no earlier sign found" if sc.loc_metric is None and sc.loc_line else (
            f"`{sc.loc_metric}` ({sc.loc_group}) from {sc.loc_departure}" if sc.loc_metric else "-")
        lo_e = lead(sc.olmo_every_step, jv, fs, cadence)
        leads_every.append(lo_e)
        lines.append(f"| {st.name} (step {fs}) | {st.meta['group']} | {want} | {ylr} | "
                     f"{_fmt(sc.olmo)} ({_fmt(sc.olmo_every_step)}) | "
                     f"{_fmt(sc.megatron)} ({_fmt(sc.megatron_every_step)}) | {_fmt_lead(lo)} ({_fmt_lead(lo_e)}) | "
                     f"{_fmt_lead(lm)} | {loc} | "
                     f"{'PASS' if ok else 'FAIL: ' + '; '.join(why)} |")
        numbers["faults"][st.name] = dict(dataclasses.asdict(sc), lead_olmo=lo, lead_megatron=lm, pass_=ok, why=why)
    finite = [x for x in leads if not math.isnan(x)]
    med = statistics.median(finite) if finite else float("nan")
    lines.append("")
    lead_ok = med >= 1.5
    ok_all &= lead_ok
    fe = [x for x in leads_every if not math.isnan(x)]
    med_e = statistics.median(fe) if fe else float("nan")
    lines.append(f"Median lead over the loss-only rule (OLMo-core, fed the same checks): {_fmt_lead(med)} "
                 f"({'PASS' if lead_ok else 'FAIL'}: needs >= 1.5x); fed every step: {_fmt_lead(med_e)}.")
    total_steps = sum(s.steps for s in healthy)
    ys = os = 0
    hl = []
    for st in healthy:
        sc = score_stream(st, cadence)
        y = sum(1 for a in sc.alerts if a[1] == "YELLOW")
        o = sum(1 for a in sc.alerts if a[1] in ("ORANGE", "RED"))
        ys, os = ys + y, os + o
        hl.append(f"{st.name}: {y} YELLOW, {o} ORANGE/RED" + (
            f" ({', '.join(f'{a[1]} {a[2]}:{a[3]} at {a[0]}' for a in sc.alerts[:4])})" if sc.alerts else ""))
        numbers["healthy"][st.name] = dataclasses.asdict(sc)
    quiet = ys <= max(1, total_steps // 10_000) and os == 0
    ok_all &= quiet
    lines.append(f"Healthy runs ({len(healthy)} streams, {total_steps} steps): {ys} YELLOW, {os} ORANGE/RED "
                 f"({'PASS' if quiet else 'FAIL'}: at most 1 YELLOW per 10,000 steps, no ORANGE/RED).")
    lines += [f"- {h}" for h in hl]
    lines.append("")
    lines.append(f"Overall at cadence {cadence}: {'PASS' if ok_all else 'FAIL'}.")
    numbers.update(median_lead_olmo=med, median_lead_olmo_every_step=med_e, healthy_yellow=ys, healthy_orange_red=os, healthy_steps=total_steps,
                   passed=ok_all)
    return "\n".join(lines), ok_all, numbers


def cmd_score(args: argparse.Namespace) -> int:
    streams = load_streams(args.streams)
    if not streams:
        print(f"no streams in {args.streams}; run `python benchmarks/fault_suite.py generate` first")
        return 2
    out = ["## Fault suite: jvitals vs the loss-only rule", "",
           f"{len(streams)} streams of real training of the reference model (`benchmarks/fault_suite.py`); "
           "steps are training steps; `-` = never.", ""]
    ok = True
    for c in args.cadence:
        text, passed, _ = score_all(streams, c)
        out += [text, ""]
        ok &= passed
    table = "\n".join(out)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")
    return 0 if ok or not args.strict else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="train the runs and write their streams")
    g.add_argument("--out", default=str(STREAMS))
    g.add_argument("--only", nargs="*", help="run names (default: all)")
    g.add_argument("--steps", type=int, default=0, help="override every run's length (debugging)")
    g.add_argument("--skip-existing", action="store_true")
    g.add_argument("--fault-step", type=int, default=0, help="override every fault step (debugging)")
    g.add_argument("--cache", default="", help="JAX persistent compilation cache directory")
    s = sub.add_parser("score", help="replay the streams through the Monitor and the baselines")
    s.add_argument("--streams", default=str(STREAMS))
    s.add_argument("--cadence", type=int, nargs="+", default=[10, 50])
    s.add_argument("--table", default="")
    s.add_argument("--strict", action="store_true", help="exit 1 unless everything passes")
    args = ap.parse_args(argv)
    return cmd_generate(args) if args.cmd == "generate" else cmd_score(args)


if __name__ == "__main__":
    sys.exit(main())
