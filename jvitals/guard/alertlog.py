"""What the guard knows of the monitor's alerts, by id, from the verdicts it was given.

:class:`AlertLog` keeps one :class:`jvitals.guard.target.AlertRecord` per alert id
across the guard's checks: its onset and change points, the highest level it
reached, whether the guard saw it clearing and holding again (a revived alert
counts from the check it held again), when it closed, and the alert it names as
its lead. The rollback target (:mod:`jvitals.guard.target`) is a pure function of
these records and the checkpoints on disk. Its rules (a new episode after a close,
an alert missing from a verdict is closed, the last calm check, what is forgotten)
are in docs/GUARD.md, "The alert log".
"""


from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import numpy as np

from jvitals.monitor.types import Level
from jvitals.guard.target import AlertRecord, earliest_sign
from jvitals.guard.verdict import VerdictLike

__all__ = ["AlertLog", "alert_id"]


def alert_id(a: Any) -> int | None:
    """The alert's monitor id (None for the guard's own alerts, id -1, or none)."""
    i = getattr(a, "id", None)
    return int(i) if isinstance(i, (int, np.integer)) and int(i) >= 0 else None


def _departures(a: Any) -> tuple[int, ...]:
    return tuple(int(loc.departure_step) for loc in (getattr(a, "localization", None) or [])
                 if getattr(loc, "departure_step", None) is not None)


class AlertLog:
    """The guard's record of the monitor's alerts (see module doc).

    Attributes:
      seen: ``{alert id: AlertRecord}``.
      last_calm: the last check with no open alert that had reached ORANGE (None: none yet).
    """

    def __init__(self) -> None:
        self.seen: dict[int, AlertRecord] = {}
        self.last_calm: int | None = None

    def observe(self, step: int, verdict: VerdictLike | None) -> None:
        """Updates the records with ``verdict``'s open and closed alerts, at check ``step``."""
        open_alerts = list(verdict.alerts) if verdict is not None else []
        closed = list(verdict.closed_alerts) if verdict is not None else []
        now_open = set()
        for a in open_alerts:
            i = alert_id(a)
            if i is not None:
                now_open.add(i)
                self._see(step, i, a)
        for a in closed:
            i = alert_id(a)
            if i is not None and i in self.seen and i not in now_open:
                self.seen[i].closed = step
        for i, rec in self.seen.items():
            if i not in now_open and rec.closed is None:
                rec.closed = step                   # gone from the open alerts: closed
        if all(self.seen[i].peak < Level.ORANGE for i in now_open):
            self.last_calm = step
        if len(self.seen) > 512:                    # forget long-closed alerts
            for i in sorted(i for i, r in self.seen.items() if r.closed is not None)[:-256]:
                del self.seen[i]

    def _see(self, step: int, i: int, a: Any) -> None:
        """One open alert at check ``step``: a new record (a new episode after a close),
        or the known one updated (revived when it stopped clearing)."""
        rec = self.seen.get(i)
        clearing = getattr(a, "clearing_since", None) is not None
        deps = _departures(a)
        peak = int(max(int(getattr(a, "peak_level", a.level)), int(a.level)))
        lead = (getattr(a, "details", None) or {}).get("lead_alert")
        if rec is None or rec.closed is not None:
            rec = self.seen[i] = AlertRecord(i, str(getattr(a, "rule", "")), int(a.onset_step), deps,
                                             peak, step)
        else:
            if rec.clearing and not clearing:
                rec.revived = step
            rec.onset, rec.departures = int(a.onset_step), deps
            rec.peak = max(rec.peak, peak)
        rec.clearing = clearing
        rec.lead = int(lead) if isinstance(lead, (int, np.integer)) else None

    def state_dict(self) -> dict[str, Any]:
        """The records and the last calm check as plain JSON (saved with each checkpoint)."""
        return {"seen": [dataclasses.asdict(r) for r in self.seen.values()], "last_calm": self.last_calm}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Replaces the records with :meth:`state_dict`'s ``d`` (an empty dict: none)."""
        self.seen = {}
        for r in d.get("seen", []):
            rec = AlertRecord(**{**r, "departures": tuple(int(x) for x in r.get("departures", ()))})
            self.seen[int(rec.id)] = rec
        self.last_calm = d.get("last_calm")

    def open_peak(self, verdict: VerdictLike | None) -> int:
        """The highest peak level of ``verdict``'s open alerts (GREEN without any)."""
        peaks = [self.seen[i].peak for i in self._open_ids(verdict) if i in self.seen]
        return max(peaks, default=int(Level.GREEN))

    @staticmethod
    def _open_ids(verdict: VerdictLike | None) -> list[int]:
        alerts = verdict.alerts if verdict is not None else []
        return [i for i in (alert_id(a) for a in alerts) if i is not None]

    def chain_sign(self, verdict: VerdictLike | None, step: int, remedied: Iterable[int] = ()) -> int:
        """Earliest sign of the chain of alerts that escalated to the red
        (:func:`jvitals.guard.target.earliest_sign` over the records, after
        :meth:`observe` of ``verdict``); ``remedied``: ids of the alerts whose remedy
        the guard applies (in the chain too)."""
        onset = verdict.onset_step if verdict is not None else None
        return earliest_sign(self.seen, step=step, calm=self.last_calm, remedied=remedied,
                             onset=None if onset is None else int(onset))

    def open_records(self, verdict: VerdictLike | None) -> dict[int, AlertRecord]:
        """``{alert id: record}`` of ``verdict``'s open alerts."""
        return {i: self.seen[i] for i in self._open_ids(verdict) if i in self.seen}

    def open_signs(self, verdict: VerdictLike | None) -> dict[int, int]:
        """``{alert id: earliest sign}`` of the open alerts."""
        return {i: r.sign() for i, r in self.open_records(verdict).items()}
