"""FSDP's compiled program against data parallelism's, on the same model and batch.

For each model (a user's linen LM with unrolled blocks, and mpscale's built-in
`TinyLM` with stacked blocks and no activation layout of its own) and each layout on
8 devices:

  dp          data parallelism (parameters replicated)
  fsdp        ``parallel.fsdp_specs`` over 8 devices, the step as it is (activations
              kept split over the batch: `mpscale.parallel`)
  fsdp-gspmd  the same without `batch_split` (GSPMD's own choice: what the step
              compiled before)

it compiles the train step (shapes only, nothing runs) and prints the compiled
temporaries, the collective bytes per step by kind, the dots and all-gathers whose
result carries the global batch, and the analytic FSDP estimate: two layers'
weights gathered (float32) + the local batch's activations, as a no-remat step keeps
them (dp's temporaries less its float32 gradients: dp runs the same rows a device) +
one layer's float32 gradient. Ratios are against dp's temporaries in the same run.

::

  python benchmarks/bench_fsdp.py                  # the CPU compiler (8 fake devices)
  JAX_PLATFORMS=cpu python benchmarks/bench_fsdp.py --gpu   # XLA's H100 compiler
      # (needs jax[cuda12] installed; no GPU: jax.experimental.topologies)
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import mpscale  # noqa: E402
from mpscale.parallel import _batch_split as batch_split  # noqa: E402
from mpscale.trainer.planning import hlo
from mpscale import parallel
from mpscale.trainer.models.lm import TinyLM  # noqa: E402

# The user's linen LM and the HLO reading are the tests' own (tests/library/parallel/test_batch_split.py).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.library.parallel.test_batch_split import (LM, global_batch_ops, nnx_lm,  # noqa: E402
                                    nnx_loss)

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpscale",
                    "trainer", "planning", "target_specs", "h100_sxm.txtpb")


def models(width, layers, vocab, seq):
  """``name -> (params shapes, loss_fn, one layer's parameter count)``."""
  linen = LM(width, layers, vocab)

  def linen_loss(params, batch):
    logits = linen.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]).mean()

  tiny = TinyLM(vocab_size=vocab, d_model=width, num_heads=4, num_layers=layers,
                d_ff=4 * width, seq_len=seq)
  layer = 12 * width * width

  def tiny_loss(params, batch):
    total, tokens = tiny.loss_fn(params, batch)
    return total / tokens
  from mpscale.trainer.models import user as models_lib
  nnx_model = models_lib.from_nnx(nnx_lm(width, layers, vocab), nnx_loss)

  def nnx_mean(params, batch):
    total, tokens = nnx_model.loss_fn(
        params, {"x": batch["inputs"], "y": batch["targets"]})
    return total / tokens
  out = {
      "linen LM": (jax.eval_shape(lambda: linen.init(
          jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"]), linen_loss,
                   layer),
      "NNX LM": (jax.eval_shape(lambda: nnx_model.init(None)), nnx_mean, layer),
      "TinyLM": (jax.eval_shape(tiny.init, jax.random.key(0)), tiny_loss, layer),
  }
  try:  # Hugging Face's own Flax GPT-2, where transformers is installed
    import transformers
  except ImportError:
    return out
  gpt2 = transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(
      n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq),
      _do_init=False)

  def gpt2_loss(params, batch):
    logits = gpt2(batch["inputs"], params=params, train=False).logits
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]).mean()
  out["HF GPT-2"] = (jax.eval_shape(lambda: gpt2.init_weights(
      jax.random.key(0), (1, seq))), gpt2_loss, layer)
  return out


def devices(gpu):
  if not gpu:
    return jax.devices()[:8]
  from jax.experimental import topologies
  return topologies.get_topology_desc("h100", "cuda", target_config=open(SPEC).read(),
                                      topology="1x1x8").devices


def compile_step(params, loss_fn, mesh, layout, rows, seq):
  specs = None if layout == "dp" else parallel.fsdp_specs(params, mesh)
  keep = batch_split.keep_batch_split
  if layout == "fsdp-gspmd":
    batch_split.keep_batch_split = lambda fn, *a: fn
  try:
    init, step = mpscale.make_train_step(loss_fn, optax.adamw(1e-3), mesh=mesh,
                                         data_axis=("data", "fsdp"), param_specs=specs)
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32)
             for k in ("inputs", "targets")}
    return step.lower(init(params), batch).compile()
  finally:
    batch_split.keep_batch_split = keep


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--gpu", action="store_true", help="compile for 8 H100s")
  ap.add_argument("--width", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--seq", type=int, default=320)
  ap.add_argument("--rows", type=int, default=16, help="global batch (sequences)")
  ap.add_argument("--no-pipeline", action="store_true",
                  help="leave out the pipelined table (FSDP inside the stages)")
  args = ap.parse_args(argv)
  mesh = Mesh(np.array(devices(args.gpu)).reshape(1, 8), ("data", "fsdp"))
  mib = 2.0**20
  print(f"{'H100 (XLA GPU compiler)' if args.gpu else 'CPU'}: width {args.width}, "
        f"{args.layers} layers, {args.rows} x {args.seq} tokens on 8 devices")
  print(f"{'model':<10}{'layout':<12}{'temp MiB':>10}{'/ dp':>7}{'/ est':>7}"
        f"{'global-batch ops':>18}  collectives (MiB)")
  for name, (params, loss_fn, layer) in models(args.width, args.layers, 512,
                                               args.seq).items():
    dp_temp = None
    for layout in ("dp", "fsdp", "fsdp-gspmd"):
      comp = compile_step(params, loss_fn, mesh, layout, args.rows, args.seq)
      temp = comp.memory_analysis().temp_size_in_bytes
      grads = sum(x.size * 4 for x in jax.tree_util.tree_leaves(params))
      if dp_temp is None:
        dp_temp = temp
        # dp keeps its local batch's activations (the same rows a device as
        # fsdp's) and every float32 gradient.
        activations = max(dp_temp - grads, 0)
      estimate = 2 * layer * 4 + activations + layer * 4
      text = comp.as_text()
      coll = ", ".join(f"{k} {v['bytes'] / mib:.0f}"
                       for k, v in sorted(hlo.collectives(text).items()))
      print(f"{name:<10}{layout:<12}{temp / mib:>10.0f}{temp / dp_temp:>7.2f}"
            f"{temp / estimate:>7.2f}"
            f"{len(global_batch_ops(text, args.rows, args.seq)):>18}"
            f"  {coll}")
  if not args.no_pipeline:
    pipelined(args, devices(args.gpu))


def pipelined(args, devs):
  """FSDP inside pipeline stages: TinyLM over 2 stages x 4 data devices, the
  parameters replicated over the 4 (dp) or split over them (fsdp, gathered a layer
  at a time where each layer runs), for each schedule."""
  tiny = TinyLM(vocab_size=512, d_model=args.width, num_heads=4,
                num_layers=2 * args.layers, d_ff=4 * args.width, seq_len=args.seq)
  params = jax.eval_shape(tiny.init, jax.random.key(0))
  layer = 12 * args.width * args.width * 4  # one layer's float32 weights
  mib = 2.0**20
  print(f"\npipelined TinyLM, {2 * args.layers} layers on 2 stages x 4 "
        f"(data or fsdp), 4 micro-batches of {args.rows} x {args.seq} tokens")
  print(f"{'schedule':<10}{'layout':<8}{'temp MiB':>10}{'/ dp':>7}"
        f"{'largest gather / layer':>24}  collectives (MiB)")
  for schedule in ("gpipe", "1f1b", "zb_h1"):
    pipe = mpscale.Pipeline(tiny.embed_fn, tiny.stage_fn, tiny.head_fn, 4,
                            schedule=schedule)
    dp_temp = None
    for layout in ("dp", "fsdp"):
      axis = "data" if layout == "dp" else "fsdp"
      mesh = Mesh(np.array(devs).reshape(4, 2), (axis, "stage"))
      specs = pipe.param_specs(params, tiny.param_specs(mesh))
      if layout == "fsdp":
        specs = parallel.fsdp_specs(params, mesh, "fsdp", specs)
      init, step = mpscale.make_train_step(
          pipe, optax.adamw(1e-3), mesh=mesh, data_axis=axis, param_specs=specs,
          per_token_loss=True)
      batch = {k: jax.ShapeDtypeStruct((args.rows, args.seq), dtype)
               for k, dtype in (("inputs", jnp.int32), ("targets", jnp.int32),
                                ("mask", jnp.float32))}
      comp = step.lower(init(params), batch).compile()
      temp = comp.memory_analysis().temp_size_in_bytes
      dp_temp = dp_temp or temp
      text = comp.as_text()
      coll = ", ".join(f"{k} {v['bytes'] / mib:.0f}"
                       for k, v in sorted(hlo.collectives(text).items()))
      print(f"{schedule:<10}{layout:<8}{temp / mib:>10.0f}{temp / dp_temp:>7.2f}"
            f"{hlo.largest_collective(text, 'all-gather') / layer:>24.2f}  {coll}")


if __name__ == "__main__":
  sys.exit(main())
