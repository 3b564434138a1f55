"""The guard's settings, one frozen config per idea (see docs/GUARD.md, "Settings").

:class:`jvitals.Rollback` is built from parts; each part's settings are a small
frozen dataclass with its own fields, defaults and validation (a ``ValueError``
names the config and the field):

- :class:`Retention`: which checkpoints the store keeps (``keep_last``, ...);
- :class:`RestorePolicy`: which checkpoint a rollback or a resume restores
  (``healthy_levels``, ``check_finite``, ``onset_margin``, ``rewind_steps``);
- :class:`RollbackActions`: what a rollback does after the restore (``lr_factor``,
  ``max_rollbacks``, ``skip_data``, ``reset_optimizer``, ``remedies``,
  ``save_on_rollback``, ``step_attr``);
- :class:`Saving`: how checkpoints are written (``sync``, ``on_save_error``,
  ``snapshots``; the cadence is ``Rollback(save_every=)``).

:func:`split_options` maps the keywords ``Rollback`` took before these configs
(``keep_last=``, ``onset_margin=``, ...) onto them, with a ``DeprecationWarning``
naming each one's new place (:data:`LEGACY`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping

from jvitals.guard.actions import parse_reset
from jvitals.guard.remedies import parse_remedies
from jvitals.guard.response import Snapshots
from jvitals.guard.target import RestorePolicy, fail as _fail

__all__ = ["RollbackActions", "LEGACY", "RestorePolicy", "Retention", "Saving", "split_options"]


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which checkpoints the store keeps (orbax's preservation policy; pins aside).

    Attributes:
      keep_last: the newest checkpoints kept (of any kind, and the newest regular
        ones: cadence, rollback, manual). At least 1.
      keep_every: cadence checkpoints on multiples of this (or the first past one)
        are kept for good (None: none).
      keep_green: the newest healthy GREEN checkpoints kept beyond ``keep_last``.
      keep_quarantined: the newest quarantined (sick) checkpoints kept for a
        post-mortem (0: deleted at the next retention).
    """

    keep_last: int = 5
    keep_every: int | None = 5000
    keep_green: int = 1
    keep_quarantined: int = 3

    def __post_init__(self) -> None:
        if int(self.keep_last) < 1:
            _fail("Retention", "keep_last", ">= 1", self.keep_last)
        if self.keep_every is not None and int(self.keep_every) < 1:
            _fail("Retention", "keep_every", ">= 1 or None", self.keep_every)
        if int(self.keep_green) < 0:
            _fail("Retention", "keep_green", ">= 0", self.keep_green)
        if int(self.keep_quarantined) < 0:
            _fail("Retention", "keep_quarantined", ">= 0", self.keep_quarantined)


@dataclasses.dataclass(frozen=True)
class RollbackActions:
    """What a rollback does after the restore, and how many it may do.

    Attributes:
      lr_factor: LR scale multiplier per rollback, compounding (1.0: leave the LR
        alone, and no :func:`~jvitals.with_lr_scale` is needed). In (0, 1].
      max_rollbacks: rollbacks allowed in the run (None: no limit); one more red
        raises :class:`jvitals.RollbackLimitError`.
      skip_data: ``False`` (keep the data position, the guide's default), ``True``
        (skip as many batches again as were consumed between the target and the
        red step) or an int ``N`` (skip ``N`` batches); the position must be an int.
      reset_optimizer: Adam moments to zero after the restore: ``('nu',)``,
        ``('mu', 'nu')`` (every parameter), or per parameter group
        ``{path_regex: ('mu', 'nu')}`` (``re.search`` on the ``/``-joined path).
        None: keep them.
      remedies: None (only the LR x ``lr_factor``), ``"default"``
        (:data:`jvitals.guard.remedies.DEFAULT_REMEDIES`) or a dict ``{rule id or
        metric regex: remedy name or callable}``
        (:func:`jvitals.guard.remedies.parse_remedies`); applied on top of ``lr_factor``.
      save_on_rollback: checkpoint the restored state at the red step (kind ``'rollback'``).
      step_attr: the train state's step field kept forward by a rollback (None:
        leave the restored one).
    """

    lr_factor: float = 0.9
    max_rollbacks: int | None = 3
    skip_data: bool | int = False
    reset_optimizer: Any = None
    remedies: Any = None
    save_on_rollback: bool = True
    step_attr: str | None = "step"

    def __post_init__(self) -> None:
        if not 0.0 < float(self.lr_factor) <= 1.0:
            _fail("RollbackActions", "lr_factor", "in (0, 1]", self.lr_factor)
        if self.max_rollbacks is not None and int(self.max_rollbacks) < 0:
            _fail("RollbackActions", "max_rollbacks", ">= 0 or None", self.max_rollbacks)
        skip = self.skip_data
        if not (isinstance(skip, bool) or (isinstance(skip, int) and skip >= 0)):
            _fail("RollbackActions", "skip_data", "False, True or an int >= 0", skip)
        parse_reset(self.reset_optimizer)       # raises a ValueError naming reset_optimizer
        parse_remedies(self.remedies)           # raises a ValueError naming the remedy


@dataclasses.dataclass(frozen=True)
class Saving:
    """How checkpoints are written (the cadence is ``Rollback(save_every=)``).

    Attributes:
      sync: wait for each save to land (errors at the save call; slower).
      on_save_error: a save that fails (full disk, permissions, I/O error):
        ``'continue'`` (one error line, a ``checkpoint_save_failed`` alert and
        event; training goes on; the next cadence save tries again) or ``'raise'``
        (:class:`jvitals.guard.CheckpointSaveError`: the loop stops).
      snapshots: a :class:`jvitals.Snapshots` for light recent snapshots between
        the cadence checkpoints (None: none).
    """

    sync: bool = False
    on_save_error: str = "continue"
    snapshots: Snapshots | None = None

    def __post_init__(self) -> None:
        if self.on_save_error not in ("continue", "raise"):
            _fail("Saving", "on_save_error", "'continue' or 'raise'", self.on_save_error)
        snap = self.snapshots
        if snap is not None and (int(snap.every) < 1 or int(snap.keep) < 1):
            _fail("Saving", "snapshots", "Snapshots(every >= 1, keep >= 1)", snap)


LEGACY: dict[str, tuple[str, str]] = {
    **{k: ("retention", k) for k in ("keep_last", "keep_every", "keep_green", "keep_quarantined")},
    **{k: ("restore", k) for k in ("healthy_levels", "check_finite", "onset_margin", "rewind_steps")},
    **{k: ("actions", k) for k in ("lr_factor", "max_rollbacks", "skip_data", "reset_optimizer",
                                   "remedies", "save_on_rollback", "step_attr")},
    "sync_save": ("saving", "sync"), "on_save_error": ("saving", "on_save_error"),
    "snapshots": ("saving", "snapshots"),
}
"""``{old Rollback keyword: (new Rollback keyword, field of its config)}``."""

CONFIGS: dict[str, type] = {"retention": Retention, "restore": RestorePolicy, "actions": RollbackActions,
                            "saving": Saving}
DEFAULTS: dict[str, Any] = {name: cls() for name, cls in CONFIGS.items()}
"""The default of each config keyword (``Rollback(retention=DEFAULTS['retention'])`` is "not given")."""
OPTIONS = ("saving", "pause", "preemption")
"""``Rollback``'s keywords beyond its named parameters (current, not deprecated)."""


def split_options(given: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """The configs of a ``Rollback``, from its config arguments and its other keywords.

    Args:
      given: ``{'retention': ..., 'restore': ..., 'actions': ...}`` as passed.
      options: the other keywords: ``saving``, ``pause``, ``preemption``, or an old
        keyword (:data:`LEGACY`: warned about, folded into its config).

    Returns:
      ``{'retention', 'restore', 'actions', 'saving': config, 'pause': ..., 'preemption': ...}``.

    Raises:
      TypeError: an unknown keyword, or an old keyword beside the config it now belongs to.
    """
    configs = {name: given.get(name, options.get(name, DEFAULTS[name])) for name in CONFIGS}
    for name, cfg in configs.items():
        if not isinstance(cfg, CONFIGS[name]):
            raise TypeError(f"Rollback expects {name}= a {CONFIGS[name].__name__}, got "
                            f"{type(cfg).__name__} {cfg!r}")
    moved: dict[str, dict[str, Any]] = {}
    for key, value in options.items():
        if key in OPTIONS:
            continue
        if key not in LEGACY:
            raise TypeError(f"Rollback() got an unexpected keyword argument {key!r}")
        where, field = LEGACY[key]
        warnings.warn(f"Rollback({key}=...) is deprecated: pass {where}="
                      f"{CONFIGS[where].__name__}({field}=...) instead.", DeprecationWarning, stacklevel=3)
        if configs[where] is not DEFAULTS[where]:
            raise TypeError(f"Rollback got {key}= and {where}=; pass {field} inside "
                            f"{CONFIGS[where].__name__}(...) only.")
        moved.setdefault(where, {})[field] = value
    for where, fields in moved.items():
        configs[where] = CONFIGS[where](**fields)
    configs["pause"] = options.get("pause", "return")
    configs["preemption"] = options.get("preemption", True)
    return configs
