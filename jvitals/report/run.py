"""Reading a run back: every TensorBoard event file under a log directory, into a :class:`Run`.

TF2 summaries are tensor events; every file is read in full (no reservoir sampling)
with tensorboard's ``EventFileLoader``. When a step is written twice (a run
restarted or rolled back onto old step numbers), the value written last wins and the
earlier one is kept in ``Run.superseded``. Alerts are merged by their id (one entry
per alert, with the message logged at its peak level), events deduplicated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

import numpy as np

from jvitals.report.writers import (
    ALERTS_TAG,
    EVENTS_TAG,
    LEVEL_TAG,
    ROLLBACK_COUNT as ROLLBACKS_TAG,
)

__all__ = [
    "LEVEL_NAMES",
    "read_run",
    "Run",
    "run_name",
]


LEVEL_NAMES = ("GREEN", "YELLOW", "ORANGE", "RED")
_GENERIC_DIRS = frozenset({"logs", "log", "tb", "tensorboard", "events", "summaries", "summary",
                           "train", "metrics", "runs"})
_LAYER_RE = re.compile(r"layer_(\d+)$")

@dataclasses.dataclass
class Run:
    """Everything read back from one log directory.

    Attributes:
        logdir: the directory read.
        files: the event files read, relative to ``logdir``.
        scalars: ``{tag: (steps int64[n], values float64[n])}``, sorted by step,
            one value per step (the one written last); NaN/Inf kept as written.
        superseded: ``{tag: (steps, values)}`` of values overwritten by a later
            write at the same step (e.g. the abandoned branch before a rollback).
        texts: ``{tag: [(step, text), ...]}`` in write order.
        alerts: the monitor's alerts (``vitals/alerts_json``), one per alert
            (an alert logged again at later steps is merged: latest fields, peak
            level kept in ``'peak_level'``), normalised: ``level`` is a name,
            numbers are floats (NaN when missing), ``localization`` is a list of
            strings, ``logged_step`` is the first step it was logged at.
        events: the guard's events (``vitals/events_json``), de-duplicated, by step.
        hparams: hyper-parameters logged with ``write_hparams``, if any.
        warnings: problems met while reading (unreadable files, bad JSON).
    """

    logdir: str
    files: list[str]
    scalars: dict[str, tuple[np.ndarray, np.ndarray]]
    superseded: dict[str, tuple[np.ndarray, np.ndarray]]
    texts: dict[str, list[tuple[int, str]]]
    alerts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    hparams: dict[str, Any]
    warnings: list[str]

    def series(self, tag: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(steps, values)`` of a scalar tag, or ``None`` if it was not logged."""
        return self.scalars.get(tag)

    @property
    def first_step(self) -> int | None:
        steps = [int(s[0]) for s, _ in self.scalars.values() if len(s)]
        steps += [int(t[0][0]) for t in self.texts.values() if t]
        return min(steps) if steps else None

    @property
    def last_step(self) -> int | None:
        steps = [int(s[-1]) for s, _ in self.scalars.values() if len(s)]
        steps += [max(int(x[0]) for x in t) for t in self.texts.values() if t]
        return max(steps) if steps else None

    def layer_tags(self, prefix: str) -> list[tuple[int, str]]:
        """``[(i, tag)]`` for tags ``{prefix}layer_{i}``, in layer order (not string order)."""
        out = []
        for tag in self.scalars:
            if tag.startswith(prefix):
                m = _LAYER_RE.fullmatch(tag[len(prefix):])
                if m:
                    out.append((int(m.group(1)), tag))
        return sorted(out)

    def rollbacks(self) -> list[dict[str, Any]]:
        """Rollbacks: the ``rollback`` events, else the steps where ``rollback/count`` rose."""
        rb = [e for e in self.events if e.get("event") == "rollback" and is_int(e.get("step"))]
        if rb:
            return rb
        s = self.series(ROLLBACKS_TAG)
        if s is None:
            return []
        out, prev = [], 0.0
        for step, v in zip(*s):
            if np.isfinite(v) and v > prev:
                out.append({"event": "rollback", "step": int(step), "inferred": True})
                prev = float(v)
        return out

    @property
    def num_rollbacks(self) -> int:
        n = len(self.rollbacks())
        s = self.series(ROLLBACKS_TAG)
        if s is not None and np.isfinite(s[1]).any():
            n = max(n, int(np.nanmax(s[1])))
        return n

    def level_periods(self) -> list[tuple[int, int, str]]:
        """``[(start, end, level_name)]``: each checked level holds until the next check.

        From ``vitals/level``; without it, from the alerts (``onset_step`` or the
        logged step, to the alert's last step). Adjacent equal levels are merged.
        """
        last = self.last_step
        s = self.series(LEVEL_TAG)
        periods: list[tuple[int, int, str]] = []
        if s is not None:
            steps, vals = s
            ok = np.isfinite(vals)
            steps, vals = steps[ok], vals[ok]
            for i, (st, v) in enumerate(zip(steps, vals)):
                end = int(steps[i + 1]) if i + 1 < len(steps) else int(max(last or st, st))
                name = LEVEL_NAMES[int(np.clip(round(v), 0, 3))]
                if periods and periods[-1][2] == name and periods[-1][1] == int(st):
                    periods[-1] = (periods[-1][0], end, name)
                else:
                    periods.append((int(st), end, name))
            return periods
        for a in self.alerts:
            lo = a.get("onset_step") if is_int(a.get("onset_step")) else a.get("logged_step")
            hi = a.get("step") if is_int(a.get("step")) else lo
            if is_int(lo):
                periods.append((int(lo), int(max(hi, lo)), a["peak_level"]))
        return sorted(periods)

    @property
    def final_level(self) -> str:
        s = self.series(LEVEL_TAG)
        if s is not None:
            vals = s[1][np.isfinite(s[1])]
            if len(vals):
                return LEVEL_NAMES[int(np.clip(round(vals[-1]), 0, 3))]
        return "unknown"


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _event_files(logdir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(logdir):
        for n in names:
            if "tfevents" in n:
                out.append(os.path.join(root, n))
    return sorted(out)


def _to_float(x) -> float:
    if x is None:
        return math.nan
    try:
        return float(x)  # also "nan", "inf", "-inf"
    except (TypeError, ValueError):
        return math.nan


def to_int(x):
    if is_int(x):
        return int(x)
    if isinstance(x, float) and math.isfinite(x) and x == int(x):
        return int(x)
    if isinstance(x, str) and re.fullmatch(r"-?\d+", x.strip()):
        return int(x)
    return None


def _normalize_alert(d: Mapping[str, Any], logged_step: int) -> dict[str, Any]:
    level = d.get("level")
    if is_int(level) or isinstance(level, float):
        level = LEVEL_NAMES[int(np.clip(level, 0, 3))] if math.isfinite(level) else "unknown"
    elif isinstance(level, str) and level.strip().upper() in LEVEL_NAMES:
        level = level.strip().upper()
    else:
        level = "unknown" if level is None else str(level)
    loc = d.get("localization") or []
    if isinstance(loc, (str, dict)):
        loc = [loc]
    loc_lines = []
    for x in loc:
        if isinstance(x, Mapping):
            loc_lines.append(str(x.get("line") or x.get("metric") or json.dumps(x, sort_keys=True)))
        else:
            loc_lines.append(str(x))
    out = dict(d)
    out.update(
            level=level,
            rule=str(d.get("rule", "")),
            metric=str(d.get("metric", "")),
            step=to_int(d.get("step")) if d.get("step") is not None else logged_step,
            onset_step=to_int(d.get("onset_step")),
            value=_to_float(d.get("value")),
            baseline=_to_float(d.get("baseline")),
            ratio=_to_float(d.get("ratio")),
            message=str(d.get("message", "")),
            cause=str(d.get("cause", "")),
            prescription=str(d.get("prescription", "")),
            localization=loc_lines,
            logged_step=logged_step,
    )
    if out["step"] is None:
        out["step"] = logged_step
    return out


_PEAK_FIELDS = ("message", "cause", "prescription", "value", "baseline", "ratio", "metric")
"""Fields an alert row shows from the record logged at its peak level."""


def run_name(logdir: str | os.PathLike) -> str:
    """The run's name from its log directory: the folder's name, or its parent's when
    the folder has a generic name (``runs/quickstart/logs`` -> ``quickstart``)."""
    parts = [p for p in os.path.abspath(os.fspath(logdir)).split(os.sep) if p]
    while len(parts) > 1 and parts[-1].lower() in _GENERIC_DIRS:
        parts.pop()
    return parts[-1] if parts else os.fspath(logdir)


def _level_rank(name: str) -> int:
    return LEVEL_NAMES.index(name) if name in LEVEL_NAMES else -1


def _parse_json_records(records, tag, warnings) -> list[tuple[int, Any]]:
    out = []
    for step, text in records:
        try:
            obj = json.loads(text)
        except (TypeError, ValueError) as e:
            warnings.append(f"{tag} at step {step}: not valid JSON ({e}); shown under 'other texts'")
            continue
        if isinstance(obj, Mapping):
            obj = [obj]
        if not isinstance(obj, list):
            warnings.append(f"{tag} at step {step}: expected a JSON list, got {type(obj).__name__}")
            continue
        out.extend((step, x) for x in obj if isinstance(x, Mapping))
    return out


def read_run(logdir: str | os.PathLike) -> Run:
    """Reads all TensorBoard event files under ``logdir`` (recursively).

    Scalars are TF2 tensor events of the ``scalars`` plugin (or any numeric
    single-element tensor, or a TF1 ``simple_value``); texts are string tensors.
    Histograms and unknown plugins are skipped. Unreadable files are reported in
    ``Run.warnings``, not raised.

    Args:
        logdir: a directory written by a clu ``MetricWriter`` (any depth).

    Returns:
        A :class:`Run`.

    Raises:
        FileNotFoundError: ``logdir`` does not exist.
    """
    logdir = os.fspath(logdir)
    if not os.path.isdir(logdir):
        raise FileNotFoundError(f"Expected a log directory, got {logdir!r}, which is not a directory")
    warnings: list[str] = []
    files = _event_files(logdir)
    num, txt, hparams = _load_events(files, logdir, warnings)
    scalars, superseded = _last_value_per_step(num)
    texts = {tag: [(step, s) for _, _, step, s in sorted(recs)] for tag, recs in txt.items()}
    alerts = _merge_alerts(_parse_json_records(texts.get(ALERTS_TAG, []), ALERTS_TAG, warnings))
    events = _unique_events(_parse_json_records(texts.get(EVENTS_TAG, []), EVENTS_TAG, warnings))
    return Run(logdir=logdir, files=[os.path.relpath(f, logdir) for f in files], scalars=scalars,
               superseded=superseded, texts=texts, alerts=alerts, events=events,
               hparams=hparams, warnings=warnings)


def _load_events(files: list[str], logdir: str, warnings: list[str]):
    """Every summary value of every file: numbers and texts by tag as ``(wall_time, seq,
    step, value)`` records (``seq`` orders records written at the same wall time), and
    the hparams. A truncated or corrupt file stops its own reading, with a warning."""
    from tensorboard.backend.event_processing import event_file_loader

    num: dict[str, list[tuple[float, int, int, float]]] = {}
    txt: dict[str, list[tuple[float, int, int, str]]] = {}
    hparams: dict[str, Any] = {}
    seq = 0
    for path in files:
        try:
            for ev in event_file_loader.EventFileLoader(path).Load():
                if not ev.HasField("summary"):
                    continue
                for v in ev.summary.value:
                    seq += 1
                    _read_value(v, (ev.wall_time, seq, int(ev.step)), num, txt, hparams, warnings)
        except Exception as e:  # noqa: BLE001 - truncated/corrupt files happen in crashed runs
            warnings.append(f"{os.path.relpath(path, logdir)}: stopped reading ({type(e).__name__}: {e})")
    return num, txt, hparams


def _read_value(v, key: tuple[float, int, int], num: dict, txt: dict, hparams: dict,
                warnings: list[str]) -> None:
    """One summary value into ``num`` (a number), ``txt`` (a string) or ``hparams``;
    histograms, images and the like are skipped."""
    from tensorboard.util import tensor_util

    plugin = v.metadata.plugin_data.plugin_name
    if v.HasField("simple_value"):
        num.setdefault(v.tag, []).append((*key, float(v.simple_value)))
        return
    if not v.HasField("tensor"):
        return
    if plugin == "hparams":
        _read_hparams(v, hparams)
        return
    if plugin in ("histograms", "images", "audio", "pr_curves", "graph_keras_model"):
        return
    try:
        arr = tensor_util.make_ndarray(v.tensor)
    except Exception as e:  # noqa: BLE001 - a bad record must not stop the report
        warnings.append(f"{v.tag} at step {key[2]}: unreadable tensor ({e})")
        return
    if arr.dtype.kind in "SOU":
        parts = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in np.ravel(arr)]
        txt.setdefault(v.tag, []).append((*key, "\n".join(parts)))
    elif arr.dtype.kind in "biuf" and arr.size == 1:
        num.setdefault(v.tag, []).append((*key, float(arr.reshape(()))))


def _last_value_per_step(num: Mapping[str, list]) -> tuple[dict, dict]:
    """Per tag, ``(steps, values)`` with the value written last at each step, and the
    values it superseded (a restart or rollback writing onto old step numbers)."""
    scalars, superseded = {}, {}
    for tag, recs in num.items():
        recs.sort()
        by_step: dict[int, float] = {}
        old_s, old_v = [], []
        for _, _, step, val in recs:
            if step in by_step:
                old_s.append(step)
                old_v.append(by_step[step])
            by_step[step] = val
        steps = np.array(sorted(by_step), dtype=np.int64)
        scalars[tag] = (steps, np.array([by_step[s] for s in steps], dtype=np.float64))
        if old_s:
            superseded[tag] = (np.array(old_s, dtype=np.int64), np.array(old_v, dtype=np.float64))
    return scalars, superseded


def _merge_alerts(records: list[tuple[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per alert (by its ``id``, else rule, metric and onset), holding its peak
    level and the fields logged at that peak (the latest record at it), in logged order."""
    alerts: dict[Any, dict[str, Any]] = {}
    for step, d in records:
        a = _normalize_alert(d, step)
        if "id" in d and d["id"] is not None:
            key = ("id", str(d["id"]))
        else:
            key = (a["rule"], a["metric"], a["onset_step"] if a["onset_step"] is not None else a["step"])
        logged_peak = d.get("peak_level")
        if is_int(logged_peak) and 0 <= logged_peak <= 3:
            logged_peak = LEVEL_NAMES[logged_peak]
        if not (isinstance(logged_peak, str) and logged_peak.upper() in LEVEL_NAMES):
            logged_peak = a["level"]
        a["peak_level"] = max(logged_peak.upper(), a["level"], key=_level_rank)
        prev = alerts.get(key)
        at_peak = {k: a[k] for k in _PEAK_FIELDS}
        if prev is None:
            a["peak"] = at_peak if a["level"] == a["peak_level"] else None
        else:
            peak = max(prev["peak_level"], a["peak_level"], key=_level_rank)
            a["logged_step"] = prev["logged_step"]
            a["peak_level"] = peak
            # The record logged at the peak level (the latest one at that level).
            a["peak"] = at_peak if a["level"] == peak else prev.get("peak")
        alerts[key] = a
    for a in alerts.values():
        if a.get("peak"):
            a.update(a.pop("peak"))
        else:
            a.pop("peak", None)
    return sorted(alerts.values(), key=lambda a: (a["logged_step"], -_level_rank(a["peak_level"])))


def _unique_events(records: list[tuple[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The events, each once (a record written twice counts once), by step."""
    events, seen = [], set()
    for step, d in records:
        k = json.dumps(d, sort_keys=True, default=str)
        if k in seen:
            continue
        seen.add(k)
        e = dict(d)
        st = to_int(e.get("step"))
        e["step"] = st if st is not None else step
        e["event"] = str(e.get("event", "event"))
        events.append(e)
    events.sort(key=lambda e: e["step"])
    return events


def _read_hparams(value, out: dict[str, Any]) -> None:
    try:
        from tensorboard.plugins.hparams import plugin_data_pb2

        data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
        if data.HasField("session_start_info"):
            for k, v in data.session_start_info.hparams.items():
                kind = v.WhichOneof("kind")
                out[k] = getattr(v, kind) if kind else None
    except Exception:  # noqa: BLE001 - hparams are optional decoration
        pass
