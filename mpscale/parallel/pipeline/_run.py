"""What every pipeline schedule shares inside the ``shard_map``: one device's run.

`PipelineRun` holds the schedule's sizes and this device's inputs (its micro-batches,
the loss scale, the keys, the layers' state copies, the FSDP shards) and the small
steps every executor takes: the stage index, casts to device-varying, a micro-batch,
its keys, the embedding's output shape, the head's loss terms. The helpers around it
say what a layer keeps for its backward (`recompute_policy`, `gathers_recomputed`),
which of a stage's layers are recomputed (`scan_layers`) and where a pipeline's layers and keys lie (`interleave_order`, `layer_keys`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
import numpy as np

from mpscale import keys as keys_lib
from mpscale import validation
from mpscale.parallel import _fsdp as fsdp_lib
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib


SAVED_NAMES = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj", "qkv_proj"),
    "save_out_proj": ("out_proj",),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "qkv_proj",
                            "out_proj"),
}
"""The named policies (MaxText's ``remat_policy`` names): each keeps the outputs a
layer names with ``jax.ad_checkpoint.checkpoint_name`` as one of these (the attention's
query, key and value projections, fused or not, and its output projection; the
trainer's built-in model names its products so, and its MLP's ``mlpwi`` and
``mlpwo``), and recomputes the rest. A layer that names none of them keeps its input
alone, as ``full``. MaxText's ``minimal`` is ``selective``."""


OFFLOADED = ("qkv_proj_offloaded", "minimal_offloaded")
"""The offloading policies (MaxText's names): the forward copies what they save to
host memory (``pinned_host``) and the backward copies it back, so the device keeps
only each layer's input, as ``full``, without recomputing the products:
``qkv_proj_offloaded`` the attention's query, key and value projections (named as in
`SAVED_NAMES`), ``minimal_offloaded`` every output ``selective`` keeps."""


RECOMPUTE = ("none", "selective", "full") + tuple(SAVED_NAMES) + OFFLOADED
"""Recomputation policies: ``none`` keeps every residual of the forward for the
backward; ``selective`` keeps the outputs of matrix products without batch dimensions
(the linear layers) and recomputes the rest, attention's core included (Megatron-LM's
selective recomputation, MaxText's ``minimal``); ``full`` keeps each layer's input and
recomputes the layer; the `SAVED_NAMES` keep the named products' outputs; the
`OFFLOADED` ones keep them in host memory."""


BUBBLE_FILL = 0.0
"""What the activation buffers hold before any stage wrote them: what a bubble tick
would compute on. Tests set it to NaN to show that nothing from a bubble reaches a
gradient."""


def recompute_policy(recompute: Any, remat: bool = False) -> Optional[Callable]:
  """The ``jax.checkpoint`` policy of a `RECOMPUTE` name (``None`` for ``"none"``), or
  ``recompute`` itself when it is a policy (a ``jax.checkpoint_policies`` callable).
  ``remat=True`` (the older flag of `Pipeline` and the trainer's model) is
  ``"full"``, beside ``recompute`` ``"none"`` or ``"full"`` only.

  Raises:
    ArgumentError: naming ``recompute`` for an unknown name, or ``remat`` and
      ``recompute`` for another beside ``remat=True``.
  """
  if not callable(recompute):
    validation.one_of("recompute", recompute, RECOMPUTE)
  if remat and (callable(recompute) or recompute not in ("none", "full")):
    raise validation.ArgumentError(
        ("remat", "recompute"), "{0}=True is {1}='full'; got "
        f"{{1}}={recompute!r}: set one of them")
  if remat:
    recompute = "full"
  if callable(recompute):
    return recompute
  if recompute in SAVED_NAMES:
    return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[recompute])
  if recompute == "qkv_proj_offloaded":
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(SAVED_NAMES["save_qkv_proj"]),
        offload_src="device", offload_dst="pinned_host")
  if recompute == "minimal_offloaded":
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host")
  return {"none": None,
          "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "full": jax.checkpoint_policies.nothing_saveable}[recompute]


def check_recompute_layers(recompute_layers: Any, policy: Optional[Callable],
                           layers: Optional[int] = None) -> None:
  """Checks ``recompute_layers``, how many of a stage's layers run under the
  recompute ``policy`` (``None``: all of them): an int from 0 to ``layers`` (a
  stage's layers, where known), and only beside a policy.

  Raises:
    ArgumentError: naming ``recompute_layers`` (and ``recompute`` when there is no
      policy to run the layers under).
  """
  if recompute_layers is None:
    return
  validation.integer("recompute_layers", recompute_layers, 0)
  if policy is None:
    raise validation.ArgumentError(
        ("recompute_layers", "recompute"), "{0} chooses how many layers of each "
        "stage run under {1}, and {1}='none' recomputes nothing: set {1} (e.g. "
        f"'full') or leave {{0}} unset; got {{0}}={recompute_layers}")
  if layers is not None and recompute_layers > layers:
    raise validation.fail("recompute_layers", f"={recompute_layers}: there are "
                          f"{layers} layers to recompute (a stage's, in a pipeline)")


def scan_layers(layer_of: Callable[[bool], Callable], x: Any, xs: Any,
                recompute_layers: Optional[int] = None, **kwargs: Any) -> Any:
  """``lax.scan(layer_of(True), x, xs)`` over stacked layers (``xs``' leading axis),
  the first ``recompute_layers`` of them recomputed (``layer_of(True)``, the scan
  body under the recompute policy) and the rest not (``layer_of(False)``): two scans,
  their outputs concatenated (Megatron-LM's ``recompute_num_layers``, its ``block``
  method). ``None``: every layer recomputed, one scan. ``kwargs`` go to each
  ``lax.scan``. Returns the scan's ``(carry, outputs)``."""
  n = jax.tree_util.tree_leaves(xs)[0].shape[0]
  k = n if recompute_layers is None else min(recompute_layers, n)
  if k in (0, n):
    return lax.scan(layer_of(k == n), x, xs, **kwargs)
  ys = []
  for start, stop, recomputed in ((0, k, True), (k, n, False)):
    part = jax.tree_util.tree_map(lambda a: a[start:stop], xs)  # pylint: disable=cell-var-from-loop
    x, y = lax.scan(layer_of(recomputed), x, part, **kwargs)
    ys.append(y)
  return x, jax.tree_util.tree_map(lambda *y: jnp.concatenate(y), *ys)


# --------------------------------------------------------------------------- pipeline
def sum_invariant(tree: Any, axes: Sequence[str], varying: Any) -> Any:
  """psums each leaf over the ``axes`` along which the matching input was invariant."""
  def reduce(g, like):
    over = tuple(a for a in axes if a not in mesh_lib.varying_axes(like))
    return lax.psum(g, over) if over else g
  return jax.tree_util.tree_map(reduce, tree, varying)


def replica_keys(keys: tuple[jax.Array, jax.Array], data_axes: Sequence[str],
                  num_replicas: int) -> tuple[jax.Array, jax.Array]:
  """Inside ``shard_map``: each micro-batch key folded with this device's data
  replica index (when there are several replicas)."""
  micro_keys, layer_ids = keys
  if num_replicas > 1:
    replica = mesh_lib.replica_index(data_axes)
    micro_keys = jax.random.key_data(jax.vmap(
        lambda k: keys_lib.replica_key(k, replica))(micro_keys))
  return micro_keys, layer_ids


def interleave_order(num_layers: int, S: int, v: int) -> Optional[np.ndarray]:
  """Layer order that puts virtual stage ``c S + s`` (chunk ``c`` of device ``s``) in
  device ``s``'s contiguous block; ``None`` without virtual stages."""
  if v == 1:
    return None
  per_chunk = num_layers // (S * v)
  return np.asarray([(c * S + s) * per_chunk + k for s in range(S) for c in range(v)
                     for k in range(per_chunk)])


def gathers_recomputed(policy: Optional[Callable]) -> Callable:
  """``policy`` (``None``: keep the outputs of matrix products) that never keeps a
  weight gathered over the data axes (`StageFSDP`): the backward gathers it again, as
  PyTorch FSDP's ``reshard_after_forward`` does, rather than autodiff's loops keeping
  every layer's gathered weights for every tick."""
  base = policy or jax.checkpoint_policies.dots_saveable

  def saveable(prim, *args, **params):
    if prim.name == "all_gather" or _is_gather_cast(prim, params):
      return False
    return base(prim, *args, **params)
  return saveable


def _is_gather_cast(prim: Any, params: dict) -> bool:
  """Whether an equation is a custom-derivative gather (`sharding.gather_cast`)."""
  if not prim.name.startswith("custom_vjp"):
    return False
  body = params.get("call_jaxpr", params.get("fun_jaxpr"))
  jaxpr = getattr(body, "jaxpr", body)
  return any(e.primitive.name == "all_gather" for e in getattr(jaxpr, "eqns", ()))


def runs_a_step(count: int) -> Any:
  """A name scope for a conditional whose costly branch runs ``count`` times a step
  on a device though every tick reaches it: a pipeline's head, which the last stage
  runs once a micro-batch. The planner's HLO reader (`mpscale.trainer.planning.hlo`)
  counts its branch so, where it would count the costliest branch every tick."""
  return jax.named_scope(f"mpscale_runs_{count}_a_step")


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """One pipelined gradient's settings, resolved once from `Pipeline.value_and_grad`'s
  arguments: what every device runs, whatever its inputs."""
  mesh: Mesh
  data_axes: tuple[str, ...]
  """The data-parallel axes (manual in the ``shard_map``, with the stage axis)."""
  stage_axis: str
  per_token_loss: bool
  cast: Callable[[Any], Any]
  """The precision policy's cast of the masters to the compute dtype."""
  param_specs: Any
  """Like the params: each leaf's spec over the manual axes (the ``shard_map``'s)."""
  num_layers: int
  num_microbatches: int
  interleave: Optional[np.ndarray]
  """Model index of each device-order layer with virtual stages, else ``None``."""
  cast_each_tick: bool = False
  """GPipe casts the masters in every tick (``grad_reduce_dtype=float32``), not once:
  its micro-batches' gradients then add up in float32."""

  @property
  def axes(self) -> tuple[str, ...]:
    """The manual axes (data, stage) every loop value varies over."""
    return self.data_axes + (self.stage_axis,)

  @property
  def S(self) -> int:  # pylint: disable=invalid-name
    """The stages."""
    return self.mesh.shape[self.stage_axis]

  @property
  def M(self) -> int:  # pylint: disable=invalid-name
    """The micro-batches of each data replica."""
    return self.num_microbatches

  @property
  def D(self) -> int:  # pylint: disable=invalid-name
    """The data replicas."""
    return layouts_lib.axis_size(self.mesh, self.data_axes)


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineRun:
  """What the executors share for one pipelined gradient, inside ``shard_map``: the
  run's settings (`RunSpec`) and this device's inputs. The 1F1B steps are its
  methods."""
  pipeline: Any
  """The `Pipeline` (or `SplitPipeline`) being run."""
  spec: RunSpec
  micro: Any
  """This device's batch rows as ``M`` micro-batches (stacked on a leading axis)."""
  scale: jax.Array
  """The loss scale."""
  keys: Any = None
  """``(raw micro-batch keys, ids of this device's layers)``, or ``None``."""
  fsdp: Optional[fsdp_lib.StageFSDP] = None
  """The parameters split over the data axes, gathered where used; ``None``: none."""
  states: Any = None
  """This device's copies of the layers' state: ``[its layers, M, ...]``, a copy per
  micro-batch (`Pipeline.value_and_grad`'s ``model_state``); ``None``: none."""

  # ---- the run's settings, as the executors read them
  S = property(lambda self: self.spec.S)
  M = property(lambda self: self.spec.M)
  per_token_loss = property(lambda self: self.spec.per_token_loss)
  cast = property(lambda self: self.spec.cast)
  axes = property(lambda self: self.spec.axes)
  num_layers = property(lambda self: self.spec.num_layers)
  cast_each_tick = property(lambda self: self.spec.cast_each_tick)

  # ---- parameters: cast, and under FSDP gathered where used
  def params(self, params: Any) -> Any:
    """The parameters for the loop: cast to the compute dtype, FSDP's split leaves
    left as master shards (`gather_layer`, `gather_rest`)."""
    if self.fsdp is None:
      return self.cast(params)
    return self.fsdp.compute(params, self.cast)

  def gather_layer(self, key: str) -> Optional[Callable]:
    """``lp -> lp`` gathered for compute (one layer of stack ``key``); ``None``
    without FSDP."""
    return None if self.fsdp is None else functools.partial(self.fsdp.layer, key)

  def gather_rest(self, p: Any) -> Any:
    """``p`` (from `params`) with its leaves outside the stacks gathered."""
    return p if self.fsdp is None else self.fsdp.rest(p)

  def gathered(self, fn: Callable) -> Callable:
    """``fn(p, ...)`` on `params` that gathers the leaves outside the stacks first;
    under FSDP inside a ``jax.checkpoint`` that gathers them again in the backward
    (autodiff's loop keeps no gathered copy)."""
    if self.fsdp is None:
      return fn
    return jax.checkpoint(lambda p, *args: fn(self.fsdp.rest(p), *args),
                          policy=gathers_recomputed(None))

  # ---- shared by both schedules
  def stage(self) -> jax.Array:
    """This device's stage index ``s``."""
    return lax.axis_index(self.pipeline.stage_axis)

  def vary(self, tree: Any) -> Any:
    return mesh_lib.cast_varying(tree, self.axes)

  def zero(self) -> jax.Array:
    return self.vary(jnp.zeros((), jnp.float32))

  def micro_batch(self, m: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda x: x[m], self.micro)

  def layer_ids(self) -> Any:
    return None if self.keys is None else self.keys[1]

  @staticmethod
  def item_states(states: Any, m: jax.Array, valid: Any = True) -> Any:
    """Micro-batch ``m``'s copy of this device's layer ``states`` (`states`, or what
    stands for them in a differentiation): ``[its layers, ...]``, or ``None``. Where
    not ``valid`` (a bubble) its gradient is cut: only the tick that runs
    micro-batch ``m`` writes that copy's update."""
    if states is None:
      return None
    copy = jax.tree_util.tree_map(
        lambda s: lax.dynamic_index_in_dim(s, m, axis=1, keepdims=False), states)
    return jax.tree_util.tree_map(
        lambda s: jnp.where(valid, s, lax.stop_gradient(s)), copy)

  def micro_keys(self, m: jax.Array, layer_ids: Any = None) -> tuple[Any, Any, Any]:
    """``(embed kwargs, raw layer keys, head kwargs)`` of micro-batch ``m`` on this
    device (its ``layer_ids``; ``None``: no layer's); ``({}, None, {})`` without
    keys."""
    if self.keys is None:
      return {}, None, {}
    if layer_ids is None:
      layer_ids = jnp.zeros((0,), jnp.int32)
    embed, layers, head = layer_keys(self.keys[0][m], layer_ids, self.num_layers)
    return {"rng": embed}, jax.random.key_data(layers), {"rng": head}

  def embed_shape(self, params: Any) -> jax.ShapeDtypeStruct:
    def embed(p, b, k):
      extras = {} if k is None else {"rng": jax.random.wrap_key_data(k)}
      return self.pipeline.embed_fn(self.gather_rest(self.params(p)), b, **extras)
    return jax.eval_shape(embed, params,
                          jax.tree_util.tree_map(lambda x: x[0], self.micro),
                          None if self.keys is None else self.keys[0][0])

  def head_terms(self, params: Any, x: jax.Array, batch: Any, **extras: Any
                ) -> tuple[jax.Array, jax.Array]:
    """``(loss, count)`` from ``head_fn``, both float32 and varying over the manual
    axes (a head may return a constant count, which would otherwise be invariant)."""
    out = self.pipeline.head_fn(params, x, batch, **extras)
    if self.per_token_loss:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError("with per_token_loss, head_fn must return (loss_sum, "
                        f"num_tokens); got {type(out).__name__}")
      loss, count = out
      count = jnp.asarray(count, jnp.float32)
    elif isinstance(out, tuple) or jnp.ndim(out) != 0:
      raise TypeError("head_fn must return a scalar loss (or, with per_token_loss, "
                      "(loss_sum, num_tokens))")
    else:
      loss, count = out, jnp.ones((), jnp.float32)
    return self.vary((jnp.asarray(loss, jnp.float32), count))

  def first(self, chunk: Any) -> jax.Array:
    """Whether this device's chunk ``chunk`` is virtual stage 0 (after the embedding)."""
    return (self.stage() == 0) & (chunk == 0)

  def last(self, chunk: Any) -> jax.Array:
    """Whether this device's chunk ``chunk`` is the last virtual stage (the head's)."""
    return ((self.stage() == self.S - 1)
            & (chunk == self.pipeline.virtual_stages - 1))


def under(policy: Optional[Callable], fn: Callable) -> Callable:
  """``fn`` under a ``jax.checkpoint`` policy (``None``: as it is)."""
  return fn if policy is None else jax.checkpoint(fn, policy=policy)


def varying(run: PipelineRun, fn: Callable) -> Callable:
  """``fn`` with its outputs cast varying over the manual axes: the branches of a
  ``lax.cond`` or ``lax.switch`` must agree on that type, and zeros are invariant."""
  return lambda: run.vary(fn())


def float32(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), tree)


def float32_zeros(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def layer_keys(rng: jax.Array, layers: jax.Array, num_layers: int
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(embed key, keys of layers, head key)`` of one micro-batch's key ``rng``: the
  embedding draws from ``fold_in(rng, 0)``, layer ``l`` from ``fold_in(rng, 1 + l)``
  and the head from ``fold_in(rng, 1 + num_layers)``, on whichever stage they run."""
  rng = keys_lib.typed(rng)
  keys = jax.vmap(lambda l: jax.random.fold_in(rng, 1 + l))(layers)
  return (jax.random.fold_in(rng, 0), keys, jax.random.fold_in(rng, 1 + num_layers))
