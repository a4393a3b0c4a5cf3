"""Pipeline schedules side by side: bubble, inputs alive, memory, compile and step time.

For S stages (default 4) and M micro-batches, every schedule runs the same model: GPipe,
1F1B, ZB-H1 (``zb_h1``, one chunk per stage), and GPipe and 1F1B interleaved over
``--virtual`` layer chunks per device (default 2; the layers must divide into S * v
chunks, and an interleaved schedule needs M a multiple of S, so its rows start at
M = S). Each is compiled on a mesh of (data=1, stage=S) devices and timed. Prints, per
(M, schedule): the counted bubble fraction of the executed tick table next to the ideal,
(S - 1) / (v M + S - 1) for GPipe and 1F1B and (S - 1) / (3 M + S - 1) for ZB-H1, whose
tick runs one of F, B (input gradient) or W (weight gradient), at equal costs a third of
a 1F1B forward-and-backward pair (1F1B's backward is B and W in one tick); the most
stage inputs alive per device (``pipeline.live_slots`` of the table: GPipe v M, 1F1B
and ZB-H1 min(S, M), interleaved 1F1B at most (v + 1) S - 1 whatever M), the compile
time, the compiled temp bytes per device (``memory_analysis``), and the median step time
(value-and-grad of the pipelined model, with the micro-batch size held fixed, so the
global batch grows with M) and per micro-batch. ZB-H1's B and W each cost about a
forward (W is the weight side of each matrix product: `mpscale.parallel.pipeline`).

``--work`` prints instead, for S in {2, 4, 8}, M in {S, 4S}, v in {1, 2} and each
recompute policy (``none``, ``selective``, ``full``), each schedule's compiled matrix
FLOPs (`mpscale.trainer.planning.hlo.matmul_flops`: loops by trip count, a conditional at its costliest
branch) over GPipe's on the same model, S, M, v and policy, and over the model's own
(``6 x params x tokens``, plus one forward more under ``full``), and its compiled temp
bytes per device over GPipe's. Nothing is timed: the ratios are the compiler's.

On a CPU-only machine run with fake devices (the script sets the flag if absent):

  python benchmarks/bench_pipeline.py [--stages 4] [--virtual 2] [--max-micro 32] [--quick]
  python benchmarks/bench_pipeline.py --work [--quick]
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

from mpscale.trainer.planning import hlo  # noqa: E402
from mpscale.parallel import pipeline as pl  # noqa: E402


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


def schedules(virtual):
  """``(label, schedule, v)`` of every schedule compared: plain, then interleaved."""
  plain = [("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("zb_h1", "zb_h1", 1)]
  if virtual == 1:
    return plain
  return plain + [(f"gpipe v{virtual}", "gpipe", virtual),
                  (f"1f1b v{virtual}", "1f1b", virtual)]


def compiled(pipe, mesh, params, batch):
  fn = jax.jit(lambda p, b: pipe.value_and_grad(p, b, mesh=mesh, per_token_loss=True))
  return fn.lower(pipe.shard_params(params, mesh), batch).compile()


def work_table(args):
  """Compiled matrix FLOPs and temp bytes of every schedule over GPipe's (``--work``)."""
  width, features, rows = (32, 16, 32) if args.quick else (64, 32, 64)
  embed_fn, stage_fn, head_fn = model(width, features)
  print(f"devices: {jax.devices()[0].platform} x {len(jax.devices())}; 2 layers a "
        f"(virtual) stage, width {width}, {rows} rows a micro-batch")
  print(f"{'S':>2} {'M':>3} {'v':>2} {'recompute':9} {'schedule':8} {'work/gpipe':>10} "
        f"{'work/model':>10} {'temp/gpipe':>10}")
  for S in (2, 4) if args.quick else (2, 4, 8):
    mesh = Mesh(np.array(jax.devices()[:S]).reshape(1, S), ("data", "stage"))
    for v in (1, 2):
      params = params_for(2 * S * v, width, features)
      layer_params = sum(x.size for x in jax.tree_util.tree_leaves(params["stages"]))
      for M in (S, 4 * S):
        rng = np.random.default_rng(M)
        batch = {"x": jnp.asarray(rng.normal(size=(M * rows, features)), jnp.float32),
                 "y": jnp.asarray(rng.normal(size=(M * rows, 8)), jnp.float32)}
        for recompute in pl.RECOMPUTE:
          # The layers' matrix products per device: 2 FLOPs a parameter and token
          # forward, twice that backward, a forward more under full recomputation.
          passes = 8 if recompute == "full" else 6
          model_flops = passes * layer_params / S * M * rows
          base = None
          for schedule in ("gpipe", "1f1b", "zb_h1"):
            if schedule == "zb_h1" and v > 1:
              continue
            pipe = pl.Pipeline(embed_fn, stage_fn, head_fn, M, schedule=schedule,
                               virtual_stages=v, recompute=recompute)
            c = compiled(pipe, mesh, params, batch)
            flops = hlo.matmul_flops(c.as_text())
            temp = c.memory_analysis().temp_size_in_bytes
            base = base or (flops, temp)
            print(f"{S:2d} {M:3d} {v:2d} {recompute:9} {schedule:8} "
                  f"{flops / base[0]:10.3f} {flops / model_flops:10.3f} "
                  f"{temp / base[1]:10.3f}", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stages", type=int, default=4)
  ap.add_argument("--virtual", type=int, default=2,
                  help="layer chunks per device of the interleaved rows (1: none)")
  ap.add_argument("--layers-per-stage", type=int, default=2)
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch")
  ap.add_argument("--max-micro", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--quick", action="store_true", help="small sizes, M up to 8")
  ap.add_argument("--work", action="store_true",
                  help="compiled matrix FLOPs and temp bytes over GPipe's, no timing")
  args = ap.parse_args()
  if args.work:
    work_table(args)
    return
  if args.quick:
    args.width, args.max_micro, args.reps = 64, 8, 3
  S, V = args.stages, args.virtual
  if V < 1 or args.layers_per_stage % V:
    raise SystemExit(f"--virtual {V} must divide --layers-per-stage "
                     f"{args.layers_per_stage} (the layers split into S * v chunks)")
  features = 32
  mesh = Mesh(np.array(jax.devices()[:S]).reshape(1, S), ("data", "stage"))
  embed_fn, stage_fn, head_fn = model(args.width, features)
  params = params_for(S * args.layers_per_stage, args.width, features)
  micro_counts = [m for m in (1, 2, 4, 8, 16, 32) if m <= args.max_micro]
  print(f"devices: {jax.devices()[0].platform} x {len(jax.devices())}; S={S}, "
        f"{args.layers_per_stage} layers/stage, width {args.width}, micro-batch "
        f"{args.micro_batch} rows; interleaved rows: v={V}, M a multiple of S")
  print("ideal: (S-1)/(vM+S-1); zb_h1: (S-1)/(3M+S-1), a zb_h1 tick is one of F, B, W "
        "(at equal costs a third of a 1f1b F+B pair, whose B is B and W in one); zb_h1's "
        "B and W each recompute the stage from its input: one forward per micro-batch "
        "more than 1f1b")
  print(f"{'schedule':9} {'M':>3} {'bubble':>7} {'ideal':>7} {'alive':>5} "
        f"{'compile s':>9} {'temp KiB':>9} {'step ms':>8} {'ms/micro':>8}")
  for M in micro_counts:
    rng = np.random.default_rng(M)
    rows = M * args.micro_batch
    batch = {"x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(rows, 8)), jnp.float32)}
    for label, schedule, v in schedules(V):
      if v > 1 and M % S:
        continue
      pipe = pl.Pipeline(embed_fn, stage_fn, head_fn, M, schedule=schedule,
                         virtual_stages=v)
      fn = jax.jit(lambda p, b, pipe=pipe: pipe.value_and_grad(p, b, mesh=mesh,
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
      table = pl.pipeline_schedule_table(schedule, S, M, v)
      bubble, alive = pl.pipeline_bubble_fraction(table), pl.live_slots(table)  # pylint: disable=protected-access
      work = 3 * M if schedule == "zb_h1" else v * M  # the ideal's (S-1)/(work+S-1)
      print(f"{label:9} {M:3d} {bubble:7.3f} {(S - 1) / (work + S - 1):7.3f} "
            f"{alive:5d} {compile_s:9.2f} {temp / 1024:9.1f} {step_ms:8.1f} "
            f"{step_ms / M:8.2f}", flush=True)


if __name__ == "__main__":
  main()
