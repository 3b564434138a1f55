"""The guard's settings: one frozen config per idea, validated per field; the old keywords map onto them."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from jvitals.guard import RollbackActions, RestorePolicy, Retention, Rollback, Saving, Snapshots
from jvitals.guard.configs import LEGACY
from jvitals.monitor.types import Level


@pytest.mark.parametrize("config, field, value", [
    (Retention, "keep_last", 0), (Retention, "keep_every", 0), (Retention, "keep_green", -1),
    (Retention, "keep_quarantined", -1), (RestorePolicy, "onset_margin", -1),
    (RestorePolicy, "rewind_steps", -2), (RestorePolicy, "healthy_levels", 3),
    (RollbackActions, "lr_factor", 0.0), (RollbackActions, "lr_factor", 1.5), (RollbackActions, "max_rollbacks", -1),
    (RollbackActions, "skip_data", -3), (RollbackActions, "skip_data", "yes"), (Saving, "on_save_error", "ignore"),
    (Saving, "snapshots", Snapshots(every=0)),
])
def test_each_config_names_its_bad_field(config, field, value):
    with pytest.raises(ValueError, match=rf"{config.__name__} expects {field}\b"):
        config(**{field: value})


def test_configs_are_frozen_with_the_documented_defaults():
    assert Retention() == Retention(keep_last=5, keep_every=5000, keep_green=1, keep_quarantined=3)
    assert RestorePolicy().healthy_levels == frozenset({int(Level.GREEN), int(Level.YELLOW)})
    assert RestorePolicy(healthy_levels=[Level.GREEN]).healthy_levels == frozenset({0})
    assert RollbackActions().lr_factor == 0.9 and RollbackActions().max_rollbacks == 3 and Saving().snapshots is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Retention().keep_last = 3   # type: ignore[misc]
    with pytest.raises(ValueError, match="reset_optimizer"):
        RollbackActions(reset_optimizer=("adam",))


def test_the_signature_is_the_new_one():
    params = inspect.signature(Rollback.__init__).parameters
    assert list(params) == ["self", "directory", "save_every", "monitor", "writer", "retention",
                            "restore", "actions", "options"]


def test_configs_reach_the_guard_and_its_store(tmp_path):
    guard = Rollback(tmp_path, save_every=7, retention=Retention(keep_last=2, keep_every=None),
                     restore=RestorePolicy(onset_margin=3, rewind_steps=10),
                     actions=RollbackActions(lr_factor=0.5, max_rollbacks=1, skip_data=4),
                     saving=Saving(sync=True, snapshots=Snapshots(every=3, keep=1)),
                     pause="raise", preemption=False)
    try:
        assert guard.save_every == 7 and guard.store.keep_last == 2 and guard.store.keep_every is None
        assert guard.restore_policy.onset_margin == 3 and guard.actions.lr_factor == 0.5
        assert guard.saving.sync and guard.snapshot_store is not None and guard.preemption is None
        assert guard.snapshot_store.keep_last == 1
    finally:
        guard.close()


@pytest.mark.parametrize("old, where", sorted(LEGACY.items()))
def test_every_old_keyword_still_works_and_names_its_new_place(tmp_path, old, where):
    config, field = where
    value = {"keep_last": 2, "keep_every": None, "keep_green": 0, "keep_quarantined": 1,
             "healthy_levels": (Level.GREEN,), "check_finite": False, "onset_margin": 2,
             "rewind_steps": 5, "lr_factor": 0.5, "max_rollbacks": 1, "skip_data": True,
             "reset_optimizer": ("nu",), "remedies": "default", "save_on_rollback": False,
             "step_attr": None, "sync_save": True, "on_save_error": "raise",
             "snapshots": Snapshots(every=5, keep=1)}[old]
    with pytest.warns(DeprecationWarning, match=rf"Rollback\({old}=\.\.\.\) is deprecated: pass {config}="):
        guard = Rollback(tmp_path, preemption=False, **{old: value})
    try:
        attr = {"restore": "restore_policy"}.get(config, config)
        got = getattr(getattr(guard, attr), field)
        assert got == (frozenset({0}) if old == "healthy_levels" else value)
    finally:
        guard.close()


def test_an_old_keyword_beside_its_config_or_an_unknown_one_is_a_type_error(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="keep_last= and retention="):
        Rollback(tmp_path, keep_last=3, retention=Retention(keep_every=None))
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lats'"):
        Rollback(tmp_path, keep_lats=3)
    with pytest.raises(TypeError, match="retention= a Retention"):
        Rollback(tmp_path, retention={"keep_last": 3})
    with pytest.raises(ValueError, match="save_every >= 1"):
        Rollback(tmp_path, save_every=0)
    with pytest.raises(ValueError, match="pause='return'"):
        Rollback(tmp_path, pause="stop")
