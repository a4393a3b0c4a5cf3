"""The run configuration's schema: typed, frozen dataclasses read from YAML.

This module reads a config and checks each value's *type* where it is read; the values
themselves are checked by the constructors that use them (`mpscale.trainer.config.load`
asks `mpscale.trainer.config.build` to build the pieces). It imports nothing else of the
trainer, so every other trainer module may import it.

`read_config` converts a parsed YAML mapping plus command-line overrides
(``--set train.steps=50``, values parsed as YAML scalars) into a `RunConfig`. A
mistake is a `ConfigError` that holds the dotted keys it speaks of (``keys``, the one
at fault first) beside its message, which names the key too::

  model.num_layers: expected an int, got 'four' (str)
  model.nun_layers: unknown key (did you mean 'num_layers'?)

A wrong type is also a ``TypeError`` (`ConfigTypeError`), any other mistake a
``ValueError``. Sections and keys left out take the defaults below; a section written as
an empty mapping (``clip:``) takes them too. Floats may be written ``1e-3``: the loader
reads YAML 1.2 floats (PyYAML's YAML 1.1 would read ``1e-3`` as a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import yaml

from mpscale import _deprecated
from mpscale.trainer.config.errors import ConfigError, ConfigTypeError  # noqa: F401


# ------------------------------------------------------------------ the dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model: the tiny decoder-only transformer (`mpscale.trainer.models.lm.TinyLM`) these
  sizes describe, or a user's model (``provider``; the sizes are then unused, but
  ``seq_len`` still cuts the built-in corpus)."""
  provider: Optional[str] = None
  """A user's model: ``"package.module:function"`` or ``"file.py:function"`` (a path
  relative to the config file), called with the `RunConfig`; it returns a Flax NNX
  module, a Flax linen module or an `mpscale.trainer.Model`
  (`mpscale.trainer.models.user`)."""
  loss: Optional[str] = None
  """With a Flax module from ``provider``: its loss, ``loss(model, batch) ->
  (loss_sum, num_tokens)`` or a mean, named like ``provider``."""
  metrics: Optional[str] = None
  """With a Flax module from ``provider``: metrics computed beside the loss in
  evaluation, ``metrics(model, batch) -> {name: (sum, count)}`` (e.g. ``{"accuracy":
  (num_correct, num_examples)}``), logged as ``eval_<name>``; named like
  ``provider``."""
  args: dict = dataclasses.field(default_factory=dict)
  """Free-form settings for ``provider`` (it reads ``config.model.args``)."""
  vocab_size: int = 256
  """Byte-level: 256."""
  d_model: int = 64
  """Width of the residual stream."""
  num_heads: int = 4
  """Attention heads; must divide ``d_model``."""
  num_layers: int = 2
  """Transformer blocks; must be divisible by ``mesh.stage``."""
  d_ff: int = 256
  """Hidden width of the MLP."""
  seq_len: int = 64
  """Tokens per training sequence (the context length)."""
  init_std: float = 0.02
  """Standard deviation of the normal initialization of weight matrices (GPT-2's)."""
  family: Literal["gpt", "llama", "mistral", "qwen2", "qwen3", "mixtral",
                  "qwen3_moe"] = "gpt"
  """The block (`mpscale.trainer.models.families`): ``gpt``, GPT-2's (LayerNorm,
  learned positions, GELU, biases); ``llama``, RMSNorm, RoPE, grouped-query
  attention and SwiGLU; ``mistral``, Llama's with a sliding window; ``qwen2``, with
  q, k, v biases; ``qwen3``, with RMSNorms of each head's q and k; ``mixtral`` and
  ``qwen3_moe``, Mistral's and Qwen3's blocks with a mixture of ``num_experts``
  SwiGLU experts for the MLP (`mpscale.experts`)."""
  num_kv_heads: Optional[int] = None
  """K/V heads of grouped-query attention (``null``: ``num_heads``); they divide
  ``num_heads``. Not ``gpt``."""
  head_dim: Optional[int] = None
  """Each head's width (``null``: ``d_model / num_heads``). Not ``gpt``."""
  rope_theta: float = 10000.0
  """The rotary embedding's base. Not ``gpt``."""
  rope_scaling: Optional[dict] = None
  """Llama 3.1's RoPE scaling, as its ``config.json`` writes it: ``{rope_type:
  llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
  original_max_position_embeddings: 8192}``, or ``{rope_type: linear, factor: F}``."""
  norm_eps: float = 1e-5
  """The RMSNorms' epsilon. Not ``gpt``."""
  tie_embeddings: bool = False
  """Logits from the token embedding's transpose (no head matrix)."""
  sliding_window: Optional[int] = None
  """Each query attends the latest ``sliding_window`` keys (``mistral``)."""
  init_from: Optional[str] = None
  """A Hugging Face checkpoint folder (``config.json`` and safetensors; relative to
  the config file) to start from: its ``config.json`` sets ``family`` and every
  size above but ``seq_len`` (the training length), and its weights the initial
  parameters, each read straight into the run's layout
  (`mpscale.trainer.hf`)."""
  attention: Literal["auto", "xla", "cudnn"] = "auto"
  """How attention is computed (`jax.nn.dot_product_attention`): ``cudnn``, cuDNN's
  fused (flash) attention, which needs NVIDIA GPUs, a 16-bit compute dtype and a head
  size (``d_model / num_heads``) a multiple of 8 up to 128; ``xla``, XLA's, with the
  scores in memory, anywhere; ``auto``, ``cudnn`` where it runs, else ``xla``
  (`mpscale.trainer.models.lm.attention_for`). A plan compiled for a GPU chooses as a
  run on that GPU does."""
  num_experts: int = 0
  """Routed experts of each block's MLP (``mixtral``, ``qwen3_moe``: Mixtral's
  ``num_local_experts``, Qwen3-MoE's ``num_experts``); 0 for the dense families."""
  experts_per_token: int = 2
  """Experts each token goes to (``num_experts_per_tok``), at most ``num_experts``."""
  expert_d_ff: Optional[int] = None
  """Each expert's hidden width (Qwen3-MoE's ``moe_intermediate_size``, Mixtral's
  ``intermediate_size``); ``null``: ``d_ff``."""
  router: Literal["softmax", "sigmoid"] = "softmax"
  """The router's scores: ``softmax`` (Mixtral, Qwen3-MoE) or ``sigmoid``
  (DeepSeek-V3), always computed in float32."""
  router_normalize: bool = True
  """Divide the chosen experts' weights by their sum (Mixtral always; Qwen3-MoE's
  ``norm_topk_prob``)."""
  router_bias_rate: float = 0.0
  """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
  scores that choose (not to the weights), raised by this much after each
  micro-batch for the experts that took fewer tokens than the mean and lowered for
  those that took more (0.001 in the paper; 0: no bias). The bias is model state:
  a skipped step leaves it untouched."""
  shared_d_ff: int = 0
  """The hidden width of a dense SwiGLU MLP every token goes through beside the
  routed experts (DeepSeek's shared experts, their widths summed); 0: none."""
  aux_loss_coef: float = 0.0
  """The load-balancing loss's weight in the training loss (Switch/GShard;
  transformers' ``router_aux_loss_coef``, which is off unless
  ``output_router_logits``)."""
  z_loss_coef: float = 0.0
  """The router z-loss's weight (ST-MoE's 0.001)."""
  capacity_factor: Optional[float] = None
  """``null``: dropless (every token reaches all its experts, grouped products).
  A number: each expert takes at most ``capacity_factor x tokens x
  experts_per_token / num_experts`` of a device's assignments a micro-batch and
  drops the rest (GShard), counted in the log's ``moe/dropped``."""
  context_parallel: Literal["ring", "all_gather"] = "ring"
  """With ``mesh.context`` > 1, how attention crosses the split sequence
  (`mpscale.parallel.context_attention`): ``ring``, the keys and values passed
  around the context axis a block at a time, each transfer overlapping the previous
  block's attention; ``all_gather``, gathered once a layer."""


@dataclasses.dataclass(frozen=True)
class BlendConfig:
  """One token corpus of ``data.blend`` and its weight
  (`mpscale.trainer.data.corpora`)."""
  path: str = ""
  """A Megatron indexed dataset's prefix (``<path>.bin`` + ``<path>.idx``) or a flat
  token file; relative to the config file."""
  weight: Optional[float] = None
  """Its share of the training samples, > 0 (the weights are normalized)."""
  name: Optional[str] = None
  """Names it in the log (``data/<name>``); default: the file's name."""


@dataclasses.dataclass(frozen=True)
class TokenizeConfig:
  """Tokenizing the text of ``data.path`` (or the embedded corpus) once, into a
  cache, and training on its tokens (`mpscale.trainer.data.tokenizing`)."""
  vocab_size: Optional[int] = None
  """Train a byte-level BPE of this many ids on the text; ``null``: encode with
  ``data.tokenizer``."""
  cache_dir: Optional[str] = None
  """Where the tokenized copy goes (relative to the config file); ``null``:
  ``$MPSCALE_CACHE_DIR``, else ``~/.cache/mpscale``, under ``tokens/``."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the data comes from and how it is batched (`mpscale.trainer.data.loader`)."""
  provider: Optional[str] = None
  """A user's data: ``"package.module:function"`` or ``"file.py:function"``, called
  with the `RunConfig`; it returns a random-access source of examples (dicts of
  arrays) or ``{"train": source, "eval": source}``."""
  args: dict = dataclasses.field(default_factory=dict)
  """Free-form settings for ``provider`` (it reads ``config.data.args``)."""
  shuffle: bool = True
  """Shuffle a ``provider``'s training examples with ``seed`` (anew each epoch)."""
  path: Optional[str] = None
  """A text file or a folder of them; ``null`` for the embedded corpus (docstrings of
  the Python standard library)."""
  eval_fraction: float = 0.1
  """Share of the corpus held out for evaluation, in (0, 1) (the built-in data: of
  its text; a token corpus: of its documents, the last ones, as Megatron's
  ``split``)."""
  batch_size: int = 16
  """Sequences per step (global, over all data-parallel replicas); after
  ``rampup_batch_size``'s ramp-up, if any."""
  rampup_batch_size: Optional[tuple[int, int, int]] = None
  """Megatron's ``--rampup-batch-size``, ``[start, increment, ramp_samples]``: the
  global batch starts at ``start`` rows and grows by ``increment`` over the first
  ``ramp_samples`` samples to ``batch_size`` (`mpscale.trainer.data.batch_sizes`); needs
  ``train.samples``. Every size must split over the data replicas and micro-batches
  as ``batch_size`` does; the train step compiles once per size."""
  eval_batches: int = 8
  """Batches of the held-out split per evaluation; 0 for all of it."""
  tokens: Optional[str] = None
  """A token corpus (`mpscale.trainer.data.corpora`): a Megatron indexed dataset's prefix
  (``<tokens>.bin`` + ``<tokens>.idx``) or a flat token file (nanoGPT's
  ``train.bin``), relative to the config file; exclusive with ``path``,
  ``provider`` and ``blend``."""
  blend: tuple[BlendConfig, ...] = ()
  """Several token corpora drawn by weight, Megatron's ``BlendedDataset`` rule, e.g.
  ``[{path: a, weight: 0.7}, {path: b, weight: 0.3}]``; exclusive with ``tokens``."""
  token_dtype: Optional[str] = None
  """A flat token file's dtype (``uint16``, ``uint32``, ``int32``...); ``null``:
  ``uint16``. An indexed dataset names its own: leave it ``null``."""
  eod: Optional[int] = None
  """The end-of-document token id: where a flat file's documents end, and what
  ``eod_mask_loss`` masks; ``null``: ``data.tokenizer``'s ``<|endoftext|>``, if it
  has one."""
  eod_mask_loss: bool = False
  """Do not predict the token after an end of document (Megatron's
  ``--eod-mask-loss``)."""
  reset_position_ids: bool = False
  """Add ``position_ids`` restarting after each end of document to the batches (a
  user's model may read them; the tiny LM reads none and refuses it)."""
  reset_attention_mask: bool = False
  """Add ``segment_ids`` that change after each end of document to the batches (a
  user's model may mask attention with them; the tiny LM refuses it)."""
  tokenizer: Optional[str] = None
  """A Hugging Face ``tokenizer.json``, or a checkpoint folder holding one (relative
  to the config file): ``mpscale sample``/``eval`` decode with it, and
  ``model.vocab_size`` must hold its vocabulary."""
  tokenize: Optional[TokenizeConfig] = None
  """Tokenize the text (``path``, or the embedded corpus) once into a cache and train
  on the tokens, e.g. ``{vocab_size: 1024}``; ``null``: bytes."""


UpdateRounding = Literal["nearest", "stochastic", "kahan"]
"""The values of ``precision.update_rounding``."""


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """FP8 matrix products in the tiny LM's blocks (`mpscale.fp8_dot_general`; the
  scaling state is the model state, `mpscale.trainer.models.lm.TinyLM`), or in a
  user's model, whose provider builds `mpscale.precision.fp8_flax` layers with this recipe
  (`mpscale.trainer.config.build.build_fp8`)."""
  recipe: Optional[str] = None
  """``delayed`` (scales from the amax history, Transformer Engine's
  ``DelayedScaling``), ``current`` (each tensor's own amax), ``blockwise``
  (DeepSeek-V3's 1 x 128 tiles and 128 x 128 blocks); ``null``: off."""
  history_len: int = 1024
  """Amaxes each scale's history keeps (one entry a micro-batch; under a pipeline
  (``mesh.stage > 1``) one a step: its micro-batches' amaxes are merged)."""
  margin: int = 0
  """``scale = fp8_max / amax / 2**margin``."""
  amax_compute: str = "max"
  """How delayed scaling reduces the history: ``max`` or ``most_recent``."""
  products: tuple[str, ...] = ("qkv", "out", "fc", "proj")
  """The block's products in FP8: ``qkv``, ``out`` (attention's output projection),
  ``fc`` and ``proj`` (the MLP's)."""
  bf16_layers: int = 1
  """Blocks at each end kept in the compute dtype (Megatron's
  ``--first-last-layers-bf16``); ``2 * bf16_layers < model.num_layers``. The head
  is never FP8."""


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """The precision policy (`mpscale.make_policy`)."""
  policy: str = "O0"
  """A preset (``O0``..``O3``, ``bf16``, ``bf16-pure``), a dtype, or
  ``params=..,compute=..,output=..``."""
  grad_reduce_dtype: Optional[str] = None
  """``float32``: under a 16-bit compute dtype, sum the gradients across data replicas
  and micro-batches in float32 (Megatron-LM's default; twice the bytes of a 16-bit
  all-reduce); ``null``: where XLA places the sums (`mpscale.make_train_step`)."""
  update_rounding: UpdateRounding = "nearest"
  """How updates land on 16-bit parameters (``bf16-pure``, ``O3``): ``nearest``
  (``optax.apply_updates``' own rounding), ``stochastic``
  (`mpscale.stochastic_rounding`, keyed by ``seed``) or ``kahan``
  (`mpscale.kahan_summation`: 2 more bytes a 16-bit parameter), last in the optimizer
  chain. float32 parameters are not affected."""
  fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)
  """FP8 products (``recipe: null``: off): the tiny LM's blocks, pipelined or not,
  or a user's model built with `mpscale.precision.fp8_flax`'s layers (its provider
  reads the recipe, `mpscale.trainer.config.build.build_fp8`); not a mixture's
  experts yet (``model.num_experts``)."""


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """Loss scaling (`mpscale.dynamic_loss_scale`, `fixed_loss_scale`, `no_loss_scale`)."""
  kind: Literal["dynamic", "fixed", "none"] = "none"
  """``dynamic``, ``fixed`` (a constant ``init_scale``) or ``none`` (scale 1)."""
  init_scale: Optional[float] = None
  """The first scale (dynamic) or the scale (fixed). ``null``: 2^15 for a mean loss;
  for a per-token loss (a sum over the micro-batch's tokens, whose weight gradients
  grow with them) 2^15 over the micro-batch's tokens, rounded up to a power of two
  (`mpscale.trainer.config.build.initial_scale`), so that it starts where a mean
  loss's 2^15 would and no early step overflows for it."""
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  """Consecutive finite steps before the scale grows."""
  hysteresis: int = 1
  """Overflows tolerated before a back-off (Megatron-LM)."""
  consecutive_hysteresis: bool = False
  """Refill the hysteresis on every finite step (DeepSpeed)."""
  refill_after_backoff: bool = False
  """Refill the hysteresis after each back-off: every ``hysteresis``-th overflow cuts
  the scale (TensorFlow's and Ascend's ``decr_every_n_nan_or_inf``)."""
  min_scale: float = 1.0
  max_scale: float = 16777216.0
  skip_nonfinite: bool = True
  """Fixed scale only: skip an overflowed step (else apply it anyway)."""


@dataclasses.dataclass(frozen=True)
class ClipConfig:
  """Gradient clipping by global norm, and the groups whose norms are logged."""
  max_norm: Optional[float] = 1.0
  """Clip the global norm to this; ``null`` or ``0`` for no clipping (Megatron-LM's
  ``clip_grad: 0``)."""
  groups: Optional[int] = None
  """Depth of the key paths that name the logged group norms (``null``: top level)."""


@dataclasses.dataclass(frozen=True)
class SpikesConfig:
  """Skipping loss and gradient-norm spikes (`mpscale.skip_spikes`): a step whose
  watched value exceeds the mean of the window by ``threshold`` standard deviations
  changes nothing."""
  window: int = 128
  """Accepted steps the mean and standard deviation cover; >= 2."""
  threshold: float = 6.0
  """Standard deviations above the mean that make a spike."""
  warmup: Optional[int] = None
  """Accepted steps before the check starts; ``null``: half the window."""
  watch: tuple[Literal["loss", "global_norm"], ...] = ("loss", "global_norm")
  """What to watch: ``loss``, ``global_norm`` or both (a list)."""
  reset_after: int = 16
  """Spikes in a row after which the window starts over (the level has moved)."""


@dataclasses.dataclass(frozen=True)
class SkipConfig:
  """Steps to skip beside the non-finite ones (which the loss-scale wrapper always
  skips)."""
  spikes: Optional[SpikesConfig] = None
  """``null``: off; ``{}`` for the defaults (OLMo-core's: window 128, 6 sigma)."""


@dataclasses.dataclass(frozen=True)
class CameConfig:
  """Options of `mpscale.came` (learning rate and weight decay are in `optimizer`)."""
  eps: tuple[float, float, float] = (1e-30, 1e-3, 1e-16)
  clip_threshold: float = 1.0
  decay_rate: float = 0.8
  beta1: float = 0.9
  beta2: Optional[float] = None
  beta3: float = 0.99
  scale_parameter: bool = False
  relative_step: bool = False
  warmup_init: bool = False
  compression: bool = False
  stack_layers: bool = False
  """Keep CAME's state stacked by role (`mpscale.came`'s ``stack_layers``): fewer GPU
  kernels for a user's model whose layers are separate leaves; the built-in model
  stacks its layers already."""


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  """Options of ``optax.adamw``."""
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8


@dataclasses.dataclass(frozen=True)
class AdafactorConfig:
  """Options of ``optax.adafactor``."""
  min_dim_size_to_factor: int = 32
  decay_rate: float = 0.8
  multiply_by_parameter_scale: bool = False
  clipping_threshold: Optional[float] = 1.0
  momentum: Optional[float] = None
  eps: float = 1e-30


@dataclasses.dataclass(frozen=True)
class ParamGroupConfig:
  """One parameter group (`mpscale.ParamGroup`): the parameters whose key path
  ``match`` finds, and their learning-rate multiplier and weight decay."""
  match: str = ""
  """A regular expression searched in each parameter's ``/``-joined key path (e.g.
  ``blocks/ln1/scale``); a parameter belongs to the first group that matches it."""
  lr_mult: float = 1.0
  """Multiplies the learning rate (schedule included); 0 freezes the group."""
  weight_decay: Optional[float] = None
  """The group's weight decay, applied to all its parameters (``weight_decay_mask``
  does not apply); ``null``: the default's, with its mask."""
  name: Optional[str] = None
  """Names the group in the logs (``lr/<name>``); default: ``match``."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer; only the sub-section named by ``name`` is used."""
  name: Literal["came", "adamw", "adafactor"] = "adamw"
  learning_rate: Optional[float] = 1e-3
  """Peak learning rate (see `ScheduleConfig`); ``null`` for none, which CAME with
  ``came.relative_step: true`` takes (its relative step size is the learning rate;
  ``came.warmup_init`` warms it up) and the other optimizers refuse."""
  weight_decay: float = 0.0
  """Decoupled weight decay (the start value with a weight-decay schedule)."""
  weight_decay_mask: Literal["matrices", "all"] = "matrices"
  """Decay only weight matrices (not biases, norms), or every parameter."""
  groups: tuple[ParamGroupConfig, ...] = ()
  """Parameter groups (`mpscale.param_groups`), e.g. ``[{match: "norm|bias",
  weight_decay: 0}, {match: "embed", lr_mult: 0.1}]``; the parameters none matches
  keep the settings above. A pattern that matches no parameter is an error."""
  came: CameConfig = dataclasses.field(default_factory=CameConfig)
  adamw: AdamWConfig = dataclasses.field(default_factory=AdamWConfig)
  adafactor: AdafactorConfig = dataclasses.field(default_factory=AdafactorConfig)


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """Learning-rate and weight-decay schedules (`mpscale.lr_schedule`,
  `mpscale.weight_decay_schedule`)."""
  style: Literal["constant", "linear", "cosine", "inverse_sqrt"] = "cosine"
  warmup_steps: int = 0
  warmup_fraction: Optional[float] = None
  """Warmup as a share of the steps of warmup plus decay (``decay_steps``, which
  defaults to ``train.steps``); exclusive with ``warmup_steps``."""
  decay_steps: Optional[int] = None
  """Steps of warmup plus decay; ``null``: ``train.steps``."""
  warmup_samples: Optional[int] = None
  """Warm-up counted in samples (Megatron's ``lr_warmup_samples``): the learning
  rate is then a function of the samples consumed (``consumed_samples``), as in
  Megatron's sample-based training; exclusive with ``warmup_steps`` and
  ``warmup_fraction``."""
  decay_samples: Optional[int] = None
  """Samples of warm-up plus decay (Megatron's ``lr_decay_samples``); ``null`` in a
  sample-counted schedule: ``train.samples`` (else the run's samples, ``train.steps
  x data.batch_size``); exclusive with ``decay_steps``. With ``train.samples``,
  ``warmup_samples`` or ``decay_samples`` set the schedule counts samples, and
  ``warmup_fraction`` is a share of ``decay_samples``; the weight-decay schedule
  still counts steps (``train.steps``)."""
  min_lr: float = 0.0
  weight_decay_end: Optional[float] = None
  """``null``: constant weight decay; else decay from ``optimizer.weight_decay`` to this."""
  weight_decay_style: Literal["constant", "linear", "cosine"] = "cosine"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh: ``data x fsdp x stage x tensor`` devices (see the layout table
  of docs/pipelines.md)."""
  data: int = 1
  """Data-parallel replicas: the batch is split, the parameters are replicated."""
  fsdp: int = 1
  """FSDP (ZeRO-3): the batch and every parameter and optimizer-state leaf are split;
  parameters are gathered for compute. On a count that divides no dimension of a
  parameter, it is padded (without a pipeline or a context axis); where it pads
  less, the mesh lays these devices out as two axes, ``fsdp x fsdp_transpose``,
  splitting each parameter on two dimensions
  (`mpscale.trainer.config.build.fsdp_transpose`)."""
  stage: int = 1
  """Pipeline stages: the stacked layers are split."""
  tensor: int = 1
  """Tensor parallelism: attention heads, MLP units and the vocabulary are split
  (Megatron's column- and row-parallel layers); must divide ``model.num_heads``,
  ``model.d_ff`` and ``model.vocab_size``."""
  expert: int = 1
  """Expert parallelism (``model.num_experts`` > 0): each device holds
  ``num_experts / expert`` of every block's experts, and tokens go to them and back
  by all-to-all; outside the experts ``expert`` is one more data axis (the batch
  is split over it). Must divide ``model.num_experts``."""
  context: int = 1
  """Context parallelism: every activation's sequence is split (``2 x context``
  chunks, device ``c`` holding chunks ``c`` and ``2 context - 1 - c`` so that causal
  attention's work is balanced), attention crossing the split as
  ``model.context_parallel`` says; ``model.seq_len`` must divide into the chunks."""
  virtual_stages: int = 1
  """Layer chunks per pipeline stage (Megatron's interleaved schedule, with either
  ``pipeline_schedule``): a smaller bubble, ``(stage - 1) / (virtual_stages x
  num_microbatches + stage - 1)``. Interleaved 1F1B keeps at most ``(virtual_stages +
  1) x stage - 1`` chunk inputs alive per device whatever ``num_microbatches``;
  interleaved GPipe keeps ``virtual_stages x num_microbatches``."""
  sequence_parallel: bool = False
  """With ``tensor`` > 1: layer norms and residual adds on a slice of the sequence."""
  pipeline_schedule: Literal["gpipe", "1f1b", "zb_h1"] = "gpipe"
  """Used when ``stage`` > 1: ``gpipe`` (all forwards, then all backwards), ``1f1b``
  (PipeDream-flush; interleaved as Megatron's with ``virtual_stages``) or ``zb_h1``
  (zero-bubble ZB-H1: the backward split into input and weight gradients, the
  weight gradients filling 1F1B's bubble; ``virtual_stages`` 1)."""
  pipeline_split: Optional[int] = None
  """An encoder-decoder's split (Megatron-LM's ``pipeline_model_parallel_split_rank``):
  the first ``pipeline_split`` stages run the encoder, the others the decoder. Needs
  ``stage`` > 1 and a ``model.provider`` whose loss is an `mpscale.SplitPipeline`
  with that ``split`` (it reads this key; examples/t5_split)."""
  shard_optimizer_state: bool = False
  """ZeRO-1: the optimizer state also split over the ``data`` axis."""

  @property
  def num_devices(self) -> int:
    return (self.data * self.fsdp * self.stage * self.context * self.expert
            * self.tensor)

  @property
  def shape_text(self) -> str:
    """``"2x1"``-style label: ``data x stage``, with fsdp and tensor when used."""
    parts = [f"{self.data}x{self.stage}"]
    parts += [f"fsdp{self.fsdp}"] if self.fsdp > 1 else []
    parts += [f"cp{self.context}"] if self.context > 1 else []
    parts += [f"ep{self.expert}"] if self.expert > 1 else []
    parts += [f"tp{self.tensor}"] if self.tensor > 1 else []
    parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
    return "-".join(parts)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop."""
  steps: Optional[int] = 300
  """Steps to train; derived from ``samples`` when that is set (then leave it out,
  give the same count, or ``null``: a config file's count overridden by ``--set
  train.steps=null --set train.samples=N``)."""
  samples: Optional[int] = None
  """Train on this many samples (rows of global batches; Megatron's
  ``train_samples``): the run ends at the first step whose samples reach it, and
  ``steps`` is that step count (`mpscale.trainer.data.batch_sizes.BatchSizes.steps_for`).
  Megatron-LM instead drops a partial last batch and may stop short of it."""
  num_microbatches: int = 1
  """Gradient accumulation, or the pipeline's micro-batches when ``mesh.stage`` > 1."""
  per_token_loss: bool = True
  """Divide by the token count of the whole batch rather than average micro-batches."""
  remat: bool = False
  """The older key of ``recompute: full``: ``true`` still reads as it, with a
  ``DeprecationWarning`` (and beside another ``recompute`` is refused)."""
  recompute: str = "none"
  """What the backward of the built-in model recomputes, with or without a pipeline:
  ``none`` (keep every residual of the forward; a pipeline's of each micro-batch),
  ``selective`` (keep the linear layers' outputs, recompute the rest: Megatron-LM's
  selective recomputation, MaxText's ``minimal``), ``full`` (keep each layer's
  input, recompute the layer), or one of MaxText's named policies, which keep the
  outputs of the products they name and recompute the rest: ``save_qkv_proj`` (the
  attention's query, key and value projections), ``save_out_proj`` (its output
  projection), ``save_dot_except_mlp`` (both) (`mpscale.parallel.SAVED_NAMES`), or
  one of MaxText's offloading policies, which keep them in host memory:
  ``qkv_proj_offloaded``, ``minimal_offloaded`` (`mpscale.parallel.OFFLOADED`)."""
  recompute_layers: Optional[int] = None
  """How many layers ``recompute`` acts on, the first ones: of the model, or of each
  pipeline stage (each chunk with ``mesh.virtual_stages``); the others keep every
  residual (Megatron-LM's ``recompute_num_layers`` with its ``block`` method).
  ``null``: every layer. The GPipe
  schedule only, in a pipeline; needs a ``recompute`` other than ``none``."""
  offload: tuple[str, ...] = ()
  """What lives in host memory (``pinned_host``) between steps, moved to the
  devices for each step and back (`mpscale.make_train_step`'s ``offload``):
  ``opt_state`` (the optimizer state), ``params`` (the master parameters). The
  losses are unchanged; the plan counts the bytes in host memory apart
  (``mpscale plan``)."""
  log_every: int = 10
  eval_every: int = 100
  """Evaluate every this many steps (and at the end); 0: only at the end."""
  checkpoint_every: int = 100
  """Save every this many steps (and at the end); 0: only at the end."""
  keep_checkpoints: int = 2
  hardware: Optional[str] = None
  """The hardware the run trains on, for its MFU: a built-in profile's name
  (``a100-80g``, ``h100-80g``, ``tpu-v4``) or a profile file's path, as ``mpscale
  plan --hardware`` takes (``mpscale train --hardware``; a file relative to the config
  file, as the config's other paths). ``metrics.csv``, TensorBoard, the progress bar
  and ``summary.json`` then give ``mfu``: TFLOP/s a device over the profile's peak for
  the step's compute dtype (`mpscale.trainer.runs.throughput`). Only logging reads
  it."""

  @property
  def full_recompute(self) -> bool:
    """Layers recomputed whole in the backward: ``recompute: full`` or ``remat:
    true`` (what the planner's FLOP and memory counts read, with
    `full_recompute_layers`)."""
    return self.remat or self.recompute == "full"

  def full_recompute_layers(self, layers: int) -> int:
    """How many of ``layers`` (the model's, or a pipeline stage's chunk's) are
    recomputed whole: none without `full_recompute`, else the first
    ``recompute_layers`` of them (all where it is ``null``)."""
    if not self.full_recompute:
      return 0
    return layers if self.recompute_layers is None else min(self.recompute_layers,
                                                            layers)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One training run."""
  name: str = ""
  """Names the run (and its default output folder); default: the config file's stem."""
  seed: int = 0
  """Seeds the initialization and the data order (a pure function of seed and step)."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
  loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
  clip: ClipConfig = dataclasses.field(default_factory=ClipConfig)
  skip: SkipConfig = dataclasses.field(default_factory=SkipConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)


# ------------------------------------------------------------------ YAML


class _Loader(yaml.SafeLoader):
  """SafeLoader reading YAML 1.2 floats (``1e-3``) and refusing duplicate keys."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if key in seen:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key {key!r}", key_node.start_mark)
      seen.add(key)
    return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_yaml(text: str, source: str = "<string>") -> Any:
  """``text`` parsed as YAML (1.2 floats, no duplicate keys).

  Raises:
    ConfigError: naming ``source`` for invalid YAML.
  """
  try:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
  except yaml.YAMLError as e:
    raise ConfigError(f"{source}: invalid YAML: {e}") from None


# ------------------------------------------------------------------ conversion


def _type_name(value: Any) -> str:
  return type(value).__name__


def _describe(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin in (Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  if origin is tuple:
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
      item = _describe(args[0])
      if item.startswith(("a ", "an ")):  # a list of mappings, of floats
        return "a list of " + item.split(" ", 1)[1] + "s"
      return f"a list, each {item}"
    item = _describe(args[0])
    item = item.split(" ", 1)[1] if item.startswith(("a ", "an ")) else item
    return f"a list of {len(args)} {item}s"
  if tp is type(None):
    return "null"
  if dataclasses.is_dataclass(tp) or tp is dict:
    return "a mapping"
  return {int: "an int", float: "a float", bool: "a bool", str: "a string"}.get(
      tp, str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
  """``value`` as type ``tp``, or a `ConfigError` naming ``key`` (no file yet)."""
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp):
    return _to_dataclass(tp, {} if value is None else value, key)
  if origin in (Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _convert(arg, value, key)
      except ConfigError as e:
        errors.append(e)
    if len(errors) == 1:
      raise errors[0]
    raise ConfigTypeError(f"{key}: expected {_describe(tp)}, got {value!r} "
                          f"({_type_name(value)})", (key,))
  if origin is Literal:
    choices = typing.get_args(tp)
    if value not in choices:
      cls = ConfigTypeError if not isinstance(value, str) else ConfigError
      raise cls(f"{key}: expected {_describe(tp)}, got {value!r}", (key,))
    return value
  if origin is tuple:
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
      raise ConfigTypeError(f"{key}: expected {_describe(tp)}, got {value!r} "
                            f"({_type_name(value)})", (key,))
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
      raise ConfigError(f"{key}: expected {_describe(tp)}, got {len(value)} items",
                        (key,))
    return tuple(_convert(a, v, f"{key}[{i}]")
                 for i, (a, v) in enumerate(zip(args, value)))
  if tp is dict:
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      raise ConfigTypeError(f"{key}: expected a mapping, got {value!r} "
                            f"({_type_name(value)})", (key,))
    return _deep_copy(dict(value))
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigTypeError(f"{key}: expected a bool (true/false), got {value!r} "
                            f"({_type_name(value)})", (key,))
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigTypeError(f"{key}: expected an int, got {value!r} "
                            f"({_type_name(value)})", (key,))
    return value
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigTypeError(f"{key}: expected a float, got {value!r} "
                            f"({_type_name(value)})", (key,))
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ConfigTypeError(f"{key}: expected a string, got {value!r} "
                            f"({_type_name(value)})", (key,))
    return value
  raise TypeError(f"unsupported config field type {tp!r} at {key}")  # a bug here


def read_mapping(raw: Any, prefix: str, allowed: Sequence[str],
                 required: Sequence[str] = ()) -> Mapping:
  """``raw``, checked to be a mapping of only ``allowed`` keys holding every
  ``required`` one: what every section of a config, and of a hardware profile, is.

  Args:
    raw: the parsed YAML value.
    prefix: its dotted key (``""`` at the top level); an error names ``prefix.key``.
    allowed: the keys it may hold.
    required: the keys it must hold.

  Raises:
    ConfigError: (`ConfigTypeError` for a value that is no mapping) naming the key:
      an unknown one (with the closest known key), or a missing one.
  """
  where = prefix or "the top level"
  if not isinstance(raw, Mapping):
    raise ConfigTypeError(f"{where}: expected a mapping of keys to values, got "
                          f"{raw!r} ({_type_name(raw)})", (prefix,) if prefix else ())
  dot = prefix + "." if prefix else ""
  for name in raw:
    if name not in allowed:
      close = difflib.get_close_matches(str(name), list(allowed), n=1)
      hint = (f" (did you mean {close[0]!r}?)" if close
              else f" (known keys: {', '.join(allowed)})")
      raise ConfigError(f"{dot}{name}: unknown key{hint}", (f"{dot}{name}",))
  for name in required:
    if name not in raw:
      raise ConfigError(f"{dot}{name}: missing ({where} needs {', '.join(required)})",
                        (f"{dot}{name}",))
  return raw


def _to_dataclass(cls: type, raw: Any, prefix: str) -> Any:
  hints = typing.get_type_hints(cls)
  fields = [f for f in dataclasses.fields(cls)]
  required = [f.name for f in fields if f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING]
  raw = read_mapping(raw, prefix, [f.name for f in fields], required)
  return cls(**{name: _convert(hints[name], value,
                               f"{prefix}.{name}" if prefix else str(name))
                for name, value in raw.items()})


# ------------------------------------------------------------------ reading


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
  """``"train.steps=50"`` as ``(("train", "steps"), 50)``; the value is YAML.

  Raises:
    ConfigError: for a malformed override.
  """
  key, sep, value = text.partition("=")
  parts = tuple(p.strip() for p in key.split("."))
  if not sep or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts):
    raise ConfigError(f"--set {text!r}: expected key.sub=value, e.g. train.steps=50")
  return parts, parse_yaml(value, source=f"--set {text!r}")


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]
                   ) -> tuple[dict[str, Any], set[str]]:
  """``raw`` (a parsed YAML mapping) with ``--set`` overrides applied.

  Returns:
    The new mapping, and the dotted keys that were overridden.
  """
  raw = _deep_copy(raw)
  touched = set()
  for text in overrides:
    parts, value = parse_override(text)
    node = raw
    for i, part in enumerate(parts[:-1]):
      child = node.get(part)
      if child is None:
        child = node[part] = {}
      elif not isinstance(child, dict):
        raise ConfigError(f"--set {text!r}: {'.'.join(parts[:i + 1])} is not a section")
      node = child
    node[parts[-1]] = value
    touched.add(".".join(parts))
  return raw, touched


def read_config(raw: Optional[Mapping[str, Any]], source: str = "<dict>",
                overrides: Sequence[str] = (), default_name: str = "run",
                base_dir: Optional[str] = None) -> tuple[RunConfig, set[str]]:
  """A `RunConfig` from a parsed mapping plus ``--set`` overrides, each value of its
  field's type (its value is not checked here: `mpscale.trainer.config.load.check`).

  Args:
    raw: the parsed YAML (``None`` for all defaults).
    source: names the origin in error messages, e.g. the file path.
    overrides: ``key.sub=value`` strings applied on top of ``raw``.
    default_name: the run's name when ``raw`` has none.
    base_dir: the folder a provider's ``"file.py:function"`` (and any other path:
      a checkpoint, token files, a hardware profile's file) is relative to (the
      config file's); default: the working directory. Such paths are made absolute.

  Returns:
    The frozen `RunConfig`, and the dotted keys the overrides set.

  Raises:
    ConfigError: (`ConfigTypeError` for a wrong type) naming ``source`` and the key,
      with ``(set by --set)`` for an overridden key.
  """
  raw = {} if raw is None else raw
  if not isinstance(raw, Mapping):
    raise ConfigTypeError(f"{source}: expected a mapping at the top level, got "
                          f"{_type_name(raw)}")
  try:
    raw, touched = apply_overrides(raw, overrides)
  except ConfigError as e:
    raise e.located(source) from None
  try:
    cfg = _to_dataclass(RunConfig, raw, "")
  except ConfigError as e:
    raise e.located(source, touched) from None
  if not cfg.name:
    cfg = dataclasses.replace(cfg, name=default_name)
  return _absolute_providers(_read_old_keys(cfg), base_dir), touched


def _read_old_keys(cfg: RunConfig) -> RunConfig:
  """``cfg`` with its old keys read as the new ones, each warning
  (``DeprecationWarning``): ``train.remat: true`` is ``train.recompute: full``.
  Beside another ``train.recompute`` it stays, for the check to refuse naming both
  keys."""
  train = cfg.train
  if not train.remat or train.recompute not in ("none", "full"):
    return cfg
  _deprecated.config_key("train.remat: true", "train.recompute: full")
  return dataclasses.replace(cfg, train=dataclasses.replace(train, remat=False,
                                                            recompute="full"))


def _deep_copy(x: Any) -> Any:
  if isinstance(x, Mapping):
    return {k: _deep_copy(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_deep_copy(v) for v in x]
  return x


def _absolute_file(spec: Optional[str], base_dir: Optional[str]) -> Optional[str]:
  """A ``"file.py:attribute"`` provider with the file's path made absolute (relative
  to ``base_dir``); a ``"package.module:attribute"`` one as it is."""
  if spec is None or ":" not in spec:
    return spec
  module, _, attribute = spec.rpartition(":")
  if not (module.endswith(".py") or "/" in module or os.sep in module):
    return spec
  path = os.path.join(base_dir or os.getcwd(), os.path.expanduser(module))
  return f"{os.path.abspath(path)}:{attribute}"


def _absolute_providers(cfg: RunConfig, base_dir: Optional[str]) -> RunConfig:
  model = dataclasses.replace(
      cfg.model, provider=_absolute_file(cfg.model.provider, base_dir),
      loss=_absolute_file(cfg.model.loss, base_dir),
      metrics=_absolute_file(cfg.model.metrics, base_dir))
  if model.init_from is not None:
    model = dataclasses.replace(model, init_from=os.path.abspath(os.path.join(
        base_dir or os.getcwd(), os.path.expanduser(model.init_from))))
  data = dataclasses.replace(cfg.data,
                             provider=_absolute_file(cfg.data.provider, base_dir))
  hardware = cfg.train.hardware
  if hardware is not None and (hardware.endswith((".yaml", ".yml")) or "/" in hardware
                               or os.sep in hardware):  # a profile file, not a name
    hardware = _absolute_path(hardware, base_dir)
  return dataclasses.replace(cfg, model=model, data=_absolute_token_paths(data,
                                                                          base_dir),
                             train=dataclasses.replace(cfg.train, hardware=hardware))


def _absolute_path(path: Optional[str], base_dir: Optional[str]) -> Optional[str]:
  """``path`` relative to ``base_dir`` (default: the working directory), absolute."""
  if path is None or path == "":
    return path
  return os.path.abspath(os.path.join(base_dir or os.getcwd(),
                                      os.path.expanduser(path)))


def tokenizer_file(path: Optional[str]) -> Optional[str]:
  """A tokenizer's file: ``path``, or the ``tokenizer.json`` of a folder (a Hugging
  Face checkpoint's)."""
  if path is not None and os.path.isdir(path):
    return os.path.join(path, "tokenizer.json")
  return path


def _absolute_token_paths(data: DataConfig, base_dir: Optional[str]) -> DataConfig:
  """The token corpora's, tokenizer's and cache's paths made absolute (relative to
  ``base_dir``), as the providers' are."""
  tokenize = data.tokenize
  if tokenize is not None:
    tokenize = dataclasses.replace(
        tokenize, cache_dir=_absolute_path(tokenize.cache_dir, base_dir))
  return dataclasses.replace(
      data, tokens=_absolute_path(data.tokens, base_dir),
      tokenizer=tokenizer_file(_absolute_path(data.tokenizer, base_dir)),
      tokenize=tokenize,
      blend=tuple(dataclasses.replace(b, path=_absolute_path(b.path, base_dir))
                  for b in data.blend))




def to_dict(cfg: Any) -> Any:
  """A config as plain YAML-ready data (tuples as lists)."""
  if dataclasses.is_dataclass(cfg):
    return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
  if isinstance(cfg, tuple):
    return [to_dict(v) for v in cfg]
  return cfg


def flat_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
  """A config (or `to_dict`'s mapping of one) as ``{"model.d_model": 64, ...}``: each
  value by its dotted key; a list is one value, an empty mapping (``model.args:
  {}``) none."""
  tree = to_dict(tree) if dataclasses.is_dataclass(tree) else tree
  if isinstance(tree, Mapping):
    out: dict[str, Any] = {}
    for k, v in tree.items():
      out.update(flat_keys(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def dump_config(cfg: RunConfig) -> str:
  """``cfg`` as YAML text that `load_config` reads back to an equal config."""
  return yaml.safe_dump(to_dict(cfg), sort_keys=False)
