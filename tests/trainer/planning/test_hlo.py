"""Reading compiled HLO text (mpscale.trainer.planning.hlo): the collectives and matrix-product FLOPs of
programs compiled on the 8 fake CPU devices, against bytes and FLOPs counted by hand,
and hand-written HLO for what a CPU compile does not print (asynchronous pairs,
conditionals, widened sums)."""

import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import pytest

from mpscale.trainer.planning import hlo

ROWS, COLS = 16, 32
"""Each device's block of the ``(8 * ROWS, COLS)`` float32 input: 2048 bytes."""
BLOCK = ROWS * COLS * 4
RING = [(i, (i + 1) % 8) for i in range(8)]


def _compiled(fn, out_specs, dtype=jnp.float32, rows=ROWS, cols=COLS):
  """The compiled HLO text of ``fn`` on each device's block of an ``(8 * rows,
  cols)`` input split over a mesh of the 8 devices."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_specs,
                            check_vma=False))
  return f.lower(jax.ShapeDtypeStruct((8 * rows, cols), dtype)).compile().as_text()


@pytest.mark.parametrize("fn, out_specs, want, counts", [
    (lambda a: jax.lax.psum(a, "x"), P(), {"all-reduce": BLOCK}, (1,)),
    # The gathered result: all 8 blocks.
    (lambda a: jax.lax.all_gather(a, "x", tiled=True), P(), {"all-gather": 8 * BLOCK},
     (1,)),
    # The whole operand, not the eighth each device keeps.
    (lambda a: jax.lax.psum_scatter(a, "x", tiled=True), P("x"),
     {"reduce-scatter": BLOCK}, (1,)),
    (lambda a: jax.lax.ppermute(a, "x", RING), P("x"), {"collective-permute": BLOCK},
     (1,)),
    (lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), P("x"),
     {"all-to-all": BLOCK}, (1,)),
    # Both arrays: one tuple-shaped all-reduce where XLA combines them (the newest
    # releases), two on the oldest jax mpscale supports (.ci/floors.txt).
    (lambda a: jax.lax.psum((a, a[:4]), "x"), P(),
     {"all-reduce": BLOCK + 4 * COLS * 4}, (1, 2)),
], ids=["psum", "all_gather", "psum_scatter", "ppermute", "all_to_all", "psum_tuple"])
def test_each_collective_of_a_compiled_program_with_its_bytes(fn, out_specs, want,
                                                               counts):
  found = hlo.collectives(_compiled(fn, out_specs))
  assert {kind: c["bytes"] for kind, c in found.items()} == want
  assert all(c["count"] in counts for c in found.values()), found


def test_a_compiled_loop_counts_its_collectives_by_the_trip_count():
  def loop(a):
    return jax.lax.fori_loop(0, 5, lambda i, c: jax.lax.ppermute(c, "x", RING), a)

  assert hlo.collectives(_compiled(loop, P("x"))) == {
      "collective-permute": {"count": 5, "bytes": 5 * BLOCK}}


@pytest.mark.parametrize("dtype, width", [("bfloat16", 2), ("float16", 2),
                                          ("float32", 4)])
def test_a_sum_counts_at_the_width_the_program_gave_it(dtype, width):
  """XLA's CPU backend sums bfloat16 in float32 (it widens the all-reduce and names
  its reducer ``*_promoted``); a GPU or TPU moves bfloat16, and so does the plan."""
  text = _compiled(lambda a: jax.lax.psum(a, "x"), P(), dtype, rows=64, cols=128)
  assert hlo.collectives(text) == {"all-reduce": {"count": 1,
                                                  "bytes": 64 * 128 * width}}


def test_matmul_flops_of_a_compiled_product_and_of_a_loop_of_them():
  a = jax.ShapeDtypeStruct((16, 32), jnp.float32)
  b = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  text = jax.jit(jnp.matmul).lower(a, b).compile().as_text()
  assert hlo.matmul_flops(text) == 2 * 16 * 64 * 32

  def loop(a, b):
    return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ b[:, :32]), a)

  text = jax.jit(loop).lower(a, b).compile().as_text()
  assert hlo.matmul_flops(text) == 3 * 2 * 16 * 32 * 32
  # XLA's own count takes the loop's body once.
  assert jax.jit(loop).lower(a, b).compile().cost_analysis()["flops"] < (
      hlo.matmul_flops(text))


def test_no_collectives_on_one_device():
  text = jax.jit(lambda a: a * 2).lower(jnp.ones((4, 4))).compile().as_text()
  assert hlo.collectives(text) == {}
  assert hlo.matmul_flops(text) == 0.0


RAGGED = """HloModule m

ENTRY %main (x: bf16[64,16], out: bf16[512,16], o: s64[8]) -> bf16[512,16] {
  %x = bf16[64,16]{1,0} parameter(0)
  %out = bf16[512,16]{1,0} parameter(1)
  %o = s64[8]{0} parameter(2)
  %go = ((bf16[64,16]{1,0}, bf16[512,16]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, s64[8]{0}), bf16[512,16]{1,0}) ragged-all-to-all-start(%x, %out, %o, %o, %o, %o), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %done = bf16[512,16]{1,0} ragged-all-to-all-done(%go)
}
"""


def test_a_ragged_all_to_all_moves_its_rows_not_its_worst_case_buffer():
  # a mixture of experts' exchange: 64 rows out, into a buffer for 8 x 64 (every
  # row to one device): the rows sent are what moves
  assert hlo.collectives(RAGGED) == {"ragged-all-to-all": {"count": 1,
                                                           "bytes": 64 * 16 * 2}}


LOOP_AND_FRIENDS = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %cp = f32[8]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %cp)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%mm (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8], /*index=1*/b: f32[4,4]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %ar = (f32[8]{0}, f32[4,4]{1,0}) all-reduce(%a, %b), channel_id=2, to_apply=%add
  %rs = f32[2]{0} reduce-scatter(%a), channel_id=4, dimensions={0}
  %ag-start = f32[32]{0} all-gather-start(%a), channel_id=3, dimensions={0}
  %ag-done = f32[32]{0} all-gather-done(%ag-start)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %f = f32[8,4]{1,0} fusion(%x, %y), kind=kOutput, calls=%mm
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_parse_reads_computations_types_and_the_entry():
  module = hlo.parse(LOOP_AND_FRIENDS)
  assert module.entry == "main"
  assert list(module.computations) == ["body", "cond", "mm", "main"]
  assert [i.op for i in module.computations["mm"]] == ["parameter", "parameter", "dot"]
  # Parameters from the signature (comments between them skipped), then every name.
  assert module.types["main"]["b"] == "f32[4,4]"
  assert module.types["main"]["ar"] == "(f32[8]{0}, f32[4,4]{1,0})"
  ag = module.computations["main"][3]
  assert (ag.name, ag.result, ag.op) == ("ag-start", "f32[32]{0}", "all-gather-start")
  # The parsed module reads as its text does.
  assert hlo.collectives(module) == hlo.collectives(LOOP_AND_FRIENDS)
  assert hlo.matmul_flops(module) == hlo.matmul_flops(LOOP_AND_FRIENDS)


def test_tuples_async_pairs_and_loops_in_hlo_text():
  assert hlo.collectives(LOOP_AND_FRIENDS) == {
      # Both arrays of the tuple-shaped all-reduce (its operand %b named only in the
      # signature).
      "all-reduce": {"count": 1, "bytes": 8 * 4 + 16 * 4},
      "reduce-scatter": {"count": 1, "bytes": 8 * 4},  # its operand, not its result
      "all-gather": {"count": 1, "bytes": 32 * 4},  # -start and -done: once
      "collective-permute": {"count": 5, "bytes": 5 * 8 * 4},  # the trip count
  }
  # The dot inside the fusion, once.
  assert hlo.matmul_flops(LOOP_AND_FRIENDS) == 2 * 8 * 4 * 16


def test_a_conditional_counts_its_costliest_branch():
  text = """HloModule m

%small (p: f32[8,16]) -> f32[8,4] {
  %p = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} constant({...})
  ROOT %d = f32[8,4]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%big (q: f32[8,64]) -> f32[8,4] {
  %q = f32[8,64]{1,0} parameter(0)
  %v = f32[64,4]{1,0} constant({...})
  ROOT %e = f32[8,4]{1,0} dot(%q, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[8,4]{1,0} collective-permute(%e), channel_id=1, source_target_pairs={{0,1}}
}

ENTRY %main (i: s32[], a: f32[8,16]) -> f32[8,4] {
  %i = s32[] parameter(0)
  ROOT %c = f32[8,4]{1,0} conditional(%i, %a, %a), branch_computations={%small, %big}
}
"""
  assert hlo.matmul_flops(text) == 2 * 8 * 4 * 64
  assert hlo.collectives(text) == {"collective-permute": {"count": 1,
                                                          "bytes": 8 * 4 * 4}}


def test_a_conditional_named_to_run_n_times_a_step_counts_them():
  """A pipeline's head: every tick reaches its conditional, the last stage runs the
  head once a micro-batch. Named so (``mpscale_runs_<n>_a_step``), the cheap branch
  counts where it is and the costly one's excess ``n`` times a step, copies of the
  conditional in peeled loops (a schedule's warm-up) together ``n`` times, and
  another conditional of its own branches (a backward's recompute) ``n`` more."""
  body = """%%small (p: f32[8,16]) -> f32[8,4] {
  %%p = f32[8,16]{1,0} parameter(0)
  %%w = f32[16,4]{1,0} constant({...})
  ROOT %%d = f32[8,4]{1,0} dot(%%p, %%w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%%big (q: f32[8,16]) -> f32[8,4] {
  %%q = f32[8,16]{1,0} parameter(0)
  %%v = f32[16,64]{1,0} constant({...})
  %%e = f32[8,64]{1,0} dot(%%q, %%v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %%u = f32[64,4]{1,0} constant({...})
  ROOT %%f = f32[8,4]{1,0} dot(%%e, %%u), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
  loop = """%%NAME (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %%t = (s32[], f32[8,16]{1,0}) parameter(0)
  %%i = s32[] get-tuple-element(%%t), index=0
  %%a = f32[8,16]{1,0} get-tuple-element(%%t), index=1
  %%c = f32[8,4]{1,0} conditional(%%i, %%a, %%a), branch_computations={%%small, %%big}, metadata={op_name="jit(step)/while/body/SCOPE/cond"}
  ROOT %%r = (s32[], f32[8,16]{1,0}) tuple(%%i, %%a)
}
"""
  entry = """ENTRY %%main (x: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %%x = (s32[], f32[8,16]{1,0}) parameter(0)
  %%w1 = (s32[], f32[8,16]{1,0}) while(%%x), condition=%%cond, body=%%warm, backend_config={"known_trip_count":{"n":"3"}}
  %%w2 = (s32[], f32[8,16]{1,0}) while(%%w1), condition=%%cond, body=%%steady, backend_config={"known_trip_count":{"n":"10"}}
  ROOT %%w3 = (s32[], f32[8,16]{1,0}) while(%%w2), condition=%%cond, body=%%again, backend_config={"known_trip_count":{"n":"5"}}
}
"""
  small, excess = 2 * 8 * 4 * 16, 2 * 8 * 64 * 16 + 2 * 8 * 4 * 64 - 2 * 8 * 4 * 16

  def text(scope):
    loops = [loop.replace("NAME", name).replace("SCOPE", scope)
             for name in ("warm", "steady")]
    # another conditional of the same cost (a backward's recompute of the head):
    # branches of its own, not copies
    again = (loop.replace("NAME", "again").replace("SCOPE", scope)
             .replace("{%%small, %%big}", "{%%small.1, %%big.1}"))
    other = body.replace("%%small (", "%%small.1 (").replace("%%big (", "%%big.1 (")
    return ("HloModule m\n\n" + body + other + "".join(loops) + again
            + entry).replace("%%", "%")

  assert hlo.matmul_flops(text("mpscale_runs_4_a_step")) == (
      13 * small + 4 * excess + 5 * small + 4 * excess)
  # unnamed: the costliest branch at each of the 18 ticks
  assert hlo.matmul_flops(text("head")) == 18 * (small + excess)


def test_a_compiled_pipeline_head_counts_once_a_micro_batch():
  """The name scope the pipelines put their head's conditional in
  (`runs_a_step`) reaches the compiled program: a loop of 10 ticks whose
  conditional runs its product on 3 of them counts that product 3 times."""
  from mpscale.parallel.pipeline import _run as run_lib
  w_small, w_big = jnp.ones((16, 4)), jnp.ones((16, 256))

  def step(x):
    def tick(carry, i):
      with run_lib.runs_a_step(3):
        y = jax.lax.cond(i < 3, lambda: (x @ w_big)[:, :4], lambda: x @ w_small)
      return carry + y, None
    return jax.lax.scan(tick, jnp.zeros((8, 4)), jnp.arange(10))[0]

  text = jax.jit(step).lower(jnp.ones((8, 16))).compile().as_text()
  assert hlo.matmul_flops(text) == pytest.approx(
      10 * 2 * 8 * 4 * 16 + 3 * (2 * 8 * 256 * 16 - 2 * 8 * 4 * 16))


def test_fp8_flops_of_a_conditional_follow_the_branch_the_products_count():
  """A layer chosen at run time in FP8 or in bf16 (a cond whose branches' products
  tie): the plan cannot tell which runs, so it counts the slower, with no FP8
  FLOPs; a costlier FP8 branch counts as an FP8 one."""
  def branch(name, kind, k):
    return f"""%{name} (p: {kind}[8,{k}]) -> bf16[8,4] {{
  %p = {kind}[8,{k}]{{1,0}} parameter(0)
  %w = {kind}[{k},4]{{1,0}} constant({{...}})
  ROOT %d = bf16[8,4]{{1,0}} dot(%p, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""

  def module(fp8_k, bf16_k):
    return ("HloModule m\n\n" + branch("fp8", "f8e4m3fn", fp8_k)
            + branch("plain", "bf16", bf16_k) + f"""
ENTRY %main (i: s32[], a: f8e4m3fn[8,{fp8_k}], c: bf16[8,{bf16_k}]) -> bf16[8,4] {{
  %i = s32[] parameter(0)
  %a = f8e4m3fn[8,{fp8_k}]{{1,0}} parameter(1)
  %c = bf16[8,{bf16_k}]{{1,0}} parameter(2)
  ROOT %r = bf16[8,4]{{1,0}} conditional(%i, %a, %c), branch_computations={{%fp8, %plain}}
}}
""")

  tie = module(16, 16)
  assert hlo.matmul_flops(tie) == 2 * 8 * 4 * 16 and hlo.fp8_flops(tie) == 0
  costlier_fp8 = module(64, 16)
  assert hlo.fp8_flops(costlier_fp8) == hlo.matmul_flops(costlier_fp8) == 2 * 8 * 4 * 64


def test_a_promoted_sum_in_hlo_text_counts_half():
  text = """HloModule m

%add.clone_promoted (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[64,128]) -> f32[64,128] {
  %a = f32[64,128]{1,0} parameter(0)
  %r = f32[64,128]{1,0} all-reduce(%a), channel_id=1, to_apply=%add.clone_promoted
  %rs = f32[8,128]{1,0} reduce-scatter(%a), channel_id=2, dimensions={0}, to_apply=%add.clone_promoted
  ROOT %t = f32[64,128]{1,0} all-reduce(%r), channel_id=3, to_apply=%add
}
"""
  assert hlo.collectives(text) == {
      "all-reduce": {"count": 2, "bytes": 64 * 128 * 2 + 64 * 128 * 4},
      "reduce-scatter": {"count": 1, "bytes": 64 * 128 * 2}}
  # sums: each one with the width the program gave it.
  assert hlo.sums(text) == [
      hlo.Sum("all-reduce", "f32", True, 64 * 128 * 2, "main"),
      hlo.Sum("reduce-scatter", "f32", True, 64 * 128 * 2, "main"),
      hlo.Sum("all-reduce", "f32", False, 64 * 128 * 4, "main")]


@pytest.mark.parametrize("dtype, widened", [("bfloat16", True), ("float32", False)])
def test_sums_say_which_dtype_a_compiled_program_sums_in(dtype, widened):
  """A bfloat16 psum compiles (on CPU) to a widened float32 all-reduce; a float32 one
  to a float32 all-reduce that is not widened. Gathers and permutes are no sums."""
  def fn(a):
    return jax.lax.psum(a, "x") + jax.lax.ppermute(a, "x", RING)

  (found,) = hlo.sums(_compiled(fn, P("x"), dtype, rows=64, cols=128))
  assert (found.kind, found.widened) == ("all-reduce", widened)
  assert found.bytes == 64 * 128 * (2 if dtype == "bfloat16" else 4)
  if jax.devices()[0].platform == "cpu":
    assert found.dtype == "f32"


def test_text_without_an_entry_reads_as_nothing():
  assert hlo.parse("").entry is None
  assert hlo.collectives("HloModule m\n") == {}
  assert hlo.matmul_flops("HloModule m\n") == 0.0


# ------------------------------------------------------------------ by mesh axis


def test_each_collective_is_read_with_the_mesh_axes_it_spans():
  """A weight split over fsdp x tensor and a batch over data x fsdp on a 2x2x2 mesh:
  the forward gathers the weight over fsdp; the backward sums its gradient over the
  batch's axes, data and fsdp (together with the reduce-scatter back to fsdp, as
  XLA arranges it), and nothing runs over tensor, which splits the output columns."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  shape = dict(mesh.shape)
  placed = lambda a, spec: jax.device_put(  # noqa: E731
      a, jax.sharding.NamedSharding(mesh, spec))
  x = placed(jnp.ones((16, 32)), P(("data", "fsdp")))
  w = placed(jnp.ones((32, 64)), P("fsdp", "tensor"))
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w)), argnums=1))
  text = grad.lower(x, w).compile().as_text()
  over = hlo.collectives_over(text, shape)
  assert {k.split(" over ")[1] for k in over} <= {"fsdp", "data,fsdp", "data"}
  assert "all-gather over fsdp" in over
  assert not [k for k in over if "tensor" in k]
  # The split agrees with the totals by kind.
  totals = hlo.collectives(text)
  for kind, cost in totals.items():
    mine = [v for k, v in over.items() if k.startswith(kind + " over")]
    assert sum(v["bytes"] for v in mine) == cost["bytes"]
    assert sum(v["count"] for v in mine) == cost["count"]


def test_a_pipelines_permutes_span_the_stage_axis():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "stage"))
  fn = jax.jit(jax.shard_map(
      lambda x: jax.lax.ppermute(x, "stage", [(i, (i + 1) % 4) for i in range(4)]),
      mesh=mesh, in_specs=P("data", "stage"), out_specs=P("data", "stage")))
  text = fn.lower(jnp.ones((2, 4))).compile().as_text()
  assert list(hlo.collectives_over(text, dict(mesh.shape))) == [
      "collective-permute over stage"]


@pytest.mark.parametrize("groups, want", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("c",)),
    ("replica_groups={{0,2},{1,3},{4,6},{5,7}}", ("b",)),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("a",)),
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("b", "c")),
    ("replica_groups={}", ("a", "b", "c")),
    # XLA's iota form: iota(8).reshape(2,2,2).transpose(1,0,2).reshape(4,2) =
    # {0,1},{4,5},{2,3},{6,7}: along c.
    ("replica_groups=[4,2]<=[2,2,2]T(1,0,2)", ("c",)),
    # iota(8).reshape(2,4).transpose(1,0).reshape(4,2) = {0,4},{1,5},...: along a.
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ("a",)),
    ("replica_groups=[2,4]<=[8]", ("b", "c")),
    ("source_target_pairs={{0,2},{2,0},{5,7}}", ("b",)),
    # XLA's mesh form (newer releases): the devices differing along the braced axes
    ("replica_groups=mesh['x'=2,'y'=2,'z'=2] {'x'}", ("a",)),
    ("replica_groups=mesh['x'=2,'y'=4] {'y'}", ("b", "c")),
    ("replica_groups=mesh['x'=4,'y'=1,'z'=2] {'z'}", ("c",)),
    # with device_ids: mesh position p holds iota(8).reshape(4,2).T.flatten()[p] =
    # 0,2,4,6,1,3,5,7; along 'y' (size 4) the groups are {0,2,4,6},{1,3,5,7}: a, b
    ("replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'y'}", ("a", "b")),
])
def test_replica_groups_map_to_mesh_axes(groups, want):
  line = f"%r = f32[4]{{0}} all-reduce(%a), channel_id=1, {groups}, to_apply=%add"
  module = hlo.parse(f"HloModule m\nENTRY %main (a: f32[4]) -> f32[4] {{\n"
                     f"  %a = f32[4]{{0}} parameter(0)\n  ROOT {line}\n}}")
  (ins,) = [i for i in module.computations[module.entry] if i.op == "all-reduce"]
  assert hlo.group_axes(hlo.replica_groups(ins, 8), {"a": 2, "b": 2, "c": 2}) == want


def test_the_mesh_form_of_a_real_compiled_program_is_read():
  """A data x tensor all-reduce as the installed XLA writes it (iota or mesh form):
  a sum over the batch's axis only is read as over that axis."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
  placed = lambda a, spec: jax.device_put(  # noqa: E731
      a, jax.sharding.NamedSharding(mesh, spec))
  x = placed(jnp.ones((16, 32)), P("data"))
  w = placed(jnp.ones((32, 64)), P(None, "tensor"))
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w)), argnums=1))
  over = hlo.collectives_over(grad.lower(x, w).compile().as_text(), dict(mesh.shape))
  assert list(over) == ["all-reduce over data"], over


# ------------------------------------------------------------------ kernels


_KERNELS = """HloModule m
%fused_slice (param_0: f32[10,64,64], param_1: s32[]) -> f32[64,64] {
  %param_0 = f32[10,64,64]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,64,64}
  ROOT %b = f32[64,64]{1,0} bitcast(%ds)
}
%fused_update (param_0: f32[10,8,64], param_1: f32[1,8,64], param_2: s32[]) -> f32[10,8,64] {
  %param_0 = f32[10,8,64]{2,1,0} parameter(0)
  %param_1 = f32[1,8,64]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = f32[10,8,64]{2,1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %c, %c)
}
%body (p: (s32[], f32[8,64], f32[10,64,64], f32[10,8,64])) -> (s32[], f32[8,64], f32[10,64,64], f32[10,8,64]) {
  %p = (s32[], f32[8,64]{1,0}, f32[10,64,64]{2,1,0}, f32[10,8,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%p), index=1
  %ws = f32[10,64,64]{2,1,0} get-tuple-element(%p), index=2
  %acts = f32[10,8,64]{2,1,0} get-tuple-element(%p), index=3
  %w = f32[64,64]{1,0} fusion(%ws, %i), kind=kLoop, calls=%fused_slice
  %y = f32[8,64]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %t = f32[8,64]{1,0} tanh(%y)
  %y3 = f32[1,8,64]{2,1,0} bitcast(%t)
  %acts2 = f32[10,8,64]{2,1,0} fusion(%acts, %y3, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,64]{1,0}, f32[10,64,64]{2,1,0}, f32[10,8,64]{2,1,0}) tuple(%i2, %t, %ws, %acts2)
}
%cond (p: (s32[], f32[8,64], f32[10,64,64], f32[10,8,64])) -> pred[] {
  %p = (s32[], f32[8,64]{1,0}, f32[10,64,64]{2,1,0}, f32[10,8,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (a: (s32[], f32[8,64], f32[10,64,64], f32[10,8,64])) -> (s32[], f32[8,64], f32[10,64,64], f32[10,8,64]) {
  %a = (s32[], f32[8,64]{1,0}, f32[10,64,64]{2,1,0}, f32[10,8,64]{2,1,0}) parameter(0)
  ROOT %w = (s32[], f32[8,64]{1,0}, f32[10,64,64]{2,1,0}, f32[10,8,64]{2,1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
"""


def test_kernels_of_a_scan_read_one_layer_and_write_one_slice_a_step():
  """A scan over 10 layers: each trip slices one layer's 64x64 weights from the
  stack (reads 16 KiB, writes 16 KiB, not the 160 KiB stack), runs an 8x64x64
  product, a tanh, and writes its 8x64 output into the stacked activations in place
  (the 2 KiB update read and written, not the 20 KiB stack)."""
  k = hlo.kernels(_KERNELS)
  dot_bytes = 4 * (8 * 64 + 64 * 64 + 8 * 64)
  assert k.dots == [(2.0 * 8 * 64 * 64, float(dot_bytes), 10)]
  floats = (2 * 4 * 64 * 64       # the slice of one layer: read and written
            + 2 * 4 * 8 * 64      # tanh: read and written
            + 2 * 4 * 8 * 64)     # the in-place update: its slice read and written
  ints = 2 * 4 + 3 * 4            # the two fusions' indices, the counter's add
  assert k.bytes == 10 * (floats + ints)
  # float32 counted at 16 bits (a 16-bit program the CPU widened)
  half = hlo.kernels(_KERNELS, float32_bytes=2)
  assert half.dots == [(2.0 * 8 * 64 * 64, dot_bytes / 2, 10)]
  assert half.bytes == 10 * (floats / 2 + ints)
  # a compiled program's products are all there, with matmul_flops' FLOPs
  f = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)
  text = f.lower(jnp.ones((32, 64)), jnp.ones((64, 128))).compile().as_text()
  got = hlo.kernels(text)
  assert sum(fl * n for fl, _, n in got.dots) == hlo.matmul_flops(text)
  assert got.bytes > 0


def _bf16_scan_gradient(num_layers: int) -> str:
  """The compiled CPU program of a bf16 scan's gradient: the backend widens the
  bf16 stacks, so each layer's update is ``convert(dynamic-update-slice(convert(p),
  u))`` inside a fusion."""
  def layers(w, x):
    def body(c, wl):
      y = jnp.tanh(c @ wl)
      return y, y
    return jax.lax.scan(body, x, w)[1]

  w = jax.ShapeDtypeStruct((num_layers, 128, 128), jnp.bfloat16)
  x = jax.ShapeDtypeStruct((32, 128), jnp.bfloat16)
  grad = jax.jit(jax.grad(lambda w, x: jnp.sum(layers(w, x).astype(jnp.float32))))
  return grad.lower(w, x).compile().as_text()


def test_an_update_inside_a_fusion_through_converts_counts_one_layer():
  """A stacked buffer updated a layer per trip, through the CPU's widening
  converts, costs one layer's bytes a trip: the step's bytes grow with the number of
  layers, not with its square (counting the whole stack each trip made 16 layers
  cost 8.5 times 4 layers' bytes)."""
  texts = {n: _bf16_scan_gradient(n) for n in (4, 16)}
  module = hlo.parse(texts[4])
  wrapped = [c for c, body in module.computations.items()
             if body and body[-1].op == "convert"
             and any(x.op == "dynamic-update-slice" for x in body)]
  if jax.default_backend() == "cpu":
    assert wrapped, "the compiled scan no longer wraps its update in converts"
  moved = {n: hlo.kernels(t).bytes for n, t in texts.items()}
  assert 3.5 < moved[16] / moved[4] < 4.5, moved


def test_convolution_flops_are_counted_as_xla_counts_them():
  """A CNN's convolutions (forward, and the input and kernel gradients the backward
  runs as convolutions too) count their multiply-adds, within 5% of XLA's own
  count of the program, which has no loop (issue #42: only ``dot`` was read, so a
  CNN planned at zero FLOPs)."""
  from jax import lax

  def loss(k1, k2, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=dn))
    h = lax.conv_general_dilated(h, k2, (2, 2), "VALID", dimension_numbers=dn,
                                 feature_group_count=4)
    return jnp.sum(h ** 2)

  args = (jnp.ones((3, 3, 8, 16)), jnp.ones((2, 2, 4, 32)), jnp.ones((4, 16, 16, 8)))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  text = compiled.as_text()
  assert "convolution(" in text and " dot(" not in text
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert hlo.matmul_flops(text) == pytest.approx(cost["flops"], rel=0.05)
  # The forward alone, by hand: 2 * batch * output features * input features (per
  # group) * the taps that land on the image (SAME's border taps read padding: 46 of
  # 16 x 3 a row).
  forward = jax.jit(loss).lower(*args).compile().as_text()
  want = 2 * 4 * 16 * 8 * 46 * 46 + 2 * 4 * 32 * 4 * (8 * 2) * (8 * 2)
  assert hlo.matmul_flops(forward) == want
  assert sum(f * n for f, _, n in hlo.kernels(forward).dots) == want



def _small_cnn_loss(k1, k2, k3, b, x):
  """3x3 convolutions: SAME with a bias and relu, stride 2 (padded 1 each side), and
  2 feature groups beside a residual."""
  from jax import lax
  dn = ("NHWC", "HWIO", "NHWC")
  h = jax.nn.relu(lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=dn)
                  + b)
  h = lax.conv_general_dilated(h, k2, (2, 2), ((1, 1), (1, 1)), dimension_numbers=dn)
  h = h + lax.conv_general_dilated(h, k3, (1, 1), "SAME", dimension_numbers=dn,
                                   feature_group_count=2)
  return jnp.sum(h ** 2)


_SMALL_CNN = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
              ((3, 3, 4, 8), (3, 3, 8, 8), (3, 3, 4, 8), (8,), (4, 8, 8, 4))]
CUDNN_CONVS = os.path.join(os.path.dirname(__file__), "..", "..", "data",
                           "cudnn_convs.hlo")
"""``jax.grad(_small_cnn_loss, argnums=(0, 1, 2, 3))`` on `_SMALL_CNN`, compiled by
XLA's CUDA compiler for one A100 (`mpscale.trainer.planning.targets`, no GPU), its
metadata and the non-convolutions' backend configs cut: its convolutions are cuDNN
calls, ``__cudnn$convForward``, ``convBiasActivationForward`` (one with a residual
side input, one a gradient XLA runs forward on the reversed kernel),
``convBackwardInput`` and ``convBackwardFilter``, strided and grouped."""


def test_cudnn_convolutions_count_as_the_cpus_convolutions():
  """A GPU program's cuDNN convolution calls, forward and backward, count what the
  CPU program of the same step counts for its plain convolutions (#64: they counted
  0). By hand: 2 * batch * output features * input features a group * the taps on
  the image, per convolution: SAME 3x3 on 8x8 (22 taps a row), stride 2 (11 on 8),
  grouped SAME on 4x4 (10); the first's kernel gradient, the others' kernel and
  input gradients."""
  with open(CUDNN_CONVS) as f:
    gpu = f.read()
  assert gpu.count('custom_call_target="__cudnn$conv') == 8 and " convolution(" not in gpu
  first, strided, grouped = (2 * 4 * 8 * 4 * 22 ** 2, 2 * 4 * 8 * 8 * 11 ** 2,
                             2 * 4 * 8 * 4 * 10 ** 2)
  want = 2 * first + 3 * strided + 3 * grouped
  assert hlo.matmul_flops(gpu) == want
  assert sum(f * n for f, _, n in hlo.kernels(gpu).dots) == want
  step = jax.jit(jax.grad(_small_cnn_loss, argnums=(0, 1, 2, 3)))
  cpu = step.lower(*_SMALL_CNN).compile()
  assert "convolution(" in cpu.as_text()
  assert hlo.matmul_flops(cpu.as_text()) == want
  cost = cpu.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert want == pytest.approx(cost["flops"], rel=0.06)  # XLA's: elementwise too

_SCHEDULED = """HloModule m, is_scheduled=true
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[256]{0} get-tuple-element(%p), index=1
  %g = f32[256]{0} all-gather-start(%v), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %t = f32[256]{0} tanh(%v)
  %gd = f32[256]{0} all-gather-done(%g)
  %w = f32[256]{0} add(%gd, %t)
  ROOT %o = (s32[], f32[256]{0}) tuple(%i, %w)
}
%cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (a: f32[64,128], b: f32[128,32], v: f32[256]) -> f32[64,32] {
  %a = f32[64,128]{1,0} parameter(0)
  %b = f32[128,32]{1,0} parameter(1)
  %v = f32[256]{0} parameter(2)
  %s = f32[128,32]{1,0} all-reduce-start(%b), channel_id=1, replica_groups={{0,2},{1,3}}, use_global_device_ids=true, to_apply=%add
  %d = f32[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %z = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%z, %v)
  %loop = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %r = f32[128,32]{1,0} all-reduce-done(%s)
  %sync = f32[64,32]{1,0} all-reduce(%d), channel_id=2, replica_groups={{0,1},{2,3}}, use_global_device_ids=true, to_apply=%add
  ROOT %e = f32[64,32]{1,0} exponential(%sync)
}
"""


def test_overlaps_are_the_kernels_between_an_async_start_and_its_done():
  """By hand: the entry's all-reduce (over data: devices 0,2 | 1,3 of data 2 x tensor
  2) has the 64x128x32 product and the whole loop (3 trips of a 256-float tanh and
  add, 2 KiB and 3 KiB each) between its halves; the loop's all-gather (over both
  axes) runs 3 times with one tanh each between its halves; the synchronous
  all-reduce has no window."""
  out = {o.collective: o for o in hlo.overlaps(_SCHEDULED, {"data": 2, "tensor": 2})}
  assert set(out) == {"all-reduce over data", "all-gather over data,tensor"}
  ar = out["all-reduce over data"]
  assert (ar.bytes, ar.count) == (128 * 32 * 4, 1)
  assert ar.window.dots == [(2.0 * 64 * 32 * 128, (64 * 128 + 128 * 32 + 64 * 32) * 4.0,
                             1)]
  assert ar.window.bytes == 3 * (2 * 1024 + 3 * 1024)
  ag = out["all-gather over data,tensor"]
  assert (ag.bytes, ag.count) == (1024, 3)
  assert ag.window == hlo.Kernels([], 2 * 1024.0)
  # Sync collectives are counted by collectives_over, with no window.
  assert "all-reduce over tensor" in hlo.collectives_over(_SCHEDULED,
                                                          {"data": 2, "tensor": 2})


_LIBRARY = """HloModule m
ENTRY %main (q: bf16[2,128,4,64], a: bf16[256,512], b: bf16[512,96]) -> bf16[2,4,128,64] {
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(0)
  %a = bf16[256,512]{1,0} parameter(1)
  %b = bf16[512,96]{1,0} parameter(2)
  %f = (bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "128", "128"], "tuple_shapes": []}, "is_flash_attention": true, "mask_type": "%MASK%"}}
  %o = bf16[2,4,128,64]{3,1,2,0} get-tuple-element(%f), index=0
  %g = (bf16[2,4,128,64]{3,1,2,0}, bf16[2,4,128,64]{3,1,2,0}, bf16[2,4,128,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %q, %q, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "128", "128"]}, "mask_type": "%MASK%"}}
  %m = (bf16[256,96]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config": {"alpha_real": 1, "dot_dimension_numbers": {"lhs_contracting_dimensions": ["1"], "rhs_contracting_dimensions": ["0"], "lhs_batch_dimensions": [], "rhs_batch_dimensions": []}}}
  %s = u32[8]{0} custom-call(%a), custom_call_target="cu_threefry2x32"
  ROOT %r = bf16[2,4,128,64]{3,1,2,0} get-tuple-element(%g), index=0
}
"""


@pytest.mark.parametrize("mask, share", [("CAUSAL", 0.5), ("NO_MASK", 1.0)])
def test_library_calls_count_the_products_they_run(mask, share):
  """A GPU program's matrix products in library calls, worked by hand: cuDNN's
  fused attention, 2 products over the [2, 4, 128, 128] scores of 64-wide heads
  forward and 5 backward, half of them under a causal mask; cuBLAS's 256x512 by
  512x96 product. Another call (a random-number kernel) does no product."""
  text = _LIBRARY.replace("%MASK%", mask)
  scores = 2 * 2 * 4 * 128 * 128 * 64
  gemm = 2 * 256 * 96 * 512
  assert hlo.matmul_flops(text) == share * (2 + 5) * scores + gemm
  k = hlo.kernels(text)
  assert sorted(f for f, _, _ in k.dots) == sorted(
      [share * 2 * scores, share * 5 * scores, float(gemm)])
  # the fused kernels read q, k and v and write their outputs: no [T, S] scores
  forward = next(b for f, b, _ in k.dots if f == share * 2 * scores)
  qkv, out, stats = 3 * 2 * 128 * 4 * 64 * 2, 2 * 4 * 128 * 64 * 2, 2 * 4 * 128 * 4
  assert forward == qkv + out + stats


def _scan_gradient(num_layers: int, remat: bool) -> str:
  """The compiled gradient of a scan of ``num_layers`` tanh layers over 32 rows of
  128 features."""
  def loss(w, x):
    def body(c, wl):
      return jnp.tanh(c @ wl), None
    return jnp.sum(jax.lax.scan(jax.checkpoint(body) if remat else body, x, w)[0])

  w = jax.ShapeDtypeStruct((num_layers, 128, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
  return jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()


def test_saved_for_backward_reads_the_forward_loops_stacks():
  """Recomputing each layer, the forward hands the backward each layer's input
  alone: 12 x 32 x 128 float32; keeping its residuals, more of them a layer; the
  stacks grow with the layers. Unrolled layers hand no stack: None."""
  layer_input = 32 * 128 * 4
  assert hlo.saved_for_backward(_scan_gradient(12, remat=True)) == 12 * layer_input
  kept = hlo.saved_for_backward(_scan_gradient(12, remat=False))
  assert kept > 12 * layer_input
  assert hlo.saved_for_backward(_scan_gradient(4, remat=False)) * 3 == kept
  f = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))))
  assert hlo.saved_for_backward(
      f.lower(jnp.ones((128, 128)), jnp.ones((32, 128))).compile().as_text()) is None


def test_an_asynchronous_start_counts_its_transfer_once():
  """A GPU program's ``*-start`` result holds its operands beside its results: a
  permute of 16 KiB moves 16 KiB (not 32), a gather of 6 KiB shards into 24 KiB
  moves 24 KiB (not 30)."""
  text = """HloModule m
ENTRY %main (a: bf16[8192], b: bf16[3072]) -> (bf16[8192], bf16[12288]) {
  %a = bf16[8192]{0} parameter(0)
  %b = bf16[3072]{0} parameter(1)
  %p = (bf16[8192]{0}, bf16[8192]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %pd = bf16[8192]{0} collective-permute-done(%p)
  %g = ((bf16[3072]{0}), (bf16[12288]{0})) all-gather-start(%b), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %gd = (bf16[12288]{0}) all-gather-done(%g)
  %gg = bf16[12288]{0} get-tuple-element(%gd), index=0
  ROOT %t = (bf16[8192]{0}, bf16[12288]{0}) tuple(%pd, %gg)
}
"""
  c = hlo.collectives(text)
  permute = c["collective-permute"]  # and its two u32 context words
  assert permute["count"] == 1 and 16384 <= permute["bytes"] <= 16384 + 8
  assert c["all-gather"] == {"count": 1, "bytes": 24576}


_TPU_NESTED = """HloModule jit_f, entry_computation_layout={()->bf16[1024,4096]{1,0}}

%fused_computation.9.clone (param_0.73: bf16[256,1024], param_1.73: bf16[1024,4096]) -> bf16[256,4096] {
  %param_0.73 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.73 = bf16[1024,4096]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.clone.4 = bf16[256,4096]{1,0:T(8,128)(2,1)} convolution(%param_0.73, %param_1.73), dim_labels=bf_io->bf
}

%fused_computation.10 (param_0.24: bf16[256,1024], param_1.71: bf16[1024,4096]) -> bf16[1024,4096] {
  %param_0.24 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.71 = bf16[1024,4096]{1,0:T(8,128)(2,1)} parameter(1)
  %fusion.7 = bf16[256,4096]{1,0:T(8,128)(2,1)} fusion(%param_0.24, %param_1.71), kind=kOutput, calls=%fused_computation.9.clone
  ROOT %convolution.2 = bf16[1024,4096]{1,0:T(8,128)(2,1)} convolution(%param_0.24, %fusion.7), dim_labels=fb_io->bf
}

ENTRY %main.0_spmd (param: bf16[256,1024], param.1: bf16[1024,4096]) -> bf16[1024,4096] {
  %param = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param.1 = bf16[1024,4096]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %fusion.6 = bf16[1024,4096]{1,0:T(8,128)(2,1)} fusion(%param, %param.1), kind=kOutput, calls=%fused_computation.10
}
"""
"""The shape of libtpu's program for ``grad(sum(f(x @ w)))`` (abridged): the forward
product fused into the backward one that consumes it, a ``kOutput`` fusion inside a
``kOutput`` fusion, each product a ``convolution`` with ``dim_labels=bf_io->bf``."""


def test_a_product_fused_inside_another_fusion_counts_in_its_kernel():
  product = 2 * 256 * 1024 * 4096
  assert hlo.matmul_flops(_TPU_NESTED) == 2 * product
  dots, _ = hlo.kernels(_TPU_NESTED)
  assert [(flops, count) for flops, _, count in dots] == [(2 * product, 1)]


_TPU_LOOP = """HloModule jit_f, entry_computation_layout={()->f32[8,8]{1,0}}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %y = f32[8,8]{1,0:T(8,128)} convolution(%x, %x), dim_labels=bf_io->bf
  ROOT %t = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) tuple(%next, %y)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %bound = s32[]{:T(128)} constant(12)
  %q = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%j, %bound), direction=LT
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0:T(8,128)} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) tuple(%zero, %a)
  %loop = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,8]{1,0:T(8,128)} get-tuple-element(%loop), index=1
}
"""
"""A loop as libtpu compiles it: no ``known_trip_count``, its bound in the condition."""


def test_a_loop_without_a_known_trip_count_runs_its_conditions_bound():
  assert hlo.matmul_flops(_TPU_LOOP) == 12 * 2 * 8 * 8 * 8
  dots, _ = hlo.kernels(_TPU_LOOP)
  assert [count for _, _, count in dots] == [12]


_GATHER = """HloModule jit_f, entry_computation_layout={()->f32[16,512]{1,0}}

%fused_gather (p0: f32[1024,512], p1: s32[16,1]) -> f32[16,512] {
  %p0 = f32[1024,512]{1,0} parameter(0)
  %p1 = s32[16,1]{1,0} parameter(1)
  ROOT %g = f32[16,512]{1,0} gather(%p0, %p1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,512}
}

ENTRY %main (a: f32[1024,512], i: s32[16,1]) -> f32[16,512] {
  %a = f32[1024,512]{1,0} parameter(0)
  %i = s32[16,1]{1,0} parameter(1)
  ROOT %f = f32[16,512]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_gather
}
"""


def test_a_fusion_gathering_rows_reads_only_those_rows():
  # 16 rows of 512 floats read, the 16 indices read, 16 rows written
  _, moved = hlo.kernels(_GATHER)
  assert moved == 16 * 512 * 4 + 16 * 4 + 16 * 512 * 4


_LAYER_OF_A_STACK = """HloModule jit_f, entry_computation_layout={()->f32[64,32]{1,0}}

%fused_update (p0: f32[4,64,32], p1: f32[4,64], p2: f32[64,32]) -> f32[64,32] {
  %p0 = f32[4,64,32]{2,1,0} parameter(0)
  %p1 = f32[4,64]{1,0} parameter(1)
  %b = f32[4,64,32]{2,1,0} broadcast(%p1), dimensions={0,1}
  %m = f32[4,64,32]{2,1,0} multiply(%p0, %b)
  %s = f32[1,64,32]{2,1,0} slice(%m), slice={[2:3], [0:64], [0:32]}
  %r = f32[64,32]{1,0} bitcast(%s)
  %p2 = f32[64,32]{1,0} parameter(2)
  ROOT %u = f32[64,32]{1,0} subtract(%p2, %r)
}

ENTRY %main (m: f32[4,64,32], f: f32[4,64], p: f32[64,32]) -> f32[64,32] {
  %m = f32[4,64,32]{2,1,0} parameter(0)
  %f = f32[4,64]{1,0} parameter(1)
  %p = f32[64,32]{1,0} parameter(2)
  ROOT %fu = f32[64,32]{1,0} fusion(%m, %f, %p), kind=kLoop, calls=%fused_update
}
"""


def test_a_fusion_reading_one_layer_of_a_stack_through_element_wise_ops_reads_it():
  # A parameter's update from its layer of a stacked momentum, slice(m * f): the
  # kernel reads that layer of m (a quarter), all of the small factors f (read
  # through a broadcast), the parameter, and writes it.
  _, moved = hlo.kernels(_LAYER_OF_A_STACK)
  layer = 64 * 32 * 4
  assert moved == layer + 4 * 64 * 4 + layer + layer
  # Where the product is also read whole (here: returned), m counts whole.
  whole = _LAYER_OF_A_STACK.replace(
      "ROOT %u = f32[64,32]{1,0} subtract(%p2, %r)",
      "%u = f32[64,32]{1,0} subtract(%p2, %r)\n  ROOT %t = (f32[64,32]{1,0}, "
      "f32[4,64,32]{2,1,0}) tuple(%u, %m)")
  whole = whole.replace("-> f32[64,32] {\n  %p0", "-> (f32[64,32], f32[4,64,32]) {\n  %p0")
  whole = whole.replace("ROOT %fu = f32[64,32]{1,0} fusion", "ROOT %fu = (f32[64,32]{1,0}, f32[4,64,32]{2,1,0}) fusion")
  assert hlo.kernels(whole).bytes == 4 * layer + 4 * 64 * 4 + layer + layer + 4 * layer


_FP8 = """HloModule jit_f, entry_computation_layout={()->bf16[128,512]{1,0}}

ENTRY %main (a: f8e4m3fn[128,256], b: f8e4m3fn[256,512], c: bf16[128,256], d: bf16[256,512]) -> bf16[128,512] {
  %a = f8e4m3fn[128,256]{1,0} parameter(0)
  %b = f8e4m3fn[256,512]{1,0} parameter(1)
  %c = bf16[128,256]{1,0} parameter(2)
  %d = bf16[256,512]{1,0} parameter(3)
  %fp8 = bf16[128,512]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %wide = bf16[128,512]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %sum = bf16[128,512]{1,0} add(%fp8, %wide)
}
"""


def test_fp8_flops_are_the_products_of_8_bit_operands():
  product = 2 * 128 * 256 * 512
  assert hlo.matmul_flops(_FP8) == 2 * product
  assert hlo.fp8_flops(_FP8) == product


def test_a_tiled_grouped_products_loop_counts_the_tiles_an_even_load_runs():
  # 96 rows of 4 experts, tiles of 8: an even load runs 4 x 3 tiles of 2 x 8 x 16 x 32
  # FLOPs (the loop's trip count is the data's; XLA would count its body once)
  from mpscale import experts  # noqa: PLC0415
  x, w = jnp.ones((96, 16)), jnp.ones((4, 16, 32))
  text = jax.jit(lambda x, w, sizes: experts.grouped_matmul(
      x, w, sizes, implementation="tiled", tile=8)).lower(
          x, w, jnp.array([24, 24, 24, 24])).compile().as_text()
  assert f'{experts.TILES_SCOPE}12"' in text or f"{experts.TILES_SCOPE}12/" in text
  assert hlo.matmul_flops(text) == 12 * 2 * 8 * 16 * 32
