"""Update-step cost of mpscale's loss-scale wrappers against plain Optax and hand-written
equivalents, on a GPT-2-small-like parameter tree.

Every implementation is timed as one jitted unit::

    step(params, opt_state, grads) -> (new_params, new_opt_state)

doing ``tx.update`` (or the hand-written equivalent) plus ``optax.apply_updates``, with
``params`` and ``opt_state`` donated. Gradients are finite (``normal * 1e-3``; the
loss-scaled implementations get them multiplied by the initial loss scale, so the
unscaled gradients are the same numbers).

Implementations (each has a letter; the ratios are named by them):

  a  ``optax.adamw(1e-3)``                                           baseline A
  b  ``optax.apply_if_finite(optax.adamw(1e-3), max_consecutive_errors=5)``
  c  hand-written jmp/flax-style dynamic scale: unscale, ``all(isfinite)``, adamw,
     ``jnp.where``-select params and state, adjust the scale
  d  ``mpscale.dynamic_loss_scale(optax.adamw(1e-3))``
  e  ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))``     baseline B
  f  ``mpscale.dynamic_loss_scale(optax.chain(mpscale.global_norm_clip(1.0),
     optax.adamw(1e-3)))``
  g  naive ``lax.cond`` dynamic scale: unscale, ``all(isfinite)``, ``lax.cond`` between
     the adamw step and keeping params/state, adjust the scale

Timing is round-robin: each round times every implementation (in a shuffled order) for
``--reps`` back-to-back calls and keeps the median of those; a ratio is formed against
the baseline measured in the same round, and the reported ratio is the median of those
paired ratios over ``--rounds`` rounds. Compilation (``lower().compile()``) and one
warm-up call are excluded from the timings and reported separately.

Targets (set for accelerators): d/a <= 1.05 and f/e <= 1.00. They are printed as PASS/MISS; the script always
exits 0 (it is a benchmark, not a test).

Usage::

    python benchmarks/bench_loss_scale.py            # full size (~35M params, 41 leaves)
    python benchmarks/bench_loss_scale.py --quick    # smaller tree, fewer rounds
    python benchmarks/bench_loss_scale.py --hlo      # also per-impl compiled-HLO stats
    python benchmarks/bench_loss_scale.py --impls a,d --rounds 20
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

import mpscale
from gpt2_tree import gpt2_like_shapes, is_shape  # benchmarks/gpt2_tree.py

try:  # host page-fault counts (POSIX only)
  import resource
except ImportError:  # pragma: no cover
  resource = None

INIT_SCALE = 2.0**15
GRAD_STD = 1e-3

# --------------------------------------------------------------------------------------
# Parameter tree
# --------------------------------------------------------------------------------------


def make_tree(shapes: dict, key: jax.Array, scale: float) -> Any:
  leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=is_shape)
  keys = jax.random.split(key, len(leaves))
  arrays = [scale * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, leaves)]
  return jax.tree_util.tree_unflatten(treedef, arrays)


def copy_tree(tree: Any) -> Any:
  """A fresh on-device copy (so donation of one impl's buffers never touches another's)."""
  return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


# --------------------------------------------------------------------------------------
# Hand-written references (c) and (g)
# --------------------------------------------------------------------------------------


class ManualScaleState(NamedTuple):
  """State of the hand-written dynamic-scale references."""
  inner_state: Any
  loss_scale: jax.Array
  growth_count: jax.Array


def _all_finite(tree: Any) -> jax.Array:
  """jmp.all_finite / flax DynamicScale: one isfinite().all() per leaf, then all."""
  leaves = jax.tree_util.tree_leaves(tree)
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def _select_tree(pred, a, b):
  """jmp.select_tree."""
  return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)


def _adjust_scale(state: ManualScaleState, finite: jax.Array,
                  growth_interval: int = 2000, factor: float = 2.0,
                  min_scale: float = 1.0, max_scale: float = 2.0**24):
  """flax.training.dynamic_scale.DynamicScale's rule (counter, grow, halve)."""
  count = state.growth_count + 1
  grow = count >= growth_interval
  ok_scale = jnp.where(grow, jnp.minimum(state.loss_scale * factor, max_scale),
                       state.loss_scale)
  ok_count = jnp.where(grow, 0, count)
  bad_scale = jnp.maximum(state.loss_scale / factor, min_scale)
  return (jnp.where(finite, ok_scale, bad_scale).astype(jnp.float32),
          jnp.where(finite, ok_count, 0).astype(jnp.int32))


def manual_select_init(inner: optax.GradientTransformation, params) -> ManualScaleState:
  return ManualScaleState(inner.init(params), jnp.asarray(INIT_SCALE, jnp.float32),
                          jnp.zeros((), jnp.int32))


def manual_select_step(inner: optax.GradientTransformation):
  """(c) jmp/flax style: always update, then jnp.where-select params and state."""
  def step(params, state: ManualScaleState, grads):
    inv = 1.0 / state.loss_scale
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) * inv, grads)
    finite = _all_finite(grads)
    updates, new_inner = inner.update(grads, state.inner_state, params)
    new_params = optax.apply_updates(params, updates)
    new_params = _select_tree(finite, new_params, params)
    new_inner = _select_tree(finite, new_inner, state.inner_state)
    scale, count = _adjust_scale(state, finite)
    return new_params, ManualScaleState(new_inner, scale, count)
  return step


def manual_cond_step(inner: optax.GradientTransformation):
  """(g) naive lax.cond: run the update only on a finite step."""
  def step(params, state: ManualScaleState, grads):
    inv = 1.0 / state.loss_scale
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) * inv, grads)
    finite = _all_finite(grads)

    def apply(operands):
      p, s, g = operands
      updates, new_s = inner.update(g, s, p)
      return optax.apply_updates(p, updates), new_s

    def keep(operands):
      p, s, _ = operands
      return p, s

    new_params, new_inner = lax.cond(finite, apply, keep,
                                     (params, state.inner_state, grads))
    scale, count = _adjust_scale(state, finite)
    return new_params, ManualScaleState(new_inner, scale, count)
  return step


# --------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------


class Impl(NamedTuple):
  key: str
  label: str
  init: Callable[[Any], Any]          # params -> opt_state
  step: Callable[[Any, Any, Any], Any]  # (params, state, grads) -> (params, state)
  scaled_grads: bool                  # feed grads * INIT_SCALE


def _optax_step(tx: optax.GradientTransformation):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _optax_impl(key, label, tx, scaled):
  return Impl(key, label, tx.init, _optax_step(tx), scaled)


def build_impls() -> dict[str, Impl]:
  adamw = lambda: optax.adamw(1e-3)  # noqa: E731
  impls = [
      _optax_impl("a", "optax.adamw", adamw(), False),
      _optax_impl("b", "optax.apply_if_finite(adamw)",
                  optax.apply_if_finite(adamw(), max_consecutive_errors=5), False),
      Impl("c", "hand-written scale+select(adamw)",
           lambda p: manual_select_init(adamw(), p), manual_select_step(adamw()), True),
      _optax_impl("d", "mpscale.dynamic_loss_scale(adamw)",
                  mpscale.dynamic_loss_scale(adamw()), True),
      _optax_impl("e", "chain(optax.clip_by_global_norm, adamw)",
                  optax.chain(optax.clip_by_global_norm(1.0), adamw()), False),
      _optax_impl("f", "mpscale.dls(chain(mpscale.clip, adamw))",
                  mpscale.dynamic_loss_scale(optax.chain(
                      mpscale.global_norm_clip(1.0), adamw())), True),
      Impl("g", "hand-written scale+lax.cond(adamw)",
           lambda p: manual_select_init(adamw(), p), manual_cond_step(adamw()), True),
  ]
  return {i.key: i for i in impls}


# (numerator, baseline, target or None)
RATIOS = [
    ("b", "a", None),
    ("c", "a", None),
    ("d", "a", 1.05),
    ("g", "a", None),
    ("d", "c", None),
    ("f", "e", 1.00),
    ("e", "a", None),
]


# --------------------------------------------------------------------------------------
# Compiled-HLO statistics
# --------------------------------------------------------------------------------------


_DT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1,
             "u8": 1, "f64": 8, "s64": 8, "u64": 8}
_ARRAY_RE = re.compile(r"\b(f32|f16|bf16|s32|u32|pred|s8|u8|f64|s64|u64)\[([0-9,]*)\]")


def _elements(shape_str: str) -> list[int]:
  """Element counts of the arrays in one HLO shape string (tuples give several)."""
  return [math.prod(int(x) for x in dims.split(",") if x) if dims else 1
          for _, dims in _ARRAY_RE.findall(shape_str)]


def hlo_stats(compiled_text: str, big: int) -> dict:
  """Rough counts from a compiled (scheduled) module's text.

  An array counts as *big* (gradient-sized) when it has at least ``big`` elements.
  Counted over the top-level (ENTRY) instructions, each of which is one kernel / loop:

  * ``fusions`` by kind, ``copies`` (top-level ``copy``: a whole buffer duplicated,
    usually inserted to protect a donated input that is read after an in-place write),
    ``conditionals``;
  * ``big_reduce``: top-level ops that reduce a big input (one full read each);
  * ``big_reads`` / ``big_writes``: big operands read / big results written by top-level
    ops: the number of passes over gradient-sized arrays (adamw alone: per big leaf,
    3 fusions reading 7 and writing 3).
  """
  comps: dict[str, list[str]] = {}
  entry: list[str] = []
  cur = None
  for ln in compiled_text.splitlines():
    m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", ln)
    if m and not ln.startswith(" "):
      cur = "ENTRY" if m.group(1) else m.group(2)
      comps[cur] = []
      continue
    if ln.startswith("}"):
      cur = None
      continue
    if cur is not None:
      comps[cur].append(ln)
  entry = comps.get("ENTRY", [])

  def has_reduce(name, seen=()):
    for ln in comps.get(name, []):
      if re.search(r"\breduce(-window)?\(", ln):
        return True
      for callee in re.findall(r"calls=%([\w.\-]+)", ln):
        if callee not in seen and has_reduce(callee, seen + (name,)):
          return True
    return False

  shape_of: dict[str, str] = {}
  kinds: dict[str, int] = {}
  n_fusion = n_cond = n_copy = big_reduce = big_reads = big_writes = 0
  for ln in entry:
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$", ln)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    shape_of[name] = shape
    if op in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0] if op != "fusion"
                          else rest.split("), kind=")[0])
    reads = sum(1 for o in operands for n in _elements(shape_of.get(o, "")) if n >= big)
    writes = sum(1 for n in _elements(shape) if n >= big)
    big_reads += reads
    big_writes += writes
    if op == "fusion":
      n_fusion += 1
      k = re.search(r"kind=(k\w+)", rest)
      if k:
        kinds[k.group(1)] = kinds.get(k.group(1), 0) + 1
    elif op == "conditional":
      n_cond += 1
    elif op == "copy":
      n_copy += 1
    callees = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", rest)
    if reads and (op in ("reduce", "reduce-window") or any(has_reduce(c) for c in callees)):
      big_reduce += 1
  return dict(entry_fusions=n_fusion, kinds=kinds, big_reduce_ops=big_reduce,
              conditionals=n_cond, entry_copies=n_copy, big_reads=big_reads,
              big_writes=big_writes)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _ms(x):
  return f"{1e3 * x:9.2f}"


def _minflt() -> int:
  if resource is None:
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true",
                  help="1 block, vocab 4096 (14M params, 17 leaves), 5 rounds x 3 reps "
                       "(about 30 s on 2 CPU cores)")
  ap.add_argument("--rounds", type=int, default=None, help="rounds (default 12; quick 5)")
  ap.add_argument("--reps", type=int, default=None,
                  help="calls per impl per round (default 3; quick 3)")
  ap.add_argument("--layers", type=int, default=None, help="transformer blocks (3)")
  ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (8192)")
  ap.add_argument("--impls", default="abcdefg", help="which impls, e.g. 'a,c,d' or 'ad'")
  ap.add_argument("--hlo", action="store_true",
                  help="print compiled-HLO stats (fusions, copies, reductions, passes "
                       "over gradient-sized arrays, cost and memory analysis)")
  ap.add_argument("--dump-hlo", default=None, metavar="DIR",
                  help="write each impl's compiled HLO text to DIR/<key>.txt")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)

  rounds = args.rounds or (5 if args.quick else 12)
  reps = args.reps or 3
  layers = args.layers if args.layers is not None else (1 if args.quick else 3)
  vocab = args.vocab or (4096 if args.quick else 8192)
  keys = [k for k in args.impls.replace(",", "") if k.strip()]

  all_impls = build_impls()
  unknown = [k for k in keys if k not in all_impls]
  if unknown:
    ap.error(f"unknown impls {unknown}; choose from {''.join(all_impls)}")
  impls = [all_impls[k] for k in keys]

  shapes = gpt2_like_shapes(vocab=vocab, layers=layers)
  key = jax.random.PRNGKey(args.seed)
  kp, kg = jax.random.split(key)
  params0 = make_tree(shapes, kp, 0.02)
  grads = make_tree(shapes, kg, GRAD_STD)
  scaled_grads = jax.tree_util.tree_map(lambda g: g * INIT_SCALE, grads)
  leaves = jax.tree_util.tree_leaves(params0)
  n_params = sum(x.size for x in leaves)
  big = min(x.size for x in leaves if x.ndim == 2)

  dev = jax.devices()[0]
  try:
    import jaxlib  # noqa: PLC0415
    jaxlib_version = jaxlib.__version__
  except (ImportError, AttributeError):
    jaxlib_version = "?"
  print(f"jax {jax.__version__}  jaxlib {jaxlib_version}  optax {optax.__version__}  "
        f"mpscale {mpscale.__version__}  python {platform.python_version()}")
  print(f"device: {dev.platform} {dev.device_kind}  (host cpus: {os.cpu_count()})")
  print(f"tree: {len(leaves)} leaves, {n_params / 1e6:.2f}M float32 params "
        f"({4 * n_params / 2**20:.0f} MiB per tree), top-level modules: "
        f"{', '.join(shapes)}")
  print(f"timing: {rounds} rounds x {reps} reps per impl, shuffled order each round")
  print()

  # Compile each impl (donating params and opt_state) and warm it up once.
  compiled, state, compile_s, stats = {}, {}, {}, {}
  for impl in impls:
    p = copy_tree(params0)
    # Copied leaf by leaf: an eagerly built state may hold one array in several leaves
    # (mpscale's skip-state init did before b0debc8), and donating such a state fails
    # with "Attempt to donate the same buffer twice".
    s = copy_tree(impl.init(p))
    g = scaled_grads if impl.scaled_grads else grads
    jitted = jax.jit(impl.step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    c = jitted.lower(p, s, g).compile()
    compile_s[impl.key] = time.perf_counter() - t0
    p, s = c(p, s, g)
    jax.block_until_ready((p, s))
    compiled[impl.key] = c
    state[impl.key] = (p, s, g)
    if args.hlo or args.dump_hlo:
      text = c.as_text()
      if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        with open(os.path.join(args.dump_hlo, f"{impl.key}.txt"), "w") as fh:
          fh.write(text)
      st = hlo_stats(text, big)
      try:
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        st["bytes_accessed_trees"] = ca.get("bytes accessed", float("nan")) / (4 * n_params)
      except Exception:  # noqa: BLE001 -- cost analysis is optional
        st["bytes_accessed_trees"] = float("nan")
      try:
        ma = c.memory_analysis()
        st["temp_trees"] = ma.temp_size_in_bytes / (4 * n_params)
      except Exception:  # noqa: BLE001 -- memory analysis is optional
        st["temp_trees"] = float("nan")
      stats[impl.key] = st
    print(f"  compiled {impl.key}: {impl.label:<42s} {compile_s[impl.key]:6.2f} s",
          flush=True)
  print()

  # Round-robin timing.
  rng = random.Random(args.seed)
  per_round: dict[str, list[float]] = {i.key: [] for i in impls}
  faults: dict[str, list[float]] = {i.key: [] for i in impls}
  gc_was = gc.isenabled()
  gc.disable()
  try:
    for _ in range(rounds):
      order = list(impls)
      rng.shuffle(order)
      for impl in order:
        c = compiled[impl.key]
        p, s, g = state[impl.key]
        times = []
        f0 = _minflt()
        for _ in range(reps):
          t0 = time.perf_counter()
          p, s = c(p, s, g)
          jax.block_until_ready((p, s))
          times.append(time.perf_counter() - t0)
        f1 = _minflt()
        state[impl.key] = (p, s, g)
        per_round[impl.key].append(statistics.median(times))
        faults[impl.key].append((f1 - f0) / reps)
  finally:
    if gc_was:
      gc.enable()

  # Report.
  # Host minor page faults per call, in MiB touched for the first time (4 KiB pages):
  # on the CPU backend every gradient-sized scratch buffer or non-donated output is
  # freshly mapped memory on each call, and faulting it in can cost more than the
  # arithmetic. (Meaningless on GPU, where the device allocator reuses memory.)
  page = resource.getpagesize() if resource is not None else 4096
  print(f"{'impl':<5}{'':<43}{'median ms':>10}{'min ms':>10}{'max ms':>10}"
        f"{'compile s':>11}{'fault MiB':>11}")
  for impl in impls:
    t = per_round[impl.key]
    fm = statistics.median(faults[impl.key]) * page / 2**20
    print(f"  {impl.key}  {impl.label:<42s}{_ms(statistics.median(t))} {_ms(min(t))} "
          f"{_ms(max(t))}{compile_s[impl.key]:10.2f}{fm:11.0f}")
  print()
  print("paired ratios (median over rounds of impl/baseline, same round):")
  for num, den, target in RATIOS:
    if num not in per_round or den not in per_round:
      continue
    r = [x / y for x, y in zip(per_round[num], per_round[den])]
    med = statistics.median(r)
    q = sorted(r)
    lo, hi = q[len(q) // 4], q[(3 * len(q)) // 4]
    verdict = ""
    if target is not None:
      verdict = f"target <= {target:.2f}: {'PASS' if med <= target else 'MISS'}"
    print(f"  {num}/{den} = {med:6.3f}   (IQR {lo:.3f}-{hi:.3f})   {verdict}")
  if dev.platform == "cpu":
    print()
    print("note: on the CPU backend XLA has no multi-output loop fusion and allocates "
          "its scratch buffers afresh on every call (see 'fault MiB'); the targets were "
          "set for accelerators, where the update is expected to be one fused pass. "
          "See benchmarks/README.md.")

  if stats:
    print()
    print(f"compiled HLO, top-level ops (big = >= {big} elements, i.e. the matrices; "
          "bytes = cost-analysis bytes accessed, temp = scratch memory, both in units "
          "of one float32 tree):")
    for impl in impls:
      st = stats[impl.key]
      kinds = " ".join(f"{k[1:]}={v}" for k, v in sorted(st["kinds"].items()))
      print(f"  {impl.key}: fusions={st['entry_fusions']:<4d} [{kinds}]  "
            f"copies={st['entry_copies']:<3d} cond={st['conditionals']} "
            f"big_reduce={st['big_reduce_ops']:<3d} big_reads={st['big_reads']:<4d} "
            f"big_writes={st['big_writes']:<4d} "
            f"bytes/tree={st['bytes_accessed_trees']:.2f} "
            f"temp/tree={st['temp_trees']:.2f}")
  return 0


if __name__ == "__main__":
  main()
  sys.exit(0)
