"""Gradient norms: one float32 sum of squares per leaf, shared by every consumer.

A full reduction over the gradients is a pass over memory that XLA cannot fuse into the
optimizer's elementwise update. mpscale makes that pass once: the finiteness check, the
global norm, the per-group ("local") norms and the clip all read the same per-leaf sums
of squares (`LeafSquares`). The loss-scale and skip wrappers hand them to the inner
transformation as the extra argument ``leaf_squares``; `global_norm_clip` reuses
them when they describe exactly the updates it receives.

The pass reads each leaf once, and on an NVIDIA GPU it also launches few kernels:
leaves that stack without moving (the same shape, dtype and sharding; where tracing
cannot know the sharding, the same weight of many layers, its key path up to layer
numbers, ``h[0]``, ``h/0`` and linen's ``h_0`` alike) are stacked into one
reduction, and small leaves (biases, norm scales) of one shape into another. XLA's GPU compiler fuses the stack into the reduction, so nothing is
copied; the CPU backend would write the stack out, so it (and any other backend)
reduces leaf by leaf. ``lax.platform_dependent`` picks at lowering. The sums land in
one float32 vector, and the flags, the total and every group norm are reductions of
that vector: XLA fuses them into one small kernel. On GPT-2 small's 149 leaves, the
H100 program of ``dynamic_loss_scale(adamw)`` launches 1.19x AdamW's kernels, where a
reduction per leaf made it 3.06x (benchmarks/README.md, ``bench_gpu_program.py``).

One pass, every consumer::

  s[leaf] = sum(float32(leaf) ** 2)          # a vector of k parts for a split leaf
  overflow = any(isnan(s) or isinf(s))        # mpscale.scaling
  global_norm = sqrt(sum(s))
  group_norms[name] = sqrt(sum of s over the leaves (or parts) in group name)
  clipped = updates * max_norm / max(global_norm, max_norm)

The code reads the same way::

  leaf_squares = measure(tree, splits_for(tree, groups))       # s, a LeafSquares
  leaf_squares = reuse_or_measure(tree, leaf_squares, groups)  # or a wrapper's s
  global_norm = jnp.sqrt(leaf_squares.total())                 # s is one vector
  group_norms, group_sizes = grouped(leaf_squares, groups)
  global_norm_clip: factor = max_norm / jnp.maximum(norm, max_norm)
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpscale import _deprecated
from mpscale import validation
from mpscale._tree import KeyPath, path_str, stack_buckets
NormGroups = Union[None, int, Callable[[KeyPath], Union[str, Sequence[str]]]]
"""How leaves map to named groups.

* ``None``: one group per top-level key of the tree (the default).
* an ``int`` ``d``: one group per distinct path prefix of depth ``d`` (``1`` is the same as
  ``None``), named by joining the keys with ``/``.
* a callable ``key_path -> str``: any grouping, e.g. per layer. It may also return a
  tuple of ``k`` names: the leaf is then split into ``k`` equal parts along its leading
  axis, part ``i`` going to group ``names[i]`` (layers stacked on a leading axis, e.g.
  one group per pipeline stage: see `mpscale.stage_norm_groups`). The split is measured in
  the same single pass.
"""

_INT32_MAX = np.iinfo(np.int32).max


def _group_fn(groups: NormGroups) -> Callable[[KeyPath], str]:
  if callable(groups):
    return groups
  depth = 1 if groups is None else groups
  return lambda path: path_str(path[:depth]) if path else "params"


class LeafSquares(NamedTuple):
  """Per-leaf float32 sums of squares of one gradient tree, made in a single pass.

  Not a state: it lives for one ``update`` call and travels to inner transformations as
  the extra argument ``leaf_squares``. The sums are one float32 vector, leaf by leaf
  (``parts[i]`` entries for leaf ``i``), so that a consumer reads all of them in one
  small kernel: the finiteness flags, the global norm and the group norms are each a
  reduction of this vector, not one operation per leaf.
  """
  leaves: tuple[Any, ...]
  """The very arrays (or tracers) that were measured, so a consumer can check by
  identity that the sums describe its own inputs."""
  vector: jax.Array
  """float32 ``[sum(parts)]``: leaf ``i``'s ``sum(leaf.astype(float32) ** 2)`` (or its
  ``parts[i]`` partial sums, one per equal part along its leading axis) at
  ``starts[i]``, in the order the reductions made them."""
  paths: tuple[KeyPath, ...]
  """Key path of each leaf."""
  parts: tuple[int, ...]
  """Per leaf, the number of parts measured separately (1: the whole leaf)."""
  starts: tuple[int, ...]
  """Per leaf, where its sums start in `vector`."""

  def describes(self, tree: Any) -> bool:
    """True when ``tree``'s leaves are exactly the measured arrays."""
    leaves = jax.tree_util.tree_leaves(tree)
    return len(leaves) == len(self.leaves) and all(
        a is b for a, b in zip(leaves, self.leaves))

  @property
  def sums(self) -> tuple[jax.Array, ...]:
    """Per leaf, its sum of squares: a float32 scalar, or a vector of ``k`` partial
    sums for a leaf measured in ``k`` parts."""
    return tuple(self.vector[o] if k == 1 else self.vector[o:o + k]
                 for o, k in zip(self.starts, self.parts))

  def total(self) -> jax.Array:
    """The sum of all the sums: the squared global norm, a float32 scalar."""
    return jnp.sum(self.vector, dtype=jnp.float32)

  def scaled(self, leaves: Sequence[Any], factor: jax.Array) -> "LeafSquares":
    """The sums of ``factor``-times the measured leaves, describing ``leaves`` (those
    scaled arrays): ``vector * factor**2``, one multiply for the whole vector."""
    return self._replace(leaves=tuple(leaves),
                         vector=self.vector * jnp.square(factor).astype(jnp.float32))


def _names(groups: NormGroups, path: KeyPath) -> tuple[str, ...]:
  """The group name(s) of one leaf, as a tuple (more than one: a split leaf)."""
  name = _group_fn(groups)(path)
  names = (name,) if isinstance(name, str) else tuple(name) if isinstance(
      name, (tuple, list)) else None
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError("groups must map key paths to a str or a tuple of str; got "
                    f"{name!r} for {path_str(path)!r}")
  return names


def splits_for(tree: Any, groups: NormGroups) -> tuple[int, ...]:
  """How many parts each leaf of ``tree`` is split into by ``groups``."""
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return tuple(len(_names(groups, p)) for p in paths)


def _check_split(x: Any, parts: int) -> None:
  shape = np.shape(x)
  if parts > 1 and (not shape or shape[0] % parts):
    raise ValueError(f"cannot split a leaf of shape {shape} into {parts} groups "
                     "along its leading axis")


def _sum_squares(x: Any, parts: int, stacked: int = 0) -> jax.Array:
  """``x``'s float32 sum of squares as a vector of ``parts`` partial sums, or of the
  ``stacked`` leaves stacked on ``x``'s leading axis, ``[stacked * parts]``."""
  x = jnp.asarray(x).astype(jnp.float32)
  if parts == 1 and not stacked:
    return jnp.sum(jnp.square(x))[None]  # reduced to a scalar: a scalar all-reduce
  lead = x.shape[:1] if stacked else ()
  rest = x.shape[1:] if stacked else x.shape
  # Split the leading axis only: flattening the rest would merge a tensor-parallel
  # axis into one dimension, and GSPMD would gather the whole leaf to do it.
  split = x.reshape(lead + ((parts, rest[0] // parts) + rest[1:] if parts > 1 else
                            (1,) + rest))  # stacked whole leaves: one part each
  axes = tuple(range(len(lead) + 1, split.ndim))
  return jnp.sum(jnp.square(split), axis=axes).reshape(-1)


def _starts(parts, order) -> tuple[int, ...]:
  """Where each leaf's sums start in a vector holding them in ``order``."""
  ends = np.cumsum([parts[i] for i in order])
  at = {i: int(end - parts[i]) for i, end in zip(order, ends)}
  return tuple(at[i] for i in range(len(parts)))


def _leafwise(leaves, parts) -> jax.Array:
  """One reduction per leaf (every backend), in leaf order."""
  return jnp.concatenate([_sum_squares(x, k) for x, k in zip(leaves, parts)])


def _stacked(leaves, parts, buckets) -> jax.Array:
  """One reduction per bucket (`stack_buckets`), the bucket's leaves stacked: XLA's GPU
  compiler fuses the stack into the reduction, so each leaf is still read once, with
  no copy, by far fewer kernels. The CPU backend would write the stack out:
  `_leafwise` there."""
  pieces = []
  for run in buckets:
    if len(run) == 1:
      pieces.append(_sum_squares(leaves[run[0]], parts[run[0]]))
    else:
      pieces.append(_sum_squares(jnp.stack([jnp.asarray(leaves[i]) for i in run]),
                                 parts[run[0]], stacked=len(run)))
  # XLA would otherwise fold a later ``sum(vector)`` into the big reductions and read
  # every leaf a second time.
  return jax.lax.optimization_barrier(jnp.concatenate(pieces))


def measure(tree: Any, splits: Optional[Sequence[int]] = None) -> LeafSquares:
  """Measures the float32 sum of squares of every leaf of ``tree`` in one pass.

  A leaf holding a NaN gives a NaN sum; a leaf holding an Inf (and no NaN) gives +Inf.
  A finite leaf whose squared norm exceeds the float32 range (norm > ~1.8e19) also gives
  +Inf: its norm, and so any clip, would be infinite, so it counts as an overflow.

  On an NVIDIA GPU leaves of one shape, dtype and sharding (where tracing cannot know
  the sharding, the same weight of many layers: its key path up to layer numbers)
  are measured by one reduction kernel over the stacked leaves, which XLA fuses
  without writing the stack; elsewhere each leaf is its own reduction
  (``lax.platform_dependent`` picks at lowering). Both read each leaf once.

  Args:
    tree: a pytree of arrays.
    splits: per leaf, the number of equal parts along its leading axis to measure
      separately (default 1 each).

  Returns:
    The `LeafSquares` of ``tree``.
  """
  with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = tuple(p for p, _ in with_path)
  leaves = tuple(x for _, x in with_path)
  parts = tuple(splits or (1,) * len(leaves))
  for x, k in zip(leaves, parts):
    _check_split(x, k)
  if not leaves:
    return LeafSquares(leaves, jnp.zeros((0,), jnp.float32), paths, parts, ())
  # Both orders are static: on a GPU the sums come bucket by bucket, elsewhere leaf by
  # leaf; the branches agree on where each leaf's sums sit by permuting the default's.
  buckets = stack_buckets(leaves, parts, paths)
  order = [i for run in buckets for i in run]
  starts = _starts(parts, order)
  in_leaf_order = _starts(parts, range(len(leaves)))
  to_buckets = np.concatenate([np.arange(in_leaf_order[i], in_leaf_order[i] + parts[i])
                               for i in order]).astype(np.int32)
  identity = np.array_equal(to_buckets, np.arange(to_buckets.size))
  vector = jax.lax.platform_dependent(
      *leaves, cuda=lambda *xs: _stacked(xs, parts, buckets),
      default=lambda *xs: (lambda v: v if identity else v[to_buckets])(
          _leafwise(xs, parts)))
  return LeafSquares(leaves, vector, paths, parts, starts)


def reuse_or_measure(tree: Any, leaf_squares: Optional[LeafSquares],
               groups: NormGroups = None) -> LeafSquares:
  """Reuses ``leaf_squares`` when it describes ``tree`` at least as finely as
  ``groups`` needs, else measures ``tree``."""
  splits = splits_for(tree, groups)
  if leaf_squares is not None and leaf_squares.describes(tree) and all(
      k == 1 or p == k for k, p in zip(splits, leaf_squares.parts)):
    return leaf_squares
  return measure(tree, splits)


def grouped(leaf_squares: LeafSquares, groups: NormGroups = None
           ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Group norms and sizes from per-leaf sums; groups keep first-appearance order.

  Each group norm is a masked sum of the sums' vector."""
  names: dict[str, int] = {}
  segment = np.zeros(int(np.sum(leaf_squares.parts, dtype=np.int64)), np.int32)
  for path, k, start in zip(leaf_squares.paths, leaf_squares.parts,
                            leaf_squares.starts):
    leaf_names = _names(groups, path)
    for j in range(k):
      name = leaf_names[0] if len(leaf_names) == 1 else leaf_names[j]
      segment[start + j] = names.setdefault(name, len(names))
  vector = leaf_squares.vector
  # One masked sum per group over the whole vector: sibling reductions of one input,
  # which XLA fuses into one kernel with the finiteness flags and the total.
  norms = {name: jnp.sqrt(jnp.sum(jnp.where(segment == g, vector, 0.0)))
           for name, g in names.items()}
  return norms, _group_sizes(leaf_squares.paths, leaf_squares.leaves, groups)


def _group_sizes(paths, leaves, groups: NormGroups) -> dict[str, jax.Array]:
  """Element count per group; static, but metrics want arrays (int32, or float32
  past the int32 range)."""
  sizes: dict[str, int] = {}
  for path, leaf in zip(paths, leaves):
    names = _names(groups, path)
    for name in names:
      sizes[name] = sizes.get(name, 0) + math.prod(np.shape(leaf)) // len(names)
  return {k: jnp.asarray(v, jnp.int32 if v <= _INT32_MAX else jnp.float32)
          for k, v in sizes.items()}


def static_sizes(sizes: dict[str, jax.Array], previous: Any) -> Any:
  """``previous`` (a state's group sizes) when it holds the same groups as ``sizes``:
  sizes are static, and passing the state's own arrays through costs nothing, where
  new constants cost a copy into the (donated) state each step."""
  same = (jax.tree_util.tree_structure(sizes) ==
          jax.tree_util.tree_structure(previous) and all(
              np.shape(a) == np.shape(b) and jnp.result_type(a) == jnp.result_type(b)
              for a, b in zip(jax.tree_util.tree_leaves(sizes),
                              jax.tree_util.tree_leaves(previous))))
  return previous if same else sizes


def global_norm(tree: Any) -> jax.Array:
  """The L2 norm of all leaves of ``tree`` together, accumulated in float32.

  Args:
    tree: a pytree of arrays (any float dtype).

  Returns:
    A float32 scalar.
  """
  return jnp.sqrt(measure(tree).total())


@_deprecated.renamed_keyword("groups", "norm_groups")
def group_norms(tree: Any, norm_groups: NormGroups = None
               ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Per-group ("local") L2 norms and element counts of ``tree``.

  Args:
    tree: a pytree of arrays.
    norm_groups: how leaves map to groups (see `NormGroups`); default one per
      top-level key.

  Returns:
    ``(norms, sizes)``: dicts from group name to a float32 norm and to the number of
    elements in the group (int32, or float32 past the int32 range).
  """
  groups = validation.norm_groups("norm_groups", norm_groups)
  return grouped(measure(tree, splits_for(tree, groups)), groups)


class GlobalNormClipState(NamedTuple):
  """State of `global_norm_clip`: what it measured at the latest step."""
  global_norm: jax.Array
  """float32 norm of the incoming updates, before clipping."""
  group_norms: dict[str, jax.Array]
  """float32 norm of each group, before clipping."""
  group_sizes: dict[str, jax.Array]
  """Number of elements in each group."""


def zero_group_stats(tree: Any, groups: NormGroups):
  """Group norms of zero and the group sizes of ``tree``, for an initial state."""
  paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [p for p, _ in paths_leaves]
  names = {n: None for p in paths for n in _names(groups, p)}
  zeros = {n: jnp.zeros((), jnp.float32) for n in names}
  return zeros, _group_sizes(paths, [x for _, x in paths_leaves], groups)

@_deprecated.renamed_keyword("groups", "norm_groups")
def global_norm_clip(max_norm: float, *, norm_groups: NormGroups = None
                    ) -> optax.GradientTransformationExtraArgs:
  """Clips updates to a maximum global L2 norm and records global and group norms.

  The updates are multiplied by ``max_norm / max(norm, max_norm)``. Inside an mpscale
  loss-scale or skip wrapper, the norm comes from the wrapper's single pass over the
  gradients (the extra argument ``leaf_squares``), so clipping costs no extra read;
  elsewhere it is measured here.

  Args:
    max_norm: the largest global norm let through; a positive finite float.
    norm_groups: how leaves map to named groups for the recorded ``group_norms``
      (see `NormGroups`); default one group per top-level key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is `GlobalNormClipState`.

  Example:
    >>> import optax, mpscale
    >>> tx = optax.chain(mpscale.global_norm_clip(1.0), optax.adamw(1e-3))
  """
  max_norm = validation.positive_float("max_norm", max_norm)
  groups = validation.norm_groups("norm_groups", norm_groups)

  def init_fn(params):
    norms, sizes = zero_group_stats(params, groups)
    return GlobalNormClipState(jnp.zeros((), jnp.float32), norms, sizes)

  def update_fn(updates, state, params=None, *, leaf_squares=None, **extra_args):
    del params, extra_args
    leaf_squares = reuse_or_measure(updates, leaf_squares, groups)
    norm = jnp.sqrt(leaf_squares.total())
    factor = max_norm / jnp.maximum(norm, max_norm)
    clipped = jax.tree_util.tree_map(lambda u: (u * factor).astype(u.dtype), updates)
    norms, sizes = grouped(leaf_squares, groups)
    return clipped, GlobalNormClipState(norm, norms,
                                        static_sizes(sizes, state.group_sizes))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
