"""Plan a run at scale without the hardware: XLA's own numbers for the real step.

`plan` builds the train step of a config for its mesh on the devices JAX has (``mpscale
plan --devices N`` simulates ``N`` CPU devices), from abstract shapes only: the
parameters are ``jax.eval_shape(model.init, key)``, the state is what
``make_train_step``'s ``init`` returns for shapes (``jax.ShapeDtypeStruct``s with the
shardings it would place the real state in), and the batch is shapes with its
data-parallel sharding. Nothing the size of the model is allocated. It compiles the
step ahead of time (``step.lower(state, batch).compile()``) and reads, per device:

- parameter and optimizer-state bytes, exactly, from each leaf's shard shape;
- gradient bytes (parameter-shaped, in the parameter dtype, sharded like them);
- XLA's buffer assignment (``compiled.memory_analysis()``): arguments, outputs,
  aliased (donated) bytes and temporaries, and from them the peak,
  ``arguments + outputs - aliased + temporaries``;
- FLOPs of the matrix products and convolutions of the partitioned per-device
  program (a GPU's cuBLAS and cuDNN calls included), loops counted by their trip
  counts (`mpscale.trainer.planning.hlo.matmul_flops`; XLA's ``cost_analysis()``
  counts a loop's body once, and is reported beside it where the compiler gives one:
  `Plan.xla_flops_per_device`);
- each collective in the compiled HLO (all-reduce, all-gather, reduce-scatter,
  collective-permute, all-to-all) with its count and bytes per step, loops counted
  by their trip counts, a bfloat16 sum at bfloat16's bytes (the CPU compile widens
  it to float32; a GPU or TPU does not) and a float32 one at float32's (with
  ``precision.grad_reduce_dtype: float32``, twice a bfloat16 gradient sum's):
  `mpscale.trainer.planning.hlo.collectives`;

plus the pipeline bubble of the config's schedule and the tokens per step; for a step
time on named hardware, the kernels (`mpscale.trainer.planning.hlo.kernels`: each matrix product's
FLOPs and bytes, every other kernel's bytes) and the collectives split by the mesh
axes they span (`mpscale.trainer.planning.hlo.collectives_over`), which
`mpscale.trainer.planning.step_time.estimate` prices (``plan(cfg, hardware=...)``,
``mpscale plan --hardware a100-80g``). A pipelined
config (``mesh.stage > 1``) also gets every schedule side by side for its stages,
micro-batches and virtual stages (`Plan.schedules`): GPipe and 1F1B, and both
interleaved when ``mesh.virtual_stages > 1``, each with its bubble and the most stage
inputs it keeps alive per device, read from the schedules' tick tables
(`mpscale.pipeline_schedule_table`; nothing more is compiled).

A user's model (``model.provider``: a Flax NNX module, a linen module or a
`mpscale.trainer.Model`) is planned as the trainer would train it: its data provider
is loaded and the batch's shapes are those of the first batch (``data.batch_size``
rows), and the model is built from that batch by the trainer's own code
(`mpscale.trainer.runs.loop`). Building it runs the provider: a Flax module is built with
its real parameters (a linen module is initialized on the first batch), held once;
what is compiled is still shapes only (the parameters, the model's state and the
optimizer state are ``jax.ShapeDtypeStruct``s), so nothing is allocated a second time.
Its model FLOPs (`Plan.model_flops`) are unknown (``None``): the formula is the
built-in LM's.

The numbers are those of the CPU backend's compile: parameter and state bytes and the
collectives are properties of the layout, and hold on any backend; temporaries and
FLOPs follow the CPU compiler's fusion decisions and are estimates for a GPU or TPU.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any, NamedTuple, Optional

import jax

from mpscale.trainer.planning import hlo as hlo_lib
from mpscale import _jaxprs as jaxprs
from mpscale import parallel as parallel_lib
from mpscale import validation
from mpscale.trainer.config import build as builders
from mpscale.trainer.models import lm as lm_lib
from mpscale.trainer.runs import loop
from mpscale.trainer.planning import step_time as step_time_lib
from mpscale.trainer.planning import targets
from mpscale.trainer.planning.hardware import Hardware, load_hardware

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: Any, name: str = "--device-memory") -> int:
  """``"80GB"``, ``"80 GiB"``, ``"512MB"`` or a number of bytes, as bytes.

  Raises:
    ValueError: naming ``name``, for anything else.
  """
  if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
    return int(text)
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
  if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
    raise ValueError(f"{name}: expected a size such as 80GB, 40GiB or 512MB; got "
                     f"{text!r}")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _fmt_count(n: float) -> str:
  """``163.1M``, ``1.2B``, ``37.5K`` or ``512``: a count of parameters, short."""
  for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
    if abs(n) >= size:
      return f"{n / size:.1f}{unit}"
  return f"{int(n)}"


def _fmt_bytes(n: float) -> str:
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


# ------------------------------------------------------------------ the plan


@dataclasses.dataclass
class Plan:
  """What one step of a config costs per device, from the compiled program."""
  name: str
  devices: int
  mesh: dict[str, int]
  params: int
  """Parameters (a count, not bytes)."""
  tokens_per_step: int
  """Tokens in one global batch (a user's batch without ``mask`` or ``targets``: its
  rows)."""
  bytes: dict[str, int]
  """Per device: ``params``, ``optimizer_state``, ``gradients``, ``model_state`` (a
  user's model's, e.g. BatchNorm statistics; 0 without), ``batch``, ``arguments``,
  ``outputs``, ``aliased``, ``temporaries``, ``peak``."""
  flops_per_device: float
  """The matrix products' FLOPs of one device's program per step (`mpscale.trainer.planning.hlo.matmul_flops`),
  bubble ticks and recomputation included."""
  xla_flops_per_device: Optional[float]
  """XLA's own count (``compiled.cost_analysis()``), which counts a loop's body
  once; ``None`` where the compiler gives none (`xla_flops_note` says why)."""
  model_flops: Optional[float]
  """The built-in LM's arithmetic per step: ``6 * N * tokens`` (``N`` the parameters
  outside the embeddings) plus attention's ``12 * layers * tokens * seq_len *
  d_model``; with ``train.recompute: full`` the forward pass runs twice (8 and 16;
  for the share of layers ``train.recompute_layers`` recomputes). ``None``
  for a user's model (``model.provider``), whose arithmetic the plan does not know
  (``flops_per_device`` counts its compiled matrix products)."""
  collectives: dict[str, dict[str, int]]
  bubble: float
  compile_seconds: float
  device_memory: Optional[int] = None
  kernels: dict[str, Any] = dataclasses.field(
      default_factory=lambda: {"dots": [], "bytes": 0.0})
  """`mpscale.trainer.planning.hlo.kernels` of the compiled step: ``dots``, ``[flops, bytes, count]``
  of each distinct matrix-product kernel, and ``bytes``, every other kernel's bytes
  per step; float32 at 16 bits under a 16-bit compute dtype (the CPU backend widens
  16-bit arithmetic to float32; a GPU or TPU does not)."""
  collectives_over: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
  """`mpscale.trainer.planning.hlo.collectives_over`: the collectives by the mesh axes they span."""
  compute_dtype: str = "float32"
  """The policy's compute dtype: the peak the matrix products run at."""
  estimate: Optional[step_time_lib.Estimate] = None
  """The step time on the hardware given to `plan` (`mpscale.trainer.planning.step_time`)."""
  schedules: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  """A pipelined config's schedules side by side (`schedule_rows`), for its stages,
  micro-batches and virtual stages: ``schedule``, ``virtual_stages``, ``bubble``,
  ``inputs_alive`` (the most stage inputs a device keeps at once) and ``config``
  (whether it is the config's own); empty without a pipeline."""
  residuals: Optional[dict[str, int]] = None
  """A pipelined config's `mpscale.Pipeline.residual_bytes`: what a device keeps for
  the backward under its schedule and recompute policy (``layer``, ``items``,
  ``layers``, ``total``); ``None`` without a pipeline."""
  activations: Optional[int] = None
  """An unpipelined config's activation bytes a device: what autodiff keeps for the
  backward of one micro-batch of the device's rows (`activation_bytes`); ``None``
  for a pipeline (its `residuals` say it per schedule)."""
  float32_share: Optional[float] = None
  """Under a 16-bit compute dtype, the share of the loss's matrix FLOPs that still
  run in float32 (`mpscale.Policy.wide_share`: a model that fixes its layers'
  dtype); ``None`` otherwise, or for a pipeline."""
  largest_gather: int = 0
  """The largest single all-gather of the step, bytes a device
  (`mpscale.trainer.planning.hlo.largest_collective`): under FSDP, the most weights gathered at once
  (one layer's where they are gathered where used)."""
  gathered_alive: int = 0
  """The most all-gathered bytes a device holds at once (`mpscale.trainer.planning.hlo.gathered_alive`):
  under FSDP that gathers where it uses, a layer's weights or two (the next one's
  prefetched), or the largest unsplit leaf; the whole model's where it is gathered
  when the step starts."""
  saved_activations: Optional[int] = None
  """The activations the compiled program hands from its forward layer loop to its
  backward one, bytes a device (`mpscale.trainer.planning.hlo.saved_for_backward`): read from the
  program, so split as the compiler split them (over the batch under FSDP, over the
  heads under tensor parallelism); ``None`` where the layers are unrolled."""
  fp8_flops: float = 0.0
  """The part of ``flops_per_device`` in FP8 GEMMs (`mpscale.trainer.planning.hlo.fp8_flops`): the
  estimate prices it at the profile's ``float8`` peak."""
  xla_flops_note: str = ""
  """Why `xla_flops_per_device` is ``None`` (empty where XLA gave its count)."""
  compiled_for: str = "fake CPU devices (XLA's CPU compiler)"
  """The devices and compiler the program was compiled for
  (`mpscale.trainer.planning.targets`): the hardware's own GPU compiler, or the CPU's."""
  compile_note: str = ""
  """Why the CPU's compiler stood in for the hardware's, and how to install it."""
  overlaps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  """The asynchronous collectives and the kernels scheduled while each transfers
  (`mpscale.trainer.planning.hlo.overlaps`, as dicts): the estimate hides each behind its window."""

  @property
  def flops_per_step(self) -> float:
    return self.flops_per_device * self.devices

  @property
  def fits(self) -> Optional[bool]:
    return None if self.device_memory is None else (
        self.bytes["peak"] <= self.device_memory)

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.update(flops_per_step=self.flops_per_step, fits=self.fits)
    return out

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2)

  @classmethod
  def from_compiled(cls, built: Any, compiled: Any, seconds: float) -> "Plan":
    """The plan of a compiled step: its memory and cost analyses, what its HLO says
    (FLOPs, collectives, kernels, overlaps, gathers alive), and the sizes of the
    state and batch it was built from (``built``: `plan`'s setup)."""
    cfg, state, batch, mesh = built.cfg, built.state, built.batch, built.setup.mesh
    mem = compiled.memory_analysis()
    xla_flops, xla_flops_note = _xla_flops(compiled, built.target)
    arguments, outputs = mem.argument_size_in_bytes, mem.output_size_in_bytes
    aliased, temporaries = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    hlo = hlo_lib.parse(compiled.as_text())  # once, for the FLOPs and the collectives
    param_bytes = parallel_lib.tree_bytes(state.params)
    axes = {} if mesh is None else dict(mesh.shape)
    # State offloaded to host memory (train.offload): the target's memory analysis
    # counts it in host outputs but, on a compile-only target or the CPU, its
    # arguments among the device's; the device holds none of it between steps.
    host = offloaded_bytes(state, cfg.train.offload)
    arguments -= max(0, host - getattr(mem, "host_argument_size_in_bytes", 0))
    compute_dtype = jax.numpy.dtype(built.setup.policy.compute_dtype).name
    # The CPU compile widens 16-bit arrays to float32; the target's keeps their dtypes.
    narrow = (compute_dtype in ("bfloat16", "float16")
              and built.target.compiler == "cpu")
    float32_bytes = 2 if narrow else 4
    work = hlo_lib.kernels(hlo, float32_bytes=float32_bytes)
    return cls(
        name=cfg.name, devices=1 if mesh is None else mesh.devices.size, mesh=axes,
        params=lm_lib.num_params(built.params), tokens_per_step=built.tokens,
        bytes={"params": param_bytes,
               "optimizer_state": parallel_lib.tree_bytes(state.opt_state),
               "gradients": param_bytes,
               "model_state": parallel_lib.tree_bytes(state.model_state),
               "batch": parallel_lib.tree_bytes(batch),
               "arguments": arguments, "outputs": outputs, "aliased": aliased,
               "temporaries": temporaries, "host": host,
               "peak": int(arguments + outputs - aliased + temporaries)},
        flops_per_device=hlo_lib.matmul_flops(hlo), fp8_flops=hlo_lib.fp8_flops(hlo),
        xla_flops_per_device=xla_flops, xla_flops_note=xla_flops_note,
        model_flops=(None if built.provided
                     else _model_flops(cfg, built.params, built.tokens)),
        collectives=hlo_lib.collectives(hlo), compile_seconds=seconds,
        device_memory=built.memory,
        kernels={"dots": [list(d) for d in work.dots], "bytes": work.bytes},
        collectives_over=hlo_lib.collectives_over(hlo, axes),
        compute_dtype=compute_dtype,
        largest_gather=hlo_lib.largest_collective(hlo, "all-gather"),
        gathered_alive=hlo_lib.gathered_alive(hlo),
        saved_activations=hlo_lib.saved_for_backward(hlo),
        compiled_for=built.target.description, compile_note=built.target.note,
        overlaps=[{"collective": o.collective, "bytes": o.bytes, "count": o.count,
                   "window": {"dots": [list(d) for d in o.window.dots],
                              "bytes": o.window.bytes}}
                  for o in hlo_lib.overlaps(hlo, axes, float32_bytes=float32_bytes)],
        **_loss_readings(built))

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Plan":
    """The `Plan` that `to_dict` wrote (derived keys dropped; an estimate is
    recomputed with `mpscale.trainer.planning.step_time.estimate`, not read)."""
    fields = {f.name for f in dataclasses.fields(cls)} - {"estimate"}
    return cls(**{k: v for k, v in d.items() if k in fields})

  def text(self) -> str:
    b = self.bytes
    mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
    model_flops = ("" if self.model_flops is None else
                   f"; the model's {self.model_flops:.3e}")
    lines = [
        f"{self.name}: {_fmt_count(self.params)} params, {self.tokens_per_step} tokens "
        f"per step, {_counted(self.devices, 'device')}{f' ({mesh})' if mesh else ''}; "
        f"compiled in {self.compile_seconds:.1f} s for {self.compiled_for}",
        *([f"  note: {self.compile_note}"] if self.compile_note else []),
        "per device:",
        f"  parameters        {_fmt_bytes(b['params']):>12}",
        f"  optimizer state   {_fmt_bytes(b['optimizer_state']):>12}",
        f"  gradients         {_fmt_bytes(b['gradients']):>12}",
        *([f"  model state       {_fmt_bytes(b['model_state']):>12}"]
          if b.get("model_state") else []),
        f"  batch             {_fmt_bytes(b['batch']):>12}",
        f"  temporaries       {_fmt_bytes(b['temporaries']):>12}",
        *self._fsdp_lines(),
        f"  peak              {_fmt_bytes(b['peak']):>12}"
        + ("" if self.device_memory is None else
           f"  of {_fmt_bytes(self.device_memory)}: "
           + ("fits" if self.fits else "DOES NOT FIT")),
        *([f"  in host memory    {_fmt_bytes(b['host']):>12}  (train.offload: "
           "between steps; moved in and out each step)"] if b.get("host") else []),
        f"  FLOPs per step    {self.flops_per_device:12.3e}  (all devices "
        f"{self.flops_per_step:.3e}{model_flops})",
        *([] if self.float32_share is None else [
            f"    in float32      {self.float32_share:12.0%}  (the policy computes in "
            f"{self.compute_dtype}"
            + ("; the model keeps its own float32 layers)" if self.float32_share > 0.5
               else ")")]),
        f"pipeline bubble     {self.bubble:12.1%}",
        *self._residual_lines(),
        *self._schedule_lines(),
        "collectives per step (per device):",
    ]
    if not self.collectives:
      lines.append("  none")
    for kind, c in sorted(self.collectives.items()):
      lines.append(f"  {kind:<18} {c['count']:>6} x  {_fmt_bytes(c['bytes']):>12}")
    if self.estimate is not None:
      lines.append(self.estimate.text())
    return "\n".join(lines)

  def _fsdp_lines(self) -> list[str]:
    """Activations a device and the weights gathered at once (under FSDP)."""
    lines = []
    split = " (before the tensor split)" if self.mesh.get("tensor", 1) > 1 else ""
    if self.activations is not None:
      lines.append(f"    activations     {_fmt_bytes(self.activations):>12}  (kept for "
                   f"the backward of one micro-batch of this device's rows){split}")
    if self.saved_activations is not None:
      lines.append(f"    saved           {_fmt_bytes(self.saved_activations):>12}  (the "
                   "program's: its forward layer loop's stacks for the backward)")
    fsdp = self.mesh.get("fsdp", 1) * self.mesh.get("fsdp_transpose", 1)
    if self.largest_gather and fsdp > 1:
      total = self.collectives.get("all-gather", {}).get("bytes", 0)
      params = max(self.bytes["params"] * fsdp, 1)
      lines.append(f"    gathered        {_fmt_bytes(self.gathered_alive):>12}  (alive "
                   f"at once; the largest all-gather {_fmt_bytes(self.largest_gather)}, "
                   f"all of them {total / params:.1f}x the parameters a step)")
    return lines

  def _residual_lines(self) -> list[str]:
    r = self.residuals
    if not r:
      return []
    split = (" (before the tensor split)"
             if self.mesh.get("tensor", 1) > 1 else "")
    # A slot is not a micro-batch: it holds one micro-batch's pass through one chunk
    # of layers (v of them a micro-batch), and GPipe's scan keeps one every tick.
    gpipe = any(row["config"] and row["schedule"] == "gpipe" for row in self.schedules)
    return [f"  residuals         {_fmt_bytes(r['total']):>12}  ("
            f"{_counted(r['items'], 'slot')} x {_counted(r['layers'], 'layer')} x "
            f"{_fmt_bytes(r['layer'])}; a slot: a micro-batch through a chunk of layers"
            + (", one a tick of GPipe's scan, bubble ticks too" if gpipe else "")
            + f"){split}"]

  def _schedule_lines(self) -> list[str]:
    if not self.schedules:
      return []
    lines = [f"  {'schedule':<18}{'bubble':>12}  {'inputs alive':>12}"]
    for row in self.schedules:
      name = row["schedule"] + (f" v{row['virtual_stages']}"
                                if row["virtual_stages"] > 1 else "")
      lines.append(f"  {name:<18}{row['bubble']:12.1%}  {row['inputs_alive']:12d}"
                   + ("  <- config" if row["config"] else ""))
    return lines


_NO_XLA_FLOPS = {
    "cuda": "XLA's CUDA compiler analyses a program's cost only with a GPU present; "
            "XLA's generic analysis of the compiled module (the CPU client's) marks "
            "each cuBLAS and cuDNN call unknown, leaving their products out, so none "
            "is given: flops_per_device counts those calls"}
"""Why a compiler's program has no XLA count (`Plan.xla_flops_note`), by
`mpscale.trainer.planning.targets.Target.compiler`."""


def offloaded_bytes(state: Any, offload: Any) -> int:
  """Bytes of the `mpscale.TrainState` fields ``offload`` names (``train.offload``),
  which live in host memory between steps."""
  return sum(parallel_lib.tree_bytes(getattr(state, field)) for field in offload)


def _xla_flops(compiled: Any, target: targets.Target) -> tuple[Optional[float], str]:
  """XLA's own FLOPs of the compiled step (`Plan.xla_flops_per_device`), or ``None``
  and why (`Plan.xla_flops_note`)."""
  try:
    cost = compiled.cost_analysis()
  except NotImplementedError:
    cost = None
  # JAX leaves its structure open: a dict, or a list of one dict per program, or
  # None (a compile-only GPU program has none).
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if cost and "flops" in cost:
    return float(cost["flops"]), ""
  return None, _NO_XLA_FLOPS.get(
      target.compiler, f"{target.description} gives no cost analysis")


def _counted(count: int, noun: str) -> str:
  """``"1 device"``, ``"8 devices"``."""
  return f"{count} {noun}" + ("" if count == 1 else "s")


def schedule_rows(num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                  schedule: Optional[str] = None) -> list[dict[str, Any]]:
  """Every pipeline schedule for ``S`` stages and ``M`` micro-batches, side by side.

  GPipe, 1F1B and ZB-H1, then, with ``virtual_stages`` ``v > 1``, GPipe and 1F1B
  interleaved over ``v`` chunks: each a dict of ``schedule``, ``virtual_stages``,
  ``bubble`` (`mpscale.pipeline_bubble_fraction` of its tick table, time-weighted: a ZB-H1
  tick is one of F, B and W, a paired 1F1B tick a forward and a backward (B and W
  together), so the fractions compare as times at equal forward, input-gradient and
  weight-gradient costs), ``inputs_alive`` (the most micro-batches whose residuals
  a device keeps at once: GPipe ``v M``, 1F1B ``min(M, 2 S - 1)``, ZB-H1 ``min(S,
  M)``, interleaved 1F1B at most ``(v + 1) S - 1``) and ``config`` (``schedule`` with ``virtual_stages``:
  the config's own). Read from the tables alone; nothing is compiled.
  """
  # pylint: disable=protected-access
  rows = []
  for v in sorted({1, virtual_stages}):
    for name in parallel_lib.SCHEDULES:
      if name == "zb_h1" and v > 1:
        continue  # one chunk per stage
      table = parallel_lib.pipeline_schedule_table(name, num_stages, num_microbatches, v)
      rows.append({"schedule": name, "virtual_stages": v,
                   "bubble": parallel_lib.pipeline_bubble_fraction(table),
                   "inputs_alive": int(parallel_lib.live_slots(table)),
                   "config": name == schedule and v == virtual_stages})
  return rows


def _model_flops(cfg: Any, params: Any, tokens: int) -> float:
  """`Plan.model_flops`."""
  m = cfg.model
  embeddings = sum(x.size for x in jax.tree_util.tree_leaves(params.get("embed", {})))
  dense = lm_lib.num_params(params) - embeddings
  chunks = cfg.mesh.stage * cfg.mesh.virtual_stages
  remat = cfg.train.full_recompute_layers(m.num_layers // chunks) * chunks / m.num_layers
  return ((6.0 + 2 * remat) * dense * tokens
          + (12.0 + 4 * remat) * m.num_layers * tokens * m.seq_len * m.d_model)


def _provided_model(cfg: Any) -> tuple[Any, dict[str, Any], int, str]:
  """A user's model (``model.provider``) as the trainer builds it, with the shapes
  of a global batch and the tokens in one.

  The data provider is loaded and its first batch taken, and the model is built on
  that batch, by the trainer's own code (`mpscale.trainer.runs.loop`); the model's state
  (`mpscale.trainer.Model.init_state`) is given as shapes.

  Returns:
    ``(model, batch, tokens_per_step, data_key)``: the `mpscale.trainer.Model`, the
    batch as ``jax.ShapeDtypeStruct``s without shardings (``data.batch_size`` rows),
    the tokens (or rows) of one global batch, and the key naming the data.

  Raises:
    ValueError, TypeError: naming the config key, for a provider that fails or
      returns the wrong type (a linen module's loss runs on the first batch).
  """
  # pylint: disable=protected-access
  data = loop.open_data(cfg, None)
  first_batch = data.train[0]
  model, _ = loop.open_model(cfg, None, None, first_batch)
  # pylint: enable=protected-access
  if model.init_state is not None:
    init_state = model.init_state
    model = model._replace(init_state=lambda key: jax.eval_shape(init_state, key))
  batch = loop.global_batch_shapes(data, first_batch)
  data_key = "data.provider" if cfg.data.provider is not None else "the built-in data"
  return model, batch, data.tokens_per_step, data_key


def activation_bytes(loss_fn: Any, params: Any, batch: Any, rows: int,
                     cast: Any = lambda p: p, **kwargs: Any) -> tuple[int, Any]:
  """What autodiff keeps for the backward of ``loss_fn`` on ``rows`` rows of
  ``batch`` (one micro-batch of a device's share), from a trace (shapes are enough;
  nothing is compiled or run): the residuals of its ``jax.vjp`` in the parameters,
  less the parameters and anything shaped like one (their casts to the compute
  dtype, which the step holds anyway). Shapes are whole along the mesh axes the
  model leaves to GSPMD (a tensor-parallel layer's are split further on the device).

  Args:
    loss_fn: ``loss_fn(params, batch, **kwargs)``, as `mpscale.make_train_step`
      calls it.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    batch: a batch (arrays or shapes) whose leading dimension is the rows.
    rows: the rows of the micro-batch a device computes at once.
    cast: the precision policy's cast to the compute dtype.
    **kwargs: passed to ``loss_fn`` (``rng``, ``model_state``).

  Returns:
    ``(bytes, forward)``: the bytes, and the traced forward (a closed jaxpr, e.g.
    for `mpscale._jaxprs.matmul_flops`): one trace serves both.
  """
  local = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype), batch)
  shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(params)}

  def residuals(p, b, kw):
    _, pullback = jax.vjp(lambda q: loss_fn(cast(q), b, **kw), p)
    inputs = jax.tree_util.tree_leaves((p, b, kw))
    return [x for x in jax.tree_util.tree_leaves(pullback)
            if not any(x is y for y in inputs) and tuple(x.shape) not in shapes]

  forward, kept = jax.make_jaxpr(residuals, return_shape=True)(params, local, kwargs)
  return int(sum(x.size * x.dtype.itemsize for x in kept)), forward


_CPU_MULTIPROCESS = "Multiprocess computations aren't implemented on the CPU backend"
"""JAX's CPU backend, asked to compile for more simulated devices than it runs in one
process (seen at 2,240 and 2,520; 1,920 compiles)."""

_NO_TILES = "Couldn't find output tile sizes"
"""XLA's CUDA compiler, asked for a program it cannot autotune (no GPU), may find no
Triton tiling for a matrix product its fusion pass gave to Triton (seen: a float16
A100 step with XLA's attention)."""


def _compile(lowered: Any, target: targets.Target) -> Any:
  """``lowered.compile()``; for a GPU target whose Triton GEMM tiling fails without
  autotuning (`_NO_TILES`), compiled again with XLA's Triton GEMMs off, their
  products left to cuBLAS as a GPU's autotuner may leave them: the FLOPs are the
  same, and the fusions around them change little."""
  try:
    return lowered.compile()
  except Exception as e:  # JaxRuntimeError, whose module differs across versions
    if target.compiler == "cpu" and _CPU_MULTIPROCESS in str(e):
      raise ValueError(
          f"--devices: the CPU's compiler cannot compile for {jax.device_count()} "
          "simulated devices (JAX's CPU backend: \"Multiprocess computations aren't "
          "implemented\"); plan on the GPU's compiler (--compiler target, "
          "pip install \"mpscale[plan-gpu]\") or with fewer devices") from e
    if target.compiler != "cuda" or _NO_TILES not in str(e):
      raise
  return lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})


def _on_device(tree: Any, device: Any) -> Any:
  """``tree``'s array shapes placed on ``device`` (a compile-only one), so the step
  compiles for it rather than for JAX's default device."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      if hasattr(x, "shape") and hasattr(x, "dtype") else x, tree)


def plan(cfg: Any, device_memory: Any = None, hardware: Any = None,
         compiler: str = "auto") -> Plan:
  """The `Plan` of one train step of ``cfg`` on its mesh (see the module docstring).

  For a user's model (``model.provider``) this runs the data and model providers as
  training would (a Flax module is built with its real parameters, once; the batch's
  shapes are the first batch's), and compiles the step from shapes all the same; its
  `Plan.model_flops` is ``None``.

  Args:
    cfg: a `mpscale.trainer.RunConfig`: of the built-in LM, or of a user's model
      (``model.provider``: a Flax NNX or linen module, or a
      `mpscale.trainer.Model`).
    device_memory: a device's memory (bytes, or text such as ``"80GB"``), to say
      whether the peak fits; default: ``hardware``'s, if given.
    hardware: a `mpscale.trainer.planning.hardware.Hardware`, or a built-in profile's name or
      a profile file's path (`load_hardware`): the plan then holds its step-time
      `Plan.estimate` there.
    compiler: which compiler's program the plan reads (`targets.MODES`): ``auto``,
      the hardware's own (its ``compile_target``, e.g. XLA's CUDA compiler for an
      H100, without a GPU) when installed, else the CPU's with a note
      (`Plan.compile_note`); ``target``: the hardware's own or an error giving the
      install line; ``cpu``: the CPU's.

  Returns:
    The `Plan`.

  Raises:
    ValueError, TypeError: naming the config key, for what training would refuse too
      (a mesh that needs more devices than exist, indivisible dimensions, a provider
      that fails or a batch its model cannot take, ...).
  """
  built = _setup(cfg, device_memory, hardware, compiler)
  compiled, seconds = _compiled_step(built)
  planned = Plan.from_compiled(built, compiled, seconds)
  if built.hardware is not None:
    planned.estimate = step_time_lib.estimate(planned, built.hardware)
  return planned


class _Built(NamedTuple):
  """What `plan` compiles, and what it reads besides the program: the run's pieces
  built from shapes on the target's devices (`_setup`)."""
  cfg: Any
  setup: Any
  """The run's pieces (`mpscale.trainer.config.build.Setup`)."""
  params: Any
  """The parameters' shapes."""
  state: Any
  """The `mpscale.TrainState`'s shapes, with their shardings."""
  batch: Any
  """A global batch's shapes, with its sharding."""
  tokens: int
  target: targets.Target
  hardware: Optional[Hardware]
  memory: Optional[int]
  """A device's memory in bytes, or ``None``."""
  provided: bool
  """A user's model (``model.provider``)."""
  data_key: str
  """The config key naming the data, for errors."""


def _setup(cfg: Any, device_memory: Any, hardware: Any, compiler: str) -> _Built:
  """`plan`'s arguments checked, and the run built from shapes on the devices of the
  compiler it reads (`targets.choose`)."""
  if hardware is not None and not isinstance(hardware, Hardware):
    hardware = load_hardware(hardware)
  if device_memory is None and hardware is not None:
    device_memory = int(hardware.hbm_bytes)
  memory = None if device_memory is None else parse_bytes(device_memory)
  fp8 = getattr(getattr(cfg.precision, "fp8", None), "recipe", None)
  if fp8 and hardware is not None and "float8" not in hardware.peak_flops:
    raise validation.fail("precision.fp8.recipe", f" ({fp8}): {hardware.name} lists no "
                          "float8 peak (no FP8 tensor cores); plan on a profile with "
                          "one (h100-80g) or without FP8")
  try:
    target = targets.choose(hardware, cfg.mesh.num_devices, compiler)
  except ValueError as e:
    raise validation.fail("hardware", f": {e}") from None
  provided = cfg.model.provider is not None
  data_key = "the built-in data"
  if provided:
    user_model, batch, tokens, data_key = _provided_model(cfg)
    cfg = builders.with_initial_scale(cfg, True,
                                      builders.micro_batch_tokens(cfg, batch))
    setup = builders.build(cfg, target.devices, model=user_model)
  else:
    setup = builders.build(cfg, target.devices)
    bs, seq = cfg.data.batch_size, cfg.model.seq_len
    batch = {k: jax.ShapeDtypeStruct((bs, seq), dtype)
             for k, dtype in (("inputs", "int32"), ("targets", "int32"),
                              ("mask", "float32"))}
    tokens = bs * seq
  params = jax.eval_shape(setup.init_params)
  state = setup.init(params)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                   sharding=builders.batch_sharding(setup.mesh))
           for k, v in batch.items()}
  if setup.mesh is None and target.devices is not None:  # one device of the target's
    state, batch = _on_device((state, batch), target.devices[0])
  return _Built(cfg, setup, params, state, batch, tokens, target, hardware, memory,
                provided, data_key)


def _compiled_step(built: _Built) -> tuple[Any, float]:
  """The step compiled from shapes for the target, and the seconds it took.

  Raises:
    ValueError, TypeError: naming ``mesh`` (the built-in model) or
      ``model.provider`` (a user's, whose loss may raise anything on its batch).
  """
  start = time.perf_counter()
  try:
    compiled = _compile(built.setup.step.lower(built.state, built.batch), built.target)
  except Exception as e:  # a user's loss on a user's batch may raise anything
    if not built.provided:
      if isinstance(e, (ValueError, TypeError)):
        cls = (validation.ArgumentTypeError if isinstance(e, TypeError)
               else validation.ArgumentError)
        raise validation.fail("mesh", f": {e}", cls) from None
      raise
    shapes = {k: (v.shape, str(v.dtype)) for k, v in built.batch.items()}
    raise validation.fail("model.provider", f": compiling its step on the first batch "
                          f"of {built.data_key} {shapes} raised {type(e).__name__}: "
                          f"{str(e)[:500]}") from None
  return compiled, time.perf_counter() - start


def _loss_readings(built: _Built) -> dict[str, Any]:
  """What the plan reads from the loss besides the program: a pipeline's bubble,
  schedules and residuals, or an unpipelined loss's activations and float32 share of
  its matrix FLOPs (`Plan`'s fields of those names)."""
  cfg, setup, state, batch = built.cfg, built.setup, built.state, built.batch
  mesh = setup.mesh
  model = setup.model
  if not built.provided and model.routing is not None:
    # traced on one device's rows, which a mixture's expert split would not divide
    model = dataclasses.replace(model, shard=None)
  loss = model.loss_fn if built.provided else builders.build_loss(cfg, model)
  out = {"bubble": loss.bubble(cfg.mesh.stage) if cfg.mesh.stage > 1 else 0.0,
         "schedules": [], "residuals": None, "activations": None,
         "float32_share": None}
  if cfg.mesh.stage > 1 and isinstance(loss, parallel_lib.Pipeline):
    out["schedules"] = schedule_rows(cfg.mesh.stage, loss.num_microbatches,
                                     loss.virtual_stages, loss.schedule)
    if not isinstance(loss, parallel_lib.SplitPipeline):
      out["residuals"] = loss.residual_bytes(
          state.params, batch, mesh=mesh, data_axis=builders.data_axes(mesh),
          per_token_loss=built.provided or cfg.train.per_token_loss,
          cast=setup.policy.cast_to_compute)
  if not isinstance(loss, parallel_lib.Pipeline):
    replicas = 1 if mesh is None else parallel_lib.axis_size(
        mesh, builders.data_axes(mesh))
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0] // (
        replicas * cfg.train.num_microbatches)
    kwargs = {}
    if state.rng is not None:
      kwargs["rng"] = jax.random.key(0)
    if state.model_state is not None:
      kwargs["model_state"] = state.model_state
    out["activations"], forward = activation_bytes(  # true shapes: unpadded
        loss, parallel_lib.unpad(state.params), batch, rows,
        setup.policy.cast_to_compute, **kwargs)
    out["float32_share"] = setup.policy.wide_share(jaxprs.matmul_flops(forward))
  return out
