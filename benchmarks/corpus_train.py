"""Training for the calibration corpus: models, data, optimizers, schedules, faults, one run.

Imported by ``benchmarks/corpus.py`` (which defines the setups and the runs); JAX,
Flax, optax and transformers are imported here only. Every run is real training on
the CPU with jvitals' own recorder, as the README's loop has it::

    tx = vitals.with_lr_scale(vitals.record(optax.chain(clip, opt, fault_scale), schedule=schedule))

``fault_scale`` is the identity except under a fault that changes the updates (an
LR the schedule does not show, a per-group LR): it sits inside the recorded chain,
so the recorder's update figures are those of the updates applied. Faults that move
the parameters themselves (weight-decay creep, logit drift, the router push) act
on the parameters after the update, as in ``benchmarks/fault_suite.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
import types
import warnings
from typing import Any, Callable, Mapping

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jvitals as vitals  # noqa: E402
from jvitals import reference_model as rm  # noqa: E402

import corpus_data as cd  # noqa: E402
import fault_suite as fs  # noqa: E402

VAL_BATCHES = 4
LOSS_SCALE_INIT = 2.0 ** 15
LOSS_SCALE_PERIOD = 500       # finite steps before the dynamic loss scale doubles


# ----------------------------------------------------------------------------------
# Schedules (tests/test_corpus_data.py recomputes opt/learning_rate from its own NumPy formulas).


def make_schedule(kind: str, peak: float, warmup: int, steps: int, end_frac: float,
                  decay_frac: float) -> optax.Schedule:
    """The learning-rate schedule of a setup.

    Args:
      kind: ``cosine`` (linear warm-up, cosine to ``end_frac * peak`` at ``steps``),
        ``constant`` (linear warm-up, then ``peak``) or ``wsd`` (linear warm-up,
        ``peak``, a linear decay to ``end_frac * peak`` over the last ``decay_frac``
        of the steps); BLIND only: ``linear`` (linear warm-up, linear decay to
        ``end_frac * peak`` at ``steps``), ``rsqrt`` (linear warm-up, then
        ``peak * sqrt(warmup / t)``).
      peak, warmup, steps, end_frac, decay_frac: see ``kind``.

    Returns:
      An optax schedule (a function of the update count).
    """
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps, end_value=peak * end_frac)
    if kind == "constant":
        return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
    if kind == "wsd":
        d = int(round(decay_frac * steps))
        return optax.join_schedules([warm, optax.constant_schedule(peak),
                                     optax.linear_schedule(peak, peak * end_frac, d)], [warmup, steps - d])
    if kind == "linear":     # BLIND: linear warm-up, then linear decay to end_frac * peak at ``steps``
        return optax.join_schedules([warm, optax.linear_schedule(peak, peak * end_frac, steps - warmup)], [warmup])
    if kind == "rsqrt":      # BLIND: linear warm-up, then peak * sqrt(warmup / t)
        w = float(max(warmup, 1))
        return optax.join_schedules([warm, lambda c: peak * jnp.sqrt(w / (c + w))], [warmup])
    raise KeyError(f"unknown schedule {kind!r}")


# ----------------------------------------------------------------------------------
# Models: one adapter per family, the same interface.


@dataclasses.dataclass
class ModelAdapter:
    """What the trainer needs of a model family.

    Attributes:
      family: ``ref`` or ``gpt2`` / ``llama`` (HF-Flax).
      vocab: vocabulary size.
      roles: the recorder's parameter roles.
      init: ``seed -> params``.
      forward: ``(params, batch) -> (loss, intermediates)`` (jit-traceable).
      lm_loss: ``(params, batch) -> loss`` of the main head (validation).
      top_k: experts per token (MoE) or None.
      emb: regex of the embedding's parameter paths.
      head: regex of the (untied) LM head's, or None.
      qk: ``(path, shape) -> NumPy 0/1 mask of the Wq/Wk entries`` or None.
      describe: the model's configuration for the metadata.
    """

    family: str
    vocab: int
    roles: Any
    init: Callable[[int], Any]
    forward: Callable[[Any, Mapping[str, Any]], tuple[Any, Any]]
    lm_loss: Callable[[Any, Mapping[str, Any]], Any]
    top_k: int | None
    emb: str
    head: str | None
    qk: Callable[[str, tuple[int, ...]], np.ndarray | None]
    describe: dict[str, Any]


def _ref_qk(cfg: rm.ModelConfig) -> Callable[[str, tuple[int, ...]], np.ndarray | None]:
    """Fused QKV kernel ``[D, (H + 2 KVH) Dh]``: the Q and K columns."""
    def qk(path: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if not path.endswith("attn/qkv/kernel"):
            return None
        m = np.zeros(shape, np.float32)
        m[..., : (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim] = 1.0
        return m
    return qk


def ref_adapter(kwargs: Mapping[str, Any], vocab: int, dtype: Any) -> ModelAdapter:
    """The reference model (``jvitals.reference_model``) with its probes on."""
    cfg = rm.ModelConfig(**{**kwargs, "vocab": vocab, "dtype": dtype})

    def forward(params, batch):
        return rm.loss_fn(params, batch, cfg)

    def lm_loss(params, batch):
        logits = rm.Decoder(cfg).apply({"params": params}, batch["tokens"], mask=batch["mask"])
        return rm.cross_entropy(logits, batch["labels"], batch["mask"])

    return ModelAdapter("ref", vocab, vitals.Roles(), lambda s: rm.init_params(cfg, jax.random.key(s)),
                        forward, lm_loss, cfg.top_k if cfg.moe else None, r"^embed/", r"^lm_head/",
                        _ref_qk(cfg), dict(kwargs, vocab=vocab, dtype=jnp.dtype(dtype).name))


def _hf_call(module: Any, params: Any, batch: Mapping[str, Any]) -> tuple[Any, Any]:
    t = batch["tokens"]
    pos = jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
    with vitals.instrument(attn_logits=True):
        out, state = module.apply({"params": params}, t, batch["mask"].astype(jnp.int32), position_ids=pos,
                                  mutable=["intermediates"])
    return out.logits, state["intermediates"]


def _hf_build(family: str, kw: Mapping[str, Any], vocab: int, seq: int, seed: int, dtype: Any) -> Any:
    import transformers as tf
    warnings.filterwarnings("ignore", category=FutureWarning)
    if family == "gpt2":
        conf = tf.GPT2Config(vocab_size=vocab, n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=cd.BOS_ID, eos_token_id=cd.BOS_ID, **kw)
        return tf.FlaxGPT2LMHeadModel(conf, seed=seed, dtype=dtype)
    if family == "gptneo":   # BLIND: tied head, q/k/v/out_proj, global + local attention layers
        conf = tf.GPTNeoConfig(vocab_size=vocab, max_position_embeddings=seq, embed_dropout=0.0, attention_dropout=0.0,
                               resid_dropout=0.0, bos_token_id=cd.BOS_ID, eos_token_id=cd.BOS_ID, **kw)
        return tf.FlaxGPTNeoForCausalLM(conf, seed=seed, dtype=dtype)
    if family == "opt":      # BLIND: tied head, learned positions (offset 2), q/k/v_proj with biases, fc1/fc2
        conf = tf.OPTConfig(vocab_size=vocab, max_position_embeddings=seq, dropout=0.0, attention_dropout=0.0,
                            bos_token_id=cd.BOS_ID, eos_token_id=cd.BOS_ID, pad_token_id=cd.PAD_ID, **kw)
        return tf.FlaxOPTForCausalLM(conf, seed=seed, dtype=dtype)
    conf = tf.LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False,
                          bos_token_id=cd.BOS_ID, eos_token_id=cd.BOS_ID, pad_token_id=cd.PAD_ID, **kw)
    return tf.FlaxLlamaForCausalLM(conf, seed=seed, dtype=dtype)


def _hf_qk(family: str, d: int) -> Callable[[str, tuple[int, ...]], np.ndarray | None]:
    def qk(path: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if family == "gpt2" and re.search(r"attn/c_attn/(kernel|bias)$", path):
            m = np.zeros(shape, np.float32)   # Conv1D kernel [3D, D], bias [3D]: rows [Q | K | V]
            m[: 2 * d] = 1.0
            return m
        if family in ("gptneo", "opt") and re.search(r"attn/(attention/)?(q_proj|k_proj)/", path):
            return np.ones(shape, np.float32)
        if family == "llama" and re.search(r"self_attn/(q_proj|k_proj)/", path):
            return np.ones(shape, np.float32)
        return None
    return qk


def hf_adapter(family: str, kwargs: Mapping[str, Any], vocab: int, seq: int, dtype: Any) -> ModelAdapter:
    """A tiny random-init HF-Flax GPT-2 (tied head) or Llama (untied), or (BLIND) GPT-Neo or OPT
    (tied), under ``vitals.instrument()``."""
    model = _hf_build(family, kwargs, vocab, seq, 0, dtype)
    roles = vitals.Roles(qkv_split=vitals.QKVSplit.from_config(model.config))
    module = model.module

    def init(seed: int) -> Any:
        return jax.device_get(_hf_build(family, kwargs, vocab, seq, seed, dtype).params)

    def forward(params, batch):
        logits, inter = _hf_call(module, params, batch)
        return rm.cross_entropy(logits, batch["labels"], batch["mask"]), inter

    def lm_loss(params, batch):
        return forward(params, batch)[0]

    d = kwargs["n_embd"] if family == "gpt2" else kwargs["hidden_size"]
    emb = {"gpt2": r"^transformer/wte/", "gptneo": r"^transformer/wte/",
           "opt": r"^model/decoder/embed_tokens/"}.get(family, r"^model/embed_tokens/")
    head = r"^lm_head/" if family == "llama" else None      # GPT-2, GPT-Neo, OPT: tied
    return ModelAdapter(family, vocab, roles, init, forward, lm_loss, None, emb, head, _hf_qk(family, d),
                        dict(kwargs, vocab=vocab, dtype=jnp.dtype(dtype).name))


# ----------------------------------------------------------------------------------
# Optimizers.


def _decay_mask(params: Any) -> Any:
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(kind: str, schedule: optax.Schedule, weight_decay: float) -> optax.GradientTransformation:
    """``adamw`` (b2 0.95), ``lion``, ``sgdm`` (Nesterov momentum 0.9, coupled decay) or
    ``adafactor``; BLIND only: ``adabelief`` (decoupled decay) and ``rmsprop`` (momentum 0.9,
    coupled decay); weight decay on matrices only (not on norm scales and biases)."""
    if kind == "adamw":
        return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_decay_mask)
    if kind == "lion":
        return optax.lion(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay, mask=_decay_mask)
    if kind == "sgdm":
        return optax.chain(optax.add_decayed_weights(weight_decay, _decay_mask),
                           optax.sgd(schedule, momentum=0.9, nesterov=True))
    if kind == "adafactor":
        return optax.adafactor(schedule, weight_decay_rate=weight_decay or None, weight_decay_mask=_decay_mask)
    if kind == "adabelief":  # BLIND: AdaBelief with decoupled weight decay
        return optax.chain(optax.scale_by_belief(b1=0.9, b2=0.999), optax.add_decayed_weights(weight_decay, _decay_mask),
                           optax.scale_by_learning_rate(schedule))
    if kind == "rmsprop":    # BLIND: RMSProp (decay 0.95) with heavy-ball momentum 0.9, coupled decay
        return optax.chain(optax.add_decayed_weights(weight_decay, _decay_mask),
                           optax.rmsprop(schedule, decay=0.95, eps=1e-8, momentum=0.9))
    raise KeyError(f"unknown optimizer {kind!r}")


def fault_scale(adapter: ModelAdapter) -> optax.GradientTransformationExtraArgs:
    """The faults' update multipliers, last in the recorded chain (identity when every
    control is 1): ``lr_mult`` (every update), ``emb_mult`` (the embedding's),
    ``qk_mult`` (the Wq/Wk entries'). Reads the extra argument ``fault_ctl``."""
    def update(updates, state, params=None, *, fault_ctl=None, **_):
        if fault_ctl is None:
            return updates, state

        def f(path, u):
            ps = jax.tree_util.keystr(path, simple=True, separator="/")
            m = fault_ctl["lr_mult"]
            if re.search(adapter.emb, ps):
                m = m * fault_ctl["emb_mult"]
            qk = adapter.qk(ps, u.shape)
            if qk is not None:
                m = m * (1.0 + (fault_ctl["qk_mult"] - 1.0) * jnp.asarray(qk))
            return u * m
        return jax.tree_util.tree_map_with_path(f, updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


# ----------------------------------------------------------------------------------
# The jitted step.


def _loss_scale_init(fp16: bool) -> dict[str, jax.Array]:
    """A dynamic loss scale (jmp-style) as device scalars: ``scale``, ``good`` (finite
    steps since the last change), ``skipped`` (steps skipped so far); 1 without fp16."""
    return dict(scale=jnp.float32(LOSS_SCALE_INIT if fp16 else 1.0), good=jnp.int32(0), skipped=jnp.int32(0))


def _loss_scale_next(ls: Mapping[str, jax.Array], finite: jax.Array) -> dict[str, jax.Array]:
    """Halve on a non-finite gradient (the step is skipped); double after
    ``LOSS_SCALE_PERIOD`` finite steps."""
    grow = finite & (ls["good"] + 1 >= LOSS_SCALE_PERIOD)
    scale = jnp.where(finite, jnp.where(grow, ls["scale"] * 2.0, ls["scale"]), jnp.maximum(ls["scale"] / 2.0, 1.0))
    good = jnp.where(finite & ~grow, ls["good"] + 1, 0)
    return dict(scale=scale, good=good, skipped=ls["skipped"] + (~finite).astype(jnp.int32))


def _param_faults(adapter: ModelAdapter, params: Any, ctl: Mapping[str, jax.Array]) -> Any:
    """Multiplicative growth of the embedding / the LM head, the router bias push."""
    def f(path, w):
        ps = jax.tree_util.keystr(path, simple=True, separator="/")
        if re.search(adapter.emb, ps):
            w = w * (1.0 + ctl["emb_growth"])
        if adapter.head and re.search(adapter.head, ps):
            w = w * (1.0 + ctl["head_growth"])
        if ps.endswith("moe/expert_bias"):
            w = w + jnp.broadcast_to(ctl["bias_push"], w.shape)
        return w
    return jax.tree_util.tree_map_with_path(f, params)


def build_trainer(adapter: ModelAdapter, optimizer: str, schedule: optax.Schedule, weight_decay: float,
                  fp16: bool) -> types.SimpleNamespace:
    """The optimizer, the jitted step (static ``full``: the heavy family) and the val loss."""
    tx = vitals.with_lr_scale(vitals.record(
        optax.chain(optax.clip_by_global_norm(1.0), make_optimizer(optimizer, schedule, weight_decay),
                    fault_scale(adapter)),
        roles=adapter.roles, schedule=schedule))

    @functools.partial(jax.jit, static_argnames="full")
    def step(params, opt_state, ls, batch, ctl, full):
        def loss_of(p):
            loss, inter = adapter.forward(p, batch)
            return loss * ctl["loss_weight"] * ls["scale"], (loss * ctl["loss_weight"], inter)

        (_, (loss, inter)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        grads = jax.tree.map(lambda g: g / ls["scale"], grads)
        updates, new_opt = tx.update(grads, opt_state, params, vitals_heavy=full, fault_ctl=ctl)
        new = _param_faults(adapter, optax.apply_updates(params, updates), ctl)
        if adapter.top_k:
            new = rm.update_expert_bias(new, inter, rate=1e-3)   # aux-loss-free balancing
        metrics = {"loss": loss}
        if fp16:    # skip the update on a non-finite gradient (params and optimizer state kept)
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
            new, new_opt = jax.tree.map(lambda a, b: jnp.where(finite, a, b), (new, new_opt), (params, opt_state))
            ls = _loss_scale_next(ls, finite)
            metrics |= {"opt/loss_scale": ls["scale"], "opt/skipped_steps": ls["skipped"].astype(jnp.float32)}
        if adapter.top_k:
            metrics |= vitals.moe_metrics(inter, expert_bias=params, top_k=adapter.top_k)
        if full:
            metrics |= vitals.activation_metrics(inter, mask=batch["mask"], labels=batch["labels"])
            metrics |= vitals.optimizer_metrics(new_opt)
        return new, new_opt, ls, metrics, vitals.recorded(new_opt)

    @jax.jit
    def val_loss(params, batches):
        return sum(adapter.lm_loss(params, b) for b in batches) / len(batches)

    return types.SimpleNamespace(tx=tx, step=step, val_loss=val_loss, schedule=schedule)


# ----------------------------------------------------------------------------------
# Data and fault controls.

NEW_FAULT_KINDS = ("qk_lr", "shard", "no_warmup", "moments_reset", "degrade")


def reset_moments(opt_state: Any) -> Any:
    """The optimizer state with every Adam/Lion moment (and Adam's bias-correction count) at
    zero, everything else (the schedule's count, the recorder) kept: what a restart that loaded
    the parameters but not the optimizer's moments resumes with."""
    def zero(x: Any) -> Any:
        if isinstance(x, optax.ScaleByAdamState):
            return x._replace(count=jnp.zeros_like(x.count), mu=jax.tree.map(jnp.zeros_like, x.mu),
                              nu=jax.tree.map(jnp.zeros_like, x.nu))
        if isinstance(x, optax.ScaleByLionState):
            return x._replace(mu=jax.tree.map(jnp.zeros_like, x.mu))
        return x

    is_state = lambda x: isinstance(x, (optax.ScaleByAdamState, optax.ScaleByLionState))  # noqa: E731
    return jax.tree.map(zero, opt_state, is_leaf=is_state)


class Data:
    """The batches of one run: a data source, its validation batches and the data faults.

    Args:
      kind: ``bigram``, ``pystdlib`` or ``pydocs``.
      vocab: vocabulary (bigram only; the texts use 258).
      seed: the run's data seed.
      batch, seq, pad_fraction: batch shape and padding.
      shard_sequences: sequences in the repeated shard (the ``shard`` fault).
    """

    def __init__(self, kind: str, vocab: int, seed: int, batch: int, seq: int, pad_fraction: float,
                 shard_sequences: int = 1024) -> None:
        self.kind, self.vocab, self.seed = kind, vocab, seed
        self.batch_size, self.seq, self.pad = batch, seq, pad_fraction
        self.text = None if kind in ("bigram", "markov2") else cd.load_text(kind)
        self.cfg = rm.ModelConfig(vocab=vocab)
        self.shard_n = shard_sequences

    def _plain(self, key: int) -> dict[str, np.ndarray]:
        if self.kind == "markov2":
            return cd.markov2_batch(key, self.batch_size, self.seq, self.pad, self.vocab)
        if self.text is None:
            b = rm.make_batch(key, self.cfg, self.batch_size, self.seq, pad_fraction=self.pad)
            return {k: np.asarray(v) for k, v in b.items()}
        return cd.text_batch(self.text.train, key, self.batch_size, self.seq, self.pad)

    def _shard(self, step: int) -> dict[str, np.ndarray]:
        """A batch drawn from the fixed shard of ``shard_n`` sequences (with replacement)."""
        rng = np.random.default_rng(77_000_000 + 31 * self.seed + step)
        if self.text is None:   # the shard: shard_n / B fixed bigram batches, one served per step
            return self._plain(5_000_000 + 1_000_003 * self.seed + int(rng.integers(self.shard_n // self.batch_size)))
        pool = cd.shard_starts(self.text.train, 55_000 + self.seed, self.shard_n, self.seq)
        starts = pool[rng.integers(0, self.shard_n, self.batch_size)]
        return cd.text_batch(self.text.train, 66_000_000 + 31 * self.seed + step, self.batch_size, self.seq,
                             self.pad, starts=starts)

    def batch(self, step: int, host: Mapping[str, Any], fault_step: int | None, overfit_n: int) -> dict:
        """The batch of ``step`` (host flags: ``overfit``, ``shard``, ``corrupt``)."""
        if host.get("shard"):
            b = self._shard(step)
        else:
            pos = step
            if host.get("overfit"):
                pos = fault_step + (step - fault_step) % overfit_n
            b = self._plain(1_000_003 * self.seed + pos)
        if host.get("corrupt"):
            rng = np.random.default_rng(99_000 + 31 * self.seed + step)
            m = b["mask"]
            b = dict(b, tokens=np.where(m, rng.integers(2, self.vocab, m.shape), cd.PAD_ID).astype(np.int32),
                     labels=np.where(m, rng.integers(2, self.vocab, m.shape), cd.PAD_ID).astype(np.int32))
        if host.get("degrade", 0.0) > 0.0:   # that share of the sequences, random tokens and labels
            rng = np.random.default_rng(98_000 + 31 * self.seed + step)
            m = b["mask"] & (rng.random((b["mask"].shape[0], 1)) < host["degrade"])
            noise = lambda: rng.integers(2, self.vocab, m.shape)  # noqa: E731
            b = dict(b, tokens=np.where(m, noise(), b["tokens"]).astype(np.int32),
                     labels=np.where(m, noise(), b["labels"]).astype(np.int32))
        return b

    def val_batches(self) -> list[dict[str, np.ndarray]]:
        """``VAL_BATCHES`` fixed held-out batches (the val split's files for the texts)."""
        if self.text is None:
            return [self._plain(10_000_000 + 7919 * self.seed + i) for i in range(VAL_BATCHES)]
        return [cd.text_batch(self.text.val, 10_000_000 + 7919 * self.seed + i, self.batch_size, self.seq, self.pad)
                for i in range(VAL_BATCHES)]

    def describe(self) -> dict[str, Any]:
        """The data's figures for the metadata."""
        out = dict(data=self.kind, vocab=self.vocab, batch=self.batch_size, seq=self.seq, pad_fraction=self.pad)
        if self.text is not None:
            out["text"] = self.text.describe()
        return out


def controls(run: Any, step: int) -> dict[str, Any]:
    """Per-step fault controls: ``fault_suite._controls`` for its fault kinds, plus
    ``qk_mult`` (the Wq/Wk LR fault) and the host flag ``shard`` (the repeated shard)."""
    kind = run.fault
    healthy = types.SimpleNamespace(fault=None, fault_step=None, params={})
    base = fs._controls(run if kind not in NEW_FAULT_KINDS else healthy, step)
    base.update(qk_mult=1.0, shard=False, degrade=0.0)
    if kind in NEW_FAULT_KINDS and step >= run.fault_step:
        if kind == "qk_lr":
            ramp = float(run.params.get("ramp", 0))
            t = (step - run.fault_step + 1) / ramp if ramp else 1.0
            base["qk_mult"] = 1.0 + (float(run.params["mult"]) - 1.0) * min(1.0, t)
        elif kind == "shard":
            base["shard"] = True
        elif kind == "degrade":
            base["degrade"] = float(run.params["share"]) * min(1.0, (step - run.fault_step + 1) / float(run.params["ramp"]))
    return base


# ----------------------------------------------------------------------------------
# One run.

_TRAINERS: dict[tuple[Any, ...], tuple[ModelAdapter, types.SimpleNamespace]] = {}


def make_adapter(family: str, kwargs: Mapping[str, Any], vocab: int, seq: int, fp16: bool) -> ModelAdapter:
    """The adapter of a model family (``ref``, ``gpt2``, ``llama``)."""
    dtype = jnp.float16 if fp16 else jnp.float32
    if family == "ref":
        return ref_adapter(kwargs, vocab, dtype)
    return hf_adapter(family, kwargs, vocab, seq, dtype)


def trainer_for(setup: Any, warmup: int) -> tuple[ModelAdapter, types.SimpleNamespace]:
    """The adapter and trainer of ``setup`` with ``warmup`` warm-up steps (built once per process)."""
    key = (setup.name, warmup)
    if key not in _TRAINERS:
        family, kwargs = setup.model_spec
        adapter = make_adapter(family, kwargs, setup.vocab, setup.seq, setup.precision == "fp16")
        sched = make_schedule(setup.schedule, setup.peak_lr, warmup, setup.horizon, setup.end_frac,
                              setup.decay_frac)
        _TRAINERS[key] = adapter, build_trainer(adapter, setup.optimizer, sched, setup.weight_decay,
                                                setup.precision == "fp16")
    return _TRAINERS[key]


_FREE_GROUP = re.compile(r"^(grad/norm|grad/share|param/norm|update/param_ratio)/(layer_\d+|embedding|lm_head)$")


def _row(metrics: Mapping[str, Any], rec: Any, full: bool = True) -> dict[str, float]:
    """This step's figures: the step's own and the recorder's fresh ones (``dict`` of a
    host ``PackedMetrics`` holds only the families computed at this update). Stored as
    the corpus was first generated: the recorder's window is left out
    (``benchmarks/windows.py`` rebuilds it from the every-step figures) and its per-group
    figures, on every update since issue 35, are kept at the heavy steps only."""
    row = {k: float(v) for k, v in metrics.items()}
    row.update({k: float(v) for k, v in dict(rec).items()
                if not k.startswith("window/") and (full or not _FREE_GROUP.match(k))})
    return row


def train_run(setup: Any, run: Any, log: Callable[[str], None] = print) -> tuple[list[dict[str, float]], dict]:
    """Train ``run`` of ``setup``; returns every step's figures and the run's measured facts.

    Args:
      setup: a ``corpus.Setup``.
      run: a ``corpus.CorpusRun`` (``fault``, ``fault_step``, ``params``, ``seed``, ``steps``).
      log: progress lines.

    Returns:
      ``(rows, facts)``: ``rows[s]`` the figures of step ``s``; ``facts`` timings and the data's
      description.
    """
    warmup = 0 if run.fault == "no_warmup" else setup.warmup
    adapter, tr = trainer_for(setup, warmup)
    params = adapter.init(run.seed)
    opt_state = tr.tx.init(params)
    ls = _loss_scale_init(setup.precision == "fp16")
    data = Data(setup.data, setup.vocab, run.seed, setup.batch, setup.seq, setup.pad_fraction,
                int(run.params.get("sequences", 1024)))
    val = jax.device_put(data.val_batches())
    n_exp = int(setup.model_spec[1].get("n_experts", 0))
    push = np.zeros(max(n_exp, 1), np.float32)
    push[: int(run.params.get("experts", 0))] = 1.0
    timer = vitals.StepTimer(tokens_per_step=setup.batch * setup.seq, clock=time.process_time)
    rows, wall, cpu, sleep_s = [], [], [], 0.0
    t0 = time.perf_counter()
    for step in range(run.steps):
        ctl = controls(run, step)
        host = {k: ctl.pop(k) for k in ("corrupt", "overfit", "sleep", "shard", "degrade")}
        if host["sleep"] and sleep_s == 0.0:
            sleep_s = float(np.median(cpu[-300:])) * float(run.params["factor"])
            log(f"  {run.name}: {sleep_s * 1e3:.1f} ms of extra host work per step from step {step}")
        full = step % setup.layers_every == 0
        batch = data.batch(step, host, run.fault_step, int(run.params.get("n_batches", 2)))
        if run.fault == "moments_reset" and step == run.fault_step:
            opt_state = reset_moments(opt_state)
        dev_ctl = {k: jnp.float32(v) for k, v in ctl.items()}
        dev_ctl["bias_push"] = jnp.asarray(push[:max(n_exp, 1)] * ctl["bias_push"])
        ts, cs = time.perf_counter(), time.process_time()
        params, opt_state, ls, metrics, rec = tr.step(params, opt_state, ls, batch, dev_ctl, full)
        if host["sleep"]:
            fs._busy(sleep_s)
        row = _row(*jax.device_get((metrics, rec)), full=full)
        wall.append(time.perf_counter() - ts)
        cpu.append(time.process_time() - cs)
        timer.step()
        row.update(timer.metrics())
        if full:
            row["val/loss"] = float(tr.val_loss(params, val))
        rows.append(row)
        if step % 1000 == 0:
            log(f"  {run.name} step {step}/{run.steps} loss {row['loss']:.3f} "
                f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.1f} ms/step")
    facts = dict(data.describe(), warmup_steps=warmup, sleep_s=sleep_s, wall_s=time.perf_counter() - t0,
                 median_step_ms=float(np.median(wall)) * 1e3, median_step_cpu_ms=float(np.median(cpu)) * 1e3,
                 throughput_clock="process_time", model_config=adapter.describe,
                 n_params=int(sum(np.size(x) for x in jax.tree.leaves(params))))
    return rows, facts
