"""Pipeline parallelism over a ``stage`` mesh axis: GPipe, 1F1B (both interleaved), ZB-H1.

A pipelined model is three functions::

  embed_fn(params, batch) -> x                # runs on the first stage
  stage_fn(layer_params, x) -> x              # ONE layer; a stage scans its layers
  head_fn(params, x, batch) -> loss           # last stage; or (loss_sum, num_tokens)

``params`` is a dict whose ``"stages"`` entry holds every layer's parameters stacked on a
leading axis of size ``num_layers``; the rest (embedding, head) is replicated over the
stages. On a mesh with a ``stage`` axis the stacked layers are split into ``S`` equal
slices over it, the batch is split over the data axes and cut into ``M`` micro-batches,
and activations move between stages with ``ppermute``. The gradients equal the
unpipelined model's.

Layouts inside a stage: ``shard_map`` is manual over the stage and data axes and
automatic over the rest, so a stage's layers keep a ``tensor`` split of their
``param_specs`` and GSPMD inserts its collectives inside the stage. A parameter split
over a data axis (FSDP) stays a master shard: it is cast and all-gathered where it is
used, a layer at a time (each layer on its forward and again on its backward, in
every schedule; the embedding and head around their calls), and its gradient is
reduce-scattered back there in the masters' dtype (`_FSDP`,
`mpscale.sharding.gather_cast`), so a device never holds a whole stage's parameters.

Schedules, per data replica (S stages, M micro-batches, v virtual stages)::

  gpipe: for t in range(v * M + S - 1):       # forward; autodiff runs it backward
           i = t - s                          # stage s's work item, if 0 <= i < v * M
           c = i % (S * v) // S               # its chunk: virtual stage c * S + s
           m = i // (S * v) * S + i % S       # its micro-batch
           x = embed(m) if s == 0 and c == 0 else what stage s - 1 (mod S) sent
           y = layers of chunk c (x); head(y) if s == S - 1 and c == v - 1
           send y to stage s + 1 (mod S)      # one ppermute per tick

  1f1b:  for t, row in enumerate(chunk_table("1f1b", S, M, v)):   # paired ticks
           the dx of tick t - 1 leaves down (it lands after F: F hides it)
           op, m, c = row[s, 0]             # slot 0: F of chunk c of micro-batch m
           F: x = embed(m) if (s, c) == (0, 0) else inbox[k]
              y, kept[k] = chunk c's layers (x), each layer's vjp residuals
              on the last virtual stage: loss, ct[k] = head and its backward
           send y up (B hides it); the dx of tick t - 1 lands in ct
           op, m, c = row[s, 1]             # slot 1: B of another micro-batch
           B: dx, dp = each layer's pullback rebuilt from kept[k], from ct[k] down
              grads += dp (+ the embedding's after virtual stage 0)
           y and dx land in the receivers' slots (item_slots)
         (`mpscale.pipeline_schedules`: the warm-up ticks run F only, the cool-down
         ticks B only, each phase its own scan, so a step costs GPipe's (v M + S - 1)
         (F + B); a stage keeps at most 2 S - 1 micro-batches' residuals, (v + 1) S
         - 1 interleaved, whatever M. ``recompute`` chooses what a layer keeps.)

  zb_h1: one op a tick (F, B or W), from chunk_table("zb_h1", S, M):
           B: dx, dp = the pullbacks with each weight product's weight held fixed
              (`mpscale.backward_split`); cts[k] = those products' output
              cotangents; grads += dp; send dx down
           W: grads += each weight product's transpose, from its input (kept[k])
              and cts[k]
         (Qi et al.'s ZB-H1; one chunk per stage: S - s warm-up forwards, then B,
         F and the W of s micro-batches back; the deferred W's fill 1F1B's
         cool-down.)

The bubble fraction is (S - 1) / (v M + S - 1) for GPipe and 1F1B, and (S - 1) /
(3 M + S - 1) for ZB-H1, each of whose ticks is one of F, B and W: with the three
taken as equal, a 1F1B forward is one of them and its backward two, and the
fractions compare as times (`mpscale.pipeline_schedules.bubble_fraction`).
With ``v > 1`` (Megatron's
interleaved schedule, ``num_layers_per_virtual_pipeline_stage``) device ``s`` holds
chunks ``s, s + S, ...``, virtual stages ``c S + s``, and activations go round the
ring: device ``S - 1``'s chunk ``c`` feeds device 0's chunk ``c + 1``. The layers are
stored in model order, so the step permutes the stacked layers into that order (one
all-to-all of the stage parameters, and of their gradients back) and ``M`` must be a
multiple of ``S``. Bubble ticks never
compute on their garbage: a stage's input on a bubble tick is replaced by zeros before
use (GPipe) or the tick runs no op at all (1F1B), so nothing from a bubble reaches a
gradient. Replicated values are cast to device-varying before the loop, so the only
all-reduces (the gradient sums over the data axes and ``stage``) happen once, after it.

Layers with state (FP8 products' scaling state, whose cotangent is its update):
``value_and_grad(..., model_state=states)`` takes the states stacked as the layers
are, and calls ``stage_fn(layer_params, x, state=its state)``. Each micro-batch of
each data replica gets a copy of the states (``[layers, D M, ...]``, over the stage
and data axes), the tick that runs it reads its copy (GPipe: a bubble tick's read is
cut from autodiff; 1F1B and ZB-H1: ``B`` differentiates the copy with the layer and
adds its update to the copy's slot, where nothing else is added), and after the
loop ``merge_state`` combines each layer's copies into its new state.

The code reads the same way::

  Pipeline.value_and_grad -> shard_map(per_device), manual over data axes and stage
    per_device: params cast varying (FSDP's leaves stay shards: _FSDP); the rows
      cut into M micro-batches; run = _PipelineRun(sizes, this device's inputs)
      loss, count, grads = _gpipe(run, params) or _ticked(run, params)
      grads: summed where invariant (_sum_invariant)
  gpipe: jax.grad of objective, a lax.scan of tick(carry, t) over v * M + S - 1
  1f1b, zb_h1: _ticked(run, params), a lax.scan a phase of the table, carry holding
         inbox, kept, ct (and cts) in K item slots (item_slots) and the gradient sums;
         the ops are _Ticks.forward, .backward and .weights

References:
  Huang et al., "GPipe", NeurIPS 2019. https://arxiv.org/abs/1811.06965
  Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024.
  https://arxiv.org/abs/2401.10241
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (1F1B, interleaved stages), SC 2021.
  https://arxiv.org/abs/2104.04473
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mpscale import backward_split
from mpscale import keys as keys_lib
from mpscale import norms as norms_lib
from mpscale import sharding as sharding_lib
from mpscale import validation
from mpscale.gradients import Gradients, check_grad_reduce_dtype

from mpscale.pipeline_schedules import (BWD, FWD, IDLE, SCHEDULES, WGT,  # noqa: F401
                                       chunk_table, item_slots, live_slots,
                                       bubble_fraction, check_schedule, schedule_chunks,
                                       schedule_table)

LAYER_ORDERS = ("model", "device")
RECOMPUTE = ("none", "selective", "full")
"""Recomputation policies: ``none`` keeps every residual of the forward for the
backward; ``selective`` keeps the outputs of matrix products without batch dimensions
(the linear layers) and recomputes the rest, attention's core included (Megatron-LM's
selective recomputation); ``full`` keeps each layer's input and recomputes the layer."""
_BUBBLE_FILL = 0.0
"""What the activation buffers hold before any stage wrote them: what a bubble tick
would compute on. Tests set it to NaN to show that nothing from a bubble reaches a
gradient."""


def recompute_policy(recompute: Any) -> Optional[Callable]:
  """The ``jax.checkpoint`` policy of a `RECOMPUTE` name (``None`` for ``"none"``), or
  ``recompute`` itself when it is a policy (a ``jax.checkpoint_policies`` callable)."""
  if callable(recompute):
    return recompute
  validation.one_of("recompute", recompute, RECOMPUTE)
  return {"none": None,
          "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "full": jax.checkpoint_policies.nothing_saveable}[recompute]


# --------------------------------------------------------------------------- groups
def stage_groups(num_stages: int, stages_key: str = "stages", *,
                 virtual_stages: int = 1, layer_order: str = "model") -> Callable:
  """Groups with one entry per pipeline stage (mindformers' ``local_norm``).

  The stacked layers under ``stages_key`` are split into ``num_stages x
  virtual_stages`` equal groups, named by the (virtual) stage that runs them:
  ``stage_0 ... stage_{S v - 1}``, ``stage_i`` holding model layers ``[i n, (i + 1)
  n)``; every other top-level key is its own group. With ``layer_order="device"``
  the layers are stored as `Pipeline.to_device_order` puts them, and the names follow
  them there. Pass it as ``groups=`` to a loss-scale wrapper or
  `mpscale.clip_by_global_norm`.
  """
  validation.one_of("layer_order", layer_order, LAYER_ORDERS)
  S, v = num_stages, virtual_stages
  if layer_order == "model":
    names = tuple(f"stage_{i}" for i in range(S * v))
  else:  # position s v + c holds virtual stage c S + s
    names = tuple(f"stage_{(p % v) * S + p // v}" for p in range(S * v))

  def groups(path):
    top = norms_lib.path_str(path[:1]) if path else "params"
    return names if top == stages_key else top

  return groups


# --------------------------------------------------------------------------- pipeline
def _sum_invariant(tree: Any, axes: Sequence[str], varying: Any) -> Any:
  """psums each leaf over the ``axes`` along which the matching input was invariant."""
  def reduce(g, like):
    over = tuple(a for a in axes if a not in sharding_lib.varying_axes(like))
    return lax.psum(g, over) if over else g
  return jax.tree_util.tree_map(reduce, tree, varying)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """A model split into pipeline stages; see the module docstring.

  Attributes:
    embed_fn: ``(params, batch) -> x``, run on the first stage.
    stage_fn: ``(layer_params, x) -> x``, one layer; ``x`` keeps its shape and dtype.
    head_fn: ``(params, x, batch) -> loss`` (a scalar mean), or with per-token loss
      ``(loss_sum, num_tokens)``.
    num_microbatches: micro-batches per data replica and step (``M``).
    schedule: ``"gpipe"``, ``"1f1b"`` or ``"zb_h1"`` (the module docstring).
    remat: ``True`` is ``recompute="full"`` (kept for older code and configs).
    stage_axis: the mesh axis the stages are split over.
    stages_key: the key of ``params`` holding the stacked layers.
    virtual_stages: layer chunks per device (``v``, Megatron's interleaved schedule,
      ``num_layers_per_virtual_pipeline_stage``): device ``s`` runs chunks ``s, s +
      S, ...``, shrinking the bubble to ``(S - 1) / (v M + S - 1)``; ``M`` must be a
      multiple of ``S``. Interleaved GPipe keeps ``v M`` stage inputs alive per device;
      interleaved 1F1B at most ``(v + 1) S - 1`` whatever ``M`` (Megatron's warm-up,
      ``2 (S - 1) + (v - 1) S`` forwards, plus one).
    layer_order: how ``params[stages_key]`` is stored. ``"model"``: layer ``l`` at
      index ``l``; with ``v > 1`` each step then permutes the stacked layers into
      device order and their gradients back (an all-to-all of the stage parameters
      each way). ``"device"``: in the order the devices run them (`to_device_order`;
      device ``s``'s chunks ``s, s + S, ...`` contiguous), so the step moves no
      parameter; `apply` and `to_model_order` give model order back. Needs
      ``num_stages``. The same as ``"model"`` when ``v = 1``.
    num_stages: the stage-axis size ``S`` the device order is for (checked against
      the mesh); ``None`` with ``layer_order="model"``.
    recompute: what the backward recomputes (`RECOMPUTE`): ``"none"`` (keep every
      residual of the forward), ``"selective"`` (keep the linear layers' outputs,
      recompute the rest) or ``"full"`` (keep each layer's input), or a
      ``jax.checkpoint_policies`` policy. Every schedule runs each layer under it;
      1F1B and ZB-H1 keep the residuals of each micro-batch's forward until its
      backward (`pipeline_schedules` bounds how many).
    merge_state: how the updates of a layer state (`value_and_grad`'s
      ``model_state``) from several micro-batches and data replicas combine into
      one: ``merge_state(updates) -> state``, ``updates`` the state's tree with a
      leading axis of updates (FP8 scaling state:
      ``functools.partial(mpscale.fp8.merge_stacked, recipe=recipe)``); ``None``:
      the pipeline takes no model state.
  """
  embed_fn: Callable
  stage_fn: Callable
  head_fn: Callable
  num_microbatches: int
  schedule: str = "gpipe"
  remat: bool = False
  stage_axis: str = "stage"
  stages_key: str = "stages"
  virtual_stages: int = 1
  layer_order: str = "model"
  num_stages: Optional[int] = None
  recompute: Any = "none"
  merge_state: Optional[Callable] = None

  def __post_init__(self):
    for name in ("embed_fn", "stage_fn", "head_fn"):
      validation.function(name, getattr(self, name))
    validation.positive_int("num_microbatches", self.num_microbatches)
    validation.positive_int("virtual_stages", self.virtual_stages)
    validation.one_of("schedule", self.schedule, SCHEDULES)
    validation.boolean("remat", self.remat)
    validation.one_of("layer_order", self.layer_order, LAYER_ORDERS)
    if self.merge_state is not None:
      validation.function("merge_state", self.merge_state)
    recompute_policy(self.recompute)  # a RECOMPUTE name, or a policy
    if self.remat and self.recompute not in ("none", "full"):
      raise validation.ArgumentError(
          ("remat", "recompute"), "{0}=True is {1}='full'; got "
          f"{{1}}={self.recompute!r}: set one of them")
    if self.schedule == "zb_h1" and self.virtual_stages > 1:
      raise validation.ArgumentError(
          ("schedule", "virtual_stages"), "{0}='zb_h1' runs one layer chunk per "
          f"stage: {{1}} must be 1; got {self.virtual_stages}")
    if self.num_stages is not None:
      validation.positive_int("num_stages", self.num_stages)
    if self.layer_order == "device" and self.num_stages is None:
      raise validation.ArgumentError(
          ("layer_order", "num_stages"), "{0}='device' needs {1}: the device order "
          "depends on the number of stages")

  # ---- the order the stacked layers are stored in
  def _device_permutation(self, tree: Any) -> Optional[np.ndarray]:
    """Model index of each device-order position, or ``None`` when they agree."""
    if self.num_stages is None:
      return None
    num_layers = jax.tree_util.tree_leaves(tree[self.stages_key])[0].shape[0]
    return _interleave_order(num_layers, self.num_stages, self.virtual_stages)

  def to_device_order(self, tree: Any) -> Any:
    """``tree`` (params, or a state holding params-shaped trees such as an optimizer
    state or a `mpscale.TrainState`) with every stacked-layer leaf (under a
    ``stages_key`` dict key, leading axis the layers) put in device order:
    position ``(s v + c) n + k`` holds model layer ``(c S + s) n + k`` (``n``
    layers a chunk). Other leaves are left as they are."""
    return self._permute(tree, inverse=False)

  def to_model_order(self, tree: Any) -> Any:
    """The inverse of `to_device_order`."""
    return self._permute(tree, inverse=True)

  def _permute(self, tree: Any, inverse: bool) -> Any:
    if self.num_stages is None or self.virtual_stages == 1:
      return tree
    key = jax.tree_util.DictKey(self.stages_key)
    found = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
             if key in p and np.ndim(x)]
    if not found:
      return tree
    num_layers = np.shape(found[0][1])[0]
    order = _interleave_order(num_layers, self.num_stages, self.virtual_stages)
    if inverse:
      order = np.argsort(order)

    def permute(path, x):
      if key in path and np.ndim(x) and np.shape(x)[0] == num_layers:
        return x[order]
      return x
    return jax.tree_util.tree_map_with_path(permute, tree)

  # ---- the unpipelined model (reference, and the single-stage path)
  def policy(self) -> Optional[Callable]:
    """The ``jax.checkpoint`` policy each layer runs under (``recompute``, or
    ``"full"`` with ``remat``); ``None``: no recomputation."""
    return recompute_policy("full" if self.remat else self.recompute)

  def layer(self, key: Optional[jax.Array] = None, stateful: bool = False
           ) -> Callable:
    """One layer, ``(layer_params, x) -> x``, under `policy`; with ``key`` (raw key
    data) it draws from that key; ``stateful``: ``((layer_params, layer_state), x)
    -> x``, the state passed to ``stage_fn`` as ``state=``."""
    return _under(self.policy(), self.plain_layer(key, stateful))

  def plain_layer(self, key: Optional[jax.Array] = None, stateful: bool = False
                 ) -> Callable:
    """`layer` without the recompute policy."""
    if not stateful:
      return lambda p, h: self._stage(p, h, key)
    return lambda ps, h: self._stage(ps[0], h, key, ps[1])

  def _stage(self, p: Any, h: jax.Array, key: Optional[jax.Array] = None,
             state: Any = None) -> jax.Array:
    """``stage_fn(p, h)``, with ``rng=`` (from raw key data) and ``state=`` where
    given."""
    extras = {}
    if key is not None:
      extras["rng"] = jax.random.wrap_key_data(key)
    if state is not None:
      extras["state"] = state
    return self.stage_fn(p, h, **extras)

  def _layers(self, layer_params: Any, x: jax.Array,
              keys: Optional[jax.Array] = None,
              gather: Optional[Callable] = None, states: Any = None) -> jax.Array:
    """The stacked layers in order; ``keys``: one raw key per layer, or ``None``;
    ``gather``: each layer's parameters gathered where it runs (`_FSDP.layer`),
    recomputed in the backward rather than kept, or ``None``; ``states``: each
    layer's state (stacked alike), or ``None``."""
    stateful = states is not None

    def body(h, xs):
      p, key, s = xs
      p = (p, s) if stateful else p
      if gather is None:
        return self.layer(key, stateful)(p, h), None
      at = (lambda ps: (gather(ps[0]), ps[1])) if stateful else gather
      fn = lambda p, h: self.layer(key, stateful)(at(p), h)  # noqa: E731
      return jax.checkpoint(fn, policy=_gathers_recomputed(self.policy()))(p, h), None
    x, _ = lax.scan(body, x, (layer_params, keys, states))
    return x

  def apply(self, params: Any, batch: Any, rng: Optional[jax.Array] = None,
            model_state: Any = None) -> Any:
    """The whole model on one device: ``head_fn(embed_fn -> all layers)``.

    With ``rng`` (a key) each function is called with ``rng=`` as well: ``embed_fn``
    with ``fold_in(rng, 0)``, layer ``l`` with ``fold_in(rng, 1 + l)`` and ``head_fn``
    with ``fold_in(rng, 1 + num_layers)`` (`Pipeline.keys`), so a layer draws the same
    masks on whichever stage it runs. With ``model_state`` (the layers' states,
    stacked as ``params[stages_key]``; see `value_and_grad`) layer ``l`` is called
    with ``state=`` its state; the state's gradient is then its update from the
    whole batch. ``params`` and ``model_state`` are stored in ``layer_order``.
    """
    if self.layer_order == "device":
      params = self.to_model_order(params)
      if model_state is not None:
        model_state = self.to_model_order({self.stages_key: model_state}
                                         )[self.stages_key]
    layers = params[self.stages_key]
    if rng is None:
      x = self.embed_fn(params, batch)
      x = self._layers(layers, x, states=model_state)
      return self.head_fn(params, x, batch)
    num_layers = jax.tree_util.tree_leaves(layers)[0].shape[0]
    embed_key, layer_keys, head_key = self.keys(rng, jnp.arange(num_layers),
                                                num_layers)
    x = self.embed_fn(params, batch, rng=embed_key)
    x = self._layers(layers, x, jax.random.key_data(layer_keys), states=model_state)
    return self.head_fn(params, x, batch, rng=head_key)

  @staticmethod
  def keys(rng: jax.Array, layers: jax.Array, num_layers: int
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(embed key, keys of layers, head key)`` of one micro-batch's key ``rng``."""
    rng = keys_lib.typed(rng)
    layer_keys = jax.vmap(lambda l: jax.random.fold_in(rng, 1 + l))(layers)
    return (jax.random.fold_in(rng, 0), layer_keys,
            jax.random.fold_in(rng, 1 + num_layers))

  # ---- layout
  def check(self, params: Any, mesh: Mesh, data_axis: Any = "data", batch: Any = None
           ) -> None:
    """Raises ``ValueError`` naming the problem for a layout that cannot pipeline.

    ``data_axis`` (the mesh's data-parallel axis or axes, `mpscale.sharding.data_axes`)
    is read only with a ``batch``, whose rows must divide into the data replicas'
    micro-batches (`mpscale.sharding.batch_rows`).
    """
    if mesh is None or self.stage_axis not in mesh.axis_names:
      raise ValueError(f"mesh has no stage axis {self.stage_axis!r}; its axes are "
                       f"{None if mesh is None else mesh.axis_names}")
    S = mesh.shape[self.stage_axis]
    if self.num_stages is not None and self.num_stages != S:
      raise ValueError(f"num_stages={self.num_stages} but the mesh has {S} stages: "
                       "the stacked layers are stored for num_stages")
    self._check_layers(params, S)
    if batch is not None:
      data_size = sharding_lib.axis_size(
          mesh, sharding_lib.data_axes(mesh, data_axis))
      sharding_lib.batch_rows(batch, data_size, self.num_microbatches, pipelined=True)

  def _check_layers(self, params: Any, S: int) -> None:
    """`check`'s stacked layers: one layer axis, split into ``S`` stages x
    ``virtual_stages`` chunks (and ``M`` a multiple of ``S`` when interleaved)."""
    if not isinstance(params, dict) or self.stages_key not in params:
      raise ValueError(f"params must be a dict with the stacked layers under "
                       f"{self.stages_key!r}")
    v = self.virtual_stages
    layers = {np.shape(x)[0] if np.ndim(x) else None
              for x in jax.tree_util.tree_leaves(params[self.stages_key])}
    if len(layers) != 1 or None in layers:
      raise ValueError(f"every leaf of params[{self.stages_key!r}] needs the same "
                       f"leading (layer) axis; got {sorted(map(str, layers))}")
    (num_layers,) = layers
    if num_layers % (S * v):
      raise ValueError(f"{num_layers} layers are not divisible by {S} stages x "
                       f"{v} virtual stages")
    check_schedule(self.schedule, S, self.num_microbatches, v)

  def param_specs(self, params: Any, specs: Any = None) -> Any:
    """PartitionSpecs: the stacked layers' leading axis over the stage axis, on top of
    ``specs`` (a pytree of specs like ``params``; default replicated)."""
    if specs is None:
      specs = jax.tree_util.tree_map(lambda _: P(), params)

    def staged(spec, leaf):
      entries = sharding_lib.pad(spec, np.ndim(leaf))
      if entries and entries[0] in (None, self.stage_axis):
        entries[0] = self.stage_axis
      else:
        raise ValueError(f"params[{self.stages_key!r}]: the layer axis of every leaf "
                         f"is split over {self.stage_axis!r}; got the spec {spec}")
      return sharding_lib.make_spec(entries)

    return {k: jax.tree_util.tree_map(staged, specs[k], v, is_leaf=sharding_lib.is_spec)
            if k == self.stages_key else specs[k] for k, v in params.items()}

  def shard_params(self, params: Any, mesh: Mesh) -> Any:
    """``params`` placed on ``mesh`` with `param_specs`."""
    return jax.device_put(
        params, sharding_lib.shardings(mesh, self.param_specs(params)))

  def bubble(self, num_stages: int) -> float:
    """The bubble fraction of this pipeline's schedule on ``num_stages`` stages."""
    return bubble_fraction(schedule_table(self.schedule, num_stages,
                                          self.num_microbatches, self.virtual_stages))

  # ---- gradients
  def _num_layers(self, params: Any) -> int:
    return jax.tree_util.tree_leaves(params[self.stages_key])[0].shape[0]

  def _stack_keys(self) -> tuple[str, ...]:
    """The keys of ``params`` holding stacked layers."""
    return (self.stages_key,)

  def _executor(self) -> Callable[..., tuple[jax.Array, jax.Array, Any, Any]]:
    return _gpipe if self.schedule == "gpipe" else _ticked  # 1f1b or zb_h1

  def value_and_grad(self, params: Any, batch: Any, *, mesh: Mesh,
                     data_axis: Any = "data", loss_scale: Any = 1.0,
                     per_token_loss: bool = False,
                     cast: Callable[[Any], Any] = lambda p: p,
                     param_specs: Any = None,
                     rng: Optional[jax.Array] = None,
                     grad_reduce_dtype: Any = None, model_state: Any = None) -> Any:
    """Loss and gradients of ``loss_scale * loss``, pipelined over ``mesh``.

    ``shard_map`` is manual over the stage axis and the data axes; every other axis
    (``tensor``) stays automatic, so each stage's layers keep the tensor-parallel
    layout of ``param_specs`` and GSPMD inserts its collectives inside the stage. A
    leaf ``param_specs`` splits over a data axis (FSDP) is gathered a layer at a time
    where it is used (the module docstring).

    Args:
      params: the model parameters (see the class docstring), float32 masters.
      batch: a pytree of arrays with the global batch on the leading axis.
      mesh: a mesh with the stage axis and the data axes.
      data_axis: the data-parallel mesh axis, or a tuple of them; every one must be an
        axis of ``mesh`` (one of size 1 where there is no data parallelism).
      loss_scale: the loss scale (gradients are of ``loss_scale * loss``).
      per_token_loss: ``head_fn`` returns ``(loss_sum, num_tokens)``; the loss is the
        sum over every micro-batch and replica divided by the total token count.
      cast: applied to ``params`` before use (a precision policy's cast to the
        compute dtype); gradients come back in the masters' dtype.
      param_specs: the params' PartitionSpecs (a pytree like ``params``), or ``None``:
        stacked layers over the stage axis, the rest replicated.
      rng: a step's key, for stochastic layers (dropout), or ``None``. Micro-batch
        ``m`` of data replica ``r`` draws from ``fold_in(fold_in(rng, m), r)`` (without
        data replicas ``fold_in(rng, m)``), as `mpscale.accumulate_gradients` gives
        each replica's micro-batch, and inside it as `Pipeline.apply` does: every
        function is called with ``rng=`` and layer ``l`` draws from
        ``fold_in(key, 1 + l)`` on whichever stage it runs.
      grad_reduce_dtype: ``None`` or float32
        (`mpscale.gradients.check_grad_reduce_dtype`). The gradients leave each
        device in the masters' dtype, so the sums over the data axes and the stage
        axis are float32 either way, and so is 1F1B's sum over micro-batches.
        GPipe's is not by default: it casts the parameters once, and autodiff adds
        each micro-batch's cotangent of that cast copy in the compute dtype. With
        float32, every tick casts the masters itself, so each micro-batch's gradient
        is widened before it is added (Megatron-LM's
        ``accumulate_allreduce_grads_in_fp32``).
      model_state: the layers' state, ``None`` or a pytree of float arrays stacked
        as ``params[stages_key]`` (leading axis the layers, in ``layer_order``) whose
        cotangent is its update: FP8 products' scaling state (`mpscale.fp8`, an
        ``_overwrite_with_gradient`` collection), whose products' custom VJPs give
        the updated state as the state's gradient. Layer ``l`` is called with
        ``state=`` its state. Every micro-batch of every data replica starts from
        it (FP8's delayed scales are the step's), each one's update is kept apart
        (a copy of the state per micro-batch and replica, laid out over the stage
        and data axes) and ``merge_state`` combines them once, after the
        schedule: for FP8 the state a single call on the whole batch records, the
        same on every replica. Needs ``merge_state``.

    Returns:
      `mpscale.gradients.Gradients` ``(grads, loss, num_tokens)``: the gradients of
      ``loss_scale * loss`` laid out like ``params``, the unscaled mean loss, and the
      token count (with ``per_token_loss``; else micro-batches x data replicas).
      With a ``model_state``, the pair ``(Gradients, new_model_state)``; a layer
      that did not use its state gets zeros (its cotangent).
    """
    return self._run(self._executor(), params, batch, mesh=mesh, data_axis=data_axis,
                     loss_scale=loss_scale, per_token_loss=per_token_loss, cast=cast,
                     param_specs=param_specs, rng=rng,
                     grad_reduce_dtype=grad_reduce_dtype, model_state=model_state)

  def residual_bytes(self, params: Any, batch: Any, *, mesh: Mesh, **kwargs: Any
                     ) -> dict[str, int]:
    """What one device keeps for the backward, from a trace of `value_and_grad`
    (same arguments; shapes are enough, nothing is compiled or run).

    Returns a dict: ``layer`` (bytes one layer keeps for one micro-batch under
    `policy`: its pullback's residuals less its parameters, and for ZB-H1 its weight
    products' inputs and output cotangents too), ``items`` (micro-batches held at
    once, each through one chunk of layers: the executor's buffer slots, for GPipe
    every tick of its scan), ``layers`` (the layers of a chunk, a device's layers over
    ``virtual_stages``) and ``total`` (their product). Shapes along the mesh axes
    the pipeline leaves to GSPMD (``tensor``, ``fsdp``) are whole: a tensor-parallel
    layer's residuals are split further on the device.
    """
    report = {}

    def executor(run, params):
      ops = _Ticks(run, params)
      v = self.virtual_stages
      if self.schedule == "gpipe":
        items = v * run.M + run.S - 1
      else:
        items = item_slots(chunk_table(self.schedule, run.S, run.M, v), v, run.M)[1]
      layer = sum(x.size * x.dtype.itemsize for x in ops.kept_shapes + ops.cts_shapes)
      report.update(layer=int(layer), items=int(items), layers=ops.n,
                    total=int(layer) * int(items) * ops.n)
      # Shapes alone: the step itself is not traced again.
      return run.zero(), run.zero(), run.vary(_float32_zeros(params)), None

    jax.eval_shape(lambda p, b: self._run(executor, p, b, mesh=mesh, **kwargs),
                   params, batch)
    return report

  def _run(self, executor: Callable, params: Any, batch: Any, *, mesh: Mesh,
           data_axis: Any = "data", loss_scale: Any = 1.0,
           per_token_loss: bool = False, cast: Callable[[Any], Any] = lambda p: p,
           param_specs: Any = None, rng: Optional[jax.Array] = None,
           grad_reduce_dtype: Any = None, model_state: Any = None) -> Any:
    """`value_and_grad` with ``executor(run, params) -> (loss, count, grads,
    state updates)``."""
    self.check(params, mesh, data_axis, batch)
    stateful = model_state is not None
    if stateful:
      self.check_model_state(model_state, params)
    float32_sums = check_grad_reduce_dtype(grad_reduce_dtype) is not None
    specs = self.param_specs(params, param_specs)
    data_axes = sharding_lib.data_axes(mesh, data_axis)
    axes = data_axes + (self.stage_axis,)
    D = sharding_lib.axis_size(mesh, data_axes)
    S, M = mesh.shape[self.stage_axis], self.num_microbatches
    num_layers = self._num_layers(params)
    interleave = _interleave_order(num_layers, S, self.virtual_stages)
    # Stored in device order, the layers are where the devices run them already.
    permute = interleave is not None and self.layer_order == "model"
    in_param_specs = jax.tree_util.tree_map(
        lambda spec: sharding_lib.only_axes(spec, axes), specs,
        is_leaf=sharding_lib.is_spec)

    def per_device(params, batch, scale, keys, states):
      # Everything in the loop varies over every manual axis, so autodiff puts no
      # psum in it. FSDP's split leaves stay shards: gathered where used (_FSDP).
      # A state's copies are this device's layers x its M micro-batches already.
      varying = sharding_lib.cast_varying(params, axes)
      fsdp = _FSDP.of(varying, in_param_specs, data_axes, cast, self._stack_keys())
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), batch)
      micro = sharding_lib.cast_varying(micro, axes)
      scale = sharding_lib.cast_varying(scale, axes)
      if keys is not None:
        keys = sharding_lib.cast_varying(_replica_keys(keys, data_axes, D), axes)
      run = _PipelineRun(self, S, M, per_token_loss, cast, axes, num_layers, micro,
                         scale, keys, float32_sums, fsdp, states)
      loss, count, grads, updates = executor(run, varying)
      grads = _sum_invariant(grads, axes, params)
      loss, count = lax.psum(loss, axes), lax.psum(count, axes)
      if per_token_loss:
        denom = count
      else:
        denom = jnp.asarray(M * D, jnp.float32)
        count = jnp.asarray(M * D, jnp.float32)
      grads = jax.tree_util.tree_map(lambda g: g / denom.astype(g.dtype), grads)
      return grads, loss / denom, count, updates

    batch_spec = sharding_lib.batch_sharding(mesh, data_axes).spec
    keys = None
    if rng is not None:
      # Micro-batch keys (raw data) and each layer's index, laid out like the layers.
      layer_ids = jnp.arange(num_layers)
      if interleave is not None:
        layer_ids = layer_ids[interleave]
      keys = (jax.random.key_data(jax.vmap(lambda m: keys_lib.microbatch_key(rng, m))(
          jnp.arange(M))), layer_ids)
    copies = None
    if stateful:
      # One copy of the state per (replica, micro-batch): [layers, D * M, ...],
      # the layers over the stages and the copies over the data axes.
      copies = jax.tree_util.tree_map(
          lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], D * M) + x.shape[1:]),
          model_state)
    copies_spec = P(self.stage_axis, data_axes or None)
    state_specs = jax.tree_util.tree_map(lambda _: copies_spec, copies)
    fn = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(in_param_specs,
                  jax.tree_util.tree_map(lambda _: batch_spec, batch), P(),
                  None if keys is None else (P(), P(self.stage_axis)), state_specs),
        out_specs=(in_param_specs, P(), P(), state_specs), axis_names=set(axes))
    reorder = lambda tree, order: jax.tree_util.tree_map(  # noqa: E731
        lambda x: x[order], tree)
    if permute:
      # Device s must hold its chunks s, s + S, ...: one all-to-all of the layers.
      params = {**params, self.stages_key: reorder(params[self.stages_key],
                                                   interleave)}
      copies = reorder(copies, interleave)
    grads, loss, count, updates = fn(
        params, batch, jnp.asarray(loss_scale, jnp.float32), keys, copies)
    if permute:
      back = np.argsort(interleave)
      grads = {**grads, self.stages_key: reorder(grads[self.stages_key], back)}
      updates = reorder(updates, back)
    if not stateful:
      return Gradients(grads, loss, count)
    # The copies' updates, merged per layer: [D * M, layers, ...] -> [layers, ...].
    new_state = self.merge_state(jax.tree_util.tree_map(
        lambda u: jnp.swapaxes(u, 0, 1), updates))
    return Gradients(grads, loss, count), new_state

  def check_model_state(self, model_state: Any, params: Any = None) -> None:
    """Raises ``ArgumentError`` naming ``model_state`` (and ``merge_state``) unless
    this pipeline can take ``model_state`` (`value_and_grad`'s): a ``merge_state``
    to combine its updates and, with ``params``, float leaves stacked over their
    layers."""
    if self.merge_state is None:
      raise validation.ArgumentError(
          ("model_state", "merge_state"), "a {0} needs the Pipeline's {1}: how its "
          "updates from several micro-batches and replicas combine")
    if params is None:
      return
    num_layers = self._num_layers(params)
    for leaf in jax.tree_util.tree_leaves(model_state):
      if (np.ndim(leaf) == 0 or np.shape(leaf)[0] != num_layers
          or not jnp.issubdtype(leaf.dtype, jnp.floating)):
        raise validation.fail(
            "model_state", f" must hold float arrays stacked over the {num_layers} "
            f"layers (leading axis) as params[{self.stages_key!r}]; got a leaf "
            f"{jnp.result_type(leaf)}{list(np.shape(leaf))}")


def _replica_keys(keys: tuple[jax.Array, jax.Array], data_axes: Sequence[str],
                  num_replicas: int) -> tuple[jax.Array, jax.Array]:
  """Inside ``shard_map``: each micro-batch key folded with this device's data
  replica index (when there are several replicas)."""
  micro_keys, layer_ids = keys
  if num_replicas > 1:
    replica = sharding_lib.replica_index(data_axes)
    micro_keys = jax.random.key_data(jax.vmap(
        lambda k: keys_lib.replica_key(k, replica))(micro_keys))
  return micro_keys, layer_ids


def _interleave_order(num_layers: int, S: int, v: int) -> Optional[np.ndarray]:
  """Layer order that puts virtual stage ``c S + s`` (chunk ``c`` of device ``s``) in
  device ``s``'s contiguous block; ``None`` without virtual stages."""
  if v == 1:
    return None
  per_chunk = num_layers // (S * v)
  return np.asarray([(c * S + s) * per_chunk + k for s in range(S) for c in range(v)
                     for k in range(per_chunk)])


def _gathers_recomputed(policy: Optional[Callable]) -> Callable:
  """``policy`` (``None``: keep the outputs of matrix products) that never keeps a
  weight gathered over the data axes (`_FSDP`): the backward gathers it again, as
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


@dataclasses.dataclass(frozen=True, eq=False)
class _FSDP:
  """Parameters split over the data axes (FSDP) inside the pipeline's ``shard_map``.

  Each stays a master shard until it is used, then is cast to the compute dtype and
  all-gathered there (`mpscale.sharding.gather_cast`): a layer at a time for the
  stacked layers (in every schedule, on the forward and again on the backward), and
  around the embedding and the head for the rest. Its gradient is reduce-scattered
  back where it is computed, in the masters' dtype, so no device ever holds a whole
  stage's parameters or gradients.
  """
  specs: Any
  """Like the params: each leaf's spec over the manual axes."""
  axes: tuple[str, ...]
  """The data axes."""
  dtypes: Any
  """Like the params: each leaf's compute dtype (the run's cast)."""
  stacks: tuple[str, ...]
  """The keys of the stacked layers."""

  @classmethod
  def of(cls, params: Any, specs: Any, axes: Sequence[str], cast: Callable,
         stacks: Sequence[str]) -> Optional["_FSDP"]:
    """``None`` where no leaf is split over ``axes``."""
    split = [sharding_lib.split_dims(s, axes)
             for s in jax.tree_util.tree_leaves(specs, is_leaf=sharding_lib.is_spec)]
    if not any(split):
      return None
    dtypes = jax.tree_util.tree_map(lambda x: x.dtype, jax.eval_shape(cast, params))
    return cls(specs, tuple(axes), dtypes, tuple(stacks))

  def _dims(self, spec: P, stacked: bool) -> tuple:
    return tuple(sharding_lib.split_dims(P(*spec[1:]) if stacked else spec, self.axes))

  def compute(self, params: Any, cast: Callable) -> Any:
    """``cast(params)``, but the split leaves left as master shards (cast when
    gathered)."""
    return jax.tree_util.tree_map(
        lambda m, c, s: m if sharding_lib.split_dims(s, self.axes) else c,
        params, cast(params), self.specs)

  def _gather(self, tree: Any, specs: Any, dtypes: Any, stacked: bool) -> Any:
    def gather(x, spec, dtype):
      dims = self._dims(spec, stacked)
      return sharding_lib.gather_cast(x, dtype, dims) if dims else x
    return jax.tree_util.tree_map(gather, tree, specs, dtypes)

  def layer(self, key: str, lp: Any) -> Any:
    """One layer's parameters (a slice of stack ``key``) gathered for compute."""
    return self._gather(lp, self.specs[key], self.dtypes[key], True)

  def rest(self, p: Any) -> Any:
    """``p`` with every leaf outside the stacks gathered for compute."""
    return {k: x if k in self.stacks else
            self._gather(x, self.specs[k], self.dtypes[k], False)
            for k, x in p.items()}

  def scatter_layer(self, key: str, grads: Any, only: Optional[set] = None) -> Any:
    """A layer's float32 gradients reduce-scattered back to its shards (1F1B and
    ZB-H1, whose backward is their own, not autodiff's); ``only``: the leaf indices
    to send, the others known zero (zeros of the shard's shape)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    specs = jax.tree_util.tree_leaves(self.specs[key], is_leaf=sharding_lib.is_spec)
    out = []
    for i, (g, spec) in enumerate(zip(leaves, specs)):
      dims = self._dims(spec, True)
      g = g.astype(jnp.float32)
      if only is not None and i not in only:
        shape = list(g.shape)
        for dim, over in dims:
          shape[dim] //= math.prod(lax.axis_size(a) for a in over)
        out.append(jnp.zeros(shape, jnp.float32))
        continue
      out.append(sharding_lib.scatter_dims(g, dims))
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclasses.dataclass(frozen=True, eq=False)
class _PipelineRun:
  """What the executors share for one pipelined gradient, inside ``shard_map``: the
  schedule's sizes and this device's inputs. The 1F1B steps are its methods."""
  pipeline: Pipeline
  S: int
  M: int
  per_token_loss: bool
  cast: Callable[[Any], Any]
  axes: tuple[str, ...]
  """The manual axes (data, stage) every loop value varies over."""
  num_layers: int
  micro: Any
  """This device's batch rows as ``M`` micro-batches (stacked on a leading axis)."""
  scale: jax.Array
  """The loss scale."""
  keys: Any = None
  """``(raw micro-batch keys, ids of this device's layers)``, or ``None``."""
  cast_each_tick: bool = False
  """GPipe casts the masters in every tick (``grad_reduce_dtype=float32``), not once:
  its micro-batches' gradients then add up in float32."""
  fsdp: Optional[_FSDP] = None
  """The parameters split over the data axes, gathered where used; ``None``: none."""
  states: Any = None
  """This device's copies of the layers' state: ``[its layers, M, ...]``, a copy per
  micro-batch (`Pipeline.value_and_grad`'s ``model_state``); ``None``: none."""

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
                          policy=_gathers_recomputed(None))

  # ---- shared by both schedules
  def stage(self) -> jax.Array:
    """This device's stage index ``s``."""
    return lax.axis_index(self.pipeline.stage_axis)

  def vary(self, tree: Any) -> Any:
    return sharding_lib.cast_varying(tree, self.axes)

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
    embed, layers, head = Pipeline.keys(self.keys[0][m], layer_ids, self.num_layers)
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


def _layers_of_chunk(pipe: Pipeline, layers: Any, chunk: jax.Array, x: jax.Array,
                     keys: Optional[jax.Array], gather: Callable = lambda lp: lp,
                     states: Any = None) -> jax.Array:
  """``pipe._layers`` over chunk ``chunk`` of ``layers`` (leaves ``[v, n, ...]``;
  ``states`` alike, or ``None``).

  Each layer's parameters are picked from the stack inside a rematerialized body
  that saves only the outputs of its matrix products under ``recompute="none"``
  (``dots_saveable``; else what `Pipeline.policy` saves): autodiff of the tick loop
  would otherwise keep the picked parameters for every tick (``v M + S - 1`` copies
  of a chunk's, memory growing with ``M``; a policy saving all but them by name
  still keeps the slice that feeds the name), where the stack itself is
  loop-invariant and kept once; the backward picks them again and recomputes the
  elementwise work. ``gather`` (FSDP, `_FSDP.layer`) gathers the picked parameters,
  again in the backward.
  """
  n = jax.tree_util.tree_leaves(layers)[0].shape[1]
  pick = lambda tree, l: jax.tree_util.tree_map(  # noqa: E731
      lambda a: a[chunk, l], tree)

  def body(h, l):
    lp = gather(pick(layers, l))
    key = None if keys is None else keys[l]
    state = None if states is None else pick(states, l)
    return pipe._stage(lp, h, key, state), None  # pylint: disable=protected-access

  policy = _gathers_recomputed(pipe.policy())
  h, _ = lax.scan(jax.checkpoint(body, policy=policy), x, jnp.arange(n))
  return h


def _gpipe(run: _PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
  """GPipe, interleaved over ``virtual_stages`` chunks: the forward loop, run
  backward by autodiff. Returns ``(loss sum, count sum, grads, state updates)`` of
  this device (the updates of its state copies, or ``None``)."""
  pipe, S, M = run.pipeline, run.S, run.M
  v = pipe.virtual_stages
  stage = run.stage()
  x_shape = run.embed_shape(params)
  ring = [(i, (i + 1) % S) for i in range(S if v > 1 else S - 1)]

  def objective(params, states):
    def cast():
      p = run.params(params)
      layers = p[pipe.stages_key]
      layer_ids = run.layer_ids()
      if v > 1:
        layers, layer_ids = jax.tree_util.tree_map(
            lambda x: x.reshape((v, x.shape[0] // v) + x.shape[1:]),
            (layers, layer_ids))
      return p, layers, layer_ids

    # Cast once, the loop's transpose adds the cotangents of the cast copy (compute
    # dtype); cast in each tick, it adds each tick's float32 gradient of the masters.
    once = None if run.cast_each_tick else cast()

    def tick(carry, t):
      p, layers, layer_ids = cast() if once is None else once
      received, loss, count = carry
      item = t - stage                   # this device's work item
      valid = (item >= 0) & (item < v * M)
      item = jnp.clip(item, 0, v * M - 1)
      within = item % (S * v)
      chunk = within // S
      m = item // (S * v) * S + within % S
      mb = run.micro_batch(m)
      chunk_ids = layer_ids if v == 1 or layer_ids is None else (
          lax.dynamic_index_in_dim(layer_ids, chunk, keepdims=False))
      embed_kw, layer_keys, head_kw = run.micro_keys(m, chunk_ids)
      starts = (stage == 0) & (chunk == 0)
      embed = run.gathered(lambda p, mb: pipe.embed_fn(p, mb, **embed_kw))
      x = lax.cond(starts, lambda: embed(p, mb).astype(x_shape.dtype),
                   lambda: received)
      # A bubble's input is garbage: replace it before any arithmetic touches it.
      x = jnp.where(valid, x, jnp.zeros_like(x))
      gather = run.gather_layer(pipe.stages_key)
      item_states = run.item_states(states, m, valid)
      if v > 1 and item_states is not None:
        item_states = jax.tree_util.tree_map(
            lambda s: s.reshape((v, s.shape[0] // v) + s.shape[1:]), item_states)
      y = (pipe._layers(layers, x, layer_keys, gather,  # pylint: disable=protected-access
                        item_states)
           if v == 1 else _layers_of_chunk(pipe, layers, chunk, x, layer_keys,
                                           gather or (lambda lp: lp), item_states))
      ends = valid & (stage == S - 1) & (chunk == v - 1)
      head = run.gathered(lambda p, y, mb: run.head_terms(p, y, mb, **head_kw))
      l, c = lax.cond(ends, lambda: head(p, y, mb),
                      lambda: (run.zero(), run.zero()))
      received = lax.ppermute(y, pipe.stage_axis, ring) if S > 1 else y
      return (received, loss + l, count + c), None

    init = run.vary(jnp.full(x_shape.shape, _BUBBLE_FILL, x_shape.dtype))
    (_, loss, count), _ = lax.scan(tick, (init, run.zero(), run.zero()),
                                   jnp.arange(v * M + S - 1))
    return run.scale * loss, (loss, count)

  (grads, updates), (loss, count) = jax.grad(objective, argnums=(0, 1),
                                             has_aux=True)(params, run.states)
  return loss, count, grads, updates


# ---------------------------------------------------------------- 1F1B and ZB-H1
@dataclasses.dataclass(frozen=True)
class _Residuals:
  """How one layer's backward is rebuilt from what its forward kept: ``jax.vjp``'s
  pullback is a pytree whose leaves are the residuals. Leaves that are the layer's
  own parameters are not kept (the backward picks them from the stack again), nor
  are zeros the forward was given (ZB-H1's deltas, which a recompute policy saves as
  its inputs); the others are, typed keys as their raw data. ZB-H1's weight products'
  inputs are kept with them, once where one is a residual too."""
  treedef: Any
  sources: tuple[tuple[str, int], ...]
  """Per pullback leaf: ``("param", i)`` the layer's ``i``-th parameter leaf,
  ``("zeros", i)`` zeros shaped like ``zeros[i]``, ``("kept", j)`` the ``j``-th kept
  array."""
  key_impls: tuple[Any, ...]
  """Per kept array: the key implementation of a typed key, else ``None``."""
  zeros: tuple[jax.ShapeDtypeStruct, ...] = ()
  inputs: tuple[int, ...] = ()
  """Per weight product (ZB-H1): which kept array is its input."""

  def pullback(self, layer_params: Any, kept: Sequence[jax.Array],
               vary: Callable = lambda x: x) -> Callable:
    params = jax.tree_util.tree_leaves(layer_params)
    kept = [x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(kept, self.key_impls)]
    zeros = [vary(jnp.zeros(z.shape, z.dtype)) for z in self.zeros]
    pick = {"param": params, "zeros": zeros, "kept": kept}
    return jax.tree_util.tree_unflatten(
        self.treedef, [pick[kind][i] for kind, i in self.sources])


def _split_pullback(pullback: Any, layer_params: Any, zeros: Sequence[jax.Array] = (),
                    inputs: Sequence[jax.Array] = ()
                    ) -> tuple[_Residuals, list[jax.Array]]:
  """``(how to rebuild it, the arrays to keep)`` of a layer's ``jax.vjp`` pullback
  (`_Residuals`), with ``zeros`` not kept and ``inputs`` kept too."""
  leaves, treedef = jax.tree_util.tree_flatten(pullback)
  known = {"param": jax.tree_util.tree_leaves(layer_params), "zeros": list(zeros)}
  sources, kept, impls = [], [], []

  def keep(leaf):
    j = next((j for j, k in enumerate(kept) if leaf is k), None)
    if j is not None:
      return j
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      impls.append(jax.random.key_impl(leaf))
      kept.append(jax.random.key_data(leaf))
    else:
      impls.append(None)
      kept.append(leaf)
    return len(kept) - 1

  for leaf in leaves:
    found = next(((kind, i) for kind, xs in known.items()
                  for i, x in enumerate(xs) if leaf is x), None)
    sources.append(found or ("kept", keep(leaf)))
  picks = tuple(keep(x) for x in inputs)
  shapes = tuple(jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros)
  return _Residuals(treedef, tuple(sources), tuple(impls), shapes, picks), kept


class _Ticks:
  """The 1F1B and ZB-H1 executors' ops on one device, inside ``shard_map``.

  ``F(m, c)`` runs chunk ``c``'s layers on micro-batch ``m`` (after the embedding on
  virtual stage 0) and keeps each layer's residuals (`Pipeline.policy` says which); on
  the last virtual stage it also runs the head and its backward, which gives the loss
  and the cotangent of the chunk's output. ``B(m, c)`` runs the chunk's layers
  backward from the kept residuals (1F1B: input and parameter gradients; ZB-H1: with
  each weight product's weight held fixed, keeping those products' output cotangents
  for ``W``, `mpscale.backward_split`), then the embedding's backward on virtual stage
  0. ``W(m)`` (ZB-H1) gives the weight products' gradients from their kept inputs and
  output cotangents. Every parameter is cast once, before the loop; its gradients are
  summed in float32.
  """

  def __init__(self, run: _PipelineRun, params: Any):
    pipe = run.pipeline
    self.run, self.pipe, self.v = run, pipe, pipe.virtual_stages
    p = run.params(params)
    layers = p[pipe.stages_key]
    self.n = jax.tree_util.tree_leaves(layers)[0].shape[0] // self.v
    self.layers = jax.tree_util.tree_map(
        lambda x: x.reshape((self.v, self.n) + x.shape[1:]), layers)
    self.rest = {k: x for k, x in p.items() if k != pipe.stages_key}
    ids = run.layer_ids()
    self.ids = None if ids is None else ids.reshape(self.v, self.n)
    self.states = None if run.states is None else jax.tree_util.tree_map(
        lambda s: s.reshape((self.v, self.n) + s.shape[1:]), run.states)
    """The state copies, ``[v, n, M, ...]``, or ``None``."""
    self.n_params = len(jax.tree_util.tree_leaves(layers))
    self.x_shape = run.embed_shape(params)
    self.split = pipe.schedule == "zb_h1"
    self._residuals: Optional[_Residuals] = None
    """How a layer's pullback is rebuilt, from the latest trace of its forward."""
    self._products: Optional[backward_split.Split] = None
    """ZB-H1: the layer's weight products, from the latest trace of its forward."""
    self.kept_shapes = self.residual_shapes()
    self.cts_shapes = ([] if self._products is None else
                       self._products.delta_shapes())
    """ZB-H1: what ``B`` keeps for ``W``: each weight product's output cotangent."""

  # ---- pieces
  def layer_params(self, c: jax.Array, l: jax.Array) -> Any:
    """Layer ``l`` of chunk ``c``, gathered (FSDP) where it is used."""
    lp = jax.tree_util.tree_map(lambda x: x[c, l], self.layers)
    gather = self.run.gather_layer(self.pipe.stages_key)
    return lp if gather is None else gather(lp)

  def layer_inputs(self, c: jax.Array, l: jax.Array, m: jax.Array) -> Any:
    """What layer ``l`` of chunk ``c`` is differentiated in for micro-batch ``m``:
    its parameters (`layer_params`), paired with its state copy where the layers
    have state."""
    lp = self.layer_params(c, l)
    if self.states is None:
      return lp
    return lp, jax.tree_util.tree_map(lambda s: s[c, l, m], self.states)

  def split_grads(self, dp: Any) -> tuple[Any, Any]:
    """``(parameter cotangents, state update or None)`` of a `layer_inputs`
    cotangent."""
    return (dp, None) if self.states is None else dp

  def layer_grads(self, dp: Any, only: Optional[set] = None) -> Any:
    """A layer's parameter gradients in float32, reduce-scattered back to its shards
    under FSDP; ``only``: the leaves (indices) that can be nonzero, the others zeros
    (not sent)."""
    if self.run.fsdp is None:
      return _float32(dp)
    return self.run.fsdp.scatter_layer(self.pipe.stages_key, self.run.vary(dp), only)

  def layer_keys(self, m: jax.Array, c: jax.Array) -> Any:
    """Raw keys of chunk ``c``'s layers for micro-batch ``m`` (``[n, ...]``), or
    ``None``."""
    if self.ids is None:
      return None
    return self.run.micro_keys(m, self.ids[c])[1]

  def with_layers(self, rest: Any) -> Any:
    return {**rest, self.pipe.stages_key: self.layers}

  def embed(self, m: jax.Array, rest: Any) -> jax.Array:
    embed_kw, _, _ = self.run.micro_keys(m)
    x = self.pipe.embed_fn(self.run.gather_rest(self.with_layers(rest)),
                           self.run.micro_batch(m), **embed_kw)
    return x.astype(self.x_shape.dtype)

  def kept_zeros(self) -> list[jax.Array]:
    """Zeros shaped like one item's kept residuals (``[n, ...]`` each)."""
    return [jnp.zeros((self.n,) + r.shape, r.dtype) for r in self.kept_shapes]

  def residual_shapes(self) -> list[jax.ShapeDtypeStruct]:
    """The residuals one layer keeps (shapes, from a trace of its forward)."""
    def one(lp, x, key):
      return self.layer_forward(lp, x, key)[1]
    key = None if self.ids is None else self.layer_keys(0, 0)[0]
    x = self.run.vary(jnp.zeros(self.x_shape.shape, self.x_shape.dtype))
    return jax.eval_shape(one, self.layer_inputs(0, 0, 0), x, key)

  def layer_forward(self, lp: Any, h: jax.Array, key: Any
                   ) -> tuple[jax.Array, list[jax.Array]]:
    """The layer's output and what its backward keeps: the pullback's residuals
    (ZB-H1: then each weight product's input, `mpscale.backward_split`). ``lp``:
    `layer_inputs`."""
    stateful = self.states is not None
    if not self.split:
      y, pullback = jax.vjp(self.pipe.layer(key, stateful), lp, h)
      self._residuals, kept = _split_pullback(pullback, lp)
      return y, kept
    products = backward_split.Split(self.pipe.plain_layer(key, stateful), lp, h)
    tapped = _under(self.pipe.policy(), products.apply)
    deltas = [self.run.vary(jnp.zeros(d.shape, d.dtype)) for d in products.delta_shapes()]
    y, pullback, inputs = jax.vjp(lambda p, x, d: tapped(p, lp, x, d), lp, h, deltas,
                                  has_aux=True)
    self._products = products
    self._residuals, kept = _split_pullback(pullback, lp, deltas, inputs)
    return y, kept

  def pullback(self, c: jax.Array, l: jax.Array, m: jax.Array,
               kept: Sequence[jax.Array]) -> Callable:
    return self._residuals.pullback(self.layer_inputs(c, l, m), kept, self.run.vary)

  # ---- the ops
  def forward(self, m: jax.Array, c: jax.Array, x_in: jax.Array):
    """``F(m, c)``: ``(y, kept, dy, d_rest, loss, count)``: the chunk's output (to
    send up), its layers' residuals (stacked ``[n, ...]``), and on the last virtual
    stage the cotangent of its output, the head's parameter gradients and the loss
    terms (zeros elsewhere)."""
    run = self.run
    x = lax.cond(run.first(c),
                 _varying(run, functools.partial(self.embed, m, self.rest)),
                 lambda: x_in)
    keys = self.layer_keys(m, c)

    def body(h, xs):
      l, key = xs
      return self.layer_forward(self.layer_inputs(c, l, m), h, key)

    y, kept = lax.scan(body, x, (jnp.arange(self.n), keys))

    def head():
      mb = run.micro_batch(m)
      _, _, head_kw = run.micro_keys(m)
      fn = lambda rest, y: run.head_terms(  # noqa: E731
          run.gather_rest(self.with_layers(rest)), y, mb, **head_kw)
      (loss, count), pull = jax.vjp(fn, self.rest, y)
      d_rest, dy = pull((run.scale.astype(loss.dtype), jnp.zeros_like(count)))
      return dy.astype(y.dtype), _float32(d_rest), loss, count

    def no_head():
      return (jnp.zeros_like(y), _float32_zeros(self.rest), run.zero(), run.zero())

    dy, d_rest, loss, count = lax.cond(run.last(c), _varying(run, head),
                                       _varying(run, no_head))
    return y, kept, dy, d_rest, loss, count

  def backward(self, m: jax.Array, c: jax.Array, ct: jax.Array, kept: Any):
    """``B(m, c)``: ``(dx, d_layers, cts, d_rest, d_states)``: ``d_layers``
    (``[n, ...]``, float32) are the parameter gradients (ZB-H1: all but the weight
    products'), ``cts`` (ZB-H1) each weight product's output cotangent (``[n,
    ...]``) for ``W``, ``d_states`` the layers' state updates (``[n, ...]``, or
    ``None``)."""
    def body(g, xs):
      l, layer_kept = xs
      dp, dh, *cts = self.pullback(c, l, m, layer_kept)(g)
      dp, d_state = self.split_grads(dp)
      # ZB-H1: the leaves only its weight products use get their gradients in W.
      only = None if self._products is None else (
          set(range(self.n_params)) - self._products.weight_only)
      return dh, (self.layer_grads(dp, only), cts[0] if cts else [], d_state)

    dx, (d_layers, cts, d_states) = lax.scan(body, ct, (jnp.arange(self.n), kept),
                                             reverse=True)
    d_rest = lax.cond(
        self.run.first(c),
        _varying(self.run, functools.partial(self.into_embed, m, dx)),
        _varying(self.run, functools.partial(_float32_zeros, self.rest)))
    return dx.astype(ct.dtype), d_layers, cts, d_rest, d_states

  def weights(self, m: jax.Array, c: jax.Array, kept: Any, cts: Any) -> Any:
    """ZB-H1's ``W``: the weight products' parameter gradients (float32,
    ``[n, ...]``) from their kept inputs and output cotangents."""
    def body(_, xs):
      l, layer_kept, dys = xs
      inputs = [layer_kept[j] for j in self._residuals.inputs]
      dp, _ = self.split_grads(self._products.weight_gradients(
          self.layer_inputs(c, l, m), inputs, dys))
      return None, self.layer_grads(dp, {t.leaf for t in self._products.taps})
    return lax.scan(body, None, (jnp.arange(self.n), kept, cts))[1]

  def into_embed(self, m: jax.Array, dx: jax.Array) -> Any:
    _, pull = jax.vjp(functools.partial(self.embed, m), self.rest)
    return _float32(pull(dx.astype(self.x_shape.dtype))[0])


def _under(policy: Optional[Callable], fn: Callable) -> Callable:
  """``fn`` under a ``jax.checkpoint`` policy (``None``: as it is)."""
  return fn if policy is None else jax.checkpoint(fn, policy=policy)


def _varying(run: _PipelineRun, fn: Callable) -> Callable:
  """``fn`` with its outputs cast varying over the manual axes: the branches of a
  ``lax.cond`` or ``lax.switch`` must agree on that type, and zeros are invariant."""
  return lambda: run.vary(fn())


def _float32(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), tree)


def _float32_zeros(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def _phases(table: np.ndarray) -> list[tuple[int, int, tuple[tuple[int, ...], ...]]]:
  """Runs of ticks that use the same op slots: ``(start, stop, ops of each slot)``
  (an empty tuple for an unused slot). Each run is one ``lax.scan`` whose tick runs a
  switch over its ops in each used slot: a warm-up that only forwards pays for no
  backward, a cool-down no forward."""
  used = (table[..., 0] != IDLE).any(axis=1)           # [ticks, slots]
  runs, start = [], 0
  for t in range(1, len(table) + 1):
    if t == len(table) or (used[t] != used[start]).any():
      ops = tuple(tuple(sorted({IDLE} | set(np.unique(table[start:t, :, k, 0]).tolist())))
                  if used[start, k] else () for k in range(table.shape[2]))
      if any(ops):
        runs.append((start, t, ops))
      start = t
  return runs


def _ticked(run: _PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
  """1F1B (interleaved over ``virtual_stages`` chunks) or ZB-H1 from its table
  (`mpscale.pipeline_schedules`): per tick, the op of each slot (`_Ticks`), one
  ``ppermute`` up and one down (paired ticks: the forward's output right after the
  forward, the backward's input gradient at the start of the next tick). Buffers
  hold ``K`` item slots (`item_slots`). Returns ``(loss sum, count sum, grads, state
  updates)`` of this device (the updates of its state copies, or ``None``)."""
  pipe, S, M = run.pipeline, run.S, run.M
  v = pipe.virtual_stages
  ops = _Ticks(run, params)
  table = chunk_table(pipe.schedule, S, M, v)
  slot_of, K = item_slots(table, v, M)
  slot_of = jnp.asarray(slot_of)
  bwd_slot = 0 if ops.split else 1     # a one-op tick (zb_h1) or a paired one
  fill = lambda shape, dtype: run.vary(  # noqa: E731
      jnp.full((K,) + tuple(shape), _BUBBLE_FILL, dtype))
  act = (ops.x_shape.shape, ops.x_shape.dtype)
  carry = {
      "inbox": fill(*act), "ct": fill(*act),
      "kept": [fill((ops.n,) + r.shape, r.dtype) for r in ops.kept_shapes],
      "d_layers": run.vary(_float32_zeros(params[pipe.stages_key])),  # as stored
      "d_rest": run.vary(_float32_zeros(ops.rest)),
      "loss": run.zero(), "count": run.zero()}
  if ops.states is not None:
    carry["d_states"] = run.vary(jax.tree_util.tree_map(jnp.zeros_like, ops.states))
  if ops.split:
    carry["cts"] = [fill((ops.n,) + d.shape, d.dtype) for d in ops.cts_shapes]
  # Paired ticks send a backward's input gradient one tick late: it leaves at the
  # start of the next tick and lands after that tick's forward, which it overlaps,
  # in time for the backward (slot 1) that needs it.
  deferred = not ops.split and (S > 1 or v > 1)
  if deferred:
    carry["sent"] = (run.vary(jnp.zeros(*act)), run.vary(jnp.asarray(False)),
                     run.vary(jnp.asarray(0, jnp.int32)))
  stage = run.stage()

  def tick(slot_ops, deliver, carry, row):
    c = dict(carry)
    y = dx = None
    got = None
    if deliver:
      got = lax.ppermute(c["sent"][0], pipe.stage_axis, _down_pairs(S, v))
    for k, kinds in enumerate(slot_ops):
      if k == 1 and got is not None:
        _, came, item = c["sent"]
        c["ct"] = _write(item, came, c["ct"], got)
      if not kinds:
        continue
      op, m, chunk = row[stage, k, 0], row[stage, k, 1], row[stage, k, 2]
      item = slot_of[stage, chunk, m]
      # The slot's ops read their item's slots here, not inside the switch (which
      # would take the whole buffers and make XLA copy them every tick), and after
      # the slot before wrote (the last virtual stage's backward reads what its
      # forward kept in the same tick).
      reads = {name: jax.tree_util.tree_map(lambda b: b[item], c[name])
               for name in _needs(kinds, _READS) if name in c}
      writes = [name for name in _needs(kinds, _WRITES) if name in c]
      branches = [_varying(run, _OP_BRANCHES[kind](ops, reads, m, chunk, writes))
                  for kind in kinds]
      index = jnp.asarray(np.searchsorted(kinds, np.arange(4)).clip(0, len(kinds) - 1),
                          jnp.int32)[op]
      out = lax.switch(index, branches)
      for name, (where, value) in out.pop("writes").items():
        c[name] = jax.tree_util.tree_map(functools.partial(_write, item, where),
                                         c[name], value)
      if BWD in kinds or WGT in kinds:
        c["d_layers"] = jax.tree_util.tree_map(
            lambda g, d: g.reshape((v,) + d.shape).at[chunk].add(d).reshape(g.shape),
            c["d_layers"], out["d_layers"])
      if BWD in kinds and "d_states" in c:
        # Each (chunk, micro-batch) has one B: its copies' updates, zeros elsewhere.
        c["d_states"] = jax.tree_util.tree_map(
            lambda u, d: u.at[chunk, :, m].add(d), c["d_states"], out["d_states"])
      c["d_rest"] = jax.tree_util.tree_map(jnp.add, c["d_rest"], out["d_rest"])
      c["loss"], c["count"] = c["loss"] + out["loss"], c["count"] + out["count"]
      if FWD in kinds and (S > 1 or v > 1):
        # Sent as soon as it exists: the backward of slot 1 hides its transfer.
        y = lax.ppermute(out["y"], pipe.stage_axis, _up_pairs(S, v))
      if BWD in kinds:
        dx = out["dx"]
    if S > 1 or v > 1:
      if y is not None:
        c["inbox"] = _write(*_arrival(run, row, slot_of, FWD, 0), c["inbox"], y)
      if deferred:
        item, came = _arrival(run, row, slot_of, BWD, bwd_slot)
        c["sent"] = run.vary((dx, came, item) if dx is not None else
                             (c["sent"][0], jnp.asarray(False), item))
      elif dx is not None:
        c["ct"] = _write(*_arrival(run, row, slot_of, BWD, bwd_slot), c["ct"],
                         lax.ppermute(dx, pipe.stage_axis, _down_pairs(S, v)))
    return c, None

  for start, stop, slot_ops in _phases(table):
    # A gradient may be on its way from the tick before once a backward ran.
    deliver = deferred and bool((table[:stop - 1, :, bwd_slot, 0] == BWD).any())
    carry, _ = lax.scan(functools.partial(tick, slot_ops, deliver), carry,
                        jnp.asarray(table[start:stop]))
  grads = {**carry["d_rest"], pipe.stages_key: carry["d_layers"]}
  updates = None if ops.states is None else jax.tree_util.tree_map(
      lambda u: u.reshape((v * ops.n,) + u.shape[2:]), carry["d_states"])
  return carry["loss"], carry["count"], grads, updates


def _write(item: jax.Array, where: jax.Array, buffer: jax.Array, value: jax.Array
          ) -> jax.Array:
  """``buffer`` with ``value`` in slot ``item`` where ``where`` (else unchanged)."""
  return buffer.at[item].set(jnp.where(where, value, buffer[item]))


def _up_pairs(S: int, v: int) -> list[tuple[int, int]]:
  """The forward's sends: up the stages, and round the ring (device ``S - 1``'s chunk
  ``c`` feeds device 0's chunk ``c + 1``) when interleaved."""
  return [(i, (i + 1) % S) for i in (range(S) if v > 1 else range(S - 1))]


def _down_pairs(S: int, v: int) -> list[tuple[int, int]]:
  return [(b, a) for a, b in _up_pairs(S, v)]


def _arrival(run: _PipelineRun, row: jax.Array, slot_of: jax.Array, kind: int,
             slot: int) -> tuple[jax.Array, jax.Array]:
  """``(item, came)``: the slot of the item that a ``kind`` op's output (FWD: from
  the device below, BWD: from the one above) sent at the end of tick ``row`` lands in
  on this device, and whether one came."""
  pipe, S = run.pipeline, run.S
  v = pipe.virtual_stages
  stage = run.stage()
  if kind == FWD:
    prev = (stage - 1) % S
    op, m, chunk = row[prev, slot, 0], row[prev, slot, 1], row[prev, slot, 2]
    came = (op == FWD) & ~((prev == S - 1) & (chunk == v - 1))
    if v == 1:
      came = came & (stage > 0)
    return slot_of[stage, jnp.minimum(chunk + (stage == 0), v - 1), m], came
  nxt = (stage + 1) % S
  op, m, chunk = row[nxt, slot, 0], row[nxt, slot, 1], row[nxt, slot, 2]
  came = (op == BWD) & ~((nxt == 0) & (chunk == 0))
  if v == 1:
    came = came & (stage < S - 1)
  return slot_of[stage, jnp.maximum(chunk - (stage == S - 1), 0), m], came


_READS = {FWD: ("inbox",), BWD: ("kept", "ct"), WGT: ("kept", "cts")}
_WRITES = {FWD: ("kept", "ct"), BWD: ("cts",), WGT: ()}
"""The item slots of `_ticked`'s buffers each op reads and writes: ``inbox``
(its input), ``kept`` (its layers' residuals), ``ct`` (its output's cotangent) and
``cts`` (ZB-H1: each weight product's output cotangent, from ``B`` to ``W``; 1F1B
has no such buffer, and its ``B`` writes nothing)."""


def _needs(kinds: Sequence[int], table: dict[int, tuple[str, ...]]) -> list[str]:
  names = {name for kind in kinds for name in table.get(kind, ())}
  return sorted(names)


def _op_idle(ops: _Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    return _op_out(ops, writes)
  return run


def _op_forward(ops: _Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    y, kept, dy, d_rest, loss, count = ops.forward(m, chunk, c["inbox"])
    last = ops.run.last(chunk)
    return _op_out(ops, writes, y=jnp.where(last, jnp.zeros_like(y), y),
                   writes={"kept": (True, kept), "ct": (last, dy)},
                   d_rest=d_rest, loss=loss, count=count)
  return run


def _op_backward(ops: _Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    dx, d_layers, cts, d_rest, d_states = ops.backward(m, chunk, c["ct"], c["kept"])
    return _op_out(ops, writes, dx=dx, d_layers=d_layers, d_rest=d_rest,
                   writes={"cts": (True, cts)} if ops.split else None,
                   d_states=d_states)
  return run


def _op_weights(ops: _Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    return _op_out(ops, writes, d_layers=ops.weights(m, chunk, c["kept"], c["cts"]))
  return run


_OP_BRANCHES = {IDLE: _op_idle, FWD: _op_forward, BWD: _op_backward, WGT: _op_weights}


def _op_out(ops: _Ticks, names: Sequence[str], *, y=None, dx=None, writes=None,
            d_layers=None, d_rest=None, loss=None, count=None, d_states=None
            ) -> dict:
  """One op's outputs, with zeros for what it does not produce, so that every branch
  of a slot's switch returns the same structure: ``writes`` maps each buffer of
  ``names`` (those the slot's ops write) to ``(where, value)``, written to the
  item's slot where ``where``."""
  act = jnp.zeros(ops.x_shape.shape, ops.x_shape.dtype)
  like = {"ct": act, "kept": ops.kept_zeros(),
          "cts": [jnp.zeros((ops.n,) + d.shape, d.dtype) for d in ops.cts_shapes]}
  given = writes or {}
  out = {} if ops.states is None else {"d_states": jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape[1:2] + s.shape[3:], s.dtype), ops.states)
                                       if d_states is None else d_states}
  return {**out,
      "y": act if y is None else y, "dx": act if dx is None else dx,
      "writes": {name: (jnp.asarray(given[name][0]), given[name][1]) if name in given
                 else (jnp.asarray(False), like[name]) for name in names},
      "d_layers": (jax.tree_util.tree_map(
          lambda x: jnp.zeros(x.shape[1:], jnp.float32), ops.layers)
                   if d_layers is None else d_layers),
      "d_rest": _float32_zeros(ops.rest) if d_rest is None else d_rest,
      "loss": ops.run.zero() if loss is None else loss,
      "count": ops.run.zero() if count is None else count}


# --------------------------------------------------------------------------- split
@dataclasses.dataclass(frozen=True)
class SplitPipeline(Pipeline):
  """An encoder-decoder model split over the stages (Megatron-LM's
  ``pipeline_model_parallel_split_rank``, as in T5): the first ``split`` stages run
  the stacked encoder layers, the others the stacked decoder layers, which also read
  the encoder's output::

    x = embed_fn(params, batch)                       # stage 0
    x = stage_fn(encoder_layer, x)                    # each encoder layer (stages < split)
    y = decoder_embed_fn(params, batch)               # stage split
    y = decoder_fn(decoder_layer, y, x)               # each decoder layer (stages >= split)
    loss = head_fn(params, y, batch)                  # last stage

  Each tick a stage sends the pair ``(x, y)`` up (the encoder stages' ``y`` is zeros;
  the decoder stages pass the encoder's ``x`` on unchanged, as Megatron sends the
  encoder's output along the decoder stages), with the GPipe schedule; autodiff
  runs it backward, so the gradient of the encoder's output sums over every decoder
  layer that read it.

  **Storage.** SPMD gives every device arrays of one shape, so both stacks are
  stored padded to one slice a stage (`to_device_order`): ``params[stages_key]``
  holds ``S x n_e`` encoder layers (``n_e = L_e / split``), the slices of stages
  ``>= split`` zeros, and ``params[decoder_key]`` ``S x n_d`` decoder layers
  (``n_d = L_d / (S - split)``), the slices of stages ``< split`` zeros. A device
  thus keeps one unused slice of the other stack (and its optimizer state): up to
  twice the layers' memory of Megatron's MPMD split, the price of one program. The
  padding gets zero gradients and stays zero under any optimizer whose update of a
  zero gradient is zero (SGD, Adam, CAME without weight decay on it...;
  decoupled weight decay keeps zeros at zero too). `to_model_order` drops it.

  Its attributes are `Pipeline`'s (``stage_fn`` is one encoder layer) and these.

  Attributes:
    decoder_embed_fn: ``(params, batch) -> y``, run on stage ``split``.
    decoder_fn: ``(layer_params, y, memory) -> y``, one decoder layer; ``memory`` is
      the encoder's output.
    split: the stages that run the encoder, ``1 <= split < S``.
    decoder_key: the key of ``params`` holding the stacked decoder layers.

  Only the GPipe schedule, without virtual stages or random keys, for now.
  """
  stages_key: str = "encoder"
  decoder_embed_fn: Optional[Callable] = None
  decoder_fn: Optional[Callable] = None
  split: Optional[int] = None
  decoder_key: str = "decoder"

  def __post_init__(self):
    super().__post_init__()
    for name in ("decoder_embed_fn", "decoder_fn"):
      validation.function(name, getattr(self, name))
    validation.positive_int("split", self.split)
    validation.positive_int("num_stages", self.num_stages)
    if self.split >= self.num_stages:
      raise validation.ArgumentError(
          ("split", "num_stages"), f"{{0}}={self.split} leaves the decoder no stage "
          f"of {{1}}={self.num_stages}: it must be below it")
    if self.schedule != "gpipe" or self.virtual_stages != 1:
      raise validation.ArgumentError(
          ("schedule", "virtual_stages"), "a SplitPipeline runs {0}='gpipe' with "
          f"{{1}}=1; got {self.schedule!r}, {self.virtual_stages}")
    if self.stages_key == self.decoder_key:
      raise validation.ArgumentError(("stages_key", "decoder_key"),
                                     "{0} and {1} must differ")

  def _stacks(self) -> tuple[tuple[str, int, int], ...]:
    """``(key, first stage, stages)`` of each stack."""
    S, k = self.num_stages, self.split
    return (self.stages_key, 0, k), (self.decoder_key, k, S - k)

  # ---- storage: each stack padded to a slice a stage
  def to_device_order(self, tree: Any) -> Any:
    """``tree`` (params, or a state holding params-shaped trees) with each stack's
    leaves padded with zeros to ``S`` slices, its own stages' slices in place (the
    class docstring)."""
    return self._stored(tree, pad=True)

  def to_model_order(self, tree: Any) -> Any:
    """The inverse of `to_device_order`: each stack's own slices only."""
    return self._stored(tree, pad=False)

  def _stored(self, tree: Any, pad: bool) -> Any:
    S = self.num_stages
    stacks = {jax.tree_util.DictKey(key): (first, count)
              for key, first, count in self._stacks()}

    def convert(path, x):
      key = next((k for k in path if k in stacks), None)
      if key is None or not np.ndim(x):
        return x
      first, count = stacks[key]
      if pad:
        n = np.shape(x)[0] // count
        widths = [(first * n, (S - first - count) * n)] + [(0, 0)] * (np.ndim(x) - 1)
        return jnp.pad(x, widths)
      n = np.shape(x)[0] // S
      return x[first * n:(first + count) * n]

    return jax.tree_util.tree_map_with_path(convert, tree)

  # ---- the unpipelined model
  def apply(self, params: Any, batch: Any, rng: Optional[jax.Array] = None) -> Any:
    """The whole model on one device, from stored (padded) ``params``."""
    if rng is not None:
      raise ValueError("rng: a SplitPipeline takes no random keys yet")
    params = self.to_model_order(params)
    x = self.embed_fn(params, batch)
    x = self._layers(params[self.stages_key], x)
    y = self.decoder_embed_fn(params, batch)
    y = _decoder_layers(self, params[self.decoder_key], y, x)
    return self.head_fn(params, y, batch)

  # ---- layout
  def _check_layers(self, params: Any, S: int) -> None:
    """`Pipeline.check`'s stacked layers, for two stacks: each stored stack splits
    into a slice a stage."""
    for key, _, _ in self._stacks():
      if not isinstance(params, dict) or key not in params:
        raise ValueError(f"params must be a dict with stacked layers under {key!r}")
      sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(params[key])}
      if len(sizes) != 1 or next(iter(sizes)) % S:
        raise ValueError(f"params[{key!r}]: every leaf needs the same leading (layer) "
                         f"axis, padded to a slice for each of the {S} stages "
                         f"(SplitPipeline.to_device_order); got {sorted(sizes)}")

  def param_specs(self, params: Any, specs: Any = None) -> Any:
    """PartitionSpecs: both stacks' leading axis over the stage axis."""
    if specs is None:
      specs = jax.tree_util.tree_map(lambda _: P(), params)
    out = dict(specs)
    for key, _, _ in self._stacks():
      out[key] = Pipeline.param_specs(dataclasses.replace(
          self, stages_key=key, decoder_key=key + "_"), {key: params[key]},
          {key: specs[key]})[key]
    return out

  # ---- gradients
  def _num_layers(self, params: Any) -> int:
    return 0  # no interleaving, no layer keys

  def _stack_keys(self) -> tuple[str, ...]:
    return (self.stages_key, self.decoder_key)

  def _executor(self) -> Callable[..., tuple[jax.Array, jax.Array, Any, Any]]:
    return _gpipe_split

  def value_and_grad(self, params: Any, batch: Any, **kwargs: Any) -> Gradients:
    """`Pipeline.value_and_grad` of the split model, from stored (padded)
    ``params``; its gradients are stored alike (zero on the padding)."""
    if kwargs.get("rng") is not None:
      raise ValueError("rng: a SplitPipeline takes no random keys yet")
    if kwargs.get("model_state") is not None:
      raise validation.fail("model_state", ": a SplitPipeline's layers take no state "
                            "yet (FP8 scaling state runs on a Pipeline)")
    return super().value_and_grad(params, batch, **kwargs)

  def residual_bytes(self, params: Any, batch: Any, **kwargs: Any) -> dict[str, int]:
    """Not reported for an encoder-decoder split: its GPipe loop is autodiff's."""
    raise TypeError("SplitPipeline.residual_bytes: an encoder-decoder split runs "
                    "GPipe through autodiff, whose residuals are not read back")


def _decoder_layers(pipe: SplitPipeline, layers: Any, y: jax.Array,
                    memory: jax.Array, gather: Optional[Callable] = None
                    ) -> jax.Array:
  """The stacked decoder layers in order, each reading ``memory``; ``gather`` as in
  `Pipeline._layers`."""
  layer = lambda p, h: pipe.decoder_fn(p, h, memory)  # noqa: E731
  body = jax.checkpoint(layer) if pipe.remat else layer
  if gather is not None:
    plain = body
    body = jax.checkpoint(lambda p, h: plain(gather(p), h),
                          policy=_gathers_recomputed(pipe.policy()))
  y, _ = lax.scan(lambda h, p: (body(p, h), None), y, layers)
  return y


def _gpipe_split(run: _PipelineRun, params: Any
                 ) -> tuple[jax.Array, jax.Array, Any, None]:
  """GPipe over a `SplitPipeline`: each tick stage ``s`` runs its encoder slice on
  ``x`` (``s < split``) or its decoder slice on ``y`` reading ``x``, and sends ``(x,
  y)`` up. Returns ``(loss sum, count sum, grads)`` of this device."""
  pipe, S, M = run.pipeline, run.S, run.M
  stage = run.stage()
  first = jax.tree_util.tree_map(lambda x: x[0], run.micro)
  cast = lambda p: run.gather_rest(run.params(p))  # noqa: E731
  x_shape = jax.eval_shape(lambda p, b: pipe.embed_fn(cast(p), b), params, first)
  y_shape = jax.eval_shape(lambda p, b: pipe.decoder_embed_fn(cast(p), b), params,
                           first)
  ring = [(i, i + 1) for i in range(S - 1)]
  embed = run.gathered(pipe.embed_fn)
  decoder_embed = run.gathered(pipe.decoder_embed_fn)
  head = run.gathered(run.head_terms)

  def objective(params):
    p = run.params(params)
    encoder, decoder = p[pipe.stages_key], p[pipe.decoder_key]

    def tick(carry, t):
      (x_in, y_in), loss, count = carry
      m = t - stage
      valid = (m >= 0) & (m < M)
      m = jnp.clip(m, 0, M - 1)
      mb = run.micro_batch(m)
      x = lax.cond(stage == 0,
                   lambda: embed(p, mb).astype(x_shape.dtype), lambda: x_in)
      y = lax.cond(stage == pipe.split,
                   lambda: decoder_embed(p, mb).astype(y_shape.dtype),
                   lambda: y_in)
      # A bubble's inputs are garbage: replace them before any arithmetic.
      x, y = jnp.where(valid, x, jnp.zeros_like(x)), jnp.where(valid, y,
                                                               jnp.zeros_like(y))
      x, y = lax.cond(
          stage < pipe.split,
          lambda: (pipe._layers(  # pylint: disable=protected-access
              encoder, x, gather=run.gather_layer(pipe.stages_key)), y),
          lambda: (x, _decoder_layers(pipe, decoder, y, x,
                                      run.gather_layer(pipe.decoder_key))))
      ends = valid & (stage == S - 1)
      l, c = lax.cond(ends, lambda: head(p, y, mb),
                      lambda: (run.zero(), run.zero()))
      sent = lax.ppermute((x, y), pipe.stage_axis, ring) if S > 1 else (x, y)
      return (sent, loss + l, count + c), None

    init = run.vary((jnp.full(x_shape.shape, _BUBBLE_FILL, x_shape.dtype),
                     jnp.full(y_shape.shape, _BUBBLE_FILL, y_shape.dtype)))
    (_, loss, count), _ = lax.scan(tick, (init, run.zero(), run.zero()),
                                   jnp.arange(M + S - 1))
    return run.scale * loss, (loss, count)

  grads, (loss, count) = jax.grad(objective, has_aux=True)(params)
  return loss, count, grads, None
