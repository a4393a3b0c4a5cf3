"""``python -m mpscale`` and the ``mpscale`` command: the trainer's command line
(`mpscale.trainer.cli`).

The one module outside `mpscale.trainer` that imports it: a shell, not library code.
Without the trainer's libraries (``pip install "mpscale[trainer]"``) it says so in one
line instead of a traceback.
"""

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command (`mpscale.trainer.cli.main`) on ``argv``; its exit status."""
  try:
    from mpscale.trainer import cli  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    if "mpscale[trainer]" not in str(e):
      raise
    print(f"mpscale: {e}", file=sys.stderr)
    return 1
  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main())
