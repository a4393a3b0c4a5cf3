"""The safetensors format, read a slice at a time and written in shards.

A file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes (row-major). `Tensors.read` reads a
slice's rows from the file (one contiguous range) and keeps nothing mapped, so a
process loading its devices' shards of a model holds those and one slice in
flight, never the whole model.

References:
  Hugging Face, "safetensors" format, https://github.com/huggingface/safetensors
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
"""safetensors' dtype names, as NumPy (and ml_dtypes) dtypes."""
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_BYTES = 5 * 10**9
"""Hugging Face's default shard size (``max_shard_size="5GB"``)."""


class HFCheckpointError(ValueError):
  """A checkpoint mpscale cannot load as it is: the message names the key, file or
  tensor."""


class Tensors:
  """The tensors of a checkpoint folder (``model.safetensors``, or the shards a
  ``model.safetensors.index.json`` names), by name; only their headers are read
  until `read` is called."""

  def __init__(self, folder: str):
    self.folder = folder
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(folder, SINGLE)):
      files = [SINGLE]
    else:
      raise HFCheckpointError(f"{folder}: no {SINGLE} and no {INDEX}")
    self._where: dict[str, tuple[str, dict[str, Any], int]] = {}
    for name in files:
      path = os.path.join(folder, name)
      header, start = _header(path)
      for key, entry in header.items():
        if key != "__metadata__":
          self._where[key] = (path, entry, start)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return sorted(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._where[name][1]["shape"])

  def dtype(self, name: str) -> np.dtype:
    return np.dtype(DTYPES[self._where[name][1]["dtype"]])

  def get(self, name: str) -> np.ndarray:
    """The whole tensor ``name``."""
    return self.read(name, ())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """``tensor[index]`` (``index``: slices, at most one per dimension), reading
    only the rows of its first dimension that the slice takes."""
    path, entry, start = self._where[name]
    shape, dtype = tuple(entry["shape"]), np.dtype(DTYPES[entry["dtype"]])
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    rows = range(shape[0])[index[0]] if shape else range(1)
    if shape and rows.step != 1:
      raise ValueError(f"{name}: a strided slice {index[0]} is not read")
    row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
    first = rows.start if len(rows) else 0
    with open(path, "rb") as f:
      f.seek(start + entry["data_offsets"][0] + first * row * dtype.itemsize)
      data = np.fromfile(f, dtype, len(rows) * row)
    if not shape:
      return data.reshape(())
    return data.reshape((len(rows),) + shape[1:])[(slice(None),) + index[1:]]


def _header(path: str) -> tuple[dict[str, Any], int]:
  """A file's header and where its data starts."""
  with open(path, "rb") as f:
    (length,) = struct.unpack("<Q", f.read(8))
    if length > 100 * 2**20:
      raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
    return json.loads(f.read(length)), 8 + length


def write(folder: str, tensors: Iterable[tuple[str, np.ndarray]],
          shard_bytes: int = SHARD_BYTES, metadata: Mapping[str, str] = None
          ) -> list[str]:
  """Write ``(name, array)`` pairs to ``folder`` as Hugging Face does: one
  ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
  ``shard_bytes`` each (a larger tensor alone in its own) with a
  ``model.safetensors.index.json``. Returns the files written.

  The arrays are taken one at a time (an iterator of them holds one in memory).
  """
  metadata = {"format": "pt", **(metadata or {})}
  shards: list[list[tuple[str, tuple[int, ...], str, int]]] = [[]]
  sizes = [0]
  temp = []
  # First pass: each tensor to its own temporary file, so that the shards' headers
  # (which must come first) are known before any shard is written.
  for name, array in tensors:
    array = np.ascontiguousarray(array)
    if array.dtype not in NAMES:
      raise TypeError(f"{name}: dtype {array.dtype} has no safetensors name")
    if sizes[-1] and sizes[-1] + array.nbytes > shard_bytes:
      shards.append([])
      sizes.append(0)
    path = os.path.join(folder, f".{len(temp)}.part")
    array.tofile(path)
    temp.append(path)
    shards[-1].append((name, array.shape, NAMES[array.dtype], array.nbytes))
    sizes[-1] += array.nbytes
  n = len(shards)
  names = ([SINGLE] if n == 1 else
           [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
  weight_map, part = {}, 0
  for file_name, shard in zip(names, shards):
    header, offset = {"__metadata__": dict(metadata)}, 0
    for name, shape, dtype, nbytes in shard:
      header[name] = {"dtype": dtype, "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
      weight_map[name] = file_name
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(folder, file_name), "wb") as f:
      f.write(struct.pack("<Q", len(text)) + text)
      for _ in shard:
        with open(temp[part], "rb") as piece:
          while chunk := piece.read(64 * 2**20):
            f.write(chunk)
        os.remove(temp[part])
        part += 1
  if n > 1:
    with open(os.path.join(folder, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
                f, indent=2)
    names.append(INDEX)
  return names
