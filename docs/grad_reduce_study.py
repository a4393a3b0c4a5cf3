"""The float32 gradient-sum study: what ``precision.grad_reduce_dtype`` changes.

::

  python docs/grad_reduce_study.py    # 5 configs x 3 seeds; ~30 minutes on 2 CPU cores
  python docs/grad_reduce_study.py --seeds 0 --steps 60 --out /tmp/study --no-docs

Each seed is one ``mpscale compare --devices 8`` of the configs in
``configs/grad_reduce/`` (with ``--set seed=N``), into ``runs/grad_reduce/seed<N>/``;
this script then writes the table and the curves' differences to
``docs/grad_reduce.md``, with the gradients' own errors: one step's gradient of each
seed's initial model on its first 4 batches, under each setting, against float32.
"""

from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity_study  # noqa: E402  (its runner and reader of the runs)

CONFIGS = os.path.join(ROOT, "configs", "grad_reduce")
RUNS = ("fp32", "bf16", "bf16_f32_sums", "fsdp_bf16", "fsdp_bf16_f32_sums")
PAIRS = (("bf16_f32_sums", "bf16"), ("fsdp_bf16_f32_sums", "fsdp_bf16"),
         ("bf16", "fp32"), ("bf16_f32_sums", "fp32"), ("fsdp_bf16", "fp32"),
         ("fsdp_bf16_f32_sums", "fp32"))
"""The curves compared step by step (same seed, so the same data and initial
parameters)."""


def run_seed(seed: int, out: str, steps: int | None = None) -> float:
  """``mpscale compare --devices 8`` of every config for one seed into
  ``out/seed<seed>`` (the fidelity study's runner); seconds."""
  extra = ["--devices", "8"]
  if steps:
    extra += ["--set", "schedule.warmup_steps=2", "--set", f"train.eval_every={steps}"]
  return fidelity_study.run_seed(seed, RUNS, out, steps, configs=CONFIGS, extra=extra)


def collect(out: str, seeds) -> dict[str, list[dict]]:
  """Run name -> one record per seed: its summary and its train-loss curve (a dict
  step -> loss)."""
  records = fidelity_study.collect(out, seeds, RUNS)
  for summaries in records.values():
    for summary in summaries:
      summary["curve"] = dict(summary["curve"])
  return records


SETTLED = 50
"""Steps of the warm-up transient (a seed's early loss spike) left out of one column."""


def curve_differences(records: dict[str, list[dict]]) -> list[dict]:
  """For each pair: the largest |difference| of the per-step train losses over all
  steps and seeds, the same from step `SETTLED` on, its mean over the last 100
  steps, and each seed's difference of the final eval losses."""
  out = []
  for a, b in PAIRS:
    worst, settled, late, evals = 0.0, 0.0, [], []
    for ra, rb in zip(records[a], records[b]):
      steps = sorted(set(ra["curve"]) & set(rb["curve"]))
      diffs = [abs(ra["curve"][s] - rb["curve"][s]) for s in steps]
      worst = max(worst, max(diffs))
      settled = max(settled, max(d for s, d in zip(steps, diffs) if s >= SETTLED))
      late.extend(diffs[-100:])
      evals.append(ra["final_eval_loss"] - rb["final_eval_loss"])
    out.append({"pair": f"{a} - {b}", "max": worst, "settled": settled,
                "late": statistics.fmean(late), "evals": evals})
  return out


def gradient_errors(seeds, batches: int = 4) -> dict[str, float]:
  """The relative L2 distance (over all leaves) of one step's gradient between the
  settings, averaged over seeds and batches: bf16 and bf16 with float32 sums
  against float32 compute, and against each other (the bfloat16 sum's rounding)."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  import jax
  import numpy as np
  import mpscale
  from mpscale.trainer.config import build as builders
  from mpscale.trainer.config import load as config_lib
  from mpscale.trainer.data import text as data_lib

  def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64))
                           for x in jax.tree_util.tree_leaves(tree)])

  def distance(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  corpus = data_lib.load_data()
  found: dict[str, list[float]] = {}
  for seed in seeds:
    cfg = config_lib.load_config(os.path.join(CONFIGS, "bf16.yaml"), [f"seed={seed}"])
    mesh = builders.build_mesh(cfg)
    model = builders.build_model(cfg, mesh)
    params = builders.init_params(cfg, model)
    grads = {}
    for name, policy, dtype in (("fp32", "O0", None), ("bf16", "bf16", None),
                                ("bf16_f32_sums", "bf16", "float32")):
      fn = jax.jit(lambda p, b, policy=policy, dtype=dtype: (
          mpscale.accumulate_gradients(model.mean_loss_fn, p, b, policy=policy,
                                       mesh=mesh, grad_reduce_dtype=dtype).grads))
      grads[name] = [flat(fn(params, jax.device_put(  # split, as the step places it
          corpus.train_batch(seed, step, 32, 64), builders.batch_sharding(mesh))))
                     for step in range(batches)]
    for a, b in (("bf16", "fp32"), ("bf16_f32_sums", "fp32"),
                 ("bf16", "bf16_f32_sums")):
      found.setdefault(f"{a} - {b}", []).extend(
          distance(x, y) for x, y in zip(grads[a], grads[b]))
  return {k: statistics.fmean(v) for k, v in found.items()}


def write_markdown(records, diffs, errors, path: str, seeds, seconds: float) -> None:
  steps = records["fp32"][0]["steps"]
  lines = [
      "# Float32 gradient sums under bf16: the study",
      "",
      f"Generated by `python docs/grad_reduce_study.py` (seeds "
      f"{', '.join(map(str, seeds))}; {seconds / 60:.1f} minutes on this machine): "
      "one `mpscale compare --devices 8 --set seed=N` of `configs/grad_reduce/*.yaml` "
      f"per seed. The tiny LM, {steps} steps of 2048-token batches, CAME; losses in "
      "nats per byte. Final losses are the last step's train loss and the held-out "
      "loss after it (8 batches); spread is max - min over the seeds.",
      "",
      "| run | mesh | micro-batches | grad_reduce_dtype | final train loss, mean | "
      "final eval loss, mean | spread | per seed | vs fp32 |",
      "| --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: |",
  ]
  ref = statistics.fmean(s["final_eval_loss"] for s in records["fp32"])
  for run, runs in records.items():
    evals = [s["final_eval_loss"] for s in runs]
    mean = statistics.fmean(evals)
    micro = "4" if run.startswith("fsdp") else "1"
    dtype = "float32" if run.endswith("f32_sums") else "-"
    vs = "" if run == "fp32" else f"{mean / ref - 1:+.2%}"
    lines.append(
        f"| {run} | {runs[0]['mesh']} | {micro} | {dtype} | "
        f"{statistics.fmean(s['final_train_loss'] for s in runs):.4f} | {mean:.4f} | "
        f"{max(evals) - min(evals):.4f} | {', '.join(f'{e:.4f}' for e in evals)} | "
        f"{vs} |")
  lines += [
      "",
      "Step by step, the same seed (same data, same initial parameters): the largest "
      "|difference| of the train losses over every step and seed, the same from step "
      f"{SETTLED} on (after the warm-up, where one seed's loss spikes), its mean over "
      "the last 100 steps, and each seed's difference of the final eval losses.",
      "",
      f"| curves | max abs difference | from step {SETTLED} | mean, last 100 steps | "
      "final eval difference, per seed |",
      "| --- | ---: | ---: | ---: | --- |",
  ]
  lines += [f"| {d['pair']} | {d['max']:.4f} | {d['settled']:.4f} | {d['late']:.4f} | "
            f"{', '.join(f'{e:+.4f}' for e in d['evals'])} |" for d in diffs]
  lines += [
      "",
      "One step's gradient (data 8, one micro-batch; each seed's initial model, its "
      "first 4 batches): the relative L2 distance over all parameters, mean of "
      f"{len(seeds) * 4} gradients.",
      "",
      "| gradients | relative L2 distance |",
      "| --- | ---: |",
  ]
  lines += [f"| {k} | {v:.2e} |" for k, v in errors.items()]
  paired = [e for d in diffs[:2] for e in d["evals"]]
  own = [e for d in diffs if d["pair"] in ("bf16 - fp32", "fsdp_bf16 - fp32")
         for e in d["evals"]]
  spreads = [max(e) - min(e) for e in (
      [s["final_eval_loss"] for s in runs] for runs in records.values())]
  lines += [
      "",
      "## Reading",
      "",
      f"- **The gradient**: bfloat16 compute puts {errors['bf16 - fp32']:.2%} of "
      "relative error in one step's gradient; summing the replicas in float32 takes "
      f"it to {errors['bf16_f32_sums - fp32']:.2%}. The bfloat16 sum's own rounding "
      f"is {errors['bf16 - bf16_f32_sums']:.2%} of the gradient, about half of the "
      "compute's error but mostly independent of it, so the two add in quadrature.",
      f"- **Training**: with float32 sums the final eval loss is lower on "
      f"{sum(e < 0 for e in paired)} of {len(paired)} paired runs (same seed, "
      f"data 8 and FSDP), by {min(-e for e in paired):.4f} to "
      f"{max(-e for e in paired):.4f} nats. That is the size of bf16's own "
      f"distance from fp32 ({min(own):+.4f} to {max(own):+.4f}, either sign), "
      "and within the seed spread "
      f"({min(spreads):.4f} to {max(spreads):.4f}): at this size and {len(seeds)} "
      "seeds, a consistent direction, not a measured gain. The curves of one seed "
      "drift apart by a few hundredths of a nat whatever changes (a different "
      "rounding anywhere does that), float32 sums as much as fp32 compute.",
      "- **What the CPU understates**: XLA's CPU backend sums a bfloat16 all-reduce "
      "in float32 and rounds once (its all-reduce promotion); NCCL's bfloat16 ring "
      "rounds at each of its N - 1 steps, so on GPUs the default sum is less precise "
      "than measured here, and more so with more replicas.",
      "- **Where nothing changes**: micro-batches over replicated parameters already "
      "sum each replica's gradient in float32 after the loop (`mpscale plan` shows "
      "the same float32 all-reduce either way), and a pipeline's sums over the data "
      "and stage axes are float32 either way; what float32 sums add there is GPipe's "
      "accumulation of micro-batches in float32 (1F1B's is already).",
      "- **The cost**: twice the bytes of the gradient all-reduce (or FSDP's "
      "reduce-scatter): 535 KiB against 268 KiB a step for this model on 8 "
      "replicas, as `mpscale plan --config configs/grad_reduce/bf16.yaml --devices 8 "
      "--set precision.grad_reduce_dtype=float32` shows.",
  ]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None) -> None:
  args = fidelity_study.study_parser(
      __doc__, os.path.join(ROOT, "runs", "grad_reduce")).parse_args(argv)
  seconds = fidelity_study.train_seeds(
      args, lambda seed: run_seed(seed, args.out, args.steps))
  records = collect(args.out, args.seeds)
  diffs = curve_differences(records)
  path = (os.path.join(args.out, "grad_reduce.md") if args.no_docs
          else os.path.join(ROOT, "docs", "grad_reduce.md"))
  errors = gradient_errors(args.seeds)
  write_markdown(records, diffs, errors, path, args.seeds, seconds)
  with open(path) as f:
    print(f.read())


if __name__ == "__main__":
  main()
