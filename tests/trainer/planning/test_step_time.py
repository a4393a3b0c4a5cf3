"""The step-time model (mpscale.trainer.planning.step_time): each term on a case computed by
hand, the link a mesh axis maps to, and a real plan's estimate."""

import dataclasses
import json
import types

import pytest

from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import compiled as planning
from mpscale.trainer.planning import step_time
from mpscale.trainer.planning.hardware import Hardware, Link, load_hardware

FAST = Link("fast", bandwidth=4e11, latency=2e-6, span="node")
SLOW = Link("slow", bandwidth=5e10, latency=1e-5, span="nodes")
GPU = Hardware(name="gpu", description="", peak_flops={"bfloat16": 1e15},
               hbm_bandwidth=2e12, hbm_bytes=80e9, devices_per_node=4,
               links=(FAST, SLOW), matmul_efficiency=0.5, memory_efficiency=0.5)


def _plan(**kw):
  fields = dict(mesh={"data": 2, "tensor": 4}, devices=8,
                kernels={"dots": [], "bytes": 0.0}, collectives_over={},
                compute_dtype="bfloat16", bubble=0.0, tokens_per_step=1000,
                model_flops=None)
  fields.update(kw)
  return types.SimpleNamespace(**fields)


def test_compute_is_the_matrix_products_at_the_efficient_peak():
  # 3 runs of a 1e12-FLOP product moving 1e6 bytes: compute-bound, at 0.5 * 1e15
  est = step_time.estimate(_plan(kernels={"dots": [[1e12, 1e6, 3]], "bytes": 0.0}),
                           GPU)
  assert est.compute == pytest.approx(3 * 1e12 / 5e14)  # 6 ms
  assert est.memory == 0 and est.collectives == 0
  assert est.seconds == pytest.approx(6e-3) and est.dominant == "compute"


def test_memory_is_the_other_kernels_bytes_and_a_memory_bound_products_excess():
  # 2e9 bytes of elementwise kernels at 0.5 * 2e12 B/s: 2 ms; a product of 1e9 FLOPs
  # moving 1e9 bytes: 2 us of compute, 1 ms of bytes: the 0.998 ms excess is memory
  est = step_time.estimate(_plan(kernels={"dots": [[1e9, 1e9, 1]], "bytes": 2e9}),
                           GPU)
  assert est.compute == pytest.approx(1e9 / 5e14)
  assert est.memory == pytest.approx(2e9 / 1e12 + (1e9 / 1e12 - 1e9 / 5e14))
  assert est.dominant == "memory"


def test_one_all_reduce_on_each_link_level():
  # mesh data 2 x tensor 4 on nodes of 4 devices: a tensor group is one node
  # (NVLink-like "fast"), a data group spans two nodes ("slow")
  plan = _plan(collectives_over={
      "all-reduce over tensor": {"bytes": 8e8, "count": 2},
      "all-reduce over data": {"bytes": 1e9, "count": 1}})
  est = step_time.estimate(plan, GPU)
  tensor = 2 * (2 * 3 / 4 * 4e8 / 4e11 + 2 * 3 * 2e-6)   # two rings of 4 on "fast"
  data = 2 * 1 / 2 * 1e9 / 5e10 + 2 * 1 * 1e-5            # one ring of 2 on "slow"
  assert est.by_link == pytest.approx({"fast": tensor, "slow": data})
  rows = {r["collective"]: r for r in est.rows}
  assert rows["all-reduce over tensor"]["link"] == "fast"
  assert rows["all-reduce over tensor"]["group"] == 4
  assert rows["all-reduce over data"]["link"] == "slow"
  assert est.collectives == pytest.approx(tensor + data)
  assert est.seconds == pytest.approx(tensor + data)  # no overlap assumed
  assert est.dominant == "collectives on slow"


def test_gathers_scatters_and_permutes_by_their_formulas():
  link = FAST
  assert step_time.collective_seconds("all-gather", 8e8, 4, link) == pytest.approx(
      3 / 4 * 8e8 / 4e11 + 3 * 2e-6)
  assert step_time.collective_seconds("reduce-scatter", 8e8, 4, link) == (
      step_time.collective_seconds("all-gather", 8e8, 4, link))
  assert step_time.collective_seconds("all-reduce", 8e8, 4, link) == pytest.approx(
      2 * step_time.collective_seconds("all-gather", 8e8, 4, link))
  assert step_time.collective_seconds("collective-permute", 8e8, 2, link) == (
      pytest.approx(8e8 / 4e11 + 2e-6))
  assert step_time.collective_seconds("all-reduce", 8e8, 1, link) == 0


def test_a_ring_across_nodes_pays_the_network_latency_only_between_nodes():
  # NCCL's ring model: 8 devices on 2 nodes of 4 cross the network on 1 of their 7
  # steps a pass; one device a node crosses it on every step
  mesh = {"fsdp": 8}
  nodes, node = step_time.ring_hops(("fsdp",), mesh, GPU)
  assert (nodes, node.name) == (2, "fast")
  got = step_time.collective_seconds("all-gather", 8e8, 8, SLOW, nodes, node)
  assert got == pytest.approx(7 / 8 * 8e8 / SLOW.bandwidth + SLOW.latency
                              + 6 * FAST.latency)
  assert step_time.collective_seconds("all-reduce", 8e8, 8, SLOW, nodes, node) == (
      pytest.approx(2 * got))
  spread = {"data": 2, "tensor": 4}  # data's group: one device on each node
  assert step_time.ring_hops(("data",), spread, GPU)[0] == 2
  assert step_time.collective_seconds("all-gather", 8e8, 2, SLOW, 2, node) == (
      step_time.collective_seconds("all-gather", 8e8, 2, SLOW))
  # the estimate prices an FSDP gather so
  plan = _plan(mesh=mesh, devices=8, collectives_over={
      "all-gather over fsdp": {"bytes": 8e8, "count": 1}})
  assert step_time.estimate(plan, GPU).collectives == pytest.approx(got)


def test_the_bubble_is_a_part_of_compute_and_memory_not_added():
  # GPipe, 2 stages, 4 micro-batches: bubble (S - 1) / (M + S - 1) = 1 / 5 of the
  # ticks, which the compiled program runs (its FLOPs include them)
  plan = _plan(kernels={"dots": [[1e12, 1e6, 5]], "bytes": 1e9}, bubble=1 / 5)
  est = step_time.estimate(plan, GPU)
  work = 5 * 1e12 / 5e14 + 1e9 / 1e12
  assert est.seconds == pytest.approx(work)
  assert est.bubble == pytest.approx(work / 5)


def test_offloaded_state_moves_in_and_out_at_the_host_link_not_hidden():
  # 1.6e9 bytes in host memory (train.offload), in and out each step at 32e9 B/s
  # each way: 0.1 s, added whole; a profile without a host link leaves it unpriced
  plan = _plan(kernels={"dots": [[1e12, 1e6, 5]], "bytes": 0.0},
               bytes={"host": 1.6e9})
  linked = dataclasses.replace(GPU, host_bandwidth=32e9)
  est = step_time.estimate(plan, linked)
  assert est.host == pytest.approx(0.1)
  assert est.seconds == pytest.approx(5 * 1e12 / 5e14 + 0.1)
  assert est.dominant == "host copies" and "host copies" in est.text()
  assert step_time.estimate(plan, GPU).host == 0
  assert load_hardware("h100-80g").host_bandwidth == 64e9
  assert load_hardware("a100-80g").host_bandwidth == 32e9
  with pytest.raises(ValueError, match="host_bandwidth"):
    dataclasses.replace(GPU, host_bandwidth=-1.0)


@pytest.mark.parametrize("mesh, axes, link, n", [
    ({"data": 2, "tensor": 4}, ("tensor",), "fast", 4),
    ({"data": 2, "tensor": 4}, ("data",), "slow", 2),
    ({"data": 2, "tensor": 2}, ("data",), "fast", 2),    # 4 devices: one node
    ({"data": 4, "stage": 2, "tensor": 2}, ("stage",), "fast", 2),
    ({"data": 4, "stage": 2, "tensor": 2}, ("data", "tensor"), "slow", 8),
])
def test_a_mesh_axis_maps_to_the_fastest_level_that_holds_it(mesh, axes, link, n):
  got, size = step_time.link_for(axes, mesh, GPU)
  assert (got.name, size) == (link, n)


def test_a_float32_step_runs_at_tf32_where_the_profile_lists_it():
  a100 = load_hardware("a100-80g")
  assert step_time.peak_for(a100, "float32") == 156e12
  assert step_time.peak_for(a100, "bfloat16") == 312e12
  with pytest.raises(ValueError, match="dtype.*float32"):
    step_time.estimate(_plan(compute_dtype="float32"), GPU)  # lists bfloat16 only
  with pytest.raises(TypeError, match="hardware"):
    step_time.estimate(_plan(), "a100-80g")


def test_a_real_plan_carries_its_estimate_as_text_and_json():
  cfg = config_lib.load_config("configs/tiny_lm_bf16.yaml",
                               ["mesh.data=2", "mesh.tensor=2"])
  planned = planning.plan(cfg, hardware="a100-80g")
  est = planned.estimate
  assert planned.device_memory == 80e9  # the profile's memory
  assert est.hardware == "a100-80g" and planned.compute_dtype == "bfloat16"
  assert est.seconds == pytest.approx(est.compute + est.memory + est.collectives)
  assert est.compute > 0 and est.memory > 0 and est.collectives > 0
  assert {r["link"] for r in est.rows} == {"nvlink3"}  # 4 devices: one DGX
  assert est.tokens_per_second == pytest.approx(planned.tokens_per_step / est.seconds)
  assert est.mfu == pytest.approx(planned.model_flops
                                  / (est.seconds * 4 * 312e12))
  assert "estimated step on a100-80g" in planned.text()
  d = json.loads(planned.to_json())
  assert d["estimate"]["seconds"] == pytest.approx(est.seconds)
  again = planning.Plan.from_dict(d)
  assert step_time.estimate(again, load_hardware("a100-80g")) == est
  # the same plan on a faster device is faster, term by term
  h100 = step_time.estimate(planned, load_hardware("h100-80g"))
  assert h100.compute < est.compute and h100.memory < est.memory
  assert dataclasses.asdict(h100)["hardware"] == "h100-80g"


def test_an_asynchronous_collective_hides_behind_the_kernels_scheduled_while_it_moves():
  # Two all-reduces over tensor (a ring of 4 on "fast"), 4e8 bytes each: 1.512 ms
  # each. The first has a 1e12-FLOP product between its start and done (2 ms at
  # 0.5 * 1e15): all of it hides. The second has 1e8 bytes of elementwise work
  # (0.1 ms at 0.5 * 2e12 B/s): 0.1 ms of it hides.
  once = 2 * 3 / 4 * 4e8 / 4e11 + 2 * 3 * 2e-6
  plan = _plan(
      kernels={"dots": [[1e12, 1e6, 1]], "bytes": 1e8},
      collectives_over={"all-reduce over tensor": {"bytes": 8e8, "count": 2}},
      overlaps=[{"collective": "all-reduce over tensor", "bytes": 4e8, "count": 1,
                 "window": {"dots": [[1e12, 1e6, 1]], "bytes": 0.0}},
                {"collective": "all-reduce over tensor", "bytes": 4e8, "count": 1,
                 "window": {"dots": [], "bytes": 1e8}}])
  est = step_time.estimate(plan, GPU)
  assert est.collectives == pytest.approx(2 * once)
  assert once == pytest.approx(1.512e-3)
  assert est.hidden == pytest.approx(once + 1e8 / 1e12)
  assert est.seconds == pytest.approx(est.compute + est.memory + 2 * once
                                      - est.hidden)
  assert "hidden behind the kernels" in est.text()
  # A window longer than its collective hides the whole collective, no more; a
  # collective run in a loop hides its count times.
  plan.overlaps = [{"collective": "all-reduce over tensor", "bytes": 4e8, "count": 2,
                    "window": {"dots": [[1e13, 1e6, 1]], "bytes": 0.0}}]
  assert step_time.estimate(plan, GPU).hidden == pytest.approx(2 * once)
  plan.overlaps = []
  assert step_time.estimate(plan, GPU).hidden == 0.0


def test_fp8_gemms_run_at_the_float8_peak_where_the_profile_has_one():
  # 3e12 FLOPs of products, 1e12 of them FP8: 2e12 at 0.5 * 1e15, 1e12 at 0.5 * 4e15
  fp8_gpu = dataclasses.replace(GPU, peak_flops={"bfloat16": 1e15, "float8": 4e15})
  plan = _plan(kernels={"dots": [[1e12, 1e6, 3]], "bytes": 0.0}, fp8_flops=1e12)
  est = step_time.estimate(plan, fp8_gpu)
  assert est.compute == pytest.approx(2e12 / 5e14 + 1e12 / 2e15)
  with pytest.raises(ValueError, match=r"precision.fp8: .*gpu lists no float8 peak"):
    step_time.estimate(plan, GPU)
  assert step_time.estimate(_plan(kernels={"dots": [[1e12, 1e6, 3]], "bytes": 0.0}),
                            GPU).compute == pytest.approx(3e12 / 5e14)
