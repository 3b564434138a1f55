"""One read per tensor: every statistic of an array from a single variadic reduction.

On an accelerator the statistics jvitals takes are bandwidth-bound: what they cost is
the bytes they read. ``jnp.sum(x)``, ``jnp.sum(x * x)`` and ``jnp.max(jnp.abs(x))``
are three reductions, and XLA:CPU (which has no multi-output fusion) reads ``x``
three times for them. :func:`fold` takes the statistics as the operands of **one**
``lax.reduce``::

    fold((x, x * x, |x|, bad), (0, 0, 0, 0), combine, axes)
      = (sum x, sum x^2, max |x|, sum bad)              # x read once

XLA fuses the elementwise producers of the operands into the reduction, so the
fusion's only parameter is ``x``: its bytes are read once, on every backend, and
XLA's cost analysis counts them once. The same holds for several arrays of one
shape (a gradient, its parameter and its update: one kernel, each read once).

Accuracy: a reduction accumulates serially on the CPU, which loses float32 precision
over long inputs (4e-4 relative on 2^20 squares). So a long trailing block of
reduced axes is reduced in two levels, rows of at most :data:`ROW` elements and then
the rows' partials (``N / ROW`` values per output, written once and read once: a
fraction ``2 / ROW`` of the input's bytes per statistic).

Combiners are associative and commutative (XLA may reorder partials; GPUs and TPUs
combine them as a tree). :func:`kinds` builds one from ``"sum"``/``"max"``/``"min"``
names; the logits probe passes its own (top-2, first argmax, online log-sum-exp).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["ROW", "fold", "kinds", "finite_parts", "FULL", "SUMSQ", "MAX"]

ROW = 1024
"""Elements a first-level partial covers when a long reduction is split in two."""

_F32 = jnp.float32

Combine = Callable[[tuple, tuple], tuple]

_OPS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "sum": lax.add, "max": lax.max, "min": lax.min}
_INITS = {"sum": 0.0, "max": -math.inf, "min": math.inf}


def kinds(names: Sequence[str]) -> tuple[tuple[float, ...], Combine]:
    """``(inits, combine)`` for operands combined by ``names`` (``"sum"``, ``"max"``, ``"min"``).

    ``max``/``min`` start at ``-inf``/``+inf``; a ``max`` of absolute values may
    pass ``0.0`` as its own init instead. One function per ``names`` (cached): an
    eager call reuses the reduction it compiled.
    """
    return _kinds(tuple(names))


@functools.lru_cache(maxsize=None)
def _kinds(names: tuple[str, ...]) -> tuple[tuple[float, ...], Combine]:
    fns = tuple(_OPS[n] for n in names)

    def combine(a: tuple, b: tuple) -> tuple:
        return tuple(f(u, v) for f, u, v in zip(fns, a, b))

    return tuple(_INITS[n] for n in names), combine


def _levels(shape: tuple[int, ...], red: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
    """``(kept shape, reduced size M, row k)`` when ``red`` is a trailing block of more
    than ``2 * ROW`` elements that splits into rows of ``k`` (``ROW / 8 <= k <= ROW``,
    ``k`` divides ``M``); None: one level."""
    n = len(shape)
    if not red or red != tuple(range(n - len(red), n)):
        return None
    m = math.prod(shape[n - len(red):])
    if m <= 2 * ROW:
        return None
    k = next((d for d in range(ROW, ROW // 8 - 1, -1) if m % d == 0), None)
    if k is None:
        return None
    return tuple(shape[:n - len(red)]), m, k


def fold(ops: Sequence[jax.Array], inits: Sequence[float | int], combine: Combine,
         axes: Sequence[int] | None = None) -> tuple[jax.Array, ...]:
    """Reduce same-shape ``ops`` over ``axes`` (None: all) in one variadic ``lax.reduce``.

    ``out[i] = combine``-reduction of ``ops[i]`` with ``inits[i]`` (its identity), the
    combiner seeing every operand of one position together. Long trailing
    reductions run in two levels (see the module docstring); the inputs are
    ``stop_gradient``-ed (statistics are never differentiated).

    Args:
      ops: arrays of one shape (any dtypes: each output has its operand's dtype).
      inits: one identity per operand (Python scalars).
      combine: ``(tuple, tuple) -> tuple``, associative and commutative.
      axes: the axes to reduce.

    Returns:
      One array per operand, of the shape without ``axes``.
    """
    ops = tuple(lax.stop_gradient(jnp.asarray(o)) for o in ops)
    shape = tuple(ops[0].shape)
    red = tuple(range(len(shape))) if axes is None else tuple(sorted(a % max(len(shape), 1) for a in axes))
    init = tuple(jnp.asarray(v, o.dtype) for v, o in zip(inits, ops))
    if not red:
        return ops
    split = _levels(shape, red)
    if split is None:
        return tuple(lax.reduce(ops, init, combine, red))
    kept, m, k = split
    rows = tuple(o.reshape(kept + (m // k, k)) for o in ops)
    part = lax.reduce(rows, init, combine, (len(kept) + 1,))
    return tuple(lax.reduce(tuple(part), init, combine, (len(kept),)))


# Which Summary fields a fold measures.
FULL = ("sum", "sumsq", "abs_max", "nonfinite")
SUMSQ = ("sumsq", "nonfinite")
MAX = ("abs_max", "nonfinite")
_KIND = {"sum": "sum", "sumsq": "sum", "abs_max": "max", "nonfinite": "sum"}


def finite_parts(x: jax.Array, valid: jax.Array | None, fields: Sequence[str]) -> tuple[
        tuple[jax.Array, ...], tuple[float, ...], tuple[str, ...]]:
    """The fold operands of :class:`~jvitals.metrics.stats.Summary` ``fields`` of ``x``.

    ``x`` is cast to float32 first (bf16/fp16 give their upcast's figures). With
    ``good = valid & isfinite(x)`` and ``xg = where(good, x, 0)``: ``sum = xg``,
    ``sumsq = xg^2``, ``abs_max = |xg|`` (init 0: the maximum of the valid finite
    values; the caller makes it NaN where any is non-finite),
    ``nonfinite = valid & ~isfinite(x)``.

    Returns:
      ``(operands, inits, kind names)`` for :func:`fold` (via :func:`kinds`).
    """
    xf = jnp.asarray(x).astype(_F32)
    fin = jnp.isfinite(xf)
    good = fin if valid is None else valid & fin
    xg = jnp.where(good, xf, 0.0)
    make = {
        "sum": lambda: xg,
        "sumsq": lambda: xg * xg,
        "abs_max": lambda: jnp.abs(xg),
        "nonfinite": lambda: jnp.where(fin if valid is None else ~valid | fin, 0.0, 1.0).astype(_F32),
    }
    ops = tuple(make[f]() for f in fields)
    inits = tuple(0.0 for _ in fields)
    return ops, inits, tuple(_KIND[f] for f in fields)
