"""A mixture-of-experts MLP: the router, the routed experts, the statistics, on a
mesh or on one device (`moe_mlp`). The Flax modules that hold its weights are
`mpscale.experts.moe_flax`'s.

On a mesh the layer runs in a ``shard_map`` over the mesh's automatic axes (nested
in a pipeline's): each device routes and sorts its own tokens (a batch split over
the data axes, ``expert`` among them, and a sequence over ``context``), its experts
are those of its index on the ``expert`` axis, and an expert's hidden units may be
split over ``tensor`` (their outputs summed over it). GSPMD gathers what the specs
do not split as they enter, so expert weights also split over FSDP's axes are
gathered there, never over ``expert``.

The statistics are the whole batch's (summed over the devices its tokens lie on),
so the load-balancing loss of a batch split over ``expert`` equals one device's.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale import validation
from mpscale.experts import _grouped
from mpscale.experts._dispatch import (RAGGED_PLATFORMS, ExpertWeights, dispatch,
                                       platform_of)
from mpscale.experts._routing import Routing, load_balancing_loss, route

EXPERT_AXIS = "expert"
"""The mesh axis the experts are split over."""


class MoeStats(NamedTuple):
  """What a layer's routing did to a batch (float32, the whole batch's)."""
  aux_loss: jax.Array
  """The load-balancing loss (`load_balancing_loss`)."""
  z_loss: jax.Array
  """The router z-loss: the mean over tokens of the logits' squared log-sum-exp."""
  counts: jax.Array
  """``[E]``: assignments to each expert (dropped ones included)."""
  dropped: jax.Array
  """Assignments dropped for capacity (0 dropless)."""
  tokens: jax.Array
  """Tokens routed."""


def _stats(routes, dispatched, token_axes) -> MoeStats:
  total = lambda v: lax.psum(v, token_axes) if token_axes else v  # noqa: E731
  tokens = total(jnp.float32(routes.experts.shape[0]))
  counts = total(dispatched.counts)
  aux = load_balancing_loss(counts, total(jnp.sum(routes.probs, axis=0)), tokens)
  z_loss = total(jnp.sum(jnp.square(routes.z))) / tokens
  return MoeStats(aux, z_loss, counts, total(dispatched.dropped), tokens)


def _local(x, router, weights, bias, *, routing, axis, tensor_axis, token_axes,
           options):
  shape = x.shape
  x = x.reshape(-1, shape[-1])
  routes = route(x, router, routing, bias)
  out = dispatch(x, routes, weights, routing, axis=axis, tensor_axis=tensor_axis,
                 **options)
  return out.y.reshape(shape), _stats(routes, out, token_axes)


def moe_mlp(x: jax.Array, router: jax.Array, weights: ExpertWeights,
            routing: Routing, *, bias: Optional[jax.Array] = None,
            mesh: Any = None, spec: Optional[PartitionSpec] = None,
            expert_axis: str = EXPERT_AXIS, tensor_axis: Optional[str] = None,
            implementation: str = "auto", tile: Optional[int] = None,
            ragged: Optional[bool] = None) -> tuple[jax.Array, MoeStats]:
  """The routed experts of tokens ``x`` (``[..., d]``).

  Args:
    x: the tokens (any leading shape).
    router: ``[d, E]``.
    weights: `ExpertWeights`, all ``E`` experts (global view).
    routing: the `Routing`.
    bias: ``[E]``, the balancing bias (`Routing.bias_rate`), or ``None``.
    mesh: a ``Mesh`` (or, inside a ``shard_map``, ignored for its abstract mesh);
      ``None``: no ``shard_map``.
    spec: how ``x`` lies on ``mesh`` (its last dimension unsplit); ``None``:
      replicated.
    expert_axis: the mesh axis the experts are split over (absent or 1: none).
    tensor_axis: the mesh axis the experts' hidden units are split over, or
      ``None``.
    implementation, tile, ragged: `dispatch`'s, ``auto`` and ``None`` chosen for
      ``mesh``'s devices (`choose`, `has_ragged_all_to_all`).

  Returns:
    ``(y, stats)``: ``y`` shaped and laid out as ``x``, and `MoeStats`.

  Raises:
    ArgumentError: naming ``num_experts`` when ``expert_axis`` does not divide the
      experts, or ``d_ff`` when ``tensor_axis`` does not divide their hidden units.
  """
  manual, abstract = mesh_lib.manual_axes()
  if manual:
    mesh = abstract
  # for the devices the program is compiled for (a compile-only GPU or TPU
  # topology's while JAX runs on the CPU too)
  platform = platform_of(mesh)
  options = dict(implementation=_grouped.choose(implementation, platform), tile=tile,
                 ragged=platform in RAGGED_PLATFORMS if ragged is None else ragged)
  if mesh is None:
    return _local(x, router, weights, bias, routing=routing, axis=None,
                  tensor_axis=None, token_axes=(), options=options)
  automatic = tuple(a for a in mesh.axis_names if a not in manual)
  size = lambda a: mesh.shape[a] if a in automatic else 1  # noqa: E731
  experts = expert_axis if size(expert_axis) > 1 else None
  tensor = tensor_axis if tensor_axis and size(tensor_axis) > 1 else None
  if experts and routing.num_experts % size(experts):
    raise validation.fail("num_experts", f" ({routing.num_experts}) is not divisible "
                          f"by mesh axis {experts!r} (size {size(experts)})")
  if tensor and weights.gate.shape[-1] % size(tensor):
    raise validation.fail("d_ff", f" of the experts ({weights.gate.shape[-1]}) is not "
                          f"divisible by mesh axis {tensor!r} (size {size(tensor)})")
  x_spec = layouts_lib.only_axes(spec or PartitionSpec(), automatic)
  token_axes = tuple(a for e in x_spec for a in layouts_lib.entry_axes(e))
  w_specs = ExpertWeights(PartitionSpec(experts, None, tensor),
                          PartitionSpec(experts, None, tensor),
                          PartitionSpec(experts, tensor, None))
  stats_spec = MoeStats(*(PartitionSpec(),) * 5)
  body = functools.partial(_local, routing=routing, axis=experts, tensor_axis=tensor,
                           token_axes=token_axes, options=options)
  if bias is None:
    bias = jnp.zeros((routing.num_experts,), jnp.float32)
  mapped = jax.shard_map(
      body, mesh=mesh, in_specs=(x_spec, PartitionSpec(), w_specs, PartitionSpec()),
      out_specs=(x_spec, stats_spec), axis_names=set(automatic), check_vma=False)
  y, stats = mapped(x, router, weights, bias)
  if manual:
    y = mesh_lib.cast_varying(y, tuple(mesh_lib.varying_axes(x)))
  return y, stats
