"""The mesh's data axes, the batch on them, and values inside ``shard_map``.

The batch's leading dimension is split over the data axes (``data``, and ``fsdp``
under FSDP): `data_axes` checks them on the mesh, `batch_sharding` lays the batch
out, and `batch_rows` checks that its rows divide into the replicas' micro-batches
(`check_batch_size`, the same rule on a config's numbers).

Inside a ``shard_map`` that is manual over some axes (the pipeline's stage and data
axes, the step's float32 sums over the data axes): `constrain` sets a layout over the
automatic axes only, `cast_varying` marks values device-varying so that autodiff puts
no ``psum`` of its own in a loop, and `replica_index` is this device's data replica.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
import numpy as np

from mpscale import _jaxprs
from mpscale import _tree
from mpscale import validation
from mpscale.parallel._layouts import AxisNames, entry_axes, spec_entry


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
    name = _tree.path_str(path) or "batch"
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


# --------------------------------------------------------------------------- activations
def manual_axes() -> tuple[frozenset, Any]:
  """The manual axes of the enclosing ``shard_map`` (empty outside one) and the
  abstract mesh that names them."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  abstract = get() if get is not None else None
  if abstract is None or getattr(abstract, "empty", True):
    return frozenset(), None
  return frozenset(getattr(abstract, "manual_axes", ())), abstract


def constrain(x: jax.Array, spec: PartitionSpec, mesh: Optional[Mesh]) -> jax.Array:
  """``lax.with_sharding_constraint(x, spec)`` on ``mesh``; ``x`` itself without one.

  Works under ``jit`` and inside a ``shard_map`` that is manual over some axes: there
  the manual axes are dropped from ``spec`` (each device already holds its own part
  along them). Use ``PartitionSpec.UNCONSTRAINED`` for dimensions whose layout GSPMD
  should choose.
  """
  if mesh is None:
    return x
  manual, abstract = manual_axes()
  target: Any = mesh
  if manual:
    spec = PartitionSpec(*(
        e if e is PartitionSpec.UNCONSTRAINED
        else spec_entry([a for a in entry_axes(e) if a not in manual]) for e in spec))
    if hasattr(jax.typeof(x), "manual_axis_type"):  # jax >= 0.9 wants the abstract mesh
      target = abstract
  return lax.with_sharding_constraint(x, NamedSharding(target, spec))


# ------------------------------------------------------------------ inside shard_map
varying_axes = _jaxprs.varying_axes
"""The mesh axes a value varies over inside ``shard_map`` (`mpscale._jaxprs`)."""


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
