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
                    (`mpscale.batch_split`; inside pipeline stages, `mpscale.pipeline`)
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

import functools
import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
import numpy as np
import optax

from mpscale import norms as norms_lib
from mpscale import validation

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


def _entry(axes: Sequence[str]) -> AxisNames:
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


# --------------------------------------------------------------------------- the batch
def data_axes(mesh: Optional[Mesh], data_axis: AxisNames) -> tuple[str, ...]:
  """``data_axis`` as the tuple of data-parallel axes of ``mesh`` (``()`` without one).

  Args:
    mesh: a ``jax.sharding.Mesh`` with Auto axes, or ``None`` for one device (or a
      ``jax.sharding.AbstractMesh``, to build a step that is checked, not run).
    data_axis: the mesh axis the batch is split over, or a tuple of them.

  Returns:
    The axes, in order.

  Raises:
    TypeError: for a ``mesh`` that is no ``Mesh``, or a ``data_axis`` that is not a
      str or a non-empty tuple of str.
    ValueError: for an axis ``mesh`` lacks, or a mesh with Explicit axes (GSPMD lays
      the arrays out, so the axes must be Auto).
  """
  if mesh is None:
    return ()
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
  axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis or ())
  if not axes or not all(isinstance(a, str) for a in axes):
    raise TypeError(f"data_axis must be a str or a tuple of str; got {data_axis!r}")
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"mesh has axes {tuple(mesh.axis_names)} but no data axis "
                     f"{missing[0]!r}; pass data_axis= one of them")
  explicit = [name for name, kind in zip(mesh.axis_names,
                                         getattr(mesh, "axis_types", None) or ())
              if "explicit" in str(kind).lower()]
  if explicit:
    raise ValueError(
        f"mesh axes {explicit} are Explicit (what jax.make_mesh makes without "
        "axis_types); "
        "mpscale lays arrays out with GSPMD and needs Auto axes: build the "
        "mesh with jax.sharding.Mesh(devices, names) or jax.make_mesh(shape, names, "
        "axis_types=(jax.sharding.AxisType.Auto,) * len(names))")
  return axes


def batch_sharding(mesh: Mesh, data_axes: AxisNames) -> NamedSharding:
  """How a global batch lies on ``mesh``: its rows split over ``data_axes``."""
  return NamedSharding(mesh, PartitionSpec(entry_axes(data_axes)))


def check_batch_size(size: int, data_size: int, num_microbatches: int = 1) -> None:
  """The batch rule: ``size`` rows split into ``data_size`` replicas of
  ``num_microbatches`` micro-batches each, so ``data_size x num_microbatches``
  divides ``size``. Checked on arrays by `batch_rows`, on a config's keys by the
  trainer.

  Raises:
    ArgumentError: whose ``names`` are ``("batch_size", "data_size",
      "num_microbatches")`` (rename them with `ArgumentError.renamed`).
  """
  divisor = data_size * num_microbatches
  if size % divisor:
    raise validation.ArgumentError(
        ("batch_size", "data_size", "num_microbatches"),
        f"{{0}} ({size}) is not divisible by {{1}} ({data_size}) x {{2}} "
        f"({num_microbatches}) = {divisor}")


def batch_rows(batch: Any, data_size: int = 1, num_microbatches: int = 1, *,
               pipelined: bool = False) -> int:
  """The batch's number of rows, checked: every leaf's leading dimension is the same
  and divisible by ``data_size x num_microbatches``.

  Args:
    batch: a pytree of arrays (or shapes) with a common leading batch dimension.
    data_size: the number of data-parallel replicas (`axis_size` of `data_axes`).
    num_microbatches: the micro-batches each replica's rows are cut into.
    pipelined: a pipeline cuts every leaf into micro-batches, so it refuses scalar
      leaves even when nothing divides the batch.

  Returns:
    The leading dimension (0 for a batch without arrays).

  Raises:
    ValueError: naming the leaf, for a scalar leaf where the batch is split, a leading
      dimension that does not divide, or leaves that disagree on the batch size.
  """
  divisor = data_size * num_microbatches
  sizes = set()
  for path, x in jax.tree_util.tree_leaves_with_path(batch):
    shape = np.shape(x)
    name = norms_lib.path_str(path) or "batch"
    if not shape:
      if divisor > 1 or pipelined:
        raise ValueError(f"batch leaf {name!r} is a scalar; with data parallelism, "
                         "micro-batches or a pipeline every batch leaf needs a leading "
                         "batch dimension")
      continue
    try:
      check_batch_size(shape[0], data_size, num_microbatches)
    except validation.ArgumentError as e:
      names = {"batch_size": f"the leading dimension of batch leaf {name!r}",
               "data_size": "data-parallel size"}
      raise e.renamed(lambda n: names.get(n, n)) from None
    sizes.add(shape[0])
  if len(sizes) > 1:
    raise ValueError(f"batch leaves disagree on the batch size: {sorted(sizes)}")
  return sizes.pop() if sizes else 0


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
      entries.append(_entry(axes))
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
        raise TypeError(f"param_specs({norms_lib.path_str(path)!r}, leaf) must return "
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


def check_specs(params: Any, specs: Any, mesh: Mesh, what: str = "param_specs"
               ) -> None:
  """Raises ``ValueError`` naming the leaf and the axis of a layout that cannot work.

  Checks every leaf: its spec has at most one entry per dimension, names axes of
  ``mesh`` only, uses each at most once, and each dimension is divisible by the size
  of the axes that split it.
  """
  for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree_util.tree_leaves(specs, is_leaf=is_spec)):
    name = norms_lib.path_str(path) or "params"
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
      if shape[dim] % size:
        raise ValueError(
            f"{what}: leaf {name!r} dimension {dim} (size {shape[dim]}) is not "
            f"divisible by mesh axis {entry!r} (size {size})")


def shardings(mesh: Mesh, specs: Any) -> Any:
  """``NamedSharding``s on ``mesh`` for a pytree of specs."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=is_spec)


# --------------------------------------------------------------------------- FSDP
def split_largest(spec: PartitionSpec, shape: Sequence[int], axes: AxisNames,
                  size: int) -> PartitionSpec:
  """``spec`` with ``axes`` added on the largest dimension that no axis splits yet and
  that ``size`` divides; ``spec`` unchanged when there is none (or ``size`` is 1)."""
  axes = tuple(a for a in entry_axes(axes) if a not in spec_axes(spec))
  if not axes or size == 1:
    return spec
  entries = pad(spec, len(shape))
  best = None
  for dim, n in enumerate(shape):
    if entries[dim] is None and n >= size and n % size == 0 and (
        best is None or n > shape[best]):
      best = dim
  if best is None:
    return spec
  entries[best] = _entry(axes)
  return make_spec(entries)


def fsdp_specs(params: Any, mesh: Mesh, axis: AxisNames = "fsdp",
               param_specs: SpecsLike = None) -> Any:
  """FSDP (ZeRO-3): every parameter also split over ``axis`` on its largest free
  dimension that the axis size divides (the rest stay as ``param_specs`` has them).

  Args:
    params: the parameters (arrays or shapes).
    mesh: the mesh holding ``axis``.
    axis: the FSDP mesh axis (or axes); the batch is split over it too.
    param_specs: a layout to add FSDP to (tensor or stage splits); any form
      `resolve_specs` accepts.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``params``.
  """
  size = axis_size(mesh, axis)
  base = resolve_specs(param_specs, params)
  return jax.tree_util.tree_map(
      lambda spec, leaf: split_largest(spec, np.shape(leaf), axis, size),
      base, params, is_leaf=is_spec)


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


def state_specs(state: Any, params: Any, param_specs: Any) -> Any:
  """Specs for an optimizer state that follow its parameters' specs.

  Every subtree of ``state`` with the tree structure of ``params`` (Adam's moments,
  CAME's statistics) is laid out leaf by leaf after the matching parameter: the same
  spec for the same shape, the spec without the averaged dimension for a factored
  statistic (the dimension its state declares, see `averaged_dims`), replicated
  otherwise; leaves outside such subtrees are replicated.
  """
  params_def = jax.tree_util.tree_structure(params)
  param_leaves = jax.tree_util.tree_leaves(params)
  spec_leaves = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)

  def like(x):
    return (not _is_array_like(x) and x is not None
            and jax.tree_util.tree_structure(x) == params_def)

  def lay_out(tree, averaged=None):
    def one(sub):
      if like(sub):
        return params_def.unflatten([
            _follow(spec, np.shape(p), np.shape(x), averaged)
            for p, spec, x in zip(param_leaves, spec_leaves,
                                  jax.tree_util.tree_leaves(sub))])
      declared = averaged_dims(sub)
      if declared is not None:
        return sub._replace(**{f: lay_out(getattr(sub, f), declared.get(f))
                               for f in sub._fields})
      return PartitionSpec()
    return jax.tree_util.tree_map(
        one, tree, is_leaf=lambda x: (like(x) or _is_array_like(x)
                                      or averaged_dims(x) is not None))

  return lay_out(state)


def _is_array_like(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def zero1_specs(state: Any, specs: Any, mesh: Mesh, data_axes: AxisNames) -> Any:
  """ZeRO-1 on top of ``specs``: each state leaf also split over the data axes its spec
  does not use yet, on its largest free dimension they divide."""
  def add(spec, leaf):
    free = tuple(a for a in entry_axes(data_axes) if a not in spec_axes(spec))
    return split_largest(spec, np.shape(leaf), free, axis_size(mesh, free))
  return jax.tree_util.tree_map(add, specs, state, is_leaf=is_spec)


# --------------------------------------------------------------------------- activations
def _manual_axes() -> tuple[frozenset, Any]:
  """The manual axes of the enclosing ``shard_map`` (empty outside one) and the
  abstract mesh that names them."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  abstract = get() if get is not None else None
  if abstract is None or getattr(abstract, "empty", True):
    return frozenset(), None
  return frozenset(getattr(abstract, "manual_axes", ())), abstract


def only_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
  """``spec`` cut to the mesh ``axes`` (a ``shard_map``'s manual axes): each entry
  keeps the axes in ``axes``, ``None`` where none is left."""
  return PartitionSpec(*(_entry([a for a in entry_axes(e) if a in axes])
                         for e in spec))


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
  """``spec`` without the mesh ``axes``: the layout of a leaf gathered over them."""
  return make_spec([_entry([a for a in entry_axes(e) if a not in axes]) for e in spec])


def constrain(x: jax.Array, spec: PartitionSpec, mesh: Optional[Mesh]) -> jax.Array:
  """``lax.with_sharding_constraint(x, spec)`` on ``mesh``; ``x`` itself without one.

  Works under ``jit`` and inside a ``shard_map`` that is manual over some axes: there
  the manual axes are dropped from ``spec`` (each device already holds its own part
  along them). Use ``PartitionSpec.UNCONSTRAINED`` for dimensions whose layout GSPMD
  should choose.
  """
  if mesh is None:
    return x
  manual, abstract = _manual_axes()
  target: Any = mesh
  if manual:
    spec = PartitionSpec(*(
        e if e is _UNCONSTRAINED
        else _entry([a for a in entry_axes(e) if a not in manual]) for e in spec))
    if hasattr(jax.typeof(x), "manual_axis_type"):  # jax >= 0.9 wants the abstract mesh
      target = abstract
  return lax.with_sharding_constraint(x, NamedSharding(target, spec))


# ------------------------------------------------------------------ inside shard_map
def varying_axes(x: Any) -> frozenset:
  """The mesh axes ``x`` varies over inside ``shard_map`` (its "vma" type)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):  # jax >= 0.9
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))


def _mark_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  if hasattr(lax, "pcast"):  # jax >= 0.8
    return lax.pcast(x, axes, to="varying")
  return lax.pvary(x, axes)  # jax 0.7: pvary is the cast it has


def cast_varying(tree: Any, axes: Sequence[str]) -> Any:
  """Marks every leaf device-varying over ``axes`` (no data moves): what autodiff
  then differentiates gets no ``psum`` of its own, and a loop carry keeps its type."""
  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return _mark_varying(x, missing) if missing else x
  return jax.tree_util.tree_map(cast, tree)


def replica_index(axes: Sequence[str]) -> jax.Array:
  """Inside ``shard_map``: this device's data replica over ``axes``, row-major (the
  order of the batch's row blocks)."""
  replica = jnp.zeros((), jnp.int32)
  for axis in axes:
    replica = replica * lax.axis_size(axis) + lax.axis_index(axis)
  return replica


def split_dims(spec: PartitionSpec, axes: Sequence[str]
              ) -> list[tuple[int, tuple[str, ...]]]:
  """``(dim, axes splitting it)`` for each dimension ``spec`` splits over ``axes``."""
  found = []
  for dim, entry in enumerate(spec):
    over = tuple(a for a in entry_axes(entry) if a in axes)
    if over:
      found.append((dim, over))
  return found


def gather_cast(x: jax.Array, dtype: Any, dims: Sequence[tuple[int, tuple[str, ...]]]
               ) -> jax.Array:
  """Inside ``shard_map``: ``x`` (a master shard) cast to ``dtype`` and all-gathered
  along ``dims`` (`split_dims`' ``(dim, axes)`` pairs). The gather moves the compute
  dtype; the gradient comes back reduce-scattered in ``x``'s own dtype (float32
  masters: float32 sums over the replicas, PyTorch FSDP's ``reduce_dtype``)."""
  return _gather_cast(x, jnp.dtype(dtype), tuple(dims), jnp.dtype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_cast(x, dtype, dims, master):
  del master
  y = x.astype(dtype)
  for dim, over in dims:
    y = lax.all_gather(y, over, axis=dim, tiled=True)
  return y


def _gather_cast_fwd(x, dtype, dims, master):
  return _gather_cast(x, dtype, dims, master), None


def _gather_cast_bwd(dtype, dims, master, _, ct):
  del dtype
  return (scatter_dims(ct.astype(master), dims),)


def scatter_dims(g: jax.Array, dims: Sequence[tuple[int, tuple[str, ...]]]
                ) -> jax.Array:
  """Inside ``shard_map``: ``g`` summed over the axes of ``dims`` (`split_dims`'
  pairs), keeping this device's slice along each dim: the reduce-scatter that
  undoes `gather_cast`'s gather."""
  for dim, over in reversed(dims):
    g = lax.psum_scatter(g, over, scatter_dimension=dim, tiled=True)
  return g


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)


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
    if not _is_array_like(leaf):
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
