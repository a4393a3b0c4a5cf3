"""FP8 products compiled for an H100 without a GPU: the GEMMs take the FP8 values.

With JAX's CUDA plugin installed, XLA's CUDA compiler builds a Flax ``nn.Dense`` whose
product is `mpscale.precision.fp8_flax.Fp8DotGeneral`, forward and backward, for one H100
(the compile-only topology of `mpscale.trainer.planning.targets`), and the tests read
the program's matrix products:

- delayed and current scaling, XLA's Triton GEMMs off (``xla_gpu_enable_triton_gemm
  =False``): three cuBLASLt FP8 GEMMs, ``__cublas$lt$matmul$f8``: the forward's
  operands both ``f8e4m3fn``, each backward one's an ``f8e5m2`` (the output gradient)
  and an ``f8e4m3fn``; no GEMM of 16-bit operands;
- the same with XLA's default (Triton GEMMs on, no autotuning without a GPU): three
  Triton GEMM fusions whose ``dot`` takes the same f8 operands (Hopper's FP8 tensor
  cores either way; on a GPU the autotuner may pick either);
- blockwise scaling: the operands are rounded to ``f8e4m3fn`` / ``f8e5m2`` tile by
  tile and held there (the FP8 values are in the program), and the products are
  bf16 GEMMs: scales that vary along the contraction are no FP8 GEMM of XLA's.

Why the products take the FP8 values directly (not an FP8 round trip before a
``dot``, the pattern of XLA's FP8 GEMM rewrite): a round trip that no FP8 GEMM takes
is elided by XLA's GPU compiler (``xla_allow_excess_precision``, on by default),
which the last test shows. The H100 target spec shipped with the planner lacks the
CUDA runtime version, and XLA then rewrites no FP8 GEMM ("FP8 Custom Calls require
CUDA 12.0 or newer"); `h100` adds the version openxla/xla's own H100 spec gives.

Marked ``gpu_compile`` and skipped without the plugin, as test_gpu_compile.py.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax.sharding import SingleDeviceSharding

import mpscale
from mpscale.trainer.planning import hlo as hlo_lib
from mpscale.precision.fp8_flax import Fp8DotGeneral
from mpscale.trainer.planning import targets
from tests.integration.test_gpu_compile import gpu_compile, needs_cuda

# pylint: disable=protected-access  (hlo's readers of instructions: _operands)

RUNTIME_VERSION = '  runtime_version: "12.8.0"\n'
"""The CUDA runtime of openxla/xla's ``specs/h100_sxm.txtpb`` (its
``gpu_device_info``): without one, XLA's deviceless compile takes the toolkit for
older than 12.0 and makes no FP8 GEMM."""
TRITON_OFF = {"xla_gpu_enable_triton_gemm": False}
ROWS, IN, OUT = 128, 256, 512


@functools.lru_cache(maxsize=None)
def h100():
  """One compile-only H100 (the planner's target spec, with a CUDA runtime)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  spec = targets.spec_text("h100_sxm")
  if "runtime_version" not in spec:
    spec = spec.replace("gpu_device_info {\n", "gpu_device_info {\n" + RUNTIME_VERSION,
                        1)
  return topologies.get_topology_desc("h100_sxm", "cuda", target_config=spec,
                                      topology="1x1x1").devices[0]


def compile_dense_step(recipe_name: str, options: dict) -> str:
  """The compiled HLO of an FP8 ``nn.Dense``'s gradients with respect to its
  variables and its input (bf16 compute, float32 parameters), for one H100."""
  recipe = mpscale.make_fp8_recipe(recipe_name)
  dense = nn.Dense(OUT, dtype=jnp.bfloat16,
                   dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
  sharding = SingleDeviceSharding(h100())
  x = jax.ShapeDtypeStruct((ROWS, IN), jnp.bfloat16, sharding=sharding)
  variables = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
      jax.eval_shape(dense.init, jax.random.key(0), x))
  loss = lambda v, x: jnp.mean(jnp.square(dense.apply(v, x).astype(jnp.float32)))
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).compile(
      compiler_options=options).as_text()


_DTYPE = re.compile(r"\(*([a-z][a-z0-9]*)\[")


def gemm_operands(text: str) -> list[tuple[str, str, str]]:
  """``(kind, lhs dtype, rhs dtype)`` of every matrix product of the compiled
  program: each ``dot`` (inside a Triton GEMM fusion, or left to XLA's emitters)
  and each cuBLAS call (its ``custom_call_target``)."""
  module = hlo_lib.parse(text)
  out = []
  for computation, instructions in module.computations.items():
    for ins in instructions:
      target = re.search(r'custom_call_target="(__cublas[^"]*)"', ins.rest)
      if ins.op != "dot" and not (ins.op == "custom-call" and target):
        continue
      kind = target.group(1) if target else "dot"
      lhs, rhs = (_DTYPE.match(module.types[computation].get(name, "")).group(1)
                  for name in hlo_lib._operands(ins)[:2])
      out.append((kind, lhs, rhs))
  return out


_FP8_PRODUCTS = [("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"),
                 ("f8e4m3fn", "f8e5m2")]
"""The forward (both e4m3) and the two backward products (the e5m2 gradient times an
e4m3 operand), operand dtypes sorted."""


@gpu_compile
@needs_cuda
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_per_tensor_scaling_compiles_to_cublaslt_fp8_gemms(recipe_name):
  gemms = gemm_operands(compile_dense_step(recipe_name, TRITON_OFF))
  assert {kind for kind, _, _ in gemms} == {"__cublas$lt$matmul$f8"}, gemms
  assert sorted(tuple(sorted(d)) for _, *d in gemms) == _FP8_PRODUCTS, gemms


@gpu_compile
@needs_cuda
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_per_tensor_scaling_compiles_to_fp8_triton_gemms_by_default(recipe_name):
  text = compile_dense_step(recipe_name, {})
  gemms = gemm_operands(text)
  assert {kind for kind, _, _ in gemms} <= {"dot", "__cublas$lt$matmul$f8"}, gemms
  assert sorted(tuple(sorted(d)) for _, *d in gemms) == _FP8_PRODUCTS, gemms
  assert '"kind":"__triton' in text  # the dots are Triton GEMM fusions


@gpu_compile
@needs_cuda
@pytest.mark.parametrize("options", [{}, TRITON_OFF], ids=["triton", "cublas"])
def test_blockwise_scaling_rounds_through_fp8_and_multiplies_in_bf16(options):
  text = compile_dense_step("blockwise", options)
  gemms = gemm_operands(text)
  assert len(gemms) == 3 and all(d == ["bf16", "bf16"] for _, *d in gemms), gemms
  # the tiles' FP8 values are in the program: the rounding happens
  assert re.search(r"= f8e4m3fn\[", text) and re.search(r"= f8e5m2\[", text)


@gpu_compile
@needs_cuda
def test_an_fp8_round_trip_before_a_bf16_gemm_is_elided_by_the_gpu_compiler():
  """Why `mpscale.fp8_dot_general` gives the GEMMs the FP8 values themselves, and
  holds blockwise values behind an optimization barrier."""
  sharding = SingleDeviceSharding(h100())
  x = jax.ShapeDtypeStruct((ROWS, IN), jnp.bfloat16, sharding=sharding)
  w = jax.ShapeDtypeStruct((IN, OUT), jnp.bfloat16, sharding=sharding)
  round_trip = lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)
  text = jax.jit(lambda x, w: round_trip(x) @ round_trip(w)).lower(x, w).compile(
      ).as_text()
  assert "f8e4m3fn" not in text  # the rounding is gone


@gpu_compile
@needs_cuda
@pytest.mark.parametrize("options", [{}, TRITON_OFF], ids=["triton", "cublas"])
def test_the_plan_reads_every_product_of_an_fp8_dense_as_an_fp8_gemm(options):
  """`mpscale.trainer.planning.hlo.fp8_flops`, which the plan prices at the profile's float8 peak:
  all of a per-tensor FP8 Dense's product FLOPs, through cuBLAS's FP8 calls and
  Triton's GEMM fusions alike; none of blockwise's bf16 products."""
  text = compile_dense_step("delayed", options)
  assert hlo_lib.fp8_flops(text) == hlo_lib.matmul_flops(text) == 3 * 2 * ROWS * IN * OUT
  assert hlo_lib.fp8_flops(compile_dense_step("blockwise", options)) == 0


@gpu_compile
@needs_cuda
def test_a_pipelined_fp8_step_multiplies_its_blocks_in_fp8_gemms():
  """The tiny LM's FP8 blocks over 2 pipeline stages x 4 data replicas, compiled for
  8 H100s: with every block in FP8 (``bf16_layers: 0``, no cond) nearly all the
  products' FLOPs are FP8 GEMMs (the rest: attention's scores and values, the
  head); with bf16 end blocks each block's precision is a cond, which the plan
  prices at bf16."""
  from mpscale.trainer.config import load as config_lib
  from mpscale.trainer.planning import compiled
  base = ["model.num_layers=4", "model.d_model=128", "model.d_ff=512",
          "model.seq_len=128", "data.batch_size=16", "train.per_token_loss=true",
          "mesh.stage=2", "mesh.data=4", "train.num_microbatches=2",
          "precision.fp8.recipe=delayed"]
  shares = {}
  for ends in (0, 1):
    cfg = config_lib.load_config("configs/tiny_lm_bf16.yaml",
                                 base + [f"precision.fp8.bf16_layers={ends}"])
    plan = compiled.plan(cfg, hardware="h100-80g", compiler="target")
    assert "H100" in plan.compiled_for and not plan.compile_note, plan.compiled_for
    shares[ends] = plan.fp8_flops / plan.flops_per_device
  assert shares[0] > 0.75 and shares[1] == 0.0, shares
