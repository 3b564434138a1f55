"""Plausible mistakes across the public API (issue 42): each is a clear error raised by jvitals,
naming the argument, the value and the fix; or, where accepted by design, a documented behaviour
checked here against NumPy. None passes silently, none loses data.

Each case asserts the exception class and the words of its message; the tables below hold one
row a mistake (docs/API.md, "Mistakes, said out loud").
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax.linen as nn

import jvitals as vitals
import jvitals.metrics.activations as activations_doc


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"layers_0": {"self_attn": {"q_proj": {"kernel": jax.random.normal(k[0], (8, 8))},
                                       "k_proj": {"kernel": jax.random.normal(k[1], (8, 8))}}},
            "lm_head": {"kernel": jax.random.normal(k[2], (8, 16))}}


# ----------------------------------------------------------------------------------
# The monitor: names it cannot read are said out loud.


def test_a_loop_logging_its_own_names_is_told_which_rules_are_blind_and_the_mapping(caplog):
    caplog.set_level(logging.WARNING, logger="jvitals.monitor")
    mon = vitals.Monitor()
    mon.update(0, {"train/loss": 3.0, "grad_norm": 1.0, "lr": 1e-3})
    (rec,) = [r for r in caplog.records if r.name == "jvitals.monitor"]
    msg = rec.getMessage()
    assert "no 'loss', 'grad/global_norm'" in msg and "spike" in msg and "ratio" in msg
    assert "vitals.Monitor(names={" in msg and "'train/loss': 'loss'" in msg and "'grad_norm': 'grad/global_norm'" in msg
    assert mon.coverage.missing == ("loss", "grad/global_norm")
    caplog.clear()
    mon.update(50, {"train/loss": 3.0, "grad_norm": 1.0})
    assert not [r for r in caplog.records if r.name == "jvitals.monitor"]       # said once


def test_the_name_mapping_gives_the_rules_their_input(caplog):
    caplog.set_level(logging.WARNING, logger="jvitals.monitor")
    mon = vitals.Monitor(names={"train/loss": "loss", "grad_norm": "grad/global_norm"})
    levels = []
    for s in range(0, 1500, 10):
        loss = 3.0 if s < 1000 else 9.0                 # the loss x3 at step 1000
        gn = 1.0 if s < 1000 else 50.0                  # the grad norm x50
        levels.append(int(mon.update(s, {"train/loss": loss, "grad_norm": gn}).level))
    assert not caplog.records                           # everything understood: quiet
    assert max(levels[:100]) == 0 and max(levels[100:]) >= int(vitals.Level.ORANGE)


def test_the_same_fault_under_unmapped_names_is_not_caught_and_that_is_said(caplog):
    caplog.set_level(logging.WARNING, logger="jvitals.monitor")
    mon = vitals.Monitor()
    for s in range(0, 1500, 10):
        mon.update(s, {"train/loss": 3.0 if s < 1000 else 9.0, "grad_norm": 1.0 if s < 1000 else 50.0})
    assert any("have no input" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("names, cls, words", [
    ({"train/loss": 3}, TypeError, "maps names to names"),
    (["train/loss"], TypeError, "expects a mapping"),
    ({"a": "loss", "b": "loss"}, ValueError, "several of your names onto ['loss']"),
])
def test_a_bad_name_mapping_is_a_clear_error(names, cls, words):
    with pytest.raises(cls, match=None) as e:
        vitals.Monitor(names=names)
    assert words in str(e.value)


def test_a_mapped_name_that_collides_with_a_logged_one_is_an_error():
    mon = vitals.Monitor(names={"train/loss": "loss"})
    with pytest.raises(ValueError, match="'train/loss' maps to 'loss'.*hold already"):
        mon.update(0, {"train/loss": 1.0, "loss": 1.0})


@pytest.mark.parametrize("field, value", [
    ("thresholds", {"grad/gloabl_norm": (2.0, 3.0)}),
    ("jump_metrics", {"update/param_ration": 5.0}),
    ("trend_metrics", {"param/global_nrom": 1.5}),
    ("schedule_metrics", ("grad/global_norms",)),
])
def test_a_misspelled_figure_in_a_policy_is_an_error_naming_the_right_one(field, value):
    with pytest.raises(ValueError, match="did you mean") as e:
        vitals.RatioConfig(**{field: value})
    assert f"RatioConfig.{field}" in str(e.value)


# ----------------------------------------------------------------------------------
# The guard: a verdict of the wrong type, a bad LR scale, a dtype change on restore.


@pytest.mark.parametrize("wrong", [vitals.Level.RED, 3, "RED", {"level": 3}])
def test_the_guard_given_something_else_than_the_verdict_is_an_error(tmp_path, wrong):
    guard = vitals.Rollback(tmp_path, save_every=100)
    state = {"params": _params(), "step": jnp.int32(0)}
    with pytest.raises(TypeError, match="expects the Verdict that monitor.update") as e:
        guard.respond(0, state, wrong, 1)
    if not isinstance(wrong, dict):
        assert "a RED would be handled as GREEN" in str(e.value)
    guard.close()


@pytest.mark.parametrize("value", [-0.5, 0.0, math.nan, math.inf])
def test_a_negative_zero_or_non_finite_lr_scale_is_an_error(value):
    st = vitals.with_lr_scale(optax.adamw(1e-3)).init(_params())
    with pytest.raises(ValueError, match="finite number > 0"):
        vitals.set_lr_scale(st, value)


def test_with_lr_scale_given_an_uncalled_optimizer_factory_says_so():
    with pytest.raises(TypeError, match="a factory: call it"):
        vitals.with_lr_scale(optax.adamw)


def test_a_float32_checkpoint_restored_into_a_bf16_state_is_an_error_naming_the_path(tmp_path):
    params = {"w": jnp.ones((4, 4), jnp.float32)}
    tx = vitals.with_lr_scale(optax.adamw(1e-3))
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0)}
    guard = vitals.Rollback(tmp_path, save_every=1)
    guard.act(0, state, None, 1)
    guard.close()
    bf16 = {**state, "params": {"w": params["w"].astype(jnp.bfloat16)},
            "opt_state": tx.init({"w": params["w"].astype(jnp.bfloat16)})}
    guard = vitals.Rollback(tmp_path, save_every=1)
    with pytest.raises(vitals.CheckpointMismatchError, match="as float32 but the train state has bfloat16") as e:
        guard.resume(bf16, 0, vitals.Monitor())
    assert "checkpoint 0" in str(e.value) and "cast deliberately" in str(e.value)
    guard.close()
    assert (tmp_path / "0").exists()                    # nothing quarantined, nothing deleted


# ----------------------------------------------------------------------------------
# The loss: the ignore index.


def test_labels_of_minus_100_without_a_mask_are_padding_not_a_nan():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 9)).astype(np.float32)
    labels = np.array([[1, 2, -100, 3, -100, 8], [0, -100, 5, 4, 4, 7]])
    loss, figs = vitals.cross_entropy(jnp.asarray(x), jnp.asarray(labels))
    valid = labels >= 0
    xs = x.astype(np.float64)
    lse = np.log(np.exp(xs).sum(-1))
    picked = np.take_along_axis(xs, np.maximum(labels, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), ((lse - picked) * valid).sum() / valid.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(figs["act/output_layer_logsumexp.mean"]), lse[valid].mean(), rtol=1e-6)



# ----------------------------------------------------------------------------------
# The tables: one row a mistake (what the user wrote, the exception, words of its message).
# Each row is built lazily (a lambda) so a row's set-up cannot fail the collection.


def _x(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def _sown(**named):
    return {"layers_0": {k: (v,) for k, v in named.items()}}


def _adam_state():
    return optax.adam(1e-3).init(_params())


def _scaled_state():
    return vitals.with_lr_scale(optax.adamw(1e-3)).init(_params())


def _recorder_update(**kwargs):
    tx = optax.chain(vitals.record(), optax.adam(1e-3))
    return tx.update(_params(), tx.init(_params()), _params(), **kwargs)


def _logit_metrics():
    return {"act/attn_logits_abs.max/layer_0": jnp.float32(50.0)}


def _recorder_args(order):
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    p = _params()
    st = tx.init(p)
    args = {"none": (None, st, p), "swapped": (p, p, st), "other": (p, st, {"w": _x(3)})}[order]
    return tx.update(*args)


RECORDER = [
    ("update of grads None", lambda: _recorder_args("none"), TypeError,
     r"tx.update\(grads, opt_state, params\) got grads=None"),
    ("update with opt_state and params swapped", lambda: _recorder_args("swapped"), TypeError,
     r"opt_state is dict, not the state tx.init\(params\) returned; were the arguments swapped"),
    ("update with another model's params", lambda: _recorder_args("other"), ValueError,
     "params does not hold the leaves of grads"),
    ("typo vitals_layer", lambda: _recorder_update(vitals_layer=True), TypeError,
     r"unknown keyword argument vitals_layer=True; did you mean vitals_heavy=\?.*'vitals_read'"),
    ("the former vitals_layers", lambda: _recorder_update(vitals_layers=True), TypeError,
     r"unknown keyword argument vitals_layers=True; did you mean vitals_heavy=\?.*'vitals_heavy'"),
    ("typo vitals_lr_scales", lambda: _recorder_update(vitals_lr_scales=0.5), TypeError,
     r"did you mean vitals_lr_scale=\?"),
    ("unknown vitals_every", lambda: _recorder_update(vitals_every=10), TypeError,
     r"vitals_every=10.*the vitals_\* keywords are \['vitals_heavy', 'vitals_lr_scale', 'vitals_read'\]"),
    ("uncalled factory", lambda: vitals.record(optax.adam), TypeError, "it is a factory: call it"),
    ("a string for the transform", lambda: vitals.record("adam"), TypeError,
     r"record\(inner=...\) expects an optax GradientTransformation, got str 'adam'"),
    ("every an int", lambda: vitals.record(every=10), TypeError,
     r"record\(every=10\) expects a mapping.*every=\{'heavy': 10\}"),
    ("every unknown family", lambda: vitals.record(every={"grads": 10}), ValueError, "unknown family 'grads'"),
    ("every a former family name", lambda: vitals.record(every={"layers": 10}), ValueError,
     r"unknown family 'layers'; families are \['light', 'heavy'\]; did you mean 'heavy'\?"),
    ("every zero", lambda: vitals.record(every={"heavy": 0}), ValueError, "a cadence must be >= 1 update"),
    ("every a float", lambda: vitals.record(every={"heavy": 2.5}), TypeError, "a cadence is an int"),
    ("post misspelled", lambda: vitals.record(post="clipped"), ValueError,
     r"post='clipped' is not one of \['auto', 'clip', 'update'\]; did you mean 'clip'"),
    ("roles a dict", lambda: vitals.record(roles={"q": "wq"}), TypeError,
     r"record: roles= expects a jvitals.Roles, got dict.*Roles\(\).extend"),
    ("roles the class", lambda: vitals.record(roles=vitals.Roles), TypeError, "the class itself: call it"),
    ("schedule a name", lambda: vitals.record(schedule="cosine"), TypeError,
     "expects a float or an optax schedule"),
    ("recorded(None)", lambda: vitals.recorded(None), TypeError, r"recorded\(\) expects the optimizer state"),
    ("recorded(the transform)", lambda: vitals.recorded(optax.adam(1e-3)), TypeError,
     "pass state.opt_state, not the transform"),
    ("recorded_steps(None)", lambda: vitals.recorded_steps(None), TypeError,
     r"recorded_steps\(\) expects the optimizer state"),
]

OPTIM = [
    ("lr scale a string", lambda: vitals.with_lr_scale(optax.adam(1e-3), "1"), TypeError,
     "a learning-rate scale must be a number, e.g. 0.5, got str '1'"),
    ("lr scale negative", lambda: vitals.with_lr_scale(optax.adam(1e-3), -1.0), ValueError, "finite number > 0"),
    ("groups an int", lambda: vitals.with_lr_scale(optax.adam(1e-3), groups=3), TypeError,
     r"with_lr_scale\(groups=3\) expects None, 'roles', a function"),
    ("group scale a tuple", lambda: vitals.with_lr_scale(optax.adam(1e-3), groups={"embedding": ("emb",)}),
     TypeError, r"with_lr_scale\(groups=\{'embedding': ...\}\): a learning-rate scale must be a number"),
    ("with_lr_scale roles dict", lambda: vitals.with_lr_scale(optax.adam(1e-3), groups="roles", roles={}),
     TypeError, "with_lr_scale: roles= expects a jvitals.Roles"),
    ("a string for the optimizer", lambda: vitals.with_lr_scale("adamw"), TypeError,
     "expects an optax GradientTransformation, got str"),
    ("set_lr_scale a string", lambda: vitals.set_lr_scale(_scaled_state(), "0.5"), TypeError,
     r"set_lr_scale\(tree, value\): a learning-rate scale must be a number.*got str '0.5'"),
    ("set_lr_scale None", lambda: vitals.set_lr_scale(_scaled_state(), None), TypeError,
     "got NoneType None; the order is set_lr_scale"),
    ("set_lr_scale swapped", lambda: vitals.set_lr_scale(0.5, _scaled_state()), TypeError,
     r"got InjectStatefulHyperparamsState.*the order is set_lr_scale\(tree, value, group=None\)"),
    ("set_lr_scale a group without groups", lambda: vitals.set_lr_scale(_scaled_state(), 0.5, group="embedding"),
     ValueError, "holds no per-group scales"),
    ("get_lr_scale without the wrapper", lambda: vitals.get_lr_scale(_adam_state()), ValueError,
     r"built with jvitals.with_lr_scale\(tx\)"),
    ("set_remedy misspelled", lambda: vitals.set_remedy(_scaled_state(), "qk_clip_tua", 50.0), ValueError,
     "unknown remedy setting 'qk_clip_tua'"),
    ("remedy misspelled", lambda: vitals.remedy(_scaled_state(), "zloss"), ValueError,
     "unknown remedy setting 'zloss'"),
    ("skip_step uncalled factory", lambda: vitals.skip_step(optax.adam), TypeError,
     r"skip_step\(inner=...\).*it is a factory: call it"),
    ("skip_step window 1", lambda: vitals.skip_step(optax.adam(1e-3), window=1), ValueError,
     "a window of at least 2 updates"),
    ("skip_step sigma 0", lambda: vitals.skip_step(optax.adam(1e-3), sigma=0.0), ValueError,
     "a positive number of standard deviations"),
    ("layer decay 0", lambda: vitals.layerwise_lr_decay(0.0), ValueError, r"decay=0.0 must be a number in \(0, 1\]"),
    ("layer decay above 1", lambda: vitals.layerwise_lr_decay(1.5), ValueError, r"decay=1.5 must be a number in"),
    ("adaptive clip alpha 1", lambda: vitals.adaptive_clip(alpha=1.0), ValueError, r"alpha=1.0 must be a number in"),
    ("adaptive clip z 0", lambda: vitals.adaptive_clip(z=0), ValueError, "z=0 must be a positive number"),
    ("adaptive clip max_norm negative", lambda: vitals.adaptive_clip(max_norm=-1.0), ValueError,
     "max_norm=-1.0 must be None or a positive number"),
    ("qk_clip no figures", lambda: vitals.qk_clip(_params(), None, 10.0), TypeError,
     "qk_clip: attn_logits_max is None"),
    ("qk_clip tau a string", lambda: vitals.qk_clip(_params(), _logit_metrics(), "10"), ValueError,
     "tau='10' must be a positive number, e.g. 100.0, not a string"),
    ("qk_clip tau negative", lambda: vitals.qk_clip(_params(), _logit_metrics(), -1.0), ValueError,
     "tau=-1.0 must be a positive number"),
    ("qk_clip figures absent", lambda: vitals.qk_clip(_params(), {"loss": 1.0}, 10.0), ValueError,
     "the metrics dict has no 'act/attn_logits_abs.max' figure"),
    ("qk_clip roles dict", lambda: vitals.qk_clip(_params(), _logit_metrics(), 10.0, roles={}), TypeError,
     "qk_clip: roles= expects a jvitals.Roles"),
    ("loss arguments swapped", lambda: vitals.cross_entropy(_x(2, 6, dtype=jnp.int32), _x(2, 6, 9)), TypeError,
     "logits have dtype int32.*were logits and labels swapped"),
    ("loss labels float", lambda: vitals.cross_entropy(_x(2, 6, 9), _x(2, 6)), TypeError,
     "labels have dtype float32; expected integer token ids"),
    ("loss labels None", lambda: vitals.cross_entropy(_x(2, 6, 9), None), TypeError,
     "cross_entropy: labels is None"),
    ("loss labels one-hot", lambda: vitals.cross_entropy(_x(2, 6, 9), _x(2, 6, 9, dtype=jnp.int32)), ValueError,
     r"labels have shape \(2, 6, 9\), expected .* \(2, 6\)"),
    ("loss mask flattened", lambda: vitals.cross_entropy(_x(2, 6, 9), _x(2, 6, dtype=jnp.int32), _x(12)),
     ValueError, r"mask has shape \(12,\), expected .* \(2, 6\)"),
    ("loss z weight negative", lambda: vitals.cross_entropy(_x(2, 6, 9), _x(2, 6, dtype=jnp.int32),
                                                             z_loss_weight=-1.0), ValueError, "must be >= 0"),
    ("loss axis unbound", lambda: vitals.cross_entropy(_x(2, 6, 9), _x(2, 6, dtype=jnp.int32), axes=("data",)),
     ValueError, "mesh axis 'data' is not bound here"),
    ("z_loss weight negative", lambda: vitals.z_loss(_x(2, 6, 9), weight=-1.0), ValueError, "weight=-1.0 must be"),
    ("z_loss integer logits", lambda: vitals.z_loss(_x(2, 6, dtype=jnp.int32)), TypeError,
     "z_loss: logits have dtype int32"),
    ("get_lr_scales of None", lambda: vitals.get_lr_scales(None), TypeError, "get_lr_scales: tree is None"),
    ("groups misspelled", lambda: vitals.with_lr_scale(optax.adam(1e-3), groups="role"), ValueError,
     r"with_lr_scale\(groups='role'\): expected None, 'roles'"),
    ("a group no leaf belongs to", lambda: vitals.set_lr_scale(
        vitals.with_lr_scale(optax.adam(1e-3), groups="roles").init(_params()), 0.5, group="layer_99"),
     ValueError, r"no parameter belongs to group 'layer_99'; the groups are \['layer_0', 'lm_head'\]"),
    ("layer decay roles a dict", lambda: vitals.layerwise_lr_decay(0.9, roles={}), TypeError,
     "layerwise_lr_decay: roles= expects a jvitals.Roles"),
    ("adaptive clip warmup a float", lambda: vitals.adaptive_clip(warmup_steps=2.5), ValueError,
     "warmup_steps=2.5 must be an int >= 1"),
]

METRICS = [
    ("summarize mask of another shape", lambda: vitals.summarize(_x(24, 8), _x(4, 6)), ValueError,
     r"mask of shape \(4, 6\) does not broadcast against x of shape \(24, 8\)"),
    ("summarize axis out of range", lambda: vitals.summarize(_x(4, 6, 8), axis=5), ValueError,
     "axis=5 is out of range"),
    ("gradients as a list of ints", lambda: vitals.gradient_metrics([1, 2, 3]), TypeError,
     r"grads: the leaf at \[0\] is int 1, not an array"),
    ("a global norm of a string", lambda: vitals.global_norm("abc"), TypeError,
     "the leaf at the root is str 'abc', not an array"),
    ("optimizer statistics of the params", lambda: vitals.optimizer_metrics(_params()), TypeError,
     "opt_state holds arrays but no optax state .*were the params passed"),
    ("a global norm's prefix not a str", lambda: vitals.global_norm_metrics(_params(), prefix=3), TypeError,
     "prefix=3, suffix='' must be str"),
    ("a Python float among the leaves", lambda: vitals.global_norm({"a": _x(4), "b": 1.5}), TypeError,
     r"the leaf at \['b'\] is float 1.5, not an array"),
    ("summarize of None", lambda: vitals.summarize(None), TypeError,
     "summarize.x=.... expects an array, got NoneType"),
    ("summarize over a mesh axis name", lambda: vitals.summarize(_x(4, 6), axis="data"), TypeError,
     r"axis='data': expected an int .*reduce\(summary, axes=...\)"),
    ("reduce over an index", lambda: vitals.reduce(vitals.summarize(_x(4)), 0), TypeError,
     r"axes=0: expected mesh axis names, e.g. axes=\('data',\)"),
    ("reduce outside shard_map", lambda: vitals.reduce(vitals.summarize(_x(4)), ("data",)), ValueError,
     r"mesh axis 'data' is not bound here.*axes=\(\) under plain jit"),
    ("activations None", lambda: vitals.activation_metrics(None), TypeError,
     "expected the sown 'intermediates' dict"),
    ("activations an array", lambda: vitals.activation_metrics(_x(4, 6, 8)), TypeError,
     "expected the sown 'intermediates' dict"),
    ("activations nothing sown", lambda: vitals.activation_metrics({}), ValueError, "nothing was sown"),
    ("[B*T, D] hidden states, [B, T] mask",
     lambda: vitals.activation_metrics(_sown(hidden_states=_x(24, 8)), mask=_x(4, 6, dtype=bool)), ValueError,
     r"mask has shape \(4, 6\) but the sown 'hidden_states' .* shape \(24, 8\).*reshape it to \(4, 6, 8\)"),
    ("[B*T, D] value of any name, [B, T] mask",
     lambda: vitals.activation_metrics(_sown(mlp_out=_x(24, 8)), mask=_x(4, 6, dtype=bool)), ValueError,
     r"mask has shape \(4, 6\) but the sown 'mlp_out' .* shape \(24, 8\).*B\*T = 24"),
    ("[T, B] mask", lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)), mask=_x(6, 4, dtype=bool)),
     ValueError, r"mask has shape \(6, 4\) but .* shape \(4, 6, 8\)"),
    ("activations names a string", lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)),
                                                                     names="hidden_states"), TypeError,
     r"names='hidden_states' is a string, read as its letters; pass a tuple of names: names=\('hidden_states',\)"),
    ("activations name misspelled", lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)),
                                                                     names=("hidden_state",)), ValueError,
     r"requested sow name\(s\) \['hidden_state'\] absent"),
    ("activations labels float", lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)),
                                                                   labels=_x(4, 6)), TypeError,
     "labels have dtype float32; expected integer token ids"),
    ("activations labels and mask disagree",
     lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)), mask=_x(4, 6, dtype=bool),
                                       labels=_x(4, 5, dtype=jnp.int32)), ValueError,
     r"labels have shape \(4, 5\) but the mask has shape \(4, 6\)"),
    ("accuracy without labels", lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)), accuracy=True),
     ValueError, "accuracy=True needs labels"),
    ("activations axes an index", lambda: vitals.activation_metrics(_sown(hidden_states=_x(4, 6, 8)), axes=0),
     TypeError, "axes=0: expected mesh axis names"),
    ("gradients None", lambda: vitals.gradient_metrics(None), TypeError, "gradient_metrics: grads is None"),
    ("params of another model", lambda: vitals.gradient_metrics(_params(), params={"w": _x(3)}), ValueError,
     r"params does not hold the leaves of grads \(3 leaves vs 1.*were they swapped"),
    ("updates without params", lambda: vitals.gradient_metrics(_params(), updates=_params()), ValueError,
     "pass params= too"),
    ("per a string", lambda: vitals.gradient_metrics(_params(), per="layer"), TypeError,
     r"per='layer' is a string, read as its letters; pass a tuple of names: per=\('layer',\)"),
    ("per misspelled", lambda: vitals.gradient_metrics(_params(), per=("layers",)), ValueError,
     "per holds 'layers', not one of \\['layer', 'role'\\]; did you mean 'layer'"),
    ("gradients roles the class", lambda: vitals.gradient_metrics(_params(), roles=vitals.Roles), TypeError,
     r"gradient_metrics: roles= expects a jvitals.Roles.*call it, roles=vitals.Roles\(\)"),
    ("gradients prefix an int", lambda: vitals.gradient_metrics(_params(), prefix=3), TypeError,
     "prefix=3 must be a str"),
    ("global_norm None", lambda: vitals.global_norm(None), TypeError, "global_norm: tree is None"),
    ("update_metrics None", lambda: vitals.update_metrics(None), TypeError, "update_metrics: updates is None"),
    ("update_metrics params of another model", lambda: vitals.update_metrics(_params(), {"w": _x(3)}),
     ValueError, "params does not hold the leaves of updates"),
    ("optimizer_metrics None", lambda: vitals.optimizer_metrics(None), TypeError,
     r"optimizer_metrics\(\) expects the optimizer state"),
    ("optimizer_metrics the transform", lambda: vitals.optimizer_metrics(optax.adam(1e-3)), TypeError,
     "not the transform"),
    ("optimizer_metrics median unknown", lambda: vitals.optimizer_metrics(_adam_state(), median="yes"),
     ValueError, "choose one of"),
    ("moe top_k 0", lambda: vitals.moe_metrics(_x(2, 8), top_k=0), ValueError, "top_k must be a positive int"),
    ("moe top_k above E", lambda: vitals.moe_metrics(_x(2, 8), top_k=9), ValueError,
     "top_k=9 exceeds the number of experts E=8"),
    ("moe top_k a float", lambda: vitals.moe_metrics(_x(2, 8), top_k=2.0), ValueError, "got 2.0"),
    ("moe counts per token", lambda: vitals.moe_metrics(_x(2, 3, 8), top_k=2), ValueError,
     r"has shape \(2, 3, 8\) \(rank 3\)"),
    ("moe bias of another E", lambda: vitals.moe_metrics(_x(2, 8), top_k=2, expert_bias=_x(2, 7)), ValueError,
     r"expert_bias has shape \(2, 7\) but the counts have E=8"),
    ("moe on a dense model", lambda: vitals.moe_metrics(_sown(hidden_states=_x(4, 6, 8)), top_k=2), ValueError,
     "no expert counts were sown"),
    ("moe window of no layer", lambda: vitals.moe_window_init(0, 8), ValueError, "need num_layers >= 1"),
    ("moe window of another shape", lambda: vitals.moe_window_update(vitals.moe_window_init(2, 8), _x(3, 8)),
     ValueError, r"build it with moe_window_init\(3, 8\)"),
    ("mtp depths of another shape", lambda: vitals.mtp_metrics(_x(2, 6, dtype=jnp.int32),
                                                               [_x(2, 5, dtype=jnp.int32)]), ValueError,
     r"mtp_argmax\[0\] has shape \(2, 5\), main_argmax \(2, 6\)"),
    ("mtp one array for the depths", lambda: vitals.mtp_metrics(_x(2, 6, dtype=jnp.int32),
                                                                _x(2, 6, dtype=jnp.int32)), TypeError,
     r"mtp_argmax must be a list.*pass \[argmax\]"),
    ("mtp logits for the argmax", lambda: vitals.mtp_metrics(_x(2, 6, 9), [_x(2, 6, 9)]), ValueError,
     r"main_argmax has shape \(2, 6, 9\); expected \[B, T\]"),
    ("replica window of none", lambda: vitals.replica_window_init(0), ValueError, "replicas=0 must be an int >= 1"),
    ("replicas not dividing the batch", lambda: vitals.replica_metrics(loss=_x(8), replicas=3), ValueError,
     "not divisible by replicas=3"),
    ("replica layout of None", lambda: vitals.replica_layout(None), TypeError,
     "must be a jax.sharding.Mesh"),
    ("replica layout axis unknown", lambda: vitals.replica_layout(jax.make_mesh((8,), ("data",)), ("dp",)),
     ValueError, r"the batch axes \['dp'\] must be among them"),
    ("assign_roles None", lambda: vitals.assign_roles(None), TypeError, "assign_roles: tree is None"),
    ("assign_roles roles a dict", lambda: vitals.assign_roles(_params(), {"q": "wq"}), TypeError,
     "assign_roles: roles= expects a jvitals.Roles"),
    ("explain_roles None", lambda: vitals.explain_roles(None, file=None), TypeError,
     "explain_roles: params is None"),
    ("explain_roles roles a dict", lambda: vitals.explain_roles(_params(), {"q": "wq"}, file=None), TypeError,
     "explain_roles: roles= expects a jvitals.Roles"),
    ("Roles patterns a dict", lambda: vitals.Roles(patterns={"q": "wq"}), TypeError,
     r"expects \(role, regex\) pairs.*Roles\(\).extend"),
    ("Roles bad regex", lambda: vitals.Roles(patterns=(("q", "wq("),)), ValueError,
     "is not a valid regular expression"),
    ("Roles stacked axis a string", lambda: vitals.Roles(stacked_axis="0"), TypeError,
     r"Roles\(stacked_axis='0'\) expects None or an int"),
    ("required role absent", lambda: vitals.assign_roles(_params(), vitals.Roles(required=("embedding",))),
     ValueError, "required role 'embedding' matched no parameter"),
    ("instrument roles a dict", lambda: vitals.instrument(roles={}).__enter__(), TypeError,
     "instrument: roles= expects a jvitals.Roles"),
    ("instrument top_k 0", lambda: vitals.instrument(top_k=0).__enter__(), ValueError,
     "instrument: top_k=0 must be >= 1"),
    ("instrument names a string", lambda: vitals.instrument(names="mlp").__enter__(), TypeError,
     "names='mlp' is a string, read as its letters"),
    ("StepTimer negative tokens", lambda: vitals.StepTimer(-5), ValueError, "tokens_per_step=-5 must be an int >= 0"),
    ("StepTimer tokens a string", lambda: vitals.StepTimer("128"), TypeError, "tokens_per_step='128' must be an int"),
    ("StepTimer clock a number", lambda: vitals.StepTimer(clock=3.0), TypeError, "clock=3.0 must be a function"),
    ("device memory of a platform name", lambda: vitals.device_memory_metrics("cpu"), TypeError,
     "must be a list of jax devices"),
    ("logits without a vocabulary axis", lambda: vitals.summarize_logits(jnp.float32(1.0)), ValueError,
     r"summarize_logits: logits must have a vocabulary axis \[..., V\], got shape \(\)"),
    ("logits mask flattened", lambda: vitals.summarize_logits(_x(2, 6, 9), _x(12)), ValueError,
     r"the mask must have their leading shape \(2, 6\), got \(12,\)"),
    ("global_norm_metrics None", lambda: vitals.global_norm_metrics(None), TypeError,
     "global_norm_metrics: tree is None"),
    ("moe window arguments swapped", lambda: vitals.moe_window_update(_x(2, 8), vitals.moe_window_init(2, 8)),
     TypeError, r"state must be the MoEWindowState.*the order is \(state, expert_counts\)"),
    ("replica window without the figure", lambda: vitals.replica_window_update(vitals.replica_window_init(2), {}, 0),
     ValueError, r"expected metrics\['replica/nonfinite'\] of shape \(2,\)"),
    ("bos tokens and mask disagree", lambda: vitals.bos_value_grad_metrics(
        {"layers_0": {"bos_value": (_x(2, 6, 8),)}}, _x(2, 6, dtype=jnp.int32), mask=_x(2, 5, dtype=bool)),
     ValueError, r"mask has shape \(2, 5\) but tokens have shape \(2, 6\)"),
]

MONITOR = [
    ("Policy the class", lambda: vitals.Monitor(vitals.Policy), TypeError, "Monitor expects a jvitals Policy"),
    ("Policy a dict", lambda: vitals.Monitor({"ratio": {}}), TypeError, "Monitor expects a jvitals Policy, got dict"),
    ("a config for the policy", lambda: vitals.Monitor(vitals.RatioConfig()), TypeError, "got RatioConfig"),
    ("rules the uncalled function", lambda: vitals.Monitor(rules=vitals.default_rules), TypeError,
     "default_rules is a function: call it with the policy"),
    ("a rule without a name", lambda: vitals.Monitor(rules=[object()]), TypeError,
     "need a non-empty str `name` and a `check"),
    ("step a string", lambda: vitals.Monitor().update("10", {"loss": 1.0}), TypeError,
     "step must be an integer, got str '10'"),
    ("step a float", lambda: vitals.Monitor().update(10.5, {"loss": 1.0}), TypeError,
     "step must be an integer, got float 10.5"),
    ("arguments swapped", lambda: vitals.Monitor().update({"loss": 1.0}, 0), TypeError,
     "step must be an integer, got dict"),
    ("figures None", lambda: vitals.Monitor().update(0, None), TypeError, "expects a mapping of metric name"),
    ("a figure a string", lambda: vitals.Monitor().update(0, {"loss": "1.0"}), TypeError,
     "metric 'loss': expected a real number"),
    ("a figure a vector", lambda: vitals.Monitor().update(0, {"loss": np.ones(3)}), TypeError,
     r"metric 'loss': expected a scalar \(0-d\) value, got an array of shape \(3,\)"),
    ("Policy field a dict", lambda: vitals.Policy(ratio={"thresholds": {}}), TypeError,
     "Policy.ratio expects a RatioConfig, got dict"),
    ("Policy field another config", lambda: vitals.Policy(ratio=vitals.SpikeConfig()), TypeError,
     "Policy.ratio expects a RatioConfig, got SpikeConfig"),
    ("thresholds inverted", lambda: vitals.RatioConfig(thresholds={"grad/global_norm": (3.0, 2.0)}), ValueError,
     r"expects 0 < yellow < orange, got \(3.0, 2.0\)"),
    ("metric names a number", lambda: vitals.SpikeConfig(metrics=3), TypeError,
     r"SpikeConfig.metrics .*expects a sequence of metric names, e.g. \('loss',\), got int 3"),
    ("metric names a string", lambda: vitals.SpikeConfig(metrics="loss"), TypeError,
     "expects a sequence of metric names.*got the string 'loss'"),
    ("warmup negative", lambda: vitals.BaselineConfig(warmup_steps=-1), ValueError,
     "BaselineConfig.warmup_steps .*expects None or an integer >= 0, got -1"),
    ("steps as a string", lambda: vitals.BaselineConfig(steps="100"), TypeError,
     r"BaselineConfig.steps \(Policy.state_dict key 'baseline_steps'\) expects an integer, got str '100'"),
    ("a flat policy key as a keyword", lambda: vitals.Policy(spike_z=5.0), TypeError,
     r"Policy got unknown keyword 'spike_z': it lives in Policy\(spike=SpikeConfig\(z=\.\.\.\)\)"),
    ("a threshold as a string", lambda: vitals.SpikeConfig(z="6"), TypeError,
     r"SpikeConfig.z .*expects a number, got str '6'"),
    ("hysteresis negative", lambda: vitals.AlertConfig(hysteresis=-1), ValueError,
     r"AlertConfig.hysteresis .*expects a value in \(0, 1\]"),
    ("flat_replicas of None", lambda: vitals.flat_replicas(None), TypeError, "flat_replicas expects the"),
    ("Retention keeps nothing", lambda: vitals.Retention(keep_last=0), ValueError,
     "Retention expects keep_last >= 1, got 0"),
    ("lr factor above 1", lambda: vitals.Recovery(lr_factor=1.5), ValueError,
     r"Recovery expects lr_factor in \(0, 1\], got 1.5"),
    ("lr factor 0", lambda: vitals.Recovery(lr_factor=0.0), ValueError, "lr_factor in"),
    ("max rollbacks negative", lambda: vitals.Recovery(max_rollbacks=-1), ValueError,
     "max_rollbacks >= 0 or None, got -1"),
    ("remedies misspelled", lambda: vitals.Recovery(remedies="defualt"), ValueError,
     "expected None, 'default' or a dict"),
    ("healthy levels by name", lambda: vitals.RestorePolicy(healthy_levels={"GREEN"}), ValueError,
     r"healthy_levels Levels, e.g. \{Level.GREEN, Level.YELLOW\}, got 'GREEN'"),
    ("healthy levels one level", lambda: vitals.RestorePolicy(healthy_levels=3), ValueError,
     "healthy_levels an iterable of levels"),
    ("a Policy field misspelled", lambda: vitals.Policy(ratios=vitals.RatioConfig()), TypeError,
     r"Policy got unknown keyword 'ratios'; its keywords are the configs \['baselines', 'ratio',"),
    ("Preemption of one signal", lambda: vitals.Preemption(15), TypeError,
     r"Preemption expects a sequence of signals, e.g. \(signal.SIGTERM,\), got 15"),
]


@pytest.mark.parametrize("build, cls, words", [pytest.param(*row[1:], id=row[0])
                                                for row in RECORDER + OPTIM + METRICS + MONITOR])
def test_a_plausible_mistake_is_a_clear_error(build, cls, words):
    with pytest.raises(cls, match=words):
        build()


class _Writer:
    def __init__(self):
        self.scalars = {}

    def write_scalars(self, step, scalars):
        self.scalars[step] = dict(scalars)

    def write_texts(self, step, texts):
        pass


WRITE = [
    ("arguments swapped", lambda w: vitals.write(0, w, {"loss": 1.0}), TypeError,
     r"writer must be a clu MetricWriter instance.*got int 0; the order is write\(writer, step"),
    ("the writer class", lambda w: vitals.write(_Writer, 0, {"loss": 1.0}), TypeError, "got type"),
    ("step a string", lambda w: vitals.write(w, "0", {"loss": 1.0}), TypeError, "write: step must be an int"),
    ("metrics None", lambda w: vitals.write(w, 0, None), TypeError, r"metrics must be a \{name: value\} mapping"),
    ("a verdict's level", lambda w: vitals.write(w, 0, {"loss": 1.0}, vitals.Level.RED), TypeError,
     "its level alone would lose the alerts"),
    ("a verdict as a dict", lambda w: vitals.write(w, 0, {"loss": 1.0}, {"level": 3}), TypeError,
     "verdict must be the Verdict monitor.update returned"),
    ("one event, not a list", lambda w: vitals.write(w, 0, {"loss": 1.0}, events={"event": "x"}), TypeError,
     r"events must be a list of dicts.*wrap it, events=\[...\]"),
    ("a figure not numeric", lambda w: vitals.write(w, 0, {"loss": "abc"}), TypeError,
     "metric 'loss' must be numeric"),
]


@pytest.mark.parametrize("build, cls, words", [pytest.param(*row[1:], id=row[0]) for row in WRITE])
def test_a_write_mistake_is_a_clear_error_and_writes_nothing(build, cls, words):
    w = _Writer()
    with pytest.raises(cls, match=words):
        build(w)
    assert not w.scalars


def _guard_state(step=0):
    tx = vitals.with_lr_scale(optax.adam(1e-3))
    return {"params": _params(), "opt_state": tx.init(_params()), "step": jnp.int32(step)}


def _act_back(d):
    guard = vitals.Rollback(d, save_every=10)
    guard.act(100, _guard_state(100), None, 1)
    return guard.act(50, _guard_state(50), None, 1)


GUARD = [
    ("directory None", lambda d: vitals.Rollback(None), TypeError, "Rollback expects a directory"),
    ("save_every 0", lambda d: vitals.Rollback(d, save_every=0), ValueError, "save_every >= 1, got 0"),
    ("save_every a float", lambda d: vitals.Rollback(d, save_every=10.5), TypeError,
     "save_every= an int number of steps, got float 10.5"),
    ("a misspelled option", lambda d: vitals.Rollback(d, save_evry=10), TypeError,
     "unexpected keyword argument 'save_evry'"),
    ("a keyword of 0.1", lambda d: vitals.Rollback(d, pause="raise", keep_last=2), TypeError,
     r"no longer takes pause=: pass saving=Saving\(pause=...\); keep_last=: pass retention=Retention"),
    ("retention a dict", lambda d: vitals.Rollback(d, retention={"keep_last": 2}), TypeError,
     "retention= a Retention, got dict"),
    ("the Monitor class", lambda d: vitals.Rollback(d, monitor=vitals.Monitor), TypeError,
     r"got the class Monitor, not an instance: pass monitor=Monitor\(...\)"),
    ("snapshots every 0", lambda d: vitals.Rollback(d, saving=vitals.Saving(snapshots=vitals.Snapshots(every=0))), ValueError,
     r"Snapshots\(every >= 1, keep >= 1\)"),
    ("store keeps nothing", lambda d: vitals.CheckpointStore(d, keep_last=0), ValueError,
     "CheckpointStore expects keep_last >= 1"),
    ("step goes back without resume", _act_back, ValueError,
     r"step 50 after step 100 goes back without a rollback or a resume.*guard.resume\(state"),
    ("step a string", lambda d: vitals.Rollback(d).act("0", _guard_state(), None, 1), TypeError,
     r"Rollback.act: step must be an int.*got str '0'"),
    ("step a float", lambda d: vitals.Rollback(d).act(1.5, _guard_state(), None, 1), TypeError,
     r"got float 1.5; the step comes first: Rollback.act\(step, state"),
    ("step negative", lambda d: vitals.Rollback(d).act(-3, _guard_state(), None, 1), ValueError,
     "step=-3 must be >= 0"),
    ("state and verdict swapped", lambda d: vitals.Rollback(d).act(0, None, _guard_state(), 1), TypeError,
     "expects the Verdict that monitor.update"),
    ("a state without the LR scale", lambda d: vitals.Rollback(d).act(0, {"params": _params()}, None, 1),
     ValueError, r"wrapped with jvitals.with_lr_scale\(tx\)"),
    ("store directory None", lambda d: vitals.CheckpointStore(None), TypeError,
     "CheckpointStore expects a directory"),
    ("resume given the Monitor class", lambda d: vitals.Rollback(d).resume(_guard_state(), 0, vitals.Monitor),
     TypeError, "got the class Monitor: pass the instance"),
    ("save step a string", lambda d: vitals.Rollback(d).save("10", _guard_state()), TypeError,
     r"Rollback.save: step must be an int.*got str '10'"),
]


@pytest.mark.parametrize("build, cls, words", [pytest.param(*row[1:], id=row[0]) for row in GUARD])
def test_a_guard_mistake_is_a_clear_error(tmp_path, build, cls, words):
    with pytest.raises(cls, match=words):
        build(str(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------------
# Mistakes that need a model, and what is accepted by design (documented where the user reads).


class _TwoLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.Dense(8, name=f"layers_{i}")(x)
        return x


def test_instrument_entered_twice_is_an_error_not_twice_the_layers():
    model, x = _TwoLayers(), jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    with vitals.instrument():
        with pytest.raises(RuntimeError, match=r"instrument\(\) is already open: entered twice.*4 layers"):
            with vitals.instrument():
                pass
        _, state = model.apply(variables, x, mutable=["intermediates"])   # the outer one still works
    m = vitals.activation_metrics(state["intermediates"])
    assert {k for k in m if "/layer_" in k and k.startswith("act/hidden_states_rms/")} == {
        "act/hidden_states_rms/layer_0", "act/hidden_states_rms/layer_1"}
    with vitals.instrument():                                              # closed: can be opened again
        pass


def test_the_step_may_go_back_after_a_resume(tmp_path):
    guard = vitals.Rollback(tmp_path, save_every=10)
    guard.act(100, _guard_state(100), None, 1)
    guard.close()
    guard = vitals.Rollback(tmp_path, save_every=10)
    state, _ = guard.resume(_guard_state(), 0, vitals.Monitor())
    assert guard.act(101, state, None, 2).action in (vitals.Action.CONTINUE, vitals.Action.SAVED)
    guard.close()


def test_a_state_without_a_recorder_reads_as_no_figures_as_documented():
    assert "empty if there is no recorder" in vitals.recorded.__doc__
    assert len(vitals.recorded(_adam_state())) == 0 and vitals.recorded_steps(_adam_state()) == {}


def test_a_single_mesh_axis_name_is_a_tuple_of_one_for_the_recorder():
    """``record(axes="data")`` is ``axes=("data",)`` (Sequence[str] | str, as everywhere), not its letters."""
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    g = {"w": jnp.arange(32.0).reshape(8, 4)}
    specs = {"w": P("data")}
    tx = vitals.record(axes="data", specs=specs, every={"heavy": 1})
    state_specs = jax.tree.map(lambda _: P(), tx.init(g))
    step = jax.jit(jax.shard_map(lambda g, s: tx.update(g, s)[1], mesh=mesh, in_specs=(specs, state_specs),
                                 out_specs=state_specs))
    put = jax.device_put(g, jax.sharding.NamedSharding(mesh, P("data")))
    got = vitals.recorded(step({"w": put["w"]}, tx.init(g)))
    np.testing.assert_allclose(float(got["grad/global_norm"]), np.linalg.norm(np.arange(32.0)), rtol=1e-6)


def test_a_generic_value_that_is_not_token_shaped_is_summarised_whole_as_documented():
    assert "summarised whole, unmasked" in activations_doc.__doc__ and "[B*T, D]" in activations_doc.__doc__
    x = np.arange(30, dtype=np.float32).reshape(5, 6)       # [5, 6]: neither [B, T, ...] nor [B*T, ...]
    m = vitals.activation_metrics(_sown(router_stats=jnp.asarray(x)), mask=jnp.ones((4, 6), bool))
    np.testing.assert_allclose(float(m["act/router_stats_rms"]), np.sqrt((x.astype(np.float64) ** 2).mean()),
                               rtol=1e-6)
