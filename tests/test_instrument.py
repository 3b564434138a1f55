"""instrument() on Linen models: the reference model (its own raw sows are the NumPy
reference), nn.scan, a tied Embed.attend head, a nested-apply head, jit + grad,
and the warnings that say what was expected."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvitals.metrics.activations import activation_metrics
from jvitals.metrics.instrument import ExpertChoices, instrument
from jvitals.metrics.moe import moe_metrics
from jvitals.metrics.probes import LogitsRows
from jvitals.reference_model import Decoder, ModelConfig, init_params, loss_fn, make_batch
from jvitals.metrics.stats import TokenSummary


def _split(inter):
    """(the model's own sows, instrument's sows) of one intermediates tree."""
    ours = (TokenSummary, LogitsRows, ExpertChoices)

    def keep(pred):
        def walk(node):
            out = {}
            for k, v in node.items():
                if isinstance(v, dict):
                    sub = walk(v)
                    if sub:
                        out[k] = sub
                else:
                    items = tuple(x for x in v if pred(isinstance(x, ours)))
                    if items:
                        out[k] = items
            return out
        return walk(inter)

    return keep(lambda o: not o), keep(lambda o: o)


def _leaves(tree, name):
    """Every value sown as `name`, in model order (layers_0, layers_1, ...)."""
    out = []

    def walk(node, path):
        for k in sorted(node, key=lambda s: [int(p) if p.isdigit() else p for p in s.replace("_", " _ ").split()]):
            v = node[k]
            if isinstance(v, dict):
                walk(v, path + (k,))
            elif k == name:
                out.extend(v)
    walk(tree, ())
    return out


def _rms(x, valid):
    x = np.asarray(x, np.float64)[valid]
    return np.sqrt(np.mean(x * x))


CFG = ModelConfig(n_layers=3, attn_gate=True, moe=True, n_mtp=1)


@pytest.fixture(scope="module")
def ref_run():
    params = init_params(CFG, jax.random.key(0))
    batch = make_batch(0, CFG, batch=2, seq=16, pad_fraction=0.25)

    @jax.jit
    def f(p):
        with instrument():
            loss, inter = loss_fn(p, batch, CFG)
        return loss, inter

    loss, inter = jax.device_get(f(params))
    return params, batch, loss, inter


def test_reference_model_figures_against_its_own_raw_sows(ref_run):
    _, batch, _, inter = ref_run
    own, ours = _split(inter)
    valid = np.asarray(batch["mask"])
    act = activation_metrics(ours, mask=batch["mask"])
    for name in ("hidden_states", "attn_out_before_proj", "gate_scores"):
        raw = _leaves(own, name)
        if name == "attn_out_before_proj":  # the o_proj's input: after the gate (the model sows before)
            raw = [np.asarray(o, np.float64) * np.asarray(g, np.float64)
                   for o, g in zip(raw, _leaves(own, "gate_scores"))]
        assert len(raw) == CFG.n_layers and len(_leaves(ours, name)) == CFG.n_layers, name
        for i, x in enumerate(raw):
            np.testing.assert_allclose(act[f"act/{name}_rms/layer_{i}"], _rms(x, valid), rtol=2e-5, err_msg=name)
        np.testing.assert_allclose(act[f"act/{name}_rms.avg"], np.mean([_rms(x, valid) for x in raw]), rtol=2e-5)
    hs = [np.abs(np.asarray(x, np.float64)[valid]).max() for x in _leaves(own, "hidden_states")]
    np.testing.assert_allclose(act["act/hidden_states_abs.max"], max(hs), rtol=2e-5)
    z = np.asarray(_leaves(own, "logits")[0], np.float64)[valid]
    np.testing.assert_allclose(act["act/output_layer_logits_rms.avg"], np.sqrt(np.mean(z * z)), rtol=2e-5)
    np.testing.assert_allclose(act["act/output_layer_logits_abs.max"], np.abs(z).max(), rtol=2e-5)
    # The second call of the same lm_head (the MTP depth) is sown as mtp_logits.
    main = np.argmax(np.asarray(_leaves(own, "logits")[0]), -1)
    mtp = np.argmax(np.asarray(_leaves(own, "mtp_logits")[0]), -1)
    both = valid[:, :-1] & valid[:, 1:]
    np.testing.assert_allclose(act["act/mtp_1_lm_head_top1_agreement"],
                               np.mean((main[:, 1:] == mtp[:, :-1])[both]), rtol=1e-6)


def test_expert_choices_count_like_the_model(ref_run):
    """expert_bias is 0 at init, so top-k of the router's logits is the model's own choice."""
    _, batch, _, inter = ref_run
    own, ours = _split(inter)
    own_counts = np.stack([np.asarray(c) for c in _leaves(own, "expert_counts")])
    choices = _leaves(ours, "expert_counts")
    assert len(choices) == CFG.n_layers and all(isinstance(c, ExpertChoices) for c in choices)
    got = np.stack([np.asarray(c.counts(batch["mask"])) for c in choices])
    np.testing.assert_array_equal(got, own_counts)
    m_own = moe_metrics(own, top_k=CFG.top_k)
    m_ours = moe_metrics(ours, top_k=CFG.top_k, mask=batch["mask"])
    for k in ("moe/maxvio.mean", "moe/dead_expert_ratio", "moe/window_tokens", "moe/load_cv.max"):
        np.testing.assert_allclose(m_ours[k], m_own[k], rtol=1e-6, err_msg=k)


def test_model_own_sows_win(ref_run):
    """Where the model sows a NAME itself, activation_metrics reads its values only."""
    _, batch, _, inter = ref_run
    own, _ = _split(inter)
    a_all = activation_metrics(inter, mask=batch["mask"])
    a_own = activation_metrics(own, mask=batch["mask"])
    assert a_all.keys() == a_own.keys()
    for k in a_own:
        np.testing.assert_allclose(a_all[k], a_own[k], rtol=1e-6, err_msg=k)


def test_loss_and_grads_unchanged_under_jit_and_grad():
    cfg = ModelConfig(n_layers=2, attn_gate=True)
    params = init_params(cfg, jax.random.key(1))
    batch = make_batch(1, cfg, batch=2, seq=8, pad_fraction=0.25)

    def plain(p):
        return loss_fn(p, batch, cfg)[0]

    def inst(p):
        with instrument(attn_logits=True):
            return loss_fn(p, batch, cfg)[0]

    l0, g0 = jax.jit(jax.value_and_grad(plain))(params)
    l1, g1 = jax.jit(jax.value_and_grad(inst))(params)
    np.testing.assert_allclose(l1, l0, rtol=1e-7)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_scan_stacked_layers():
    cfg = ModelConfig(n_layers=3, scan_layers=True)
    params = init_params(cfg, jax.random.key(2))
    batch = make_batch(2, cfg, batch=2, seq=8, pad_fraction=0.25)
    with instrument():
        _, state = Decoder(cfg).apply({"params": params}, batch["tokens"], mask=batch["mask"],
                                      mutable=["intermediates"])
    own, ours = _split(state["intermediates"])
    (hs,) = _leaves(ours, "hidden_states")
    assert hs.count.shape == (3, 2, 8)  # [L, B, T]
    act = activation_metrics(ours, mask=batch["mask"])
    (raw,) = _leaves(own, "hidden_states")
    valid = np.asarray(batch["mask"])
    for i in range(3):
        np.testing.assert_allclose(act[f"act/hidden_states_rms/layer_{i}"], _rms(raw[i], valid), rtol=2e-5)


class _TiedLM(nn.Module):
    """Blocks named blocks_{i} and a head tied to the embedding through Embed.attend."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(32, 8, name="embed")
        h = emb(ids)
        for i in range(2):
            h = h + nn.Dense(8, name=f"block_{i}")(h)
        return emb.attend(nn.LayerNorm(name="ln_f")(h))


class _NestedHeadLM(nn.Module):
    """A tied head run in a nested apply, as HF-Flax GPT-2 does."""

    def setup(self):
        self.wte = nn.Embed(32, 8)
        self.lm_head = nn.Dense(32, use_bias=False)

    def __call__(self, ids):
        h = self.wte(ids)
        kernel = self.wte.variables["params"]["embedding"].T
        return self.lm_head.apply({"params": {"kernel": kernel}}, h)


@pytest.mark.parametrize("model", [_TiedLM(), _NestedHeadLM()], ids=["attend", "nested_apply"])
def test_tied_heads_are_seen(model):
    ids = jnp.arange(12).reshape(2, 6) % 32
    params = model.init(jax.random.key(0), ids)["params"]
    mask = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
    with instrument() as report:
        logits, state = model.apply({"params": params}, ids, mutable=["intermediates"])
    assert "logits" in report.sown, str(report)
    act = activation_metrics(state["intermediates"], mask=mask)
    z = np.asarray(logits, np.float64)[np.asarray(mask)]
    np.testing.assert_allclose(act["act/output_layer_logits_rms.avg"], np.sqrt(np.mean(z * z)), rtol=2e-5)


def test_probes_false_sows_raw_arrays():
    model = _TiedLM()
    ids = jnp.arange(12).reshape(2, 6) % 32
    params = model.init(jax.random.key(0), ids)["params"]
    with instrument(probes=False):
        _, state = model.apply({"params": params}, ids, mutable=["intermediates"])
    (h0,) = state["intermediates"]["block_0"]["hidden_states"]
    assert h0.shape == (2, 6, 8)
    assert isinstance(state["intermediates"]["embed"]["logits"][0], LogitsRows)  # logits: never whole


def test_warnings_say_what_to_do():
    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="thing")(x)

    x = jnp.ones((2, 3))
    p = Plain().init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"nothing was sown.*explain_roles"):
        with instrument():
            Plain().apply(p, x, mutable=["intermediates"])
    model = _TiedLM()
    ids = jnp.zeros((2, 6), jnp.int32)
    tp = model.init(jax.random.key(0), ids)
    with pytest.warns(UserWarning, match=r"mutable=\['intermediates'\]"):
        with instrument():
            model.apply(tp, ids)

    class Routed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="router")(x)

    class MoEBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Routed(name="moe")(x)

    rp = MoEBlock().init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"instrument\(top_k=K\)"):
        with instrument():
            MoEBlock().apply(rp, x, mutable=["intermediates"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with instrument(top_k=2):
            _, st = MoEBlock().apply(rp, x, mutable=["intermediates"])
    assert isinstance(st["intermediates"]["moe"]["router"]["expert_counts"][0], ExpertChoices)


def test_dense_model_moe_metrics_says_no_expert_counts(ref_run):
    cfg = ModelConfig(n_layers=2)
    params = init_params(cfg, jax.random.key(0))
    batch = make_batch(0, cfg, batch=2, seq=8)
    with instrument():
        _, state = Decoder(cfg).apply({"params": params}, batch["tokens"], mask=batch["mask"],
                                      mutable=["intermediates"])
    with pytest.raises(ValueError, match="no expert counts were sown"):
        moe_metrics(state["intermediates"], top_k=2)
    with pytest.raises(ValueError, match=r"nothing was sown.*instrument\(\)"):
        activation_metrics({})
