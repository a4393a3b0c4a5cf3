"""Tokens per second of the tiny LM's full train step in float32, bfloat16 and float16.

Each precision is the real main-job path: a config (``configs/tiny_lm_fp32.yaml``,
``tiny_lm_bf16.yaml``, ``tiny_lm_fp16.yaml``, i.e. O0, bf16 compute and O2 with dynamic
loss scaling) resized by ``--set``-style overrides, built by `mpscale.trainer.builders.build`
into ``make_train_step`` with CAME or AdamW, clipping and the step's metrics, and fed a
fixed random batch of tokens. Float32 is timed twice: with JAX's default matmul
precision (TF32 tensor cores on NVIDIA Ampere and newer) and with
``jax.default_matmul_precision("highest")`` (true float32 products), because both are
what "fp32 training" means to someone.

Timing alternates the precisions every round (A B C D, B C D A, ...) and reports the
median step time and the median of per-round ratios against float32. Compile time is
excluded. Targets (on an accelerator): bf16 / fp32 and fp16 / fp32 tokens per second
>= 1.5 at a size where the matrix products dominate.

Usage::

    python benchmarks/bench_precision.py                     # d_model 1024, 8 layers
    python benchmarks/bench_precision.py --quick             # tiny, for a CPU smoke run
    python benchmarks/bench_precision.py --optimizer adamw --d-model 2048
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")

# name -> (config file, matmul precision context)
PRECISIONS = {
    "fp32": ("tiny_lm_fp32.yaml", None),
    "fp32-highest": ("tiny_lm_fp32.yaml", "highest"),
    "bf16": ("tiny_lm_bf16.yaml", None),
    "fp16": ("tiny_lm_fp16.yaml", None),
}


def build(name: str, args) -> tuple:
  """``(step, state, batch, tokens per step, precision)`` for one precision."""
  path, precision = PRECISIONS[name]
  d = args.d_model
  overrides = [
      f"model.d_model={d}", f"model.num_heads={max(1, d // 64)}",
      f"model.num_layers={args.layers}", f"model.d_ff={4 * d}",
      f"model.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
      f"optimizer.name={args.optimizer}", "train.per_token_loss=true",
  ]
  cfg = config_lib.load_config(os.path.join(_CONFIGS, path), overrides)
  setup = builders.build(cfg)
  params = builders.init_params(cfg, setup.model)
  state = setup.init(params)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1))
  batch = jax.device_put({"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
                          "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
                          "mask": jnp.ones((args.batch, args.seq_len), jnp.float32)})
  return setup.step, state, batch, args.batch * args.seq_len, precision


def _context(precision):
  return (jax.default_matmul_precision(precision) if precision
          else contextlib.nullcontext())


def run_steps(step, state, batch, n, precision):
  with _context(precision):
    start = time.perf_counter()
    for _ in range(n):
      state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
  return state, metrics, (time.perf_counter() - start) / n


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--optimizer", choices=["came", "adamw"], default="adamw")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--steps", type=int, default=10, help="steps per timed run")
  ap.add_argument("--precisions", default="fp32,fp32-highest,bf16,fp16")
  args = ap.parse_args(argv)
  if args.quick:
    args.d_model, args.layers, args.seq_len, args.batch = 64, 2, 64, 8
    args.rounds, args.steps = 3, 3
  names = [n for n in args.precisions.split(",") if n]
  for n in names:
    if n not in PRECISIONS:
      ap.error(f"--precisions: unknown {n!r}; choose from {', '.join(PRECISIONS)}")

  dev = jax.devices()[0]
  print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); tiny LM d_model "
        f"{args.d_model}, {args.layers} layers, seq {args.seq_len}, batch {args.batch}, "
        f"{args.optimizer}; {args.rounds} rounds x {args.steps} steps, alternating")
  runs = {}
  for name in names:
    step, state, batch, tokens, precision = build(name, args)
    start = time.perf_counter()
    with _context(precision):
      compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    state, metrics, _ = run_steps(step, state, batch, 2, precision)  # warm-up
    runs[name] = dict(step=step, state=state, batch=batch, tokens=tokens,
                      precision=precision, compile_s=compile_s,
                      flops=float(cost.get("flops", float("nan"))), times=[])
    print(f"  built {name:<13s} compile {compile_s:6.2f} s  loss "
          f"{float(metrics['loss']):.4f}  scale {float(metrics['loss_scale']):g}",
          flush=True)

  for r in range(args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      run = runs[name]
      run["state"], _, t = run_steps(run["step"], run["state"], run["batch"],
                                     args.steps, run["precision"])
      run["times"].append(t)

  base = "fp32" if "fp32" in runs else names[0]
  print(f"\n{'precision':<14s}{'step ms':>10s}{'tokens/s':>12s}{'TFLOP/s':>10s}"
        f"{'compile s':>11s}{'speed-up vs ' + base:>18s}")
  for name in names:
    run = runs[name]
    ms = statistics.median(run["times"])
    speedup = statistics.median(b / t for b, t in zip(runs[base]["times"], run["times"]))
    target = ""
    if name in ("bf16", "fp16") and base == "fp32":
      target = f"  (target >= 1.5: {'PASS' if speedup >= 1.5 else 'MISS'})"
    print(f"{name:<14s}{1e3 * ms:10.2f}{run['tokens'] / ms:12.0f}"
          f"{run['flops'] / ms / 1e12:10.1f}{run['compile_s']:11.2f}{speedup:18.2f}{target}")


if __name__ == "__main__":
  main()
