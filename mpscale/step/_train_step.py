"""The train step: precision, loss scaling, micro-batches and every mesh layout.

`make_train_step(loss_fn, optimizer, ...)` returns ``(init, step)``. One step::

  scale = loss_scale_of(opt_state)                    # the scale used for this step
  g = 0                                               # float32, shaped like params
  for micro_batch in split(batch, num_microbatches):  # a lax.scan
    g += grad(scale * loss_fn(policy.cast_to_compute(params), micro_batch))
  g /= num_microbatches          # or / total token count, with per_token_loss
  updates, opt_state = optimizer.update(g, opt_state, params, loss=unscaled_loss)
  params = apply_updates(params, updates)             # master params, param_dtype

The optimizer's mpscale wrapper (`dynamic_loss_scale`, `fixed_loss_scale`,
`no_loss_scale`) unscales ``g`` in float32, checks it in one pass, skips a non-finite
step and adjusts the scale. An optimizer without one is wrapped in `no_loss_scale`, so
every step reports the same metrics and skips non-finite gradients.

The code reads the same way::

  layout    = Layout(mesh, data axes, param_specs, ZeRO-1, pipeline)  # where arrays live
  gradients = _gradient_source(loss_fn, ...)    # chosen once: accumulate or pipeline
  def step(state, batch):
    grads, loss, tokens = gradients(state.params, batch, loss_scale_of(state))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params,
                                          loss=loss)     # for skip_spikes
    state = layout.constrain(TrainState(apply_updates(...), opt_state, step + 1))

Data parallelism is jit + GSPMD over a `jax.sharding.Mesh`: the batch is sharded over
the data axes, and XLA inserts the gradient all-reduce. ``param_specs`` lays the
parameters out on the mesh (`mpscale.parallel`): FSDP splits them over a data axis
(``("data", "fsdp")``), tensor parallelism over a ``tensor`` axis, and XLA gathers and
reduce-scatters them; the optimizer state follows its parameters (a factored moment
the dimension it kept), and FSDP's data axes split it too. With
``shard_optimizer_state=True`` each optimizer-state leaf is also split over the
remaining data axes along its largest free divisible dimension (ZeRO-1); XLA then
updates each shard where it lives and all-gathers the parameter updates.

The overflow check, the global norm and the group norms read one float32 sum of squares
per gradient leaf (`mpscale.scaling`); across devices they only ever move those scalars,
never a gradient. On replicated gradients (plain data parallelism) each device sums its
all-reduced copy, with no communication; on sharded ones (ZeRO-1) XLA all-reduces the
per-device partial sums, a few bytes. Each leaf's sum can start as soon as that leaf's
all-reduce lands, so the check puts no collective of its own on the critical path and
the large gradient all-reduces are free to overlap the backward pass. On GPU, let
XLA schedule for that overlap with::

  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true
             --xla_gpu_all_reduce_combine_threshold_bytes=134217728"

(the second combines the per-leaf all-reduces into fewer, larger ones; the names and
defaults of XLA flags change between jaxlib releases, see the JAX "GPU performance
tips"). With micro-batches, each data replica accumulates its own float32 gradient
inside the ``lax.scan`` (the loss function is ``jax.vmap``-ed over the replicas, each
seeing its own rows), and the replicas' sums are added once after the loop: one
gradient all-reduce per step, not one per micro-batch. Without micro-batches, or with
laid-out parameters, GSPMD sums a weight's gradient inside the backward matmul, in the
compute dtype; ``grad_reduce_dtype=float32`` moves every sum to float32 (each device's
own gradient, widened, then summed over the replicas in a ``shard_map``: an
all-reduce, or FSDP's reduce-scatter), as Megatron-LM does by default.

A Flax ``TrainState`` user takes the short path::

  init, step = mpscale.make_train_step(loss_fn, ts.tx, policy="O2")
  state = init(ts)                  # keeps ts.params, ts.step and the Adam moments
  for batch in data:
    state, metrics = step(state, batch)
  ts = ts.replace(params=state.params, step=state.step)   # for ts.apply_fn
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax

from mpscale import _jaxprs as jaxprs
from mpscale import _tree
from mpscale import _versions
from mpscale import gradients as gradients_lib
from mpscale import keys as keys_lib
from mpscale import validation
from mpscale.gradients import Gradients
from mpscale.parallel import _context as context_lib
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale.parallel import _padding as padding_lib
from mpscale.parallel.pipeline import _pipeline as pipeline_lib
from mpscale.precision import _fp8_state as fp8_state_lib
from mpscale.precision import _policy as policy_lib
from mpscale.scaling import _loss_scale as loss_scale_lib
from mpscale.scaling import _skip as skip_lib
from mpscale.scaling import _spikes as spikes_lib
from mpscale.step import _accumulate as accumulate_lib
from mpscale.step import _metrics as metrics_lib
from mpscale.step import _state as state_lib
from mpscale.step import _sums as sums_lib
from mpscale.step._accumulate import DataAxis, LossFn


def _check_pipeline(pipeline: pipeline_lib.Pipeline, mesh: Optional[Mesh],
                    num_microbatches: int) -> int:
  """Validates a pipelined step's settings; returns its micro-batch count."""
  if mesh is None or pipeline.stage_axis not in mesh.axis_names:
    raise ValueError(f"a Pipeline needs a mesh with its stage axis "
                     f"{pipeline.stage_axis!r}; got "
                     f"{None if mesh is None else tuple(mesh.axis_names)}")
  if num_microbatches not in (1, pipeline.num_microbatches):
    raise ValueError(f"num_microbatches={num_microbatches} disagrees with the "
                     f"pipeline's num_microbatches={pipeline.num_microbatches}")
  return pipeline.num_microbatches


def _gradient_source(loss_fn: Any, layout: state_lib.Layout, policy: policy_lib.Policy,
                     num_microbatches: int, per_token_loss: bool,
                     reduce_dtype: Optional[np.dtype] = None,
                     merge_state: Optional[Callable] = None
                    ) -> Callable[..., tuple[Gradients, Any]]:
  """The step's one gradient source: ``(params, batch, loss_scale, rng, model_state)
  -> (Gradients, new model_state)``."""
  if isinstance(loss_fn, pipeline_lib.Pipeline):
    def pipelined(params, batch, scale, rng, model_state):
      layer_state = _pipeline_state(loss_fn, model_state)
      out = loss_fn.value_and_grad(
          params, batch, mesh=layout.mesh, data_axis=layout.data_axes,
          loss_scale=scale, per_token_loss=per_token_loss, cast=policy.cast_to_compute,
          param_specs=layout.specs(params), rng=rng,
          grad_reduce_dtype=reduce_dtype if accumulate_lib.sums_in_float32(policy, reduce_dtype)
          else None, model_state=layer_state)
      grads, new_state = out if layer_state is not None else (out, None)
      if not per_token_loss:
        grads = grads._replace(num_tokens=jnp.asarray(
            mesh_lib.batch_rows(batch), jnp.int32))
      if new_state is not None:
        written = fp8_state_lib.reached(new_state, layer_state)
        new_state = fp8_state_lib.join_overwrite(
            fp8_state_lib.split_overwrite(model_state)[0], {loss_fn.stages_key: written})
      return grads, new_state
    return pipelined

  def accumulated(params, batch, scale, rng, model_state):
    out = accumulate_lib.accumulate_gradients(
        loss_fn, params, batch, loss_scale=scale, policy=policy,
        num_microbatches=num_microbatches, per_token_loss=per_token_loss,
        mesh=layout.mesh, data_axis=layout.data_axes or "data",
        param_specs=None if layout.param_specs is None else layout.specs(
            padding_lib.unpad(_tree.shapes(params))),  # (as stored: Padded leaves)
        rng=rng, model_state=model_state, grad_reduce_dtype=reduce_dtype,
        merge_state=merge_state)
    return out if model_state is not None else (out, None)
  return accumulated


def _pipeline_model(pipeline: pipeline_lib.Pipeline) -> Callable:
  """`Pipeline.apply` as the step calls a loss: with a ``model_state`` (the step's,
  `_pipeline_state`), ``(out, model_state)``."""
  def model(params, batch, rng=None, model_state=None):
    if model_state is None:
      return pipeline.apply(params, batch, rng=rng)
    out = pipeline.apply(params, batch, rng=rng,
                         model_state=_pipeline_state(pipeline, model_state))
    return out, model_state
  return model


def _pipeline_state(pipeline: pipeline_lib.Pipeline, model_state: Any) -> Any:
  """The layers' state a `Pipeline` takes from a step's ``model_state``: ``None``,
  or an ``_overwrite_with_gradient`` collection (FP8 scaling state) holding only the
  stacked layers' states, under the pipeline's ``stages_key``."""
  if model_state is None:
    return None
  collection = (fp8_state_lib.split_overwrite(model_state)
                if isinstance(model_state, Mapping) else (model_state, None))
  rest, overwrite = collection
  if rest or not isinstance(overwrite, Mapping) or set(overwrite) != {
      pipeline.stages_key}:
    raise validation.fail(
        "model_state", f" of a Pipeline must be {{{fp8_state_lib.OVERWRITE_WITH_GRADIENT!r}: "
        f"{{{pipeline.stages_key!r}: the layers' states}}}} (FP8 scaling state, "
        "stacked as the layers are): a pipeline's stages pass no other state; got "
        f"the keys {sorted(model_state) if isinstance(model_state, Mapping) else None}")
  return overwrite[pipeline.stages_key]


def _skipped_total(opt_state: Any) -> jax.Array:
  """The wrapper's count of skipped steps."""
  return _tree.find(opt_state, skip_lib.SkipNonfiniteState)[0].skipped


def _check_spikes_inside(opt_state: Any) -> None:
  """A `skip_spikes` sits inside the loss-scale (or skip) wrapper: around it, it
  would judge scaled gradients and its skips would go uncounted (``skipped``, the
  model state)."""
  for spikes_state in _tree.find(opt_state, spikes_lib.SkipSpikesState):
    if _tree.find(spikes_state.inner_state, skip_lib.SkipNonfiniteState):
      raise validation.fail(
          "optimizer", ": skip_spikes wraps a loss-scale or skip_nonfinite wrapper; "
          "put it inside instead, e.g. dynamic_loss_scale(skip_spikes(inner))")


def _check_step_inputs(model: LossFn, policy: policy_lib.Policy, tx: Any,
                       state: state_lib.TrainState, batch: Any, data_size: int,
                       num_microbatches: int, per_token_loss: bool) -> None:
  """At trace time: the batch divides, the state matches the optimizer, and the loss
  function returns the structure ``per_token_loss`` asks for."""
  mesh_lib.batch_rows(batch, data_size, num_microbatches)
  expected = jax.tree_util.tree_structure(
      jax.eval_shape(tx.init, _tree.shapes(state.params)))
  if jax.tree_util.tree_structure(state.opt_state) != expected:
    raise ValueError("state.opt_state does not match the optimizer passed to "
                     "make_train_step; build the state with its init()")
  _check_spikes_inside(state.opt_state)
  micro_batch = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(
          (x.shape[0] // num_microbatches,) + x.shape[1:] if x.shape else (),
          x.dtype), batch)
  key = None if state.rng is None else jax.eval_shape(keys_lib.typed, state.rng)

  _check_takes(model, sorted(sums_lib.loss_extras(key, state.model_state)))

  def call(p, b, k, model_state):
    out = model(policy.cast_to_compute(p), b, **sums_lib.loss_extras(k, model_state))
    if model_state is not None:
      out, _ = sums_lib.split_state_output(out, model_state)
    return out

  closed, out_shape = jax.make_jaxpr(call, return_shape=True)(
      _tree.shapes(state.params), micro_batch, key, _tree.shapes(state.model_state))
  accumulate_lib.check_loss_structure(out_shape, per_token_loss)
  # A 16-bit policy that the model overrides (its layers fixed to float32) says so.
  policy.check_compute(jaxprs.matmul_flops(closed), stacklevel=1)


def _check_takes(fn: Callable, keywords: list[str]) -> None:
  """Raises ``TypeError`` if ``fn``'s signature cannot take ``keywords``."""
  if not keywords:
    return
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # no signature to read: the call will tell
    return
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return
  names = {p.name for p in parameters if p.kind in (
      inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
  missing = [k for k in keywords if k not in names]
  if missing:
    raise TypeError(
        f"the state holds {' and '.join(keywords)}, so the step calls "
        f"loss_fn(params, batch, {', '.join(f'{k}=...' for k in keywords)}); "
        f"{getattr(fn, '__name__', 'loss_fn')} takes no {missing[0]!r}")


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    policy: Union[None, str, policy_lib.Policy] = None,
                    mesh: Optional[Mesh] = None, data_axis: DataAxis = "data",
                    num_microbatches: int = 1, per_token_loss: bool = False,
                    shard_optimizer_state: bool = False,
                    param_specs: layouts_lib.SpecsLike = None, donate: bool = True,
                    model_state_dtype: Any = jnp.float32,
                    grad_reduce_dtype: Any = None,
                    merge_state: Optional[Callable] = None,
                    context_parallel: str = "ring",
                    offload: Sequence[str] = ()
                   ) -> tuple[Callable[..., state_lib.TrainState],
                              Callable[[state_lib.TrainState, Any], tuple[state_lib.TrainState, dict]]]:
  """A jitted mixed-precision, data-parallel train step and its ``init``.

  ``init(params)`` casts the parameters to the policy's ``param_dtype``, initializes
  the optimizer (wrapped in `no_loss_scale` when it has no mpscale loss-scale or skip
  wrapper) and places everything on the mesh. ``step(state, batch)`` is a ``jax.jit``
  function taking one optimizer step (the algorithm is in the module docstring); it
  checks the batch and the loss function's output structure when it traces. See
  docs/train_step.md for the loss function and the optimizer's wrapper, layouts,
  micro-batches, float32 gradient sums, stochastic and stateful models, pipelines,
  compiling from shapes, and the metrics.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, a floating scalar mean loss (with
      ``per_token_loss``, ``-> (loss_sum, num_tokens)``) of the parameters cast by
      ``policy.cast_to_compute``; with a model state it returns ``(that,
      new_model_state)``. Or a `mpscale.Pipeline`, over the mesh's stage axis, whose
      model state can only be its layers' FP8 scaling state
      (``{"_overwrite_with_gradient": {stages_key: states stacked as the layers}}``,
      the pipeline built with ``merge_state``).
    optimizer: an optax transformation, ideally wrapped in `mpscale.dynamic_loss_scale`
      (float16) or `mpscale.no_loss_scale`, their ``axis_name`` unset. Its ``update``
      gets the unscaled loss as the extra argument ``loss``.
    policy: a `mpscale.Policy` or a name for `mpscale.make_policy`; default float32.
    mesh: a ``jax.sharding.Mesh``, or ``None`` for one device.
    data_axis: the mesh axis (or tuple of axes, e.g. ``("data", "fsdp")``) the batch
      is sharded over. A ``context`` axis on ``mesh`` (`mpscale.parallel.CONTEXT_AXIS`)
      splits the sequence (each batch leaf's second dimension) over it: a model that
      attends with ``jax.nn.dot_product_attention(..., is_causal=True)`` then attends
      across the split with no change to its code, as ``context_parallel`` says
      (`mpscale.parallel.attention_over`; the built-in LM lays its own sequence
      out, balanced); a model that attends otherwise is refused when ``step``
      traces.
    num_microbatches: gradient accumulation: the batch's leading dimension is split
      into this many micro-batches under one loss scale, with one optimizer update
      (a `Pipeline`'s are its own: 1 or the same number here).
    per_token_loss: the gradient is divided by the token count summed over all
      micro-batches and data replicas (Megatron ``calculate_per_token_loss``).
    shard_optimizer_state: ZeRO-1: also shard each optimizer-state leaf over the data
      axes its spec does not use. Needs a mesh. Results are the same as unsharded.
    param_specs: the parameters' layout on ``mesh``: a pytree of ``PartitionSpec``
      like the params (or a prefix of it), a function ``(key_path, leaf) ->
      PartitionSpec``, or `mpscale.parallel.logical_specs`; ``None``: replicated (a
      Pipeline's stacked layers over its stage axis). Checked by ``init``.
    donate: donate the input state's buffers to the output state.
    model_state_dtype: the dtype of the model state's floating leaves (BatchNorm
      statistics), whatever the policy; ``None`` keeps the dtypes ``init`` is given.
    grad_reduce_dtype: ``None`` (XLA's choice) or float32: under a 16-bit compute
      dtype, every gradient sum across data replicas and micro-batches is float32
      (Megatron-LM's ``accumulate_allreduce_grads_in_fp32``); ``init`` then refuses a
      model state other than FP8 scaling state alone with ``merge_state``.
    merge_state: with ``grad_reduce_dtype=float32`` and FP8 scaling state (an
      ``_overwrite_with_gradient`` collection), how the data replicas' updates of it
      combine (`mpscale.accumulate_gradients`' ``merge_state``:
      ``functools.partial(mpscale.precision.merge_stacked, recipe=recipe)``). A
      `Pipeline` merges its own (its ``merge_state``).
    context_parallel: ``"ring"`` or ``"all_gather"``
      (`mpscale.parallel.context_attention`), with a ``context`` axis.
    offload: `TrainState` fields kept in host memory (``pinned_host``) between
      steps: ``"opt_state"`` (the optimizer state), ``"params"`` (the master
      parameters). Each step moves them to the device when it starts and back when
      it ends (XLA overlaps the copies where the program allows); what a step
      computes is unchanged, a skipped step's state included. Needs a mesh whose
      devices have host memory (GPU, TPU; JAX's CPU backend has it too), and jax
      0.10.2 or newer (older ones are refused by name).

  Returns:
    ``(init, step)``: ``init(params | flax TrainState | TrainState, *,
    model_state=None, rng=None) -> TrainState`` (given ``jax.ShapeDtypeStruct``s, the
    state's shapes and shardings, allocating nothing) and ``step(state, batch) ->
    (state, metrics)``, ``metrics`` a dict of device arrays: ``loss`` (unscaled),
    ``num_tokens``, ``loss_scale`` (this step's) and `mpscale.step.StepMetrics`'
    (``overflow``, ``skipped``, ``global_norm``, ``group_norms``, ...).

  Raises:
    ValueError: for a mesh without ``data_axis``; ``shard_optimizer_state`` without a
      mesh; a ``grad_reduce_dtype`` other than ``None`` or float32 (an
      `mpscale.ArgumentError` naming it); by ``init``, ``param_specs`` that do not fit
      the params or the mesh (`mpscale.parallel.check_specs`); and, when ``step``
      traces, a batch whose size is not divisible by the data-parallel size times
      ``num_microbatches``.
    TypeError: when ``step`` traces, for a ``loss_fn`` returning the wrong structure.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, mpscale
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    >>> params = {"w": jnp.ones(3)}
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> tx = mpscale.dynamic_loss_scale(optax.adamw(1e-3))
    >>> init, step = mpscale.make_train_step(loss_fn, tx, policy="O2", mesh=mesh)
    >>> state = init(params)
    >>> state, metrics = step(state, batch)
    >>> float(metrics["loss"])
    9.0
  """
  if not (isinstance(loss_fn, pipeline_lib.Pipeline) or callable(loss_fn)):
    raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}")
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError("optimizer must be an optax.GradientTransformation; got "
                    f"{type(optimizer).__name__}")
  policy = policy_lib.Policy() if policy is None else policy_lib.make_policy(policy)
  validation.positive_int("num_microbatches", num_microbatches)
  validation.boolean("per_token_loss", per_token_loss)
  validation.boolean("shard_optimizer_state", shard_optimizer_state)
  validation.boolean("donate", donate)
  data_axes = mesh_lib.data_axes(mesh, data_axis)
  validation.one_of("context_parallel", context_parallel, context_lib.CONTEXT_PARALLEL)
  if shard_optimizer_state and mesh is None:
    raise ValueError("shard_optimizer_state=True needs a mesh")
  if param_specs is not None and mesh is None:
    raise ValueError("param_specs needs a mesh")
  pipeline = loss_fn if isinstance(loss_fn, pipeline_lib.Pipeline) else None
  if pipeline is not None:
    num_microbatches = _check_pipeline(pipeline, mesh, num_microbatches)
  reduce_dtype = gradients_lib.check_grad_reduce_dtype(grad_reduce_dtype)
  layout = state_lib.Layout(
      mesh, data_axes, param_specs, shard_optimizer_state, pipeline,
      unpaddable(pipeline is not None, context_lib.context_size(mesh)),
      _check_offload(offload, mesh))
  if merge_state is not None:
    validation.function("merge_state", merge_state)
  gradients = _gradient_source(loss_fn, layout, policy, num_microbatches,
                               per_token_loss, reduce_dtype, merge_state)
  model = _pipeline_model(pipeline) if pipeline is not None else loss_fn
  if context_lib.context_size(mesh) > 1:
    if pipeline is not None:
      _check_context_pipeline(pipeline, mesh, data_axes, context_parallel)
    gradients = _over_context(gradients, mesh, data_axes, context_parallel, model)
  data_size = layouts_lib.axis_size(mesh, data_axes)

  if model_state_dtype is not None:
    model_state_dtype = jnp.dtype(model_state_dtype)

  def init(params_or_state: Any, *, model_state: Any = None,
           rng: Any = None) -> state_lib.TrainState:
    given = (model_state if model_state is not None
             else getattr(params_or_state, "model_state", None))
    if pipeline is not None and given is not None:
      pipeline.check_model_state(_pipeline_state(pipeline, given))
    if (pipeline is None and accumulate_lib.sums_in_float32(policy, reduce_dtype)
        and given is not None):
      accumulate_lib.check_mergeable(given, merge_state)
    return state_lib.init_state(optimizer, policy, layout, params_or_state, model_state, rng,
                       model_state_dtype)

  def step_fn(state: state_lib.TrainState, batch: Any) -> tuple[state_lib.TrainState, dict]:
    stored, state = layout.load(state)  # the params as stored, and cut
    tx = state_lib.wrapped(optimizer, state.params)
    _check_step_inputs(model, policy, tx, state, batch, data_size, num_microbatches,
                       per_token_loss)
    scale = loss_scale_lib.loss_scale_of(state.opt_state)
    key = None if state.rng is None else keys_lib.step_key(state.rng, state.step)
    (grads, loss, num_tokens), model_state = gradients(
        stored, batch, scale, key, state.model_state)
    # The unscaled loss, for a skip_spikes inside (optax drops it for a
    # transformation that takes no extra arguments).
    # ``samples``: the step's global batch size, for schedules counted in samples
    # (`mpscale.count_samples`).
    updates, opt_state = optax.with_extra_args_support(tx).update(
        grads, state.opt_state, state.params, loss=loss,
        samples=jnp.asarray(jax.tree_util.tree_leaves(batch)[0].shape[0], jnp.int32))
    params = optax.apply_updates(state.params, updates)
    if model_state is not None:
      # A skipped step's statistics may hold the overflow's Inf/NaN: keep the old.
      applied = _skipped_total(opt_state) == _skipped_total(state.opt_state)
      model_state = jax.tree_util.tree_map(
          lambda new, old: jnp.where(applied, new, old), model_state,
          state.model_state)
    new_state = state_lib.TrainState(params, opt_state, state.step + 1, model_state, state.rng)
    new_state = layout.store(layout.constrain(new_state, layout.state(new_state)))
    metrics = metrics_lib.step_metrics(opt_state)
    metrics.update(loss=loss, num_tokens=num_tokens, loss_scale=scale)
    return new_state, layout.constrain(metrics)

  # The state keeps the sharding it arrives with (init's); the batch is placed, from
  # host memory, straight into its data-parallel sharding.
  jit_kwargs: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
  if mesh is not None:
    jit_kwargs["in_shardings"] = (None, layout.batch())
  return init, jax.jit(step_fn, **jit_kwargs)


OFFLOAD_JAX = "0.10.2"
"""The oldest jax whose step with ``offload`` compiles on a mesh: 0.7.1 to 0.10.1
abort in XLA's SPMD partitioner ("Side-effect HLO must have sharding" on the host
placement annotations)."""


def _check_offload(offload: Any, mesh: Optional[Mesh]) -> tuple[str, ...]:
  """``offload`` checked: `mpscale.step.OFFLOAD` names, each once, on a mesh whose
  devices have a ``pinned_host`` memory.

  Raises:
    ArgumentError: naming ``offload``.
  """
  if isinstance(offload, str) or not isinstance(offload, (tuple, list)):
    raise validation.fail("offload", f" must be a list of {list(state_lib.OFFLOAD)}; "
                          f"got {offload!r}", validation.ArgumentTypeError)
  for field in offload:
    validation.one_of("offload", field, state_lib.OFFLOAD)
  if len(set(offload)) != len(offload):
    raise validation.fail("offload", f" names a field twice: {list(offload)}")
  if not offload:
    return ()
  if mesh is None:
    raise validation.fail("offload", f" ({list(offload)}) needs a mesh (one device: "
                          "jax.sharding.Mesh(jax.devices()[:1], ('data',)))")
  if not hasattr(jax, "memory") or not _versions.at_least(jax.__version__,
                                                         OFFLOAD_JAX):
    raise validation.fail("offload", f" ({list(offload)}) needs jax >= {OFFLOAD_JAX} "
                          f"(this is {jax.__version__}, whose SPMD partitioner aborts "
                          "on the host placements)")
  device = mesh.devices.flat[0] if isinstance(mesh, Mesh) else None  # (not abstract)
  memories = getattr(device, "addressable_memories", None)
  kinds = {m.kind for m in memories()} if memories is not None else set()
  if kinds and "pinned_host" not in kinds:  # (compile-only: no list)
    raise validation.fail("offload", f" ({list(offload)}): {device.platform} devices "
                          "have no pinned_host memory to keep it in")
  return tuple(offload)


def unpaddable(pipelined: bool = False, context: int = 1) -> Optional[str]:
  """Why a `make_train_step` of these settings cannot store a parameter its layout
  splits unevenly over the data axes padded (`mpscale.parallel.Padded`), naming
  the argument; ``None`` when it can. Its gradients are then taken inside a
  ``shard_map`` that does not follow a padded leaf: a `mpscale.Pipeline`'s stages,
  or a ``context`` axis. (Float32 sums, ``grad_reduce_dtype``, gather each padded
  shard and cut it: `mpscale.parallel.gather_cast`.)

  Args:
    pipelined: the loss is a `mpscale.Pipeline`.
    context: the size of the mesh's ``context`` axis.

  Returns:
    The reason, as the end of a sentence naming the argument, or ``None``.
  """
  if pipelined:
    return "a Pipeline (loss_fn), whose stages run in a shard_map,"
  if context > 1:
    return "a context axis (mesh), attended over in a shard_map,"
  return None


def _name(model: Any) -> str:
  """How an error names the model: its function's qualified name."""
  fn = getattr(model, "__func__", model)
  return getattr(fn, "__qualname__", type(model).__name__)


def _over_context(gradients: Callable, mesh: Mesh, data_axes: tuple[str, ...],
                  mode: str, model: Any) -> Callable:
  """``gradients`` with the batch's sequence split over the mesh's ``context`` axis
  and the model's ``jax.nn.dot_product_attention`` attending across the split
  (`mpscale.parallel.attention_over`).

  Raises (when traced): ValueError naming ``mesh.context`` and the model, for a
  model that attended without it.
  """
  def run(params, batch, *args):
    batch = context_lib.split_sequence(batch, mesh, data_axes)
    with context_lib.attention_over(mesh, data_axes, mode) as split:
      out = gradients(params, batch, *args)
    if not split.seen():
      raise ValueError(
          f"mesh.context ({context_lib.context_size(mesh)}): the model "
          f"({_name(model)}) never called jax.nn.dot_product_attention, so its "
          "attention cannot cross the split sequence; attend with "
          "jax.nn.dot_product_attention(q, k, v, is_causal=True), or use a mesh "
          "without a context axis")
    return out
  return run


def _check_context_pipeline(pipeline: Any, mesh: Mesh, data_axes: tuple[str, ...],
                            mode: str) -> None:
  """A `Pipeline` beside a context axis: the ring only under GPipe (1F1B's and
  ZB-H1's stages run different branches at a tick, and the ring's transfers would
  not pair up), and no other axis left to GSPMD inside the stages (XLA's SPMD
  partitioner, jax 0.10, aborts on a stage split over context and, say, tensor).

  Raises:
    ValueError: naming ``context_parallel`` or the axes.
  """
  if mode == "ring" and pipeline.schedule != "gpipe":
    raise validation.fail(
        "context_parallel", f": ring passes K/V blocks inside the "
        f"{pipeline.schedule} schedule's per-stage branches, where they would not "
        "pair up; use all_gather, or the gpipe schedule")
  manual = set(data_axes) | {pipeline.stage_axis, context_lib.CONTEXT_AXIS}
  others = [a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1]
  if others:
    raise ValueError(
        f"mesh: a Pipeline beside a context axis takes no other axis inside its "
        f"stages, and {others} would be one (XLA's SPMD partitioner aborts on the "
        "stage); make it a data axis, or drop the context or stage axis")
