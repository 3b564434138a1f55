"""The steps of :func:`jvitals.monitor.localize.localize`, each on hand-built arrays.

The whole function is tested on streams in tests/test_monitor_rules.py (drift
ignored, the change point found); here each step that carries a decision is
called on its own, with expectations worked out from the module doc's rule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jvitals.monitor import config as C
from jvitals.monitor.localize import (
    _band,
    _candidates,
    _departures,
    _Fit,
    _fit_reference,
    _fit_space,
    _rank,
    _windows,
)
from jvitals.monitor.policy import Policy


def test_the_reference_is_the_steps_before_the_window_and_none_before_the_start():
    ts = np.arange(0, 101, 10)
    p = Policy(localize=C.LocalizeConfig(lookback=20, reference=30))
    # Onset 80: the window is [60, now], the reference [30, 60).
    wr, rr = _windows(ts, 80, p, None)
    assert ts[wr].tolist() == [60, 70, 80, 90, 100] and ts[rr].tolist() == [30, 40, 50]
    # The baselines started at 45: the warm-up before it is no reference.
    wr, rr = _windows(ts, 80, p, 45)
    assert ts[rr].tolist() == [50]
    # Nothing after the start before the window: nothing to compare with.
    assert _windows(ts, 80, p, 60) is None


def test_candidates_need_three_finite_reference_samples_and_a_window_sample():
    nan = math.nan
    R = np.array([[1.0, 1.0, -1.0, 1.0, 1.0],
                  [2.0, nan, 0.5, 1.0, 1.0],
                  [3.0, 2.0, 0.7, 1.0, 1.0]])
    W = np.array([[1.0, 1.0, 1.0, nan, 1.0],
                  [1.0, 1.0, 1.0, nan, 1.0]])
    cand, logs = _candidates(R, W, excluded=4)
    # 0: three positive samples -> log space; 1: two finite -> out; 2: a negative
    # sample -> judged as is; 3: no window sample -> out; 4: excluded.
    assert cand.tolist() == [0, 2] and logs.tolist() == [True, False]


def test_a_non_finite_window_sample_counts_as_off_a_missing_one_stays_missing():
    X = np.array([[math.e, math.inf], [math.nan, -math.inf]])
    logs = np.array([True, False])
    ref, win = _fit_space(X, logs), _fit_space(X, logs, window=True)
    assert ref[0, 0] == pytest.approx(1.0) and np.isnan(ref[0, 1]) and np.isnan(ref[1, 1])
    assert win[0, 1] == math.inf and win[1, 1] == math.inf and np.isnan(win[1, 0])


def test_an_insignificant_slope_is_a_level_a_clear_drift_is_kept():
    u = np.arange(6, dtype=float)
    # Alternating 1.0 / 1.2: the least-squares slope is 0.3 / 17.5 = 0.017 with
    # residuals of ~0.1, t = 0.017 * sqrt(17.5) / 0.15 < 3: a level at the mean 1.1,
    # sigma = 1.4826 x the median |x - 1.1| = 1.4826 x 0.1.
    alt = np.array([1.0, 1.2, 1.0, 1.2, 1.0, 1.2])
    # An exact line 2 + 0.5 u: the slope is kept.
    line = 2.0 + 0.5 * u
    fit = _fit_reference(np.stack([alt, line], axis=1), u)
    assert fit.slope[0] == 0.0 and fit.suu[0] == 0.0
    assert fit.level[0] == pytest.approx(1.1) and fit.sigma[0] == pytest.approx(0.14826)
    assert fit.slope[1] == pytest.approx(0.5) and fit.suu[1] == pytest.approx(17.5)
    assert fit.u_last.tolist() == [5.0, 5.0] and fit.n.tolist() == [6, 6]


def test_the_band_lets_an_extrapolated_drift_run_twice_as_fast():
    # A line of slope 1 (reference up to u = 5, n = 10, S_uu = 100, sigma 0.1); with
    # z = 1 and a 1% floor, the drift slack 1 x |b| x (u - 5) is the widest 100 steps
    # on: the band at u = 105 is 100, at u = 5 the prediction interval
    # 0.1 x sqrt(1 + 1/10 + 25/100).
    fit = _Fit(np.array([10]), np.array([0.0]), np.array([0.0]), np.array([1.0]), np.array([100.0]),
               np.array([0.1]), np.array([5.0]))
    p = Policy(localize=C.LocalizeConfig(z=1.0, min_ratio=0.01, drift_slack=1.0))
    pred, band = _band(fit, np.array([5.0, 105.0]), np.array([False]), p)
    assert pred[:, 0].tolist() == [5.0, 105.0]
    assert band[0, 0] == pytest.approx(0.1 * math.sqrt(1.35)) and band[1, 0] == pytest.approx(100.0)


def test_a_departure_is_the_start_of_the_final_run_off_the_band_away_from_the_reference():
    nan = math.nan
    # Prediction 0, band 1, reference level 0 unless said otherwise.
    Wt = np.array([[0.0, 0.0, 1.0, 0.0],
                   [2.0, 0.0, 2.0, 2.0],
                   [0.0, -2.0, 3.0, 2.0],
                   [2.0, 2.0, 3.0, 2.0],
                   [2.0, 2.0, 3.0, 2.0],
                   [2.0, 2.0, 3.0, nan]])
    pred = np.zeros_like(Wt)
    pred[:, 2] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]     # column 2's reference drifted up 1 per row
    band = np.ones_like(Wt) * 0.5
    band[:, :2] = 1.0
    band[:, 3] = 1.0
    ok, first, last = _departures(Wt, pred, band, np.zeros(4))
    # 0: an excursion at row 1 came back at row 2; the final run starts at row 3.
    # 1: below the band at row 2, then above from row 3: the run on the latest side is 3.
    # 2: a drift that stopped at 3: the latest sample is 3 below its extrapolation (6)
    #    but still above the reference level 0, so it moved towards it: no departure.
    # 3: the latest sample is missing: the latest is row 4, off since row 1.
    assert ok.tolist() == [True, True, False, True]
    assert first[[0, 1, 3]].tolist() == [3, 3, 1] and last.tolist() == [5, 5, 5, 4]


def test_ranking_puts_the_alerts_own_group_first_then_the_earliest_then_the_largest():
    departed = [("grad/share/layer_1", 100, 2.0), ("moe/load/max", 120, 5.0),
                ("grad/share/layer_2", 100, 3.0), ("grad/share/layer_0", 90, 1.0)]
    assert [d[0] for d in _rank(departed, None)] == [
        "grad/share/layer_0", "grad/share/layer_2", "grad/share/layer_1", "moe/load/max"]
    # A router alert names the router's figures first.
    assert [d[0] for d in _rank(departed, "router")][0] == "moe/load/max"
