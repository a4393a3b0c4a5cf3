"""Does FSDP's per-product weight gather overlap compute? Baseline against a
one-product lookahead, on XLA's H100 compiler (no GPU needed).

`mpscale.batch_split` gathers each weight where a matrix product uses it, under
``jax.checkpoint``, and ties the gather to that product's own input with
``lax.optimization_barrier`` so XLA does not hoist every layer's gather to the step's
start. The *lookahead* variant (patched in here, `lookahead`) ties each weight's
gather to the input of the *previous* product instead (one product of prefetch), so
product k+1's gather may start while product k runs.

For each model and variant this compiles the FSDP train step for 8 H100s
(``jax.experimental.topologies``; shapes only, nothing runs) and prints the compiled
temporaries and, for every ``all-gather-start``/``all-gather-done`` pair in the entry
computation and in loop bodies (the compiled text is scheduled: its order is the
order the GPU's stream is fed), how many compute ops (fusion, custom-call, dot,
convolution) and how many matrix products (gemm fusions, dots, cuBLAS calls) are
scheduled between them. ``--check`` first compares the loss and gradients of the two
variants on 8 CPU devices.

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

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax._src import core as jax_core  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_fsdp  # noqa: E402
from mpscale import batch_split, hlo, jaxprs, sharding  # noqa: E402

_Split = batch_split._Split


# ------------------------------------------------------------- the lookahead variant
def _lookahead_product(self, eqn, values, specs):
  """`_Split.product` with each weight's gather tied to the *previous* product's
  input (the operands that are not weights) rather than its own: one product of
  prefetch. The first product of a trace (a step, a scan body) ties to its own."""
  inputs = [x for x, s in zip(values, specs) if s is None]
  prev = getattr(self, "_prev", None)
  # Only a value of the trace being built: never a scan body's value outside it.
  tie = prev[1] if prev is not None and prev[0] is jax_core.trace_ctx.trace else inputs
  self._prev = (jax_core.trace_ctx.trace, inputs)
  n = len(values)

  def gathered(*args):
    values, tie = list(args[:n]), args[n:]
    w = [i for i, s in enumerate(specs) if s is not None]
    _, ws = lax.optimization_barrier((tie, [values[i] for i in w]))
    for i, x in zip(w, ws):
      values[i] = x
    return jaxprs.bind(eqn, [x if s is None else sharding.constrain(x, s, self.mesh)
                             for x, s in zip(values, specs)])
  return list(jax.checkpoint(gathered)(*values, *tie))


def _scoped(method):
  """A scan or remat body starts with no previous product (and leaves none)."""
  def wrapped(self, *args):
    self._prev = None
    try:
      return method(self, *args)
    finally:
      self._prev = None
  return wrapped


@contextlib.contextmanager
def lookahead():
  saved = _Split.product, _Split.scan, _Split.remat
  _Split.product = _lookahead_product
  _Split.scan, _Split.remat = _scoped(saved[1]), _scoped(saved[2])
  try:
    yield
  finally:
    _Split.product, _Split.scan, _Split.remat = saved


VARIANTS = {"baseline": contextlib.nullcontext, "lookahead": lookahead}


# ------------------------------------------------------------------- the HLO reading
def _is_matmul(ins):
  if ins.op in ("dot", "convolution"):
    return True
  text = ins.name + ins.rest
  return ins.op in ("fusion", "custom-call") and (
      "gemm" in text or "cublas" in text or "__triton" in text)


def gather_pairs(text):
  """``(computation, start name, result type, compute ops between, matmuls between,
  op_name)`` for each all-gather-start in a computation that is not a fusion's."""
  module = hlo.parse(text)
  bodies = set()
  for inss in module.computations.values():
    for ins in inss:
      if ins.op == "while":
        bodies.update(x.split(",")[0].strip("%")
                      for x in ins.rest.split("body=")[1:])
  out = []
  for comp, inss in module.computations.items():
    if comp != module.entry and comp not in bodies:
      continue
    where = {ins.name: k for k, ins in enumerate(inss)}
    for k, ins in enumerate(inss):
      if ins.op != "all-gather-start":
        continue
      done = next(j for j in range(k + 1, len(inss)) if inss[j].op == "all-gather-done"
                  and inss[j].rest.split(")")[0].strip().strip("%") == ins.name)
      between = inss[k + 1:done]
      compute = sum(i.op in ("fusion", "custom-call", "dot", "convolution")
                    for i in between)
      mm = sum(_is_matmul(i) for i in between)
      op_name = ins.rest.split('op_name="')[1].split('"')[0] if 'op_name="' in ins.rest else ""
      out.append((comp, ins.name, ins.result.split("}")[0] if False else ins.result,
                  compute, mm, op_name, where[ins.name], done))
  return out


def _gathered_mib(result):
  # The result tuple's second half is what is gathered: count it.
  half = result[result.find("), (") + 3:] if "), (" in result else result
  return hlo._shape_bytes(half) / 2.0**20


# ---------------------------------------------------------------------- the checks
def check_values(models, rows, seq):
  """Loss and gradients of both variants on 8 CPU devices (the same step code)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(1, 8), ("data", "fsdp"))
  for name, (shapes, loss_fn, _) in models.items():
    keys = jax.random.split(jax.random.key(1), len(jax.tree_util.tree_leaves(shapes)))
    params = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shapes),
        [0.05 * jax.random.normal(k, s.shape, s.dtype)
         for k, s in zip(keys, jax.tree_util.tree_leaves(shapes))])
    specs = sharding.fsdp_specs(params, mesh)
    params = jax.device_put(params, jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=sharding.is_spec))
    ids = jax.random.randint(jax.random.key(2), (rows, seq), 0, 512)
    batch = jax.device_put({"inputs": ids, "targets": jnp.roll(ids, -1, 1)},
                           NamedSharding(mesh, P(("data", "fsdp"))))
    got = {}
    for variant, ctx in VARIANTS.items():
      with ctx():
        f = batch_split.keep_batch_split(loss_fn, mesh, ("data", "fsdp"), specs)
        got[variant] = jax.jit(jax.value_and_grad(f))(params, batch)
    ref = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    a, b, r = (jax.tree_util.tree_leaves(got["baseline"]),
               jax.tree_util.tree_leaves(got["lookahead"]), jax.tree_util.tree_leaves(ref))
    same = all(np.array_equal(x, y) for x, y in zip(a, b))
    err = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))
    err_ref = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                  for x, y in zip(b, r))
    print(f"  {name:<10} loss+grads lookahead vs baseline: bitwise {same}, "
          f"max |diff| {err:.2e}; vs plain jit {err_ref:.2e}")


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
    return ms if args.models == "all" else {
        k: ms[k] for k in args.models.split(",")}

  if args.check:
    print("values, 8 CPU devices, width 64, 2 layers, 16 x 32 tokens:")
    check_values(pick(bench_fsdp.models(64, 2, 512, 32)), 16, 32)

  mesh = Mesh(np.array(bench_fsdp.devices(not args.cpu)).reshape(1, 8),
              ("data", "fsdp"))
  print(f"\n{'CPU' if args.cpu else 'H100 (XLA GPU compiler)'}: width {args.width}, "
        f"{args.layers} layers, {args.rows} x {args.seq} tokens, FSDP over 8")
  print(f"{'model':<10}{'variant':<11}{'temp MiB':>9}{'gathers':>8}"
        f"{'overlap compute':>16}{'overlap matmul':>15}{'fwd ovl/n':>10}"
        f"{'bwd ovl/n':>10}{'MiB hidden':>11}")
  for name, (params, loss_fn, _) in pick(bench_fsdp.models(
      args.width, args.layers, 512, args.seq)).items():
    for variant, ctx in VARIANTS.items():
      with ctx():
        comp = bench_fsdp.compile_step(params, loss_fn, mesh, "fsdp", args.rows,
                                       args.seq)
      temp = comp.memory_analysis().temp_size_in_bytes / 2.0**20
      pairs = gather_pairs(comp.as_text())
      fwd = [p for p in pairs if "transpose(" not in p[5]]
      bwd = [p for p in pairs if "transpose(" in p[5]]
      hidden = sum(_gathered_mib(p[2]) for p in pairs if p[4])
      print(f"{name:<10}{variant:<11}{temp:>9.1f}{len(pairs):>8}"
            f"{sum(p[3] > 0 for p in pairs):>16}{sum(p[4] > 0 for p in pairs):>15}"
            f"{sum(p[4] > 0 for p in fwd):>6}/{len(fwd):<3}"
            f"{sum(p[4] > 0 for p in bwd):>6}/{len(bwd):<3}"
            f"{hidden:>11.1f}")
      if args.pairs:
        for comp_name, start, result, n, mm, op, i, j in pairs:
          where = "entry" if comp_name.startswith("main") else comp_name[:18]
          print(f"    {where:<18} {start:<22} {_gathered_mib(result):7.2f} MiB "
                f"lines {i:>5}-{j:<5} compute {n:>3} matmul {mm:>3}  "
                f"{'bwd' if 'transpose(' in op else 'fwd'}")


if __name__ == "__main__":
  sys.exit(main())
