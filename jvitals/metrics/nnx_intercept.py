"""Method interception for Flax NNX modules: what ``flax.linen.intercept_methods`` is to Linen.

Flax NNX has no hook around a module's methods. :func:`intercept_methods` wraps the
named methods of every ``nnx.Module`` subclass defined when the context opens, at the
class level, for as long as the context is open, and puts them back on exit (Flax's
own ``nnx.capture(..., method_outputs=...)`` wraps classes the same way). Every call
of such a method, eager or while ``nnx.jit`` / ``nnx.grad`` trace it, then goes
through ``interceptor(next_fun, args, kwargs, context)`` as in Linen, with
``context.module`` the instance and ``context.method_name`` the method.

Not thread-safe (the classes are shared): do not trace in several threads while the
context is open. Classes defined inside the context are not wrapped.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from flax import nnx

__all__ = ["InterceptContext", "intercept_methods"]

_MARK = "_jvitals_intercepted"


class InterceptContext(NamedTuple):
    """What an interceptor learns about a call.

    Attributes:
      module: the ``nnx.Module`` instance whose method is called.
      method_name: the method's name (``"__call__"``, ``"attend"``...).
    """

    module: Any
    method_name: str


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls`` (recursively), each once, in a stable order."""
    seen: dict[type, None] = {}
    todo = list(cls.__subclasses__())
    while todo:
        c = todo.pop(0)
        if c not in seen:
            seen[c] = None
            todo.extend(c.__subclasses__())
    return list(seen)


def _wrap(fn: Callable[..., Any], name: str, interceptor: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return interceptor(functools.partial(fn, self), args, kwargs, InterceptContext(self, name))

    setattr(method, _MARK, True)
    return method


@contextlib.contextmanager
def intercept_methods(interceptor: Callable[..., Any],
                      methods: Sequence[str] = ("__call__",)) -> Iterator[None]:
    """Route every call of ``methods`` on NNX modules through ``interceptor``.

    Args:
      interceptor: ``interceptor(next_fun, args, kwargs, context) -> output``;
        ``next_fun(*args, **kwargs)`` runs the method (bound to the module).
      methods: the method names to intercept (a class's own definitions only: an
        inherited method is intercepted where it is defined).

    Yields:
      None; on exit every wrapped method is restored.
    """
    patched: list[tuple[type, str, Any]] = []
    try:
        for cls in [nnx.Module] + _subclasses(nnx.Module):
            for name in methods:
                fn = cls.__dict__.get(name)
                if inspect.isfunction(fn) and not getattr(fn, _MARK, False):
                    patched.append((cls, name, fn))
                    setattr(cls, name, _wrap(fn, name, interceptor))
        yield
    finally:
        for cls, name, fn in reversed(patched):
            setattr(cls, name, fn)
