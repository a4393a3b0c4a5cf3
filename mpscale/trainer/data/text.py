"""Text data for the tiny LM: an embedded corpus, byte-level tokens, and batches.

The default corpus is real English text that ships with every Python install: the
docstrings of a fixed, sorted list of standard-library modules (`STDLIB_MODULES`), read
from their source files with ``ast`` (nothing is imported), module by module and, within
a module, in source order. Tokens are the UTF-8 bytes (vocabulary 256).

The held-out split takes whole blocks of `BLOCK_BYTES` bytes, chosen by a fixed
permutation, so both splits mix all modules. A training batch is a pure function of
``(seed, step)``: resuming at step ``s`` sees exactly the batches an uninterrupted run
would. Evaluation reads the held-out split in order, as non-overlapping windows, with
the padding of the last window masked out.

The corpus differs between Python versions (their docstrings do), not between runs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import sysconfig
from typing import Iterator, Optional, Union

import numpy as np

from mpscale import validation

STDLIB_MODULES: tuple[str, ...] = tuple(sorted((
    "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.tasks",
    "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "concurrent.futures._base", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "doctest", "email.message", "enum", "fileinput",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "heapq", "hmac",
    "html.parser", "http.client", "http.server", "inspect", "ipaddress", "json",
    "json.decoder", "logging", "logging.handlers", "mailbox", "mimetypes", "numbers",
    "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pprint", "queue",
    "random", "re", "sched", "secrets", "selectors", "shlex", "shutil", "socket",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "traceback", "typing", "unittest.case",
    "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref",
    "zipfile",
)))
"""The modules whose docstrings form the embedded corpus (about 650 KB on 3.11)."""

BLOCK_BYTES = 4096
"""Granularity of the train/held-out split."""

Batch = dict[str, np.ndarray]
"""``{"inputs": int32 [B, T], "targets": int32 [B, T], "mask": float32 [B, T]}``."""


def _module_file(root: str, module: str) -> Optional[str]:
  base = os.path.join(root, *module.split("."))
  for path in (base + ".py", os.path.join(base, "__init__.py")):
    if os.path.isfile(path):
      return path
  return None


def _docstrings(source: bytes) -> list[str]:
  """Docstrings of a module, its classes and functions, in source order."""
  found = []

  def visit(node: ast.AST) -> None:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=True)
      if doc:
        found.append(doc)
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        visit(child)

  visit(ast.parse(source))
  return found


@functools.lru_cache(maxsize=1)
def stdlib_documents() -> tuple[str, ...]:
  """The embedded corpus as documents, one per module of `STDLIB_MODULES` present in
  this Python: a ``# module NAME`` line, then its docstrings, separated by blank
  lines (cached). The token corpora's documents (`mpscale.trainer.data.tokenizing`)."""
  root = sysconfig.get_paths()["stdlib"]
  parts = []
  for module in STDLIB_MODULES:
    path = _module_file(root, module)
    if path is None:
      continue
    with open(path, "rb") as f:
      docs = _docstrings(f.read())
    if docs:
      parts.append(f"# module {module}\n\n" + "\n\n".join(docs))
  if not parts:
    raise RuntimeError(f"no standard-library sources found under {root}")
  return tuple(parts)


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> bytes:
  """The embedded corpus: standard-library docstrings as UTF-8 bytes (cached).

  Returns:
    The `stdlib_documents` separated by blank lines.
  """
  return ("\n\n".join(stdlib_documents()) + "\n").encode("utf-8")


def read_text(path: Union[str, os.PathLike]) -> bytes:
  """The bytes of a text file, or of every non-hidden file under a folder (sorted).

  Raises:
    ValueError: naming ``path`` when it does not exist or holds no data.
  """
  path = os.fspath(path)
  if os.path.isfile(path):
    files = [path]
  elif os.path.isdir(path):
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
      files.extend(os.path.join(dirpath, f) for f in sorted(filenames)
                   if not f.startswith("."))
  else:
    raise ValueError(f"data path {path!r} is neither a file nor a folder")
  chunks = []
  for name in files:
    with open(name, "rb") as f:
      chunks.append(f.read())
  data = b"\n\n".join(c for c in chunks if c)
  if not data:
    raise ValueError(f"data path {path!r} holds no text")
  return data


def tokenize(text: Union[str, bytes]) -> np.ndarray:
  """Byte-level tokens: the UTF-8 bytes of ``text`` as ``uint8`` ids (vocab 256)."""
  if isinstance(text, str):
    text = text.encode("utf-8")
  return np.frombuffer(text, dtype=np.uint8).copy()


def detokenize(tokens: np.ndarray) -> str:
  """Tokens back to text (invalid UTF-8 sequences replaced)."""
  return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def split_tokens(tokens: np.ndarray, eval_fraction: float
                ) -> tuple[np.ndarray, np.ndarray]:
  """``(train, held_out)``: whole blocks of `BLOCK_BYTES` tokens, chosen by a fixed
  permutation, go to the held-out split (at least one block each way).

  Raises:
    ValueError: if ``eval_fraction`` is outside (0, 1) or the text is too short.
  """
  validation.float_in("eval_fraction", eval_fraction, 0.0, 1.0, low_open=True,
                      high_open=True)
  num_blocks = -(-len(tokens) // BLOCK_BYTES)
  block = BLOCK_BYTES
  if num_blocks < 2:  # short text: split it in two blocks
    block = -(-len(tokens) // 2)
    num_blocks = 2
  num_eval = min(max(1, round(eval_fraction * num_blocks)), num_blocks - 1)
  held_out = set(np.random.default_rng(0).permutation(num_blocks)[:num_eval].tolist())
  train = [tokens[i * block:(i + 1) * block] for i in range(num_blocks)
           if i not in held_out]
  evals = [tokens[i * block:(i + 1) * block] for i in sorted(held_out)]
  return np.concatenate(train), np.concatenate(evals)


@dataclasses.dataclass(frozen=True)
class TextData:
  """A tokenized corpus split into training and held-out tokens."""
  train: np.ndarray
  """uint8 training tokens."""
  held_out: np.ndarray
  """uint8 held-out tokens."""
  source: str
  """Where the text came from (``"stdlib docstrings"`` or a path)."""

  def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int,
                  rows: slice = slice(None)) -> Batch:
    """The training batch of step ``step``: a pure function of ``(seed, step)``.

    Each row is a window of ``seq_len + 1`` tokens at a uniformly random offset.
    ``rows`` reads only those rows of it (one process's part of a global batch).

    Raises:
      ValueError: if the training split is shorter than one window.
    """
    limit = len(self.train) - seq_len - 1
    if limit < 1:
      raise ValueError(f"training text ({len(self.train)} tokens) is shorter than "
                       f"one sequence of seq_len={seq_len} + 1")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, limit + 1, size=batch_size)[rows]
    windows = self.train[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
            "mask": np.ones((len(starts), seq_len), np.float32)}

  def eval_batches(self, batch_size: int, seq_len: int,
                   max_batches: int = 0) -> Iterator[Batch]:
    """The held-out split as batches of non-overlapping windows, in order.

    Padding (of the last window, and of rows past the end) has mask 0.

    Args:
      batch_size: rows per batch.
      seq_len: tokens per row.
      max_batches: stop after this many batches; 0 for the whole split.

    Yields:
      Batches shaped like `train_batch`'s.
    """
    tokens = self.held_out.astype(np.int32)
    num_targets = len(tokens) - 1
    num_rows = -(-num_targets // seq_len)
    num_batches = -(-num_rows // batch_size)
    if max_batches:
      num_batches = min(num_batches, max_batches)
    padded = np.zeros(num_batches * batch_size * seq_len + 1, np.int32)
    mask = np.zeros(num_batches * batch_size * seq_len, np.float32)
    n = min(len(tokens), len(padded))
    padded[:n] = tokens[:n]
    mask[:max(0, n - 1)] = 1.0
    shape = (num_batches, batch_size, seq_len)
    inputs, targets = padded[:-1].reshape(shape), padded[1:].reshape(shape)
    mask = mask.reshape(shape)
    for i in range(num_batches):
      yield {"inputs": inputs[i], "targets": targets[i], "mask": mask[i]}


def load_data(path: Optional[Union[str, os.PathLike]] = None,
              eval_fraction: float = 0.1) -> TextData:
  """The corpus at ``path`` (a file or folder), or the embedded one, split and tokenized.

  Args:
    path: a text file or folder; ``None`` for the standard-library docstrings.
    eval_fraction: share held out for evaluation.

  Returns:
    A `TextData`.
  """
  if path is None:
    text, source = stdlib_corpus(), "stdlib docstrings"
  else:
    text, source = read_text(path), os.fspath(path)
  train, held_out = split_tokens(tokenize(text), eval_fraction)
  return TextData(train=train, held_out=held_out, source=source)
