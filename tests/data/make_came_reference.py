"""Generates tests/data/came_reference.npz: CAME trajectories from came-pytorch 0.1.3.

Needs the optional extra ``reference`` (CPU torch first)::

  pip install torch==2.13.0            # the CPU build
  pip install came-pytorch==0.1.3
  python tests/data/make_came_reference.py

The params and the gradients are not stored: both are drawn with NumPy from fixed
seeds by `initial_params` and `gradient`, which tests/library/optim/test_came.py imports from this
file (importing it needs no torch). The gradients are random at every step and never
derived from the params. What is stored, per variant and dtype, is the parameter
trajectory at a few checkpoint steps: every small leaf in full, the (256, 512) leaf
as a strided sample (every 31st number, which meets every row and column; in full at
the last step of the float32 ``default`` run), plus a fingerprint of the first
gradients so that a change in NumPy's generator shows up as such.

Variants (the mpscale keyword arguments are in `VARIANTS`):

* ``default``: came-pytorch's defaults, constant beta2 = 0.999.
* ``decay_rate``: mindformers' time-dependent beta2 = 1 - t**-0.8 (came-pytorch
  follows it because the group's ``betas`` are set before each step), beta3 = 0.99,
  weight decay.
* ``scale_parameter``: Adafactor's parameter scale: came-pytorch follows it with one
  param group per leaf whose ``lr`` is set to ``lr * max(eps[1], rms(p))`` before each
  step (weight decay is scaled by that lr as well, as in mpscale).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

SEED = 20230712
STEPS = 100
CHECKPOINTS = (1, 2, 10, 50, 100)
BIG = "w_256x512"
BIG_STRIDE = 31
SHAPES = {
    "w_32x48": (32, 48),
    "b_48": (48,),
    "w_4x8x16": (4, 8, 16),
    "w_1x64": (1, 64),
    BIG: (256, 512),
    "scalar": (),
}
# Gradient magnitude per leaf: several orders, so eps and the clip both matter.
GRAD_SCALES = {"w_32x48": 1.0, "b_48": 1e-2, "w_4x8x16": 3.0, "w_1x64": 1e-3,
               BIG: 0.1, "scalar": 10.0}
DTYPES = ("float32", "float64")

VARIANTS = {
    "default": dict(learning_rate=1e-3, eps=(1e-30, 1e-3, 1e-16), clip_threshold=1.0,
                    decay_rate=None, beta1=0.9, beta2=0.999, beta3=0.9999,
                    weight_decay=0.0, scale_parameter=False),
    "decay_rate": dict(learning_rate=1e-3, eps=(1e-30, 1e-3, 1e-16),
                       clip_threshold=1.0, decay_rate=0.8, beta1=0.9, beta2=None,
                       beta3=0.99, weight_decay=0.01, scale_parameter=False),
    "scale_parameter": dict(learning_rate=1e-2, eps=(1e-30, 1e-3, 1e-16),
                            clip_threshold=0.5, decay_rate=None, beta1=0.9,
                            beta2=0.999, beta3=0.999, weight_decay=0.05,
                            scale_parameter=True),
}

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "came_reference.npz")


def initial_params() -> dict[str, np.ndarray]:
  """The float64 starting params, one standard normal draw per leaf."""
  rng = np.random.default_rng(SEED)
  return {name: rng.standard_normal(shape) for name, shape in SHAPES.items()}


def gradient(step: int) -> dict[str, np.ndarray]:
  """The float64 gradients of ``step`` (1-based), independent of the params.

  Each leaf is a standard normal draw times log-normal row and column factors (so the
  factored second moment has structure to find) times a per-leaf scale.
  """
  grads = {}
  for index, (name, shape) in enumerate(SHAPES.items()):
    rng = np.random.default_rng([SEED, step, index])
    g = rng.standard_normal(shape)
    if len(shape) >= 2:
      g = g * np.exp(0.5 * rng.standard_normal(shape[:-1] + (1,)))
      g = g * np.exp(0.5 * rng.standard_normal(shape[:-2] + (1,) + shape[-1:]))
    grads[name] = GRAD_SCALES[name] * g
  return grads


def big_sample(x: np.ndarray) -> np.ndarray:
  """The strided sample of the (256, 512) leaf kept at every checkpoint."""
  return np.asarray(x).reshape(-1)[::BIG_STRIDE]


def _beta2_at(config: dict, t: int) -> float:
  if config["beta2"] is not None:
    return config["beta2"]
  return 1.0 - t ** (-config["decay_rate"])


def run_came_pytorch(config: dict, dtype: str) -> dict[int, dict[str, np.ndarray]]:
  """Params at each checkpoint step, from came-pytorch 0.1.3."""
  import torch
  from came_pytorch import CAME

  torch.manual_seed(0)
  torch_dtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
  params = {name: torch.nn.Parameter(torch.tensor(p, dtype=torch_dtype))
            for name, p in initial_params().items()}
  eps0, eps1, eps2 = config["eps"]
  opt = CAME([{"params": [p]} for p in params.values()], lr=config["learning_rate"],
             eps=(eps0, eps2), clip_threshold=config["clip_threshold"],
             betas=(config["beta1"], 0.999, config["beta3"]),
             weight_decay=config["weight_decay"])
  out = {}
  for step in range(1, STEPS + 1):
    for name, g in gradient(step).items():
      params[name].grad = torch.tensor(g, dtype=torch_dtype)
    for group in opt.param_groups:
      (p,) = group["params"]
      group["betas"] = (config["beta1"], _beta2_at(config, step), config["beta3"])
      lr = config["learning_rate"]
      if config["scale_parameter"]:
        rms = float(p.detach().norm(2) / math.sqrt(p.numel()))
        lr = lr * max(eps1, rms)
      group["lr"] = lr
    opt.step()
    if step in CHECKPOINTS:
      out[step] = {name: p.detach().numpy().copy() for name, p in params.items()}
  return out


def main() -> None:
  import came_pytorch
  import torch

  arrays = {}
  first = gradient(1)
  for name, g in first.items():
    arrays[f"grad1/{name}"] = big_sample(g) if name == BIG else g
  for variant, config in VARIANTS.items():
    for dtype in DTYPES:
      trajectory = run_came_pytorch(config, dtype)
      for step, params in trajectory.items():
        for name, p in params.items():
          key = f"{variant}/{dtype}/step{step}/{name}"
          arrays[key] = big_sample(p) if name == BIG else p
      if variant == "default" and dtype == "float32":
        arrays[f"{variant}/{dtype}/step{STEPS}/{BIG}_full"] = trajectory[STEPS][BIG]
  arrays["meta"] = np.asarray(json.dumps({
      "seed": SEED, "steps": STEPS, "checkpoints": CHECKPOINTS,
      "big_stride": BIG_STRIDE, "variants": VARIANTS,
      "torch": torch.__version__, "numpy": np.__version__,
      "came_pytorch": getattr(came_pytorch, "__version__", "0.1.3")}))
  np.savez_compressed(OUT, **arrays)
  print(f"wrote {OUT}: {os.path.getsize(OUT) / 1e6:.2f} MB, {len(arrays)} arrays")


if __name__ == "__main__":
  main()
