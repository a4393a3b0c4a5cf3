"""Pipeline schedules: bubble, compile time, temp memory and step time vs micro-batches.

For S stages (default 4) and M micro-batches, each schedule is compiled on a mesh of
(data=1, stage=S) devices and timed. Prints, per (schedule, M): the counted bubble
fraction of the executed tick table next to the ideal (S - 1) / (M + S - 1), the compile
time, the compiled temp bytes per device (``memory_analysis``), and the median step time
(value-and-grad of the pipelined model, with the micro-batch size held fixed, so the
global batch grows with M). Step time per micro-batch is reported too: it falls as the
bubble shrinks.

On a CPU-only machine run with fake devices (the script sets the flag if absent):

  python benchmarks/bench_pipeline.py [--stages 4] [--max-micro 32] [--quick]
"""

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  if "jax" in sys.modules:
    raise SystemExit("set XLA_FLAGS before importing jax")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from mpscale import pipeline as pl  # noqa: E402


def model(width, features):
  def embed_fn(p, b):
    return b["x"] @ p["embed"]

  def stage_fn(lp, x):
    return x + jnp.tanh(x @ lp["w1"]) @ lp["w2"]

  def head_fn(p, x, b):
    err = jnp.sum((x @ p["head"] - b["y"]) ** 2, axis=-1)
    return jnp.sum(err), jnp.asarray(err.size, jnp.float32)

  return embed_fn, stage_fn, head_fn


def params_for(layers, width, features, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2] if len(s) > 1 else 1),
                             jnp.float32)
  return {"embed": f(features, width),
          "stages": {"w1": f(layers, width, 4 * width), "w2": f(layers, 4 * width, width)},
          "head": f(width, 8)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stages", type=int, default=4)
  ap.add_argument("--layers-per-stage", type=int, default=2)
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch")
  ap.add_argument("--max-micro", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--quick", action="store_true", help="small sizes, M up to 8")
  args = ap.parse_args()
  if args.quick:
    args.width, args.max_micro, args.reps = 64, 8, 3
  S = args.stages
  features = 32
  mesh = Mesh(np.array(jax.devices()[:S]).reshape(1, S), ("data", "stage"))
  embed_fn, stage_fn, head_fn = model(args.width, features)
  params = params_for(S * args.layers_per_stage, args.width, features)
  micro_counts = [m for m in (1, 2, 4, 8, 16, 32) if m <= args.max_micro]
  print(f"devices: {jax.devices()[0].platform} x {len(jax.devices())}; S={S}, "
        f"{args.layers_per_stage} layers/stage, width {args.width}, micro-batch "
        f"{args.micro_batch} rows")
  print(f"{'schedule':8} {'M':>3} {'bubble':>7} {'ideal':>7} {'compile s':>9} "
        f"{'temp KiB':>9} {'step ms':>8} {'ms/micro':>8}")
  for schedule in ("gpipe", "1f1b"):
    for M in micro_counts:
      rng = np.random.default_rng(M)
      rows = M * args.micro_batch
      batch = {"x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
               "y": jnp.asarray(rng.normal(size=(rows, 8)), jnp.float32)}
      pipe = pl.Pipeline(embed_fn, stage_fn, head_fn, M, schedule=schedule)
      fn = jax.jit(lambda p, b: pipe.value_and_grad(p, b, mesh=mesh,
                                                    per_token_loss=True))
      sharded = pipe.shard_params(params, mesh)
      t0 = time.perf_counter()
      compiled = fn.lower(sharded, batch).compile()
      compile_s = time.perf_counter() - t0
      temp = compiled.memory_analysis().temp_size_in_bytes
      jax.block_until_ready(compiled(sharded, batch))
      times = []
      for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(sharded, batch))
        times.append(time.perf_counter() - t0)
      step_ms = 1e3 * float(np.median(times))
      bubble = pl.bubble_fraction(pl.schedule_table(schedule, S, M))
      print(f"{schedule:8} {M:3d} {bubble:7.3f} {(S - 1) / (M + S - 1):7.3f} "
            f"{compile_s:9.2f} {temp / 1024:9.1f} {step_ms:8.1f} {step_ms / M:8.2f}",
            flush=True)


if __name__ == "__main__":
  main()
