"""The guard's parts own their state: the verdict contract at the door, and a Restorer that
returns what it decided for the Rollback to apply (no part holds the Rollback)."""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
import optax
import pytest

from jvitals.guard import Rollback, Recovery
from jvitals.guard.restore import Record, Restored, Restorer
from jvitals.guard.verdict import VERDICT_FIELDS, VerdictLike, check_verdict
from jvitals.monitor.types import Alert, Level, Verdict
from jvitals.optim.lr_scale import get_lr_scale, with_lr_scale

TX = with_lr_scale(optax.sgd(0.1))


def make_state(v: float) -> dict:
    p = {"w": jnp.full((3,), float(v))}
    return {"params": p, "opt_state": TX.init(p), "step": jnp.asarray(int(v))}


def alert(id_: int, level: Level, step: int, onset: int) -> Alert:
    return Alert(id=id_, rule="grad_norm", metric="grad/global_norm", level=level, step=step, value=9.0,
                 baseline=1.0, ratio=9.0, onset_step=onset, opened_step=onset, message=f"[{level.name}] #{id_}",
                 cause="c", prescription="p", localization=[], peak_level=level)


def test_the_monitors_verdict_satisfies_the_contract_and_other_things_are_named():
    v = Verdict(3, Level.GREEN, [], [], [], {})
    assert isinstance(v, VerdictLike) and all(hasattr(v, f) for f in VERDICT_FIELDS)
    check_verdict(v)
    check_verdict(None)

    @dataclasses.dataclass
    class Partial:                      # a home-made verdict without closed_alerts, scores, onset_step
        level: Level
        alerts: list

    with pytest.raises(TypeError, match="lacks closed_alerts, scores, onset_step"):
        check_verdict(Partial(Level.RED, []))
    with pytest.raises(TypeError, match=r"a RED would be handled as GREEN\), which lacks level, alerts"):
        check_verdict(int(Level.RED))


def test_the_door_of_act_checks_the_contract(tmp_path):
    guard = Rollback(tmp_path)
    with pytest.raises(TypeError, match="Rollback.respond/act expects the Verdict.*lacks level"):
        guard.act(0, make_state(0), {"level": 3}, 0)
    assert guard.checkpoints == []
    guard.close()


def test_the_restorer_holds_no_guard_and_returns_what_it_decided(tmp_path):
    """The Restorer is given the stores, the guard's bookkeeping and the settings, never the
    Rollback or its save; a rollback's result is a Restored the guard applies."""
    params = inspect.signature(Restorer).parameters
    assert list(params) == ["disk", "state", "outbox", "saver", "policy", "recovery"]
    for name in ("restore_target", "resume", "update_pins"):
        assert "guard" not in inspect.signature(getattr(Restorer, name)).parameters, name

    guard = Rollback(tmp_path, save_every=10, recovery=Recovery(lr_factor=0.5))
    for s in range(0, 40, 5):
        guard.act(s, make_state(s), None, s + 1)
    red = [alert(1, Level.RED, 40, 33)]
    verdict = Verdict(40, Level.RED, red, red, [], {})
    guard._state.alerts.observe(40, verdict)
    guard._state.checks.append(40)
    done = guard._restorer.restore_target(40, make_state(40), verdict, 41, (33, 30),
                                          Record(1.0, [], {}))
    assert isinstance(done, Restored) and done.target.step == 20
    assert done.lr_scale == 0.5 and get_lr_scale(done.state) == pytest.approx(0.5)
    assert done.position == 41 and done.entry["to_step"] == 20 and done.entry["onset_step"] == 33
    assert [a["kind"] for a in done.entry["recovery"]] == ["restore", "lr_scale"]
    # Nothing of the guard's record moved: applying it is the Rollback's.
    assert guard.lr_scale == 1.0 and guard.history == [] and guard.position == 36
    guard.close()
