"""Auxiliary losses jvitals' prescriptions name: the z-loss (PaLM).

METRICS.md §6 prescribes a z-loss when the output logits drift (the log-sum-exp
grows): it pulls ``log Z = logsumexp(logits)`` towards 0, so the softmax stays
well conditioned without changing what it predicts.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

__all__ = ["z_loss"]


def z_loss(logits: jax.Array, mask: jax.Array | None = None, *, weight: float = 1e-4) -> jax.Array:
    """``weight * mean over valid tokens of logsumexp(logits, axis=-1) ** 2`` (PaLM).

    Computed in float32 whatever the logits' dtype (bf16 logits are upcast before
    the log-sum-exp); differentiable; masked tokens contribute neither value nor
    gradient (even if their logits are not finite).

    Args:
      logits: ``[..., V]`` output logits (e.g. ``[B, T, V]``).
      mask: None (every token valid), or a boolean/0-1 array of shape
        ``logits.shape[:-1]`` (True = valid). With no valid token the loss is 0.
      weight: the coefficient (PaLM: 1e-4), >= 0.

    Returns:
      A float32 scalar: add it to the training loss.

    Raises:
      ValueError: if ``mask``'s shape is not ``logits.shape[:-1]``, or ``weight``
        is a negative number.

    Example::

      loss = cross_entropy(logits, labels, mask) + vitals.z_loss(logits, mask)
    """
    if isinstance(weight, (int, float)) and not weight >= 0:
        raise ValueError(f"z_loss: weight={weight!r} must be >= 0 (PaLM uses 1e-4)")
    if jnp.ndim(logits) < 1:
        raise ValueError(f"z_loss: logits must have a vocabulary axis (shape [..., V]), got shape "
                         f"{jnp.shape(logits)}")
    x = jnp.asarray(logits).astype(jnp.float32)
    if mask is None:
        return jnp.asarray(weight, jnp.float32) * jnp.mean(jnp.square(jax.nn.logsumexp(x, axis=-1)))
    if tuple(jnp.shape(mask)) != tuple(x.shape[:-1]):
        raise ValueError(f"z_loss: mask has shape {tuple(jnp.shape(mask))}, expected the logits' "
                         f"shape without the vocabulary axis, {tuple(x.shape[:-1])}")
    valid = jnp.asarray(mask).astype(bool)
    # Masked rows are zeroed before the log-sum-exp, so garbage there (inf, NaN)
    # reaches neither the value nor the gradient.
    lse = jax.nn.logsumexp(jnp.where(valid[..., None], x, 0.0), axis=-1)
    total = jnp.sum(jnp.where(valid, jnp.square(lse), 0.0))
    n = jnp.sum(valid.astype(jnp.float32))
    return jnp.asarray(weight, jnp.float32) * total / jnp.maximum(n, 1.0)
