"""Do a pipeline's sends overlap its compute in the program XLA compiles for H100s?

Compiles the pipelined value-and-grad of the bench model (`bench_pipeline.model`,
bfloat16) for S H100s without a GPU (``jax.experimental.topologies`` with
``mpscale/trainer/planning/target_specs/h100_sxm.txtpb``) and reads the scheduled HLO: for every loop body that
sends, each ``collective-permute-start`` / ``-done`` pair and the compute kernels the
schedule puts between them. A ``conditional`` between them is a tick's op (a
forward or backward switch) that hides the transfer; a pair with nothing heavy
between is a wait. Nothing runs; the schedule is the compiler's.

Needs JAX's CUDA build (a venv with ``pip install "jax[cuda12]"`` and this project):

  JAX_PLATFORMS=cpu python benchmarks/gpu_overlap.py [--stages 4] [--schedule 1f1b]
"""

import argparse
import os
import re
import sys

# Compile only: the host is the CPU (bench_pipeline wants the device flag set first).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_pipeline  # noqa: E402

from mpscale.parallel import pipeline as pl  # noqa: E402

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpscale",
                    "trainer", "planning", "target_specs", "h100_sxm.txtpb")


def compiled_text(schedule, S, M, recompute, width, rows, virtual):
  topo = topologies.get_topology_desc("h100", "cuda", target_config=open(SPEC).read(),
                                      topology=f"1x1x{S}")
  mesh = Mesh(np.array(topo.devices).reshape(1, S), ("data", "stage"))
  features = width // 4
  embed_fn, stage_fn, head_fn = bench_pipeline.model(width, features)
  pipe = pl.Pipeline(embed_fn, stage_fn, head_fn, M, schedule=schedule,
                     recompute=recompute, virtual_stages=virtual)
  params = jax.eval_shape(lambda: bench_pipeline.params_for(2 * S * virtual, width,
                                                            features))
  params = jax.tree_util.tree_map(
      lambda p, spec: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16,
                                           sharding=NamedSharding(mesh, spec)),
      params, pipe.param_specs(params))
  batch = {k: jax.ShapeDtypeStruct((M * rows, n), jnp.bfloat16,
                                   sharding=NamedSharding(mesh, P()))
           for k, n in (("x", features), ("y", 8))}
  fn = jax.jit(lambda p, b: pipe.value_and_grad(p, b, mesh=mesh, per_token_loss=True))
  return fn.lower(params, batch).compile().as_text()


def computations(text):
  """``{name: [instruction lines]}`` of a scheduled HLO module."""
  out, name = {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      name = head.group(1)
      out[name] = []
    elif name and line.strip() == "}":
      name = None
    elif name:
      out[name].append(line.strip())
  return out


def overlaps(lines):
  """Per send in a computation: ``(start index, done index, heavy kernels between)``."""
  for i, line in enumerate(lines):
    if "collective-permute-start(" not in line:
      continue
    var = line.split(" = ")[0]
    j = next(k for k, x in enumerate(lines)
             if "collective-permute-done(" in x and var + ")" in x)
    heavy = [x.split(" = ")[0] for x in lines[i + 1:j]
             if re.search(r"\b(conditional|while|custom-call)\(", x)
             or "gemm" in x.split(" = ")[0]]
    yield i, j, heavy


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stages", type=int, default=4)
  ap.add_argument("--micro", type=int, default=0, help="micro-batches (default 4 S)")
  ap.add_argument("--schedule", default="1f1b", choices=pl.SCHEDULES)
  ap.add_argument("--virtual", type=int, default=1)
  ap.add_argument("--recompute", default="none", choices=pl.RECOMPUTE)
  ap.add_argument("--width", type=int, default=1024)
  ap.add_argument("--rows", type=int, default=512, help="rows per micro-batch")
  args = ap.parse_args()
  S = args.stages
  text = compiled_text(args.schedule, S, args.micro or 4 * S, args.recompute,
                       args.width, args.rows, args.virtual)
  print(f"{args.schedule} v{args.virtual}, S={S}, recompute={args.recompute}, "
        f"compiled for {S} x H100 (bfloat16, width {args.width}, {args.rows} rows)")
  hidden = waits = 0
  for name, lines in computations(text).items():
    sends = list(overlaps(lines))
    if not sends:
      continue
    print(f"{name}: {len(lines)} instructions")
    for i, j, heavy in sends:
      print(f"  send {i:4d} -> done {j:4d}: {', '.join(heavy) or 'no compute between'}")
      hidden += bool(heavy)
      waits += not heavy
  print(f"sends with compute between start and done: {hidden}; without: {waits}")


if __name__ == "__main__":
  main()
