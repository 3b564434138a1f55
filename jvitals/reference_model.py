"""A small decoder-only Flax Linen transformer, instrumented for jvitals.

Used by the tests, examples and benchmarks. One :class:`ModelConfig` switches between a
dense and an MoE MLP (sigmoid top-k router with an expert-selection bias), fused-QKV
attention (grouped-query K/V) and MLA (low-rank ``q_down/q_up``, ``kv_down/kv_up``), an
optional sigmoid output gate on attention, K MTP heads (DeepSeek-V3 style), and layers as a
Python list (``layers_{i}``) or ``nn.scan``-stacked (``layers``). It sows under the
METRICS.md §7 names (raw tensors, or the probes of :mod:`jvitals.metrics.probes` with
``use_probes=True``), and its parameter names are a contract with
:mod:`jvitals.metrics.roles`.

What it sows, its parameter names and shapes, and an example: docs/MODELS.md, "The
reference model".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jvitals.metrics import probes
from jvitals.metrics.paths import natural_key

__all__ = [
    "Decoder",
    "ModelConfig",
    "cross_entropy",
    "init_params",
    "init_perturbations",
    "loss_fn",
    "make_batch",
    "mtp_cross_entropy",
    "update_expert_bias",
]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Configuration of the reference :class:`Decoder`.

    Attributes:
      vocab: vocabulary size V (ids 0 = pad, 1 = BOS by default).
      d_model: residual width D.
      n_layers: number of transformer layers L.
      n_heads: query heads H.
      n_kv_heads: K/V heads for fused QKV (grouped-query; divides ``n_heads``).
      head_dim: per-head width Dh.
      d_ff: dense MLP width F.
      attention: ``'fused_qkv'`` or ``'mla'``.
      q_lora_rank, kv_lora_rank: MLA ranks Rq, Rkv.
      attn_gate: sigmoid gate on the attention output (gated attention).
      moe: MoE MLP instead of the dense one.
      n_experts, top_k, d_expert: MoE experts E, experts per token, expert width.
      n_mtp: number of MTP depths K.
      scan_layers: stack the layers with ``nn.scan`` (params under ``layers/``).
      dtype: compute dtype (e.g. ``jnp.bfloat16``).
      param_dtype: parameter dtype.
      bos_id, pad_id: special token ids.
      use_probes: sow compact probe summaries instead of raw tensors.
      sow_attn_logits: sow the pre-softmax attention scores (raw: ``[B, H, T, T]``).
    """

    vocab: int = 128
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    d_ff: int = 64
    attention: str = "fused_qkv"
    q_lora_rank: int = 16
    kv_lora_rank: int = 16
    attn_gate: bool = False
    moe: bool = False
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 32
    n_mtp: int = 0
    scan_layers: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bos_id: int = 1
    pad_id: int = 0
    use_probes: bool = False
    sow_attn_logits: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ("fused_qkv", "mla"):
            raise ValueError(f"ModelConfig.attention must be 'fused_qkv' or 'mla', got {self.attention!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.moe and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"ModelConfig: top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.vocab < 3:
            raise ValueError(f"ModelConfig: vocab={self.vocab} must hold pad, BOS and at least one token")


def _dense(cfg: ModelConfig, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)


def _norm(cfg: ModelConfig, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)


def _sow(module: nn.Module, cfg: ModelConfig, name: str, x: jax.Array, mask: jax.Array) -> None:
    if cfg.use_probes:
        probes.sow_summary(module, name, x, mask)
    else:
        module.sow("intermediates", name, x)


class Attention(nn.Module):
    """Causal self-attention: fused QKV (GQA) or MLA, optional sigmoid output gate."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        h, dh = cfg.n_heads, cfg.head_dim
        if cfg.attention == "fused_qkv":
            kvh = cfg.n_kv_heads
            qkv = _dense(cfg, (h + 2 * kvh) * dh, "qkv")(x)
            q, k, v = jnp.split(qkv, [h * dh, (h + kvh) * dh], axis=-1)
            q = q.reshape(b, t, h, dh)
            k = k.reshape(b, t, kvh, dh)
            v = v.reshape(b, t, kvh, dh)
        else:
            kvh = h
            cq = _norm(cfg, "q_norm")(_dense(cfg, cfg.q_lora_rank, "q_down")(x))
            q = _dense(cfg, h * dh, "q_up")(cq).reshape(b, t, h, dh)
            ckv = _norm(cfg, "kv_norm")(_dense(cfg, cfg.kv_lora_rank, "kv_down")(x))
            k, v = jnp.split(_dense(cfg, 2 * h * dh, "kv_up")(ckv), 2, axis=-1)
            k = k.reshape(b, t, h, dh)
            v = v.reshape(b, t, h, dh)
        v = probes.perturb_values(self, v, "bos_value")
        if kvh != h:
            k = jnp.repeat(k, h // kvh, axis=2)
            v = jnp.repeat(v, h // kvh, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(_F32) / math.sqrt(dh)
        # Padded query rows still see position 0 (BOS), so no row is all-masked.
        if cfg.sow_attn_logits and cfg.use_probes:   # the probe's summary from the softmax's own read
            probs = probes.attn_softmax_probe(self, scores, mask).astype(cfg.dtype)
        else:
            if cfg.sow_attn_logits:
                self.sow("intermediates", "attn_logits", scores)
            keys_ok = probes.attention_valid_mask(mask, t, t, 4, queries=False)
            probs = jax.nn.softmax(jnp.where(keys_ok, scores, -1e30), axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h * dh)
        _sow(self, cfg, "attn_out_before_proj", out, mask)
        if cfg.attn_gate:
            gate = jax.nn.sigmoid(_dense(cfg, h * dh, "gate")(x))
            _sow(self, cfg, "gate_scores", gate, mask)
            out = out * gate
        return _dense(cfg, cfg.d_model, "o_proj")(out)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        del mask
        cfg = self.cfg
        g = _dense(cfg, cfg.d_ff, "gate_proj")(x)
        u = _dense(cfg, cfg.d_ff, "up_proj")(x)
        return _dense(cfg, cfg.d_model, "down_proj")(nn.silu(g) * u)


class Experts(nn.Module):
    """E SwiGLU experts as stacked plain params (no ``/kernel`` suffix)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        cfg = self.cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        wg = self.param("gate_proj", init, (e, d, f), cfg.param_dtype).astype(cfg.dtype)
        wu = self.param("up_proj", init, (e, d, f), cfg.param_dtype).astype(cfg.dtype)
        wd = self.param("down_proj", init, (e, f, d), cfg.param_dtype).astype(cfg.dtype)
        hidden = nn.silu(jnp.einsum("btd,edf->btef", x, wg)) * jnp.einsum("btd,edf->btef", x, wu)
        y = jnp.einsum("btef,efd->bted", hidden, wd)
        return jnp.einsum("bted,bte->btd", y, combine.astype(cfg.dtype))


class MoE(nn.Module):
    """Sigmoid top-k router with an expert-selection bias (aux-loss-free balancing).

    ``s = sigmoid(router(x))``; experts chosen by ``top_k(s + stop_gradient(bias))``;
    combine weights ``s`` at the chosen experts, normalised to sum 1. Every expert
    runs on every token (dense; fine for tiny models). Sows ``expert_counts``
    ``[E]`` int32: top-k selections over the valid tokens (sum = n_valid * top_k).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        e = cfg.n_experts
        bias = self.param("expert_bias", nn.initializers.zeros, (e,), cfg.param_dtype)
        scores = jax.nn.sigmoid(_dense(cfg, e, "router")(x).astype(_F32))
        _, idx = lax.top_k(scores + lax.stop_gradient(bias.astype(_F32))[None, None, :], cfg.top_k)
        chosen = jnp.sum(jax.nn.one_hot(idx, e, dtype=_F32), axis=-2)  # [B, T, E] in {0, 1}
        weights = scores * chosen
        combine = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-9)
        counts = jnp.sum(chosen * mask[..., None].astype(_F32), axis=(0, 1))
        self.sow("intermediates", "expert_counts", counts.astype(jnp.int32))
        return Experts(cfg, name="experts")(x, combine)


class Block(nn.Module):
    """Pre-norm transformer layer; ``(h, mask) -> (h, None)`` so it can be scanned."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.cfg
        h = h + Attention(cfg, name="attn")(_norm(cfg, "input_layernorm")(h), mask)
        x = _norm(cfg, "pre_mlp_layernorm")(h)
        h = h + (MoE(cfg, name="moe") if cfg.moe else MLP(cfg, name="mlp"))(x, mask)
        _sow(self, cfg, "hidden_states", h, mask)
        return h, None


class MTPHead(nn.Module):
    """One MTP depth: ``proj(concat(input_layernorm(h_prev), embed(token k ahead)))``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_prev: jax.Array, emb_ahead: jax.Array) -> jax.Array:
        x = jnp.concatenate([_norm(self.cfg, "input_layernorm")(h_prev), emb_ahead.astype(h_prev.dtype)], -1)
        return _dense(self.cfg, self.cfg.d_model, "proj")(x)


def _shift_left(tokens: jax.Array, d: int, fill: int) -> jax.Array:
    """``tokens[:, t + d]`` at position ``t`` (``fill`` past the end)."""
    pad = jnp.full(tokens.shape[:1] + (d,), fill, tokens.dtype)
    return jnp.concatenate([tokens[:, d:], pad], axis=1)


class Decoder(nn.Module):
    """Decoder-only LM. ``__call__(tokens [B, T], *, mask [B, T]) -> logits [B, T, V]``.

    With ``return_mtp=True`` returns ``(logits, (mtp_logits_1, ..., mtp_logits_K))``,
    where depth ``k`` at position ``t`` predicts token ``t + k + 1``.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, *, mask: jax.Array | None = None,
                 return_mtp: bool = False) -> Any:
        cfg = self.cfg
        if mask is None:
            mask = jnp.ones(tokens.shape, bool)
        mask = jnp.asarray(mask, bool)
        embed = nn.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="embed")
        h = embed(tokens)
        if cfg.scan_layers:
            stack = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0, "perturbations": 0},
                            split_rngs={"params": True}, in_axes=nn.broadcast, length=cfg.n_layers)
            h, _ = stack(cfg, name="layers")(h, mask)
        else:
            for i in range(cfg.n_layers):
                h, _ = Block(cfg, name=f"layers_{i}")(h, mask)
        final_norm = _norm(cfg, "final_layernorm")
        lm_head = _dense(cfg, cfg.vocab, "lm_head")
        logits = lm_head(final_norm(h))
        self._sow_logits("logits", logits, mask)
        mtp = []
        h_k = h
        for k in range(cfg.n_mtp):
            ahead = embed(_shift_left(tokens, k + 1, cfg.pad_id))
            h_k = MTPHead(cfg, name=f"mtp_{k}")(h_k, ahead)
            mtp_logits = lm_head(final_norm(h_k))
            self._sow_logits("mtp_logits", mtp_logits, mask)
            mtp.append(mtp_logits)
        return (logits, tuple(mtp)) if return_mtp else logits

    def _sow_logits(self, name: str, logits: jax.Array, mask: jax.Array) -> None:
        if self.cfg.use_probes:
            probes.logits_probe(self, logits, mask, name=name)
        else:
            self.sow("intermediates", name, logits)


# ----------------------------------------------------------------------------------
# Utilities for tests, examples and benchmarks.


def init_params(cfg: ModelConfig, rng: jax.Array, seq: int = 8) -> dict:
    """Initialise the parameters (only ``params``; sown and perturbation collections dropped)."""
    tokens = jnp.zeros((1, seq), jnp.int32)
    return jax.jit(lambda r: Decoder(cfg).init(r, tokens)["params"])(rng)


def init_perturbations(cfg: ModelConfig, tokens: jax.Array) -> dict:
    """Zero ``perturbations`` collection for ``tokens``' shape (for ``bos_value`` grads).

    Pass it as ``{'params': p, 'perturbations': pert}`` to ``apply`` and take the
    gradient with respect to it (see :func:`loss_fn`).
    """
    shapes = jax.eval_shape(lambda t: Decoder(cfg).init(jax.random.key(0), t), tokens)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["perturbations"])


def _transition_table(vocab: int, seed: int = 1234) -> np.ndarray:
    """A fixed sparse bigram table over ids ``2..V-1``: 3 successors per token."""
    rng = np.random.default_rng(seed)
    n = vocab - 2
    table = np.zeros((vocab, vocab), np.float64)
    for i in range(vocab):
        succ = rng.choice(n, size=min(3, n), replace=False) + 2
        table[i, succ] = np.array([0.7, 0.2, 0.1])[: len(succ)]
        table[i] /= table[i].sum()
    return table


@functools.lru_cache(maxsize=8)
def _transition_cdf(vocab: int) -> np.ndarray:
    """Row-wise CDF of :func:`_transition_table` (cached, read-only: the table is built
    once per vocabulary size instead of once per batch)."""
    cdf = np.cumsum(_transition_table(vocab), axis=1)
    cdf.setflags(write=False)
    return cdf


def make_batch(rng_or_seed: Any, cfg: ModelConfig, batch: int, seq: int,
               pad_fraction: float = 0.0) -> dict[str, jax.Array]:
    """A batch of a learnable synthetic task: a fixed random bigram (Markov) chain.

    Each row is ``[BOS, x_1, x_2, ...]`` with ``x_{i+1} ~ table[x_i]`` (3 likely
    successors per token; the table depends only on ``cfg.vocab``), so the loss
    falls from ``log V`` towards the chain's entropy (~0.8 nats). Rows are
    right-padded with ``cfg.pad_id``: each row has ``n_pad ~ U{0 .. 2 * pad_fraction
    * seq}`` padded positions (at least 2 real ones), so about ``pad_fraction`` of
    the positions are padding.

    Args:
      rng_or_seed: an int seed, a ``numpy.random.Generator`` or a JAX key.
      cfg: model configuration (vocab, bos_id, pad_id).
      batch, seq: B and T.
      pad_fraction: mean fraction of padded positions, in [0, 1).

    Returns:
      ``dict(tokens=[B, T] int32, labels=[B, T] int32, mask=[B, T] bool)``:
      ``labels[b, t]`` is the token at ``t + 1``; ``mask[b, t]`` is True when both
      ``tokens[b, t]`` and ``labels[b, t]`` are real (padding: ``pad_id``).
    """
    if isinstance(rng_or_seed, np.random.Generator):
        rng = rng_or_seed
    elif isinstance(rng_or_seed, (int, np.integer)):
        rng = np.random.default_rng(int(rng_or_seed))
    else:
        rng = np.random.default_rng(np.asarray(jax.random.key_data(rng_or_seed)).ravel().tolist())
    if not 0.0 <= pad_fraction < 1.0:
        raise ValueError(f"make_batch: pad_fraction must be in [0, 1), got {pad_fraction}")
    cdf = _transition_cdf(cfg.vocab)
    seqs = np.empty((batch, seq + 1), np.int64)
    seqs[:, 0] = cfg.bos_id
    for t in range(1, seq + 1):
        u = rng.random(batch)[:, None]
        seqs[:, t] = np.minimum((u > cdf[seqs[:, t - 1]]).sum(axis=1), cfg.vocab - 1)
    max_pad = int(round(2 * pad_fraction * seq))
    n_pad = np.minimum(rng.integers(0, max_pad + 1, size=batch), seq - 2)
    n_real = seq - n_pad
    mask = np.arange(seq)[None, :] < n_real[:, None]
    tokens = np.where(mask, seqs[:, :-1], cfg.pad_id)
    labels = np.where(mask, seqs[:, 1:], cfg.pad_id)
    return dict(tokens=jnp.asarray(tokens, jnp.int32), labels=jnp.asarray(labels, jnp.int32),
                mask=jnp.asarray(mask))


def cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Masked mean token cross-entropy, in float32.

    ``sum_valid (logsumexp(logits) - logits[label]) / max(n_valid, 1)``.
    """
    x = logits.astype(_F32)
    nll = jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    m = jnp.asarray(mask, _F32)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def mtp_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array, k: int) -> jax.Array:
    """MTP depth ``k``'s loss: position ``t`` scored against ``labels[t + k]`` where both
    ``t`` and ``t + k`` are valid, read over all ``T`` positions with the last ``k`` masked
    (MaxText's ``roll_and_mask``): the whole ``[B, T, V]`` logits, not a slice of them, so
    the compiler can fuse the loss's row reductions with any other reader of the logits.

    ``cross_entropy(logits[:, :-k], labels[:, k:], mask[:, :-k] & mask[:, k:])``, the same value.
    """
    t = labels.shape[1]
    valid = (jnp.arange(t) < t - k)[None, :]
    m = valid & jnp.asarray(mask, bool) & jnp.roll(jnp.asarray(mask, bool), -k, axis=1)
    return cross_entropy(logits, jnp.roll(labels, -k, axis=1), m)   # the wrapped-round labels masked


def loss_fn(params: Any, batch: Mapping[str, jax.Array], cfg: ModelConfig,
            perturbations: Any = None, *, mtp_weight: float = 0.3) -> tuple[jax.Array, dict]:
    """LM loss (+ ``mtp_weight`` x mean MTP loss) and the sown intermediates.

    MTP depth ``k`` at position ``t`` is scored against ``labels[t + k]``, where both
    ``t`` and ``t + k`` are valid.

    Args:
      params: model parameters.
      batch: ``make_batch`` output.
      cfg: model configuration.
      perturbations: optional ``init_perturbations`` tree; differentiate with
        respect to it for the ``bos_value`` gradients.
      mtp_weight: weight of the MTP losses.

    Returns:
      ``(loss, intermediates)`` -- for ``jax.value_and_grad(..., has_aux=True)``.
    """
    variables = {"params": params}
    if perturbations is not None:
        variables["perturbations"] = perturbations
    (logits, mtp), state = Decoder(cfg).apply(variables, batch["tokens"], mask=batch["mask"],
                                              return_mtp=True, mutable=["intermediates"])
    labels, mask = batch["labels"], batch["mask"]
    loss = cross_entropy(logits, labels, mask)
    if mtp:
        extra = []
        for k, lk in enumerate(mtp, start=1):
            extra.append(mtp_cross_entropy(lk, labels, mask, k))
        loss = loss + mtp_weight * sum(extra) / len(extra)
    return loss, state.get("intermediates", {})



def update_expert_bias(params: Any, expert_counts: Any, rate: float) -> Any:
    """Aux-loss-free balancing: ``b_e += rate * sign(mean_e(c) - c_e)`` per MoE layer.

    Under-loaded experts get a larger selection bias, over-loaded ones a smaller
    one. The bias is only used for selection (under ``stop_gradient``), so this
    rule, outside the gradient, is its only update.

    Args:
      params: model parameters holding ``.../moe/expert_bias`` (``[E]`` per listed
        layer, ``[L, E]`` scan-stacked).
      expert_counts: the ``'intermediates'`` tree a forward pass sowed (its
        ``expert_counts`` entries are matched to the params by module path), or
        the counts in layer order: a sequence of ``[E]`` or an ``[n_moe_layers, E]``
        array (which a stacked bias of the same shape takes as is).
      rate: bias update speed.

    Returns:
      ``params`` with every expert bias updated.

    Raises:
      ValueError: if the counts do not match the MoE layers.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
    bias_paths = sorted((p for p in paths if p.endswith("moe/expert_bias")), key=natural_key)
    if not bias_paths:
        raise ValueError("update_expert_bias: params hold no '.../moe/expert_bias' (not an MoE model)")
    by_path: dict[str, jax.Array] = {}
    if isinstance(expert_counts, Mapping):
        inter = expert_counts.get("intermediates", expert_counts)
        cflat = jax.tree_util.tree_flatten_with_path(inter)[0]
        for p, v in cflat:
            ps = jax.tree_util.keystr(p, simple=True, separator="/")
            m = re.match(r"(.*moe)/expert_counts(/\d+)?$", ps)
            if m:
                prefix = m.group(1)
                by_path[prefix] = by_path.get(prefix, 0) + jnp.asarray(v, _F32)
        missing = [p for p in bias_paths if p[: -len("/expert_bias")] not in by_path]
        if missing:
            raise ValueError(f"update_expert_bias: no sown expert_counts for {missing}; "
                             f"found counts at {sorted(by_path)}")
        counts = {p: by_path[p[: -len("/expert_bias")]] for p in bias_paths}
    else:
        if hasattr(expert_counts, "shape") and len(bias_paths) == 1:
            seq: Sequence[Any] = [expert_counts]
        else:
            seq = list(expert_counts)
        if len(seq) != len(bias_paths):
            raise ValueError(f"update_expert_bias: got counts for {len(seq)} MoE layer(s), "
                             f"expected {len(bias_paths)} ({bias_paths})")
        counts = {p: jnp.asarray(c, _F32) for p, c in zip(bias_paths, seq)}

    def upd(path: Any, leaf: jax.Array) -> jax.Array:
        ps = jax.tree_util.keystr(path, simple=True, separator="/")
        if ps not in counts:
            return leaf
        c = counts[ps]
        if c.shape != leaf.shape:
            raise ValueError(f"update_expert_bias: counts for {ps} have shape {c.shape}, "
                             f"the bias has shape {leaf.shape}")
        step = rate * jnp.sign(jnp.mean(c, axis=-1, keepdims=True) - c)
        return (leaf.astype(_F32) + step).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(upd, params)
