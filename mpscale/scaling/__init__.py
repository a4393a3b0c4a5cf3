"""Loss scaling, skipping bad steps, and the gradient norms they share.

The Optax wrappers a mixed-precision step puts around its optimizer, and the one
float32 pass over the gradients they all read:

- `dynamic_loss_scale`, `fixed_loss_scale`, `no_loss_scale`, `policy_loss_scale`
  (the wrapper a precision policy calls for), with `loss_scale_of`, `scale_loss` and
  `with_loss_scale` to read and set the scale (``_loss_scale``);
- `skip_nonfinite`: a step with a NaN or Inf changes nothing (``_skip``), by selecting
  each state leaf where it is produced (``_producer_select``);
- `skip_spikes`: a step whose loss or gradient norm is an outlier changes nothing
  (``_spikes``);
- `global_norm`, `group_norms`, `global_norm_clip` and `LeafSquares`, the per-leaf
  sums of squares every one of them reads (``_norms``).

May import: the core (`mpscale.validation`, ``_tree``, ``_jaxprs``).
"""

from mpscale.scaling._loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    fixed_loss_scale,
    loss_scale_of,
    no_loss_scale,
    policy_loss_scale,
    scale_loss,
    with_loss_scale,
)
from mpscale.scaling._norms import (
    GlobalNormClipState,
    LeafSquares,
    NormGroups,
    global_norm,
    global_norm_clip,
    group_norms,
)
from mpscale.scaling._skip import SkipNonfiniteState, skip_nonfinite
from mpscale.scaling._spikes import SkipSpikesState, skip_spikes

__all__ = [
    "GlobalNormClipState",
    "LeafSquares",
    "LossScaleState",
    "NormGroups",
    "SkipNonfiniteState",
    "SkipSpikesState",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "global_norm",
    "global_norm_clip",
    "group_norms",
    "loss_scale_of",
    "no_loss_scale",
    "policy_loss_scale",
    "scale_loss",
    "skip_nonfinite",
    "skip_spikes",
    "with_loss_scale",
]
