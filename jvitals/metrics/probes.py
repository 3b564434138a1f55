"""Model-side probes: sow compact summaries instead of whole tensors.

A plain ``self.sow('intermediates', 'logits', logits)`` keeps a ``[B, T, V]`` tensor alive
until the metrics are computed. The probes compute, inside the model, the few numbers a
metric needs and sow those under the same METRICS.md §7 NAME, so
:func:`~jvitals.metrics.activations.activation_metrics` reads either form:
:func:`sow_summary` (a :class:`~jvitals.metrics.stats.Summary`), :func:`logits_probe` (a
:class:`LogitsSummary`, with the ``[B, T]`` argmax MTP agreement needs),
:func:`attn_logits_probe` (or :func:`attn_softmax_probe`, which takes the model's softmax
too), :func:`perturb_values`. Every probe works on ``lax.stop_gradient`` of its input (the
model's gradients never change); summaries are mask-aware at sow time: pass the model's token
mask.

The table of probes and sizes, and ``nn.scan``: docs/DEVICE.md, "probes: compact summaries
sown in the model".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jvitals.metrics import fold
from jvitals.metrics.stats import Summary, _count_and_mask, nan_rule, eager_jit, reduce, summarize, summarize_max
from jvitals.metrics.axes import make_varying, pmax_over

__all__ = [
    "LogitsRows",
    "LogitsSummary",
    "attn_logits_probe",
    "attn_softmax_probe",
    "attention_valid_mask",
    "logits_probe",
    "logits_rows",
    "perturb_values",
    "row_argmax",
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
        (``rms = sqrt(sum logits^2 / (n_valid * V))``, ``abs_max``); its
        ``nonfinite`` counts the valid positions holding a NaN or an infinity (rows,
        not entries, as :func:`attn_softmax_probe` counts query rows; :func:`_row_stats`), and
        ``rms`` and ``abs_max`` are NaN where it is > 0.
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
        (``[B, T]``), the first maximum; -1 at a position holding a NaN (no class);
        masked positions hold their argmax too (the consumer masks).
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


_EXACT_IOTA = 1 << 24
"""Below this many columns a float32 holds every column index exactly."""


def _first_max(x2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(max, first column holding it, the column index)`` of ``[R, V]`` rows, as plain
    reductions (the maximum, then the least column equal to it). The column index is a
    float32 below :data:`_EXACT_IOTA` columns (XLA:CPU vectorises float reductions, not
    integer ones), int32 above. A row holding a NaN may give any column: its caller
    decides (NaN maxima are not equal to themselves)."""
    top1 = jnp.max(x2, axis=-1)
    v = x2.shape[-1]
    dtype, none = (_F32, jnp.inf) if v < _EXACT_IOTA else (jnp.int32, v)
    col = lax.broadcasted_iota(dtype, x2.shape, 1)
    first = jnp.min(jnp.where(x2 == top1[:, None], col, none), axis=-1)
    return top1, jnp.minimum(first, v - 1).astype(jnp.int32), col


def row_argmax(x: jax.Array) -> jax.Array:
    """The first column of each row's maximum (last axis) as int32, -1 for a row holding a
    NaN: :class:`LogitsRows`' ``argmax`` of raw logits (the raw MTP logits' argmax), from the
    same plain reductions (:func:`_row_stats`; XLA drops the figures not used). On rows
    without a NaN it is ``jnp.argmax(x, -1)``. The TPU compiler reads it in the kernels of a
    loss's ``logsumexp`` of the same float32 logits (docs/COST.md)."""
    return _row_stats(x)[-1]


def _row_stats(x: jax.Array) -> tuple[jax.Array, ...]:
    """Per-row (last axis) statistics of ``[..., V]`` logits by plain reductions; each ``[...]``.

    Returns ``(top1, top2, lse, sum, sumsq, abs_max, nonfinite, argmax)``, for any values:

    - ``top1 = max x``; ``argmax``, the first column holding it (int32); ``top2``, the
      largest entry of the other columns (a tie gives ``top2 == top1``, as
      ``lax.top_k(x, 2)``; a select, not a copy of the logits with that column set);
    - ``lse = jax.nn.logsumexp(x)`` as written (+inf for a row holding +inf, -inf for a
      row of -inf, NaN for a row holding a NaN);
    - ``sum``, ``sumsq``, ``abs_max = max |x|`` of the row (not finite where it holds a
      non-finite value: the summary leaves such a row's out);
    - ``nonfinite``: 1 where the row holds a NaN or an infinity (``lse`` NaN: a NaN, NaN
      survives every sum; ``abs_max`` +inf: an infinity), else 0: a row flag, not a count
      of entries;
    - a row holding a NaN has ``top1 = top2 = NaN`` and ``argmax = -1`` (no class).

    Every figure is a plain reduction of the float32 logits, one form for every backend:
    the TPU compiler fuses them with a loss's own reductions of the same float32 logits
    (``jax.nn.logsumexp`` is computed once), and XLA:CPU vectorises them. A count of the
    non-finite entries, or the first NaN's column, would each read the logits once more
    on the TPU (docs/COST.md), which is why a row flag and ``-1`` stand in their place.
    """
    xf = jnp.asarray(x).astype(_F32)
    shape, v = xf.shape, xf.shape[-1]
    x2 = xf.reshape(-1, v)
    top1, argmax, col = _first_max(x2)
    top2 = jnp.max(jnp.where(col == argmax[:, None].astype(col.dtype), -jnp.inf, x2), axis=-1)
    lse = jax.nn.logsumexp(x2, axis=-1)
    amax = jnp.max(jnp.abs(x2), axis=-1)
    nan = jnp.isnan(lse)
    bad = (nan | (amax == jnp.inf)).astype(_F32)
    out = (jnp.where(nan, jnp.nan, top1), jnp.where(nan, jnp.nan, top2), lse, jnp.sum(x2, axis=-1),
           jnp.sum(x2 * x2, axis=-1), amax, bad, jnp.where(nan, -1, argmax))
    return tuple(o.reshape(shape[:-1]) for o in out)


def _chunk_rows(rows: int, v: int, chunk_elements: int | None) -> int:
    """Largest divisor of ``rows`` with ``chunk * v <= chunk_elements`` (>= 1);
    ``rows`` (one pass) when ``chunk_elements`` is None or 0."""
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

    Every per-position statistic is a plain reduction over the vocabulary
    (:func:`_row_stats`), which the TPU compiler fuses into one read of the logits, with
    a loss's ``logsumexp`` of the same float32 logits; the masked summary over positions
    is one reduction over the ``[B, T]`` row figures.

    Args:
      logits: ``[..., V]`` array of any float dtype (cast to float32 first).
      mask: optional boolean ``logits.shape[:-1]`` (``[B, T]``), True = valid.
      chunk_elements: optional: reduce at most this many logits at a time (a
        ``lax.map`` over chunks of positions); None or 0 (default): one pass.

    Returns:
      A :class:`LogitsSummary`.

    Raises:
      ValueError: if ``mask`` does not have the shape ``logits.shape[:-1]``.
    """
    x = lax.stop_gradient(jnp.asarray(logits))
    if x.ndim < 1:
        raise ValueError(f"summarize_logits: logits must have a vocabulary axis [..., V], got shape {x.shape}")
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
    ``sum``, ``sumsq``, ``abs_max`` (meaningless where ``nonfinite > 0``), ``nonfinite``
    (1 where the row holds a NaN or an infinity, else 0) and ``argmax`` (int32; -1 where
    the row holds a NaN). ``vocab`` is ``V`` (static).
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
        return _rows_summary(self, valid)


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
    chunk = _chunk_rows(rows, v, chunk_elements)
    if chunk < rows:
        out = lax.map(_row_stats, x2.reshape(rows // chunk, chunk, v))
        return tuple(o.reshape(rows) for o in out)
    return _row_stats(x2)


def _rows_summary(rows: "LogitsRows", valid: jax.Array) -> "LogitsSummary":
    """The masked :class:`LogitsSummary` from per-row figures: one reduction over positions.

    A row with a non-finite value makes every logits statistic NaN through
    ``nonfinite``; its sums are left out. ``top2_diff``, ``top2_tie`` and ``lse``
    are summaries of per-row values (``tie`` NaN where ``top1 - top2`` is not
    finite), ``lse_max`` the signed maximum of ``lse`` over valid rows.
    """
    top1, top2, lse, argmax, v = rows.top1, rows.top2, rows.lse, rows.argmax, rows.vocab
    r_sum, r_sumsq, r_amax, r_bad = rows.sum, rows.sumsq, rows.abs_max, rows.nonfinite
    diff = top1 - top2
    tie_f = jnp.where(jnp.isfinite(diff), (top2 == top1).astype(_F32), jnp.nan)
    ok = valid & (r_bad == 0)
    ops, inits, names = [], [0.0] * 12, ["sum", "sum", "max", "sum"] * 3
    for x in (lse, diff, tie_f):
        ops += fold.summary_ops(x, valid, fold.FULL)
    ops += [jnp.where(ok, r_sum, 0.0), jnp.where(ok, r_sumsq, 0.0), jnp.where(ok, r_amax, 0.0),
            jnp.where(valid, r_bad, 0.0), jnp.where(valid, lse, -jnp.inf), valid.astype(_F32)]
    inits += [0.0, 0.0, 0.0, 0.0, -jnp.inf, 0.0]
    names += ["sum", "sum", "max", "sum", "max", "sum"]
    got = fold.fold(ops, inits, fold.kinds(names)[1])
    n = got[-1]
    pos = [Summary(count=n, sum=got[j], sumsq=got[j + 1], abs_max=nan_rule(got[j + 2], n, got[j + 3]),
                   nonfinite=got[j + 3]) for j in (0, 4, 8)]
    lse_s, diff_s, tie_s = pos
    count = n * v
    nonfinite = got[15]
    logit_s = Summary(count=count, sum=got[12], sumsq=got[13], abs_max=nan_rule(got[14], count, nonfinite),
                      nonfinite=nonfinite)
    lse_max = jnp.where((lse_s.nonfinite > 0) | (n <= 0), jnp.nan, got[16]).astype(_F32)
    return LogitsSummary(logits=logit_s, top2_diff=diff_s, top2_tie=tie_s, lse=lse_s, lse_max=lse_max,
                         argmax=argmax)


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
    with fold.cpu_plain():   # the CPU's fastest form (fold.cpu_plain)
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
    with fold.cpu_plain():   # the CPU's plain form of the positions' summary (fold.cpu_plain)
        summary = summarize_logits(logits, mask)
    return module.sow("intermediates", name, summary)


def attention_valid_mask(mask: jax.Array | None, tq: int, tk: int, ndim: int,
                         causal: bool = True, *, queries: bool = True) -> jax.Array:
    """Boolean mask of valid ``(query, key)`` entries for ``[B, ..., Tq, Tk]`` scores.

    ``valid[b, ..., q, k] = (k <= q + (Tk - Tq)) & mask[b, q] & mask[b, k]`` (causal
    term only when ``causal``; the offset aligns the last query with the last key; the
    query term only when ``queries``: without it, the keys a softmax may attend to).
    Shape ``[B or 1, 1, ..., Tq, Tk]`` with ``ndim`` axes, ready to broadcast.

    Args:
      mask: ``[B, T]`` token mask (``T == Tq == Tk``) or None.
      tq, tk: query and key lengths.
      ndim: rank of the scores.
      causal: apply the causal (lower-triangular) term.
      queries: apply the mask's query term ``mask[b, q]``.
    """
    mid = (1,) * (ndim - 3)
    valid = jnp.ones((1,) + mid + (tq, tk), bool)
    if causal:
        valid = valid & jnp.tril(jnp.ones((tq, tk), bool), k=tk - tq).reshape((1,) + mid + (tq, tk))
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        b = mask.shape[0]
        valid = valid & mask.reshape((b,) + mid + (1, tk))
        if queries:
            valid = valid & mask.reshape((b,) + mid + (tq, 1))
    return valid


def _check_attention(where: str, scores: jax.Array, mask: jax.Array | None) -> None:
    """A clear error for scores that are not ``[B, ..., Tq, Tk]`` or a mask that does not fit
    them (a ``[B, T]`` token mask with ``T == Tq == Tk``, or a boolean mask of the scores'
    rank that broadcasts to them)."""
    shape = tuple(jnp.shape(scores))
    if len(shape) < 3:
        raise ValueError(f"{where}: scores of shape {shape}: pass [B, ..., Tq, Tk] pre-softmax scores "
                         "(batch first, heads in the middle, queries and keys last)")
    if mask is None:
        return
    ms = tuple(jnp.shape(mask))
    if len(ms) == len(shape):
        try:
            np.broadcast_shapes(ms, shape)
        except ValueError:
            raise ValueError(f"{where}: a mask of shape {ms} does not broadcast against scores of shape {shape}: "
                             f"pass a [B, T] token mask (here {(shape[0], shape[-1])}) or a boolean mask of the "
                             "scores' shape") from None
        return
    if len(ms) != 2 or ms[0] not in (1, shape[0]) or not ms[1] == shape[-2] == shape[-1]:
        raise ValueError(f"{where}: a token mask of shape {ms} for scores of shape {shape}: pass the [B, T] "
                         f"token mask of the batch (here {(shape[0], shape[-1])}, with Tq == Tk == T), or a "
                         "boolean mask of the scores' rank")


def attn_logits_probe(module: Any, scores: jax.Array, mask: jax.Array | None = None,
                      name: str = "attn_logits", *, causal: bool = True) -> bool:
    """Sow the maximum |pre-softmax attention score| over valid entries (a ``Summary``).

    Only ``count``, ``abs_max`` and ``nonfinite`` are measured
    (:func:`~jvitals.metrics.stats.summarize_max`: one reduction over ``[B, H, T, T]``
    per layer); the summary's mean/rms are NaN by construction.

    Valid entries: causal (``k <= q``) and both the query and the key are real
    tokens. Where the model's masked softmax can be taken by jvitals,
    :func:`attn_softmax_probe` sows the same figure from the softmax's own row reductions
    (on the TPU compiler this probe's reduction reads the scores again on an unrolled
    model: docs/COST.md). ``abs_max`` of the sown summary is the max attention logit of the
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

    Raises:
      ValueError: scores of fewer than 3 axes, or a mask that fits them neither as a ``[B, T]``
        token mask nor as a mask of their rank.
    """
    _check_attention("attn_logits_probe", scores, mask)
    scores = lax.stop_gradient(scores)
    if mask is not None and jnp.ndim(mask) == scores.ndim:
        valid = jnp.asarray(mask, bool)
    else:
        valid = attention_valid_mask(mask, scores.shape[-2], scores.shape[-1], scores.ndim, causal)
    with fold.cpu_plain():
        return module.sow("intermediates", name, summarize_max(scores, valid))


def attn_softmax_probe(module: Any, scores: jax.Array, mask: jax.Array | None = None,
                       name: str = "attn_logits", *, causal: bool = True) -> jax.Array:
    """The attention probabilities, ``softmax`` over the keys of the masked scores, and
    :func:`attn_logits_probe`'s summary sown from the same read of the scores.

    ``probs = jax.nn.softmax(where(keys_ok, scores, -1e30), axis=-1)``, ``keys_ok`` the
    causal term and the key's token mask (a query whose keys are all masked attends
    uniformly, as in any ``-1e30``-masked softmax; float16 scores take ``-65504``, its
    largest finite value). The summary is taken per row first:
    ``max |s| = max over rows of max(max_k where(keys_ok, s, -1e30), -min_k where(keys_ok,
    s, 1e30))``, the padded query rows dropped afterwards. The row maximum is the one the
    softmax takes, the same expression, so the compiler computes it once; the row minimum
    is its sibling over the same operand. On the TPU compiler both ride in the kernel of
    the score matmul on an unrolled model too, where :func:`attn_logits_probe`'s separate
    reduction is merged across layers and reads the written-out scores again
    (docs/COST.md). Use it in place of the model's own masked softmax.

    ``count`` and ``abs_max`` are :func:`attn_logits_probe`'s; ``nonfinite`` counts the
    valid rows (a head's query) holding a non-finite score, not the scores themselves
    (``abs_max`` is NaN then either way).

    Args:
      module: the Linen module doing the sowing (``self``).
      scores: ``[B, ..., Tq, Tk]`` pre-softmax scores (heads in the middle axes).
      mask: ``[B, T]`` token mask, or a boolean mask of the scores' rank used as is
        (``causal`` then ignored), or None.
      name: sow name.
      causal: include the causal term (token masks only).

    Returns:
      ``[B, ..., Tq, Tk]`` probabilities, the scores' dtype.

    Raises:
      ValueError: as :func:`attn_logits_probe`.
    """
    _check_attention("attn_softmax_probe", scores, mask)
    nd = scores.ndim
    tq, tk = scores.shape[-2:]
    rows = None   # the [B, ..., Tq] query rows a token mask keeps
    if mask is not None and jnp.ndim(mask) == nd:
        keys_ok = valid = jnp.asarray(mask, bool)
    else:
        keys_ok = attention_valid_mask(mask, tq, tk, nd, causal, queries=False)
        valid = attention_valid_mask(mask, tq, tk, nd, causal)
        if mask is not None:
            m = jnp.asarray(mask, bool)
            rows = m.reshape((m.shape[0],) + (1,) * (nd - 3) + (tq,))
    big = min(1e30, float(jnp.finfo(jnp.result_type(scores)).max))   # finite in float16 too
    probs = jax.nn.softmax(jnp.where(keys_ok, scores, -big), axis=-1)
    s = lax.stop_gradient(scores)   # in the scores' own dtype: the softmax's row maximum, to the letter
    hi = jnp.max(jnp.where(keys_ok, s, -big), axis=-1).astype(_F32)
    lo = jnp.min(jnp.where(keys_ok, s, big), axis=-1).astype(_F32)
    row = jnp.maximum(hi, -lo)   # max |s| of a row; -big where the row has no valid key
    bad = ~jnp.isfinite(row)
    row = jnp.maximum(row, 0.0)
    if rows is not None:
        row = jnp.where(rows, row, 0.0)
        bad = bad & rows
    count = _count_and_mask(valid, tuple(scores.shape), None, None)[0]
    nonfinite = jnp.sum(bad, dtype=_F32)
    amax = jnp.max(row)   # NaN by nan_rule below wherever a row is bad
    nan = jnp.full((), jnp.nan, _F32)
    module.sow("intermediates", name, Summary(count=count, sum=nan, sumsq=nan,
                                              abs_max=nan_rule(amax, count, nonfinite), nonfinite=nonfinite))
    return probs


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
