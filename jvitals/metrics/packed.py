"""A flat ``{name: scalar}`` dict that is one vector as a pytree: :class:`PackedMetrics`.

The optax recorder keeps ~100 figures in its state. As a plain dict each is a
pytree leaf, i.e. a buffer XLA copies in and out of every jitted step (its cost on
the CPU: docs/COST.md); packed, they are one.

The figures come in families computed at different cadences (the recorder's
``"light"`` figures every update, its ``"heavy"`` figures every 50). A figure
not computed at the latest update still holds its last value in the vector, but
the dict shows only the *fresh* ones: the vector ends with one flag per family
(1.0: computed at the latest update), so what reaches a writer, the monitor or
the report after ``jax.device_get`` is only what was computed at that update,
with no extra transfer.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PackedMetrics"]


class PackedMetrics(dict):
    """A read-only ``{name: float32 scalar}`` dict backed by one float32 vector.

    It reads like the flat dict it is (``m["grad/global_norm"]``, ``items()``,
    ``dict(m)``, ``{**m}``, ``optax.tree.get(state, name)``), but as a pytree it is
    a single leaf, the vector: the ~100 figures of a recorder cross the jitted
    step as one buffer instead of ~100 (on XLA:CPU each costs a copy in and out of
    the step; docs/COST.md). The entries are
    views made on first read: slices inside ``jit``; outside it, one jitted
    unstack (NumPy scalars after ``jax.device_get``). Read it on the host at the
    logging cadence, ``jax.device_get(vitals.recorded(state.opt_state))``, rather
    than returning ``recorded(...)`` from the step, which makes each figure a
    buffer again.

    **Freshness.** With ``families``, each figure belongs to a family and the
    vector ends with one flag per family (in :attr:`flags` order): 1.0 if the
    family was computed at the latest update, else 0.0. Then the dict holds only
    the fresh figures: iterating, ``len``, ``in``, ``items()``, ``dict(m)``,
    ``{**m}``, ``m[name]`` and ``m.get(name)`` see those alone (a stale name
    raises a ``KeyError`` that says so), whatever reads it: ``vitals.write``, the
    monitor, ``optax.tree.get``. :meth:`latest` gives every figure's last value,
    fresh or not; :attr:`fresh` the flags. Inside ``jit`` (traced values) and for
    abstract or spec leaves, freshness cannot be read: every name is shown. For
    a vector on the device, the flags are read with the figures (one small
    device-to-host copy, at the host's logging cadence).

    Attributes:
      names: the figure names, in the vector's order.
      vector: ``float32[len(names) + len(flags)]`` (or whatever leaf a
        ``jax.tree.map`` put there: a ``ShapeDtypeStruct``, a ``PartitionSpec``).
      families: each name's family label (None: no flags, every figure fresh).
      flags: the family labels of the trailing flags, in order (``()`` without
        ``families``).
    """

    __slots__ = ("names", "vector", "families", "flags", "_filled", "_all", "_fresh")

    def __init__(self, names: Sequence[str], vector: Any, families: Sequence[str] | None = None):
        super().__init__()
        self.names = tuple(names)
        self.vector = vector
        self.families = None if families is None else tuple(families)
        if self.families is not None and len(self.families) != len(self.names):
            raise ValueError(f"PackedMetrics: {len(self.families)} families for {len(self.names)} names; "
                             "give one family label per name")
        self.flags = () if self.families is None else tuple(dict.fromkeys(self.families))
        self._filled = False
        self._all: dict[str, Any] = {}
        self._fresh: dict[str, bool] | None = None

    # -- building -----------------------------------------------------------------

    @staticmethod
    def flag_vector(flags: Sequence[str], fresh: Mapping[str, Any]) -> jax.Array:
        """The trailing flags for ``flags`` (labels) from ``{label: bool}`` (traced or not)."""
        return jnp.stack([jnp.asarray(fresh[f]).astype(jnp.float32).reshape(()) for f in flags]) \
            if flags else jnp.zeros([0], jnp.float32)

    @classmethod
    def merge(cls, parts: Iterable["PackedMetrics"]) -> "PackedMetrics":
        """One :class:`PackedMetrics` holding every part's figures and flags (one concatenation).

        Family labels of the second part on are suffixed ``#k`` (k: the part's
        index) so each part keeps its own flags; a part without families gets a
        flag that is always 1.
        """
        parts = list(parts)
        if len(parts) == 1:
            return parts[0]
        names: list[str] = []
        families: list[str] = []
        figs, flags = [], []
        for k, p in enumerate(parts):
            n = len(p.names)
            names += p.names
            suffix = "" if k == 0 else f"#{k}"
            if p.families is None:
                families += [f"always{suffix}"] * n
                figs.append(p.vector[:n])
                flags.append(np.ones([1], np.float32) if n else np.zeros([0], np.float32))
            else:
                families += [f + suffix for f in p.families]
                figs.append(p.vector[:n])
                flags.append(p.vector[n:])
        numpy = all(isinstance(v, np.ndarray) for v in figs + flags)
        cat = np.concatenate if numpy else jnp.concatenate
        return cls(names, cat(figs + flags), families)

    # -- reading ------------------------------------------------------------------

    def _fill(self) -> None:
        if self._filled:
            return
        v, n = self.vector, len(self.names)
        fresh_flags: np.ndarray | None = None
        if isinstance(v, jax.core.Tracer):
            items = [v[i] for i in range(n)]
        elif isinstance(v, jax.Array):
            every = list(_unstack(v)) if v.shape[0] else []
            items = every[:n]
            if self.flags:
                fresh_flags = np.asarray(jax.device_get(every[n:]), np.float32)
        elif isinstance(v, np.ndarray):  # after jax.device_get
            items = [v[i] for i in range(n)]
            if self.flags:
                fresh_flags = np.asarray(v[n:], np.float32)
        elif isinstance(v, jax.ShapeDtypeStruct):
            items = [jax.ShapeDtypeStruct((), v.dtype)] * n
        else:  # a spec or placeholder leaf: the same for every entry
            items = [v] * n
        self._all = dict(zip(self.names, items))
        if fresh_flags is not None:
            self._fresh = {f: bool(x > 0.5) for f, x in zip(self.flags, fresh_flags)}
            shown = {k: x for k, x, fam in zip(self.names, items, self.families) if self._fresh[fam]}
        else:
            shown = self._all
        dict.update(self, shown)
        self._filled = True

    @property
    def fresh(self) -> dict[str, bool] | None:
        """``{family: computed at the latest update}``; None where it cannot be read (traced)."""
        self._fill()
        return None if self._fresh is None else dict(self._fresh)

    def family(self, name: str) -> str | None:
        """The family of ``name`` (None without families)."""
        if name not in self.names:
            raise KeyError(name)
        return None if self.families is None else self.families[self.names.index(name)]

    def latest(self) -> dict[str, Any]:
        """Every figure's last computed value, fresh or not (NaN if never computed)."""
        self._fill()
        return dict(self._all)

    def __getitem__(self, key: str) -> Any:
        self._fill()
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        if key in self._all:
            fam = self.family(key)
            raise KeyError(
                f"{key!r} was not computed at the latest update (its family {fam!r} was not due); "
                f"PackedMetrics shows only fresh figures. Its last value is in .latest()[{key!r}], and "
                "vitals.recorded_steps(opt_state) says when each family last ran.")
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        self._fill()
        return dict.__contains__(self, key)

    def __iter__(self):
        self._fill()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._fill()
        return dict.__len__(self)

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
        self._fill()
        return dict.get(self, key, default)

    def copy(self) -> dict[str, Any]:  # noqa: D102
        self._fill()
        return dict(dict.items(self))

    def __or__(self, other: Any) -> dict[str, Any]:
        return self.copy() | dict(other)

    def __ror__(self, other: Any) -> dict[str, Any]:
        return dict(other) | self.copy()

    def __eq__(self, other: object) -> bool:
        self._fill()
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedMetrics({len(self.names)} figures: {', '.join(self.names[:3])}{', ...' if len(self.names) > 3 else ''})"

    def __reduce__(self):
        return (PackedMetrics, (self.names, self.vector, self.families))


@jax.jit
def _unstack(v: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(v[i] for i in range(v.shape[0]))


jax.tree_util.register_pytree_with_keys(
    PackedMetrics,
    lambda m: (((jax.tree_util.GetAttrKey("vector"), m.vector),), (m.names, m.families)),
    lambda aux, children: PackedMetrics(aux[0], children[0], aux[1]),
    flatten_func=lambda m: ((m.vector,), (m.names, m.families)),
)
