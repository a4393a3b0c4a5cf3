"""From a `RunConfig` to the pieces of a run: model, policy, optimizer, mesh, step.

Data flows one way: the config's schema (`mpscale.trainer.config.schema`) -> these
builders -> the training loop (`mpscale.trainer.runs.loop`);
`mpscale.trainer.config.load` builds the pieces once on shapes, with `check`, when it
loads a config::

  policy    = make_policy(precision.policy)
  optimizer = <loss_scale.kind>_loss_scale(chain(global_norm_clip(clip.max_norm),
                                                 <optimizer.name>(lr_schedule, wd),
                                                 <precision.update_rounding>))
              # the rounding only for stochastic (stochastic_rounding) or kahan
              # skip.spikes: skip_spikes(chain(...)) inside the loss scaling
  mesh      = Mesh(devices, ("data", "fsdp", "stage", "tensor"))   # axes > 1, and data
  model     = TinyLM.from_sizes(model, recompute=train.recompute, fp8=<precision.fp8>)
              # FP8 blocks: their scaling state is the TrainState's model_state
  specs     = model.param_specs(mesh)            # tensor and FSDP splits, if any
  loss      = TinyLM.loss_fn  or  Pipeline(embed_fn, stage_fn, head_fn) if stage > 1
  init, step = make_train_step(loss, optimizer, policy=policy, mesh=mesh,
                               data_axis=("data", "fsdp"), param_specs=specs, ...)

A builder's error is a `mpscale.validation.ArgumentError` (a ``ValueError``; also a
``TypeError`` for a wrong type) whose ``names`` are config keys, the one at fault first,
and whose message names them, e.g. ``loss_scale.backoff_factor must be in (0, 1)``
or ``precision.policy: unknown policy 'O7'``. The constructors' own errors name their
arguments; the builders rename them to the keys that feed them
(`mpscale.trainer.config.errors.keyed`), and never read an error's text.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding
import numpy as np
import optax

from mpscale import _tree
from mpscale import experts as experts_lib
from mpscale import gradients as gradients_lib
from mpscale import optim as optim_lib
from mpscale import parallel as parallel_lib
from mpscale import precision as precision_lib
from mpscale import scaling as scaling_lib
from mpscale import step as step_lib
from mpscale import validation
from mpscale.trainer.config import errors
from mpscale.trainer.config import schema
from mpscale.trainer.data import batch_sizes as batch_sizes_lib
from mpscale.trainer.hf import checkpoint as hf
from mpscale.trainer.models import lm as lm_lib
from mpscale.trainer.models import user as models_lib

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
FSDP_TRANSPOSE_AXIS = "fsdp_transpose"
STAGE_AXIS = "stage"
CONTEXT_AXIS = parallel_lib.CONTEXT_AXIS
TENSOR_AXIS = "tensor"
EXPERT_AXIS = experts_lib.EXPERT_AXIS
MESH_AXES = (DATA_AXIS, FSDP_AXIS, FSDP_TRANSPOSE_AXIS, STAGE_AXIS, CONTEXT_AXIS,
             EXPERT_AXIS, TENSOR_AXIS)


def build_policy(cfg: schema.RunConfig) -> precision_lib.Policy:
  """The precision policy named by ``precision.policy``."""
  return errors.keyed("precision.policy",
                      lambda: precision_lib.make_policy(cfg.precision.policy))


def build_grad_reduce_dtype(cfg: schema.RunConfig) -> Any:
  """``precision.grad_reduce_dtype``, checked: ``None`` or float32
  (`mpscale.gradients.check_grad_reduce_dtype`)."""
  return errors.keyed("precision.grad_reduce_dtype",
                      lambda: gradients_lib.check_grad_reduce_dtype(
                    cfg.precision.grad_reduce_dtype))


def build_update_rounding(cfg: schema.RunConfig
                          ) -> Optional[optax.GradientTransformation]:
  """The transform ``precision.update_rounding`` names, for the end of the optimizer
  chain: `mpscale.stochastic_rounding` keyed by `rounding_key` (``stochastic``),
  `mpscale.kahan_summation` (``kahan``), or ``None`` (``nearest``: plain
  ``optax.apply_updates``).

  Raises:
    ArgumentError: naming ``precision.update_rounding`` for another value.
  """
  kind = validation.one_of("precision.update_rounding",
                           cfg.precision.update_rounding,
                           typing.get_args(schema.UpdateRounding))
  if kind == "stochastic":
    return optim_lib.stochastic_rounding(rounding_key(cfg))
  if kind == "kahan":
    return optim_lib.kahan_summation()
  return None


def build_fp8(cfg: schema.RunConfig) -> Optional[precision_lib.Fp8Recipe]:
  """The `mpscale.Fp8Recipe` of ``precision.fp8`` (``None`` where its ``recipe`` is
  null).

  Raises:
    ArgumentError: naming the ``precision.fp8`` key at fault: an unknown recipe or
      ``amax_compute``, a ``history_len`` < 1, a negative ``margin``. (A user's
      model, ``model.provider``, builds its own FP8 layers: its provider gets the
      config and may call this; `build` checks that it keeps an FP8 state.)
  """
  fp8 = cfg.precision.fp8
  if fp8.recipe is None:
    return None
  recipe = errors.keyed("precision.fp8", lambda: precision_lib.make_fp8_recipe(
      fp8.recipe, history_len=fp8.history_len, margin=fp8.margin,
      amax_compute=fp8.amax_compute), errors.fields("precision.fp8", fp8))
  return recipe


def check_user_fp8(cfg: schema.RunConfig, model: Any) -> None:
  """A user's model under ``precision.fp8``: it must keep FP8 scaling state (an
  ``_overwrite_with_gradient`` collection of `mpscale.Fp8State`, as
  `mpscale.precision.fp8_flax`'s layers make), which its provider builds from the config
  (`build_fp8`); a model without one would train without FP8 while the config says
  FP8.

  Raises:
    ArgumentError: naming ``precision.fp8.recipe`` and ``model.provider``.
  """
  init_state = getattr(model, "init_state", None)
  state = None if init_state is None else jax.eval_shape(init_state,
                                                         jax.random.key(cfg.seed))
  collection = (state.get(precision_lib.OVERWRITE_WITH_GRADIENT)
                if isinstance(state, Mapping) else None)
  found = [x for x in jax.tree_util.tree_leaves(
      collection, is_leaf=lambda x: isinstance(x, precision_lib.Fp8State))
           if isinstance(x, precision_lib.Fp8State)]
  if not found:
    raise validation.ArgumentError(
        ("precision.fp8.recipe", "model.provider"),
        f"{{0}} ({cfg.precision.fp8.recipe}) is set, but the user's model ({{1}}) "
        "keeps no FP8 scaling state: build its layers with mpscale.precision.fp8_flax's FP8 "
        "products (the provider gets the config: "
        "mpscale.trainer.config.build.build_fp8(config) is its recipe), or set "
        "{0}: null")


def build_model(cfg: schema.RunConfig, mesh: Optional[Mesh] = None,
                devices: Optional[Sequence[Any]] = None) -> lm_lib.TinyLM:
  """The tiny LM with ``model`` sizes, ``train.recompute`` and
  ``train.recompute_layers``, and ``precision.fp8``
  (`build_fp8`); on a mesh with ``fsdp`` or
  ``tensor`` axes its activations are laid out for them (``mesh.sequence_parallel``).
  Its attention is ``model.attention`` for the devices it runs on: the mesh's, else
  the first of ``devices`` (default ``jax.devices()``; none when empty, as when a
  config is checked on shapes, or on an abstract mesh).
  """
  policy = build_policy(cfg)
  if isinstance(mesh, Mesh):
    device = mesh.devices.flat[0]
  elif mesh is None:
    device = next(iter(jax.devices() if devices is None else devices), None)
  else:
    device = None
  head_dim = cfg.model.head_dim or (cfg.model.d_model // cfg.model.num_heads
                                    if cfg.model.num_heads else 0)
  attention = errors.keyed("model", lambda: lm_lib.attention_for(
      cfg.model.attention, device, policy.compute_dtype, head_dim),
                           {"attention": "model.attention"})
  shard = None
  if mesh is not None and any(a in mesh.axis_names
                              for a in (FSDP_AXIS, CONTEXT_AXIS, EXPERT_AXIS,
                                        TENSOR_AXIS)):
    shard = errors.keyed("model", lambda: lm_lib.ActivationSharding(
        mesh, batch_axes=data_axes(mesh), tensor_axis=TENSOR_AXIS,
        sequence_parallel=cfg.mesh.sequence_parallel, context_axis=CONTEXT_AXIS,
        context_parallel=cfg.model.context_parallel),
                         {"context_parallel": "model.context_parallel"})
  fp8 = build_fp8(cfg)
  return errors.keyed("model", lambda: lm_lib.TinyLM.from_sizes(
      cfg.model, remat=cfg.train.remat, recompute=cfg.train.recompute,
      recompute_layers=cfg.train.recompute_layers, shard=shard,
      attention=attention, fp8=fp8, fp8_products=cfg.precision.fp8.products,
      bf16_layers=cfg.precision.fp8.bf16_layers),
                      errors.fields("model", cfg.model, remat="train.remat",
                                    recompute="train.recompute",
                                    recompute_layers="train.recompute_layers",
                                    fp8_products="precision.fp8.products",
                                    bf16_layers="precision.fp8.bf16_layers"))


def data_axes(mesh: Optional[Mesh]) -> tuple[str, ...]:
  """The trainer's choice of the mesh axes the batch is split over: ``data``, and
  ``fsdp`` (with ``fsdp_transpose``, `fsdp_transpose`) and ``expert`` when present
  (taken from the mesh's own axes, so there is nothing to check; `make_train_step`
  checks them with `mpscale.parallel.data_axes`); ``("data",)`` without a mesh.
  Outside the experts, the expert axis is one more data axis."""
  if mesh is None:
    return (DATA_AXIS,)
  return tuple(a for a in (DATA_AXIS, FSDP_AXIS, FSDP_TRANSPOSE_AXIS, EXPERT_AXIS)
               if a in mesh.axis_names)


def batch_sharding(mesh: Optional[Mesh]) -> Optional[NamedSharding]:
  """How a global batch lies on ``mesh``: its rows split over `data_axes`
  (`mpscale.parallel.batch_sharding`); ``None`` without a mesh."""
  return (None if mesh is None
          else parallel_lib.batch_sharding(mesh, data_axes(mesh)))


def build_param_specs(cfg: schema.RunConfig, model: lm_lib.TinyLM,
                      mesh: Optional[Mesh]) -> Any:
  """The params' PartitionSpecs (`TinyLM.param_specs`) when ``mesh.fsdp``,
  ``mesh.context`` or ``mesh.tensor`` split them; ``None`` (replicated, or split by
  stage only) else. The context axis splits them as FSDP does (Megatron's
  distributed optimizer spans its data and context groups alike): each device's
  tokens are a slice of the sequences, so the weights, gathered a layer at a time,
  need not be whole on each."""
  if mesh is None or (cfg.mesh.fsdp == 1 and cfg.mesh.tensor == 1
                      and cfg.mesh.context == 1 and cfg.mesh.expert == 1):
    return None
  return errors.keyed("mesh", lambda: model.param_specs(
      mesh, fsdp_axis=(FSDP_AXIS, CONTEXT_AXIS), pad=pads_unevenly(cfg),
      transpose_axis=FSDP_TRANSPOSE_AXIS), errors.fields("model", cfg.model))


def pads_unevenly(cfg: schema.RunConfig) -> bool:
  """Whether FSDP splits a parameter whose dimensions ``mesh.fsdp`` does not
  divide, stored padded (`mpscale.parallel.Padded`): where the step can
  (`mpscale.step.unpaddable`: no pipeline, no context axis); else such a
  parameter stays replicated over ``fsdp``."""
  return step_lib.unpaddable(cfg.mesh.stage > 1, cfg.mesh.context) is None


def fsdp_transpose(cfg: schema.RunConfig,
                   model: Optional[models_lib.Model] = None) -> int:
  """How many of ``mesh.fsdp``'s devices the mesh lays out as a second FSDP axis,
  ``fsdp_transpose`` (MaxText's), splitting each parameter on another dimension
  than ``fsdp`` does (`mpscale.parallel.split_across`); 1: none.

  Where ``mesh.fsdp`` divides every parameter's dimension it splits, there is none.
  Where it pads some (`pads_unevenly`), the factor of ``mesh.fsdp`` that leaves a
  device the fewest elements (padding included; the smallest factor of those tied):
  on 1,120 GPUs a 530B GPT's weights pad by 0.004% over ``fsdp 160 x
  fsdp_transpose 7`` where they pad by 1.17% over one axis of 1,120. The batch is
  split over both axes in the same order, so each device's rows are the same.

  Args:
    cfg: the run.
    model: a user's model (its ``init`` and ``param_specs``); default the built-in.
  """
  n = cfg.mesh.fsdp
  if n == 1 or not pads_unevenly(cfg):
    return 1
  init = build_model(cfg, abstract_mesh(cfg), ()).init if model is None else model.init
  shapes = jax.tree_util.tree_leaves(jax.eval_shape(init, jax.random.key(cfg.seed)))

  def held(transpose):  # (elements a device holds, whether any leaf is padded)
    mesh = abstract_mesh(cfg, transpose)
    specs = (user_param_specs(cfg, model, mesh) if model is not None
             else build_param_specs(cfg, build_model(cfg, mesh, ()), mesh))
    count, padded = 0, False
    for x, spec in zip(shapes,
                       jax.tree_util.tree_leaves(specs, is_leaf=parallel_lib.is_spec)):
      stored = parallel_lib.padded_shape(x.shape, spec, mesh)
      count += math.prod(stored) // parallel_lib.axis_size(
          mesh, parallel_lib.spec_axes(spec))
      padded |= stored != tuple(x.shape)
    return count, padded

  count, padded = held(1)
  if not padded:
    return 1
  counts = {1: count, **{t: held(t)[0] for t in range(2, n) if n % t == 0}}
  return min(counts, key=lambda t: (counts[t], t))


def build_batch_sizes(cfg: schema.RunConfig) -> batch_sizes_lib.BatchSizes:
  """The global batch size of each step: ``data.batch_size``, after
  ``data.rampup_batch_size``'s ramp-up (`mpscale.trainer.data.batch_sizes.BatchSizes`).

  Raises:
    ArgumentError: naming ``data.rampup_batch_size`` for a ramp that does not climb
      to ``data.batch_size`` in whole increments, or one without ``train.samples``
      (as Megatron-LM, which ramps up sample-based runs only).
  """
  data = cfg.data
  if data.rampup_batch_size is not None and cfg.train.samples is None:
    raise validation.ArgumentError(
        ("data.rampup_batch_size", "train.samples"), "{0} needs {1}: a ramp-up is "
        "counted in samples, so the run is too (set {1}; train.steps follows)")
  return errors.keyed(
      "data.rampup_batch_size",
      lambda: batch_sizes_lib.BatchSizes(data.batch_size, data.rampup_batch_size),
      {"batch_size": "data.batch_size", "rampup": "data.rampup_batch_size"})


def train_steps(cfg: schema.RunConfig) -> int:
  """The steps of the run: ``train.steps``, or with ``train.samples`` the steps
  that consume them (`mpscale.trainer.data.batch_sizes.BatchSizes.steps_for`).

  Raises:
    ArgumentError: naming ``train.samples`` (or the batch keys, `build_batch_sizes`).
  """
  if cfg.train.samples is None:
    return cfg.train.steps
  sizes = build_batch_sizes(cfg)
  return errors.keyed("train.samples", lambda: sizes.steps_for(cfg.train.samples),
                      {"samples": "train.samples"})


def counts_samples(cfg: schema.RunConfig) -> bool:
  """Whether the learning rate is a function of the samples consumed:
  ``train.samples``, ``schedule.warmup_samples`` or ``schedule.decay_samples`` set
  (Megatron's sample-based training)."""
  s = cfg.schedule
  return (cfg.train.samples is not None or s.warmup_samples is not None
          or s.decay_samples is not None)


def _sample_schedule_keys(cfg: schema.RunConfig) -> None:
  """A schedule counted in samples takes no step counts (Megatron refuses
  ``lr_warmup_iters``/``lr_decay_iters`` in sample-based training)."""
  s = cfg.schedule
  mode = next(key for key, value in (
      ("schedule.warmup_samples", s.warmup_samples),
      ("schedule.decay_samples", s.decay_samples), ("train.samples", cfg.train.samples))
              if value is not None)
  for key, given, instead in (
      ("schedule.warmup_steps", s.warmup_steps != 0, "schedule.warmup_samples"),
      ("schedule.decay_steps", s.decay_steps is not None, "schedule.decay_samples")):
    if given:
      raise validation.ArgumentError(
          (key, mode), f"{{0}} counts steps, but {{1}} makes the schedule count "
          f"samples: give {instead} instead")
  if s.warmup_samples is not None and s.warmup_fraction is not None:
    raise validation.ArgumentError(
        ("schedule.warmup_samples", "schedule.warmup_fraction"),
        "give {0} or {1}, not both")


def build_lr_schedule(cfg: schema.RunConfig) -> Optional[optax.Schedule]:
  """``schedule`` applied to ``optimizer.learning_rate`` (`mpscale.lr_schedule`);
  ``None`` for CAME without a learning rate (``optimizer.learning_rate: null``: its
  relative step, `mpscale.came`'s ``relative_step``).

  Counted in samples (`counts_samples`), it is Megatron's sample-based schedule:
  ``lr_schedule(peak, warmup_steps=warmup_samples, decay_steps=decay_samples)`` of
  the samples the applied steps consumed before the update, which
  `build_inner_optimizer` counts with `mpscale.count_samples` (Megatron's scheduler
  steps by each applied step's batch size), so a batch-size ramp-up warms up by
  samples, not steps, and a skipped step moves nothing.

  Raises:
    ArgumentError: naming ``optimizer.learning_rate`` when it is null for an
      optimizer other than CAME; naming a step key and a sample key that are mixed.
  """
  if cfg.optimizer.learning_rate is None:
    if cfg.optimizer.name == "came":
      return None  # optim_lib.came() checks that relative_step is on
    raise validation.ArgumentError(
        ("optimizer.learning_rate", "optimizer.name"),
        "{0} is null, which only CAME takes (with optimizer.came.relative_step: "
        f"true); {{1}} {cfg.optimizer.name!r} needs a learning rate")
  s = cfg.schedule
  if counts_samples(cfg):
    return _sample_schedule(cfg)
  decay_steps = cfg.train.steps if s.decay_steps is None else s.decay_steps
  keys = errors.fields("schedule", s, peak="optimizer.learning_rate")
  if s.decay_steps is None:
    keys["decay_steps"] = "train.steps"
  return errors.keyed("schedule", lambda: optim_lib.lr_schedule(
      cfg.optimizer.learning_rate, warmup_steps=s.warmup_steps,
      warmup_fraction=s.warmup_fraction, decay_steps=decay_steps, style=s.style,
      min_lr=s.min_lr), keys)


def _sample_schedule(cfg: schema.RunConfig) -> optax.Schedule:
  """`build_lr_schedule` counted in samples."""
  _sample_schedule_keys(cfg)
  s, sizes = cfg.schedule, build_batch_sizes(cfg)
  keys = errors.fields("schedule", s, peak="optimizer.learning_rate",
                       warmup_steps="schedule.warmup_samples",
                       decay_steps="schedule.decay_samples")
  decay = s.decay_samples
  if decay is None:  # Megatron's lr_decay_samples default: train_samples
    decay = (cfg.train.samples if cfg.train.samples is not None
             else sizes.consumed_at(cfg.train.steps))
    keys["decay_steps"] = ("train.samples" if cfg.train.samples is not None
                           else "train.steps")
  return errors.keyed("schedule", lambda: optim_lib.lr_schedule(
      cfg.optimizer.learning_rate, warmup_steps=s.warmup_samples or 0,
      warmup_fraction=s.warmup_fraction, decay_steps=decay, style=s.style,
      min_lr=s.min_lr), keys)


def build_weight_decay(cfg: schema.RunConfig) -> Any:
  """``optimizer.weight_decay``, or a schedule to ``schedule.weight_decay_end``
  over ``train.steps``; in a sample-counted run (`counts_samples`) over the run's
  samples, counted as the learning rate is (Megatron's ``wd_incr_steps`` is
  ``train_samples`` there)."""
  start, end = cfg.optimizer.weight_decay, cfg.schedule.weight_decay_end
  if end is None:
    return validation.non_negative_float("optimizer.weight_decay", start)
  keys = {"start": "optimizer.weight_decay", "end": "schedule.weight_decay_end",
          "steps": "train.steps", "style": "schedule.weight_decay_style"}
  total = cfg.train.steps
  if counts_samples(cfg):
    total = (cfg.train.samples if cfg.train.samples is not None
             else build_batch_sizes(cfg).consumed_at(cfg.train.steps))
    keys["steps"] = "train.samples" if cfg.train.samples is not None else "train.steps"
  return errors.keyed("schedule", lambda: optim_lib.weight_decay_schedule(
      start, end, total, style=cfg.schedule.weight_decay_style), keys)


def weight_decay_mask(kind: str) -> Optional[Callable[[Any], Any]]:
  """``"matrices"``: decay every leaf but biases and norm scales; ``"all"``: ``None``."""
  if kind == "all":
    return None

  def mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _tree.path_str(path[-1:]) not in ("bias", "scale"), params)

  return mask


def _scheduled(value: Any) -> Callable[[Any], Any]:
  return value if callable(value) else (lambda count: value)


def optimizer_factory(cfg: schema.RunConfig) -> Callable[..., Any]:
  """``make(learning_rate, weight_decay, mask)``: the optimizer ``optimizer.name``
  with its sub-section's settings (no clip or scale); its errors name the library's
  arguments (`build_inner_optimizer` renames them to keys).

  The weight decay is decoupled and multiplied by the learning rate for all three
  (``p -= lr * (update + wd * p)``); Adafactor's own ``weight_decay_rate`` is not, so
  it gets ``lr * wd``. AdamW and Adafactor are wrapped in ``optax.inject_hyperparams``
  so the metrics report their learning rate (CAME records its own), with float32
  hyperparameters whatever the parameters' dtype (inferred from float16 parameters,
  AdamW's ``eps`` of 1e-8 would round to 0 and divide 0 by 0). AdamW's first moment
  is kept in the parameters' dtype (``precision.policy``'s), as its second is: left
  to optax it would turn float32 at the first float32 gradient, so 16-bit
  parameters' state changed dtype after one step and the step compiled twice.
  """
  opt = cfg.optimizer
  if opt.name == "came":
    c = opt.came

    def make(learning_rate, weight_decay, mask):
      return optim_lib.came(
          learning_rate, eps=c.eps, clip_threshold=c.clip_threshold,
          decay_rate=c.decay_rate, beta1=c.beta1, beta2=c.beta2, beta3=c.beta3,
          weight_decay=weight_decay, scale_parameter=c.scale_parameter,
          relative_step=c.relative_step, warmup_init=c.warmup_init,
          compression=c.compression, mask=mask, stack_layers=c.stack_layers)
    return make
  if opt.name == "adamw":
    adamw = opt.adamw
    mu_dtype = build_policy(cfg).param_dtype

    def make(learning_rate, weight_decay, mask):
      return optax.inject_hyperparams(
          optax.adamw, static_args=("mask", "mu_dtype"), hyperparam_dtype=jnp.float32)(
              learning_rate=learning_rate, b1=adamw.b1, b2=adamw.b2, eps=adamw.eps,
              weight_decay=weight_decay, mask=mask, mu_dtype=mu_dtype)
    return make
  if opt.name == "adafactor":
    adafactor = opt.adafactor

    def make(learning_rate, weight_decay, mask):
      lr_fn, wd_fn = _scheduled(learning_rate), _scheduled(weight_decay)
      return optax.inject_hyperparams(
          optax.adafactor, static_args=(
              "min_dim_size_to_factor", "multiply_by_parameter_scale", "momentum",
              "dtype_momentum", "factored", "weight_decay_mask"),
          hyperparam_dtype=jnp.float32)(
              learning_rate=learning_rate,
              min_dim_size_to_factor=adafactor.min_dim_size_to_factor,
              decay_rate=adafactor.decay_rate,
              multiply_by_parameter_scale=adafactor.multiply_by_parameter_scale,
              clipping_threshold=adafactor.clipping_threshold,
              momentum=adafactor.momentum, eps=adafactor.eps,
              weight_decay_rate=lambda n: lr_fn(n) * wd_fn(n),
              weight_decay_mask=mask)
    return make
  raise validation.fail("optimizer.name", f": unknown optimizer {opt.name!r}")


def _param_groups(cfg: schema.RunConfig) -> list[optim_lib.ParamGroup]:
  """``optimizer.groups`` as `mpscale.ParamGroup`s: a group that sets its weight
  decay applies it to every parameter it holds (no ``weight_decay_mask``)."""
  groups = []
  for i, g in enumerate(cfg.optimizer.groups):
    if not g.match:
      raise validation.fail(f"optimizer.groups[{i}].match", " is missing: each group "
                            "needs a regular expression of the parameters it holds")
    groups.append(optim_lib.ParamGroup(
        g.match, lr_mult=g.lr_mult, weight_decay=g.weight_decay, name=g.name,
        options={} if g.weight_decay is None else {"mask": None}))
  return groups


def build_inner_optimizer(cfg: schema.RunConfig) -> optax.GradientTransformation:
  """The optimizer named by ``optimizer.name``, with its schedules (no clip or scale)
  (`optimizer_factory`), and ``optimizer.groups`` (`mpscale.param_groups`)."""
  opt = cfg.optimizer
  lr = build_lr_schedule(cfg)
  wd = build_weight_decay(cfg)
  mask = weight_decay_mask(opt.weight_decay_mask)
  make = optimizer_factory(cfg)
  section = f"optimizer.{opt.name}"
  keys = errors.fields(section, getattr(opt, opt.name),
                       learning_rate="optimizer.learning_rate",
                       weight_decay="optimizer.weight_decay",
                       mask="optimizer.weight_decay_mask", groups="optimizer.groups")
  if not opt.groups:
    inner = errors.keyed(section, lambda: make(lr, wd, mask), keys)
  else:
    groups = _param_groups(cfg)
    inner = errors.keyed(section, lambda: optim_lib.param_groups(
        make, groups, learning_rate=lr, weight_decay=wd, mask=mask), keys)
  # Megatron's scheduler steps by each applied step's samples.
  return optim_lib.count_samples(inner) if counts_samples(cfg) else inner


def check_param_groups(cfg: schema.RunConfig, param_shapes: Any) -> None:
  """Each of ``optimizer.groups`` matches some parameter of ``param_shapes``.

  Raises:
    ArgumentError: naming ``optimizer.groups[i].match`` of one that matches none.
  """
  if cfg.optimizer.groups:
    groups = _param_groups(cfg)
    errors.keyed("optimizer.groups",
                 lambda: optim_lib.param_group_labels(param_shapes, groups),
                 {"groups": "optimizer.groups"})


def build_groups(cfg: schema.RunConfig) -> scaling_lib.NormGroups:
  """The groups of the logged norms: ``clip.groups`` depth, or per pipeline stage."""
  if cfg.clip.groups is not None:
    return cfg.clip.groups
  if cfg.mesh.stage > 1:  # one group per (virtual) stage, stored in device order
    return parallel_lib.stage_norm_groups(cfg.mesh.stage,
                                     virtual_stages=cfg.mesh.virtual_stages,
                                     layer_order="device")
  return None


DEFAULT_SCALE = 2.0**15
"""The first loss scale of a mean loss (jmp's, PyTorch's ``GradScaler``'s 2^16 / 2)."""


def micro_batch_tokens(cfg: schema.RunConfig, batch: Any = None) -> int:
  """How many tokens one micro-batch's per-token loss sums at most: the built-in
  LM's rows x ``model.seq_len``; a user's batch's smallest array (``[rows, seq]``
  for a language model's ids or mask, ``[rows]`` for a classifier's labels), over
  ``train.num_microbatches``."""
  if batch is None:
    tokens = cfg.data.batch_size * cfg.model.seq_len
  else:
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(batch)
             if np.ndim(x) >= 1]
    tokens = min(sizes) if sizes else 1
  return max(1, tokens // max(1, cfg.train.num_microbatches))


def initial_scale(cfg: schema.RunConfig, per_token: bool, tokens: int) -> float:
  """``loss_scale.init_scale``, or when it is ``null``: `DEFAULT_SCALE` for a mean
  loss, and for a per-token loss (a sum over ``tokens``) `DEFAULT_SCALE` over
  ``tokens`` rounded up to a power of two, at least ``loss_scale.min_scale``: the
  sum's weight gradients are ``tokens`` times the mean's (issue #42: a user's LM of
  2,048 tokens a batch skipped its first 9 steps from 2^15)."""
  given = cfg.loss_scale.init_scale
  if given is not None:
    return given
  if not per_token:
    return DEFAULT_SCALE
  return max(DEFAULT_SCALE / 2.0 ** math.ceil(math.log2(max(tokens, 1))),
             cfg.loss_scale.min_scale)


def with_initial_scale(cfg: schema.RunConfig, per_token: bool,
                       tokens: int) -> schema.RunConfig:
  """``cfg`` with ``loss_scale.init_scale`` set (`initial_scale`): what a run folder's
  ``config.yaml`` keeps, so a resumed run starts from the same numbers."""
  if cfg.loss_scale.init_scale is not None:
    return cfg
  return dataclasses.replace(cfg, loss_scale=dataclasses.replace(
      cfg.loss_scale, init_scale=initial_scale(cfg, per_token, tokens)))


def build_optimizer(cfg: schema.RunConfig) -> optax.GradientTransformation:
  """Loss scaling around ``chain(global_norm_clip, optimizer, update rounding)``
  (the rounding `build_update_rounding`, where there is one), with ``skip_spikes``
  between the two when ``skip.spikes`` is set (it judges the unscaled, unclipped
  gradients and the loss). A skipped step keeps the rounding's state too."""
  groups = build_groups(cfg)
  inner = build_inner_optimizer(cfg)
  rounding = build_update_rounding(cfg)
  if rounding is not None:
    inner = optax.chain(inner, rounding)
  if cfg.clip.max_norm:  # null or 0: no clipping
    inner = optax.chain(errors.keyed("clip", lambda: scaling_lib.global_norm_clip(
        cfg.clip.max_norm, norm_groups=groups), errors.fields("clip", cfg.clip)), inner)
  spikes = cfg.skip.spikes
  if spikes is not None:
    inner = errors.keyed("skip.spikes", lambda: scaling_lib.skip_spikes(
        inner, window=spikes.window, threshold=spikes.threshold,
        warmup=spikes.warmup, watch=spikes.watch, reset_after=spikes.reset_after),
                         errors.fields("skip.spikes", spikes))
  loss_scale = cfg.loss_scale
  if loss_scale.init_scale is None:  # the built-in model's, when no one resolved it
    loss_scale = dataclasses.replace(loss_scale, init_scale=initial_scale(
        cfg, cfg.train.per_token_loss, micro_batch_tokens(cfg)))
  keys = errors.fields("loss_scale", loss_scale, scale="loss_scale.init_scale")
  if loss_scale.kind == "dynamic":
    return errors.keyed("loss_scale", lambda: scaling_lib.dynamic_loss_scale(
        inner, init_scale=loss_scale.init_scale, growth_factor=loss_scale.growth_factor,
        backoff_factor=loss_scale.backoff_factor,
        growth_interval=loss_scale.growth_interval, hysteresis=loss_scale.hysteresis,
        consecutive_hysteresis=loss_scale.consecutive_hysteresis,
        refill_after_backoff=loss_scale.refill_after_backoff,
        min_scale=loss_scale.min_scale, max_scale=loss_scale.max_scale, norm_groups=groups), keys)
  if loss_scale.kind == "fixed":
    return errors.keyed("loss_scale", lambda: scaling_lib.fixed_loss_scale(
        inner, loss_scale.init_scale, skip_nonfinite=loss_scale.skip_nonfinite,
        norm_groups=groups), keys)
  return scaling_lib.no_loss_scale(inner, norm_groups=groups)


def build_mesh(cfg: schema.RunConfig, devices: Optional[Sequence[Any]] = None,
               transpose: int = 1) -> Optional[Mesh]:
  """A mesh of ``mesh.data x fsdp x stage x context x expert x tensor`` devices, or
  ``None`` for a single device. Its axes are ``data`` and every other axis of size >
  1, in the order ``("data", "fsdp", "fsdp_transpose", "stage", "context", "expert",
  "tensor")``: ``tensor`` innermost, on the devices nearest each other, then
  ``expert`` (two all-to-alls a block each way) and ``context`` (whose ring passes a
  block a layer). ``transpose`` > 1 lays ``mesh.fsdp`` out as two axes,
  ``fsdp x fsdp_transpose`` of ``mesh.fsdp / transpose x transpose`` devices in the
  same order (`fsdp_transpose`).

  Raises:
    ArgumentError: naming ``mesh`` when there are too few devices.
  """
  mesh = cfg.mesh
  sizes = mesh_sizes(cfg, transpose)
  if mesh.num_devices == 1:
    return None
  axes = tuple(axis for axis in MESH_AXES if axis == DATA_AXIS or sizes[axis] > 1)
  devices = list(jax.devices() if devices is None else devices)
  needed = mesh.num_devices
  if len(devices) < needed:
    hint = (f"; on CPU, simulate them with --devices {needed}"
            if devices[0].platform == "cpu" else "")
    shape = " x ".join(f"{axis} {sizes[axis]}" for axis in axes)
    available = "1 is" if len(devices) == 1 else f"{len(devices)} are"
    raise validation.fail("mesh", f": {shape} needs {needed} devices, but "
                          f"{available} available{hint}")
  return Mesh(np.asarray(devices[:needed]).reshape([sizes[axis] for axis in axes]),
              axes)


def mesh_sizes(cfg: schema.RunConfig, transpose: int = 1) -> dict[str, int]:
  """Each of `MESH_AXES`' size, from ``mesh`` (``mesh.fsdp`` as ``fsdp x
  fsdp_transpose``, the latter ``transpose``)."""
  sizes = {axis: getattr(cfg.mesh, axis, 1) for axis in MESH_AXES}
  sizes[FSDP_AXIS] //= transpose
  sizes[FSDP_TRANSPOSE_AXIS] = transpose
  return sizes


def abstract_mesh(cfg: schema.RunConfig, transpose: int = 1) -> Optional[AbstractMesh]:
  """The mesh `build_mesh` makes, as a ``jax.sharding.AbstractMesh``: its axes and
  sizes, no devices (``None`` for a single device)."""
  if cfg.mesh.num_devices == 1:
    return None
  sizes = mesh_sizes(cfg, transpose)
  axes = tuple(axis for axis in MESH_AXES if axis == DATA_AXIS or sizes[axis] > 1)
  return AbstractMesh(tuple(sizes[axis] for axis in axes), axes)


def build_loss(cfg: schema.RunConfig, model: lm_lib.TinyLM) -> Any:
  """What `make_train_step` differentiates: the model's loss, or a `Pipeline`.

  With ``mesh.stage > 1`` this is ``mpscale.Pipeline(model.embed_fn, model.stage_fn,
  model.head_fn, train.num_microbatches, mesh.pipeline_schedule, train.remat,
  train.recompute, train.recompute_layers)``, its
  layers stored in device order (``layer_order="device"``: no all-to-all of the stage
  parameters with ``mesh.virtual_stages`` > 1; `Setup.to_device_order`); else
  ``model.loss_fn`` (``(loss_sum, num_tokens)``) with ``train.per_token_loss``, or
  ``model.mean_loss_fn``.
  """
  if cfg.mesh.stage > 1:
    keys = errors.fields("mesh", cfg.mesh, schedule="mesh.pipeline_schedule",
                         num_microbatches="train.num_microbatches", remat="train.remat",
                         recompute="train.recompute",
                         recompute_layers="train.recompute_layers")
    # FP8 scaling state: each micro-batch's and replica's update merged (max amax).
    merge = (None if model.fp8 is None
             else functools.partial(precision_lib.merge_stacked, recipe=model.fp8))
    return errors.keyed("mesh", lambda: parallel_lib.Pipeline(
        model.embed_fn, model.stage_fn, model.head_fn,
        num_microbatches=cfg.train.num_microbatches,
        schedule=cfg.mesh.pipeline_schedule, remat=cfg.train.remat,
        recompute=cfg.train.recompute, recompute_layers=cfg.train.recompute_layers,
        stage_axis=STAGE_AXIS, virtual_stages=cfg.mesh.virtual_stages,
        layer_order="device", num_stages=cfg.mesh.stage, merge_state=merge), keys)
  return model.loss_fn if cfg.train.per_token_loss else model.mean_loss_fn


def check(cfg: schema.RunConfig) -> None:
  """Checks ``cfg`` by building it on shapes: `build` with ``abstract=True``, so the
  same code checks a config and builds its run. Nothing is placed or allocated, no
  device is needed (the mesh is abstract), and a provider (``model.provider``,
  ``data.provider``) is imported but not called.

  Raises:
    ArgumentError: (`mpscale.validation`; ``ArgumentTypeError`` for a wrong type)
      whose ``names`` are the config keys at fault.
  """
  build(cfg, abstract=True)


def check_train_steps(cfg: schema.RunConfig) -> None:
  """With ``train.samples``, ``train.steps`` is the step count it takes
  (`train_steps`; `mpscale.trainer.config.load.load_config` sets it so).

  Raises:
    ArgumentError: naming ``train.steps`` and ``train.samples`` when they disagree.
  """
  steps = train_steps(cfg)
  if steps != cfg.train.steps:
    raise validation.ArgumentError(
        ("train.steps", "train.samples"), f"{{0}} ({cfg.train.steps}) disagrees with "
        f"{{1}} ({cfg.train.samples}), which takes {steps} steps: leave {{0}} out "
        "(it is derived from {1})")


class Setup(NamedTuple):
  """Everything a training loop needs, built from one config."""
  model: Union[lm_lib.TinyLM, models_lib.Model]
  policy: precision_lib.Policy
  optimizer: optax.GradientTransformation
  mesh: Optional[Mesh]
  init: Callable[[Any], step_lib.TrainState]
  """``init(params) -> TrainState``, with the model's initial state and the run's key
  when it has them (`run_key`)."""
  step: Callable[[step_lib.TrainState, Any], tuple[Any, dict]]
  """The jitted ``step(state, batch) -> (state, metrics)``."""
  evaluate: Callable[[Any, Any], dict[str, tuple[jax.Array, jax.Array]]]
  """Jitted ``evaluate(state, batch) -> {"loss": (loss_sum, num_tokens), name: (sum,
  count)}`` of a `TrainState` in inference mode, in the compute dtype: the loss and
  the model's metrics."""
  init_params: Callable[[], Any]
  """``init_params()``: the model's float32 initial parameters, from ``seed``."""
  to_model_order: Callable[[Any], Any] = lambda tree: tree
  """A state (or params) as the model orders its layers: a pipeline's stacked layers
  are stored in device order in the `TrainState` (``layer_order="device"``), in
  model order in checkpoints and for evaluation, sampling and export; the same
  shardings. The identity without one."""
  to_device_order: Callable[[Any], Any] = lambda tree: tree
  """The inverse of ``to_model_order``."""


def user_param_specs(cfg: schema.RunConfig, model: models_lib.Model,
                     mesh: Optional[Mesh]) -> Any:
  """A user's model's layout: its ``param_specs`` (a function of the mesh, or specs),
  plus FSDP over ``fsdp`` when ``mesh.fsdp`` > 1.

  Raises:
    ArgumentError: naming ``mesh.tensor`` or ``mesh.stage`` when the model gives no
      layout for them, or ``mesh.stage`` when its loss is not a `mpscale.Pipeline`.
  """
  pipelined = isinstance(model.loss_fn, parallel_lib.Pipeline)
  if cfg.mesh.stage > 1 and not pipelined:
    raise validation.ArgumentError(
        ("mesh.stage", "model.provider"), f"{{0}} ({cfg.mesh.stage}) > 1 needs {{1}} "
        "to return an mpscale.trainer.Model whose loss_fn is an mpscale.Pipeline")
  if pipelined and cfg.mesh.stage == 1:
    raise validation.ArgumentError(
        "mesh.stage", "{0}: the model's loss_fn is an mpscale.Pipeline, which needs "
        "{0} > 1")
  split = getattr(model.loss_fn, "split", None) if pipelined else None
  if split != cfg.mesh.pipeline_split:
    raise validation.ArgumentError(
        ("mesh.pipeline_split", "model.provider"),
        f"{{0}} is {cfg.mesh.pipeline_split}, but the model of {{1}} "
        + ("has no encoder-decoder split (its loss_fn is not an mpscale.SplitPipeline)"
           if split is None else f"splits its pipeline at {split}")
        + "; they must agree (the provider reads config.mesh.pipeline_split)")
  specs = model.param_specs
  if callable(specs) and mesh is not None:
    specs = errors.keyed("mesh", lambda: specs(mesh))
  if cfg.mesh.tensor > 1 and specs is None:
    raise validation.ArgumentError(
        ("mesh.tensor", "model.provider"), f"{{0}} ({cfg.mesh.tensor}) > 1 needs the "
        "model's layout: return an mpscale.trainer.Model with param_specs from {1}")
  if mesh is not None and cfg.mesh.fsdp > 1:
    shapes = jax.eval_shape(model.init, jax.random.key(cfg.seed))
    transpose = (FSDP_TRANSPOSE_AXIS if FSDP_TRANSPOSE_AXIS in mesh.axis_names
                 else None)
    specs = errors.keyed("mesh.fsdp", lambda: parallel_lib.fsdp_specs(
        shapes, mesh, FSDP_AXIS, specs, pads_unevenly(cfg), transpose))
  return specs


def build(cfg: schema.RunConfig, devices: Optional[Sequence[Any]] = None, *,
          model: Optional[models_lib.Model] = None,
          abstract: bool = False) -> Optional[Setup]:
  """Model, policy, optimizer, mesh, train step and evaluation for ``cfg``.

  With ``mesh.stage > 1`` the loss is a `mpscale.Pipeline` and the micro-batches are
  the pipeline's (``make_train_step`` gets ``num_microbatches=1``).

  Args:
    cfg: the run.
    devices: the devices of the mesh; default ``jax.devices()``.
    model: a user's model (`mpscale.trainer.models.user.as_model`); default: the tiny LM
      ``model`` describes. A user's loss is per token (``(loss_sum, num_tokens)``;
      a mean counts as one token), whatever ``train.per_token_loss`` says.
    abstract: build on shapes only, to check ``cfg`` (`check`): an abstract mesh of
      the config's sizes (no devices), nothing allocated, and the providers a config
      names imported, not called.

  Returns:
    The `Setup`; ``None`` when ``abstract``.

  Raises:
    ArgumentError: (``ArgumentTypeError`` for a wrong type) naming the config keys
      at fault.
  """
  policy = build_policy(cfg)
  reduce_dtype = build_grad_reduce_dtype(cfg)
  build_batch_sizes(cfg)
  check_train_steps(cfg)
  optimizer = build_optimizer(cfg)
  if build_fp8(cfg) is not None and model is not None:
    check_user_fp8(cfg, model)
  if cfg.data.provider is not None:
    models_lib.load_object(cfg.data.provider, "data.provider")
  if model is None and cfg.model.provider is not None:
    if not abstract:
      raise ValueError("model.provider names a user's model: build it first "
                       "(mpscale.trainer.runs.loop.open_model) and pass it as model=")
    for key in ("provider", "loss", "metrics"):  # imported now, called by the run
      if getattr(cfg.model, key) is not None:
        models_lib.load_object(getattr(cfg.model, key), f"model.{key}")
    return None
  transpose = fsdp_transpose(cfg, model)
  mesh = (abstract_mesh(cfg, transpose) if abstract
          else build_mesh(cfg, devices, transpose))
  pieces = _model_pieces(cfg, model, mesh, () if abstract else devices)
  if cfg.optimizer.groups:
    check_param_groups(cfg, jax.eval_shape(pieces.init_params))
  init_state, merge = build_model_state(cfg, pieces.model, policy, reduce_dtype)
  make_init, step = errors.keyed("train", lambda: step_lib.make_train_step(
      pieces.loss, optimizer, policy=policy, mesh=mesh, data_axis=data_axes(mesh),
      num_microbatches=1 if cfg.mesh.stage > 1 else cfg.train.num_microbatches,
      per_token_loss=pieces.per_token,
      shard_optimizer_state=cfg.mesh.shard_optimizer_state,
      param_specs=pieces.specs, grad_reduce_dtype=reduce_dtype, merge_state=merge,
      context_parallel=cfg.model.context_parallel, offload=cfg.train.offload),
      {"grad_reduce_dtype": "precision.grad_reduce_dtype",
       "context_parallel": "model.context_parallel", "offload": "train.offload"})
  if abstract:
    return None
  if isinstance(pieces.model, lm_lib.TinyLM) and pieces.model.routing is not None:
    step = _with_routing_metrics(step, pieces.model)
  pipeline = pieces.loss if isinstance(pieces.loss, parallel_lib.Pipeline) else None
  key = run_key(cfg)
  stochastic = getattr(pieces.model, "stochastic", False)

  def init(params):
    model_state = None if init_state is None else init_state(key)
    if pipeline is not None:  # the stacked layers (and their states) in device order
      params, model_state = (
          jax.eval_shape(pipeline.to_device_order, (params, model_state))
          if _is_abstract(params) else pipeline.to_device_order((params, model_state)))
    return make_init(params, model_state=model_state, rng=key if stochastic else None)

  return Setup(pieces.model, policy, optimizer, mesh, init, step,
               build_evaluate(pieces.model, pieces.evaluate, policy, pipeline),
               pieces.init_params,
               _placed_alike(pipeline.to_model_order if pipeline else None),
               _placed_alike(pipeline.to_device_order if pipeline else None))


def _with_routing_metrics(step: Callable, model: lm_lib.TinyLM) -> Callable:
  """``step`` whose metrics also hold ``moe``: the routing statistics of the new
  state (`TinyLM.routing_metrics`), computed in the same program."""
  def routed(state, batch):
    state, metrics = step(state, batch)
    return state, {**metrics, "moe": model.routing_metrics(state.model_state)}
  return jax.jit(routed, donate_argnums=(0,))


class _ModelPieces(NamedTuple):
  """What `build` takes from the model: its loss (a `mpscale.Pipeline` under
  ``mesh.stage > 1``), evaluation, layout and initial parameters."""
  model: Any
  loss: Any
  evaluate: Callable
  per_token: bool
  """The loss is ``(loss_sum, num_tokens)``."""
  specs: Any
  init_params: Callable[[], Any]


def _model_pieces(cfg: schema.RunConfig, model: Optional[models_lib.Model],
                  mesh: Any, devices: Optional[Sequence[Any]]) -> _ModelPieces:
  """The built-in tiny LM's pieces (``model`` ``None``), or a user's model's (whose
  loss is per token: ``(loss_sum, num_tokens)``, a mean counting as one token)."""
  if model is not None:
    return _ModelPieces(model, model.loss_fn, model.evaluate, True,
                        user_param_specs(cfg, model, mesh),
                        functools.partial(model.init, jax.random.key(cfg.seed)))
  if cfg.mesh.pipeline_split is not None:
    raise validation.ArgumentError(
        ("mesh.pipeline_split", "model.provider"), "{0} splits an encoder-decoder; "
        "the built-in tiny LM is decoder-only: give {1} an mpscale.SplitPipeline "
        "model (examples/t5_split)")
  model = build_model(cfg, mesh, devices)
  specs = build_param_specs(cfg, model, mesh)
  return _ModelPieces(model, build_loss(cfg, model), model.evaluate,
                      cfg.train.per_token_loss, specs,
                      functools.partial(init_params, cfg, model, mesh, specs))


def build_model_state(cfg: schema.RunConfig, model: Any, policy: Any,
                      reduce_dtype: Any) -> tuple[Optional[Callable], Optional[Callable]]:
  """``(init_state, merge_state)``: the model state's initializer (``None`` for a
  model without one; the tiny LM's FP8 scaling state under ``precision.fp8``) and
  how replicas' or micro-batches' updates of FP8 state merge (max amax; ``None``
  without FP8).

  Raises:
    ArgumentError: naming ``precision.grad_reduce_dtype`` (float32 sums, in which
      each data replica differentiates its own rows) with a model state other than
      FP8 scaling state alone.
  """
  init_state = getattr(model, "init_state", None)
  if isinstance(model, lm_lib.TinyLM) and (model.fp8 is not None
                                          or model.routing is not None):
    init_state = lambda key: model.init_model_state()  # noqa: E731
  fp8 = build_fp8(cfg)
  merge = None if fp8 is None else functools.partial(precision_lib.merge_stacked,
                                                     recipe=fp8)
  if (reduce_dtype is None or init_state is None or cfg.mesh.stage > 1
      or jnp.finfo(policy.compute_dtype).bits >= 32):
    # (A pipeline sums in float32 itself and carries the FP8 state.)
    return init_state, merge
  # Each replica differentiates its own rows: only FP8 scaling state can follow,
  # merged. make_train_step's init would refuse the others: say so by key, now.
  state = jax.eval_shape(init_state, jax.random.key(cfg.seed))
  fp8_only = (isinstance(state, Mapping)
              and set(state) == {precision_lib.OVERWRITE_WITH_GRADIENT})
  if isinstance(model, lm_lib.TinyLM) and model.routing is not None:
    raise validation.ArgumentError(
        ("precision.grad_reduce_dtype", "model.num_experts"),
        "{0}: float32 sums each data replica's own gradient, but a mixture of "
        "experts ({1}) keeps routing state (its balancing bias and statistics); "
        "set {0}: null")
  if not (fp8 is not None and fp8_only):
    raise validation.ArgumentError(
        ("precision.grad_reduce_dtype", "model.provider"),
        "{0}: float32 sums each data replica's own gradient, but the model of {1} "
        "keeps a state (synchronized BatchNorm statistics), which makes every "
        "micro-batch's gradient span all replicas' rows; set {0}: null")
  return init_state, merge


def build_evaluate(model: Any, evaluate_fn: Callable, policy: Any,
                   pipeline: Optional[parallel_lib.Pipeline]) -> Callable:
  """The jitted evaluation of a `mpscale.TrainState` on a batch: the model's loss
  (and its metrics, where it has them) on the parameters in model order, cast to
  the compute dtype."""
  metrics_fn = getattr(model, "metrics", None)

  @jax.jit
  def evaluate(state, batch):
    # (a leaf FSDP splits unevenly is stored padded, an offloaded one on the host)
    state = parallel_lib.unpad(step_lib.on_device(state))
    params, model_state = (state.params, state.model_state) if pipeline is None else (
        pipeline.to_model_order((state.params, state.model_state)))
    kw = {} if model_state is None else {"model_state": model_state}
    params = policy.cast_to_compute(params)
    out = {"loss": evaluate_fn(params, batch, **kw)}
    if metrics_fn is not None:
      out.update(metrics_fn(params, batch, **kw))
    return out

  return evaluate


def _is_abstract(tree: Any) -> bool:
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree))


def place_like(tree: Any, like: Any) -> Any:
  """``tree`` with each array leaf put in the sharding of ``like``'s leaf, where that
  is an array of the same shape (a `mpscale.SplitPipeline`'s padding changes the
  stacks' shapes: those leaves are left as they are)."""
  return jax.tree_util.tree_map(
      lambda new, old: (jax.device_put(new, old.sharding)
                        if isinstance(old, jax.Array) and new.shape == old.shape
                        else new), tree, like)


def _placed_alike(permute: Optional[Callable[[Any], Any]]) -> Callable[[Any], Any]:
  """``permute`` (a pipeline's layer order) with its result placed as its input
  (`place_like`); the identity for ``None``."""
  if permute is None:
    return lambda tree: tree
  return lambda tree: place_like(permute(tree), tree)


def run_key(cfg: schema.RunConfig) -> jax.Array:
  """The run's key for random draws in training (dropout): ``fold_in(key(seed), 1)``,
  apart from the parameters' ``key(seed)``."""
  return jax.random.fold_in(jax.random.key(cfg.seed), 1)


def rounding_key(cfg: schema.RunConfig) -> jax.Array:
  """The key of ``precision.update_rounding: stochastic``'s draws:
  ``fold_in(key(seed), 2)``, apart from the parameters' and the run's (`run_key`)."""
  return jax.random.fold_in(jax.random.key(cfg.seed), 2)


def init_params(cfg: schema.RunConfig, model: lm_lib.TinyLM, mesh: Any = None,
                specs: Any = None) -> Any:
  """The model's float32 initial parameters: from ``seed``, or read from
  ``model.init_from`` (`mpscale.trainer.hf.load_params`), each straight into its
  layout on ``mesh`` (``specs``) when it is a concrete one."""
  if cfg.model.init_from is None or isinstance(jnp.zeros(()), jax.core.Tracer):
    # under jax.eval_shape (a config checked, a step planned): the same shapes,
    # and nothing of the checkpoint read
    return model.init(jax.random.key(cfg.seed))
  concrete = isinstance(mesh, Mesh)
  return errors.keyed("model", lambda: hf.load_params(
      cfg.model.init_from, model, mesh if concrete else None,
      specs if concrete else None), {"init_from": "model.init_from"})


def optimizer_state_bytes(optimizer: optax.GradientTransformation, params: Any) -> int:
  """Bytes of ``optimizer``'s state for ``params`` (from shapes; nothing allocated)."""
  return parallel_lib.tree_bytes(jax.eval_shape(optimizer.init, params),
                                 per_device=False)


def describe(cfg: schema.RunConfig) -> dict[str, str]:
  """Short labels of a run for tables: policy, loss scaling, optimizer, mesh."""
  init = cfg.loss_scale.init_scale
  init = "auto" if init is None else f"{init:g}"
  scaling = {"dynamic": f"dynamic (init {init})", "fixed": f"fixed {init}",
             "none": "none"}[cfg.loss_scale.kind]
  return {"policy": cfg.precision.policy, "loss_scale": scaling,
          "optimizer": cfg.optimizer.name,
          "mesh": cfg.mesh.shape_text}
