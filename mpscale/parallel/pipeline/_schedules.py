"""Pipeline schedule tables: which op each stage runs at each tick of a pipelined step.

A pipelined step is one SPMD program whose ticks advance in lock step: every stage runs
its part of a tick, then activations and cotangents move one stage with ``ppermute``. A
tick has two slots, each a ``lax.switch`` over the ops that appear in it, so a tick
lasts as long as the costliest op in each slot, whichever stage runs it::

  slot 0: IDLE or FWD                  (1f1b, gpipe's forward ticks)
          IDLE, FWD, BWD or WGT        (zb_h1: one op a tick, each a forward's cost)
  slot 1: IDLE or BWD                  (1f1b, gpipe's backward ticks)

**1F1B with paired ticks** (``1f1b``, ``v`` virtual stages). Stage ``s`` forwards its
``v M`` work items in GPipe's interleaved order, item ``k`` at tick ``k + s`` (chunk ``k
% (S v) // S`` of micro-batch ``k // (S v) * S + k % S``), and runs their backwards in
the mirrored order, backward item ``k`` (the same micro-batch, chunk ``v - 1 - k % (S
v) // S``) at tick ``k + (v + 1) S - 2 - s``. Each hop takes one tick; the last virtual
stage runs the forward and the backward of a micro-batch in the same tick, forward
first. So in the steady state every stage runs one forward and one backward (of
different micro-batches) each tick; the ``v S - 1`` warm-up ticks run forwards only and
the ``v S - 1`` cool-down ticks backwards only, and the step costs ``(v M + S - 1) (F +
B)``, GPipe's. Item ``(m, c)`` is alive on stage ``s`` (its residuals kept) for ``2 (S v
- 1 - (c S + s)) + 1`` ticks: at most ``2 S - 1`` items a stage without virtual stages,
``(v + 1) S - 1`` with them (stage 0), whatever ``M``. Megatron's asynchronous 1F1B
keeps ``S``: in lock step a hop costs a whole ``F + B`` tick, not one op.

**ZB-H1** (``zb_h1``, Qi et al.): the backward split into ``BWD`` (input gradient) and
``WGT`` (weight gradient), each as costly as a forward when the forward's residuals are
kept, so one op a tick costs the same on every stage. Stage ``s`` runs ``S - s``
warm-up forwards, then ``BWD``, a ``WGT`` once ``s`` of them wait, and ``F``; the
deferred ``WGT`` s fill the cool-down: ``3 M + S - 1`` one-op ticks against 1F1B's
``M + S - 1`` ticks of ``F + B`` (three ops' worth).

**GPipe** (``gpipe``): ``v M + S - 1`` forward ticks (slot 0), then the mirrored
backward ticks (slot 1); autodiff runs the backward.

References:
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (1F1B, interleaved stages), SC 2021.
  https://arxiv.org/abs/2104.04473
  Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024.
  https://arxiv.org/abs/2401.10241
"""

from __future__ import annotations

import functools

import numpy as np

from mpscale import validation

SCHEDULES = ("gpipe", "1f1b", "zb_h1")
IDLE, FWD, BWD, WGT = 0, 1, 2, 3
"""The ops of a schedule table; ``WGT`` (the weight gradient, split from ``BWD``) only
in ``zb_h1``'s, whose ``BWD`` is then the input gradient alone."""
SLOTS = 2
"""Op slots a tick: 0 for forwards (and every op of a one-op tick), 1 for backwards."""


def pipeline_schedule_table(schedule: str, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> np.ndarray:
  """The ops each stage runs at each tick, as an int array ``[ticks, stages, 2, 2]``.

  ``table[t, s, k] = (op, m)``: slot ``k`` of stage ``s`` at tick ``t`` runs ``op``
  (``IDLE``, ``FWD``, ``BWD`` or ``WGT``) on micro-batch ``m``; slot 0 runs before
  slot 1 (the module docstring). With ``virtual_stages=v`` an op runs one of a
  device's ``v`` layer chunks (`pipeline_schedule_chunks` says which).
  """
  return chunk_table(schedule, num_stages, num_microbatches, virtual_stages)[..., :2]


def pipeline_schedule_chunks(schedule: str, num_stages: int, num_microbatches: int,
                    virtual_stages: int = 1) -> np.ndarray:
  """The layer chunk of each op of `pipeline_schedule_table`, ``[ticks, stages, 2]`` (0 for an
  idle slot, and always 0 without virtual stages): stage ``s``'s chunk ``c`` is
  virtual stage ``c S + s``."""
  return chunk_table(schedule, num_stages, num_microbatches, virtual_stages)[..., 2]


def check_schedule(schedule: str, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> None:
  """Raises ``ValueError`` naming the argument when ``schedule`` cannot run ``S``
  stages, ``M`` micro-batches and ``v`` virtual stages."""
  validation.one_of("schedule", schedule, SCHEDULES)
  S, M, v = num_stages, num_microbatches, virtual_stages
  if v > 1 and schedule == "zb_h1":
    raise ValueError("the zb_h1 schedule runs one layer chunk per stage "
                     f"(virtual_stages=1); got virtual_stages={v}")
  if v > 1 and M % S:
    raise ValueError(f"virtual_stages={v} needs num_microbatches ({M}) divisible by "
                     f"the {S} stages")


def _item(k: int, S: int, v: int, backward: bool) -> tuple[int, int]:
  """``(m, chunk)`` of forward (or backward) item ``k`` of a stage."""
  chunk = k % (S * v) // S
  return k // (S * v) * S + k % S, (v - 1 - chunk) if backward else chunk


@functools.lru_cache(maxsize=64)
def chunk_table(schedule: str, num_stages: int, num_microbatches: int,
                virtual_stages: int = 1) -> np.ndarray:
  """`pipeline_schedule_table` with each op's chunk: ``[ticks, stages, 2, 3]`` of ``(op, m,
  chunk)`` (read-only; cached)."""
  check_schedule(schedule, num_stages, num_microbatches, virtual_stages)
  S, M, v = num_stages, num_microbatches, virtual_stages
  if schedule == "zb_h1":
    table = _lockstep([_zb_h1_ops(S, M, s) for s in range(S)], S)
  else:
    ticks = v * M + (v + 1) * S - 2 if schedule == "1f1b" else 2 * (v * M + S - 1)
    table = np.zeros((ticks, S, SLOTS, 3), np.int32)
    for s in range(S):
      for k in range(v * M):
        m, c = _item(k, S, v, False)
        table[k + s, s, 0] = (FWD, m, c)
        if schedule == "1f1b":
          table[k + (v + 1) * S - 2 - s, s, 1] = (BWD, *_item(k, S, v, True))
        else:  # gpipe: the backward mirrors the forward
          table[ticks - 1 - (k + s), s, 1] = (BWD, m, c)
  table.flags.writeable = False
  return table


def _zb_h1_ops(S: int, M: int, s: int) -> list[tuple[int, int, int]]:
  """Stage ``s``'s ops in ZB-H1 (Qi et al., 2023): the backward split into ``B``
  (input gradient, on the critical path) and ``W`` (weight gradient, anywhere after
  ``B``). ``S - s`` warm-up forwards; then ``B``, a ``W`` once ``s`` of them wait, and
  ``F``, repeated; the remaining ``B``s and the deferred ``W``s fill what is 1F1B's
  cool-down bubble."""
  warmup = min(S - s, M)
  ops = [(FWD, m, 0) for m in range(warmup)]
  f, b, w = warmup, 0, 0

  def backward():
    nonlocal b, w
    ops.append((BWD, b, 0))
    b += 1
    if b - w > s:
      ops.append((WGT, w, 0))
      w += 1

  while f < M:
    backward()
    ops.append((FWD, f, 0))
    f += 1
  while b < M:
    backward()
  return ops + [(WGT, m, 0) for m in range(w, M)]


def _lockstep(order: list[list[tuple[int, int, int]]], S: int) -> np.ndarray:
  """One-op ticks (slot 0) from each stage's op list: an op runs once its input
  arrived at an earlier tick (``ppermute`` takes one tick)."""
  done: dict[tuple[int, int, int], int] = {}   # (op, stage, m) -> tick
  pos, rows, t = [0] * S, [], 0
  while any(p < len(ops) for p, ops in zip(pos, order)):
    row = np.zeros((S, SLOTS, 3), np.int32)
    for s in range(S):
      if pos[s] == len(order[s]):
        continue
      op, m, c = order[s][pos[s]]
      if op == FWD:
        ready = s == 0 or done.get((FWD, s - 1, m), t) < t
      elif op == WGT:
        ready = done.get((BWD, s, m), t) < t
      else:
        ready = done.get((BWD, s + 1, m) if s < S - 1 else (FWD, s, m), t) < t
      if ready:
        row[s, 0] = (op, m, c)
    for s in range(S):
      if row[s, 0, 0] != IDLE:
        done[(int(row[s, 0, 0]), s, int(row[s, 0, 1]))] = t
        pos[s] += 1
    rows.append(row)
    t += 1
  return np.stack(rows)


# ----------------------------------------------------------------- reading a table
def op_costs(table: np.ndarray) -> dict[int, int]:
  """Each op's cost in forwards: ``FWD`` 1; ``BWD`` 2 (input and weight gradients),
  or 1 in a table with ``WGT`` ops (the input gradient alone), whose ``WGT`` is 1."""
  split = bool((table[..., 0] == WGT).any())
  return {IDLE: 0, FWD: 1, BWD: 1 if split else 2, WGT: 1}


def _slot_costs(table: np.ndarray) -> np.ndarray:
  """Each slot's op cost (`op_costs`), ``[ticks, stages, 2]``."""
  return np.vectorize(op_costs(table).__getitem__, otypes=[np.int64])(table[..., 0])


def tick_costs(table: np.ndarray) -> np.ndarray:
  """Each tick's time in forwards: in each slot the costliest op any stage runs
  (the lock step), summed over the slots."""
  return _slot_costs(table).max(axis=1).sum(axis=-1)


def pipeline_bubble_fraction(table: np.ndarray) -> float:
  """Share of the stages' time that runs no op: ``1 - busy / (S x step time)``, with
  the times of `tick_costs` (a forward 1, a backward 2, ZB-H1's input and weight
  gradients 1 each)."""
  total = tick_costs(table).sum() * table.shape[1]
  return float(1.0 - _slot_costs(table).sum() / total) if total else 0.0


def _frees(table: np.ndarray) -> int:
  """The op after which an item's buffers are free: its ``WGT`` if the table has
  them, else its ``BWD``."""
  return WGT if (table[..., 0] == WGT).any() else BWD


def live_slots(table: np.ndarray) -> int:
  """Most work items whose stage input (and residuals) a stage keeps at once, over
  stages and ticks: from its forward to its backward (its weight gradient, with
  ``WGT`` ops); slot 0 runs before slot 1."""
  frees, most = _frees(table), 1
  for s in range(table.shape[1]):
    live = 0
    for row in table[:, s]:
      for op in row[:, 0]:
        live += 1 if op == FWD else -1 if op == frees else 0
        most = max(most, live)
  return most


def item_slots(table: np.ndarray, v: int, M: int) -> tuple[np.ndarray, int]:
  """Buffer slots for a 1F1B or ZB-H1 ``table`` (``[ticks, S, 2, 3]``): item ``(m,
  chunk)`` of stage ``s`` holds one slot of each buffer (received input, residuals,
  received cotangent) from its input's arrival until its last op (``BWD``, or
  ``WGT``).

  Within a tick, slot 0's op writes its item's buffers before slot 1's op reads its
  own, and the inputs and cotangents sent by ``ppermute`` land after both. So a slot
  freed at tick ``t`` is taken again by an item that arrives by ``ppermute`` at the
  end of ``t``, but by an item embedded at ``t`` (virtual stage 0) only from ``t +
  1``. Returns ``(slots [S, v, M], K)``, ``K`` the slots a stage needs."""
  S = table.shape[1]
  frees = _frees(table)
  fwd_tick, end_tick = {}, {}
  for t, row in enumerate(table):
    for s in range(S):
      for op, m, c in row[s]:
        if op == FWD:
          fwd_tick[(s, c, m)] = t
        if op == frees:
          end_tick[(s, c, m)] = t
  slots = np.zeros((S, v, M), np.int32)
  for s in range(S):
    items = []
    for c in range(v):
      for m in range(M):
        if c * S + s == 0:   # embedded in its own forward's tick
          start, key = fwd_tick[(s, c, m)], 1
        else:                # sent at the end of the tick below forwarded it
          start, key = fwd_tick[((s - 1) % S, c - (s == 0), m)], 0
        items.append((start, key, end_tick[(s, c, m)], c, m))
    ends: list[int] = []   # per slot, the tick its last item ends
    for start, key, end, c, m in sorted(items):
      slot = next((k for k, e in enumerate(ends) if e + key <= start), len(ends))
      if slot == len(ends):
        ends.append(end)
      ends[slot] = end
      slots[s, c, m] = slot
  return slots, int(slots.max()) + 1
