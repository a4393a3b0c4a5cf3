"""Checkpoints of a run (orbax): its whole train state and its data position.

Each checkpoint holds two items: ``state``, the `mpscale.TrainState` as a flat dict of
arrays (`checkpoint_tree`), and ``data``, the grain iterator's state (JSON), so a
resumed run reads the very batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any, Mapping, Optional


class CheckpointError(ValueError):
  """A checkpoint to resume from is corrupt or belongs to another run."""


def _checkpoint_key(path: Any) -> str:
  import jax
  return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


_REPORTED = ("group_norms", "group_sizes")
"""State fields that only report the last step (each step recomputes them): not
saved, so that a checkpoint restores under another grouping of the norms (a
pipeline's stages x virtual stages)."""


def _saved(key: str) -> bool:
  return not any(part in _REPORTED for part in key.split("."))


def checkpoint_tree(state: Any) -> dict[str, Any]:
  """``state`` as a flat dict ``"opt_state.skip_state...kernel" -> array`` without its
  zero-size leaves (CAME keeps empty placeholders, which orbax refuses to save) and
  the per-group norms and sizes the wrappers report (`_REPORTED`). A leaf the state
  stores padded (`mpscale.parallel.Padded`: FSDP's uneven split) is its padded
  array, keyed as the unpadded leaf (`true_shapes` says its true shape)."""
  import jax
  from mpscale import parallel
  flat = jax.tree_util.tree_flatten_with_path(parallel.padded_values(state))[0]
  return {key: leaf for key, leaf in ((_checkpoint_key(p), x) for p, x in flat)
          if getattr(leaf, "size", 1) > 0 and _saved(key)}


def true_shapes(state: Any) -> dict[str, list[int]]:
  """The true shape of each leaf ``state`` stores padded, by `checkpoint_tree` key."""
  import jax
  from mpscale import parallel
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=parallel.is_padded)[0]
  return {_checkpoint_key(p): list(x.shape) for p, x in flat if parallel.is_padded(x)}


def from_checkpoint_tree(like: Any, saved: dict[str, Any]) -> Any:
  """The state shaped like ``like`` with the leaves of ``saved`` (zero-size leaves
  taken from ``like``), every leaf committed to its ``like`` leaf's sharding (a
  padded one put back in its `mpscale.parallel.Padded` node). Orbax gives committed
  arrays back; a state mixing them with uncommitted ones (the zero-size leaves)
  would make the step compile once for it and again for its own (committed)
  outputs."""
  import jax
  from mpscale import parallel

  def restored(path, leaf):
    value = saved.get(_checkpoint_key(path), leaf)
    sharding = getattr(leaf, "sharding", None)
    return value if sharding is None else jax.device_put(value, sharding)

  values = parallel.padded_values(like)
  flat, treedef = jax.tree_util.tree_flatten_with_path(values)
  return parallel.rewrap(
      jax.tree_util.tree_unflatten(treedef, [restored(p, x) for p, x in flat]), like)


def _listed(steps: list[int], which: str = "checkpoints") -> str:
  """The checkpoints there are, and how to pick one."""
  if not steps:
    return f"no {which} there"
  return (f"{which} there: steps {', '.join(map(str, steps))} (pick one with "
          "--step N)")


def save(manager: Any, step: int, state: Any, data_state: Any, *,
         consumed_samples: Optional[int] = None) -> None:
  """Saves ``state`` and the data iterator's ``data_state`` as checkpoint ``step`` of
  the orbax ``manager`` (asynchronously: ``manager.wait_until_finished()``), with
  the samples trained on by then (``consumed_samples``, Megatron's
  ``consumed_train_samples``) beside them, in a JSON item ``meta``, and there too
  the true shapes of the leaves it holds padded (`true_shapes`): their padding is
  zeros at the end, so any layout's padding restores from them (`restore_latest`)."""
  import orbax.checkpoint as ocp
  items = dict(state=ocp.args.StandardSave(checkpoint_tree(state)),
               data=ocp.args.JsonSave(data_state))
  meta: dict[str, Any] = {}
  if consumed_samples is not None:
    meta["consumed_samples"] = int(consumed_samples)
  padded = true_shapes(state)
  if padded:
    meta["true_shapes"] = padded
  if meta:
    items["meta"] = ocp.args.JsonSave(meta)
  manager.save(step, args=ocp.args.Composite(**items))


def consumed_samples(ckpt_dir: str, step: int) -> Optional[int]:
  """The samples checkpoint ``step`` in ``ckpt_dir`` was trained on (`save`'s
  ``consumed_samples``), or ``None`` when it records none.

  Raises:
    CheckpointError: naming the file when it cannot be read (corrupt), and the
      other checkpoints there (``--step`` picks one).
  """
  meta = _meta(ckpt_dir, step)
  return None if meta.get("consumed_samples") is None else int(meta["consumed_samples"])


def _meta(ckpt_dir: str, step: int) -> dict[str, Any]:
  """Checkpoint ``step``'s JSON item ``meta`` (`save`), ``{}`` when it has none.

  Raises:
    CheckpointError: as `consumed_samples`.
  """
  path = os.path.join(ckpt_dir, str(step), "meta", "metadata")
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      meta = json.load(f)
    if "consumed_samples" in meta:
      int(meta["consumed_samples"])
    dict(meta.get("true_shapes", {}))
    return meta
  except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable, not JSON...
    others = [s for s in saved_steps(ckpt_dir) if s != step]
    raise CheckpointError(
        f"{path}: cannot read the samples checkpoint {step} was trained on "
        f"(corrupt: {type(e).__name__}); {_listed(others, 'others')}") from None


def saved_steps(ckpt_dir: str) -> list[int]:
  """The steps of the checkpoints in ``ckpt_dir``, in order (none: ``[]``)."""
  import orbax.checkpoint as ocp
  if not os.path.isdir(ckpt_dir):
    return []
  with ocp.CheckpointManager(ckpt_dir) as reader:
    return sorted(reader.all_steps())


def _saved_shapes(step_dir: str) -> Optional[dict[str, tuple[int, ...]]]:
  """The shape of each array checkpoint ``step_dir`` holds (by `checkpoint_tree`
  key), read from its metadata; ``None`` when that cannot be read (corrupt)."""
  import orbax.checkpoint as ocp
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)  # orbax warns of the metadata files it looks for
  try:
    meta = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, "state"))
  except Exception:  # orbax raises many kinds; the restore's error says which
    return None
  finally:
    absl.setLevel(level)
  tree = getattr(meta, "item_metadata", meta)  # the tree itself before orbax 0.11
  tree = getattr(tree, "tree", tree)
  if not isinstance(tree, Mapping):
    return None
  return {key: tuple(leaf.shape) for key, leaf in tree.items()
          if getattr(leaf, "shape", None) is not None}


def _cause(error: Exception, step_dir: str) -> str:
  """An orbax (TensorStore) error's first line, whole (the array and the file at
  fault, and what is wrong with it), with its files relative to ``step_dir`` (the
  message names it first), and without the TensorStore spec it ends with: a JSON
  dump of every driver option."""
  line = (str(error).strip().splitlines() or [""])[0]
  line = line.replace(os.path.abspath(step_dir) + os.sep, "")
  return re.sub(r"\s*\[tensorstore_spec\b.*$", "", line)


def _restore_error(step_dir: str, error: Exception, abstract: dict[str, Any],
                   others: list[int]) -> CheckpointError:
  """Why checkpoint ``step_dir`` does not restore into arrays like ``abstract``:
  the arrays whose shapes differ from the config's model (another model's
  checkpoint: every other checkpoint of that run differs as well), else corrupt or
  foreign, with ``error``'s cause and the ``others`` there to pick from."""
  # Read only when orbax's error speaks of shapes: a corrupt checkpoint's metadata
  # fails to read as well, leaving more TensorStore reads behind.
  saved = (_saved_shapes(step_dir) if "shape" in str(error) else None) or {}
  model_first = sorted(abstract, key=lambda key: not key.startswith("params."))
  differ = [f"{key} is {saved[key]} there, {tuple(abstract[key].shape)} for this "
            "config" for key in model_first
            if key in saved and saved[key] != tuple(abstract[key].shape)]
  if differ:
    more = f" (and {len(differ) - 2} more arrays)" if len(differ) > 2 else ""
    return CheckpointError(
        f"{step_dir}: the checkpoint's array shapes differ from this config's model: "
        f"{'; '.join(differ[:2])}{more}. It was written by a model of other sizes "
        "(model.d_model, num_layers, vocab_size, ...): use the config it was written "
        "with")
  return CheckpointError(
      f"{step_dir}: cannot restore this run's state from it (corrupt, or written by "
      f"another config: {type(error).__name__}: {_cause(error, step_dir)}); "
      f"{_listed(others, 'others')}")


def _repadded(step_dir: str, saved_true: Mapping[str, Any],
              true: Mapping[str, Any], abstract: Mapping[str, Any]) -> list[str]:
  """The keys of ``abstract`` whose array checkpoint ``step_dir`` holds in another
  shape only by padding: the true shapes (``saved_true`` there, ``true`` here, a
  leaf's own shape where not padded) agree."""
  if not saved_true and not true:
    return []
  saved = _saved_shapes(step_dir) or {}
  return [key for key, leaf in abstract.items()
          if key in saved and saved[key] != tuple(leaf.shape)
          and tuple(saved_true.get(key, saved[key]))
          == tuple(true.get(key, leaf.shape))]


def restore_latest(ckpt_dir: str, state: Any, *, opt_state: bool = True,
                   step: Optional[int] = None) -> tuple[Any, int, Any]:
  """``state`` restored from the latest checkpoint in ``ckpt_dir`` (or the one of
  ``step``), its step and the data iterator's state saved with it, or ``(state, 0,
  None)`` when there is none.

  Every leaf is restored into the sharding of its ``state`` leaf, so a checkpoint
  written on one mesh restores onto another.

  Args:
    ckpt_dir: the run's checkpoint folder.
    state: the state to restore into (its shapes, dtypes and shardings).
    opt_state: ``False`` reads all but the optimizer state, leaving ``state``'s as
      it is: enough to evaluate or sample, and readable on a mesh whose optimizer
      state is laid out otherwise (its norms are grouped per pipeline stage).
    step: the checkpoint to read; ``None``: the latest.

  Raises:
    CheckpointError: naming the checkpoint, when it cannot be restored into a state
      shaped like ``state``: the arrays whose shapes differ (a model of other
      sizes), or the cause and the other checkpoints there (corrupt, or written by
      another config); or when ``step`` names none.
  """
  import jax
  import orbax.checkpoint as ocp
  if not os.path.isdir(ckpt_dir):
    return state, 0, None
  with ocp.CheckpointManager(ckpt_dir) as reader:
    steps = sorted(reader.all_steps())
    if step is not None and step not in steps:
      raise CheckpointError(f"{ckpt_dir}: no checkpoint of step {step}; "
                            f"{_listed(steps)}")
    latest = step if step is not None else reader.latest_step()
    if latest is None:
      return state, 0, None
    wanted = {key: leaf for key, leaf in checkpoint_tree(state).items()
              if opt_state or not key.startswith("opt_state.")}
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, wanted)
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    # A leaf stored padded there or here (FSDP's uneven split on another device
    # count): its true shapes agree, its padding is zeros at the end, so orbax pads
    # or cuts it to this state's shape (strict=False).
    for key in _repadded(os.path.join(ckpt_dir, str(latest)),
                         _meta(ckpt_dir, latest).get("true_shapes", {}),
                         true_shapes(state), abstract):
      restore_args[key] = dataclasses.replace(restore_args[key], strict=False)
    # Partial: a checkpoint written before the reported norms were left out holds
    # them too, and they are taken from ``state``.
    state_args = ocp.args.PyTreeRestore(
        abstract, restore_args=restore_args, partial_restore=True)
    try:
      saved = reader.restore(latest, args=ocp.args.Composite(
          state=state_args, data=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many kinds; all mean "not this run's"
      raise _restore_error(os.path.join(ckpt_dir, str(latest)), e, abstract,
                           [s for s in steps if s != latest]) from None
  state = from_checkpoint_tree(state, saved.state)
  return state, int(jax.device_get(state.step)), saved.data
