"""Tests of jvitals.remedies and Rollback(remedies=...): the guard applies a prescription.

The cause -> remedy table on real monitor alerts, the group LR scales checked
against plain Adam updates (optax, NumPy), the flags saved in real orbax checkpoints
and restored by ``resume``, the history/event/message/report text, and an end to
end run on the reference model (benchmarks/remedies.py's loop).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jvitals.optim.lr_scale import get_lr_scale, get_lr_scales, get_remedy, with_lr_scale
from jvitals.monitor.types import Alert, Level, Verdict
from jvitals.reference_model import ModelConfig, init_params
from jvitals.guard.remedies import (
    DEFAULT_REMEDIES,
    REMEDY_NAMES,
    applied_text,
    apply_remedies,
    causes_of,
    parse_remedies,
)
from jvitals.report.page import remedy_texts
from jvitals.guard.rollback import Action, Rollback
from jvitals.guard import Recovery, Retention

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                  sow_attn_logits=False)
ADAM = optax.adam(1e-2)
TX = with_lr_scale(ADAM, groups="roles")
TX_PLAIN = with_lr_scale(ADAM)
PARAMS = init_params(CFG, jax.random.key(0))


def alert(metric: str, rule: str = "group", level: int = Level.YELLOW, *, id_: int = 1,
          baseline: float = 1.0, value: float = 3.0, onset: int = 0, group: str | None = None) -> Alert:
    details = {"group": group} if group is not None else {}
    return Alert(id=id_, rule=rule, metric=metric, level=Level(level), step=onset, value=value,
                 baseline=baseline, ratio=value / baseline, onset_step=onset, opened_step=onset,
                 message=f"[{Level(level).name}] {metric}", cause="c", prescription="p",
                 localization=[], peak_level=Level(level), details=details)


def red_verdict(step: int, *extra: Alert, onset: int | None = None) -> Verdict:
    onset = step if onset is None else onset
    red = alert("grad/global_norm", "divergence", Level.RED, id_=99, onset=onset)
    alerts = [red, *extra]
    return Verdict(step, Level.RED, alerts, [red], [], {})


def green(step: int) -> Verdict:
    return Verdict(step, Level.GREEN, [], [], [], {})


# ----------------------------------------------------------------------------
# The table.
# ----------------------------------------------------------------------------


def test_causes_read_the_group_from_details_and_metric():
    cs = causes_of([alert("update/param_ratio/embedding", group="embedding", id_=1),
                    alert("grad/share/layer_1", id_=2), alert("loss", "loss_spike", id_=3),
                    alert("grad/share/layer_1", id_=2)])
    assert [(c.rule, c.metric, c.group) for c in cs] == [
        ("group", "update/param_ratio/embedding", "embedding"), ("group", "grad/share/layer_1", "layer_1"),
        ("loss_spike", "loss", None)]


def test_default_table_cause_to_remedy_and_scales_against_plain_adam():
    state = {"opt_state": TX.init(PARAMS)}
    alerts = [alert("update/param_ratio/embedding", group="embedding", id_=1),
              alert("grad/share/embedding", group="embedding", id_=2),   # the same group: once
              alert("grad/share/lm_head", group="lm_head", id_=3),
              alert("grad/share/layer_0", group="layer_0", id_=4),
              alert("act/attn_logits_abs.max/layer_1", "ratio", baseline=12.5, value=80.0, id_=5),
              alert("act/output_layer_logits_abs.max", "ratio", id_=6),
              alert("loss", "loss_spike", id_=7)]                             # no remedy
    new, flags, actions = apply_remedies(state, alerts, parse_remedies("default"), {}, lr_factor=0.9)
    assert [a["remedy"] for a in actions] == ["group_lr", "group_lr", "layer_decay", "qk_clip", "z_loss"]
    assert all(a["applied"] for a in actions)
    # Independent numbers: embedding 0.5 then x0.9**N (N = 2 layers); lm_head 0.5; layer i x0.9**(1-i).
    want = {"embedding": 0.5 * 0.81, "lm_head": 0.5, "layer_0": 0.9, "layer_1": 1.0, "other": 1.0}
    got = get_lr_scales(new)
    assert got == pytest.approx(want, rel=1e-6)
    assert flags["lr_groups"] == pytest.approx({k: v for k, v in want.items() if k != "other"})
    assert flags["qk_clip_tau"] == pytest.approx(12.5) and flags["z_loss"] == pytest.approx(1e-4)
    assert flags["layer_decay"] == pytest.approx(0.9)
    assert state["opt_state"] is not new["opt_state"] and get_lr_scale(state, "embedding") == 1.0  # pure
    # Each group's updates are plain Adam's x its scale (optax, no jvitals).
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), PARAMS)
    u, _ = TX.update(grads, new["opt_state"], PARAMS)
    ref, _ = ADAM.update(grads, ADAM.init(PARAMS), PARAMS)
    factor = {"embed": want["embedding"], "lm_head": 0.5, "layers_0": 0.9, "layers_1": 1.0,
              "final_layernorm": 1.0}
    for k, f in factor.items():
        jax.tree.map(lambda a, b, f=f: np.testing.assert_allclose(np.asarray(a), f * np.asarray(b), rtol=1e-5),
                     u[k], ref[k])
    text = applied_text(actions)
    assert text.startswith("applied: embedding LR x0.5; lm_head LR x0.5; layer-wise LR decay 0.9")
    assert "QK-clip at tau=12.5" in text and "z-loss on" in text
    # Applied again (a relapse): the group LR halves again, the decay and the flags stay.
    new2, flags2, actions2 = apply_remedies(new, alerts[:1] + alerts[3:4], parse_remedies("default"), flags)
    assert get_lr_scale(new2, "embedding") == pytest.approx(0.5 * 0.81 * 0.5)
    assert [a["applied"] for a in actions2] == [True, False] and "already set" in actions2[1]["text"]


def test_group_remedy_without_groups_falls_back_to_the_global_factor_and_says_so():
    state = {"opt_state": TX_PLAIN.init(PARAMS)}
    new, flags, actions = apply_remedies(state, [alert("grad/share/embedding", group="embedding")],
                                         parse_remedies("default"), {}, lr_factor=0.9)
    assert new is state and "lr_groups" not in flags
    (a,) = actions
    assert a["applied"] is False and "global LR x0.9 only" in a["text"] and "groups='roles'" in a["text"]
    # Layer decay without layer groups: a flag for the next restart.
    _, flags, (a,) = apply_remedies(state, [alert("grad/share/layer_0")], parse_remedies("default"), {})
    assert flags["layer_decay"] == 0.9 and "layerwise_lr_decay(0.9)" in a["text"]


def test_user_dict_rule_ids_regexes_and_callables():
    def halve_everything(state, cause, flags):
        flags["seen"] = cause.metric
        return state, f"custom for {cause.metric}"

    table = parse_remedies({"loss_spike": halve_everything, r"grad/share/lm_head$": "group_lr",
                            "grad_norm": "lr_factor"})
    state = {"opt_state": TX.init(PARAMS)}
    new, flags, actions = apply_remedies(
        state, [alert("loss", "loss_spike", id_=1), alert("grad/share/lm_head", id_=2),
                alert("grad/global_norm", "grad_norm", id_=3), alert("grad/share/embedding", id_=4)],
        table, {}, lr_factor=0.8)
    assert [a["text"] for a in actions] == ["custom for loss", "lm_head LR x0.5", "global LR x0.8"]
    assert flags["seen"] == "loss" and get_lr_scale(new, "embedding") == 1.0
    assert get_lr_scale(new, "lm_head") == 0.5
    assert parse_remedies(None) == () and len(parse_remedies("default")) == len(DEFAULT_REMEDIES)


def test_bad_remedies_are_value_errors_naming_the_value_and_the_allowed(tmp_path):
    with pytest.raises(ValueError, match=r"'halve_lr'.*does not exist.*group_lr.*layer_decay.*qk_clip.*z_loss"):
        Rollback(tmp_path / "a", recovery=Recovery(remedies={"grad/share/embedding": "halve_lr"}))
    with pytest.raises(ValueError, match=r"remedies='defaults'.*'default'"):
        Rollback(tmp_path / "b", recovery=Recovery(remedies="defaults"))
    with pytest.raises(ValueError, match=r"key '\(' is not a regular expression"):
        parse_remedies({"(": "z_loss"})
    with pytest.raises(ValueError, match=r"name among .*or a callable, got 3"):
        parse_remedies({"loss": 3})
    with pytest.raises(ValueError, match=r"expects None, 'default' or a dict, got list"):
        parse_remedies(["z_loss"])
    assert set(REMEDY_NAMES) == {"group_lr", "layer_decay", "qk_clip", "z_loss", "lr_factor"}


# ----------------------------------------------------------------------------
# The guard: real orbax checkpoints.
# ----------------------------------------------------------------------------


def make_state(value: float) -> dict:
    params = jax.tree.map(lambda p: jnp.full_like(p, value), PARAMS)
    return {"params": params, "opt_state": TX.init(params), "step": jnp.asarray(int(value), jnp.int32)}


def test_guard_applies_records_checkpoints_and_resumes_the_remedies(tmp_path):
    emb = alert("update/param_ratio/embedding", group="embedding", id_=1, onset=33)
    attn = alert("act/attn_logits_abs.max", "ratio", id_=2, baseline=20.0, value=90.0, onset=33)
    guard = Rollback(tmp_path, save_every=10, retention=Retention(keep_last=5, keep_every=None), recovery=Recovery(remedies="default"))
    for s in (0, 10, 20, 30):
        guard.act(s, make_state(s), green(s), s + 1)
    r = guard.act(40, make_state(40), red_verdict(40, emb, attn, onset=35), 41)
    assert r.action is Action.ROLLBACK and r.target_step == 20
    # The restored state: params of step 20, global LR x0.9, embedding LR x0.5.
    assert float(r.state["params"]["lm_head"]["kernel"][0, 0]) == 20.0
    assert get_lr_scale(r.state) == pytest.approx(0.9)
    assert get_lr_scale(r.state, "embedding") == pytest.approx(0.5)
    assert get_lr_scale(r.state, "lm_head") == pytest.approx(1.0)
    assert guard.remedies == {"lr_groups": {"embedding": 0.5}, "qk_clip_tau": 20.0}
    # History, event, message, report.
    acts = guard.history[-1]["recovery"]
    assert [a["kind"] for a in acts] == ["restore", "lr_scale", "remedy", "remedy"]
    assert acts[2]["text"] == "embedding LR x0.5" and acts[2]["metric"] == "update/param_ratio/embedding"
    (ev,) = [e for e in r.events if e["event"] == "rollback"]
    assert ev["remedies"] == ["embedding LR x0.5",
                              "QK-clip at tau=20 (the pre-fault max of act/attn_logits_abs.max; "
                              "in flight: the step reads vitals.remedy(opt_state, 'qk_clip_tau'))"]
    assert get_remedy(r.state, "qk_clip_tau") == 20.0       # set in the optimizer state, in flight
    assert remedy_texts(ev) == ev["remedies"] and remedy_texts({"recovery": acts}) == ev["remedies"]
    older = {"actions": [{("action" if k == "kind" else k): v for k, v in a.items()} for a in acts]}
    assert remedy_texts(older) == ev["remedies"]               # an older jvitals's log: actions/action
    (msg,) = [a.message for a in r.alerts if a.rule == "rollback"]
    assert "applied: embedding LR x0.5; QK-clip at tau=20" in msg
    pytest.importorskip("matplotlib")
    from jvitals.report import Run
    from jvitals.report.page import build_html
    run = Run(str(tmp_path), [], {"loss": (np.arange(41), np.ones(41))}, {}, {}, [], [ev], {}, [])
    page = build_html(run)
    assert "<th>remedies applied</th>" in page and "<td>embedding LR x0.5; QK-clip at tau=20" in page
    # A relapse restores an older checkpoint (embedding scale 1.0 on disk): the guard's
    # remedy stays in force and halves again.
    r2 = guard.act(50, make_state(50), red_verdict(50, emb, onset=45), 51)
    assert r2.action is Action.ROLLBACK and r2.target_step < 40
    assert get_lr_scale(r2.state, "embedding") == pytest.approx(0.25)
    assert get_lr_scale(r2.state) == pytest.approx(0.81)
    assert guard.remedies["lr_groups"] == {"embedding": 0.25}
    for s in (60, 70):
        guard.act(s, r2.state, green(s), s + 1)          # the loop continues from the restored state
    guard.close()
    # What is on disk: the flags in the newest checkpoint's metadata; resume restores them.
    _, meta = guard.restore(70, make_state(0))
    assert meta["remedies"] == {"lr_groups": {"embedding": 0.25}, "qk_clip_tau": 20.0}
    fresh = Rollback(tmp_path, save_every=10, retention=Retention(keep_last=5, keep_every=None), recovery=Recovery(remedies="default"))
    state, position = fresh.resume(make_state(0), 0)
    assert fresh.resumed_step == 70 and position == 71
    assert fresh.remedies == {"lr_groups": {"embedding": 0.25}, "qk_clip_tau": 20.0}
    assert get_lr_scale(state, "embedding") == pytest.approx(0.25)
    assert [a["text"] for h in fresh.history for a in h["recovery"] if a["kind"] == "remedy"] == [
        "embedding LR x0.5", ev["remedies"][1], "embedding LR x0.5"]
    fresh.close()


def test_without_remedies_the_guard_does_what_it_did(tmp_path):
    emb = alert("update/param_ratio/embedding", group="embedding", id_=1, onset=33)
    guard = Rollback(tmp_path, save_every=10, retention=Retention(keep_every=None))
    for s in (0, 10, 20, 30):
        guard.act(s, make_state(s), green(s), s + 1)
    r = guard.act(40, make_state(40), red_verdict(40, emb, onset=35), 41)
    assert [a["kind"] for a in guard.history[-1]["recovery"]] == ["restore", "lr_scale"]
    assert get_lr_scale(r.state, "embedding") == 1.0 and guard.remedies == {}
    (ev,) = [e for e in r.events if e["event"] == "rollback"]
    assert ev["remedies"] == [] and "applied:" not in [a for a in r.alerts if a.rule == "rollback"][0].message
    guard.close()


# ----------------------------------------------------------------------------
# End to end: the embedding-LR fault on the reference model.
# ----------------------------------------------------------------------------


def _bench():
    path = ROOT / "benchmarks" / "remedies.py"
    spec = importlib.util.spec_from_file_location("jvitals_bench_remedies", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_end_to_end_embedding_lr_fault_group_remedy_recovers_where_global_cut_leaves_the_cause(tmp_path):
    """x100 on the embedding's updates from step 150 (in the loop, so no restore undoes it):
    the group alert names the embedding, the guard rolls back with the embedding LR halved
    and the run stays healthy; the global LR x0.9 alone leaves the embedding's LR as it was
    (benchmarks/remedies.py, seed 1; docs/REMEDIES.md's table)."""
    b = _bench()
    kw = dict(mult=100.0, steps=330, fault_step=150, seed=1)
    cure = b.run_arm(tmp_path / "remedy", remedies="default", **kw)
    plain = b.run_arm(tmp_path / "global", remedies=None, **kw)
    for r in (cure, plain):
        r["guard"].close()
        assert r["group_alert_step"] is not None and 150 <= r["group_alert_step"] < r["first_red"]
        assert r["limit"] is None
    # The remedy: one rollback, the embedding's LR halved (its alert named in the action) ...
    assert len(cure["rollbacks"]) == 1 and cure["relapses"] == 0
    (rem,) = [a for a in cure["rollbacks"][0]["recovery"] if a["kind"] == "remedy"]
    assert rem["remedy"] == "group_lr" and rem["group"] == "embedding" and rem["text"] == "embedding LR x0.5"
    (msg,) = [a.message for a in cure["responses"][0].alerts if a.rule == "rollback"]
    assert "applied: embedding LR x0.5" in msg
    assert cure["emb_scale"] == pytest.approx(0.5) and cure["global_scale"] == pytest.approx(0.9)
    # ... and the run recovers: the loss of the last 20 steps below the pre-fault loss.
    assert cure["recovered"] and cure["loss_end"] < cure["loss_pre"]
    red = cure["rollbacks"][0]["step"]
    assert all(math.isfinite(cure["losses"][s]) for s in range(red, kw["steps"]))
    # The global LR x0.9 alone: the same first red; the embedding's LR left as it was, so its
    # group alert is still open at the end (or the run relapsed).
    assert plain["first_red"] == cure["first_red"]
    assert plain["emb_scale"] == 1.0 and plain["global_scale"] == pytest.approx(0.9 ** len(plain["rollbacks"]))
    assert plain["relapses"] >= 1 or any("group:" in a and "embedding" in a for a in plain["open_at_end"])
