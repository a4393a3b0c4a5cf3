"""``python -m mpscale``: the command line (`mpscale.trainer.cli`).

The one module outside `mpscale.trainer` that imports it: a shell, not library code.
"""

import sys

from mpscale.trainer.cli import main

if __name__ == "__main__":
  sys.exit(main())
