"""Argument checks shared by the public entries: every plausible mistake a clear error.

Each check raises from jvitals an exception that names the entry and the argument, shows the value
and says what to do. Only static things are checked (Python values, types, pytree structures,
shapes and dtypes): nothing here reads a traced value, so an entry stays traceable under ``jit``.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import math
import numbers
from typing import Any, Collection, Iterable, Iterator, Mapping

import jax
import numpy as np

__all__ = ["RENAMED", "check_cadence", "check_choice", "check_extra_kwargs", "check_names", "check_not_none", "check_number",
           "check_opt_state", "check_same_structure", "check_schedule", "check_transform", "not_nested", "show"]

#: Former names (keywords and recorder families) and what they are called now: the hint of a
#: "did you mean" where an old name is passed.
RENAMED: Mapping[str, str] = {"vitals_layers": "vitals_heavy", "vitals_layer": "vitals_heavy",
                              "vitals_full": "vitals_heavy", "global": "light", "layers": "heavy"}

_OPEN: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("jvitals_open", default=frozenset())


def show(value: Any, limit: int = 80) -> str:
    """``value``'s type and a short repr, for a message."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def check_transform(tx: Any, where: str, arg: str = "inner") -> Any:
    """``tx`` if it is an optax ``GradientTransformation`` (has ``init`` and ``update``).

    Raises:
      TypeError: naming an uncalled factory (``optax.adamw`` for ``optax.adamw(lr)``).
    """
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return tx
    fix = ("it is a factory: call it, e.g. optax.adamw(1e-3)" if callable(tx)
           else "pass a transform, e.g. optax.adamw(1e-3) or optax.clip_by_global_norm(1.0)")
    raise TypeError(f"{where}({arg}=...) expects an optax GradientTransformation, got {show(tx)}; {fix}")


def check_not_none(value: Any, where: str, arg: str, what: str) -> Any:
    """``value`` unless it is None (``what``: what was expected, e.g. ``'the gradients pytree'``)."""
    if value is None:
        raise TypeError(f"{where}: {arg} is None; expected {what}")
    return value


def check_number(value: Any, where: str, arg: str, *, low: float | None = None, high: float | None = None,
                 integer: bool = False, open_low: bool = False, fix: str = "") -> Any:
    """``value`` if it is a real number (an ``int`` when ``integer``) in ``[low, high]``
    (``(low, high]`` when ``open_low``), finite unless ``high`` is ``inf``.

    Raises:
      TypeError: not a number (a str, None, an array, a bool).
      ValueError: out of range or not finite.
    """
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
        raise TypeError(f"{where}: {arg}={value!r} ({type(value).__name__}) must be "
                        f"{'an int' if integer else 'a real number'}{'; ' + fix if fix else ''}")
    v = float(value)
    bad = math.isnan(v) or (math.isinf(v) and high != math.inf)
    bad = bad or (low is not None and (v <= low if open_low else v < low)) or (high is not None and v > high)
    if bad:
        lo = "" if low is None else f"{'>' if open_low else '>='} {low}"
        hi = "" if high is None or high == math.inf else f"<= {high}"
        rng = " and ".join(x for x in (lo, hi) if x) or "finite"
        raise ValueError(f"{where}: {arg}={value!r} must be {rng}{'; ' + fix if fix else ''}")
    return value


def check_names(value: Any, where: str, arg: str, known: Collection[str] | None = None) -> tuple[str, ...]:
    """``value`` as a tuple of names: a collection of strings (a lone string is a mistake:
    it would be read letter by letter), each among ``known`` when given."""
    if isinstance(value, str):
        raise TypeError(f"{where}: {arg}={value!r} is a string, read as its letters; "
                        f"pass a tuple of names: {arg}=({value!r},)")
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise TypeError(f"{where}: {arg} expects a tuple of names, got {show(value)}")
    names = tuple(value)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{where}: {arg} expects names (str), got {show(n)} in {names!r}")
        if known is not None and n not in known:
            near = difflib.get_close_matches(n, list(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"{where}: {arg} holds {n!r}, not one of {sorted(known)}{hint}")
    return names


def check_extra_kwargs(extra: Mapping[str, Any], known: Collection[str], where: str, prefix: str = "vitals_") -> None:
    """No keyword argument starting with ``prefix`` outside ``known`` (a typo of ``vitals_heavy``,
    or a former name such as ``vitals_layers`` (:data:`RENAMED`), would otherwise be passed on
    and dropped by optax, silently)."""
    for k in extra:
        if k.startswith(prefix) and k not in known:
            near = [RENAMED[k]] if RENAMED.get(k) in known else \
                difflib.get_close_matches(k, list(known), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}=? " if near else ""
            raise TypeError(f"{where}: unknown keyword argument {k}={extra[k]!r}; {hint}"
                            f"the {prefix}* keywords are {sorted(known)}")


def check_same_structure(a: Any, b: Any, where: str, arg_a: str, arg_b: str) -> None:
    """``a`` and ``b`` hold the same leaves (the same number and shapes; the containers may
    differ, e.g. an NNX ``State`` and its pure dict). None ``b``: nothing to check."""
    if b is None:
        return
    sa = sorted(tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(a))
    sb = sorted(tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(b))
    if sa != sb:
        only_a, only_b = [x for x in sa if x not in sb][:3], [x for x in sb if x not in sa][:3]
        raise ValueError(f"{where}: {arg_b} does not hold the leaves of {arg_a} ({len(sa)} leaves vs "
                         f"{len(sb)}; shapes only in {arg_a}: {only_a}, only in {arg_b}: {only_b}); were "
                         f"they swapped or taken of another model? pass {arg_b} as the pytree {arg_a} "
                         f"was taken of")


def check_choice(value: Any, choices: Collection[str], where: str, arg: str) -> Any:
    """``value`` if it is one of ``choices`` (naming the nearest one otherwise)."""
    if not isinstance(value, str) or value not in choices:
        near = difflib.get_close_matches(str(value), list(choices), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"{where}: {arg}={value!r} is not one of {list(choices)}{hint}")
    return value


def check_cadence(every: Any, defaults: Mapping[str, int], where: str) -> dict[str, int]:
    """``defaults`` updated by ``every`` (``{family: int >= 1}``; the families are ``defaults``' keys;
    a former family name (:data:`RENAMED`) is an error that names the new one)."""
    if every is None:
        return dict(defaults)
    if not isinstance(every, Mapping):
        raise TypeError(f"{where}(every={every!r}) expects a mapping {{family: updates}}, e.g. "
                        f"every={{{list(defaults)[-1]!r}: {every!r}}}; families are {list(defaults)}")
    out = dict(defaults)
    for k, v in every.items():
        if k not in defaults:
            near = [RENAMED[k]] if isinstance(k, str) and RENAMED.get(k) in defaults else \
                difflib.get_close_matches(str(k), list(defaults), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"{where}(every=...): unknown family {k!r}; families are {list(defaults)}{hint}")
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{where}(every={{{k!r}: {v!r}}}): a cadence is an int number of updates, e.g. 50")
        if v < 1:
            raise ValueError(f"{where}(every={{{k!r}: {v}}}): a cadence must be >= 1 update")
        out[k] = int(v)
    return out


def check_opt_state(opt_state: Any, where: str) -> None:
    """``opt_state`` is an optimizer state, not None nor the transform that makes one."""
    transform = callable(getattr(opt_state, "init", None)) and callable(getattr(opt_state, "update", None))
    if opt_state is None or transform:
        raise TypeError(f"{where}() expects the optimizer state (opt_state = tx.init(params), as the step returns "
                        f"it), got {type(opt_state).__name__}; pass state.opt_state, not the transform")


@contextlib.contextmanager
def not_nested(where: str, why: str) -> Iterator[None]:
    """A context that may not be entered inside itself (in this thread or task)."""
    if where in _OPEN.get():
        raise RuntimeError(f"{where} is already open: entered twice, {why}")
    token = _OPEN.set(_OPEN.get() | {where})
    try:
        yield
    finally:
        _OPEN.reset(token)


def check_schedule(schedule: Any, where: str) -> None:
    """``schedule`` is None, a number or a callable (an optax schedule)."""
    if schedule is not None and not callable(schedule) and not isinstance(schedule, numbers.Real):
        raise TypeError(f"{where}(schedule={schedule!r}) expects a float or an optax schedule "
                        f"(e.g. optax.cosine_decay_schedule(3e-4, 10_000)), the one the optimizer uses")
