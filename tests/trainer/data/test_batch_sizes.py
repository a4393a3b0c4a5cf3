"""Training counted in samples (mpscale.trainer.data.batch_sizes): Megatron's batch-size ramp-up,
against a step-by-step simulation of its rule and against Megatron-Core's own
calculator when installed."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mpscale
from mpscale.trainer.data.batch_sizes import BatchSizes

pytestmark = pytest.mark.floors  # on the declared floors too (.ci/run)


def _simulate(batch_size, rampup, steps):
  """Megatron-LM's loop, by hand: before each step, the size from the samples so far."""
  start, increment, ramp = rampup
  per_increment = ramp / ((batch_size - start) // increment)
  consumed, sizes, before = 0, [], []
  for _ in range(steps):
    size = (batch_size if consumed > ramp
            else start + int(consumed / per_increment) * increment)
    sizes.append(size)
    before.append(consumed)
    consumed += size
  return sizes, before


ramps = st.integers(1, 8).flatmap(lambda inc: st.tuples(
    st.integers(1, 6).map(lambda k: k * inc),          # start
    st.just(inc),                                      # increment
    st.integers(1, 400),                               # ramp samples
    st.integers(1, 6).map(lambda k: k * inc)))         # batch_size - start


@settings(max_examples=60, deadline=None)
@given(ramps)
def test_sizes_and_consumed_samples_follow_megatrons_rule(ramp):
  start, increment, samples, extra = ramp
  sizes = BatchSizes(start + extra, (start, increment, samples))
  want_sizes, want_before = _simulate(start + extra, (start, increment, samples), 150)
  assert [sizes.size_at(i) for i in range(150)] == want_sizes
  assert [sizes.consumed_at(i) for i in range(150)] == want_before
  # On traced step counts (vmap's tracers: no Python branching on a value passes),
  # op by op: a jit compiled a program for each example, most of the test's time.
  consumed = jax.vmap(sizes.consumed_fn())(np.arange(0, 150, 7, dtype=np.int32))
  assert np.asarray(consumed).tolist() == want_before[::7]
  total = want_before[-1] + want_sizes[-1]
  for target in (1, total // 3 + 1, total):
    n = sizes.steps_for(target)
    assert sum(want_sizes[:n]) >= target > sum(want_sizes[:n - 1])
  seen = tuple(dict.fromkeys(want_sizes))  # each size, in order
  assert sizes.sizes()[:len(seen)] == seen and sizes.sizes()[-1] == start + extra


def test_megatron_cores_own_calculator_agrees():
  calculator = pytest.importorskip(
      "megatron.core.num_microbatches_calculator",
      reason="Megatron-Core is not installed: pip install torch==2.13.0 && "
             "pip install -e '.[megatron]'")
  for batch_size, rampup in ((1024, (256, 128, 50_000)), (16, (4, 4, 100)),
                             (96, (32, 32, 1)), (72, (8, 8, 999))):
    ref = calculator.RampupBatchsizeNumMicroBatchesCalculator(
        batch_size, 1, 1, False, 0, *rampup)
    sizes = BatchSizes(batch_size, rampup)
    consumed = 0
    for step in range(400):
      ref.update(consumed, consistency_check=False)
      assert sizes.size_at(step) == ref.get_current_global_batch_size(), step
      assert sizes.consumed_at(step) == consumed
      consumed += ref.get_current_global_batch_size()


def test_a_constant_batch_and_a_schedule_in_samples():
  # A ramp that starts at the full size is none (Megatron-Core divides by zero).
  assert not BatchSizes(64, (64, 8, 1000)).ramped
  assert BatchSizes(64, (64, 8, 1000)).sizes() == (64,)
  sizes = BatchSizes(32)
  assert not sizes.ramped and sizes.sizes() == (32,)
  assert sizes.consumed_at(10) == 320 and sizes.steps_for(321) == 11


@pytest.mark.parametrize("kwargs, name", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 16, "rampup": (4, 5, 100)}, "rampup"),
    ({"batch_size": 16, "rampup": (32, 4, 100)}, "rampup"),
    ({"batch_size": 16, "rampup": (0, 4, 100)}, "rampup[0]"),
    ({"batch_size": 16, "rampup": (4, 4, 0)}, "rampup[2]"),
    ({"batch_size": 16, "rampup": (4, 4)}, "rampup"),
])
def test_bad_sizes_name_their_argument(kwargs, name):
  with pytest.raises(mpscale.ArgumentError) as e:
    BatchSizes(**kwargs)
  assert e.value.name == name
