"""One-pass tensor summaries and their mesh-correct reduction.

A :class:`Summary` holds what every statistic is derived from::

    count = #valid elements   sum, sumsq = sums over valid finite x, x^2 (float32)
    abs_max = max over valid |x|   nonfinite = #valid elements that are NaN or +-Inf

whence ``mean = sum / count``, ``rms = sqrt(sumsq / count)``,
``std = sqrt(max(sumsq / count - mean^2, 0))``. Every derived statistic is NaN when
``nonfinite > 0`` (METRICS.md §1: non-finite values are never hidden) or ``count == 0``.
Summaries merge associatively (``Summary.empty()`` is the identity), so the reduction
across a mesh is exact: counts and sums ``psum``-ed, maxima ``pmax``-ed, a mean over shards
``psum(sum) / psum(count)``, never ``pmean(local_mean)``.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec

from jvitals.metrics import fold
from jvitals.metrics.axes import NO_SPEC, check_axes, make_varying, manual_varying, reduce_axes

__all__ = ["Summary", "TokenSummary", "summarize_tokens", "summarize", "summarize_many", "summarize_fields",
           "summarize_max", "summarize_sumsq", "reduce", "eager_jit"]

_F32 = jnp.float32


def nan_rule(value: jax.Array, count: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """``value``, NaN where the input held a non-finite value or nothing: every summary figure's rule."""
    return jnp.where((nonfinite > 0) | (count <= 0), jnp.nan, value).astype(_F32)


# ----------------------------------------------------------------------------------
# Eager calls compile once.


def _eager(tree: Any) -> bool:
    """True when no leaf of ``tree`` is a tracer (called eagerly, outside jit/grad/shard_map)."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def eager_jit(static_argnames: Sequence[str] = ()) -> Any:
    """Decorator: called eagerly, run ``fn`` through one cached ``jax.jit`` of it.

    A device function called outside ``jit`` runs op by op, and each of its
    ``lax.cond``/``lax.map`` is traced and compiled anew on every call (their
    branches are fresh closures): a compile per ``summarize`` in a notebook. Called eagerly with hashable ``static_argnames``, the wrapped
    function goes through ``jax.jit(fn, static_argnames=...)`` instead, which
    compiles once per input shapes; inside a trace (any tracer among the
    arguments: ``jit``, ``grad``, ``shard_map``, ``scan``...) it is ``fn`` itself.

    Args:
      static_argnames: keyword arguments that are Python values (axes, names,
        flags); an unhashable value there falls back to the plain call.
    """
    static = tuple(static_argnames)

    def deco(fn: Any) -> Any:
        jitted = jax.jit(fn, static_argnames=static)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            dyn = {k: v for k, v in kwargs.items() if k not in static}
            if not _eager((args, dyn)):
                return fn(*args, **kwargs)
            for k in static:  # names=["logits"] -> ("logits",): hashable, the same meaning
                if isinstance(kwargs.get(k), list):
                    kwargs[k] = tuple(kwargs[k])
            try:
                for k in static:
                    if k in kwargs:
                        hash(kwargs[k])
                jax.tree.map(_check_leaf, (args, dyn))
            except TypeError:
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    return deco


def _check_leaf(x: Any) -> None:
    if not (hasattr(x, "dtype") or isinstance(x, (int, float, bool, complex))):
        raise TypeError(f"not an array leaf: {type(x).__name__}")


@struct.dataclass
class Summary:
    """Sufficient statistics of a tensor, in float32 (see the module docstring).

    Attributes:
      count: number of valid elements.
      sum: sum of the valid finite elements.
      sumsq: sum of squares of the valid finite elements.
      abs_max: ``max |x|`` over valid elements; NaN if any is non-finite or if
        there are none.
      nonfinite: number of valid elements that are NaN or infinite.

    All fields have the same shape: ``()`` for a whole-tensor summary, ``(L,)``
    for ``summarize(x, axis=...)``.
    """

    count: jax.Array
    sum: jax.Array
    sumsq: jax.Array
    abs_max: jax.Array
    nonfinite: jax.Array

    @classmethod
    def empty(cls, shape: Sequence[int] = ()) -> "Summary":
        """The identity of :meth:`merge`: nothing counted, NaN statistics."""
        z = jnp.zeros(shape, _F32)
        return cls(count=z, sum=z, sumsq=z, abs_max=jnp.full(shape, jnp.nan, _F32), nonfinite=z)

    def merge(self, other: "Summary") -> "Summary":
        """Summary of the union of both inputs (associative; ``empty()`` is neutral)."""
        count = self.count + other.count
        nonfinite = self.nonfinite + other.nonfinite
        amax = jnp.fmax(_finite_or_minus_inf(self.abs_max), _finite_or_minus_inf(other.abs_max))
        return Summary(
            count=count,
            sum=self.sum + other.sum,
            sumsq=self.sumsq + other.sumsq,
            abs_max=nan_rule(amax, count, nonfinite),
            nonfinite=nonfinite,
        )

    def total(self) -> "Summary":
        """Merge every entry of a per-layer summary (shape ``(L,)``) into one."""
        count = jnp.sum(self.count)
        nonfinite = jnp.sum(self.nonfinite)
        amax = jnp.max(_finite_or_minus_inf(self.abs_max), initial=-jnp.inf)
        return Summary(
            count=count,
            sum=jnp.sum(self.sum),
            sumsq=jnp.sum(self.sumsq),
            abs_max=nan_rule(amax, count, nonfinite),
            nonfinite=nonfinite,
        )

    @property
    def mean(self) -> jax.Array:
        """``sum / count`` (NaN if empty or non-finite)."""
        return nan_rule(self.sum / jnp.maximum(self.count, 1.0), self.count, self.nonfinite)

    @property
    def rms(self) -> jax.Array:
        """``sqrt(sumsq / count)``; includes the mean, unlike :attr:`std`."""
        return nan_rule(jnp.sqrt(self.sumsq / jnp.maximum(self.count, 1.0)), self.count, self.nonfinite)

    @property
    def norm(self) -> jax.Array:
        """L2 norm ``sqrt(sumsq)`` (NaN if non-finite; 0 for an empty input)."""
        return jnp.where(self.nonfinite > 0, jnp.nan, jnp.sqrt(self.sumsq)).astype(_F32)

    @property
    def std(self) -> jax.Array:
        """Population standard deviation ``sqrt(max(E[x^2] - E[x]^2, 0))``.

        One-pass formula: it loses precision when ``|mean| >> std``.
        """
        n = jnp.maximum(self.count, 1.0)
        mean = self.sum / n
        var = jnp.maximum(self.sumsq / n - mean * mean, 0.0)
        return nan_rule(jnp.sqrt(var), self.count, self.nonfinite)


@struct.dataclass
class TokenSummary:
    """Per-position sufficient statistics: a :class:`Summary` for every token.

    What :func:`jvitals.metrics.instrument.instrument` sows: for activations ``x`` of
    shape ``[*S, ...]`` (``S = [B, T]``), each field has shape ``S`` and holds the
    statistics of that position's entries (``x[b, t, ...]``). The token mask is
    applied later, by :meth:`masked` (``activation_metrics(..., mask=)``), so the
    sowing code needs no mask and the figures exclude padding exactly as if the
    raw ``x`` had been sown: ``masked(m) == summarize(x, m)``.

    Attributes:
      count, sum, sumsq, abs_max, nonfinite: as :class:`Summary`, per position
        (``abs_max`` NaN where the position holds a non-finite value; ``count``
        counts the entries that are valid at sow time, e.g. unmasked attention
        keys).
    """

    count: jax.Array
    sum: jax.Array
    sumsq: jax.Array
    abs_max: jax.Array
    nonfinite: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The per-position shape (``[B, T]``, or ``[L, B, T]`` when scan-stacked)."""
        return tuple(self.count.shape)

    def masked(self, mask: jax.Array | None = None, *, axis: int | None = None) -> Summary:
        """The :class:`Summary` over the positions where ``mask`` is True.

        Args:
          mask: boolean, aligned with the leading positions (``[B, T]``; against
            ``[L, B, T]`` fields with ``axis=0`` too); None: every position.
          axis: keep this axis of the fields (the layer axis of scan-stacked sows).

        Returns:
          A :class:`Summary` (fields ``()``, or ``(shape[axis],)``).
        """
        shape = self.shape
        red, axis = _reduced_axes(shape, axis)
        valid = None if mask is None else jnp.broadcast_to(_align_mask(jnp.asarray(mask, bool), shape, axis), shape)

        def keep(x: jax.Array, empty: float) -> jax.Array:
            return x if valid is None else jnp.where(valid, x, empty)

        # One read of the five per-position fields (fold.py).
        inits, combine = fold.kinds(("sum", "sum", "sum", "max", "sum"))
        count, total, sumsq, amax, nonfinite = fold.fold(
            (keep(self.count, 0.0), keep(self.sum, 0.0), keep(self.sumsq, 0.0),
             keep(_finite_or_minus_inf(self.abs_max), -jnp.inf), keep(self.nonfinite, 0.0)),
            inits, combine, red)
        return Summary(count=count, sum=total, sumsq=sumsq, abs_max=nan_rule(amax, count, nonfinite),
                       nonfinite=nonfinite)


@eager_jit(static_argnames=("token_ndim", "max_only"))
def summarize_tokens(x: jax.Array, valid: jax.Array | None = None, *, token_ndim: int = 2,
                     max_only: bool = False) -> TokenSummary:
    """Per-position statistics of ``x`` over every axis after the first ``token_ndim``.

    ``x[*S, ...]`` -> a :class:`TokenSummary` with fields of shape ``S =
    x.shape[:token_ndim]``; ``valid`` (broadcastable to ``x``) excludes entries
    at sow time (masked attention keys). Float32, as :func:`summarize`, and one
    read of ``x`` for all of them (one variadic reduction, ``fold.py``).

    Args:
      x: activations, e.g. ``[B, T, D]``.
      token_ndim: how many leading axes are token axes (2: ``[B, T]``).
      valid: optional boolean mask broadcastable to ``x``.
      max_only: measure only ``count``, ``abs_max`` and ``nonfinite`` (sum and
        sumsq NaN), for the attention logits.

    Returns:
      A :class:`TokenSummary`.
    """
    x = lax.stop_gradient(jnp.asarray(x))
    if x.ndim < token_ndim:
        raise ValueError(f"summarize_tokens: x of shape {tuple(x.shape)} has fewer than token_ndim="
                         f"{token_ndim} axes")
    red = tuple(range(token_ndim, x.ndim))
    s_shape = tuple(x.shape[:token_ndim])
    vb = None if valid is None else jnp.broadcast_to(jnp.asarray(valid, bool), x.shape)
    if vb is None:
        count = jnp.full(s_shape, float(np.prod([x.shape[d] for d in red])), _F32)
    else:
        count = jnp.sum(vb, axis=red, dtype=_F32)
    got = _fold_one(x, vb, red, fold.MAX if max_only else fold.FULL)
    nan = jnp.full(s_shape, jnp.nan, _F32)
    return TokenSummary(count=count, sum=got.get("sum", nan), sumsq=got.get("sumsq", nan),
                        abs_max=nan_rule(got["abs_max"], count, got["nonfinite"]),
                        nonfinite=got["nonfinite"])


def _fold_one(x: jax.Array, valid: jax.Array | None, red: tuple[int, ...] | None,
              fields: Sequence[str]) -> dict[str, jax.Array]:
    """``fields`` of one array over ``red`` in one read (see :func:`_fold_groups`)."""
    return _fold_groups([(x, valid, red, fields)])[0]


def _fold_groups(items: Sequence[tuple]) -> list[dict[str, jax.Array]]:
    """The :class:`Summary` ``fields`` of several arrays, one read each.

    Items ``(x, valid, red, fields[, tag])`` with the same shape, reduced axes and
    ``tag`` (and, inside ``shard_map``, the same varying mesh axes: a reduction's
    outputs take the type of all its operands) share one variadic reduction: one
    kernel reading each of their arrays once (``fold.py``). A tag keeps items
    apart: the arrays of one kernel are all live while it runs.

    Returns:
      Per item, ``{field: array}`` (``abs_max`` before the NaN rule).
    """
    groups: dict[Any, list[int]] = {}
    for i, (x, valid, red, *_) in enumerate(items):
        tag = items[i][4] if len(items[i]) > 4 else None
        key = (tuple(jnp.shape(x)), red, manual_varying(x), None if valid is None else manual_varying(valid), tag)
        groups.setdefault(key, []).append(i)
    out: list[dict[str, jax.Array]] = [{} for _ in items]
    for idx in groups.values():
        shape = tuple(jnp.shape(items[idx[0]][0]))
        got = fold.fold_summaries([(items[i][0], None if items[i][1] is None else
                                    jnp.broadcast_to(items[i][1], shape), items[i][3]) for i in idx],
                                  items[idx[0]][2])
        for i, g in zip(idx, got):
            out[i] = g
    return out


def _finite_or_minus_inf(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isnan(x), -jnp.inf, x)


def _align_mask(mask: jax.Array, shape: tuple[int, ...], axis: int | None) -> jax.Array:
    """Reshape ``mask`` to the rank of an array of ``shape``, ready to broadcast.

    A mask of the same rank broadcasts by NumPy rules. A mask of lower rank is
    aligned with the *leading* axes of ``x`` (a ``[B, T]`` token mask against
    ``[B, T, D]`` activations); when ``axis`` is kept, it is first tried against
    the shape without that axis (a ``[B, T]`` mask against scan-stacked
    ``[L, B, T, D]`` values). The result has size-1 axes where it broadcasts
    (``jnp.broadcast_to(result, shape)`` is the full mask), so a count over it
    need not read the broadcast (:func:`_broadcast_count`).
    """
    mshape = tuple(mask.shape)

    def fits(target: tuple[int, ...]) -> bool:
        return len(mshape) <= len(target) and all(m in (1, t) for m, t in zip(mshape, target))

    if len(mshape) == len(shape):
        if all(m in (1, s) for m, s in zip(mshape, shape)):
            return mask
    elif len(mshape) < len(shape):
        if axis is not None:
            without = shape[:axis] + shape[axis + 1:]
            if fits(without):
                return jnp.expand_dims(mask.reshape(mshape + (1,) * (len(without) - len(mshape))), axis)
        if fits(shape):
            return mask.reshape(mshape + (1,) * (len(shape) - len(mshape)))
    hint = f" (or, with axis={axis}, those of the shape without that axis)" if axis is not None else ""
    raise ValueError(
        f"mask of shape {mshape} does not broadcast against x of shape {shape}: a mask "
        f"must match x's leading axes{hint}, e.g. a [B, T] token mask for [B, T, D] "
        f"activations. Pass mask with shape {shape[:len(mshape)] if len(mshape) <= len(shape) else shape[:2]}."
    )


def _reduced_axes(shape: tuple[int, ...], axis: int | None) -> tuple[tuple[int, ...] | None, int | None]:
    """The axes to reduce (None: all) and the normalised kept ``axis``."""
    if axis is None:
        return None, None
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis={axis!r}: expected an int (an array axis to keep, e.g. 0 for stacked layers); "
                        "mesh axis names go to reduce(summary, axes=...)")
    if not -len(shape) <= axis < len(shape) or len(shape) == 0:
        raise ValueError(f"axis={axis} is out of range for x of shape {shape}")
    axis = axis % len(shape)
    return tuple(i for i in range(len(shape)) if i != axis), axis


def summarize(x: jax.Array, mask: jax.Array | None = None, *, axis: int | None = None) -> Summary:
    """Summarise ``x`` in float32, in one read of ``x``.

    ``count = sum(mask)``, ``sum = sum(where(mask & finite, x, 0))``,
    ``sumsq = sum(where(mask & finite, x, 0)^2)``, ``abs_max = max(mask * |x|)``,
    ``nonfinite = sum(mask & ~isfinite(x))``. ``x`` is cast to float32 before any
    arithmetic, so bf16/fp16 inputs give the figures of their float32 upcast.
    The count is taken over the mask at its own size; the four others are the
    operands of one variadic reduction (``fold.py``), so ``x`` is read once, on
    every backend, with no conditional.

    Args:
      x: any array (any float or integer dtype).
      mask: optional boolean array, True = valid; broadcast against ``x`` (same
        rank: NumPy rules; lower rank: aligned with ``x``'s leading axes, after
        removing ``axis`` if that fits). Masked elements count nowhere.
      axis: keep this axis (e.g. the leading layer axis of ``nn.scan``-stacked
        values): the result has fields of shape ``(x.shape[axis],)``.

    Returns:
      A :class:`Summary` (fields of shape ``()``, or ``(x.shape[axis],)``).

    Raises:
      ValueError: if ``mask`` does not broadcast against ``x`` or ``axis`` is out
        of range.

    Example:
      >>> s = summarize(jnp.array([[3.0, 4.0], [1e9, 0.0]]), mask=jnp.array([True, False]))
      >>> round(float(s.rms), 4), int(s.count)
      (3.5355, 2)
    """
    if x is None or isinstance(x, (str, dict)):
        raise TypeError(f"summarize(x=...) expects an array, got {type(x).__name__} {x!r:.60}")
    return summarize_many([(x, mask, axis)])[0]


def summarize_many(items: Sequence[tuple[jax.Array, jax.Array | None, int | None]]) -> list[Summary]:
    """:func:`summarize` of several arrays; arrays of one shape share one reduction.

    Each array is read once; items of the same shape and ``axis`` are summarised
    by one variadic reduction (one kernel). Called eagerly it compiles once per
    shapes (a cached ``jax.jit``).

    Args:
      items: ``(x, mask, axis)`` triples, as :func:`summarize` takes them.

    Returns:
      One :class:`Summary` per item, in order.
    """
    items = [tuple(it) for it in items]
    if items and _eager([(x, m) for x, m, _ in items]):
        axes = tuple(a for _, _, a in items)
        try:
            return list(_summarize_many_jit([(x, m) for x, m, _ in items], axes))
        except TypeError:
            pass
    return _summarize_many(items)


@functools.partial(jax.jit, static_argnums=1)
def _summarize_many_jit(arrays: Any, axes: tuple[int | None, ...]) -> list[Summary]:
    return _summarize_many([(x, m, a) for (x, m), a in zip(arrays, axes)])


def _summarize_many(items: Sequence[tuple[jax.Array, jax.Array | None, int | None]]) -> list[Summary]:
    """The traced body of :func:`summarize_many`."""
    return summarize_fields([(x, m, a, fold.FULL) for x, m, a in items])


def summarize_fields(items: Sequence[tuple[jax.Array, jax.Array | None, int | None, Sequence[str]]]) -> list[Summary]:
    """Summaries measuring only some fields, arrays of one shape sharing one reduction.

    Each item is ``(x, mask, axis, fields[, tag])`` with ``fields`` among
    ``fold.FULL`` (``"sum"``, ``"sumsq"``, ``"abs_max"``, ``"nonfinite"``);
    ``count`` is always measured (from the mask, at its own size), the fields
    not asked for are NaN. Every array is read once (``fold.py``); items of one
    shape and tag share a kernel.

    Returns:
      One :class:`Summary` per item, in order.
    """
    counts, folds = [], []
    for x, mask, axis, fields, *tag in items:
        x = jnp.asarray(x)
        shape = tuple(x.shape)
        red, axis = _reduced_axes(shape, axis)
        count, m = _count_and_mask(mask, shape, red, axis)
        counts.append(count)
        folds.append((x, m, red, tuple(fields), tag[0] if tag else None))
    out = []
    for count, f in zip(counts, _masked_groups(folds)):
        nan = jnp.full_like(count, jnp.nan)
        nonfinite = f["nonfinite"]
        amax = nan_rule(f["abs_max"], count, nonfinite) if "abs_max" in f else nan
        out.append(Summary(count=count, sum=f.get("sum", nan), sumsq=f.get("sumsq", nan), abs_max=amax,
                           nonfinite=nonfinite))
    return out


def _count_and_mask(mask: jax.Array | None, shape: tuple[int, ...], red: tuple[int, ...] | None,
                    axis: int | None) -> tuple[jax.Array, jax.Array | None]:
    """The number of valid elements per kept entry, and the mask aligned with ``shape``
    (size 1 where it broadcasts, :func:`_align_mask`; None: all valid).

    The count is taken over the mask at its own size (times the broadcast
    factor), never over its broadcast to ``shape``.
    """
    dims = tuple(range(len(shape))) if red is None else red
    if mask is None:
        n = float(np.prod([shape[d] for d in dims]))
        return jnp.full(() if axis is None else (shape[axis],), n, _F32), None
    m = _align_mask(jnp.asarray(mask, bool), shape, axis)
    return _broadcast_count(m, shape, red, axis), m


def _constant_tail(shape: tuple[int, ...], mask: jax.Array, red: tuple[int, ...] | None) -> tuple[int, ...]:
    """The trailing axes of ``shape``, all reduced, along which the aligned ``mask`` is
    constant (size 1 there): the feature axes of ``[B, T, D]`` activations under a ``[B, T]``
    token mask."""
    dims = set(range(len(shape)) if red is None else red)
    tail: list[int] = []
    for d in reversed(range(len(shape))):
        if d not in dims or mask.shape[d] != 1:
            break
        tail.append(d)
    return tuple(sorted(tail))


def _masked_groups(items: Sequence[tuple]) -> list[dict[str, jax.Array]]:
    """:func:`_fold_groups` of items ``(x, mask, red, fields, tag)`` with the mask aligned
    (:func:`_count_and_mask`), which is applied after the axes it is constant along.

    A ``[B, T]`` token mask over ``[B, T, D]`` activations: each token's statistics over
    ``D`` first, unmasked, then the masked sums and maximum of those ``[B, T]`` partials.
    The same figures (every element of a token shares its mask), and the reduction over
    the tensor holds no mask: inside it, the TPU compiler laid the model's tensor out anew
    for it (a read of its own, several times one read: docs/COST.md). A
    mask that varies along the last axis (the attention scores' causal mask) is applied
    inside the reduction.
    """
    folds, post = [], []
    for x, m, red, fields, tag in items:
        shape = tuple(jnp.shape(x))
        tail = () if m is None else _constant_tail(shape, m, red)
        if tail:
            folds.append((x, None, tail, fields, tag))
            post.append((m, tail, red))
        else:
            folds.append((x, None if m is None else jnp.broadcast_to(m, shape), red, fields, tag))
            post.append(None)
    out = []
    for got, (x, *_), after in zip(_fold_groups(folds), items, post):
        if after is None:
            out.append(got)
            continue
        m, tail, red = after
        keep = [d for d in range(jnp.ndim(x)) if d not in tail]
        dims = set(range(jnp.ndim(x)) if red is None else red)
        m1 = m.reshape(tuple(m.shape[d] for d in keep))
        red2 = tuple(i for i, d in enumerate(keep) if d in dims)
        out.append({f: (jnp.max if f == "abs_max" else jnp.sum)(jnp.where(m1, v, 0.0), axis=red2)
                    for f, v in got.items()})
    return out


@eager_jit(static_argnames=("axis",))
def summarize_sumsq(x: jax.Array | Sequence[jax.Array], *, axis: int | None = None) -> Summary:
    """A :class:`Summary` that measures only ``count``, ``sumsq`` and ``nonfinite``.

    For L2 norms over whole trees (the global gradient/parameter/update norms,
    per-layer parameter norms): ``sum(where(finite, x, 0)^2)`` and the non-finite
    count in float32, one read of each array (arrays of one shape share one
    variadic reduction). ``sum`` and ``abs_max`` are NaN -- not measured.
    ``norm`` is right (NaN if any element is non-finite); so is ``rms``.

    Args:
      x: an array, or a list/tuple of arrays summarised together (the leaves of
        a tree).
      axis: keep this axis of every array (the layer axis of scan-stacked
        leaves, all of the same length along it): fields of shape ``(L,)``.

    Returns:
      A :class:`Summary` whose ``sum``/``abs_max`` are NaN.
    """
    xs = [jnp.asarray(a) for a in (x if isinstance(x, (list, tuple)) else [x])]
    kept = () if axis is None else (xs[0].shape[axis],)
    got = _fold_groups([(a, None, _reduced_axes(tuple(a.shape), axis)[0], fold.SUMSQ) for a in xs])
    sumsq = functools.reduce(jnp.add, [g["sumsq"] for g in got], jnp.zeros(kept, _F32))
    nonfinite = functools.reduce(jnp.add, [g["nonfinite"] for g in got], jnp.zeros(kept, _F32))
    nan = jnp.full(kept, jnp.nan, _F32)
    n = float(sum(a.size for a in xs)) / (kept[0] if kept else 1)
    return Summary(count=jnp.full(kept, n, _F32), sum=nan, sumsq=sumsq, abs_max=nan, nonfinite=nonfinite)


def _broadcast_count(mask: jax.Array, shape: tuple[int, ...], red: tuple[int, ...] | None,
                     axis: int | None) -> jax.Array:
    """``sum(broadcast_to(mask, shape))`` over ``red`` without reading the broadcast.

    ``mask`` has the rank of ``shape`` with size-1 axes where it broadcasts (as
    :func:`_align_mask` returns it: ``[B, T, 1]`` against ``[B, T, D]``,
    ``[B, 1, T, T]`` against ``[B, H, T, T]`` scores); it is summed at its own
    size and multiplied by the broadcast factor.
    """
    dims = tuple(range(len(shape))) if red is None else red
    factor = float(np.prod([shape[d] for d in dims if mask.shape[d] == 1 and shape[d] > 1]))
    count = jnp.sum(mask, axis=dims, dtype=_F32) * factor
    if axis is not None and mask.shape[axis] == 1:
        count = jnp.broadcast_to(count, (shape[axis],))
    return count


@eager_jit(static_argnames=("axis",))
def summarize_max(x: jax.Array | Sequence[jax.Array], mask: jax.Array | None = None, *,
                  axis: int | None = None) -> Summary:
    """A :class:`Summary` that measures only ``count``, ``abs_max`` and ``nonfinite``.

    For figures that only need the maximum (the pre-softmax attention logits,
    ``[B, H, T, T]`` per layer; Adam's ``nu``): ``max |x|`` over the valid finite
    elements and the non-finite count, in one read of ``x``. ``sum`` and
    ``sumsq`` are NaN -- not measured -- so ``mean``/``rms``/``std`` are NaN by
    construction.

    Args:
      x: an array, or a list/tuple of arrays summarised together (one maximum
        and one count for them all; no ``mask`` or ``axis`` then).
      mask, axis: as for :func:`summarize`.

    Returns:
      A :class:`Summary` whose ``sum``/``sumsq`` are NaN.
    """
    if isinstance(x, (list, tuple)):
        if mask is not None or axis is not None:
            raise ValueError("summarize_max of a list of arrays takes no mask or axis")
        xs = [jnp.asarray(a) for a in x]
        if not xs:
            return Summary.empty()
        if any(manual_varying(a) for a in xs):   # inside shard_map: the one-read form
            amax, nonfinite = _max_one_read(xs)
        else:
            amax, nonfinite = fold.on_cpu(lambda: _max_plain(xs), lambda: _max_one_read(xs))
        count = jnp.full((), float(sum(a.size for a in xs)), _F32)
    else:
        xf = jnp.asarray(x)
        shape = tuple(xf.shape)
        red, axis = _reduced_axes(shape, axis)
        count, m = _count_and_mask(mask, shape, red, axis)
        got = _masked_groups([(xf, m, red, fold.MAX, None)])[0]
        amax, nonfinite = got["abs_max"], got["nonfinite"]
    nan = jnp.full_like(amax, jnp.nan)
    return Summary(count=count, sum=nan, sumsq=nan, abs_max=nan_rule(amax, count, nonfinite),
                   nonfinite=nonfinite)


def _max_one_read(xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(max |x| over the finite elements, #non-finite)`` of arrays, one read each (``fold.py``)."""
    got = _fold_groups([(a, None, None, fold.MAX) for a in xs])
    return (functools.reduce(jnp.maximum, [g["abs_max"] for g in got]),
            functools.reduce(jnp.add, [g["nonfinite"] for g in got]))


def _max_plain(xs: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """:func:`_max_one_read` in XLA:CPU's fastest form: a plain ``max |x|`` per array (NaN
    where one is NaN; the caller's NaN rule reads the count), the non-finite count only where
    that maximum is not finite (a ``lax.cond``: a healthy step reads nothing for it)."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(a.astype(_F32))) for a in xs])

    def count() -> jax.Array:
        return functools.reduce(jnp.add, [jnp.sum(jnp.where(jnp.isfinite(a.astype(_F32)), 0.0, 1.0)) for a in xs])

    nonfinite = lax.cond(jnp.isfinite(amax), lambda: jnp.zeros((), _F32), count)
    return amax, nonfinite


def _reduce_summary(s: Summary, axes: tuple[str, ...], spec: Any) -> Summary:
    red = reduce_axes([s.count, s.sum, s.sumsq, s.abs_max, s.nonfinite], axes, spec)
    if not red:
        return s

    def psum(x: jax.Array) -> jax.Array:
        return lax.psum(make_varying(x, red), red)

    count = psum(s.count)
    nonfinite = psum(s.nonfinite)
    # pmax drops NaN on some backends and keeps it on others: reduce finite
    # maxima only and rebuild NaN from the psum-ed counts.
    amax = lax.pmax(make_varying(_finite_or_minus_inf(s.abs_max), red), red)
    return Summary(count=count, sum=psum(s.sum), sumsq=psum(s.sumsq), abs_max=nan_rule(amax, count, nonfinite),
                   nonfinite=nonfinite)


def _is_summary(x: Any) -> bool:
    return isinstance(x, Summary)


def reduce(tree: Any, axes: Sequence[str] | str = (), *, specs: Any = None) -> Any:
    """Reduce every :class:`Summary` in ``tree`` over the named mesh axes.

    Counts and sums are ``psum``-ed, maxima ``pmax``-ed, so derived means are
    ``psum(sum) / psum(count)``: exact with shards of unequal valid counts.

    Each leaf is reduced only over the axes it is *sharded* along: with
    ``specs`` (a pytree of ``PartitionSpec`` with the structure of ``tree``, or a
    prefix of it, where a Summary may take one spec), the axes its spec names;
    without, the axes JAX's type system says the value varies along inside
    ``shard_map``. A replicated leaf is therefore never counted twice. Non-Summary
    leaves are left as they are. With ``axes=()`` (plain ``jit`` over global
    arrays) nothing is reduced and no collective is emitted.

    Args:
      tree: a pytree whose ``Summary`` nodes are reduced.
      axes: mesh axis names bound by the enclosing ``shard_map``/``pmap``.
      specs: optional pytree of ``PartitionSpec`` (``None`` = replicated).

    Returns:
      ``tree`` with each Summary replaced by its reduction.

    Raises:
      ValueError: if an axis name is not bound, or ``specs`` does not match.
    """
    axes = check_axes(axes)
    if not axes:
        return tree

    def per_spec(spec: Any, sub: Any) -> Any:
        return jax.tree.map(lambda s: _reduce_summary(s, axes, spec) if _is_summary(s) else s,
                            sub, is_leaf=_is_summary)

    if specs is None:
        return per_spec(NO_SPEC, tree)
    try:
        return jax.tree.map(per_spec, specs, tree,
                            is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
    except ValueError as e:
        raise ValueError(
            f"specs must be a pytree of PartitionSpec with the structure of tree (or a "
            f"prefix of it); they do not match: {e}") from None
