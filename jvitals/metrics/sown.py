"""Reading what a model sowed: every value by its NAME in model order, the ``[B, T]``
token shape it is checked against, the layer layout (one value per layer, or a
leading layer axis when ``nn.scan``-stacked) and the mesh axes its figures are
reduced over.

Shared by :mod:`jvitals.metrics.activations` and :mod:`jvitals.metrics.replicas`'
readers of the ``intermediates`` collection (Linen dicts and NNX ``State``\\ s alike).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jvitals.metrics.axes import sharded_axes, varying_axes
from jvitals.metrics.paths import natural_key
from jvitals.metrics.probes import LogitsRows, LogitsSummary, vary_along
from jvitals.metrics.stats import Summary, TokenSummary, reduce
from jvitals.metrics.variables import is_state, value_of

__all__ = ["Entry", "Tokens", "cat", "collect", "collect_all", "from_instrument", "plain", "red_axes", "reduce_over",
           "stacked_layout", "token_shape", "token_stacked"]

Entry = tuple[str, Any]  # (module path, one sown value)


def plain(tree: Any) -> Any:
    """NNX ``State`` -> pure dict; anything else unchanged."""
    return nnx.to_pure_dict(tree) if is_state(tree) else tree


def collect_all(tree: Any, collection: str, who: str) -> dict[str, list[Entry]]:
    """Group every sown value by its leaf NAME, in model order (see module docstring)."""
    tree = plain(tree)
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{who}: expected the sown '{collection}' dict (Linen: the '{collection}' entry "
            f"of apply(..., mutable=['{collection}']); NNX: the State nnx.capture returns), "
            f"got {type(tree).__name__}.")
    if collection in tree and isinstance(plain(tree[collection]), Mapping):
        tree = plain(tree[collection])
    found: dict[str, list[tuple[list, int, str, Any]]] = {}

    def walk(node: Mapping, path: tuple[str, ...]) -> None:
        for key, value in node.items():
            value = plain(value_of(value))
            p = path + (str(key),)
            if isinstance(value, Mapping):
                walk(value, p)
                continue
            items = value if type(value) in (tuple, list) else (value,)
            for j, item in enumerate(items):
                found.setdefault(str(key), []).append(
                    ([natural_key(c) for c in p], j, "/".join(p), value_of(item)))

    walk(tree, ())
    return {name: [(path, v) for _, _, path, v in sorted(items, key=lambda e: (e[0], e[1]))]
            for name, items in found.items()}


def collect(tree: Any, collection: str, who: str) -> dict[str, list[Entry]]:
    """:func:`collect_all`, less instrument()'s summaries of a NAME the model sows itself."""
    out = collect_all(tree, collection, who)
    # A model that sows a NAME itself keeps its values: instrument()'s per-token
    # summaries of that NAME are dropped (else every layer would count twice).
    for name, items in out.items():
        own = [e for e in items if not from_instrument(e[1])]
        if own and len(own) < len(items):
            out[name] = own
    return out


def from_instrument(v: Any) -> bool:
    """What jvitals.instrument sows: per-token summaries (never raw arrays)."""
    return isinstance(v, (TokenSummary, LogitsRows)) or type(v).__name__ == "ExpertChoices"


def red_axes(name: str, arrays: Iterable[Any], axes: tuple[str, ...],
              specs: Mapping[str, PartitionSpec | None] | None) -> tuple[str, ...]:
    """Mesh axes the statistics of ``name`` are reduced over."""
    if not axes:
        return ()
    if specs is not None and name in specs:
        return sharded_axes(specs[name], axes)
    out: set[str] = set()
    for a in jax.tree.leaves(list(arrays)):
        out.update(varying_axes(a, axes))
    return tuple(a for a in axes if a in out)


def reduce_over(tree: Any, red: tuple[str, ...]) -> Any:
    return reduce(vary_along(tree, red), red) if red else tree


def cat(summaries: list[Summary]) -> Summary:
    return jax.tree.map(lambda *a: jnp.concatenate([jnp.reshape(x, (-1,)) for x in a]), *summaries)


class Tokens:
    """The ``[B, T]`` token shape every token-shaped value is checked against."""

    def __init__(self, shape: tuple[int, ...] | None, source: str):
        self.shape = shape
        self.source = source

    def describe(self) -> str:
        return f"{self.source} has shape {self.shape}"


def token_shape(mask: Any, labels: Any, entries: Mapping[str, list[Entry]]) -> Tokens:
    if mask is not None:
        return Tokens(tuple(mask.shape), "mask")
    if labels is not None:
        return Tokens(tuple(labels.shape), "labels")
    for path, v in entries.get("logits", []):
        if isinstance(v, (LogitsSummary, LogitsRows)):
            return Tokens(tuple(v.argmax.shape), f"the probed logits' argmax at '{path}'")
        if hasattr(v, "shape") and len(v.shape) >= 2:
            return Tokens(tuple(v.shape[:-1]), f"the logits [B, T, V] at '{path}'")
    return Tokens(None, "no mask")


def stacked_layout(name: str, shape: tuple[int, ...], tok: Tokens, path: str, strict: bool) -> bool | None:
    """True: ``(L, *S, ...)``; False: ``(*S, ...)``; None: not token-shaped (generic only)."""
    rank = len(shape)
    if tok.shape is None:
        return rank >= {"hidden_states": 4, "attn_logits": 5}.get(name, 10**9)
    s = tok.shape
    n = len(s)
    if name == "attn_logits":
        b, t = (s[0], s[-1]) if n == 2 else (None, None)
        tail = rank >= 3 and shape[-2:] == (t, t)
        one = tail and shape[0] == b
        many = tail and rank >= 4 and shape[1] == b
        what = f"[B, ..., T, T] = ({b}, ..., {t}, {t})"
    else:
        one = shape[:n] == s
        many = rank > n and shape[1:n + 1] == s
        what = f"[B, T, ...] = ({', '.join(map(str, s))}, ...)"
    if one and many:
        return rank >= {"hidden_states": n + 2, "attn_logits": 5}.get(name, 10**9)
    if one or many:
        return many
    flat = n == 2 and min(s) > 1 and rank >= 2 and shape[0] == s[0] * s[1]  # [B*T, D]: flattened tokens
    if not strict and not flat:
        return None
    raise ValueError(
        f"activation_metrics: {tok.describe()} but the sown '{name}' value at '{path}' has "
        f"shape {shape}; expected {what} (or with a leading layer axis when nn.scan-stacked). "
        + (f"Its leading axis is B*T = {shape[0]}, flattened tokens: reshape it to {(*s, *shape[1:])} "
           f"before sowing, so that the mask can be applied. " if flat else "")
        + "Pass a [B, T] mask (True = valid) matching the model's tokens.")


def token_stacked(name: str, shape: tuple[int, ...], tok: Tokens, path: str) -> bool | None:
    """A per-token summary's fields: ``S`` (False) or ``(L, *S)`` (True); None if not
    token-shaped (then summarised whole, unmasked)."""
    if tok.shape is None:
        return len(shape) >= 3
    s = tok.shape
    n = len(s)
    one = shape[:n] == s
    many = len(shape) > n and shape[1:n + 1] == s
    if one and many:
        return len(shape) > n
    if one or many:
        return many
    raise ValueError(
        f"activation_metrics: {tok.describe()} but the per-token summary sown as '{name}' at '{path}' "
        f"covers positions of shape {shape}; expected [B, T] = {s} (or a leading layer axis when "
        f"nn.scan-stacked). Pass the [B, T] mask (True = valid) of the tokens this apply ran on.")
