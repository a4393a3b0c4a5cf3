"""The trainer's data loader: `grain` datasets of global batches, one per step.

Whatever the data, training reads a ``grain.MapDataset`` whose item ``i`` is the batch
of step ``i`` (a dict of numpy arrays, ``data.batch_size`` rows), through a
``grain`` iterator whose state (``{"next_index": step}``) is saved in every checkpoint
beside the model, so ``--resume`` continues at the very next batch.

- The **embedded corpus** or a text file (``data.path``): `TrainBatches`, the random
  windows of `mpscale.trainer.data.TextData.train_batch`, a pure function of ``(seed,
  step)``; evaluation reads the held-out split in order.
- A **user's source** (``data.provider``, or ``data=`` in Python): a random-access
  source of examples (``len(source)`` and ``source[i]``, a dict of arrays; any
  ``grain`` data source or ``grain.MapDataset``), or a mapping ``{"train": source,
  "eval": source}``. Training shuffles it with ``seed`` (anew each epoch; ``data.shuffle:
  false`` keeps its order), repeats it, and batches it; evaluation reads the first
  ``data.eval_batches`` full batches of ``eval`` in order.

Across processes (`mpscale.trainer.distributed`) each process reads only its rows
``[start, stop)`` of each global batch (``rows``), the ones its devices hold: the
text's windows for those rows, or a user source's examples ``i * batch_size + start``
to ``i * batch_size + stop``, batched as blocks of ``stop - start`` and strided
(``ds.batch(stop - start)[start // size :: batch_size // size]``), so the processes
together read exactly the batches one process would.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import grain
import numpy as np

from mpscale import validation
from mpscale.trainer import data as data_lib

_READ = dict(num_threads=1, prefetch_buffer_size=2)
"""One background thread reads up to two batches ahead of the step."""


class TrainBatches:
  """The training batches of a `TextData`, as a random-access grain source: item
  ``step`` is ``text.train_batch(seed, step, batch_size, seq_len)``."""

  def __init__(self, text: data_lib.TextData, seed: int, batch_size: int,
               seq_len: int, rows: Optional[tuple[int, int]] = None):
    self.text, self.seed = text, seed
    self.batch_size, self.seq_len = batch_size, seq_len
    self.rows = slice(*rows) if rows is not None else slice(None)

  def __len__(self) -> int:
    return 2**62  # endless: steps, not epochs

  def __getitem__(self, step: int) -> data_lib.Batch:
    return self.text.train_batch(self.seed, int(step), self.batch_size, self.seq_len,
                                 self.rows)

  def __repr__(self) -> str:
    return (f"TrainBatches({self.text.source!r}, seed={self.seed}, "
            f"batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"rows={self.rows.start, self.rows.stop})")


@dataclasses.dataclass
class Data:
  """A run's data: training batches by step, evaluation batches, and a label."""
  train: Any
  """``grain.MapDataset``: item ``i`` is this process's rows (`rows`) of the global
  batch of step ``i`` (all of it with one process)."""
  eval_batches: Callable[[], Iterable[data_lib.Batch]]
  """The evaluation batches, in order (none: no evaluation)."""
  source: str
  """Where the data comes from, for the summary."""
  tokens_per_step: int
  """Tokens (or rows) in one global training batch, for the tokens/s figure."""
  batch_size: int
  """Rows of a global batch."""
  rows: tuple[int, int]
  """The rows ``[start, stop)`` of each global batch that this process reads."""

  def iterator(self, state: Optional[Mapping[str, Any]] = None) -> Iterator:
    """A grain iterator over `train` from its start, or from ``state`` (a saved
    ``get_state()``)."""
    it = iter(self.train.to_iter_dataset(grain.ReadOptions(**_READ)))
    if state is not None:
      it.set_state(dict(state))
    return it


def _tokens(batch: Mapping[str, Any]) -> int:
  """Tokens of a batch: the size of ``mask`` or ``targets`` if it has one, else its
  rows."""
  for name in ("mask", "targets"):
    if name in batch:
      return int(np.size(batch[name]))
  return int(len(next(iter(batch.values()))))


def _check_rows(rows: Optional[tuple[int, int]], batch_size: int) -> tuple[int, int]:
  if rows is None:
    return 0, batch_size
  start, stop = rows
  size = stop - start
  if not (0 <= start < stop <= batch_size) or batch_size % size or start % size:
    raise ValueError(f"rows: expected a block [start, stop) of a batch of "
                     f"{batch_size} rows, aligned to its size; got {rows}")
  return start, stop


def text_data(text: data_lib.TextData, cfg: Any,
              rows: Optional[tuple[int, int]] = None) -> Data:
  """`Data` of the tiny LM's corpus, batched as ``cfg`` says; ``rows`` of each
  batch (default: all)."""
  bs, seq_len = cfg.data.batch_size, cfg.model.seq_len
  start, stop = _check_rows(rows, bs)
  train = grain.MapDataset.source(TrainBatches(text, cfg.seed, bs, seq_len,
                                               (start, stop)))

  def eval_batches():
    for batch in text.eval_batches(bs, seq_len, cfg.data.eval_batches):
      yield {k: v[start:stop] for k, v in batch.items()}

  return Data(train=train, eval_batches=eval_batches, source=text.source,
              tokens_per_step=bs * seq_len, batch_size=bs, rows=(start, stop))


def _source(obj: Any, key: str) -> Any:
  if isinstance(obj, grain.MapDataset):
    return obj
  if hasattr(obj, "__len__") and hasattr(obj, "__getitem__") and not isinstance(
      obj, (str, bytes, Mapping)):
    return grain.MapDataset.source(obj)
  raise validation.fail(
      key, ": expected a random-access source of examples (len(source) and "
      "source[i]; a grain data source or grain.MapDataset) or a mapping {'train': "
      f"source, 'eval': source}}; got {type(obj).__module__}.{type(obj).__qualname__}",
      validation.ArgumentTypeError)


def _check_examples(ds: Any, name: str, batch_size: int, key: str) -> None:
  if len(ds) < batch_size:
    raise validation.ArgumentError(
        (key, "data.batch_size"), f"{{0}}: the {name} split has {len(ds)} examples, "
        f"fewer than {{1}} ({batch_size})")
  try:
    example = ds[0]
  except Exception as e:  # the user's source may raise anything
    raise validation.fail(key, f": reading {name}[0] raised {type(e).__name__}: {e}"
                          ) from None
  if not isinstance(example, Mapping):
    raise validation.fail(
        key, ": an example must be a dict of arrays (a batch is the dict of their "
        f"stacks); {name}[0] is {type(example).__module__}."
        f"{type(example).__qualname__}", validation.ArgumentTypeError)


def _process_batches(ds: Any, batch_size: int, rows: tuple[int, int]) -> Any:
  """``ds`` in batches of ``batch_size``, of which only ``rows`` are read."""
  start, stop = rows
  size = stop - start
  if size == batch_size:
    return ds.batch(batch_size, drop_remainder=True)
  return ds.batch(size, drop_remainder=True)[start // size::batch_size // size]


def user_data(obj: Any, cfg: Any, key: str = "data.provider",
              rows: Optional[tuple[int, int]] = None) -> Data:
  """`Data` of a user's source (see the module docstring); ``rows`` of each batch
  (default: all).

  Raises:
    TypeError, ValueError: naming ``key``, for something that is not a source, a
      split smaller than one batch, or examples that are not dicts.
  """
  bs = cfg.data.batch_size
  rows = _check_rows(rows, bs)
  if isinstance(obj, Mapping):
    unknown = set(obj) - {"train", "eval"}
    if "train" not in obj or unknown:
      raise validation.fail(key, ": a mapping of splits needs 'train' (and may have "
                            f"'eval'); got keys {sorted(obj)}")
    train, held_out = _source(obj["train"], key), obj.get("eval")
    held_out = None if held_out is None else _source(held_out, key)
  else:
    train, held_out = _source(obj, key), None
  _check_examples(train, "train", bs, key)
  if held_out is not None:
    _check_examples(held_out, "eval", bs, key)
  if cfg.data.shuffle:
    train = train.shuffle(seed=cfg.seed)
  train = _process_batches(train.repeat(), bs, rows)

  def eval_batches():
    if held_out is None:
      return iter(())
    count = len(held_out) // bs  # full global batches
    if cfg.data.eval_batches:
      count = min(count, cfg.data.eval_batches)
    batches = _process_batches(held_out, bs, rows)
    return (batches[i] for i in range(count))

  local_tokens = _tokens(train[0])
  return Data(train=train, eval_batches=eval_batches, source=repr(obj)[:200],
              tokens_per_step=local_tokens * bs // (rows[1] - rows[0]),
              batch_size=bs, rows=rows)
