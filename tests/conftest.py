import os

# the CUDA simulator unless the shell asked for hardware (NUMBA_ENABLE_CUDASIM=0 wins);
# must be set before numba is imported anywhere
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

from kernels import device  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if device.SIMULATOR:
        skip = pytest.mark.skip(reason="gpu: needs a real CUDA GPU (NUMBA_ENABLE_CUDASIM=0)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
