"""The monitor's plain-JSON helpers: floats that survive as strings when non-finite, the
state of rules and trackers, and the one ``NAN`` of the monitor modules.

Imports nothing from the other monitor modules.
"""

from __future__ import annotations

import collections
import math
import numbers
from typing import Any, Mapping

__all__ = ["NAN", "dec_any", "dec_float", "dec_floats", "dec_state", "enc_float", "enc_floats", "enc_state"]

NAN = math.nan
"""Not a number: the one NaN constant of the monitor modules."""


# --------------------------------------------------------------------------
# JSON helpers (non-finite floats survive as strings).
# --------------------------------------------------------------------------


def enc_float(x: float) -> float | str:
    """Encodes a float for JSON: finite floats as is, others as a string."""
    x = float(x)
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def dec_float(x: Any) -> float:
    """Decodes :func:`enc_float`'s output (``None`` reads as NaN)."""
    if x is None:
        return math.nan
    return float(x)


def enc_floats(xs) -> list[float | str]:
    return [enc_float(x) for x in xs]


def dec_floats(xs) -> list[float]:
    return [dec_float(x) for x in xs]


_NONFINITE = ("nan", "inf", "-inf")


def enc_state(x: Any) -> Any:
    """A rule's state value as plain JSON: floats by :func:`enc_float`, tuples, lists
    and deques as lists, sets as sorted lists, mappings with str keys, and objects
    with ``state_dict()`` (the trackers) as that dict.

    Raises:
      TypeError: a value of another type (name it in the rule's ``state_fields``
        only if it is one of these).
    """
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return enc_float(x)
    if isinstance(x, Mapping):
        return {str(k): enc_state(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted(enc_state(v) for v in x)
    if isinstance(x, (list, tuple, collections.deque)):
        return [enc_state(v) for v in x]
    state_dict = getattr(x, "state_dict", None)
    if state_dict is not None:
        return state_dict()
    raise TypeError(f"enc_state: cannot write a {type(x).__name__} ({x!r:.60}) as JSON state")


def dec_any(x: Any) -> Any:
    """Inverse of :func:`enc_state` for plain values: ``"nan"``/``"inf"``/``"-inf"``
    back to floats, lists and dicts decoded element by element."""
    if isinstance(x, str):
        return float(x) if x in _NONFINITE else x
    if isinstance(x, list):
        return [dec_any(v) for v in x]
    if isinstance(x, dict):
        return {k: dec_any(v) for k, v in x.items()}
    return x


def dec_state(x: Any, like: Any, value_type: Any = None) -> Any:
    """Inverse of :func:`enc_state`, shaped like ``like`` (the field's value in a fresh
    rule): a tracker through its class's ``from_state_dict``; a deque with ``like``'s
    ``maxlen``; a set of tuples; a float by :func:`dec_float`; a dict whose values are
    ``value_type`` trackers (``value_type.from_state_dict`` each; an entry saved with another
    ``kind`` than ``value_type.kind`` is dropped: that tracker restarts); anything else
    by :func:`dec_any`."""
    if value_type is not None:
        kind = getattr(value_type, "kind", None)
        kind = kind if isinstance(kind, str) else None
        return {k: value_type.from_state_dict(v) for k, v in x.items()
                if kind is None or v.get("kind", kind) == kind}
    if like is not None and not isinstance(like, (Mapping, list, tuple, str, numbers.Number)) \
            and hasattr(like, "from_state_dict"):
        return type(like).from_state_dict(x)
    if isinstance(like, collections.deque):
        return collections.deque((dec_any(v) for v in x), maxlen=like.maxlen)
    if isinstance(like, (set, frozenset)):
        return {tuple(v) if isinstance(v, list) else v for v in dec_any(x)}
    if isinstance(like, float):
        return dec_float(x)
    return dec_any(x)
