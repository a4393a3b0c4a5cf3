"""Hugging Face's names for the built-in LM's families: ``config.json`` keys to
`TinyLM` fields and back, and checkpoint tensor names to parameter paths.

A block's parameters are stacked over the layers (``params["stages"]``, leading
axis ``layers``) and a mixture's experts over the experts (``[layers, E, ...]``);
a checkpoint holds one tensor a layer, and an expert: `HFTensor` names them with
``{layer}`` and ``{expert}`` in the name, and load, check and save go over those
indices alike (`HFTensor.parts`).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from mpscale.trainer.hf.tensors import HFCheckpointError
from mpscale.trainer.models import families
from mpscale.trainer.models import lm as lm_lib

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""The families Hugging Face checkpoints come in (``model_type``), and the class
``transformers`` reads each with."""

SIZES = {"vocab_size": "vocab_size", "hidden_size": "d_model",
         "num_attention_heads": "num_heads", "num_hidden_layers": "num_layers",
         "intermediate_size": "d_ff"}
"""``config.json``'s required sizes, and the `TinyLM` field each sets."""

OPTIONAL = {"num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps",
            "tie_word_embeddings": "tie_embeddings", "initializer_range": "init_std",
            "rope_scaling": "rope_scaling", "sliding_window": "sliding_window"}
"""``config.json``'s optional keys, and the `TinyLM` field each sets."""

EXPERTS = {
    "mixtral": {"num_local_experts": "num_experts",
                "num_experts_per_tok": "experts_per_token",
                "intermediate_size": "expert_d_ff"},
    "qwen3_moe": {"num_experts": "num_experts",
                  "num_experts_per_tok": "experts_per_token",
                  "moe_intermediate_size": "expert_d_ff"}}
"""A mixture's required ``config.json`` sizes, by family, and the `TinyLM` field
each sets (Mixtral's ``intermediate_size`` sets ``d_ff`` too: `SIZES`)."""

EXPERTS_OPTIONAL = {"mixtral": {}, "qwen3_moe": {"norm_topk_prob": "router_normalize"}}
"""A mixture's optional keys, by family, and the `TinyLM` field each sets."""

ABSENT = {"norm_topk_prob": False}
"""What transformers makes of a key ``config.json`` leaves out, where that is not
`TinyLM`'s default (Qwen3-MoE's router does not renormalize unless told to)."""

EXPERTS_FIXED = {
    "mixtral": {"router": "softmax", "router_normalize": True, "shared_d_ff": 0,
                "router_bias_rate": 0.0},
    "qwen3_moe": {"router": "softmax", "shared_d_ff": 0, "router_bias_rate": 0.0}}
"""The `TinyLM` fields a family's transformers class has no key for, at the
value it computes: `config_of` refuses a model at another, naming the field (a
balancing bias is model state no tensor of the checkpoint holds)."""

WRITTEN = {"llama": {"attention_bias": False}, "mistral": {},
           "qwen2": {"use_sliding_window": False},
           "qwen3": {"attention_bias": False, "use_sliding_window": False},
           "mixtral": {"router_jitter_noise": 0.0},
           "qwen3_moe": {"attention_bias": False, "use_sliding_window": False,
                         "decoder_sparse_step": 1, "mlp_only_layers": []}}
"""The `NEUTRAL` keys `config_of` writes for each family, at what mpscale
computes (a reader need not know transformers' defaults)."""

RESOLVED = {"num_kv_heads": "kv_heads", "head_dim": "dims_per_head",
            "expert_d_ff": "expert_width"}
"""The `TinyLM` property `config_of` writes for a field whose ``None`` means
another field's value (``config.json`` states it)."""

NEUTRAL = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
           "attention_dropout": (0, 0.0), "use_sliding_window": (False,),
           "partial_rotary_factor": (1, 1.0), "layer_types": None,
           "router_jitter_noise": (0, 0.0), "decoder_sparse_step": (1,),
           "mlp_only_layers": ([],)}
"""Keys that change the math: the values mpscale computes (any other is refused,
naming the key, and `WHY` it changes it where that is not plain). ``layer_types``
must name ``full_attention`` only."""

WHY = {"router_jitter_noise": "Mixtral's router multiplies its input by noise "
                              "while training; mpscale's router has none",
       "decoder_sparse_step": "every decoder_sparse_step-th layer only is a mixture, "
                              "the others dense MLPs; mpscale's blocks are all "
                              "mixtures (1)",
       "mlp_only_layers": "these layers are dense MLPs among the mixtures; "
                          "mpscale's blocks are all mixtures ([])"}
"""Why a `NEUTRAL` key at another value is refused, where the key alone does not
say."""

ROUTER_LOSS = ("router_aux_loss_coef", "output_router_logits")
"""A mixture's load-balancing loss: its weight, and whether transformers adds it
(to the loss of ``labels``) at all; `aux_loss_coef` reads them."""

INFORMATIONAL = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
    "max_position_embeddings", "pretraining_tp", "_name_or_path", "max_window_layers",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "use_bfloat16", "tokenizer_class", "quantization_config"}
"""Keys that do not change what the model computes (``quantization_config`` is
refused when present: see `fields`)."""

LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
         "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
         "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
         "k_norm": "self_attn.k_norm", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
         "down": "mlp.down_proj"}
"""A Llama block's modules (`mpscale.trainer.models.lm.LlamaBlock`) and Hugging
Face's names for them under ``model.layers.<i>``."""

EXPERT_LAYER = {
    "mixtral": {"router": "block_sparse_moe.gate",
                "gate": "block_sparse_moe.experts.{expert}.w1",
                "up": "block_sparse_moe.experts.{expert}.w3",
                "down": "block_sparse_moe.experts.{expert}.w2"},
    "qwen3_moe": {"router": "mlp.gate", "gate": "mlp.experts.{expert}.gate_proj",
                  "up": "mlp.experts.{expert}.up_proj",
                  "down": "mlp.experts.{expert}.down_proj"}}
"""A mixture's weights (``params["stages"]["moe"]``, `mpscale.experts.MoeMLP`:
``router`` ``[d, E]``, ``gate``, ``up`` ``[E, d, f]``, ``down`` ``[E, f, d]``) and
Hugging Face's names for them under ``model.layers.<i>``, by family: one
``Linear`` (``[out, in]``) an expert."""


def fields(config: dict[str, Any], seq_len: Optional[int] = None) -> dict[str, Any]:
  """`TinyLM`'s fields of a ``config.json`` (``seq_len``: the training length;
  default its ``max_position_embeddings``).

  Raises:
    HFCheckpointError: naming ``model_type`` for a family mpscale does not have, a
      size key that is missing, or a key that changes the math at a value mpscale
      does not compute (or that it does not know).
  """
  family = config.get("model_type")
  if family not in ARCHITECTURES:
    raise HFCheckpointError(f"config.json: model_type {family!r} is not a family "
                          f"mpscale has; it loads {', '.join(ARCHITECTURES)}")
  if config.get("quantization_config") is not None:
    raise HFCheckpointError("config.json: quantization_config: a quantized checkpoint; "
                          "mpscale loads floating-point weights only")
  out: dict[str, Any] = {"family": family}
  for key, name in [*SIZES.items(), *EXPERTS.get(family, {}).items()]:
    if key not in config:
      raise HFCheckpointError(f"config.json: {key} is missing")
    out[name] = int(config[key])
  optional = {**OPTIONAL, **EXPERTS_OPTIONAL.get(family, {})}
  for key, name in optional.items():
    value = config.get(key, ABSENT.get(key))
    if value is not None:
      out[name] = value
  if not families.TRAITS[family].sliding_window:
    out.pop("sliding_window", None)  # Qwen's is off unless use_sliding_window
  if family in EXPERTS:
    out["aux_loss_coef"] = aux_loss_coef(config)
  _check_neutral(config)
  known = {*SIZES, *optional, *NEUTRAL, *INFORMATIONAL, *EXPERTS.get(family, ()),
           *(ROUTER_LOSS if family in EXPERTS else ())}
  unknown = sorted(set(config) - known)
  if unknown:
    raise HFCheckpointError(f"config.json: {', '.join(unknown)}: not a key mpscale "
                          f"knows, and it may change the model's math; remove it if "
                          f"it does not")
  try:
    out["rope_scaling"] = families.RopeScaling.from_dict(out.get("rope_scaling"))
  except ValueError as e:
    raise HFCheckpointError(f"config.json: {e}") from None
  if out.get("head_dim") == out["d_model"] // out["num_heads"]:
    out.pop("head_dim")
  out["seq_len"] = int(seq_len or config.get("max_position_embeddings") or 2048)
  return out


def _check_neutral(config: dict[str, Any]) -> None:
  """Refuses a `NEUTRAL` key at a value mpscale does not compute, naming it."""
  for key, values in NEUTRAL.items():
    if key not in config or config[key] is None:
      continue
    ok = (all(t == "full_attention" for t in config[key]) if values is None
          else config[key] in values)
    if not ok:
      raise HFCheckpointError(
          f"config.json: {key} = {config[key]!r} changes the model's math in a way "
          f"mpscale does not compute" + (f": {WHY[key]}" if key in WHY else ""))


def aux_loss_coef(config: dict[str, Any]) -> float:
  """The load-balancing loss's weight of a mixture's ``config.json``, as
  transformers applies it: ``router_aux_loss_coef`` (its default 0.001) when
  ``output_router_logits`` is true, else 0 (transformers computes no such loss
  then). `config_of` writes it back the same way (with the loss off,
  ``output_router_logits`` false and transformers' default weight), so a round
  trip keeps it.

  What it weighs differs in one respect: transformers' loss is one product of
  means over every layer's tokens together, mpscale's (`TinyLM.aux_loss_coef`)
  the mean of each block's own; they agree for one layer, and for layers routed
  alike."""
  if not config.get("output_router_logits"):
    return 0.0
  return float(config.get("router_aux_loss_coef", 0.001))


def config_of(model: lm_lib.TinyLM, dtype: str) -> dict[str, Any]:
  """The ``config.json`` of ``model`` (its weights stored in ``dtype``).

  Raises:
    HFCheckpointError: for a family with no Hugging Face form, or a mixture with a
      setting its family's transformers class does not compute (`EXPERTS_FIXED`),
      naming the field.
  """
  if model.family not in ARCHITECTURES:
    raise HFCheckpointError(f"model.family {model.family!r} has no Hugging Face form "
                          f"here; {', '.join(ARCHITECTURES)} do")
  for name, value in EXPERTS_FIXED.get(model.family, {}).items():
    if getattr(model, name) != value:
      raise HFCheckpointError(
          f"model.{name} = {getattr(model, name)!r}: transformers' "
          f"{ARCHITECTURES[model.family]} computes {name} {value!r} only; a "
          f"{model.family} checkpoint cannot hold this model")
  config = {"architectures": [ARCHITECTURES[model.family]],
            "model_type": model.family, "hidden_act": "silu",
            "torch_dtype": dtype, "max_position_embeddings": model.seq_len}
  sizes = {**SIZES, **OPTIONAL, **EXPERTS.get(model.family, {}),
           **EXPERTS_OPTIONAL.get(model.family, {})}
  for key, name in sizes.items():
    config[key] = getattr(model, RESOLVED.get(name, name))
  if model.rope_scaling is not None:
    config["rope_scaling"] = model.rope_scaling.to_dict()
  if model.family in EXPERTS:
    config["output_router_logits"] = model.aux_loss_coef > 0
    config["router_aux_loss_coef"] = model.aux_loss_coef or 0.001
  config.update(WRITTEN[model.family])
  return config


class HFTensor(NamedTuple):
  """Where a parameter lies in a Hugging Face checkpoint."""
  name: str
  """Its tensors' name; with ``{layer}`` (and ``{expert}``) in it, one tensor a
  layer (and an expert) of a parameter stacked over them (its leading axes)."""
  transposed: bool
  """Whether its matrices are stored transposed (``[out, in]``, PyTorch's
  ``Linear``)."""

  @property
  def stacked(self) -> int:
    """How many of the parameter's leading axes index its tensors (0, 1: layers,
    2: layers and experts)."""
    return self.name.count("{")

  def at(self, index: tuple[int, ...]) -> str:
    """The name of the tensor at ``index`` (a layer, and an expert)."""
    return self.name.format(**dict(zip(("layer", "expert"), index)))

  def parts(self, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
    """``(index, name)`` of each tensor of a parameter of ``shape``."""
    for index in itertools.product(*map(range, shape[:self.stacked])):
      yield index, self.at(index)


def hf_tensor(family: str, path: tuple[str, ...]) -> HFTensor:
  """Where the parameter at ``path`` of a ``family`` model lies in a Hugging Face
  checkpoint (`LAYER`, `EXPERT_LAYER`)."""
  if path == ("embed", "token"):
    return HFTensor("model.embed_tokens.weight", False)
  if path == ("head", "norm", "scale"):
    return HFTensor("model.norm.weight", False)
  if path == ("head", "out", "kernel"):
    return HFTensor("lm_head.weight", True)
  layer = "model.layers.{layer}."
  if path[0] == "stages" and len(path) == 3 and path[1] in LAYER:
    kind = {"kernel": "weight", "bias": "bias", "scale": "weight"}[path[2]]
    return HFTensor(f"{layer}{LAYER[path[1]]}.{kind}", path[2] == "kernel")
  experts = EXPERT_LAYER.get(family, {})
  if path[:2] == ("stages", "moe") and len(path) == 3 and path[2] in experts:
    return HFTensor(f"{layer}{experts[path[2]]}.weight", True)
  raise HFCheckpointError(f"parameter {'/'.join(path)} has no Hugging Face name")


def reader(tensors: Any, tensor: HFTensor, shape: tuple[int, ...],
           dtype: Any) -> Callable[[tuple[slice, ...]], np.ndarray]:
  """``read(index) -> array``: the slice ``index`` (a tuple of slices of ``shape``)
  of the parameter stored as ``tensor`` in ``tensors`` (`tensors.Tensors`), in
  ``dtype``, reading only that slice of each of its layers' (and experts')
  tensors."""
  stacked = tensor.stacked

  def one(name: str, index: tuple[slice, ...]) -> np.ndarray:
    if tensor.transposed:
      return tensors.read(name, (index[1], index[0])).T.astype(dtype, copy=False)
    return tensors.read(name, index).astype(dtype, copy=False)

  def read(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index)
    taken = [range(n)[i] for n, i in zip(shape, index)]
    out = np.empty(tuple(map(len, taken)), dtype)
    for at in itertools.product(*map(range, out.shape[:stacked])):
      picked = tuple(r[i] for r, i in zip(taken, at))
      out[at] = one(tensor.at(picked), index[stacked:])
    return out
  return read
