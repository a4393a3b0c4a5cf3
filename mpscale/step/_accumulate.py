"""Gradients over micro-batches and data replicas: `accumulate_gradients`.

One call::

  g = 0                                               # float32, shaped like params
  for micro_batch in split(batch, num_microbatches):  # a lax.scan
    g += grad(scale * loss_fn(policy.cast_to_compute(params), micro_batch))
  g /= num_microbatches          # or / total token count, with per_token_loss

Three strategies add the losses and float32 gradients up, and `averaged` divides:

* one micro-batch (`single_gradient`): one gradient of the whole batch; under a mesh
  GSPMD all-reduces (or reduce-scatters) it once;
* several (`microbatch_scan`): a ``lax.scan``; with replicated parameters each data
  replica accumulates its own gradient (``jax.vmap`` over the replicas) and the
  replicas are summed once after the loop, with laid-out parameters (or a model
  state that must see the whole micro-batch) each micro-batch's gradient is reduced
  into the parameters' layout;
* every sum in float32 (``grad_reduce_dtype=float32``, ``float32_sums``): a
  ``shard_map`` manual over the data axes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec
import numpy as np

from mpscale import _tree
from mpscale import gradients as gradients_lib
from mpscale import keys as keys_lib
from mpscale import validation
from mpscale.gradients import Gradients
from mpscale.parallel import _batch_split as batch_split_lib
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale.parallel import _padding as padding_lib
from mpscale.precision import _fp8 as fp8_lib
from mpscale.precision import _fp8_state as fp8_state_lib
from mpscale.precision import _policy as policy_lib
from mpscale.step import _float32_sums as float32_lib
from mpscale.step import _sums as sums_lib

LossFn = Callable[[Any, Any], Any]
"""``loss_fn(params, batch) -> loss``: see `make_train_step`."""
DataAxis = Union[str, tuple[str, ...]]
"""A mesh axis, or a tuple of them."""


def check_loss_structure(out: Any, per_token_loss: bool) -> None:
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


def sums_in_float32(policy: policy_lib.Policy, reduce_dtype: Optional[np.dtype]
                    ) -> bool:
  """Whether the gradient sums must be moved to float32: asked for, and the compute
  dtype is narrower (under float32 compute they are float32 already)."""
  return reduce_dtype is not None and jnp.finfo(policy.compute_dtype).bits < 32


def check_mergeable(model_state: Any, merge_state: Optional[Callable]) -> None:
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
        "the replicas' updates (functools.partial(mpscale.precision.merge_stacked, "
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

  FP8 scaling state (`mpscale.precision`): a model state holding an
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
    params: the master parameters (a padded state's may hold
      `mpscale.parallel.Padded` leaves: the gradients are of the true shapes).
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
      `mpscale.parallel`), or ``None`` for replicated params.
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
      `mpscale.parallel.constrain`, which drops the manual data axes. Under a
      float32 compute dtype the sums are float32 already and nothing changes. A
      ``model_state`` refuses it (synchronized BatchNorm makes each micro-batch's
      gradient span every replica's rows), except FP8 scaling state alone (an
      ``_overwrite_with_gradient`` collection) with ``merge_state``.
    merge_state: how updates of an FP8 scaling state from data replicas that
      differentiate their own rows combine (``grad_reduce_dtype=float32``):
      ``merge_state(updates)``, ``updates`` the collection with a leading axis of
      replicas (``functools.partial(mpscale.precision.merge_stacked, recipe=recipe)``).
      Each micro-batch's updates are gathered from the replicas and merged, so
      every replica carries the state on as the global micro-batch records it.

  Returns:
    `Gradients` ``(grads, loss, num_tokens)``; with a ``model_state``, the pair
    ``(Gradients, new_model_state)`` (the state after the last micro-batch, in the
    leaves' own dtypes).
  """
  policy = policy_lib.Policy() if policy is None else policy_lib.make_policy(policy)
  validation.positive_int("num_microbatches", num_microbatches)
  scale = jnp.asarray(loss_scale, jnp.float32)
  data_axes = mesh_lib.data_axes(mesh, data_axis)
  data_size = layouts_lib.axis_size(mesh, data_axes)
  rows = mesh_lib.batch_rows(batch, data_size, num_microbatches)
  stored, padded = params, padding_lib.holds_padding(params)
  specs = (layouts_lib.resolve_specs(param_specs, padding_lib.unpad(
      _tree.shapes(params)) if padded else params)
           if mesh is not None and param_specs is not None else None)
  rng = None if rng is None else keys_lib.typed(rng)
  stateful = model_state is not None
  wide = sums_in_float32(
      policy, gradients_lib.check_grad_reduce_dtype(grad_reduce_dtype))
  if wide and stateful:
    check_mergeable(model_state, merge_state)

  # Laid-out parameters: activations stay split over the batch, so GSPMD gathers
  # weights (FSDP's all-gather, a layer at a time) rather than activations.
  model = (batch_split_lib.keep_batch_split(loss_fn, mesh, data_axes, specs)
           if specs is not None and not wide else loss_fn)
  if padded and not wide:  # each Padded leaf cut where it lives
    params = sums_lib.like_params(padding_lib.unpad(stored), specs, mesh)
  scaled_loss = sums_lib.scaled_loss(model, policy, scale, per_token_loss, stateful)
  # Three strategies add up the losses and float32 gradients; averaged divides.
  if wide and data_size > 1:
    sums = float32_lib.float32_sums(scaled_loss, policy, stored, batch, rng, mesh, data_axes,
                         specs, num_microbatches, model_state, merge_state)
  elif num_microbatches == 1:
    sums = _single_gradient(scaled_loss, params, batch, rng, model_state, mesh, specs)
  else:
    sums = _microbatch_scan(scaled_loss, params, batch, rng, model_state, mesh,
                            data_axes, specs, num_microbatches)
  gradients = sums_lib.averaged(sums, per_token_loss, rows)
  return gradients if not stateful else (gradients, sums.model_state)


def _single_gradient(scaled_loss: Callable, params: Any, batch: Any,
                     rng: Optional[jax.Array], model_state: Any, mesh: Optional[Mesh],
                     specs: Any) -> sums_lib.Sums:
  """`accumulate_gradients` with one micro-batch: one gradient of the whole batch,
  widened to float32. Under a mesh GSPMD all-reduces (or reduce-scatters) it once."""
  key = None if rng is None else keys_lib.microbatch_key(rng, 0)
  grads, (loss, tokens, model_state) = fp8_state_lib.grad_with_overwrite(scaled_loss)(
      params, batch, key, model_state)
  grads = sums_lib.like_params(
      jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads), specs, mesh)
  return sums_lib.Sums(grads, loss, tokens, 1, model_state)


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
                    ) -> sums_lib.Sums:
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
  grad_fn = fp8_state_lib.grad_with_overwrite(scaled_loss)
  replicas = layouts_lib.axis_size(mesh, vmap_axes)
  inner = layouts_lib.axis_size(mesh, inner_axes)
  micro_batches = sums_lib.split_microbatches(batch, num_microbatches, replicas, inner)
  piece_grad = (grad_fn if replicas == 1
                else jax.vmap(grad_fn, in_axes=(None, 0, 0, None)))
  lead = (vmap_axes,) if replicas > 1 else ()
  if mesh is not None:
    rows_spec = PartitionSpec(None, *lead, inner_axes or None)
    micro_batches = jax.tree_util.tree_map(
        lambda x: mesh_lib.constrain(x, rows_spec, mesh), micro_batches)
  keys = _microbatch_keys(rng, num_microbatches, replicas)
  first = jax.tree_util.tree_map(lambda x: x[0], micro_batches)
  first_key = None if keys is None else keys[0]
  grad_shapes, (loss_shape, tokens_shape, _) = jax.eval_shape(
      piece_grad, params, first, first_key, model_state)

  def on_replicas(carry):
    grads, (loss, tokens) = carry
    if mesh is None:
      return carry
    grads = sums_lib.like_params(grads, specs, mesh, lead)
    if lead:
      loss, tokens = (mesh_lib.constrain(x, PartitionSpec(*lead), mesh)
                      for x in (loss, tokens))
    return grads, (loss, tokens)

  def body(carry, xs):
    carry, state = carry
    micro_batch, key = xs
    grads, (loss, tokens, state) = piece_grad(params, micro_batch, key, state)
    carry = sums_lib.added(carry, (grads, (loss, tokens)))
    return (on_replicas(carry), state), None

  grads, loss, tokens = sums_lib.zero_sums(grad_shapes, loss_shape, tokens_shape)
  ((grads, (loss, tokens)), model_state), _ = lax.scan(
      body, (on_replicas((grads, (loss, tokens))), model_state),
      (micro_batches, keys))
  if replicas > 1:
    grads, loss, tokens = jax.tree_util.tree_map(
        lambda x: jnp.sum(x, axis=0), (grads, loss, tokens))
    grads = sums_lib.like_params(grads, specs, mesh)
  return sums_lib.Sums(grads, loss, tokens, num_microbatches * replicas, model_state)


