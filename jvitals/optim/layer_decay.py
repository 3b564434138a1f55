"""Layer-wise learning-rate decay (LLRD) as an optax transformation.

METRICS.md §6 prescribes it when the shallow layers' share of the gradient grows
("shallow layers' LR too high"): the update of layer ``i`` of ``N`` is scaled by::

    factor(layer i) = decay ** (N - 1 - i)        # the last layer: 1
    factor(embedding) = decay ** N                # token and position embeddings
    factor(lm_head) = factor(final norm) = 1      # and every other non-layer leaf

Layers and roles come from :func:`jvitals.metrics.roles.assign_roles` (a scan-stacked
subtree's slice ``i`` gets layer ``i``'s factor). Put it *after* the optimizer in the chain,
``optax.chain(optax.adamw(sched), vitals.layerwise_lr_decay(0.9))``: it scales the final
update, i.e. the learning rate; before Adam the scale would be normalised away.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jvitals.metrics.roles import LeafRole, Roles, assign_roles, check_roles

__all__ = ["layer_decay_factors", "layerwise_lr_decay"]

_EMBEDDINGS = ("embedding", "position_embedding")


def _check_decay(decay: Any) -> float:
    d = math.nan
    if not isinstance(decay, (bool, str, jax.core.Tracer)) and decay is not None:
        try:
            d = float(np.asarray(decay)) if np.ndim(decay) == 0 else math.nan
        except (TypeError, ValueError):
            d = math.nan
    if not 0.0 < d <= 1.0:
        raise ValueError(f"layerwise_lr_decay: decay={decay!r} must be a number in (0, 1] "
                         "(METRICS.md §6: 0.85-0.95, start at 0.95; 1.0 = no decay)")
    return d


def _num_layers(leaves: tuple[LeafRole, ...]) -> int:
    layers = [i for lr in leaves for i in lr.layers]
    if not layers:
        raise ValueError(
            "layerwise_lr_decay: no parameter lies in a layer (no 'layers_{i}', 'h/{i}', "
            "'layers/{i}' or nn.scan-stacked 'layers/...' path), so there is nothing to decay. "
            "Check jvitals.explain_roles(params) and pass roles=Roles(layer_patterns=...) or "
            "Roles().with_stack(...).")
    return max(layers) + 1


def layer_decay_factors(tree: Any, decay: float, roles: Roles | None = None) -> list[Any]:
    """The LLRD factor of every leaf of ``tree``, in ``jax.tree`` flatten order.

    Args:
      tree: a parameter (or update) pytree; only paths and shapes are read.
      decay: the decay per layer, in (0, 1].
      roles: the :class:`~jvitals.metrics.roles.Roles` (defaults if None).

    Returns:
      Per leaf a Python float, or for an ``nn.scan``-stacked leaf a float32 NumPy
      array of the leaf's rank, holding slice ``i``'s factor along the layer axis
      (size 1 elsewhere, so it broadcasts).

    Raises:
      ValueError: if ``decay`` is outside (0, 1], or no leaf lies in a layer.
    """
    d = _check_decay(decay)
    leaves = assign_roles(tree, roles)
    n = _num_layers(leaves)
    out: list[Any] = []
    for lr in leaves:
        if lr.role in _EMBEDDINGS:
            out.append(d ** n)
        elif lr.stack is not None:
            shape = [1] * len(lr.shape)
            shape[lr.stack_axis] = lr.num_layers
            f = np.array([d ** (n - 1 - i) for i in lr.layers], np.float64)
            out.append(f.astype(np.float32).reshape(shape))
        elif lr.layer is not None:
            out.append(d ** (n - 1 - lr.layer))
        else:
            out.append(1.0)
    return out


def layerwise_lr_decay(decay: float, *, roles: Roles | None = None) -> optax.GradientTransformation:
    """Scales the update of layer ``i`` of ``N`` by ``decay ** (N - 1 - i)``.

    The token (and position) embedding gets ``decay ** N``; the LM head, the final
    norm and every other leaf outside the layers get 1. ``N`` is one more than the
    largest layer index the roles find. Stacked (``nn.scan``) leaves scale each
    slice of their layer axis by its layer's factor. The factors are constants of
    the tree's structure (no state, no host work in the step).

    Args:
      decay: the decay per layer, in (0, 1] (METRICS.md §6: 0.85-0.95).
      roles: the :class:`~jvitals.metrics.roles.Roles` that find layers and embeddings.

    Returns:
      An ``optax.GradientTransformation`` (empty state). Put it after the optimizer.

    Raises:
      ValueError: if ``decay`` is outside (0, 1] (at once), or no leaf lies in a
        layer (at ``init``).

    Example::

      tx = optax.chain(optax.adamw(3e-4), vitals.layerwise_lr_decay(0.9))
    """
    _check_decay(decay)
    roles = check_roles(roles, "layerwise_lr_decay")

    def init_fn(params):
        layer_decay_factors(params, decay, roles)  # fail early on a tree without layers
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        factors = layer_decay_factors(updates, decay, roles)
        out = [u if (isinstance(f, float) and f == 1.0)
               else (u.astype(jnp.float32) * jnp.asarray(f, jnp.float32)).astype(u.dtype)
               for u, f in zip(leaves, factors)]
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(init_fn, update_fn)
