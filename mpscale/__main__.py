"""``python -m mpscale`` and the ``mpscale`` command: the trainer's command line
(`mpscale.trainer.cli`).

The one module outside `mpscale.trainer` that imports it: a shell, not library code.
Without the trainer's libraries (``pip install "mpscale[trainer]"``) it says so in one
line instead of a traceback.
"""

import signal
import sys
import threading
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command (`mpscale.trainer.cli.main`) on ``argv``; its exit status.

  A Ctrl-C while the trainer's modules import (seconds: JAX, orbax, Flax) is held
  until they are in, then ends the command with status 130 before it starts
  anything: raised inside an import, it printed a traceback and could crash the
  interpreter at exit."""
  held = []
  hold = threading.current_thread() is threading.main_thread()
  if hold:
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
  try:
    from mpscale.trainer import cli  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    if "mpscale[trainer]" not in str(e):
      raise
    print(f"mpscale: {e}", file=sys.stderr)
    return 1
  finally:
    if hold:
      signal.signal(signal.SIGINT, previous)
  if held:
    print("mpscale: interrupted before it started anything", file=sys.stderr)
    return 130
  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main())
