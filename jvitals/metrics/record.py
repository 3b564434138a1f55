"""The optax recorder: gradient vitals of every step, inside the compiled update.

::

    tx = vitals.with_lr_scale(vitals.record(                   # the placement that gives every figure
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), schedule=schedule))
    updates, opt_state = tx.update(grads, opt_state, params, vitals_heavy=heavy)
    metrics = vitals.recorded(opt_state)     # {'grad/global_norm': ..., ...}

The recorder passes updates through unchanged (or through ``inner``) and keeps the latest
figures in its state. Two families: ``"light"`` (the light step, every update: global norms,
every layer's and group's figures, the clip's and the update's, the learning rate) and
``"heavy"`` (the heavy step, at a cadence, every 50 updates by default, or
``vitals_heavy=True``: the per-role figures). Placement, cadence, what each step
reads, and the recorder with ``MultiSteps``, ``apply_if_finite`` and NNX: docs/RECORDER.md.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jvitals.metrics import gradients as _gradients
from jvitals.metrics import light as _light
from jvitals.metrics import axes as _axes
from jvitals.metrics import window as _window
from jvitals.metrics.clip_norm import optax_form
from jvitals.metrics.chain import has_threshold, leading_clip, skipped, state_at
from jvitals.metrics.explain import log_roles_summary
from jvitals.metrics.optimizer import LR_SCALE, LR_SCALE_ARG, injected_hyperparams
from jvitals.metrics.packed import PackedMetrics
from jvitals.metrics.checks import (check_cadence, check_choice, check_extra_kwargs, check_opt_state,
                                    check_same_structure, check_schedule, check_transform)
from jvitals.metrics.roles import Roles, check_roles
from jvitals.metrics.variables import unwrap

__all__ = ["RecordState", "record", "recorded", "recorded_steps", "DEFAULT_EVERY"]

DEFAULT_EVERY: Mapping[str, int] = {"light": 1, "heavy": 50}
_FAMILIES = ("light", "heavy")
_KEYWORDS = ("vitals_heavy", "vitals_read", LR_SCALE_ARG)  # the update's own keyword arguments
_READ = "read"   # last_step[_READ]: the update after which the host last read the window


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


def _has_state(tree: Any) -> bool:
    return bool(jax.tree.leaves(tree))


class _Plan(NamedTuple):
    """What the recorder reports beside the gradient figures (decided at trace time).

    clip: how ``grad/global_norm_post_clip`` is known: ``"max_norm"`` (a leading
      ``optax.clip_by_global_norm``: ``min(||g||, max_norm)``), ``"threshold"`` (a
      leading transform whose state has ``clip_threshold``: ``min(||g||,
      threshold)``), ``"measured"`` (the norm of ``inner``'s outputs), or None.
    update: ``inner``'s outputs are the final updates (``update/*`` figures).
    lr: ``opt/learning_rate`` is known (``schedule=`` or an injected learning rate).
    """

    clip: str | None
    update: bool
    lr: bool


def record(inner: optax.GradientTransformation | None = None, *, roles: Roles | None = None,
           every: Mapping[str, int] | None = None, specs: Any = None, axes: Sequence[str] = (),
           post: Literal["auto", "clip", "update"] = "auto",
           schedule: optax.ScalarOrSchedule | None = None) -> optax.GradientTransformationExtraArgs:
    """Record gradient vitals in the optimizer state (see the module docstring).

    Args:
      inner: an optional transform to wrap (a clip, or the whole optimizer, e.g.
        ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))``). Its
        outputs and state are passed through untouched. A clip first in it (an
        ``optax.clip_by_global_norm``, or a transform whose state has a
        ``clip_threshold`` field, such as :func:`jvitals.adaptive_clip`) is
        recognised: its post-clip figures come from the pre-clip norm.
      roles: parameter roles for the per-role figures of the heavy family (default
        ``Roles()``, which recognises common Flax naming).
      every: cadence per family in updates, e.g. ``{"light": 1, "heavy": 500}``
        (default :data:`DEFAULT_EVERY`: light every update, heavy every 50).
      specs: ``PartitionSpec`` pytree of the gradients/params (inside
        ``shard_map``, where JAX cannot tell what is sharded).
      axes: mesh axes bound by an enclosing ``shard_map``; ``()`` under ``jit``.
      post: what ``inner``'s outputs are: ``"clip"`` (clipped gradients:
        ``grad/global_norm_post_clip``, ``grad/clip_ratio``, ``grad/clipped``) or
        ``"update"`` (final updates: ``update/global_norm``,
        ``update/param_ratio``, and in the light family
        ``update/param_ratio/layer_{i}`` and per group). ``"auto"``: ``"clip"`` if
        ``inner`` is a recognised clip; ``"update"`` (plus the clip figures) if it
        is a chain starting with one; else ``"update"`` if ``inner`` keeps any
        state (an optimizer), else ``"clip"``. Plain SGD keeps no state: pass
        ``post="update"``.
      schedule: the learning rate (a float or an optax schedule of the update
        count), logged as ``opt/learning_rate`` at each update, times the
        ``vitals_lr_scale`` the update receives. Without it the learning rate is
        read from an ``optax.inject_hyperparams`` state inside ``inner``
        (``hyperparams['learning_rate']``), if any.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`RecordState` (wrapping ``inner``'s). Its update takes the extra
      keyword arguments ``vitals_heavy`` (a Python bool: the heavy family
      this update or not, decided at trace time; a traced bool: the
      conditional's predicate; None: ``every``; not passed on) and
      ``vitals_lr_scale`` (the global learning-rate scale in force, which
      :func:`jvitals.with_lr_scale` passes: it multiplies ``opt/learning_rate``
      and the update figures; 1.0 if absent); every extra argument but ``vitals_heavy``
      is passed to ``inner``; any other ``vitals_*`` keyword is a ``TypeError`` naming them.

    Raises:
      TypeError: ``inner`` not a transform (an uncalled factory such as ``optax.adamw``),
        ``roles`` not a :class:`Roles`, ``every`` not a mapping, ``schedule`` not a schedule.
      ValueError: an unknown family in ``every`` or a cadence < 1, ``post`` not one of the three.
    """
    cadence, roles = check_cadence(every, DEFAULT_EVERY, "record"), check_roles(roles, "record")
    inner = None if inner is None else check_transform(inner, "record")
    check_choice(post, ("auto", "clip", "update"), "record", "post")
    check_schedule(schedule, "record")
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    cfg = _Config(roles=roles, specs=specs, axes=axes, cadence=cadence, schedule=schedule,
                  lead=leading_clip(inner), post=post)
    inner = optax.with_extra_args_support(inner) if inner is not None else None

    def init_fn(params: Any) -> RecordState:
        log_roles_summary(params, roles)  # once per tree: the weight matrices no per-role figure reads
        inner_state = inner.init(params) if inner is not None else optax.EmptyState()
        return RecordState(jnp.zeros([], jnp.int32), _empty_metrics(params, _plan(cfg, inner, inner_state), roles),
                           {f: jnp.full((), -1, jnp.int32) for f in _FAMILIES + (_READ,)}, inner_state)

    def update_fn(updates: Any, state: RecordState, params: Any = None, *,
                  vitals_heavy: bool | jax.Array | None = None, vitals_read: bool | jax.Array | None = None,
                  **extra: Any):
        _check_update_args(updates, state, params, extra)
        if inner is not None:
            out, inner_state = inner.update(updates, state.inner_state, params, **extra)
        else:
            out, inner_state = updates, state.inner_state
        step = _Step(grads=updates, out=out, params=params, count=state.count, inner_state=inner_state,
                     plan=_plan(cfg, inner, inner_state), outer=_outer_scale(extra),
                     names=state.metrics.names)
        return out, _recorded_state(cfg, step, state, vitals_heavy, vitals_read, extra.get("loss"))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_update_args(updates: Any, state: Any, params: Any, extra: Mapping[str, Any]) -> None:
    """``tx.update(grads, opt_state, params, **extra)``'s arguments in their order, and no
    unknown ``vitals_*`` keyword (static checks)."""
    check_extra_kwargs(extra, _KEYWORDS, "record: tx.update(...)")
    if updates is None:
        raise TypeError("record: tx.update(grads, opt_state, params) got grads=None; pass the gradients pytree")
    if not (hasattr(state, "inner_state") and hasattr(state, "metrics")):
        raise TypeError(f"record: tx.update(grads, opt_state, params): opt_state is {type(state).__name__}, not the "
                        "state tx.init(params) returned; were the arguments swapped? the order is "
                        "(grads, opt_state, params)")
    check_same_structure(updates, params, "record: tx.update", "grads", "params")


def _recorded_state(cfg: "_Config", step: "_Step", state: RecordState, vitals_heavy: Any, vitals_read: Any,
                    loss: Any) -> RecordState:
    """The recorder's state after one update: the due families' figures, the ones set
    outside any conditional, the window (``loss``: the update's ``loss=``), the flags."""
    due, static = _due(cfg.cadence, state.count, vitals_heavy)
    prev = state.metrics.vector[:len(step.names)]
    vec, out_norm, heavy_static = _family_vector(cfg, step, prev, due, static, vitals_heavy)
    if heavy_static:
        due["heavy"] = jnp.asarray(True)
    fresh = due["light"] | due["heavy"]
    vec = _set_outside(cfg, step, vec, prev, out_norm, fresh)
    vec = _set_window(cfg, step, vec, state.last_step[_READ] >= state.count - 1, loss, fresh)
    flags = PackedMetrics.flag_vector(state.metrics.flags, {
        "light": fresh, "heavy": due["heavy"], "window": True, "window_loss": loss is not None})
    metrics = PackedMetrics(step.names, jnp.concatenate([vec, flags]), state.metrics.families)
    read = True if vitals_read is None else jnp.asarray(vitals_read, bool).reshape(())
    last = {"light": jnp.where(fresh, state.count, state.last_step["light"]),
            "heavy": jnp.where(due["heavy"], state.count, state.last_step["heavy"]),
            _READ: jnp.where(read, state.count, state.last_step[_READ])}
    return RecordState(state.count + 1, metrics, last, step.inner_state)


class _Config(NamedTuple):
    """What :func:`record` was built with (static)."""

    roles: Roles
    specs: Any
    axes: tuple[str, ...]
    cadence: dict[str, int]
    schedule: Any
    lead: tuple[tuple[int | str, ...], Any, bool]  # leading_clip(inner): path, max_norm, whole
    post: str


class _Step(NamedTuple):
    """One update's inputs to the recorder's figures."""

    grads: Any
    out: Any
    params: Any
    count: jax.Array
    inner_state: Any
    plan: _Plan
    outer: jax.Array | None
    names: tuple[str, ...]

    @property
    def with_updates(self) -> bool:
        """Whether the update figures (per layer too) can be measured."""
        return self.plan.update and self.params is not None


def _plan(cfg: _Config, inner: Any, inner_state: Any) -> _Plan:
    """What to report beside the gradient figures, from ``post`` and the inner state."""
    lr = cfg.schedule is not None or _injected_lr(inner_state) is not None
    if inner is None:
        return _Plan(None, False, lr)
    if cfg.post not in ("auto", "clip", "update"):
        raise ValueError(f"record(post={cfg.post!r}): expected 'auto', 'clip' or 'update'")
    lead_path, lead_max, lead_whole = cfg.lead
    known = ("threshold" if has_threshold(state_at(inner_state, lead_path)) else
             "max_norm" if lead_max is not None else None)
    if cfg.post == "clip":
        return _Plan(known if lead_whole and known else "measured", False, lr)
    if cfg.post == "update":
        return _Plan(known if known and not lead_whole else None, True, lr)
    if known:
        return _Plan(known, not lead_whole, lr)
    return _Plan(None, True, lr) if _has_state(inner_state) else _Plan("measured", False, lr)


def _empty_metrics(params: Any, pl: _Plan, roles: Roles) -> PackedMetrics:
    """Every name the recorder may fill (found by tracing the families on ``params``), NaN;
    the window's entries after them (empty)."""
    def names(p: Any) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        # global view: no mesh axes are bound at init
        m = _gradients.gradient_metrics(p, params=p, updates=p if pl.update else None, roles=roles)
        g = dict(_light.light_metrics(p, p, p if pl.update else None, roles=roles))
        g.pop("update/nonfinite_count", None)
        if not pl.update:
            g = {k: v for k, v in g.items() if not k.startswith("update/")}
        one = m["grad/global_norm"]
        if pl.update:
            g["update/rms"] = one
        g.update(_clip_metrics(one, one, one if pl.clip == "threshold" else None) if pl.clip else {})
        if pl.lr:
            g[LR_NAME] = one
        return m, g

    heavy_names, light_names = jax.eval_shape(names, params)
    keys = list({**heavy_names, **light_names})
    families = ["light" if k in light_names else "heavy" for k in keys]
    win = _window.window_names(keys + ["loss"])
    keys += win
    families += ["window_loss" if k.startswith(_window.WINDOW_PREFIX + "loss.") else "window" for k in win]
    n_flags = len(dict.fromkeys(families))
    empty = _window.empty_window(win)
    vec = jnp.concatenate([jnp.full((len(keys) - len(win),), jnp.nan, jnp.float32),
                           jnp.stack([empty[k] for k in win]), jnp.zeros((n_flags,), jnp.float32)])
    return PackedMetrics(keys, vec, families)


def _outer_scale(extra: Mapping[str, Any]) -> jax.Array | None:
    """The global learning-rate scale ``with_lr_scale`` passes (None: not passed)."""
    outer = extra.get(LR_SCALE_ARG)
    return None if outer is None else jnp.asarray(outer, jnp.float32).reshape(())


def _due(cadence: Mapping[str, int], count: jax.Array,
         vitals_heavy: bool | jax.Array | None) -> tuple[dict[str, jax.Array], bool | None]:
    """Which families are due at update ``count`` (traced booleans), and the heavy
    family decided at trace time (a Python bool; None when it is not)."""
    due = {f: (count % cadence[f]) == 0 for f in _FAMILIES}
    static = None
    if isinstance(vitals_heavy, (bool, np.bool_)):
        static = bool(vitals_heavy)
        due["heavy"] = jnp.asarray(static)
    elif vitals_heavy is not None:
        due["heavy"] = jnp.asarray(vitals_heavy, bool).reshape(())
    return due, static


def _fill(step: _Step, axes: tuple[str, ...], m: Mapping[str, jax.Array], base: jax.Array) -> jax.Array:
    """The figure vector with ``m``'s names set (replicated first); the rest keep ``base``'s."""
    m = _replicated(dict(m), axes)
    have = [k for k in step.names if k in m]
    fresh = jnp.stack([m[k].astype(jnp.float32) for k in have])
    if len(have) == len(step.names):
        return fresh
    index = {k: i for i, k in enumerate(step.names)}
    return base.at[jnp.array([index[k] for k in have])].set(fresh)


def _heavy_figures(cfg: _Config, step: _Step) -> dict[str, jax.Array]:
    """Every family: :func:`jvitals.gradient_metrics` of the gradients, params and (the
    final) updates; update figures times ``outer``.

    Under ``jit`` (float32, no mesh axes) on every backend: the light step's figures
    (:mod:`jvitals.metrics.light`: global and group norms from the per-leaf sums the clip
    and the step take anyway, the update figures from the change applied, which the TPU
    compiler fuses with ``optax.apply_updates``) and the per-role gradient figures by plain
    reductions (:func:`jvitals.metrics.gradients.plain_grad_figures`), which XLA:CPU
    vectorises and GPUs and TPUs fuse into the kernels that produce and read the gradients
    (docs/COST.md). Otherwise
    (``shard_map``, other dtypes) one pass over the leaves of the three trees
    (:func:`jvitals.metrics.gradients.gradient_metrics`).
    """
    upd = step.out if step.with_updates else None
    plain = (not cfg.axes and optax_form(step.grads, ())
             and (step.params is None or optax_form(step.params, ())))
    if plain:
        m = _gradients.plain_grad_figures(step.grads, roles=cfg.roles)
        light = _light.light_metrics(step.grads, step.params, upd, roles=cfg.roles)
        m.update({k: v for k, v in light.items() if k.startswith(("param/", "update/"))
                  and k != "update/nonfinite_count"})
    else:
        m = _gradients.gradient_metrics(step.grads, params=step.params, updates=upd, roles=cfg.roles,
                                        specs=cfg.specs, axes=cfg.axes)
    if step.outer is not None:  # the updates applied are outer * out (jvitals.with_lr_scale)
        m = {k: v * step.outer if k.startswith("update/") else v for k, v in m.items()}
    return m


def _needs_out_norm(step: _Step, heavy_static: bool) -> bool:
    """Whether ``||out||`` is needed: a measured clip, or update figures the heavy
    pass does not give this update."""
    return step.plan.clip == "measured" or (step.plan.update and not (heavy_static and step.with_updates))


def _family_vector(cfg: _Config, step: _Step, prev: jax.Array, due: Mapping[str, jax.Array],
                   static: bool | None, vitals_heavy: Any) -> tuple[jax.Array, jax.Array | None, bool]:
    """The families' figures into the vector, and ``||out||`` where it is needed.

    Static heavy flag: no cadence conditional (the light step's gradient norm
    is the clip's and every group's figures come from the same per-leaf sums, see
    :mod:`jvitals.metrics.light`; the heavy step reads gradient, parameter and
    output in one kernel per leaf). Traced cadence: a ``lax.cond``/``lax.switch`` on
    the update count (the outputs' norm outside it, so XLA need not hand them to the
    conditional for it).

    Returns:
      ``(vector, ||out|| or None, heavy_static)``.
    """
    heavy_static = static is True or (static is None and vitals_heavy is None and cfg.cadence["heavy"] == 1)
    want_out = _needs_out_norm(step, heavy_static)

    def light(v: jax.Array) -> jax.Array:
        return _fill(step, cfg.axes, _light_figures(cfg, step, True)[0], v)

    def heavy(v: jax.Array) -> jax.Array:
        return _fill(step, cfg.axes, _heavy_figures(cfg, step), v)

    if static is False and cfg.cadence["light"] == 1:
        m, out_norm = _light_figures(cfg, step, want_out)
        return _fill(step, cfg.axes, m, prev), out_norm, False
    out_norm = _out_norm(cfg, step.out) if want_out else None
    if heavy_static:
        return heavy(prev), out_norm, True
    if static is False:
        return lax.cond(due["light"], light, lambda v: v, prev), out_norm, False
    if cfg.cadence["light"] == 1:
        # Measured on XLA:CPU, one conditional holding both costs less than the
        # global pass outside it and a conditional for the rest.
        return lax.cond(due["heavy"], heavy, light, prev), out_norm, False
    which = jnp.where(due["heavy"], 2, jnp.where(due["light"], 1, 0))
    return lax.switch(which, (lambda v: v, light, heavy), prev), out_norm, False


_SET_OUTSIDE = ("update/global_norm", "update/param_ratio", "update/nonfinite_count")


def _light_figures(cfg: _Config, step: _Step, with_out: bool) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """The light step's figures (:func:`jvitals.metrics.light.light_metrics`: global and
    every group's, from one set of per-leaf sums) and ``||out||`` when ``with_out``.

    The global update figures are left out (set outside, scaled, by :func:`_set_outside`);
    the groups' update ratios are scaled by ``outer`` here, as the heavy step's are.
    """
    upd = with_out and step.with_updates
    m = _light.light_metrics(step.grads, step.params, step.out if upd else None, roles=cfg.roles,
                             specs=cfg.specs, axes=cfg.axes)
    out_norm = None
    if upd:
        out_norm = _replicated({"n": m["update/global_norm"]}, cfg.axes)["n"]
    elif with_out:
        out_norm = _out_norm(cfg, step.out)
    scale = step.outer if step.outer is not None else None
    m = {k: (v * scale if scale is not None and k.startswith("update/") else v)
         for k, v in m.items() if k not in _SET_OUTSIDE}
    return m, out_norm


def _set_window(cfg: _Config, step: _Step, vec: jax.Array, new: jax.Array, loss: Any,
                fresh: jax.Array) -> jax.Array:
    """The window's entries after this update (:mod:`jvitals.metrics.window`), where the
    global figures are fresh: this update's loss (``loss=``, if given), gradient norm and
    update ratio, whether any was non-finite, whether an in-step skip dropped it."""
    index = {k: i for i, k in enumerate(step.names)}
    loss_key = _window.WINDOW_PREFIX + "loss."
    names = [k for k in step.names if k.startswith(_window.WINDOW_PREFIX)
             and (loss is not None or not k.startswith(loss_key))]
    if not names:
        return vec
    values = {f: vec[index[f]] for f in _window.WINDOW_FIGURES if f in index}
    bad = ~jnp.isfinite(values["grad/global_norm"]) | (vec[index["grad/nonfinite_count"]] > 0)
    if loss is not None:
        values["loss"] = _replicated({"loss": jnp.asarray(loss, jnp.float32).reshape(())}, cfg.axes)["loss"]
        bad = bad | ~jnp.isfinite(values["loss"])
    at = jnp.array([index[k] for k in names])
    w = _window.update_window({k: vec[index[k]] for k in names}, new, values, bad, skipped(step.inner_state))
    return vec.at[at].set(jnp.where(fresh, jnp.stack([w[k] for k in names]), vec[at]))


def _out_norm(cfg: _Config, out: Any) -> jax.Array:
    """``||out||`` (replicated), one read of each leaf."""
    n = _gradients.global_norm(out, specs=cfg.specs, axes=cfg.axes)
    return _replicated({"n": n}, cfg.axes)["n"].astype(jnp.float32)


def _set_outside(cfg: _Config, step: _Step, vec: jax.Array, prev: jax.Array, out_norm: jax.Array | None,
                 fresh: jax.Array) -> jax.Array:
    """The figures made outside any conditional (post-clip, update, learning rate), kept
    only when the pre-clip figures they are compared with are fresh."""
    index = {k: i for i, k in enumerate(step.names)}
    pre = vec[index["grad/global_norm"]]
    pl = step.plan
    pm: dict[str, jax.Array] = {}
    if pl.clip is not None:
        pm.update(_post_clip(cfg, step, pre, out_norm))
    if pl.update and out_norm is not None:
        scaled = out_norm * step.outer if step.outer is not None else out_norm
        param_norm = vec[index["param/global_norm"]] if "param/global_norm" in index else None
        pm.update(_update_metrics(scaled, param_norm))
    if pl.update and "update/rms" in index:
        # ||u|| / sqrt(n): Adam's lr |m| / (sqrt(v) + eps) per element, 0.1-0.3 lr while eps << sqrt(v)
        u = pm["update/global_norm"] if "update/global_norm" in pm else vec[index["update/global_norm"]]
        pm["update/rms"] = u / math.sqrt(max(_global_size(cfg, step.out), 1))
    if pl.lr:
        pm[LR_NAME] = _learning_rate(cfg.schedule, step.count, step.inner_state, step.outer)
    pm = {k: v for k, v in pm.items() if k in index}
    if not pm:
        return vec
    at = jnp.array([index[k] for k in pm])
    return vec.at[at].set(jnp.where(fresh, jnp.stack([v.astype(jnp.float32) for v in pm.values()]), prev[at]))


def _post_clip(cfg: _Config, step: _Step, pre: jax.Array, out_norm: jax.Array | None) -> dict[str, jax.Array]:
    """The clip figures: the post-clip norm known from the pre-clip one for a recognised
    clip (``min(||g||, max_norm or threshold)``), else measured (``||out||``)."""
    lead_path, lead_max, _ = cfg.lead
    threshold = None
    if step.plan.clip == "max_norm":
        post_norm = _min_keep_nan(pre, jnp.asarray(lead_max, jnp.float32))
    elif step.plan.clip == "threshold":
        threshold = jnp.asarray(state_at(step.inner_state, lead_path).clip_threshold, jnp.float32).reshape(())
        post_norm = _min_keep_nan(pre, threshold)
    else:
        post_norm = out_norm
    return _clip_metrics(pre, post_norm, threshold)


LR_NAME = "opt/learning_rate"


def _min_keep_nan(pre: jax.Array, limit: jax.Array) -> jax.Array:
    """``min(||g||, limit)``, NaN if ``||g||`` is NaN (the norm a clip at ``limit`` outputs)."""
    return jnp.where(jnp.isnan(pre), jnp.nan, jnp.minimum(pre, limit.astype(pre.dtype)))


def _clip_metrics(pre: jax.Array, post_norm: jax.Array, threshold: jax.Array | None) -> dict[str, jax.Array]:
    """``grad/global_norm_post_clip = ||out||``, ``grad/clip_ratio = ||out|| / ||g||``,
    ``grad/clipped = ||out|| < ||g||``, and ``grad/clip_threshold`` when the clip has one."""
    m = {"grad/global_norm_post_clip": post_norm,
         "grad/clip_ratio": post_norm / pre,
         "grad/clipped": (post_norm < pre * (1 - 1e-6)).astype(jnp.float32)}
    if threshold is not None:
        m["grad/clip_threshold"] = threshold
    return m


def _update_metrics(upd_norm: jax.Array, param_norm: jax.Array | None) -> dict[str, jax.Array]:
    """``update/global_norm = ||u||`` and ``update/param_ratio = ||u|| / ||params||``."""
    m = {"update/global_norm": upd_norm}
    if param_norm is not None:
        m["update/param_ratio"] = upd_norm / param_norm
    return m


def _global_size(cfg: _Config, tree: Any) -> int:
    """``n``, the number of elements of ``tree`` over the mesh (static): under ``jit`` its size;
    inside ``shard_map`` each leaf's shard size times the sizes of the axes its norm is reduced
    over (as :func:`jvitals.metrics.gradients.global_norm` reduces it)."""
    specs = _gradients.flat_specs(tree, cfg.specs, "updates") if cfg.axes else None
    return sum(int(np.size(x)) * math.prod(lax.axis_size(a) for a in _axes.reduction_axes(
        x, cfg.axes, specs[i] if specs else None, specs is not None)) for i, x in enumerate(jax.tree.leaves(tree)))


def _injected_lr(tree: Any) -> jax.Array | None:
    found = injected_hyperparams(tree, "learning_rate")
    return found[0] if found else None


def _learning_rate(schedule: Any, count: jax.Array, inner_state: Any, outer: jax.Array | None) -> jax.Array:
    """The learning rate applied at update ``count``: ``schedule(count)`` (or the injected
    ``learning_rate``) x every ``lr_scale`` injected inside ``inner`` x ``outer``."""
    if schedule is not None:
        lr = schedule(count) if callable(schedule) else schedule
    else:
        lr = _injected_lr(inner_state)
    lr = jnp.asarray(lr, jnp.float32).reshape(())
    for s in injected_hyperparams(inner_state, LR_SCALE):
        lr = lr * jnp.asarray(s, jnp.float32).reshape(())
    return lr if outer is None else lr * outer


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
    along = {k: (_axes.manual_varying(v) or frozenset()) & set(axes) for k, v in m.items()}
    keys = [k for k in m if along[k]]
    if not keys:
        return m
    red = tuple(a for a in axes if any(a in along[k] for k in keys))
    vec = jnp.stack([_axes.make_varying(m[k].astype(jnp.float32), red) for k in keys])
    vec = lax.psum(vec, red) / math.prod(lax.axis_size(a) for a in red)
    return {**m, **{k: vec[i] for i, k in enumerate(keys)}}


def _states(opt_state: Any) -> list[RecordState]:
    """Every RecordState in ``opt_state``, outer before inner (a recorder may wrap one);
    Flax NNX ``Variable`` leaves (``nnx.Optimizer.opt_state``) read as their values."""
    opt_state = unwrap(opt_state)
    found: list[RecordState] = []
    is_rec = lambda x: isinstance(x, RecordState)  # noqa: E731
    for x in jax.tree.leaves(opt_state, is_leaf=is_rec):
        if is_rec(x):
            found.append(x)
            found.extend(_states(x.inner_state))
    return found


def recorded(opt_state: Any) -> PackedMetrics:
    """The metrics every recorder anywhere in ``opt_state`` computed at the latest update.

    Read it on the host at the logging cadence::

        host = jax.device_get(vitals.recorded(state.opt_state))   # one packed vector
        dict(host)   # only the figures computed at the latest update

    The result is a :class:`~jvitals.metrics.packed.PackedMetrics`: a read-only dict of
    the *fresh* figures (a heavy figure appears only at the updates where the
    heavy family ran; ``.latest()`` gives every figure's last value,
    :func:`recorded_steps` when each family last ran), one vector as a pytree, so
    ``jax.device_get`` moves it in one transfer.

    Args:
      opt_state: an optimizer state holding one or more :class:`RecordState`
        (inside ``chain``, ``MultiSteps``, ``inject_hyperparams``,
        ``apply_if_finite``, or nested recorders); a Flax NNX
        ``nnx.Optimizer``'s ``opt_state`` as it is (its ``OptState`` Variables are
        read as their values).

    Returns:
      ``{name: float32 scalar}`` as a :class:`PackedMetrics` (several recorders'
      vectors concatenated into one); empty if there is no recorder.

    Raises:
      TypeError: ``opt_state`` is None or the transform itself (not its state).
      ValueError: if two recorders record the same name (e.g. two
        ``record(clip)``), which would make the figure ambiguous.
    """
    check_opt_state(opt_state, "recorded")
    states = _states(opt_state)
    seen: set[str] = set()
    for st in states:
        clash = sorted(seen & set(st.metrics.names))
        if clash:
            raise ValueError(
                f"recorded(): two recorders in the optimizer state both record {clash[:4]}; "
                "keep one recorder per position (one first in the chain, or one wrapping the clip)")
        seen |= set(st.metrics.names)
    if not states:
        return PackedMetrics((), np.zeros([0], np.float32))
    return PackedMetrics.merge(st.metrics for st in states)


def recorded_steps(opt_state: Any) -> dict[str, jax.Array]:
    """``{family: update count when last computed}`` of the first recorder in ``opt_state``."""
    check_opt_state(opt_state, "recorded_steps")
    states = _states(opt_state)
    return dict(states[0].last_step) if states else {}
