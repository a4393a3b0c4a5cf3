"""`mpscale.parallel`: activations stay split over the batch under FSDP, for any
model, with the same values and gradients."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpscale
from mpscale.parallel import _batch_split as batch_split
from mpscale.trainer.planning import hlo
from mpscale import parallel

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def fsdp_mesh(data=1, fsdp=8):
  return Mesh(np.array(jax.devices()[:data * fsdp]).reshape(data, fsdp),
              ("data", "fsdp"))


# ------------------------------------------------------------------ a user's model
class Block(nn.Module):
  width: int
  heads: int = 4

  @nn.compact
  def __call__(self, x):
    b, t, w = x.shape
    h = nn.LayerNorm()(x)
    qkv = nn.Dense(3 * w)(h).reshape(b, t, 3, self.heads, w // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(w // self.heads)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(x.shape)
    x = x + nn.Dense(w)(a)
    return x + nn.Dense(w)(nn.gelu(nn.Dense(4 * w)(nn.LayerNorm()(x))))


class LM(nn.Module):
  """A user's linen LM: unrolled blocks, an embedding lookup, a head."""
  width: int
  layers: int = 2
  vocab: int = 512

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.vocab, self.width)(ids)
    for _ in range(self.layers):
      x = Block(self.width)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def lm_loss(model):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss_fn


def lm_step(model, rows, seq, mesh, optimizer=None):
  params = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"])
  specs = None if mesh is None else parallel.fsdp_specs(params, mesh)
  init, step = mpscale.make_train_step(
      lm_loss(model), optimizer or optax.adamw(1e-3), mesh=mesh,
      data_axis=("data", "fsdp") if mesh is not None else "data", param_specs=specs)
  return params, init, step


# --------------------------------------------------------------- the same values
def test_values_and_gradients_are_the_functions():
  """Embedding lookup, reshapes, transposes, einsums, a scan over stacked layers with
  a checkpointed body, a nested jit, a custom-derivative softmax, reductions: the
  wrapped loss and its gradients equal the plain one's, and the activations are
  constrained along the batch (the lowered program carries the constraints)."""
  mesh = fsdp_mesh(2, 4)
  rng = np.random.default_rng(0)
  params = {"embed": rng.normal(size=(32, 16)), "w": rng.normal(size=(3, 16, 16)) / 4,
            "head": rng.normal(size=(16, 32)) / 4}
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
  specs = parallel.fsdp_specs(params, mesh)
  batch = {"ids": jnp.asarray(rng.integers(0, 32, (8, 6))),
           "y": jnp.asarray(rng.integers(0, 32, (8, 6)))}

  @jax.jit
  def norm(x):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

  def loss(p, b):
    x = p["embed"][b["ids"]]                                   # gather
    layer = jax.checkpoint(lambda h, w: (norm(jnp.tanh(h @ w)) + h, None))
    x, _ = jax.lax.scan(layer, x, p["w"])
    flat = x.reshape(-1, x.shape[-1]).T.T                      # [B T, D]
    logits = jax.nn.log_softmax(flat @ p["head"])
    picked = jnp.take_along_axis(logits, b["y"].reshape(-1, 1), axis=-1)
    return -picked.mean()

  wrapped = batch_split.keep_batch_split(loss, mesh, ("data", "fsdp"), specs)
  put = lambda t, s: jax.device_put(t, jax.tree_util.tree_map(  # noqa: E731
      lambda q: NamedSharding(mesh, q), s, is_leaf=parallel.is_spec))
  p = put(params, specs)
  b = put(batch, {"ids": P(("data", "fsdp")), "y": P(("data", "fsdp"))})
  want = jax.jit(jax.value_and_grad(loss))(p, b)
  got = jax.jit(jax.value_and_grad(wrapped))(p, b)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  text = jax.jit(wrapped).lower(p, b).as_text()
  assert text.count("sharding_constraint") >= 10
  assert "sharding_constraint" not in jax.jit(loss).lower(p, b).as_text()


def test_without_data_axes_the_function_is_returned():
  f = lambda p, b: b  # noqa: E731
  assert batch_split.keep_batch_split(f, None, ("data",)) is f
  assert batch_split.keep_batch_split(f, fsdp_mesh(1, 8), ("data",)) is f  # size 1


@pytest.mark.parametrize("shape, out, dim, want", [
    ((8, 6, 16), (48, 16), 0, 0),          # [B, T, D] -> [B T, D]: the rows stay
    ((48, 16), (8, 6, 16), 0, None),       # a split of the rows: not followed
    ((4, 8, 16), (4, 128), 1, 1),          # batch second, merged with what follows
    ((8, 6, 16), (8, 6, 4, 4), 0, 0),
])
def test_a_reshape_keeps_the_batch_where_its_rows_stay(shape, out, dim, want):
  assert batch_split._reshaped(shape, out, dim) == want


def test_a_product_places_the_batch_after_its_batch_dimensions():
  # "bqhd,bkhd->bhqk": batch dims (b, h) first, then q, then k.
  numbers = (((3,), (3,)), ((0, 2), (0, 2)))
  shapes = [(8, 5, 4, 2), (8, 7, 4, 2)]
  assert batch_split._dot(numbers, [0, None], shapes) == 0
  assert batch_split._dot(numbers, [1, None], shapes) == 2      # q
  assert batch_split._dot(numbers, [None, 1], shapes) == 3      # k
  # x @ w with x's batch contracted (a weight gradient): none.
  assert batch_split._dot((((0,), (0,)), ((), ())), [0, None], [(8, 3), (8, 4)]) is None


# --------------------------------------------------------- the compiled program
def global_batch_ops(text, rows, seq):
  """Dots and all-gathers whose result carries the global batch: its ``rows *
  seq`` tokens in one dimension, or ``rows`` followed by ``seq``."""
  found = []
  for inss in hlo.parse(text).computations.values():
    for ins in inss:
      if ins.op not in ("dot", "all-gather", "all-gather-start", "convolution"):
        continue
      for dims in re.findall(r"\[([0-9,]*)\]", ins.result):
        d = [int(x) for x in dims.split(",") if x]
        if rows * seq in d or any(a == rows and b == seq for a, b in zip(d, d[1:])):
          found.append(f"{ins.op} {ins.result}")
  return found


ROWS, SEQ, WIDTH = 16, 320, 1024   # 2 sequences a device: activations ~ weights


def compiled(model, mesh):
  params, init, step = lm_step(model, ROWS, SEQ, mesh)
  batch = {k: jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32) for k in ("x", "y")}
  return step.lower(init(params), batch).compile()


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fsdp_keeps_a_user_models_batch_split(monkeypatch):
  """A user's linen LM under FSDP on 8 devices, at 2 sequences a device: no dot or
  all-gather in the compiled step carries the global batch, and none exchanges
  activations (all-to-all). Without `keep_batch_split` GSPMD turns the fsdp axis into
  feature parallelism over the whole batch (what the step did before)."""
  model, mesh = LM(WIDTH), fsdp_mesh(1, 8)
  text = compiled(model, mesh).as_text()
  assert global_batch_ops(text, ROWS, SEQ) == []
  assert "all-to-all" not in hlo.collectives(text)
  monkeypatch.setattr(batch_split, "keep_batch_split", lambda fn, *a: fn)
  before = compiled(model, mesh).as_text()
  assert len(global_batch_ops(before, ROWS, SEQ)) > 10
  assert "all-to-all" in hlo.collectives(before)


def test_fsdp_gathers_each_weight_forward_and_backward():
  """All-gathered bytes: every split weight once for the forward and once again for
  the backward (the forward's are not kept), not activations."""
  model, mesh = LM(WIDTH), fsdp_mesh(1, 8)
  params = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"])
  split = sum(x.size * 4 for x, s in zip(
      jax.tree_util.tree_leaves(params),
      jax.tree_util.tree_leaves(parallel.fsdp_specs(params, mesh),
                                is_leaf=parallel.is_spec)) if "fsdp" in parallel.spec_axes(s))
  gathered = hlo.collectives(compiled(model, mesh).as_text())["all-gather"]["bytes"]
  assert 1.9 * split <= gathered <= 2.1 * split


def test_a_transposed_or_reshaped_weight_is_gathered_where_it_is_used():
  """Hugging Face's ``Conv1D`` keeps its kernel ``[out, in]`` and multiplies by its
  transpose; other models reshape a flat weight. Through either, the weight is still
  gathered at its product and again for the backward's input gradient, not gathered
  once and kept from the forward to the backward. Four layers of equal weights: the
  first is gathered once (its input needs no gradient), the transposed and the
  reshaped one twice each, the last once (the loss's last product keeps its gathered
  weight: its backward follows at once): 6 weights' bytes (all kept: 4; the last
  gathered again: 7)."""
  rng = np.random.default_rng(0)
  width, rows, seq = 256, 16, 64
  f32 = lambda *s: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32)  # noqa: E731
  params = {"w0": f32(width, 4 * width), "w1": f32(width, 4 * width),
            "w2": f32(4 * width * width), "w3": f32(4 * width, width)}

  def loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w0"])                    # [.., 4 width]
    h = jnp.tanh(h @ p["w1"].T)                           # [.., width]
    h = jnp.tanh(h @ p["w2"].reshape(width, 4 * width))   # [.., 4 width]
    return jnp.mean(jnp.square(h @ p["w3"]))

  weights = _gathered_weights(loss, params, rows, seq, width)
  assert weights == pytest.approx(6, rel=0.02)


@pytest.mark.parametrize("split", ["rows", "width"])
def test_an_embedding_is_looked_up_where_it_lies_not_gathered(split):
  """A table split over FSDP, by rows or by width, is never all-gathered: each
  device looks up the whole batch's rows in its slice of the width (a table split
  by rows is resplit by width there), and all-to-alls exchange the looked-up rows
  and their gradients. What is all-gathered is the head, once (the loss's last
  product), and the tokens. The values and gradients are the unsplit function's."""
  rng = np.random.default_rng(2)
  vocab, width, rows, seq = 1024, 256, 16, 64
  f32 = lambda *s: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32)  # noqa: E731
  params = {"table": f32(vocab, width), "head": f32(width, vocab)}
  tokens = jnp.asarray(rng.integers(0, vocab, (rows, seq)), jnp.int32)

  def loss(p, batch):
    x = jnp.take(p["table"], batch["tokens"], axis=0)
    return jnp.mean(jnp.square(jnp.tanh(x) @ p["head"]))

  mesh = fsdp_mesh(1, 8)
  table = P("fsdp", None) if split == "rows" else P(None, "fsdp")
  specs = {"table": table, "head": P(None, "fsdp")}
  shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                     is_leaf=parallel.is_spec)
  split_loss = batch_split.keep_batch_split(loss, mesh, ("fsdp",), specs)
  grad = jax.jit(jax.value_and_grad(split_loss), in_shardings=(
      shardings, {"tokens": NamedSharding(mesh, P("fsdp"))}), out_shardings=(
          None, shardings))
  batch = {"tokens": tokens}
  text = grad.lower(params, batch).compile().as_text()
  collectives = hlo.collectives(text)
  head, ids = width * vocab * 4, rows * seq * 4
  assert collectives["all-gather"]["bytes"] == pytest.approx(head + ids, rel=0.05)
  assert "all-to-all" in collectives
  value, grads = grad(params, batch)
  want_value, want = jax.value_and_grad(loss)(params, batch)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for key in params:
    np.testing.assert_allclose(grads[key], want[key], rtol=1e-4, atol=1e-7)


def _gathered_weights(loss, params, rows, seq, width):
  """All-gathered bytes of ``loss``'s FSDP-8 step (SGD, a ``[rows, seq, width]``
  input) in units of one ``width x 4 width`` float32 weight."""
  mesh = fsdp_mesh(1, 8)
  init, step = mpscale.make_train_step(
      loss, optax.sgd(0.1), mesh=mesh, data_axis=("data", "fsdp"),
      param_specs=parallel.fsdp_specs(params, mesh))
  batch = {"x": jax.ShapeDtypeStruct((rows, seq, width), jnp.float32)}
  text = step.lower(init(params), batch).compile().as_text()
  return hlo.collectives(text)["all-gather"]["bytes"] / (4 * width * width * 4)


def test_a_recomputed_layer_gathers_each_weight_at_most_twice():
  """Under a ``jax.checkpoint`` of the layers (recompute), each weight is gathered
  for the forward and once more for the backward's recompute, whose gathers the
  products' backward uses: 6 weights' bytes for the three of the test above (the
  first's too: the recompute needs it). With a checkpoint of each product inside
  the recomputed layers (as before) the products' backward gathered again: 7
  weights' bytes here, where MaxText gathers twice."""
  rng = np.random.default_rng(1)
  width, rows, seq = 256, 16, 64
  f32 = lambda *s: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32)  # noqa: E731
  params = {"w0": f32(width, 4 * width), "w1": f32(4 * width, width),
            "w2": f32(width, 4 * width)}

  @jax.checkpoint
  def layers(p, x):
    h = jnp.tanh(x @ p["w0"])
    h = jnp.tanh(h @ p["w1"])
    return h @ p["w2"]

  def loss(p, batch):
    return jnp.mean(jnp.square(layers(p, batch["x"])))

  weights = _gathered_weights(loss, params, rows, seq, width)
  assert weights == pytest.approx(6, rel=0.02)


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fsdp_user_model_matches_one_device():
  """Three SGD steps of the user's LM under FSDP (data 2 x fsdp 4) equal one
  device's: loss and params, float32. (Not Adam: the key bias's gradient is zero but
  for rounding, which Adam would scale up to a full step.)"""
  model = LM(32, vocab=64)
  rng = np.random.default_rng(1)
  batch = {k: jnp.asarray(rng.integers(0, 64, (8, 12))) for k in ("x", "y")}
  params = jax.jit(model.init)(jax.random.key(0), batch["x"][:1])["params"]  # one program
  results = []
  for mesh in (None, fsdp_mesh(2, 4)):
    _, init, step = lm_step(model, 8, 12, mesh, optax.sgd(0.5))
    state = init(params)
    for _ in range(3):
      state, metrics = step(state, batch)
    results.append((float(metrics["loss"]), jax.device_get(state.params)))
  (loss1, p1), (loss8, p8) = results
  assert loss8 == pytest.approx(loss1, rel=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(p8), jax.tree_util.tree_leaves(p1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def nnx_lm(width, layers=2, vocab=512):
  """A user's Flax NNX transformer LM (unrolled blocks), as a test would write it."""
  from flax import nnx

  class NNXBlock(nnx.Module):
    def __init__(self, w, rngs):
      self.norm = nnx.LayerNorm(w, rngs=rngs)
      self.qkv, self.out = nnx.Linear(w, 3 * w, rngs=rngs), nnx.Linear(w, w, rngs=rngs)
      self.up, self.down = nnx.Linear(w, 4 * w, rngs=rngs), nnx.Linear(4 * w, w, rngs=rngs)

    def __call__(self, x):
      b, t, w = x.shape
      q, k, v = jnp.split(self.qkv(self.norm(x)).reshape(b, t, 3 * 4, w // 4), 3, -2)
      s = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(w // 4), -1)
      x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", s, v).reshape(x.shape))
      return x + self.down(jax.nn.gelu(self.up(x)))

  class NNXLM(nnx.Module):
    def __init__(self, w, rngs):
      self.embed = nnx.Embed(vocab, w, rngs=rngs)
      self.blocks = nnx.List([NNXBlock(w, rngs) for _ in range(layers)]) if hasattr(
          nnx, "List") else [NNXBlock(w, rngs) for _ in range(layers)]
      self.head = nnx.Linear(w, vocab, rngs=rngs)

    def __call__(self, ids):
      x = self.embed(ids)
      for block in self.blocks:
        x = block(x)
      return self.head(x)

  return NNXLM(width, nnx.Rngs(0))


def nnx_loss(module, batch):
  return optax.softmax_cross_entropy_with_integer_labels(
      module(batch["x"]), batch["y"]).mean()


@pytest.mark.slow  # long: not in the floors job (.ci/run)
def test_fsdp_keeps_an_nnx_models_batch_split(monkeypatch):
  """The same for a Flax NNX model, as the trainer adapts it
  (`mpscale.trainer.models.user.from_nnx`): no global-batch dot or gather, where GSPMD
  alone made them."""
  from mpscale.trainer.models import user as models

  model = models.from_nnx(nnx_lm(WIDTH), nnx_loss)
  params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  model.init(None))
  mesh = fsdp_mesh(1, 8)

  def text():
    init, step = mpscale.make_train_step(
        model.loss_fn, optax.adamw(1e-3), mesh=mesh, data_axis=("data", "fsdp"),
        param_specs=parallel.fsdp_specs(params, mesh), per_token_loss=True)
    batch = {k: jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32) for k in ("x", "y")}
    return step.lower(init(params), batch).compile().as_text()

  assert global_batch_ops(text(), ROWS, SEQ) == []
  monkeypatch.setattr(batch_split, "keep_batch_split", lambda fn, *a: fn)
  assert len(global_batch_ops(text(), ROWS, SEQ)) > 10


def test_fsdp_keeps_hugging_face_gpt2s_batch_split(monkeypatch):
  """Hugging Face's own Flax GPT-2 (transformers' ``FlaxGPT2LMHeadModel``, code
  nobody here wrote), 2 layers of width 1024, under FSDP on 8 devices at 2 sequences
  a device: no global-batch dot or gather in the compiled step, where GSPMD alone
  made them. Needs the optional ``outside`` extra (transformers)."""
  transformers = pytest.importorskip("transformers")
  gpt2 = transformers.FlaxGPT2LMHeadModel(
      transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=512,
                              n_positions=SEQ), _do_init=False)
  params = jax.eval_shape(lambda: gpt2.init_weights(jax.random.key(0), (1, SEQ)))

  def loss_fn(p, batch):
    logits = gpt2(batch["x"], params=p, train=False).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  mesh = fsdp_mesh(1, 8)

  def text():
    init, step = mpscale.make_train_step(
        loss_fn, optax.adamw(1e-3), mesh=mesh, data_axis=("data", "fsdp"),
        param_specs=parallel.fsdp_specs(params, mesh))
    batch = {k: jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32) for k in ("x", "y")}
    return step.lower(init(params), batch).compile().as_text()

  assert global_batch_ops(text(), ROWS, SEQ) == []
  monkeypatch.setattr(batch_split, "keep_batch_split", lambda fn, *a: fn)
  assert len(global_batch_ops(text(), ROWS, SEQ)) > 10


def test_each_weight_is_gathered_one_product_ahead():
  """Prefetch: a product's weight gather waits on the *previous* product's input
  (and a token of its gathered weight), not its own, so on a GPU it overlaps the
  previous product (benchmarks/fsdp_prefetch_study.py reads the H100 schedule: 16
  of 18 forward gathers overlap a matmul, none before). In the traced step each
  product's checkpoint takes the previous one's token (a one-element slice of its
  gathered weight) among its inputs; the loss's last product is not checkpointed
  (it keeps its gathered weight for its backward, which follows at once)."""
  rng = np.random.default_rng(0)
  params = {f"w{i}": jnp.asarray(rng.normal(size=(32, 32)) * 0.1, jnp.float32)
            for i in range(4)}

  def loss(p, b):
    h = b["x"]
    for i in range(4):
      h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h ** 2)

  mesh = fsdp_mesh(1, 8)
  wrapped = batch_split.keep_batch_split(loss, mesh, ("data", "fsdp"),
                                         parallel.fsdp_specs(params, mesh))
  batch = {"x": jnp.ones((16, 32))}
  jaxpr = jax.make_jaxpr(wrapped)(params, batch).jaxpr
  products = [e for e in jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2",
                                                            "remat")]
  assert len(products) == 3
  made = {v: e for e in jaxpr.eqns for v in e.outvars}

  def source(v):  # back through one-operand equations (stop_gradient and the like)
    while v in made and made[v] not in products and len(made[v].invars) == 1:
      v = made[v].invars[0]
    return v

  for before, after in zip(products, products[1:]):
    tokens = {v for v in before.outvars if v.aval.size == 1}
    assert tokens & {source(v) for v in after.invars}, "no prefetch"
  # The same values and gradients as the plain loss.
  want = jax.value_and_grad(loss)(params, batch)
  got = jax.jit(jax.value_and_grad(wrapped))(params, batch)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
