"""Where each replica lives: its devices, their processes and host names.

:func:`replica_layout` maps entry ``r`` of every ``replica/*`` vector
(:func:`jvitals.metrics.replicas.replica_metrics`) to its devices, their process
index and their host name, gathered once at start-up, so that every message can
name the host a bad replica runs on (``docs/REPLICAS.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import socket
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np

__all__ = ["ReplicaLayout", "ReplicaPlace", "process_hostnames", "replica_layout"]


@dataclasses.dataclass(frozen=True)
class ReplicaPlace:
    """Where one replica lives.

    Attributes:
      replica: its index ``r`` (entry ``r`` of every ``replica/*`` vector).
      devices: the ids of its devices (``jax.Device.id``).
      device_names: ``str(device)`` of each (``TFRT_CPU_3``, ``cuda:5``, ``TPU_12(...)``).
      processes: the process index of each device (``jax.Device.process_index``).
      hosts: the host name of each device's process.
    """

    replica: int
    devices: tuple[int, ...]
    device_names: tuple[str, ...]
    processes: tuple[int, ...]
    hosts: tuple[str, ...]

    def describe(self) -> str:
        """``'replica 3 (device 3 TFRT_CPU_3, process 0, host worker-0)'``."""
        devs = ", ".join(f"{i} {n}" for i, n in zip(self.devices[:4], self.device_names[:4]))
        more = f" +{len(self.devices) - 4} more" if len(self.devices) > 4 else ""
        procs = sorted(set(self.processes))
        hosts = sorted(set(self.hosts))
        return (f"replica {self.replica} (device{'s' if len(self.devices) > 1 else ''} {devs}{more}, "
                f"process{'es' if len(procs) > 1 else ''} {', '.join(map(str, procs))}, "
                f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})")

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON (the monitor's one serialisation convention)."""
        return {"replica": self.replica, "devices": list(self.devices),
                "device_names": list(self.device_names), "processes": list(self.processes),
                "hosts": list(self.hosts)}


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Replica -> devices -> process -> host, for every replica (see :func:`replica_layout`).

    Attributes:
      axes: the mesh axes the batch is sharded along (replica ``r`` is the flat index
        over them, the first axis major, as ``lax.axis_index(axes)`` counts).
      places: one :class:`ReplicaPlace` per replica.
    """

    axes: tuple[str, ...]
    places: tuple[ReplicaPlace, ...]

    @property
    def size(self) -> int:
        """The number of replicas ``R``."""
        return len(self.places)

    def __len__(self) -> int:
        return len(self.places)

    def __getitem__(self, r: int) -> ReplicaPlace:
        return self.places[r]

    def describe(self, r: int) -> str:
        """The sentence naming replica ``r`` (see :meth:`ReplicaPlace.describe`)."""
        return self.places[r].describe()

    def replica_of(self, device_id: int) -> int:
        """The replica holding the device of this id (ValueError if none)."""
        for p in self.places:
            if device_id in p.devices:
                return p.replica
        raise ValueError(f"no replica holds device {device_id}")

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: what the monitor's rule and the report read."""
        return {"axes": list(self.axes), "replicas": [p.state_dict() for p in self.places]}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "ReplicaLayout":
        """The layout :meth:`state_dict` wrote."""
        return cls(tuple(d["axes"]), tuple(
            ReplicaPlace(int(p["replica"]), tuple(p["devices"]), tuple(p["device_names"]),
                         tuple(p["processes"]), tuple(p["hosts"])) for p in d["replicas"]))


@functools.lru_cache(maxsize=1)
def process_hostnames() -> tuple[str, ...]:
    """Every process's host name, in process order (a collective: all processes call it).

    One ``jax.experimental.multihost_utils.process_allgather`` of the UTF-8 name as
    int32 codes (256 at most), once per process (cached): the public, backend-neutral
    way JAX exchanges host values (gloo on CPU, NCCL/ICI elsewhere); the distributed
    key-value store would do too, but JAX reaches it only through private modules.
    """
    name = socket.gethostname()
    if jax.process_count() == 1:
        return (name,)
    from jax.experimental import multihost_utils

    codes = np.zeros(256, np.int32)
    raw = np.frombuffer(name.encode()[:256], np.uint8)
    codes[:raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(codes)).reshape(jax.process_count(), -1)
    return tuple(bytes(r[r > 0].astype(np.uint8).tolist()).decode(errors="replace") for r in rows)


def replica_layout(mesh: Any, axes: Sequence[str] | str = ("data",), *,
                   hosts: Sequence[str] | Mapping[int, str] | None = None) -> ReplicaLayout:
    """Replica -> devices -> process index -> host name, gathered once at start-up.

    Replica ``r`` is the flat index over the batch ``axes`` of the mesh (first axis
    major), the order ``lax.axis_index(axes)`` and a ``PartitionSpec`` over those
    axes use; its devices are every device at that index (all indices of the other
    axes). Call it on every process (the host names are exchanged once, see
    :func:`process_hostnames`).

    Args:
      mesh: a ``jax.sharding.Mesh``, or a sequence of devices (``pmap``: one replica
        each, in that order).
      axes: the mesh axes the batch is sharded along.
      hosts: the host name of each process (a sequence by process index or a
        mapping); None: gathered.

    Returns:
      A :class:`ReplicaLayout`.

    Raises:
      ValueError: an axis the mesh lacks.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if isinstance(mesh, jax.sharding.Mesh):
        names = tuple(mesh.axis_names)
        missing = [a for a in axes if a not in names]
        if missing or not axes:
            raise ValueError(f"replica_layout: the mesh has axes {list(names)}; the batch axes {list(axes)} "
                             f"must be among them (pass axes=, e.g. ('data',)).")
        order = [names.index(a) for a in axes] + [i for i, a in enumerate(names) if a not in axes]
        grid = np.transpose(np.asarray(mesh.devices), order)
        grid = grid.reshape(int(np.prod([mesh.shape[a] for a in axes])), -1)
    else:
        if mesh is None or isinstance(mesh, (str, int)) or not isinstance(mesh, Iterable):
            raise TypeError(f"replica_layout: mesh={mesh!r:.40} must be a jax.sharding.Mesh (e.g. "
                            f"jax.make_mesh((8,), ('data',))) or a list of devices, one per replica")
        grid = np.asarray(list(mesh), dtype=object).reshape(-1, 1)
        axes = axes or ("replica",)
    if hosts is None:
        hosts = process_hostnames()
    name_of = dict(hosts) if isinstance(hosts, Mapping) else dict(enumerate(hosts))
    places = []
    for r, row in enumerate(grid):
        devs = list(row)
        places.append(ReplicaPlace(
            r, tuple(int(d.id) for d in devs), tuple(str(d) for d in devs),
            tuple(int(d.process_index) for d in devs),
            tuple(str(name_of.get(int(d.process_index), f"process-{d.process_index}")) for d in devs)))
    return ReplicaLayout(axes, tuple(places))

