"""The trainer across processes (mpscale.trainer.runs.distributed).

The slow tests start real runs of ``mpscale train`` as 2 local processes x 4 fake CPU
devices each, on JAX's distributed runtime (gloo collectives), and compare them with
the same run in this process on its 8 devices:

- a data-parallel run of a user's NNX model and data source (examples/nnx_transformer)
  and a data x pipeline run of the tiny LM give the same metrics.csv, evaluation
  loss, final params and optimizer state as one process;
- one process killed with SIGKILL mid-run: the other stops within the heartbeat
  timeout with JAX's message, the run folder stays readable, and both relaunched with
  ``--resume`` end bit-identical to the uninterrupted two-process run;
- a process started with another config is refused before any step, naming the key.

"The same" across the process count is up to float rounding: the cross-process
all-reduce (gloo) adds the replicas' gradients in another order than one process
does, so a few values differ in their last bits (the first steps' losses agree to the
bit). A resumed two-process run against an uninterrupted one is exact.
"""

import csv
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpscale.trainer.config import load as config_lib
from mpscale.trainer.data import text as data_lib
from mpscale.trainer.runs import distributed
from mpscale.trainer.data import loader
from tests import helpers, quick_compile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "nnx_transformer", "config.yaml")
TINY_LM = os.path.join(ROOT, "configs", "tiny_lm_dp_pp.yaml")
STEPS, EVERY = 12, 2
COMMON = [f"train.steps={STEPS}", f"train.log_every={EVERY}",
          f"train.checkpoint_every={EVERY}", f"train.eval_every={STEPS // 2}",
          "train.keep_checkpoints=100", "schedule.warmup_steps=2",
          # float32 and AdamW: CAME's first steps amplify rounding differences.
          "precision.policy=O0", "loss_scale.kind=none", "optimizer.name=adamw",
          "data.batch_size=16", "data.eval_batches=2"]
RUNS = {
    # data parallel over the 8 devices of both processes: a user's model and data
    "data": (EXAMPLE, COMMON + [
        "mesh.data=8", "model.args.d_model=32", "model.args.num_layers=1",
        "data.args.train_size=600", "data.args.eval_size=64"]),
    # 2 data replicas (one per process) x 4 pipeline stages: the tiny LM, its corpus
    "data_x_pipeline": (TINY_LM, COMMON + [
        "mesh.data=2", "mesh.stage=4", "model.num_layers=4", "model.d_model=32",
        "model.d_ff=64", "model.seq_len=32", "train.num_microbatches=2"]),
}
# The rates and times of the wall clock (tflops_per_device and mfu are rates too).
TIMING = ("tokens_per_s", "tflops_per_device", "mfu", "wall_s")


# ------------------------------------------------------------------ one process


def _cfg(**data):
  return config_lib.config_from_dict({"data": {"batch_size": 8, **data}}, "<test>")


def test_each_process_reads_its_rows_of_the_text_batches():
  text = data_lib.load_data(None)
  cfg = _cfg(eval_batches=2)
  whole = loader.text_data(text, cfg)
  parts = [loader.text_data(text, cfg, rows) for rows in ((0, 4), (4, 8))]
  for step in (0, 1, 57):
    for key, value in whole.train[step].items():
      np.testing.assert_array_equal(
          np.concatenate([p.train[step][key] for p in parts]), value, err_msg=key)
  for want, *got in zip(whole.eval_batches(), *(p.eval_batches() for p in parts)):
    for key in want:
      np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])
  assert all(p.tokens_per_step == whole.tokens_per_step for p in parts)


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_process_reads_its_rows_of_a_user_source(shuffle):
  cfg = _cfg(shuffle=shuffle)
  examples = {"train": [{"i": np.asarray(i)} for i in range(20)],
              "eval": [{"i": np.asarray(100 + i)} for i in range(20)]}
  whole = loader.user_data(examples, cfg)
  parts = [loader.user_data(examples, cfg, rows=rows)
           for rows in ((0, 2), (2, 4), (4, 6), (6, 8))]
  its = [p.iterator() for p in parts]
  for step, want in zip(range(9), whole.iterator()):  # past two epochs
    np.testing.assert_array_equal(np.concatenate([next(it)["i"] for it in its]),
                                  want["i"], err_msg=f"step {step}")
  # A process's position restores like one process's.
  state = its[1].get_state()
  assert state == {"next_index": 9}
  np.testing.assert_array_equal(next(parts[1].iterator(state))["i"], next(its[1])["i"])
  want_eval = [b["i"] for b in whole.eval_batches()]
  got_eval = [np.concatenate(rows) for rows in
              zip(*([b["i"] for b in p.eval_batches()] for p in parts))]
  assert len(want_eval) == len(got_eval) == 2  # full batches of 8 out of 20
  for want, got in zip(want_eval, got_eval):
    np.testing.assert_array_equal(got, want)


def test_rows_must_be_an_aligned_block_of_the_batch():
  examples = [{"i": np.asarray(i)} for i in range(20)]
  for rows in ((0, 3), (2, 6), (4, 12), (5, 5)):
    with pytest.raises(ValueError, match=r"rows: expected a block"):
      loader.user_data(examples, _cfg(), rows=rows)


def test_one_process_reads_every_row_and_builds_no_global_array():
  import jax
  from jax.sharding import Mesh
  from mpscale.trainer.config import build as builders
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "stage"))
  sharding = builders.batch_sharding(mesh)
  assert sharding.spec == jax.sharding.PartitionSpec(("data",))
  assert distributed.process_rows(sharding, 16) == (0, 16)
  batch = {"x": np.arange(16)}
  assert distributed.global_batch(batch, sharding, 16, (0, 16)) is batch
  distributed.check_same_run(_cfg())  # one process: nothing to compare


def test_fingerprint_holds_config_run_code_and_versions():
  cfg = config_lib.load_config(EXAMPLE)
  print_ = distributed.fingerprint(cfg, resume=False)
  assert print_["model.args.d_model"] == 64 and print_["run.resume"] is False
  assert print_["version.jax"] and print_["code.mpscale"]
  assert print_["code.model.provider"]  # examples/nnx_transformer/model.py's digest
  assert distributed.fingerprint(cfg, resume=False) == print_
  other = distributed.fingerprint(
      config_lib.load_config(EXAMPLE, ["model.args.d_model=48"]), resume=True)
  assert distributed.differences([print_, print_]) == []
  diff = distributed.differences([print_, other, print_])
  assert diff == ["model.args.d_model: 64 on processes 0, 2, 48 on process 1",
                  "run.resume: false on processes 0, 2, true on process 1"]


def test_initialize_only_when_asked_and_checks_its_flags(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.initialize() is False
  with pytest.raises(ValueError, match="--num-processes must be >= 1"):
    distributed.initialize("localhost:1", 0, 0)
  with pytest.raises(ValueError, match=r"--process-id must be in \[0, --num-processes\)"):
    distributed.initialize("localhost:1", 2, 2)
  with pytest.raises(ValueError, match="--heartbeat-timeout must be >= 1"):
    distributed.initialize("localhost:1", 2, 0, heartbeat_timeout=0)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer"):
    distributed.initialize()


# ------------------------------------------------------------------ several processes


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  # Two processes compiling the same program at once would share the persistent
  # compilation cache (conftest.py) mid-write; they compile for themselves.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  # A run of 12 steps is mostly XLA compiling: the processes compile with LLVM's
  # optimizations off and the older fusion emitters, as this process does
  # (conftest.py), several times faster. The programs' partitioning and collectives are
  # XLA's either way; the one-process run they are compared with compiles so too.
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {quick_compile.FLAGS}".strip()
  return env


def _launch(kind, out, logs, *extra, sets=()):
  """Starts the two processes of ``mpscale train`` for run ``kind``."""
  config, settings = RUNS[kind]
  port = helpers.free_port()
  procs = []
  for i in range(2):
    args = [sys.executable, "-m", "mpscale", "train", "--config", config, "--out",
            str(out), "--devices", "4", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id", str(i), *extra]
    for s in list(settings) + list(sets if i == 1 else ()):
      args += ["--set", s]
    with open(logs / f"process{i}.log", "wb") as log:
      procs.append(subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=log,
                                    stderr=subprocess.STDOUT))
  return procs


def _wait(procs, logs, timeout=400):
  deadline = time.time() + timeout
  try:
    for p in procs:
      p.wait(timeout=max(1, deadline - time.time()))
  except subprocess.TimeoutExpired:
    pytest.fail("the processes did not finish:\n" + _tails(logs))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs]


def _tails(logs):
  return "\n".join(f"--- {f.name}\n" + f.read_text(errors="replace")[-2500:]
                   for f in sorted(logs.glob("process*.log")))


def _two_process_run(kind, out, logs, *extra, sets=()):
  logs.mkdir(parents=True, exist_ok=True)
  codes = _wait(_launch(kind, out, logs, *extra, sets=sets), logs)
  return codes


def _rows(out):
  with open(os.path.join(out, "metrics.csv")) as f:
    return list(csv.DictReader(f))


def _state(out, step):
  """The checkpoint's state (a flat dict of numpy arrays) and data position, read
  onto this process's first device whatever mesh wrote it."""
  import jax
  import orbax.checkpoint as ocp
  path = os.path.join(os.path.abspath(out), "checkpoints", str(step))
  checkpointer = ocp.StandardCheckpointer()
  meta = checkpointer.metadata(os.path.join(path, "state"))
  meta = getattr(meta, "item_metadata", meta)  # newer orbax wraps it
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device)
            for k, v in meta.items()}
  state = checkpointer.restore(os.path.join(path, "state"), target)
  with ocp.CheckpointManager(os.path.dirname(path)) as manager:
    position = manager.restore(step, args=ocp.args.Composite(
        data=ocp.args.JsonRestore())).data
  return {k: np.asarray(v) for k, v in state.items()}, position


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``kind -> (one-process run folder, two-process run folder)``, trained once."""
  import mpscale.trainer
  base = tmp_path_factory.mktemp("multihost")
  out = {}
  for kind, (config, settings) in RUNS.items():
    one, two = base / f"{kind}-one", base / f"{kind}-two"
    codes = _two_process_run(kind, two, base / f"{kind}-logs")
    assert codes == [0, 0], _tails(base / f"{kind}-logs")
    mpscale.trainer.run(config, overrides=settings, out_dir=str(one), verbose=False,
                        progress=False)
    out[kind] = (one, two)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RUNS))
def test_two_processes_train_like_one(runs, kind):
  one, two = runs[kind]
  want, got = _rows(one), _rows(two)
  assert [r["step"] for r in got] == [r["step"] for r in want] == [
      str(s) for s in range(EVERY, STEPS + 1, EVERY)]
  for w, g in zip(want, got):
    assert set(w) == set(g)
    for key in w:
      if key in TIMING or w[key] == "":
        assert (g[key] == "") == (w[key] == ""), key
        continue
      np.testing.assert_allclose(float(g[key]), float(w[key]), rtol=2e-6, atol=1e-7,
                                 err_msg=f"step {w['step']} {key}")
  # The evaluation: twice in the log, and the summary's final one.
  assert sum(r["eval_loss"] != "" for r in got) == 2
  s_one, s_two = (json.loads((d / "summary.json").read_text()) for d in (one, two))
  np.testing.assert_allclose(s_two["final_eval_loss"], s_one["final_eval_loss"],
                             rtol=2e-6)
  assert s_two["params"] == s_one["params"] and s_two["steps"] == STEPS
  # Params and optimizer state, to float32 rounding of the reduction order.
  (w_state, w_pos), (g_state, g_pos) = _state(one, STEPS), _state(two, STEPS)
  assert w_pos == g_pos == {"next_index": STEPS}
  assert set(w_state) == set(g_state)
  assert any(k.startswith("opt_state") for k in w_state)
  # Except the attention key bias (the example's NNX attention has one): it shifts
  # every logit of a query alike, which softmax ignores, so its gradient is zero in
  # exact arithmetic and rounding noise in floats, which Adam normalizes into steps
  # of the learning rate's size in random directions.
  noise = [k for k in w_state if "key.bias" in k]
  assert bool(noise) == (kind == "data")
  for key, w in w_state.items():
    if key not in noise:
      atol = 1e-4 * float(np.max(np.abs(w))) + 1e-8
      np.testing.assert_allclose(g_state[key], w, rtol=0, atol=atol, err_msg=key)
  # One writer: process 0 (one TensorBoard event file, one plot, one summary).
  assert len(glob.glob(str(two / "tb" / "events*"))) == 1
  assert sorted(os.listdir(two)) == sorted(os.listdir(one))


@pytest.mark.slow
def test_sigkill_of_one_process_stops_the_other_and_resume_is_bit_identical(
    runs, tmp_path):
  _, whole = runs["data"]
  killed, logs = tmp_path / "killed", tmp_path / "logs"
  logs.mkdir()
  victim = random.Random().choice([0, 1])
  target = random.Random().choice(range(EVERY, STEPS - EVERY + 1, EVERY))
  procs = _launch("data", killed, logs, "--heartbeat-timeout", "10")
  survivor = procs[1 - victim]
  try:
    deadline = time.time() + 400
    while not [s for s in helpers.steps_saved(killed) if s >= target]:
      assert all(p.poll() is None for p in procs), (
          "a process ended before the kill\n" + _tails(logs))
      assert time.time() < deadline, "no checkpoint appeared\n" + _tails(logs)
      time.sleep(0.05)
    time.sleep(random.Random().uniform(0.0, 0.3))
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    try:
      survivor.wait(timeout=120)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process {1 - victim} still runs 120 s after process {victim} was "
                  "killed (heartbeat timeout 10 s)")
    waited = time.time() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  saved = helpers.steps_saved(killed)
  assert saved and saved[-1] < STEPS, "killed too late to test resume"
  # The survivor stopped with an error, within the heartbeat timeout plus slack,
  # and said why (JAX's coordination service).
  log = (logs / f"process{1 - victim}.log").read_text(errors="replace")
  assert survivor.returncode != 0 and waited < 60, (waited, log[-2000:])
  assert "distributed service detected fatal errors" in log, log[-2000:]

  # Nothing in the run folder is corrupt: the config, each row, each checkpoint.
  config_lib.load_config(killed / "config.yaml")
  rows = _rows(killed)
  assert [int(r["step"]) for r in rows] == list(range(EVERY, EVERY * len(rows) + 1,
                                                      EVERY))
  assert all(r["loss"] and np.isfinite(float(r["loss"])) for r in rows)
  for step in saved:
    _state(killed, step)

  codes = _two_process_run("data", killed, tmp_path / "resume-logs", "--resume")
  assert codes == [0, 0], _tails(tmp_path / "resume-logs")
  (want, want_pos), (got, got_pos) = _state(whole, STEPS), _state(killed, STEPS)
  assert got_pos == want_pos == {"next_index": STEPS}
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMING} for r in rs]
  assert strip(_rows(killed)) == strip(_rows(whole))


@pytest.mark.slow
def test_a_process_with_another_config_is_refused_before_any_step(tmp_path):
  out, logs = tmp_path / "run", tmp_path / "logs"
  codes = _two_process_run("data", out, logs, sets=["optimizer.learning_rate=0.01"])
  assert codes == [2, 2], _tails(logs)
  for i in range(2):
    log = (logs / f"process{i}.log").read_text()
    assert "do not run the same config" in log, log[-2000:]
    assert ("optimizer.learning_rate: 0.003 on process 0, 0.01 on process 1"
            in log), log[-2000:]
  assert not out.exists()  # nothing written


def test_distributed_without_a_cluster_says_what_to_pass(tmp_path):
  env = {k: v for k, v in _env().items() if k not in (
      "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
      "KUBERNETES_SERVICE_HOST", "OMPI_MCA_orte_hnp_uri", "SLURM_JOB_ID")}
  result = subprocess.run(
      [sys.executable, "-m", "mpscale", "train", "--config", TINY_LM, "--out",
       str(tmp_path / "run"), "--distributed"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "mpscale: error: --distributed: " in result.stderr
  assert "no cluster was detected" in result.stderr
  assert "--coordinator, --num-processes and --process-id" in result.stderr
  assert not (tmp_path / "run").exists()


def test_the_docs_recipe_for_two_processes_is_what_the_tests_run():
  import re
  import shlex
  from mpscale.trainer import cli
  with open(os.path.join(ROOT, "docs", "trainer.md")) as f:
    page = f.read()
  section = page[page.index("## Several hosts"):]
  block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
  command = re.search(r"(mpscale train .*?)&\n", block.replace("\\\n", " "),
                      flags=re.S).group(1)
  args = shlex.split(command.replace("$i", "1"))[1:]
  parsed = cli._parser().parse_args(args)
  assert (parsed.num_processes, parsed.process_id, parsed.devices) == (2, 1, 4)
  assert parsed.coordinator.startswith("localhost:")
  cfg = config_lib.load_config(os.path.join(ROOT, parsed.config), parsed.set)
  assert cfg.mesh.num_devices == parsed.num_processes * parsed.devices
