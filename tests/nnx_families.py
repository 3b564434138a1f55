"""Models of the naming families jvitals' roles know, written from each family's own source.

Each model holds its parameters under the module and parameter names, and in the array
layouts, its source gives them (the file is named beside each class); dimensions are
tiny (2 layers, d = 32). They have no forward pass: the role tests feed them random
gradients of the parameters' structure (a forward pass only matters for activations).
Where the family is Flax NNX the model is NNX (``nnx.Param`` leaves; PyTorch sources
keep ``weight [out, in]``, as a port that loads their checkpoints does); where it is Flax
Linen (MaxText, T5X, Flaxformer, the Gemma library) it is a Linen module whose ``init``
gives the parameter tree. tunix's NNX Gemma 4 is the real model (``nnx_models.tunix_module``).
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

D, H, KVH, DH, F, V, L = 32, 4, 2, 8, 48, 61, 2
"""Model width, query heads, key/value heads, head width, MLP width, vocabulary, layers."""


def _param(rngs: nnx.Rngs, *shape: int) -> nnx.Param:
    return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape, jnp.float32))


class Weight(nnx.Module):
    """A PyTorch module's parameter as its source names it: ``weight`` (``nn.Linear``:
    ``[out, in]``; ``nn.Embedding``: ``[V, D]``; a norm: ``[D]``)."""

    def __init__(self, *shape: int, rngs: nnx.Rngs):
        self.weight = _param(rngs, *shape)


class Kernel(nnx.Module):
    """An NNX linear layer's parameter: ``kernel [in, out]`` (bonsai's ``ShardedLinear``)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs):
        self.kernel = _param(rngs, d_in, d_out)


# ----------------------------------------------------------------------------------
# OLMo: allenai/OLMo olmo/model.py (OLMoSequentialBlock, OLMoLlamaBlock, OLMo).


class OLMoSequentialBlock(nnx.Module):
    """``att_proj [D + 2 KVD, D]`` (fused ``q, k, v = qkv.split(fused_dims)``), ``attn_out``,
    ``ff_proj [hidden, D]`` (SwiGLU: ``x, gate = x.chunk(2, dim=-1)``, so ``[up | gate]``;
    GELU: a plain up projection), ``ff_out [D, hidden * output_multiplier]``, ``attn_norm``,
    ``ff_norm``, and with ``attention_layer_norm`` ``q_norm [D]``, ``k_norm [KVD]``."""

    def __init__(self, *, swiglu: bool, rngs: nnx.Rngs):
        kvd = KVH * DH
        hidden = 2 * F if swiglu else F
        self.att_proj = Weight(D + 2 * kvd, D, rngs=rngs)
        self.attn_out = Weight(D, D, rngs=rngs)
        self.ff_proj = Weight(hidden, D, rngs=rngs)
        self.ff_out = Weight(D, F, rngs=rngs)
        self.attn_norm = Weight(D, rngs=rngs)
        self.ff_norm = Weight(D, rngs=rngs)
        self.q_norm = Weight(D, rngs=rngs)
        self.k_norm = Weight(kvd, rngs=rngs)


class OLMoLlamaBlock(nnx.Module):
    """``q_proj``, ``k_proj``, ``v_proj``, ``attn_out``, ``ff_proj [2F, D]`` (SwiGLU ``[up |
    gate]``), ``ff_out``, ``attn_norm``, ``ff_norm``."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.q_proj = Weight(D, D, rngs=rngs)
        self.k_proj = Weight(KVH * DH, D, rngs=rngs)
        self.v_proj = Weight(KVH * DH, D, rngs=rngs)
        self.attn_out = Weight(D, D, rngs=rngs)
        self.ff_proj = Weight(2 * F, D, rngs=rngs)
        self.ff_out = Weight(D, F, rngs=rngs)
        self.attn_norm = Weight(D, rngs=rngs)
        self.ff_norm = Weight(D, rngs=rngs)


class OLMoTransformer(nnx.Module):
    """``OLMo.transformer``: ``wte``, ``blocks``, ``ln_f`` and, without ``weight_tying``,
    ``ff_out [V, D]`` (the output layer: ``logits = self.transformer.ff_out(x)``)."""

    def __init__(self, *, block: str, swiglu: bool, weight_tying: bool, rngs: nnx.Rngs):
        self.wte = Weight(V, D, rngs=rngs)
        make = (lambda: OLMoSequentialBlock(swiglu=swiglu, rngs=rngs)) if block == "sequential" else (
            lambda: OLMoLlamaBlock(rngs=rngs))
        self.blocks = nnx.List([make() for _ in range(L)])
        self.ln_f = Weight(D, rngs=rngs)
        if not weight_tying:
            self.ff_out = Weight(V, D, rngs=rngs)


class OLMo(nnx.Module):
    def __init__(self, *, block: str = "sequential", swiglu: bool = True, weight_tying: bool = False,
                 seed: int = 0):
        self.transformer = OLMoTransformer(block=block, swiglu=swiglu, weight_tying=weight_tying,
                                           rngs=nnx.Rngs(seed))


# ----------------------------------------------------------------------------------
# OLMo-core: allenai/OLMo-core src/olmo_core/nn/transformer/model.py (embeddings, blocks,
# lm_head), transformer/block.py (attention, attention_norm, feed_forward, feed_forward_norm,
# feed_forward_moe), attention/__init__.py (w_q, w_k, w_v, w_out, w_g, q_norm, k_norm),
# feed_forward.py (w1, w2, w3), lm_head.py (norm, w_out), moe/mlp.py (w1 [E*D, F], w2 [E*F, D],
# w3 [E*D, F] as bare parameters), moe/router.py (weight [E*D], flattened).


class OLMoCoreAttention(nnx.Module):
    def __init__(self, *, gated: bool, rngs: nnx.Rngs):
        self.w_q = Weight(H * DH, D, rngs=rngs)
        self.w_k = Weight(KVH * DH, D, rngs=rngs)
        self.w_v = Weight(KVH * DH, D, rngs=rngs)
        self.w_out = Weight(D, H * DH, rngs=rngs)
        if gated:
            self.w_g = Weight(H * DH, D, rngs=rngs)
        self.q_norm = Weight(H * DH, rngs=rngs)
        self.k_norm = Weight(KVH * DH, rngs=rngs)


class OLMoCoreFeedForward(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.w1 = Weight(F, D, rngs=rngs)
        self.w2 = Weight(D, F, rngs=rngs)
        self.w3 = Weight(F, D, rngs=rngs)


class OLMoCoreMoEMLP(nnx.Module):
    def __init__(self, experts: int, *, rngs: nnx.Rngs):
        self.w1 = _param(rngs, experts * D, F)
        self.w2 = _param(rngs, experts * F, D)
        self.w3 = _param(rngs, experts * D, F)


class OLMoCoreParallelMLP(nnx.Module):
    def __init__(self, experts: int, *, rngs: nnx.Rngs):
        self.mlp = OLMoCoreMoEMLP(experts, rngs=rngs)


class OLMoCoreMoE(nnx.Module):
    def __init__(self, experts: int, *, rngs: nnx.Rngs):
        self.router = Weight(experts * D, rngs=rngs)
        self.experts = OLMoCoreParallelMLP(experts, rngs=rngs)
        self.shared_mlp = OLMoCoreFeedForward(rngs=rngs)


class OLMoCoreBlock(nnx.Module):
    def __init__(self, *, moe: bool, gated: bool, rngs: nnx.Rngs):
        self.attention = OLMoCoreAttention(gated=gated, rngs=rngs)
        self.attention_norm = Weight(D, rngs=rngs)
        if moe:
            self.feed_forward_moe = OLMoCoreMoE(4, rngs=rngs)
        else:
            self.feed_forward = OLMoCoreFeedForward(rngs=rngs)
        self.feed_forward_norm = Weight(D, rngs=rngs)


class OLMoCoreLMHead(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = Weight(D, rngs=rngs)
        self.w_out = Weight(V, D, rngs=rngs)


class OLMoCore(nnx.Module):
    """Block 0 dense with a gated attention (``w_g``), block 1 MoE."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embeddings = Weight(V, D, rngs=rngs)
        self.blocks = nnx.List([OLMoCoreBlock(moe=i == 1, gated=i == 0, rngs=rngs) for i in range(L)])
        self.lm_head = OLMoCoreLMHead(rngs=rngs)


# ----------------------------------------------------------------------------------
# LLaDA: jax-ml/bonsai bonsai/models/llada/modeling.py (LLaDALlamaBlock, LLaDAModel; NNX,
# kernels [in, out]): ff_proj is the gate (x = silu(ff_proj(x)) * up_proj(x)); the
# top-level ff_out is the output layer.


class LLaDARMSNorm(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.weight = _param(rngs, D)


class LLaDALlamaBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.attn_norm = LLaDARMSNorm(rngs=rngs)
        self.ff_norm = LLaDARMSNorm(rngs=rngs)
        self.q_proj = Kernel(D, D, rngs=rngs)
        self.k_proj = Kernel(D, KVH * DH, rngs=rngs)
        self.v_proj = Kernel(D, KVH * DH, rngs=rngs)
        self.attn_out = Kernel(D, D, rngs=rngs)
        self.ff_proj = Kernel(D, F, rngs=rngs)
        self.up_proj = Kernel(D, F, rngs=rngs)
        self.ff_out = Kernel(F, D, rngs=rngs)


class LLaDAModel(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.wte = nnx.Embed(V, D, rngs=rngs)
        self.ln_f = LLaDARMSNorm(rngs=rngs)
        self.blocks = nnx.List([LLaDALlamaBlock(rngs=rngs) for _ in range(L)])
        self.ff_out = Kernel(D, V, rngs=rngs)


# ----------------------------------------------------------------------------------
# DeepSeek-V3: deepseek-ai/DeepSeek-V3 inference/model.py (MLA: wq_a, q_norm, wq_b, or wq
# when q_lora_rank == 0; wkv_a [kv_lora_rank + qk_rope_head_dim, D], kv_norm, wkv_b, wo;
# MLP w1, w2, w3; MoE gate (weight [E, D], bias [E]), experts, shared_experts; Block attn,
# ffn, attn_norm, ffn_norm; Transformer embed, layers, norm, head). PyTorch layouts.

RQ, RKV, NOPE, ROPE, DV, FM, E = 16, 12, 8, 4, 8, 24, 4
"""q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, moe_inter_dim, experts."""


class DeepSeekMLA(nnx.Module):
    def __init__(self, *, q_lora: bool, rngs: nnx.Rngs):
        qk = NOPE + ROPE
        if q_lora:
            self.wq_a = Weight(RQ, D, rngs=rngs)
            self.q_norm = Weight(RQ, rngs=rngs)
            self.wq_b = Weight(H * qk, RQ, rngs=rngs)
        else:
            self.wq = Weight(H * qk, D, rngs=rngs)
        self.wkv_a = Weight(RKV + ROPE, D, rngs=rngs)
        self.kv_norm = Weight(RKV, rngs=rngs)
        self.wkv_b = Weight(H * (NOPE + DV), RKV, rngs=rngs)
        self.wo = Weight(D, H * DV, rngs=rngs)


class DeepSeekMLP(nnx.Module):
    def __init__(self, inter: int, *, rngs: nnx.Rngs):
        self.w1 = Weight(inter, D, rngs=rngs)
        self.w2 = Weight(D, inter, rngs=rngs)
        self.w3 = Weight(inter, D, rngs=rngs)


class DeepSeekGate(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.weight = _param(rngs, E, D)
        self.bias = _param(rngs, E)   # the expert-selection bias (``scores += self.bias``)


class DeepSeekMoE(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.gate = DeepSeekGate(rngs=rngs)
        self.experts = nnx.List([DeepSeekMLP(FM, rngs=rngs) for _ in range(E)])
        self.shared_experts = DeepSeekMLP(FM, rngs=rngs)


class DeepSeekBlock(nnx.Module):
    def __init__(self, layer_id: int, *, q_lora: bool, rngs: nnx.Rngs):
        self.attn = DeepSeekMLA(q_lora=q_lora, rngs=rngs)
        self.ffn = DeepSeekMLP(F, rngs=rngs) if layer_id < 1 else DeepSeekMoE(rngs=rngs)  # n_dense_layers = 1
        self.attn_norm = Weight(D, rngs=rngs)
        self.ffn_norm = Weight(D, rngs=rngs)


class DeepSeekV3(nnx.Module):
    def __init__(self, *, q_lora: bool = True, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = Weight(V, D, rngs=rngs)
        self.layers = nnx.List([DeepSeekBlock(i, q_lora=q_lora, rngs=rngs) for i in range(L)])
        self.norm = Weight(D, rngs=rngs)
        self.head = Weight(V, D, rngs=rngs)


# ----------------------------------------------------------------------------------
# Gemma 4 (Linen): google-deepmind/gemma gemma/gm/nn/gemma4/_modules.py (Embedder
# input_embedding [V, D]; Attention q_einsum [H, D, Dh], kv_einsum [2, KVH, D, Dh] or, with
# k_eq_v, k_einsum [KVH, D, Dh], attn_vec_einsum [H, Dh, D], query_norm, key_norm; FeedForward
# gating_einsum [2, F, D] and linear [F, D] in the block's own scope (nn.share_scope); Block
# pre_attention_norm, post_attention_norm, skip_scale, pre_ffw_norm, mlp, post_ffw_norm and,
# with enable_moe, mlp2 (dense) beside mlp (MoE), pre_ffw2_norm, post_ffw1_norm,
# post_ffw2_norm), _moe.py (router_logits [D, E], gating_einsum [E, 2, F, D], linear [E, F, D],
# per_expert_scale [E], router_scale [D]), _transformer.py (blocks named layer_{i},
# final_norm; the output layer is embedder.decode: tied), _layers.py (Einsum's param 'w',
# RMSNorm's 'scale').


class GemmaEinsum(nn.Module):
    shape: tuple[int, ...]
    weight_name: str = "w"

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param(self.weight_name, nn.initializers.normal(0.02), self.shape)


class GemmaRMSNorm(nn.Module):
    dim: int

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("scale", nn.initializers.ones, (self.dim,))


class GemmaFeedForward(nn.Module):
    """The dense FFW: its params sit in its own scope (``nn.share_scope``)."""

    hidden: int

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        init = nn.initializers.normal(0.02)
        return (self.param("gating_einsum", init, (2, self.hidden, D)), self.param("linear", init, (self.hidden, D)))


class GemmaMoE(nn.Module):
    experts: int
    hidden: int

    def setup(self):
        self.router_logits = GemmaEinsum((D, self.experts))
        self.linear = GemmaEinsum((self.experts, self.hidden, D))
        self.gating_einsum = GemmaEinsum((self.experts, 2, self.hidden, D))
        self.per_expert_scale = self.param("per_expert_scale", nn.initializers.ones, (self.experts,))
        self.router_scale = self.param("router_scale", nn.initializers.ones, (D,))

    def __call__(self):
        return self.router_logits(), self.linear(), self.gating_einsum()


class GemmaAttention(nn.Module):
    k_eq_v: bool

    def setup(self):
        self.attn_vec_einsum = GemmaEinsum((H, DH, D))
        self.q_einsum = GemmaEinsum((H, D, DH))
        if self.k_eq_v:
            self.k_einsum = GemmaEinsum((KVH, D, DH))
        else:
            self.kv_einsum = GemmaEinsum((2, KVH, D, DH))
        self.query_norm = GemmaRMSNorm(DH)
        self.key_norm = GemmaRMSNorm(DH)

    def __call__(self):
        kv = self.k_einsum() if self.k_eq_v else self.kv_einsum()
        return self.attn_vec_einsum(), self.q_einsum(), kv, self.query_norm(), self.key_norm()


class GemmaBlock(nn.Module):
    k_eq_v: bool
    moe: bool

    def setup(self):
        self.pre_attention_norm = GemmaRMSNorm(D)
        self.skip_scale = self.param("skip_scale", nn.initializers.ones, (1,))
        self.attn = GemmaAttention(self.k_eq_v)
        self.post_attention_norm = GemmaRMSNorm(D)
        self.pre_ffw_norm = GemmaRMSNorm(D)
        self.post_ffw_norm = GemmaRMSNorm(D)
        if self.moe:
            self.pre_ffw2_norm = GemmaRMSNorm(D)
            self.mlp2 = GemmaFeedForward(F)
            self.post_ffw2_norm = GemmaRMSNorm(D)
            self.mlp = GemmaMoE(E, FM)
            self.post_ffw1_norm = GemmaRMSNorm(D)
        else:
            self.mlp = GemmaFeedForward(F)

    def __call__(self):
        out = [self.pre_attention_norm(), self.attn(), self.post_attention_norm(), self.pre_ffw_norm(),
               self.post_ffw_norm(), self.mlp()]
        if self.moe:
            out += [self.pre_ffw2_norm(), self.mlp2(), self.post_ffw2_norm(), self.post_ffw1_norm()]
        return out


class GemmaEmbedder(nn.Module):
    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("input_embedding", nn.initializers.normal(0.02), (V, D))


class Gemma4Linen(nn.Module):
    """Layer 0 local (kv_einsum), layer 1 global with k_eq_v (k_einsum); with ``moe`` every
    block has the MoE branch beside the dense one."""

    moe: bool = True

    def setup(self):
        self.embedder = GemmaEmbedder()
        self.blocks = [GemmaBlock(k_eq_v=i == 1, moe=self.moe, name=f"layer_{i}") for i in range(L)]
        self.final_norm = GemmaRMSNorm(D)

    def __call__(self):
        return self.embedder(), [b() for b in self.blocks], self.final_norm()


# ----------------------------------------------------------------------------------
# MaxText (Linen, scanned): AI-Hypercomputer/maxtext src/maxtext/layers/attentions.py (query
# [D, H, Dh], key/value [D, KVH, Dh], out [H, Dh, D]; with share_kv_projections no value),
# linears.py MlpBlock (wi_0, wi_1 [D, F] or, with fused_mlp, wi [D, num_activations, F]
# (activations ('silu', 'linear'): [.., 0, ..] is the gate); wo [F, D]), moe.py (MoeBlock's
# gate [D, E], wi_0/wi_1 [E, D, F], wo [E, F, D]), attention_mla.py (wq_a [D, Rq], q_norm,
# wq_b [Rq, H, Dqk], wkv_a [D, Rkv + rope], kv_norm, wkv_b [Rkv, H, nope + Dv], out),
# decoders.py (token_embedder, decoder/layers scanned with param_scan_axis = 1,
# decoder_norm, logits_dense [D, V]).


def _dense(features, name, axis=-1):
    return nn.DenseGeneral(features=features, axis=axis, use_bias=False, name=name,
                           kernel_init=nn.initializers.normal(0.02))


class MaxTextAttention(nn.Module):
    mla: bool = False

    @nn.compact
    def __call__(self, x):
        if self.mla:
            q = _dense((H, NOPE + ROPE), "wq_b")(nn.RMSNorm(name="q_norm")(_dense(RQ, "wq_a")(x)))
            kv = _dense(RKV + ROPE, "wkv_a")(x)
            kv = _dense((H, NOPE + DV), "wkv_b")(nn.RMSNorm(name="kv_norm")(kv[..., :RKV]))
            o = kv[..., NOPE:] + q[..., :DV]
            return _dense(D, "out", axis=(-2, -1))(o)
        q = _dense((H, DH), "query")(x)
        k = _dense((KVH, DH), "key")(x)
        v = _dense((KVH, DH), "value")(x)
        o = q + jnp.repeat(k + v, H // KVH, axis=-2)
        return _dense(D, "out", axis=(-2, -1))(o)


class MaxTextMlp(nn.Module):
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        if self.fused:
            h = _dense((2, F), "wi")(x)
            h = nn.silu(h[..., 0, :]) * h[..., 1, :]
        else:
            h = nn.silu(_dense(F, "wi_0")(x)) * _dense(F, "wi_1")(x)
        return _dense(D, "wo")(h)


class MaxTextMoeBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.02)
        logits = _dense(E, "gate")(x)
        wi_0 = self.param("wi_0", init, (E, D, FM))
        wi_1 = self.param("wi_1", init, (E, D, FM))
        wo = self.param("wo", init, (E, FM, D))
        h = nn.silu(jnp.einsum("btd,edf->btef", x, wi_0)) * jnp.einsum("btd,edf->btef", x, wi_1)
        return jnp.einsum("btef,efd,bte->btd", h, wo, jax.nn.softmax(logits))


class MaxTextDecoderLayer(nn.Module):
    mla: bool = False
    fused_mlp: bool = False
    moe: bool = False

    @nn.compact
    def __call__(self, x, _):
        h = nn.RMSNorm(name="pre_self_attention_layer_norm")(x)
        x = x + MaxTextAttention(self.mla, name="self_attention")(h)
        h = nn.RMSNorm(name="post_self_attention_layer_norm")(x)
        if self.moe:
            x = x + MaxTextMoeBlock(name="MoeBlock_0")(h)
        else:
            x = x + MaxTextMlp(self.fused_mlp, name="mlp")(h)
        return x, None


class MaxTextDecoder(nn.Module):
    mla: bool = False
    fused_mlp: bool = False
    moe: bool = False

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(MaxTextDecoderLayer, variable_axes={"params": 1}, split_rngs={"params": True},
                       in_axes=(nn.broadcast,), length=L, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = scan(self.mla, self.fused_mlp, self.moe, name="layers")(x, None)
        x = nn.RMSNorm(name="decoder_norm")(x)
        return _dense(V, "logits_dense")(x)


class MaxText(nn.Module):
    mla: bool = False
    fused_mlp: bool = False
    moe: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="token_embedder")(tokens)
        return MaxTextDecoder(self.mla, self.fused_mlp, self.moe, name="decoder")(x)


class MaxTextSharedKVAttention(nn.Module):
    share_kv: bool

    @nn.compact
    def __call__(self, x):
        q = _dense((H, DH), "query")(x)
        k = _dense((KVH, DH), "key")(x)
        v = k if self.share_kv else _dense((KVH, DH), "value")(x)
        return _dense(D, "out", axis=(-2, -1))(q + jnp.repeat(k + v, H // KVH, axis=-2))


class MaxTextSharedKVLayer(nn.Module):
    share_kv: bool

    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm(name="pre_self_attention_layer_norm")(x)
        return x + MaxTextSharedKVAttention(self.share_kv, name="self_attention")(h)


class MaxTextSharedKVDecoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(L):
            x = MaxTextSharedKVLayer(share_kv=i == 1, name=f"layers_{i}")(x)
        x = nn.RMSNorm(name="decoder_norm")(x)
        return _dense(V, "logits_dense")(x)


class MaxTextSharedKV(nn.Module):
    """Unscanned (``scan_layers=False``: ``decoder/layers_{i}``): layer 0 with key and value,
    layer 1 with ``share_kv_projections`` (key alone, read as K and V)."""

    @nn.compact
    def __call__(self, tokens):
        return MaxTextSharedKVDecoder(name="decoder")(nn.Embed(V, D, name="token_embedder")(tokens))


# ----------------------------------------------------------------------------------
# T5X (Linen): google-research/t5x t5x/examples/t5/network.py (token_embedder; encoder and
# decoder with relpos_bias (rel_embedding [H, buckets]), layers_{i}, encoder_norm /
# decoder_norm, logits_dense [D, V]; EncoderLayer pre_attention_layer_norm, attention,
# pre_mlp_layer_norm, mlp; DecoderLayer pre_self_attention_layer_norm, self_attention,
# pre_cross_attention_layer_norm, encoder_decoder_attention, pre_mlp_layer_norm, mlp) and
# layers.py (query/key/value [D, H, Dh], out [H, Dh, D]; MlpBlock 'wi' with one activation,
# else wi_0, wi_1; wo; LayerNorm's 'scale'). Flaxformer (google/flaxformer
# components/dense.py: wi_fused [D, num_activations, F] with fuse_kernels;
# components/attention/dense_attention.py: qkv_fused [D, 3, H, Dh], query + kv_fused
# [D, 2, H, Dh]) keeps the same architecture names.

BUCKETS = 8


class T5Attention(nn.Module):
    fused: str = ""   # "", "qkv" (self-attention), "kv" (cross-attention)

    @nn.compact
    def __call__(self, x):
        if self.fused == "qkv":
            qkv = _dense((3, H, DH), "qkv_fused")(x)
            o = qkv[..., 0, :, :] + qkv[..., 1, :, :] + qkv[..., 2, :, :]
        elif self.fused == "kv":
            kv = _dense((2, H, DH), "kv_fused")(x)
            o = _dense((H, DH), "query")(x) + kv[..., 0, :, :] + kv[..., 1, :, :]
        else:
            o = _dense((H, DH), "query")(x) + _dense((H, DH), "key")(x) + _dense((H, DH), "value")(x)
        return _dense(D, "out", axis=(-2, -1))(o)


class T5Mlp(nn.Module):
    kind: str = "gated"   # "gated" (wi_0, wi_1), "relu" (wi), "fused" (Flaxformer wi_fused)

    @nn.compact
    def __call__(self, x):
        if self.kind == "gated":
            h = nn.gelu(_dense(F, "wi_0")(x)) * _dense(F, "wi_1")(x)
        elif self.kind == "relu":
            h = nn.relu(_dense(F, "wi")(x))
        else:
            h = _dense((2, F), "wi_fused")(x)
            h = nn.gelu(h[..., 0, :]) * h[..., 1, :]
        return _dense(D, "wo")(h)


class T5LayerNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("scale", nn.initializers.ones, (x.shape[-1],))


class T5RelPos(nn.Module):
    @nn.compact
    def __call__(self):
        return self.param("rel_embedding", nn.initializers.normal(0.02), (H, BUCKETS))


class T5(nn.Module):
    mlp: str = "gated"
    flaxformer: bool = False

    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(V, D, name="token_embedder")
        x = emb(tokens)
        enc = _T5Stack(self.mlp, self.flaxformer, decoder=False, name="encoder")(x, None)
        return _T5Stack(self.mlp, self.flaxformer, decoder=True, name="decoder")(x, enc)


class _T5Stack(nn.Module):
    mlp: str
    flaxformer: bool
    decoder: bool

    @nn.compact
    def __call__(self, x, enc):
        x = x + T5RelPos(name="relpos_bias")().sum()
        for i in range(L):
            x = _T5Layer(self.mlp, self.flaxformer, self.decoder, name=f"layers_{i}")(x, enc)
        x = T5LayerNorm(name="decoder_norm" if self.decoder else "encoder_norm")(x)
        return _dense(V, "logits_dense")(x) if self.decoder else x


class _T5Layer(nn.Module):
    mlp: str
    flaxformer: bool
    decoder: bool

    @nn.compact
    def __call__(self, x, enc):
        fused = "qkv" if self.flaxformer else ""
        if self.decoder:
            x = x + T5Attention(fused, name="self_attention")(T5LayerNorm(name="pre_self_attention_layer_norm")(x))
            y = T5LayerNorm(name="pre_cross_attention_layer_norm")(x)
            x = x + T5Attention("kv" if self.flaxformer else "", name="encoder_decoder_attention")(y + enc)
        else:
            x = x + T5Attention(fused, name="attention")(T5LayerNorm(name="pre_attention_layer_norm")(x))
        return x + T5Mlp(self.mlp, name="mlp")(T5LayerNorm(name="pre_mlp_layer_norm")(x))


def linen_params(module: nn.Module, *args: Sequence) -> dict:
    """``module.init(...)['params']`` under ``{'params': ...}`` (the tree a Linen train state holds)."""
    return {"params": jax.jit(module.init)(jax.random.key(0), *args)["params"]}
