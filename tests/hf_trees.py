"""Parameter trees named like HuggingFace-Flax GPT-2, Llama and MaxText (for the transform tests).

Arrays of small shapes filled with distinct values, so tests can run real updates
on them; ``L`` layers, width ``D``, vocabulary ``V``.
"""

import numpy as np

V, D, T, L = 50, 8, 16, 3


def _arr(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _build(spec, seed=[0]):
    if isinstance(spec, tuple):
        seed[0] += 1
        return _arr(spec, seed[0])
    return {k: _build(v) for k, v in spec.items()}


def gpt2():
    """HF-Flax GPT-2: ``transformer/h/{i}/attn/c_attn`` fused QKV ``[3D, D]`` with a bias; tied head."""
    return _build({"transformer": {
        "wte": {"embedding": (V, D)}, "wpe": {"embedding": (T, D)},
        "h": {str(i): {"ln_1": {"scale": (D,), "bias": (D,)},
                       "attn": {"c_attn": {"kernel": (3 * D, D), "bias": (3 * D,)},
                                "c_proj": {"kernel": (D, D), "bias": (D,)}},
                       "ln_2": {"scale": (D,)},
                       "mlp": {"c_fc": {"kernel": (4 * D, D)}, "c_proj": {"kernel": (D, 4 * D)}}}
              for i in range(L)},
        "ln_f": {"scale": (D,)}}})


def llama():
    """HF-Flax Llama: separate ``q_proj``/``k_proj`` (with biases, as Qwen has), ``model/norm``."""
    return _build({"model": {
        "embed_tokens": {"embedding": (V, D)},
        "layers": {str(i): {"self_attn": {"q_proj": {"kernel": (D, D), "bias": (D,)},
                                          "k_proj": {"kernel": (D, D // 2), "bias": (D // 2,)},
                                          "v_proj": {"kernel": (D, D // 2)},
                                          "o_proj": {"kernel": (D, D)}},
                            "input_layernorm": {"weight": (D,)}} for i in range(L)},
        "norm": {"weight": (D,)}}, "lm_head": {"kernel": (D, V)}})


def maxtext():
    """MaxText scanned layers: layer axis 1 (``param_scan_axis=1``)."""
    return _build({"params": {
        "token_embedder": {"embedding": (V, D)},
        "decoder": {"layers": {"self_attention": {"query": {"kernel": (D, L, 2, 4)}},
                               "pre_self_attention_layer_norm": {"scale": (D, L)}},
                    "decoder_norm": {"scale": (D,)},
                    "logits_dense": {"kernel": (D, V)}}}})
