"""FSDP (ZeRO-3): parameters split over the data axes, gathered where they are used.

`fsdp_specs` splits every parameter over the ``fsdp`` axis on its largest free
dimension (the batch is split over it too). Where a parameter is used it is cast to
the compute dtype and all-gathered, a layer at a time, and its gradient is
reduce-scattered back there in the masters' dtype. Three places do that, one per way
a step runs:

* under ``jit`` (GSPMD): `mpscale.parallel.keep_batch_split` keeps the activations
  split over the batch, so GSPMD gathers weights, not activations;
* inside a ``shard_map`` manual over the data axes (the step's float32 sums,
  ``grad_reduce_dtype=float32``): `gather_where_used` gathers each master shard at
  each equation that uses it;
* inside the pipeline's ``shard_map``: `StageFSDP` gathers a layer at a time on
  every schedule's forward and again on its backward.

All three move the compute dtype with `gather_cast` and reduce-scatter with
`scatter_dims`, whose transpose it is.

References:
  Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
  VLDB 2023. https://arxiv.org/abs/2304.11277
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020. https://arxiv.org/abs/1910.02054
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np

from mpscale import _jaxprs as jaxprs
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel._layouts import (AxisNames, SpecsLike, axis_size, is_spec,
                                       resolve_specs, split_across,
                                       split_largest)


def fsdp_specs(params: Any, mesh: Mesh, axis: AxisNames = "fsdp",
               param_specs: SpecsLike = None, pad: bool = False,
               transpose_axis: AxisNames = None) -> Any:
  """FSDP (ZeRO-3): every parameter also split over ``axis`` on its largest free
  dimension that the axis size divides (the rest stay as ``param_specs`` has them).

  A parameter none of whose free dimensions the axis size divides stays replicated
  over it; with ``pad``, it is split too, on the free dimension whose padding costs
  least (`split_largest`'s ``uneven``), and `mpscale.make_train_step` stores it
  padded (`mpscale.parallel.Padded`): every device then holds ``1/N`` of every
  parameter of at least ``N`` rows, whatever ``N`` (1,120 = 2^5·5·7 GPUs divide none
  of a 530B GPT's dimensions).

  Args:
    params: the parameters (arrays or shapes).
    mesh: the mesh holding ``axis``.
    axis: the FSDP mesh axis (or axes); the batch is split over it too.
    param_specs: a layout to add FSDP to (tensor or stage splits); any form
      `resolve_specs` accepts.
    pad: split dimensions the axis size does not divide too (padded by the step).
    transpose_axis: a second FSDP axis (MaxText's ``fsdp_transpose``), splitting
      each parameter on another dimension than ``axis`` does (`split_across`): the
      parameters are split over both, ``N = axis x transpose_axis`` ways, with
      less padding than over one axis of ``N`` where ``N`` divides no dimension
      (1,120 = 32 x 35). The batch is split over it too.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``params``.
  """
  size = axis_size(mesh, axis)
  base = resolve_specs(param_specs, params)
  if transpose_axis is None:
    split = lambda spec, shape: split_largest(spec, shape, axis, size, pad)
  else:
    sizes = (size, axis_size(mesh, transpose_axis))
    split = lambda spec, shape: split_across(spec, shape, axis, transpose_axis, sizes,
                                             pad)
  return jax.tree_util.tree_map(lambda spec, leaf: split(spec, np.shape(leaf)),
                                base, params, is_leaf=is_spec)


def gather_cast(x: jax.Array, dtype: Any, dims: Sequence[tuple]) -> jax.Array:
  """Inside ``shard_map``: ``x`` (a master shard) cast to ``dtype`` and all-gathered
  along ``dims`` (`split_dims`' ``(dim, axes)`` pairs; a ``(dim, axes, size)``
  triple cuts a padded leaf's gather to its true ``size``, `mpscale.parallel.Padded`).
  The gather moves the compute dtype; the gradient comes back reduce-scattered in
  ``x``'s own dtype (float32 masters: float32 sums over the replicas, PyTorch FSDP's
  ``reduce_dtype``), the padding's share zeros."""
  return _gather_cast(x, jnp.dtype(dtype), tuple(_triples(dims)), jnp.dtype(x.dtype))


def _triples(dims: Sequence[tuple]) -> list[tuple[int, tuple[str, ...], Optional[int]]]:
  """``dims`` as ``(dim, axes, true size or None)`` triples."""
  return [(d[0], tuple(d[1]), d[2] if len(d) > 2 else None) for d in dims]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_cast(x, dtype, dims, master):
  del master
  y = x.astype(dtype)
  for dim, over, size in dims:
    y = lax.all_gather(y, over, axis=dim, tiled=True)
    if size is not None:
      y = lax.slice_in_dim(y, 0, size, axis=dim)
  return y


def _gather_cast_fwd(x, dtype, dims, master):
  return _gather_cast(x, dtype, dims, master), None


def _gather_cast_bwd(dtype, dims, master, _, ct):
  del dtype
  return (scatter_dims(ct.astype(master), dims),)


def scatter_dims(g: jax.Array, dims: Sequence[tuple]) -> jax.Array:
  """Inside ``shard_map``: ``g`` summed over the axes of ``dims`` (`split_dims`'
  pairs, or `gather_cast`'s triples: ``g`` of the true size, padded with zeros
  first), keeping this device's slice along each dim: the reduce-scatter that
  undoes `gather_cast`'s gather."""
  for dim, over, size in reversed(_triples(dims)):
    if size is not None:
      n = math.prod(lax.axis_size(a) for a in over)
      widths = [(0, 0)] * g.ndim
      widths[dim] = (0, -(-size // n) * n - size)
      g = jnp.pad(g, widths)
    g = lax.psum_scatter(g, over, scatter_dimension=dim, tiled=True)
  return g


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)


# ------------------------------------------------ inside shard_map: gathered where used
class _Shard:
  """A weight kept as its master shard until it is used (`gather_where_used`): the
  dtype it is cast to there and the dimensions it is split along, ``(dim, axes)``."""

  def __init__(self, dtype: Any, dims: tuple):
    self.dtype, self.dims = dtype, dims

  def gather(self, x: jax.Array) -> jax.Array:
    return gather_cast(x, self.dtype, self.dims)


def gather_where_used(fn: Callable[..., Any], dims: Any) -> Callable[..., Any]:
  """Inside a ``shard_map`` that is manual over FSDP's data axes: ``fn(params,
  *args)`` evaluated on the parameters' master shards, each split leaf cast and
  all-gathered at each equation that uses it (`mpscale.parallel.gather_cast`, under
  ``jax.checkpoint`` so the backward gathers it again), never the whole model at
  once; its gradient is reduce-scattered there in the masters' dtype.

  ``fn`` is traced on the parameters' whole shapes, device-varying as their gathers
  are (so a custom VJP, FP8's, is replayed on the types it was traced on), and
  evaluated again one equation at a time: a cast of a split leaf is deferred to its gather (the gather moves the
  compute dtype, the gradient sums in float32), and a leaf is followed into
  ``scan`` bodies (a stacked leaf's slice is one layer's shard), nested ``jit``
  calls and ``checkpoint``. Any other equation that uses it gathers it there; one
  that cannot be followed (``cond``, ``while``, custom derivatives) gathers it
  whole first.

  Args:
    fn: ``fn(params, *args)``, written for whole parameters.
    dims: like ``params``: each leaf's ``(dim, axes)`` pairs
      (`mpscale.parallel.split_dims` of its spec over the manual data axes), a
      tuple, empty for a leaf that is not split; a ``(dim, axes, size)`` triple
      for a leaf stored padded along ``dim`` (`gather_cast`), whose true size
      ``fn`` is traced on.

  Returns:
    ``f(shards, *args)`` with ``fn``'s results.
  """
  def wrapped(shards: Any, *args: Any) -> Any:
    leaf_dims = jax.tree_util.tree_leaves(dims, is_leaf=lambda x: isinstance(x, tuple))
    shard_leaves = jax.tree_util.tree_leaves(shards)
    # Traced on the types its gathers give: a split leaf gathered is still varying
    # over the axes its shard varies over. (Traced invariant, the trace's pvarys
    # and its custom VJPs' types, fixed when traced, would not fit the replay.)
    whole = [jax.typeof(x).update(shape=_whole_shape(x.shape, d)) if d else
             jax.typeof(x) for x, d in zip(shard_leaves, leaf_dims)]
    p_tree = jax.tree_util.tree_structure(shards)
    leaves, tree = jax.tree_util.tree_flatten(args)

    def flat(*xs):
      p = jax.tree_util.tree_unflatten(p_tree, xs[:len(whole)])
      return fn(p, *jax.tree_util.tree_unflatten(tree, xs[len(whole):]))

    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*whole, *leaves)
    marks = {v: _Shard(x.dtype, tuple(d)) for v, x, d in
             zip(closed.jaxpr.invars, shard_leaves, leaf_dims) if d}
    outs = _Gathers().run(closed.jaxpr, closed.consts, [*shard_leaves, *leaves], marks)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return wrapped


def _whole_shape(shape: tuple, dims: Sequence) -> tuple:
  out = list(shape)
  for dim, axes, size in _triples(dims):
    out[dim] = size if size is not None else out[dim] * math.prod(
        lax.axis_size(a) for a in axes)
  return tuple(out)


class _Gathers:
  """`gather_where_used`'s evaluation: values, and the weights still shards."""

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          marks: dict) -> list:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    marks = dict(marks)
    for eqn in jaxpr.eqns:
      values = [jaxprs.read(env, v) for v in eqn.invars]
      shards = [jaxprs.lookup(marks, v) for v in eqn.invars]
      if all(s is None for s in shards):
        outs = jaxprs.bind(eqn, values)
      elif eqn.primitive.name in jaxprs.CASTS and shards[0] is not None:
        # Deferred: cast where gathered (the compute dtype moves, float32 sums back).
        dtype = eqn.params.get("new_dtype", eqn.outvars[0].aval.dtype)
        marks[eqn.outvars[0]] = _Shard(dtype, shards[0].dims)
        outs = values
      else:
        outs = self.equation(eqn, values, shards)
      env.update(zip(eqn.outvars, outs))
    return [self.whole(jaxprs.read(env, v), jaxprs.lookup(marks, v))
            for v in jaxpr.outvars]

  @staticmethod
  def whole(x: Any, shard: Optional[_Shard]) -> Any:
    if shard is not None:
      return shard.gather(x)
    return x if hasattr(x, "dtype") and hasattr(x, "astype") else jax.numpy.asarray(x)

  def equation(self, eqn: Any, values: list, shards: list) -> list:
    body = jaxprs.call_body(eqn)
    if body is not None:
      return self.run(body[0], body[1], values,
                      {v: s for v, s in zip(body[0].invars, shards) if s is not None})
    name = eqn.primitive.name
    if name == "scan":
      return self.scan(eqn, values, shards)
    if name in jaxprs.REMAT:
      inner = {v: s for v, s in zip(eqn.params["jaxpr"].invars, shards)
               if s is not None}
      return list(jax.checkpoint(
          lambda *args: self.run(eqn.params["jaxpr"], (), args, inner),
          prevent_cse=eqn.params.get("prevent_cse", True),
          policy=eqn.params.get("policy"))(*values))

    def use(*values):
      # Tied to the equation's other operands: gathered once its input is there.
      values = lax.optimization_barrier(values)
      return jaxprs.bind(eqn, [self.whole(x, s) for x, s in zip(values, shards)])
    # The backward gathers again rather than keeping the gathered weight.
    return list(jax.checkpoint(use)(*values))

  def scan(self, eqn: Any, values: list, shards: list) -> list:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    # A carried weight, or a stack split along its layers, is gathered first.
    first = [s is not None and (nc <= i < nc + nk or (
        i >= nc + nk and any(d[0] == 0 for d in s.dims)))
             for i, s in enumerate(shards)]
    values = [self.whole(x, s) if g else x for x, s, g in zip(values, shards, first)]
    shards = [None if g else s for s, g in zip(shards, first)]
    consts, init, xs = values[:nc], values[nc:nc + nk], values[nc + nk:]
    # A stacked weight's slice is one layer's shard.
    inner = [*shards[:nc], *([None] * nk),
             *(None if s is None else _Shard(s.dtype, tuple(
                 (d - 1, a, n) for d, a, n in _triples(s.dims)))
               for s in shards[nc + nk:])]
    body = p["jaxpr"]
    marks = {v: s for v, s in zip(body.jaxpr.invars, inner) if s is not None}

    def step(carry, x):
      outs = self.run(body.jaxpr, body.consts, [*consts, *carry, *x], marks)
      return outs[:nk], outs[nk:]

    carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


@dataclasses.dataclass(frozen=True, eq=False)
class StageFSDP:
  """Parameters split over the data axes (FSDP) inside the pipeline's ``shard_map``.

  Each stays a master shard until it is used, then is cast to the compute dtype and
  all-gathered there (`mpscale.parallel.gather_cast`): a layer at a time for the
  stacked layers (in every schedule, on the forward and again on the backward), and
  around the embedding and the head for the rest. Its gradient is reduce-scattered
  back where it is computed, in the masters' dtype, so no device ever holds a whole
  stage's parameters or gradients.
  """
  specs: Any
  """Like the params: each leaf's spec over the manual axes."""
  axes: tuple[str, ...]
  """The data axes."""
  dtypes: Any
  """Like the params: each leaf's compute dtype (the run's cast)."""
  stacks: tuple[str, ...]
  """The keys of the stacked layers."""

  @classmethod
  def of(cls, params: Any, specs: Any, axes: Sequence[str], cast: Callable,
         stacks: Sequence[str]) -> Optional["StageFSDP"]:
    """``None`` where no leaf is split over ``axes``."""
    split = [layouts_lib.split_dims(s, axes)
             for s in jax.tree_util.tree_leaves(specs, is_leaf=layouts_lib.is_spec)]
    if not any(split):
      return None
    dtypes = jax.tree_util.tree_map(lambda x: x.dtype, jax.eval_shape(cast, params))
    return cls(specs, tuple(axes), dtypes, tuple(stacks))

  def _dims(self, spec: P, stacked: bool) -> tuple:
    return tuple(layouts_lib.split_dims(P(*spec[1:]) if stacked else spec, self.axes))

  def compute(self, params: Any, cast: Callable) -> Any:
    """``cast(params)``, but the split leaves left as master shards (cast when
    gathered)."""
    return jax.tree_util.tree_map(
        lambda m, c, s: m if layouts_lib.split_dims(s, self.axes) else c,
        params, cast(params), self.specs)

  def _gather(self, tree: Any, specs: Any, dtypes: Any, stacked: bool) -> Any:
    def gather(x, spec, dtype):
      dims = self._dims(spec, stacked)
      return gather_cast(x, dtype, dims) if dims else x
    return jax.tree_util.tree_map(gather, tree, specs, dtypes)

  def layer(self, key: str, lp: Any) -> Any:
    """One layer's parameters (a slice of stack ``key``) gathered for compute."""
    return self._gather(lp, self.specs[key], self.dtypes[key], True)

  def rest(self, p: Any) -> Any:
    """``p`` with every leaf outside the stacks gathered for compute."""
    return {k: x if k in self.stacks else
            self._gather(x, self.specs[k], self.dtypes[k], False)
            for k, x in p.items()}

  def scatter_layer(self, key: str, grads: Any, only: Optional[set] = None) -> Any:
    """A layer's float32 gradients reduce-scattered back to its shards (1F1B and
    ZB-H1, whose backward is their own, not autodiff's); ``only``: the leaf indices
    to send, the others known zero (zeros of the shard's shape)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    specs = jax.tree_util.tree_leaves(self.specs[key], is_leaf=layouts_lib.is_spec)
    out = []
    for i, (g, spec) in enumerate(zip(leaves, specs)):
      dims = self._dims(spec, True)
      g = g.astype(jnp.float32)
      if only is not None and i not in only:
        shape = list(g.shape)
        for dim, over in dims:
          shape[dim] //= math.prod(lax.axis_size(a) for a in over)
        out.append(jnp.zeros(shape, jnp.float32))
        continue
      out.append(scatter_dims(g, dims))
    return jax.tree_util.tree_unflatten(treedef, out)
