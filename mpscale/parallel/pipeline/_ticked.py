"""1F1B (interleaved over virtual stages) and ZB-H1, tick by tick from their tables.

`ticked` runs the ``1f1b`` and ``zb_h1`` schedules of the pseudocode in
``_pipeline``'s docstring with their own backward: one ``lax.scan`` per phase of the
table (`_phases`: a warm-up that only forwards pays for no backward), its carry a
`Carry` of the ``K`` item slots (`item_slots`) and the gradient sums; each tick runs
the ops of its slots (`Ticks.forward`, `.backward`, `.weights`) through a switch, and
one ``ppermute`` up and one down. ZB-H1's ``B`` and ``W`` are a layer's backward split
in two (``_backward_split``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from mpscale.parallel.pipeline import _backward_split as backward_split
from mpscale.parallel.pipeline import _run as run_lib
from mpscale.parallel.pipeline._schedules import (BWD, FWD, IDLE, WGT, chunk_table,
                                                  item_slots)


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


class Ticks:
  """The 1F1B and ZB-H1 executors' ops on one device, inside ``shard_map``.

  ``F(m, c)`` runs chunk ``c``'s layers on micro-batch ``m`` (after the embedding on
  virtual stage 0) and keeps each layer's residuals (`Pipeline.policy` says which); on
  the last virtual stage it also runs the head and its backward, which gives the loss
  and the cotangent of the chunk's output. ``B(m, c)`` runs the chunk's layers
  backward from the kept residuals (1F1B: input and parameter gradients; ZB-H1: with
  each weight product's weight held fixed, keeping those products' output cotangents
  for ``W``, `mpscale.parallel.pipeline`), then the embedding's backward on virtual stage
  0. ``W(m)`` (ZB-H1) gives the weight products' gradients from their kept inputs and
  output cotangents. Every parameter is cast once, before the loop; its gradients are
  summed in float32.
  """

  def __init__(self, run: run_lib.PipelineRun, params: Any):
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
      return run_lib.float32(dp)
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
    (ZB-H1: then each weight product's input, `mpscale.parallel.pipeline`). ``lp``:
    `layer_inputs`."""
    stateful = self.states is not None
    if not self.split:
      y, pullback = jax.vjp(self.pipe.layer(key, stateful), lp, h)
      self._residuals, kept = _split_pullback(pullback, lp)
      return y, kept
    products = backward_split.Split(self.pipe.plain_layer(key, stateful), lp, h)
    tapped = run_lib.under(self.pipe.policy(), products.apply)
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
  def forward(self, m: jax.Array, c: jax.Array, x_in: jax.Array, heads: int = 0):
    """``F(m, c)``: ``(y, kept, dy, d_rest, loss, count)``: the chunk's output (to
    send up), its layers' residuals (stacked ``[n, ...]``), and on the last virtual
    stage the cotangent of its output, the head's parameter gradients and the loss
    terms (zeros elsewhere). ``heads``: how many times a step this call runs the
    head (its conditional's name scope, `runs_a_step`, for the planner)."""
    run = self.run
    x = lax.cond(run.first(c),
                 run_lib.varying(run, functools.partial(self.embed, m, self.rest)),
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
      return dy.astype(y.dtype), run_lib.float32(d_rest), loss, count

    def no_head():
      return (jnp.zeros_like(y), run_lib.float32_zeros(self.rest), run.zero(), run.zero())

    with run_lib.runs_a_step(heads):
      dy, d_rest, loss, count = lax.cond(run.last(c), run_lib.varying(run, head),
                                         run_lib.varying(run, no_head))
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
        run_lib.varying(self.run, functools.partial(self.into_embed, m, dx)),
        run_lib.varying(self.run, functools.partial(run_lib.float32_zeros, self.rest)))
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
    return run_lib.float32(pull(dx.astype(self.x_shape.dtype))[0])


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


class Carry(NamedTuple):
  """What `ticked`'s scans carry from tick to tick: ``K`` item slots of each buffer
  (`item_slots`), where an op of a micro-batch and chunk reads and writes its item's
  slot, and this device's sums."""
  inbox: jax.Array
  """``[K, ...]``: each item's input (from the device below, or the embedding)."""
  ct: jax.Array
  """``[K, ...]``: the cotangent of each item's output (from the device above, or
  the head's backward)."""
  kept: list
  """``[K, n, ...]`` each: what each item's layers kept for their backward."""
  d_layers: Any
  """float32 gradients of the stacked layers, as they are stored."""
  d_rest: Any
  """float32 gradients of the other parameters (embedding, head)."""
  loss: jax.Array
  count: jax.Array
  d_states: Any = None
  """The layers' state copies' updates, ``[v, n, M, ...]``; ``None`` without state."""
  cts: Any = None
  """ZB-H1: ``[K, n, ...]`` each: each weight product's output cotangent, from ``B``
  to ``W``; ``None`` for 1F1B."""
  sent: Any = None
  """Paired ticks: ``(dx, came, item)``, the input gradient a backward sends at the
  start of the next tick; ``None`` where it is sent at once."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Ticking:
  """What every tick of one `ticked` run reads: the run, its ops, and its table's
  item slots."""
  run: run_lib.PipelineRun
  ops: "Ticks"
  slot_of: jax.Array
  """``[S, v, M]``: the buffer slot of each (stage, chunk, micro-batch) item."""
  bwd_slot: int
  """The table slot of a backward: 0 in a one-op tick (ZB-H1), 1 in a paired one."""
  deferred: bool
  """Paired ticks send a backward's input gradient one tick late: it leaves at the
  start of the next tick and lands after that tick's forward, which it overlaps, in
  time for the backward (slot 1) that needs it."""

  @property
  def sends(self) -> bool:
    """Whether anything crosses devices: several stages, or a ring of chunks."""
    return self.run.S > 1 or self.run.pipeline.virtual_stages > 1


def ticked(run: run_lib.PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
  """1F1B (interleaved over ``virtual_stages`` chunks) or ZB-H1 from its table
  (`mpscale.parallel.pipeline_schedule_table`): per tick, the op of each slot
  (`Ticks`), one ``ppermute`` up and one down (paired ticks: the forward's output
  right after the forward, the backward's input gradient at the start of the next
  tick). Buffers hold ``K`` item slots (`item_slots`). Returns ``(loss sum, count
  sum, grads, state updates)`` of this device (the updates of its state copies, or
  ``None``)."""
  pipe, v = run.pipeline, run.pipeline.virtual_stages
  ops = Ticks(run, params)
  table = chunk_table(pipe.schedule, run.S, run.M, v)
  slot_of, K = item_slots(table, v, run.M)
  ticking = _Ticking(run, ops, jnp.asarray(slot_of), bwd_slot=0 if ops.split else 1,
                     deferred=not ops.split and (run.S > 1 or v > 1))
  carry = _first_carry(ticking, params, K)
  for start, stop, slot_ops in _phases(table):
    # A gradient may be on its way from the tick before once a backward ran.
    deliver = ticking.deferred and bool(
        (table[:stop - 1, :, ticking.bwd_slot, 0] == BWD).any())
    # How many times each slot's forward runs the head in this phase: the last
    # device's forwards of its last chunk (`Ticks.forward`'s `runs_a_step`).
    last = table[start:stop, run.S - 1]
    heads = tuple(int(((last[:, k, 0] == FWD) & (last[:, k, 2] == v - 1)).sum())
                  for k in range(table.shape[2]))
    carry, _ = lax.scan(functools.partial(_tick, ticking, slot_ops, deliver, heads),
                        carry, jnp.asarray(table[start:stop]))
  grads = {**carry.d_rest, pipe.stages_key: carry.d_layers}
  updates = None if ops.states is None else jax.tree_util.tree_map(
      lambda u: u.reshape((v * ops.n,) + u.shape[2:]), carry.d_states)
  return carry.loss, carry.count, grads, updates


def _first_carry(ticking: _Ticking, params: Any, K: int) -> Carry:
  """The buffers before the first tick (what a bubble would read: `BUBBLE_FILL`)
  and zero sums."""
  run, ops = ticking.run, ticking.ops
  fill = lambda shape, dtype: run.vary(  # noqa: E731
      jnp.full((K,) + tuple(shape), run_lib.BUBBLE_FILL, dtype))
  act = (ops.x_shape.shape, ops.x_shape.dtype)
  return Carry(
      inbox=fill(*act), ct=fill(*act),
      kept=[fill((ops.n,) + r.shape, r.dtype) for r in ops.kept_shapes],
      d_layers=run.vary(run_lib.float32_zeros(params[run.pipeline.stages_key])),
      d_rest=run.vary(run_lib.float32_zeros(ops.rest)),
      loss=run.zero(), count=run.zero(),
      d_states=(None if ops.states is None else
                run.vary(jax.tree_util.tree_map(jnp.zeros_like, ops.states))),
      cts=([fill((ops.n,) + d.shape, d.dtype) for d in ops.cts_shapes]
           if ops.split else None),
      sent=((run.vary(jnp.zeros(*act)), run.vary(jnp.asarray(False)),
             run.vary(jnp.asarray(0, jnp.int32))) if ticking.deferred else None))


def _tick(ticking: _Ticking, slot_ops: tuple[tuple[int, ...], ...], deliver: bool,
          heads: tuple[int, ...], carry: Carry, row: jax.Array) -> tuple[Carry, None]:
  """One tick: the ops of each used slot (`_run_slot`; ``heads``: how many times
  its forward runs the head in this phase), then what they send (`_sent`)."""
  run = ticking.run
  S, v = run.S, run.pipeline.virtual_stages
  got = None
  if deliver:
    got = lax.ppermute(carry.sent[0], run.pipeline.stage_axis, _down_pairs(S, v))
  y = dx = None
  for k, kinds in enumerate(slot_ops):
    if k == 1 and got is not None:
      _, came, item = carry.sent
      carry = carry._replace(ct=_write(item, came, carry.ct, got))
    if not kinds:
      continue
    carry, out = _run_slot(ticking, k, kinds, carry, row, heads[k])
    if FWD in kinds and ticking.sends:
      # Sent as soon as it exists: the backward of slot 1 hides its transfer.
      y = lax.ppermute(out["y"], run.pipeline.stage_axis, _up_pairs(S, v))
    if BWD in kinds:
      dx = out["dx"]
  return _sent(ticking, carry, row, y, dx), None


def _run_slot(ticking: _Ticking, k: int, kinds: tuple[int, ...], carry: Carry,
              row: jax.Array, heads: int) -> tuple[Carry, dict]:
  """Slot ``k``'s op of this tick (a switch over the ``kinds`` it runs in this
  phase): its item's buffers read and written, its gradients and loss added
  (``heads``: how many times its forward runs the head in this phase)."""
  run, ops = ticking.run, ticking.ops
  v = run.pipeline.virtual_stages
  stage = run.stage()
  op, m, chunk = row[stage, k, 0], row[stage, k, 1], row[stage, k, 2]
  item = ticking.slot_of[stage, chunk, m]
  # The slot's ops read their item's slots here, not inside the switch (which would
  # take the whole buffers and make XLA copy them every tick), and after the slot
  # before wrote (the last virtual stage's backward reads what its forward kept in
  # the same tick).
  present = [name for name in Carry._fields if getattr(carry, name) is not None]
  reads = {name: jax.tree_util.tree_map(lambda b: b[item], getattr(carry, name))
           for name in _needs(kinds, _READS) if name in present}
  writes = [name for name in _needs(kinds, _WRITES) if name in present]
  branches = [run_lib.varying(run, (
      functools.partial(_op_forward, heads=heads) if kind == FWD
      else _OP_BRANCHES[kind])(ops, reads, m, chunk, writes)) for kind in kinds]
  index = jnp.asarray(np.searchsorted(kinds, np.arange(4)).clip(0, len(kinds) - 1),
                      jnp.int32)[op]
  out = lax.switch(index, branches)
  updated = {name: jax.tree_util.tree_map(functools.partial(_write, item, where),
                                          getattr(carry, name), value)
             for name, (where, value) in out.pop("writes").items()}
  if BWD in kinds or WGT in kinds:
    updated["d_layers"] = jax.tree_util.tree_map(
        lambda g, d: g.reshape((v,) + d.shape).at[chunk].add(d).reshape(g.shape),
        carry.d_layers, out["d_layers"])
  if BWD in kinds and carry.d_states is not None:
    # Each (chunk, micro-batch) has one B: its copies' updates, zeros elsewhere.
    updated["d_states"] = jax.tree_util.tree_map(
        lambda u, d: u.at[chunk, :, m].add(d), carry.d_states, out["d_states"])
  updated["d_rest"] = jax.tree_util.tree_map(jnp.add, carry.d_rest, out["d_rest"])
  updated["loss"], updated["count"] = carry.loss + out["loss"], carry.count + out["count"]
  return carry._replace(**updated), out


def _sent(ticking: _Ticking, carry: Carry, row: jax.Array, y: Optional[jax.Array],
          dx: Optional[jax.Array]) -> Carry:
  """``carry`` with what this tick's ops sent landed in the receivers' slots: the
  forward's output in the next device's ``inbox``; the backward's input gradient
  in the device below's ``ct`` (paired ticks: held in ``sent`` for the next
  tick)."""
  if not ticking.sends:
    return carry
  run, slot_of = ticking.run, ticking.slot_of
  if y is not None:
    carry = carry._replace(
        inbox=_write(*_arrival(run, row, slot_of, FWD, 0), carry.inbox, y))
  if ticking.deferred:
    item, came = _arrival(run, row, slot_of, BWD, ticking.bwd_slot)
    return carry._replace(sent=run.vary(
        (dx, came, item) if dx is not None else
        (carry.sent[0], jnp.asarray(False), item)))
  if dx is not None:
    S, v = run.S, run.pipeline.virtual_stages
    carry = carry._replace(ct=_write(
        *_arrival(run, row, slot_of, BWD, ticking.bwd_slot), carry.ct,
        lax.ppermute(dx, run.pipeline.stage_axis, _down_pairs(S, v))))
  return carry


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


def _arrival(run: run_lib.PipelineRun, row: jax.Array, slot_of: jax.Array, kind: int,
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
"""The item slots of `ticked`'s buffers (`Carry` fields) each op reads and writes: ``inbox``
(its input), ``kept`` (its layers' residuals), ``ct`` (its output's cotangent) and
``cts`` (ZB-H1: each weight product's output cotangent, from ``B`` to ``W``; 1F1B
has no such buffer, and its ``B`` writes nothing)."""


def _needs(kinds: Sequence[int], table: dict[int, tuple[str, ...]]) -> list[str]:
  names = {name for kind in kinds for name in table.get(kind, ())}
  return sorted(names)


def _op_idle(ops: Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    return _op_out(ops, writes)
  return run


def _op_forward(ops: Ticks, c: dict, m, chunk, writes, heads: int = 0) -> Callable:
  def run():
    y, kept, dy, d_rest, loss, count = ops.forward(m, chunk, c["inbox"], heads)
    last = ops.run.last(chunk)
    return _op_out(ops, writes, y=jnp.where(last, jnp.zeros_like(y), y),
                   writes={"kept": (True, kept), "ct": (last, dy)},
                   d_rest=d_rest, loss=loss, count=count)
  return run


def _op_backward(ops: Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    dx, d_layers, cts, d_rest, d_states = ops.backward(m, chunk, c["ct"], c["kept"])
    return _op_out(ops, writes, dx=dx, d_layers=d_layers, d_rest=d_rest,
                   writes={"cts": (True, cts)} if ops.split else None,
                   d_states=d_states)
  return run


def _op_weights(ops: Ticks, c: dict, m, chunk, writes) -> Callable:
  def run():
    return _op_out(ops, writes, d_layers=ops.weights(m, chunk, c["kept"], c["cts"]))
  return run


_OP_BRANCHES = {IDLE: _op_idle, FWD: _op_forward, BWD: _op_backward, WGT: _op_weights}


def _op_out(ops: Ticks, names: Sequence[str], *, y=None, dx=None, writes=None,
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
      "d_rest": run_lib.float32_zeros(ops.rest) if d_rest is None else d_rest,
      "loss": ops.run.zero() if loss is None else loss,
      "count": ops.run.zero() if count is None else count}
