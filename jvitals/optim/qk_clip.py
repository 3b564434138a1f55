"""QK-clip: shrink a layer's ``Wq`` and ``Wk`` when its attention logits grew too large.

METRICS.md §6 prescribes "clip the attention logits" when ``act/attn_logits_abs.max/layer_{i}``
grows. QK-clip (MuonClip, Kimi K2) acts on the weights after an optimizer step: for each
layer whose max pre-softmax logit ``m_i`` exceeds ``tau``, with ``gamma_i = tau / m_i``::

    Wq_i <- sqrt(gamma_i) * Wq_i      Wk_i <- sqrt(gamma_i) * Wk_i     (and their biases)

so every logit of that layer shrinks by ``gamma_i``; other layers are untouched. Q and K are
found by :mod:`jvitals.metrics.roles` (separate kernels, or the parts of a fused QKV kernel
split as the gradient figures split it). Per head (``attn_logits_max`` of shape ``[L, H]``),
head ``h`` shrinks by ``gamma_{i,h}`` exactly. Not for QK-norm models (the norm cancels it).

Q without K (MLA), biases, the per-head form and grouped-query heads: docs/REMEDIES.md,
"qk_clip, in detail".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jvitals.metrics.qkv import QKVLayout, kv_layout, merge_qkv, qkv_layout, resolve_fused, split_qkv
from jvitals.metrics.roles import LeafRole, QKVSplit, Roles, assign_roles, check_roles

__all__ = ["qk_clip"]

_F32 = jnp.float32
_Q_ROLES = ("q", "q_up")
_K_ROLES = ("k", "kv", "qkv")
_KERNEL_NAMES = ("kernel", "weight", "w")


def _module(path: str) -> str | None:
    """The module path of a kernel leaf (``.../q_proj/kernel`` -> ``.../q_proj``)."""
    parts = path.split("/")
    return "/".join(parts[:-1]) if parts[-1] in _KERNEL_NAMES and len(parts) > 1 else None


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _layer_shape(lr: LeafRole) -> tuple[int, ...]:
    if lr.stack is None:
        return lr.shape
    return lr.shape[: lr.stack_axis] + lr.shape[lr.stack_axis + 1:]


def _check_tau(tau: Any) -> None:
    if isinstance(tau, (jax.core.Tracer,)):
        return
    if isinstance(tau, (str, bytes)) or tau is None:
        raise ValueError(f"qk_clip: tau={tau!r} must be a positive number, e.g. 100.0, not a string (or "
                         f"vitals.remedy(opt_state, 'qk_clip_tau'))")
    try:
        t = float(np.asarray(tau))
    except (TypeError, ValueError):
        raise ValueError(f"qk_clip: tau={tau!r} must be a positive number (the largest attention "
                         "logit allowed, e.g. 100)") from None
    if not t > 0:
        raise ValueError(f"qk_clip: tau={tau!r} must be a positive number (the largest attention "
                         "logit allowed, e.g. 100; +inf: no clip); a negative or zero tau would zero "
                         "or flip the attention")


def _place(vec: jax.Array, lr: LeafRole, out_axes: Sequence[int], out_sizes: Sequence[int]) -> jax.Array:
    """A factor array broadcastable to the leaf.

    ``vec``: ``[n_layers_in_leaf, prod(out_sizes)]`` for a stacked leaf, ``[prod]``
    otherwise; ``out_axes`` are axes of one layer's shape (consecutive, increasing).
    """
    nd = len(lr.shape)
    if lr.stack is None:
        arr = vec.reshape(tuple(out_sizes))
        axes = list(out_axes)
    else:
        arr = vec.reshape((vec.shape[0],) + tuple(out_sizes))
        axes = [lr.stack_axis] + [a + 1 if a >= lr.stack_axis else a for a in out_axes]
    order = np.argsort(axes)
    arr = jnp.transpose(arr, tuple(int(i) for i in order))
    shape = [1] * nd
    for a, s in zip(sorted(axes), (arr.shape[i] for i in range(arr.ndim))):
        shape[a] = s
    return arr.reshape(shape)


def qk_clip(params: Any, attn_logits_max: Any, tau: Any, *, roles: Roles | None = None) -> Any:
    """Scales ``Wq`` and ``Wk`` (and biases) of each layer whose max logit exceeds ``tau``.

    For layer ``i`` with ``m_i = attn_logits_max[i] > tau`` (strictly; non-finite
    maxima are left alone), ``Wq`` and ``Wk`` are multiplied by ``sqrt(tau / m_i)``
    so the layer's logits shrink by ``tau / m_i`` (see the module docstring for
    fused QKV, Q-only layers and the per-head form).

    The weights are read and written only at a step where some layer exceeds ``tau``
    (a ``lax.cond``): with ``tau = +inf`` (the guard's setting before a remedy turns it on,
    :func:`jvitals.remedy`) the step pays one comparison per layer.

    Args:
      params: the parameter pytree (after the optimizer step).
      attn_logits_max: the max |pre-softmax attention logit| per layer, ``[L]``
        (the ``act/attn_logits_abs.max/layer_{i}`` figures in layer order), or per
        layer and query head, ``[L, H]``; or the step's metrics dict, from which the
        ``act/attn_logits_abs.max/layer_{i}`` figures are taken (the whole model's
        ``act/attn_logits_abs.max`` for every layer where there are none). May be traced.
      tau: the largest logit allowed (> 0; e.g. 100 as in MuonClip; ``+inf``: no clip);
        a traced scalar too (``vitals.remedy(opt_state, "qk_clip_tau")``).
      roles: the :class:`~jvitals.metrics.roles.Roles` finding Q, K and the layers.

    Returns:
      ``params`` with the same structure, dtypes and shapes; pure and jittable.

    Raises:
      TypeError: ``params`` or ``attn_logits_max`` None, ``roles`` not a Roles.
      ValueError: if ``tau`` is not a positive number (a string too), ``attn_logits_max``'s length
        is not the number of layers, the params hold no Q/K projection, or a
        kernel's width does not split into the heads.

    Example::

      params = vitals.qk_clip(params, metrics, tau=100.0)   # metrics: activation_metrics' dict
      params = vitals.qk_clip(params, metrics, vitals.remedy(opt_state, "qk_clip_tau"))  # the guard's
    """
    roles = check_roles(roles, "qk_clip")
    _check_tau(tau)
    if params is None or attn_logits_max is None:
        raise TypeError(f"qk_clip: {'params' if params is None else 'attn_logits_max'} is None; call "
                        f"qk_clip(params, metrics, tau) with the params pytree and activation_metrics' dict "
                        f"(or the [L] per-layer max logits)")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    infos = assign_roles(params, roles)
    layers = [i for lr in infos for i in lr.layers]
    n_layers = max(layers) + 1 if layers else 0
    if isinstance(attn_logits_max, Mapping):
        attn_logits_max = _from_metrics(attn_logits_max, n_layers)
    gamma, per_head = layer_gammas(attn_logits_max, tau, n_layers)
    plan = _QKPlan.build(infos, roles)

    def clip(leaves: list[jax.Array]) -> list[jax.Array]:
        return _clip_leaves(leaves, infos, plan, gamma, per_head)

    leaves = [x for _, x in flat]
    if any(plan.kernel_of(lr) is not None for lr in infos):
        leaves = jax.lax.cond(jnp.any(gamma < 1.0), clip, lambda xs: list(xs), leaves)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _from_metrics(metrics: Mapping[str, Any], n_layers: int, metric: str = "act/attn_logits_abs.max"
                  ) -> jax.Array:
    """``[L]`` per-layer maxima from a metrics dict (the whole model's where a layer has none)."""
    per = [metrics.get(f"{metric}/layer_{i}") for i in range(n_layers)]
    if all(v is None for v in per):
        if metric not in metrics:
            raise ValueError(f"qk_clip: the metrics dict has no {metric!r} figure (per layer: "
                             f"{metric}/layer_{{i}}); compute vitals.activation_metrics(sown, "
                             "names=('attn_logits',)) in the step and pass its dict")
        per = [metrics[metric]] * n_layers
    elif any(v is None for v in per):
        missing = [i for i, v in enumerate(per) if v is None]
        raise ValueError(f"qk_clip: the metrics dict has {metric}/layer_{{i}} for some layers but not "
                         f"for {missing} of the {n_layers} the params hold")
    return jnp.stack([jnp.asarray(v, _F32) for v in per])


def _clip_leaves(leaves: Sequence[jax.Array], infos: Sequence[LeafRole], plan: "_QKPlan", gamma: jax.Array,
                 per_head: bool) -> list[jax.Array]:
    out = []
    for x, lr in zip(leaves, infos):
        kl = plan.kernel_of(lr)
        if kl is None:
            out.append(x)
            continue
        qf, kf, _ = plan.factors(_parent(_module(kl.path) or kl.path), gamma, per_head)
        qf, kf = _per_layer(qf, lr), _per_layer(kf, lr)               # [Hq] / [n, Hq] ...
        if kl.role == "qkv":
            out.append(plan.scale_fused(x, lr, kl, qf, kf))
        elif kl.role == "kv":
            out.append(plan.scale_kv(x, lr, kl, kf, per_head))
        else:
            out.append(_scale_leaf(x, lr, qf if kl.role in _Q_ROLES else kf, per_head,
                                   _out_axes(lr, plan.is_bias(lr), plan.d_model)))
    return out


def layer_gammas(attn_logits_max: Any, tau: Any, n_layers: int) -> tuple[jax.Array, bool]:
    """The shrink factor of each layer (or layer and query head): ``[L, 1]`` or ``[L, H]``.

    ``gamma = tau / m`` where ``m > tau`` and ``m`` is finite, else 1.

    Raises:
      ValueError: if ``attn_logits_max`` is not ``[n_layers]`` or ``[n_layers, H]``.
    """
    m = jnp.asarray(attn_logits_max, _F32)
    if m.ndim not in (1, 2) or n_layers == 0 or m.shape[0] != n_layers:
        raise ValueError(
            f"qk_clip: attn_logits_max has shape {tuple(m.shape)}; expected [{n_layers}] (one max "
            f"attention logit per layer, the params have {n_layers} layers) or [{n_layers}, H] "
            "(per query head)")
    tau_ = jnp.asarray(tau, _F32)
    gamma = jnp.where(jnp.isfinite(m) & (m > tau_), tau_ / m, 1.0)
    return (gamma, True) if m.ndim == 2 else (gamma[:, None], False)


def _out_axes(lr: LeafRole, is_bias: bool, d_model: int | None = None,
              shape: Sequence[int] | None = None) -> tuple[int, ...]:
    """The output (head) axes of one layer's kernel, or every axis of a bias.

    A 2-D kernel ``[D, H*Dh]``: the last. A per-head einsum weight: every axis but its
    input axis, the first of the model width ``d_model`` (Llama's ``[D, H, Dh]``,
    Gemma's ``[H, D, Dh]``); without the width, the last two.
    """
    ls = tuple(shape) if shape is not None else _layer_shape(lr)
    nd = len(ls)
    if is_bias:
        return tuple(range(nd))
    if nd >= 3 and d_model is not None and d_model in ls:
        d = ls.index(d_model)
        return tuple(a for a in range(nd) if a != d)
    return (nd - 2, nd - 1) if nd >= 3 else (nd - 1,)


def _per_layer(v: jax.Array, lr: LeafRole) -> jax.Array:
    """The rows of a per-layer factor ``[L, ...]`` that a leaf holds."""
    if lr.stack is not None:
        return v[lr.first_layer: lr.first_layer + lr.num_layers]
    return v[lr.layer] if lr.layer is not None else jnp.ones_like(v[0])


def _spread(f: jax.Array, width: int, what: str) -> jax.Array:
    """Per-head factors ``[..., heads]`` repeated over each head's entries: ``[..., width]``."""
    heads = f.shape[-1]
    if width % heads:
        raise ValueError(f"qk_clip: {what} has {width} entries, not divisible into {heads} heads")
    return jnp.repeat(f, width // heads, axis=-1)


def _scale_leaf(x: jax.Array, lr: LeafRole, f: jax.Array, per_head: bool,
                axes: tuple[int, ...]) -> jax.Array:
    """A separate Q or K kernel (or its bias) times its factor, per layer or per head."""
    if not per_head:
        axes, sizes, vec = (), [], f.reshape(f.shape[:-1])
    else:
        ls = _layer_shape(lr)
        sizes = [ls[a] for a in axes]
        vec = _spread(f, math.prod(sizes), f"the output of {lr.path!r}")
    return (x.astype(_F32) * _place(vec, lr, axes, sizes)).astype(x.dtype)


@dataclasses.dataclass
class _QKPlan:
    """Where Q and K live: kernels by module, each attention's Q/K widths, which layers have K.

    Attributes:
      roles: the roles (for the fused-QKV layout and split).
      kernels: module path -> the Q / K / fused-QKV kernel leaf.
      o_numel: attention module path -> one layer's output-projection size (the fused split needs it).
      widths: attention module path -> ``{"q": Q width, "k": K width}`` (one layer's output entries).
      has_k: per layer, whether it has a K projection (MLA's ``q_up`` layers may not).
      d_model: the model width (the embedding's last axis), or None: the input axis of
        a per-head einsum weight.
    """

    roles: Roles
    kernels: dict[str, LeafRole]
    o_numel: dict[str, int]
    widths: dict[str, dict[str, int]]
    has_k: np.ndarray
    d_model: int | None = None

    @classmethod
    def build(cls, infos: Sequence[LeafRole], roles: Roles) -> "_QKPlan":
        """Finds the kernels and reads their widths.

        Raises:
          ValueError: if no leaf has a Q/K role (names ``explain_roles`` and a pattern to add).
        """
        kernels: dict[str, LeafRole] = {}
        o_numel: dict[str, int] = {}
        for lr in infos:
            mod = _module(lr.path)
            if lr.role in _Q_ROLES + _K_ROLES:
                kernels[mod if mod is not None else lr.path] = lr
            if lr.role == "o":
                o_numel.setdefault(_parent(mod if mod is not None else lr.path), math.prod(_layer_shape(lr)))
        if not kernels:
            raise ValueError(
                "qk_clip: no Q/K projection found (no leaf of role 'q', 'k', 'qkv' or 'q_up'); check "
                "jvitals.explain_roles(params) and add a pattern, e.g. "
                "Roles().extend(q=r'(^|/)my_query/kernel$', k=r'(^|/)my_key/kernel$')")
        n_layers = 1 + max((i for lr in infos for i in lr.layers), default=-1)
        emb = [lr for lr in infos if lr.role == "embedding" and len(lr.shape) == 2]
        plan = cls(roles, kernels, o_numel, {}, np.zeros(n_layers, bool), emb[0].shape[-1] if emb else None)
        for mod, lr in kernels.items():
            attn = _parent(mod)
            if lr.role == "qkv":
                nq, nk, _ = plan.fused(lr)[3].sizes
                plan.widths.setdefault(attn, {}).update(q=nq, k=nk)
            elif lr.role == "kv":
                kshape = plan.kv_part_shape(lr)
                plan.widths.setdefault(attn, {})["k"] = math.prod(
                    kshape[a] for a in _out_axes(lr, False, plan.d_model, kshape))
            else:
                ls = _layer_shape(lr)
                plan.widths.setdefault(attn, {})["k" if lr.role == "k" else "q"] = math.prod(
                    ls[a] for a in _out_axes(lr, False, plan.d_model))
            if lr.role in _K_ROLES:
                plan.has_k[list(lr.layers)] = True
        return plan

    def kv_part_shape(self, lr: LeafRole) -> tuple[int, ...]:
        """One layer's K part of a K/V kernel (role ``kv``), without the split axis if
        it held the parts stacked (Gemma's ``[2, KVH, D, Dh]`` -> ``[KVH, D, Dh]``)."""
        shape = _layer_shape(lr)
        lay = kv_layout(shape, lr.path)
        if shape[lay.axis] == 2:
            return shape[: lay.axis] + shape[lay.axis + 1:]
        return shape[: lay.axis] + (lay.sizes[1],) + shape[lay.axis + 1:]

    def scale_kv(self, x: jax.Array, lr: LeafRole, kl: LeafRole, kf: jax.Array, per_head: bool) -> jax.Array:
        """A K/V kernel (role ``kv``; or its bias): its K part times the K factor, V untouched."""
        shape = _layer_shape(kl)
        lay = kv_layout(shape if not self.is_bias(lr) else _layer_shape(lr), lr.path)
        dim = lay.axis + 1 if lr.stack_axis is not None and lay.axis >= lr.stack_axis else lay.axis
        n = lay.sizes[1]
        k, v = jnp.split(x, [n], axis=dim)
        if shape[lay.axis] == 2 and not self.is_bias(lr):   # stacked: the K part is [1, ...]
            kshape = self.kv_part_shape(kl)
            axes = tuple(a + (a >= lay.axis) for a in _out_axes(kl, False, self.d_model, kshape))
        else:
            axes = (lay.axis,) if not self.is_bias(lr) else tuple(range(len(_layer_shape(lr))))
        kpart = LeafRole(lr.path, tuple(k.shape), lr.role, lr.name, lr.layer, lr.stack, lr.stack_axis,
                         lr.first_layer, lr.num_layers)
        return jnp.concatenate([_scale_leaf(k, kpart, kf, per_head, axes), v], axis=dim)

    def is_bias(self, lr: LeafRole) -> bool:
        return lr.path.endswith("/bias") and _parent(lr.path) in self.kernels

    def kernel_of(self, lr: LeafRole) -> LeafRole | None:
        """The Q/K kernel a leaf is (or is the bias of), or None: the leaf is left alone."""
        if self.is_bias(lr):
            kl = self.kernels[_parent(lr.path)]
            return kl if lr.layers == kl.layers else None
        return lr if lr.role in _Q_ROLES + _K_ROLES and lr.layers else None

    def fused(self, lr: LeafRole) -> tuple[QKVSplit, str, int | None, QKVLayout]:
        """How one layer's fused kernel splits: (split with its axis, layout, q_size, QKVLayout)."""
        shape = _layer_shape(lr)
        o = self.o_numel.get(_parent(_module(lr.path) or lr.path))
        layout = self.roles.qkv_layout_of(lr.path)
        split, q_size = resolve_fused(shape, self.roles.qkv_split, o)
        return split, layout, q_size, qkv_layout(shape, split, path=lr.path, layout=layout, q_size=q_size)

    def factors(self, attn: str, gamma: jax.Array, per_head: bool) -> tuple[jax.Array, jax.Array, int]:
        """(Q factor per query head ``[L, Hq]``, K factor per KV head ``[L, G]``, heads per group).

        Per layer: ``sqrt(gamma)`` on Q and K where the layer has K, the whole ``gamma``
        on Q where it has none. Per head: one K head per Q head splits ``sqrt(gamma)``
        between them; a K head shared by several Q heads stays and each Q head takes
        its whole ``gamma``.
        """
        hk = jnp.asarray(self.has_k)[:, None]
        if not per_head:
            return jnp.where(hk, jnp.sqrt(gamma), gamma), jnp.sqrt(gamma), 1
        n_heads = gamma.shape[1]
        w = self.widths.get(attn, {})
        nq, nk = w.get("q"), w.get("k")
        if nq is None or nq % n_heads:
            raise ValueError(
                f"qk_clip: per-head maxima for {n_heads} heads, but the Q projection of "
                f"{attn or 'the model'!r} has {nq} output entries, not a multiple of {n_heads}; "
                "pass one maximum per layer instead")
        dh = nq // n_heads
        if nk is None:
            return gamma, jnp.ones_like(gamma), 1
        if nk % dh or n_heads % (nk // dh):
            raise ValueError(
                f"qk_clip: the K projection of {attn!r} has {nk} output entries, not a whole "
                f"number of heads of width {dh} dividing {n_heads} query heads")
        kvh = nk // dh
        if kvh == n_heads:
            return jnp.sqrt(gamma), jnp.sqrt(gamma), 1
        return gamma, jnp.ones((gamma.shape[0], kvh), _F32), n_heads // kvh

    def scale_fused(self, x: jax.Array, lr: LeafRole, kl: LeafRole, qf: jax.Array, kf: jax.Array) -> jax.Array:
        """A fused QKV kernel (or its bias): split as the roles do (contiguous or per-head
        interleaved), Q and K parts times their factors (heads in model order), merged back."""
        split, layout, q_size, lay = self.fused(kl)
        if self.is_bias(lr):
            split = dataclasses.replace(split, axis=len(_layer_shape(lr)) - 1)
        nq, nk, _ = lay.sizes
        q, k, v = split_qkv(x, split, path=kl.path, layout=layout, q_size=q_size, stack_axis=lr.stack_axis)
        ax = (split.axis,)
        q = (q.astype(_F32) * _place(_spread(qf, nq, f"the Q part of {lr.path!r}"), lr, ax, [nq])).astype(x.dtype)
        k = (k.astype(_F32) * _place(_spread(kf, nk, f"the K part of {lr.path!r}"), lr, ax, [nk])).astype(x.dtype)
        return merge_qkv((q, k, v), split, path=kl.path, layout=layout, q_size=q_size,
                         stack_axis=lr.stack_axis, fused_shape=x.shape)
