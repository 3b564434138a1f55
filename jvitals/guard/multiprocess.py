"""Agreement between processes (no-ops on one process): what every process saw, gathered.

Every process of a multi-host run calls the guard's methods in the same order;
where their answers could differ (a save that failed on one host, a restore that
failed on one, a data position) they agree through ``process_allgather``.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["agree", "allgather_ints", "allgather_json", "json_default"]




def allgather_ints(values: Sequence[int]) -> np.ndarray:
    """``[process_count, len(values)]`` int64 rows: every process's ``values``."""
    row = np.asarray(values, np.int64)
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(row.astype(np.int32))).reshape(
        jax.process_count(), -1).astype(np.int64)


def agree(ok: bool) -> bool:
    """True only if ``ok`` is true on every process."""
    return bool(allgather_ints([int(bool(ok))]).min())


def json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def allgather_json(obj: Any) -> list[Any]:
    """Every process's ``obj`` (JSON-serialisable), in process order."""
    text = json.dumps(obj, default=json_default)
    if jax.process_count() == 1:
        return [json.loads(text)]
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    n = int(allgather_ints([data.size]).max())
    rows = allgather_ints(np.pad(data, (0, n - data.size), constant_values=-1).tolist())
    return [json.loads(bytes(r[r >= 0].astype(np.uint8).tolist()).decode()) for r in rows]
