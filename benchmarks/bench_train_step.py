"""Step time of `mpscale.make_train_step` against hand-written jitted Flax+Optax steps.

For float32 and float16 compute, three jitted steps train the same Flax MLP on the same
batch with AdamW, each donating its state:

* ``mpscale``: ``make_train_step(loss_fn, tx, policy=...)``.
* ``hand``: the same math written out by hand: scale the loss by
  ``loss_scale_of(opt_state)``, ``jax.grad`` through the compute cast, ``tx.update``
  with the same mpscale-wrapped optimizer, ``optax.apply_updates``, ``step_metrics``.
  The ratio ``mpscale / hand`` is the cost of the step's machinery (target <= 1.05).
* ``plain``: what a Flax user writes without mpscale: plain ``optax.adamw`` in float32,
  and ``flax.training.dynamic_scale.DynamicScale`` in float16 (no norms, no metrics).
  ``mpscale / plain`` is informational: the cost of the one-pass checks and metrics.

Runs alternate between the steps (A B C, then B C A, ...) and the figure reported is the
median over rounds of the per-round ratio of step times, which cancels slow drifts of a
shared machine. Compile time is ``jit(...).lower(...).compile()`` wall time; XLA's cost
analysis of each compiled step (flops, bytes accessed) is printed too, a figure that
does not depend on the machine's load.

Usage::

  python benchmarks/bench_train_step.py            # a few minutes on a laptop CPU
  python benchmarks/bench_train_step.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import flax.linen as nn
from flax.training import dynamic_scale as dynamic_scale_lib
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpscale


class MLP(nn.Module):
  width: int
  depth: int
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.gelu(nn.Dense(self.width)(x))
    return nn.Dense(self.classes)(x)


def make_problem(batch_size: int, width: int, depth: int, features: int = 256):
  rng = np.random.RandomState(0)
  batch = {"x": rng.randn(batch_size, features).astype(np.float32),
           "y": rng.randint(0, 10, size=(batch_size,)).astype(np.int32)}
  model = MLP(width, depth)
  params = model.init(jax.random.PRNGKey(0), batch["x"][:1])["params"]
  return model, params, batch


def make_loss(model: nn.Module, policy: mpscale.Policy) -> Callable:
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, policy.cast_to_compute(batch["x"]))
    logits = policy.cast_to_output(logits).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss_fn


def mpscale_step(loss_fn, tx, policy, params):
  init, step = mpscale.make_train_step(loss_fn, tx, policy=policy)
  return step, init(params)


def hand_step(loss_fn, tx, policy, params):
  """The same math as make_train_step, written out."""
  def step(state, batch):
    params, opt_state, count = state
    scale = mpscale.loss_scale_of(opt_state)

    def scaled(p):
      loss = loss_fn(policy.cast_to_compute(p), batch)
      return scale * loss, loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = mpscale.step_metrics(opt_state)
    metrics.update(loss=loss, loss_scale=scale)
    return (params, opt_state, count + 1), metrics

  params = policy.cast_to_param(params)
  state = (params, tx.init(params), jnp.zeros((), jnp.int32))
  return jax.jit(step, donate_argnums=0), jax.jit(lambda s: s)(state)


def plain_step(loss_fn, policy, params, lr, fp16):
  """A Flax user's step: plain AdamW, and flax's DynamicScale for float16."""
  tx = optax.adamw(lr)

  def step(state, batch):
    params, opt_state, dyn = state
    compute_loss = lambda p: loss_fn(policy.cast_to_compute(p), batch)
    if fp16:
      dyn, is_finite, loss, grads = dyn.value_and_grad(compute_loss)(params)
    else:
      loss, grads = jax.value_and_grad(compute_loss)(params)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if fp16:
      keep = lambda new, old: jax.tree_util.tree_map(
          lambda a, b: jnp.where(is_finite, a, b), new, old)
      new_params = keep(new_params, params)
      new_opt_state = keep(new_opt_state, opt_state)
    return (new_params, new_opt_state, dyn), {"loss": loss}

  params = policy.cast_to_param(params)
  dyn = dynamic_scale_lib.DynamicScale() if fp16 else None
  state = (params, tx.init(params), dyn)
  return jax.jit(step, donate_argnums=0), jax.jit(lambda s: s)(state)


def compile_step(step, state, batch) -> tuple[float, dict[str, float]]:
  """Wall seconds of ``lower().compile()`` and XLA's cost analysis of the result."""
  jax.clear_caches()  # else a repeated compile is a cache hit
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return seconds, {k: float(cost.get(k, float("nan")))
                   for k in ("flops", "bytes accessed")}


def time_steps(step, state, batch, n: int) -> tuple[Any, float]:
  start = time.perf_counter()
  for _ in range(n):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  return state, (time.perf_counter() - start) / n


def bench(precision: str, args) -> dict[str, Any]:
  fp16 = precision == "fp16"
  policy = mpscale.make_policy("params=float32,compute=float16,output=float32"
                              if fp16 else "O0")
  model, params, batch = make_problem(args.batch, args.width, args.depth)
  batch = jax.device_put(batch)
  loss_fn = make_loss(model, policy)
  lr = 1e-3
  wrapped = (mpscale.dynamic_loss_scale(optax.adamw(lr)) if fp16
             else mpscale.no_loss_scale(optax.adamw(lr)))

  builders = {
      "mpscale": lambda: mpscale_step(loss_fn, wrapped, policy, params),
      "hand": lambda: hand_step(loss_fn, wrapped, policy, params),
      "plain": lambda: plain_step(loss_fn, policy, params, lr, fp16),
  }
  names = list(builders)
  steps, states, cost = {}, {}, {}
  compile_times: dict[str, list[float]] = {n: [] for n in names}
  for name, build in builders.items():
    steps[name], states[name] = build()
  for r in range(args.compiles):
    for name in names[r % len(names):] + names[:r % len(names)]:
      seconds, cost[name] = compile_step(steps[name], states[name], batch)
      compile_times[name].append(seconds)
  compile_s = {n: statistics.median(t) for n, t in compile_times.items()}
  for name in names:
    states[name], _ = time_steps(steps[name], states[name], batch, args.warmup)

  times: dict[str, list[float]] = {n: [] for n in names}
  for r in range(args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      states[name], t = time_steps(steps[name], states[name], batch, args.steps)
      times[name].append(t)

  ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
  return {
      "precision": precision,
      "step_ms": {n: 1e3 * statistics.median(times[n]) for n in names},
      "compile_s": compile_s,
      "cost": cost,
      "mpscale/hand": ratio("mpscale", "hand"),
      "mpscale/plain": ratio("mpscale", "plain"),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--depth", type=int, default=3)
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=None, help="steps per timed run")
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--compiles", type=int, default=None,
                      help="compilations per step for the median compile time")
  parser.add_argument("--precision", choices=["fp32", "fp16", "both"], default="both")
  args = parser.parse_args()
  args.rounds = args.rounds or (5 if args.quick else 15)
  args.steps = args.steps or (10 if args.quick else 20)
  args.compiles = args.compiles or (1 if args.quick else 3)

  print(f"jax {jax.__version__} on {jax.devices()[0].platform} "
        f"({jax.devices()[0].device_kind}); MLP {args.depth}x{args.width}, batch "
        f"{args.batch}; {args.rounds} rounds x {args.steps} steps, alternating")
  precisions = ["fp32", "fp16"] if args.precision == "both" else [args.precision]
  for precision in precisions:
    r = bench(precision, args)
    ms, cs = r["step_ms"], r["compile_s"]
    print(f"\n[{precision}] median step time (ms):   mpscale {ms['mpscale']:.3f}  "
          f"hand {ms['hand']:.3f}  plain {ms['plain']:.3f}")
    print(f"[{precision}] compile time (s, median): mpscale {cs['mpscale']:.2f}  "
          f"hand {cs['hand']:.2f}  plain {cs['plain']:.2f}")
    for key in ("flops", "bytes accessed"):
      c = r["cost"]
      print(f"[{precision}] XLA {key:14s}:        mpscale {c['mpscale'][key]:.4g}  "
            f"hand {c['hand'][key]:.4g}  plain {c['plain'][key]:.4g}")
    print(f"[{precision}] median paired ratio mpscale/hand  = {r['mpscale/hand']:.3f}"
          "  (target <= 1.05)")
    print(f"[{precision}] median paired ratio mpscale/plain = {r['mpscale/plain']:.3f}"
          "  (checks + metrics vs none)")


if __name__ == "__main__":
  main()
