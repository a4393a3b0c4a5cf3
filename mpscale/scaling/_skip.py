"""Finite-check-and-skip: a step with a NaN/Inf gradient changes nothing and is counted.

The check reads the per-leaf sums of squares from `mpscale.scaling` (one pass over the
gradients, shared with the global and group norms and any clip), and the skip is a
select, not a ``lax.cond``: the inner update is always computed and the new or the old
state kept elementwise. A select needs no device-to-host sync of the predicate (a
``cond`` on GPU does) and is elementwise work XLA fuses into the inner update. Each
state leaf is selected where the inner update produces it
(`mpscale.scaling`), so the inner update's own outputs read the selected state
and a donated state is updated in place with no copies, on every backend (see
benchmarks/README.md for the figures).

Per step::

  s = sum of squares of each leaf of g           # shared with the norms and the clip
  nan, inf = any(isnan(s)), any(isinf(s))        # agreed across replicas (axis_name)
  new_updates, new_inner = inner.update(g, inner_state)     # always computed
  if nan or inf:                                  # skip: nothing changes
    updates = -0.0; inner_state kept; skipped += 1; consecutive_skipped += 1
  elif a skip_spikes inside inner skipped it:     # a spike: no overflow
    updates = -0.0 (inner's); skipped += 1; consecutive_skipped += 1
  else:
    updates, inner_state = new_updates, new_inner; consecutive_skipped = 0
  global_norm = sqrt(sum(s)); group_norms by the groups of a clip inside inner,
  else by this wrapper's

The code reads the same way (`apply_or_skip`)::

  leaf_squares = norms.reuse_or_measure(updates, leaf_squares, groups)   # s
  overflow = nan | inf                            # _any_across for axis_name
  new_updates, new_inner, raw_inner = producer_select.update_or_skip(
      run_inner, skip, state.inner_state)         # the select, per state leaf
  new_updates = producer_select.updates_or_skip(new_updates, skip)   # -0.0
  skipped_now = skip | _spiked(raw_inner)         # a skip_spikes' own skip
  SkipNonfiniteState(new_inner, skipped + skipped_now, ..., global_norm, ...)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import optax

from mpscale.scaling import _norms as norms_lib
from mpscale import _tree
from mpscale.scaling import _producer_select as producer_select
from mpscale.scaling import _spikes as spikes_lib
from mpscale import _deprecated
from mpscale import validation


class SkipNonfiniteState(NamedTuple):
  """State of `skip_nonfinite`; also the ``skip_state`` of every loss-scale wrapper."""
  inner_state: Any
  """State of the wrapped transformation; untouched by a skipped step."""
  skipped: jax.Array
  """int32 total number of skipped steps: non-finite ones, and the spikes a
  `mpscale.skip_spikes` inside skipped."""
  consecutive_skipped: jax.Array
  """int32 number of skipped steps since the last applied one."""
  overflow: jax.Array
  """bool: the latest step's gradients held a NaN or an Inf."""
  nan: jax.Array
  """bool: the latest step's gradients held a NaN."""
  inf: jax.Array
  """bool: the latest step's gradients held an Inf (or a norm past float32's range)."""
  global_norm: jax.Array
  """float32 global norm of the latest step's (unscaled) gradients, before any clip."""
  group_norms: dict[str, jax.Array]
  """float32 norm of each group of the latest gradients (the groups of a
  `global_norm_clip` inside ``inner`` when there is one, else this wrapper's)."""
  group_sizes: dict[str, jax.Array]
  """Number of elements in each group."""


def _any_across(flag: jax.Array, axis_name: Optional[str]) -> jax.Array:
  if axis_name is None:
    return flag
  return lax.pmax(flag.astype(jnp.int32), axis_name) > 0


def _reported_groups(inner_state: Any, own_groups):
  """Group norms to report: a clip's inside ``inner_state`` (its groups were chosen for
  clipping), else ``own_groups()``."""
  clips = _tree.find(inner_state, norms_lib.GlobalNormClipState)
  if clips:
    return clips[0].group_norms, clips[0].group_sizes
  return own_groups()


def _spiked(inner_state: Any) -> jax.Array:
  """Whether a `mpscale.skip_spikes` inside ``inner_state`` skipped its step."""
  flag = jnp.zeros((), jnp.bool_)
  for spikes_state in _tree.find(inner_state, spikes_lib.SkipSpikesState):
    flag = flag | spikes_state.spike
  return flag


def init_state(inner: optax.GradientTransformation, params: Any,
               groups: norms_lib.NormGroups) -> SkipNonfiniteState:
  """The state of a wrapper that skips non-finite steps of ``inner``."""
  inner_state = inner.init(params)
  norms, sizes = jax.tree_util.tree_map(jnp.array, _reported_groups(  # copies
      inner_state, lambda: norms_lib.zero_group_stats(params, groups)))
  # A fresh array per field: one buffer shared by two fields cannot be donated.
  zero_i = lambda: jnp.zeros((), jnp.int32)
  false = lambda: jnp.zeros((), jnp.bool_)
  return SkipNonfiniteState(
      inner_state=inner_state, skipped=zero_i(), consecutive_skipped=zero_i(),
      overflow=false(), nan=false(), inf=false(),
      global_norm=jnp.zeros((), jnp.float32), group_norms=norms, group_sizes=sizes)


def apply_or_skip(inner: optax.GradientTransformationExtraArgs, updates: Any,
                  state: SkipNonfiniteState, params: Any, *, skip_nonfinite: bool,
                  groups: norms_lib.NormGroups, axis_name: Optional[str],
                  extra_args: dict,
                  leaf_squares: Optional[norms_lib.LeafSquares] = None
                 ) -> tuple[Any, SkipNonfiniteState]:
  """Checks ``updates`` in one pass, runs ``inner``, and skips the step if non-finite.

  With ``skip_nonfinite=False`` a non-finite step is reported as an overflow but
  applied anyway. ``leaf_squares``, when it describes ``updates`` (the loss-scale
  wrappers measure the raw gradients; an outer wrapper hands its own down), is used
  instead of a new pass; it is passed on to ``inner`` either way.
  """
  leaf_squares = norms_lib.reuse_or_measure(updates, leaf_squares, groups)
  nan = _any_across(jnp.any(jnp.isnan(leaf_squares.vector)), axis_name)
  inf = _any_across(jnp.any(jnp.isinf(leaf_squares.vector)), axis_name)
  overflow = nan | inf

  run_inner = lambda: inner.update(
      updates, state.inner_state, params, leaf_squares=leaf_squares, **extra_args)
  if skip_nonfinite:
    skip = overflow
    new_updates, new_inner, raw_inner = producer_select.update_or_skip(
        run_inner, skip, state.inner_state)
    new_updates = producer_select.updates_or_skip(new_updates, skip)  # -0.0
  else:
    new_updates, new_inner = run_inner()
    raw_inner = new_inner
    skip = jnp.zeros((), jnp.bool_)
  # A step a skip_spikes inside skipped is skipped too (read from the unselected
  # state: the step's own flag); the inner state already kept itself.
  skipped_now = (skip | _spiked(raw_inner)).astype(jnp.int32)
  # The unselected state, so a skipped step still reports its own norms.
  group_norms, group_sizes = _reported_groups(
      raw_inner, lambda: norms_lib.grouped(leaf_squares, groups))
  group_sizes = norms_lib.static_sizes(group_sizes, state.group_sizes)

  new_state = SkipNonfiniteState(
      inner_state=new_inner,
      skipped=state.skipped + skipped_now,
      consecutive_skipped=(state.consecutive_skipped + 1) * skipped_now,
      overflow=overflow, nan=nan, inf=inf,
      global_norm=jnp.sqrt(leaf_squares.total()),
      group_norms=group_norms, group_sizes=group_sizes)
  return new_updates, new_state


@_deprecated.renamed_keyword("groups", "norm_groups")
def skip_nonfinite(inner: optax.GradientTransformation, *,
                   norm_groups: norms_lib.NormGroups = None,
                   axis_name: Optional[str] = None
                  ) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that a step with any NaN/Inf gradient changes nothing.

  On a non-finite step the returned updates are ``-0.0`` everywhere (so
  ``optax.apply_updates`` leaves every parameter bit-identical) and the inner state is
  kept as it was, so counts and schedules inside ``inner`` do not advance. The step is
  counted in ``skipped`` and ``consecutive_skipped``, and so is a step that a
  `mpscale.skip_spikes` inside ``inner`` skipped (not as an overflow). The same single pass also records
  the global norm and the group norms of the gradients, for `mpscale.step_metrics`.

  Args:
    inner: the transformation to wrap, e.g. ``optax.adamw(1e-3)``.
    norm_groups: how leaves map to the recorded group norms (see
      `mpscale.scaling.NormGroups`); default one group per top-level key.
    axis_name: when the update runs per replica (inside ``shard_map``/``pmap``), the
      mapped axis over which the skip decision is agreed: if any replica sees a
      non-finite gradient, every replica skips.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state `SkipNonfiniteState`.

  References:
    optax.apply_if_finite, which this replaces with a single shared pass.
  """
  inner = validation.transformation("inner", inner)
  groups = validation.norm_groups("norm_groups", norm_groups)
  axis_name = validation.axis_name("axis_name", axis_name)

  def init_fn(params):
    return init_state(inner, params, groups)

  def update_fn(updates, state, params=None, *, leaf_squares=None, **extra_args):
    updates = jax.tree_util.tree_map(jnp.asarray, updates)
    return apply_or_skip(inner, updates, state, params, skip_nonfinite=True,
                         groups=groups, axis_name=axis_name, extra_args=extra_args,
                         leaf_squares=leaf_squares)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
