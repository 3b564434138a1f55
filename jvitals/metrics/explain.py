"""What :func:`assign_roles` made of a parameter tree, as a person reads it.

:func:`explain_roles` prints every leaf's path, shape, role and layer, the stacked
subtrees, a tied output layer and the leaves no role matched (they still count in
every norm; only per-role figures skip them).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping, TextIO

from jvitals.metrics.roles import LeafRole, Roles, assign_roles

__all__ = ["RolesExplanation", "explain_roles"]


@dataclasses.dataclass(frozen=True)
class RolesExplanation:
    """The result of :func:`explain_roles`; ``str()`` gives a readable table.

    Attributes:
      leaves: every leaf's :class:`LeafRole`.
      unmatched: paths no role pattern matched (they still count in norms).
      stacks: ``{prefix: (axis, num_layers, first_layer)}`` of stacked subtrees.
      tied_head: the paths of the embedding when no leaf is an ``lm_head`` (the
        output layer is tied to the embedding: GPT-2, Bloom, Gemma...), else ().
    """

    leaves: tuple[LeafRole, ...]
    unmatched: tuple[str, ...]
    stacks: Mapping[str, tuple[int, int, int]]
    tied_head: tuple[str, ...] = ()

    def by_role(self) -> dict[str, list[str]]:
        """``{role: [paths]}`` of the matched leaves."""
        out: dict[str, list[str]] = {}
        for lr in self.leaves:
            if lr.role is not None:
                out.setdefault(lr.role, []).append(lr.path)
        return out

    def __str__(self) -> str:
        rows = []
        for lr in self.leaves:
            if lr.stack is not None:
                layer = f"{lr.first_layer}..{lr.first_layer + lr.num_layers - 1} (stacked axis {lr.stack_axis})"
            else:
                layer = "-" if lr.layer is None else str(lr.layer)
            role = "-" if lr.role is None else (lr.role if lr.name in (None, lr.role) else f"{lr.role} ({lr.name})")
            rows.append((lr.path, str(lr.shape), role, layer))
        w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("path", "shape", "role", "layer"))]
        fmt = "  ".join("{:<%d}" % n for n in w)
        lines = [fmt.format("path", "shape", "role", "layer"), fmt.format(*("-" * n for n in w))]
        lines += [fmt.format(*r) for r in rows]
        if self.stacks:
            lines.append("")
            for prefix, (axis, n, first) in self.stacks.items():
                lines.append(f"stacked: {prefix!r}: {n} layers along axis {axis} (layers {first}..{first + n - 1})")
        lines.append("")
        if self.tied_head:
            lines.append(
                f"lm_head: none; the output layer is tied to the embedding ({', '.join(self.tied_head)}): "
                f"its gradient is the embedding's, so the lm_head figures (grad/output_layer_*, "
                f"grad/norm/lm_head, grad/share/lm_head, ...) are omitted.")
        if self.unmatched:
            lines.append(f"unmatched ({len(self.unmatched)}; counted in global and per-layer norms only):")
            lines += [f"  {p}" for p in self.unmatched]
        else:
            lines.append("unmatched: none")
        return "\n".join(lines)


def explain_roles(params: Any, roles: Roles | None = None, *, file: TextIO | None = sys.stdout) -> RolesExplanation:
    """Show which role and layer every parameter got, and which matched nothing.

    Args:
      params: a parameter pytree (arrays or ``ShapeDtypeStruct``\\ s).
      roles: the :class:`Roles` (defaults if None).
      file: where to print the table (None: do not print).

    Returns:
      A :class:`RolesExplanation`.

    Raises:
      ValueError: as :func:`assign_roles`.

    Example:
      >>> explain_roles(params)   # doctest: +SKIP
      path                               shape       role        layer
      params/layers_0/attn/qkv/kernel    (64, 192)   qkv         0
      ...
    """
    leaves = assign_roles(params, roles)
    stacks = {}
    for lr in leaves:
        if lr.stack is not None:
            stacks[lr.stack] = (lr.stack_axis, lr.num_layers, lr.first_layer)
    roles_found = {lr.role for lr in leaves}
    tied = (tuple(lr.path for lr in leaves if lr.role == "embedding")
            if "lm_head" not in roles_found and "embedding" in roles_found else ())
    out = RolesExplanation(leaves, tuple(lr.path for lr in leaves if lr.role is None), stacks, tied)
    if file is not None:
        print(out, file=file)
    return out
