"""The CPU's forms of the statistics: plain reductions, which XLA:CPU vectorises.

XLA:CPU runs a variadic reduction (the one-read form every statistic takes on GPUs and TPUs,
:mod:`jvitals.metrics.fold`), and any reduction fed by a comparison or a select, as a serial
loop. So the forms here take the healthy case in arithmetic only and leave non-finite values
to a ``lax.cond`` that a healthy step does not run: :func:`plain_summaries` (the heavy
step's per-piece gradient summaries) and :func:`row_stats` / :func:`argmax` (the logits'
row statistics). Each is chosen by :func:`~jvitals.metrics.fold.on_cpu` beside a one-read
form of the same figures, and tested against it and NumPy (tests/test_cpu_forms.py).
Timings: docs/COST.md, "The CPU's forms: plain reductions".
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jvitals.metrics import fold
from jvitals.metrics.stats import Summary, nan_rule

__all__ = ["EXACT_IOTA", "PlainKeys", "argmax", "plain_keys", "plain_summaries", "row_stats"]

_F32 = jnp.float32

EXACT_IOTA = 1 << 24
"""Below this many columns a float32 holds every column index exactly (the plain forms)."""


def plain_summaries(items: Sequence[tuple]) -> list[Summary]:
    """:func:`~jvitals.metrics.stats.summarize_fields` of unmasked items under ``jit``, in
    XLA:CPU's fastest form: plain reductions, which it vectorises (a variadic one runs as
    a serial loop).

    Per item ``(x, None, axis, fields, tag)``: ``sumsq = sum x^2`` written as optax writes a
    leaf's (``optax.tree.norm``: XLA computes a whole gradient leaf's once for this and the
    clip), ``abs_max = max |x|``; the non-finite counts only where the items' sums of squares
    are not all finite, under one ``lax.cond`` (a healthy step reads nothing for them). A
    non-finite element makes ``sumsq`` NaN or Inf here where the fold leaves it out; every
    figure read from a summary with ``nonfinite > 0`` is NaN either way (``Summary.norm``,
    ``rms``, ``_share``), so the figures are the fold's.

    Returns:
      One :class:`~jvitals.metrics.stats.Summary` per item (``sum`` NaN: not measured).
    """
    def dims(x: jax.Array, axis: int | None) -> tuple[int, ...]:
        return tuple(d for d in range(x.ndim) if d != axis)

    def square(x: jax.Array) -> jax.Array:
        return jnp.square(x.real) + jnp.square(x.imag)

    xs = [jnp.asarray(it[0]).astype(_F32) for it in items]
    sumsq = [jnp.sum(square(x), axis=dims(x, it[2])) for x, it in zip(xs, items)]
    amax = [jnp.max(jnp.abs(x), axis=dims(x, it[2])) if "abs_max" in it[3] else None for x, it in zip(xs, items)]
    bad = ~jnp.isfinite(sum((jnp.sum(s) for s in sumsq), jnp.zeros((), _F32)))

    def count() -> list[jax.Array]:
        return [jnp.sum(fold.finite_parts(x)[1], axis=dims(x, it[2])) for x, it in zip(xs, items)]

    def zero() -> list[jax.Array]:
        return [jnp.zeros(s.shape, _F32) for s in sumsq]

    # The CPU counts under a cond a healthy step skips; GPUs and TPUs beside the sums (a
    # sibling reduction they fuse with them; a GPU conditional waits on the host).
    nonfinite = fold.on_cpu(lambda: lax.cond(bad, count, zero), count) if items else []
    out = []
    for x, it, sq, am, nf in zip(xs, items, sumsq, amax, nonfinite):
        n = jnp.full(sq.shape, float(x.size // max(int(np.prod(sq.shape)), 1)), _F32)
        nan = jnp.full(sq.shape, jnp.nan, _F32)
        out.append(Summary(count=n, sum=nan, sumsq=sq, abs_max=nan if am is None else nan_rule(am, n, nf),
                           nonfinite=nf))
    return out


class PlainKeys(NamedTuple):
    """The plain forms' shared pieces of ``[..., V]`` rows (see :func:`plain_keys`)."""

    xf: jax.Array        # the rows in float32
    key: jax.Array       # xf with NaN read as -inf
    top1: jax.Array      # max key per row
    eq: jax.Array        # key == top1
    argmax: jax.Array    # jnp.argmax's index, int32
    has_nan: jax.Array   # the row holds a NaN


def plain_keys(x: jax.Array) -> PlainKeys:
    """The pieces both plain forms use, each a plain reduction XLA:CPU vectorises (the
    column index as float32: its integer reductions it does not). ``argmax`` is
    ``jnp.argmax``'s: the first NaN of a row holding one (found below ``-V``), else the
    first maximum. Any rows, NaN and Inf included (the masked branch of :func:`row_stats`
    and :func:`argmax`)."""
    xf = x.astype(_F32)
    v = x.shape[-1]
    nan = jnp.isnan(xf)
    key = jnp.where(nan, -jnp.inf, xf)
    top1 = jnp.max(key, axis=-1)
    eq = key == top1[..., None]
    col = lax.broadcasted_iota(_F32, x.shape, x.ndim - 1)
    idx = jnp.min(jnp.where(nan, col - v, jnp.where(eq, col, jnp.inf)), axis=-1)
    return PlainKeys(xf, key, top1, eq, jnp.where(idx < 0, idx + v, idx).astype(jnp.int32), idx < 0)


def row_stats(x: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`~jvitals.metrics.probes._row_stats_one_read`'s figures by plain reductions, XLA:CPU's fastest form (it
    vectorises a plain reduction of arithmetic; its one-read form's custom reduction runs as
    a serial loop, and so does any reduction fed by a comparison or a select).

    Logits with no NaN or Inf (``sum(x * 0) == 0`` in every row: arithmetic only) take
    :func:`_finite_rows`; otherwise every row takes :func:`_masked_rows` (a ``lax.cond``:
    the healthy step runs one branch; timings in docs/COST.md)."""
    xf = x.astype(_F32)
    bad = jnp.isnan(jnp.sum(xf * 0.0))
    return lax.cond(bad, _masked_rows, _finite_rows, xf)


def _finite_rows(xf: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`row_stats` of rows free of NaN and Inf: ``top1 = max x``; ``argmax``,
    the first column holding it; ``top2``, the largest entry of the other columns (a tie
    gives ``top2 == top1``, as ``lax.top_k``; a select, not a copy of the logits with that
    column set: no logits-sized temporary); ``lse`` as
    ``jax.nn.logsumexp`` writes it (a loss taking ``jax.nn.logsumexp`` of the same float32
    logits shares it: XLA computes it once); plain sums, max ``|x|``, no non-finite entry."""
    shape, v = xf.shape, xf.shape[-1]
    x2 = xf.reshape(-1, v)
    top1, argmax, col = _finite_argmax(x2)
    top2 = jnp.max(jnp.where(col == argmax[:, None].astype(_F32), -jnp.inf, x2), axis=-1)   # no copy of x
    rows = shape[:-1]
    out = (top1, top2, jax.nn.logsumexp(x2, axis=-1), jnp.sum(x2, axis=-1), jnp.sum(x2 * x2, axis=-1),
           jnp.max(jnp.abs(x2), axis=-1), jnp.zeros_like(top1))
    return tuple(o.reshape(rows) for o in out) + (argmax.reshape(rows),)


def _finite_argmax(x2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(max, first column holding it, the column index as float32)`` of finite ``[R, V]`` rows."""
    top1 = jnp.max(x2, axis=-1)
    col = lax.broadcasted_iota(_F32, x2.shape, 1)
    return top1, jnp.min(jnp.where(x2 == top1[:, None], col, jnp.inf), axis=-1).astype(jnp.int32), col


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` as int32 by plain reductions: finite logits (``sum(x * 0) == 0``)
    take the maximum and its first column, others :func:`plain_keys` (a ``lax.cond``, as
    :func:`row_stats`)."""
    xf = x.astype(_F32)
    v = xf.shape[-1]

    def finite(xf: jax.Array) -> jax.Array:
        return _finite_argmax(xf.reshape(-1, v))[1].reshape(xf.shape[:-1])

    return lax.cond(jnp.isnan(jnp.sum(xf * 0.0)), lambda xf: plain_keys(xf).argmax, finite, xf)


def _masked_rows(xf: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`row_stats` of any rows (NaN and Inf too): the NaN-free keys' ``top1``
    and ``argmax`` (:func:`plain_keys`), ``top2 = top1`` where ``top1`` occurs twice, else
    the largest key below it; ``lse`` as ``jax.nn.logsumexp``; the finite entries' sums and
    max ``|x|``; the non-finite count."""
    k = plain_keys(xf)
    ties = jnp.sum(jnp.where(k.eq, 1.0, 0.0), axis=-1)
    top2 = jnp.where(ties > 1, k.top1, jnp.max(jnp.where(k.eq, -jnp.inf, k.key), axis=-1))
    fin = jnp.isfinite(xf)
    xg = jnp.where(fin, xf, 0.0)
    return (jnp.where(k.has_nan, jnp.nan, k.top1), top2, jax.nn.logsumexp(xf, axis=-1), jnp.sum(xg, axis=-1),
            jnp.sum(xg * xg, axis=-1), jnp.max(jnp.abs(xg), axis=-1), jnp.sum(jnp.where(fin, 0.0, 1.0), axis=-1),
            k.argmax)
