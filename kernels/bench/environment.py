"""Where the benchmark ran: the GPU (or the simulator), its driver, the library versions, the L2
size that decides how many input sets keep a case out of the cache."""

from __future__ import annotations

import datetime
import platform
import shutil
import subprocess

import numba
import numpy as np
from numba import cuda

from kernels import device
from kernels.device import SIMULATOR

DEFAULT_L2_BYTES = 50 << 20     # when the device cannot say (H100/H200: 50 MiB)


def l2_bytes() -> int:
    """The device's L2 cache size in bytes (DEFAULT_L2_BYTES when it cannot say, or in the simulator)."""
    if SIMULATOR:
        return DEFAULT_L2_BYTES
    try:
        return int(cuda.get_current_device().L2_CACHE_SIZE) or DEFAULT_L2_BYTES
    except Exception:                          # an attribute this driver does not report
        return DEFAULT_L2_BYTES


def versions() -> list:
    """(key, value) lines of the report header: where and with what it ran."""
    import numba_cuda

    lines = [("date (UTC)", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")),
             ("GPU", device.where())]
    if not SIMULATOR:
        gpu = cuda.get_current_device()
        free, total = cuda.current_context().get_memory_info()
        lines.append(("device", f"cc {gpu.compute_capability[0]}.{gpu.compute_capability[1]}, "
                                f"{gpu.MULTIPROCESSOR_COUNT} SMs, L2 {l2_bytes() >> 20} MiB, "
                                f"{total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free)"))
        from numba.cuda.cudadrv import driver
        major, minor = driver.get_version()
        lines.append(("driver", f"{nvidia_driver()} (CUDA driver API {major}.{minor})"))
    lines.append(("versions", f"numba {numba.__version__}, numba-cuda {numba_cuda.__version__}, "
                              f"numpy {np.__version__}, Python {platform.python_version()}"))
    return lines


def nvidia_driver() -> str:
    """The NVIDIA driver version from nvidia-smi, or 'unknown'."""
    if shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.strip().splitlines()[0]
    except (subprocess.SubprocessError, OSError, IndexError):
        return "unknown"
