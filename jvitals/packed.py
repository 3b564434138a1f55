"""A flat ``{name: scalar}`` dict that is one vector as a pytree: :class:`PackedMetrics`.

The optax recorder keeps ~100 figures in its state. As a plain dict each is a
pytree leaf, i.e. a buffer XLA copies in and out of every jitted step (1-2 us
each on the CPU); packed, they are one.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["PackedMetrics"]


class PackedMetrics(dict):
    """A read-only ``{name: float32 scalar}`` dict backed by one float32 vector.

    It reads like the flat dict it is (``m["grad/global_norm"]``, ``items()``,
    ``optax.tree.get(state, name)``), but as a pytree it is a single leaf, the
    vector: the ~100 figures of a recorder cross the jitted step as one buffer
    instead of ~100 (on XLA:CPU each costs a copy in and out of the step, 1-2
    us, which is several percent of a 10 ms step). The entries are views made
    on first read: slices inside ``jit``; outside it, one jitted unstack (NumPy
    scalars after ``jax.device_get``). Read it on the host at the logging
    cadence, ``vitals.recorded(state.opt_state)``, rather than returning
    ``recorded(...)`` from the step, which makes each figure a buffer again.

    Attributes:
      names: the figure names, in the vector's order.
      vector: ``float32[len(names)]`` (or whatever leaf a ``jax.tree.map`` put
        there: a ``ShapeDtypeStruct``, a ``PartitionSpec``).
    """

    __slots__ = ("names", "vector", "_filled")

    def __init__(self, names: Sequence[str], vector: Any):
        super().__init__()
        self.names = tuple(names)
        self.vector = vector
        self._filled = False

    def _fill(self) -> None:
        if self._filled:
            return
        v, n = self.vector, len(self.names)
        if isinstance(v, jax.core.Tracer):
            items = [v[i] for i in range(n)]
        elif isinstance(v, jax.Array):
            items = list(_unstack(v)) if n else []
        elif isinstance(v, np.ndarray):  # after jax.device_get
            items = [v[i] for i in range(n)]
        elif isinstance(v, jax.ShapeDtypeStruct):
            items = [jax.ShapeDtypeStruct((), v.dtype)] * n
        else:  # a spec or placeholder leaf: the same for every entry
            items = [v] * n
        dict.update(self, zip(self.names, items))
        self._filled = True

    def __getitem__(self, key: str) -> Any:
        self._fill()
        return dict.__getitem__(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def keys(self):  # noqa: D102
        self._fill()
        return dict.keys(self)

    def values(self):  # noqa: D102
        self._fill()
        return dict.values(self)

    def items(self):  # noqa: D102
        self._fill()
        return dict.items(self)

    def get(self, key: str, default: Any = None) -> Any:  # noqa: D102
        return self[key] if key in self.names else default

    def __eq__(self, other: object) -> bool:
        self._fill()
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedMetrics({len(self.names)} figures: {', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''})"

    def __reduce__(self):
        return (PackedMetrics, (self.names, self.vector))


@jax.jit
def _unstack(v: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(v[i] for i in range(v.shape[0]))


jax.tree_util.register_pytree_with_keys(
    PackedMetrics,
    lambda m: (((jax.tree_util.GetAttrKey("vector"), m.vector),), m.names),
    lambda names, children: PackedMetrics(names, children[0]),
    flatten_func=lambda m: ((m.vector,), m.names),
)
