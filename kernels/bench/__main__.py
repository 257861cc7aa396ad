"""``python -m kernels.bench``: see the package docstring."""

import sys

from kernels.bench.cli import main

if __name__ == "__main__":          # not when a spawned worker process imports this module
    sys.exit(main())
