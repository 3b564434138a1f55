"""The red response: which action for which verdict, over a checkpoint store.

:class:`Rollback` is the one place in jvitals that acts on a verdict. Each call
of :meth:`Rollback.respond` (at the host's check cadence) does one of::

    verdict level      action     what happens
    GREEN / YELLOW     SAVED      save on the cadence (first call, then each time the
                                  step crosses a multiple of ``save_every``); a light
                                  snapshot between them with ``snapshots=``
                       CONTINUE   otherwise
    ORANGE             PAUSE      save now (off-cadence too; once per orange episode),
                                  then pause as asked: 'return' (the loop decides),
                                  'raise' (:class:`TrainingPaused`) or a callable
    RED                ROLLBACK   restore the newest healthy checkpoint from before the
                                  fault's earliest sign, then the actions: learning rate
                                  x ``lr_factor``; optionally skip data, reset Adam
                                  moments; data position kept by default

The checkpoints live in a :class:`jvitals.guard.checkpoints.CheckpointStore` (save,
levels, pins, quarantine, retention); this module decides what to save, what to
pin and what to restore, and knows nothing about orbax.

Decisions (each is tested):

- **Checkpoint numbers** are the ``step`` passed to ``respond``. After a
  rollback the numbering keeps going forward: params and optimizer state come
  from the old checkpoint, the step counter (``step_attr``) and the data position
  do not go back. Orbax silently skips a save at a step <= its latest and refuses
  an existing step; forward numbering avoids both.
- **The rollback is itself checkpointed** (``save_on_rollback=True``): the
  restored state, after the actions, with the data position to continue from, is
  saved as the red step (kind ``"rollback"``); a crash right after it resumes
  rolled back.
- **The target** is the newest *healthy* checkpoint (saved at a level in
  ``healthy_levels`` with no open alert that had reached ORANGE, not quarantined,
  restores on every process, finite) saved before the fault's **earliest sign**
  minus one host cadence ``k``. ``E`` is the earliest of the onsets
  and localization change points (``Localization.departure_step``) of the chain
  of alerts that escalated to the red: the open alerts whose peak reached ORANGE
  or RED, the open spike alerts (a spike's onset), the alerts they name (``details['lead_alert']``),
  the ORANGE+ alerts that closed since the last calm check, and, with ``remedies=``,
  the alerts whose remedy the guard applies (a group YELLOW that names the cause the
  remedy treats: its onset is the fault's). An alert that closed without
  escalating is not in the chain; the monitor opens a new alert (a new episode,
  with its own onset) when a condition that had cleared holds again, and an alert
  the guard saw stop holding (its ``clearing_since`` set) and hold again counts
  from the check it held again, so a closed noise YELLOW never moves the target. ``k``, the margin of one host
  cadence, takes the target older than the last check before ``E``: the metrics
  seen at a check may come from any update since the previous check (that
  check's own included: its effect shows from the next step), so the checkpoint
  of that check may hold a faulty update and the one before is taken; this also
  holds when ``E`` lies between the guard's checks (a change point, or a monitor
  fed more often than the guard acts). ``rewind_steps=N`` also requires
  ``step <= E - N``. Corrupt candidates are quarantined (one log line each,
  ``checkpoint_corrupt`` alerts) and the next older one is tried.
- **Pins**: the newest healthy checkpoint, every rollback target, and the newest
  healthy checkpoint before each open alert's earliest sign (and, with
  ``rewind_steps=N``, the healthy ones of the last ``N`` steps and the newest
  before them) are pinned: retention never deletes them (the store logs what it keeps and why).
- **Quarantine**: the checkpoints after the target up to the red step are sick:
  quarantined, kept for a post-mortem (the newest ``keep_quarantined``), never
  restored by a rollback or :meth:`resume`.
- **Relapse**: red again without a healthy check since the previous rollback:
  the previous target is suspect (quarantined, reason ``relapse``) and an older
  healthy checkpoint is used; if there is none, the suspect is used anyway.
- **Actions after the restore**, each recorded in :attr:`history` (``actions``)
  and in the ``rollback`` event: the LR scale x ``lr_factor`` (compounding; the
  optimizer must be wrapped with :func:`jvitals.with_lr_scale`); ``skip_data``
  (``True``: advance the data position by as many batches as were consumed
  between the target and the red step, i.e. past a bad stretch as long again;
  an int ``N``: by ``N`` batches; the position must then be an int); and
  ``reset_optimizer`` (zero the Adam moments ``mu``/``nu`` of the named
  parameter groups; the count is reset too when every moment of every
  parameter is reset: a fresh Adam); then, with ``remedies=``, the remedy of each
  alert's cause (:mod:`jvitals.guard.remedies`: the alert's group LR x0.5, layer-wise
  LR decay, the QK-clip and z-loss flags in :attr:`Rollback.remedies`), each an
  action ``{"action": "remedy", "text": ...}`` named in the rollback alert's
  message ("applied: embedding LR x0.5"). The flags are saved with every
  checkpoint and restored by :meth:`resume`.
- **The limit**: red after ``max_rollbacks`` rollbacks raises
  :class:`RollbackLimitError` after quarantining the checkpoints saved from the
  fault's earliest sign on; the error names the healthy checkpoints on disk,
  which a restart (:meth:`resume`, a larger ``max_rollbacks``) continues from.
- **Resume** restores the newest healthy checkpoint (of the checkpoints and the
  snapshots), skipping quarantined ones and ones saved during an open ORANGE/RED
  period, and logs which and why.
- **Snapshots** (``snapshots=Snapshots(every=50, keep=2)``): light, frequent,
  asynchronous checkpoints in a second store (local disk, the newest ``keep``
  plus pinned ones) between the cadence checkpoints; they are candidates for a
  rollback and a resume like any other healthy checkpoint.
- **The guard's figures**: with ``writer=`` every call writes
  ``rollback/count`` and ``rollback/lr_scale`` and the guard's events
  (``vitals/events_json``: rollback, save, pause, checkpoint_skipped) through
  :func:`jvitals.write`, at the call's step.
- **Multi-host**: every process calls ``respond``; process 0's level, earliest
  sign and cutoff decide for all (``process_allgather``, which also checks that
  all processes are at the same step). Restores are agreed on. Each process's
  data position is saved and given back to it.

Example (the loop of USER-LOOP.md)::

    tx = vitals.with_lr_scale(optax.chain(vitals.record(optax.clip_by_global_norm(1.0)),
                                          optax.adamw(schedule)))
    monitor = vitals.Monitor()
    guard = vitals.Rollback(ckpt_dir, writer=writer)
    state, position = guard.resume(state, position, monitor)
    for step in range(int(state.step), num_steps):
        state, metrics = train_step(state, loader.batch(position)); position += 1
        if step % 50 == 0:
            verdict = monitor.update(step, jax.device_get(metrics))
            vitals.write(writer, step, host, verdict)
            state = guard.respond(step, state, verdict, position)
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import math
import os
import re
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import numpy as np
import optax

from jvitals.monitor.types import PRESCRIPTIONS, RULE_PRESCRIPTION, Alert, Level
from jvitals.guard.checkpoints import (
    CADENCE,
    MANUAL,
    ORANGE_SAVE,
    QUARANTINE_FILE,
    ROLLBACK_SAVE,
    SNAPSHOT,
    CheckpointInfo,
    CheckpointSaveError,
    CheckpointStore,
    agree,
    allgather_ints,
    allgather_json,
    json_default,
    level_name,
)
from jvitals.optim.lr_scale import has_lr_scale, set_lr_scale
from jvitals.guard.remedies import (
    _matches,
    applied_text,
    apply_remedies,
    causes_of,
    check_regex,
    parse_remedies,
    reapply_lr_groups,
)
from jvitals.guard.events import ROLLBACK_COUNT, ROLLBACK_LR_SCALE, write_events

__all__ = [
    "Action",
    "CheckpointInfo",
    "CheckpointSaveError",
    "QUARANTINE_FILE",
    "Response",
    "Rollback",
    "RollbackError",
    "RollbackLimitError",
    "Snapshots",
    "TrainingPaused",
]

_log = logging.getLogger("jvitals.guard.rollback")
_MOMENTS = ("mu", "nu")


class Action(enum.Enum):
    """What :meth:`Rollback.act` did."""

    CONTINUE = "continue"   # nothing to do at this step
    SAVED = "saved"         # a cadence checkpoint (or a snapshot) was written
    PAUSE = "pause"         # orange: a checkpoint was written; the loop should pause
    ROLLBACK = "rollback"   # red: the returned state is a restored healthy one
    RESUMED = "resumed"     # resume() restored a checkpoint


class Response(NamedTuple):
    """The result of :meth:`Rollback.act`.

    Attributes:
      action: what happened.
      state: the train state to continue with (the input one unless ROLLBACK or RESUMED).
      step: the step the call was made at.
      saved_step: the checkpoint written by this call, or None.
      target_step: the checkpoint restored (ROLLBACK, RESUMED), or None.
      lr_scale: the learning-rate scale in force after the call.
      alerts: alerts raised by the guard at this call (``rule`` ``'rollback'``,
        ``'checkpoint_corrupt'``).
      metrics: ``rollback/*`` scalars to log (see :meth:`Rollback.metrics`).
      events: the guard's events at this call (dicts with ``event`` and ``step``).
      position: the data position to continue from (the input one unless
        ``skip_data`` moved it, or RESUMED).
      snapshot_step: the snapshot written by this call, or None.
    """

    action: Action
    state: Any
    step: int
    saved_step: int | None
    target_step: int | None
    lr_scale: float
    alerts: tuple[Alert, ...]
    metrics: dict[str, float]
    events: tuple[dict[str, Any], ...] = ()
    position: Any = None
    snapshot_step: int | None = None


class Snapshots(NamedTuple):
    """Light recent snapshots between the cadence checkpoints.

    Attributes:
      every: steps between snapshots (a snapshot when ``step // every`` grows and
        no cadence checkpoint is written at that call).
      keep: snapshots kept (the newest; rollback targets are pinned beyond it).
      directory: where (a local disk is best); default ``<directory>/snapshots``.
    """

    every: int = 50
    keep: int = 2
    directory: str | os.PathLike | None = None


class RollbackError(RuntimeError):
    """A red verdict that cannot be answered with a rollback."""


class RollbackLimitError(RollbackError):
    """The run went red again after ``max_rollbacks`` rollbacks.

    Attributes:
      step: the step of the red verdict.
      history: the previous rollbacks (dicts with ``step``, ``to_step``, ``onset_step``,
        ``lr_scale``, ``actions``, ``alerts``).
      alerts: the red verdict's alerts.
      position: the data position at the red step.
      healthy: the healthy checkpoints on disk a restart can continue from, newest first.
    """

    def __init__(self, message: str, *, step: int, history: list[dict[str, Any]],
                 alerts: Sequence[Any], position: Any, healthy: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step, self.history, self.alerts, self.position = step, history, list(alerts), position
        self.healthy = list(healthy)


class TrainingPaused(Exception):
    """Raised by ``respond`` on orange when ``pause='raise'``, after the save.

    Attributes: ``step``, ``saved_step`` (the checkpoint written, or None if this
    orange episode was already saved), ``alerts`` (the verdict's), ``response``.
    """

    def __init__(self, message: str, *, step: int, saved_step: int | None,
                 alerts: Sequence[Any], response: Response) -> None:
        super().__init__(message)
        self.step, self.saved_step, self.alerts, self.response = step, saved_step, list(alerts), response


# ----------------------------------------------------------------------------
# The guard's record of the alerts it has seen.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Seen:
    """One alert id as the guard saw it across its checks."""

    id: int
    rule: str
    onset: int
    departures: tuple[int, ...]
    peak: int
    first_check: int
    revived: int | None = None      # the check at which it held again after clearing
    clearing: bool = False
    closed: int | None = None
    lead: int | None = None

    def sign(self) -> int:
        """The alert's earliest sign: its onset or a change point of its localization."""
        e = min((self.onset, *self.departures))
        return e if self.revived is None else max(e, self.revived)


def _is_spike(rule: str) -> bool:
    """A spike alert (its onset is the spike's first step); periodic patterns are not."""
    return "spike" in rule and rule != "periodic_spike"


def _alert_id(a: Any) -> int | None:
    i = getattr(a, "id", None)
    return int(i) if isinstance(i, (int, np.integer)) and int(i) >= 0 else None


class _AlertLog:
    """What the guard knows of the monitor's alerts, by id (from the verdicts only)."""

    def __init__(self) -> None:
        self.seen: dict[int, _Seen] = {}
        self.last_calm: int | None = None      # last check with no open alert that reached ORANGE

    def observe(self, step: int, verdict: Any) -> None:
        open_alerts = list(getattr(verdict, "alerts", None) or []) if verdict is not None else []
        closed = list(getattr(verdict, "closed_alerts", None) or []) if verdict is not None else []
        now_open = set()
        for a in open_alerts:
            i = _alert_id(a)
            if i is None:
                continue
            now_open.add(i)
            rec = self.seen.get(i)
            clearing = getattr(a, "clearing_since", None) is not None
            deps = tuple(int(loc.departure_step) for loc in (getattr(a, "localization", None) or [])
                         if getattr(loc, "departure_step", None) is not None)
            peak = int(max(int(getattr(a, "peak_level", a.level)), int(a.level)))
            lead = (getattr(a, "details", None) or {}).get("lead_alert")
            if rec is None or rec.closed is not None:
                rec = self.seen[i] = _Seen(i, str(getattr(a, "rule", "")), int(a.onset_step), deps,
                                           peak, step)
            else:
                if rec.clearing and not clearing:
                    rec.revived = step
                rec.onset, rec.departures = int(a.onset_step), deps
                rec.peak = max(rec.peak, peak)
            rec.clearing = clearing
            rec.lead = int(lead) if isinstance(lead, (int, np.integer)) else None
        for a in closed:
            i = _alert_id(a)
            if i is not None and i in self.seen and i not in now_open:
                self.seen[i].closed = step
        for i, rec in self.seen.items():
            if i not in now_open and rec.closed is None:
                rec.closed = step                   # gone from the open alerts: closed
        if all(self.seen[i].peak < Level.ORANGE for i in now_open):
            self.last_calm = step
        if len(self.seen) > 512:                    # forget long-closed alerts
            for i in sorted(i for i, r in self.seen.items() if r.closed is not None)[:-256]:
                del self.seen[i]

    def open_peak(self, verdict: Any) -> int:
        peaks = [self.seen[i].peak for i in self._open_ids(verdict) if i in self.seen]
        return max(peaks, default=int(Level.GREEN))

    @staticmethod
    def _open_ids(verdict: Any) -> list[int]:
        out = []
        for a in (getattr(verdict, "alerts", None) or []) if verdict is not None else []:
            i = _alert_id(a)
            if i is not None:
                out.append(i)
        return out

    def chain_sign(self, verdict: Any, step: int, remedied: Iterable[int] = ()) -> int:
        """Earliest sign of the chain of alerts that escalated to the red (see module doc);
        ``remedied``: ids of the alerts whose remedy the guard applies (in the chain too)."""
        ids = {i for i in self._open_ids(verdict) if i in self.seen and (
            self.seen[i].peak >= Level.ORANGE or _is_spike(self.seen[i].rule))}
        ids |= {i for i in remedied if i in self.seen}
        calm = self.last_calm if self.last_calm is not None else -1
        ids |= {i for i, r in self.seen.items()
                if r.peak >= Level.ORANGE and r.closed is not None and r.closed > calm}
        for i in list(ids):
            lead = self.seen[i].lead
            if lead is not None and lead in self.seen:
                ids.add(lead)
        signs = [self.seen[i].sign() for i in ids]
        if not signs and verdict is not None and getattr(verdict, "onset_step", None) is not None:
            signs.append(int(verdict.onset_step))
        return min(signs) if signs else int(step)

    def open_signs(self, verdict: Any) -> dict[int, int]:
        """``{alert id: earliest sign}`` of the open alerts."""
        return {i: self.seen[i].sign() for i in self._open_ids(verdict) if i in self.seen}


# ----------------------------------------------------------------------------
# Small helpers.
# ----------------------------------------------------------------------------


def _get_field(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(name, None)
    return getattr(state, name, None)


def _set_field(state: Any, name: str, value: Any) -> Any:
    if isinstance(state, Mapping):
        if name not in state:
            return state
        out = dict(state)
        out[name] = value
        return type(state)(out) if type(state) is not dict else out
    if not hasattr(state, name):
        return state
    if hasattr(state, "_replace"):          # NamedTuple
        return state._replace(**{name: value})
    if hasattr(state, "replace"):           # flax.struct / TrainState
        return state.replace(**{name: value})
    if dataclasses.is_dataclass(state):
        return dataclasses.replace(state, **{name: value})
    return state


def _alert_lines(alerts: Iterable[Any], limit: int = 5) -> str:
    lines = [getattr(a, "message", str(a)).split("\n")[0] for a in list(alerts)[:limit]]
    return "; ".join(lines) if lines else "(no alerts)"


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=json_default))


def _check_position(position: Any) -> Any:
    """``position`` as plain JSON types, or a TypeError saying what is accepted."""
    try:
        return _jsonable(position)
    except (TypeError, ValueError) as e:
        raise TypeError(
            "Rollback: the data position must be JSON-serialisable (an int, or a dict/list of "
            f"ints, floats and strings), got {type(position).__name__}: {e}") from e


def _load_monitor(monitor: Any, d: Mapping[str, Any]) -> None:
    """Loads a monitor's saved state into ``monitor`` in place."""
    if hasattr(monitor, "load_state_dict"):
        monitor.load_state_dict(d)
        return
    fresh = type(monitor).from_state_dict(d)
    monitor.__dict__.update(fresh.__dict__)


def _make_alert(rule: str, metric: str, level: Level, step: int, value: float, onset: int,
                message: str, details: dict[str, Any]) -> Alert:
    pres = PRESCRIPTIONS[RULE_PRESCRIPTION.get(rule, "generic")]
    return Alert(id=-1, rule=rule, metric=metric, level=Level(level), step=int(step),
                 value=float(value), baseline=math.nan, ratio=math.nan, onset_step=int(onset),
                 opened_step=int(step), message=message, cause=pres.cause,
                 prescription=pres.prescription, localization=[], peak_level=Level(level),
                 closed_step=int(step), details=details)


def _parse_reset(spec: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``reset_optimizer`` as ``((path regex, moments), ...)``; see :class:`Rollback`."""
    if spec is None or spec is False:
        return ()
    if isinstance(spec, str):
        spec = (spec,)
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, (list, tuple)) and all(isinstance(m, str) for m in spec):
        items = [(".*", tuple(spec))]
    else:
        raise ValueError(f"Rollback expects reset_optimizer=('nu',), ('mu', 'nu') or "
                         f"{{path_regex: moments}}, got {spec!r}")
    out = []
    for pattern, moments in items:
        moments = (moments,) if isinstance(moments, str) else tuple(moments)
        bad = [m for m in moments if m not in _MOMENTS]
        if bad or not moments:
            raise ValueError(f"Rollback: reset_optimizer names Adam moments among {_MOMENTS}, got "
                             f"{moments!r} for {pattern!r}")
        check_regex(pattern, "Rollback: reset_optimizer")
        out.append((str(pattern), moments))
    return tuple(out)


def _path_name(path: Sequence[Any]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _zeros_like(x: Any) -> Any:
    """Zeros of ``x``'s shape, dtype and sharding (no retrace of a jitted step)."""
    if isinstance(x, jax.Array):
        host = np.zeros(x.shape, x.dtype)
        if x.sharding.is_fully_addressable:
            return jax.device_put(host, x.sharding)
        return jax.make_array_from_callback(x.shape, x.sharding, lambda idx: host[idx])
    return np.zeros_like(x)


def reset_adam_moments(state: Any, spec: Sequence[tuple[str, Sequence[str]]]) -> tuple[Any, dict[str, Any]]:
    """Zeroes the Adam moments named by ``spec`` in every ``ScaleByAdamState`` of ``state``.

    Args:
      state: any pytree holding optax Adam states.
      spec: ``((path regex, moments), ...)``; a leaf's moment is reset when the
        leaf's ``/``-joined parameter path matches a regex (``re.search``) listed
        with that moment.

    Returns:
      ``(state, summary)``: the new state, and ``{"leaves": {moment: [paths]},
      "count_reset": bool}`` (the count is zeroed when every moment of every leaf
      was reset: a fresh Adam).
    """
    done: dict[str, list[str]] = {m: [] for m in _MOMENTS}
    total = {"n": 0, "all": True, "found": False}

    def node(x: Any) -> Any:
        if not isinstance(x, optax.ScaleByAdamState):
            return x
        total["found"] = True
        new = {}
        for m in _MOMENTS:
            def leaf(path, v, m=m):
                name = _path_name(path)
                if any(m in ms and re.search(p, name) for p, ms in spec):
                    done[m].append(name)
                    return _zeros_like(v)
                total["all"] = False
                return v
            new[m] = jax.tree_util.tree_map_with_path(leaf, getattr(x, m))
        out = x._replace(mu=new["mu"], nu=new["nu"])
        if total["all"]:
            out = out._replace(count=_zeros_like(x.count))
        return out

    out = jax.tree.map(node, state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if not total["found"]:
        raise ValueError("Rollback(reset_optimizer=...) expects an Adam-family optimizer state "
                         "(optax.ScaleByAdamState, as in adam/adamw) in the train state; found none. "
                         "Pass reset_optimizer=None for this optimizer.")
    count_reset = total["all"] and bool(done["mu"] or done["nu"])
    if not count_reset and total["all"]:
        count_reset = False
    return out, {"leaves": {m: sorted(set(v)) for m, v in done.items() if v}, "count_reset": count_reset}


# ----------------------------------------------------------------------------
# The guard.
# ----------------------------------------------------------------------------


class Rollback:
    """Saves on a cadence, pauses on orange, rolls back on red (see module doc).

    Args:
      directory: the checkpoint directory (created if missing; any path orbax accepts).
      save_every: cadence in steps: a checkpoint at the first call and whenever
        ``step // save_every`` grows.
      keep_last: the newest cadence/rollback checkpoints kept (and the newest of any kind).
      keep_every: cadence checkpoints on multiples of this are kept for good (None: none).
      keep_green: the newest healthy GREEN checkpoints kept beyond ``keep_last``.
      keep_quarantined: the newest quarantined (sick) checkpoints kept for a post-mortem.
      lr_factor: LR scale multiplier per rollback (1.0: leave the LR alone, and no
        :func:`~jvitals.with_lr_scale` is needed).
      max_rollbacks: rollbacks allowed in the run (None: no limit); one more red
        raises :class:`RollbackLimitError`.
      healthy_levels: saved levels a rollback may restore.
      pause: on orange: ``'return'`` (action PAUSE), ``'raise'``
        (:class:`TrainingPaused`) or a callable taking the :class:`Response`.
      monitor: the Monitor whose ``state_dict`` is saved and whose
        ``note_rollback`` is called (also set by :meth:`resume`).
      save_on_rollback: checkpoint the restored state at the red step.
      step_attr: the train state's step field kept forward by a rollback (None:
        leave the restored one).
      sync_save: wait for each save to land (errors at the save call; slower).
      check_finite: reject targets holding non-finite values.
      onset_margin: the least margin in steps before the earliest sign (one host
        cadence, back to the last check before it, is used when larger).
      rewind_steps: restore a checkpoint at least this many steps before the
        earliest sign (the guide: "roll back 10-100 steps before the spike"; None:
        the newest healthy one).
      skip_data: ``False`` (default, the guide: keep the data position), ``True``
        (skip as many batches again as were consumed between the target and the
        red step) or an int ``N`` (skip ``N`` batches); the position must be an int.
        Read the new position from ``guard.position`` (or ``Response.position``).
      reset_optimizer: Adam moments to zero after the restore: ``('nu',)``,
        ``('mu', 'nu')`` (every parameter), or per parameter group
        ``{path_regex: ('mu', 'nu')}`` (matched with ``re.search`` against the
        ``/``-joined parameter path, e.g. ``'embed'``). None: keep them.
      snapshots: a :class:`Snapshots` for light recent snapshots (None: none).
      writer: a clu ``MetricWriter`` (or anything with its ``write_*`` methods):
        the guard writes its figures and events through :func:`jvitals.write`.
      remedies: None (only the LR x ``lr_factor``), ``"default"`` (the table of
        :data:`jvitals.guard.remedies.DEFAULT_REMEDIES`: a group's update-ratio or
        grad-share alert -> that group's LR x0.5; a layer's -> layer-wise LR decay
        0.9; attention logits -> QK-clip at their pre-fault value; output logits
        -> z-loss), or a dict ``{rule id or metric regex: remedy name or
        callable}`` (see :func:`jvitals.guard.remedies.parse_remedies`). Applied at
        each rollback after the restore, on top of ``lr_factor`` (pass
        ``lr_factor=1.0`` for the remedy alone).

    Attributes:
      last_action: the :class:`Action` of the latest call (None before any).
      last_response: the latest :class:`Response`.
      lr_scale: the LR scale in force (compounded over rollbacks).
      history: the rollbacks so far (dicts; saved in the metadata).
      alerts: every alert the guard raised, oldest first.
      events: every event the guard recorded, oldest first.
      position: the data position to continue from after the latest call.
      resumed_step: the checkpoint :meth:`resume` restored (None: fresh start).
      store: the :class:`~jvitals.guard.checkpoints.CheckpointStore` of the checkpoints.
      snapshot_store: the store of the snapshots (None without ``snapshots``).
      remedies: the remedies' flags for the loop (a plain JSON dict, saved with
        each checkpoint, restored by :meth:`resume`): ``"qk_clip_tau"`` (call
        :func:`jvitals.qk_clip` with it), ``"z_loss"`` (the weight of
        :func:`jvitals.z_loss`), ``"layer_decay"`` and ``"lr_groups"`` (the
        group LR scales the guard set, kept in force over later restores).

    Raises:
      CheckpointSaveError: the directory cannot be created or written.
      ValueError: an argument is out of range.
    """

    def __init__(self, directory: str | os.PathLike, *, save_every: int = 500,
                 keep_last: int = 5, keep_every: int | None = 5000, keep_green: int = 1,
                 keep_quarantined: int = 3, lr_factor: float = 0.9,
                 max_rollbacks: int | None = 3,
                 healthy_levels: Iterable[int] = (Level.GREEN, Level.YELLOW),
                 pause: str | Callable[[Response], Any] = "return", monitor: Any = None,
                 save_on_rollback: bool = True, step_attr: str | None = "step",
                 sync_save: bool = False, check_finite: bool = True, onset_margin: int = 1,
                 rewind_steps: int | None = None, skip_data: bool | int = False,
                 reset_optimizer: Any = None, snapshots: Snapshots | None = None,
                 writer: Any = None, remedies: Any = None) -> None:
        self.remedy_table = parse_remedies(remedies)
        if int(save_every) < 1:
            raise ValueError(f"Rollback expects save_every >= 1, got {save_every}")
        if not 0.0 < float(lr_factor) <= 1.0:
            raise ValueError(f"Rollback expects 0 < lr_factor <= 1, got {lr_factor}")
        if max_rollbacks is not None and int(max_rollbacks) < 0:
            raise ValueError(f"Rollback expects max_rollbacks >= 0 or None, got {max_rollbacks}")
        if not (pause in ("return", "raise") or callable(pause)):
            raise ValueError(f"Rollback expects pause='return', 'raise' or a callable, got {pause!r}")
        if int(onset_margin) < 0:
            raise ValueError(f"Rollback expects onset_margin >= 0, got {onset_margin}")
        if rewind_steps is not None and int(rewind_steps) < 0:
            raise ValueError(f"Rollback expects rewind_steps >= 0 or None, got {rewind_steps}")
        if not (isinstance(skip_data, bool) or (isinstance(skip_data, int) and skip_data >= 0)):
            raise ValueError(f"Rollback expects skip_data=False, True or an int >= 0, got {skip_data!r}")
        if snapshots is not None and (int(snapshots.every) < 1 or int(snapshots.keep) < 1):
            raise ValueError(f"Rollback expects Snapshots(every >= 1, keep >= 1), got {snapshots}")
        self.save_every = int(save_every)
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = None if max_rollbacks is None else int(max_rollbacks)
        self.healthy_levels = frozenset(int(x) for x in healthy_levels)
        self.pause = pause
        self.monitor = monitor
        self.save_on_rollback = bool(save_on_rollback)
        self.step_attr = step_attr
        self.sync_save = bool(sync_save)
        self.check_finite = bool(check_finite)
        self.onset_margin = int(onset_margin)
        self.rewind_steps = None if rewind_steps is None else int(rewind_steps)
        self.skip_data = skip_data
        self.reset_optimizer = _parse_reset(reset_optimizer)
        self.snapshots = snapshots
        self.writer = writer

        self.last_action: Action | None = None
        self.last_response: Response | None = None
        self.lr_scale = 1.0
        self.history: list[dict[str, Any]] = []
        self.remedies: dict[str, Any] = {}
        self.alerts: list[Alert] = []
        self.events: list[dict[str, Any]] = []
        self.position: Any = None
        self.resumed_step: int | None = None
        self._pending: list[Alert] = []
        self._pending_events: list[dict[str, Any]] = []
        self._last_regular: int | None = None
        self._last_snapshot: int | None = None
        self._last_healthy_check: int | None = None
        self._orange_saved = False
        self._lr_checked = False
        self._resumed = False
        self._warned_no_resume = False
        self._checks: collections.deque[int] = collections.deque(maxlen=4096)
        self._log = _AlertLog()
        self._open_peak = int(Level.GREEN)

        self.store = CheckpointStore(directory, keep_last=keep_last, keep_every=keep_every,
                                     keep_green=keep_green, keep_quarantined=keep_quarantined,
                                     healthy_levels=self.healthy_levels, name="checkpoints")
        self.directory = self.store.directory
        self.snapshot_store: CheckpointStore | None = None
        if snapshots is not None:
            where = snapshots.directory if snapshots.directory is not None else self.directory / "snapshots"
            self.snapshot_store = CheckpointStore(
                where, keep_last=int(snapshots.keep), keep_every=None, keep_green=0,
                keep_quarantined=0, healthy_levels=self.healthy_levels, name="snapshots",
                quarantine_file=True)
        self._collect_failures()
        regular = [r.step for r in self.store.checkpoints if r.kind in (CADENCE, ROLLBACK_SAVE, MANUAL)
                   and r.quarantined is None]
        self._last_regular = max(regular) if regular else None
        self._found_at_open = max((s.latest_step() for s in self._stores() if s.latest_step() is not None),
                                  default=None)

    # ------------------------------------------------------------------
    # Public API.
    # ------------------------------------------------------------------

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Records of the checkpoints on disk (not the snapshots), oldest first."""
        return self.store.checkpoints

    @property
    def snapshot_checkpoints(self) -> list[CheckpointInfo]:
        """Records of the snapshots on disk, oldest first (empty without ``snapshots``)."""
        return self.snapshot_store.checkpoints if self.snapshot_store is not None else []

    @property
    def quarantined(self) -> dict[int, str]:
        """``{step: reason}`` of the checkpoints (not snapshots) that are never restored."""
        return self.store.quarantined

    @property
    def pins(self) -> dict[int, str]:
        """``{step: why}`` of the checkpoints retention never deletes."""
        return dict(self.store.pins)

    def metrics(self) -> dict[str, float]:
        """Scalars to log at any step: ``rollback/count`` and ``rollback/lr_scale``."""
        return {ROLLBACK_COUNT: float(len(self.history)), ROLLBACK_LR_SCALE: float(self.lr_scale)}

    def resume(self, state: Any, position: Any = None, monitor: Any = None) -> tuple[Any, Any]:
        """Restores the newest healthy checkpoint, if any (after a crash or a restart).

        Picks, among the checkpoints and snapshots, the newest healthy one (saved
        at a healthy level with no open ORANGE/RED alert, not quarantined, restores
        on every process and is finite); logs which and why the newer ones were
        skipped. Loads the monitor's state from it into ``monitor``, and the LR
        scale and rollback history into the guard. Without a healthy checkpoint
        a relapse suspect is used; without any, the inputs are returned.

        Args:
          state: a train state of the right structure, shapes, dtypes and shardings
            (the freshly initialised one): the restore target.
          position: the data position to use when there is no checkpoint.
          monitor: the Monitor to restore (in place) and to use from now on.

        Returns:
          ``(state, position)``: restored from the checkpoint (this process's
          position), or the inputs unchanged when the directory has none.
        """
        if monitor is not None:
            self.monitor = monitor
        self._resumed = True
        self._check_lr_scale(state)
        for s in self._stores():
            s.wait()
        found = self._first_restorable(None, state, finite=self.check_finite)
        skipped = [f"{r.step} ({self._why_not(r)})" for r in self._all_records()
                   if found is None or r.step > found[0].step]
        if found is None:
            if skipped:
                _log.warning("Rollback: resume found no healthy checkpoint in %s (skipped: %s); "
                             "starting fresh.", self.directory, ", ".join(skipped))
            self.position = position
            self._done(Response(Action.CONTINUE, state, -1, None, None, self.lr_scale,
                                tuple(self._drain()), self.metrics(), tuple(self._drain_events()),
                                position))
            return state, position
        rec, restored, meta = found
        _log.info("Rollback: resumed from %s %d (%s, %s)%s.", rec.store, rec.step, rec.kind,
                  level_name(rec.level), f"; skipped newer: {', '.join(skipped)}" if skipped else "")
        if self.monitor is not None and meta.get("monitor") is not None:
            _load_monitor(self.monitor, meta["monitor"])
        self.lr_scale = float(meta.get("lr_scale", 1.0))
        self.history = list(meta.get("rollbacks", []))
        self.remedies = dict(meta.get("remedies") or {})
        self.resumed_step = rec.step
        self._last_regular = rec.step
        self._last_snapshot = rec.step
        checks = [r.step for r in self._all_records() if r.step <= rec.step
                  and r.level in self.healthy_levels and r.kind != ROLLBACK_SAVE]
        self._last_healthy_check = max(checks) if checks else None
        self._orange_saved = False
        positions = meta.get("positions")
        if isinstance(positions, list) and len(positions) == jax.process_count():
            position = positions[jax.process_index()]
        else:
            position = meta.get("position")
        self.position = position
        self._update_pins(None)
        self._event({"event": "resume", "step": rec.step, "store": rec.store, "kind": rec.kind,
                     "skipped": skipped})
        self._done(Response(Action.RESUMED, restored, rec.step, None, rec.step, self.lr_scale,
                            tuple(self._drain()), self.metrics(), tuple(self._drain_events(keep=True)),
                            position))
        return restored, position

    def respond(self, step: int, state: Any, verdict: Any, position: Any = None) -> Any:
        """Acts on ``verdict`` and returns the state to continue with.

        See :meth:`act`; this returns only ``act(...).state`` (the action is in
        :attr:`last_action`, the data position to continue from in :attr:`position`).
        """
        return self.act(step, state, verdict, position).state

    def act(self, step: int, state: Any, verdict: Any, position: Any = None) -> Response:
        """Saves, pauses or rolls back according to ``verdict``.

        Args:
          step: the loop's step (the checkpoint number); same on every process, increasing.
          state: the current train state (any pytree; never modified).
          verdict: this process's ``Monitor.update`` result (None: GREEN). On
            several processes, process 0's decides for all.
          position: the data position after this step (JSON-serialisable).

        Returns:
          A :class:`Response`; its ``state`` is the restored one on ROLLBACK.

        Raises:
          RollbackLimitError: red after ``max_rollbacks`` rollbacks.
          RollbackError: red and no healthy checkpoint before the earliest sign.
          TrainingPaused: orange with ``pause='raise'`` (after the save).
          CheckpointSaveError: a save failed (the state is untouched).
        """
        step = int(step)
        _check_position(position)
        if self.skip_data is not False and not isinstance(position, (int, np.integer)):
            raise TypeError(f"Rollback(skip_data={self.skip_data!r}) expects an int data position "
                            f"(batches consumed), got {type(position).__name__} {position!r}; pass "
                            "an int, or skip_data=False and skip in your loader.")
        self._log.observe(step, verdict)
        self._checks.append(step)
        level, sign, cutoff = self._decide(step, verdict)
        self._check_lr_scale(state)
        if not self._resumed and self._found_at_open is not None and not self._warned_no_resume:
            self._warned_no_resume = True
            _log.warning("Rollback: %s already held checkpoints up to step %d but resume() "
                         "was not called; starting fresh alongside them.",
                         self.directory, self._found_at_open)
        for s in self._stores():
            s.poll()
        alerts = self._drain()
        open_peak = max(self._open_peak, level)
        self.position = position
        if level >= Level.RED:
            response = self._rollback(step, state, verdict, position, sign, cutoff, alerts)
        elif level == Level.ORANGE:
            saved = None
            if not self._orange_saved:
                saved = self._save(step, state, position, level, ORANGE_SAVE, open_peak=open_peak)
                self._orange_saved = True
                self._event({"event": "pause", "step": step, "saved_step": saved})
            response = Response(Action.PAUSE, state, step, saved, None, self.lr_scale,
                                tuple(alerts + self._drain()), self.metrics(),
                                tuple(self._drain_events()), position)
        else:
            self._orange_saved = False
            saved = snap = None
            if self._cadence_due(step):
                saved = self._save(step, state, position, level, CADENCE, open_peak=open_peak)
            elif self._snapshot_due(step) and open_peak < Level.ORANGE:
                snap = self._save(step, state, position, level, SNAPSHOT, open_peak=open_peak)
            response = Response(Action.SAVED if saved is not None or snap is not None else Action.CONTINUE,
                                state, step, saved, None, self.lr_scale, tuple(alerts + self._drain()),
                                self.metrics(), tuple(self._drain_events()), position, snap)
        if level in self.healthy_levels:
            self._last_healthy_check = step
        self._update_pins(verdict)
        self._done(response)
        self._write(step, response)
        if response.action is Action.PAUSE:
            self._pause(response, verdict)
        return response

    def save(self, step: int, state: Any, position: Any = None, *, level: int = Level.GREEN) -> int | None:
        """Saves a checkpoint now (kind ``'manual'``), e.g. at the end of training.

        Returns:
          The step saved, or None if a usable checkpoint of that step exists.
        """
        return self._save(int(step), state, position, int(level), MANUAL)

    def restore(self, step: int, state: Any) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint (or snapshot) ``step`` onto ``state``'s structure and shardings.

        For inspection (a post-mortem of a quarantined checkpoint too); the guard's
        own bookkeeping is not changed.

        Returns:
          ``(state, metadata)``.
        """
        step = int(step)
        store = self.store
        if step not in self.store.records and self.snapshot_store is not None \
                and step in self.snapshot_store.records:
            store = self.snapshot_store
        return store.restore(step, state)

    def wait(self) -> None:
        """Blocks until pending saves have landed.

        Raises:
          CheckpointSaveError: an asynchronous save failed.
        """
        for s in self._stores():
            s.wait()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        try:
            self.wait()
        finally:
            for s in self._stores():
                s.close()

    def __enter__(self) -> "Rollback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------
    # Decisions.
    # ------------------------------------------------------------------

    def _stores(self) -> list[CheckpointStore]:
        return [self.store] + ([self.snapshot_store] if self.snapshot_store is not None else [])

    def _all_records(self) -> list[CheckpointInfo]:
        """Every record of every store, newest first (a checkpoint before a snapshot at one step)."""
        recs = [r for s in self._stores() for r in s.records.values()]
        return sorted(recs, key=lambda r: (-r.step, r.store != "checkpoints"))

    def _store_of(self, rec: CheckpointInfo) -> CheckpointStore:
        return self.store if rec.store == self.store.name else self.snapshot_store  # type: ignore[return-value]

    def _why_not(self, rec: CheckpointInfo) -> str:
        if rec.quarantined:
            return f"quarantined: {rec.quarantined}"
        if rec.level not in self.healthy_levels:
            return f"saved at {level_name(rec.level)}"
        if rec.open_peak >= Level.ORANGE:
            return f"saved during an open {level_name(rec.open_peak)} alert"
        return "not needed"

    def _decide(self, step: int, verdict: Any) -> tuple[int, int, int]:
        """Process 0's (level, earliest sign, cutoff), the same on every process (and its
        open peak level, in ``_open_peak``)."""
        level = int(getattr(verdict, "level", Level.GREEN)) if verdict is not None else int(Level.GREEN)
        sign = self._log.chain_sign(verdict, step, self._remedied(verdict)) if level >= Level.RED else step
        rows = allgather_ints([step, level, sign, self._cutoff(sign), self._log.open_peak(verdict)])
        if (rows[:, 0] != rows[0, 0]).any():
            raise RuntimeError(
                f"Rollback: processes called respond at different steps {rows[:, 0].tolist()}; "
                "expected every process at the same step. Call respond at the same steps on "
                "every process.")
        self._open_peak = int(rows[0, 4])
        return int(rows[0, 1]), int(rows[0, 2]), int(rows[0, 3])

    def _remedied(self, verdict: Any) -> set[int]:
        """Ids of the verdict's alerts (open, and closed at this check) whose cause has a
        remedy in the guard's table: the alerts :func:`apply_remedies` acts on."""
        if not self.remedy_table or verdict is None:
            return set()
        alerts = list(getattr(verdict, "alerts", None) or []) + list(
            getattr(verdict, "closed_alerts", None) or [])
        return {c.alert_id for c in causes_of(alerts)
                if c.alert_id >= 0 and any(_matches(p, c) for p, _ in self.remedy_table)}

    def _cutoff(self, sign: int) -> int:
        """A target's step must be below this: one host cadence before the earliest sign.

        The metrics seen at a check may come from any update since the previous
        check, that check's own included (its effect shows from the next step), so
        the target must be older than the last check before ``sign``: with ``sign``
        at a check, the previous check; with ``sign`` between checks (a change
        point, or a monitor fed more often than the guard acts), the check before
        it. Without an earlier check: ``sign - onset_margin``.
        """
        before = [c for c in self._checks if c < sign]
        cutoff = sign - self.onset_margin
        if before:
            cutoff = min(cutoff, max(before))
        return cutoff

    def _cadence_due(self, step: int) -> bool:
        last = self._last_regular
        return last is None or step // self.save_every > last // self.save_every

    def _snapshot_due(self, step: int) -> bool:
        if self.snapshot_store is None:
            return False
        every = int(self.snapshots.every)  # type: ignore[union-attr]
        last = max((x for x in (self._last_snapshot, self._last_regular) if x is not None), default=None)
        return last is None or step // every > last // every

    def _first_restorable(self, before: int | None, like: Any, *, finite: bool,
                          not_after: int | None = None) -> tuple[CheckpointInfo, Any, dict] | None:
        """The newest healthy checkpoint (``step < before``, ``<= not_after``) that restores."""
        for allow_suspect in (False, True):
            for rec in self._all_records():
                if before is not None and rec.step >= before:
                    continue
                if not_after is not None and rec.step > not_after:
                    continue
                store = self._store_of(rec)
                if not store.is_healthy(rec, allow_suspect=allow_suspect):
                    continue
                got = store.try_restore(rec.step, like, finite=finite)
                self._collect_failures()
                if got is not None:
                    if allow_suspect:
                        _log.warning("Rollback: no healthy checkpoint left; using the relapse "
                                     "suspect %d (%s).", rec.step, rec.quarantined)
                    return (rec, *got)
        return None

    def _update_pins(self, verdict: Any) -> None:
        """Pins the newest healthy checkpoint, the rollback targets, and the newest healthy
        one before each open alert's earliest sign."""
        pins: dict[int, str] = {}
        for h in self.history:
            pins.setdefault(int(h["to_step"]), f"rollback target (restored at step {h['step']})")
            if h.get("source_step") is not None:
                pins.setdefault(int(h["source_step"]), f"params of a rollback target (step {h['step']})")
        recs = [r for r in self._all_records() if self._store_of(r).is_healthy(r)]
        if recs:
            pins.setdefault(recs[0].step, "newest healthy")
        rewind = self.rewind_steps
        if rewind is not None and self._checks:
            now = max(self._checks)
            # Any later onset is >= now: keep the newest healthy checkpoint at least N
            # steps back, and the newer healthy ones that will take its place.
            reserve = [r for r in recs if r.step <= now - rewind]
            floor = reserve[0].step if reserve else -1
            for r in recs:
                if r.step >= floor:
                    pins.setdefault(r.step, f"rewind_steps={rewind} reserve (step {now})")
        for i, sign in sorted(self._log.open_signs(verdict).items()):
            cut = self._cutoff(sign)
            before = [r for r in recs if r.step < cut and (rewind is None or r.step <= sign - rewind)]
            if before:
                pins.setdefault(before[0].step, f"newest healthy before the onset {sign} of open alert "
                                                f"#{i} ({self._log.seen[i].rule})")
        if jax.process_count() > 1:
            pins = {int(s): r for s, r in allgather_json({str(s): r for s, r in pins.items()})[0].items()}
        for s in self._stores():
            s.set_pins(pins)

    # ------------------------------------------------------------------
    # Red.
    # ------------------------------------------------------------------

    def _rollback(self, step: int, state: Any, verdict: Any, position: Any, sign: int,
                  cutoff: int, alerts: list[Alert]) -> Response:
        verdict_alerts = list(getattr(verdict, "alerts", []) or [])
        not_after = None if self.rewind_steps is None else sign - self.rewind_steps
        for s in self._stores():
            s.wait()
        if self.max_rollbacks is not None and len(self.history) >= self.max_rollbacks:
            self._limit(step, verdict_alerts, position, sign, cutoff)
        if self.history and (self._last_healthy_check is None
                             or self._last_healthy_check <= self.history[-1]["step"]):
            prev = self.history[-1]
            reason = (f"relapse: red again at step {step} without a healthy check since the "
                      f"rollback at step {prev['step']} to step {prev['to_step']}")
            source = prev.get("source_step", prev["to_step"])
            for r in self._all_records():
                if r.quarantined is None and (r.step == prev["to_step"]
                                              or r.restored_from in (prev["to_step"], source)):
                    self._store_of(r).quarantine(r.step, reason)
        found = self._first_restorable(cutoff, state, finite=self.check_finite, not_after=not_after)
        if found is None:
            listing = ", ".join(f"{r.step}:{level_name(r.level)}" + (f" ({self._why_not(r)})"
                                if not self._store_of(r).is_healthy(r) else "")
                                for r in reversed(self._all_records())) or "none"
            for s in self._stores():
                s.write_quarantine()
            bound = f"step {cutoff}" + (f" and at most step {not_after}" if not_after is not None else "")
            raise RollbackError(
                f"Rollback: red at step {step} (earliest sign {sign}) but no "
                f"healthy checkpoint before {bound} in {str(self.directory)!r}; expected one saved at "
                f"a level in {sorted(level_name(x) for x in self.healthy_levels)} with no open "
                f"ORANGE/RED alert that restores. On disk: {listing}. Alerts: "
                f"{_alert_lines(verdict_alerts)}. Save earlier (a smaller save_every, snapshots=, "
                "or a larger keep_last) or restart from an older run.")
        rec, restored, meta = found
        alerts.extend(self._drain())            # corrupt candidates skipped on the way
        target = rec.step
        source = rec.restored_from if rec.restored_from is not None else target   # whose params
        for r in self._all_records():
            if target < r.step <= step and r.quarantined is None:
                self._store_of(r).quarantine(
                    r.step, f"sick: after rollback target {target}; red at step {step} (earliest sign {sign})")
        actions: list[dict[str, Any]] = [{"action": "restore", "to_step": target, "store": rec.store}]
        new_scale = self.lr_scale * self.lr_factor
        if self.lr_factor != 1.0:
            restored = set_lr_scale(restored, new_scale)
            actions.append({"action": "lr_scale", "factor": self.lr_factor, "value": new_scale})
        if self.step_attr is not None:
            current = _get_field(state, self.step_attr)
            if current is not None:
                restored = _set_field(restored, self.step_attr, current)
        if self.reset_optimizer:
            restored, summary = reset_adam_moments(restored, self.reset_optimizer)
            actions.append({"action": "reset_optimizer",
                            "spec": {p: list(m) for p, m in self.reset_optimizer},
                            "moments": sorted(summary["leaves"]),
                            "leaves": sum(len(v) for v in summary["leaves"].values()),
                            "count_reset": summary["count_reset"]})
        if self.remedy_table:
            restored = reapply_lr_groups(restored, self.remedies)
            closed = list(getattr(verdict, "closed_alerts", []) or [])
            restored, flags, applied = apply_remedies(restored, verdict_alerts + closed,
                                                      self.remedy_table, self.remedies,
                                                      lr_factor=self.lr_factor)
            self.remedies = flags
            actions.extend(applied)
        new_position = position
        if self.skip_data is not False:
            positions = meta.get("positions")
            then = positions[jax.process_index()] if isinstance(positions, list) and \
                len(positions) == jax.process_count() else meta.get("position")
            n = int(self.skip_data) if not isinstance(self.skip_data, bool) else \
                max(0, int(position) - int(then if isinstance(then, (int, float)) else position))
            new_position = int(position) + n
            actions.append({"action": "skip_data", "batches": n, "from_position": int(position),
                            "position": new_position})
        self.lr_scale = new_scale
        self.position = new_position
        self.history.append({"step": step, "to_step": target, "source_step": source,
                             "onset_step": sign, "cutoff": cutoff,
                             "lr_scale": new_scale, "position": _jsonable(new_position),
                             "actions": actions,
                             "alerts": [_alert_lines([a]) for a in verdict_alerts[:5]]})
        note = None
        if self.monitor is not None and hasattr(self.monitor, "note_rollback"):
            note = self.monitor.note_rollback(step, target)
        did = ", ".join(_action_text(a) for a in actions[1:] if a["action"] != "remedy") or "no other action"
        cure = applied_text(actions)
        did += f"; {cure}" if cure else ""
        message = (f"[RED] rolled back at step {step} (earliest sign {sign}) to the healthy {rec.store[:-1]} "
                   f"of step {target}; {did}; data position {new_position!r}; "
                   f"{len(self.history)} rollback(s) so far; quarantined: {sorted(self.quarantined)}. "
                   f"Cause: {_alert_lines(verdict_alerts, 2)}")
        alerts.append(_make_alert("rollback", ROLLBACK_COUNT, Level.RED, step, len(self.history), sign,
                                  message, {"to_step": target, "lr_scale": new_scale, "actions": actions,
                                            "monitor_alert_id": getattr(note, "id", None)}))
        self._event({"event": "rollback", "step": step, "to_step": target, "onset_step": sign,
                     "lr_scale": new_scale, "position": _jsonable(new_position), "actions": actions,
                     "remedies": [a["text"] for a in actions if a["action"] == "remedy"],
                     "reason": _alert_lines(verdict_alerts, 1)})
        for s in self._stores():
            s.write_quarantine()
        self._orange_saved = False
        saved = None
        if self.save_on_rollback:
            saved = self._save(step, restored, new_position, rec.level, ROLLBACK_SAVE, restored_from=source)
        metrics = {**self.metrics(), "rollback/from_step": float(step), "rollback/to_step": float(target)}
        return Response(Action.ROLLBACK, restored, step, saved, target, new_scale,
                        tuple(alerts + self._drain()), metrics, tuple(self._drain_events()), new_position)

    def _limit(self, step: int, verdict_alerts: list[Any], position: Any, sign: int, cutoff: int) -> None:
        """Raises :class:`RollbackLimitError` after quarantining what was saved since the sign."""
        for r in self._all_records():
            if r.step >= cutoff and r.quarantined is None and r.step <= step:
                self._store_of(r).quarantine(
                    r.step, f"sick: saved after the earliest sign {sign} of the red at step {step} "
                            "(rollback limit reached)")
        healthy = [r.step for r in self._all_records() if self._store_of(r).is_healthy(r)]
        for s in self._stores():
            s.write_quarantine()
        self._update_pins(None)
        done = ", ".join(f"{h['step']}->{h['to_step']}" for h in self.history) or "none"
        self._event({"event": "rollback_limit", "step": step, "onset_step": sign, "healthy": healthy})
        raise RollbackLimitError(
            f"Rollback: {len(self.history)} rollback(s) already (steps {done}; LR scale now "
            f"{self.lr_scale:.4g}) and the run went red again at step {step} (earliest sign "
            f"{sign}): {_alert_lines(verdict_alerts)}. max_rollbacks={self.max_rollbacks} "
            f"reached: lower the learning rate further or inspect the data at position "
            f"{position!r}. Healthy checkpoints on disk in {str(self.directory)!r}, newest first: "
            f"{healthy or 'none'}; a restart (Rollback(..., max_rollbacks=N).resume()) continues "
            f"from {healthy[0] if healthy else 'nothing'}; quarantined: {sorted(self.quarantined)}.",
            step=step, history=list(self.history), alerts=verdict_alerts, position=position,
            healthy=healthy)

    # ------------------------------------------------------------------
    # Orange.
    # ------------------------------------------------------------------

    def _pause(self, response: Response, verdict: Any) -> None:
        if self.pause == "return":
            return
        if self.pause == "raise":
            where = (f"checkpoint saved as step {response.saved_step}" if response.saved_step is not None
                     else "this orange episode was already saved")
            raise TrainingPaused(
                f"Rollback: training paused at step {response.step} on ORANGE "
                f"({_alert_lines(getattr(verdict, 'alerts', []) or [])}); {where} in "
                f"{str(self.directory)!r}. Fix the cause, then restart and call guard.resume() "
                "(it resumes from the newest healthy checkpoint).",
                step=response.step, saved_step=response.saved_step,
                alerts=getattr(verdict, "alerts", []) or [], response=response)
        self.pause(response)

    # ------------------------------------------------------------------
    # Saving.
    # ------------------------------------------------------------------

    def _save(self, step: int, state: Any, position: Any, level: int, kind: str,
              restored_from: int | None = None, open_peak: int = 0) -> int | None:
        position = _check_position(position)
        store = self.snapshot_store if kind == SNAPSHOT else self.store
        assert store is not None
        positions = allgather_json(position)
        meta = {
            "position": positions[0], "positions": positions,
            "monitor": self.monitor.state_dict() if self.monitor is not None and hasattr(
                self.monitor, "state_dict") else None,
            "rollback_count": len(self.history), "rollbacks": self.history,
            "remedies": self.remedies,
        }
        saved = store.save(step, state, meta, level=level, kind=kind, restored_from=restored_from,
                           open_peak=open_peak, lr_scale=self.lr_scale, sync=self.sync_save)
        if saved is not None:
            if kind in (CADENCE, ROLLBACK_SAVE, MANUAL):
                self._last_regular = step
            if kind == SNAPSHOT:
                self._last_snapshot = step
            self._event({"event": "save" if kind != SNAPSHOT else "snapshot", "step": step,
                         "kind": kind, "level": level_name(level)})
        return saved

    # ------------------------------------------------------------------
    # Small helpers.
    # ------------------------------------------------------------------

    def _check_lr_scale(self, state: Any) -> None:
        if self._lr_checked or self.lr_factor == 1.0:
            return
        if not has_lr_scale(state):
            raise ValueError(
                f"Rollback(lr_factor={self.lr_factor}) expects the train state's optimizer to be "
                "wrapped with jvitals.with_lr_scale(tx) (an inject_hyperparams state holding "
                f"'lr_scale'), found none in the {type(state).__name__}. Build the optimizer as "
                "tx = jvitals.with_lr_scale(tx), or pass lr_factor=1.0 to keep the LR.")
        self._lr_checked = True

    def _collect_failures(self) -> None:
        """Turns the stores' skipped checkpoints into alerts and events (one each)."""
        for s in self._stores():
            for step, reason in s.failures:
                self._pending.append(_make_alert(
                    "checkpoint_corrupt", "checkpoint/corrupt", Level.YELLOW, step, step, step,
                    f"[YELLOW] {s.name[:-1]} of step {step} in {str(s.directory)!r} cannot be used "
                    f"({reason}); skipped and quarantined.", {"reason": reason}))
                self._event({"event": "checkpoint_skipped", "step": step, "store": s.name,
                             "reason": reason})
            s.failures.clear()

    def _event(self, e: dict[str, Any]) -> None:
        self._pending_events.append(e)
        self.events.append(e)

    def _drain(self) -> list[Alert]:
        self._collect_failures()
        out, self._pending = self._pending, []
        return out

    def _drain_events(self, keep: bool = False) -> list[dict[str, Any]]:
        out = list(self._pending_events)
        if not keep:
            self._pending_events = []
        return out

    def _done(self, response: Response) -> None:
        self.alerts.extend(response.alerts)
        self.last_response = response
        self.last_action = response.action

    def _write(self, step: int, response: Response) -> None:
        if self.writer is None:
            return
        write_events(self.writer, step, response.metrics, response.events)


def _action_text(a: Mapping[str, Any]) -> str:
    kind = a.get("action")
    if kind == "lr_scale":
        return f"LR scale {a['value']:.4g} (x{a['factor']} per rollback)"
    if kind == "skip_data":
        return f"skipped {a['batches']} batches"
    if kind == "remedy":
        return str(a.get("text"))
    if kind == "reset_optimizer":
        return f"reset Adam {'/'.join(a['moments']) or 'nothing'} of {a['leaves']} leaves" + (
            " and its count" if a.get("count_reset") else "")
    return str(kind)
