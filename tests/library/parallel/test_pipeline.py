"""Tests for mpscale.parallel.pipeline: GPipe and 1F1B against the unpipelined model."""

import dataclasses
import functools
import operator
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mpscale
from tests import helpers
from mpscale import _tree
from mpscale.parallel import pipeline as pl
from mpscale.parallel.pipeline import _run as run_lib
from mpscale.parallel.pipeline import _ticked as ticked_lib

FLOORS = pytest.mark.floors
"""The tests CI runs on the declared floors too (.ci/run): one of each schedule and
layout family, the FP8 state through every schedule, and the errors. The others
exercise the same JAX calls on other shapes, on the newest releases only."""

LAYERS, WIDTH, FEATURES, BATCH = 8, 8, 4, 64


KINDS = ("none", "selective", "full")
"""The kinds of recomputation the grids run (`pl.RECOMPUTE`'s first three): the
named policies (`pl.SAVED_NAMES`) keep what a layer names, and these layers name
nothing."""


def embed_fn(p, b):
  return b["x"] @ p["embed"]


def stage_fn(lp, x):
  return jnp.tanh(x @ lp["w"] + lp["b"])


def head_fn(p, x, b):
  err = jnp.sum((x @ p["head"] - b["y"]) ** 2, axis=-1)
  return jnp.sum(err * b["mask"]), jnp.sum(b["mask"])


def mean_head_fn(p, x, b):
  return jnp.mean((x @ p["head"] - b["y"]) ** 2)


def make_params(seed=0, layers=LAYERS):
  rng = np.random.default_rng(seed)
  f32 = lambda *s, scale=1.0: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
  return {"embed": f32(FEATURES, WIDTH, scale=0.5),
          "stages": {"w": f32(layers, WIDTH, WIDTH, scale=0.4),
                     "b": f32(layers, WIDTH, scale=0.1)},
          "head": f32(WIDTH, 2)}


def make_batch(seed=1, size=BATCH):
  rng = np.random.default_rng(seed)
  # Uneven token masks: some micro-batches and replicas hold far fewer tokens.
  mask = (rng.random(size) < np.linspace(0.1, 0.9, size)).astype(np.float32)
  mask[0] = 1.0
  return {"x": jnp.asarray(rng.normal(size=(size, FEATURES)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(size, 2)), jnp.float32),
          "mask": jnp.asarray(mask)}


def mesh_of(data, stage):
  return Mesh(np.array(jax.devices()[:data * stage]).reshape(data, stage),
              ("data", "stage"))


# The references are compiled (eagerly each op compiles on its own, once per
# parametrized case: most of many cases' time); the arithmetic is the same.
@functools.partial(jax.jit, static_argnames="per_token")
def reference(params, batch, per_token=True):
  model = pl.Pipeline(embed_fn, stage_fn, head_fn if per_token else mean_head_fn, 1)

  def loss(p):
    out = model.apply(p, batch)
    return out[0] / out[1] if per_token else out

  return jax.value_and_grad(loss)(params)


def assert_close(a, b, tol=1e-5):
  helpers.assert_close(a, b, tol)


LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]
MICROS = [1, 2, 4, 8]


def _pairwise_schedules():
  """Every (data x stage) layout with every micro-batch count, each pair once, with
  GPipe and 1F1B alternating so that every schedule meets every layout and every
  micro-batch count twice (all pairs of the three, half of the 32 triples). What a
  triple alone could break, the tables of each (schedule, stages, micro-batches),
  is checked for every triple by `test_schedule_table_is_a_valid_pipeline`."""
  cases = []
  for i, (data, stage) in enumerate(LAYOUTS):
    for j, micro in enumerate(MICROS):
      schedule = ("gpipe", "1f1b")[(i + j) % 2]
      marks = [FLOORS] if (data, stage, micro) == (2, 4, 4) else []
      cases.append(pytest.param(schedule, data, stage, micro, marks=marks))
  return cases


def test_the_pairwise_cases_meet_every_pair():
  cases = [c.values for c in _pairwise_schedules()]
  assert {(d, s, m) for _, d, s, m in cases} == {(d, s, m) for d, s in LAYOUTS
                                                for m in MICROS}
  assert {(k, d, s) for k, d, s, _ in cases} == {(k, d, s) for k in ("gpipe", "1f1b")
                                                for d, s in LAYOUTS}
  assert {(k, m) for k, _, _, m in cases} == {(k, m) for k in ("gpipe", "1f1b")
                                             for m in MICROS}


@pytest.mark.parametrize("schedule, data, stage, micro", _pairwise_schedules())
def test_loss_and_grads_equal_unpipelined(schedule, data, stage, micro):
  params, batch = make_params(), make_batch()
  want_loss, want_grads = reference(params, batch)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, schedule=schedule)
  mesh = mesh_of(data, stage)
  grads, loss, tokens = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh, per_token_loss=True))(params, batch)
  assert float(tokens) == float(batch["mask"].sum())
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_mean_loss_and_loss_scale(schedule):
  params, batch = make_params(), make_batch()
  want_loss, want_grads = reference(params, batch, per_token=False)
  model = pl.Pipeline(embed_fn, stage_fn, mean_head_fn, 4, schedule=schedule)
  grads, loss, count = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(2, 4), loss_scale=1024.0))(params, batch)
  assert float(count) == 8  # 4 micro-batches x 2 replicas
  assert_close(loss, want_loss)
  assert_close(jax.tree.map(lambda g: g / 1024.0, grads), want_grads)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_nan_filled_bubbles_never_reach_gradients(schedule, monkeypatch):
  params, batch = make_params(), make_batch()
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 2, schedule=schedule)
  mesh = mesh_of(2, 4)

  def run(fill):
    monkeypatch.setattr(run_lib, "BUBBLE_FILL", fill)  # read when traced
    # compiled (eagerly, 3-4x the time), one trace a fill
    return jax.jit(lambda p, b: model.value_and_grad(
        p, b, mesh=mesh, per_token_loss=True))(params, batch)

  clean, poisoned = run(0.0), run(float("nan"))
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(poisoned))
  chex.assert_trees_all_equal(clean, poisoned)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
def test_remat_gives_the_same_gradients():
  params, batch = make_params(), make_batch()
  mesh = mesh_of(2, 4)
  plain, remat = [jax.jit(lambda p, b, r=r: pl.Pipeline(
      embed_fn, stage_fn, head_fn, 4, remat=r).value_and_grad(
          p, b, mesh=mesh, per_token_loss=True))(params, batch) for r in (False, True)]
  assert_close(plain, remat, 1e-6)

  def tanh_count(remat):  # the backward recomputes each layer's forward under remat
    model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, remat=remat)
    jaxpr = jax.make_jaxpr(lambda p, b: model.value_and_grad(
        p, b, mesh=mesh, per_token_loss=True))(params, batch)
    return str(jaxpr).count(" tanh ")

  assert tanh_count(True) > tanh_count(False) >= 1


def _schedule_policy_cases():
  """Every schedule under every recompute policy (the pairs that decide what a
  layer keeps and how its backward is rebuilt), each on one of two layouts: data x
  stages with one chunk, and interleaved stages. GPipe and 1F1B meet both layouts
  under two policies of three, and every policy meets both layouts (ZB-H1 runs one
  chunk per stage, so only the first)."""
  plain, interleaved = (2, 4, 4, 1), (1, 2, 4, 2)
  cases = []
  for i, schedule in enumerate(pl.SCHEDULES):
    for j, recompute in enumerate(KINDS):
      layout = plain if schedule == "zb_h1" or (i + j) % 2 else interleaved
      marks = [FLOORS] if (schedule, recompute) == ("zb_h1", "none") else []
      cases.append(pytest.param(schedule, recompute, *layout, marks=marks))
  return cases


def test_the_policy_cases_meet_every_pair():
  cases = [c.values for c in _schedule_policy_cases()]
  assert {(s, r) for s, r, *_ in cases} == {(s, r) for s in pl.SCHEDULES
                                            for r in KINDS}
  for schedule in ("gpipe", "1f1b"):
    assert {v for s, _, _, _, _, v in cases if s == schedule} == {1, 2}
  for recompute in KINDS:
    assert {v for _, r, _, _, _, v in cases if r == recompute} == {1, 2}


@pytest.mark.parametrize("schedule, recompute, data, stage, micro, virtual",
                         _schedule_policy_cases())
def test_every_schedule_and_recompute_policy_equals_unpipelined(
    schedule, recompute, data, stage, micro, virtual):
  params, batch = make_params(), make_batch()
  want_loss, want_grads = reference(params, batch)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, schedule=schedule,
                      recompute=recompute, virtual_stages=virtual)
  grads, loss, _ = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(data, stage), per_token_loss=True))(params, batch)
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


def mlp_stage_fn(lp, x):
  """A layer with two weight products, the second fed by the first."""
  return x + jnp.tanh(x @ lp["w"] + lp["b"]) @ lp["w2"]


def _matmul_flops(schedule, micro, virtual, recompute, stages=4, mlp=False):
  from mpscale.trainer.planning import hlo
  params = make_params()
  if mlp:
    params["stages"]["w2"] = jnp.swapaxes(params["stages"]["w"], 1, 2)
  model = pl.Pipeline(embed_fn, mlp_stage_fn if mlp else stage_fn, head_fn, micro,
                      schedule=schedule, virtual_stages=virtual, recompute=recompute)
  compiled = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(1, stages), per_token_loss=True)).lower(
          params, make_batch(size=8 * micro)).compile()
  return hlo.matmul_flops(compiled.as_text())


@pytest.mark.parametrize("recompute", KINDS)
@pytest.mark.parametrize("virtual", [1, 2])
def test_paired_1f1b_compiles_to_gpipes_matrix_flops(recompute, virtual):
  """Read from the compiled program (loops by trip count, a conditional at its
  costliest branch): 1F1B's paired ticks cost GPipe's matrix work on the same model,
  S, M, v and recompute policy (lock-step ticks that alternated F and B cost twice
  it)."""
  gpipe = _matmul_flops("gpipe", 16, virtual, recompute)
  assert _matmul_flops("1f1b", 16, virtual, recompute) <= 1.1 * gpipe


@pytest.mark.parametrize("recompute", KINDS)
def test_zb_h1_compiles_to_gpipes_matrix_flops(recompute):
  """ZB-H1 runs one of F, B and W a tick, and W is the weight side of each matrix
  product alone (`mpscale.parallel.pipeline`), so each costs about a forward: within
  10% of GPipe's work on layers of two products (1.02x; a W that took the layer's
  whole pullback redid the second's input side to reach the first: 1.17x). Under
  full recomputation B also recomputes the forward, and a lock-step tick lasts as
  long as the B some stage runs: within 20% (1.11x; 1.36x before)."""
  gpipe = _matmul_flops("gpipe", 16, 1, recompute, mlp=True)
  bound = 1.2 if recompute == "full" else 1.1
  assert _matmul_flops("zb_h1", 16, 1, recompute, mlp=True) <= bound * gpipe


def test_recompute_policies_keep_what_they_say():
  """The residuals kept per micro-batch shrink from none to selective to full (each
  layer's input alone), and none of them is a copy of the layer's parameters."""
  mesh = mesh_of(1, 4)

  def kept(recompute):
    model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule="1f1b",
                        recompute=recompute)
    shapes = {}

    def capture(run, params):
      ops = ticked_lib.Ticks(run, params)
      shapes["kept"] = ops.residual_shapes()
      return ticked_lib.ticked(run, params)
    original = model._executor
    object.__setattr__(model, "_executor", lambda: capture)
    try:
      # traced only: the residuals are read while tracing (no program to run)
      jax.eval_shape(lambda p, b: model.value_and_grad(
          p, b, mesh=mesh, per_token_loss=True), make_params(), make_batch())
    finally:
      object.__setattr__(model, "_executor", original)
    return [tuple(s.shape) for s in shapes["kept"]]

  rows = BATCH // 4
  full, selective, none = kept("full"), kept("selective"), kept("none")
  assert full == [(rows, WIDTH)]                     # the layer's input
  assert len(none) > len(selective) > len(full)
  assert (WIDTH, WIDTH) not in none + selective + full  # the weights are not kept


def test_residual_bytes_follow_the_schedule_and_the_policy():
  """`Pipeline.residual_bytes`: a layer keeps less from none to selective to full;
  1F1B holds its item slots (2S - 1 at most), GPipe every tick; ZB-H1's layer keeps
  its weight products' inputs and output cotangents as well."""
  params, batch, mesh = make_params(), make_batch(), mesh_of(1, 4)

  def report(schedule, recompute, micro=8, v=1):
    model = pl.Pipeline(embed_fn, mlp_stage_fn, head_fn, micro, schedule=schedule,
                        recompute=recompute, virtual_stages=v)
    p = {**params, "stages": {**params["stages"], "w2": params["stages"]["w"]}}
    return model.residual_bytes(p, batch, mesh=mesh, per_token_loss=True)

  layer = {r: report("1f1b", r)["layer"] for r in KINDS}
  rows = BATCH // 8
  assert layer["full"] == rows * WIDTH * 4            # the layer's input, float32
  assert layer["none"] > layer["selective"] > layer["full"]
  one = report("1f1b", "none")
  assert (one["items"], one["layers"]) == (7, 2)      # min(M, 2S - 1), 8 layers / 4
  assert one["total"] == 7 * 2 * one["layer"]
  assert report("gpipe", "none")["items"] == 8 + 4 - 1
  # Interleaved: an item is one chunk's pass (8 layers / 4 stages / 2 chunks), and the
  # slots are shared by the chunks: (v + 1) S - 1 items alive, and one slot more where
  # an embedded item waits for a slot freed at the end of its tick.
  two = report("1f1b", "none", v=2)
  assert two["layers"] == 1 and 3 * 4 - 1 <= two["items"] <= 3 * 4
  assert two["total"] == two["items"] * one["layer"]
  assert report("gpipe", "none", v=2)["items"] == 2 * 8 + 4 - 1
  zb = report("zb_h1", "full")
  # + inputs (x: kept already, tanh(x w + b)) + output cotangents (two [rows, WIDTH])
  assert zb["layer"] == layer["full"] + 3 * rows * WIDTH * 4
  assert zb["items"] == 4                              # min(S, M)


def test_recompute_layers_recomputes_the_first_layers_of_a_stage():
  """``recompute_layers=k`` (Megatron-LM's ``recompute_num_layers``): a stage's
  first ``k`` layers run under the policy and the rest keep their residuals, so
  the backward keeps what ``none`` keeps with ``k = 0``, what ``full`` keeps with
  all of them, and strictly between with some; alike in a chunk of interleaved
  stages (`layers_of_chunk`)."""
  from mpscale.parallel.pipeline import _gpipe as gpipe_lib
  params, batch = make_params(), make_batch()
  x = embed_fn(params, batch)
  stage = jax.tree.map(lambda a: a[:4], params["stages"])      # a stage of 4 layers
  chunks = jax.tree.map(lambda a: a.reshape((2, 4) + a.shape[1:]), params["stages"])

  def kept(**kwargs):
    pipe = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, **kwargs)
    return (helpers.kept_bytes(lambda p: jnp.sum(pipe._layers(p, x)), stage),
            helpers.kept_bytes(lambda p: jnp.sum(gpipe_lib.layers_of_chunk(
                pipe, p, jnp.int32(1), x, None)), chunks))
  for where, (none, full, *by_k) in enumerate(zip(
      kept(), kept(recompute="full"),
      *(kept(recompute="full", recompute_layers=k) for k in (0, 2, 4)))):
    assert by_k[0] == none > by_k[1] > by_k[2] == full, (where, none, by_k, full)


@pytest.mark.parametrize("data, stage, virtual", [(2, 4, 1), (1, 2, 2)])
def test_recompute_layers_under_gpipe_equals_unpipelined(data, stage, virtual):
  params, batch = make_params(), make_batch()
  want_loss, want_grads = reference(params, batch)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute="full",
                      virtual_stages=virtual, recompute_layers=1)
  grads, loss, _ = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(data, stage), per_token_loss=True))(params, batch)
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


def test_bad_recompute_layers_names_the_argument():
  with pytest.raises(mpscale.ArgumentError, match="recompute='none' recomputes "
                     "nothing") as err:
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute_layers=1)
  assert err.value.names == ("recompute_layers", "recompute")
  with pytest.raises(ValueError, match="recompute_layers"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute="full", recompute_layers=-1)
  with pytest.raises(TypeError, match="recompute_layers"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute="full", recompute_layers=1.5)
  with pytest.raises(mpscale.ArgumentError, match="'gpipe'") as err:
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule="1f1b", recompute="full",
                recompute_layers=1)
  assert err.value.names == ("recompute_layers", "schedule")
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute="full",
                      recompute_layers=3)
  with pytest.raises(ValueError, match=r"=3: there are 2 layers to recompute \(a stage's"):
    model.value_and_grad(make_params(), make_batch(), mesh=mesh_of(2, 4),
                         per_token_loss=True)


@FLOORS
def test_bad_recompute_names_the_argument():
  with pytest.raises(ValueError, match="recompute"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute="some")
  with pytest.raises(mpscale.ArgumentError, match="remat") as err:
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, remat=True, recompute="selective")
  assert err.value.names == ("remat", "recompute")
  policy = jax.checkpoint_policies.dots_saveable  # a policy of one's own is taken
  assert pl.Pipeline(embed_fn, stage_fn, head_fn, 4, recompute=policy).policy() is policy


def _train(params, batch, tx, grad_fn, steps=5):
  @jax.jit
  def step(params, opt_state):
    scale = mpscale.loss_scale_of(opt_state)
    loss, grads = grad_fn(params, batch, scale)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(loss)
  return params, opt_state, losses


def _optimizer(stages):
  groups = pl.stage_norm_groups(stages)
  return mpscale.dynamic_loss_scale(
      optax.chain(mpscale.global_norm_clip(0.5, norm_groups=groups), optax.adam(1e-2)),
      init_scale=2.0**8, norm_groups=groups)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
@pytest.mark.parametrize("schedule, data, stage, micro", [
    ("gpipe", 1, 8, 8), ("gpipe", 2, 4, 2), ("1f1b", 4, 2, 4), ("1f1b", 2, 4, 8),
    ("1f1b", 8, 1, 1)])
def test_five_steps_match_unpipelined(schedule, data, stage, micro):
  params, batch = make_params(), make_batch()
  tx = _optimizer(stage)

  def ref_grads(p, b, scale):
    loss, grads = reference(p, b)
    return loss, jax.tree.map(lambda g: g * scale, grads)

  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, schedule=schedule)
  mesh = mesh_of(data, stage)

  def pipe_grads(p, b, scale):
    grads, loss, _ = model.value_and_grad(p, b, mesh=mesh, loss_scale=scale,
                                          per_token_loss=True)
    return loss, grads

  want = _train(params, batch, tx, ref_grads)
  got = _train(model.shard_params(params, mesh), batch, tx, pipe_grads)
  assert_close(got[2], want[2])
  assert_close(got[0], want[0])
  assert_close(got[1], want[1])
  metrics = mpscale.step_metrics(got[1])
  assert set(metrics["group_norms"]) == {"embed", "head"} | {
      f"stage_{i}" for i in range(stage)}
  stage_sq = sum(float(metrics["group_norms"][f"stage_{i}"]) ** 2 for i in range(stage))
  np.testing.assert_allclose(
      stage_sq + sum(float(metrics["group_norms"][k]) ** 2 for k in ("embed", "head")),
      float(metrics["global_norm"]) ** 2, rtol=1e-5)
  assert int(metrics["group_sizes"]["stage_0"]) == LAYERS // stage * (WIDTH * WIDTH +
                                                                      WIDTH)


@FLOORS
def test_overflow_in_one_stage_makes_every_stage_and_replica_skip():
  params, batch = make_params(), make_batch()
  mesh = mesh_of(2, 4)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 2, schedule="1f1b")
  tx = _optimizer(4)
  params = model.shard_params(params, mesh)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    grads, _, _ = model.value_and_grad(params, batch, mesh=mesh, per_token_loss=True,
                                       loss_scale=mpscale.loss_scale_of(opt_state))
    # Layer 5 lives on stage 2 only.
    grads["stages"]["w"] = grads["stages"]["w"].at[5, 0, 0].set(jnp.inf)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  new_params, new_state = step(params, opt_state)
  m = mpscale.step_metrics(new_state)
  assert bool(m["overflow"]) and int(m["skipped"]) == 1
  assert np.isinf(m["group_norms"]["stage_2"]) and np.isfinite(m["group_norms"]["stage_0"])
  for new, old in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    shards = {str(s.index): np.asarray(s.data) for s in new.addressable_shards}
    for s in new.addressable_shards:  # every copy of a slice is identical
      np.testing.assert_array_equal(np.asarray(s.data), shards[str(s.index)])


def _loop_bodies(hlo: str) -> dict[str, str]:
  """Computation name -> text, for every while-loop body and what it calls."""
  comps = {}
  for block in re.split(r"\n(?=\S)", hlo):
    m = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
    if m:
      comps[m.group(1)] = block
  todo = re.findall(r"body=%?([\w.\-]+)", hlo)
  seen = {}
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen[name] = comps[name]
    todo += re.findall(r"(?:to_apply|calls|body|condition|branch_computations)="
                       r"\{?%?([\w.\-]+)", comps[name])
    todo += re.findall(r"branch_computations=\{([^}]*)\}", comps[name]) and [
        n.strip().lstrip("%") for n in re.findall(
            r"branch_computations=\{([^}]*)\}", comps[name])[0].split(",")] or []
  return seen


@FLOORS
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_all_reduce_inside_the_pipeline_loop(schedule):
  params, batch = make_params(), make_batch()
  mesh = mesh_of(2, 4)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule=schedule)
  hlo = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh, per_token_loss=True)).lower(params, batch).compile().as_text()
  bodies = _loop_bodies(hlo)
  assert bodies, "expected a while loop"
  assert any("collective-permute" in text for text in bodies.values())
  assert not [n for n, text in bodies.items() if "all-reduce" in text]
  assert "all-reduce" in hlo  # the gradient sums do happen, after the loop


def _temp_bytes_and_size(schedule, micro, virtual=1, recompute="none"):
  batch = make_batch(size=16 * micro)  # fixed micro-batch size, growing M
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, schedule=schedule,
                      virtual_stages=virtual, recompute=recompute)
  mesh = mesh_of(1, 4)
  compiled = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh, per_token_loss=True)).lower(make_params(), batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes, len(compiled.as_text())


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_1f1b_memory_stays_flat_while_gpipe_grows(recompute):
  """From M = 2S on, 1F1B and ZB-H1 keep a bounded number of micro-batches'
  residuals (2S - 1 and S a stage; interleaved (v + 1) S - 1): compiled temp memory
  at 4M is that at M, and below GPipe's, which keeps all M."""
  def temp(schedule, micro, virtual=1):
    return _temp_bytes_and_size(schedule, micro, virtual, recompute)

  S = 4
  gpipe = [temp("gpipe", m) for m in (2 * S, 8 * S)]
  assert gpipe[1][0] > 1.6 * gpipe[0][0]
  for schedule, v in (("1f1b", 1), ("zb_h1", 1), ("1f1b", 2)):
    flat = [temp(schedule, m, v) for m in (2 * S, 8 * S)]
    assert flat[1][0] < 1.1 * flat[0][0], (schedule, v)
    assert flat[1][0] < temp("gpipe", 8 * S, v)[0], (schedule, v)
    assert flat[1][1] < 1.05 * flat[0][1]  # a scan: the program does not grow with M
  assert temp("1f1b", 2 * S)[0] < gpipe[0][0]  # already at M = 2S


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, micro, virtual", [
    (1, 1, 1), (2, 3, 1), (4, 8, 1), (4, 1, 1), (3, 7, 1),
    (2, 2, 2), (2, 4, 4), (2, 8, 2), (4, 4, 2), (4, 16, 2), (4, 8, 4), (3, 6, 3)])
def test_schedule_table_is_a_valid_pipeline(schedule, stages, micro, virtual):
  """Every virtual stage c S + s runs F and B of every micro-batch once, after its
  inputs (the virtual stage below, the one above), one tick per hop (the last
  virtual stage's B in its F's tick, slot 1 after slot 0); the bubble is Megatron's;
  the inputs alive per device stay within the schedule's bound. 1F1B's ticks pair:
  every tick where any stage runs a forward and any a backward is a tick of both,
  and a step costs GPipe's forward and backward ticks."""
  S, M, v = stages, micro, virtual
  table = pl.pipeline_schedule_table(schedule, S, M, v)
  chunks = pl.pipeline_schedule_chunks(schedule, S, M, v)
  when = {}
  for t, row in enumerate(table):
    for s in range(S):
      for k, (op, m) in enumerate(row[s]):
        if op != pl.IDLE:
          key = (op, chunks[t, s, k] * S + s, m)
          assert key not in when
          assert k == (0 if op == pl.FWD else 1)
          when[key] = (t, k)
  assert len(when) == 2 * S * v * M
  last = S * v - 1
  for (op, vs, m), t in when.items():
    if op == pl.FWD and vs > 0:
      assert when[(pl.FWD, vs - 1, m)][0] < t[0]
    if op == pl.BWD:
      assert when[(pl.FWD, vs, m)] < t
      if vs < last:
        assert when[(pl.BWD, vs + 1, m)][0] < t[0]
  assert pl.pipeline_bubble_fraction(table) == pytest.approx((S - 1) / (v * M + S - 1))
  from mpscale.parallel.pipeline import _schedules as ps
  assert ps.tick_costs(table).sum() == 3 * (v * M + S - 1)  # GPipe's F + B ticks
  live = pl.live_slots(table)
  if schedule == "gpipe":
    assert live == v * M
  else:  # a hop a tick: 2 (S v - 1 - vs) + 1 ticks alive, whatever M
    assert live <= min(v * M, 2 * S - 1 if v == 1 else (v + 1) * S - 1)


def test_interleaved_1f1b_keeps_its_inputs_bounded_as_m_grows():
  """From the tables: interleaved 1F1B's inputs alive stop growing at (v + 1) S - 1
  while interleaved GPipe's grow as v M."""
  for S, v in ((2, 2), (4, 2), (4, 4)):
    bound = (v + 1) * S - 1
    lives = [pl.live_slots(pl.pipeline_schedule_table("1f1b", S, M, v))
             for M in (S, 2 * S, 4 * S, 8 * S)]
    assert max(lives) <= bound and lives[-1] == lives[-2]
    assert pl.live_slots(pl.pipeline_schedule_table("gpipe", S, 8 * S, v)) == 8 * S * v


@FLOORS
def test_clear_errors():
  params, batch = make_params(), make_batch()
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4)
  with pytest.raises(ValueError, match="not divisible by 3 stages"):
    model.value_and_grad(params, batch, mesh=Mesh(
        np.array(jax.devices()[:3]).reshape(1, 3), ("data", "stage")))
  with pytest.raises(ValueError, match="num_microbatches"):
    model.value_and_grad(params, make_batch(size=12), mesh=mesh_of(2, 4))
  with pytest.raises(ValueError, match="stage axis"):
    model.value_and_grad(params, batch, mesh=Mesh(np.array(jax.devices()), ("data",)))
  with pytest.raises(ValueError, match="num_microbatches"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 0)
  with pytest.raises(ValueError, match="schedule"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 2, schedule="zb")
  with pytest.raises(TypeError, match="stage_fn"):
    pl.Pipeline(embed_fn, None, head_fn, 2)
  with pytest.raises(TypeError, match="per_token_loss"):
    pl.Pipeline(embed_fn, stage_fn, mean_head_fn, 2).value_and_grad(
        params, batch, mesh=mesh_of(2, 4), per_token_loss=True)


@FLOORS
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_make_train_step_with_a_pipeline_matches_the_plain_step(schedule):
  params, batch = make_params(), make_batch()
  tx = _optimizer(4)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule=schedule)
  mesh = mesh_of(2, 4)
  init, step = mpscale.make_train_step(model, tx, mesh=mesh, per_token_loss=True)
  ref_init, ref_step = mpscale.make_train_step(model.apply, tx, per_token_loss=True)
  state, ref_state = init(params), ref_init(params)
  assert state.params["stages"]["w"].sharding.spec == jax.sharding.PartitionSpec(
      "stage")
  mu = state.opt_state.skip_state.inner_state[1][0].mu  # adam's first moment
  assert mu["stages"]["w"].sharding.spec == jax.sharding.PartitionSpec("stage")
  for _ in range(5):
    state, metrics = step(state, batch)
    ref_state, ref_metrics = ref_step(ref_state, batch)
  assert_close(state.params, ref_state.params)
  assert_close(state.opt_state, ref_state.opt_state)
  for key in ("loss", "num_tokens", "global_norm", "group_norms", "loss_scale"):
    assert_close(metrics[key], ref_metrics[key])
  assert "stage_3" in metrics["group_norms"]
  assert step._cache_size() == 1


@FLOORS
def test_make_train_step_pipeline_errors():
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4)
  tx = optax.sgd(0.1)
  with pytest.raises(ValueError, match="stage axis"):
    mpscale.make_train_step(model, tx, mesh=Mesh(np.array(jax.devices()), ("data",)))
  with pytest.raises(ValueError, match="disagrees"):
    mpscale.make_train_step(model, tx, mesh=mesh_of(2, 4), num_microbatches=2)
  with pytest.raises(ValueError, match=r"layer axis of every leaf is split over "
                     r"'stage'"):
    init, _ = mpscale.make_train_step(model, tx, mesh=mesh_of(2, 4),
                                      param_specs={"stages": P("data"), "embed": P(),
                                                   "head": P()})
    init(make_params())


@pytest.mark.parametrize("virtual, micro", [(2, 4), (4, 4), (2, 8)])
def test_interleaved_stages_equal_unpipelined(virtual, micro):
  params, batch = make_params(), make_batch()
  want_loss, want_grads = reference(params, batch)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, virtual_stages=virtual)
  grads, loss, tokens = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(2, 4 if LAYERS // virtual >= 4 else 2), per_token_loss=True)
                                )(params, batch)
  assert float(tokens) == float(batch["mask"].sum())
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


INTERLEAVED_1F1B = [(S, v, k * S) for S in (2, 4) for v in (2, 4) for k in (1, 2, 4)]
"""Stages x virtual stages x micro-batches (S, 2S, 4S); 16 layers hold 4 x 4."""


@pytest.mark.parametrize("stages, virtual, micro", [
    pytest.param(*case, marks=[] if case in ((2, 2, 4), (4, 2, 4), (4, 4, 8))
                 else [pytest.mark.slow]) for case in INTERLEAVED_1F1B])
def test_interleaved_1f1b_equals_unpipelined(stages, virtual, micro):
  params, batch = make_params(layers=16), make_batch()
  want_loss, want_grads = reference(params, batch)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, schedule="1f1b",
                      virtual_stages=virtual)
  grads, loss, tokens = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(8 // stages, stages), per_token_loss=True))(params, batch)
  assert float(tokens) == float(batch["mask"].sum())
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaved_1f1b_trains_as_the_plain_step_and_skips_a_poisoned_batch(
    virtual):
  """Five steps equal the unpipelined step's (params, optimizer state, metrics); a
  batch with a NaN in one micro-batch is skipped everywhere: no parameter or state
  moves on any stage."""
  params, batch = make_params(layers=16), make_batch()
  tx = _optimizer(4 * virtual)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule="1f1b",
                      virtual_stages=virtual)
  init, step = mpscale.make_train_step(model, tx, mesh=mesh_of(2, 2),
                                       per_token_loss=True)
  ref_init, ref_step = mpscale.make_train_step(model.apply, tx, per_token_loss=True)
  state, ref_state = init(params), ref_init(params)
  for _ in range(5):
    state, metrics = step(state, batch)
    ref_state, ref_metrics = ref_step(ref_state, batch)
  assert_close(state.params, ref_state.params)
  assert_close(state.opt_state, ref_state.opt_state)
  for key in ("loss", "num_tokens", "global_norm", "loss_scale"):
    assert_close(metrics[key], ref_metrics[key])
  poisoned = dict(batch, x=batch["x"].at[BATCH // 2 + 3].set(jnp.nan))
  before = jax.device_get(state)
  state, metrics = step(state, poisoned)
  assert bool(metrics["overflow"]) and int(metrics["skipped"]) == 1
  chex.assert_trees_all_equal(jax.device_get(state.params), before.params)
  chex.assert_trees_all_equal(
      _tree.find(jax.device_get(state.opt_state),
                             optax.ScaleByAdamState),
      _tree.find(before.opt_state, optax.ScaleByAdamState))


@pytest.mark.parametrize("stages, virtual, micro", [(4, 2, 4), (2, 4, 6), (4, 1, 8),
                                                    (3, 3, 3)])
def test_interleaved_bubble_is_megatrons(stages, virtual, micro):
  S, v, M = stages, virtual, micro
  table = pl.pipeline_schedule_table("gpipe", S, M, virtual_stages=v)
  assert pl.pipeline_bubble_fraction(table) == pytest.approx((S - 1) / (v * M + S - 1))
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, M, virtual_stages=v)
  assert model.bubble(S) == pytest.approx((S - 1) / (v * M + S - 1))
  # Every micro-batch runs forward and backward through each of the v chunks once.
  for op in (pl.FWD, pl.BWD):
    counts = np.bincount(table[..., 1][table[..., 0] == op], minlength=M)
    assert (counts == S * v).all()


@FLOORS
def test_interleaved_clear_errors():
  params, batch = make_params(), make_batch()
  with pytest.raises(ValueError, match="virtual_stages must be"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, virtual_stages=0)
  with pytest.raises(ValueError, match="num_microbatches .6. divisible by the 4"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 6, virtual_stages=2).value_and_grad(
        params, make_batch(size=12), mesh=mesh_of(1, 4), per_token_loss=True)
  with pytest.raises(ValueError, match="not divisible by 4 stages x 4 virtual"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, virtual_stages=4).value_and_grad(
        params, batch, mesh=mesh_of(2, 4), per_token_loss=True)


# ------------------------------------------------------------------ layer order


def _collective_kinds(hlo):
  return set(re.findall(r"(all-to-all|all-gather|collective-permute|all-reduce|"
                        r"reduce-scatter)(?:-start)?\(", hlo))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layers_stored_in_device_order_move_no_parameter(schedule):
  """Model order: the step gathers the stage parameters into device order (an
  all-gather here, an all-to-all elsewhere) and their gradients back. Device order:
  no such collective, the same gradients (in device order)."""
  params, batch = make_params(layers=16), make_batch()
  want_loss, want_grads = reference(params, batch)
  mesh = mesh_of(2, 4)
  kinds = {}
  for order in ("model", "device"):
    model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule=schedule,
                        virtual_stages=2, layer_order=order,
                        num_stages=4 if order == "device" else None)
    stored = model.shard_params(
        model.to_device_order(params) if order == "device" else params, mesh)
    fn = jax.jit(lambda p, b: model.value_and_grad(p, b, mesh=mesh,
                                                   per_token_loss=True))
    kinds[order] = _collective_kinds(fn.lower(stored, batch).compile().as_text())
    grads, loss, _ = fn(stored, batch)
    assert_close(loss, want_loss)
    assert_close(model.to_model_order(grads) if order == "device" else grads,
                 want_grads)
    out = model.apply(stored, batch)  # apply reads the stored order
    assert_close(out[0] / out[1], want_loss)
  assert kinds["model"] & {"all-gather", "all-to-all"}
  assert not kinds["device"] & {"all-gather", "all-to-all"}
  assert "collective-permute" in kinds["device"]  # the activations still move


def test_device_order_round_trips_a_state_and_names_its_groups():
  S, v = 2, 2
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 2, virtual_stages=v,
                      layer_order="device", num_stages=S)
  params = make_params()
  state = {"params": params, "opt": optax.adam(1e-3).init(params),
           "nested": {"copy": params}}
  stored = model.to_device_order(state)
  chex.assert_trees_all_equal(model.to_model_order(stored), state)
  # Device s holds its chunks s, s + S contiguous: position (s v + c) n + k holds
  # model layer (c S + s) n + k, n = 2 layers a chunk.
  w = np.asarray(params["stages"]["w"])
  got = np.asarray(stored["params"]["stages"]["w"])
  for s in range(S):
    for c in range(v):
      for k in range(2):
        np.testing.assert_array_equal(got[(s * v + c) * 2 + k], w[(c * S + s) * 2 + k])
  # Any params-shaped tree inside the state moves alike (an optimizer's moments).
  chex.assert_trees_all_equal(stored["nested"]["copy"], stored["params"])
  chex.assert_trees_all_equal(stored["params"]["embed"], params["embed"])
  # The groups keep the virtual stages' names wherever their layers are stored.
  by_model, _ = mpscale.group_norms(params, pl.stage_norm_groups(S * v))
  by_device, _ = mpscale.group_norms(
      model.to_device_order(params),
      pl.stage_norm_groups(S, virtual_stages=v, layer_order="device"))
  assert_close(by_device, by_model)


@FLOORS
def test_layer_order_errors_name_the_argument():
  with pytest.raises(mpscale.ArgumentError, match="layer_order='device' needs "
                     "num_stages") as err:
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, virtual_stages=2,
                layer_order="device")
  assert err.value.names == ("layer_order", "num_stages")
  with pytest.raises(ValueError, match="layer_order"):
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, layer_order="stage")
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 4, virtual_stages=2,
                      layer_order="device", num_stages=2)
  with pytest.raises(ValueError, match="num_stages=2 .* the mesh has 4 stages"):
    model.value_and_grad(make_params(), make_batch(), mesh=mesh_of(2, 4),
                         per_token_loss=True)


# ------------------------------------------------------------------ ZB-H1


@pytest.mark.parametrize("stages, micro", [(1, 1), (2, 1), (2, 2), (3, 7), (4, 3),
                                           (4, 8), (4, 16), (8, 32)])
def test_zb_h1_table_splits_the_backward_and_fills_1f1bs_bubble(stages, micro):
  """Every stage runs F, B (input gradient) and W (weight gradient) of every
  micro-batch once, B after the stage above's B, W after its own B; the bubble is
  ZB-H1's (S - 1)/(3M + S - 1) once M >= S, below 1F1B's whenever S > 1, with no
  more inputs alive than 1F1B's peak."""
  S, M = stages, micro
  table = pl.pipeline_schedule_table("zb_h1", S, M)
  assert (table[:, :, 1, 0] == pl.IDLE).all()  # one op a tick, in slot 0
  when = {}
  for t, row in enumerate(table):
    for s, (op, m) in enumerate(row[:, 0]):
      if op != pl.IDLE:
        assert (op, s, m) not in when
        when[(op, s, m)] = t
  assert len(when) == 3 * S * M
  for (op, s, m), t in when.items():
    if op == pl.FWD and s > 0:
      assert when[(pl.FWD, s - 1, m)] < t
    if op == pl.BWD:
      assert when[(pl.BWD, s + 1, m) if s < S - 1 else (pl.FWD, s, m)] < t
    if op == pl.WGT:
      assert when[(pl.BWD, s, m)] < t
  zb = pl.pipeline_bubble_fraction(table)
  ofob = pl.pipeline_bubble_fraction(pl.pipeline_schedule_table("1f1b", S, M))
  if M >= S:
    assert zb == pytest.approx((S - 1) / (3 * M + S - 1))
  assert zb < ofob if S > 1 else zb == ofob == 0
  assert pl.live_slots(table) <= min(S, M)


@pytest.mark.parametrize("data, stage, micro", [
    (2, 4, 4), (1, 8, 8), (4, 2, 1), (2, 4, 2), (8, 1, 1), (1, 8, 2)])
def test_zb_h1_equals_unpipelined(data, stage, micro):
  params, batch = make_params(), make_batch()
  want_loss, want_grads = reference(params, batch)
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, micro, schedule="zb_h1")
  grads, loss, tokens = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(data, stage), per_token_loss=True))(params, batch)
  assert float(tokens) == float(batch["mask"].sum())
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


@FLOORS
def test_zb_h1_runs_one_chunk_per_stage():
  with pytest.raises(mpscale.ArgumentError, match="zb_h1.* virtual_stages must be 1"
                     ) as err:
    pl.Pipeline(embed_fn, stage_fn, head_fn, 4, schedule="zb_h1", virtual_stages=2)
  assert err.value.names == ("schedule", "virtual_stages")
  with pytest.raises(ValueError, match="virtual_stages=1"):
    pl.pipeline_schedule_table("zb_h1", 2, 4, virtual_stages=2)


def test_interleaved_gpipe_keeps_the_stacked_layers_once_not_per_tick():
  """Autodiff of the tick loop kept each tick's chunk of the stacked parameters
  (v M + S - 1 copies); the chunk is now picked again in the backward. With wide
  layers (a chunk's parameters 4 MiB a device) the compiled temp memory grows far
  less than 4 MiB per extra tick from M = 8 to M = 32."""
  width, S, v = 256, 4, 2

  def wide_stage(lp, x):
    return x + jnp.tanh(x @ lp["w1"]) @ lp["w2"]

  rng = np.random.default_rng(0)
  layers = S * v * 2
  params = {"embed": jnp.asarray(rng.normal(size=(FEATURES, width)) * 0.1, jnp.float32),
            "stages": {"w1": jnp.zeros((layers, width, 4 * width), jnp.float32),
                       "w2": jnp.zeros((layers, 4 * width, width), jnp.float32)},
            "head": jnp.zeros((width, 2), jnp.float32)}
  mesh = mesh_of(1, S)
  temp = {}
  for micro in (8, 32):
    batch = make_batch(size=4 * micro)
    model = pl.Pipeline(embed_fn, wide_stage, head_fn, micro, virtual_stages=v)
    temp[micro] = jax.jit(lambda p, b: model.value_and_grad(
        p, b, mesh=mesh, per_token_loss=True)).lower(params, batch).compile(
        ).memory_analysis().temp_size_in_bytes
  chunk_bytes = 2 * 2 * width * 4 * width * 4  # 2 layers of w1 and w2, float32
  assert temp[32] - temp[8] < 0.1 * 24 * v * chunk_bytes


# ------------------------------------------------------------------ encoder-decoder

SRC, TGT = 5, 3


def enc_embed_fn(p, b):
  return b["src"] @ p["embed"]


def enc_layer_fn(lp, x):
  return x + jnp.tanh(x @ lp["w"] + lp["b"])


def dec_embed_fn(p, b):
  return b["tgt"] @ p["dec_embed"]


def dec_layer_fn(lp, y, memory):
  return y + jnp.tanh(y @ lp["w"] + jnp.mean(memory, axis=1, keepdims=True) @ lp["m"])


def seq2seq_head_fn(p, y, b):
  err = jnp.sum((y @ p["head"] - b["out"]) ** 2, axis=-1)
  return jnp.sum(err * b["mask"]), jnp.sum(b["mask"])


def seq2seq_params(encoder_layers, decoder_layers, seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
  return {"embed": f32(FEATURES, WIDTH), "dec_embed": f32(FEATURES, WIDTH),
          "head": f32(WIDTH, 2),
          "encoder": {"w": f32(encoder_layers, WIDTH, WIDTH),
                      "b": f32(encoder_layers, WIDTH, scale=0.1)},
          "decoder": {"w": f32(decoder_layers, WIDTH, WIDTH),
                      "m": f32(decoder_layers, WIDTH, WIDTH)}}


def seq2seq_batch(rows=16, seed=1):
  rng = np.random.default_rng(seed)
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return {"src": f32(rows, SRC, FEATURES), "tgt": f32(rows, TGT, FEATURES),
          "out": f32(rows, TGT, 2),
          "mask": jnp.asarray((rng.random((rows, TGT)) < 0.7).astype(np.float32))}


@jax.jit
def seq2seq_reference(params, batch):
  """The encoder-decoder by hand, layer by layer (compiled, as `reference`)."""
  def loss(p):
    x = enc_embed_fn(p, batch)
    for i in range(p["encoder"]["w"].shape[0]):
      x = enc_layer_fn(jax.tree.map(lambda a: a[i], p["encoder"]), x)
    y = dec_embed_fn(p, batch)
    for i in range(p["decoder"]["w"].shape[0]):
      y = dec_layer_fn(jax.tree.map(lambda a: a[i], p["decoder"]), y, x)
    total, count = seq2seq_head_fn(p, y, batch)
    return total / count
  return jax.value_and_grad(loss)(params)


def split_model(split, stages, micro):
  return pl.SplitPipeline(enc_embed_fn, enc_layer_fn, seq2seq_head_fn, micro,
                          decoder_embed_fn=dec_embed_fn, decoder_fn=dec_layer_fn,
                          split=split, num_stages=stages)


@pytest.mark.parametrize("data, stages, split, micro", [
    (2, 4, 1, 2), (2, 4, 2, 4), (1, 4, 3, 4), (4, 2, 1, 1)])
def test_an_encoder_decoder_split_equals_its_unpipelined_model(data, stages, split,
                                                                micro):
  """The first ``split`` stages run the encoder (2 layers a stage), the rest the
  decoder (2 layers a stage), reading the encoder's output."""
  params = seq2seq_params(2 * split, 2 * (stages - split))
  batch = seq2seq_batch()
  want_loss, want_grads = seq2seq_reference(params, batch)
  model = split_model(split, stages, micro)
  stored = model.to_device_order(params)
  # Each stack padded to a slice a stage, the other stages' slices zero.
  assert stored["encoder"]["w"].shape[0] == 2 * stages
  assert not np.asarray(stored["encoder"]["w"][2 * split:]).any()
  assert not np.asarray(stored["decoder"]["w"][:2 * split]).any()
  grads, loss, tokens = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(data, stages), per_token_loss=True))(stored, batch)
  assert float(tokens) == float(batch["mask"].sum())
  assert_close(loss, want_loss)
  assert_close(model.to_model_order(grads), want_grads)
  assert not np.asarray(grads["encoder"]["w"][2 * split:]).any()  # padding: zero
  assert not np.asarray(grads["decoder"]["w"][:2 * split]).any()
  out = model.apply(stored, batch)
  assert_close(out[0] / out[1], want_loss)
  chex.assert_trees_all_equal(model.to_model_order(stored), params)


@FLOORS
def test_an_encoder_decoder_split_trains_as_the_unpipelined_step():
  params, batch = seq2seq_params(2, 6), seq2seq_batch()
  model = split_model(1, 4, 2)
  tx = mpscale.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**8)
  init, step = mpscale.make_train_step(model, tx, mesh=mesh_of(2, 4),
                                       per_token_loss=True)
  ref_init, ref_step = mpscale.make_train_step(model.apply, tx, per_token_loss=True)
  state = init(model.to_device_order(params))
  ref_state = ref_init(model.to_device_order(params))
  for _ in range(3):
    state, metrics = step(state, batch)
    ref_state, ref_metrics = ref_step(ref_state, batch)
  assert_close(state.params, ref_state.params)
  assert_close(metrics["loss"], ref_metrics["loss"])
  assert float(metrics["loss"]) < float(seq2seq_reference(params, batch)[0])


@FLOORS
@pytest.mark.parametrize("kwargs, names, message", [
    (dict(split=4, num_stages=4), ("split", "num_stages"),
     "split=4 leaves the decoder no stage"),
    (dict(split=0, num_stages=4), ("split",), "split must be"),
    (dict(split=1, num_stages=4, schedule="1f1b"), ("schedule", "virtual_stages"),
     "runs schedule='gpipe'"),
])
def test_a_bad_split_names_the_argument(kwargs, names, message):
  with pytest.raises(mpscale.ArgumentError, match=message) as err:
    pl.SplitPipeline(enc_embed_fn, enc_layer_fn, seq2seq_head_fn, 2,
                     decoder_embed_fn=dec_embed_fn, decoder_fn=dec_layer_fn, **kwargs)
  assert err.value.names == names


def test_an_encoder_decoder_splits_decoder_layers_recompute_as_its_encoders():
  """The decoder's layers run under the recompute policy as the encoder's do (they
  were recomputed under ``remat=True`` alone, and ``recompute="full"`` or
  ``"selective"`` kept all of their residuals): what the backward keeps shrinks
  from none to selective to full, and full keeps what ``remat=True`` keeps."""
  params, batch = seq2seq_params(2, 6), seq2seq_batch()

  def kept(**kwargs):
    model = dataclasses.replace(split_model(1, 4, 2), **kwargs)
    return helpers.kept_bytes(lambda p: model.apply(p, batch)[0],
                              model.to_device_order(params))
  by = {recompute: kept(recompute=recompute) for recompute in ("none", "selective",
                                                                "full")}
  assert by["none"] > by["selective"] > by["full"], by
  assert kept(remat=True) == by["full"]


def test_a_split_stack_that_does_not_fit_the_stages_is_refused():
  model = split_model(1, 4, 2)
  with pytest.raises(ValueError, match="padded to a slice for each of the 4 stages"):
    model.value_and_grad(seq2seq_params(2, 6), seq2seq_batch(), mesh=mesh_of(2, 4),
                         per_token_loss=True)  # not padded: 2 and 6 layers
  with pytest.raises(ValueError, match="num_stages=4 but the mesh has 2 stages"):
    model.value_and_grad(model.to_device_order(seq2seq_params(2, 6)), seq2seq_batch(),
                         mesh=mesh_of(4, 2), per_token_loss=True)


def _jaxprs_in(value):
  from jax.extend import core as jcore
  if isinstance(value, jcore.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jcore.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _jaxprs_in(v)


def _scan_bodies(jaxpr):
  """Every ``scan`` body inside ``jaxpr`` (through shard_map, jit and cond)."""
  for eqn in jaxpr.eqns:
    for sub in _jaxprs_in(list(eqn.params.values())):
      if eqn.primitive.name == "scan":
        yield sub
      yield from _scan_bodies(sub)


def test_paired_ticks_send_the_gradient_before_the_forward():
  """In 1F1B's steady ticks (a forward, then a backward), the input gradient of the
  tick before leaves first, so that its transfer overlaps the forward, and the
  forward's output leaves before the backward: each send has compute to hide
  behind (benchmarks/gpu_overlap.py shows it in the program compiled for H100s)."""
  model = pl.Pipeline(embed_fn, stage_fn, head_fn, 8, schedule="1f1b")
  jaxpr = jax.make_jaxpr(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh_of(1, 4), per_token_loss=True))(make_params(), make_batch())
  steady = []
  for body in _scan_bodies(jaxpr.jaxpr):
    names = [e.primitive.name for e in body.eqns]
    if names.count("cond") >= 2 and names.count("ppermute") == 2:
      steady.append(names)
  assert steady
  for names in steady:
    sends = [i for i, n in enumerate(names) if n == "ppermute"]
    switches = [i for i, n in enumerate(names) if n == "cond"]
    assert sends[0] < switches[0] < sends[1] < switches[-1]


def test_split_pipeline_reports_no_residuals():
  model = split_model(2, 4, 4)
  with pytest.raises(TypeError, match="residual_bytes"):
    model.residual_bytes(seq2seq_params(4, 4), seq2seq_batch(), mesh=mesh_of(1, 4))


# ------------------------------------------------------------ FSDP inside the stages
def fsdp_mesh(fsdp=2, stage=4):
  return Mesh(np.array(jax.devices()[:fsdp * stage]).reshape(fsdp, stage),
              ("fsdp", "stage"))


def fsdp_value_and_grad(model, params, mesh, fsdp=True):
  """The pipelined gradient with every leaf also split over ``fsdp`` (ZeRO-3), or
  (``fsdp=False``) replicated over it: plain data parallelism."""
  specs = model.param_specs(params)
  if fsdp:
    specs = mpscale.fsdp_specs(params, mesh, "fsdp", specs)
  return jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh, data_axis="fsdp", per_token_loss=True, param_specs=specs)), specs


@pytest.mark.parametrize("schedule", pl.SCHEDULES)
@pytest.mark.parametrize("recompute, virtual", [("none", 1), ("selective", 1),
                                                ("full", 2)])
def test_fsdp_split_stages_equal_unpipelined(schedule, recompute, virtual):
  if schedule == "zb_h1" and virtual > 1:
    pytest.skip("zb_h1 runs one chunk per stage")
  params, batch = make_params(), make_batch()
  params["stages"]["w2"] = params["stages"]["w"][::-1] * 0.5
  model = pl.Pipeline(embed_fn, mlp_stage_fn, head_fn, 4, schedule=schedule,
                      recompute=recompute, virtual_stages=virtual)
  want_loss, want_grads = jax.jit(jax.value_and_grad(
      lambda p: operator.truediv(*pl.Pipeline(embed_fn, mlp_stage_fn, head_fn, 1)
                                 .apply(p, batch))))(params)
  fn, specs = fsdp_value_and_grad(model, params, fsdp_mesh())
  # Every leaf is split over fsdp: the stacked layers on a dimension of their own.
  assert all("fsdp" in str(s) for s in jax.tree_util.tree_leaves(
      specs, is_leaf=lambda x: isinstance(x, P)))
  grads, loss, _ = fn(params, batch)
  assert_close(loss, want_loss)
  assert_close(grads, want_grads)


def test_fsdp_split_encoder_decoder_equals_its_unpipelined_model():
  params = seq2seq_params(4, 4)
  batch = seq2seq_batch()
  want_loss, want_grads = seq2seq_reference(params, batch)
  model = split_model(2, 4, 2)
  stored = model.to_device_order(params)
  mesh = mesh_of(2, 4)
  specs = mpscale.fsdp_specs(stored, mesh, "data", model.param_specs(stored))
  assert "data" in str(specs["decoder"]["m"]) and "data" in str(specs["embed"])
  grads, loss, _ = jax.jit(lambda p, b: model.value_and_grad(
      p, b, mesh=mesh, per_token_loss=True, param_specs=specs))(stored, batch)
  assert_close(loss, want_loss)
  assert_close(model.to_model_order(grads), want_grads)


def _all_gather_sizes(hlo: str) -> list[int]:
  """The element count of each all-gather's result in a compiled program."""
  sizes = []
  for shape in re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo):
    sizes.append(int(np.prod([int(d) for d in shape.split(",") if d] or [1])))
  return sizes


@FLOORS
@pytest.mark.parametrize("schedule", pl.SCHEDULES)
def test_fsdp_stages_gather_a_layer_at_a_time(schedule):
  """Under FSDP a stage's parameters are gathered one layer at a time, where the
  layer runs: no all-gather in the compiled step is larger than one layer's largest
  leaf (gathering the stage's stacked layers whole when the step starts, as the
  step once did, is twice that here: two layers a stage), and the step's
  temporaries stay within data parallelism's on the same model (once 1.9-2.2x)."""
  wide, layers = 128, 8
  rng = np.random.default_rng(0)
  f32 = lambda *s: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32)  # noqa: E731
  params = {"embed": f32(FEATURES, wide), "head": f32(wide, 2),
            "stages": {"w": f32(layers, wide, 4 * wide), "w2": f32(layers, 4 * wide, wide),
                       "b": f32(layers, 4 * wide)}}
  batch = make_batch(size=64)
  model = pl.Pipeline(embed_fn, mlp_stage_fn, head_fn, 8, schedule=schedule)
  mesh = fsdp_mesh()
  temps = {}
  for fsdp in (True, False):
    fn, _ = fsdp_value_and_grad(model, params, mesh, fsdp)
    compiled = fn.lower(params, batch).compile()
    temps[fsdp] = compiled.memory_analysis().temp_size_in_bytes
    if fsdp:
      sizes = _all_gather_sizes(compiled.as_text())
  one_layer = wide * 4 * wide
  assert sizes and max(sizes) <= one_layer, sorted(set(sizes))
  assert one_layer in sizes  # the layers' weights are gathered, not activations
  assert temps[True] <= 1.05 * temps[False], temps


# ------------------------------------------- layer state: FP8 scaling state in stages
def _fp8_stage_fn(recipe):
  def fp8_stage_fn(lp, x, state=None):
    if state is None:
      return stage_fn(lp, x)
    y = mpscale.fp8_dot_general(x, lp["w"], (((1,), (0,)), ((), ())), state, recipe)
    return jnp.tanh(y + lp["b"])
  return fp8_stage_fn


def _fp8_pipeline(recipe, micro=1, **kwargs):
  merge = lambda updates: mpscale.precision.merge_stacked(updates, recipe)  # noqa: E731
  return pl.Pipeline(embed_fn, _fp8_stage_fn(recipe), head_fn, micro,
                     merge_state=merge, **kwargs)


def _fp8_states(recipe, layers=LAYERS):
  return jax.tree_util.tree_map(lambda x: jnp.stack([x] * layers),
                                mpscale.fp8_state(recipe))


def _pipelined_fp8(model, params, batch, states, data, stage):
  mesh = mesh_of(data, stage)
  return jax.jit(lambda p, b, s: model.value_and_grad(
      p, b, mesh=mesh, per_token_loss=True, model_state=s))(params, batch, states)


@FLOORS
@pytest.mark.parametrize("schedule, data, stage, micro, virtual", [
    ("gpipe", 2, 4, 4, 1), ("1f1b", 2, 4, 4, 1), ("zb_h1", 2, 4, 4, 1),
    ("gpipe", 1, 2, 4, 2), ("1f1b", 1, 2, 4, 2), ("1f1b", 8, 1, 1, 1)])
def test_fp8_state_through_every_schedule_is_the_whole_batch_update(
    schedule, data, stage, micro, virtual):
  """Every micro-batch of every replica starts from the step's scales, and the
  merged update is bit-identical to one call on the whole batch (delayed scaling:
  the same scales, so the same FP8 values and gradients too). A bubble's update
  reaching a copy would add a second state to it."""
  recipe = mpscale.make_fp8_recipe("delayed", history_len=4)
  params, batch = make_params(), make_batch()
  states = _fp8_states(recipe)
  reference = _fp8_pipeline(recipe)

  def whole(p, s):
    return reference.apply(p, batch, model_state=s)[0]

  want_grads, want_states = jax.jit(jax.grad(whole, argnums=(0, 1)))(params, states)
  model = _fp8_pipeline(recipe, micro, schedule=schedule, virtual_stages=virtual)
  (grads, _, tokens), new = _pipelined_fp8(model, params, batch, states, data, stage)
  assert_close(grads, jax.tree_util.tree_map(lambda g: g / tokens, want_grads))
  for got, want in zip(jax.tree_util.tree_leaves(new),
                       jax.tree_util.tree_leaves(want_states)):
    np.testing.assert_array_equal(got, want)
  assert np.all(new.lhs.amax_history[:, 0] > 0) and np.all(new.grad.scale != 1.0)


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_fp8_recipes_record_the_same_state_on_every_schedule(recipe):
  """Current and blockwise scaling quantize each micro-batch on its own, so they
  differ from a whole-batch call, but not between schedules, and with one
  micro-batch and replica they are that call."""
  recipe = mpscale.make_fp8_recipe(recipe, history_len=4, block_size=4)
  params, batch = make_params(), make_batch()
  states = _fp8_states(recipe)
  runs = [_pipelined_fp8(_fp8_pipeline(recipe, 4, schedule=s), params, batch, states,
                         2, 4) for s in ("gpipe", "1f1b", "zb_h1")]
  for (grads, _, _), new in runs[1:]:
    assert_close(grads, runs[0][0][0])
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(runs[0][1])):
      np.testing.assert_array_equal(a, b)
  _, single = _pipelined_fp8(_fp8_pipeline(recipe, 1, schedule="1f1b"), params, batch,
                             states, 1, 4)
  want = jax.jit(jax.grad(lambda s: _fp8_pipeline(recipe).apply(
      params, batch, model_state=s)[0]))(states)
  for a, b in zip(jax.tree_util.tree_leaves(single), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(a, b)


@FLOORS
def test_fp8_pipeline_step_skips_an_overflow_with_identical_state_everywhere():
  """make_train_step over a pipeline with FP8 state: clean steps update the state
  (as the unpipelined step with one micro-batch does), an injected overflow leaves
  it bit-identical, and every device's copy of it is the same."""
  recipe = mpscale.make_fp8_recipe("delayed", history_len=4)
  params, batch = make_params(), make_batch()
  state0 = {mpscale.OVERWRITE_WITH_GRADIENT: {"stages": _fp8_states(recipe)}}
  tx = _optimizer(4)
  model = _fp8_pipeline(recipe, 4, schedule="1f1b")
  init, step = mpscale.make_train_step(model, tx, mesh=mesh_of(2, 4),
                                       per_token_loss=True)

  def unpipelined(p, b, model_state):
    layers = model_state[mpscale.OVERWRITE_WITH_GRADIENT]["stages"]
    return model.apply(p, b, model_state=layers), model_state

  ref_init, ref_step = mpscale.make_train_step(unpipelined, tx, per_token_loss=True)
  state, ref_state = init(params, model_state=state0), ref_init(params,
                                                                model_state=state0)
  for _ in range(2):
    state, _ = step(state, batch)
    ref_state, _ = ref_step(ref_state, batch)
  assert_close(state.params, ref_state.params)
  for a, b in zip(jax.tree_util.tree_leaves(state.model_state),
                  jax.tree_util.tree_leaves(ref_state.model_state)):
    np.testing.assert_array_equal(a, b)
  poisoned = dict(batch, x=batch["x"].at[3, 0].set(jnp.inf))
  before = jax.device_get(state.model_state)  # the step donates its state
  after, metrics = step(state, poisoned)
  assert bool(metrics["overflow"])
  for new, old in zip(jax.tree_util.tree_leaves(after.model_state),
                      jax.tree_util.tree_leaves(before)):
    np.testing.assert_array_equal(new, old)
    copies = [np.asarray(s.data) for s in new.addressable_shards]
    for copy in copies:
      np.testing.assert_array_equal(copy, copies[0])


@FLOORS
def test_layer_state_errors_name_the_argument():
  recipe = mpscale.make_fp8_recipe("delayed", history_len=4)
  params, batch = make_params(), make_batch()
  mesh = mesh_of(1, 2)
  no_merge = pl.Pipeline(embed_fn, _fp8_stage_fn(recipe), head_fn, 2)
  with pytest.raises(mpscale.ArgumentError) as err:
    no_merge.value_and_grad(params, batch, mesh=mesh, model_state=_fp8_states(recipe))
  assert err.value.names == ("model_state", "merge_state")
  with pytest.raises(mpscale.ArgumentError) as err:
    _fp8_pipeline(recipe, 2).value_and_grad(params, batch, mesh=mesh,
                                            model_state=_fp8_states(recipe, 4))
  assert err.value.names == ("model_state",) and "stacked over the 8" in str(err.value)
  with pytest.raises(mpscale.ArgumentTypeError) as err:
    pl.Pipeline(embed_fn, stage_fn, head_fn, 2, merge_state="max")
  assert err.value.names == ("merge_state",)
  init, _ = mpscale.make_train_step(_fp8_pipeline(recipe, 2), optax.sgd(0.1),
                                    mesh=mesh)
  with pytest.raises(mpscale.ArgumentError) as err:
    init(params, model_state={"batch_stats": {"x": jnp.zeros(8)}})
  assert err.value.names == ("model_state",)
