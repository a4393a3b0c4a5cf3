"""mpscale: mixed-precision and parallel training pieces for JAX, as Optax transforms.

This package is the library: Optax transforms, the precision policy, norms, CAME, the
pipeline and the train step. The trainer built on it (configs, data, the tiny LM,
checkpoints, logs, the ``mpscale`` command) is the subpackage `mpscale.trainer`; no
module of the library imports it.
"""

from mpscale import _versions

_versions.check()


from mpscale.came import CameLearningRateState, ScaleByCameState, came, scale_by_came
from mpscale.skip import SkipNonfiniteState, skip_nonfinite
from mpscale.spikes import SkipSpikesState, skip_spikes
from mpscale.gradients import Gradients
from mpscale import fp8, keys
from mpscale.fp8 import (
    OVERWRITE_WITH_GRADIENT,
    Fp8Meta,
    Fp8Recipe,
    Fp8State,
    fp8_dot_general,
    fp8_recipe,
    fp8_state,
    join_overwrite,
    split_overwrite,
)
from mpscale.loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    fixed_loss_scale,
    loss_scale_for,
    loss_scale_of,
    no_loss_scale,
    scale_loss,
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
from mpscale.parameter_groups import ParamGroup, ParamGroupsState, param_groups
from mpscale.pipeline import (Pipeline, SplitPipeline, bubble_fraction, schedule_chunks,
                              schedule_table, stage_groups)
from mpscale.schedules import count_samples, lr_schedule, weight_decay_schedule
from mpscale.sharding import flax_specs, fsdp_specs, logical_specs
from mpscale.policy import Policy, default_keep_fp32, get_policy, keep_fp32_by_name
from mpscale.rounding import (KahanSummationState, StochasticRoundingState,
                              kahan_summation, stochastic_round, stochastic_rounding)
from mpscale.train_step import TrainState, accumulate_gradients, make_train_step
from mpscale.validation import ArgumentError, ArgumentTypeError

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CameLearningRateState",
    "ClipByGlobalNormState",
    "Fp8Meta",
    "Fp8Recipe",
    "Fp8State",
    "Gradients",
    "KahanSummationState",
    "LeafSquares",
    "LossScaleState",
    "OVERWRITE_WITH_GRADIENT",
    "ParamGroup",
    "ParamGroupsState",
    "Pipeline",
    "Policy",
    "ScaleByCameState",
    "SkipNonfiniteState",
    "SkipSpikesState",
    "SplitPipeline",
    "StochasticRoundingState",
    "TrainState",
    "accumulate_gradients",
    "bubble_fraction",
    "came",
    "clip_by_global_norm",
    "default_keep_fp32",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "flax_specs",
    "fp8_dot_general",
    "fp8_recipe",
    "fp8_state",
    "fsdp_specs",
    "get_policy",
    "global_norm",
    "group_norms",
    "join_overwrite",
    "kahan_summation",
    "keep_fp32_by_name",
    "logical_specs",
    "loss_scale_for",
    "loss_scale_of",
    "count_samples",
    "lr_schedule",
    "make_train_step",
    "no_loss_scale",
    "param_groups",
    "scale_by_came",
    "scale_loss",
    "skip_nonfinite",
    "skip_spikes",
    "split_overwrite",
    "schedule_chunks",
    "schedule_table",
    "stage_groups",
    "stochastic_round",
    "stochastic_rounding",
    "step_metrics",
    "weight_decay_schedule",
    "with_loss_scale",
]
