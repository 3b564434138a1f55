"""The recorder's light step: global norms and, from the same per-leaf sums, every group's.

The light step already takes one sum of squares per leaf of the gradients (the clip's,
computed once for both), the parameters and the updates; summing them by group costs scalar
additions, no read, so the per-layer and per-group figures ride on every update::

    grad/norm/{G} = sqrt(sum over G's leaves of sum g^2)    grad/share/{G} = ||g_G||^2 / ||g||^2
    param/norm/{G} = ||p_G||                         update/param_ratio/{G} = ||u_G|| / ||p_G||

for ``G`` = ``layer_{i}``, ``embedding``, ``lm_head``. Under ``jit`` the update figures
come from the change the step applies, ``(p + u) - p`` (bf16 and other float dtypes summed
in float32); inside ``shard_map`` every tree is read by
:func:`~jvitals.metrics.gradients.tree_stats`.

Why, stacked leaves and the applied change: docs/RECORDER.md, "The light step: every
group's figures from the clip's sums".
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from jvitals.metrics import gradients as G
from jvitals.metrics.clip_norm import nonfinite_where, norm_and_count, optax_form
from jvitals.metrics.roles import Roles
from jvitals.metrics.axes import check_axes

__all__ = ["light_metrics"]

_F32 = jnp.float32


def light_metrics(grads: Any, params: Any = None, updates: Any = None, *, roles: Roles | None = None,
                  specs: Any = None, axes: Sequence[str] | str = ()) -> dict[str, jax.Array]:
    """:func:`~jvitals.metrics.gradients.norm_metrics` plus every group's figures (module docstring).

    Args:
      grads, params, updates: as :func:`~jvitals.metrics.gradients.norm_metrics` takes them.
      roles: the parameter roles (default ``Roles()``).
      specs, axes: ``PartitionSpec`` pytree (prefix) and bound mesh axes (``shard_map``).

    Returns:
      ``{name: scalar}``: the global norms of ``norm_metrics`` and ``grad/norm/{G}``,
      ``grad/share/{G}``, ``param/norm/{G}`` (with ``params``),
      ``update/param_ratio/{G}`` (with both); counts int32.
    """
    axes = check_axes(axes)
    roles = Roles() if roles is None else roles
    if not axes and _floats(grads) and (params is None or _floats(params)):
        return _under_jit(grads, params, updates, roles)
    return _joint(grads, params, updates, roles, specs, axes)


def _floats(tree: Any) -> bool:
    """Whether every leaf of ``tree`` is a real floating-point array (float32, bf16, ...)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) for x in leaves)


def _joint(grads: Any, params: Any, updates: Any, roles: Roles, specs: Any = None,
           axes: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """Every figure from one variadic reduction per leaf over its gradient, parameter and
    update (:func:`~jvitals.metrics.gradients.tree_stats`; a stacked leaf per slice)."""
    trees = {"grads": grads, "params": params, "updates": updates}
    present = [n for n, t in trees.items() if t is not None]
    t = G.tree_stats(trees, layered=present, roles=roles, specs=specs, axes=axes, what="grads")
    out = G.grad_figures(t["grads"], "grad", per_layer=True, per_role=False)
    if params is not None:
        out.update(G.param_figures(t["params"], "param", per_layer=True))
    if updates is not None:
        s = t["updates"].all
        out["update/nonfinite_count"] = G.nonfinite_count(s)
        if params is not None:
            out.update(G.update_figures(t["updates"], t["params"], "update", per_layer=True))
        else:
            out["update/global_norm"] = s.norm
    return out


def _leaf_sums(x: jax.Array, stack_axis: int | None) -> jax.Array:
    """``sum x^2`` of a leaf, per slice along ``stack_axis``: for float32 as optax writes it
    (``optax.tree.norm``: the clip's own expression, so XLA computes it once for both);
    other float dtypes upcast to float32 first."""
    x = x.astype(_F32)             # bf16/fp16 summed in float32 (no-op for float32)
    sq = jnp.square(x.real) + jnp.square(x.imag)
    if stack_axis is None:
        return jnp.sum(sq)
    return jnp.sum(sq, axis=tuple(a for a in range(x.ndim) if a != stack_axis))


class _Groups:
    """Sums of squares accumulated per group key (``layer_{i}``, ``embedding``, ``lm_head``)."""

    def __init__(self) -> None:
        self.sums: dict[str, jax.Array] = {}

    def add(self, key: str, v: jax.Array) -> None:
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def norms(self) -> dict[str, jax.Array]:
        return {k: _nan_if_not_finite(jnp.sqrt(v)) for k, v in self.sums.items()}


def _nan_if_not_finite(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.nan).astype(_F32)


def _keys(lr: Any) -> list[tuple[str, int | None]]:
    """``(group key, slice)`` a leaf's sums count in: its group (embedding, LM head) or its
    layer; a stacked leaf's layers with their slice index."""
    if lr is None or lr.role is None and lr.layer is None and lr.stack is None:
        return []
    if lr.role in G.GROUP_ROLES:
        return [(G.GROUP_ROLES[lr.role], None)]
    if lr.stack is not None:
        return [(f"layer_{lr.first_layer + j}", j) for j in range(lr.num_layers)]
    return [] if lr.layer is None else [(f"layer_{lr.layer}", None)]


def _under_jit(grads: Any, params: Any, updates: Any, roles: Roles) -> dict[str, jax.Array]:
    """:func:`light_metrics` under ``jit`` (no mesh axes, floating-point trees): each tree's
    per-leaf sums (a stacked leaf's per slice) once, the global figures and the groups' from
    them. Float32 gradients give the clip's own norm (its expression, computed once for
    both); other dtypes are summed in float32 (plain reductions of the upcast leaves, which
    GPUs and TPUs fuse with the clip's over the same leaves)."""
    plan, _, _ = G.plan_leaves(grads, roles=roles, specs=None, axes=(), need_roles=True, split_qkv=False,
                               what="grads")
    gl = jax.tree.leaves(grads)
    gg, pg = _Groups(), _Groups()
    if optax_form(grads, ()):
        g_norm, g_count = norm_and_count(grads)        # the clip's expression: computed once
        for leaf in plan:
            if _keys(leaf.role):
                _add(gg, leaf.role, gl[leaf.index])
    else:
        g_total = jnp.zeros((), _F32)
        for leaf in plan:
            g_total = g_total + _add(gg, leaf.role, gl[leaf.index])
        g_norm = _nan_if_not_finite(jnp.sqrt(g_total))
        g_count = nonfinite_where(~jnp.isfinite(g_norm), grads)
    out = {"grad/global_norm": g_norm, "grad/nonfinite_count": g_count}
    if params is None:
        _grad_groups(out, gg, g_norm)
        if updates is not None:
            out.update(_update_groups(updates, roles))
        return out
    pl = jax.tree.leaves(params)
    p_total = jnp.zeros((), _F32)
    for leaf in plan:
        p_total = p_total + _add(pg, leaf.role, pl[leaf.index])
    _grad_groups(out, gg, g_norm)
    out["param/global_norm"] = _nan_if_not_finite(jnp.sqrt(p_total))
    pn = pg.norms()
    out.update({f"param/norm/{k}": v for k, v in pn.items()})
    if updates is not None:   # the change applied (module docstring)
        out.update(_applied_groups(updates, params, plan, out["param/global_norm"], pn))
    return out


def _add(groups: _Groups, lr: Any, x: jax.Array) -> jax.Array:
    """``x``'s sums of squares into the groups it counts in (a stacked leaf's per slice,
    along its layer axis); the whole leaf's sum."""
    axis = lr.stack_axis if lr is not None and lr.stack is not None else None
    s = _leaf_sums(x, axis)
    total = s if axis is None else jnp.sum(s)
    for k, j in _keys(lr):
        groups.add(k, total if j is None else s[j])
    return total


def _applied_groups(updates: Any, params: Any, plan: Sequence[Any], p_norm: jax.Array,
                    pn: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """:func:`_update_groups`' figures from the change the step applies, ``(p + u) - p`` with
    ``p + u`` as ``optax.apply_updates`` writes it (XLA computes the step's own new
    parameters once for both, and GPUs and TPUs fuse these sums into that kernel as more
    outputs: no read of their own): a plain sum per leaf (a stacked leaf's per slice) of
    two arrays the step holds anyway (the parameters, and the new ones it writes out).
    Equal to ``||u||`` up to the rounding of ``p + u`` in the parameters' dtype (an update
    below half an ulp of ``p`` is not applied, and not counted); the difference is taken
    in float32. The non-finite count reads ``u`` where the norm is not finite."""
    new = optax.apply_updates(params, updates)
    diff = jax.tree.leaves(jax.tree.map(lambda a, b: a.astype(_F32) - b.astype(_F32), new, params))
    ug = _Groups()
    total = jnp.zeros((), _F32)
    for leaf in plan:
        total = total + _add(ug, leaf.role, diff[leaf.index])
    norm = _nan_if_not_finite(jnp.sqrt(total))
    out = {"update/global_norm": norm,
           "update/nonfinite_count": nonfinite_where(~jnp.isfinite(norm), updates),
           "update/param_ratio": (norm / p_norm).astype(_F32)}
    for k, v in ug.norms().items():
        if k in pn:
            out[f"update/param_ratio/{k}"] = (v / pn[k]).astype(_F32)
    return out


def _grad_groups(out: dict[str, jax.Array], gg: _Groups, g_norm: jax.Array) -> None:
    """``grad/norm/{G}`` and ``grad/share/{G}`` from the groups' sums of squares."""
    for k, v in gg.sums.items():
        out[f"grad/norm/{k}"] = _nan_if_not_finite(jnp.sqrt(v))
        out[f"grad/share/{k}"] = _nan_if_not_finite(v / jnp.square(g_norm))


def _update_groups(updates: Any, roles: Roles, p_norm: jax.Array | None = None,
                   pn: Mapping[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """The update figures from the updates themselves (one reduction per leaf of them; where
    the step gives no parameters): ``update/global_norm``, ``update/nonfinite_count``, and
    with the parameters' norms ``update/param_ratio`` and ``update/param_ratio/{G}``."""
    tu = G.tree_stats({"updates": updates}, layered=["updates"], roles=roles, what="updates")["updates"]
    out = {"update/global_norm": tu.all.norm, "update/nonfinite_count": G.nonfinite_count(tu.all)}
    if p_norm is None:
        return out
    pn = pn or {}
    out["update/param_ratio"] = (tu.all.norm / p_norm).astype(_F32)
    for i, s in tu.layers.items():
        if f"layer_{i}" in pn:
            out[f"update/param_ratio/layer_{i}"] = (s.norm / pn[f"layer_{i}"]).astype(_F32)
    for g, s in tu.groups.items():
        if g in pn:
            out[f"update/param_ratio/{g}"] = (s.norm / pn[g]).astype(_F32)
    return out
