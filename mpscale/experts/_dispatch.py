"""Tokens to their experts and back: on one device, and across an ``expert`` axis.

Dropless (`Routing.capacity_factor` ``None``)::

  order = argsort(chosen experts)            # each (token, slot) by expert
  rows = x[token of order]                   # sorted rows, one group an expert
  # expert axis: each device holds E / P experts; the rows of device p's experts
  # go to p (one ragged all-to-all), are sorted there by its local expert, ...
  y_rows = down(silu(gate(rows)) * up(rows))  # grouped products (`grouped_matmul`)
  # ... and come back the same way (the reverse all-to-all)
  y = sum over slots of weight * y_rows[order^-1]

With a capacity, each expert takes the first ``C`` assignments of a device's tokens
(token order) into an ``[E, C, d]`` buffer, multiplied expert by expert (and, on an
expert axis, exchanged with one all-to-all each way); the rest are dropped, and
counted.

On a backend with ``jax.lax.ragged_all_to_all`` (GPUs, TPUs), the rows move as they
are; elsewhere (XLA's CPU compiler has none) each device sends a buffer padded to
its whole rows to each peer with ``jax.lax.all_to_all``, and places what it gets at
the offsets the ragged exchange would (`exchange`): the same rows land in the same
places. Either way the receiving buffer holds ``P x`` a device's rows (every
assignment could go to one device): the dropless layer's worst case.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from mpscale.experts import _grouped
from mpscale.experts._routing import Routes, Routing


class ExpertWeights(NamedTuple):
  """The routed experts' SwiGLU matrices, stacked on a leading expert axis."""
  gate: jax.Array
  """``[E, d, f]``."""
  up: jax.Array
  """``[E, d, f]``."""
  down: jax.Array
  """``[E, f, d]``."""


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """``silu(gate) * up`` in float32 (the SiLU's exp, and the product, stay finite),
  cast back to ``gate``'s dtype. Under ``jax.checkpoint``: the backward keeps
  ``gate`` and ``up`` alone, in their dtype (the compute dtype in a model), and
  recomputes the float32 intermediates (five ``[rows, d_ff]`` float32 arrays
  otherwise)."""
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(
      gate.dtype)


def _expert_mlp(rows: jax.Array, w: ExpertWeights, sizes: jax.Array,
                implementation: str, tile: Optional[int],
                expected_rows: Optional[int] = None) -> jax.Array:
  """The experts' SwiGLU of ``rows`` (sorted by expert, ``sizes`` a group)."""
  mm = functools.partial(_grouped.grouped_matmul, group_sizes=sizes,
                         implementation=implementation, tile=tile,
                         expected_rows=expected_rows)
  return mm(swiglu(mm(rows, w.gate), mm(rows, w.up)), w.down)


# ------------------------------------------------------------------ the exchange
class Plan(NamedTuple):
  """One direction of a ragged exchange over an axis of ``P`` devices, from this
  device's side (each ``[P]`` int32)."""
  send_offsets: jax.Array
  """Where this device's rows for each peer start in its operand."""
  send_sizes: jax.Array
  """How many rows it sends each peer."""
  dest_offsets: jax.Array
  """Where its rows land in each peer's output."""
  recv_offsets: jax.Array
  """Where each peer's rows land in this device's output."""
  recv_sizes: jax.Array
  """How many rows it gets from each peer."""
  source_offsets: jax.Array
  """Where each peer's rows for this device start in that peer's operand."""

  @classmethod
  def of(cls, blocks: jax.Array, me: jax.Array) -> "Plan":
    """The plan of ``blocks[s, p]`` rows going from ``s`` to ``p`` (the same
    matrix on every device), each device's rows for its peers in peer order."""
    sent = _grouped.exclusive_cumsum(blocks, axis=1)
    landed = _grouped.exclusive_cumsum(blocks, axis=0)
    return cls(sent[me], blocks[me], landed[me],
               _grouped.exclusive_cumsum(blocks[:, me]),
               blocks[:, me], sent[:, me])

  def reverse(self) -> "Plan":
    """The plan that sends every row back where it came from."""
    return Plan(self.recv_offsets, self.recv_sizes, self.source_offsets,
                self.send_offsets, self.send_sizes, self.dest_offsets)


def _padded_all_to_all(x, rows_out, plan, axis):
  """What ``ragged_all_to_all`` does, with a padded ``all_to_all``."""
  cap = x.shape[0]
  step = jnp.arange(cap)
  source = plan.send_offsets[:, None] + step[None]
  sent = jnp.where((step[None] < plan.send_sizes[:, None])[..., None],
                   jnp.take(x, jnp.minimum(source, cap - 1), axis=0), 0)
  got = lax.all_to_all(sent, axis, 0, 0, tiled=False)
  dest = plan.recv_offsets[:, None] + step[None]
  dest = jnp.where(step[None] < plan.recv_sizes[:, None], dest, rows_out)
  out = jnp.zeros((rows_out,) + x.shape[1:], x.dtype)
  return out.at[dest.reshape(-1)].set(got.reshape((-1,) + x.shape[1:]), mode="drop")


def _move(x, rows_out, plan, axis, ragged):
  if not ragged:
    return _padded_all_to_all(x, rows_out, plan, axis)
  out = jnp.zeros((rows_out,) + x.shape[1:], x.dtype)
  return lax.ragged_all_to_all(x, out, plan.send_offsets, plan.send_sizes,
                               plan.dest_offsets, plan.recv_sizes, axis_name=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 3, 4))
def exchange(x: jax.Array, rows_out: int, plan: Plan, axis: str, ragged: bool
             ) -> jax.Array:
  """Inside a ``shard_map`` manual over ``axis``: the rows of ``x`` sent as
  ``plan`` says, into ``rows_out`` rows (zeros where nothing lands); its gradient
  is the reverse exchange. ``ragged``: ``jax.lax.ragged_all_to_all``, else a
  padded ``jax.lax.all_to_all``."""
  return _move(x, rows_out, plan, axis, ragged)


def _exchange_forward(x, rows_out, plan, axis, ragged):
  return _move(x, rows_out, plan, axis, ragged), (x.shape[0], plan)


def _exchange_backward(rows_out, axis, ragged, res, g):
  rows_in, plan = res
  zeros = jax.tree_util.tree_map(jnp.zeros_like, plan)
  return _move(g, rows_in, plan.reverse(), axis, ragged), zeros


exchange.defvjp(_exchange_forward, _exchange_backward)


def platform_of(mesh: Any = None) -> str:
  """The platform a mesh's devices are (``cpu``, ``gpu``/``cuda``, ``tpu``; a
  compile-only topology's too), else the default backend's."""
  devices = getattr(mesh, "devices", None)
  if devices is not None and getattr(devices, "size", 0):
    return devices.flat[0].platform
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    return device.platform
  return jax.default_backend()


def has_ragged_all_to_all(mesh: Any = None) -> bool:
  """Whether XLA compiles ``jax.lax.ragged_all_to_all`` for ``mesh``'s devices (the
  default backend's without one): its GPU and TPU compilers do, its CPU compiler
  does not."""
  return platform_of(mesh) in RAGGED_PLATFORMS


RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
"""The platforms whose XLA compilers have ``ragged_all_to_all``."""


# ------------------------------------------------------------------- the layer
class Dispatched(NamedTuple):
  """The routed experts' output and what the dispatch saw (this device's)."""
  y: jax.Array
  """``[tokens, d]``: the weighted sum of each token's experts' outputs."""
  counts: jax.Array
  """``[E]`` float32: assignments each expert was chosen for (before any drop)."""
  dropped: jax.Array
  """float32: assignments dropped for capacity (0 dropless)."""


def _unsort(rows: jax.Array, order: jax.Array) -> jax.Array:
  """``rows`` put back where the permutation ``order`` took them from (``rows[i]``
  to ``order[i]``). A gather by the inverse permutation: its backward keeps the
  indices alone, where a scatter's keeps masks and copies of ``rows``."""
  inverse = jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype))
  return jnp.take(rows, inverse, axis=0)


@jax.checkpoint
def _combine(rows: jax.Array, routes: Routes) -> jax.Array:
  """Each token's weighted sum (float32) of its slots' rows (``[tokens x k, d]``,
  a token's ``k`` rows together). Under ``jax.checkpoint``: the backward keeps the
  rows in their dtype, not their float32 copy."""
  n, k = routes.experts.shape
  return jnp.einsum("nkd,nk->nd", rows.reshape(n, k, -1).astype(jnp.float32),
                    routes.weights)


def dispatch(x: jax.Array, routes: Routes, weights: ExpertWeights, routing: Routing,
             *, axis: Optional[str] = None, tensor_axis: Optional[str] = None,
             implementation: str = "auto", tile: Optional[int] = None,
             ragged: Optional[bool] = None) -> Dispatched:
  """The routed experts applied to tokens ``x`` (``[tokens, d]``) as ``routes``
  says.

  Args:
    x: this device's tokens.
    routes: their `route`.
    weights: the experts this device holds: all ``E``, or inside a ``shard_map``
      manual over ``axis`` of size ``P``, the ``E / P`` of its index (device ``p``
      holding experts ``p E/P ...``).
    routing: the `Routing`.
    axis: the expert axis (``None``: every expert here).
    tensor_axis: an axis the experts' hidden units are split over (their outputs
      are summed over it), or ``None``.
    implementation, tile: the grouped product's (`grouped_matmul`).
    ragged: exchange with ``ragged_all_to_all`` (``None``: where the default
      backend has it, `has_ragged_all_to_all`).

  Returns:
    `Dispatched`.
  """
  k = routes.experts.shape[1]
  flat = routes.experts.reshape(-1)
  counts = jnp.zeros((routing.num_experts,), jnp.int32).at[flat].add(1)
  order = jnp.argsort(flat, stable=True)  # each (token, slot), by expert
  if routing.capacity_factor is not None:
    y, dropped = _with_capacity(x, routes, order, counts, weights, routing, axis)
  else:
    rows = jnp.take(x, order // k, axis=0)
    if axis is None:
      out = _expert_mlp(rows, weights, counts, implementation, tile)
    else:
      ragged = has_ragged_all_to_all() if ragged is None else ragged
      out = _across(rows, counts, weights, axis, ragged, implementation, tile)
    y = _combine(_unsort(out, order), routes)
    dropped = jnp.float32(0)
  if tensor_axis is not None:
    y = lax.psum(y, tensor_axis)
  return Dispatched(y.astype(x.dtype), counts.astype(jnp.float32), dropped)


def _across(rows, counts, weights, axis, ragged, implementation, tile):
  """Dropless rows (sorted by expert) through the experts spread over ``axis``."""
  size = lax.axis_size(axis)
  me = lax.axis_index(axis)
  local = weights.gate.shape[0]
  every = lax.all_gather(counts, axis)                       # [source, E]
  mine = lax.dynamic_slice_in_dim(every, me * local, local, axis=1)  # [source, local]
  plan = Plan.of(every.reshape(size, size, local).sum(-1), me)
  received = exchange(rows, size * rows.shape[0], plan, axis, ragged)
  # what came is grouped by source, then local expert: regroup by local expert
  ends = jnp.cumsum(mine.reshape(-1))
  block = jnp.searchsorted(ends, jnp.arange(received.shape[0]), side="right")
  expert = jnp.where(block < ends.shape[0], block % local, local)
  regroup = jnp.argsort(expert, stable=True)
  # the tiles sized for the rows a device gets when the load is even, not for the
  # buffer's worst case
  out = _expert_mlp(jnp.take(received, regroup, axis=0), weights, mine.sum(0),
                    implementation, tile, expected_rows=rows.shape[0])
  out = _unsort(out, regroup)
  return exchange(out, rows.shape[0], plan.reverse(), axis, ragged)


def _per_expert(buffer: jax.Array, w: jax.Array) -> jax.Array:
  """``buffer[e] @ w[e]`` for each expert ``e``, in ``buffer``'s dtype with float32
  sums, as `grouped_matmul`'s."""
  return jnp.einsum("ecd,edf->ecf", buffer, w.astype(buffer.dtype),
                    preferred_element_type=jnp.float32).astype(buffer.dtype)


def _with_capacity(x, routes, order, counts, weights, routing, axis):
  """The capacity variant: ``[E, C, d]`` buffers, the assignments past ``C`` of an
  expert dropped (``order``: the assignments by expert, ``counts``: each expert's);
  returns ``(y, dropped)``."""
  n, k = routes.experts.shape
  num, cap = routing.num_experts, routing.capacity(n)
  flat = routes.experts.reshape(-1)
  rank = jnp.arange(n * k) - _grouped.exclusive_cumsum(counts)[flat[order]]
  position = jnp.zeros((n * k,), jnp.int32).at[order].set(rank)
  kept = position < cap
  slot = jnp.where(kept, flat * cap + position, num * cap)
  # each buffer row's token (``n``, a zero row, where none fills it): a gather,
  # whose backward keeps the indices alone (a scatter's keeps masks and copies)
  token = jnp.full((num * cap + 1,), n, jnp.int32).at[slot].set(
      jnp.arange(n * k, dtype=jnp.int32) // k)[:-1]
  padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
  buffer = jnp.take(padded, token, axis=0).reshape(num, cap, -1)
  if axis is not None:  # [E, C, d] -> each device its experts' rows from every peer
    size, local = lax.axis_size(axis), weights.gate.shape[0]
    buffer = lax.all_to_all(buffer.reshape(size, local, cap, -1), axis, 0, 0,
                            tiled=False)
    buffer = buffer.transpose(1, 0, 2, 3).reshape(local, size * cap, -1)
  h = swiglu(_per_expert(buffer, weights.gate), _per_expert(buffer, weights.up))
  out = _per_expert(h, weights.down)
  if axis is not None:
    out = out.reshape(local, size, cap, -1).transpose(1, 0, 2, 3)
    out = lax.all_to_all(out, axis, 0, 0, tiled=False).reshape(num, cap, -1)
  rows = jnp.concatenate([out.reshape(num * cap, -1),
                          jnp.zeros((1, out.shape[-1]), out.dtype)])[slot]
  return _combine(rows, routes), jnp.sum(~kept).astype(jnp.float32)
