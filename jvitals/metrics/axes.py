"""Mesh axes: which manual axes are bound here, which ones an array varies along or is
sharded along, and the ``psum``/``pmax`` over exactly those.

Inside ``shard_map`` a leaf's statistic must be reduced over the axes the leaf is
sharded along (with ``specs``) or, without specs, the axes JAX's type system says it
varies along; under ``pmap`` (where JAX does not track it) every named axis.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax
from jax import lax
from jax.sharding import PartitionSpec

__all__ = [
    "bound_axes",
    "check_axes",
    "make_varying",
    "varying_axes",
    "sharded_axes",
    "reduction_axes",
    "psum_over",
    "pmax_over",
    "NO_SPEC",
    "reduce_axes",
    "manual_varying",
]


NO_SPEC = object()   # "no spec given": reduce over the axes the value varies along


def manual_varying(x: Any) -> frozenset[str] | None:
    """The manual mesh axes ``x`` varies along, or None if JAX does not say.

    jax >= 0.10 records it as ``jax.typeof(x).manual_axis_type.varying``; some
    earlier releases as ``jax.typeof(x).vma``. Both are tried, so a rename fails
    soft (to "unknown") rather than hard.
    """
    try:
        aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    except Exception:  # pragma: no cover - very old JAX
        return None
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    return None


def bound_axes() -> tuple[str, ...]:
    """Names of the manual mesh axes bound here (inside ``shard_map``/``pmap``)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover
        return ()
    names = getattr(mesh, "manual_axes", None)
    if names is None:
        names = getattr(mesh, "axis_names", ())
    return tuple(names or ())


def check_axes(axes: Iterable[str] | str) -> tuple[str, ...]:
    """Normalise ``axes`` to a tuple and check that each name is bound here.

    Raises:
      TypeError: ``axes`` is not names (an int, None).
      ValueError: naming the unbound axis and the bound ones.
    """
    if isinstance(axes, str):
        axes = (axes,)
    if axes is None or not all(isinstance(a, str) for a in (axes if isinstance(axes, Iterable) else [axes])):
        raise TypeError(f"axes={axes!r}: expected mesh axis names, e.g. axes=('data',) inside shard_map "
                        f"(a name, not an index or a size), or axes=() under plain jit")
    axes = tuple(axes)
    bound = bound_axes()
    for a in axes:
        if a in bound:
            continue
        try:  # vmap/pmap names that the abstract mesh does not list
            lax.axis_size(a)
        except NameError:
            raise ValueError(
                f"mesh axis {a!r} is not bound here; bound axes: {list(bound)}. "
                "Call this inside jax.shard_map (or pmap) over a mesh with that axis, "
                "or pass axes=() under plain jit, where arrays are global."
            ) from None
    return axes


def _tracks_varying(axis: str) -> bool:
    """Whether JAX tracks varying axes here (shard_map with check_vma=True)."""
    v = manual_varying(lax.axis_index(axis))
    return v is not None and axis in v


def varying_axes(x: jax.Array, axes: Sequence[str]) -> tuple[str, ...]:
    """Axes of ``axes`` along which ``x`` varies, as JAX's type system records it.

    Where JAX does not track it (``shard_map(check_vma=False)``, ``pmap``), every
    axis of ``axes`` is assumed to vary (pmap semantics: pass ``specs`` to say
    otherwise).
    """
    if not axes:
        return ()
    v = manual_varying(x)
    if v is None or not _tracks_varying(axes[0]):
        return tuple(axes)
    return tuple(a for a in axes if a in v)


def sharded_axes(spec: PartitionSpec | None, axes: Sequence[str]) -> tuple[str, ...]:
    """Axes of ``axes`` that ``spec`` shards along (a ``None`` spec: replicated)."""
    if spec is None:
        return ()
    named: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        if isinstance(entry, (tuple, list)):
            named.update(entry)
        else:
            named.add(entry)
    return tuple(a for a in axes if a in named)


def reduction_axes(x: jax.Array, axes: tuple[str, ...], spec: Any, has_specs: bool) -> tuple[str, ...]:
    """The axes of ``axes`` a summary of the leaf ``x`` must be reduced over.

    With specs (``has_specs``): those ``spec`` shards it along (``None``:
    replicated), less any it is, by type, invariant along; without: those it
    varies along (all of ``axes`` where JAX does not track it, as under ``pmap``).
    """
    return reduce_axes([x], tuple(axes), spec if has_specs else NO_SPEC)


def reduce_axes(leaves: Sequence[jax.Array], axes: tuple[str, ...], spec: Any) -> tuple[str, ...]:
    """The axes a value (given as its arrays) must be reduced over.

    Without a spec: the axes any of ``leaves`` varies along (a count built from
    a constant mask is invariant even though the data it counts varies). With a
    spec: the axes it shards along, less those along which JAX knows every leaf
    is invariant (identical on every shard there: psum would multiply it).
    """
    if not axes:
        return ()
    tracked = _tracks_varying(axes[0])
    varying: set[str] = set()
    for leaf in leaves:
        v = manual_varying(leaf)
        if v is None:
            tracked = False
            break
        varying |= v
    if spec is NO_SPEC:
        return tuple(a for a in axes if a in varying) if tracked else axes
    wanted = sharded_axes(spec, axes)
    return tuple(a for a in wanted if a in varying) if tracked else wanted


def make_varying(x: jax.Array, red: tuple[str, ...]) -> jax.Array:
    """Mark ``x`` as varying along ``red`` so one collective can cover all of them."""
    v = manual_varying(x)
    if v is None or not _tracks_varying(red[0]):
        return x
    missing = tuple(a for a in red if a not in v)
    return lax.pcast(x, missing, to="varying") if missing else x



def psum_over(x: jax.Array, axes: Sequence[str], spec: Any = NO_SPEC) -> jax.Array:
    """``psum`` of ``x`` over the axes of ``axes`` it is sharded (or varies) along."""
    red = reduce_axes([x], tuple(axes), spec)
    return lax.psum(make_varying(x, red), red) if red else x


def pmax_over(x: jax.Array, axes: Sequence[str], spec: Any = NO_SPEC) -> jax.Array:
    """``pmax`` of ``x`` over the axes of ``axes`` it is sharded (or varies) along."""
    red = reduce_axes([x], tuple(axes), spec)
    return lax.pmax(make_varying(x, red), red) if red else x
