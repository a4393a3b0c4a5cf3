"""The optimizer steps as XLA compiles them for one H100, without a GPU (issue #45).

Each optimizer step is compiled ahead of time for one NVIDIA H100
(``jax.experimental.topologies`` with ``mpscale/trainer/planning/target_specs/h100_sxm.txtpb``; nothing runs) and
its program is read, against a baseline compiled in the same run:

* ``kernels``: `mpscale.trainer.planning.hlo.launches`, the instructions one step runs other than
  parameters, tuples, get-tuple-elements, bitcasts and constants (fusions, copies,
  custom-calls, collectives), a loop body's times its trip count: one launch each.
  The columns that break them down read the entry computation only (the optimizer
  steps have no loops; TinyLM's stacked blocks run in one):
  ``reductions``: the fusions of kind ``kInput`` (a reduction kernel).
  ``scalar``: the other kernels whose result is rank 0 (a tuple of rank-0 arrays
  included), copies aside. ``copies``: the ``copy`` ops; ``whole-leaf copies``: those
  whose result is at least as large as the smallest parameter leaf (a copy of a whole
  leaf, not of a scalar or an empty array). The CPU backend has no ``kInput`` fusions
  (its reductions are loops), so ``--cpu`` prints no reduction count.
* ``bytes``: what `mpscale.trainer.planning.hlo.kernels` says one step reads and writes
  (``k.bytes + sum(bytes * count)`` of its matrix products).
* ``temp``: ``compiled.memory_analysis().temp_size_in_bytes``, the compiled
  temporaries beside the (donated) inputs and the outputs.

The optimizer steps are ``step(params, opt_state, grads) -> (params, opt_state)``
(``tx.update`` + ``optax.apply_updates``, params and opt_state donated) on the
GPT-2-small-like tree of `gpt2_tree.gpt2_like_shapes` (``--layers`` blocks, float32).
The last rows are whole train steps (float16 compute, policy "O2") of a Flax linen MLP
(4 Dense layers of width 1024) and of mpscale's TinyLM (width 768, 12 stacked blocks,
8 x 256 tokens): `mpscale.make_train_step` with ``dynamic_loss_scale(adamw)`` against
a hand-written jitted step doing the same math without the skip (gradient of
``scale * loss``, unscale, adamw, apply).

Needs JAX's CUDA build for the H100 (``pip install "jax[cuda12]"``); on a plain CPU
install it prints why it skips and exits 0. ``--cpu`` compiles for the host CPU
instead, for comparison (a CPU fuses differently: other kernel counts)::

  JAX_PLATFORMS=cpu python benchmarks/bench_gpu_program.py [--layers 12] [--cpu]
      [--vocab 8192] [--tied] [--names slash|list|linen] [--only REGEX]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: the host is the CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_tree import gpt2_like_shapes, is_shape  # noqa: E402

import mpscale  # noqa: E402
from mpscale.trainer.planning import hlo  # noqa: E402

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpscale",
                    "trainer", "planning", "target_specs", "h100_sxm.txtpb")
_BOOKKEEPING = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")  # f32[768,3072]


def _result_arrays(ins) -> list[tuple[str, list[int]]]:
  """``(dtype, dims)`` of each array in an instruction's result type."""
  return [(dtype, [int(d) for d in dims.split(",") if d])
          for dtype, dims in _ARRAY.findall(ins.result)]


def h100_device():
  """The H100 of a one-GPU topology, or ``(None, why)`` where this JAX has none."""
  try:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc("h100", "cuda", target_config=open(SPEC).read(),
                                        topology="1x1x1")
    return topo.devices[0], None
  except Exception as e:  # no jax_cuda12_plugin: no GPU compiler here
    return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def placed(tree, dev):
  """``tree``'s arrays as ``ShapeDtypeStruct``s on ``dev``."""
  shard = SingleDeviceSharding(dev)
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard), tree)


def measure(compiled, params) -> dict:
  """The readings of one compiled step (see the module docstring)."""
  text = compiled.as_text()
  module = hlo.parse(text)
  entry = module.computations[module.entry]
  smallest = min(x.size * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree_util.tree_leaves(params))
  work = [i for i in entry if i.op not in _BOOKKEEPING]
  reduction = lambda i: i.op == "fusion" and "kind=kInput" in i.rest
  rank0 = lambda i: not any(dims for _, dims in _result_arrays(i))
  k = hlo.kernels(module)
  return {
      "kernels": hlo.launches(module),
      "reductions": sum(map(reduction, work)),
      "scalar": sum(rank0(i) and not reduction(i) and i.op != "copy" for i in work),
      "copies": sum(i.op == "copy" for i in work),
      "leaf_copies": sum(i.op == "copy" and hlo._shape_bytes(i.result) >= smallest
                         for i in work),
      "ops": collections.Counter(i.op for i in work),
      "bytes": k.bytes + sum(b * n for _, b, n in k.dots),
      "temp": compiled.memory_analysis().temp_size_in_bytes,
      "text": text,
  }


def optimizer_row(params, tx, dev) -> dict:
  """`measure` of ``tx``'s update and ``optax.apply_updates`` on ``params`` (placed on
  ``dev``), the parameters and state donated, compiled for ``dev``."""
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  state = placed(jax.eval_shape(tx.init, params), dev)
  return measure(jax.jit(step, donate_argnums=(0, 1)).lower(
      params, state, params).compile(), params)


def optimizer_rows(layers: int, dev, *, vocab: int = 8192, tied: bool = False,
                   names: str = "slash"):
  """``(name, baseline name, compile())`` of the optimizer steps on the GPT-2 tree
  (`gpt2_tree.gpt2_like_shapes` with these arguments)."""
  shapes = gpt2_like_shapes(layers=layers, vocab=vocab, untied_head=not tied,
                            names=names)
  params = placed(jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape), dev)

  def build(tx):
    return lambda: optimizer_row(params, tx, dev)

  adamw = lambda: optax.adamw(1e-3)
  return [
      ("adamw", None, build(adamw())),
      ("dls(adamw)", "adamw", build(mpscale.dynamic_loss_scale(adamw()))),
      ("apply_if_finite(adamw, 10)", "adamw",
       build(optax.apply_if_finite(adamw(), 10))),
      ("chain(optax clip, adamw)", None,
       build(optax.chain(optax.clip_by_global_norm(1.0), adamw()))),
      ("dls(chain(mpscale clip, adamw))", "chain(optax clip, adamw)",
       build(mpscale.dynamic_loss_scale(
           optax.chain(mpscale.global_norm_clip(1.0), adamw())))),
      ("mpscale.came", "adamw", build(mpscale.came(1e-3))),
      ("mpscale.came(stack_layers)", "adamw",
       build(mpscale.came(1e-3, stack_layers=True))),
  ]


def mlp(width: int, depth: int, dtype=None):
  """A Flax linen MLP: ``depth`` Dense layers of ``width`` (the last gives the logits)
  computing in ``dtype`` (left unset, the float32 biases the policy keeps would
  promote every product to float32)."""
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(depth):
        x = nn.Dense(width, dtype=dtype)(x)
        if i < depth - 1:
          x = nn.gelu(x)
      return x
  return MLP()


def train_step_rows(dev, which: str = "both"):
  """``make_train_step`` (O2, dls(adamw)) against the same step written by hand, on
  the Flax MLP and on mpscale's TinyLM (GPT-2-small-like: width 768, 12 stacked
  blocks, 8 x 256 tokens)."""
  policy = mpscale.make_policy("O2")
  models = []
  if which in ("both", "mlp"):
    width, depth = 1024, 4
    model = mlp(width, depth, policy.compute_dtype)
    params = jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), jnp.zeros((1, width), jnp.float32))["params"])
    batch = {"x": jax.ShapeDtypeStruct((512, width), jnp.float32),
             "y": jax.ShapeDtypeStruct((512,), jnp.int32)}

    def mlp_loss(p, b):
      logits = model.apply({"params": p}, policy.cast_to_compute(b["x"]))
      logits = policy.cast_to_output(logits).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    models.append((f"MLP {depth}x{width}", params, mlp_loss, batch))
  if which in ("both", "tinylm"):
    from mpscale.trainer.models.lm import TinyLM
    tiny = TinyLM(vocab_size=8192, d_model=768, num_heads=12, num_layers=12,
                  d_ff=3072, seq_len=256)
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)

    def tiny_loss(p, b):
      total, count = tiny.loss_fn(p, b)
      return total / count
    models.append(("TinyLM 12x768", jax.eval_shape(tiny.init, jax.random.key(0)),
                   tiny_loss, {"inputs": tokens, "targets": tokens}))

  rows = []
  for label, params, loss_fn, batch in models:
    batch = placed(batch, dev)

    def mpscale_step(params=params, loss_fn=loss_fn, batch=batch):
      init, step = mpscale.make_train_step(
          loss_fn, mpscale.dynamic_loss_scale(optax.adamw(1e-3)), policy=policy)
      # mesh=None: init gives shapes without a device; place them on the H100.
      state = placed(init(params), dev)
      return measure(step.lower(state, batch).compile(), params)

    def hand_step(params=params, loss_fn=loss_fn, batch=batch):
      tx = optax.adamw(1e-3)

      def step(state, b):
        p, opt_state, scale = state
        loss_of = lambda q: loss_fn(policy.cast_to_compute(q), b)
        loss, grads = jax.value_and_grad(lambda q: scale * loss_of(q))(p)
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) / scale, grads)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state, scale), loss / scale

      p = jax.eval_shape(policy.cast_to_param, params)
      state = placed((p, jax.eval_shape(tx.init, p),
                      jax.ShapeDtypeStruct((), jnp.float32)), dev)
      return measure(jax.jit(step, donate_argnums=0).lower(state, batch).compile(),
                     params)

    hand = f"hand {label}: scale, unscale, adamw"
    rows += [(hand, None, hand_step),
             (f"make_train_step {label} O2 dls(adamw)", hand, mpscale_step)]
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=12,
                      help="GPT-2 blocks of the optimizer steps' tree (default 12)")
  parser.add_argument("--vocab", type=int, default=8192,
                      help="vocabulary of the optimizer steps' tree (default 8192)")
  parser.add_argument("--tied", action="store_true",
                      help="no separate lm_head (--vocab 50257 --tied: GPT-2's 124M)")
  parser.add_argument("--names", choices=("slash", "list", "linen"), default="slash",
                      help="how the tree spells its blocks: h/0 (default), a list "
                           "h[0], or linen's top-level h_0")
  parser.add_argument("--only", metavar="REGEX",
                      help="compile only the rows whose name matches (baselines kept)")
  parser.add_argument("--cpu", action="store_true",
                      help="compile for the host CPU instead of an H100")
  parser.add_argument("--dump", metavar="DIR",
                      help="write each step's compiled HLO text under DIR")
  parser.add_argument("--train", choices=("both", "mlp", "tinylm", "none"),
                      default="both", help="which train-step rows to add")
  parser.add_argument("--ops", action="store_true",
                      help="also print each step's kernel ops by opcode")
  args = parser.parse_args()

  if args.cpu:
    dev, target = jax.devices("cpu")[0], "the host CPU"
  else:
    dev, why = h100_device()
    if dev is None:
      print(f"bench_gpu_program: skipped: no H100 compiler in this JAX ({why}); "
            "needs jax[cuda12] (or run with --cpu)")
      return
    target = "one H100 (XLA's GPU compiler, no GPU)"
  print(f"JAX {jax.__version__}, optax {optax.__version__}; compiled for {target}; "
        f"GPT-2 tree of {args.layers} layers, vocab {args.vocab}"
        f"{' tied' if args.tied else ''}, blocks named {args.names}")

  rows = optimizer_rows(args.layers, dev, vocab=args.vocab, tied=args.tied,
                        names=args.names)
  try:
    rows += [] if args.train == "none" else train_step_rows(dev, args.train)
  except ImportError as e:
    print(f"(train-step rows skipped: {e})")
  if args.only:
    wanted = {n for n, _, _ in rows if re.search(args.only, n)}
    wanted |= {b for n, b, _ in rows if n in wanted and b}
    rows = [r for r in rows if r[0] in wanted]
  results: dict[str, dict] = {}
  header = (f"{'step':40s} {'baseline':28s} {'kernels':>7s} {'k/base':>6s} "
            f"{'reduct':>6s} {'scalar':>6s} {'copies':>6s} {'leafcp':>6s} {'GiB':>7s} "
            f"{'B/base':>6s} "
            f"{'temp MiB':>8s}")
  print(header)
  print("-" * len(header))
  for name, base, compile_ in rows:
    try:
      r = results[name] = compile_()
    except Exception as e:  # report the row, keep the others
      print(f"{name:40s} failed to compile: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}")
      continue
    b = results.get(base)
    kratio = f"{r['kernels'] / b['kernels']:6.2f}" if b else f"{'-':>6s}"
    bratio = f"{r['bytes'] / b['bytes']:6.2f}" if b else f"{'-':>6s}"
    reductions = f"{'-':>6s}" if args.cpu else f"{r['reductions']:6d}"
    print(f"{name:40s} {base or '-':28s} {r['kernels']:7d} {kratio} "
          f"{reductions} {r['scalar']:6d} {r['copies']:6d} {r['leaf_copies']:6d} "
          f"{r['bytes'] / 2**30:7.3f} {bratio} {r['temp'] / 2**20:8.1f}", flush=True)
    if args.ops:
      print(f"{'':42s}{dict(r['ops'].most_common())}")
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      fname = "".join(c if c.isalnum() else "_" for c in name).strip("_") + ".txt"
      with open(os.path.join(args.dump, fname), "w") as f:
        f.write(r["text"])
  print("kernels: launches a step (mpscale.trainer.planning.hlo.launches: fusions, copies, custom-calls,"
        " collectives; loop bodies by trip count); the rest read the entry:"
        " reduct: kInput fusions; scalar: other kernels with a rank-0 result (copies"
        " aside); leafcp: copies at least one parameter leaf in size; GiB: bytes one"
        " step reads and writes (mpscale.trainer.planning.hlo.kernels); temp: compiled temporaries")


if __name__ == "__main__":
  main()
