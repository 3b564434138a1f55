"""The recorder's light step: global norms and, from the same per-leaf sums, every group's.

The light step (every update) already takes one sum of squares per leaf of the
gradients (the clip's, which XLA computes once for both), the parameters and the
updates. Summing those per-leaf sums by group costs scalar additions, no read, so the
per-layer and per-group figures ride on every update::

    grad/norm/{G}          = sqrt(sum over G's leaves of sum g^2)
    grad/share/{G}         = ||g_G||^2 / ||g||^2
    param/norm/{G}         = ||p_G||
    update/param_ratio/{G} = ||u_G|| / ||p_G||

for ``G`` = ``layer_{i}``, ``embedding``, ``lm_head`` (:data:`~jvitals.metrics.gradients.GROUP_ROLES`),
with the leaves' roles from :func:`~jvitals.metrics.roles.assign_roles` (decided at trace
time). The per-role figures (``grad/Wq_abs.max``, ``grad/W_up_rms``...) need a read of
their own (a maximum, a fused QKV kernel's parts) and stay on the heavy step.

Scan-stacked leaves (``nn.scan``): the parameters' and the updates' sums are taken per
slice along the layer axis (the same read), but the gradients' are the clip's, over the
whole stacked leaf: per-layer *gradient* figures of a stacked model would need a second
read of the gradients, so they stay on the heavy step (the embedding's and the head's
are never stacked and ride on every update).

Inside ``shard_map`` (or for other dtypes) every tree is read by one variadic reduction
per leaf (:func:`~jvitals.metrics.gradients.tree_stats`), which gives every group's sums
from the same read, stacked leaves per layer included.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from jvitals.metrics import gradients as G
from jvitals.metrics.roles import Roles
from jvitals.metrics.stats import check_axes

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
    if G._optax_form(grads, axes) and (params is None or G._optax_form(params, axes)):
        return _under_jit(grads, params, updates, roles)
    trees = {"grads": grads, "params": params, "updates": updates}
    present = [n for n, t in trees.items() if t is not None]
    t = G.tree_stats(trees, layered=present, roles=roles, specs=specs, axes=axes, what="grads")
    out = G._grad_figures(t["grads"], "grad", per_layer=True, per_role=False)
    if params is not None:
        out.update(G._param_figures(t["params"], "param", per_layer=True))
    if updates is not None:
        s = t["updates"].all
        out["update/nonfinite_count"] = G._nonfinite(s)
        if params is not None:
            out.update(G._update_figures(t["updates"], t["params"], "update", per_layer=True))
        else:
            out["update/global_norm"] = s.norm
    return out


def _leaf_sums(x: jax.Array, stack_axis: int | None) -> jax.Array:
    """``sum x^2`` of a float32 leaf as optax writes it (``optax.tree.norm``: the clip's
    own expression, so XLA computes it once for both), per slice along ``stack_axis``."""
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
    """:func:`light_metrics` under ``jit`` for float32 gradients and parameters: each tree's
    per-leaf (per-slice) sums once, the global figures and the groups' from them."""
    g_norm, g_count = G._norm_and_count(grads)        # the clip's expression: computed once
    out = {"grad/global_norm": g_norm, "grad/nonfinite_count": g_count}
    plan, _, _ = G._plan(grads, roles=roles, specs=None, axes=(), need_roles=True, split_qkv=False,
                         what="grads")
    stacked = any(leaf.role is not None and leaf.role.stack is not None for leaf in plan)
    gl = jax.tree.leaves(grads)
    pl = jax.tree.leaves(params) if params is not None else None
    gg, pg = _Groups(), _Groups()
    p_total = jnp.zeros((), _F32)
    for leaf in plan:
        keys = _keys(leaf.role)
        axis = leaf.role.stack_axis if keys and leaf.role.stack is not None else None
        if keys and axis is None:          # a stacked leaf's gradient: the clip reads it whole
            g = _leaf_sums(gl[leaf.index], None)
            for k, _ in keys:
                gg.add(k, g)
        if pl is not None:
            p = _leaf_sums(pl[leaf.index], axis)
            p_total = p_total + jnp.sum(p)
            for k, j in keys:
                pg.add(k, p if j is None else p[j])
    for k, v in gg.sums.items():
        if stacked and k.startswith("layer_"):
            continue                       # partial layers: the stacked leaves are missing
        out[f"grad/norm/{k}"] = _nan_if_not_finite(jnp.sqrt(v))
        out[f"grad/share/{k}"] = _nan_if_not_finite(v / jnp.square(g_norm))
    if pl is not None:
        out["param/global_norm"] = _nan_if_not_finite(jnp.sqrt(p_total))
        pn = pg.norms()
        out.update({f"param/norm/{k}": v for k, v in pn.items()})
    if updates is not None:
        out.update(_update_groups(updates, roles, out.get("param/global_norm"), pn if pl is not None else {}))
    return out


def _update_groups(updates: Any, roles: Roles, p_norm: jax.Array | None,
                   pn: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The update figures from one variadic read per leaf of the updates (per slice for a
    stacked leaf), fused by XLA with the optimizer's last elementwise step:
    ``update/global_norm``, ``update/nonfinite_count``, and with the parameters' norms
    ``update/param_ratio`` and ``update/param_ratio/{G}``."""
    t = G.tree_stats({"updates": updates}, layered=["updates"], roles=roles, what="updates")["updates"]
    out = {"update/global_norm": t.all.norm, "update/nonfinite_count": G._nonfinite(t.all)}
    if p_norm is None:
        return out
    out["update/param_ratio"] = (t.all.norm / p_norm).astype(_F32)
    for i, s in t.layers.items():
        if f"layer_{i}" in pn:
            out[f"update/param_ratio/layer_{i}"] = (s.norm / pn[f"layer_{i}"]).astype(_F32)
    for g, s in t.groups.items():
        if g in pn:
            out[f"update/param_ratio/{g}"] = (s.norm / pn[g]).astype(_F32)
    return out
