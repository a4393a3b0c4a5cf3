"""Training samples cut from token corpora, as Megatron's GPT dataset does, and blends.

`GPTSamples` turns a corpus (`mpscale.trainer.data.token_files`: a Megatron indexed
dataset or a flat token file) into a random-access source of training examples, each
``seq_len + 1`` consecutive tokens as ``inputs``/``targets``/``mask``: the tiny LM's
batch rows (`GPTSamples.examples` reads a batch of them at once). It builds the same three indices as Megatron-Core's ``GPTDataset`` (for
the same corpus, ``seq_len``, seed and ``num_samples`` they are equal, and so are the
samples)::

  T = tokens in the documents;  L = seq_len
  epochs = max(1, ceil((num_samples * L + 1) / T))     # 1 if num_samples is None
  rng = numpy.random.RandomState(seed)
  document_index = the documents, each `epochs` times, shuffled by rng
                   (the last epoch shuffled on its own when fewer than 80% of its
                   samples are needed: the final epoch is "separated")
  stream = the documents concatenated in document_index order  (epochs * T tokens)
  N = (epochs * T - 1) // L                            # samples built, >= num_samples
  sample k = stream[k * L : k * L + L + 1]             # the next starts at its last
  sample_index[k] = (position in document_index, offset) of stream[k * L]
  shuffle_index = a permutation of 0..N-1 by rng       # the separated epoch's
                                                       # samples permuted after the rest
  example i = sample shuffle_index[i]

So every token of the stream is an input exactly once, but for the last
``epochs * T - N * L`` (between 1 and L) tokens; with one epoch, every token of every
document is an input of exactly one sample, but for that tail. The samples of each
epoch are not confined to it: the documents of all (unseparated) epochs are shuffled
together, as Megatron does. ``len(samples)`` is ``N``.

The indices are built once and cached as ``.npy`` files beside the data (in
``cache/`` next to it, or in ``cache_dir``), named by a hash of what they depend on
(the seed, ``seq_len``, ``num_samples``, the documents used, and the corpus's sequence
count, token count and sequence lengths): reused when all are present, built anew
when any of these changes. Each file is written to a temporary name and moved into
place, so processes building the same index at once leave a whole one.

An example is ``{"inputs": int32 [L], "targets": int32 [L], "mask": float32 [L]}``
(`mpscale.trainer.data.text.Batch`'s row). Megatron's options at document boundaries,
by the end-of-document token ``eod`` in the inputs:

- ``eod_mask_loss``: ``mask`` is 0 where the input is ``eod`` (the target after an end
  of document, the first token of the next, is not predicted);
- ``reset_position_ids``: adds ``position_ids`` (int32 [L]), restarting at 0 after
  each ``eod``;
- ``reset_attention_mask``: adds ``segment_ids`` (int32 [L]), 0 from the start and one
  more after each ``eod``: a token may attend to the earlier tokens of its segment
  (Megatron's mask). The tiny LM (`mpscale.trainer.models.lm.TinyLM`) reads neither: it uses
  learned positions ``0..L-1`` and plain causal attention.

`BlendedSamples` mixes several sources by weight with Megatron's ``BlendedDataset``
rule: example ``i`` comes from the source whose count so far lags furthest behind its
share, ``argmax_d(weight_d * max(i, 1) - count_d)`` (the first on ties), as the
``count_d``-th example of that source. The rule has no randomness: the order within
each source comes from its own seed. `blend` builds it over corpora.

References:
  Megatron-Core, ``megatron/core/datasets/gpt_dataset.py`` (``GPTDataset``,
  ``_build_document_index``, ``_build_shuffle_index``,
  ``_get_ltor_masks_and_position_ids``), ``helpers.cpp`` (``build_sample_idx``,
  ``build_blending_indices``), ``blended_dataset.py`` and
  ``blended_megatron_dataset_builder.py`` (the per-source sizes, with a surplus):
  https://github.com/NVIDIA/Megatron-LM/tree/main/megatron/core/datasets
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import os
import tempfile
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mpscale import validation
from mpscale.trainer.data import token_files

_INDICES = ("document_index", "sample_index", "shuffle_index")
_SEPARATE_FINAL_EPOCH_BELOW = 0.8
"""Megatron's threshold: a last epoch of which fewer than this share of samples is
needed is shuffled on its own (so the others are used up first)."""


def num_epochs(tokens_per_epoch: int, seq_len: int, num_samples: Optional[int]) -> int:
  """Epochs of ``tokens_per_epoch`` tokens that hold ``num_samples`` samples of
  ``seq_len + 1`` tokens overlapping by one (1 if ``num_samples`` is ``None``)."""
  if num_samples is None:
    return 1
  return max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))


def _document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                    separate_final_epoch: bool) -> np.ndarray:
  """Megatron's ``_build_document_index``: ``documents`` repeated ``epochs`` times
  and shuffled (the last epoch apart if ``separate_final_epoch``), int32."""
  if not separate_final_epoch or epochs == 1:
    index = np.tile(documents.astype(np.int32), epochs)
    rng.shuffle(index)
    return index
  first = _document_index(documents, epochs - 1, rng, False)
  return np.concatenate([first, _document_index(documents, 1, rng, False)])


def _sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_len: int,
                  num_samples: int) -> np.ndarray:
  """``[num_samples + 1, 2]``: where stream position ``k * seq_len`` is, as (position
  in ``document_index``, offset in that document); the same values as Megatron's
  ``build_sample_idx`` (which starts at ``(0, 0)`` even when the first document is
  empty), and its dtype (int32 where the values fit)."""
  lengths = sizes[document_index].astype(np.int64)
  ends = np.cumsum(lengths)
  positions = np.arange(num_samples + 1, dtype=np.int64) * seq_len
  where = np.searchsorted(ends, positions, side="right")
  offsets = positions - (ends[where] - lengths[where])
  where[0], offsets[0] = 0, 0
  fits = max(len(document_index), int(sizes.max())) <= np.iinfo(np.int32).max
  return np.stack([where, offsets], axis=1).astype(np.int32 if fits else np.int64)


def _shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
  """Megatron's ``_build_shuffle_index``: ``0..first-1`` shuffled, then
  ``first..total-1`` shuffled."""
  dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
  head = np.arange(first, dtype=dtype)
  rng.shuffle(head)
  if first == total:
    return head
  tail = np.arange(first, total, dtype=dtype)
  rng.shuffle(tail)
  return np.concatenate([head, tail])


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_len: int, seed: int,
                  num_samples: Optional[int] = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(document_index, sample_index, shuffle_index)`` of `GPTSamples` (the module
  docstring): Megatron's ``GPTDataset`` indices over the sequences ``documents`` of a
  corpus whose sequence lengths are ``sizes``."""
  tokens = int(np.sum(sizes[documents], dtype=np.int64))
  epochs = num_epochs(tokens, seq_len, num_samples)
  separate = False
  if epochs > 1:
    before_final = ((epochs - 1) * tokens - 1) // seq_len
    per_epoch = (tokens - 1) // seq_len
    separate = (num_samples - before_final
                < int(_SEPARATE_FINAL_EPOCH_BELOW * per_epoch))
  rng = np.random.RandomState(seed)
  document_index = _document_index(documents, epochs, rng, separate)
  built = (epochs * tokens - 1) // seq_len
  sample_index = _sample_index(sizes, document_index, seq_len, built)
  shuffle_index = _shuffle_index(before_final if separate else built, built, rng)
  return document_index, sample_index, shuffle_index


def _digest(array: np.ndarray) -> str:
  return hashlib.md5(np.ascontiguousarray(array).tobytes(),
                     usedforsecurity=False).hexdigest()


def _save(path: str, write: Callable[[Any], None]) -> None:
  """``write(file)`` to a fresh temporary file beside ``path``, then moved to
  ``path``: the file is whole or absent, whoever else writes it at once."""
  handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path),
                                       prefix=os.path.basename(path) + ".")
  try:
    with os.fdopen(handle, "wb") as f:
      write(f)
    os.replace(temporary, path)
  except BaseException:
    os.unlink(temporary)
    raise


def _corpus(corpus: Any) -> Any:
  if not all(hasattr(corpus, a) for a in ("sequence_lengths", "get", "__len__")):
    raise validation.fail(
        "corpus", " must be a token corpus (sequence_lengths, get(i, offset, "
        "length)): an IndexedDataset or FlatTokens of mpscale.trainer.data.token_files; "
        f"got {type(corpus).__name__}", validation.ArgumentTypeError)
  return corpus


def _documents(documents: Any, count: int) -> np.ndarray:
  if documents is None:
    return np.arange(count, dtype=np.int32)
  array = np.asarray(documents)
  if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype,
                                                              np.integer)):
    raise validation.fail("documents", " must be a 1-D array of sequence numbers",
                          validation.ArgumentTypeError)
  if array.size == 0 or array.min() < 0 or array.max() >= count:
    raise validation.fail("documents", f" must be sequence numbers in [0, {count}), "
                          "at least one")
  return array.astype(np.int32)


class GPTSamples:
  """Samples of ``seq_len + 1`` tokens from a corpus, shuffled, as Megatron's
  ``GPTDataset`` cuts them (the module docstring): a random-access source for grain.

  Args:
    corpus: an `mpscale.trainer.data.token_files.IndexedDataset` or ``FlatTokens`` (or
      anything with ``sequence_lengths``, ``get(i, offset, length)`` and ``path``);
      each of its sequences is a document.
    seq_len: tokens per example (the model's ``seq_len``); a sample holds one more.
    seed: the shuffles' seed (``numpy.random.RandomState``), in ``[0, 2**32)``.
    num_samples: build at least this many samples (whole epochs); ``None``: one
      epoch.
    documents: the sequence numbers to use (e.g. a train/validation split); default
      all.
    eod: the end-of-document token, for the options below; default the corpus's own
      (``FlatTokens.eod``).
    eod_mask_loss: mask the targets that follow an ``eod`` input.
    reset_position_ids: add ``position_ids`` restarting after each ``eod``.
    reset_attention_mask: add ``segment_ids`` that change after each ``eod``.
    cache_dir: the folder of the cached indices; default ``cache/`` beside the
      corpus. ``cache=False`` keeps them in memory only.
    cache: whether to read and write the cached indices.

  Attributes:
    document_index: int32, the documents in stream order.
    sample_index: ``[len + 1, 2]``, each sample's start (position in
      ``document_index``, offset).
    shuffle_index: the sample each example is.
    epochs: passes over the documents the stream holds.
    cache_hit: whether the indices were read from the cache (not built).
    cache_files: the cached index files (empty without a cache).

  Raises:
    ValueError, TypeError: naming the argument: ``seq_len`` < 1, a corpus shorter
      than one sample, an option that needs ``eod`` without one, a bad ``seed``.

  Example:
    >>> import os, tempfile
    >>> from mpscale.trainer.data.token_files import IndexedDataset, write_indexed
    >>> from mpscale.trainer.data.token_datasets import GPTSamples
    >>> prefix = write_indexed(os.path.join(tempfile.mkdtemp(), "corpus"),
    ...                        [range(10), range(10, 30)], "uint16")
    >>> samples = GPTSamples(IndexedDataset(prefix), seq_len=8, seed=0)
    >>> len(samples), sorted(samples[0]), samples[0]["inputs"].shape
    (3, ['inputs', 'mask', 'targets'], (8,))
  """

  def __init__(self, corpus: Any, seq_len: int, seed: int = 0,
               num_samples: Optional[int] = None, *, documents: Any = None,
               eod: Optional[int] = None, eod_mask_loss: bool = False,
               reset_position_ids: bool = False, reset_attention_mask: bool = False,
               cache_dir: Optional[token_files.Path] = None, cache: bool = True):
    self.corpus = _corpus(corpus)
    self.seq_len = validation.positive_int("seq_len", seq_len)
    self.seed = validation.integer("seed", seed, 0)
    if self.seed >= 2**32:
      raise validation.fail("seed", f" must be < 2**32 (a RandomState seed); got "
                            f"{seed}")
    self.num_samples = (None if num_samples is None
                        else validation.positive_int("num_samples", num_samples))
    self.documents = _documents(documents, len(corpus))
    self.eod_mask_loss = validation.boolean("eod_mask_loss", eod_mask_loss)
    self.reset_position_ids = validation.boolean("reset_position_ids",
                                                 reset_position_ids)
    self.reset_attention_mask = validation.boolean("reset_attention_mask",
                                                   reset_attention_mask)
    self.eod = getattr(corpus, "eod", None) if eod is None else validation.integer(
        "eod", eod, 0)
    options = [name for name in ("eod_mask_loss", "reset_position_ids",
                                 "reset_attention_mask") if getattr(self, name)]
    if options and self.eod is None:
      raise validation.fail("eod", f": {', '.join(options)} needs the end-of-document "
                            "token id")
    sizes = np.asarray(corpus.sequence_lengths)
    self.tokens_per_epoch = int(np.sum(sizes[self.documents], dtype=np.int64))
    if self.tokens_per_epoch < self.seq_len + 1:
      raise validation.ArgumentError(
          ("seq_len", "corpus"), f"{{0}} + 1 = {self.seq_len + 1} tokens is more than "
          f"the {self.tokens_per_epoch} tokens of {{1}} (its documents used)")
    self.epochs = num_epochs(self.tokens_per_epoch, self.seq_len, self.num_samples)
    self.cache = validation.boolean("cache", cache)
    self.cache_dir = self._cache_dir(cache_dir)
    self.cache_hit, self.cache_files = False, {}
    self._indices(sizes)

  def _cache_dir(self, cache_dir: Optional[token_files.Path]) -> Optional[str]:
    if not self.cache:
      return None
    if cache_dir is not None:
      return os.fspath(cache_dir)
    path = getattr(self.corpus, "path", None)
    if path is None:
      raise validation.fail("cache_dir", ": the corpus has no path to cache its "
                            "indices beside; give a cache_dir or cache=False")
    return os.path.join(os.path.dirname(os.path.abspath(path)), "cache")

  def description(self) -> dict[str, Any]:
    """What the indices depend on (hashed into the cache files' names)."""
    sizes = np.asarray(self.corpus.sequence_lengths)
    return {"class": "mpscale.GPTSamples", "format": 1, "seed": self.seed,
            "seq_len": self.seq_len, "num_samples": self.num_samples,
            "sequences": len(sizes), "tokens": self.tokens_per_epoch,
            "sequence_lengths_md5": _digest(sizes.astype("<i4")),
            "documents_md5": _digest(self.documents.astype("<i4"))}

  def _indices(self, sizes: np.ndarray) -> None:
    if self.cache_dir is None:
      self._set(*build_indices(sizes, self.documents, self.seq_len, self.seed,
                               self.num_samples))
      return
    description = json.dumps(self.description(), sort_keys=True, indent=1)
    key = hashlib.md5(description.encode(), usedforsecurity=False).hexdigest()
    stem = os.path.basename(os.fspath(getattr(self.corpus, "path", None) or "corpus"))
    files = {name: os.path.join(self.cache_dir, f"{stem}-{key}-{name}.npy")
             for name in _INDICES + ("description",)}
    files["description"] = files["description"][:-len(".npy")] + ".json"
    if all(os.path.isfile(f) for f in files.values()) and self._load(files):
      self.cache_hit, self.cache_files = True, files
      return
    self._set(*build_indices(sizes, self.documents, self.seq_len, self.seed,
                             self.num_samples))
    try:
      os.makedirs(self.cache_dir, exist_ok=True)
      for name in _INDICES:
        _save(files[name], functools.partial(np.save, arr=getattr(self, name)))
      _save(files["description"], lambda f: f.write(description.encode() + b"\n"))
      self.cache_files = files
    except OSError as e:  # a read-only data folder: train on, rebuild next time
      warnings.warn(f"GPTSamples: cannot cache the sample index in "
                    f"{self.cache_dir!r} ({e}); pass cache_dir= to keep it")

  def _load(self, files: dict[str, str]) -> bool:
    """Reads the cached indices; ``False`` (and nothing set) if they do not fit."""
    try:
      indices = [np.load(files[name], mmap_mode="r") for name in _INDICES]
    except (OSError, ValueError):
      return False
    document_index, sample_index, shuffle_index = indices
    if (sample_index.ndim != 2 or sample_index.shape[1] != 2
        or len(shuffle_index) != len(sample_index) - 1
        or len(document_index) != self.epochs * len(self.documents)):
      return False
    self._set(document_index, sample_index, shuffle_index)
    return True

  def _set(self, document_index: np.ndarray, sample_index: np.ndarray,
           shuffle_index: np.ndarray) -> None:
    self.document_index = document_index
    self.sample_index = sample_index
    self.shuffle_index = shuffle_index

  def __len__(self) -> int:
    return len(self.sample_index) - 1

  def tokens(self, i: int) -> np.ndarray:
    """The ``seq_len + 1`` tokens of example ``i`` (int32)."""
    n = len(self)
    i = operator.index(i)
    if not -n <= i < n:
      raise IndexError(f"example {i} out of range for {n} samples")
    k = int(self.shuffle_index[i % n])
    (first, offset), (last, end) = self.sample_index[k], self.sample_index[k + 1]
    first, offset, last, end = int(first), int(offset), int(last), int(end)
    get, docs = self.corpus.get, self.document_index
    if first == last:
      parts = [get(int(docs[first]), offset, end - offset + 1)]
    else:
      parts = ([get(int(docs[first]), offset)]
               + [get(int(docs[d])) for d in range(first + 1, last)]
               + [get(int(docs[last]), 0, end + 1)])
    window = np.concatenate(parts).astype(np.int32)
    assert len(window) == self.seq_len + 1, (i, len(window))
    return window

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    """Example ``i``: ``inputs``, ``targets``, ``mask`` (and ``position_ids``,
    ``segment_ids`` if asked for), see the module docstring."""
    window = self.tokens(i)
    inputs, targets = window[:-1], window[1:]
    mask = np.ones(self.seq_len, np.float32)
    if self.eod_mask_loss:
      mask[inputs == self.eod] = 0.0
    example = {"inputs": inputs, "targets": targets, "mask": mask}
    if self.reset_position_ids or self.reset_attention_mask:
      ends = np.flatnonzero(inputs[:-1] == self.eod) + 1  # a segment starts there
      segment_ids = np.zeros(self.seq_len, np.int32)
      segment_ids[ends] = 1
      segment_ids = np.cumsum(segment_ids, dtype=np.int32)
      if self.reset_position_ids:
        starts = np.concatenate([[0], ends]).astype(np.int32)
        example["position_ids"] = (np.arange(self.seq_len, dtype=np.int32)
                                   - starts[segment_ids])
      if self.reset_attention_mask:
        example["segment_ids"] = segment_ids
    return example

  def examples(self, indices: Any) -> dict[str, np.ndarray]:
    """Examples ``indices`` stacked (``[len(indices), seq_len]`` each): the batch
    ``grain`` makes of ``[self[i] for i in indices]``, the same arrays (and keys, in
    its sorted order), read in one vectorized pass (the loader's batches of one corpus,
    `mpscale.trainer.data.corpora.SampleBatches`).

    Each row is the ``seq_len + 1`` tokens of the stream from its sample's start
    (``sample_index``): the documents it spans are found by a ``searchsorted`` over
    their ends, and the tokens gathered from the corpus's memory-mapped file at once.
    A corpus other than `token_files.IndexedDataset` or ``FlatTokens`` is read row
    by row (`tokens`).
    """
    ids = np.asarray(indices, dtype=np.int64).reshape(-1)
    n = len(self)
    if ids.size and (ids.min() < -n or ids.max() >= n):
      raise IndexError(f"examples {ids.min()}..{ids.max()} out of range for {n} "
                       "samples")
    ids %= n
    gather = self._gather()
    if gather is None:
      windows = (np.stack([self.tokens(int(i)) for i in ids]) if ids.size
                 else np.zeros((0, self.seq_len + 1), np.int32))
    else:
      windows = self._windows(ids, *gather)
    inputs = np.ascontiguousarray(windows[:, :-1])
    targets = np.ascontiguousarray(windows[:, 1:])
    mask = (inputs != self.eod if self.eod_mask_loss
            else np.ones(inputs.shape, bool)).astype(np.float32)
    batch = {"inputs": inputs, "targets": targets, "mask": mask}
    if self.reset_position_ids or self.reset_attention_mask:
      starts = np.zeros(inputs.shape, bool)  # a segment starts after each eod
      starts[:, 1:] = inputs[:, :-1] == self.eod
      if self.reset_position_ids:
        steps = np.arange(self.seq_len, dtype=np.int32)
        first = np.maximum.accumulate(np.where(starts, steps, 0), axis=1)
        batch["position_ids"] = (steps - first).astype(np.int32)
      if self.reset_attention_mask:
        batch["segment_ids"] = np.cumsum(starts, axis=1, dtype=np.int32)
    return dict(sorted(batch.items()))  # grain's batch orders the keys so

  def _gather(self) -> Optional[tuple[np.ndarray, ...]]:
    """What `_windows` reads, opened once: the corpus's whole token array
    (memory-mapped), the position in it of each sequence's first token, the
    sequence lengths (int64), and the three indices (plain arrays, not memory maps:
    faster to index); ``None`` for a corpus read only through ``get``."""
    if "_gathered" not in self.__dict__:  # set once, whole (the loader's thread)
      corpus, tokens, gathered = self.corpus, None, None
      if isinstance(corpus, token_files.FlatTokens):
        tokens, first = corpus.tokens, np.asarray(corpus.sequence_starts, np.int64)
      elif isinstance(corpus, token_files.IndexedDataset):
        itemsize = corpus.dtype.itemsize
        pointers = np.asarray(corpus.sequence_pointers, np.int64)
        path = token_files.data_file(corpus.path)
        count = os.path.getsize(path) // itemsize
        if count and not np.any(pointers % itemsize):
          tokens = np.memmap(path, dtype=corpus.dtype, mode="r", shape=(count,))
          first = pointers // itemsize
      if tokens is not None:
        gathered = (np.asarray(tokens), first,
                    np.asarray(corpus.sequence_lengths, np.int64),
                    *(np.asarray(getattr(self, name)) for name in _INDICES))
      self._gathered = gathered
    return self._gathered

  def _windows(self, ids: np.ndarray, tokens: np.ndarray, first_token: np.ndarray,
               sizes: np.ndarray, document_index: np.ndarray,
               sample_index: np.ndarray, shuffle_index: np.ndarray) -> np.ndarray:
    """int32 ``[len(ids), seq_len + 1]``: the tokens of examples ``ids``
    (``0 <= ids < len``), as `tokens` reads them, gathered at once."""
    width = self.seq_len + 1
    span = np.arange(width, dtype=np.int64)
    k = shuffle_index[ids].astype(np.int64)
    first, offset = sample_index[k].astype(np.int64).T  # where each starts
    last = sample_index[k + 1, 0]  # the document it ends in
    if np.array_equal(first, last):  # each in one document
      docs = document_index[first]
      return tokens[(first_token[docs] + offset)[:, None] + span].astype(np.int32)
    # The documents (positions in document_index) each row spans, back to back.
    count = last - first + 1
    head = np.cumsum(count) - count  # each row's first piece in the list
    docs = document_index[np.arange(head[-1] + count[-1])
                          + np.repeat(first - head, count)]
    lengths = sizes[docs]
    before = np.cumsum(lengths) - lengths
    # Each piece's start relative to its row's first token; its end, cut to the
    # window, plus row * width: non-decreasing, so one searchsorted finds, for
    # token t of row r (r * width + t), the piece that holds it.
    start = before - np.repeat(before[head] + offset, count)
    rows = np.arange(0, len(ids) * width, width, dtype=np.int64)
    ends = np.minimum(start + lengths, width) + np.repeat(rows, count)
    piece = np.searchsorted(ends, rows[:, None] + span, side="right")
    return tokens[(first_token[docs] - start)[piece] + span].astype(np.int32)

  def __getstate__(self) -> dict[str, Any]:
    state = dict(self.__dict__)
    state.pop("_gathered", None)  # the memory map: opened again when read
    if self.cache_files:  # pickled without the indices: read again from the cache
      state.update(dict.fromkeys(_INDICES))
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    if self.document_index is None and not self._load(self.cache_files):
      self._set(*build_indices(np.asarray(self.corpus.sequence_lengths),
                               self.documents, self.seq_len, self.seed,
                               self.num_samples))

  def __repr__(self) -> str:
    return (f"GPTSamples({self.corpus!r}, seq_len={self.seq_len}, seed={self.seed}, "
            f"{len(self)} samples, {self.epochs} epoch(s))")


def blending_indices(weights: Sequence[float], size: int
                     ) -> tuple[np.ndarray, np.ndarray]:
  """``(dataset_index, dataset_sample_index)`` of a blend: Megatron's
  ``build_blending_indices`` (the module docstring) for normalized ``weights``;
  int16 and int64 arrays of ``size``."""
  weights = [float(w) for w in weights]
  counts = [0] * len(weights)
  order = range(1, len(weights))
  chosen = []
  for i in range(size):
    t = max(float(i), 1.0)
    best, lag = 0, weights[0] * t - counts[0]
    for d in order:
      behind = weights[d] * t - counts[d]
      if behind > lag:
        best, lag = d, behind
    chosen.append(best)
    counts[best] += 1
  dataset_index = np.asarray(chosen, np.int16)
  sample_index = np.zeros(size, np.int64)
  for d in range(len(weights)):  # the k-th draw from d is its sample k
    picked = dataset_index == d
    sample_index[picked] = np.arange(int(picked.sum()))
  return dataset_index, sample_index


def _weights(weights: Any, count: int, sources: str) -> np.ndarray:
  if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
    raise validation.fail("weights", " must be a sequence of positive floats; got "
                          f"{type(weights).__name__}", validation.ArgumentTypeError)
  if len(weights) != count:
    raise validation.ArgumentError(("weights", sources), f"{{0}} has {len(weights)} "
                                   f"entries; {{1}} has {count}: one weight each")
  values = [validation.positive_float(f"weights[{i}]", w)
            for i, w in enumerate(weights)]
  values = np.asarray(values, np.float64)
  return values / np.sum(values)


class BlendedSamples:
  """Examples drawn from several sources by weight, Megatron's ``BlendedDataset``
  rule (the module docstring): a random-access source for grain.

  Args:
    datasets: random-access sources of examples (`GPTSamples`, or any with ``len``
      and ``[i]``), each with as many examples as the blend draws from it.
    weights: one positive float per source; normalized to sum to 1.
    num_samples: examples in the blend.

  Attributes:
    weights: the normalized weights.
    dataset_index: int16 ``[num_samples]``, the source of each example.
    dataset_sample_index: int64 ``[num_samples]``, its example in that source.

  Raises:
    ValueError, TypeError: naming ``weights`` (negative, zero, not one per
      dataset), ``datasets`` (too few examples in one) or ``num_samples``.
  """

  def __init__(self, datasets: Sequence[Any], weights: Sequence[float],
               num_samples: int):
    if isinstance(datasets, (str, bytes)) or not hasattr(datasets, "__len__") or any(
        not (hasattr(d, "__len__") and hasattr(d, "__getitem__")) for d in datasets):
      raise validation.fail("datasets", " must be a list of random-access sources "
                            "(len and [i])", validation.ArgumentTypeError)
    if not 0 < len(datasets) < 2**15:
      raise validation.fail("datasets", f" must hold 1 to 32767 sources; got "
                            f"{len(datasets)}")
    self.datasets = list(datasets)
    self.weights = _weights(weights, len(self.datasets), "datasets")
    self.num_samples = validation.positive_int("num_samples", num_samples)
    self.dataset_index, self.dataset_sample_index = blending_indices(
        self.weights, self.num_samples)
    drawn = np.bincount(self.dataset_index, minlength=len(self.datasets))
    for d, (dataset, count) in enumerate(zip(self.datasets, drawn)):
      if count > len(dataset):
        raise validation.ArgumentError(
            (f"datasets[{d}]", "num_samples"), f"{{0}} has {len(dataset)} examples; "
            f"a blend of {{1}}={self.num_samples} draws {count} from it")

  def __len__(self) -> int:
    return self.num_samples

  def __getitem__(self, i: int) -> Any:
    """Example ``i``: example ``dataset_sample_index[i]`` of source
    ``dataset_index[i]``."""
    i = operator.index(i)
    if not -self.num_samples <= i < self.num_samples:
      raise IndexError(f"example {i} out of range for {self.num_samples}")
    d = int(self.dataset_index[i])
    return self.datasets[d][int(self.dataset_sample_index[i])]

  def realised_fractions(self, n: Optional[int] = None) -> np.ndarray:
    """The share of each source among the first ``n`` examples (default all), for
    the log: float64 ``[sources]``."""
    n = self.num_samples if n is None else validation.positive_int("n", n)
    n = min(n, self.num_samples)
    counts = np.bincount(self.dataset_index[:n], minlength=len(self.datasets))
    return counts / n

  def __repr__(self) -> str:
    return (f"BlendedSamples({len(self.datasets)} sources, weights="
            f"{np.round(self.weights, 4).tolist()}, {self.num_samples} samples)")


def blend(corpora: Sequence[Any], weights: Sequence[float], seq_len: int,
          num_samples: int, seed: int = 0, *, surplus: float = 0.005,
          documents: Optional[Sequence[Any]] = None, **options: Any
          ) -> BlendedSamples:
  """A `BlendedSamples` of ``num_samples`` over `GPTSamples` of each corpus (a
  ``data.blend`` of corpora).

  Corpus ``d`` gets ``ceil(ceil(num_samples * weight_d) * (1 + surplus))`` samples
  (at least; whole epochs), all with the same ``seed``, as Megatron's
  ``BlendedMegatronDatasetBuilder`` asks (``mid_level_dataset_surplus``).

  Args:
    corpora: token corpora (`mpscale.trainer.data.token_files`).
    weights: one positive float per corpus.
    seq_len: tokens per example.
    num_samples: examples in the blend.
    seed: the seed of every corpus's shuffles.
    surplus: the share of extra samples built per corpus.
    documents: the sequence numbers to use of each corpus (a train/validation
      split), one array (or ``None``: all) per corpus; default all of each.
    **options: the other arguments of `GPTSamples` (``eod_mask_loss``,
      ``cache_dir``...), the same for every corpus.

  Returns:
    The blend, with `BlendedSamples.realised_fractions` for the log.
  """
  if isinstance(corpora, (str, bytes)) or not hasattr(corpora, "__len__"):
    raise validation.fail("corpora", " must be a list of token corpora",
                          validation.ArgumentTypeError)
  normalized = _weights(weights, len(corpora), "corpora")
  num_samples = validation.positive_int("num_samples", num_samples)
  surplus = validation.non_negative_float("surplus", surplus)
  sizes = [int(math.ceil(math.ceil(num_samples * w) * (1 + surplus)))
           for w in normalized.tolist()]
  if documents is None:
    documents = [None] * len(corpora)
  elif isinstance(documents, (str, bytes)) or len(documents) != len(corpora):
    raise validation.ArgumentError(("documents", "corpora"), "{0} must hold one array "
                                   "of sequence numbers (or None) per corpus of {1}")
  samples = [GPTSamples(corpus, seq_len, seed, size, documents=docs, **options)
             for corpus, size, docs in zip(corpora, sizes, documents)]
  return BlendedSamples(samples, weights, num_samples)
