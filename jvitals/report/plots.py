"""The report's plots: one per metric family with the alert levels shaded, the level
timeline with rollbacks, the per-layer gradient-share heat map, and a replica x step
heat map per per-replica figure. matplotlib is imported when a plot is drawn.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import numpy as np

from jvitals.report.writers import (
    REPLICAS_TAG,
    ROLLBACK_LR_SCALE as LR_SCALE_TAG,
)
from jvitals.report.run import is_int, Run

__all__ = [
    "FAMILIES",
    "Family",
    "plot_family",
    "plot_layer_heatmap",
    "plot_replica_heatmap",
    "plot_timeline",
    "replica_matrices",
    "share_matrix",
]


LEVEL_COLORS = {"GREEN": "#2e9d4f", "YELLOW": "#f2c12e", "ORANGE": "#f08a24", "RED": "#d62d20"}

@dataclasses.dataclass(frozen=True)
class Family:
    """A group of metrics drawn on one plot.

    Attributes:
        key: short id, e.g. ``"grad_norm"``.
        title: plot title.
        tags: tags on the left axis (exact names).
        right: tags on a right-hand axis (another unit), may be empty.
        layer_prefix: instead of ``tags``, one line per ``{layer_prefix}layer_{i}``.
        logy: ``"auto"`` (log when positive and spanning > 2 decades), True, False.
    """

    key: str
    title: str
    tags: tuple[str, ...] = ()
    right: tuple[str, ...] = ()
    layer_prefix: str | None = None
    logy: Any = "auto"

    def present(self, run: Run) -> list[str]:
        """The family's tags that ``run`` logged (left then right)."""
        if self.layer_prefix is not None:
            return [t for _, t in run.layer_tags(self.layer_prefix)]
        return [t for t in (*self.tags, *self.right) if t in run.scalars]


FAMILIES: tuple[Family, ...] = (
        Family("loss", "Loss (train / validation)", ("loss", "val/loss")),
        Family("ppl", "Perplexity", ("ppl", "val/ppl"), logy="auto"),
        Family("val_gap", "Train/val gap (val/loss - loss)", ("val/gap",), logy=False),
        Family("grad_norm", "Gradient global norm, pre / post clip",
               ("grad/global_norm", "grad/global_norm_post_clip"), ("grad/clip_ratio",)),
        Family("nonfinite", "Non-finite gradients / skipped steps",
               ("grad/nonfinite_count", "opt/skipped_steps"), logy=False),
        Family("param_norm", "Parameter global norm", ("param/global_norm",)),
        Family("update", "Update norm and update/param ratio",
               ("update/global_norm",), ("update/param_ratio",)),
        Family("layer_grad_norm", "Per-layer gradient norm", layer_prefix="grad/norm/"),
        Family("layer_param_norm", "Per-layer parameter norm", layer_prefix="param/norm/"),
        Family("logits", "Output-layer logits",
               ("act/output_layer_logits_rms.avg", "act/output_layer_logits_abs.max",
                "act/output_layer_logits_top2_diff.avg", "act/output_layer_logsumexp.mean",
                "act/output_layer_logsumexp.max"),
               ("act/output_layer_logits_top2_equal_ratio",)),
        Family("activations", "Hidden states and attention",
               ("act/hidden_states_rms.avg", "act/hidden_states_abs.max", "act/attn_logits_abs.max",
                "act/attn_out_before_proj_rms.avg", "act/gate_scores_rms.avg")),
        Family("moe", "MoE load", ("moe/maxvio.mean", "moe/maxvio.max", "moe/load_imbalance"),
               ("moe/dead_expert_ratio",), logy=False),
        Family("moe_tokens", "MoE window tokens", ("moe/window_tokens", "moe/expected_tokens_per_expert")),
        Family("optimizer", "Adam second moment", ("opt/adam_nu_log10_spread",), ("opt/adam_nu_abs.max",)),
        Family("loss_scale", "Loss scale", ("opt/loss_scale",), logy=True),
        Family("throughput", "Throughput", ("sys/tokens_per_sec",), ("sys/steps_per_sec",), logy=False),
        Family("memory", "Device memory (bytes)",
               ("sys/device_memory_bytes", "sys/device_memory_peak_bytes"), logy=False),
        Family("lr_scale", "Learning-rate scale (rollbacks cut it)", (LR_SCALE_TAG,), logy=False),
)
_FAMILY_BY_KEY = {f.key: f for f in FAMILIES}
SHARE_PREFIX = "grad/share/"


def _family(family: str | Family) -> Family:
    if isinstance(family, Family):
        return family
    try:
        return _FAMILY_BY_KEY[family]
    except KeyError:
        raise KeyError(f"Expected a family key among {sorted(_FAMILY_BY_KEY)}, got {family!r}") from None


def _want_log(values: Sequence[np.ndarray], logy) -> bool:
    if logy != "auto":
        return bool(logy)
    v = np.concatenate([x[np.isfinite(x)] for x in values]) if values else np.array([])
    return bool(len(v) and (v > 0).all() and v.max() / v.min() > 100)


def shade_levels(ax, run: Run, *, alpha: float = 0.22) -> None:
    """Shades YELLOW/ORANGE/RED periods and draws a dashed line at each rollback."""
    for start, end, name in run.level_periods():
        if name in ("YELLOW", "ORANGE", "RED"):
            ax.axvspan(start, max(end, start + 0.5), color=LEVEL_COLORS[name], alpha=alpha, lw=0, zorder=0)
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#8b0000", ls="--", lw=1.2, zorder=3)


def _new_ax(ax, figsize=(9, 3)):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, layout="constrained")[1]


def plot_family(run: Run, family: str | Family, ax=None, *, shade: bool = True):
    """Plots one metric family against step; non-finite values are marked with a red x.

    Args:
        run: from :func:`read_run`.
        family: a key of :data:`FAMILIES` (``"loss"``, ``"grad_norm"``, ...) or a
            :class:`Family`.
        ax: a matplotlib Axes; default a new pyplot figure (notebook use).
        shade: shade the monitor's level periods and mark rollbacks.

    Returns:
        The Axes (``None`` if the run has none of the family's tags).
    """
    fam = _family(family)
    tags = fam.present(run)
    if not tags:
        return None
    ax = _new_ax(ax)
    left = tags if fam.layer_prefix else [t for t in fam.tags if t in run.scalars]
    right = [] if fam.layer_prefix else [t for t in fam.right if t in run.scalars]
    axes = [(ax, left)]
    if right:
        axes.append((ax.twinx() if left else ax, right))
    import matplotlib.transforms as mtransforms

    handles = []
    # A figure computed every N steps is drawn at its own steps, as points (never
    # forward-filled onto the steps of denser figures).
    densest = max((len(s) for s, _ in run.scalars.values()), default=0)
    for k, (a, group) in enumerate(axes):
        if not group:
            continue
        cmap = None
        if fam.layer_prefix and len(group) > 10:
            import matplotlib

            cmap = matplotlib.colormaps["viridis"]
        for j, tag in enumerate(group):
            steps, vals = run.scalars[tag]          # only the steps it was written at
            color = cmap(j / max(1, len(group) - 1)) if cmap else None
            style = "-" if k == 0 else ":"
            label = tag if not fam.layer_prefix or len(group) <= 10 or j in (0, len(group) - 1) else None
            sparse = len(steps) < 40 or len(steps) * 3 < densest
            (h,) = a.plot(steps, vals, style, lw=1.0 if sparse else 1.3, color=color, label=label,
                          marker="." if sparse else None, ms=4)
            if label:
                handles.append(h)
            if tag in run.superseded:
                ss, sv = run.superseded[tag]
                a.plot(ss, sv, "o", ms=2.5, color=h.get_color(), alpha=0.35)
            bad = ~np.isfinite(vals)
            if bad.any():
                tr = mtransforms.blended_transform_factory(a.transData, a.transAxes)
                hb = a.scatter(steps[bad], np.full(bad.sum(), 0.96), marker="x", color="#d62d20",
                               transform=tr, zorder=5, label=f"{tag}: non-finite" if j == 0 else None, clip_on=False)
                if j == 0:
                    handles.append(hb)
        if _want_log([run.scalars[t][1] for t in group], fam.logy):
            a.set_yscale("log")
        if k == 1 and left:
            a.set_ylabel(", ".join(group), fontsize=7)
    if shade:
        shade_levels(ax, run)
    ax.set_title(fam.title, fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                  ncol=min(len(handles), 4), frameon=False, borderaxespad=0.2)
    return ax


def share_matrix(run: Run):
    """``(layers, steps, matrix[L, S], source)`` of per-layer gradient shares, or ``None``."""
    tags = run.layer_tags(SHARE_PREFIX)
    source = "grad/share/layer_*"
    computed = False
    if not tags:
        tags = run.layer_tags("grad/norm/")
        source = "computed from grad/norm/layer_* as ||g_i||^2 / sum_j ||g_j||^2"
        computed = True
    if not tags:
        return None
    steps = np.unique(np.concatenate([run.scalars[t][0] for _, t in tags]))
    mat = np.full((len(tags), len(steps)), np.nan)
    for r, (_, t) in enumerate(tags):
        s, v = run.scalars[t]
        mat[r, np.searchsorted(steps, s)] = v
    if computed:
        sq = mat ** 2
        with np.errstate(invalid="ignore", divide="ignore"):
            mat = sq / np.sum(sq, axis=0, keepdims=True)
    return [i for i, _ in tags], steps, mat, source


def plot_layer_heatmap(run: Run, ax=None):
    """Heat map of each layer's gradient share (layers x steps), rollbacks marked.

    Uses ``grad/share/layer_{i}``; without them, shares computed from
    ``grad/norm/layer_{i}``. Missing or non-finite cells are grey.

    Returns:
        The Axes, or ``None`` when no per-layer gradient figures were logged.
    """
    got = share_matrix(run)
    if got is None:
        return None
    layers, steps, mat, source = got
    ax = _new_ax(ax)
    import matplotlib

    cmap = matplotlib.colormaps["magma"].with_extremes(bad="#bbbbbb")
    if len(steps) > 1:
        mids = (steps[1:] + steps[:-1]) / 2
        xedges = np.concatenate([[steps[0] - (mids[0] - steps[0])], mids, [steps[-1] + (steps[-1] - mids[-1])]])
    else:
        xedges = np.array([steps[0] - 0.5, steps[0] + 0.5])
    yedges = np.arange(len(layers) + 1) - 0.5
    m = ax.pcolormesh(xedges, yedges, np.ma.masked_invalid(mat), cmap=cmap, shading="flat")
    ax.figure.colorbar(m, ax=ax, label="share of ||g||^2", pad=0.01)
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([f"layer {i}" for i in layers], fontsize=7)
    return _finish_heat_map(ax, run, f"Per-layer gradient share ({source})")


def replica_matrices(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{figure: (steps int64[S], values float64[R, S])}`` from ``vitals/replicas_json``.

    One column per step that wrote the per-replica vectors (the last write of a step
    wins); a step with another number of replicas than the last one is left out.
    """
    by_step: dict[int, dict[str, list]] = {}
    for step, text in run.texts.get(REPLICAS_TAG, []):
        try:
            figs = json.loads(text).get("figures", {})
        except (ValueError, AttributeError):
            continue
        if isinstance(figs, Mapping):
            by_step[int(step)] = dict(figs)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    names = sorted({f for d in by_step.values() for f in d})
    for f in names:
        cols = [(st, d[f]) for st, d in sorted(by_step.items()) if isinstance(d.get(f), list)]
        if not cols:
            continue
        n = len(cols[-1][1])
        cols = [(st, v) for st, v in cols if len(v) == n]
        steps = np.array([st for st, _ in cols], dtype=np.int64)
        vals = np.array([[np.nan if x is None else float(x) for x in v] for _, v in cols], np.float64).T
        out[f] = (steps, vals)
    return out


def plot_replica_heatmap(run: Run, figure: str, ax=None, *, clip: float = 10.0):
    """Replica x step heat map of one per-replica figure, rollbacks marked.

    Each column is coloured by the robust z-score of each replica against the others
    at that step (``(x - median) / max(1.4826 MAD, 2% |median|)``, clipped to
    ``+-clip``): a sick replica is a bright row, a bad data shard a bright diagonal
    (when shards rotate). The non-finite counts are drawn as counts (log scale);
    missing or non-finite cells are grey.

    Returns:
        The Axes, or ``None`` when the figure was not logged.
    """
    from jvitals.monitor.rules_replicas import robust_z

    got = replica_matrices(run).get(figure)
    if got is None:
        return None
    steps, vals = got
    ax = _new_ax(ax)
    import matplotlib

    if figure == "nonfinite":
        mat, label, cmap = np.log10(1.0 + np.where(np.isfinite(vals), vals, np.nan)), "log10(1 + count)", "Reds"
        vmin, vmax = 0.0, max(1.0, float(np.nanmax(mat)) if np.isfinite(mat).any() else 1.0)
    else:
        mat = np.stack([robust_z(vals[:, j])[0] for j in range(vals.shape[1])], axis=1)
        mat = np.clip(mat, -clip, clip)
        label, cmap, vmin, vmax = "robust z vs the other replicas", "RdBu_r", -clip, clip
    cmap = matplotlib.colormaps[cmap].with_extremes(bad="#bbbbbb")
    if len(steps) > 1:
        mids = (steps[1:] + steps[:-1]) / 2
        xedges = np.concatenate([[steps[0] - (mids[0] - steps[0])], mids, [steps[-1] + (steps[-1] - mids[-1])]])
    else:
        xedges = np.array([steps[0] - 0.5, steps[0] + 0.5])
    yedges = np.arange(vals.shape[0] + 1) - 0.5
    m = ax.pcolormesh(xedges, yedges, np.ma.masked_invalid(mat), cmap=cmap, vmin=vmin, vmax=vmax,
                      shading="flat")
    ax.figure.colorbar(m, ax=ax, label=label, pad=0.01)
    if vals.shape[0] <= 32:
        ax.set_yticks(range(vals.shape[0]))
        ax.set_yticklabels([f"replica {i}" for i in range(vals.shape[0])], fontsize=6)
    return _finish_heat_map(ax, run, f"replica/{figure} ({vals.shape[0]} replicas x {len(steps)} steps)")


def plot_timeline(run: Run, ax=None):
    """A strip coloured by the monitor's level over steps, with rollbacks and saves marked."""
    ax = _new_ax(ax, figsize=(9, 1.2))
    first, last = run.first_step or 0, run.last_step or 1
    ax.axvspan(first, max(last, first + 1), color="#e8e8e8", lw=0)
    for start, end, name in run.level_periods():
        ax.axvspan(start, max(end, start + 0.5), color=LEVEL_COLORS.get(name, "#999999"), lw=0)
    for e in run.events:
        if e.get("event") == "save":
            ax.plot([e["step"]], [0.1], marker="|", color="#333333", ms=8)
        elif e.get("event") == "pause":
            ax.plot([e["step"]], [0.5], marker="s", color="#333333", ms=5)
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#111111", lw=2)
        ax.plot([rb["step"]], [1.0], marker="v", color="#111111", ms=9, clip_on=False)
        label = "rollback" + (f" to {rb['to_step']}" if is_int(rb.get("to_step")) else "")
        ax.annotate(label, (rb["step"], 1.0), xytext=(4, 2), textcoords="offset points", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_xlim(first, max(last, first + 1))
    ax.set_yticks([])
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title("Monitor level (green/yellow/orange/red); | save, \u25a0 pause, \u25bc rollback",
                 fontsize=9, loc="left")
    return ax


def _finish_heat_map(ax, run, title: str):
    """A heat map's rollback lines (dashed cyan), title and step axis; returns ``ax``."""
    for rb in run.rollbacks():
        ax.axvline(rb["step"], color="#00e5ff", ls="--", lw=1.2)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    return ax
