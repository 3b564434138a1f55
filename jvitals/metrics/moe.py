"""Router vitals of mixture-of-experts layers over an explicit window (METRICS.md §2, §7).

Input: the ``expert_counts`` each MoE layer sows, ``c[l, e]`` = top-k selections of expert
``e`` in layer ``l`` over the valid tokens this device routed, ``psum``-ed over the
token-sharding mesh axes (``axes``). Per MoE layer (``mean_l = mean_e c[l, e]``)::

    maxvio_l     = (max_e c[l, e] - mean_l) / mean_l      load_cv_l = std_e c[l, e] / mean_l
    dead_ratio_l = #{e : c[l, e] = 0} / E

then summarised over layers (``moe/maxvio.mean``, ``moe/load_imbalance``,
``moe/dead_expert_ratio``...). A window longer than one step is kept in
:class:`MoEWindowState` (a NamedTuple of arrays, so it checkpoints with orbax) by
:func:`moe_window_update`. Every figure: docs/DEVICE.md, "moe: the router's figures".
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jvitals.metrics.gradients import flat_specs
from jvitals.metrics.roles import Roles
from jvitals.metrics.paths import path_str
from jvitals.metrics.stats import eager_jit
from jvitals.metrics.axes import check_axes, psum_over, reduction_axes

__all__ = ["MoEWindowState", "moe_metrics", "moe_window_init", "moe_window_update"]

_F32 = jnp.float32


class MoEWindowState(NamedTuple):
    """Expert counts summed over a window of steps.

    Attributes:
      counts: ``[L, E]`` selections per (MoE layer, expert), already reduced over
        the token-sharding axes (identical on every device).
      steps: int32 scalar, steps accumulated since the last reset.
    """

    counts: jax.Array
    steps: jax.Array


def moe_window_init(num_layers: int, num_experts: int, dtype: Any = jnp.int32) -> MoEWindowState:
    """An empty window for ``num_layers`` MoE layers of ``num_experts`` experts.

    ``dtype`` int32 (default) counts exactly up to 2^31 per expert; float32 would
    lose integers beyond 2^24.
    """
    if num_layers < 1 or num_experts < 1:
        raise ValueError(f"moe_window_init: need num_layers >= 1 and num_experts >= 1, got "
                         f"{num_layers} and {num_experts}")
    return MoEWindowState(counts=jnp.zeros((num_layers, num_experts), dtype), steps=jnp.zeros([], jnp.int32))


@eager_jit(static_argnames=("axes",))
def moe_window_update(state: MoEWindowState, expert_counts: Any, *, axes: Sequence[str] | str = (),
                      reset: Any = False, mask: Any = None) -> MoEWindowState:
    """Add one step's counts to the window (``reset``: start a new window with them).

    ``counts <- (0 if reset else counts) + psum_{axes}(expert_counts)``.

    Args:
      state: the window.
      expert_counts: this step's counts, any form :func:`moe_metrics` accepts.
      axes: token-sharding mesh axes to ``psum`` over (inside ``shard_map``).
      reset: bool (may be traced, e.g. ``step % interval == 0``).
      mask: ``[B, T]`` token mask for ``instrument()``'s per-token expert choices.

    Returns:
      The updated :class:`MoEWindowState`.

    Raises:
      ValueError: if the counts' ``[L, E]`` shape differs from the window's.
    """
    if not isinstance(state, MoEWindowState):
        raise TypeError(f"moe_window_update: state must be the MoEWindowState of moe_window_init(L, E) (kept in "
                        f"the train state), got {type(state).__name__}; the order is (state, expert_counts)")
    c, _ = _counts_matrix(expert_counts, mask)
    if tuple(c.shape) != tuple(state.counts.shape):
        raise ValueError(f"moe_window_update: expert_counts give shape [L, E] = {tuple(c.shape)}, the "
                         f"window holds {tuple(state.counts.shape)}; build it with "
                         f"moe_window_init({c.shape[0]}, {c.shape[1]}).")
    c = psum_over(c, check_axes(axes))
    if jnp.issubdtype(state.counts.dtype, jnp.integer):
        c = jnp.round(c.astype(_F32))
    reset = jnp.asarray(reset, bool)
    counts = jnp.where(reset, jnp.zeros_like(state.counts), state.counts) + c.astype(state.counts.dtype)
    steps = jnp.where(reset, 0, state.steps) + 1
    return MoEWindowState(counts=counts, steps=steps.astype(jnp.int32))


_OTHER_SOWN = frozenset({"intermediates", "hidden_states", "logits", "attn_out_before_proj", "gate_scores",
                         "attn_logits", "mtp_logits"})


def _is_choices(x: Any) -> bool:
    return type(x).__name__ == "ExpertChoices" and hasattr(x, "counts")


def _counts_matrix(expert_counts: Any, mask: Any = None) -> tuple[jax.Array, list[int]]:
    """``[L, E]`` counts from an array or a sown pytree, and each row's layer index.

    ``instrument()``'s per-token expert choices are counted over ``mask`` here."""
    if isinstance(expert_counts, MoEWindowState):
        c = expert_counts.counts
        return c, list(range(c.shape[0]))
    try:  # an NNX State -> a pure dict
        from flax import nnx
        if isinstance(expert_counts, nnx.State):
            expert_counts = nnx.to_pure_dict(expert_counts)
    except ImportError:  # pragma: no cover
        pass
    leaves = jax.tree_util.tree_flatten_with_path(expert_counts, is_leaf=_is_choices)[0]
    named = [(p, x) for p, x in leaves if "expert_counts" in path_str(p).split("/")]
    if not named and isinstance(expert_counts, Mapping):
        parts = {part for p, _ in leaves for part in path_str(p).split("/")}
        if not leaves or parts & _OTHER_SOWN:
            held = sorted(parts & _OTHER_SOWN - {"intermediates"})
            raise ValueError(
                "moe_metrics: no expert counts were sown"
                + (f" (the intermediates hold {held})" if held else " (the tree is empty)")
                + ". A dense model has none: skip moe_metrics. An MoE model: sow 'expert_counts' ([E] tokens "
                  "per expert, one sow per MoE layer) in the model, or run its apply inside "
                  "jvitals.instrument(top_k=K) with mutable=['intermediates'] so each router's choices are "
                  "sown, then pass state['intermediates'] (and mask=).")
    if not leaves:
        raise ValueError("expert_counts is empty: expected [E] (one MoE layer), [L, E] (scan-stacked) "
                         "or a pytree of those (the sown 'expert_counts' of each MoE layer).")
    if named and len(named) < len(leaves):  # a whole 'intermediates' tree: take its expert_counts
        leaves = named
    leaves = [(p, x.counts(mask) if _is_choices(x) else x) for p, x in leaves]
    roles = Roles()
    rows = []  # (sort key, layer index or None, [L, E] array)
    num_e = None
    for order, (p, x) in enumerate(leaves):
        path = path_str(p) or "expert_counts"
        x = jnp.asarray(x)
        if x.ndim not in (1, 2):
            raise ValueError(
                f"expert_counts {path!r} has shape {tuple(x.shape)} (rank {x.ndim}): expected [E] tokens "
                f"per expert for one MoE layer, or [L, E] for scan-stacked layers. Sum any batch axes "
                f"first (counts are over the device's valid tokens).")
        x2 = x[None] if x.ndim == 1 else x
        if num_e is not None and x2.shape[1] != num_e:
            raise ValueError(f"expert_counts {path!r} has {x2.shape[1]} experts, earlier layers {num_e}: "
                             f"every MoE layer must report all E experts.")
        num_e = x2.shape[1]
        layer = roles.layer_of(path) if x.ndim == 1 else None
        rows.append((layer, order, x2))
    if all(r[0] is not None for r in rows) and len({r[0] for r in rows}) == len(rows):
        rows.sort(key=lambda r: r[0])  # model order, not key order (layers_10 < layers_2)
        ids = [r[0] for r in rows]
    else:
        ids = None
    c = jnp.concatenate([r[2] for r in rows], axis=0)
    return c, ids if ids is not None else list(range(c.shape[0]))


def _bias_abs_sum(expert_bias: Any, axes: tuple[str, ...], bias_specs: Any) -> jax.Array:
    leaves = jax.tree_util.tree_flatten_with_path(expert_bias)[0]
    sp = flat_specs(expert_bias, bias_specs, "expert_bias")
    roles = Roles()
    picked = [i for i, (p, _) in enumerate(leaves) if roles.role_of(path_str(p))[0] == "expert_bias"]
    if not picked:
        picked = list(range(len(leaves)))
    total = jnp.zeros([], _F32)
    for i in picked:
        b = jnp.asarray(leaves[i][1])
        s = jnp.sum(jnp.abs(b.astype(_F32)))
        red = reduction_axes(b, axes, sp[i] if sp is not None else None, sp is not None)
        total = total + (jax.lax.psum(s, red) if red else s)
    return total


def _masked_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    n = jnp.sum(valid.astype(_F32))
    return jnp.where(n > 0, jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n, 1.0), jnp.nan).astype(_F32)


def _masked_max(x: jax.Array, valid: jax.Array) -> jax.Array:
    m = jnp.max(jnp.where(valid, x, -jnp.inf))
    return jnp.where(jnp.any(valid), m, jnp.nan).astype(_F32)


@eager_jit(static_argnames=("top_k", "axes", "prefix", "per_layer"))
def moe_metrics(expert_counts: Any, *, expert_bias: Any = None, top_k: int, axes: Sequence[str] | str = (),
                bias_specs: Any = None, prefix: str = "moe", per_layer: bool = True,
                mask: Any = None) -> dict[str, jax.Array]:
    """Router load metrics over a window (see the module docstring for formulas).

    Args:
      expert_counts: ``[E]`` (one MoE layer), ``[L, E]`` (scan-stacked), a pytree
        of those, or a whole sown ``intermediates`` tree (its entries named
        ``expert_counts`` are used; layers are ordered by the layer index in their
        paths, ``layers_2`` before ``layers_10``), or
        a :class:`MoEWindowState` (counts already reduced; ``moe/window_steps``
        is emitted too).
      expert_bias: optional expert-selection bias: an array, or a pytree (e.g. the
        params: leaves with role ``expert_bias`` are used, else every leaf).
      top_k: experts selected per token.
      axes: token-sharding mesh axes the counts are ``psum``-ed over (the axes they
        vary along; inside ``shard_map``). Ignored for a :class:`MoEWindowState`.
        The bias is reduced over the axes it is sharded along (``bias_specs``) or
        varies along.
      bias_specs: optional ``PartitionSpec`` pytree (prefix) for ``expert_bias``.
      prefix: name prefix.
      per_layer: emit ``{prefix}/{metric}/layer_{i}`` too.
      mask: ``[B, T]`` token mask (True = valid): counts
        :func:`~jvitals.metrics.instrument.instrument`'s per-token expert choices over
        the valid tokens only (counts a model sowed itself are used as they are).

    Returns:
      ``{name: float32 scalar}``.

    Raises:
      ValueError: no expert counts in a sown tree (a dense model), counts of the
        wrong rank or inconsistent E, ``top_k`` < 1 or greater than the number of
        experts, an ``expert_bias`` array whose last axis is not E.

    Example:
      >>> m = moe_metrics(jnp.array([[4, 0, 2, 2]]), top_k=2)
      >>> float(m["moe/maxvio.max"]), float(m["moe/dead_expert_ratio"])
      (1.0, 0.25)
    """
    axes = check_axes(axes)
    c, ids = _counts_matrix(expert_counts, mask)
    _check_top_k(top_k, c.shape)
    global_view = not axes and bias_specs is None     # inside shard_map a bias may hold E / shards experts
    if global_view and hasattr(expert_bias, "shape") and expert_bias.ndim >= 1 and expert_bias.shape[-1] != c.shape[1]:
        raise ValueError(f"moe_metrics: expert_bias has shape {tuple(expert_bias.shape)} but the counts have "
                         f"E={c.shape[1]} experts ([L, E] = {tuple(c.shape)}); pass the router's bias, [E] or "
                         f"[L, E], or the params pytree (its 'expert_bias' leaves are found by role)")
    if not isinstance(expert_counts, MoEWindowState):
        c = psum_over(c, axes)
    loads = _layer_loads(c.astype(_F32))
    out = _aggregates(loads, c.astype(_F32), top_k, prefix)
    if isinstance(expert_counts, MoEWindowState):
        out[f"{prefix}/window_steps"] = expert_counts.steps.astype(_F32)
    if expert_bias is not None:
        out[f"{prefix}/ep_bias_abs_sum"] = _bias_abs_sum(expert_bias, axes, bias_specs)
    if per_layer:
        for j, i in enumerate(ids):
            for name in ("maxvio", "load_imbalance", "load_cv", "dead_expert_ratio"):
                out[f"{prefix}/{name}/layer_{i}"] = loads[name][j].astype(_F32)
    return out


def _check_top_k(top_k: Any, shape: tuple[int, ...]) -> None:
    """``top_k`` must be a positive int no larger than the number of experts ``E``."""
    num_l, num_e = int(shape[0]), int(shape[1])
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive int (experts selected per token), got {top_k!r}")
    if top_k > num_e:
        raise ValueError(f"top_k={top_k} exceeds the number of experts E={num_e} in expert_counts of shape "
                         f"[L, E] = {(num_l, num_e)}: a token cannot select more experts than exist.")


def _layer_loads(c: jax.Array) -> dict[str, jax.Array]:
    """Per MoE layer (rows of ``c``, ``[L, E]`` float32): ``valid`` (mean > 0: a layer
    that routed nothing is left out of the ratios), ``maxvio``, ``load_imbalance``,
    ``load_cv`` (NaN where not valid) and ``dead_expert_ratio``."""
    mean = jnp.mean(c, axis=1)
    mx = jnp.max(c, axis=1)
    valid = mean > 0
    safe = jnp.where(valid, mean, 1.0)
    dev = c - mean[:, None]  # two passes: a one-pass variance cancels on balanced large counts
    return {"valid": valid,
            "maxvio": jnp.where(valid, (mx - mean) / safe, jnp.nan),
            "load_imbalance": jnp.where(valid, mx / safe, jnp.nan),
            "load_cv": jnp.where(valid, jnp.sqrt(jnp.mean(dev * dev, axis=1)) / safe, jnp.nan),
            "dead_expert_ratio": jnp.mean((c == 0).astype(_F32), axis=1)}


def _aggregates(loads: Mapping[str, jax.Array], c: jax.Array, top_k: int, p: str) -> dict[str, jax.Array]:
    """The figures over layers: means and maxima over the valid layers, the dead ratio
    over all (layer, expert) pairs, and the window's token counts."""
    valid = loads["valid"]
    num_l, num_e = int(c.shape[0]), int(c.shape[1])
    window_tokens = jnp.sum(c) / (num_l * top_k)
    return {
        f"{p}/dead_expert_ratio": jnp.mean(loads["dead_expert_ratio"]),
        f"{p}/maxvio.mean": _masked_mean(loads["maxvio"], valid),
        f"{p}/maxvio.max": _masked_max(loads["maxvio"], valid),
        f"{p}/load_imbalance": _masked_max(loads["load_imbalance"], valid),
        f"{p}/load_imbalance.max": _masked_max(loads["load_imbalance"], valid),
        f"{p}/load_imbalance.mean": _masked_mean(loads["load_imbalance"], valid),
        f"{p}/load_cv.mean": _masked_mean(loads["load_cv"], valid),
        f"{p}/load_cv.max": _masked_max(loads["load_cv"], valid),
        f"{p}/window_tokens": window_tokens.astype(_F32),
        f"{p}/expected_tokens_per_expert": (window_tokens * top_k / num_e).astype(_F32),
    }
