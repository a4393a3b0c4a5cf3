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
reduce-scattered back there in the masters' dtype (`StageFSDP`,
`mpscale.parallel.gather_cast`), so a device never holds a whole stage's parameters.

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
         (`mpscale.parallel.pipeline`: the warm-up ticks run F only, the cool-down
         ticks B only, each phase its own scan, so a step costs GPipe's (v M + S - 1)
         (F + B); a stage keeps at most 2 S - 1 micro-batches' residuals, (v + 1) S
         - 1 interleaved, whatever M. ``recompute`` chooses what a layer keeps.)

  zb_h1: one op a tick (F, B or W), from chunk_table("zb_h1", S, M):
           B: dx, dp = the pullbacks with each weight product's weight held fixed
              (`mpscale.parallel.pipeline`); cts[k] = those products' output
              cotangents; grads += dp; send dx down
           W: grads += each weight product's transpose, from its input (kept[k])
              and cts[k]
         (Qi et al.'s ZB-H1; one chunk per stage: S - s warm-up forwards, then B,
         F and the W of s micro-batches back; the deferred W's fill 1F1B's
         cool-down.)

The bubble fraction is (S - 1) / (v M + S - 1) for GPipe and 1F1B, and (S - 1) /
(3 M + S - 1) for ZB-H1, each of whose ticks is one of F, B and W: with the three
taken as equal, a 1F1B forward is one of them and its backward two, and the
fractions compare as times (`mpscale.parallel.pipeline.pipeline_bubble_fraction`).
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
    per_device: params cast varying (FSDP's leaves stay shards: StageFSDP); the rows
      cut into M micro-batches; run = PipelineRun(sizes, this device's inputs)
      loss, count, grads = gpipe(run, params) or ticked(run, params)
      grads: summed where invariant (sum_invariant)
  gpipe: jax.grad of objective, a lax.scan of tick(carry, t) over v * M + S - 1
  1f1b, zb_h1: ticked(run, params), a lax.scan a phase of the table, carry holding
         inbox, kept, ct (and cts) in K item slots (item_slots) and the gradient sums;
         the ops are Ticks.forward, .backward and .weights

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
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mpscale import _tree
from mpscale import keys as keys_lib
from mpscale import validation
from mpscale.gradients import Gradients, check_grad_reduce_dtype
from mpscale.parallel import _fsdp as fsdp_lib
from mpscale.parallel import _layouts as layouts_lib
from mpscale.parallel import _mesh as mesh_lib
from mpscale.parallel.pipeline import _gpipe as gpipe_lib
from mpscale.parallel.pipeline import _run as run_lib
from mpscale.parallel.pipeline import _ticked as ticked_lib
from mpscale.parallel.pipeline._schedules import (SCHEDULES, check_schedule, chunk_table,
                                                  item_slots, pipeline_bubble_fraction,
                                                  pipeline_schedule_table)

LAYER_ORDERS = ("model", "device")
"""How a pipeline's stacked layers may be stored (`Pipeline`'s ``layer_order``)."""


# --------------------------------------------------------------------------- groups
def stage_norm_groups(num_stages: int, stages_key: str = "stages", *,
                 virtual_stages: int = 1, layer_order: str = "model") -> Callable:
  """NormGroups with one entry per pipeline stage (mindformers' ``local_norm``).

  The stacked layers under ``stages_key`` are split into ``num_stages x
  virtual_stages`` equal groups, named by the (virtual) stage that runs them:
  ``stage_0 ... stage_{S v - 1}``, ``stage_i`` holding model layers ``[i n, (i + 1)
  n)``; every other top-level key is its own group. With ``layer_order="device"``
  the layers are stored as `Pipeline.to_device_order` puts them, and the names follow
  them there. Pass it as ``groups=`` to a loss-scale wrapper or
  `mpscale.global_norm_clip`.
  """
  validation.one_of("layer_order", layer_order, LAYER_ORDERS)
  S, v = num_stages, virtual_stages
  if layer_order == "model":
    names = tuple(f"stage_{i}" for i in range(S * v))
  else:  # position s v + c holds virtual stage c S + s
    names = tuple(f"stage_{(p % v) * S + p // v}" for p in range(S * v))

  def groups(path):
    top = _tree.path_str(path[:1]) if path else "params"
    return names if top == stages_key else top

  return groups


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
      backward (`pipeline_schedules` bounds how many). The `SAVED_NAMES` keep
      what ``stage_fn`` names with ``jax.ad_checkpoint.checkpoint_name``.
    merge_state: how the updates of a layer state (`value_and_grad`'s
      ``model_state``) from several micro-batches and data replicas combine into
      one: ``merge_state(updates) -> state``, ``updates`` the state's tree with a
      leading axis of updates (FP8 scaling state:
      ``functools.partial(mpscale.precision.merge_stacked, recipe=recipe)``); ``None``:
      the pipeline takes no model state.
    recompute_layers: how many layers of each stage (each chunk with
      ``virtual_stages``) run under ``recompute``, the first ones; the rest keep
      every residual (Megatron-LM's ``recompute_num_layers``, its ``block``
      method); ``None``: all of them. GPipe only (1F1B and ZB-H1 keep one layout of
      residuals for every layer); `apply`, the model on one device, recomputes the
      first ``recompute_layers`` of all its layers.
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
  recompute_layers: Optional[int] = None

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
    # recompute a RECOMPUTE name or a policy, and remat beside it
    run_lib.check_recompute_layers(self.recompute_layers, self.policy())
    if self.recompute_layers is not None and self.schedule != "gpipe":
      raise validation.ArgumentError(
          ("recompute_layers", "schedule"), f"{{0}}: {{1}}={self.schedule!r} "
          "keeps one layout of residuals for every layer, so it recomputes all of "
          "a stage's layers or none: leave {0} unset or use {1}='gpipe'")
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
    return run_lib.interleave_order(num_layers, self.num_stages, self.virtual_stages)

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
    order = run_lib.interleave_order(num_layers, self.num_stages, self.virtual_stages)
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
    return run_lib.recompute_policy(self.recompute, self.remat)

  def layer(self, key: Optional[jax.Array] = None, stateful: bool = False
           ) -> Callable:
    """One layer, ``(layer_params, x) -> x``, under `policy`; with ``key`` (raw key
    data) it draws from that key; ``stateful``: ``((layer_params, layer_state), x)
    -> x``, the state passed to ``stage_fn`` as ``state=``."""
    return run_lib.under(self.policy(), self.plain_layer(key, stateful))

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
    ``gather``: each layer's parameters gathered where it runs (`StageFSDP.layer`),
    recomputed in the backward rather than kept, or ``None``; ``states``: each
    layer's state (stacked alike), or ``None``."""
    stateful = states is not None

    def layer_of(recomputed):
      policy = self.policy() if recomputed else None

      def body(h, xs):
        p, key, s = xs
        p = (p, s) if stateful else p
        layer = run_lib.under(policy, self.plain_layer(key, stateful))
        if gather is None:
          return layer(p, h), None
        at = (lambda ps: (gather(ps[0]), ps[1])) if stateful else gather
        fn = lambda p, h: layer(at(p), h)  # noqa: E731
        return jax.checkpoint(fn, policy=run_lib.gathers_recomputed(policy))(p, h), None
      return body
    x, _ = run_lib.scan_layers(layer_of, x, (layer_params, keys, states),
                               self.recompute_layers)
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
    """``(embed key, keys of layers, head key)`` of one micro-batch's key ``rng``
    (`mpscale.keys`: the embedding folds in 0, layer ``l`` ``1 + l``, the head
    ``1 + num_layers``)."""
    return run_lib.layer_keys(rng, layers, num_layers)

  # ---- layout
  def check(self, params: Any, mesh: Mesh, data_axis: Any = "data", batch: Any = None
           ) -> None:
    """Raises ``ValueError`` naming the problem for a layout that cannot pipeline.

    ``data_axis`` (the mesh's data-parallel axis or axes, `mpscale.parallel.data_axes`)
    is read only with a ``batch``, whose rows must divide into the data replicas'
    micro-batches (`mpscale.parallel.batch_rows`).
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
      data_size = layouts_lib.axis_size(
          mesh, mesh_lib.data_axes(mesh, data_axis))
      mesh_lib.batch_rows(batch, data_size, self.num_microbatches, pipelined=True)

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
    run_lib.check_recompute_layers(self.recompute_layers, self.policy(),
                                   num_layers // (S * v))
    check_schedule(self.schedule, S, self.num_microbatches, v)

  def param_specs(self, params: Any, specs: Any = None) -> Any:
    """PartitionSpecs: the stacked layers' leading axis over the stage axis, on top of
    ``specs`` (a pytree of specs like ``params``; default replicated)."""
    if specs is None:
      specs = jax.tree_util.tree_map(lambda _: P(), params)

    def staged(spec, leaf):
      entries = layouts_lib.pad(spec, np.ndim(leaf))
      if entries and entries[0] in (None, self.stage_axis):
        entries[0] = self.stage_axis
      else:
        raise ValueError(f"params[{self.stages_key!r}]: the layer axis of every leaf "
                         f"is split over {self.stage_axis!r}; got the spec {spec}")
      return layouts_lib.make_spec(entries)

    return {k: jax.tree_util.tree_map(staged, specs[k], v, is_leaf=layouts_lib.is_spec)
            if k == self.stages_key else specs[k] for k, v in params.items()}

  def shard_params(self, params: Any, mesh: Mesh) -> Any:
    """``params`` placed on ``mesh`` with `param_specs`."""
    return jax.device_put(
        params, layouts_lib.shardings(mesh, self.param_specs(params)))

  def bubble(self, num_stages: int) -> float:
    """The bubble fraction of this pipeline's schedule on ``num_stages`` stages."""
    return pipeline_bubble_fraction(pipeline_schedule_table(self.schedule, num_stages,
                                          self.num_microbatches, self.virtual_stages))

  # ---- gradients
  def _num_layers(self, params: Any) -> int:
    return jax.tree_util.tree_leaves(params[self.stages_key])[0].shape[0]

  def _stack_keys(self) -> tuple[str, ...]:
    """The keys of ``params`` holding stacked layers."""
    return (self.stages_key,)

  def _executor(self) -> Callable[..., tuple[jax.Array, jax.Array, Any, Any]]:
    return gpipe_lib.gpipe if self.schedule == "gpipe" else ticked_lib.ticked  # 1f1b or zb_h1

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
        cotangent is its update: FP8 products' scaling state (`mpscale.precision`, an
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
    self.check(params, mesh, data_axis, batch)
    spec = self._spec(params, mesh, data_axis, per_token_loss, cast, param_specs,
                      grad_reduce_dtype)
    return self._run(self._executor(), spec, params, batch, loss_scale, rng,
                     model_state)

  def residual_bytes(self, params: Any, batch: Any, *, mesh: Mesh,
                     data_axis: Any = "data", per_token_loss: bool = False,
                     cast: Callable[[Any], Any] = lambda p: p, param_specs: Any = None,
                     grad_reduce_dtype: Any = None, **kwargs: Any) -> dict[str, int]:
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
      ops = ticked_lib.Ticks(run, params)
      v = self.virtual_stages
      if self.schedule == "gpipe":
        items = v * run.M + run.S - 1
      else:
        items = item_slots(chunk_table(self.schedule, run.S, run.M, v), v, run.M)[1]
      layer = sum(x.size * x.dtype.itemsize for x in ops.kept_shapes + ops.cts_shapes)
      report.update(layer=int(layer), items=int(items), layers=ops.n,
                    total=int(layer) * int(items) * ops.n)
      # Shapes alone: the step itself is not traced again.
      return run.zero(), run.zero(), run.vary(run_lib.float32_zeros(params)), None

    self.check(params, mesh, data_axis, batch)
    spec = self._spec(params, mesh, data_axis, per_token_loss, cast, param_specs,
                      grad_reduce_dtype)
    jax.eval_shape(lambda p, b: self._run(
        executor, spec, p, b, kwargs.get("loss_scale", 1.0), kwargs.get("rng"),
        kwargs.get("model_state")), params, batch)
    return report

  # ---- one pipelined gradient: the spec, the inputs laid out, the shard_map
  def _spec(self, params: Any, mesh: Mesh, data_axis: Any, per_token_loss: bool,
            cast: Callable[[Any], Any], param_specs: Any, grad_reduce_dtype: Any
           ) -> run_lib.RunSpec:
    """`value_and_grad`'s layout arguments, checked and resolved (`RunSpec`)."""
    data_axes = mesh_lib.data_axes(mesh, data_axis)
    axes = data_axes + (self.stage_axis,)
    specs = self.param_specs(params, param_specs)
    S = mesh.shape[self.stage_axis]
    num_layers = self._num_layers(params)
    return run_lib.RunSpec(
        mesh=mesh, data_axes=data_axes, stage_axis=self.stage_axis,
        per_token_loss=per_token_loss, cast=cast,
        param_specs=jax.tree_util.tree_map(
            lambda spec: layouts_lib.only_axes(spec, axes), specs,
            is_leaf=layouts_lib.is_spec),
        num_layers=num_layers, num_microbatches=self.num_microbatches,
        interleave=run_lib.interleave_order(num_layers, S, self.virtual_stages),
        cast_each_tick=check_grad_reduce_dtype(grad_reduce_dtype) is not None)

  def _run(self, executor: Callable, spec: run_lib.RunSpec, params: Any, batch: Any,
           loss_scale: Any, rng: Optional[jax.Array], model_state: Any) -> Any:
    """`value_and_grad` with ``executor(run, params) -> (loss, count, grads,
    state updates)``, each device's part in a ``shard_map`` (`_per_device`)."""
    stateful = model_state is not None
    if stateful:
      self.check_model_state(model_state, params)
    keys = self._micro_keys(spec, rng)
    copies = self._state_copies(spec, model_state)
    batch_spec = mesh_lib.batch_sharding(spec.mesh, spec.data_axes).spec
    state_specs = jax.tree_util.tree_map(
        lambda _: P(self.stage_axis, spec.data_axes or None), copies)
    fn = jax.shard_map(
        self._per_device(executor, spec), mesh=spec.mesh,
        in_specs=(spec.param_specs,
                  jax.tree_util.tree_map(lambda _: batch_spec, batch), P(),
                  None if keys is None else (P(), P(self.stage_axis)), state_specs),
        out_specs=(spec.param_specs, P(), P(), state_specs),
        axis_names=set(spec.axes))
    # Stored in model order with virtual stages, device s must hold its chunks s,
    # s + S, ...: one all-to-all of the layers each way.
    permute = spec.interleave is not None and self.layer_order == "model"
    if permute:
      params = {**params, self.stages_key: _reordered(params[self.stages_key],
                                                      spec.interleave)}
      copies = _reordered(copies, spec.interleave)
    grads, loss, count, updates = fn(
        params, batch, jnp.asarray(loss_scale, jnp.float32), keys, copies)
    if permute:
      back = np.argsort(spec.interleave)
      grads = {**grads, self.stages_key: _reordered(grads[self.stages_key], back)}
      updates = _reordered(updates, back)
    if not stateful:
      return Gradients(grads, loss, count)
    # The copies' updates, merged per layer: [D * M, layers, ...] -> [layers, ...].
    new_state = self.merge_state(jax.tree_util.tree_map(
        lambda u: jnp.swapaxes(u, 0, 1), updates))
    return Gradients(grads, loss, count), new_state

  def _micro_keys(self, spec: run_lib.RunSpec, rng: Optional[jax.Array]) -> Any:
    """``(raw micro-batch keys, each layer's index laid out like the layers)``, or
    ``None`` without ``rng``."""
    if rng is None:
      return None
    layer_ids = jnp.arange(spec.num_layers)
    if spec.interleave is not None:
      layer_ids = layer_ids[spec.interleave]
    micro_keys = jax.vmap(lambda m: keys_lib.microbatch_key(rng, m))(jnp.arange(spec.M))
    return jax.random.key_data(micro_keys), layer_ids

  @staticmethod
  def _state_copies(spec: run_lib.RunSpec, model_state: Any) -> Any:
    """One copy of the layers' state per (replica, micro-batch): ``[layers, D * M,
    ...]``, the layers over the stages and the copies over the data axes."""
    if model_state is None:
      return None
    copies = spec.D * spec.M
    return jax.tree_util.tree_map(
        lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], copies) + x.shape[1:]),
        model_state)

  def _per_device(self, executor: Callable, spec: run_lib.RunSpec) -> Callable:
    """One device's part: its inputs cast varying over the manual axes, the
    ``executor``'s sums, reduced over the axes and divided into means."""
    axes, M, D = spec.axes, spec.M, spec.D

    def per_device(params, batch, scale, keys, states):
      # Everything in the loop varies over every manual axis, so autodiff puts no
      # psum in it. FSDP's split leaves stay shards: gathered where used (StageFSDP).
      # A state's copies are this device's layers x its M micro-batches already.
      varying = mesh_lib.cast_varying(params, axes)
      fsdp = fsdp_lib.StageFSDP.of(varying, spec.param_specs, spec.data_axes,
                                   spec.cast, self._stack_keys())
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), batch)
      if keys is not None:
        keys = mesh_lib.cast_varying(
            run_lib.replica_keys(keys, spec.data_axes, D), axes)
      run = run_lib.PipelineRun(
          self, spec, mesh_lib.cast_varying(micro, axes),
          mesh_lib.cast_varying(scale, axes), keys, fsdp, states)
      loss, count, grads, updates = executor(run, varying)
      grads = run_lib.sum_invariant(grads, axes, params)
      loss, count = lax.psum(loss, axes), lax.psum(count, axes)
      if spec.per_token_loss:
        denom = count
      else:
        denom = jnp.asarray(M * D, jnp.float32)
        count = jnp.asarray(M * D, jnp.float32)
      grads = jax.tree_util.tree_map(lambda g: g / denom.astype(g.dtype), grads)
      return grads, loss / denom, count, updates

    return per_device

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


def _reordered(tree: Any, order: np.ndarray) -> Any:
  """Every leaf of ``tree`` with its leading (layer) axis in ``order``."""
  return jax.tree_util.tree_map(lambda x: x[order], tree)
