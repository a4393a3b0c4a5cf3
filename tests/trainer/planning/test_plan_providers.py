"""`mpscale plan` of a user's model (``model.provider``): the NNX examples (the
transformer, and the digits CNN with BatchNorm and dropout), a linen module and a
plain `mpscale.trainer.Model`, planned from shapes and checked against the real arrays
the trainer builds for them.

Each example's step is compiled on one device and on ``mesh.data=2``; the command
then plans the digits CNN again (a hit of the session's compilation cache,
conftest.py).
"""

import json
import os
import textwrap

import jax
import numpy as np
import pytest

from mpscale.trainer.config import build as builders
from mpscale.trainer import cli
from mpscale.trainer.config import load as config_lib
from mpscale.trainer.runs import loop
from mpscale.trainer.planning import compiled as plan_lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DIGITS = os.path.join(ROOT, "examples", "digits_cnn", "config.yaml")
TRANSFORMER = os.path.join(ROOT, "examples", "nnx_transformer", "config.yaml")
SMALLER = {TRANSFORMER: ["model.args.num_layers=1", "data.args.train_size=512",
                        "data.args.eval_size=128"]}
"""One block (half the compile) and fewer sums to generate; the batch is the
config's."""


def _device_bytes(tree, device):
  """Bytes of ``tree``'s real arrays on ``device``."""
  return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
             for s in x.addressable_shards if s.device == device)


def _real_state(cfg):
  """The trainer's initial state of ``cfg``'s user model (built as `loop._prepare`
  builds it) and the device whose shards to count."""
  data = loop.open_data(cfg, None)
  model, _ = loop.open_model(cfg, None, None, data.train[0])
  setup = builders.build(cfg, model=model)
  state = setup.init(setup.init_params())
  device = (jax.devices()[0] if setup.mesh is None
            else setup.mesh.devices.flat[0])
  return state, device


def _check_against_real(planned, cfg):
  state, device = _real_state(cfg)
  assert planned.bytes["params"] == _device_bytes(state.params, device)
  assert planned.bytes["gradients"] == planned.bytes["params"]
  assert planned.bytes["optimizer_state"] == _device_bytes(state.opt_state, device)
  assert planned.bytes["model_state"] == (
      0 if state.model_state is None else _device_bytes(state.model_state, device))
  assert planned.params == sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  assert planned.bytes["peak"] > 0
  assert planned.bytes["peak"] >= planned.bytes["params"]
  assert planned.model_flops is None  # the built-in LM's formula does not apply


def _nnx_param_bytes(cfg):
  """Bytes of the ``nnx.Param``s of the module ``cfg``'s provider builds."""
  from flax import nnx
  from mpscale.trainer.models import user as models
  build = models.load_object(cfg.model.provider, "model.provider")
  module = build(cfg)
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("path", [TRANSFORMER, DIGITS],
                         ids=["nnx_transformer", "digits_cnn"])
@pytest.mark.parametrize("data", [1, 2])
def test_plan_of_an_nnx_example_has_the_real_bytes(path, data):
  cfg = config_lib.load_config(path, [f"mesh.data={data}", *SMALLER.get(path, [])])
  planned = plan_lib.plan(cfg, device_memory="1GB")
  assert planned.devices == data and planned.fits is True
  # Data parallel: every device holds all of the module's parameters (float32).
  assert planned.bytes["params"] == _nnx_param_bytes(cfg)
  assert planned.bytes["peak"] > planned.bytes["params"]
  assert planned.model_flops is None
  if data > 1:  # and every byte the trainer places on a device, one by one
    _check_against_real(planned, cfg)
  batch = cfg.data.batch_size
  if path == DIGITS:
    # BatchNorm's statistics are the model's state (dropout's key is the run's).
    assert planned.bytes["model_state"] > 0
    assert planned.tokens_per_step == batch  # no mask or targets: its rows
    assert planned.bytes["batch"] == batch * (8 * 8 + 1) * 4 // data  # image, label
  else:
    assert planned.bytes["model_state"] == 0
    assert planned.tokens_per_step == batch * 16  # the mask's size
  if data > 1:
    assert "all-reduce" in planned.collectives  # the gradients'
  else:
    assert not planned.collectives
  assert planned.flops_per_device > 0


def test_the_command_plans_a_provider_model(capsys):
  assert cli.main(["plan", "--config", DIGITS]) == 0
  text = capsys.readouterr().out
  assert text.startswith("digits_cnn: 37.8K params, 64 tokens per step, 1 device")
  assert "  model state " in text and "per device:" in text
  assert "the model's" not in text  # its FLOPs formula is the built-in LM's
  assert cli.main(["plan", "--config", DIGITS, "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["model_flops"] is None and out["bytes"]["model_state"] > 0
  assert out["bytes"]["params"] == _nnx_param_bytes(config_lib.load_config(DIGITS))


PROVIDERS = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn
    from mpscale.trainer import Model


    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))


    def linen_model(config):
      return MLP()


    def mse(model, batch):
      return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


    def plain_model(config):
      def init(key):
        return {"w": jax.random.normal(key, (4, 8)), "b": jnp.zeros((8,))}

      def loss_fn(params, batch):
        err = (batch["x"] @ params["w"] + params["b"]).sum(-1, keepdims=True)
        return ((err - batch["y"]) ** 2).sum(), jnp.float32(batch["y"].size)
      return Model(init, loss_fn)


    def source(config):
      rng = np.random.default_rng(0)
      x = rng.normal(size=(64, 4)).astype(np.float32)
      return [{"x": x[i], "y": x[i, :1]} for i in range(64)]
''')


@pytest.mark.parametrize("kind", ["linen", "plain"])
def test_plan_of_a_linen_module_or_a_model(tmp_path, kind):
  (tmp_path / "providers.py").write_text(PROVIDERS)
  model = ({"provider": "providers.py:linen_model", "loss": "providers.py:mse"}
           if kind == "linen" else {"provider": "providers.py:plain_model"})
  raw = {"name": kind, "model": model,
         "data": {"provider": "providers.py:source", "batch_size": 16},
         "optimizer": {"name": "adamw"}}
  cfg = config_lib.config_from_dict(raw, base_dir=str(tmp_path),
                                    overrides=["mesh.data=4"])
  planned = plan_lib.plan(cfg)
  _check_against_real(planned, cfg)
  assert planned.params == (4 * 16 + 16 + 16 + 1 if kind == "linen" else 4 * 8 + 8)
  assert planned.devices == 4 and planned.tokens_per_step == 16
  assert "all-reduce" in planned.collectives
  assert np.isfinite(planned.flops_per_device)
