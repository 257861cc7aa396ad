"""One place decides where the kernels run: a real CUDA GPU, or numba's CUDA simulator.

The simulator is used when no GPU is present or when the user asks for it with
``NUMBA_ENABLE_CUDASIM=1``; ``NUMBA_ENABLE_CUDASIM=0`` forces hardware. numba reads the variable
once, at import, so every kernel module imports this module before ``numba``.
"""

from __future__ import annotations

import glob
import os
import sys


def _gpu_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/dev/dxg"))


if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    if "numba" in sys.modules and "numba.cuda" in sys.modules:
        pass  # numba already decided; respect it
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if _gpu_present() else "1"

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

SIMULATOR: bool = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
if SIMULATOR:
    # every simulated CUDA thread is a Python thread: shorter switch intervals make
    # barrier-heavy kernels about 3x faster in the simulator
    sys.setswitchinterval(5e-4)


def where() -> str:
    """'simulator' or the GPU's name."""
    if SIMULATOR:
        return "simulator"
    return cuda.get_current_device().name.decode() if isinstance(
        cuda.get_current_device().name, bytes) else str(cuda.get_current_device().name)


def is_device_array(x) -> bool:
    # the simulator's numba.cuda has no is_cuda_array; every numba device array, real or
    # simulated, carries __cuda_ndarray__ = True
    return bool(getattr(x, "__cuda_ndarray__", False))


def check_threads(threads: int) -> None:
    """Block sizes for shared-memory tree reductions: a power of two in [32, 1024]."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not (
            32 <= threads <= 1024 and threads & (threads - 1) == 0):
        raise ValueError(f"threads must be a power of two in [32, 1024], got {threads!r}")


def to_device(x, dtype=None):
    """A device array for ``x``: device arrays pass through, host arrays are copied once."""
    if is_device_array(x):
        return x
    x = np.ascontiguousarray(x, dtype=dtype)
    return cuda.to_device(x)


@cuda.jit
def fill_kernel(flat, value):
    # one thread per element of a flat (contiguous) view
    i = cuda.grid(1)
    if i < flat.size:
        flat[i] = value


def poisoned(shape, dtype=np.float32):
    """A new device array filled with NaN (floats) or -1 (integers), so unwritten elements show.

    On a GPU the fill runs on the device (nothing is copied from the host); in the simulator,
    where every CUDA thread is a Python thread, the array is filled on the host and copied.
    """
    dtype = np.dtype(dtype)
    value = dtype.type(np.nan if np.issubdtype(dtype, np.floating) else -1)
    if SIMULATOR:
        return cuda.to_device(np.full(shape, value, dtype=dtype))
    out = cuda.device_array(shape, dtype=dtype)
    if out.size:
        fill_kernel[blocks(out.size, 256), 256](out.reshape(out.size), value)
    return out


def to_host_if(result, *inputs):
    """Return ``result`` as numpy unless some input already lived on the device."""
    if any(is_device_array(x) for x in inputs):
        return result
    return result.copy_to_host()


def check_float32(**arrays) -> None:
    """Device arrays are used as they are (no conversion), so they must already be float32."""
    for name, x in arrays.items():
        if is_device_array(x) and x.dtype != np.float32:
            raise ValueError(f"{name} must be float32 on the device, got {x.dtype}")


def pow2_threads(count: int, maximum: int = 128) -> int:
    """Block size for a reduction over ``count`` items: the smallest power of two >= count, in
    [32, maximum]. A block never has many more threads than work: idle threads still pay for every
    barrier (on hardware a little, in the simulator a whole Python thread)."""
    threads = 32
    while threads < min(count, maximum):
        threads *= 2
    return threads


def row_threads(count: int, maximum: int = 128) -> int:
    """Threads per block for a row of ``count`` independent outputs: whole warps, at most ``maximum``."""
    return min(maximum, 32 * blocks(count, 32))


def blocks(count: int, threads: int) -> int:
    """Blocks of ``threads`` needed to cover ``count`` items (at least one)."""
    return max(1, (count + threads - 1) // threads)
