"""RMSNorm, the numba.cuda twin of ``ddtree/rmsnorm.py``.

Legend: T rows (tokens), D features, B threads per block.

    y = x / sqrt(mean(x^2) + eps) * weight

One kernel: one block per row. Its threads stride over the row summing squares in float32,
a shared-memory tree reduction adds the B partial sums, then every thread scales its own
elements. Bytes: each row is read twice (sum of squares, then scale; the second read usually
hits L1/L2) and written once, plus the weight vector: the kernel is memory-bound.

The block size B is a compile-time constant of the kernel (a shared array needs a static size),
so ``_rmsnorm_kernel(B)`` builds and caches one kernel per block size.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from kernels.device import (
    check_float32,
    check_threads,
    is_device_array,
    poisoned,
    pow2_threads,
    to_device,
    to_host_if,
)


# --8<-- [start:rmsnorm_kernel]
@functools.cache
def _rmsnorm_kernel(threads: int):
    """The RMSNorm kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def rmsnorm_kernel(x, weight, eps, out):
        # one block = one row of x (T, D); one thread = columns tid, tid + B, tid + 2B, ...
        # shared memory: B float32 partial sums of squares, tree-reduced to partial[0]
        partial = cuda.shared.array(threads, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        width = x.shape[1]

        acc = float32(0.0)
        for d in range(tid, width, threads):
            value = x[row, d]
            acc += value * value
        partial[tid] = acc
        cuda.syncthreads()

        stride = threads // 2                     # B/2, B/4, ..., 1: halve the live sums
        while stride > 0:
            if tid < stride:
                partial[tid] += partial[tid + stride]
            cuda.syncthreads()
            stride //= 2

        # every thread reads the total; the same float32 operations, in the same order, as numpy
        mean_square = partial[0] / float32(width)
        inv_rms = float32(1.0) / math.sqrt(mean_square + float32(eps))
        for d in range(tid, width, threads):
            out[row, d] = x[row, d] * inv_rms * weight[d]

    return rmsnorm_kernel
# --8<-- [end:rmsnorm_kernel]




# --8<-- [start:rmsnorm]
def rmsnorm(x, weight, eps: float, threads: int | None = None):
    """Normalise each row of ``x`` (T, D) (or any (..., D)) by its RMS, then scale by ``weight`` (D,).

    numpy in -> numpy out; a device array in -> a device array out (no copy back to the host).
    ``threads`` (a power of two) sets the block size, by default the smallest covering D (at most
    128); any D works with any block size.
    """
    x = x if is_device_array(x) else np.asarray(x, dtype=np.float32)
    weight = weight if is_device_array(weight) else np.asarray(weight, dtype=np.float32)
    if x.ndim < 1:
        raise ValueError(f"x must have shape (T, D) or (..., D), got a {x.ndim}-d array")
    width = x.shape[x.ndim - 1]                                   # (the simulator's shapes reject [-1])
    if weight.shape != (width,):
        raise ValueError(f"weight must have shape ({width},) to match x's last axis, got {weight.shape}")
    if not (isinstance(eps, (int, float, np.floating)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a non-negative finite number, got {eps!r}")
    threads = pow2_threads(width) if threads is None else threads
    check_threads(threads)
    check_float32(x=x, weight=weight)

    d_x, d_weight = to_device(x, np.float32), to_device(weight, np.float32)
    shape = d_x.shape
    if d_x.ndim != 2:
        if not d_x.is_c_contiguous():
            raise ValueError(f"a {d_x.ndim}-d device x must be C-contiguous (it is viewed as 2-D)")
        d_x = d_x.reshape(-1, width)                              # [T, D]
    out = poisoned(d_x.shape)                                     # [T, D], NaN until written
    if d_x.shape[0] > 0:
        _rmsnorm_kernel(threads)[d_x.shape[0], threads](d_x, d_weight, float(eps), out)
    if len(shape) != 2:
        out = out.reshape(shape)
    return to_host_if(out, x, weight)
# --8<-- [end:rmsnorm]
