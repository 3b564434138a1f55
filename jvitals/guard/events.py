"""The names the guard writes, and its one write call (the report reads the same names).

The guard (:class:`jvitals.Rollback` with ``writer=``) writes its own figures
(``rollback/count``, ``rollback/lr_scale``) and its events (``vitals/events_json``:
rollback, save, snapshot, pause, checkpoint_skipped, ...) through any object with
clu's writer methods, at its call's step, under names no other call writes.
:func:`jvitals.write` writes a user's events under the same tag. The names are
defined here, once, because the guard is the lowest layer that writes them; the
report (``jvitals.report``) imports them from here.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["EVENTS_TAG", "ROLLBACK_COUNT", "ROLLBACK_LR_SCALE", "json_default", "write_events"]

EVENTS_TAG = "vitals/events_json"
"""A JSON list of events (rollback, save, snapshot, pause, checkpoint_skipped, ...)."""
ROLLBACK_COUNT = "rollback/count"
"""Rollbacks so far (written by :class:`jvitals.Rollback` at each of its calls)."""
ROLLBACK_LR_SCALE = "rollback/lr_scale"
"""The learning-rate scale in force (1.0, then x0.9 per rollback)."""


def json_default(x: Any) -> Any:
    """``json.dumps(default=)`` for what events and alerts hold: NumPy scalars, objects
    with ``state_dict()`` (or, before it, ``to_dict()``), anything else as its ``str``."""
    if isinstance(x, (np.generic,)):
        return x.item()
    for name in ("state_dict", "to_dict"):
        method = getattr(x, name, None)
        if callable(method):
            return method()
    return str(x)


def events_json(events: Iterable[Mapping[str, Any]]) -> str:
    """The events as the JSON text written under :data:`EVENTS_TAG`."""
    return json.dumps([dict(e) for e in events], default=json_default)


def write_events(writer: Any, step: int, scalars: Mapping[str, float],
                 events: Iterable[Mapping[str, Any]] = ()) -> None:
    """Write the guard's scalars and events at ``step`` (one call per method).

    Args:
      writer: any object with clu's ``write_scalars`` and ``write_texts``.
      step: the training step of the guard's call.
      scalars: ``{name: float}``, e.g. ``{ROLLBACK_COUNT: 1.0, ROLLBACK_LR_SCALE: 0.9}``.
      events: dicts such as ``{"event": "rollback", "step": 420, "to_step": 300}``.
    """
    step = int(step)
    scalars = {k: float(v) for k, v in scalars.items()}
    events = list(events)
    if scalars:
        writer.write_scalars(step, scalars)
    if events:
        writer.write_texts(step, {EVENTS_TAG: events_json(events)})
