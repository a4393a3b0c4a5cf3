"""The trainer's data loader: `grain` datasets of global batches, one per step.

Whatever the data, training reads a ``grain.MapDataset`` whose item ``i`` is the batch
of step ``i`` (a dict of numpy arrays, ``data.batch_size`` rows), through a
``grain`` iterator whose state (``{"next_index": step}``) is saved in every checkpoint
beside the model, so ``--resume`` continues at the very next batch.

- The **embedded corpus** or a text file (``data.path``): `TrainBatches`, the random
  windows of `mpscale.trainer.data.text.TextData.train_batch`, a pure function of ``(seed,
  step)``; evaluation reads the held-out split in order.
- A **user's source** (``data.provider``, or ``data=`` in Python): a random-access
  source of examples (``len(source)`` and ``source[i]``, a dict of arrays; any
  ``grain`` data source or ``grain.MapDataset``), or a mapping ``{"train": source,
  "eval": source}``. Training shuffles it with ``seed`` (anew each epoch; ``data.shuffle:
  false`` keeps its order), repeats it, and batches it; evaluation reads the first
  ``data.eval_batches`` full batches of ``eval`` in order.
- **Token corpora** (``data.tokens``, ``data.blend``, ``data.tokenize``;
  `mpscale.trainer.data.corpora`): Megatron's GPT samples (`mpscale.trainer.data.token_datasets`),
  already shuffled by ``seed``, read as a user's source without another shuffle; a
  blend's share of each corpus is counted per step (`SourceShares`) for the log.

Across processes (`mpscale.trainer.runs.distributed`) each process reads only its rows
``[start, stop)`` of each global batch (``rows``), the ones its devices hold: the
text's windows for those rows, or a user source's examples ``i * batch_size + start``
to ``i * batch_size + stop``, batched as blocks of ``stop - start`` and strided
(``ds.batch(stop - start)[start // size :: batch_size // size]``), so the processes
together read exactly the batches one process would.

With a **batch-size ramp-up** (``data.rampup_batch_size``, `mpscale.trainer.data.batch_sizes`)
step ``i``'s global batch has ``n = size_at(i)`` rows: the text's windows of
``(seed, i, n)``, or the next ``n`` examples of the stream, ``consumed_at(i)``
onward (`RampedBatches`); a process reads the same share of it as of a full batch,
rows ``[start * n / batch_size, stop * n / batch_size)`` (`rows_of`). The position
is still the step, so a resumed run reads the very batches of an uninterrupted one.
Without a ramp-up the batches are the ones above.
"""

from __future__ import annotations

import dataclasses
from typing import (Any, Callable, Iterable, Iterator, Mapping, Optional,
                    Sequence)

import grain
import numpy as np

from mpscale import validation
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.data import batch_sizes as batch_sizes_lib

_READ = dict(num_threads=1, prefetch_buffer_size=2)
"""One background thread reads up to two batches ahead of the step."""


def rows_of(rows: tuple[int, int], batch_size: int, size: int) -> tuple[int, int]:
  """A process's rows of a global batch of ``size`` rows, given its ``rows`` of one
  of ``batch_size``: the same share at the same place, ``[start * size /
  batch_size, stop * size / batch_size)``.

  Raises:
    ValueError: naming ``data.rampup_batch_size`` when ``size`` does not split so
      (the config's batch rule prevents it).
  """
  start, stop = rows
  if (start * size) % batch_size or (stop * size) % batch_size:
    raise validation.fail("data.rampup_batch_size", f": its batch size {size} does "
                          f"not split as rows {rows} of {batch_size} do")
  return start * size // batch_size, stop * size // batch_size


class TrainBatches:
  """The training batches of a `TextData`, as a random-access grain source: item
  ``step`` is ``text.train_batch(seed, step, size, seq_len)``, ``size`` =
  ``batch_size`` or with a ramp-up ``sizes.size_at(step)``."""

  def __init__(self, text: data_lib.TextData, seed: int, batch_size: int,
               seq_len: int, rows: Optional[tuple[int, int]] = None,
               sizes: Optional[batch_sizes_lib.BatchSizes] = None):
    self.text, self.seed = text, seed
    self.batch_size, self.seq_len = batch_size, seq_len
    self.rows = slice(*rows) if rows is not None else slice(None)
    self.sizes = sizes if sizes is not None and sizes.ramped else None

  def __len__(self) -> int:
    return 2**62  # endless: steps, not epochs

  def __getitem__(self, step: int) -> data_lib.Batch:
    step, size, rows = int(step), self.batch_size, self.rows
    if self.sizes is not None:
      size = self.sizes.size_at(step)
      rows = slice(*rows_of(rows.indices(self.batch_size)[:2], self.batch_size, size))
    return self.text.train_batch(self.seed, step, size, self.seq_len, rows)

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
  """Tokens (or rows) in one global training batch of ``batch_size`` rows (a full
  one, after a ramp-up), for the tokens/s figure."""
  batch_size: int
  """Rows of a global batch."""
  rows: tuple[int, int]
  """The rows ``[start, stop)`` of each global batch that this process reads."""
  shares: Optional["SourceShares"] = None
  """A blend's realised share of each source (``data.blend``), for the log;
  ``None`` for one source."""
  tokenizer: Optional[str] = None
  """The ``tokenizer.json`` its tokens decode with; ``None``: bytes (or unknown)."""
  sizes: Optional[batch_sizes_lib.BatchSizes] = None
  """The global batch size of each step (a ramp-up's); ``None``: ``batch_size``."""

  def size_at(self, step: int) -> int:
    """Rows of the global batch of ``step``."""
    return self.batch_size if self.sizes is None else self.sizes.size_at(step)

  def rows_at(self, step: int) -> tuple[int, int]:
    """The rows of the global batch of ``step`` that this process reads."""
    return rows_of(self.rows, self.batch_size, self.size_at(step))

  def consumed_at(self, step: int) -> int:
    """Samples (rows of global batches) trained on before ``step``."""
    return (step * self.batch_size if self.sizes is None
            else self.sizes.consumed_at(step))

  def tokens_between(self, start: int, stop: int) -> int:
    """Tokens (or rows) of the global batches of steps ``start .. stop - 1``."""
    rows = self.consumed_at(stop) - self.consumed_at(start)
    return rows * self.tokens_per_step // self.batch_size

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


class SourceShares:
  """The share of each source among the examples of a run's first steps, from the
  source of each example (a blend's ``dataset_index``): ``fractions(step)``.

  The counts per step are summed once, so a log point costs a lookup.

  Args:
    names: the sources' names.
    source_index: the source of each example, in training order (at least the
      samples of ``steps`` steps).
    batch_size: examples per step.
    steps: the steps to count.
    sizes: with a batch-size ramp-up, the examples of each step (its
      ``consumed_at``); default: ``batch_size`` each.
  """

  def __init__(self, names: Sequence[str], source_index: np.ndarray, batch_size: int,
               steps: int, sizes: Optional[batch_sizes_lib.BatchSizes] = None):
    self.names = tuple(names)
    self.batch_size = batch_size
    if sizes is None:
      sizes = batch_sizes_lib.BatchSizes(batch_size)
    self.consumed = np.array([sizes.consumed_at(s) for s in range(steps + 1)],
                             np.int64)
    """int64 ``[steps + 1]``: examples of the first ``step`` steps."""
    per_step = np.zeros((steps, len(self.names)), np.int64)
    phases = sizes.phases()
    for phase, following in zip(phases, phases[1:] + (None,)):
      first = phase.first_step  # a phase's steps are a block of its size
      last = steps if following is None else min(following.first_step, steps)
      if first >= last:
        break
      block = np.asarray(source_index[phase.consumed:phase.consumed + (
          last - first) * phase.size]).reshape(last - first, phase.size)
      for d in range(len(self.names)):
        per_step[first:last, d] = np.count_nonzero(block == d, axis=1)
    counts = np.zeros((steps + 1, len(self.names)), np.int64)
    np.cumsum(per_step, axis=0, out=counts[1:])
    self.counts = counts
    """int64 ``[steps + 1, sources]``: examples of each source in the first
    ``step`` steps."""

  def fractions(self, step: int) -> dict[str, float]:
    """Each source's share (by name) of the examples of steps ``0 .. step - 1``;
    NaN before the first step."""
    step = min(int(step), len(self.counts) - 1)
    total = int(self.consumed[step])
    return {name: (float(self.counts[step, d]) / total if total else float("nan"))
            for d, name in enumerate(self.names)}


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
  """`Data` of the tiny LM's corpus, batched as ``cfg`` says (with its ramp-up, if
  any); ``rows`` of each batch (default: all)."""
  bs, seq_len = cfg.data.batch_size, cfg.model.seq_len
  start, stop = _check_rows(rows, bs)
  sizes = batch_sizes(cfg)
  train = grain.MapDataset.source(TrainBatches(text, cfg.seed, bs, seq_len,
                                               (start, stop), sizes))

  def eval_batches():
    for batch in text.eval_batches(bs, seq_len, cfg.data.eval_batches):
      yield {k: v[start:stop] for k, v in batch.items()}

  return Data(train=train, eval_batches=eval_batches, source=text.source,
              tokens_per_step=bs * seq_len, batch_size=bs, rows=(start, stop),
              sizes=sizes)


def batch_sizes(cfg: Any) -> Optional[batch_sizes_lib.BatchSizes]:
  """The batch sizes of ``data.rampup_batch_size``'s ramp-up (the config checked
  them); ``None`` without one."""
  rampup = getattr(cfg.data, "rampup_batch_size", None)
  sizes = (None if rampup is None
           else batch_sizes_lib.BatchSizes(cfg.data.batch_size, rampup))
  return sizes if sizes is not None and sizes.ramped else None


class RampedBatches:
  """The training batches of a stream of examples under a batch-size ramp-up, as a
  random-access grain source: item ``step`` is examples ``consumed_at(step) +
  [start, stop)`` of ``examples`` (a process's `rows_of` the step's batch), batched
  as grain batches them.

  Args:
    examples: the examples in training order, endless (``ds.repeat()``).
    sizes: the batch size of each step.
    rows: the rows ``[start, stop)`` of a full batch this process reads.
  """

  def __init__(self, examples: Any, sizes: batch_sizes_lib.BatchSizes,
               rows: tuple[int, int]):
    self.examples, self.sizes, self.rows = examples, sizes, rows

  def __len__(self) -> int:
    return 2**62  # endless: steps, not epochs

  def __getitem__(self, step: int) -> Any:
    step = int(step)
    first = self.sizes.consumed_at(step)
    start, stop = rows_of(self.rows, self.sizes.batch_size, self.sizes.size_at(step))
    return self.examples[first + start:first + stop].batch(stop - start)[0]

  def __repr__(self) -> str:
    return f"RampedBatches({self.sizes!r}, rows={self.rows})"


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
              rows: Optional[tuple[int, int]] = None, *,
              shuffle: Optional[bool] = None) -> Data:
  """`Data` of a user's source (see the module docstring); ``rows`` of each batch
  (default: all). ``shuffle`` (default ``data.shuffle``): shuffle the training
  examples with ``seed``; a source already in training order (token samples) is
  read as it is.

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
  if cfg.data.shuffle if shuffle is None else shuffle:
    train = train.shuffle(seed=cfg.seed)
  sizes = batch_sizes(cfg)
  if sizes is None:
    train = _process_batches(train.repeat(), bs, rows)
  else:
    train = grain.MapDataset.source(RampedBatches(train.repeat(), sizes, rows))

  def eval_batches():
    if held_out is None:
      return iter(())
    count = len(held_out) // bs  # full global batches
    if cfg.data.eval_batches:
      count = min(count, cfg.data.eval_batches)
    batches = _process_batches(held_out, bs, rows)
    return (batches[i] for i in range(count))

  first_rows = rows if sizes is None else rows_of(rows, bs, sizes.size_at(0))
  return Data(train=train, eval_batches=eval_batches, source=repr(obj)[:200],
              tokens_per_step=_tokens(train[0]) * bs // (first_rows[1] - first_rows[0]),
              batch_size=bs, rows=rows, sizes=sizes)
