"""Hugging Face's names for the built-in LM's families: ``config.json`` keys to
`TinyLM` fields and back, and checkpoint tensor names to parameter paths."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from mpscale.trainer.hf.tensors import HFCheckpointError
from mpscale.trainer.models import families
from mpscale.trainer.models import lm as lm_lib

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
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

NEUTRAL = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
           "attention_dropout": (0, 0.0), "use_sliding_window": (False,),
           "partial_rotary_factor": (1, 1.0), "layer_types": None}
"""Keys that change the math: the values mpscale computes (any other is refused,
naming the key). ``layer_types`` must name ``full_attention`` only."""

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
  for key, name in SIZES.items():
    if key not in config:
      raise HFCheckpointError(f"config.json: {key} is missing")
    out[name] = int(config[key])
  for key, name in OPTIONAL.items():
    if config.get(key) is not None:
      out[name] = config[key]
  if family != "mistral":  # Qwen's sliding_window is off unless use_sliding_window
    out.pop("sliding_window", None)
  for key, values in NEUTRAL.items():
    if key not in config or config[key] is None:
      continue
    ok = (all(t == "full_attention" for t in config[key]) if values is None
          else config[key] in values)
    if not ok:
      raise HFCheckpointError(f"config.json: {key} = {config[key]!r} changes the "
                            f"model's math in a way mpscale does not compute")
  known = set(SIZES) | set(OPTIONAL) | set(NEUTRAL) | INFORMATIONAL
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


def config_of(model: lm_lib.TinyLM, dtype: str) -> dict[str, Any]:
  """The ``config.json`` of ``model`` (its weights stored in ``dtype``)."""
  if model.family not in ARCHITECTURES:
    raise HFCheckpointError(f"model.family {model.family!r} has no Hugging Face form "
                          f"here; {', '.join(ARCHITECTURES)} do")
  config = {"architectures": [ARCHITECTURES[model.family]],
            "model_type": model.family, "hidden_act": "silu",
            "torch_dtype": dtype, "max_position_embeddings": model.seq_len}
  for key, name in {**SIZES, **OPTIONAL}.items():
    config[key] = getattr(model, name)
  config["num_key_value_heads"] = model.kv_heads
  config["head_dim"] = model.dims_per_head
  if model.rope_scaling is not None:
    config["rope_scaling"] = model.rope_scaling.to_dict()
  if model.family in ("llama", "qwen3"):
    config["attention_bias"] = False
  if model.family in ("qwen2", "qwen3"):
    config["use_sliding_window"] = False
  return config


def hf_name(path: tuple[str, ...], layer: Optional[int] = None) -> tuple[str, bool]:
  """Hugging Face's name of the parameter at ``path`` (of ``layer`` for a block's),
  and whether its matrix is stored transposed (``[out, in]``, PyTorch's
  ``Linear``)."""
  if path == ("embed", "token"):
    return "model.embed_tokens.weight", False
  if path == ("head", "norm", "scale"):
    return "model.norm.weight", False
  if path == ("head", "out", "kernel"):
    return "lm_head.weight", True
  if path[0] == "stages" and len(path) == 3 and path[1] in LAYER:
    kind = {"kernel": "weight", "bias": "bias", "scale": "weight"}[path[2]]
    return f"model.layers.{layer}.{LAYER[path[1]]}.{kind}", path[2] == "kernel"
  raise HFCheckpointError(f"parameter {'/'.join(path)} has no Hugging Face name")


def reader(tensors: Any, path: tuple[str, ...], shape: tuple[int, ...],
           dtype: Any) -> Callable[[tuple[slice, ...]], np.ndarray]:
  """``read(index) -> array``: the slice ``index`` (a tuple of slices of ``shape``)
  of the parameter at ``path`` from ``tensors`` (`tensors.Tensors`), in
  ``dtype``, reading only that slice (a block's are stacked over layers)."""
  def one(name: str, transposed: bool, index: tuple[slice, ...]) -> np.ndarray:
    if transposed:
      return tensors.read(name, (index[1], index[0])).T.astype(dtype, copy=False)
    return tensors.read(name, index).astype(dtype, copy=False)

  if path[0] != "stages":
    name, transposed = hf_name(path)
    return lambda index: one(name, transposed, tuple(index))

  def read(index: tuple[slice, ...]) -> np.ndarray:
    layers = range(shape[0])[index[0]]
    parts = [one(*hf_name(path, layer), tuple(index[1:])) for layer in layers]
    return np.stack(parts) if parts else np.zeros(
        (0,) + tuple(len(range(n)[i]) for n, i in zip(shape[1:], index[1:])), dtype)
  return read
