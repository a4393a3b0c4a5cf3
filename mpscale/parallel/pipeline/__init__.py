"""Pipeline parallelism over a ``stage`` mesh axis: GPipe, 1F1B (both interleaved),
ZB-H1, and encoder-decoder splits.

A pipelined model is three functions, ``embed_fn``, ``stage_fn`` (one layer) and
``head_fn``, its layers' parameters stacked on a leading axis split over the stages
(`Pipeline`, in ``_pipeline``; the algorithm is its module docstring). From the top:

- ``_pipeline``: `Pipeline`: checks, layouts, the unpipelined model, and
  ``value_and_grad``: one ``shard_map`` manual over the stage and data axes, each
  device's part run by a schedule's executor; `stage_norm_groups`;
- ``_split``: `SplitPipeline`, an encoder-decoder split (T5's), and its GPipe loop;
- ``_gpipe``: GPipe, the forward loop that autodiff runs backward;
- ``_ticked``: 1F1B and ZB-H1, tick by tick from their tables, with their own
  backward (`Carry`, the item slots the ticks carry);
- ``_run``: what every executor shares on one device (`PipelineRun`, `RunSpec`),
  recomputation (`recompute_policy`, `SAVED_NAMES`, `OFFLOADED`, and the first
  layers of a stage recomputed: `scan_layers`, `check_recompute_layers`);
- ``_backward_split``: a layer's backward in two, input gradient and weight
  gradients, for ZB-H1 (`BackwardSplit`);
- ``_schedules``: the schedule tables, which op each stage runs at each tick, and
  what they cost (`pipeline_schedule_table`, `pipeline_bubble_fraction`,
  `tick_costs`, `live_slots`): small pure functions the tests and notebooks call.

May import: the core, and ``mpscale.parallel``'s own layout modules (``_layouts``,
``_mesh``, ``_fsdp``).
"""

from mpscale.parallel.pipeline._backward_split import Split as BackwardSplit
from mpscale.parallel.pipeline._pipeline import LAYER_ORDERS, Pipeline, stage_norm_groups
from mpscale.parallel.pipeline._run import (
    RECOMPUTE,
    OFFLOADED,
    SAVED_NAMES,
    check_recompute_layers,
    recompute_policy,
    scan_layers,
)
from mpscale.parallel.pipeline._schedules import (
    BWD,
    FWD,
    IDLE,
    SCHEDULES,
    SLOTS,
    WGT,
    check_schedule,
    chunk_table,
    item_slots,
    live_slots,
    op_costs,
    pipeline_bubble_fraction,
    pipeline_schedule_chunks,
    pipeline_schedule_table,
    tick_costs,
)
from mpscale.parallel.pipeline._split import SplitPipeline

__all__ = [
    "BWD",
    "BackwardSplit",
    "FWD",
    "IDLE",
    "LAYER_ORDERS",
    "Pipeline",
    "RECOMPUTE",
    "OFFLOADED",
    "SAVED_NAMES",
    "SCHEDULES",
    "SLOTS",
    "SplitPipeline",
    "WGT",
    "check_recompute_layers",
    "check_schedule",
    "chunk_table",
    "item_slots",
    "live_slots",
    "op_costs",
    "pipeline_bubble_fraction",
    "pipeline_schedule_chunks",
    "pipeline_schedule_table",
    "recompute_policy",
    "scan_layers",
    "stage_norm_groups",
    "tick_costs",
]
