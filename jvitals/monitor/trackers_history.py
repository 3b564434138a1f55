"""Per-layer history for localization: :class:`LayerHistory`, a NumPy ring buffer of the
candidate metrics (per layer / group) with their own median baselines.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from jvitals.monitor.codec import dec_floats, enc_floats
from jvitals.monitor.policy import Policy

__all__ = ["LayerHistory"]


class LayerHistory:
    """Fixed-size NumPy history of the localization candidates.

    One row per ``stride`` steps of model time (later samples within a stride
    are merged into the row), ``rows`` rows in a ring, one column per metric
    (at most ``max_columns``). Missing values are NaN; non-finite values are
    stored as ``+inf``. Each column gets a median baseline over its baseline
    window (from the rows, when the window closes; ``mean``), for
    ``Monitor.baseline``.
    """

    def __init__(self, rows: int, stride: int) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.stride = max(1, stride)
        cap = 16
        self.data = np.full((rows, cap), np.nan)
        self.steps = np.zeros(rows, np.int64)
        self.ts = np.zeros(rows, np.int64)
        self.pos = 0
        self.n = 0
        self.mean = np.full(cap, np.nan)
        self.pending = 0

    def column(self, name: str, max_columns: int) -> int:
        """Column of ``name``, created if new (``-1`` once full)."""
        c = self.index.get(name)
        if c is not None:
            return c
        if len(self.names) >= max_columns:
            return -1
        c = len(self.names)
        if c >= self.data.shape[1]:
            cap = 2 * self.data.shape[1]
            data = np.full((self.data.shape[0], cap), np.nan)
            data[:, :c] = self.data
            self.data = data
            mean = np.full(cap, np.nan)
            mean[:c] = self.mean[:c]
            self.mean = mean
        self.names.append(name)
        self.index[name] = c
        self.pending += 1
        return c

    def observe(self, s: int, t: int, cols: np.ndarray, vals: np.ndarray, p: Policy,
                start: int | None) -> None:
        """Records one sample of the columns ``cols`` (values ``vals``)."""
        finite = np.isfinite(vals)
        if not finite.all():
            vals = np.where(finite, vals, np.inf)
        if self.n and 0 <= t - int(self.ts[self.pos - 1]) < self.stride:
            self.data[self.pos - 1, cols] = vals
        else:
            row = self.data[self.pos]
            row.fill(np.nan)
            row[cols] = vals
            self.steps[self.pos] = s
            self.ts[self.pos] = t
            self.pos = (self.pos + 1) % self.data.shape[0]
            self.n = min(self.n + 1, self.data.shape[0])
        if self.pending and start is not None and t >= start + p.baselines.steps - 1:
            self._baselines(start, p)

    def _baselines(self, start: int, p: Policy) -> None:
        ncol = len(self.names)
        todo = np.flatnonzero(np.isnan(self.mean[:ncol]))
        order = self._chrono()
        order = order[self.ts[order] >= start]
        h = self.data[order][:, todo]
        h = np.where(np.isfinite(h), h, np.nan)
        ok = ~np.isnan(h)
        rank = np.cumsum(ok, axis=0)
        in_win = (self.ts[order] < start + p.baselines.steps)[:, None] | (rank <= p.baselines.min_samples)
        h = np.where(in_win & ok, h, np.nan)
        cnt = (~np.isnan(h)).sum(axis=0)
        ready = cnt >= p.baselines.min_samples
        if ready.any():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med = np.nanmedian(h[:, ready], axis=0)
            self.mean[todo[ready]] = med
            self.pending = int(np.isnan(self.mean[:ncol]).sum())

    def _chrono(self) -> np.ndarray:
        r = self.data.shape[0]
        return (np.arange(self.pos - self.n, self.pos) % r)

    def chrono(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, model times, data[rows, columns])`` oldest first."""
        order = self._chrono()
        return self.steps[order], self.ts[order], self.data[order, :len(self.names)]

    def drop_after(self, t: int) -> None:
        """Forgets rows of model time > ``t`` (an abandoned trajectory)."""
        order = self._chrono()
        keep = order[self.ts[order] <= t]
        data, steps, ts = self.data[keep].copy(), self.steps[keep].copy(), self.ts[keep].copy()
        self.data.fill(np.nan)
        k = len(keep)
        self.data[:k], self.steps[:k], self.ts[:k] = data, steps, ts
        self.n = k
        self.pos = k % self.data.shape[0]

    def state_dict(self) -> dict[str, Any]:
        order = self._chrono()
        ncol = len(self.names)
        return {
            "names": list(self.names),
            "stride": self.stride,
            "rows": self.data.shape[0],
            "steps": self.steps[order].tolist(),
            "ts": self.ts[order].tolist(),
            "data": [enc_floats(r) for r in self.data[order, :ncol].tolist()],
            "mean": enc_floats(self.mean[:ncol].tolist()),
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, Any], rows: int, stride: int) -> "LayerHistory":
        h = cls(rows, stride)
        for name in d["names"]:
            h.column(name, len(d["names"]))
        ncol = len(h.names)
        h.mean[:ncol] = dec_floats(d["mean"])
        h.pending = int(np.isnan(h.mean[:ncol]).sum())
        data = [dec_floats(r) for r in d["data"]][-rows:]
        k = len(data)
        if k:
            h.data[:k, :ncol] = np.asarray(data, dtype=np.float64).reshape(k, ncol)
        h.steps[:k] = d["steps"][len(d["steps"]) - k:]
        h.ts[:k] = d["ts"][len(d["ts"]) - k:]
        h.n = k
        h.pos = k % rows
        return h
