"""Issue #64 item 4: CAME's state stacked by role (``mpscale.came(stack_layers=True)``)
against its per-leaf state and ``optax.adamw``, on the H100 program of the GPT-2 tree
of `bench_gpu_program` (12 layers, vocab 8192, untied head: 149 leaves), compiled
for one H100 without a GPU (``jax.experimental.topologies``), under each spelling of
the layer numbers: ``h/0`` (a digit key), ``h[0]`` (a list) and linen's ``h_0``; then
on GPT-2 small's 124M tree (vocab 50257, tied head) with linen's names. Each alone and
inside `mpscale.dynamic_loss_scale` (which skips a non-finite step).

Stacked, each statistic of the 12 layers' ``c_fc`` kernels is one array (a
``[12, 768, 3072]`` momentum, ``[12, 768]`` and ``[12, 3072]`` factored
statistics), the update runs once per stack (XLA's GPU compiler fuses the stacking
of the gradients into the reductions that read them), and each parameter's update
reads its layer of its stack's direction.

Columns: ``kernels`` (`mpscale.trainer.planning.hlo.launches`), ``reductions`` (the
entry's ``kInput`` fusions), ``GiB`` (`mpscale.trainer.planning.hlo.kernels`, which
counts a layer read by a static slice of a stack, through element-wise ops, as that
layer) and the compiled temporaries::

  JAX_PLATFORMS=cpu python benchmarks/came_stacked_study.py   # ~5 min, 2 cores
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mpscale  # noqa: E402
from bench_gpu_program import h100_device, optimizer_row, placed  # noqa: E402
from gpt2_tree import gpt2_like_shapes, is_shape  # noqa: E402

TREES = (("slash", 8192, False), ("list", 8192, False), ("linen", 8192, False),
         ("linen", 50257, True))
"""(layer names, vocab, tied head) of each GPT-2 tree (12 layers)."""

STEPS = {
    "adamw": lambda: optax.adamw(1e-3),
    "mpscale.came": lambda: mpscale.came(1e-3),
    "mpscale.came(stack_layers)": lambda: mpscale.came(1e-3, stack_layers=True),
    "dls(adamw)": lambda: mpscale.dynamic_loss_scale(optax.adamw(1e-3)),
    "dls(came)": lambda: mpscale.dynamic_loss_scale(mpscale.came(1e-3)),
    "dls(came(stack_layers))": lambda: mpscale.dynamic_loss_scale(
        mpscale.came(1e-3, stack_layers=True)),
}


def main():
  dev, why = h100_device()
  if dev is None:
    print(f"skipped: no H100 compiler here ({why})")
    return
  print("| tree | step | kernels | /adamw | reductions | GiB | /adamw | temp MiB |")
  print("|---|---|---|---|---|---|---|---|")
  for names, vocab, tied in TREES:
    shapes = gpt2_like_shapes(layers=12, vocab=vocab, untied_head=not tied,
                              names=names)
    params = placed(jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape), dev)
    rows = {name: optimizer_row(params, make(), dev) for name, make in STEPS.items()}
    base = rows["adamw"]
    tree = f"{names}, vocab {vocab}{', tied' if tied else ''}"
    for name, r in rows.items():
      print(f"| {tree} | {name} | {r['kernels']} | "
            f"{r['kernels'] / base['kernels']:.2f} | {r['reductions']} | "
            f"{r['bytes'] / 2**30:.3f} | {r['bytes'] / base['bytes']:.2f} | "
            f"{r['temp'] / 2**20:.1f} |")


if __name__ == "__main__":
  main()
