"""``python -m mpscale``: the command line (see `mpscale.cli`)."""

import sys

from mpscale.cli import main

if __name__ == "__main__":
  sys.exit(main())
