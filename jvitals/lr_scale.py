"""A learning-rate scale that works with any optax schedule, set from the host.

Setting ``hyperparams['learning_rate']`` of an ``inject_hyperparams`` state does
nothing when the learning rate is a schedule (the schedule recomputes it each
step), and an unfiltered ``optax.tree.set`` breaks the schedule's own state. So
jvitals multiplies the *final update* by a separate hyperparameter instead::

    tx' = inject_hyperparams(lambda lr_scale: chain(tx, scale(lr_scale)))(lr_scale=1.0)
    update' = lr_scale * tx.update(grads)          # = (lr_scale * lr_t) * direction_t

For every optax optimizer whose update is linear in its learning rate (SGD,
Adam(W), Lion, Adafactor with a fixed lr, ...), scaling the update is the same as
scaling the learning rate at every step of the schedule. The rollback in
:mod:`jvitals.rollback` turns this scale down (x0.9 per rollback, compounding).

The scale lives in the optimizer state as a float32 scalar (whatever the params'
dtype), so it is checkpointed with it; :func:`set_lr_scale` replaces it with an
array of the same dtype, shape and sharding, so a jitted step does not retrace.

Example::

    tx = vitals.with_lr_scale(optax.adamw(optax.cosine_decay_schedule(3e-4, 10_000)))
    opt_state = tx.init(params)
    opt_state = vitals.set_lr_scale(opt_state, 0.9)
    vitals.get_lr_scale(opt_state)   # 0.9 (as float32)
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LR_SCALE", "with_lr_scale", "get_lr_scale", "set_lr_scale", "has_lr_scale"]

LR_SCALE = "lr_scale"
"""Name of the injected hyperparameter holding the learning-rate scale."""

_STATE_TYPES = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)

T = TypeVar("T")


def with_lr_scale(tx: optax.GradientTransformation, lr_scale: float = 1.0
                  ) -> optax.GradientTransformationExtraArgs:
    """Wraps ``tx`` so its updates are multiplied by a host-settable ``lr_scale``.

    ``update = lr_scale * tx.update(...)``; with any optax schedule inside ``tx``
    this scales the learning rate at every step while the schedule keeps running.

    Args:
      tx: any optax transformation (a chain, an optimizer with a schedule, ...).
      lr_scale: the initial scale (1.0: no change).

    Returns:
      An ``optax.inject_hyperparams`` transformation whose state is an
      ``InjectStatefulHyperparamsState`` with ``hyperparams['lr_scale']`` a float32
      scalar; extra update arguments (``loss=``, ...) are forwarded to ``tx``.

    Example::

      tx = with_lr_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched)))
    """
    def factory(lr_scale):
        return optax.chain(tx, optax.scale(lr_scale))

    return optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(
        lr_scale=float(lr_scale))


def _is_scale_state(x: Any) -> bool:
    return isinstance(x, _STATE_TYPES) and LR_SCALE in x.hyperparams


def _scale_nodes(tree: Any) -> list[Any]:
    """Every inject-hyperparams state in ``tree`` holding an ``lr_scale`` (nested too)."""
    found = []
    for node in jax.tree.leaves(tree, is_leaf=_is_scale_state):
        if _is_scale_state(node):
            found.append(node)
            found.extend(_scale_nodes(node.inner_state))
    return found


def has_lr_scale(tree: Any) -> bool:
    """True if ``tree`` (an opt_state, or a whole train state) holds an ``lr_scale``."""
    return bool(_scale_nodes(tree))


def get_lr_scale(tree: Any) -> float:
    """Reads the ``lr_scale`` hyperparameter from anywhere in ``tree``.

    Args:
      tree: an optimizer state, or any pytree containing one (a flax ``TrainState``,
        a dict), built with :func:`with_lr_scale`.

    Returns:
      The scale as a Python float (one host read).

    Raises:
      ValueError: if ``tree`` holds no ``lr_scale``, or holds several that differ.
    """
    nodes = _scale_nodes(tree)
    if not nodes:
        raise ValueError(
            "Expected an optimizer state built with jvitals.with_lr_scale(tx) (an "
            f"inject_hyperparams state with a '{LR_SCALE}' hyperparameter), found none "
            f"in a {type(tree).__name__}. Wrap the optimizer: "
            "tx = jvitals.with_lr_scale(tx).")
    values = [float(np.asarray(jax.device_get(n.hyperparams[LR_SCALE]))) for n in nodes]
    if any(v != values[0] for v in values):
        raise ValueError(f"Expected one '{LR_SCALE}' value, found {len(values)} that differ: "
                         f"{values}. Set them together with jvitals.set_lr_scale(tree, value).")
    return values[0]


def _like(old: Any, value: float) -> Any:
    """``value`` as an array with ``old``'s dtype, shape and sharding (no retrace)."""
    if isinstance(old, jax.core.Tracer):
        return jnp.full(jnp.shape(old), value, dtype=jnp.result_type(old))
    if isinstance(old, jax.Array):
        host = np.full(old.shape, value, dtype=old.dtype)
        sharding = old.sharding
        if sharding.is_fully_addressable:
            return jax.device_put(host, sharding)
        # Multi-process: every process supplies its own shards of the same value.
        return jax.make_array_from_callback(old.shape, sharding, lambda idx: host[idx])
    dtype = getattr(old, "dtype", np.float32)
    return np.full(np.shape(old), value, dtype=dtype)


def set_lr_scale(tree: T, value: float) -> T:
    """Sets every ``lr_scale`` hyperparameter in ``tree`` to ``value``.

    The new value keeps the old one's dtype (float32 with :func:`with_lr_scale`),
    shape and sharding, so a jitted train step that takes ``tree`` does not retrace
    or recompile.

    Args:
      tree: an optimizer state, or any pytree containing one.
      value: the new scale (e.g. ``0.9 * get_lr_scale(tree)``).

    Returns:
      A copy of ``tree`` with the scale replaced; the input is not modified.

    Raises:
      ValueError: if ``tree`` holds no ``lr_scale`` hyperparameter.
    """
    if not has_lr_scale(tree):
        get_lr_scale(tree)  # raises the explanatory error
    value = float(value)

    def replace(node: Any) -> Any:
        if not _is_scale_state(node):
            return node
        hyper = dict(node.hyperparams)
        hyper[LR_SCALE] = _like(hyper[LR_SCALE], value)
        return node._replace(hyperparams=hyper, inner_state=set_in(node.inner_state))

    def set_in(subtree: Any) -> Any:
        return jax.tree.map(replace, subtree, is_leaf=_is_scale_state)

    return set_in(tree)
