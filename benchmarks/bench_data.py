"""The trainer's grain data loader against the direct batch function it replaced, and
a token corpus on disk read through it: cost per batch, and as a share of a tiny-LM
train step.

Measured per batch (or per step), in microseconds, for batches of ``B x T`` tokens
(default 16 x 64). Variants (each has a letter; the ratios are named by them):

  a  ``text.train_batch(seed, step, B, T)`` for consecutive steps: the pure function of
     ``(seed, step)`` the trainer called before it read data through grain  (baseline)
  b  ``next(it)``, ``it = loader.text_data(text, cfg).iterator()``: the trainer's grain
     loader over the same batches (its first batches are checked equal to a's); one
     background thread reads two batches ahead
  c  ``next(it)`` of ``loader.user_data(examples, cfg).iterator()``: a user's source
     (a list of ``--examples`` dicts of ``inputs``/``targets``/``mask`` arrays of
     length T) shuffled, repeated and batched by grain
  d  the train step of ``configs/tiny_lm_fp16.yaml`` at the same B and T, with
     ``block_until_ready`` after each step
  e  ``loader.text_data(text, cfg).train[step]``: grain's random access to a's batches,
     no read-ahead thread (diagnostic: grain's per-item cost alone)
  f  the trainer's loop fed by a: next batch, dispatch the step, wait for the previous
     step (one step in flight, as `mpscale.trainer.runs.loop` does with a progress bar)
  g  the same loop fed by the grain loader (a second iterator like b's)
  h  the same loop fed by a token corpus on disk: ``corpora.token_data(cfg)
     .iterator()`` with ``data.tokens`` naming a Megatron indexed dataset (uint16,
     written once to a temporary folder by ``token_files.write_indexed``) of the
     embedded corpus's bytes, one document per module (``data.stdlib_documents()``,
     as ``data.tokenize`` splits it; ``--token-documents paragraphs``: one per
     blank-line-separated paragraph, ~110 bytes, so over half the samples span two or
     more documents), each ended by ``data.eod`` 0 (no NUL byte occurs in the text, so
     ``model.vocab_size`` stays 256 and the step is the very one f and g compile),
     with ``data.eod_mask_loss``: Megatron GPT samples of T + 1 tokens, read by grain
     a batch per item (``corpora.SampleBatches``: the batch's samples gathered at
     once from the memory-mapped tokens by ``GPTSamples.examples``; checked to have
     the text batches' keys, dtypes and shapes)
  i  ``next(it)`` of that token loader alone (a second iterator, like b)
     (diagnostic: the token corpus's cost per batch)

Timing is round-robin: each round times every variant once, in a shuffled order, as a
block of ``--batches`` calls (``--steps`` for d, f, g, h), with the garbage collector
off.
Each ratio is formed within a round; the median over ``--rounds`` rounds is printed
with its interquartile range:

  b/a, c/a    the loaders' cost against the direct function
  e/a         grain's random access alone (b - e is the read-ahead thread's handoff)
  (b-a)/d     the grain loader's extra cost as a share of a step, as if nothing
              overlapped (an upper bound for the trainer)
  (c-a)/d     the same for a user's source
  g/f         the same measured in the loop, where the read-ahead thread overlaps the
              step (on a 2-core CPU it competes with XLA's threads instead)
  h/f         the loop fed by the token corpus on disk against the loop fed by the
              in-memory direct function (target: <= 1.05)
  h/g         the same against the loop fed by the grain text loader
  i/a         the token loader's cost per batch against the direct function
  (i-a)/d     its extra cost as a share of a step, as if nothing overlapped (compare
              h/f - 1)

Compilation and one warm-up call per variant are excluded. Before each block of b, c,
g, h and i, the batches read ahead while other variants ran are taken untimed, so a
block does not start with a full buffer.

Usage::

    python benchmarks/bench_data.py            # 11 rounds x 400 batches / 20 steps: ~45 s
    python benchmarks/bench_data.py --quick    # 5 rounds x 100 batches / 8 steps: ~20 s
    python benchmarks/bench_data.py --quick --token-documents paragraphs
    python benchmarks/bench_data.py --batch-size 32 --seq-len 128 --examples 8192
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Callable, NamedTuple, Optional

import grain
import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import corpora  # noqa: E402
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.data import loader
from mpscale.trainer.data import token_files  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "tiny_lm_fp16.yaml")
CHECK_STEPS = 4
"""The grain loader's first batches checked equal to the direct function's."""
READ_AHEAD = loader._READ["prefetch_buffer_size"]  # noqa: SLF001 -- the loader's own
"""Batches the loader's background thread reads ahead (drained before each block)."""
EOD = 0
"""The token corpus's end-of-document id: a byte the embedded text never holds, so the
tiny LM's 256 ids hold it."""


class Variant(NamedTuple):
  key: str
  label: str
  call: Callable[[], None]
  """One batch (or one step)."""
  per_block: int
  """Calls per timed block."""
  prepare: Optional[Callable[[], None]] = None
  """Untimed, before each block."""
  finish: Optional[Callable[[], None]] = None
  """Timed, after the block's calls (waits for work still in flight)."""


def _time_block(v: Variant) -> float:
  """Microseconds per call of one block of ``v``."""
  if v.prepare is not None:
    v.prepare()
  start = time.perf_counter()
  for _ in range(v.per_block):
    v.call()
  if v.finish is not None:
    v.finish()
  return (time.perf_counter() - start) / v.per_block * 1e6


def _check_like(got: data_lib.Batch, want: data_lib.Batch, what: str) -> None:
  """``got`` has ``want``'s keys, dtypes and shapes (the same compiled step)."""
  assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
  for k in want:
    g, w = np.asarray(got[k]), want[k]
    assert g.dtype == w.dtype and g.shape == w.shape, (
        f"{what}: {k} is {g.dtype}{list(g.shape)}, want {w.dtype}{list(w.shape)}")


def _check_same(got: data_lib.Batch, want: data_lib.Batch, step: int) -> None:
  _check_like(got, want, f"step {step}")
  for k in want:
    assert np.array_equal(np.asarray(got[k]), want[k]), (
        f"step {step}: {k} differs from train_batch's")


def _user_examples(text: data_lib.TextData, count: int, seq_len: int,
                   seed: int) -> list[data_lib.Batch]:
  """``count`` examples as a user would list them: windows of the corpus at random
  offsets, each a dict of arrays of length ``seq_len``."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(text.train) - seq_len, size=count)
  windows = text.train[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return [{"inputs": w[:-1], "targets": w[1:], "mask": np.ones(seq_len, np.float32)}
          for w in windows]


def _token_documents(split: str) -> list[np.ndarray]:
  """The embedded corpus's bytes as documents, each ended by `EOD`: one per module
  (``split="modules"``, the corpus's own documents) or per paragraph."""
  if split == "modules":
    texts = [d.encode("utf-8") for d in data_lib.stdlib_documents()]
  else:
    texts = [p for d in data_lib.stdlib_documents()
             for p in d.encode("utf-8").split(b"\n\n") if p.strip()]
  docs = [np.append(np.frombuffer(t, np.uint8), EOD).astype(np.uint16) for t in texts]
  assert all(np.count_nonzero(d == EOD) == 1 for d in docs), "the text holds EOD"
  return docs


RATIOS = [
    ("b/a", "grain loader / direct", lambda t: t["b"] / t["a"]),
    ("c/a", "user source / direct", lambda t: t["c"] / t["a"]),
    ("e/a", "grain random access / direct", lambda t: t["e"] / t["a"]),
    ("(b-a)/d", "grain loader's extra cost, share of a step",
     lambda t: (t["b"] - t["a"]) / t["d"]),
    ("(c-a)/d", "user source's extra cost, share of a step",
     lambda t: (t["c"] - t["a"]) / t["d"]),
    ("g/f", "loop with grain / loop with direct", lambda t: t["g"] / t["f"]),
    ("h/f", "loop with token corpus / loop with direct (target <= 1.05)",
     lambda t: t["h"] / t["f"]),
    ("h/g", "loop with token corpus / loop with grain text",
     lambda t: t["h"] / t["g"]),
    ("i/a", "token loader / direct", lambda t: t["i"] / t["a"]),
    ("(i-a)/d", "token loader's extra cost, share of a step",
     lambda t: (t["i"] - t["a"]) / t["d"]),
]
"""(name, meaning, ratio of one round's per-call times)."""


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
  q = sorted(xs)
  return statistics.median(q), q[len(q) // 4], q[(3 * len(q)) // 4]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true",
                  help="5 rounds x 100 batches / 8 steps (about 20 s on 2 CPU cores)")
  ap.add_argument("--rounds", type=int, default=None,
                  help="rounds (default 11; quick 5)")
  ap.add_argument("--batches", type=int, default=None,
                  help="batches per block of a, b, c, e, i (default 400; quick "
                  "100)")
  ap.add_argument("--steps", type=int, default=None,
                  help="steps per block of d, f, g, h (default 20; quick 8)")
  ap.add_argument("--batch-size", type=int, default=16, help="B, rows per batch (16)")
  ap.add_argument("--seq-len", type=int, default=64, help="T, tokens per row (64)")
  ap.add_argument("--examples", type=int, default=4096,
                  help="examples in c's user source (4096)")
  ap.add_argument("--token-documents", choices=("modules", "paragraphs"),
                  default="modules", help="the token corpus's documents: one per "
                  "module (default) or per paragraph")
  ap.add_argument("--seed", type=int, default=0, help="seed of the round order")
  args = ap.parse_args(argv)

  rounds = args.rounds or (5 if args.quick else 11)
  batches = args.batches or (100 if args.quick else 400)
  steps = args.steps or (8 if args.quick else 20)
  bs, seq_len = args.batch_size, args.seq_len

  # One config for the loaders and the step: the fp16 tiny LM at B x T.
  cfg = config_lib.load_config(CONFIG, [f"data.batch_size={bs}",
                                        f"model.seq_len={seq_len}"])
  text = data_lib.load_data()
  text_data = loader.text_data(text, cfg)
  user = loader.user_data(_user_examples(text, args.examples, seq_len, cfg.seed), cfg)

  # (h, i) the token corpus on disk, and the same config reading it. The folder (with
  # the sample indices GPTSamples caches in it) is removed at the end.
  folder = tempfile.TemporaryDirectory(prefix="bench_data_")
  documents = _token_documents(args.token_documents)
  prefix = token_files.write_indexed(os.path.join(folder.name, "stdlib"), documents,
                                     np.uint16)
  token_cfg = config_lib.load_config(CONFIG, [
      f"data.batch_size={bs}", f"model.seq_len={seq_len}", f"data.tokens={prefix}",
      f"data.eod={EOD}", "data.eod_mask_loss=true"])
  assert token_cfg.model == cfg.model, "the token config changed the model"
  t0 = time.perf_counter()
  token_data = corpora.token_data(token_cfg)
  token_open_s = time.perf_counter() - t0

  dev = jax.devices()[0]
  print(f"jax {jax.__version__}  grain {getattr(grain, '__version__', '?')}  "
        f"numpy {np.__version__}  python {platform.python_version()}")
  print(f"device: {dev.platform} {dev.device_kind}  (host cpus: {os.cpu_count()})")
  print(f"batch {bs} x {seq_len} tokens; corpus: {text.source}, {len(text.train)} "
        f"training tokens; user source: {args.examples} examples; step: "
        f"{os.path.relpath(CONFIG, ROOT)} ({cfg.precision.policy}, "
        f"{cfg.optimizer.name}, loss scale {cfg.loss_scale.kind})")
  print(f"token corpus: {len(documents)} documents ({args.token_documents}), "
        f"{sum(map(len, documents))} uint16 tokens, indexed dataset on disk; "
        f"opened (sample indices built) in {token_open_s * 1e3:.0f} ms")
  print(f"timing: {rounds} rounds, {batches} batches / {steps} steps per block, "
        "shuffled order each round")

  # (a) direct, for consecutive steps.
  direct_steps = itertools.count()

  def direct() -> data_lib.Batch:
    return text.train_batch(cfg.seed, next(direct_steps), bs, seq_len)

  # (b) the grain loader, checked against (a) on its first batches.
  grain_it = text_data.iterator()
  for step in range(CHECK_STEPS):
    _check_same(next(grain_it), text.train_batch(cfg.seed, step, bs, seq_len), step)
  print(f"check: the grain loader's first {CHECK_STEPS} batches equal train_batch's")

  # (c) the user source: shuffled, repeated and batched.
  user_it = user.iterator()
  first = next(user_it)
  for k in ("inputs", "targets", "mask"):
    assert first[k].shape == (bs, seq_len), f"user batch {k}: {first[k].shape}"

  # (i) the token loader, its batches shaped as the text's (the same compiled step).
  token_it = token_data.iterator()
  want = text.train_batch(cfg.seed, 0, bs, seq_len)
  for step in range(CHECK_STEPS):
    _check_like(next(token_it), want, f"token batch {step}")
  print(f"check: the token loader's first {CHECK_STEPS} batches have the text "
        "batches' keys, dtypes and shapes")

  # (e) random access, consecutive steps.
  access_steps = itertools.count()

  # (d, f, g) the train step; compiled here.
  t0 = time.perf_counter()
  setup = builders.build(cfg)
  box = {"state": setup.init(setup.init_params()), "pending": None}
  fixed = text.train_batch(cfg.seed, 0, bs, seq_len)
  box["state"], metrics = setup.step(box["state"], fixed)
  jax.block_until_ready(metrics)
  print(f"step built and compiled in {time.perf_counter() - t0:.1f} s")

  def step() -> None:
    box["state"], metrics = setup.step(box["state"], fixed)
    jax.block_until_ready(metrics["loss"])

  def loop_call(next_batch: Callable[[], data_lib.Batch]) -> Callable[[], None]:
    """One iteration of the trainer's loop: read, dispatch, wait for the previous."""
    def call() -> None:
      batch = next_batch()
      box["state"], metrics = setup.step(box["state"], batch)
      if box["pending"] is not None:
        jax.block_until_ready(box["pending"])
      box["pending"] = metrics["loss"]
    return call

  def settle() -> None:
    if box["pending"] is not None:
      jax.block_until_ready(box["pending"])
    box["pending"] = None

  loop_it = text_data.iterator()
  token_loop_it = token_data.iterator()

  def drain(it) -> Callable[[], None]:
    """Takes the batches read ahead while other variants ran (untimed)."""
    def prepare() -> None:
      for _ in range(READ_AHEAD):
        next(it)
    return prepare

  def prepare_loop(it) -> Callable[[], None]:
    def prepare() -> None:
      settle()
      drain(it)()
    return prepare

  variants = [
      Variant("a", "direct: text.train_batch(seed, step, B, T)", direct, batches),
      Variant("b", "grain: next(text_data(text, cfg).iterator())",
              lambda: next(grain_it), batches, prepare=drain(grain_it)),
      Variant("c", "user source: next(user_data(examples, cfg).iterator())",
              lambda: next(user_it), batches, prepare=drain(user_it)),
      Variant("d", "train step (fp16 tiny LM), blocked", step, steps),
      Variant("e", "grain random access: text_data(...).train[step]",
              lambda: text_data.train[next(access_steps)], batches),
      Variant("f", "loop: direct batch + step", loop_call(direct), steps,
              prepare=settle, finish=settle),
      Variant("g", "loop: grain batch + step", loop_call(lambda: next(loop_it)), steps,
              prepare=prepare_loop(loop_it), finish=settle),
      Variant("h", "loop: token-corpus batch + step",
              loop_call(lambda: next(token_loop_it)), steps,
              prepare=prepare_loop(token_loop_it), finish=settle),
      Variant("i", "token corpus: next(corpora.token_data(cfg).iterator())",
              lambda: next(token_it), batches, prepare=drain(token_it)),
  ]
  for v in variants:  # warm-up, untimed
    v.call()
    if v.finish is not None:
      v.finish()

  rng = random.Random(args.seed)
  times: dict[str, list[float]] = {v.key: [] for v in variants}
  gc_was = gc.isenabled()
  gc.disable()
  try:
    for _ in range(rounds):
      order = list(variants)
      rng.shuffle(order)
      for v in order:
        times[v.key].append(_time_block(v))
  finally:
    if gc_was:
      gc.enable()

  print()
  print(f"{'':4}{'variant':<58}{'median us':>11}{'min us':>11}{'max us':>11}")
  for v in variants:
    t = times[v.key]
    print(f"  {v.key} {v.label:<57}{statistics.median(t):11.1f}{min(t):11.1f}"
          f"{max(t):11.1f}")

  # One dict of per-call times per round; each ratio is taken within a round.
  by_round = [dict(zip(times, r)) for r in zip(*times.values())]
  print()
  print("paired ratios (median over rounds of the ratio within a round, IQR):")
  for name, label, ratio in RATIOS:
    med, lo, hi = _quartiles([ratio(t) for t in by_round])
    print(f"  {name:<8} {med:8.4f}   (IQR {lo:.4f}-{hi:.4f})   {label}")
  folder.cleanup()
  return 0


if __name__ == "__main__":
  sys.exit(main())
