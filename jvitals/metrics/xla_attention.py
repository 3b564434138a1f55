"""Flax's and jax's attention with the attention-logit summary read from the softmax's own row
reductions: ``jax.nn.dot_product_attention``'s XLA computation run here
(:func:`attention_with_summary`), and the summary of the masked scores flax's
``dot_product_attention_weights`` hands ``jax.nn.softmax`` (:func:`softmax_input_summary`).

:func:`~jvitals.metrics.instrument.instrument` (``attn_logits=True``) runs this in place of
``jax.nn.dot_product_attention`` (``nnx.MultiHeadAttention`` without dropout) when the XLA
implementation is the one asked for (``implementation=None`` or ``"xla"``). It is the same
computation as jax's ``_dot_product_attention_xla``, written with public ``jnp`` and
``jax.nn`` calls:

- grouped queries ``q[B, T, K, G, H]`` (``N = K G`` query heads, ``K`` key/value heads);
- ``logits = einsum(q, k)`` in float32 (``preferred_element_type``; bf16 and float16 inputs
  take the ``BF16_BF16_F32`` / ``F16_F16_F32`` dot algorithm, as jax does), times ``scale``
  (``1 / sqrt(H)`` by default), plus ``bias``;
- ``padded = where(ok, logits, -0.7 * finfo.max)``, ``ok`` the mask, the causal term, the local
  window and the sequence lengths;
- ``probs = softmax(padded)`` cast to the keys' dtype, ``out = einsum(probs, v)``, zero past a
  query's sequence length.

The summary of the valid scores is taken per row (a head's query) from the softmax's row
maximum, ``max_k padded``, the same expression, so the compiler computes it once, and the row
minimum ``min_k where(ok, logits, 0.7 * finfo.max)`` beside it in the same kernel:
``max |s|`` of a row ``= max(max_k, -min_k)``, then the largest over the heads of a query.
The minimum is taken over the mask, not over a compare of the scores, which the TPU compiler
reads apart. A bias that masks by ``finfo.min`` (HF-Flax's convention) also leaves its masked
entries out of the summary; that row maximum is then no longer the softmax's, and is read
apart. What each form reads on the TPU compiler: docs/COST.md (``tests/test_tpu_cost.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jvitals.metrics.stats import TokenSummary, nan_rule

__all__ = ["attention_with_summary", "bias_keeps", "softmax_input_summary", "valid_pairs"]

_F32 = jnp.float32


def bias_keeps(bias: Any) -> jax.Array:
    """Where an attention bias leaves a key in: ``bias > finfo.min / 2`` (a bias that masks, as
    HF-Flax's does, adds ``finfo.min`` where a key is masked)."""
    b = lax.stop_gradient(jnp.asarray(bias))
    return b > jnp.finfo(b.dtype).min / 2


def _dot_precision(dtype: Any) -> Any:
    if dtype == jnp.bfloat16:
        return lax.DotAlgorithmPreset.BF16_BF16_F32
    if dtype == jnp.float16:
        return lax.DotAlgorithmPreset.F16_F16_F32
    return None


def _einsum(spec: str, a: jax.Array, b: jax.Array, out: Any) -> jax.Array:
    """``jnp.einsum`` with jax's dot algorithm for half inputs, the default where the platform
    refuses it (as jax falls back)."""
    try:
        return jnp.einsum(spec, a, b, precision=_dot_precision(a.dtype), preferred_element_type=out)
    except Exception:
        return jnp.einsum(spec, a, b, preferred_element_type=out)


def _ensure_4d(x: Any) -> Any:
    if x is None:
        return None
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _grouped(t: Any, k: int, g: int) -> Any:
    """A ``[B, N or 1, T, S]`` bias or mask as ``[B, K, G, T, S]`` (jax's grouping)."""
    if t is None:
        return None
    b, n, tq, ts = t.shape
    if n == 1:
        return jnp.broadcast_to(t[:, :, None], (b, 1, g, tq, ts))
    return t.reshape(b, k, g, tq, ts)


def valid_pairs(tq: int, ts: int, *, is_causal: bool = False,
                local_window_size: int | tuple[int, int] | None = None, query_seq_lengths: Any = None,
                key_value_seq_lengths: Any = None) -> jax.Array:
    """The (query, key) pairs ``jax.nn.dot_product_attention`` keeps, ``[B or 1, 1, Tq, Tk]``:
    ``k <= q`` if causal; ``q - left <= k <= q + right`` in a local window (an int: both
    sides); ``q < query_seq_lengths[b]`` and ``k < key_value_seq_lengths[b]``."""
    qi = jnp.arange(tq).reshape(1, 1, tq, 1)
    kj = jnp.arange(ts).reshape(1, 1, 1, ts)
    ok = jnp.ones((1, 1, tq, ts), bool)
    if is_causal:
        ok = ok & jnp.tril(jnp.ones((tq, ts), bool)).reshape(1, 1, tq, ts)
    if local_window_size is not None:
        w = local_window_size
        left, right = (w, w) if isinstance(w, int) else w
        ok = ok & (qi <= kj + left) & (qi >= kj - right)
    if query_seq_lengths is not None:
        ok = ok & (qi < jnp.asarray(query_seq_lengths).reshape(-1, 1, 1, 1))
    if key_value_seq_lengths is not None:
        ok = ok & (kj < jnp.asarray(key_value_seq_lengths).reshape(-1, 1, 1, 1))
    return ok


def _core(q: jax.Array, k: jax.Array, v: jax.Array, bias: Any, mask: Any, *, scale: float,
          pairs: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One group of query heads (``q[B, T, K, H]``): ``(out, row_max, row_min, count)``, the
    rows ``[B, K, T]`` over the valid keys (``-big`` / ``big`` where a row has none), ``count``
    the valid (head, key) pairs of each query ``[B, T]``; ``pairs``: :func:`valid_pairs`'
    keywords."""
    logits_dtype = jnp.promote_types(q.dtype, _F32)
    logits = _einsum("BTNH,BSNH->BNTS", q, k, logits_dtype)
    logits = logits * jnp.array(scale, dtype=logits.dtype)
    if bias is not None:
        logits = (logits + bias).astype(logits.dtype)
    tq, ts = logits.shape[2], logits.shape[3]
    ok = valid_pairs(tq, ts, **pairs)
    if mask is not None:
        ok = ok & mask.astype(bool)
    big = min(float(jnp.finfo(logits.dtype).max), float(jnp.finfo(_F32).max)) * 0.7
    padded = jnp.where(ok, logits, jnp.asarray(-big, logits.dtype)).astype(_F32)
    probs = jax.nn.softmax(padded, axis=-1).astype(k.dtype)
    out = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    q_len = pairs.get("query_seq_lengths")
    if q_len is not None:
        live = jnp.arange(tq)[None, :] < jnp.asarray(q_len)[:, None]
        out = out * live[:, :, None, None].astype(out.dtype)

    s = lax.stop_gradient(padded)
    keys_ok = ok
    if bias is not None:
        keys_ok = ok & bias_keeps(bias)
        s = jnp.where(keys_ok, s, -big)
    hi = jnp.max(s, axis=-1)   # the softmax's own row maximum where no bias masks
    lo = jnp.min(jnp.where(keys_ok, s, big), axis=-1)
    return out, hi, lo, _pair_count(keys_ok, logits.shape)


def _pair_count(ok: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``sum over heads and keys of broadcast(ok, shape)``, ``shape = [..., H, Tq, Tk]``,
    without broadcasting a mask that is the same for every head over the heads."""
    heads = shape[-3]
    per = ok.shape[-3] if ok.ndim >= 3 else 1
    c = jnp.sum(jnp.broadcast_to(ok, shape[:-3] + (per,) + shape[-2:]), axis=(-3, -1), dtype=_F32)
    return c * float(heads // per)


def _rows_summary(hi: jax.Array, lo: jax.Array, count: jax.Array, heads: tuple[int, ...]) -> TokenSummary:
    """A query's summary from its heads' rows: ``max |s| = max over heads of max(hi, -lo)``
    (a row with no valid key has ``hi = -big`` and ``lo = big``, so it gives nothing), the
    heads whose row is not finite counted in ``nonfinite``; ``count`` as given."""
    row = jnp.maximum(hi, -lo)
    bad = jnp.sum(~jnp.isfinite(row), axis=heads, dtype=_F32)
    amax = jnp.max(jnp.maximum(row, 0.0), axis=heads)
    nan = jnp.full(count.shape, jnp.nan, _F32)
    return TokenSummary(count=count, sum=nan, sumsq=nan, abs_max=nan_rule(amax, count, bad), nonfinite=bad)


def attention_with_summary(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                           scale: float | None = None, **pairs: Any) -> tuple[jax.Array, TokenSummary]:
    """``jax.nn.dot_product_attention(...)`` (its XLA implementation) and the summary of its
    valid pre-softmax scores per query position.

    Args:
      query, key, value, bias, mask, scale: as ``jax.nn.dot_product_attention``
        (``[B, T, N, H]`` or ``[T, N, H]``).
      **pairs: its ``is_causal``, ``local_window_size``, ``query_seq_lengths`` and
        ``key_value_seq_lengths`` (:func:`valid_pairs`).

    Returns:
      ``(out, summary)``: the attention output, ``query``'s shape and dtype; a
      :class:`~jvitals.metrics.stats.TokenSummary` of shape ``[B, T]`` (``[T]`` unbatched):
      ``count`` the valid (head, key) scores of the query, ``abs_max`` their largest ``|s|``
      (NaN where one is not finite or none is valid), ``nonfinite`` the heads whose valid
      scores hold a non-finite value (rows, not scores), ``sum`` and ``sumsq`` NaN.
    """
    out_shape = jnp.shape(query)
    q, k, v = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    bias, mask = _ensure_4d(bias), _ensure_4d(mask)
    bsz, tq, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    core = functools.partial(_core, scale=float(1.0 / np.sqrt(h)) if scale is None else scale, pairs=pairs)
    # jax's own grouping: the query heads of one key/value head mapped over, G of them.
    out, hi, lo, count = jax.vmap(core, in_axes=(3, None, None, 2, 2), out_axes=(3, 2, 2, 2))(
        q.reshape(bsz, tq, kh, g, h), k, v, _grouped(bias, kh, g), _grouped(mask, kh, g))
    token = out_shape[:-2]
    rows = [x.reshape(token[:-1] + x.shape[1:]) for x in (hi, lo)]   # [B, K, G, T] ([K, G, T] unbatched)
    heads = (len(token) - 1, len(token))
    return out.reshape(out_shape), _rows_summary(*rows, jnp.sum(count, axis=2).reshape(token), heads)


def softmax_input_summary(x: jax.Array, keys_ok: Any = None) -> TokenSummary:
    """The summary of the valid scores of a masked softmax's input, from its row maximum.

    ``x[..., H, Tq, Tk]`` is what flax's ``dot_product_attention_weights`` hands
    ``jax.nn.softmax``: the scores (plus bias), ``finfo.min`` where the mask or a masking bias
    (HF-Flax's) drops a key. Per row, ``max_k x`` is the softmax's own row maximum (the same
    expression, computed once) and ``min_k where(keys_ok, x, finfo.max)`` rides beside it;
    ``max |s|`` of a row ``= max(max_k, -min_k)`` (a row with no valid key gives nothing: its
    maximum is ``finfo.min`` and its minimum ``finfo.max``).

    Args:
      x: the softmax's input, ``[..., H, Tq, Tk]``.
      keys_ok: boolean broadcastable to ``x``, the valid (query, key) pairs (the mask and
        :func:`bias_keeps`), for the row minimum and ``count`` (None: every pair).

    Returns:
      A :class:`~jvitals.metrics.stats.TokenSummary` of shape ``x.shape[:-3] + (Tq,)``:
      ``count`` the valid (head, key) pairs of a query, ``abs_max`` their largest ``|s|``,
      ``nonfinite`` the heads whose row holds a non-finite value, ``sum`` and ``sumsq`` NaN.
    """
    s = lax.stop_gradient(x)
    ok = jnp.ones((), bool) if keys_ok is None else jnp.asarray(keys_ok, bool)
    hi = jnp.max(s, axis=-1).astype(_F32)   # the softmax's own row maximum
    # The row minimum over the mask, not over a compare of ``s`` (which the TPU compiler
    # reads apart: docs/COST.md).
    lo = jnp.min(jnp.where(ok, s, jnp.asarray(jnp.finfo(s.dtype).max, s.dtype)), axis=-1).astype(_F32)
    return _rows_summary(hi, lo, _pair_count(ok, s.shape), (s.ndim - 3,))
