"""Fused QKV kernels: where the Q, K and V parts of one fused projection lie.

One concern: given a fused kernel (``c_attn``, ``query_key_value``, ``qkv``...) and
its :class:`~jvitals.roles.QKVSplit`, say which entries are Q, K and V, so that
:func:`~jvitals.gradients.gradient_metrics` summarises each part on its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from jvitals.roles import LeafRole, Roles



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


def _o_sizes(infos: Sequence[LeafRole], gshapes: Sequence[tuple[int, ...]]) -> dict[str, int]:
    """Per-layer element count of each attention module's output projection."""
    out: dict[str, int] = {}
    for lr, gs in zip(infos, gshapes):
        if lr.role == "o":
            out.setdefault(_attn_module(lr.path), math.prod(_layer_shape(gs, lr)))
    return out


def _qkv_pieces(x: jax.Array, lr: LeafRole, roles: Roles, spec: Any, axes: tuple[str, ...],
                o_numel: int | None = None) -> list[tuple[str, jax.Array, jax.Array | None, int | None]]:
    """Q, K and V parts of a fused QKV kernel, as ``(name, x, mask, axis)`` to summarise
    (per layer if stacked)."""
    shape = tuple(x.shape)  # local (per-shard) inside shard_map
    gshape = _global_shape(shape, spec, axes)
    stacked = lr.stack_axis is not None
    layer_shape = _layer_shape(gshape, lr)
    a = roles.qkv_split.resolve_axis(layer_shape)
    dim = a + 1 if stacked and a >= lr.stack_axis else a
    local_n = shape[dim]
    mesh = _spec_axes_at(spec, dim, len(shape), axes)
    n = gshape[dim]
    q_size = None
    if o_numel is not None:
        d_in = math.prod(layer_shape) // n
        if d_in > 0 and o_numel % d_in == 0:
            q_size = o_numel // d_in
    nq, nk, nv = roles.qkv_split.sizes(n, lr.path, f"axis {a} of its per-layer shape {layer_shape}", q_size)
    bounds = ((0, nq), (nq, nq + nk), (nq + nk, n))
    ax = lr.stack_axis
    out = []
    if not mesh:
        for name, (lo, hi) in zip(("Wq", "Wk", "Wv"), bounds):
            out.append((name, lax.slice_in_dim(x, lo, hi, axis=dim), None, ax))
        return out
    # Sharded along the split axis: each shard holds a block of global columns.
    idx = jnp.zeros((), jnp.int32)
    for m in mesh:
        idx = idx * lax.axis_size(m) + lax.axis_index(m)
    col = idx * local_n + jnp.arange(local_n, dtype=jnp.int32)
    bshape = [1] * len(shape)
    bshape[dim] = local_n
    for name, (lo, hi) in zip(("Wq", "Wk", "Wv"), bounds):
        mask = ((col >= lo) & (col < hi)).reshape(bshape)
        out.append((name, x, mask, ax))
    return out
