"""Policy as a composition of per-rule configs: the same defaults, the old flat names
(deprecated), the flat dict checkpoints hold, and errors that name their field."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from jvitals.monitor import config as C
from jvitals.monitor.policy import _FLAT, Policy
from jvitals.monitor.rules import check_order, default_rules


def test_every_old_flat_field_has_a_place_with_its_old_default():
    p = Policy()
    d = p.state_dict()
    assert list(d) == list(_FLAT)
    for old, (sub, new) in _FLAT.items():
        assert isinstance(getattr(p, sub), tuple(C.__dict__[n] for n in C.__all__ if n.endswith("Config")))
        with pytest.warns(DeprecationWarning, match=rf"{sub}\.{new}"):
            assert getattr(p, old) == getattr(getattr(p, sub), new)


def test_old_keywords_warn_naming_the_new_place_and_still_work():
    with pytest.warns(DeprecationWarning, match=r"spike_z -> Policy\(spike=SpikeConfig\(z=\.\.\.\)\)"):
        p = Policy(spike_z=5.0, red_after=4, baseline="fixed")
    assert p == Policy(spike=C.SpikeConfig(z=5.0), health=C.HealthConfig(red_after=4),
                       baselines=C.BaselineConfig(kind="fixed"))
    # An old keyword on top of a given config changes that config's field only.
    with pytest.warns(DeprecationWarning):
        q = Policy(spike=C.SpikeConfig(min_ratio=1.2), spike_z=5.0)
    assert (q.spike.z, q.spike.min_ratio) == (5.0, 1.2)
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(p, spike_z=4.0).spike.z == 4.0
    with pytest.raises(TypeError, match="unexpected keyword"):
        Policy(spike_zz=1.0)
    with pytest.warns(DeprecationWarning, match=r"policy\.baselines\.settle_span"):
        assert Policy().settle_span == Policy().baselines.settle_span == 250
    with pytest.raises(AttributeError):
        Policy().spike_zz


def test_the_flat_dict_round_trips_and_old_checkpoints_load():
    p = Policy(ratio=C.RatioConfig(thresholds={"update/param_ratio": (2, 4)}), replica=C.ReplicaConfig(z=5.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        d = json.loads(json.dumps(p.state_dict()))
        assert d["ratio_rules"] == {"update/param_ratio": [2.0, 4.0]} and d["replica_z"] == 5.0
        assert Policy.from_state_dict(d) == p
        # a checkpoint written before some field existed holds a subset
        assert Policy.from_state_dict({"spike_z": 5.0}) == Policy(spike=C.SpikeConfig(z=5.0))
    with pytest.raises(ValueError, match="unknown fields"):
        Policy.from_state_dict({"warmup": 3})
    with pytest.warns(DeprecationWarning, match="state_dict"):
        assert Policy.from_dict(p.to_dict()) == p


def test_a_negative_val_gap_halflife_names_its_field():
    with pytest.raises(ValueError, match=r"ValidationConfig.gap_halflife \(Policy.val_gap_halflife\)"):
        C.ValidationConfig(gap_halflife=-1.0)
    with pytest.raises(ValueError, match="val_gap_halflife"), pytest.warns(DeprecationWarning):
        Policy(val_gap_halflife=-1.0)
    with pytest.raises(ValueError, match=r"SpikeConfig.trend_halflife \(Policy.trend_halflife\)"):
        C.SpikeConfig(trend_halflife=0.0)


def test_a_bad_regex_names_the_field_and_the_pattern():
    with pytest.raises(ValueError, match=r"LocalizeConfig.pattern \(Policy.localize_pattern\).*'layer_\(\\\\d'"):
        C.LocalizeConfig(pattern=r"layer_(\d")
    with pytest.raises(ValueError, match="localize_pattern"), pytest.warns(DeprecationWarning):
        Policy(localize_pattern="[")


def test_configs_are_checked_on_their_own():
    with pytest.raises(ValueError, match="yellow < orange"):
        C.RatioConfig(thresholds={"grad/global_norm": (3.0, 2.0)})
    with pytest.raises(TypeError, match="sequence of metric names"):
        C.SpikeConfig(metrics="loss")
    with pytest.raises(ValueError, match=r"BaselineConfig.kind \(Policy.baseline\)"):
        C.BaselineConfig(kind="median")
    with pytest.raises(TypeError, match="Policy.spike expects a SpikeConfig"):
        Policy(spike=C.RatioConfig())


def test_default_rules_assert_the_order_their_notes_need():
    rules = default_rules(Policy())
    names = [r.name for r in rules]
    assert names.index("data") < names.index("spike") < names.index("val_gap")
    i, j = names.index("ratio"), names.index("trend")
    swapped = rules[:]
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match=r"'trend' reads Figures.notes.schedule, written by 'ratio'"):
        check_order(swapped)
