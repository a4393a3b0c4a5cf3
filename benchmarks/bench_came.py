"""Update-step cost of `mpscale.came` against optax.adamw, optax.adafactor and, when
torch is installed, came-pytorch 0.1.3 and pytorch_optimizer's CAME, on a GPT-2-small-like
parameter tree.

Every JAX implementation is timed as one jitted unit::

    step(params, opt_state, grads) -> (new_params, new_opt_state)

doing ``tx.update`` plus ``optax.apply_updates`` with ``params`` and ``opt_state``
donated, called back to back and ended with ``block_until_ready``. The torch optimizers
are timed as ``opt.step()`` with the gradients already in ``p.grad``, with
``torch.set_num_threads`` set to the number of CPU cores XLA uses.

Timing is round-robin: each round times every implementation (in a shuffled order) for
``--reps`` back-to-back steps and takes the median step time; each ratio is formed
between two implementations measured in the same round, and the reported ratio is the
median of these paired ratios over ``--rounds`` rounds. Compilation and one warm-up step
are not timed.

Targets (printed as PASS/MISS; the script always exits 0, it is a benchmark):

  came / optax.adamw           <= 1.30 (and within 2x of the HBM bound, on a GPU)
  came-pytorch / came          >= 3
  pytorch_optimizer / came     >= 2

Also printed: optimizer-state bytes against optax.adamw, and with ``--hlo`` the number of
top-level fusions and of passes over gradient-sized arrays in each compiled step.

What limits came / adamw on XLA:CPU (jaxlib 0.10, measured on this tree):

* A gradient-sized temporary is allocated afresh at every step and its pages are
  faulted in again: a straightforward CAME (one ``g**2``, one ``u`` shared by several
  reductions) made ~14k page faults per step on the ``--quick`` tree and ran at ~4x
  adamw. mpscale's CAME gives
  every gradient-sized expression a single consumer, so it allocates none (~0 faults).
* Each matrix then needs seven passes: row and column sums of ``g**2``, the sum of
  ``u**2`` (the clip), the momentum, row and column sums of the instability, and the
  update fused with ``apply_updates``: 11 gradient-sized reads and 2 writes, against
  adamw's single fused pass (4 reads, 3 writes). XLA:CPU cannot fuse a row reduction,
  a column reduction and an elementwise output into one loop.
* Reductions run through a library kernel that is slower on column reductions and on
  broadcast factors than on plain row sums. Even if every reduction read at the speed
  of a plain row sum, the seven passes would cost about 2x adamw.

Usage::

    python benchmarks/bench_came.py            # ~35M params, 41 leaves
    python benchmarks/bench_came.py --quick    # ~9M params, 17 leaves, fewer rounds
    python benchmarks/bench_came.py --no-torch --rounds 20
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import statistics
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpscale
from gpt2_tree import gpt2_like_shapes, is_shape  # benchmarks/gpt2_tree.py

LR = 1e-3
GRAD_STD = 1e-3


def make_tree(shapes: dict, seed: int, scale: float) -> dict:
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda s: (scale * rng.standard_normal(s)).astype(np.float32), shapes,
      is_leaf=is_shape)


class Impl(NamedTuple):
  key: str
  label: str
  setup: Callable[[], Callable[[], None]]
  """Builds the implementation's own params and state; returns ``run(reps)``."""
  state_bytes: Optional[Callable[[], int]] = None


def jax_impl(key: str, label: str, tx: optax.GradientTransformation, params: dict,
             grads: dict) -> Impl:
  holder: dict[str, Any] = {}

  def setup():
    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    p = jax.tree_util.tree_map(jnp.asarray, params)
    g = jax.tree_util.tree_map(jnp.asarray, grads)
    s = tx.init(p)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, g).compile()
    holder["hlo"] = compiled.as_text()
    holder["bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(s))
    box = [p, s]

    def run(reps: int):
      for _ in range(reps):
        box[0], box[1] = compiled(box[0], box[1], g)
      jax.block_until_ready(box)

    run(1)  # warm-up
    return run

  impl = Impl(key, label, setup, lambda: holder["bytes"])
  impl_holders[key] = holder
  return impl


impl_holders: dict[str, dict] = {}


def torch_impl(key: str, label: str, make_opt: Callable, params: dict,
               grads: dict) -> Impl:
  def setup():
    import torch
    tensors = [torch.nn.Parameter(torch.from_numpy(np.array(p)))
               for p in jax.tree_util.tree_leaves(params)]
    for t, g in zip(tensors, jax.tree_util.tree_leaves(grads)):
      t.grad = torch.from_numpy(np.array(g))
    opt = make_opt(tensors)

    def run(reps: int):
      with torch.no_grad():
        for _ in range(reps):
          opt.step()

    run(1)
    return run

  return Impl(key, label, setup)


def big_passes(compiled_text: str, big: int) -> tuple[int, int, int]:
  """(top-level fusions, gradient-sized operands read, gradient-sized results written)
  over the ENTRY computation of a compiled module: how many passes over big arrays."""
  entry = compiled_text[compiled_text.index("ENTRY"):].split("\n}\n")[0]
  sizes: dict[str, int] = {}
  fusions = reads = writes = 0
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\((.*?)\)", line)
    if not m:
      continue
    name, shape, op, operands = m.groups()
    dims = re.findall(r"\[([0-9,]*)\]", shape)
    size = max((int(np.prod([int(x) for x in d.split(",") if x])) for d in dims),
               default=1)
    sizes[name] = size
    if op in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
      continue
    fusions += op == "fusion"
    reads += sum(sizes.get(o, 0) >= big for o in re.findall(r"%([\w.\-]+)", operands))
    writes += size >= big and "(" not in shape
  return fusions, reads, writes


def copy_bandwidth(nbytes: int = 2**30, reps: int = 20) -> float:
  """Device memory bandwidth in bytes/s (read + write) of a jitted ``x + 1`` over a
  float32 array of ``nbytes``: the roofline the optimizers are measured against."""
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda v: v + 1, donate_argnums=0)
  x = jax.block_until_ready(f(x))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    x = jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  del x
  return 2 * nbytes / statistics.median(times)


# Minimal passes over gradient-sized float32 arrays, in units of one parameter tree
# (reads + writes), for an update fused as far as the algorithm allows:
#   adamw: read g, p, mu, nu; write p, mu, nu                                    = 7
#   came (factored matrices): read g for the row/column sums of g^2; read g again
#     for the sum of u^2 (the clip needs the new factors); read g, mu and write mu
#     while reducing the instability (u - mu)^2 to rows/columns; read mu, p and
#     write p (the update needs the instability factors)                       = 8
MIN_TREE_PASSES = {"adamw": 7, "came": 8}


def print_bandwidth_bound(times: dict, leaves: list) -> None:
  """Each JAX optimizer's median step time against the HBM bound of its minimal
  passes (only meaningful on an accelerator)."""
  if jax.devices()[0].platform == "cpu":
    return
  tree_bytes = sum(x.size for x in leaves) * 4
  bandwidth = copy_bandwidth()
  print(f"\nmemory bound (copy bandwidth {bandwidth / 1e12:.2f} TB/s, measured now; "
        f"one tree = {tree_bytes / 2**20:.1f} MiB):")
  for k, passes in MIN_TREE_PASSES.items():
    bound = passes * tree_bytes / bandwidth
    t = statistics.median(times[k])
    print(f"  {k:10s} {passes} tree passes = {passes * tree_bytes / 2**20:7.1f} MiB, "
          f"bound {1e3 * bound:7.3f} ms, measured {1e3 * t:7.3f} ms = {t / bound:5.2f} x "
          f"bound" + ("  (target <= 2: " + ("PASS" if t / bound <= 2 else "MISS") + ")"
                      if k == "came" else ""))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="1 block, vocab 4096 (9M params, 17 leaves), 5 rounds")
  ap.add_argument("--rounds", type=int, default=None, help="rounds (default 8)")
  ap.add_argument("--reps", type=int, default=3, help="steps per impl per round")
  ap.add_argument("--no-torch", action="store_true", help="skip the torch optimizers")
  ap.add_argument("--hlo", action="store_true", help="print compiled-HLO pass counts")
  ap.add_argument("--dump-hlo", default=None, metavar="DIR",
                  help="write each JAX impl's compiled HLO text to DIR/came_<key>.txt")
  args = ap.parse_args(argv)
  rounds = args.rounds or (5 if args.quick else 8)
  shapes = (gpt2_like_shapes(vocab=4096, layers=1) if args.quick
            else gpt2_like_shapes())
  params = make_tree(shapes, 0, 0.02)
  grads = make_tree(shapes, 1, GRAD_STD)
  leaves = jax.tree_util.tree_leaves(params)
  n_params = sum(x.size for x in leaves)
  threads = os.cpu_count() or 1
  print(f"tree: {n_params / 1e6:.1f}M params in {len(leaves)} leaves; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {threads} CPU cores, "
        f"{platform.processor() or platform.machine()}")

  impls = [
      jax_impl("came", "mpscale.came", mpscale.came(LR), params, grads),
      jax_impl("adamw", "optax.adamw", optax.adamw(LR), params, grads),
      jax_impl("adafactor", "optax.adafactor", optax.adafactor(LR), params, grads),
      jax_impl("came(stack_layers)", "mpscale.came(stack_layers)",
               mpscale.came(LR, stack_layers=True), params, grads),
  ]
  state_only = {
      "came(compression)": mpscale.came(LR, compression=True),
  }
  if not args.no_torch:
    try:
      import torch
      torch.set_num_threads(threads)
      from came_pytorch import CAME as CamePytorch
      impls.append(torch_impl("came-pytorch", "came_pytorch.CAME 0.1.3",
                              lambda ps: CamePytorch(ps, lr=LR), params, grads))
      try:
        from pytorch_optimizer import CAME as CamePO
        impls.append(torch_impl("pytorch_optimizer", "pytorch_optimizer.CAME",
                                lambda ps: CamePO(ps, lr=LR), params, grads))
      except ImportError:
        print("pytorch_optimizer not installed: skipped")
    except ImportError:
      print("torch / came-pytorch not installed: torch comparisons skipped")

  runs = {}
  for impl in impls:
    t0 = time.perf_counter()
    runs[impl.key] = impl.setup()
    print(f"  set up {impl.label:28s} in {time.perf_counter() - t0:6.1f} s")

  times: dict[str, list[float]] = {k: [] for k in runs}
  order = list(runs)
  for _ in range(rounds):
    random.shuffle(order)
    for k in order:
      steps = []
      for _ in range(args.reps):
        t0 = time.perf_counter()
        runs[k](1)
        steps.append(time.perf_counter() - t0)
      times[k].append(statistics.median(steps))

  print(f"\nmedian step time over {rounds} rounds x {args.reps} steps:")
  for impl in impls:
    print(f"  {impl.label:28s} {1e3 * statistics.median(times[impl.key]):9.2f} ms")

  def ratio(a, b):
    return statistics.median(x / y for x, y in zip(times[a], times[b]))

  print("\nmedian of paired ratios:")
  checks = [("came", "adamw", "<=", 1.30), ("came", "adafactor", None, None),
            ("adafactor", "adamw", None, None),
            ("came(stack_layers)", "came", None, None),
            ("came-pytorch", "came", ">=", 3.0),
            ("pytorch_optimizer", "came", ">=", 2.0)]
  for a, b, op, target in checks:
    if a not in times or b not in times:
      continue
    r = ratio(a, b)
    verdict = ""
    if op is not None:
      ok = r <= target if op == "<=" else r >= target
      verdict = f"  (target {op} {target:g}: {'PASS' if ok else 'MISS'})"
    print(f"  {a:>18s} / {b:<10s} {r:6.2f}{verdict}")

  print("\noptimizer-state bytes:")
  adamw_bytes = impl_holders["adamw"]["bytes"]
  rows = [(k, impl_holders[k]["bytes"]) for k in ("came", "adafactor", "adamw")]
  rows += [(k, sum(x.size * jnp.dtype(x.dtype).itemsize for x in
               jax.tree_util.tree_leaves(jax.eval_shape(tx.init, params))))
           for k, tx in state_only.items()]
  for k, b in rows:
    print(f"  {k:18s} {b / 2**20:9.1f} MiB  ({b / adamw_bytes:.3f} x adamw)")

  print_bandwidth_bound(times, leaves)

  if args.dump_hlo:
    os.makedirs(args.dump_hlo, exist_ok=True)
    for k in ("came", "adamw", "adafactor"):
      with open(os.path.join(args.dump_hlo, f"came_{k}.txt"), "w") as fh:
        fh.write(impl_holders[k]["hlo"])

  if args.hlo:
    big = min(x.size for x in leaves if x.ndim == 2)
    print(f"\ncompiled step (top level; 'big' = >= {big} elements):")
    for k in ("came", "adamw", "adafactor"):
      fusions, reads, writes = big_passes(impl_holders[k]["hlo"], big)
      print(f"  {k:10s} fusions {fusions:4d}   big reads {reads:4d}   "
            f"big writes {writes:4d}")


if __name__ == "__main__":
  main()
