"""A pytree leaf's path as jvitals names it, and the natural order of such names.

:func:`path_str` is the one place a leaf's path becomes a name
(``params/layers_0/attn/qkv/kernel``): every role, layer, recorder figure and
LR-scale group is matched against it. :func:`natural_key` sorts names as a person
does (``layer_2`` before ``layer_10``).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax

__all__ = ["leaves_by_path", "natural_key", "path_str"]

_CONTAINER_KEY = jax.tree_util.GetAttrKey("value")


def path_str(path: Sequence[Any]) -> str:
    """A leaf's module path, ``/``-joined: ``params/layers_0/attn/qkv/kernel``.

    ``keystr(path, simple=True, separator='/')`` without the container level a
    Flax NNX ``Variable`` adds: every leaf of an ``nnx.State`` (``nnx.state``,
    ``nnx.grad``, ``nnx.split``) flattens to ``.../q_proj/kernel`` then the
    Variable's ``GetAttrKey('value')``, which would otherwise be read as the
    leaf's name (``value``: the ``v`` role). A dict key named ``value`` (a Linen
    module called ``value``) is a ``DictKey`` and stays.
    """
    path = tuple(path)
    while path and path[-1] == _CONTAINER_KEY:
        path = path[:-1]
    return jax.tree_util.keystr(path, simple=True, separator="/")


def leaves_by_path(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` of every leaf of ``tree``, paths as :func:`path_str` gives them
    (an ``nnx.State``'s without the Variables' ``value``), in flatten order."""
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def natural_key(name: str) -> list[Any]:
    """Sort key of ``name`` with its runs of digits read as numbers (``layer_2 < layer_10``)."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))]
