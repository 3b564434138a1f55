"""Losses: the token cross-entropy with the output logits' figures from its own pass, and
the z-loss (PaLM) jvitals' prescriptions name.

METRICS.md §6 prescribes a z-loss when the output logits drift (the log-sum-exp
grows): it pulls ``log Z = logsumexp(logits)`` towards 0, so the softmax stays
well conditioned without changing what it predicts.

:func:`cross_entropy` takes the figures of the output logits (METRICS.md §2's
``act/output_layer_logits_*`` and the log-sum-exp) from the reductions over the
vocabulary the loss takes anyway, so they ride on every step instead of only on the
heavy one.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jvitals.metrics.axes import check_axes, pmax_over, psum_over

__all__ = ["LOGIT_FIGURES", "cross_entropy", "z_loss"]

_F32 = jnp.float32

LOGIT_FIGURES = ("act/output_layer_logits_rms.avg", "act/output_layer_logits_abs.max",
                 "act/output_layer_logsumexp.mean", "act/output_layer_logsumexp.max")
"""The figures :func:`cross_entropy` returns beside the loss (the names of
:func:`~jvitals.metrics.activations.activation_metrics`, equal values)."""


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
    _check_rows("z_loss", logits, mask=mask)
    x = jnp.asarray(logits).astype(jnp.float32)
    if mask is None:
        return jnp.asarray(weight, jnp.float32) * jnp.mean(jnp.square(jax.nn.logsumexp(x, axis=-1)))
    valid = jnp.asarray(mask).astype(bool)
    # Masked rows are zeroed before the log-sum-exp, so garbage there (inf, NaN)
    # reaches neither the value nor the gradient.
    lse = jax.nn.logsumexp(jnp.where(valid[..., None], x, 0.0), axis=-1)
    total = jnp.sum(jnp.where(valid, jnp.square(lse), 0.0))
    n = jnp.sum(valid.astype(jnp.float32))
    return jnp.asarray(weight, jnp.float32) * total / jnp.maximum(n, 1.0)


_ROWS = {"labels": ("labels have", "integer token ids"), "mask": ("mask has", "True = a valid token")}


def _check_rows(fn: str, logits: jax.Array, **rows: jax.Array | None) -> None:
    """Raises a ValueError naming ``fn`` unless ``logits`` has a vocabulary axis and each
    given row array (``labels``, ``mask``) is shaped ``logits.shape[:-1]``; a TypeError for
    None, integer logits or non-integer labels."""
    for name, x in {"logits": logits, **rows}.items():
        if x is None and name != "mask":
            raise TypeError(f"{fn}: {name} is None; expected an array ({_ROWS.get(name, ('', '[..., V] scores'))[1]})")
    if not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
        raise TypeError(f"{fn}: logits have dtype {jnp.result_type(logits)}; expected floating [..., V] scores "
                        f"(were logits and labels swapped? the order is (logits, labels, mask))")
    if "labels" in rows and not jnp.issubdtype(jnp.result_type(rows["labels"]), jnp.integer):
        raise TypeError(f"{fn}: labels have dtype {jnp.result_type(rows['labels'])}; expected integer token ids "
                        f"(-100 or another negative id: padding), not one-hot or probabilities")
    if jnp.ndim(logits) < 1:
        raise ValueError(f"{fn}: logits must have a vocabulary axis (shape [..., V]), got shape "
                         f"{jnp.shape(logits)}")
    want = tuple(jnp.shape(logits)[:-1])
    for name, x in rows.items():
        if x is not None and tuple(jnp.shape(x)) != want:
            has, what = _ROWS[name]
            raise ValueError(f"{fn}: {has} shape {tuple(jnp.shape(x))}, expected the logits' shape "
                             f"without the vocabulary axis, {want} ({what})")


def cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None, *,
                  z_loss_weight: float = 0.0, axes: Sequence[str] | str = ()
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean token cross-entropy, and the output logits' figures from the same pass.

    In float32 whatever the logits' dtype; with ``x`` the logits of a valid position,
    ``m = max_v x`` and ``lse = m + log sum_v exp(x - m)``::

        loss = sum_valid (lse - x[label]) / n_valid  (+ z_loss_weight * sum_valid lse^2 / n_valid)
        act/output_layer_logits_rms.avg  = sqrt(sum_valid sum_v x^2 / (n_valid V))
        act/output_layer_logits_abs.max  = max_valid max(m, -min_v x)
        act/output_layer_logsumexp.mean  = sum_valid lse / n_valid
        act/output_layer_logsumexp.max   = max_valid lse

    The figures are those of :func:`~jvitals.metrics.activations.activation_metrics`
    on the same logits (same names, equal values), taken from the reductions over the
    vocabulary the loss needs (the maximum and the log-sum-exp) plus a sum of squares
    and a minimum over the same rows, which XLA fuses with them where it fuses
    reductions over one input (GPU, TPU); so the README's light step carries them on
    every step. A non-finite logit of a valid position makes the figures NaN (the loss
    shows it as it is); masked positions enter neither the loss nor the figures, whatever
    they hold, and get a zero gradient where their logits are finite (as with optax's
    loss; zeroing the whole logits first would cost the CPU two more reads of them).
    The figures carry no gradient.

    Args:
      logits: ``[..., V]`` output logits (e.g. ``[B, T, V]``).
      labels: integer ids of shape ``logits.shape[:-1]``; a negative id (the ignore index
        -100 of PyTorch and Hugging Face loaders) marks a position as padding, as ``mask``
        does. An id ``>= V`` is a data error the loss shows as NaN.
      mask: None (every position valid), or a boolean/0-1 array of shape
        ``logits.shape[:-1]`` (True = valid). With no valid position the loss is 0.
      z_loss_weight: adds PaLM's z-loss (:func:`z_loss`) from the same log-sum-exp (>= 0).
      axes: inside ``shard_map``, the mesh axes the tokens are sharded along (the
        sums and maxima are reduced over them; the vocabulary axis must be whole).

    Returns:
      ``(loss, figures)``: a float32 scalar (the mean over the valid positions of
      the shard's global batch) and ``{name: float32 scalar}`` of :data:`LOGIT_FIGURES`.

    Raises:
      TypeError: logits or labels None, integer logits (swapped arguments), non-integer labels.
      ValueError: labels or mask not shaped ``logits.shape[:-1]``, a negative
        ``z_loss_weight``, or an axis not bound here.

    Example::

      def loss_fn(params):
          logits = model.apply({"params": params}, batch["tokens"])
          return vitals.cross_entropy(logits, batch["labels"], batch["mask"])   # (loss, figures)
      (loss, logit_figures), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    """
    _check_rows("cross_entropy", logits, labels=labels, mask=mask)
    if isinstance(z_loss_weight, (int, float)) and not z_loss_weight >= 0:
        raise ValueError(f"cross_entropy: z_loss_weight={z_loss_weight!r} must be >= 0 (PaLM uses 1e-4)")
    axes = check_axes(axes)
    x = jnp.asarray(logits).astype(_F32)
    labels = jnp.asarray(labels, jnp.int32)
    valid = jnp.ones(x.shape[:-1], bool) if mask is None else jnp.asarray(mask).astype(bool)
    valid = valid & (labels >= 0)       # a negative label (the ignore index -100) is padding
    m = lax.stop_gradient(jnp.max(x, axis=-1))
    safe_m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(x - safe_m[..., None]), axis=-1)) + safe_m
    picked = _label_logit(x, jnp.maximum(labels, 0))
    n = psum_over(jnp.sum(valid.astype(_F32)), axes)
    per_token = lse - picked
    if not (isinstance(z_loss_weight, (int, float)) and z_loss_weight == 0):
        per_token = per_token + jnp.asarray(z_loss_weight, _F32) * jnp.square(lse)
    loss = psum_over(jnp.sum(jnp.where(valid, per_token, 0.0)), axes) / jnp.maximum(n, 1.0)
    return loss, _logit_figures(lax.stop_gradient(x), lax.stop_gradient(lse), m, valid, n, axes)


def _label_logit(x: jax.Array, labels: jax.Array) -> jax.Array:
    """``x[..., label]``: a gather (the fast form: on XLA:CPU a one-hot sum over the
    vocabulary costs 8% of a small model's step), or, where JAX cannot gather along an
    explicitly sharded vocabulary axis, MaxText's one-hot form (a masked sum), which any
    sharding allows."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if not spec or len(spec) != x.ndim or spec[-1] is None:
        return jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    hit = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == labels[..., None]
    return jnp.sum(jnp.where(hit, x, 0.0), axis=-1)


def _logit_figures(x: jax.Array, lse: jax.Array, m: jax.Array, valid: jax.Array, n: jax.Array,
                   axes: tuple[str, ...]) -> dict[str, jax.Array]:
    """:data:`LOGIT_FIGURES` from the rows' maximum ``m`` and log-sum-exp (see :func:`cross_entropy`)."""
    neg = jnp.float32(-jnp.inf)
    sumsq = psum_over(jnp.sum(jnp.where(valid, jnp.sum(jnp.square(x), axis=-1), 0.0)), axes)
    absmax = pmax_over(jnp.max(jnp.where(valid, jnp.maximum(m, -jnp.min(x, axis=-1)), neg)), axes)
    lse_sum = psum_over(jnp.sum(jnp.where(valid, lse, 0.0)), axes)
    lse_max = pmax_over(jnp.max(jnp.where(valid, lse, neg)), axes)
    vocab = x.shape[-1]
    raw = {"act/output_layer_logits_rms.avg": jnp.sqrt(sumsq / jnp.maximum(n * vocab, 1.0)),
           "act/output_layer_logits_abs.max": absmax,
           "act/output_layer_logsumexp.mean": lse_sum / jnp.maximum(n, 1.0),
           "act/output_layer_logsumexp.max": lse_max}
    # A non-finite valid logit makes the sum of squares non-finite, and every figure NaN
    # (as activation_metrics gives them); no valid position: NaN.
    ok = jnp.isfinite(sumsq) & (n > 0.5)
    return {k: jnp.where(ok, v, jnp.nan).astype(_F32) for k, v in raw.items()}
