"""mpscale plan --search (mpscale.trainer.planning.search): layouts ranked by estimated step
time, only those that fit, the same answer twice, a cache, and errors naming their
cause."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import search as search_lib
from mpscale.trainer.planning import targets
from mpscale.trainer.planning.hardware import load_hardware

CONFIG = "configs/tiny_lm_dp_pp.yaml"  # 4 layers, per-token loss: pipelines allowed
A100 = load_hardware("a100-80g")
AXES = ("data",)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
  """The tiny LM on 2 devices over the data axis (with and without ZeRO-1 and
  recomputation: four layouts; the other axes are enumerated above, and compiling
  them all would take minutes) searched twice with one cache, then again with a
  device memory that the largest plan no longer fits in."""
  cache = str(tmp_path_factory.mktemp("plans"))
  start = time.perf_counter()
  first = search_lib.search(CONFIG, 2, A100, axes=AXES, cache_dir=cache)
  first_seconds = time.perf_counter() - start
  start = time.perf_counter()
  second = search_lib.search(CONFIG, 2, A100, axes=AXES, cache_dir=cache)
  second_seconds = time.perf_counter() - start
  peaks = sorted(r["peak_bytes"] for r in first.ranked)
  tight = dataclasses.replace(A100, hbm_bytes=peaks[-1] - 1)
  third = search_lib.search(CONFIG, 2, tight, axes=AXES, cache_dir=cache)
  return first, second, third, first_seconds, second_seconds, tight


def test_every_layout_is_enumerated_within_the_stated_rules():
  cfg = config_lib.load_config(CONFIG)
  ladders = search_lib.layouts(cfg, 8, 8)
  meshes = {(l[0]["mesh.data"], l[0]["mesh.fsdp"], l[0]["mesh.stage"],
             l[0].get("mesh.context", 1), l[0]["mesh.tensor"]) for l in ladders}
  for data, fsdp, stage, context, tensor in meshes:
    assert data * fsdp * stage * context * tensor == 8
    assert cfg.model.num_heads % tensor == 0 and cfg.model.num_layers % stage == 0
    assert data == 1 or fsdp == 1
    assert cfg.model.seq_len % (2 * context) == 0
    assert context == 1 or stage == 1 or tensor == 1
  assert (8, 1, 1, 1, 1) in meshes and (1, 8, 1, 1, 1) in meshes
  assert (2, 1, 2, 1, 2) in meshes and (2, 1, 1, 2, 2) in meshes
  for ladder in ladders:  # the ring where the schedule lets it: GPipe's
    layout = ladder[0]
    if layout.get("mesh.context", 1) > 1:
      assert (layout["model.context_parallel"] == "ring") == (
          layout.get("mesh.pipeline_schedule", "gpipe") == "gpipe")
  for ladder in ladders:
    # a ladder is one layout: without a pipeline, its micro-batch counts, fewest
    # first; then, the last resort, its last variant with the optimizer state offloaded
    *plain, offloaded = ladder
    assert offloaded == {**plain[-1], "train.offload": ["opt_state"]}
    rest = [{k: x for k, x in v.items() if k != "train.num_microbatches"}
            for v in plain]
    assert all(r == rest[0] for r in rest)
    counts = [v["train.num_microbatches"] for v in plain]
    assert counts == sorted(counts) and (len(counts) == 1
                                         or ladder[0]["mesh.stage"] == 1)
    for v in ladder:
      if v["mesh.stage"] > 1:
        assert v["train.num_microbatches"] >= v["mesh.stage"]
        assert v["mesh.pipeline_schedule"] in ("gpipe", "1f1b", "zb_h1")
  schedules = {l[0].get("mesh.pipeline_schedule") for l in ladders}
  assert {"gpipe", "1f1b", "zb_h1"} <= schedules
  assert any(l[0].get("mesh.sequence_parallel") for l in ladders)
  assert any(l[0].get("mesh.virtual_stages") == 2 for l in ladders)


def test_the_search_offloads_the_optimizer_state_only_where_nothing_else_fits():
  """Each ladder's last resort (`search.layouts`): on a device whose memory holds a
  layout's state only without its optimizer state, the pre-ranking starts that
  ladder at its offloaded variant, priced with the host link's copies; with room,
  at its first variant."""
  from mpscale.trainer.planning import analytic
  cfg = config_lib.load_config(CONFIG)
  ladders = [l for l in search_lib.layouts(cfg, 8, 8)
             if l[0]["mesh.data"] == 8 and l[0]["train.recompute"] == "full"
             and not l[0]["mesh.shard_optimizer_state"]]
  model = analytic.Model.from_config(cfg)
  last = analytic.Layout.from_overrides(ladders[0][-2])
  offloaded = analytic.Layout.from_overrides(ladders[0][-1])
  assert offloaded.offload_optimizer and not last.offload_optimizer
  held = analytic.memory_bytes(model, last)
  memory = (held + analytic.memory_bytes(model, offloaded)) / 2
  small = dataclasses.replace(A100, hbm_bytes=memory)
  (candidate,), _ = search_lib.preranked(cfg, ladders[:1], small)
  assert candidate.start == len(ladders[0]) - 1
  assert candidate.estimate.host == pytest.approx(
      2 * analytic.optimizer_bytes(model, offloaded) / A100.host_bandwidth)
  (roomy,), _ = search_lib.preranked(cfg, ladders[:1], A100)
  assert roomy.start == 0 and roomy.estimate.host == 0


def test_the_search_says_which_compiler_its_plans_read(searched):
  """Here JAX's CUDA plugin is absent (the GPU tier's folder is not on the path of
  the main suite): the search compiles on the CPU, and says so with the install
  line; with the plugin it compiles for the A100s."""
  first = searched[0]
  if targets.cuda_installed():
    assert "NVIDIA A100" in first.compiled_for and not first.compile_note
  else:
    assert "CPU" in first.compiled_for and "mpscale[plan-gpu]" in first.compile_note
    assert "note: " in first.text()


@pytest.mark.skipif(not targets.cuda_installed(), reason="JAX's CUDA plugin is not "
                    'installed (pip install "mpscale[plan-gpu]")')
def test_a_search_on_the_gpus_compiler_caches_apart_from_the_cpus(tmp_path):
  """The same layouts compiled for H100s and for the CPU are two plans in the cache:
  the GPU's are not read back as the CPU's."""
  h100 = load_hardware("h100-80g")
  gpu = search_lib.search(CONFIG, 2, h100, axes=AXES, top=1, compiler="target",
                          cache_dir=str(tmp_path))
  cpu = search_lib.search(CONFIG, 2, h100, axes=AXES, top=1, compiler="cpu",
                          cache_dir=str(tmp_path))
  assert "NVIDIA H100" in gpu.compiled_for and "CPU" in cpu.compiled_for
  assert cpu.cache_hits == 0 and gpu.ranked[0]["seconds"] != cpu.ranked[0]["seconds"]


@pytest.mark.slow  # three searches, ~40 s together
def test_the_search_ranks_fitting_layouts_by_estimated_time(searched):
  first = searched[0]
  assert first.ranked and first.not_planned == 0
  seconds = [r["seconds"] for r in first.ranked]
  assert seconds == sorted(seconds)
  for r in first.ranked:
    assert r["peak_bytes"] <= A100.hbm_bytes
    # each row's --set line rebuilds its layout
    flags = r["set"].split()
    assert flags[::2] == ["--set"] * len(r["layout"])
    cfg = config_lib.load_config(CONFIG, flags[1::2])
    assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.stage * cfg.mesh.tensor == 2
  assert "--set mesh.data=" in first.text() and "not searched" in first.text()
  assert {r["mesh"]["data"] for r in first.ranked} == {2}
  assert not any(set(r["mesh"]) - {"data"} for r in first.ranked)  # not in AXES
  assert {(r["layout"]["train.recompute"], r["layout"]["mesh.shard_optimizer_state"])
          for r in first.ranked} == {("none", False), ("none", True), ("full", False),
                                     ("full", True)}


@pytest.mark.slow  # three searches, ~40 s together
def test_the_same_top_layout_twice_and_the_cached_run_is_faster(searched):
  first, second, _, first_seconds, second_seconds, _ = searched
  assert second.ranked[0]["layout"] == first.ranked[0]["layout"]
  assert [r["seconds"] for r in second.ranked] == [r["seconds"] for r in first.ranked]
  assert first.cache_hits == 0
  assert second.cache_hits == len(second.ranked) + second.over_memory_compiled > 0
  assert all(r["cached"] for r in second.ranked)
  assert second_seconds < first_seconds


@pytest.mark.slow  # three searches, ~40 s together
def test_only_layouts_that_fit_are_returned(searched):
  first, _, third, _, _, tight = searched
  assert all(r["peak_bytes"] <= tight.hbm_bytes for r in third.ranked)
  assert third.over_memory_compiled > 0
  # the largest layout no longer fits as it was: it is ranked with more
  # micro-batches, or not at all
  biggest = max(first.ranked, key=lambda r: r["peak_bytes"])["layout"]
  assert biggest not in [r["layout"] for r in third.ranked]


SMALL_AXES = ("data", "tensor")  # 20 layouts on 8 devices, each compiled in seconds


@pytest.fixture(scope="module")
def exhaustive(tmp_path_factory):
  """The tiny LM on 8 devices over data and tensor: every layout compiled
  (``top=None``), then the pre-ranked search (its leading 3 compiled) on the same
  cache, which compiles nothing again. About 2 minutes on 2 cores: the two tests
  that read it are the extended tier's (the `searched` tests rank, compile and
  cache in the default run)."""
  cache = str(tmp_path_factory.mktemp("plans"))
  every = search_lib.search(CONFIG, 8, A100, axes=SMALL_AXES, top=None,
                            cache_dir=cache)
  leading = search_lib.search(CONFIG, 8, A100, axes=SMALL_AXES, top=3,
                              cache_dir=cache)
  return every, leading


@pytest.mark.slow  # 20 compiles, ~2-4 min on 2 cores
@pytest.mark.extended
def test_the_preranked_search_finds_the_exhaustive_searchs_best(exhaustive):
  every, leading = exhaustive
  assert every.not_planned == 0 and every.compiled == every.candidates == 20
  assert len(every.ranked) == 20
  assert leading.compiled == 3 and leading.not_planned == 17
  assert leading.cache_hits == 3  # the exhaustive search's plans, not compiled again
  assert leading.ranked[0]["layout"] == every.ranked[0]["layout"]
  assert leading.ranked[0]["seconds"] == every.ranked[0]["seconds"]
  assert "20 layouts ranked from shapes" in leading.text()


@pytest.mark.slow  # shares the exhaustive search
@pytest.mark.extended
def test_the_preranking_agrees_with_compiled_plans_on_a_small_model(exhaustive):
  rows = exhaustive[0].ranked  # every layout, by its compiled estimate
  compiled = [r["seconds"] for r in rows]
  analytic = [r["analytic_seconds"] for r in rows]
  # rank correlation (Spearman's rho, no ties in practice)
  def ranks(xs):
    order = sorted(range(len(xs)), key=xs.__getitem__)
    return [order.index(i) for i in range(len(xs))]
  rc, ra = ranks(compiled), ranks(analytic)
  n = len(rows)
  rho = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rc, ra)) / (n * (n * n - 1))
  assert rho > 0.8
  # every clear case ordered alike: a layout compiled at least 2x slower than
  # another is ranked below it from shapes too
  for slow in rows:
    for fast in rows:
      if slow["seconds"] > 2 * fast["seconds"]:
        assert slow["analytic_seconds"] > fast["analytic_seconds"], (
            slow["set"], fast["set"])
  # the compiled best is the analytic best or close behind it
  assert rows[0]["analytic_rank"] <= 3


def test_impossible_requests_name_their_cause(tmp_path):
  tiny = dataclasses.replace(A100, hbm_bytes=1e3)
  with pytest.raises(ValueError, match=r"--search.*no layout.*fits"):
    search_lib.search(CONFIG, 2, tiny, axes=("data",))
  with pytest.raises(ValueError, match=r"--hardware.*a100-80g"):
    search_lib.search(CONFIG, 2, "a100-80gb")
  with pytest.raises(ValueError, match=r"--devices.*JAX has"):
    search_lib.search(CONFIG, 4096, A100)
  with pytest.raises(ValueError, match=r"--compile-top"):
    search_lib.search(CONFIG, 2, A100, axes=("data",), top=0)
  with pytest.raises(ValueError, match=r"--axes"):
    search_lib.search(CONFIG, 2, A100, axes=("data", "experts"))
  profile = tmp_path / "gpu.yaml"
  profile.write_text("peak_flops: {bfloat16: 1.0e15}\nhbm_bandwidth: 2.0e12\n"
                     "hbm_bytes: 8.0e10\nlinks: [{name: x, span: node, "
                     "bandwidth: 1.0e11, latency: 1.0e-6}]\n")
  out = subprocess.run(
      [sys.executable, "-m", "mpscale", "plan", "--config", CONFIG, "--search",
       "--devices", "2", "--hardware", str(profile)],
      capture_output=True, text=True, cwd=os.getcwd())
  assert out.returncode == 2
  assert "devices_per_node: missing" in out.stderr and str(profile) in out.stderr
