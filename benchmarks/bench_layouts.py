"""Per-device bytes and collectives of every parameter layout, against data parallelism.

Two programs, each compiled for every layout on 8 devices (fake CPU devices here, so
the byte and collective counts are exact; step times only mean something on an
accelerator, and are printed with ``--time``):

  tiny LM     the whole train step (`mpscale.make_train_step`, dynamic loss scale +
              clip + CAME, 4 micro-batches, per-token loss) of an 8-layer `TinyLM`
  GPT-2 tree  the optimizer update alone (dynamic loss scale + clip + CAME or AdamW)
              on the GPT-2-small-like tree of the other benchmarks, laid out by a
              function of the key path

For each: parameter and optimizer-state bytes per device (from the arrays' specs),
the compiled step's argument and temporary bytes (``memory_analysis``), and each
collective kind's count and bytes (``as_text`` of the compiled HLO; XLA:CPU lowers a
reduce-scatter as an all-reduce). Ratios are against the replicated data-parallel
layout measured in the same run.

  python benchmarks/bench_layouts.py            # both programs, ~3 min on 2 cores
  python benchmarks/bench_layouts.py --quick    # smaller models, ~1 min
  python benchmarks/bench_layouts.py --time     # + median step time (an accelerator)
"""

import argparse
import os
import sys
import time

# 8 fake CPU devices (on an accelerator the flag changes nothing; it uses real ones).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpscale  # noqa: E402
from mpscale.trainer.planning import hlo as hlo_lib  # noqa: E402
from mpscale.trainer.models import lm as lm_lib  # noqa: E402
from mpscale.trainer.config.load import ModelConfig  # noqa: E402
from gpt2_tree import gpt2_like_shapes, is_shape  # noqa: E402

AXES = ("data", "fsdp", "stage", "tensor")
LM_LAYOUTS = {  # name: ((data, fsdp, stage, tensor), zero1, sequence_parallel, v)
    "dp8 (baseline)": ((8, 1, 1, 1), False, False, 1),
    "dp8 + ZeRO-1": ((8, 1, 1, 1), True, False, 1),
    "fsdp8": ((1, 8, 1, 1), False, False, 1),
    "tp8": ((1, 1, 1, 8), False, False, 1),
    "tp8 + sp": ((1, 1, 1, 8), False, True, 1),
    "fsdp4 x tp2": ((1, 4, 1, 2), False, False, 1),
    "dp2 x fsdp2 x tp2": ((2, 2, 1, 2), False, False, 1),
    "dp2 x pp2 x tp2": ((2, 1, 2, 2), False, False, 1),
    "fsdp2 x pp2(v2) x tp2 + sp": ((1, 2, 2, 2), False, True, 2),
}
TREE_LAYOUTS = {  # name: (data, fsdp, tensor)
    "dp8 (baseline)": (8, 1, 1),
    "fsdp8": (1, 8, 1),
    "tp8": (1, 1, 8),
    "fsdp4 x tp2": (1, 4, 2),
}


def make_mesh(shape, names=AXES):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def per_device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(tree))


def state_bytes(state) -> tuple[int, int]:
  """Per-device bytes of a `TrainState`'s params and optimizer state."""
  return per_device_bytes(state.params), per_device_bytes(state.opt_state)


def fmt_bytes(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if n < 1024 or unit == "GB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def fmt_ops(hlo: str) -> str:
  """Each collective kind's count and bytes per step, as `mpscale plan` reads the
  compiled HLO (`mpscale.trainer.planning.hlo.collectives`: loops by their trip counts, a bfloat16
  sum at bfloat16's bytes)."""
  ops = hlo_lib.collectives(hlo)
  return ", ".join(f"{k} {v['count']} ({fmt_bytes(v['bytes'])})"
                   for k, v in sorted(ops.items())) or "-"


def median_time(fn, *args, rounds=5):
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def bench_lm(quick: bool, timed: bool) -> None:
  cfg = ModelConfig(d_model=128 if quick else 256, num_heads=8, num_layers=8,
                    d_ff=512 if quick else 1024, seq_len=64 if quick else 128)
  micro, batch_size = 4, 32
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (batch_size, cfg.seq_len + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "mask": np.ones((batch_size, cfg.seq_len), np.float32)}
  print(f"\n== tiny LM train step: d_model {cfg.d_model}, {cfg.num_layers} layers, "
        f"batch {batch_size} x {cfg.seq_len}, {micro} micro-batches, CAME ==")
  header = (f"{'layout':28} {'params/dev':>11} {'opt/dev':>10} {'vs dp':>6} "
            f"{'args':>9} {'temp':>9} {'compile':>8}" + ("  step" if timed else ""))
  print(header)
  base = None
  for name, (shape, zero1, sp, virtual) in LM_LAYOUTS.items():
    mesh = make_mesh(shape)
    laid_out = shape[1] > 1 or shape[3] > 1  # fsdp or tensor: as the main job does
    model = lm_lib.TinyLM.from_sizes(cfg, shard=lm_lib.ActivationSharding(
        mesh, sequence_parallel=sp) if laid_out else None)
    loss = model.loss_fn
    if shape[2] > 1:
      loss = mpscale.Pipeline(model.embed_fn, model.stage_fn, model.head_fn, micro,
                              virtual_stages=virtual)
    tx = mpscale.dynamic_loss_scale(optax.chain(mpscale.global_norm_clip(1.0),
                                                mpscale.came(1e-3)))
    specs = model.param_specs(mesh) if laid_out else None
    init, step = mpscale.make_train_step(
        loss, tx, mesh=mesh, data_axis=("data", "fsdp"), num_microbatches=micro,
        per_token_loss=True, shard_optimizer_state=zero1, param_specs=specs)
    state = init(model.init(jax.random.key(0)))
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    p, o = state_bytes(state)
    base = base or (p + o)
    line = (f"{name:28} {fmt_bytes(p):>11} {fmt_bytes(o):>10} {(p + o) / base:6.3f} "
            f"{fmt_bytes(mem.argument_size_in_bytes):>9} "
            f"{fmt_bytes(mem.temp_size_in_bytes):>9} {compile_s:7.1f}s")
    if timed:
      state, _ = step(state, batch)
      line += f"  {1e3 * median_time(lambda s: step(s, batch)[0], state):.1f} ms"
    print(line)
    print(f"{'':28} {fmt_ops(compiled.as_text())}")


def tree_specs(path, leaf, tensor: bool):
  """Megatron's split of the GPT-2 tree: qkv and fc column-parallel, their output
  projections row-parallel, the vocabulary split; nothing else."""
  name = "/".join(str(getattr(k, "key", k)) for k in path)
  if not tensor:
    return P()
  if name.endswith(("c_attn/kernel", "c_fc/kernel", "lm_head/kernel")):
    return P(None, "tensor")
  if name.endswith(("c_attn/bias", "c_fc/bias")) or name.endswith("wte"):
    return P("tensor")
  if name.endswith("c_proj/kernel"):
    return P("tensor")
  return P()


def bench_tree(quick: bool, timed: bool) -> None:
  shapes = gpt2_like_shapes(layers=1 if quick else 3)
  params = jax.tree_util.tree_map(lambda s: jnp.zeros(s, jnp.float32), shapes,
                                  is_leaf=is_shape)
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f"\n== optimizer update on the GPT-2-like tree: {n / 1e6:.1f}M params ==")
  for opt_name, inner in (("adamw", optax.adamw(1e-3)), ("came", mpscale.came(1e-3))):
    tx = mpscale.dynamic_loss_scale(optax.chain(mpscale.global_norm_clip(1.0), inner))
    print(f"-- {opt_name}")
    base = None
    for name, shape in TREE_LAYOUTS.items():
      mesh = make_mesh(shape, ("data", "fsdp", "tensor"))
      specs = mpscale.fsdp_specs(
          params, mesh, "fsdp",
          lambda path, leaf: tree_specs(path, leaf, shape[2] > 1))
      init, _ = mpscale.make_train_step(lambda p, b: jnp.zeros(()), tx, mesh=mesh,
                                        data_axis=("data", "fsdp"), param_specs=specs)
      state = init(params)
      shards = jax.tree_util.tree_map(lambda x: x.sharding,
                                      (state.params, state.opt_state))
      update = jax.jit(tx.update, in_shardings=shards + (shards[0],),
                       out_shardings=(shards[0], shards[1]))
      compiled = update.lower(state.params, state.opt_state, state.params).compile()
      p, o = state_bytes(state)
      base = base or (p + o)
      line = (f"{name:20} params {fmt_bytes(p):>9}  opt {fmt_bytes(o):>9}  "
              f"vs dp {(p + o) / base:.3f}  collectives: "
              f"{fmt_ops(compiled.as_text())}")
      if timed:
        seconds = median_time(compiled, state.params, state.opt_state, state.params)
        line += f"  {1e3 * seconds:.1f} ms"
      print(line)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="smaller models")
  parser.add_argument("--time", action="store_true", help="median step times too")
  parser.add_argument("--only", choices=("lm", "tree"), default=None)
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
  if jax.device_count() < 8:
    print("needs 8 devices (on CPU the script fakes them; on an accelerator it needs "
          "8 real ones)")
    return
  if args.only in (None, "lm"):
    bench_lm(args.quick, args.time)
  if args.only in (None, "tree"):
    bench_tree(args.quick, args.time)


if __name__ == "__main__":
  main()
