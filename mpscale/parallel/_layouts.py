"""Parameter layouts on a mesh: PartitionSpecs for parameters, optimizer state, batches.

A layout is one ``PartitionSpec`` per parameter leaf. `make_train_step` takes it as
``param_specs``, in any of three forms, resolved once by `resolve_specs`::

  param_specs = {"w": P("fsdp", "tensor"), "b": P()}     # a pytree like the params
  param_specs = lambda path, leaf: P(...)                 # a function of the key path
  param_specs = logical_specs(names, rules)               # logical axis names + rules

Logical names are MaxText's and Flax's idea: a model names each dimension once
(``("embed", "mlp")`` for an MLP kernel) and a table of rules maps names to mesh axes
(``("embed", "fsdp"), ("mlp", "tensor")``), so one model runs under every layout. Flax
models that carry their own metadata (``nn.with_logical_partitioning``,
``nn.with_partitioning``, ``nnx.with_partitioning``) give their specs with
`flax_specs`.

Everything else follows the parameters::

  optimizer state   a leaf shaped like its parameter takes its spec; a factored moment
                    (CAME's and Adafactor's row and column statistics, one dimension
                    fewer) takes the spec without the dimension its state declares it
                    averages over (`averaged_dims`); scalars replicate
  ZeRO-1            on top, each optimizer-state leaf also splits its largest free
                    dimension over the data axes that are not already in its spec
  FSDP (ZeRO-3)     `fsdp_specs`: each parameter splits its largest free dimension
                    over the ``fsdp`` axis; it is all-gathered where it is used, a
                    layer at a time, and its gradient reduce-scattered there
                    (`mpscale.parallel`; inside pipeline stages, `mpscale.parallel.pipeline`)
  the batch         leading dimension over the data axes (``data`` and ``fsdp``):
                    `data_axes`, `batch_sharding`; `batch_rows` checks it divides

GSPMD turns the specs into collectives. What mpscale adds (the overflow check, the
global and group norms, the clip, the loss scale) reads one float32 sum of squares per
leaf, which XLA computes where each shard lives and all-reduces as a scalar: no
gradient ever crosses devices for them.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020. https://arxiv.org/abs/1910.02054
  Xu et al., "GSPMD: General and Scalable Parallelization for ML Computation Graphs",
  2021. https://arxiv.org/abs/2105.04663
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from mpscale import _tree

AxisNames = Union[None, str, tuple[str, ...]]
Rules = Sequence[tuple[str, AxisNames]]
SpecsLike = Union[None, Any, Callable[[Any, Any], PartitionSpec]]

_UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


def is_spec(x: Any) -> bool:
  """Whether ``x`` is a ``PartitionSpec`` (the ``is_leaf`` of a pytree of specs)."""
  return isinstance(x, PartitionSpec)


def pad(spec: PartitionSpec, ndim: int) -> list[AxisNames]:
  """The entries of ``spec`` padded with ``None`` to ``ndim``."""
  return list(spec) + [None] * (ndim - len(spec))


def entry_axes(entry: AxisNames) -> tuple[str, ...]:
  """The mesh axes one spec entry names (``()`` for ``None`` and ``UNCONSTRAINED``)."""
  if entry is None or entry is _UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]) -> AxisNames:
  """The spec entry naming ``axes``: ``None``, one axis, or a tuple of them."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def make_spec(entries: Sequence[AxisNames]) -> PartitionSpec:
  """The spec of ``entries``, without trailing ``None`` entries (XLA returns specs in
  that form, and jit would otherwise see two different shardings and compile twice)."""
  entries = list(entries)
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
  """Every mesh axis ``spec`` names, in order."""
  return tuple(a for entry in spec for a in entry_axes(entry))


def axis_size(mesh: Mesh, axes: AxisNames) -> int:
  """The number of devices along ``axes`` of ``mesh`` (1 for ``None``)."""
  return math.prod(mesh.shape[a] for a in entry_axes(axes))


# --------------------------------------------------------------------------- logical
def logical_specs(logical: Any, rules: Rules) -> Any:
  """PartitionSpecs from logical axis names, through ``rules``.

  Args:
    logical: a pytree whose leaves are tuples of logical names, one per dimension
      (``None`` for a dimension that is never split), e.g. ``("embed", "mlp")``.
    rules: ``(logical name, mesh axis | tuple of axes | None)`` pairs. A name without
      a rule, or whose mesh axes an earlier dimension of the same leaf already uses, is
      not split (Flax's ``logical_to_mesh_axes`` convention).

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``logical``.
  """
  table: dict[str, AxisNames] = {}
  for rule in rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2
            and isinstance(rule[0], str)):
      raise TypeError(f"rules must be (logical name, mesh axes) pairs; got {rule!r}")
    table.setdefault(rule[0], rule[1])

  def one(names):
    used: set[str] = set()
    entries = []
    for name in names:
      axes = entry_axes(table.get(name)) if name is not None else ()
      if not axes or used & set(axes):
        entries.append(None)
        continue
      used |= set(axes)
      entries.append(spec_entry(axes))
    return make_spec(entries)

  return jax.tree_util.tree_map(
      one, logical, is_leaf=lambda x: isinstance(x, tuple) and all(
          n is None or isinstance(n, str) for n in x))


def flax_specs(variables: Any, rules: Optional[Rules] = None) -> Any:
  """The PartitionSpecs a Flax model's parameters carry as metadata.

  Args:
    variables: linen variables or params holding ``nn.Partitioned`` /
      ``nn.LogicallyPartitioned`` boxes, or an ``nnx.State`` whose variables have a
      ``sharding`` (``nnx.with_partitioning``).
    rules: rules for the logical names of ``nn.with_logical_partitioning``; without
      them its names are taken as mesh axes.

  Returns:
    A pytree of ``PartitionSpec`` shaped like ``flax_unbox(variables)`` (leaves with
    no metadata are replicated).
  """
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(variables, nnx.State):
    # The variable types: flax 0.10 has VariableState besides Variable; flax >= 0.11
    # has Variable only (its VariableState is a deprecated alias, not read here).
    variable_types = (nnx.Variable,) + tuple(
        t for t in (nnx.__dict__.get("VariableState"),)
        if isinstance(t, type) and t is not nnx.Variable)

    def of_variable(v):
      names = getattr(v, "out_sharding", None)        # flax >= 0.12
      if names is None:
        names = getattr(v, "sharding_names", None)    # flax 0.11
      if names is None:
        names = getattr(v, "sharding", None)          # flax 0.10: the names
        names = names if isinstance(names, (tuple, list)) else None
      return PartitionSpec(*names) if names else PartitionSpec()

    return jax.tree_util.tree_map(of_variable, variables,
                                  is_leaf=lambda v: isinstance(v, variable_types))

  def of_box(box):
    if not isinstance(box, nn.Partitioned):
      return PartitionSpec()
    if isinstance(box, nn.LogicallyPartitioned) and rules is not None:
      return logical_specs(tuple(box.names), rules)
    return PartitionSpec(*box.names)

  return jax.tree_util.tree_map(of_box, variables,
                                is_leaf=lambda x: isinstance(x, nn.Partitioned))


def flax_unbox(variables: Any) -> Any:
  """``variables`` without Flax's partitioning boxes (plain arrays)."""
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  return nn.meta.unbox(variables)


# --------------------------------------------------------------------------- resolve
def resolve_specs(param_specs: SpecsLike, params: Any) -> Any:
  """One ``PartitionSpec`` per leaf of ``params``, from any accepted form.

  Args:
    param_specs: ``None`` (replicated), a pytree of ``PartitionSpec`` with the
      structure of ``params`` (or a prefix of it: a spec covers a whole subtree), or a
      function ``(key_path, leaf) -> PartitionSpec``.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``params``.

  Raises:
    TypeError: naming the leaf when a function returns something else, or when the
      pytree does not match ``params``.
  """
  if param_specs is None:
    return jax.tree_util.tree_map(lambda _: PartitionSpec(), params)
  if callable(param_specs) and not is_spec(param_specs):
    def call(path, leaf):
      spec = param_specs(path, leaf)
      if spec is None:
        return PartitionSpec()
      if not is_spec(spec):
        raise TypeError(f"param_specs({_tree.path_str(path)!r}, leaf) must return "
                        f"a PartitionSpec; got {type(spec).__name__}")
      return spec
    return jax.tree_util.tree_map_with_path(call, params)
  try:
    return jax.tree_util.tree_map(
        lambda spec, leaf: jax.tree_util.tree_map(
            lambda _: PartitionSpec() if spec is None else spec, leaf),
        param_specs, params, is_leaf=lambda x: x is None or is_spec(x))
  except (ValueError, TypeError) as e:
    raise TypeError("param_specs must be a pytree of PartitionSpec matching the "
                    f"params (or a prefix of them), or a function; {e}") from None


def check_specs(params: Any, specs: Any, mesh: Mesh, what: str = "param_specs",
                uneven_axes: Sequence[str] = ()) -> None:
  """Raises ``ValueError`` naming the leaf and the axis of a layout that cannot work.

  Checks every leaf: its spec has at most one entry per dimension, names axes of
  ``mesh`` only, uses each at most once, and each dimension is divisible by the size
  of the axes that split it; a dimension split by ``uneven_axes`` alone (a train
  step's data axes: FSDP) need only be at least that size (the step stores the leaf
  padded, `mpscale.parallel.Padded`).
  """
  for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree_util.tree_leaves(specs, is_leaf=is_spec)):
    name = _tree.path_str(path) or "params"
    shape = np.shape(leaf)
    if len(spec) > len(shape):
      raise ValueError(f"{what}: leaf {name!r} of shape {shape} has a spec {spec} with "
                       f"{len(spec)} entries for {len(shape)} dimensions")
    seen: set[str] = set()
    for dim, entry in enumerate(pad(spec, len(shape))):
      for axis in entry_axes(entry):
        if axis not in mesh.axis_names:
          raise ValueError(f"{what}: leaf {name!r} names mesh axis {axis!r}, which the "
                           f"mesh does not have (its axes are {tuple(mesh.axis_names)})")
        if axis in seen:
          raise ValueError(f"{what}: leaf {name!r} uses mesh axis {axis!r} twice in "
                           f"{spec}")
        seen.add(axis)
      size = axis_size(mesh, entry)
      even = not (entry_axes(entry) and set(entry_axes(entry)) <= set(uneven_axes))
      if not even and shape[dim] < size:
        raise ValueError(
            f"{what}: leaf {name!r} dimension {dim} (size {shape[dim]}) is smaller "
            f"than mesh axis {entry!r} (size {size}): some devices would hold "
            "nothing but padding")
      if even and shape[dim] % size:
        raise ValueError(
            f"{what}: leaf {name!r} dimension {dim} (size {shape[dim]}) is not "
            f"divisible by mesh axis {entry!r} (size {size})")


def shardings(mesh: Mesh, specs: Any) -> Any:
  """``NamedSharding``s on ``mesh`` for a pytree of specs."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=is_spec)


# --------------------------------------------------------------------------- FSDP
def split_largest(spec: PartitionSpec, shape: Sequence[int], axes: AxisNames,
                  size: int, uneven: bool = False) -> PartitionSpec:
  """``spec`` with ``axes`` added on the largest dimension that no axis splits yet and
  that ``size`` divides; ``spec`` unchanged when there is none (or ``size`` is 1).

  With ``uneven``, where ``size`` divides no free dimension, the free dimension of at
  least ``size`` whose padding to a multiple of ``size`` adds the fewest elements
  (the largest of those tied): the step stores that leaf padded
  (`mpscale.parallel.Padded`).
  """
  axes = tuple(a for a in entry_axes(axes) if a not in spec_axes(spec))
  if not axes or size == 1:
    return spec
  entries = pad(spec, len(shape))
  free = [dim for dim, n in enumerate(shape) if entries[dim] is None and n >= size]
  even = [dim for dim in free if shape[dim] % size == 0]
  if even:
    best = max(even, key=lambda dim: shape[dim])  # the first of the largest
  elif uneven and free:
    total = math.prod(shape)
    best = min(free, key=lambda dim: (
        -(-shape[dim] // size) * size * (total // shape[dim]), -shape[dim]))
  else:
    return spec
  entries[best] = spec_entry(axes)
  return make_spec(entries)


def split_across(spec: PartitionSpec, shape: Sequence[int], first: AxisNames,
                 second: AxisNames, sizes: tuple[int, int],
                 uneven: bool = False) -> PartitionSpec:
  """``spec`` with two groups of axes added, each on its own free dimension (MaxText's
  ``fsdp`` and ``fsdp_transpose``): ``first`` (of size ``sizes[0]``) and ``second``
  (``sizes[1]``) on the two dimensions that split evenly, the largest such for
  ``first``; else both together on one dimension their product divides
  (`split_largest`).

  A device count that divides no dimension (1,120 = 32 x 35 GPUs for a 530B GPT,
  whose dimensions 7 divides none of) splits a leaf 1/N with less padding this way
  than on one dimension: ``(20480, 81920)`` pads to ``(20480, 81935)`` (+0.02%) over
  32 and 35, to ``(20480, 82880)`` (+1.2%) over 1,120.

  Args:
    spec: the leaf's layout so far (tensor or stage splits).
    shape: the leaf's shape.
    first: the mesh axis (or axes) of the first group.
    second: the mesh axis (or axes) of the second group.
    sizes: the two groups' sizes.
    uneven: where nothing splits evenly, the placement that pads fewest elements
      (either group on its own dimension, or both on one), stored padded by the step
      (`mpscale.parallel.Padded`); else each group as `split_largest` places it alone.

  Returns:
    The ``PartitionSpec``.
  """
  taken = spec_axes(spec)
  first, second = (tuple(a for a in entry_axes(g) if a not in taken)
                   for g in (first, second))

  def each_alone():  # each group where split_largest places it, the first first
    return split_largest(split_largest(spec, shape, first, sizes[0], uneven), shape,
                         second, sizes[1], uneven)

  if not first or not second or 1 in sizes:
    return each_alone()
  entries = pad(spec, len(shape))
  free = [dim for dim, n in enumerate(shape) if entries[dim] is None]
  total = math.prod(shape)
  both = sizes[0] * sizes[1]

  def padded(*splits):  # elements of the leaf padded for (dim, size) splits
    out = list(shape)
    for dim, size in splits:
      out[dim] = -(-out[dim] // size) * size
    return math.prod(out)

  # (cost, preference, placement): apart on two dimensions, or together on one.
  options = [(padded((a, sizes[0]), (b, sizes[1])), 0, -shape[a], -shape[b], (a, b))
             for a in free for b in free
             if a != b and shape[a] >= sizes[0] and shape[b] >= sizes[1]]
  options += [(padded((d, both)), 1, -shape[d], 0, (d,)) for d in free
              if shape[d] >= both]
  even = [o for o in options if o[0] == total]
  if not even and not uneven:
    return each_alone()
  if not options:
    return spec
  place = min(even or options)[-1]
  if len(place) == 1:
    entries[place[0]] = spec_entry(first + second)
  else:
    entries[place[0]], entries[place[1]] = spec_entry(first), spec_entry(second)
  return make_spec(entries)


def is_array_like(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def only_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
  """``spec`` cut to the mesh ``axes`` (a ``shard_map``'s manual axes): each entry
  keeps the axes in ``axes``, ``None`` where none is left."""
  return PartitionSpec(*(spec_entry([a for a in entry_axes(e) if a in axes])
                         for e in spec))


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
  """``spec`` without the mesh ``axes``: the layout of a leaf gathered over them."""
  return make_spec([spec_entry([a for a in entry_axes(e) if a not in axes]) for e in spec])


def split_dims(spec: PartitionSpec, axes: Sequence[str]
              ) -> list[tuple[int, tuple[str, ...]]]:
  """``(dim, axes splitting it)`` for each dimension ``spec`` splits over ``axes``."""
  found = []
  for dim, entry in enumerate(spec):
    over = tuple(a for a in entry_axes(entry) if a in axes)
    if over:
      found.append((dim, over))
  return found


# --------------------------------------------------------------------------- memory
def tree_bytes(tree: Any, specs: Any = None, mesh: Optional[Mesh] = None, *,
               per_device: bool = True) -> int:
  """Bytes of the array leaves of ``tree``: all of them, or what one device holds.

  Exact, from shapes: ``tree`` may hold arrays or ``jax.ShapeDtypeStruct`` leaves;
  other leaves (and ``None``) hold no bytes.

  Args:
    tree: a pytree, e.g. parameters, an optimizer state, a batch.
    specs: a ``PartitionSpec`` per leaf of ``tree``; with ``mesh``, each leaf counts
      its shard under its spec. ``None``: each leaf's own ``.sharding`` decides
      (a leaf without one counts whole).
    mesh: the mesh ``specs`` lay the leaves out on.
    per_device: ``False``: every byte of every leaf, whatever its layout.

  Returns:
    The number of bytes.

  Raises:
    ValueError: for ``specs`` without a ``mesh``, or with another number of leaves
      than ``tree``.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  shardings: list[Any] = [getattr(x, "sharding", None) for x in leaves]
  if specs is not None and per_device:
    if mesh is None:
      raise ValueError("tree_bytes: specs need a mesh")
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=is_spec)
    if len(spec_leaves) != len(leaves):
      raise ValueError(f"tree_bytes: {len(spec_leaves)} specs for {len(leaves)} "
                       "leaves")
    shardings = [NamedSharding(mesh, s) for s in spec_leaves]
  total = 0
  for leaf, sharding in zip(leaves, shardings):
    if not is_array_like(leaf):
      continue
    shape = tuple(leaf.shape)
    if per_device and sharding is not None:
      shape = sharding.shard_shape(shape)
    total += math.prod(shape) * leaf.dtype.itemsize
  return int(total)


def bytes_per_device(mesh: Mesh, params: Any, specs: Any) -> dict[str, int]:
  """Bytes of ``params`` laid out by ``specs`` on ``mesh``, in all and per device.

  Exact: from shapes and specs (`tree_bytes`); ``params`` may hold
  ``jax.ShapeDtypeStruct`` leaves.

  Returns:
    ``{"total": int, "per_device": int}``.
  """
  return {"total": tree_bytes(params, per_device=False),
          "per_device": tree_bytes(params, specs, mesh)}
