"""FP8 scaling state after the products: merging updates, routing it through a step.

A product's updated state comes back as the *gradient* of its state (`mpscale.precision`'s
``_fp8``). Two things happen to it next:

* where micro-batches or data replicas differentiate apart (a ``scan``, a ``vmap``,
  a ``shard_map``), their updates of one old state combine into the one a single
  call on all the data records: `merge`, `merge_stacked`, `merge_across`;
* a step differentiates the ``_overwrite_with_gradient`` collection with the
  parameters and replaces it by its gradient (`split_overwrite`, `join_overwrite`,
  `grad_with_overwrite`); a state no product reached keeps its old value
  (`reached`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from mpscale import validation
from mpscale.precision._fp8 import (E4M3, E5M2, OVERWRITE_WITH_GRADIENT, Fp8Meta,
                                    Fp8Recipe, Fp8State, recipe_of, reduce_history,
                                    scale_from_amax, usable)


# ------------------------------------------------------------------ combining updates
def _is_state(x: Any) -> bool:
  return isinstance(x, Fp8State)


def _merged_meta(history: jax.Array, fallback: jax.Array, dtype: Any,
                 recipe: Fp8Recipe) -> Fp8Meta:
  """The meta of a merged history: the scale from it, else the old one."""
  algo = recipe.amax_compute if recipe.name == "delayed" else "most_recent"
  scale = scale_from_amax(reduce_history(history, algo), fallback, dtype, recipe.margin)
  return Fp8Meta(scale.astype(fallback.dtype), history)


def _valid(meta: Fp8Meta, recipe: Fp8Recipe) -> jax.Array:
  """Whether an update's own scale came from its amax (else it kept the old one)."""
  algo = recipe.amax_compute if recipe.name == "delayed" else "most_recent"
  return usable(reduce_history(meta.amax_history.astype(jnp.float32), algo))


def _map_states(fn, *trees, argname: str):
  """``fn(*states)`` on every `Fp8State` of ``trees`` (alike), checking that they
  hold nothing else."""
  def one(*nodes):
    if not all(map(_is_state, nodes)):
      raise validation.fail(argname, " must hold only Fp8State nodes (an "
                            f"{OVERWRITE_WITH_GRADIENT} collection); found a "
                            f"{type(nodes[0]).__name__}", validation.ArgumentTypeError)
    formats = (E4M3, E4M3, E5M2)
    return Fp8State(*(fn(dtype, *metas) for dtype, *metas in zip(formats, *nodes)))
  return jax.tree_util.tree_map(one, *trees, is_leaf=_is_state)


def merge(a: Any, b: Any, recipe: Fp8Recipe) -> Any:
  """Two updates of the same FP8 state combined into one (micro-batches, replicas).

  Each history takes the element-wise max of ``a``'s and ``b``'s (their only new
  entry, ``[0]``, is each side's amax; the rest is the old history they share), and
  its scale is computed again from the merged history (an update that kept the old
  scale carries it, for an amax of 0 or inf). Commutative and associative: any
  order of merging gives the same state, the one a single call on all the data
  would record (for the ``max`` and ``most_recent`` reductions). Start a ``scan``'s
  carry with the first micro-batch's update.

  Args:
    a: a tree of `Fp8State` (an ``_overwrite_with_gradient`` collection).
    b: the same tree, another update from the same old state.
    recipe: the products' `Fp8Recipe`.

  Returns:
    The merged tree.
  """
  recipe = recipe_of(recipe)

  def meta(dtype, x, y):
    history = jnp.maximum(x.amax_history, y.amax_history)
    fallback = jnp.where(_valid(x, recipe), y.scale, x.scale)
    return _merged_meta(history, fallback, dtype, recipe)
  return _map_states(meta, a, b, argname="a")


def merge_stacked(states: Any, recipe: Fp8Recipe) -> Any:
  """`merge` over the leading axis of every leaf (updates stacked by a ``vmap``).

  Args:
    states: a tree of `Fp8State` whose arrays have a leading axis of updates.
    recipe: the products' `Fp8Recipe`.

  Returns:
    The merged tree, without the leading axis.
  """
  recipe = recipe_of(recipe)

  def meta(dtype, m):
    history = jnp.max(m.amax_history, axis=0)
    kept = jnp.where(_valid(m, recipe), jnp.inf, m.scale)
    return _merged_meta(history, jnp.min(kept, axis=0).astype(m.scale.dtype), dtype,
                        recipe)
  return _map_states(meta, states, argname="states")


def merge_across(state: Any, recipe: Fp8Recipe, axis_name: Any) -> Any:
  """`merge` across a mapped axis (inside ``shard_map``, ``pmap`` or a named
  ``vmap``): every member gets the merged state.

  Args:
    state: this member's tree of `Fp8State`.
    recipe: the products' `Fp8Recipe`.
    axis_name: the axis (or tuple of axes) to merge over.

  Returns:
    The merged tree, the same on every member.
  """
  recipe = recipe_of(recipe)
  axis_name = validation.axis_name("axis_name", axis_name)

  def meta(dtype, m):
    history = lax.pmax(m.amax_history, axis_name)
    kept = lax.pmin(jnp.where(_valid(m, recipe), jnp.inf, m.scale), axis_name)
    return _merged_meta(history, kept.astype(m.scale.dtype), dtype, recipe)
  return _map_states(meta, state, argname="state")


# ------------------------------------------------------------------ routing the state
def split_overwrite(tree: Mapping[str, Any]) -> tuple[Any, Any]:
  """``tree`` without its ``_overwrite_with_gradient`` collection, and the collection.

  For Flax variables (``{"params": ..., "_overwrite_with_gradient": ...}``) and their
  gradients: the step applies the optimizer to the first and replaces the FP8 state
  by the second (`join_overwrite` puts them together again).

  Args:
    tree: a mapping of collections (a dict or Flax ``FrozenDict``).

  Returns:
    ``(rest, state)``: ``rest`` of ``tree``'s type, ``state`` the collection or
    ``None`` when ``tree`` has none.
  """
  if not isinstance(tree, Mapping):
    raise validation.fail("tree", " must be a mapping of collections; got "
                          f"{type(tree).__name__}", validation.ArgumentTypeError)
  rest = {k: v for k, v in tree.items() if k != OVERWRITE_WITH_GRADIENT}
  return _like(tree, rest), tree.get(OVERWRITE_WITH_GRADIENT)


def join_overwrite(rest: Mapping[str, Any], state: Any) -> Any:
  """`split_overwrite`'s inverse: ``rest`` with ``state`` as its
  ``_overwrite_with_gradient`` collection (``rest`` as it is for ``None``)."""
  if state is None:
    return rest
  return _like(rest, {**rest, OVERWRITE_WITH_GRADIENT: state})


def _like(original: Mapping[str, Any], items: dict) -> Any:
  return items if isinstance(original, dict) else type(original)(items)


def grad_with_overwrite(scaled_loss: Callable) -> Callable:
  """``jax.grad(scaled_loss, has_aux=True)``, overwriting FP8 state by its gradient.

  A model state holding an ``_overwrite_with_gradient`` collection (`mpscale.precision`:
  FP8 products' scaling state) is differentiated with the parameters: the products'
  custom VJPs give each `mpscale.precision.Fp8State` its updated value as its cotangent,
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
    if not (isinstance(state, Mapping) and OVERWRITE_WITH_GRADIENT in state):
      return plain(params, micro_batch, key, state)
    rest, overwrite = split_overwrite(state)

    def loss(p, o):
      return scaled_loss(p, micro_batch, key, join_overwrite(rest, o))

    (grads, written), (loss_value, tokens, new_state) = jax.grad(
        loss, argnums=(0, 1), has_aux=True)(params, overwrite)
    new_rest, _ = split_overwrite(new_state)
    written = reached(written, overwrite)
    return grads, (loss_value, tokens, join_overwrite(new_rest, written))
  return grad_fn


def reached(new: Any, old: Any) -> Any:
  """Each `mpscale.precision.Fp8State` of ``new`` (the FP8 states' cotangents, or their
  merged updates), or its value in ``old`` where no product gave one (its scales all
  0: a product outside the loss's graph)."""
  def one(n: Any, o: Any) -> Any:
    if not _is_state(n):
      return n
    hit = (n.lhs.scale != 0) | (n.rhs.scale != 0) | (n.grad.scale != 0)

    def pick(a, b):  # per state of a stack (the scales' shape), over its history too
      return jnp.where(hit.reshape(hit.shape + (1,) * (a.ndim - hit.ndim)),
                       a, b)
    return jax.tree_util.tree_map(pick, n, o)
  return jax.tree_util.tree_map(one, new, old, is_leaf=_is_state)
