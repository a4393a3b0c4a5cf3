"""The ``mpscale`` command: train the tiny LM from a config, or compare several configs.

::

  mpscale train --config configs/tiny_lm_fp16.yaml [--set train.steps=50 ...]
                [--out runs/NAME] [--resume | --overwrite] [--devices N] [--data PATH]
                [--hardware h100-80g]
  mpscale plan --config configs/x.yaml [--devices N] [--device-memory 80GB] [--hardware a100-80g] [--json]
  mpscale plan --config configs/x.yaml --search --devices N --hardware a100-80g [--budget S] [--compile-top K]
  mpscale compare configs/a.yaml configs/b.yaml ... [--out runs/compare]
                  [--plot docs/fidelity.png] [--set ...] [--resume | --overwrite]
                  [--hardware h100-80g]   (the table: losses, ..., TFLOP/s a device, MFU)
  mpscale eval runs/NAME [--devices N]
  mpscale sample runs/NAME [--prompt TEXT] [--tokens N] [--devices N]
  mpscale tokenize INPUT... | --embedded  --out PREFIX  (--vocab-size N | --tokenizer
                   tokenizer.json) [--key text] [--format indexed|flat]

A run writes into its own folder (default ``runs/<config name>``)::

  config.yaml     the resolved config (every default filled in)
  metrics.csv     one row per logged step: loss, eval_loss, loss_scale, overflows, ...,
                  tokens_per_s, tflops_per_device, mfu (with --hardware)
  tb/             TensorBoard event files (tensorboardX)
  checkpoints/    orbax checkpoints of the whole TrainState
  metrics.png     loss, loss scale and gradient norm
  summary.json    final train/eval loss, skipped steps, optimizer-state bytes, time,
                  a step's FLOPs a device, TFLOP/s a device, MFU (with --hardware)

The data order is a pure function of ``(seed, step)``, so ``--resume`` continues from
the latest checkpoint with the same batches, and the same losses, as an uninterrupted
run. ``--set train.steps=N --resume`` without ``--out`` extends the run of the same
overrides but ``train.steps`` in its own folder (`resume_out_dir`). An existing run is
never overwritten without ``--resume`` or ``--overwrite``, and a run whose config or
setup fails writes nothing. ``eval`` and ``sample`` restore a run onto the devices
there are: on fewer than its mesh needs, onto one.

Arguments are parsed before JAX touches a device, so ``--devices N`` can still make the
CPU backend simulate ``N`` devices (``--xla_force_host_platform_device_count``).

Across hosts, one process per host runs the same command with ``--distributed``
(JAX finds its peers under SLURM, Open MPI, Cloud TPU or Kubernetes), or with
``--coordinator HOST:PORT --num-processes N --process-id I`` (or the environment
variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``);
see `mpscale.trainer.runs.distributed`::

  mpscale train --config c.yaml --coordinator 10.0.0.1:1234 --num-processes 2 \
                --process-id 0      # and --process-id 1 on the other host
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from typing import Any, Optional, Sequence

from mpscale import validation
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import corpora
from mpscale.trainer.data import tokenizing
from mpscale.trainer.planning import targets
from mpscale.trainer.runs.checkpoints import CheckpointError
from mpscale.trainer.hf.tensors import HFCheckpointError
from mpscale.trainer.runs.compare import compare
from mpscale.trainer.runs import distributed
from mpscale.trainer.runs.interrupts import InterruptedBeforeStart, Interrupts
from mpscale.trainer.runs.devices import (host_devices_at_least, set_host_device_count,
                                          start_on_cpu)
from mpscale.trainer.runs.loop import (RunDirError, evaluate_run, evaluate_run_metrics,
                                  existing_run_files, export_run, sample_run, train)


def default_out_dir(name: str, overrides: Sequence[str], root: str = "runs") -> str:
  """``runs/<name>``, or with ``--set`` overrides ``runs/<name>+<overrides>``, so a
  shortened or changed run never lands in the folder of the config's own run."""
  if not overrides:
    return os.path.join(root, name)
  slug = "+".join(re.sub(r"[^A-Za-z0-9_.=\-]+", "_", o) for o in overrides)
  if len(slug) > 60:
    digest = hashlib.sha1("\0".join(overrides).encode()).hexdigest()[:8]
    slug = f"{slug[:50]}-{digest}"
  return os.path.join(root, f"{name}+{slug}")


def _is_steps_override(override: str) -> bool:
  return override.partition("=")[0].strip() == "train.steps"


def resume_out_dir(name: str, overrides: Sequence[str], root: str = "runs", *,
                   verbose: bool = True) -> str:
  """The folder ``train --resume`` continues without ``--out``.

  That is `default_out_dir` when it holds a run. A run extended with ``--set
  train.steps=N`` has another default folder than the run it extends, so when that
  one holds no run but the folder of the same overrides without ``train.steps``
  (``runs/<name>`` for no others) does, that run is continued, and a line on stderr
  says so. When neither holds one, the line names the folder the new run starts in
  and the runs of ``name`` under ``root``.

  Args:
    name: the config's name.
    overrides: the ``--set`` overrides, in their order.
    root: the folder of the runs.
    verbose: print the line (on stderr).

  Returns:
    The run's folder.
  """
  out = default_out_dir(name, overrides, root)
  if existing_run_files(out):
    return out
  others = [o for o in overrides if not _is_steps_override(o)]
  extended = default_out_dir(name, others, root)
  if len(others) < len(overrides) and existing_run_files(extended):
    if verbose:
      print(f"mpscale: --resume: {out} holds no run; continuing {extended} (the run "
            "that train.steps extends)", file=sys.stderr)
    return extended
  if verbose:
    looked = out if extended == out else f"{out} or {extended}"
    print(f"mpscale: --resume: no run in {looked}; starting one in {out} (runs of "
          f"{name} under {root}: {', '.join(_runs_named(name, root)) or 'none'}; "
          "--out picks one)", file=sys.stderr)
  return out


def _runs_named(name: str, root: str) -> list[str]:
  """The folders under ``root`` holding a run of the config ``name``."""
  folders = sorted(os.listdir(root)) if os.path.isdir(root) else []
  return [os.path.join(root, f) for f in folders
          if (f == name or f.startswith(f"{name}+"))
          and existing_run_files(os.path.join(root, f))]


def _hardware_set(args: argparse.Namespace) -> list[str]:
  """``--hardware`` as the override it stands for (``train.hardware=NAME``, a file's
  path made absolute: it is relative to here, not to the config); it names no run
  folder, as a ``--set`` does: the hardware changes what is logged only."""
  if args.hardware is None:
    return []
  name = os.path.abspath(args.hardware) if os.path.isfile(args.hardware) else (
      args.hardware)
  return [f"train.hardware={name}"]


def _warn_unused_devices(cfg: config_lib.RunConfig, devices: Optional[int]) -> None:
  mesh = cfg.mesh
  needed = mesh.num_devices
  if devices is None:
    return
  text = f"--devices {devices}"
  if distributed.is_multiprocess():
    import jax
    text += f" x {jax.process_count()} processes"  # --devices is per process
    devices *= jax.process_count()
  if devices > needed:
    print(f"mpscale: warning: {text}, but the config's mesh is data "
          f"{mesh.data} x fsdp {mesh.fsdp} x stage {mesh.stage} x tensor "
          f"{mesh.tensor}, so the run uses {needed} device(s); e.g. --set mesh.data="
          f"{devices // (needed // mesh.data)} for data parallelism", file=sys.stderr)


def _version_text() -> str:
  """``mpscale X (jax Y, optax Z, flax W)``, read without importing JAX."""
  from mpscale import _versions  # noqa: PLC0415

  def version(name):
    return _versions.installed(name) or "not installed"
  deps = ", ".join(f"{n} {version(n)}" for n in ("jax", "jaxlib", "optax", "flax"))
  return f"mpscale {version('mpscale')} ({deps}; floors: " + ", ".join(
      f"{n}>={v}" for n, v in _versions.FLOORS.items()) + ")"


def _run_flags(command: argparse.ArgumentParser) -> None:
  """The flags of the commands that train (``train``, ``compare``): overrides, data,
  devices, resume, progress, and joining a run across processes (hosts)."""
  command.add_argument("--set", action="append", default=[], metavar="KEY.SUB=VALUE",
                       help="override a config value (parsed as YAML); repeatable")
  command.add_argument("--data", metavar="PATH",
                       help="a text file or folder instead of the embedded corpus")
  command.add_argument("--devices", type=int, metavar="N", help=(
      "simulate N devices on CPU (XLA host platform device count)"))
  group = command.add_mutually_exclusive_group()
  group.add_argument("--resume", action="store_true",
                     help="continue the run(s) from the latest checkpoint")
  group.add_argument("--overwrite", action="store_true",
                     help="replace the files of an existing run")
  command.add_argument("--progress", action=argparse.BooleanOptionalAction,
                       default=None, help="show a progress bar (default: on a terminal)")
  command.add_argument("--quiet", action="store_true", help="print only errors")
  command.add_argument("--hardware", metavar="NAME|FILE", help=(
      "log MFU against this hardware's peak for the step's compute dtype: a built-in "
      "profile (a100-80g, h100-80g, tpu-v4) or a profile file (train.hardware; the "
      "run's folder stays the config's)"))
  hosts = command.add_argument_group(
      "several processes (hosts)",
      "start the same command on every host; see mpscale.trainer.runs.distributed")
  hosts.add_argument("--distributed", action="store_true", help=(
      "join a multi-process run, finding the peers from the cluster (SLURM, Open "
      "MPI, Cloud TPU, Kubernetes) or the flags and JAX_* variables below"))
  hosts.add_argument("--coordinator", metavar="HOST:PORT", help=(
      "process 0's address (default: $JAX_COORDINATOR_ADDRESS or detected)"))
  hosts.add_argument("--num-processes", type=int, metavar="N",
                     help="processes in the run (default: $JAX_NUM_PROCESSES)")
  hosts.add_argument("--process-id", type=int, metavar="I",
                     help="this process's id, 0..N-1 (default: $JAX_PROCESS_ID)")
  hosts.add_argument("--heartbeat-timeout", type=int, metavar="SECONDS", help=(
      "a process that stops answering for this long counts as dead and every other "
      "process stops (default: JAX's, 100)"))
  hosts.add_argument("--initialization-timeout", type=int, metavar="SECONDS",
                     help="how long to wait for every process to join (default 300)")


def _train_command(sub: Any) -> None:
  """``mpscale train``: train one config."""
  train_cmd = sub.add_parser("train", help="train one config")
  train_cmd.add_argument("--config", required=True, help="the run's YAML config")
  train_cmd.add_argument("--out", help="the run's folder (default runs/<config name>, "
                         "plus +<overrides> with --set)")
  train_cmd.add_argument("--step", type=int, metavar="N", help=(
      "with --resume: continue from the checkpoint of step N, not the latest (the "
      "later ones are deleted)"))
  _run_flags(train_cmd)


def _compare_command(sub: Any) -> None:
  """``mpscale compare``: train several configs, plot and tabulate them."""
  compare_cmd = sub.add_parser("compare",
                               help="train several configs, plot and tabulate them")
  compare_cmd.add_argument("configs", nargs="+", help="YAML configs")
  compare_cmd.add_argument("--out", help="folder of the runs and the comparison "
                           "(default runs/compare, plus +<overrides> with --set)")
  compare_cmd.add_argument("--plot", metavar="PNG",
                           help="also copy the comparison plot here")
  _run_flags(compare_cmd)


def _plan_command(sub: Any) -> None:
  """``mpscale plan``: compile a config's step from shapes, estimate and search."""
  plan_cmd = sub.add_parser("plan", help=(
      "compile one config's step for its mesh from shapes only and print per-device "
      "memory, FLOPs, collectives and the pipeline bubble"))
  plan_cmd.add_argument("--config", required=True, help="the run's YAML config")
  plan_cmd.add_argument("--set", action="append", default=[], metavar="KEY.SUB=VALUE",
                        help="override a config value (parsed as YAML); repeatable")
  plan_cmd.add_argument("--devices", type=int, metavar="N", help=(
      "simulate N devices on CPU (default: as many as the config's mesh needs)"))
  plan_cmd.add_argument("--device-memory", metavar="SIZE",
                        help="one device's memory, e.g. 80GB: say whether it fits")
  plan_cmd.add_argument("--hardware", metavar="NAME|FILE", help=(
      "estimate the step time on this hardware: a built-in profile (a100-80g, "
      "h100-80g, tpu-v4) or a profile YAML file; its memory is the device memory"))
  plan_cmd.add_argument("--search", action="store_true", help=(
      "rank every layout of the config's model on --devices N of --hardware by "
      "estimated step time (the config's own mesh is ignored)"))
  plan_cmd.add_argument("--budget", type=float, default=600.0, metavar="SECONDS",
                        help="--search: stop planning after this long (default 600)")
  plan_cmd.add_argument("--axes", default="data,fsdp,stage,context,expert,tensor", help=(
      "--search: the mesh axes to search, comma-separated (the others stay 1)"))
  plan_cmd.add_argument("--top", type=int, default=10, metavar="K",
                        help="--search: print the K fastest layouts (default 10)")
  plan_cmd.add_argument("--compile-top", type=int, default=4, metavar="K", help=(
      "--search: rank every layout from shapes, then compile the leading ones "
      "until K fit (default 4); 0: compile every layout"))
  plan_cmd.add_argument("--cache", metavar="DIR", help=(
      "--search: cache compiled plans here (default ~/.cache/mpscale/plans); "
      "'none' for no cache"))
  plan_cmd.add_argument("--compiler", choices=targets.MODES, default="auto", help=(
      "whose program to read: the hardware's own compiler (XLA's CUDA compiler for a "
      "GPU profile, no GPU needed, pip install \"mpscale[plan-gpu]\"; libtpu's for a "
      "TPU profile, no TPU needed, pip install \"mpscale[plan-tpu]\") when "
      "installed, else the CPU's (auto, the default); target: the hardware's or an "
      "error; cpu"))
  plan_cmd.add_argument("--json", action="store_true", help="print JSON")


def _run_commands(sub: Any) -> None:
  """``mpscale eval`` and ``mpscale sample``: use a run's checkpoint."""
  evaluate_cmd = sub.add_parser("eval", help="evaluate a run's latest checkpoint")
  evaluate_cmd.add_argument("run", help="the run's folder")
  sample_cmd = sub.add_parser("sample",
                              help="write text with a run's latest checkpoint")
  sample_cmd.add_argument("run", help="the run's folder")
  sample_cmd.add_argument("--prompt", default="",
                          help="text to continue (default: none)")
  sample_cmd.add_argument("--tokens", type=int, default=200, help=(
      "tokens to write: bytes, or the tokenizer's tokens for a token corpus"))
  sample_cmd.add_argument("--temperature", type=float, default=0.8,
                          help="sampling temperature; 0 picks the likeliest token")
  sample_cmd.add_argument("--seed", type=int, default=0)
  export_cmd = sub.add_parser("export", help=(
      "write a run's latest checkpoint as a Hugging Face checkpoint folder"))
  export_cmd.add_argument("run", help="the run's folder")
  export_cmd.add_argument("--hf", required=True, metavar="OUT", help=(
      "the folder to write (config.json, safetensors sharded at 5 GB, the "
      "tokenizer's files when the run had them); it must not hold a checkpoint"))
  export_cmd.add_argument("--dtype", choices=("float32", "bfloat16"),
                          default="float32", help="the stored weights' dtype")
  for command in (evaluate_cmd, sample_cmd, export_cmd):
    command.add_argument("--step", type=int, metavar="N", help=(
        "use the checkpoint of step N (default: the latest)"))
    command.add_argument("--devices", type=int, metavar="N", help=(
        "use at most N devices, simulating them on CPU (default: the devices JAX "
        "has); a run whose mesh needs more is rebuilt on one device"))


def _tokenize_command(sub: Any) -> None:
  """``mpscale tokenize``: text or JSON-lines to a token dataset."""
  tokenize_cmd = sub.add_parser("tokenize", help=(
      "turn text or JSON-lines into a token dataset (data.tokens) with a Hugging "
      "Face tokenizer"))
  tokenize_cmd.add_argument("inputs", nargs="*", metavar="INPUT", help=(
      "text files (one document each), JSON-lines files (.jsonl: one document per "
      "line) or folders of them"))
  tokenize_cmd.add_argument("--embedded", action="store_true", help=(
      "tokenize the embedded corpus (one document per module)"))
  tokenize_cmd.add_argument("--out", required=True, metavar="PREFIX", help=(
      "the indexed dataset's prefix (PREFIX.bin + PREFIX.idx), or the flat file"))
  vocabulary = tokenize_cmd.add_mutually_exclusive_group(required=True)
  vocabulary.add_argument("--tokenizer", metavar="JSON",
                          help=("encode with this Hugging Face tokenizer.json, or "
                                "a checkpoint folder's"))
  vocabulary.add_argument("--vocab-size", type=int, metavar="N", help=(
      "train a byte-level BPE of N ids on the input, saved as tokenizer.json beside "
      "the output"))
  tokenize_cmd.add_argument("--key", default="text",
                            help="the text field of a JSON-lines record (default text)")
  tokenize_cmd.add_argument("--format", choices=tokenizing.FORMATS, default="indexed",
                            help="Megatron's indexed dataset (default) or a flat file")
  tokenize_cmd.add_argument("--eod-token", default=tokenizing.EOD_TOKEN, help=(
      "the end-of-document token appended to each document (default "
      f"{tokenizing.EOD_TOKEN})"))
  tokenize_cmd.add_argument("--overwrite", action="store_true", help=(
      "replace a corpus or tokenizer.json already there (refused by default)"))
  tokenize_cmd.add_argument("--progress", action=argparse.BooleanOptionalAction,
                            default=None,
                            help="show a progress bar (default: on a terminal)")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="mpscale", description=(
          "Mixed-precision and parallel training for JAX: train a config (the "
          "built-in tiny LM, or your model and data), compare configs, plan a run on "
          "hardware you do not have, evaluate or sample a run, tokenize text."))
  parser.add_argument("--version", action="version", version=_version_text())
  sub = parser.add_subparsers(dest="command", required=True)
  for add in (_train_command, _compare_command, _plan_command, _run_commands,
              _tokenize_command):
    add(sub)
  return parser


_TOKENIZE_FLAGS = {"inputs": "INPUT", "out": "--out", "tokenizer": "--tokenizer",
                   "vocab_size": "--vocab-size", "key": "--key", "fmt": "--format",
                   "eod_token": "--eod-token"}
"""`mpscale.trainer.data.tokenizing.tokenize`'s arguments as the command's flags."""


def _tokenize(args: argparse.Namespace) -> None:
  """``mpscale tokenize``: writes the corpus, prints what it wrote."""
  try:
    made = tokenizing.tokenize(
        args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        key=args.key, fmt=args.format, eod_token=args.eod_token,
        embedded=args.embedded, progress=args.progress, overwrite=args.overwrite)
  except validation.ArgumentError as e:
    raise config_lib.ConfigError(str(e.renamed(
        lambda n: _TOKENIZE_FLAGS.get(n, n)))) from None
  except OSError as e:
    raise config_lib.ConfigError(f"tokenize: {e}") from None
  print(made.text())


def _plan_config(args: argparse.Namespace) -> Optional[config_lib.RunConfig]:
  """``mpscale plan``'s config, loaded before JAX starts (its mesh's devices are the
  ones the CPU compile simulates when ``--devices`` is not given), and then planned:
  one load. ``None`` for a config that does not load: the plan loads it again and
  says what is wrong with it."""
  try:
    return config_lib.load_config(args.config, args.set)
  except config_lib.ConfigError:
    return None


def _initialize(args: argparse.Namespace) -> None:
  """``jax.distributed.initialize`` when the flags or environment ask for it."""
  get = lambda name: getattr(args, name, None)
  distributed.initialize(
      get("coordinator"), get("num_processes"), get("process_id"),
      auto=bool(get("distributed")), heartbeat_timeout=get("heartbeat_timeout"),
      initialization_timeout=get("initialization_timeout"))


def _search(args: argparse.Namespace, hardware: Any) -> None:
  """``mpscale plan --search``: rank the layouts, with a progress bar on a terminal."""
  from mpscale.trainer.planning import search as search_lib  # noqa: PLC0415
  if hardware is None or not args.devices:
    raise config_lib.ConfigError("--search needs --devices N and --hardware NAME")
  cache = (search_lib.default_cache_dir() if args.cache is None else
           None if args.cache.lower() == "none" else args.cache)
  from rich.progress import Progress  # noqa: PLC0415
  with Progress(transient=True, disable=args.json or not sys.stderr.isatty()) as bar:
    task = bar.add_task("planning layouts", total=None)

    def progress(done: int, total: int, what: str) -> None:
      bar.update(task, completed=done, total=total,
                 description=f"planning layouts (last: {what})")

    try:
      result = search_lib.search(args.config, args.devices, hardware,
                                 overrides=tuple(args.set),
                                 axes=tuple(a.strip() for a in args.axes.split(",")),
                                 budget=args.budget,
                                 top=args.compile_top or None,
                                 cache_dir=cache, compiler=args.compiler,
                                 progress=progress)
    except (ValueError, TypeError) as e:
      raise config_lib.as_config_error(e).located(args.config) from None
  print(json.dumps(result.to_dict(), indent=2) if args.json
        else result.text(top=args.top))


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command; returns the exit status (2 for a config or run-folder error)."""
  args = _parser().parse_args(argv)
  plan_cfg = None
  try:
    if args.command == "plan":  # compile only: a GPU compiler registers on the CPU
      start_on_cpu()
      if args.devices is None and not args.search:
        plan_cfg = _plan_config(args)
        host_devices_at_least(1 if plan_cfg is None else plan_cfg.mesh.num_devices)
    set_host_device_count(getattr(args, "devices", None))  # tokenize has none
    _initialize(args)
  except ValueError as e:
    print(f"mpscale: error: {e}", file=sys.stderr)
    return 2
  try:
    if args.command == "train":
      with Interrupts():  # a Ctrl-C from here on stops at a step boundary
        cfg = config_lib.load_config(args.config, args.set + _hardware_set(args),
                                     args.data)
        _warn_unused_devices(cfg, args.devices)
        out = args.out or (resume_out_dir(cfg.name, args.set, verbose=not args.quiet)
                           if args.resume else default_out_dir(cfg.name, args.set))
        train(cfg, out, resume=args.resume, overwrite=args.overwrite,
              progress=args.progress, source=args.config, verbose=not args.quiet,
              step=args.step)
    elif args.command == "plan":
      from mpscale.trainer.planning import compiled as plan_lib  # noqa: PLC0415
      from mpscale.trainer.planning.hardware import load_hardware  # noqa: PLC0415
      try:
        hardware = None if args.hardware is None else load_hardware(args.hardware)
      except ValueError as e:  # an unknown profile, or a profile file's mistake
        raise config_lib.as_config_error(e) from None
      if args.search:
        _search(args, hardware)
        return 0
      cfg = plan_cfg or config_lib.load_config(args.config, args.set)
      try:
        planned = plan_lib.plan(cfg, device_memory=args.device_memory,
                                hardware=hardware, compiler=args.compiler)
      except (ValueError, TypeError) as e:
        raise config_lib.as_config_error(e).located(args.config) from None
      print(planned.to_json() if args.json else planned.text())
    elif args.command == "eval":
      values, step = evaluate_run_metrics(args.run, args.devices, args.step)
      unit = corpora.loss_unit(config_lib.load_config(
          os.path.join(args.run, "config.yaml")))
      said = [f"eval loss {values.pop('loss'):.4f}"
              + ("" if unit is None else f" nats/{unit}")]
      said += [f"{name} {value:.4f}" for name, value in sorted(values.items())]
      print(f"{args.run}: {', '.join(said)} at step {step}")
    elif args.command == "tokenize":
      _tokenize(args)
    elif args.command == "export":
      written = export_run(args.run, args.hf, dtype=args.dtype, devices=args.devices,
                           step=args.step)
      print(f"{args.hf}: {', '.join(written)}")
    elif args.command == "sample":
      if args.tokens < 1 or args.temperature < 0:
        raise config_lib.ConfigError("--tokens must be >= 1 and --temperature >= 0")
      print(sample_run(args.run, args.prompt, args.tokens,
                       temperature=args.temperature, seed=args.seed,
                       devices=args.devices, step=args.step))
    else:
      for path in args.configs:
        _warn_unused_devices(config_lib.load_config(path, args.set, args.data),
                             args.devices)
      compare(args.configs, args.out or default_out_dir("compare", args.set),
              overrides=args.set + _hardware_set(args), data_path=args.data,
              resume=args.resume, overwrite=args.overwrite, progress=args.progress,
              plot_path=args.plot, verbose=not args.quiet)
  except (config_lib.ConfigError, RunDirError, CheckpointError, HFCheckpointError) as e:
    print(f"mpscale: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    if args.command not in ("train", "compare"):
      said = ""
    elif isinstance(e, InterruptedBeforeStart) and args.command == "train":
      said = " before the run wrote anything"
    else:
      said = "; continue with --resume"
    print(f"mpscale: interrupted{said}", file=sys.stderr)
    return 130
  return 0
