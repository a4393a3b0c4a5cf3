"""Planning a step from shapes only (mpscale.trainer.planning.compiled), checked against the real
arrays and the model's arithmetic."""

import jax
import numpy as np
import pytest

from mpscale import parallel
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import compiled as plan_lib

SMALL = ["model.d_model=128", "model.d_ff=512", "model.num_layers=4", "model.seq_len=32",
         "data.batch_size=16", "train.steps=10", "schedule.warmup_steps=1"]
"""A small LM with real matrices (the embeddings are not the bulk of it). The tests
plan its data-parallel step several times: the persistent compilation cache
(conftest.py) compiles it once."""


def _cfg(*sets, config="configs/tiny_lm_fp16.yaml"):
  import os
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
  return config_lib.load_config(os.path.join(root, config), SMALL + list(sets))


def _device_bytes(tree, device):
  """Bytes of ``tree``'s real arrays on ``device``."""
  return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
             for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("sets", [
    ["mesh.data=8"],
    ["mesh.data=8", "mesh.shard_optimizer_state=true"],
    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
])
def test_planned_state_bytes_are_the_real_arrays(sets):
  cfg = _cfg(*sets)
  planned = plan_lib.plan(cfg, device_memory="1GB")
  setup = builders.build(cfg)
  state = setup.init(setup.init_params())
  device = setup.mesh.devices.flat[0]
  assert planned.bytes["params"] == _device_bytes(state.params, device)
  assert planned.bytes["optimizer_state"] == _device_bytes(state.opt_state, device)
  assert planned.devices == 8 and planned.fits is True
  assert planned.bytes["peak"] >= planned.bytes["params"] + planned.bytes[
      "optimizer_state"]
  assert planned.params == sum(x.size for x in jax.tree_util.tree_leaves(state.params))


@pytest.mark.parametrize("n", [3, 6])
def test_fsdp_on_a_device_count_that_divides_no_dimension_plans_a_padded_share(n):
  # 3 and 6 divide none of 128, 512 and 256: each weight is split padded (issue
  # #63); on 6, over fsdp 3 x fsdp_transpose 2, which pads 512 to 513, not 516.
  cfg = _cfg(f"mesh.fsdp={n}", "data.batch_size=12")
  planned = plan_lib.plan(cfg, device_memory="1GB")
  setup = builders.build(cfg)
  assert dict(setup.mesh.shape) == (
      {"data": 1, "fsdp": 3} if n == 3 else {"data": 1, "fsdp": 3, "fsdp_transpose": 2})
  assert planned.mesh == dict(setup.mesh.shape)
  state = setup.init(setup.init_params())
  assert planned.bytes["params"] == _device_bytes(state.params,
                                                  setup.mesh.devices.flat[0])
  true = sum(x.nbytes for x in jax.tree_util.tree_leaves(
      parallel.unpad(jax.device_get(state.params))))
  assert true / n < planned.bytes["params"] <= 1.01 * true / n  # padding <= 1%
  # The gathers against the whole model: a device's parameters times n.
  gathers = planned.collectives["all-gather"]["bytes"]
  assert f"all of them {gathers / (planned.bytes['params'] * n):.1f}x" in planned.text()
  assert planned.params == sum(
      x.size for x in jax.tree_util.tree_leaves(parallel.unpad(state.params)))


@pytest.mark.parametrize("remat", [False, True])
def test_planned_flops_are_six_n_t_plus_attention(remat):
  planned = plan_lib.plan(_cfg("mesh.data=8",
                               *(["train.recompute=full"] if remat else [])))
  cfg = _cfg()
  layers = cfg.model.num_layers * (4 * 128 * 128 + 2 * 128 * 512)  # + small vectors
  tokens, attention = 16 * 32, 12 * 4 * 16 * 32 * 32 * 128
  want = (8 if remat else 6) * (layers + 128 * 256) * tokens + (
      attention * (16 / 12 if remat else 1))
  assert planned.model_flops == pytest.approx(want, rel=0.01)
  assert planned.flops_per_step == pytest.approx(planned.model_flops, rel=0.10)


def test_collectives_of_data_parallel_and_pipeline_steps():
  dp = plan_lib.plan(_cfg("mesh.data=8"))
  # The gradients' all-reduce (float16 compute: half the float32 params' bytes) and
  # the loss's; nothing else.
  assert set(dp.collectives) == {"all-reduce"}
  assert dp.collectives["all-reduce"]["bytes"] >= dp.bytes["params"] // 2
  pp = plan_lib.plan(_cfg("mesh.data=2", "mesh.stage=4", "model.num_layers=4",
                          "train.num_microbatches=4", "train.per_token_loss=true"))
  assert pp.bubble == pytest.approx(3 / 7)  # (S - 1) / (M + S - 1), GPipe
  permutes = pp.collectives["collective-permute"]
  # Each tick of the loop (M + S - 1 forward, as many backward) sends one
  # micro-batch of activations to the next stage: counted by the loop's trip count.
  ticks = 2 * (4 + 4 - 1)
  activation = (16 // 2 // 4) * 32 * 128 * 2  # rows x seq x d_model, float16
  assert permutes["count"] >= ticks
  # ... plus a few scalars (the loss's pieces) moved once.
  assert ticks * activation <= permutes["bytes"] < ticks * activation + 1024


def test_fsdp_plan_reports_activations_a_device_and_one_weight_gathered():
  """Activations follow a device's rows (1/8 of one device's on 8, whether the
  parameters are replicated or split); under FSDP the largest all-gather is one
  layer's largest weight in the compute dtype (d_ff x d_model, float16), not more:
  the weights are gathered where they are used."""
  one, dp, fsdp = (plan_lib.plan(_cfg(*sets))
                   for sets in ([], ["mesh.data=8"], ["mesh.fsdp=8"]))
  assert dp.activations == fsdp.activations
  assert one.activations == pytest.approx(8 * dp.activations, rel=0.01)
  assert dp.largest_gather == 0 and dp.gathered_alive == 0
  assert fsdp.largest_gather == 128 * 512 * 2
  # alive at once: more than one weight (the CPU's program, its layers unrolled,
  # keeps each gathered weight from the forward to the backward)
  assert fsdp.largest_gather < fsdp.gathered_alive
  # The tiny LM's matrix products follow its float16 policy: none left in float32.
  assert one.float32_share == 0.0 and "in float32" in one.text()
  text = fsdp.text()
  assert "activations" in text and "gathered" in text and "gathered" not in dp.text()
  assert "alive at once" in text


def test_a_pipelined_plan_shows_every_schedule_side_by_side():
  """Interleaved 1F1B (S = 4, M = 8, v = 2): the plan lists GPipe and 1F1B, plain and
  interleaved, with each table's bubble and stage inputs alive, its own marked, in the
  text and the dict."""
  from mpscale.parallel import pipeline as pl
  S, M, v = 4, 8, 2
  planned = plan_lib.plan(_cfg("mesh.data=2", f"mesh.stage={S}", "model.num_layers=8",
                               f"train.num_microbatches={M}", "train.per_token_loss=true",
                               "mesh.pipeline_schedule=1f1b", f"mesh.virtual_stages={v}"))
  want = []
  for vs in (1, v):
    for schedule in ("gpipe", "1f1b") + (("zb_h1",) if vs == 1 else ()):
      table = pl.pipeline_schedule_table(schedule, S, M, vs)
      want.append({"schedule": schedule, "virtual_stages": vs,
                   "bubble": pl.pipeline_bubble_fraction(table),
                   "inputs_alive": pl.live_slots(table),
                   "config": schedule == "1f1b" and vs == v})
  assert planned.schedules == want
  # M, min(M, 2S-1) (paired ticks: a hop a tick), min(S, M), vM, (v+1)S-1
  assert [r["inputs_alive"] for r in planned.schedules] == [8, 7, 4, 16, 11]
  # ZB-H1's bubble (S-1)/(3M+S-1) is 1F1B's (S-1)/(M+S-1) with the weight gradients
  # filling it.
  assert planned.schedules[2]["bubble"] == pytest.approx((S - 1) / (3 * M + S - 1))
  assert planned.bubble == pytest.approx((S - 1) / (v * M + S - 1))
  assert planned.to_dict()["schedules"] == want
  # What a device keeps for the backward: 1F1B's item slots x a chunk's layers'
  # residuals (a slot holds one chunk's pass, of 8 / S / v layers).
  r = planned.residuals
  slots = pl.item_slots(pl.chunk_table("1f1b", S, M, v), v, M)[1]
  assert (r["items"], r["layers"]) == (slots, 8 // S // v)
  assert r["total"] == r["items"] * r["layers"] * r["layer"] > 0
  assert any(line.strip().startswith("residuals") and f"{r['items']} slots x"
             in line for line in planned.text().splitlines()), planned.text()
  shown = [line.split() for line in planned.text().splitlines()]
  for row in want:
    name = [row["schedule"]] + ([f"v{v}"] if row["virtual_stages"] > 1 else [])
    mark = ["<-", "config"] if row["config"] else []
    assert name + [f"{row['bubble']:.1%}", str(row["inputs_alive"])] + mark in shown, (
        row, planned.text())


def test_a_layout_that_cannot_work_gets_the_training_error():
  cfg = _cfg("mesh.data=16")
  with pytest.raises(ValueError, match="mesh: data 16 needs 16 devices, but 8 are"):
    plan_lib.plan(cfg)
  with pytest.raises(ValueError, match="--device-memory: expected a size"):
    plan_lib.plan(_cfg(), device_memory="lots")
  assert plan_lib.parse_bytes("80GB") == 80 * 10**9
  assert plan_lib.parse_bytes("40 GiB") == 40 * 2**30


def _peak_rss_reset() -> bool:
  """Resets this process's peak resident set size (Linux: ``/proc/self/clear_refs``)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _peak_rss(field: str = "VmHWM") -> int:
  """This process's peak (or, with ``"VmRSS"``, current) resident set size."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise AssertionError(f"no {field}")


@pytest.mark.slow
def test_planning_allocates_nothing():
  """Plans 1.2B parameters replicated on 8 devices, with their optimizer state more
  than this machine's memory, while the process's peak memory (VmHWM, reset before)
  stays far below one replica above what it held before (a test worker keeps what
  earlier tests compiled)."""
  import os
  if not _peak_rss_reset():
    pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")
  cfg = _cfg("mesh.data=8", "model.d_model=2048", "model.d_ff=8192",
             "model.num_layers=24", "model.num_heads=16")
  before = _peak_rss("VmRSS")
  planned = plan_lib.plan(cfg)
  peak = _peak_rss() - before
  replica = planned.bytes["params"] + planned.bytes["optimizer_state"]
  assert planned.params > 1_200_000_000
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert 8 * replica > memory, (replica, memory)
  assert peak < replica / 2, (peak, replica)
  assert np.isfinite(planned.flops_per_device)


def test_the_command_prints_the_plan_as_text_or_json(capsys, monkeypatch):
  import json
  import os
  from mpscale.trainer import cli
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
  config = os.path.join(root, "configs", "tiny_lm_fp16.yaml")
  sets = [a for s in SMALL + ["mesh.data=8"] for a in ("--set", s)]
  loads, load = [], cli.config_lib.load_config
  monkeypatch.setattr(cli.config_lib, "load_config",
                      lambda *a, **k: loads.append(a) or load(*a, **k))
  assert cli.main(["plan", "--config", config, *sets, "--json",
                   "--device-memory", "80GB"]) == 0
  assert len(loads) == 1  # read once: for the mesh's devices, then planned
  monkeypatch.setattr(cli.config_lib, "load_config", load)
  out = json.loads(capsys.readouterr().out)
  assert out["devices"] == 8 and out["fits"] is True and out["device_memory"] == 8e10
  assert set(out["bytes"]) >= {"params", "optimizer_state", "gradients", "temporaries",
                               "peak"}
  assert cli.main(["plan", "--config", config, *sets]) == 0
  text = capsys.readouterr().out
  assert "per device:" in text and "all-reduce" in text
  assert cli.main(["plan", "--config", config, *sets, "--set", "mesh.data=16"]) == 2
  assert "mesh: data 16 needs 16 devices" in capsys.readouterr().err
  # an unknown hardware profile: the command's one-line error and status 2
  assert cli.main(["plan", "--config", config, *sets, "--hardware", "b200"]) == 2
  assert capsys.readouterr().err.startswith(
      "mpscale: error: --hardware: unknown hardware profile 'b200'")


_MEASURE = r'''
import gc, json, os, sys
import jax
import numpy as np
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib

def status(field):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024

cfg = config_lib.load_config(sys.argv[1], sys.argv[2:])
setup = builders.build(cfg)
state = setup.init(setup.init_params())
bs, seq = cfg.data.batch_size, cfg.model.seq_len
sharding = builders.batch_sharding(setup.mesh)
rng = np.random.default_rng(0)
batch = {k: jax.device_put(v, sharding) for k, v in {
    "inputs": rng.integers(0, 256, (bs, seq)).astype(np.int32),
    "targets": rng.integers(0, 256, (bs, seq)).astype(np.int32),
    "mask": np.ones((bs, seq), np.float32)}.items()}
compiled = setup.step.lower(state, batch).compile()
device = setup.mesh.devices.flat[0]
live = sum(s.data.nbytes for x in jax.tree_util.tree_leaves((state, batch))
           for s in x.addressable_shards if s.device == device)
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")
state, metrics = compiled(state, batch)
jax.block_until_ready((state, metrics))
peak = status("VmHWM")
print(json.dumps({"live": live, "transient": peak - before,
                  "devices": int(setup.mesh.devices.size)}))
'''


@pytest.mark.slow
def test_planned_peak_is_within_15_percent_of_a_real_step(tmp_path):
  """The peak one device needs, planned from shapes, against a real step on 8 CPU
  devices in a fresh process: the bytes of its live state and batch (its arrays'
  shards on device 0) plus an eighth of what the step adds to the process's memory
  at its highest (the peak resident set size, VmHWM, reset just before the step,
  minus the resident size before it). Large buffers are made to come straight from
  the OS (``MALLOC_MMAP_THRESHOLD_``) so that a freed one is not reused unseen."""
  import json
  import os
  import subprocess
  import sys
  if not _peak_rss_reset():
    pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
  config = os.path.join(root, "configs", "tiny_lm_fp32_adamw.yaml")
  sets = ["mesh.data=8", "model.d_model=256", "model.d_ff=1024", "model.num_layers=4",
          "model.seq_len=128", "data.batch_size=64", "train.steps=10",
          "schedule.warmup_steps=1"]
  script = tmp_path / "measure.py"
  script.write_text(_MEASURE)
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  result = subprocess.run([sys.executable, str(script), config, *sets], env=env,
                          capture_output=True, text=True, timeout=300, cwd=root)
  assert result.returncode == 0, result.stderr[-3000:]
  measured = json.loads(result.stdout.strip().splitlines()[-1])
  planned = plan_lib.plan(config_lib.load_config(config, sets))
  real_peak = measured["live"] + measured["transient"] / measured["devices"]
  # (XLA's argument bytes add a few bytes of scalar padding to the arrays' shards.)
  assert measured["live"] == pytest.approx(planned.bytes["arguments"], abs=256)
  print(f"planned peak {planned.bytes['peak']} B, measured {real_peak:.0f} B "
        f"(live {measured['live']}, step adds {measured['transient']} on "
        f"{measured['devices']} devices)")
  assert planned.bytes["peak"] == pytest.approx(real_peak, rel=0.15), (
      planned.bytes, measured)


def test_the_docs_table_is_what_plan_says():
  """docs/plans.md's exact columns (parameter and optimizer-state bytes per device)
  for GPT-2 124M on 8 devices under FSDP, planned afresh from the same overrides
  docs/plan_table.py uses: a stale table fails here."""
  import os
  from tests.helpers import ROOT as root, load_script
  table = load_script("docs", "plan_table.py")
  with open(os.path.join(root, "docs", "plans.md")) as f:
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in f
            if line.startswith("| gpt2_124m | 8 | FSDP |")]
  assert len(rows) == 1, rows
  _, _, _, params, optimizer, _, fits, *_ = rows[0]
  sets = table.layouts(8, 12, 512)["FSDP"]
  cfg = config_lib.load_config(os.path.join(root, "configs", "gpt2_124m.yaml"), sets)
  planned = plan_lib.plan(cfg, device_memory=table.MEMORY)
  assert params == f"{planned.bytes['params'] / 1e9:.2f} GB"
  assert optimizer == f"{planned.bytes['optimizer_state'] / 1e9:.2f} GB"
  assert fits == ("yes" if planned.fits else "no")


def _plan_of(**fields):
  """A `Plan` with made-up numbers, for its text."""
  made = dict(name="p", devices=1, mesh={}, params=1000, tokens_per_step=64,
              bytes={k: 1024 for k in ("params", "optimizer_state", "gradients",
                                       "batch", "temporaries", "peak")},
              flops_per_device=1e6, xla_flops_per_device=1e6, model_flops=None,
              collectives={}, bubble=0.0, compile_seconds=0.1)
  return plan_lib.Plan(**{**made, **fields})


def test_the_plans_text_counts_devices_and_residual_slots_in_words():
  """Issue #64: a one-device plan said "1 devices ()", and a plan of 4 micro-batches
  through 2 stages of 2 virtual stages on GPipe said its residuals were of "9
  micro-batches": they are GPipe's 9 slots (v M + S - 1 ticks of its scan, a
  micro-batch through a chunk of layers each)."""
  first = _plan_of().text().splitlines()[0]
  assert ", 1 device; compiled in" in first, first
  assert "8 devices (data 2 x stage 4); compiled" in _plan_of(
      devices=8, mesh={"data": 2, "stage": 4}).text()
  piped = _plan_of(devices=2, mesh={"data": 1, "stage": 2}, bubble=1 / 9,
                   schedules=plan_lib.schedule_rows(2, 4, 2, "gpipe"),
                   residuals={"layer": 2 ** 20, "items": 9, "layers": 1,
                              "total": 9 * 2 ** 20})
  line = next(ln for ln in piped.text().splitlines() if "residuals" in ln)
  assert "(9 slots x 1 layer x 1.00 MiB; a slot: a micro-batch through a chunk" in line
  assert "micro-batches" not in line and "GPipe's scan" in line


def test_a_state_above_the_device_memory_fits_with_its_optimizer_state_offloaded():
  """#63's target: a config whose state (parameters, gradients, AdamW's moments)
  needs 1.3x a device's memory does not fit; with ``train.offload: [opt_state]``
  its plan fits, and says how many bytes are in host memory."""
  sets = ["model.d_model=256", "model.d_ff=1024", "model.num_layers=4",
          "model.seq_len=16", "data.batch_size=8", "mesh.data=2"]
  config = "configs/tiny_lm_fp32_adamw.yaml"
  plain = plan_lib.plan(_cfg(*sets, config=config))
  b = plain.bytes
  memory = int((b["params"] + b["gradients"] + b["optimizer_state"]) / 1.3)
  plain = plan_lib.plan(_cfg(*sets, config=config), device_memory=memory)
  offloaded = plan_lib.plan(_cfg(*sets, "train.offload=[opt_state]", config=config),
                            device_memory=memory)
  assert plain.fits is False and offloaded.fits is True
  assert offloaded.bytes["host"] == offloaded.bytes["optimizer_state"] > 0
  assert plain.bytes["peak"] - offloaded.bytes["peak"] == offloaded.bytes["host"]
  assert "in host memory" in offloaded.text()
