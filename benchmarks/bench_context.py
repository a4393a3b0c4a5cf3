"""Context parallelism on H100s, read from the H100 program (no GPU needed).

Llama 3.1 8B (configs/llama3.1_8b.yaml: bf16, each layer recomputed, AdamW), one
sequence a step of 8k to 128k tokens, its sequence split over ``mesh.context`` on
8 to 32 H100s (the parameters and optimizer state split over the same devices, as
FSDP splits them), ring against all-gather, each compiled for the GPUs by XLA's
CUDA compiler (`mpscale.trainer.planning.compiled.plan`, ``h100-80g``) and priced by
the planner's step-time estimate. Printed, per run: a device's peak memory and
temporaries, whether it fits in 80 GB, the planned step and tokens a second a GPU,
the ring's K/V transfers with kernels scheduled between their start and their done
(count, and bytes), the share of collective time the program hides, and the causal
balance of the sequence's order (the largest device's attention work over the
mean). Then the ratios the issue sets: peak memory at 32k on context 8 over the same
run on one device (target <= 0.2), the balance (<= 1.1), 128k on 16 H100s within 80
GB, and ring over all-gather (step and memory) at each length.

Needs JAX's CUDA plugin (``pip install "mpscale[plan-gpu]"``):

  python benchmarks/bench_context.py [--lengths 8192,32768,131072]
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from mpscale import parallel  # noqa: E402
from mpscale.trainer.config import load as config_lib  # noqa: E402
from mpscale.trainer.planning import compiled  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "configs", "llama3.1_8b.yaml")
GIB = 2 ** 30


def _plan(length: int, context: int, mode: str = "ring"):
  overrides = [f"model.seq_len={length}", "data.batch_size=1", "mesh.fsdp=1",
               f"mesh.context={context}", f"model.context_parallel={mode}"]
  cfg = config_lib.load_config(CONFIG, overrides=overrides)
  return compiled.plan(cfg, hardware="h100-80g", compiler="target")


def balance(length: int, context: int) -> float:
  """The largest device's causal (query, key) pairs over the mean, in the balanced
  order (`mpscale.parallel.context_order`)."""
  order = parallel.context_order(length, context)
  work = [float(np.sum(rows + 1)) for rows in np.split(order, context)]
  return max(work) / float(np.mean(work))


def _overlapped(planned) -> tuple[int, int, float]:
  """The context permutes: how many, how many with kernels between start and done,
  and the share of their bytes those move."""
  rows = [o for o in planned.overlaps
          if o["collective"].startswith("collective-permute over context")]
  busy = [o for o in rows if o["window"].get("bytes", 0) or o["window"].get("dots")]
  total = sum(o["bytes"] * o["count"] for o in rows) or 1
  return len(rows), len(busy), sum(o["bytes"] * o["count"] for o in busy) / total


def _row(label: str, planned, length: int, context: int) -> dict:
  est = planned.estimate
  peak, temps = planned.bytes["peak"], planned.bytes["temporaries"]
  permutes, busy, share = _overlapped(planned)
  hidden = est.hidden / max(est.hidden + est.collectives, 1e-12)
  row = dict(label=label, peak=peak / GIB, temps=temps / GIB, fits=peak <= 80e9,
             step=est.seconds, tps=est.tokens_per_second / max(context, 1),
             permutes=permutes, busy=busy, busy_bytes=share, hidden=hidden,
             balance=balance(length, context) if context > 1 else 1.0)
  print(f"{label:28s} {row['peak']:7.1f} {row['temps']:7.1f} "
        f"{'yes' if row['fits'] else 'no':>4s} {row['step']:8.3f} {row['tps']:9.0f} "
        f"{busy:3d}/{permutes:<3d} {share:6.0%} {hidden:6.0%} {row['balance']:5.2f}",
        flush=True)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="8192,32768,131072")
  args = parser.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  print(f"{'run':28s} {'peak':>7s} {'temps':>7s} {'fits':>4s} {'step s':>8s} "
        f"{'tok/s/gpu':>9s} {'overlapped':>7s} {'bytes':>6s} {'hidden':>6s} "
        f"{'bal':>5s}")
  print(f"{'':28s} {'GiB':>7s} {'GiB':>7s}")
  rows = {}
  runs = [(n, c) for n in lengths for c in ((8,) if n < 65536 else (16, 32))]
  if 32768 in lengths:
    rows[(32768, 1, "one")] = _row("32k, one H100", _plan(32768, 1), 32768, 1)
  for length, context in runs:
    for mode in ("ring", "all_gather"):
      label = f"{length // 1024}k, context {context}, {mode}"
      rows[(length, context, mode)] = _row(label, _plan(length, context, mode),
                                           length, context)
  print()
  if (32768, 1, "one") in rows:
    one = rows[(32768, 1, "one")]["peak"]
    for mode in ("ring", "all_gather"):
      ratio = rows[(32768, 8, mode)]["peak"] / one
      print(f"peak memory, 32k on context 8 ({mode}) / one H100: {ratio:.3f} "
            f"(target <= 0.2)")
  for length, context in runs:
    ring, gather = rows[(length, context, "ring")], rows[(length, context, "all_gather")]
    print(f"{length // 1024}k on {context}: ring / all-gather step "
          f"{ring['step'] / gather['step']:.3f}, peak {ring['peak'] / gather['peak']:.3f}; "
          f"balance {ring['balance']:.3f} (target <= 1.1)")
  if (131072, 16, "ring") in rows:
    row = rows[(131072, 16, "ring")]
    print(f"128k on 16 H100s: peak {row['peak']:.1f} GiB, fits in 80 GB: {row['fits']}")


if __name__ == "__main__":
  main()
