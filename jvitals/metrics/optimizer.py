"""Optimizer-state vitals (METRICS.md §3): Adam second moments, loss scale, skipped steps.

``optimizer_metrics`` finds every Adam-like state (a NamedTuple with a ``nu`` field:
``optax.ScaleByAdamState``, AMSGrad's, AdaBelief's) wherever it sits in the chain —
inside ``chain``, ``inject_hyperparams``, ``apply_if_finite``, ``MultiSteps``,
``masked``... — and reports over all their ``nu`` elements:

    opt/adam_nu_abs.max       = max |nu|                       (exact)
    opt/adam_nu_median        ~ median(nu)                     (log-histogram, below)
    opt/adam_nu_log10_spread  = log10(max nu) - log10(median nu)

**The median** is read from a histogram, not a sort: each float32 ``|nu|`` falls in
the bin given by its top 16 bits (sign, 8 exponent bits, 7 mantissa bits), so the
bins are uniform in log space, ``2^-7`` relative wide (~0.0034 decades), and cover
every float32. Histograms of all leaves are summed and ``psum``-ed (32768 counts),
the median bin found by a cumulative sum, and the bin's midpoint returned: within
``log10(1 + 2^-7) < 0.0034`` of NumPy's ``log10(median)`` (exact ranks; for an even
count the two middle bins' values are averaged, as NumPy does). Bin 0 (zero and
denormals below ``9.2e-41``) reads as 0, so a model whose ``nu`` is mostly zero has
an infinite spread, as NumPy would. Cost on the CPU: one read and a 32768-bin
scatter-add per leaf; no sort, no concatenation, no host sync. On GPUs and TPUs a
scatter-add of many equal indices serialises (as long as a whole training step on a
GPU, docs/COST.md), so there ``'auto'`` takes :func:`window_quantile`: the bin of a
sample's median (every 32nd block of 8 rows of each leaf, 32 blocks at most; the first 8
rows of a leaf under 256 rows), then **one read of each leaf** that takes its maximum and
counts it at 16 edges around that bin (one kernel per leaf on the TPU); the median is the
bin's midpoint, as above, when it lies within 4 bins of the sample's, else interpolated
across a wider interval (the function's docstring).
:func:`search_quantile` finds the exact bins in four reads of each leaf (``median=``
chooses).

**On the CPU, above** ``2 NU_SAMPLE`` **values** (about a million), the median is that of a
systematic sample (:func:`systematic_sample`: every ``k``-th value of each leaf, ``k`` odd,
about ``NU_SAMPLE`` values), binned the same way: XLA:CPU scatters one value per
nanosecond or so, and the scatter over every ``nu`` was the costliest figure of the whole
step there (the d256 benchmark, 4.9M ``nu``: +16% of the step, against +1.5% sampled). The
sample's median is exact to the bin on the sample; on real Adam ``nu`` (the reference
models after 1, 10 and 60 steps) it fell within 0.0024 decades of NumPy's median of every
value (the bins' own bound: 0.0034). ``median='histogram'`` or ``'search'`` reads every
value on any backend; ``'sample'`` the sample on any; ``'window'``
:func:`window_quantile` on any. The maximum reads every value.

``opt/loss_scale`` comes from a dynamic loss scale carried in the state (flax's
``DynamicScale``, jmp's ``DynamicLossScale``, or any leaf named ``loss_scale``), or
the ``loss_scale=`` argument. ``opt/skipped_steps`` is the sum of
``optax.apply_if_finite``'s ``total_notfinite`` (steps whose update was non-finite;
past ``max_consecutive_errors`` optax applies them anyway), with
``opt/consecutive_nonfinite`` beside it. ``opt/learning_rate`` is read from
``inject_hyperparams`` when present (``hyperparams['learning_rate']``, times every
``lr_scale`` of :func:`jvitals.with_lr_scale` in the state: the global scales, not
per-group ones), as the recorder logs it.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jvitals.metrics import fold
from jvitals.metrics.gradients import Accumulator, flat_specs
from jvitals.metrics.paths import path_str
from jvitals.metrics.variables import unwrap
from jvitals.metrics.stats import Summary, summarize_max
from jvitals.metrics.axes import check_axes, make_varying, psum_over, reduction_axes
from jvitals.metrics.checks import check_opt_state

__all__ = ["LR_SCALE", "LR_SCALE_ARG", "NU_BINS", "NU_SAMPLE", "WINDOW_BLOCKS", "WINDOW_SAMPLE", "block_sample",
           "histogram_quantile", "injected_hyperparams", "log_histogram", "optimizer_metrics", "search_quantile",
           "systematic_sample", "window_quantile"]

_F32 = jnp.float32
LR_SCALE = "lr_scale"
"""Name of the injected hyperparameter holding the global learning-rate scale
(:func:`jvitals.with_lr_scale`); ``opt/learning_rate`` multiplies every one in the state."""

LR_SCALE_ARG = "vitals_lr_scale"
"""Extra update argument carrying the global scale in force to the wrapped ``tx``
(:func:`jvitals.with_lr_scale` passes it; the recorder reads it)."""

NU_BINS = 1 << 15
"""Bins of the float32 log-histogram (top 16 bits of a non-negative float32)."""

NU_SAMPLE = 1 << 19
"""About how many ``nu`` values the CPU's median reads (:func:`systematic_sample`; every
value up to twice as many)."""


def _is_state_node(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_adam(x: Any) -> bool:
    return isinstance(x, tuple) and "nu" in getattr(x, "_fields", ())


def _is_apply_if_finite(x: Any) -> bool:
    return isinstance(x, tuple) and {"notfinite_count", "total_notfinite", "inner_state"} <= set(
        getattr(x, "_fields", ()))


def _is_inject(x: Any) -> bool:
    return isinstance(x, tuple) and {"hyperparams", "inner_state"} <= set(getattr(x, "_fields", ()))


def _is_loss_scale_obj(x: Any) -> bool:
    return type(x).__name__ in ("DynamicScale", "DynamicLossScale", "StaticLossScale")


_HIST_CHUNK = 1 << 18  # elements binned at a time: bounds the scatter's index buffer (1 MiB)


_NONFINITE_BIN = 0x7F80  # bits(+inf) >> 16: every bin from here up holds only Inf/NaN
_ROW = 128  # bins per row of histogram_quantile's two-level search


def _bins(x: jax.Array) -> jax.Array:
    """``bits(|x|) >> 16`` as int32: the :func:`log_histogram` bin of each element."""
    return (lax.bitcast_convert_type(jnp.abs(x.astype(_F32)), jnp.uint32) >> 16).astype(jnp.int32)


_SCATTER = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                       scatter_dims_to_operand_dims=(0,))


def _bins16(x: jax.Array) -> jax.Array:
    """The bins of ``x``, flat, as uint16 (they fit: ``NU_BINS = 2^15``)."""
    return (lax.bitcast_convert_type(jnp.abs(jnp.ravel(x).astype(_F32)), jnp.uint32) >> 16).astype(jnp.uint16)


def _count_bins(hist: jax.Array, idx: jax.Array) -> jax.Array:
    """``hist`` plus one count per bin index of ``idx`` (uint16: half the bytes of
    int32 indices on a backend that writes them out before scattering, XLA:CPU)."""
    return lax.scatter_add(hist, idx[:, None], jnp.ones(idx.shape, hist.dtype), _SCATTER,
                           indices_are_sorted=False, unique_indices=False,
                           mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def log_histogram(x: jax.Array, hist: jax.Array | None = None) -> jax.Array:
    """Counts of ``|x|`` per float32 top-16-bit bin (``NU_BINS`` int32); non-finite skipped.

    ``hist``: counts to add to (``log_histogram(b, log_histogram(a))`` counts
    both; one buffer for many leaves). Default: zeros.

    ``bin(v) = bits(|v|) >> 16``. Inf and NaN land in the top 128 bins (from
    ``bits(+inf) >> 16 = 0x7F80``, where no finite value lands), which are
    cleared at the end, so one read of ``x`` gives the bins. Large leaves are
    binned ``_HIST_CHUNK`` elements at a time (a loop over the whole chunks, each
    sliced inside the loop, then the remainder; nothing is padded or copied), so the
    scatter never holds more than one chunk of indices.
    """
    xf = jnp.asarray(x).ravel()
    n = xf.shape[0]

    def add(hist: jax.Array, part: jax.Array) -> tuple[jax.Array, None]:
        return _count_bins(hist, _bins16(part)), None

    hist = jnp.zeros([NU_BINS], jnp.int32) if hist is None else hist
    whole = (n // _HIST_CHUNK) * _HIST_CHUNK
    if whole == n == _HIST_CHUNK or 0 < n < _HIST_CHUNK:
        hist = add(hist, xf)[0]
    else:
        if whole:  # chunks sliced inside the loop: no copy of the whole chunks first
            hist = lax.fori_loop(0, whole // _HIST_CHUNK, lambda i, h: add(
                h, lax.dynamic_slice(xf, (i * _HIST_CHUNK,), (_HIST_CHUNK,)))[0], hist)
        if whole < n:
            hist = add(hist, lax.slice(xf, (whole,), (n,)))[0]
    return hist.at[_NONFINITE_BIN:].set(0)


def _log_histogram_many(xs: Sequence[jax.Array]) -> jax.Array:
    """:func:`log_histogram` of every array of ``xs`` together.

    A scatter reads and writes the whole ``NU_BINS`` histogram (128 KiB) besides its
    indices, so leaves smaller than a chunk are binned together: their bins are
    concatenated (one fusion reading each leaf once) into batches of at most
    ``_HIST_CHUNK`` indices, one scatter a batch; larger leaves go through
    :func:`log_histogram`'s chunks. The non-finite bins are cleared once.
    """
    hist = jnp.zeros([NU_BINS], jnp.int32)
    batch: list[jax.Array] = []
    size = 0

    def flush(hist: jax.Array, batch: list[jax.Array]) -> jax.Array:
        return _count_bins(hist, jnp.concatenate([_bins16(b) for b in batch]))

    for x in xs:
        n = int(np.prod(jnp.shape(x)))
        if n >= _HIST_CHUNK:
            hist = log_histogram(x, hist)
            continue
        if size + n > _HIST_CHUNK and batch:
            hist, batch, size = flush(hist, batch), [], 0
        batch.append(jnp.asarray(x))
        size += n
    if batch:
        hist = flush(hist, batch)
    return hist.at[_NONFINITE_BIN:].set(0)


def _bin_value(b: jax.Array) -> jax.Array:
    mid = (b.astype(jnp.uint32) << 16) | jnp.uint32(0x8000)
    return jnp.where(b == 0, 0.0, lax.bitcast_convert_type(mid, _F32)).astype(_F32)


def _linear_rule(n: jax.Array, q: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NumPy's linear rule over ``n`` values: the position ``q (n - 1)`` and its two ranks."""
    pos = q * jnp.maximum(n - 1.0, 0.0)
    return pos, jnp.floor(pos), jnp.ceil(pos)


def _read_bins(lo_bin: jax.Array, hi_bin: jax.Array, pos: jax.Array, n: jax.Array) -> jax.Array:
    """The two ranks' bin midpoints interpolated at ``pos``; NaN if there is no value."""
    frac = pos - jnp.floor(pos)
    v = _bin_value(lo_bin) * (1.0 - frac) + _bin_value(hi_bin) * frac
    return jnp.where(n > 0, v, jnp.nan).astype(_F32)


def histogram_quantile(hist: jax.Array, q: float = 0.5) -> jax.Array:
    """The ``q``-quantile of the values a :func:`log_histogram` counted (NumPy's
    linear rule at the two neighbouring ranks, each read as its bin's midpoint).

    The bin holding rank ``r`` is ``#{b : cum[b] <= r}`` (``cum``: the running
    count); it is found in two levels, rows of 128 bins then the bins of one
    row, so no running count over all 32768 bins is formed.
    """
    h = hist.astype(_F32)
    rows = h.reshape(-1, _ROW)
    row_cum = jnp.cumsum(jnp.sum(rows, axis=1))
    n = row_cum[-1]
    pos, lo_rank, hi_rank = _linear_rule(n, q)

    def bin_of(rank: jax.Array) -> jax.Array:
        k = jnp.minimum(jnp.sum(row_cum <= rank, dtype=jnp.int32), rows.shape[0] - 1)
        before = jnp.where(k > 0, row_cum[jnp.maximum(k - 1, 0)], 0.0)
        cum = before + jnp.cumsum(lax.dynamic_index_in_dim(rows, k, keepdims=False))
        return k * _ROW + jnp.sum(cum <= rank, dtype=jnp.int32)

    return _read_bins(bin_of(lo_rank), bin_of(hi_rank), pos, n)


# The search's passes: (bin width, edges). 4 + 4 + 4 + 3 bits cover the 2^15 bins
# of |x|; each pass narrows the range holding a rank's bin 16-fold (8-fold last).
_SEARCH_PASSES = ((2048, 15), (128, 15), (8, 15), (1, 7))


def search_quantile(groups: Mapping[tuple[str, ...], Sequence[jax.Array]], q: float = 0.5) -> jax.Array:
    """The value :func:`histogram_quantile` of :func:`log_histogram` gives, without a scatter.

    The bin holding rank ``r`` is ``B(r) = max{e : C(e) <= r}``, ``C(e) = #{x :
    bin(x) < e}``. Each of four passes counts ``C`` at 15 (last: 7) evenly spaced
    edges inside the range known to hold ``B`` -- a compare-and-sum fused into one
    read of each leaf, no index buffer, no atomics -- and keeps the sixteenth of
    the range below the first edge whose count exceeds ``r``. Both ranks of
    NumPy's linear rule are searched in the same passes. The element count ``n``
    is the leaves' sizes (a non-finite element is counted and lands above every
    finite bin: the caller reports NaN then, as :func:`optimizer_metrics` does).

    A scatter-add of many equal bin indices serialises on GPUs and TPUs; these passes
    are plain reductions there. XLA:CPU materialises the compares instead (far
    more time and memory than the histogram, docs/COST.md), so the CPU keeps the histogram.

    Args:
      groups: leaves by the mesh axes their counts are ``psum``-ed over (``()``:
        none), as :func:`jvitals.metrics.stats.reduction_axes` gives them.
      q: the quantile, in [0, 1].

    Returns:
      float32 scalar: the ``q``-quantile of ``|x|`` over every leaf, each rank
      read as its bin's midpoint (0 for bin 0); NaN if there is no element.
    """
    n = _total(groups, [jnp.asarray(sum(x.size for x in xs), _F32) for xs in groups.values()])
    pos, lo_rank, hi_rank = _linear_rule(n, q)
    ranks = jnp.stack([lo_rank, hi_rank])
    lo = jnp.zeros([2], jnp.int32)
    for width, k in _SEARCH_PASSES:
        edges = (lo[:, None] + width * jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]).reshape(-1)
        counts = _total(groups, [sum(jnp.sum(_bins(x)[..., None] < edges.reshape((1,) * x.ndim + (-1,)),
                                             axis=tuple(range(x.ndim)), dtype=jnp.int32)
                                     for x in xs) for xs in groups.values()]).reshape(2, k)
        lo = lo + width * jnp.sum(counts <= ranks[:, None], axis=1, dtype=jnp.int32)
    return _read_bins(lo[0], lo[1], pos, n)


def _total(groups: Mapping[tuple[str, ...], Sequence[jax.Array]], local: list[jax.Array]) -> jax.Array:
    """The per-group counts ``local`` summed, each ``psum``-ed over its group's axes (float32)."""
    out = jnp.zeros(local[0].shape, _F32)
    for red, c in zip(groups, local):
        c = c.astype(_F32)
        # lax.psum, not psum_over: n is a constant, invariant yet to be summed.
        out = out + (lax.psum(make_varying(c, red), red) if red else c)
    return out


# window_quantile's edges, as offsets from the sample's bin b: unit-wide bins from b - 4 to
# b + 4 (exact there), then 4-, 16- and 72-bin-wide ones out to b -+ 96 (about 0.33 decades).
_WINDOW = (-96, -24, -8, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 9, 25, 97)
WINDOW_SAMPLE = 32
"""About one ``nu`` value in how many :func:`window_quantile`'s sample reads (:func:`block_sample`)."""

WINDOW_BLOCKS = 32
"""The most blocks of 8 rows :func:`block_sample` takes of one leaf (256 rows, spread evenly):
on a large leaf the sample's cost, not its precision, is what grows with its size."""


def block_sample(x: jax.Array, every: int = WINDOW_SAMPLE, blocks: int = WINDOW_BLOCKS) -> jax.Array:
    """Every ``every``-th block of 8 rows of ``x`` viewed as a matrix ``[prod(shape[:-1]),
    shape[-1]]`` (its major dimension split only), about one element in ``every``, spread over
    its rows; at most ``blocks`` blocks (on a leaf of more than ``8 every blocks`` rows, every
    ``ceil(rows / (8 blocks))``-th block). A leaf of at least 16 rows but fewer than ``8 every``
    gives its first block, 8 rows with every column (as a ``[d, vocab]`` head of ``8 every``
    rows gives its one block: its rows are features, its columns tokens); one of one dimension
    or of fewer than 16 rows is taken whole.

    The blocks are taken along the dimension the TPU lays out major, so that they are
    slices of the leaf as it lies in memory, not a relaid-out copy of it: the last two
    dimensions swapped where the last is not a multiple of 128 and the one before is (the
    layout the compiler picks to spare the minor dimension its padding, as it does for an
    MLP kernel ``[d, 704]``). Where the rows are not a multiple of ``8 every``, the blocks are
    separate slices (a prefix sliced off first would be written out whole)."""
    x = jnp.asarray(x)
    if x.ndim < 2:
        return x
    if x.shape[-1] % 128 and x.shape[-2] % 128 == 0:
        x = jnp.swapaxes(x, -1, -2)
    r, c = int(np.prod(x.shape[:-1])), x.shape[-1]
    every = max(every, -(-r // (8 * blocks)))
    if r < 16:
        return x
    x = x.reshape(r, c)
    span = 8 * every
    nb = r // span
    if nb == 0:
        return x[None, :8]
    if r % span == 0:
        return x.reshape(nb, every, 8, c)[:, 0]
    return jnp.stack([x[i * span:i * span + 8] for i in range(nb)])


def _interval_bins(edges: jax.Array, counts: jax.Array, rank: jax.Array) -> jax.Array:
    """The continuous bin of ``rank`` from running counts at ``edges`` (ascending, ``counts[0]
    = 0``, ``counts[-1]`` above every rank): the bin's midpoint when the interval holding the
    rank is one bin wide, else interpolated by rank across the interval."""
    a = jnp.clip(jnp.sum(counts <= rank, dtype=jnp.int32), 1, edges.shape[0] - 1)
    e0, e1 = edges[a - 1].astype(_F32), edges[a].astype(_F32)
    c0, c1 = counts[a - 1], counts[a]
    t = (rank - c0 + 0.5) / jnp.maximum(c1 - c0, 1.0)
    return jnp.where(e1 - e0 <= 1.0, e0 + 0.5, e0 + jnp.clip(t, 0.0, 1.0) * (e1 - e0))


def _value_of(f: jax.Array) -> jax.Array:
    """The float32 whose top 16 bits are the continuous bin ``f`` (0 in bin 0, as :func:`_bin_value`)."""
    bits = jnp.clip(f * 65536.0, 0.0, float(_NONFINITE_BIN << 16)).astype(jnp.int32)
    return jnp.where(f < 1.0, 0.0, lax.bitcast_convert_type(bits, _F32)).astype(_F32)


def _sample_bin(sample: Mapping[tuple[str, ...], Sequence[jax.Array]],
                weights: Mapping[tuple[str, ...], Sequence[float]], q: float) -> jax.Array:
    """The bin, to 7, of the weighted sample's ``q``-quantile (its lower rank; each element of a
    sample leaf counts ``weights`` times, its leaf's size over the sample's, so every leaf
    weighs as much as it holds): three passes of 16 edges counted as sibling reductions
    (``((bin - e) >> 31) & 1``), each narrowing the range 17-fold (2^15, 1928, 114, 7 bins);
    the middle of the last range."""
    n = _total(sample, [jnp.asarray(sum(x.size * w for x, w in zip(xs, weights[red])), _F32)
                        for red, xs in sample.items()])
    rank = _linear_rule(n, q)[1]
    lo, width = jnp.int32(0), NU_BINS
    while width > 8:
        step = -(-width // 17)
        edges = lo + step * jnp.arange(1, 17, dtype=jnp.int32)
        local = []
        for red, xs in sample.items():
            c = jnp.zeros([16], _F32)
            for x, w in zip(xs, weights[red]):
                b = _bins(x)
                c = c + jnp.stack([jnp.sum(((b - edges[j]) >> 31) & 1) for j in range(16)]).astype(_F32) * w
            local.append(c)
        counts = _total(sample, local)
        lo = lo + step * jnp.sum(counts <= rank, dtype=jnp.int32)
        width = step
    return lo + width // 2


def window_quantile(groups: Mapping[tuple[str, ...], Sequence[jax.Array]], q: float = 0.5,
                    every: int = WINDOW_SAMPLE) -> tuple[jax.Array, jax.Array]:
    """``(max |x|, q-quantile of |x|)`` over every leaf, reading each leaf once (GPUs, TPUs).

    1. The bin ``b`` of the ``q``-quantile of a sample (:func:`block_sample`: every
       ``every``-th block of 8 rows of each leaf, at most ``WINDOW_BLOCKS`` of them, copied
       out behind a barrier), each leaf weighted by its size over its sample's, to 7 bins in
       three passes over the sample.
    2. One pass over every leaf, each behind its own ``optimization_barrier`` (read as the
       step writes it): ``max`` and ``min`` of ``bits(|x|)`` and the running counts
       ``C(e) = #{x : bin(x) < e}`` at the 16 edges ``e = b + o``, ``o`` in ``_WINDOW``, as
       sibling reductions (``((bin - e) >> 31) & 1``: no comparison, no boolean) that the
       compiler fuses into one kernel reading the leaf once.
    3. Each rank of NumPy's linear rule is placed between the two edges (or the data's
       lowest bin and its highest bin + 1) whose counts bracket it.

    **Precision**: within ``b - 4 <= B <= b + 4`` (``B`` the quantile's bin over every
    value) the bins are one wide and the value is :func:`search_quantile`'s: its bin's
    midpoint, within ``log10(1 + 2^-7) < 0.0034`` decades. Further out the value is
    interpolated by rank across an interval 4, 16 or 72 bins wide (an error below 0.014,
    0.054, 0.24 decades), or between ``b -+ 96`` and the data's extreme bin. The sample is
    spread over every leaf's rows (an embedding's tokens, from the first to the last), not
    random: on rows whose scale varies (rare tokens) its bin may stand some bins off ``B``.

    Returns:
      float32 scalars ``(max |x|, quantile)``, both NaN if any element is not finite
      (Inf or NaN) or there is none.
    """
    groups = {red: [jnp.asarray(x) for x in xs if x.size] for red, xs in groups.items()}
    sample = {red: [lax.optimization_barrier(block_sample(x, every)) for x in xs] for red, xs in groups.items()}
    weights = {red: [x.size / max(v.size, 1) for x, v in zip(groups[red], vs)] for red, vs in sample.items()}
    centre = _sample_bin(sample, weights, q)
    edges = jnp.clip(centre + jnp.asarray(_WINDOW, jnp.int32), 0, _NONFINITE_BIN)
    hi_bits, lo_bits, local = [], [], []
    for red, xs in groups.items():
        his, los, cs = [], [], []
        for x in xs:
            x = lax.optimization_barrier(x)
            bits = lax.bitcast_convert_type(x.astype(_F32), jnp.int32) & 0x7FFFFFFF
            b = bits >> 16
            his.append(jnp.max(bits))
            los.append(jnp.min(bits))
            cs.append(jnp.stack([jnp.sum(((b - edges[j]) >> 31) & 1) for j in range(len(_WINDOW))]))
        if not his:  # only empty leaves: nothing to count
            his, los, cs = [jnp.int32(0)], [jnp.int32(0x7F800000)], [jnp.zeros([len(_WINDOW)], jnp.int32)]
        hi, lo = functools.reduce(jnp.maximum, his), functools.reduce(jnp.minimum, los)
        if red:
            hi, lo = lax.pmax(make_varying(hi, red), red), lax.pmin(make_varying(lo, red), red)
        hi_bits.append(hi)
        lo_bits.append(lo)
        local.append(sum(cs))
    hi, lo = functools.reduce(jnp.maximum, hi_bits), functools.reduce(jnp.minimum, lo_bits)
    counts = _total(groups, local)
    n = _total(groups, [jnp.asarray(sum(x.size for x in xs), _F32) for xs in groups.values()])
    pos, lo_rank, hi_rank = _linear_rule(n, q)
    all_edges = jnp.concatenate([(lo >> 16)[None], jnp.clip(edges, lo >> 16, (hi >> 16) + 1),
                                 ((hi >> 16) + 1)[None]])
    all_counts = jnp.concatenate([jnp.zeros([1], _F32), counts, n[None]])
    frac = pos - jnp.floor(pos)
    v = (_value_of(_interval_bins(all_edges, all_counts, lo_rank)) * (1.0 - frac)
         + _value_of(_interval_bins(all_edges, all_counts, hi_rank)) * frac)
    bad = (hi >= 0x7F800000) | (n <= 0)
    amax = lax.bitcast_convert_type(hi, _F32)
    return (jnp.where(bad, jnp.nan, amax).astype(_F32), jnp.where(bad, jnp.nan, v).astype(_F32))


def _histogram_median(groups: Mapping[tuple[str, ...], Sequence[jax.Array]]) -> jax.Array:
    """:func:`histogram_quantile` (0.5) of the leaves' summed, ``psum``-ed :func:`log_histogram`."""
    hist = jnp.zeros([NU_BINS], _F32)
    for red, xs in groups.items():
        h = _log_histogram_many(xs).astype(_F32)
        hist = hist + (psum_over(h, red, PartitionSpec(red)) if red else h)
    return histogram_quantile(hist, 0.5)


_MEDIAN_METHODS = ("auto", "histogram", "search", "sample", "window")


def optimizer_metrics(opt_state: Any, *, specs: Any = None, axes: Sequence[str] | str = (),
                      loss_scale: Any = None, prefix: str = "opt",
                      median: str = "auto") -> dict[str, jax.Array]:
    """Adam second-moment statistics, loss scale and skipped steps of an optax state.

    See the module docstring for the formulas and the median's precision.

    Args:
      opt_state: any optax state (nested as deep as wanted; a Flax NNX
        ``nnx.Optimizer``'s ``opt_state`` as it is).
      specs: optional ``PartitionSpec`` pytree (prefix) with the *params*'
        structure; applied to each ``nu`` tree.
      axes: mesh axes bound by the enclosing ``shard_map`` (``()`` under ``jit``).
        Each ``nu`` leaf is reduced over the axes it is sharded (``specs``) or
        varies along.
      loss_scale: optional dynamic loss scale (an array, or an object with
        ``.loss_scale`` / ``.scale``) when the state does not carry one.
      prefix: name prefix.
      median: how ``opt/adam_nu_median`` is found: ``'histogram'``
        (:func:`log_histogram`, one read and a scatter-add per leaf) or ``'search'``
        (:func:`search_quantile`, four reads, no scatter), the same value either way;
        ``'sample'``: the histogram of :func:`systematic_sample` (every value below
        ``2 NU_SAMPLE``); ``'window'``: :func:`window_quantile` (a sample's bin, then one
        read of every value for the maximum and 16 counts around it); ``'auto'``: the
        sample's histogram on the CPU, the window on other backends
        (``lax.platform_dependent``: the backend compiling the step decides).

    Returns:
      ``{name: scalar}``: ``opt/adam_nu_abs.max``, ``opt/adam_nu_median``,
      ``opt/adam_nu_log10_spread`` (if an Adam state is found), ``opt/loss_scale``
      (if found), ``opt/skipped_steps`` and ``opt/consecutive_nonfinite`` (if an
      ``apply_if_finite`` state is found), ``opt/learning_rate`` (if injected); empty for a
      state holding none of these (plain SGD).

    Raises:
      TypeError: ``opt_state`` is None or the transform itself (pass ``tx.init(params)``).
      ValueError: an unknown ``median`` method.

    Example:
      >>> tx = optax.apply_if_finite(optax.adam(1e-3), 3)   # doctest: +SKIP
      >>> optimizer_metrics(tx.init(params))["opt/skipped_steps"]  # doctest: +SKIP
    """
    check_opt_state(opt_state, "optimizer_metrics")
    if median not in _MEDIAN_METHODS:
        raise ValueError(f"optimizer_metrics(median={median!r}): choose one of {list(_MEDIAN_METHODS)}")
    axes = check_axes(axes)
    opt_state = unwrap(opt_state)  # a Flax NNX nnx.Optimizer's opt_state: OptState Variables
    p = prefix
    out: dict[str, jax.Array] = {}
    adam = _find(opt_state, _is_adam)
    if adam:
        out.update(_nu_figures(adam, specs=specs, axes=axes, median=median, prefix=p))
    ls = _find_loss_scale(opt_state, loss_scale)
    if ls is not None:
        out[f"{p}/loss_scale"] = ls
    aif = _find(opt_state, _is_apply_if_finite)
    if aif:
        out[f"{p}/skipped_steps"] = sum(jnp.asarray(n.total_notfinite).astype(jnp.int32) for n in aif)
        out[f"{p}/consecutive_nonfinite"] = sum(jnp.asarray(n.notfinite_count).astype(jnp.int32) for n in aif)
    lrs = injected_hyperparams(opt_state, "learning_rate")
    if lrs:  # times every LR scale injected (jvitals.with_lr_scale)
        lr = jnp.asarray(lrs[0], _F32).reshape(())
        for s in injected_hyperparams(opt_state, LR_SCALE):
            lr = lr * jnp.asarray(s, _F32).reshape(())
        out[f"{p}/learning_rate"] = lr
    if not out and jax.tree.leaves(opt_state) and not _find(opt_state, _is_state_node):
        raise TypeError("optimizer_metrics: opt_state holds arrays but no optax state (no NamedTuple such as "
                        "ScaleByAdamState in it): were the params passed? pass opt_state = tx.init(params)")
    return out


def _find(tree: Any, pred: Any) -> list[Any]:
    """The nodes of ``tree`` (outermost first) for which ``pred`` holds."""
    return [n for n in jax.tree.leaves(tree, is_leaf=pred) if pred(n)]


def _nu_groups(adam: Sequence[Any], specs: Any, axes: tuple[str, ...]) -> dict[tuple[str, ...], list[jax.Array]]:
    """Every ``nu`` leaf of the Adam states, grouped by the mesh axes it is reduced over."""
    groups: dict[tuple[str, ...], list[jax.Array]] = {}
    for st in adam:
        leaves = jax.tree.leaves(st.nu)
        sp = flat_specs(st.nu, specs, "Adam nu (the params' structure)")
        for i, x in enumerate(leaves):
            red = reduction_axes(x, axes, sp[i] if sp is not None else None, sp is not None)
            groups.setdefault(red, []).append(x)
    return groups


def systematic_sample(groups: Mapping[tuple[str, ...], Sequence[jax.Array]],
                      size: int = NU_SAMPLE) -> dict[tuple[str, ...], list[jax.Array]]:
    """Every ``k``-th element of each leaf (flattened, from its first), ``k`` the odd number
    at or above ``n // size`` (``n``: the elements of all leaves), so about ``size`` to
    ``2 size`` elements, every leaf in proportion; the leaves as they are when ``k < 2``.
    An odd ``k`` walks every column of a power-of-two wide matrix across its rows."""
    n = sum(int(np.prod(jnp.shape(x))) for xs in groups.values() for x in xs)
    k = n // size
    if k < 2:
        return {red: list(xs) for red, xs in groups.items()}
    k |= 1
    return {red: [jnp.ravel(x)[::k] for x in xs] for red, xs in groups.items()}


def _median(groups: Mapping[tuple[str, ...], Sequence[jax.Array]], median: str) -> jax.Array:
    """The ``nu`` median by the method asked for (``'auto'``: on the CPU the histogram of
    a systematic sample of about ``NU_SAMPLE`` elements, :func:`window_quantile` elsewhere;
    the backend compiling the step decides)."""
    if median == "histogram":
        return _histogram_median(groups)
    if median == "search":
        return search_quantile(groups, 0.5)
    if median == "sample":
        return _histogram_median(systematic_sample(groups))
    if median == "window":
        return window_quantile(groups, 0.5)[1]
    # Inside fold.one_read() on the CPU: the histogram of every value (XLA:CPU materialises
    # the window's compares: its bytes say nothing of a GPU's).
    return fold.on_cpu(lambda: _histogram_median(systematic_sample(groups)),
                       lambda: lax.platform_dependent(cpu=lambda: _histogram_median(groups),
                                                      default=lambda: window_quantile(groups, 0.5)[1]))


def _max_and_median(groups: Mapping[tuple[str, ...], Sequence[jax.Array]], median: str,
                    ) -> tuple[jax.Array, jax.Array]:
    """``(max |nu|, median)`` over every leaf: the maximum and non-finite count by
    :func:`~jvitals.metrics.stats.summarize_max` (one read), the median by ``median``'s
    method (NaN with a non-finite ``nu``)."""
    acc = Accumulator()
    for red, xs in groups.items():  # nu >= 0: only its max and non-finite count
        acc.add(red, "nu", summarize_max(xs))
    s = acc.result().get("nu", Summary.empty())
    return s.abs_max, jnp.where(s.nonfinite > 0, jnp.nan, _median(groups, median)).astype(_F32)


def _nu_figures(adam: Sequence[Any], *, specs: Any, axes: tuple[str, ...], median: str,
                prefix: str) -> dict[str, jax.Array]:
    """``{p}/adam_nu_abs.max``, ``_median`` (NaN with a non-finite ``nu``) and
    ``_log10_spread`` over every ``nu`` leaf. ``'auto'`` on GPUs and TPUs (and ``'window'``):
    :func:`window_quantile`, the maximum and the median's counts in one read of each leaf;
    on the CPU the maximum and the median (a sample's histogram) apart."""
    groups = _nu_groups(adam, specs, axes)
    if median == "window":
        amax, med = window_quantile(groups, 0.5)
    elif median == "auto":
        amax, med = fold.on_cpu(lambda: _max_and_median(groups, "auto"),
                                lambda: lax.platform_dependent(cpu=lambda: _max_and_median(groups, "histogram"),
                                                               default=lambda: window_quantile(groups, 0.5)))
    else:
        amax, med = _max_and_median(groups, median)
    return {f"{prefix}/adam_nu_abs.max": amax, f"{prefix}/adam_nu_median": med,
            f"{prefix}/adam_nu_log10_spread": (jnp.log10(amax) - jnp.log10(med)).astype(_F32)}


def _find_loss_scale(opt_state: Any, loss_scale: Any) -> jax.Array | None:
    """The dynamic loss scale (float32): ``loss_scale`` if given, else the first
    loss-scale object in the state (flax ``DynamicScale``, jmp's), else the first
    leaf named ``loss_scale``; an object is read through ``.loss_scale`` or ``.scale``.

    Raises:
      ValueError: an object with neither attribute.
    """
    ls = loss_scale
    if ls is None:
        objs = _find(opt_state, _is_loss_scale_obj)
        if objs:
            ls = objs[0]
        else:
            ls = next((leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
                       if path_str(path).split("/")[-1] == "loss_scale"), None)
    if ls is None:
        return None
    if not hasattr(ls, "shape"):
        ls = getattr(ls, "loss_scale", None) if hasattr(ls, "loss_scale") else getattr(ls, "scale", None)
        if ls is None:
            raise ValueError(f"loss_scale: expected an array or an object with .loss_scale or .scale, "
                             f"got {type(loss_scale).__name__}")
    return jnp.asarray(ls).astype(_F32)


def injected_hyperparams(tree: Any, key: str) -> list[jax.Array]:
    """Every ``hyperparams[key]`` of an ``optax.inject_hyperparams`` state in ``tree``.

    Outer states first (an inject state nested in another's ``inner_state`` comes
    after it).

    Args:
      tree: an optimizer state (or any pytree holding one).
      key: the hyperparameter, e.g. ``"learning_rate"`` or ``"lr_scale"``.

    Returns:
      The values found (arrays or tracers), possibly empty.
    """
    found = []
    for n in jax.tree.leaves(tree, is_leaf=_is_inject):
        if _is_inject(n) and isinstance(n.hyperparams, Mapping):
            if key in n.hyperparams:
                found.append(n.hyperparams[key])
            found.extend(injected_hyperparams(n.inner_state, key))
    return found
