"""Loading and saving Hugging Face checkpoints (`mpscale.trainer.hf`)."""


from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpscale import _tree
from mpscale import parallel as parallel_lib
from mpscale.trainer.hf import names
from mpscale.trainer.hf import tensors as safetensors_lib
from mpscale.trainer.hf.names import HFCheckpointError
from mpscale.trainer.models import lm as lm_lib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")
"""The files besides the weights that `save` copies from a checkpoint folder."""

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The ``config.json`` keys `save` carries over from the model's source folder."""

_IGNORED = ("rotary_emb.inv_freq",)
"""Tensors older checkpoints carry that the model recomputes (and, with a tied
head, a copy of the embedding some carry as ``lm_head.weight``, which transformers
ignores too)."""


def read_config(path: str) -> dict[str, Any]:
  """``path``'s ``config.json`` (``path``: the folder, or the file)."""
  file = path if path.endswith(".json") else os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise HFCheckpointError(f"{path}: no config.json (a Hugging Face checkpoint "
                          f"folder holds one)")
  with open(file) as f:
    return json.load(f)


def model_fields(path: str, seq_len: Optional[int] = None) -> dict[str, Any]:
  """The `TinyLM` fields (family and sizes) of ``path``'s ``config.json``;
  ``seq_len`` the training length (default: its ``max_position_embeddings``)."""
  return names.fields(read_config(path), seq_len)


def load(path: str, *, seq_len: Optional[int] = None, dtype: Any = jnp.float32,
         mesh: Optional[jax.sharding.Mesh] = None, specs: Any = None,
         **model_kwargs: Any) -> tuple[lm_lib.TinyLM, Any]:
  """The model and parameters of a Hugging Face checkpoint folder.

  Args:
    path: a folder with ``config.json`` and ``model.safetensors`` or a
      ``model.safetensors.index.json`` and its shards.
    seq_len: the model's training length; default the checkpoint's
      ``max_position_embeddings``.
    dtype: the parameters' dtype (float32: the masters a run trains).
    mesh, specs: lay each parameter out as ``specs`` (a tree of PartitionSpecs
      like the params, e.g. ``model.param_specs(mesh)``; default that) says on
      ``mesh``, each process reading only its devices' slices; ``None``: arrays on
      the default device.
    **model_kwargs: `TinyLM`'s other fields (``remat``, ``attention``, ``shard``,
      ``fp8``...).

  Returns:
    ``(model, params)``: a `TinyLM` and its parameters (``model.logits(params,
    tokens)`` gives the float32 logits).

  Raises:
    HFCheckpointError: naming the key, file or tensor: a family mpscale does not
      have, a ``config.json`` setting that changes the math and that it does not
      compute, a missing tensor, one of the wrong shape, or one it would not use.
  """
  model = lm_lib.TinyLM(**model_fields(path, seq_len), **model_kwargs)
  return model, load_params(path, model, mesh, specs, dtype)


def load_params(path: str, model: lm_lib.TinyLM, mesh: Optional[jax.sharding.Mesh] = None,
                specs: Any = None, dtype: Any = jnp.float32) -> Any:
  """The parameters of ``model`` (a `TinyLM` of the checkpoint's family and sizes)
  read from the checkpoint folder ``path``, laid out as `load` lays them out.

  Raises:
    HFCheckpointError: as `load`.
  """
  tensors = safetensors_lib.Tensors(path)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  used = _check(model, tensors, shapes)
  ignored = _IGNORED + (("lm_head.weight",) if model.tie_embeddings else ())
  unused = [n for n in tensors.names() if n not in used and not n.endswith(ignored)]
  if unused:
    raise HFCheckpointError(f"{path}: tensor {unused[0]} is not a parameter of a "
                          f"{model.family} model of this config.json"
                          + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
  if mesh is not None and specs is None:
    specs = model.param_specs(mesh)

  def leaf(key_path, shape, spec=None):
    tensor = names.hf_tensor(model.family, _param_path(key_path))
    read = names.reader(tensors, tensor, shape.shape, np.dtype(dtype))
    if mesh is None:
      return jnp.asarray(read(tuple(slice(None) for _ in shape.shape)))
    if parallel_lib.padded_shape(shape.shape, spec, mesh) != tuple(shape.shape):
      # Split unevenly (FSDP on any device count): read whole along those
      # dimensions; the step's init stores it padded, split.
      spec = parallel_lib.make_spec([
          e if shape.shape[d] % parallel_lib.axis_size(mesh, e) == 0 else None
          for d, e in enumerate(parallel_lib.pad(spec, len(shape.shape)))])
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(shape.shape, sharding, read)

  if mesh is None:
    return jax.tree_util.tree_map_with_path(leaf, shapes)
  return jax.tree_util.tree_map_with_path(leaf, shapes, specs)


def _param_path(key_path: Any) -> tuple[str, ...]:
  """A parameter's path as its keys (``("stages", "q", "kernel")``)."""
  return tuple(_tree.path_str(key_path).split("/"))


def _check(model: lm_lib.TinyLM, tensors: Any, shapes: Any) -> set[str]:
  """The checkpoint's tensor names the model's parameters read, each checked to be
  there with its shape."""
  used = set()
  for key_path, shape in jax.tree_util.tree_leaves_with_path(shapes):
    tensor = names.hf_tensor(model.family, _param_path(key_path))
    want = shape.shape[tensor.stacked:]
    for _, name in tensor.parts(shape.shape):
      if name not in tensors:
        raise HFCheckpointError(f"{tensors.folder}: tensor {name} is missing")
      expected = tuple(reversed(want)) if tensor.transposed else tuple(want)
      if tensors.shape(name) != expected:
        raise HFCheckpointError(f"{tensors.folder}: tensor {name} has shape "
                              f"{list(tensors.shape(name))}; config.json makes it "
                              f"{list(expected)}")
      used.add(name)
  return used


def save(model: lm_lib.TinyLM, params: Any, path: str, *, dtype: str = "float32",
         source: Optional[str] = None,
         shard_bytes: int = safetensors_lib.SHARD_BYTES) -> list[str]:
  """Write ``model`` and ``params`` as a Hugging Face checkpoint folder.

  Args:
    model: a `TinyLM` of a family in `ARCHITECTURES`.
    params: its parameters (any dtype or layout; each leaf is fetched to the host
      in turn).
    path: the folder to write; it must not hold a checkpoint already.
    dtype: ``float32`` or ``bfloat16``, the stored weights' dtype.
    source: the checkpoint folder the model came from (``model.init_from``): its
      tokenizer files (`TOKENIZER_FILES`) are copied, and its ``config.json``'s
      token ids (`TOKEN_IDS`) carried over.
    shard_bytes: the largest shard (Hugging Face's 5 GB by default).

  Returns:
    The files written.

  Raises:
    HFCheckpointError: for a family with no Hugging Face form (``gpt``), a ``dtype``
      other than those two, or a folder that holds a checkpoint; nothing is
      written.
  """
  if dtype not in ("float32", "bfloat16"):
    raise HFCheckpointError(f"dtype {dtype!r}: choose float32 or bfloat16")
  config = names.config_of(model, dtype)
  if source and os.path.exists(os.path.join(source, "config.json")):
    config.update({k: v for k, v in read_config(source).items() if k in TOKEN_IDS})
  if os.path.exists(os.path.join(path, "config.json")):
    raise HFCheckpointError(f"{path} holds a checkpoint already; choose a new folder")
  store = np.dtype(jnp.bfloat16 if dtype == "bfloat16" else np.float32)

  def arrays():
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
      tensor = names.hf_tensor(model.family, _param_path(key_path))
      array = np.asarray(jax.device_get(leaf))
      for index, name in tensor.parts(array.shape):
        part = array[index]
        yield name, (part.T if tensor.transposed else part).astype(store)

  os.makedirs(path, exist_ok=True)
  written = safetensors_lib.write(path, arrays(), shard_bytes)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  written.append("config.json")
  for name in TOKENIZER_FILES if source else ():
    if os.path.exists(os.path.join(source, name)):
      shutil.copy(os.path.join(source, name), os.path.join(path, name))
      written.append(name)
  return written
