"""Fused QKV kernels: where the Q, K and V parts of one fused projection lie.

Given a fused kernel (``c_attn``, ``query_key_value``, ``qkv``...) and its
:class:`~jvitals.metrics.roles.QKVSplit`, say which entries along the split axis are Q, K
and V. Two layouts exist in the wild: ``"contiguous"`` (``[Q heads | K heads | V heads]``,
GPT-2's ``c_attn``) and ``"interleaved"`` (per key/value group its query heads, then its key
and value heads, ``[KVH, H / KVH + 2, Dh]``: Bloom, GPT-NeoX, Falcon; it needs the head
count, and jvitals raises rather than guess it). :func:`split_qkv` and :func:`merge_qkv`
map a fused kernel to its parts and back (e.g. for QK-clip); :func:`fused_pieces` gives the
parts the gradient figures measure.

Which families use which layout: docs/DEVICE.md, "qkv: the fused layouts".
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if TYPE_CHECKING:
    from jvitals.metrics.roles import LeafRole, QKVSplit, Roles

__all__ = ["LAYOUTS", "QKVLayout", "kv_layout", "merge_qkv", "pair_layout", "qkv_layout", "qkv_part_ids",
           "split_qkv"]

LAYOUTS = ("contiguous", "interleaved")
"""The fused-QKV layouts :class:`~jvitals.metrics.roles.QKVSplit` can name (module docstring)."""


class QKVLayout(NamedTuple):
    """Where Q, K and V lie along the split axis of one fused kernel (static, no arrays).

    Attributes:
      axis: the split axis (non-negative) of the kernel it was resolved for.
      layout: ``"contiguous"`` or ``"interleaved"``.
      sizes: ``(q, k, v)`` entries along ``axis``.
      groups: key/value groups ``G`` of the interleaved layout (1 when contiguous).
      head_dim: ``Dh`` of the interleaved layout (None when contiguous).
    """

    axis: int
    layout: str
    sizes: tuple[int, int, int]
    groups: int = 1
    head_dim: int | None = None

    @property
    def n(self) -> int:
        """Entries along the split axis."""
        return sum(self.sizes)

    @property
    def per_group(self) -> tuple[int, int, int]:
        """``(q, k, v)`` entries of one key/value group (the whole axis when contiguous)."""
        g = self.groups
        return self.sizes[0] // g, self.sizes[1] // g, self.sizes[2] // g


def _no_heads_error(path: str, n: int, where: str) -> ValueError:
    return ValueError(
        f"fused QKV split: kernel {path!r} ({n} entries on {where}) is laid out per head "
        f"(interleaved [H, 3, Dh] as Bloom's and GPT-NeoX's query_key_value, or [KVH, H/KVH + 2, Dh] "
        f"with grouped-query attention): splitting it needs the head count, which the parameter "
        f"shapes do not give. Pass Roles(qkv_split=QKVSplit(num_heads=H, num_kv_heads=KVH, "
        f"layout='interleaved')) (num_kv_heads defaults to num_heads), e.g. from the model's "
        f"config (n_head / num_attention_heads), or QKVSplit(layout='contiguous') if its columns "
        f"really are [Q | K | V].")


def qkv_layout(shape: Sequence[int], split: "QKVSplit | None" = None, *, path: str = "qkv",
               layout: str | None = None, q_size: int | None = None) -> QKVLayout:
    """Resolve where Q, K and V lie in one layer's fused kernel of ``shape``.

    Args:
      shape: one layer's kernel shape (no scan axis).
      split: the :class:`~jvitals.metrics.roles.QKVSplit` (default ``QKVSplit()``).
      path: the kernel's path, for error messages.
      layout: the layout when ``split.layout`` is None (what
        :meth:`~jvitals.metrics.roles.Roles.qkv_layout_of` picks by path); default
        ``"contiguous"``.
      q_size: the Q width inferred from the output projection (contiguous layout
        without head counts only; see :meth:`~jvitals.metrics.roles.QKVSplit.sizes`).

    Returns:
      A :class:`QKVLayout`.

    Raises:
      ValueError: an unknown layout, an interleaved layout without ``num_heads``,
        or an axis that does not divide into the configured heads.
    """
    if split is None:
        from jvitals.metrics.roles import QKVSplit
        split = QKVSplit()
    shape = tuple(int(d) for d in shape)
    lay = split.layout if split.layout is not None else (layout or "contiguous")
    if lay not in LAYOUTS:
        raise ValueError(f"fused QKV split: layout={lay!r} for {path!r}; expected one of {LAYOUTS}")
    a = split.resolve_axis(shape)
    n = shape[a]
    where = f"axis {a} of its per-layer shape {shape}"
    if lay == "contiguous":
        if n == 3 and len(shape) > 2:  # stacked [3, ...]: one entry each, whatever the head counts
            return QKVLayout(a, lay, (1, 1, 1))
        return QKVLayout(a, lay, split.sizes(n, path, where, q_size))
    h = split.num_heads
    if h is None:
        raise _no_heads_error(path, n, where)
    kvh = split.num_kv_heads if split.num_kv_heads is not None else h
    nq, nk, nv = split.sizes(n, path, where)
    if h % kvh:
        raise ValueError(f"fused QKV split: kernel {path!r}: num_heads={h} is not a multiple of "
                         f"num_kv_heads={kvh}; the interleaved layout groups H / KVH query heads per "
                         f"key/value head. Check QKVSplit(num_heads=..., num_kv_heads=...).")
    return QKVLayout(a, lay, (nq, nk, nv), groups=kvh, head_dim=nk // kvh)


def resolve_fused(shape: Sequence[int], split: "QKVSplit | None" = None,
                  o_numel: int | None = None) -> tuple["QKVSplit", int | None]:
    """The split axis of one layer's fused kernel, checked against the head counts and
    the attention's output projection, and the Q width it implies.

    :meth:`~jvitals.metrics.roles.QKVSplit.resolve_axis` reads the shape alone, which can
    mislead: a one-head ``[D, 3*Dh]`` kernel with ``D > 3*Dh`` looks split on axis 0.
    An axis *fits* when it divides into ``H + 2*KVH`` heads and, given the output
    projection's per-layer size ``numel(Wo) = H*Dh*D``, when ``H*Dh*d_in == numel(Wo)``
    (``d_in`` = the kernel's other entries); without head counts, when
    ``q = numel(Wo) / d_in`` leaves two equal K and V widths. If the shape's axis does
    not fit, the last axis that does is taken. An explicit ``QKVSplit(axis=)`` wins.

    Args:
      shape: one layer's kernel shape (no scan axis).
      split: the :class:`~jvitals.metrics.roles.QKVSplit` (default ``QKVSplit()``).
      o_numel: per-layer element count of the attention's output projection, if known.

    Returns:
      ``(split with its axis set, q_size)``; ``q_size`` is the Q width inferred from
      the output projection (contiguous split without head counts), else None.
    """
    if split is None:
        from jvitals.metrics.roles import QKVSplit
        split = QKVSplit()
    shape = tuple(int(d) for d in shape)

    def q_size_on(a: int) -> int | None:
        n = shape[a]
        d_in = math.prod(shape) // n if n else 0
        if o_numel is None or d_in <= 0 or o_numel % d_in:
            return None
        q = o_numel // d_in
        return q if 0 < q < n and (n - q) % 2 == 0 else None

    def fits(a: int) -> bool:
        n = shape[a]
        if n == 3 and len(shape) > 2:  # Q, K, V stacked on an axis of 3: Gemma's [3, H, D, Dh]
            return o_numel is None or 3 * o_numel == math.prod(shape)
        if split.num_heads is None:
            return q_size_on(a) is not None
        h = split.num_heads
        parts = h + 2 * (split.num_kv_heads if split.num_kv_heads is not None else h)
        if parts <= 0 or n % parts:
            return False
        return o_numel is None or o_numel == h * (n // parts) * (math.prod(shape) // n)

    a = split.resolve_axis(shape)
    if split.axis is None and not fits(a):
        a = next((b for b in reversed(range(len(shape))) if fits(b)), a)
    split = dataclasses.replace(split, axis=a)
    return split, (q_size_on(a) if split.num_heads is None else None)


def qkv_part_ids(lay: QKVLayout) -> np.ndarray:
    """The part of every entry along the split axis: 0 = Q, 1 = K, 2 = V (int8, ``(n,)``)."""
    pq, pk, pv = lay.per_group
    block = np.concatenate([np.zeros(pq, np.int8), np.ones(pk, np.int8), np.full(pv, 2, np.int8)])
    return np.tile(block, lay.groups)


def _grouped(x: jax.Array, axis: int, lay: QKVLayout) -> jax.Array:
    """``x`` with its split axis reshaped to ``(G, per-group entries)``."""
    g = lay.groups
    return x.reshape(x.shape[:axis] + (g, x.shape[axis] // g) + x.shape[axis + 1:])


def split_qkv(kernel: jax.Array, split: "QKVSplit | None" = None, *, path: str = "qkv",
              layout: str | None = None, q_size: int | None = None,
              stack_axis: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Q, K and V parts of a fused kernel, each contiguous along the split axis.

    Along the split axis the parts come out head by head in model order (query
    head ``i`` of the interleaved layout belongs to key/value group
    ``i // (H / KVH)``); every other axis is untouched. :func:`merge_qkv` inverts it.

    Args:
      kernel: one layer's fused kernel, or a scan-stacked ``[..., L, ...]`` stack
        of them (then pass ``stack_axis``).
      split: the :class:`~jvitals.metrics.roles.QKVSplit` the roles use
        (``roles.qkv_split``); default ``QKVSplit()``.
      path: the kernel's path (for errors).
      layout: the layout when ``split.layout`` is None; pass
        ``roles.qkv_layout_of(path)`` to split exactly as the roles do.
      q_size: see :func:`qkv_layout`.
      stack_axis: the layer axis of a scan-stacked kernel (None: one layer).

    Returns:
      ``(q, k, v)`` (``jnp`` arrays; traceable under ``jit``).

    Example:
      >>> q, k, v = split_qkv(w, roles.qkv_split, layout=roles.qkv_layout_of(path))
      >>> w2 = merge_qkv((q * s, k * s, v), roles.qkv_split, layout=roles.qkv_layout_of(path))
    """
    kernel = jnp.asarray(kernel)
    shape = tuple(kernel.shape)
    layer_shape = shape if stack_axis is None else shape[:stack_axis] + shape[stack_axis + 1:]
    lay = qkv_layout(layer_shape, split, path=path, layout=layout, q_size=q_size)
    dim = lay.axis + 1 if stack_axis is not None and lay.axis >= stack_axis else lay.axis
    if lay.layout == "contiguous":
        nq, nk, _ = lay.sizes
        return (lax.slice_in_dim(kernel, 0, nq, axis=dim), lax.slice_in_dim(kernel, nq, nq + nk, axis=dim),
                lax.slice_in_dim(kernel, nq + nk, lay.n, axis=dim))
    pq, pk, _ = lay.per_group
    xg = _grouped(kernel, dim, lay)  # [..., G, per group, ...]
    parts = (lax.slice_in_dim(xg, 0, pq, axis=dim + 1), lax.slice_in_dim(xg, pq, pq + pk, axis=dim + 1),
             lax.slice_in_dim(xg, pq + pk, xg.shape[dim + 1], axis=dim + 1))
    return tuple(p.reshape(shape[:dim] + (p.shape[dim] * p.shape[dim + 1],) + shape[dim + 1:])
                 for p in parts)


def merge_qkv(parts: Sequence[jax.Array], split: "QKVSplit | None" = None, *,
              path: str = "qkv", layout: str | None = None, q_size: int | None = None,
              stack_axis: int | None = None, fused_shape: Sequence[int] | None = None) -> jax.Array:
    """The fused kernel whose :func:`split_qkv` (same arguments) is ``(q, k, v)``.

    ``merge_qkv(split_qkv(w, s, ...), s, ..., fused_shape=w.shape) == w`` exactly
    (the entries are only permuted).

    Args:
      parts: ``(q, k, v)``, as :func:`split_qkv` returns them.
      split, path, layout, q_size, stack_axis: as for :func:`split_qkv`.
      fused_shape: the fused kernel's shape; needed when Q, K and V have equal
        sizes (default: the parts concatenated along the one axis on which their
        sizes differ, grouped-query).

    Returns:
      The fused kernel.
    """
    q, k, v = (jnp.asarray(t) for t in parts)
    if split is None:
        from jvitals.metrics.roles import QKVSplit
        split = QKVSplit()
    if fused_shape is None:
        diff = [i for i in range(q.ndim) if not q.shape[i] == k.shape[i] == v.shape[i]]
        if len(diff) != 1:
            raise ValueError(
                f"merge_qkv: parts of shapes {q.shape}, {k.shape}, {v.shape} do not say which axis was "
                f"split (equal Q, K and V sizes fit several); pass fused_shape= (the fused kernel's shape).")
        d = diff[0]
        fused_shape = q.shape[:d] + (q.shape[d] + k.shape[d] + v.shape[d],) + q.shape[d + 1:]
    fused_shape = tuple(fused_shape)
    layer_shape = fused_shape if stack_axis is None else fused_shape[:stack_axis] + fused_shape[stack_axis + 1:]
    lay = qkv_layout(layer_shape, split, path=path, layout=layout, q_size=q_size)
    dim = lay.axis + 1 if stack_axis is not None and lay.axis >= stack_axis else lay.axis
    if lay.layout == "contiguous":
        return jnp.concatenate([q, k, v], axis=dim)
    parts = [_grouped(t, dim, lay) for t in (q, k, v)]
    return jnp.concatenate(parts, axis=dim + 1).reshape(fused_shape)


def _spec_axes_at(spec: Any, dim: int, ndim: int, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes (of ``axes``) that ``spec`` shards dimension ``dim`` along, in order."""
    if spec is None or dim >= len(spec):
        return ()
    entry = spec[dim]
    if entry is None:
        return ()
    entry = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
    return tuple(a for a in entry if a in axes)


def _global_shape(shape: tuple[int, ...], spec: Any, axes: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(d * math.prod(lax.axis_size(m) for m in _spec_axes_at(spec, i, len(shape), axes))
                 for i, d in enumerate(shape))


def _layer_shape(gshape: tuple[int, ...], lr: LeafRole) -> tuple[int, ...]:
    if lr.stack_axis is None:
        return gshape
    return gshape[: lr.stack_axis] + gshape[lr.stack_axis + 1:]


def _attn_module(path: str) -> str:
    parts = path.split("/")
    if parts[-1] in ("kernel", "weight", "w"):
        parts = parts[:-1]
    return "/".join(parts[:-1])


def out_proj_sizes(infos: Sequence[LeafRole], shapes: Sequence[tuple[int, ...]], specs: Sequence[Any] | None,
                   axes: tuple[str, ...]) -> dict[str, int]:
    """Per-layer element count of each attention module's output projection (role ``o``),
    keyed by the module's path: the Q width a fused QKV kernel is split with when no head
    counts are given (:func:`fused_pieces`). ``shapes`` are the leaves' local shapes,
    ``specs`` their ``PartitionSpec`` (None: as JAX's types say, over ``axes``)."""
    out: dict[str, int] = {}
    for i, (lr, shape) in enumerate(zip(infos, shapes)):
        if lr.role == "o":
            gs = _global_shape(shape, specs[i] if specs is not None else None, axes)
            out.setdefault(_attn_module(lr.path), math.prod(_layer_shape(gs, lr)))
    return out


def _pair_axis(shape: tuple[int, ...], axis: int | None) -> int:
    """The split axis of a two-way fused kernel: ``axis`` if given, else the first axis of
    size 2 of a kernel of rank > 2 (not the last), else the larger axis of a 2-D kernel
    (the last on a tie), else the last."""
    if axis is not None:
        return axis
    if len(shape) > 2 and 2 in shape[:-1]:
        return shape.index(2)
    if len(shape) == 2 and shape[0] > shape[1]:
        return 0
    return len(shape) - 1


def kv_layout(shape: Sequence[int], path: str = "kv", axis: int | None = None) -> QKVLayout:
    """Where K and V lie in one layer's K/V kernel (role ``kv``): a :class:`QKVLayout`
    with no Q part (sizes ``(0, n / 2, n / 2)``).

    K and V are stacked on the first axis of size 2 of a kernel of rank > 2 (Gemma's
    ``kv_einsum`` ``[2, KVH, D, Dh]``: ``[0]`` is K, ``[1]`` is V), or are the two
    halves ``[K | V]`` of the larger axis of a 2-D kernel (``[D, 2 * KVH * Dh]``; the
    last axis on a tie). ``axis`` (a :attr:`~jvitals.metrics.roles.Roles.fused_axes`
    rule's) overrides the shape's guess.

    Raises:
      ValueError: if the axis does not split into two equal halves.
    """
    lay = pair_layout(shape, path, axis, role="kv")
    return QKVLayout(lay.axis, "contiguous", (0,) + lay.sizes[:2])


_PAIR_WORDS = {"kv": ("K/V", "K and V", "[2, KVH, D, Dh]", "[K | V]"),
               "gate_up": ("gate/up", "gate and up", "[2, F, D]", "[gate | up]"),
               "up_gate": ("up/gate", "up and gate", "[2, F, D]", "[up | gate]")}


def pair_layout(shape: Sequence[int], path: str = "fused", axis: int | None = None,
                role: str = "gate_up") -> QKVLayout:
    """Where the two parts of one layer's two-way fused kernel lie (roles ``kv``,
    ``gate_up``, ``up_gate``; :data:`~jvitals.metrics.roles.FUSED_PARTS` names them):
    sizes ``(n / 2, n / 2, 0)`` along the split axis, first part first.

    The parts are stacked on an axis of size 2 (Gemma's ``gating_einsum`` ``[2, F, D]``,
    ``[E, 2, F, D]`` for its experts; MaxText's fused ``wi`` ``[D, 2, F]``) or are the two
    halves of one axis (OLMo's ``ff_proj`` ``[2F, D]``, Phi-3's ``gate_up_proj``). The
    axis: ``axis`` if given (a :attr:`~jvitals.metrics.roles.Roles.fused_axes` rule's),
    else the first axis of size 2 of a kernel of rank > 2, else the larger axis of a 2-D
    kernel (the last on a tie), else the last.

    Raises:
      ValueError: if the axis does not split into two equal halves.
    """
    shape = tuple(int(d) for d in shape)
    a = _pair_axis(shape, axis)
    n = shape[a] if shape else 0
    if n < 2 or n % 2:
        what, parts, stacked, halves = _PAIR_WORDS.get(role, ("fused", "its two parts", "[2, ...]", "halves"))
        raise ValueError(
            f"{what} kernel {path!r} of shape {shape}: expected {parts} stacked on an axis of size 2 "
            f"({stacked}) or two equal halves {halves} of one axis, got {n} entries on axis {a}. If it is "
            f"not a fused {what} kernel, give it its own role, e.g. Roles().extend(up=r'(^|/)your_module/w$'); "
            f"if its parts lie on another axis, Roles(fused_axes=((r'(^|/)your_module', AXIS),) + "
            f"DEFAULT_FUSED_AXES).")
    return QKVLayout(a, "contiguous", (n // 2, n // 2, 0))


def fused_pieces(x: jax.Array, lr: LeafRole, roles: Roles, spec: Any, axes: tuple[str, ...],
                 out_sizes: Mapping[str, int]) -> list[tuple[str, jax.Array, jax.Array | None, int | None]]:
    """The parts of a fused kernel (a role of :data:`~jvitals.metrics.roles.FUSED_PARTS`:
    Q, K and V of ``qkv``; K and V of ``kv``; gate and up of ``gate_up``/``up_gate``), as
    ``(name, x, mask, axis)`` to summarise (per layer if stacked), in the layout ``roles``
    gives its path; ``out_sizes`` from :func:`out_proj_sizes` (a QKV kernel's Q width)."""
    from jvitals.metrics.roles import FUSED_PARTS
    o_numel = out_sizes.get(_attn_module(lr.path))
    shape = tuple(x.shape)  # local (per-shard) inside shard_map
    gshape = _global_shape(shape, spec, axes)
    layer_shape = _layer_shape(gshape, lr)
    rule = roles.fused_axis_of(lr.path, layer_shape)
    if lr.role == "qkv":
        split = roles.qkv_split
        if rule is not None and split.axis is None:
            split = dataclasses.replace(split, axis=rule)
        split, q_size = resolve_fused(layer_shape, split, o_numel)
        lay = qkv_layout(layer_shape, split, path=lr.path, layout=roles.qkv_layout_of(lr.path),
                         q_size=q_size)
    else:
        lay = pair_layout(layer_shape, lr.path, rule, role=lr.role)
    names = FUSED_PARTS[lr.role] + ("",) * (3 - len(FUSED_PARTS[lr.role]))
    return [p for p, size in zip(_layout_pieces(x, lr, lay, spec, axes, names), lay.sizes) if size]


def _layout_pieces(x: jax.Array, lr: LeafRole, lay: QKVLayout, spec: Any, axes: tuple[str, ...],
                   names: tuple[str, str, str] = ("Wq", "Wk", "Wv"),
                   ) -> list[tuple[str, jax.Array, jax.Array | None, int | None]]:
    """The three parts of ``x`` in ``lay`` named ``names`` (``Wq``, ``Wk``, ``Wv``; a slice
    each, or the whole shard with a mask where the split axis is sharded)."""
    shape = tuple(x.shape)
    a, n = lay.axis, lay.n
    dim = a + 1 if lr.stack_axis is not None and a >= lr.stack_axis else a
    local_n = shape[dim]
    mesh = _spec_axes_at(spec, dim, len(shape), axes)
    ax = lr.stack_axis
    out = []
    if not mesh:
        if lay.layout == "contiguous":
            nq, nk, _ = lay.sizes
            bounds = ((0, nq), (nq, nq + nk), (nq + nk, n))
            for name, (lo, hi) in zip(names, bounds):
                out.append((name, lax.slice_in_dim(x, lo, hi, axis=dim), None, ax))
            return out
        # Interleaved: the split axis as (G, per group); each part is a slice of the latter.
        pq, pk, _ = lay.per_group
        xg = _grouped(x, dim, lay)
        gax = ax + 1 if ax is not None and ax > dim else ax
        bounds = ((0, pq), (pq, pq + pk), (pq + pk, xg.shape[dim + 1]))
        for name, (lo, hi) in zip(names, bounds):
            out.append((name, lax.slice_in_dim(xg, lo, hi, axis=dim + 1), None, gax))
        return out
    # Sharded along the split axis: each shard holds a block of global entries.
    idx = jnp.zeros((), jnp.int32)
    for m in mesh:
        idx = idx * lax.axis_size(m) + lax.axis_index(m)
    col = idx * local_n + jnp.arange(local_n, dtype=jnp.int32)
    part = jnp.asarray(qkv_part_ids(lay))[col]
    bshape = [1] * len(shape)
    bshape[dim] = local_n
    for j, name in enumerate(names):
        out.append((name, x, (part == j).reshape(bshape), ax))
    return out
