"""orbax's asyncio noise, held back: the guard logs one line of its own per failed checkpoint.

orbax runs its reads and writes as asyncio tasks on background threads; a failed
checkpoint makes them log tracebacks on the ``asyncio`` and ``absl`` loggers (and,
for a restore's late reads, raise ``RuntimeError('Event loop is closed')`` into
``sys.unraisablehook``). :func:`quiet_orbax` and the filter and hook installed by
:class:`jvitals.guard.checkpoints.CheckpointStore` count them instead of printing
them; :func:`one_line` shortens an orbax/tensorstore error to the line the guard logs.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Iterator

__all__ = ["install_log_filter", "install_unraisablehook", "one_line", "quiet_orbax"]

_log = logging.getLogger("jvitals.guard.checkpoints")




class _OrbaxNoise(logging.Filter):
    """Drops log records carrying an orbax/asyncio traceback (counted, not printed)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0
        self.late_reads = 0   # closed-loop errors of late reads (see _install_unraisablehook)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        tb = record.exc_info[2] if record.exc_info else None
        files = []
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        exc_text = str(record.exc_info[1]) if record.exc_info and record.exc_info[1] is not None else ""
        if any("orbax" in f or "tensorstore" in f for f in files) \
                or ("orbax" in text and record.levelno >= logging.ERROR) \
                or (_never_retrieved(text) and ("orbax" in text + exc_text or "tensorstore" in text + exc_text)) \
                or "Event loop is closed" in text + exc_text and any("asyncio" in f for f in files):
            self.dropped += 1
            _log.debug("orbax: %s", text.splitlines()[0][:200] if text else "(no message)")
            return False
        return True


def _never_retrieved(text: str) -> bool:
    """asyncio's log of a task or future garbage-collected with its exception unread (a
    restore's late reads: a failed read's sibling futures, see :func:`_is_closed_loop_error`)."""
    return "Task exception was never retrieved" in text or "Future exception was never retrieved" in text


_NOISE = _OrbaxNoise()
_NOISE_LOGGERS = ("asyncio", "absl")


def _is_closed_loop_error(exc: BaseException | None, tb: Any) -> bool:
    """``RuntimeError('Event loop is closed')`` raised by asyncio's ``call_soon_threadsafe``.

    Root cause: orbax runs a restore's reads as asyncio tasks on a fresh event
    loop (``asyncio_utils._run_sync_via_new_loop``: ``run_until_complete`` then
    ``close``). When one read fails, the gather raises and the loop is closed
    with the other reads' tasks still pending; their tensorstore futures keep
    going, and when each completes, tensorstore's ``__await__`` callback calls
    ``loop.call_soon_threadsafe`` on the closed loop. tensorstore's C++ callback
    runner reports that ``RuntimeError`` with ``PyErr_WriteUnraisable(nullptr)``:
    it reaches ``sys.unraisablehook`` (not ``sys.excepthook``), whose default
    prints a bare traceback to stderr: one per late read.
    """
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return bool(names) and names[0] == "call_soon_threadsafe"


def _install_unraisablehook() -> None:
    """Holds back the closed-loop errors of :func:`_is_closed_loop_error` (once).

    Everything else goes to the hook that was installed before (by default,
    Python's, which prints it).
    """
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_jvitals_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if _is_closed_loop_error(unraisable.exc_value, unraisable.exc_traceback):
            _NOISE.dropped += 1
            _NOISE.late_reads += 1
            return
        previous(unraisable)

    hook._jvitals_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _install_log_filter() -> None:
    """Keeps :class:`_OrbaxNoise` on the ``asyncio`` and ``absl`` loggers (orbax's
    background threads log there after the call that started them returned)."""
    for name in _NOISE_LOGGERS:
        lg = logging.getLogger(name)
        if _NOISE not in lg.filters:
            lg.addFilter(_NOISE)


@contextlib.contextmanager
def quiet_orbax() -> Iterator[_OrbaxNoise]:
    """Captures orbax's asyncio tracebacks (``asyncio`` and ``absl`` loggers) inside the block.

    The caller logs one line of its own per failed checkpoint instead. Yields the
    filter (``.dropped`` counts the records held back).
    """
    loggers = [logging.getLogger(n) for n in _NOISE_LOGGERS]
    added = [lg for lg in loggers if _NOISE not in lg.filters]
    for lg in added:
        lg.addFilter(_NOISE)
    try:
        yield _NOISE
    finally:
        for lg in added:
            lg.removeFilter(_NOISE)


def one_line(err: BaseException, limit: int = 300) -> str:
    """``err``'s first line, at most ``limit`` characters: its start and its end.

    tensorstore nests its causes (``Error opening "zarr" driver: ... Error reading
    byte range ... of local file ...: <cause>``): the end names the cause.
    """
    text = str(err).splitlines()[0] if str(err) else ""
    # tensorstore appends payloads: [tensorstore_spec='{...}'] [source locations='...'].
    text = re.split(r" \[(?:tensorstore_spec|source locations)", text, maxsplit=1)[0]
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5):]}"


install_unraisablehook = _install_unraisablehook
install_log_filter = _install_log_filter
