"""Token corpora on disk: Megatron's indexed dataset format and flat token files.

A **corpus** is what `mpscale.trainer.data.token_datasets.GPTSamples` cuts samples from: numbered
sequences of token ids (one per document here), memory-mapped, with

- ``len(corpus)``, the number of sequences, and ``sequence_lengths`` (int32);
- ``get(i, offset=0, length=None)``, part of sequence ``i`` as a read-only array;
- ``path``, where its files are (the sample index is cached beside them).

Two readers present it: `IndexedDataset` (Megatron-LM's ``<prefix>.bin`` +
``<prefix>.idx``) and `FlatTokens` (one file of raw token ids, nanoGPT's ``train.bin``,
cut into documents after each end-of-document token). `open_corpus` picks one for a
path.

**The indexed format** (Megatron-Core's ``IndexedDataset``, byte for byte). The
``.bin`` file holds every sequence's tokens back to back, in the dataset's dtype,
little-endian, with no header. The ``.idx`` file is, in order (all little-endian)::

  b"MMIDIDX\\x00\\x00"          9 bytes, the magic
  version                      uint64, always 1
  dtype code                   uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                               6 float64, 7 float32, 8 uint16
  sequence count S             uint64
  document count D             uint64 (the number of documents + 1)
  sequence lengths             S x int32, in tokens
  sequence pointers            S x int64, byte offsets into the .bin (the running sum
                               of the lengths times the dtype's size)
  document indices             D x int64: 0, then after each document the number of
                               sequences written so far (document d is the sequences
                               document_indices[d] .. document_indices[d + 1] - 1)
  sequence modes (optional)    S x int8, only in multimodal datasets

The format does not say whether the modes are there; Megatron's reader is told
(``multimodal=True``), this one reads it from the size of the file. The token dtype
is chosen by the vocabulary size as Megatron's ``preprocess_data.py`` does
(`token_dtype`: ``uint16`` below 65,500 ids, else ``int32``); there is no code for
``uint32``.

**Flat token files** hold nothing but the tokens. A document ends with (and includes)
its end-of-document token ``eod``, as when a tokenizer appends one to each document
(nanoGPT writes GPT-2's ``<|endoftext|>``, 50256, after each); tokens after the last
``eod`` form a last document. Without ``eod`` the file is one document. A document
longer than 2**31 - 1 tokens is cut there (sequence lengths are int32, as in the
indexed format); it changes nothing but the unit the document order is shuffled in.

References:
  Megatron-Core, ``megatron/core/datasets/indexed_dataset.py`` (``_IndexWriter``,
  ``_IndexReader``, ``IndexedDatasetBuilder``, ``DType``):
  https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/datasets/indexed_dataset.py
  Megatron-LM, ``tools/preprocess_data.py`` (one sequence per document with
  ``--append-eod``; the dtype by vocabulary size).
  nanoGPT, ``data/openwebtext/prepare.py`` (``train.bin``: uint16 tokens, an
  end-of-text token after each document).
"""

from __future__ import annotations

import operator
import os
import struct
from typing import Any, Iterable, Optional, Union

import numpy as np

from mpscale import validation

Path = Union[str, os.PathLike]

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The magic that starts every ``.idx`` file."""

INDEX_VERSION = 1
"""The only version of the ``.idx`` layout."""

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
    4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.float64),
    7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
"""Megatron-Core's ``DType`` codes: the byte in the ``.idx`` header that names the
token dtype of the ``.bin``."""

_CODES = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, code, S, D
_MAX_SEQUENCE = 2**31 - 1  # sequence lengths are int32
_SCAN_TOKENS = 1 << 24  # FlatTokens looks for end-of-document tokens in chunks of this


def token_dtype(vocab_size: int) -> np.dtype:
  """The dtype Megatron stores tokens of a vocabulary of ``vocab_size`` ids in:
  ``uint16`` below 65,500, else ``int32`` (``DType.optimal_dtype``)."""
  vocab_size = validation.positive_int("vocab_size", vocab_size)
  return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def index_file(prefix: Path) -> str:
  """``<prefix>.idx``."""
  return os.fspath(prefix) + ".idx"


def data_file(prefix: Path) -> str:
  """``<prefix>.bin``."""
  return os.fspath(prefix) + ".bin"


def _token_dtype_arg(name: str, dtype: Any, *, writable: bool) -> np.dtype:
  """``dtype`` as a NumPy integer dtype (one Megatron has a code for if
  ``writable``)."""
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise validation.fail(name, f" must be a NumPy integer dtype; got {dtype!r}",
                          validation.ArgumentTypeError) from None
  if not np.issubdtype(dtype, np.integer):
    raise validation.fail(name, f" must be an integer dtype (token ids); got {dtype}",
                          validation.ArgumentTypeError)
  if writable and dtype.newbyteorder("=") not in _CODES:
    raise validation.fail(
        name, f" {dtype} has no code in Megatron's indexed format; use uint16 (a "
        "vocabulary below 65,500 ids), int32, or one of uint8, int8, int16, int64")
  return dtype.newbyteorder("<")


def _check_tokens(tokens: Any, dtype: np.dtype) -> np.ndarray:
  """``tokens`` as a 1-D array of ``dtype``, every id representable in it."""
  array = np.asarray(tokens)
  if array.ndim != 1:
    raise validation.fail("tokens", f" must be 1-D; got shape {array.shape}")
  if array.size == 0:
    return array.astype(dtype)
  if not np.issubdtype(array.dtype, np.integer):
    raise validation.fail("tokens", f" must be integer token ids; got {array.dtype}",
                          validation.ArgumentTypeError)
  info = np.iinfo(dtype)
  low, high = int(array.min()), int(array.max())
  if low < info.min or high > info.max:
    bad = low if low < info.min else high
    raise validation.fail("tokens", f": id {bad} does not fit the dataset's dtype "
                          f"{dtype.newbyteorder('=')} [{info.min}, {info.max}]")
  return array.astype(dtype, copy=False)


def _mmap(path: str) -> np.ndarray:
  """The bytes of ``path``, memory-mapped read-only (an empty array for an empty
  file, which cannot be mapped)."""
  if os.path.getsize(path) == 0:
    return np.zeros(0, np.uint8)
  return np.memmap(path, dtype=np.uint8, mode="r")


def _read_bytes(data: np.ndarray, dtype: np.dtype, start: int, length: int
                ) -> np.ndarray:
  """``length`` items of ``dtype`` at byte ``start`` of ``data``, read-only."""
  if not length:
    return np.zeros(0, dtype)
  return np.frombuffer(data, dtype=dtype, count=length, offset=start)


def _part(name: str, size: int, offset: Any, length: Any) -> tuple[int, int]:
  """``(offset, length)`` checked against a sequence of ``size`` tokens."""
  offset = validation.integer("offset", offset, 0)
  length = size - offset if length is None else validation.integer("length", length, 0)
  if offset + length > size:
    raise IndexError(f"{name}: tokens [{offset}, {offset + length}) past its end "
                     f"({size} tokens)")
  return offset, length


def _index(i: Any, n: int) -> int:
  i = operator.index(i)
  if not -n <= i < n:
    raise IndexError(f"sequence {i} out of range for {n} sequences")
  return i % n


class IndexedDatasetWriter:
  """Writes a Megatron indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``).

  The same bytes as Megatron-Core's ``IndexedDatasetBuilder(bin, dtype)`` given the
  same ``add_document`` calls and then ``finalize(idx)``. Tokens stream to the
  ``.bin`` as they come; the ``.idx`` is written by `finalize`. As a context manager
  it finalizes on a clean exit and removes the partial ``.bin`` on an exception.

  Args:
    prefix: the path without ``.bin``/``.idx``; its folder must exist.
    dtype: the token dtype (`token_dtype` of the vocabulary size): one of the integer
      types Megatron has a code for.
    multimodal: also write a mode (int8) per sequence.

  Example:
    >>> import os, tempfile
    >>> from mpscale.trainer.data.token_files import (IndexedDataset,
    ...                                          IndexedDatasetWriter, token_dtype)
    >>> prefix = os.path.join(tempfile.mkdtemp(), "corpus")
    >>> with IndexedDatasetWriter(prefix, token_dtype(50257)) as writer:
    ...   writer.add_document([464, 3290, 50256])
    ...   writer.add_document([40, 50256])
    >>> IndexedDataset(prefix)[1].tolist()
    [40, 50256]
  """

  def __init__(self, prefix: Path, dtype: Any, *, multimodal: bool = False):
    self.prefix = os.fspath(prefix)
    self.dtype = _token_dtype_arg("dtype", dtype, writable=True)
    self.multimodal = validation.boolean("multimodal", multimodal)
    folder = os.path.dirname(self.prefix) or "."
    if not os.path.isdir(folder):
      raise validation.fail("prefix", f": no folder {folder!r} to write into")
    self.sequence_lengths: list[int] = []
    self.sequence_modes: Optional[list[int]] = [] if self.multimodal else None
    self.document_indices: list[int] = [0]
    self._bin = open(data_file(self.prefix), "wb")

  def add_document(self, tokens: Any, lengths: Optional[Iterable[int]] = None,
                   modes: Optional[Iterable[int]] = None) -> None:
    """Appends a document: ``tokens`` (1-D integer ids), one sequence, or several
    of ``lengths`` (summing to ``len(tokens)``), with ``modes`` if multimodal (default
    0 each).

    Raises:
      ValueError: naming ``tokens`` (an id the dtype cannot hold), ``lengths`` or
        ``modes``.
    """
    if self._bin.closed:
      raise validation.fail("add_document", ": the writer is finalized")
    array = _check_tokens(tokens, self.dtype)
    lengths = [len(array)] if lengths is None else [int(n) for n in lengths]
    if any(n < 0 or n > _MAX_SEQUENCE for n in lengths) or sum(lengths) != len(array):
      raise validation.fail("lengths", f" must be sequence lengths summing to the "
                            f"{len(array)} tokens; got {lengths}")
    if modes is not None and not self.multimodal:
      raise validation.fail("modes", " are for a multimodal writer "
                            "(multimodal=True)")
    if self.sequence_modes is not None:
      modes = [0] * len(lengths) if modes is None else [int(m) for m in modes]
      if len(modes) != len(lengths) or not all(-128 <= m < 128 for m in modes):
        raise validation.fail("modes", f" must be one int8 per sequence "
                              f"({len(lengths)}); got {modes}")
      self.sequence_modes.extend(modes)
    self._bin.write(array.tobytes(order="C"))
    self.sequence_lengths.extend(lengths)
    self.document_indices.append(len(self.sequence_lengths))

  def finalize(self) -> None:
    """Closes the ``.bin`` and writes the ``.idx``."""
    self._bin.close()
    lengths = np.asarray(self.sequence_lengths, np.int64)
    pointers = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
    with open(index_file(self.prefix), "wb") as f:
      f.write(INDEX_HEADER)
      f.write(struct.pack("<Q", INDEX_VERSION))
      f.write(struct.pack("<B", _CODES[self.dtype.newbyteorder("=")]))
      f.write(struct.pack("<Q", len(lengths)))
      f.write(struct.pack("<Q", len(self.document_indices)))
      f.write(lengths.astype("<i4").tobytes())
      f.write(pointers.astype("<i8").tobytes())
      f.write(np.asarray(self.document_indices, "<i8").tobytes())
      if self.sequence_modes is not None:
        f.write(np.asarray(self.sequence_modes, np.int8).tobytes())

  def __enter__(self) -> "IndexedDatasetWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.finalize()
    else:
      self._bin.close()
      os.remove(data_file(self.prefix))


def write_indexed(prefix: Path, documents: Iterable[Any], dtype: Any) -> str:
  """Writes ``documents`` (1-D integer token arrays, one sequence each) as a Megatron
  indexed dataset; returns ``prefix``. See `IndexedDatasetWriter`."""
  with IndexedDatasetWriter(prefix, dtype) as writer:
    for document in documents:
      writer.add_document(document)
  return os.fspath(prefix)


class _Sequences:
  """The sequence access both readers share: ``len``, ``[i]`` and `get`, over their
  ``sequence_lengths``; a reader says how to read a sequence's tokens (``_read``)
  and what its errors call one (``_unit``)."""

  _unit = "sequence"
  sequence_lengths: np.ndarray

  def __len__(self) -> int:
    return len(self.sequence_lengths)

  def __getitem__(self, i: int) -> np.ndarray:
    """The tokens of sequence ``i`` (read-only, in the file's dtype)."""
    return self.get(i)

  def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
    """``length`` tokens (default: to the end) of sequence ``i`` from ``offset``
    (read-only, in the file's dtype; a `FlatTokens` sequence is a document)."""
    i = _index(i, len(self))
    offset, length = _part(f"{self._unit} {i}", int(self.sequence_lengths[i]), offset,
                           length)
    return self._read(i, offset, length)

  def _read(self, i: int, offset: int, length: int) -> np.ndarray:
    """``length`` tokens of sequence ``i`` from ``offset``, both checked."""
    raise NotImplementedError


class IndexedDataset(_Sequences):
  """A Megatron indexed dataset, memory-mapped: its sequences by number.

  Reads what Megatron-Core's ``IndexedDatasetBuilder`` (or `IndexedDatasetWriter`)
  writes; the ``.idx`` is checked against its own counts and the file sizes.

  Args:
    prefix: the path without ``.bin``/``.idx``.

  Attributes:
    path: ``prefix``.
    dtype: the token dtype.
    sequence_lengths: int32 ``[S]``, tokens per sequence.
    sequence_pointers: int64 ``[S]``, byte offsets of the sequences in the ``.bin``.
    document_indices: int64 ``[D]``: document ``d`` is the sequences
      ``document_indices[d]`` to ``document_indices[d + 1] - 1``.
    sequence_modes: int8 ``[S]`` in a multimodal dataset, else ``None``.

  Raises:
    ValueError: naming ``prefix``, for a missing file or one not in the format.
  """

  def __init__(self, prefix: Path):
    self.path = os.fspath(prefix)
    self._open()

  def _open(self) -> None:
    idx, bin_ = index_file(self.path), data_file(self.path)
    for path in (idx, bin_):
      if not os.path.isfile(path):
        hint = (" (give the prefix, without .bin/.idx)"
                if self.path.endswith((".bin", ".idx")) else "")
        raise validation.fail("prefix", f": no file {path!r}: a Megatron indexed "
                              f"dataset is <prefix>.bin + <prefix>.idx{hint}")
    index = _mmap(idx)
    if len(index) < _HEADER_BYTES or bytes(index[:9]) != INDEX_HEADER:
      raise validation.fail("prefix", f": {idx!r} is not a Megatron index (no "
                            "MMIDIDX header)")
    version, code, count, docs = struct.unpack("<QBQQ", bytes(index[9:_HEADER_BYTES]))
    if version != INDEX_VERSION or code not in DTYPE_CODES:
      raise validation.fail("prefix", f": {idx!r} has version {version}, dtype code "
                            f"{code}; this reader knows version 1, codes 1-8")
    self.dtype = DTYPE_CODES[code].newbyteorder("<")
    size = _HEADER_BYTES + 12 * count + 8 * docs
    if len(index) not in (size, size + count):
      raise validation.fail("prefix", f": {idx!r} is {len(index)} bytes; {count} "
                            f"sequences and {docs} document indices take {size} "
                            f"(+{count} with modes)")
    offset = _HEADER_BYTES
    self.sequence_lengths = np.frombuffer(index, "<i4", count, offset)
    offset += 4 * count
    self.sequence_pointers = np.frombuffer(index, "<i8", count, offset)
    offset += 8 * count
    self.document_indices = np.frombuffer(index, "<i8", docs, offset)
    offset += 8 * docs
    self.sequence_modes = (np.frombuffer(index, np.int8, count, offset)
                           if len(index) > size else None)
    self._data = _mmap(bin_)
    self._check(idx, bin_)

  def _check(self, idx: str, bin_: str) -> None:
    lengths, docs = self.sequence_lengths, self.document_indices
    if (len(docs) < 1 or docs[0] != 0 or docs[-1] != len(lengths)
        or np.any(np.diff(docs) < 0) or np.any(lengths < 0)):
      raise validation.fail("prefix", f": {idx!r} has inconsistent document "
                            "indices or negative sequence lengths")
    if len(lengths):
      end = int(self.sequence_pointers[-1]) + int(lengths[-1]) * self.dtype.itemsize
      if end > len(self._data):
        raise validation.fail("prefix", f": {bin_!r} has {len(self._data)} bytes; "
                              f"its index points up to byte {end}")

  def _read(self, i: int, offset: int, length: int) -> np.ndarray:
    start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
    return _read_bytes(self._data, self.dtype, start, length)

  def document(self, d: int) -> np.ndarray:
    """The tokens of document ``d``: its sequences concatenated."""
    d = _index(d, len(self.document_indices) - 1)
    first, last = self.document_indices[d], self.document_indices[d + 1]
    parts = [self.get(i) for i in range(int(first), int(last))]
    return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

  @property
  def num_documents(self) -> int:
    """Documents in the dataset (``len(document_indices) - 1``)."""
    return len(self.document_indices) - 1

  @property
  def num_tokens(self) -> int:
    """Tokens in all sequences."""
    return int(np.sum(self.sequence_lengths, dtype=np.int64))

  def __getstate__(self) -> dict[str, Any]:  # pickles as its path, maps anew
    return {"path": self.path}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.path = state["path"]
    self._open()

  def __repr__(self) -> str:
    return (f"IndexedDataset({self.path!r}, {len(self)} sequences, "
            f"{self.num_documents} documents, {self.dtype.newbyteorder('=')})")


class FlatTokens(_Sequences):
  """A flat file of token ids (nanoGPT's ``train.bin``), memory-mapped, as documents
  that end with the end-of-document token ``eod`` (see the module docstring).

  The same interface as `IndexedDataset` (one sequence per document), for
  `mpscale.trainer.data.token_datasets.GPTSamples`. Finding the documents reads the whole file
  once, in chunks.

  Args:
    path: the file.
    dtype: its integer token dtype (``uint16`` for nanoGPT's GPT-2 tokens; ``uint32``
      for a larger vocabulary).
    eod: the end-of-document token id; ``None``: the file is one document.

  Attributes:
    path: ``path``.
    dtype: the token dtype.
    eod: the end-of-document id, or ``None``.
    tokens: the whole file, memory-mapped read-only.
    sequence_lengths: int32 ``[documents]``.
    sequence_starts: int64 ``[documents]``, the first token of each.
    document_indices: int64 ``0 .. documents`` (each document one sequence).

  Raises:
    ValueError, TypeError: naming ``path`` (missing, or not a whole number of
      tokens), ``dtype`` (not an integer type) or ``eod`` (not an id of the dtype).
  """

  _unit = "document"

  def __init__(self, path: Path, dtype: Any = np.uint16, eod: Optional[int] = None):
    self.path = os.fspath(path)
    self.dtype = _token_dtype_arg("dtype", dtype, writable=False)
    if eod is not None:
      eod = validation.integer("eod", eod, 0)
      if eod > np.iinfo(self.dtype).max:
        raise validation.fail("eod", f" {eod} is not an id of dtype "
                              f"{self.dtype.newbyteorder('=')}")
    self.eod = eod
    self._open()

  def _open(self) -> None:
    if not os.path.isfile(self.path):
      raise validation.fail("path", f": no file {self.path!r}")
    size = os.path.getsize(self.path)
    if size % self.dtype.itemsize:
      raise validation.fail("path", f": {self.path!r} has {size} bytes, not a whole "
                            f"number of {self.dtype.newbyteorder('=')} tokens")
    self._data = _mmap(self.path)
    self.tokens = _read_bytes(self._data, self.dtype, 0, size // self.dtype.itemsize)
    self.sequence_starts, self.sequence_lengths = self._documents()
    self.document_indices = np.arange(len(self.sequence_lengths) + 1, dtype=np.int64)

  def _documents(self) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the documents: ends after each ``eod``, and cuts
    keeping each under 2**31 tokens."""
    n = len(self.tokens)
    ends = []
    if self.eod is not None:
      for first in range(0, n, _SCAN_TOKENS):
        chunk = self.tokens[first:first + _SCAN_TOKENS]
        ends.append(np.flatnonzero(chunk == self.eod).astype(np.int64) + first + 1)
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if n and (not len(ends) or ends[-1] != n):
      ends = np.append(ends, n)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    lengths = ends - starts
    if np.any(lengths > _MAX_SEQUENCE):  # rare: cut the long ones
      cuts = [np.arange(s, s + l, _MAX_SEQUENCE) for s, l in zip(starts, lengths)]
      starts = np.concatenate(cuts)
      lengths = np.diff(np.append(starts, n))
    return starts, lengths.astype(np.int32)

  def _read(self, i: int, offset: int, length: int) -> np.ndarray:
    start = int(self.sequence_starts[i]) + offset
    return self.tokens[start:start + length]

  @property
  def num_tokens(self) -> int:
    """Tokens in the file."""
    return len(self.tokens)

  def __getstate__(self) -> dict[str, Any]:  # pickles as its arguments, maps anew
    return {"path": self.path, "dtype": self.dtype, "eod": self.eod}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._open()

  def __repr__(self) -> str:
    return (f"FlatTokens({self.path!r}, dtype={self.dtype.newbyteorder('=')}, "
            f"eod={self.eod}, {len(self)} documents)")


Corpus = Union[IndexedDataset, FlatTokens]
"""A token corpus (see the module docstring)."""


def open_corpus(path: Path, dtype: Any = None, eod: Optional[int] = None) -> Corpus:
  """The corpus at ``path``: an `IndexedDataset` if ``<path>.idx`` exists (``path``
  is its prefix), else a `FlatTokens` file (``dtype``, default ``uint16``, and
  ``eod``; an indexed dataset's documents are its sequences, whatever ``eod``).

  Raises:
    ValueError: naming ``path`` when neither exists, or ``dtype`` given for an
      indexed dataset (its index names its own).
  """
  path = os.fspath(path)
  if os.path.isfile(index_file(path)):
    if dtype is not None:
      raise validation.fail("dtype", f": {path!r} is an indexed dataset, whose .idx "
                            "names its dtype; leave dtype out")
    return IndexedDataset(path)
  if os.path.isfile(path):
    return FlatTokens(path, np.uint16 if dtype is None else dtype, eod)
  raise validation.fail("path", f": neither an indexed dataset ({path!r}.idx + .bin) "
                        f"nor a flat token file {path!r}")
