"""The optimizer state's layout: following its parameters, and ZeRO-1 on top.

A state leaf shaped like its parameter takes the parameter's spec; a factored moment
(CAME's and Adafactor's row and column statistics, one dimension fewer) takes the
spec without the dimension its state declares it averages over (`averaged_dims`);
scalars replicate (`state_specs`). ZeRO-1 (`zero1_specs`) then splits each leaf's
largest free dimension over the data axes its spec does not use yet.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020. https://arxiv.org/abs/1910.02054
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec
import numpy as np
import optax

from mpscale import _tree
from mpscale.parallel._layouts import (AxisNames, axis_size, entry_axes, is_array_like,
                                       is_spec, make_spec, pad, spec_axes,
                                       split_largest)


# --------------------------------------------------------------------------- state
AVERAGED_DIMS: dict[type, Mapping[str, int]] = {
    optax.FactoredState: {"v_row": -1, "v_col": -2},
}
"""Factored statistics of optimizer states that cannot declare their own: state type
-> {field: the parameter dimension that field's statistic averages over}. A state
type of one's own declares it as a class attribute ``averaged_dims`` of that form
(`mpscale.ScaleByCameState` does)."""


def averaged_dims(state: Any) -> Optional[Mapping[str, int]]:
  """The factored statistics ``state`` declares (see `AVERAGED_DIMS`), or ``None``."""
  declared = AVERAGED_DIMS.get(type(state))
  if declared is None:
    declared = getattr(type(state), "averaged_dims", None)
  return declared if isinstance(declared, Mapping) else None


def _follow(param_spec: PartitionSpec, param_shape: Sequence[int],
            shape: Sequence[int], averaged: Optional[int]) -> PartitionSpec:
  """The spec of an optimizer-state leaf of ``shape`` kept for a parameter.

  ``averaged``: the parameter dimension the leaf's statistic averages over, as its
  state declares it; it decides when dropping more than one dimension fits ``shape``
  (a square matrix). Undeclared, or not fitting ``shape``, the last fitting one.
  """
  param_shape, shape = tuple(param_shape), tuple(shape)
  entries = pad(param_spec, len(param_shape))
  if shape == param_shape:
    return param_spec
  dropped = [d for d in range(len(param_shape))
             if param_shape[:d] + param_shape[d + 1:] == shape]
  if not dropped:
    return PartitionSpec()
  dim = dropped[-1]
  if averaged is not None:
    declared = averaged + len(param_shape) if averaged < 0 else averaged
    dim = declared if declared in dropped else dim
  return make_spec(entries[:dim] + entries[dim + 1:])


def _masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _common(specs: Sequence[PartitionSpec], rank: int) -> tuple[Any, ...]:
  """The spec entries ``specs`` (of leaves of one rank) agree on; None elsewhere."""
  rows = [pad(spec, rank) for spec in specs]
  return tuple(entries[0] if all(e == entries[0] for e in entries) else None
               for entries in zip(*rows))


def state_specs(state: Any, params: Any, param_specs: Any) -> Any:
  """Specs for an optimizer state that follow its parameters' specs.

  Every subtree of ``state`` with the tree structure of ``params`` (Adam's moments,
  CAME's statistics; a parameter group's, where ``optax.MaskedNode`` stands for the
  other groups' leaves) is laid out leaf by leaf after the matching parameter: the
  same spec for the same shape, the spec without the averaged dimension for a
  factored statistic (the dimension its state declares, see `averaged_dims`),
  replicated otherwise. A `mpscale.Stacks` (state stacked by role) lays out each
  stack after its members: the leading axis unsplit, then the spec its members
  share (replicated where a member is not a leaf of ``params``). Leaves outside
  such subtrees are replicated.
  """
  params_def = jax.tree_util.tree_structure(params)
  with_path = jax.tree_util.tree_flatten_with_path(params)[0]
  param_leaves = [p for _, p in with_path]
  spec_leaves = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
  by_path = {_tree.path_str(path): (spec, np.shape(p))
             for (path, p), spec in zip(with_path, spec_leaves)}

  def like(x):
    return (not is_array_like(x) and x is not None
            and jax.tree_util.tree_structure(x, is_leaf=_masked) == params_def)

  def stacked(sub, averaged):
    specs = []
    for members, x in zip(sub.members, sub.arrays):
      if any(m not in by_path for m in members):  # not these params' leaves
        specs.append(PartitionSpec())
        continue
      shape = by_path[members[0]][1]
      entries = _common([by_path[m][0] for m in members], len(shape))
      specs.append(_follow(make_spec((None,) + entries), (len(members),) + shape,
                           np.shape(x), averaged))
    return _tree.Stacks(specs, sub.members)

  def lay_out(tree, averaged=None):
    def one(sub):
      if isinstance(sub, _tree.Stacks):
        return stacked(sub, averaged)
      if like(sub):
        return params_def.unflatten([
            x if _masked(x) else _follow(spec, np.shape(p), np.shape(x), averaged)
            for p, spec, x in zip(param_leaves, spec_leaves,
                                  jax.tree_util.tree_leaves(sub, is_leaf=_masked))])
      declared = averaged_dims(sub)
      if declared is not None:
        return sub._replace(**{f: lay_out(getattr(sub, f), declared.get(f))
                               for f in sub._fields})
      return PartitionSpec()
    return jax.tree_util.tree_map(
        one, tree, is_leaf=lambda x: (isinstance(x, _tree.Stacks) or like(x)
                                      or is_array_like(x)
                                      or averaged_dims(x) is not None))

  return lay_out(state)


def zero1_specs(state: Any, specs: Any, mesh: Mesh, data_axes: AxisNames) -> Any:
  """ZeRO-1 on top of ``specs``: each state leaf also split over the data axes its spec
  does not use yet, on its largest free dimension they divide."""
  def add(spec, leaf):
    free = tuple(a for a in entry_axes(data_axes) if a not in spec_axes(spec))
    return split_largest(spec, np.shape(leaf), free, axis_size(mesh, free))
  return jax.tree_util.tree_map(add, specs, state, is_leaf=is_spec)
