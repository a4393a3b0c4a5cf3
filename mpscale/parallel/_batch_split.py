"""Activations kept split over the batch: FSDP as FSDP for any model.

Under FSDP (``mesh.fsdp``, `mpscale.parallel.fsdp_specs`) the batch and the parameters
are split over the same devices. GSPMD then chooses, product by product, whether to
all-gather the weight or the activation. Where a layer's activations are comparable
to its weights (a few sequences a device: the regime FSDP is for) it gathers the
activations and splits the features, so every device multiplies the *global* batch
by a slice of each weight: activation memory grows with the global batch, the
opposite of FSDP.

`keep_batch_split` pins the layout instead, without changing the model's code. It
traces the loss to a jaxpr and evaluates it again, following the batch dimension of
every value computed from the batch (through elementwise ops, reshapes, transposes,
broadcasts, matrix products, gathers, reductions, and into ``scan``, ``checkpoint``
and nested ``jit`` bodies), and constrains each such value to stay split over the
data axes along it (every other dimension left to GSPMD, so tensor parallelism keeps
its own layout). Given the parameters' specs, it also gathers each weight over the
data axes where a matrix product, convolution or lookup uses it (a parameter, a cast
of one, or its slice in a scan over stacked layers), keeping its other axes (a
tensor-parallel split). So GSPMD gathers weights, not activations: a layer at a time,
inside a scan over stacked layers too, and each gradient is reduce-scattered there.
Values whose batch dimension it cannot follow (inside custom derivatives, ``cond``
and ``while`` bodies) are left to GSPMD.

Inside a ``shard_map`` that is manual over the data axes (the step's float32 sums,
``grad_reduce_dtype=float32``) the batch is each device's own already, and
`gather_where_used` does the weights' half by hand: each split leaf stays a master
shard and is cast and all-gathered at each equation that uses it, its gradient
reduce-scattered there in float32.

References:
  Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
  VLDB 2023. https://arxiv.org/abs/2304.11277
  Xu et al., "GSPMD: General and Scalable Parallelization for ML Computation Graphs",
  2021. https://arxiv.org/abs/2105.04663
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from mpscale import _jaxprs as jaxprs
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib

Dim = Optional[int]
"""Where a value's batch dimension is (``None``: it has none that is followed)."""

_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "reduce_xor", "argmax", "argmin", "reduce_precision")
_PRODUCTS = ("dot_general", "conv_general_dilated", "gather")
"""Where a weight is used whole: gathered over the data axes there."""
_SHAPING = ("reshape", "squeeze", "expand_dims")
"""Through which a weight left whole (no other split) is still the weight."""


def _uses_weight(eqn: Any, specs: list) -> bool:
  """Whether ``eqn`` uses a weight where it is gathered, or passes one on."""
  if all(s is None for s in specs):
    return False
  name = eqn.primitive.name
  return (name in _PRODUCTS or name in jaxprs.REMAT or name == "scan"
          or jaxprs.call_body(eqn) is not None)


def keep_batch_split(fn: Callable[..., Any], mesh: Optional[Mesh],
                     axes: Sequence[str], param_specs: Any = None
                    ) -> Callable[..., Any]:
  """``fn(params, batch, **kwargs)`` with every value computed from ``batch`` kept
  split over the mesh ``axes`` along its batch dimension (the module docstring).

  Args:
    fn: a loss (any function of the parameters and a batch of arrays whose leading
      dimension is the batch); ``kwargs`` (a key, a model state) are passed through.
    mesh: the mesh of the step, or ``None`` (``fn`` is returned as it is).
    axes: the data axes the batch is split over (``("data", "fsdp")``); those the
      mesh lacks or has at size 1 are dropped, and with none left ``fn`` is returned.
    param_specs: the parameters' ``PartitionSpec``s (a pytree like them), or
      ``None``: weights are left to GSPMD.

  Returns:
    A function of the same arguments and results as ``fn``, with the same values.
  """
  axes = tuple(a for a in axes
               if mesh is not None and a in mesh.axis_names and mesh.shape[a] > 1)
  if not axes:
    return fn
  split = _Split(mesh, axes)

  def wrapped(params: Any, batch: Any, **kwargs: Any) -> Any:
    leaves, tree = jax.tree_util.tree_flatten((params, batch, kwargs))
    num_params = len(jax.tree_util.tree_leaves(params))
    num_batch = len(jax.tree_util.tree_leaves(batch))

    def flat(*leaves):
      p, b, kw = jax.tree_util.tree_unflatten(tree, leaves)
      return fn(p, b, **kw)

    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    dims = [0 if num_params <= i < num_params + num_batch and jax.numpy.ndim(x) > 0
            else None for i, x in enumerate(leaves)]
    weights = dict(zip(closed.jaxpr.invars, split.weight_specs(params, param_specs)))
    with split.body():
      split.last = _last_use(closed.jaxpr, weights, split.axes)
      outs, _ = split.run(closed.jaxpr, closed.consts, leaves, dims, weights)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return wrapped


@jax.custom_vjp
def _route(value: jax.Array, grad_to: jax.Array) -> jax.Array:
  """``value`` forward; its cotangent goes to ``grad_to`` (zeros to ``value``): a
  prefetched weight (`_Split.product`) whose gradient flows back through the
  barrier over its product's own operands."""
  del grad_to
  return value


_route.defvjp(lambda value, grad_to: (value, None),
              lambda _, ct: (jax.numpy.zeros_like(ct), ct))


class _Split:
  """The evaluation: values, their batch dimensions, the constraints."""

  def __init__(self, mesh: Mesh, axes: tuple[str, ...]):
    self.mesh, self.axes = mesh, axes
    self.size = layouts_lib.axis_size(mesh, axes)
    self.previous: Optional[list] = None
    """The last product's inputs and a token of its gathered weight, in the body
    being evaluated: what the next product's gather waits on (`product`)."""
    self.recomputed = False
    """Whether the body being evaluated is a ``jax.checkpoint``'s (`remat`)."""
    self.last: Any = None
    """The loss's last equation that uses a weight (`_last_use`): a product there
    keeps its gathered weight for its backward, which comes next."""

  @contextlib.contextmanager
  def body(self, recomputed: Optional[bool] = None):
    """A scan or checkpoint body (a trace of its own): its products look ahead
    among themselves only, and none of its values leaves it; ``recomputed``: it is
    a ``jax.checkpoint``'s (``None``: as the body around it)."""
    self.previous, outer = None, self.recomputed
    self.recomputed = outer if recomputed is None else recomputed
    try:
      yield
    finally:
      self.previous, self.recomputed = None, outer

  def pin(self, x: Any, dim: Dim) -> Any:
    """``x`` constrained to the batch split along ``dim`` (when it divides)."""
    if dim is None or x.shape[dim] % self.size:
      return x
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[dim] = self.axes if len(self.axes) > 1 else self.axes[0]
    return mesh_lib.constrain(x, PartitionSpec(*spec), self.mesh)

  def weight_specs(self, params: Any, specs: Any) -> list[Optional[PartitionSpec]]:
    """Each parameter leaf's spec (``None`` without specs)."""
    leaves = jax.tree_util.tree_leaves(params)
    if specs is None:
      return [None] * len(leaves)
    return jax.tree_util.tree_leaves(specs, is_leaf=layouts_lib.is_spec)

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          dims: Sequence[Dim], weights: Optional[dict] = None
         ) -> tuple[list, list[Dim]]:
    """Evaluates ``jaxpr``; ``dims``: the batch dimension of each argument;
    ``weights``: the spec of each argument variable that is a weight.
    Returns the outputs and their batch dimensions."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    where: dict = {v: d for v, d in zip(jaxpr.invars, dims) if d is not None}
    weights = {v: s for v, s in (weights or {}).items() if s is not None}
    for eqn in jaxpr.eqns:
      values = [jaxprs.read(env, v) for v in eqn.invars]
      ins = [jaxprs.lookup(where, v) for v in eqn.invars]
      specs = [jaxprs.lookup(weights, v) for v in eqn.invars]
      if all(d is None for d in ins) and not _uses_weight(eqn, specs):
        outs, out_dims = jaxprs.bind(eqn, values), [None] * len(eqn.outvars)
      else:
        outs, out_dims = self.equation(eqn, values, ins, specs)
        outs = [self.pin(x, d) for x, d in zip(outs, out_dims)]
      env.update(zip(eqn.outvars, outs))
      where.update((v, d) for v, d in zip(eqn.outvars, out_dims) if d is not None)
      _follow_weight(eqn, specs, weights, self.axes)
    out_dims = [jaxprs.lookup(where, v) for v in jaxpr.outvars]
    return [jaxprs.read(env, v) for v in jaxpr.outvars], out_dims

  def equation(self, eqn: Any, values: list, dims: list[Dim], specs: list
              ) -> tuple[list, list]:
    name = eqn.primitive.name
    body = jaxprs.call_body(eqn)
    if body is not None:
      inner = dict(zip(body[0].invars, specs))
      return self.run(body[0], body[1], values, dims, inner)
    if name == "scan":
      return self.scan(eqn, values, dims, specs)
    if name in jaxprs.REMAT:
      return self.remat(eqn, values, dims, specs)
    out_dims = (_out_dims(eqn, dims) if any(d is not None for d in dims)
                else [None] * len(eqn.outvars))
    if name in _PRODUCTS:
      values = [self.pin(x, d) for x, d in zip(values, dims)]
      if any(s is not None for s in specs):
        used = [None if s is None else layouts_lib.without_axes(s, self.axes)
                for s in specs]
        if name == "gather" and specs[0] is not None:
          used[0] = _looked_up(eqn, specs[0], self.axes, self.mesh)
        return self.product(eqn, values, used), out_dims
    return jaxprs.bind(eqn, values), out_dims

  def product(self, eqn: Any, values: list, specs: list) -> list:
    """A product with its weights gathered over the data axes, under
    ``jax.checkpoint``: the backward gathers them again rather than keeping every
    layer's gathered weights from the forward (PyTorch FSDP's default,
    ``reshard_after_forward``). Inside a recomputed body (the user's or the
    model's ``jax.checkpoint`` of a layer) the product is not checkpointed again:
    the backward's recompute of the layer gathers the weight once more, and its
    products' backward uses that gather; a checkpoint of the product would gather
    it a third time. Nor is the loss's last product (`_last_use`: a head), whose
    backward follows at once.

    Optimization barriers place the gathers. In the forward a weight is gathered
    once the *previous* product's input is there (and a one-element token of the
    previous gathered weight, so that XLA's all-gather combiner does not merge the
    two gathers into one that waits for the later input): one product of prefetch,
    its gather overlapping the previous product, and never every layer's gather at
    the start of the step. The barrier over the product's own operands stays for
    the backward, the weight's cotangent routed through it (`_route`), so the
    backward gathers each weight again at its product and reduce-scatters its
    gradient there, one layer at a time."""
    inputs = [x for x, s in zip(values, specs) if s is None]
    tie = [lax.stop_gradient(t) for t in (self.previous or inputs)]
    weights = [i for i, s in enumerate(specs) if s is not None]
    n = len(values)

    def gathered(*args):
      values, tie = list(args[:n]), args[n:]
      own = list(lax.optimization_barrier(values))
      _, early = lax.optimization_barrier(
          (tie, [lax.stop_gradient(values[i]) for i in weights]))
      for i, x in zip(weights, early):
        own[i] = mesh_lib.constrain(_route(x, own[i]), specs[i], self.mesh)
      first = own[weights[0]]
      token = lax.slice(first, (0,) * first.ndim, (1,) * first.ndim)
      return [*jaxprs.bind(eqn, own), token]

    run = (gathered if self.recomputed or eqn is self.last
           else jax.checkpoint(gathered))
    *outs, token = run(*values, *tie)
    self.previous = inputs + [token]
    return outs

  def scan(self, eqn: Any, values: list, dims: list[Dim], specs: list
          ) -> tuple[list, list]:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = values[:nc], values[nc:nc + nk], values[nc + nk:]
    carry_dims = dims[nc:nc + nk]
    # A scan over the batch itself slices it away; otherwise each slice keeps it.
    x_dims = [None if d in (None, 0) else d - 1 for d in dims[nc + nk:]]
    # A stacked weight's slice is a layer's weight: its spec without the layers.
    x_specs = [None if s is None else PartitionSpec(*s[1:])
               for s in specs[nc + nk:]]
    body, seen = p["jaxpr"], {}
    inner = dict(zip(body.jaxpr.invars, [*specs[:nc], *([None] * nk), *x_specs]))

    def step(carry, x):
      with self.body():
        outs, out_dims = self.run(body.jaxpr, body.consts, [*consts, *carry, *x],
                                  [*dims[:nc], *carry_dims, *x_dims], inner)
      seen["dims"] = out_dims
      return outs[:nk], outs[nk:]

    carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    out_dims = seen["dims"]
    carry_out = [d if d == e else None for d, e in zip(carry_dims, out_dims[:nk])]
    return [*carry, *ys], carry_out + [None if d is None else d + 1
                                       for d in out_dims[nk:]]

  def remat(self, eqn: Any, values: list, dims: list[Dim], specs: list
           ) -> tuple[list, list]:
    p, seen = eqn.params, {}
    inner = dict(zip(p["jaxpr"].invars, specs))

    def body(*args):
      with self.body(recomputed=True):
        outs, seen["dims"] = self.run(p["jaxpr"], (), args, dims, inner)
      return outs

    outs = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                          policy=p.get("policy"))(*values)
    return list(outs), seen["dims"]


def _last_use(jaxpr: Any, weights: dict, axes: tuple[str, ...]) -> Any:
  """The last equation of ``jaxpr`` that uses one of the ``weights`` (their specs
  by variable, followed through casts as `_Split.run` does), or ``None``.

  Nothing after it uses a weight, so its backward is the first to: a product there
  (a language model's head) keeps its gathered weight rather than gathering it again
  a moment later, which costs no memory the backward would not hold anyway."""
  weights = {v: s for v, s in weights.items() if s is not None}
  last = None
  for eqn in jaxpr.eqns:
    specs = [jaxprs.lookup(weights, v) for v in eqn.invars]
    if _uses_weight(eqn, specs):
      last = eqn
    _follow_weight(eqn, specs, weights, axes)
  return last


def _follow_weight(eqn: Any, specs: list, weights: dict, axes: tuple[str, ...]
                  ) -> None:
  """Adds ``eqn``'s output to ``weights`` when it is still its first operand's
  weight (`_weight_through`); ``specs``: its operands' specs."""
  if specs and specs[0] is not None:
    moved = _weight_through(eqn, specs[0], axes)
    if moved is not None:
      weights[eqn.outvars[0]] = moved


def _weight_through(eqn: Any, spec: PartitionSpec, axes: tuple[str, ...]
                   ) -> Optional[PartitionSpec]:
  """The spec of a weight after a one-operand equation that keeps it a weight (a
  cast; a transpose, as Hugging Face's ``Conv1D`` applies to its kernel; a reshape
  or the like of a weight split over the data ``axes`` alone: it is then used
  gathered), ``None`` for any other."""
  name = eqn.primitive.name
  if name in jaxprs.CASTS:
    return spec
  entries = layouts_lib.pad(spec, eqn.invars[0].aval.ndim)
  if name == "transpose":
    return layouts_lib.make_spec([entries[d] for d in eqn.params["permutation"]])
  if name in _SHAPING and all(e is None for e in layouts_lib.pad(
      layouts_lib.without_axes(spec, axes), len(entries))):
    return PartitionSpec()
  return None


def _looked_up(eqn: Any, spec: PartitionSpec, axes: tuple[str, ...], mesh: Mesh
               ) -> PartitionSpec:
  """The layout a weight split by ``spec`` is looked up in (a ``gather`` from a
  table: an embedding): gathered over the data ``axes``, except those it is split
  over, which are kept on the largest dimension the lookup takes whole (the model
  width) when they divide it.

  Every device then looks up the whole batch's rows in its slice of the width, and
  GSPMD exchanges the looked-up rows for the batch's split with one all-to-all (the
  gradient's with another), where gathering the table would move and hold all of
  it, forward and backward. A table split over its rows is first resplit over its
  width: one all-to-all of the table's shards."""
  numbers, shape = eqn.params["dimension_numbers"], eqn.invars[0].aval.shape
  split = [a for a in axes if a in layouts_lib.spec_axes(spec)]
  entries = layouts_lib.pad(layouts_lib.without_axes(spec, axes), len(shape))
  if not split:
    return layouts_lib.make_spec(entries)
  size = layouts_lib.axis_size(mesh, tuple(split))
  sliced = (set(numbers.collapsed_slice_dims) | set(numbers.start_index_map)
            | set(getattr(numbers, "operand_batching_dims", ())))
  whole = [d for d in range(len(shape)) if d not in sliced and entries[d] is None
           and eqn.params["slice_sizes"][d] == shape[d] and shape[d] % size == 0]
  if whole:
    entries[max(whole, key=lambda d: shape[d])] = (
        tuple(split) if len(split) > 1 else split[0])
  return layouts_lib.make_spec(entries)


def _out_dims(eqn: Any, dims: list[Dim]) -> list[Dim]:
  """The batch dimension of each output of ``eqn``, from its operands' ``dims``."""
  name = eqn.primitive.name
  shapes = [v.aval.shape for v in eqn.invars]
  i = next(k for k, d in enumerate(dims) if d is not None)
  d, shape = dims[i], shapes[i]
  p = eqn.params
  if name == "broadcast_in_dim":
    return [p["broadcast_dimensions"][d] if i == 0 else None]
  if name == "transpose":
    return [list(p["permutation"]).index(d)]
  if name == "reshape":
    return [_reshaped(shape, eqn.outvars[0].aval.shape, d)]
  if name == "squeeze":
    gone = [x % len(shape) for x in p["dimensions"]]
    return [None if d in gone else d - sum(x < d for x in gone)]
  if name in _REDUCTIONS and "axes" in p:
    return [None if d in p["axes"] else d - sum(x < d for x in p["axes"])]
  if name == "dot_general":
    return [_dot(p["dimension_numbers"], dims, shapes)]
  if name == "gather" and dims[1] is not None:
    return [_gathered(p["dimension_numbers"], dims[1], shapes[1],
                      eqn.outvars[0].aval.ndim)]
  return [_same(shape, d, v.aval.shape) for v in eqn.outvars]


def _same(shape: tuple, d: int, out: tuple) -> Dim:
  """An output keeps the batch dimension where the operand's shape carries over:
  elementwise ops, slices that leave it whole, updates, casts."""
  if len(out) == len(shape) and out[d] == shape[d]:
    return d
  if d == 0 and out and out[0] == shape[0]:
    return 0
  return None


def _reshaped(shape: tuple, out: tuple, d: int) -> Dim:
  """A reshape keeps the batch dimension where the dimensions before it are kept and
  it is merged with those after it (``[B, T, D] -> [B T, D]``), so each device's
  rows stay its own."""
  before = math.prod(shape[:d])
  for j in range(len(out)):
    if math.prod(out[:j]) == before and out[j] % shape[d] == 0:
      return j
  return None


def _dot(numbers: Any, dims: list[Dim], shapes: list[tuple]) -> Dim:
  """The output position of an operand's batch dimension in a ``dot_general``:
  batch dimensions first, then the left operand's free ones, then the right's."""
  (contract_l, contract_r), (batch_l, batch_r) = numbers
  free = [[x for x in range(len(shapes[k])) if x not in (contract_l, contract_r)[k]
           and x not in (batch_l, batch_r)[k]] for k in (0, 1)]
  for k in (0, 1):
    d = dims[k]
    if d is None:
      continue
    batch, contract = (batch_l, batch_r)[k], (contract_l, contract_r)[k]
    if d in batch:
      return list(batch).index(d)
    if d in contract:
      return None
    return len(batch) + (len(free[0]) if k else 0) + free[k].index(d)
  return None


def _gathered(numbers: Any, d: int, shape: tuple, out_ndim: int) -> Dim:
  """A gather's output batch dimension from its indices' (an embedding lookup):
  the output's dimensions that are not offsets follow the indices' in order (the
  last indices dimension holds the index vector)."""
  if d == len(shape) - 1:
    return None
  rest = [x for x in range(out_ndim) if x not in numbers.offset_dims]
  return rest[d] if d < len(rest) else None


