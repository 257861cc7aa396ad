import os

# the CUDA simulator unless the shell asked for hardware (NUMBA_ENABLE_CUDASIM=0 wins);
# must be set before numba is imported anywhere
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kernels import device  # noqa: E402
from kernels.device import cuda  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if device.SIMULATOR:
        skip = pytest.mark.skip(reason="gpu: needs a real CUDA GPU (NUMBA_ENABLE_CUDASIM=0)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def host_copies(monkeypatch):
    """Sizes of every device -> host copy made while the test runs (an empty list: none)."""
    sizes = []
    array_type = type(cuda.to_device(np.zeros(1, np.float32)))
    original = array_type.copy_to_host

    def recording(self, *args, **kwargs):
        sizes.append(self.size)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(array_type, "copy_to_host", recording)
    return sizes
