"""The trainer's grain loader against the direct batch function it replaced.

Measured per batch (microseconds), the variants alternated within each round, medians
over rounds:

- ``direct``: ``TextData.train_batch(seed, step, B, T)``, the pure function of
  ``(seed, step)`` the trainer called before it read data through grain;
- ``grain``: ``next(it)`` of the trainer's loader over the same batches
  (`mpscale.trainer.loader.text_data`; checked equal to ``direct``'s);
- ``user``: a user's source of examples (a list of dicts) through
  `mpscale.trainer.loader.user_data`: shuffled, repeated and batched by grain;
- ``step``: the tiny LM's train step (fp16 config, same B and T), for scale.

Printed: ``grain/direct``, ``user/direct`` and ``(grain - direct)/step``, the loader's
extra cost as a share of a step.

::

  python benchmarks/bench_data.py [--quick] [--batch-size 16] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpscale.trainer import builders, config as config_lib, data as data_lib  # noqa: E402
from mpscale.trainer import loader  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _per_batch(fn, count):
  start = time.perf_counter()
  for _ in range(count):
    fn()
  return (time.perf_counter() - start) / count * 1e6


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer rounds and batches")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  args = parser.parse_args(argv)
  rounds, count = (5, 100) if args.quick else (11, 400)
  bs, seq_len = args.batch_size, args.seq_len
  cfg = config_lib.load_config(
      os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml"),
      [f"data.batch_size={bs}", f"model.seq_len={seq_len}"])
  text = data_lib.load_data()
  grain_it = loader.text_data(text, cfg).iterator()
  for step in range(3):  # the same batches as before
    got, want = next(grain_it), text.train_batch(cfg.seed, step, bs, seq_len)
    assert all(np.array_equal(got[k], want[k]) for k in want), "batches differ"
  rng = np.random.default_rng(0)
  examples = []
  for _ in range(4096):
    row = rng.integers(0, 256, seq_len + 1).astype(np.int32)
    examples.append({"inputs": row[:-1], "targets": row[1:],
                     "mask": np.ones(seq_len, np.float32)})
  user_it = loader.user_data(examples, cfg).iterator()
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  batch = text.train_batch(cfg.seed, 0, bs, seq_len)
  box = {"state": state, "step": 3}

  def direct():
    text.train_batch(cfg.seed, box["step"], bs, seq_len)
    box["step"] += 1

  def train_step():
    box["state"], metrics = setup.step(box["state"], batch)
    jax.block_until_ready(metrics["loss"])

  train_step()  # compile
  variants = {"direct": (direct, count), "grain": (lambda: next(grain_it), count),
              "user": (lambda: next(user_it), count),
              "step": (train_step, max(5, count // 20))}
  times = {name: [] for name in variants}
  for _ in range(rounds):
    for name, (fn, n) in variants.items():  # alternated within each round
      times[name].append(_per_batch(fn, n))
  med = {name: statistics.median(t) for name, t in times.items()}
  print(f"batch {bs} x {seq_len}, {rounds} rounds, medians (us per batch):")
  for name, value in med.items():
    print(f"  {name:7s} {value:10.1f}")
  print(f"grain/direct           {med['grain'] / med['direct']:.2f}")
  print(f"user/direct            {med['user'] / med['direct']:.2f}")
  print(f"(grain - direct)/step  {(med['grain'] - med['direct']) / med['step']:.4f}")


if __name__ == "__main__":
  main()
