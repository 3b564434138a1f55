"""``instrument()``: jvitals' activation summaries from any Flax model, Linen or NNX, unmodified.

A model that never calls ``sow`` gives :func:`~jvitals.metrics.activations.activation_metrics`
nothing to read. Around its call, :func:`instrument` intercepts every module call (Linen:
``flax.linen.intercept_methods``; NNX: :mod:`jvitals.metrics.nnx_intercept`) and sows, under
the METRICS.md §7 names, compact *per-token summaries* of what the
:class:`~jvitals.metrics.roles.Roles` patterns recognise, so no mask is needed here: the
mask given later to ``activation_metrics`` drops padded positions exactly as if the raw
tensors had been sown. Every summary is taken on ``lax.stop_gradient`` of the activations
(neither the loss nor the gradients change), inside ``jit``, ``nn.scan`` and ``nn.remat``.

Usage, the table of names and where each is found, padding, cost and how NNX modules are
wrapped: docs/DEVICE.md, "instrument: activation summaries from an unmodified model".
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import warnings
from typing import Any, Callable, Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax import lax

from jvitals.metrics import fold
from jvitals.metrics.nnx_intercept import intercept_methods as intercept_nnx
from jvitals.metrics.probes import logits_rows
from jvitals.metrics.roles import Roles, check_roles
from jvitals.metrics.checks import check_names, check_number, not_nested
from jvitals.metrics.stats import summarize_tokens
from jvitals.metrics.xla_attention import attention_with_summary, bias_keeps, softmax_input_summary, valid_pairs

__all__ = ["ExpertChoices", "InstrumentReport", "instrument"]

_F32 = jnp.float32
_COLLECTION = "intermediates"
_KERNEL_NAMES = ("kernel", "weight", "w", "embedding")
_NNX_METHODS = ("__call__", "attend", "decode")  # decode: a tied head (tunix's Embedder.decode)


@struct.dataclass
class ExpertChoices:
    """The experts each token was routed to, as ``instrument`` sows ``expert_counts``.

    Attributes:
      experts: ``[*S, k]`` int32 expert indices (``S = [B, T]``; ``[L, *S, k]``
        scan-stacked), the top-k of the router's scores.
      num_experts: ``E`` (static).

    :func:`~jvitals.metrics.moe.moe_metrics` counts them over the valid tokens
    (``mask=``): ``c[e] = #{(b, t, j) : mask[b, t] and experts[b, t, j] == e}``.
    """

    experts: jax.Array
    num_experts: int = struct.field(pytree_node=False, default=0)

    def counts(self, mask: jax.Array | None = None) -> jax.Array:
        """``[E]`` float32 selections over the positions where ``mask`` is True
        (``[L, E]`` for scan-stacked choices, with ``mask`` ``[B, T]``)."""
        idx = self.experts
        stacked = mask is not None and idx.ndim == jnp.ndim(mask) + 2
        w = jnp.ones(idx.shape, _F32) if mask is None else jnp.broadcast_to(
            jnp.asarray(mask, _F32).reshape(((1,) if stacked else ()) + tuple(jnp.shape(mask)) + (1,)), idx.shape)
        onehot = jax.nn.one_hot(idx, self.num_experts, dtype=_F32) * w[..., None]
        if stacked:
            return jnp.sum(onehot.reshape(idx.shape[0], -1, self.num_experts), axis=1)
        return jnp.sum(onehot.reshape(-1, self.num_experts), axis=0)


@dataclasses.dataclass
class InstrumentReport:
    """What one :func:`instrument` context sowed, for ``explain`` and errors.

    Attributes:
      sown: ``{NAME: [module path, ...]}`` in call order (the last trace).
      skipped: ``{NAME: reason}`` for names that could not be sown.
    """

    sown: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{name}: {len(paths)} x ({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''})"
                 for name, paths in self.sown.items()]
        lines += [f"{name}: not sown ({why})" for name, why in self.skipped.items()]
        return "\n".join(lines) if lines else "nothing sown"


# ----------------------------------------------------------------------------------
# The interceptor's state (one per context; reset at every outermost apply).


@dataclasses.dataclass
class _Frame:
    module: Any
    path: str          # the logical path: nested applies get their caller's path as prefix
    method: str = "__call__"


class _State:
    def __init__(self, roles: Roles, probes: bool, attn_logits: bool, top_k: int | None,
                 names: frozenset[str] | None, report: InstrumentReport):
        self.roles = roles
        self.probes = probes
        self.attn_logits = attn_logits
        self.top_k = top_k
        self.names = names
        self.report = report
        self.stack: list[_Frame] = []
        self.prefixes: dict[int, str] = {}    # id(root scope) -> logical prefix of that apply
        self.heads: dict[str, int] = {}       # lm_head path -> calls in this apply
        self.kinds: dict[tuple[Any, ...], str | None] = {}
        self.warned: set[str] = set()
        self.nnx_paths: dict[int, str] = {}   # id(NNX module) -> its path from the root call
        self.tokens: tuple[int, ...] | None = None  # the NNX root call's token shape [B, T]

    def want(self, name: str) -> bool:
        return self.names is None or name in self.names

    def begin_apply(self) -> None:
        self.prefixes.clear()
        self.heads.clear()
        self.report.sown.clear()
        self.report.skipped.clear()


def _scope_root(module: Any) -> Any:
    scope = getattr(module, "scope", None)
    while scope is not None and getattr(scope, "parent", None) is not None:
        scope = scope.parent
    return scope


def _logical_path(state: _State, module: Any) -> str:
    own = "/".join(str(p) for p in module.path) if getattr(module, "scope", None) is not None else ""
    root = _scope_root(module)
    if root is not None and id(root) not in state.prefixes:
        if not state.stack:
            state.prefixes[id(root)] = ""  # the outermost apply
        elif not own:
            # The root of a nested apply (``self.lm_head.apply(...)`` with the tied
            # embedding): its caller's path plus its own name.
            name = getattr(module, "name", None)
            state.prefixes[id(root)] = "/".join(p for p in (state.stack[-1].path, name) if p)
        else:
            # A lifted transform's scope (nn.scan, nn.remat...): paths stay absolute.
            top = _scope_root(state.stack[-1].module)
            state.prefixes[id(root)] = state.prefixes.get(id(top), "") if top is not None else ""
    prefix = state.prefixes.get(id(root), "") if root is not None else ""
    return "/".join(p for p in (prefix, own) if p)


def _mutable(module: Any) -> bool:
    try:
        return getattr(module, "scope", None) is not None and module.is_mutable_collection(_COLLECTION)
    except Exception:  # pragma: no cover - unbound modules
        return False


def _sow_target(state: _State, module: Any) -> Any:
    """The module to sow into: ``module`` if its collection is mutable, else the
    nearest caller's (a nested ``apply`` sows into the apply that called it)."""
    if _mutable(module):
        return module
    for frame in reversed(state.stack):
        if _mutable(frame.module):
            return frame.module
    return None


def _direct_params(module: Any) -> list[str]:
    if isinstance(module, nnx.Module):  # its own Params (attributes), not its submodules'
        return [k for k, v in vars(module).items() if isinstance(v, nnx.Param)]
    try:
        params = module.variables.get("params", {})
    except Exception:
        return []
    return [k for k, v in params.items() if not isinstance(v, Mapping)]


def _holds_indexed_layers(roles: Roles, module: Any, path: str) -> bool:
    """Whether the module's parameters hold Python-list layers as children (``0``,
    ``1``... or names a layer pattern ends at): a container of blocks, such as HF's
    ``FlaxLlamaLayerCollection`` at ``model/layers``, not a scan-stacked block."""
    try:
        params = module.variables.get("params", {})
    except Exception:
        return False
    for key, value in params.items():
        if not isinstance(value, Mapping):
            continue
        if str(key).isdigit():
            return True
        child = f"{path}/{key}"
        for rx in roles.layer_patterns:
            if any(m.end(1) == len(child) for m in re.finditer(rx, child, re.IGNORECASE)):
                return True
    return False


def _is_block(roles: Roles, path: str, module: Any = None) -> bool:
    """A transformer block: the module's path ends at a layer index (``h/0``, ``layers_3``),
    or is an ``nn.scan``-stacked subtree itself (``layers``: its body runs once per layer),
    unless its parameters show it is a container of Python-list layers."""
    stack = roles.stack_of(path + "/") if path else None
    if stack is not None and stack[0] == path:
        return module is None or not _holds_indexed_layers(roles, module, path)
    for rx in roles.layer_patterns:
        for m in re.finditer(rx, path, re.IGNORECASE):
            if m.end(1) == len(path):
                return True
    return False


def _kind(state: _State, module: Any, path: str, method: str) -> str | None:
    key = (type(module), path, method)
    if key in state.kinds:
        return state.kinds[key]
    roles = state.roles
    kind = None
    leaves = _direct_params(module)
    found = None
    for leaf in leaves:
        if leaf == "bias":
            continue
        role, _ = roles.role_of(f"{path}/{leaf}" if path else leaf)
        if role is not None:
            found = role
            break
    if method in ("attend", "decode"):
        kind = "logits" if found in ("embedding", "lm_head", None) else None
    elif method == "__call__":
        if found == "lm_head":
            kind = "logits"
        elif found == "o":
            kind = "attn_out_before_proj"
        elif found == "attn_gate":
            kind = "gate_scores"
        elif found == "router":
            kind = "expert_counts"
        elif found is None and _is_block(roles, path, module):
            kind = "hidden_states"
    state.kinds[key] = kind
    return kind


def _hidden_state(out: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """A block's output hidden state: the output if it is an array; of a tuple (tunix's
    ``(cache, x)``), the element shaped like the block's input, else the first array."""
    if isinstance(out, (tuple, list)):
        x = _first_input(args, kwargs)
        for o in out:
            if hasattr(o, "shape") and x is not None and tuple(o.shape) == tuple(x.shape):
                return o
        return next((o for o in out if hasattr(o, "shape")), None)
    return _first_array(out)


def _first_array(out: Any) -> Any:
    """The main output of a module call: an array, the first of a tuple/list, or the
    first value of a mapping (HF ``ModelOutput``)."""
    seen = 0
    while not hasattr(out, "shape") and seen < 4:
        seen += 1
        if isinstance(out, Mapping):
            vals = [v for v in out.values() if v is not None]
            out = vals[0] if vals else None
        elif isinstance(out, (tuple, list)):
            out = out[0] if out else None
        else:
            return None
    return out if hasattr(out, "shape") else None


def _first_input(args: tuple, kwargs: Mapping[str, Any]) -> Any:
    if args and hasattr(args[0], "shape"):
        return args[0]
    for k in ("inputs", "x", "hidden_states", "input"):
        if k in kwargs and hasattr(kwargs[k], "shape"):
            return kwargs[k]
    for v in kwargs.values():
        if hasattr(v, "shape"):
            return v
    return None


def _token_summary(state: _State, x: jax.Array) -> Any:
    x = lax.stop_gradient(x)
    if not state.probes:
        return x
    t = state.tokens  # NNX: the root call's [B, T]; per-head [B, T, H, Dh] values keep it
    nd = len(t) if t is not None and tuple(x.shape[:len(t)]) == t and x.ndim > len(t) else max(x.ndim - 1, 1)
    with fold.cpu_plain():   # the CPU's fastest form (fold.cpu_plain)
        return summarize_tokens(x, token_ndim=nd)


def _find_top_k(state: _State, module: Any) -> int | None:
    if state.top_k is not None:
        return state.top_k
    names = ("num_experts_per_tok", "top_k", "moe_top_k", "num_selected_experts", "experts_per_token",
             "num_experts_per_token", "experts_per_tok")
    chain, m = [], module
    for _ in range(4):            # Linen: the router and its parents
        if m is None:
            break
        chain.append(m)
        m = getattr(m, "parent", None)
    chain += [f.module for f in reversed(state.stack)]   # NNX (no parents): the calling modules
    for m in chain:
        for holder in (m, getattr(m, "config", None), getattr(m, "cfg", None)):
            for n in names:
                v = getattr(holder, n, None) if holder is not None else None
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return None


def _warn_once(state: _State, key: str, msg: str) -> None:
    if key not in state.warned:
        state.warned.add(key)
        warnings.warn(msg, stacklevel=4)


def _sow(state: _State, module: Any, path: str, name: str, value: Any) -> None:
    if isinstance(module, nnx.Module):
        _sow_nnx(state, module, path, name, value)
        return
    target = _sow_target(state, module)
    if target is None:
        state.report.skipped.setdefault(
            name, "the 'intermediates' collection is not mutable: pass mutable=['intermediates'] to apply")
        return
    target.sow(_COLLECTION, name, value)
    state.report.sown.setdefault(name, []).append(path)


def _handle(state: _State, kind: str, module: Any, path: str, args: tuple, kwargs: Mapping, out: Any) -> None:
    if kind == "hidden_states":
        h = _hidden_state(out, args, kwargs)
        if h is not None and h.ndim >= 2 and state.want(kind):
            _sow(state, module, path, kind, _token_summary(state, h))
    elif kind == "attn_out_before_proj":
        x = _first_input(args, kwargs)
        if x is not None and x.ndim >= 2 and state.want(kind):
            _sow(state, module, path, kind, _token_summary(state, x))
    elif kind == "gate_scores":
        g = _first_array(out)
        if g is not None and state.want(kind):
            _sow(state, module, path, kind, _token_summary(state, jax.nn.sigmoid(g.astype(_F32))))
    elif kind == "logits":
        z = _first_array(out)
        if z is None or z.ndim < 2:
            return
        calls = state.heads.get(path, 0)
        state.heads[path] = calls + 1
        name = "logits" if sum(state.heads.values()) == 1 else "mtp_logits"
        if state.want(name):
            _sow(state, module, path, name, logits_rows(z))
    elif kind == "expert_counts":
        z = _first_array(out)
        if z is None or not state.want(kind):
            return
        k = _find_top_k(state, module)
        if k is None:
            _warn_once(state, "top_k", (
                f"instrument(): a router was recognised at {path!r} but its top-k is unknown, so no "
                f"'expert_counts' are sown; pass instrument(top_k=K) (experts selected per token)."))
            state.report.skipped[kind] = f"router at {path!r}: top_k unknown, pass instrument(top_k=K)"
            return
        _, idx = lax.top_k(lax.stop_gradient(z.astype(_F32)), k)
        _sow(state, module, path, kind, ExpertChoices(experts=idx.astype(jnp.int32), num_experts=int(z.shape[-1])))


def _interceptor(state: _State) -> Callable[..., Any]:
    def intercept(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        if ctx.method_name not in ("__call__", "attend"):
            return next_fun(*args, **kwargs)
        module = ctx.module
        if not state.stack:
            state.begin_apply()
        return _call_and_sow(state, _Frame(module, _logical_path(state, module), ctx.method_name),
                             next_fun, args, kwargs)

    return intercept


def _call_and_sow(state: _State, frame: _Frame, next_fun: Callable[..., Any], args: tuple,
                  kwargs: dict) -> Any:
    """Run the call with its frame on the stack, then sow what its module's kind asks for
    (and, after the outermost call, warn if nothing was sown)."""
    state.stack.append(frame)
    try:
        out = next_fun(*args, **kwargs)
    finally:
        state.stack.pop()
    kind = _kind(state, frame.module, frame.path, frame.method)
    if kind is not None:
        _handle(state, kind, frame.module, frame.path, args, kwargs, out)
    if not state.stack:
        _check_sown(state)
    return out


# ----------------------------------------------------------------------------------
# Flax NNX: the same recognition over module paths from the outermost call.


def _sow_nnx(state: _State, module: Any, path: str, name: str, value: Any) -> None:
    """Sow into ``nnx.Intermediate`` on the module: through ``nnx.capture`` when one is
    open (its returned State holds it), else as an ``nnx.Intermediate`` attribute of the
    module (a tuple, one entry per call), which ``nnx.pop(model, nnx.Intermediate)``
    takes; Flax's own ``Module.sow`` did so before ``nnx.capture``."""
    if hasattr(module, "__captures__"):
        if module.sow(nnx.Intermediate, name, value):
            state.report.sown.setdefault(name, []).append(path)
        else:
            state.report.skipped.setdefault(
                name, "nnx.capture is open without nnx.Intermediate: capture it, "
                      "nnx.capture(fn, nnx.Intermediate)")
        return
    held = vars(module).get(name)
    if held is None:
        setattr(module, name, nnx.Intermediate((value,)))
    elif isinstance(held, nnx.Intermediate):
        held.set_value(tuple(held.get_value()) + (value,))
    else:
        state.report.skipped.setdefault(
            name, f"the module at {path!r} already has an attribute {name!r} that is not an nnx.Intermediate")
        return
    state.report.sown.setdefault(name, []).append(path)


def _nnx_root(state: _State, module: Any, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """At the outermost NNX call: every submodule's path from it, and the token shape
    (its first integer array argument: ``tokens [B, T]``)."""
    state.begin_apply()
    state.nnx_paths = {}
    for p, m in nnx.iter_modules(module):
        state.nnx_paths.setdefault(id(m), "/".join(str(k) for k in p))
    x = _first_input(args, kwargs)
    state.tokens = tuple(x.shape) if x is not None and jnp.issubdtype(x.dtype, jnp.integer) else None


def _nnx_interceptor(state: _State) -> Callable[..., Any]:
    def intercept(next_fun: Callable[..., Any], args: tuple, kwargs: dict, ctx: Any) -> Any:
        module, method = ctx.module, ctx.method_name
        top = state.stack[-1] if state.stack else None
        if top is not None and top.module is module and top.method == method:
            return next_fun(*args, **kwargs)  # a subclass's method calling super()'s
        if top is None:
            _nnx_root(state, module, args, kwargs)
        path = state.nnx_paths.get(id(module))
        if path is None:  # not under the outermost call's module (built during the call)
            return next_fun(*args, **kwargs)
        return _call_and_sow(state, _Frame(module, path, method), next_fun, args, kwargs)

    return intercept


def _check_sown(state: _State) -> None:
    if state.report.sown:
        return
    why = state.report.skipped.get("hidden_states") or next(iter(state.report.skipped.values()), None)
    _warn_once(state, "nothing", (
        "instrument(): nothing was sown in this apply: "
        + (why if why else "no module matched the roles' patterns (no transformer block whose path ends in "
           "a layer index such as 'h/0' or 'layers_3', no output projection, no lm_head)")
        + ". Check vitals.explain_roles(params) and extend the patterns: "
          "instrument(Roles().extend(o=r'(^|/)my_out_proj/kernel$'), ...) or "
          "Roles(layer_patterns=(r'(?:^|/)blocks_(\\d+)(?:/|$)',))."))


# ----------------------------------------------------------------------------------
# Attention logits: flax's dot_product_attention_weights (Linen's and NNX's) and
# jax.nn.dot_product_attention (NNX's MultiHeadAttention without dropout), wherever imported.


def _scores(query: Any, key: Any, bias: Any, mask: Any, scale: float | None = None) -> tuple[Any, Any]:
    """``(s, valid)``, both ``[..., H, Tq, Tk]``: the pre-softmax scores of ``[..., T, H, D]``
    queries and keys (K/V heads repeated for grouped queries) and where they count."""
    q = lax.stop_gradient(query).astype(_F32)
    k = lax.stop_gradient(key).astype(_F32)
    if k.shape[-2] != q.shape[-2]:
        k = jnp.repeat(k, q.shape[-2] // k.shape[-2], axis=-2)
    sc = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])) if scale is None else jnp.float32(scale)
    s = jnp.einsum("...qhd,...khd->...hqk", q * sc, k)
    valid = jnp.ones((), bool)
    if bias is not None:
        b = lax.stop_gradient(jnp.asarray(bias)).astype(_F32)
        s = s + b
        valid = valid & bias_keeps(bias)
    if mask is not None:
        valid = valid & jnp.asarray(mask, bool)
    return s, jnp.broadcast_to(valid, s.shape)


def _sow_scores(state: _State, s: Any, valid: Any) -> None:
    """Sows ``attn_logits`` for the module being called: per query position, the max over
    heads and valid keys of ``[..., H, Tq, Tk]`` scores."""
    frame = state.stack[-1]
    s = jnp.moveaxis(s, -2, -3)            # [..., Tq, H, Tk]
    valid = jnp.moveaxis(valid, -2, -3)
    with fold.cpu_plain():
        summary = summarize_tokens(s, valid, token_ndim=s.ndim - 2, max_only=True)
    _sow(state, frame.module, frame.path, "attn_logits", summary)


@contextlib.contextmanager
def _softmax_inputs() -> Iterator[list[Any]]:
    """``jax.nn.softmax`` recording its inputs (over the last axis, no ``where``) while open."""
    real = jax.nn.softmax
    seen: list[Any] = []

    def softmax(x, axis=-1, where=None, *args, **kw):
        if where is None and not args and not kw and axis in (-1, jnp.ndim(x) - 1):
            seen.append(x)
        return real(x, axis, where, *args, **kw)

    jax.nn.softmax = softmax
    try:
        yield seen
    finally:
        jax.nn.softmax = real


def _attn_wrapper(state: _State, orig: Callable[..., Any]) -> Callable[..., Any]:
    """flax's ``dot_product_attention_weights`` (Linen's, NNX's), run as it is: the summary is
    taken from the input it hands ``jax.nn.softmax`` (its masked scores), beside the softmax's
    own row maximum (:func:`~jvitals.metrics.xla_attention.softmax_input_summary`); where that
    input is not seen as expected, from ``q.k`` recomputed."""
    def dot_product_attention_weights(query, key, bias=None, mask=None, *args, **kwargs):
        if not (state.stack and state.want("attn_logits")):
            return orig(query, key, bias, mask, *args, **kwargs)
        with _softmax_inputs() as seen:
            out = orig(query, key, bias, mask, *args, **kwargs)
        shape = tuple(jnp.shape(out))
        if len(seen) == 1 and tuple(jnp.shape(seen[0])) == shape and len(shape) >= 3:
            ok = jnp.ones((), bool) if bias is None else bias_keeps(bias)
            if mask is not None:
                ok = ok & jnp.asarray(mask, bool)
            frame = state.stack[-1]
            _sow(state, frame.module, frame.path, "attn_logits", softmax_input_summary(seen[0], ok))
        else:
            _sow_scores(state, *_scores(query, key, bias, mask))
        return out

    dot_product_attention_weights.__wrapped__ = orig  # type: ignore[attr-defined]
    return dot_product_attention_weights


_XLA_KEYWORDS = frozenset({"scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths",
                           "local_window_size", "implementation", "return_residual"})


def _jax_attn_wrapper(state: _State, orig: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.nn.dot_product_attention``'s scores: ``scale``, ``is_causal``, the sequence
    lengths and ``local_window_size`` as it applies them (``[B, T, N, H]`` or ``[T, N, H]``).

    Its XLA implementation (``implementation=None`` or ``"xla"``) is run as
    :func:`~jvitals.metrics.xla_attention.attention_with_summary`, the same computation with
    the summary from the softmax's own row reductions (no second read of the scores); any
    other (cuDNN, the residual) runs as it is, the scores recomputed beside it."""
    def dot_product_attention(query, key, value, bias=None, mask=None, *args, **kw):
        if not (state.stack and state.want("attn_logits")) or args:
            return orig(query, key, value, bias, mask, *args, **kw)
        pairs = {n: kw[n] for n in ("is_causal", "local_window_size", "query_seq_lengths",
                                    "key_value_seq_lengths") if kw.get(n) is not None}
        if (not kw.get("return_residual") and kw.get("implementation") in (None, "xla")
                and set(kw) <= _XLA_KEYWORDS):
            # jax's own argument checks first (shapes only), so a mistake reads as jax words it.
            jax.eval_shape(lambda *a: orig(*a, **kw), query, key, value, bias, mask)
            out, summary = attention_with_summary(query, key, value, bias, mask, scale=kw.get("scale"), **pairs)
            frame = state.stack[-1]
            _sow(state, frame.module, frame.path, "attn_logits", summary)
            return out
        s, valid = _scores(query, key, bias, mask, kw.get("scale"))
        ok = valid_pairs(s.shape[-2], s.shape[-1], **pairs)
        _sow_scores(state, s, valid & ok.reshape(ok.shape[4 - s.ndim:]))   # [T, N, H] inputs: [N, T, S]
        return orig(query, key, value, bias, mask, *args, **kw)

    dot_product_attention.__wrapped__ = orig  # type: ignore[attr-defined]
    return dot_product_attention


@contextlib.contextmanager
def _patched_attention(state: _State) -> Iterator[list[str]]:
    """Replace flax's ``dot_product_attention_weights`` (Linen's and NNX's) and
    ``jax.nn.dot_product_attention`` in every loaded module that holds them
    (``flax.linen.attention``, ``flax.nnx.nn.attention``, ``jax.nn``, HF-Flax's modeling
    modules, a user's ``from jax.nn import dot_product_attention``)."""
    import flax.linen.attention as fla
    import flax.nnx.nn.attention as nxa

    swaps = {fla.dot_product_attention_weights: _attn_wrapper(state, fla.dot_product_attention_weights),
             nxa.dot_product_attention_weights: _attn_wrapper(state, nxa.dot_product_attention_weights),
             jax.nn.dot_product_attention: _jax_attn_wrapper(state, jax.nn.dot_product_attention)}
    names = ("dot_product_attention_weights", "dot_product_attention")
    patched: list[tuple[Any, str, Any]] = []
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if d is None:
            continue
        try:
            for n in names:
                orig = d.get(n)
                if orig is not None and any(orig is o for o in swaps):
                    d[n] = swaps[orig]
                    patched.append((mod, n, orig))
        except Exception:  # pragma: no cover - exotic module objects
            continue
    try:
        yield [m.__name__ for m, _, _ in patched]
    finally:
        for mod, n, orig in patched:
            mod.__dict__[n] = orig


@contextlib.contextmanager
def instrument(roles: Roles | None = None, *, probes: bool = True, attn_logits: bool = False,
               top_k: int | None = None, names: Any = None) -> Iterator[InstrumentReport]:
    """Sow jvitals' summaries from every Flax Linen ``apply`` and NNX model call inside the context.

    See the module docstring for what is sown and how modules are recognised.

    Args:
      roles: the :class:`~jvitals.metrics.roles.Roles` (default patterns if None; use
        ``Roles().extend(...)`` to add your own -- the same object the gradient
        metrics take).
      probes: sow per-token summaries (default). ``False`` sows the raw
        ``hidden_states`` / ``attn_out_before_proj`` / ``gate_scores`` tensors
        (for debugging; the logits are always summarised, never sown whole).
      attn_logits: also sow ``attn_logits``: wraps flax's
        ``dot_product_attention_weights`` (Linen's, used by ``nn.MultiHeadDotProductAttention``
        and HF-Flax GPT-2, GPT-J, GPT-Neo, Llama, Mistral, Gemma, Bloom, OPT...; NNX's)
        and ``jax.nn.dot_product_attention`` (``nnx.MultiHeadAttention`` without dropout,
        with its causal flag, sequence lengths and local window) while the context is open.
        ``jax.nn.dot_product_attention``'s XLA implementation is run as
        :func:`~jvitals.metrics.xla_attention.attention_with_summary` (the same computation,
        the summary from its softmax's own row reductions); flax's weights function runs as it
        is, the summary from the masked scores it hands ``jax.nn.softmax``
        (:func:`~jvitals.metrics.xla_attention.softmax_input_summary`); cuDNN attention runs
        as it is, ``q.k`` recomputed beside it and reduced once per layer.
        The functions are swapped in the modules' globals while the context is open (trace
        time only; do not trace in several threads at once).
      top_k: experts per token, for ``expert_counts`` (default: the router's or
        its parents' ``num_experts_per_tok`` / ``top_k`` attribute or config).
      names: only these NAMEs (default: all).

    Yields:
      An :class:`InstrumentReport` of what the last traced ``apply`` sowed.

    Raises:
      RuntimeError: entered inside another ``instrument()``. TypeError/ValueError: bad arguments.

    Example:
      >>> with instrument() as report:
      ...     logits, state = model.module.apply({"params": p}, ids, am, mutable=["intermediates"])
      >>> m = activation_metrics(state["intermediates"], mask=am.astype(bool))
      >>> with instrument():                                   # Flax NNX, e.g. inside nnx.jit
      ...     logits, sown = nnx.capture(lambda m: m(ids, am), nnx.Intermediate)(model)
      >>> m = activation_metrics(sown, mask=am.astype(bool))
    """
    roles = check_roles(roles, "instrument")
    names = None if names is None else check_names(names, "instrument", "names")
    if top_k is not None:
        check_number(top_k, "instrument", "top_k", low=1, integer=True, fix="experts per token, e.g. top_k=2")
    report = InstrumentReport()
    state = _State(roles, probes, attn_logits, top_k, None if names is None else frozenset(names), report)
    with contextlib.ExitStack() as stack:
        stack.enter_context(not_nested("instrument()", "every module would be sown twice (a 2-layer model "
                                       "would report 4 layers); open it once, around the apply"))
        if attn_logits:
            stack.enter_context(_patched_attention(state))
        stack.enter_context(nn.intercept_methods(_interceptor(state)))
        stack.enter_context(intercept_nnx(_nnx_interceptor(state), _NNX_METHODS))
        yield report
