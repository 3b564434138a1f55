"""Flax NNX, first class: the figures on NNX models written by others, every number
against NumPy.

Models: an NNX model of our own with HF's names (``nnx_models.HFStyleLM``) and tunix's
NNX Llama 3 (GQA, per-head einsum weights), Qwen 3 (q/k norms) and Gemma (stacked
``kv_einsum``, or ``qkv_einsum`` with as many KV heads as heads; a tied embedding),
tiny and random-initialised (tunix installed with ``--no-deps``; skipped with the
reason when it is absent). The NumPy references name each parameter by hand, per
family (``REFERENCE_ROLES``), not by jvitals' patterns.
"""

from __future__ import annotations

import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiers import tiered
from flax import nnx

import jvitals as vitals
import nnx_models as nm
from jvitals.metrics.paths import path_str

# tunix's model files use APIs their dependencies now deprecate (Variable.value, sharding=,
# jax.experimental.shard_map, pxla.thread_resources): not ours to fix, kept out of the report.
pytestmark = [pytest.mark.filterwarnings(f"ignore:{m}:DeprecationWarning") for m in (
    r".*'\.value' access is now deprecated", "'sharding' is deprecated", "jax.experimental.shard_map is deprecated",
    "jax.interpreters.pxla.thread_resources is deprecated")]

# ----------------------------------------------------------------------------------
# The models and, by hand, what each parameter is.

FAMILIES = ("plain", "llama3", "qwen3", "gemma", "gemma_mha")
SLOW_FAMILIES = ("qwen3", "gemma", "gemma_mha")   # the fast tier: plain and llama3


def build(family: str, seed: int = 0):
    """``(model, call(model, tokens, mask) -> logits, vocab)``."""
    if family == "plain":
        model = nm.HFStyleLM(rngs=nnx.Rngs(seed))
        return model, (lambda m, t, k: m(t, k)), 61
    if family == "llama3":
        model, cfg = nm.tunix_llama3(seed=seed)
    elif family == "qwen3":
        model, cfg = nm.tunix_qwen3(seed=seed)
    elif family == "gemma":
        model, cfg = nm.tunix_gemma(seed=seed)          # 4 heads, 1 KV head: q_einsum + kv_einsum
    else:
        model, cfg = nm.tunix_gemma(kv_heads=4, seed=seed)  # MHA: qkv_einsum [3, H, D, Dh]

    def call(m, tokens, mask):
        pos, attn = nm.tunix_inputs(tokens, mask)
        return m(tokens, pos, None, attn)[0]

    return model, call, 53


# Per family: (regex on the pure-dict path, metric base, part index along axis 0 or None).
_LAYER = r"layers/(\d+)/"
REFERENCE_ROLES = {
    "plain": [
        (r"^embed_tokens/embedding$", "word_embeddings", None),
        (r"^lm_head/kernel$", "output_layer", None),
        (r"^norm/scale$", "final_norm", None),
        (_LAYER + r"self_attn/q_proj/kernel$", "Wq", None),
        (_LAYER + r"self_attn/k_proj/kernel$", "Wk", None),
        (_LAYER + r"self_attn/v_proj/kernel$", "Wv", None),
        (_LAYER + r"self_attn/o_proj/kernel$", "Wo", None),
        (_LAYER + r"mlp/gate_proj/kernel$", "W_gate", None),
        (_LAYER + r"mlp/up_proj/kernel$", "W_up", None),
        (_LAYER + r"mlp/down_proj/kernel$", "W_down", None),
        (_LAYER + r"input_layernorm/scale$", "input_layernorm", None),
        (_LAYER + r"post_attention_layernorm/scale$", "post_attention_layernorm", None),
    ],
    "llama3": [
        (r"^embedder/input_embedding$", "word_embeddings", None),
        (r"^lm_head/w$", "output_layer", None),
        (r"^final_norm/w$", "final_norm", None),
        (_LAYER + r"attn/q_proj/w$", "Wq", None),
        (_LAYER + r"attn/k_proj/w$", "Wk", None),
        (_LAYER + r"attn/v_proj/w$", "Wv", None),
        (_LAYER + r"attn/o_proj/w$", "Wo", None),
        (_LAYER + r"mlp/gate_proj/kernel$", "W_gate", None),
        (_LAYER + r"mlp/up_proj/kernel$", "W_up", None),
        (_LAYER + r"mlp/down_proj/kernel$", "W_down", None),
        (_LAYER + r"input_layernorm/w$", "input_layernorm", None),
        (_LAYER + r"post_attention_layernorm/w$", "post_attention_layernorm", None),
    ],
}
REFERENCE_ROLES["qwen3"] = REFERENCE_ROLES["llama3"] + [
    (_LAYER + r"attn/q_norm/w$", "q_norm", None),
    (_LAYER + r"attn/k_norm/w$", "k_norm", None),
]
_GEMMA = [
    (r"^embedder/input_embedding$", "word_embeddings", None),
    (r"^final_norm/scale$", "final_norm", None),
    (_LAYER + r"attn/attn_vec_einsum/w$", "Wo", None),
    (_LAYER + r"mlp/gate_proj/kernel$", "W_gate", None),
    (_LAYER + r"mlp/up_proj/kernel$", "W_up", None),
    (_LAYER + r"mlp/down_proj/kernel$", "W_down", None),
    (_LAYER + r"pre_attention_norm/scale$", "pre_attention_norm", None),
    (_LAYER + r"pre_ffw_norm/scale$", "pre_ffw_norm", None),
]
REFERENCE_ROLES["gemma"] = _GEMMA + [
    (_LAYER + r"attn/q_einsum/w$", "Wq", None),
    (_LAYER + r"attn/kv_einsum/w$", "Wk", 0),     # [2, KVH, D, Dh]: K is [0], V is [1]
    (_LAYER + r"attn/kv_einsum/w$", "Wv", 1),
]
REFERENCE_ROLES["gemma_mha"] = _GEMMA + [
    (_LAYER + r"attn/qkv_einsum/w$", "Wq", 0),    # [3, H, D, Dh]
    (_LAYER + r"attn/qkv_einsum/w$", "Wk", 1),
    (_LAYER + r"attn/qkv_einsum/w$", "Wv", 2),
]


def flat(tree) -> dict[str, np.ndarray]:
    """``{path: array}`` of a pure dict (``nnx.to_pure_dict``), paths joined by hand."""
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            p = f"{prefix}/{k}" if prefix else str(k)
            if isinstance(v, dict):
                walk(v, p)
            else:
                out[p] = np.asarray(v, np.float64)

    walk(tree, "")
    return out


def reference(family: str, grads: dict[str, np.ndarray]) -> dict[str, float]:
    """Every role figure (global and per layer), the global, per-layer and group norms, in NumPy."""
    pieces: dict[str, list[np.ndarray]] = {}
    per_layer: dict[tuple[str, int], list[np.ndarray]] = {}
    layer_sq: dict[int, float] = {}
    matched = set()
    for path, g in grads.items():
        m_layer = re.match(r"layers/(\d+)/", path)
        if m_layer:
            layer_sq[int(m_layer.group(1))] = layer_sq.get(int(m_layer.group(1)), 0.0) + float(np.sum(g ** 2))
        for rx, base, part in REFERENCE_ROLES[family]:
            m = re.search(rx, path)
            if m:
                matched.add(path)
                x = g if part is None else g[part]
                pieces.setdefault(base, []).append(x.ravel())
                if m.groups():
                    per_layer.setdefault((base, int(m.group(1))), []).append(x.ravel())
    assert matched == set(grads), f"the reference names every parameter: {sorted(set(grads) - matched)}"
    want = {"grad/global_norm": float(np.sqrt(sum(np.sum(g ** 2) for g in grads.values())))}
    for base, xs in pieces.items():
        x = np.concatenate(xs)
        want[f"grad/{base}_rms"] = float(np.sqrt(np.mean(x ** 2)))
        want[f"grad/{base}_abs.max"] = float(np.abs(x).max())
    for (base, i), xs in per_layer.items():
        x = np.concatenate(xs)
        want[f"grad/{base}_rms/layer_{i}"] = float(np.sqrt(np.mean(x ** 2)))
        want[f"grad/{base}_abs.max/layer_{i}"] = float(np.abs(x).max())
    for i, sq in layer_sq.items():
        want[f"grad/norm/layer_{i}"] = float(np.sqrt(sq))
    emb = np.concatenate(pieces["word_embeddings"])
    want["grad/norm/embedding"] = float(np.sqrt(np.sum(emb ** 2)))
    if "output_layer" in pieces:
        want["grad/norm/lm_head"] = float(np.sqrt(np.sum(np.concatenate(pieces["output_layer"]) ** 2)))
    return want


def loss_fn(call, tokens, mask):
    """Masked next-token cross-entropy of a right-padded batch."""
    def f(model):
        logits = call(model, tokens, mask).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits[:, :-1])
        ll = jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
        w = (mask[:, 1:] & mask[:, :-1]).astype(jnp.float32)
        return -(ll * w).sum() / w.sum()
    return f


@pytest.fixture(autouse=True)
def _third_party_broadcasting():
    """tunix's models broadcast ``[D] * [B, T, D]`` implicitly; conftest makes that an error
    for jvitals' own code. Allowed here, around the models' calls only where jvitals is not."""
    with jax.numpy_rank_promotion("allow"):
        yield


# ----------------------------------------------------------------------------------
# Paths and roles.


def test_path_drops_the_variable_level_only():
    model = nm.HFStyleLM(rngs=nnx.Rngs(0))
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]]
    assert "layers/0/self_attn/q_proj/kernel" in paths and not any(p.endswith("value") for p in paths)
    # A Linen module called "value" (a dict key) keeps its name: it is the V projection.
    linen = {"params": {"attn": {"value": {"kernel": jnp.ones((4, 4))}}}}
    (p, _), = jax.tree_util.tree_flatten_with_path(linen)[0]
    assert path_str(p) == "params/attn/value/kernel"
    assert vitals.Roles().role_of(path_str(p))[0] == "v"


@pytest.mark.parametrize("family", tiered(FAMILIES, SLOW_FAMILIES))
def test_explain_roles_on_nnx_state(family):
    """explain_roles(nnx.state(model, nnx.Param)) gives every leaf the role the hand table
    gives it, unmatched none (before: every leaf read as 'v (Wv)', 'unmatched: none')."""
    model, _, _ = build(family)
    buf = io.StringIO()
    ex = vitals.explain_roles(nnx.state(model, nnx.Param), file=buf)
    names = {}
    for lr in ex.leaves:
        if lr.role in ("qkv", "kv"):
            names[lr.path] = lr.role
        else:
            names[lr.path] = lr.name
    for path, name in names.items():
        rows = [base for rx, base, _ in REFERENCE_ROLES[family] if re.search(rx, path)]
        if names[path] == "qkv":
            assert rows == ["Wq", "Wk", "Wv"], path
        elif names[path] == "kv":
            assert rows == ["Wk", "Wv"], path
        else:
            assert rows == [name], (path, name, rows)
    assert ex.unmatched == ()
    assert bool(ex.tied_head) == family.startswith("gemma")
    table = buf.getvalue()
    assert "unmatched: none" in table
    v_rows = [line for line in table.splitlines() if " v (Wv) " in line]
    assert all(re.search(r"/(v_proj)/", line) for line in v_rows)   # only the V projections read as Wv


def test_a_leaf_no_role_matches_is_unmatched_not_defaulted():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.mystery = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
            self.lm_head = nnx.Linear(4, 8, use_bias=False, rngs=rngs)

    model = Odd(nnx.Rngs(0))
    ex = vitals.explain_roles(nnx.state(model, nnx.Param), file=None)
    assert ex.unmatched == ("mystery/kernel",)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    m = vitals.gradient_metrics(grads)
    # counted in the global norm, in no role
    np.testing.assert_allclose(float(m["grad/global_norm"]), np.sqrt(16 + 32), rtol=1e-6)
    assert {k for k in m if k.endswith("_rms")} == {"grad/output_layer_rms"}


# ----------------------------------------------------------------------------------
# Gradient figures.


@pytest.fixture(scope="module", params=tiered(FAMILIES, FAMILIES[1:]))
def trained_grads(request):
    family = request.param
    model, call, vocab = build(family, seed=3)
    tokens, mask = nm.batch(vocab, seed=4)
    with jax.numpy_rank_promotion("allow"):
        grads = nnx.jit(nnx.grad(loss_fn(call, tokens, mask)))(model)
        metrics = jax.jit(lambda g, p: vitals.gradient_metrics(g, params=p))(grads, nnx.state(model, nnx.Param))
    return family, model, grads, jax.device_get(metrics)


def test_gradient_figures_on_nnx_grads_match_numpy(trained_grads):
    """gradient_metrics(State that nnx.grad returns): every role figure, global and per layer,
    the per-layer and group norms, against NumPy on the named arrays (rtol 2e-4)."""
    family, model, grads, got = trained_grads
    want = reference(family, flat(nnx.to_pure_dict(grads)))
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(got["grad/global_norm"], float(optax.tree.norm(grads)), rtol=1e-5)
    for name in ("Wq", "Wk", "Wv", "Wo", "W_gate", "W_up", "W_down"):
        assert f"grad/{name}_rms/layer_1" in got and f"grad/{name}_abs.max/layer_0" in got
    assert "grad/word_embeddings_abs.max" in got
    assert ("grad/output_layer_abs.max" in got) == (not family.startswith("gemma"))   # tied: omitted
    # the figure names are exactly the reference's role families, no stray role
    roles = {k.split("/")[1].rsplit("_", 1)[0] for k in got if k.endswith("_rms") and k.count("/") == 1}
    assert roles == {k.split("/")[1].rsplit("_", 1)[0] for k in want if k.endswith("_rms") and k.count("/") == 1}
    params = flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(got["param/global_norm"],
                               np.sqrt(sum(np.sum(p ** 2) for p in params.values())), rtol=1e-5)


# ----------------------------------------------------------------------------------
# instrument() on NNX models.


def hidden_states_by_hand(family, model, tokens, mask):
    """Each decoder layer's output, running the layers one by one (no instrument)."""
    if family == "plain":
        x = model.embed_tokens(tokens)
        out = []
        for layer in model.layers:
            x = layer(x, mask)
            out.append(x)
        return out
    pos, attn = nm.tunix_inputs(tokens, mask)
    x = model.embedder.encode(tokens)
    out = []
    for layer in model.layers:
        _, x = layer(x, pos, None, attn)   # tunix's layers return (cache, x)
        out.append(x)
    return out


def act_reference(hidden, logits, mask):
    m = np.asarray(mask)
    hs = [np.asarray(h, np.float64)[m] for h in hidden]
    z = np.asarray(logits, np.float64)[m]
    return {"act/hidden_states_rms.avg": np.mean([np.sqrt(np.mean(h ** 2)) for h in hs]),
            "act/hidden_states_abs.max": max(np.abs(h).max() for h in hs),
            **{f"act/hidden_states_rms/layer_{i}": np.sqrt(np.mean(h ** 2)) for i, h in enumerate(hs)},
            "act/output_layer_logits_rms.avg": np.sqrt(np.mean(z ** 2)),
            "act/output_layer_logits_abs.max": np.abs(z).max()}


@pytest.mark.parametrize("family", tiered(FAMILIES, SLOW_FAMILIES))
@pytest.mark.parametrize("idiom", ["capture", "pop"])
def test_instrument_inside_nnx_jit_matches_numpy(family, idiom):
    """instrument() around an NNX model's call inside nnx.jit sows per-token summaries that
    activation_metrics turns into each decoder layer's output figures and the logits',
    equal to NumPy over the valid tokens of a right-padded batch; a layer returning
    (cache, x) is read at x; Gemma's tied head (Embedder.decode) gives the logits."""
    model, call, vocab = build(family, seed=1)
    tokens, mask = nm.batch(vocab, b=4, t=9, pad=(0, 3, 5, 1), seed=2)

    @nnx.jit
    def forward(model, tokens, mask):
        with vitals.instrument():
            if idiom == "capture":
                logits, sown = nnx.capture(lambda m: call(m, tokens, mask), nnx.Intermediate)(model)
            else:
                logits = call(model, tokens, mask)
                sown = nnx.pop(model, nnx.Intermediate)
        return logits, vitals.activation_metrics(sown, mask=mask)

    logits, got = jax.device_get(forward(model, tokens, mask))
    want = act_reference(hidden_states_by_hand(family, model, tokens, mask), logits, mask)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, err_msg=k)
    n_layers = len(model.layers)
    assert {k for k in got if k.startswith("act/hidden_states_rms/layer_")} == {
        f"act/hidden_states_rms/layer_{i}" for i in range(n_layers)}
    assert f"act/attn_out_before_proj_rms/layer_{n_layers - 1}" in got
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))   # popped, or never set (capture)


def test_instrument_sows_summaries_never_the_logits_and_reads_attention_input():
    """The sown values are per-token summaries (no [B, T, V] array); the attention output
    projection's input matches the attention computed by hand."""
    model, call, vocab = build("plain", seed=5)
    tokens, mask = nm.batch(vocab, seed=6)
    with vitals.instrument() as report:
        _, sown = nnx.capture(lambda m: call(m, tokens, mask), nnx.Intermediate)(model)
    assert set(report.sown) == {"hidden_states", "attn_out_before_proj", "logits"}
    assert report.sown["logits"] == ["lm_head"]
    sizes = [x.size for x in jax.tree.leaves(sown)]
    assert max(sizes) < tokens.size * vocab
    act = vitals.activation_metrics(sown, mask=mask)
    # attention core output before o_proj, layer 0, by hand
    layer = model.layers[0]
    h = layer.input_layernorm(model.embed_tokens(tokens))
    a = layer.self_attn
    b, t, _ = h.shape
    q = np.asarray(a.q_proj(h)).reshape(b, t, a.heads, a.head_dim)
    k = np.repeat(np.asarray(a.k_proj(h)).reshape(b, t, a.kv_heads, a.head_dim), a.heads // a.kv_heads, 2)
    v = np.repeat(np.asarray(a.v_proj(h)).reshape(b, t, a.kv_heads, a.head_dim), a.heads // a.kv_heads, 2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(a.head_dim)
    allowed = np.tril(np.ones((t, t), bool))[None, None] & np.asarray(mask)[:, None, None, :]
    s = np.where(allowed, s, -1e9)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, -1)[np.asarray(mask)]
    np.testing.assert_allclose(act["act/attn_out_before_proj_rms/layer_0"], np.sqrt(np.mean(o ** 2)), rtol=2e-4)


@pytest.mark.slow
def test_instrument_in_an_nnx_training_step_changes_nothing():
    """Inside nnx.value_and_grad + nnx.Optimizer under nnx.jit: the loss and the gradients are
    those of the uninstrumented step, the figures arrive as the step's aux."""
    model, call, vocab = build("llama3", seed=2)
    tokens, mask = nm.batch(vocab, seed=3)
    f = loss_fn(call, tokens, mask)

    def instrumented(m):
        with vitals.instrument():
            loss, sown = nnx.capture(f, nnx.Intermediate)(m)
        return loss, sown

    (loss, sown), grads = nnx.jit(nnx.value_and_grad(instrumented, has_aux=True))(model)
    loss0, grads0 = nnx.jit(nnx.value_and_grad(f))(model)
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss0))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(grads), nnx.to_pure_dict(grads0))
    act = vitals.activation_metrics(sown, mask=mask)
    assert np.isfinite(float(act["act/hidden_states_rms.avg"]))


def test_instrument_warns_when_an_nnx_model_has_nothing_it_knows():
    class Blob(nnx.Module):
        def __init__(self, rngs):
            self.mystery = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return self.mystery(x)

    with pytest.warns(UserWarning, match="nothing was sown.*transformer block"):
        with vitals.instrument() as report:
            Blob(nnx.Rngs(0))(jnp.ones((2, 3, 4)))
    assert str(report) == "nothing sown"
    # and the classes are restored on exit
    assert not hasattr(nnx.Linear.__call__, "_jvitals_intercepted")


# ----------------------------------------------------------------------------------
# The recorder in nnx.Optimizer.


def _record_tx(schedule, clip=1.0, **kw):
    return vitals.with_lr_scale(vitals.record(
        optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule)), schedule=schedule, **kw), **{})


@pytest.mark.slow
def test_recorder_in_nnx_optimizer_gives_the_linen_paths_figures():
    """nnx.Optimizer(model, record(...)); optimizer.update(model, grads, vitals_heavy=full);
    vitals.recorded(optimizer.opt_state) as it is: the same names and values as the same
    transformation applied to the plain arrays (the Linen path), the pre-clip norm
    optax.global_norm's, the per-role figures NumPy's."""
    model, call, vocab = build("plain", seed=7)
    tokens, mask = nm.batch(vocab, seed=8)
    schedule = optax.linear_schedule(1e-3, 1e-4, 50)
    tx = _record_tx(schedule, clip=0.05)
    params0 = jax.tree.map(jnp.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    opt_state0 = tx.init(params0)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit(static_argnames="full")
    def step(model, optimizer, full):
        grads = nnx.grad(loss_fn(call, tokens, mask))(model)
        optimizer.update(model, grads, vitals_heavy=full)
        return grads

    grads = step(model, optimizer, True)
    got = jax.device_get(vitals.recorded(optimizer.opt_state))
    assert all(np.ndim(v) == 0 for v in got.values())        # scalars, not the wrapped vector
    pure_grads = nnx.to_pure_dict(grads)
    _, linen_state = jax.jit(lambda g, s, p: tx.update(g, s, p, vitals_heavy=True))(pure_grads, opt_state0, params0)
    linen = jax.device_get(vitals.recorded(linen_state))
    assert set(got) == set(linen)
    for k in linen:
        np.testing.assert_allclose(got[k], linen[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(got["grad/global_norm"], float(optax.tree.norm(pure_grads)), rtol=1e-6)
    assert got["grad/clipped"] == 1.0
    want = reference("plain", flat(pure_grads))
    for k in ("grad/Wq_rms", "grad/Wv_abs.max", "grad/W_down_rms/layer_2", "grad/output_layer_abs.max",
              "grad/word_embeddings_abs.max", "grad/norm/layer_1"):
        np.testing.assert_allclose(got[k], want[k], rtol=2e-4, err_msg=k)
    # the light step: the light family only, every update
    grads = step(model, optimizer, False)
    light = jax.device_get(vitals.recorded(optimizer.opt_state))
    assert "grad/Wq_rms" not in light
    np.testing.assert_allclose(light["grad/global_norm"], float(optax.tree.norm(grads)), rtol=1e-6)
    np.testing.assert_allclose(light["opt/learning_rate"], float(schedule(1)), rtol=1e-6)
    steps = {k: int(v) for k, v in vitals.recorded_steps(optimizer.opt_state).items()}
    assert (steps["light"], steps["heavy"]) == (1, 0)            # the light step counted, no heavy one


@pytest.mark.slow
def test_optimizer_metrics_and_lr_scale_on_nnx_optimizer_state():
    model, call, vocab = build("plain", seed=9)
    optimizer = nnx.Optimizer(model, vitals.with_lr_scale(optax.adam(1e-3), groups="roles"), wrt=nnx.Param)
    tokens, mask = nm.batch(vocab)
    optimizer.update(model, nnx.grad(loss_fn(call, tokens, mask))(model))
    m = jax.device_get(vitals.optimizer_metrics(optimizer.opt_state))
    nu = [np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(optimizer.opt_state)[0]
          if "/nu/" in path_str(p)]
    assert len(nu) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(m["opt/adam_nu_abs.max"], max(np.abs(x).max() for x in nu), rtol=1e-6)
    # the scales: read on opt_state and on nnx.state; set on nnx.state and applied with nnx.update
    assert vitals.get_lr_scale(optimizer.opt_state) == 1.0
    state = nnx.state((model, optimizer))
    assert vitals.optim.has_lr_scale(state) and vitals.optim.has_lr_scale(state, "layer_2")
    assert set(vitals.get_lr_scales(state)) == {"embedding", "lm_head", "layer_0", "layer_1", "layer_2", "other"}
    nnx.update((model, optimizer), vitals.set_lr_scale(vitals.set_lr_scale(state, 0.5), 0.25, group="embedding"))
    assert vitals.get_lr_scale(optimizer.opt_state) == 0.5
    assert vitals.get_lr_scale(nnx.state(optimizer), "embedding") == 0.25
    assert vitals.get_lr_scale(optimizer.opt_state, "layer_0") == 1.0
    with pytest.raises(ValueError, match="no parameter belongs to group 'layer_9'"):
        vitals.set_lr_scale(state, 0.5, group="layer_9")


# ----------------------------------------------------------------------------------
# The guard over nnx.state((model, optimizer)).


def _nnx_run(directory, *, num_steps, fault_step=None, check_every=5, seed=0):
    """A real NNX training run, the default Monitor, the guard over nnx.state((model, optimizer));
    one update x1000 at ``fault_step``. Returns what happened."""
    from jvitals import reference_model as rm

    data = rm.ModelConfig(vocab=64)
    model = nm.HFStyleLM(vocab=64, d=32, f=64, layers=2, heads=4, kv_heads=2, rngs=nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, num_steps)
    optimizer = nnx.Optimizer(model, _record_tx(schedule), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch, mult):
        def lossf(m):
            return rm.cross_entropy(m(batch["tokens"], batch["mask"]), batch["labels"], batch["mask"])
        loss, grads = nnx.value_and_grad(lossf)(model)
        updates = optimizer.update(model, grads, vitals_heavy=False)
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        nnx.update(model, jax.tree.map(lambda p, u: p + (mult - 1.0) * u, params, updates))  # x mult
        return {"loss": loss}

    monitor = vitals.Monitor()
    guard = vitals.Rollback(directory, save_every=50)
    state, position = guard.resume(nnx.state((model, optimizer)), 0, monitor)
    nnx.update((model, optimizer), state)
    losses, rollbacks, consumed = {}, [], []
    for step in range(int(optimizer.step[...]), num_steps):
        consumed.append(position)
        mult = jnp.float32(1000.0 if step == fault_step else 1.0)
        metrics = train_step(model, optimizer, rm.make_batch(position, data, batch=8, seq=32), mult)
        position += 1
        if step % check_every == 0:
            host = jax.device_get({**metrics, **vitals.recorded(optimizer.opt_state)})
            losses[step] = float(host["loss"])
            verdict = monitor.update(step, host)
            new = guard.respond(step, nnx.state((model, optimizer)), verdict, position)
            if guard.last_action is vitals.Action.ROLLBACK:
                r = guard.last_response
                saved, _ = guard.restore(r.target_step, nnx.state((model, optimizer)))
                rollbacks.append((step, r, saved))
            nnx.update((model, optimizer), new)
    guard.close()
    return model, optimizer, position, losses, rollbacks, consumed, guard


def _pure(state):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state)


@pytest.mark.slow
def test_guard_rolls_an_nnx_run_back_to_before_the_fault(tmp_path):
    """One update x1000 at step 130: RED, a rollback to a checkpoint saved before the fault
    whose parameters the restored state holds exactly, LR scale 0.9 in nnx.Optimizer's
    state after, optimizer.step and the data position kept going forward, recovery."""
    n, fault = 300, 130
    model, optimizer, position, losses, rollbacks, consumed, guard = _nnx_run(
        tmp_path, num_steps=n, fault_step=fault)
    assert len(rollbacks) == 1
    red, response, saved = rollbacks[0]
    assert fault < red and response.target_step < fault
    jax.tree.map(np.testing.assert_array_equal, _pure(saved[0]), _pure(response.state[0]))
    assert vitals.get_lr_scale(optimizer.opt_state) == pytest.approx(0.9)
    assert vitals.get_lr_scale(nnx.state((model, optimizer))) == pytest.approx(0.9)
    assert int(optimizer.step[...]) == n and position == n and consumed == list(range(n))
    pre = np.mean([v for s, v in losses.items() if fault - 40 <= s < fault])
    assert max(v for s, v in losses.items() if fault <= s <= red) > 3 * pre
    assert all(np.isfinite(v) and v < 1.5 * pre for s, v in losses.items() if s >= red + 20)


@pytest.mark.slow
def test_guard_resumes_an_nnx_run_and_resets_moments(tmp_path):
    """resume() onto a fresh model and optimizer hands back nnx.state that nnx.update applies:
    the newest checkpoint's parameters, optimizer step and LR scale; reset_adam_moments on
    an nnx.State zeroes the named moments and, when all are, the count."""
    model, optimizer, position, *_ = _nnx_run(tmp_path, num_steps=60, check_every=10)
    on_disk = {r.step for r in vitals.Rollback(tmp_path).checkpoints}
    assert on_disk == {0, 50}
    fresh = nm.HFStyleLM(vocab=64, d=32, f=64, layers=2, heads=4, kv_heads=2, rngs=nnx.Rngs(99))
    fresh_opt = nnx.Optimizer(fresh, _record_tx(optax.constant_schedule(1e-3)), wrt=nnx.Param)
    guard = vitals.Rollback(tmp_path)
    state, pos = guard.resume(nnx.state((fresh, fresh_opt)), 0, vitals.Monitor())
    nnx.update((fresh, fresh_opt), state)
    restored, _ = guard.restore(50, nnx.state((fresh, fresh_opt)))
    guard.close()
    assert guard.resumed_step == 50 and pos == 51 and int(fresh_opt.step[...]) == 51
    jax.tree.map(np.testing.assert_array_equal, _pure(nnx.state(fresh, nnx.Param)), _pure(restored[0]))
    from jvitals.guard.rollback import reset_adam_moments
    st = nnx.state((fresh, fresh_opt))
    out, summary = reset_adam_moments(st, (("embed", ("mu", "nu")),))
    flat_out = flat(_pure(out))
    assert summary["leaves"] == {"mu": ["embed_tokens/embedding"], "nu": ["embed_tokens/embedding"]}
    assert not summary["count_reset"]
    mu = [k for k in flat_out if k.endswith("/mu/embed_tokens/embedding")]
    assert mu and all(not flat_out[k].any() for k in mu)
    assert any(flat_out[k].any() for k in flat_out if "/mu/layers/0/" in k)
    adam_counts = [k[: -len("count")] for k in flat_out if k.endswith("/count")
                   and any(q.startswith(k[: -len("count")] + "nu/") for q in flat_out)]
    assert len(adam_counts) == 1 and flat_out[adam_counts[0] + "count"] == 51   # kept
    out, summary = reset_adam_moments(st, ((".*", ("mu", "nu")),))
    assert summary["count_reset"]
    everything = flat(_pure(out))
    assert everything[adam_counts[0] + "count"] == 0
    assert not any(v.any() for k, v in everything.items() if k.startswith((adam_counts[0] + "mu/", adam_counts[0] + "nu/")))
    assert everything["0/layers/0/mlp/up_proj/kernel"].any()    # the parameters are untouched


def test_a_nan_figure_in_the_recorders_state_is_not_a_sick_checkpoint():
    """The recorder's figures are measurements (a family never computed is NaN): a
    checkpoint holding them restores, in a Linen TrainState and in an nnx.State alike."""
    from jvitals.guard.checkpoints import all_finite
    params = {"w": jnp.ones((3,))}
    tx = vitals.record(optax.adam(1e-3))
    opt_state = tx.init(params)
    assert np.isnan(np.asarray(opt_state.metrics.vector)).any()
    assert all_finite({"params": params, "opt_state": opt_state})
    assert not all_finite({"params": {"w": jnp.array([1.0, np.nan])}, "opt_state": opt_state})
    model = nm.HFStyleLM(rngs=nnx.Rngs(0))
    state = nnx.state((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
    assert all_finite(state)


# ----------------------------------------------------------------------------------
# QK-clip on per-head einsum weights and stacked K/V.


def test_qk_clip_on_gemmas_einsum_weights():
    """Per layer: Wq and K (kv_einsum[0]) x sqrt(gamma), V (kv_einsum[1]) untouched; per
    head (4 query heads sharing 1 K head): K untouched, query head h (axis 0 of
    q_einsum [H, D, Dh]) x gamma_h."""
    model, _, _ = build("gemma", seed=4)
    params = nnx.state(model, nnx.Param)
    before = flat(nnx.to_pure_dict(params))
    m = jnp.array([50.0, 400.0])           # layer 1 over tau = 100: gamma 0.25
    out = flat(nnx.to_pure_dict(vitals.qk_clip(params, m, 100.0)))
    for i, g in ((0, 1.0), (1, 0.25)):
        q, kv = f"layers/{i}/attn/q_einsum/w", f"layers/{i}/attn/kv_einsum/w"
        np.testing.assert_allclose(out[q], np.sqrt(g) * before[q], rtol=1e-6)
        np.testing.assert_allclose(out[kv][0], np.sqrt(g) * before[kv][0], rtol=1e-6)
        np.testing.assert_array_equal(out[kv][1], before[kv][1])
    per_head = jnp.array([[10.0, 20.0, 30.0, 40.0], [400.0, 50.0, 200.0, 100.0]])
    out = flat(nnx.to_pure_dict(vitals.qk_clip(params, per_head, 100.0)))
    q, kv = "layers/1/attn/q_einsum/w", "layers/1/attn/kv_einsum/w"
    np.testing.assert_allclose(out[q], np.array([0.25, 1.0, 0.5, 1.0])[:, None, None] * before[q], rtol=1e-6)
    np.testing.assert_array_equal(out[kv], before[kv])
    np.testing.assert_array_equal(out["layers/0/attn/q_einsum/w"], before["layers/0/attn/q_einsum/w"])


def test_qk_clip_on_llamas_per_head_weights():
    """Llama 3's q_proj [D, H, Dh], k_proj [D, KVH, Dh]: per layer both x sqrt(gamma)."""
    model, _, _ = build("llama3", seed=4)
    params = nnx.state(model, nnx.Param)
    before = flat(nnx.to_pure_dict(params))
    out = flat(nnx.to_pure_dict(vitals.qk_clip(params, jnp.array([400.0, 50.0]), 100.0)))
    for name in ("q_proj", "k_proj"):
        np.testing.assert_allclose(out[f"layers/0/attn/{name}/w"], 0.5 * before[f"layers/0/attn/{name}/w"], rtol=1e-6)
        np.testing.assert_array_equal(out[f"layers/1/attn/{name}/w"], before[f"layers/1/attn/{name}/w"])
    np.testing.assert_array_equal(out["layers/0/attn/v_proj/w"], before["layers/0/attn/v_proj/w"])


@pytest.mark.slow
def test_instrument_counts_the_experts_of_tunixs_qwen3_moe():
    """Qwen 3's MoE layer: the router (an nnx.Linear) is found by its role, the top-k by the
    calling MoE layer's ``experts_per_tok``; moe_metrics of the sown choices over the valid
    tokens equals the counts of each layer's router top-k computed by hand."""
    model, cfg = nm.tunix_qwen3(experts=6, top_k=2, seed=3)
    ex = vitals.explain_roles(nnx.state(model, nnx.Param), file=None)
    assert ex.unmatched == () and {"router", "gate", "up", "down"} <= set(ex.by_role())
    tokens, mask = nm.batch(53, b=4, t=8, pad=(0, 3, 1, 5), seed=5)
    pos, attn = nm.tunix_inputs(tokens, mask)
    with vitals.instrument():
        _, sown = nnx.capture(lambda m: m(tokens, pos, None, attn), nnx.Intermediate)(model)
    got = jax.device_get(vitals.moe_metrics(sown, top_k=2, mask=mask))
    x = model.embedder.encode(tokens)
    counts = []
    for layer in model.layers:
        _, a = layer.attn(layer.input_layernorm(x), pos, None, attn)
        h = layer.post_attention_layernorm(a + x)
        scores = np.asarray(layer.mlp.router(h), np.float64)[np.asarray(mask)]      # [N, E]
        top = np.argsort(-scores, axis=-1)[:, :2]
        counts.append(np.bincount(top.ravel(), minlength=6))
        _, x = layer(x, pos, None, attn)
    counts = np.array(counts, np.float64)
    assert got["moe/window_tokens"] == int(np.asarray(mask).sum())
    np.testing.assert_allclose(got["moe/dead_expert_ratio"], np.mean(counts == 0))
    vio = (counts.max(1) - counts.mean(1)) / counts.mean(1)
    np.testing.assert_allclose(got["moe/maxvio.mean"], vio.mean(), rtol=1e-6)
    np.testing.assert_allclose(got["moe/maxvio.max"], vio.max(), rtol=1e-6)


@pytest.mark.slow
def test_nnx_model_sharded_on_a_mesh_figures_and_checkpoints(tmp_path, devices):
    """An NNX model whose kernels are sharded over 'model' (NamedSharding) and a batch over
    'data': under nnx.jit the recorder's and gradient_metrics' figures are those of the
    unsharded model; the guard restores nnx.state onto the same shardings."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, call, vocab = build("plain", seed=11)
    tokens, mask = nm.batch(vocab, b=4, t=8, pad=(0, 1, 2, 3), seed=12)
    f = loss_fn(call, tokens, mask)
    want = jax.device_get(vitals.gradient_metrics(nnx.grad(f)(model)))

    def shard(x):
        spec = P(None, "model") if x.ndim == 2 and x.shape[1] % 4 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    nnx.update(model, jax.tree.map(shard, nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, _record_tx(optax.constant_schedule(1e-3)), wrt=nnx.Param)
    data = NamedSharding(mesh, P("data"))
    tokens, mask = jax.device_put(tokens, data), jax.device_put(mask, data)

    @nnx.jit
    def step(model, optimizer, tokens, mask):
        grads = nnx.grad(loss_fn(call, tokens, mask))(model)
        optimizer.update(model, grads, vitals_heavy=True)
        return vitals.gradient_metrics(grads)

    got = jax.device_get(step(model, optimizer, tokens, mask))
    rec = jax.device_get(vitals.recorded(optimizer.opt_state))
    for k in ("grad/global_norm", "grad/Wq_rms", "grad/W_up_abs.max", "grad/norm/layer_1"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(rec[k], want[k], rtol=1e-5, err_msg=k)
    kernel = model.layers[0].mlp.up_proj.kernel
    assert kernel[...].sharding.spec == P(None, "model")
    with vitals.Rollback(tmp_path) as guard:
        state = nnx.state((model, optimizer))
        guard.respond(0, state, None, 1)
        guard.wait()
        restored, _ = guard.restore(0, state)
    back = restored[0]["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    assert back.sharding == kernel[...].sharding
    np.testing.assert_array_equal(np.asarray(back), np.asarray(kernel[...]))
