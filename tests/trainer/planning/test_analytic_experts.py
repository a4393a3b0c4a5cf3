"""The analytic pre-ranking of a mixture of experts (mpscale.trainer.planning.analytic,
mpscale.trainer.planning.search): parameters against the model's own and Mixtral
8x7B's published counts, the experts' state split over ``expert``, FLOPs of the
routed tokens only, the all-to-alls and gradient sums by hand, and the search's
``expert`` axis. Shapes only: nothing compiles."""

import jax
import pytest

from mpscale.trainer.config import load as config_lib
from mpscale.trainer.models import lm as lm_lib
from mpscale.trainer.planning import analytic
from mpscale.trainer.planning import search as search_lib
from mpscale.trainer.planning import step_time
from mpscale.trainer.planning.hardware import Hardware, Link, load_hardware

# d 8, 2 layers, 4 experts of 6 units, 2 a token; 8 sequences of 4 tokens a step
MOE = lm_lib.TinyLM(vocab_size=16, d_model=8, num_heads=2, num_kv_heads=1,
                    num_layers=2, d_ff=12, seq_len=4, family="mixtral",
                    num_experts=4, experts_per_token=2, expert_d_ff=6)
SMALL = analytic.Model(MOE, batch_size=8)
# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1's config.json)
MIXTRAL = analytic.Model(lm_lib.TinyLM(
    vocab_size=32000, d_model=4096, num_heads=32, num_kv_heads=8, num_layers=32,
    d_ff=14336, seq_len=4096, family="mixtral", num_experts=8, experts_per_token=2),
    batch_size=256)
FAST = Link("fast", bandwidth=1e11, latency=1e-6, span="node")
SLOW = Link("slow", bandwidth=1e10, latency=1e-5, span="nodes")
GPU = Hardware(name="gpu", description="", peak_flops={"bfloat16": 1e15},
               hbm_bandwidth=2e12, hbm_bytes=80e9, devices_per_node=4,
               links=(FAST, SLOW), matmul_efficiency=0.5, memory_efficiency=0.5)
CONFIG = "configs/tiny_lm_dp_pp.yaml"  # 4 layers of d 64, 4 heads, 32 sequences


def test_mixtral_8x7b_has_its_published_total_and_active_parameters():
  """46.7B parameters, 12.9B a token (Mistral AI, "Mixtral of Experts", 2024)."""
  p = analytic.param_counts(MIXTRAL)
  total = p.embed + p.head + MIXTRAL.lm.num_layers * p.layer
  assert total == pytest.approx(46.7e9, rel=0.01)
  assert analytic.active_params(MIXTRAL) == pytest.approx(12.9e9, rel=0.01)
  # a dense model's active parameters are all of them
  dense = analytic.Model(lm_lib.TinyLM(vocab_size=16, d_model=8, num_heads=2,
                                       num_layers=2, d_ff=12, seq_len=4,
                                       family="mistral"), batch_size=8)
  d = analytic.param_counts(dense)
  assert analytic.active_params(dense) == d.embed + d.head + 2 * d.layer


@pytest.mark.parametrize("sizes", [{}, {"shared_d_ff": 10, "family": "qwen3_moe",
                                        "head_dim": 6}], ids=["mixtral", "shared"])
def test_expert_parameter_counts_are_the_models(sizes):
  """The router, the experts' gate, up and down and a shared MLP's, against the
  model's own parameters (their shapes: nothing allocated)."""
  fields = dict(vocab_size=16, d_model=8, num_heads=2, num_kv_heads=1, num_layers=2,
                d_ff=12, seq_len=4, family="mixtral", num_experts=4,
                experts_per_token=2, expert_d_ff=6)
  lm = lm_lib.TinyLM(**{**fields, **sizes})
  p = analytic.param_counts(analytic.Model(lm, batch_size=8))
  shapes = jax.eval_shape(lm.init, jax.random.key(0))
  assert lm_lib.num_params(shapes) == p.embed + p.head + 2 * p.layer
  assert p.experts == 3 * 8 * 6 * 4  # gate, up, down of 4 experts, a layer
  routed = sum(shapes["stages"]["moe"][k].size for k in ("gate", "up", "down"))
  assert 2 * p.experts == routed


def test_expert_parallelism_splits_the_experts_and_their_state_only():
  """Under expert 8 a device holds 1/8 of Mixtral's experts (and their gradients
  and Adam moments) and all of the rest; under data 8, everything."""
  data, expert = analytic.Layout(data=8), analytic.Layout(expert=8)
  experts = analytic.expert_params_per_device
  assert experts(MIXTRAL, expert) <= 0.15 * experts(MIXTRAL, data)
  assert experts(MIXTRAL, expert) == pytest.approx(experts(MIXTRAL, data) / 8)
  rest = lambda l: (analytic.params_per_device(MIXTRAL, l)  # noqa: E731
                    - experts(MIXTRAL, l))
  assert rest(expert) == pytest.approx(rest(data))
  per_param = 2 * MIXTRAL.param_bytes + MIXTRAL.optimizer_bytes
  assert analytic.state_bytes(MIXTRAL, expert) == pytest.approx(
      (rest(expert) + experts(MIXTRAL, data) / 8) * per_param)
  # FSDP splits the experts too, and tensor their hidden units
  both = analytic.Layout(fsdp=2, expert=4, tensor=2)
  assert experts(MIXTRAL, both) == pytest.approx(experts(MIXTRAL, data) / 16)


def test_expert_is_a_data_axis_outside_the_experts():
  """A device's tokens (and so its attention's FLOPs and activations) are those of
  ``data`` of the same size; its experts' products are its tokens' too."""
  for fn in (analytic.tokens_per_device, analytic.matmul_flops,
             analytic.activation_bytes, analytic.rows):
    assert fn(SMALL, analytic.Layout(expert=2)) == fn(SMALL, analytic.Layout(data=2))


def test_flops_count_the_routed_tokens_only():
  """Each token through its k experts (and the router over all E): by hand, and
  more experts at the same k add the router's FLOPs alone."""
  d, q, kv, t, v, k, f_e, e = 8, 8, 4, 4, 16, 2, 6, 4
  tokens = 8 * 4 / 2
  layer = 2 * (2 * d * q + 2 * d * kv + 3 * d * k * f_e) + 4 * t * q + 2 * d * e
  layout = analytic.Layout(data=2)
  assert analytic.matmul_flops(SMALL, layout) == tokens * 3 * (2 * layer + 2 * d * v)
  wider = analytic.Model(lm_lib.TinyLM(
      vocab_size=16, d_model=8, num_heads=2, num_kv_heads=1, num_layers=2, d_ff=12,
      seq_len=4, family="mixtral", num_experts=16, experts_per_token=2,
      expert_d_ff=6), batch_size=8)
  router = tokens * 3 * 2 * 2 * d * (16 - 4)  # 2 layers
  assert analytic.matmul_flops(wider, layout) == pytest.approx(
      analytic.matmul_flops(SMALL, layout) + router)
  every = analytic.Model(lm_lib.TinyLM(
      vocab_size=16, d_model=8, num_heads=2, num_kv_heads=1, num_layers=2, d_ff=12,
      seq_len=4, family="mixtral", num_experts=4, experts_per_token=4,
      expert_d_ff=6), batch_size=8)
  assert analytic.matmul_flops(every, layout) - analytic.matmul_flops(
      SMALL, layout) == tokens * 3 * 2 * 2 * 3 * d * (4 - 2) * f_e


@pytest.mark.parametrize("remat", [False, True])
def test_all_to_alls_by_hand(remat):
  """Two all-to-alls a layer and micro-batch forward, two backward, two more in
  the recompute, each of a device's rows x k x d in bfloat16; none without the
  expert axis."""
  layout = analytic.Layout(data=2, expert=2, microbatches=2, remat=remat)
  found = [c for c in analytic.collectives(SMALL, layout) if c.kind == "all-to-all"]
  rows = 8 / (4 * 2)  # a micro-batch of a replica (data 2 x expert 2)
  passes = 3 if remat else 2
  assert found == [analytic.Collective("all-to-all", ("expert",),
                                       rows * 4 * 2 * 8 * 2, 2 * 2 * 2 * passes)]
  assert analytic.routed_bytes(SMALL, layout) == rows * 4 * 2 * 8 * 2
  assert not [c for c in analytic.collectives(SMALL, analytic.Layout(data=4))
              if c.kind == "all-to-all"]


def _seconds(c, layout):
  """``c`` priced as the estimate prices it (`step_time`'s ring formulas)."""
  link, n = step_time.link_for(c.axes, layout.mesh, GPU)
  return c.count * step_time.collective_seconds(
      c.kind, c.nbytes, n, link, *step_time.ring_hops(c.axes, layout.mesh, GPU))


def test_all_to_alls_are_priced_on_the_link_the_expert_axis_spans():
  """``expert`` sits beside ``tensor`` in the mesh: 4 of it fill a node of 4
  (the fast link), 8 span two (the slow one, the fast one's latency inside a
  node), whatever ``data`` is."""
  inside, across = analytic.Layout(data=2, expert=4), analytic.Layout(expert=8)
  for layout, seconds in ((inside, (3 / 4 / 1e11, 3 * 1e-6)),
                          (across, (7 / 8 / 1e10, 1e-5 + 6 * 1e-6))):
    found = analytic.collectives(SMALL, layout)
    (c,) = [c for c in found if c.kind == "all-to-all"]
    assert _seconds(c, layout) == pytest.approx(c.count * (seconds[0] * c.nbytes
                                                           + seconds[1]))
    assert analytic.collective_seconds(SMALL, layout, GPU) == pytest.approx(
        sum(_seconds(x, layout) for x in found))


def test_gradient_sums_run_over_expert_for_every_weight_but_the_experts():
  layout = analytic.Layout(data=2, expert=2)
  n = analytic.params_per_device(SMALL, layout)
  e = analytic.expert_params_per_device(SMALL, layout)
  sums = [c for c in analytic.collectives(SMALL, layout) if c.kind == "all-reduce"]
  assert sums == [analytic.Collective("all-reduce", ("data", "expert"), (n - e) * 4, 1),
                  analytic.Collective("all-reduce", ("data",), e * 4, 1)]
  # expert alone: the experts' gradients are not summed at all
  only = analytic.Layout(expert=4)
  assert [c.axes for c in analytic.collectives(SMALL, only)
          if c.kind == "all-reduce"] == [("expert",)]


def test_activations_hold_the_routed_rows_in_the_dense_mlps_stead():
  """A layer keeps k routed rows of d a token and their k f_e units (the SwiGLU's
  gate and up, and its float32 product), and the router's float32 scores."""
  layout = analytic.Layout(data=2)
  dense = analytic.Model(lm_lib.TinyLM(
      vocab_size=16, d_model=8, num_heads=2, num_kv_heads=1, num_layers=2,
      d_ff=2 * 6, seq_len=4, family="mistral"), batch_size=8)
  tokens = 8 / 2 * 4
  routed = 2 * 8 * 2 + 4 * 4  # k rows of d in bfloat16, E float32 scores
  assert analytic.activation_bytes(SMALL, layout) - analytic.activation_bytes(
      dense, layout) == tokens * 2 * routed  # 2 layers; the units alike (k f_e = f)


def test_fused_attention_holds_no_scores():
  """cuDNN's attention (``Model.attention``) moves and keeps no [h, T, T] scores."""
  layout = analytic.Layout(data=2)
  fused = SMALL._replace(attention="cudnn")
  scores = 8 / 2 * 4 * 2 * 2 * 4  # tokens, layers, heads, positions
  assert analytic.elementwise_bytes(SMALL, layout) - analytic.elementwise_bytes(
      fused, layout) == scores * analytic.ELEMENTWISE_PASSES["scores"] * 4
  assert analytic.activation_bytes(SMALL, layout) - analytic.activation_bytes(
      fused, layout) == scores * (8 + 2)


def _moe_config(num_experts):
  return config_lib.load_config(CONFIG, [
      "mesh.stage=1", "mesh.data=1", "model.family=mixtral",
      f"model.num_experts={num_experts}", "model.experts_per_token=2"])


def test_the_search_splits_experts_only_for_a_mixture_and_by_divisors():
  """6 experts on 8 devices: expert 1 or 2 (the divisors of both), never with
  stages (the trainer does not pipeline a mixture yet); a dense model's layouts
  have no expert axis; every mesh fills the devices and splits the batch."""
  ladders = search_lib.layouts(_moe_config(6), 8, 8)
  experts = {l[0]["mesh.expert"] for l in ladders}
  assert experts == {1, 2}
  assert all(l[0]["mesh.stage"] == 1 for l in ladders)
  for ladder in ladders:
    mesh = ladder[0]
    size = (mesh["mesh.data"] * mesh["mesh.fsdp"] * mesh.get("mesh.context", 1)
            * mesh["mesh.expert"] * mesh["mesh.tensor"])
    assert size == 8
    replicas = mesh["mesh.data"] * mesh["mesh.fsdp"] * mesh["mesh.expert"]
    assert 32 % (replicas * mesh["train.num_microbatches"]) == 0
  assert {l[0]["mesh.expert"] for l in search_lib.layouts(_moe_config(8), 8, 8)} == {
      1, 2, 4, 8}
  dense = config_lib.load_config(CONFIG)
  assert not any("mesh.expert" in l[0] for l in search_lib.layouts(dense, 8, 8))
  # --axes without expert leaves it 1
  assert {l[0]["mesh.expert"] for l in search_lib.layouts(
      _moe_config(8), 8, 8, axes=("data", "tensor"))} == {1}


def test_the_search_prices_a_mixtures_layouts_with_their_all_to_alls():
  """From shapes: the layouts of 8 experts on 8 devices ranked, each variant's
  estimate the analytic one of its layout (the all-to-alls in it)."""
  cfg = _moe_config(8)
  ladders = search_lib.layouts(cfg, 8, 8, axes=("data", "expert"))
  fitting, over = search_lib.preranked(cfg, ladders, load_hardware("h100-80g"))
  assert len(fitting) + len(over) == len(ladders) and fitting
  model = analytic.Model.from_config(cfg)
  for c in fitting:
    layout = analytic.Layout.from_overrides(c.ladder[c.start])
    assert c.estimate == analytic.estimate(model, layout, load_hardware("h100-80g"))
  split = [c for c in fitting if c.ladder[0]["mesh.expert"] == 8]
  assert split and any(x.kind == "all-to-all" for x in analytic.collectives(
      model, analytic.Layout.from_overrides(split[0].ladder[split[0].start])))


def test_a_layout_read_from_a_config_is_its_overrides():
  cfg = _moe_config(8)
  overrides = {"mesh.data": 2, "mesh.expert": 4, "mesh.fsdp": 1, "mesh.stage": 1,
               "mesh.tensor": 1, "train.num_microbatches": 2, "train.recompute": "full",
               "mesh.shard_optimizer_state": True, "mesh.pipeline_schedule": "1f1b"}
  again = config_lib.load_config(CONFIG, [
      *[f"{k}={str(v).lower()}" for k, v in overrides.items()],
      "model.family=mixtral", "model.num_experts=8"])
  assert analytic.Layout.from_config(again) == analytic.Layout.from_overrides(
      overrides)
  assert analytic.Model.from_config(cfg).lm.num_experts == 8
