"""How long a planned step takes on named hardware: the compiled work, priced.

`estimate` prices what `mpscale.trainer.planning.compiled.plan` read from the compiled step
(per device, per step) on a `mpscale.trainer.planning.hardware.Hardware` profile:

- **compute**: each matrix-product kernel (`mpscale.trainer.planning.hlo.kernels`) at the peak of the
  compute dtype (FP8 GEMMs, `mpscale.trainer.planning.hlo.fp8_flops`, at the ``float8`` peak) times
  the profile's ``matmul_efficiency`` (the measured share of the
  peak a large product reaches; the built-in GPU profiles cite theirs). A product
  whose bytes take longer at the memory rate than its FLOPs at this rate (a roofline,
  kernel by kernel) counts that excess as memory time.
- **memory**: the bytes every other kernel reads and writes (elementwise fusions,
  reductions, copies) at ``hbm_bandwidth`` times ``memory_efficiency``. The CPU
  backend that compiles the plan computes 16-bit arithmetic in float32; under a
  16-bit compute dtype the plan counts float32 arrays at 16 bits, as a GPU holds
  them. It also fuses less than a GPU backend: the term is an upper bound.
- **collectives**: each collective over the mesh axes it spans
  (`mpscale.trainer.planning.hlo.collectives_over`), priced on the link level its group needs, with
  the ring formulas of Thakur et al. (``n`` devices in a group, ``B`` the bytes per
  device, ``b`` the link's one-way bandwidth, ``a`` its latency)::

    all-reduce          2 (n - 1) / n * B / b + 2 (n - 1) a
    all-gather          (n - 1) / n * B / b + (n - 1) a      B: the gathered result
    reduce-scatter      (n - 1) / n * B / b + (n - 1) a      B: the whole operand
    all-to-all          (n - 1) / n * B / b + (n - 1) a
    collective-permute  B / b + a                            one hop

  A ring over ``k`` nodes crosses the network on ``k - 1`` of its ``n - 1`` steps a
  pass; the other ``n - k`` stay inside a node. As NCCL's own cost model prices a
  ring (``ncclTopoTuneModel``: ``(nsteps - nInterSteps) * intraLat + nInterSteps *
  interLat``), ``(n - 1) a`` is then ``(k - 1) a + (n - k) a_node``, ``a_node`` the
  latency of the fastest link inside a node.

- **bubble**: the pipeline's idle share. The compiled program of a pipeline runs
  every tick of its schedule on every device (SPMD), bubble ticks included, so the
  compute and memory terms already hold it; the estimate reports the bubble's part
  of them (``bubble * (compute + memory)``) and does not add it again.

**How mesh axes are laid onto nodes.** The trainer's mesh is ``data x fsdp x stage x
tensor`` in that order, row-major: device ``i`` of the mesh is device ``i`` of the
job, and node ``k`` holds devices ``k * devices_per_node`` onward. So ``tensor``
fills a node first, then ``stage``, ``fsdp`` and ``data`` (Megatron-LM's order:
tensor parallelism inside a node). A collective's group runs on the fastest link
whose span holds it: a ``node`` link holds a group whose devices share one node; a
``slice`` link (a TPU's ICI) holds the whole job (one slice: several slices are not
modelled); ``nodes`` and ``slices`` links hold any group. A group spanning nodes runs
at the slower link's per-device bandwidth (each GPU of a DGX has its own adapter).

**Overlap: what the compiled program schedules.** A GPU program's collectives are
asynchronous (``<kind>-start`` ... ``<kind>-done``), and XLA's scheduler places
kernels between the two halves; those kernels run while the collective transfers
(`mpscale.trainer.planning.hlo.overlaps`). Each such collective hides behind its window, at most its
own time: ``hidden = sum(count * min(collective, window))``, the window priced as the
kernels are. The step time is ``compute + memory + collectives - hidden``. A CPU
compile's collectives are synchronous, so a plan on it hides nothing: an upper bound,
and what Megatron-LM's 2021 runs did (its tensor-parallel all-reduces block the layer
that needs them, and the data-parallel gradient all-reduce ran after the backward).
Two collectives in flight over the same kernels may each hide behind them (NCCL runs
them on streams of their own). The dominant term is the largest of compute, memory
and the collectives of each link level.

References:
  NCCL, ``src/graph/tuning.cc`` (``ncclTopoTuneModel``: a ring's latency, its steps
  inside and between nodes), https://github.com/NVIDIA/nccl.
  Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
  Operations in MPICH", Int. J. High Perform. Comput. Appl. 19(1), 2005.
  Williams, Waterman and Patterson, "Roofline: an insightful visual performance model
  for multicore architectures", Commun. ACM 52(4), 2009.
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC 2021 (arXiv:2104.04473).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from mpscale import validation
from mpscale.trainer.planning.hardware import Hardware, Link, peak_for

_RING_STEPS = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}
"""Ring passes of each collective kind: an all-reduce is a reduce-scatter then an
all-gather."""

@dataclasses.dataclass
class Estimate:
  """One step's estimated time on a `Hardware` profile (see the module docstring)."""
  hardware: str
  seconds: float
  """The step: ``compute + memory + collectives - hidden + host``."""
  compute: float
  """Seconds of matrix products at ``peak * matmul_efficiency``."""
  memory: float
  """Seconds of memory-bound kernels at ``hbm_bandwidth * memory_efficiency``."""
  collectives: float
  """Seconds of collectives, all link levels."""
  bubble: float
  """Seconds of pipeline bubble, a part of ``compute + memory`` (not added)."""
  by_link: dict[str, float]
  """Seconds of collectives by link level name."""
  rows: list[dict[str, Any]]
  """Each collective: ``collective`` (``"<kind> over <axes>"``), ``group`` (its
  devices), ``link``, ``count``, ``bytes`` (per device, per step) and ``seconds``."""
  tokens_per_second: float
  mfu: Optional[float]
  """The model's FLOPs per step (`Plan.model_flops`) over ``seconds * devices *
  peak``; ``None`` for a user's model."""
  peak_flops: float
  """The peak used (FLOP/s, the compute dtype's, before ``matmul_efficiency``)."""
  dominant: str
  """``compute``, ``memory`` or ``collectives on <link>``: the largest term."""
  assumptions: dict[str, Any]
  hidden: float = 0.0
  """Seconds of collectives hidden behind the kernels the compiled program schedules
  while they transfer (`mpscale.trainer.planning.hlo.overlaps`; 0 for a program without asynchronous
  collectives, such as the CPU backend's)."""
  host: float = 0.0
  """Seconds of host offload's copies (``train.offload``): the state in host memory
  moved in and out each step at the profile's ``host_bandwidth``, counted whole (not
  hidden); 0 without offload, or for a profile without ``host_bandwidth``."""

  def text(self) -> str:
    lines = [f"estimated step on {self.hardware}: {self.seconds * 1e3:.1f} ms, "
             f"{self.tokens_per_second:,.0f} tokens/s"
             + ("" if self.mfu is None else f", MFU {self.mfu:.1%}")
             + f"; dominant: {self.dominant}",
             f"  compute           {self.compute * 1e3:10.1f} ms  (at "
             f"{self.assumptions['matmul_efficiency']:.1%} of "
             f"{self.peak_flops / 1e12:g} TFLOP/s)",
             f"  memory            {self.memory * 1e3:10.1f} ms  (at "
             f"{self.assumptions['memory_efficiency']:.1%} of HBM bandwidth)",
             f"  collectives       {self.collectives * 1e3:10.1f} ms  "
             + (f"({self.hidden * 1e3:.1f} ms hidden behind the kernels scheduled "
                "while they transfer)" if self.hidden else "(not overlapped)")]
    for link, seconds in self.by_link.items():
      lines.append(f"    on {link:<14} {seconds * 1e3:10.1f} ms")
    if self.host:
      lines.append(f"  host copies       {self.host * 1e3:10.1f} ms  (train.offload's "
                   "state in and out, at the host link's bandwidth, not overlapped)")
    if self.bubble:
      lines.append(f"  of which bubble   {self.bubble * 1e3:10.1f} ms  (in compute "
                   "and memory)")
    return "\n".join(lines)


def link_for(axes: tuple[str, ...], mesh: dict[str, int], hardware: Hardware
             ) -> tuple[Link, int]:
  """The link level a collective over mesh ``axes`` runs on, and its group's size.

  The group of device 0 along ``axes`` (row-major ids, module docstring) stays on
  node 0 when every member's id is below ``devices_per_node``; its link is then the
  fastest ``node`` link, else the fastest link of any other span.

  Returns:
    ``(link, n)``: the `Link` and the devices in one group (the product of the
    axes' sizes; 1 for no axes).
  """
  n = math.prod(mesh[a] for a in axes)
  local = max(_group(axes, mesh)) < hardware.devices_per_node
  for link in hardware.links:
    if link.span == "node" and local:
      return link, n
    if link.span != "node":
      return link, n
  return hardware.links[-1], n  # only node links: the slowest of them


def _group(axes: tuple[str, ...], mesh: dict[str, int]) -> list[int]:
  """The row-major device ids of device 0's group along ``axes``."""
  names = list(mesh)
  strides = {name: math.prod(list(mesh.values())[k + 1:])
             for k, name in enumerate(names)}
  ids = [0]
  for a in axes:
    ids = [i + j * strides[a] for i in ids for j in range(mesh[a])]
  return ids


def ring_hops(axes: tuple[str, ...], mesh: dict[str, int], hardware: Hardware
              ) -> tuple[int, Optional[Link]]:
  """How many nodes a group along ``axes`` spans, and the link inside a node.

  Returns:
    ``(k, node_link)``: the nodes holding device 0's group, and the fastest ``node``
    link of ``hardware`` (None where it has none, as a TPU slice). A ring over the
    group crosses the network on ``k - 1`` steps a pass (module docstring).
  """
  nodes = len({i // hardware.devices_per_node for i in _group(axes, mesh)})
  node = next((link for link in hardware.links if link.span == "node"), None)
  return nodes, node


def collective_seconds(kind: str, nbytes: float, n: int, link: Link,
                       nodes: int = 0, node_link: Optional[Link] = None) -> float:
  """Seconds one collective of ``kind`` takes with ``nbytes`` per device over a
  group of ``n`` devices on ``link`` (ring formulas, module docstring).

  With ``nodes`` (the nodes the group spans, `ring_hops`) and ``node_link``, a ring
  over several nodes pays ``link``'s latency on its ``nodes - 1`` steps between
  nodes and ``node_link``'s on the rest (NCCL's ring model); otherwise every step
  pays ``link``'s."""
  if n <= 1 or nbytes <= 0:
    return 0.0
  if kind == "collective-permute":
    return nbytes / link.bandwidth + link.latency
  passes = _RING_STEPS.get(kind, 1)
  latency = (n - 1) * link.latency
  if node_link is not None and 1 < nodes < n:
    latency = (nodes - 1) * link.latency + (n - nodes) * node_link.latency
  return passes * ((n - 1) / n * nbytes / link.bandwidth + latency)


def _kernel_seconds(kernels: Any, flop_rate: float, byte_rate: float
                    ) -> tuple[float, float]:
  """``(compute, memory)`` seconds of kernels (`mpscale.trainer.planning.hlo.Kernels`, or its dict
  form): each matrix product at ``flop_rate``, with the excess of its bytes at
  ``byte_rate`` over its FLOPs counted as memory (a roofline, kernel by kernel), and
  every other kernel's bytes at ``byte_rate``."""
  dots, other = ((kernels["dots"], kernels["bytes"]) if isinstance(kernels, dict)
                 else kernels)
  compute = memory = 0.0
  for flops, nbytes, count in dots:
    on_flops, on_bytes = flops / flop_rate, nbytes / byte_rate
    compute += count * on_flops
    memory += count * max(0.0, on_bytes - on_flops)
  return compute, memory + other / byte_rate


def _priced(key: str, nbytes: float, mesh: dict[str, int], hardware: Hardware
            ) -> tuple[Link, int, float]:
  """``(link, group size, seconds)`` of one ``"<kind> over <axes>"`` collective
  moving ``nbytes`` per device."""
  kind, _, axes_text = key.partition(" over ")
  axes = tuple(a for a in axes_text.split(",") if a in mesh)
  link, n = link_for(axes, mesh, hardware)
  if kind == "collective-permute":
    n = 2 if n > 1 else 1
  return link, n, collective_seconds(kind, nbytes, n, link,
                                     *ring_hops(axes, mesh, hardware))


def estimate(plan: Any, hardware: Hardware) -> Estimate:
  """The step time of ``plan`` (a `mpscale.trainer.planning.compiled.Plan`) on ``hardware``.

  Args:
    plan: its ``mesh``, ``devices``, ``kernels``, ``collectives_over``,
      ``compute_dtype``, ``bubble``, ``tokens_per_step`` and ``model_flops`` are read.
    hardware: the profile.

  Returns:
    The `Estimate`.

  Raises:
    ArgumentError: naming ``hardware``, when it is not a `Hardware`, or ``dtype``
      when the profile lists no peak for the plan's compute dtype.
  """
  if not isinstance(hardware, Hardware):
    raise validation.fail("hardware", " must be a Hardware profile (load_hardware); "
                          f"got {type(hardware).__name__}", validation.ArgumentTypeError)
  peak = peak_for(hardware, plan.compute_dtype)
  flop_rate = peak * hardware.matmul_efficiency
  byte_rate = hardware.hbm_bandwidth * hardware.memory_efficiency
  compute, memory = _kernel_seconds(plan.kernels, flop_rate, byte_rate)
  fp8 = getattr(plan, "fp8_flops", 0.0) or 0.0
  if fp8:  # FP8 GEMMs at the float8 peak, not the compute dtype's
    if "float8" not in hardware.peak_flops:
      raise validation.fail(
          "precision.fp8", f": the plan's products run in FP8, and {hardware.name} "
          "lists no float8 peak (no FP8 tensor cores); plan on a profile with one "
          "(h100-80g) or without precision.fp8")
    compute += fp8 / (hardware.peak("float8") * hardware.matmul_efficiency) - (
        fp8 / flop_rate)
  rows, by_link = [], {}
  for key, c in sorted(plan.collectives_over.items()):
    link, n, once = _priced(key, c["bytes"] / max(c["count"], 1), plan.mesh, hardware)
    seconds = c["count"] * once
    rows.append({"collective": key, "group": n, "link": link.name,
                 "count": c["count"], "bytes": c["bytes"], "seconds": seconds})
    if seconds:
      by_link[link.name] = by_link.get(link.name, 0.0) + seconds
  collectives = sum(by_link.values())
  hidden = 0.0
  for o in getattr(plan, "overlaps", None) or ():
    once = _priced(o["collective"], o["bytes"], plan.mesh, hardware)[2]
    window = sum(_kernel_seconds(o["window"], flop_rate, byte_rate))
    hidden += o["count"] * min(once, window)
  hidden = min(hidden, collectives)
  offloaded = (getattr(plan, "bytes", None) or {}).get("host", 0)
  host = (2 * offloaded / hardware.host_bandwidth  # in at the start, out at the end
          if offloaded and hardware.host_bandwidth else 0.0)
  total = compute + memory + collectives - hidden + host
  terms = {"compute": compute, "memory": memory, "host copies": host,
           **{f"collectives on {k}": v for k, v in by_link.items()}}
  mfu = (None if plan.model_flops is None or total <= 0 else
         plan.model_flops / (total * plan.devices * peak))
  return Estimate(
      hardware=hardware.name, seconds=total, compute=compute, memory=memory,
      collectives=collectives, hidden=hidden, host=host,
      bubble=plan.bubble * (compute + memory),
      by_link=by_link, rows=rows,
      tokens_per_second=plan.tokens_per_step / total if total > 0 else math.inf,
      mfu=mfu, peak_flops=peak, dominant=max(terms, key=terms.get),
      assumptions={"matmul_efficiency": hardware.matmul_efficiency,
                   "memory_efficiency": hardware.memory_efficiency,
                   "overlap": "the compiled program's asynchronous collectives, behind "
                   "the kernels scheduled between their start and done",
                   "axes_onto_nodes": "row-major, "
                   + " x ".join(plan.mesh) + f"; {hardware.devices_per_node} devices "
                   "a node", "compute_dtype": plan.compute_dtype,
                   "assumed_in_profile": list(hardware.assumed)})
