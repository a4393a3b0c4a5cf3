"""The train step: gradients over micro-batches and replicas, the update, the metrics.

- `make_train_step`: ``(init, step)``, one jitted step over any layout of
  `mpscale.parallel` (``_train_step``); `TrainState`, what it carries, built by
  ``init`` and placed on the mesh (``_state``; a leaf split unevenly over the data
  axes stored padded, `unpaddable` says when it cannot be);
- `accumulate_gradients`: float32 gradients of ``loss_scale * loss`` over
  micro-batches and data replicas (``_accumulate``; what its strategies share:
  ``_sums``), with every sum in float32 on request (``grad_reduce_dtype``,
  ``_float32_sums``);
- `step_metrics`: what a loop logs each step, read from the optimizer state
  (``_metrics``).

May import: every other room of the library and the core.
"""

from mpscale.gradients import Gradients
from mpscale.step._metrics import StepMetrics, step_metrics
from mpscale.step._accumulate import DataAxis, LossFn, accumulate_gradients
from mpscale.step._state import OFFLOAD, TrainState, on_device
from mpscale.step._train_step import make_train_step, unpaddable

__all__ = [
    "DataAxis",
    "OFFLOAD",
    "Gradients",
    "LossFn",
    "StepMetrics",
    "TrainState",
    "accumulate_gradients",
    "make_train_step",
    "on_device",
    "step_metrics",
    "unpaddable",
]
