"""GPipe, interleaved over virtual stages: the forward loop, run backward by autodiff.

`gpipe` is the ``gpipe`` schedule of the pseudocode in ``_pipeline``'s docstring: a
``lax.scan`` over ``v M + S - 1`` ticks, each running one chunk of layers on one
micro-batch (`layers_of_chunk`) and sending its output up with one ``ppermute``, and
``jax.grad`` of that loop. A bubble tick's input is replaced by zeros before any
arithmetic touches it, so nothing from a bubble reaches a gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from mpscale.parallel.pipeline import _run as run_lib


def layers_of_chunk(pipe: Any, layers: Any, chunk: jax.Array, x: jax.Array,
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
  elementwise work. ``gather`` (FSDP, `StageFSDP.layer`) gathers the picked parameters,
  again in the backward. The chunk's first ``recompute_layers`` run under the policy,
  the rest under ``recompute="none"``'s (`scan_layers`).
  """
  n = jax.tree_util.tree_leaves(layers)[0].shape[1]
  pick = lambda tree, l: jax.tree_util.tree_map(  # noqa: E731
      lambda a: a[chunk, l], tree)

  def body(h, l):
    lp = gather(pick(layers, l))
    key = None if keys is None else keys[l]
    state = None if states is None else pick(states, l)
    return pipe._stage(lp, h, key, state), None  # pylint: disable=protected-access

  def layer_of(recomputed):
    policy = run_lib.gathers_recomputed(pipe.policy() if recomputed else None)
    return jax.checkpoint(body, policy=policy)
  h, _ = run_lib.scan_layers(layer_of, x, jnp.arange(n), pipe.recompute_layers)
  return h


def gpipe(run: run_lib.PipelineRun, params: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
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
           if v == 1 else layers_of_chunk(pipe, layers, chunk, x, layer_keys,
                                           gather or (lambda lp: lp), item_states))
      ends = valid & (stage == S - 1) & (chunk == v - 1)
      head = run.gathered(lambda p, y, mb: run.head_terms(p, y, mb, **head_kw))
      with run_lib.runs_a_step(run.M):
        l, c = lax.cond(ends, lambda: head(p, y, mb),
                        lambda: (run.zero(), run.zero()))
      received = lax.ppermute(y, pipe.stage_axis, ring) if S > 1 else y
      return (received, loss + l, count + c), None

    init = run.vary(jnp.full(x_shape.shape, run_lib.BUBBLE_FILL, x_shape.dtype))
    (_, loss, count), _ = lax.scan(tick, (init, run.zero(), run.zero()),
                                   jnp.arange(v * M + S - 1))
    return run.scale * loss, (loss, count)

  (grads, updates), (loss, count) = jax.grad(objective, argnums=(0, 1),
                                             has_aux=True)(params, run.states)
  return loss, count, grads, updates
