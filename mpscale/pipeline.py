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
over a data axis (FSDP) is all-gathered whole when the step starts and its gradient
reduce-scattered back when it ends (``lax.all_gather`` / ``lax.psum_scatter``).

Schedules, per data replica (S stages, M micro-batches, v virtual stages)::

  gpipe: for t in range(v * M + S - 1):       # forward; autodiff runs it backward
           i = t - s                          # stage s's work item, if 0 <= i < v * M
           c = i % (S * v) // S               # its chunk: virtual stage c * S + s
           m = i // (S * v) * S + i % S       # its micro-batch
           x = embed(m) if s == 0 and c == 0 else what stage s - 1 (mod S) sent
           y = layers of chunk c (x); head(y) if s == S - 1 and c == v - 1
           send y to stage s + 1 (mod S)      # one ppermute per tick

  1f1b:  for t, row in enumerate(_schedule("1f1b", S, M, v)):
           op, m, c = row[s]                  # F, B of chunk c of micro-batch m, or idle
           k = slots[s, c, m]                 # its buffer slot (_slots)
           F: x = embed(m) if (s, c) == (0, 0) else inbox_f[k]; saved[k] = x
              send chunk c's layers (x) up    # the last virtual stage sends nothing
           B: dp, dx = vjp(chunk c [+ head if last], saved[k], inbox_b[k])
              grads += dp; send dx down       # and into embed after virtual stage 0
         (Megatron's order, `_device_ops`: (S - 1 - s) * 2 + (v - 1) * S warm-up
         forwards, S - 1 - s without virtual stages, then one forward and one backward
         alternately, then the remaining backwards. B recomputes the chunk from its
         saved input, so the inputs alive per device stay within the warm-up plus one,
         at most (v + 1) S - 1 (S for v = 1) whatever M, while GPipe keeps v M.)

  zb_h1: the 1f1b loop over _schedule("zb_h1", S, M), the backward split in two
         (Qi et al.'s zero-bubble ZB-H1; one chunk per stage):
           B: dx = vjp_x(stage [+ head if last], saved[k], inbox_b[k]); send dx down
           W: grads += vjp_p(the same, saved[k], inbox_b[k])  # [+ embed on the first]
         (S - s warm-up forwards, then B, F and the W of s micro-batches back; the
         deferred W's fill the cool-down where 1F1B waits: a bubble of (S - 1) op
         times a stage against 1F1B's 3 (S - 1), at the same S inputs alive. Each of
         B and W recomputes the stage from its saved input: one forward more than
         1F1B per micro-batch, the price of the split without keeping residuals.)

The bubble fraction is (S - 1) / (v M + S - 1) for GPipe and 1F1B, and (S - 1) /
(3 M + S - 1) for ZB-H1, each of whose ticks is one of F, B and W: with the three
taken as equal, a 1F1B forward tick is one of them and its backward tick two, and
the fractions compare as times. With ``v > 1`` (Megatron's
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

The code reads the same way::

  Pipeline.value_and_grad -> shard_map(per_device), manual over data axes and stage
    per_device: params cast varying, FSDP leaves all-gathered (gather_split); the
      rows cut into M micro-batches; run = _PipelineRun(sizes, this device's inputs)
      loss, count, grads = _gpipe(run, params) or _one_f_one_b(run, params)
      grads: reduce-scattered (scatter_split), summed where invariant (_sum_invariant)
  gpipe: jax.grad of objective, a lax.scan of tick(carry, t) over v * M + S - 1
  1f1b:  lax.scan(run.tick, carry, _schedule("1f1b", S, M, v)), carry holding
         saved, inbox_f, inbox_b (K slots each, _slots) and the sums
         F(m, c) = run.forward (run.embed, run.stage_layers of chunk c)
         B(m, c) = run.backward (vjp of run.stage_and_head on the last virtual stage,
                   else of run.stage_layers; then of run.embed on the first)

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
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mpscale import keys as keys_lib
from mpscale import norms as norms_lib
from mpscale import sharding as sharding_lib
from mpscale import validation
from mpscale.gradients import Gradients, check_grad_reduce_dtype

SCHEDULES = ("gpipe", "1f1b", "zb_h1")
LAYER_ORDERS = ("model", "device")
IDLE, FWD, BWD, WGT = 0, 1, 2, 3
"""The ops of a schedule table; ``WGT`` (the weight gradient, split from ``BWD``) only
in ``zb_h1``'s."""
_BUBBLE_FILL = 0.0
"""What the activation buffers hold before any stage wrote them: what a bubble tick
would compute on. Tests set it to NaN to show that nothing from a bubble reaches a
gradient."""


# --------------------------------------------------------------------------- schedules
def schedule_table(schedule: str, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> np.ndarray:
  """The op each stage runs at each tick, as an int array ``[ticks, stages, 2]``.

  ``table[t, s] = (op, m)`` with ``op`` one of ``IDLE``, ``FWD``, ``BWD`` and ``m`` the
  micro-batch. Built by running every stage's op list in lock step: an op starts when its
  input arrived at an earlier tick (``ppermute`` takes one tick). With
  ``virtual_stages=v`` a tick runs one of a device's ``v`` layer chunks
  (`schedule_chunks` says which): GPipe's forward takes ``v M + S - 1`` ticks and its
  backward mirrors it; interleaved 1F1B runs Megatron's order (`_device_ops`).
  """
  return _schedule(schedule, num_stages, num_microbatches, virtual_stages)[..., :2]


def schedule_chunks(schedule: str, num_stages: int, num_microbatches: int,
                    virtual_stages: int = 1) -> np.ndarray:
  """The layer chunk of each op of `schedule_table`, ``[ticks, stages]`` (0 for an
  idle tick, and always 0 without virtual stages): stage ``s``'s chunk ``c`` is
  virtual stage ``c S + s``."""
  return _schedule(schedule, num_stages, num_microbatches, virtual_stages)[..., 2]


def _device_ops(schedule: str, S: int, M: int, v: int, s: int
               ) -> list[tuple[int, int, int]]:
  """Device ``s``'s ops in order, ``(op, m, chunk)``.

  1F1B (Megatron-LM's ``forward_backward_pipelining_with_interleaving`` order; with
  ``v = 1`` PipeDream-flush): forward item ``k`` is chunk ``k % (S v) // S`` of
  micro-batch ``k // (S v) * S + k % S``, backward item ``k`` the same micro-batch in
  the reverse chunk ``v - 1 - k % (S v) // S``. ``(S - 1 - s) * 2 + (v - 1) * S``
  warm-up forwards (``S - 1 - s`` without virtual stages), then one forward and one
  backward alternately, then the remaining backwards.
  """
  total = v * M

  def item(k, backward):
    chunk = k % (S * v) // S
    return k // (S * v) * S + k % S, (v - 1 - chunk) if backward else chunk

  if schedule == "gpipe":
    fwd = [(FWD, *item(k, False)) for k in range(total)]
    return fwd + [(BWD, m, c) for _, m, c in reversed(fwd)]
  if schedule == "zb_h1":
    return _zb_h1_ops(S, M, s)
  warmup = min((S - 1 - s) * 2 + (v - 1) * S if v > 1 else S - 1 - s, total)
  ops = [(FWD, *item(k, False)) for k in range(warmup)]
  f, b = warmup, 0
  while f < total:
    ops += [(FWD, *item(f, False)), (BWD, *item(b, True))]
    f, b = f + 1, b + 1
  return ops + [(BWD, *item(k, True)) for k in range(b, total)]


def _zb_h1_ops(S: int, M: int, s: int) -> list[tuple[int, int, int]]:
  """Stage ``s``'s ops in ZB-H1 (Qi et al., 2023): the backward split into ``B``
  (input gradient, on the critical path) and ``W`` (weight gradient, anywhere after
  ``B``). ``S - s`` warm-up forwards, one more than 1F1B's; then ``B``, a ``W``
  once ``s`` of them wait, and ``F``, repeated; the remaining ``B``s and the
  deferred ``W``s fill what is 1F1B's cool-down bubble. At most ``S`` inputs are
  alive per stage (1F1B's peak), and with ``F``, ``B`` and ``W`` of one time unit
  each the bubble is ``S - 1`` units a stage against 1F1B's ``3 (S - 1)``."""
  warmup = min(S - s, M)
  ops = [(FWD, m, 0) for m in range(warmup)]
  f, b, w = warmup, 0, 0

  def backward():
    nonlocal b, w
    ops.append((BWD, b, 0))
    b += 1
    if b - w > s:
      ops.append((WGT, w, 0))
      w += 1

  while f < M:
    backward()
    ops.append((FWD, f, 0))
    f += 1
  while b < M:
    backward()
  return ops + [(WGT, m, 0) for m in range(w, M)]


@functools.lru_cache(maxsize=64)
def _schedule(schedule: str, num_stages: int, num_microbatches: int,
              virtual_stages: int = 1) -> np.ndarray:
  """`schedule_table` with each op's chunk: ``[ticks, stages, 3]`` of ``(op, m,
  chunk)`` (read-only; cached)."""
  validation.one_of("schedule", schedule, SCHEDULES)
  S, M, v = num_stages, num_microbatches, virtual_stages
  if v > 1 and schedule == "zb_h1":
    raise ValueError("the zb_h1 schedule runs one layer chunk per stage "
                     f"(virtual_stages=1); got virtual_stages={v}")
  if v > 1 and M % S:
    raise ValueError(f"virtual_stages={v} needs num_microbatches ({M}) divisible by "
                     f"the {S} stages")
  if schedule == "gpipe" and v > 1:
    # Every stage forwards its items back to back (each waits for the stage before);
    # the backward mirrors the forward.
    forward = []
    for t in range(v * M + S - 1):
      row = []
      for s in range(S):
        k = t - s
        chunk = k % (S * v) // S
        m = k // (S * v) * S + k % S
        row.append((FWD, m, chunk) if 0 <= k < v * M else (IDLE, 0, 0))
      forward.append(row)
    backward = [[(BWD, m, c) if op == FWD else (IDLE, 0, 0) for op, m, c in row]
                for row in forward[::-1]]
    table = np.asarray(forward + backward, np.int32)
    table.flags.writeable = False
    return table
  order = [_device_ops(schedule, S, M, v, s) for s in range(S)]
  last = S * v - 1
  done: dict[tuple[int, int, int], int] = {}   # (op, virtual stage, m) -> tick
  pos, rows, t = [0] * S, [], 0
  while any(p < len(ops) for p, ops in zip(pos, order)):
    row = []
    for s in range(S):
      if pos[s] == len(order[s]):
        row.append((IDLE, 0, 0))
        continue
      op, m, c = order[s][pos[s]]
      vs = c * S + s
      if op == FWD:
        ready = vs == 0 or done.get((FWD, vs - 1, m), t) < t
      elif op == WGT:
        ready = done.get((BWD, vs, m), t) < t
      else:
        ready = done.get((BWD, vs + 1, m) if vs < last else (FWD, vs, m), t) < t
      row.append((op, m, c) if ready else (IDLE, 0, 0))
    for s, (op, m, c) in enumerate(row):
      if op != IDLE:
        done[(op, c * S + s, m)] = t
        pos[s] += 1
    rows.append(row)
    t += 1
  table = np.asarray(rows, np.int32)
  table.flags.writeable = False
  return table


def bubble_fraction(table: np.ndarray) -> float:
  """Share of (tick, stage) slots that run no op."""
  return float(np.mean(table[..., 0] == IDLE))


def _live_slots(table: np.ndarray) -> int:
  """Most micro-batches whose stage input must be kept at once, over stages and ticks:
  from its forward to its backward (to its weight gradient, with ``WGT`` ops)."""
  S = table.shape[1]
  frees = WGT if (table[..., 0] == WGT).any() else BWD
  most = 1
  for s in range(S):
    live = 0
    for op, _ in table[:, s]:
      live += 1 if op == FWD else -1 if op == frees else 0
      most = max(most, live)
  return most


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
    remat: recompute each stage's activations in the backward pass (GPipe; 1F1B always
      recomputes a stage from its saved input).
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

  def __post_init__(self):
    for name in ("embed_fn", "stage_fn", "head_fn"):
      validation.function(name, getattr(self, name))
    validation.positive_int("num_microbatches", self.num_microbatches)
    validation.positive_int("virtual_stages", self.virtual_stages)
    validation.one_of("schedule", self.schedule, SCHEDULES)
    validation.boolean("remat", self.remat)
    validation.one_of("layer_order", self.layer_order, LAYER_ORDERS)
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
  def _layers(self, layer_params: Any, x: jax.Array,
              keys: Optional[jax.Array] = None) -> jax.Array:
    """The stacked layers in order; ``keys``: one raw key per layer, or ``None``."""
    if keys is None:
      body = jax.checkpoint(self.stage_fn) if self.remat else self.stage_fn
      x, _ = lax.scan(lambda h, p: (body(p, h), None), x, layer_params)
      return x
    layer = lambda p, h, k: self.stage_fn(  # noqa: E731
        p, h, rng=jax.random.wrap_key_data(k))
    body = jax.checkpoint(layer) if self.remat else layer
    x, _ = lax.scan(lambda h, pk: (body(pk[0], h, pk[1]), None), x,
                    (layer_params, keys))
    return x

  def apply(self, params: Any, batch: Any, rng: Optional[jax.Array] = None) -> Any:
    """The whole model on one device: ``head_fn(embed_fn -> all layers)``.

    With ``rng`` (a key) each function is called with ``rng=`` as well: ``embed_fn``
    with ``fold_in(rng, 0)``, layer ``l`` with ``fold_in(rng, 1 + l)`` and ``head_fn``
    with ``fold_in(rng, 1 + num_layers)`` (`Pipeline.keys`), so a layer draws the same
    masks on whichever stage it runs. ``params`` are stored in ``layer_order``.
    """
    if self.layer_order == "device":
      params = self.to_model_order(params)
    if rng is None:
      x = self.embed_fn(params, batch)
      x = self._layers(params[self.stages_key], x)
      return self.head_fn(params, x, batch)
    num_layers = jax.tree_util.tree_leaves(params[self.stages_key])[0].shape[0]
    embed_key, layer_keys, head_key = self.keys(rng, jnp.arange(num_layers),
                                                num_layers)
    x = self.embed_fn(params, batch, rng=embed_key)
    x = self._layers(params[self.stages_key], x, jax.random.key_data(layer_keys))
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
    if v > 1 and self.num_microbatches % S:
      raise ValueError(f"virtual_stages={v} needs num_microbatches "
                       f"({self.num_microbatches}) divisible by the {S} stages")

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

  def _executor(self) -> Callable[..., tuple[jax.Array, jax.Array, Any]]:
    return _gpipe if self.schedule == "gpipe" else _one_f_one_b  # or zb_h1

  def value_and_grad(self, params: Any, batch: Any, *, mesh: Mesh,
                     data_axis: Any = "data", loss_scale: Any = 1.0,
                     per_token_loss: bool = False,
                     cast: Callable[[Any], Any] = lambda p: p,
                     param_specs: Any = None,
                     rng: Optional[jax.Array] = None,
                     grad_reduce_dtype: Any = None) -> Gradients:
    """Loss and gradients of ``loss_scale * loss``, pipelined over ``mesh``.

    ``shard_map`` is manual over the stage axis and the data axes that split no
    parameter; every other axis (``tensor``, ``fsdp``) stays automatic, so each stage's
    layers keep the tensor-parallel or FSDP layout of ``param_specs`` and GSPMD inserts
    their collectives inside the stage.

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

    Returns:
      `mpscale.gradients.Gradients` ``(grads, loss, num_tokens)``: the gradients of
      ``loss_scale * loss`` laid out like ``params``, the unscaled mean loss, and the
      token count (with ``per_token_loss``; else micro-batches x data replicas).
    """
    self.check(params, mesh, data_axis, batch)
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

    def per_device(params, batch, scale, keys):
      # Everything in the loop varies over every manual axis, so autodiff puts no
      # psum in it.
      varying = sharding_lib.gather_split(sharding_lib.cast_varying(params, axes),
                                          in_param_specs, data_axes)
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), batch)
      micro = sharding_lib.cast_varying(micro, axes)
      scale = sharding_lib.cast_varying(scale, axes)
      if keys is not None:
        keys = sharding_lib.cast_varying(_replica_keys(keys, data_axes, D), axes)
      run = _PipelineRun(self, S, M, per_token_loss, cast, axes, num_layers, micro,
                         scale, keys, float32_sums)
      loss, count, grads = self._executor()(run, varying)
      grads = sharding_lib.scatter_split(grads, in_param_specs, data_axes)
      grads = _sum_invariant(grads, axes, params)
      loss, count = lax.psum(loss, axes), lax.psum(count, axes)
      if per_token_loss:
        denom = count
      else:
        denom = jnp.asarray(M * D, jnp.float32)
        count = jnp.asarray(M * D, jnp.float32)
      grads = jax.tree_util.tree_map(lambda g: g / denom.astype(g.dtype), grads)
      return grads, loss / denom, count

    batch_spec = sharding_lib.batch_sharding(mesh, data_axes).spec
    keys = None
    if rng is not None:
      # Micro-batch keys (raw data) and each layer's index, laid out like the layers.
      layer_ids = jnp.arange(num_layers)
      if interleave is not None:
        layer_ids = layer_ids[interleave]
      keys = (jax.random.key_data(jax.vmap(lambda m: keys_lib.microbatch_key(rng, m))(
          jnp.arange(M))), layer_ids)
    fn = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(in_param_specs,
                  jax.tree_util.tree_map(lambda _: batch_spec, batch), P(),
                  None if keys is None else (P(), P(self.stage_axis))),
        out_specs=(in_param_specs, P(), P()), axis_names=set(axes))
    if permute:
      # Device s must hold its chunks s, s + S, ...: one all-to-all of the layers.
      params = {**params, self.stages_key: jax.tree_util.tree_map(
          lambda x: x[interleave], params[self.stages_key])}
    grads, loss, count = fn(params, batch, jnp.asarray(loss_scale, jnp.float32), keys)
    if permute:
      back = np.argsort(interleave)
      grads = {**grads, self.stages_key: jax.tree_util.tree_map(
          lambda g: g[back], grads[self.stages_key])}
    return Gradients(grads, loss, count)


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

  def micro_keys(self, m: jax.Array, layer_ids: Any) -> tuple[Any, Any, Any]:
    """``(embed kwargs, raw layer keys, head kwargs)`` of micro-batch ``m`` on this
    device (its ``layer_ids``); ``({}, None, {})`` without keys."""
    if self.keys is None:
      return {}, None, {}
    embed, layers, head = Pipeline.keys(self.keys[0][m], layer_ids, self.num_layers)
    return {"rng": embed}, jax.random.key_data(layers), {"rng": head}

  def embed_shape(self, params: Any) -> jax.ShapeDtypeStruct:
    def embed(p, b, k):
      extras = {} if k is None else {"rng": jax.random.wrap_key_data(k)}
      return self.pipeline.embed_fn(self.cast(p), b, **extras)
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

  # ---- 1F1B (`_one_f_one_b`): the functions a tick runs
  def embed(self, m: jax.Array, dtype: Any, p: Any) -> jax.Array:
    """``embed(m)``: micro-batch ``m``'s input to the first stage, in ``dtype``."""
    embed_kw, _, _ = self.micro_keys(m, self.layer_ids())
    return self.pipeline.embed_fn(self.cast(p), self.micro_batch(m),
                                  **embed_kw).astype(dtype)

  def chunk_of(self, tree: Any, chunk: Any) -> Any:
    """Chunk ``chunk`` (traced) of this device's stacked layers (or layer ids): the
    ``v`` chunks are contiguous blocks (`_interleave_order`)."""
    v = self.pipeline.virtual_stages
    if v == 1:
      return tree
    return jax.tree_util.tree_map(lambda x: lax.dynamic_index_in_dim(
        x.reshape((v, x.shape[0] // v) + x.shape[1:]), chunk, keepdims=False), tree)

  def stage_layers(self, m: jax.Array, p: Any, x: jax.Array, chunk: Any = 0
                  ) -> jax.Array:
    """``stage(x)``: this device's layers (of chunk ``chunk``) on micro-batch ``m``'s
    activations."""
    ids = self.layer_ids()
    _, layer_keys, _ = self.micro_keys(m, None if ids is None
                                       else self.chunk_of(ids, chunk))
    return self.pipeline._layers(  # pylint: disable=protected-access
        self.chunk_of(self.cast(p)[self.pipeline.stages_key], chunk), x, layer_keys)

  def stage_and_head(self, m: jax.Array, p: Any, x: jax.Array, chunk: Any = 0
                    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The last stage's layers (its last chunk), then ``head_fn``: ``(scale * loss,
    (loss, count))``."""
    y = self.stage_layers(m, p, x, chunk)
    _, _, head_kw = self.micro_keys(m, self.layer_ids())
    loss, count = self.head_terms(self.cast(p), y, self.micro_batch(m), **head_kw)
    return self.scale * loss, (loss, count)

  def first(self, chunk: Any) -> jax.Array:
    """Whether this device's chunk ``chunk`` is virtual stage 0 (after the embedding)."""
    return (self.stage() == 0) & (chunk == 0)

  def last(self, chunk: Any) -> jax.Array:
    """Whether this device's chunk ``chunk`` is the last virtual stage (the head's)."""
    return ((self.stage() == self.S - 1)
            & (chunk == self.pipeline.virtual_stages - 1))

  def forward(self, p: Any, x_in: jax.Array, m: jax.Array, chunk: Any = 0
             ) -> tuple[jax.Array, jax.Array]:
    """``F(m)`` of chunk ``chunk``: ``(x, y)``, the chunk's input (to save) and its
    output (to send up; the last virtual stage's goes nowhere, its layers run in
    `backward`)."""
    x = lax.cond(self.first(chunk), functools.partial(self.embed, m, x_in.dtype, p),
                 lambda: x_in)
    y = lax.cond(self.last(chunk), lambda: x,
                 functools.partial(self.stage_layers, m, p, x, chunk))
    return x, y

  def backward(self, p: Any, x: jax.Array, ct: jax.Array, m: jax.Array,
               chunk: Any = 0) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """``B(m)`` of chunk ``chunk``: ``(dp, dx, loss, count)`` through the chunk
    recomputed from its saved input ``x`` (and the head after the last virtual stage,
    the embedding before the first)."""
    dp, dx, loss, count = lax.cond(
        self.last(chunk), functools.partial(self._through_head, p, x, m, chunk),
        functools.partial(self._through_stage, p, x, ct, m, chunk))
    dp = lax.cond(self.first(chunk),
                  functools.partial(self._into_embed, p, dp, dx, m), lambda: dp)
    return dp, dx, loss, count

  def backward_input(self, p: Any, x: jax.Array, ct: jax.Array, m: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """ZB-H1's ``B(m)``: ``(dx, loss, count)``, the input gradient only (through the
    head on the last stage, which gives the loss). The first stage's goes nowhere
    (its ``W`` takes the embedding's gradient), so it computes none."""
    def through_head():
      _, vjp, (loss, count) = jax.vjp(lambda x: self.stage_and_head(m, p, x), x,
                                      has_aux=True)
      (dx,) = vjp(self.vary(jnp.ones((), jnp.float32)))
      return dx, loss, count

    def through_stage():
      _, vjp = jax.vjp(lambda x: self.stage_layers(m, p, x), x)
      (dx,) = vjp(ct)
      return dx, self.zero(), self.zero()

    stage = self.stage()
    return lax.cond(stage == self.S - 1, through_head,
                    lambda: lax.cond(stage == 0, lambda: (jnp.zeros_like(x),
                                                          self.zero(), self.zero()),
                                     through_stage))

  def backward_weights(self, p: Any, x: jax.Array, ct: jax.Array, m: jax.Array
                      ) -> Any:
    """ZB-H1's ``W(m)``: the parameters' gradient of the stage recomputed from its
    saved input ``x`` and the cotangent ``ct`` it received (the head's on the last
    stage); on the first stage through the embedding as well."""
    def of(fn, ct):
      def weights():
        _, vjp = jax.vjp(lambda p: fn(p, x), p)
        return vjp(ct)[0]

      def with_embedding():
        _, vjp = jax.vjp(fn, p, x)
        dp, dx = vjp(ct)
        return self._into_embed(p, dp, dx, m)
      return lax.cond(self.stage() == 0, with_embedding, weights)

    head = lambda p, x: self.stage_and_head(m, p, x)[0]  # noqa: E731
    layers = lambda p, x: self.stage_layers(m, p, x)  # noqa: E731
    return lax.cond(self.stage() == self.S - 1,
                    lambda: of(head, self.vary(jnp.ones((), jnp.float32))),
                    lambda: of(layers, ct))

  def _through_head(self, p, x, m, chunk):
    _, vjp, (loss, count) = jax.vjp(
        lambda p, x: self.stage_and_head(m, p, x, chunk), p, x, has_aux=True)
    dp, dx = vjp(self.vary(jnp.ones((), jnp.float32)))
    return dp, dx, loss, count

  def _through_stage(self, p, x, ct, m, chunk):
    _, vjp = jax.vjp(lambda p, x: self.stage_layers(m, p, x, chunk), p, x)
    dp, dx = vjp(ct)
    return dp, dx, self.zero(), self.zero()

  def _into_embed(self, p, dp, dx, m):
    _, vjp = jax.vjp(functools.partial(self.embed, m, dx.dtype), p)
    (dp_embed,) = vjp(dx)
    return jax.tree_util.tree_map(jnp.add, dp, dp_embed)

  def zero_grads(self, params: Any) -> Any:
    return self.vary(jax.tree_util.tree_map(
        lambda x: jnp.zeros(x.shape, jnp.float32), params))

  def tick(self, params: Any, slots: jax.Array, carry: tuple, row: jax.Array
          ) -> tuple[tuple, None]:
    """One tick of the 1F1B table: this stage's op of ``row`` (``[S, 3]`` of ``(op,
    m, chunk)``, `_schedule`), then the sends.

    ``carry`` is ``(saved, inbox_f, inbox_b, grads, loss, count)``: ``K`` slots of
    saved chunk inputs, of activations received from below and of cotangents from
    above, and the sums so far. Item ``(m, chunk)`` of stage ``s`` keeps slot
    ``slots[s, chunk, m]`` from its input's arrival to its backward (`_slots`).
    """
    saved, inbox_f, inbox_b, grads, loss, count = carry
    S, v, stage = self.S, self.pipeline.virtual_stages, self.stage()
    op, m, chunk = row[stage, 0], row[stage, 1], row[stage, 2]
    slot = slots[stage, chunk, m]
    branches = [
        functools.partial(self._op_idle, params, inbox_f[slot]),
        functools.partial(self._op_forward, params, inbox_f[slot], m, chunk)]
    if self.pipeline.schedule == "zb_h1":
      branches += [
          functools.partial(self._op_input_grad, params, saved, inbox_b, slot, m),
          functools.partial(self._op_weight_grad, params, saved, inbox_b, slot, m)]
    else:
      branches.append(functools.partial(self._op_backward, params, saved, inbox_b,
                                        slot, m, chunk))
    x, y, dx, dp, l, c = lax.switch(op, branches)
    saved = saved.at[slot].set(jnp.where(op == FWD, x, saved[slot]))
    grads = jax.tree_util.tree_map(jnp.add, grads, dp)
    if S > 1 or v > 1:
      # Up the ring (device S - 1's chunk c feeds device 0's chunk c + 1) and down.
      pairs = range(S) if v > 1 else range(S - 1)
      from_prev = lax.ppermute(y, self.pipeline.stage_axis,
                               [(i, (i + 1) % S) for i in pairs])
      from_next = lax.ppermute(dx, self.pipeline.stage_axis,
                               [((i + 1) % S, i) for i in pairs])
      prev, next_ = (stage - 1) % S, (stage + 1) % S
      prev_op, prev_m, prev_c = row[prev, 0], row[prev, 1], row[prev, 2]
      next_op, next_m, next_c = row[next_, 0], row[next_, 1], row[next_, 2]
      got_f = (prev_op == FWD) & ~((prev == S - 1) & (prev_c == v - 1))
      got_b = (next_op == BWD) & ~((next_ == 0) & (next_c == 0))
      if v == 1:  # no ring: the ends receive nothing
        got_f, got_b = got_f & (stage > 0), got_b & (stage < S - 1)
      f_chunk = jnp.minimum(prev_c + (stage == 0), v - 1)
      b_chunk = jnp.maximum(next_c - (stage == S - 1), 0)
      f_slot, b_slot = slots[stage, f_chunk, prev_m], slots[stage, b_chunk, next_m]
      inbox_f = inbox_f.at[f_slot].set(jnp.where(got_f, from_prev, inbox_f[f_slot]))
      inbox_b = inbox_b.at[b_slot].set(jnp.where(got_b, from_next, inbox_b[b_slot]))
    return (saved, inbox_f, inbox_b, grads, loss + l, count + c), None

  # Each op gives (x to save, y to send up, dx to send down, dp, loss, count).
  def _op_idle(self, params, x_in):
    z = jnp.zeros_like(x_in)
    return z, z, z, self.zero_grads(params), self.zero(), self.zero()

  def _op_forward(self, params, x_in, m, chunk):
    x, y = self.forward(params, x_in, m, chunk)
    return x, y, jnp.zeros_like(y), self.zero_grads(params), self.zero(), self.zero()

  def _op_input_grad(self, params, saved, inbox_b, slot, m):
    dx, l, c = self.backward_input(params, saved[slot], inbox_b[slot], m)
    return (saved[slot], jnp.zeros_like(dx), dx.astype(saved.dtype),
            self.zero_grads(params), l, c)

  def _op_weight_grad(self, params, saved, inbox_b, slot, m):
    dp = self.backward_weights(params, saved[slot], inbox_b[slot], m)
    dp = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), dp)
    z = jnp.zeros_like(saved[slot])
    return saved[slot], z, z, dp, self.zero(), self.zero()

  def _op_backward(self, params, saved, inbox_b, slot, m, chunk):
    dp, dx, l, c = self.backward(params, saved[slot], inbox_b[slot], m, chunk)
    dp = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), dp)
    return (saved[slot], jnp.zeros_like(dx), dx.astype(saved.dtype), dp, l, c)


def _layers_of_chunk(pipe: Pipeline, layers: Any, chunk: jax.Array, x: jax.Array,
                     keys: Optional[jax.Array]) -> jax.Array:
  """``pipe._layers`` over chunk ``chunk`` of ``layers`` (leaves ``[v, n, ...]``).

  Each layer's parameters are picked from the stack inside a rematerialized body
  that saves only the outputs of its matrix products (``dots_saveable``): autodiff
  of the tick loop would otherwise keep the picked parameters for every tick (``v M
  + S - 1`` copies of a chunk's, memory growing with ``M``), where the stack itself
  is loop-invariant and kept once; the backward picks them again and recomputes the
  elementwise work. With ``remat`` nothing of the body is saved, as in
  `Pipeline._layers`.
  """
  n = jax.tree_util.tree_leaves(layers)[0].shape[1]

  def body(h, l):
    lp = jax.tree_util.tree_map(lambda a: a[chunk, l], layers)
    if keys is None:
      return pipe.stage_fn(lp, h), None
    return pipe.stage_fn(lp, h, rng=jax.random.wrap_key_data(keys[l])), None

  policy = (jax.checkpoint_policies.nothing_saveable if pipe.remat else
            jax.checkpoint_policies.dots_saveable)
  h, _ = lax.scan(jax.checkpoint(body, policy=policy), x, jnp.arange(n))
  return h


def _gpipe(run: _PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any]:
  """GPipe, interleaved over ``virtual_stages`` chunks: the forward loop, run
  backward by autodiff. Returns ``(loss sum, count sum, grads)`` of this device."""
  pipe, S, M = run.pipeline, run.S, run.M
  v = pipe.virtual_stages
  stage = run.stage()
  x_shape = run.embed_shape(params)
  ring = [(i, (i + 1) % S) for i in range(S if v > 1 else S - 1)]

  def objective(params):
    def cast():
      p = run.cast(params)
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
      x = lax.cond(starts,
                   lambda: pipe.embed_fn(p, mb, **embed_kw).astype(x_shape.dtype),
                   lambda: received)
      # A bubble's input is garbage: replace it before any arithmetic touches it.
      x = jnp.where(valid, x, jnp.zeros_like(x))
      y = (pipe._layers(layers, x, layer_keys)  # pylint: disable=protected-access
           if v == 1 else _layers_of_chunk(pipe, layers, chunk, x, layer_keys))
      ends = valid & (stage == S - 1) & (chunk == v - 1)
      l, c = lax.cond(ends, lambda: run.head_terms(p, y, mb, **head_kw),
                      lambda: (run.zero(), run.zero()))
      received = lax.ppermute(y, pipe.stage_axis, ring) if S > 1 else y
      return (received, loss + l, count + c), None

    init = run.vary(jnp.full(x_shape.shape, _BUBBLE_FILL, x_shape.dtype))
    (_, loss, count), _ = lax.scan(tick, (init, run.zero(), run.zero()),
                                   jnp.arange(v * M + S - 1))
    return run.scale * loss, (loss, count)

  grads, (loss, count) = jax.grad(objective, has_aux=True)(params)
  return loss, count, grads


def _slots(table: np.ndarray, v: int, M: int) -> tuple[np.ndarray, int]:
  """Buffer slots for a 1F1B ``table`` (``[ticks, S, 3]``, `_schedule`): item ``(m,
  chunk)`` of stage ``s`` holds one slot of each buffer (received input, saved input,
  received cotangent) from the tick its input arrives (the tick the stage below
  forwarded it, or its own forward after the embedding) until its backward; a slot
  freed by a backward is taken again from that tick on (the tick reads before it
  writes). Returns ``(slots [S, v, M], K)``, ``K`` the slots a stage needs: at most
  the items alive at once (`_live_slots`) plus one."""
  S = table.shape[1]
  frees = WGT if (table[..., 0] == WGT).any() else BWD  # ZB-H1: its W reads them
  fwd_tick, bwd_tick = {}, {}
  for t, row in enumerate(table):
    for s, (op, m, c) in enumerate(row):
      if op == FWD:
        fwd_tick[(s, c, m)] = t
      elif op == frees:
        bwd_tick[(s, c, m)] = t
  slots = np.zeros((S, v, M), np.int32)
  most = 1
  for s in range(S):
    items = []
    for c in range(v):
      for m in range(M):
        vs = c * S + s
        arrive = (fwd_tick[(s, c, m)] if vs == 0
                  else fwd_tick[((s - 1) % S, c - (s == 0), m)])
        items.append((arrive, bwd_tick[(s, c, m)], c, m))
    free, busy = [], []   # busy: (end tick, slot)
    for arrive, end, c, m in sorted(items):
      busy.sort()
      while busy and busy[0][0] <= arrive:
        free.append(busy.pop(0)[1])
      slot = min(free) if free else len(busy)
      if free:
        free.remove(slot)
      slots[s, c, m] = slot
      busy.append((end, slot))
      most = max(most, len(busy))
  return slots, most


def _one_f_one_b(run: _PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any]:
  """1F1B, interleaved over ``virtual_stages`` chunks, from its table (`_schedule`):
  each tick one forward, one backward or nothing (`_PipelineRun.tick`). Returns
  ``(loss sum, count sum, grads)`` of this device."""
  v = run.pipeline.virtual_stages
  table = _schedule(run.pipeline.schedule, run.S, run.M, v)
  slots, K = _slots(table, v, run.M)
  x_shape = run.embed_shape(params)
  buf = run.vary(jnp.full((K,) + x_shape.shape, _BUBBLE_FILL, x_shape.dtype))
  carry = (buf, buf, buf, run.zero_grads(params), run.zero(), run.zero())
  (_, _, _, grads, loss, count), _ = lax.scan(
      functools.partial(run.tick, params, jnp.asarray(slots)), carry,
      jnp.asarray(table))
  return loss, count, grads


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

  def _executor(self) -> Callable[..., tuple[jax.Array, jax.Array, Any]]:
    return _gpipe_split

  def value_and_grad(self, params: Any, batch: Any, **kwargs: Any) -> Gradients:
    """`Pipeline.value_and_grad` of the split model, from stored (padded)
    ``params``; its gradients are stored alike (zero on the padding)."""
    if kwargs.get("rng") is not None:
      raise ValueError("rng: a SplitPipeline takes no random keys yet")
    return super().value_and_grad(params, batch, **kwargs)


def _decoder_layers(pipe: SplitPipeline, layers: Any, y: jax.Array,
                    memory: jax.Array) -> jax.Array:
  """The stacked decoder layers in order, each reading ``memory``."""
  layer = lambda p, h: pipe.decoder_fn(p, h, memory)  # noqa: E731
  body = jax.checkpoint(layer) if pipe.remat else layer
  y, _ = lax.scan(lambda h, p: (body(p, h), None), y, layers)
  return y


def _gpipe_split(run: _PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any]:
  """GPipe over a `SplitPipeline`: each tick stage ``s`` runs its encoder slice on
  ``x`` (``s < split``) or its decoder slice on ``y`` reading ``x``, and sends ``(x,
  y)`` up. Returns ``(loss sum, count sum, grads)`` of this device."""
  pipe, S, M = run.pipeline, run.S, run.M
  stage = run.stage()
  first = jax.tree_util.tree_map(lambda x: x[0], run.micro)
  cast = lambda p: run.cast(p)  # noqa: E731
  x_shape = jax.eval_shape(lambda p, b: pipe.embed_fn(cast(p), b), params, first)
  y_shape = jax.eval_shape(lambda p, b: pipe.decoder_embed_fn(cast(p), b), params,
                           first)
  ring = [(i, i + 1) for i in range(S - 1)]

  def objective(params):
    p = cast(params)
    encoder, decoder = p[pipe.stages_key], p[pipe.decoder_key]

    def tick(carry, t):
      (x_in, y_in), loss, count = carry
      m = t - stage
      valid = (m >= 0) & (m < M)
      m = jnp.clip(m, 0, M - 1)
      mb = run.micro_batch(m)
      x = lax.cond(stage == 0,
                   lambda: pipe.embed_fn(p, mb).astype(x_shape.dtype), lambda: x_in)
      y = lax.cond(stage == pipe.split,
                   lambda: pipe.decoder_embed_fn(p, mb).astype(y_shape.dtype),
                   lambda: y_in)
      # A bubble's inputs are garbage: replace them before any arithmetic.
      x, y = jnp.where(valid, x, jnp.zeros_like(x)), jnp.where(valid, y,
                                                               jnp.zeros_like(y))
      x, y = lax.cond(
          stage < pipe.split,
          lambda: (pipe._layers(encoder, x), y),  # pylint: disable=protected-access
          lambda: (x, _decoder_layers(pipe, decoder, y, x)))
      ends = valid & (stage == S - 1)
      l, c = lax.cond(ends, lambda: run.head_terms(p, y, mb),
                      lambda: (run.zero(), run.zero()))
      sent = lax.ppermute((x, y), pipe.stage_axis, ring) if S > 1 else (x, y)
      return (sent, loss + l, count + c), None

    init = run.vary((jnp.full(x_shape.shape, _BUBBLE_FILL, x_shape.dtype),
                     jnp.full(y_shape.shape, _BUBBLE_FILL, y_shape.dtype)))
    (_, loss, count), _ = lax.scan(tick, (init, run.zero(), run.zero()),
                                   jnp.arange(M + S - 1))
    return run.scale * loss, (loss, count)

  grads, (loss, count) = jax.grad(objective, has_aux=True)(params)
  return loss, count, grads
