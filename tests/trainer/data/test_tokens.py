"""GPT samples and blends: Megatron's sample index, its cache, the options at document
boundaries, and the blending rule (equal to Megatron-Core's own when it is installed).

Every corpus here numbers its tokens (token ``k`` is the ``k``-th of the
concatenated documents), so a sample shows where each of its tokens came from.
"""

import os
import pickle
import types

import numpy as np
import pytest

from mpscale import validation
from mpscale.trainer.data.token_files import FlatTokens, IndexedDataset, write_indexed
from mpscale.trainer.data.token_datasets import (BlendedSamples, GPTSamples, blend,
                                    blending_indices)

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _numbered(tmp_path, lengths, name="c", first=0):
  """An indexed corpus whose tokens are ``first, first + 1, ...`` in document order,
  and its documents."""
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + first
  docs = [np.arange(s, s + n) for s, n in zip(starts, lengths)]
  return IndexedDataset(write_indexed(tmp_path / name, docs, np.int32)), docs


def _lengths(seed, count=40, high=30):
  lengths = np.random.default_rng(seed).integers(0, high, count)
  lengths[[0, count // 2]] = 0  # empty documents are skipped
  return lengths


def _stream(samples, docs):
  return np.concatenate([docs[d] for d in samples.document_index])


def test_one_epoch_uses_every_token_once_but_the_tail(tmp_path):
  corpus, docs = _numbered(tmp_path, _lengths(0))
  seq_len = 8
  samples = GPTSamples(corpus, seq_len, seed=3)
  total = corpus.num_tokens
  assert samples.epochs == 1 and len(samples) == (total - 1) // seq_len
  inputs = np.concatenate([samples[i]["inputs"] for i in range(len(samples))])
  counts = np.bincount(inputs, minlength=total)
  assert counts.max() == 1
  stream = _stream(samples, docs)
  tail = stream[len(samples) * seq_len:]  # the stream's end: 1 to seq_len tokens
  assert 1 <= len(tail) <= seq_len
  np.testing.assert_array_equal(np.sort(np.flatnonzero(counts == 0)), np.sort(tail))


def test_samples_are_seq_len_plus_one_stream_tokens_overlapping_by_one(tmp_path):
  corpus, docs = _numbered(tmp_path, _lengths(1))
  seq_len = 6
  samples = GPTSamples(corpus, seq_len, seed=0, num_samples=150)
  stream = _stream(samples, docs)
  position = np.empty(len(stream), np.int64)
  position[stream[:corpus.num_tokens]] = np.arange(corpus.num_tokens)  # 1st epoch
  starts = []
  for i in range(len(samples)):
    window, example = samples.tokens(i), samples[i]
    assert window.dtype == np.int32 and len(window) == seq_len + 1
    np.testing.assert_array_equal(example["inputs"], window[:-1])
    np.testing.assert_array_equal(example["targets"], window[1:])
    assert example["mask"].dtype == np.float32 and example["mask"].shape == (seq_len,)
    k = int(samples.shuffle_index[i]) * seq_len  # where the sample starts
    np.testing.assert_array_equal(stream[k:k + seq_len + 1], window)
    starts.append(k)
  assert sorted(starts) == list(range(0, len(samples) * seq_len, seq_len))


def test_several_epochs_use_each_token_once_per_epoch_but_the_tail(tmp_path):
  corpus, _ = _numbered(tmp_path, _lengths(2))
  seq_len, total = 8, corpus.num_tokens
  num_samples = 2 * total // seq_len + 5  # into a third epoch
  samples = GPTSamples(corpus, seq_len, seed=1, num_samples=num_samples)
  assert samples.epochs == 3 and len(samples) >= num_samples
  assert len(samples) == (3 * total - 1) // seq_len
  inputs = np.concatenate([samples[i]["inputs"] for i in range(len(samples))])
  counts = np.bincount(inputs, minlength=total)
  short = np.flatnonzero(counts < 3)
  assert set(counts.tolist()) <= {2, 3} and 1 <= len(short) <= seq_len
  assert len(short) == 3 * total - len(samples) * seq_len


def test_a_small_final_epoch_is_shuffled_after_the_others(tmp_path):
  corpus, _ = _numbered(tmp_path, _lengths(3))
  seq_len, total = 8, corpus.num_tokens
  before_final = (total - 1) // seq_len  # the samples of epoch one (of two)
  small = GPTSamples(corpus, seq_len, 0, before_final + 3, cache=False)
  assert small.epochs == 2
  np.testing.assert_array_equal(np.sort(small.shuffle_index[:before_final]),
                                np.arange(before_final))
  large = GPTSamples(corpus, seq_len, 0, 2 * before_final - 1, cache=False)
  assert large.epochs == 2  # 80% or more of the last epoch: one shuffle of all
  assert np.sort(large.shuffle_index[:before_final]).max() >= before_final


def test_two_seeds_give_different_orders_one_seed_the_same(tmp_path):
  corpus, _ = _numbered(tmp_path, _lengths(4))
  first = GPTSamples(corpus, 8, seed=1, cache=False)
  again = GPTSamples(corpus, 8, seed=1, cache=False)
  other = GPTSamples(corpus, 8, seed=2, cache=False)
  tokens = lambda s: np.stack([s.tokens(i) for i in range(len(s))])
  np.testing.assert_array_equal(tokens(first), tokens(again))
  assert not np.array_equal(tokens(first), tokens(other))
  assert not np.array_equal(first.document_index, other.document_index)


def _mtimes(files):
  return {f: os.stat(f).st_mtime_ns for f in files.values()}


def test_the_index_is_cached_beside_the_data_and_reused(tmp_path):
  corpus, _ = _numbered(tmp_path, _lengths(5))
  built = GPTSamples(corpus, 8, seed=1, num_samples=100)
  assert not built.cache_hit
  assert {os.path.dirname(f) for f in built.cache_files.values()} == {
      str(tmp_path / "cache")}
  assert all(os.path.isfile(f) for f in built.cache_files.values())
  before = _mtimes(built.cache_files)
  reused = GPTSamples(corpus, 8, seed=1, num_samples=100)
  assert reused.cache_hit and reused.cache_files == built.cache_files
  assert _mtimes(reused.cache_files) == before  # read, not written again
  for name in ("document_index", "sample_index", "shuffle_index"):
    np.testing.assert_array_equal(getattr(reused, name), getattr(built, name))
  for i in (0, 7, len(built) - 1):
    np.testing.assert_array_equal(reused.tokens(i), built.tokens(i))
  assert len(os.listdir(tmp_path / "cache")) == 4


@pytest.mark.parametrize("change", ["num_samples", "seed", "seq_len", "documents",
                                    "data"])
def test_the_cached_index_is_rebuilt_when_a_key_changes(tmp_path, change):
  corpus, _ = _numbered(tmp_path, _lengths(6))
  args = dict(seq_len=8, seed=1, num_samples=100, cache_dir=tmp_path / "idx")
  built = GPTSamples(corpus, **args)
  if change == "data":  # the same path, other document sizes
    corpus, _ = _numbered(tmp_path, _lengths(7))
  elif change == "documents":
    args["documents"] = np.arange(1, len(corpus))
  else:
    args[change] += 1
  rebuilt = GPTSamples(corpus, **args)
  assert not rebuilt.cache_hit
  assert set(rebuilt.cache_files.values()).isdisjoint(built.cache_files.values())
  assert GPTSamples(corpus, **args).cache_hit


def test_a_damaged_cache_is_rebuilt_and_no_cache_writes_nothing(tmp_path):
  corpus, _ = _numbered(tmp_path, _lengths(8))
  built = GPTSamples(corpus, 8, seed=1, cache_dir=tmp_path / "idx")
  with open(built.cache_files["sample_index"], "wb") as f:
    f.write(b"not an array")
  again = GPTSamples(corpus, 8, seed=1, cache_dir=tmp_path / "idx")
  assert not again.cache_hit
  np.testing.assert_array_equal(again.sample_index, built.sample_index)
  assert GPTSamples(corpus, 8, seed=1, cache_dir=tmp_path / "idx").cache_hit
  GPTSamples(corpus, 8, seed=2, cache=False)
  assert not os.path.exists(tmp_path / "cache")
  assert len(os.listdir(tmp_path / "idx")) == 4


def _eod_corpus(tmp_path, eod=0, count=60):
  rng = np.random.default_rng(9)
  docs = [np.append(rng.integers(eod + 1, eod + 100, rng.integers(1, 12)), eod)
          for _ in range(count)]
  return docs, write_indexed(tmp_path / "eod", docs, np.uint16)


def test_eod_mask_loss_and_resets_follow_megatron(tmp_path):
  _, prefix = _eod_corpus(tmp_path)
  samples = GPTSamples(IndexedDataset(prefix), 16, seed=0, eod=0,
                       eod_mask_loss=True, reset_position_ids=True,
                       reset_attention_mask=True)
  masked = 0
  for i in range(len(samples)):
    example = samples[i]
    mask, position, segment = [], [], []
    p = s = 0
    for token in example["inputs"].tolist():  # Megatron's rule, token by token
      mask.append(0.0 if token == 0 else 1.0)
      position.append(p)
      segment.append(s)
      p, s = (0, s + 1) if token == 0 else (p + 1, s)
    np.testing.assert_array_equal(example["mask"], mask)
    np.testing.assert_array_equal(example["position_ids"], position)
    np.testing.assert_array_equal(example["segment_ids"], segment)
    assert example["position_ids"].dtype == example["segment_ids"].dtype == np.int32
    masked += len(mask) - sum(mask)
  assert masked > 0
  plain = GPTSamples(IndexedDataset(prefix), 16, seed=0)[0]
  assert set(plain) == {"inputs", "targets", "mask"} and plain["mask"].all()


def test_flat_tokens_give_the_same_samples_as_the_indexed_corpus(tmp_path):
  docs, prefix = _eod_corpus(tmp_path, eod=7)
  flat = tmp_path / "train.bin"
  np.concatenate(docs).astype(np.uint16).tofile(flat)
  from_flat = GPTSamples(FlatTokens(flat, eod=7), 10, seed=4, num_samples=200,
                         eod_mask_loss=True)  # the eod is the file's
  from_index = GPTSamples(IndexedDataset(prefix), 10, seed=4, num_samples=200, eod=7,
                          eod_mask_loss=True)
  assert len(from_flat) == len(from_index)
  for i in range(len(from_flat)):
    for key, value in from_flat[i].items():
      np.testing.assert_array_equal(value, from_index[i][key])


def test_grain_reads_it_and_it_pickles_without_its_index(tmp_path):
  import grain
  corpus, _ = _numbered(tmp_path, _lengths(10))
  samples = GPTSamples(corpus, 8, seed=1, num_samples=64)
  batch = grain.MapDataset.source(samples).batch(4)[2]
  assert batch["inputs"].shape == batch["targets"].shape == (4, 8)
  np.testing.assert_array_equal(batch["inputs"][1], samples[9]["inputs"])
  blob = pickle.dumps(samples)
  assert len(blob) < 10_000  # paths, not the arrays
  again = pickle.loads(blob)
  np.testing.assert_array_equal(again.tokens(5), samples.tokens(5))


# ------------------------------------------------------------------ blends
def test_a_blend_realises_its_weights(tmp_path):
  a, _ = _numbered(tmp_path, [50] * 20, "a", first=0)
  b, _ = _numbered(tmp_path, [50] * 20, "b", first=10_000)
  mix = blend([a, b], [0.3, 0.7], seq_len=8, num_samples=2000, seed=0)
  assert len(mix) == 2000
  sources = [int(mix[i]["inputs"][0] >= 10_000) for i in range(2000)]
  from_a = sources.count(0) / 2000
  assert abs(from_a - 0.3) <= 0.02
  np.testing.assert_allclose(mix.realised_fractions(), [from_a, 1 - from_a])
  assert all(int(mix[i]["inputs"].max() >= 10_000) == sources[i] for i in range(50))
  counts = np.cumsum(np.eye(2)[mix.dataset_index], axis=0)  # after each sample
  ideal = np.arange(1, 2001)[:, None] * np.array([0.3, 0.7])
  assert np.abs(counts - ideal).max() <= 1.0  # never a whole sample behind
  np.testing.assert_allclose(mix.realised_fractions(10), [0.3, 0.7])


def test_a_blend_is_deterministic_from_the_seed(tmp_path):
  a, _ = _numbered(tmp_path, [30] * 10, "a")
  b, _ = _numbered(tmp_path, [30] * 10, "b", first=1000)
  args = dict(seq_len=8, num_samples=300, cache=False)
  first = blend([a, b], [1, 3], seed=5, **args)
  again = blend([a, b], [0.25, 0.75], seed=5, **args)  # normalized: the same
  other = blend([a, b], [1, 3], seed=6, **args)
  np.testing.assert_array_equal(first.dataset_index, again.dataset_index)
  np.testing.assert_array_equal(first.dataset_index, other.dataset_index)
  same = [np.array_equal(first[i]["inputs"], again[i]["inputs"]) for i in range(300)]
  differ = [np.array_equal(first[i]["inputs"], other[i]["inputs"]) for i in range(300)]
  assert all(same) and not all(differ)


def test_blending_indices_number_each_sources_draws():
  index, sample = blending_indices([0.2, 0.5, 0.3], 1000)
  assert index.dtype == np.int16 and sample.dtype == np.int64
  for d in range(3):
    np.testing.assert_array_equal(sample[index == d], np.arange((index == d).sum()))
  assert index[0] == 1  # the heaviest first


# ------------------------------------------------------------------ bad input
def test_bad_sample_arguments_are_named(tmp_path):
  corpus, _ = _numbered(tmp_path, [5, 5])
  for kwargs, pattern in [
      (dict(seq_len=0), "^seq_len must be >= 1"),
      (dict(seq_len=10), r"^seq_len \+ 1 = 11 tokens is more than the 10 tokens of "
                         "corpus"),
      (dict(seq_len=4, seed=-1), "^seed"), (dict(seq_len=4, seed=2**32), "^seed"),
      (dict(seq_len=4, num_samples=0), "^num_samples"),
      (dict(seq_len=4, eod_mask_loss=True), "^eod: eod_mask_loss needs"),
      (dict(seq_len=4, reset_attention_mask=True), "^eod: reset_attention_mask"),
      (dict(seq_len=4, documents=[0, 2]), r"^documents must be sequence numbers"),
      (dict(seq_len=4, eod_mask_loss=1), "^eod_mask_loss must be a bool")]:
    with pytest.raises(validation.ArgumentError, match=pattern):
      GPTSamples(corpus, **kwargs)
  with pytest.raises(validation.ArgumentTypeError, match="^corpus must be a token"):
    GPTSamples([[1, 2, 3]], 2)
  with pytest.raises(validation.ArgumentError, match="^cache_dir"):
    GPTSamples(_Pathless(corpus), 4)
  assert len(GPTSamples(_Pathless(corpus), 4, cache=False)) == 2
  with pytest.raises(IndexError):
    GPTSamples(corpus, 4, cache=False)[2]


class _Pathless:
  """A corpus without a path: only its sequences."""

  def __init__(self, corpus):
    self.sequence_lengths, self.get = corpus.sequence_lengths, corpus.get
    self._n = len(corpus)

  def __len__(self):
    return self._n


def test_bad_blend_arguments_are_named(tmp_path):
  corpus, _ = _numbered(tmp_path, [40] * 3)
  small = GPTSamples(corpus, 8, cache=False)  # 14 samples
  for weights, pattern in [([-1, 1], r"^weights\[0\] must be positive"),
                           ([0, 0], r"^weights\[0\] must be positive"),
                           ([1, float("nan")], r"^weights\[1\]"),
                           ([1, 2, 3], "^weights has 3 entries; datasets has 2")]:
    with pytest.raises(validation.ArgumentError, match=pattern):
      BlendedSamples([small, small], weights, 10)
  with pytest.raises(validation.ArgumentTypeError, match="^weights must be a sequence"):
    BlendedSamples([small], 1.0, 10)
  with pytest.raises(validation.ArgumentError,
                     match=r"^datasets\[1\] has 14 examples; a blend of num_samples="):
    BlendedSamples([small, small], [0.1, 0.9], 40)
  with pytest.raises(validation.ArgumentTypeError, match="^datasets must be a list"):
    BlendedSamples([small, 3], [1, 1], 4)
  with pytest.raises(validation.ArgumentError, match="^weights has 1 entries; corpora"):
    blend([corpus, corpus], [1], seq_len=8, num_samples=4)
  with pytest.raises(validation.ArgumentError, match="^n must be >= 1"):
    BlendedSamples([small], [1], 4).realised_fractions(0)


# ------------------------------------------------------------------ Megatron-Core
def _megatron_gpt():
  reason = ("megatron-core is not installed (pip install torch==2.13.0, then "
            "pip install -e '.[megatron]')")
  gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason=reason)
  helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp", reason=reason)
  return gpt, helpers


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("seq_len,seed,num_samples", [
    (16, 3, None), (16, 3, 100), (16, 5, 70), (7, 1, 300), (7, 2, 240), (50, 2, 40),
    (1, 0, 30)])
def test_the_samples_are_megatron_cores(tmp_path, seq_len, seed, num_samples):
  gpt, _ = _megatron_gpt()
  from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
  from megatron.core.datasets.utils import Split
  docs, prefix = _eod_corpus(tmp_path, count=40)
  tokenizer = types.SimpleNamespace(eod=0, vocab_size=100,
                                    unique_identifiers={"class": "stub"})
  config = gpt.GPTDatasetConfig(
      random_seed=seed, sequence_length=seq_len, split="1,0,0",
      path_to_cache=str(tmp_path / "megatron"), tokenizer=tokenizer,
      reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
  indexed = MegatronIndexed(prefix)
  theirs = gpt.GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32),
                          num_samples, Split.train, config)
  ours = GPTSamples(IndexedDataset(prefix), seq_len, seed, num_samples, eod=0,
                    eod_mask_loss=True, reset_position_ids=True,
                    reset_attention_mask=True)
  assert len(ours) == len(theirs)
  for name in ("document_index", "sample_index", "shuffle_index"):
    mine, megatron = getattr(ours, name), getattr(theirs, name)
    assert mine.dtype == megatron.dtype, name
    np.testing.assert_array_equal(mine, megatron, err_msg=name)
  q = np.arange(seq_len)
  for i in range(len(ours)):
    mine, megatron = ours[i], theirs[i]
    np.testing.assert_array_equal(mine["inputs"], megatron["tokens"].numpy())
    np.testing.assert_array_equal(mine["targets"], megatron["labels"].numpy())
    np.testing.assert_array_equal(mine["mask"], megatron["loss_mask"].numpy())
    np.testing.assert_array_equal(mine["position_ids"],
                                  megatron["position_ids"].numpy())
    segment = mine["segment_ids"]
    sees = (q[None, :] <= q[:, None]) & (segment[None, :] == segment[:, None])
    np.testing.assert_array_equal(~sees, megatron["attention_mask"][0].numpy())


def test_the_grid_above_covers_a_separated_final_epoch_and_not(tmp_path):
  docs, prefix = _eod_corpus(tmp_path, count=40)
  separated = []
  for seq_len, num_samples in [(16, 100), (16, 70), (7, 300), (7, 240)]:
    samples = GPTSamples(IndexedDataset(prefix), seq_len, 0, num_samples, cache=False)
    before = ((samples.epochs - 1) * samples.tokens_per_epoch - 1) // seq_len
    separated.append(bool(np.sort(samples.shuffle_index[:before]).max() < before))
  assert separated == [True, False, True, False]


@pytest.mark.parametrize("weights,size", [([0.3, 0.7], 2000),
                                          ([0.3, 0.2, 0.5], 5000),
                                          ([1 / 3] * 3, 999)])
def test_the_blend_is_megatron_cores(weights, size):
  _, helpers = _megatron_gpt()
  index = np.zeros(size, np.int16)
  sample = np.zeros(size, np.int64)
  helpers.build_blending_indices(index, sample, np.asarray(weights), len(weights),
                                 size, False)
  mine_index, mine_sample = blending_indices(weights, size)
  np.testing.assert_array_equal(mine_index, index)
  np.testing.assert_array_equal(mine_sample, sample)
