"""Token corpora in the trainer (mpscale.trainer.data.corpora, tokenizing): training from a
Megatron indexed dataset or a flat token file, blends and their logged shares, the
rows each process reads, exact resume, ``mpscale tokenize``, and the keys that name
a mistake.

The corpora here are random documents of ids ``1..V-1``, each ended by the
end-of-document id 0, unless a test numbers its tokens to tell samples apart.
"""

import csv
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import mpscale.trainer
from mpscale.trainer import cli
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import corpora
from mpscale.trainer.data import loader
from mpscale.trainer.data import tokenizing
from mpscale.trainer.data.token_files import FlatTokens, IndexedDataset, write_indexed
from mpscale.trainer.data.token_datasets import GPTSamples

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
EOD = 0
SMALL = {"model": {"d_model": 32, "num_heads": 2, "num_layers": 1, "d_ff": 64,
                   "seq_len": 16},
         "data": {"batch_size": 8, "eval_batches": 2, "eval_fraction": 0.25},
         "train": {"steps": 4, "log_every": 1, "eval_every": 2, "checkpoint_every": 4},
         "schedule": {"warmup_steps": 1}, "optimizer": {"name": "adamw"}}


def _documents(seed, count=40, vocab=256, low=5, high=60):
  rng = np.random.default_rng(seed)
  return [np.append(rng.integers(1, vocab, n), EOD)
          for n in rng.integers(low, high, count)]


def _indexed(path, documents, dtype=np.uint16):
  return write_indexed(str(path), documents, dtype)


def _flat(path, documents, dtype=np.uint16):
  np.concatenate(documents).astype(dtype).tofile(str(path))
  return str(path)


def _config(data, **sections):
  """The small run's config as a mapping, with ``data`` keys and ``sections``."""
  raw = {key: dict(value) for key, value in SMALL.items()}
  raw["data"].update(data)
  for key, value in sections.items():
    raw.setdefault(key, {}).update(value)
  return raw


def _cfg(data, **sections):
  return config_lib.config_from_dict(_config(data, **sections), "<test>")


def _rows(out):
  with open(os.path.join(out, "metrics.csv"), newline="") as f:
    return list(csv.DictReader(f))


def _train(out, raw, data=None):
  return mpscale.trainer.run(raw, out_dir=str(out), data=data, progress=False,
                             verbose=False)


# ------------------------------------------------------------------ training


@pytest.mark.slow  # three short runs: about 25 s on 2 cores
def test_a_token_file_trains_like_its_samples_given_as_a_source(tmp_path):
  # The same documents as an indexed dataset, as a flat file (cut after each end of
  # document), and as the examples of a user's source in the same order: the same
  # batches, so the same losses, norms and evaluation.
  docs = _documents(0)
  prefix, flat = _indexed(tmp_path / "c", docs), _flat(tmp_path / "c.flat", docs)
  options = {"eod": EOD, "eod_mask_loss": True}
  _train(tmp_path / "indexed", _config({"tokens": prefix, **options}))
  _train(tmp_path / "flat", _config({"tokens": flat, "token_dtype": "uint16",
                                     **options}))
  cfg = _cfg({"tokens": prefix, **options})
  train, held_out = corpora.split_documents(len(docs), cfg.data.eval_fraction)
  np.testing.assert_array_equal(held_out, np.arange(30, 40))  # the last 25%
  n = cfg.train.steps * cfg.data.batch_size
  corpus = IndexedDataset(prefix)
  make = lambda documents, count: GPTSamples(
      corpus, cfg.model.seq_len, cfg.seed, count, documents=documents, cache=False,
      eod=EOD, eod_mask_loss=True)
  train_samples, eval_samples = make(train, n), make(held_out, None)
  source = {"train": [train_samples[i] for i in range(n)],
            "eval": [eval_samples[i] for i in range(len(eval_samples))]}
  _train(tmp_path / "source", _config({"shuffle": False}), data=source)
  keys = ("step", "loss", "eval_loss", "global_norm")
  want = [tuple(r[k] for k in keys) for r in _rows(tmp_path / "source")]
  assert len(want) == 4 and want[1][2] != ""  # four rows, evaluated at step 2
  for run in ("indexed", "flat"):
    assert [tuple(r[k] for k in keys) for r in _rows(tmp_path / run)] == want, run
  # The masked targets count: the same batches without the mask train otherwise.
  assert any((s["mask"] == 0).any() for s in source["train"][:8])
  summary = json.loads((tmp_path / "indexed" / "summary.json").read_text())
  assert summary["data"] == prefix and "data_fractions" not in summary


def _numbered(path, lengths, first=1):
  """An indexed corpus whose tokens are ``first, first + 1, ...`` in order: each
  sample's first input tells which it is."""
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + first
  return _indexed(path, [np.arange(s, s + n) for s, n in zip(starts, lengths)],
                  np.int32)


@pytest.mark.parametrize("blend", [False, True])
def test_each_process_reads_disjoint_rows_whose_union_is_the_global_batch(
    tmp_path, blend):
  lengths = np.random.default_rng(1).integers(20, 80, 30)
  a = _numbered(tmp_path / "a", lengths)
  b = _numbered(tmp_path / "b", lengths, first=3000)
  data = ({"blend": [{"path": a, "weight": 0.6}, {"path": b, "weight": 0.4}]}
          if blend else {"tokens": a})
  cfg = _cfg(data, model={"vocab_size": 8192}, train={"steps": 30})
  whole = corpora.token_data(cfg)
  parts = [corpora.token_data(cfg, rows) for rows in ((0, 2), (2, 4), (4, 6), (6, 8))]
  its = [p.iterator() for p in parts]
  seen = set()
  for step, want in zip(range(30), whole.iterator()):  # about three epochs of a
    got = [next(it) for it in its]
    for key in want:  # each its rows: together the batch, in order
      np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key],
                                    err_msg=f"step {step} {key}")
    seen.update(want["inputs"].ravel().tolist())
  # A process's position restores like one process's.
  state = its[1].get_state()
  assert state == {"next_index": 30}
  np.testing.assert_array_equal(next(parts[1].iterator(state))["inputs"],
                                next(its[1])["inputs"])
  # Evaluation: each process's rows of the same held-out batches.
  want_eval = [e["inputs"] for e in whole.eval_batches()]
  got_eval = [np.concatenate(r) for r in
              zip(*([e["inputs"] for e in p.eval_batches()] for p in parts))]
  assert len(want_eval) == len(got_eval) == 2
  for want, got in zip(want_eval, got_eval):
    np.testing.assert_array_equal(got, want)
  held_out = corpora.split_documents(30, cfg.data.eval_fraction)[1].tolist()
  assert held_out == list(range(22, 30))
  starts = np.concatenate([[0], np.cumsum(lengths)])
  held_tokens = {t + f for d in held_out for t in range(starts[d], starts[d + 1])
                 for f in (1, 3000)}
  assert set(np.concatenate(want_eval).ravel().tolist()) <= held_tokens
  assert not seen & held_tokens  # training never reads a held-out token
  assert len(seen) > 0.9 * (starts[22] * (2 if blend else 1))  # but all the others


# ------------------------------------------------------------------ batches at once
#
# One corpus without a ramp-up is read as corpora.SampleBatches (a batch per grain
# item, gathered by GPTSamples.examples); the per-example path it replaces is
# loader.user_data over the GPTSamples, which blends and ramp-ups still take.


def _per_example(samples, cfg, rows=None):
  """The batches grain makes of ``samples`` example by example (the reference)."""
  return loader.user_data({"train": samples}, cfg, "data.tokens", rows,
                          shuffle=False).train


def _assert_same_batch(got, want, what):
  assert list(got) == list(want), what  # the keys, in order
  for key in want:
    assert got[key].dtype == want[key].dtype, (what, key)
    np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what} {key}")


def _sample_corpora(tmp_path):
  """An indexed corpus with empty documents and a flat file of the same tokens:
  documents of 0 to 40 tokens, so most samples of 16 span two or more."""
  docs = _documents(10, count=60, low=0, high=40)
  docs[3] = docs[17] = np.zeros(0, np.int64)  # an indexed corpus may hold empty ones
  return {"indexed": IndexedDataset(_indexed(tmp_path / "c", docs)),
          "flat": FlatTokens(_flat(tmp_path / "c.flat", docs), np.uint16, EOD)}


@pytest.mark.parametrize("kind", ["indexed", "flat"])
@pytest.mark.parametrize("options", [
    {}, {"eod_mask_loss": True},
    {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True},
    {"reset_position_ids": True}])
def test_sample_batches_equal_the_per_example_batches(tmp_path, kind, options):
  corpus = _sample_corpora(tmp_path)[kind]
  cfg = _cfg({})  # 8 rows of 16 tokens
  bs = cfg.data.batch_size
  # Three epochs of indices (the documents repeated and shuffled, the last epoch
  # apart), read from the cache as the trainer reads them (memory-mapped); the
  # batches run past the last sample into the first again, mid-batch (the samples
  # are not a multiple of 8).
  make = lambda: GPTSamples(corpus, 16, 3, 200, eod=EOD, cache_dir=tmp_path / "idx",
                            **options)
  make()
  samples = make()
  assert samples.cache_hit and samples.epochs == 3 and len(samples) % bs
  end = len(samples) // bs
  steps = [0, 1, 2, end - 1, end, end + 1, end + 2, 2 * end + 1, 10**6]
  for rows in (None, (0, 4), (4, 8), (2, 4)):
    want, got = _per_example(samples, cfg, rows), corpora.SampleBatches(
        samples, bs, rows)
    for step in steps:
      _assert_same_batch(got[step], want[step], f"rows {rows} step {step}")
  # Two processes' rows: together the whole batch, in order.
  halves = [corpora.SampleBatches(samples, bs, r) for r in ((0, 4), (4, 8))]
  whole = corpora.SampleBatches(samples, bs)
  for step in steps:
    for key, value in whole[step].items():
      np.testing.assert_array_equal(
          np.concatenate([h[step][key] for h in halves]), value, err_msg=key)
  # The reset options' arrays, as Megatron makes them, on a batch with eods.
  batch = whole[end]
  if options.get("reset_position_ids"):
    assert (batch["inputs"][:, :-1] == EOD).any()
    assert batch["position_ids"].min() == 0 and (batch["position_ids"][:, 0] == 0).all()
  # Every example of the epoch, in any order, negative ones too, and none.
  ids = np.concatenate([np.arange(-len(samples), len(samples)), [5, 5, 0]])
  got = samples.examples(ids)
  for key, value in got.items():
    assert value.shape[0] == len(ids) and value.flags.c_contiguous
  for j in range(0, len(ids), 7):
    _assert_same_batch({k: v[j] for k, v in got.items()},
                       dict(sorted(samples[int(ids[j])].items())), f"example {ids[j]}")
  assert {k: v.shape for k, v in samples.examples([]).items()} == {
      k: (0, 16) for k in got}
  with pytest.raises(IndexError):
    samples.examples([len(samples)])


def test_a_corpus_read_only_through_get_is_gathered_row_by_row(tmp_path):
  class Wrapped:  # the corpus interface GPTSamples needs, no memory-mapped file
    def __init__(self, corpus):
      self.corpus, self.sequence_lengths = corpus, corpus.sequence_lengths

    def __len__(self):
      return len(self.corpus)

    def get(self, i, offset=0, length=None):
      return self.corpus.get(i, offset, length)

  corpus = _sample_corpora(tmp_path)["indexed"]
  fast = GPTSamples(corpus, 16, 1, 200, eod=EOD, eod_mask_loss=True, cache=False)
  slow = GPTSamples(Wrapped(corpus), 16, 1, 200, eod=EOD, eod_mask_loss=True,
                    cache=False)
  assert slow._gather() is None and fast._gather() is not None
  ids = np.arange(len(fast))
  _assert_same_batch(slow.examples(ids), fast.examples(ids), "all")
  # Pickled (as grain may, to a worker process) it maps the corpus anew.
  fast.examples([0])
  again = pickle.loads(pickle.dumps(fast))
  assert "_gathered" not in again.__dict__
  _assert_same_batch(again.examples(ids), fast.examples(ids), "unpickled")


@pytest.mark.parametrize("kind", ["indexed", "flat"])
def test_token_data_reads_one_corpus_a_batch_at_a_time_and_resumes(tmp_path, kind):
  path = str(_sample_corpora(tmp_path)[kind].path)
  data = {"tokens": path, "eod": EOD, "eod_mask_loss": True}
  if kind == "flat":
    data["token_dtype"] = "uint16"
  cfg = _cfg(data, train={"steps": 35})
  run = corpora.token_data(cfg)
  assert "SampleBatches" in str(run.train)  # not grain's batches of examples
  # The reference: the same GPTSamples (the training documents, the run's sample
  # count) batched example by example.
  corpus = (IndexedDataset(path) if kind == "indexed"
            else FlatTokens(path, np.uint16, EOD))
  train, _ = corpora.split_documents(len(corpus), cfg.data.eval_fraction)
  samples = GPTSamples(corpus, cfg.model.seq_len, cfg.seed, 35 * 8, documents=train,
                       eod=EOD, eod_mask_loss=True, cache=False)
  want = _per_example(samples, cfg)
  end = len(samples) // 8  # its last batch runs into its first samples again
  assert samples.epochs > 2 and len(samples) % 8
  it = run.iterator()
  for step in range(end + 3):
    _assert_same_batch(next(it), want[step], f"step {step}")
  # Mid-epoch, past the samples' end: the position is the step, as grain's own
  # batches of examples record it, and a new iterator from it goes on alike.
  state = it.get_state()
  reference = iter(want.to_iter_dataset())
  for _ in range(end + 3):
    next(reference)
  assert state == reference.get_state() == {"next_index": end + 3}
  resumed = run.iterator(state)
  for step in range(end + 3, end + 8):
    batch = next(it)
    _assert_same_batch(next(resumed), batch, f"resumed step {step}")
    _assert_same_batch(batch, want[step], f"step {step}")
  # A ramp-up keeps grain's batches of examples (its batches change size).
  raw = _config({**data, "rampup_batch_size": [4, 4, 32]},
                train={"steps": None, "samples": 200})
  raw["schedule"] = {"warmup_samples": 8}  # a ramp-up counts the run in samples
  ramped = corpora.token_data(config_lib.config_from_dict(raw, "<test>"))
  assert "SampleBatches" not in str(ramped.train)
  assert [len(ramped.train[step]["inputs"]) for step in (0, 7, 8)] == [4, 4, 8]


def _blend_rule(weights, size):
  """Megatron's blending rule, written from its C++ (helpers.cpp)."""
  weights = np.asarray(weights) / np.sum(weights)
  counts, chosen = np.zeros(len(weights)), []
  for i in range(size):
    errors = weights * max(i, 1) - counts
    chosen.append(int(np.argmax(errors)))
    counts[chosen[-1]] += 1
  return np.asarray(chosen)


def test_a_blend_logs_the_share_of_each_corpus(tmp_path):
  a = _indexed(tmp_path / "a", _documents(2))
  b = _indexed(tmp_path / "b", _documents(3, vocab=100))
  blend = [{"path": a, "weight": 3.0, "name": "web"}, {"path": b, "weight": 1.0}]
  out = tmp_path / "run"
  summary = _train(out, _config({"blend": blend}, train={"steps": 5}))
  rows = _rows(out)
  chosen = _blend_rule([3.0, 1.0], 5 * 8)
  for row in rows:
    step = int(row["step"])
    share = np.mean(chosen[:step * 8] == 0)
    assert float(row["data/web"]) == pytest.approx(share, abs=1e-12)
    assert float(row["data/b"]) == pytest.approx(1 - share, abs=1e-12)
  assert summary["data_fractions"] == {"web": float(rows[-1]["data/web"]),
                                       "b": float(rows[-1]["data/b"])}
  assert summary["data_fractions"]["web"] == pytest.approx(0.75, abs=1 / 40)
  assert summary["data"] == "blend: web 3, b 1"


# ------------------------------------------------------------------ resume


@pytest.mark.slow  # three training processes (quickly compiled: test_resume._env)
def test_sigkill_then_resume_is_bit_identical(tmp_path, monkeypatch):
  # test_resume's run on a blend of an indexed corpus (about three epochs of it:
  # killed mid-epoch) and a flat file, killed mid-blend.
  from tests.trainer.runs import test_resume as resume
  a = _indexed(tmp_path / "a", _documents(4, count=30, low=20, high=60))
  b = _flat(tmp_path / "b.bin", _documents(5, count=30, low=20, high=60))
  data = {"blend": [{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}],
          "eod": EOD, "eod_mask_loss": True,
          "eval_fraction": 0.3}  # a batch of 8 held-out samples of 32 tokens
  config = tmp_path / "blend.yaml"
  config.write_text(json.dumps({
      "name": "blend", "data": data, "precision": {"policy": "O2"},
      "loss_scale": {"kind": "dynamic"}, "optimizer": {"name": "came"}}))
  monkeypatch.setitem(resume.RUNS, "blend", (str(config), resume.SETTINGS))
  (tmp_path / "runs").mkdir()
  resume.test_sigkill_then_resume_is_bit_identical(tmp_path / "runs", "blend")
  header = _rows(tmp_path / "runs" / "killed")[0]
  assert "data/a" in header and "data/b.bin" in header


# ------------------------------------------------------------------ tokenize


TEXTS = ["Return the number of items.\n\n  Indented; tabs\tand ünïcödé: 日本 🎉",
         "A second document, with <angle> brackets and  two spaces.",
         "x" * 300]


def test_tokenize_round_trips_text_through_a_trained_bpe(tmp_path, capsys):
  (tmp_path / "in").mkdir()
  for i, text in enumerate(TEXTS):
    (tmp_path / "in" / f"{i}.txt").write_text(text, encoding="utf-8")
  records = tmp_path / "docs.jsonl"
  records.write_text("".join(json.dumps({"body": t, "id": i}) + "\n"
                             for i, t in enumerate(TEXTS)), encoding="utf-8")
  out = tmp_path / "out"
  out.mkdir()
  assert cli.main(["tokenize", str(tmp_path / "in"), str(records), "--key", "body",
                   "--vocab-size", "300", "--out", str(out / "c")]) == 0
  printed = capsys.readouterr()
  # No bar without a terminal (rich 13.0 ends it with a blank line, no more).
  assert printed.out.startswith("6 documents") and printed.err.strip() == ""
  tokenizer = tokenizing.load_tokenizer(str(out / "tokenizer.json"))
  assert 257 < tokenizing.vocabulary_size(tokenizer) <= 300
  corpus = IndexedDataset(str(out / "c"))
  assert len(corpus) == 6
  for i, text in enumerate(TEXTS + TEXTS):  # the folder's files, then the lines
    ids = corpus[i]
    assert ids[-1] == EOD and EOD not in ids[:-1]  # <|endoftext|> is id 0
    assert tokenizing.decode(tokenizer, ids[:-1]) == text
  for text in TEXTS + ["unseen: Ωμέγα ☃ \r\n\x00"]:
    ids = tokenizing.encode(tokenizer, text)
    assert tokenizing.decode(tokenizer, ids) == text and ids.max() < 300
  assert len(tokenizing.encode(tokenizer, TEXTS[2])) < 300 // 4  # merges learned
  # A flat file with the same tokenizer: the same tokens back to back.
  assert cli.main(["tokenize", str(tmp_path / "in"), str(records), "--key", "body",
                   "--tokenizer", str(out / "tokenizer.json"), "--format", "flat",
                   "--out", str(out / "c.flat")]) == 0
  flat = np.fromfile(out / "c.flat", np.uint16)
  np.testing.assert_array_equal(flat, np.concatenate([corpus[i] for i in range(6)]))


def test_tokenize_refuses_to_write_over_a_corpus_or_a_tokenizer(tmp_path, capsys):
  """Issue #42: the two tokenize blocks of the README (now docs/data.md) into one
  folder replaced a 1,024-id tokenizer with a 512-id one, and the first corpus then
  decoded garbage. Writing
  over a tokenizer.json or a corpus is refused before anything is written, naming
  the flag; --overwrite allows it."""
  (tmp_path / "in.txt").write_text("\n\n".join(TEXTS), encoding="utf-8")
  out = tmp_path / "out"
  out.mkdir()
  first = ["tokenize", str(tmp_path / "in.txt"), "--vocab-size", "300",
           "--out", str(out / "a")]
  assert cli.main(first) == 0
  capsys.readouterr()
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  second = ["tokenize", str(tmp_path / "in.txt"), "--vocab-size", "280",
            "--out", str(out / "b")]
  assert cli.main(second) == 2
  assert "--vocab-size" in capsys.readouterr().err
  assert cli.main(first) == 2  # the corpus itself
  assert "--out" in capsys.readouterr().err
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
  assert cli.main(second + ["--overwrite"]) == 0
  assert tokenizing.vocabulary_size(
      tokenizing.load_tokenizer(str(out / "tokenizer.json"))) <= 280


def test_a_corpus_a_tokenizer_cannot_decode_is_refused_at_start(tmp_path):
  """Ids beyond ``data.tokenizer``'s vocabulary (a corpus written by another
  tokenizer) are refused when the data is loaded, naming both keys, even where the
  model's vocabulary would hold them."""
  bpe = tokenizing.train_bpe(TEXTS, 300)
  bpe.save(str(tmp_path / "tokenizer.json"))
  size = tokenizing.vocabulary_size(bpe)
  prefix = _indexed(tmp_path / "c", _documents(3, vocab=size + 50))
  cfg = _cfg({"tokens": prefix, "tokenizer": str(tmp_path / "tokenizer.json")},
             model={"vocab_size": 512})
  with pytest.raises(mpscale.ArgumentError, match="another tokenizer") as info:
    corpora.token_data(cfg)
  assert info.value.names == ("data.tokenizer", "data.tokens")


def test_a_checkpoint_folder_gives_its_tokenizer(tmp_path):
  """``data.tokenizer`` and ``mpscale tokenize --tokenizer`` take a Hugging Face
  checkpoint's folder for the ``tokenizer.json`` in it: the same ids as the file,
  and a corpus beyond its vocabulary refused as with the file."""
  folder = tmp_path / "checkpoint"
  folder.mkdir()
  bpe = tokenizing.train_bpe(TEXTS, 300)
  bpe.save(str(folder / "tokenizer.json"))
  from_folder = tokenizing.load_tokenizer(str(folder))
  assert from_folder.encode(TEXTS[0]).ids == bpe.encode(TEXTS[0]).ids
  size = tokenizing.vocabulary_size(bpe)
  prefix = _indexed(tmp_path / "c", _documents(3, vocab=size + 50))
  cfg = _cfg({"tokens": prefix, "tokenizer": str(folder)}, model={"vocab_size": 512})
  assert cfg.data.tokenizer == str(folder / "tokenizer.json")
  with pytest.raises(mpscale.ArgumentError, match="another tokenizer"):
    corpora.token_data(cfg)


def test_tokenize_output_is_plain_without_a_terminal(tmp_path):
  text = tmp_path / "t.txt"
  text.write_text(" ".join(TEXTS))
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH",
                                                                       ""))
  for flags in ([], ["--progress"]):  # the bar asked for, on a pipe
    result = subprocess.run(
        [sys.executable, "-m", "mpscale", "tokenize", str(text), "--vocab-size", "260",
         "--out", str(tmp_path / "c"), "--overwrite", *flags], capture_output=True,
        text=True,
        env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("1 document, ")
    assert "\x1b" not in result.stdout + result.stderr  # no terminal control codes
  assert "tokenize" in result.stderr  # the bar's final state, printed once


def test_data_tokenize_builds_the_copy_once_and_sample_decodes_it(tmp_path):
  text = tmp_path / "docs.jsonl"
  text.write_text("".join(json.dumps({"text": f"document {i}: " + " ".join(
      TEXTS[i % 3].split()[:8]) * 3}) + "\n" for i in range(20)))
  data = {"path": str(text), "tokenize": {"vocab_size": 300,
                                          "cache_dir": str(tmp_path / "cache")}}
  cfg = _cfg(data, model={"vocab_size": 300})
  first = corpora.token_data(cfg)
  built = sorted(os.listdir(tmp_path / "cache" / "tokens"))
  assert len(built) == 1 and built[0].startswith("docs.jsonl-")
  again = corpora.token_data(cfg)
  assert sorted(os.listdir(tmp_path / "cache" / "tokens")) == built  # reused
  assert first.tokenizer == again.tokenizer and first.tokenizer.endswith(
      "tokenizer.json")
  np.testing.assert_array_equal(first.train[3]["inputs"], again.train[3]["inputs"])


@pytest.mark.slow  # trains, then compiles the sampler: about 40 s on 2 cores
def test_the_bpe_config_trains_and_sample_and_eval_use_its_tokenizer(tmp_path, capsys):
  out = tmp_path / "run"
  small = ["model.d_model=32", "model.num_heads=2", "model.num_layers=1",
           "model.d_ff=64", "model.seq_len=16", "data.batch_size=8",
           "data.eval_batches=2", "train.steps=2", "schedule.warmup_steps=1",
           f"data.tokenize.cache_dir={tmp_path / 'cache'}"]
  assert cli.main(["train", "--config", os.path.join(ROOT, "configs",
                                                     "tiny_lm_bpe.yaml"),
                   "--out", str(out), "--quiet", "--no-progress",
                   *[a for o in small for a in ("--set", o)]]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["data"].startswith("stdlib docstrings, tokenized")
  (copy,) = os.listdir(tmp_path / "cache" / "tokens")
  tokenizer = tokenizing.load_tokenizer(str(tmp_path / "cache" / "tokens" / copy /
                                            "tokenizer.json"))
  text = cli.sample_run(str(out), "Return the", 6, temperature=0.0)
  assert text.startswith("Return the") and len(text) > len("Return the")
  written = tokenizing.encode(tokenizer, text[len("Return the"):])
  assert 0 < len(written) <= 6 * 2  # BPE tokens, not bytes (re-encoding may split)
  capsys.readouterr()
  assert cli.main(["eval", str(out)]) == 0
  loss = summary["final_eval_loss"]
  assert f"eval loss {loss:.4f} nats/token at step 2" in capsys.readouterr().out


# ------------------------------------------------------------------ mistakes


@pytest.fixture
def corpus(tmp_path):
  return _indexed(tmp_path / "c", _documents(6))


def _blend(corpus, weights):
  return [{"path": corpus, "weight": w, "name": f"c{i}"} for i, w in enumerate(weights)]


@pytest.mark.parametrize("data,sections,key", [
    (lambda c: {"tokens": c, "path": "text.txt"}, {}, "data.tokens"),
    (lambda c: {"tokens": c, "blend": _blend(c, [1, 1])}, {}, "data.blend"),
    (lambda c: {"tokens": c + "x"}, {}, "data.tokens"),
    (lambda c: {"tokens": c + ".bin"}, {}, "data.tokens"),
    (lambda c: {"tokens": c, "token_dtype": "uint16"}, {}, "data.token_dtype"),
    (lambda c: {"token_dtype": "float32", "tokens": c}, {}, "data.token_dtype"),
    (lambda c: {"blend": _blend(c, [1, 0])}, {}, "data.blend[1].weight"),
    (lambda c: {"blend": _blend(c, [1, -2])}, {}, "data.blend[1].weight"),
    (lambda c: {"blend": [{"path": c}]}, {}, "data.blend[0].weight"),
    (lambda c: {"blend": [{"path": c, "weight": 1}] * 2}, {}, "data.blend[1].name"),
    (lambda c: {"tokens": c, "reset_position_ids": True, "eod": 0}, {},
     "data.reset_position_ids"),
    (lambda c: {"tokens": c, "eod_mask_loss": True}, {}, "data.eod_mask_loss"),
    (lambda c: {"eod_mask_loss": True}, {}, "data.eod_mask_loss"),
    (lambda c: {"tokens": c, "eod": 300}, {}, "data.eod"),
    (lambda c: {"tokenize": {}}, {}, "data.tokenize.vocab_size"),
    (lambda c: {"tokenize": {"vocab_size": 100}}, {}, "data.tokenize.vocab_size"),
    (lambda c: {"tokenize": {"vocab_size": 512}}, {}, "model.vocab_size"),
])
def test_bad_token_keys_are_named(corpus, data, sections, key):
  with pytest.raises(config_lib.ConfigError) as info:
    _cfg(data(corpus), **sections)
  assert info.value.keys[0] == key and key in str(info.value)


def test_a_missing_idx_and_a_tokenizer_beyond_the_vocabulary_are_named(tmp_path):
  docs = _documents(7)
  prefix = _indexed(tmp_path / "c", docs)
  os.remove(prefix + ".idx")
  with pytest.raises(config_lib.ConfigError, match=r"data.tokens: .*c.bin' has no "
                     r".*c.idx' beside it") as info:
    _cfg({"tokens": prefix})
  assert info.value.keys == ("data.tokens",)
  bpe = tokenizing.train_bpe(TEXTS, 300)
  bpe.save(str(tmp_path / "tokenizer.json"))
  flat = _flat(tmp_path / "c.flat", docs)
  with pytest.raises(config_lib.ConfigError) as info:
    _cfg({"tokens": flat, "tokenizer": str(tmp_path / "tokenizer.json")})
  assert info.value.keys == ("model.vocab_size", "data.tokenizer")
  # Relative to the config file, as the providers are; the tokenizer's
  # <|endoftext|> is the end of document.
  (tmp_path / "run.yaml").write_text(json.dumps(_config(
      {"tokens": "c.flat", "tokenizer": "tokenizer.json", "eod_mask_loss": True},
      model={"vocab_size": 512})))
  cfg = config_lib.load_config(str(tmp_path / "run.yaml"))
  assert cfg.data.tokens == flat and corpora.token_data(cfg).tokenizer == str(
      tmp_path / "tokenizer.json")


def test_ids_beyond_the_vocabulary_and_an_unsplittable_file_fail_before_any_write(
    tmp_path):
  docs = _documents(8, vocab=1000)
  prefix = _indexed(tmp_path / "c", docs)
  out = tmp_path / "run"
  with pytest.raises(config_lib.ConfigError) as info:
    _train(out, _config({"tokens": prefix}))
  assert info.value.keys == ("model.vocab_size", "data.tokens")
  assert f"holds id {max(d.max() for d in docs)}" in str(info.value)
  flat = _flat(tmp_path / "one.bin", _documents(9))
  with pytest.raises(config_lib.ConfigError, match="set data.eod") as info:
    _train(out, _config({"tokens": flat}))  # no data.eod: one document
  assert info.value.keys == ("data.eval_fraction", "data.tokens")
  assert not out.exists()
