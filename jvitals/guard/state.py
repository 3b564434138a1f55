"""The guard's own state and its outbox: what :class:`jvitals.Rollback`'s parts share.

:class:`GuardState` is the bookkeeping that decides what to save and restore next
(the last cadence save, the last healthy check, the checks, the alert log, ...);
it is saved with every checkpoint (``meta['guard']``, :meth:`GuardState.to_meta`)
and read back by a resume (:meth:`GuardState.load`), so a resumed run saves, pins
and picks rollback targets as the uninterrupted run would. :class:`Outbox` holds
the alerts and events the guard raised and not yet returned in a
:class:`jvitals.Response`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Collection, Iterable, Mapping

from jvitals.monitor.types import Alert, Level
from jvitals.guard.alertlog import AlertLog
from jvitals.guard.checkpoints import CADENCE, MANUAL, ROLLBACK_SAVE, SNAPSHOT
from jvitals.guard.response import make_alert
from jvitals.guard.target import CheckpointInfo

__all__ = ["GuardState", "Outbox", "REGULAR_KINDS"]

REGULAR_KINDS = (CADENCE, ROLLBACK_SAVE, MANUAL)
"""The kinds of save that restart the cadence (``save_every``)."""


def _checks() -> collections.deque[int]:
    return collections.deque(maxlen=4096)


@dataclasses.dataclass
class GuardState:
    """The guard's bookkeeping (see module doc).

    Attributes:
      last_regular: the step of the last regular save (cadence, rollback, manual).
      last_snapshot: the step of the last snapshot.
      last_healthy_check: the last check at a healthy level.
      orange_saved: this orange episode was saved (once per episode).
      level: the level the guard last acted on (process 0's).
      open_peak: the highest level of the open alerts at the last check (process 0's).
      checks: the guard's check steps (the newest 4096).
      alerts: the guard's record of the monitor's alerts, by id.
      preempted_at: the step a preemption notice was acted on (None: none).
    """

    last_regular: int | None = None
    last_snapshot: int | None = None
    last_healthy_check: int | None = None
    orange_saved: bool = False
    level: int = int(Level.GREEN)
    open_peak: int = int(Level.GREEN)
    checks: collections.deque[int] = dataclasses.field(default_factory=_checks)
    alerts: AlertLog = dataclasses.field(default_factory=AlertLog)
    preempted_at: int | None = None

    def saved(self, step: int, kind: str) -> None:
        """Records a save of ``kind`` at ``step`` (or a failed one: the next try is at the next cadence)."""
        if kind in REGULAR_KINDS:
            self.last_regular = step
        if kind == SNAPSHOT:
            self.last_snapshot = step

    def to_meta(self, step: int, kind: str) -> dict[str, Any]:
        """The state once a save of ``kind`` at ``step`` is done (``meta['guard']``)."""
        return {"last_regular": step if kind in REGULAR_KINDS else self.last_regular,
                "last_snapshot": step if kind == SNAPSHOT else self.last_snapshot,
                "last_healthy_check": self.last_healthy_check, "orange_saved": self.orange_saved,
                "level": self.level, "open_peak": self.open_peak, "checks": list(self.checks),
                "alerts": self.alerts.state_dict()}

    def load(self, rec: CheckpointInfo, saved: Mapping[str, Any] | None,
             records: Iterable[CheckpointInfo], healthy_levels: Collection[int]) -> None:
        """The state as it was when ``rec`` was saved (:meth:`to_meta`); for a checkpoint
        written before it was saved, the closest guess from the disk (``records``)."""
        if saved is None:
            checks = [r.step for r in records if r.step <= rec.step
                      and r.level in healthy_levels and r.kind != ROLLBACK_SAVE]
            saved = {"last_regular": rec.step, "last_snapshot": rec.step,
                     "last_healthy_check": max(checks) if checks else None}
        self.last_regular, self.last_snapshot = saved.get("last_regular"), saved.get("last_snapshot")
        self.last_healthy_check = saved.get("last_healthy_check")
        self.orange_saved = bool(saved.get("orange_saved", False))
        self.level = int(saved.get("level", rec.level if rec.level >= 0 else Level.GREEN))
        self.open_peak = int(saved.get("open_peak", rec.open_peak))
        self.checks.clear()
        self.checks.extend(int(c) for c in saved.get("checks", []))
        self.alerts.load_state_dict(saved.get("alerts") or {})


class Outbox:
    """The guard's alerts and events not yet returned, and every event so far.

    Attributes:
      alerts: the alerts raised since the last :meth:`take_alerts` (one list object
        for the guard's life: drained in place).
      events: every event recorded, oldest first (``Rollback.events``).
    """

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.events: list[dict[str, Any]] = []
        self._pending_events: list[dict[str, Any]] = []

    def event(self, e: dict[str, Any]) -> None:
        self._pending_events.append(e)
        self.events.append(e)

    def alert(self, a: Alert) -> None:
        self.alerts.append(a)

    def collect_failures(self, disk: Any) -> None:
        """Turns the stores' skipped checkpoints (:meth:`Stores.failures`) into alerts and events."""
        for s, step, reason in disk.failures():
            self.alert(make_alert(
                "checkpoint_corrupt", "checkpoint/corrupt", Level.YELLOW, step, step, step,
                f"[YELLOW] {s.name[:-1]} of step {step} in {str(s.directory)!r} cannot be used "
                f"({reason}); skipped and quarantined.", {"reason": reason}))
            self.event({"event": "checkpoint_skipped", "step": step, "store": s.name, "reason": reason})

    def take_alerts(self, disk: Any) -> list[Alert]:
        """The pending alerts (the stores' skipped checkpoints first collected), drained."""
        self.collect_failures(disk)
        out = list(self.alerts)
        self.alerts.clear()
        return out

    def take_events(self, keep: bool = False) -> list[dict[str, Any]]:
        """The pending events, drained unless ``keep``."""
        out = list(self._pending_events)
        if not keep:
            self._pending_events = []
        return out
