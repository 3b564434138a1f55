"""The natural-instability corpus (``benchmarks/natural.py``, ``tests/data/natural``): runs whose
instability comes from their settings, each beside a control that differs in one setting.

Replayed as the README loop's host sees them, at a check every 10 steps (heavy family every 50)
and at the README's cadence (every 50, heavy every 500), through a fresh ``Monitor()``:

- every sick run whose instability reproduces: its first alert names the cause (its rule among
  ``CAUSE_RULES[kind]``) and comes before the loss separates from the control's, the step
  computed here from the two streams' losses (a run sick from its first update, whose loss
  separates at step 0: within its first 100 steps);
- every control, and both arms of a pair where the instability does not reproduce at this size
  (``REPRODUCED``): no ORANGE or RED, at most one YELLOW;
- the corpus' own measurements (``check/``, never shown to the monitor) confirm each sick run
  against its control, computed here with NumPy.

Pure NumPy and the monitor: no JAX, no training.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import natural as N  # noqa: E402

CADENCES = ((10, 50), (50, 500))
REPRODUCED = {"attn_logits", "no_warmup", "data_shard", "adam_eps"}
"""Kinds whose instability reproduces at this size (docs/DIAGNOSIS.md says why the others do not)."""

STREAMS = {split: N.load(split) for split in N.SPLITS}
PAIRS = [p for p in N.PAIRS if p.name("sick") in STREAMS[p.split] and p.name("control") in STREAMS[p.split]]


def test_every_pair_of_the_corpus_is_on_disk():
    missing = [p.name("*") for p in N.PAIRS if p not in PAIRS]
    assert not missing, f"regenerate with python benchmarks/natural.py generate: {missing}"


def _smoothed(x: np.ndarray, width: int = 51) -> np.ndarray:
    ok = np.isfinite(x)
    k = np.ones(width)
    return np.convolve(np.where(ok, x, 0.0), k, "same") / np.maximum(np.convolve(ok.astype(float), k, "same"), 1)


def _separation(pair: N.Pair) -> int | None:
    """NumPy, here: the first step from which the sick run's 51-step mean loss stays 2% above the
    control's for 200 steps."""
    s = STREAMS[pair.split]
    a, b = _smoothed(s[pair.name("sick")].dense("loss")), _smoothed(s[pair.name("control")].dense("loss"))
    above = a > 1.02 * b
    for i in range(len(a) - 200):
        if above[i: i + 200].all():
            return i
    return None


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.kind in REPRODUCED], ids=lambda p: p.name("*"))
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_the_sick_runs_first_alert_names_the_cause_before_the_loss_separates(pair, cadence, heavy):
    st = STREAMS[pair.split][pair.name("sick")]
    alerts = N.replay_alerts(st, cadence, heavy)
    assert alerts, f"{pair.name('sick')}: no alert at checks every {cadence}"
    first = alerts[0]
    assert first["rule"] in N.CAUSE_RULES[pair.kind], first
    sep = _separation(pair)
    assert sep == N.separation_step(st, STREAMS[pair.split][pair.name("control")])
    if sep == 0:
        # Sick from its first update (Adam's epsilon): nothing can come before; the cause is
        # named within the warm-up's first 100 steps.
        assert first["step"] <= 100, (first, sep)
    else:
        assert sep is None or first["step"] < sep, (first, sep)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.name("*"))
@pytest.mark.parametrize("cadence,heavy", CADENCES)
def test_controls_stay_quiet(pair, cadence, heavy):
    arms = ("control",) if pair.kind in REPRODUCED else ("control", "sick")
    for arm in arms:
        alerts = N.replay_alerts(STREAMS[pair.split][pair.name(arm)], cadence, heavy)
        assert not [a for a in alerts if a["level"] in ("ORANGE", "RED")], (arm, alerts)
        assert sum(a["level"] == "YELLOW" for a in alerts) <= 1, (arm, alerts)


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.kind == "attn_logits"], ids=lambda p: p.name("*"))
def test_attention_logit_growth_is_real_by_the_corpus_own_measurements(pair):
    """Independent of the monitor: the sick run's attention entropy (its least layer's) over the
    second half is under a fifth of the control's (0.01-0.15 nats against 0.35-0.95), and its
    loss ends higher."""
    s = STREAMS[pair.split]
    sick, ctrl = s[pair.name("sick")], s[pair.name("control")]
    half = sick.steps // 2

    def late(st, name):
        idx, v = st.series[name]
        return float(np.mean(v[idx >= half]))

    assert late(sick, "check/attn_entropy.min") < 0.2 * late(ctrl, "check/attn_entropy.min")
    assert np.mean(sick.dense("loss")[-200:]) > np.mean(ctrl.dense("loss")[-200:])


@pytest.mark.parametrize("pair", [p for p in PAIRS if p.kind == "adam_eps"], ids=lambda p: p.name("*"))
def test_a_large_epsilon_shrinks_the_update_by_the_corpus_own_measurements(pair):
    s = STREAMS[pair.split]
    u = {arm: s[pair.name(arm)].series["check/update_rms_per_lr"][1] for arm in ("sick", "control")}
    assert np.median(u["sick"][5:]) < 0.5 * np.median(u["control"][5:])
