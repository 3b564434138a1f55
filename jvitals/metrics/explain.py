"""What :func:`assign_roles` made of a parameter tree, as a person reads it.

:func:`explain_roles` prints every leaf's path, shape, role and layer, the stacked
subtrees, the output layer (its own leaf, tied to the embedding, or not recognised) and
the leaves no role matched (they still count in every norm; only per-role figures skip
them). A weight matrix no role names is listed under the family it sits in (attention,
MLP/MoE, embedding): the per-role figures of that family (``grad/W_up_*``...) do not
include it, and the explanation says so rather than let the figure's name claim it.

:func:`roles_summary` is the short form a training run logs once
(:func:`log_roles_summary`, called by :func:`jvitals.record` when it is built on a
parameter tree): which figures the named weights feed, which weight matrices got no role
and the one line that gives them one. It is empty when every weight matrix has a role.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from typing import Any, Mapping, TextIO

import jax

from jvitals.metrics.roles import FUSED_PARTS, LeafRole, Roles, assign_roles, check_roles

__all__ = ["FAMILIES", "RolesExplanation", "explain_roles", "family_of", "log_roles_summary", "roles_summary"]

LOGGER = logging.getLogger("jvitals.metrics")

FAMILIES: Mapping[str, tuple[str, ...]] = {
    "attention": ("q", "k", "v", "o", "qkv", "kv", "kv_shared", "q_down", "q_up", "kv_down", "kv_up",
                  "attn_gate", "rel_pos_bias"),
    "MLP": ("gate", "up", "down", "gate_up", "up_gate", "router", "expert_bias"),
    "embedding": ("embedding", "position_embedding", "lm_head", "ple_embedding", "ple_model_projection"),
}
"""Family -> its roles: a weight matrix no role names, found in a family's modules, is one
the family's per-role figures do not include."""

# Where a leaf sits, by its ancestors' names (first match wins).
_FAMILY_CONTEXT = (
    ("attention", re.compile(r"(?:^|/)[^/]*(?:attn|attention)[^/]*/", re.IGNORECASE)),
    ("MLP", re.compile(r"(?:^|/)[^/]*(?:mlp|ffn|ff_|feed_?forward|moe|experts?|router|dense_?block|"
                       r"mlpblock|densereludense)[^/]*/", re.IGNORECASE)),
    ("embedding", re.compile(r"(?:^|/)[^/]*(?:embed|wte|wpe)[^/]*/", re.IGNORECASE)),
)


def family_of(path: str) -> str:
    """The family (``attention``, ``MLP``, ``embedding`` or ``other``) a leaf's modules place it in."""
    for family, rx in _FAMILY_CONTEXT:
        if rx.search(path):
            return family
    return "other"


def _figure_names(lr: LeafRole) -> tuple[str, ...]:
    """The metric base names a leaf's gradient feeds (a fused kernel: each part's)."""
    if lr.role in FUSED_PARTS:
        return FUSED_PARTS[lr.role]
    return () if lr.name is None else (lr.name,)


@dataclasses.dataclass(frozen=True)
class RolesExplanation:
    """The result of :func:`explain_roles`; ``str()`` gives a readable table.

    Attributes:
      leaves: every leaf's :class:`LeafRole`.
      unmatched: paths no role pattern matched (they still count in norms).
      stacks: ``{prefix: (axis, num_layers, first_layer)}`` of stacked subtrees.
      tied_head: the paths of the embedding when the output layer is tied to it: no leaf
        is an ``lm_head`` and no other leaf could be one (GPT-2, Bloom, Gemma...), else ().
      unnamed: ``{family: paths}`` of the weight matrices no role names, by the family
        they sit in (:data:`FAMILIES`, or ``other``); biases and scale vectors are left out.
      partial: ``{metric base: paths}``: the figures (``grad/{base}_*``) of a family that
        has weight matrices no role names, with those matrices: the figure does not
        include them.
      head_candidates: when no leaf is an ``lm_head``: unmatched matrices outside the
        layers shaped like the embedding (``[V, D]`` or ``[D, V]``), which may be an
        output layer no pattern names (then the head is not called tied).
    """

    leaves: tuple[LeafRole, ...]
    unmatched: tuple[str, ...]
    stacks: Mapping[str, tuple[int, int, int]]
    tied_head: tuple[str, ...] = ()
    unnamed: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    partial: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    head_candidates: tuple[str, ...] = ()

    def by_role(self) -> dict[str, list[str]]:
        """``{role: [paths]}`` of the matched leaves."""
        out: dict[str, list[str]] = {}
        for lr in self.leaves:
            if lr.role is not None:
                out.setdefault(lr.role, []).append(lr.path)
        return out

    def figures(self) -> dict[str, list[str]]:
        """``{metric base: [paths]}``: which leaves each per-role figure (``grad/{base}_rms``...)
        reads; a fused kernel feeds each of its parts' figures."""
        out: dict[str, list[str]] = {}
        for lr in self.leaves:
            for name in _figure_names(lr):
                out.setdefault(name, []).append(lr.path)
        return out

    def __str__(self) -> str:
        rows = []
        for lr in self.leaves:
            if lr.stack is not None:
                layer = f"{lr.first_layer}..{lr.first_layer + lr.num_layers - 1} (stacked axis {lr.stack_axis})"
            else:
                layer = "-" if lr.layer is None else str(lr.layer)
            if lr.role is None:
                role = "-"
            elif lr.role in FUSED_PARTS:
                role = f"{lr.role} ({' | '.join(FUSED_PARTS[lr.role])})"
            else:
                role = lr.role if lr.name in (None, lr.role) else f"{lr.role} ({lr.name})"
            rows.append((lr.path, str(lr.shape), role, layer))
        w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("path", "shape", "role", "layer"))]
        fmt = "  ".join("{:<%d}" % n for n in w)
        lines = [fmt.format("path", "shape", "role", "layer").rstrip(), fmt.format(*("-" * n for n in w))]
        lines += [fmt.format(*r).rstrip() for r in rows]
        if self.stacks:
            lines.append("")
            for prefix, (axis, n, first) in self.stacks.items():
                lines.append(f"stacked: {prefix!r}: {n} layers along axis {axis} (layers {first}..{first + n - 1})")
        lines.append("")
        lines += _head_lines(self)
        shapes = {lr.path: lr.shape for lr in self.leaves}
        if self.unnamed:
            lines.append("weight matrices no role names (in no per-role figure; counted in grad/global_norm and "
                         "grad/norm/layer_i only):")
            for family, paths in self.unnamed.items():
                figs = [b for b, ps in self.partial.items() if set(ps) & set(paths)]
                note = (f" -- {', '.join(f'grad/{b}_*' for b in figs)} do not include them" if figs else "")
                lines.append(f"  {family}{note}:")
                lines += [f"    {p} {shapes[p]}" for p in paths]
        if self.unmatched:
            lines.append(f"unmatched ({len(self.unmatched)}; counted in global and per-layer norms only):")
            lines += [f"  {p}" for p in self.unmatched]
        else:
            lines.append("unmatched: none")
        return "\n".join(lines)


def _head_lines(ex: RolesExplanation) -> list[str]:
    if ex.tied_head:
        return [f"lm_head: none; the output layer is tied to the embedding ({', '.join(ex.tied_head)}): "
                f"its gradient is the embedding's, so the lm_head figures (grad/output_layer_*, "
                f"grad/norm/lm_head, grad/share/lm_head, ...) are omitted."]
    if ex.head_candidates:
        return [f"lm_head: not recognised; no figure is grad/output_layer_*. Shaped like the embedding, "
                f"outside the layers, no role: {', '.join(ex.head_candidates)} -- if it is the output layer, "
                f"name it: Roles().extend(lm_head=r'(^|/){_module(ex.head_candidates[0])}(/kernel|/weight)?$')."]
    return []


def _module(path: str) -> str:
    parts = path.split("/")
    if len(parts) > 1 and parts[-1] in ("kernel", "weight", "w"):
        return parts[-2]
    return parts[-1]


def _explain(leaves: tuple[LeafRole, ...]) -> RolesExplanation:
    stacks = {}
    for lr in leaves:
        if lr.stack is not None:
            stacks[lr.stack] = (lr.stack_axis, lr.num_layers, lr.first_layer)
    roles_found = {lr.role for lr in leaves}
    unnamed: dict[str, list[str]] = {}
    for lr in leaves:
        if lr.role is None and lr.is_matrix:
            unnamed.setdefault(family_of(lr.path), []).append(lr.path)
    partial: dict[str, list[str]] = {}
    for family, paths in unnamed.items():
        for lr in leaves:
            if lr.role in FAMILIES.get(family, ()):
                for name in _figure_names(lr):
                    partial.setdefault(name, list(paths))
    candidates: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    if "lm_head" not in roles_found and "embedding" in roles_found:
        emb = [lr for lr in leaves if lr.role == "embedding"]
        shapes = {tuple(sorted(lr.shape)) for lr in emb if len(lr.shape) == 2}
        candidates = tuple(lr.path for lr in leaves
                           if lr.role is None and not lr.layers and tuple(sorted(lr.shape)) in shapes)
        tied = () if candidates else tuple(lr.path for lr in emb)
    return RolesExplanation(leaves, tuple(lr.path for lr in leaves if lr.role is None), stacks, tied,
                            {f: tuple(p) for f, p in unnamed.items()}, {b: tuple(p) for b, p in partial.items()},
                            candidates)


def explain_roles(params: Any, roles: Roles | None = None, *, file: TextIO | None = sys.stdout) -> RolesExplanation:
    """Show which role and layer every parameter got, and which matched nothing.

    Args:
      params: a parameter pytree (arrays or ``ShapeDtypeStruct``\\ s; an ``nnx.State``).
      roles: the :class:`Roles` (defaults if None).
      file: where to print the table (None: do not print).

    Returns:
      A :class:`RolesExplanation`.

    Raises:
      TypeError: ``params`` is None or ``roles`` not a :class:`Roles`.
      ValueError: as :func:`assign_roles`.

    Example:
      >>> explain_roles(params)   # doctest: +SKIP
      path                               shape       role        layer
      params/layers_0/attn/qkv/kernel    (64, 192)   qkv         0
      ...
    """
    if params is None:
        raise TypeError("explain_roles: params is None; expected the parameter pytree, e.g. variables['params']")
    out = _explain(assign_roles(params, check_roles(roles, "explain_roles")))
    if file is not None:
        print(out, file=file)
    return out


def roles_summary(params: Any, roles: Roles | None = None) -> str:
    """A short account of what the per-role figures watch, or ``''`` when every weight
    matrix of ``params`` has a role and the output layer is accounted for.

    Otherwise: the figures the named weights feed (``Wq x2, W_up x4, ...``: leaves per
    figure), the weight matrices no role names by family and the figures of that family
    that do not include them, an output layer that may go unrecognised, and the one line
    that names them (``Roles().extend(...)``, passed as ``roles=``).

    Args:
      params: a parameter pytree (arrays, ``ShapeDtypeStruct``\\ s or tracers; an ``nnx.State``).
      roles: the :class:`Roles` (defaults if None).

    Returns:
      The summary (several lines), or ``''``.
    """
    ex = _explain(assign_roles(params, roles))
    if not ex.unnamed and not ex.head_candidates:
        return ""
    figures = ex.figures()
    n = sum(len(p) for p in ex.unnamed.values())
    total = sum(1 for lr in ex.leaves if lr.is_matrix)
    lines = [f"jvitals: {n} of {total} weight matrices have no role, so no per-role figure includes them "
             f"(they count in grad/global_norm and grad/norm/layer_i only)."]
    if figures:
        lines.append("  per-role figures read: " + ", ".join(f"{b} x{len(p)}" for b, p in sorted(figures.items())))
    shapes = {lr.path: lr.shape for lr in ex.leaves}
    for family, paths in ex.unnamed.items():
        figs = [b for b, ps in ex.partial.items() if set(ps) & set(paths)]
        head = f"  {family}" + (f" (not in {', '.join(figs)})" if figs else "") + ": "
        shown = ", ".join(f"{p} {shapes[p]}" for p in paths[:4])
        lines.append(head + shown + (f" and {len(paths) - 4} more" if len(paths) > 4 else ""))
    lines += [f"  {line}" for line in _head_lines(ex)]
    first = next((p for ps in ex.unnamed.values() for p in ps), None)
    if first is not None:
        lines.append(f"  give one a role: vitals.Roles().extend(up=r'(^|/){_module(first)}(/kernel|/weight|/w)?$') "
                     f"(any role: gate, up, down, q, k, v, o, router, or a name of your own), passed as roles= to "
                     f"record() and gradient_metrics(); vitals.explain_roles(params, roles) shows every leaf.")
    return "\n".join(lines)


_LOGGED: set[Any] = set()  # summaries already logged, by tree structure, shapes and roles


def log_roles_summary(params: Any, roles: Roles | None = None) -> str:
    """Log :func:`roles_summary` as a warning on the ``jvitals.metrics`` logger, once per
    distinct tree structure (with its shapes) and roles; quiet when it is empty.

    Called at trace time (only shapes are read), e.g. by :func:`jvitals.record`'s init.

    Returns:
      The summary logged by this call (``''`` when there is nothing to say, or it was
      logged before for this tree and roles).
    """
    roles = Roles() if roles is None else roles
    leaves, treedef = jax.tree_util.tree_flatten(params)
    key = (treedef, tuple(tuple(getattr(x, "shape", ())) for x in leaves), roles)
    if key in _LOGGED:
        return ""
    _LOGGED.add(key)
    text = roles_summary(params, roles)
    if text:
        LOGGER.warning(text)
    return text

