"""The optax remedies: what the guard (or a user) turns to when a vital is off.

Learning-rate scales per group (``with_lr_scale``/``set_lr_scale``) and the remedies' settings
the guard turns on mid-run (``remedy``/``set_remedy``), layer-wise LR
decay, an adaptive clip, QK-clip, the z-loss and an in-step skip of outlying updates. They import ``jvitals.metrics`` (the
parameter roles, the names the recorder reads) and nothing above it.
"""

from jvitals.optim.lr_scale import (
    get_lr_scale,
    get_lr_scales,
    get_remedy,
    has_lr_scale,
    has_remedy,
    LR_SCALE,
    LR_SCALE_ARG,
    LRGroupScaleState,
    remedy,
    REMEDY_SETTINGS,
    set_lr_scale,
    set_remedy,
    with_lr_scale,
)
from jvitals.optim.layer_decay import (
    layer_decay_factors,
    layerwise_lr_decay,
)
from jvitals.optim.clipping import (
    adaptive_clip,
    AdaptiveClipState,
)
from jvitals.optim.qk_clip import (
    qk_clip,
)
from jvitals.optim.losses import (
    cross_entropy,
    z_loss,
)
from jvitals.optim.skip import (
    skip_step,
    SkipStepState,
)

__all__ = [
    "adaptive_clip",
    "AdaptiveClipState",
    "cross_entropy",
    "get_lr_scale",
    "get_lr_scales",
    "get_remedy",
    "has_lr_scale",
    "has_remedy",
    "layer_decay_factors",
    "layerwise_lr_decay",
    "LR_SCALE",
    "LR_SCALE_ARG",
    "LRGroupScaleState",
    "qk_clip",
    "remedy",
    "REMEDY_SETTINGS",
    "set_lr_scale",
    "set_remedy",
    "skip_step",
    "SkipStepState",
    "with_lr_scale",
    "z_loss",
]
