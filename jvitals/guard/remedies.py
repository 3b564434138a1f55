"""The guard's prescriptions: from an alert's cause to a remedy applied at a rollback.

:class:`jvitals.Rollback` (``Recovery(remedies="default")`` or a dict) calls
:func:`apply_remedies` after it has restored the healthy checkpoint. Each alert of
the red verdict (open and just closed) is read as a :class:`Cause` (its rule, its
metric, the group the metric names) and matched against a table ``{pattern:
remedy}``; a pattern matches a cause when it equals the alert's rule id or
``re.search``-es its metric. The default table (:data:`DEFAULT_REMEDIES`, from
METRICS.md §6), what each remedy does, the fallbacks without LR groups, the flags
for the loop and a user's own remedy are in docs/REMEDIES.md, "The guard applies them".

Every function here is pure: it returns a new state and a new flags dict, and
leaves its inputs alone.
"""


from __future__ import annotations

import copy
import math
import re
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, Union

from jvitals.monitor.types import split_group
from jvitals.optim.lr_scale import REMEDY_SETTINGS, get_lr_scales, has_remedy, set_lr_scale, set_remedy

__all__ = [
    "DEFAULT_REMEDIES",
    "REMEDY_NAMES",
    "Cause",
    "RemedyTable",
    "apply_remedies",
    "applied_text",
    "causes_of",
    "parse_remedies",
    "reapply_remedies",
    "remedied_ids",
    "restart_without",
]

GROUP_LR_FACTOR = 0.5
"""``group_lr``: the group's LR scale multiplier (METRICS.md §6: "embedding and LM head at 0.5x")."""

LAYER_DECAY = 0.9
"""``layer_decay``: the decay (METRICS.md §6: 0.85-0.95)."""

Z_LOSS_WEIGHT = 1e-4
"""``z_loss``: the weight set in ``flags["z_loss"]`` (PaLM's 1e-4)."""

REMEDY_NAMES: tuple[str, ...] = ("group_lr", "layer_decay", "qk_clip", "z_loss", "lr_factor")
"""The built-in remedies; ``lr_factor`` does nothing beyond the guard's global LR factor."""


def _add_flag(flags: dict[str, Any], key: str, values: Iterable[Any]) -> list[Any]:
    have = list(flags.get(key) or [])
    for v in values:
        if v not in have:
            have.append(v)
    flags[key] = have
    return have


def restart_without(state: Any, cause: Cause, flags: dict[str, Any]) -> tuple[Any, str]:
    """The per-replica rule's remedy (the default table's ``replica/`` entry): a sick device
    is cured by leaving its host out, not by a lower learning rate.

    The guard cannot remove a host: after it restored the healthy checkpoint this flags
    the host for the restart (``flags["exclude_hosts"]``, ``flags["exclude_devices"]``,
    saved with every checkpoint and given back by ``resume``) and says so in the
    rollback's message; a suspect data shard is flagged as ``flags["suspect_data"]`` for
    the loader; an unknown suspect is only named. The state is returned unchanged.

    Args:
      state: the restored train state.
      cause: a :class:`Cause` of the ``replica`` rule (its ``details`` name the replica,
        devices, processes, hosts, the suspect and the data shards seen).
      flags: the guard's remedies dict, updated in place.

    Returns:
      ``(state, text)``.
    """
    d = dict(cause.details or {})
    suspect, r = d.get("suspect", "unknown"), d.get("replica", "?")
    hosts, devices = list(d.get("hosts") or []), list(d.get("devices") or [])
    data = [x for x in (d.get("data_seen") or []) if x is not None]
    if suspect == "device":
        _add_flag(flags, "exclude_hosts", hosts)
        _add_flag(flags, "exclude_devices", devices)
        where = f"host {', '.join(map(str, hosts))}" if hosts else f"replica {r}'s host"
        return state, (f"restart without {where} (devices {', '.join(map(str, devices)) or '?'}, "
                       f"replica {r}) from this healthy checkpoint: its device is suspect, and a lower "
                       f"learning rate is not the cure; flagged exclude_hosts")
    if suspect == "data" and data:
        _add_flag(flags, "suspect_data", data[-1:])
        return state, (f"data shard {data[-1]} is suspect: skip or repair it (flagged suspect_data "
                       "for the loader); hosts kept")
    return state, (f"replica {r} (hosts {', '.join(map(str, hosts)) or '?'}) left the other replicas, "
                   "device or data not told apart: rotate the data shards between replicas to tell")


DEFAULT_REMEDIES: Mapping[str, Any] = {
    r"^replica/": restart_without,   # the per-replica rule's alerts: a callable, see restart_without
    r"^(update/param_ratio|grad/share|param/norm)/(embedding|lm_head)$": "group_lr",
    r"^(update/param_ratio|grad/share)/layer_\d+$": "layer_decay",
    r"^act/attn_logits": "qk_clip",
    r"^act/(output_layer_logits|logits)": "z_loss",
}
"""The ``remedies="default"`` table: metric regex -> remedy name, or the callable
:func:`restart_without` for the per-replica rule's alerts (see the module doc)."""

Remedy = Union[str, Callable[..., Any]]
RemedyTable = tuple[tuple[str, Remedy], ...]


class Cause(NamedTuple):
    """One alert as a cause for a remedy.

    Attributes:
      rule: the alert's rule id (``'group'``, ``'ratio'``, ``'divergence'``...).
      metric: the metric it watches (``'update/param_ratio/embedding'``).
      group: the parameter group the alert names (``details['group']``, else the
        metric's last part when it is ``embedding``, ``lm_head`` or ``layer_{i}``),
        or None.
      level: the alert's level (an int).
      value: the metric's latest value.
      baseline: the metric's pre-fault reference (NaN if none).
      alert_id: the monitor's alert id (-1 if none).
      details: the alert's ``details`` (the per-replica rule's names and suspicion), or None.
    """

    rule: str
    metric: str
    group: str | None
    level: int
    value: float
    baseline: float
    alert_id: int = -1
    details: Mapping[str, Any] | None = None


def _get(a: Any, name: str, default: Any = None) -> Any:
    if isinstance(a, Mapping):
        return a.get(name, default)
    return getattr(a, name, default)


def _float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


_SUMMARIES = ("divergence", "rollback")
"""Rules whose alert summarizes others (it names the lead alert's metric)."""


def causes_of(alerts: Iterable[Any]) -> list[Cause]:
    """The alerts (``Alert`` objects or their dict form: ``state_dict()``, ``to_dict()``) as :class:`Cause` s.

    Args:
      alerts: the red verdict's alerts (open ones first, then the just-closed ones).

    Returns:
      One cause per alert with a metric, in the given order, duplicates (same
      alert id) dropped; the divergence rule's alerts last (a RED that names its lead's
      metric: the lead's own alert carries the remedy's details, e.g. the QK-clip tau).
    """
    out, seen = [], set()
    alerts = sorted(alerts, key=lambda a: str(_get(a, "rule", "")) in _SUMMARIES)
    for a in alerts:
        metric = str(_get(a, "metric", "") or "")
        if not metric:
            continue
        i = _get(a, "id", -1)
        i = int(i) if isinstance(i, int) else -1
        if i >= 0 and i in seen:
            continue
        seen.add(i)
        details = _get(a, "details", None) or {}
        group = details.get("group") if isinstance(details, Mapping) else None
        if group is None:
            sg = split_group(metric)
            group = sg[1] if sg else None
        out.append(Cause(str(_get(a, "rule", "")), metric, None if group is None else str(group),
                         int(_get(a, "level", 0) or 0), _float(_get(a, "value")),
                         _float(_get(a, "baseline")), i,
                         dict(details) if isinstance(details, Mapping) else None))
    return out


def check_regex(pattern: str, where: str) -> None:
    """Raises a ValueError naming ``where`` and ``pattern`` if ``pattern`` is not a
    regular expression (a table key of ``Recovery(remedies=)`` or ``reset_optimizer=``)."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{where} key {pattern!r} is not a regular expression ({e})") from e


def parse_remedies(remedies: None | str | Mapping[str, Remedy]) -> RemedyTable:
    """The ``Recovery(remedies=...)`` argument as an ordered table.

    Args:
      remedies: None (no table), ``"default"`` (:data:`DEFAULT_REMEDIES`) or a
        mapping ``{pattern: remedy}``: a pattern is a rule id or a metric regex; a
        remedy is a name in :data:`REMEDY_NAMES` or a callable
        ``fn(state, cause, flags) -> state | (state, text)``.

    Returns:
      ``((pattern, remedy), ...)`` in the mapping's order (the first match of a
      cause wins).

    Raises:
      ValueError: an unknown string, a remedy name that does not exist, or a
        pattern that is not a regular expression.
    """
    if remedies is None:
        return ()
    if isinstance(remedies, str):
        if remedies != "default":
            raise ValueError(f"Recovery(remedies={remedies!r}): expected None, 'default' or a dict "
                             f"{{rule id or metric regex: remedy}} with remedies among "
                             f"{list(REMEDY_NAMES)} or callables")
        remedies = DEFAULT_REMEDIES
    if not isinstance(remedies, Mapping):
        raise ValueError(f"Recovery(remedies=...) expects None, 'default' or a dict, got "
                         f"{type(remedies).__name__} {remedies!r}")
    out = []
    for pattern, remedy in remedies.items():
        if not isinstance(pattern, str):
            raise ValueError(f"Recovery(remedies=...): a key must be a rule id or a metric regex "
                             f"(str), got {pattern!r}")
        check_regex(pattern, "Recovery(remedies=...):")
        if isinstance(remedy, str):
            if remedy not in REMEDY_NAMES:
                raise ValueError(f"Recovery(remedies=...): remedy {remedy!r} (for {pattern!r}) does "
                                 f"not exist; the remedies are {list(REMEDY_NAMES)} or a callable "
                                 "fn(state, cause, flags) -> state")
        elif not callable(remedy):
            raise ValueError(f"Recovery(remedies=...): the remedy for {pattern!r} must be a name "
                             f"among {list(REMEDY_NAMES)} or a callable, got {remedy!r}")
        out.append((pattern, remedy))
    return tuple(out)


def _matches(pattern: str, cause: Cause) -> bool:
    return pattern == cause.rule or re.search(pattern, cause.metric) is not None


def remedied_ids(alerts: Iterable[Any], table: RemedyTable) -> set[int]:
    """Ids of the alerts whose cause has a remedy in ``table``: the alerts
    :func:`apply_remedies` acts on (the guard counts them in the fault's chain)."""
    return {c.alert_id for c in causes_of(alerts)
            if c.alert_id >= 0 and any(_matches(p, c) for p, _ in table)}


def _remedy_name(remedy: Remedy) -> str:
    return remedy if isinstance(remedy, str) else getattr(remedy, "__name__", type(remedy).__name__)


def reapply_remedies(state: Any, flags: Mapping[str, Any]) -> Any:
    """Sets what the guard's remedies chose on ``state``: the group LR scales
    (``flags["lr_groups"]``) and the in-flight settings (``flags["qk_clip_tau"]``,
    ``flags["z_loss"]``).

    A restore brings back a checkpoint's own scales and settings, which may predate a
    remedy; the guard calls this after each restore so the remedies stay in force.

    Args:
      state: a train state whose optimizer was built with ``with_lr_scale``.
      flags: the guard's remedies dict.

    Returns:
      ``state`` with each listed group scale and setting the state holds set (others untouched).
    """
    for name in REMEDY_SETTINGS:
        if flags.get(name) is not None and has_remedy(state, name):
            state = set_remedy(state, name, float(flags[name]))
    groups = flags.get("lr_groups") or {}
    if not groups:
        return state
    present = set(get_lr_scales(state))
    for g, v in groups.items():
        if g in present:
            state = set_lr_scale(state, float(v), group=g)
    return state


def _action(name: str, cause: Cause, text: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "remedy", "remedy": name, "rule": cause.rule, "metric": cause.metric,
            "group": cause.group, "text": text, **extra}


def _group_lr(state: Any, cause: Cause, flags: dict[str, Any], lr_factor: float
              ) -> tuple[Any, dict[str, Any]]:
    g = cause.group
    scales = get_lr_scales(state)
    if g is None or g not in scales:
        why = ("the optimizer has no per-group LR scales (build it with "
               "vitals.with_lr_scale(tx, groups='roles'))" if not scales else
               f"no LR group {g!r} in the optimizer (groups: {sorted(scales)})")
        return state, _action("group_lr", cause, f"{g} LR not changed ({why}): global LR "
                              f"x{lr_factor:g} only", applied=False)
    old = float(flags.setdefault("lr_groups", {}).get(g, scales[g]))
    new = old * GROUP_LR_FACTOR
    flags["lr_groups"][g] = new
    state = set_lr_scale(state, new, group=g)
    return state, _action("group_lr", cause, f"{g} LR x{GROUP_LR_FACTOR:g}", applied=True,
                          factor=GROUP_LR_FACTOR, value=new)


def _layer_decay(state: Any, cause: Cause, flags: dict[str, Any], lr_factor: float
                 ) -> tuple[Any, dict[str, Any]]:
    if flags.get("layer_decay") is not None:
        return state, _action("layer_decay", cause, f"layer-wise LR decay {flags['layer_decay']:g} "
                              "already set", applied=False)
    d = LAYER_DECAY
    flags["layer_decay"] = d
    scales = get_lr_scales(state)
    layers = sorted(int(g[6:]) for g in scales if re.fullmatch(r"layer_\d+", g))
    if not layers:
        return state, _action("layer_decay", cause, f"layer-wise LR decay {d:g} flagged for the "
                              "next restart (no per-layer LR groups: build the optimizer with "
                              "vitals.with_lr_scale(tx, groups='roles') or chain "
                              f"vitals.layerwise_lr_decay({d:g}))", applied=False, decay=d)
    n = max(layers) + 1
    mine = flags.setdefault("lr_groups", {})
    factors = {f"layer_{i}": d ** (n - 1 - i) for i in layers}
    if "embedding" in scales:
        factors["embedding"] = d ** n
    for g, f in factors.items():
        mine[g] = float(mine.get(g, scales[g])) * f
        state = set_lr_scale(state, mine[g], group=g)
    return state, _action("layer_decay", cause, f"layer-wise LR decay {d:g} (layer i of {n}: "
                          f"x{d:g}**({n - 1}-i), embedding x{d ** n:.3g})", applied=True, decay=d,
                          factors=factors)


def _in_flight(state: Any, name: str, value: float) -> tuple[Any, str]:
    """Sets the remedy setting ``name`` in the optimizer state when it holds one (the step
    reads it with ``vitals.remedy``); says where it went."""
    if has_remedy(state, name):
        return set_remedy(state, name, value), f"in flight: the step reads vitals.remedy(opt_state, {name!r})"
    return state, (f"flag {name} for the loop (the optimizer state holds no remedy settings: build it "
                   "with jvitals.with_lr_scale(tx) to have it applied in flight)")


def _qk_clip(state: Any, cause: Cause, flags: dict[str, Any], lr_factor: float
             ) -> tuple[Any, dict[str, Any]]:
    details = cause.details or {}
    tau = _float(details.get("qk_clip_tau", cause.baseline))
    what = "the alert's" if "qk_clip_tau" in details else f"the pre-fault max of {cause.metric}"
    if not (math.isfinite(tau) and tau > 0):
        return state, _action("qk_clip", cause, f"QK-clip not set (no finite pre-fault value of "
                              f"{cause.metric})", applied=False)
    old = flags.get("qk_clip_tau")
    if old is not None:
        tau = min(float(old), tau)
    flags["qk_clip_tau"] = tau
    state, where = _in_flight(state, "qk_clip_tau", tau)
    return state, _action("qk_clip", cause, f"QK-clip at tau={tau:.4g} ({what}; {where})", applied=True,
                          tau=tau)


def _z_loss(state: Any, cause: Cause, flags: dict[str, Any], lr_factor: float
            ) -> tuple[Any, dict[str, Any]]:
    if flags.get("z_loss"):
        return state, _action("z_loss", cause, f"z-loss already on (weight {flags['z_loss']:g})",
                              applied=False)
    flags["z_loss"] = Z_LOSS_WEIGHT
    state, where = _in_flight(state, "z_loss", Z_LOSS_WEIGHT)
    return state, _action("z_loss", cause, f"z-loss on (weight {Z_LOSS_WEIGHT:g}; {where})", applied=True,
                          weight=Z_LOSS_WEIGHT)


def _lr_factor(state: Any, cause: Cause, flags: dict[str, Any], lr_factor: float
               ) -> tuple[Any, dict[str, Any]]:
    return state, _action("lr_factor", cause, f"global LR x{lr_factor:g}", applied=True)


_BUILTIN = {"group_lr": _group_lr, "layer_decay": _layer_decay, "qk_clip": _qk_clip,
            "z_loss": _z_loss, "lr_factor": _lr_factor}


def apply_remedies(state: Any, alerts: Sequence[Any], table: RemedyTable,
                   flags: Mapping[str, Any], *, lr_factor: float = 1.0
                   ) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """Applies the remedy of each alert's cause (first matching pattern), once each.

    Args:
      state: the restored train state.
      alerts: the red verdict's alerts (``Alert`` objects or dicts).
      table: from :func:`parse_remedies`.
      flags: the guard's remedies dict (not modified).
      lr_factor: the guard's global factor (named by a fallback's text).

    Returns:
      ``(state, flags, steps)``: the new state, the new flags, and one step
      dict per application (``{"kind": "remedy", "remedy", "rule", "metric",
      "group", "text", "applied", ...}``). A remedy is applied once per
      ``(remedy, group)`` at a rollback (two alerts on the embedding halve its LR
      once).
    """
    flags = copy.deepcopy(dict(flags))
    steps: list[dict[str, Any]] = []
    done: set[tuple[str, str | None]] = set()
    for cause in causes_of(alerts):
        hit = next((r for p, r in table if _matches(p, cause)), None)
        if hit is None:
            continue
        name = _remedy_name(hit)
        key = (name, cause.group if name == "group_lr" else None)
        if key in done:
            continue
        done.add(key)
        if isinstance(hit, str):
            state, act = _BUILTIN[hit](state, cause, flags, lr_factor)
        else:
            got = hit(state, cause, flags)
            text = f"{name} (for {cause.metric})"
            if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], str):
                state, text = got
            else:
                state = got
            act = _action(name, cause, text, applied=True)
        steps.append(act)
    return state, flags, steps


def applied_text(steps: Iterable[Mapping[str, Any]]) -> str:
    """``'applied: embedding LR x0.5; z-loss on (...)'`` of the remedy steps ('' if none)."""
    texts = [str(a.get("text")) for a in steps if a.get("kind") == "remedy"]
    return ("applied: " + "; ".join(texts)) if texts else ""

