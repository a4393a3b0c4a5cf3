"""Tree helpers the rooms share: key paths as strings, shapes, and optimizer states.

* `path_str`: a key path as the ``/``-joined string every grouping of leaves reads
  (norm groups, parameter groups, the precision policy's float32 names, layouts).
* `shapes`: a tree of arrays as ``jax.ShapeDtypeStruct`` leaves.
* Reading an optimizer state: the loss scale, the metrics and the train step read
  mpscale's wrapper states from wherever they sit in an
  ``optax.chain``/``inject_hyperparams`` state tree; `find` and `find_all` find them
  (with ``optax.tree_utils``), `plain` accepts a Flax NNX optimizer too, and
  `learning_rate` reads the outermost learning rate.
* `stack_buckets`: leaves that stack into one array without moving any (same shape,
  dtype and sharding; the same weight of many layers where tracing cannot know the
  sharding), so that a reduction over the stack is one GPU kernel instead of one per
  leaf (the gradient norms' pass, the RMS clips of CAME's vectors).
* `Stacks` and `layer_stacks`: state kept stacked by role (the same weight of every
  layer as one array), as `mpscale.came`'s ``stack_layers`` keeps it.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

KeyPath = tuple[Any, ...]
"""A key path, as ``jax.tree_util.tree_flatten_with_path`` gives it."""


def path_str(path: KeyPath) -> str:
  """A key path as a ``/``-joined string, e.g. ``"encoder/layer_0/kernel"``
  (``jax.tree_util.keystr`` in its simple form)."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def shapes(tree: Any) -> Any:
  """``tree`` with every leaf a ``jax.ShapeDtypeStruct`` of its shape and dtype."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def nnx_module():
  """flax.nnx if the program has imported it, else None (then no NNX object exists)."""
  return sys.modules.get("flax.nnx")


def plain(opt_state: Any) -> Any:
  """``opt_state`` as plain arrays: a Flax NNX ``nnx.Optimizer`` gives its state, and
  NNX ``Variable`` wrappers (``nnx.OptArray``, ``nnx.OptState``) give their values;
  anything else is returned as it is."""
  nnx = nnx_module()
  if nnx is None:
    return opt_state
  if isinstance(opt_state, nnx.Optimizer):
    opt_state = opt_state.opt_state
  is_var = lambda x: isinstance(x, nnx.Variable)

  def unwrap(x):
    if not is_var(x):
      return x
    return x.get_value() if hasattr(x, "get_value") else x.value
  return jax.tree_util.tree_map(unwrap, opt_state, is_leaf=is_var)


def find_all(opt_state: Any, kind: type) -> list[tuple[Any, Any]]:
  """``(key_path, state)`` of every ``kind`` NamedTuple in ``opt_state`` (itself
  included), outermost first."""
  if isinstance(opt_state, kind):
    return [((), opt_state)] + find_all(tuple(opt_state), kind)
  found = optax.tree_utils.tree_get_all_with_path(
      opt_state, kind.__name__, lambda _, x: isinstance(x, kind))
  return sorted(found, key=lambda path_state: len(path_state[0]))


def find(opt_state: Any, kind: type) -> list[Any]:
  """Every ``kind`` NamedTuple in ``opt_state``, outermost first."""
  return [state for _, state in find_all(opt_state, kind)]


def learning_rate(opt_state: Any) -> Any:
  """The outermost learning rate in ``opt_state``, as float32: an
  ``optax.inject_hyperparams`` hyperparameter or a state field named
  ``learning_rate`` (`mpscale.came`'s, `mpscale.param_groups`'); ``None`` if none."""
  found = optax.tree_utils.tree_get_all_with_path(
      opt_state, "learning_rate", lambda _, x: not isinstance(x, tuple))
  if not found:
    return None
  _, lr = min(found, key=lambda path_value: len(path_value[0]))
  return jnp.asarray(lr, jnp.float32)


# -------------------------------------------------------------------------------------
# Leaves that stack without moving.

_STACK_MAX = 32
"""Leaves stacked into one reduction at most: a GPU fusion reads each as an operand,
and XLA caps a fusion's operands."""

_SMALL = 1 << 16
"""Leaves of at most this many elements (biases, norms' scales) of one shape and
dtype are measured together whatever their names: moving one is cheap even if its
sharding differs from its neighbours'."""

_SMALL_MAX = 128
"""Small leaves measured by one reduction at most."""


_LAYER_NUMBER = re.compile(r"[0-9]+$")


def _role(path: KeyPath) -> tuple[Any, ...]:
  """``path`` with each key's layer number made one wildcard: a list index (``h[3]``),
  a digit key (``h/3``) and a trailing number (linen's ``h_3``, ``Block_3``) alike.
  The same weight of every layer shares a role, and so (as a rule) its sharding."""
  out = []
  for key in path:
    name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
    out.append("*" if isinstance(name, int) else _LAYER_NUMBER.sub("*", str(name)))
  return tuple(out)


def _placement(x: Any) -> Any:
  """What, besides shape and dtype, lets ``x`` share a stack: its sharding as a
  hashable key, or None where tracing cannot know it.

  A concrete array gives its ``sharding``. A traced leaf gives its abstract value's
  sharding where that decides the layout: on a mesh whose axes are explicit or manual
  (``shard_map``), or of one device. On a mesh with an automatic axis of size > 1, and
  with no mesh at all (a jitted leaf on one device, but also an uncommitted argument
  of a jit given ``in_shardings``), GSPMD picks the layout after tracing: None.
  """
  if not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, "sharding", None)  # a jax.Array; NumPy and scalars: None
    return ("host",) if sharding is None else sharding
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  auto = getattr(jax.sharding, "AxisType", None)
  types, sizes = getattr(mesh, "axis_types", None), getattr(mesh, "axis_sizes", ())
  if auto is None or not isinstance(types, tuple) or len(types) != len(sizes) or any(
      t == auto.Auto and size > 1 for t, size in zip(types, sizes)):
    return None
  return (tuple(zip(mesh.axis_names, sizes)), tuple(map(str, types)),
          tuple(sharding.spec))


def stack_buckets(leaves: Sequence[Any], parts: Sequence[int],
                  paths: Sequence[KeyPath]) -> list[list[int]]:
  """Leaves one reduction measures together, as lists of indices: up to `_STACK_MAX`
  leaves stackable without moving any (same shape, dtype, ``parts``, the number of
  equal parts along the leading axis each is measured in, and sharding), or up to
  `_SMALL_MAX` small leaves of one shape and dtype.

  The sharding is `_placement`'s. Where tracing cannot know it (GSPMD's automatic
  axes, or no mesh on the abstract value), the role of the leaf's key path
  (`_role`: its layer numbers made wildcards) stands in for it, since layouts are
  given per role: the same weight of every layer, however the layers are named
  (``h[0]``, ``h/0``, linen's ``h_0``), shares a bucket, and same-shaped weights of
  different roles (a column- and a row-parallel matrix) do not.
  """
  keyed = []
  for x, k, path in zip(leaves, parts, paths):
    small = k == 1 and np.size(x) <= _SMALL
    if small:
      placement = None
    else:
      placement = _placement(x)
      placement = ("role", _role(path)) if placement is None else (
          "sharding", placement)
    keyed.append(((np.shape(x), jnp.result_type(x), k, placement),
                  _SMALL_MAX if small else _STACK_MAX))
  return _runs(keyed)


def _runs(keyed: Sequence[tuple[Any, int]]) -> list[list[int]]:
  """Indices grouped by key (``keyed[i]``: leaf ``i``'s key and its group's most
  leaves), in order of each key's first leaf, a group past its most cut into runs."""
  buckets: dict[Any, list[list[int]]] = {}
  for i, (key, most) in enumerate(keyed):
    runs = buckets.setdefault(key, [[]])
    if len(runs[-1]) == most:
      runs.append([])
    runs[-1].append(i)
  return [run for runs in buckets.values() for run in runs]


# -------------------------------------------------------------------------------------
# State stacked by role.

def layer_stacks(paths: Sequence[KeyPath], shapes: Sequence[Sequence[int]]
                ) -> list[list[int]]:
  """Leaves that share a stack of state, as lists of indices in tree order: the same
  weight of every layer (one role, `_role`: layer numbers made wildcards, however the
  layers are named) and one shape, up to `_STACK_MAX` leaves a stack.

  It reads only key paths and shapes, so the parameters at ``init`` and the
  gradients at ``update`` (whatever their dtypes and shardings) give the same stacks.
  """
  runs = _runs([((_role(path), tuple(shape)), _STACK_MAX)
                for path, shape in zip(paths, shapes)])
  return sorted(runs, key=lambda run: run[0])


@jax.tree_util.register_pytree_with_keys_class
class Stacks:
  """Arrays that each stack some leaves of a tree on a new leading axis: state kept
  by role (one momentum ``[12, 768, 3072]`` for the 12 layers' ``c_fc`` kernels)
  rather than leaf by leaf.

  ``arrays[k][j]`` belongs to the leaf whose key path (`path_str`) is
  ``members[k][j]``. The members are static (the tree's structure), so a layout
  (`mpscale.parallel.state_specs`) and a checkpoint can tell whose state each row is.
  """

  def __init__(self, arrays: Sequence[Any], members: Sequence[Sequence[str]]):
    self.arrays = tuple(arrays)
    self.members = tuple(tuple(m) for m in members)

  def tree_flatten_with_keys(self):
    keys = [jax.tree_util.SequenceKey(k) for k in range(len(self.arrays))]
    return list(zip(keys, self.arrays)), self.members

  def tree_flatten(self):
    return self.arrays, self.members

  @classmethod
  def tree_unflatten(cls, members, arrays):
    return cls(arrays, members)

  def __eq__(self, other):  # as a NamedTuple compares: member by member
    return (isinstance(other, Stacks) and self.members == other.members
            and self.arrays == other.arrays)

  __hash__ = None  # type: ignore[assignment]  # holds arrays, as a NamedTuple would

  def __repr__(self):
    rows = ", ".join(f"{m[0]} x{len(m)}: {getattr(x, 'shape', x)}"
                     for m, x in zip(self.members, self.arrays))
    return f"Stacks({rows})"
