"""Pytree helpers of the checkpoint store: the restore target, the finiteness check, and
a checkpoint held against the train state (:func:`fit`): what matches is restored as it
is; a recorder state an older jvitals wrote (another figure vector, other families) is
taken from the train state (:class:`Fit`, :func:`graft`, :func:`migration_note`); any
other difference is a :class:`CheckpointMismatchError` naming the path, the shapes and
the step."""

from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jvitals.metrics.paths import path_str
from jvitals.optim.lr_scale import REMEDY_SETTINGS

__all__ = ["CheckpointMismatchError", "Fit", "abstract", "all_finite", "check_dtypes", "fit", "float_dtypes", "graft",
           "migration_note"]




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


# ----------------------------------------------------------------------------
# A checkpoint against the train state: what fits, what an older recorder wrote.
# ----------------------------------------------------------------------------

RECORDER_FIELDS = ("metrics", "last_step")
"""A recorder state's own fields (``RecordState.metrics``, the latest figures and the
window; ``RecordState.last_step``, when each family was last computed): measurements,
whose layout changes with the jvitals version. Its ``count`` (the update counter the
schedule's figure and the cadences read) and ``inner_state`` (the wrapped optimizer's
state: Adam's moments) are training state."""

Path = tuple[str, ...]


class CheckpointMismatchError(ValueError):
    """A checkpoint whose arrays do not fit the train state: the model or the optimizer
    changed since it was saved. The checkpoint is left as it is (not quarantined).

    Attributes: ``directory``, ``step``, ``path`` (the first path that differs, ``/``-joined),
    ``on_disk`` and ``expected`` (its dtype and shape there and in the train state, or
    ``"absent"``).
    """

    def __init__(self, message: str, *, directory: str, step: int, path: str = "", on_disk: str = "",
                 expected: str = "") -> None:
        super().__init__(message)
        self.directory, self.step, self.path = directory, step, path
        self.on_disk, self.expected = on_disk, expected


class Fit(NamedTuple):
    """How a checkpoint whose recorder states differ from the train state's is restored.

    Attributes:
      target: the restore target, shaped like the checkpoint: the train state's leaves
        (as :func:`abstract` gives them), NumPy arrays for the differing recorders' own
        leaves (read, then dropped).
      kept: the train state's paths taken from it rather than from disk (the differing
        recorders' ``metrics`` and ``last_step``).
      diffs: what differed, ``(path, on disk, in the train state)``.
      where: the checkpoint, ``"<store>: checkpoint <step> in '<directory>'"``.
    """

    target: Any
    kept: frozenset[Path]
    diffs: tuple[tuple[Path, str, str], ...]
    where: str


def _path(keys: Any) -> Path:
    """A pytree path as orbax names it on disk (dict keys, field names, indices as text),
    one name per level (``keystr``'s simple form; a Variable's ``value`` level kept, unlike
    :func:`~jvitals.metrics.paths.path_str`, since orbax's tree keeps it too)."""
    return tuple(jax.tree_util.keystr((k,), simple=True, separator="/") for k in keys)


def _flat(tree: Any) -> dict[Path, Any]:
    return {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _describe(x: Any) -> str:
    """``float32[32, 64]`` (a leaf of the train state, or orbax's metadata of one)."""
    shape = getattr(x, "shape", None)
    shape = np.shape(x) if shape is None else shape
    dtype = getattr(x, "dtype", None)
    if dtype is None and not isinstance(x, (str, bytes)):
        dtype = np.asarray(x).dtype
    return f"{np.dtype(dtype).name if dtype is not None else type(x).__name__}[{', '.join(map(str, shape))}]"


def _shape(x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    return tuple(np.shape(x) if shape is None else shape)


def _recorders(paths: Any) -> set[Path]:
    """The paths of the recorder states in a tree with these leaf paths: the nodes with a
    ``count``, a ``last_step`` and a ``metrics/vector`` (a ``RecordState``, or its form
    in an ``nnx.State`` or on disk)."""
    paths = list(paths)
    prefixes = {p[:j] for p in paths for j in range(1, len(p) + 1)}
    return {p[:i] for p in paths for i in range(len(p) - 1)
            if p[i:i + 2] == ("metrics", "vector") and p[:i] + ("count",) in prefixes
            and p[:i] + ("last_step",) in prefixes}


def _owner(path: Path, recorders: set[Path]) -> Path | None:
    """The recorder whose own field (:data:`RECORDER_FIELDS`) holds ``path``, or None."""
    for i, k in enumerate(path):
        if k in RECORDER_FIELDS and path[:i] in recorders:
            return path[:i]
    return None


def _diffs(disk: Mapping[Path, Any], mine: Mapping[Path, Any]) -> list[tuple[Path, str, str]]:
    """Every path whose leaf is absent on one side or has another shape, the train
    state's order first (dtypes aside: orbax casts to the train state's)."""
    out = [(p, "absent" if p not in disk else _describe(disk[p]), _describe(x)) for p, x in mine.items()
           if p not in disk or tuple(getattr(disk[p], "shape", ())) != _shape(x)]
    return out + [(p, _describe(m), "absent") for p, m in disk.items() if p not in mine]


def fit(disk_tree: Any, like: Any, *, step: int, directory: str, store: str = "checkpoints") -> Fit | None:
    """Compares the tree of checkpoint ``step`` (orbax's metadata of it, in ``directory``
    of the store named ``store``) with the train state ``like``.

    Returns:
      None when every path and shape matches (restore onto ``like`` as it is); a
      :class:`Fit` when the only differences lie in recorder states' own fields (a
      checkpoint of an older jvitals recorder).

    Raises:
      CheckpointMismatchError: a difference anywhere else (it names the first).
      ValueError: the checkpoint's tree is empty (unreadable metadata: corrupt).
    """
    where = f"{store}: checkpoint {int(step)} in {str(directory)!r}"
    disk = _flat(disk_tree)
    if not disk:
        raise ValueError(f"{where}: its tree metadata lists no arrays")
    mine = _flat(like)
    _check_dtypes(disk, mine, where, (int(step), str(directory)))
    diffs = _diffs(disk, mine)
    if not diffs:
        return None
    recorders = _recorders(mine)
    settings = {d[0] for d in diffs if _new_setting(d)}
    outside = [d for d in diffs if _owner(d[0], recorders) is None and d[0] not in settings]
    if outside:
        raise _mismatch(outside, where, (int(step), str(directory)))
    changed = {_owner(d[0], recorders) for d in diffs} - {None}

    def leaf(keys: Any, m: Any) -> Any:
        p = _path(keys)
        if _owner(p, changed) is not None:
            return np.zeros(tuple(getattr(m, "shape", ()) or ()), getattr(m, "dtype", None) or np.float32)
        return abstract(mine[p])

    target = jax.tree_util.tree_map_with_path(leaf, disk_tree)
    kept = frozenset(p for p in mine if _owner(p, changed) is not None) | frozenset(settings)
    return Fit(target, kept, tuple(diffs), where)


def _new_setting(diff: tuple[Path, str, str]) -> bool:
    """A remedy setting :func:`jvitals.with_lr_scale` holds today that the checkpoint's older
    jvitals did not (``hyperparams/qk_clip_tau``, ``hyperparams/z_loss``): taken at its off
    value from the train state."""
    path, on_disk, _ = diff
    return on_disk == "absent" and len(path) >= 2 and path[-2] == "hyperparams" and path[-1] in REMEDY_SETTINGS


def float_dtypes(tree: Any) -> dict[str, int]:
    """``{dtype name: count}`` of the floating-point leaves of ``tree`` (a checkpoint's
    signature: a restore whose train state differs has cast some of them)."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        d = _float_dtype(x)
        if d is not None:
            out[d.name] = out.get(d.name, 0) + 1
    return dict(sorted(out.items()))


def check_dtypes(disk_tree: Any, like: Any, *, step: int, directory: str, store: str = "checkpoints") -> None:
    """Raises :class:`CheckpointMismatchError` for the first floating-point array whose dtype
    on disk differs from the train state's."""
    _check_dtypes(_flat(disk_tree), _flat(like), f"{store}: checkpoint {int(step)} in {str(directory)!r}",
                  (int(step), str(directory)))


def _float_dtype(x: Any) -> np.dtype | None:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    dtype = np.dtype(dtype)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else None


def _check_dtypes(disk: Mapping[Path, Any], mine: Mapping[Path, Any], where: str, step_dir: tuple[int, str]) -> None:
    """A floating-point leaf saved in one dtype and restored into another (orbax would cast it:
    a float32 run resumed in bfloat16, Adam's moments too, without a word) is an error naming
    the first such path and how many there are."""
    diffs = [(p, d, m) for p, x in mine.items() if p in disk
             for d, m in [(_float_dtype(disk[p]), _float_dtype(x))] if d is not None and m is not None and d != m]
    if not diffs:
        return
    (path, d, m), rest = diffs[0], diffs[1:]
    step, directory = step_dir
    name = "/".join(path)
    raise CheckpointMismatchError(
        f"{where} holds {name} as {d.name} but the train state has {m.name}"
        f"{f' ({len(rest)} more floating-point arrays differ in dtype)' if rest else ''}: restoring would cast "
        f"every such array silently. Restore into a train state of the checkpoint's dtypes (the run's own "
        f"model and optimizer), then cast deliberately (jax.tree.map(lambda x: x.astype(jnp.{m.name}), ...)) "
        "if the change is wanted.", directory=directory, step=int(step), path=name, on_disk=d.name, expected=m.name)


def _mismatch(diffs: list[tuple[Path, str, str]], where: str,
              step_dir: tuple[int, str]) -> CheckpointMismatchError:
    (path, on_disk, expected), rest = diffs[0], diffs[1:]
    step, directory = step_dir
    name = "/".join(path)
    more = (f" ({len(rest)} more path(s) differ: {', '.join('/'.join(d[0]) for d in rest[:3])}"
            f"{', ...' if len(rest) > 3 else ''})") if rest else ""
    return CheckpointMismatchError(
        f"{where} does not fit the train state: {name} is {on_disk} on disk but {expected} in the "
        f"train state{more}. The model or the optimizer changed since checkpoint {step} was saved; jvitals "
        "does not patch a model's arrays, and the checkpoint is left as it is (not quarantined). "
        "Resume with the model and optimizer it was saved with, or start the changed model in a new "
        "checkpoint directory (or move this run's checkpoints away).",
        directory=directory, step=int(step), path=name, on_disk=on_disk, expected=expected)


def graft(restored: Any, like: Any, kept: frozenset[Path]) -> Any:
    """``like``'s structure with its leaves from ``restored`` (the checkpoint's tree, read
    through :attr:`Fit.target`), the ``kept`` paths from ``like`` itself (copies)."""
    got = _flat(restored)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    for keys, x in leaves:
        p = _path(keys)
        out.append((x.copy() if isinstance(x, jax.Array) else x) if p in kept else got[p])
    return jax.tree_util.tree_unflatten(treedef, out)


def migration_note(fitted: Fit) -> str:
    """The one warning line of a checkpoint an older jvitals recorder wrote."""
    shown = "; ".join(f"{'/'.join(p)}: {d} on disk, {e} now" for p, d, e in fitted.diffs[:4])
    shown += "; ..." if len(fitted.diffs) > 4 else ""
    kept = ", ".join(sorted("/".join(p) for p in fitted.kept))
    return (f"{fitted.where} was written by an older jvitals ({shown}): restored every other "
            f"array from disk, and kept from the current train state {kept}: the recorder's figures "
            "(the latest figures and the window since the last read, which the next update refills) "
            "and the remedies' settings the older version did not have (off).")
