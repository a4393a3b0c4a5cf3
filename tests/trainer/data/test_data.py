"""Data: the embedded corpus, byte tokens, the split, and (seed, step)-pure batches."""

import numpy as np
import pytest

from mpscale.trainer.data import text as data

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


@pytest.fixture(scope="module")
def corpus():
  return data.load_data()


def test_stdlib_corpus_is_real_deterministic_text():
  text = data.stdlib_corpus()
  assert len(text) > 300_000
  assert text.startswith(b"# module argparse\n")
  assert b"Command-line parsing library" in text
  data.stdlib_corpus.cache_clear()
  assert data.stdlib_corpus() == text  # read again from the sources: identical
  assert list(data.STDLIB_MODULES) == sorted(data.STDLIB_MODULES)


def test_byte_tokens_round_trip():
  text = "héllo, wörld\n"
  tokens = data.tokenize(text)
  assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode())
  assert data.detokenize(tokens) == text


def test_split_takes_whole_blocks(corpus):
  tokens = data.tokenize(data.stdlib_corpus())
  assert len(corpus.train) + len(corpus.held_out) == len(tokens)
  share = len(corpus.held_out) / len(tokens)
  assert 0.07 < share < 0.13
  first = corpus.held_out[:data.BLOCK_BYTES].tobytes()
  assert tokens.tobytes().find(first) % data.BLOCK_BYTES == 0
  with pytest.raises(ValueError, match="eval_fraction"):
    data.split_tokens(tokens, 1.0)


def test_train_batch_is_a_pure_function_of_seed_and_step(corpus):
  a = corpus.train_batch(0, 7, 4, 16)
  b = corpus.train_batch(0, 7, 4, 16)
  for key in ("inputs", "targets", "mask"):
    np.testing.assert_array_equal(a[key], b[key])
  assert a["inputs"].shape == (4, 16) and a["inputs"].dtype == np.int32
  np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
  assert a["mask"].sum() == 4 * 16
  assert not np.array_equal(a["inputs"], corpus.train_batch(0, 8, 4, 16)["inputs"])
  assert not np.array_equal(a["inputs"], corpus.train_batch(1, 7, 4, 16)["inputs"])


def test_eval_batches_cover_the_held_out_split_once(corpus):
  small = data.TextData(corpus.train, corpus.held_out[:1000], "test")
  batches = list(small.eval_batches(batch_size=4, seq_len=64))
  assert len(batches) == 4  # ceil(999 / 64) = 16 rows, 4 per batch
  mask = np.concatenate([b["mask"].ravel() for b in batches])
  targets = np.concatenate([b["targets"].ravel() for b in batches])
  assert mask.sum() == 999
  np.testing.assert_array_equal(targets[:999], small.held_out[1:1000])
  assert len(list(small.eval_batches(4, 64, max_batches=2))) == 2


def test_read_text_from_file_and_folder(tmp_path):
  (tmp_path / "b.txt").write_text("second")
  (tmp_path / "a.txt").write_text("first")
  (tmp_path / ".hidden").write_text("never")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "c.txt").write_text("third")
  assert data.read_text(tmp_path) == b"first\n\nsecond\n\nthird"
  assert data.read_text(tmp_path / "a.txt") == b"first"
  with pytest.raises(ValueError, match="neither a file nor a folder"):
    data.read_text(tmp_path / "missing")
  loaded = data.load_data(tmp_path / "a.txt", eval_fraction=0.5)
  assert loaded.source.endswith("a.txt")
  with pytest.raises(ValueError, match="shorter than one sequence"):
    loaded.train_batch(0, 0, 2, 16)
