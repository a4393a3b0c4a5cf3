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

  layout    = _Layout(mesh, data axes, param_specs, ZeRO-1, pipeline)  # where arrays live
  gradients = _gradient_source(loss_fn, ...)    # chosen once: accumulate or pipeline
  def step(state, batch):
    grads, loss, tokens = gradients(state.params, batch, loss_scale_of(state))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params,
                                          loss=loss)     # for skip_spikes
    state = layout.constrain(TrainState(apply_updates(...), opt_state, step + 1))

Data parallelism is jit + GSPMD over a `jax.sharding.Mesh`: the batch is sharded over
the data axes, and XLA inserts the gradient all-reduce. ``param_specs`` lays the
parameters out on the mesh (`mpscale.sharding`): FSDP splits them over a data axis
(``("data", "fsdp")``), tensor parallelism over a ``tensor`` axis, and XLA gathers and
reduce-scatters them; the optimizer state follows its parameters (a factored moment
the dimension it kept), and FSDP's data axes split it too. With
``shard_optimizer_state=True`` each optimizer-state leaf is also split over the
remaining data axes along its largest free divisible dimension (ZeRO-1); XLA then
updates each shard where it lives and all-gathers the parameter updates.

The overflow check, the global norm and the group norms read one float32 sum of squares
per gradient leaf (`mpscale.norms`); across devices they only ever move those scalars,
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

import dataclasses
import inspect
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import optax

from mpscale import batch_split as batch_split_lib
from mpscale import fp8 as fp8_lib
from mpscale import jaxprs
from mpscale import keys as keys_lib
from mpscale import loss_scale as loss_scale_lib
from mpscale import metrics as metrics_lib
from mpscale import norms as norms_lib
from mpscale import opt_state as opt_state_lib
from mpscale import pipeline as pipeline_lib
from mpscale import policy as policy_lib
from mpscale import sharding as sharding_lib
from mpscale import skip as skip_lib
from mpscale import spikes as spikes_lib
from mpscale import gradients as gradients_lib
from mpscale import validation
from mpscale.gradients import Gradients

LossFn = Callable[[Any, Any], Any]
DataAxis = Union[str, tuple[str, ...]]


class TrainState(NamedTuple):
  """Everything a step reads and writes; a plain pytree that checkpoints cleanly."""
  params: Any
  """Master parameters, in the policy's ``param_dtype``."""
  opt_state: Any
  """Optimizer state, holding an mpscale loss-scale wrapper state (the scale, the skip
  counters and the latest step's norms)."""
  step: jax.Array
  """int32 number of steps taken, skipped ones included."""
  model_state: Any = None
  """The model's non-parameter state (BatchNorm statistics, any collection or NNX
  variable its forward pass updates; FP8 scaling state in an
  ``_overwrite_with_gradient`` collection, replaced by its gradient), float32 unless
  ``model_state_dtype`` says otherwise; ``None`` for a model without one. Updated by
  an applied step, untouched by a skipped one (an overflow's amax is never kept)."""
  rng: Optional[jax.Array] = None
  """Raw ``uint32`` key data every random draw of the run derives from
  (`mpscale.keys`); ``None`` for a deterministic model. It never changes: step ``n``
  draws from ``fold_in(rng, n)``."""

  @classmethod
  def from_flax(cls, flax_state: Any) -> "TrainState":
    """The params, opt_state and step of a ``flax.training.train_state.TrainState``.

    The opt_state is taken as it is; `make_train_step`'s ``init`` also wraps a plain
    optax state into the loss-scale state its step expects.
    """
    for field in ("params", "opt_state", "step"):
      if not hasattr(flax_state, field):
        raise TypeError(f"expected a flax TrainState; {type(flax_state).__name__} has "
                        f"no {field!r}")
    return cls(flax_state.params, flax_state.opt_state,
               jnp.asarray(flax_state.step, jnp.int32))


def _is_flax_state(x: Any) -> bool:
  return all(hasattr(x, f) for f in ("params", "opt_state", "step", "tx", "apply_fn"))


def _shapes(tree: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def _has_wrapper(optimizer: optax.GradientTransformation, params: Any) -> bool:
  state = jax.eval_shape(optimizer.init, _shapes(params))
  return bool(opt_state_lib.find(state, skip_lib.SkipNonfiniteState))


def _wrapped(optimizer: optax.GradientTransformation, params: Any
            ) -> optax.GradientTransformation:
  """``optimizer``, or `no_loss_scale(optimizer)` when it has no mpscale wrapper."""
  if _has_wrapper(optimizer, params):
    return optimizer
  return loss_scale_lib.no_loss_scale(optimizer)


def _split_microbatches(batch: Any, num_microbatches: int, num_replicas: int,
                        num_inner: int = 1) -> Any:
  """Leading dim ``B`` -> ``[num_microbatches, num_replicas, B / (num_microbatches x
  num_replicas)]``, or ``[num_microbatches, B / num_microbatches]`` with one replica.

  The batch's rows are ``num_replicas x num_inner`` contiguous device blocks (its
  data-parallel shards; ``num_inner`` shards inside each replica, e.g. over ``fsdp``).
  Each block is cut into ``num_microbatches`` contiguous pieces, and micro-batch ``k``
  of a replica holds piece ``k`` of each of its blocks, so the split moves no data
  between devices. With one block, micro-batch ``k`` is block ``k``.
  """
  def split(x):
    rows = x.shape[0] // (num_microbatches * num_replicas * num_inner)
    x = x.reshape((num_replicas, num_inner, num_microbatches, rows) + x.shape[1:])
    x = jnp.moveaxis(x, 2, 0)
    x = x.reshape((num_microbatches, num_replicas, num_inner * rows) + x.shape[4:])
    return x[:, 0] if num_replicas == 1 else x
  return jax.tree_util.tree_map(split, batch)


def _check_loss_structure(out: Any, per_token_loss: bool) -> None:
  def is_scalar(x, kind):
    return (isinstance(x, jax.ShapeDtypeStruct) and x.shape == ()
            and jnp.issubdtype(x.dtype, kind))

  if per_token_loss:
    if (not isinstance(out, (tuple, list)) or len(out) != 2
        or not is_scalar(out[0], jnp.floating)
        or not is_scalar(out[1], jnp.number)):
      raise TypeError(
          "with per_token_loss=True, loss_fn(params, batch) must return "
          "(loss_sum, num_tokens): a floating scalar and a numeric scalar; got "
          f"{out}")
  elif not is_scalar(out, jnp.floating):
    raise TypeError(
        "loss_fn(params, batch) must return a floating scalar loss (or, with "
        f"per_token_loss=True, a pair (loss_sum, num_tokens)); got {out}")


def _sums_in_float32(policy: policy_lib.Policy, reduce_dtype: Optional[np.dtype]
                    ) -> bool:
  """Whether the gradient sums must be moved to float32: asked for, and the compute
  dtype is narrower (under float32 compute they are float32 already)."""
  return reduce_dtype is not None and jnp.finfo(policy.compute_dtype).bits < 32


def _check_mergeable(model_state: Any, merge_state: Optional[Callable]) -> None:
  """Under float32 sums (each replica differentiates its own rows) a model state
  must be FP8 scaling state alone, whose replicas' updates ``merge_state``
  combines."""
  if not (isinstance(model_state, Mapping)
          and set(model_state) == {fp8_lib.OVERWRITE_WITH_GRADIENT}):
    raise _refuse_model_state()
  if merge_state is None:
    raise validation.ArgumentError(
        ("merge_state", "grad_reduce_dtype"), "FP8 scaling state under {1}=float32 "
        "needs {0}: each data replica updates it from its own rows, and {0} combines "
        "the replicas' updates (functools.partial(mpscale.fp8.merge_stacked, "
        "recipe=recipe))")
  validation.function("merge_state", merge_state)


def _refuse_model_state() -> validation.ArgumentError:
  return validation.ArgumentError(
      ("grad_reduce_dtype", "model_state"),
      "{0}=float32 sums each data replica's own gradient, but a {1} (synchronized "
      "BatchNorm statistics) makes every micro-batch's gradient span all replicas' "
      "rows; pass {0}=None")


def accumulate_gradients(loss_fn: LossFn, params: Any, batch: Any, *,
                         loss_scale: Any = 1.0,
                         policy: Union[None, str, policy_lib.Policy] = None,
                         num_microbatches: int = 1, per_token_loss: bool = False,
                         mesh: Optional[Mesh] = None, data_axis: DataAxis = "data",
                         param_specs: Any = None, rng: Optional[jax.Array] = None,
                         model_state: Any = None,
                         grad_reduce_dtype: Any = None,
                         merge_state: Optional[Callable] = None) -> Gradients:
  """float32 gradients of ``loss_scale * loss``, accumulated over micro-batches.

  ``loss_fn`` sees the parameters cast by ``policy.cast_to_compute``; the gradients
  flow back through that cast (so through the compute dtype) and are returned as
  float32, shaped like ``params``.

  A stochastic model gets a key (``rng``), a stateful one its state (``model_state``):
  ``loss_fn(params, batch, rng=key, model_state=state)``, each keyword passed only
  when given here, and with ``model_state`` the loss returns ``(out, new_state)``.
  Micro-batch ``k`` draws from `mpscale.keys.microbatch_key` ``(rng, k)`` (and, when
  each data replica accumulates its own gradient, replica ``r`` from
  `mpscale.keys.replica_key` of that). The
  state runs through the micro-batches in order; each call sees the whole micro-batch
  of every data replica, so statistics a model computes over its batch (BatchNorm's)
  are those of the global micro-batch, the same on every device, as synchronized
  BatchNorm computes them.

  FP8 scaling state (`mpscale.fp8`): a model state holding an
  ``_overwrite_with_gradient`` collection is differentiated with the parameters, and
  the collection is replaced by its gradient, the products' updated states. The
  state runs through the micro-batches in order, so each micro-batch's amax enters
  the histories: the history advances once per micro-batch, not once per step. Under
  ``jit`` on a mesh the state is replicated and GSPMD reduces each amax over the
  global tensor, so every replica records the same.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (a mean), or with ``per_token_loss``
      ``-> (loss_sum, num_tokens)``; with ``rng``/``model_state`` it takes them as
      keywords, and with ``model_state`` it returns ``(that, new_model_state)``.
    params: the master parameters.
    batch: a pytree of arrays with a common leading batch dimension.
    loss_scale: multiplies the loss before differentiation.
    policy: a `mpscale.Policy` or preset name; default float32.
    num_microbatches: splits the batch's leading dimension into this many micro-batches
      (a ``lax.scan``), accumulating float32 gradients.
    per_token_loss: divide by the token count summed over all micro-batches
      (mindformers/Megatron ``calculate_per_token_loss``) instead of averaging the
      micro-batch means. A step with no tokens has zero gradients and a zero loss.
    mesh: with micro-batches, the mesh whose ``data_axis`` shards the batch: each data
      replica then accumulates its own gradient (``jax.vmap`` over replicas) and the
      replicas' gradients are added once, after the loop, so the gradient all-reduce
      happens once per step. With ``param_specs`` or a ``model_state``, each
      micro-batch's gradient is instead reduced into the parameters' layout (a
      reduce-scatter for FSDP, as ZeRO-3 does) and accumulated there. Without
      micro-batches GSPMD needs no help.
    data_axis: the mesh axis (or axes) of the data-parallel replicas.
    param_specs: the params' ``PartitionSpec``s (a pytree like ``params``; see
      `mpscale.sharding`), or ``None`` for replicated params.
    rng: a PRNG key (typed or raw) the step's random draws derive from; ``None``: the
      loss takes no key.
    model_state: the model's non-parameter state (a pytree of arrays); ``None``: the
      loss keeps none. Its new value comes back in the leaves' own dtypes.
    grad_reduce_dtype: ``None`` or float32
      (`mpscale.gradients.check_grad_reduce_dtype`). ``None``: XLA places the sums.
      Without micro-batches GSPMD puts the cross-replica sum of a weight's gradient
      inside the backward matmul, in the compute dtype; so it does each micro-batch's
      with ``param_specs`` or a ``model_state``; on the vmapped path the replicas'
      float32 sums are added after the loop. float32 (Megatron-LM's
      ``accumulate_allreduce_grads_in_fp32``): under a 16-bit compute dtype each
      device takes the gradient of its own rows (a ``shard_map`` over the data axes,
      even with one micro-batch), widens it to float32 and accumulates it over the
      micro-batches; the replicas are summed in float32: FSDP's split parameters
      reduce-scattered each micro-batch (as PyTorch FSDP's ``reduce_dtype``), the
      others all-reduced once after the loop. Each micro-batch's gradient is still
      rounded to the compute dtype once, by the matmul that makes it. The loss runs
      inside the ``shard_map``: an activation layout it sets must use
      `mpscale.sharding.constrain`, which drops the manual data axes. Under a
      float32 compute dtype the sums are float32 already and nothing changes. A
      ``model_state`` refuses it (synchronized BatchNorm makes each micro-batch's
      gradient span every replica's rows), except FP8 scaling state alone (an
      ``_overwrite_with_gradient`` collection) with ``merge_state``.
    merge_state: how updates of an FP8 scaling state from data replicas that
      differentiate their own rows combine (``grad_reduce_dtype=float32``):
      ``merge_state(updates)``, ``updates`` the collection with a leading axis of
      replicas (``functools.partial(mpscale.fp8.merge_stacked, recipe=recipe)``).
      Each micro-batch's updates are gathered from the replicas and merged, so
      every replica carries the state on as the global micro-batch records it.

  Returns:
    `Gradients` ``(grads, loss, num_tokens)``; with a ``model_state``, the pair
    ``(Gradients, new_model_state)`` (the state after the last micro-batch, in the
    leaves' own dtypes).
  """
  policy = policy_lib.Policy() if policy is None else policy_lib.get_policy(policy)
  validation.positive_int("num_microbatches", num_microbatches)
  scale = jnp.asarray(loss_scale, jnp.float32)
  data_axes = sharding_lib.data_axes(mesh, data_axis)
  data_size = sharding_lib.axis_size(mesh, data_axes)
  rows = sharding_lib.batch_rows(batch, data_size, num_microbatches)
  specs = (sharding_lib.resolve_specs(param_specs, params)
           if mesh is not None and param_specs is not None else None)
  rng = None if rng is None else keys_lib.typed(rng)
  stateful = model_state is not None
  wide = _sums_in_float32(
      policy, gradients_lib.check_grad_reduce_dtype(grad_reduce_dtype))
  if wide and stateful:
    _check_mergeable(model_state, merge_state)

  # Laid-out parameters: activations stay split over the batch, so GSPMD gathers
  # weights (FSDP's all-gather, a layer at a time) rather than activations.
  model = (batch_split_lib.keep_batch_split(loss_fn, mesh, data_axes, specs)
           if specs is not None and not wide else loss_fn)
  scaled_loss = _scaled_loss(model, policy, scale, per_token_loss, stateful)
  # Three strategies add up the losses and float32 gradients; _averaged divides.
  if wide and data_size > 1:
    sums = _float32_sums(scaled_loss, policy, params, batch, rng, mesh, data_axes,
                         specs, num_microbatches, model_state, merge_state)
  elif num_microbatches == 1:
    sums = _single_gradient(scaled_loss, params, batch, rng, model_state, mesh, specs)
  else:
    sums = _microbatch_scan(scaled_loss, params, batch, rng, model_state, mesh,
                            data_axes, specs, num_microbatches)
  gradients = _averaged(sums, per_token_loss, rows)
  return gradients if not stateful else (gradients, sums.model_state)


class _Sums(NamedTuple):
  """What a strategy of `accumulate_gradients` adds up, before `_averaged` divides."""
  grads: Any
  """float32 gradients of the scaled losses, shaped and laid out like the params."""
  loss: jax.Array
  """The unscaled losses (float32)."""
  tokens: jax.Array
  """The token counts (``per_token_loss``; else zeros)."""
  pieces: int
  """How many losses were added: the divisor of their mean."""
  model_state: Any
  """The model state after the last micro-batch, or ``None``."""


def _scaled_loss(model: Callable, policy: policy_lib.Policy, scale: jax.Array,
                 per_token_loss: bool, stateful: bool) -> Callable:
  """``scaled_loss(params, micro_batch, key, state) -> (scale * loss, (loss, tokens,
  new_state))``: the function every strategy differentiates, ``model`` called on the
  parameters cast to the compute dtype, its loss in float32."""
  def scaled_loss(p, micro_batch, key, state):
    out = model(policy.cast_to_compute(p), micro_batch, **_loss_extras(key, state))
    if stateful:
      out, state = _split_state_output(out, state)
    loss, tokens = out if per_token_loss else (out, 0)
    loss = jnp.asarray(loss).astype(jnp.float32)
    return scale * loss, (loss, jnp.asarray(tokens), state)
  return scaled_loss


def _state_grad(scaled_loss: Callable) -> Callable:
  """``jax.grad(scaled_loss, has_aux=True)``, overwriting FP8 state by its gradient.

  A model state holding an ``_overwrite_with_gradient`` collection (`mpscale.fp8`:
  FP8 products' scaling state) is differentiated with the parameters: the products'
  custom VJPs give each `mpscale.fp8.Fp8State` its updated value as its cotangent,
  and that replaces the collection in the new model state (the other collections as
  the loss returned them). A state the differentiation did not reach (a zero
  cotangent: no scale is ever 0) keeps its old value. Any other model state: exactly
  ``jax.grad``.

  Returns:
    ``grad_fn(params, micro_batch, key, state) -> (grads, (loss, tokens,
    new_state))``, ``grads`` of the parameters only.
  """
  plain = jax.grad(scaled_loss, has_aux=True)

  def grad_fn(params, micro_batch, key, state):
    if not (isinstance(state, Mapping) and fp8_lib.OVERWRITE_WITH_GRADIENT in state):
      return plain(params, micro_batch, key, state)
    rest, overwrite = fp8_lib.split_overwrite(state)

    def loss(p, o):
      return scaled_loss(p, micro_batch, key, fp8_lib.join_overwrite(rest, o))

    (grads, written), (loss_value, tokens, new_state) = jax.grad(
        loss, argnums=(0, 1), has_aux=True)(params, overwrite)
    new_rest, _ = fp8_lib.split_overwrite(new_state)
    written = _reached(written, overwrite)
    return grads, (loss_value, tokens, fp8_lib.join_overwrite(new_rest, written))
  return grad_fn


def _is_fp8_state(x: Any) -> bool:
  return isinstance(x, fp8_lib.Fp8State)


def _reached(new: Any, old: Any) -> Any:
  """Each `mpscale.fp8.Fp8State` of ``new`` (the FP8 states' cotangents, or their
  merged updates), or its value in ``old`` where no product gave one (its scales all
  0: a product outside the loss's graph)."""
  def one(n: Any, o: Any) -> Any:
    if not _is_fp8_state(n):
      return n
    reached = (n.lhs.scale != 0) | (n.rhs.scale != 0) | (n.grad.scale != 0)

    def pick(a, b):  # per state of a stack (the scales' shape), over its history too
      return jnp.where(reached.reshape(reached.shape + (1,) * (a.ndim - reached.ndim)),
                       a, b)
    return jax.tree_util.tree_map(pick, n, o)
  return jax.tree_util.tree_map(one, new, old, is_leaf=_is_fp8_state)


def _like_params(grads: Any, specs: Any, mesh: Optional[Mesh],
                 leading: tuple[Any, ...] = ()) -> Any:
  """Constrains gradient-shaped trees to the params' layout ``specs`` (after
  ``leading`` dimensions); with no layout (``specs`` ``None``), ``grads``."""
  if specs is None:
    return grads
  return jax.tree_util.tree_map(
      lambda g, spec: sharding_lib.constrain(
          g, PartitionSpec(*leading, *sharding_lib.pad(spec, g.ndim - len(leading))),
          mesh), grads, specs)


def _added(total: Any, new: Any) -> Any:
  """``total + new`` leaf by leaf, in ``total``'s dtypes (the float32 sums)."""
  return jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), total, new)


def _zero_sums(grads: Any, loss: Any, tokens: Any) -> tuple[Any, jax.Array, jax.Array]:
  """Zero float32 gradients shaped like ``grads`` and a zero loss and token count of
  the shapes of ``loss`` and ``tokens``: where a ``lax.scan`` starts adding."""
  return (jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), grads),
          jnp.zeros(loss.shape, jnp.float32),
          jnp.zeros(tokens.shape, _token_dtype(tokens.dtype)))


def _single_gradient(scaled_loss: Callable, params: Any, batch: Any,
                     rng: Optional[jax.Array], model_state: Any, mesh: Optional[Mesh],
                     specs: Any) -> _Sums:
  """`accumulate_gradients` with one micro-batch: one gradient of the whole batch,
  widened to float32. Under a mesh GSPMD all-reduces (or reduce-scatters) it once."""
  key = None if rng is None else keys_lib.microbatch_key(rng, 0)
  grads, (loss, tokens, model_state) = _state_grad(scaled_loss)(
      params, batch, key, model_state)
  grads = _like_params(
      jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads), specs, mesh)
  return _Sums(grads, loss, tokens, 1, model_state)


def _microbatch_keys(rng: Optional[jax.Array], num_microbatches: int, replicas: int
                    ) -> Optional[jax.Array]:
  """Micro-batch ``k``'s key ``microbatch_key(rng, k)``, ``[num_microbatches]``; with
  several replicas, replica ``r``'s ``replica_key`` of that, ``[num_microbatches,
  replicas]``. ``None`` without ``rng``."""
  if rng is None:
    return None
  keys = jax.vmap(lambda k: keys_lib.microbatch_key(rng, k))(
      jnp.arange(num_microbatches))
  if replicas > 1:
    keys = jax.vmap(lambda k: jax.vmap(lambda r: keys_lib.replica_key(k, r))(
        jnp.arange(replicas)))(keys)
  return keys


def _microbatch_scan(scaled_loss: Callable, params: Any, batch: Any,
                     rng: Optional[jax.Array], model_state: Any, mesh: Optional[Mesh],
                     data_axes: tuple[str, ...], specs: Any, num_microbatches: int
                    ) -> _Sums:
  """`accumulate_gradients` over several micro-batches: a ``lax.scan`` adding their
  gradients in float32.

  Replicated parameters: one accumulator per data replica (the gradient ``jax.vmap``-ed
  over the replicas, each seeing its own rows), the replicas summed once, after the
  loop. Laid-out parameters, or a model state that must see the whole micro-batch:
  each micro-batch's gradient is reduced into the parameters' layout (FSDP's
  reduce-scatter) and accumulated there, and the model's activation layout sees the
  whole batch.
  """
  per_replica = specs is None and model_state is None
  vmap_axes = data_axes if per_replica else ()
  inner_axes = () if per_replica else data_axes
  grad_fn = _state_grad(scaled_loss)
  replicas = sharding_lib.axis_size(mesh, vmap_axes)
  inner = sharding_lib.axis_size(mesh, inner_axes)
  micro_batches = _split_microbatches(batch, num_microbatches, replicas, inner)
  piece_grad = (grad_fn if replicas == 1
                else jax.vmap(grad_fn, in_axes=(None, 0, 0, None)))
  lead = (vmap_axes,) if replicas > 1 else ()
  if mesh is not None:
    rows_spec = PartitionSpec(None, *lead, inner_axes or None)
    micro_batches = jax.tree_util.tree_map(
        lambda x: sharding_lib.constrain(x, rows_spec, mesh), micro_batches)
  keys = _microbatch_keys(rng, num_microbatches, replicas)
  first = jax.tree_util.tree_map(lambda x: x[0], micro_batches)
  first_key = None if keys is None else keys[0]
  grad_shapes, (loss_shape, tokens_shape, _) = jax.eval_shape(
      piece_grad, params, first, first_key, model_state)

  def on_replicas(carry):
    grads, (loss, tokens) = carry
    if mesh is None:
      return carry
    grads = _like_params(grads, specs, mesh, lead)
    if lead:
      loss, tokens = (sharding_lib.constrain(x, PartitionSpec(*lead), mesh)
                      for x in (loss, tokens))
    return grads, (loss, tokens)

  def body(carry, xs):
    carry, state = carry
    micro_batch, key = xs
    grads, (loss, tokens, state) = piece_grad(params, micro_batch, key, state)
    carry = _added(carry, (grads, (loss, tokens)))
    return (on_replicas(carry), state), None

  grads, loss, tokens = _zero_sums(grad_shapes, loss_shape, tokens_shape)
  ((grads, (loss, tokens)), model_state), _ = lax.scan(
      body, (on_replicas((grads, (loss, tokens))), model_state),
      (micro_batches, keys))
  if replicas > 1:
    grads, loss, tokens = jax.tree_util.tree_map(
        lambda x: jnp.sum(x, axis=0), (grads, loss, tokens))
    grads = _like_params(grads, specs, mesh)
  return _Sums(grads, loss, tokens, num_microbatches * replicas, model_state)


def _averaged(sums: _Sums, per_token_loss: bool, rows: int) -> Gradients:
  """The mean of ``sums``: divided by the token count with ``per_token_loss`` (a step
  with no tokens keeps its zeros), else by the number of losses added; the token
  count is then the batch's ``rows``."""
  grads, loss, tokens = sums.grads, sums.loss, sums.tokens
  if per_token_loss:
    tokens = tokens.astype(_token_dtype(jnp.result_type(tokens)))
    inv = 1.0 / jnp.maximum(tokens.astype(jnp.float32), 1.0)
  else:
    tokens = jnp.asarray(rows, jnp.int32)
    inv = 1.0 / sums.pieces
  if per_token_loss or sums.pieces > 1:
    grads = jax.tree_util.tree_map(lambda g: g * inv, grads)
    loss = loss * inv
  return Gradients(grads, loss, tokens)


def _float32_sums(scaled_loss: Callable, policy: policy_lib.Policy, params: Any,
                  batch: Any, rng: Optional[jax.Array], mesh: Mesh,
                  data_axes: tuple[str, ...], specs: Any, num_microbatches: int,
                  model_state: Any = None, merge_state: Optional[Callable] = None
                 ) -> _Sums:
  """`accumulate_gradients` with ``grad_reduce_dtype=float32`` over several data
  replicas: the sums of the gradients, losses and token counts over every micro-batch
  and data replica, the gradients summed in float32.

  A ``shard_map`` manual over the data axes and automatic over the others (a tensor
  split stays GSPMD's, and so does the model's activation layout, whose
  `mpscale.sharding.constrain` drops the manual axes). On each device::

    p = params                                  # this device's shard, varying
    g = 0                                       # float32, p's shape
    for micro_batch in split(this replica's rows):   # a lax.scan
      # FSDP: each split leaf cast and all-gathered where the loss uses it
      # (batch_split.gather_where_used: a layer at a time, again for the
      # backward), its gradient reduce-scattered there in float32
      d = grad(scaled_loss)(p, micro_batch)     # these rows only: no sum yet
      g += float32(d)
    g = psum(g, the data axes that split no dimension)  # float32 all-reduce, once

  Without a split leaf the gradient is taken with respect to the cast parameters:
  the same numbers as through the cast (its transpose only widens). FSDP gathers the
  compute dtype and sums in float32. Micro-batch ``k`` of replica ``r`` draws from
  ``replica_key(microbatch_key(rng, k), r)``, as on the vmapped path.

  FP8 scaling state (``model_state``, an ``_overwrite_with_gradient`` collection)
  runs through the micro-batches: each replica's update of it is gathered from
  every replica and merged (``merge_state``), so each micro-batch records the
  global amaxes, as the other paths do.
  """
  grad_fn = _state_grad(scaled_loss)
  layout = (jax.tree_util.tree_map(lambda _: PartitionSpec(), params)
            if specs is None else specs)
  manual = jax.tree_util.tree_map(
      lambda spec: sharding_lib.only_axes(spec, data_axes), layout,
      is_leaf=sharding_lib.is_spec)
  keys = None if rng is None else jax.random.key_data(jax.vmap(
      lambda k: keys_lib.microbatch_key(rng, k))(jnp.arange(num_microbatches)))

  def vary(tree):
    return sharding_lib.cast_varying(tree, data_axes)

  dims = jax.tree_util.tree_map(
      lambda spec: tuple(sharding_lib.split_dims(spec, data_axes)), manual,
      is_leaf=sharding_lib.is_spec)
  split = any(jax.tree_util.tree_leaves(dims))
  if split and model_state is not None:
    # Its custom VJP is replayed on gathered (device-varying) weights that it was
    # traced invariant on: not supported yet.
    raise validation.ArgumentError(
        ("grad_reduce_dtype", "param_specs", "model_state"),
        "{0}=float32 with {1} splitting parameters over the data axes (FSDP) takes "
        "no FP8 scaling {2} yet; pass {0}=None, or keep the parameters whole")
  # FSDP: the masters' shards, each cast and gathered where the loss uses it.
  shard_grad = _state_grad(batch_split_lib.gather_where_used(scaled_loss, dims))

  def merged(state, old):
    """The replicas' updates of the FP8 state, gathered and merged (the same
    everywhere; a product no replica ran keeps its old state)."""
    if state is None:
      return None
    _, update = fp8_lib.split_overwrite(state)
    updates = jax.tree_util.tree_map(
        lambda x: lax.all_gather(x, data_axes, axis=0, tiled=False), update)
    new = _reached(merge_state(updates), fp8_lib.split_overwrite(old)[1])
    return fp8_lib.join_overwrite(state, new)

  def per_device(params, batch, keys, model_state):
    p = vary(params if split else policy.cast_to_compute(params))
    micro_batches = _split_microbatches(batch, num_microbatches, 1)
    if keys is not None:
      replica = sharding_lib.replica_index(data_axes)
      keys = jax.vmap(lambda k: keys_lib.replica_key(
          jax.random.wrap_key_data(k), replica))(vary(keys))
    grad = shard_grad if split else grad_fn

    def body(carry, xs):
      carry, state = carry
      micro_batch, key = xs
      grads, (loss, tokens, new_state) = grad(p, micro_batch, key, state)
      new = (jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads), loss,
             tokens)
      return (_added(carry, new), merged(new_state, state)), None

    first = jax.tree_util.tree_map(lambda x: x[0], (micro_batches, keys))
    state = None if model_state is None else vary(model_state)
    _, (loss_shape, tokens_shape, _) = jax.eval_shape(grad, p, *first, state)
    zeros = vary(_zero_sums(p, loss_shape, tokens_shape))
    ((grads, loss, tokens), state), _ = lax.scan(body, (zeros, state),
                                                 (micro_batches, keys))
    grads = jax.tree_util.tree_map(
        lambda g, spec: _psum_over(g, tuple(
            a for a in data_axes if a not in sharding_lib.spec_axes(spec))),
        grads, manual, is_leaf=sharding_lib.is_spec)
    # The merged state is the same on every replica: one copy each, the first kept.
    copies = jax.tree_util.tree_map(lambda x: x[None], state)
    return grads, lax.psum(loss, data_axes), lax.psum(tokens, data_axes), copies

  batch_spec = sharding_lib.batch_sharding(mesh, data_axes).spec
  state_specs = jax.tree_util.tree_map(lambda _: PartitionSpec(data_axes),
                                       model_state)
  fn = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(manual, jax.tree_util.tree_map(lambda _: batch_spec, batch),
                None if keys is None else PartitionSpec(),
                jax.tree_util.tree_map(lambda _: PartitionSpec(), model_state)),
      out_specs=(manual, PartitionSpec(), PartitionSpec(), state_specs),
      axis_names=set(data_axes))
  grads, loss, tokens, copies = fn(params, batch, keys, model_state)
  new_state = jax.tree_util.tree_map(lambda x: x[0], copies)
  return _Sums(_like_params(grads, specs, mesh), loss, tokens,
               num_microbatches * sharding_lib.axis_size(mesh, data_axes), new_state)


def _psum_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return lax.psum(x, axes) if axes else x


def _key_data(rng: Any) -> jax.Array:
  """A seed or key as raw key data (``uint32``), what a `TrainState` stores: plain
  arrays checkpoint with any library."""
  if isinstance(rng, (int, np.integer)):
    return jax.random.key_data(jax.random.key(int(rng)))
  if isinstance(rng, jax.ShapeDtypeStruct):
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
      return jax.eval_shape(jax.random.key_data, rng)
    return rng
  if jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  if jnp.result_type(rng) != jnp.uint32:
    raise TypeError(f"rng must be an int seed or a PRNG key; got {rng!r}")
  return jnp.asarray(rng)


def _loss_extras(key: Any, state: Any) -> dict[str, Any]:
  """The keywords a loss is called with: ``rng`` and ``model_state`` when it has them."""
  extras = {}
  if key is not None:
    extras["rng"] = key
  if state is not None:
    extras["model_state"] = state
  return extras


def _split_state_output(out: Any, state: Any) -> tuple[Any, Any]:
  """A stateful loss's ``(out, new_state)``, the state in its old dtypes.

  Raises:
    TypeError: if ``out`` is no pair, or the new state's structure differs.
  """
  if not isinstance(out, (tuple, list)) or len(out) != 2:
    raise TypeError("with a model_state, loss_fn(params, batch, model_state=...) must "
                    "return (loss, new_model_state), where loss is what it returns "
                    f"without one; got {type(out).__name__}")
  out, new_state = out
  if (jax.tree_util.tree_structure(new_state)
      != jax.tree_util.tree_structure(state)):
    raise TypeError("loss_fn returned a new model_state whose structure differs from "
                    f"the one it was given: {jax.tree_util.tree_structure(new_state)} "
                    f"vs {jax.tree_util.tree_structure(state)}")
  new_state = jax.tree_util.tree_map(
      lambda new, old: jnp.asarray(new).astype(jnp.result_type(old)), new_state, state)
  return out, new_state


def _token_dtype(dtype: Any) -> Any:
  """Token counts add up in int32 (exact) or, when floating, in float32."""
  return jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32


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


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where every array of a step lives on the mesh (``mesh=None``: one device)."""
  mesh: Optional[Mesh]
  data_axes: tuple[str, ...]
  param_specs: Any
  zero1: bool
  pipeline: Optional[pipeline_lib.Pipeline]

  def specs(self, params: Any) -> Any:
    """The params' specs, checked (a pipeline adds its stage axis)."""
    specs = sharding_lib.resolve_specs(self.param_specs, params)
    if self.pipeline is not None:
      specs = self.pipeline.param_specs(params, specs)
    sharding_lib.check_specs(params, specs, self.mesh)
    return specs

  def state(self, state: TrainState) -> Optional[TrainState]:
    """``NamedSharding``s for a `TrainState` (of arrays or shapes)."""
    if self.mesh is None:
      return None
    params = self.specs(state.params)
    opt = sharding_lib.state_specs(state.opt_state, state.params, params)
    # FSDP shards the optimizer state over its data axes too (a moment the spec of
    # its parameter leaves unsplit: a factored one); ZeRO-1 over every data axis.
    used = {a for s in jax.tree_util.tree_leaves(params, is_leaf=sharding_lib.is_spec)
            for a in sharding_lib.spec_axes(s)}
    over = self.data_axes if self.zero1 else tuple(a for a in self.data_axes
                                                   if a in used)
    if over:
      opt = sharding_lib.zero1_specs(state.opt_state, opt, self.mesh, over)
    # The model state and the key are replicated: every device holds them whole.
    model_state = jax.tree_util.tree_map(lambda _: PartitionSpec(), state.model_state)
    rng = None if state.rng is None else PartitionSpec()
    return TrainState(*sharding_lib.shardings(
        self.mesh, (params, opt, PartitionSpec(), model_state, rng)))

  def batch(self) -> Optional[NamedSharding]:
    if self.mesh is None:
      return None
    return sharding_lib.batch_sharding(self.mesh, self.data_axes)

  def constrain(self, tree: Any, shardings: Any = None) -> Any:
    """``tree`` constrained to ``shardings`` (default: replicated)."""
    if self.mesh is None:
      return tree
    if shardings is None:
      shardings = jax.tree_util.tree_map(
          lambda _: NamedSharding(self.mesh, PartitionSpec()), tree)
    return lax.with_sharding_constraint(tree, shardings)


def _gradient_source(loss_fn: Any, layout: _Layout, policy: policy_lib.Policy,
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
          grad_reduce_dtype=reduce_dtype if _sums_in_float32(policy, reduce_dtype)
          else None, model_state=layer_state)
      grads, new_state = out if layer_state is not None else (out, None)
      if not per_token_loss:
        grads = grads._replace(num_tokens=jnp.asarray(
            sharding_lib.batch_rows(batch), jnp.int32))
      if new_state is not None:
        written = _reached(new_state, layer_state)
        new_state = fp8_lib.join_overwrite(
            fp8_lib.split_overwrite(model_state)[0], {loss_fn.stages_key: written})
      return grads, new_state
    return pipelined

  def accumulated(params, batch, scale, rng, model_state):
    out = accumulate_gradients(
        loss_fn, params, batch, loss_scale=scale, policy=policy,
        num_microbatches=num_microbatches, per_token_loss=per_token_loss,
        mesh=layout.mesh, data_axis=layout.data_axes or "data",
        param_specs=None if layout.param_specs is None else layout.specs(params),
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
  collection = (fp8_lib.split_overwrite(model_state)
                if isinstance(model_state, Mapping) else (model_state, None))
  rest, overwrite = collection
  if rest or not isinstance(overwrite, Mapping) or set(overwrite) != {
      pipeline.stages_key}:
    raise validation.fail(
        "model_state", f" of a Pipeline must be {{{fp8_lib.OVERWRITE_WITH_GRADIENT!r}: "
        f"{{{pipeline.stages_key!r}: the layers' states}}}} (FP8 scaling state, "
        "stacked as the layers are): a pipeline's stages pass no other state; got "
        f"the keys {sorted(model_state) if isinstance(model_state, Mapping) else None}")
  return overwrite[pipeline.stages_key]


def _skipped_total(opt_state: Any) -> jax.Array:
  """The wrapper's count of skipped steps."""
  return opt_state_lib.find(opt_state, skip_lib.SkipNonfiniteState)[0].skipped


def _check_spikes_inside(opt_state: Any) -> None:
  """A `skip_spikes` sits inside the loss-scale (or skip) wrapper: around it, it
  would judge scaled gradients and its skips would go uncounted (``skipped``, the
  model state)."""
  for spikes_state in opt_state_lib.find(opt_state, spikes_lib.SkipSpikesState):
    if opt_state_lib.find(spikes_state.inner_state, skip_lib.SkipNonfiniteState):
      raise validation.fail(
          "optimizer", ": skip_spikes wraps a loss-scale or skip_nonfinite wrapper; "
          "put it inside instead, e.g. dynamic_loss_scale(skip_spikes(inner))")


def _check_step_inputs(model: LossFn, policy: policy_lib.Policy, tx: Any,
                       state: TrainState, batch: Any, data_size: int,
                       num_microbatches: int, per_token_loss: bool) -> None:
  """At trace time: the batch divides, the state matches the optimizer, and the loss
  function returns the structure ``per_token_loss`` asks for."""
  sharding_lib.batch_rows(batch, data_size, num_microbatches)
  expected = jax.tree_util.tree_structure(
      jax.eval_shape(tx.init, _shapes(state.params)))
  if jax.tree_util.tree_structure(state.opt_state) != expected:
    raise ValueError("state.opt_state does not match the optimizer passed to "
                     "make_train_step; build the state with its init()")
  _check_spikes_inside(state.opt_state)
  micro_batch = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(
          (x.shape[0] // num_microbatches,) + x.shape[1:] if x.shape else (),
          x.dtype), batch)
  key = None if state.rng is None else jax.eval_shape(keys_lib.typed, state.rng)

  _check_takes(model, sorted(_loss_extras(key, state.model_state)))

  def call(p, b, k, model_state):
    out = model(policy.cast_to_compute(p), b, **_loss_extras(k, model_state))
    if model_state is not None:
      out, _ = _split_state_output(out, model_state)
    return out

  closed, out_shape = jax.make_jaxpr(call, return_shape=True)(
      _shapes(state.params), micro_batch, key, _shapes(state.model_state))
  _check_loss_structure(out_shape, per_token_loss)
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


def _adopt_opt_state(optimizer: optax.GradientTransformation, params: Any,
                     opt_state: Any) -> Any:
  """``opt_state`` in the structure of the wrapped optimizer's state."""
  wrapped = _wrapped(optimizer, params)
  expected = jax.tree_util.tree_structure(
      jax.eval_shape(wrapped.init, _shapes(params)))
  if jax.tree_util.tree_structure(opt_state) == expected:
    return opt_state
  if wrapped is not optimizer:
    inner = jax.tree_util.tree_structure(
        jax.eval_shape(optimizer.init, _shapes(params)))
    if jax.tree_util.tree_structure(opt_state) == inner:
      fresh = wrapped.init(params)
      return fresh._replace(skip_state=fresh.skip_state._replace(inner_state=opt_state))
  raise ValueError("the given opt_state does not match the optimizer passed to "
                   "make_train_step (its tree structure differs)")


def _init_state(optimizer: optax.GradientTransformation, policy: policy_lib.Policy,
                layout: _Layout, params_or_state: Any, model_state: Any = None,
                rng: Any = None, model_state_dtype: Any = jnp.float32) -> TrainState:
  """`make_train_step`'s ``init``: a placed `TrainState` in fresh buffers."""
  given = None
  if isinstance(params_or_state, TrainState) or _is_flax_state(params_or_state):
    given = (params_or_state if isinstance(params_or_state, TrainState)
             else TrainState.from_flax(params_or_state))
    for name, value in (("model_state", model_state), ("rng", rng)):
      if value is not None and getattr(given, name) is not None:
        raise ValueError(f"init got {name}= and a state that holds one; pass one")
    model_state = given.model_state if model_state is None else model_state
    rng = given.rng if rng is None else rng
  model_state = _cast_model_state(model_state, model_state_dtype)
  rng = None if rng is None else _key_data(rng)

  def fresh_state(params, model_state, rng):
    return TrainState(params, _wrapped(optimizer, params).init(params),
                      jnp.zeros((), jnp.int32), model_state, rng)

  if given is None and _is_abstract(params_or_state):
    return _abstract_state(layout, jax.eval_shape(
        lambda p, m, r: fresh_state(policy.cast_to_param(p), m, r),
        params_or_state, model_state, rng))
  if given is not None:
    params = policy.cast_to_param(given.params)
    state = TrainState(params, _adopt_opt_state(optimizer, params, given.opt_state),
                       jnp.asarray(given.step, jnp.int32), model_state, rng)
    shardings = layout.state(_shapes(state))
    if shardings is not None:
      state = jax.device_put(state, shardings)
    # A jit copy gives every leaf its own new buffer: the step donates its input,
    # which must neither free the caller's arrays nor meet one buffer twice (an
    # eagerly built optimizer state can share one array between fields).
    state = jax.jit(lambda s: s, out_shardings=shardings)(state)
  else:
    params = policy.cast_to_param(params_or_state)
    shardings = layout.state(jax.eval_shape(fresh_state, _shapes(params),
                                            _shapes(model_state), _shapes(rng)))
    if shardings is not None:
      params, model_state, rng = jax.device_put(
          (params, model_state, rng),
          (shardings.params, shardings.model_state, shardings.rng))
    # jit returns new buffers, so donating the state never frees ``params``.
    state = jax.jit(fresh_state, out_shardings=shardings)(params, model_state, rng)
  _check_finite_params(state.params)
  _warn_if_unscaled(policy, state.opt_state)
  return state


def _cast_model_state(model_state: Any, dtype: Any) -> Any:
  """The model state with its floating leaves in ``dtype`` (``None``: as they are)."""
  if model_state is None or dtype is None:
    return model_state

  def cast(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return (jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
              if jnp.issubdtype(x.dtype, jnp.floating) else x)
    x = jnp.asarray(x)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree_util.tree_map(cast, model_state)


def _is_abstract(tree: Any) -> bool:
  """Whether ``tree`` is shapes only (``jax.ShapeDtypeStruct`` leaves, at least one)."""
  leaves = jax.tree_util.tree_leaves(tree)
  return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _abstract_state(layout: _Layout, state: TrainState) -> TrainState:
  """The `TrainState` ``init`` would build, as ``ShapeDtypeStruct``s with the
  shardings it would place it in: what ``step.lower`` needs to compile ahead of time,
  with nothing allocated."""
  shardings = layout.state(state)
  if shardings is None:
    return state
  return jax.tree_util.tree_map(
      lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      state, shardings)


def _check_finite_params(params: Any) -> None:
  """Raises ``ValueError`` naming the first parameter holding a NaN or an Inf.

  One host sync, at ``init`` only: a model that starts non-finite would otherwise
  skip every step without a word.
  """
  flags = jax.tree_util.tree_map(
      lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
      else jnp.asarray(True), params)
  for path, ok in jax.tree_util.tree_leaves_with_path(jax.device_get(flags)):
    if not ok:
      raise ValueError(f"initial parameter {norms_lib.path_str(path)!r} holds a NaN "
                       "or an Inf")


def _warn_if_unscaled(policy: policy_lib.Policy, opt_state: Any) -> None:
  if not policy.needs_loss_scaling:
    return
  states = opt_state_lib.find(opt_state, loss_scale_lib.LossScaleState)
  scale = states[0].loss_scale if states else None
  unscaled = scale is None
  if scale is not None and not isinstance(scale, jax.core.Tracer):
    unscaled = float(scale) == 1.0
  if unscaled:
    warnings.warn(
        f"policy {policy} computes in float16 but the optimizer has no loss scaling "
        "(scale 1): small float16 gradients will flush to zero. Wrap the optimizer in "
        "mpscale.dynamic_loss_scale, e.g. with mpscale.loss_scale_for(policy, optimizer).",
        stacklevel=3)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    policy: Union[None, str, policy_lib.Policy] = None,
                    mesh: Optional[Mesh] = None, data_axis: DataAxis = "data",
                    num_microbatches: int = 1, per_token_loss: bool = False,
                    shard_optimizer_state: bool = False,
                    param_specs: sharding_lib.SpecsLike = None, donate: bool = True,
                    model_state_dtype: Any = jnp.float32,
                    grad_reduce_dtype: Any = None,
                    merge_state: Optional[Callable] = None
                   ) -> tuple[Callable[..., TrainState],
                              Callable[[TrainState, Any], tuple[TrainState, dict]]]:
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
    policy: a `mpscale.Policy` or a name for `mpscale.get_policy`; default float32.
    mesh: a ``jax.sharding.Mesh``, or ``None`` for one device.
    data_axis: the mesh axis (or tuple of axes, e.g. ``("data", "fsdp")``) the batch
      is sharded over.
    num_microbatches: gradient accumulation: the batch's leading dimension is split
      into this many micro-batches under one loss scale, with one optimizer update
      (a `Pipeline`'s are its own: 1 or the same number here).
    per_token_loss: the gradient is divided by the token count summed over all
      micro-batches and data replicas (Megatron ``calculate_per_token_loss``).
    shard_optimizer_state: ZeRO-1: also shard each optimizer-state leaf over the data
      axes its spec does not use. Needs a mesh. Results are the same as unsharded.
    param_specs: the parameters' layout on ``mesh``: a pytree of ``PartitionSpec``
      like the params (or a prefix of it), a function ``(key_path, leaf) ->
      PartitionSpec``, or `mpscale.sharding.logical_specs`; ``None``: replicated (a
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
      ``functools.partial(mpscale.fp8.merge_stacked, recipe=recipe)``). A
      `Pipeline` merges its own (its ``merge_state``).

  Returns:
    ``(init, step)``: ``init(params | flax TrainState | TrainState, *,
    model_state=None, rng=None) -> TrainState`` (given ``jax.ShapeDtypeStruct``s, the
    state's shapes and shardings, allocating nothing) and ``step(state, batch) ->
    (state, metrics)``, ``metrics`` a dict of device arrays: ``loss`` (unscaled),
    ``num_tokens``, ``loss_scale`` (this step's) and `mpscale.metrics.StepMetrics`'
    (``overflow``, ``skipped``, ``global_norm``, ``group_norms``, ...).

  Raises:
    ValueError: for a mesh without ``data_axis``; ``shard_optimizer_state`` without a
      mesh; a ``grad_reduce_dtype`` other than ``None`` or float32 (an
      `mpscale.ArgumentError` naming it); by ``init``, ``param_specs`` that do not fit
      the params or the mesh (`mpscale.sharding.check_specs`); and, when ``step``
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
  policy = policy_lib.Policy() if policy is None else policy_lib.get_policy(policy)
  validation.positive_int("num_microbatches", num_microbatches)
  validation.boolean("per_token_loss", per_token_loss)
  validation.boolean("shard_optimizer_state", shard_optimizer_state)
  validation.boolean("donate", donate)
  data_axes = sharding_lib.data_axes(mesh, data_axis)
  if shard_optimizer_state and mesh is None:
    raise ValueError("shard_optimizer_state=True needs a mesh")
  if param_specs is not None and mesh is None:
    raise ValueError("param_specs needs a mesh")
  pipeline = loss_fn if isinstance(loss_fn, pipeline_lib.Pipeline) else None
  if pipeline is not None:
    num_microbatches = _check_pipeline(pipeline, mesh, num_microbatches)
  reduce_dtype = gradients_lib.check_grad_reduce_dtype(grad_reduce_dtype)
  layout = _Layout(mesh, data_axes, param_specs, shard_optimizer_state, pipeline)
  if merge_state is not None:
    validation.function("merge_state", merge_state)
  gradients = _gradient_source(loss_fn, layout, policy, num_microbatches,
                               per_token_loss, reduce_dtype, merge_state)
  model = _pipeline_model(pipeline) if pipeline is not None else loss_fn
  data_size = sharding_lib.axis_size(mesh, data_axes)

  if model_state_dtype is not None:
    model_state_dtype = jnp.dtype(model_state_dtype)

  def init(params_or_state: Any, *, model_state: Any = None,
           rng: Any = None) -> TrainState:
    given = (model_state if model_state is not None
             else getattr(params_or_state, "model_state", None))
    if pipeline is not None and given is not None:
      pipeline.check_model_state(_pipeline_state(pipeline, given))
    if (pipeline is None and _sums_in_float32(policy, reduce_dtype)
        and given is not None):
      _check_mergeable(given, merge_state)
    return _init_state(optimizer, policy, layout, params_or_state, model_state, rng,
                       model_state_dtype)

  def step_fn(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    tx = _wrapped(optimizer, state.params)
    _check_step_inputs(model, policy, tx, state, batch, data_size, num_microbatches,
                       per_token_loss)
    scale = loss_scale_lib.loss_scale_of(state.opt_state)
    key = None if state.rng is None else keys_lib.step_key(state.rng, state.step)
    (grads, loss, num_tokens), model_state = gradients(
        state.params, batch, scale, key, state.model_state)
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
    new_state = TrainState(params, opt_state, state.step + 1, model_state, state.rng)
    new_state = layout.constrain(new_state, layout.state(new_state))
    metrics = metrics_lib.step_metrics(opt_state)
    metrics.update(loss=loss, num_tokens=num_tokens, loss_scale=scale)
    return new_state, layout.constrain(metrics)

  # The state keeps the sharding it arrives with (init's); the batch is placed, from
  # host memory, straight into its data-parallel sharding.
  jit_kwargs: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
  if mesh is not None:
    jit_kwargs["in_shardings"] = (None, layout.batch())
  return init, jax.jit(step_fn, **jit_kwargs)
