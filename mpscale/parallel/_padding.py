"""Layouts on any device count: a leaf whose dimension its axes do not divide, padded.

JAX's shardings split a dimension evenly: an array of 20,480 rows cannot live split
over 1,120 devices. A layout (`fsdp_specs` with ``pad=True``, or any ``param_specs``)
may still split such a dimension; the step then stores that leaf padded with zeros to
the next multiple of its axes' size, as a `Padded` node holding the padded array and
the true shape, so every device holds ``1/N`` of it (torch FSDP2 pads its shards the
same way; DeepSpeed pads flattened buffers).

Inside the step the leaf is cut back to its true shape (`unpad`) before anything reads
it, and padded again after (`pad_to`). Under GSPMD, on a mesh whose axes are
automatic, the cut and the pad are local: XLA lays an unevenly split array out as its
padded shards, so no bytes move, and the model, the gradients, the optimizer (a
factored moment's row and column means included) and every norm see the true shapes
only. The padding never reaches the math.

`padded_shape` says what a leaf is stored as.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mpscale.parallel._layouts import axis_size, pad


@jax.tree_util.register_pytree_with_keys_class
class Padded:
  """A leaf stored padded with zeros at the end of the dimensions its layout splits
  unevenly: ``value`` (the padded array) and ``shape`` (the true shape, static)."""

  def __init__(self, value: Any, shape: Sequence[int]):
    self.value, self.shape = value, tuple(int(n) for n in shape)

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("value"), self.value),), self.shape

  def tree_flatten(self):
    return (self.value,), self.shape

  @classmethod
  def tree_unflatten(cls, shape, children):
    return cls(children[0], shape)

  def __repr__(self) -> str:
    return f"Padded({self.value!r}, shape={self.shape})"


def is_padded(x: Any) -> bool:
  """Whether ``x`` is a `Padded` node (the ``is_leaf`` of a padded state)."""
  return isinstance(x, Padded)


def holds_padding(tree: Any) -> bool:
  """Whether ``tree`` holds a `Padded` node."""
  return any(is_padded(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_padded))


def padded_shape(shape: Sequence[int], spec: PartitionSpec,
                 mesh: Optional[Mesh]) -> tuple[int, ...]:
  """``shape`` with each dimension ``spec`` splits rounded up to a multiple of the
  size of the axes splitting it (``shape`` itself where they divide it)."""
  if mesh is None:
    return tuple(shape)
  return tuple(-(-n // size) * size for n, size in zip(
      shape, (axis_size(mesh, entry) for entry in pad(spec, len(shape)))))


def _needs(leaf: Any, sharding: Any) -> bool:
  return (isinstance(sharding, NamedSharding) and hasattr(leaf, "shape")
          and padded_shape(leaf.shape, sharding.spec, sharding.mesh)
          != tuple(leaf.shape))


def uneven_leaves(tree: Any, shardings: Any) -> list[str]:
  """The leaves of ``tree`` (true shapes) their shardings split unevenly, each as
  ``'path' (shape, spec)``."""
  from mpscale import _tree
  found = []
  for (path, leaf), sharding in zip(
      jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(shardings)):
    if _needs(leaf, sharding):
      found.append(f"{_tree.path_str(path)!r} ({tuple(leaf.shape)}, {sharding.spec})")
  return found


def pad_to(tree: Any, shardings: Any) -> Any:
  """``tree`` (true shapes; arrays, tracers or ``ShapeDtypeStruct``s) with every leaf
  its sharding splits unevenly padded with zeros into a `Padded` node (of a
  ``ShapeDtypeStruct`` of the padded shape, in that sharding, for a shape)."""
  def one(leaf, sharding):
    if not _needs(leaf, sharding):
      return leaf
    shape = padded_shape(leaf.shape, sharding.spec, sharding.mesh)
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return Padded(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding),
                    leaf.shape)
    widths = [(0, p - n) for n, p in zip(leaf.shape, shape)]
    return Padded(lax.with_sharding_constraint(jnp.pad(leaf, widths), sharding),
                  leaf.shape)
  return jax.tree_util.tree_map(one, tree, shardings)


def stored_shardings(tree: Any, shardings: Any) -> Any:
  """``shardings`` (like ``tree``, true shapes) shaped like ``pad_to(tree,
  shardings)``: a `Padded` node around each padded leaf's sharding (a jit's
  ``out_shardings`` for a padded state)."""
  return jax.tree_util.tree_map(
      lambda leaf, sharding: Padded(sharding, leaf.shape) if _needs(leaf, sharding)
      else sharding, tree, shardings)


def unpad(tree: Any) -> Any:
  """``tree`` with every `Padded` node cut back to its true shape (shapes stay
  shapes). Inside ``jit``, constrain the cut to the padded form's sharding, so that
  it moves nothing (`mpscale.step`'s ``Layout.unpad``); outside, on a split array,
  ``jax.device_get`` it first."""
  def one(leaf):
    if not is_padded(leaf):
      return leaf
    if isinstance(leaf.value, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(leaf.shape, leaf.value.dtype)
    return leaf.value[tuple(slice(0, n) for n in leaf.shape)]
  return jax.tree_util.tree_map(one, tree, is_leaf=is_padded)


def padded_values(tree: Any) -> Any:
  """``tree`` with every `Padded` node replaced by its padded array: the arrays a
  padded state stores (what a checkpoint writes)."""
  return jax.tree_util.tree_map(lambda x: x.value if is_padded(x) else x, tree,
                                is_leaf=is_padded)


def rewrap(values: Any, like: Any) -> Any:
  """``values`` (a tree of padded arrays, as `padded_values` gives) put back in the
  `Padded` nodes of ``like``."""
  return jax.tree_util.tree_map(
      lambda v, x: Padded(v, x.shape) if is_padded(x) else v, values, like)

