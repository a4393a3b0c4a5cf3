"""Text to token corpora with a Hugging Face ``tokenizers`` tokenizer: ``mpscale
tokenize``, and the cached copy a config's ``data.tokenize`` trains on.

The text comes as **documents** (`read_documents`):

- a JSON-lines file (``.jsonl``, ``.json``): one document per line, the line's
  ``key`` field (``"text"``), as Megatron-LM's ``tools/preprocess_data.py`` reads;
- any other file: the whole file is one document (UTF-8; invalid bytes replaced);
- a folder: each of its non-hidden files, sorted, as above;
- the embedded corpus: one document per standard-library module
  (`mpscale.trainer.data.text.stdlib_documents`).

`tokenize` encodes each document without the tokenizer's own special tokens, appends
the end-of-document token (``<|endoftext|>``; Megatron's ``--append-eod``) and writes
it as one sequence of a Megatron indexed dataset (``<out>.bin`` + ``<out>.idx``) or
appends it to a flat token file (`mpscale.trainer.data.token_files`), in the dtype the
vocabulary needs (`mpscale.trainer.data.token_files.token_dtype`)::

  tokenizer = tokenizer.json given, or train_bpe(documents, vocab_size)
  for each document:  ids = tokenizer.encode(text).ids + [eod];  write(ids)

`train_bpe` trains a **byte-level BPE** (GPT-2's pre-tokenizer without a prefix space,
its byte-level decoder): every string encodes, and ``decode(encode(text)) == text``.
Its id 0 is ``<|endoftext|>``, then come the 256 byte symbols, then the merges, up to
``vocab_size`` ids (fewer when the text has fewer pairs to merge).

`cached_corpus` is ``data.tokenize``: the text tokenized once into
``<cache>/tokens/<name>-<key>/`` (``corpus.bin``, ``corpus.idx``, ``tokenizer.json``,
``info.json``; the sample index goes to its ``cache/``), where ``key`` hashes the
documents, the vocabulary size or tokenizer, the end-of-document token and the
``tokenizers`` version; reused while they stay the same. The folder is built under a
temporary name and renamed, so processes building it at once leave one whole copy.

References:
  Hugging Face tokenizers, "Training from memory" and the byte-level BPE:
  https://huggingface.co/docs/tokenizers/training_from_memory
  Megatron-LM, ``tools/preprocess_data.py`` (JSON-lines input, ``--append-eod``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import tokenizers
from rich.console import Console

from mpscale import validation
from mpscale.trainer.config import schema
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.runs import progress as progress_lib
from mpscale.trainer.data import token_files

EOD_TOKEN = "<|endoftext|>"
"""The end-of-document token `tokenize` appends (GPT-2's)."""

FORMATS = ("indexed", "flat")
"""What `tokenize` writes: a Megatron indexed dataset, or a flat token file."""

_JSON_LINES = (".jsonl", ".json")
_BATCH = 256  # documents encoded at once (the tokenizer runs them in parallel)
_CACHE_FORMAT = 1  # changes when cached_corpus writes something else


@dataclasses.dataclass(frozen=True)
class Document:
  """One document of the input: its text and the input bytes it came from."""
  text: str
  bytes: int
  """Bytes of input read for it (for the progress bar)."""


def _files(path: str, name: str) -> list[str]:
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    found = []
    for folder, subfolders, names in os.walk(path):
      subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
      found += [os.path.join(folder, n) for n in sorted(names) if not n.startswith(".")]
    if found:
      return found
    raise validation.fail(name, f": the folder {path!r} holds no files")
  raise validation.fail(name, f": no file or folder {path!r}")


def _json_lines(path: str, key: str, key_name: str) -> Iterator[Document]:
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise validation.fail("inputs", f": {path}:{number} is not JSON ({e.msg}); a "
                              ".jsonl file holds one JSON object per line") from None
      text = record.get(key) if isinstance(record, dict) else None
      if not isinstance(text, str):
        raise validation.fail(key_name, f" {key!r}: {path}:{number} has no string "
                              f"field {key!r} (its keys: "
                              f"{sorted(record) if isinstance(record, dict) else '-'})")
      yield Document(text, len(line))


def read_documents(inputs: Sequence[str], key: str = "text", *, embedded: bool = False,
                   key_name: str = "key") -> Iterator[Document]:
  """The documents of ``inputs`` (files or folders; see the module docstring), or of
  the embedded corpus when ``embedded``, in order.

  Raises:
    ValueError: naming ``inputs`` (missing, empty, not JSON) or ``key_name`` (a
      JSON line without the field).
  """
  if embedded:
    for text in data_lib.stdlib_documents():
      yield Document(text, len(text.encode("utf-8")))
    return
  for path in inputs:
    for file in _files(os.fspath(path), "inputs"):
      if file.endswith(_JSON_LINES):
        yield from _json_lines(file, key, key_name)
      else:
        with open(file, "rb") as f:
          raw = f.read()
        yield Document(raw.decode("utf-8", errors="replace"), len(raw))


def input_bytes(inputs: Sequence[str], *, embedded: bool = False) -> int:
  """Bytes of the input (the progress bar's total)."""
  if embedded:
    return sum(len(t.encode("utf-8")) for t in data_lib.stdlib_documents())
  return sum(os.path.getsize(f) for path in inputs for f in _files(os.fspath(path),
                                                                    "inputs"))


def train_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = EOD_TOKEN,
              name: str = "vocab_size") -> tokenizers.Tokenizer:
  """A byte-level BPE of up to ``vocab_size`` ids trained on ``texts``: id 0 is
  ``eod_token``, then the 256 bytes, then the merges (see the module docstring).

  Raises:
    ValueError: naming ``name`` when ``vocab_size`` < 257 (the bytes and the
      end-of-document token).

  Example:
    >>> from mpscale.trainer.data.tokenizing import decode, encode, train_bpe
    >>> bpe = train_bpe(["the cat sat on the mat"] * 10, vocab_size=300)
    >>> ids = encode(bpe, "the mat, ünïcödé")
    >>> bpe.token_to_id("<|endoftext|>"), decode(bpe, ids)
    (0, 'the mat, ünïcödé')
  """
  vocab_size = validation.integer(name, vocab_size, 257)
  from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[eod_token], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer=trainer)
  return tokenizer


def load_tokenizer(path: str, name: str = "tokenizer") -> tokenizers.Tokenizer:
  """The Hugging Face tokenizer saved at ``path`` (a ``tokenizer.json``, or a
  checkpoint folder holding one).

  Raises:
    ValueError: naming ``name`` for a missing or unreadable file.
  """
  path = schema.tokenizer_file(os.fspath(path))
  if not os.path.isfile(path):
    raise validation.fail(name, f": no file {path!r} (a Hugging Face tokenizer.json)")
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises its own kind
    raise validation.fail(name, f": {path!r} is not a Hugging Face tokenizer.json "
                          f"({type(e).__name__}: {str(e)[:200]})") from None


def vocabulary_size(tokenizer: tokenizers.Tokenizer) -> int:
  """Ids the tokenizer can give (its added tokens included)."""
  return tokenizer.get_vocab_size(with_added_tokens=True)


def eod_id(tokenizer: tokenizers.Tokenizer, eod_token: str = EOD_TOKEN,
           name: Optional[str] = "eod_token") -> Optional[int]:
  """The id of ``eod_token``; ``None`` when the tokenizer lacks it and ``name`` is
  ``None``, else a ``ValueError`` naming ``name``."""
  found = tokenizer.token_to_id(eod_token)
  if found is None and name is not None:
    raise validation.fail(name, f" {eod_token!r} is not a token of the tokenizer; "
                          "name its end-of-document token")
  return found


def encode(tokenizer: tokenizers.Tokenizer, text: str) -> np.ndarray:
  """``text`` as int32 ids, without the tokenizer's special tokens."""
  return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)


def decode(tokenizer: tokenizers.Tokenizer, ids: Any) -> str:
  """``ids`` as text, special tokens (``<|endoftext|>``) written out."""
  return tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                          skip_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class Tokenized:
  """What `tokenize` wrote."""
  path: str
  """The corpus: the indexed dataset's prefix, or the flat file."""
  format: str
  """``indexed`` or ``flat``."""
  tokenizer: Optional[str]
  """The tokenizer.json it saved (a trained BPE), or ``None`` (one was given)."""
  documents: int
  tokens: int
  """Tokens written, the end-of-document tokens included."""
  vocab_size: int
  """The tokenizer's ids."""
  eod: int
  """The end-of-document id appended to each document."""
  dtype: str
  """The tokens' dtype on disk."""

  def text(self) -> str:
    """A line saying what was written and how a config reads it."""
    files = (f"{self.path}.bin + .idx" if self.format == "indexed" else self.path)
    flat = "" if self.format == "indexed" else f", data.token_dtype: {self.dtype}"
    saved = f"; tokenizer {self.tokenizer}" if self.tokenizer else ""
    documents = "1 document" if self.documents == 1 else f"{self.documents} documents"
    return (f"{documents}, {self.tokens} tokens ({self.dtype}, "
            f"vocabulary {self.vocab_size}, end of document {self.eod}) -> {files}"
            f"{saved} (config: data.tokens: {self.path}, data.eod: {self.eod}{flat})")


class _Writer:
  """Appends documents to an indexed dataset or a flat file; removes what it wrote
  when closed after an error."""

  def __init__(self, out: str, fmt: str, dtype: np.dtype):
    self.fmt, self.out, self.dtype = fmt, out, dtype
    if fmt == "indexed":
      self.writer = token_files.IndexedDatasetWriter(out, dtype)
    else:
      self.file = open(out, "wb")

  def add(self, ids: np.ndarray) -> None:
    if self.fmt == "indexed":
      self.writer.add_document(ids)
    else:
      self.file.write(ids.astype(self.dtype).tobytes())

  def close(self, ok: bool) -> None:
    if self.fmt == "indexed":
      self.writer.__exit__(None if ok else ValueError, None, None)
    else:
      self.file.close()
      if not ok:
        os.remove(self.out)


def _progress(show: Optional[bool], console: Optional[Console]) -> Any:
  console = console or Console(stderr=True)
  return progress_lib.make_progress(
      console, disable=not (console.is_terminal if show is None else show))


def tokenize(inputs: Sequence[str], out: str, *, tokenizer: Optional[str] = None,
             vocab_size: Optional[int] = None, key: str = "text",
             fmt: str = "indexed", eod_token: str = EOD_TOKEN, embedded: bool = False,
             save_tokenizer: Optional[str] = None, progress: Optional[bool] = None,
             console: Optional[Console] = None, overwrite: bool = False
             ) -> Tokenized:
  """Writes the documents of ``inputs`` (or the embedded corpus) as a token corpus
  (the module docstring): ``mpscale tokenize``.

  Args:
    inputs: text files, JSON-lines files or folders.
    out: the corpus: an indexed dataset's prefix, or the flat file (its folder is
      made when missing).
    tokenizer: a Hugging Face ``tokenizer.json`` to encode with.
    vocab_size: instead, train a byte-level BPE of this many ids on the input
      (`train_bpe`), saved as ``save_tokenizer`` (default ``tokenizer.json`` in
      ``out``'s folder).
    key: the text field of a JSON-lines file's records.
    fmt: ``"indexed"`` or ``"flat"``.
    eod_token: the end-of-document token appended to each document.
    embedded: read the embedded corpus instead of ``inputs``.
    save_tokenizer: where a trained BPE goes.
    progress: show a progress bar (rich, on ``console``); default: on a terminal.
    console: where the bar goes; default stderr.
    overwrite: replace a corpus or a tokenizer that is already there; by default
      that is refused before anything is written (a corpus is only read right
      with the tokenizer that wrote it).

  Returns:
    A `Tokenized`: what was written.

  Raises:
    ValueError: naming ``inputs``, ``tokenizer``, ``vocab_size``, ``key``, ``fmt``
      or ``eod_token`` (they keep these names; ``mpscale tokenize`` says them as its
      flags).
  """
  fmt = validation.one_of("fmt", fmt, FORMATS)
  if (tokenizer is None) == (vocab_size is None):
    raise validation.ArgumentError(("tokenizer", "vocab_size"), "give {0} (a "
                                   "tokenizer.json) or {1} (train a BPE), one of them")
  if embedded == bool(inputs):
    raise validation.fail("inputs", ": give input files or the embedded corpus, one "
                          "of them")
  folder = os.path.dirname(os.path.abspath(out))
  saved = None if tokenizer is not None else (
      save_tokenizer or os.path.join(folder, "tokenizer.json"))
  _refuse_overwrite(out, fmt, saved, overwrite)
  total = input_bytes(inputs, embedded=embedded)
  os.makedirs(folder, exist_ok=True)  # the input checked first: a typo makes none
  documents = lambda: read_documents(inputs, key, embedded=embedded)
  bar = _progress(progress, console)
  with bar:
    task = bar.add_task("tokenize", total=total, info="")
    if tokenizer is None:
      bar.update(task, info=f"training a byte-level BPE of {vocab_size} ids")
      model = train_bpe((d.text for d in documents()), vocab_size, eod_token)
      model.save(saved)
    else:
      model = load_tokenizer(tokenizer)
    eod = eod_id(model, eod_token)
    size = vocabulary_size(model)
    dtype = token_files.token_dtype(size)
    writer = _Writer(out, fmt, dtype)
    count, tokens = 0, 0
    try:
      for chunk in _chunks(documents(), _BATCH):
        encoded = model.encode_batch([d.text for d in chunk],
                                     add_special_tokens=False)
        for doc, enc in zip(chunk, encoded):
          ids = np.asarray(enc.ids + [eod], np.int64)
          writer.add(ids)
          count, tokens = count + 1, tokens + len(ids)
        bar.update(task, advance=sum(d.bytes for d in chunk),
                   info=f"{count} documents, {tokens} tokens")
    except BaseException:
      writer.close(ok=False)
      raise
    writer.close(ok=True)
  return Tokenized(os.fspath(out), fmt, saved, count, tokens, size, eod,
                   str(dtype.newbyteorder("=")))


def _refuse_overwrite(out: str, fmt: str, tokenizer: Optional[str],
                      overwrite: bool) -> None:
  """Refuses (naming ``out`` or ``vocab_size``) to replace an existing corpus or
  tokenizer, unless ``overwrite``."""
  if overwrite:
    return
  corpus = [out + ext for ext in (".bin", ".idx")] if fmt == "indexed" else [out]
  there = [p for p in corpus if os.path.exists(p)]
  if there:
    raise validation.fail("out", f": {there[0]!r} exists; writing over a corpus is "
                          "refused (give another --out, or --overwrite)")
  if tokenizer is not None and os.path.exists(tokenizer):
    raise validation.fail(
        "vocab_size", f": the trained BPE would replace {tokenizer!r}, the tokenizer "
        "of the corpora written beside it, which then decode wrong; write into "
        "another folder, encode with it (--tokenizer), or --overwrite")


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
  chunk = []
  for item in items:
    chunk.append(item)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


# ------------------------------------------------------------------ data.tokenize


def default_cache_dir() -> str:
  """``$MPSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpscale``, else
  ``~/.cache/mpscale``."""
  if os.environ.get("MPSCALE_CACHE_DIR"):
    return os.environ["MPSCALE_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                           ".cache")
  return os.path.join(base, "mpscale")


@dataclasses.dataclass(frozen=True)
class CachedCorpus:
  """A tokenized copy of a text (`cached_corpus`)."""
  prefix: str
  """The indexed dataset's prefix."""
  tokenizer: str
  """Its ``tokenizer.json``."""
  eod: int
  """The end-of-document id."""
  built: bool
  """Whether this call built it (else it was in the cache)."""


def _digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.md5(f.read(), usedforsecurity=False).hexdigest()


def cached_corpus(text: Optional[str], *, vocab_size: Optional[int] = None,
                  tokenizer: Optional[str] = None, cache_dir: Optional[str] = None,
                  progress: Optional[bool] = False) -> CachedCorpus:
  """``data.tokenize``: the documents of ``text`` (a file or folder; ``None``: the
  embedded corpus) tokenized once, as an indexed dataset in the cache (see the module
  docstring), and reused.

  Args:
    text: what to tokenize; ``None``: the embedded corpus.
    vocab_size: train a byte-level BPE of this many ids on it ...
    tokenizer: ... or encode with this ``tokenizer.json``.
    cache_dir: the cache (`default_cache_dir`); the copy goes under ``tokens/``.
    progress: show `tokenize`'s progress bar while building.

  Raises:
    ValueError: naming ``inputs``, ``vocab_size`` or ``tokenizer``.
  """
  inputs = [] if text is None else [text]
  hasher = hashlib.md5(usedforsecurity=False)
  for document in read_documents(inputs, embedded=text is None):
    hasher.update(hashlib.md5(document.text.encode("utf-8"),
                              usedforsecurity=False).digest())
  description = {"format": _CACHE_FORMAT, "tokenizers": tokenizers.__version__,
                 "eod_token": EOD_TOKEN, "documents_md5": hasher.hexdigest(),
                 "vocab_size": vocab_size,
                 "tokenizer_md5": None if tokenizer is None else _digest(tokenizer)}
  key = hashlib.md5(json.dumps(description, sort_keys=True).encode(),
                    usedforsecurity=False).hexdigest()[:16]
  name = "stdlib" if text is None else os.path.basename(os.path.normpath(text))
  root = os.path.join(cache_dir or default_cache_dir(), "tokens")
  folder = os.path.join(root, f"{name}-{key}")
  info_path = os.path.join(folder, "info.json")
  built = False
  if not os.path.isfile(info_path):
    os.makedirs(root, exist_ok=True)
    building = tempfile.mkdtemp(dir=root, prefix=f".{name}-{key}.")
    try:
      made = tokenize(inputs, os.path.join(building, "corpus"), tokenizer=tokenizer,
                      vocab_size=vocab_size, embedded=text is None,
                      save_tokenizer=os.path.join(building, "tokenizer.json"),
                      progress=progress)
      if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(building, "tokenizer.json"))
      info = {**description, **dataclasses.asdict(made), "path": "corpus",
              "tokenizer": "tokenizer.json", "source": text or "stdlib docstrings"}
      with open(os.path.join(building, "info.json"), "w") as f:
        json.dump(info, f, indent=1)
      try:
        os.rename(building, folder)
        built = True
      except OSError:  # another process renamed its copy first: use that one
        if not os.path.isfile(info_path):
          raise
    finally:
      shutil.rmtree(building, ignore_errors=True)
  with open(info_path) as f:
    info = json.load(f)
  return CachedCorpus(os.path.join(folder, "corpus"),
                      os.path.join(folder, "tokenizer.json"), int(info["eod"]), built)
