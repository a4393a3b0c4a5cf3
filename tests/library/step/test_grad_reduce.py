"""float32 gradient sums under a 16-bit compute dtype (``grad_reduce_dtype``): where the
compiled program sums (mpscale.trainer.planning.hlo.sums, the plan's reader), what it changes in the
numbers, what `mpscale plan` counts, and the bad inputs."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax
import pytest

import mpscale
from mpscale.trainer.planning import hlo
from mpscale.parallel import pipeline as pl
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.planning import compiled as planning
from tests.library.parallel import test_pipeline as tp

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

IN, HIDDEN, OUT, ROWS = 32, 64, 16, 256
PARAM_BYTES = 4 * (IN * HIDDEN + HIDDEN * OUT)
FSDP = {"w1": P("data", None), "w2": P(None, "data")}


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w1": jnp.asarray(rng.normal(size=(IN, HIDDEN)) * 0.2, jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(HIDDEN, OUT)) * 0.2, jnp.float32)}


def _batch(seed=1, rows=ROWS):
  rng = np.random.default_rng(seed)
  return {"x": jnp.asarray(rng.normal(size=(rows, IN)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(rows, OUT)), jnp.float32)}


def loss_fn(p, b):
  h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"])
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)


def _mesh():
  return Mesh(np.array(jax.devices()[:8]), ("data",))


def _step(policy="bf16", **kw):
  return mpscale.make_train_step(loss_fn, optax.adam(1e-2), policy=policy,
                                 mesh=_mesh(), **kw)


def _gradient_sums(step, init):
  """The compiled step's sums that move more than a few scalars (the loss and the
  norms' sums of squares are scalars): its gradient sums."""
  state = init(jax.eval_shape(_params))
  text = step.lower(state, _batch()).compile().as_text()
  return [s for s in hlo.sums(text) if s.bytes > 64]


# ------------------------------------------------------------------ the compiled sums
@pytest.mark.parametrize("num_microbatches, specs", [
    (1, None), (4, None), (1, FSDP), (2, FSDP)],
    ids=["data", "data_micro", "fsdp", "fsdp_micro"])
def test_the_gradient_sums_are_float32_in_the_program(num_microbatches, specs):
  """With the option every gradient sum is a float32 sum in the program itself (not a
  bfloat16 one the CPU compile widened, which `hlo.Sum.widened` tells apart), over
  every parameter's float32 bytes: an all-reduce, or FSDP's reduce-scatter. Without
  it, GSPMD sums in bfloat16 inside the backward matmul, except on the vmapped path
  of micro-batches over replicated parameters, whose replicas are summed in float32
  after the loop."""
  kw = dict(num_microbatches=num_microbatches, param_specs=specs)
  wide = _gradient_sums(*_step(grad_reduce_dtype=jnp.float32, **kw)[::-1])
  assert wide and all(s.dtype == "f32" and not s.widened for s in wide), wide
  assert {s.kind for s in wide} == {"reduce-scatter" if specs else "all-reduce"}
  # Written once (FSDP's reduce-scatters in the loop of micro-batches, which
  # `hlo.collectives` counts by its trip count): every parameter's float32 bytes,
  # and the loss's where XLA combines it into the same all-reduce.
  assert PARAM_BYTES <= sum(s.bytes for s in wide) <= PARAM_BYTES + 16
  default = _gradient_sums(*_step(**kw)[::-1])
  if num_microbatches > 1 and specs is None:
    assert all(not s.widened for s in default), default
  else:
    assert any(s.widened for s in default), default


def _entry_loops_carry(text, type_text):
  """Whether a loop of the entry computation (a pipeline's ticks) carries
  ``type_text``, e.g. ``bf16[2,8,8]``."""
  module = hlo.parse(text)
  return any(ins.op == "while" and type_text in ins.result
             for ins in module.computations[module.entry])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_sums_in_float32_and_gpipe_accumulates_in_float32(schedule):
  """A pipeline's gradients leave each device float32, so its data-axis all-reduces
  are float32 either way. GPipe's loop adds each micro-batch's gradient: by default
  as the bfloat16 cotangent of the parameters cast once (its backward loop carries
  the stage's layer weights, ``[layers per stage, width, width]``, in bfloat16);
  with the option each tick casts, and the loop carries them in float32. 1F1B
  accumulates float32 either way."""
  model = pl.Pipeline(tp.embed_fn, tp.stage_fn, tp.mean_head_fn, 4, schedule=schedule)
  mesh = tp.mesh_of(2, 4)
  weights = f"[{tp.LAYERS // 4},{tp.WIDTH},{tp.WIDTH}]"
  found = {}
  for reduce_dtype in (None, "float32"):
    init, step = mpscale.make_train_step(model, optax.sgd(0.1), policy="bf16",
                                         mesh=mesh, grad_reduce_dtype=reduce_dtype)
    text = step.lower(init(jax.eval_shape(tp.make_params)), tp.make_batch()
                      ).compile().as_text()
    sums = [s for s in hlo.sums(text) if s.bytes > 64]
    assert sums and all(s.dtype == "f32" and not s.widened for s in sums), sums
    found[reduce_dtype] = _entry_loops_carry(text, "bf16" + weights)
    assert _entry_loops_carry(text, "f32" + weights)
  assert found == {None: schedule == "gpipe", "float32": False}


# ------------------------------------------------------------------ the numbers
def _sharded(batch):
  """``batch`` split over the data axis, as the train step places it (a replicated
  batch would let GSPMD compute every gradient whole on each device, with no sum)."""
  return jax.device_put(batch, jax.sharding.NamedSharding(_mesh(), P("data")))


def _grads(policy, **kw):
  fn = jax.jit(lambda p, b: mpscale.accumulate_gradients(
      loss_fn, p, b, policy=policy, mesh=_mesh(), **kw).grads)
  return fn(_params(), _sharded(_batch()))


def _relative(a, b):
  """Relative L2 distance of two gradient trees, over all their leaves."""
  a, b = (np.concatenate([np.ravel(np.asarray(x, np.float64))
                          for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow  # long: not in the floors job (.ci/run)
@pytest.mark.parametrize("specs", [None, FSDP], ids=["data", "fsdp"])
def test_the_gradient_is_the_float32_sum_of_the_replicas_own(specs):
  """Each replica's own bfloat16 gradient (its 32 rows, on one device), summed in
  float32, is what the option returns, to float32 rounding; the default's bfloat16
  sum is off by bfloat16 rounding, and so further from the float32-compute gradient
  (which differs from both by the bfloat16 forward pass)."""
  own = [jax.jit(lambda p, b: mpscale.accumulate_gradients(
      loss_fn, p, b, policy="bf16").grads)(
          _params(), jax.tree_util.tree_map(lambda x: x[r * 32:(r + 1) * 32],
                                            _batch())) for r in range(8)]
  exact = jax.tree_util.tree_map(
      lambda *g: sum(np.asarray(x, np.float64) for x in g) / 8, *own)
  wide = _grads("bf16", param_specs=specs, grad_reduce_dtype="float32")
  default = _grads("bf16", param_specs=specs)
  assert _relative(wide, exact) < 1e-5
  assert _relative(default, exact) > 1e-4  # bfloat16's rounding of the sum
  reference = _grads("O0", param_specs=specs)
  assert _relative(wide, reference) < _relative(default, reference) < 2e-2


def test_micro_batches_agree_with_the_vmapped_float32_sums():
  """With micro-batches over replicated parameters both paths sum in float32, and
  each replica's micro-batch draws the same dropout key on both: they agree to the
  rounding of each micro-batch's bfloat16 gradient (another key is far off)."""
  def dropout_loss(p, b, rng):
    h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"])
    h = jnp.where(jax.random.bernoulli(rng, 0.5, h.shape), 2 * h, 0).astype(h.dtype)
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)

  def grads(seed=3, **kw):
    return jax.jit(lambda p, b: mpscale.accumulate_gradients(
        dropout_loss, p, b, policy="bf16", mesh=_mesh(), num_microbatches=4,
        rng=jax.random.key(seed), **kw).grads)(_params(), _sharded(_batch()))

  wide = grads(grad_reduce_dtype="float32")
  assert _relative(wide, grads()) < 5e-3
  assert _relative(wide, grads(seed=4)) > 0.1


def test_training_with_float32_sums_agrees_with_bf16_sums_and_float32():
  """Five Adam steps on 8 replicas: the params with the option, without it, and
  under float32 compute agree to bfloat16's precision."""
  def train(policy, **kw):
    init, step = _step(policy, **kw)
    state = init(_params())
    for i in range(5):
      state, metrics = step(state, _batch(seed=10 + i))
    return state.params, float(metrics["loss"])

  wide, wide_loss = train("bf16", grad_reduce_dtype="float32", num_microbatches=2)
  default, default_loss = train("bf16", num_microbatches=2)
  reference, reference_loss = train("O0", num_microbatches=2)
  assert _relative(wide, default) < 1e-2
  assert _relative(wide, reference) < 1e-2 and _relative(default, reference) < 1e-2
  assert wide_loss == pytest.approx(reference_loss, rel=1e-2)
  assert default_loss == pytest.approx(reference_loss, rel=1e-2)


def test_float32_compute_is_left_as_it_is():
  """Under float32 compute the sums are float32 already: the option changes neither
  the sums nor a bit of the gradients."""
  def sums(**kw):
    init, step = _step("O0", **kw)
    text = step.lower(init(jax.eval_shape(_params)), _batch()).compile().as_text()
    return sorted((s.kind, s.dtype, s.widened, s.bytes) for s in hlo.sums(text))

  assert sums(grad_reduce_dtype="float32") == sums()
  wide, default = _grads("O0", grad_reduce_dtype="float32"), _grads("O0")
  jax.tree_util.tree_map(np.testing.assert_array_equal, wide, default)


# ------------------------------------------------------------------ the plan
@pytest.mark.slow  # two compiles of the tiny LM's step: about 20 s
def test_the_plan_counts_float32_sums_at_twice_the_bytes():
  """`mpscale plan` of the tiny LM on 8 replicas: its one gradient all-reduce moves
  the float32 parameters' bytes with ``precision.grad_reduce_dtype: float32``, twice
  the bfloat16 sum's."""
  def plan(*sets):
    cfg = config_lib.load_config("configs/tiny_lm_bf16.yaml", [
        "mesh.data=8", "data.batch_size=16", "model.seq_len=16", "model.num_layers=1",
        "optimizer.name=adamw", *sets])
    return planning.plan(cfg)

  default = plan()
  wide = plan("precision.grad_reduce_dtype=float32")
  assert set(wide.collectives) == set(default.collectives) == {"all-reduce"}
  assert wide.collectives["all-reduce"]["bytes"] == pytest.approx(
      2 * default.collectives["all-reduce"]["bytes"], abs=64)
  assert 0 <= wide.collectives["all-reduce"]["bytes"] - wide.bytes["params"] <= 64


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("value, error", [
    ("bfloat16", ValueError), (jnp.float16, ValueError), ("float64", ValueError),
    ("f32x", TypeError), (3.5, TypeError)])
def test_a_bad_dtype_names_the_argument(value, error):
  with pytest.raises(error, match="grad_reduce_dtype"):
    _step(grad_reduce_dtype=value)
  with pytest.raises(error, match="grad_reduce_dtype"):
    _grads("bf16", grad_reduce_dtype=value)
  with pytest.raises(error, match="grad_reduce_dtype"):
    tp_model = pl.Pipeline(tp.embed_fn, tp.stage_fn, tp.mean_head_fn, 2)
    tp_model.value_and_grad(tp.make_params(), tp.make_batch(), mesh=tp.mesh_of(2, 4),
                            grad_reduce_dtype=value)


def test_a_model_state_is_refused_by_name():
  def stateful(p, b, model_state):
    return loss_fn(p, b), model_state

  init, _ = _step(grad_reduce_dtype="float32")
  with pytest.raises(mpscale.ArgumentError, match="grad_reduce_dtype") as e:
    init(_params(), model_state={"mean": jnp.zeros(3)})
  assert e.value.names == ("grad_reduce_dtype", "model_state")
  with pytest.raises(mpscale.ArgumentError, match="model_state"):
    mpscale.accumulate_gradients(stateful, _params(), _batch(), policy="bf16",
                                 model_state={"mean": jnp.zeros(3)},
                                 grad_reduce_dtype="float32")
  # Under float32 compute there is nothing to move: no refusal.
  init, _ = _step("O0", grad_reduce_dtype="float32")
  init(_params(), model_state={"mean": jnp.zeros(3)})


def test_a_bad_config_value_names_the_key():
  with pytest.raises(ValueError, match=r"precision\.grad_reduce_dtype") as e:
    config_lib.load_config("configs/tiny_lm_bf16.yaml",
                           ["precision.grad_reduce_dtype=bfloat16"])
  assert "precision.grad_reduce_dtype" in e.value.keys


def test_a_model_with_a_state_is_refused_by_key():
  from mpscale.trainer.config import build as builders
  from mpscale.trainer.models import user as models

  def stateful(p, b, model_state):
    return loss_fn(p, b), model_state

  model = models.Model(init=lambda key: _params(), loss_fn=stateful, evaluate=loss_fn,
                       init_state=lambda key: {"mean": jnp.zeros(3)})
  cfg = config_lib.load_config("configs/tiny_lm_bf16.yaml",
                               ["precision.grad_reduce_dtype=float32"])
  with pytest.raises(mpscale.ArgumentError, match="precision.grad_reduce_dtype") as e:
    builders.build(cfg, model=model)
  assert e.value.names == ("precision.grad_reduce_dtype", "model.provider")


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fsdp_float32_sums_gather_a_layer_at_a_time():
  """Under FSDP the float32-sums step casts and gathers each weight where the loss
  uses it (`mpscale.parallel.gather_where_used`): on the built-in LM, whose layers
  are stacked and scanned, no all-gather is larger than one layer's largest weight
  in bfloat16 (the step once gathered every stacked leaf whole, each micro-batch),
  the gradient sums stay float32, and the gradients equal one device's."""
  from mpscale.trainer.models import lm as lm_lib
  tiny = lm_lib.TinyLM(vocab_size=64, d_model=64, num_heads=4, num_layers=4,
                       d_ff=256, seq_len=16)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
  params = jax.jit(tiny.init)(jax.random.key(0))  # one program, not op by op
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (16, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "mask": np.ones((16, 16), np.float32)}

  def grads(mesh, policy):
    return jax.jit(lambda p, b: mpscale.accumulate_gradients(
        tiny.loss_fn, p, b, policy=policy, mesh=mesh, per_token_loss=True,
        data_axis=("data", "fsdp") if mesh else "data", num_microbatches=2,
        param_specs=tiny.param_specs(mesh) if mesh else None,
        grad_reduce_dtype=jnp.float32 if mesh else None).grads)

  fn = grads(mesh, "bf16")
  text = fn.lower(params, batch).compile().as_text()
  # One layer's MLP weight, at 4 bytes: XLA's CPU backend widens a bfloat16
  # all-gather to float32 (the whole stack is 4 layers of it).
  layer = 64 * 256 * 4
  assert 0 < hlo.largest_collective(text, "all-gather") <= layer
  sums = [s for s in hlo.sums(text) if s.bytes > 64]
  assert sums and all(s.dtype == "f32" and not s.widened for s in sums), sums
  want = grads(None, "f32")(params, batch)
  got = grads(mesh, "f32")(params, batch)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ------------------------------------------------- FP8 scaling state under float32 sums
RECIPE = mpscale.make_fp8_recipe("delayed", history_len=4)


def fp8_loss_fn(p, b, model_state):
  state = model_state[mpscale.OVERWRITE_WITH_GRADIENT]["w1"]
  h = jnp.tanh(mpscale.fp8_dot_general(b["x"].astype(p["w1"].dtype), p["w1"],
                                       (((1,), (0,)), ((), ())), state, RECIPE))
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2), model_state


def _fp8_state():
  return {mpscale.OVERWRITE_WITH_GRADIENT: {"w1": mpscale.fp8_state(RECIPE)}}


@pytest.mark.slow  # long: not in the floors job (.ci/run)
@pytest.mark.parametrize("num_microbatches, specs", [(1, None), (2, None), (2, FSDP)],
                         ids=["one", "micro", "fsdp"])
def test_fp8_state_under_float32_sums_records_the_global_amaxes(num_microbatches,
                                                                specs):
  """Each replica differentiates its own rows and updates the FP8 state from them;
  merge_state combines the replicas' updates each micro-batch, so the forward
  operands' state is the one the bf16-sums step records (the global amaxes, a
  history entry a micro-batch), bit for bit, on every device. The output gradient
  each replica quantizes is that of its own rows' mean loss, 8 (the replicas) times
  the global mean's: its amaxes are 8 times the bf16-sums step's, exactly. Under
  FSDP (fsdp) the FP8 product's custom VJP runs on w1 gathered where it is used,
  its gradient reduce-scattered in float32, and trains as the bf16-sums step."""
  merge = lambda u: mpscale.precision.merge_stacked(u, RECIPE)  # noqa: E731
  steps = {}
  for name, kw in (("bf16", {}), ("float32", {"grad_reduce_dtype": "float32",
                                               "merge_state": merge})):
    init, step = mpscale.make_train_step(
        fp8_loss_fn, optax.sgd(0.1), policy="bf16", mesh=_mesh(),
        num_microbatches=num_microbatches, param_specs=specs, **kw)
    state = init(_params(), model_state=_fp8_state())
    for _ in range(2):
      state, _ = step(state, _batch())
    steps[name] = state
  want, got = (steps[k].model_state[mpscale.OVERWRITE_WITH_GRADIENT]["w1"]
               for k in ("bf16", "float32"))
  for a, b in zip(jax.tree_util.tree_leaves((got.lhs, got.rhs)),
                  jax.tree_util.tree_leaves((want.lhs, want.rhs))):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(got.grad.amax_history, 8 * want.grad.amax_history)
  for a in jax.tree_util.tree_leaves(got):
    copies = [np.asarray(s.data) for s in a.addressable_shards]
    assert all(np.array_equal(c, copies[0]) for c in copies)
  meta = got
  assert np.count_nonzero(meta.lhs.amax_history) == 2 * num_microbatches
  assert np.count_nonzero(meta.grad.amax_history) == 2 * num_microbatches
  for a, b in zip(jax.tree_util.tree_leaves(steps["float32"].params),
                  jax.tree_util.tree_leaves(steps["bf16"].params)):
    np.testing.assert_allclose(a, b, rtol=0.02, atol=1e-4)


def test_fp8_state_under_float32_sums_needs_merge_state_by_name():
  init, _ = _step(grad_reduce_dtype="float32")
  with pytest.raises(mpscale.ArgumentError) as e:
    init(_params(), model_state=_fp8_state())
  assert e.value.names == ("merge_state", "grad_reduce_dtype")
  with pytest.raises(mpscale.ArgumentError) as e:  # FP8 state and BatchNorm's
    init(_params(), model_state={**_fp8_state(), "mean": jnp.zeros(3)})
  assert e.value.names == ("grad_reduce_dtype", "model_state")
  with pytest.raises(mpscale.ArgumentTypeError) as e:
    _step(grad_reduce_dtype="float32", merge_state="max")
  assert e.value.names == ("merge_state",)
