"""Preemption: the notice that the machine goes away, turned into a save at the next step boundary.

Spot VMs and preemptible TPUs get SIGTERM and about 30 s before they stop; a job
scheduler (Slurm, Kubernetes) sends SIGTERM before SIGKILL. :class:`Preemption`
watches for that notice and :meth:`jvitals.Rollback.preempted`, which the loop calls
at the end of every step, asks it: on a notice the guard saves the state, the data
position and the monitor's state as checkpoint ``step`` (kind :data:`PREEMPT`),
waits until it is committed and returns True; a restart's ``resume`` continues from
it, no step computed twice. Where the notice comes from (a signal handler on one
process, JAX's preemption service on several) is in docs/GUARD.md, "Preemption".
"""


from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable, Sequence

import jax


__all__ = ["PREEMPT", "Preemption", "save_on_notice"]

_log = logging.getLogger("jvitals.guard.rollback")

PREEMPT = "preempt"
"""The kind of the checkpoint a preemption saves (:meth:`jvitals.Rollback.preempted`)."""


class Preemption:
    """Watches for a preemption notice (see module doc).

    Args:
      signals: the signals that mean "preempted" on one process (default SIGTERM;
        Slurm's ``--signal=USR1@60`` wants ``(signal.SIGTERM, signal.SIGUSR1)``).

    Attributes:
      notice: what the notice was (``'SIGTERM'``, ``'jax preemption notice'``, a
        :meth:`notify` reason), or None while there was none.
      source: ``'signal'`` (one process), ``'jax'`` (JAX's service), ``'off'``
        (no notice can arrive), or None before the first :meth:`reached`.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        if isinstance(signals, (int, str)) or not hasattr(signals, "__iter__"):
            raise TypeError(f"Preemption expects a sequence of signals, e.g. (signal.SIGTERM,), got {signals!r}")
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("Preemption expects at least one signal, got none")
        self.notice: str | None = None
        self.source: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def reached(self, step: int) -> bool:
        """True when the loop should save now and stop: the same answer, at the same
        step, on every process. Cheap: a flag read (one process) or JAX's local
        sync-point check (several; no collective).

        Args:
          step: the step just done (consecutive steps, the same on every process).

        Returns:
          True once a notice arrived (one process), or at the agreed step (several).
        """
        if self.source is None:
            self.source = self._start()
        if self.source == "jax":
            try:
                hit = self._jax_sync_point(int(step))
            except RuntimeError as e:      # the service is off: said once, then never asked again
                self.source = "off"
                _log.warning("Rollback: no preemption saves on these %d processes: JAX's preemption "
                             "service is off (%s); expected jax.distributed.initialize with "
                             "jax_enable_preemption_service=True (the default).", jax.process_count(), e)
                return False
            if hit:
                self.notice = self.notice or "jax preemption notice"
            return hit
        return self.notice is not None

    def notify(self, reason: str = "notify()") -> None:
        """A preemption notice from code (one process): the next :meth:`reached` is True."""
        if self.notice is None:
            self.notice = str(reason)

    def close(self) -> None:
        """Puts back the signal handlers that were there before (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- Internals. --------------------------------------------------

    def _start(self) -> str:
        """Chooses where the notice comes from (see module doc) and installs the handlers."""
        if jax.process_count() > 1:
            return "jax"
        if threading.current_thread() is not threading.main_thread():
            _log.warning("Rollback: no preemption saves: signal handlers can only be installed from "
                         "the main thread, and guard.preempted() was first called from %r. Call it "
                         "from the main thread (the training loop's).", threading.current_thread().name)
            return "off"
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)
        return "signal"

    @staticmethod
    def _jax_sync_point(step: int) -> bool:
        from jax.experimental import multihost_utils
        return bool(multihost_utils.reached_preemption_sync_point(step))

    def _handler(self, signum: int, frame: Any) -> None:
        """Records the first notice (nothing else: it runs between two bytecodes of the
        loop) and calls a Python handler that was installed before."""
        if self.notice is None:
            self.notice = signal.Signals(signum).name
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)


def save_on_notice(step: int, save: Callable[[], Any], settle: Callable[[], None], *, store: Any,
                   notice: str | None, position: Any) -> dict[str, Any]:
    """The save of a preemption notice at ``step`` (see :meth:`jvitals.Rollback.preempted`).

    Calls ``save()`` unless ``store`` holds a usable checkpoint of ``step`` (the one
    ``respond`` saved at it), then ``settle()`` (the save committed, or its failure
    reported); logs one line.

    Returns:
      The ``preempt`` event.
    """
    t0 = time.monotonic()
    rec = store.records.get(step)
    if rec is None or rec.quarantined is not None:
        save()
    settle()
    saved = step in store.records
    took = time.monotonic() - t0
    if saved:
        _log.warning("Rollback: preemption notice (%s) at step %d: checkpoint %d (state, data "
                     "position %r, monitor) is committed in %r (%.1f s). Stop the loop; a restart's "
                     "resume() continues from step %d.", notice, step, step, position,
                     str(store.directory), took, step + 1)
    else:
        _log.warning("Rollback: preemption notice (%s) at step %d: its checkpoint could not be "
                     "saved (the error above). Stop the loop; a restart's resume() continues from "
                     "the newest healthy checkpoint.", notice, step)
    return {"event": "preempt", "step": step, "notice": notice,
            "saved_step": step if saved else None, "seconds": round(took, 3)}
