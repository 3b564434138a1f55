"""Small pre-norm decoders for the natural-instability corpus (``benchmarks/natural.py``).

Each setting that the literature ties to an instability is one field of
:class:`NatConfig`, so a sick run and its control differ in exactly that field:

- ``qk_norm``: RMSNorm on each head's queries and keys (Dehghani et al. 2023; Wortsman et
  al. 2023): without it, at a high learning rate, the attention logits grow until the
  softmax saturates;
- ``softcap``: Gemma's ``c * tanh(logits / c)`` on the output logits (0: off);
- ``logits_dtype``: the dtype the LM head computes its logits in (``bfloat16`` for
  PaLM's low-precision output-logit divergence);
- ``attention``: ``mha`` (Llama's ``q_proj/k_proj/v_proj/o_proj``) or ``mla`` (DeepSeek's
  ``q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj``);
- ``n_experts``: 0 for a dense SwiGLU MLP, else a softmax top-k MoE
  (``mlp/router``, stacked ``mlp/experts/{gate,up,down}_proj``).

Two APIs with the same architecture and names: Linen (:class:`LinenDecoder`) and NNX
(:class:`NNXDecoder`). Both sow what jvitals reads (METRICS.md §7: ``attn_logits``
``[B, H, T, T]``, ``hidden_states``, ``logits``, ``expert_counts``) and, into a separate
collection jvitals never reads (``checks``), the measurements the corpus uses to confirm an
instability independently of the monitor: each layer's attention entropy (nats, mean over
valid query rows of ``-sum_k p log p``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class NatConfig:
    """One model of the natural corpus (see the module docstring for the settings)."""

    vocab: int = 258
    d_model: int = 64
    n_layers: int = 3
    n_heads: int = 4
    d_ff: int = 256
    qk_norm: bool = False
    attention: str = "mha"          # "mha" | "mla"
    q_rank: int = 48                # MLA: the query's latent width
    kv_rank: int = 32               # MLA: the keys' and values' latent width
    n_experts: int = 0
    top_k: int = 2
    d_expert: int = 128
    softcap: float = 0.0
    logits_dtype: str = "float32"
    tie_embed: bool = False
    rope: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``[B, T, H, Dh]`` (half-split form, base 10,000)."""
    t, dh = x.shape[1], x.shape[-1]
    freq = 1.0 / (10_000.0 ** (jnp.arange(0, dh // 2, dtype=F32) / (dh // 2)))
    ang = jnp.arange(t, dtype=F32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    a, b = x[..., : dh // 2], x[..., dh // 2:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal attention of ``[B, T, H, Dh]`` q, k, v under a ``[B, T]`` key mask.

    Returns ``(out [B, T, H*Dh], scores [B, H, T, T] pre-softmax, entropy [])``: the
    entropy is the mean over valid query rows of each head's ``-sum_k p log p``.
    """
    b, t, h, dh = q.shape
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((t, t), bool))
    ok = causal[None, None] & mask[:, None, None, :].astype(bool)
    ok = ok | (jnp.arange(t)[None, None, None, :] == 0)          # row never empty: BOS seen
    logp = jax.nn.log_softmax(jnp.where(ok, scores, -1e30), axis=-1)
    p = jnp.exp(logp)
    ent = -jnp.sum(jnp.where(ok, p * logp, 0.0), axis=-1)           # [B, H, T]
    rows = jnp.broadcast_to(mask[:, None, :].astype(F32), ent.shape)
    entropy = jnp.sum(ent * rows) / jnp.maximum(jnp.sum(rows), 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).reshape(b, t, h * dh)
    return out, scores, entropy


def route(logits: jax.Array, top_k: int, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing: ``(combine [B, T, E], counts [E] int32 over valid tokens)``."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)
    onehot = jax.nn.one_hot(idx, probs.shape[-1], dtype=F32)           # [B, T, k, E]
    combine = jnp.einsum("btk,btke->bte", top / jnp.sum(top, -1, keepdims=True), onehot)
    counts = jnp.sum(onehot * mask[..., None, None].astype(F32), axis=(0, 1, 2)).astype(jnp.int32)
    return combine, counts


def output_logits(h: jax.Array, w: jax.Array, cfg: NatConfig) -> jax.Array:
    """``h @ w`` in ``cfg.logits_dtype``, soft-capped when ``cfg.softcap`` > 0; float32 out."""
    dt = jnp.dtype(cfg.logits_dtype)
    logits = jnp.einsum("btd,dv->btv", h.astype(dt), w.astype(dt)).astype(F32)
    if cfg.softcap > 0:
        logits = cfg.softcap * jnp.tanh(logits / cfg.softcap)
    return logits


# ----------------------------------------------------------------------------------
# Linen.


class _LinenAttention(nn.Module):
    cfg: NatConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        h, dh = cfg.n_heads, cfg.head_dim
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)  # noqa: E731
        if cfg.attention == "mla":
            cq = nn.RMSNorm(name="q_a_layernorm")(dense(cfg.q_rank, "q_a_proj")(x))
            q = dense(h * dh, "q_b_proj")(cq).reshape(b, t, h, dh)
            ckv = nn.RMSNorm(name="kv_a_layernorm")(dense(cfg.kv_rank, "kv_a_proj_with_mqa")(x))
            k, v = jnp.split(dense(2 * h * dh, "kv_b_proj")(ckv), 2, axis=-1)
        else:
            q = dense(h * dh, "q_proj")(x).reshape(b, t, h, dh)
            k, v = dense(h * dh, "k_proj")(x), dense(h * dh, "v_proj")(x)
        k, v = k.reshape(b, t, h, dh), v.reshape(b, t, h, dh)
        if cfg.qk_norm:
            q, k = nn.RMSNorm(name="q_norm")(q), nn.RMSNorm(name="k_norm")(k)
        if cfg.rope:
            q, k = rope(q), rope(k)
        out, scores, entropy = attend(q, k, v, mask)
        self.sow("intermediates", "attn_logits", scores)
        self.sow("checks", "attn_entropy", entropy)
        return dense(cfg.d_model, "o_proj")(out)


class _LinenMLP(nn.Module):
    cfg: NatConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        if not cfg.n_experts:
            g = nn.Dense(cfg.d_ff, use_bias=False, name="gate_proj")(x)
            u = nn.Dense(cfg.d_ff, use_bias=False, name="up_proj")(x)
            return nn.Dense(cfg.d_model, use_bias=False, name="down_proj")(nn.silu(g) * u)
        combine, counts = route(nn.Dense(cfg.n_experts, use_bias=False, name="router")(x), cfg.top_k, mask)
        self.sow("intermediates", "expert_counts", counts)
        return _LinenExperts(cfg, name="experts")(x, combine)


class _LinenExperts(nn.Module):
    cfg: NatConfig

    @nn.compact
    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        cfg = self.cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        wg = self.param("gate_proj", init, (e, d, f))
        wu = self.param("up_proj", init, (e, d, f))
        wd = self.param("down_proj", init, (e, f, d))
        hidden = nn.silu(jnp.einsum("btd,edf->btef", x, wg)) * jnp.einsum("btd,edf->btef", x, wu)
        return jnp.einsum("btef,efd,bte->btd", hidden, wd, combine)


class _LinenBlock(nn.Module):
    cfg: NatConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + _LinenAttention(self.cfg, name="self_attn")(nn.RMSNorm(name="input_layernorm")(x), mask)
        x = x + _LinenMLP(self.cfg, name="mlp")(nn.RMSNorm(name="post_attention_layernorm")(x), mask)
        self.sow("intermediates", "hidden_states", x)
        return x


class LinenDecoder(nn.Module):
    """A Llama-named pre-norm decoder (``embed_tokens``, ``layers_{i}``, ``norm``, ``lm_head``)."""

    cfg: NatConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed_tokens",
                         embedding_init=nn.initializers.normal(0.02))
        x = embed(tokens)
        for i in range(cfg.n_layers):
            x = _LinenBlock(cfg, name=f"layers_{i}")(x, mask)
        x = nn.RMSNorm(name="norm")(x)
        if cfg.tie_embed:
            w = embed.embedding.T
        else:
            w = self.param("lm_head", nn.initializers.lecun_normal(), (cfg.d_model, cfg.vocab))
        logits = output_logits(x, w, cfg)
        self.sow("intermediates", "logits", logits)
        return logits


# ----------------------------------------------------------------------------------
# NNX: the same architecture and parameter names.


class _Lin(nnx.Module):
    """A bias-free linear layer whose weight is ``kernel`` (as Linen's Dense)."""

    def __init__(self, d_in: int, d_out: int, rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...]


class _NNXAttention(nnx.Module):
    def __init__(self, cfg: NatConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.n_heads * cfg.head_dim
        if cfg.attention == "mla":
            self.q_a_proj = _Lin(d, cfg.q_rank, rngs)
            self.q_a_layernorm = nnx.RMSNorm(cfg.q_rank, rngs=rngs)
            self.q_b_proj = _Lin(cfg.q_rank, hd, rngs)
            self.kv_a_proj_with_mqa = _Lin(d, cfg.kv_rank, rngs)
            self.kv_a_layernorm = nnx.RMSNorm(cfg.kv_rank, rngs=rngs)
            self.kv_b_proj = _Lin(cfg.kv_rank, 2 * hd, rngs)
        else:
            self.q_proj, self.k_proj, self.v_proj = (_Lin(d, hd, rngs) for _ in range(3))
        if cfg.qk_norm:
            self.q_norm = nnx.RMSNorm(cfg.head_dim, rngs=rngs)
            self.k_norm = nnx.RMSNorm(cfg.head_dim, rngs=rngs)
        self.o_proj = _Lin(hd, d, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        h, dh = cfg.n_heads, cfg.head_dim
        if cfg.attention == "mla":
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            k, v = jnp.split(self.kv_b_proj(self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))), 2, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (y.reshape(b, t, h, dh) for y in (q, k, v))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rope:
            q, k = rope(q), rope(k)
        out, scores, entropy = attend(q, k, v, mask)
        self.sow(nnx.Intermediate, "attn_logits", scores)
        self.sow(Checks, "attn_entropy", entropy)
        return self.o_proj(out)


class Checks(nnx.Variable):
    """The corpus' own measurements (never read by jvitals)."""


class _NNXExperts(nnx.Module):
    def __init__(self, cfg: NatConfig, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f)))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f)))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d)))

    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        hidden = (nnx.silu(jnp.einsum("btd,edf->btef", x, self.gate_proj[...]))
                  * jnp.einsum("btd,edf->btef", x, self.up_proj[...]))
        return jnp.einsum("btef,efd,bte->btd", hidden, self.down_proj[...], combine)


class _NNXMLP(nnx.Module):
    def __init__(self, cfg: NatConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        if cfg.n_experts:
            self.router = _Lin(cfg.d_model, cfg.n_experts, rngs)
            self.experts = _NNXExperts(cfg, rngs)
        else:
            self.gate_proj = _Lin(cfg.d_model, cfg.d_ff, rngs)
            self.up_proj = _Lin(cfg.d_model, cfg.d_ff, rngs)
            self.down_proj = _Lin(cfg.d_ff, cfg.d_model, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        if not self.cfg.n_experts:
            return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))
        combine, counts = route(self.router(x), self.cfg.top_k, mask)
        self.sow(nnx.Intermediate, "expert_counts", counts)
        return self.experts(x, combine)


class _NNXBlock(nnx.Module):
    def __init__(self, cfg: NatConfig, rngs: nnx.Rngs) -> None:
        self.input_layernorm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.self_attn = _NNXAttention(cfg, rngs)
        self.post_attention_layernorm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.mlp = _NNXMLP(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), mask)
        x = x + self.mlp(self.post_attention_layernorm(x), mask)
        self.sow(nnx.Intermediate, "hidden_states", x)
        return x


class NNXDecoder(nnx.Module):
    """:class:`LinenDecoder` in NNX (``layers/{i}`` instead of ``layers_{i}``)."""

    def __init__(self, cfg: NatConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([_NNXBlock(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        if not cfg.tie_embed:
            self.lm_head = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (cfg.d_model, cfg.vocab)))

    def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        x = self.norm(x)
        w = self.embed_tokens.embedding[...].T if self.cfg.tie_embed else self.lm_head[...]
        logits = output_logits(x, w, self.cfg)
        self.sow(nnx.Intermediate, "logits", logits)
        return logits


def attention_q_k_paths(cfg: NatConfig) -> dict[str, tuple[str, ...]]:
    """What QK-clip scales, by hand (for the tests): ``{"q": names, "k": names}`` of a layer."""
    if cfg.attention == "mla":
        return {"q": ("q_b_proj",), "k": ("kv_b_proj",)}
    return {"q": ("q_proj",), "k": ("k_proj",)}


def describe(cfg: NatConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
