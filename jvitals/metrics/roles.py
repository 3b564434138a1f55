"""Parameter roles: which leaf of a parameter tree is the embedding, Wq, a norm scale...

The gradient and parameter figures are reported per *role* (``grad/Wq_abs.max``) and per
*layer* (``grad/norm/layer_{i}``). :class:`Roles` maps a leaf's path (``keystr(path,
simple=True, separator='/')``) to both: the role is the first ``(role, regex)`` of
:attr:`Roles.patterns` that ``re.search``-es the path (then the leaf's siblings, for what a
path cannot decide: :func:`assign_roles`); the layer is a :attr:`Roles.layer_patterns`
index, or a slice of an ``nn.scan``-stacked subtree (:attr:`Roles.stacks`). Fused roles
(:data:`FUSED_PARTS`) are split into their parts before any statistic. Leaves no pattern
matches keep their layer and count in every norm; only per-role figures skip them.

The families the defaults recognise, the special roles (fused, ``kv_shared``, ``norm``),
Flax NNX paths and :func:`explain_roles`: docs/MODELS.md, "Roles, in detail".
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import jax

from jvitals.metrics.paths import path_str
from jvitals.metrics.role_patterns import (  # noqa: F401 (the default tables, re-exported here)
    DEFAULT_FUSED_AXES,
    DEFAULT_LAYER_PATTERNS,
    DEFAULT_PATTERNS,
    DEFAULT_QKV_LAYOUTS,
    DEFAULT_STACKS,
    FUSED_PARTS,
    ROLE_HINTS,
    ROLE_METRIC_NAMES,
    UP_OR_FUSED,
)

__all__ = [
    "DEFAULT_FUSED_AXES",
    "DEFAULT_LAYER_PATTERNS",
    "DEFAULT_PATTERNS",
    "DEFAULT_QKV_LAYOUTS",
    "DEFAULT_STACKS",
    "FUSED_PARTS",
    "LeafRole",
    "QKVSplit",
    "ROLE_METRIC_NAMES",
    "Roles",
    "assign_roles",
    "check_roles",
    "scope_of",
]


# ----------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class QKVSplit:
    """How a fused QKV kernel splits into Q, K and V (see :mod:`jvitals.metrics.qkv`).

    The split axis holds ``(num_heads + 2 * num_kv_heads) * head_dim`` entries;
    Q gets ``num_heads`` of every ``num_heads + 2 * num_kv_heads`` parts, K and V
    ``num_kv_heads`` each (grouped-query attention), laid out as ``layout`` says:

    * ``"contiguous"``: ``[Q heads | K heads | V heads]`` (GPT-2's ``c_attn``, the
      reference model's ``qkv``). Without head counts the axis splits into equal
      thirds (multi-head attention), or by the Q width the output projection
      gives (grouped-query).
    * ``"interleaved"``: ``[KVH, H / KVH + 2, Dh]``: per key/value group its query
      heads, its key head, its value head; ``[H, 3, Dh]`` without grouping (HF
      Bloom's and GPT-NeoX's ``query_key_value``, Falcon, Megatron GQA). Needs
      ``num_heads``: without it jvitals raises instead of splitting wrongly.
    * None (default): by path, :attr:`Roles.qkv_layouts` (``query_key_value`` is
      interleaved, everything else contiguous).

    Attributes:
      axis: the split axis of one layer's kernel (``-1``: output columns). For a
        scan-stacked kernel it is converted to the stacked array's axis. None
        (default) picks it from the shape: an axis of size 3 when no head counts
        are given (``[D, 3, H, Dh]``), else the larger axis of a 2-D kernel (the
        fused one: ``[D, 3D]`` Linen, ``[3D, D]`` HF-Flax GPT-2's ``Conv1D``; the
        last on a tie), else the last axis.
      num_heads: query heads ``H`` (None: equal thirds).
      num_kv_heads: key/value heads ``KVH`` (None: equal to ``num_heads``).
      layout: ``"contiguous"``, ``"interleaved"`` or None (by path).

    Example:
      >>> Roles(qkv_split=QKVSplit(num_heads=16, layout="interleaved"))   # Bloom, GPT-NeoX
      >>> Roles(qkv_split=QKVSplit.from_config(model.config))              # any HF config
    """

    axis: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    layout: str | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in ("contiguous", "interleaved"):
            raise ValueError(f"QKVSplit(layout={self.layout!r}): expected 'contiguous' ([Q | K | V]), "
                             f"'interleaved' (per head [H, 3, Dh] / per group) or None (by path)")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "QKVSplit":
        """Head counts from a model config (HF ``num_attention_heads``/``n_head``/
        ``num_heads``, ``num_key_value_heads``/``num_kv_heads``); ``overrides`` win."""
        def first(*names: str) -> Any:
            for n in names:
                v = getattr(config, n, None)
                if v is not None:
                    return int(v)
            return None

        kw = dict(num_heads=first("num_attention_heads", "n_head", "num_heads", "n_heads"),
                  num_kv_heads=first("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"))
        kw.update(overrides)
        return cls(**kw)

    def resolve_axis(self, shape: Sequence[int]) -> int:
        """The split axis (non-negative) for one layer's kernel of ``shape``."""
        nd = len(shape)
        if nd == 0:
            raise ValueError("fused QKV split: a scalar cannot be split into Q, K, V")
        if self.axis is not None:
            if not -nd <= self.axis < nd:
                raise ValueError(f"fused QKV split: axis={self.axis} is out of range for a kernel of shape "
                                 f"{tuple(shape)} (one layer's shape); set QKVSplit(axis=...)")
            return self.axis % nd
        if self.num_heads is None and nd > 2 and 3 in tuple(shape)[:-1]:
            return tuple(shape).index(3)
        if nd == 2 and shape[0] > shape[1]:
            return 0
        return nd - 1

    def sizes(self, n: int, path: str = "qkv", axis_desc: str | None = None,
              q_size: int | None = None) -> tuple[int, int, int]:
        """``(q, k, v)`` sizes along the split axis for an axis of ``n`` entries.

        Without head counts, ``q_size`` (the Q width, inferred by
        :func:`~jvitals.metrics.gradients.gradient_metrics` from the attention's output
        projection: ``H * Dh = numel(Wo) / D``) gives a grouped-query split
        ``(q, (n - q) / 2, (n - q) / 2)``; without it the axis splits in thirds.

        Raises:
          ValueError: if ``n`` is not divisible into the configured parts.
        """
        h = self.num_heads
        kvh = self.num_kv_heads if self.num_kv_heads is not None else h
        where = axis_desc or f"axis {self.axis}"
        if h is None and q_size is not None and 0 < q_size < n and (n - q_size) % 2 == 0:
            return q_size, (n - q_size) // 2, (n - q_size) // 2
        if h is None:
            if n % 3:
                raise ValueError(
                    f"fused QKV split: kernel {path!r} has {n} entries on {where}, not divisible "
                    f"into equal Q, K, V thirds. For grouped-query attention pass the head counts, "
                    f"e.g. Roles(qkv_split=QKVSplit(num_heads=H, num_kv_heads=KVH, axis=AXIS)), "
                    f"or the right axis.")
            return n // 3, n // 3, n // 3
        parts = h + 2 * kvh
        if h <= 0 or kvh <= 0 or n % parts:
            raise ValueError(
                f"fused QKV split: kernel {path!r} has {n} entries on {where}, not divisible into "
                f"(H + 2*KVH) = ({h} + 2*{kvh}) = {parts} heads. Expected a multiple of {parts} "
                f"([Q heads | K heads | V heads] of equal head_dim); check QKVSplit(num_heads=..., "
                f"num_kv_heads=..., axis=...).")
        d = n // parts
        return h * d, kvh * d, kvh * d


@dataclasses.dataclass(frozen=True)
class Roles:
    """Maps parameter paths to roles and layers (see the module docstring).

    Attributes:
      patterns: ``(role, regex)`` pairs, first match wins (:data:`DEFAULT_PATTERNS`).
      layer_patterns: regexes capturing a Python-list layer's index in group 1.
      stacks: ``(regex, axis)`` rules for ``nn.scan``-stacked subtrees.
      stacked_axis: if set, overrides the axis of every stack rule (MaxText:
        ``param_scan_axis``; the reference model: 0).
      qkv_split: how fused QKV kernels split.
      qkv_layouts: ``(regex, layout)``: the layout of a fused kernel whose path
        matches, when ``qkv_split.layout`` is None (:data:`DEFAULT_QKV_LAYOUTS`;
        no match: ``"contiguous"``).
      fused_axes: ``(regex, axis)``: the split axis of a fused kernel of rank > 2
        whose path matches (:data:`DEFAULT_FUSED_AXES`; negative: from the end of one
        layer's shape). ``QKVSplit(axis=...)`` wins for ``qkv``.
      required: roles that must match at least one leaf (``ValueError`` if not).
        ``q``/``k``/``v`` are satisfied by a fused ``qkv``, ``gate``/``up`` by a fused
        ``gate_up``/``up_gate``.
      norm_prefixes: ``(regex, prefix)``: a norm whose path matches ``regex`` is
        named ``prefix + name`` (MTP blocks' norms become ``mtp_input_layernorm``,
        kept apart from the trunk's ``input_layernorm``).

    Example:
      >>> roles = Roles().extend(q=r"(^|/)my_query/kernel$").replace(stacked_axis=1)
      >>> roles = Roles(qkv_split=QKVSplit(num_heads=8, num_kv_heads=2), required=("q", "o"))
    """

    patterns: tuple[tuple[str, str], ...] = DEFAULT_PATTERNS
    layer_patterns: tuple[str, ...] = DEFAULT_LAYER_PATTERNS
    stacks: tuple[tuple[str, int], ...] = DEFAULT_STACKS
    stacked_axis: int | None = None
    qkv_split: QKVSplit = QKVSplit()
    qkv_layouts: tuple[tuple[str, str], ...] = DEFAULT_QKV_LAYOUTS
    fused_axes: tuple[tuple[str, int], ...] = DEFAULT_FUSED_AXES
    required: tuple[str, ...] = ()
    norm_prefixes: tuple[tuple[str, str], ...] = ((r"(?:^|/)mtp_?\d+/", "mtp_"),)

    def __post_init__(self) -> None:
        if isinstance(self.patterns, (str, Mapping)) or not all(
                isinstance(x, tuple) and len(x) == 2 for x in self.patterns):
            raise TypeError(f"Roles(patterns=...) expects (role, regex) pairs, e.g. (('q', r'(^|/)wq$'),), "
                            f"got {self.patterns!r:.80}; to add a few to the defaults use Roles().extend(q=regex)")
        if self.stacked_axis is not None and (isinstance(self.stacked_axis, bool)
                                              or not isinstance(self.stacked_axis, int)):
            raise TypeError(f"Roles(stacked_axis={self.stacked_axis!r}) expects None or an int (the scan "
                            f"axis of stacked layers, e.g. 0; MaxText: param_scan_axis)")
        for role, rx in self.patterns:
            _compile(rx, f"pattern for role {role!r}")
        for rx in self.layer_patterns:
            c = _compile(rx, "layer pattern")
            if c.groups < 1:
                raise ValueError(f"layer pattern {rx!r} must capture the layer index in group 1")
        for rx, layout in self.qkv_layouts:
            _compile(rx, "qkv layout rule")
            if layout not in ("contiguous", "interleaved"):
                raise ValueError(f"qkv layout rule ({rx!r}, {layout!r}): layout must be 'contiguous' "
                                 f"or 'interleaved'")
        for rx, axis in self.stacks:
            _compile(rx, "stack pattern")
            if not isinstance(axis, int):
                raise ValueError(f"stack rule ({rx!r}, {axis!r}): axis must be an int")
        for rx, axis in self.fused_axes:
            _compile(rx, "fused axis rule")
            if not isinstance(axis, int):
                raise ValueError(f"fused axis rule ({rx!r}, {axis!r}): axis must be an int (negative: from "
                                 f"the end of one layer's shape)")
        if isinstance(self.required, str):
            object.__setattr__(self, "required", (self.required,))

    # -- building variants ------------------------------------------------------

    def replace(self, **changes: Any) -> "Roles":
        """A copy with fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def extend(self, **role_patterns: str | Sequence[str]) -> "Roles":
        """Add patterns for roles, tried before every existing pattern.

        Args:
          **role_patterns: ``role=regex`` or ``role=(regex, ...)``; new role names
            are allowed (reported as ``grad/{role}_rms``).
        """
        new = tuple((r, p) for r, ps in role_patterns.items() for p in _as_tuple(ps))
        return self.replace(patterns=new + self.patterns)

    def override(self, **role_patterns: str | Sequence[str]) -> "Roles":
        """Replace every pattern of the named roles by the given ones (tried first)."""
        kept = tuple((r, p) for r, p in self.patterns if r not in role_patterns)
        new = tuple((r, p) for r, ps in role_patterns.items() for p in _as_tuple(ps))
        return self.replace(patterns=new + kept)

    def without(self, *roles: str) -> "Roles":
        """Drop every pattern of the named roles."""
        return self.replace(patterns=tuple((r, p) for r, p in self.patterns if r not in roles))

    def with_stack(self, pattern: str, axis: int = 0) -> "Roles":
        """Add a stacked-subtree rule (tried before the defaults)."""
        return self.replace(stacks=((pattern, axis),) + self.stacks)

    # -- matching -----------------------------------------------------------------

    def role_of(self, path: str) -> tuple[str | None, str | None]:
        """``(role, metric base name)`` of a path, or ``(None, None)``."""
        for role, rx in self.patterns:
            m = _compile(rx, role).search(path)
            if m is None:
                continue
            if role == "norm":
                name = m.groupdict().get("name") or _parent(path)
                for prx, prefix in self.norm_prefixes:
                    if _compile(prx, "norm prefix").search(path):
                        name = prefix + name
                        break
                else:
                    if name.lower() == "norm":  # grad/norm_rms would read as grad/norm/layer_i
                        inside = self.layer_of(path) is not None or self.stack_of(path) is not None
                        name = "block_norm" if inside else "final_norm"
                return role, name
            return role, ROLE_METRIC_NAMES.get(role, role)
        return None, None

    def qkv_layout_of(self, path: str) -> str:
        """The fused-QKV layout of the kernel at ``path``: ``qkv_split.layout`` if set,
        else the first :attr:`qkv_layouts` rule that matches, else ``"contiguous"``."""
        if self.qkv_split.layout is not None:
            return self.qkv_split.layout
        for rx, layout in self.qkv_layouts:
            if _compile(rx, "qkv layout rule").search(path):
                return layout
        return "contiguous"

    def fused_axis_of(self, path: str, layer_shape: Sequence[int]) -> int | None:
        """The split axis (non-negative) of the fused kernel at ``path`` of one layer's
        ``layer_shape`` given by the first :attr:`fused_axes` rule that matches, or None
        (no rule, or a kernel of rank <= 2: its axis comes from its shape).

        Raises:
          ValueError: if the rule's axis is out of range for ``layer_shape``.
        """
        nd = len(layer_shape)
        if nd <= 2:
            return None
        for rx, axis in self.fused_axes:
            if _compile(rx, "fused axis rule").search(path):
                if not -nd <= axis < nd:
                    raise ValueError(
                        f"fused kernel {path!r} of per-layer shape {tuple(layer_shape)}: the fused axis rule "
                        f"({rx!r}, {axis}) is out of range. Pass Roles(fused_axes=((r'...', AXIS),) + "
                        f"DEFAULT_FUSED_AXES) with the axis its parts are stacked or concatenated on.")
                return axis % nd
        return None

    def layer_of(self, path: str) -> int | None:
        """Index of the Python-list layer ``path`` lies in, or None."""
        for rx in self.layer_patterns:
            m = _compile(rx, "layer pattern").search(path)
            if m is not None:
                return int(m.group(1))
        return None

    def stack_of(self, path: str) -> tuple[str, int] | None:
        """``(stack prefix, axis)`` if ``path`` lies in a scan-stacked subtree."""
        for rx, axis in self.stacks:
            m = _compile(rx, "stack pattern").search(path)
            if m is not None:
                return path[: m.end()], (self.stacked_axis if self.stacked_axis is not None else axis)
        return None


class LeafRole(NamedTuple):
    """What :func:`assign_roles` decided for one leaf.

    Attributes:
      path: ``keystr(path, simple=True, separator='/')``.
      shape: the leaf's shape.
      role: the role, or None (unmatched; still counted in norms).
      name: the metric base name (``Wq``, ``input_layernorm``...), or None.
      layer: the layer of a Python-list leaf, or None.
      stack: the stacked subtree's prefix for a scan-stacked leaf, or None.
      stack_axis: the layer axis of a stacked leaf, or None.
      first_layer: the model layer index of entry 0 along ``stack_axis``.
      num_layers: the leaf's size along ``stack_axis``.
    """

    path: str
    shape: tuple[int, ...]
    role: str | None
    name: str | None
    layer: int | None
    stack: str | None = None
    stack_axis: int | None = None
    first_layer: int | None = None
    num_layers: int | None = None

    @property
    def layers(self) -> tuple[int, ...]:
        """Model layer indices this leaf holds (empty for non-layer leaves)."""
        if self.stack is not None:
            return tuple(range(self.first_layer, self.first_layer + self.num_layers))
        return () if self.layer is None else (self.layer,)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's shape: the shape without the stacked layer axis (if any)."""
        if self.stack_axis is None:
            return self.shape
        return self.shape[: self.stack_axis] + self.shape[self.stack_axis + 1:]

    @property
    def is_matrix(self) -> bool:
        """Whether the leaf is a weight matrix: rank >= 2 per layer and not a bias (scales,
        biases and norm weights are vectors). Only matrices are reported when no role names
        them (:func:`~jvitals.metrics.explain.roles_summary`)."""
        return len(self.layer_shape) >= 2 and "bias" not in self.path.rsplit("/", 1)[-1].lower()


# ----------------------------------------------------------------------------------
# Resolution.


def _is_param_leaf(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_roles(roles: Any, where: str) -> Roles:
    """``roles`` if it is a :class:`Roles` instance (``Roles()`` for None)."""
    if roles is None:
        return Roles()
    if isinstance(roles, Roles):
        return roles
    fix = ("the class itself: call it, roles=vitals.Roles()" if roles is Roles
           else "build one: roles=vitals.Roles().extend(role=regex), e.g. Roles().extend(q=r'(^|/)wq$')")
    raise TypeError(f"{where}: roles= expects a jvitals.Roles, got {type(roles).__name__} {roles!r:.60}; {fix}")


def assign_roles(tree: Any, roles: Roles | None = None) -> tuple[LeafRole, ...]:
    """Role and layer of every leaf of ``tree``, in ``jax.tree`` flatten order.

    Works on arrays, ``jax.ShapeDtypeStruct``\\ s or tracers (only shapes are read),
    so it runs at trace time at no device cost.

    Roles: the first pattern that matches each path, then what the siblings of a leaf
    say (the leaves of the same module, :func:`scope_of`): a fused gate/up candidate
    beside an up projection is the gate, one as large as its down projection is the up
    projection; a K alone, where other layers have a V, is K and V (``kv_shared``).

    Layers: a Python-list leaf takes the index its path names; a scan-stacked
    subtree contributes ``size along stack axis`` layers. Several stacked subtrees
    (MaxText's ``dense_layers`` then ``moe_layers``) are numbered one after the
    other in the order of their prefixes. If a stacked subtree's leaves disagree on
    their size along the rule's axis, the first axis on which they all agree is used
    (``explain_roles`` shows it); if there is none, that is an error.

    Args:
      tree: a parameter (or gradient, update) pytree.
      roles: the :class:`Roles` (default patterns if None).

    Returns:
      A tuple of :class:`LeafRole`, one per array leaf.

    Raises:
      TypeError: ``tree`` is None or ``roles`` not a :class:`Roles` (a dict, the class uncalled).
      ValueError: if a required role matches nothing (listing the nearest paths), or
        a stacked subtree has no consistent layer axis.
    """
    roles = check_roles(roles, "assign_roles")
    if tree is None:
        raise TypeError("assign_roles: tree is None; expected a parameter (or gradient) pytree, e.g. "
                        "variables['params'] or nnx.state(model, nnx.Param)")
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    raw = []
    for p, x in leaves:
        path = path_str(p)
        shape = tuple(getattr(x, "shape", ()))
        role, name = roles.role_of(path)
        stack = roles.stack_of(path)
        raw.append((path, shape, role, name, stack))

    # Stacked subtrees: find each one's layer axis and size.
    groups: dict[str, list[tuple[str, tuple[int, ...], int]]] = {}
    for path, shape, _, _, stack in raw:
        if stack is not None:
            groups.setdefault(stack[0], []).append((path, shape, stack[1]))
    group_axis: dict[str, tuple[int, int]] = {}
    for prefix, members in groups.items():
        want = members[0][2]
        group_axis[prefix] = _stack_axis(prefix, members, want)
    offsets: dict[str, int] = {}
    start = 0
    for prefix in sorted(groups):
        offsets[prefix] = start
        start += group_axis[prefix][1]

    out = []
    for path, shape, role, name, stack in raw:
        if stack is not None:
            axis, n = group_axis[stack[0]]
            out.append(LeafRole(path, shape, role, name, None, stack[0], axis, offsets[stack[0]], n))
        else:
            out.append(LeafRole(path, shape, role, name, roles.layer_of(path)))
    out = _by_context(out, roles)
    _check_required(out, roles)
    return out


def scope_of(path: str) -> str:
    """The module holding a weight's module: ``layers_0/mlp`` for ``layers_0/mlp/wi/kernel``,
    ``layers/0/moe`` for a bare ``layers/0/moe/linear``. Leaves of one scope are siblings
    (one attention, one MLP, one block): :func:`assign_roles` reads a fused kernel's
    siblings to tell what it is."""
    parts = path.split("/")
    if len(parts) > 1 and parts[-1] in ("kernel", "weight", "w"):
        parts = parts[:-1]
    return "/".join(parts[:-1])


def _by_context(leaves: Sequence[LeafRole], roles: Roles) -> tuple[LeafRole, ...]:
    """The roles a path cannot decide alone, from each leaf's siblings (:func:`scope_of`).

    * A fused gate/up candidate (``gate_up``, ``up_gate``) beside a separate up
      projection is the gate (LLaDA's ``ff_proj`` beside ``up_proj``); one whose name is
      fused in some families only (:data:`~jvitals.metrics.role_patterns.UP_OR_FUSED`)
      and that holds as many entries as its down projection is a plain up projection
      (T5's ``wi`` beside ``wo``, OLMo's ``ff_proj`` with a GELU MLP); otherwise it stays
      fused (split into ``W_gate`` and ``W_up``: twice the down projection's entries).
      Inside ``shard_map`` the sizes are a shard's (a kernel and its down projection
      sharded by different factors compare wrongly): a pattern of your own
      (``Roles().extend(gate_up=...)``) is taken as it is.
    * A ``k`` with no V projection beside it, in a model whose other attention layers
      have one, is read as K and V (``kv_shared``: MaxText's ``share_kv_projections``
      keeps ``key`` alone) -- unless a weight matrix no role names sits beside it (that
      may be the V projection: it is reported, nothing is assumed).
    """
    scopes: dict[str, list[int]] = {}
    for i, lr in enumerate(leaves):
        scopes.setdefault(scope_of(lr.path), []).append(i)
    v_roles = ("v", "kv", "qkv", "kv_shared")
    has_v = any(lr.role in ("v", "kv", "qkv") for lr in leaves)
    out = list(leaves)
    for i, lr in enumerate(leaves):
        sib = [leaves[j] for j in scopes[scope_of(lr.path)] if j != i]
        if lr.role in ("gate_up", "up_gate"):
            if any(s.role == "up" for s in sib):
                out[i] = lr._replace(role="gate", name=ROLE_METRIC_NAMES["gate"])
            elif (_compile(UP_OR_FUSED, "up or fused").search(lr.path) and _by_default(roles, lr.path)
                  and any(s.role == "down" and math.prod(s.shape) == math.prod(lr.shape) for s in sib)):
                out[i] = lr._replace(role="up", name=ROLE_METRIC_NAMES["up"])
        elif (lr.role == "k" and has_v and not any(s.role in v_roles for s in sib)
              and not any(s.role is None and s.is_matrix for s in sib)):
            out[i] = lr._replace(role="kv_shared", name=ROLE_METRIC_NAMES["kv_shared"])
    return tuple(out)


def _by_default(roles: Roles, path: str) -> bool:
    """Whether ``path``'s role comes from a default pattern (not one the user added)."""
    for role, rx in roles.patterns:
        if _compile(rx, role).search(path):
            return (role, rx) in DEFAULT_PATTERNS
    return False


def _stack_axis(prefix: str, members: list, want: int) -> tuple[int, int]:
    def sizes(axis: int) -> set[int] | None:
        got = set()
        for _, shape, _ in members:
            if len(shape) == 0 or not -len(shape) <= axis < len(shape):
                return None
            got.add(shape[axis])
        return got

    if want < 0:
        raise ValueError(f"stack rule for {prefix!r}: the layer axis must be >= 0, got {want}")
    s = sizes(want)
    if s is not None and len(s) == 1:
        return want, s.pop()
    for axis in range(max(len(m[1]) for m in members)):
        s = sizes(axis)
        if s is not None and len(s) == 1:
            return axis, s.pop()
    shapes = ", ".join(f"{p}: {sh}" for p, sh, _ in members[:6])
    raise ValueError(
        f"stacked subtree {prefix!r}: its leaves do not share a layer axis (expected the same size "
        f"along axis {want} for every leaf; got {shapes}). If it is not nn.scan-stacked, drop the "
        f"rule with Roles(stacks=...); if the layer axis is elsewhere, pass Roles(stacked_axis=AXIS).")


def _check_required(leaves: Sequence[LeafRole], roles: Roles) -> None:
    found = {lr.role for lr in leaves}
    if "qkv" in found:
        found |= {"q", "k", "v"}
    if found & {"kv", "kv_shared"}:
        found |= {"k", "v"}
    if found & {"gate_up", "up_gate"}:
        found |= {"gate", "up"}
    for role in roles.required:
        if role in found:
            continue
        tried = [rx for r, rx in roles.patterns if r == role]
        near = _nearest([lr.path for lr in leaves if lr.role is None] or [lr.path for lr in leaves], role)
        raise ValueError(
            f"required role {role!r} matched no parameter. Patterns tried: {tried or '(none)'}. "
            f"Nearest paths: {near}. Add a pattern for it, e.g. "
            f"roles.extend({role}=r'(^|/)your_module/kernel$'), or drop it from required.")


def _nearest(paths: Sequence[str], role: str, k: int = 5) -> list[str]:
    words = ROLE_HINTS.get(role, (role,))

    def score(path: str) -> float:
        parts = path.lower().split("/")
        return max(difflib.SequenceMatcher(None, w, p).ratio() for w in words for p in parts)

    return sorted(paths, key=lambda p: -score(p))[:k]


# ----------------------------------------------------------------------------------


_CACHE: dict[tuple[str, str], re.Pattern] = {}


def _compile(rx: str, what: str) -> re.Pattern:
    # A cache of compiled immutable regexes (not a registry of behaviour).
    key = (rx, what)
    c = _CACHE.get(key)
    if c is None:
        try:
            c = re.compile(rx, re.IGNORECASE)
        except re.error as e:
            raise ValueError(f"{what}: {rx!r} is not a valid regular expression: {e}") from None
        _CACHE[key] = c
    return c


def _parent(path: str) -> str:
    parts = path.split("/")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def _as_tuple(x: str | Iterable[str]) -> tuple[str, ...]:
    return (x,) if isinstance(x, str) else tuple(x)
