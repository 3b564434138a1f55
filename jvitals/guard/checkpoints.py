"""The checkpoint store behind :class:`jvitals.Rollback`: save, retention, pins, quarantine.

A :class:`CheckpointStore` is one orbax ``CheckpointManager`` directory whose
steps each hold two items: ``state`` (the train state pytree, ``StandardSave``)
and ``meta`` (JSON). It knows, per step, the health level the checkpoint was
saved at, its kind, whether an alert that had reached ORANGE was open when it was
saved, and whether it is quarantined; it knows nothing about verdicts (the
response policy in :mod:`jvitals.guard.rollback` decides what to save and restore).

Its decisions (healthy, retention and pins, quarantine, failures as one line each,
a checkpoint of an older jvitals, the exit) are in docs/GUARD.md, "The checkpoint
store". Multi-process: every process calls every method in the same order (orbax
is multi-host aware); agreement on restores uses ``process_allgather``.
"""


from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import threading
import weakref
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import jax
import orbax.checkpoint as ocp
from etils import epath

from jvitals.monitor.types import Level
from jvitals.guard.multiprocess import agree, allgather_ints, allgather_json, json_default  # noqa: F401 - re-exported
from jvitals.guard.orbax_noise import (  # noqa: F401 - re-exported (tests reach _NOISE and the installers here)
    _NOISE,
    _OrbaxNoise,
    _install_log_filter,
    _install_unraisablehook,
    _is_closed_loop_error,
    one_line,
    quiet_orbax,
)
from jvitals.guard.pytrees import (  # noqa: F401 - re-exported
    CheckpointMismatchError,
    Fit,
    abstract,
    check_dtypes,
    float_dtypes,
    all_finite,
    fit,
    graft,
    migration_note,
)
from jvitals.guard.target import CheckpointInfo, is_healthy, level_name

__all__ = [
    "CADENCE",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointStore",
    "MANUAL",
    "ORANGE_SAVE",
    "Provenance",
    "QUARANTINE_FILE",
    "ROLLBACK_SAVE",
    "SNAPSHOT",
    "quiet_orbax",
]

_log = logging.getLogger("jvitals.guard.checkpoints")

QUARANTINE_FILE = "jvitals_quarantine.json"
META_FORMAT = "jvitals.Rollback"
META_VERSION = 2

CADENCE, ORANGE_SAVE, ROLLBACK_SAVE, MANUAL, SNAPSHOT = "cadence", "orange", "rollback", "manual", "snapshot"
REGULAR = (CADENCE, ROLLBACK_SAVE, MANUAL)


class Provenance(NamedTuple):
    """Where a saved state came from (kept in the checkpoint's metadata).

    Attributes:
      restored_from: the checkpoint it was restored from (None: trained on, not restored).
      lr_scale: the LR scale in force when it was saved.
    """

    restored_from: int | None = None
    lr_scale: float = 1.0


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (unwritable directory, full disk, ...).

    The caller's train state is untouched. Attributes: ``directory``, ``step``.
    """

    def __init__(self, message: str, *, directory: str, step: int | None) -> None:
        super().__init__(message)
        self.directory, self.step = directory, step


# ----------------------------------------------------------------------------
# Retention.
# ----------------------------------------------------------------------------


class _Retention:
    """Orbax ``PreservationPolicy`` reading the store's records (see module doc)."""

    def __init__(self, store: "CheckpointStore") -> None:
        self._store = weakref.ref(store)

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
        del context
        store = self._store()
        steps = [int(c.step) for c in checkpoints]
        if store is None:
            return [True] * len(steps)
        keep = store.keep_reasons(steps)
        dropped = [s for s in steps if s not in keep]
        if dropped:
            kept = "; ".join(f"{s} ({', '.join(r)})" for s, r in sorted(keep.items()))
            _log.info("retention in %s: deleting %s; keeping %s", store.directory, dropped, kept)
        return [s in keep for s in steps]


# ----------------------------------------------------------------------------
# The store.
# ----------------------------------------------------------------------------


class CheckpointStore:
    """One orbax checkpoint directory with levels, pins, quarantine and retention.

    Args:
      directory: the checkpoint directory (created if missing; any path orbax accepts).
      keep_last: the newest checkpoints kept (of any kind, and regular ones).
      keep_every: cadence checkpoints on multiples of this are kept for good (None: none).
      keep_green: the newest healthy GREEN checkpoints kept beyond ``keep_last``.
      keep_quarantined: the newest quarantined checkpoints kept for a post-mortem.
      healthy_levels: saved levels that count as healthy.
      name: the store's name in records and messages (``'checkpoints'``, ``'snapshots'``).
      quarantine_file: write the quarantine list to ``directory/jvitals_quarantine.json``.

    Raises:
      CheckpointSaveError: the directory cannot be created or used.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 5,
                 keep_every: int | None = 5000, keep_green: int = 1, keep_quarantined: int = 3,
                 healthy_levels: Iterable[int] = (Level.GREEN, Level.YELLOW),
                 name: str = "checkpoints", quarantine_file: bool = True) -> None:
        if int(keep_last) < 1:
            raise ValueError(f"CheckpointStore expects keep_last >= 1, got {keep_last}")
        if keep_every is not None and int(keep_every) < 1:
            raise ValueError(f"CheckpointStore expects keep_every >= 1 or None, got {keep_every}")
        if int(keep_quarantined) < 0 or int(keep_green) < 0:
            raise ValueError(f"CheckpointStore expects keep_quarantined, keep_green >= 0, got "
                             f"{keep_quarantined}, {keep_green}")
        self.keep_last = int(keep_last)
        self.keep_every = None if keep_every is None else int(keep_every)
        self.keep_green = int(keep_green)
        self.keep_quarantined = int(keep_quarantined)
        self.healthy_levels = frozenset(int(x) for x in healthy_levels)
        self.name = name
        self._quarantine_file = bool(quarantine_file)
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"CheckpointStore expects a directory (str or path), got {type(directory).__name__}")
        d = os.fspath(directory)
        # orbax wants absolute paths ("Checkpoint path should be absolute" at the
        # first asynchronous save); a local relative path is taken from the cwd.
        self.directory = epath.Path(d if "://" in d else os.path.abspath(d))
        self.records: dict[int, CheckpointInfo] = {}
        self.pins: dict[int, str] = {}
        self.failures: list[tuple[int, str]] = []     # (step, reason): read by the policy
        self._unsaved_step: int | None = None
        self._dropped: dict[int, CheckpointInfo] = {}   # forgotten by the pending save's retention
        try:
            with quiet_orbax():
                self._mngr = ocp.CheckpointManager(
                    self.directory,
                    options=ocp.CheckpointManagerOptions(
                        create=True,
                        cleanup_tmp_directories=True,
                        enable_async_checkpointing=True,
                        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                        preservation_policy=_Retention(self),
                    ),
                )
        except Exception as e:  # noqa: BLE001 - reported with the directory
            raise CheckpointSaveError(
                f"Rollback: cannot use {str(self.directory)!r} as a checkpoint directory "
                f"({type(e).__name__}: {e}). Expected a writable directory (or a path where "
                "one can be created); pass another directory.",
                directory=str(self.directory), step=None) from e
        _install_unraisablehook()
        _install_log_filter()
        self._load_records()
        _register_exit_wait(self)

    # ------------------------------------------------------------------
    # What is on disk.
    # ------------------------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Records of the checkpoints on disk, oldest first."""
        return [self.records[s] for s in sorted(self.records)]

    @property
    def quarantined(self) -> dict[int, str]:
        """``{step: reason}`` of the checkpoints that are never restored."""
        return {s: r.quarantined for s, r in sorted(self.records.items()) if r.quarantined}

    def is_healthy(self, rec: CheckpointInfo, *, allow_suspect: bool = False) -> bool:
        """Saved at a healthy level, no open ORANGE/RED alert, not quarantined."""
        return is_healthy(rec, self.healthy_levels, allow_suspect=allow_suspect)

    def healthy(self, *, before: int | None = None, allow_suspect: bool = False) -> list[CheckpointInfo]:
        """Healthy checkpoints (step ``< before`` if given), newest first."""
        return [r for r in sorted(self.records.values(), key=lambda r: -r.step)
                if self.is_healthy(r, allow_suspect=allow_suspect) and (before is None or r.step < before)]

    def latest_step(self) -> int | None:
        return max(self.records) if self.records else None

    def set_pins(self, pins: Mapping[int, str]) -> None:
        """Replaces the pinned steps (``{step: why}``); retention never deletes them."""
        self.pins = {int(s): str(r) for s, r in pins.items()}

    def quarantine(self, step: int, reason: str) -> None:
        """Marks ``step`` as never to be restored (kept for a post-mortem, bounded)."""
        rec = self.records.get(int(step))
        if rec is not None and rec.quarantined is None:
            rec.quarantined = reason
            _log.info("%s: checkpoint %d quarantined: %s", self.name, rec.step, reason)

    def keep_reasons(self, steps: Sequence[int]) -> dict[int, list[str]]:
        """``{step: [why it is kept]}`` for the steps retention keeps (see module doc)."""
        ordered = sorted(int(s) for s in steps)
        rec = self.records
        why: dict[int, list[str]] = {}

        def add(s: int, reason: str) -> None:
            why.setdefault(s, []).append(reason)

        live = [s for s in ordered if not (s in rec and rec[s].quarantined)]
        for s in live[-self.keep_last:]:
            add(s, f"newest {self.keep_last}")
        regular = [s for s in live if s in rec and rec[s].kind in REGULAR]
        for s in regular[-self.keep_last:]:
            add(s, f"newest {self.keep_last} regular")
        if self.keep_every:
            prev = None
            for s in (s for s in ordered if s in rec and rec[s].kind == CADENCE):
                if s % self.keep_every == 0 or (prev is not None and s // self.keep_every > prev // self.keep_every):
                    if not rec[s].quarantined:
                        add(s, f"every {self.keep_every}, for good")
                prev = s
        if self.keep_green > 0:
            green = [s for s in ordered if s in rec and rec[s].level == Level.GREEN
                     and self.is_healthy(rec[s])]
            for s in green[-self.keep_green:]:
                add(s, "newest healthy GREEN")
        for s in ordered:
            if s in self.pins:
                add(s, f"pinned: {self.pins[s]}")
        sick = [s for s in ordered if s in rec and rec[s].quarantined and s not in self.pins]
        for s in sick[-self.keep_quarantined:] if self.keep_quarantined else []:
            add(s, "quarantined, kept for a post-mortem")
        if ordered and ordered[-1] not in why and not (ordered[-1] in rec and rec[ordered[-1]].quarantined):
            add(ordered[-1], "newest")
        return why

    # ------------------------------------------------------------------
    # Saving.
    # ------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, level: int, kind: str,
             open_peak: int = 0, provenance: Provenance = Provenance(),
             sync: bool = False) -> int | None:
        """Saves ``state`` and ``meta`` as checkpoint ``step`` (asynchronously unless ``sync``).

        A quarantined checkpoint of the same step (reached again after a resume
        from an older one) is deleted and replaced. ``provenance`` is where the
        state came from (the checkpoint it was restored from, the LR scale in force).

        Returns:
          ``step``, or None when a usable checkpoint of that step exists.

        Raises:
          CheckpointSaveError: the directory cannot take it (nothing is modified).
        """
        step = int(step)
        existing = self.records.get(step)
        if existing is not None and existing.quarantined is None:
            _log.warning("%s: a usable checkpoint of step %d exists in %s; not saving it again.",
                         self.name, step, self.directory)
            return None
        self.wait()
        self._probe(step)
        if existing is not None or step in self._mngr.all_steps():
            self._mngr.delete(step)
            self.records.pop(step, None)
        restored_from, lr_scale = provenance
        rec = CheckpointInfo(step, int(level), kind, float(lr_scale), restored_from, None,
                             int(open_peak), self.name)
        full = dict(meta)
        full.update({
            "format": META_FORMAT, "version": META_VERSION, "step": step, "level": int(level),
            "level_name": level_name(level), "kind": kind, "open_peak": int(open_peak),
            "restored_from": restored_from, "lr_scale": float(lr_scale),
            "quarantine": {str(s): r for s, r in self.quarantined.items()},
            "pins": {str(s): r for s, r in sorted(self.pins.items())},
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "process_count": jax.process_count(),
            "float_dtypes": float_dtypes(state),
        })
        json.dumps(full, default=json_default)  # fail here, not in orbax's thread
        self.records[step] = rec
        try:
            with quiet_orbax():
                ok = self._mngr.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(full)), force=True)
        except Exception as e:  # noqa: BLE001 - reported with the directory and step
            self.records.pop(step, None)
            raise self._save_error(step, e) from e
        if not ok:
            self.records.pop(step, None)
            raise CheckpointSaveError(
                f"Rollback: orbax did not save step {step} in {str(self.directory)!r} (latest "
                f"step {self._mngr.latest_step()}); expected every save to land. The train "
                "state is unchanged.", directory=str(self.directory), step=step)
        self._unsaved_step = step
        self._dropped = self._sync_records()
        if sync:
            self.wait()
        return step

    def _probe(self, step: int) -> None:
        """Fails fast (on every process) when the directory cannot take a checkpoint."""
        err = None
        probe = self.directory / f".jvitals_probe_{step}_{jax.process_index()}"
        try:
            if not self.directory.is_dir():
                raise NotADirectoryError(f"{str(self.directory)!r} is not a directory")
            probe.write_bytes(b"\0" * 4096)
        except Exception as e:  # noqa: BLE001
            err = e
        finally:
            try:
                if probe.exists():
                    probe.unlink()
            except Exception:  # noqa: BLE001
                pass
        if not agree(err is None):
            raise self._save_error(step, err or RuntimeError("another process could not write")) from err

    def _save_error(self, step: int | None, e: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"Rollback: could not save the checkpoint of step {step} in "
            f"{str(self.directory)!r}: {type(e).__name__}: {e}. Expected a writable directory "
            "with free space; the in-memory train state is unchanged (nothing was restored or "
            "modified), so you can free space or fix permissions and keep training, or pass "
            "another directory.", directory=str(self.directory), step=step)

    def wait(self) -> None:
        """Blocks until pending saves have landed.

        Raises:
          CheckpointSaveError: an asynchronous save failed (that checkpoint does not exist).
        """
        err = None
        try:
            with quiet_orbax():
                self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            err = e
        failed, dropped = self._unsaved_step, self._dropped
        self._unsaved_step, self._dropped = None, {}
        if not agree(err is None):
            if failed is not None:
                self.records.pop(failed, None)
            self._keep_after_failure(failed, dropped)
            _log.debug("%s: the asynchronous save of step %s failed: %s", self.name, failed,
                       f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if err else
                       "error on another process")
            raise CheckpointSaveError(
                f"Rollback: the asynchronous save of step {failed} in {str(self.directory)!r} "
                f"failed: {type(err).__name__ if err else 'error on another process'}: {err}. "
                "Expected a writable directory with free space; the in-memory train state is "
                "unchanged; that checkpoint does not exist.",
                directory=str(self.directory), step=failed) from err

    def poll(self) -> None:
        """Surfaces a failed asynchronous save without blocking (single process)."""
        if jax.process_count() == 1 and self._unsaved_step is not None \
                and not self._mngr.is_saving_in_progress():
            self.wait()

    @property
    def saving(self) -> bool:
        return self._unsaved_step is not None

    def _sync_records(self) -> dict[int, CheckpointInfo]:
        """Drops the records of steps orbax no longer lists; returns them."""
        on_disk = set(int(s) for s in self._mngr.all_steps())
        return {s: self.records.pop(s) for s in list(self.records) if s not in on_disk}

    def _keep_after_failure(self, failed: int | None, dropped: Mapping[int, CheckpointInfo]) -> None:
        """After a failed asynchronous save: orbax forgot at save time the steps its
        retention was to delete once the save landed, which it did not: they are still
        on disk and come back (``reload``); the failed step's temporary directory goes."""
        with quiet_orbax():
            self._mngr.reload()
        on_disk = set(int(s) for s in self._mngr.all_steps())
        self.records.update({s: r for s, r in dropped.items() if s in on_disk})
        self._sync_records()
        for tmp in self.directory.glob(f"{failed}.orbax-checkpoint-tmp*") if failed is not None else []:
            try:
                tmp.rmtree()
            except Exception as e:  # noqa: BLE001 - another process removed it, or it is not ours
                _log.debug("%s: could not remove %s: %s", self.name, tmp, e)

    def delete_quarantined_beyond_bound(self) -> None:
        """Applies the quarantine bound now (orbax applies retention only after a save)."""
        keep = self.keep_reasons(list(self.records))
        for s in [s for s in self.records if s not in keep and self.records[s].quarantined]:
            _log.info("retention in %s: deleting quarantined %d (beyond the newest %d kept)",
                      self.directory, s, self.keep_quarantined)
            self._mngr.delete(s)
            del self.records[s]

    # ------------------------------------------------------------------
    # Restoring.
    # ------------------------------------------------------------------

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint ``step`` onto ``like``'s structure and shardings (no health checks).

        When that fails, the checkpoint's tree is held against ``like``'s
        (:func:`_refit`): a checkpoint whose only differences lie in recorder states'
        own fields (one an older jvitals recorder wrote: another figure vector, fewer
        ``last_step`` families) is restored after all, every other array from disk and
        those fields from ``like``, with one warning line (:func:`migration_note`).

        Raises:
          CheckpointMismatchError: another path is absent or has another shape (the
            model or the optimizer changed).
          Exception: orbax's error, when the tree fits (the checkpoint is corrupt).
        """
        self.wait()
        try:
            with quiet_orbax():
                out = self._mngr.restore(int(step), args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract(like)), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - held against the tree on disk
            fitted = _refit(self, step, like, e)
        else:
            saved = dict(out["meta"]).get("float_dtypes")
            if saved is not None and saved != float_dtypes(like):
                # orbax cast some floating array to the train state's dtype: name it (the
                # saved tree is read only then).
                with quiet_orbax():
                    check_dtypes(_saved_tree(self.directory, step), like, step=int(step),
                                 directory=str(self.directory), store=self.name)
            return out["state"], dict(out["meta"])
        with quiet_orbax():
            out = self._mngr.restore(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardRestore(fitted.target), meta=ocp.args.JsonRestore()))
        _log.warning("%s", migration_note(fitted))
        return graft(out["state"], like, fitted.kept), dict(out["meta"])

    def try_restore(self, step: int, like: Any, *, finite: bool) -> tuple[Any, dict] | None:
        """Restores ``step`` (agreed by every process), or quarantines it and returns None.

        A failure is one warning line and one entry in :attr:`failures`.

        Raises:
          CheckpointMismatchError: the checkpoint does not fit ``like`` (on any process):
            not quarantined, since a changed model or optimizer, not the checkpoint, is
            at fault (every older checkpoint would be quarantined in turn, and retention
            could delete them).
        """
        err, out = None, None
        try:
            out = self.restore(step, like)
            if finite and not all_finite(out[0]):
                raise FloatingPointError("it holds non-finite values")
        except Exception as e:  # noqa: BLE001 - any failure makes the checkpoint unusable
            err = e
        codes = allgather_ints([0 if err is None else 2 if isinstance(err, CheckpointMismatchError) else 1])
        if int(codes.max()) == 0:
            return out
        if int(codes.max()) == 2:
            if isinstance(err, CheckpointMismatchError):
                raise err
            raise CheckpointMismatchError(
                f"{self.name}: checkpoint {int(step)} in {str(self.directory)!r} does not fit the train "
                "state on another process (see its error); the checkpoint is left as it is.",
                directory=str(self.directory), step=int(step))
        # The reads still in flight when the restore failed complete later; the
        # closed-loop errors they raise are held back (see _install_unraisablehook).
        if isinstance(err, FloatingPointError):
            reason = "non-finite values"
        elif err is not None:
            reason = f"corrupt: {type(err).__name__}: {one_line(err)}"
        else:
            reason = "corrupt: failed to restore on another process"
        rec = self.records.get(int(step))
        if rec is not None:
            rec.quarantined = reason
        self.failures.append((int(step), reason))
        self.write_quarantine()
        _log.warning("%s", skip_message(self, step, reason))
        return None

    def read_meta(self, step: int) -> dict[str, Any]:
        with quiet_orbax():
            meta = self._mngr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, Mapping) or meta.get("format") != META_FORMAT:
            raise ValueError(f"not a jvitals checkpoint (metadata {str(meta)[:80]!r})")
        return dict(meta)

    def _load_records(self) -> None:
        quarantine = self._read_quarantine()
        newest_pins: dict[int, str] = {}
        for step in sorted(int(s) for s in self._mngr.all_steps()):
            try:
                meta = self.read_meta(step)
                rec = CheckpointInfo(step, int(meta["level"]), str(meta["kind"]),
                                     float(meta.get("lr_scale", 1.0)), meta.get("restored_from"),
                                     None, int(meta.get("open_peak", 0)), self.name)
                for s, reason in (meta.get("quarantine") or {}).items():
                    quarantine.setdefault(int(s), reason)
                newest_pins = {int(s): str(r) for s, r in (meta.get("pins") or {}).items()}
            except Exception as e:  # noqa: BLE001 - unreadable metadata = unusable checkpoint
                reason = f"corrupt: metadata unreadable: {type(e).__name__}: {one_line(e, 200)}"
                rec = CheckpointInfo(step, -1, "unknown", quarantined=reason, store=self.name)
                self.failures.append((step, reason))
                _log.warning("%s", skip_message(self, step, reason))
            self.records[step] = rec
        for s, reason in quarantine.items():
            if s in self.records and self.records[s].quarantined is None:
                self.records[s].quarantined = reason
        self.pins = newest_pins

    def _read_quarantine(self) -> dict[int, str]:
        path = self.directory / QUARANTINE_FILE
        try:
            if self._quarantine_file and path.exists():
                data = json.loads(path.read_text())
                return {int(s): str(r) for s, r in data.get("steps", {}).items()}
        except Exception as e:  # noqa: BLE001
            _log.warning("%s: cannot read %s (%s); relying on checkpoint metadata", self.name, path, e)
        return {}

    def write_quarantine(self) -> None:
        """Writes the quarantine list (process 0; the checkpoints' metadata keep it too)."""
        if jax.process_index() != 0 or not self._quarantine_file:
            return
        steps = {s: r for s, r in self._read_quarantine().items() if s in self.records}
        steps.update(self.quarantined)
        data = {"format": "jvitals.quarantine", "version": 1,
                "note": "checkpoints jvitals never restores (the newest kept for a post-mortem)",
                "steps": {str(s): r for s, r in sorted(steps.items())}}
        path = self.directory / QUARANTINE_FILE
        tmp = self.directory / (QUARANTINE_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except Exception as e:  # noqa: BLE001 - the metadata keeps the list too
            _log.warning("%s: cannot write %s (%s)", self.name, path, e)

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        try:
            self.wait()
        finally:
            with quiet_orbax():
                self._mngr.close()


def _refit(store: CheckpointStore, step: int, like: Any, err: Exception) -> Fit:
    """After the restore of ``step`` onto ``like`` failed with ``err``: how to restore it
    (:func:`fit`, from the tree orbax saved; read only then, since it costs about as
    much as a third of a restore).

    Raises:
      CheckpointMismatchError: the tree differs outside the recorder states.
      Exception: ``err`` itself when the tree fits ``like`` or cannot be read (the
        checkpoint is corrupt).
    """
    try:
        with quiet_orbax():
            fitted = fit(_saved_tree(store.directory, step), like, step=int(step),
                         directory=str(store.directory), store=store.name)
    except CheckpointMismatchError:
        raise
    except Exception:  # noqa: BLE001 - unreadable metadata: the restore's own error stands
        raise err from None
    if fitted is None:
        raise err
    return fitted


def _saved_tree(directory: epath.Path, step: int) -> Any:
    """The tree checkpoint ``step`` holds as its ``state`` item, as orbax's metadata (dtypes,
    shapes; dicts and lists), read from its ``_METADATA`` file without the arrays."""
    handler = ocp.StandardCheckpointHandler()
    try:
        return handler.metadata(directory / str(int(step)) / "state").tree
    finally:
        handler.close()


def skip_message(store: "CheckpointStore", step: int, reason: str) -> str:
    """The one log line of a checkpoint that cannot be used: step, reason, what happens."""
    keep = (f"its files are kept for a post-mortem (the newest {store.keep_quarantined} "
            f"quarantined are kept) in {str(store.directory / str(int(step)))!r}"
            if store.keep_quarantined else "it is deleted at the next retention")
    return (f"{store.name}: checkpoint {int(step)} in {str(store.directory)!r} skipped: {reason}. "
            f"Quarantined: never restored, an older healthy checkpoint is used instead; {keep}.")


def _wait_at_exit(ref: "weakref.ref[CheckpointStore]") -> None:
    """Lets an in-flight asynchronous save land when the program exits."""
    store = ref()
    if store is None:
        return
    try:
        with quiet_orbax():
            store._mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - nothing left to raise to
        _log.error("%s: the last asynchronous save failed at exit: %s", store.name,
                   str(e).splitlines()[0][:200] if str(e) else type(e).__name__)


def _register_exit_wait(store: CheckpointStore) -> None:
    """Registers :func:`_wait_at_exit` to run before ``concurrent.futures`` shuts its pools."""
    ref = weakref.ref(store)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_wait_at_exit, ref)
            return
        except RuntimeError:   # interpreter already shutting down
            pass
    atexit.register(_wait_at_exit, ref)
