"""Pipeline parallelism over a ``stage`` mesh axis: GPipe and 1F1B in ``shard_map``.

A pipelined model is three functions::

  embed_fn(params, batch) -> x                # runs on the first stage
  stage_fn(layer_params, x) -> x              # ONE layer; a stage scans its layers
  head_fn(params, x, batch) -> loss           # last stage; or (loss_sum, num_tokens)

``params`` is a dict whose ``"stages"`` entry holds every layer's parameters stacked on a
leading axis of size ``num_layers``; the rest (embedding, head) is replicated. On a mesh
with axes (``data``, ``stage``) the stacked layers are split into ``num_stages`` equal
slices sharded over ``stage``, the batch is sharded over ``data`` and cut into
``num_microbatches`` micro-batches, and activations move between stages with
``ppermute``. The gradients equal the unpipelined model's.

Schedules, per data replica (S stages, M micro-batches)::

  gpipe: for t in range(M + S - 1):           # forward; autodiff runs it backward
           stage s runs micro-batch t - s if 0 <= t - s < M, sends to s + 1
  1f1b:  a static table gives each (tick, stage) one op, F(m) or B(m) or idle, in
         PipeDream-flush order: S - 1 - s warm-up forwards, then one forward and one
         backward alternately, then the remaining backwards. B(m) recomputes the
         stage from its saved input and applies its VJP, so at most S inputs per stage
         are alive: memory stays flat in M while GPipe's grows with M.

Both have the bubble fraction (S - 1) / (M + S - 1). Bubble ticks never compute on
their garbage: a stage's input on a bubble tick is replaced by zeros before use (GPipe)
or the tick runs no op at all (1F1B), so nothing from a bubble reaches a gradient.
Replicated values are cast to device-varying before the loop, so the only all-reduces
(the gradient sums over ``data`` and ``stage``) happen once, after it.

References:
  Huang et al., "GPipe", NeurIPS 2019. https://arxiv.org/abs/1811.06965
  Narayanan et al., "PipeDream" / Megatron-LM 1F1B, SC 2021.
  https://arxiv.org/abs/2104.04473
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mpscale import norms as norms_lib

SCHEDULES = ("gpipe", "1f1b")
IDLE, FWD, BWD = 0, 1, 2


# --------------------------------------------------------------------------- schedules
def schedule_table(schedule: str, num_stages: int, num_microbatches: int) -> np.ndarray:
  """The op each stage runs at each tick, as an int array ``[ticks, stages, 2]``.

  ``table[t, s] = (op, m)`` with ``op`` one of ``IDLE``, ``FWD``, ``BWD`` and ``m`` the
  micro-batch. Built by running every stage's op list in lock step: an op starts when its
  input arrived at an earlier tick (``ppermute`` takes one tick).
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
  S, M = num_stages, num_microbatches
  order = []
  for s in range(S):
    if schedule == "gpipe":
      ops = [(FWD, m) for m in range(M)] + [(BWD, m) for m in reversed(range(M))]
    else:
      warmup = min(S - 1 - s, M)
      ops = [(FWD, m) for m in range(warmup)]
      f, b = warmup, 0
      while f < M:
        ops += [(FWD, f), (BWD, b)]
        f, b = f + 1, b + 1
      ops += [(BWD, m) for m in range(b, M)]
    order.append(ops)
  done: dict[tuple[int, int, int], int] = {}
  pos, rows, t = [0] * S, [], 0
  while any(p < 2 * M for p in pos):
    row = []
    for s in range(S):
      if pos[s] == 2 * M:
        row.append((IDLE, 0))
        continue
      op, m = order[s][pos[s]]
      dep = (FWD, s - 1, m) if op == FWD else (BWD, s + 1, m)
      edge = s == 0 if op == FWD else s == S - 1
      if op == BWD and edge:
        dep = (FWD, s, m)
      if edge and op == FWD or done.get(dep, t) < t:
        row.append((op, m))
      else:
        row.append((IDLE, 0))
    for s, (op, m) in enumerate(row):
      if op != IDLE:
        done[(op, s, m)] = t
        pos[s] += 1
    rows.append(row)
    t += 1
  return np.asarray(rows, np.int32)


def bubble_fraction(table: np.ndarray) -> float:
  """Share of (tick, stage) slots that run no op."""
  return float(np.mean(table[..., 0] == IDLE))


def _live_slots(table: np.ndarray) -> int:
  """Most micro-batches whose stage input must be kept at once, over stages and ticks."""
  S = table.shape[1]
  most = 1
  for s in range(S):
    live = 0
    for op, _ in table[:, s]:
      live += 1 if op == FWD else -1 if op == BWD else 0
      most = max(most, live)
  return most


# --------------------------------------------------------------------------- groups
def stage_groups(num_stages: int, stages_key: str = "stages") -> Callable:
  """Groups with one entry per pipeline stage (mindformers' ``local_norm``).

  The stacked layers under ``stages_key`` are split into ``num_stages`` groups
  ``stage_0 ... stage_{S-1}``; every other top-level key is its own group. Pass it as
  ``groups=`` to a loss-scale wrapper or `mpscale.clip_by_global_norm`.
  """
  names = tuple(f"stage_{i}" for i in range(num_stages))

  def groups(path):
    top = norms_lib.path_name(path[:1]) if path else "params"
    return names if top == stages_key else top

  return groups


# --------------------------------------------------------------------------- pipeline
def _varying_axes(x: Any) -> frozenset:
  """The mesh axes ``x`` varies over inside ``shard_map`` (its "vma" type)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):  # jax >= 0.9
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))


def _mark_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  if hasattr(lax, "pcast"):  # jax >= 0.8
    return lax.pcast(x, axes, to="varying")
  return lax.pvary(x, axes)  # jax 0.7, where pcast does not exist yet


def _cast_varying(tree: Any, axes: Sequence[str]) -> Any:
  """Marks every leaf device-varying over ``axes`` (no data moves)."""
  def cast(x):
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return _mark_varying(x, missing) if missing else x
  return jax.tree_util.tree_map(cast, tree)


def _sum_invariant(tree: Any, axes: Sequence[str], varying: Any) -> Any:
  """psums each leaf over the ``axes`` along which the matching input was invariant."""
  def reduce(g, like):
    over = tuple(a for a in axes if a not in _varying_axes(like))
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
    schedule: ``"gpipe"`` or ``"1f1b"``.
    remat: recompute each stage's activations in the backward pass (GPipe; 1F1B always
      recomputes a stage from its saved input).
    stage_axis: the mesh axis the stages are split over.
    stages_key: the key of ``params`` holding the stacked layers.
  """
  embed_fn: Callable
  stage_fn: Callable
  head_fn: Callable
  num_microbatches: int
  schedule: str = "gpipe"
  remat: bool = False
  stage_axis: str = "stage"
  stages_key: str = "stages"

  def __post_init__(self):
    for name in ("embed_fn", "stage_fn", "head_fn"):
      if not callable(getattr(self, name)):
        raise TypeError(f"{name} must be callable")
    m = self.num_microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
      raise ValueError(f"num_microbatches must be an int >= 1; got {m!r}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}; got {self.schedule!r}")
    if not isinstance(self.remat, bool):
      raise TypeError(f"remat must be a bool; got {type(self.remat).__name__}")

  # ---- the unpipelined model (reference, and the single-stage path)
  def _layers(self, layer_params: Any, x: jax.Array) -> jax.Array:
    body = jax.checkpoint(self.stage_fn) if self.remat else self.stage_fn
    x, _ = lax.scan(lambda h, p: (body(p, h), None), x, layer_params)
    return x

  def apply(self, params: Any, batch: Any) -> Any:
    """The whole model on one device: ``head_fn(embed_fn -> all layers)``."""
    x = self.embed_fn(params, batch)
    x = self._layers(params[self.stages_key], x)
    return self.head_fn(params, x, batch)

  # ---- layout
  def num_stages(self, mesh: Optional[Mesh]) -> int:
    if mesh is None or self.stage_axis not in mesh.axis_names:
      return 1
    return mesh.shape[self.stage_axis]

  def check(self, params: Any, mesh: Mesh, data_axis: Optional[str], batch: Any = None
           ) -> None:
    """Raises ``ValueError`` naming the problem for a layout that cannot pipeline."""
    if mesh is None or self.stage_axis not in mesh.axis_names:
      raise ValueError(f"mesh has no stage axis {self.stage_axis!r}; its axes are "
                       f"{None if mesh is None else mesh.axis_names}")
    if not isinstance(params, dict) or self.stages_key not in params:
      raise ValueError(f"params must be a dict with the stacked layers under "
                       f"{self.stages_key!r}")
    S = mesh.shape[self.stage_axis]
    layers = {np.shape(x)[0] if np.ndim(x) else None
              for x in jax.tree_util.tree_leaves(params[self.stages_key])}
    if len(layers) != 1 or None in layers:
      raise ValueError(f"every leaf of params[{self.stages_key!r}] needs the same "
                       f"leading (layer) axis; got {sorted(map(str, layers))}")
    (num_layers,) = layers
    if num_layers % S:
      raise ValueError(f"{num_layers} layers are not divisible by {S} stages")
    if batch is not None:
      D = mesh.shape[data_axis] if data_axis in mesh.axis_names else 1
      for x in jax.tree_util.tree_leaves(batch):
        if np.ndim(x) == 0 or np.shape(x)[0] % (D * self.num_microbatches):
          raise ValueError(
              f"batch size {np.shape(x)[:1]} is not divisible by data-parallel size "
              f"{D} x num_microbatches {self.num_microbatches}")

  def param_specs(self, params: Any) -> Any:
    """PartitionSpecs: stacked layers sharded over the stage axis, the rest replicated."""
    return {k: jax.tree_util.tree_map(
        lambda _: P(self.stage_axis) if k == self.stages_key else P(), v)
            for k, v in params.items()}

  def shard_params(self, params: Any, mesh: Mesh) -> Any:
    """``params`` placed on ``mesh`` with `param_specs`."""
    return jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        params, self.param_specs(params))

  # ---- gradients
  def value_and_grad(self, params: Any, batch: Any, *, mesh: Mesh,
                     data_axis: str = "data", loss_scale: Any = 1.0,
                     per_token_loss: bool = False,
                     cast: Callable[[Any], Any] = lambda p: p,
                     _bubble_fill: float = 0.0) -> tuple[jax.Array, jax.Array, Any]:
    """Loss and gradients of ``loss_scale * loss``, pipelined over ``mesh``.

    Args:
      params: the model parameters (see the class docstring), float32 masters.
      batch: a pytree of arrays with the global batch on the leading axis.
      mesh: a mesh with the stage axis (and optionally ``data_axis``).
      data_axis: the data-parallel mesh axis.
      loss_scale: the loss scale (gradients are of ``loss_scale * loss``).
      per_token_loss: ``head_fn`` returns ``(loss_sum, num_tokens)``; the loss is the
        sum over every micro-batch and replica divided by the total token count.
      cast: applied to ``params`` before use (a precision policy's cast to the
        compute dtype); gradients come back in the masters' dtype.

    Returns:
      ``(loss, num_tokens, grads)``: the unscaled mean loss, the token (or example)
      count, and the gradients of ``loss_scale * loss``, laid out like ``params``.
    """
    self.check(params, mesh, data_axis, batch)
    S = mesh.shape[self.stage_axis]
    D = mesh.shape[data_axis] if data_axis in mesh.axis_names else 1
    M = self.num_microbatches
    axes = tuple(a for a in (data_axis, self.stage_axis) if a in mesh.axis_names)
    batch_spec = P(data_axis) if data_axis in mesh.axis_names else P()
    specs = self.param_specs(params)
    table = schedule_table(self.schedule, S, M)
    run = self._run_gpipe if self.schedule == "gpipe" else self._run_1f1b

    def per_device(params, batch, scale):
      # Everything in the loop varies over every axis, so autodiff puts no psum in it.
      varying = _cast_varying(params, axes)
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape((M, x.shape[0] // M) + x.shape[1:]), batch)
      micro = _cast_varying(micro, axes)
      scale = _cast_varying(scale, axes)
      loss, count, grads = run(varying, micro, scale, S, M, table, per_token_loss, cast,
                               _bubble_fill, axes)
      grads = _sum_invariant(grads, axes, params)
      loss, count = lax.psum(loss, axes), lax.psum(count, axes)
      if per_token_loss:
        denom = count
      else:
        denom = jnp.asarray(M * D, jnp.float32)
        count = jnp.asarray(M * D, jnp.float32)
      grads = jax.tree_util.tree_map(lambda g: g / denom.astype(g.dtype), grads)
      return loss / denom, count, grads

    fn = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(specs, jax.tree_util.tree_map(lambda _: batch_spec, batch), P()),
        out_specs=(P(), P(), specs))
    return fn(params, batch, jnp.asarray(loss_scale, jnp.float32))

  def _head_terms(self, params, x, batch, per_token_loss, axes):
    """``(loss, count)`` from ``head_fn``, both float32 and varying over ``axes`` (a
    head may return a constant count, which would otherwise be device-invariant)."""
    loss, count = self._head_outputs(params, x, batch, per_token_loss)
    return _cast_varying((loss, count), axes)

  def _head_outputs(self, params, x, batch, per_token_loss):
    out = self.head_fn(params, x, batch)
    if per_token_loss:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError("with per_token_loss, head_fn must return (loss_sum, "
                        f"num_tokens); got {type(out).__name__}")
      loss, count = out
      return jnp.asarray(loss, jnp.float32), jnp.asarray(count, jnp.float32)
    if isinstance(out, tuple) or jnp.ndim(out) != 0:
      raise TypeError("head_fn must return a scalar loss (or, with per_token_loss, "
                      "(loss_sum, num_tokens))")
    return jnp.asarray(out, jnp.float32), jnp.ones((), jnp.float32)

  def _run_gpipe(self, params, micro, scale, S, M, table, per_token_loss, cast, fill,
                 axes):
    stage = lax.axis_index(self.stage_axis)
    vzero = lambda: _cast_varying(jnp.zeros((), jnp.float32), axes)
    first, last = stage == 0, stage == S - 1
    x_shape = jax.eval_shape(
        lambda p, b: self.embed_fn(cast(p), b), params,
        jax.tree_util.tree_map(lambda x: x[0], micro))
    ring = [(i, i + 1) for i in range(S - 1)]

    def objective(params):
      p = cast(params)
      layers = p[self.stages_key]

      def tick(carry, t):
        received, loss, count = carry
        m_in = t - stage
        valid_in = (m_in >= 0) & (m_in < M)
        mb_in = jax.tree_util.tree_map(lambda x: x[jnp.clip(t, 0, M - 1)], micro)
        x = lax.cond(first & (t < M), lambda: self.embed_fn(p, mb_in).astype(
            x_shape.dtype), lambda: received)
        # A bubble's input is garbage: replace it before any arithmetic touches it.
        x = jnp.where(valid_in, x, jnp.zeros_like(x))
        y = self._layers(layers, x)
        m_out = jnp.clip(t - (S - 1), 0, M - 1)
        valid_out = last & (t >= S - 1)
        mb_out = jax.tree_util.tree_map(lambda x: x[m_out], micro)
        l, c = lax.cond(valid_out,
                        lambda: self._head_terms(p, y, mb_out, per_token_loss, axes),
                        lambda: (vzero(), vzero()))
        received = lax.ppermute(y, self.stage_axis, ring) if S > 1 else y
        return (received, loss + l, count + c), None

      init = _cast_varying(jnp.full(x_shape.shape, fill, x_shape.dtype), axes)
      (_, loss, count), _ = lax.scan(tick, (init, vzero(), vzero()),
                                     jnp.arange(M + S - 1))
      return scale * loss, (loss, count)

    grads, (loss, count) = jax.grad(objective, has_aux=True)(params)
    return loss, count, grads

  def _run_1f1b(self, params, micro, scale, S, M, table, per_token_loss, cast, fill,
                axes):
    stage = lax.axis_index(self.stage_axis)
    vary = lambda tree: _cast_varying(tree, axes)
    zero_s = lambda: vary(jnp.zeros((), jnp.float32))
    K = _live_slots(table)
    mb0 = jax.tree_util.tree_map(lambda x: x[0], micro)
    x_shape = jax.eval_shape(lambda p, b: self.embed_fn(cast(p), b), params, mb0)
    up = [(i, i + 1) for i in range(S - 1)]
    down = [(i + 1, i) for i in range(S - 1)]
    ops = jnp.asarray(table)
    zeros_like_params = lambda: vary(jax.tree_util.tree_map(
        lambda x: jnp.zeros(x.shape, jnp.float32), params))
    layers_of = lambda p: p[self.stages_key]

    def embed(p, m):
      mb = jax.tree_util.tree_map(lambda x: x[m], micro)
      return self.embed_fn(cast(p), mb).astype(x_shape.dtype)

    def stage_only(p, x):
      return self._layers(layers_of(cast(p)), x)

    def stage_and_head(p, x, m):
      mb = jax.tree_util.tree_map(lambda x: x[m], micro)
      y = self._layers(layers_of(cast(p)), x)
      loss, count = self._head_terms(cast(p), y, mb, per_token_loss, axes)
      return scale * loss, (loss, count)

    def forward(p, x_in, m):
      x = lax.cond(stage == 0, lambda: embed(p, m), lambda: x_in)
      y = lax.cond(stage == S - 1, lambda: x, lambda: stage_only(p, x))
      return x, y

    def backward(p, x, ct, m):
      def through_head():
        _, vjp, (loss, count) = jax.vjp(
            lambda p, x: stage_and_head(p, x, m), p, x, has_aux=True)
        dp, dx = vjp(vary(jnp.ones((), jnp.float32)))
        return dp, dx, loss, count

      def through_stage():
        _, vjp = jax.vjp(stage_only, p, x)
        dp, dx = vjp(ct)
        return dp, dx, zero_s(), zero_s()

      dp, dx, loss, count = lax.cond(stage == S - 1, through_head, through_stage)

      def into_embed():
        _, vjp = jax.vjp(lambda p: embed(p, m), p)
        (dp_embed,) = vjp(dx)
        return jax.tree_util.tree_map(jnp.add, dp, dp_embed)

      dp = lax.cond(stage == 0, into_embed, lambda: dp)
      return dp, dx, loss, count

    def tick(carry, row):
      saved, inbox_f, inbox_b, grads, loss, count = carry
      op, m = row[stage, 0], row[stage, 1]
      slot = m % K
      x_in = inbox_f[slot]

      def do_forward():
        x, y = forward(params, x_in, m)
        return x, y, jnp.zeros_like(y), zeros_like_params(), zero_s(), zero_s()

      def do_backward():
        dp, dx, l, c = backward(params, saved[slot], inbox_b[slot], m)
        dp = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), dp)
        return (saved[slot], jnp.zeros_like(dx), dx.astype(x_shape.dtype), dp, l, c)

      def do_nothing():
        z = jnp.zeros_like(x_in)
        return z, z, z, zeros_like_params(), zero_s(), zero_s()

      x, y, dx, dp, l, c = lax.switch(op, (do_nothing, do_forward, do_backward))
      saved = saved.at[slot].set(jnp.where(op == FWD, x, saved[slot]))
      grads = jax.tree_util.tree_map(jnp.add, grads, dp)
      if S > 1:
        from_prev = lax.ppermute(y, self.stage_axis, up)
        from_next = lax.ppermute(dx, self.stage_axis, down)
        prev_op, prev_m = row[jnp.maximum(stage - 1, 0)]
        next_op, next_m = row[jnp.minimum(stage + 1, S - 1)]
        got_f = (stage > 0) & (prev_op == FWD)
        got_b = (stage < S - 1) & (next_op == BWD)
        inbox_f = inbox_f.at[prev_m % K].set(
            jnp.where(got_f, from_prev, inbox_f[prev_m % K]))
        inbox_b = inbox_b.at[next_m % K].set(
            jnp.where(got_b, from_next, inbox_b[next_m % K]))
      return (saved, inbox_f, inbox_b, grads, loss + l, count + c), None

    buf = vary(jnp.full((K,) + x_shape.shape, fill, x_shape.dtype))
    carry = (buf, buf, buf, zeros_like_params(), zero_s(), zero_s())
    (_, _, _, grads, loss, count), _ = lax.scan(tick, carry, ops)
    return loss, count, grads
