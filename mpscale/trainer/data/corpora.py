"""Token corpora as a run's data: ``data.tokens``, ``data.blend``, ``data.tokenize``.

From the config to the loader::

  corpora  = open_corpus(data.tokens) | open_corpus(p) for each data.blend[i].path
             | tokenizing.cached_corpus(data.path, data.tokenize)  # tokenized once
  D        = a corpus's sequences (its documents)
  held out = its last max(1, round(data.eval_fraction * D)) documents; train: the rest
  train    = GPTSamples(corpus, model.seq_len, seed, train.steps * data.batch_size,
                        documents=train)   # or a ramp-up's samples   # data.tokens
             | blend(corpora, weights, ..., documents=train of each)  # data.blend
  eval     = GPTSamples(corpus, ..., documents=held out): one epoch    # data.tokens
             | blend(corpora, weights, n, documents=held out of each), n =
               data.eval_batches * data.batch_size, or with 0 the samples the held-out
               documents hold                                          # data.blend
  batches  = loader.user_data({"train": train, "eval": eval}, shuffle=False)
             # one corpus, no ramp-up: train read as SampleBatches(train), the same
             # batches gathered a batch at a time

- **Order**: the samples come shuffled by ``seed`` (`mpscale.trainer.data.token_datasets`: the
  documents, then the samples, as Megatron's ``GPTDataset``), and a blend draws from
  its corpora by Megatron's deterministic rule; the loader reads them in that order
  (``data.shuffle`` does not apply). Step ``i`` reads samples ``i * batch_size`` to
  ``(i + 1) * batch_size - 1`` (with ``data.rampup_batch_size``: ``consumed_at(i)``
  onward, ``size_at(i)`` of them); across processes each reads only its rows of
  them.
- **Resume**: the loader's position (the step) is checkpointed, and the samples are a
  pure function of the corpora, ``model.seq_len``, ``seed`` and the sample count: a
  resumed run reads exactly the samples an uninterrupted one would, mid-epoch and
  mid-blend. Raising ``train.steps`` on resume changes the order only where it
  changes the number of epochs the index holds (as Megatron's ``train_samples``).
- **The split** takes the last documents, as Megatron's ``split: "90,10,0"`` does (up
  to rounding; at least one document each way). A flat file without ``data.eod`` is
  one document and cannot be split: give its end-of-document id.
- **Vocabulary**: the built-in model's ``model.vocab_size`` must exceed every id: the
  tokenizer's (``data.tokenizer``) and each corpus's largest, read once at start
  (skipped when the corpus's dtype cannot hold an id that large).
- **Document boundaries**: ``data.eod_mask_loss`` masks the target after each
  end-of-document token (the tiny LM too). ``data.reset_position_ids`` and
  ``data.reset_attention_mask`` add ``position_ids`` and ``segment_ids`` for a user's
  model (``model.provider``) to read; the tiny LM reads neither (learned positions
  ``0..seq_len-1``, causal attention across the documents a sample holds, as Megatron
  without those flags) and refuses them.
- **Blends** log each corpus's realised share of the samples trained on
  (``data/<name>`` columns of ``metrics.csv``, ``data_fractions`` in the summary),
  counted once from the blend's index (`mpscale.trainer.data.loader.SourceShares`).

Errors name the config keys, checked when the config loads (`check`: which keys
go together, the files exist, the weights, the vocabulary) or when the data is
opened (`token_data`: the corpus's contents), before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import grain
import numpy as np

from mpscale import validation
from mpscale.trainer.config import errors
from mpscale.trainer.data import loader
from mpscale.trainer.data import batch_sizes as batch_sizes_lib
from mpscale.trainer.config import schema
from mpscale.trainer.data import token_files
from mpscale.trainer.data import tokenizing
from mpscale.trainer.data import token_datasets as tokens_lib

_OPTIONS = ("token_dtype", "eod", "eod_mask_loss", "reset_position_ids",
            "reset_attention_mask", "tokenizer")
"""The ``data`` keys that only a token corpus reads."""
_SCAN_TOKENS = 1 << 24  # the largest id is looked for in chunks of this


def uses_tokens(data: schema.DataConfig) -> bool:
  """Whether ``data`` trains on a token corpus (``tokens``, ``blend`` or
  ``tokenize``) rather than bytes or a provider."""
  return bool(data.tokens or data.blend or data.tokenize is not None)


def loss_unit(cfg: schema.RunConfig) -> Optional[str]:
  """What the logged loss is per: ``"token"`` for a token corpus, ``"byte"`` for
  the built-in text; ``None`` for a user's model (``model.provider``), whose loss is
  per whatever its ``num_tokens`` counts (examples, for a classifier)."""
  if cfg.model.provider is not None:
    return None
  return "token" if uses_tokens(cfg.data) else "byte"


def _dtype(value: Optional[str]) -> Optional[np.dtype]:
  if value is None:
    return None
  try:
    dtype = np.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not np.issubdtype(dtype, np.integer):
    raise validation.fail("data.token_dtype", f": expected an integer NumPy dtype "
                          f"(uint16, uint32, int32...); got {value!r}")
  return dtype


def _check_path(key: str, path: str, dtype: Optional[np.dtype]) -> None:
  """The corpus ``key`` names exists: an indexed dataset or a flat file."""
  idx, bin_ = token_files.index_file(path), token_files.data_file(path)
  if os.path.isfile(idx):
    if not os.path.isfile(bin_):
      raise validation.fail(key, f": {idx!r} has no {bin_!r} beside it (a Megatron "
                            "indexed dataset is <prefix>.bin + <prefix>.idx)")
    if dtype is not None:
      raise validation.ArgumentError(
          ("data.token_dtype", key), "{0}: {1} is a Megatron indexed dataset, whose "
          ".idx names its dtype; set {0}: null")
    return
  stem, ext = os.path.splitext(path)
  if ext in (".bin", ".idx") and os.path.isfile(token_files.index_file(stem)):
    raise validation.fail(key, f": {path!r} is part of the indexed dataset {stem!r}; "
                          "give its prefix, without .bin/.idx")
  if os.path.isfile(path):
    return
  if os.path.isfile(bin_):
    raise validation.fail(key, f": {bin_!r} has no {idx!r} beside it (a Megatron "
                          "indexed dataset is <prefix>.bin + <prefix>.idx)")
  raise validation.fail(key, f": no token corpus at {path!r}: neither a Megatron "
                        "indexed dataset (<path>.bin + <path>.idx) nor a flat token "
                        "file")


def _sources(data: schema.DataConfig) -> list[tuple[str, str, str]]:
  """``(key, path, name)`` of each corpus of ``data.tokens`` / ``data.blend``."""
  if data.tokens:
    return [("data.tokens", data.tokens, os.path.basename(data.tokens))]
  return [(f"data.blend[{i}].path", b.path, b.name or os.path.basename(b.path))
          for i, b in enumerate(data.blend)]


def _exclusive(cfg: schema.RunConfig) -> None:
  data = cfg.data
  given = [key for key, value in (("data.tokens", data.tokens),
                                  ("data.blend", data.blend),
                                  ("data.tokenize", data.tokenize is not None))
           if value]
  if len(given) > 1:
    raise validation.ArgumentError((given[1], given[0]), "{0} and {1} are exclusive: "
                                   "one token source")
  if not given:
    for name in _OPTIONS:
      value = getattr(data, name)
      if value is not None and value is not False:
        raise validation.fail(f"data.{name}", " applies to a token corpus only: set "
                              "data.tokens, data.blend or data.tokenize (or remove it)")
    return
  others = [k for k, v in (("data.provider", data.provider),
                           ("data.path", data.path)) if v is not None]
  if given[0] == "data.tokenize":  # data.path is the text it tokenizes
    others = [k for k in others if k != "data.path"]
  if others:
    raise validation.ArgumentError((given[0], others[0]), "{0} and {1} are exclusive "
                                   "(one source of data)")


def _check_tokenize(cfg: schema.RunConfig) -> None:
  data, tokenize = cfg.data, cfg.data.tokenize
  if (tokenize.vocab_size is None) == (data.tokenizer is None):
    raise validation.ArgumentError(
        ("data.tokenize.vocab_size", "data.tokenizer"), "{0}: give it (train a "
        "byte-level BPE on the text) or {1} (encode with a tokenizer.json), one of "
        "them")
  if data.token_dtype is not None:
    raise validation.ArgumentError(("data.token_dtype", "data.tokenize"), "{0}: {1} "
                                   "writes an indexed dataset, whose .idx names its "
                                   "dtype; set {0}: null")
  if tokenize.vocab_size is not None:
    validation.integer("data.tokenize.vocab_size", tokenize.vocab_size, 257)
    if cfg.model.provider is None and tokenize.vocab_size > cfg.model.vocab_size:
      raise validation.ArgumentError(
          ("model.vocab_size", "data.tokenize.vocab_size"), f"{{0}} "
          f"({cfg.model.vocab_size}) must hold the ids of {{1}} "
          f"({tokenize.vocab_size})")
  if data.path is not None and not os.path.exists(data.path):
    raise validation.fail("data.path", f": no file or folder {data.path!r} to "
                          "tokenize")


def _check_blend(blend: tuple[schema.BlendConfig, ...]) -> None:
  names: dict[str, int] = {}
  for i, entry in enumerate(blend):
    if not entry.path:
      raise validation.fail(f"data.blend[{i}].path", " is missing: each corpus of "
                            "the blend needs its path")
    if entry.weight is None:
      raise validation.fail(f"data.blend[{i}].weight", " is missing: each corpus of "
                            "the blend needs its weight (> 0)")
    validation.positive_float(f"data.blend[{i}].weight", entry.weight)
    name = entry.name or os.path.basename(entry.path)
    if name in names:
      raise validation.ArgumentError(
          (f"data.blend[{i}].name", f"data.blend[{names[name]}]"), f"{{0}}: {name!r} "
          "names {1} too; name each corpus apart (it names its data/<name> column)")
    names[name] = i


def _check_options(cfg: schema.RunConfig, tokenizer: Any) -> None:
  data, built_in = cfg.data, cfg.model.provider is None
  for name in ("reset_position_ids", "reset_attention_mask"):
    if getattr(data, name) and built_in:
      what = "position_ids" if name == "reset_position_ids" else "segment_ids"
      raise validation.fail(
          f"data.{name}", f": the tiny LM reads no {what} (learned positions "
          "0..seq_len-1, causal attention over the whole sample); a user's model "
          "(model.provider) may read them. Set it false")
  needs = [n for n in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
           if getattr(data, n)]
  has_eod = (data.eod is not None or data.tokenize is not None or (
      tokenizer is not None and tokenizing.eod_id(tokenizer, name=None) is not None))
  if needs and not has_eod:
    raise validation.ArgumentError((f"data.{needs[0]}", "data.eod"), "{0} needs the "
                                   "end-of-document token id: set {1}")
  if data.eod is not None:
    validation.integer("data.eod", data.eod, 0)
    if built_in and data.eod >= cfg.model.vocab_size:
      raise validation.ArgumentError(("data.eod", "model.vocab_size"), f"{{0}} "
                                     f"({data.eod}) must be an id of {{1}} "
                                     f"({cfg.model.vocab_size})")
  if tokenizer is not None and built_in:
    size = tokenizing.vocabulary_size(tokenizer)
    if size > cfg.model.vocab_size:
      raise validation.ArgumentError(
          ("model.vocab_size", "data.tokenizer"), f"{{0}} ({cfg.model.vocab_size}) "
          f"must hold the {size} ids of {{1}}")


def check(cfg: schema.RunConfig) -> None:
  """Checks the token-corpus keys of ``cfg`` without reading the corpora: which keys
  go together, that the files exist, the blend's weights and names, the tokenizer
  and the vocabulary it needs, the options at document boundaries.

  Raises:
    ArgumentError: (``ArgumentTypeError`` for a wrong type) whose ``names`` are the
      config keys at fault.
  """
  _exclusive(cfg)
  data = cfg.data
  if not uses_tokens(data):
    return
  dtype = _dtype(data.token_dtype)
  if data.tokenize is not None:
    _check_tokenize(cfg)
  _check_blend(data.blend)
  for key, path, _ in _sources(data):
    _check_path(key, path, dtype)
  tokenizer = (None if data.tokenizer is None
               else tokenizing.load_tokenizer(data.tokenizer, "data.tokenizer"))
  _check_options(cfg, tokenizer)


# ------------------------------------------------------------------ the data


def split_documents(count: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """``(train, held_out)`` sequence numbers of a corpus of ``count``: the last
  ``max(1, round(eval_fraction * count))`` held out (Megatron's ``split``, at least
  one each way).

  Raises:
    ValueError: naming ``count`` when it is below 2.
  """
  if count < 2:
    raise validation.fail("count", f" ({count}) must be >= 2 documents to hold some "
                          "out")
  held = min(max(1, round(eval_fraction * count)), count - 1)
  return (np.arange(count - held, dtype=np.int32),
          np.arange(count - held, count, dtype=np.int32))


def max_token_id(corpus: token_files.Corpus) -> int:
  """The largest id in ``corpus`` (all its tokens, read in chunks); -1 if none."""
  if isinstance(corpus, token_files.FlatTokens):
    tokens = corpus.tokens
  else:
    path = token_files.data_file(corpus.path)
    size = os.path.getsize(path) // corpus.dtype.itemsize
    tokens = (np.memmap(path, dtype=corpus.dtype, mode="r", shape=(size,)) if size
              else np.zeros(0, corpus.dtype))
  top = -1
  for first in range(0, len(tokens), _SCAN_TOKENS):
    top = max(top, int(tokens[first:first + _SCAN_TOKENS].max()))
  return top


@dataclasses.dataclass
class _Corpus:
  key: str
  """The config key naming it."""
  name: str
  corpus: token_files.Corpus
  train: np.ndarray
  held_out: np.ndarray


def _open(cfg: schema.RunConfig, key: str, path: str, name: str,
          eod: Optional[int]) -> _Corpus:
  corpus = errors.keyed(key, lambda: token_files.open_corpus(
      path, _dtype(cfg.data.token_dtype), eod),
      {"path": key, "prefix": key, "dtype": "data.token_dtype", "eod": "data.eod"})
  if len(corpus) < 2:
    hint = (" (a flat file without data.eod is one document: set data.eod, its "
            "end-of-document id)" if isinstance(corpus, token_files.FlatTokens)
            and eod is None else "")
    raise validation.ArgumentError(
        ("data.eval_fraction", key), f"{{0}}: {{1}} holds {len(corpus)} document(s); "
        f"evaluation holds whole documents out, so it needs 2 or more{hint}")
  train, held_out = split_documents(len(corpus), cfg.data.eval_fraction)
  sizes = np.asarray(corpus.sequence_lengths)
  for part, documents in (("training", train), ("held-out", held_out)):
    tokens = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens < cfg.model.seq_len + 1:
      raise validation.ArgumentError(
          ("data.eval_fraction", key, "model.seq_len"), f"{{0}} "
          f"({cfg.data.eval_fraction}): the {part} documents of {{1}} hold {tokens} "
          f"tokens, fewer than one sample ({{2}} + 1 = {cfg.model.seq_len + 1})")
  return _Corpus(key, name, corpus, train, held_out)


def _check_ids(cfg: schema.RunConfig, corpora: list[_Corpus],
               tokenizer_path: Optional[str], tokenizer_key: str) -> None:
  """Every id of the corpora is below ``model.vocab_size`` (the built-in model) and
  below the tokenizer's vocabulary (``data.tokenizer``, which decodes the samples:
  a corpus written by another tokenizer holds ids it does not know)."""
  limits = []
  if cfg.model.provider is None:
    limits.append((cfg.model.vocab_size, "model.vocab_size",
                   "raise {0} to at least {top}"))
  if tokenizer_path is not None:
    size = tokenizing.vocabulary_size(
        tokenizing.load_tokenizer(tokenizer_path, tokenizer_key))
    limits.append((size, tokenizer_key, "{1} was written by another tokenizer: "
                   "give the one that wrote it"))
  for c in corpora:
    top = None  # the corpus is read once, and only where its dtype could exceed
    for size, key, fix in limits:
      if np.iinfo(c.corpus.dtype).max < size:
        continue  # no id of its dtype reaches it
      top = max_token_id(c.corpus) if top is None else top
      if top >= size:
        raise validation.ArgumentError(
            (key, c.key), f"{{0}} ({size} ids) must hold every token id; {{1}} holds "
            f"id {top}: " + fix.format("{0}", "{1}", top=top + 1))


def _eod(cfg: schema.RunConfig, tokenizer_path: Optional[str]) -> Optional[int]:
  """``data.eod``, else the tokenizer's ``<|endoftext|>`` (if it has one)."""
  if cfg.data.eod is not None or tokenizer_path is None:
    return cfg.data.eod
  return tokenizing.eod_id(tokenizing.load_tokenizer(tokenizer_path, "data.tokenizer"),
                           name=None)


def _sample_keys(key: str) -> dict[str, str]:
  return {"seq_len": "model.seq_len", "seed": "seed", "num_samples": "train.steps",
          "eod": "data.eod", "corpus": key, "corpora": "data.blend",
          "weights": "data.blend", "eod_mask_loss": "data.eod_mask_loss",
          "reset_position_ids": "data.reset_position_ids",
          "reset_attention_mask": "data.reset_attention_mask"}


def _samples(cfg: schema.RunConfig, corpora: list[_Corpus], eod: Optional[int],
             held_out: bool) -> Any:
  """The training samples (or the held-out ones) of the corpora."""
  data, seq_len = cfg.data, cfg.model.seq_len
  options = dict(eod=eod, eod_mask_loss=data.eod_mask_loss,
                 reset_position_ids=data.reset_position_ids,
                 reset_attention_mask=data.reset_attention_mask)
  part = (lambda c: c.held_out) if held_out else (lambda c: c.train)
  # The samples of the whole run: train.steps x data.batch_size, or a ramp-up's.
  sizes = loader.batch_sizes(cfg) or batch_sizes_lib.BatchSizes(data.batch_size)
  count = sizes.consumed_at(cfg.train.steps)
  if not data.blend:
    c = corpora[0]
    return errors.keyed(c.key, lambda: tokens_lib.GPTSamples(
        c.corpus, seq_len, cfg.seed, None if held_out else count,
        documents=part(c), **options), _sample_keys(c.key))
  if held_out:
    sizes = [np.asarray(c.corpus.sequence_lengths) for c in corpora]
    count = data.eval_batches * data.batch_size or sum(
        (int(np.sum(s[c.held_out], dtype=np.int64)) - 1) // seq_len
        for s, c in zip(sizes, corpora))
  weights = [b.weight for b in data.blend]
  return errors.keyed("data.blend", lambda: tokens_lib.blend(
      [c.corpus for c in corpora], weights, seq_len, count, cfg.seed,
      documents=[part(c) for c in corpora], **options), _sample_keys("data.blend"))


class SampleBatches:
  """The training batches of one corpus's samples, as a random-access grain source:
  item ``step`` is this process's ``rows`` ``[start, stop)`` of the global batch of
  ``step``, examples ``step * batch_size + r`` (``start <= r < stop``, modulo
  ``len(samples)``) stacked, read at once by `tokens.GPTSamples.examples`.

  The very batches (and the same iterator position, the step) that
  ``loader.user_data`` makes of ``samples`` without a shuffle
  (``ds.repeat().batch(...)`` and its row striding), without grain's and
  ``GPTSamples.__getitem__``'s cost per example. Without a batch-size ramp-up only.
  """

  def __init__(self, samples: tokens_lib.GPTSamples, batch_size: int,
               rows: Optional[tuple[int, int]] = None):
    self.samples, self.batch_size = samples, batch_size
    self.rows = (0, batch_size) if rows is None else tuple(rows)
    self._offsets = np.arange(self.rows[0], self.rows[1], dtype=np.int64)

  def __len__(self) -> int:
    return 2**62  # endless: steps, not epochs

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    n = len(self.samples)
    first = (int(step) * self.batch_size) % n
    return self.samples.examples((first + self._offsets) % n)

  def __repr__(self) -> str:
    return (f"SampleBatches({self.samples!r}, batch_size={self.batch_size}, "
            f"rows={self.rows})")


def token_data(cfg: schema.RunConfig, rows: Optional[tuple[int, int]] = None, *,
               progress: Optional[bool] = False) -> loader.Data:
  """The run's `mpscale.trainer.data.loader.Data` from its token corpora (the module
  docstring); ``rows`` of each batch (default: all). ``data.tokenize`` builds its
  cached copy first if it is not there (with a progress bar if ``progress``).

  Raises:
    ArgumentError: naming the config keys: a corpus that cannot be read, too few
      documents or tokens to split, an id beyond ``model.vocab_size``.
  """
  data = cfg.data
  tokenizer = data.tokenizer
  if data.tokenize is not None:
    cached = errors.keyed("data.tokenize", lambda: tokenizing.cached_corpus(
        data.path, vocab_size=data.tokenize.vocab_size, tokenizer=data.tokenizer,
        cache_dir=data.tokenize.cache_dir, progress=progress),
        {"inputs": "data.path", "vocab_size": "data.tokenize.vocab_size",
         "tokenizer": "data.tokenizer"})
    tokenizer = cached.tokenizer
    name = os.path.basename(data.path) if data.path else "stdlib"
    sources = [("data.tokenize", cached.prefix, name)]
    source = (f"{data.path or 'stdlib docstrings'}, tokenized "
              f"({os.path.dirname(cached.prefix)})")
  else:
    sources = _sources(data)
    source = (data.tokens if data.tokens else "blend: " + ", ".join(
        f"{name} {b.weight:g}" for (_, _, name), b in zip(sources, data.blend)))
  eod = _eod(cfg, tokenizer)
  corpora = [_open(cfg, key, path, name, eod) for key, path, name in sources]
  _check_ids(cfg, corpora, tokenizer,
             "data.tokenize" if data.tokenize is not None else "data.tokenizer")
  train = _samples(cfg, corpora, eod, held_out=False)
  held_out = _samples(cfg, corpora, eod, held_out=True)
  key = sources[0][0] if len(sources) == 1 else "data.blend"
  run_data = loader.user_data({"train": train, "eval": held_out}, cfg, key, rows,
                              shuffle=False)
  run_data.source = source
  run_data.tokenizer = tokenizer
  if not data.blend and run_data.sizes is None:  # the same batches, read at once
    run_data.train = grain.MapDataset.source(SampleBatches(train, data.batch_size,
                                                           run_data.rows))
  if data.blend:
    run_data.shares = loader.SourceShares([c.name for c in corpora],
                                          train.dataset_index, data.batch_size,
                                          cfg.train.steps, run_data.sizes)
  return run_data
