"""MaxText's own train step compiled for 8 H100s with no GPU (run in MaxText's
environment, not mpscale's: see bench_maxtext.py, which starts it).

MaxText's ``train_compile.py`` takes its GPUs from ``jax.devices()``; here its mesh is
built on the compile-only topology JAX's CUDA plugin registers (as mpscale's planner
does, `mpscale.trainer.planning.targets`), and its train step is compiled as
``train_compile.main`` compiles it. Prints one JSON line: the program's memory and
cost analyses; writes its HLO text to ``--hlo``.

  python maxtext_step.py --hlo OUT.txt --spec h100_sxm.txtpb -- key=value ...
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin registers its topology


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--hlo", required=True)
  parser.add_argument("--spec", required=True, help="XLA's target spec of the GPU")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()

  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import AxisType, Mesh  # noqa: PLC0415
  import maxtext  # noqa: PLC0415
  from maxtext.trainers.pre_train import train_compile  # noqa: PLC0415
  from maxtext.utils import maxtext_utils  # noqa: PLC0415

  with open(args.spec) as f:
    spec = f.read()

  def topology_mesh(config):
    devices = topologies.get_topology_desc("h100_sxm", "cuda", target_config=spec,
                                           topology="1x1x8").devices
    grid = maxtext_utils.create_device_mesh(config, list(devices))
    return Mesh(grid, config.mesh_axes,
                axis_types=(AxisType.Auto,) * len(config.mesh_axes))

  kept = {}
  compile_step = train_compile.jit_and_compile

  def keep(*a, **k):
    kept["compiled"] = compile_step(*a, **k)
    return kept["compiled"]

  train_compile.get_topology_mesh = topology_mesh
  train_compile.jit_and_compile = keep
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  train_compile.main([sys.argv[0], base, *args.overrides])
  compiled = kept["compiled"]
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}  # none: GPU AOT
  with open(args.hlo, "w") as f:
    f.write(compiled.as_text())
  print("MAXTEXT " + json.dumps({
      "temporaries": memory.temp_size_in_bytes,
      "arguments": memory.argument_size_in_bytes,
      "flops": float(cost.get("flops", 0.0)),
      "bytes_accessed": float(cost.get("bytes accessed", 0.0))}))


if __name__ == "__main__":
  main()
