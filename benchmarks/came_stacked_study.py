"""Issue #64 item 4: CAME's state stacked by role (``mpscale.came(stack_layers=True)``)
against its per-leaf state and ``optax.adamw``, on the H100 program of the GPT-2 tree
of `bench_gpu_program` (12 layers, vocab 8192, untied head: 149 leaves), compiled
for one H100 without a GPU (``jax.experimental.topologies``), under each spelling of
the layer numbers: ``h/0`` (a digit key), ``h[0]`` (a list) and linen's ``h_0``.

Stacked, each statistic of the 12 layers' ``c_fc`` kernels is one array (a
``[12, 768, 3072]`` momentum, ``[12, 768]`` and ``[12, 3072]`` factored
statistics), the update runs once per stack (XLA's GPU compiler fuses the stacking
of the gradients into the reductions that read them), and each parameter's update
reads its layer of its stack's direction.

Columns: ``kernels`` (`mpscale.trainer.planning.hlo.launches`), ``reductions`` (the
entry's ``kInput`` fusions), ``GiB`` (`mpscale.trainer.planning.hlo.kernels`, which
counts a layer read by a static slice of a stack, through element-wise ops, as that
layer) and the compiled temporaries::

  JAX_PLATFORMS=cpu python benchmarks/came_stacked_study.py   # ~2 min, 2 cores
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu_program import h100_device, optimizer_rows  # noqa: E402

ROWS = ("adamw", "mpscale.came", "mpscale.came(stack_layers)")


def main():
  dev, why = h100_device()
  if dev is None:
    print(f"skipped: no H100 compiler here ({why})")
    return
  print("| names | step | kernels | /adamw | reductions | GiB | /adamw | temp MiB |")
  print("|---|---|---|---|---|---|---|---|")
  for names in ("slash", "list", "linen"):
    rows = {name: build() for name, _, build in optimizer_rows(12, dev, names=names)
            if name in ROWS}
    base = rows["adamw"]
    for name in ROWS:
      r = rows[name]
      print(f"| {names} | {name} | {r['kernels']} | "
            f"{r['kernels'] / base['kernels']:.2f} | {r['reductions']} | "
            f"{r['bytes'] / 2**30:.3f} | {r['bytes'] / base['bytes']:.2f} | "
            f"{r['temp'] / 2**20:.1f} |")


if __name__ == "__main__":
  main()
