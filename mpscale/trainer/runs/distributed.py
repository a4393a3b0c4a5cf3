"""Runs across processes (hosts) on JAX's distributed runtime.

One program per host, as Megatron-LM, DeepSpeed and MaxText run; `jax.distributed`
connects them (it finds its peers under SLURM, Open MPI, Cloud TPU and Kubernetes, or
from a coordinator address, a process count and an id), and the train step is one
global program over the devices of all of them. This module holds what the trainer
adds on top:

- `initialize`: ``jax.distributed.initialize`` from flags, the environment or the
  cluster, with a bounded heartbeat (a process whose peer dies stops within it);
- `check_same_run`: every process must train the same config with the same code; a
  difference stops the run before any step, naming the key and the processes;
- `process_rows` and `global_batch`: each process reads only the rows of each global
  batch that its own devices hold, and the step gets one global array built from them.

With one process every function here is a no-op (``process_rows`` gives all rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from typing import Any, Mapping, Optional

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, auto: bool = False,
               heartbeat_timeout: Optional[int] = None,
               initialization_timeout: Optional[int] = None) -> bool:
  """Starts JAX's distributed runtime when asked to, before any device is used.

  Asked to means: ``coordinator`` or ``num_processes`` given, ``JAX_COORDINATOR_ADDRESS``
  and ``JAX_NUM_PROCESSES`` set, or ``auto`` (then JAX detects SLURM, Open MPI, Cloud
  TPU or Kubernetes, and fills in what is not given). ``JAX_PROCESS_ID`` gives the id
  when ``process_id`` is not.

  Args:
    coordinator: ``host:port`` of process 0's coordination service.
    num_processes: how many processes take part.
    process_id: this process's id, ``0 .. num_processes - 1``.
    auto: initialize even with nothing given (cluster auto-detection).
    heartbeat_timeout: seconds after which a process that stopped answering counts as
      dead; every other process then stops with JAX's message ("Terminating process
      because the JAX distributed service detected fatal errors ... another task
      died") instead of waiting for it. Default: JAX's (100 s).
    initialization_timeout: seconds to wait for every process to connect. Default:
      JAX's (300 s).

  Returns:
    Whether the runtime was initialized.

  Raises:
    ValueError: naming the flag, for a count or id out of range.
  """
  coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None and os.environ.get(ENV_PROCESS_ID):
    process_id = _env_int(ENV_PROCESS_ID)
  if not (auto or num_processes is not None or (coordinator and process_id is not None)):
    return False
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num-processes must be >= 1; got {num_processes}")
  if process_id is not None and not (
      0 <= process_id < (num_processes if num_processes is not None else sys.maxsize)):
    raise ValueError(f"--process-id must be in [0, --num-processes); got {process_id}"
                     + (f" of {num_processes}" if num_processes is not None else ""))
  for name, value in (("--heartbeat-timeout", heartbeat_timeout),
                      ("--initialization-timeout", initialization_timeout)):
    if value is not None and value < 1:
      raise ValueError(f"{name} must be >= 1 second; got {value}")
  import jax
  kwargs: dict[str, Any] = {}
  if heartbeat_timeout is not None:
    kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout
  if initialization_timeout is not None:
    kwargs["initialization_timeout"] = initialization_timeout
  try:
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=num_processes, process_id=process_id,
                               **kwargs)
  except ValueError as e:  # JAX's, when neither the flags nor a cluster say enough
    raise ValueError(
        f"--distributed: {e} (no cluster was detected: SLURM, Open MPI, Cloud TPU or "
        "Kubernetes; pass --coordinator, --num-processes and --process-id, or set "
        f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})") from None
  return True


def _env_int(name: str) -> int:
  try:
    return int(os.environ[name])
  except ValueError:
    raise ValueError(f"{name} must be an integer; got {os.environ[name]!r}") from None


def is_multiprocess() -> bool:
  """Whether this program is one of several processes (without starting JAX's
  backends when it has not been started by a distributed initialize)."""
  if "jax" not in sys.modules:
    return False
  import jax
  return jax.process_count() > 1


# ------------------------------------------------------------- the same run everywhere


def _file_digest(paths: list[str], root: str = "") -> str:
  """A digest of the files' contents and their paths relative to ``root``."""
  h = hashlib.sha256()
  for path in paths:
    h.update(os.path.relpath(path, root or os.path.dirname(path)).encode() + b"\0")
    with open(path, "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def _package_digest() -> str:
  """A digest of mpscale's own source files (the code every process must share)."""
  import mpscale  # noqa: PLC0415  (the library never imports the trainer)
  root = os.path.dirname(os.path.abspath(mpscale.__file__))
  paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root)
                 for f in files if f.endswith(".py"))
  return _file_digest(paths, root)


def _provider_digest(spec: Optional[str]) -> Optional[str]:
  """A digest of the file that defines a provider (``"pkg.mod:fn"`` or
  ``"file.py:fn"``), or ``None`` when it has none."""
  if not spec:
    return None
  from mpscale.trainer.models import user as models
  try:
    obj = models.load_object(spec, "provider")
  except (ValueError, TypeError):
    return None
  path = getattr(sys.modules.get(getattr(obj, "__module__", "")), "__file__", None)
  return _file_digest([path]) if path and os.path.exists(path) else None


def fingerprint(cfg: Any, **run: Any) -> dict[str, Any]:
  """What must be the same on every process: the resolved config (each key), the
  run's options (``run``: output folder, resume, ...), mpscale's source, the
  providers' source files, and the versions of Python and the libraries."""
  from mpscale import _versions
  from mpscale.trainer.config import load as config_lib
  out = config_lib.flat_keys(cfg)
  out.update({f"run.{k}": v for k, v in run.items()})
  out["code.mpscale"] = f"{_versions.installed('mpscale')} {_package_digest()}"
  for key in ("model.provider", "model.loss", "data.provider"):
    digest = _provider_digest(out.get(key))
    if digest is not None:
      out[f"code.{key}"] = digest
  out["version.python"] = platform.python_version()
  for name in ("jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "grain", "numpy"):
    out[f"version.{name}"] = _versions.installed(name)
  return out


def _allgather_text(text: str) -> list[str]:
  """``text`` of every process, in process order (a device collective)."""
  import numpy as np
  from jax.experimental import multihost_utils
  data = np.frombuffer(text.encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(data))))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:len(data)] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [bytes(row[:n]).decode() for row, n in zip(gathered, sizes)]


def differences(prints: list[dict[str, Any]]) -> list[str]:
  """``"key: value on process 0, other on process 1"`` for each key whose value is
  not the same in every fingerprint of ``prints`` (one per process)."""
  out = []
  for key in sorted(set().union(*prints)):
    values = [p.get(key, "<missing>") for p in prints]
    if any(v != values[0] for v in values[1:]):
      by_value: dict[str, list[int]] = {}
      for i, v in enumerate(values):
        by_value.setdefault(json.dumps(v, sort_keys=True, default=str), []).append(i)
      out.append(f"{key}: " + ", ".join(
          f"{text} on process{'es' if len(ids) > 1 else ''} "
          f"{', '.join(map(str, ids))}" for text, ids in by_value.items()))
  return out


def check_same_run(cfg: Any, source: str = "<config>", **run: Any) -> None:
  """Stops the run unless every process has the same `fingerprint`: nothing has run
  or been written yet. A no-op with one process.

  Raises:
    mpscale.trainer.config.load.ConfigError: naming ``source``, each differing key and its
      value on each process.
  """
  if not is_multiprocess():
    return
  from mpscale.trainer.config import load as config_lib
  mine = fingerprint(cfg, **run)
  prints = [json.loads(t) for t in
            _allgather_text(json.dumps(mine, sort_keys=True, default=str))]
  diff = differences(prints)
  if diff:
    raise config_lib.ConfigError(
        f"{source}: the {len(prints)} processes do not run the same config and code; "
        "every process must be started with the same config, flags and versions: "
        + "; ".join(diff[:10]) + (f"; and {len(diff) - 10} more" if len(diff) > 10
                                  else ""))


# ------------------------------------------------------------------ batches by process


def process_rows(sharding: Any, batch_size: int) -> tuple[int, int]:
  """The rows ``[start, stop)`` of each global batch that this process's devices
  hold, the batch laid out by ``sharding`` (split on its first dimension, e.g.
  `mpscale.trainer.config.build.batch_sharding`); all rows with one process or without a
  sharding.

  Raises:
    ValueError: naming ``mesh`` when this process's rows are not one contiguous range
      aligned to its size (the devices of a process are not adjacent on the data axes).
  """
  import jax
  if sharding is None or jax.process_count() == 1:
    return 0, batch_size
  spans = sorted({index[0].indices(batch_size)[:2] for index in
                  sharding.addressable_devices_indices_map((batch_size,)).values()})
  if not spans:
    raise ValueError(
        f"mesh: its {sharding.mesh.devices.size} devices include none of process "
        f"{jax.process_index()}'s; every process must take part: use all "
        f"{jax.device_count()} devices of the {jax.process_count()} processes")
  start, stop = spans[0][0], max(s for _, s in spans)
  covered = sum(b - a for a, b in spans)
  size = stop - start
  if covered != size or batch_size % size or start % size:
    raise ValueError(
        f"mesh: process {jax.process_index()}'s devices hold rows {spans} of each "
        f"batch of {batch_size}: not one block of the batch; order the devices so "
        "each process's are adjacent on the data axes")
  return start, stop


def global_batch(local: Mapping[str, Any], sharding: Any, batch_size: int,
                 rows: tuple[int, int]) -> Any:
  """One global batch laid out by ``sharding`` from each process's rows ``rows``
  (`process_rows`) of it; the host batch itself with one process or without a
  sharding (the step places it)."""
  import jax
  if sharding is None or jax.process_count() == 1:
    return local
  start = rows[0]

  def shard(v):
    def piece(index):
      first, last = index[0].indices(batch_size)[:2]
      return v[(slice(first - start, last - start),) + tuple(index[1:])]
    return jax.make_array_from_callback((batch_size,) + v.shape[1:], sharding, piece)

  return {k: shard(v) for k, v in local.items()}
