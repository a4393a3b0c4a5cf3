"""The tiny LM: pipeline-form functions, the unpipelined loss, masks, causality, dtypes."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpscale
from mpscale.trainer.config import load as config
from mpscale.trainer.models import lm
from tests import helpers

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)

CFG = config.ModelConfig(d_model=32, num_heads=4, num_layers=3, d_ff=64, seq_len=16)


class Jitted:
  """The model's functions, jitted (op-by-op dispatch is slow on a loaded CPU)."""

  def __init__(self, model):
    self.model = model
    for name in ("embed_fn", "stage_fn", "head_fn", "hidden_fn", "loss_fn",
                 "mean_loss_fn"):
      setattr(self, name, jax.jit(getattr(model, name)))


@pytest.fixture(scope="module")
def model():
  return Jitted(lm.TinyLM.from_sizes(CFG))


@pytest.fixture(scope="module")
def params(model):
  return jax.jit(model.model.init)(jax.random.key(0))


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(4, CFG.seq_len + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "mask": np.ones((4, CFG.seq_len), np.float32)}


def test_params_are_stacked_per_layer(params):
  assert set(params) == {"embed", "stages", "head"}
  for leaf in jax.tree_util.tree_leaves(params["stages"]):
    assert leaf.shape[0] == CFG.num_layers
  kernels = params["stages"]["qkv"]["kernel"]
  assert not np.allclose(kernels[0], kernels[1])  # independently initialized
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  assert lm.num_params(params) == sum(x.size for x in jax.tree_util.tree_leaves(params))


def test_loss_at_init_is_uniform_over_bytes(model, params, batch):
  loss_sum, num_tokens = model.loss_fn(params, batch)
  assert num_tokens == 4 * CFG.seq_len
  assert abs(loss_sum / num_tokens - math.log(256)) < 0.05
  assert np.isclose(model.mean_loss_fn(params, batch), loss_sum / num_tokens)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_loss_fn_is_the_composition_of_the_pipeline_functions(model, params, batch):
  x = model.embed_fn(params, batch)
  for i in range(CFG.num_layers):
    x = model.stage_fn(jax.tree_util.tree_map(lambda p: p[i], params["stages"]), x)
  expected = model.head_fn(params, x, batch)
  np.testing.assert_allclose(model.loss_fn(params, batch), expected, rtol=1e-5)


def test_pipeline_apply_matches_loss_fn(model, params, batch):
  m = model.model
  pipeline = mpscale.Pipeline(m.embed_fn, m.stage_fn, m.head_fn, num_microbatches=2)
  np.testing.assert_allclose(jax.jit(pipeline.apply)(params, batch),
                             model.loss_fn(params, batch), rtol=1e-5)


def test_mask_drops_tokens(model, params, batch):
  masked = dict(batch, mask=batch["mask"].copy())
  masked["mask"][:, 8:] = 0
  loss_sum, num_tokens = model.loss_fn(params, masked)
  assert num_tokens == 4 * 8
  changed = dict(masked, targets=masked["targets"].copy())
  changed["targets"][:, 8:] = (changed["targets"][:, 8:] + 1) % 256
  np.testing.assert_allclose(model.loss_fn(params, changed)[0], loss_sum, rtol=1e-6)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_attention_is_causal(model, params, batch):
  hidden = model.hidden_fn(params, batch)
  later = dict(batch, inputs=batch["inputs"].copy())
  later["inputs"][:, 10:] = (later["inputs"][:, 10:] + 7) % 256
  changed = model.hidden_fn(params, later)
  np.testing.assert_allclose(hidden[:, :10], changed[:, :10], rtol=1e-5, atol=1e-6)
  assert not np.allclose(hidden[:, 10:], changed[:, 10:])


@pytest.mark.slow  # long: not in the floors job (.ci/run)
@pytest.mark.parametrize("spec, dtype", [("O2", jnp.float16), ("bf16", jnp.bfloat16),
                                         ("O0", jnp.float32)])
def test_activations_follow_the_compute_dtype_and_loss_is_float32(
    model, params, batch, spec, dtype):
  policy = mpscale.make_policy(spec)
  cast = jax.jit(policy.cast_to_compute)(params)  # O2 keeps norms and biases in float32
  hidden = jax.eval_shape(model.model.hidden_fn, cast, batch)
  assert hidden.dtype == dtype
  loss_sum, num_tokens = jax.eval_shape(model.model.loss_fn, cast, batch)
  assert loss_sum.dtype == jnp.float32 and num_tokens.dtype == jnp.float32
  loss = jax.jit(model.model.mean_loss_fn)(cast, batch)
  assert abs(float(loss) - math.log(256)) < 0.1


@pytest.mark.slow  # over 5 s on 2 cores: the quick loop skips it
def test_remat_gives_the_same_gradients(params, batch):
  plain, remat = lm.TinyLM.from_sizes(CFG), lm.TinyLM.from_sizes(CFG, remat=True)
  g1 = jax.jit(jax.grad(plain.mean_loss_fn))(params, batch)
  g2 = jax.jit(jax.grad(remat.mean_loss_fn))(params, batch)
  for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_recompute_without_a_pipeline_keeps_less_and_gives_the_same_gradients(
    params, batch):
  """``recompute`` (#63 item 5: one key, with or without a pipeline): ``full``
  keeps the least (``remat=True`` is it, to the byte), ``selective`` keeps the
  blocks' matrix products and less than ``none``; the gradients are the plain
  model's."""
  models = {name: lm.TinyLM.from_sizes(CFG, recompute=name)
            for name in ("none", "selective", "full")}
  mean_loss = lambda m: lambda p: m.mean_loss_fn(p, batch)
  kept = {name: helpers.kept_bytes(mean_loss(m), params) for name, m in models.items()}
  assert kept["full"] < kept["selective"] < kept["none"], kept
  assert helpers.kept_bytes(mean_loss(lm.TinyLM.from_sizes(CFG, remat=True)), params) == kept["full"]
  grad = lambda m: jax.jit(jax.grad(m.mean_loss_fn))(params, batch)
  want = grad(models["none"])
  for a, b in zip(jax.tree_util.tree_leaves(want),
                  jax.tree_util.tree_leaves(grad(models["selective"]))):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_recompute_layers_recomputes_the_first_blocks(params, batch):
  """``recompute_layers=k`` (Megatron-LM's ``recompute_num_layers``): the first
  ``k`` blocks run under ``recompute``, the others keep every residual, so the
  backward keeps what ``none`` keeps with ``k = 0``, less with each block more,
  and what ``full`` keeps with all of them; the gradients are the plain model's."""
  mean_loss = lambda m: lambda p: m.mean_loss_fn(p, batch)
  model = lambda **kw: lm.TinyLM.from_sizes(CFG, **kw)
  none, full = (helpers.kept_bytes(mean_loss(model(recompute=r)), params)
                for r in ("none", "full"))
  kept = [helpers.kept_bytes(mean_loss(model(recompute="full", recompute_layers=k)),
                             params) for k in range(CFG.num_layers + 1)]
  assert none == kept[0] > kept[1] > kept[2] > kept[3] == full, (none, kept, full)
  grad = lambda m: jax.jit(jax.grad(m.mean_loss_fn))(params, batch)
  for a, b in zip(jax.tree_util.tree_leaves(grad(model())),
                  jax.tree_util.tree_leaves(grad(model(recompute="full",
                                                       recompute_layers=1)))):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_named_recompute_policies_keep_the_products_they_name(family):
  """MaxText's named policies (`mpscale.parallel.SAVED_NAMES`) keep the outputs the
  blocks name and nothing else of a block (GPT's fused ``qkv_proj``, Llama's
  ``query_proj``, ``key_proj`` and ``value_proj``, both ``out_proj``: a block's
  residuals, read under the policy), so the model keeps more than ``full`` and
  less than ``selective``, which keeps every product."""
  sizes = dict(vocab_size=256, d_model=32, num_heads=4, num_layers=2, d_ff=64,
               seq_len=16, family=family)
  if family == "llama":
    sizes.update(num_kv_heads=2, sliding_window=None)
  params = jax.eval_shape(lm.TinyLM(**sizes).init, jax.random.key(0))
  block = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                 params["stages"])
  x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
  qkv = {"qkv_proj"} if family == "gpt" else {"query_proj", "key_proj", "value_proj"}
  want = {"save_qkv_proj": qkv, "save_out_proj": {"out_proj"},
          "save_dot_except_mlp": qkv | {"out_proj"}}
  stage = lm.TinyLM(**sizes).stage_fn
  saved = {r: helpers.saved_names(lambda lp, h, r=r: jnp.sum(jax.checkpoint(
      stage, policy=mpscale.parallel.recompute_policy(r))(lp, h)), block, x) for r in want}
  if helpers.residuals_are_named():  # (jax 0.7 does not name them: the bytes below)
    assert saved == want
  tokens = jnp.zeros((2, 16), jnp.int32)
  data = {"inputs": tokens, "targets": tokens}
  kept = {r: helpers.kept_bytes(lambda p, m=lm.TinyLM(**sizes, recompute=r): m.loss_fn(
      p, data)[0], params) for r in (*want, "full", "selective")}
  assert (kept["full"] < kept["save_out_proj"] < kept["save_qkv_proj"]
          < kept["save_dot_except_mlp"] < kept["selective"]), kept


def test_recompute_is_checked_and_is_the_configs_key():
  with pytest.raises(ValueError, match="recompute"):
    lm.TinyLM.from_sizes(CFG, recompute="some")
  with pytest.raises(ValueError, match=r"remat=True is recompute='full'"):
    lm.TinyLM.from_sizes(CFG, remat=True, recompute="selective")
  from mpscale.trainer.config import build as builders  # noqa: PLC0415
  for recompute in ("selective", "full"):  # without a pipeline, as with one
    cfg = config.config_from_dict({"train": {"recompute": recompute}}, "<test>")
    assert builders.build_model(cfg).recompute == recompute
    assert cfg.train.full_recompute == (recompute == "full")
  with pytest.raises(ValueError, match=r"train.remat=True is train.recompute='full'"):
    config.config_from_dict({"train": {"remat": True, "recompute": "selective"}},
                            "<test>")
  cfg = config.config_from_dict({"train": {"recompute": "full", "recompute_layers": 1}},
                                "<test>")
  assert builders.build_model(cfg).recompute_layers == 1
  with pytest.raises(ValueError, match="recompute_layers"):
    lm.TinyLM.from_sizes(CFG, recompute_layers=1)        # beside recompute="none"
  with pytest.raises(ValueError, match="recompute_layers=4: there are 3 layers"):
    lm.TinyLM.from_sizes(CFG, recompute="full", recompute_layers=4)


def test_the_old_remat_key_reads_as_full_recompute_with_a_warning():
  """``train.remat: true`` (the older key) still loads, as ``train.recompute:
  full``, and warns to write that."""
  with pytest.warns(DeprecationWarning, match=r"the config key train.remat: true is "
                    r"deprecated .*; use train.recompute: full"):
    cfg = config.config_from_dict({"train": {"remat": True}}, "<test>")
  assert (cfg.train.remat, cfg.train.recompute) == (False, "full")
  assert cfg.train.full_recompute


def test_too_long_sequence_is_an_error(model, params):
  tokens = np.zeros((1, CFG.seq_len + 1), np.int32)
  with pytest.raises(ValueError, match="longer than the model's seq_len"):
    model.model.loss_fn(params, {"inputs": tokens, "targets": tokens})


def test_generate_continues_the_prompt_past_the_window():
  from mpscale.trainer.models.lm import TinyLM
  model = TinyLM(vocab_size=256, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                 seq_len=8)
  params = jax.jit(model.init)(jax.random.key(0))
  prompt = np.frombuffer(b"hello", np.uint8)
  # The reference logits as one compiled program (eagerly each op compiles alone).
  window_logits = jax.jit(lambda p, tokens: model.logits_fn(
      p, model.hidden_fn(p, {"inputs": tokens})))
  out = model.generate(params, prompt, 20, rng=jax.random.key(1), temperature=0.0)
  assert out.dtype == np.int32 and len(out) == 25  # ids of any vocabulary
  assert bytes(out[:5].astype(np.uint8)) == b"hello"
  # Greedy: each written token is the argmax given the (windowed) text before it.
  text = list(out)
  for i in (5, 12, 24):
    context = text[max(0, i - 8):i]
    tokens = np.zeros(8, np.int32)
    tokens[:len(context)] = context
    logits = window_logits(params, tokens[None])
    assert int(np.argmax(logits[0, len(context) - 1])) == text[i]
  assert len(model.generate(params, np.zeros(0, np.uint8), 3, rng=jax.random.key(2))) == 3
  # An empty prompt is conditioned on ``start`` (a corpus's end of document).
  first = lambda start: int(model.generate(params, np.zeros(0, np.int32), 1,
                                           rng=jax.random.key(3), temperature=0.0,
                                           start=start)[0])
  for start in (10, 200):
    tokens = np.zeros(8, np.int32)
    tokens[0] = start
    logits = window_logits(params, tokens[None])
    assert first(start) == int(np.argmax(logits[0, 0]))
  with pytest.raises(ValueError, match="num_tokens"):
    model.generate(params, prompt, 0, rng=jax.random.key(0))


# ------------------------------------------------------------------ attention


@jax.jit  # one program (eagerly each op compiles alone)
def _softmax_attention(q, k, v):
  """Causal softmax attention written out: float32 scores over sqrt(head size)."""
  length, head_dim = q.shape[1], q.shape[-1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
  causal = jnp.tril(jnp.ones((length, length), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(jnp.float32))


@pytest.mark.slow  # long: not in the floors job (.ci/run)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_attention_is_jax_s_own_xla_attention(dtype):
  """`lm.causal_attention` against JAX's `jax.nn.dot_product_attention` (its XLA
  implementation) and against softmax attention written out in float32."""
  q, k, v = (jax.random.normal(key, (2, 16, 4, 8)).astype(dtype)
             for key in jax.random.split(jax.random.key(0), 3))
  got = jax.jit(lm.causal_attention)(q, k, v)
  assert got.dtype == dtype
  jax_s = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                    implementation="xla"))(q, k, v)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.float32(got), np.float32(jax_s), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.float32(got), _softmax_attention(q, k, v),
                             rtol=tol, atol=tol)
  # float16 too (JAX's own XLA attention does not compile for it on the CPU)
  half = jax.jit(lm.causal_attention)(*(x.astype(jnp.float16) for x in (q, k, v)))
  np.testing.assert_allclose(np.float32(half), _softmax_attention(q, k, v),
                             rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("window, kv_heads", [(None, 4), (5, 2)])
def test_causal_attention_in_query_blocks_is_one_blocks(window, kv_heads):
  """Query blocks (the last one short), each against the keys it can see, give the
  values and gradients of the whole rows at once: with a sliding window, whose
  first keys start past position 0, and grouped K/V heads too. Each block's
  scores are recomputed in the backward (under ``jax.checkpoint``) and the keys
  above the diagonal's blocks never multiplied: fewer FLOPs than one block."""
  kq, kk, kv, kc = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(kq, (2, 19, 4, 8))
  k, v = (jax.random.normal(key, (2, 19, kv_heads, 8)) for key in (kk, kv))
  cotangent = jax.random.normal(kc, q.shape)

  def loss(block, q, k, v):
    return jnp.sum(lm.causal_attention(q, k, v, window, block=block) * cotangent)

  blocks = functools.partial(loss, 4)
  # both compiled (eagerly the reference's ops compile one by one)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, 19), argnums=(0, 1, 2)))(
      q, k, v)
  got = jax.jit(jax.value_and_grad(blocks, argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  def flops(f):
    cost = jax.jit(f).lower(q, k, v).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
  assert flops(blocks) < 0.8 * flops(functools.partial(loss, 19))


class _Device:
  def __init__(self, platform, kind):
    self.platform, self.device_kind = platform, kind


H100 = _Device("gpu", "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("choice, device, dtype, head_dim, want", [
    ("auto", H100, jnp.bfloat16, 64, "cudnn"),
    ("auto", H100, jnp.float16, 128, "cudnn"),
    ("auto", H100, jnp.float32, 64, "xla"),        # cuDNN's is 16-bit only
    ("auto", H100, jnp.bfloat16, 12, "xla"),       # not a multiple of 8
    ("auto", H100, jnp.bfloat16, 256, "xla"),      # over 128
    ("auto", _Device("cpu", "cpu"), jnp.bfloat16, 64, "xla"),
    ("auto", _Device("gpu", "AMD Instinct MI300X"), jnp.bfloat16, 64, "xla"),
    ("auto", None, jnp.bfloat16, 64, "xla"),       # an abstract mesh: no device
    ("xla", H100, jnp.bfloat16, 64, "xla"),
    ("cudnn", H100, jnp.bfloat16, 64, "cudnn"),
    ("cudnn", None, jnp.bfloat16, 64, "xla"),      # checked where devices are known
])
def test_attention_for_chooses_cudnn_where_it_runs(choice, device, dtype, head_dim,
                                                   want):
  assert lm.attention_for(choice, device, dtype, head_dim) == want


@pytest.mark.parametrize("device, dtype, head_dim, why", [
    (_Device("cpu", "cpu"), jnp.bfloat16, 64, "NVIDIA GPUs, and the devices are cpu"),
    (H100, jnp.float32, 64, "compute dtype is float32"),
    (H100, jnp.bfloat16, 20, "multiple of 8 up to 128, not 20"),
])
def test_cudnn_attention_where_it_cannot_run_says_why(device, dtype, head_dim, why):
  with pytest.raises(ValueError, match=f"^attention: cuDNN.*{why}"):
    lm.attention_for("cudnn", device, dtype, head_dim)


def test_an_unknown_attention_is_an_error():
  with pytest.raises(ValueError, match="^attention must be one of 'auto', 'xla'"):
    lm.attention_for("flash", H100, jnp.bfloat16, 64)
  with pytest.raises(ValueError, match="^attention must be one of 'xla', 'cudnn'"):
    lm.TinyLM.from_sizes(CFG, attention="auto")


def test_a_cudnn_model_computes_float32_activations_with_xla(params, batch):
  """cuDNN's attention is 16-bit only: a float32 pass (initialization, a float32
  policy) of a model built for it takes XLA's, and gives the same loss."""
  fused = lm.TinyLM.from_sizes(CFG, attention="cudnn")
  plain = lm.TinyLM.from_sizes(CFG)
  text = jax.jit(fused.loss_fn).lower(params, batch).as_text()
  assert "cudnn" not in text
  np.testing.assert_allclose(jax.jit(fused.mean_loss_fn)(params, batch),
                             jax.jit(plain.mean_loss_fn)(params, batch), rtol=1e-6)


# ------------------------------------------------------------------ FP8 blocks
FP8_CFG = config.ModelConfig(d_model=32, num_heads=4, num_layers=4, d_ff=64,
                             seq_len=16)


def _fp8_model(recipe="delayed", **kwargs):
  return lm.TinyLM.from_sizes(
      FP8_CFG, fp8=mpscale.make_fp8_recipe(recipe, history_len=8), **kwargs)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fp8_state_is_stacked_over_every_block_and_passes_through(batch):
  """One state per block, as params["stages"] (a pipeline splits both alike): the
  first and last blocks' (kept in bf16) all zeros, the others the recipe's first."""
  model = _fp8_model(fp8_products=("qkv", "fc"))
  params = model.init(jax.random.key(0))
  state = model.init_model_state()
  stages = state["_overwrite_with_gradient"]["stages"]
  assert set(stages) == {"qkv", "fc"}
  for leaf in jax.tree_util.tree_leaves(stages):
    assert leaf.shape[0] == FP8_CFG.num_layers and leaf.dtype == jnp.float32
    assert not np.any(leaf[0]) and not np.any(leaf[-1])
  assert np.all(stages["qkv"].lhs.scale[1:-1] == 1.0)
  on = [bool(lm.fp8_block(jax.tree_util.tree_map(lambda x: x[i], stages)))
        for i in range(FP8_CFG.num_layers)]
  assert on == [False, True, True, False]
  (loss_sum, tokens), new = jax.jit(model.loss_fn)(params, batch, state)
  assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
  plain = jax.jit(model.loss_fn)(params, batch)  # no state: no FP8
  assert tokens == plain[1] and loss_sum != plain[0]
  np.testing.assert_allclose(loss_sum, plain[0], rtol=2e-2)
  assert lm.TinyLM.from_sizes(FP8_CFG).init_model_state() is None


@pytest.mark.slow  # long: not in the floors job (.ci/run)
@pytest.mark.parametrize("remat", [False, True])
def test_fp8_state_gradient_updates_every_fp8_block(batch, remat):
  """Each FP8 block's products record their amaxes through the state's gradient
  (the first and last blocks, kept in bf16, have no state); remat changes nothing."""
  model = _fp8_model(remat=remat)
  params = model.init(jax.random.key(0))
  state = model.init_model_state()

  def loss(p, s):
    (loss_sum, tokens), _ = model.loss_fn(p, batch, s)
    return loss_sum / tokens

  grads, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, state)
  for meta in jax.tree_util.tree_leaves(
      new, is_leaf=lambda x: isinstance(x, mpscale.Fp8Meta)):
    assert np.all(meta.amax_history[1:-1, 0] > 0)  # every FP8 block, every tensor
    assert np.all(meta.scale[1:-1] != 1.0)
    assert not np.any(np.asarray(meta.scale)[[0, -1]])  # the bf16 blocks': no product, zeros
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
  if remat:
    reference = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        params, _fp8_model(remat=False).init_model_state())
    for a, b in zip(jax.tree_util.tree_leaves((grads, new)),
                    jax.tree_util.tree_leaves(reference)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs, names", [
    ({"fp8_products": ("qkv", "mlp")}, ("fp8_products",)),
    ({"fp8_products": ()}, ("fp8_products",)),
    ({"bf16_layers": 2}, ("bf16_layers", "num_layers")),
    ({"bf16_layers": -1}, ("bf16_layers",)),
])
def test_bad_fp8_settings_are_refused_by_name(kwargs, names):
  with pytest.raises(mpscale.ArgumentError) as err:
    _fp8_model(**kwargs)
  assert err.value.names == names


def test_a_state_without_fp8_is_refused(params, batch):
  with pytest.raises(mpscale.ArgumentError) as err:
    lm.TinyLM.from_sizes(CFG).loss_fn(params, batch, {"x": jnp.zeros(())})
  assert err.value.names == ("model_state",)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fp8_pipeline_form_equals_loss_fn_and_its_state_update(batch):
  """A Pipeline of embed_fn / stage_fn(state=) / head_fn (its layers under a
  lax.cond on fp8_block) gives loss_fn's loss, gradients and state update."""
  model = _fp8_model()
  params = model.init(jax.random.key(0))
  state = model.init_model_state()
  layers = state["_overwrite_with_gradient"]["stages"]
  pipeline = mpscale.Pipeline(model.embed_fn, model.stage_fn, model.head_fn, 1)

  def via_loss_fn(p, s):
    return model.loss_fn(p, batch, {"_overwrite_with_gradient": {"stages": s}})[0][0]

  def via_pipeline(p, s):
    return pipeline.apply(p, batch, model_state=s)[0]

  want = jax.jit(jax.value_and_grad(via_loss_fn, argnums=(0, 1)))(params, layers)
  got = jax.jit(jax.value_and_grad(via_pipeline, argnums=(0, 1)))(params, layers)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  helpers.assert_close(got[1][0], want[1][0], 1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(got[1][1]),
                  jax.tree_util.tree_leaves(want[1][1])):
    np.testing.assert_array_equal(a, b)  # the bf16 ends' zeros too
  plain = jax.jit(via_pipeline)(params, jax.tree_util.tree_map(jnp.zeros_like, layers))
  np.testing.assert_allclose(plain, model.loss_fn(params, batch)[0], rtol=1e-5)


def test_fp8_with_no_bf16_layers_puts_every_block_in_fp8(batch):
  model = _fp8_model(bf16_layers=0)
  params = model.init(jax.random.key(0))
  state = model.init_model_state()
  for leaf in jax.tree_util.tree_leaves(state):
    assert leaf.shape[0] == FP8_CFG.num_layers
  grad = jax.jit(jax.grad(lambda s: model.loss_fn(params, batch, s)[0][0]))(state)
  assert np.all(grad["_overwrite_with_gradient"]["stages"]["qkv"].lhs.amax_history[:, 0]
                > 0)


def _korthikanti_bytes(d_model, q_width, kv_width, d_ff, gated, itemsize=2):
  """Bytes a token one block needs kept for its backward, in Korthikanti et al.'s
  count with flash attention and no dropout (``32 * d_model`` for GPT's block, 16-bit):
  the two norms' inputs, the attention's input, q, k, v and the output projection's
  input, the MLP's input, its hidden product(s) and the down projection's input.

  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", 2022, section 4.1. https://arxiv.org/abs/2205.05198
  """
  return itemsize * (_attention_count(d_model, q_width, kv_width) + d_model
                     + (3 if gated else 2) * d_ff)


def _attention_count(d_model, q_width, kv_width):
  """The elements a token `_korthikanti_bytes` counts outside the MLP: the two
  norms' inputs, the attention's input, q, k, v and the output projection's input."""
  return 2 * d_model + d_model + q_width + 2 * kv_width + q_width


def _experts_bytes(d_model, q_width, kv_width, d_ff, slots, num_experts, shared_d_ff=0,
                   itemsize=2):
  """`_korthikanti_bytes` of a block whose MLP is a mixture of experts: Llama's
  attention part; the MLP's input (the router's); for each of a token's routed
  ``slots`` (``top_k`` dropless; a capacity buffer's rows a token, ``E x C / tokens``,
  with one) the expert's input row, its gate and up products, the down
  projection's input and its output (the routing weight's gradient needs it), all in
  the compute dtype; the router's float32 scores (``[tokens, E]``); and a shared
  SwiGLU MLP's gate, up and down-input (its input is the MLP's)."""
  routed = slots * (2 * d_model + 3 * d_ff)
  return (itemsize * (_attention_count(d_model, q_width, kv_width) + d_model + routed
                      + 3 * shared_d_ff) + 4 * num_experts)


MOE = {"num_experts": 4, "experts_per_token": 2}


@pytest.mark.parametrize("family, kv_heads, moe", [
    ("gpt", None, {}), ("llama", 2, {}), ("qwen3", 2, {}), ("mistral", 4, {}),
    ("mixtral", 2, {**MOE, "shared_d_ff": 128}), ("qwen3_moe", 2, MOE),
    ("qwen3_moe", 2, {**MOE, "capacity_factor": 1.25})])
def test_a_block_keeps_what_its_backward_needs_in_the_compute_dtype(
    monkeypatch, family, kv_heads, moe):
  """Within 1.2x Korthikanti's count a token and layer (#64 item 1: GPT's block kept
  126 * d_model bytes, float32 copies of the GELU's input and the LayerNorms'
  normalized inputs; Llama's 114, the SwiGLU's and RMSNorms'), read off the
  residuals ``jax.vjp`` keeps in a bfloat16 model, with attention in query blocks
  (as at long sequences: no ``[T, T]`` scores kept). A mixture of experts'
  (`_experts_bytes`): Mixtral's with a shared MLP kept 257 * d_model, Qwen3-MoE's
  214, and 260 with a capacity: five float32 ``[slots, d_ff]`` copies in the
  experts' SwiGLU, the float32 rows of the weighted sum and the router's input, the
  masks and copies of the scatters that sort rows back."""
  monkeypatch.setattr(lm, "QUERY_BLOCK", 16)
  d_model, heads, d_ff, batch, length = 64, 4, 256, 2, 64
  policy = mpscale.make_policy("bf16")
  tokens = jnp.zeros((batch, length), jnp.int32)
  data = {"inputs": tokens, "targets": tokens}
  kept = []
  for layers in (2, 4):
    model = lm.TinyLM(vocab_size=256, d_model=d_model, num_heads=heads,
                      num_layers=layers, d_ff=d_ff, seq_len=length, family=family,
                      num_kv_heads=kv_heads, sliding_window=None, **moe)
    params = jax.eval_shape(
        policy.cast_to_compute, jax.eval_shape(model.init, jax.random.key(0)))
    kept.append(helpers.kept_bytes(lambda p: model.loss_fn(p, data)[0], params))  # pylint: disable=cell-var-from-loop
  tokens = batch * length
  per_token_layer = (kept[1] - kept[0]) / 2 / tokens
  kv_width = (kv_heads or heads) * d_model // heads
  if moe:
    routing = model.routing
    slots = (routing.top_k if routing.capacity_factor is None
             else routing.num_experts * routing.capacity(tokens) / tokens)
    count = _experts_bytes(d_model, d_model, kv_width, d_ff, slots,
                           routing.num_experts, moe.get("shared_d_ff", 0))
  else:
    count = _korthikanti_bytes(d_model, d_model, kv_width, d_ff, family != "gpt")
  assert per_token_layer <= 1.2 * count, (per_token_layer / d_model, count / d_model)


def _residual_bytes(loss, params, space: str) -> int:
  """The bytes ``jax.vjp`` of ``loss(params)`` keeps in memory ``space``
  (``"Device"`` or ``"Host"``), beyond its arguments."""
  residuals = jax._src.ad_checkpoint.saved_residuals(loss, params)  # pylint: disable=protected-access
  return sum(aval.size * aval.dtype.itemsize for aval, source in residuals
             if "argument" not in source and str(aval.memory_space).endswith(space))


@pytest.mark.parametrize("recompute", mpscale.parallel.OFFLOADED)
def test_offloading_policies_keep_residuals_in_host_memory(recompute):
  """MaxText's offloading policies (`mpscale.parallel.OFFLOADED`): the device keeps
  what ``full`` keeps, the products they save are kept in host memory (none
  without them), and the gradients are the plain model's."""
  params = lm.TinyLM.from_sizes(CFG).init(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab_size)
  batch = {"inputs": tokens, "targets": tokens}
  model = lambda **kw: lm.TinyLM.from_sizes(CFG, **kw)  # noqa: E731
  mean_loss = lambda m: lambda p: m.mean_loss_fn(p, batch)  # noqa: E731
  offloaded, full = model(recompute=recompute), model(recompute="full")
  assert (_residual_bytes(mean_loss(offloaded), params, "Device")
          == _residual_bytes(mean_loss(full), params, "Device"))
  assert _residual_bytes(mean_loss(offloaded), params, "Host") > 0
  assert _residual_bytes(mean_loss(model(recompute="selective")), params, "Host") == 0
  grad = lambda m: jax.jit(jax.grad(m.mean_loss_fn))(params, batch)  # noqa: E731
  for a, b in zip(jax.tree_util.tree_leaves(grad(model())),
                  jax.tree_util.tree_leaves(grad(offloaded))):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
