"""Train the digits example from Python: the same model, loss and data as
``config.yaml`` names, passed to `mpscale.trainer.run` as objects.

::

  python examples/digits_cnn/train.py [--steps 200] [--out runs/digits_cnn_python]
"""

from __future__ import annotations

import argparse
import os
import sys

import mpscale.trainer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model as example  # noqa: E402  (this folder's model.py)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--out", default=os.path.join("runs", "digits_cnn_python"))
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, as for mpscale train")
  args = parser.parse_args(argv)
  # The config's settings (precision, loss scale, optimizer, schedule, run length,
  # and the evaluation metrics, model.metrics).
  config = mpscale.trainer.load_config(os.path.join(HERE, "config.yaml"),
                                       [f"train.steps={args.steps}", *args.set])
  # Objects given here take the place of the providers the config names.
  module = example.build(config)  # a flax.nnx.Module with BatchNorm and dropout
  data = example.source(config)   # {"train": source, "eval": source}
  return mpscale.trainer.run(config, model=module, loss=example.loss, data=data,
                             out_dir=args.out, overwrite=True)


if __name__ == "__main__":
  summary = main()
  accuracy = summary.get("final_eval_accuracy")
  accuracy = "" if accuracy is None else f", accuracy {accuracy:.3f}"
  print(f"eval loss {summary['final_eval_loss']:.3f}{accuracy} after "
        f"{summary['steps']} steps -> {summary['out_dir']}")
