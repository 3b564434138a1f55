"""The host side of the per-replica vitals, and the rule that names a sick device or data shard.

:func:`jvitals.replica_metrics` gives, inside the step, small ``(R,)`` vectors over the
data-parallel replicas. On the host, :func:`flat_replicas` turns each into per-replica
scalars (``replica/loss/3``, with the data shard each replica read) that
``Monitor.update`` accepts; :func:`replica_summaries` / :func:`replica_vectors` give the
writer the worst replica's robust z-score and the vectors for the report's heat maps.
:class:`ReplicaRule` (rule id ``replica``) flags a replica whose figure is a robust outlier
against the others (median/MAD across replicas) on consecutive checks, and says whether it
suspects the device or the data, because the cures differ (restart without that host, or
skip the shard). The formula, the suspect table and the remedies: docs/REPLICAS.md, "The
rule". NumPy only, as the rest of the monitor.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import numpy as np

from jvitals.monitor.codec import NAN as _NAN
from jvitals.monitor.policy import Policy
from jvitals.monitor.types import PRESCRIPTIONS, Level, Reading, RuleBase, Spike, release, set_

__all__ = [
    "DATA_FIGURE",
    "REPLICA_PREFIX",
    "ReplicaRule",
    "flat_replicas",
    "replica_summaries",
    "replica_vectors",
    "robust_z",
    "robust_z_rows",
]

REPLICA_PREFIX = "replica/"
"""Every per-replica figure's name starts with it: ``replica/{figure}[/{r}]``."""
DATA_FIGURE = "data"
"""``replica/data/{r}``: the data shard (source id) replica ``r`` read at the step."""
NONFINITE_FIGURE = "nonfinite"
TOKENS_FIGURE = "tokens"
FIRST_FIGURE = "first_nonfinite_step"   # jvitals.replica_window_metrics: -1 never, else the step
_PER = re.compile(r"^replica/(?P<fig>.+)/(?P<r>\d+)$")
_MAD_SIGMA = 1.4826   # mad -> standard deviation of a normal sample


# ----------------------------------------------------------------------------------
# Flat figures.


def flat_replicas(metrics: Mapping[str, Any], data: Sequence[Any] | None = None) -> dict[str, Any]:
    """``metrics`` with each ``replica/{figure}`` vector as per-replica scalars.

    ``replica/loss = [a, b, ...]`` becomes ``replica/loss/0 = a``, ``replica/loss/1 =
    b``, ...; other entries are kept as they are (in order, first). With ``data``, the
    data shard (any integer id of the source: file shard, reader, host loader) each
    replica read at this step is added as ``replica/data/{r}``: the rule tells a
    sick device from a sick data shard by whether the outlier follows it.

    Args:
      metrics: the host's figures (``jax.device_get`` of the step's dict).
      data: ``R`` integers, entry ``r`` the data shard replica ``r`` read (None: not
        known; the rule then cannot tell the device from the data).

    Returns:
      A new flat ``{name: float}`` dict for :meth:`Monitor.update` and :func:`jvitals.write`.

    Raises:
      ValueError: vectors of different lengths, or ``data`` of another length.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"flat_replicas expects the {{name: value}} figures read from the device "
                        f"(jax.device_get of the step's metrics), got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    vectors: dict[str, np.ndarray] = {}
    for k, v in metrics.items():
        if k.startswith(REPLICA_PREFIX) and np.ndim(v) == 1:
            vectors[k] = np.asarray(v, np.float64)
        else:
            out[k] = v
    sizes = {k: v.size for k, v in vectors.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"flat_replicas: the replica vectors have different lengths {sizes}; every "
                         f"replica/* vector has one entry per replica.")
    if data is not None:
        d = np.asarray(data, np.float64).reshape(-1)
        n = next(iter(sizes.values()), d.size)
        if d.size != n:
            raise ValueError(f"flat_replicas: data has {d.size} entries but there are {n} replicas; "
                             f"pass one data shard id per replica (entry r: what replica r read).")
        vectors[REPLICA_PREFIX + DATA_FIGURE] = d
    for k, v in vectors.items():
        for r, x in enumerate(v.tolist()):
            out[f"{k}/{r}"] = x
    return out


def replica_vectors(metrics: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The per-replica figures of a flat (or vector) dict as ``{figure: (R,) float64}``.

    Reads ``replica/{figure}/{r}`` scalars and ``replica/{figure}`` vectors; a figure
    whose replica indices are not exactly ``0..R-1`` is left out.
    """
    per: dict[str, dict[int, float]] = {}
    out: dict[str, np.ndarray] = {}
    for k, v in metrics.items():
        if not k.startswith(REPLICA_PREFIX):
            continue
        if np.ndim(v) == 1:
            out[k[len(REPLICA_PREFIX):]] = np.asarray(v, np.float64)
            continue
        m = _PER.match(k)
        if m:
            per.setdefault(m["fig"], {})[int(m["r"])] = float(np.asarray(v))
    for fig, d in per.items():
        if sorted(d) == list(range(len(d))):
            out[fig] = np.array([d[r] for r in range(len(d))], np.float64)
    return out


def _nanmedian_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Median of each row's finite entries (NaN for a row without any) and their count.

    One sort of the ``[F, R]`` matrix (non-finite entries last) instead of a
    ``np.median`` call per row: the host checks every figure at every check.
    """
    ok = np.isfinite(x)
    k = ok.sum(axis=-1)
    srt = np.sort(np.where(ok, x, np.inf), axis=-1)
    rows = np.arange(x.shape[0])
    lo, hi = srt[rows, np.maximum((k - 1) // 2, 0)], srt[rows, np.maximum(k // 2, 0)]
    with np.errstate(invalid="ignore"):
        med = np.where(k > 0, (lo + hi) / 2, _NAN)
    return med, k


def robust_z_rows(x: np.ndarray, rel_floor: float = 0.02) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`robust_z` of each row of ``x [F, R]``: ``(z [F, R], med [F], s [F])``."""
    x = np.asarray(x, np.float64)
    med, _ = _nanmedian_rows(x)
    mad, _ = _nanmedian_rows(np.abs(x - med[..., None]))
    with np.errstate(invalid="ignore"):
        s = np.maximum(np.maximum(_MAD_SIGMA * mad, rel_floor * np.abs(med)), 1e-30)
        z = (x - med[..., None]) / s[..., None]
    z = np.where(np.isfinite(x), z, _NAN)
    return z, med, np.where(np.isfinite(med), s, _NAN)


def robust_z(x: Sequence[float], rel_floor: float = 0.02) -> tuple[np.ndarray, float, float]:
    """Robust z-scores of ``x`` against its own median (non-finite entries: NaN, left out).

    ``z_r = (x_r - med) / s`` with ``med = median(x)``, ``s = max(1.4826 * median |x -
    med|, rel_floor * |med|)`` (a tiny positive floor when both are 0).

    Returns:
      ``(z, med, s)``; ``z`` NaN where ``x`` is not finite; ``med``/``s`` NaN with no
      finite entry.
    """
    z, med, s = robust_z_rows(np.asarray(x, np.float64)[None, :], rel_floor)
    return z[0], float(med[0]), float(s[0])


_JUDGED_OUT = (TOKENS_FIGURE, DATA_FIGURE, NONFINITE_FIGURE, FIRST_FIGURE)


def replica_summaries(vectors: Mapping[str, np.ndarray], rel_floor: float = 0.02) -> dict[str, float]:
    """What the writer gets instead of R scalars per figure.

    Per judged figure ``f``: ``replica/{f}/worst_z`` (the largest ``|z|``, signed) and
    ``replica/{f}/worst_replica`` (its index); for the non-finite counts
    ``replica/nonfinite/replicas`` (how many replicas hold one) and
    ``replica/nonfinite/worst_replica`` (the one with the most; -1 if none).
    """
    out: dict[str, float] = {}
    for fig, x in vectors.items():
        x = np.asarray(x, np.float64)
        if fig == NONFINITE_FIGURE:
            bad = ~(x == 0)
            out[f"{REPLICA_PREFIX}{fig}/replicas"] = float(bad.sum())
            out[f"{REPLICA_PREFIX}{fig}/worst_replica"] = float(
                np.argmax(np.where(np.isfinite(x), x, np.inf)) if bad.any() else -1)
            continue
        if fig in _JUDGED_OUT or x.size == 0:
            continue
        z, _, _ = robust_z(x, rel_floor)
        if np.isfinite(z).any():
            r = int(np.nanargmax(np.abs(z)))
            out[f"{REPLICA_PREFIX}{fig}/worst_z"] = float(z[r])
            out[f"{REPLICA_PREFIX}{fig}/worst_replica"] = float(r)
    return out


# ----------------------------------------------------------------------------------
# The rule.


def _layout_dict(layout: Any) -> dict[str, Any] | None:
    if layout is None:
        return None
    d = layout.state_dict() if hasattr(layout, "state_dict") else dict(layout)
    if "replicas" not in d:
        raise TypeError("ReplicaRule.layout expects a jvitals.ReplicaLayout (vitals.replica_layout(mesh)) "
                        f"or its state_dict(), got {type(layout).__name__}")
    return d


def _ids(xs: Sequence[Any]) -> str:
    xs = list(xs)
    return ", ".join(map(str, xs[:6])) + (f" +{len(xs) - 6} more" if len(xs) > 6 else "")


class ReplicaRule(RuleBase):
    """Names the replica (devices, process, host) whose figures left the others'.

    See the module docstring for the conditions; every number is a ``Policy.replica_*``
    field. Set :attr:`layout` (``monitor.rule('replica').layout =
    vitals.replica_layout(mesh)``) for the messages to name devices, processes and
    hosts; without it they name the replica index only.

    Args:
      policy: the :class:`Policy`.
      layout: a :class:`~jvitals.metrics.replicas.ReplicaLayout` or its ``state_dict()``.
      figures: the ``replica/{figure}`` vectors judged for outliers (default
        :attr:`FIGURES`); the non-finite counts are always judged.

    Raises:
      ValueError: a ``Policy.replica_*`` field out of range (naming it).
    """

    name = "replica"
    alert_ids = ("replica",)   # the alerts' ``rule`` (docs/MONITOR.md)
    levels = (Level.YELLOW, Level.ORANGE)
    state_fields = ("streaks", "spread")   # the layout is the run's: set it again after a restart
    FIGURES = ("loss", "hidden_states_rms", "hidden_states_abs.max", "output_layer_logits_abs.max",
               "grad_norm")

    def __init__(self, policy: Policy, layout: Any = None, *, figures: Sequence[str] | None = None) -> None:
        self.p = policy
        self.figures = tuple(self.FIGURES if figures is None else figures)
        # The replica thresholds are checked by ReplicaConfig (Policy.replica).
        self._layout: dict[str, Any] | None = None
        self.layout = layout
        self.streaks: dict[str, list[dict[str, Any]]] = {}
        self.spread: dict[str, float] = {}     # figure -> EMA of the relative spread (scale / |median|)

    # -- the layout ---------------------------------------------------------------

    @property
    def layout(self) -> dict[str, Any] | None:
        """The replica layout as a plain dict (set a ``ReplicaLayout`` or its dict)."""
        return self._layout

    @layout.setter
    def layout(self, value: Any) -> None:
        self._layout = _layout_dict(value)

    def _place(self, r: int, n: int) -> tuple[str, dict[str, Any]]:
        lay = self._layout
        if lay is None or len(lay["replicas"]) != n:
            why = "" if lay is None else f"; the layout has {len(lay['replicas'])} replicas, the figures {n}"
            return f"replica {r}{why}", {"replica": r}
        p = lay["replicas"][r]
        devs = ", ".join(f"{i} {nm}" for i, nm in list(zip(p["devices"], p["device_names"]))[:4])
        more = f" +{len(p['devices']) - 4} more" if len(p["devices"]) > 4 else ""
        procs, hosts = sorted(set(p["processes"])), sorted(set(p["hosts"]))
        text = (f"replica {r} (device{'s' if len(p['devices']) > 1 else ''} {devs}{more}, "
                f"process{'es' if len(procs) > 1 else ''} {_ids(procs)}, "
                f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})")
        return text, {"replica": r, "devices": list(p["devices"]), "device_names": list(p["device_names"]),
                      "processes": procs, "hosts": hosts}

    # -- reading the figures ------------------------------------------------------

    def _plan(self, f: Any) -> dict[str, list[int]]:
        cache = f.plan.cache
        got = cache.get("replica")
        if got is None:
            per: dict[str, dict[int, int]] = {}
            for i, k in enumerate(f.plan.keys):
                m = _PER.match(k)
                if m:
                    per.setdefault(m["fig"], {})[int(m["r"])] = i
            got = {fig: np.array([d[r] for r in range(len(d))], np.intp) for fig, d in per.items()
                   if sorted(d) == list(range(len(d)))}
            cache["replica"] = got
        return got

    def check(self, f: Any) -> list[Any]:
        plan = self._plan(f)
        if not plan:
            return []
        vals = np.asarray(f.vals, np.float64)
        vec = {fig: vals[idx] for fig, idx in plan.items()}
        data = vec.get(DATA_FIGURE)
        tokens = vec.get(TOKENS_FIGURE)
        out: list[Any] = []
        if NONFINITE_FIGURE in vec:
            out.extend(self._nonfinite(f, vec[NONFINITE_FIGURE], data, vec.get(FIRST_FIGURE)))
        figs = [fig for fig in self.figures if fig in vec]
        if figs:
            hits = self._outliers(figs, np.stack([vec[fig] for fig in figs]), tokens)
        for i, fig in enumerate(figs):
            x, key = vec[fig], REPLICA_PREFIX + fig
            hit = hits[i]
            if hit is None:
                self.streaks.pop(key, None)
                out.append(release("replica", key))
                continue
            r, z, med, k = hit
            streak = self._extend(key, f.step, r, data, float(x[r]), z)
            if len(streak) < self.p.replica.confirm:
                out.append(release("replica", key))
                continue
            out.append(self._set(key, Level.YELLOW, x, r, z, med, k, streak))
        return out

    def _outliers(self, figs: list[str], x: np.ndarray, tokens: np.ndarray | None
                  ) -> list[tuple[int, float, float, int] | None]:
        """Per row of ``x [F, R]``, the worst outlier replica ``(r, z, median, n_replicas)`` or None.

        The z-score's scale is the larger of this check's (``robust_z_rows``) and the
        figure's typical spread (:attr:`spread`, updated here from this check's scale).
        """
        ok = np.isfinite(x)
        if tokens is not None and tokens.shape == x.shape[1:]:
            ok &= tokens > 0
        xs = np.where(ok, x, _NAN)
        z, med, s = robust_z_rows(xs, self.p.replica.rel_floor)
        k = ok.sum(axis=1)
        decay = 0.5 ** (1.0 / self.p.replica.spread_halflife)
        for i, fig in enumerate(figs):
            if not (k[i] >= self.p.replica.min_replicas and med[i] > 0 and math.isfinite(s[i])):
                continue
            rel, typical = s[i] / med[i], self.spread.get(fig)
            if typical is not None and typical * med[i] > s[i]:
                z[i] *= s[i] / (typical * med[i])
            self.spread[fig] = rel if typical is None else decay * typical + (1 - decay) * rel
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = xs / med[:, None]
        lim = self.p.replica.min_ratio
        az = np.where(np.isnan(z), 0.0, np.abs(z))
        cand = ok & (az > self.p.replica.z) & ((ratio > lim) | (ratio < 1.0 / lim))
        cand &= ((k >= self.p.replica.min_replicas) & (med > 0))[:, None]
        out: list[tuple[int, float, float, int] | None] = []
        for i in range(x.shape[0]):
            if not cand[i].any():
                out.append(None)
                continue
            r = int(np.argmax(np.where(cand[i], az[i], -1.0)))
            out.append((r, float(z[i, r]), float(med[i]), int(k[i])))
        return out

    def _extend(self, key: str, step: int, r: int, data: np.ndarray | None, value: float,
                z: float) -> list[dict[str, Any]]:
        d = None if data is None or not math.isfinite(data[r]) else int(data[r])
        entry = {"step": int(step), "replica": r, "data": d, "value": value, "z": z}
        streak = self.streaks.get(key, [])
        if streak:
            last = streak[-1]
            same = last["replica"] == r or (d is not None and last["data"] == d)
            streak = streak if same else []
        streak = (streak + [entry])[-8:]
        self.streaks[key] = streak
        return streak

    # -- judging ------------------------------------------------------------------

    def _nonfinite(self, f: Any, nf: np.ndarray, data: np.ndarray | None,
                   first: np.ndarray | None) -> list[Any]:
        key = REPLICA_PREFIX + NONFINITE_FIGURE
        bad = ~(nf == 0)
        n = nf.size
        if not bad.any():
            self.streaks.pop(key, None)
            return [release("replica", key)]
        if bad.all():
            streak = self.streaks.get(key)
            if not streak or ("replica", key) not in f.open:
                return self._first(f, key, nf, first)
            first = streak[0]
            text, where = self._place(first["replica"], n)
            return [self._change(
                key, Level.ORANGE, (float(np.nansum(np.where(np.isfinite(nf), nf, 0))), _NAN),
                f"every replica is non-finite now (spread through the gradient all-reduce); {text} was "
                f"the first, at step {first['step']}, while the others were finite. "
                f"{self._verdict(streak, n)[1]}", streak, where, n)]
        r = int(np.argmax(np.where(np.isfinite(nf), nf, np.inf)))
        streak = self._extend(key, f.step, r, data, float(nf[r]), _NAN)
        text, where = self._place(r, n)
        others = np.flatnonzero(bad).tolist()
        also = f" (also replicas {_ids([i for i in others if i != r])})" if len(others) > 1 else ""
        head = (f"{text} holds {nf[r]:g} non-finite values{also} while {int((~bad).sum())} of {n} "
                f"replicas are finite. {self._verdict(streak, n)[1]}")
        return [self._change(key, Level.ORANGE, (float(nf[r]), 0.0), head, streak, where, n,
                             bad_replicas=others)]

    def _first(self, f: Any, key: str, nf: np.ndarray, first: np.ndarray | None) -> list[Any]:
        """Every replica non-finite at this check: name the one(s) the device window saw go
        first (:func:`jvitals.replica_window_update`), if they were a minority."""
        n = nf.size
        if first is None or first.shape != nf.shape or not (first >= 0).any():
            return []          # nothing to name: the NonFiniteRule speaks for the whole run
        s0 = float(first[first >= 0].min())
        went = np.flatnonzero(first == s0).tolist()
        if len(went) * 2 > n:
            return []
        r = went[0]
        entry = {"step": int(s0), "replica": r, "data": None, "value": float(nf[r]), "z": _NAN}
        self.streaks[key] = [entry]
        text, where = self._place(r, n)
        also = f" (with replicas {_ids(went[1:])})" if len(went) > 1 else ""
        head = (f"every replica is non-finite now (spread through the gradient all-reduce); {text}{also} "
                f"went non-finite first, at step {int(s0)}, while the others were finite (the device "
                f"window's record). Suspect: not known from one event.")
        return [self._change(key, Level.ORANGE, (float(nf[r]), 0.0), head, [entry], where, n,
                             bad_replicas=went, first_step=int(s0))]

    def _set(self, key: str, level: Level, x: np.ndarray, r: int, z: float, med: float, k: int,
             streak: list[dict[str, Any]]) -> Any:
        text, where = self._place(r, x.size)
        head = (f"{text} is an outlier in {key} on {len(streak)} consecutive checks: {x[r]:.4g} against "
                f"a median of {med:.4g} over {k} replicas (robust z {z:+.3g}, {x[r] / med:.3g}x). "
                f"{self._verdict(streak, x.size)[1]}")
        return self._change(key, level, (float(x[r]), med), head, streak, where, x.size, z=z)

    def _change(self, key: str, level: Level, figures: tuple[float, float], head: str,
                streak: list[dict[str, Any]], where: dict[str, Any], n: int, **extra: Any) -> Any:
        """The ``"set"`` change of ``key``; ``figures``: ``(value, baseline)``."""
        value, baseline = figures
        suspect, _, cause, prescription = self._verdict(streak, n)
        pres_key = f"replica_{suspect}"
        details = {**where, "suspect": suspect, "cause": cause, "prescription": prescription,
                   "consecutive_checks": len(streak), "replicas_seen": [s["replica"] for s in streak],
                   "data_seen": [s["data"] for s in streak], "steps_seen": [s["step"] for s in streak],
                   **{k: (float(v) if isinstance(v, (float, np.floating)) else v) for k, v in extra.items()}}
        ratio = value / baseline if baseline and math.isfinite(baseline) else _NAN
        return set_("replica", key, level, Reading(value, baseline, ratio), head,
                    f"{key} left the other replicas' on replica {streak[-1]['replica']}",
                    key=key, onset=streak[0]["step"], details=details, diverging=False,
                    prescription=pres_key if pres_key in PRESCRIPTIONS else None)

    def _verdict(self, streak: list[dict[str, Any]], n: int) -> tuple[str, str, str, str]:
        """``(suspect, sentence, cause, prescription)`` from the checks of the streak."""
        last = streak[-1]
        text, where = self._place(last["replica"], n)
        hosts = ", ".join(where.get("hosts", [])) or f"the host of replica {last['replica']}"
        devs = _ids(where.get("devices", [])) or "its devices"
        if len(streak) < 2:
            return ("unknown", "Suspect: not known after one check (the next checks tell whether it "
                    "stays on the device while the data moves, or follows the data).",
                    "one replica's figures left the others'",
                    f"watch the next checks; if it stays on replica {last['replica']}, restart without "
                    f"host {hosts}")
        if any(s["data"] is None for s in streak):
            return ("unknown", "Suspect: cannot tell the device from the data: no data shards were "
                    "logged (pass data= to vitals.flat_replicas).",
                    "a device or the data shard it read (no data shards logged)",
                    "log which data shard each replica reads (flat_replicas(..., data=)); if it stays "
                    f"on replica {last['replica']}, restart without host {hosts}")
        pairs = list(zip(streak, streak[1:]))
        dev = [b for a, b in pairs if a["replica"] == b["replica"] and a["data"] != b["data"]]
        dat = [b for a, b in pairs if a["replica"] != b["replica"] and a["data"] == b["data"]]
        trail = ", ".join(f"replica {s['replica']} / data shard {s['data']} at step {s['step']}"
                          for s in streak[-4:])
        if dev and not dat:
            return ("device", f"Suspect: the device: the outlier stayed on replica {last['replica']} while "
                    f"its data moved ({trail}). Restart without host {hosts} (devices {devs}) from the "
                    "healthy checkpoint; do not lower the learning rate: the model is not at fault.",
                    f"a sick device: replica {last['replica']}'s figures stay off the others' whatever data "
                    "it reads",
                    f"restart without host {hosts} (devices {devs}) from the healthy checkpoint; do not "
                    "lower the learning rate")
        if dat and not dev:
            return ("data", f"Suspect: the data: the outlier followed data shard {last['data']} across "
                    f"replicas ({trail}). Skip or repair data shard {last['data']}; the devices and the "
                    "learning rate are not at fault.",
                    f"a bad data shard: shard {last['data']} moves the figures of whichever replica reads it",
                    f"skip or repair data shard {last['data']} (roll back to the healthy checkpoint if the "
                    "loss was hurt); keep the learning rate and the hosts")
        why = ("the data never moved between replicas" if not dev and not dat
               else "it moved with both the replica and the data")
        return ("unknown", f"Suspect: cannot tell the device from the data: {why} ({trail}). To tell "
                f"them apart, rotate the data shards between replicas (or replay data shard {last['data']} "
                f"on another host).",
                f"replica {last['replica']}'s device or data shard {last['data']} (cannot tell: {why})",
                f"rotate the data shards between replicas, or replay data shard {last['data']} on another "
                f"host; if the outlier stays on replica {last['replica']}, restart without host {hosts}")

    # -- state --------------------------------------------------------------------

    def rewind(self, step: int, t_to: int) -> list[Spike]:
        """Forgets the streaks (the replicas run from the restored state); keeps the spreads."""
        del step, t_to
        self.streaks.clear()
        return []
