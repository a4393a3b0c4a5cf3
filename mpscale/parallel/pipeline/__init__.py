"""Pipeline parallelism over a ``stage`` mesh axis: GPipe, 1F1B (both interleaved),
ZB-H1, and encoder-decoder splits.

TODO
"""

from mpscale.parallel.pipeline._backward_split import Split as BackwardSplit
from mpscale.parallel.pipeline._pipeline import LAYER_ORDERS, Pipeline, stage_norm_groups
from mpscale.parallel.pipeline._run import RECOMPUTE, recompute_policy
from mpscale.parallel.pipeline._split import SplitPipeline
from mpscale.parallel.pipeline._schedules import (
    SCHEDULES,
    check_schedule,
    live_slots,
    pipeline_bubble_fraction,
    pipeline_schedule_chunks,
    pipeline_schedule_table,
    tick_costs,
)

__all__ = [
    "BackwardSplit",
    "LAYER_ORDERS",
    "Pipeline",
    "RECOMPUTE",
    "SCHEDULES",
    "SplitPipeline",
    "check_schedule",
    "live_slots",
    "pipeline_bubble_fraction",
    "pipeline_schedule_chunks",
    "pipeline_schedule_table",
    "recompute_policy",
    "stage_norm_groups",
    "tick_costs",
]
