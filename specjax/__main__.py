"""``python -m specjax``: the command line in :mod:`specjax.cli`."""

import sys

from specjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
