"""Importing numba before the kernels package must not decide "hardware" on a machine without a GPU."""

import os
import subprocess
import sys

PROGRAM = """
import numba                                   # before kernels: numba has read the environment
import numpy as np
from kernels import device
from kernels.device import cuda
print(device.SIMULATOR, cuda.to_device(np.arange(3, dtype=np.float32)).copy_to_host().tolist())
"""


def test_numba_imported_first_still_gets_the_simulator_without_a_gpu():
    from kernels.device import _gpu_present

    env = {key: value for key, value in os.environ.items() if key != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(not _gpu_present()), "[0.0,", "1.0,", "2.0]"]
