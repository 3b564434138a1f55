"""Roles: default patterns over real-world naming, layers, stacks, overrides, errors."""

import dataclasses
import io

import jax
import jax.numpy as jnp
import pytest

from jvitals.metrics.roles import QKVSplit, Roles, assign_roles

from jvitals.metrics.explain import explain_roles

S = jax.ShapeDtypeStruct


def _tree(entries):
    tree = {}
    for path, shape in entries:
        node = tree
        parts = path.split("/")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = S(shape, jnp.float32)
    return tree


# (path, expected role, expected metric name, expected layer)
CASES = [
    # jvitals reference model, unscanned
    ("params/embed/embedding", "embedding", "word_embeddings", None),
    ("params/layers_3/input_layernorm/scale", "norm", "input_layernorm", 3),
    ("params/layers_3/attn/qkv/kernel", "qkv", "qkv", 3),
    ("params/layers_10/attn/q_down/kernel", "q_down", "mla_Q_down", 10),
    ("params/layers_10/attn/q_norm/scale", "norm", "q_norm", 10),
    ("params/layers_0/attn/q_up/kernel", "q_up", "mla_Q_up", 0),
    ("params/layers_0/attn/kv_down/kernel", "kv_down", "mla_KV_down", 0),
    ("params/layers_0/attn/kv_up/kernel", "kv_up", "mla_KV_up", 0),
    ("params/layers_0/attn/gate/kernel", "attn_gate", "attn_gate", 0),
    ("params/layers_0/attn/o_proj/kernel", "o", "Wo", 0),
    ("params/layers_0/pre_mlp_layernorm/scale", "norm", "pre_mlp_layernorm", 0),
    ("params/layers_0/mlp/gate_proj/kernel", "gate", "W_gate", 0),
    ("params/layers_0/mlp/up_proj/kernel", "up", "W_up", 0),
    ("params/layers_0/mlp/down_proj/kernel", "down", "W_down", 0),
    ("params/layers_1/moe/router/kernel", "router", "router", 1),
    ("params/layers_1/moe/expert_bias", "expert_bias", "expert_bias", 1),
    ("params/layers_1/moe/experts/gate_proj", "gate", "W_gate", 1),
    ("params/layers_1/moe/experts/down_proj", "down", "W_down", 1),
    ("params/final_layernorm/scale", "norm", "final_layernorm", None),
    ("params/lm_head/kernel", "lm_head", "output_layer", None),
    ("params/mtp_0/input_layernorm/scale", "norm", "mtp_input_layernorm", None),
    ("params/mtp_1/proj/kernel", "mtp_proj", "mtp_proj", None),
    # Flax examples (lm1b / wmt)
    ("decoder/Embed_0/embedding", "embedding", "word_embeddings", None),
    ("decoder/posembed_output/pos_embedding", "position_embedding", "position_embeddings", None),
    ("decoder/encoderdecoderblock_2/LayerNorm_0/scale", "norm", "LayerNorm_0", 2),
    ("decoder/encoderdecoderblock_2/LayerNorm_0/bias", None, None, 2),
    ("decoder/encoderdecoderblock_2/MultiHeadDotProductAttention_0/query/kernel", "q", "Wq", 2),
    ("decoder/encoderdecoderblock_2/MultiHeadDotProductAttention_0/key/kernel", "k", "Wk", 2),
    ("decoder/encoderdecoderblock_2/MultiHeadDotProductAttention_0/value/kernel", "v", "Wv", 2),
    ("decoder/encoderdecoderblock_2/MultiHeadDotProductAttention_0/out/kernel", "o", "Wo", 2),
    ("decoder/encoderdecoderblock_2/MlpBlock_0/Dense_0/kernel", "up", "W_up", 2),
    ("decoder/encoderdecoderblock_2/MlpBlock_0/Dense_1/kernel", "down", "W_down", 2),
    ("decoder/encoderdecoder_norm/scale", "norm", "encoderdecoder_norm", None),
    ("decoder/logitdense/kernel", "lm_head", "output_layer", None),
    # MaxText, unscanned
    ("params/token_embedder/embedding", "embedding", "word_embeddings", None),
    ("params/decoder/layers_4/self_attention/query/kernel", "q", "Wq", 4),
    ("params/decoder/layers_4/self_attention/out/kernel", "o", "Wo", 4),
    ("params/decoder/layers_4/mlp/wi_0/kernel", "gate", "W_gate", 4),
    ("params/decoder/layers_4/mlp/wi_1/kernel", "up", "W_up", 4),
    ("params/decoder/layers_4/mlp/wo/kernel", "down", "W_down", 4),
    ("params/decoder/layers_4/pre_self_attention_layer_norm/scale", "norm", "pre_self_attention_layer_norm", 4),
    ("params/decoder/decoder_norm/scale", "norm", "decoder_norm", None),
    ("params/decoder/logits_dense/kernel", "lm_head", "output_layer", None),
    # HF-Flax GPT-2
    ("transformer/wte/embedding", "embedding", "word_embeddings", None),
    ("transformer/wpe/embedding", "position_embedding", "position_embeddings", None),
    ("transformer/h/7/ln_1/scale", "norm", "ln_1", 7),
    ("transformer/h/7/attn/c_attn/kernel", "qkv", "qkv", 7),
    ("transformer/h/7/attn/c_attn/bias", None, None, 7),
    ("transformer/h/7/attn/c_proj/kernel", "o", "Wo", 7),
    ("transformer/h/7/mlp/c_fc/kernel", "up", "W_up", 7),
    ("transformer/h/7/mlp/c_proj/kernel", "down", "W_down", 7),
    ("transformer/ln_f/scale", "norm", "ln_f", None),
    # HF-Flax Llama / Mixtral / DeepSeek
    ("model/embed_tokens/embedding", "embedding", "word_embeddings", None),
    ("model/layers/12/self_attn/q_proj/kernel", "q", "Wq", 12),
    ("model/layers/12/self_attn/k_proj/kernel", "k", "Wk", 12),
    ("model/layers/12/self_attn/v_proj/kernel", "v", "Wv", 12),
    ("model/layers/12/self_attn/o_proj/kernel", "o", "Wo", 12),
    ("model/layers/12/input_layernorm/weight", "norm", "input_layernorm", 12),
    ("model/layers/12/post_attention_layernorm/weight", "norm", "post_attention_layernorm", 12),
    # A module named just "norm": final_norm outside the layers (grad/norm_rms would
    # read as the gradient-norm family grad/norm/layer_i), block_norm inside.
    ("model/norm/weight", "norm", "final_norm", None),
    ("model/layers/2/norm/weight", "norm", "block_norm", 2),
    ("lm_head/kernel", "lm_head", "output_layer", None),
    ("model/layers/1/block_sparse_moe/gate/kernel", "router", "router", 1),
    ("model/layers/1/block_sparse_moe/experts/5/w1/kernel", "gate", "W_gate", 1),
    ("model/layers/1/block_sparse_moe/experts/5/w2/kernel", "down", "W_down", 1),
    ("model/layers/1/block_sparse_moe/experts/5/w3/kernel", "up", "W_up", 1),
    ("model/layers/3/self_attn/q_a_proj/kernel", "q_down", "mla_Q_down", 3),
    ("model/layers/3/self_attn/q_a_layernorm/weight", "norm", "q_a_layernorm", 3),
    ("model/layers/3/self_attn/q_b_proj/kernel", "q_up", "mla_Q_up", 3),
    ("model/layers/3/self_attn/kv_a_proj_with_mqa/kernel", "kv_down", "mla_KV_down", 3),
    ("model/layers/3/self_attn/kv_b_proj/kernel", "kv_up", "mla_KV_up", 3),
    ("model/layers/3/mlp/gate/kernel", "router", "router", 3),
    ("model/layers/3/mlp/gate/e_score_correction_bias", "expert_bias", "expert_bias", 3),
    ("model/layers/3/mlp/experts/0/gate_proj/kernel", "gate", "W_gate", 3),
    ("model/layers/3/mlp/shared_experts/up_proj/kernel", "up", "W_up", 3),
    # Meta-Llama style
    ("layers/2/attention/wq/weight", "q", "Wq", 2),
    ("layers/2/attention/wo/weight", "o", "Wo", 2),
    ("layers/2/feed_forward/w1/weight", "gate", "W_gate", 2),
    ("layers/2/feed_forward/w2/weight", "down", "W_down", 2),
    ("layers/2/attention_norm/weight", "norm", "attention_norm", 2),
]


@pytest.mark.parametrize("path,role,name,layer", CASES, ids=[c[0] for c in CASES])
def test_default_patterns(path, role, name, layer):
    r = Roles()
    assert r.role_of(path) == (role, name)
    assert r.layer_of(path) == layer
    assert r.stack_of(path) is None


def test_scanned_reference_model_axis0_and_maxtext_axis1():
    L, D, F = 3, 8, 16
    ref = _tree([("params/layers/attn/qkv/kernel", (L, D, 24)), ("params/layers/input_layernorm/scale", (L, D)),
                 ("params/layers/mlp/down_proj/kernel", (L, F, D)), ("params/embed/embedding", (32, D))])
    got = {lr.path: lr for lr in assign_roles(ref)}
    lr = got["params/layers/attn/qkv/kernel"]
    assert (lr.stack, lr.stack_axis, lr.num_layers, lr.first_layer, lr.layers) == ("params/layers", 0, 3, 0, (0, 1, 2))
    assert got["params/embed/embedding"].layers == ()

    mt = _tree([("params/decoder/layers/self_attention/query/kernel", (D, L, 2, 4)),
                ("params/decoder/layers/mlp/wo/kernel", (F, L, D)),
                ("params/decoder/layers/pre_self_attention_layer_norm/scale", (D, L))])
    for lr in assign_roles(mt):
        assert (lr.stack_axis, lr.num_layers) == (1, L)
    # The layer axis is configurable; a rule's axis that does not fit falls back.
    mt0 = _tree([("params/decoder/layers/self_attention/query/kernel", (L, D, 2, 4)),
                 ("params/decoder/layers/mlp/wo/kernel", (L, F, D))])
    assert {lr.stack_axis for lr in assign_roles(mt0)} == {0}
    assert {lr.stack_axis for lr in assign_roles(mt0, Roles(stacked_axis=0))} == {0}
    with pytest.raises(ValueError, match="do not share a layer axis"):
        assign_roles(_tree([("layers/a/kernel", (2, 3)), ("layers/b/kernel", (4, 5))]))


def test_two_stacks_are_numbered_in_order():
    t = _tree([("decoder/dense_layers/mlp/wi_0/kernel", (8, 2, 16)),
               ("decoder/moe_layers/MoeBlock_0/wi_0", (4, 3, 8, 16))])
    got = {lr.path: lr for lr in assign_roles(t)}
    assert got["decoder/dense_layers/mlp/wi_0/kernel"].layers == (0, 1)
    assert got["decoder/moe_layers/MoeBlock_0/wi_0"].layers == (2, 3, 4)


def test_layer_index_is_numeric_not_lexicographic():
    t = _tree([(f"params/layers_{i}/mlp/up_proj/kernel", (2, 2)) for i in range(12)])
    got = assign_roles(t)
    assert sorted(lr.layer for lr in got) == list(range(12))
    assert got[2].path == "params/layers_10/mlp/up_proj/kernel" and got[2].layer == 10


def test_explain_roles_prints_and_lists_unmatched():
    t = _tree([("params/layers_0/attn/qkv/kernel", (8, 24)), ("params/layers_0/weird/thing", (3,)),
               ("params/layers/mlp/up_proj/kernel", (2, 8, 16))])
    buf = io.StringIO()
    ex = explain_roles(t, file=buf)
    text = buf.getvalue()
    assert ex.unmatched == ("params/layers_0/weird/thing",)
    assert "params/layers_0/attn/qkv/kernel" in text and "qkv" in text
    assert "unmatched (1" in text and "stacked axis 0" in text
    assert ex.by_role()["up"] == ["params/layers/mlp/up_proj/kernel"]
    assert ex.stacks == {"params/layers": (0, 2, 0)}
    assert str(ex) == text.rstrip("\n")


def test_required_role_unmatched_lists_nearest_paths():
    t = _tree([("model/layers/0/attn/my_q/kernel", (4, 4)), ("model/layers/0/mlp/up_proj/kernel", (4, 8))])
    with pytest.raises(ValueError, match=r"required role 'q' matched no parameter.*my_q"):
        assign_roles(t, Roles(required=("q",)))
    # fixed by extending the patterns
    r = Roles(required=("q", "up")).extend(q=r"(^|/)my_q/kernel$")
    assert assign_roles(t, r)[0].role == "q"
    # fused QKV satisfies q, k and v
    assign_roles(_tree([("h/0/attn/c_attn/kernel", (4, 12))]), Roles(required="q"))


def test_override_extend_without_and_frozen():
    r = Roles().override(q=r"(^|/)queries$", router=(r"(^|/)switch$",))
    assert r.role_of("attn/q_proj/kernel") == (None, None)
    assert r.role_of("blk/queries") == ("q", "Wq")
    assert r.role_of("moe/switch") == ("router", "router")
    r2 = Roles().extend(my_role=r"(^|/)special$")
    assert r2.role_of("a/special") == ("my_role", "my_role")
    assert Roles().without("norm").role_of("ln_1/scale") == (None, None)
    assert Roles().with_stack(r"(^|/)trunk(?=/)", 2).stack_of("trunk/x/kernel") == ("trunk", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Roles().stacked_axis = 1
    assert hash(Roles()) == hash(Roles())
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Roles().extend(q="(unclosed")


def test_qkv_split_sizes_and_axis():
    assert QKVSplit().sizes(96) == (32, 32, 32)
    assert QKVSplit(num_heads=8, num_kv_heads=2).sizes(96) == (64, 16, 16)
    with pytest.raises(ValueError, match=r"96 entries.*\(H \+ 2\*KVH\) = \(4 \+ 2\*3\) = 10"):
        QKVSplit(num_heads=4, num_kv_heads=3).sizes(96, "layers_0/attn/qkv/kernel")
    with pytest.raises(ValueError, match="equal Q, K, V thirds"):
        QKVSplit().sizes(10)
    assert QKVSplit().resolve_axis((8, 24)) == 1       # Linen [D, 3D]
    assert QKVSplit().resolve_axis((24, 8)) == 0       # HF-Flax GPT-2 Conv1D [3D, D]
    assert QKVSplit().resolve_axis((8, 3, 2, 4)) == 1  # [D, 3, H, Dh]
    assert QKVSplit(axis=-1).resolve_axis((24, 8)) == 1
    with pytest.raises(ValueError, match="out of range"):
        QKVSplit(axis=2).resolve_axis((8, 24))


def test_tied_head_said_once_and_qkv_split_from_config():
    tied = _tree([("transformer/wte/embedding", (64, 8)), ("transformer/h/0/attn/c_attn/kernel", (24, 8)),
                  ("transformer/ln_f/scale", (8,))])
    buf = io.StringIO()
    ex = explain_roles(tied, file=buf)
    assert ex.tied_head == ("transformer/wte/embedding",)
    assert buf.getvalue().count("tied to the embedding") == 1
    untied = _tree([("model/embed_tokens/embedding", (64, 8)), ("lm_head/kernel", (8, 64))])
    buf = io.StringIO()
    assert explain_roles(untied, file=buf).tied_head == ()
    assert "tied" not in buf.getvalue()

    class Cfg:
        num_attention_heads, num_key_value_heads = 8, 2

    class BloomCfg:
        n_head = 16

    assert QKVSplit.from_config(Cfg()) == QKVSplit(num_heads=8, num_kv_heads=2)
    assert QKVSplit.from_config(BloomCfg(), layout="interleaved") == QKVSplit(num_heads=16, layout="interleaved")
