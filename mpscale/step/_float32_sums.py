"""Every gradient sum in float32 (``grad_reduce_dtype=float32``): `float32_sums`.

Megatron-LM's ``accumulate_allreduce_grads_in_fp32``: under a 16-bit compute dtype
each device takes the gradient of its own rows, widens it to float32 and accumulates
it over the micro-batches, and the replicas are summed in float32, FSDP's split
parameters reduce-scattered each micro-batch (as PyTorch FSDP's ``reduce_dtype``),
the others all-reduced once after the loop. A pipeline does the same inside its own
``shard_map`` (`mpscale.Pipeline.value_and_grad`'s ``grad_reduce_dtype``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from mpscale import keys as keys_lib
from mpscale.parallel import _fsdp as fsdp_lib
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale.parallel import _padding as padding_lib
from mpscale.precision import _fp8_state as fp8_state_lib
from mpscale.precision import _policy as policy_lib
from mpscale.step import _sums as sums_lib


def float32_sums(scaled_loss: Callable, policy: policy_lib.Policy, params: Any,
                  batch: Any, rng: Optional[jax.Array], mesh: Mesh,
                  data_axes: tuple[str, ...], specs: Any, num_microbatches: int,
                  model_state: Any = None, merge_state: Optional[Callable] = None
                 ) -> sums_lib.Sums:
  """`accumulate_gradients` with ``grad_reduce_dtype=float32`` over several data
  replicas: the sums of the gradients, losses and token counts over every micro-batch
  and data replica, the gradients summed in float32.

  A ``shard_map`` manual over the data axes and automatic over the others (a tensor
  split stays GSPMD's, and so does the model's activation layout, whose
  `mpscale.parallel.constrain` drops the manual axes). On each device::

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

  ``params`` may hold `mpscale.parallel.Padded` leaves (a padded state's): their
  padded arrays enter the ``shard_map`` split evenly, each gather is cut to the true
  shape the loss is traced on, and the gradients come back in the true shapes.

  FP8 scaling state (``model_state``, an ``_overwrite_with_gradient`` collection)
  runs through the micro-batches: each replica's update of it is gathered from
  every replica and merged (``merge_state``), so each micro-batch records the
  global amaxes, as the other paths do.
  """
  grad_fn = fp8_state_lib.grad_with_overwrite(scaled_loss)
  stored, params = params, padding_lib.padded_values(params)
  layout = (jax.tree_util.tree_map(lambda _: PartitionSpec(), params)
            if specs is None else specs)
  manual = jax.tree_util.tree_map(
      lambda spec: layouts_lib.only_axes(spec, data_axes), layout,
      is_leaf=layouts_lib.is_spec)
  keys = None if rng is None else jax.random.key_data(jax.vmap(
      lambda k: keys_lib.microbatch_key(rng, k))(jnp.arange(num_microbatches)))

  def vary(tree):
    return mesh_lib.cast_varying(tree, data_axes)

  def split_of(spec, leaf):  # a padded leaf's gathers cut to its true size
    true = leaf.shape if padding_lib.is_padded(leaf) else None
    return tuple((d, a) if true is None else (d, a, true[d])
                 for d, a in layouts_lib.split_dims(spec, data_axes))
  dims = jax.tree_util.tree_map(split_of, manual, stored, is_leaf=layouts_lib.is_spec)
  split = any(jax.tree_util.tree_leaves(dims, is_leaf=lambda x: isinstance(x, tuple)))
  # FSDP: the masters' shards, each cast and gathered where the loss uses it.
  shard_grad = fp8_state_lib.grad_with_overwrite(fsdp_lib.gather_where_used(scaled_loss, dims))

  def merged(state, old):
    """The replicas' updates of the FP8 state, gathered and merged (the same
    everywhere; a product no replica ran keeps its old state)."""
    if state is None:
      return None
    _, update = fp8_state_lib.split_overwrite(state)
    updates = jax.tree_util.tree_map(
        lambda x: lax.all_gather(x, data_axes, axis=0, tiled=False), update)
    new = fp8_state_lib.reached(merge_state(updates), fp8_state_lib.split_overwrite(old)[1])
    return fp8_state_lib.join_overwrite(state, new)

  def per_device(params, batch, keys, model_state):
    p = vary(params if split else policy.cast_to_compute(params))
    micro_batches = sums_lib.split_microbatches(batch, num_microbatches, 1)
    if keys is not None:
      replica = mesh_lib.replica_index(data_axes)
      keys = jax.vmap(lambda k: keys_lib.replica_key(
          jax.random.wrap_key_data(k), replica))(vary(keys))
    grad = shard_grad if split else grad_fn

    def body(carry, xs):
      carry, state = carry
      micro_batch, key = xs
      grads, (loss, tokens, new_state) = grad(p, micro_batch, key, state)
      new = (jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads), loss,
             tokens)
      return (sums_lib.added(carry, new), merged(new_state, state)), None

    first = jax.tree_util.tree_map(lambda x: x[0], (micro_batches, keys))
    state = None if model_state is None else vary(model_state)
    _, (loss_shape, tokens_shape, _) = jax.eval_shape(grad, p, *first, state)
    zeros = vary(sums_lib.zero_sums(p, loss_shape, tokens_shape))
    ((grads, loss, tokens), state), _ = lax.scan(body, (zeros, state),
                                                 (micro_batches, keys))
    grads = jax.tree_util.tree_map(
        lambda g, spec: _psum_over(g, tuple(
            a for a in data_axes if a not in layouts_lib.spec_axes(spec))),
        grads, manual, is_leaf=layouts_lib.is_spec)
    # The merged state is the same on every replica: one copy each, the first kept.
    copies = jax.tree_util.tree_map(lambda x: x[None], state)
    return grads, lax.psum(loss, data_axes), lax.psum(tokens, data_axes), copies

  batch_spec = mesh_lib.batch_sharding(mesh, data_axes).spec
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
  grads = padding_lib.unpad(padding_lib.rewrap(grads, stored))
  new_state = jax.tree_util.tree_map(lambda x: x[0], copies)
  return sums_lib.Sums(sums_lib.like_params(grads, specs, mesh), loss, tokens,
               num_microbatches * layouts_lib.axis_size(mesh, data_axes), new_state)


def _psum_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return lax.psum(x, axes) if axes else x
