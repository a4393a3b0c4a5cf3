"""Mixtures of experts: a router, dropless grouped experts, and expert parallelism.

- ``_routing``: which experts each token goes to (`Routing`, `route`), the
  load-balancing loss, and DeepSeek-V3's balancing bias (`update_bias`);
- ``_grouped``: the grouped matrix product of rows sorted by expert
  (`grouped_matmul`: XLA's ``ragged_dot``, or tiles of one expert each);
- ``_dispatch``: tokens to their experts and back, on one device or across an
  ``expert`` axis with ragged (or padded) all-to-alls, dropless or with a capacity
  (`dispatch`, `exchange`), and the experts' activation (`swiglu`, which the
  built-in dense SwiGLU blocks share);
- ``_layer``: the whole layer on a mesh, and its statistics (`moe_mlp`,
  `MoeStats`);
- `mpscale.experts.moe_flax`: the layer as linen and NNX modules (needs Flax).

May import: the core and `mpscale.parallel`.
"""

from mpscale.experts._dispatch import (
    Dispatched,
    ExpertWeights,
    Plan,
    dispatch,
    RAGGED_PLATFORMS,
    exchange,
    has_ragged_all_to_all,
    platform_of,
    swiglu,
)
from mpscale.experts._grouped import (IMPLEMENTATIONS, TILES_SCOPE, choose,
                                      default_tile, grouped_matmul)
from mpscale.experts._layer import EXPERT_AXIS, MoeStats, moe_mlp
from mpscale.experts._routing import (
    SCORES,
    Routes,
    Routing,
    expert_counts,
    load_balancing_loss,
    route,
    update_bias,
)

__all__ = [
    "Dispatched",
    "EXPERT_AXIS",
    "ExpertWeights",
    "IMPLEMENTATIONS",
    "MoeStats",
    "Plan",
    "RAGGED_PLATFORMS",
    "Routes",
    "Routing",
    "SCORES",
    "TILES_SCOPE",
    "choose",
    "default_tile",
    "dispatch",
    "exchange",
    "expert_counts",
    "grouped_matmul",
    "has_ragged_all_to_all",
    "load_balancing_loss",
    "moe_mlp",
    "swiglu",
    "platform_of",
    "route",
    "update_bias",
]
