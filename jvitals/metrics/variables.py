"""Flax NNX containers in pytrees: ``nnx.Variable`` leaves and ``nnx.State`` trees.

jvitals' functions take pytrees of arrays. Flax NNX hands over the same figures
wrapped: ``nnx.Optimizer.opt_state`` keeps optax's structure with every array leaf
in an ``nnx.OptState`` Variable, and ``nnx.state(...)`` / ``nnx.grad`` / ``nnx.split``
give an ``nnx.State`` whose leaves flatten through each Variable's ``value``. One
concern here: seeing through those wrappers, so the rest of jvitals reads arrays.
Paths are normalised in one place, :func:`jvitals.metrics.paths.path_str`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

__all__ = ["holds_variables", "is_state", "is_variable", "unwrap", "value_of"]


def is_variable(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX ``Variable`` (``nnx.Param``, ``nnx.OptState``, ...)."""
    return isinstance(x, nnx.Variable)


def is_state(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX ``State`` (what ``nnx.state``, ``nnx.grad``,
    ``nnx.split`` return)."""
    return isinstance(x, nnx.State)


def holds_variables(tree: Any) -> bool:
    """Whether ``tree`` holds Flax NNX Variables (an ``nnx.State``, or the plain dict of
    Variables that later Flax versions return in its place)."""
    return is_state(tree) or any(is_variable(x) for x in jax.tree.leaves(tree, is_leaf=is_variable))


def value_of(x: Any) -> Any:
    """The value a Variable holds, or ``x`` itself."""
    return x.get_value() if is_variable(x) else x


def unwrap(tree: Any) -> Any:
    """``tree`` with every ``nnx.Variable`` replaced by the value it holds.

    The structure around the Variables is kept (optax's NamedTuples in
    ``nnx.Optimizer.opt_state``, a jvitals ``PackedMetrics``); a tree without
    Variables is returned as it is.

    Example:
      >>> unwrap(optimizer.opt_state)      # optax's state, arrays where OptState Variables were
    """
    if not holds_variables(tree):
        return tree
    return jax.tree.map(value_of, tree, is_leaf=is_variable)
