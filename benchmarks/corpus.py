"""The calibration corpus (issue 27): real training streams of several models, data,
optimizers and schedules, healthy and faulty, split into a TUNING and a HELD-OUT part.

::

    python benchmarks/corpus.py list                                   # setups, runs, split
    python benchmarks/corpus.py generate --split tuning [--only NAME..] [--cache /tmp/jaxcache]
    python benchmarks/corpus.py score --split tuning|heldout|blind --cadence 50 [--heavy-every 500] [--json F]

Streams are ``benchmarks/fault_suite.py``'s format (:func:`fault_suite.save_stream`,
:func:`fault_suite.load_stream`) with more metadata (``setup``, ``split``, the
optimizer, the schedule, the data source); they live in ``tests/data/corpus/{tuning,
heldout}/``. The reference model's own fault suite (``tests/data/streams``, the dense
AdamW bigram setup at a long cosine horizon) is the first member of the TUNING part:
its runs are defined once, in ``fault_suite.RUNS``, and the corpus' fault runs take
their fault definitions (kind, group, expected level, delay, parameters) from the
same entries (:func:`fault_run`).

The split (:data:`SETUPS`, ``split`` field; README ``tests/data/corpus/README.md``):
the HELD-OUT part holds a model family (HF Llama), a data source (the packages'
documentation, ``pydocs``) and an optimizer (SGD with momentum) that no TUNING stream
uses, and seeds (>= 1000) that no TUNING stream uses. The BLIND part (``tests/data/corpus/
blind/``, never tuned on) holds model families (HF GPT-Neo, OPT; the reference model as
``ref-l3g``), data (``pysite``, ``markov2``), optimizers (AdaBelief, RMSProp + momentum),
schedules (linear decay, inverse square root) and seeds (>= 2000) that neither other part
uses; its faults are :data:`BLIND_FAULT_PLAN`.

``score`` (and :func:`score_corpus`, for tests) replays a split through ``jvitals.Monitor()``
(or any monitor factory) and OLMo-core's loss rule fed the same checks
(``fault_suite.score_stream``): per rule, the healthy streams' alerts and rates with the
``Policy`` fields that tune the rule; per fault, the first alert opening at/after the fault,
the lead, the false leads, early onsets or localizations, and whether the first alert's rule
also fires on the same setup's healthy runs. Faults defined but not generated, and why:
:data:`UNSPIKED_FAULTS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_suite as fs  # noqa: E402
import windows as win  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "corpus"
SPLITS = ("tuning", "heldout", "blind")

# ----------------------------------------------------------------------------------
# Models: (family, kwargs). The reference model's sizes are fault_suite's, with the
# attention-logit probe on (the attention-logit fault needs it).

MODEL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "ref-dense": ("ref", dict(fs.MODELS["dense"], sow_attn_logits=True)),
    "ref-moe": ("ref", dict(fs.MODELS["moe"], sow_attn_logits=True)),
    "gpt2": ("gpt2", dict(n_layer=2, n_embd=32, n_head=4)),
    "gpt2-l3": ("gpt2", dict(n_layer=3, n_embd=48, n_head=4)),
    "llama": ("llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)),
    "llama-l3": ("llama", dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2)),
    # BLIND only: HF-Flax GPT-Neo (a global and a local-window layer) and OPT, and the reference
    # model at 3 layers, width 48, gated attention, scan-stacked.
    "gptneo": ("gptneo", dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=128, window_size=32,
                              attention_types=[[["global", "local"], 1]])),
    "opt-l3": ("opt", dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, ffn_dim=192,
                           word_embed_proj_dim=48)),
    "ref-l3g": ("ref", dict(vocab=128, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=96,
                            attn_gate=True, scan_layers=True, use_probes=True, sow_attn_logits=True)),
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One training configuration of the corpus (several seeds and faults run on it).

    Attributes:
      name: ``{model}/{data}/{optimizer}/{schedule}[/fp16]``.
      model: key of :data:`MODEL_SPECS`.
      data: ``bigram``, ``pystdlib``, ``pydocs``, ``pysite`` or ``markov2`` (see ``corpus_data``).
      optimizer: ``adamw``, ``lion``, ``sgdm``, ``adafactor``, ``adabelief`` or ``rmsprop``.
      schedule: ``cosine``, ``constant``, ``wsd``, ``linear`` or ``rsqrt``.
      peak_lr, weight_decay: the optimizer's.
      horizon: the schedule's length in steps (healthy runs train this long).
      split: ``tuning``, ``heldout`` or ``blind``.
      warmup: linear warm-up steps.
      end_frac: the final LR as a fraction of the peak (cosine, WSD).
      decay_frac: WSD: the decay's share of the horizon.
      precision: ``fp32`` or ``fp16`` (float16 compute, dynamic loss scale).
      vocab: the bigram language's vocabulary (258 for the byte texts).
      batch, seq, pad_fraction: batch shape.
      layers_every: the heavy family's cadence (and ``val/loss``'s).
    """

    name: str
    model: str
    data: str
    optimizer: str
    schedule: str
    peak_lr: float
    weight_decay: float
    horizon: int
    split: str
    warmup: int = 200
    end_frac: float = 0.1
    decay_frac: float = 0.2
    precision: str = "fp32"
    vocab: int = 128
    batch: int = 8
    seq: int = 64
    pad_fraction: float = 0.1
    layers_every: int = 50

    @property
    def model_spec(self) -> tuple[str, dict[str, Any]]:
        return MODEL_SPECS[self.model]

    def describe(self) -> dict[str, Any]:
        """The setup's fields for a stream's metadata."""
        return dict(dataclasses.asdict(self), model_family=self.model_spec[0])


def _setup(model: str, data: str, opt: str, sched: str, lr: float, wd: float, horizon: int, split: str,
           **kw: Any) -> Setup:
    name = "/".join([model, data, opt, sched] + (["fp16"] if kw.get("precision") == "fp16" else []))
    vocab = kw.pop("vocab", 128 if data in ("bigram", "markov2") else 258)
    return Setup(name, model, data, opt, sched, lr, wd, horizon, split, vocab=vocab, **kw)


#: Every setup. Learning rates: AdamW 3e-3 / wd 0.1 (GPT-2, Llama 2e-3), Lion ~1/6 of that with
#: 5x the decay, SGD-momentum 0.1, Adafactor 1e-2. Cosine decays to 0.1x (0.05x for Lion) of the
#: peak at the horizon, WSD linearly to 0.02x over the last 20%.
SETUPS: tuple[Setup, ...] = (
    # TUNING
    _setup("ref-dense", "pystdlib", "adamw", "cosine", 3e-3, 0.1, 4000, "tuning"),
    _setup("ref-dense", "pystdlib", "lion", "cosine", 5e-4, 0.5, 6000, "tuning", end_frac=0.05),
    _setup("ref-dense", "bigram", "adafactor", "cosine", 1e-2, 0.0, 3000, "tuning"),
    _setup("ref-dense", "pystdlib", "adamw", "wsd", 3e-3, 0.1, 3000, "tuning", precision="fp16",
           end_frac=0.02),
    _setup("ref-moe", "bigram", "adamw", "wsd", 3e-3, 0.1, 3000, "tuning", end_frac=0.02),
    _setup("gpt2", "pystdlib", "adamw", "constant", 2e-3, 0.1, 4000, "tuning"),
    _setup("gpt2", "bigram", "lion", "wsd", 3e-4, 0.5, 4000, "tuning", end_frac=0.02),
    _setup("gpt2-l3", "pystdlib", "lion", "cosine", 3e-4, 0.5, 6000, "tuning", end_frac=0.05),
    # HELD-OUT: Llama, the packages' documentation and SGD-momentum appear only here.
    _setup("llama", "pydocs", "adamw", "cosine", 2e-3, 0.1, 4000, "heldout"),
    _setup("llama", "pystdlib", "lion", "cosine", 3e-4, 0.5, 6000, "heldout", end_frac=0.05),
    _setup("llama-l3", "bigram", "adamw", "wsd", 2e-3, 0.1, 4000, "heldout", end_frac=0.02),
    _setup("gpt2", "pydocs", "lion", "cosine", 3e-4, 0.5, 5000, "heldout", end_frac=0.05),
    _setup("ref-dense", "pydocs", "sgdm", "constant", 0.1, 1e-4, 4000, "heldout"),
    _setup("ref-moe", "pydocs", "lion", "cosine", 5e-4, 0.5, 3000, "heldout", end_frac=0.05),
    _setup("ref-dense", "pydocs", "adamw", "cosine", 3e-3, 0.1, 4000, "heldout", precision="fp16"),
    # BLIND: GPT-Neo, OPT, the reference model's ref-l3g configuration, the third-party packages'
    # source (pysite), the order-2 Markov language (markov2), AdaBelief, RMSProp + momentum, the
    # linear-decay and inverse-square-root schedules appear only here (none tuned on, none looked at).
    _setup("gptneo", "pysite", "adabelief", "linear", 2e-3, 0.1, 4000, "blind", end_frac=0.05),
    _setup("opt-l3", "markov2", "rmsprop", "rsqrt", 3e-4, 1e-4, 4000, "blind", vocab=64),
    _setup("ref-l3g", "pysite", "rmsprop", "linear", 3e-4, 1e-4, 4000, "blind", end_frac=0.05),
    _setup("gptneo", "markov2", "adabelief", "rsqrt", 2e-3, 0.1, 4000, "blind", vocab=64),
    _setup("opt-l3", "pysite", "adabelief", "rsqrt", 2e-3, 0.1, 4000, "blind"),
)
SETUP_BY_NAME = {s.name: s for s in SETUPS}
#: Seeds: TUNING 1-99, HELD-OUT 1000+, BLIND 2000+ (none shared; fault_suite's runs use 11-21, 100-202).
HEALTHY_SEEDS = {"tuning": (1, 2), "heldout": (1001, 1002), "blind": (2001, 2002)}
EXTRA_SEEDS = {"ref-dense/pystdlib/adamw/cosine": (3,)}


# ----------------------------------------------------------------------------------
# Runs.


@dataclasses.dataclass(frozen=True)
class CorpusRun:
    """One stream of the corpus: a setup, a seed, a length and (maybe) a fault.

    The fault fields mean what ``fault_suite.Run``'s do (``fault`` kind, ``fault_step``,
    ``group``, expected ``level``, ``max_delay``, ``params``, ``description``); ``template``
    names the ``fault_suite.RUNS`` (or :data:`NEW_FAULTS`) entry they come from.
    """

    name: str
    setup: str
    seed: int
    steps: int
    split: str
    fault: str | None = None
    fault_step: int | None = None
    group: str | None = None
    level: str | None = None
    max_delay: int | None = None
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)
    description: str = "healthy"
    template: str | None = None


F = fs.FAULT_STEP
#: The faults fault_suite does not have, in its ``Run`` shape (model and seed unused here).
NEW_FAULTS: dict[str, fs.Run] = {r.name: r for r in (
    fs.Run("attn_logit_growth", "-", 0, F + 1500, "qk_lr", F, "attention", "YELLOW", 800,
           params={"mult": 30.0, "ramp": 100},
           description="the Wq/Wk updates x30 (ramped in over 100 steps), no QK-norm: attention logits grow"),
    fs.Run("repeated_shard", "-", 0, F + 2000, "shard", F, "data", "YELLOW", 1500, params={"sequences": 256},
           description="the loader serves the same 256 sequences (16k tokens) again and again from the fault step"),
    fs.Run("data_degrade", "-", 0, F + 2500, "degrade", F, "data", "YELLOW", 1500,
           params={"share": 0.6, "ramp": 2000},
           description="a degrading data pipeline: the share of sequences replaced by random tokens ramps "
                       "0 -> 60% over 2000 steps (issue 35; TUNING only)"),
    fs.Run("loss_scale_collapse", "-", 0, F + 500, "head_growth", F, "loss_scale", "YELLOW", 200,
           params={"rate": 0.02},
           description="float16 with a dynamic loss scale; the LM head's kernel x1.02 per step: the "
                       "backward overflows float16 at ever smaller scales, the loss scale falls"),
)}


#: Defined and trainable (``corpus_train`` knows their kinds) but NOT in the corpus: these tiny
#: models do not spike without warm-up. Measured (400 steps, ref-dense and GPT-2 on pystdlib):
#: AdamW at 1e-2 and 3e-2 and Lion at 3e-3 and 5e-4 from step 0 reach the same or a lower loss
#: than with the 200-step warm-up, with no grad-norm excursion; zeroing Adam's moments at step
#: 400 at the peak LR raised update/param_ratio 3.7x for one step and left the loss unchanged.
#: A fault that changes nothing the loss or the model shows is not a fault to score leads on.
UNSPIKED_FAULTS: dict[str, fs.Run] = {r.name: r for r in (
    fs.Run("warmup_skip", "-", 0, 1500, "no_warmup", 0, "lr", "YELLOW", 500,
           description="no warm-up: the peak learning rate from step 0"),
    fs.Run("restart_no_warmup", "-", 0, F + 500, "moments_reset", F, "lr", "YELLOW", 100,
           description="a restart that lost the optimizer's moments (Adam mu, nu and its bias-correction "
                       "count zeroed) and resumed at the peak learning rate without a new warm-up"),
)}


def fault_template(name: str) -> fs.Run:
    """A fault's definition: ``fault_suite.RUNS``' entry of that name, or :data:`NEW_FAULTS`'."""
    return NEW_FAULTS[name] if name in NEW_FAULTS else fs.run_by_name(name)


def fault_run(template: str, setup: str, seed: int, fault_step: int = 1200) -> CorpusRun:
    """A fault run of ``setup``: the template's fault, moved to ``fault_step``, with the
    template's post-fault length (the warm-up-skip fault keeps its step 0)."""
    t = fault_template(template)
    s = SETUP_BY_NAME[setup]
    fstep = t.fault_step if t.fault == "no_warmup" else fault_step
    steps = fstep + (t.steps - t.fault_step)
    short = s.name.replace("/", ".")
    return CorpusRun(f"{template}.{short}.s{seed}", setup, seed, steps, s.split, t.fault, fstep, t.group,
                     t.level, t.max_delay, dict(t.params), t.description, template)


def _healthy_runs() -> list[CorpusRun]:
    out = []
    for s in SETUPS:
        for seed in HEALTHY_SEEDS[s.split] + EXTRA_SEEDS.get(s.name, ()):
            out.append(CorpusRun(f"healthy.{s.name.replace('/', '.')}.s{seed}", s.name, seed, s.horizon, s.split))
    return out


_T = ("ref-dense/pystdlib/adamw/cosine", "ref-dense/pystdlib/lion/cosine", "ref-dense/bigram/adafactor/cosine",
      "ref-dense/pystdlib/adamw/wsd/fp16", "ref-moe/bigram/adamw/wsd", "gpt2/pystdlib/adamw/constant",
      "gpt2/bigram/lion/wsd", "gpt2-l3/pystdlib/lion/cosine")
_H = ("llama/pydocs/adamw/cosine", "llama/pystdlib/lion/cosine", "llama-l3/bigram/adamw/wsd",
      "gpt2/pydocs/lion/cosine", "ref-dense/pydocs/sgdm/constant", "ref-moe/pydocs/lion/cosine",
      "ref-dense/pydocs/adamw/cosine/fp16")
_B = ("gptneo/pysite/adabelief/linear", "opt-l3/markov2/rmsprop/rsqrt", "ref-l3g/pysite/rmsprop/linear",
      "gptneo/markov2/adabelief/rsqrt", "opt-l3/pysite/adabelief/rsqrt")
#: fault -> [(setup, fault step)]; fault_suite's own stream of each of its faults is in the
#: TUNING part too (tests/data/streams).
FAULT_PLAN: dict[str, list[tuple[str, int]]] = {
    "lr_x100": [(_T[5], 1200), (_H[0], 1200), (_H[3], 3500)],
    "lr_x1000_once": [(_T[1], 1200), (_H[1], 1200), (_H[4], 1200)],
    "emb_lr_x30": [(_T[6], 1200), (_H[0], 1200), (_H[4], 1200)],
    "emb_wd_creep": [(_T[0], 1200), (_H[1], 3000), (_H[3], 1200)],
    "logit_drift": [(_T[0], 2000), (_H[0], 1200), (_H[2], 1200)],
    "nan_batch": [(_T[7], 1200), (_H[3], 1200)],
    "corrupt_data": [(_T[5], 1200), (_H[1], 1200)],
    "overfit": [(_T[1], 1200), (_H[0], 1200)],
    "periodic_shocks": [(_T[6], 1200), (_H[4], 1200)],
    "router_collapse": [(_T[4], 1200), (_H[5], 1200)],
    "throughput_drop": [(_T[7], 1200), (_H[2], 1200)],
    "attn_logit_growth": [(_T[0], 1200), (_T[5], 1200), (_H[0], 1200), (_H[3], 1200)],
    "repeated_shard": [(_T[0], 1200), (_T[7], 1200), (_H[1], 1200), (_H[3], 1200)],
    "loss_scale_collapse": [(_T[3], 1200), (_H[6], 1200)],
    "data_degrade": [(_T[0], 1200), (_T[5], 1200)],
}
#: More TUNING runs of a fault, with their own seeds (4-9: no other run's), added after the
#: held-out part was scored to tune a rule on setups of its own (issue 35: the slow
#: embedding and LM-head faults on Lion and at step 1200): fault -> [(setup, fault step, seed)].
TUNING_EXTRA: dict[str, list[tuple[str, int, int]]] = {
    "emb_wd_creep": [(_T[7], 1200, 4), (_T[1], 1200, 5)],
    "logit_drift": [(_T[0], 1200, 6), (_T[1], 1200, 7)],
}
#: Faults kept in the TUNING part only (added to tune a rule; the held-out and blind parts
#: were scored as they were).
TUNING_ONLY = ("data_degrade",)
#: The BLIND part's faults (the same templates; no MoE or fp16 setup there, so no router or loss-scale fault).
BLIND_FAULT_PLAN: dict[str, list[tuple[str, int]]] = {
    "lr_x100": [(_B[1], 1200), (_B[0], 1200)],
    "lr_x1000_once": [(_B[4], 1200), (_B[2], 1200)],
    "emb_lr_x30": [(_B[0], 1200), (_B[4], 1200)],
    "emb_wd_creep": [(_B[3], 1200), (_B[1], 1200)],
    "logit_drift": [(_B[2], 1200)],
    "nan_batch": [(_B[3], 1200), (_B[0], 1200)],
    "corrupt_data": [(_B[4], 1200), (_B[2], 1200)],
    "overfit": [(_B[2], 1200)],
    "periodic_shocks": [(_B[1], 1200)],
    "throughput_drop": [(_B[3], 1200)],
    "attn_logit_growth": [(_B[1], 1200), (_B[2], 1200), (_B[3], 1200)],
    "repeated_shard": [(_B[0], 1200), (_B[4], 1200)],
}


#: Fault seeds: ``30 + 4 k + j`` (TUNING), ``1100 + 4 k + j`` (HELD-OUT) or ``2100 + 4 k + j`` (BLIND),
#: k the fault's index here.
_SEED_ORDER = ("lr_x100", "lr_x1000_once", "emb_lr_x30", "emb_wd_creep", "logit_drift", "nan_batch", "corrupt_data",
               "overfit", "periodic_shocks", "router_collapse", "throughput_drop", "attn_logit_growth",
               "repeated_shard", "warmup_skip", "loss_scale_collapse", "restart_no_warmup", "data_degrade")


def _fault_runs() -> list[CorpusRun]:
    out = []
    for template, where in FAULT_PLAN.items():
        k = _SEED_ORDER.index(template)
        for j, (setup, fstep) in enumerate(where):
            base = 30 if SETUP_BY_NAME[setup].split == "tuning" else 1100
            out.append(fault_run(template, setup, base + 4 * k + j, fstep))
    for template, extra in TUNING_EXTRA.items():
        out += [fault_run(template, setup, seed, fstep) for setup, fstep, seed in extra]
    for template, where in BLIND_FAULT_PLAN.items():
        k = _SEED_ORDER.index(template)
        out += [fault_run(template, setup, 2100 + 4 * k + j, fstep) for j, (setup, fstep) in enumerate(where)]
    return out


RUNS: tuple[CorpusRun, ...] = tuple(_healthy_runs() + _fault_runs())
RUN_BY_NAME = {r.name: r for r in RUNS}


# ----------------------------------------------------------------------------------
# Generation.


def stream_path(run: CorpusRun, root: Path = CORPUS) -> Path:
    """Where ``run``'s stream lives: ``{root}/{split}/{name}.npz``."""
    return root / run.split / f"{run.name}.npz"


def loss_note(loss: np.ndarray, fault_step: int) -> dict[str, Any]:
    """Whether the loss ever shows the fault: OLMo-core's rule fed every step (first firing at
    or after the fault, None: never), and the largest 50-step mean of the loss after the fault
    over its mean in the 200 steps before (a non-finite loss counts as infinite); ``loss_shows``
    when the rule fired or that ratio exceeds 1.1 (for a fault at step 0: NaN, the rule alone)."""
    loss = np.asarray(loss, np.float64)
    rule = fs.OlmoLossSpike()
    first = None
    for s, x in enumerate(loss):
        if rule.update(s, {"loss": float(x)}) and s >= fault_step and first is None:
            first = s
    smooth = np.convolve(np.nan_to_num(loss, nan=np.inf), np.ones(50) / 50, mode="valid")   # mean of 50 steps
    pre = loss[max(0, fault_step - 200):fault_step]
    pre = pre[np.isfinite(pre)]
    post = smooth[fault_step:]
    ratio = float(np.max(post) / np.mean(pre)) if len(pre) and len(post) else math.nan
    return dict(olmo_every_step=first, max_loss_ratio=ratio,
                loss_shows=bool(first is not None or ratio > 1.1))


def run_meta(run: CorpusRun, setup: Setup, facts: Mapping[str, Any], rows: Sequence[Mapping[str, float]]) -> dict:
    """A stream's metadata: fault_suite's keys (so its loader, replay and scorer read it) plus
    the setup, the split and the data."""
    meta = dict(
        name=run.name, model=setup.model, model_family=setup.model_spec[0], seed=run.seed, fault=run.fault,
        fault_step=run.fault_step, group=run.group, level=run.level, max_delay=run.max_delay,
        params=dict(run.params), description=run.description, template=run.template, split=run.split,
        setup=setup.describe(), optimizer=setup.optimizer, schedule=setup.schedule, data=setup.data,
        precision=setup.precision, peak_lr=setup.peak_lr, weight_decay=setup.weight_decay, horizon=setup.horizon,
        end_frac=setup.end_frac, decay_frac=setup.decay_frac, clip=1.0, layers_every=setup.layers_every,
        val_every=setup.layers_every, val_batches=4, default_cadence=10, group_figures="recorder",
        opt_learning_rate="recorder", log_vocab=math.log(setup.vocab), generator="benchmarks/corpus.py",
        **{k: v for k, v in facts.items() if k not in ("warmup_steps", "data")}, warmup_steps=facts["warmup_steps"])
    if run.fault:
        meta["loss_note"] = loss_note(np.array([r.get("loss", np.nan) for r in rows]), run.fault_step)
    return meta


def generate(runs: Sequence[CorpusRun], root: Path = CORPUS, skip_existing: bool = False,
             log: Callable[[str], None] = print) -> list[Path]:
    """Train each run and write its stream (grouped by setup: one compile per setup and process)."""
    import corpus_train as ct

    paths = []
    for run in sorted(runs, key=lambda r: (r.setup, r.fault or "", r.name)):
        path = stream_path(run, root)
        if skip_existing and path.exists():
            log(f"skip {run.name} (exists)")
            continue
        setup = SETUP_BY_NAME[run.setup]
        rows, facts = ct.train_run(setup, run, log=log)
        meta = run_meta(run, setup, facts, rows)
        fs.save_stream(path, meta, rows)
        log(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB, {run.steps} steps, "
            f"{facts['median_step_ms']:.1f} ms/step median, {facts['wall_s']:.0f} s)")
        paths.append(path)
    return paths


def _select(args: argparse.Namespace) -> list[CorpusRun]:
    runs = [RUN_BY_NAME[n] for n in args.only] if args.only else list(RUNS)
    if args.split:
        runs = [r for r in runs if r.split == args.split]
    if args.setup:
        runs = [r for r in runs if r.setup in args.setup]
    if args.kind == "healthy":
        runs = [r for r in runs if not r.fault]
    elif args.kind == "faults":
        runs = [r for r in runs if r.fault]
    return runs


def _jax_setup(cache: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    import jax

    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def cmd_generate(args: argparse.Namespace) -> int:
    _jax_setup(args.cache)
    runs = _select(args)
    if args.steps:
        runs = [dataclasses.replace(r, steps=args.steps) for r in runs]
    if args.fault_step:
        runs = [dataclasses.replace(r, fault_step=args.fault_step) if r.fault and r.fault_step else r for r in runs]
    print(f"{len(runs)} runs, {sum(r.steps for r in runs)} steps", flush=True)
    generate(runs, Path(args.out), args.skip_existing, log=lambda s: print(s, flush=True))
    return 0


# ----------------------------------------------------------------------------------
# Scoring: the corpus replayed through jvitals.Monitor() and OLMo-core's loss rule.

#: The Policy fields that tune each rule (by ``alert.rule``).
RULE_POLICY: dict[str, str] = {
    "nonfinite": "nonfinite_metrics, nonfinite_count_metrics",
    "loss_spike": "spike_z, spike_min_ratio, physiological_steps, spike_alert_metrics",
    "periodic_spike": "periodic_metrics, periodic_min_spikes, periodic_tolerance, periodic_min_interval",
    "grad_norm": ("ratio_rules['grad/global_norm'], baseline, drift_halflife, schedule_metrics, lr_exponent, "
                  "ratio_noise_z, confirm_checks, hysteresis"),
    "param_norm": "trend_metrics['param/global_norm'], trend_window, trend_drift_k",
    "ratio": "ratio_rules, baseline, drift_halflife, confirm_checks, hysteresis",
    "grad_trend": "trend_metrics['grad/global_norm'], trend_window, trend_buckets, trend_drift_k",
    "jump": "jump_metrics",
    "group": "group_bands, group_jump, group_window, group_drift_k, group_z, group_min_share, group_global_ratio",
    "logits": "logit_bands, group_window, group_drift_k",
    "router": "router_bands, router_z, router_steps",
    "throughput": "throughput_metrics, throughput_drop, throughput_z, throughput_noise_halflife, throughput_hold_steps",
    "early": "early_jumps, early_min_samples, early_min_span, baseline_steps",
    "data": "data_window, data_rise, data_z, data_band, data_confirm",
    "skip": "skip_orange_checks",
    "window_spikes": "spike_z, window_min_steps, rolling_window",
    "loss_scale": "loss_scale_metric, loss_scale_drop",
    "val_gap": "val_gap_ratio, val_gap_min_growth, val_gap_window, gap_z, gap_confirm",
    "val_rise": "val_rise_z, val_rise_min, val_rise_window, val_rise_sparse_run",
    "broken_model": "broken_chance_frac, broken_param_jump, broken_param_loss, broken_steps, broken_loss_steps",
    "repeat": "repeat_window, repeat_collapse",
    "attn_logits": "attn_metric, attn_level, attn_growth, attn_window, attn_orange",
    "output_logits": "out_metric, out_level, out_growth, out_window",
    "update_size": "update_level, update_hold, warmup_frac, vanish_level, vanish_checks",
    "divergence": "red_after, red_min_steps, divergence_loss_ratio",
    "replica": "replica_z, replica_min_ratio, replica_rel_floor, replica_confirm",
}


def load_split(split: str, root: str | Path = CORPUS, with_fault_suite: bool = True) -> list[fs.Stream]:
    """Every stream of a split (``{root}/{split}/*.npz``); the TUNING part also holds
    fault_suite's streams (``tests/data/streams``), marked ``split: "tuning"``."""
    streams = fs.load_streams(Path(root) / split) if (Path(root) / split).exists() else []
    if split == "tuning" and with_fault_suite:
        for st in fs.load_streams(fs.STREAMS):
            st.meta.setdefault("split", "tuning")
            st.meta.setdefault("setup", {"name": f"ref-{st.meta['model']}/bigram/adamw/cosine@10000 (fault_suite)"})
            streams.append(st)
    return streams


def thin_heavy(stream: fs.Stream, heavy_every: int) -> fs.Stream:
    """``stream`` with the heavy family (figures recorded every ``layers_every`` steps, and
    ``val/loss``) kept only at steps that are multiples of ``heavy_every`` (the README loop's
    heavy step every 500)."""
    if not heavy_every:
        return stream
    every = int(stream.meta.get("layers_every", 50))
    series = {}
    for n, (idx, v) in stream.series.items():
        heavy = len(idx) <= stream.steps // every + 1 and np.all(idx % every == 0)
        keep = idx % heavy_every == 0 if heavy else np.ones(len(idx), bool)
        series[n] = (idx[keep], v[keep])
    return fs.Stream(meta=stream.meta, steps=stream.steps, series=series)


class SpyMonitor:
    """A ``jvitals.Monitor()`` whose every alert, at every check, is logged:
    ``log[i] = (step, id, rule, metric, level, onset_step, first localization departure)``."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.monitor = factory()
        self.log: list[tuple[int, int, str, str, int, int | None, int | None]] = []

    def update(self, step: int, metrics: Mapping[str, float]) -> Any:
        v = self.monitor.update(step, metrics)
        for a in v.alerts:
            loc = list(getattr(a, "localization", []) or [])
            self.log.append((step, int(a.id), str(a.rule), str(a.metric), int(a.level),
                             getattr(a, "onset_step", None), int(loc[0].departure_step) if loc else None))
        return v


def _default_factory() -> Callable[[], Any]:
    from jvitals.monitor.monitor import Monitor

    return Monitor


def _healthy_figures(scores: Sequence[tuple[fs.Stream, fs.Score]]) -> dict[str, Any]:
    """Per-rule alert counts (by the alert's peak level) over the healthy streams."""
    steps = sum(st.steps for st, _ in scores)
    rules: dict[str, dict[str, int]] = {}
    streams = {}
    for st, sc in scores:
        for (_, peak, rule, _) in sc.alerts:
            rules.setdefault(rule, {lv: 0 for lv in fs.LEVELS[1:]})[peak] += 1
        streams[st.name] = [dict(step=a[0], level=a[1], rule=a[2], metric=a[3]) for a in sc.alerts]
    per = {r: dict(c, total=sum(c.values()), per_10k=sum(c.values()) * 1e4 / max(steps, 1),
                   per_20k=sum(c.values()) * 2e4 / max(steps, 1), policy=RULE_POLICY.get(r, "?"))
           for r, c in sorted(rules.items())}
    ys = sum(c["YELLOW"] for c in rules.values())
    ors = sum(c["ORANGE"] + c["RED"] for c in rules.values())
    return dict(streams=len(scores), steps=steps, rules=per, yellow=ys, orange_red=ors,
                yellow_per_20k=ys * 2e4 / max(steps, 1), alerts=streams)


def _events(spy: SpyMonitor, fault_step: int) -> list[tuple[int, int, str, str, int, int | None, int | None]]:
    """The alerts that open, or escalate, at or after the fault (an alert opened before the fault
    and still open is not a detection of it): the spy's log entries at their first check at
    each new level."""
    seen: dict[int, int] = {}
    out = []
    for e in spy.log:
        if e[4] > seen.get(e[1], 0):
            seen[e[1]] = e[4]
            if e[0] >= fault_step:
                out.append(e)
    return out


def _fault_figures(st: fs.Stream, sc: fs.Score, spy: SpyMonitor, cadence: int) -> dict[str, Any]:
    """One fault stream's detection (the first alert opening or escalating at or after the fault),
    its lead over the loss rule, the alerts before the fault (false leads), and the earliest onset
    and localization departure those post-fault alerts name (early: more than one check before
    the fault)."""
    f = int(st.meta["fault_step"])
    ev = _events(spy, f)
    jv = ev[0][0] if ev else None
    top = max((e for e in ev if e[0] == jv), key=lambda e: e[4]) if ev else None
    want = st.meta.get("level")
    got = next((e[0] for e in ev if e[4] >= fs.LEVELS.index(want)), None) if want else None
    onset = min((e[5] for e in ev if e[5] is not None), default=None)
    dep = min((e[6] for e in ev if e[6] is not None), default=None)
    return dict(
        fault=st.meta.get("template") or st.name, setup=st.meta["setup"]["name"], split=st.meta.get("split"),
        fault_step=f, group=st.meta.get("group"), expected=want, max_delay=st.meta.get("max_delay"),
        first_alert=jv, first_level=fs.LEVELS[top[4]] if top else None, first_rule=top[2] if top else None,
        first_metric=top[3] if top else None, expected_reached=got,
        in_time=got is not None and (st.meta.get("max_delay") is None or got - f <= st.meta["max_delay"]),
        peak=fs.LEVELS[max((e[4] for e in ev), default=0)], olmo=sc.olmo, olmo_every_step=sc.olmo_every_step,
        lead=fs.lead(sc.olmo, jv, f, cadence), later_than_loss=jv is not None and sc.olmo is not None and jv > sc.olmo,
        false_leads=[dict(step=a[0], level=a[1], rule=a[2], metric=a[3]) for a in sc.pre_fault_alerts],
        onset=onset, departure=dep,
        early_onset=onset is not None and onset < f - cadence,
        early_localization=dep is not None and dep < f - cadence,
        loss_note=st.meta.get("loss_note") or loss_note(st.dense("loss"), f))


def _twin_check(faults: dict[str, dict[str, Any]], healthy: Sequence[tuple[fs.Stream, fs.Score]],
                window: int = 250) -> None:
    """Mark each fault's first alert ``twin_rule``: True when a healthy stream of the same setup
    opened an alert of the same rule within ``window`` steps of that step (the first alert may
    then be the setup's natural drift, not the fault); None without a healthy twin."""
    by_setup: dict[str, list[fs.Score]] = {}
    for st, sc in healthy:
        by_setup.setdefault(st.meta["setup"]["name"], []).append(sc)
    for x in faults.values():
        twins = by_setup.get(x["setup"])
        if not twins or x["first_alert"] is None:
            x["twin_rule"] = None
            continue
        x["twin_rule"] = any(a[2] == x["first_rule"] and abs(a[0] - x["first_alert"]) <= window
                             for sc in twins for a in sc.alerts)


def score_corpus(split: str, root: str | Path = CORPUS, cadence: int = 50, heavy_every: int = 0,
                 monitor_factory: Callable[[], Any] | None = None, with_fault_suite: bool = True,
                 streams: Sequence[fs.Stream] | None = None, windows: bool = True) -> dict[str, Any]:
    """Replay one split through a fresh monitor per stream (default: ``jvitals.Monitor()``) at
    a host cadence, and OLMo-core's loss-only rule on the same checks.

    Args:
      split: ``tuning`` or ``heldout``.
      root: the corpus directory.
      cadence: host check every ``cadence`` steps (the README loop: 50).
      heavy_every: keep the heavy family only every this many steps (the README: 500; 0:
        as recorded, every 50).
      monitor_factory: makes the monitor (default ``jvitals.Monitor``).
      with_fault_suite: the TUNING part includes fault_suite's streams.
      streams: score these instead of loading the split.
      windows: the README loop of issue 35 (``benchmarks/windows.py``): each check also
        carries the device window since the previous check, and the free per-group figures
        stay at every recorded step when the heavy family is thinned; False: the check's own
        figures only (the loop before windows).

    Returns:
      ``{"healthy": {...per-rule counts, yellow_per_20k, ...}, "faults": {name: {...}},
      "median_lead", "later_than_loss", "false_leads", "early_onsets", ...}``.
    """
    factory = monitor_factory or _default_factory()
    if streams is None:
        streams = load_split(split, root, with_fault_suite)
    healthy, faults = [], {}
    for st0 in streams:
        st = win.thin(st0, heavy_every) if windows else thin_heavy(st0, heavy_every)
        spies: list[SpyMonitor] = []

        def make() -> SpyMonitor:
            spies.append(SpyMonitor(factory))
            return spies[-1]

        sc = fs.score_stream(st, cadence, monitor_factory=make, replay_fn=win.replay if windows else None)
        if st.meta.get("fault"):
            faults[st.name] = _fault_figures(st, sc, spies[-1], cadence)
        else:
            healthy.append((st, sc))
    _twin_check(faults, healthy)
    leads = [x["lead"] for x in faults.values() if not math.isnan(x["lead"])]
    seen = [x["lead"] for x in faults.values() if x["olmo"] is not None]   # faults the loss rule catches
    return dict(
        split=split, cadence=cadence, heavy_every=heavy_every, windows=windows, healthy=_healthy_figures(healthy), faults=faults,
        median_lead=statistics.median(leads) if leads else math.nan,
        median_lead_where_loss_rule_fires=statistics.median(seen) if seen else math.nan,
        later_than_loss=sorted(n for n, x in faults.items() if x["later_than_loss"]),
        missed=sorted(n for n, x in faults.items() if x["first_alert"] is None),
        false_leads=sorted(n for n, x in faults.items() if x["false_leads"]),
        first_alert_in_healthy_twin=sorted(n for n, x in faults.items() if x["twin_rule"]),
        early_onsets=sorted(n for n, x in faults.items() if x["early_onset"] or x["early_localization"]))


def _fmt_lead(x: float) -> str:
    return "-" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:.2f}x"


def format_scores(res: Mapping[str, Any]) -> str:
    """The markdown tables of :func:`score_corpus`'s result."""
    h = res["healthy"]
    out = [f"## {res['split']}: cadence {res['cadence']}, heavy every {res['heavy_every'] or 'recorded (50)'}"
           f"{'' if res.get('windows', True) else ', no windows'}", "",
           f"Healthy: {h['streams']} streams, {h['steps']} steps: {h['yellow']} YELLOW, {h['orange_red']} "
           f"ORANGE/RED ({h['yellow_per_20k']:.2f} YELLOW per 20,000 steps).", "",
           "| rule | YELLOW | ORANGE | RED | per 10k steps | per 20k steps | Policy fields |",
           "|---|---|---|---|---|---|---|"]
    for r, c in h["rules"].items():
        out.append(f"| {r} | {c['YELLOW']} | {c['ORANGE']} | {c['RED']} | {c['per_10k']:.2f} | {c['per_20k']:.2f} "
                   f"| {c['policy']} |")
    noisy = {n: a for n, a in h["alerts"].items() if a}
    if noisy:
        out += ["", "Healthy streams with alerts (opening step, peak level, rule:metric):"]
        out += [f"- {n}: " + "; ".join(f"{a['step']} {a['level']} {a['rule']}:{a['metric']}" for a in al[:6])
                + (f"; ... ({len(al)} in all)" if len(al) > 6 else "") for n, al in sorted(noisy.items())]
    out += ["", "| fault stream | split | fault step | first alert (level, rule:metric) | OLMo (every step) | lead "
            "| loss shows | false leads | onset / localization before the fault | rule in healthy twin |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for n, x in sorted(res["faults"].items()):
        fa = "-" if x["first_alert"] is None else \
            f"{x['first_alert']} ({x['first_level']}, {x['first_rule']}:{x['first_metric']})"
        note = x.get("loss_note") or {}
        fl = "; ".join(f"{a['step']} {a['level']} {a['rule']}" for a in x["false_leads"][:3]) or "-"
        early = ", ".join(k for k in ("early_onset", "early_localization") if x[k]) or "-"
        out.append(f"| {n} | {x['split']} | {x['fault_step']} | {fa} | {x['olmo'] if x['olmo'] is not None else '-'} "
                   f"({x['olmo_every_step'] if x['olmo_every_step'] is not None else '-'}) | {_fmt_lead(x['lead'])} "
                   f"| {note.get('loss_shows', '?')} | {fl} | {early} | {x['twin_rule']} |")
    out += ["", f"Median lead over the loss rule: {_fmt_lead(res['median_lead'])} (over the "
            f"faults the loss rule catches at this cadence: {_fmt_lead(res['median_lead_where_loss_rule_fires'])}); "
            f"later than the loss rule: "
            f"{len(res['later_than_loss'])}; missed: {len(res['missed'])}; "
            f"with false leads: {len(res['false_leads'])}; "
            f"onset/localization > 1 check before the fault: {len(res['early_onsets'])} (of {len(res['faults'])}); "
            f"first alert's rule also fired on a healthy twin within 250 steps: "
            f"{len(res['first_alert_in_healthy_twin'])}."]
    return "\n".join(out)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def cmd_score(args: argparse.Namespace) -> int:
    res = score_corpus(args.split, args.root, args.cadence, args.heavy_every, windows=not args.no_windows)
    print(format_scores(res))
    if args.json:
        Path(args.json).write_text(json.dumps(_json_safe(res), indent=1))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    for r in _select(args):
        f = f"{r.fault} at {r.fault_step} ({r.group}, {r.level} within {r.max_delay})" if r.fault else "healthy"
        print(f"{r.split:8s} {r.name:60s} {r.steps:6d} steps  seed {r.seed:5d}  {f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "list"):
        g = sub.add_parser(name)
        g.add_argument("--split", choices=SPLITS)
        g.add_argument("--setup", nargs="*", help="setup names")
        g.add_argument("--only", nargs="*", help="run names")
        g.add_argument("--kind", choices=("all", "healthy", "faults"), default="all")
        if name == "generate":
            g.add_argument("--out", default=str(CORPUS))
            g.add_argument("--cache", default="", help="JAX persistent compilation cache directory")
            g.add_argument("--skip-existing", action="store_true")
            g.add_argument("--steps", type=int, default=0, help="override every run's length (debugging)")
            g.add_argument("--fault-step", type=int, default=0, help="override every fault step (debugging)")
    s = sub.add_parser("score", help="replay a split through the default Monitor and the loss rule")
    s.add_argument("--split", choices=SPLITS, required=True)
    s.add_argument("--root", default=str(CORPUS))
    s.add_argument("--cadence", type=int, default=50)
    s.add_argument("--heavy-every", type=int, default=0, help="keep the heavy family only every N steps")
    s.add_argument("--json", default="", help="write the numbers here")
    s.add_argument("--no-windows", action="store_true",
                   help="the checks' own figures only (the loop before issue 35's windows)")
    args = ap.parse_args(argv)
    return {"generate": cmd_generate, "list": cmd_list, "score": cmd_score}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
