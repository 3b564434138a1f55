"""The flat dict a checkpoint holds for the policy: each key and its config field.

``Policy.state_dict`` writes one key per config field (``spike_z`` for ``policy.spike.z``)
and ``Policy.from_state_dict`` reads it back. One table, read by ``policy.py`` (that dict
and the error for a flat key given as a ``Policy`` keyword) and by ``config.py`` (each
error names the key beside the field: ``ValidationConfig.gap_halflife (Policy.state_dict
key 'val_gap_halflife')``). Plain data, no imports.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["FLAT", "FLAT_KEY"]

# The flat key -> (config, field), in the order of the flat dict ``Policy.state_dict`` writes.
FLAT: Mapping[str, tuple[str, str]] = {
    "warmup_steps": ("baselines", "warmup_steps"), "lr_metric": ("baselines", "lr_metric"),
    "lr_plateau_tol": ("baselines", "lr_plateau_tol"), "settle_metric": ("baselines", "settle_metric"),
    "settle_window": ("baselines", "settle_window"), "settle_min_samples": ("baselines", "settle_min_samples"),
    "settle_tolerance": ("baselines", "settle_tolerance"),
    "settle_max_steps": ("baselines", "settle_max_steps"), "baseline_steps": ("baselines", "steps"),
    "baseline_min_samples": ("baselines", "min_samples"), "baseline": ("baselines", "kind"),
    "drift_halflife": ("baselines", "drift_halflife"), "ratio_rules": ("ratio", "thresholds"),
    "schedule_metrics": ("ratio", "schedule_metrics"), "jump_metrics": ("ratio", "jump_metrics"),
    "lr_exponent": ("ratio", "lr_exponent"), "weight_decay": ("ratio", "weight_decay"),
    "ratio_noise_z": ("ratio", "noise_z"), "confirm_checks": ("ratio", "confirm_checks"),
    "confirm_steps": ("ratio", "confirm_steps"), "hysteresis": ("alerts", "hysteresis"),
    "clear_steps": ("alerts", "clear_steps"), "episode_gap": ("alerts", "episode_gap"),
    "rolling_window": ("baselines", "rolling_window"), "rolling_k": ("baselines", "rolling_k"),
    "ema_alpha": ("baselines", "ema_alpha"), "ema_z": ("baselines", "ema_z"),
    "adaptive_min_samples": ("baselines", "adaptive_min_samples"),
    "nonfinite_metrics": ("system", "nonfinite_metrics"),
    "nonfinite_count_metrics": ("system", "nonfinite_count_metrics"),
    "throughput_metrics": ("system", "throughput_metrics"), "throughput_drop": ("system", "throughput_drop"),
    "throughput_z": ("system", "throughput_z"),
    "throughput_noise_halflife": ("system", "throughput_noise_halflife"),
    "throughput_hold_steps": ("system", "throughput_hold_steps"), "early_jumps": ("between", "early_jumps"),
    "early_min_samples": ("between", "early_min_samples"), "early_min_span": ("between", "early_min_span"),
    "skip_orange_checks": ("between", "skip_orange_checks"),
    "window_min_steps": ("between", "window_min_steps"), "data_window": ("between", "data_window"),
    "data_rise": ("between", "data_rise"), "data_z": ("between", "data_z"),
    "data_band": ("between", "data_band"), "data_confirm": ("between", "data_confirm"),
    "repeat_window": ("between", "repeat_window"), "repeat_collapse": ("between", "repeat_collapse"),
    "loss_scale_metric": ("system", "loss_scale_metric"), "loss_scale_drop": ("system", "loss_scale_drop"),
    "event_hold_steps": ("system", "event_hold_steps"), "val_gap_window": ("validation", "gap_window"),
    "val_gap_ratio": ("validation", "gap_ratio"), "val_gap_min_growth": ("validation", "gap_min_growth"),
    "val_gap_halflife": ("validation", "gap_halflife"), "spike_metrics": ("spike", "metrics"),
    "spike_alert_metrics": ("spike", "alert_metrics"), "spike_z": ("spike", "z"),
    "spike_min_ratio": ("spike", "min_ratio"), "spike_recover_z": ("spike", "recover_z"),
    "spike_recover_ratio": ("spike", "recover_ratio"), "trend_halflife": ("spike", "trend_halflife"),
    "scale_halflife": ("spike", "scale_halflife"), "spike_min_samples": ("spike", "min_samples"),
    "physiological_steps": ("spike", "physiological_steps"),
    "pathological_steps": ("spike", "pathological_steps"), "post_window": ("spike", "post_window"),
    "spike_forget_steps": ("spike", "forget_steps"), "periodic_metrics": ("spike", "periodic_metrics"),
    "periodic_min_spikes": ("spike", "periodic_min_spikes"),
    "periodic_tolerance": ("spike", "periodic_tolerance"),
    "periodic_min_interval": ("spike", "periodic_min_interval"),
    "periodic_escalate_min_spikes": ("spike", "periodic_escalate_min_spikes"),
    "periodic_shrink": ("spike", "periodic_shrink"), "trend_metrics": ("ratio", "trend_metrics"),
    "trend_window": ("ratio", "trend_window"), "trend_buckets": ("ratio", "trend_buckets"),
    "trend_drift_k": ("ratio", "trend_drift_k"), "group_bands": ("bands", "group_bands"),
    "group_z": ("bands", "group_z"), "group_jump": ("bands", "group_jump"),
    "group_window": ("bands", "group_window"), "group_drift_k": ("bands", "group_drift_k"),
    "drift_memory": ("bands", "drift_memory"), "group_confirm": ("bands", "group_confirm"),
    "group_min_share": ("bands", "group_min_share"), "group_global_ratio": ("bands", "group_global_ratio"),
    "group_growth": ("bands", "group_growth"),
    "logit_bands": ("bands", "logit_bands"), "router_bands": ("bands", "router_bands"),
    "router_z": ("bands", "router_z"), "router_steps": ("bands", "router_steps"),
    "vocab_size": ("health", "vocab_size"), "vocab_metric": ("health", "vocab_metric"),
    "broken_chance_frac": ("health", "broken_chance_frac"),
    "broken_param_jump": ("health", "broken_param_jump"),
    "broken_jump_window": ("health", "broken_jump_window"),
    "broken_param_loss": ("health", "broken_param_loss"), "broken_steps": ("health", "broken_steps"),
    "broken_loss_steps": ("health", "broken_loss_steps"), "gap_z": ("validation", "gap_z"),
    "gap_confirm": ("validation", "gap_confirm"), "val_rise_window": ("validation", "rise_window"),
    "val_rise_min_samples": ("validation", "rise_min_samples"), "val_rise_z": ("validation", "rise_z"),
    "val_rise_min": ("validation", "rise_min"), "val_rise_sparse_run": ("validation", "rise_sparse_run"),
    "divergence_loss_ratio": ("health", "divergence_loss_ratio"),
    "red_after": ("health", "red_after"), "red_min_steps": ("health", "red_min_steps"),
    "score_window": ("spike", "score_window"), "localize_pattern": ("localize", "pattern"),
    "localize_window": ("localize", "window"), "localize_rows": ("localize", "rows"),
    "localize_lookback": ("localize", "lookback"), "localize_reference": ("localize", "reference"),
    "localize_z": ("localize", "z"), "localize_min_ratio": ("localize", "min_ratio"),
    "localize_drift_slack": ("localize", "drift_slack"), "localize_top": ("localize", "top"),
    "localize_max_metrics": ("localize", "max_metrics"), "history_size": ("alerts", "history_size"),
    "spikes_size": ("alerts", "spikes_size"), "replica_z": ("replica", "z"),
    "replica_min_ratio": ("replica", "min_ratio"), "replica_rel_floor": ("replica", "rel_floor"),
    "replica_spread_halflife": ("replica", "spread_halflife"), "replica_confirm": ("replica", "confirm"),
    "replica_min_replicas": ("replica", "min_replicas"),
    "attn_metric": ("scale", "attn_metric"), "attn_level": ("scale", "attn_level"),
    "attn_growth": ("scale", "attn_growth"), "attn_window": ("scale", "attn_window"),
    "attn_orange": ("scale", "attn_orange"), "qk_clip_tau": ("scale", "qk_clip_tau"),
    "update_level": ("scale", "update_level"), "update_hold": ("scale", "update_hold"),
    "warmup_frac": ("scale", "warmup_frac"), "out_metric": ("scale", "out_metric"),
    "out_level": ("scale", "out_level"), "out_growth": ("scale", "out_growth"),
    "out_window": ("scale", "out_window"), "vanish_level": ("scale", "vanish_level"),
    "vanish_checks": ("scale", "vanish_checks"),
}

_CLASS_OF: Mapping[str, str] = {
    "baselines": "BaselineConfig", "ratio": "RatioConfig", "alerts": "AlertConfig", "system": "SystemConfig",
    "between": "BetweenConfig", "validation": "ValidationConfig", "spike": "SpikeConfig", "bands": "BandConfig",
    "health": "HealthConfig", "localize": "LocalizeConfig", "replica": "ReplicaConfig",
    "scale": "ScaleConfig",
}

FLAT_KEY: Mapping[str, Mapping[str, str]] = {
    cls: {new: key for key, (sub, new) in FLAT.items() if sub == name} for name, cls in _CLASS_OF.items()}
"""``{config class name: {field: its flat key}}``."""
