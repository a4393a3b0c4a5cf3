"""The analytic pre-ranking (mpscale.trainer.planning.analytic): each formula by hand on
tiny sizes, against the model's own parameters, the pipeline's schedule tables and
the exact state bytes, and its FLOPs against a compiled plan's."""

import jax
import pytest

from mpscale.parallel.pipeline import _schedules as pipeline_schedules
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.models import lm as lm_lib
from mpscale.trainer.planning import analytic
from mpscale.trainer.planning import compiled as planning
from mpscale.trainer.planning import search as search_lib
from mpscale.trainer.planning import step_time
from mpscale.trainer.planning.hardware import Hardware, Link

CONFIG = "configs/tiny_lm_dp_pp.yaml"
# d 4, f 8, vocabulary 16, 4 positions, 2 layers, 8 sequences a step
LM = lm_lib.TinyLM(vocab_size=16, d_model=4, num_heads=2, num_layers=2, d_ff=8,
                   seq_len=4)
SMALL = analytic.Model(LM, batch_size=8, param_bytes=4, compute_bytes=2,
                       compute_dtype="bfloat16", reduce_bytes=4, optimizer_bytes=8.0)
FAST = Link("fast", bandwidth=1e11, latency=1e-6, span="node")
SLOW = Link("slow", bandwidth=1e10, latency=1e-5, span="nodes")
GPU = Hardware(name="gpu", description="", peak_flops={"bfloat16": 1e15},
               hbm_bandwidth=2e12, hbm_bytes=80e9, devices_per_node=4,
               links=(FAST, SLOW), matmul_efficiency=0.5, memory_efficiency=0.5)


def test_parameter_counts_are_the_models():
  p = analytic.param_counts(SMALL)
  # a layer: qkv 4x12 + 12, out 4x4 + 4, fc 4x8 + 8, proj 8x4 + 4, two layer norms 2x8
  assert p.layer == 60 + 20 + 40 + 36 + 16 == 172
  assert p.layer_split == 60 + 16 + 40 + 32  # out's and proj's biases stay whole
  assert (p.embed, p.head) == (16 * 4 + 4 * 4, 2 * 4 + 4 * 16)
  shapes = jax.eval_shape(LM.init, jax.random.key(0))
  assert lm_lib.num_params(shapes) == p.embed + p.head + 2 * p.layer


@pytest.mark.parametrize("family, sizes", [
    ("llama", dict(num_kv_heads=1)), ("mistral", dict(tie_embeddings=True)),
    ("qwen2", dict(num_kv_heads=1)), ("qwen3", dict(head_dim=6, num_kv_heads=1))])
def test_parameter_counts_are_each_familys(family, sizes):
  lm = lm_lib.TinyLM(vocab_size=16, d_model=4, num_heads=2, num_layers=2, d_ff=8,
                     seq_len=4, family=family, **sizes)
  p = analytic.param_counts(SMALL._replace(lm=lm))
  shapes = jax.eval_shape(lm.init, jax.random.key(0))
  assert lm_lib.num_params(shapes) == p.embed + p.head + 2 * p.layer
  split = sum(x.size // 2 for k, v in shapes["stages"].items()
              if k in ("q", "k", "v", "o", "gate", "up", "down")
              for x in jax.tree_util.tree_leaves(v))
  assert p.layer_split == split


def test_parameters_a_device_and_its_state():
  p = analytic.param_counts(SMALL)
  whole = p.embed + p.head + 2 * p.layer
  assert analytic.params_per_device(SMALL, analytic.Layout(data=4)) == whole
  assert analytic.params_per_device(SMALL, analytic.Layout(fsdp=4)) == whole / 4
  # two stages: one layer each; the embedding and head on both
  assert analytic.params_per_device(SMALL, analytic.Layout(stage=2)) == (
      p.embed + p.head + p.layer)
  split = analytic.params_per_device(SMALL, analytic.Layout(tensor=2))
  assert split == whole - (p.embed_split + p.head_split + 2 * p.layer_split) / 2
  # parameters and gradients in float32, Adam's 8 bytes; ZeRO-1 splits the 8
  assert analytic.state_bytes(SMALL, analytic.Layout(data=4)) == whole * (4 + 4 + 8)
  assert analytic.state_bytes(SMALL, analytic.Layout(data=4, zero1=True)) == (
      whole * (4 + 4 + 8 / 4))


@pytest.mark.parametrize("layout", [
    {"mesh.data": 8}, {"mesh.fsdp": 8}, {"mesh.data": 4, "mesh.tensor": 2},
    {"mesh.data": 4, "mesh.shard_optimizer_state": True, "mesh.tensor": 2},
    {"mesh.data": 2, "mesh.stage": 2, "mesh.tensor": 2}])
def test_state_bytes_are_the_exact_ones_within_a_tenth(layout):
  overrides = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.stage": 1, "mesh.tensor": 1,
               "train.num_microbatches": 4, **layout}
  cfg = config_lib.load_config(CONFIG, search_lib._overrides(overrides))  # noqa: SLF001
  model = analytic.Model.from_config(cfg)
  estimate = analytic.state_bytes(model, analytic.Layout.from_overrides(overrides))
  assert estimate == pytest.approx(search_lib.static_bytes(cfg), rel=0.1)


def test_matmul_flops_by_hand():
  d, f, t, v = 4, 8, 4, 16
  layer = 2 * (4 * d * d + 2 * d * f) + 4 * t * d  # 256 + 64 a token
  head = 2 * d * v
  tokens = 8 * 4 / 2  # two replicas
  plain = analytic.Layout(data=2)
  assert analytic.matmul_flops(SMALL, plain) == tokens * 3 * (2 * layer + head)
  # recomputation runs each layer's forward again, less its last product (2 d f)
  remat = analytic.Layout(data=2, remat=True)
  assert analytic.matmul_flops(SMALL, remat) == tokens * (
      2 * (3 * layer + layer - 2 * d * f) + 3 * head)
  # tensor 2 halves everything; two stages each run one layer, bubble ticks too
  assert analytic.matmul_flops(SMALL, analytic.Layout(data=2, tensor=2)) == (
      tokens * 3 * (2 * layer + head) / 2)
  # one layer a stage, run on each of the M + S - 1 = 3 ticks for M = 2 items
  piped = analytic.Layout(data=2, stage=2, microbatches=2)
  assert analytic.matmul_flops(SMALL, piped) == pytest.approx(
      tokens * 3 * (layer * (2 + 2 - 1) / 2 + head))


@pytest.mark.parametrize("schedule,stages,micro,virtual", [
    ("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("zb_h1", 4, 8, 1), ("gpipe", 2, 4, 2),
    ("1f1b", 2, 8, 2), ("1f1b", 4, 4, 1), ("zb_h1", 2, 4, 1)])
def test_bubble_and_items_alive_are_the_schedule_tables(schedule, stages, micro,
                                                        virtual):
  # micro-batches at least the stages, as `search.layouts` enumerates them
  layout = analytic.Layout(stage=stages, microbatches=micro, schedule=schedule,
                           virtual_stages=virtual)
  table = pipeline_schedules.pipeline_schedule_table(schedule, stages, micro, virtual)
  assert analytic.bubble(layout) == pytest.approx(
      pipeline_schedules.pipeline_bubble_fraction(table))
  assert analytic.live_items(layout) == pipeline_schedules.live_slots(table)


def test_collectives_by_hand():
  n = analytic.params_per_device(SMALL, analytic.Layout(data=4))
  assert analytic.collectives(SMALL, analytic.Layout(data=4)) == [
      analytic.Collective("all-reduce", ("data",), n * 4, 1)]
  zero1 = analytic.collectives(SMALL, analytic.Layout(data=4, zero1=True))
  pieces = analytic.PIECES * analytic.LEAVES  # a piece a leaf and statistic
  assert [c.kind for c in zero1] == ["all-reduce", "all-gather"]
  assert [c.nbytes * c.count for c in zero1] == pytest.approx([n * 4, n * 4])
  assert [c.count for c in zero1] == [pieces, pieces]
  # a micro-batch of 2 sequences x 4 tokens x d 4 in bfloat16 crosses the tensor
  # axis twice a layer a pass (forward, backward), plus the embedding and head's
  tensor = analytic.collectives(SMALL, analytic.Layout(data=4, tensor=2))
  big = [c for c in tensor if c.axes == ("tensor",) and c.nbytes == 2 * 4 * 4 * 2]
  assert [(c.kind, c.count) for c in big] == [("all-reduce", 2 * 2 * 2 + 2)]
  sp = analytic.collectives(SMALL, analytic.Layout(data=4, tensor=2,
                                                   sequence_parallel=True))
  assert {c.kind for c in sp if c.nbytes == 64} == {"all-gather", "reduce-scatter"}
  # a pipeline sends a micro-batch each way each of its v M + S - 1 ticks
  piped = analytic.collectives(SMALL, analytic.Layout(stage=2, microbatches=4))
  permute = [c for c in piped if c.kind == "collective-permute"]
  assert permute == [analytic.Collective("collective-permute", ("stage",),
                                         2 * 4 * 4 * 2, 2 * (4 + 2 - 1))]


def test_zb_h1_costs_what_its_compiled_step_moves_beyond_1f1b():
  """ZB-H1's layer bytes and tensor-parallel activation collectives are 1F1B's
  times `ZB_H1_COST` (what its split backward was measured to move), its bubble
  aside; the optimizer's update and the head are the same; 1F1B's are GPipe's."""
  def layout(schedule):
    return analytic.Layout(data=2, stage=2, tensor=2, microbatches=4, remat=True,
                           schedule=schedule)

  zb, f1, gp = (layout(s) for s in ("zb_h1", "1f1b", "gpipe"))
  fixed = analytic.params_per_device(SMALL, zb) * (
      analytic.UPDATE_BYTES + 2 * SMALL.optimizer_bytes)
  head = SMALL.batch_size * SMALL.lm.seq_len / 2 * (
      analytic.ELEMENTWISE_PASSES["logits"] * SMALL.lm.vocab_size / 2 * 4)

  def layer_bytes(l):  # the layers' bytes, the bubble's ticks taken out
    return ((analytic.elementwise_bytes(SMALL, l) - fixed - head)
            * (1 - analytic.bubble(l)))

  def activation_collectives(l):
    activation = analytic.rows(SMALL, l) * SMALL.lm.seq_len * SMALL.lm.d_model * 2
    return sum(c.count for c in analytic.collectives(SMALL, l)
               if c.axes == ("tensor",) and c.nbytes == activation)

  assert layer_bytes(zb) == pytest.approx(analytic.ZB_H1_COST["bytes"]
                                          * layer_bytes(f1))
  assert layer_bytes(f1) == pytest.approx(layer_bytes(gp))
  assert activation_collectives(f1) > 0
  assert activation_collectives(zb) == pytest.approx(
      analytic.ZB_H1_COST["tensor"] * activation_collectives(f1))


def test_the_estimate_prices_with_the_step_time_formulas():
  layout = analytic.Layout(data=8)  # 8 devices over 2 nodes of 4: the slow link
  n = analytic.params_per_device(SMALL, layout)
  est = analytic.estimate(SMALL, layout, GPU)
  # a ring over 2 nodes: 1 of its 7 steps a pass between them (NCCL's ring model)
  assert est.collectives == pytest.approx(
      2 * 7 / 8 * n * 4 / 1e10 + 2 * (1e-5 + 6 * FAST.latency))
  assert est.collectives == step_time.collective_seconds("all-reduce", n * 4, 8, SLOW,
                                                         2, FAST)
  assert est.compute == pytest.approx(
      analytic.matmul_flops(SMALL, layout) / (1e15 * 0.5))
  assert est.memory == pytest.approx(
      analytic.elementwise_bytes(SMALL, layout) / (2e12 * 0.5))
  assert est.seconds == pytest.approx(est.compute + est.memory + est.collectives)
  assert est.bubble == 0 and est.peak_bytes == analytic.memory_bytes(SMALL, layout)
  local = analytic.estimate(SMALL, analytic.Layout(data=4, stage=2), GPU)
  assert local.bubble > 0


def test_more_memory_saving_costs_less_memory():
  base = analytic.Layout(data=2, microbatches=1)
  assert analytic.activation_bytes(SMALL, base._replace(microbatches=2)) < (
      analytic.activation_bytes(SMALL, base))
  assert analytic.activation_bytes(SMALL, base._replace(remat=True)) < (
      analytic.activation_bytes(SMALL, base))
  assert analytic.elementwise_bytes(SMALL, base._replace(remat=True)) < (
      analytic.elementwise_bytes(SMALL, base))
  assert analytic.memory_bytes(SMALL, base._replace(zero1=True)) < (
      analytic.memory_bytes(SMALL, base))
  assert analytic.fits(SMALL, base, 1e9) and not analytic.fits(SMALL, base, 1e3)


def test_recompute_layers_counts_k_of_a_stages_layers_recomputed():
  """``train.recompute_layers`` (``k`` of a stage's ``L`` layers, Megatron-LM's
  ``recompute_num_layers``): a device keeps the first ``k`` layers' inputs and the
  other layers' residuals, and one layer's working set only when every layer is
  recomputed; ``k = 0`` is no recomputation, ``k = L`` all of it (the matrix FLOPs
  alike). Read from the config's keys."""
  base = analytic.Layout(data=2)
  tokens = analytic.rows(SMALL, base) * LM.seq_len
  layer_input = tokens * LM.d_model * SMALL.compute_bytes
  memory = lambda **kw: analytic.activation_bytes(SMALL, base._replace(**kw))  # noqa: E731
  flops = lambda **kw: analytic.matmul_flops(SMALL, base._replace(**kw))  # noqa: E731
  none, full = memory(), memory(remat=True)
  layer = none - full + 2 * layer_input     # a layer's residuals
  assert memory(remat=True, recompute_layers=0) == none
  assert memory(remat=True, recompute_layers=1) == pytest.approx(
      none - layer + layer_input)         # layer 0's input kept, layer 1's residuals
  assert memory(remat=True, recompute_layers=2) == full
  assert flops(remat=True, recompute_layers=0) == flops()
  assert flops() < flops(remat=True, recompute_layers=1) < flops(remat=True)
  assert flops(remat=True, recompute_layers=1) == pytest.approx(
      (flops() + flops(remat=True)) / 2)
  staged = analytic.Layout(data=2, stage=2, microbatches=2, remat=True,
                           recompute_layers=1)  # a stage's one layer: all of it
  assert analytic.activation_bytes(SMALL, staged) == analytic.activation_bytes(
      SMALL, staged._replace(recompute_layers=None))
  cfg = config_lib.config_from_dict({"train": {"recompute": "full",
                                               "recompute_layers": 1}}, "<test>")
  assert analytic.Layout.from_config(cfg).recompute_layers == 1
  assert analytic.Layout.from_overrides({"train.recompute": "full"}).remat


@pytest.mark.slow  # one compile each: 10-40 s on 2 busy cores
@pytest.mark.parametrize("family", [{}, {"model.family": "llama",
                                         "model.num_kv_heads": 2}],
                         ids=["gpt", "llama_gqa"])
def test_matmul_flops_are_the_compiled_plans(family):
  overrides = {"mesh.data": 2, "mesh.stage": 1, "mesh.tensor": 2, "mesh.fsdp": 1,
               "train.num_microbatches": 1, "train.recompute": "full", **family}
  cfg = config_lib.load_config(CONFIG, search_lib._overrides(overrides))  # noqa: SLF001
  plan = planning.plan(cfg)
  model = analytic.Model.from_config(cfg)
  layout = analytic.Layout.from_overrides(overrides)
  assert analytic.matmul_flops(model, layout) == pytest.approx(plan.flops_per_device)
  assert analytic.params_per_device(model, layout) * 4 == plan.bytes["params"]


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_context_divides_a_devices_tokens_and_exchanges_kv_by_hand(mode):
  """Context 2: a device's FLOPs, memory-bound bytes and activations are half its
  replica's; its parameters and state are half too (split over context as FSDP
  splits them, as the trainer lays them out), gathered over context; the gradient
  sum runs over context too; the K/V exchange by hand (a
  device's K and V: 2 x 4 rows x 2 of the 4 positions x 2 heads x 2 dims x 2 bytes
  = 128 bytes); the ring's permutes hidden behind attention up to its FLOPs' time."""
  whole, split = analytic.Layout(data=2), analytic.Layout(data=2, context=2,
                                                          context_parallel=mode)
  for fn in (analytic.matmul_flops, analytic.activation_bytes,
             analytic.params_per_device):
    assert fn(SMALL, split) == pytest.approx(fn(SMALL, whole) / 2)
  assert analytic.context_kv_bytes(SMALL, split) == 2 * 4 * 2 * 2 * 2 * 2 == 128
  # the weights gathered over context in the compute dtype, forward and backward
  # (the ring's layout has no other all-gather)
  weights = analytic.params_per_device(SMALL, split) * 2
  gathers = [c for c in analytic.collectives(SMALL, analytic.Layout(
      data=2, context=2)) if c.kind == "all-gather"]
  assert {c.axes for c in gathers} == {("context",)}
  assert sum(c.nbytes * c.count for c in gathers) == pytest.approx(
      2 * weights * SMALL.compute_bytes)
  found = {(c.kind, c.axes): c for c in analytic.collectives(SMALL, split)}
  assert ("all-reduce", ("data", "context")) in found
  layers = 2  # one micro-batch, two layers
  if mode == "ring":
    permute = [c for c in analytic.collectives(SMALL, split)
               if c.kind == "collective-permute"]
    # forward and backward, context - 1 each; the float32 gradients, context
    assert [(c.nbytes, c.count) for c in permute] == [(128, layers * 1 * 2),
                                                      (256, layers * 2)]
    hidden = analytic.hidden_seconds(SMALL, split, GPU)
    assert 0 < hidden <= analytic.collective_seconds(SMALL, split, GPU)
    estimate = analytic.estimate(SMALL, split, GPU)
    assert estimate.hidden == pytest.approx(
        hidden + analytic.fsdp_hidden_seconds(SMALL, split, GPU))
  else:
    gather = found[("all-gather", ("context",))]
    scatter = found[("reduce-scatter", ("context",))]
    assert (gather.nbytes, gather.count) == (256, layers * 2)
    assert (scatter.nbytes, scatter.count) == (512, layers)
    assert analytic.hidden_seconds(SMALL, split, GPU) == 0


def test_fsdp_moves_the_trainers_bytes_and_hides_behind_the_next_layer():
  """FSDP 8 over two nodes of 4: each leaf gathered in bf16 forward and backward and
  its gradient reduce-scattered in float32 (the trainer's gather_cast); every
  layer's collectives but one a phase hide, each behind one layer's products of
  that phase, so a model of one layer hides nothing."""
  layout = analytic.Layout(data=1, fsdp=8)
  gather, scatter = [c for c in analytic.collectives(SMALL, layout)
                     if c.axes == ("fsdp",) and c.kind != "all-reduce"]
  whole = analytic.params_per_device(SMALL, layout) * 8
  assert gather.nbytes * gather.count == pytest.approx(2 * whole * 2)
  assert scatter.nbytes * scatter.count == pytest.approx(whole * 4)
  rate = 1e15 * 0.5
  forward = analytic._priced([gather._replace(count=gather.count / 2)], layout, GPU)
  backward = analytic._priced([gather._replace(count=gather.count / 2), scatter],
                              layout, GPU)
  flops = analytic.tokens_per_device(SMALL, layout) * analytic._layer_flops(
      SMALL, layout)
  want = 1 * (min(forward / 2, flops / rate) + min(backward / 2, 2 * flops / rate))
  assert analytic.fsdp_hidden_seconds(SMALL, layout, GPU) == pytest.approx(want)
  assert 0 < want < analytic.collective_seconds(SMALL, layout, GPU)
  one = SMALL._replace(lm=lm_lib.TinyLM(vocab_size=16, d_model=4, num_heads=2,
                                        num_layers=1, d_ff=8, seq_len=4))
  assert analytic.fsdp_hidden_seconds(one, layout, GPU) == 0
  assert analytic.fsdp_hidden_seconds(SMALL, analytic.Layout(data=8), GPU) == 0
