"""Which layout to run: every layout the trainer can run on N devices, planned and
ranked by estimated step time on named hardware (``mpscale plan --search``).

`search` enumerates the layouts of a config (`layouts`): every split of the devices
into ``data x fsdp x stage x context x expert x tensor`` (``expert`` only for a
mixture of experts, dividing its ``num_experts``), and with it ZeRO-1
(``shard_optimizer_state``),
the micro-batches, activation recomputation (``train.recompute``: ``none`` or
``full``), host offload of the optimizer state (each ladder's last variant), sequence
parallelism,
the pipeline schedule and virtual stages. A layout the trainer would refuse (tensor
not dividing the heads, stages not dividing the layers, a batch not splitting over
the replicas and micro-batches) is never built. Then, cheapest first::

  ladders = layouts(cfg, N)                       # thousands at 512 devices
  for each ladder: its first variant that fits by analytic.memory_bytes,
                   priced by analytic.estimate    # shapes only: ~0.1 ms each
  drop the ladders with no variant that fits; sort the rest by that price
  for the leading ladders, in that order, until `top` fit (or the budget ends):
    exact state bytes (static_bytes) over the memory: next variant
    compile (or read the cache), price with step_time.estimate
    compiled peak over the memory: next variant (more micro-batches)
  rank those by the compiled estimate

1. **Rank from shapes** (`preranked`, `mpscale.trainer.planning.analytic`): every
   ladder's FLOPs, memory-bound bytes and collectives per device, priced with the
   step-time model's own formulas; its memory (state, activations) picks the
   ladder's first variant expected to fit and drops the ladders none of whose
   variants fits. Nothing is built or compiled: 2,664 layouts of a 6.7B model on
   512 devices take under a second.
2. **Compile the leading ones.** Each is planned (`mpscale.trainer.planning.compiled.plan`:
   the real step, compiled from shapes by the hardware's own compiler when it is
   installed, else the CPU's: ``compiler``) and priced on the hardware
   (`mpscale.trainer.planning.step_time`), after the exact state check
   (`static_bytes`); a layout whose compiled peak exceeds the memory is tried
   again with its next variant (twice the micro-batches). Compiling stops when
   ``top`` layouts fit (default `TOP`; ``top=None`` compiles every layout: the
   exhaustive search). Plans are cached on disk by the config, the device count
   and the versions of mpscale and JAX, so a second search compiles nothing it has
   compiled before; the estimate is recomputed from the cached plan (any hardware).
3. **Rank** the compiled layouts that fit by their compiled estimate; each row
   keeps its analytic rank and estimate beside it.

A time budget stops the compiling; the layouts not compiled are reported. The
analytic order is for choosing what to compile, not a step time to quote: on the
tiny LM over 8 devices (data x tensor, 20 layouts) the exhaustive search's best is
among the pre-ranking's leading three (tests/trainer/planning/test_search.py).

Kept out of the enumeration to keep it to what a user would try (each is stated in
the result as ``rules``): ``data`` and ``fsdp`` together (hybrid sharding), ``tensor``
larger than a node, ZeRO-1 without data parallelism, sequence parallelism without
tensor parallelism, virtual stages other than 1 and 2, and micro-batches other than
powers of two.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple, Optional

import jax

from mpscale import parallel as parallel_lib
from mpscale import validation
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import analytic
from mpscale.trainer.planning import compiled as planning
from mpscale.trainer.planning import step_time as step_time_lib
from mpscale.trainer.planning import targets
from mpscale.trainer.planning.hardware import Hardware, load_hardware

CACHE_VERSION = 1
"""Bumped when what a cached plan holds changes (the key also holds a digest of
mpscale's own source, so a changed step is compiled anew)."""

RULES = (
    "data and fsdp are not combined (no hybrid sharding)",
    "tensor at most devices_per_node",
    "ZeRO-1 only with data > 1",
    "sequence parallelism only with tensor > 1",
    "virtual stages 1 or 2 (2 only with stage > 1, 1F1B or GPipe)",
    "micro-batches a power of two, at least the stages when pipelined (at most 4"
    " counts), without a pipeline the fewest that fit",
    "expert only for a mixture of experts (model.num_experts > 0), a divisor of"
    " its experts",
)
"""What `layouts` leaves out, said with every result."""

TOP = 4
"""Layouts `search` ranks by their compiled estimate, by default: the leading ones
of the analytic order are compiled until this many fit (GPT-3 6.7B on 512 H100s:
the best of the leading 8 is among the leading 4, in about a minute of CPU)."""


def default_cache_dir() -> str:
  """``$XDG_CACHE_HOME/mpscale/plans`` (``~/.cache/mpscale/plans``)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                          ".cache")
  return os.path.join(base, "mpscale", "plans")


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


AXES = ("data", "fsdp", "stage", "context", "expert", "tensor")
"""The mesh axes searched, in the trainer's order (`--axes` chooses among them)."""


def _splits(cfg: config_lib.RunConfig, devices: int, tensor: int,
            axes: tuple[str, ...]) -> list[tuple[int, int, int]]:
  """``(stage, context, expert)`` splits of ``devices / tensor`` that ``cfg``'s
  model and the trainer allow (``expert`` a divisor of ``num_experts``, only for a
  mixture; a mixture unpipelined: the trainer refuses its stages yet)."""
  m, rest = cfg.model, devices // tensor
  sizes = lambda axis, n: _divisors(n) if axis in axes else [1]  # noqa: E731
  experts = [e for e in sizes("expert", rest) if m.num_experts and (
      m.num_experts % e == 0)] or [1]
  out = []
  for stage, context, expert in itertools.product(
      sizes("stage", rest), sizes("context", rest), experts):
    if (m.num_layers % stage or rest % (stage * context * expert)
        or m.seq_len % (2 * context)
        or context > 1 and stage > 1 and tensor > 1  # see config.load
        or m.num_experts and stage > 1):
      continue
    out.append((stage, context, expert))
  return out


def layouts(cfg: config_lib.RunConfig, devices: int, devices_per_node: int,
            axes: tuple[str, ...] = AXES) -> list[list[dict[str, Any]]]:
  """Every layout of ``cfg``'s model on ``devices`` devices, as ``--set`` overrides
  (``{"mesh.data": 4, ...}``), within `RULES`; each one the trainer accepts. Mesh
  axes not in ``axes`` stay 1.

  Returns:
    One ladder per layout (the mesh, sequence parallelism, the pipeline schedule and
    virtual stages, ZeRO-1, recomputation and, pipelined, the micro-batches): a
    pipelined layout's ladder is itself; an unpipelined one's is its micro-batch
    counts, fewest first, which only hold fewer activations at once and re-read the
    weights once more each; each ends with its last variant's optimizer state
    offloaded to host memory (``train.offload: [opt_state]``), moved in and out each
    step. `search` plans a ladder's variants in order
    and keeps the first that fits.
  """
  m = cfg.model
  batch = cfg.data.batch_size
  out = []
  for tensor in _divisors(devices) if "tensor" in axes else [1]:
    if tensor > devices_per_node or m.num_heads % tensor or m.d_ff % tensor or (
        m.vocab_size % tensor) or m.num_experts and (m.expert_d_ff or m.d_ff) % tensor:
      continue
    for stage, context, expert in _splits(cfg, devices, tensor, axes):
      rest = devices // (tensor * stage * context * expert)
      splits = [(d, f) for d, f in ((rest, 1), (1, rest)) if rest == 1 or (
          (d == 1 or "data" in axes) and (f == 1 or "fsdp" in axes))]
      for data, fsdp in dict.fromkeys(splits):
        replicas = data * fsdp * expert  # outside the experts, a data axis
        if batch % replicas:
          continue
        per_replica = batch // replicas
        micro = [2**k for k in range(0, 20) if 2**k <= per_replica
                 and per_replica % 2**k == 0 and (stage == 1 or 2**k >= stage)]
        if stage > 1:
          micro = micro[:4]  # S, 2S, 4S, 8S (as the batch allows): the bubble shrinks
        virtual = [1, 2] if stage > 1 and m.num_layers % (2 * stage) == 0 else [1]
        schedules = ["gpipe", "1f1b", "zb_h1"] if stage > 1 else ["gpipe"]
        seq_par = [False, True] if tensor > 1 else [False]
        for v, sched, sp in itertools.product(virtual, schedules, seq_par):
          if v > 1 and sched == "zb_h1":
            continue
          structure = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.stage": stage,
                       "mesh.tensor": tensor}
          if m.num_experts:  # set always: the config's own would stay otherwise
            structure["mesh.expert"] = expert
          if context > 1:
            # a ring where the schedule lets it (GPipe's stages run alike)
            structure.update({"mesh.context": context, "model.context_parallel":
                              "ring" if sched == "gpipe" else "all_gather"})
          if stage > 1:
            structure.update({"mesh.pipeline_schedule": sched,
                              "mesh.virtual_stages": v})
          if tensor > 1:
            structure["mesh.sequence_parallel"] = sp
          for recompute, zero1 in (("none", False), ("none", True), ("full", False),
                                   ("full", True)):
            if zero1 and data == 1:
              continue
            for group in ([[mb] for mb in micro] if stage > 1 else [micro]):
              ladder = [{**structure, "mesh.shard_optimizer_state": zero1,
                         "train.num_microbatches": mb, "train.recompute": recompute}
                        for mb in group]
              # the last resort: the optimizer state in host memory
              out.append(ladder + [{**ladder[-1], "train.offload": ["opt_state"]}])
  return out


def _order(ladder: list[dict[str, Any]]) -> tuple:
  """Planning order of ladders: fewer stages, less tensor parallelism, no FSDP,
  fewer micro-batches, plainer options first."""
  layout = ladder[0]
  return (layout["mesh.stage"], layout.get("mesh.context", 1),
          layout.get("mesh.expert", 1), layout["mesh.tensor"], layout["mesh.fsdp"],
          layout["train.num_microbatches"], layout.get("mesh.virtual_stages", 1),
          layout.get("mesh.pipeline_schedule", ""),
          layout.get("mesh.sequence_parallel", False),
          layout["train.recompute"] != "none",
          layout["mesh.shard_optimizer_state"], bool(layout.get("train.offload")))


def _overrides(layout: dict[str, Any]) -> list[str]:
  """The layout as ``key=value`` overrides (values as YAML: ``true``, ``4``,
  ``[opt_state]``)."""
  def value(v):
    if isinstance(v, bool):
      return str(v).lower()
    return f"[{','.join(v)}]" if isinstance(v, list) else v
  return [f"{k}={value(v)}" for k, v in layout.items()]


def set_line(layout: dict[str, Any]) -> str:
  """The layout as the command line's ``--set`` flags."""
  return " ".join(f"--set {o}" for o in _overrides(layout))


def static_bytes(cfg: config_lib.RunConfig) -> int:
  """Parameters, gradients and optimizer state one device holds in its memory under
  ``cfg``'s layout (``train.offload``'s fields, in host memory, left out): exact,
  from shapes (nothing compiled or allocated)."""
  setup = builders.build(cfg)
  params = jax.eval_shape(setup.init_params)
  state = setup.init(params)
  return (2 * parallel_lib.tree_bytes(state.params)
          + parallel_lib.tree_bytes(state.opt_state)
          - planning.offloaded_bytes(state, cfg.train.offload))


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
  """A digest of mpscale's Python source: what compiles the step."""
  import mpscale  # noqa: PLC0415  (the package imports the trainer lazily)
  root = os.path.dirname(os.path.abspath(mpscale.__file__))
  digest = hashlib.sha256()
  for folder, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for name in sorted(files):
      if name.endswith(".py"):
        with open(os.path.join(folder, name), "rb") as f:
          digest.update(name.encode() + f.read())
  return digest.hexdigest()


def _cache_key(cfg: config_lib.RunConfig, devices: int, target: str = "") -> str:
  blob = json.dumps({"config": dataclasses.asdict(cfg), "devices": devices,
                     "target": target,
                     "jax": jax.__version__, "jaxlib": jax.lib.__version__
                     if hasattr(jax.lib, "__version__") else "",
                     "source": _source_digest(), "cache": CACHE_VERSION},
                    sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _cache_path(cfg: config_lib.RunConfig, devices: int,
                cache_dir: Optional[str], target: str = "") -> Optional[str]:
  return (None if not cache_dir else
          os.path.join(cache_dir, _cache_key(cfg, devices, target) + ".json"))


def cached(cfg: config_lib.RunConfig, devices: int, memory: int,
           cache_dir: Optional[str], target: str = "") -> Optional[planning.Plan]:
  """``cfg``'s `Plan` from the cache (its device memory ``memory``, no estimate),
  compiled for ``target`` (a `targets.Target`'s description), or ``None``."""
  path = _cache_path(cfg, devices, cache_dir, target)
  if path is None or not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    planned = planning.Plan.from_dict(json.load(f))
  planned.device_memory = memory
  return planned


def compile_plan(cfg: config_lib.RunConfig, devices: int, memory: int,
                 cache_dir: Optional[str], hardware: Optional[Hardware] = None,
                 compiler: str = "cpu") -> planning.Plan:
  """``cfg``'s `Plan`, compiled by ``compiler`` for ``hardware``
  (`mpscale.trainer.planning.compiled.plan`), and cached when ``cache_dir`` is
  given (under the target it compiled for)."""
  planned = planning.plan(cfg, device_memory=memory, hardware=hardware,
                          compiler=compiler)
  planned.estimate = None  # priced again by the caller, on any hardware
  path = _cache_path(cfg, devices, cache_dir, planned.compiled_for)
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(planned.to_dict(), f)
    os.replace(tmp, path)
  return planned


class Candidate(NamedTuple):
  """A ladder ranked from shapes (`preranked`)."""
  ladder: list[dict[str, Any]]
  start: int
  """Its first variant that fits by `analytic.memory_bytes` (the last, if none)."""
  estimate: analytic.Estimate
  """That variant's `analytic.estimate`."""


def preranked(cfg: config_lib.RunConfig, ladders: list[list[dict[str, Any]]],
              hardware: Hardware, device: Any = None
              ) -> tuple[list[Candidate], list[Candidate]]:
  """Every ladder priced from shapes (`analytic.estimate`): no config is built and
  nothing compiled, so thousands take a second.

  Args:
    cfg: the run, its model, batch, precision and optimizer (`analytic.Model`).
    ladders: `layouts`' ladders.
    hardware: the profile: its memory, peaks and links.
    device: one of the devices the leading layouts compile for: the attention is
      the one the trainer chooses there (`analytic.Model.from_config`).

  Returns:
    ``(fitting, over)``: the ladders whose variant fits the memory by the analytic
    bound, fastest first, and those none of whose variants does, smallest first.
  """
  model = analytic.Model.from_config(cfg, device)
  memory = float(hardware.hbm_bytes)
  fitting, over = [], []
  for ladder in ladders:
    layouts_ = [analytic.Layout.from_overrides(v) for v in ladder]
    start = next((i for i, v in enumerate(layouts_)
                  if analytic.fits(model, v, memory)), None)
    at = len(ladder) - 1 if start is None else start
    candidate = Candidate(ladder, at, analytic.estimate(model, layouts_[at], hardware))
    (over if start is None else fitting).append(candidate)
  fitting.sort(key=lambda c: (c.estimate.seconds, _order(c.ladder)))
  over.sort(key=lambda c: c.estimate.peak_bytes)
  return fitting, over


@dataclasses.dataclass
class Result:
  """What `search` found."""
  config: str
  devices: int
  hardware: str
  ranked: list[dict[str, Any]]
  """The compiled layouts that fit, fastest first: ``layout`` (overrides), ``set``
  (the ``--set`` line), ``mesh``, ``seconds``, ``tokens_per_second``, ``mfu``,
  ``dominant``, ``compute``, ``memory``, ``collectives``, ``bubble``, ``peak_bytes``,
  ``cached``, ``analytic_seconds`` and ``analytic_rank`` (its place from shapes,
  1 the fastest)."""
  candidates: int
  """Layouts enumerated (ladders: one structure and its memory-saving variants)."""
  over_memory_analytic: int
  """Layouts none of whose variants fits by the analytic memory (`preranked`)."""
  over_memory_bound: int
  """Variants dropped by the exact state bound (state alone over the memory)."""
  over_memory_compiled: int
  """Variants compiled, their peak over the memory."""
  refused: int
  """Layouts refused by the trainer when built (e.g. an indivisible dimension)."""
  not_planned: int
  """Layouts ranked from shapes but not compiled: past ``top``, or left when the
  time budget ran out."""
  seconds: float
  cache_hits: int
  compiled: int = 0
  """Plans compiled or read from the cache."""
  top: int = 0
  """The layouts the search was asked to rank compiled (``top``)."""
  rules: tuple[str, ...] = RULES
  compiled_for: str = ""
  """The devices and compiler the layouts were compiled for (`targets.Target`)."""
  compile_note: str = ""
  """Why the CPU's compiler stood in for the hardware's, and how to install it."""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def text(self, top: int = 10) -> str:
    lines = [f"{self.config} on {self.devices} x {self.hardware}: {self.candidates} "
             f"layouts ranked from shapes ({self.over_memory_analytic} over the "
             f"memory), the leading compiled: {len(self.ranked)} fit of "
             f"{self.compiled} plans ({self.cache_hits} from the cache; "
             f"{self.over_memory_bound} over the memory by their state alone, "
             f"{self.over_memory_compiled} by their compiled peak, {self.refused} "
             f"refused); {self.not_planned} not compiled; {self.seconds:.0f} s",
             *([f"compiled for {self.compiled_for}"] if self.compiled_for else []),
             *([f"note: {self.compile_note}"] if self.compile_note else []),
             f"{'#':>3} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9}  "
             "dominant / --set line (its rank from shapes)"]
    for i, r in enumerate(self.ranked[:top], 1):
      mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
      lines.append(f"{i:>3} {r['seconds'] * 1e3:9.1f} {r['tokens_per_second']:11,.0f} "
                   f"{mfu:>6} {r['peak_bytes'] / 2**30:9.1f}  {r['dominant']} "
                   f"(#{r['analytic_rank']})")
      lines.append(f"      {r['set']}")
    lines.append("not searched: " + "; ".join(self.rules))
    return "\n".join(lines)


@dataclasses.dataclass
class _Tally:
  """What `_plan_ladder` saw, summed over the ladders compiled."""
  over_bound: int = 0
  over_compiled: int = 0
  refused: int = 0
  hits: int = 0
  compiled: int = 0
  smallest: float = math.inf


def _row(layout: dict[str, Any], planned: planning.Plan, hit: bool,
         hardware: Hardware, candidate: Candidate, rank: int) -> dict[str, Any]:
  """A `Result.ranked` row: the compiled estimate of ``layout``'s plan."""
  est = step_time_lib.estimate(planned, hardware)
  return {"layout": layout, "set": set_line(layout), "mesh": planned.mesh,
          "seconds": est.seconds, "tokens_per_second": est.tokens_per_second,
          "mfu": est.mfu, "dominant": est.dominant, "compute": est.compute,
          "memory": est.memory, "collectives": est.collectives, "bubble": est.bubble,
          "peak_bytes": planned.bytes["peak"], "cached": hit,
          "analytic_seconds": candidate.estimate.seconds, "analytic_rank": rank}


def _plan_ladder(config_path: str, overrides: tuple[str, ...], devices: int,
                 memory: int, cache_dir: Optional[str], candidate: Candidate,
                 tally: _Tally, out_of_time: Callable[[], bool],
                 hardware: Hardware, target: targets.Target, compiler: str
                 ) -> Optional[tuple[dict[str, Any], planning.Plan, bool]]:
  """The first variant of ``candidate``'s ladder, from its analytic start, whose
  compiled peak fits: ``(layout, plan, from the cache)``, or ``None``."""
  for layout in candidate.ladder[candidate.start:]:
    if out_of_time():
      return None
    try:
      cfg = config_lib.load_config(config_path, list(overrides) + _overrides(layout))
      planned = cached(cfg, devices, memory, cache_dir, target.description)
      hit = planned is not None
      if not hit:
        state = static_bytes(cfg)
        tally.smallest = min(tally.smallest, state)
        if state > memory:
          tally.over_bound += 1
          continue
        planned = compile_plan(cfg, devices, memory, cache_dir, hardware, compiler)
    except (ValueError, TypeError):
      tally.refused += 1
      return None
    tally.hits += hit
    tally.compiled += 1
    tally.smallest = min(tally.smallest, planned.bytes["peak"])
    if planned.fits:
      return layout, planned, hit
    tally.over_compiled += 1
  return None


def search(config_path: str, devices: int, hardware: Any, *,
           overrides: tuple[str, ...] = (), axes: tuple[str, ...] = AXES,
           top: Optional[int] = TOP, budget: float = 600.0,
           cache_dir: Optional[str] = None, compiler: str = "auto",
           progress: Optional[Callable[[int, int, str], None]] = None) -> Result:
  """Rank the layouts of a config on ``devices`` devices of ``hardware``: all of
  them from shapes, the leading ``top`` compiled (module docstring).

  Args:
    config_path: the run's YAML config; its model, batch, precision and optimizer are
      kept, its layout (mesh, micro-batches, recomputation) is what is searched.
    devices: the devices to lay out (JAX must have that many: ``mpscale plan
      --devices N`` simulates them).
    hardware: a `Hardware`, a built-in profile's name or a profile file's path.
    overrides: ``--set`` overrides applied before the layout's own.
    axes: the mesh axes searched (the others stay 1); default all of `AXES`
      (``expert`` only for a mixture of experts).
    top: how many layouts to rank by their compiled estimate: the ladders are
      compiled in their analytic order until ``top`` fit; ``None``: every one (an
      exhaustive search).
    budget: seconds of compiling before the rest is left uncompiled.
    cache_dir: where compiled plans are cached (``None``: no cache).
    compiler: whose program the leading layouts are compiled to
      (`mpscale.trainer.planning.compiled.plan`'s ``compiler``): ``auto``, the
      hardware's own compiler when installed (XLA's CUDA compiler for a GPU
      profile), else the CPU's; ``target``; ``cpu``.
    progress: ``progress(done, total, what)``, called as each layout is done.

  Returns:
    The `Result`.

  Raises:
    ArgumentError: naming ``--devices`` when JAX has fewer devices or no layout can
      be built; naming ``--hardware`` for an unknown profile (`load_hardware`);
      naming ``--compile-top`` when ``top`` is not positive; naming ``--search`` when no layout
      fits in the device's memory (with the smallest need seen).
  """
  if not isinstance(hardware, Hardware):
    hardware = load_hardware(hardware)
  devices = validation.positive_int("--devices", devices)
  if jax.device_count() < devices:
    raise validation.fail("--devices", f": {devices} devices asked, JAX has "
                          f"{jax.device_count()} (mpscale plan --devices N simulates "
                          "N on CPU)")
  budget = validation.positive_float("--budget", budget)
  if top is not None:
    top = validation.positive_int("--compile-top", top)
  axes = tuple(axes)
  for axis in axes:
    validation.one_of("--axes", axis, AXES)
  base = config_lib.load_config(config_path, list(overrides))
  memory = int(hardware.hbm_bytes)
  try:
    target = targets.choose(hardware, devices, compiler)
  except ValueError as e:
    raise validation.fail("--hardware", f": {e}") from None
  ladders = layouts(base, devices, hardware.devices_per_node, axes)
  if not ladders:
    raise validation.fail("--devices", f": no layout of {base.name} on {devices} "
                          "devices (tensor must divide the heads, d_ff and the "
                          "vocabulary, stages the layers, replicas the batch)")
  start = time.perf_counter()
  fitting, over = preranked(base, ladders, hardware,
                            next(iter(target.devices or jax.devices()), None))
  tally = _Tally(smallest=min((c.estimate.peak_bytes for c in over), default=math.inf))
  ranked, done = [], 0
  out_of_time = lambda: time.perf_counter() - start > budget  # noqa: E731
  order = fitting + (over if top is None else [])  # exhaustive: every ladder
  for rank, candidate in enumerate(order, 1):
    if out_of_time() or (top is not None and len(ranked) >= top):
      break
    done += 1
    found = _plan_ladder(config_path, overrides, devices, memory, cache_dir,
                         candidate, tally, out_of_time, hardware, target, compiler)
    if found:
      ranked.append(_row(*found, hardware=hardware, candidate=candidate, rank=rank))
    if progress:
      progress(done, len(order) if top is None else min(top, len(order)),
               f"{len(ranked)} fit")
  if not ranked and done == len(order):
    raise validation.fail("--search", f": no layout of {base.name} on {devices} x "
                          f"{hardware.name} fits in {memory / 1e9:.1f} GB a device "
                          f"(the smallest needs {tally.smallest / 1e9:.1f} GB); use "
                          "more devices or a device with more memory")
  ranked.sort(key=lambda r: r["seconds"])
  return Result(config=base.name, devices=devices, hardware=hardware.name,
                compiled_for=target.description, compile_note=target.note,
                ranked=ranked, candidates=len(ladders),
                over_memory_analytic=len(over), over_memory_bound=tally.over_bound,
                over_memory_compiled=tally.over_compiled, refused=tally.refused,
                not_planned=len(order) - done,
                seconds=time.perf_counter() - start, cache_hits=tally.hits,
                compiled=tally.compiled, top=top or 0)
