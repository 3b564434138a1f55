"""Activation vitals: every ``act/*`` and ``diag/*`` metric of METRICS.md §2-§4.

Computed inside the compiled step from what a Flax model sowed under the METRICS.md §7
names: raw tensors or the compact probes of :mod:`jvitals.metrics.probes`. Only a sow's
*leaf key* (its NAME) matters, not the module path above it; layers are ordered by path
with numbers compared as numbers; a scan-stacked sow holds one layer per slice. Token-shaped
values are masked with ``mask`` (``attn_logits`` also causally); a value of another name that
is not token-shaped is summarised whole, unmasked, but a ``[B*T, D]`` one beside a ``[B, T]``
mask is an error. Per-instance figures are ``{metric}/layer_{i}``; non-finite counts sit
beside them as ``act/{base}.nonfinite``.

The sow conventions accepted (containers, values, layer order, scan-stacked or not, masks),
the table of names -> figures and the distribution rules: docs/DEVICE.md, "activations:
the sow conventions and the names".
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jvitals.metrics import fold
from jvitals.metrics.probes import (LogitsRows, LogitsSummary, attention_valid_mask, row_argmax, summarize_logits)
from jvitals.metrics.stats import (Summary, TokenSummary, eager_jit, summarize, summarize_many, summarize_max)
from jvitals.metrics.checks import check_names
from jvitals.metrics.axes import check_axes
from jvitals.metrics.sown import (Entry, Tokens, cat, collect, red_axes, reduce_over, stacked_layout, token_shape,
                                  token_stacked)

__all__ = ["activation_metrics", "bos_value_grad_metrics", "mtp_metrics"]

_F32 = jnp.float32

# sow NAME -> (metric base, ((statistic, aggregate suffix), ...))
_LAYER_FAMILIES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "hidden_states": ("act/hidden_states", (("rms", ".avg"), ("abs.max", ""))),
    "attn_out_before_proj": ("act/attn_out_before_proj", (("rms", ".avg"),)),
    "gate_scores": ("act/gate_scores", (("rms", ".avg"),)),
    "attn_logits": ("act/attn_logits", (("abs.max", ""),)),
}
_LOGITS, _MTP = "logits", "mtp_logits"
_NOT_HERE = frozenset({"expert_counts"})  # read by the MoE metrics


# ----------------------------------------------------------------------------------
# Layer summaries (reading the sown tree: sown.py).


def _layer_summaries(name: str, entries: list[Entry], tok: Tokens, mask: Any,
                     strict: bool) -> Summary:
    """One ``Summary`` per instance, concatenated: fields of shape ``(n_instances,)``."""
    out = []
    for path, v in entries:
        if isinstance(v, Summary):
            if jnp.ndim(v.count) > 1:
                raise ValueError(f"activation_metrics: the Summary sown as '{name}' at '{path}' has "
                                 f"fields of shape {jnp.shape(v.count)}; expected () per layer or "
                                 f"(L,) when nn.scan-stacked.")
            out.append(v)
            continue
        if isinstance(v, TokenSummary):
            stacked = token_stacked(name, v.shape, tok, path)
            m = mask if mask is not None and stacked is not None else None
            out.append(v.masked(m, axis=0 if stacked else None))
            continue
        if isinstance(v, (LogitsSummary, LogitsRows)):
            raise ValueError(f"activation_metrics: a {type(v).__name__} was sown as '{name}' at '{path}'; "
                             f"logits probes belong under 'logits' or 'mtp_logits'.")
        x = jnp.asarray(v)
        stacked = stacked_layout(name, tuple(x.shape), tok, path, strict)
        axis = 0 if stacked else None
        if name == "attn_logits":
            lead = 1 if stacked else 0
            t_q, t_k = x.shape[-2], x.shape[-1]
            m = mask if (mask is not None and x.shape[-2:] == (mask.shape[-1],) * 2) else None
            valid = attention_valid_mask(m, t_q, t_k, x.ndim - lead)
            if stacked:
                valid = valid[None]
            out.append(summarize_max(x, valid, axis=axis))  # only its max is reported
        elif stacked is None or mask is None:
            out.append(summarize(x, axis=axis))
        else:
            out.append(summarize(x, mask, axis=axis))
    return cat(out)


def _emit_layers(out: dict, base: str, stats: Sequence[tuple[str, str]], s: Summary,
                 per_layer: bool = True) -> None:
    values = {"rms": s.rms, "abs.max": s.abs_max, "mean": s.mean, "std": s.std}
    for stat, suffix in stats:
        v = values[stat]
        agg = jnp.max(v) if stat == "abs.max" else jnp.mean(v)
        out[f"{base}_{stat}{suffix}"] = agg
        if per_layer:
            for i in range(v.shape[0]):
                out[f"{base}_{stat}/layer_{i}"] = v[i]
    out[f"{base}.nonfinite"] = jnp.sum(s.nonfinite)
    if per_layer:
        for i in range(s.nonfinite.shape[0]):
            out[f"{base}.nonfinite/layer_{i}"] = s.nonfinite[i]


# ----------------------------------------------------------------------------------
# Logits, MTP and accuracies.


def _logits_summary(path: str, v: Any, tok: Tokens, mask: Any, name: str) -> LogitsSummary:
    if isinstance(v, LogitsSummary):
        return v
    if isinstance(v, LogitsRows):
        if tok.shape is not None and v.shape != tok.shape:
            raise ValueError(
                f"activation_metrics: {tok.describe()} but the logits rows sown as '{name}' at '{path}' "
                f"cover positions {v.shape}; expected [B, T] = {tok.shape}. Pass the mask of the tokens "
                f"this apply ran on.")
        return v.summary(mask)
    if isinstance(v, Summary):
        raise ValueError(f"activation_metrics: a plain Summary was sown as '{name}' at '{path}'; "
                         f"the logits metrics need jvitals.logits_probe (a LogitsSummary) "
                         f"or the raw [B, T, V] logits.")
    x = jnp.asarray(v)
    if tok.shape is not None and tuple(x.shape[:-1]) != tok.shape:
        raise ValueError(
            f"activation_metrics: {tok.describe()} but the sown '{name}' value at '{path}' has "
            f"shape {tuple(x.shape)}; expected [B, T, V] = ({', '.join(map(str, tok.shape))}, V). "
            f"Pass a [B, T] mask (True = valid) matching the model's tokens.")
    return summarize_logits(x, mask)


def _argmaxes(name: str, entries: list[Entry], tok: Tokens) -> list[jax.Array]:
    """Per-position argmax ``[B, T]`` of each instance (stacked ``(K, B, T[, V])`` split)."""
    out = []
    for path, v in entries:
        if isinstance(v, (LogitsSummary, LogitsRows)):
            a = v.argmax
            many = tok.shape is not None and a.ndim == len(tok.shape) + 1
            out.extend(list(a) if many else [a])
            continue
        if isinstance(v, Summary):
            raise ValueError(f"activation_metrics: a plain Summary was sown as '{name}' at '{path}'; "
                             f"MTP agreement needs jvitals.logits_probe or the raw logits.")
        x = jnp.asarray(v)
        a = row_argmax(x)
        if tok.shape is not None and tuple(a.shape) not in (tok.shape,) and tuple(a.shape[1:]) == tok.shape:
            out.extend(list(a))
        elif tok.shape is not None and tuple(a.shape) != tok.shape:
            raise ValueError(
                f"activation_metrics: {tok.describe()} but the sown '{name}' value at '{path}' has "
                f"shape {tuple(x.shape)}; expected [B, T, V] = ({', '.join(map(str, tok.shape))}, V).")
        else:
            out.append(a)
    return out


def _indicator_mean(hit: jax.Array, valid: jax.Array, red: tuple[str, ...]) -> jax.Array:
    return reduce_over(summarize(hit.astype(_F32), valid), red).mean


@eager_jit(static_argnames=("axes",))
def mtp_metrics(main_argmax: jax.Array, mtp_argmax: Sequence[jax.Array], *,
                labels: jax.Array | None = None, mask: jax.Array | None = None,
                axes: Sequence[str] | str = ()) -> dict[str, jax.Array]:
    """MTP agreement and top-1 accuracies (METRICS.md §4), from argmaxes.

    The main head at position ``t`` predicts token ``t+1``; MTP depth ``k``
    (1-based) at ``t`` predicts token ``t+k+1``. Both predict the same token when
    the main head is read at ``t+k``::

      agreement_k = mean_{t : valid[t] & valid[t+k]} [argmax(main[t+k]) == argmax(mtp_k[t])]
      acc_main    = mean_{t : valid[t]}              [argmax(main[t]) == labels[t]]
      acc_k       = mean_{t : valid[t] & valid[t+k]} [argmax(mtp_k[t]) == labels[t+k]]

    Counts are ``psum``-ed over ``axes`` before dividing (shard the batch only).

    Args:
      main_argmax: ``[B, T]`` int argmax of the main logits.
      mtp_argmax: per depth k = 1..K, ``[B, T]`` int argmax of the MTP logits.
      labels: optional ``[B, T]`` next-token ids (``labels[t]`` = token ``t+1``).
      mask: optional ``[B, T]`` bool, True = valid.
      axes: mesh axes the batch is sharded along (inside ``shard_map``).

    Returns:
      ``act/mtp_{k}_lm_head_top1_agreement``; with labels also
      ``act/lm_head_top1_accuracy`` and ``act/mtp_{k}_top1_accuracy``.
    """
    axes = check_axes(axes)
    main = jnp.asarray(main_argmax)
    _check_mtp(main, mtp_argmax, labels, mask)
    b, t = main.shape
    valid = jnp.ones((b, t), bool) if mask is None else jnp.asarray(mask, bool)
    red = red_axes("mtp_logits", [main, valid, *mtp_argmax] + ([labels] if labels is not None else []),
                    axes, None)
    out: dict[str, jax.Array] = {}
    if labels is not None:
        out["act/lm_head_top1_accuracy"] = _indicator_mean(main == labels, valid, red)
    for k, mk in enumerate(mtp_argmax, start=1):
        if k >= t:
            both = jnp.zeros((b, 0), bool)
            agree = acc = both
        else:
            both = valid[:, :-k] & valid[:, k:]
            agree = main[:, k:] == mk[:, :-k]
            acc = mk[:, :-k] == labels[:, k:] if labels is not None else None
        out[f"act/mtp_{k}_lm_head_top1_agreement"] = _indicator_mean(agree, both, red)
        if labels is not None:
            out[f"act/mtp_{k}_top1_accuracy"] = _indicator_mean(acc, both, red)
    return out


# ----------------------------------------------------------------------------------
# Entry points.


def _check_mtp(main: jax.Array, mtp: Any, labels: Any, mask: Any) -> None:
    """Static shapes of :func:`mtp_metrics`' arguments: every one ``[B, T]`` as the main argmax."""
    if main.ndim != 2:
        raise ValueError(f"mtp_metrics: main_argmax has shape {main.shape}; expected [B, T] token ids "
                         f"(the argmax over the vocabulary of [B, T, V] logits)")
    if hasattr(mtp, "shape") or not isinstance(mtp, Sequence):
        raise TypeError(f"mtp_metrics: mtp_argmax must be a list with one [B, T] argmax per MTP depth, got "
                        f"{type(mtp).__name__}; for one depth pass [argmax]")
    for what, x in [*((f"mtp_argmax[{i}]", m) for i, m in enumerate(mtp)), ("labels", labels), ("mask", mask)]:
        if x is not None and tuple(jnp.shape(x)) != main.shape:
            raise ValueError(f"mtp_metrics: {what} has shape {tuple(jnp.shape(x))}, main_argmax {main.shape}; "
                             f"every one must be the same [B, T]")


@eager_jit(static_argnames=("axes", "names", "accuracy"))
def activation_metrics(
    intermediates: Any,
    *,
    mask: jax.Array | None = None,
    labels: jax.Array | None = None,
    axes: Sequence[str] | str = (),
    specs: Mapping[str, PartitionSpec | None] | None = None,
    names: Sequence[str] | None = None,
    accuracy: bool | None = None,
) -> dict[str, jax.Array]:
    """Every ``act/*`` metric of METRICS.md from a model's sown intermediates.

    Formulas (each statistic over all valid elements of the global batch, in
    float32; per-layer first, then aggregated over layers):

    - ``act/output_layer_logits_rms.avg = sqrt(sum_valid sum_v x^2 / (n_valid V))``,
      ``_abs.max = max_valid |x|``, ``_top2_diff.avg = mean_valid (top1 - top2)``,
      ``_top2_equal_ratio = mean_valid [top1 == top2]``;
      ``act/output_layer_logsumexp.mean`` / ``.max`` of ``logsumexp_v x`` over valid
      positions.
    - ``act/hidden_states_rms.avg = mean_l rms_l``, ``act/hidden_states_abs.max =
      max_l max|h_l|``; likewise ``attn_out_before_proj_rms.avg``,
      ``gate_scores_rms.avg``, ``attn_logits_abs.max`` (valid = causal & padding).
    - MTP agreement and accuracies: see :func:`mtp_metrics`.
    - any other NAME ``x``: ``act/{x}_rms``, ``_abs.max``, ``_mean``, ``_std`` over all
      its instances together.

    A non-finite value makes its statistics NaN; ``act/{base}.nonfinite`` counts
    them (per layer too), and ``act/output_layer_logits.nonfinite`` the valid positions
    whose logits hold one (rows: :func:`~jvitals.metrics.probes.logits_rows`). See the
    module docstring for the accepted sow
    conventions and the per-layer naming (``{metric}/layer_{i}``).

    Args:
      intermediates: the sown collection (Linen dict, with or without the
        ``'intermediates'`` key; NNX ``State``).
      mask: ``[B, T]`` bool, True = valid token (default: all valid).
      labels: ``[B, T]`` next-token ids, for the top-1 accuracies.
      axes: inside ``shard_map``, the mesh axes the tokens are sharded along;
        ``()`` under plain ``jit`` (global arrays).
      specs: optional ``{NAME: PartitionSpec}``: reduce that NAME's statistics over
        the axes of ``axes`` the spec names, instead of the axes its values vary
        along (needed where JAX does not track it, e.g. ``check_vma=False``, for
        values replicated over a token axis).
      names: only these sow NAMEs (each must be present); default: all.
      accuracy: compute the top-1 accuracies (``True`` requires ``labels``);
        default: when ``labels`` is given.

    Returns:
      A flat ``{name: float32 scalar}`` dict.

    Raises:
      TypeError: ``names`` a lone string, float ``labels``.
      ValueError: a mask / labels / value shape mismatch (a ``[B*T, D]`` value with a
        ``[B, T]`` mask, whatever its name: reshape it to ``[B, T, D]``), a requested NAME absent,
        ``accuracy=True`` without labels, several ``logits`` sows, MTP logits
        without the main logits.

    Example:
      >>> logits, sown = model.apply({"params": p}, tokens, mask=mask, mutable=["intermediates"])
      >>> m = activation_metrics(sown, mask=mask, labels=labels)
      >>> m["act/hidden_states_rms.avg"], m["act/hidden_states_rms/layer_0"]
    """
    axes = check_axes(axes)
    names = None if names is None else check_names(names, "activation_metrics", "names")
    entries = _select(collect(intermediates, "intermediates", "activation_metrics"), names)
    mask, labels, want_acc = _check_inputs(mask, labels, accuracy)
    tok = token_shape(mask, labels, entries)
    with fold.cpu_plain():   # the CPU's fastest form for these materialised tensors (fold.cpu_plain)
        return _figures(entries, tok, mask, labels if want_acc else None, want_acc, axes, specs)


def _figures(entries: dict[str, list[Entry]], tok: Any, mask: jax.Array | None, labels: jax.Array | None,
             want_acc: bool, axes: tuple[str, ...], specs: Any) -> dict[str, jax.Array]:
    """:func:`activation_metrics`' figures from its checked inputs."""
    out: dict[str, jax.Array] = {}
    for name, (base, stats) in _LAYER_FAMILIES.items():
        if name in entries:
            s = _layer_summaries(name, entries[name], tok, mask, strict=True)
            s = reduce_over(s, red_axes(name, [[v for _, v in entries[name]], mask], axes, specs))
            _emit_layers(out, base, stats, s)
    main = _logits_family(out, entries, tok, mask, axes, specs)
    if _MTP in entries or want_acc:
        out.update(_agreement_family(entries, tok, mask, labels, axes,
                                     None if main is None else main.argmax, _MTP in entries))
    for name, items in entries.items():
        if name in _LAYER_FAMILIES or name in (_LOGITS, _MTP) or name in _NOT_HERE:
            continue
        s = _layer_summaries(name, items, tok, mask, strict=False)
        s = reduce_over(s, red_axes(name, [[v for _, v in items], mask], axes, specs))
        _emit_generic(out, f"act/{name}", s)
    return out


def _select(entries: dict[str, list[Entry]], names: Sequence[str] | None) -> dict[str, list[Entry]]:
    """The sown entries to read (``names``, each of which must be present; None: all).

    Raises:
      ValueError: nothing was sown, or a requested name is absent.
    """
    if not entries:
        raise ValueError(
            "activation_metrics: nothing was sown (the intermediates are empty). Expected values "
            "under the METRICS.md §7 names ('hidden_states', 'logits', ...). A model that does not "
            "sow them itself: run its apply inside jvitals.instrument() with "
            "mutable=['intermediates'] -- `with vitals.instrument(): out, state = "
            "model.apply(variables, x, mutable=['intermediates'])` -- and pass state['intermediates'].")
    if names is None:
        return entries
    missing = [n for n in names if n not in entries]
    if missing:
        raise ValueError(
            f"activation_metrics: requested sow name(s) {missing} absent; the intermediates "
            f"hold {sorted(entries)}. Sow them in the model (self.sow('intermediates', NAME, value)) or "
            f"drop them from names=.")
    return {n: entries[n] for n in names}


def _check_inputs(mask: Any, labels: Any, accuracy: bool | None) -> tuple[Any, Any, bool]:
    """``(mask, labels, whether to report accuracies)``, checked: both ``[B, T]``;
    ``accuracy=True`` needs labels (default: accuracies when labels are given)."""
    if mask is not None:
        mask = jnp.asarray(mask, bool)
    if labels is not None:
        labels = jnp.asarray(labels)
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise TypeError(f"activation_metrics: labels have dtype {labels.dtype}; expected integer "
                            f"token ids [B, T] (labels[t] = token t+1), not probabilities or one-hot")
        if mask is not None and tuple(labels.shape) != tuple(mask.shape):
            raise ValueError(f"activation_metrics: labels have shape {tuple(labels.shape)} but the "
                             f"mask has shape {tuple(mask.shape)}; both must be [B, T].")
    if accuracy and labels is None:
        raise ValueError("activation_metrics: accuracy=True needs labels=[B, T] next-token ids "
                         "(labels[t] = token t+1), got labels=None.")
    return mask, labels, labels is not None if accuracy is None else bool(accuracy)


def _logits_family(out: dict, entries: Mapping[str, list[Entry]], tok: Tokens, mask: Any,
                   axes: tuple[str, ...], specs: Any) -> LogitsSummary | None:
    """The output layer's ``act/output_layer_*`` figures into ``out``; returns the
    (reduced) :class:`LogitsSummary`, whose local ``argmax`` the agreement reuses
    (one read of raw logits gives both), or None without sown logits."""
    if _LOGITS not in entries:
        return None
    if len(entries[_LOGITS]) != 1:
        paths = [p for p, _ in entries[_LOGITS]]
        raise ValueError(
            f"activation_metrics: found {len(paths)} sown 'logits' values (at {paths}); the "
            f"output-layer logits must be sown once per call. Sow MTP logits as 'mtp_logits'.")
    path, v = entries[_LOGITS][0]
    ls = _logits_summary(path, v, tok, mask, _LOGITS)
    ls = ls.reduce(red_axes(_LOGITS, [v, mask], axes, specs))
    out["act/output_layer_logits_rms.avg"] = ls.logits.rms
    out["act/output_layer_logits_abs.max"] = ls.logits.abs_max
    out["act/output_layer_logits_top2_diff.avg"] = ls.top2_diff.mean
    out["act/output_layer_logits_top2_equal_ratio"] = ls.top2_tie.mean
    out["act/output_layer_logsumexp.mean"] = ls.lse.mean
    out["act/output_layer_logsumexp.max"] = ls.lse_max
    out["act/output_layer_logits.nonfinite"] = ls.logits.nonfinite
    return ls


def _agreement_family(entries: Mapping[str, list[Entry]], tok: Tokens, mask: Any, labels: Any,
                      axes: tuple[str, ...], main: jax.Array | None, has_mtp: bool) -> dict[str, jax.Array]:
    """MTP agreement and top-1 accuracies (:func:`mtp_metrics`) from the main head's
    argmax ``main`` (None: no sown logits, an error) and the MTP heads'."""
    if main is None:
        why = "MTP agreement" if has_mtp else "top-1 accuracy"
        raise ValueError(f"activation_metrics: {why} needs the main output logits sown as "
                         f"'logits'; the intermediates hold {sorted(entries)}.")
    if labels is not None and tuple(labels.shape) != tuple(main.shape):
        raise ValueError(f"activation_metrics: labels have shape {tuple(labels.shape)} but the "
                         f"logits are [B, T, V] with [B, T] = {tuple(main.shape)}.")
    mtp = _argmaxes(_MTP, entries[_MTP], tok) if has_mtp else []
    return mtp_metrics(main, mtp, labels=labels, mask=mask, axes=axes)


def _emit_generic(out: dict, base: str, s: Summary) -> None:
    tot = s.total()
    out[f"{base}_rms"] = tot.rms
    out[f"{base}_abs.max"] = tot.abs_max
    out[f"{base}_mean"] = tot.mean
    out[f"{base}_std"] = tot.std
    out[f"{base}.nonfinite"] = tot.nonfinite
    n = s.count.shape[0]
    if n > 1:
        for i in range(n):
            out[f"{base}_rms/layer_{i}"] = s.rms[i]
            out[f"{base}_abs.max/layer_{i}"] = s.abs_max[i]
            out[f"{base}_mean/layer_{i}"] = s.mean[i]
            out[f"{base}_std/layer_{i}"] = s.std[i]
            out[f"{base}.nonfinite/layer_{i}"] = s.nonfinite[i]


@eager_jit(static_argnames=("bos_id", "axes", "name"))
def bos_value_grad_metrics(
    perturbation_grads: Any,
    tokens: jax.Array | None = None,
    *,
    bos_id: int | None = None,
    mask: jax.Array | None = None,
    axes: Sequence[str] | str = (),
    name: str = "bos_value",
    specs: Mapping[str, PartitionSpec | None] | None = None,
) -> dict[str, jax.Array]:
    """BOS attention-value gradient vitals (METRICS.md §2, ``diag/bos_value_grad_*``).

    ``g = dLoss/dv`` for the attention values ``v`` (``Module.perturb`` gradients,
    see :func:`jvitals.metrics.probes.perturb_values`). BOS positions are where
    ``tokens == bos_id`` (given both), else position 0; non-BOS are the other
    valid positions. Per layer ``l``::

      diag/bos_value_grad_rms/layer_l     = rms(g_l[valid & bos])
      diag/bos_value_grad_abs.max/layer_l = max |g_l[valid & bos]|
      diag/bos_value_grad_ratio/layer_l   = rms(g_l[valid & bos]) / rms(g_l[valid & ~bos])

    and the unsuffixed aggregates take all layers' elements together
    (``diag/bos_value_grad_rms = rms`` over every layer's BOS gradients, the ratio
    of the pooled RMSs). ``diag/bos_value_grad.nonfinite`` counts non-finite
    gradient elements at valid positions.

    Args:
      perturbation_grads: the gradient w.r.t. the ``'perturbations'`` collection
        (with or without that key); leaves named ``name``, ``[B, T, ...]`` per layer
        or ``[L, B, T, ...]`` scan-stacked.
      tokens: ``[B, T]`` token ids (for ``bos_id`` matching and the token shape).
      bos_id: BOS token id; without it (or without tokens) BOS is position 0.
      mask: ``[B, T]`` bool, True = valid.
      axes: inside ``shard_map``, the mesh axes the batch is sharded along.
      name: the perturbation name.
      specs: optional ``{name: PartitionSpec}`` (see :func:`activation_metrics`).

    Returns:
      Flat dict of float32 scalars.

    Raises:
      ValueError: if neither tokens nor mask is given, no ``name`` leaf exists, or
        the shapes do not match.
    """
    axes = check_axes(axes)
    entries = collect(perturbation_grads, "perturbations", "bos_value_grad_metrics")
    if name not in entries:
        raise ValueError(
            f"bos_value_grad_metrics: no perturbation named '{name}' in the gradients; found "
            f"{sorted(entries)}. Put jvitals.perturb_values(self, v, '{name}') on the "
            f"attention values and differentiate w.r.t. the 'perturbations' collection.")
    tok, valid, is_bos = _bos_positions(tokens, mask, bos_id)
    bos, rest = _bos_summaries(entries[name], name, tok, valid, is_bos)
    red = red_axes(name, [[v for _, v in entries[name]], valid, is_bos], axes, specs)
    return _bos_figures(*reduce_over((bos, rest), red))


def _bos_positions(tokens: Any, mask: Any, bos_id: int | None) -> tuple[Tokens, jax.Array, jax.Array]:
    """The ``[B, T]`` token shape, the valid positions and the BOS ones (``tokens ==
    bos_id`` given both, else position 0).

    Raises:
      ValueError: neither tokens nor mask, or their shapes differ.
    """
    if tokens is None and mask is None:
        raise ValueError("bos_value_grad_metrics: pass tokens=[B, T] or mask=[B, T] so that the "
                         "[B, T] token axes of the gradients can be located.")
    shape = tuple((tokens if tokens is not None else mask).shape)
    if tokens is not None and mask is not None and tuple(mask.shape) != shape:
        raise ValueError(f"bos_value_grad_metrics: mask has shape {tuple(mask.shape)} but tokens "
                         f"have shape {shape}; both must be [B, T].")
    valid = jnp.ones(shape, bool) if mask is None else jnp.asarray(mask, bool)
    if tokens is not None and bos_id is not None:
        is_bos = jnp.asarray(tokens) == bos_id
    else:
        is_bos = jnp.broadcast_to(jnp.arange(shape[-1]) == 0, shape)
    return Tokens(shape, "tokens" if tokens is not None else "mask"), valid, is_bos


def _bos_summaries(entries: list[Entry], name: str, tok: Tokens, valid: jax.Array,
                   is_bos: jax.Array) -> tuple[Summary, Summary]:
    """Per layer, the Summary of the gradients at valid BOS positions and at the other
    valid ones: one reduction per sown value for both (each gradient read once)."""
    bos_s, rest_s = [], []
    for path, v in entries:
        g = jnp.asarray(v)
        stacked = stacked_layout(name, tuple(g.shape), tok, path, strict=False)
        if stacked is None:
            raise ValueError(
                f"bos_value_grad_metrics: {tok.describe()} but the '{name}' gradient at '{path}' "
                f"has shape {tuple(g.shape)}; expected [B, T, ...] = ({', '.join(map(str, tok.shape))}, "
                f"...) or [L, B, T, ...] when nn.scan-stacked.")
        axis = 0 if stacked else None
        b, r = summarize_many([(g, valid & is_bos, axis), (g, valid & ~is_bos, axis)])
        bos_s.append(b)
        rest_s.append(r)
    return cat(bos_s), cat(rest_s)


def _bos_figures(bos: Summary, rest: Summary) -> dict[str, jax.Array]:
    """``diag/bos_value_grad_*``: the pooled RMS, max and ratio, and per layer."""
    base = "diag/bos_value_grad"
    tb, tr = bos.total(), rest.total()
    out = {f"{base}_rms": tb.rms, f"{base}_abs.max": tb.abs_max, f"{base}_ratio": tb.rms / tr.rms,
           f"{base}.nonfinite": tb.nonfinite + tr.nonfinite}
    ratio = bos.rms / rest.rms
    for i in range(bos.count.shape[0]):
        out[f"{base}_rms/layer_{i}"] = bos.rms[i]
        out[f"{base}_abs.max/layer_{i}"] = bos.abs_max[i]
        out[f"{base}_ratio/layer_{i}"] = ratio[i]
        out[f"{base}.nonfinite/layer_{i}"] = bos.nonfinite[i] + rest.nonfinite[i]
    return out
