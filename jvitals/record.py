"""The optax recorder: gradient vitals of every step, inside the compiled update.

::

    tx = optax.chain(vitals.record(), optax.clip_by_global_norm(1.0), optax.adamw(lr))
    tx = optax.chain(vitals.record(optax.clip_by_global_norm(1.0)), optax.adamw(lr))
    tx = vitals.record(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)))
    ...
    metrics = vitals.recorded(opt_state)     # {'grad/global_norm': ..., ...}

The recorder passes updates through unchanged (or through ``inner``, whose
outputs and state are exactly those of ``inner`` alone) and keeps the latest
metrics in its state, a flat ``{name: float32 scalar}`` dict, so
``optax.tree.get(opt_state, 'grad/global_norm')`` works too.

Families and their cadence (``every``, in optimizer updates):

- ``"global"`` (default every update): ``grad/global_norm`` (pre-clip: the
  updates the recorder receives), ``grad/nonfinite_count``,
  ``param/global_norm`` (with ``params``); with ``inner`` also
  ``grad/global_norm_post_clip``, ``grad/clip_ratio`` (post / pre) and
  ``grad/clipped`` (1.0 when the clip fired) — or, when ``inner`` is a whole
  optimizer, ``update/global_norm`` and ``update/param_ratio``
  (``||update|| / ||params||``).
- ``"layers"`` (default every 50 updates): every per-role and per-layer figure of
  :func:`jvitals.gradient_metrics` — ``grad/Wq_abs.max`` ..., ``grad/norm/layer_i``,
  ``grad/share/layer_i``, ``param/norm/layer_i``.

On a step where a family is not due, its figures keep their previous values and
are not computed: the choice is a ``lax.cond``/``lax.switch`` on the step counter, so
only the branch taken runs. A conditional is not free, though: XLA:CPU spends
time on the branch it skips (in proportion to its size: about 2% of a 10 ms
step for the per-layer branch), and on a GPU the step waits for the host to
read the predicate (measured on an H200, a 34 ms step: the light step took
1.16x the time of the step without vitals with the ``lax.cond`` cadence, 1.04x
with the static flag below). So the per-layer family can also be chosen at trace
time, by an extra argument of the update, which ``optax.chain``, ``MultiSteps``,
``inject_hyperparams`` and ``apply_if_finite`` pass through, from a step
compiled twice on a static flag::

    updates, opt_state = tx.update(grads, opt_state, params, vitals_layers=full)

``vitals_layers=True`` computes every family this update, ``False`` only the
global one (its cadence still applies), with no conditional and nothing of the
per-layer pass compiled; a traced boolean is used as the predicate of the
``lax.cond``; None (the default) follows ``every``. Without a conditional, the
global sum of squares, written as ``optax.global_norm`` writes it, is computed
once by XLA for these figures and for an ``optax.clip_by_global_norm`` in the
same step. The post-clip norm of a wrapped ``optax.clip_by_global_norm(max_norm)``
is ``min(||g||, max_norm)`` (NaN if ``||g||`` is), known without reading the
clipped gradients; any other wrapped transform's outputs (an optimizer's
updates) cost one more pass, made outside any conditional (a conditional would
force XLA to materialise them) and kept only when the pre-clip figures are
fresh. ``RecordState.last_step`` records, per family, the update at which its
figures were last computed (-1: never).

Placement:

- With ``optax.MultiSteps(opt, k)``, put the recorder *inside* ``opt``: it then
  sees the mean of the ``k`` micro-gradients, at the boundary where the update
  is applied (outside, it would record every micro-batch).
- With ``optax.apply_if_finite``, put the recorder *outside* it (first in the
  chain, or wrapping it): ``apply_if_finite`` discards its inner state on a
  non-finite step, and with it the recorded NaN.
- With ``optax.inject_hyperparams``, anywhere: :func:`recorded` searches the
  whole optimizer state.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jvitals import gradients as _gradients
from jvitals import stats as _stats
from jvitals.packed import PackedMetrics
from jvitals.roles import Roles

__all__ = ["RecordState", "record", "recorded", "recorded_steps", "DEFAULT_EVERY"]

DEFAULT_EVERY: Mapping[str, int] = {"global": 1, "layers": 50}
_FAMILIES = ("global", "layers")


class RecordState(NamedTuple):
    """State of :func:`record`.

    Attributes:
      count: number of updates seen (int32).
      metrics: the latest figures, ``{name: float32 scalar}`` (a
        :class:`PackedMetrics`: one vector as a pytree leaf).
      last_step: ``{family: int32}``, the update count at which each family was
        last computed (-1 if never).
      inner_state: the wrapped transform's state (``optax.EmptyState()`` if none).
    """

    count: jax.Array
    metrics: dict[str, jax.Array]
    last_step: dict[str, jax.Array]
    inner_state: Any


def _check_every(every: Mapping[str, int] | None) -> dict[str, int]:
    out = dict(DEFAULT_EVERY)
    for k, v in (every or {}).items():
        if k not in _FAMILIES:
            raise ValueError(f"record(every=...): unknown family {k!r}; families are {list(_FAMILIES)}")
        if int(v) < 1:
            raise ValueError(f"record(every={{{k!r}: {v}}}): a cadence must be >= 1 update")
        out[k] = int(v)
    return out


def _has_state(tree: Any) -> bool:
    return bool(jax.tree.leaves(tree))


def record(inner: optax.GradientTransformation | None = None, *, roles: Roles | None = None,
           every: Mapping[str, int] | None = None, specs: Any = None, axes: Sequence[str] = (),
           post: Literal["auto", "clip", "update"] = "auto") -> optax.GradientTransformationExtraArgs:
    """Record gradient vitals in the optimizer state (see the module docstring).

    Args:
      inner: an optional transform to wrap (a clip, or the whole optimizer). Its
        outputs and state are passed through untouched.
      roles: parameter roles for the per-role/per-layer family (default
        ``Roles()``, which recognises common Flax naming).
      every: cadence per family, e.g. ``{"global": 1, "layers": 500}``.
      specs: ``PartitionSpec`` pytree of the gradients/params (inside
        ``shard_map``, where JAX cannot tell what is sharded).
      axes: mesh axes bound by an enclosing ``shard_map``; ``()`` under ``jit``.
      post: what ``inner``'s outputs are: ``"clip"`` (clipped gradients:
        ``grad/global_norm_post_clip``, ``grad/clip_ratio``, ``grad/clipped``) or
        ``"update"`` (final updates: ``update/global_norm``,
        ``update/param_ratio``). ``"auto"``: ``"update"`` if ``inner`` keeps any
        state (an optimizer), else ``"clip"``. Plain SGD keeps no state: pass
        ``post="update"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`RecordState` (wrapping ``inner``'s). Its update takes one extra
      keyword argument, ``vitals_layers`` (a Python bool: the per-layer family
      this update or not, decided at trace time; a traced bool: the
      conditional's predicate; None: ``every``); other extra arguments are
      passed to ``inner``.
    """
    cadence = _check_every(every)
    roles = roles if roles is not None else Roles()
    axes = tuple(axes)
    clip_max = _clip_max_norm(inner)
    inner = optax.with_extra_args_support(inner) if inner is not None else None

    def init_fn(params: Any) -> RecordState:
        inner_state = inner.init(params) if inner is not None else optax.EmptyState()
        kind = _post_kind(post, inner, inner_state)

        def names(p: Any) -> dict[str, jax.Array]:  # global view: no mesh axes are bound at init
            m = _gradients.gradient_metrics(p, params=p, roles=roles)
            m.update(_post_metrics(m["grad/global_norm"], m["grad/global_norm"],
                                   m.get("param/global_norm"), kind))
            return m

        keys = list(jax.eval_shape(names, params))
        metrics = PackedMetrics(keys, jnp.full((len(keys),), jnp.nan, jnp.float32))
        last = {f: jnp.full((), -1, jnp.int32) for f in _FAMILIES}
        return RecordState(jnp.zeros([], jnp.int32), metrics, last, inner_state)

    def _global(grads: Any, params: Any) -> dict[str, jax.Array]:
        m = _gradients.global_norm_metrics(grads, specs=specs, axes=axes)
        if params is not None:
            m["param/global_norm"] = _gradients.global_norm(params, specs=specs, axes=axes)
        return m

    def update_fn(updates: Any, state: RecordState, params: Any = None, *,
                  vitals_layers: bool | jax.Array | None = None, **extra: Any):
        if inner is not None:
            out, inner_state = inner.update(updates, state.inner_state, params, **extra)
        else:
            out, inner_state = updates, state.inner_state
        kind = _post_kind(post, inner, inner_state)
        count = state.count
        due = {f: (count % cadence[f]) == 0 for f in _FAMILIES}
        static = None  # the per-layer family decided at trace time (a Python bool)
        if isinstance(vitals_layers, (bool, np.bool_)):
            static = bool(vitals_layers)
            due["layers"] = jnp.asarray(static)
        elif vitals_layers is not None:
            due["layers"] = jnp.asarray(vitals_layers, bool).reshape(())
        names = state.metrics.names
        prev = state.metrics.vector  # the figures cross the conditional as one vector
        index = {k: i for i, k in enumerate(names)}

        def fill(m: dict[str, jax.Array], base: jax.Array) -> jax.Array:
            m = _replicated(m, axes)
            have = [k for k in names if k in m]
            fresh = jnp.stack([m[k].astype(jnp.float32) for k in have])
            if len(have) == len(names):
                return fresh
            return base.at[jnp.array([index[k] for k in have])].set(fresh)  # the rest keep their values

        def keep(v: jax.Array) -> jax.Array:
            return v

        def light(v: jax.Array) -> jax.Array:
            return fill(_global(updates, params), v)

        def heavy(v: jax.Array) -> jax.Array:
            return fill(_gradients.gradient_metrics(updates, params=params, roles=roles, specs=specs,
                                                    axes=axes), v)

        # Only the gradients and params enter a conditional (never the inner
        # transform's outputs, which XLA would then have to materialise).
        if static is True or (static is None and vitals_layers is None and cadence["layers"] == 1):
            vec = heavy(prev)  # one pass gives every family
            due["layers"] = jnp.asarray(True)
        elif static is False:
            # No conditional, nothing of the per-layer pass compiled: the global
            # sum of squares, written as optax.global_norm writes it, is computed
            # once by XLA for these figures and for a clip in the same step.
            vec = light(prev) if cadence["global"] == 1 else lax.cond(due["global"], light, keep, prev)
        elif cadence["global"] == 1:
            # The per-layer pass (which gives the global figures too) or the
            # global pass. Measured on XLA:CPU, one conditional holding both costs
            # less than the global pass outside it and a conditional for the rest.
            vec = lax.cond(due["layers"], heavy, light, prev)
        else:
            which = jnp.where(due["layers"], 2, jnp.where(due["global"], 1, 0))
            vec = lax.switch(which, (keep, light, heavy), prev)
        fresh = due["global"] | due["layers"]
        if kind is not None:
            pre = vec[index["grad/global_norm"]]
            if kind == "clip" and clip_max is not None:
                # optax.clip_by_global_norm scales by max_norm / ||g|| when ||g|| >=
                # max_norm: its output's norm is min(||g||, max_norm) (NaN stays NaN).
                post_norm = jnp.where(jnp.isnan(pre), jnp.nan, jnp.minimum(pre, jnp.asarray(clip_max, pre.dtype)))
            else:
                # One norm of the outputs, outside any conditional, kept only when
                # the pre-clip figures it is compared with are fresh.
                post_norm = _replicated({"n": _gradients.global_norm(out, specs=specs, axes=axes)}, axes)["n"]
            param_norm = vec[index["param/global_norm"]] if "param/global_norm" in index else None
            pm = _post_metrics(pre, post_norm.astype(jnp.float32), param_norm, kind)
            pm = {k: v for k, v in pm.items() if k in index}
            if pm:
                at = jnp.array([index[k] for k in pm])
                vec = vec.at[at].set(jnp.where(fresh, jnp.stack([v.astype(jnp.float32) for v in pm.values()]),
                                               prev[at]))
        metrics = PackedMetrics(names, vec)
        last = {"global": jnp.where(fresh, count, state.last_step["global"]),
                "layers": jnp.where(due["layers"], count, state.last_step["layers"])}
        new_state = RecordState(count + 1, metrics, last, inner_state)
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _post_metrics(pre: jax.Array, post_norm: jax.Array, param_norm: jax.Array | None,
                  kind: str | None) -> dict[str, jax.Array]:
    """The figures comparing the inner transform's outputs with its inputs.

    ``kind == "clip"``: ``grad/global_norm_post_clip = ||out||``,
    ``grad/clip_ratio = ||out|| / ||g||``, ``grad/clipped = ||out|| < ||g||``;
    ``kind == "update"``: ``update/global_norm = ||out||``,
    ``update/param_ratio = ||out|| / ||params||``.
    """
    if kind is None:
        return {}
    if kind == "clip":
        return {"grad/global_norm_post_clip": post_norm,
                "grad/clip_ratio": post_norm / pre,
                "grad/clipped": (post_norm < pre * (1 - 1e-6)).astype(jnp.float32)}
    m = {"update/global_norm": post_norm}
    if param_norm is not None:
        m["update/param_ratio"] = post_norm / param_norm
    return m


def _replicated(m: dict[str, jax.Array], axes: tuple[str, ...]) -> dict[str, jax.Array]:
    """Make figures that JAX types as varying (but that are equal on every shard) replicated.

    Inside ``shard_map``, a figure of a leaf that is replicated by its spec can
    still be typed as varying (an optimizer's outputs inherit the type of a norm
    over sharded leaves). The state must hold replicated values, so such figures
    are averaged over those axes: one ``psum`` of a stacked vector, exact for
    equal values up to rounding, and NaN stays NaN (``pmax`` would drop it on
    some backends).
    """
    if not axes:
        return m
    # Axes each figure is typed as varying along (empty where JAX tracks nothing).
    along = {k: (_stats._manual_varying(v) or frozenset()) & set(axes) for k, v in m.items()}
    keys = [k for k in m if along[k]]
    if not keys:
        return m
    red = tuple(a for a in axes if any(a in along[k] for k in keys))
    vec = jnp.stack([_stats.make_varying(m[k].astype(jnp.float32), red) for k in keys])
    vec = lax.psum(vec, red) / math.prod(lax.axis_size(a) for a in red)
    return {**m, **{k: vec[i] for i, k in enumerate(keys)}}


def _clip_max_norm(inner: Any) -> Any:
    """``max_norm`` if ``inner`` is ``optax.clip_by_global_norm(max_norm)``, else None.

    Recognised by its update function (``clip_by_global_norm.<locals>.update_fn``
    in optax, ``max_norm`` in its closure). Its output's norm is then
    ``min(||g||, max_norm)``, known from the pre-clip norm without another pass
    over the clipped gradients; any other transform's output is measured.
    """
    fn = getattr(inner, "update", None)
    if (getattr(fn, "__qualname__", None) != "clip_by_global_norm.<locals>.update_fn"
            or not str(getattr(fn, "__module__", "")).startswith("optax")):
        return None
    try:
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        value = cells["max_norm"].cell_contents
    except (AttributeError, KeyError, ValueError):
        return None
    return value if isinstance(value, (int, float)) or getattr(value, "shape", None) == () else None


def _post_kind(post: str, inner: Any, inner_state: Any) -> str | None:
    if inner is None:
        return None
    if post == "auto":
        return "update" if _has_state(inner_state) else "clip"
    if post not in ("clip", "update"):
        raise ValueError(f"record(post={post!r}): expected 'auto', 'clip' or 'update'")
    return post


def _states(opt_state: Any) -> list[RecordState]:
    """Every RecordState in ``opt_state``, outer before inner (a recorder may wrap one)."""
    found: list[RecordState] = []
    is_rec = lambda x: isinstance(x, RecordState)  # noqa: E731
    for x in jax.tree.leaves(opt_state, is_leaf=is_rec):
        if is_rec(x):
            found.append(x)
            found.extend(_states(x.inner_state))
    return found


def recorded(opt_state: Any) -> dict[str, jax.Array]:
    """The latest metrics of every recorder anywhere in ``opt_state``, as one flat dict.

    Args:
      opt_state: an optimizer state holding one or more :class:`RecordState`
        (inside ``chain``, ``MultiSteps``, ``inject_hyperparams``,
        ``apply_if_finite``, or nested recorders).

    Returns:
      ``{name: float32 scalar}``; ``{}`` if there is no recorder.

    Raises:
      ValueError: if two recorders record the same name (e.g. two
        ``record(clip)``), which would make the figure ambiguous.
    """
    out: dict[str, jax.Array] = {}
    for st in _states(opt_state):
        clash = sorted(set(out) & set(st.metrics))
        if clash:
            raise ValueError(
                f"recorded(): two recorders in the optimizer state both record {clash[:4]}; "
                "keep one recorder per position (one first in the chain, or one wrapping the clip)")
        out.update(st.metrics.items())
    return out


def recorded_steps(opt_state: Any) -> dict[str, jax.Array]:
    """``{family: update count when last computed}`` of the first recorder in ``opt_state``."""
    states = _states(opt_state)
    return dict(states[0].last_step) if states else {}
