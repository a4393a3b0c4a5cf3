"""mpscale: mixed-precision and parallel training pieces for JAX, as Optax transforms.

This package is the library. Its rooms, each one concern, from the bottom up:

- `mpscale.precision`: precision policies and FP8 products;
- `mpscale.scaling`: loss scaling, skipping non-finite steps and spikes, and the
  gradient norms they share;
- `mpscale.optim`: CAME, learning-rate and weight-decay schedules, parameter groups,
  stochastic rounding;
- `mpscale.parallel`: layouts on a mesh, FSDP, ZeRO-1, and pipeline stages
  (`mpscale.parallel.pipeline`);
- `mpscale.experts`: mixtures of experts, their router, grouped products and expert
  parallelism;
- `mpscale.step`: `make_train_step`, gradient accumulation, the step's metrics.

Under them the core: `mpscale.validation` (argument checks and their errors),
`mpscale.keys` (a run's random keys), `mpscale.gradients` (what every gradient
source returns) and the private tree and jaxpr helpers. Every name a user needs day
to day is importable from here (``from mpscale import dynamic_loss_scale``); each
room exports its own in full (``from mpscale.parallel import tree_bytes``).

The trainer built on the library (configs, data, the tiny LM, checkpoints, logs, the
planner, the ``mpscale`` command) is the subpackage `mpscale.trainer`; no module of
the library imports it.
"""

from mpscale import _versions

_versions.check()

from mpscale import _deprecated  # noqa: E402
from mpscale import gradients, keys, validation  # noqa: E402,F401
from mpscale import experts, optim, parallel, precision, scaling, step  # noqa: E402,F401
from mpscale.gradients import Gradients  # noqa: E402
from mpscale.optim import (  # noqa: E402
    CameLearningRateState,
    KahanSummationState,
    ParamGroup,
    ParamGroupsState,
    ScaleByCameState,
    Stacks,
    StochasticRoundingState,
    came,
    count_samples,
    kahan_summation,
    lr_schedule,
    param_groups,
    scale_by_came,
    stochastic_round,
    stochastic_rounding,
    weight_decay_schedule,
)
from mpscale.parallel import (  # noqa: E402
    Pipeline,
    SplitPipeline,
    flax_specs,
    fsdp_specs,
    logical_specs,
    pipeline_bubble_fraction,
    pipeline_schedule_chunks,
    pipeline_schedule_table,
    stage_norm_groups,
)
from mpscale.precision import (  # noqa: E402
    OVERWRITE_WITH_GRADIENT,
    Fp8Meta,
    Fp8Recipe,
    Fp8State,
    Policy,
    default_keep_fp32,
    fp8_dot_general,
    fp8_state,
    join_overwrite,
    keep_fp32_by_name,
    make_fp8_recipe,
    make_policy,
    split_overwrite,
)
from mpscale.scaling import (  # noqa: E402
    GlobalNormClipState,
    LeafSquares,
    LossScaleState,
    SkipNonfiniteState,
    SkipSpikesState,
    dynamic_loss_scale,
    fixed_loss_scale,
    global_norm,
    global_norm_clip,
    group_norms,
    loss_scale_of,
    no_loss_scale,
    policy_loss_scale,
    scale_loss,
    skip_nonfinite,
    skip_spikes,
    with_loss_scale,
)
from mpscale.step import (  # noqa: E402
    TrainState,
    accumulate_gradients,
    make_train_step,
    step_metrics,
)
from mpscale.validation import ArgumentError, ArgumentTypeError  # noqa: E402

__version__ = "0.1.0"

_deprecated.install_finder()


def __getattr__(name: str):
  """A name or module path that moved or was renamed (`mpscale._deprecated`)."""
  return _deprecated.name(name)


__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CameLearningRateState",
    "Fp8Meta",
    "Fp8Recipe",
    "Fp8State",
    "GlobalNormClipState",
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
    "Stacks",
    "SkipNonfiniteState",
    "SkipSpikesState",
    "SplitPipeline",
    "StochasticRoundingState",
    "TrainState",
    "accumulate_gradients",
    "came",
    "count_samples",
    "default_keep_fp32",
    "dynamic_loss_scale",
    "fixed_loss_scale",
    "flax_specs",
    "fp8_dot_general",
    "fp8_state",
    "fsdp_specs",
    "global_norm",
    "global_norm_clip",
    "group_norms",
    "join_overwrite",
    "kahan_summation",
    "keep_fp32_by_name",
    "logical_specs",
    "loss_scale_of",
    "lr_schedule",
    "make_fp8_recipe",
    "make_policy",
    "make_train_step",
    "no_loss_scale",
    "param_groups",
    "pipeline_bubble_fraction",
    "pipeline_schedule_chunks",
    "pipeline_schedule_table",
    "policy_loss_scale",
    "scale_by_came",
    "scale_loss",
    "skip_nonfinite",
    "skip_spikes",
    "split_overwrite",
    "stage_norm_groups",
    "stochastic_round",
    "stochastic_rounding",
    "step_metrics",
    "weight_decay_schedule",
    "with_loss_scale",
]
