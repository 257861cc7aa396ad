"""``python -m kernels.bench``: see the package docstring."""

import sys

from kernels.bench.cli import main

sys.exit(main())
