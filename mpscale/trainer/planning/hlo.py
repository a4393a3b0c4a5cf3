"""What a compiled program does per step, read from its HLO text.

The text is what ``jax.jit(f).lower(*args).compile().as_text()`` prints: the
partitioned program one device runs, after XLA's passes. `parse` reads it into its
computations (``%name (params) -> type { ... }``, one instruction a line) and the
result type of every name in each; nothing is executed and JAX is not imported.

Two readings are built on it, each summed over what one step runs:

- `collectives`: each collective kind (`COLLECTIVES`) with how many run and how many
  bytes each device moves (the larger of operands and result);
- `matmul_flops`: the FLOPs of the matrix products (``dot``) and convolutions (a
  GPU program's cuBLAS and cuDNN calls of them too).

`collectives_over` splits `collectives` by the mesh axes each one spans (read from
its replica groups, or a permute's source-target pairs): what prices it on a link.

`sums` lists each all-reduce and reduce-scatter with the dtype it sums in (whether
the gradients are summed in float32 or in the compute dtype).

How a step is summed, from the entry computation down::

  cost(computation) = sum over its instructions i of
                        cost(i)
                      + trips(i) * cost(body)      i a while (XLA's known_trip_count)
                      + max over branches cost(b)  i a conditional (one branch runs)
                        (one named ``mpscale_runs_<n>_a_step``: its cheapest branch,
                        and the costliest one's excess n times a step)
                      + cost(callee)               i calls it otherwise (a fusion,
                                                   a call, a reducer)

XLA's own ``compiled.cost_analysis()`` counts a loop's body once; these readings count
it by its trip count, so a pipeline's ticks and a scan over layers are all there.

Example:

  >>> from mpscale.trainer.planning import hlo
  >>> text = '''HloModule m
  ... ENTRY %main (a: f32[64,128]) -> f32[64,128] {
  ...   %a = f32[64,128]{1,0} parameter(0)
  ...   ROOT %r = f32[64,128]{1,0} all-reduce(%a), channel_id=1, to_apply=%add
  ... }'''
  >>> hlo.collectives(text)
  {'all-reduce': {'bytes': 32768, 'count': 1}}
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, NamedTuple, Optional, Union

from mpscale.experts import TILES_SCOPE

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all", "ragged-all-to-all")
"""The collective kinds `collectives` counts (an asynchronous ``<kind>-start`` as
its kind)."""

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+"
                          r"([a-z][a-z0-9\-]*)\((.*)$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)")
_PARAM = re.compile(r"([\w.\-]+):\s*(\(?[a-z][a-z0-9]*\[[0-9,]*\])")
_PROMOTED = re.compile(r"_promoted(?:\.\d+)?$")


class Instruction(NamedTuple):
  """One line of a computation: ``name = result op(rest``."""
  name: str
  """The name it defines (without ``%``)."""
  result: str
  """Its result type as written (``f32[8,16]{1,0}``, or a tuple of them)."""
  op: str
  """The opcode (``dot``, ``all-reduce``, ``all-gather-start``, ``while``, ...)."""
  rest: str
  """Everything after the opening parenthesis: operands, then attributes."""


class Module(NamedTuple):
  """A compiled HLO module, as `parse` reads it."""
  computations: dict[str, list[Instruction]]
  """Each computation's instructions, in order, by the computation's name."""
  types: dict[str, dict[str, str]]
  """Each computation's result type of every name in it (parameters included)."""
  entry: Optional[str]
  """The entry computation's name (``None`` if the text has none)."""


def _shape_bytes(text: str, float32_bytes: int = 4) -> int:
  """Bytes of every array shape written in ``text`` (``f32[8,16]{1,0}`` is 512; a
  tuple's shapes are summed), a float32 element at ``float32_bytes``; dtypes it does
  not know count nothing."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype in _DTYPE_BYTES:
      size = float32_bytes if dtype == "f32" else _DTYPE_BYTES[dtype]
      total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


def parse(hlo: str) -> Module:
  """The `Module` of the compiled HLO text ``hlo`` (``compiled.as_text()``).

  A computation starts at an unindented line ending in ``{`` and ends at a line that
  is ``}``; within it, each ``name = type op(...)`` line is an `Instruction`."""
  computations: dict[str, list[Instruction]] = {}
  types: dict[str, dict[str, str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m:
        current = m.group(1)
        computations[current] = []
        types[current] = dict(_PARAM.findall(line.split("->")[0]))
        if line.startswith("ENTRY"):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      name = _NAME.match(line).group(1)
      computations[current].append(Instruction(name, *m.groups()))
      types[current][name] = m.group(1)
  return Module(computations, types, entry)


def _as_module(hlo: Union[str, Module]) -> Module:
  return parse(hlo) if isinstance(hlo, str) else hlo


def _callees(ins: Instruction) -> tuple[tuple[str, str], ...]:
  """``(role, computation)`` for each computation ``ins`` calls: ``body`` and
  ``condition`` of a while, ``branch`` of a conditional, ``call`` otherwise."""
  return _callees_of(ins.rest)


@functools.lru_cache(maxsize=1 << 16)
def _callees_of(rest: str) -> tuple[tuple[str, str], ...]:
  """`_callees` of an instruction's text after its op (memoised: a plan's readings
  walk each instruction several times)."""
  out = [(role if role in ("body", "condition") else
          "branch" if role.endswith("_computation") else "call", name)
         for role, name in re.findall(
             r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
             r"=%?([\w.\-]+)", rest)]
  for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
    out += [("branch", c) for c in re.findall(r"%?([\w.\-]+)", group)]
  return tuple(out)


_RUNS_A_STEP = re.compile(r'op_name="[^"]*\bmpscale_runs_(\d+)_a_step\b')
"""The name scope a pipeline puts its head's conditional in
(`mpscale.parallel.pipeline`'s ``runs_a_step``): reached every tick, its costly
branch runs ``n`` times a step (once a micro-batch, on the last stage)."""


_CLONE = re.compile(r"(\.clone(\.\d+)?)+$")
"""The suffix XLA gives a computation it copies."""


def _runs_a_step(ins: Instruction) -> Optional[int]:
  """``n`` for a conditional named to run its costly branch ``n`` times a step."""
  found = _RUNS_A_STEP.search(ins.rest) if ins.op == "conditional" else None
  return int(found.group(1)) if found else None


_Cost = Callable[[str, Instruction], dict[str, float]]
"""``cost(computation, instruction) -> {key: value}``: what one instruction costs."""


class _Totals:
  """``cost`` summed over what a computation, or one instruction, runs in a step: a
  while body its trip count times (XLA's ``known_trip_count``), a conditional its
  costliest branch (one runs; which one, the program decides; ``branch_key`` ranks
  them, by default the sum of their costs), any other called computation (fusions,
  calls) once per call. Memoised per computation.

  A conditional named to run its costly branch ``n`` times a step (`_runs_a_step`: a
  pipeline's head, which every tick reaches and the last stage runs once a
  micro-batch) counts its cheapest branch where it is, and the costliest branch's
  excess over it ``n`` times in the step (`extra`; the copies XLA makes of a
  conditional, calling ``.clone``s of its branches, together ``n`` times)."""

  def __init__(self, module: Module, cost: _Cost,
               branch_key: Optional[Callable[[dict[str, float]], Any]] = None):
    self.module, self.cost = module, cost
    self.branch_key = branch_key or (lambda d: sum(d.values()))
    self.memo: dict[str, dict[str, float]] = {}
    self.extra: dict[tuple[str, ...], tuple[int, dict[str, float]]] = {}
    """``(count, excess)`` by conditional (its branches, copies as one): what the
    step adds ``count`` times."""

  def instruction(self, name: str, ins: Instruction) -> dict[str, float]:
    """What ``ins`` (of computation ``name``) runs: itself and its callees."""
    acc = dict(self.cost(name, ins))

    def add(d: dict[str, float], times: float = 1.0) -> None:
      for k, v in d.items():
        acc[k] = acc.get(k, 0.0) + times * v

    callees = [(r, c) for r, c in _callees(ins) if c in self.module.computations]
    branches = [self.computation(c) for r, c in callees if r == "branch"]
    count = _runs_a_step(ins) if len(branches) > 1 else None
    if count is not None:
      cheap = min(branches, key=self.branch_key)
      costly = max(branches, key=self.branch_key)
      add(cheap)
      # A copy XLA made (a loop peeled off: a schedule's warm-up) calls copies of
      # the same branches, named ``<branch>.clone``: together they run n times.
      same = tuple(sorted(_CLONE.sub("", c) for r, c in callees if r == "branch"))
      self.extra[same] = (count, {
          k: costly.get(k, 0.0) - cheap.get(k, 0.0) for k in costly})
    elif branches:
      add(max(branches, key=self.branch_key))
    for role, callee in callees:
      if role == "body":
        add(self.computation(callee), _trips(ins, self.module))
      elif role == "call":
        add(self.computation(callee))
    return acc

  def computation(self, name: str) -> dict[str, float]:
    """What one run of the computation ``name`` runs."""
    if name not in self.memo:
      self.memo[name] = {}  # no recursion in HLO; a guard all the same
      acc: dict[str, float] = {}
      for ins in self.module.computations[name]:
        for k, v in self.instruction(name, ins).items():
          acc[k] = acc.get(k, 0.0) + v
      self.memo[name] = acc
    return self.memo[name]


def _per_step(module: Module, cost: _Cost,
              branch_key: Optional[Callable[[dict[str, float]], Any]] = None
              ) -> dict[str, float]:
  """The sum of ``cost`` over everything one step runs (`_Totals`, from the entry)."""
  if module.entry not in module.computations:
    return {}
  totals = _Totals(module, cost, branch_key)
  acc = dict(totals.computation(module.entry))
  for count, excess in totals.extra.values():
    for k, v in excess.items():
      acc[k] = acc.get(k, 0.0) + count * v
  return acc


def _operands(ins: Instruction) -> list[str]:
  """The operand names of an instruction (``%a, %b`` before the closing paren)."""
  return re.findall(r"%([\w.\-]+)", ins.rest.split(")", 1)[0])


def _dims(type_text: str) -> list[int]:
  m = _SHAPE.search(type_text or "")
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _promoted(ins: Instruction) -> bool:
  """Whether the backend widened this all-reduce or reduce-scatter from a 16-bit float
  the program gave it: XLA's CPU backend sums bfloat16 in float32 (its
  ``AllReducePromotion`` pass, which names the new reducer ``<name>_promoted``); GPUs
  (NCCL) and TPUs reduce bfloat16 as it is, and so would the planned run."""
  shape = _SHAPE.search(ins.result)
  return shape is not None and shape.group(1) == "f32" and any(
      _PROMOTED.search(reducer) for _, reducer in _callees(ins))


def _kind(ins: Instruction) -> str:
  """The op, an asynchronous ``<kind>-start`` read as its kind."""
  return ins.op[:-len("-start")] if ins.op.endswith("-start") else ins.op


def _moved(module: Module, name: str, ins: Instruction) -> int:
  """Bytes a collective moves per device: the larger of its operands and result, a
  widened sum at the program's 16-bit width (`_promoted`)."""
  operand_bytes = _shape_bytes(ins.rest.split("),", 1)[0]) or sum(
      _shape_bytes(module.types[name].get(o, "")) for o in _operands(ins))
  result_bytes = _shape_bytes(ins.result)
  if ins.op.endswith("-start") and ins.result.startswith("("):
    # an asynchronous start's result holds its operands beside its results
    result_bytes = max(result_bytes - operand_bytes, 0)
  moved = max(result_bytes, operand_bytes)
  if _kind(ins) == "ragged-all-to-all":
    # its buffer (the output, or the return trip's input) is sized for the worst
    # case, every row to one device: the rows sent are the smaller side's at most
    shapes = [m.group(0) for m in _SHAPE.finditer(ins.result)]
    first = shapes[0] if ins.op.endswith("-start") else module.types[name].get(
        (_operands(ins) or [""])[0], "")
    moved = min(_shape_bytes(first) or moved, _shape_bytes(shapes[-1]) or moved)
  return moved // 2 if _promoted(ins) else moved


class Sum(NamedTuple):
  """One all-reduce or reduce-scatter of a compiled program, as `sums` reads it."""
  kind: str
  """``all-reduce`` or ``reduce-scatter``."""
  dtype: str
  """The element type it sums in, as compiled (``f32``, ``bf16``): its largest
  array's."""
  widened: bool
  """The CPU backend widened it from a 16-bit float (a reducer named
  ``*_promoted``): the program sums in 16 bits, and a GPU or TPU would."""
  bytes: int
  """Bytes one run of it moves per device, at the program's width (as `collectives`
  counts them)."""
  computation: str
  """The computation holding it (a loop body, the entry, ...)."""


def sums(hlo: Union[str, Module]) -> list[Sum]:
  """Every all-reduce and reduce-scatter in the compiled HLO ``hlo`` (text, or
  `parse`'s `Module`), one `Sum` each as written (a loop's counts once): which
  dtype each sums in, the one thing `collectives` leaves out. A float32 ``Sum`` with
  ``widened`` false is a float32 sum in the program itself."""
  module = _as_module(hlo)
  out = []
  for name, instructions in module.computations.items():
    for ins in instructions:
      kind = _kind(ins)
      if kind not in ("all-reduce", "reduce-scatter"):
        continue
      shapes = [(_shape_bytes(f"{d}[{dims}]"), d) for d, dims in _SHAPE.findall(
          ins.result) if d in _DTYPE_BYTES]
      dtype = max(shapes)[1] if shapes else ""
      out.append(Sum(kind, dtype, _promoted(ins), _moved(module, name, ins), name))
  return out


def collectives(hlo: Union[str, Module]) -> dict[str, dict[str, int]]:
  """Each collective kind in the compiled HLO ``hlo`` (text, or `parse`'s `Module`):
  ``{kind: {"bytes": ..., "count": ...}}``, how many run per step and how many bytes
  they move per device (the larger of operands and result: an all-gather's gathered
  result, a reduce-scatter's full operand; a tuple-shaped collective, all its
  arrays). An op in a ``while`` body counts its loop's trip count times (XLA's
  ``known_trip_count``), nested loops multiplied; in a conditional, the costliest
  branch counts; an asynchronous pair (``-start``/``-done``) counts once. A bfloat16
  sum that XLA's CPU backend widened to float32 (a reducer named ``*_promoted``)
  counts at bfloat16's bytes, as a GPU or TPU moves it. Kinds that do not occur are
  left out.
  """
  module = _as_module(hlo)

  def cost(name: str, ins: Instruction) -> dict[str, float]:
    kind = _kind(ins)
    if kind not in COLLECTIVES:
      return {}
    return {f"{kind}/count": 1, f"{kind}/bytes": _moved(module, name, ins)}

  out: dict[str, dict[str, int]] = {}
  for key, value in sorted(_per_step(module, cost).items()):
    kind, field = key.split("/")
    out.setdefault(kind, {})[field] = int(value)
  return out


def largest_collective(hlo: Union[str, Module], kind: str) -> int:
  """The bytes of the largest single ``kind`` collective (``"all-gather"``, ...) in
  the compiled HLO ``hlo``, per device, as `collectives` counts one; 0 without one.
  Under FSDP the largest all-gather is the most of the weights gathered at once by
  one op: a layer's (or one weight's) where they are gathered where used, the whole
  model's where they are gathered when the step starts.

  Example:

    >>> from mpscale.trainer.planning import hlo
    >>> text = '''HloModule m
    ... ENTRY %main (a: f32[8,128]) -> f32[32,128] {
    ...   %a = f32[8,128]{1,0} parameter(0)
    ...   ROOT %g = f32[32,128]{1,0} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
    ... }'''
    >>> hlo.largest_collective(text, "all-gather")
    16384
  """
  module = _as_module(hlo)
  return max((_moved(module, name, ins) for name, body in module.computations.items()
              for ins in body if _kind(ins) == kind), default=0)


_ALIASES = ("bitcast", "get-tuple-element", "all-gather-done", "copy-start",
            "copy-done")
"""Ops whose result is (a view of) their operand's buffer, for liveness."""


def gathered_alive(hlo: Union[str, Module]) -> int:
  """The most all-gathered bytes a device holds at once in the compiled HLO
  ``hlo``: in each computation's order (a compiled program's schedule), each
  all-gather's result lives from the gather (an asynchronous one's start) to its
  last use, through views of it; the largest sum of those alive together, over the
  computations (a loop body counts one trip: under FSDP that gathers a layer at a
  time, one layer's weights and the next one's prefetched; gathered when the step
  starts, the whole model's).

  Example:

    >>> from mpscale.trainer.planning import hlo
    >>> text = '''HloModule m
    ... ENTRY %main (a: f32[8,128], b: f32[8,128]) -> f32[32,128] {
    ...   %a = f32[8,128]{1,0} parameter(0)
    ...   %b = f32[8,128]{1,0} parameter(1)
    ...   %ga = f32[32,128]{1,0} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
    ...   %ea = f32[32,128]{1,0} exponential(%ga)
    ...   %gb = f32[32,128]{1,0} all-gather(%b), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
    ...   ROOT %s = f32[32,128]{1,0} add(%ea, %gb)
    ... }'''
    >>> hlo.gathered_alive(text)  # %ga dies at its last use, before %gb
    16384
  """
  module = _as_module(hlo)
  best = 0
  for body in module.computations.values():
    position = {ins.name: i for i, ins in enumerate(body)}
    owner: dict[str, str] = {}  # a view's name -> the gather it shows
    size: dict[str, int] = {}
    for ins in body:
      if _kind(ins) == "all-gather":
        owner[ins.name] = ins.name
        size[ins.name] = _shape_bytes(ins.result) if ins.op == "all-gather" else 0
      elif ins.op in _ALIASES and _operands(ins) and _operands(ins)[0] in owner:
        owner[ins.name] = owner[_operands(ins)[0]]
        if ins.op == "all-gather-done":
          size[owner[ins.name]] = _shape_bytes(ins.result)
    last = {g: position[g] for g in size}
    for ins in body:
      for operand in _operands(ins):
        if operand in owner:
          last[owner[operand]] = max(last[owner[operand]], position[ins.name])
    alive = 0
    for _, change in sorted([(position[g], size[g]) for g in size]
                            + [(last[g] + 0.5, -size[g]) for g in size]):
      alive += change
      best = max(best, alive)
  return best


def saved_for_backward(hlo: Union[str, Module]) -> Optional[int]:
  """The activations a device keeps for the backward in the compiled HLO ``hlo``
  of a layer loop (`lax.scan`): the stacked buffers a ``while`` loop writes (a
  state element its body does not pass through unchanged, whose leading dimension
  is the trip count: one slice a trip) that a later ``while`` loop of the same
  computation reads: the forward's residuals handed to the backward. Their bytes,
  the largest over the computations (one micro-batch's, where an outer loop runs
  them); ``None`` where no loop hands a stack to another (layers unrolled)."""
  module = _as_module(hlo)
  best = None
  for body in module.computations.values():
    loops = [ins for ins in body if ins.op == "while"]
    if len(loops) < 2:
      continue
    by_name = {ins.name: ins for ins in body}
    read: set[str] = set()
    for loop in loops:
      state = by_name.get((_operands(loop) or [""])[0])
      read.update(_operands(state) if state is not None and state.op == "tuple"
                  else _operands(loop))
    total = 0
    for ins in body:
      loop = by_name.get((_operands(ins) or [""])[0])
      index = re.search(r"index=(\d+)", ins.rest)
      if (ins.op != "get-tuple-element" or ins.name not in read or loop is None
          or loop.op != "while" or not index):
        continue
      dims = _dims(ins.result)
      if dims and dims[0] == _trips(loop, module) > 1 and _written(module, loop,
                                                           int(index.group(1))):
        total += _shape_bytes(ins.result)
    if total:
      best = max(best or 0, total)
  return best


def _written(module: Module, loop: Instruction, index: int) -> bool:
  """Whether the body of the ``while`` ``loop`` writes element ``index`` of its
  state (its root does not pass the element through from its parameter)."""
  body = dict(_callees(loop)).get("body", "")
  instructions = module.computations.get(body, [])
  if not instructions or instructions[-1].op != "tuple":
    return False
  by_name = {ins.name: ins for ins in instructions}
  operands = _operands(instructions[-1])
  if index >= len(operands):
    return False
  element = _through(by_name, by_name.get(operands[index]))
  if element is None or element.op != "get-tuple-element":
    return True
  source = by_name.get((_operands(element) or [""])[0])
  same = re.search(r"index=(\d+)", element.rest)
  return not (source is not None and source.op == "parameter" and same is not None
              and int(same.group(1)) == index)


def matmul_flops(hlo: Union[str, Module]) -> float:
  """FLOPs of the matrix products (``dot``: ``2 * prod(result) * prod(contracted
  dims)``), convolutions (``2 * prod(result) * prod(kernel) / kernel output
  features``) and library calls of them (cuBLAS, cuDNN's fused attention:
  `_library_flops`) in the compiled HLO ``hlo`` (text, or `parse`'s `Module`) per step,
  counted as in `collectives` (loop trip counts, which XLA's own cost analysis counts
  once; a conditional's costliest branch). Elementwise work is left out: a small
  share of a transformer's or a CNN's."""
  module = _as_module(hlo)

  def cost(name: str, ins: Instruction) -> dict[str, float]:
    flops = _product_flops(module, name, ins)
    return {"flops": flops} if flops else {}

  return _per_step(module, cost).get("flops", 0.0)


def fp8_flops(hlo: Union[str, Module]) -> float:
  """The part of `matmul_flops` whose products take 8-bit float operands: FP8 GEMMs
  (a ``dot`` or ``convolution`` of ``f8e4m3fn``/``f8e5m2`` operands, as in a Triton
  GEMM fusion, or cuBLAS's ``__cublas$lt$matmul$f8``), counted per step as
  `matmul_flops` counts. A CPU compile widens 8-bit operands before its products,
  so it finds none there. A conditional counts the branch `matmul_flops` counts;
  where its branches' products tie (a layer in FP8 or in bf16, chosen at run time:
  a pipeline's `mpscale.trainer.models.lm.TinyLM` blocks), the one with the fewest
  FP8 FLOPs, the slower: the plan cannot tell which runs."""
  module = _as_module(hlo)

  def cost(name: str, ins: Instruction) -> dict[str, float]:
    flops = _product_flops(module, name, ins)
    types = module.types[name]
    operands = _operands(ins)[:2]
    if flops and len(operands) == 2 and all(
        types.get(o, "").startswith("f8") for o in operands):
      return {"flops": flops, "all": flops}
    return {"all": flops} if flops else {}

  def branch_key(d: dict[str, float]) -> tuple[float, float]:
    return d.get("all", 0.0), -d.get("flops", 0.0)

  return _per_step(module, cost, branch_key).get("flops", 0.0)


_GROUPS = re.compile(r"replica_groups=(\{(?:\{[0-9,]*\},?)*\}|\[[0-9,]+\]<=\[[0-9,]+\]"
                     r"(?:T\([0-9,]+\))?)")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?|"
    r"[0-9,]+)\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


def replica_groups(ins: Instruction, num_devices: int) -> list[list[int]]:
  """The device groups of a collective: its ``replica_groups``, written out
  (``{{0,2},{1,3}}``), in XLA's iota form (``[2,2]<=[4]``, ``[4,2]<=[2,2,2]T(1,0,2)``:
  ``iota(prod(dims)).reshape(dims).transpose(perm).reshape(groups, size)``) or in its
  mesh form (``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: the devices that differ
  along the braced axes, `_mesh_groups`); a
  collective-permute's source-target pairs, each a group of two; one group of every
  device when none are given. Ids are positions in the program's device assignment
  (a mesh's devices in row-major order)."""
  pairs = _PAIRS.search(ins.rest)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
  mesh = _MESH_GROUPS.search(ins.rest)
  if mesh:
    return _mesh_groups(*mesh.groups())
  m = _GROUPS.search(ins.rest)
  if m is None or m.group(1) == "{}":
    return [list(range(num_devices))]
  text = m.group(1)
  if text.startswith("{"):
    return [[int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([0-9,]*)\}", text[1:-1])]
  shape, rest = text.split("<=")
  groups, size = (int(d) for d in shape.strip("[]").split(","))
  dims = [int(d) for d in rest.split("]")[0].strip("[").split(",")]
  perm = re.search(r"T\(([0-9,]+)\)", rest)
  order = [int(p) for p in perm.group(1).split(",")] if perm else list(range(len(dims)))
  ids = _transposed_iota(dims, order)
  return [ids[g * size:(g + 1) * size] for g in range(groups)]


def _mesh_groups(axes_text: str, ids_text: Optional[str], over_text: str
                 ) -> list[list[int]]:
  """The groups of XLA's mesh form, ``mesh['a'=4,'b'=2] {'a'}`` (optionally with
  ``device_ids=([2,4]T(1,0))`` or a list, the device at each mesh position in
  row-major order): the devices that differ only along the braced axes."""
  axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", axes_text)]
  names, sizes = [a for a, _ in axes], [n for _, n in axes]
  over = set(re.findall(r"'([^']+)'", over_text))
  total = math.prod(sizes)
  if ids_text is None:
    ids = list(range(total))
  elif ids_text.startswith("["):
    dims = [int(d) for d in ids_text[1:ids_text.index("]")].split(",")]
    perm = re.search(r"T\(([0-9,]+)\)", ids_text)
    order = ([int(p) for p in perm.group(1).split(",")] if perm
             else list(range(len(dims))))
    ids = _transposed_iota(dims, order)
  else:
    ids = [int(i) for i in ids_text.split(",") if i]
  strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
  groups: dict[tuple[int, ...], list[int]] = {}
  for position in range(total):
    coords = [(position // strides[k]) % sizes[k] for k in range(len(sizes))]
    key = tuple(c for k, c in enumerate(coords) if names[k] not in over)
    groups.setdefault(key, []).append(ids[position])
  return list(groups.values())


def _transposed_iota(dims: list[int], order: list[int]) -> list[int]:
  """``iota(prod(dims)).reshape(dims).transpose(order).flatten()``, without numpy."""
  strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
  shape = [dims[o] for o in order]
  out = []
  for flat in range(math.prod(shape)):
    index, rem = [], flat
    for n in reversed(shape):
      index.append(rem % n)
      rem //= n
    index.reverse()
    out.append(sum(index[k] * strides[order[k]] for k in range(len(order))))
  return out


def group_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """The mesh axes (in mesh order) along which the devices of some group differ:
  the axes a collective over ``groups`` spans, device ``i`` at row-major position
  ``i`` of a mesh of ``mesh_shape`` (``{axis: size}``, in order)."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())

  def coords(i: int) -> list[int]:
    out = []
    for n in reversed(sizes):
      out.append(i % n)
      i //= n
    return out[::-1]

  spans = set()
  for group in groups:
    points = [coords(i) for i in group]
    spans.update(k for k in range(len(names))
                 if len({p[k] for p in points}) > 1)
  return tuple(names[k] for k in sorted(spans))


def collectives_over(hlo: Union[str, Module], mesh_shape: dict[str, int]
                    ) -> dict[str, dict[str, int]]:
  """`collectives` split by the mesh axes each spans: ``{"<kind> over <axes>":
  {"bytes": ..., "count": ...}}``, ``<axes>`` the spanned axes joined by ``,`` (see
  `group_axes`; ``-`` for a collective within one device). Counted per step as
  `collectives` counts (loops by their trip counts, a conditional's costliest
  branch, a widened bfloat16 sum at bfloat16's bytes).

  Example:

    >>> from mpscale.trainer.planning import hlo
    >>> text = '''HloModule m
    ... ENTRY %main (a: f32[64,128]) -> f32[64,128] {
    ...   %a = f32[64,128]{1,0} parameter(0)
    ...   ROOT %r = f32[64,128]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,2},{1,3}}, use_global_device_ids=true, to_apply=%add
    ... }'''
    >>> hlo.collectives_over(text, {"data": 2, "tensor": 2})
    {'all-reduce over data': {'bytes': 32768, 'count': 1}}
  """
  module = _as_module(hlo)
  devices = math.prod(mesh_shape.values())

  def cost(name: str, ins: Instruction) -> dict[str, float]:
    kind = _kind(ins)
    if kind not in COLLECTIVES:
      return {}
    axes = ",".join(group_axes(replica_groups(ins, devices), mesh_shape)) or "-"
    key = f"{kind} over {axes}"
    return {f"{key}/count": 1, f"{key}/bytes": _moved(module, name, ins)}

  out: dict[str, dict[str, int]] = {}
  for key, value in sorted(_per_step(module, cost).items()):
    kind, field = key.rsplit("/", 1)
    out.setdefault(kind, {})[field] = int(value)
  return out


# ------------------------------------------------------------------ kernels

_FREE = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
    "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
    "add-dependency", "domain", "copy-done", "send-done", "recv-done", "iota"))
"""Ops that move no array through memory of their own: bookkeeping, control flow
(its bodies are counted), a constant baked into the program, the second half of an
asynchronous pair."""


def _fused(module: Module) -> set[str]:
  """Computations that run inside another instruction (a fusion's body, a reducer,
  a while condition, a sort's comparator): their instructions are not kernels."""
  out = set()
  for instructions in module.computations.values():
    for ins in instructions:
      for role, callee in _callees(ins):
        if role == "condition" or (role == "call" and ins.op != "call"):
          out.add(callee)
  return out


def _users(instructions: list[Instruction]) -> dict[str, list[tuple[Instruction, int]]]:
  """Each name's users in a computation, with the operand position it takes."""
  out: dict[str, list[tuple[Instruction, int]]] = {}
  for ins in instructions:
    for k, operand in enumerate(_operands(ins)):
      out.setdefault(operand, []).append((ins, k))
  return out


def _accessed(module: Module, name: str, ins: Instruction,
              float32_bytes: int = 4) -> int:
  """Bytes a kernel reads and writes once: its operands and result, except that a
  dynamic slice reads only its slice of a buffer and an in-place dynamic update
  writes only its update (a scan reading one layer's weights from the stacked ones,
  or writing one layer's activations into the stack, touches that layer alone)."""
  types = module.types[name]
  if ins.op == "dynamic-slice":
    return 2 * _shape_bytes(ins.result, float32_bytes)
  if ins.op == "dynamic-update-slice":
    operands = _operands(ins)
    return (2 * _shape_bytes(types.get(operands[1], ""), float32_bytes)
            if len(operands) > 1 else 0)
  operands = _operands(ins)
  body = None
  if ins.op == "fusion":
    called = [c for r, c in _callees(ins) if c in module.computations]
    body = called[0] if called else None
  if body is None:
    return _shape_bytes(ins.result, float32_bytes) + sum(
        _shape_bytes(types.get(o, ""), float32_bytes) for o in operands)
  # A fusion: its parameters as its body reads them, its root as it writes it.
  inner = module.computations[body]
  inner_types = module.types[body]
  params = _parameters(inner)
  by_name = {x.name: x for x in inner}
  root = inner[-1] if inner else None
  roots = ([by_name.get(o) for o in _operands(root)]
           if root is not None and root.op == "tuple" else [root])
  # A root may write its update through a change of type or layout: the CPU
  # backend widens a 16-bit stack, ``convert(dynamic-update-slice(convert(p), u))``,
  # and still updates ``p`` in place.
  updates = {}
  for r in roots:
    dus = _through(by_name, r)
    if dus is not None and dus.op == "dynamic-update-slice" and len(_operands(dus)) > 1:
      updates[r.name] = dus
  in_place = set()
  for dus in updates.values():
    base = _through(by_name, by_name.get(_operands(dus)[0]))
    in_place.add(base.name if base is not None else _operands(dus)[0])
  total = 0
  for k, operand in enumerate(operands):
    p = params.get(k)
    full = _shape_bytes(types.get(operand, ""), float32_bytes)
    if p is None:
      total += full
      continue
    if p.name in in_place:
      continue  # updated in place: the update is counted as the result
    sliced = _sliced(module, body, p, float32_bytes)
    total += full if sliced is None else sliced
  for r in roots:
    if r is None:
      continue
    dus = updates.get(r.name)
    if dus is not None:
      # The update's elements, at the width the root stores them.
      update = math.prod(_dims(inner_types.get(_operands(dus)[1], "")))
      whole = math.prod(_dims(r.result)) or 1
      total += _shape_bytes(r.result, float32_bytes) * update // whole
    else:
      total += _shape_bytes(r.result, float32_bytes)
  return total


def _parameters(computation: list[Instruction]) -> dict[int, Instruction]:
  """A computation's parameters by number."""
  params = {}
  for x in computation:
    if x.op == "parameter":
      m = re.match(r"\s*(\d+)", x.rest)
      if m:
        params[int(m.group(1))] = x
  return params


_ELEMENTWISE = frozenset((
    "abs", "add", "clamp", "compare", "convert", "divide", "exponential", "maximum",
    "minimum", "multiply", "negate", "power", "rsqrt", "select", "sqrt", "subtract"))
"""Element-wise ops: a fused kernel computes an element of their result from the
same element of each operand of its shape."""


def _read_through(users: dict[str, list[tuple[Instruction, int]]], user: Instruction,
                  of: Instruction, depth: int = 0) -> Optional[float]:
  """The share of ``of``'s elements a fused kernel reads through ``user``, one of its
  readers: a static ``slice`` reads its slice; an element-wise op of ``of``'s shape
  what its own readers read of it (a parameter's update reading its layer of a
  stacked momentum, ``slice(m * f)``); ``None`` for anything else (read whole)."""
  if user.op == "slice":
    return math.prod(_dims(user.result)) / (math.prod(_dims(of.result)) or 1)
  uses = users.get(user.name, [])
  if (user.op not in _ELEMENTWISE or _dims(user.result) != _dims(of.result)
      or not uses or depth > 32):
    return None
  share = 0.0
  for reader, _ in uses:
    got = _read_through(users, reader, user, depth + 1)
    if got is None:
      return None
    share += got
  return min(share, 1.0)


def _sliced(module: Module, body: str, param: Instruction,
            float32_bytes: int) -> Optional[int]:
  """The bytes fusion computation ``body`` reads of its parameter ``param`` when it
  reads only dynamic slices or gathers of it (a loss picking each target's logit),
  or static slices of it or of element-wise ops of its shape (`_read_through`),
  directly or through the fusions it nests (libtpu slices one layer's weights from
  the stack in a fusion of its own inside the product's); ``None`` when it reads the
  whole."""
  users = _users(module.computations[body])
  uses = users.get(param.name, [])
  if not uses:
    return None
  total = 0
  for user, pos in uses:
    if user.op in ("dynamic-slice", "gather") and pos == 0:
      total += _shape_bytes(user.result, float32_bytes)
      continue
    if user.op == "slice" or user.op in _ELEMENTWISE:
      share = _read_through(users, user, param)
      if share is None:
        return None
      total += int(share * _shape_bytes(param.result, float32_bytes))
      continue
    called = [c for r, c in _callees(user) if c in module.computations]
    inner = _parameters(module.computations[called[0]]).get(pos) if (
        user.op == "fusion" and called) else None
    got = None if inner is None else _sliced(module, called[0], inner, float32_bytes)
    if got is None:
      return None
    total += got
  return total


_RELAYOUT = ("convert", "bitcast", "copy")
"""Ops a fusion may wrap around an in-place update without changing what it
touches: a change of element type (the CPU backend's widened 16-bit buffers) or of
layout."""


def _through(by_name: dict[str, Instruction],
             ins: Optional[Instruction]) -> Optional[Instruction]:
  """``ins`` with any `_RELAYOUT` ops above it looked through."""
  while ins is not None and ins.op in _RELAYOUT and _operands(ins):
    ins = by_name.get(_operands(ins)[0])
  return ins


def launches(hlo: Union[str, Module]) -> int:
  """How many kernels one step of the compiled HLO ``hlo`` launches per device: the
  instructions of the entry, of each loop body (times its trip count) and of a
  conditional's costliest branch, other than bookkeeping (`kernels`' free ops) and the
  second halves of asynchronous pairs; a fusion, a copy, a collective, a library call
  is one each. On a GPU each is a launch (or a node of a command buffer), a cost of
  its own beside the bytes it moves.

  Example:

    >>> from mpscale.trainer.planning import hlo
    >>> text = '''HloModule m
    ... ENTRY %main (a: f32[8]) -> f32[8] {
    ...   %a = f32[8]{0} parameter(0)
    ...   %e = f32[8]{0} exponential(%a)
    ...   ROOT %n = f32[8]{0} negate(%e)
    ... }'''
    >>> hlo.launches(text)
    2
  """
  module = _as_module(hlo)
  fused = _fused(module)

  def cost(name: str, ins: Instruction) -> dict[str, float]:
    if name in fused or ins.op in _FREE or ins.op.endswith("-done"):
      return {}
    return {"launches": 1}

  return int(round(_per_step(module, cost).get("launches", 0.0)))


def _product_flops(module: Module, name: str, ins: Instruction) -> float:
  """The FLOPs of one ``dot``, ``convolution`` or library call of matrix products
  (`_library_flops`; 0 for any other op)."""
  if ins.op == "dot":
    return _dot_flops(module, name, ins)
  if ins.op == "convolution":
    return _conv_flops(module, name, ins)
  if ins.op == "custom-call":
    return _library_flops(module, name, ins)
  return 0.0


_CUDNN_CONV_ROLES = {"__cudnn$convBackwardInput": ("result", 1, 0),
                     "__cudnn$convBackwardFilter": (0, "result", 1)}
"""Where a cuDNN convolution call (``__cudnn$conv...``) holds the input, the kernel
and the output of the forward convolution its ``window`` and ``dim_labels`` describe:
an operand's index, or its first output (``result``). The backward calls compute the
input's or the kernel's gradient of that convolution; every forward call
(``convForward``, the fused ``convBiasActivationForward``, ``convForwardGraph``)
takes ``(input, kernel, ...)`` and writes the output."""

_FMHA_PRODUCTS = {"forward": 2, "backward": 5}
"""Matrix products of fused attention over the ``[T, S]`` scores, each ``2 * B * H
* T * S * D`` FLOPs: forward ``Q K^T`` and ``P V``; backward the scores recomputed,
``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K``, ``dK = dS^T Q`` (FlashAttention-2's
count, Dao 2023)."""


def _library_flops(module: Module, name: str, ins: Instruction) -> float:
  """The FLOPs of a library call that multiplies matrices (a GPU program's), as its
  ``backend_config`` describes it:

  - cuBLAS (``__cublas$gemm``, ``__cublas$lt$matmul``): ``2 * prod(result) *
    prod(contracted dims)``, the result the call's first output;
  - cuDNN fused attention (``__cudnn$fmha...``): `_FMHA_PRODUCTS` over the scores'
    ``intermediate_tensor_shape`` ``[B, H, T, S]`` and the head size ``D`` (its
    first output's last dimension), halved under a causal mask (the kernels skip
    the tiles above the diagonal);
  - cuDNN convolutions (``__cudnn$conv...``), forward or either gradient:
    `_window_flops` of the forward convolution the call's ``window`` and
    ``dim_labels`` describe (`_CUDNN_CONV_ROLES`), as a ``convolution`` of the
    CPU's program is counted (each gradient's plain ``convolution`` there counts
    the forward's taps too).

  Any other call (a sort, a random-number generator, a user's kernel whose work the
  program does not state) counts 0 here and its bytes as any kernel's."""
  target = re.search(r'custom_call_target="([^"]+)"', ins.rest)
  if not target:
    return 0.0
  target = target.group(1)
  first = _dims(ins.result)  # the first output's
  if target.startswith("__cublas$"):
    operands = _operands(ins)
    lhs = _dims(module.types[name].get(operands[0], "")) if operands else []
    m = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', ins.rest)
    contracted = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
    if not lhs or not contracted:
      return 0.0
    return 2.0 * math.prod(first) * math.prod(lhs[d] for d in contracted)
  if target.startswith("__cudnn$fmha"):
    scores = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?'
                       r'"dimensions":\s*\[([^\]]*)\]', ins.rest)
    if not scores or not first:
      return 0.0
    products = _FMHA_PRODUCTS["backward" if "Backward" in target else "forward"]
    flops = 2.0 * products * math.prod(
        int(d) for d in re.findall(r"\d+", scores.group(1))) * first[-1]
    return flops / 2 if '"mask_type":"CAUSAL"' in ins.rest.replace(" ", "") else flops
  if target.startswith("__cudnn$conv"):
    operands = [_dims(module.types[name].get(o, "")) for o in _operands(ins)]
    shapes = [first if role == "result" else operands[role] if role < len(operands)
              else [] for role in _CUDNN_CONV_ROLES.get(target, (0, 1, "result"))]
    return _window_flops(*shapes, ins.rest) if all(shapes) else 0.0
  return 0.0


def _conv_flops(module: Module, name: str, ins: Instruction) -> float:
  """``2 *`` the multiply-adds of one ``convolution``, as XLA's cost analysis counts
  them (`_window_flops` of its operands and result)."""
  types = module.types[name]
  operands = _operands(ins)
  if len(operands) < 2:
    return 0.0
  lhs, rhs = (_dims(types.get(o, "")) for o in operands[:2])
  return _window_flops(lhs, rhs, _dims(ins.result), ins.rest)


def _window_flops(lhs: list[int], rhs: list[int], out: list[int], attrs: str) -> float:
  """``2 *`` the multiply-adds of a convolution of input ``lhs`` and kernel ``rhs``
  into ``out`` (their dimensions) whose ``dim_labels`` (``b01f_01io->b01f``) and
  ``window`` are written in ``attrs``: for each output element (batch x output
  features), each kernel tap that lands on a real input element (not padding, not a
  hole of ``lhs_dilate``) times the kernel's input features (per feature group)."""
  labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attrs)
  if not labels:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  if not (len(lhs) == len(lhs_l) and len(rhs) == len(rhs_l) and len(out) == len(out_l)):
    return 0.0
  window = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in (window.group(1).split() if window else ()))
  spatial = len(lhs_l) - 2

  def per_dim(key, default):
    if key not in fields:
      return [default] * spatial
    return [tuple(int(v) for v in x.split("_")) if "_" in x else int(x)
            for x in fields[key].split("x")]

  strides, pads = per_dim("stride", 1), per_dim("pad", (0, 0))
  lhs_dilate, rhs_dilate = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
  taps = 1
  for d in range(spatial):
    size, k, o = (dims[l.index(str(d))] for dims, l in ((lhs, lhs_l), (rhs, rhs_l),
                                                         (out, out_l)))
    last = (size - 1) * lhs_dilate[d]
    taps *= sum(1 for j in range(o) for t in range(k)
                if 0 <= (p := j * strides[d] + t * rhs_dilate[d] - pads[d][0]) <= last
                and p % lhs_dilate[d] == 0)
  return 2.0 * (out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
                * taps)


def _dot_flops(module: Module, name: str, ins: Instruction) -> float:
  """``2 * prod(result) * prod(contracted dims)`` of one ``dot``."""
  operands = _operands(ins)
  lhs = _dims(module.types[name].get(operands[0], "")) if operands else []
  m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.rest)
  contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if (
      m and lhs) else 1
  return 2.0 * math.prod(_dims(ins.result)) * contracted


class Kernels(NamedTuple):
  """What one step's kernels do per device, for a roofline (`kernels`)."""
  dots: list[tuple[float, float, int]]
  """Each distinct matrix-product kernel as ``(flops, bytes, count)``: the FLOPs and
  the bytes of one run, and how many runs a step makes (loops by their trip counts).
  A fusion holding a ``dot`` is one such kernel (its FLOPs the ``dot``'s, its bytes
  the fusion's)."""
  bytes: float
  """Bytes every other kernel (elementwise fusions, reductions, copies, slices)
  reads and writes per step; collectives excluded (`collectives` counts them)."""


def kernels(hlo: Union[str, Module], float32_bytes: int = 4) -> Kernels:
  """The kernels one step of the compiled HLO ``hlo`` runs per device (text, or
  `parse`'s `Module`), counted as `collectives` counts (loops by their trip counts,
  a conditional's costliest branch): the matrix products with their FLOPs and bytes,
  and the bytes of all the rest (`Kernels`).

  A kernel is an instruction of the entry, of a loop body or of a branch: a fusion
  runs as one, reading its operands and writing its result once. A dynamic slice
  reads only its slice and an in-place dynamic update writes only its update, inside
  a fusion or not (`_accessed`). Collectives and bookkeeping (tuples, bitcasts,
  parameters, constants) move nothing here. These are the compiling backend's
  kernels: the CPU backend fuses less than a GPU's and computes 16-bit matrix
  products in float32, so its bytes are an upper bound for a GPU's. Under a 16-bit
  compute dtype, ``float32_bytes=2`` counts the float32 arrays of the program at 16
  bits, as a GPU or TPU would hold the CPU backend's widened ones (the float32 master
  weights and optimizer moments, a small share of a large step's traffic, are then
  undercounted by half).

  Example:

    >>> from mpscale.trainer.planning import hlo
    >>> text = '''HloModule m
    ... ENTRY %main (a: f32[64,128], b: f32[128,32]) -> f32[64,32] {
    ...   %a = f32[64,128]{1,0} parameter(0)
    ...   %b = f32[128,32]{1,0} parameter(1)
    ...   %d = f32[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ...   ROOT %e = f32[64,32]{1,0} exponential(%d)
    ... }'''
    >>> hlo.kernels(text)
    Kernels(dots=[(524288.0, 57344.0, 1)], bytes=16384.0)
  """
  module = _as_module(hlo)
  return _as_kernels(_per_step(module, _kernel_cost(module, float32_bytes)))


def _fused_flops(module: Module, ins: Instruction) -> float:
  """The product FLOPs inside fusion ``ins``, through the fusions it nests (a TPU
  program fuses a product into the one that consumes it: ``kOutput`` in
  ``kOutput``)."""
  total = 0.0
  for _, c in _callees(ins):
    for x in module.computations.get(c, ()):
      total += (_fused_flops(module, x) if x.op == "fusion"
                else _product_flops(module, c, x))
  return total


def _kernel_cost(module: Module, float32_bytes: int = 4) -> _Cost:
  """The `_Cost` of a kernel for `kernels`: ``{"dot <flops> <bytes>": 1}`` for a
  matrix product (or a fusion holding one), ``{"bytes": <bytes>}`` for any other."""
  fused = _fused(module)

  def cost(name: str, ins: Instruction) -> dict[str, float]:
    if name in fused or ins.op in _FREE or _kind(ins) in COLLECTIVES or (
        ins.op.endswith("-done")):
      return {}
    moved = _accessed(module, name, ins, float32_bytes)
    flops = _product_flops(module, name, ins)
    if ins.op in ("dot", "convolution") or flops:
      return {f"dot {flops!r} {moved}": 1}
    if ins.op == "fusion":
      flops = _fused_flops(module, ins)
      if flops:
        return {f"dot {flops!r} {moved}": 1}
    return {"bytes": moved}

  return cost


def _as_kernels(totals: dict[str, float]) -> Kernels:
  dots = []
  for key, count in sorted(totals.items()):
    if key.startswith("dot "):
      _, flops, moved = key.split()
      dots.append((float(flops), float(moved), int(round(count))))
  return Kernels(dots, totals.get("bytes", 0.0))


def _trips(ins: Instruction, module: Optional[Module] = None) -> int:
  """A while loop's trip count: XLA's ``known_trip_count``; a tiled grouped
  product's (`mpscale.experts.grouped_matmul`), whose trip count is the data's, the
  tiles an even load runs (its name scope, ``mpscale_tiles=N``); else, with
  ``module``,
  the bound of a condition ``counter < constant(N)`` (libtpu's programs carry no
  ``known_trip_count``; a JAX loop's counter starts at 0); else 1."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
  if m:
    return int(m.group(1))
  m = re.search(rf'op_name="[^"]*{re.escape(TILES_SCOPE)}(\d+)', ins.rest)
  if m:  # a tiled grouped product's loop: the tiles an even load runs
    return int(m.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", ins.rest)
  if module is None or not cond or cond.group(1) not in module.computations:
    return 1
  body = module.computations[cond.group(1)]
  constants = {x.name: x.rest for x in body if x.op == "constant"}
  root = body[-1]
  if root.op != "compare" or "direction=LT" not in root.rest:
    return 1
  operands = _operands(root)
  bound = re.match(r"(\d+)\)", constants.get(operands[-1], "")) if operands else None
  return int(bound.group(1)) if bound else 1


class Overlap(NamedTuple):
  """One asynchronous collective of a scheduled program and the work XLA placed
  between its start and its done, which runs while it transfers (`overlaps`)."""
  collective: str
  """``"<kind> over <axes>"``, as `collectives_over` keys it."""
  bytes: int
  """Bytes it moves per device, once (as `collectives_over` counts them)."""
  count: int
  """How many times a step runs it (loops by their trip counts)."""
  window: Kernels
  """The kernels between its start and its done, once (a loop or call among them
  with all it runs)."""


def overlaps(hlo: Union[str, Module], mesh_shape: dict[str, int],
             float32_bytes: int = 4) -> list[Overlap]:
  """The asynchronous collectives (``<kind>-start`` ... ``<kind>-done``) of a
  scheduled compiled program, each with the kernels scheduled between its two
  halves: the work that runs while it transfers. A scheduled module
  (``is_scheduled=true``, as ``compile().as_text()`` gives it) lists each
  computation's instructions in the order they run. A synchronous collective (the CPU
  backend's) has no window and is not listed. Counted per step as `collectives_over`
  counts.

  Example:

    >>> from mpscale.trainer.planning import hlo
    >>> text = '''HloModule m, is_scheduled=true
    ... ENTRY %main (a: f32[64,128], b: f32[128,32]) -> f32[64,32] {
    ...   %a = f32[64,128]{1,0} parameter(0)
    ...   %b = f32[128,32]{1,0} parameter(1)
    ...   %s = f32[128,32]{1,0} all-reduce-start(%b), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
    ...   %d = f32[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ...   %r = f32[128,32]{1,0} all-reduce-done(%s)
    ...   ROOT %e = f32[64,32]{1,0} exponential(%d)
    ... }'''
    >>> [(o.collective, o.bytes, o.count, o.window) for o in hlo.overlaps(text, {"data": 2})]
    [('all-reduce over data', 16384, 1, Kernels(dots=[(524288.0, 57344.0, 1)], bytes=0.0))]
  """
  module = _as_module(hlo)
  devices = math.prod(mesh_shape.values())
  fused = _fused(module)
  totals = _Totals(module, _kernel_cost(module, float32_bytes))
  runs = _per_step(module, lambda name, ins: (
      {name: 1.0} if ins is module.computations[name][0] else {}))
  out = []
  for name, instructions in module.computations.items():
    if name in fused or not runs.get(name):
      continue
    windows: dict[str, tuple[Instruction, dict[str, float]]] = {}
    for ins in instructions:
      if ins.op.endswith("-done"):
        started = _operands(ins)
        pair = windows.pop(started[0], None) if started else None
        if pair is not None:
          start, acc = pair
          axes = ",".join(group_axes(replica_groups(start, devices), mesh_shape)) or "-"
          out.append(Overlap(f"{_kind(start)} over {axes}",
                             _moved(module, name, start), int(round(runs[name])),
                             _as_kernels(acc)))
      elif ins.op.endswith("-start") and _kind(ins) in COLLECTIVES:
        windows[ins.name] = (ins, {})
      elif windows:
        for k, v in totals.instruction(name, ins).items():
          for _, acc in windows.values():
            acc[k] = acc.get(k, 0.0) + v
  return out
