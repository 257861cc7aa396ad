"""kernels: numba.cuda twins of the ``ddtree`` numpy reference, same stems and function names.

Importing this package decides GPU or simulator (see ``kernels.device``) before numba loads.
"""

from kernels import device as device  # noqa: F401  (must run before any numba import)
