"""The default tables of :mod:`jvitals.metrics.roles`: which names each role is spelled
with in the model families jvitals knows, and how their fused kernels and layers are laid
out.

Every family's entries come from its own source (named beside them). ``docs/MODELS.md``
tables the families; :class:`~jvitals.metrics.roles.Roles` takes these as its defaults and
``Roles().extend(...)`` adds names before them.
"""

from __future__ import annotations

from typing import Mapping

__all__ = [
    "DEFAULT_FUSED_AXES",
    "DEFAULT_LAYER_PATTERNS",
    "DEFAULT_PATTERNS",
    "DEFAULT_QKV_LAYOUTS",
    "DEFAULT_STACKS",
    "FUSED_PARTS",
    "ROLE_METRIC_NAMES",
    "UP_OR_FUSED",
]

# A weight leaf: the module name is followed by its kernel (Linen ``kernel``,
# HF/NNX ``weight``, Gemma ``w``) or is the leaf itself (the reference model's
# ``moe/experts/gate_proj``). Biases are deliberately not matched.
_W = r"(?:/(?:kernel|weight|w))?$"
# Ancestor contexts.
_ATT = r"(?:^|/)[^/]*(?:attn|attention)[^/]*(?:/[^/]+)*?"
_MLP = r"(?:^|/)[^/]*(?:mlp|ffn|feed_?forward|moe|experts?|dense_?block|mlpblock|densereludense)[^/]*(?:/[^/]+)*?"
_MOE = r"(?:^|/)[^/]*(?:moe|router|mlp|feed_?forward|ffn)[^/]*"


def _any(*names: str) -> str:
    return r"(?:^|/)(?:" + "|".join(names) + r")" + _W


DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    # Embeddings and output layer.
    ("position_embedding", r"(?:^|/)(?:wpe|position_embeddings?|pos_?embed\w*|posembed\w*|"
                           r"position_embedder|embed_positions)(?:/(?:embedding|weight|kernel|pos_embedding))?$"),
    # T5's relative position buckets (T5X/Flaxformer relpos_bias, HF T5 relative_attention_bias).
    ("rel_pos_bias", r"(?:^|/)(?:relpos_bias/rel_embedding|relative_attention_bias(?:/(?:embedding|weight))?)$"),
    # Gemma 3n/4 per-layer embeddings (PLE): a second token-indexed table [V, L, P] and its projections.
    ("ple_embedding", r"(?:^|/)(?:per_layer_input_embedding|per_layer_embeddings)$"),
    ("ple_model_projection", r"(?:^|/)per_layer_model_projection" + _W),
    ("ple_input_gate", r"(?:^|/)per_layer_input_gate" + _W),
    ("ple_projection", r"(?:^|/)per_layer_projection" + _W),
    ("embedding", r"(?:^|/)(?:embed|wte|embed_tokens|token_embedder|tok_embeddings|word_embeddings|"
                  r"shared|shared_embedding|embedder|embeddings|embedding|Embed_\d+|token_embedding|tok_emb)"
                  r"/(?:embedding|weight|kernel|input_embedding)$"),
    ("lm_head", _any(r"lm_head", r"logits_dense", r"logitdense", r"output_layer", r"unembed\w*",
                     r"embed_out", r"output_projection", r"logits_proj")),
    ("lm_head", r"^(?:params/)?(?:model/|transformer/|decoder/)?(?:output|head)" + _W),
    # OLMo / LLaDA: ff_out at the top level (under transformer/) is the output layer; inside a
    # block it is the MLP's down projection (below). OLMo-core: lm_head/w_out.
    ("lm_head", r"^(?:params/)?(?:model/)?(?:transformer/)?ff_out" + _W),
    ("lm_head", r"(?:^|/)lm_head/w_out" + _W),
    # Multi-token prediction projections.
    ("mtp_proj", r"(?:^|/)mtp_?\d+/(?:[^/]+/)*?(?:proj|eh_proj)" + _W),
    # Attention: fused QKV, MLA low-rank projections, Q/K/V/O, output gate.
    ("qkv", _any(r"qkv", r"c_attn", r"query_key_value", r"wqkv", r"qkv_proj", r"in_proj",
                 r"w_pack", r"to_qkv", r"fused_qkv", r"qkv_einsum", r"att_proj", r"qkv_fused", r"w_qkv")),
    ("q_down", _any(r"q_down", r"q_a_proj", r"wq_a", r"q_down_proj", r"q_a")),
    ("q_up", _any(r"q_up", r"q_b_proj", r"wq_b", r"q_up_proj", r"q_b")),
    ("kv_down", _any(r"kv_down", r"kv_a_proj_with_mqa", r"kv_a_proj", r"wkv_a", r"kv_down_proj", r"kv_a")),
    ("kv_up", _any(r"kv_up", r"kv_b_proj", r"wkv_b", r"kv_up_proj", r"kv_b")),
    # K and V in one kernel: stacked on an axis of 2 (Gemma's kv_einsum [2, KVH, D, Dh],
    # Flaxformer's kv_fused [D, 2, H, Dh]) or [K | V].
    ("kv", _any(r"kv_einsum", r"kv_proj", r"to_kv", r"key_value", r"kv", r"kv_fused")),
    # One projection read as both K and V: Gemma 4's k_einsum exists only when k_eq_v.
    ("kv_shared", _any(r"k_einsum")),
    ("q", _any(r"q_proj", r"query", r"wq", r"q", r"to_q", r"query_proj", r"q_einsum", r"w_q")),
    ("k", _any(r"k_proj", r"key", r"wk", r"k", r"to_k", r"key_proj", r"w_k")),
    ("v", _any(r"v_proj", r"value", r"wv", r"v", r"to_v", r"value_proj", r"w_v")),
    ("o", _any(r"o_proj", r"out_proj", r"attn_vec_einsum", r"output_proj", r"attn_out")),
    ("o", _ATT + r"/(?:out|o|wo|c_proj|proj|dense|output|to_out|w_out)" + _W),
    ("attn_gate", _ATT + r"/(?:gate|g_proj|gate_proj|output_gate|gate_score|w_g)" + _W),
    # MoE router and expert-selection bias.
    ("expert_bias", r"(?:^|/)(?:expert_bias|e_score_correction_bias|score_correction_bias|"
                    r"router_bias|routed_bias|expert_score_bias)$"),
    ("expert_bias", _MOE + r"/(?:gate|router)/bias$"),
    ("router", _any(r"router", r"moe_gate", r"gate_network", r"switch_gate", r"router_gate", r"wg",
                    r"router_logits")),
    ("router", _MOE + r"/gate" + _W),
    # MLP (dense, shared experts and routed experts alike). Gate and up in one kernel
    # (gate_up: [gate | up] or stacked [2, ...] gate first; up_gate: OLMo's ff_proj, [up | gate])
    # are split before any statistic; a candidate that holds as many entries as its block's
    # down projection is a plain up projection, one beside a separate up projection is the
    # gate (assign_roles).
    ("gate_up", _any(r"gating_einsum", r"gate_up_proj", r"wi_fused", r"wi", r"dense_h_to_4h")),
    ("up_gate", _any(r"ff_proj")),
    ("gate", _any(r"gate_proj", r"wi_0", r"w1", r"fc_gate", r"gate_linear", r"w_gate")),
    ("up", _any(r"up_proj", r"wi_1", r"w3", r"c_fc", r"fc1", r"fc_in", r"up", r"w_up", r"linear_in")),
    ("down", _any(r"down_proj", r"w2", r"fc2", r"fc_out", r"dense_4h_to_h", r"down", r"w_down", r"linear_out",
                  r"ff_out")),
    ("down", _MLP + r"/(?:wo|c_proj|out|proj|output|linear)" + _W),
    ("up", r"(?:^|/)[^/]*mlp[^/]*/Dense_0" + _W),
    ("down", r"(?:^|/)[^/]*mlp[^/]*/Dense_1" + _W),
    # Norm scales (Linen/NNX ``scale``; ``weight``/``gamma``/``w`` under a *norm*/ln* module).
    ("norm", r"(?:^|/)(?P<name>[^/]+)/scale$"),
    ("norm", r"(?:^|/)(?P<name>[^/]*norm[^/]*|ln_?[^/]*)/(?:weight|gamma|w)$"),
)
"""``(role, regex)`` pairs, tried in order; the first whose regex ``re.search``-es
the leaf path (case-insensitive) gives the role. A ``name`` group names a norm."""

DEFAULT_LAYER_PATTERNS: tuple[str, ...] = (
    # layers/3, h/3, blocks/3 (Python lists, HF FrozenDicts, NNX lists)
    r"(?:^|/)(?:layers|layer|h|blocks|block|decoder_layers|encoder_layers|transformer_blocks|"
    r"resblocks|res_blocks)/(\d+)(?:/|$)",
    # layers_3, layer_3, block_3, Block_3, encoderdecoderblock_3, DecoderLayer_3
    r"(?:^|/)(?![^/]*(?:mlp|ffn|norm|attn|attention|moe|scan|expert))[a-z0-9_]*?(?:layers?|blocks?)_?(\d+)(?:/|$)",
    r"(?:^|/)h_(\d+)(?:/|$)",
)
"""Regexes whose group 1 is a Python-list layer's index; the first that matches wins."""

_NOT_INDEX = r"(?!/\d+(?:/|$))"
DEFAULT_STACKS: tuple[tuple[str, int], ...] = (
    # MaxText scans with param_scan_axis=1 by default.
    (r"^(?:params/)?decoder/(?:layers|dense_layers|moe_layers)(?=/)" + _NOT_INDEX, 1),
    # nn.scan(Block, variable_axes={'params': 0}, name='layers') and alike.
    (r"(?:^|/)(?:layers|blocks|scan_?\w*|\w*_layers|ScanBlock\w*|ScanLayer\w*|stacked\w*)(?=/)" + _NOT_INDEX, 0),
)
"""``(regex, axis)``: a path matching ``regex`` lies in the ``nn.scan``-stacked
subtree ending where the match ends, with the layer axis at ``axis``."""

DEFAULT_QKV_LAYOUTS: tuple[tuple[str, str], ...] = (
    # HF Bloom, GPT-NeoX, Falcon and Megatron checkpoints: per head (or per KV group).
    (r"(?:^|/)query_key_value(?:/|$)", "interleaved"),
)
"""``(regex, layout)``: fused-QKV kernels laid out per head; every other is
``[Q | K | V]`` (see :class:`QKVSplit`)."""

DEFAULT_FUSED_AXES: tuple[tuple[str, int], ...] = (
    # Gemma (google-deepmind/gemma gm/nn): dense gating_einsum [2, F, D]; Gemma 4's MoE
    # gating_einsum [E, 2, F, D] (gm/nn/gemma4/_moe.py): gate is [0], up is [1].
    (r"(?:^|/)gating_einsum(?:/w)?$", -3),
    # Gemma: kv_einsum [2, KVH, D, Dh]: K is [0], V is [1].
    (r"(?:^|/)kv_einsum(?:/w)?$", -4),
    # Flaxformer dense_attention.py: qkv_fused [D, 3, H, Dh], kv_fused [D, 2, H, Dh].
    (r"(?:^|/)(?:qkv_fused|kv_fused)(?:/kernel)?$", -3),
    # MaxText linears.py fused_mlp / Flaxformer dense.py wi_fused: [D, 2, F] (gate, up).
    (r"(?:^|/)(?:wi|wi_fused)/kernel$", -2),
    # MaxText moe.py prefuse_moe_weights: wi [E, D, 2F] = [gate | up].
    (r"(?:^|/)[^/]*moe[^/]*/wi$", -1),
    # MaxText attentions.py fused_qkv: qkv_proj [D, H + 2 KVH, Dh], heads [Q | K | V].
    (r"(?:^|/)qkv_proj/kernel$", -2),
    # HF Llama 4 experts: gate_up_proj [E, D, 2F] = [gate | up].
    (r"(?:^|/)gate_up_proj$", -1),
)
"""``(regex, axis)``: the split axis of a fused kernel (roles ``qkv``, ``kv``, ``gate_up``,
``up_gate``) of rank > 2 per layer whose path matches; negative axes count from the end of
one layer's shape (a scan axis is not counted). Without a rule the axis comes from the
shape (:func:`~jvitals.metrics.qkv.pair_layout`, :class:`QKVSplit`)."""

ROLE_METRIC_NAMES: Mapping[str, str] = {
    "embedding": "word_embeddings",
    "position_embedding": "position_embeddings",
    "lm_head": "output_layer",
    "q": "Wq",
    "k": "Wk",
    "v": "Wv",
    "o": "Wo",
    "q_down": "mla_Q_down",
    "q_up": "mla_Q_up",
    "kv_down": "mla_KV_down",
    "kv_up": "mla_KV_up",
    "attn_gate": "attn_gate",
    "gate": "W_gate",
    "up": "W_up",
    "down": "W_down",
    "router": "router",
    "expert_bias": "expert_bias",
    "mtp_proj": "mtp_proj",
    "kv_shared": "Wkv_shared",
    "rel_pos_bias": "relative_attention_bias",
    "ple_embedding": "per_layer_embeddings",
    "ple_model_projection": "per_layer_model_projection",
    "ple_input_gate": "per_layer_input_gate",
    "ple_projection": "per_layer_projection",
}
"""Role -> the metric base name (``grad/{base}_rms``). Roles not listed (user
roles) use their own name; ``norm`` uses the norm's module name; ``qkv`` reports
under ``Wq``/``Wk``/``Wv`` after the split, ``kv`` under ``Wk``/``Wv``, ``gate_up`` and
``up_gate`` under ``W_gate``/``W_up`` (:data:`FUSED_PARTS`)."""

UP_OR_FUSED = r"(?:^|/)(?:wi|ff_proj|dense_h_to_4h)" + _W
"""Names that are a fused gate/up kernel in one family and a plain up projection in
another (T5's ``wi`` and MaxText's fused ``wi``; OLMo's ``ff_proj`` with SwiGLU or GELU;
ChatGLM's and GPT-NeoX's ``dense_h_to_4h``): :func:`~jvitals.metrics.roles.assign_roles`
reads one as the up projection when it holds as many entries as the down projection
beside it. Every other fused name (``gating_einsum``, ``gate_up_proj``, ``wi_fused``) is
fused in every family that uses it."""

FUSED_PARTS: Mapping[str, tuple[str, ...]] = {
    "qkv": ("Wq", "Wk", "Wv"),
    "kv": ("Wk", "Wv"),
    "gate_up": ("W_gate", "W_up"),
    "up_gate": ("W_up", "W_gate"),
}
"""Fused roles -> the metric names of their parts, in the order they lie along the split
axis: ``qkv`` ``[Q | K | V]`` (or per head, :class:`QKVSplit`), ``kv`` ``[K | V]``,
``gate_up`` ``[gate | up]`` (Gemma's ``gating_einsum``, MaxText's fused ``wi``, Phi-3's
``gate_up_proj``), ``up_gate`` ``[up | gate]`` (OLMo's ``ff_proj``: ``x, gate = x.chunk(2)``)."""

ROLE_HINTS: Mapping[str, tuple[str, ...]] = {
    "embedding": ("embed", "embedding", "wte", "embed_tokens", "token_embedder"),
    "lm_head": ("lm_head", "logits_dense", "output", "unembed"),
    "q": ("q_proj", "query", "wq"), "k": ("k_proj", "key", "wk"), "v": ("v_proj", "value", "wv"),
    "o": ("o_proj", "out", "wo", "c_proj"), "qkv": ("qkv", "c_attn", "query_key_value"),
    "q_down": ("q_down", "q_a_proj"), "q_up": ("q_up", "q_b_proj"), "kv": ("kv_einsum", "kv_proj", "to_kv"),
    "kv_down": ("kv_down", "kv_a_proj"), "kv_up": ("kv_up", "kv_b_proj"),
    "gate": ("gate_proj", "wi_0", "w1"), "up": ("up_proj", "wi_1", "w3", "c_fc"),
    "down": ("down_proj", "wo", "w2", "c_proj"), "router": ("router", "gate"),
    "expert_bias": ("expert_bias", "e_score_correction_bias"), "norm": ("norm", "layernorm", "scale"),
    "gate_up": ("gating_einsum", "gate_up_proj", "wi"), "up_gate": ("ff_proj",), "kv_shared": ("k_einsum",),
}
"""Role -> the words it is usually spelled with in parameter paths: they rank the "nearest
paths" an error names when a required role matches nothing."""
