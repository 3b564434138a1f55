"""Reading an optax transform's structure: the clip first in a chain, an in-step skip's state.

The recorder (:mod:`jvitals.metrics.record`) recognises what it wraps from optax's own
closures (``optax.chain``'s ``update_fns``, ``optax.clip_by_global_norm``'s ``max_norm``,
``with_extra_args_support``'s ``tx``) and from state field names (a clip's
``clip_threshold``, an in-step skip's ``last_skipped``, ``optax.apply_if_finite``'s
``last_finite``). Pure Python at trace time; nothing here runs in the step but
:func:`skipped`'s boolean.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["SKIP_FIELD", "clip_max_norm", "has_threshold", "leading_clip", "skipped", "state_at"]


SKIP_FIELD = "last_skipped"
"""The state field of an in-step skip (``jvitals.skip_step``) the recorder's window reads."""


def skipped(inner_state: Any) -> jax.Array:
    """Whether an in-step skip inside ``inner`` dropped this update: a state with a
    ``last_skipped`` field (:func:`jvitals.skip_step`) or ``optax.apply_if_finite``'s
    (``last_finite`` false)."""
    hit = jnp.zeros((), bool)

    def is_node(x: Any) -> bool:
        f = getattr(x, "_fields", ())
        return SKIP_FIELD in f or {"last_finite", "notfinite_count"} <= set(f)

    for x in jax.tree.leaves(inner_state, is_leaf=is_node):
        if is_node(x):
            if SKIP_FIELD in x._fields:
                hit = hit | jnp.asarray(getattr(x, SKIP_FIELD), bool).reshape(())
            else:
                hit = hit | ~jnp.asarray(x.last_finite, bool).reshape(())
            hit = hit | skipped(x.inner_state) if "inner_state" in x._fields else hit
    return hit


def _closure(fn: Any) -> dict[str, Any]:
    try:
        return {k: c.cell_contents for k, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())}
    except (AttributeError, ValueError):
        return {}


def _is_optax_fn(fn: Any, qualname: str) -> bool:
    return (getattr(fn, "__qualname__", None) == qualname
            and str(getattr(fn, "__module__", "")).startswith("optax"))


def _unwrap(fn: Any) -> Any:
    """The update function inside ``optax.with_extra_args_support`` wrappers."""
    for _ in range(32):
        if not _is_optax_fn(fn, "with_extra_args_support.<locals>.update"):
            break
        tx = _closure(fn).get("tx")
        if tx is None:
            break
        fn = tx.update
    return fn


def _max_norm_of(fn: Any) -> Any:
    """``max_norm`` if ``fn`` is the update of ``optax.clip_by_global_norm(max_norm)``, else None."""
    if not _is_optax_fn(fn, "clip_by_global_norm.<locals>.update_fn"):
        return None
    value = _closure(fn).get("max_norm")
    return value if isinstance(value, (int, float)) or getattr(value, "shape", None) == () else None


def clip_max_norm(inner: Any) -> Any:
    """``max_norm`` if ``inner`` is ``optax.clip_by_global_norm(max_norm)``, else None.

    Recognised by its update function (``clip_by_global_norm.<locals>.update_fn``
    in optax, ``max_norm`` in its closure). Its output's norm is then
    ``min(||g||, max_norm)``, known from the pre-clip norm without another pass
    over the clipped gradients; any other transform's output is measured.
    """
    return _max_norm_of(getattr(inner, "update", None))


def leading_clip(inner: Any) -> tuple[tuple[int | str, ...], Any, bool]:
    """Where the first transform applied by ``inner`` sits, and whether it is a known clip.

    Follows ``optax.chain``'s first element (through nested chains and
    ``with_extra_args_support`` wrappers), reading optax's closures.

    Returns:
      ``(path, max_norm, whole)``: ``path``, the indices of its state inside
      ``inner``'s state (``()``: ``inner`` itself; ``(0,)``: a chain's first
      element...); ``max_norm`` if it is an ``optax.clip_by_global_norm``, else
      None (a clip with a ``clip_threshold`` state field is recognised from the
      state); ``whole``: ``inner`` is that transform alone (every chain on the
      way has one element).
    """
    if inner is None:
        return (), None, True
    fn = _unwrap(getattr(inner, "update", None))
    path: tuple[int | str, ...] = ()
    whole = True
    for _ in range(32):
        if _is_wrapper(fn):      # jvitals.skip_step(inner): its state's inner_state
            fn = _unwrap(_closure(fn)["inner"].update)
            path += ("inner_state",)
            continue
        if not _is_optax_fn(fn, "chain.<locals>.update_fn"):
            break
        fns = _closure(fn).get("update_fns")
        if not fns:
            break
        whole = whole and len(fns) == 1
        path += (0,)
        fn = _unwrap(fns[0])
    return path, _max_norm_of(fn), whole


def _is_wrapper(fn: Any) -> bool:
    """``fn`` is the update of :func:`jvitals.skip_step` (wrapping ``inner``)."""
    return (getattr(fn, "__qualname__", None) == "skip_step.<locals>.update_fn"
            and str(getattr(fn, "__module__", "")).startswith("jvitals")
            and hasattr(_closure(fn).get("inner"), "update"))


def state_at(state: Any, path: tuple[int | str, ...]) -> Any:
    """``state[path[0]][path[1]]...`` (a str: the field of that name; None where the state
    has no such element)."""
    for i in path:
        if isinstance(i, str):
            if i not in getattr(state, "_fields", ()):
                return None
            state = getattr(state, i)
            continue
        if not isinstance(state, tuple) or hasattr(state, "_fields") or len(state) <= i:
            return None
        state = state[i]
    return state


def has_threshold(state: Any) -> bool:
    """A clip's state: a NamedTuple with a ``clip_threshold`` field (e.g. ``AdaptiveClipState``)."""
    return "clip_threshold" in getattr(state, "_fields", ())
