"""Pytree helpers of the checkpoint store: the restore target, and the finiteness check."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvitals.metrics.paths import path_str

__all__ = ["abstract", "all_finite"]




def abstract(tree: Any) -> Any:
    """Restore target: jax.Arrays become ShapeDtypeStructs with their sharding."""
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(leaf, tree)


_MEASUREMENTS = re.compile(r"(?:^|/)metrics/vector$")
"""The recorder's figures (``RecordState.metrics``, a ``PackedMetrics`` vector; in an
``nnx.State`` the same path): measurements of the last update, not training state, so a
NaN figure (a skipped non-finite step, a family never computed) is not a sick checkpoint."""


def all_finite(tree: Any) -> bool:
    """True if every floating-point leaf of ``tree`` is finite (one host read), the
    recorder's figures (:data:`_MEASUREMENTS`) aside."""
    flags = [jnp.all(jnp.isfinite(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
             if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)
             and not _MEASUREMENTS.search(path_str(p))]
    if not flags:
        return True
    return bool(jax.device_get(jnp.all(jnp.stack(flags))))
