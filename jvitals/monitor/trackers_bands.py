"""A figure's history against its own band: :class:`BucketSeries` (bucket means, the trend
rule), :class:`DriftBand` (jumps against its noise, drift against its own drift: the group
rule), :class:`GapSeries` (the train/val gap).
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Any, NamedTuple

import numpy as np

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.codec import dec_floats, dec_state, enc_floats, enc_state

__all__ = ["BandSettings", "BucketSeries", "DriftBand", "GapSeries"]


class BucketSeries:
    """Means of ``k`` parallel series in fixed step buckets, last ``n`` kept.

    Bucket ``b = s // width``; ``add`` returns True when it closed a bucket
    (the first sample of a later bucket arrived), so a caller recomputes its
    statistics once per bucket, not per check.
    """

    def __init__(self, width: int, n: int, k: int) -> None:
        self.width, self.n, self.k = max(1, width), n, k
        self.ids: collections.deque[int] = collections.deque(maxlen=n)
        self.means: collections.deque[list[float]] = collections.deque(maxlen=n)
        self.cur: int | None = None
        self.sums = [0.0] * k
        self.cnt = 0

    def add(self, s: int, xs: list[float]) -> bool:
        b = s // self.width
        closed = False
        if b != self.cur:
            if self.cur is not None and self.cnt:
                self.ids.append(self.cur)
                self.means.append([x / self.cnt for x in self.sums])
                closed = True
            self.sums, self.cnt = list(xs), 1
            self.cur = b
            return closed
        sums = self.sums
        for i, x in enumerate(xs):
            sums[i] += x
        self.cnt += 1
        return False

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bucket start steps, means[n, k])`` of the closed buckets."""
        ids = np.fromiter(self.ids, np.float64, len(self.ids)) * self.width
        return ids, np.asarray(list(self.means), np.float64).reshape(len(self.ids), self.k)

    def clear(self) -> None:
        self.ids.clear()
        self.means.clear()
        self.cur, self.sums, self.cnt = None, [0.0] * self.k, 0

    def state_dict(self) -> dict[str, Any]:
        return {"width": self.width, "n": self.n, "k": self.k, "ids": list(self.ids),
                "means": [enc_floats(m) for m in self.means], "cur": self.cur,
                "sums": enc_floats(self.sums), "cnt": self.cnt}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "BucketSeries":
        b = cls(int(d["width"]), int(d["n"]), int(d["k"]))
        b.ids.extend(int(x) for x in d["ids"])
        b.means.extend(dec_floats(m) for m in d["means"])
        b.cur, b.sums, b.cnt = d["cur"], dec_floats(d["sums"]), int(d["cnt"])
        return b


class BandSettings(NamedTuple):
    """What :meth:`DriftBand.observe` judges a sample by (see :class:`DriftBand`).

    Attributes:
      band: the band ratio (``log(band)`` the least departure).
      jump: a one-sample change of at least this ratio is a jump (``math.inf``: none).
      z: departures beyond ``z`` x the one-sample noise.
      k: a drift beyond ``k`` x the figure's own largest drift over the window.
      windows: the drift windows ``W`` (steps).
      memory: the half-life (steps) with which that largest drift fades.
      confirm: samples a candidate must hold.
      hysteresis: a confirmed departure holds above this fraction of ``log(band)``.
      abrupt: judge jumps and steps too (False: drift only).
      growth: judge a rise that does not slow too (``DriftBand``'s **growth**).
    """

    band: float
    jump: float
    z: float
    k: float
    windows: tuple[int, ...]
    memory: float
    confirm: int
    hysteresis: float
    abrupt: bool = True
    growth: bool = False


class DriftBand:
    """Departures of one figure ``y`` (a log) from its own recent history.

    At each sample ``(t, y)`` (model time), for each window ``W`` of ``windows``::

        d     = y - y_prev                                 one-sample change
        noise = sqrt(EMA of d^2)                           its sample-to-sample noise
        c_W   = y - y(t - W)                               change over the last W steps
        D_W   = max(D_W * 0.5 ** (dt / memory), |c_W(u)|)  the largest change over W
                                                           steps it showed up to W steps
                                                           ago (u <= t - W; fading)

    A departure opens (``anchor`` = the level it left, ``sign`` its direction):

    - **jump**: ``|d| >= max(log(jump), z * noise)``: confirmed at once (from the
      second change on: the first one only teaches ``noise``; until 3 changes were learned
      the ``z * noise`` term is left out: a sparse figure's first changes say little);
    - **step**: ``|d| > max(log(band), z * noise)``: a candidate;
    - **drift**: ``|c_W| > max(log(band), k * D_W, z * noise)`` for some ``W``: a
      candidate (``anchor = y(t - W)``; the noise term matters where samples are
      sparse, ``c_W`` then being one noisy change);
    - **growth** (``growth=True``; ``W`` the first window): ``c_W > log(band)`` and
      ``c_W >= y(t - W) - y(t - 2W)``: a rise beyond the band over ``W`` steps that did not
      slow from the ``W`` before, a candidate (``anchor = y(t - W)``). A healthy figure's
      growth slows as training settles (the TUNING corpus' parameter norms: at most 1.17x
      per 500 steps, relative to the trunk, without slowing); a creep that compounds (a
      negative weight decay, a head scaled a little every step) does not, and it outgrows
      ``k * D_W`` only late where the run's early growth set ``D_W``.

    It holds while ``sign * (y - anchor) > hold`` (``log(band)`` for a candidate,
    ``hysteresis * log(band)`` once confirmed) and is confirmed after ``confirm``
    samples; otherwise it ends. ``noise`` and ``D_W`` learn only from samples in
    band (a fault never widens the band it is judged by); a change enters ``D_W``
    only ``W`` steps after it was seen, so a creep is judged against the drift
    before it, not against its own growth; until 3 changes have entered it, ``D_W``
    is the largest change seen so far once those span ``W / 2`` steps (a cold
    start: a creep already under way is learned as the figure's own drift). Two windows
    (``W`` and ``4 W`` by default) see a fast creep early and a slow one once it
    has outgrown the group's drift. History: one sample per ``max(windows) // 32``
    steps (the latest kept), spanning the longest window.
    """

    __slots__ = ("ts", "ys", "last_t", "last_y", "var", "nvar", "drift", "ndrift", "drift_t",
                 "fresh", "dh_t", "dh_d", "anchor", "sign", "onset", "run", "kind", "stat", "window")

    def __init__(self, nwin: int = 2) -> None:
        self.ts: list[int] = []
        self.ys: list[float] = []
        self.last_t: int | None = None
        self.last_y = _NAN
        self.var = 0.0
        self.nvar = 0
        self.drift = [0.0] * nwin               # D_W per window
        self.ndrift = [0] * nwin
        self.drift_t = [0] * nwin
        self.fresh: list[list[list]] = [[] for _ in range(nwin)]   # [t, |c|] not yet W old
        self.dh_t: list[int] = []      # D_W0 once matured (3 samples), and when: spanning the
        self.dh_d: list[float] = []    # longest window
        self.anchor: float | None = None
        self.sign = 0
        self.onset = 0
        self.run = 0
        self.kind = ""
        self.stat = _NAN   # the one-sample change (jump/step) or the W-step change (drift)
        self.window = 0    # the window of a drift departure

    @property
    def noise(self) -> float | None:
        return math.sqrt(self.var) if self.nvar >= 3 else None

    def natural(self, i: int = 0, windows: tuple[int, ...] = (), t: int | None = None) -> float | None:
        """``D_W`` of window ``i``: the largest change over it the figure showed
        (``None`` before 3 samples matured). A longer window not matured yet takes
        the first window's as it was when the longer window now judged began (``t -
        W_i + W_0``: before a creep that started within it), scaled by the windows'
        ratio (a steady drift's)."""
        if self.ndrift[i] >= 3:
            return self.drift[i]
        if i and len(windows) > i and t is not None:
            then = t - windows[i] + windows[0]
            k = bisect.bisect_right(self.dh_t, then) - 1
            if k >= 0:
                return self.dh_d[k] * windows[i] / windows[0]
        fresh = self.fresh[i]
        if fresh and len(windows) > i and fresh[-1][0] - fresh[0][0] >= windows[i] // 2:
            return max(c for _, c in fresh)   # cold start: the largest change so far, unlagged
        return None

    def _at(self, x: int) -> float | None:
        """``y`` at model time ``x`` (linear between the samples around it; None before them)."""
        ts, ys = self.ts, self.ys
        if not ts or ts[0] > x:
            return None
        i = bisect.bisect_right(ts, x) - 1
        if i + 1 >= len(ts) or ts[i] == x:
            return ys[i]
        return ys[i] + (ys[i + 1] - ys[i]) * (x - ts[i]) / (ts[i + 1] - ts[i])

    def _keep(self, t: int, y: float, span: int) -> None:
        if len(self.ts) >= 2 and t - self.ts[-2] < max(1, span // 32):
            self.ts[-1], self.ys[-1] = t, y     # the last slot floats until a stride past the one before
        else:
            self.ts.append(t)
            self.ys.append(y)
        k = bisect.bisect_left(self.ts, t - span) - 1   # one sample at or before t - span
        if k > 0:
            del self.ts[:k], self.ys[:k]
        k = bisect.bisect_left(self.dh_t, t - span) - 1
        if k > 0:
            del self.dh_t[:k], self.dh_d[:k]

    def observe(self, s: int, t: int, y: float, c: BandSettings) -> bool:
        """Feeds one sample ``y`` at step ``s`` (model time ``t``); True while a confirmed
        departure holds (see the class doc; ``c.abrupt=False``: drift departures only)."""
        band, jump, z, k, windows, memory, confirm, hysteresis, abrupt, growth = c
        lband = math.log(band)
        prev = self.last_y if self.last_t is not None else None
        past = [self._at(t - w) for w in windows]
        if self.anchor is not None:
            dev = (y - self.anchor) * self.sign
            if dev > lband * (hysteresis if self.run >= confirm else 1.0):
                self.run = min(self.run + 1, confirm)
            else:
                self.anchor, self.run, self.kind = None, 0, ""
        elif prev is not None:
            d = y - prev
            noise = self.noise
            zn = z * (noise if noise is not None else math.sqrt(self.var))
            # Before 3 changes were learned (sparse samples: a heavy family every 500 steps)
            # their spread says little: a jump needs only to be one.
            zj = zn if noise is not None else 0.0
            if abrupt and self.nvar and abs(d) >= max(math.log(jump), zj):
                self._open(s, prev, d, "jump", confirm)
            elif abrupt and noise is not None and abs(d) > max(lband, zn):
                self._open(s, prev, d, "step", 1)
            else:
                for i, (w, yp) in enumerate(zip(windows, past)):
                    nat = self.natural(i, windows, t)
                    if yp is not None and nat is not None and abs(y - yp) > max(lband, k * nat, zn):
                        self._open(s, yp, y - yp, "drift", 1)
                        self.window = w
                        break
                else:
                    if growth and self._grows(t, y, windows[0], lband):
                        self._open(s, past[0], y - past[0], "growth", 1)
                        self.window = windows[0]
                    else:                                # in band: learn
                        self.var += (d * d - self.var) / min(self.nvar + 1, 16)
                        self.nvar += 1
                        for i, (w, yp) in enumerate(zip(windows, past)):
                            if yp is not None:
                                self._learn_drift(i, t, abs(y - yp), w, memory)
        self.last_t, self.last_y = t, y
        self._keep(t, y, max(windows))
        return self.anchor is not None and self.run >= confirm

    def _rise(self, t: int, y: float, w: int) -> tuple[float, float] | None:
        """``(y - y(t - w), y(t - w) - y(t - 2w))``: the change over the last ``w`` steps and
        over the ``w`` before (None before ``2w`` of history)."""
        y1, y2 = self._at(t - w), self._at(t - 2 * w)
        return None if y1 is None or y2 is None else (y - y1, y1 - y2)

    def _grows(self, t: int, y: float, w: int, lband: float) -> bool:
        """The **growth** departure (the class doc): ``y`` rose by more than ``lband`` over the
        last ``w`` steps, not less than over the ``w`` before."""
        r = self._rise(t, y, w)
        return r is not None and r[0] > lband and r[0] >= r[1]

    def last_rise(self, w: int) -> tuple[float, float] | None:
        """:meth:`_rise` at the latest sample (what a growth departure's message quotes)."""
        return None if self.last_t is None else self._rise(self.last_t, self.last_y, w)

    def _learn_drift(self, i: int, t: int, c: float, window: int, memory: float) -> None:
        fresh = self.fresh[i]
        if fresh and t - fresh[-1][0] < max(1, window // 16):
            fresh[-1][1] = max(fresh[-1][1], c)
        else:
            fresh.append([t, c])
        while fresh and fresh[0][0] <= t - window:
            u, cu = fresh.pop(0)
            dt = max(u - self.drift_t[i], 0) if self.ndrift[i] else 0
            self.drift[i] = max(self.drift[i] * 0.5 ** (dt / memory), cu)
            self.drift_t[i] = u
            self.ndrift[i] += 1
            if i == 0 and self.ndrift[0] >= 3:
                self.dh_t.append(u)
                self.dh_d.append(self.drift[0])

    def _open(self, s: int, anchor: float, change: float, kind: str, run: int) -> None:
        self.anchor, self.sign, self.onset, self.run = anchor, 1 if change > 0 else -1, s, run
        self.kind, self.stat, self.window = kind, change, 0

    def rewind(self, t_to: int) -> None:
        """Forgets samples after model time ``t_to`` and any open departure."""
        k = bisect.bisect_right(self.ts, t_to)
        del self.ts[k:], self.ys[k:]
        for fresh in self.fresh:
            fresh[:] = [x for x in fresh if x[0] <= t_to]
        k = bisect.bisect_right(self.dh_t, t_to)
        del self.dh_t[k:], self.dh_d[k:]
        self.last_t = self.ts[-1] if self.ts else None
        self.last_y = self.ys[-1] if self.ys else _NAN
        self.anchor, self.run, self.kind = None, 0, ""

    def state_dict(self) -> dict[str, Any]:
        return {k: enc_state(getattr(self, k)) for k in self.__slots__}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "DriftBand":
        b = cls(len(d["drift"]))
        for k in cls.__slots__:
            setattr(b, k, dec_state(d[k], getattr(b, k)))
        b.drift = dec_floats(d["drift"])
        return b


class GapSeries:
    """(t, gap) samples covering the last ``2 * val_gap_window`` steps.

    Keeps one sample at or before ``t - 2W`` so both window ends can be
    linearly interpolated: ``g(x)`` between the samples around ``x``.
    """

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.gs: list[float] = []
        self.head = 0

    def add(self, t: int, g: float, span: int) -> None:
        self.ts.append(t)
        self.gs.append(g)
        while self.head + 1 < len(self.ts) and self.ts[self.head + 1] <= t - span:
            self.head += 1
        if self.head > 64 and self.head * 2 > len(self.ts):
            del self.ts[: self.head]
            del self.gs[: self.head]
            self.head = 0

    def covers(self, x: int) -> bool:
        return self.head < len(self.ts) and self.ts[self.head] <= x

    def at(self, x: int) -> float:
        i = bisect.bisect_right(self.ts, x, self.head) - 1
        if i + 1 >= len(self.ts) or self.ts[i] == x:
            return self.gs[i]
        t0, t1 = self.ts[i], self.ts[i + 1]
        return self.gs[i] + (self.gs[i + 1] - self.gs[i]) * (x - t0) / (t1 - t0)

    def max_before(self, x: int) -> float:
        """The largest gap of the samples kept at or before ``x`` (-inf if none)."""
        hi = bisect.bisect_right(self.ts, x, self.head)
        return max(self.gs[self.head:hi], default=-math.inf)

    def drop_after(self, t: int) -> None:
        keep = [i for i in range(self.head, len(self.ts)) if self.ts[i] <= t]
        self.ts = [self.ts[i] for i in keep]
        self.gs = [self.gs[i] for i in keep]
        self.head = 0

    def state_dict(self) -> dict[str, Any]:
        return {"ts": self.ts[self.head:], "gs": enc_floats(self.gs[self.head:])}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "GapSeries":
        g = cls()
        g.ts = [int(x) for x in d["ts"]]
        g.gs = dec_floats(d["gs"])
        return g
