"""The compiler a plan reads (mpscale.trainer.planning.targets): the hardware's own
(XLA's CUDA compiler for a GPU profile, no GPU needed) when installed, else the CPU's,
saying so; and the GPU program it gives, where JAX's CUDA plugin is installed."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpscale.trainer.planning import hlo as hlo_lib
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.config.schema import ConfigError
from mpscale.trainer.planning import compiled, hardware, targets
from tests.trainer.planning.test_hardware import USER_FILE, _write

_CUDA = targets.cuda_installed()
needs_cuda = pytest.mark.skipif(not _CUDA, reason="JAX's CUDA plugin is not installed "
                                f"({targets.INSTALL})")


@pytest.mark.parametrize("devices, per_node, text", [
    (1, 8, "1x1x1"), (8, 8, "1x1x8"), (4, 8, "1x1x4"), (16, 8, "2x1x8"),
    (512, 8, "64x1x8"), (8, 4, "2x1x4")])
def test_the_topology_is_whole_nodes(devices, per_node, text):
  assert targets.topology(devices, per_node) == text


def test_a_topology_that_does_not_fill_its_nodes_names_the_mesh():
  with pytest.raises(ValueError, match=r"^mesh: 12 devices span 2 nodes of 8"):
    targets.topology(12, 8)


def test_each_builtin_profile_names_its_compile_target():
  got = {n: hardware.load_hardware(n).compile_target for n in hardware.builtin_names()}
  assert got == {"a100-80g": "cuda/a100_sxm_80", "h100-80g": "cuda/h100_sxm",
                 "tpu-v4": "tpu/v4"}
  for name in ("a100_sxm_80", "h100_sxm"):
    assert 'platform_name: "CUDA"' in targets.spec_text(name)


@pytest.mark.parametrize("value, message", [
    ("cuda/h200_sxm", r"no GPU target spec 'h200_sxm'; known: cuda/a100_sxm_80, "
                      "cuda/h100_sxm"),
    ("rocm/mi300", r"must be 'cuda/<spec>' or 'tpu/<chip>'; got 'rocm/mi300'")])
def test_an_unknown_compile_target_names_the_key(tmp_path, value, message):
  path = _write(tmp_path, "compile_target: " + value + "\n" + USER_FILE)
  with pytest.raises(ConfigError, match=message) as info:
    hardware.load_hardware(path)
  assert info.value.keys == ("compile_target",)
  # the key once, after the file: the reason is not read back from another message
  assert str(info.value).count("compile_target:") == 1, str(info.value)
  assert "compile_target must" not in str(info.value)


def test_without_the_cuda_compiler_auto_falls_back_and_target_gives_the_install_line(
    monkeypatch):
  monkeypatch.setattr(targets, "cuda_installed", lambda: False)
  h100 = hardware.load_hardware("h100-80g")
  chosen = targets.choose(h100, 8)
  assert chosen.compiler == "cpu" and chosen.devices is None
  assert "not installed" in chosen.note and targets.INSTALL in chosen.note
  with pytest.raises(ValueError, match=r"^compiler: h100-80g's compiler .* not "
                     r"installed; install it with: pip install \"mpscale\[plan-gpu\]\""):
    targets.choose(h100, 8, "target")
  assert targets.choose(h100, 8, "cpu").note == ""
  assert targets.choose(None, 8).compiler == "cpu"
  with pytest.raises(ValueError, match="compiler: target needs --hardware"):
    targets.choose(None, 8, "target")
  with pytest.raises(ValueError, match="compiler must be one of auto, target, cpu"):
    targets.choose(h100, 8, "gpu")


def test_without_libtpu_a_tpu_profile_falls_back_and_target_gives_the_install_line(
    monkeypatch):
  monkeypatch.setattr(targets, "tpu_installed", lambda: False)
  v4 = hardware.load_hardware("tpu-v4")
  chosen = targets.choose(v4, 8)
  assert chosen.compiler == "cpu" and targets.INSTALL_TPU in chosen.note
  with pytest.raises(ValueError, match=r"^compiler: tpu-v4's compiler \(libtpu\) is "
                     r"not installed; install it with: pip install \"mpscale\[plan-tpu\]"):
    targets.choose(v4, 8, "target")


@pytest.mark.parametrize("chips, chip, shape", [
    (4, "v4", "v4:2x2x1"), (8, "v4", "v4:2x2x2"), (32, "v4", "v4:2x4x4"),
    (64, "v4", "v4:4x4x4"), (1024, "v5p", "v5p:8x8x16"), (4, "v5e", "v5e:2x2"),
    (32, "v5e", "v5e:4x8"), (256, "v6e", "v6e:16x16")])
def test_a_tpu_slice_doubles_its_smallest_dimension(chips, chip, shape):
  assert targets.tpu_topology(chips, chip) == shape


def test_chips_no_slice_holds_and_unknown_chips_are_errors_naming_the_key():
  for chips in (2, 12, 24):
    with pytest.raises(ValueError, match=rf"^mesh: {chips} devices are no v4 slice"):
      targets.tpu_topology(chips, "v4")
  with pytest.raises(ValueError, match=r"compile_target: no TPU chip 'v9'; known: "
                     "tpu/v4, tpu/v5p, tpu/v5e, tpu/v6e"):
    targets.parse("tpu/v9")


@pytest.mark.skipif(not targets.tpu_installed(), reason="libtpu is not installed "
                    f"({targets.INSTALL_TPU})")
def test_libtpu_compiles_a_step_for_a_tpu_slice_without_a_tpu():
  """libtpu's program for 8 v4 chips: bf16 gradients all-reduced in bf16, products
  as convolutions counted at their FLOPs, a scan's loop by its condition's bound."""
  chosen = targets.choose(hardware.load_hardware("tpu-v4"), 8, "target")
  assert chosen.compiler == "tpu" and len(chosen.devices) == 8
  assert chosen.devices[0].device_kind == "TPU v4" and "v4:2x2x2" in chosen.description
  mesh = jax.sharding.Mesh(np.array(chosen.devices), ("data",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct((8 * 64, 256), jnp.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((6, 256, 256), jnp.bfloat16, sharding=whole)

  def grad(x, w):
    def loss(w):
      h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
      return jnp.sum(h.astype(jnp.float32) ** 2)
    return jax.grad(loss)(w)

  text = jax.jit(grad).lower(x, w).compile().as_text()
  assert hlo_lib.matmul_flops(text) == 3 * 6 * 2 * 64 * 256 * 256
  reduces = [line for line in text.splitlines()
             if re.search(r"= \S+ all-reduce(-start)?\(", line)]
  assert reduces and all("= bf16[" in line for line in reduces), reduces


def test_a_plan_says_which_compiler_it_read(monkeypatch):
  monkeypatch.setattr(targets, "cuda_installed", lambda: False)
  cfg = config_lib.config_from_dict({
      "model": {"d_model": 32, "num_heads": 2, "num_layers": 1, "d_ff": 64,
                "seq_len": 16}, "data": {"batch_size": 4}, "train": {"steps": 10},
      "schedule": {"warmup_steps": 1}})
  planned = compiled.plan(cfg, hardware="h100-80g")
  assert planned.compiled_for.startswith("fake CPU devices")
  assert targets.INSTALL in planned.compile_note
  assert f"note: {planned.compile_note}" in planned.text()
  with pytest.raises(Exception, match=r"hardware: compiler: .*install it with"):
    compiled.plan(cfg, hardware="h100-80g", compiler="target")


# ------------------------------------------------------------------ the GPU program
def _collective_dtypes(text):
  counts = collections.Counter()
  module = hlo_lib.parse(text)
  for instructions in module.computations.values():
    for ins in instructions:
      kind = hlo_lib._kind(ins)  # pylint: disable=protected-access
      if kind in hlo_lib.COLLECTIVES:
        for dtype in re.findall(r"\b(bf16|f16|f32)\[", ins.result):
          counts[dtype] += 1
  return counts


def _program(cfg, mode):
  target = targets.choose(hardware.load_hardware("h100-80g"), cfg.mesh.num_devices,
                          mode)
  setup = builders.build(cfg, target.devices)
  state = setup.init(jax.eval_shape(setup.init_params))
  shape = (cfg.data.batch_size, cfg.model.seq_len)
  batch = {k: jax.ShapeDtypeStruct(shape, d, sharding=builders.batch_sharding(setup.mesh))
           for k, d in (("inputs", "int32"), ("targets", "int32"), ("mask", "float32"))}
  return target, setup.step.lower(state, batch).compile().as_text()


@needs_cuda
def test_an_h100_plan_reads_the_gpus_program_with_16_bit_collectives_kept():
  """Every layout at once (FSDP x pipeline x tensor, fp16 O2) compiled for 8 H100s
  without one: the CUDA compiler keeps 16-bit collectives that the CPU's widens to
  float32."""
  cfg = config_lib.load_config("configs/tiny_lm_all_axes.yaml")
  gpu_target, gpu = _program(cfg, "target")
  cpu_target, cpu = _program(cfg, "cpu")
  assert gpu_target.compiler == "cuda" and "H100" in gpu_target.description
  assert len(gpu_target.devices) == 8 and cpu_target.compiler == "cpu"
  on_gpu, on_cpu = _collective_dtypes(gpu), _collective_dtypes(cpu)
  share = lambda c: c["f16"] / max(sum(c.values()), 1)
  assert share(on_gpu) > share(on_cpu), (on_gpu, on_cpu)
  planned = compiled.plan(cfg, hardware="h100-80g", compiler="target")
  assert "NVIDIA H100" in planned.compiled_for and planned.compile_note == ""
  assert planned.estimate is not None and planned.flops_per_device > 0
  # The GPU's scheduler makes collectives asynchronous (windows to hide them); the
  # CPU's does not.
  assert planned.overlaps
  assert not compiled.plan(cfg, hardware="h100-80g", compiler="cpu").overlaps


@needs_cuda
def test_a_one_device_h100_plan_compiles_for_the_h100():
  cfg = config_lib.config_from_dict({
      "model": {"d_model": 64, "num_heads": 2, "num_layers": 1, "d_ff": 128,
                "seq_len": 32}, "data": {"batch_size": 8}, "train": {"steps": 10},
      "precision": {"policy": "O2"}, "schedule": {"warmup_steps": 1}})
  on_gpu = compiled.plan(cfg, hardware="h100-80g", compiler="target")
  on_cpu = compiled.plan(cfg, hardware="h100-80g", compiler="cpu")
  assert "1 x NVIDIA H100" in on_gpu.compiled_for
  assert on_gpu.kernels != on_cpu.kernels  # another program


@needs_cuda
@pytest.mark.parametrize("attention, fused", [("auto", True), ("cudnn", True),
                                              ("xla", False)])
def test_an_h100_program_attends_with_cudnn_as_a_run_there_would(attention, fused):
  """``model.attention: auto`` chooses cuDNN's fused attention for a 16-bit model
  compiled for H100s, as a run on them does (forward and backward kernels); ``xla``
  keeps the scores in XLA's program."""
  cfg = config_lib.load_config("configs/tiny_lm_bf16.yaml",
                               ["mesh.fsdp=8", f"model.attention={attention}"])
  _, text = _program(cfg, "target")
  assert ("__cudnn$fmhaSoftmax\"" in text) == fused
  assert ("__cudnn$fmhaSoftmaxBackward" in text) == fused


class _Lowered:
  """A lowered step whose first compile fails as XLA's CUDA compiler may without a
  GPU to autotune on."""

  def __init__(self, error):
    self.error, self.options = error, []

  def compile(self, compiler_options=None):
    self.options.append(compiler_options)
    if len(self.options) == 1 and self.error:
      raise RuntimeError(self.error)
    return "compiled"


def test_a_gpu_compile_without_triton_tiles_is_compiled_again_without_triton():
  gpu = targets.Target(devices=None, compiler="cuda", description="gpu")
  lowered = _Lowered("INTERNAL: Couldn't find output tile sizes that satisfy hlo: ...")
  assert compiled._compile(lowered, gpu) == "compiled"
  assert lowered.options == [None, {"xla_gpu_enable_triton_gemm": False}]
  # any other failure, or on the CPU, is raised as it is
  for target, error in ((gpu, "INTERNAL: something else"),
                        (targets.Target(None, "cpu", "cpu"), compiled._NO_TILES)):
    with pytest.raises(RuntimeError, match=re.escape(error)):
      compiled._compile(_Lowered(error), target)


def test_too_many_devices_for_the_cpus_compiler_is_an_error_naming_devices():
  # JAX's CPU backend refuses past some 2,000 simulated devices with a runtime error
  # deep in XLA; the plan says which argument and how to plan instead
  class Lowered:
    def compile(self, **kw):
      raise RuntimeError("INVALID_ARGUMENT: " + compiled._CPU_MULTIPROCESS + ".")

  cpu = targets.Target(devices=None, compiler="cpu", description="cpu")
  with pytest.raises(ValueError, match=r"--devices.*--compiler target"):
    compiled._compile(Lowered(), cpu)
  other = RuntimeError("something else")

  class Failing:
    def compile(self, **kw):
      raise other

  with pytest.raises(RuntimeError) as info:
    compiled._compile(Failing(), cpu)
  assert info.value is other


def test_fp8_on_a_profile_without_fp8_is_refused_naming_the_key():
  cfg = config_lib.config_from_dict({
      "model": {"d_model": 32, "num_heads": 2, "num_layers": 4, "d_ff": 64,
                "seq_len": 16}, "data": {"batch_size": 4}, "train": {"steps": 10},
      "schedule": {"warmup_steps": 1},
      "precision": {"policy": "bf16", "fp8": {"recipe": "delayed"}}})
  for name in ("a100-80g", "tpu-v4"):
    with pytest.raises(ValueError, match=rf"precision.fp8.recipe \(delayed\): {name} "
                       "lists no float8 peak"):
      compiled.plan(cfg, hardware=name)
