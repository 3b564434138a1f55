"""Offline report of a training run's vital signs, read from TensorBoard event files.

Reads every event file under a log directory (written by any clu ``MetricWriter``,
e.g. ``clu.metric_writers.create_default_writer``), and builds one self-contained
HTML file: a level timeline with rollbacks, one plot per metric family with the
yellow/orange/red periods shaded, a per-layer gradient-share heat map, a
replica x step heat map of each per-replica figure (``vitals/replicas_json``), the
monitor's alerts with diagnosis and prescription, and the source guide's check-up
table (``seeds/003``, §6.2) for the run's phase.

The reading and plotting pieces are public so that a notebook can use them::

    run = read_run("/tmp/logdir")
    steps, values = run.scalars["loss"]
    plot_family(run, "grad_norm")          # a new pyplot figure when no ax is given
    for item in checkup(run):
        print(item.phase, item.status, item.text, item.figure)

Phase rule (:func:`run_phase`), from the guide's check-up table: *start-up* is
steps 0-1000; *middle* is from step 1000 to the middle of training; *late* is
the second half of training. With ``total_steps`` (the planned length, from
``--total-steps`` or a logged hparam ``total_steps``/``num_steps``/
``num_train_steps``/``train_steps``) a run whose last logged step is past
``total_steps / 2`` is *late*; without it, a run past step 1000 is *middle*
(its length so far is all we know). ``--phase`` overrides the rule.

Reading notes: TF2 summaries are tensor events; every file is read in full (no
reservoir sampling) with tensorboard's ``EventFileLoader``. When a step is
written twice (a run restarted or rolled back onto old step numbers), the value
written last wins and the earlier one is kept in ``Run.superseded``.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import html
import io
import json
import math
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
        "CheckItem",
        "FAMILIES",
        "Family",
        "LEVEL_NAMES",
        "PHASES",
        "Run",
        "build_html",
        "checkup",
        "plot_family",
        "plot_layer_heatmap",
        "plot_replica_heatmap",
        "replica_matrices",
        "plot_timeline",
        "read_run",
        "remedy_texts",
        "run_phase",
        "write_report",
]

LEVEL_NAMES = ("GREEN", "YELLOW", "ORANGE", "RED")
LEVEL_COLORS = {"GREEN": "#2e9d4f", "YELLOW": "#f2c12e", "ORANGE": "#f08a24", "RED": "#d62d20"}
PHASES = ("start-up", "middle", "late")
STARTUP_END = 1000  # the guide: start-up is steps 0-1000.
# The names the library writes, read by the same constants (jvitals.writers defines them).
from jvitals.report.writers import (  # noqa: E402
    ALERTS_MD_TAG,  # the same alerts as markdown: shown only without the JSON
    ALERTS_TAG,
    EVENTS_TAG,
    LEVEL_TAG,
    REPLICAS_TAG,
    ROLLBACK_COUNT as ROLLBACKS_TAG,
    ROLLBACK_LR_SCALE as LR_SCALE_TAG,
)
_GENERIC_DIRS = frozenset({"logs", "log", "tb", "tensorboard", "events", "summaries", "summary",
                           "train", "metrics", "runs"})
_TOTAL_STEP_HPARAMS = ("total_steps", "num_steps", "num_train_steps", "train_steps", "steps")
_LAYER_RE = re.compile(r"layer_(\d+)$")


# --------------------------------------------------------------------------
# Reading.
# --------------------------------------------------------------------------


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
        rb = [e for e in self.events if e.get("event") == "rollback" and _is_int(e.get("step"))]
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
            lo = a.get("onset_step") if _is_int(a.get("onset_step")) else a.get("logged_step")
            hi = a.get("step") if _is_int(a.get("step")) else lo
            if _is_int(lo):
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


def _is_int(x) -> bool:
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


def _to_int(x):
    if _is_int(x):
        return int(x)
    if isinstance(x, float) and math.isfinite(x) and x == int(x):
        return int(x)
    if isinstance(x, str) and re.fullmatch(r"-?\d+", x.strip()):
        return int(x)
    return None


def _normalize_alert(d: Mapping[str, Any], logged_step: int) -> dict[str, Any]:
    level = d.get("level")
    if _is_int(level) or isinstance(level, float):
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
            step=_to_int(d.get("step")) if d.get("step") is not None else logged_step,
            onset_step=_to_int(d.get("onset_step")),
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
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.util import tensor_util

    logdir = os.fspath(logdir)
    if not os.path.isdir(logdir):
        raise FileNotFoundError(f"Expected a log directory, got {logdir!r}, which is not a directory")
    warnings: list[str] = []
    num: dict[str, list[tuple[float, int, int, float]]] = {}
    txt: dict[str, list[tuple[float, int, int, str]]] = {}
    hparams: dict[str, Any] = {}
    seq = 0
    files = _event_files(logdir)
    for path in files:
        try:
            for ev in event_file_loader.EventFileLoader(path).Load():
                if not ev.HasField("summary"):
                    continue
                for v in ev.summary.value:
                    seq += 1
                    plugin = v.metadata.plugin_data.plugin_name
                    key = (ev.wall_time, seq, int(ev.step))
                    if v.HasField("simple_value"):
                        num.setdefault(v.tag, []).append((*key, float(v.simple_value)))
                        continue
                    if not v.HasField("tensor"):
                        continue
                    if plugin == "hparams":
                        _read_hparams(v, hparams)
                        continue
                    if plugin in ("histograms", "images", "audio", "pr_curves", "graph_keras_model"):
                        continue
                    try:
                        arr = tensor_util.make_ndarray(v.tensor)
                    except Exception as e:  # noqa: BLE001 - a bad record must not stop the report
                        warnings.append(f"{v.tag} at step {ev.step}: unreadable tensor ({e})")
                        continue
                    if arr.dtype.kind in "SOU":
                        parts = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                                 for x in np.ravel(arr)]
                        txt.setdefault(v.tag, []).append((*key, "\n".join(parts)))
                    elif arr.dtype.kind in "biuf" and arr.size == 1:
                        num.setdefault(v.tag, []).append((*key, float(arr.reshape(()))))
        except Exception as e:  # noqa: BLE001 - truncated/corrupt files happen in crashed runs
            warnings.append(f"{os.path.relpath(path, logdir)}: stopped reading ({type(e).__name__}: {e})")

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
    texts = {}
    for tag, recs in txt.items():
        recs.sort()
        texts[tag] = [(step, s) for _, _, step, s in recs]

    alerts: dict[Any, dict[str, Any]] = {}
    for step, d in _parse_json_records(texts.get(ALERTS_TAG, []), ALERTS_TAG, warnings):
        a = _normalize_alert(d, step)
        if "id" in d and d["id"] is not None:
            key = ("id", str(d["id"]))
        else:
            key = (a["rule"], a["metric"], a["onset_step"] if a["onset_step"] is not None else a["step"])
        logged_peak = d.get("peak_level")
        if _is_int(logged_peak) and 0 <= logged_peak <= 3:
            logged_peak = LEVEL_NAMES[logged_peak]
        if not (isinstance(logged_peak, str) and logged_peak.upper() in LEVEL_NAMES):
            logged_peak = a["level"]
        a["peak_level"] = max(logged_peak.upper(), a["level"], key=_level_rank)
        prev = alerts.get(key)
        at_peak = {k: a[k] for k in _PEAK_FIELDS}
        if prev is None:
            a["peak"] = at_peak if a["level"] == a["peak_level"] else None
            alerts[key] = a
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
    alert_list = sorted(alerts.values(), key=lambda a: (a["logged_step"], -_level_rank(a["peak_level"])))

    events, seen = [], set()
    for step, d in _parse_json_records(texts.get(EVENTS_TAG, []), EVENTS_TAG, warnings):
        k = json.dumps(d, sort_keys=True, default=str)
        if k in seen:
            continue
        seen.add(k)
        e = dict(d)
        st = _to_int(e.get("step"))
        e["step"] = st if st is not None else step
        e["event"] = str(e.get("event", "event"))
        events.append(e)
    events.sort(key=lambda e: e["step"])
    return Run(logdir=logdir, files=[os.path.relpath(f, logdir) for f in files], scalars=scalars,
               superseded=superseded, texts=texts, alerts=alert_list, events=events,
               hparams=hparams, warnings=warnings)


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


# --------------------------------------------------------------------------
# Families and plots.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """A group of metrics drawn on one plot.

    Attributes:
        key: short id, e.g. ``"grad_norm"``.
        title: plot title.
        tags: tags on the left axis (exact names).
        right: tags on a right-hand axis (another unit), may be empty.
        layer_prefix: instead of ``tags``, one line per ``{layer_prefix}layer_{i}``.
        logy: ``"auto"`` (log when positive and spanning > 2 decades), True, False.
    """

    key: str
    title: str
    tags: tuple[str, ...] = ()
    right: tuple[str, ...] = ()
    layer_prefix: str | None = None
    logy: Any = "auto"

    def present(self, run: Run) -> list[str]:
        """The family's tags that ``run`` logged (left then right)."""
        if self.layer_prefix is not None:
            return [t for _, t in run.layer_tags(self.layer_prefix)]
        return [t for t in (*self.tags, *self.right) if t in run.scalars]


FAMILIES: tuple[Family, ...] = (
        Family("loss", "Loss (train / validation)", ("loss", "val/loss")),
        Family("ppl", "Perplexity", ("ppl", "val/ppl"), logy="auto"),
        Family("val_gap", "Train/val gap (val/loss - loss)", ("val/gap",), logy=False),
        Family("grad_norm", "Gradient global norm, pre / post clip",
               ("grad/global_norm", "grad/global_norm_post_clip"), ("grad/clip_ratio",)),
        Family("nonfinite", "Non-finite gradients / skipped steps",
               ("grad/nonfinite_count", "opt/skipped_steps"), logy=False),
        Family("param_norm", "Parameter global norm", ("param/global_norm",)),
        Family("update", "Update norm and update/param ratio",
               ("update/global_norm",), ("update/param_ratio",)),
        Family("layer_grad_norm", "Per-layer gradient norm", layer_prefix="grad/norm/"),
        Family("layer_param_norm", "Per-layer parameter norm", layer_prefix="param/norm/"),
        Family("logits", "Output-layer logits",
               ("act/output_layer_logits_rms.avg", "act/output_layer_logits_abs.max",
                "act/output_layer_logits_top2_diff.avg", "act/output_layer_logsumexp.mean",
                "act/output_layer_logsumexp.max"),
               ("act/output_layer_logits_top2_equal_ratio",)),
        Family("activations", "Hidden states and attention",
               ("act/hidden_states_rms.avg", "act/hidden_states_abs.max", "act/attn_logits_abs.max",
                "act/attn_out_before_proj_rms.avg", "act/gate_scores_rms.avg")),
        Family("moe", "MoE load", ("moe/maxvio.mean", "moe/maxvio.max", "moe/load_imbalance"),
               ("moe/dead_expert_ratio",), logy=False),
        Family("moe_tokens", "MoE window tokens", ("moe/window_tokens", "moe/expected_tokens_per_expert")),
        Family("optimizer", "Adam second moment", ("opt/adam_nu_log10_spread",), ("opt/adam_nu_abs.max",)),
        Family("loss_scale", "Loss scale", ("opt/loss_scale",), logy=True),
        Family("throughput", "Throughput", ("sys/tokens_per_sec",), ("sys/steps_per_sec",), logy=False),
        Family("memory", "Device memory (bytes)",
               ("sys/device_memory_bytes", "sys/device_memory_peak_bytes"), logy=False),
        Family("lr_scale", "Learning-rate scale (rollbacks cut it)", (LR_SCALE_TAG,), logy=False),
)
_FAMILY_BY_KEY = {f.key: f for f in FAMILIES}
_SHARE_PREFIX = "grad/share/"


def _family(family: str | Family) -> Family:
    if isinstance(family, Family):
        return family
    try:
        return _FAMILY_BY_KEY[family]
    except KeyError:
        raise KeyError(f"Expected a family key among {sorted(_FAMILY_BY_KEY)}, got {family!r}") from None


def _want_log(values: Sequence[np.ndarray], logy) -> bool:
    if logy != "auto":
        return bool(logy)
    v = np.concatenate([x[np.isfinite(x)] for x in values]) if values else np.array([])
    return bool(len(v) and (v > 0).all() and v.max() / v.min() > 100)


def shade_levels(ax, run: Run, *, alpha: float = 0.22) -> None:
    """Shades YELLOW/ORANGE/RED periods and draws a dashed line at each rollback."""
    for start, end, name in run.level_periods():
        if name in ("YELLOW", "ORANGE", "RED"):
            ax.axvspan(start, max(end, start + 0.5), color=LEVEL_COLORS[name], alpha=alpha, lw=0, zorder=0)
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#8b0000", ls="--", lw=1.2, zorder=3)


def _new_ax(ax, figsize=(9, 3)):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, layout="constrained")[1]


def plot_family(run: Run, family: str | Family, ax=None, *, shade: bool = True):
    """Plots one metric family against step; non-finite values are marked with a red x.

    Args:
        run: from :func:`read_run`.
        family: a key of :data:`FAMILIES` (``"loss"``, ``"grad_norm"``, ...) or a
            :class:`Family`.
        ax: a matplotlib Axes; default a new pyplot figure (notebook use).
        shade: shade the monitor's level periods and mark rollbacks.

    Returns:
        The Axes (``None`` if the run has none of the family's tags).
    """
    fam = _family(family)
    tags = fam.present(run)
    if not tags:
        return None
    ax = _new_ax(ax)
    left = tags if fam.layer_prefix else [t for t in fam.tags if t in run.scalars]
    right = [] if fam.layer_prefix else [t for t in fam.right if t in run.scalars]
    axes = [(ax, left)]
    if right:
        axes.append((ax.twinx() if left else ax, right))
    import matplotlib.transforms as mtransforms

    handles = []
    # A figure computed every N steps is drawn at its own steps, as points (never
    # forward-filled onto the steps of denser figures).
    densest = max((len(s) for s, _ in run.scalars.values()), default=0)
    for k, (a, group) in enumerate(axes):
        if not group:
            continue
        cmap = None
        if fam.layer_prefix and len(group) > 10:
            import matplotlib

            cmap = matplotlib.colormaps["viridis"]
        for j, tag in enumerate(group):
            steps, vals = run.scalars[tag]          # only the steps it was written at
            color = cmap(j / max(1, len(group) - 1)) if cmap else None
            style = "-" if k == 0 else ":"
            label = tag if not fam.layer_prefix or len(group) <= 10 or j in (0, len(group) - 1) else None
            sparse = len(steps) < 40 or len(steps) * 3 < densest
            (h,) = a.plot(steps, vals, style, lw=1.0 if sparse else 1.3, color=color, label=label,
                          marker="." if sparse else None, ms=4)
            if label:
                handles.append(h)
            if tag in run.superseded:
                ss, sv = run.superseded[tag]
                a.plot(ss, sv, "o", ms=2.5, color=h.get_color(), alpha=0.35)
            bad = ~np.isfinite(vals)
            if bad.any():
                tr = mtransforms.blended_transform_factory(a.transData, a.transAxes)
                hb = a.scatter(steps[bad], np.full(bad.sum(), 0.96), marker="x", color="#d62d20",
                               transform=tr, zorder=5, label=f"{tag}: non-finite" if j == 0 else None, clip_on=False)
                if j == 0:
                    handles.append(hb)
        if _want_log([run.scalars[t][1] for t in group], fam.logy):
            a.set_yscale("log")
        if k == 1 and left:
            a.set_ylabel(", ".join(group), fontsize=7)
    if shade:
        shade_levels(ax, run)
    ax.set_title(fam.title, fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                  ncol=min(len(handles), 4), frameon=False, borderaxespad=0.2)
    return ax


def _share_matrix(run: Run):
    """``(layers, steps, matrix[L, S], source)`` of per-layer gradient shares, or ``None``."""
    tags = run.layer_tags(_SHARE_PREFIX)
    source = "grad/share/layer_*"
    computed = False
    if not tags:
        tags = run.layer_tags("grad/norm/")
        source = "computed from grad/norm/layer_* as ||g_i||^2 / sum_j ||g_j||^2"
        computed = True
    if not tags:
        return None
    steps = np.unique(np.concatenate([run.scalars[t][0] for _, t in tags]))
    mat = np.full((len(tags), len(steps)), np.nan)
    for r, (_, t) in enumerate(tags):
        s, v = run.scalars[t]
        mat[r, np.searchsorted(steps, s)] = v
    if computed:
        sq = mat ** 2
        with np.errstate(invalid="ignore", divide="ignore"):
            mat = sq / np.sum(sq, axis=0, keepdims=True)
    return [i for i, _ in tags], steps, mat, source


def plot_layer_heatmap(run: Run, ax=None):
    """Heat map of each layer's gradient share (layers x steps), rollbacks marked.

    Uses ``grad/share/layer_{i}``; without them, shares computed from
    ``grad/norm/layer_{i}``. Missing or non-finite cells are grey.

    Returns:
        The Axes, or ``None`` when no per-layer gradient figures were logged.
    """
    got = _share_matrix(run)
    if got is None:
        return None
    layers, steps, mat, source = got
    ax = _new_ax(ax)
    import matplotlib

    cmap = matplotlib.colormaps["magma"].with_extremes(bad="#bbbbbb")
    if len(steps) > 1:
        mids = (steps[1:] + steps[:-1]) / 2
        xedges = np.concatenate([[steps[0] - (mids[0] - steps[0])], mids, [steps[-1] + (steps[-1] - mids[-1])]])
    else:
        xedges = np.array([steps[0] - 0.5, steps[0] + 0.5])
    yedges = np.arange(len(layers) + 1) - 0.5
    m = ax.pcolormesh(xedges, yedges, np.ma.masked_invalid(mat), cmap=cmap, shading="flat")
    ax.figure.colorbar(m, ax=ax, label="share of ||g||^2", pad=0.01)
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([f"layer {i}" for i in layers], fontsize=7)
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#00e5ff", ls="--", lw=1.2)
    ax.set_title(f"Per-layer gradient share ({source})", fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    return ax


def replica_matrices(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{figure: (steps int64[S], values float64[R, S])}`` from ``vitals/replicas_json``.

    One column per step that wrote the per-replica vectors (the last write of a step
    wins); a step with another number of replicas than the last one is left out.
    """
    by_step: dict[int, dict[str, list]] = {}
    for step, text in run.texts.get(REPLICAS_TAG, []):
        try:
            figs = json.loads(text).get("figures", {})
        except (ValueError, AttributeError):
            continue
        if isinstance(figs, Mapping):
            by_step[int(step)] = dict(figs)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    names = sorted({f for d in by_step.values() for f in d})
    for f in names:
        cols = [(st, d[f]) for st, d in sorted(by_step.items()) if isinstance(d.get(f), list)]
        if not cols:
            continue
        n = len(cols[-1][1])
        cols = [(st, v) for st, v in cols if len(v) == n]
        steps = np.array([st for st, _ in cols], dtype=np.int64)
        vals = np.array([[np.nan if x is None else float(x) for x in v] for _, v in cols], np.float64).T
        out[f] = (steps, vals)
    return out


def plot_replica_heatmap(run: Run, figure: str, ax=None, *, clip: float = 10.0):
    """Replica x step heat map of one per-replica figure, rollbacks marked.

    Each column is coloured by the robust z-score of each replica against the others
    at that step (``(x - median) / max(1.4826 MAD, 2% |median|)``, clipped to
    ``+-clip``): a sick replica is a bright row, a bad data shard a bright diagonal
    (when shards rotate). The non-finite counts are drawn as counts (log scale);
    missing or non-finite cells are grey.

    Returns:
        The Axes, or ``None`` when the figure was not logged.
    """
    from jvitals.monitor.replicas import robust_z

    got = replica_matrices(run).get(figure)
    if got is None:
        return None
    steps, vals = got
    ax = _new_ax(ax)
    import matplotlib

    if figure == "nonfinite":
        mat, label, cmap = np.log10(1.0 + np.where(np.isfinite(vals), vals, np.nan)), "log10(1 + count)", "Reds"
        vmin, vmax = 0.0, max(1.0, float(np.nanmax(mat)) if np.isfinite(mat).any() else 1.0)
    else:
        mat = np.stack([robust_z(vals[:, j])[0] for j in range(vals.shape[1])], axis=1)
        mat = np.clip(mat, -clip, clip)
        label, cmap, vmin, vmax = "robust z vs the other replicas", "RdBu_r", -clip, clip
    cmap = matplotlib.colormaps[cmap].with_extremes(bad="#bbbbbb")
    if len(steps) > 1:
        mids = (steps[1:] + steps[:-1]) / 2
        xedges = np.concatenate([[steps[0] - (mids[0] - steps[0])], mids, [steps[-1] + (steps[-1] - mids[-1])]])
    else:
        xedges = np.array([steps[0] - 0.5, steps[0] + 0.5])
    yedges = np.arange(vals.shape[0] + 1) - 0.5
    m = ax.pcolormesh(xedges, yedges, np.ma.masked_invalid(mat), cmap=cmap, vmin=vmin, vmax=vmax,
                      shading="flat")
    ax.figure.colorbar(m, ax=ax, label=label, pad=0.01)
    if vals.shape[0] <= 32:
        ax.set_yticks(range(vals.shape[0]))
        ax.set_yticklabels([f"replica {i}" for i in range(vals.shape[0])], fontsize=6)
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#00e5ff", ls="--", lw=1.2)
    ax.set_title(f"replica/{figure} ({vals.shape[0]} replicas x {len(steps)} steps)", fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    return ax


def plot_timeline(run: Run, ax=None):
    """A strip coloured by the monitor's level over steps, with rollbacks and saves marked."""
    ax = _new_ax(ax, figsize=(9, 1.2))
    first, last = run.first_step or 0, run.last_step or 1
    ax.axvspan(first, max(last, first + 1), color="#e8e8e8", lw=0)
    for start, end, name in run.level_periods():
        ax.axvspan(start, max(end, start + 0.5), color=LEVEL_COLORS.get(name, "#999999"), lw=0)
    for e in run.events:
        if e.get("event") == "save":
            ax.plot([e["step"]], [0.1], marker="|", color="#333333", ms=8)
        elif e.get("event") == "pause":
            ax.plot([e["step"]], [0.5], marker="s", color="#333333", ms=5)
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#111111", lw=2)
        ax.plot([rb["step"]], [1.0], marker="v", color="#111111", ms=9, clip_on=False)
        label = "rollback" + (f" to {rb['to_step']}" if _is_int(rb.get("to_step")) else "")
        ax.annotate(label, (rb["step"], 1.0), xytext=(4, 2), textcoords="offset points", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_xlim(first, max(last, first + 1))
    ax.set_yticks([])
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title("Monitor level (green/yellow/orange/red); | save, \u25a0 pause, \u25bc rollback",
                 fontsize=9, loc="left")
    return ax


# --------------------------------------------------------------------------
# The check-up table (seed 003, §6.2).
# --------------------------------------------------------------------------

PASSED, FAILED, NOT_MEASURED = "PASSED", "FAILED", "NOT MEASURED"


@dataclasses.dataclass(frozen=True)
class CheckItem:
    """One line of the guide's check-up table, decided from the logged figures.

    Attributes:
        phase: ``"start-up"``, ``"middle"`` or ``"late"``.
        text: the checklist item (English; ``source`` holds the guide's wording).
        status: ``"PASSED"``, ``"FAILED"`` or ``"NOT MEASURED"``.
        figure: the figure that decided it, e.g. ``"last/second quarter median
            ratio 1.05 (limit 2)"``, or why it could not be measured.
        metrics: the tags it read.
        window: ``(first, last)`` step of the window it was judged over.
        source: the guide's original wording (Chinese).
    """

    phase: str
    text: str
    status: str
    figure: str
    metrics: tuple[str, ...]
    window: tuple[int, int]
    source: str


def _total_steps(run: Run, total_steps: int | None) -> int | None:
    if total_steps:
        return int(total_steps)
    for k in _TOTAL_STEP_HPARAMS:
        v = run.hparams.get(k)
        if isinstance(v, (int, float)) and v > 0:
            return int(v)
    return None


def run_phase(run: Run, total_steps: int | None = None) -> str:
    """The run's phase by the guide's boundaries (see the module docstring).

    ``last_step <= 1000``: start-up; else, with the planned ``total_steps``
    (argument or logged hparam), late once ``last_step > total_steps / 2``;
    otherwise middle.
    """
    last = run.last_step or 0
    if last <= STARTUP_END:
        return "start-up"
    total = _total_steps(run, total_steps)
    if total is not None and last > total / 2:
        return "late"
    return "middle"


def _phase_window(run: Run, phase: str, total: int | None) -> tuple[int, int]:
    first, last = run.first_step or 0, run.last_step or 0
    if phase == "start-up":
        return first, min(last, STARTUP_END)
    mid = (total if total is not None else last) / 2
    if phase == "middle":
        lo = STARTUP_END if last > STARTUP_END else first
        hi = last if total is None else int(min(last, max(mid, lo)))
        return lo, hi
    return int(mid if mid < last else last / 2), last


def _window(run: Run, tag: str, win: tuple[int, int], finite: bool = True):
    s = run.series(tag)
    if s is None:
        return None
    steps, vals = s
    m = (steps >= win[0]) & (steps <= win[1])
    if finite:
        m &= np.isfinite(vals)
    return steps[m], vals[m]


def _quarters(vals: np.ndarray) -> list[float]:
    parts = np.array_split(vals, 4)
    return [float(np.median(p)) for p in parts]


def _fmt(x: float) -> str:
    if x is None or not np.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


_MIN_POINTS = 8


def _first_tag(run: Run, tags: Iterable[str]) -> str | None:
    return next((t for t in tags if t in run.scalars), None)


def _check_grad_stable(run, win):
    tag = "grad/global_norm"
    w = _window(run, tag, win)
    if w is None or len(w[1]) < _MIN_POINTS:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} finite points of {tag} in the window", (tag,)
    q = _quarters(w[1])
    ratio = q[3] / q[1] if q[1] > 0 else math.inf
    status = PASSED if ratio <= 2 else FAILED
    return status, (f"median of the last quarter / second quarter = {_fmt(ratio)} (limit 2, the "
                    f"yellow factor); {_fmt(q[0])} -> {_fmt(q[3])}"), (tag,)


def _check_loss_falls(run, win):
    tag = "loss"
    w = _window(run, tag, win)
    if w is None or len(w[1]) < _MIN_POINTS:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} finite points of {tag} in the window", (tag,)
    q = _quarters(w[1])
    change = (q[3] - q[0]) / abs(q[0]) if q[0] else math.nan
    status = PASSED if q[3] < q[0] else FAILED
    return status, (f"median of the first quarter {_fmt(q[0])} -> last quarter {_fmt(q[3])} "
                    f"({change:+.1%}); no expected rate was logged, so 'falling' is the test"), (tag,)


def _check_nonfinite(run, win):
    tags = [t for t in run.scalars if t in ("loss", "ppl", "grad/global_norm", "grad/global_norm_post_clip",
                                             "param/global_norm", "update/global_norm")
            or t == "grad/nonfinite_count" or t.endswith(".nonfinite") or t.endswith("_nonfinite")]
    if not tags:
        return NOT_MEASURED, "none of loss, grad/global_norm, grad/nonfinite_count logged", ()
    firsts = []
    for t in tags:
        w = _window(run, t, win, finite=False)
        steps, vals = w
        bad = ~np.isfinite(vals)
        if "nonfinite" in t:
            bad |= np.nan_to_num(vals, nan=1.0) > 0
        if bad.any():
            firsts.append((int(steps[bad][0]), t, int(bad.sum())))
    if firsts:
        firsts.sort()
        s, t, n = firsts[0]
        return FAILED, f"first at step {s} in {t} ({n} step(s)); {len(firsts)} tag(s) affected", tuple(tags)
    return PASSED, f"all finite in {len(tags)} tag(s)", tuple(tags)


def _check_activation_range(run, win, limit=1e4):
    tags = [t for t in run.scalars if t.startswith("act/") and ("abs.max" in t or "abs_max" in t)]
    if not tags:
        return NOT_MEASURED, "no act/*_abs.max activation maxima logged", ()
    worst = (-math.inf, "", 0)
    nonfinite = None
    for t in tags:
        steps, vals = _window(run, t, win, finite=False)
        if (~np.isfinite(vals)).any() and nonfinite is None:
            nonfinite = (int(steps[~np.isfinite(vals)][0]), t)
        fin = np.isfinite(vals)
        if fin.any():
            i = int(np.argmax(np.where(fin, np.abs(vals), -np.inf)))
            if abs(vals[i]) > worst[0]:
                worst = (float(abs(vals[i])), t, int(steps[i]))
    if nonfinite:
        return FAILED, f"non-finite at step {nonfinite[0]} in {nonfinite[1]}", tuple(tags)
    if worst[1] == "":
        return NOT_MEASURED, "no activation maxima in the window", tuple(tags)
    status = PASSED if worst[0] <= limit else FAILED
    return status, (f"largest |activation| {_fmt(worst[0])} ({worst[1]} at step {worst[2]}); "
                    f"limit {limit:.0e} (the guide's overflow mark)"), tuple(tags)


def _check_throughput(run, win):
    tag = _first_tag(run, ("sys/tokens_per_sec", "sys/steps_per_sec"))
    if tag is None:
        return NOT_MEASURED, "no sys/tokens_per_sec or sys/steps_per_sec logged", ()
    steps, vals = _window(run, tag, win)
    if len(vals) < 4:
        return NOT_MEASURED, f"needs >= 4 finite points of {tag} in the window", (tag,)
    vals = vals[1:]  # the first reading includes compilation
    base = float(np.median(vals[: max(1, len(vals) // 2)]))
    last = float(np.median(vals[-max(1, len(vals) // 4):]))
    ratio = last / base if base > 0 else math.nan
    status = PASSED if ratio >= 0.7 else FAILED
    return status, (f"{tag}: last-quarter median {_fmt(last)} = {_fmt(ratio)}x its early median "
                    f"{_fmt(base)} (fail below 0.7x: the guide's 30% drop); no expected figure was logged"), (tag,)


def _check_grad_with_loss(run, win):
    g, lo = _window(run, "grad/global_norm", win), _window(run, "loss", win)
    if g is None or lo is None or len(g[1]) < _MIN_POINTS or len(lo[1]) < _MIN_POINTS:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} finite points of loss and grad/global_norm", (
                "loss", "grad/global_norm")
    gq, lq = _quarters(g[1]), _quarters(lo[1])
    gr = gq[3] / gq[0] if gq[0] > 0 else math.inf
    lchange = (lq[3] - lq[0]) / abs(lq[0]) if lq[0] else math.nan
    status = FAILED if gr > 1.25 else PASSED
    return status, (f"grad norm x{_fmt(gr)} (first -> last quarter median) while loss {lchange:+.1%}; "
                    f"fail if grad norm climbs > 1.25x"), ("loss", "grad/global_norm")


def _check_layer_shares(run, win):
    got = _share_matrix(run)
    if got is None:
        return NOT_MEASURED, "no grad/share/layer_* or grad/norm/layer_* logged", ()
    layers, steps, mat, source = got
    m = (steps >= win[0]) & (steps <= win[1])
    mat = mat[:, m]
    cols = np.isfinite(mat).all(axis=0)
    mat = mat[:, cols]
    if mat.shape[1] < 4:
        return NOT_MEASURED, f"needs >= 4 steps with every layer's share in the window ({source})", ()
    k = max(1, mat.shape[1] // 4)
    a, b = np.median(mat[:, :k], axis=1), np.median(mat[:, -k:], axis=1)
    rel = np.maximum(b, a) / np.maximum(np.minimum(a, b), 1e-12)
    moved = (rel > 1.5) & (np.abs(b - a) > 0.02)
    i = int(np.argmax(np.abs(b - a)))
    status = FAILED if moved.any() else PASSED
    return status, (f"largest shift: layer {layers[i]} {a[i]:.1%} -> {b[i]:.1%} (first -> last quarter); "
                    f"fail if a layer's share changes > 1.5x and > 2 points"), ("grad/share/layer_*",)


def _check_val_gap(run, win):
    w = _window(run, "val/gap", win)
    tag = "val/gap"
    if w is None or len(w[1]) == 0:
        v, lo = run.series("val/loss"), run.series("loss")
        if v is None or lo is None:
            return NOT_MEASURED, "neither val/gap nor val/loss with loss logged", ("val/gap",)
        vs, vv = _window(run, "val/loss", win)
        ls, lv = run.series("loss")
        ok = np.isfinite(lv)
        gap = vv - np.interp(vs, ls[ok], lv[ok]) if ok.any() else vv * np.nan
        w, tag = (vs, gap), "val/loss - loss"
    steps, gap = w
    if len(gap) < 3:
        return NOT_MEASURED, f"needs >= 3 validation points in the window (got {len(gap)})", ("val/gap",)
    span = min(1000, (steps[-1] - steps[0]) / 2)
    end = steps[-1]
    g = lambda s: float(np.interp(s, steps, gap))  # noqa: E731
    recent, before = g(end) - g(end - span), g(end - span) - g(end - 2 * span)
    bad = recent > 0 and recent > 1.5 * max(before, 0)
    status = FAILED if bad else PASSED
    return status, (f"{tag} grew {_fmt(recent)} over the last {int(span)} steps vs {_fmt(before)} over the "
                    f"{int(span)} before (fail if > 1.5x and growing); now {_fmt(gap[-1])}"), ("val/gap",)


def _spikes(steps, vals, w=10):
    """Simple spike finder: above median(prev w) + max(4 MAD-sigma, 10%); recovered within 5%/2 sigma."""
    out, i = [], w
    while i < len(vals):
        prev = vals[i - w:i]
        trend = float(np.median(prev))
        sigma = 1.4826 * float(np.median(np.abs(prev - trend)))
        if vals[i] > trend + max(4 * sigma, 0.1 * abs(trend)):
            band = trend + max(2 * sigma, 0.05 * abs(trend))
            j = i + 1
            while j < len(vals) and vals[j] > band:
                j += 1
            rec = int(steps[j] - steps[i]) if j < len(vals) else None
            out.append((int(steps[i]), float(vals[i:j].max() / trend) if trend else math.inf, rec,
                        int(steps[-1] - steps[i])))
            i = j + w
        else:
            i += 1
    return out


def _check_spike_recovery(run, win):
    w = _window(run, "loss", win)
    monitor = [a for a in run.alerts if a["rule"] in ("loss_spike", "divergence")
               and win[0] <= a["step"] <= win[1]]
    if (w is None or len(w[1]) < 12) and not monitor:
        return NOT_MEASURED, "needs >= 12 finite loss points in the window (or the monitor's spike alerts)", ("loss",)
    spikes = _spikes(*w) if w is not None and len(w[1]) >= 12 else []
    slow = [s for s in spikes if (s[2] if s[2] is not None else s[3]) > 300]
    parts = []
    if spikes:
        recs = [s[2] for s in spikes if s[2] is not None]
        parts.append(f"{len(spikes)} loss spike(s), slowest recovery "
                     f"{max(recs) if recs else '-'} steps" + (f", {len(spikes) - len(recs)} not recovered"
                                                              if len(recs) < len(spikes) else ""))
    else:
        parts.append("no loss spikes found")
    if monitor:
        parts.append(f"monitor: {len(monitor)} spike/divergence alert(s)")
    status = FAILED if slow or monitor else PASSED
    return status, "; ".join(parts) + " (normal: back within 100-300 steps)", ("loss",)


def _check_param_norm(run, win):
    tag = "param/global_norm"
    s = run.series(tag)
    w = _window(run, tag, win)
    if s is None or w is None or len(w[1]) < 2:
        return NOT_MEASURED, f"needs >= 2 finite points of {tag} in the window", (tag,)
    steps, vals = s
    ok = np.isfinite(vals)
    base_m = ok & (steps <= steps[ok][0] + 500)
    base = float(np.mean(vals[base_m]))
    ratio = float(np.max(w[1]) / base) if base > 0 else math.inf
    jumps = np.abs(np.diff(w[1])) / np.maximum(np.abs(w[1][:-1]), 1e-12)
    jump = float(jumps.max()) if len(jumps) else 0.0
    status = PASSED if ratio <= 1.5 and jump <= 0.1 else FAILED
    return status, (f"max {_fmt(ratio)}x the first-500-step baseline {_fmt(base)} (limit 1.5x); largest "
                    f"jump between logged points {jump:.1%} (limit 10%)"), (tag,)


def _check_checkpoints(run, win, every=500):
    saves = sorted(e["step"] for e in run.events if e.get("event") == "save")
    if not saves:
        return NOT_MEASURED, "no 'save' events logged in vitals/events_json", (EVENTS_TAG,)
    inwin = [s for s in saves if win[0] <= s <= win[1]]
    pts = [win[0]] + inwin + [win[1]]
    gap = max(b - a for a, b in zip(pts, pts[1:]))
    status = PASSED if gap <= every * 1.1 else FAILED
    return status, (f"{len(inwin)} save(s) in the window; longest stretch without one {gap} steps "
                    f"(expected every {every})"), (EVENTS_TAG,)


def _check_val_rising(run, win):
    tag = "val/loss"
    s = run.series(tag)
    w = _window(run, tag, win)
    if s is None or w is None or len(w[1]) < 2:
        return NOT_MEASURED, f"needs >= 2 finite {tag} points in the window", (tag,)
    steps, vals = s
    ok = np.isfinite(vals) & (steps <= w[0][-1])
    best_i = int(np.argmin(np.where(ok, vals, np.inf)))
    best, now = float(vals[best_i]), float(w[1][-1])
    rise = (now - best) / abs(best) if best else math.nan
    status = FAILED if rise > 0.01 else PASSED
    extra = "; consider stopping early" if status == FAILED else ""
    return status, (f"val loss now {_fmt(now)} vs best {_fmt(best)} at step {int(steps[best_i])} "
                    f"({rise:+.1%}; fail above +1%){extra}"), (tag,)


def _check_loss_vs_lr(run, win):
    lr = _first_tag(run, ("opt/learning_rate", "learning_rate", "lr", "opt/lr"))
    if lr is None:
        return NOT_MEASURED, "no learning-rate series logged (opt/learning_rate)", ("loss",)
    lo, lw = _window(run, "loss", win), _window(run, lr, win)
    if lo is None or len(lo[1]) < _MIN_POINTS or len(lw[1]) < 2:
        return NOT_MEASURED, f"needs >= {_MIN_POINTS} loss points and 2 {lr} points in the window", ("loss", lr)
    q = _quarters(lo[1])
    change = (q[3] - q[0]) / abs(q[0]) if q[0] else math.nan
    lr_change = lw[1][-1] / lw[1][0] if lw[1][0] else math.nan
    status = PASSED if q[3] <= q[0] else FAILED
    return status, (f"loss {change:+.1%} (first -> last quarter median) while {lr} x{_fmt(lr_change)}; "
                    f"fail if the loss stopped falling while the LR still drives it"), ("loss", lr)


def _check_loss_scale(run, win):
    tag = "opt/loss_scale"
    w = _window(run, tag, win)
    if w is None or len(w[1]) < 2:
        return NOT_MEASURED, f"{tag} not logged (no dynamic loss scaling)", (tag,)
    vals = w[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        falls = vals[:-1] / vals[1:]
    worst = float(np.nanmax(falls)) if len(falls) else 1.0
    status = FAILED if worst >= 16 else PASSED
    return status, (f"largest one-step fall x{_fmt(worst)} (fail at >= 2^4); range {_fmt(vals.min())} - "
                    f"{_fmt(vals.max())}"), (tag,)


def _check_final_eval(run, win):
    evals = [e for e in run.events if e.get("event") in ("eval", "evaluation", "final_eval")]
    saves = [e["step"] for e in run.events if e.get("event") == "save"]
    if not evals:
        return NOT_MEASURED, "not in the logged figures: run a full evaluation of the final checkpoint", ()
    last_eval = max(e["step"] for e in evals)
    if saves and last_eval < max(saves):
        return FAILED, f"last evaluation at step {last_eval}, before the last save at {max(saves)}", (EVENTS_TAG,)
    return PASSED, f"evaluation logged at step {last_eval}", (EVENTS_TAG,)


# (phase, English item, the guide's wording, check function)
CHECKLIST = (
        ("start-up", "Grad norm settles into a stable range (not diverging)",
         "grad norm是否收敛在一个稳定范围（不是持续发散）", _check_grad_stable),
        ("start-up", "Loss is falling at the expected rate",
         "loss是否在按预期的速度下降", _check_loss_falls),
        ("start-up", "No NaN or Inf at any step",
         "有没有在某个特定step出现NaN或者Inf", _check_nonfinite),
        ("start-up", "Every layer's activation range is within a reasonable interval",
         "各层的激活值范围是否在合理区间", _check_activation_range),
        ("start-up", "Data-loading throughput reaches the expected level",
         "数据加载吞吐是否达到预期", _check_throughput),
        ("middle", "Grad norm falls together with the loss",
         "grad norm是否随loss同步下降", _check_grad_with_loss),
        ("middle", "The layer-wise grad norm distribution stays stable",
         "layer-wise grad norm分布是否保持稳定", _check_layer_shares),
        ("middle", "The train/val gap is within a reasonable range",
         "train/val gap是否在合理范围", _check_val_gap),
        ("middle", "Loss spikes recover at a normal speed",
         "loss spike的恢复速度是否正常", _check_spike_recovery),
        ("middle", "Param norm grows slowly rather than jumping",
         "param norm是否在缓慢增长而不是突变", _check_param_norm),
        ("middle", "Checkpoints are being saved as expected",
         "checkpoints是否按预期保存", _check_checkpoints),
        ("late", "Validation loss has not started to rise (if it has, consider stopping early)",
         "val loss是否已经出现回升（如果是，考虑提前终止）", _check_val_rising),
        ("late", "The loss descent rate matches the learning-rate schedule",
         "loss曲线的下降速率是否与学习率调度匹配", _check_loss_vs_lr),
        ("late", "The loss scale is stable",
         "loss scale是否稳定", _check_loss_scale),
        ("late", "The final checkpoint has had a full evaluation",
         "是否做过最终checkpoint的完整评测", _check_final_eval),
)


def checkup(run: Run, phase: str | None = None, *, total_steps: int | None = None,
            all_phases: bool = False, checkpoint_every: int = 500) -> list[CheckItem]:
    """Marks each item of the guide's check-up table PASSED / FAILED / NOT MEASURED.

    Each phase's items are judged over that phase's window of steps (start-up:
    up to step 1000; middle: 1000 to the middle of training; late: the second
    half; see :func:`run_phase`).

    Args:
        run: from :func:`read_run`.
        phase: one of :data:`PHASES`; default the run's phase.
        total_steps: the planned number of training steps, if known.
        all_phases: judge the items of every phase, not only ``phase``'s
            (phases the run has not reached are NOT MEASURED).
        checkpoint_every: the expected checkpoint interval (steps).

    Returns:
        The items, in the guide's order.

    Raises:
        ValueError: an unknown ``phase``.
    """
    if phase is None:
        phase = run_phase(run, total_steps)
    if phase not in PHASES:
        raise ValueError(f"Expected phase to be one of {PHASES}, got {phase!r} instead")
    total = _total_steps(run, total_steps)
    current = run_phase(run, total_steps)
    out = []
    for ph, text, source, fn in CHECKLIST:
        if ph != phase and not all_phases:
            continue
        win = _phase_window(run, ph, total)
        reached = ph == phase or PHASES.index(ph) <= PHASES.index(current)
        if run.last_step is None:
            status, fig, tags = NOT_MEASURED, "nothing logged", ()
        elif not reached:
            status, fig, tags = NOT_MEASURED, f"the run has not reached the {ph} phase", ()
        else:
            try:
                if fn is _check_checkpoints:
                    status, fig, tags = fn(run, win, checkpoint_every)
                else:
                    status, fig, tags = fn(run, win)
            except Exception as e:  # noqa: BLE001 - one bad figure must not sink the report
                status, fig, tags = NOT_MEASURED, f"could not be computed ({type(e).__name__}: {e})", ()
        out.append(CheckItem(ph, text, status, fig, tuple(tags), (int(win[0]), int(win[1])), source))
    return out


# --------------------------------------------------------------------------
# HTML.
# --------------------------------------------------------------------------

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#1d1d1f;background:#fff;line-height:1.4}
h1{font-size:24px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;
padding-bottom:4px} h3{font-size:14px;margin:16px 0 6px}
table{border-collapse:collapse;width:100%;font-size:12.5px;margin:6px 0}
th,td{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f3f4f6} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.hdr td{border:none;padding:2px 12px 2px 0;font-size:14px} .hdr td:first-child{color:#666}
.lv{display:inline-block;padding:1px 7px;border-radius:9px;color:#fff;font-weight:600;font-size:12px}
.GREEN{background:#2e9d4f}.YELLOW{background:#f2c12e;color:#222}.ORANGE{background:#f08a24}
.RED{background:#d62d20}.unknown{background:#888}
.st{font-weight:700;white-space:nowrap} .PASSED{color:#1e7b3a} .FAILED{color:#c0261a}
.NOTMEASURED{color:#777}
img{max-width:100%;display:block;margin:6px 0 14px}
.src{color:#888;font-size:11px} .muted{color:#777;font-size:12px} pre{white-space:pre-wrap;
background:#f6f8fa;padding:8px;font-size:12px;max-height:300px;overflow:auto}
ul.loc{margin:0;padding-left:16px}
"""


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), (list, dict))
    except (TypeError, ValueError):
        return False


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fig_png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(fig, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="{_fig_png(fig)}">'


def _figure(size):
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def _num(x) -> str:
    return _e(_fmt(x)) if isinstance(x, (int, float, np.floating)) else _e(x)


def _lr_scale_text(run: Run) -> str:
    """``'1 -> 0.9 (from step 420)'``, or 'not measured' without ``rollback/lr_scale``."""
    s = run.series(LR_SCALE_TAG)
    if s is None or not np.isfinite(s[1]).any():
        return "not measured (no rollback/lr_scale: pass writer= to vitals.Rollback)"
    steps, vals = s[0][np.isfinite(s[1])], s[1][np.isfinite(s[1])]
    changes = [f"{_fmt(vals[i])} from step {steps[i]}" for i in range(1, len(vals)) if vals[i] != vals[i - 1]]
    return f"{_fmt(vals[0])}" + (" -> " + ", ".join(changes) if changes else " throughout")


def remedy_texts(rollback_event: Mapping[str, Any]) -> list[str]:
    """The remedies a ``rollback`` event applied (``'embedding LR x0.5'``, ...), in order.

    Read from the event's ``remedies`` list, else from its ``actions`` of kind
    ``'remedy'`` (their ``text``); empty for a rollback without remedies.
    """
    got = rollback_event.get("remedies")
    if isinstance(got, list):
        return [str(x) for x in got]
    acts = rollback_event.get("actions")
    if not isinstance(acts, list):
        return []
    return [str(a.get("text", a.get("remedy", ""))) for a in acts
            if isinstance(a, Mapping) and a.get("action") == "remedy"]


def build_html(run: Run, *, title: str | None = None, phase: str | None = None,
               total_steps: int | None = None, all_phases: bool = True,
               checkpoint_every: int = 500) -> str:
    """The self-contained HTML report (PNG plots as ``data:`` URIs, every logged string escaped)."""
    title = title or f"jvitals report: {run_name(run.logdir)}"
    cur_phase = phase or run_phase(run, total_steps)
    alerts = run.alerts
    by_level = {n: sum(a["peak_level"] == n for a in alerts) for n in ("YELLOW", "ORANGE", "RED")}
    rbs = run.rollbacks()
    final = run.final_level
    p = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
         f"<style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    p.append(f"<p class='muted'>generated {_e(datetime.datetime.now().strftime('%Y-%m-%d %H:%M'))} "
             f"by jvitals from {len(run.files)} event file(s)</p>")
    steps = f"{run.first_step} - {run.last_step}" if run.last_step is not None else "none"
    p.append("<table class='hdr'>")
    for k, v in (("run dir", _e(os.path.abspath(run.logdir))),
                 ("steps covered", _e(steps)),
                 ("final level", f"<span class='lv {_e(final)}'>{_e(final)}</span>"),
                 ("alerts", " ".join(f"<span class='lv {n}'>{n} {c}</span>" for n, c in by_level.items())
                  + f" <span class='muted'>({len(alerts)} in all)</span>"),
                 ("rollbacks", _e(run.num_rollbacks)),
                 ("LR scale", _e(_lr_scale_text(run))),
                 ("phase", _e(cur_phase) + (" <span class='muted'>(given)</span>" if phase else
                                            " <span class='muted'>(from the steps; see the rule below)</span>")),
                 ("metrics logged", _e(len(run.scalars)) + " scalar tags, " + _e(len(run.texts)) + " text tags")):
        p.append(f"<tr><td>{k}</td><td>{v}</td></tr>")
    p.append("</table>")
    for w in run.warnings:
        p.append(f"<p class='muted'>reader: {_e(w)}</p>")

    if run.last_step is None:
        p.append("<p>No metrics were found in this directory.</p></body></html>")
        return "".join(p)

    p.append("<h2>Timeline</h2>")
    fig = _figure((12, 1.3))
    plot_timeline(run, fig.add_subplot())
    p.append(_img(fig, "level timeline"))
    if rbs:
        p.append("<table><tr><th>rollback at step</th><th>restored step</th><th>earliest sign</th>"
                 "<th>lr scale</th><th>remedies applied</th><th>actions</th><th>reason</th></tr>")
        for r in rbs:
            acts = r.get("actions") or []
            cures = remedy_texts(r)
            acts = "; ".join(", ".join(f"{k}={v}" for k, v in a.items()) if isinstance(a, Mapping) else str(a)
                             for a in acts if not (isinstance(a, Mapping) and a.get("action") == "remedy")
                             ) if isinstance(acts, list) else str(acts)
            p.append(f"<tr><td class='num'>{_e(r.get('step'))}</td><td class='num'>{_e(r.get('to_step', ''))}</td>"
                     f"<td class='num'>{_e(r.get('onset_step', ''))}</td>"
                     f"<td class='num'>{_num(r.get('lr_scale', ''))}</td>"
                     f"<td>{_e('; '.join(cures) or 'none')}</td><td>{_e(acts)}</td>"
                     f"<td>{_e(r.get('reason', ''))}</td></tr>")
        p.append("</table>")

    p.append("<h2>Vital signs</h2><p class='muted'>Shaded: the monitor's yellow/orange/red periods; "
             "dashed dark red lines: rollbacks; red x: non-finite values; faint dots: values overwritten "
             "after a restart.</p>")
    used = {LEVEL_TAG, ROLLBACKS_TAG}
    missing = []
    for fam in FAMILIES:
        tags = fam.present(run)
        if not tags:
            missing.append(fam.title)
            continue
        used.update(tags)
        fig = _figure((12, 2.5))
        plot_family(run, fam, fig.add_subplot())
        p.append(_img(fig, fam.title))
    p.append("<h3>Per-layer gradient share</h3>")
    got = _share_matrix(run)
    if got is not None:
        used.update(t for _, t in run.layer_tags(_SHARE_PREFIX))
        fig = _figure((12, max(2.2, 0.25 * len(got[0]) + 1.2)))
        plot_layer_heatmap(run, fig.add_subplot())
        p.append(_img(fig, "per-layer gradient share heat map"))
    else:
        p.append("<p class='muted'>not measured (no grad/share/layer_* or grad/norm/layer_*)</p>")
    reps = replica_matrices(run)
    if reps:
        p.append("<h3>Per-replica figures</h3><p class='muted'>Each data-parallel replica (row) against "
                 "the others at each step (column): robust z-scores, clipped; a sick device is a bright "
                 "row, a bad data shard a bright trail that moves between replicas with the data.</p>")
        for fig_name in [f for f in reps if f not in ("data", "first_nonfinite_step")]:
            fig = _figure((12, max(2.2, 0.18 * reps[fig_name][1].shape[0] + 1.2)))
            plot_replica_heatmap(run, fig_name, fig.add_subplot())
            p.append(_img(fig, f"replica/{fig_name} heat map"))
        used.update(t for t in run.scalars if t.startswith("replica/"))
    if missing:
        p.append(f"<p class='muted'>Not measured (no tags logged): {_e('; '.join(missing))}.</p>")

    p.append("<h2>Alerts</h2>")
    if not alerts:
        p.append("<p>No alerts were logged.</p>")
    else:
        p.append("<table><tr><th>step</th><th>level</th><th>metric</th><th>rule</th><th>value / baseline"
                 "</th><th>message</th><th>cause</th><th>prescription</th><th>localization</th></tr>")
        for a in alerts:
            lvl = a["peak_level"]
            onset = f" (onset {a['onset_step']})" if a["onset_step"] is not None else ""
            if _to_int(a.get("closed_step")) is not None:
                onset += f", closed {a['closed_step']}"
            vb = f"{_fmt(a['value'])} / {_fmt(a['baseline'])}"
            if np.isfinite(a["ratio"]):
                vb += f" (x{_fmt(a['ratio'])})"
            loc = "".join(f"<li>{_e(x)}</li>" for x in a["localization"])
            p.append(f"<tr><td class='num'>{_e(a['step'])}{_e(onset)}</td>"
                     f"<td><span class='lv {_e(lvl)}'>{_e(lvl)}</span></td><td>{_e(a['metric'])}</td>"
                     f"<td>{_e(a['rule'])}</td><td class='num'>{_e(vb)}</td><td>{_e(a['message'])}</td>"
                     f"<td>{_e(a['cause'])}</td><td>{_e(a['prescription'])}</td>"
                     f"<td><ul class='loc'>{loc}</ul></td></tr>")
        p.append("</table>")
    other_events = [e for e in run.events if e.get("event") not in ("rollback",)]
    if other_events:
        p.append("<h3>Guard events</h3><table><tr><th>step</th><th>event</th><th>details</th></tr>")
        for e in other_events:
            det = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("step", "event"))
            p.append(f"<tr><td class='num'>{_e(e['step'])}</td><td>{_e(e['event'])}</td><td>{_e(det)}</td></tr>")
        p.append("</table>")

    p.append("<h2>Check-up</h2>")
    total = _total_steps(run, total_steps)
    p.append("<p class='muted'>The guide's check-up table (seed 003, §6.2). Phase rule: start-up = steps "
             "0-1000; middle = step 1000 to the middle of training; late = the second half. The run's last "
             f"step is {_e(run.last_step)}; planned total steps: {_e(total if total else 'unknown (pass --total-steps)')}"
             ". Each phase's items are judged over that phase's window of steps.</p>")
    items = checkup(run, cur_phase, total_steps=total_steps, all_phases=all_phases,
                    checkpoint_every=checkpoint_every)
    order = [cur_phase] + [x for x in PHASES if x != cur_phase]
    for ph in order:
        rows = [it for it in items if it.phase == ph]
        if not rows:
            continue
        label = "this run's phase" if ph == cur_phase else "other phase"
        reached = ph == cur_phase or PHASES.index(ph) <= PHASES.index(run_phase(run, total_steps))
        where = f"window steps {rows[0].window[0]}-{rows[0].window[1]}" if reached else "not reached"
        p.append(f"<h3>{_e(ph)} <span class='muted'>({_e(label)}; {_e(where)})</span></h3>")
        p.append("<table><tr><th style='width:34%'>item <span class='muted'>(hover: the guide's wording)</span></th><th style='width:11%'>result</th>"
                 "<th>deciding figure</th></tr>")
        for it in rows:
            p.append(f"<tr><td title='{_e(it.source)}' lang='en'>{_e(it.text)}</td>"
                     f"<td class='st {it.status.replace(' ', '')}'>{_e(it.status)}</td>"
                     f"<td>{_e(it.figure)}</td></tr>")
        p.append("</table>")

    rest = sorted(t for t in run.scalars if t not in used)
    if rest:
        p.append("<h2>Other metrics</h2><table><tr><th>tag</th><th>points</th><th>first step</th>"
                 "<th>last step</th><th>last</th><th>min</th><th>max</th><th>non-finite</th></tr>")
        for t in rest:
            s, v = run.scalars[t]
            fin = v[np.isfinite(v)]
            mn, mx = (_fmt(fin.min()), _fmt(fin.max())) if len(fin) else ("-", "-")
            p.append(f"<tr><td>{_e(t)}</td><td class='num'>{len(s)}</td><td class='num'>{s[0]}</td>"
                     f"<td class='num'>{s[-1]}</td><td class='num'>{_num(float(v[-1]))}</td>"
                     f"<td class='num'>{_e(mn)}</td><td class='num'>{_e(mx)}</td>"
                     f"<td class='num'>{int((~np.isfinite(v)).sum())}</td></tr>")
        p.append("</table>")
    skip = {ALERTS_TAG, EVENTS_TAG, REPLICAS_TAG} | ({ALERTS_MD_TAG} if ALERTS_TAG in run.texts else set())
    shown = {t: recs for t, recs in run.texts.items() if t not in skip}
    for t in (ALERTS_TAG, EVENTS_TAG):
        bad = [(st, x) for st, x in run.texts.get(t, []) if not _parses(x)]
        if bad:
            shown[t + " (unparsed)"] = bad
    if shown:
        p.append("<h2>Other texts</h2>")
        for t in sorted(shown):
            recs = shown[t]
            p.append(f"<h3>{_e(t)} <span class='muted'>({len(recs)} record(s); last shown)</span></h3>")
            step, s = recs[-1]
            p.append(f"<pre>step {_e(step)}:\n{_e(s[:20000])}</pre>")
    p.append("</body></html>")
    return "\n".join(p)


def write_report(logdir: str | os.PathLike, out: str | os.PathLike, *, title: str | None = None,
                 phase: str | None = None, total_steps: int | None = None,
                 checkpoint_every: int = 500) -> str:
    """Reads ``logdir`` and writes the HTML report to ``out``; returns ``out``."""
    run = read_run(logdir)
    doc = build_html(run, title=title, phase=phase, total_steps=total_steps,
                     checkpoint_every=checkpoint_every)
    out = os.fspath(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(doc)
    return out
