"""The guard's checkpoints and snapshots as one: what :class:`jvitals.Rollback` reads and restores.

:class:`Stores` holds the checkpoint store and, with ``snapshots=``, the snapshot
store (:class:`jvitals.guard.checkpoints.CheckpointStore` each) and answers for
both: every record newest first (a checkpoint before a snapshot at one step),
the store of a record, a quarantine, the pins, the waits, and the restore of the
first of a list of candidates (:func:`jvitals.guard.target.restore_order`,
:func:`jvitals.guard.target.pick_target`) that restores on every process.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Collection, Iterable, Mapping

import jax

from jvitals.guard.checkpoints import CheckpointStore, allgather_json
from jvitals.guard.target import CheckpointInfo, newest_first

__all__ = ["Stores", "own_position"]

_log = logging.getLogger("jvitals.guard.rollback")


def own_position(meta: Mapping[str, Any]) -> Any:
    """This process's data position saved in a checkpoint's metadata (``positions``,
    one per process; ``position``, process 0's, when the process count changed)."""
    positions = meta.get("positions")
    if isinstance(positions, list) and len(positions) == jax.process_count():
        return positions[jax.process_index()]
    return meta.get("position")


class Stores:
    """The checkpoint store and the snapshot store (see module doc).

    Args:
      directory: the checkpoint directory.
      snapshots: a :class:`jvitals.Snapshots` (``every``, ``keep``, ``directory``,
        default ``<directory>/snapshots``), or None: no snapshot store.
      healthy_levels: the levels a healthy checkpoint was saved at.
      retention: the checkpoint store's :class:`jvitals.guard.configs.Retention`; the
        snapshot store keeps the newest ``snapshots.keep`` and no others.

    Attributes:
      main: the checkpoint store.
      snapshots: the snapshot store, or None.
    """

    def __init__(self, directory: str | os.PathLike, snapshots: Any = None, *,
                 healthy_levels: Collection[int], retention: Any) -> None:
        r = retention
        self.main = CheckpointStore(directory, keep_last=r.keep_last, keep_every=r.keep_every,
                                    keep_green=r.keep_green, keep_quarantined=r.keep_quarantined,
                                    healthy_levels=healthy_levels, name="checkpoints")
        self.snapshots: CheckpointStore | None = None
        if snapshots is not None:
            where = snapshots.directory if snapshots.directory is not None else self.main.directory / "snapshots"
            self.snapshots = CheckpointStore(
                where, keep_last=int(snapshots.keep), keep_every=None, keep_green=0, keep_quarantined=0,
                healthy_levels=healthy_levels, name="snapshots", quarantine_file=True)

    def all(self) -> list[CheckpointStore]:
        """The stores: the checkpoints, then the snapshots."""
        return [self.main] + ([self.snapshots] if self.snapshots is not None else [])

    def records(self) -> list[CheckpointInfo]:
        """Every record of every store, newest first (a checkpoint before a snapshot at one step)."""
        return newest_first(r for s in self.all() for r in s.records.values())

    def of(self, rec: CheckpointInfo) -> CheckpointStore:
        """The store holding ``rec``."""
        return self.main if rec.store == self.main.name else self.snapshots  # type: ignore[return-value]

    def holding(self, step: int) -> CheckpointStore:
        """The store holding ``step``: the checkpoints', unless only a snapshot has it."""
        if step not in self.main.records and self.snapshots is not None and step in self.snapshots.records:
            return self.snapshots
        return self.main

    def latest_step(self) -> int | None:
        """The newest step in any store (None: both empty)."""
        return max((s.latest_step() for s in self.all() if s.latest_step() is not None), default=None)

    def quarantine(self, recs: Iterable[CheckpointInfo], reason: str) -> None:
        """Quarantines each of ``recs`` in its store."""
        for r in recs:
            self.of(r).quarantine(r.step, reason)

    def restore_first(self, candidates: Iterable[CheckpointInfo], like: Any, *,
                      finite: bool) -> tuple[CheckpointInfo, Any, dict] | None:
        """The first of ``candidates`` that restores (finite, with ``finite``) on every
        process, as ``(record, state, metadata)``; one that does not is quarantined by
        its store (in its ``failures``) and the next is tried. None: none restores."""
        for rec in candidates:
            got = self.of(rec).try_restore(rec.step, like, finite=finite)
            if got is not None:
                if rec.quarantined is not None:
                    _log.warning("Rollback: no healthy checkpoint left; using the relapse "
                                 "suspect %d (%s).", rec.step, rec.quarantined)
                return (rec, *got)
        return None

    def set_pins(self, pins: Mapping[int, str]) -> None:
        """Pins ``{step: why}`` in every store (process 0's on every process)."""
        if jax.process_count() > 1:
            pins = {int(s): r for s, r in allgather_json({str(s): r for s, r in pins.items()})[0].items()}
        for s in self.all():
            s.set_pins(pins)

    def failures(self) -> list[tuple[CheckpointStore, int, str]]:
        """The checkpoints the stores skipped since the last call: ``(store, step, reason)``."""
        out = [(s, step, reason) for s in self.all() for step, reason in s.failures]
        for s in self.all():
            s.failures.clear()
        return out

    def poll(self) -> None:
        for s in self.all():
            s.poll()

    def wait(self) -> None:
        """Blocks until the pending saves have landed (raises a failed one's error)."""
        for s in self.all():
            s.wait()

    def write_quarantine(self) -> None:
        for s in self.all():
            s.write_quarantine()

    def close(self) -> None:
        for s in self.all():
            s.close()
