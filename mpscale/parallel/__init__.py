"""Where arrays live on a ``jax.sharding.Mesh``: layouts, FSDP, ZeRO-1, pipelines.

- ``_layouts``: a ``PartitionSpec`` per parameter (`resolve_specs` takes a tree of
  specs, a function of the key path, or `logical_specs`; `flax_specs` reads a Flax
  model's own), checked on the mesh (`check_specs`), and the bytes a layout puts on a
  device (`tree_bytes`, `bytes_per_device`);
- ``_mesh``: the data axes, the batch on them (`data_axes`, `batch_sharding`,
  `batch_rows`), and values inside a ``shard_map`` (`constrain`, `cast_varying`,
  `replica_index`);
- ``_optimizer_state``: the optimizer state following its parameters (`state_specs`)
  and ZeRO-1 (`zero1_specs`);
- ``_fsdp``: FSDP, parameters split over the data axes and gathered where used
  (`fsdp_specs`, `gather_cast`, `gather_where_used`, the pipeline's `StageFSDP`);
- ``_padding``: a leaf split unevenly (FSDP on any device count), stored padded
  (`Padded`, `pad_to`, `unpad`, `padded_values`, `rewrap`, `padded_shape`);
- ``_context``: context parallelism, attention over a sequence split along a
  ``context`` axis (`context_attention`, `context_order`);
- ``_batch_split``: activations kept split over the batch, so GSPMD gathers weights,
  not activations (`keep_batch_split`);
- `mpscale.parallel.pipeline`: pipeline stages (`Pipeline`, `SplitPipeline`, their
  schedules).

May import: the core (`mpscale.validation`, `mpscale.keys`, `mpscale.gradients`,
``_tree``, ``_jaxprs``).
"""

from mpscale.parallel._batch_split import keep_batch_split
from mpscale.parallel._context import (
    CONTEXT_AXIS,
    CONTEXT_PARALLEL,
    attention_over,
    check_context_length,
    context_attention,
    context_order,
    context_size,
    split_sequence,
)
from mpscale.parallel._fsdp import (
    fsdp_specs,
    gather_cast,
    gather_where_used,
    scatter_dims,
)
from mpscale.parallel._padding import (
    Padded,
    is_padded,
    pad_to,
    padded_shape,
    padded_values,
    rewrap,
    unpad,
)
from mpscale.parallel._layouts import (
    AxisNames,
    Rules,
    SpecsLike,
    axis_size,
    bytes_per_device,
    check_specs,
    entry_axes,
    flax_specs,
    flax_unbox,
    is_spec,
    logical_specs,
    make_spec,
    only_axes,
    pad,
    resolve_specs,
    shardings,
    spec_axes,
    split_across,
    split_dims,
    spec_entry,
    split_largest,
    tree_bytes,
    without_axes,
)
from mpscale.parallel._mesh import (
    batch_rows,
    batch_sharding,
    cast_varying,
    manual_axes,
    check_batch_size,
    constrain,
    data_axes,
    replica_index,
    varying_axes,
)
from mpscale.parallel._optimizer_state import (
    AVERAGED_DIMS,
    averaged_dims,
    state_specs,
    zero1_specs,
)
from mpscale.parallel.pipeline import (
    LAYER_ORDERS,
    RECOMPUTE,
    OFFLOADED,
    SAVED_NAMES,
    SCHEDULES,
    BackwardSplit,
    Pipeline,
    SplitPipeline,
    check_recompute_layers,
    check_schedule,
    live_slots,
    pipeline_bubble_fraction,
    pipeline_schedule_chunks,
    pipeline_schedule_table,
    recompute_policy,
    scan_layers,
    stage_norm_groups,
    tick_costs,
)

__all__ = [
    "AVERAGED_DIMS",
    "AxisNames",
    "BackwardSplit",
    "CONTEXT_AXIS",
    "CONTEXT_PARALLEL",
    "LAYER_ORDERS",
    "Padded",
    "Pipeline",
    "RECOMPUTE",
    "Rules",
    "OFFLOADED",
    "SAVED_NAMES",
    "SCHEDULES",
    "SpecsLike",
    "SplitPipeline",
    "attention_over",
    "averaged_dims",
    "axis_size",
    "batch_rows",
    "batch_sharding",
    "bytes_per_device",
    "cast_varying",
    "manual_axes",
    "check_batch_size",
    "check_context_length",
    "check_recompute_layers",
    "check_schedule",
    "check_specs",
    "constrain",
    "context_attention",
    "context_order",
    "context_size",
    "data_axes",
    "entry_axes",
    "flax_specs",
    "flax_unbox",
    "fsdp_specs",
    "gather_cast",
    "gather_where_used",
    "is_padded",
    "is_spec",
    "keep_batch_split",
    "live_slots",
    "logical_specs",
    "make_spec",
    "only_axes",
    "pad",
    "pad_to",
    "padded_shape",
    "padded_values",
    "pipeline_bubble_fraction",
    "pipeline_schedule_chunks",
    "pipeline_schedule_table",
    "recompute_policy",
    "replica_index",
    "resolve_specs",
    "rewrap",
    "scan_layers",
    "scatter_dims",
    "shardings",
    "spec_entry",
    "spec_axes",
    "split_across",
    "split_dims",
    "split_sequence",
    "split_largest",
    "stage_norm_groups",
    "state_specs",
    "tick_costs",
    "tree_bytes",
    "unpad",
    "varying_axes",
    "without_axes",
    "zero1_specs",
]
