"""mpscale's train step against MaxText's, both compiled for 8 H100s with no GPU.

The model is MaxText's ``llama2-7b`` with 4 decoder layers (1.07B parameters), FSDP
over 8 devices, 4 sequences of 4,096 tokens a device, each layer fully recomputed,
float32 master weights and bf16 compute, AdamW after clipping at 1.0. MaxText's step
is its own (``train_compile``'s, in MaxText's environment: `maxtext_step.py`);
mpscale's is the built-in ``llama`` family's and a user's linen Llama's
(`linen_llama.py`, ``model.provider``), each planned by
`mpscale.trainer.planning.compiled.plan`.
Both programs are read with the planner's HLO reader and priced with its step-time
estimate on the ``h100-80g`` profile. Printed: each figure and mpscale / MaxText, for
XLA's attention and cuDNN's fused attention (MaxText's ``dot_product`` and
``cudnn_flash_jax``).

MaxText is the benchmark's own install, outside mpscale's dependencies: a Python 3.12
virtualenv with the MaxText 0.2.5 wheel (``--no-deps``), the
``decoupled-requirements.txt`` it ships and ``jax[cuda12]==0.11.1``. mpscale's side
needs JAX's CUDA plugin (``pip install "mpscale[plan-gpu]"``).

  python benchmarks/bench_maxtext.py --maxtext-python /tmp/mt/venv/bin/python
"""

import argparse
import dataclasses
import json
import os
import subprocess
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A user's model opens its data on the run's mesh (`mpscale plan --devices 8`).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, ROWS, SEQ, DEVICES = 4, 4, 4096, 8

MAXTEXT = ["model_name=llama2-7b", "override_model_config=true", f"base_num_decoder_layers={LAYERS}",
           f"per_device_batch_size={ROWS}", f"max_target_length={SEQ}",
           "remat_policy=full", "dtype=bfloat16", "weight_dtype=float32",
           f"ici_fsdp_parallelism={DEVICES}", "compile_topology=a3",
           "compile_topology_num_slices=1", "dataset_type=synthetic",
           "enable_checkpointing=false", "opt_type=adamw",
           "gradient_clipping_threshold=1.0", "scan_layers=true",
           "run_name=bench_maxtext", "base_output_directory=/tmp/bench_maxtext",
           "hardware=gpu", "skip_jax_distributed_system=true"]
ATTENTION = {"xla": "dot_product", "cudnn": "cudnn_flash_jax"}


def mpscale_config(attention: str) -> dict:
  """The same model and step as mpscale's config (``llama2-7b``: 32 heads of 128,
  SwiGLU of 11,008, RoPE base 10,000, RMSNorm 1e-5, untied head of 32,000)."""
  return {
      "name": f"llama2_7b_{LAYERS}_layers",
      "model": {"family": "llama", "vocab_size": 32000, "d_model": 4096,
                "num_heads": 32, "num_layers": LAYERS, "d_ff": 11008,
                "rope_theta": 10000.0, "norm_eps": 1e-5, "seq_len": SEQ,
                "attention": attention},
      "data": {"batch_size": ROWS * DEVICES},
      "precision": {"policy": "bf16"},
      "clip": {"max_norm": 1.0},
      "optimizer": {"name": "adamw", "learning_rate": 1e-4},
      "mesh": {"data": 1, "fsdp": DEVICES},
      "train": {"per_token_loss": True, "recompute": "full"}}


def linen_config(attention: str) -> dict:
  """The same step on a user's linen Llama (`linen_llama.py`, ``model.provider``)."""
  cfg = mpscale_config(attention)
  path = os.path.join(HERE, "linen_llama.py")
  cfg["name"] = f"linen_llama2_7b_{LAYERS}_layers"
  cfg["model"] = {"provider": f"{path}:build", "loss": f"{path}:loss",
                  "args": {"vocab": 32000, "d_model": 4096, "num_heads": 32,
                           "num_layers": LAYERS, "d_ff": 11008, "seq_len": SEQ,
                           "attention": attention}}
  cfg["data"] = {**cfg["data"], "provider": f"{path}:source"}
  cfg["train"] = {"per_token_loss": True}  # the model recomputes its layers itself
  return cfg


def figures(plan, hardware) -> dict:
  """What the table compares, read off a `Plan`."""
  from mpscale.trainer.planning import step_time  # noqa: PLC0415
  collectives = plan.collectives
  return {
      "temporaries": plan.bytes["temporaries"],
      "flops": plan.flops_per_device,
      "bytes accessed": plan.kernels["bytes"] + sum(
          b * n for _, b, n in plan.kernels["dots"]),
      "all-gathered": collectives.get("all-gather", {}).get("bytes", 0),
      "reduce-scattered": collectives.get("reduce-scatter", {}).get("bytes", 0),
      "all-to-all": collectives.get("all-to-all", {}).get("bytes", 0),
      "all collectives": sum(v.get("bytes", 0) for v in collectives.values()),
      "planned step (s)": step_time.estimate(plan, hardware).seconds}


def maxtext_plan(ours, python: str, attention: str):
  """MaxText's program as a `Plan`: mpscale's plan with every figure read from
  MaxText's compiled step instead."""
  from mpscale.trainer.planning import hlo as hlo_lib  # noqa: PLC0415
  spec = os.path.join(os.path.dirname(HERE), "mpscale", "trainer", "planning",
                      "target_specs", "h100_sxm.txtpb")
  with tempfile.TemporaryDirectory() as folder:
    text_path = os.path.join(folder, "maxtext.hlo")
    out = subprocess.run(
        [python, os.path.join(HERE, "maxtext_step.py"), "--hlo", text_path, "--spec",
         spec, "--", *MAXTEXT, f"attention={ATTENTION[attention]}"],
        capture_output=True, text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # its own JAX
    if out.returncode:
      raise RuntimeError(f"MaxText's compile failed:\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("MAXTEXT "))
    theirs = json.loads(line[len("MAXTEXT "):])
    with open(text_path) as f:
      hlo = hlo_lib.parse(f.read())
  work = hlo_lib.kernels(hlo)
  axes = dict(ours.mesh)
  return dataclasses.replace(
      ours, bytes={**ours.bytes, "temporaries": theirs["temporaries"]},
      flops_per_device=hlo_lib.matmul_flops(hlo), fp8_flops=0.0,
      collectives=hlo_lib.collectives(hlo),
      kernels={"dots": [list(d) for d in work.dots], "bytes": work.bytes},
      collectives_over=hlo_lib.collectives_over(hlo, axes),
      overlaps=[{"collective": o.collective, "bytes": o.bytes, "count": o.count,
                 "window": {"dots": [list(d) for d in o.window.dots],
                            "bytes": o.window.bytes}}
                for o in hlo_lib.overlaps(hlo, axes)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--maxtext-python", required=True,
                      help="the Python of MaxText's environment")
  parser.add_argument("--attention", nargs="*", default=list(ATTENTION))
  args = parser.parse_args()
  from mpscale.trainer.config import load as config_lib  # noqa: PLC0415
  from mpscale.trainer.planning import compiled  # noqa: PLC0415
  from mpscale.trainer.planning.hardware import load_hardware  # noqa: PLC0415
  hardware = load_hardware("h100-80g")
  for attention in args.attention:
    plans = {}
    for name, make in (("built-in", mpscale_config), ("linen", linen_config)):
      cfg = config_lib.config_from_dict(make(attention), "<bench>")
      plans[name] = compiled.plan(cfg, hardware=hardware, compiler="target")
      if "H100" not in plans[name].compiled_for:
        raise SystemExit(f"mpscale's step was not compiled for H100s: "
                         f"{plans[name].compile_note}")
    theirs = figures(maxtext_plan(plans["built-in"], args.maxtext_python, attention),
                     hardware)
    ours = {name: figures(plan, hardware) for name, plan in plans.items()}
    print(f"\n{attention} attention ({ATTENTION[attention]} in MaxText), per device; "
          f"mpscale's built-in llama and a user's linen Llama, each over MaxText:")
    print(f"  {'':18s} {'built-in':>10s} {'linen':>10s} {'MaxText':>10s} "
          f"{'built-in/MT':>12s} {'linen/MT':>9s}")
    for key, b in theirs.items():
      a, u = ours["built-in"][key], ours["linen"][key]
      ratio = lambda x: x / b if b else float("nan")  # noqa: E731
      print(f"  {key:18s} {a:10.4g} {u:10.4g} {b:10.4g} {ratio(a):12.2f} "
            f"{ratio(u):9.2f}")

if __name__ == "__main__":
  main()
