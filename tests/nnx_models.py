"""Flax NNX models for the NNX tests: one of our own with HF-style names, and the
NNX model zoo of tunix (Llama 3, Qwen 3, Gemma), tiny and random-initialised.

tunix (``google-tunix``) is installed without its dependencies (``pip install
--no-deps google-tunix==0.1.7``; its model files need only flax, jax and
jaxtyping). Its package ``__init__`` imports heavy modules (metrax, grain, ...), so
:func:`tunix_module` loads ``tunix.models.<family>.model`` without running it, and
a test that needs it is skipped with the reason when the package is absent.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# ----------------------------------------------------------------------------------
# Our own: HF Llama names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
# down_proj, embed_tokens, lm_head, input_layernorm, post_attention_layernorm, norm).


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q_proj = nnx.Linear(d, heads * self.head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(d, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(heads * self.head_dim, d, use_bias=False, rngs=rngs)

    def __call__(self, x, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
        allowed = jnp.tril(jnp.ones((t, t), bool))[None, None] & mask[:, None, None, :]
        w = jax.nn.softmax(jnp.where(allowed, s, -1e9), axis=-1)
        return self.o_proj(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, -1))


class MLP(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, d, f, heads, kv_heads, rngs):
        self.input_layernorm = nnx.RMSNorm(d, rngs=rngs)
        self.self_attn = Attention(d, heads, kv_heads, rngs)
        self.post_attention_layernorm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = MLP(d, f, rngs)

    def __call__(self, x, mask):
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class HFStyleLM(nnx.Module):
    """A Llama-like decoder written with HF's names, in plain NNX (``nnx.List`` layers)."""

    def __init__(self, vocab=61, d=16, f=24, layers=3, heads=4, kv_heads=2, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(d, f, heads, kv_heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, mask=None):
        mask = jnp.ones(tokens.shape, bool) if mask is None else mask
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.norm(x))


# ----------------------------------------------------------------------------------
# tunix's NNX model zoo.


def tunix_module(family: str) -> types.ModuleType:
    """``tunix.models.<family>.model``, imported without running ``tunix/__init__``.

    Skips the calling test (with the reason) when tunix or a dependency of the model
    file is missing.
    """
    name = f"tunix.models.{family}.model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("tunix") if "tunix" not in sys.modules else None
    if "tunix" not in sys.modules:
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("tunix is not installed (pip install --no-deps google-tunix==0.1.7 jaxtyping)")
        pkg = types.ModuleType("tunix")  # the package without its __init__ (heavy imports)
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["tunix"] = pkg
    try:
        return importlib.import_module(name)
    except ImportError as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"tunix's {family} model does not import here: {e}")


def tunix_llama3(layers=2, vocab=53, d=16, hidden=24, heads=4, kv_heads=2, head_dim=4, tied=False, seed=0):
    """tunix's Llama 3 (GQA, per-head einsum weights ``q_proj.w [D, H, Dh]``, ``o_proj.w [H, Dh, D]``)."""
    m = tunix_module("llama3")
    cfg = m.ModelConfig(num_layers=layers, vocab_size=vocab, embed_dim=d, hidden_dim=hidden, num_heads=heads,
                        head_dim=head_dim, num_kv_heads=kv_heads, rope_theta=10_000, norm_eps=1e-5,
                        weight_tying=tied)
    return _random_mlp(m.Llama3(cfg, rngs=nnx.Rngs(seed)), seed), cfg


def tunix_qwen3(layers=2, vocab=53, d=16, hidden=24, heads=4, kv_heads=2, head_dim=4, tied=False, seed=0,
                experts=None, top_k=None):
    """tunix's Qwen 3 (GQA, q_norm / k_norm on the heads); with ``experts``, its MoE layer
    (an ``nnx.Linear`` router, expert weights ``gate_proj [E, D, F]``... as bare Params)."""
    m = tunix_module("qwen3")
    cfg = m.ModelConfig(num_layers=layers, vocab_size=vocab, embed_dim=d, hidden_dim=hidden, num_heads=heads,
                        head_dim=head_dim, num_kv_heads=kv_heads, rope_theta=10_000, norm_eps=1e-6,
                        use_tied_embedding=tied, num_experts=experts, num_experts_per_tok=top_k)
    return _random_mlp(m.Qwen3(cfg, rngs=nnx.Rngs(seed)), seed), cfg


def tunix_gemma(layers=2, vocab=53, d=16, hidden=24, heads=4, kv_heads=1, head_dim=4, seed=0):
    """tunix's Gemma (``q_einsum [H, D, Dh]``, stacked ``kv_einsum [2, KVH, D, Dh]`` when
    ``kv_heads != heads``, else ``qkv_einsum [3, H, D, Dh]``; ``attn_vec_einsum [H, Dh, D]``;
    the output layer tied to the embedding)."""
    m = tunix_module("gemma")
    cfg = m.ModelConfig(num_layers=layers, num_embed=vocab, embed_dim=d, hidden_dim=hidden, num_heads=heads,
                        head_dim=head_dim, num_kv_heads=kv_heads, final_logit_softcap=None,
                        use_post_attn_norm=False, use_post_ffw_norm=False,
                        attention_types=(m.AttentionType.GLOBAL,) * layers)
    return _random_mlp(m.Gemma(cfg, rngs=nnx.Rngs(seed)), seed), cfg


def _random_mlp(model, seed):
    """tunix initialises the MLP kernels (and Gemma's norm scales) to zero: a zero MLP gives
    zero gradients to half the figures. Give every zero-initialised parameter random values."""
    state = nnx.state(model, nnx.Param)
    key = jax.random.key(1000 + seed)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(key, len(leaves))
    new = [jnp.where(jnp.all(x == 0), 0.2 * jax.random.normal(k, x.shape, x.dtype), x) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


def tunix_inputs(tokens: jax.Array, mask: jax.Array):
    """tunix's call arguments for a right-padded batch: positions and a causal
    attention mask over the valid keys (``[B, T, T]``)."""
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    attn = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]
    return positions, attn


def batch(vocab, b=3, t=7, pad=(0, 2, 3), seed=0):
    """A right-padded batch: ``tokens [B, T]`` and ``mask [B, T]`` (row i has ``pad[i]``
    padded positions at its end)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(b, t))
    mask = np.ones((b, t), bool)
    for i, p in enumerate(pad[:b]):
        if p:
            mask[i, t - p:] = False
            tokens[i, t - p:] = 0
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)
