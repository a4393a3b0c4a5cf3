"""A layout's step priced from shapes alone: which layouts the search compiles.

`mpscale.trainer.planning.search` has thousands of layouts to rank and can compile a
handful (seconds each on the CPU, more at hundreds of devices). `estimate` prices a
layout of the built-in LM in microseconds, with no JAX at all, from the config's
sizes (`Model`) and the layout (`Layout`), per device and step:

- **matrix FLOPs** (`matmul_flops`): ``2 (4 d^2 + 2 d f) / t`` a token and layer plus
  attention's ``4 T d / t``, and the head's ``2 d V / t``; the backward twice the
  forward; recomputation runs each layer's forward again but its last product
  (``2 d f / t``: the compiled program drops it, its output unused). A mixture of
  experts (``num_experts`` ``E`` > 0) counts the routed tokens only: each goes
  through its ``k`` experts of width ``f_e`` (and a shared MLP of ``f_s``), so its
  MLP is ``2 · 3 d (k f_e + f_s) / t`` (`mlp_units`), and its router ``2 d E``
  (whole on every tensor rank). A pipeline runs
  every tick on every device, its bubble ticks too: its layers' FLOPs are divided by
  ``1 - bubble``.
- **memory-bound bytes** (`elementwise_bytes`): the passes over the activations that
  are not matrix products (layer norms, GELU, softmax over the ``h T`` scores, the
  loss over ``V / t`` logits, an expert layer's ``k`` routed rows of ``d``), a
  constant number each per token (the scores' none under cuDNN's fused attention,
  `Model.attention`), and the optimizer's
  update over the device's parameters (`ELEMENTWISE_PASSES`, `UPDATE_BYTES`); under
  recomputation a layer's passes shrink (`REMAT_BYTES`); ZB-H1's split backward
  moves more, and runs more tensor-parallel collectives (`ZB_H1_COST`, measured).
- **collectives** (`collectives`), each a `Collective` (kind, mesh axes, bytes a
  device, how many)::

    data      all-reduce of the gradients, once a step (their dtype: ``reduce_bytes``)
    ZeRO-1    the same all-reduce, then an all-gather of the updated parameters
    fsdp      all-gather of each layer's weights in the compute dtype in the
              forward and once more for the backward (the recompute's gather
              serves it), and a reduce-scatter of its gradient in the masters'
              dtype, per micro-batch (`_fsdp_collectives`)
    tensor    Megatron's all-reduce of a layer's [rows, T, d] output after attention
              and after the MLP, forward and backward (and the recompute), per
              micro-batch; with sequence parallelism an all-gather and a
              reduce-scatter each instead; one more for the vocabulary-split
              embedding and head
    stage     one permute of a micro-batch's [rows, T, d] activations a tick, each
              way; the embedding's and head's gradients summed over the stages
    context   as fsdp's, the parameters split over it too (as the trainer lays them
              out) and the gradient sum; per layer and micro-batch, a ring's
              ``context - 1`` permutes of a device's K and V forward, and as many of
              them with their float32 gradients back (``context`` of those), or an
              all-gather of K and V forward and backward and a reduce-scatter of
              their gradients (`context_kv_bytes`)
    expert    per expert layer and micro-batch, two all-to-alls of a device's ``k``
              routed rows of ``d`` (to the experts' devices and back) forward, two
              backward, two more in the recompute (`routed_bytes`); the experts'
              gradients are summed over data, fsdp and context only, every other
              weight's over expert too (a data axis for them)

  priced with `mpscale.trainer.planning.step_time`'s own ring formulas and link
  levels (`step_time.collective_seconds`, `step_time.link_for`).
- **bubble** (`bubble`): ``(S - 1) / (v M + S - 1)`` for GPipe and 1F1B, ``(S - 1) /
  (3 M + S - 1)`` for ZB-H1.
- **memory** (`memory_bytes`): parameters, gradients and optimizer state (`state_bytes`,
  the optimizer's bytes a parameter read once from its state's shapes), the
  activations a device keeps for the backward (`activation_bytes`: each layer's of
  every micro-batch in flight, `live_items`; with recomputation only its input and
  one layer's working set, for the recomputed ones, `recomputed_share`) and one layer's gathered weights under FSDP. An expert
  layer's weights are split over ``expert`` (each device holds ``E / expert`` of
  them), the others are not.

The step is ``compute + memory + collectives``, nothing hidden (as the CPU compile the
search reads) but the ring's K/V permutes, each behind its block's attention
(`hidden_seconds`: up to the attention's FLOPs' time), and FSDP's per-layer
collectives, each behind the neighbouring layer's products (`fsdp_hidden_seconds`:
a prefetching FSDP's overlap; XLA's GPU schedule may hide less, docs/planning.md); the experts' all-to-alls are
not hidden (the expert products wait for the rows they bring). Context parallelism
divides a device's tokens by ``context``, expert parallelism (a data axis outside
the experts) by ``expert``. The constants are counts, not a fit to one machine; what
they are for is the order of layouts, not a step time to quote: the search compiles
the leading ones and ranks those by their compiled estimate.
tests/trainer/planning/test_analytic.py checks each formula by hand on tiny sizes
and the order against compiled plans, test_analytic_experts.py a mixture's.

Example:

  >>> from mpscale.trainer.planning import analytic
  >>> from mpscale.trainer.planning.hardware import load_hardware
  >>> from mpscale.trainer.models.lm import TinyLM
  >>> model = analytic.Model(TinyLM(vocab_size=256, d_model=64, num_heads=4,
  ...                               num_layers=4, d_ff=256, seq_len=64), batch_size=32)
  >>> layout = analytic.Layout(data=4, tensor=2)
  >>> tokens = 32 * 64 / 4  # a device's share of the batch
  >>> analytic.matmul_flops(model, layout) == tokens * 3 * (4 * (2 * (4 * 64**2
  ...     + 2 * 64 * 256) + 4 * 64 * 64) + 2 * 64 * 256) / 2
  True
  >>> analytic.estimate(model, layout, load_hardware("a100-80g")).seconds > 0
  True
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import jax
import numpy as np
from mpscale.trainer.config import build as builders
from mpscale.trainer.models import families
from mpscale.trainer.models import lm as lm_lib
from mpscale.trainer.planning import step_time as step_time_lib
from mpscale.trainer.planning.hardware import Hardware

AXES = ("data", "fsdp", "stage", "context", "expert", "tensor")
"""The trainer's mesh axes, in its row-major order (`step_time.link_for`)."""

ELEMENTWISE_PASSES = {"residual": 230, "mlp": 15, "scores": 15, "logits": 10,
                      "routed": 15}
"""Bytes-passes a token makes over each activation outside the matrix products, in a
forward and backward together: ``residual`` over its ``d`` values (two layer norms,
two residual adds, casts, the residuals kept for the backward), ``mlp`` over ``f /
t`` (GELU in float32, its gradient), ``scores`` over ``h T / t`` float32 scores
(mask, softmax and its gradient) and ``logits`` over ``V / t`` float32 logits
(log-softmax and its gradient). Read off compiled plans of GPT-2 124M's step (data
8, data 4 x tensor 2, with and without recomputation): the CPU compile the search
ranks by moves the residual stream many more times than a fused GPU kernel would.
``routed`` is counted, not read off a plan: over an expert layer's ``k d`` routed
values a token (in the compute dtype), the gather into expert order (a read and a
write), the exchange's send and receive buffers and the weighted combine's read, five
passes forward and twice that backward."""

REMAT_BYTES = 0.65
"""The share of a layer's elementwise bytes left under recomputation: the compiled
step without it writes every residual out and reads it back in the backward; with
it they stay inside the recomputed layer's fused kernels (GPT-2 124M: 0.63-0.65)."""

ZB_H1_COST = {"bytes": 2.2, "tensor": 1.5}
"""What mpscale's ZB-H1 step moves beyond 1F1B's, measured on the GPU's compile: its
split backward (an input-gradient pass, then a weight-gradient pass) reads and
writes 2.2x 1F1B's memory-bound layer bytes and runs 1.4-1.6x its tensor-parallel
gathers and reduce-scatters (GPT-3 6.7B on 512 H100s, data 16 x stage 4 x tensor 8
with sequence parallelism, 8 micro-batches, recomputation: 454 GiB against 210 GiB of
elementwise bytes, 27.9 and 20.3 GiB of gathers and reduce-scatters over ``tensor``
against 17.2 and 14.4). Without it the search ranked ZB-H1 first for its smaller
bubble and its compiled plans came out 1.5x slower than 1F1B's."""

LAYER_LEAVES = 12
"""Parameter leaves of a layer (four kernels, four biases, two layer norms' scale
and bias): what FSDP gathers one by one."""

LEAVES = LAYER_LEAVES + 5
"""Parameter leaves of the LM: a layer's (stacked), the two embeddings and the
head's layer norm and kernel."""

EXPERT_LEAVES = 3
"""Parameter leaves of an expert layer's routed experts (gate, up and down, each
stacked over the experts and the layers): summed over their own axes."""

PIECES = 3
"""Collectives a parameter leaf's gradient sum and gather split into when the
optimizer state is split (ZeRO-1, FSDP): the gradient and the optimizer's
statistics."""

UPDATE_BYTES = 4 * 6
"""Bytes the optimizer's update reads and writes a parameter a step, besides its
state: the parameter and its gradient read, the parameter written, in float32, with
the gradient's clipping and unscaling passes."""


class Layout(NamedTuple):
  """One layout of the trainer: what `search.layouts` enumerates, as fields."""
  data: int = 1
  """Data-parallel replicas holding whole copies (``mesh.data``)."""
  fsdp: int = 1
  """Replicas splitting the parameters and state (``mesh.fsdp``, ZeRO-3)."""
  stage: int = 1
  """Pipeline stages (``mesh.stage``)."""
  tensor: int = 1
  """Megatron's split of heads, MLP units and vocabulary (``mesh.tensor``)."""
  context: int = 1
  """The sequence's split (``mesh.context``)."""
  expert: int = 1
  """The experts' split (``mesh.expert``); outside the experts, a data axis."""
  context_parallel: str = "ring"
  """How attention crosses it (``model.context_parallel``)."""
  microbatches: int = 1
  """Micro-batches per data replica (``train.num_microbatches``)."""
  remat: bool = False
  """Recompute layers' forwards in the backward (``train.recompute: full``)."""
  recompute_layers: Optional[int] = None
  """With ``remat``, how many layers of each stage's chunk are recomputed, the first
  ones (``train.recompute_layers``); ``None``: all (`recomputed_share`)."""
  zero1: bool = False
  """Optimizer state split over ``data`` (``mesh.shard_optimizer_state``)."""
  sequence_parallel: bool = False
  """The residual stream split over ``tensor`` along the sequence."""
  schedule: str = "gpipe"
  """The pipeline schedule: ``gpipe``, ``1f1b`` or ``zb_h1``."""
  virtual_stages: int = 1
  """Chunks a stage holds (interleaved schedules)."""
  offload_optimizer: bool = False
  """The optimizer state in host memory between steps (``train.offload:
  [opt_state]``): out of the device's state, moved in and out each step."""

  @classmethod
  def from_overrides(cls, overrides: Mapping[str, Any]) -> "Layout":
    """The layout of `search.layouts`' ``{"mesh.data": 4, ...}`` overrides (keys
    left out keep their defaults)."""
    keys = {"mesh.data": "data", "mesh.fsdp": "fsdp", "mesh.stage": "stage",
            "mesh.tensor": "tensor", "train.num_microbatches": "microbatches",
            "train.recompute_layers": "recompute_layers",
            "mesh.shard_optimizer_state": "zero1",
            "mesh.sequence_parallel": "sequence_parallel",
            "mesh.pipeline_schedule": "schedule", "mesh.virtual_stages":
            "virtual_stages", "mesh.context": "context", "mesh.expert": "expert",
            "model.context_parallel": "context_parallel"}
    fields = {keys[k]: v for k, v in overrides.items() if k in keys}
    if "train.recompute" in overrides:
      fields["remat"] = overrides["train.recompute"] == "full"
    if "train.offload" in overrides:
      fields["offload_optimizer"] = "opt_state" in overrides["train.offload"]
    return cls(**fields)

  @classmethod
  def from_config(cls, cfg: Any) -> "Layout":
    """The layout of ``cfg``'s ``mesh`` and ``train`` sections (a
    `mpscale.trainer.RunConfig`, checked or as read)."""
    m = cfg.mesh
    return cls(data=m.data, fsdp=m.fsdp, stage=m.stage, tensor=m.tensor,
               context=m.context, expert=m.expert,
               context_parallel=cfg.model.context_parallel,
               microbatches=cfg.train.num_microbatches, remat=cfg.train.full_recompute,
               recompute_layers=cfg.train.recompute_layers,
               zero1=m.shard_optimizer_state, sequence_parallel=m.sequence_parallel,
               schedule=m.pipeline_schedule, virtual_stages=m.virtual_stages,
               offload_optimizer="opt_state" in cfg.train.offload)

  @property
  def mesh(self) -> dict[str, int]:
    """The mesh, every axis, in the trainer's order."""
    return {axis: getattr(self, axis) for axis in AXES}

  @property
  def replicas(self) -> int:
    """The batch's split (``data x fsdp x expert``: outside the experts, ``expert``
    is one more data axis)."""
    return self.data * self.fsdp * self.expert

  @property
  def param_axes(self) -> tuple[str, ...]:
    """The axes (of size > 1) the parameters and their state are split over as
    FSDP splits them: ``fsdp``, and ``context`` (as the trainer lays them out,
    `mpscale.trainer.config.build.build_param_specs`)."""
    return tuple(a for a in ("fsdp", "context") if getattr(self, a) > 1)

  @property
  def param_split(self) -> int:
    """The devices one parameter is split over (``fsdp x context``)."""
    return self.fsdp * self.context


class Model(NamedTuple):
  """The sizes of the built-in LM and of its step that the estimate reads."""
  lm: lm_lib.TinyLM
  """The model: ``vocab_size`` ``V``, ``d_model`` ``d``, ``num_heads`` ``h``,
  ``num_layers`` ``L``, ``d_ff`` ``f`` and ``seq_len`` ``T`` are read; with a
  mixture of experts, ``num_experts`` ``E``, ``experts_per_token`` ``k``, each
  expert's width ``f_e`` (``expert_width``) and the shared MLP's ``shared_d_ff``
  ``f_s``."""
  batch_size: int
  """Sequences a step (all replicas)."""
  param_bytes: int = 4
  """Bytes of a parameter (the policy's parameter dtype)."""
  compute_bytes: int = 2
  """Bytes of an activation (the policy's compute dtype)."""
  compute_dtype: str = "bfloat16"
  reduce_bytes: int = 4
  """Bytes of a gradient summed over the replicas (the gradients' dtype, or float32
  with ``precision.grad_reduce_dtype``)."""
  optimizer_bytes: float = 8.0
  """Optimizer state a parameter, in bytes (Adam's two float32 moments: 8)."""
  attention: str = "xla"
  """The attention the step runs (`mpscale.trainer.models.lm.attention_for`):
  ``xla`` holds each layer's ``[h, T, T]`` float32 scores in memory (their passes,
  and their bytes kept for the backward); ``cudnn``'s fused attention neither
  moves nor keeps them."""

  @classmethod
  def from_config(cls, cfg: Any, device: Any = None) -> "Model":
    """The sizes of ``cfg`` (a `mpscale.trainer.RunConfig` of the built-in LM), its
    optimizer's bytes a parameter read from its state's shapes (nothing
    allocated; the layout does not matter), and its attention as the trainer
    chooses it on devices like ``device`` (`lm.attention_for`; ``None``, no device
    known: ``xla``)."""
    lm = lm_lib.TinyLM.from_sizes(cfg.model)
    policy = builders.build_policy(cfg)
    shapes = jax.eval_shape(lm.init, jax.random.key(0))
    count = lm_lib.num_params(shapes)
    opt = builders.optimizer_state_bytes(builders.build_optimizer(cfg), shapes)
    param_bytes = np.dtype(policy.param_dtype).itemsize
    reduce_bytes = (4 if cfg.precision.grad_reduce_dtype == "float32" else param_bytes)
    return cls(lm=lm, batch_size=cfg.data.batch_size, param_bytes=param_bytes,
               compute_bytes=np.dtype(policy.compute_dtype).itemsize,
               compute_dtype=np.dtype(policy.compute_dtype).name,
               reduce_bytes=reduce_bytes, optimizer_bytes=opt / count,
               attention=lm_lib.attention_for(cfg.model.attention, device,
                                              policy.compute_dtype, lm.dims_per_head))


class Params(NamedTuple):
  """Parameters of the LM by where they sit; ``*_split`` the part that tensor
  parallelism splits (heads, MLP units, vocabulary)."""
  layer: int
  layer_split: int
  embed: int
  embed_split: int
  head: int
  head_split: int
  experts: int = 0
  """Of ``layer_split``, a layer's routed experts (``3 d f_e E``): split over
  ``expert`` too."""


def mlp_units(model: Model) -> int:
  """The MLP's hidden units one token goes through: ``d_ff``, or with experts its
  ``k`` experts' and the shared MLP's, ``k f_e + f_s`` (routed tokens only)."""
  lm = model.lm
  if not lm.num_experts:
    return lm.d_ff
  return lm.experts_per_token * lm.expert_width + lm.shared_d_ff


def param_counts(model: Model) -> Params:
  """The LM's parameters (`mpscale.trainer.models.lm.TinyLM`): a layer's (its
  attention's and MLP's matrices, biases and norms: GPT-2's qkv, out, fc and proj
  with biases and two LayerNorms, or the Llama block's q, k, v, o, gate, up and
  down with two RMSNorms, Qwen2's q, k, v biases and Qwen3's q/k norms; with
  experts, the router ``[d, E]``, the experts' gate, up and down ``3 d f_e E`` and
  a shared MLP's ``3 d f_s`` in the dense MLP's stead), the embeddings' (tokens,
  and GPT-2's positions) and the head's (a norm and, untied, the vocabulary
  projection). Grouped K/V heads count as split over ``tensor`` (replicated when it
  does not divide them, a small share of a layer); the router is whole on every
  tensor rank.

  Returns:
    `Params`, each a count (the whole model: ``embed + head + num_layers *
    layer``)."""
  lm = model.lm
  d, f, v, t = lm.d_model, lm.d_ff, lm.vocab_size, lm.seq_len
  q, kv = lm.num_heads * lm.dims_per_head, lm.kv_heads * lm.dims_per_head
  gpt = lm.family == "gpt"
  attention = 2 * d * q + 2 * d * kv  # q (or qkv) and o kernels, k and v
  experts = 3 * d * lm.expert_width * lm.num_experts
  mlp = (3 * d * lm.shared_d_ff + experts if lm.num_experts
         else (2 if gpt else 3) * d * f)
  split_biases = (q + 2 * kv + f if gpt
                  else q + 2 * kv if families.TRAITS[lm.family].qkv_bias else 0)
  split = attention + mlp + split_biases
  norms = 4 * d if gpt else 2 * d + (2 * lm.dims_per_head
                                     if families.TRAITS[lm.family].qk_norm else 0)
  other_biases = 2 * d if gpt else 0  # out and proj biases
  router = d * lm.num_experts
  head = 0 if lm.tie_embeddings else d * v
  return Params(layer=split + norms + other_biases + router, layer_split=split,
                embed=v * d + (t * d if gpt else 0), embed_split=v * d,
                head=(2 * d if gpt else d) + head, head_split=head, experts=experts)


def active_params(model: Model) -> float:
  """The parameters one token goes through: every one but the experts it is not
  routed to (``k / E`` of the experts'). Mixtral 8x7B: 12.9B of 46.7B."""
  p, lm = param_counts(model), model.lm
  share = lm.experts_per_token / lm.num_experts if lm.num_experts else 1
  return p.embed + p.head + lm.num_layers * (p.layer - p.experts * (1 - share))


def _layer_on_device(p: Params, layout: Layout) -> float:
  """A layer's parameters on one device before FSDP's split: its heads and MLP
  units split over ``tensor``, its experts over ``tensor x expert``."""
  t = layout.tensor
  return (p.layer - p.layer_split + (p.layer_split - p.experts) / t
          + p.experts / (t * layout.expert))


def params_per_device(model: Model, layout: Layout) -> float:
  """Parameters one device holds: a stage's layers and the embedding and head (on
  every stage), their heads, MLP units and vocabulary split over ``tensor``, the
  experts over ``expert`` too, and everything over ``fsdp`` and ``context``
  (`Layout.param_split`)."""
  p, t = param_counts(model), layout.tensor
  per = lambda whole, split: whole - split + split / t  # noqa: E731
  layers = model.lm.num_layers / layout.stage * _layer_on_device(p, layout)
  return (layers + per(p.embed, p.embed_split) + per(p.head, p.head_split)
          ) / layout.param_split


def expert_params_per_device(model: Model, layout: Layout) -> float:
  """Of `params_per_device`, the routed experts' (their gradients are summed over
  ``data``, ``fsdp`` and ``context`` only)."""
  p = param_counts(model)
  return (model.lm.num_layers / layout.stage * p.experts
          / (layout.tensor * layout.expert * layout.param_split))


def optimizer_bytes(model: Model, layout: Layout) -> float:
  """The optimizer state a device holds between steps, on the device or, offloaded,
  in host memory; split over ``data`` too with ZeRO-1."""
  return (params_per_device(model, layout) * model.optimizer_bytes
          / (layout.data if layout.zero1 else 1))


def state_bytes(model: Model, layout: Layout) -> float:
  """Parameters, gradients (in the parameters' dtype) and optimizer state a device
  holds in its memory (`optimizer_bytes`, unless offloaded)."""
  n = params_per_device(model, layout)
  optimizer = 0.0 if layout.offload_optimizer else optimizer_bytes(model, layout)
  return 2 * n * model.param_bytes + optimizer


def _zb_h1(layout: Layout) -> bool:
  return layout.stage > 1 and layout.schedule == "zb_h1"


def bubble(layout: Layout) -> float:
  """The idle share of a pipeline's step: ``(S - 1) / (v M + S - 1)`` (GPipe,
  1F1B), ``(S - 1) / (3 M + S - 1)`` (ZB-H1, one of F, B, W a tick); 0 unpipelined."""
  s, m, v = layout.stage, layout.microbatches, layout.virtual_stages
  if s == 1:
    return 0.0
  work = 3 * m if layout.schedule == "zb_h1" else v * m
  return (s - 1) / (work + s - 1)


def live_items(layout: Layout) -> int:
  """The most work items (a micro-batch's chunk of a stage's layers) whose
  activations a device keeps at once: all ``M`` unpipelined (accumulated one after
  another: 1), GPipe ``v M``, 1F1B ``min(v M, (v + 1) S - 1)``, ZB-H1 ``min(M, S)``
  (`mpscale.parallel.pipeline.live_slots`)."""
  s, m, v = layout.stage, layout.microbatches, layout.virtual_stages
  if s == 1:
    return 1
  if layout.schedule == "gpipe":
    return v * m
  if layout.schedule == "zb_h1":
    return min(m, s)
  return min(v * m, (v + 1) * s - 1)


def rows(model: Model, layout: Layout) -> float:
  """Sequences in one micro-batch of one replica."""
  return model.batch_size / (layout.replicas * layout.microbatches)


def tokens_per_device(model: Model, layout: Layout) -> float:
  """A device's tokens a step: its replica's share of the batch (split over
  ``data x fsdp x expert``), its ``1 / context`` of each sequence."""
  return model.batch_size * model.lm.seq_len / (layout.replicas * layout.context)


def context_kv_bytes(model: Model, layout: Layout) -> float:
  """A device's K and V of one micro-batch and layer (its rows, its ``1 / context``
  of the sequence, its K/V heads: split over ``tensor`` where it divides them), in
  the compute dtype: what a ring step passes on."""
  lm = model.lm
  heads = lm.kv_heads / layout.tensor if lm.kv_heads % layout.tensor == 0 else (
      lm.num_heads / layout.tensor)  # repeated to the query heads
  return (2 * rows(model, layout) * lm.seq_len / layout.context * heads
          * lm.dims_per_head * model.compute_bytes)


def routed_bytes(model: Model, layout: Layout) -> float:
  """A device's routed rows of one micro-batch and expert layer: its tokens times
  ``k`` rows of ``d``, in the compute dtype: what one all-to-all over ``expert``
  moves (the ``(expert - 1) / expert`` that leave the device, in its price); 0
  without experts."""
  lm = model.lm
  if not lm.num_experts:
    return 0.0
  return (rows(model, layout) * lm.seq_len / layout.context * lm.experts_per_token
          * lm.d_model * model.compute_bytes)


def _scores(model: Model) -> int:
  """Scores a token holds in a layer, ``h T``, under XLA's attention; none under
  cuDNN's fused attention (`Model.attention`)."""
  return model.lm.num_heads * model.lm.seq_len if model.attention == "xla" else 0


def matmul_flops(model: Model, layout: Layout) -> float:
  """Matrix-product FLOPs one device runs a step (module docstring)."""
  lm, t = model.lm, layout.tensor
  d, units = lm.d_model, mlp_units(model)
  layer = _layer_flops(model, layout)
  # Recomputing a block, XLA's program leaves out the products whose outputs the
  # backward does not read again: the MLP's last, and in the RoPE families the q, k
  # and v projections (attention's own checkpoint keeps its q, k, v inputs), as the
  # compiled programs show (tests/trainer/planning/test_analytic.py).
  q, kv = lm.num_heads * lm.dims_per_head, lm.kv_heads * lm.dims_per_head
  kept = 2 * d * units + (0 if lm.family == "gpt" else 2 * d * q + 4 * d * kv)
  passes = 3 + (1 - kept / t / layer) * recomputed_share(model, layout)
  layers = model.lm.num_layers / layout.stage * layer * passes / (1 - bubble(layout))
  head = 3 * 2 * d * model.lm.vocab_size / t
  return tokens_per_device(model, layout) * (layers + head)


def _layer_flops(model: Model, layout: Layout) -> float:
  """A layer's forward matrix-product FLOPs a token on one device."""
  lm, t = model.lm, layout.tensor
  d, units = lm.d_model, mlp_units(model)
  q, kv = lm.num_heads * lm.dims_per_head, lm.kv_heads * lm.dims_per_head
  products = 2 * d * q + 2 * d * kv + (2 if lm.family == "gpt" else 3) * d * units
  router = 2 * d * lm.num_experts  # whole on every tensor rank
  return (2 * products + 4 * lm.seq_len * q) / t + router


def _layer_forward_flops(model: Model, layout: Layout) -> float:
  """One layer's forward matrix-product FLOPs a device runs a step (every
  micro-batch's tokens)."""
  return tokens_per_device(model, layout) * _layer_flops(model, layout)


def elementwise_bytes(model: Model, layout: Layout) -> float:
  """Bytes one device's memory-bound kernels move a step (`ELEMENTWISE_PASSES`,
  `UPDATE_BYTES`)."""
  lm, t, cb = model.lm, layout.tensor, model.compute_bytes
  tokens = tokens_per_device(model, layout)
  residual = lm.d_model / (t if layout.sequence_parallel else 1)
  routed = lm.experts_per_token * lm.d_model if lm.num_experts else 0
  layer = (ELEMENTWISE_PASSES["residual"] * residual * cb
           + ELEMENTWISE_PASSES["mlp"] * mlp_units(model) / t * 4
           + ELEMENTWISE_PASSES["routed"] * routed * cb
           + ELEMENTWISE_PASSES["scores"] * _scores(model) / t * 4)
  layer *= 1 - recomputed_share(model, layout) * (1 - REMAT_BYTES)
  if _zb_h1(layout):
    layer *= ZB_H1_COST["bytes"]
  layers = model.lm.num_layers / layout.stage * layer / (1 - bubble(layout))
  head = ELEMENTWISE_PASSES["logits"] * model.lm.vocab_size / t * 4
  n = params_per_device(model, layout)
  update = n * (UPDATE_BYTES + 2 * model.optimizer_bytes / (
      layout.data if layout.zero1 else 1))
  return tokens * (layers + head) + update


def activation_bytes(model: Model, layout: Layout) -> float:
  """Activations a device keeps for the backward at its peak: each layer's of each
  micro-batch in flight (`live_items`), heads, MLP units and scores split over
  ``tensor``, the residual stream too with sequence parallelism; with experts the
  routed rows' (``k`` of ``d`` a token, and their units, `mlp_units`) and the
  router's float32 scores in the dense MLP's stead; with recomputation a layer's
  input only, and one layer's whole working set (with ``recompute_layers``, the
  first layers' inputs and the others' residuals, whose freeing in the backward
  makes room for the working set); and the micro-batch's float32 logits."""
  lm, cb, t = model.lm, model.compute_bytes, layout.tensor
  d, tokens = lm.d_model, rows(model, layout) * lm.seq_len / layout.context
  residual = 6 * d * cb / (t if layout.sequence_parallel else 1)
  split = (4 * d * cb + mlp_units(model) * (2 * cb + 4)
           + _scores(model) * (8 + cb)) / t
  routed = (lm.experts_per_token * d * cb + lm.num_experts * 4
            if lm.num_experts else 0)
  layer = tokens * (residual + split + routed)
  layers = model.lm.num_layers / (layout.stage * layout.virtual_stages)
  share = recomputed_share(model, layout)
  chunk = layers * (share * tokens * d * cb + (1 - share) * layer)
  kept = live_items(layout) * chunk
  logits = 3 * tokens * model.lm.vocab_size / t * 4
  # The first layers recompute their working set after the backward of the later,
  # kept ones freed theirs: room for it, unless every layer is recomputed.
  working = layer * max(0.0, 1 - (1 - share) * layers) if share else 0.0
  return kept + working + logits


def recomputed_share(model: Model, layout: Layout) -> float:
  """The share of a device's layers recomputed whole in the backward: none without
  ``remat``, else the first ``recompute_layers`` of each stage's chunk (of the
  model's layers, unpipelined; all where ``None``): Megatron-LM's
  ``recompute_num_layers``."""
  if not layout.remat:
    return 0.0
  chunk = model.lm.num_layers / (layout.stage * layout.virtual_stages)
  if layout.recompute_layers is None:
    return 1.0
  return min(layout.recompute_layers, chunk) / chunk


def memory_bytes(model: Model, layout: Layout) -> float:
  """A device's peak: `state_bytes`, `activation_bytes` and, under FSDP (or
  context), one layer's weights gathered (twice: the next one's gather
  overlaps)."""
  gathered = (2 * _layer_on_device(param_counts(model), layout) * model.compute_bytes
              if layout.param_split > 1 else 0)
  return state_bytes(model, layout) + activation_bytes(model, layout) + gathered


class Collective(NamedTuple):
  """Collectives of one kind over some mesh axes, per device and step."""
  kind: str
  """``all-reduce``, ``all-gather``, ``reduce-scatter`` or ``collective-permute``."""
  axes: tuple[str, ...]
  nbytes: float
  """Bytes a device moves in one (`step_time.collective_seconds`' ``B``)."""
  count: float


def collectives(model: Model, layout: Layout) -> list[Collective]:
  """The collectives of one device's step (module docstring); those of a group of
  one device are left out. Counts follow the compiled program: the gradient sum is
  one all-reduce (the experts' apart, `_gradient_sums`), unless the optimizer state
  is split (ZeRO-1, FSDP), when it runs a piece a parameter leaf and statistic
  (`PIECES`); FSDP gathers leaf by leaf."""
  p, cb = param_counts(model), model.compute_bytes
  n = params_per_device(model, layout)
  out = _gradient_sums(model, layout)
  if layout.zero1 and layout.data > 1:
    pieces = PIECES * LEAVES
    out.append(Collective("all-gather", ("data",), n * model.param_bytes / pieces,
                          pieces))
  m, passes = layout.microbatches, 2 + recomputed_share(model, layout)
  layers = model.lm.num_layers / layout.stage
  out += _fsdp_collectives(model, layout)
  activation = (rows(model, layout) * model.lm.seq_len / layout.context
                * model.lm.d_model * cb)
  out += _context_collectives(model, layout, m * layers, passes)
  if model.lm.num_experts and layout.expert > 1:
    # to the experts' devices and back, in each forward and backward
    out.append(Collective("all-to-all", ("expert",), routed_bytes(model, layout),
                          m * layers * 2 * passes))
  if layout.tensor > 1:
    big = m * ((passes + 2) * layers + 2)  # two a layer a pass (the recompute's
    # second unused), the embedding's and the head's
    if _zb_h1(layout):
      big *= ZB_H1_COST["tensor"]
    small = m * 4 * layers + 1  # per-token statistics (float32)
    kinds = (("all-gather", "reduce-scatter") if layout.sequence_parallel else
             ("all-reduce",))
    for kind in kinds:
      out.append(Collective(kind, ("tensor",), activation, big / len(kinds)))
    out.append(Collective("all-reduce", ("tensor",),
                          rows(model, layout) * model.lm.seq_len * 4, small))
  if layout.stage > 1:
    s, v = layout.stage, layout.virtual_stages
    ticks = (3 * m if layout.schedule == "zb_h1" else v * m) + s - 1
    out.append(Collective("collective-permute", ("stage",),
                          activation / (layout.tensor if layout.sequence_parallel
                                        else 1), 2 * ticks))
    ends = (p.embed + p.head - p.embed_split - p.head_split
            + (p.embed_split + p.head_split) / layout.tensor)
    out.append(Collective("all-reduce", ("stage",), ends * model.reduce_bytes, 1))
  return out


def _gradient_sums(model: Model, layout: Layout) -> list[Collective]:
  """The gradient sums: over the axes a device's tokens are a slice of the batch
  along (``data``, ``fsdp``, ``context``, and ``expert`` for every weight but the
  experts', which it splits); one all-reduce, or a piece a parameter leaf and
  statistic when the optimizer state is split (`PIECES`)."""
  n, experts = params_per_device(model, layout), expert_params_per_device(
      model, layout)
  split = layout.zero1 and layout.data > 1 or layout.param_split > 1
  axes = tuple(a for a in ("data", "fsdp", "context") if getattr(layout, a) > 1)
  dense = axes + (("expert",) if layout.expert > 1 else ())
  parts = ([(dense, n - experts, LEAVES), (axes, experts, EXPERT_LEAVES)]
           if experts and layout.expert > 1 else [(dense, n, LEAVES)])
  out = []
  for group, count, leaves in parts:
    pieces = PIECES * leaves if split else 1
    if group:
      out.append(Collective("all-reduce", group, count * model.reduce_bytes / pieces,
                            pieces))
  return out


def _fsdp_collectives(model: Model, layout: Layout) -> list[Collective]:
  """FSDP's collectives (`mpscale.parallel` gathers as its ``gather_cast``, ZeRO-3):
  per micro-batch, each leaf gathered in the compute dtype for the forward and
  once more for the backward (the recompute's gather serves the backward too), and
  its gradient reduce-scattered in the masters' dtype (the gather's transpose)."""
  if layout.param_split == 1:
    return []
  leaves = LAYER_LEAVES * model.lm.num_layers / layout.stage + LEAVES - LAYER_LEAVES
  weights = params_per_device(model, layout) * layout.param_split / leaves
  m = layout.microbatches
  return [Collective("all-gather", layout.param_axes,
                     weights * model.compute_bytes, 2 * m * leaves),
          Collective("reduce-scatter", layout.param_axes,
                     weights * model.param_bytes, m * leaves)]


def fsdp_hidden_seconds(model: Model, layout: Layout, hardware: Hardware) -> float:
  """FSDP's collectives that run behind the layers' products: a layer's gather is
  issued while the layer before it computes (FSDP2's and DeepSpeed's prefetch; a
  compiled XLA program may overlap less, each gather with its own layer's
  products), and its gradient's reduce-scatter while the next layer's backward
  computes. So in each phase every
  layer's collectives but one hide, each behind up to one layer's products of that
  phase: the forward's gathers behind the forward, the backward's gathers and
  reduce-scatters behind the backward (and the recompute). Nothing hides where a
  stage holds one layer."""
  found = _fsdp_collectives(model, layout)
  layers = model.lm.num_layers / layout.stage
  if not found or layers <= 1:
    return 0.0
  gather, scatter = found
  forward = _priced([gather._replace(count=gather.count / 2)], layout, hardware)
  backward = _priced([gather._replace(count=gather.count / 2), scatter], layout,
                     hardware)
  rate = step_time_lib.peak_for(hardware, model.compute_dtype) * hardware.matmul_efficiency
  layer_forward = _layer_forward_flops(model, layout) / rate
  recompute = layer_forward if layout.remat else 0.0
  return (layers - 1) * (min(forward / layers, layer_forward)
                         + min(backward / layers, 2 * layer_forward + recompute))


def _context_collectives(model: Model, layout: Layout, layers: float,
                         passes: float) -> list[Collective]:
  """The K/V exchanges of ``layers`` layer runs (micro-batches times layers) with
  ``passes`` forwards and backwards (3 with recomputation: the forward twice; 2 and
  the share of layers recomputed, `recomputed_share`)."""
  c = layout.context
  if c == 1:
    return []
  kv = context_kv_bytes(model, layout)
  forwards = passes - 1
  if layout.context_parallel == "ring":
    gradients = kv * 4 / model.compute_bytes
    return [Collective("collective-permute", ("context",), kv,
                       layers * (c - 1) * (forwards + 1)),
            Collective("collective-permute", ("context",), gradients, layers * c)]
  return [Collective("all-gather", ("context",), kv * c, layers * (forwards + 1)),
          Collective("reduce-scatter", ("context",), kv * c * 4 / model.compute_bytes,
                     layers)]


def hidden_seconds(model: Model, layout: Layout, hardware: Hardware) -> float:
  """The ring's K/V permutes that run behind attention: each step's transfer
  overlaps the previous block's attention, so up to the attention FLOPs' time (a
  device's tokens, ``4 T q / t`` a token and layer, three passes)."""
  if layout.context == 1 or layout.context_parallel != "ring":
    return 0.0
  ring = _priced(_context_collectives(
      model, layout, layout.microbatches * model.lm.num_layers / layout.stage,
      2 + recomputed_share(model, layout)), layout, hardware)
  lm = model.lm
  attention = (tokens_per_device(model, layout) * lm.num_layers / layout.stage * 3
               * 4 * lm.seq_len * lm.num_heads * lm.dims_per_head / layout.tensor)
  rate = step_time_lib.peak_for(hardware, model.compute_dtype) * hardware.matmul_efficiency
  return min(ring, attention / rate)


class Estimate(NamedTuple):
  """A layout's step from shapes (`estimate`), in seconds, and its peak bytes."""
  seconds: float
  compute: float
  memory: float
  collectives: float
  bubble: float
  """The bubble's share of ``compute + memory`` (in them, not added)."""
  peak_bytes: float
  """`memory_bytes`."""
  hidden: float = 0.0
  """Collective seconds behind compute (the ring's, `hidden_seconds`), already
  taken out of ``collectives`` and ``seconds``."""
  host: float = 0.0
  """Seconds of an offloaded optimizer state's copies, in and out at the host link
  (`step_time`'s ``host``), in ``seconds``."""


def collective_seconds(model: Model, layout: Layout, hardware: Hardware) -> float:
  """`collectives`, priced on the links their groups need."""
  return _priced(collectives(model, layout), layout, hardware)


def _priced(found: list[Collective], layout: Layout, hardware: Hardware) -> float:
  """The seconds of ``found`` on ``layout``'s mesh (a permute: one hop)."""
  mesh, total = layout.mesh, 0.0
  for c in found:
    link, n = step_time_lib.link_for(c.axes, mesh, hardware)
    if c.kind == "collective-permute":
      n = 2 if n > 1 else 1
    total += c.count * step_time_lib.collective_seconds(
        c.kind, c.nbytes, n, link, *step_time_lib.ring_hops(c.axes, mesh, hardware))
  return total


def estimate(model: Model, layout: Layout, hardware: Hardware) -> Estimate:
  """``layout``'s step on ``hardware`` from shapes alone (module docstring).

  Args:
    model: the sizes (`Model.from_config`).
    layout: the layout (`Layout.from_overrides`).
    hardware: the profile: its peak for the compute dtype
      (`mpscale.trainer.planning.hardware.peak_for`) times ``matmul_efficiency``,
      ``hbm_bandwidth`` times ``memory_efficiency``, and its links.

  Returns:
    The `Estimate`.
  """
  flop_rate = (step_time_lib.peak_for(hardware, model.compute_dtype)
               * hardware.matmul_efficiency)
  byte_rate = hardware.hbm_bandwidth * hardware.memory_efficiency
  compute = matmul_flops(model, layout) / flop_rate
  memory = elementwise_bytes(model, layout) / byte_rate
  hidden = (hidden_seconds(model, layout, hardware)
            + fsdp_hidden_seconds(model, layout, hardware))
  comms = collective_seconds(model, layout, hardware) - hidden
  host = (2 * optimizer_bytes(model, layout) / hardware.host_bandwidth
          if layout.offload_optimizer and hardware.host_bandwidth else 0.0)
  return Estimate(seconds=compute + memory + comms + host, compute=compute,
                  memory=memory, collectives=comms,
                  bubble=bubble(layout) * (compute + memory),
                  peak_bytes=memory_bytes(model, layout), hidden=hidden, host=host)


def fits(model: Model, layout: Layout, memory: float, slack: float = 1.0) -> bool:
  """Whether ``layout``'s `memory_bytes` are within ``slack`` times ``memory``."""
  return memory_bytes(model, layout) <= slack * memory


__all__ = ["AXES", "Collective", "ELEMENTWISE_PASSES", "EXPERT_LEAVES", "Estimate",
           "LAYER_LEAVES", "LEAVES", "Layout", "Model", "PIECES", "Params",
           "REMAT_BYTES", "UPDATE_BYTES", "activation_bytes", "active_params",
           "bubble", "collectives", "context_kv_bytes", "expert_params_per_device",
           "fsdp_hidden_seconds", "hidden_seconds", "tokens_per_device",
           "collective_seconds", "elementwise_bytes", "estimate", "fits", "live_items", "matmul_flops",
           "memory_bytes", "mlp_units", "optimizer_bytes", "param_counts",
           "params_per_device",
           "routed_bytes", "rows", "state_bytes"]
