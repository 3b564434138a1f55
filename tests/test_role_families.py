"""Roles on the naming families users bring, each model written from its own source
(``nnx_families``; tunix's NNX Gemma 4 as it ships), every figure against NumPy.

For each family a table written here from the family's source (not from jvitals'
patterns) names what every parameter is: its metric base, and for a fused kernel the
slice of it each part is. ``gradient_metrics`` of random gradients must give, per role
and per layer, what NumPy computes on those slices; a leaf the table calls unnamed must
be unmatched (never read as another role); the head is tied exactly where the source
ties it. Then: weight matrices no role names are reported under their family, the
figures of that family say they do not include them, the recorder logs that once, and
the one line the summary gives makes them watched.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiers import tiered
from flax import nnx

import jvitals as vitals
import nnx_families as nf
import nnx_models as nm
from jvitals.metrics import explain as explain_mod

D, H, KVH, DH, F, V, L = nf.D, nf.H, nf.KVH, nf.DH, nf.F, nf.V, nf.L
KVD = KVH * DH

# tunix's model files use APIs their dependencies now deprecate: not ours to fix.
pytestmark = [pytest.mark.filterwarnings(f"ignore:{m}:DeprecationWarning") for m in (
    r".*'\.value' access is now deprecated", "'sharding' is deprecated", "jax.experimental.shard_map is deprecated",
    "jax.interpreters.pxla.thread_resources is deprecated")]

Part = Callable[[np.ndarray], np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class Family:
    """A model and, by hand, what each of its parameters is.

    Attributes:
      build: returns the parameter tree (an ``nnx.State`` or a Linen ``{'params': ...}``).
      table: ``(regex on the path, metric base or None (no role), part)``; a fused kernel
        has one row per part, ``part`` slicing it out of the (stacked) gradient.
      layer: regex whose group 1 is a list layer's index.
      stack: ``(regex, axis)`` of a scan-stacked subtree (its layer ``i`` is index ``i`` there).
      tied: whether the source ties the output layer to the embedding.
    """

    build: Callable[[], Any]
    table: tuple[tuple[str, str | None, Part], ...]
    layer: str = r"^$"
    stack: tuple[str, int] | None = None
    tied: bool = False


def _rows(prefix: str, rows: list[tuple[str, str | None, Part]]) -> list[tuple[str, str | None, Part]]:
    return [(prefix + rx, base, part) for rx, base, part in rows]


# -- OLMo (allenai/OLMo olmo/model.py): att_proj splits by fused_dims (d_model, KVD, KVD) on
# its output rows; SwiGLU's ``x, gate = x.chunk(2, dim=-1)``: ff_proj's first half of rows
# is the up projection, the second the gate. transformer.ff_out is the output layer.
_OLMO_BLOCK = _rows(r"^transformer/blocks/\d+/", [
    (r"att_proj/weight$", "Wq", lambda g: g[:D]),
    (r"att_proj/weight$", "Wk", lambda g: g[D:D + KVD]),
    (r"att_proj/weight$", "Wv", lambda g: g[D + KVD:]),
    (r"attn_out/weight$", "Wo", None),
    (r"ff_proj/weight$", "W_up", lambda g: g[:F]),
    (r"ff_proj/weight$", "W_gate", lambda g: g[F:]),
    (r"ff_out/weight$", "W_down", None),
    (r"attn_norm/weight$", "attn_norm", None),
    (r"ff_norm/weight$", "ff_norm", None),
    (r"q_norm/weight$", "q_norm", None),
    (r"k_norm/weight$", "k_norm", None),
])
_OLMO_TOP = [
    (r"^transformer/wte/weight$", "word_embeddings", None),
    (r"^transformer/ln_f/weight$", "ln_f", None),
    (r"^transformer/ff_out/weight$", "output_layer", None),
]
_OLMO_LLAMA = _rows(r"^transformer/blocks/\d+/", [
    (r"q_proj/weight$", "Wq", None), (r"k_proj/weight$", "Wk", None), (r"v_proj/weight$", "Wv", None),
    (r"attn_out/weight$", "Wo", None),
    (r"ff_proj/weight$", "W_up", lambda g: g[:F]), (r"ff_proj/weight$", "W_gate", lambda g: g[F:]),
    (r"ff_out/weight$", "W_down", None), (r"attn_norm/weight$", "attn_norm", None),
    (r"ff_norm/weight$", "ff_norm", None),
])
_OLMO_GELU = [r for r in _OLMO_BLOCK if "ff_proj" not in r[0]] + [
    (r"^transformer/blocks/\d+/ff_proj/weight$", "W_up", None)]   # GELU: output_multiplier 1, no gate

# -- OLMo-core (allenai/OLMo-core src/olmo_core/nn/...): see nnx_families.OLMoCore.
_OLMO_CORE = _rows(r"^blocks/\d+/", [
    (r"attention/w_q/weight$", "Wq", None), (r"attention/w_k/weight$", "Wk", None),
    (r"attention/w_v/weight$", "Wv", None), (r"attention/w_out/weight$", "Wo", None),
    (r"attention/w_g/weight$", "attn_gate", None),
    (r"attention/q_norm/weight$", "q_norm", None), (r"attention/k_norm/weight$", "k_norm", None),
    (r"attention_norm/weight$", "attention_norm", None), (r"feed_forward_norm/weight$", "feed_forward_norm", None),
    (r"feed_forward/w1/weight$", "W_gate", None), (r"feed_forward/w2/weight$", "W_down", None),
    (r"feed_forward/w3/weight$", "W_up", None),
    (r"feed_forward_moe/router/weight$", "router", None),
    (r"feed_forward_moe/experts/mlp/w1$", "W_gate", None), (r"feed_forward_moe/experts/mlp/w2$", "W_down", None),
    (r"feed_forward_moe/experts/mlp/w3$", "W_up", None),
    (r"feed_forward_moe/shared_mlp/w1/weight$", "W_gate", None),
    (r"feed_forward_moe/shared_mlp/w2/weight$", "W_down", None),
    (r"feed_forward_moe/shared_mlp/w3/weight$", "W_up", None),
]) + [
    (r"^embeddings/weight$", "word_embeddings", None),
    (r"^lm_head/norm/weight$", "final_norm", None),        # the final norm lives in the LM head
    (r"^lm_head/w_out/weight$", "output_layer", None),
]

# -- LLaDA (jax-ml/bonsai bonsai/models/llada/modeling.py): silu(ff_proj(x)) * up_proj(x).
_LLADA = _rows(r"^blocks/\d+/", [
    (r"q_proj/kernel$", "Wq", None), (r"k_proj/kernel$", "Wk", None), (r"v_proj/kernel$", "Wv", None),
    (r"attn_out/kernel$", "Wo", None), (r"ff_proj/kernel$", "W_gate", None), (r"up_proj/kernel$", "W_up", None),
    (r"ff_out/kernel$", "W_down", None), (r"attn_norm/weight$", "attn_norm", None),
    (r"ff_norm/weight$", "ff_norm", None),
]) + [
    (r"^wte/embedding$", "word_embeddings", None), (r"^ln_f/weight$", "ln_f", None),
    (r"^ff_out/kernel$", "output_layer", None),
]

# -- DeepSeek-V3 (deepseek-ai/DeepSeek-V3 inference/model.py).
_DEEPSEEK = _rows(r"^layers/\d+/", [
    (r"attn/wq_a/weight$", "mla_Q_down", None), (r"attn/wq_b/weight$", "mla_Q_up", None),
    (r"attn/wq/weight$", "Wq", None),
    (r"attn/wkv_a/weight$", "mla_KV_down", None), (r"attn/wkv_b/weight$", "mla_KV_up", None),
    (r"attn/wo/weight$", "Wo", None), (r"attn/q_norm/weight$", "q_norm", None),
    (r"attn/kv_norm/weight$", "kv_norm", None), (r"attn_norm/weight$", "attn_norm", None),
    (r"ffn_norm/weight$", "ffn_norm", None),
    (r"ffn/(?:experts/\d+/|shared_experts/)?w1/weight$", "W_gate", None),
    (r"ffn/(?:experts/\d+/|shared_experts/)?w2/weight$", "W_down", None),
    (r"ffn/(?:experts/\d+/|shared_experts/)?w3/weight$", "W_up", None),
    (r"ffn/gate/weight$", "router", None), (r"ffn/gate/bias$", "expert_bias", None),
]) + [
    (r"^embed/weight$", "word_embeddings", None), (r"^norm/weight$", "final_norm", None),
    (r"^head/weight$", "output_layer", None),
]

# -- Gemma 4, Linen (google-deepmind/gemma gemma/gm/nn/gemma4): gelu(gating[0]) * gating[1]
# ('gecd,ekfd->kgecf', k = 2; FeedForward: gate[..., 0, :], gate[..., 1, :]); kv_einsum's
# 'CKDH': key, value = [0], [1]; k_einsum: value_proj = key_proj (one weight, both roles).
_GEMMA4_LINEN = _rows(r"^params/layer_\d+/", [
    (r"attn/q_einsum/w$", "Wq", None), (r"attn/kv_einsum/w$", "Wk", lambda g: g[0]),
    (r"attn/kv_einsum/w$", "Wv", lambda g: g[1]), (r"attn/k_einsum/w$", "Wkv_shared", None),
    (r"attn/attn_vec_einsum/w$", "Wo", None),
    (r"attn/query_norm/scale$", "query_norm", None), (r"attn/key_norm/scale$", "key_norm", None),
    (r"mlp/router_logits/w$", "router", None),
    (r"mlp/gating_einsum/w$", "W_gate", lambda g: g[:, 0]), (r"mlp/gating_einsum/w$", "W_up", lambda g: g[:, 1]),
    (r"mlp/linear/w$", "W_down", None),
    (r"mlp2/gating_einsum$", "W_gate", lambda g: g[0]), (r"mlp2/gating_einsum$", "W_up", lambda g: g[1]),
    (r"mlp2/linear$", "W_down", None),
    (r"mlp/per_expert_scale$", None, None), (r"mlp/router_scale$", None, None), (r"skip_scale$", None, None),
] + [(rf"{n}/scale$", n, None) for n in ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm",
                                          "post_ffw_norm", "pre_ffw2_norm", "post_ffw2_norm", "post_ffw1_norm")]) + [
    (r"^params/embedder/input_embedding$", "word_embeddings", None),
    (r"^params/final_norm/scale$", "final_norm", None),
]

# -- Gemma 4, NNX (google/tunix tunix/models/gemma4/model.py, moe.py; the installed
# google-tunix): MoERagged's gating_einsum [E, 2, F, D] is transposed to [E, D, 2, F] and
# split x1 = [:, 0], x2 = [:, 1] with gelu(x1) * x2; router_logits [D, E] and linear
# [E, F, D] are bare Params; with k_eq_v_global, global layers hold k_einsum (value_proj =
# key_proj); per-layer inputs (PLE): embedder.per_layer_input_embedding [V, L, P],
# per_layer_model_projection, per_layer_input_gate, per_layer_projection.
_GEMMA4_NNX = _rows(r"^layers/\d+/", [
    (r"attn/q_einsum/w$", "Wq", None), (r"attn/kv_einsum/w$", "Wk", lambda g: g[0]),
    (r"attn/kv_einsum/w$", "Wv", lambda g: g[1]), (r"attn/k_einsum/w$", "Wkv_shared", None),
    (r"attn/attn_vec_einsum/w$", "Wo", None),
    (r"attn/_query_norm/scale$", "_query_norm", None), (r"attn/_key_norm/scale$", "_key_norm", None),
    (r"mlp/gate_proj/kernel$", "W_gate", None), (r"mlp/up_proj/kernel$", "W_up", None),
    (r"mlp/down_proj/kernel$", "W_down", None),
    (r"moe/router_logits$", "router", None),
    (r"moe/gating_einsum$", "W_gate", lambda g: g[:, 0]), (r"moe/gating_einsum$", "W_up", lambda g: g[:, 1]),
    (r"moe/linear$", "W_down", None),
    (r"moe/per_expert_scale$", None, None), (r"moe/router_scale$", None, None), (r"skip_scale$", None, None),
    (r"per_layer_input_gate/w$", "per_layer_input_gate", None),
    (r"per_layer_projection/w$", "per_layer_projection", None),
] + [(rf"{n}/scale$", n, None) for n in (
    "pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm", "moe_pre_ffw_norm",
    "moe_post_ffw_norm", "dense_post_ffw_norm", "post_per_layer_input_norm")]) + [
    (r"^embedder/input_embedding$", "word_embeddings", None),
    (r"^embedder/per_layer_input_embedding$", "per_layer_embeddings", None),
    (r"^embedder/per_layer_model_projection/w$", "per_layer_model_projection", None),
    (r"^embedder/per_layer_projection_norm/scale$", "per_layer_projection_norm", None),
    (r"^final_norm/scale$", "final_norm", None),
]

# -- MaxText (AI-Hypercomputer/maxtext src/maxtext/layers/*; scanned, param_scan_axis = 1:
# every stacked kernel is [in.., L, out..]). Fused mlp/wi [D, L, 2, F]: [.., 0, :] silu'd (gate).
_MT = r"^params/decoder/layers/"
_MAXTEXT_COMMON = [
    (_MT + r"self_attention/query/kernel$", "Wq", None), (_MT + r"self_attention/key/kernel$", "Wk", None),
    (_MT + r"self_attention/value/kernel$", "Wv", None), (_MT + r"self_attention/out/kernel$", "Wo", None),
    (_MT + r"pre_self_attention_layer_norm/scale$", "pre_self_attention_layer_norm", None),
    (_MT + r"post_self_attention_layer_norm/scale$", "post_self_attention_layer_norm", None),
    (r"^params/token_embedder/embedding$", "word_embeddings", None),
    (r"^params/decoder/decoder_norm/scale$", "decoder_norm", None),
    (r"^params/decoder/logits_dense/kernel$", "output_layer", None),
]
_MAXTEXT = _MAXTEXT_COMMON + [
    (_MT + r"mlp/wi_0/kernel$", "W_gate", None), (_MT + r"mlp/wi_1/kernel$", "W_up", None),
    (_MT + r"mlp/wo/kernel$", "W_down", None)]
_MAXTEXT_FUSED = _MAXTEXT_COMMON + [
    (_MT + r"mlp/wi/kernel$", "W_gate", lambda g: g[:, :, 0]), (_MT + r"mlp/wi/kernel$", "W_up", lambda g: g[:, :, 1]),
    (_MT + r"mlp/wo/kernel$", "W_down", None)]
_MAXTEXT_MOE = _MAXTEXT_COMMON + [
    (_MT + r"MoeBlock_0/gate/kernel$", "router", None), (_MT + r"MoeBlock_0/wi_0$", "W_gate", None),
    (_MT + r"MoeBlock_0/wi_1$", "W_up", None), (_MT + r"MoeBlock_0/wo$", "W_down", None)]
_MAXTEXT_MLA = [r for r in _MAXTEXT if "query" not in r[0] and "/key/" not in r[0] and "value" not in r[0]] + [
    (_MT + r"self_attention/wq_a/kernel$", "mla_Q_down", None), (_MT + r"self_attention/wq_b/kernel$", "mla_Q_up", None),
    (_MT + r"self_attention/wkv_a/kernel$", "mla_KV_down", None),
    (_MT + r"self_attention/wkv_b/kernel$", "mla_KV_up", None),
    (_MT + r"self_attention/q_norm/scale$", "q_norm", None), (_MT + r"self_attention/kv_norm/scale$", "kv_norm", None)]
# share_kv_projections (configs/models/gemma4-26b.yml): the global layer keeps `key` alone.
_MAXTEXT_SHARED_KV = _rows(r"^params/decoder/layers_\d+/", [
    (r"self_attention/query/kernel$", "Wq", None), (r"self_attention/value/kernel$", "Wv", None),
    (r"self_attention/out/kernel$", "Wo", None),
    (r"pre_self_attention_layer_norm/scale$", "pre_self_attention_layer_norm", None),
]) + [
    (r"^params/decoder/layers_0/self_attention/key/kernel$", "Wk", None),
    (r"^params/decoder/layers_1/self_attention/key/kernel$", "Wkv_shared", None),
    (r"^params/token_embedder/embedding$", "word_embeddings", None),
    (r"^params/decoder/decoder_norm/scale$", "decoder_norm", None),
    (r"^params/decoder/logits_dense/kernel$", "output_layer", None),
]

# -- T5X (google-research/t5x t5x/examples/t5/network.py, layers.py) and Flaxformer.
# Encoder and decoder layers_i are both layer i (the list index the path names).
_T5_ATT = r"(?:attention|self_attention|encoder_decoder_attention)/"
_T5_COMMON = _rows(r"^params/(?:encoder|decoder)/layers_\d+/", [
    (_T5_ATT + r"out/kernel$", "Wo", None), (r"mlp/wo/kernel$", "W_down", None),
] + [(rf"{n}/scale$", n, None) for n in ("pre_attention_layer_norm", "pre_mlp_layer_norm",
                                         "pre_self_attention_layer_norm", "pre_cross_attention_layer_norm")]) + [
    (r"^params/token_embedder/embedding$", "word_embeddings", None),
    (r"^params/(?:encoder|decoder)/relpos_bias/rel_embedding$", "relative_attention_bias", None),
    (r"^params/encoder/encoder_norm/scale$", "encoder_norm", None),
    (r"^params/decoder/decoder_norm/scale$", "decoder_norm", None),
    (r"^params/decoder/logits_dense/kernel$", "output_layer", None),
]
_T5_QKV = _rows(r"^params/(?:encoder|decoder)/layers_\d+/" + _T5_ATT, [
    (r"query/kernel$", "Wq", None), (r"key/kernel$", "Wk", None), (r"value/kernel$", "Wv", None)])
_T5X = _T5_COMMON + _T5_QKV + _rows(r"^params/(?:encoder|decoder)/layers_\d+/mlp/", [
    (r"wi_0/kernel$", "W_gate", None), (r"wi_1/kernel$", "W_up", None)])
_T5X_RELU = _T5_COMMON + _T5_QKV + [(r"^params/(?:encoder|decoder)/layers_\d+/mlp/wi/kernel$", "W_up", None)]
_FLAXFORMER = _T5_COMMON + _rows(r"^params/(?:encoder|decoder)/layers_\d+/", [
    (r"(?:attention|self_attention)/qkv_fused/kernel$", "Wq", lambda g: g[:, 0]),
    (r"(?:attention|self_attention)/qkv_fused/kernel$", "Wk", lambda g: g[:, 1]),
    (r"(?:attention|self_attention)/qkv_fused/kernel$", "Wv", lambda g: g[:, 2]),
    (r"encoder_decoder_attention/query/kernel$", "Wq", None),
    (r"encoder_decoder_attention/kv_fused/kernel$", "Wk", lambda g: g[:, 0]),
    (r"encoder_decoder_attention/kv_fused/kernel$", "Wv", lambda g: g[:, 1]),
    (r"mlp/wi_fused/kernel$", "W_gate", lambda g: g[:, 0]), (r"mlp/wi_fused/kernel$", "W_up", lambda g: g[:, 1]),
])

_TOKENS = jnp.zeros((1, 3), jnp.int32)


def _nnx(make):
    return lambda: nnx.state(make(), nnx.Param)


def _linen(module):
    return lambda: nf.linen_params(module, _TOKENS)


def tunix_gemma4(moe: bool = True, seed: int = 0):
    """tunix's NNX Gemma 4: layer 0 local (kv_einsum), layer 1 global with k_eq_v (k_einsum),
    MoE beside the dense MLP, per-layer inputs."""
    m = nm.tunix_module("gemma4")
    cfg = m.ModelConfig(num_layers=L, num_embed=V, embed_dim=D, hidden_dim=F, num_heads=H, head_dim=DH,
                        num_kv_heads=KVH, num_global_kv_heads=1, global_key_size=DH, k_eq_v_global=True,
                        sliding_window_size=4, final_logit_softcap=None, per_layer_input_dim=8,
                        attention_pattern=(m.AttentionType.LOCAL_SLIDING, m.AttentionType.GLOBAL),
                        enable_moe=moe, num_experts=nf.E if moe else None, num_experts_per_tok=2 if moe else None,
                        expert_dim=nf.FM if moe else None, moe_dense_hidden_dim=F if moe else None)
    return m.Gemma4(cfg, rngs=nnx.Rngs(seed))


FAMILIES: dict[str, Family] = {
    "olmo": Family(_nnx(nf.OLMo), tuple(_OLMO_BLOCK + _OLMO_TOP), r"^transformer/blocks/(\d+)/"),
    "olmo_llama_tied": Family(_nnx(lambda: nf.OLMo(block="llama", weight_tying=True)),
                              tuple(_OLMO_LLAMA + _OLMO_TOP[:2]), r"^transformer/blocks/(\d+)/", tied=True),
    "olmo_gelu": Family(_nnx(lambda: nf.OLMo(swiglu=False)), tuple(_OLMO_GELU + _OLMO_TOP),
                        r"^transformer/blocks/(\d+)/"),
    "olmo_core": Family(_nnx(nf.OLMoCore), tuple(_OLMO_CORE), r"^blocks/(\d+)/"),
    "llada": Family(_nnx(nf.LLaDAModel), tuple(_LLADA), r"^blocks/(\d+)/"),
    "deepseek_v3": Family(_nnx(nf.DeepSeekV3), tuple(_DEEPSEEK), r"^layers/(\d+)/"),
    "deepseek_v3_no_q_lora": Family(_nnx(lambda: nf.DeepSeekV3(q_lora=False)), tuple(_DEEPSEEK), r"^layers/(\d+)/"),
    "gemma4_linen": Family(lambda: nf.linen_params(nf.Gemma4Linen()), tuple(_GEMMA4_LINEN), r"^params/layer_(\d+)/",
                           tied=True),
    "gemma4_tunix": Family(_nnx(tunix_gemma4), tuple(_GEMMA4_NNX), r"^layers/(\d+)/", tied=True),
    "maxtext": Family(_linen(nf.MaxText()), tuple(_MAXTEXT), stack=(_MT, 1)),
    "maxtext_fused_mlp": Family(_linen(nf.MaxText(fused_mlp=True)), tuple(_MAXTEXT_FUSED), stack=(_MT, 1)),
    "maxtext_moe": Family(_linen(nf.MaxText(moe=True)), tuple(_MAXTEXT_MOE), stack=(_MT, 1)),
    "maxtext_mla": Family(_linen(nf.MaxText(mla=True)), tuple(_MAXTEXT_MLA), stack=(_MT, 1)),
    "maxtext_shared_kv": Family(_linen(nf.MaxTextSharedKV()), tuple(_MAXTEXT_SHARED_KV), r"^params/decoder/layers_(\d+)/"),
    "t5x": Family(_linen(nf.T5()), tuple(_T5X), r"/layers_(\d+)/"),
    "t5x_relu": Family(_linen(nf.T5(mlp="relu")), tuple(_T5X_RELU), r"/layers_(\d+)/"),
    "flaxformer": Family(_linen(nf.T5(mlp="fused", flaxformer=True)), tuple(_FLAXFORMER), r"/layers_(\d+)/"),
}


# ----------------------------------------------------------------------------------
# The NumPy reference.


def flat(tree: Any) -> dict[str, np.ndarray]:
    """``{path: float64 array}``, paths joined by hand (an ``nnx.State`` through its pure dict)."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    out: dict[str, np.ndarray] = {}

    def walk(node, prefix):
        for k, v in node.items():
            p = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, dict):
                walk(v, p)
            else:
                out[p] = np.asarray(v, np.float64)

    walk(tree, "")
    return out


def named(fam: Family, path: str) -> list[tuple[str | None, Part]]:
    rows = [(base, part) for rx, base, part in fam.table if re.search(rx, path)]
    assert rows, f"the reference table names every parameter; it misses {path!r}"
    return rows


def layer_pieces(fam: Family, path: str, x: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(layer, array)`` of one (sliced) gradient: one entry per layer it holds."""
    if fam.stack is not None and re.search(fam.stack[0], path):
        return [(i, np.take(x, i, axis=fam.stack[1])) for i in range(x.shape[fam.stack[1]])]
    m = re.search(fam.layer, path)
    return [(int(m.group(1)), x)] if m else []


def reference(fam: Family, grads: dict[str, np.ndarray]) -> dict[str, float]:
    """Every per-role figure (global and per layer), the per-layer norms and shares, the
    global and group norms, by the table."""
    pieces: dict[str, list[np.ndarray]] = {}
    per_layer: dict[tuple[str, int], list[np.ndarray]] = {}
    layer_sq: dict[int, float] = {}
    for path, g in grads.items():
        for i, x in layer_pieces(fam, path, g):
            layer_sq[i] = layer_sq.get(i, 0.0) + float(np.sum(x ** 2))
        for base, part in named(fam, path):
            if base is None:
                continue
            x = g if part is None else part(g)
            pieces.setdefault(base, []).append(x.ravel())
            for i, xi in layer_pieces(fam, path, x):
                per_layer.setdefault((base, i), []).append(xi.ravel())
    total = sum(float(np.sum(g ** 2)) for g in grads.values())
    want = {"grad/global_norm": np.sqrt(total)}
    for base, xs in pieces.items():
        x = np.concatenate(xs)
        want[f"grad/{base}_rms"] = np.sqrt(np.mean(x ** 2))
        want[f"grad/{base}_abs.max"] = np.abs(x).max()
    for (base, i), xs in per_layer.items():
        x = np.concatenate(xs)
        want[f"grad/{base}_rms/layer_{i}"] = np.sqrt(np.mean(x ** 2))
        want[f"grad/{base}_abs.max/layer_{i}"] = np.abs(x).max()
    for i, sq in layer_sq.items():
        want[f"grad/norm/layer_{i}"] = np.sqrt(sq)
        want[f"grad/share/layer_{i}"] = sq / total
    for group, base in (("embedding", "word_embeddings"), ("lm_head", "output_layer")):
        if base in pieces:
            want[f"grad/norm/{group}"] = np.sqrt(np.sum(np.concatenate(pieces[base]) ** 2))
    return want


def random_grads(params: Any, seed: int = 0) -> Any:
    """Random gradients with the parameters' structure (an ``nnx.State`` stays one)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)


def _role_keys(metrics) -> set[str]:
    skip = ("grad/global_norm", "grad/nonfinite_count", "grad/norm/", "grad/share/")
    return {k for k in metrics if not k.startswith(skip) and not k.endswith(".nonfinite")}


@pytest.fixture(autouse=True)
def _third_party_broadcasting():
    """tunix's models broadcast implicitly; conftest forbids it for jvitals' own code."""
    with jax.numpy_rank_promotion("allow"):
        yield


# ----------------------------------------------------------------------------------
# Every figure against NumPy.

# the largest models, and the variants of a family the others cover: in the slow tier
SLOW_FAMILIES = {"t5x", "t5x_relu", "gemma4_tunix", "gemma4_linen", "maxtext_shared_kv", "maxtext_moe", "maxtext",
                 "maxtext_fused_mlp", "olmo", "olmo_gelu", "deepseek_v3", "deepseek_v3_no_q_lora", "olmo_llama_tied"}


@pytest.mark.parametrize("name", tiered(sorted(FAMILIES), SLOW_FAMILIES))
def test_gradient_figures_of_each_family_match_numpy(name):
    """gradient_metrics(random grads) per role and per layer equals NumPy on the slices the
    hand table names; the per-role figures are exactly the table's (none missing, none
    extra); unmatched leaves count in the norms only."""
    fam = FAMILIES[name]
    params = fam.build()
    grads = random_grads(params, seed=len(name))
    got = jax.device_get(jax.jit(vitals.gradient_metrics)(grads))
    want = reference(fam, flat(grads))
    for k, v in want.items():
        assert k in got, f"{name}: missing {k}"
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-12, err_msg=f"{name}: {k}")
    assert _role_keys(got) == _role_keys(want), f"{name}: {sorted(_role_keys(got) ^ _role_keys(want))}"
    assert ("grad/norm/lm_head" in got) == (not fam.tied)


@pytest.mark.parametrize("name", tiered(sorted(FAMILIES), SLOW_FAMILIES))
def test_explain_roles_of_each_family(name):
    """explain_roles: each leaf's figure(s) are the table's, in the table's order for a
    fused kernel; the leaves the table leaves unnamed are exactly the unmatched ones (and
    they are no weight matrices: nothing to report, the summary is quiet); tied as the
    source ties it."""
    fam = FAMILIES[name]
    params = fam.build()
    buf = io.StringIO()
    ex = vitals.explain_roles(params, file=buf)
    parts = vitals.metrics.roles.FUSED_PARTS
    figures = {lr.path: parts.get(lr.role, () if lr.name is None else (lr.name,)) for lr in ex.leaves}
    for path, names in figures.items():
        want = tuple(b for b, _ in named(fam, path) if b is not None)
        assert names == want, (path, names, want)
    unnamed = {p for p in figures if named(fam, p) == [(None, None)]}
    assert set(ex.unmatched) == unnamed
    assert ex.unnamed == {} and ex.partial == {} and ex.head_candidates == ()
    assert bool(ex.tied_head) == fam.tied
    assert explain_mod.roles_summary(params) == ""
    text = buf.getvalue()
    assert ("tied to the embedding" in text) == fam.tied
    assert ("unmatched: none" in text) == (not unnamed)
    for lr in ex.leaves:
        if lr.role in ("gate_up", "up_gate", "qkv", "kv"):
            assert re.search(re.escape(lr.path) + r"\s.*\s" + re.escape(lr.role) + r" \(W", text)


@pytest.mark.slow
def test_fused_and_shared_kernels_are_split_or_named_as_their_source_says():
    """The decisions the path alone cannot make: OLMo's ff_proj is [up | gate] (SwiGLU) or
    the up projection (GELU), LLaDA's ff_proj beside up_proj is the gate, T5's wi beside a
    same-size wo is the up projection, MaxText's fused wi splits on its axis of 2 (also
    when the layer count is 2); Gemma 4's k_einsum and MaxText's lone key are K and V."""
    def roles(name):
        return {lr.path: lr.role for lr in vitals.assign_roles(FAMILIES[name].build())}

    assert roles("olmo")["transformer/blocks/0/ff_proj/weight"] == "up_gate"
    assert roles("olmo_gelu")["transformer/blocks/0/ff_proj/weight"] == "up"
    assert roles("llada")["blocks/1/ff_proj/kernel"] == "gate"
    assert roles("t5x_relu")["params/encoder/layers_0/mlp/wi/kernel"] == "up"
    assert roles("maxtext_fused_mlp")["params/decoder/layers/mlp/wi/kernel"] == "gate_up"
    assert roles("gemma4_linen")["params/layer_1/attn/k_einsum/w"] == "kv_shared"
    assert roles("maxtext_shared_kv")["params/decoder/layers_1/self_attention/key/kernel"] == "kv_shared"
    assert roles("maxtext_shared_kv")["params/decoder/layers_0/self_attention/key/kernel"] == "k"
    # A name fused in every family that uses it stays fused whatever the sizes (inside
    # shard_map they are a shard's); a pattern of one's own is taken as it is.
    gemma = FAMILIES["gemma4_linen"].build()
    half = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // 2,) + x.shape[1:], x.dtype)
                        if x.ndim == 4 and x.shape[1] == 2 else x, gemma)      # experts sharded in two
    assert {lr.path: lr.role for lr in vitals.assign_roles(half)}["params/layer_0/mlp/gating_einsum/w"] == "gate_up"
    own = vitals.Roles().extend(gate_up=r"(^|/)mlp/wi/kernel$")
    t5 = {lr.path: lr.role for lr in vitals.assign_roles(FAMILIES["t5x_relu"].build(), own)}
    assert t5["params/encoder/layers_0/mlp/wi/kernel"] == "gate_up"
    # A model with no V projection anywhere keeps its K: nothing says it doubles as V.
    qk = {"layers_0": {"attn": {n: {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
                                for n in ("q_proj", "k_proj", "o_proj")}}}
    assert {lr.role for lr in vitals.assign_roles(qk)} == {"q", "k", "o"}
    # Nor one beside a matrix no role names (it may be the V projection): reported instead.
    qk["layers_1"] = {"attn": {n: {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
                               for n in ("q_proj", "k_proj", "v_proj", "o_proj")}}
    qk["layers_0"]["attn"]["val"] = {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    ex = vitals.explain_roles(qk, file=None)
    assert {lr.path: lr.role for lr in ex.leaves}["layers_0/attn/k_proj/kernel"] == "k"
    assert ex.unnamed == {"attention": ("layers_0/attn/val/kernel",)}


# ----------------------------------------------------------------------------------
# The recorder's heavy step.


@pytest.mark.parametrize("name", [pytest.param("gemma4_tunix", marks=pytest.mark.slow), "olmo"])
def test_recorder_in_nnx_optimizer_on_nnx_families(name):
    """record() inside nnx.Optimizer, the heavy family due: the recorded per-role and
    per-layer figures of the update's gradients equal NumPy's."""
    fam = FAMILIES[name]
    model = tunix_gemma4() if name == "gemma4_tunix" else nf.OLMo()
    params = nnx.state(model, nnx.Param)
    grads = random_grads(params, seed=7)
    optimizer = nnx.Optimizer(model, vitals.record(optax.sgd(0.1), post="update"), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, grads):
        optimizer.update(model, grads, vitals_heavy=True)

    step(model, optimizer, grads)
    got = jax.device_get(vitals.recorded(optimizer.opt_state))
    want = reference(fam, flat(grads))
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-12, err_msg=f"{name}: {k}")


@pytest.mark.parametrize("name", ["maxtext_fused_mlp", pytest.param("gemma4_linen", marks=pytest.mark.slow)])
def test_recorder_on_linen_families(name):
    """record() on a Linen parameter tree (MaxText scanned on axis 1 with a fused wi;
    Gemma 4's MoE): the recorded figures equal NumPy's."""
    fam = FAMILIES[name]
    params = fam.build()
    grads = random_grads(params, seed=3)
    tx = vitals.record(optax.sgd(0.1), post="update")
    state = tx.init(params)
    _, state = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=True))(grads, state, params)
    got = jax.device_get(vitals.recorded(state))
    for k, v in reference(fam, flat(grads)).items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-12, err_msg=f"{name}: {k}")


# ----------------------------------------------------------------------------------
# What no role names: reported under its family, never read as another role.


class _UnknownExperts(nnx.Module):
    """A Gemma-4-like block whose experts come in a layout no pattern knows: the dense
    MLP is named (gate_proj, up_proj, down_proj), the experts (w_in [E, D, 2F] = [gate |
    up], w_out [E, F, D]) are not."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([_UnknownExpertsLayer(rngs) for _ in range(L)])
        self.lm_head = nf.Kernel(D, V, rngs=rngs)


class _UnknownExpertsLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mlp = nm.MLP(D, F, rngs)
        self.moe = _UnknownMoE(rngs)


class _UnknownMoE(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w_in = nf._param(rngs, nf.E, D, 2 * nf.FM)
        self.w_out = nf._param(rngs, nf.E, nf.FM, D)


def test_weight_matrices_no_role_names_are_reported_never_covered():
    """Unknown expert weights: listed under MLP, the MLP figures say they do not include
    them, W_gate/W_up/W_down read the dense MLP only (NumPy), the norms count them; the
    summary names them and the line that fixes it; with that line they are watched."""
    params = nnx.state(_UnknownExperts(nnx.Rngs(0)), nnx.Param)
    experts = [f"layers/{i}/moe/{w}" for i in range(L) for w in ("w_in", "w_out")]
    buf = io.StringIO()
    ex = vitals.explain_roles(params, file=buf)
    assert ex.unnamed == {"MLP": tuple(experts)}
    assert set(ex.partial) == {"W_gate", "W_up", "W_down"}
    assert all(ex.partial[b] == tuple(experts) for b in ex.partial)
    text = buf.getvalue()
    assert "grad/W_down_*, grad/W_gate_*, grad/W_up_* do not include them" in text
    assert all(f"    {p} " in text for p in experts)

    grads = random_grads(params, seed=11)
    g = flat(grads)
    got = jax.device_get(vitals.gradient_metrics(grads))
    for base, mod in (("W_gate", "gate_proj"), ("W_up", "up_proj"), ("W_down", "down_proj")):
        x = np.concatenate([g[f"layers/{i}/mlp/{mod}/kernel"].ravel() for i in range(L)])
        np.testing.assert_allclose(got[f"grad/{base}_rms"], np.sqrt(np.mean(x ** 2)), rtol=2e-4)
    for i in range(L):
        sq = sum(float(np.sum(v ** 2)) for p, v in g.items() if p.startswith(f"layers/{i}/"))
        np.testing.assert_allclose(got[f"grad/norm/layer_{i}"], np.sqrt(sq), rtol=2e-4)

    summary = explain_mod.roles_summary(params)
    assert summary.startswith(f"jvitals: {len(experts)} of {len(experts) + 8} weight matrices have no role")
    assert "MLP (not in W_down, W_gate, W_up): layers/0/moe/w_in (4, 32, 48)" in summary
    assert "vitals.Roles().extend(up=r'(^|/)w_in(/kernel|/weight|/w)?$')" in summary

    # Naming them (as the summary says): the experts' [gate | up] split on the last axis.
    roles = vitals.Roles(fused_axes=((r"(^|/)moe/w_in$", -1),) + vitals.metrics.roles.DEFAULT_FUSED_AXES
                         ).extend(gate_up=r"(^|/)moe/w_in$", down=r"(^|/)moe/w_out$")
    assert explain_mod.roles_summary(params, roles) == ""
    got = jax.device_get(vitals.gradient_metrics(grads, roles=roles))
    fm = nf.FM
    for base, parts in (("W_gate", [("mlp/gate_proj/kernel", None), ("moe/w_in", lambda a: a[..., :fm])]),
                        ("W_up", [("mlp/up_proj/kernel", None), ("moe/w_in", lambda a: a[..., fm:])]),
                        ("W_down", [("mlp/down_proj/kernel", None), ("moe/w_out", None)])):
        for i in range(L):
            x = np.concatenate([(g[f"layers/{i}/{p}"] if f is None else f(g[f"layers/{i}/{p}"])).ravel()
                                for p, f in parts])
            np.testing.assert_allclose(got[f"grad/{base}_rms/layer_{i}"], np.sqrt(np.mean(x ** 2)), rtol=2e-4)
            np.testing.assert_allclose(got[f"grad/{base}_abs.max/layer_{i}"], np.abs(x).max(), rtol=1e-6)


def test_the_recorder_logs_the_summary_once_and_is_quiet_when_all_is_named(caplog, monkeypatch):
    """record().init logs the summary on 'jvitals.metrics' (WARNING) once per tree structure;
    a second init of the same tree logs nothing; a model whose weights all have roles
    logs nothing."""
    monkeypatch.setattr(explain_mod, "_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="jvitals.metrics")
    unknown = nnx.state(_UnknownExperts(nnx.Rngs(1)), nnx.Param)
    tx = vitals.record(optax.sgd(0.1))
    tx.init(unknown)
    tx.init(unknown)
    jax.jit(tx.init)(unknown)            # at trace time as well: still once
    logged = [r for r in caplog.records if r.name == "jvitals.metrics"]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "layers/1/moe/w_out (4, 24, 32)" in logged[0].getMessage()
    caplog.clear()
    tx.init(FAMILIES["olmo"].build())
    tx.init(FAMILIES["maxtext_moe"].build())
    assert not [r for r in caplog.records if r.name == "jvitals.metrics"]


def test_head_tied_only_where_the_tree_shows_it():
    """No lm_head leaf is not proof of a tied head: an unnamed matrix outside the layers
    shaped like the embedding may be the head (not called tied; said, with the fix); with
    none, the head is the embedding; OLMo's top-level ff_out is the head."""
    olmo = vitals.explain_roles(FAMILIES["olmo"].build(), file=None)
    assert olmo.tied_head == () and olmo.by_role()["lm_head"] == ["transformer/ff_out/weight"]
    tied = vitals.explain_roles(FAMILIES["olmo_llama_tied"].build(), file=None)
    assert tied.tied_head == ("transformer/wte/weight",)

    S = jax.ShapeDtypeStruct
    tree = {"embed_tokens": {"embedding": S((V, D), jnp.float32)},
            "layers": {"0": {"mlp": {n: {"kernel": S(s, jnp.float32)} for n, s in
                                     (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D)))}}},
            "to_vocab": {"kernel": S((D, V), jnp.float32)}}
    buf = io.StringIO()
    ex = vitals.explain_roles(tree, file=buf)
    assert ex.tied_head == () and ex.head_candidates == ("to_vocab/kernel",)
    assert "lm_head: not recognised" in buf.getvalue() and "tied" not in buf.getvalue()
    summary = explain_mod.roles_summary(tree)
    assert "Roles().extend(lm_head=r'(^|/)to_vocab(/kernel|/weight)?$')" in summary
    named = vitals.Roles().extend(lm_head=r"(^|/)to_vocab(/kernel|/weight)?$")
    assert explain_mod.roles_summary(tree, named) == ""
    assert vitals.explain_roles(tree, named, file=None).by_role()["lm_head"] == ["to_vocab/kernel"]


def test_fused_axis_rules_and_errors_name_the_path_and_the_fix():
    S = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="fused axis rule.*axis must be an int"):
        vitals.Roles(fused_axes=((r"x", "last"),))
    odd = {"layers_0": {"mlp": {"gate_up_proj": {"kernel": S((D, 2 * F + 1), jnp.float32)},
                                "down_proj": {"kernel": S((F, D), jnp.float32)}}}}
    with pytest.raises(ValueError, match=r"gate/up kernel 'layers_0/mlp/gate_up_proj/kernel'.*give it its own role"):
        vitals.gradient_metrics(jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), odd))
    bad = vitals.Roles(fused_axes=((r"gating_einsum", -5),))
    gemma = FAMILIES["gemma4_linen"].build()
    with pytest.raises(ValueError, match=r"'params/layer_0/mlp/gating_einsum/w'.*out of range.*fused_axes"):
        vitals.gradient_metrics(gemma, roles=bad)


@pytest.mark.slow
def test_fused_gate_up_sharded_inside_shard_map(devices):
    """Gemma 4's MoE gating_einsum [E, 2, F, D] sharded over its experts, the dense
    gating_einsum [2, F, D] and kv_einsum [2, KVH, D, Dh] sharded along the axis that holds
    their parts (each shard holds one part), inside shard_map: every per-role and per-layer
    figure equals NumPy's on the unsharded arrays."""
    import functools
    from jax.sharding import NamedSharding, PartitionSpec as P

    fam = FAMILIES["gemma4_linen"]
    grads = random_grads(fam.build(), seed=5)
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def spec_of(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return P("x") if re.search(r"(?:mlp/gating_einsum/w|mlp2/gating_einsum|kv_einsum/w)$", name) else P()

    specs = jax.tree_util.tree_map_with_path(spec_of, grads)
    assert sum(s == P("x") for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))) == 5
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), grads, specs)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs,), out_specs=P())
    def f(g):
        return vitals.gradient_metrics(g, specs=specs, axes=("x",))

    got = jax.device_get(f(sharded))
    want = reference(fam, flat(grads))
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-12, err_msg=k)
    assert _role_keys(got) == _role_keys(want)
