"""mpscale: mixed-precision and parallel training pieces for JAX, as Optax transforms."""

from mpscale.finite import SkipNonfiniteState, skip_nonfinite
from mpscale.loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    fixed_loss_scale,
    loss_scale_of,
    no_loss_scale,
    with_loss_scale,
)
from mpscale.metrics import step_metrics
from mpscale.norms import (
    ClipByGlobalNormState,
    LeafSquares,
    clip_by_global_norm,
    global_norm,
    group_norms,
)

__version__ = "0.1.0"

__all__ = [
    "ClipByGlobalNormState",
    "LeafSquares",
    "LossScaleState",
    "SkipNonfiniteState",
    "clip_by_global_norm",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "global_norm",
    "group_norms",
    "loss_scale_of",
    "no_loss_scale",
    "skip_nonfinite",
    "step_metrics",
    "with_loss_scale",
]
