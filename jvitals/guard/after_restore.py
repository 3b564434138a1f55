"""The steps after a rollback's restore, each a function of the restored state.

The guard restores the target, then, in this order, each step recorded as a dict
(``{"kind": ...}``) in the ``recovery`` list of the rollback's history entry and
event: :func:`scale_lr` (the LR scale x ``lr_factor``, compounding),
:func:`keep_step` (the train state's step field keeps going forward),
:func:`reset_moments` (the Adam moments of the named parameter groups zeroed:
:func:`reset_adam_moments`), the remedies of the alerts' causes
(:mod:`jvitals.guard.remedies`) and :func:`skip_batches` (the data position moved
past the bad stretch). :func:`step_text` says a step in words for the rollback
alert's message.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import optax

from jvitals.metrics.paths import leaves_by_path, path_str
from jvitals.metrics.variables import holds_variables
from jvitals.optim.lr_scale import has_lr_scale, set_lr_scale
from jvitals.guard.remedies import check_regex
from jvitals.guard.stores import own_position

__all__ = [
    "MOMENTS",
    "check_lr_scale",
    "get_field",
    "keep_step",
    "parse_reset",
    "reset_adam_moments",
    "reset_moments",
    "scale_lr",
    "set_field",
    "skip_batches",
    "step_text",
]

MOMENTS = ("mu", "nu")


def get_field(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(name, None)
    return getattr(state, name, None)


def set_field(state: Any, name: str, value: Any) -> Any:
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


def parse_reset(spec: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
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
        bad = [m for m in moments if m not in MOMENTS]
        if bad or not moments:
            raise ValueError(f"Rollback: reset_optimizer names Adam moments among {MOMENTS}, got "
                             f"{moments!r} for {pattern!r}")
        check_regex(pattern, "Rollback: reset_optimizer")
        out.append((str(pattern), moments))
    return tuple(out)


def path_name(path: Sequence[Any]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def zeros_like(x: Any) -> Any:
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
    done: dict[str, list[str]] = {m: [] for m in MOMENTS}
    total = {"n": 0, "all": True, "found": False}

    def node(x: Any) -> Any:
        if not isinstance(x, optax.ScaleByAdamState):
            return x
        total["found"] = True
        new = {}
        for m in MOMENTS:
            def leaf(path, v, m=m):
                name = path_name(path)
                if any(m in ms and re.search(p, name) for p, ms in spec):
                    done[m].append(name)
                    return zeros_like(v)
                total["all"] = False
                return v
            new[m] = jax.tree_util.tree_map_with_path(leaf, getattr(x, m))
        out = x._replace(mu=new["mu"], nu=new["nu"])
        if total["all"]:
            out = out._replace(count=zeros_like(x.count))
        return out

    if holds_variables(state):
        return _reset_nnx_moments(state, spec)
    out = jax.tree.map(node, state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if not total["found"]:
        raise ValueError("Recovery(reset_optimizer=...) expects an Adam-family optimizer state "
                         "(optax.ScaleByAdamState, as in adam/adamw) in the train state; found none. "
                         "Pass reset_optimizer=None for this optimizer.")
    count_reset = total["all"] and bool(done["mu"] or done["nu"])
    if not count_reset and total["all"]:
        count_reset = False
    return out, {"leaves": {m: sorted(set(v)) for m, v in done.items() if v}, "count_reset": count_reset}


def _reset_nnx_moments(state: Any, spec: Sequence[tuple[str, Sequence[str]]]) -> tuple[Any, dict[str, Any]]:
    """:func:`reset_adam_moments` of an ``nnx.State``, where optax's ``ScaleByAdamState``
    is a dict ``{count, mu, nu}``: found by those paths (``.../mu/<param path>``)."""
    paths = leaves_by_path(state)
    adams = sorted({p[: -len("count")] for p in paths if p == "count" or p.endswith("/count")
                    if any(q.startswith(p[: -len("count")] + "mu/") for q in paths)
                    and any(q.startswith(p[: -len("count")] + "nu/") for q in paths)})
    if not adams:
        raise ValueError("Recovery(reset_optimizer=...) expects an Adam-family optimizer state "
                         "(optax's ScaleByAdamState: count, mu, nu) in the nnx.State; found none. "
                         "Pass reset_optimizer=None for this optimizer.")
    done: dict[str, list[str]] = {m: [] for m in MOMENTS}
    kept: set[str] = set()
    zero: set[str] = set()
    for p in paths:
        for pre in adams:
            for m in MOMENTS:
                if p.startswith(f"{pre}{m}/"):
                    name = p[len(pre) + len(m) + 1:]
                    if any(m in ms and re.search(rx, name) for rx, ms in spec):
                        done[m].append(name)
                        zero.add(p)
                    else:
                        kept.add(pre)
    zero |= {pre + "count" for pre in adams if pre not in kept and zero}
    out = jax.tree_util.tree_map_with_path(lambda p, x: zeros_like(x) if path_str(p) in zero else x, state)
    names = {m: sorted(set(v)) for m, v in done.items() if v}
    return out, {"leaves": names, "count_reset": bool(names) and not kept}


def check_lr_scale(state: Any, lr_factor: float) -> None:
    """Raises a ValueError when ``lr_factor`` turns an LR scale that ``state`` lacks
    (its optimizer not wrapped with :func:`jvitals.with_lr_scale`)."""
    if lr_factor == 1.0 or has_lr_scale(state):
        return
    raise ValueError(
        f"Recovery(lr_factor={lr_factor}) expects the train state's optimizer to be "
        "wrapped with jvitals.with_lr_scale(tx) (an inject_hyperparams state holding "
        f"'lr_scale'), found none in the {type(state).__name__}. Build the optimizer as "
        "tx = jvitals.with_lr_scale(tx), or pass lr_factor=1.0 to keep the LR.")


def scale_lr(restored: Any, lr_scale: float, lr_factor: float) -> tuple[Any, float, list[dict[str, Any]]]:
    """The LR scale x ``lr_factor`` in ``restored``: ``(state, new scale, steps)``
    (no step and the state untouched when ``lr_factor`` is 1)."""
    new_scale = lr_scale * lr_factor
    if lr_factor == 1.0:
        return restored, new_scale, []
    return set_lr_scale(restored, new_scale), new_scale, [
        {"kind": "lr_scale", "factor": lr_factor, "value": new_scale}]


def keep_step(restored: Any, state: Any, step_attr: str | None) -> Any:
    """``restored`` with ``state``'s step field (``step_attr``): the step counter goes on.

    In a Flax NNX state (``nnx.State``) every Variable named ``step_attr`` at the top or one
    level down is kept (``nnx.Optimizer``'s ``step`` in ``nnx.state(optimizer)`` and
    in ``nnx.state((model, optimizer))``).
    """
    if step_attr is None:
        return restored
    if holds_variables(state):
        current = {p: x for p, x in leaves_by_path(state).items() if re.fullmatch(rf"(?:[^/]+/)?{re.escape(step_attr)}", p)}
        return jax.tree_util.tree_map_with_path(lambda p, x: current.get(path_str(p), x), restored)
    current = get_field(state, step_attr)
    return restored if current is None else set_field(restored, step_attr, current)


def reset_moments(restored: Any, spec: Sequence[tuple[str, Sequence[str]]]) -> tuple[Any, list[dict[str, Any]]]:
    """:func:`reset_adam_moments` as a step: ``(state, steps)`` (none for an empty ``spec``)."""
    if not spec:
        return restored, []
    restored, summary = reset_adam_moments(restored, spec)
    return restored, [{"kind": "reset_optimizer", "spec": {p: list(m) for p, m in spec},
                       "moments": sorted(summary["leaves"]),
                       "leaves": sum(len(v) for v in summary["leaves"].values()),
                       "count_reset": summary["count_reset"]}]


def skip_batches(position: Any, meta: Mapping[str, Any], skip_data: bool | int) -> tuple[Any, list[dict[str, Any]]]:
    """The data position after the restore: ``(position, steps)``.

    ``skip_data=False``: unchanged, no step. ``True``: as many batches again as
    were consumed between the target (its saved position, this process's) and now.
    An int ``N``: ``N`` batches.
    """
    if skip_data is False:
        return position, []
    then = own_position(meta)
    n = int(skip_data) if not isinstance(skip_data, bool) else \
        max(0, int(position) - int(then if isinstance(then, (int, float)) else position))
    new_position = int(position) + n
    return new_position, [{"kind": "skip_data", "batches": n, "from_position": int(position),
                           "position": new_position}]


def step_text(a: Mapping[str, Any]) -> str:
    """A step after the restore (its dict) in words."""
    kind = a.get("kind")
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
