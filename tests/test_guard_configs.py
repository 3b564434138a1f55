"""The guard's settings: one frozen config per idea, validated per field; a keyword of 0.1 is a
TypeError naming its config."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import pytest

from jvitals.guard import Recovery, RestorePolicy, Retention, Rollback, Saving, Snapshots
from jvitals.guard.configs import MOVED
from jvitals.monitor.types import Level


@pytest.mark.parametrize("config, field, value", [
    (Retention, "keep_last", 0), (Retention, "keep_every", 0), (Retention, "keep_green", -1),
    (Retention, "keep_quarantined", -1), (RestorePolicy, "onset_margin", -1),
    (RestorePolicy, "rewind_steps", -2), (RestorePolicy, "healthy_levels", 3),
    (Recovery, "lr_factor", 0.0), (Recovery, "lr_factor", 1.5), (Recovery, "max_rollbacks", -1),
    (Recovery, "skip_data", -3), (Recovery, "skip_data", "yes"), (Saving, "on_save_error", "ignore"),
    (Saving, "snapshots", Snapshots(every=0)),
])
def test_each_config_names_its_bad_field(config, field, value):
    with pytest.raises(ValueError, match=rf"{config.__name__} expects {field}\b"):
        config(**{field: value})


def test_configs_are_frozen_with_the_documented_defaults():
    assert Retention() == Retention(keep_last=5, keep_every=5000, keep_green=1, keep_quarantined=3)
    assert RestorePolicy().healthy_levels == frozenset({int(Level.GREEN), int(Level.YELLOW)})
    assert RestorePolicy(healthy_levels=[Level.GREEN]).healthy_levels == frozenset({0})
    assert Recovery().lr_factor == 0.9 and Recovery().max_rollbacks == 3 and Saving().snapshots is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Retention().keep_last = 3   # type: ignore[misc]
    with pytest.raises(ValueError, match="reset_optimizer"):
        Recovery(reset_optimizer=("adam",))


def test_the_signature_names_every_keyword():
    params = inspect.signature(Rollback.__init__).parameters
    assert list(params) == ["self", "directory", "save_every", "monitor", "writer", "retention", "restore",
                            "recovery", "saving"]
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_configs_reach_the_guard_and_its_store(tmp_path):
    guard = Rollback(tmp_path, retention=Retention(keep_last=2, keep_every=None),
                     restore=RestorePolicy(onset_margin=3, rewind_steps=10),
                     recovery=Recovery(lr_factor=0.5, max_rollbacks=1, skip_data=4),
                     save_every=7, saving=Saving(pause="raise", preemption=False, sync=True,
                                                 snapshots=Snapshots(every=3, keep=1)))
    try:
        assert guard.save_every == 7 and guard.pause == "raise"
        assert guard.store.keep_last == 2 and guard.store.keep_every is None
        assert guard.restore_policy.onset_margin == 3 and guard.recovery.lr_factor == 0.5
        assert guard.saving.sync and guard.snapshot_store is not None and guard.preemption is None
        assert guard.snapshot_store.keep_last == 1
    finally:
        guard.close()


@pytest.mark.parametrize("old, where", sorted(MOVED.items()))
def test_every_old_keyword_is_a_type_error_naming_its_new_place(tmp_path, old, where):
    with pytest.raises(TypeError, match=rf"no longer takes {old}=: pass {re.escape(where)}"):
        Rollback(tmp_path, **{old: 1})
    assert not os.path.exists(tmp_path / "checkpoints")


def test_a_config_of_the_wrong_type_or_an_unknown_keyword_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lats'"):
        Rollback(tmp_path, keep_lats=3)
    with pytest.raises(TypeError, match="retention= a Retention"):
        Rollback(tmp_path, retention={"keep_last": 3})
    with pytest.raises(ValueError, match="Rollback expects save_every >= 1"):
        Rollback(tmp_path, save_every=0)
    with pytest.raises(TypeError, match="Saving expects preemption= True, False or a Preemption"):
        Saving(preemption="yes")
    with pytest.raises(ValueError, match="Saving expects pause 'return', 'raise' or a callable"):
        Rollback(tmp_path, saving=Saving(pause="stop"))
