"""Gradient norms: one float32 sum of squares per leaf, shared by every consumer.

A full reduction over the gradients is a pass over memory that XLA cannot fuse into the
optimizer's elementwise update. mpscale makes that pass once: the finiteness check, the
global norm, the per-group ("local") norms and the clip all read the same per-leaf sums
of squares (`LeafSquares`). The loss-scale and skip wrappers hand them to the inner
transformation as the extra argument ``leaf_squares``; `clip_by_global_norm` reuses
them when they describe exactly the updates it receives.

One pass, every consumer::

  s[leaf] = sum(float32(leaf) ** 2)          # a vector of k parts for a split leaf
  overflow = any(isnan(s) or isinf(s))        # mpscale.skip
  global_norm = sqrt(sum(s))
  group_norms[name] = sqrt(sum of s over the leaves (or parts) in group name)
  clipped = updates * max_norm / max(global_norm, max_norm)

The code reads the same way::

  leaf_squares = measure(tree, splits_for(tree, groups))       # s, a LeafSquares
  leaf_squares = reuse_or_measure(tree, leaf_squares, groups)  # or a wrapper's s
  global_norm = jnp.sqrt(total(leaf_squares.sums))
  group_norms, group_sizes = grouped(leaf_squares, groups)
  clip_by_global_norm: factor = max_norm / jnp.maximum(norm, max_norm)
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpscale import validation

KeyPath = tuple[Any, ...]
Groups = Union[None, int, Callable[[KeyPath], Union[str, Sequence[str]]]]
"""How leaves map to named groups.

* ``None``: one group per top-level key of the tree (the default).
* an ``int`` ``d``: one group per distinct path prefix of depth ``d`` (``1`` is the same as
  ``None``), named by joining the keys with ``/``.
* a callable ``key_path -> str``: any grouping, e.g. per layer. It may also return a
  tuple of ``k`` names: the leaf is then split into ``k`` equal parts along its leading
  axis, part ``i`` going to group ``names[i]`` (layers stacked on a leading axis, e.g.
  one group per pipeline stage: see `mpscale.stage_groups`). The split is measured in
  the same single pass.
"""

_INT32_MAX = np.iinfo(np.int32).max


def path_str(path: KeyPath) -> str:
  """A key path as a ``/``-joined string, e.g. ``"encoder/layer_0/kernel"``
  (``jax.tree_util.keystr`` in its simple form)."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _group_fn(groups: Groups) -> Callable[[KeyPath], str]:
  if callable(groups):
    return groups
  depth = 1 if groups is None else groups
  return lambda path: path_str(path[:depth]) if path else "params"


class LeafSquares(NamedTuple):
  """Per-leaf float32 sums of squares of one gradient tree, made in a single pass.

  Not a state: it lives for one ``update`` call and travels to inner transformations as
  the extra argument ``leaf_squares``.
  """
  leaves: tuple[Any, ...]
  """The very arrays (or tracers) that were measured, so a consumer can check by
  identity that the sums describe its own inputs."""
  sums: tuple[jax.Array, ...]
  """Per leaf, ``sum(leaf.astype(float32) ** 2)``: a float32 scalar, or a vector of
  ``k`` partial sums for a leaf split into ``k`` parts along its leading axis."""
  paths: tuple[KeyPath, ...]
  """Key path of each leaf."""

  def describes(self, tree: Any) -> bool:
    """True when ``tree``'s leaves are exactly the measured arrays."""
    leaves = jax.tree_util.tree_leaves(tree)
    return len(leaves) == len(self.leaves) and all(
        a is b for a, b in zip(leaves, self.leaves))


def _names(groups: Groups, path: KeyPath) -> tuple[str, ...]:
  """The group name(s) of one leaf, as a tuple (more than one: a split leaf)."""
  name = _group_fn(groups)(path)
  names = (name,) if isinstance(name, str) else tuple(name) if isinstance(
      name, (tuple, list)) else None
  if not names or not all(isinstance(n, str) for n in names):
    raise TypeError("groups must map key paths to a str or a tuple of str; got "
                    f"{name!r} for {path_str(path)!r}")
  return names


def splits_for(tree: Any, groups: Groups) -> tuple[int, ...]:
  """How many parts each leaf of ``tree`` is split into by ``groups``."""
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return tuple(len(_names(groups, p)) for p in paths)


def _sum_squares(x: Any, parts: int) -> jax.Array:
  x = jnp.asarray(x).astype(jnp.float32)
  if parts == 1:
    return jnp.sum(jnp.square(x))
  if x.ndim == 0 or x.shape[0] % parts:
    raise ValueError(f"cannot split a leaf of shape {x.shape} into {parts} groups "
                     "along its leading axis")
  # Split the leading axis only: flattening the rest would merge a tensor-parallel
  # axis into one dimension, and GSPMD would gather the whole leaf to do it.
  split = x.reshape((parts, x.shape[0] // parts) + x.shape[1:])
  return jnp.sum(jnp.square(split), axis=tuple(range(1, split.ndim)))


def measure(tree: Any, splits: Optional[Sequence[int]] = None) -> LeafSquares:
  """Measures the float32 sum of squares of every leaf of ``tree`` in one pass.

  A leaf holding a NaN gives a NaN sum; a leaf holding an Inf (and no NaN) gives +Inf.
  A finite leaf whose squared norm exceeds the float32 range (norm > ~1.8e19) also gives
  +Inf: its norm, and so any clip, would be infinite, so it counts as an overflow.

  Args:
    tree: a pytree of arrays.
    splits: per leaf, the number of equal parts along its leading axis to measure
      separately (default 1 each).
  """
  with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = tuple(p for p, _ in with_path)
  leaves = tuple(x for _, x in with_path)
  splits = splits or (1,) * len(leaves)
  sums = tuple(_sum_squares(x, k) for x, k in zip(leaves, splits))
  return LeafSquares(leaves, sums, paths)


def reuse_or_measure(tree: Any, leaf_squares: Optional[LeafSquares],
               groups: Groups = None) -> LeafSquares:
  """Reuses ``leaf_squares`` when it describes ``tree`` at least as finely as
  ``groups`` needs, else measures ``tree``."""
  splits = splits_for(tree, groups)
  if leaf_squares is not None and leaf_squares.describes(tree) and all(
      k == 1 or np.size(s) == k for k, s in zip(splits, leaf_squares.sums)):
    return leaf_squares
  return measure(tree, splits)


def total(sums: Sequence[jax.Array]) -> jax.Array:
  """Sum of per-leaf sums (scalars or split vectors) as one float32 scalar."""
  return sum((jnp.sum(s) for s in sums), jnp.zeros((), jnp.float32))


def grouped(leaf_squares: LeafSquares, groups: Groups = None
           ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Group norms and sizes from per-leaf sums; groups keep first-appearance order."""
  sq: dict[str, list[jax.Array]] = {}
  for path, s in zip(leaf_squares.paths, leaf_squares.sums):
    names = _names(groups, path)
    parts = [jnp.sum(s)] if len(names) == 1 else [s[i] for i in range(len(names))]
    for name, part in zip(names, parts):
      sq.setdefault(name, []).append(part)
  norms = {k: jnp.sqrt(total(v)) for k, v in sq.items()}
  return norms, _group_sizes(leaf_squares.paths, leaf_squares.leaves, groups)


def _group_sizes(paths, leaves, groups: Groups) -> dict[str, jax.Array]:
  """Element count per group; static, but metrics want arrays (int32, or float32
  past the int32 range)."""
  sizes: dict[str, int] = {}
  for path, leaf in zip(paths, leaves):
    names = _names(groups, path)
    for name in names:
      sizes[name] = sizes.get(name, 0) + math.prod(np.shape(leaf)) // len(names)
  return {k: jnp.asarray(v, jnp.int32 if v <= _INT32_MAX else jnp.float32)
          for k, v in sizes.items()}


def global_norm(tree: Any) -> jax.Array:
  """The L2 norm of all leaves of ``tree`` together, accumulated in float32.

  Args:
    tree: a pytree of arrays (any float dtype).

  Returns:
    A float32 scalar.
  """
  return jnp.sqrt(total(measure(tree).sums))


def group_norms(tree: Any, groups: Groups = None
               ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Per-group ("local") L2 norms and element counts of ``tree``.

  Args:
    tree: a pytree of arrays.
    groups: how leaves map to groups (see `Groups`); default one per top-level key.

  Returns:
    ``(norms, sizes)``: dicts from group name to a float32 norm and to the number of
    elements in the group (int32, or float32 past the int32 range).
  """
  groups = validation.groups("groups", groups)
  return grouped(measure(tree, splits_for(tree, groups)), groups)


class ClipByGlobalNormState(NamedTuple):
  """State of `clip_by_global_norm`: what it measured at the latest step."""
  global_norm: jax.Array
  """float32 norm of the incoming updates, before clipping."""
  group_norms: dict[str, jax.Array]
  """float32 norm of each group, before clipping."""
  group_sizes: dict[str, jax.Array]
  """Number of elements in each group."""


def zero_group_stats(tree: Any, groups: Groups):
  """Group norms of zero and the group sizes of ``tree``, for an initial state."""
  paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [p for p, _ in paths_leaves]
  names = {n: None for p in paths for n in _names(groups, p)}
  zeros = {n: jnp.zeros((), jnp.float32) for n in names}
  return zeros, _group_sizes(paths, [x for _, x in paths_leaves], groups)



def clip_by_global_norm(max_norm: float, *, groups: Groups = None
                       ) -> optax.GradientTransformationExtraArgs:
  """Clips updates to a maximum global L2 norm and records global and group norms.

  The updates are multiplied by ``max_norm / max(norm, max_norm)``. Inside an mpscale
  loss-scale or skip wrapper, the norm comes from the wrapper's single pass over the
  gradients (the extra argument ``leaf_squares``), so clipping costs no extra read;
  elsewhere it is measured here.

  Args:
    max_norm: the largest global norm let through; a positive finite float.
    groups: how leaves map to named groups for the recorded ``group_norms`` (see
      `Groups`); default one group per top-level key.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is `ClipByGlobalNormState`.

  Example:
    >>> import optax, mpscale
    >>> tx = optax.chain(mpscale.clip_by_global_norm(1.0), optax.adamw(1e-3))
  """
  max_norm = validation.positive_float("max_norm", max_norm)
  groups = validation.groups("groups", groups)

  def init_fn(params):
    norms, sizes = zero_group_stats(params, groups)
    return ClipByGlobalNormState(jnp.zeros((), jnp.float32), norms, sizes)

  def update_fn(updates, state, params=None, *, leaf_squares=None, **extra_args):
    del params, state, extra_args
    leaf_squares = reuse_or_measure(updates, leaf_squares, groups)
    norm = jnp.sqrt(total(leaf_squares.sums))
    factor = max_norm / jnp.maximum(norm, max_norm)
    clipped = jax.tree_util.tree_map(lambda u: (u * factor).astype(u.dtype), updates)
    norms, sizes = grouped(leaf_squares, groups)
    return clipped, ClipByGlobalNormState(norm, norms, sizes)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
