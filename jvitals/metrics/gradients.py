"""Gradient, parameter and update vitals from pytrees (METRICS.md §2-§3).

Every figure comes from one read of each leaf: a gradient, its parameter and its update
are measured together by one variadic reduction (:mod:`jvitals.metrics.fold`), reduced
over the mesh axes *that leaf* is sharded along, then merged per role, layer and group::

    global_norm   = sqrt(sum over leaves of sum g^2)
    share/layer_i = ||g_i||^2 / ||g||^2          {role}_rms = sqrt(sum_role g^2 / n_role)

A non-finite element makes every figure it enters NaN and is counted in
``nonfinite_count``. Families: :func:`global_norm_metrics`, :func:`norm_metrics` (the light
step), :func:`update_metrics`, :func:`gradient_metrics` (everything); :func:`tree_stats` and
the ``*_figures`` functions are the engine :mod:`jvitals.metrics.light` shares. Every formula,
the families and the CPU's form: docs/DEVICE.md, "gradients: one read per leaf".
"""

from __future__ import annotations

from typing import Any, Collection, Hashable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jvitals.metrics.qkv import fused_pieces, out_proj_sizes  # fused QKV: jvitals/metrics/qkv.py
from jvitals.metrics.roles import FUSED_PARTS, LeafRole, Roles, assign_roles, check_roles
from jvitals.metrics.checks import check_names, check_not_none, check_same_structure
from jvitals.metrics import fold
from jvitals.metrics import cpu_forms
from jvitals.metrics.clip_norm import norm_and_count, norm_as_optax, optax_form
from jvitals.metrics.stats import Summary, reduce, summarize_fields
from jvitals.metrics.axes import check_axes, reduction_axes

__all__ = [
    "GROUP_ROLES",
    "global_norm",
    "global_norm_metrics",
    "gradient_metrics",
    "norm_metrics",
    "tree_stats",
    "update_metrics",
]

_F32 = jnp.float32

GROUP_ROLES: Mapping[str, str] = {"embedding": "embedding", "lm_head": "lm_head"}
"""Role (of :mod:`jvitals.metrics.roles`) -> the non-layer group its leaves are reported in,
beside the per-layer families (``grad/norm/embedding``, ``update/param_ratio/lm_head``).
A head tied to the embedding has no leaf of its own, so no ``lm_head`` group."""


# ----------------------------------------------------------------------------------
# Mesh plumbing shared with moe.py / optimizer.py.


class _Box:
    """Holds a spec as an opaque leaf while broadcasting a specs prefix."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any):
        self.spec = spec


def flat_specs(tree: Any, specs: Any, what: str = "tree") -> list[Any] | None:
    """``specs`` (a pytree prefix of ``tree`` with ``PartitionSpec``/None leaves)
    broadcast to one spec per leaf of ``tree``, in flatten order (None if no specs)."""
    if specs is None:
        return None

    def is_spec(s: Any) -> bool:
        return s is None or isinstance(s, PartitionSpec)

    try:
        full = jax.tree.map(lambda sp, sub: jax.tree.map(lambda _: _Box(sp), sub), specs, tree, is_leaf=is_spec)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"specs must be a pytree of PartitionSpec (None = replicated) with the structure of the "
            f"{what} (or a prefix of it); they do not match: {e}") from None
    return [b.spec for b in jax.tree.leaves(full, is_leaf=lambda b: isinstance(b, _Box))]


class Accumulator:
    """Keyed summaries grouped by reduction axes; one packed collective per group."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, ...], dict[Hashable, Summary]] = {}

    def add(self, red: tuple[str, ...], key: Hashable, s: Summary) -> None:
        g = self.groups.setdefault(tuple(red), {})
        g[key] = g[key].merge(s) if key in g else s

    def result(self) -> dict[Hashable, Summary]:
        out: dict[Hashable, Summary] = {}
        for red, g in self.groups.items():
            if red:
                g = _reduce_packed(g, red)
            for k, s in g.items():
                out[k] = out[k].merge(s) if k in out else s
        return out


def _reduce_packed(g: Mapping[Hashable, Summary], red: tuple[str, ...]) -> dict[Hashable, Summary]:
    keys = list(g)
    shapes = [tuple(g[k].count.shape) for k in keys]
    sizes = [int(np.prod(s)) for s in shapes]
    fields = ("count", "sum", "sumsq", "abs_max", "nonfinite")
    packed = Summary(**{f: jnp.concatenate([jnp.ravel(getattr(g[k], f)) for k in keys]) for f in fields})
    packed = reduce(packed, red, specs=PartitionSpec(red))
    out = {}
    start = 0
    for k, shape, n in zip(keys, shapes, sizes):
        out[k] = Summary(**{f: getattr(packed, f)[start:start + n].reshape(shape) for f in fields})
        start += n
    return out


def _take(s: Summary, j: int) -> Summary:
    return jax.tree.map(lambda f: f[j], s)


def _float_leaves(tree: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _skip(x: Any) -> bool:
    return not hasattr(x, "dtype") or x.dtype == jax.dtypes.float0


# ----------------------------------------------------------------------------------
# One pass over the leaves of several trees.


class TreeStats:
    """Reduced summaries of one tree: global, per layer, per group, per role, per role and layer."""

    def __init__(self, res: Mapping[Hashable, Summary], stack_first: Mapping[str, int]):
        self.all: Summary = res.get("all", Summary.empty())
        self.layers: dict[int, Summary] = {}
        self.groups: dict[str, Summary] = {}
        self.roles: dict[str, Summary] = {}
        self.role_layers: dict[str, dict[int, Summary]] = {}
        for key, s in res.items():
            if key != "all":
                self._file(key, s, stack_first)

    def _file(self, key: tuple, s: Summary, stack_first: Mapping[str, int]) -> None:
        """Put one accumulated summary under its key (a stacked one: one entry per layer)."""
        kind = key[0]
        if kind == "group":
            self.groups[key[1]] = s
        elif kind == "role":
            self.roles[key[1]] = s
        elif kind in ("layer", "role_layer"):
            d = self.layers if kind == "layer" else self.role_layers.setdefault(key[1], {})
            _put(d, key[-1], s)
        elif kind in ("stack", "role_stack"):
            d = self.layers if kind == "stack" else self.role_layers.setdefault(key[1], {})
            first = stack_first[key[-1]]
            for j in range(s.count.shape[0]):
                _put(d, first + j, _take(s, j))


class Leaf(NamedTuple):
    """One leaf position of the trees: its role (None: global figures only) and spec."""

    index: int
    role: LeafRole | None
    spec: Any


def plan_leaves(ref: Any, *, roles: Roles, specs: Any, axes: tuple[str, ...], need_roles: bool, split_qkv: bool,
                what: str) -> tuple[list[Leaf], dict[str, int], bool]:
    """The leaves to measure (float leaves of ``ref``) with their roles and specs, the
    per-layer size of each attention output projection (to split fused QKV kernels),
    and whether specs were given."""
    leaves = _float_leaves(ref)
    infos = assign_roles(ref, roles) if need_roles else None
    sp = flat_specs(ref, specs, what)
    o_sizes: dict[str, int] = {}
    if split_qkv and infos is not None and any(lr.role == "qkv" for lr in infos):
        o_sizes = out_proj_sizes(infos, [tuple(getattr(x, "shape", ())) for _, x in leaves], sp, axes)
    plan = [Leaf(i, None if infos is None else infos[i], None if sp is None else sp[i])
            for i, (_, x) in enumerate(leaves) if not _skip(x)]
    return plan, o_sizes, sp is not None


def _pieces(x: jax.Array, leaf: Leaf, roles: Roles, axes: tuple[str, ...], o_sizes: Mapping[str, int],
            split_qkv: bool) -> list[tuple[str | None, jax.Array, jax.Array | None, int | None]]:
    """``(role name, array, mask, layer axis)`` parts of one leaf: a fused QKV kernel's
    Q, K and V when ``split_qkv``, else the leaf itself."""
    lr = leaf.role
    if lr is None:
        return [(None, x, None, None)]
    if split_qkv and lr.role in FUSED_PARTS:  # qkv, kv, gate_up, up_gate: split first
        return fused_pieces(x, lr, roles, leaf.spec, axes, o_sizes)
    return [(lr.name, x, None, lr.stack_axis)]


def _tree_stats(trees: Mapping[str, Any], *, role_tree: str | None, layered: Sequence[str], roles: Roles | None,
                specs: Any, axes: Sequence[str] | str, what: str, plain: bool = False) -> dict[str, TreeStats]:
    """:class:`TreeStats` of each tree of ``trees`` (same structure), in one read of each leaf.

    For every leaf position, the leaf of each tree is measured by one variadic
    reduction (``fold.py``; leaves of one shape share it): the tree ``role_tree``
    fully (sum, sumsq, max|x|, non-finite count; per role, a fused QKV kernel as
    its Q, K and V parts), the others for their norms (sumsq, non-finite count).
    Trees in ``layered`` also get their per-layer and per-group figures. So a
    gradient, its parameter and its update are read once each, by one kernel.
    Each leaf's summaries are then reduced over the mesh axes it is sharded along.

    Args:
      trees: ``{name: pytree}``, every tree with the structure of the first.
      role_tree: the tree measured per role, or None.
      layered: the trees with per-layer and per-group figures.
      roles, specs, axes, what: as :func:`gradient_metrics` takes them.
      plain: measure each piece by plain reductions (:func:`~jvitals.metrics.cpu_forms.plain_summaries`:
        XLA:CPU's fastest form) instead of one variadic reduction per leaf; under ``jit`` only.

    Returns:
      ``{name: TreeStats}``.
    """
    axes = check_axes(axes)
    roles = Roles() if roles is None else roles
    names = list(trees)
    ref = trees[names[0]]
    split = role_tree is not None
    plan, o_sizes, has_specs = plan_leaves(ref, roles=roles, specs=specs, axes=axes,
                                     need_roles=split or bool(layered), split_qkv=split, what=what)
    flat = {n: [x for _, x in _float_leaves(t)] for n, t in trees.items()}
    items, owners = [], []
    for leaf in plan:
        for n in names:
            x = flat[n][leaf.index]
            if _skip(x):
                continue
            fields = ROLE_FIELDS if n == role_tree else fold.SUMSQ
            parts = _pieces(x, leaf, roles, axes, o_sizes, split and n == role_tree)
            red = reduction_axes(x, axes, leaf.spec, has_specs)
            owners.append((n, leaf, red, [name for name, *_ in parts]))
            # One kernel per leaf position (its gradient, parameter and update):
            # kernels over several leaves would keep them all live at once.
            items.extend((px, pm, pa, fields, leaf.index) for _, px, pm, pa in parts)
    summaries = iter(cpu_forms.plain_summaries(items) if plain else summarize_fields(items))
    accs = {n: Accumulator() for n in names}
    stack_first: dict[str, int] = {}
    for n, leaf, red, part_names in owners:
        pieces = [(name, next(summaries)) for name in part_names]
        if leaf.role is not None and leaf.role.stack is not None:
            stack_first[leaf.role.stack] = leaf.role.first_layer
        _add_leaf(accs[n], red, leaf.role, pieces, layered=n in layered, by_role=n == role_tree)
    return {n: TreeStats(accs[n].result(), stack_first) for n in names}


ROLE_FIELDS = ("sumsq", "abs_max", "nonfinite")
"""What the role tree's pieces are measured for: no figure reads their plain sum."""


def _add_leaf(acc: Accumulator, red: tuple[str, ...], lr: LeafRole | None,
              pieces: Sequence[tuple[str | None, Summary]], *, layered: bool, by_role: bool) -> None:
    """Add one leaf's summaries to the keys they count in: ``"all"``; per layer (or
    stack) and group when ``layered``; per role (and role x layer) when ``by_role``."""
    merged = pieces[0][1]
    for _, s in pieces[1:]:
        merged = merged.merge(s)
    stacked = lr is not None and lr.stack is not None
    acc.add(red, "all", merged.total() if stacked else merged)
    if lr is None:
        return
    if layered and lr.role in GROUP_ROLES:
        acc.add(red, ("group", GROUP_ROLES[lr.role]), merged.total() if stacked else merged)
    if layered and stacked:
        acc.add(red, ("stack", lr.stack), merged)
    elif layered and lr.layer is not None:
        acc.add(red, ("layer", lr.layer), merged)
    if not by_role:
        return
    for name, s in pieces:
        if name is None:  # a leaf no role matches: global and per-layer figures only
            continue
        acc.add(red, ("role", name), s.total() if stacked else s)
        if layered and stacked:
            acc.add(red, ("role_stack", name, lr.stack), s)
        elif layered and lr.layer is not None:
            acc.add(red, ("role_layer", name, lr.layer), s)


def tree_stats(trees: Mapping[str, Any], *, role_tree: str | None = None, layered: Sequence[str] = (),
               roles: Roles | None = None, specs: Any = None, axes: Sequence[str] | str = (),
               what: str = "tree") -> dict[str, TreeStats]:
    """:func:`_tree_stats` over the trees, grouped by structure (None trees left out):
    trees of one structure are read in one pass, leaf by leaf."""
    by_def: dict[Any, dict[str, Any]] = {}
    for n, t in trees.items():
        if t is not None:
            _check_arrays(t, n if n != "tree" else what)
            by_def.setdefault(jax.tree.structure(t), {})[n] = t
    out: dict[str, TreeStats] = {}
    for group in by_def.values():
        rt = role_tree if role_tree in group else None
        out.update(_tree_stats(group, role_tree=rt, layered=[n for n in layered if n in group], roles=roles,
                               specs=specs, axes=axes, what=what))
    return out


def _check_arrays(tree: Any, what: str) -> None:
    """TypeError naming the first leaf of ``tree`` that is not an array (a str, a Python int)."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(x, "dtype"):
            raise TypeError(f"{what}: the leaf at {jax.tree_util.keystr(path) or 'the root'} is {type(x).__name__} "
                            f"{x!r:.40}, not an array; pass a pytree of arrays (e.g. the gradients jax.grad returns)")


def plain_grad_figures(grads: Any, *, roles: Roles | None = None, prefix: str = "grad") -> dict[str, jax.Array]:
    """:func:`gradient_metrics`' gradient figures (per layer, group and role) under ``jit``,
    each piece measured by plain reductions (:func:`~jvitals.metrics.cpu_forms.plain_summaries`): XLA:CPU's fastest
    form, the recorder's heavy step there. Same names and values as ``gradient_metrics(grads,
    roles=roles)`` (float32 rounding apart); no mesh axes."""
    t = _tree_stats({"grads": grads}, role_tree="grads", layered=["grads"], roles=roles, specs=None, axes=(),
                    what="grads", plain=True)["grads"]
    return grad_figures(t, prefix, per_layer=True, per_role=True)


def _put(d: dict, k: Any, s: Summary) -> None:
    d[k] = d[k].merge(s) if k in d else s


def nonfinite_count(s: Summary) -> jax.Array:
    """``#(x is NaN or Inf)`` of a summary, as the ``*/nonfinite_count`` figures report it (int32)."""
    return s.nonfinite.astype(jnp.int32)


# ----------------------------------------------------------------------------------
# Public functions.


def global_norm(tree: Any, *, specs: Any = None, axes: Sequence[str] | str = ()) -> jax.Array:
    """L2 norm of every element of ``tree``, ``sqrt(sum_leaves sum x^2)``, in float32.

    Equal to ``optax.global_norm`` on global arrays; NaN if any element is non-finite.
    Inside ``shard_map`` each leaf's sum of squares is psum-ed over the axes of
    ``axes`` it is sharded along (``specs``) or varies along.
    """
    check_not_none(tree, "global_norm", "tree", "a pytree of arrays")
    return tree_stats({"tree": tree}, specs=specs, axes=axes)["tree"].all.norm


def global_norm_metrics(tree: Any, *, specs: Any = None, axes: Sequence[str] | str = (),
                        prefix: str = "grad", suffix: str = "") -> dict[str, jax.Array]:
    """The cheap every-step family: global norm and non-finite count.

    ``{prefix}/global_norm{suffix} = sqrt(sum g^2)`` (NaN if any non-finite),
    ``{prefix}/nonfinite_count{suffix} = #non-finite elements``; one read of each leaf
    (under ``jit``, float32: a sum of squares per leaf as optax writes it, the count
    only when the norm is not finite; see :func:`norm_metrics`).

    Args:
      tree: gradients (or any pytree of arrays).
      specs: optional pytree of ``PartitionSpec`` (a prefix of ``tree``; None =
        replicated) saying which mesh axes each leaf is sharded along.
      axes: mesh axes bound by the enclosing ``shard_map``; ``()`` under ``jit``.
      prefix, suffix: name parts; the recorder's post-clip family uses
        ``suffix='_post_clip'`` for ``grad/global_norm_post_clip``.

    Returns:
      ``{name: float32 scalar}`` (the count is int32).

    Example:
      >>> global_norm_metrics({"w": jnp.array([3.0, 4.0])})["grad/global_norm"]
      Array(5., dtype=float32)
    """
    check_not_none(tree, "global_norm_metrics", "tree", "a pytree of arrays (the gradients)")
    if not (isinstance(prefix, str) and isinstance(suffix, str)):
        raise TypeError(f"global_norm_metrics: prefix={prefix!r}, suffix={suffix!r} must be str (the figures' names)")
    if optax_form(tree, check_axes(axes)):  # under jit: as norm_metrics takes it
        n, count = norm_and_count(tree)
        return {f"{prefix}/global_norm{suffix}": n, f"{prefix}/nonfinite_count{suffix}": count}
    s = tree_stats({"tree": tree}, specs=specs, axes=axes)["tree"].all
    return {f"{prefix}/global_norm{suffix}": s.norm, f"{prefix}/nonfinite_count{suffix}": nonfinite_count(s)}


def norm_metrics(grads: Any, params: Any = None, updates: Any = None, *, specs: Any = None,
                 axes: Sequence[str] | str = ()) -> dict[str, jax.Array]:
    """The global norms of the gradients, parameters and updates: the recorder's light step.

    ``grad/global_norm = ||g||`` (NaN if any element is non-finite),
    ``grad/nonfinite_count``; with ``params`` ``param/global_norm = ||p||``; with
    ``updates`` ``update/global_norm = ||u||``, ``update/nonfinite_count`` and, with
    both, ``update/param_ratio = ||u|| / ||p||``.

    Under ``jit`` (no mesh axes bound), with float32 gradients and parameters:

    - the gradients' norm is written as optax writes it (``optax.tree.norm``: one
      ``sum(g^2)`` per leaf), so a clip (``optax.clip_by_global_norm``) on the same
      gradients and this norm are one computation to XLA: no read of its own. Their
      non-finite count is 0 when the norm is finite and is counted only when it is
      not: on the CPU under a ``lax.cond`` (no host round trip there; a healthy step
      skips the count's read), on other backends beside the norm and selected
      (XLA:GPU and TPU fuse the count with the norm's reduction of the same tensor;
      a conditional would make a GPU step wait on the host for its predicate);
    - the parameters' norm is a plain sum per leaf (vectorised on XLA:CPU);
    - the updates' norm and non-finite count are one variadic reduction per leaf
      (:mod:`jvitals.metrics.fold`), which XLA fuses with the optimizer's last
      elementwise step. A plain sum would take the update written out on XLA:CPU
      (no multi-output fusion): 2 x the parameters' bytes more, a parameter-sized
      buffer, and slower beside a large model (``benchmarks/light_forms.py``).

    Otherwise (inside ``shard_map``, or other dtypes) a gradient, its parameter and
    its update are measured by one variadic reduction per leaf, each reduced over
    the mesh axes it is sharded along.

    Args:
      grads: the gradients.
      params: the parameters (None: no ``param/*``).
      updates: the updates (None: no ``update/*``).
      specs: ``PartitionSpec`` pytree (prefix) of the trees (inside ``shard_map``).
      axes: bound mesh axes; ``()`` under ``jit``.

    Returns:
      ``{name: scalar}`` (counts int32).
    """
    axes = check_axes(axes)
    trees = {"grads": grads, "params": params, "updates": updates}
    if optax_form(grads, axes) and (params is None or optax_form(params, axes)):
        return _norms_under_jit(grads, params, updates)
    t = tree_stats(trees, specs=specs, axes=axes, what="grads")
    out = {"grad/global_norm": t["grads"].all.norm, "grad/nonfinite_count": nonfinite_count(t["grads"].all)}
    if params is not None:
        out["param/global_norm"] = t["params"].all.norm
    if updates is not None:
        out["update/global_norm"] = t["updates"].all.norm
        out["update/nonfinite_count"] = nonfinite_count(t["updates"].all)
        if params is not None:
            out["update/param_ratio"] = (t["updates"].all.norm / t["params"].all.norm).astype(_F32)
    return out


def _norms_under_jit(grads: Any, params: Any, updates: Any) -> dict[str, jax.Array]:
    """:func:`norm_metrics` under ``jit`` for float32 gradients and parameters (its
    docstring says how each tree is read)."""
    g, count = norm_and_count(grads)
    out = {"grad/global_norm": g, "grad/nonfinite_count": count}
    if params is not None:
        out["param/global_norm"] = norm_as_optax(params)[0]
    if updates is not None:
        s = tree_stats({"updates": updates}, what="updates")["updates"].all
        u = s.norm
        out["update/global_norm"] = u
        out["update/nonfinite_count"] = nonfinite_count(s)
        if params is not None:
            out["update/param_ratio"] = u / out["param/global_norm"]
    return out


def update_metrics(updates: Any, params: Any = None, *, specs: Any = None, axes: Sequence[str] | str = (),
                   prefix: str = "update") -> dict[str, jax.Array]:
    """Norm of the final update and its size relative to the parameters.

    ``update/global_norm = ||u||``, ``update/param_ratio = ||u|| / ||p||``,
    ``update/nonfinite_count``; one read of each leaf of both trees.

    Args:
      updates: the optimizer's output updates (what ``optax.apply_updates`` adds).
      params: the parameters the updates apply to (None: no ratio).
      specs: ``PartitionSpec`` pytree (prefix) shared by updates and params.
      axes: bound mesh axes (``shard_map``); ``()`` under ``jit``.
      prefix: name prefix.

    Returns:
      ``{name: scalar}``.
    """
    _check_trees("update_metrics", updates, params, None, prefix, "updates")
    t = tree_stats({"updates": updates, "params": params}, specs=specs, axes=axes, what="updates")
    u = t["updates"].all
    out = {f"{prefix}/global_norm": u.norm, f"{prefix}/nonfinite_count": nonfinite_count(u)}
    if params is not None:
        out[f"{prefix}/param_ratio"] = (u.norm / t["params"].all.norm).astype(_F32)
    return out


def gradient_metrics(grads: Any, *, params: Any = None, updates: Any = None, roles: Roles | None = None,
                     specs: Any = None, axes: Sequence[str] | str = (), prefix: str = "grad",
                     per: Collection[str] = ("layer", "role")) -> dict[str, jax.Array]:
    """Every ``grad/*`` and ``param/*`` vital of METRICS.md §2-§3, in one pass per leaf.

    Emitted (``p = prefix``; ``{base}`` is the role's metric name, see
    :data:`~jvitals.metrics.roles.ROLE_METRIC_NAMES`: ``word_embeddings``, ``output_layer``,
    ``Wq``/``Wk``/``Wv``/``Wo`` (a fused QKV kernel split first), ``mla_Q_down``,
    ``mla_Q_up``, ``mla_KV_down``, ``mla_KV_up``, ``attn_gate``, ``W_gate``,
    ``W_up``, ``W_down``, ``router``, ``expert_bias``, each norm's module name...):

    * ``{p}/global_norm = sqrt(sum g^2)``, ``{p}/nonfinite_count``;
    * per layer ``i`` (``per_layer``): ``{p}/norm/layer_{i} = ||g_i||``,
      ``{p}/share/layer_{i} = ||g_i||^2 / ||g||^2``, ``{p}/nonfinite_count/layer_{i}``;
    * per role (``per_role``): ``{p}/{base}_abs.max = max |g|``,
      ``{p}/{base}_rms = sqrt(mean g^2)`` over all its elements (all layers),
      ``{p}/{base}.nonfinite``; and per layer ``{p}/{base}_rms/layer_{i}``,
      ``{p}/{base}_abs.max/layer_{i}``;
    * per group ``G`` of :data:`GROUP_ROLES` (``per_layer``; the leaves of role
      ``embedding`` / ``lm_head``; a group without leaves, e.g. a head tied to the
      embedding, is omitted): ``{p}/norm/{G} = ||g_G||``,
      ``{p}/share/{G} = ||g_G||^2 / ||g||^2``;
    * with ``params``: ``param/global_norm``, ``param/norm/layer_{i}``,
      ``param/norm/{G}``;
    * with ``updates`` (and ``params``): ``update/global_norm = ||u||``,
      ``update/param_ratio = ||u|| / ||p||``, and per layer and group
      ``update/param_ratio/layer_{i} = ||u_i|| / ||p_i||``,
      ``update/param_ratio/{G} = ||u_G|| / ||p_G||`` (per layer);
      scan-stacked leaves per slice, as every per-layer figure.

    Leaves no role matches still count in the global and per-layer figures.

    Args:
      grads: gradient pytree (after loss-scale unscaling; pre- or post-clip as the
        caller decides; name the family with ``prefix``).
      params: optional parameter pytree (same structure) for ``param/*``.
      updates: optional final updates (what ``optax.apply_updates`` adds; same
        structure) for ``update/*``; needs ``params``.
      roles: :class:`~jvitals.metrics.roles.Roles` (default patterns if None).
      specs: optional pytree of ``PartitionSpec`` (a prefix of ``grads``; None =
        replicated): the mesh axes each leaf is sharded along. Without it, inside
        ``shard_map``, the axes each leaf varies along (JAX's type system).
      axes: mesh axes bound by the enclosing ``shard_map``; ``()`` under ``jit``
        with global (``NamedSharding``) arrays.
      prefix: the gradient family's name prefix (``grad``; the ``param/*`` and
        ``update/*`` names are fixed).
      per: which breakdowns to emit besides the global figures: ``"layer"``
        (per layer and group), ``"role"`` (per role); ``()``: the global ones only.

    Returns:
      ``{name: scalar jax.Array}`` (float32; counts int32).

    Raises:
      ValueError: a required role is unmatched, a fused QKV kernel does not split,
        ``specs`` does not match, an axis is not bound, or ``updates`` come without
        ``params``, or ``params``/``updates`` that do not hold the leaves of ``grads`` (swapped).
      TypeError: ``grads`` is None, ``roles`` not a :class:`Roles`, ``per`` a lone string.

    Example:
      >>> m = gradient_metrics(grads, params=params)          # doctest: +SKIP
      >>> m["grad/global_norm"], m["grad/Wq_abs.max"], m["grad/share/layer_0"]  # doctest: +SKIP
    """
    _check_trees("gradient_metrics", grads, params, updates, prefix)
    roles = check_roles(roles, "gradient_metrics")
    per = check_names(per, "gradient_metrics", "per", ("layer", "role"))
    if updates is not None and params is None:
        raise ValueError("gradient_metrics(updates=...): the update/param ratios need the parameters the "
                         "updates apply to; pass params= too")
    per_layer, per_role = "layer" in per, "role" in per
    trees = {"grads": grads, "params": params, "updates": updates}
    t = tree_stats(trees, role_tree="grads" if per_role else None, layered=list(trees) if per_layer else (),
                   roles=roles, specs=specs, axes=axes, what="grads")
    out = grad_figures(t["grads"], prefix, per_layer=per_layer, per_role=per_role)
    if params is not None:
        out.update(param_figures(t["params"], "param", per_layer=per_layer))
    if updates is not None:
        out.update(update_figures(t["updates"], t["params"], "update", per_layer=per_layer))
    return out


def _check_trees(where: str, grads: Any, params: Any, updates: Any, prefix: Any, first: str = "grads") -> None:
    check_not_none(grads, where, first, f"a pytree of arrays (the {first}, e.g. from jax.grad or tx.update)")
    check_same_structure(grads, params, where, first, "params")
    check_same_structure(grads, updates, where, first, "updates")
    if not isinstance(prefix, str):
        raise TypeError(f"{where}: prefix={prefix!r} must be a str (the figures' names start with it, e.g. 'grad')")


def _share(s: Summary, total_sq: jax.Array) -> jax.Array:
    """``||g_i||^2 / ||g||^2`` (NaN where either is non-finite)."""
    sq = jnp.where(s.nonfinite > 0, jnp.nan, s.sumsq)
    return (sq / total_sq).astype(_F32)


def grad_figures(t: TreeStats, p: str, *, per_layer: bool, per_role: bool) -> dict[str, jax.Array]:
    """``{p}/global_norm``, the non-finite counts, per-layer/group norms and shares, per-role figures."""
    out: dict[str, jax.Array] = {f"{p}/global_norm": t.all.norm, f"{p}/nonfinite_count": nonfinite_count(t.all)}
    if per_layer:
        total_sq = jnp.where(t.all.nonfinite > 0, jnp.nan, t.all.sumsq)
        for i in sorted(t.layers):
            out[f"{p}/norm/layer_{i}"] = t.layers[i].norm
            out[f"{p}/share/layer_{i}"] = _share(t.layers[i], total_sq)
            out[f"{p}/nonfinite_count/layer_{i}"] = nonfinite_count(t.layers[i])
        for g in sorted(t.groups):
            out[f"{p}/norm/{g}"] = t.groups[g].norm
            out[f"{p}/share/{g}"] = _share(t.groups[g], total_sq)
    if per_role:
        for name in sorted(t.roles):
            s = t.roles[name]
            out[f"{p}/{name}_abs.max"] = s.abs_max
            out[f"{p}/{name}_rms"] = s.rms
            out[f"{p}/{name}.nonfinite"] = nonfinite_count(s)
            for i in sorted(t.role_layers.get(name, {})):
                out[f"{p}/{name}_rms/layer_{i}"] = t.role_layers[name][i].rms
                out[f"{p}/{name}_abs.max/layer_{i}"] = t.role_layers[name][i].abs_max
    return out


def param_figures(tp: TreeStats, p: str, *, per_layer: bool) -> dict[str, jax.Array]:
    """``{p}/global_norm`` and, per layer and group, ``{p}/norm/...``."""
    out = {f"{p}/global_norm": tp.all.norm}
    if per_layer:
        for i in sorted(tp.layers):
            out[f"{p}/norm/layer_{i}"] = tp.layers[i].norm
        for g in sorted(tp.groups):
            out[f"{p}/norm/{g}"] = tp.groups[g].norm
    return out


def update_figures(tu: TreeStats, tp: TreeStats, p: str, *, per_layer: bool) -> dict[str, jax.Array]:
    """``||u||``, ``||u|| / ||p||`` globally, per layer and per group."""
    out = {f"{p}/global_norm": tu.all.norm, f"{p}/param_ratio": (tu.all.norm / tp.all.norm).astype(_F32)}
    if per_layer:
        for i in sorted(tu.layers):
            if i in tp.layers:
                out[f"{p}/param_ratio/layer_{i}"] = (tu.layers[i].norm / tp.layers[i].norm).astype(_F32)
        for g in sorted(tu.groups):
            if g in tp.groups:
                out[f"{p}/param_ratio/{g}"] = (tu.groups[g].norm / tp.groups[g].norm).astype(_F32)
    return out
