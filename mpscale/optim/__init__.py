"""Optimizers and what shapes their updates: CAME, schedules, parameter groups,
rounding.

- `came` and `scale_by_came`: the CAME optimizer with every mindformers option
  (``_came``), its state leaf by leaf or stacked by role (`Stacks`);
- `lr_schedule`, `weight_decay_schedule` (Megatron-LM's), and `count_samples` for
  schedules counted in samples (``_lr_schedules``);
- `param_groups`, `ParamGroup`: one optimizer with settings per group of leaves
  (``_param_groups``);
- `stochastic_round`, `stochastic_rounding`, `kahan_summation`: how updates land on
  16-bit parameters (``_rounding``).

May import: the core (`mpscale.validation`, `mpscale.keys`, ``_tree``).
"""

from mpscale._tree import Stacks
from mpscale.optim._came import (
    CameLearningRateState,
    Compression,
    ScalarOrSchedule,
    ScaleByCameState,
    came,
    scale_by_came,
)
from mpscale.optim._lr_schedules import count_samples, lr_schedule, weight_decay_schedule
from mpscale.optim._param_groups import (
    ParamGroup,
    ParamGroupsState,
    param_group_labels,
    param_groups,
)
from mpscale.optim._rounding import (
    KahanSummationState,
    StochasticRoundingState,
    kahan_summation,
    stochastic_round,
    stochastic_rounding,
)

__all__ = [
    "CameLearningRateState",
    "Compression",
    "KahanSummationState",
    "ParamGroup",
    "ParamGroupsState",
    "ScalarOrSchedule",
    "ScaleByCameState",
    "Stacks",
    "StochasticRoundingState",
    "came",
    "count_samples",
    "kahan_summation",
    "lr_schedule",
    "param_group_labels",
    "param_groups",
    "scale_by_came",
    "stochastic_round",
    "stochastic_rounding",
    "weight_decay_schedule",
]
