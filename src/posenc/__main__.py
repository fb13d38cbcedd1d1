"""`python -m posenc ...`: the same command line as `posenc` (see `posenc.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
