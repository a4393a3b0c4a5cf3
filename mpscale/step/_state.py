"""What a step carries, and where it lives: `TrainState`, built by ``init``.

`init_state` casts the parameters to the policy's ``param_dtype``, initializes the
optimizer (wrapped in `mpscale.no_loss_scale` when it has no mpscale loss-scale or
skip wrapper: `wrapped`), and places everything on the mesh where `Layout` says:
the parameters by their specs, the optimizer state after them (ZeRO-1 on top), the
model state and the key replicated.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import optax

from mpscale import _tree
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale.parallel import _optimizer_state as state_layouts_lib
from mpscale.parallel import _padding as padding_lib
from mpscale.precision import _policy as policy_lib
from mpscale.scaling import _loss_scale as loss_scale_lib
from mpscale.scaling import _skip as skip_lib


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


def is_flax_state(x: Any) -> bool:
  return all(hasattr(x, f) for f in ("params", "opt_state", "step", "tx", "apply_fn"))


def _has_wrapper(optimizer: optax.GradientTransformation, params: Any) -> bool:
  state = jax.eval_shape(optimizer.init, _tree.shapes(params))
  return bool(_tree.find(state, skip_lib.SkipNonfiniteState))


def wrapped(optimizer: optax.GradientTransformation, params: Any
            ) -> optax.GradientTransformation:
  """``optimizer``, or `no_loss_scale(optimizer)` when it has no mpscale wrapper."""
  if _has_wrapper(optimizer, params):
    return optimizer
  return loss_scale_lib.no_loss_scale(optimizer)


def key_data(rng: Any) -> jax.Array:
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


OFFLOAD = ("params", "opt_state")
"""The `TrainState` fields a step can keep in host memory between steps
(`make_train_step`'s ``offload``): the master parameters and the optimizer state."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where every array of a step lives on the mesh (``mesh=None``: one device)."""
  mesh: Optional[Mesh]
  data_axes: tuple[str, ...]
  param_specs: Any
  zero1: bool
  pipeline: Any
  """The `mpscale.Pipeline` the step runs, or ``None``."""
  unpaddable: Optional[str] = None
  """Why this step cannot pad a leaf its layout splits unevenly (its gradients are
  summed inside a ``shard_map``, which splits evenly only), naming the argument; or
  ``None``: it can."""
  offload: tuple[str, ...] = ()
  """The `TrainState` fields kept in host memory between steps (`OFFLOAD`)."""

  def specs(self, params: Any) -> Any:
    """The params' specs, checked (a pipeline adds its stage axis); a dimension
    they split unevenly over data axes alone (FSDP) is padded in the state
    (`store`)."""
    specs = layouts_lib.resolve_specs(self.param_specs, params)
    if self.pipeline is not None:
      specs = self.pipeline.param_specs(params, specs)
    layouts_lib.check_specs(params, specs, self.mesh, uneven_axes=self.data_axes)
    return specs

  def state(self, state: TrainState) -> Optional[TrainState]:
    """``NamedSharding``s for a `TrainState` (of arrays or shapes)."""
    if self.mesh is None:
      return None
    params = self.specs(state.params)
    opt = state_layouts_lib.state_specs(state.opt_state, state.params, params)
    # FSDP shards the optimizer state over its data axes too (a moment the spec of
    # its parameter leaves unsplit: a factored one); ZeRO-1 over every data axis.
    used = {a for s in jax.tree_util.tree_leaves(params, is_leaf=layouts_lib.is_spec)
            for a in layouts_lib.spec_axes(s)}
    over = self.data_axes if self.zero1 else tuple(a for a in self.data_axes
                                                   if a in used)
    if over:
      opt = state_layouts_lib.zero1_specs(state.opt_state, opt, self.mesh, over)
    # The model state and the key are replicated: every device holds them whole.
    model_state = jax.tree_util.tree_map(lambda _: PartitionSpec(), state.model_state)
    rng = None if state.rng is None else PartitionSpec()
    return TrainState(*layouts_lib.shardings(
        self.mesh, (params, opt, PartitionSpec(), model_state, rng)))

  def store(self, state: TrainState) -> TrainState:
    """``state`` (true shapes, in device memory) as the step stores it: every leaf
    its sharding splits unevenly padded into a `mpscale.parallel.Padded` node
    (`mpscale.parallel.pad_to`), and the `offload`ed fields moved to host memory."""
    shapes = _tree.shapes(state)
    shardings = self._padded(shapes)
    if shardings is None:
      return state
    state = padding_lib.pad_to(state, shardings)
    return state._replace(**{field: on_host(getattr(state, field))
                             for field in self.offload})

  def load(self, state: TrainState) -> tuple[Any, TrainState]:
    """Inside the step: a stored ``state`` with its `offload`ed fields moved to
    device memory, as ``(params, state)``: the parameters still padded where they
    are stored so (the gradients take them so: float32 sums gather padded shards),
    and the state cut to its true shapes (`unpad`) for the rest."""
    state = state._replace(**{field: on_device(getattr(state, field))
                              for field in self.offload})
    return state.params, self.unpad(state)

  def unpad(self, state: TrainState) -> TrainState:
    """Inside the step: ``state`` cut back to its true shapes, each cut split as its
    padded form is (a local cut under GSPMD: no bytes move)."""
    if not padding_lib.holds_padding(state):
      return state
    cut = padding_lib.unpad(state)
    return self.constrain(cut, self.state(cut))

  def stored(self, state: TrainState) -> Optional[TrainState]:
    """The shardings of ``store(state)`` (``state``: true shapes): padded leaves'
    in their `mpscale.parallel.Padded` nodes, the `offload`ed fields' in host
    memory (``pinned_host``).

    Raises:
      ValueError: naming the leaf split unevenly and `unpaddable`'s argument, on a
        step that cannot pad it.
    """
    shardings = self._padded(state)
    if shardings is None:
      return None
    shardings = padding_lib.stored_shardings(state, shardings)
    return shardings._replace(**{field: jax.tree_util.tree_map(
        lambda s: s.with_memory_kind("pinned_host"), getattr(shardings, field))
                                 for field in self.offload})

  def _padded(self, state: TrainState) -> Optional[TrainState]:
    """``state(state)``, checked against `unpaddable`."""
    shardings = self.state(state)
    if shardings is None or self.unpaddable is None:
      return shardings
    found = padding_lib.uneven_leaves(state, shardings)
    if found:
      raise ValueError(f"param_specs split {found[0]} unevenly; the step stores such "
                       f"a leaf padded, which {self.unpaddable} cannot take (it "
                       "splits evenly only): give it a layout its mesh axes divide")
    return shardings

  def batch(self) -> Optional[NamedSharding]:
    if self.mesh is None:
      return None
    return mesh_lib.batch_sharding(self.mesh, self.data_axes)

  def constrain(self, tree: Any, shardings: Any = None) -> Any:
    """``tree`` constrained to ``shardings`` (default: replicated)."""
    if self.mesh is None:
      return tree
    if shardings is None:
      shardings = jax.tree_util.tree_map(
          lambda _: NamedSharding(self.mesh, PartitionSpec()), tree)
    return lax.with_sharding_constraint(tree, shardings)


def on_device(tree: Any) -> Any:
  """``tree``'s arrays in device memory, their layouts kept: a state a step with
  ``offload`` stores in host memory, for a computation of one's own (inside or
  outside ``jit``); arrays already there stay."""
  return _to_space(tree, "Device")


def on_host(tree: Any) -> Any:
  """``tree``'s arrays in host memory (``pinned_host``), their layouts kept."""
  return _to_space(tree, "Host")


def _to_space(tree: Any, space: str) -> Any:
  if not hasattr(jax, "memory"):  # (before jax.memory, no step offloads)
    return tree
  return jax.tree_util.tree_map(
      lambda x: jax.device_put(x, getattr(jax.memory.Space, space))
      if isinstance(x, (jax.Array, jax.core.Tracer)) else x, tree)


def _adopt_opt_state(optimizer: optax.GradientTransformation, params: Any,
                     opt_state: Any) -> Any:
  """``opt_state`` in the structure of the wrapped optimizer's state."""
  tx = wrapped(optimizer, params)
  expected = jax.tree_util.tree_structure(
      jax.eval_shape(tx.init, _tree.shapes(params)))
  if jax.tree_util.tree_structure(opt_state) == expected:
    return opt_state
  if tx is not optimizer:
    inner = jax.tree_util.tree_structure(
        jax.eval_shape(optimizer.init, _tree.shapes(params)))
    if jax.tree_util.tree_structure(opt_state) == inner:
      fresh = tx.init(params)
      return fresh._replace(skip_state=fresh.skip_state._replace(inner_state=opt_state))
  raise ValueError("the given opt_state does not match the optimizer passed to "
                   "make_train_step (its tree structure differs)")


def init_state(optimizer: optax.GradientTransformation, policy: policy_lib.Policy,
                layout: Layout, params_or_state: Any, model_state: Any = None,
                rng: Any = None, model_state_dtype: Any = jnp.float32) -> TrainState:
  """`make_train_step`'s ``init``: a placed `TrainState` in fresh buffers."""
  given = None
  if isinstance(params_or_state, TrainState) or is_flax_state(params_or_state):
    given = (params_or_state if isinstance(params_or_state, TrainState)
             else TrainState.from_flax(params_or_state))
    for name, value in (("model_state", model_state), ("rng", rng)):
      if value is not None and getattr(given, name) is not None:
        raise ValueError(f"init got {name}= and a state that holds one; pass one")
    model_state = given.model_state if model_state is None else model_state
    rng = given.rng if rng is None else rng
  model_state = _cast_model_state(model_state, model_state_dtype)
  rng = None if rng is None else key_data(rng)

  def fresh_state(params, model_state, rng):
    return TrainState(params, wrapped(optimizer, params).init(params),
                      jnp.zeros((), jnp.int32), model_state, rng)

  if given is None and _is_abstract(params_or_state):
    return _abstract_state(layout, jax.eval_shape(
        lambda p, m, r: fresh_state(policy.cast_to_param(p), m, r),
        params_or_state, model_state, rng))
  if given is not None:
    params = policy.cast_to_param(given.params)
    state = TrainState(params, _adopt_opt_state(optimizer, params, given.opt_state),
                       jnp.asarray(given.step, jnp.int32), model_state, rng)
    shapes = _tree.shapes(state)
    shardings = layout.state(shapes)
    if shardings is not None and not padding_lib.uneven_leaves(shapes, shardings):
      state = jax.device_put(state, shardings)
    # A jit copy gives every leaf its own new buffer: the step donates its input,
    # which must neither free the caller's arrays nor meet one buffer twice (an
    # eagerly built optimizer state can share one array between fields).
    state = jax.jit(layout.store, out_shardings=layout.stored(shapes))(state)
  else:
    params = policy.cast_to_param(params_or_state)
    shapes = jax.eval_shape(fresh_state, _tree.shapes(params),
                            _tree.shapes(model_state), _tree.shapes(rng))
    shardings = layout.state(shapes)
    if shardings is not None:
      # (A leaf split unevenly cannot be placed split: the jit pads it first.)
      params = (params if padding_lib.uneven_leaves(shapes, shardings)
                else jax.device_put(params, shardings.params))
      model_state, rng = jax.device_put((model_state, rng),
                                        (shardings.model_state, shardings.rng))
    # jit returns new buffers, so donating the state never frees ``params``.
    state = jax.jit(lambda *args: layout.store(fresh_state(*args)),
                    out_shardings=layout.stored(shapes))(params, model_state, rng)
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


def _abstract_state(layout: Layout, state: TrainState) -> TrainState:
  """The `TrainState` ``init`` would build, as ``ShapeDtypeStruct``s with the
  shardings it would place it in (padded where `Layout.store` pads, in host memory
  where it offloads): what
  ``step.lower`` needs to compile ahead of time, with nothing allocated."""
  shardings = layout.state(state)
  if shardings is None:
    return state
  return jax.tree_util.tree_map(
      lambda sharding, s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      layout.stored(state), padding_lib.pad_to(state, shardings))


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
      raise ValueError(f"initial parameter {_tree.path_str(path)!r} holds a NaN "
                       "or an Inf")


def _warn_if_unscaled(policy: policy_lib.Policy, opt_state: Any) -> None:
  if not policy.needs_loss_scaling:
    return
  states = _tree.find(opt_state, loss_scale_lib.LossScaleState)
  scale = states[0].loss_scale if states else None
  unscaled = scale is None
  if scale is not None and not isinstance(scale, jax.core.Tracer):
    unscaled = float(scale) == 1.0
  if unscaled:
    warnings.warn(
        f"policy {policy} computes in float16 but the optimizer has no loss scaling "
        "(scale 1): small float16 gradients will flush to zero. Wrap the optimizer in "
        "mpscale.dynamic_loss_scale, e.g. with mpscale.policy_loss_scale(policy, optimizer).",
        stacklevel=3)
