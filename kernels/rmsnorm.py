"""RMSNorm, the numba.cuda twin of ``ddtree/rmsnorm.py``.

Legend (docs/glossary.md): T rows, D hidden_size (the latent norms normalise Rq or R features the
same way), TPB threads per block.

    y = x / sqrt(mean(x^2) + eps) * weight

One kernel: one block per row. Its threads stride over the row summing squares in float32,
``block_sum`` adds the TPB partial sums, then every thread scales its own elements. On a GPU the
block has up to ROW_THREADS = 512 threads, and each thread loads its elements ``batch`` at a time
into registers before adding them (``row_batch``, by the launch's rows: ``kernels.tuning``): in a
plain loop each iteration's load waits for the one before, so a row would cost D / TPB memory
latencies one after another. A row of at most TPB x batch elements is read once: the scale pass
uses the registers, and its weights are loaded with the row, so that no load waits after the sum;
a longer row is read twice (sum of squares, then scale; the second read usually hits L1/L2). The
kernel is memory-bound: each row is read once and written once, plus the weight vector.

The block size TPB is a compile-time constant of the kernel (a shared array needs a static
size), so ``rmsnorm_kernel(TPB)`` builds and caches one kernel per block size.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from ddtree import rmsnorm as reference
from kernels import tuning
from kernels.blocks import block_sum, check_threads
from kernels.device import (
    as_rows,
    check_float32,
    check_out,
    deliver,
    host_or_device,
    is_device_array,
    output,
    reduction_threads,
    to_device,
)

# the default block on a GPU: up to one thread per element of the row, at most 512 (a block of 1024
# makes the reduction tree one barrier step deeper, which costs a row more than its threads save)
ROW_THREADS = 512
BATCH_SLOTS = 8192          # batch x threads at most: a block's values and weights in registers
MAX_BATCH = 32              # the largest ``batch`` rmsnorm takes


# --8<-- [start:rmsnorm_kernel]
@functools.cache
def rmsnorm_kernel(threads: int, residual: bool = False, batch: int = tuning.RMSNORM_FEW_ROWS_BATCH,
                   slots: int = 0):
    """The RMSNorm kernel for blocks of ``threads`` threads (a power of two); with ``residual``, the residual
    add before it (x += delta, written back), in the same launch; with ``slots`` = k > 0, an MoE layer's k
    weighed expert outputs added to delta first, in slot order (``kernels.moe.combine_kernel``'s sum, whose
    launch this saves). ``batch``: a thread's elements loaded at a time (``rmsnorm`` picks ``row_batch``);
    every thread adds its squares in column order whatever the batch, so it changes no bit, only how many
    loads are in flight."""
    adds, slot_count = residual or slots > 0, max(1, slots)

    @cuda.jit
    def kernel(x, delta, down, slot_weights, weight, eps, out):
        # one block = one row of x (T, D); one thread = columns tid, tid + TPB, tid + 2 TPB, ...
        # read ``batch`` at a time into registers (their loads overlap; a row of one batch loads
        # its weights with them), squares summed in column order; shared memory: TPB float32
        # partial sums of squares, reduced to partial[0]. With ``residual`` or ``slots`` a value is
        # x + (delta or 0 + slot_weights[t, 0] down[t, 0] + ...), and its thread writes it back to x
        # (delta, down and slot_weights unused else)
        partial = cuda.shared.array(threads, float32)
        values = cuda.local.array(batch, float32)
        scales = cuda.local.array(batch, float32)          # a one-batch row's weights, loaded with x
        weighs = cuda.local.array(slot_count, float32)    # the row's k slot weights, loaded once
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        width = x.shape[1]
        one_batch = width <= threads * batch
        for j in range(slots):
            weighs[j] = slot_weights[row, j]

        acc = float32(0.0)
        for base in range(tid, width, threads * batch):
            for b in range(batch):
                d = min(base + b * threads, width - 1)      # past the row: re-read its last column
                if adds:                                    # combine_kernel's sum, then the add
                    total = delta[row, d] if residual else float32(0.0)
                    if base + b * threads < width:          # (past the row: its value goes unused)
                        for j in range(slots):
                            total += weighs[j] * down[row, j, d]
                    values[b] = x[row, d] + total
                else:
                    values[b] = x[row, d]
                if one_batch:                               # in flight with x: no wait after the sum
                    scales[b] = weight[d]
            for b in range(batch):
                if base + b * threads < width:
                    acc += values[b] * values[b]
                    if adds:                                # the owner alone writes the sum back
                        x[row, base + b * threads] = values[b]
        partial[tid] = acc
        block_sum(partial)

        # every thread reads the total; the same float32 operations, in the same order, as numpy
        mean_square = partial[0] / float32(width)
        inv_rms = float32(1.0) / math.sqrt(mean_square + float32(eps))
        if one_batch:                                       # the row and its weights are in registers
            for b in range(batch):
                d = tid + b * threads
                if d < width:
                    out[row, d] = values[b] * inv_rms * scales[b]
        else:                                               # x holds the sums: the thread wrote them
            for d in range(tid, width, threads):
                out[row, d] = x[row, d] * inv_rms * weight[d]

    return kernel
# --8<-- [end:rmsnorm_kernel]


def check_rmsnorm(x, weight, eps, *, threads=None, out=None, residual=None, batch=None, slots=None):
    """The reference's rules (shapes, eps), then the launch's: block size, batch, float32 on the
    device, ``out``, ``residual`` (x's shape, float32, x and it both device arrays: x is updated in
    place) and ``slots`` (``check_slots``). Returns x and weight as numpy or device arrays."""
    x, weight = host_or_device(x, np.float32), host_or_device(weight, np.float32)
    reference.check_rmsnorm(x, weight, eps)
    if threads is not None:
        check_threads(threads)
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be an int in [1, {MAX_BATCH}], got {batch!r}")
        block = threads or reduction_threads(x.shape[x.ndim - 1], ROW_THREADS)
        if batch * block > BATCH_SLOTS:
            raise ValueError(f"batch x threads must be at most {BATCH_SLOTS} (a block's registers), got "
                             f"{batch} x {block}")
    check_float32(x=x, weight=weight)
    check_out(out, x.shape)
    if residual is not None:
        if not (is_device_array(x) and is_device_array(residual)):
            raise ValueError("residual needs x and residual as device arrays (x is updated in place), got "
                             f"x {type(x).__name__} and residual {type(residual).__name__}")
        check_float32(residual=residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
    if slots is not None:
        check_slots(x, slots)
    return x, weight


def check_slots(x, slots) -> None:
    """``slots`` = (down, weights): device float32 arrays (T, k, D) and (T, k), k >= 1, for x (T, D),
    itself a device array (x is updated in place)."""
    if not (isinstance(slots, tuple) and len(slots) == 2):
        raise ValueError(f"slots must be a pair (down, weights), got {type(slots).__name__}")
    down, weights = slots
    if not all(map(is_device_array, (x, down, weights))):
        names = ", ".join(f"{name} {type(array).__name__}" for name, array in (("x", x), ("down", down),
                                                                                ("weights", weights)))
        raise ValueError(f"slots needs x, down and weights as device arrays (x is updated in place), got "
                         f"{names}")
    check_float32(down=down, weights=weights)
    if x.ndim != 2 or down.ndim != 3 or weights.shape != down.shape[:2] or down.shape[1] < 1 \
            or (down.shape[0], down.shape[2]) != x.shape:
        raise ValueError(f"slots must be down (T, k, D) and weights (T, k) with k >= 1 for x (T, D) = "
                         f"{x.shape}, got down {down.shape} and weights {weights.shape}")


def row_batch(rows: int, threads: int, width: int) -> int:
    """The default ``batch`` for a launch of ``rows`` rows of ``width`` elements in blocks of
    ``threads`` threads: the larger one up to one block per SM (``sm_count()`` rows), the smaller one
    for more rows (both in ``kernels.tuning``), at most BATCH_SLOTS / threads, and never more than a
    thread's elements of the row (ceil(width / threads)): a slot past the row would only load its last
    column again. It changes no bit, so it may depend on the launch."""
    few = rows <= tuning.sm_count()
    batch = tuning.RMSNORM_FEW_ROWS_BATCH if few else tuning.RMSNORM_MANY_ROWS_BATCH
    return max(1, min(batch, BATCH_SLOTS // threads, -(-width // threads)))


# --8<-- [start:rmsnorm]
def rmsnorm(x, weight, eps: float, *, residual=None, slots=None, threads: int | None = None,
            batch: int | None = None, out=None, stream=None):
    """Normalise each row of ``x`` (T, D) (or any (..., D)) by its RMS, then scale by ``weight`` (D,).

    numpy in -> numpy out; a device array in -> a device array out (no copy back to the host). ``residual``
    (device arrays only): first x += residual, written back into x, then the norm of the sum: a residual add
    and the norm after it in one launch, the same bits as the two apart. ``slots`` = (down, weights) (device
    arrays, x (T, D): down (T, k, D), weights (T, k)): an MoE layer's routed experts not yet combined
    (``kernels.moe.moe(combine=False)``), added to the residual (or to 0 without one) in slot order, then
    to x: the same bits as ``combine_kernel`` and the norm apart. ``threads`` (a power of two) sets the
    block size, by default the smallest covering D (at most ROW_THREADS on a GPU, 32 in the simulator); any
    D works with any block size. ``batch``: each thread's elements loaded at a time (default ``row_batch``;
    the same bits at any batch). ``out`` (x's shape, float32) receives the result; ``stream`` is where the
    kernel is launched (None: the default stream).
    """
    x, weight = check_rmsnorm(x, weight, eps, threads=threads, out=out, residual=residual, batch=batch,
                              slots=slots)
    threads = threads or reduction_threads(x.shape[x.ndim - 1], ROW_THREADS)
    d_x = as_rows(to_device(x, np.float32), "x")                      # [T, D]
    d_out = output(out, x.shape, stream=stream)                       # NaN until written
    if d_x.shape[0] > 0:
        delta = d_x if residual is None else as_rows(residual, "residual")   # [T, D]
        rows, width = d_x.shape
        down, slot_weights = slots or (d_x.reshape(rows, 1, width), d_x)    # [T, k, D], [T, k] (unused: x)
        batch = batch or row_batch(rows, threads, width)
        launch = rmsnorm_kernel(threads, residual is not None, batch, 0 if slots is None else down.shape[1])
        launch[rows, threads, stream](d_x, delta, down, slot_weights, to_device(weight, np.float32),
                                      float(eps), as_rows(d_out, "out"))
    return deliver(d_out, out, x, weight)
# --8<-- [end:rmsnorm]
