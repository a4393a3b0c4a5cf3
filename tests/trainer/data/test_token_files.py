"""Token corpora on disk: Megatron's indexed format (byte for byte), flat token files.

The format is checked against a plain ``struct`` reading of its layout here, and
against Megatron-Core's own reader and writer when the extra is installed
(``pip install torch==2.13.0`` first, the CPU build, then ``pip install -e
".[megatron]"``).
"""

import os
import pickle
import struct

import numpy as np
import pytest

from mpscale import validation
from mpscale.trainer.data import token_files
from mpscale.trainer.data.token_files import (FlatTokens, IndexedDataset,
                                         IndexedDatasetWriter, open_corpus,
                                         token_dtype, write_indexed)

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _documents(rng, count, high, max_len=40, empty=(1,)):
  docs = [rng.integers(0, high, rng.integers(1, max_len)) for _ in range(count)]
  for i in empty:
    docs[i] = np.zeros(0, np.int64)
  return docs


def _read_layout(prefix):
  """The .idx parsed field by field from its documented layout."""
  with open(prefix + ".idx", "rb") as f:
    raw = f.read()
  magic, (version, code, count, docs) = raw[:9], struct.unpack_from("<QBQQ", raw, 9)
  at = 34
  lengths = np.frombuffer(raw, "<i4", count, at)
  pointers = np.frombuffer(raw, "<i8", count, at + 4 * count)
  indices = np.frombuffer(raw, "<i8", docs, at + 12 * count)
  rest = raw[at + 12 * count + 8 * docs:]
  return magic, version, code, lengths, pointers, indices, rest


@pytest.mark.parametrize("dtype,code,high", [
    (np.uint8, 1, 256), (np.int8, 2, 128), (np.int16, 3, 2**15), (np.int32, 4, 2**31),
    (np.int64, 5, 2**40), (np.uint16, 8, 2**16)])
def test_round_trip_and_byte_layout(tmp_path, dtype, code, high):
  rng = np.random.default_rng(code)
  docs = _documents(rng, 300, high, empty=(0, 7, 299))
  prefix = write_indexed(tmp_path / "corpus", docs, dtype)
  data = IndexedDataset(prefix)
  assert len(data) == 300 and data.num_documents == 300
  assert data.dtype == np.dtype(dtype)
  for i, doc in enumerate(docs):
    np.testing.assert_array_equal(data[i], doc)
    np.testing.assert_array_equal(data.document(i), doc)
  assert data.num_tokens == sum(map(len, docs))
  # The file, read field by field from the documented layout.
  magic, version, file_code, lengths, pointers, indices, rest = _read_layout(prefix)
  assert (magic, version, file_code, rest) == (b"MMIDIDX\x00\x00", 1, code, b"")
  np.testing.assert_array_equal(lengths, [len(d) for d in docs])
  itemsize = np.dtype(dtype).itemsize
  np.testing.assert_array_equal(pointers,
                                np.cumsum([0] + [len(d) * itemsize for d in docs[:-1]]))
  np.testing.assert_array_equal(indices, np.arange(301))
  expected_bin = b"".join(np.asarray(d, np.dtype(dtype).newbyteorder("<")).tobytes()
                          for d in docs)
  with open(prefix + ".bin", "rb") as f:
    assert f.read() == expected_bin
  np.testing.assert_array_equal(data.sequence_lengths, lengths)
  np.testing.assert_array_equal(data.document_indices, indices)


def test_parts_of_a_sequence(tmp_path):
  prefix = write_indexed(tmp_path / "c", [np.arange(10), np.arange(100, 105)], np.int32)
  data = IndexedDataset(prefix)
  np.testing.assert_array_equal(data.get(1, 2), [102, 103, 104])
  np.testing.assert_array_equal(data.get(0, 3, 4), [3, 4, 5, 6])
  np.testing.assert_array_equal(data[-1], np.arange(100, 105))
  assert data.get(0, 10).size == 0
  with pytest.raises(IndexError):
    data.get(1, 3, 3)
  with pytest.raises(IndexError):
    data[2]


def test_documents_of_several_sequences_and_modes(tmp_path):
  prefix = str(tmp_path / "mm")
  with IndexedDatasetWriter(prefix, np.int32, multimodal=True) as writer:
    writer.add_document(np.arange(10), lengths=[4, 6], modes=[1, 2])
    writer.add_document([7, 8, 9])  # one sequence, mode 0
    writer.add_document([], lengths=[])  # a document of no sequences
  data = IndexedDataset(prefix)
  assert len(data) == 3 and data.num_documents == 3
  np.testing.assert_array_equal(data.document_indices, [0, 2, 3, 3])
  np.testing.assert_array_equal(data.sequence_modes, [1, 2, 0])
  np.testing.assert_array_equal(data[1], [4, 5, 6, 7, 8, 9])
  np.testing.assert_array_equal(data.document(0), np.arange(10))
  assert data.document(2).size == 0
  assert IndexedDataset(write_indexed(tmp_path / "plain", [[1]], np.int32)
                        ).sequence_modes is None


def test_token_dtype_by_vocabulary_size():
  assert token_dtype(256) == np.uint16 and token_dtype(65499) == np.uint16
  assert token_dtype(65500) == np.int32 and token_dtype(200_000) == np.int32


def test_the_readers_pickle_as_their_paths(tmp_path):
  prefix = write_indexed(tmp_path / "c", [np.arange(5), np.arange(3)], np.uint16)
  flat = tmp_path / "flat.bin"
  np.array([1, 2, 0, 3, 0], np.uint16).tofile(flat)
  for reader in (IndexedDataset(prefix), FlatTokens(flat, eod=0)):
    blob = pickle.dumps(reader)
    assert len(blob) < 1000  # the path, not the mapped data
    again = pickle.loads(blob)
    for i in range(len(reader)):
      np.testing.assert_array_equal(again[i], reader[i])


# ------------------------------------------------------------------ flat token files
def _reference_split(tokens, eod):
  docs, start = [], 0
  for i, t in enumerate(tokens):
    if t == eod:
      docs.append(tokens[start:i + 1])
      start = i + 1
  if start < len(tokens):
    docs.append(tokens[start:])
  return docs


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_flat_tokens_split_after_each_end_of_document(tmp_path, dtype, monkeypatch):
  monkeypatch.setattr(token_files, "_SCAN_TOKENS", 7)  # several chunks
  rng = np.random.default_rng(0)
  eod = 70_000 if dtype == np.uint32 else 50256
  tokens = rng.integers(0, 1000, 200).astype(dtype)
  tokens[rng.choice(200, 25, replace=False)] = eod
  tokens[[3, 4]] = eod  # an empty-but-for-eod document
  path = tmp_path / "train.bin"
  tokens.tofile(path)
  flat = FlatTokens(path, dtype, eod=eod)
  expected = _reference_split(tokens.tolist(), eod)
  assert len(flat) == len(expected) and flat.num_tokens == 200
  for i, doc in enumerate(expected):
    np.testing.assert_array_equal(flat[i], doc)
  np.testing.assert_array_equal(flat.document_indices, np.arange(len(expected) + 1))
  whole = FlatTokens(path, dtype)  # no eod: one document
  assert len(whole) == 1 and np.array_equal(whole[0], tokens)


def test_flat_tokens_end_with_the_last_eod_or_not(tmp_path):
  path = tmp_path / "t.bin"
  np.array([5, 6, 0, 7, 0], np.uint16).tofile(path)
  assert [d.tolist() for d in FlatTokens(path, eod=0)] == [[5, 6, 0], [7, 0]]
  np.array([5, 0, 7, 8], np.uint16).tofile(path)
  assert [d.tolist() for d in FlatTokens(path, eod=0)] == [[5, 0], [7, 8]]


def test_open_corpus_picks_the_reader(tmp_path):
  prefix = write_indexed(tmp_path / "c", [[1, 2]], np.uint16)
  assert isinstance(open_corpus(prefix), IndexedDataset)
  flat = tmp_path / "f.bin"
  np.array([1, 2], np.uint32).tofile(flat)
  corpus = open_corpus(flat, np.uint32, eod=2)
  assert isinstance(corpus, FlatTokens) and corpus.dtype == np.uint32
  with pytest.raises(validation.ArgumentError, match="^path: neither"):
    open_corpus(tmp_path / "nothing")
  with pytest.raises(validation.ArgumentError, match="^dtype:"):
    open_corpus(prefix, np.uint16)


# ------------------------------------------------------------------ bad input
def test_bad_files_name_the_prefix(tmp_path):
  with pytest.raises(validation.ArgumentError, match=r"^prefix: no file .*\.idx"):
    IndexedDataset(tmp_path / "missing")
  prefix = write_indexed(tmp_path / "c", [np.arange(6), np.arange(4)], np.int32)
  with pytest.raises(validation.ArgumentError, match="without .bin/.idx"):
    IndexedDataset(prefix + ".bin")
  raw = open(prefix + ".idx", "rb").read()
  for name, broken in [("header", b"XXIDIDX\x00\x00" + raw[9:]),
                       ("version", raw[:9] + struct.pack("<Q", 2) + raw[17:]),
                       ("dtype code", raw[:17] + b"\x09" + raw[18:]),
                       ("truncated", raw[:-3]),
                       ("document indices", raw[:-8] + struct.pack("<q", 5))]:
    bad = str(tmp_path / name.replace(" ", "_"))
    open(bad + ".idx", "wb").write(broken)
    open(bad + ".bin", "wb").write(open(prefix + ".bin", "rb").read())
    with pytest.raises(validation.ArgumentError, match="^prefix: "):
      IndexedDataset(bad)
  open(prefix + ".bin", "wb").write(b"\x00" * 20)  # 5 of the 10 int32 tokens
  with pytest.raises(validation.ArgumentError, match="^prefix: .* up to byte 40"):
    IndexedDataset(prefix)


def test_bad_writer_arguments_are_named(tmp_path):
  with pytest.raises(validation.ArgumentTypeError, match="^dtype must be an integer"):
    IndexedDatasetWriter(tmp_path / "a", np.float32)
  with pytest.raises(validation.ArgumentError, match="^dtype uint32 has no code"):
    IndexedDatasetWriter(tmp_path / "a", np.uint32)
  with pytest.raises(validation.ArgumentError, match="^prefix: no folder"):
    IndexedDatasetWriter(tmp_path / "no" / "a", np.uint16)
  with pytest.raises(validation.ArgumentError, match="^vocab_size"):
    token_dtype(0)
  writer = IndexedDatasetWriter(tmp_path / "a", np.uint16)
  with pytest.raises(validation.ArgumentError, match="^tokens: id 70000 does not fit"):
    writer.add_document([1, 70000])
  with pytest.raises(validation.ArgumentError, match="^tokens: id -1"):
    writer.add_document([-1])
  with pytest.raises(validation.ArgumentTypeError, match="^tokens must be integer"):
    writer.add_document([1.5])
  with pytest.raises(validation.ArgumentError, match="^lengths"):
    writer.add_document([1, 2, 3], lengths=[1, 1])
  with pytest.raises(validation.ArgumentError, match="^modes"):
    writer.add_document([1], modes=[1])
  writer.finalize()
  with pytest.raises(validation.ArgumentError, match="finalized"):
    writer.add_document([1])


def test_a_failed_write_leaves_no_partial_dataset(tmp_path):
  prefix = tmp_path / "c"
  with pytest.raises(validation.ArgumentError):
    write_indexed(prefix, [[1, 2], [1, 99999]], np.uint16)
  assert not os.listdir(tmp_path)


def test_bad_flat_files_are_named(tmp_path):
  path = tmp_path / "odd.bin"
  path.write_bytes(b"\x01\x02\x03")
  with pytest.raises(validation.ArgumentError, match="^path: .* 3 bytes, not a whole"):
    FlatTokens(path, np.uint16)
  with pytest.raises(validation.ArgumentError, match="^path: no file"):
    FlatTokens(tmp_path / "missing.bin")
  with pytest.raises(validation.ArgumentTypeError, match="^dtype must be an integer"):
    FlatTokens(path, np.float16)
  with pytest.raises(validation.ArgumentError, match="^eod 70000 is not an id"):
    FlatTokens(path, np.uint16, eod=70000)


# ------------------------------------------------------------------ Megatron-Core
def _megatron():
  return pytest.importorskip(
      "megatron.core.datasets.indexed_dataset",
      reason="megatron-core is not installed (pip install torch==2.13.0, then "
             "pip install -e '.[megatron]')")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_reads_what_mpscale_writes_and_back(tmp_path, dtype):
  megatron = _megatron()
  rng = np.random.default_rng(1)
  docs = _documents(rng, 200, 60_000, empty=(0, 50))
  ours = write_indexed(tmp_path / "ours", docs, dtype)
  theirs = str(tmp_path / "theirs")
  builder = megatron.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
  for doc in docs:
    builder.add_document(np.asarray(doc, np.int64), [len(doc)])  # as preprocess_data
  builder.finalize(theirs + ".idx")
  # Byte-identical files for the same documents.
  for ext in (".bin", ".idx"):
    assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
  read_by_megatron = megatron.IndexedDataset(ours)
  read_by_us = IndexedDataset(theirs)
  for i, doc in enumerate(docs):
    np.testing.assert_array_equal(read_by_megatron[i], doc)
    np.testing.assert_array_equal(read_by_us[i], doc)
  np.testing.assert_array_equal(read_by_megatron.document_indices,
                                read_by_us.document_indices)
  np.testing.assert_array_equal(read_by_megatron.sequence_lengths,
                                read_by_us.sequence_lengths)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_core_multimodal_documents_match(tmp_path):
  megatron = _megatron()
  theirs = str(tmp_path / "theirs")
  builder = megatron.IndexedDatasetBuilder(theirs + ".bin", dtype=np.int32,
                                           multimodal=True)
  builder.add_document(np.arange(10), [4, 6], [1, 2])
  builder.add_document(np.arange(3), [3], [5])
  builder.finalize(theirs + ".idx")
  ours = str(tmp_path / "ours")
  with IndexedDatasetWriter(ours, np.int32, multimodal=True) as writer:
    writer.add_document(np.arange(10), [4, 6], [1, 2])
    writer.add_document(np.arange(3), modes=[5])
  for ext in (".bin", ".idx"):
    assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
  read = megatron.IndexedDataset(ours, multimodal=True)
  np.testing.assert_array_equal(read.index.sequence_modes, [1, 2, 5])
  np.testing.assert_array_equal(read.document_indices, [0, 2, 3])
