"""Does FSDP's per-product weight gather overlap compute? mpscale's one-product
lookahead against the gathers it replaced, on XLA's H100 compiler (no GPU needed).

`mpscale.parallel` gathers each weight where a matrix product uses it, under
``jax.checkpoint`` (the backward gathers it again). Since issue #47 it gathers a
weight once the *previous* product's input is there, one product ahead
(`_Split.product`, scoped by `_Split.body` to the step, a scan step or a remat
body). The two variants before it are patched in here (nothing in ``mpscale``
edited) to show what the lookahead changed:

  own input                the code before: an ``lax.optimization_barrier`` over the
                           product's own operands, so a weight is gathered once its
                           own product's input is there (no prefetch)
  tie-only                 the weights' barrier over the previous product's input
                           instead, and nothing else (XLA's all-gather combiner may
                           merge consecutive gathers into one that waits for the
                           later input)
  lookahead (mpscale now)  `_Split.product` as it is: that barrier plus a 1-element
                           token of the previous gathered weight (no merging), the
                           own-input barrier kept for the backward with the shard's
                           cotangent routed through it (`batch_split._route`)

For each model and variant this compiles the FSDP train step for 8 H100s
(``jax.experimental.topologies``; shapes only, nothing runs) and prints the compiled
temporaries, the collectives, and, for every ``all-gather-start``/``all-gather-done``
pair in the entry computation and in loop bodies (the compiled text is scheduled: its
order is the order the GPU's stream is fed), whether compute ops (fusion,
custom-call, dot, convolution) and matrix products (gemm fusions, dots, cuBLAS calls)
are scheduled between them, forward and backward apart. ``--check`` first compares
the loss and every gradient of each variant with mpscale's and with the loss without
``batch_split``, on 8 CPU devices.

::

  JAX_PLATFORMS=cpu python benchmarks/fsdp_prefetch_study.py            # linen LM
  JAX_PLATFORMS=cpu python benchmarks/fsdp_prefetch_study.py --models all --check
  JAX_PLATFORMS=cpu python benchmarks/fsdp_prefetch_study.py --pairs    # every pair

(needs ``jax[cuda12]`` installed for the H100 compiler; ``--cpu`` compiles for the
CPU instead.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_fsdp  # noqa: E402
from mpscale.parallel import _batch_split as batch_split  # noqa: E402
from mpscale.trainer.planning import hlo
from mpscale import _jaxprs as jaxprs
from mpscale import parallel

_Split = batch_split._Split
NOW = "lookahead (mpscale now)"


# ------------------------------------------------------ the variants it replaced
def _own_input_product(self, eqn, values, specs):
  """`_Split.product` before issue #47's lookahead: the weights tied to the
  product's own input, so each is gathered once that input is there."""
  def gathered(*values):
    values = lax.optimization_barrier(values)
    return jaxprs.bind(eqn, [x if s is None else parallel.constrain(x, s, self.mesh)
                             for x, s in zip(values, specs)])
  return list(jax.checkpoint(gathered)(*values))


def _naive_product(self, eqn, values, specs):
  """`_Split.product` with the weights' barrier over the *previous* product's input
  (``self.previous``, reset by `_Split.body` for each step, scan step and remat
  body) instead of its own, and nothing else."""
  inputs = [x for x, s in zip(values, specs) if s is None]
  tie = self.previous or inputs
  self.previous = inputs
  n = len(values)

  def gathered(*args):
    values, tie = list(args[:n]), args[n:]
    w = [i for i, s in enumerate(specs) if s is not None]
    _, ws = lax.optimization_barrier((tie, [values[i] for i in w]))
    for i, x in zip(w, ws):
      values[i] = x
    return jaxprs.bind(eqn, [x if s is None else parallel.constrain(x, s, self.mesh)
                             for x, s in zip(values, specs)])
  return list(jax.checkpoint(gathered)(*values, *tie))


def _patched(product):
  @contextlib.contextmanager
  def ctx():
    saved = _Split.product
    _Split.product = product
    try:
      yield
    finally:
      _Split.product = saved
  return ctx


VARIANTS = {"own input": _patched(_own_input_product),
            "tie-only": _patched(_naive_product),
            NOW: contextlib.nullcontext}


# ------------------------------------------------------------------- the HLO reading
COMPUTE = ("fusion", "custom-call", "dot", "convolution")


class Pair(NamedTuple):
  """An ``all-gather-start`` and its ``all-gather-done`` in a scheduled computation."""
  computation: str
  start: str
  mib: float
  """What it gathers (the done's result), MiB."""
  compute: int
  """Compute ops (`COMPUTE`) scheduled between start and done."""
  matmuls: int
  """Of those, matrix products (gemm fusions, dots, cuBLAS calls)."""
  backward: bool
  """From the backward (its op_name has ``transpose(``)."""
  lines: tuple


def _is_matmul(ins):
  if ins.op in ("dot", "convolution"):
    return True
  text = ins.name + ins.rest
  return ins.op in ("fusion", "custom-call") and (
      "gemm" in text or "cublas" in text or "__triton" in text)


def gather_pairs(text):
  """Every all-gather start/done pair in the entry computation and in loop bodies
  (the compiled text is scheduled: its order is the order the stream is fed)."""
  module = hlo.parse(text)
  bodies = {x.split(",")[0].split("}")[0].strip().lstrip("%")
            for inss in module.computations.values() for ins in inss
            if ins.op == "while" for x in ins.rest.split("body=")[1:]}
  out = []
  for comp, inss in module.computations.items():
    if comp != module.entry and comp not in bodies:
      continue
    for k, ins in enumerate(inss):
      if ins.op != "all-gather-start":
        continue
      done = next(j for j in range(k + 1, len(inss)) if inss[j].op == "all-gather-done"
                  and inss[j].rest.split(")")[0].strip().lstrip("%") == ins.name)
      between = inss[k + 1:done]
      op_name = ins.rest.split('op_name="')[1].split('"')[0] if 'op_name="' in ins.rest else ""
      out.append(Pair(comp, ins.name, hlo._shape_bytes(inss[done].result) / 2.0**20,
                      sum(i.op in COMPUTE for i in between),
                      sum(_is_matmul(i) for i in between),
                      "transpose(" in op_name, (k, done)))
  return out


# ---------------------------------------------------------------------- the checks
def check_values(models, rows, seq):
  """Loss and gradients of each variant against mpscale's (`NOW`) and against the
  loss without `batch_split`, on 8 CPU devices."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(1, 8), ("data", "fsdp"))

  def worst(xs, ys):
    return max(float(np.max(np.abs(np.asarray(x, np.float64)
                                   - np.asarray(y, np.float64))))
               for x, y in zip(xs, ys))

  for name, (shapes, loss_fn, _) in models.items():
    leaves = jax.tree_util.tree_leaves(shapes)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shapes),
        [0.05 * jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)])
    specs = parallel.fsdp_specs(params, mesh)
    params = jax.device_put(params, jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=parallel.is_spec))
    ids = jax.random.randint(jax.random.key(2), (rows, seq), 0, 512)
    batch = jax.device_put({"inputs": ids, "targets": jnp.roll(ids, -1, 1)},
                           NamedSharding(mesh, P(("data", "fsdp"))))
    got = {}
    for variant, ctx in VARIANTS.items():
      with ctx():
        f = batch_split.keep_batch_split(loss_fn, mesh, ("data", "fsdp"), specs)
        got[variant] = jax.tree_util.tree_leaves(
            jax.jit(jax.value_and_grad(f))(params, batch))
    plain = jax.tree_util.tree_leaves(jax.jit(jax.value_and_grad(loss_fn))(params, batch))
    for variant, leaves in got.items():
      vs_now = ""
      if variant != NOW:
        same = all(np.array_equal(x, y) for x, y in zip(got[NOW], leaves))
        vs_now = ("bitwise equal to mpscale's" if same else
                  f"differ from mpscale's, max |diff| {worst(got[NOW], leaves):.1e}")
        vs_now += "; "
      print(f"  {name:<10} {variant:<24} loss and every gradient {vs_now}"
            f"vs no batch_split max |diff| {worst(leaves, plain):.1e}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cpu", action="store_true", help="the CPU compiler, not H100's")
  ap.add_argument("--models", default="linen LM",
                  help="comma-separated names from bench_fsdp.models, or 'all'")
  ap.add_argument("--width", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--seq", type=int, default=320)
  ap.add_argument("--rows", type=int, default=16, help="global batch (sequences)")
  ap.add_argument("--pairs", action="store_true", help="print every gather pair")
  ap.add_argument("--check", action="store_true",
                  help="compare values on 8 CPU devices first (a small model)")
  args = ap.parse_args(argv)

  def pick(ms):
    return ms if args.models == "all" else {k: ms[k] for k in args.models.split(",")}

  if args.check:
    print("values on 8 CPU devices (width 64, 2 layers, 16 x 32 tokens):")
    check_values(pick(bench_fsdp.models(64, 2, 512, 32)), 16, 32)

  mesh = Mesh(np.array(bench_fsdp.devices(not args.cpu)).reshape(1, 8),
              ("data", "fsdp"))
  print(f"\n{'CPU' if args.cpu else 'H100 (XLA GPU compiler)'}: width {args.width}, "
        f"{args.layers} layers, {args.rows} x {args.seq} tokens, FSDP over 8\n"
        "gathers overlapped: with at least one matmul (compute op) between start and "
        "done, of all pairs")
  print(f"{'model':<10}{'variant':<24}{'temp MiB':>9}{'forward':>14}{'backward':>14}"
        f"{'MiB hidden/gathered':>21}  collectives (count, MiB)")
  for name, (params, loss_fn, _) in pick(bench_fsdp.models(
      args.width, args.layers, 512, args.seq)).items():
    for variant, ctx in VARIANTS.items():
      with ctx():
        comp = bench_fsdp.compile_step(params, loss_fn, mesh, "fsdp", args.rows,
                                       args.seq)
      temp = comp.memory_analysis().temp_size_in_bytes / 2.0**20
      text = comp.as_text()
      pairs = gather_pairs(text)
      cols = []
      for back in (False, True):
        ps = [p for p in pairs if p.backward == back]
        cols.append(f"{sum(p.matmuls > 0 for p in ps)}({sum(p.compute > 0 for p in ps)})"
                    f"/{len(ps)}")
      hidden = sum(p.mib for p in pairs if p.matmuls)
      coll = ", ".join(f"{k} {v['count']}x {v['bytes'] / 2.0**20:.0f}"
                       for k, v in sorted(hlo.collectives(text).items()))
      print(f"{name:<10}{variant:<24}{temp:>9.1f}{cols[0]:>14}{cols[1]:>14}"
            f"{hidden:>11.0f}/{sum(p.mib for p in pairs):<9.0f}  {coll}")
      if args.pairs:
        for p in pairs:
          where = "entry" if p.computation == hlo.parse(text).entry else p.computation
          print(f"    {where[:20]:<20} {p.start:<22}{p.mib:7.2f} MiB  lines "
                f"{p.lines[0]:>5}-{p.lines[1]:<5} compute {p.compute:>3} "
                f"matmul {p.matmuls:>3}  {'bwd' if p.backward else 'fwd'}")


if __name__ == "__main__":
  sys.exit(main())
