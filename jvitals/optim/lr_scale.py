"""Learning-rate scales that work with any optax schedule, set from the host.

Setting ``hyperparams['learning_rate']`` does nothing when the learning rate is a schedule
(it is recomputed each step), so jvitals multiplies the *final update* by a separate
hyperparameter instead::

    update' = lr_scale * tx.update(grads)          # = (lr_scale * lr_t) * direction_t

the same as scaling the learning rate at every step for every optimizer whose update is
linear in it (SGD, Adam(W), Lion...). With ``groups=`` every leaf belongs to a group
(``"embedding"``, ``"lm_head"``, ``"layer_{i}"``, ``"other"``) with a scale of its own. The
scales are float32 scalars in the optimizer state (checkpointed with it; :func:`set_lr_scale`
keeps dtype, shape and sharding, so a jitted step does not retrace), and the wrapped update
gets the scale in force as ``vitals_lr_scale=`` (:data:`LR_SCALE_ARG`) for the recorder.
Groups, the extra argument and an example: docs/REMEDIES.md, "with_lr_scale, in detail".
"""

from __future__ import annotations

import numbers
import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jvitals.metrics.optimizer import LR_SCALE, LR_SCALE_ARG  # the names the recorder reads
from jvitals.metrics.roles import LeafRole, Roles, assign_roles, check_roles
from jvitals.metrics.paths import leaves_by_path, natural_key, path_str
from jvitals.metrics.variables import value_of

__all__ = [
    "LR_SCALE",
    "LR_SCALE_ARG",
    "LRGroupScaleState",
    "REMEDY_SETTINGS",
    "get_lr_scale",
    "get_lr_scales",
    "get_remedy",
    "has_lr_scale",
    "has_remedy",
    "leaf_groups",
    "remedy",
    "set_lr_scale",
    "set_remedy",
    "with_lr_scale",
]

T = TypeVar("T")

REMEDY_SETTINGS: Mapping[str, float] = {"qk_clip_tau": 0.0, "z_loss": 0.0}
"""The remedies' settings :func:`with_lr_scale` holds beside the LR scale, as stored when
off: QK-clip's tau (0 stored: no clip; :func:`remedy` reads it as ``+inf``, so a checkpoint
holds only finite values whatever dtype it is cast to) and the z-loss weight (0). The guard's
remedies set them (:func:`set_remedy`); the train step reads them (:func:`remedy`)."""

GroupsArg = Union[None, str, Callable[[Any], Any], Mapping[str, float]]
"""``None``, ``"roles"``, a function ``params -> pytree of group names``, or a
mapping ``{group: initial scale}`` over the roles groups."""


class LRGroupScaleState(NamedTuple):
    """State of the per-group scale inside :func:`with_lr_scale` (``groups=`` set).

    Attributes:
      scales: ``{group name: float32 scalar}``; the update of a leaf in group ``g``
        is multiplied by ``scales[g]`` (and then by the global ``lr_scale``).
    """

    scales: dict[str, jax.Array]


# ----------------------------------------------------------------------------------
# Groups.


def _roles_group(lr: LeafRole) -> str | tuple[tuple[str, ...], int]:
    if lr.role in ("embedding", "lm_head"):
        return lr.role
    if lr.stack is not None:
        return tuple(f"layer_{i}" for i in lr.layers), lr.stack_axis
    if lr.layer is not None:
        return f"layer_{lr.layer}"
    return "other"


def leaf_groups(tree: Any, groups: GroupsArg = "roles", roles: Roles | None = None
                ) -> list[str | tuple[tuple[str, ...], int]]:
    """The group of every leaf of ``tree``, in ``jax.tree`` flatten order.

    Args:
      tree: a parameter (or update) pytree; only paths and shapes are read, so it
        works on tracers and ``ShapeDtypeStruct``\\ s.
      groups: ``"roles"`` (or a mapping, which uses the roles groups): a leaf of
        role ``embedding`` is ``"embedding"``, of role ``lm_head`` ``"lm_head"``, a
        leaf of layer ``i`` ``"layer_{i}"``, anything else ``"other"``; or a
        function ``tree -> pytree of group names`` (one ``str`` per leaf).
      roles: the :class:`~jvitals.metrics.roles.Roles` for ``"roles"`` (defaults if None).

    Returns:
      Per leaf, a group name, or for an ``nn.scan``-stacked leaf
      ``((name of slice 0, name of slice 1, ...), layer axis)``.

    Raises:
      ValueError: if the function's result does not give one ``str`` per leaf.
    """
    if groups is None:
        raise ValueError("leaf_groups: groups=None has no groups; pass 'roles' or a function")
    if callable(groups) and not isinstance(groups, str):
        names = groups(tree)
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        try:
            per_leaf = treedef.flatten_up_to(names)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "with_lr_scale(groups=fn): fn(params) must return a pytree of the params' "
                f"structure with one group name (str) per leaf; got {type(names).__name__} "
                f"that does not match ({e})") from None
        for (p, _), g in zip(flat, per_leaf):
            if not isinstance(g, str) or not g:
                raise ValueError(
                    f"with_lr_scale(groups=fn): the group of {path_str(p)!r} "
                    f"is {g!r}; expected a non-empty str (a group name)")
        return list(per_leaf)
    if isinstance(groups, str) and groups != "roles":
        raise ValueError(f"with_lr_scale(groups={groups!r}): expected None, 'roles', a function "
                         "params -> pytree of group names, or a mapping {group: initial scale}")
    return [_roles_group(lr) for lr in assign_roles(tree, roles)]


def _group_names(per_leaf: Sequence[Any]) -> list[str]:
    seen: dict[str, None] = {}
    for g in per_leaf:
        for n in ((g,) if isinstance(g, str) else g[0]):
            seen.setdefault(n, None)
    return list(seen)


def _scale_by_group(groups: GroupsArg, roles: Roles | None,
                    init: Mapping[str, float]) -> optax.GradientTransformation:
    """``update_leaf *= scales[group(leaf)]`` (per slice for stacked leaves)."""

    def init_fn(params):
        names = _group_names(leaf_groups(params, groups, roles))
        unknown = sorted(set(init) - set(names))
        if unknown:
            raise ValueError(
                f"with_lr_scale(groups={dict(init)!r}): group(s) {unknown} have no parameter; "
                f"the groups of these params are {sorted(names, key=natural_key)}")
        return LRGroupScaleState({n: jnp.asarray(init.get(n, 1.0), jnp.float32) for n in names})

    def update_fn(updates, state, params=None):
        per_leaf = leaf_groups(params if params is not None else updates, groups, roles)
        leaves, treedef = jax.tree.flatten(updates)
        if len(per_leaf) != len(leaves):
            raise ValueError(f"with_lr_scale: params have {len(per_leaf)} leaves, updates {len(leaves)}")
        missing = sorted(set(_group_names(per_leaf)) - set(state.scales))
        if missing:
            raise ValueError(f"with_lr_scale: group(s) {missing} are not in the state (groups "
                             f"{sorted(state.scales)}); re-create the state with tx.init(params)")
        out = []
        for u, g in zip(leaves, per_leaf):
            if isinstance(g, str):
                m = state.scales[g]
            else:
                names, axis = g
                shape = [1] * u.ndim
                shape[axis] = len(names)
                m = jnp.stack([state.scales[n] for n in names]).reshape(shape)
            out.append((u * m).astype(u.dtype))
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------------
# The wrapper.


def _check_scale(value: Any, where: str) -> None:
    """A scale is a real number (a Python or NumPy number, a 0-d array), never a str, None or a state."""
    number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    array = isinstance(value, (np.ndarray, jax.Array)) and value.shape == () and (
        jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer))
    if not (number or array):
        raise TypeError(f"{where}: a learning-rate scale must be a number, e.g. 0.5, got {type(value).__name__} "
                        f"{value!r:.60}" + ("; the order is set_lr_scale(tree, value, group=None)"
                                             if where.startswith("set_") else ""))


def with_lr_scale(tx: optax.GradientTransformation, lr_scale: float = 1.0, *,
                  groups: GroupsArg = None, roles: Roles | None = None
                  ) -> optax.GradientTransformationExtraArgs:
    """Wraps ``tx`` so its updates are multiplied by host-settable scales.

    ``update = lr_scale * lr_scale[group] * tx.update(...)``; with any optax
    schedule inside ``tx`` this scales the learning rate at every step while the
    schedule keeps running.

    Args:
      tx: any optax transformation (a chain, an optimizer with a schedule, ...).
      lr_scale: the initial global scale (1.0: no change).
      groups: None (one global scale, the state of earlier versions); ``"roles"``
        (a scale per group of :func:`leaf_groups`: ``"embedding"``, ``"lm_head"``,
        ``"layer_{i}"``, ``"other"``); a function ``params -> pytree of group
        names`` (one ``str`` per leaf); or a mapping ``{group: initial scale}``
        (roles groups, the others starting at 1.0).
      roles: the :class:`~jvitals.metrics.roles.Roles` for the roles groups.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      ``InjectStatefulHyperparamsState`` with ``hyperparams['lr_scale']`` a float32
      scalar, beside the remedies' settings the guard turns on mid-run
      (:data:`REMEDY_SETTINGS`: ``qk_clip_tau``, ``z_loss``; read by the step with
      :func:`remedy`, never by the update); with ``groups`` its ``inner_state`` also holds an
      :class:`LRGroupScaleState`. Extra update arguments (``loss=``, ...) are
      forwarded to ``tx``, plus ``vitals_lr_scale=`` (the global scale in force).

    Raises:
      TypeError: ``tx`` not a transform (an uncalled factory), a scale not a number,
        ``groups`` of another kind, ``roles`` not a Roles.
      ValueError: a scale not finite and > 0; (at ``init``) if a mapping names a group
        no leaf belongs to.

    Example::

      tx = with_lr_scale(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched)))
      tx = with_lr_scale(optax.adamw(sched), groups={"embedding": 0.5, "lm_head": 0.5})
    """
    if not callable(getattr(tx, "update", None)) or not callable(getattr(tx, "init", None)):
        hint = " (a factory: call it, e.g. optax.adamw(lr))" if callable(tx) else ""
        raise TypeError(f"with_lr_scale expects an optax GradientTransformation, got {type(tx).__name__}{hint}")
    _check_scale(lr_scale, "with_lr_scale(lr_scale=...)")
    if not (float(lr_scale) > 0 and float(lr_scale) < float("inf")):
        raise ValueError(f"with_lr_scale(lr_scale={lr_scale!r}): the initial scale must be a finite number > 0")
    roles = check_roles(roles, "with_lr_scale")
    if groups is None:
        members: tuple[optax.GradientTransformation, ...] = ()
    else:
        init: Mapping[str, float] = {}
        if not isinstance(groups, (str, Mapping)) and not callable(groups):
            raise TypeError(f"with_lr_scale(groups={groups!r}) expects None, 'roles', a function params -> "
                            f"group names, or a mapping {{group: initial scale}}, e.g. {{'embedding': 0.5}}")
        if isinstance(groups, Mapping):
            for k, v in groups.items():
                _check_scale(v, f"with_lr_scale(groups={{{k!r}: ...}})")
            init = {str(k): float(v) for k, v in groups.items()}
            groups = "roles"
        if isinstance(groups, str) and groups != "roles":
            leaf_groups({}, groups, roles)  # raises: names what is allowed
        members = (_scale_by_group(groups, roles, init),)

    def factory(lr_scale, qk_clip_tau, z_loss):
        del qk_clip_tau, z_loss    # the step reads them (remedy()); the update does not
        return optax.chain(tx, *members, optax.scale(lr_scale))

    injected = optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(
        lr_scale=float(lr_scale), **REMEDY_SETTINGS)

    def update_fn(updates, state, params=None, **extra):
        outer = extra.pop(LR_SCALE_ARG, None)
        own = jnp.asarray(state.hyperparams[LR_SCALE], jnp.float32)
        in_force = own if outer is None else own * jnp.asarray(outer, jnp.float32)
        return injected.update(updates, state, params, **{LR_SCALE_ARG: in_force}, **extra)

    return optax.GradientTransformationExtraArgs(injected.init, update_fn)


# ----------------------------------------------------------------------------------
# Reading and setting.
#
# The scales are found by their leaf paths, which are the same whatever holds the
# state: optax's NamedTuples (``.../hyperparams/lr_scale``, ``.../inner_state/1/
# scales/embedding``), the same with Flax NNX ``OptState`` Variables around the
# leaves (``nnx.Optimizer.opt_state``), or the nested dicts of an ``nnx.State``
# (``nnx.state((model, optimizer))``, where the NamedTuples are gone).


class _Slot(NamedTuple):
    """One scale leaf: its leaf path in the tree and its group (None: a global scale)."""

    path: str
    group: str | None


def _slots(tree: Any) -> list[_Slot]:
    """Every global ``lr_scale`` leaf of ``tree`` and every group scale inside one."""
    paths = list(leaves_by_path(tree))
    suffix = f"hyperparams/{LR_SCALE}"
    prefixes = [p[: -len(suffix)] for p in paths if p == suffix or p.endswith("/" + suffix)]
    out = [_Slot(p + suffix, None) for p in prefixes]
    for p in paths:
        m = _GROUP_PATH.search(p)
        if m and any(p.startswith(pre + "inner_state/") for pre in prefixes):
            out.append(_Slot(p, m.group(1)))
    return out


_GROUP_PATH = re.compile(r"(?:^|/)scales/([^/]+)$")



def _group_names_in(tree: Any) -> list[str]:
    """The group names in ``tree``'s group states, in natural order (layer_2 < layer_10)."""
    return sorted({s.group for s in _slots(tree) if s.group is not None}, key=natural_key)


def _check_group(tree: Any, group: str, what: str) -> None:
    names = _group_names_in(tree)
    if not names:
        raise ValueError(
            f"{what}(group={group!r}): the optimizer state holds no per-group scales (built with "
            "jvitals.with_lr_scale(tx) without groups). Build it with "
            "jvitals.with_lr_scale(tx, groups='roles') or groups=fn, or pass group=None for the "
            "global scale.")
    if group not in names:
        raise ValueError(f"{what}(group={group!r}): no parameter belongs to group {group!r}; "
                         f"the groups are {names} (or group=None for the global scale)")


def has_lr_scale(tree: Any, group: str | None = None) -> bool:
    """True if ``tree`` (an opt_state, a whole train state, an ``nnx.Optimizer``'s
    ``opt_state`` or an ``nnx.State``) holds an ``lr_scale`` (with ``group``: a scale
    for that group)."""
    return any(s.group == group for s in _slots(tree))


def _one_value(values: list[float], what: str) -> float:
    if any(v != values[0] for v in values):
        raise ValueError(f"Expected one '{what}' value, found {len(values)} that differ: "
                         f"{values}. Set them together with jvitals.set_lr_scale(tree, value).")
    return values[0]


def _host(x: Any) -> float:
    return float(np.asarray(jax.device_get(value_of(x))))


def get_lr_scale(tree: Any, group: str | None = None) -> float:
    """Reads the global ``lr_scale`` (or one group's scale) from anywhere in ``tree``.

    Args:
      tree: an optimizer state, or any pytree containing one (a flax ``TrainState``,
        a dict), built with :func:`with_lr_scale`; a Flax NNX ``nnx.Optimizer``'s
        ``opt_state`` or an ``nnx.State`` holding it (``nnx.state((model, optimizer))``).
      group: None for the global scale (which multiplies every group's), or a group
        name (``"embedding"``, ``"layer_3"``...): that group's own factor.

    Returns:
      The scale as a Python float (one host read).

    Raises:
      ValueError: if ``tree`` holds no such scale (naming the groups there are), or
        holds several that differ.
    """
    if group is not None:
        _check_group(tree, group, "get_lr_scale")
    slots = [s for s in _slots(tree) if s.group == group]
    if not slots:
        raise ValueError(
            "Expected an optimizer state built with jvitals.with_lr_scale(tx) (an "
            f"inject_hyperparams state with a '{LR_SCALE}' hyperparameter), found none "
            f"in a {type(tree).__name__}. Wrap the optimizer: "
            "tx = jvitals.with_lr_scale(tx).")
    values = leaves_by_path(tree)
    return _one_value([_host(values[s.path]) for s in slots],
                      LR_SCALE if group is None else f"{LR_SCALE}[{group}]")


def get_lr_scales(tree: Any) -> dict[str, float]:
    """Every group's own scale, ``{group: float}`` (empty without groups; one host read each)."""
    if tree is None:
        raise TypeError("get_lr_scales: tree is None; pass the optimizer state (or the train state) built "
                        "with jvitals.with_lr_scale(tx, groups=...)")
    return {g: get_lr_scale(tree, g) for g in _group_names_in(tree)}


def _like(old: Any, value: float) -> Any:
    """``value`` as an array with ``old``'s dtype, shape, sharding and commitment.

    Committed or not is part of a jitted function's cache key: an uncommitted
    scale (what ``tx.init`` and a single-device jitted step give) replaced by a
    committed one would compile the step again, once per changed scale.
    """
    if isinstance(old, jax.core.Tracer):
        return jnp.full(jnp.shape(old), value, dtype=jnp.result_type(old))
    if isinstance(old, jax.Array):
        host = np.full(old.shape, value, dtype=old.dtype)
        if not old.committed:  # as tx.init and a jitted step leave it: a committed one recompiles
            return jax.device_put(host)
        sharding = old.sharding
        if sharding.is_fully_addressable:
            return jax.device_put(host, sharding)
        # Multi-process: every process supplies its own shards of the same value.
        return jax.make_array_from_callback(old.shape, sharding, lambda idx: host[idx])
    dtype = getattr(old, "dtype", np.float32)
    return np.full(np.shape(old), value, dtype=dtype)


def set_lr_scale(tree: T, value: float, group: str | None = None) -> T:
    """Sets the global ``lr_scale`` (or one group's scale) everywhere in ``tree``.

    The new value keeps the old one's dtype (float32 with :func:`with_lr_scale`),
    shape and sharding, so a jitted train step that takes ``tree`` does not retrace
    or recompile.

    Args:
      tree: an optimizer state, or any pytree containing one; a Flax NNX
        ``nnx.Optimizer``'s ``opt_state`` or an ``nnx.State`` holding it (apply the
        result with ``nnx.update(optimizer, set_lr_scale(nnx.state(optimizer), v))``).
      value: the new scale (e.g. ``0.9 * get_lr_scale(tree)``).
      group: None for the global scale, or a group name: that group's own factor
        (the global one still multiplies it).

    Returns:
      A copy of ``tree`` with the scale replaced; the input is not modified.

    Raises:
      TypeError: ``value`` is not a number (a str, None; arguments swapped).
      ValueError: if ``value`` is not a finite number > 0, or ``tree`` holds no such scale
        (naming the groups there are).
    """
    _check_scale(value, "set_lr_scale(tree, value)")
    value = float(value)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"set_lr_scale(value={value!r}{'' if group is None else f', group={group!r}'}): a "
                         "learning-rate scale must be a finite number > 0 (a negative one ascends the "
                         "loss, NaN or inf breaks the weights); 0.9 * get_lr_scale(tree) is a 10% cut")
    if group is not None:
        _check_group(tree, group, "set_lr_scale")
    elif not has_lr_scale(tree):
        get_lr_scale(tree)  # raises the explanatory error
    targets = {s.path for s in _slots(tree) if s.group == group}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _like(x, value) if path_str(p) in targets else x, tree)


# ----------------------------------------------------------------------------------
# The remedies' settings (QK-clip's tau, the z-loss weight): set by the guard, read by the step.


def _check_remedy_name(name: str, what: str) -> None:
    if name not in REMEDY_SETTINGS:
        raise ValueError(f"{what}: unknown remedy setting {name!r}; the settings are "
                         f"{sorted(REMEDY_SETTINGS)}")


def _remedy_paths(tree: Any, name: str) -> list[str]:
    suffix = f"hyperparams/{name}"
    return [p for p in leaves_by_path(tree) if p == suffix or p.endswith("/" + suffix)]


def has_remedy(tree: Any, name: str) -> bool:
    """True if ``tree`` holds the remedy setting ``name`` (built with :func:`with_lr_scale`)."""
    _check_remedy_name(name, "has_remedy")
    return bool(_remedy_paths(tree, name))


def remedy(tree: Any, name: str) -> jax.Array:
    """The remedy setting ``name`` as the train step reads it (a traced float32 under ``jit``).

    ``qk_clip_tau`` (``+inf`` until the guard turns QK-clip on) and ``z_loss`` (0 until it
    turns the z-loss on); a state without them (an optimizer not wrapped with
    :func:`with_lr_scale`) reads as off.

    Args:
      tree: the optimizer state (or a train state, an ``nnx.Optimizer``'s ``opt_state``).
      name: ``"qk_clip_tau"`` or ``"z_loss"``.

    Returns:
      A float32 scalar.

    Example::

      loss = loss + vitals.z_loss(logits, mask, weight=vitals.remedy(state.opt_state, "z_loss"))
      params = vitals.qk_clip(params, metrics, vitals.remedy(opt_state, "qk_clip_tau"))
    """
    _check_remedy_name(name, "remedy")
    paths = _remedy_paths(tree, name)
    v = (jnp.float32(REMEDY_SETTINGS[name]) if not paths
         else jnp.asarray(value_of(leaves_by_path(tree)[paths[0]]), jnp.float32))
    if name == "qk_clip_tau":
        v = jnp.where(v > 0, v, jnp.float32(jnp.inf))      # stored 0: off
    return v


def get_remedy(tree: Any, name: str) -> float:
    """The remedy setting ``name`` on the host (one read); its off value where ``tree`` has none."""
    return _host(remedy(tree, name))


def set_remedy(tree: T, name: str, value: float) -> T:
    """Sets the remedy setting ``name`` everywhere in ``tree`` (no retrace: dtype, shape and
    sharding kept, as :func:`set_lr_scale`).

    Raises:
      ValueError: an unknown name, a value out of range (tau must be > 0, the z-loss weight
        >= 0; both may not be NaN), or a ``tree`` without the setting.
    """
    _check_remedy_name(name, "set_remedy")
    value = float(value)
    if value != value or (name == "qk_clip_tau" and not value > 0) or (name == "z_loss" and not 0 <= value < np.inf):
        raise ValueError(f"set_remedy({name!r}, {value!r}): qk_clip_tau must be > 0 (+inf: off), z_loss a "
                         "finite number >= 0 (0: off)")
    if name == "qk_clip_tau" and value == np.inf:
        value = 0.0                                          # stored as off
    targets = set(_remedy_paths(tree, name))
    if not targets:
        raise ValueError(f"set_remedy({name!r}): the {type(tree).__name__} holds no remedy settings; build "
                         "the optimizer with tx = jvitals.with_lr_scale(tx)")
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _like(x, value) if path_str(p) in targets else x, tree)
