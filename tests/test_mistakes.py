"""Plausible mistakes across the public API: each is a clear error raised by jvitals, naming the
argument, the value and the fix; or, where accepted by design, a documented behaviour checked
here against NumPy. None passes silently, none loses data.

Each case asserts the exception class and the words of its message.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jvitals as vitals


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
