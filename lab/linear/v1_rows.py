"""Version "rows", the first batch-invariant linear: the GEMV's reduction (a block of TPB threads
per output column, thread partials strided along Din, then ``block_sums``' tree) walked over the
rows 8 at a time, so every y[t, n] has the bits of ``kernels.linear``'s "gemv" whatever T is
(``SAME_BITS`` against ``linear(version="gemv")``) and a tree row equals its AR row. It made
DDTree == AR exact in the engine (commit 8be9088), but it was slow: one block per output column
for every pass of 8 rows, each ending in a log2(TPB)-step tree, so a tiny model's projections spent
their time scheduling tens of thousands of small blocks, and a 40-row verify cost 1.6 AR steps of
device time on the H200. "tiles" (v2) replaced it with fewer, fuller blocks: 1.3 AR steps, tiny's
AR 1090 -> 1453 tok/s (commit 2c061a4; its records engine-h200-2026-11-30b and the profile).
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from kernels.blocks import block_sums, blocks
from kernels.device import SIMULATOR, reduction_threads
from kernels.linear import ROWS_PER_PASS, row_passes
from lab.harness import Case
from lab.linear import linear_cases, linear_contract

SHIPPED = "kernels.linear.linear"
TWIN = "ddtree.linear.linear"
SAME_BITS = True            # against linear(version="gemv"): every case passes version="gemv" to both
TOLERANCE = (1e-5, 1e-5)
# output columns per block: one on a GPU (parallelism); several in the simulator, where every block
# costs Python threads. Each output's sum is the same either way.
COLUMNS_PER_BLOCK = 8 if SIMULATOR else 1


@functools.cache
def rows_kernel(threads: int):
    """The batch-invariant linear for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(x, weight, out):
        # one block = output column(s) n (blockIdx.x) for the passes of ROWS_PER_PASS rows
        # blockIdx.y, blockIdx.y + gridDim.y, ...; one thread = k = tid, tid + TPB, ... of each dot
        # product (the W row stays in L1 while the block walks its rows); shared memory:
        # ROWS_PER_PASS x TPB float32 partial sums, one tree per row: thread partials in k order,
        # then block_sum's tree, as gemv_kernel. A row's sum never depends on the rows beside it,
        # nor on how the passes are spread over blocks.
        partial = cuda.shared.array((ROWS_PER_PASS, threads), float32)
        acc = cuda.local.array(ROWS_PER_PASS, float32)
        first = cuda.blockIdx.x * COLUMNS_PER_BLOCK
        for n in range(first, min(first + COLUMNS_PER_BLOCK, weight.shape[0])):
            for t0 in range(cuda.blockIdx.y * ROWS_PER_PASS, x.shape[0], cuda.gridDim.y * ROWS_PER_PASS):
                rows_pass(x, weight, out, n, t0, partial, acc)

    return kernel


@cuda.jit(device=True)
def rows_pass(x, weight, out, n, t0, partial, acc):
    """y[t0:t0 + ROWS_PER_PASS, n]: thread partials along Din, then one tree per row."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    rows = x.shape[0]
    for r in range(ROWS_PER_PASS):
        acc[r] = float32(0.0)
    for k in range(tid, x.shape[1], threads):
        w = weight[n, k]
        for r in range(min(ROWS_PER_PASS, rows - t0)):
            acc[r] += x[t0 + r, k] * w
    for r in range(ROWS_PER_PASS):
        partial[r, tid] = acc[r]
    block_sums(partial)                          # block_sum's tree, for ROWS_PER_PASS rows at once
    if tid < ROWS_PER_PASS and t0 + tid < rows:
        out[t0 + tid, n] = partial[tid, 0]
    cuda.syncthreads()                           # the partials are rewritten by the next pass


def run(x, weight, *, version: str = "gemv", threads: int | None = None, out=None, stream=None):
    """``kernels.linear.linear``'s contract by "rows" (``threads``: the block size, a power of two;
    default the smallest covering Din, at most 128). ``version`` names the shipped version whose
    bits these are ("gemv")."""
    if version != "gemv":
        raise ValueError(f'"rows" gives the bits of "gemv", not of {version!r}')

    def launch(d_x, d_weight, d_out, stream):
        block = threads or reduction_threads(d_x.shape[1])
        grid = (blocks(d_out.shape[1], COLUMNS_PER_BLOCK), row_passes(d_x.shape[0]))   # x over Dout, y over T
        rows_kernel(block)[grid, block, stream](d_x, d_weight, d_out)

    return linear_contract(x, weight, launch, out=out, stream=stream, version=version, threads=threads)


def cases() -> list[Case]:
    """Din not a multiple of the block (nor of 32), Din < one block, two passes of rows, NaN and inf."""
    return linear_cases(SHAPES, {"version": "gemv", "threads": 32})


SHAPES = {"decode_row": (1, 70, 5, 0), "few_rows": (3, 45, 2, 1), "short_din": (2, 9, 3, 2),
          "two_passes": (11, 45, 3, 3)}


