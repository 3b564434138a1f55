"""Policy as a composition of per-rule configs: the same defaults, the flat dict checkpoints
hold, a flat key given as a keyword refused with its place, and errors that name their field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jvitals.monitor import config as C
from jvitals.monitor.flat_names import FLAT as _FLAT
from jvitals.monitor.policy import Policy
from jvitals.monitor.rules import check_order, default_rules


def test_every_flat_key_has_a_config_field_with_its_default():
    p = Policy()
    d = p.state_dict()
    assert list(d) == list(_FLAT)
    configs = tuple(C.__dict__[n] for n in C.__all__ if n.endswith("Config"))
    for key, (sub, new) in _FLAT.items():
        assert isinstance(getattr(p, sub), configs)
        assert Policy.from_state_dict({key: d[key]}) == p


def test_a_flat_key_as_a_keyword_is_refused_naming_its_place():
    with pytest.raises(TypeError, match=r"Policy got unknown keyword 'spike_z': it lives in "
                                        r"Policy\(spike=SpikeConfig\(z=\.\.\.\)\)"):
        Policy(spike_z=5.0)
    with pytest.raises(TypeError, match=r"'baseline_steps': it lives in Policy\(baselines=BaselineConfig\(steps="):
        Policy(baselines=C.BaselineConfig(warmup_steps=0), baseline_steps=20)
    with pytest.raises(TypeError, match=r"'spike_z': it lives in"):
        dataclasses.replace(Policy(), spike_z=4.0)
    with pytest.raises(TypeError, match=r"unknown keyword 'spike_zz'; its keywords are the configs \['baselines'"):
        Policy(spike_zz=1.0)
    with pytest.raises(AttributeError):
        Policy().spike_z
    with pytest.raises(AttributeError):
        Policy().settle_span
    assert Policy(spike=C.SpikeConfig(z=5.0)).spike.z == 5.0
    assert dataclasses.replace(Policy(), spike=C.SpikeConfig(z=4.0)).spike.z == 4.0


def test_the_flat_dict_round_trips_and_old_checkpoints_load():
    p = Policy(ratio=C.RatioConfig(thresholds={"update/param_ratio": (2, 4)}), replica=C.ReplicaConfig(z=5.0))
    d = json.loads(json.dumps(p.state_dict()))
    assert d["ratio_rules"] == {"update/param_ratio": [2.0, 4.0]} and d["replica_z"] == 5.0
    assert Policy.from_state_dict(d) == p
    # a checkpoint written before some field existed holds a subset
    assert Policy.from_state_dict({"spike_z": 5.0}) == Policy(spike=C.SpikeConfig(z=5.0))
    with pytest.raises(ValueError, match="unknown fields"):
        Policy.from_state_dict({"warmup": 3})
    assert not hasattr(p, "to_dict") and not hasattr(Policy, "from_dict")


def test_a_negative_val_gap_halflife_names_its_field():
    with pytest.raises(ValueError, match=r"ValidationConfig.gap_halflife \(Policy.state_dict key 'val_gap_halflife'\)"):
        C.ValidationConfig(gap_halflife=-1.0)
    with pytest.raises(ValueError, match="val_gap_halflife"):
        Policy.from_state_dict({"val_gap_halflife": -1.0})
    with pytest.raises(ValueError, match=r"SpikeConfig.trend_halflife \(Policy.state_dict key 'trend_halflife'\)"):
        C.SpikeConfig(trend_halflife=0.0)


def test_a_bad_regex_names_the_field_and_the_pattern():
    with pytest.raises(ValueError, match=r"LocalizeConfig.pattern \(Policy.state_dict key 'localize_pattern'\)"
                                         r".*'layer_\(\\\\d'"):
        C.LocalizeConfig(pattern=r"layer_(\d")
    with pytest.raises(ValueError, match="localize_pattern"):
        Policy(localize=C.LocalizeConfig(pattern="["))


def test_configs_are_checked_on_their_own():
    with pytest.raises(ValueError, match="yellow < orange"):
        C.RatioConfig(thresholds={"grad/global_norm": (3.0, 2.0)})
    with pytest.raises(TypeError, match="sequence of metric names"):
        C.SpikeConfig(metrics="loss")
    with pytest.raises(ValueError, match=r"BaselineConfig.kind \(Policy.state_dict key 'baseline'\)"):
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
