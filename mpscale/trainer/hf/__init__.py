"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2, Qwen3, and the
mixtures of experts Mixtral and Qwen3-MoE (each expert one tensor there, the
experts stacked into ``[layers, E, ...]`` here).

- `load`: a folder with ``config.json`` and ``model.safetensors`` (or the shards a
  ``model.safetensors.index.json`` names) to a `TinyLM` of that family and its
  parameters, each read straight into its layout on a mesh when one is given (a
  process reads only the slices its devices hold);
- `save`: a `TinyLM` of those families and its parameters to a folder that
  ``transformers.AutoModelForCausalLM.from_pretrained`` reads, float32 or bfloat16,
  sharded at 5 GB;
- `model_fields`: the family and sizes of a ``config.json`` alone (what ``mpscale
  plan`` needs).

Example::

  from mpscale.trainer import hf
  model, params = hf.load("Llama-3.1-8B")
  logits = model.logits(params, tokens)     # float32 [batch, length, vocab]
  hf.save(model, params, "out", dtype="bfloat16")

Modules: `checkpoint` (load, save), `names` (``config.json`` keys and tensor
names, as tables), `tensors` (the safetensors format, read a slice at a time).

May import: ``models``.
"""

from mpscale.trainer.hf.checkpoint import (  # noqa: F401 (the room's API)
    TOKENIZER_FILES, load, load_params, model_fields, read_config, save)
from mpscale.trainer.hf.names import ARCHITECTURES, HFCheckpointError  # noqa: F401
