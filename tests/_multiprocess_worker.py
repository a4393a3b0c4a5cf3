"""A worker for tests/integration/test_multiprocess.py: one of two processes, 4 CPU devices each.

Also imported by the test itself, which runs the same `train` on 8 local devices.
"""

import os
import sys

import numpy as np

STEPS = 4


def train(kind: str) -> dict:
  """Trains a small model for STEPS steps on a mesh of all (global) devices."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import mpscale

  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 4)).astype(np.float32)
  y = rng.normal(size=(32, 2)).astype(np.float32)
  mask = (rng.random(32) < 0.7).astype(np.float32)
  if kind == "data":
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}
    model = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    tx = mpscale.dynamic_loss_scale(optax.adam(0.1), init_scale=2.0**8)
  else:  # pipelined: data axis across the two processes, stages within each
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))
    params = {"embed": jnp.asarray(rng.normal(size=(4, 8)) * 0.5, jnp.float32),
              "stages": {"w": jnp.asarray(rng.normal(size=(8, 8, 8)) * 0.3, jnp.float32)},
              "head": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)}

    def head(p, h, b):
      err = jnp.sum((h @ p["head"] - b["y"]) ** 2, axis=-1)
      return jnp.sum(err * b["mask"]), jnp.sum(b["mask"])

    model = mpscale.Pipeline(lambda p, b: b["x"] @ p["embed"],
                             lambda lp, h: jnp.tanh(h @ lp["w"]), head,
                             num_microbatches=2, schedule="1f1b")
    tx = mpscale.dynamic_loss_scale(
        optax.chain(mpscale.global_norm_clip(1.0, norm_groups=mpscale.stage_norm_groups(4)),
                    optax.adam(0.05)), init_scale=2.0**8)
  init, step = mpscale.make_train_step(model, tx, mesh=mesh,
                                       per_token_loss=kind != "data")
  state = init(params)
  sharding = NamedSharding(mesh, P("data"))
  batch = {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i])
           for k, v in {"x": x, "y": y, "mask": mask}.items()}
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(metrics["loss"])
  out = multihost_utils.process_allgather(
      {"params": state.params, "losses": losses,
       "scale": mpscale.loss_scale_of(state.opt_state)}, tiled=True)
  return jax.tree.map(np.asarray, out)


def flatten(result: dict) -> dict:
  """``result`` as a flat ``{"params/w": array, ...}`` dict (npz keys)."""
  from mpscale.scaling import _norms as norms
  import jax
  return {norms.path_str(path): v
          for path, v in jax.tree_util.tree_flatten_with_path(result)[0]}


def main():
  process_id, port, kind, out_path = sys.argv[1:]
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=2, process_id=int(process_id))
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  result = train(kind)
  if jax.process_index() == 0:
    np.savez(out_path, **flatten(result))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
