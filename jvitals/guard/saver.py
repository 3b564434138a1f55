"""The guard's saving: when a save is due, the save itself, and a save that failed.

:class:`Saver` writes the guard's checkpoints and snapshots into its
:class:`jvitals.guard.stores.Stores`: a regular checkpoint when the step crosses
a multiple of ``save_every`` (:meth:`Saver.cadence_due`), a snapshot between them
with :class:`jvitals.Snapshots` (:meth:`Saver.snapshot_due`). Each checkpoint's
metadata holds the data position of every process, the guard's record (the
caller's ``record``: monitor state, rollbacks, remedies) and the guard's own
state (:meth:`jvitals.guard.state.GuardState.to_meta`). A save that fails is
raised (``Saving(on_save_error='raise')``) or becomes one error line, a
``checkpoint_save_failed`` alert and an event, and training goes on.
"""

from __future__ import annotations

import logging
from typing import Any, Collection, Iterable, Mapping

from jvitals.guard.checkpoints import SNAPSHOT, CheckpointSaveError, Provenance
from jvitals.guard.configs import Saving
from jvitals.guard.multiprocess import allgather_json
from jvitals.guard.response import check_position, save_failed_alert
from jvitals.guard.state import GuardState, Outbox
from jvitals.guard.target import is_healthy, level_name

__all__ = ["Saver"]

_log = logging.getLogger("jvitals.guard.rollback")


class Saver:
    """Saves into the guard's stores (see module doc).

    Args:
      disk: the guard's :class:`jvitals.guard.stores.Stores`.
      every: the cadence in steps (``Rollback(save_every=)``).
      saving: the :class:`jvitals.guard.configs.Saving` settings.
      state: the guard's :class:`GuardState` (its last saves are updated here).
      outbox: where the events and the failed saves' alerts go.
      healthy_levels: the levels a good checkpoint was saved at (named in a failure's alert).
    """

    def __init__(self, disk: Any, every: int, saving: Saving, state: GuardState, outbox: Outbox,
                 healthy_levels: Collection[int]) -> None:
        self.disk, self.every, self.saving = disk, int(every), saving
        self.state, self.outbox, self.healthy_levels = state, outbox, healthy_levels

    def cadence_due(self, step: int) -> bool:
        last = self.state.last_regular
        return last is None or step // self.every > last // self.every

    def snapshot_due(self, step: int) -> bool:
        if self.disk.snapshots is None:
            return False
        every = int(self.saving.snapshots.every)  # type: ignore[union-attr]
        last = max((x for x in (self.state.last_snapshot, self.state.last_regular) if x is not None),
                   default=None)
        return last is None or step // every > last // every

    def save(self, step: int, tree: Any, position: Any, record: Mapping[str, Any], *, level: int,
             kind: str, open_peak: int = 0, provenance: Provenance = Provenance()) -> int | None:
        """Saves ``tree`` as checkpoint (or snapshot) ``step``; the step saved, or None
        (a usable one exists, or the save failed and was reported)."""
        position = check_position(position)
        store = self.disk.snapshots if kind == SNAPSHOT else self.disk.main
        assert store is not None
        positions = allgather_json(position)
        meta = {"position": positions[0], "positions": positions, **record,
                "guard": self.state.to_meta(step, kind)}
        self.settle([store])              # an earlier save's failure first: this one is still tried
        saved, failed = None, False
        try:
            saved = store.save(step, tree, meta, level=level, kind=kind, open_peak=open_peak,
                               provenance=provenance, sync=self.saving.sync)
        except CheckpointSaveError as e:
            failed = True
            self.failed(e)
        if saved is not None or failed:    # failed: the next try is at the next cadence
            self.state.saved(step, kind)
        if saved is not None:
            self.outbox.event({"event": "save" if kind != SNAPSHOT else "snapshot", "step": step,
                               "kind": kind, "level": level_name(level)})
        return saved

    def settle(self, stores: Iterable[Any] | None = None, poll: bool = False) -> None:
        """Waits for the stores' pending saves (``poll``: only finished ones, without
        blocking); a failed one goes to :meth:`failed`."""
        for s in list(stores) if stores is not None else self.disk.all():
            try:
                s.poll() if poll else s.wait()
            except CheckpointSaveError as e:
                self.failed(e)

    def failed(self, e: CheckpointSaveError) -> None:
        """A save that failed: raised (``on_save_error='raise'``), or one error line, an
        alert and an event, and training goes on from the in-memory state."""
        if self.saving.on_save_error == "raise":
            raise e
        good = [r.step for r in self.disk.records() if is_healthy(r, self.healthy_levels)]
        alert = save_failed_alert(e, newest_good=max(good) if good else None, every=self.every)
        _log.error("%s", alert.message)
        self.outbox.alert(alert)
        self.outbox.event({"event": "save_failed", "step": e.step, "directory": e.directory,
                           "error": alert.details["error"]})
