"""Train the digits example from Python: the same model, loss and data as
``config.yaml`` names, passed to `mpscale.trainer.run` as objects.

::

  python examples/digits_cnn/train.py [--steps 200] [--out runs/digits_cnn_python]
                                     [--resume | --overwrite]

As ``mpscale train``, a folder that holds a run is refused unless ``--resume``
continues it or ``--overwrite`` replaces it.
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
  existing = parser.add_mutually_exclusive_group()
  existing.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest checkpoint")
  existing.add_argument("--overwrite", action="store_true",
                        help="replace the run in --out")
  args = parser.parse_args(argv)
  # The config's settings (precision, loss scale, optimizer, schedule, run length,
  # and the evaluation metrics, model.metrics).
  config = mpscale.trainer.load_config(os.path.join(HERE, "config.yaml"),
                                       [f"train.steps={args.steps}", *args.set])
  # Objects given here take the place of the providers the config names.
  module = example.build(config)  # a flax.nnx.Module with BatchNorm and dropout
  data = example.source(config)   # {"train": source, "eval": source}
  try:
    return mpscale.trainer.run(config, model=module, loss=example.loss, data=data,
                               out_dir=args.out, resume=args.resume,
                               overwrite=args.overwrite)
  except (mpscale.trainer.ConfigError, mpscale.trainer.RunDirError) as e:
    # said as the command says it: a bad --set, a run already in --out
    parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
  summary = main()
  accuracy = summary.get("final_eval_accuracy")
  accuracy = "" if accuracy is None else f", accuracy {accuracy:.3f}"
  print(f"eval loss {summary['final_eval_loss']:.3f}{accuracy} after "
        f"{summary['steps']} steps -> {summary['out_dir']}")
