"""Model-side probes: sow compact summaries instead of whole tensors.

A plain ``self.sow('intermediates', 'logits', logits)`` keeps a ``[B, T, V]`` tensor
alive until the metrics are computed (and ships it out of ``jit`` if the
intermediates are returned). The probes compute, inside the model, the few
numbers a metric needs and sow those under the same METRICS.md §7 NAME, so
:func:`jvitals.metrics.activations.activation_metrics` reads either form:

=====================  ===================================================  ==========================
probe                  sows                                                 size
=====================  ===================================================  ==========================
:func:`sow_summary`    a :class:`~jvitals.metrics.stats.Summary` of ``x``           5 scalars
:func:`logits_probe`   a :class:`LogitsSummary` (logits, top-2, LSE, argmax) ~20 scalars + ``[B, T]`` int32
:func:`attn_logits_probe` a ``Summary`` of the valid pre-softmax scores     5 scalars
:func:`perturb_values` nothing sown: a zero perturbation (``Module.perturb``) gradient ``[B, T, ...]``
=====================  ===================================================  ==========================

The argmax kept by :class:`LogitsSummary` (``[B, T]`` int32, ``V`` times smaller than
the logits) is what MTP agreement (METRICS.md §4) and top-1 accuracies need:
they compare argmaxes at *shifted* positions, which no per-step scalar can do.

Every probe works on ``lax.stop_gradient`` of its input: it never changes the
model's gradients. Under ``nn.scan`` the sown structs gain a leading layer axis
on every field, which ``activation_metrics`` reads as one instance per layer.
Summaries are mask-aware at sow time: pass the model's token mask.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jvitals.metrics.stats import (Summary, eager_jit, make_varying, pmax_over, reduce, summarize, summarize_many,
                           summarize_max)

__all__ = [
    "LogitsRows",
    "LogitsSummary",
    "attn_logits_probe",
    "attention_valid_mask",
    "logits_probe",
    "logits_rows",
    "perturb_values",
    "sow_summary",
    "summarize_logits",
    "vary_along",
]

_F32 = jnp.float32


@struct.dataclass
class LogitsSummary:
    """What the output-layer metrics need from ``[..., V]`` logits, without the logits.

    All statistics are over the *valid* positions (mask True), in float32; every
    field but ``argmax`` is a sum, count or maximum, so per-shard values combine
    exactly (``psum``/``pmax``, see :meth:`reduce`).

    Attributes:
      logits: ``Summary`` of the logits over valid positions x vocab
        (``rms = sqrt(sum logits^2 / (n_valid * V))``, ``abs_max``).
      top2_diff: ``Summary`` over valid positions of ``top1 - top2`` (the two
        largest values as ``lax.top_k(logits, 2)`` gives them: a tie gives 0).
        Its ``count`` is the number of valid positions.
      top2_tie: ``Summary`` over valid positions of the indicator
        ``top1 == top2`` (NaN where the logits are not finite); ``mean`` is the
        tie ratio.
      lse: ``Summary`` over valid positions of ``logsumexp(logits)``.
      lse_max: signed ``max`` of ``logsumexp`` over valid positions (NaN if any is
        non-finite or there is none).
      argmax: ``argmax(logits, -1)`` as int32, shape ``logits.shape[:-1]``
        (``[B, T]``); masked positions hold their argmax too (the consumer masks).
    """

    logits: Summary
    top2_diff: Summary
    top2_tie: Summary
    lse: Summary
    lse_max: jax.Array
    argmax: jax.Array

    def reduce(self, axes: tuple[str, ...]) -> "LogitsSummary":
        """``psum``/``pmax`` every statistic over ``axes`` (``argmax`` stays local).

        Use inside ``shard_map`` with the axes the *tokens* are sharded along: every
        statistic is reduced over all of them (see :func:`vary_along`).
        """
        if not axes:
            return self
        fields = vary_along((self.logits, self.top2_diff, self.top2_tie, self.lse, self.lse_max), axes)
        summaries = reduce(fields[:4], axes)
        lse = summaries[3]
        amax = pmax_over(jnp.where(jnp.isnan(fields[4]), -jnp.inf, fields[4]), axes)
        lse_max = jnp.where((lse.nonfinite > 0) | (lse.count <= 0), jnp.nan, amax).astype(_F32)
        return LogitsSummary(*summaries, lse_max=lse_max, argmax=self.argmax)


def vary_along(tree: Any, axes: tuple[str, ...]) -> Any:
    """Mark every array leaf of ``tree`` as varying along ``axes`` (inside ``shard_map``).

    A statistic of sharded tokens must be summed over the token axes even when
    one of its fields happens to be identical on every shard (a count computed
    without a mask is the local token count, the same everywhere): ``psum`` then
    multiplies it by the axis size, which is the right global count.
    ``jvitals.metrics.stats.reduce`` reduces each field over the axes JAX says it varies
    along, so the fields are cast to varying first (``lax.pcast(..., to='varying')``).
    Where JAX does not track varying axes this is the identity.
    """
    if not axes:
        return tree

    def cast(x: Any) -> Any:
        if not isinstance(x, jax.Array) and not hasattr(x, "aval"):
            return x
        return make_varying(x, axes)

    return jax.tree.map(cast, tree)


# Logits per chunk when summarize_logits picks (chunk_elements=None) on the CPU:
# an eighth of them, within [512 KiB, 4 MiB] of float32. Smaller chunks cost
# XLA:CPU one loop iteration each (measured: 4 chunks of small's 512 x 512 logits
# instead of 2 cost 5% of its 10 ms step); larger ones, temporaries of their size.
# Other backends take one pass: GPU/TPU fuse the selects and compares into the
# reductions (so no logits-sized temporaries are expected; the one-pass path's
# memory is not yet measured on a device), and each iteration of a loop of small chunks
# costs a GPU a round trip to the host (on an H200, the probes cost 13% of a
# 34 ms step, this one's 256 chunks of 2^20 logits among them).
_CHUNK_MIN, _CHUNK_MAX, _CHUNKS = 1 << 17, 1 << 20, 8


def _row_stats(x: jax.Array) -> tuple[jax.Array, ...]:
    """Per-row (last axis) reductions of ``[R, V]`` float32 logits; each ``[R]``.

    Returns ``(top1, top2, lse, sum, sumsq, abs_max, nonfinite, argmax)``, for
    any values (NaN and +-inf included), with no conditional:

    - ``top1 = max x``, NaN if the row holds a NaN (on every backend);
    - ``argmax``: the first index of ``top1``, or of the first NaN (what
      ``jnp.argmax`` gives);
    - ``top2 = max`` over every other index -- what ``lax.top_k(x, 2)`` gives on
      finite rows, so a tie gives ``top2 == top1``;
    - ``lse = s + log(sum exp(x - s))`` with ``s = top1`` where finite, else 0
      (``jax.nn.logsumexp``'s shift: +inf for a row holding +inf, -inf for a row
      of -inf);
    - ``nonfinite``: the number of NaN/Inf entries (a row's sums, sumsq and
      abs_max are meaningless where it is > 0; the caller leaves them out).

    Eight plain reductions: XLA:CPU's own ``argmax`` is a variadic reduction ~8x
    slower than all of them together. No ``lax.cond`` either: in a ``lax.map``
    body XLA:CPU pays for the skipped branch on every iteration (measured: 4.5%
    of the moe config's step), and one after the loop makes XLA copy the logits
    (x1.06 temp memory on the medium config).
    """
    v = x.shape[-1]
    m = jnp.max(x, axis=-1)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = shift + jnp.log(jnp.sum(jnp.exp(x - shift[:, None]), axis=-1))
    # XLA:CPU's max drops NaN (openxla/xla#21461); the exp sum keeps it: NaN
    # exactly for a row holding a NaN (x - shift <= 0 elsewhere, or +inf).
    top1 = jnp.where(jnp.isnan(lse), jnp.nan, m)
    # The argmax in one pass that does not wait for the exp sum (so a consumer of
    # the argmax alone, MTP agreement, costs two passes): a NaN's index ranks
    # before every index of the maximum, whichever ``m`` the backend's max gave.
    # A float32 iota reduces faster than int32 on CPU; exact up to 2v <= 2^24.
    iota = lax.broadcasted_iota(_F32 if v <= (1 << 23) else jnp.int32, x.shape, 1)
    rank = jnp.min(jnp.where(x != x, iota, jnp.where(x == m[:, None], iota + v, 2 * v)), axis=-1)
    first = jnp.where(rank >= v, rank - v, rank)
    top2 = jnp.max(jnp.where(iota == first[:, None], -jnp.inf, x), axis=-1)
    # max|x| = max(m, -min x) on a finite row (the only rows it is read for):
    # a plain min reduces twice as fast as a max of |x| on XLA:CPU.
    amax = jnp.maximum(m, -jnp.min(x, axis=-1))
    return (top1, top2, lse, jnp.sum(x, axis=-1), jnp.sum(x * x, axis=-1), amax,
            jnp.sum(jnp.where(jnp.isfinite(x), 0.0, 1.0), axis=-1), first.astype(jnp.int32))


def _chunk_rows(rows: int, v: int, chunk_elements: int | None) -> int:
    """Largest divisor of ``rows`` with ``chunk * v <= chunk_elements`` (>= 1).

    ``chunk_elements``: None picks ``clip(rows * v / 8, 2^17, 2^20)``; 0 means
    one chunk of everything.
    """
    if chunk_elements is None:
        chunk_elements = min(max(rows * v // _CHUNKS, _CHUNK_MIN), _CHUNK_MAX)
    if not chunk_elements or rows * v <= chunk_elements:
        return rows
    target = max(1, chunk_elements // max(v, 1))
    return max(d for d in range(1, min(rows, target) + 1) if rows % d == 0)


@eager_jit(static_argnames=("chunk_elements",))
def summarize_logits(logits: jax.Array, mask: jax.Array | None = None, *,
                     chunk_elements: int | None = None) -> LogitsSummary:
    """Reduce ``[..., V]`` logits to a :class:`LogitsSummary` (float32).

    Per position: ``top1 = max_v x``; a tie when ``top1`` occurs at least twice
    (then ``top2 = top1``), else ``top2 = max{x_v : x_v < top1}`` -- the values
    ``lax.top_k(x, 2)`` returns, without its cost on CPU;
    ``lse = logsumexp_v x``. Masked positions count nowhere (a masked position
    holding inf/NaN or huge values changes nothing).

    On the CPU the per-position reductions run over chunks of positions
    (``lax.map``) of at most ``chunk_elements`` logits, so the temporaries
    XLA:CPU materialises (one per select or compare feeding a reduction) stay
    small. Other backends fuse those into the reductions, so by default they take
    one pass (``lax.platform_dependent``: the backend compiling the step decides).

    Args:
      logits: ``[..., V]`` array of any float dtype (cast to float32 first).
      mask: optional boolean ``logits.shape[:-1]`` (``[B, T]``), True = valid.
      chunk_elements: logits per chunk, on every backend; None: on the CPU an
        eighth of them, within ``[2^17, 2^20]``, elsewhere one pass; 0: one pass
        over everything.

    Returns:
      A :class:`LogitsSummary`.

    Raises:
      ValueError: if ``mask`` does not have the shape ``logits.shape[:-1]``.
    """
    x = lax.stop_gradient(jnp.asarray(logits))
    pos_shape = tuple(x.shape[:-1])
    v = x.shape[-1]
    if mask is None:
        valid = jnp.ones(pos_shape, bool)
    else:
        valid = jnp.asarray(mask, bool)
        if tuple(valid.shape) != pos_shape:
            raise ValueError(
                f"logits of shape {tuple(x.shape)} are [..., V] = ({', '.join(map(str, pos_shape))}, "
                f"{v}): the mask must have their leading shape {pos_shape}, got "
                f"{tuple(valid.shape)}.")
    rows = int(np.prod(pos_shape, dtype=np.int64))
    stats = _row_stats_chunked(x.reshape(rows, v), rows, v, chunk_elements)
    rows = LogitsRows(*(s.reshape(pos_shape) for s in stats), vocab=v)
    return rows.summary(valid)


@struct.dataclass
class LogitsRows:
    """Per-position logits statistics, before any token mask (what ``instrument`` sows).

    Every field has the positions' shape (``[B, T]``; ``[L, B, T]`` scan-stacked):
    ``top1``, ``top2``, ``lse`` as :class:`LogitsSummary` defines them, the row's
    ``sum``, ``sumsq``, ``abs_max`` (meaningless where ``nonfinite > 0``), its
    non-finite count and ``argmax`` (int32). ``vocab`` is ``V`` (static).
    :meth:`summary` applies the mask: ``logits_rows(x).summary(m) ==
    summarize_logits(x, m)``, so padding is excluded after the fact.
    """

    top1: jax.Array
    top2: jax.Array
    lse: jax.Array
    sum: jax.Array
    sumsq: jax.Array
    abs_max: jax.Array
    nonfinite: jax.Array
    argmax: jax.Array
    vocab: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        """The positions' shape."""
        return tuple(self.top1.shape)

    def summary(self, mask: jax.Array | None = None) -> "LogitsSummary":
        """The :class:`LogitsSummary` over the positions where ``mask`` is True.

        Raises:
          ValueError: if ``mask`` does not have the positions' shape.
        """
        pos_shape = self.shape
        if mask is None:
            valid = jnp.ones(pos_shape, bool)
        else:
            valid = jnp.asarray(mask, bool)
            if tuple(valid.shape) != pos_shape:
                raise ValueError(f"logits rows of positions {pos_shape}: the mask must have that shape, "
                                 f"got {tuple(valid.shape)}.")
        return _rows_summary(self.top1, self.top2, self.lse, self.sum, self.sumsq, self.abs_max,
                             self.nonfinite, self.argmax, valid, self.vocab)


@eager_jit(static_argnames=("chunk_elements",))
def logits_rows(logits: jax.Array, *, chunk_elements: int | None = None) -> LogitsRows:
    """Per-position :class:`LogitsRows` of ``[..., V]`` logits (no mask; see
    :func:`summarize_logits` for the statistics and the chunking)."""
    x = lax.stop_gradient(jnp.asarray(logits))
    pos_shape = tuple(x.shape[:-1])
    v = x.shape[-1]
    rows = int(np.prod(pos_shape, dtype=np.int64))
    stats = _row_stats_chunked(x.reshape(rows, v), rows, v, chunk_elements)
    return LogitsRows(*(s.reshape(pos_shape) for s in stats), vocab=v)


def _row_stats_chunked(x2: jax.Array, rows: int, v: int, chunk_elements: int | None) -> tuple[jax.Array, ...]:
    def chunked(x2: jax.Array, chunk: int) -> tuple[jax.Array, ...]:
        if chunk < rows:
            out = lax.map(lambda c: _row_stats(c.astype(_F32)), x2.reshape(rows // chunk, chunk, v))
            return tuple(o.reshape(rows) for o in out)
        return _row_stats(x2.astype(_F32))

    if chunk_elements is None:
        return lax.platform_dependent(cpu=lambda: chunked(x2, _chunk_rows(rows, v, None)),
                                      default=lambda: chunked(x2, rows))
    return chunked(x2, _chunk_rows(rows, v, chunk_elements))


def _rows_summary(top1: jax.Array, top2: jax.Array, lse: jax.Array, r_sum: jax.Array, r_sumsq: jax.Array,
                  r_amax: jax.Array, r_bad: jax.Array, argmax: jax.Array, valid: jax.Array,
                  v: int) -> "LogitsSummary":
    tie = top2 == top1
    diff = top1 - top2
    tie_f = jnp.where(jnp.isfinite(diff), tie.astype(_F32), jnp.nan)
    # The logits' Summary from per-row pieces: a row with a non-finite value makes
    # every statistic NaN through ``nonfinite``; its sums are left out.
    ok = valid & (r_bad == 0)
    count = jnp.sum(valid, dtype=_F32) * v
    nonfinite = jnp.sum(jnp.where(valid, r_bad, 0.0))
    amax = jnp.max(jnp.where(ok, r_amax, 0.0), initial=0.0)
    logit_s = Summary(
        count=count,
        sum=jnp.sum(jnp.where(ok, r_sum, 0.0)),
        sumsq=jnp.sum(jnp.where(ok, r_sumsq, 0.0)),
        abs_max=jnp.where((nonfinite > 0) | (count <= 0), jnp.nan, amax).astype(_F32),
        nonfinite=nonfinite,
    )
    lse_s, diff_s, tie_s = summarize_many([(lse, valid, None), (diff, valid, None), (tie_f, valid, None)])
    lse_max = jnp.max(jnp.where(valid, lse, -jnp.inf), initial=-jnp.inf)
    lse_max = jnp.where((lse_s.nonfinite > 0) | (lse_s.count <= 0), jnp.nan, lse_max).astype(_F32)
    return LogitsSummary(
        logits=logit_s,
        top2_diff=diff_s,
        top2_tie=tie_s,
        lse=lse_s,
        lse_max=lse_max,
        argmax=argmax,
    )


def sow_summary(module: Any, name: str, x: jax.Array, mask: jax.Array | None = None) -> bool:
    """Sow ``summarize(x, mask)`` under ``name`` in the ``'intermediates'`` collection.

    Five float32 scalars instead of ``x``. ``activation_metrics`` treats the sown
    ``Summary`` exactly as it would the raw ``x`` with that ``mask``.

    Args:
      module: the Linen module doing the sowing (``self``).
      name: the METRICS.md §7 NAME (``'hidden_states'``, ``'gate_scores'``, ...).
      x: activations, leading axes ``[B, T]``.
      mask: optional ``[B, T]`` token mask (True = valid).

    Returns:
      Whatever ``Module.sow`` returns (False when 'intermediates' is not mutable).
    """
    return module.sow("intermediates", name, summarize(lax.stop_gradient(x), mask))


def logits_probe(module: Any, logits: jax.Array, mask: jax.Array | None = None,
                 name: str = "logits") -> bool:
    """Sow a :class:`LogitsSummary` of ``logits`` under ``name`` (never the logits).

    Use ``name='mtp_logits'`` for each MTP depth (in order k = 1..K).

    Args:
      module: the Linen module doing the sowing (``self``).
      logits: ``[B, T, V]`` logits.
      mask: optional ``[B, T]`` token mask.
      name: sow name (``'logits'`` or ``'mtp_logits'``).

    Returns:
      Whatever ``Module.sow`` returns.
    """
    return module.sow("intermediates", name, summarize_logits(logits, mask))


def attention_valid_mask(mask: jax.Array | None, tq: int, tk: int, ndim: int,
                         causal: bool = True) -> jax.Array:
    """Boolean mask of valid ``(query, key)`` entries for ``[B, ..., Tq, Tk]`` scores.

    ``valid[b, ..., q, k] = (k <= q + (Tk - Tq)) & mask[b, q] & mask[b, k]`` (causal
    term only when ``causal``; the offset aligns the last query with the last key).
    Shape ``[B or 1, 1, ..., Tq, Tk]`` with ``ndim`` axes, ready to broadcast.

    Args:
      mask: ``[B, T]`` token mask (``T == Tq == Tk``) or None.
      tq, tk: query and key lengths.
      ndim: rank of the scores.
      causal: apply the causal (lower-triangular) term.
    """
    mid = (1,) * (ndim - 3)
    valid = jnp.ones((1,) + mid + (tq, tk), bool)
    if causal:
        valid = valid & jnp.tril(jnp.ones((tq, tk), bool), k=tk - tq).reshape((1,) + mid + (tq, tk))
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        b = mask.shape[0]
        valid = valid & mask.reshape((b,) + mid + (tq, 1)) & mask.reshape((b,) + mid + (1, tk))
    return valid


def attn_logits_probe(module: Any, scores: jax.Array, mask: jax.Array | None = None,
                      name: str = "attn_logits", *, causal: bool = True) -> bool:
    """Sow the maximum |pre-softmax attention score| over valid entries (a ``Summary``).

    Only ``count``, ``abs_max`` and ``nonfinite`` are measured
    (:func:`~jvitals.metrics.stats.summarize_max`: one reduction over ``[B, H, T, T]``
    per layer); the summary's mean/rms are NaN by construction.

    Valid entries: causal (``k <= q``) and both the query and the key are real
    tokens. ``abs_max`` of the sown summary is the max attention logit of the
    layer (the QK-clip / attention-logit-growth signal,
    ``act/attn_logits_abs.max``).

    Args:
      module: the Linen module doing the sowing (``self``).
      scores: ``[B, ..., Tq, Tk]`` pre-softmax scores (heads in the middle axes),
        before or after masking: masked entries are excluded here either way.
      mask: ``[B, T]`` token mask, or a boolean mask broadcastable to ``scores``
        (same rank), used as is (``causal`` then ignored), or None.
      name: sow name.
      causal: include the causal term (token masks only).

    Returns:
      Whatever ``Module.sow`` returns.
    """
    scores = lax.stop_gradient(scores)
    if mask is not None and jnp.ndim(mask) == scores.ndim:
        valid = jnp.asarray(mask, bool)
    else:
        valid = attention_valid_mask(mask, scores.shape[-2], scores.shape[-1], scores.ndim, causal)
    return module.sow("intermediates", name, summarize_max(scores, valid))


def perturb_values(module: Any, v: jax.Array, name: str = "bos_value") -> jax.Array:
    """``module.perturb(name, v)``: a zero perturbation whose gradient is ``dLoss/dv``.

    Put it on the attention value vectors (``[B, T, heads, head_dim]``) and take
    ``jax.grad`` of the loss with respect to the ``'perturbations'`` collection
    (initialised by ``Module.init``, zeros of ``v``'s shape; stacked under
    ``nn.scan`` with ``variable_axes={'perturbations': 0}``). Without that collection
    in ``apply`` it is the identity. Feed the gradients to
    :func:`jvitals.metrics.activations.bos_value_grad_metrics`.
    """
    return module.perturb(name, v)
