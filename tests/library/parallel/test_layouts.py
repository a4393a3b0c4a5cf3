"""Sharded parameters (FSDP, tensor, sequence) beside data and pipeline stages.

The reference for every layout is the same step on one device: after five steps of
dynamic loss scale + clip + CAME (or AdamW) with micro-batches, a per-token loss and
uneven masks, the loss, the norms and the parameters agree to 1e-5 (float32).
"""

import collections
import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import mpscale
from mpscale.trainer.models import lm as lm_lib
from mpscale import parallel
from mpscale.trainer.config.load import ModelConfig

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

AXES = ("data", "fsdp", "stage", "tensor")
CONFIG = ModelConfig(d_model=32, num_heads=8, num_layers=4, d_ff=64, seq_len=16)
BATCH, STEPS, MICRO = 16, 5, 2


def make_mesh(data=1, fsdp=1, stage=1, tensor=1):
  shape = (data, fsdp, stage, tensor)
  return Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape), AXES)


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (BATCH, CONFIG.seq_len + 1)).astype(np.int32)
  # Uneven masks: rows keep from 10% to 90% of their tokens.
  keep = np.linspace(0.1, 0.9, BATCH)[:, None]
  mask = (rng.random((BATCH, CONFIG.seq_len)) < keep).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def make_optimizer(name):
  # The key bias of attention has a true gradient of zero (the softmax is shift
  # invariant), so its float32 gradient is rounding noise (about 1e-12), which a
  # normalizing optimizer with a tiny eps turns into a full +-lr step whose sign
  # depends on the order of the sums: CAME normalizes it twice, by the second moment
  # (eps[0]) and by the instability (eps[2]). Larger eps keep the noise from deciding
  # those updates; every other parameter moves as with the defaults.
  if name.startswith("came"):
    inner = mpscale.came(1e-2, eps=(1e-8, 1e-3, 1e-6),
                         stack_layers=name == "came_stacked")
  else:
    inner = optax.adamw(1e-2, eps=1e-6)
  return mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(0.5, norm_groups=1), inner),
      init_scale=2.0 ** 10, norm_groups=1)


def make_step(mesh, optimizer, *, virtual=0, sequence_parallel=False, schedule="gpipe",
              zero1=False, donate=True):
  shard = None if mesh is None else lm_lib.ActivationSharding(
      mesh, sequence_parallel=sequence_parallel)
  model = lm_lib.TinyLM.from_sizes(CONFIG, shard=shard)
  loss = model.loss_fn
  if virtual:
    loss = mpscale.Pipeline(model.embed_fn, model.stage_fn, model.head_fn, MICRO,
                            schedule=schedule, virtual_stages=virtual)
  return model, mpscale.make_train_step(
      loss, make_optimizer(optimizer), mesh=mesh,
      data_axis=("data", "fsdp") if mesh is not None else "data",
      num_microbatches=MICRO, per_token_loss=True, shard_optimizer_state=zero1,
      param_specs=None if mesh is None else model.param_specs(mesh), donate=donate)


def train(mesh, optimizer, **kw):
  model, (init, step) = make_step(mesh, optimizer, **kw)
  state = init(jax.jit(model.init)(jax.random.key(0)))
  history = []
  for i in range(STEPS):
    state, metrics = step(state, make_batch(i))
    history.append(jax.device_get(metrics))
  return state, history


@functools.lru_cache(maxsize=None)
def reference(optimizer):
  state, history = train(None, optimizer)
  return jax.device_get(state), history


def assert_same_run(got, want):
  (state, history), (want_state, want_history) = got, want
  for metrics, expected in zip(history, want_history):
    for key in ("loss", "global_norm", "num_tokens", "loss_scale"):
      np.testing.assert_allclose(metrics[key], expected[key], rtol=1e-5, atol=1e-5,
                                 err_msg=key)
    for name, norm in expected["group_norms"].items():
      np.testing.assert_allclose(metrics["group_norms"][name], norm, rtol=1e-5,
                                 atol=1e-5, err_msg=name)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(state.params),
                          jax.tree_util.tree_leaves(want_state.params)):
    np.testing.assert_allclose(np.asarray(x), y, rtol=1e-5, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


LAYOUTS = {
    # (data, fsdp, tensor); 2x2x2 is the quick test below, with ZeRO-1 and sequence
    # parallelism on top
    "fsdp4-tp2": dict(fsdp=4, tensor=2),
    "fsdp8": dict(fsdp=8),
    "tp8": dict(tensor=8),
    # (data, stage, tensor) and (stage, fsdp), pipelined
    "dp2-pp2-tp2": dict(data=2, stage=2, tensor=2),
    "pp4-fsdp2": dict(stage=4, fsdp=2),
}


@pytest.mark.slow  # about 20 s each on 2 cores
@pytest.mark.parametrize("layout, optimizer", [(layout, "came") for layout in LAYOUTS]
                         + [("fsdp8", "adamw")])
def test_matches_one_device(layout, optimizer):
  shape = LAYOUTS[layout]
  virtual = 1 if shape.get("stage", 1) > 1 else 0
  got = train(make_mesh(**shape), optimizer, virtual=virtual)
  assert_same_run(got, reference(optimizer))


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fsdp_tensor_sequence_parallel_zero1_matches_one_device():
  got = train(make_mesh(data=2, fsdp=2, tensor=2), "came", sequence_parallel=True,
              zero1=True)
  assert_same_run(got, reference("came"))
  specs = {jax.tree_util.keystr(p): x.sharding.spec
           for p, x in jax.tree_util.tree_leaves_with_path(got[0].params)}
  assert specs["['stages']['qkv']['kernel']"] == P(None, "fsdp", "tensor")
  assert specs["['stages']['proj']['kernel']"] == P(None, "tensor", "fsdp")


@pytest.mark.slow  # about 20 s each on 2 cores
@pytest.mark.parametrize("schedule, virtual", [("gpipe", 2), ("1f1b", 1)])
def test_pipelines_with_tensor_parallel_stages_match_one_device(schedule, virtual):
  zero1 = schedule == "1f1b"  # ZeRO-1 on top of the stage and tensor splits
  got = train(make_mesh(data=2, stage=2, tensor=2), "came", virtual=virtual,
              schedule=schedule, sequence_parallel=True, zero1=zero1)
  assert_same_run(got, reference("came"))
  mu = got[0].opt_state.skip_state.inner_state[1][0].mu["stages"]["fc"]["kernel"]
  assert mu.sharding.spec == (P("stage", "data", "tensor") if zero1
                              else P("stage", None, "tensor"))


def test_interleaved_bubble_is_smaller():
  model, _ = make_step(None, "came")
  pipe = lambda v: mpscale.Pipeline(model.embed_fn, model.stage_fn, model.head_fn,
                                    MICRO * 2, virtual_stages=v)
  S, M = 2, MICRO * 2
  for v in (1, 2):
    assert pipe(v).bubble(S) == pytest.approx((S - 1) / (v * M + S - 1))


# ------------------------------------------------------------------ skipping, norms


def test_an_overflow_in_one_shard_makes_every_device_skip():
  mesh = make_mesh(fsdp=4, tensor=2)
  specs = {"w": P("fsdp", "tensor")}

  def loss_fn(params, batch):  # d loss / d w = batch["c"] summed over rows
    return jnp.mean(jnp.sum(params["w"] * batch["c"], axis=(1, 2)))

  init, step = mpscale.make_train_step(
      loss_fn, make_optimizer("came"), mesh=mesh, data_axis=("data", "fsdp"),
      param_specs=specs, num_microbatches=2)
  state = init({"w": jnp.ones((8, 6))})
  before = jax.device_get(state)
  c = np.ones((8, 8, 6), np.float32)
  c[5, 7, 5] = np.inf  # lands on one element of w: the shard of fsdp 3, tensor 1
  state, metrics = step(state, {"c": c})
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  for x, y in zip(jax.tree_util.tree_leaves(state.params),
                  jax.tree_util.tree_leaves(before.params)):
    for shard in x.addressable_shards:  # every device kept its shard as it was
      np.testing.assert_array_equal(shard.data, y[shard.index])
  inner = jax.tree_util.tree_leaves(state.opt_state.skip_state.inner_state)
  assert all(np.isfinite(np.asarray(s.data)).all() for x in inner
             for s in x.addressable_shards)
  # A clean step after it moves every shard.
  state, metrics = step(state, {"c": np.ones((8, 8, 6), np.float32)})
  assert not bool(metrics["overflow"])
  assert not np.allclose(np.asarray(state.params["w"]), before.params["w"])


# ------------------------------------------------------------------ memory


def test_fsdp_divides_params_and_optimizer_state():
  n = 8
  _, (init, step) = make_step(make_mesh(fsdp=n), "came")
  state = init(lm_lib.TinyLM.from_sizes(CONFIG).init(jax.random.key(0)))
  leaves = jax.tree_util.tree_leaves((state.params, state.opt_state))
  total = sum(x.nbytes for x in leaves)
  unsplit = [x.nbytes for x in leaves
             if "fsdp" not in parallel.spec_axes(x.sharding.spec)]
  assert max(unsplit) <= 16  # only scalars (step counts, the scale) stay whole
  bound = total / n + sum(unsplit)
  per_device = parallel.tree_bytes((state.params, state.opt_state))
  assert per_device <= bound, (per_device, total / n, sum(unsplit))
  # The compiled step holds no more than that, plus the batch.
  compiled = step.lower(state, make_batch()).compile()
  batch_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(make_batch()))
  argument_bytes = compiled.memory_analysis().argument_size_in_bytes
  assert argument_bytes <= bound + batch_bytes + 64, (argument_bytes, bound)


def test_tensor_parallelism_divides_the_matrices_it_splits():
  _, (init, _) = make_step(make_mesh(tensor=8), "adamw")
  state = init(lm_lib.TinyLM.from_sizes(CONFIG).init(jax.random.key(0)))
  split = {"['embed']['token']", "['head']['out']['kernel']"} | {
      f"['stages']['{name}']['kernel']" for name in ("qkv", "out", "fc", "proj")}
  for path, x in jax.tree_util.tree_leaves_with_path(state.params):
    name = jax.tree_util.keystr(path)
    if name in split:
      assert x.addressable_shards[0].data.nbytes == x.nbytes // 8, name
  # Adam's moments follow their parameters.
  mu = state.opt_state.skip_state.inner_state[1][0].mu
  assert mu["stages"]["qkv"]["kernel"].sharding.spec == P(None, None, "tensor")


def test_came_factors_follow_their_dimension():
  mesh = make_mesh(fsdp=2, tensor=4)
  params = {"w": jax.ShapeDtypeStruct((8, 12), jnp.float32)}
  specs = {"w": P("fsdp", "tensor")}
  state = jax.eval_shape(mpscale.came(1e-3).init, params)
  laid = parallel.state_specs(state, params, specs)
  came_state = laid[0]
  assert came_state.mu["w"] == P("fsdp", "tensor")
  assert came_state.v_row["w"] == P("fsdp")          # mean over the last dim
  assert came_state.v_col["w"] == P("tensor")        # mean over the rows
  assert came_state.instability_row["w"] == P("fsdp")
  assert came_state.v["w"] == P()                    # an empty placeholder
  # Square factors: CAME's state declares which dimension each statistic averages.
  square = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
  laid = parallel.state_specs(jax.eval_shape(mpscale.came(1e-3).init, square), square,
                              specs)[0]
  assert (laid.v_row["w"], laid.v_col["w"]) == (P("fsdp"), P("tensor"))
  # ZeRO-1 on top: the data axes a leaf does not use yet, on a free dimension.
  followed = parallel.state_specs(state, params, {"w": P(None, "tensor")})
  zero = parallel.zero1_specs(state, followed, mesh, ("fsdp",))
  assert zero[0].mu["w"] == P("fsdp", "tensor")
  assert zero[0].v_col["w"] == P("tensor")  # 12 / 4; fsdp has no free dim left


def _stacked(laid, field, first):
  """The spec of the stack of ``laid``'s ``field`` whose first member is ``first``."""
  stacks = getattr(laid, field)
  return dict(zip([m[0] for m in stacks.members], stacks.arrays))[first]


def test_came_state_stacked_by_role_follows_its_members():
  # Four linen-named layers of a column-parallel matrix, and a vector; the layer
  # h_2's bias is laid out differently from the others' (P("tensor") against P()).
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  params = {f"h_{i}": {"w": shape(8, 12), "b": shape(12)} for i in range(4)}
  specs = {f"h_{i}": {"w": P("fsdp", "tensor"), "b": P("tensor" if i == 2 else None)}
           for i in range(4)}
  state = jax.eval_shape(mpscale.came(1e-3, stack_layers=True).init, params)
  laid = parallel.state_specs(state, params, specs)[0]
  assert _stacked(laid, "mu", "h_0/w") == P(None, "fsdp", "tensor")
  assert _stacked(laid, "v_row", "h_0/w") == P(None, "fsdp")  # mean over the last dim
  assert _stacked(laid, "v_col", "h_0/w") == P(None, "tensor")
  assert _stacked(laid, "instability_col", "h_0/w") == P(None, "tensor")
  assert _stacked(laid, "mu", "h_0/b") == P()  # its members disagree: unsplit
  assert _stacked(laid, "v", "h_0/b") == P()
  # A stack of leaves these params do not hold (a transform run on other keys) is
  # replicated, not an error.
  renamed = parallel.state_specs(state, {"other": params["h_0"]["w"]},
                                 {"other": P("fsdp", "tensor")})[0]
  assert set(jax.tree_util.tree_leaves(renamed.mu, is_leaf=parallel.is_spec)) == {P()}
  # ZeRO-1 on top splits the one free dimension, the stack's (4 layers over data 2).
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  zero = parallel.zero1_specs(state, parallel.state_specs(state, params, specs), mesh,
                              ("data",))
  assert _stacked(zero[0], "mu", "h_0/w") == P("data", "fsdp", "tensor")


def test_parameter_groups_state_follows_its_parameters():
  # Each group's optimizer state holds optax.MaskedNode for the other groups'
  # leaves: it is laid out after its own parameters, not replicated.
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  params = {"embed": shape(16, 8), "blocks": {"w": shape(8, 12)}}
  specs = {"embed": P("fsdp", None), "blocks": {"w": P("fsdp", "tensor")}}
  for stack_layers in (False, True):
    tx = mpscale.param_groups(
        lambda **kw: mpscale.came(stack_layers=stack_layers, **kw),
        [mpscale.ParamGroup("embed", lr_mult=0.5)], learning_rate=1e-3)
    state = jax.eval_shape(tx.init, params)
    laid = parallel.state_specs(state, params, specs)
    embed = laid.inner_states["embed"].inner_state[0]
    blocks = laid.inner_states["default"].inner_state[0]
    if stack_layers:
      assert _stacked(embed, "mu", "embed") == P(None, "fsdp")
      assert _stacked(blocks, "v_col", "blocks/w") == P(None, "tensor")
    else:
      assert embed.mu["embed"] == P("fsdp", None)
      assert isinstance(embed.mu["blocks"]["w"], optax.MaskedNode)
      assert blocks.mu["blocks"]["w"] == P("fsdp", "tensor")
      assert blocks.v_row["blocks"]["w"] == P("fsdp")
    assert (jax.tree_util.tree_structure(laid, is_leaf=parallel.is_spec)
            == jax.tree_util.tree_structure(state))


@pytest.mark.slow  # about 20 s on 2 cores
def test_came_state_stacked_by_role_trains_as_one_device():
  # CAME's state stacked by role (each of TinyLM's stacked weights its own stack),
  # FSDP x tensor and ZeRO-1 over data: the per-leaf CAME's run on one device.
  got = train(make_mesh(data=2, fsdp=2, tensor=2), "came_stacked", zero1=True)
  assert_same_run(got, reference("came"))
  came_state = got[0].opt_state.skip_state.inner_state[1][0]
  qkv = _stacked(came_state, "mu", "stages/qkv/kernel")
  assert qkv.shape[0] == 1  # TinyLM stacks its layers: one leaf a stack
  assert qkv.sharding.spec == P(None, "data", "fsdp", "tensor")  # ZeRO-1: the layers


def test_adafactor_factors_follow_their_dimension():
  square = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
  state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=1).init, square)
  laid = parallel.state_specs(state, square, {"w": P("fsdp", "tensor")})
  (factored,) = [s for s in jax.tree_util.tree_leaves(
      laid, is_leaf=lambda x: isinstance(x, optax.FactoredState))
                 if isinstance(s, optax.FactoredState)]
  assert (factored.v_row["w"], factored.v_col["w"]) == (P("fsdp"), P("tensor"))


class _DeclaredState(NamedTuple):
  """A statistic named "row" that averages over dim 0 (the rows), as declared."""
  row: Any
  averaged_dims = {"row": 0}


class _UndeclaredState(NamedTuple):
  """Statistics whose names say "row" and "col", and nothing declared."""
  row: Any
  col: Any


def test_a_state_declares_which_dimension_a_statistic_averages():
  square = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
  specs = {"w": P("fsdp", "tensor")}
  stat = {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}
  # Dropping either dimension fits the shape; the declaration decides, not the name.
  declared = parallel.state_specs(_DeclaredState(stat), square, specs)
  assert declared.row["w"] == P("tensor")
  # Field names alone decide nothing: undeclared, both take the last fitting one.
  undeclared = parallel.state_specs(_UndeclaredState(stat, stat), square, specs)
  assert (undeclared.row["w"], undeclared.col["w"]) == (P("fsdp"), P("fsdp"))
  # An unambiguous shape needs no declaration.
  wide = {"w": jax.ShapeDtypeStruct((8, 12), jnp.float32)}
  cols = {"w": jax.ShapeDtypeStruct((12,), jnp.float32)}
  laid = parallel.state_specs(_UndeclaredState(stat, cols), wide, specs)
  assert (laid.row["w"], laid.col["w"]) == (P("fsdp"), P("tensor"))


def test_tree_bytes_counts_what_one_device_holds():
  mesh = make_mesh(fsdp=2, tensor=4)
  x = jax.device_put(jnp.zeros((8, 16), jnp.float32),
                     NamedSharding(mesh, P("fsdp", "tensor")))
  assert parallel.tree_bytes(x) == 8 * 16 * 4 // 8
  assert parallel.tree_bytes(x, per_device=False) == 8 * 16 * 4
  shape = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16,
                               sharding=NamedSharding(mesh, P(None, "tensor")))
  assert parallel.tree_bytes(shape) == 8 * 16 * 2 // 4
  # Specs on a mesh decide over the leaves' own layout.
  tree = {"a": shape, "b": jax.ShapeDtypeStruct((6,), jnp.int32)}
  specs = {"a": P("fsdp"), "b": P()}
  assert parallel.tree_bytes(tree, specs, mesh) == 8 * 16 * 2 // 2 + 6 * 4
  assert parallel.bytes_per_device(mesh, tree, specs) == {
      "total": 8 * 16 * 2 + 6 * 4, "per_device": 8 * 16 * 2 // 2 + 6 * 4}
  # None and non-array leaves hold nothing; a leaf without a sharding counts whole.
  mixed = {"a": None, "b": 3, "c": "name", "d": np.zeros((5,), np.float16)}
  assert parallel.tree_bytes(mixed) == 10
  assert parallel.tree_bytes(mixed, per_device=False) == 10
  with pytest.raises(ValueError, match="specs need a mesh"):
    parallel.tree_bytes(tree, specs)


# ------------------------------------------------------------------ collectives


def _collectives(hlo):
  """Collective kind -> list of non-scalar operand shapes, from compiled HLO text."""
  found = collections.defaultdict(list)
  pattern = re.compile(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all)"
                       r"(?:-start)?\(")
  for line in hlo.splitlines():
    m = pattern.search(line)
    if m:
      for shape in re.findall(r"\w+\[[\d,]*\]", m.group(1)):
        if not re.search(r"\[\]", shape):
          found[m.group(2)].append(shape)
  return found


def test_collectives_of_fsdp_and_tensor_step_and_only_scalars_for_the_check():
  mesh = make_mesh(fsdp=4, tensor=2)
  model, (init, step) = make_step(mesh, "adamw")
  state = init(jax.jit(model.init)(jax.random.key(0)))
  step_ops = _collectives(step.lower(state, make_batch()).compile().as_text())
  assert step_ops["all-gather"], "FSDP gathers the parameters for compute"
  # XLA:CPU lowers a reduce-scatter as an all-reduce and a slice; GPU keeps it.
  assert step_ops["all-reduce"] or step_ops["reduce-scatter"]

  # The update alone, on gradients laid out like the parameters: the overflow check,
  # the global and group norms, the clip, the loss scale and AdamW move only scalars.
  tx = make_optimizer("adamw")
  shardings = jax.tree_util.tree_map(lambda x: x.sharding, (state.params,
                                                            state.opt_state))
  update = jax.jit(tx.update, in_shardings=shardings + (shardings[0],),
                   out_shardings=(shardings[0], shardings[1]))
  hlo = update.lower(state.params, state.opt_state, state.params).compile().as_text()
  assert "all-reduce" in hlo  # the per-leaf sums of squares
  # FSDP never splits the stacked layers' dimension, so a stacked bias split over
  # tensor has no dimension left for fsdp: it stays replicated over fsdp while its
  # moments are split, and its update alone is gathered (a bias's worth, ZeRO-1's).
  unsplit = {f"f32[{','.join(map(str, x.sharding.shard_shape(x.shape)))}]"
             for x in jax.tree_util.tree_leaves(state.params)
             if "fsdp" not in parallel.spec_axes(x.sharding.spec)}
  found = _collectives(hlo)
  assert set(found) <= {"all-gather"} and set(found["all-gather"]) <= unsplit, (
      dict(found), unsplit)


def test_sequence_parallel_splits_the_residual_stream_over_the_sequence():
  mesh = make_mesh(tensor=8)
  params = lm_lib.TinyLM.from_sizes(CONFIG).init(jax.random.key(0))
  batch = make_batch()

  def compiled(sp):
    model = lm_lib.TinyLM.from_sizes(CONFIG, shard=lm_lib.ActivationSharding(
        mesh, sequence_parallel=sp))
    return jax.jit(model.hidden_fn).lower(params, batch).compile().as_text()

  # Each device holds the residual stream [batch, seq / 8, d_model] with sequence
  # parallelism, and the whole of it without.
  local = f"f32[{BATCH},{CONFIG.seq_len // 8},{CONFIG.d_model}]"
  assert local in compiled(True)
  assert local not in compiled(False)


# ------------------------------------------------------------------ checkpoints


@pytest.mark.slow  # about 30 s on 2 cores
def test_sharded_checkpoint_restores_onto_another_mesh(tmp_path):
  import orbax.checkpoint as ocp
  from mpscale.trainer.runs import checkpoints

  mesh_a, mesh_b = make_mesh(data=2, fsdp=2, tensor=2), make_mesh(fsdp=4, tensor=2)
  model, (init_a, step_a) = make_step(mesh_a, "adamw", donate=False)
  state = init_a(jax.jit(model.init)(jax.random.key(0)))
  state, _ = step_a(state, make_batch(0))
  with ocp.CheckpointManager(tmp_path) as manager:
    checkpoints.save(manager, 1, state, {"next_index": 1})

  _, (init_b, step_b) = make_step(mesh_b, "adamw")
  fresh = init_b(jax.jit(model.init)(jax.random.key(1)))
  restored, at, data_state = checkpoints.restore_latest(str(tmp_path), fresh)
  assert at == 1 and data_state == {"next_index": 1}
  for x, y in zip(jax.tree_util.tree_leaves(restored),
                  jax.tree_util.tree_leaves(fresh)):
    assert x.sharding == y.sharding  # laid out for mesh B
  # Every saved leaf comes back (the reported group norms are not saved: the next
  # step recomputes them).
  saved, back = checkpoints.checkpoint_tree(state), checkpoints.checkpoint_tree(restored)
  assert saved.keys() == back.keys()
  assert not [k for k in saved if "group_norms" in k or "group_sizes" in k]
  for key in saved:
    np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(saved[key]))
  # And the run goes on the same on either mesh.
  on_a, _ = step_a(state, make_batch(1))
  on_b, _ = step_b(restored, make_batch(1))
  for x, y in zip(jax.tree_util.tree_leaves(on_a.params),
                  jax.tree_util.tree_leaves(on_b.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ bad layouts


def _loss(params, batch):
  return jnp.mean(batch["x"] @ params["w"])


def test_bad_layouts_name_the_leaf_and_axis_before_any_step():
  mesh = make_mesh(fsdp=2, tensor=4)
  params = {"w": jnp.ones((6, 8))}
  tx = optax.sgd(0.1)

  def build(specs):
    init, _ = mpscale.make_train_step(_loss, tx, mesh=mesh, param_specs=specs,
                                      data_axis=("data", "fsdp"))
    return init(params)

  with pytest.raises(ValueError, match=r"'w' dimension 0 \(size 6\) is not divisible "
                     r"by mesh axis 'tensor' \(size 4\)"):
    build({"w": P("tensor")})
  with pytest.raises(ValueError, match="'w' names mesh axis 'model'"):
    build({"w": P(None, "model")})
  with pytest.raises(ValueError, match="'w' uses mesh axis 'fsdp' twice"):
    build({"w": P("fsdp", "fsdp")})
  with pytest.raises(ValueError, match="'w' of shape .* 3 entries for 2 dimensions"):
    build({"w": P(None, None, "fsdp")})
  with pytest.raises(TypeError, match=r"param_specs\('w', leaf\) must return"):
    build(lambda path, leaf: "tensor")
  if hasattr(jax.sharding, "AxisType"):
    explicit = jax.make_mesh((8,), ("data",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match=r"mesh axes \['data'\] are Explicit"):
      mpscale.make_train_step(_loss, tx, mesh=explicit)
  with pytest.raises(ValueError, match="param_specs needs a mesh"):
    mpscale.make_train_step(_loss, tx, param_specs={"w": P()})
  with pytest.raises(mpscale.ArgumentError, match=r"num_heads \(4\) is not divisible "
                     r"by mesh axis 'tensor' \(size 8\)") as err:
    lm_lib.TinyLM.from_sizes(ModelConfig(num_heads=4)).param_specs(make_mesh(tensor=8))
  assert err.value.name == "num_heads"


def test_param_specs_forms_agree():
  mesh = make_mesh(fsdp=2, tensor=4)
  params = {"a": {"w": jnp.ones((4, 8))}, "b": jnp.ones((8,))}
  as_tree = {"a": {"w": P("fsdp", "tensor")}, "b": P()}
  as_prefix = {"a": P("fsdp", "tensor"), "b": None}
  as_function = lambda path, leaf: P("fsdp", "tensor") if leaf.ndim == 2 else P()
  as_logical = parallel.logical_specs(
      {"a": {"w": ("rows", "cols")}, "b": ("cols_again",)},
      [("rows", "fsdp"), ("cols", "tensor")])
  results = [parallel.resolve_specs(f, params)
             for f in (as_tree, as_prefix, as_function, as_logical)]
  for r in results:
    assert r == as_tree
  # A mesh axis is used once per leaf: the second dimension naming it is not split.
  assert parallel.logical_specs(("x", "y"), [("x", "tensor"), ("y", "tensor")]) == (
      P("tensor"))
  fsdp = parallel.fsdp_specs(params, mesh, "fsdp", {"a": {"w": P(None, "tensor")},
                                                    "b": P()})
  assert fsdp == {"a": {"w": P("fsdp", "tensor")}, "b": P("fsdp")}


def test_flax_partitioning_metadata():
  import flax.linen as nn
  from flax import nnx

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = self.param("kernel", nn.with_partitioning(nn.initializers.ones, (None, "tensor")),
                     (4, 8))
      b = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                          ("mlp",)), (8,))
      return x @ k + b

  variables = jax.eval_shape(Linen().init, jax.random.key(0), jnp.ones((1, 4)))
  specs = parallel.flax_specs(variables["params"], rules=[("mlp", "tensor")])
  assert specs == {"kernel": P(None, "tensor"), "bias": P("tensor")}
  assert jax.tree_util.tree_structure(specs) == jax.tree_util.tree_structure(
      parallel.flax_unbox(variables["params"]))

  class Nnx(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("fsdp", None))(
          rngs.params(), (4, 8)))

  mesh = make_mesh(fsdp=2)
  with (jax.set_mesh(mesh) if hasattr(jax, "set_mesh")  # flax >= 0.11 wants a mesh
        else jax.sharding.use_mesh(mesh)):
    state = nnx.state(Nnx(nnx.Rngs(0)), nnx.Param)
  specs = parallel.flax_specs(state)
  assert jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)) == [
      P("fsdp", None)]


# ------------------------------------------------------------------ from a config


@pytest.mark.slow  # about 40 s on 2 cores
def test_the_all_axes_config_trains_like_one_device():
  import dataclasses
  from mpscale.trainer.config import build as builders
  from mpscale.trainer.config import load as config_lib
  from mpscale.trainer.data import text as data_lib

  # float32 and no loss scale, so that one device and eight can agree to 1e-5.
  cfg = config_lib.load_config(
      "configs/tiny_lm_all_axes.yaml",
      ["precision.policy=O0", "loss_scale.kind=none", "train.steps=3",
       # eps that keep the key bias's zero gradient (rounding noise) from
       # deciding its updates; see make_optimizer
       "optimizer.came.eps=[1.0e-8, 1.0e-3, 1.0e-6]",
       "schedule.warmup_steps=1", "model.d_model=32", "model.d_ff=64",
       "model.seq_len=16", "data.batch_size=8"])
  single = dataclasses.replace(cfg, mesh=config_lib.MeshConfig())
  text = data_lib.load_data(single.data.path, single.data.eval_fraction)
  runs = []
  for c in (cfg, single):
    setup = builders.build(c)
    state = setup.init(builders.init_params(c, setup.model))
    for step in range(3):
      batch = text.train_batch(c.seed, step, c.data.batch_size, c.model.seq_len)
      state, metrics = setup.step(state, batch)
    # The pipelined state stores its layers in device order.
    runs.append((jax.device_get(setup.to_model_order(state.params)),
                 jax.device_get(metrics)))
  (sharded, m_sharded), (one, m_one) = runs
  assert set(m_sharded["group_norms"]) == {"embed", "head"} | {
      f"stage_{i}" for i in range(4)}  # one group per virtual stage
  np.testing.assert_allclose(m_sharded["loss"], m_one["loss"], rtol=1e-5)
  np.testing.assert_allclose(m_sharded["global_norm"], m_one["global_norm"], rtol=1e-5)
  for x, y in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(one)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------
# Every public transform, as optax's own sharding sweep runs its optimizers: built
# abstractly, run eagerly and under jit, and on an explicit-sharding mesh, where the
# state's types (shape, dtype and sharding) must not change from one step to the next.

_CAME_STATIC = ("clip_threshold", "decay_rate", "beta1", "beta2", "beta3", "loss_scale",
                "scale_parameter", "relative_step", "warmup_init", "compression",
                "stack_layers")


def _sweep_transforms():
  adamw = lambda: optax.adamw(1e-2)
  lr = mpscale.lr_schedule(1e-2, warmup_steps=1, decay_steps=10, style="cosine")
  wd = mpscale.weight_decay_schedule(0.0, 0.1, 10)
  matrices = lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)
  return {
      "skip_nonfinite": lambda: mpscale.skip_nonfinite(adamw(), norm_groups=1),
      "dynamic(skip_nonfinite)": lambda: mpscale.dynamic_loss_scale(
          mpscale.skip_nonfinite(adamw()), init_scale=4.0, growth_interval=1),
      "skip_nonfinite(fixed)": lambda: mpscale.skip_nonfinite(
          mpscale.fixed_loss_scale(optax.sgd(0.1), 8.0)),
      "fixed(apply overflow)": lambda: mpscale.fixed_loss_scale(
          optax.sgd(0.1), 8.0, skip_nonfinite=False),
      "no_loss_scale(clip, adamw)": lambda: mpscale.no_loss_scale(
          optax.chain(mpscale.global_norm_clip(1.0, norm_groups=1), adamw())),
      # The check is on from step 2 (these updates pass no loss: the norm only).
      "dynamic(skip_spikes(clip, adamw))": lambda: mpscale.dynamic_loss_scale(
          mpscale.skip_spikes(optax.chain(mpscale.global_norm_clip(1.0), adamw()),
                              window=2, watch="global_norm"), init_scale=4.0),
      "global_norm_clip": lambda: mpscale.global_norm_clip(0.5),
      "dynamic(clip, came)": lambda: mpscale.dynamic_loss_scale(
          optax.chain(mpscale.global_norm_clip(1.0), mpscale.came(1e-2)),
          init_scale=2.0 ** 8, hysteresis=2),
      "dynamic(clip, came(stack_layers))": lambda: mpscale.dynamic_loss_scale(
          optax.chain(mpscale.global_norm_clip(1.0),
                      mpscale.came(1e-2, stack_layers=True)),
          init_scale=2.0 ** 8, hysteresis=2),
      "came(beta2, weight decay, mask)": lambda: mpscale.came(
          1e-2, beta2=0.999, weight_decay=0.1, mask=matrices),
      "came(relative_step, warmup_init, scale_parameter)": lambda: mpscale.came(
          relative_step=True, warmup_init=True, scale_parameter=True),
      "came(compression float16, loss_scale)": lambda: mpscale.came(
          1e-2, compression="float16", loss_scale=8.0),
      "came(compression bfloat16)": lambda: mpscale.came(1e-2, compression="bfloat16"),
      "scale_by_came": lambda: optax.chain(mpscale.scale_by_came(),
                                           optax.scale_by_learning_rate(1e-2)),
      "inject_hyperparams(adamw, schedules)": lambda: mpscale.dynamic_loss_scale(
          optax.inject_hyperparams(optax.adamw)(learning_rate=lr, weight_decay=wd)),
      "inject_hyperparams(came, schedules)": lambda: optax.inject_hyperparams(
          mpscale.came, static_args=_CAME_STATIC)(learning_rate=lr, weight_decay=wd),
  }


SWEEP = _sweep_transforms()
# Leaves of every rank, split over the mesh where they can be.
_SWEEP_SPECS = {"w": P(None, "x", None), "m": P("x", None), "b": P("x"), "s": P()}


def _sweep_params():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(2, 8, 4)), "m": rng.normal(size=(8, 6)),
          "b": rng.normal(size=(8,)), "s": np.asarray(0.5)}


# The transforms that skip a non-finite step get a NaN at step 1.
_SKIPS = {"skip_nonfinite", "dynamic(skip_nonfinite)", "skip_nonfinite(fixed)",
          "no_loss_scale(clip, adamw)", "dynamic(clip, came)",
          "dynamic(clip, came(stack_layers))",
          "inject_hyperparams(adamw, schedules)"}


def _sweep_grads(step, params, name):
  """Gradients for step ``step``; at step 1 a NaN for the transforms that skip it."""
  grads = jax.tree.map(lambda p: jnp.sin(p * (step + 1.0)), params)
  if step == 1 and name in _SKIPS:
    b = grads["b"]  # a select keeps an explicit sharding (a scatter would need one)
    # the mask laid out as b: jax 0.7's select refuses a replicated one beside it
    nan_at_3 = jax.device_put(np.arange(b.shape[0]) == 3, b.sharding)
    grads["b"] = jnp.where(nan_at_3, jnp.nan, b)
  return grads


def _scaled(grads, tx_state):
  scale = mpscale.loss_scale_of(tx_state)
  return jax.tree.map(lambda g: g * scale, grads)


def _types(tree):
  """Shape, dtype and sharding spec of every leaf (the spec on an explicit mesh)."""
  def kind(x):
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return (tuple(x.shape), str(x.dtype), None if spec is None else tuple(spec))
  return jax.tree.map(kind, tree)


def _run(name, tx, params, steps, update):
  state = tx.init(params)
  out = []
  for step in range(steps):
    grads = _scaled(_sweep_grads(step, params, name), state)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append((params, state))
  return out


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_sweep_abstract_init_matches_concrete(name):
  tx = SWEEP[name]()
  params = jax.tree.map(jnp.asarray, _sweep_params())
  abstract = jax.eval_shape(tx.init, params)
  concrete = tx.init(params)
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
    assert (a.shape, a.dtype) == (c.shape, c.dtype)


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_sweep_eager_equals_jit_and_keeps_state_types(name):
  tx = SWEEP[name]()
  params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), _sweep_params())
  eager = _run(name, tx, params, 3, tx.update)
  jitted = _run(name, tx, params, 3, jax.jit(tx.update))
  first = _types(tx.init(params))
  for (p_e, s_e), (p_j, s_j) in zip(eager, jitted):
    assert _types(s_j) == first and _types(s_e) == first
    for a, b in zip(jax.tree.leaves((p_e, s_e)), jax.tree.leaves((p_j, s_j))):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=2e-5, atol=1e-6)
  for params_now, _ in jitted:  # nothing non-finite reaches the parameters
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params_now))


def _explicit_mesh():
  if not (hasattr(jax.sharding, "AxisType") and hasattr(jax, "set_mesh")
          and hasattr(jax, "typeof")):
    pytest.skip("explicit sharding needs jax.sharding.AxisType and jax.set_mesh")
  return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the skip's fast path runs too
@pytest.mark.parametrize("name", sorted(SWEEP))
def test_sweep_on_an_explicit_sharding_mesh_keeps_state_types(name):
  mesh = _explicit_mesh()
  tx = SWEEP[name]()
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(jnp.asarray(v, jnp.float32),
                                NamedSharding(mesh, _SWEEP_SPECS[k]))
              for k, v in _sweep_params().items()}
    state = tx.init(params)
    first = _types(state)
    abstract = jax.eval_shape(tx.init, params)
    assert _types(abstract) == first
    update = jax.jit(tx.update)
    for step in range(3):
      grads = _scaled(_sweep_grads(step, params, name), state)
      updates, state = update(grads, state, params)
      assert _types(state) == first, f"step {step}"
      assert _types(updates) == _types(params), f"step {step}"
      params = optax.apply_updates(params, updates)
  # The parameters keep their layout and stay finite.
  for k, spec in _SWEEP_SPECS.items():
    assert tuple(jax.typeof(params[k]).sharding.spec) == tuple(spec)
    assert np.isfinite(np.asarray(params[k])).all()
