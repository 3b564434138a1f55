"""Writing a step's metrics, verdict and events to any clu ``MetricWriter``.

Everything is written in one call per step, so that clu's rule "a name is written at most
once per step" holds: the scalars (with ``vitals/level`` and the verdict's ``monitor/*``
scores), each per-layer family as one histogram ``{base}/by_layer``, the alerts as text
(``vitals/alerts``, ``vitals/alerts_json``) and the events (``vitals/events_json``). A
per-replica figure never becomes R scalars: its worst replica's robust z-score and index
are scalars, and the vectors one JSON text (``vitals/replicas_json``). The guard writes its
own figures and events through this function. The writer is any object with clu's writer
methods; jvitals never owns its lifecycle.

What each call writes, in detail: docs/REPORT.md, "What the writer writes".
"""

from __future__ import annotations

import json
import math
import operator
import re
from typing import Any, Iterable, Mapping, Protocol

import jax
import numpy as np

from jvitals.guard.events import EVENTS_TAG, ROLLBACK_COUNT, ROLLBACK_LR_SCALE, events_json, json_default
from jvitals.guard.verdict import VerdictLike
from jvitals.monitor.rules_replicas import REPLICA_PREFIX, replica_summaries, replica_vectors

__all__ = [
    "ALERTS_MD_TAG",
    "ALERTS_TAG",
    "EVENTS_TAG",
    "LEVEL_TAG",
    "MetricWriterLike",
    "REPLICAS_TAG",
    "ROLLBACK_COUNT",
    "ROLLBACK_LR_SCALE",
    "alerts_markdown",
    "write",
]

# The names jvitals writes, defined once (the report reads them by these constants);
# the guard's own (events, rollback figures) are defined in jvitals.guard.events.
LEVEL_TAG = "vitals/level"
"""The verdict's level, 0 GREEN .. 3 RED."""
ALERTS_TAG = "vitals/alerts_json"
"""A JSON list of the open and just-closed alerts."""
ALERTS_MD_TAG = "vitals/alerts"
"""The same alerts as markdown."""
REPLICAS_TAG = "vitals/replicas_json"
"""The per-replica vectors of a step, ``{"figures": {figure: [x_0, ..., x_{R-1}]}}`` (NaN as null)."""

_LAYER = re.compile(r"^(?P<base>.+)/layer_(?P<i>\d+)$")


class MetricWriterLike(Protocol):
    """The part of ``clu.metric_writers.MetricWriter`` that jvitals uses."""

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None: ...

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...

    def write_histograms(self, step: int, arrays: Mapping[str, Any],
                         num_buckets: Mapping[str, int] | None = None) -> None: ...


def _finite_or_none(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _alert_dict(alert: Any) -> dict[str, Any]:
    d = alert.state_dict() if hasattr(alert, "state_dict") else dict(vars(alert))
    level = getattr(alert, "level", d.get("level"))
    d["level"] = getattr(level, "name", str(level))
    if "localization" in d:
        d["localization"] = [loc.get("line", str(loc)) if isinstance(loc, dict) else str(loc)
                             for loc in d["localization"]]
    return {k: _finite_or_none(v) for k, v in d.items()}


def alerts_markdown(alerts: Iterable[Any]) -> str:
    """Alerts as a markdown list: level, step, metric, message, then the localization."""
    lines = []
    for a in alerts:
        d = _alert_dict(a)
        lines.append(f"- **{d['level']}** step {d.get('step')} `{d.get('metric')}` ({d.get('rule')}): "
                     f"{d.get('message', '')}")
        lines += [f"  - {loc}" for loc in d.get("localization") or []]
    return "\n".join(lines)


def _check_write(writer: Any, step: Any, metrics: Any, verdict: Any, events: Any) -> int:
    """:func:`write`'s arguments, each a clear error; the step as an int."""
    if isinstance(writer, type) or not callable(getattr(writer, "write_scalars", None)):
        raise TypeError(f"write: writer must be a clu MetricWriter instance (with write_scalars), got "
                        f"{type(writer).__name__} {writer!r:.40}; the order is write(writer, step, metrics, verdict)")
    try:
        step = None if isinstance(step, (bool, np.bool_)) else operator.index(step)
    except TypeError:
        step = None
    if step is None:
        raise TypeError("write: step must be an int (the training step); the order is write(writer, step, metrics)")
    if not isinstance(metrics, Mapping):
        raise TypeError(f"write: metrics must be a {{name: value}} mapping, got {type(metrics).__name__}")
    if verdict is not None and not (hasattr(verdict, "level") and hasattr(verdict, "alerts")):
        raise TypeError(f"write: verdict must be the Verdict monitor.update returned (or None), got "
                        f"{type(verdict).__name__} {verdict!r:.40}: its level alone would lose the alerts")
    if isinstance(events, Mapping) or isinstance(events, str):
        raise TypeError(f"write: events must be a list of dicts (e.g. response.events), got one "
                        f"{type(events).__name__}: wrap it, events=[...]")
    return step


def write(writer: MetricWriterLike, step: int, metrics: Mapping[str, Any], verdict: VerdictLike | None = None, *,
          events: Iterable[Mapping[str, Any]] | None = (), histograms: bool = True) -> None:
    """Write one step's metrics, verdict and events through a clu writer.

    Args:
      writer: a clu ``MetricWriter`` (or anything with its ``write_*`` methods).
      step: the training step.
      metrics: a flat ``{name: value}`` dict; device arrays are fetched here (one
        ``jax.device_get``), scalars are written as scalars, arrays as histograms.
      verdict: a :class:`jvitals.Verdict` (optional).
      events: dicts such as ``{"event": "rollback", "step": 420, "to_step": 300}``
        (None or empty: none).
      histograms: also write per-layer families as ``{base}/by_layer`` histograms.

    Raises:
      TypeError: if a metric value is not numeric (names the metric); a writer, step,
        metrics, verdict or events of the wrong kind (e.g. the arguments swapped, a
        verdict's level alone, one event dict instead of a list of them).
    """
    step = _check_write(writer, step, metrics, verdict, events)
    host = jax.device_get(dict(metrics))
    replicas = replica_vectors(host)
    if replicas:
        host = {k: v for k, v in host.items() if not k.startswith(REPLICA_PREFIX)}
    scalars: dict[str, float] = {}
    arrays: dict[str, np.ndarray] = {}
    layers: dict[str, dict[int, float]] = {}
    for name, value in host.items():
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"metric {name!r} must be numeric, got {type(value).__name__} {value!r}")
        if arr.ndim == 0:
            scalars[name] = float(arr)
            m = _LAYER.match(name)
            if m:
                layers.setdefault(m["base"], {})[int(m["i"])] = float(arr)
        else:
            arrays[name] = arr.astype(np.float64)
    texts: dict[str, str] = {}
    if replicas:
        scalars.update(replica_summaries(replicas))
        texts[REPLICAS_TAG] = json.dumps({"figures": {
            f: [x if math.isfinite(x) else None for x in v.tolist()] for f, v in replicas.items()}})
    if verdict is not None:
        scalars[LEVEL_TAG] = float(int(verdict.level))
        for k, v in (getattr(verdict, "scores", None) or {}).items():
            scalars[k] = float(v)
        shown = list(getattr(verdict, "alerts", [])) + list(getattr(verdict, "closed_alerts", []))
        if shown:
            texts[ALERTS_MD_TAG] = alerts_markdown(shown)
            texts[ALERTS_TAG] = json.dumps([_alert_dict(a) for a in shown], default=json_default)
    events = [dict(e) for e in (events or ())]
    if events:
        texts[EVENTS_TAG] = events_json(events)
    if histograms:
        for base, per in layers.items():
            if len(per) >= 2:
                arrays[f"{base}/by_layer"] = np.array([per[i] for i in sorted(per)], np.float64)
    if scalars:
        writer.write_scalars(step, scalars)
    if arrays:
        finite = {k: v[np.isfinite(v)] for k, v in arrays.items()}
        finite = {k: v for k, v in finite.items() if v.size}
        if finite:
            writer.write_histograms(step, finite)
    if texts:
        writer.write_texts(step, texts)
