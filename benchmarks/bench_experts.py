"""Mixtures of experts on H100s, read from the H100 program (no GPU needed).

Two programs, each compiled for 8 H100s by XLA's CUDA compiler:

1. **One Mixtral-8x7B layer's experts** (``mpscale.experts.moe_mlp``, forward and
   backward): 8 experts of 4096 -> 14336 -> 4096, 2 a token, 8 x 4096 tokens in
   bfloat16, the experts split over ``expert`` 8. The grouped products two ways:
   ``tiled`` (mpscale's, the default off TPUs) against ``ragged``
   (``jax.lax.ragged_dot``, the reference), measured in the same run. Printed: the
   matrix-product FLOPs of each program per routed token's own (the routed rows
   times the three matrices, forward and backward); for ``tiled`` the loops' tiles
   are counted as an even load runs them (`mpscale.trainer.planning.hlo` reads a
   tiled loop's name scope: its trip count is the data's, and XLA counts a loop
   once), and the bound a partial tile an expert sets. Then how the tokens move (ragged all-to-alls, or
   padded ones) and whether any all-gather moves an expert's weights.
2. **The trainer's step** of a 2-layer Mixtral-shaped model (configs like
   configs/tiny_moe.yaml at d 1024, 8 experts of 3584) under ``mesh.expert`` 8 and
   under ``mesh.data`` 8: the expert weights' bytes a device, and the step's
   collectives.

The issue's targets: under ``expert`` 8 no all-gather of an expert's weights and the
tokens moved by all-to-all; expert parameter bytes a device <= 0.15 of ``data``
8's; the grouped products' FLOPs within 1.1x of the routed tokens' own.

Needs JAX's CUDA plugin (``pip install "mpscale[plan-gpu]"``):

  python benchmarks/bench_experts.py
"""

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from mpscale import experts  # noqa: E402
from mpscale import parallel  # noqa: E402
from mpscale.trainer.config import build as builders  # noqa: E402
from mpscale.trainer.config import load as config_lib  # noqa: E402
from mpscale.trainer.planning import compiled, hlo, targets  # noqa: E402

TOKENS, D, F, E, K, P_ = 8 * 4096, 4096, 14336, 8, 2, 8


def _h100s():
  from jax.experimental import topologies  # noqa: PLC0415
  return list(topologies.get_topology_desc(
      "h100_sxm", "cuda", target_config=targets.spec_text("h100_sxm"),
      topology=targets.topology(8, 8)).devices)[:8]


def _layer_program(implementation: str) -> str:
  mesh = Mesh(np.array(_h100s()), ("expert",))
  routing = experts.Routing(E, K)

  def loss(x, router, w):
    y, stats = experts.moe_mlp(x, router, w, routing, mesh=mesh, spec=P("expert"),
                               implementation=implementation)
    return jnp.sum(y.astype(jnp.float32)) + stats.aux_loss

  shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
  args = (jax.ShapeDtypeStruct((TOKENS, D), jnp.bfloat16, sharding=shard(P("expert"))),
          jax.ShapeDtypeStruct((D, E), jnp.float32, sharding=shard(P())),
          experts.ExpertWeights(*(
              jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=shard(P("expert")))
              for s in ((E, D, F), (E, D, F), (E, F, D)))))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()


def _tile_rows(text: str) -> int:
  """The tiled loops' tile: the rows of their ``[tile, d] x [d, f]`` products."""
  tiles = [int(m.group(1)) for m in re.finditer(rf"\[(\d+),{F}\]\{{1,0\}} dot\(", text)]
  return min(tiles) if tiles else 0


def _layer_report() -> None:
  routed = 2 * 3 * 3 * TOKENS * K * D * F / P_   # a device's share, fwd + 2x bwd
  print("one Mixtral-8x7B layer's experts, expert 8 on 8 H100s (per device)")
  for implementation in ("tiled", "ragged"):
    text = _layer_program(implementation)
    found = hlo.matmul_flops(text)
    moves = {kind: len(re.findall(rf" {kind}-start\(", text))
             for kind in ("ragged-all-to-all", "all-to-all", "all-gather")}
    moves["all-gathers of expert weights"] = len(re.findall(
        rf"\[[^\]]*\b{F}\b[^\]]*\]\S* all-gather-start\(", text))
    if implementation == "tiled":
      # hlo.matmul_flops counts each tiled loop at the tiles an even load runs
      # (its `experts.TILES_SCOPE`): its trip count is the data's
      tile = _tile_rows(text)
      rows = TOKENS * K // P_           # an even load: each device's expert's rows
      print(f"  tiled: tile {tile} rows, {len(re.findall(' while[(]', text))} "
            f"loops; FLOPs {found / routed:.3f}x the routed tokens' (bound "
            f"{1 + (E // P_) * tile / rows:.3f}x, a partial tile an expert); moves "
            f"{moves}")
    else:
      print(f"  ragged_dot: FLOPs {found / routed:.2f}x the routed tokens' "
            f"(every row of the receiving buffer); moves {moves}")


def _expert_bytes(cfg) -> float:
  model = builders.build_model(cfg, builders.abstract_mesh(cfg))
  specs = builders.build_param_specs(cfg, model, builders.abstract_mesh(cfg))
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  moe = {k: v for k, v in shapes["stages"]["moe"].items() if k != "router"}
  moe_specs = (None if specs is None
               else {k: specs["stages"]["moe"][k] for k in moe})
  mesh = builders.abstract_mesh(cfg)
  return parallel.bytes_per_device(mesh, moe, moe_specs)["per_device"]


def _step_report() -> None:
  base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                      "tiny_moe.yaml")
  sizes = ["model.d_model=1024", "model.num_heads=16", "model.num_kv_heads=8",
           "model.d_ff=3584", "model.seq_len=4096", "model.vocab_size=32000",
           "data.batch_size=8", "train.recompute=full"]
  print("\nthe trainer's step, a 2-layer Mixtral-shaped model on 8 H100s")
  found = {}
  for mesh in ("mesh.expert=8,mesh.data=1", "mesh.expert=1,mesh.data=8"):
    cfg = config_lib.load_config(base, overrides=sizes + mesh.split(","))
    found[mesh] = _expert_bytes(cfg)
    planned = compiled.plan(cfg, hardware="h100-80g", compiler="target")
    print(f"  {mesh}: expert weights {found[mesh] / 2**20:.0f} MiB a device; "
          f"peak {planned.bytes.get('peak', 0) / 2**30:.1f} GiB; collectives "
          f"{sorted(planned.collectives)}")
  ratio = found["mesh.expert=8,mesh.data=1"] / found["mesh.expert=1,mesh.data=8"]
  print(f"  expert bytes a device, expert 8 over data 8: {ratio:.3f} (target <= 0.15)")


if __name__ == "__main__":
  _layer_report()
  _step_report()
