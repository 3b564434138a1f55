"""The public API, pinned: each ``__all__`` (the top level and the five subpackages) is the
list below, no name has two doors, the top level holds what the README and docs use, and
0.1's flat module aliases are gone. Changing the public API means changing this file."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PUBLIC = {
    'jvitals': (
        'Action', 'activation_metrics', 'adaptive_clip', 'AdaptiveClipState', 'Alert', 'AlertConfig',
        'assign_roles', 'attn_logits_probe', 'attn_softmax_probe', 'BandConfig', 'BaselineConfig', 'BetweenConfig',
        'bos_value_grad_metrics', 'Cause', 'Change', 'CheckpointMismatchError', 'CheckpointSaveError',
        'CheckpointStore',
        'DEFAULT_REMEDIES', 'default_rules', 'device_memory_metrics', 'ExpertChoices', 'explain_roles',
        'Figures', 'flat_replicas', 'get_lr_scale', 'get_lr_scales', 'get_remedy', 'global_norm',
        'global_norm_metrics',
        'gradient_metrics', 'HealthConfig', 'instrument', 'InstrumentReport', 'layer_decay_factors',
        'layerwise_lr_decay', 'LeafRole', 'Level', 'Localization', 'LocalizeConfig', 'logits_probe',
        'LogitsSummary', 'LRGroupScaleState', 'moe_metrics', 'moe_window_init', 'moe_window_update',
        'MoEWindowState', 'Monitor', 'mtp_metrics', 'optimizer_metrics', 'PackedMetrics', 'perturb_values',
        'Policy', 'Preemption', 'qk_clip', 'QKVSplit', 'RatioConfig', 'record', 'recorded', 'recorded_steps',
        'RecordState', 'Recovery', 'reduce', 'remedy', 'REMEDY_NAMES', 'replica_layout', 'replica_metrics', 'replica_window_init',
        'replica_window_metrics', 'replica_window_update', 'ReplicaConfig', 'ReplicaLayout', 'ReplicaPlace',
        'ReplicaRule', 'ReplicaWindow', 'Response', 'RestorePolicy', 'Retention', 'Roles', 'RolesExplanation',
        'Rollback', 'RollbackError', 'RollbackLimitError', 'Saving', 'ScaleConfig',
        'set_lr_scale', 'set_remedy',
        'skip_step', 'SkipStepState', 'Snapshots', 'sow_summary', 'Spike', 'SpikeConfig', 'StepTimer',
        'summarize', 'summarize_logits', 'Summary', 'SystemConfig', 'TrainingPaused', 'update_metrics',
        'ValidationConfig', 'Verdict', 'with_lr_scale', 'write', 'z_loss', 'cross_entropy',
    ),
    'jvitals.metrics': (
        'activation_metrics', 'assign_roles', 'attn_logits_probe', 'attn_softmax_probe', 'bos_value_grad_metrics', 'DEFAULT_EVERY',
        'DEFAULT_LAYER_PATTERNS', 'DEFAULT_PATTERNS', 'DEFAULT_QKV_LAYOUTS', 'DEFAULT_STACKS',
        'device_memory_metrics', 'ExpertChoices', 'explain_roles', 'global_norm', 'global_norm_metrics',
        'gradient_metrics', 'GROUP_ROLES', 'instrument', 'InstrumentReport', 'LAYOUTS', 'LeafRole',
        'logits_probe', 'LogitsSummary', 'moe_metrics', 'moe_window_init', 'moe_window_update',
        'MoEWindowState', 'mtp_metrics', 'optimizer_metrics', 'PackedMetrics', 'perturb_values', 'QKVLayout',
        'QKVSplit', 'record', 'recorded', 'recorded_steps', 'RecordState', 'reduce', 'REPLICA_FIGURES',
        'replica_layout', 'replica_metrics', 'replica_window_init', 'replica_window_metrics',
        'replica_window_update', 'ReplicaLayout', 'ReplicaPlace', 'ReplicaWindow', 'ROLE_METRIC_NAMES',
        'Roles', 'RolesExplanation', 'sow_summary', 'StepTimer', 'summarize', 'summarize_logits', 'Summary',
        'update_metrics',
    ),
    'jvitals.optim': (
        'adaptive_clip', 'AdaptiveClipState', 'get_lr_scale', 'get_lr_scales', 'get_remedy', 'has_lr_scale',
        'has_remedy', 'layer_decay_factors', 'layerwise_lr_decay', 'LR_SCALE', 'LR_SCALE_ARG',
        'LRGroupScaleState', 'qk_clip', 'remedy', 'REMEDY_SETTINGS', 'set_lr_scale', 'set_remedy', 'skip_step',
        'SkipStepState', 'with_lr_scale', 'z_loss', 'cross_entropy',
    ),
    'jvitals.monitor': (
        'Alert', 'AlertConfig', 'AttnLogitRule', 'BandConfig', 'BASELINE_KINDS', 'BaselineConfig',
        'BetweenConfig', 'BrokenModelRule', 'Change', 'Coverage', 'default_rules', 'DivergenceRule', 'Figures', 'flat_replicas', 'GapRule',
        'GroupRule', 'HealthConfig', 'JumpRule', 'Level', 'Localization', 'LocalizeConfig', 'LogitRule',
        'LossScaleRule', 'Monitor', 'NonFiniteRule', 'Notes', 'OutputLogitRule', 'Policy', 'Prescription', 'PRESCRIPTIONS',
        'RatioConfig', 'RatioRule', 'ReplicaConfig', 'ReplicaRule', 'RouterRule', 'Rule', 'RULE_PRESCRIPTION',
        'ScaleConfig', 'Spike', 'SpikeConfig', 'SpikeRule', 'SystemConfig', 'ThroughputRule', 'TrendRule',
        'UpdateSizeRule',
        'ValidationConfig', 'ValRiseRule', 'Verdict',
    ),
    'jvitals.guard': (
        'Action', 'CADENCE', 'Cause', 'CheckpointInfo', 'CheckpointMismatchError', 'CheckpointSaveError',
        'CheckpointStore',
        'choose_target', 'DEFAULT_REMEDIES', 'MANUAL', 'ORANGE_SAVE', 'Past', 'PREEMPT', 'Preemption',
        'Recovery', 'REMEDY_NAMES', 'Response', 'RestorePolicy', 'Retention', 'Rollback', 'ROLLBACK_SAVE',
        'RollbackError', 'RollbackLimitError', 'Saving', 'SNAPSHOT', 'Snapshots', 'Target',
        'TrainingPaused',
    ),
    'jvitals.report': (
        'ALERTS_MD_TAG', 'ALERTS_TAG', 'CheckItem', 'checkup', 'EVENTS_TAG', 'LEVEL_TAG', 'plot_family',
        'plot_layer_heatmap', 'plot_replica_heatmap', 'plot_timeline', 'read_run', 'REPLICAS_TAG',
        'ROLLBACK_COUNT', 'ROLLBACK_LR_SCALE', 'Run', 'write', 'write_report',
    ),
}


SUBPACKAGES = ("jvitals.metrics", "jvitals.optim", "jvitals.monitor", "jvitals.guard", "jvitals.report")
DOCS = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_names_are_pinned(name):
    """Each ``__all__`` is exactly the pinned list (a change to the public API is a change here), and
    every name in it exists."""
    mod = importlib.import_module(name)
    assert sorted(mod.__all__, key=str.lower) == sorted(PUBLIC[name], key=str.lower)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, missing


def test_one_door_per_name():
    """No name is exported by two subpackages; each top-level name is its subpackage's object."""
    owner: dict[str, str] = {}
    for sub in SUBPACKAGES:
        for n in importlib.import_module(sub).__all__:
            assert n not in owner, f"{n!r} is exported by both {owner[n]} and {sub}"
            owner[n] = sub
    import jvitals

    for n in jvitals.__all__:
        assert n in owner, f"jvitals.{n} is not exported by any subpackage"
        assert getattr(jvitals, n) is getattr(importlib.import_module(owner[n]), n), n


def test_docs_api_lists_exactly_the_top_level_names():
    """docs/API.md's tables list each top-level name once, and nothing else."""
    import jvitals

    listed = re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", (DOCS / "docs" / "API.md").read_text(), re.M)
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    assert sorted(listed) == sorted(jvitals.__all__)


def test_no_legacy_module_aliases():
    """0.1's flat module paths are gone (0.x): ``jvitals.stats`` is not ``jvitals.metrics.stats``."""
    import jvitals

    assert not hasattr(jvitals, "_FLAT_MODULES")
    for old in ("stats", "rollback", "checkpoints", "writers", "roles", "_monitor_rules"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"jvitals.{old}")
