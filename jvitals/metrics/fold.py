"""One read per tensor: every statistic of an array from reductions the compiler fuses.

On an accelerator the statistics are bandwidth-bound: what they cost is the bytes they
read. The sum, sum of squares, ``max |x|`` and non-finite count of a tensor are written as
plain sibling reductions, ``(sum x, sum x^2, max |x|, sum bad)``, which XLA:GPU and TPU fuse
into one kernel reading ``x`` once. Finiteness comes by arithmetic on the exponent bits
(:func:`finite_parts`: ``bad = (((bits >> 23) & 255) + 1) >> 8``), never by a comparison
the TPU compiler would materialise. XLA:CPU has no multi-output fusion: there the
statistics are the operands of one variadic ``lax.reduce`` (with lanes and two levels),
:func:`on_cpu` and :func:`cpu_plain` choose the form per backend.

Why each rule, the CPU's variadic form and which form runs where: docs/DEVICE.md, "fold:
one read per tensor".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Iterator, Sequence, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["FULL", "LANES", "MAX", "ROW", "SUMSQ", "cpu_plain", "finite_parts", "fold", "fold_map",
           "fold_summaries", "kinds", "on_cpu", "one_read", "summary_ops"]

_T = TypeVar("_T")

ROW = 1024
"""Elements a first-level partial covers at most when one long axis is split in rows."""

PARTIALS = 0.05
"""The most a two-level reduction's partials (written once, read once) may add to the
bytes of its input."""

_F32 = jnp.float32

Combine = Callable[[tuple, tuple], tuple]
Make = Callable[..., tuple]

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

    combine.kinds = names  # type: ignore[attr-defined]  (a plain form exists: see fold_map)
    return tuple(_INITS[n] for n in names), combine


_CPU_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("jvitals_fold_cpu_plain", default=False)
_ONE_READ: contextvars.ContextVar[bool] = contextvars.ContextVar("jvitals_fold_one_read", default=False)


@contextlib.contextmanager
def cpu_plain(on: bool = True) -> Iterator[None]:
    """Folds traced inside take the plain form on every backend, the CPU included.

    XLA:CPU runs a variadic reduction as a serial loop and vectorises a plain one, so
    where the inputs are materialised anyway (the activation summaries) each operand of a
    ``sum``/``max``/``min`` fold is its own plain reduction there as on GPUs and TPUs (one
    form). ``on=False``: the form outside.
    """
    token = _CPU_PLAIN.set(on)
    try:
        yield
    finally:
        _CPU_PLAIN.reset(token)


def on_cpu(plain: Callable[[], _T], one: Callable[[], _T]) -> _T:
    """``plain()`` (the CPU's form) where the step compiles for the CPU, ``one()`` (what GPUs
    and TPUs read once) elsewhere (``lax.platform_dependent``: the backend compiling the
    step decides), and ``one()`` everywhere inside :func:`one_read`. The caller writes both
    forms, with one output type (a pytree of the same structure, shapes and dtypes)."""
    if _ONE_READ.get():
        return one()
    return lax.platform_dependent(cpu=plain, default=one)


@contextlib.contextmanager
def one_read() -> Iterator[None]:
    """What GPUs and TPUs compile (the ``one()`` form of every :func:`on_cpu` choice), on
    every backend inside, the CPU included: to test those forms' figures here. Their bytes
    on the TPU are read off its compiler (``benchmarks/tpu_cost.py``); XLA:CPU, without
    multi-output fusion, reads a tensor once per plain reduction of it."""
    token = _ONE_READ.set(True)
    try:
        yield
    finally:
        _ONE_READ.reset(token)


LANES = 4
"""Positions combined elementwise before the reduction proper (see :func:`fold`)."""


def _trailing(shape: tuple[int, ...], red: tuple[int, ...]) -> bool:
    """Whether ``red`` is a trailing block of axes."""
    n = len(shape)
    return bool(red) and red == tuple(range(n - len(red), n))


def _lanes(arrays: tuple[jax.Array, ...], make: Make, combine: Combine) -> tuple[jax.Array, ...]:
    """The operands of groups of :data:`LANES` neighbours along the last axis, combined
    elementwise: ``[..., d] -> [..., d / LANES]``. ``make`` is applied to each lane's
    strided slice of the inputs (the inputs are sliced, not the operands: XLA then
    fuses every lane into the reduction's loop; only the last axis is split, so a
    broadcast mask stays a broadcast), and the lanes are merged by a tree of
    ``combine``: the same read, a quarter of the reduction's serial steps."""
    parts = [tuple(make(*(a.reshape(a.shape[:-1] + (-1, LANES))[..., j] for a in arrays)))
             for j in range(LANES)]
    while len(parts) > 1:
        parts = [tuple(combine(parts[i], parts[i + 1])) for i in range(0, len(parts), 2)]
    return parts[0]


def _reduce_trailing(ops: tuple[jax.Array, ...], init: tuple[jax.Array, ...], combine: Combine,
                     red: tuple[int, ...], itemsize: int) -> tuple[jax.Array, ...]:
    """Reduce a trailing block of axes, in two levels when it is long (see the module
    docstring): first a trailing run of ``run`` elements, then the partials. The run
    is the shortest trailing run of the axes whose partials cost at most
    :data:`PARTIALS` of the input's bytes (``2 x 4 x len(ops) / run <= PARTIALS x
    itemsize``), or the last axis split in rows; a short block is one level."""
    shape = tuple(ops[0].shape)
    total = math.prod(shape[i] for i in red)
    least = math.ceil(8 * len(ops) / (PARTIALS * itemsize))
    if total <= max(2 * ROW, 2 * least):
        return tuple(lax.reduce(ops, init, combine, red))
    for j in range(1, len(red)):
        inner = red[len(red) - j:]
        if math.prod(shape[i] for i in inner) >= least:
            part = lax.reduce(ops, init, combine, inner)
            return tuple(lax.reduce(tuple(part), init, combine, red[:len(red) - j]))
    d = shape[-1]
    k = next((c for c in range(min(ROW, d // 2), least - 1, -1) if d % c == 0), None)
    if k is None:
        return tuple(lax.reduce(ops, init, combine, red))
    rows = tuple(o.reshape(shape[:-1] + (d // k, k)) for o in ops)
    part = lax.reduce(rows, init, combine, (len(shape),))
    return tuple(lax.reduce(tuple(part), init, combine, red))


def fold_map(make: Make, arrays: Sequence[jax.Array], inits: Sequence[float | int], combine: Combine,
             axes: Sequence[int] | None = None) -> tuple[jax.Array, ...]:
    """Reduce the operands ``make(*arrays)`` over ``axes`` (None: all) in one variadic
    ``lax.reduce``: the ``arrays`` (one shape) are read once.

    ``out[i]`` is the ``combine``-reduction of operand ``i`` from ``inits[i]`` (its
    identity), the combiner seeing every operand of one position together; ``make``
    builds the operands elementwise from the inputs (it is called on slices of them).
    A :func:`kinds` combiner: one plain reduction per operand on GPUs and TPUs, which they
    fuse into one read (and inside :func:`cpu_plain` on the CPU too); the CPU's variadic
    form elsewhere (lanes, two levels: the module docstring). A custom combiner: one
    variadic reduction (the CPU's with lanes and levels). The inputs are
    ``stop_gradient``-ed (statistics are never differentiated).

    Args:
      make: ``(*arrays) -> tuple of operands``, elementwise.
      arrays: the inputs, of one shape.
      inits: one identity per operand (Python scalars; each output has its
        operand's dtype).
      combine: ``(tuple, tuple) -> tuple``, associative and commutative.
      axes: the axes to reduce.

    Returns:
      One array per operand, of the shape without ``axes``.
    """
    arrays = tuple(lax.stop_gradient(jnp.asarray(a)) for a in arrays)
    shape = tuple(arrays[0].shape)
    red = tuple(range(len(shape))) if axes is None else tuple(sorted(a % max(len(shape), 1) for a in axes))
    if not red:
        return tuple(make(*arrays))
    names = getattr(combine, "kinds", None)
    if names is None:   # a custom combiner: no plain form
        return tuple(on_cpu(lambda: _variadic(make, arrays, inits, combine, red),
                            lambda: _single(make, arrays, inits, combine, red)))
    if _CPU_PLAIN.get():
        return _plain(make, arrays, inits, names, red)
    return tuple(on_cpu(lambda: _variadic(make, arrays, inits, combine, red),
                        lambda: _plain(make, arrays, inits, names, red)))


def _plain(make: Make, arrays: tuple[jax.Array, ...], inits: Sequence[float | int], names: Sequence[str],
           red: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """:func:`fold_map`'s plain form: one plain ``lax.reduce`` per operand (sum, max, min),
    siblings GPUs and TPUs fuse into one read."""
    ops = tuple(make(*arrays))
    out = tuple(lax.reduce(o, jnp.asarray(v, o.dtype), _OPS[n], red) for o, v, n in zip(ops, inits, names))
    # Inside shard_map every output varies along what any input does, as a variadic
    # reduction's outputs do (the platforms' branches must have one type).
    axes = frozenset().union(*(_varying(a) for a in arrays))
    return tuple(_as_varying(o, axes) for o in out)


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes ``x`` varies along (empty where JAX says nothing)."""
    try:
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
    except Exception:  # pragma: no cover - an older JAX
        return frozenset()
    return frozenset(getattr(mat, "varying", ()) or ())


def _as_varying(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    missing = tuple(sorted(axes - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _single(make: Make, arrays: tuple[jax.Array, ...], inits: Sequence[float | int], combine: Combine,
            red: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """A custom combiner's form on GPUs and TPUs: one variadic ``lax.reduce``, no lanes."""
    ops = tuple(make(*arrays))
    return tuple(lax.reduce(ops, _init(inits, ops), combine, red))


def _variadic(make: Make, arrays: tuple[jax.Array, ...], inits: Sequence[float | int], combine: Combine,
              red: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """:func:`fold_map`'s CPU form: one variadic ``lax.reduce`` over lanes, in levels (module docstring)."""
    shape = tuple(arrays[0].shape)
    if not _trailing(shape, red):
        ops = tuple(make(*arrays))
        return tuple(lax.reduce(ops, _init(inits, ops), combine, red))
    if shape[-1] % LANES == 0 and shape[-1] >= 4 * LANES:
        ops = _lanes(arrays, make, combine)
    else:
        ops = tuple(make(*arrays))
    return _reduce_trailing(ops, _init(inits, ops), combine, red, jnp.dtype(arrays[0].dtype).itemsize)


def _init(inits: Sequence[float | int], ops: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(v, o.dtype) for v, o in zip(inits, ops))


def fold(ops: Sequence[jax.Array], inits: Sequence[float | int], combine: Combine,
         axes: Sequence[int] | None = None) -> tuple[jax.Array, ...]:
    """:func:`fold_map` of operands already built (``ops``, one shape)."""
    return fold_map(lambda *o: o, ops, inits, combine, axes)


# Which Summary fields a fold measures.
FULL = ("sum", "sumsq", "abs_max", "nonfinite")
SUMSQ = ("sumsq", "nonfinite")
MAX = ("abs_max", "nonfinite")
_KIND = {"sum": "sum", "sumsq": "sum", "abs_max": "max", "nonfinite": "sum"}


def finite_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(xg, bad)``: ``x`` in float32 with its NaN and Inf read as 0, and 1.0 where they were
    (0.0 elsewhere), by arithmetic on the bits, no comparison (module docstring)::

        e = (bits >> 23) & 255;  bad = (e + 1) >> 8;  xg = bits & (bad - 1)

    (``e = 255`` exactly for Inf and NaN; ``bad - 1`` is all ones for a finite element.)
    bf16/fp16 are upcast first (an upcast keeps Inf and NaN)."""
    xf = jnp.asarray(x).astype(_F32)
    bits = lax.bitcast_convert_type(xf, jnp.int32)
    bad = (((bits >> 23) & 255) + 1) >> 8
    return lax.bitcast_convert_type(bits & (bad - 1), _F32), bad.astype(_F32)


def summary_ops(x: jax.Array, valid: jax.Array | None, fields: Sequence[str]) -> tuple[jax.Array, ...]:
    """The fold operands of :class:`~jvitals.metrics.stats.Summary` ``fields`` of ``x``.

    ``x`` is cast to float32 first (bf16/fp16 give their upcast's figures). With
    ``(xf, bad) = finite_parts(x)`` (the finite values, NaN and Inf read as 0) and ``xg``
    that where ``valid`` (else 0): ``sum = xg``, ``sumsq = xg^2``, ``abs_max = |xg|`` (a
    maximum from 0: that of the valid finite values; the caller makes it NaN where any is
    non-finite), ``nonfinite = bad`` where ``valid``. All are reduced from 0.
    """
    xf, bad = finite_parts(x)
    xg = xf if valid is None else jnp.where(valid, xf, 0.0)
    make = {
        "sum": lambda: xg,
        "sumsq": lambda: xg * xg,
        "abs_max": lambda: jnp.abs(xg),
        "nonfinite": lambda: bad if valid is None else jnp.where(valid, bad, 0.0),
    }
    return tuple(make[f]() for f in fields)


def fold_summaries(items: Sequence[tuple[jax.Array, jax.Array | None, Sequence[str]]],
                   axes: Sequence[int] | None) -> list[dict[str, jax.Array]]:
    """The Summary ``fields`` of several arrays of one shape in one reduction (one read each).

    Args:
      items: ``(x, valid, fields)``: ``valid`` None or a boolean of ``x``'s shape
        (a broadcast is fine: it is fused, not read at that size).
      axes: the axes to reduce (those of every item).

    Returns:
      Per item, ``{field: array}`` (``abs_max`` before the NaN rule).
    """
    arrays: list[jax.Array] = []
    layout: list[tuple[bool, tuple[str, ...]]] = []
    names: list[str] = []
    for x, valid, fields in items:
        arrays.append(x)
        if valid is not None:
            arrays.append(valid)
        layout.append((valid is not None, tuple(fields)))
        names += [_KIND[f] for f in fields]

    def make(*args: jax.Array) -> tuple[jax.Array, ...]:
        ops: list[jax.Array] = []
        it = iter(args)
        for masked, fields in layout:
            x = next(it)
            ops += summary_ops(x, next(it) if masked else None, fields)
        return tuple(ops)

    got = iter(fold_map(make, arrays, [0.0] * len(names), kinds(names)[1], axes))
    return [{f: next(got) for f in fields} for _, fields in layout]
