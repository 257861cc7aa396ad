"""Block sizes and block-wide reductions: the pieces every kernel shares.

Legend: TPB threads per block (a kernel's block size, ``cuda.blockDim.x``).

Host side, the block-size pickers: ``pow2_threads`` for a block that reduces over its threads (a power of two:
each step of a tree reduction halves the live values), ``row_threads`` for a block of independent outputs
(whole warps), ``blocks`` for the grid, ``check_threads`` for a block size a caller forces.

Device side, the block reductions. Thread tid writes its value to ``scratch[tid]`` (TPB shared slots), the
reduction combines them with a tree: TPB/2 threads combine pairs, then TPB/4, ..., one barrier per level,
log2(TPB) levels; the result lands in ``scratch[0]``. The pairing is fixed, so a sum is deterministic run to
run (but not numpy's order: floats are not associative). Each reduction starts with a barrier
(every thread's slot is written) and ends with one (``scratch[0]`` is final), so the caller writes its slot
just before and reads ``scratch[0]`` just after; a caller that reuses ``scratch`` waits for a barrier first,
so that every thread has read ``scratch[0]``. ``segment_max`` / ``segment_sum`` run the same tree inside each
segment of a block (a warp per head in attention_paths' version 3): segment = TPB is the block reduction, pair
for pair. Shared-memory trees are the portable baseline: the CUDA simulator has no warp shuffles.
"""

from __future__ import annotations

import math

from numba import cuda

MAX_TPB = 128   # the largest block the pickers choose (a forced block size may be larger)


# --8<-- [start:pickers]
def pow2_threads(count: int, maximum: int = MAX_TPB) -> int:
    """TPB for a reduction over ``count`` items: the smallest power of two >= count, in
    [32, maximum]. A block never has many more threads than work: idle threads still pay for every
    barrier (on hardware a little, in the simulator a whole Python thread)."""
    threads = 32
    while threads < min(count, maximum):
        threads *= 2
    return threads


def row_threads(count: int, maximum: int = MAX_TPB) -> int:
    """TPB for a row of ``count`` independent outputs: whole warps of 32, at most ``maximum``."""
    return min(maximum, 32 * blocks(count, 32))


def blocks(count: int, threads: int) -> int:
    """Blocks of ``threads`` needed to cover ``count`` items (at least one)."""
    return max(1, (count + threads - 1) // threads)
# --8<-- [end:pickers]


def check_threads(threads, maximum: int = 1024) -> None:
    """A forced block size for a tree reduction: a power of two in [32, maximum]."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not (
            32 <= threads <= maximum and threads & (threads - 1) == 0):
        raise ValueError(f"threads must be a power of two in [32, {maximum}], got {threads!r}")


# --8<-- [start:block_sum]
@cuda.jit(device=True)
def block_sum(scratch):
    """scratch[0] = sum(scratch[:TPB]), in a fixed order (deterministic)."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()                            # every thread has written its slot
    stride = cuda.blockDim.x // 2                 # TPB/2, TPB/4, ..., 1: halve the live sums
    while stride > 0:
        if tid < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:block_sum]


# --8<-- [start:block_sums]
@cuda.jit(device=True)
def block_sums(scratch):
    """scratch[r, 0] = sum(scratch[r, :TPB]) for every row r of a 2-D scratch: block_sum's tree,
    one per row, so that each row's sum is the one block_sum would give it alone."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            for r in range(scratch.shape[0]):
                scratch[r, tid] += scratch[r, tid + stride]
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:block_sums]


# --8<-- [start:block_max]
@cuda.jit(device=True)
def block_max(scratch):
    """scratch[0] = max(scratch[:TPB]) (-inf entries are fine)."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            scratch[tid] = max(scratch[tid], scratch[tid + stride])
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:block_max]


# --8<-- [start:segment_reductions]
@cuda.jit(device=True)
def segment_max(scratch, segment):
    """scratch[s] = max(scratch[s:s + segment]) for every segment start s = 0, segment, 2 segment,
    ... of the block: ``block_max``'s tree run inside each segment of ``segment`` threads (a power
    of two dividing TPB), one barrier of the whole block per level. segment = TPB is block_max."""
    tid = cuda.threadIdx.x
    lane = tid % segment                          # this thread's place in its segment
    cuda.syncthreads()
    stride = segment // 2
    while stride > 0:
        if lane < stride:
            scratch[tid] = max(scratch[tid], scratch[tid + stride])
        cuda.syncthreads()
        stride //= 2


@cuda.jit(device=True)
def segment_sum(scratch, segment):
    """scratch[s] = sum(scratch[s:s + segment]) for every segment start s: ``block_sum``'s tree
    (the same pairs, the same order) inside each segment. segment = TPB is block_sum."""
    tid = cuda.threadIdx.x
    lane = tid % segment
    cuda.syncthreads()
    stride = segment // 2
    while stride > 0:
        if lane < stride:
            scratch[tid] += scratch[tid + stride]
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:segment_reductions]


# --8<-- [start:comes_first]
@cuda.jit(device=True)
def comes_first(value, index, other_value, other_index):
    """True when (value, index) comes before (other_value, other_index) in np.argmax's order:
    NaN beats any number, a larger value beats a smaller one, equals go to the lower index.
    An index of -1 is "no entry": it comes after everything."""
    if index < 0:
        return False
    if other_index < 0:
        return True
    if math.isnan(value):
        return not math.isnan(other_value) or index < other_index
    if math.isnan(other_value):
        return False
    return value > other_value or (value == other_value and index < other_index)
# --8<-- [end:comes_first]


# --8<-- [start:block_argmax]
@cuda.jit(device=True)
def block_argmax(values, indices):
    """(values[0], indices[0]) = the pair of (values[:TPB], indices[:TPB]) that ``comes_first``;
    indices[0] = -1 when every slot is empty. The order is total, so the winner does not depend on
    how the tree pairs the slots up."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride and comes_first(values[tid + stride], indices[tid + stride],
                                        values[tid], indices[tid]):
            values[tid] = values[tid + stride]
            indices[tid] = indices[tid + stride]
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:block_argmax]
