"""Robust statistics: the Theil-Sen slope, the Mann-Kendall trend test and the median.
"""

from __future__ import annotations

import math

import numpy as np

from jvitals.monitor.codec import NAN as _NAN

__all__ = ["mann_kendall_z", "median", "theil_sen"]


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.triu_indices(n, 1)``, cached (a pure function of ``n``)."""
    got = _PAIRS.get(n)
    if got is None:
        if len(_PAIRS) > 64:
            _PAIRS.clear()
        got = _PAIRS[n] = np.triu_indices(n, 1)
    return got


def theil_sen(x: np.ndarray, y: np.ndarray) -> float:
    """Theil-Sen slope: ``median((y_j - y_i) / (x_j - x_i))`` over ``i < j``
    with ``x_i != x_j`` (NaN with fewer than two distinct ``x``)."""
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        return _NAN
    return float(np.median((y[j] - y[i])[ok] / dx[ok]))


def mann_kendall_z(y: np.ndarray) -> float:
    """Mann-Kendall trend statistic (no ties correction)::

        S = sum_{i<j} sign(y_j - y_i),  var = n (n - 1) (2n + 5) / 18
        z = (S - sign(S)) / sqrt(var)

    ``z > 0``: rising; ``|z| > 3`` is significant at p ~ 0.003 for
    independent samples. 0 for fewer than 3 samples.
    """
    n = len(y)
    if n < 3:
        return 0.0
    i, j = _pairs(n)
    s = float(np.sign(y[j] - y[i]).sum())
    var = n * (n - 1) * (2 * n + 5) / 18.0
    return (s - math.copysign(1.0, s)) / math.sqrt(var) if s else 0.0


def median(xs) -> float:
    """Median of a small sequence in plain Python (faster than NumPy below ~100)."""
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])
