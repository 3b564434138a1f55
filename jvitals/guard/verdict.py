"""The verdict contract: what the guard reads of ``Monitor.update``'s result.

:class:`VerdictLike` is a runtime-checkable ``typing.Protocol`` that
:class:`jvitals.Verdict` satisfies; :meth:`jvitals.Rollback.act` checks it at the
door (:func:`check_verdict`: a TypeError naming what is missing), so the guard's
parts read the verdict's fields as attributes, with no probing.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from jvitals.monitor.types import Alert

__all__ = ["VERDICT_FIELDS", "VerdictLike", "check_verdict"]

VERDICT_FIELDS = ("level", "alerts", "closed_alerts", "scores", "onset_step")
"""The attributes the guard and the writers read of a verdict."""


@runtime_checkable
class VerdictLike(Protocol):
    """What the guard reads of a verdict (:class:`jvitals.Verdict` is one).

    Attributes:
      level: the verdict's level (an int-like :class:`jvitals.Level`).
      alerts: the open alerts after the check.
      closed_alerts: the alerts closed at the check.
      scores: floats to log (``monitor/*``).
      onset_step: the earliest onset among the alerts at the verdict's level (None: none).
    """

    @property
    def level(self) -> int: ...

    @property
    def alerts(self) -> Sequence[Alert]: ...

    @property
    def closed_alerts(self) -> Sequence[Alert]: ...

    @property
    def scores(self) -> Mapping[str, float]: ...

    @property
    def onset_step(self) -> int | None: ...


def check_verdict(verdict: Any, where: str = "Rollback.respond/act") -> None:
    """``verdict`` is None (GREEN) or a :class:`VerdictLike`; else a TypeError naming
    what came instead and the fields it lacks."""
    if verdict is None or isinstance(verdict, VerdictLike):
        return
    missing = [name for name in VERDICT_FIELDS if not hasattr(verdict, name)]
    what = f"{type(verdict).__name__} {verdict!r}"[:120]
    hint = (" (the verdict's level alone: a RED would be handled as GREEN)"
            if isinstance(verdict, (int, float, str)) else "")
    raise TypeError(f"{where} expects the Verdict that monitor.update(step, figures) returned "
                    f"(or None for GREEN), got {what}{hint}, which lacks {', '.join(missing)}; pass the "
                    "verdict itself: guard.respond(step, state, verdict, position)")
