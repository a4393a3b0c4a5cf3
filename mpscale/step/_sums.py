"""What every gradient strategy of `accumulate_gradients` shares: the function it
differentiates (`scaled_loss`), the micro-batches it cuts (`split_microbatches`),
and the float32 sums it adds up (`Sums`) before `averaged` divides them."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mpscale.gradients import Gradients
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale.precision import _policy as policy_lib


def split_microbatches(batch: Any, num_microbatches: int, num_replicas: int,
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


class Sums(NamedTuple):
  """What a strategy of `accumulate_gradients` adds up, before `averaged` divides."""
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


def scaled_loss(model: Callable, policy: policy_lib.Policy, scale: jax.Array,
                 per_token_loss: bool, stateful: bool) -> Callable:
  """``scaled_loss(params, micro_batch, key, state) -> (scale * loss, (loss, tokens,
  new_state))``: the function every strategy differentiates, ``model`` called on the
  parameters cast to the compute dtype, its loss in float32."""
  def scaled_loss(p, micro_batch, key, state):
    out = model(policy.cast_to_compute(p), micro_batch, **loss_extras(key, state))
    if stateful:
      out, state = split_state_output(out, state)
    loss, tokens = out if per_token_loss else (out, 0)
    loss = jnp.asarray(loss).astype(jnp.float32)
    return scale * loss, (loss, jnp.asarray(tokens), state)
  return scaled_loss


def like_params(grads: Any, specs: Any, mesh: Optional[Mesh],
                 leading: tuple[Any, ...] = ()) -> Any:
  """Constrains gradient-shaped trees to the params' layout ``specs`` (after
  ``leading`` dimensions); with no layout (``specs`` ``None``), ``grads``."""
  if specs is None:
    return grads
  return jax.tree_util.tree_map(
      lambda g, spec: mesh_lib.constrain(
          g, PartitionSpec(*leading, *layouts_lib.pad(spec, g.ndim - len(leading))),
          mesh), grads, specs)


def added(total: Any, new: Any) -> Any:
  """``total + new`` leaf by leaf, in ``total``'s dtypes (the float32 sums)."""
  return jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), total, new)


def zero_sums(grads: Any, loss: Any, tokens: Any) -> tuple[Any, jax.Array, jax.Array]:
  """Zero float32 gradients shaped like ``grads`` and a zero loss and token count of
  the shapes of ``loss`` and ``tokens``: where a ``lax.scan`` starts adding."""
  return (jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), grads),
          jnp.zeros(loss.shape, jnp.float32),
          jnp.zeros(tokens.shape, token_dtype(tokens.dtype)))


def averaged(sums: Sums, per_token_loss: bool, rows: int) -> Gradients:
  """The mean of ``sums``: divided by the token count with ``per_token_loss`` (a step
  with no tokens keeps its zeros), else by the number of losses added; the token
  count is then the batch's ``rows``."""
  grads, loss, tokens = sums.grads, sums.loss, sums.tokens
  if per_token_loss:
    tokens = tokens.astype(token_dtype(jnp.result_type(tokens)))
    inv = 1.0 / jnp.maximum(tokens.astype(jnp.float32), 1.0)
  else:
    tokens = jnp.asarray(rows, jnp.int32)
    inv = 1.0 / sums.pieces
  if per_token_loss or sums.pieces > 1:
    grads = jax.tree_util.tree_map(lambda g: g * inv, grads)
    loss = loss * inv
  return Gradients(grads, loss, tokens)


def loss_extras(key: Any, state: Any) -> dict[str, Any]:
  """The keywords a loss is called with: ``rng`` and ``model_state`` when it has them."""
  extras = {}
  if key is not None:
    extras["rng"] = key
  if state is not None:
    extras["model_state"] = state
  return extras


def split_state_output(out: Any, state: Any) -> tuple[Any, Any]:
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


def token_dtype(dtype: Any) -> Any:
  """Token counts add up in int32 (exact) or, when floating, in float32."""
  return jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32
