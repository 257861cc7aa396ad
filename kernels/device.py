"""One place decides where the kernels run (a real CUDA GPU, or numba's CUDA simulator), and the
host-side helpers every launch wrapper shares: device arrays in and out, output buffers.

The simulator is used when no GPU is present or when the user asks for it with ``NUMBA_ENABLE_CUDASIM=1``;
``NUMBA_ENABLE_CUDASIM=0`` forces hardware. numba reads the variable once, at import, so every kernel module
imports this module before ``numba``. In the simulator it also installs ``kernels.simulator`` (cheaper
barriers, threads and array accesses; the same results).

A launch wrapper takes numpy arrays (the result comes back as numpy) or device arrays (the
result stays on the device). ``out``, when given, is the buffer the kernel writes (``check_out``,
``output``): a device ``out`` means no allocation and no NaN poison, so a caller can keep its
buffers and capture the launches in a CUDA graph; without it the wrapper allocates a new output
filled with NaN (``poisoned``), so an element the kernel fails to write shows.
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
        if "numba" in sys.modules:  # numba read the environment when it was imported: again
            sys.modules["numba"].core.config.reload_config()

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kernels import simulator  # noqa: E402
from kernels.blocks import MAX_TPB, blocks, pow2_threads  # noqa: E402

SIMULATOR: bool = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


if SIMULATOR:
    simulator.install()


def hardware_options(**options) -> dict:
    """``cuda.jit`` options that only a GPU takes (``max_registers``): empty in the CUDA simulator,
    whose ``jit`` refuses them (it has no registers to limit)."""
    return {} if SIMULATOR else options


def reduction_threads(count: int, maximum: int = MAX_TPB) -> int:
    """TPB for the row kernels' reductions over ``count`` items (``pow2_threads``, at most ``maximum``): at
    most 32 threads in the simulator, where every idle thread is a Python thread waiting at every barrier. The
    block size changes the order of a sum, never which rows it depends on."""
    return pow2_threads(count, 32 if SIMULATOR else maximum)


def where() -> str:
    """'simulator' or the GPU's name."""
    if SIMULATOR:
        return "simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def core_device():
    """numba's device as a ``cuda.core`` ``Device``, current for ``cuda.core`` too (GPU only): what
    the engine's stream and the benchmark's graphs are made from.

    numba's context is made current first, and the device is named by its id: ``Device()`` with no
    id asks the driver for the current context's device, an error while no context is current."""
    from cuda.core import Device

    device = Device(cuda.current_context().device.id)
    device.set_current()
    return device


def is_device_array(x) -> bool:
    # the simulator's numba.cuda has no is_cuda_array; every numba device array, real or
    # simulated, carries __cuda_ndarray__ = True
    return bool(getattr(x, "__cuda_ndarray__", False))


def host_or_device(x, dtype=None):
    """Device arrays as they are; anything else as a numpy array (of ``dtype`` when given)."""
    return x if is_device_array(x) else np.asarray(x, dtype=dtype)


def to_device(x, dtype=None):
    """A device array for ``x``: device arrays pass through, host arrays are copied once."""
    if is_device_array(x):
        return x
    x = np.ascontiguousarray(x, dtype=dtype)
    return cuda.to_device(x)


def as_rows(d_array, name: str):
    """View a device array (..., C) as (R, C): kernels index rows and columns."""
    if d_array.ndim == 2:
        return d_array
    if not d_array.is_c_contiguous():
        raise ValueError(f"a {d_array.ndim}-d device {name} must be C-contiguous (it is viewed as 2-D)")
    return d_array.reshape(-1, d_array.shape[d_array.ndim - 1])


@cuda.jit
def fill_kernel(flat, value):
    # one thread per element of a flat (contiguous) view
    i = cuda.grid(1)
    if i < flat.size:
        flat[i] = value


def filled(shape, value, dtype=np.float32, stream=None):
    """A new device array holding ``value`` everywhere.

    On a GPU the fill runs on the device (nothing is copied from the host); in the simulator,
    where every CUDA thread is a Python thread, the array is filled on the host and copied.
    """
    dtype = np.dtype(dtype)
    if SIMULATOR:
        return cuda.to_device(np.full(shape, value, dtype=dtype))
    out = cuda.device_array(shape, dtype=dtype)
    if out.size:
        fill_kernel[blocks(out.size, 256), 256, stream](out.reshape(out.size), dtype.type(value))
    return out


def poisoned(shape, dtype=np.float32, stream=None):
    """A new device array filled with NaN (floats) or -1 (integers), so unwritten elements show."""
    dtype = np.dtype(dtype)
    return filled(shape, np.nan if np.issubdtype(dtype, np.floating) else -1, dtype, stream)


def check_out(out, shape, dtype=np.float32, name: str = "out", strided: bool = False) -> None:
    """A caller's output buffer (host or device), when given: ``shape``, ``dtype``, C-contiguous
    (with ``strided``, a device buffer may be any view: its kernel indexes it as it is)."""
    if out is None:
        return
    shape, dtype = tuple(shape), np.dtype(dtype)
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {shape}, "
                         f"got {out.dtype} of shape {tuple(out.shape)}")
    if is_device_array(out):
        if not (strided or out.is_c_contiguous()):
            raise ValueError(f"{name} must be C-contiguous")
    elif not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def output(out, shape, dtype=np.float32, stream=None):
    """The device array a kernel writes: a device ``out`` itself (no allocation, no poison),
    otherwise a new NaN-poisoned one (copied into a host ``out`` by ``deliver``)."""
    return out if is_device_array(out) else poisoned(shape, dtype, stream)


def deliver(result, out, *inputs):
    """What a wrapper returns. With ``out`` given: ``out`` (a host ``out`` receives a copy of the
    device ``result``). Without: ``result`` on the device if some input lived there, else on the host."""
    if out is not None:
        if not is_device_array(out):
            result.copy_to_host(out)
        return out
    if any(is_device_array(x) for x in inputs):
        return result
    return result.copy_to_host()


def check_version(version, versions: tuple[int, ...]) -> int:
    """A kernel version asked for with ``version=``: one of ``versions`` (an int, not a bool)."""
    if isinstance(version, bool) or version not in versions:
        raise ValueError(f"version must be one of {versions}, got {version!r}")
    return int(version)


def check_float32(**arrays) -> None:
    """Device arrays are used as they are (no conversion), so they must already be float32."""
    for name, x in arrays.items():
        if is_device_array(x) and x.dtype != np.float32:
            raise ValueError(f"{name} must be float32 on the device, got {x.dtype}")
