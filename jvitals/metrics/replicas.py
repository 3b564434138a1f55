"""Per-replica vitals: the few figures that can name a sick device, host or data shard.

Every other figure is reduced over the whole mesh, which hides *where* a fault sits: a NaN
on one of 256 chips is "the loss is NaN". :func:`replica_metrics` keeps, beside them, a
float32 ``(R,)`` vector over the data-parallel replicas for the figures a sick part moves
(``replica/loss``, ``replica/nonfinite``, ``replica/grad_norm``...), each reduced *within*
a replica's slice of the batch; only those vectors cross devices, and no pass over the data
is added. Under ``jit`` pass ``replicas=R`` (the batch split into ``R`` consecutive
blocks); inside ``shard_map`` pass ``axes=`` (each device's figures placed at its index and
``psum``-ed). :func:`replica_layout` maps each replica to its devices, process and host.

Every figure's formula and the two views: docs/REPLICAS.md, "The figures, in the code's
words".
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jvitals.metrics.probes import LogitsRows, LogitsSummary
from jvitals.metrics.stats import Summary, TokenSummary, eager_jit, summarize_sumsq
from jvitals.metrics.axes import bound_axes, check_axes, make_varying, reduction_axes, varying_axes
from jvitals.metrics.sown import collect_all

__all__ = [
    "REPLICA_FIGURES",
    "ReplicaWindow",
    "replica_metrics",
    "replica_window_init",
    "replica_window_metrics",
    "replica_window_update",
]

_F32 = jnp.float32
PREFIX = "replica/"
REPLICA_FIGURES = ("loss", "tokens", "nonfinite", "hidden_states_rms", "hidden_states_abs.max",
                   "output_layer_logits_abs.max", "grad_norm")
"""The figure names, each emitted as ``replica/{name}`` (``grad_norm`` only with ``grads``)."""

_HIDDEN, _LOGITS = "hidden_states", "logits"


# ----------------------------------------------------------------------------------
# Device side.


@eager_jit(static_argnames=("replicas", "axes"))
def replica_metrics(*, loss: jax.Array | None = None, mask: jax.Array | None = None,
                    intermediates: Any = None, grads: Any = None, replicas: int | None = None,
                    axes: Sequence[str] | str = (), specs: Any = None) -> dict[str, jax.Array]:
    """Each data-parallel replica's own figures, as ``(R,)`` vectors (module docstring).

    Formulas, for replica ``r`` holding batch rows ``B_r`` (valid = ``mask``)::

      replica/loss[r]     = sum_{valid in B_r} loss / n_valid[r]
      replica/tokens[r]   = n_valid[r]
      replica/hidden_states_rms[r]     = mean_l sqrt(sumsq_l[r] / count_l[r])
      replica/hidden_states_abs.max[r] = max_l max |h_l[B_r]|
      replica/output_layer_logits_abs.max[r] = max |logits[B_r, valid]|
      replica/grad_norm[r] = sqrt(sum over leaves of sum g_r^2)   (g_r: replica r's local grads)
      replica/nonfinite[r] = non-finite values among all of the above inputs of replica r

    Args:
      loss: the model's per-token ``[B, T]`` (or per-example ``[B]``, any ``[B, ...]``)
        loss, before any mean.
      mask: boolean, the shape of ``loss`` or its leading ``[B, T]`` (True = valid);
        also the token mask of the activations. None: all valid.
      intermediates: the sown collection (as :func:`jvitals.activation_metrics` takes
        it); ``hidden_states`` and ``logits`` are read when sown per token
        (``TokenSummary``/``LogitsRows``, what :func:`jvitals.instrument` sows) or raw
        (``[B, T, ...]``, ``[L, B, T, ...]`` scan-stacked). Batch-reduced probes
        (a scalar ``Summary``/``LogitsSummary``) are skipped where a per-token form of
        the same name exists, else an error.
      grads: the replica's local gradients, before the data-parallel ``psum``
        (``shard_map``/``pmap`` only).
      replicas: the number of replicas ``R`` in the global view (``jit``); inside
        ``shard_map`` it is the size of ``axes`` (checked if given).
      axes: inside ``shard_map``/``pmap``, the mesh axes the batch is sharded along
        (``'data'``, or ``('data', 'expert')``); ``()`` under plain ``jit``.
      specs: optional pytree of ``PartitionSpec`` for ``grads`` (its structure or a
        prefix): which other mesh axes each leaf is sharded along, where JAX does not
        track it (``check_vma=False``, ``pmap``).

    Returns:
      ``{"replica/{figure}": float32 (R,)}`` for the figures the inputs allow
      (``nonfinite`` always; ``tokens`` with ``loss`` or ``mask``).

    Raises:
      ValueError: a batch not divisible by ``replicas``; ``replicas`` missing under
        ``jit`` or different from the size of ``axes``; an axis not bound; a mask of
        the wrong shape; gradients under ``jit`` or already summed over ``axes``; only
        batch-reduced probes for an activation name; nothing to measure.
    """
    axes = check_axes(axes)
    size = _replica_count(axes, replicas)
    # Diagnostics only, never part of a gradient (they may be taken inside the loss function).
    loss, mask, intermediates, grads = lax.stop_gradient((loss, mask, intermediates, grads))
    groups = 1 if axes else size
    batch, mask = _check_batch(loss, mask, intermediates, groups)
    figs = _figures(loss, mask, intermediates, grads, groups=groups, batch=batch, axes=axes, specs=specs)
    if axes:
        figs = _gather(figs, axes, size)
    return {PREFIX + k: v for k, v in figs.items()}


def _check_batch(loss: Any, mask: Any, intermediates: Any, groups: int) -> tuple[int, jax.Array | None]:
    """The batch size ``B`` (divisible by ``groups``) and the boolean mask, checked."""
    batch = _batch_size(loss, mask, intermediates)
    if batch is None:
        raise ValueError("replica_metrics: nothing to measure; pass loss=[B, ...] (the per-token or "
                         "per-example loss), mask=[B, T] and/or intermediates= (the sown collection).")
    if batch % groups:
        raise ValueError(
            f"replica_metrics: the batch axis has B={batch} rows, not divisible by replicas={groups}: "
            f"each replica holds B/R consecutive rows of the global batch. Use a global batch that "
            f"is a multiple of the number of replicas (the size of the mesh's data axis).")
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        if mask.ndim == 0 or mask.shape[0] != batch:
            raise ValueError(f"replica_metrics: mask has shape {tuple(mask.shape)}; expected the "
                             f"batch-leading shape of the loss / tokens, [B, T] with B={batch}.")
    return batch, mask


def _figures(loss: Any, mask: jax.Array | None, intermediates: Any, grads: Any, *, groups: int, batch: int,
             axes: tuple[str, ...], specs: Any) -> dict[str, jax.Array]:
    """Each group's figures, ``(groups,)`` vectors (before the gather inside ``shard_map``);
    ``nonfinite`` sums the non-finite counts of every input read."""
    figs: dict[str, jax.Array] = {}
    bad = jnp.zeros((groups,), _F32)
    if loss is not None:
        figs["loss"], figs["tokens"], nf = _loss_figures(jnp.asarray(loss), mask, groups)
        bad = bad + nf
    elif mask is not None:
        figs["tokens"] = jnp.sum(mask.reshape(groups, -1), axis=1, dtype=_F32)
    if intermediates is not None:
        act, nf = _activation_figures(intermediates, mask, groups, batch)
        figs.update(act)
        bad = bad + nf
    if grads is not None:
        if not axes:
            raise ValueError(
                "replica_metrics: per-replica gradient norms need each replica's local gradients, "
                "before the data-parallel all-reduce; under plain jit (GSPMD) the gradients are "
                "already global. Compute the step under jax.shard_map with an explicit "
                "lax.psum of the gradients and pass the gradients from before it, with axes=.")
        figs["grad_norm"], nf = _local_grad_norm(grads, axes, specs)
        bad = bad + nf
    figs["nonfinite"] = bad
    return figs


def _replica_count(axes: tuple[str, ...], replicas: int | None) -> int:
    if axes:
        n = int(np.prod([lax.axis_size(a) for a in axes]))
        if replicas is not None and int(replicas) != n:
            raise ValueError(f"replica_metrics: replicas={replicas} but the batch axes {list(axes)} "
                             f"have {n} shards; pass replicas=None inside shard_map.")
        return n
    if replicas is None or isinstance(replicas, bool) or int(replicas) < 1:
        raise ValueError(
            f"replica_metrics: under plain jit pass replicas=R, the number of batch shards (e.g. "
            f"mesh.shape['data'] or vitals.replica_layout(mesh).size), got {replicas!r}; inside "
            f"shard_map pass axes=('data',) instead.")
    return int(replicas)


def _batch_size(loss: Any, mask: Any, intermediates: Any) -> int | None:
    for x in (loss, mask):
        if x is not None:
            if jnp.ndim(x) == 0:
                raise ValueError("replica_metrics: loss / mask must have a leading batch axis [B, ...], "
                                 "got a scalar: pass the per-token (or per-example) loss before its mean.")
            return int(jnp.shape(x)[0])
    if intermediates is not None:
        for name in (_HIDDEN, _LOGITS):
            for _, v in _entries(intermediates).get(name, []):
                if isinstance(v, (TokenSummary, LogitsRows)):
                    shape = v.shape
                elif hasattr(v, "shape") and jnp.ndim(v) >= 2:
                    shape = tuple(v.shape)
                else:
                    continue
                stacked = name == _HIDDEN and len(shape) >= (3 if isinstance(v, TokenSummary) else 4)
                return int(shape[1] if stacked else shape[0])
    return None


def _grouped(x: jax.Array, groups: int, lead: int = 0) -> jax.Array:
    """``x[..lead.., B, rest]`` -> ``[..lead.., G, B/G * prod(rest)]``."""
    shape = x.shape
    return x.reshape(shape[:lead] + (groups, -1))


def _rows(x: jax.Array, valid: jax.Array | None, *, square: bool, maximum: bool) -> Summary:
    """Per-row statistics of ``x [G, n, ...]`` over the valid ``[G, n]`` entries: fields ``(G,)``.

    No conditional: the non-finite count is a sum beside the others (in the global view,
    the predicate of a conditional over replica-sharded rows would cost a cross-device
    all-reduce on every step).
    ``sum`` holds the sum of squares when ``square`` (then ``sumsq`` is NaN), else the sum;
    ``abs_max`` is NaN unless ``maximum``.
    """
    xf = x.astype(_F32)
    v = None if valid is None else jnp.reshape(valid, valid.shape + (1,) * (xf.ndim - valid.ndim))
    fin = jnp.isfinite(xf)
    good = fin if v is None else fin & v
    xz = jnp.where(good, xf, 0.0)
    red = tuple(range(1, xf.ndim))
    total = jnp.sum(xz * xz if square else xz, axis=red)
    bad = jnp.sum(~fin if v is None else v & ~fin, axis=red, dtype=_F32)
    per = float(np.prod(xf.shape[valid.ndim:])) if valid is not None else float(np.prod(xf.shape[1:]))
    count = (jnp.sum(valid, axis=tuple(range(1, valid.ndim)), dtype=_F32) * per if valid is not None
             else jnp.full(total.shape, per, _F32))
    amax = jnp.max(jnp.abs(xz), axis=red) if maximum else jnp.full(total.shape, jnp.nan, _F32)
    amax = jnp.where((bad > 0) | (count <= 0), jnp.nan, amax)
    nan = jnp.full(total.shape, jnp.nan, _F32)
    return Summary(count=count, sum=nan if square else total, sumsq=total if square else nan,
                   abs_max=amax, nonfinite=bad)


def _loss_figures(loss: jax.Array, mask: jax.Array | None, groups: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-group mean loss, valid count, non-finite count."""
    x = loss.astype(_F32)
    m = None
    if mask is not None:
        if tuple(mask.shape) != tuple(x.shape[:mask.ndim]):
            raise ValueError(f"replica_metrics: the mask has shape {tuple(mask.shape)} but the loss has "
                             f"shape {tuple(x.shape)}; the mask must match the loss's leading axes.")
        m = _grouped(mask, groups)
    s = _rows(_grouped(x, groups).reshape((groups, -1) + ((x.size // mask.size,) if m is not None else ())),
              m, square=False, maximum=False)
    return s.mean, s.count, s.nonfinite


# ----------------------------------------------------------------------------------
# Activations (the sown tree read as activation_metrics reads it: sown.collect).


def _entries(tree: Any) -> dict[str, list[tuple[str, Any]]]:
    """Every sown value of the tree by its leaf NAME, in model order (Linen dict or NNX State)."""
    return collect_all(tree, "intermediates", "replica_metrics")


def _per_token(name: str, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The entries of ``name`` that still hold per-position information."""
    reduced = (Summary, LogitsSummary)
    keep = [(p, v) for p, v in items if not isinstance(v, reduced)]
    if items and not keep:
        kinds = sorted({type(v).__name__ for _, v in items})
        raise ValueError(
            f"replica_metrics: '{name}' was sown only as batch-reduced {kinds} (at {items[0][0]}), "
            f"which holds no per-replica information. Sow per-token summaries (run the apply inside "
            f"jvitals.instrument(), or sow raw [B, T, ...] tensors), or drop the activation figures "
            f"(pass loss= and mask= alone).")
    return keep


def _activation_figures(intermediates: Any, mask: jax.Array | None, groups: int, batch: int
                        ) -> tuple[dict[str, jax.Array], jax.Array]:
    entries = _entries(intermediates)
    out: dict[str, jax.Array] = {}
    bad = jnp.zeros((groups,), _F32)
    hidden = _per_token(_HIDDEN, entries.get(_HIDDEN, []))
    if hidden:
        pos = _cat([_layer_positions(p, v, mask, batch) for p, v in hidden])      # fields [L, B, T]
        s = _token_groups(pos, mask, groups, stacked=True)                        # fields [L, G]
        out["hidden_states_rms"] = jnp.mean(s.rms, axis=0)
        finite = jnp.where(jnp.isnan(s.abs_max), -jnp.inf, s.abs_max)
        nf = jnp.sum(s.nonfinite, axis=0)
        out["hidden_states_abs.max"] = jnp.where(nf > 0, jnp.nan, jnp.max(finite, axis=0))
        bad = bad + nf
    logits = _per_token(_LOGITS, entries.get(_LOGITS, []))
    if logits:
        if len(logits) != 1:
            raise ValueError(f"replica_metrics: {len(logits)} 'logits' sows (at {[p for p, _ in logits]}); "
                             f"the output logits must be sown once per call.")
        amax, nf = _logits_groups(*logits[0], mask, groups, batch)
        out["output_layer_logits_abs.max"] = amax
        bad = bad + nf
    return out, bad


def _cat(parts: list[Summary]) -> Summary:
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts)


def _check_positions(name: str, path: str, shape: tuple[int, ...], batch: int, mask: Any,
                     stacked: bool) -> None:
    pos = shape[1:] if stacked else shape
    want = tuple(mask.shape) if mask is not None else None
    if pos[0] != batch or (want is not None and tuple(pos[:len(want)]) != want):
        raise ValueError(
            f"replica_metrics: '{name}' at '{path}' covers positions {shape} but the batch is "
            f"{(want or (batch,))}; expected [B, T, ...] (or [L, B, T, ...] when nn.scan-stacked). "
            f"Pass the [B, T] mask of the tokens this apply ran on.")


def _layer_positions(path: str, v: Any, mask: jax.Array | None, batch: int) -> TokenSummary:
    """One hidden-states sow as per-position statistics with a leading layer axis ``[L, B, T]``."""
    if isinstance(v, TokenSummary):
        stacked = len(v.shape) == 3 or (len(v.shape) == 2 and v.shape[0] != batch)
        _check_positions(_HIDDEN, path, v.shape, batch, mask, stacked)
        return v if stacked else jax.tree.map(lambda f: f[None], v)
    x = jnp.asarray(v)
    stacked = x.ndim >= 4 or (x.ndim >= 2 and x.shape[0] != batch)
    _check_positions(_HIDDEN, path, tuple(x.shape), batch, mask, stacked)
    ts = _positions(x, 3 if stacked else 2)
    return ts if stacked else jax.tree.map(lambda f: f[None], ts)


def _positions(x: jax.Array, lead: int) -> TokenSummary:
    """Per-position statistics of raw activations ``[*S, ...]`` over the axes after ``S``.

    Three reductions that read ``x`` where it lies (no ``x``-sized temporary: on XLA:CPU an
    elementwise select or square before a reduction is materialised): ``sum x^2`` as a dot
    product in float32, ``max x`` and ``min x``. A position holding a NaN or Inf makes one
    of them non-finite (a NaN: the dot product; ``max`` may drop it); it is counted once in
    ``nonfinite`` (positions, not elements) and its ``abs_max`` is NaN.
    """
    d = int(np.prod(x.shape[lead:], dtype=np.int64))
    flat = x.reshape(x.shape[:lead] + (d,))
    sumsq = jnp.einsum("...d,...d->...", flat, flat, preferred_element_type=_F32)
    hi, lo = jnp.max(flat, axis=-1).astype(_F32), jnp.min(flat, axis=-1).astype(_F32)
    bad = ~(jnp.isfinite(sumsq) & jnp.isfinite(hi) & jnp.isfinite(lo))
    nan = jnp.full(sumsq.shape, jnp.nan, _F32)
    return TokenSummary(count=jnp.full(sumsq.shape, float(d), _F32), sum=nan,
                        sumsq=jnp.where(bad, 0.0, sumsq), abs_max=jnp.where(bad, jnp.nan, jnp.maximum(hi, -lo)),
                        nonfinite=bad.astype(_F32))


def _token_groups(ts: TokenSummary, mask: jax.Array | None, groups: int, stacked: bool) -> Summary:
    """Per-position statistics summed within each replica's rows: fields ``[L, G]``."""
    lead = 1 if stacked else 0
    valid = None if mask is None else _grouped(mask, groups)

    def tot(x: jax.Array) -> jax.Array:
        x = _grouped(x.astype(_F32), groups, lead)
        return jnp.sum(x if valid is None else jnp.where(valid, x, 0.0), axis=-1)

    count, nonfinite = tot(ts.count), tot(ts.nonfinite)
    a = _grouped(ts.abs_max.astype(_F32), groups, lead)
    a = jnp.where(jnp.isnan(a), -jnp.inf, a)
    if valid is not None:
        a = jnp.where(valid, a, -jnp.inf)
    amax = jnp.max(a, axis=-1, initial=-jnp.inf)
    amax = jnp.where((nonfinite > 0) | (count <= 0), jnp.nan, amax)
    s = Summary(count=count, sum=tot(ts.sum), sumsq=tot(ts.sumsq), abs_max=amax, nonfinite=nonfinite)
    return s if stacked else jax.tree.map(lambda f: f[None], s)


def _logits_groups(path: str, v: Any, mask: jax.Array | None, groups: int, batch: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Per-replica ``max |logits|`` over valid positions and the non-finite count.

    Raw ``[B, T, V]`` logits are first reduced per position over the vocabulary (no
    logits-sized temporary), then per replica as a sown :class:`LogitsRows` is; their
    non-finite count is then of positions (a sown ``LogitsRows`` counts elements).
    """
    if isinstance(v, LogitsRows):
        _check_positions(_LOGITS, path, v.shape, batch, mask, False)
        return _row_groups(v.abs_max, v.nonfinite, mask, groups)
    x = jnp.asarray(v)
    _check_positions(_LOGITS, path, tuple(x.shape), batch, mask, False)
    if mask is not None and tuple(x.shape[:-1]) != tuple(mask.shape):
        raise ValueError(f"replica_metrics: the logits at '{path}' have shape {tuple(x.shape)}; expected "
                         f"[B, T, V] with [B, T] = {tuple(mask.shape)}.")
    # Per position, three reductions that read the logits where they lie: max, min and the
    # float32 sum (NaN-propagating, where a backend's max may drop a NaN). A position holding a
    # NaN/Inf is counted once and its maximum is not read.
    hi, lo = jnp.max(x, axis=-1).astype(_F32), jnp.min(x, axis=-1).astype(_F32)
    total = jnp.sum(x, axis=-1, dtype=_F32)
    bad = ~(jnp.isfinite(total) & jnp.isfinite(hi) & jnp.isfinite(lo))
    return _row_groups(jnp.maximum(hi, -lo), bad, mask, groups)


def _row_groups(row_amax: jax.Array, row_bad: jax.Array, mask: jax.Array | None, groups: int
                ) -> tuple[jax.Array, jax.Array]:
    """Per-position ``max |x|`` and non-finite counts ``[B, ...]`` -> per replica ``(G,)``."""
    nf_rows = _grouped(row_bad.astype(_F32), groups)
    valid = jnp.ones(nf_rows.shape, bool) if mask is None else _grouped(mask, groups)
    nf = jnp.sum(jnp.where(valid, nf_rows, 0.0), axis=-1)
    a = jnp.where(valid & (nf_rows == 0), _grouped(row_amax.astype(_F32), groups), -jnp.inf)
    amax = jnp.max(jnp.where(jnp.isnan(a), -jnp.inf, a), axis=-1, initial=-jnp.inf)
    count = jnp.sum(valid, axis=-1)
    return jnp.where((nf > 0) | (count <= 0), jnp.nan, amax).astype(_F32), nf


# ----------------------------------------------------------------------------------
# Local gradients and the gather.


def _local_grad_norm(grads: Any, axes: tuple[str, ...], specs: Any) -> tuple[jax.Array, jax.Array]:
    """``sqrt`` of the replica's local sum of squares (psum-ed over the other axes a leaf is
    sharded along), and its non-finite count; shapes ``(1,)``."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        raise ValueError("replica_metrics: grads holds no arrays.")
    spec_leaves = [None] * len(leaves)
    if specs is not None:
        try:
            spec_leaves = jax.tree.leaves(jax.tree.map(
                lambda s, sub: [s] * len(jax.tree.leaves(sub)), specs, grads,
                is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)),
                is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
        except ValueError as e:
            raise ValueError(f"replica_metrics: specs must be a pytree of PartitionSpec with the "
                             f"structure of grads (or a prefix of it): {e}") from None
    for leaf in leaves:
        summed = [a for a in axes if a not in varying_axes(leaf, axes)]
        if summed:
            raise ValueError(
                f"replica_metrics: a gradient leaf of shape {tuple(leaf.shape)} is already the same on "
                f"every shard of {summed} (summed over the replicas): pass the local gradients from "
                f"before the data-parallel psum. With check_vma=True, differentiate with respect to "
                f"params made varying first (lax.pcast(params, {tuple(axes)}, to='varying')), then psum.")
    others = tuple(a for a in bound_axes() if a not in axes)
    by_axes: dict[tuple[str, ...], list[jax.Array]] = {}
    for leaf, spec in zip(leaves, spec_leaves):
        red = reduction_axes(leaf, others, spec, specs is not None) if others else ()
        by_axes.setdefault(red, []).append(leaf)
    sumsq, bad = jnp.zeros((), _F32), jnp.zeros((), _F32)
    for red, group in by_axes.items():
        s = summarize_sumsq(group)
        if red:
            s = Summary(count=s.count, sum=s.sum, abs_max=s.abs_max,
                        sumsq=lax.psum(make_varying(s.sumsq, red), red),
                        nonfinite=lax.psum(make_varying(s.nonfinite, red), red))
        sumsq, bad = sumsq + s.sumsq, bad + s.nonfinite
    norm = jnp.where(bad > 0, jnp.nan, jnp.sqrt(sumsq)).astype(_F32)
    return norm[None], bad[None]


def _gather(figs: dict[str, jax.Array], axes: tuple[str, ...], size: int) -> dict[str, jax.Array]:
    """Each device's ``(1,)`` figures placed at its replica index, psum-ed over ``axes``: ``(R,)``."""
    names = list(figs)
    local = jnp.stack([jnp.reshape(figs[k], ()).astype(_F32) for k in names])          # [F]
    here = lax.axis_index(axes) if len(axes) > 1 else lax.axis_index(axes[0])
    placed = jnp.where((jnp.arange(size) == here)[:, None], local[None, :], 0.0)      # [R, F]
    table = lax.psum(make_varying(placed, axes), axes)
    return {k: table[:, i] for i, k in enumerate(names)}


# ----------------------------------------------------------------------------------
# Who went non-finite first, between the host's checks.


class ReplicaWindow(NamedTuple):
    """Device state kept in the train state: the step each replica first went non-finite.

    A NaN on one device reaches every replica through the gradient all-reduce at the
    next update (unless the optimizer skips non-finite updates), so a host that checks
    every N steps may only ever see all replicas non-finite. The window remembers, on
    the device, ``first_nonfinite[r]``: the first step at which ``replica/nonfinite[r]
    > 0`` (-1: never); the rule names the replica(s) that went first. A rollback that
    restores the train state restores the window with it.

    Attributes:
      first_nonfinite: int32 ``(R,)``.
    """

    first_nonfinite: jax.Array


def replica_window_init(replicas: int) -> ReplicaWindow:
    """A window for ``replicas`` replicas: nobody non-finite yet."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replica_window_init: replicas={replicas!r} must be an int >= 1, the number of "
                         f"data-parallel replicas (e.g. vitals.replica_layout(mesh).size)")
    return ReplicaWindow(jnp.full((int(replicas),), -1, jnp.int32))


def replica_window_update(window: ReplicaWindow, metrics: Mapping[str, jax.Array],
                          step: jax.Array | int) -> ReplicaWindow:
    """``first[r] = step`` where replica ``r`` is non-finite now and was not before.

    Args:
      window: the previous :class:`ReplicaWindow`.
      metrics: holds ``replica/nonfinite`` (what :func:`replica_metrics` returns).
      step: this step (an int32 scalar: the train state's step).

    Returns:
      The new window (one select over ``(R,)``).

    Raises:
      ValueError: no ``replica/nonfinite`` or a window of another size.
    """
    nf = metrics.get(PREFIX + "nonfinite")
    if nf is None or jnp.shape(nf) != jnp.shape(window.first_nonfinite):
        raise ValueError(f"replica_window_update: expected metrics['replica/nonfinite'] of shape "
                         f"{tuple(jnp.shape(window.first_nonfinite))} (the window's replicas), got "
                         f"{None if nf is None else tuple(jnp.shape(nf))}.")
    bad = ~(nf == 0)
    first = window.first_nonfinite
    return ReplicaWindow(jnp.where((first < 0) & bad, jnp.asarray(step, jnp.int32), first))


def replica_window_metrics(window: ReplicaWindow) -> dict[str, jax.Array]:
    """``{"replica/first_nonfinite_step": float32 (R,)}`` (-1: never) for the host."""
    return {PREFIX + "first_nonfinite_step": window.first_nonfinite.astype(_F32)}
