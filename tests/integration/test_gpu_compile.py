"""The train steps compiled for 8 H100s without a GPU: the program the GPUs would run.

With JAX's CUDA plugin installed, XLA's CUDA compiler builds each layout's real train
step (`LAYOUTS`: data, FSDP, tensor, every pipeline schedule, the Llama block under
FSDP, float16 with the dynamic loss scale) for the compile-only topology of 8 H100s
(`mpscale.trainer.planning.targets`), and the tests read the program:

- 16-bit collectives stay 16-bit (`widened_collectives`): XLA's CPU compiler sums
  and gathers bfloat16 in float32; a GPU must not;
- the temporaries stay under `temporaries_bound`, computed from the model's sizes;
- under FSDP, no all-gather holds more than one layer's weights
  (`gather_bound`: the whole model is never gathered at once) and no array holds the
  global batch (`full_batch_arrays`).

A lowering error that only XLA's GPU compiler raises fails here, on a machine that
has never run a GPU. Without the plugin these tests skip, saying why; the checks'
own tests (on programs compiled for the CPU, and hand-written HLO) run everywhere.

``pytest -m gpu_compile`` runs the compiled ones; CI's GPU-compile tier (``.ci/run``)
installs the least that compiles them: ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``
at jaxlib's version and ``nvidia-cudnn-cu12`` (cuDNN's fused attention), without the
other NVIDIA libraries ``jax[cuda12]`` brings.
"""

import functools
import os
import re
import textwrap
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import mpscale
from mpscale.trainer.planning import hlo as hlo_lib
from mpscale.trainer.config import build as builders
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import hardware, targets
from tests.trainer.planning.test_targets import _collective_dtypes

# pylint: disable=protected-access  (hlo's readers of instructions: _as_module, _kind,
# _operands, _callees, _promoted, _fused, _FREE)

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
NUM_DEVICES = 8
HARDWARE = "h100-80g"

_SPLIT = ("data.batch_size=40", "model.seq_len=60", "model.num_layers=4")
"""40 rows of 60 tokens, 5 rows a device over 8: sizes no weight has, and no split of
a device's 300 tokens (a split-K GEMM's ``[k, 300 / k, 64]``) has, so
`full_batch_arrays` cannot mistake another array for the batch."""
_PIPELINE = ("data.batch_size=16", "train.num_microbatches=2", "mesh.data=4")
LAYOUTS = {
    "data": ("tiny_lm_bf16.yaml", _SPLIT + ("mesh.data=8",)),
    "fsdp": ("tiny_lm_bf16.yaml", _SPLIT + ("mesh.fsdp=8",)),
    "tensor": ("tiny_lm_bf16.yaml", _SPLIT + ("mesh.data=2", "mesh.tensor=4",
                                              "mesh.sequence_parallel=true")),
    "gpipe": ("tiny_lm_dp_pp.yaml", _PIPELINE + ("mesh.pipeline_schedule=gpipe",)),
    "1f1b": ("tiny_lm_dp_pp.yaml", _PIPELINE + ("mesh.pipeline_schedule=1f1b",)),
    "1f1b_interleaved": ("tiny_lm_dp_pp.yaml", _PIPELINE + (
        "mesh.pipeline_schedule=1f1b", "mesh.virtual_stages=2")),
    "zb_h1": ("tiny_lm_dp_pp.yaml", _PIPELINE + ("mesh.pipeline_schedule=zb_h1",)),
    "fp16_dynamic_fsdp": ("tiny_lm_fp16.yaml", _SPLIT + ("mesh.fsdp=8",)),
    # the Llama block: RoPE, grouped K/V heads (2 for 4 query heads), SwiGLU,
    # RMSNorm, under FSDP. (Under FSDP 4 x tensor 2 its program holds one float32
    # collective-permute of a kernel's gradient, 8 KB a step, where GPT-2's block
    # has none: not yet found.)
    "llama_fsdp": ("tiny_lm_bf16.yaml", _SPLIT + (
        "model.family=llama", "model.num_kv_heads=2", "mesh.fsdp=8")),
    # context parallelism: the ring of cuDNN blocks over context 4, beside data 2
    "llama_context": ("tiny_lm_bf16.yaml", (
        "data.batch_size=8", "model.seq_len=64", "model.num_layers=4",
        "model.family=llama", "model.num_kv_heads=2", "mesh.data=2",
        "mesh.context=4")),
    # a mixture of experts (8 experts of 128 units, 2 a token) over expert 4
    "mixtral_expert": ("tiny_moe.yaml", (
        "data.batch_size=8", "model.seq_len=64", "mesh.data=2", "mesh.expert=4")),
}
"""Each layout compiled for the 8 H100s: a config file of configs/ and its
``--set`` overrides, on 8 devices."""

gpu_compile = pytest.mark.gpu_compile
needs_cuda = pytest.mark.skipif(
    not targets.cuda_installed(),
    reason=f"JAX's CUDA plugin is not installed ({targets.INSTALL}, or the minimal "
    "set in .ci/run's GPU-compile tier)")


# ------------------------------------------------------------------ the checks
_SIXTEEN_BIT = ("bf16", "f16")
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose")
_DTYPE = re.compile(r"\(*([a-z][a-z0-9]*)\[")


def _dtype(type_text: str) -> str:
  m = _DTYPE.match(type_text or "")
  return m.group(1) if m else ""


def _converted_from_16_bit(module: hlo_lib.Module, computation: str, name: str,
                           index: Optional[int] = None) -> bool:
  """Whether the value ``name`` of ``computation`` (its ``index``-th element, for a
  tuple) is a 16-bit value converted to float32: a ``convert`` from bf16 or f16,
  through relayouts and into the fusions that compute it."""
  by_name = {ins.name: ins for ins in module.computations[computation]}
  ins = by_name.get(name)
  while ins is not None and ins.op in _PASS_THROUGH:
    ins = by_name.get(hlo_lib._operands(ins)[0])
  if ins is None:
    return False  # a parameter: made elsewhere
  if ins.op == "convert":
    source = module.types[computation].get(hlo_lib._operands(ins)[0], "")
    return _dtype(source) in _SIXTEEN_BIT and _dtype(ins.result) == "f32"
  if ins.op == "get-tuple-element":
    element = int(re.search(r"index=(\d+)", ins.rest).group(1))
    return _converted_from_16_bit(module, computation, hlo_lib._operands(ins)[0],
                                  element)
  if ins.op == "tuple" and index is not None:
    return _converted_from_16_bit(module, computation,
                                  hlo_lib._operands(ins)[index])
  if ins.op == "fusion":
    callee = next(c for role, c in hlo_lib._callees(ins) if role == "call")
    root = module.computations[callee][-1]  # XLA prints the ROOT last
    return _converted_from_16_bit(module, callee, root.name, index)
  return False


def widened_collectives(hlo: Any) -> list[str]:
  """The collectives of the compiled program ``hlo`` (text, or `mpscale.trainer.planning.hlo.parse`'s
  `mpscale.trainer.planning.hlo.Module`) that move 16-bit data as float32, each as
  ``"<computation>/<name>: <result type>"``: a sum XLA widened (its reducer
  ``*_promoted``, `mpscale.trainer.planning.hlo.sums`), or a float32 operand that is a bf16 or f16
  value converted. A float32 collective of float32 data (a loss, a norm, a weight
  the policy keeps in float32) is not one. Empty on a GPU's program of a 16-bit
  policy; XLA's CPU compiler widens them all."""
  module = hlo_lib._as_module(hlo)
  out = []
  for computation, instructions in module.computations.items():
    for ins in instructions:
      if (hlo_lib._kind(ins) not in hlo_lib.COLLECTIVES
          or ins.op.endswith("-done")):
        continue
      if hlo_lib._promoted(ins) or any(
          _converted_from_16_bit(module, computation, operand)
          for operand in hlo_lib._operands(ins)):
        out.append(f"{computation}/{ins.name}: {ins.result}")
  return out


def full_batch_arrays(hlo: Any, batch_size: int, seq_len: int) -> list[str]:
  """The arrays the compiled program ``hlo`` keeps in memory (the results of kernels
  outside fusions, whose insides are a kernel's registers and tiles) that hold a
  whole global batch of ``batch_size`` rows of ``seq_len`` tokens (a shape with both
  sizes, or with their product as one dimension), each as ``"<name>: <type>"``: an
  activation no device of a data-parallel or FSDP layout should hold (each holds its
  own rows). ``batch_size`` must be a size no weight has, nor a split of a device's
  tokens."""
  module = hlo_lib._as_module(hlo)
  fused = hlo_lib._fused(module)
  out = []
  for computation, instructions in module.computations.items():
    if computation in fused:
      continue
    for ins in instructions:
      if ins.op in hlo_lib._FREE:  # a view (bitcast) or bookkeeping, no buffer
        continue
      for dims in re.findall(r"\b[a-z][a-z0-9]*\[([0-9,]+)\]", ins.result):
        shape = [int(d) for d in dims.split(",")]
        if (batch_size in shape and seq_len in shape) or (
            batch_size * seq_len in shape):
          out.append(f"{ins.name}: {ins.result}")
          break
  return out


def _leaf_bytes(tree: Any, bytes_per_element: int = 4) -> list[int]:
  return [int(np.prod(x.shape)) * bytes_per_element
          for x in jax.tree_util.tree_leaves(tree)]


def gather_bound(params: Any, num_layers: int) -> int:
  """The most bytes one all-gather of an FSDP step may gather: one layer's weights
  (``params["stages"]``, stacked over ``num_layers`` layers) or the largest weight
  outside the layers, whichever is more, at float32's 4 bytes an element (a 16-bit
  policy gathers them at 2). A whole model of ``num_layers >= 4`` is over twice it."""
  layer = sum(_leaf_bytes(params["stages"])) // num_layers
  others = {k: v for k, v in params.items() if k != "stages"}
  return max([layer] + _leaf_bytes(others))


def temporaries_bound(cfg: Any, params: Any) -> int:
  """The most temporary bytes a device's step may take (XLA's
  ``memory_analysis().temp_size_in_bytes``), from the model's sizes::

    r = batch_size / (data x fsdp)       the rows a device computes a step
    l = num_layers / stage               the layers it holds
    t = r                                the rows it keeps activations of; with
                                         stages S > 1, M micro-batches and v
                                         virtual stages, r / M rows each of the
        = r / M x (v M + S - 1) / v      pipeline's ticks, a chunk of l / v layers
    activations = l t T (34 D + 10 H T)  Megatron's 16-bit activations (Korthikanti
                                         et al. 2022, 34 D bytes a token and layer),
                                         attention's scores and probabilities in
                                         float32 and 16 bits (H T each, 10 bytes)
    logits = t T V 10                    16-bit logits, the float32 log-softmax and
                                         its gradient
    weights = 16 P                       4 float32 copies of all P parameters:
                                         gathered weights, gradients, the update
    bound = 2 (activations + logits) + weights

  for sequences of ``T`` tokens, width ``D``, ``H`` heads and ``V`` tokens in the
  vocabulary: every tick's activations kept at once (GPipe's most), nothing divided
  by the tensor split, twice over. A step over it keeps several times what it needs
  (the whole batch on each device, every micro-batch twice, the scores of every
  layer in float32 and a copy).
  """
  m, mesh = cfg.model, cfg.mesh
  rows = cfg.data.batch_size // (mesh.data * mesh.fsdp)
  if mesh.stage > 1:
    microbatches, chunks = cfg.train.num_microbatches, mesh.virtual_stages
    rows = rows * (chunks * microbatches + mesh.stage - 1) // (microbatches * chunks)
  layers = m.num_layers // mesh.stage
  activations = layers * rows * m.seq_len * (34 * m.d_model
                                             + 10 * m.num_heads * m.seq_len)
  logits = rows * m.seq_len * m.vocab_size * 10
  return 2 * (activations + logits) + 4 * sum(_leaf_bytes(params))


# ------------------------------------------------------------------ the programs
class Program(NamedTuple):
  """One layout's train step as compiled for the 8 H100s."""
  cfg: Any
  """The `mpscale.trainer.RunConfig`."""
  params: Any
  """The parameters' shapes, whole (``jax.ShapeDtypeStruct``s)."""
  text: str
  """The compiled HLO (``compiled.as_text()``)."""
  module: hlo_lib.Module
  """``text`` parsed (`mpscale.trainer.planning.hlo.parse`)."""
  memory: Any
  """``compiled.memory_analysis()``."""


def _config(name: str) -> Any:
  path, overrides = LAYOUTS[name]
  return config_lib.load_config(os.path.join(CONFIGS, path), list(overrides))


def compile_step(cfg: Any, devices: Optional[list[Any]]) -> tuple[Any, Any]:
  """``cfg``'s train step compiled for ``devices`` (``None``: JAX's own), from
  shapes, as `mpscale.trainer.planning.compiled.plan` builds it; with the
  parameters' shapes. Without the plan's second try (Triton GEMMs off, where XLA
  finds no tiling without autotuning): any compile error fails the test."""
  setup = builders.build(cfg, devices)
  params = jax.eval_shape(setup.init_params)
  state = setup.init(params)
  sharding = builders.batch_sharding(setup.mesh)
  shape = (cfg.data.batch_size, cfg.model.seq_len)
  batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
           for k, dtype in (("inputs", "int32"), ("targets", "int32"),
                            ("mask", "float32"))}
  return setup.step.lower(state, batch).compile(), params


@functools.lru_cache(maxsize=None)
def _program(name: str) -> Program:
  cfg = _config(name)
  target = targets.choose(hardware.load_hardware(HARDWARE), NUM_DEVICES, "target")
  assert target.compiler == "cuda", target
  compiled, params = compile_step(cfg, target.devices)
  text = compiled.as_text()
  return Program(cfg, params, text, hlo_lib.parse(text), compiled.memory_analysis())


def _programs(*names: str) -> dict[str, Program]:
  """The `Program` of each layout named (default: every one of `LAYOUTS`), compiled
  once a session and shared by the tests."""
  return {name: _program(name) for name in names or LAYOUTS}


# ------------------------------------------------------------------ the GPU's programs
@gpu_compile
@needs_cuda
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_gpus_program_keeps_16_bit_collectives_and_bounded_temporaries(name):
  program = _programs(name)[name]
  compute = jnp.dtype(mpscale.make_policy(program.cfg.precision.policy).compute_dtype)
  sixteen_bit = {"bfloat16": "bf16", "float16": "f16"}[compute.name]
  assert _collective_dtypes(program.text)[sixteen_bit], "no 16-bit collective"
  assert not widened_collectives(program.module)
  temporaries = program.memory.temp_size_in_bytes
  bound = temporaries_bound(program.cfg, program.params)
  assert temporaries <= bound, (
      f"{name}: {temporaries} temporary bytes a device, over the bound {bound}")


@gpu_compile
@needs_cuda
def test_offloaded_state_leaves_the_gpus_program_for_host_memory():
  """``train.offload: [opt_state, params]`` under FSDP 8: the H100 program writes the
  new optimizer state and master parameters to host memory (``S(5)``), every byte a
  device holds of them, where the device-resident program writes none there."""
  cfg = config_lib.load_config(os.path.join(CONFIGS, "tiny_lm_bf16.yaml"), list(
      _SPLIT + ("mesh.fsdp=8", "train.offload=[opt_state,params]")))
  target = targets.choose(hardware.load_hardware(HARDWARE), NUM_DEVICES, "target")
  compiled, _ = compile_step(cfg, target.devices)
  setup = builders.build(cfg, target.devices)
  state = setup.init(jax.eval_shape(setup.init_params))
  held = (mpscale.parallel.tree_bytes(state.params)
          + mpscale.parallel.tree_bytes(state.opt_state))
  assert compiled.memory_analysis().host_output_size_in_bytes >= held > 0
  assert "S(5)" in compiled.as_text()
  assert _program("fsdp").memory.host_output_size_in_bytes == 0


@gpu_compile
@needs_cuda
@pytest.mark.parametrize("name", ["fsdp", "fp16_dynamic_fsdp", "data"])
def test_under_fsdp_and_data_no_device_holds_the_whole_batch_or_model(name):
  program = _programs(name)[name]
  cfg = program.cfg
  assert not full_batch_arrays(program.module, cfg.data.batch_size, cfg.model.seq_len)
  if cfg.mesh.fsdp > 1:
    gathered = hlo_lib.largest_collective(program.module, "all-gather")
    bound = gather_bound(program.params, cfg.model.num_layers)
    assert 0 < gathered <= bound, (
        f"{name}: an all-gather of {gathered} bytes, over one layer's {bound}")



@gpu_compile
@needs_cuda
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_gpus_program_attends_with_cudnns_fused_attention(name):
  """Every layout (pipelines' partly manual shard_map included) runs the LM's
  attention as cuDNN's fused kernels, forward and backward (``model.attention:
  auto`` on H100s)."""
  program = _programs(name)[name]
  assert '"__cudnn$fmhaSoftmax"' in program.text, name
  assert '"__cudnn$fmhaSoftmaxBackward"' in program.text, name


@gpu_compile
@needs_cuda
def test_the_context_ring_attends_in_cudnn_blocks_with_asynchronous_transfers():
  """Context 4: each layer's forward attends 3 cuDNN blocks on the diagonal step
  and 2 on each of the 3 others (9), its backward as many (the 4 layers unrolled,
  none recomputed); the K/V blocks pass as asynchronous collective-permutes (start,
  done) over the context axis, some with kernels scheduled between the two."""
  program = _programs("llama_context")["llama_context"]
  blocks = 9 * program.cfg.model.num_layers
  assert program.text.count('"__cudnn$fmhaSoftmax"') == blocks
  assert program.text.count('"__cudnn$fmhaSoftmaxBackward"') == blocks
  overlaps = [o for o in hlo_lib.overlaps(program.module, {"data": 2, "context": 4})
              if o.collective == "collective-permute over context"]
  assert overlaps, "no asynchronous transfer over the context axis"
  assert any(o.window.dots or o.window.bytes for o in overlaps)


@gpu_compile
@needs_cuda
def test_experts_move_tokens_by_ragged_all_to_all_and_never_gather_an_expert():
  """Expert 4: each block's tokens go to their experts' devices and back by one
  ragged all-to-all each way, forward and backward (XLA's GPU compiler has them; the
  CPU's padded all-to-all is absent); no all-gather moves an expert's weights (no
  all-gather result has the experts' 128 hidden units, which no other weight has);
  the grouped products run in tiles, no product multiplies every row of the
  receiving buffer."""
  program = _programs("mixtral_expert")["mixtral_expert"]
  cfg = program.cfg
  starts = re.findall(r" ragged-all-to-all-start\(", program.text)
  assert len(starts) == 4 * cfg.model.num_layers, len(starts)
  assert not re.findall(r" all-to-all-start\(| all-to-all\(", program.text)
  gathered = [ins.result for computation in program.module.computations.values()
              for ins in computation if hlo_lib._kind(ins) == "all-gather"]
  assert not [r for r in gathered if re.search(r"\[[^\]]*\b128\b", r)], gathered
  # the receiving buffer: expert x a device's (token, slot) rows
  buffer = (cfg.data.batch_size // (cfg.mesh.data * cfg.mesh.expert) * cfg.model.seq_len
            * cfg.model.experts_per_token * cfg.mesh.expert)
  products = [line for line in program.text.splitlines()
              if " dot(" in line or "gemm_fusion" in line.split("=", 1)[0]]
  assert not [p for p in products if re.search(rf"= \w+\[{buffer},128\]", p)]
  assert [p for p in products if re.search(r"= \w+\[16,128\]", p)]  # a tile's


_CNN = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn


    class CNN(nn.Module):
      @nn.compact
      def __call__(self, x):
        def conv(features, size, stride=1, pad=1):
          return nn.Conv(features, (size, size), (stride, stride),
                         padding=((pad, pad), (pad, pad)), use_bias=False)
        x = nn.relu(nn.BatchNorm(use_running_average=False)(conv(8, 3)(x)))
        y = conv(16, 3)(nn.relu(conv(16, 3, 2)(x)))
        x = nn.relu(y + conv(16, 1, 2, 0)(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


    def model(config):
      return CNN()


    def loss(model, batch):
      logp = jax.nn.log_softmax(model(batch["image"]))
      picked = jnp.take_along_axis(logp, batch["label"][:, None], axis=-1)[:, 0]
      return -picked.sum(), jnp.float32(picked.shape[0])


    def source(config):
      rng = np.random.default_rng(0)
      return [{"image": rng.normal(size=(8, 8, 3)).astype(np.float32),
               "label": np.int32(i % 10)} for i in range(32)]
''')
"""A user's small ResNet-style CNN (linen, BatchNorm, a strided block with a 1x1
projection) on 8x8 images: its padding is even on both sides, which cuDNN takes as
it is (a SAME stride-2 convolution of an even size pads one side only, and XLA's GPU
compiler pads its input with zeros for cuDNN, which then multiplies them too)."""


@gpu_compile
@needs_cuda
def test_a_cnn_planned_for_a100s_counts_its_cudnn_convolutions(tmp_path):
  """#64: the A100 plan of a CNN counted its cuDNN convolutions (forward, fused and
  both gradients) as 0 FLOPs, and gave NaN for XLA's count. Its FLOPs are now the
  CPU program's, and by hand 2 * rows * output features * input features * taps
  on the image for each convolution (the stem's 3x3 on 8x8: 22 taps a row; the
  strided 3x3: 11 on 8; the 3x3 on 4x4: 10; the strided 1x1: 4), forward, and
  backward for the kernel (and the input, past the stem), with the head's product;
  XLA's count is absent with the reason (the CUDA compiler has none without a GPU),
  and present on the CPU."""
  from mpscale.trainer.planning import compiled as plan_lib  # pylint: disable=import-outside-toplevel
  (tmp_path / "providers.py").write_text(_CNN)
  raw = {"name": "cnn", "model": {"provider": "providers.py:model",
                                  "loss": "providers.py:loss"},
         "data": {"provider": "providers.py:source", "batch_size": 16},
         "optimizer": {"name": "adamw"}}
  cfg = config_lib.config_from_dict(raw, base_dir=str(tmp_path))
  gpu = plan_lib.plan(cfg, hardware="a100-80g", compiler="target")
  cpu = plan_lib.plan(cfg, hardware="a100-80g", compiler="cpu")
  stem, strided, second, projection, head = (
      2 * 16 * 8 * 3 * 22 ** 2, 2 * 16 * 16 * 8 * 11 ** 2, 2 * 16 * 16 * 16 * 10 ** 2,
      2 * 16 * 16 * 8 * 4 ** 2, 2 * 16 * 16 * 10)
  want = 2 * stem + 3 * (strided + second + projection + head)
  assert gpu.flops_per_device == cpu.flops_per_device == want
  assert gpu.xla_flops_per_device is None and "GPU" in gpu.xla_flops_note
  assert cpu.xla_flops_per_device > cpu.flops_per_device and not cpu.xla_flops_note

# ------------------------------------------------------------------ the checks fail
def _cpu_mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("d",))


def _cpu_text(fn, *args: jax.ShapeDtypeStruct, **jit_kwargs: Any) -> str:
  return jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()


def test_16_bit_collectives_widened_by_the_cpu_compiler_are_found():
  mesh = _cpu_mesh()
  rows = NamedSharding(mesh, P("d"))
  x = jax.ShapeDtypeStruct((NUM_DEVICES * 4, 16), jnp.bfloat16, sharding=rows)
  summed = jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"),
                         out_specs=P())
  assert len(widened_collectives(_cpu_text(summed, x))) == 1
  master = jax.ShapeDtypeStruct((NUM_DEVICES * 4, 16), jnp.float32, sharding=rows)
  cast = lambda w: w.astype(jnp.bfloat16)
  assert widened_collectives(_cpu_text(cast, master,
                                       out_shardings=NamedSharding(mesh, P())))
  # float32 data summed in float32 is not widened
  assert not widened_collectives(_cpu_text(summed, master))


def test_16_bit_collectives_as_the_gpu_compiles_them_pass():
  text = """HloModule m
%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}
%fused (p: f32[8,16]) -> (bf16[8,16], f32[8,16]) {
  %p = f32[8,16]{1,0} parameter(0)
  %c = bf16[8,16]{1,0} convert(%p)
  %m = f32[8,16]{1,0} multiply(%p, %p)
  ROOT %t = (bf16[8,16]{1,0}, f32[8,16]{1,0}) tuple(%c, %m)
}
%widen (q: bf16[8,16]) -> f32[8,16] {
  %q = bf16[8,16]{1,0} parameter(0)
  ROOT %w = f32[8,16]{1,0} convert(%q)
}
ENTRY %main (x: f32[8,16], y: bf16[8,16]) -> f32[64,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %y = bf16[8,16]{1,0} parameter(1)
  %f = (bf16[8,16]{1,0}, f32[8,16]{1,0}) fusion(%x), kind=kLoop, calls=%fused
  %g0 = bf16[8,16]{1,0} get-tuple-element(%f), index=0
  %g1 = f32[8,16]{1,0} get-tuple-element(%f), index=1
  %ag = (bf16[8,16]{1,0}, bf16[64,16]{1,0}) all-gather-start(%g0), dimensions={0}
  %ar = bf16[8,16]{1,0} all-reduce(%y), to_apply=%add
  %kept = f32[64,16]{1,0} all-gather(%g1), dimensions={0}
  %wide = f32[8,16]{1,0} fusion(%y), kind=kLoop, calls=%widen
  %b = f32[8,16]{1,0} bitcast(%wide)
  ROOT %bad = f32[64,16]{1,0} all-gather(%b), dimensions={0}
}"""
  assert widened_collectives(text) == ["main/bad: f32[64,16]{1,0}"]


def test_a_whole_model_gather_and_a_whole_batch_are_found():
  """The stacked layers gathered before the loop over them (not one layer a trip),
  and a batch each device holds whole: both found on the CPU's programs."""
  mesh = _cpu_mesh()
  num_layers, width, batch, seq = 4, 32, 40, 24
  params = {"stages": jax.ShapeDtypeStruct((num_layers, width, width), jnp.float32,
                                           sharding=NamedSharding(mesh, P(None, "d"))),
            "embed": jax.ShapeDtypeStruct((16, width), jnp.float32,
                                          sharding=NamedSharding(mesh, P("d")))}
  replicated = NamedSharding(mesh, P())

  def forward(p, x, whole):
    stacked = p["stages"]
    if whole:
      stacked = jax.lax.with_sharding_constraint(stacked, replicated)

    def layer(h, w):
      w = jax.lax.with_sharding_constraint(w, replicated)
      return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, stacked)[0].sum()

  def program(whole, batch_sharding):
    x = jax.ShapeDtypeStruct((batch, seq, width), jnp.float32, sharding=batch_sharding)
    return hlo_lib.parse(_cpu_text(functools.partial(forward, whole=whole), params, x))

  split = program(False, NamedSharding(mesh, P("d")))
  bound = gather_bound(params, num_layers)
  assert 0 < hlo_lib.largest_collective(split, "all-gather") <= bound
  assert not full_batch_arrays(split, batch, seq)
  whole = program(True, replicated)
  assert hlo_lib.largest_collective(whole, "all-gather") > bound
  assert full_batch_arrays(whole, batch, seq)


def test_temporaries_over_the_bound_are_found():
  """The FSDP layout's loss and gradient on one device (the whole batch there, 8
  devices' rows) are over the bound of the 8-device step."""
  cfg = _config("fsdp")
  path, _ = LAYOUTS["fsdp"]
  one_device = config_lib.load_config(os.path.join(CONFIGS, path), list(_SPLIT))
  setup = builders.build(one_device, jax.devices()[:1])
  params = jax.eval_shape(setup.init_params)
  shape = (cfg.data.batch_size, cfg.model.seq_len)
  batch = {k: jax.ShapeDtypeStruct(shape, dtype) for k, dtype in (
      ("inputs", "int32"), ("targets", "int32"), ("mask", "float32"))}
  loss = builders.build_loss(one_device, setup.model)
  grad = jax.grad(lambda p, b: loss(setup.policy.cast_to_compute(p), b))
  compiled = jax.jit(grad).lower(params, batch).compile()
  assert compiled.memory_analysis().temp_size_in_bytes > temporaries_bound(cfg, params)
  assert full_batch_arrays(compiled.as_text(), cfg.data.batch_size, cfg.model.seq_len)
