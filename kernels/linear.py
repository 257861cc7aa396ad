"""Linear layers, embedding gather and greedy argmax: the numba.cuda twin of ``ddtree/linear.py``.

Legend: T rows, Din input features, Dout output features, V vocab_size, D hidden_size,
TPB threads per block. Weights are stored (Dout, Din) as in Hugging Face state dicts, so
``y = x @ W.T``.

``linear`` has six kernel versions; ``version=None`` picks by the number of rows:
    version "gemm": tiled shared-memory GEMM, 16 x 16 output tiles, one thread per output (T > 4)
    version "gemv": one block per output y[t, n], a block reduction over Din (T <= 4: decode steps)
    version "rows": one block per output column n for every row, the GEMV's reduction per row;
                    batch-invariant
    version "tiles": one lane per output column, 32 columns per block, rows in registers, Din
                    cut into fixed slices summed in order; batch-invariant and far fewer blocks
                    (what the engine runs by default: never picked by ``version=None``)
    version "tiles_gemm": a register-tiled GEMM that adds every output's terms in "tiles"' order:
                    the same bits as "tiles", 4 to 16 times fewer weight reads for many rows
                    (the engine's projections from ``kernels.model.GEMM_FROM_ROWS`` rows on)
    version "warps": one warp per output column, lanes striding Din with their loads unrolled,
                    rows in registers; batch-invariant, built to stream W near copy bandwidth
                    (an engine option: on the H200 it ran the AR step faster and tree rows
                    slower than "tiles", profile-h200-2026-12-01e.md)
    version "stream": "tiles"' sums bit for bit, one thread per (output column, Din slice)
                    reading its W row straight from global memory, no shared-memory staging
Bytes: W (Dout * Din floats) dominates at decode sizes. The GEMM loads each W tile once per
16-row strip of x and reuses every loaded element 16 times from shared memory, which pays off
when many rows share W; with T <= 4 most of its 16 x 16 threads would compute padding rows, so
the GEMV instead puts a whole block on each dot product and streams every W row once (the T
blocks sharing a row run back to back, so the rows after the first find it in L2). The switch
between them changes the order of each sum with T, so a row's result depends on how many rows
run with it. "rows" sums every y[t, n] exactly as "gemv" does (bit for bit) whatever T is: the
engine's tree rows then equal its AR rows.

"rows" pays for that with one block per output column and a log2(TPB)-step tree per output: on
the H200, a tiny model's expert and projection kernels spent their time scheduling tens of
thousands of small blocks, and a 40-row verify cost 1.6 AR steps. "tiles" keeps the invariance
with fewer, fuller blocks: a warp's 32 lanes own 32 output columns, and each lane sums its column
sequentially along a slice of Din for ROWS_PER_PASS rows at once (the W tile is staged through
shared memory so that the loads stay coalesced, and every staged weight serves all the rows);
the block's warps take Din's slices 0, S, 2S, ... / 1, S + 1, ... and their S partial sums are
added in slice order. S depends on Din only (``k_slices``), never on T.

"tiles" still reads W once per pass of 8 rows, and its inner loop reads shared memory once per
multiply-add (the x value; each weight serves 8): on the H200 its 64-row 7168 -> 2048 projection
ran at 0.22x torch's SGEMM. "tiles_gemm" computes the same sums as a register-tiled GEMM. Its
order is "tiles"': slice s of Din (chunks s, s + S, ...) is summed from zero, k in order, into
P_s, and y = P_0 + P_1 + ... + P_{S-1}. Within that order it is free to tile: a block owns a tile
of rows x columns of y (32 x 32 or 128 x 128, ``GemmTiles``), each thread a 4 x 4 or 8 x 8
sub-tile in registers, so every staged weight serves a whole tile of rows and every fragment read
(one float4) feeds 4 or 8 multiply-adds; the next step's tiles are loaded into registers while
the current step's sums run. Its thread groups sum several slices at once (32 x 32 tiles: all 4,
so a 64-row projection still fills the GPU) and add them into y in slice order; with one group
per block (128 x 128 tiles) one launch per slice continues the sum in y. The tile shape depends
on the result's size, never the order, so the bits are "tiles"' at any T (on the GPU both compile
``acc += x * w`` to the same fused multiply-add).

"stream" computes exactly those sums (the same terms, the same order, the same ``acc += x * w``
multiply-adds, the S partials added in slice order: bit-identical to "tiles") with the W tile's
detour through shared memory taken out. A thread owns one (column n, slice s) chain and reads its
own W row's 32 consecutive floats of each chunk straight into registers, all the loads issued
before the first add; its rows' sums stay in registers, and only the S partials meet in shared
memory, once per pass. In "tiles" each lane stores its 32 loaded weights of a 32 x 32 tile to
shared memory and reads 32 back, between two block-wide barriers: no warp issues the next tile's
loads before the whole block has added the current one. "stream" has no barrier and no shared
traffic inside the sum, so its warps run independently and more of W is in flight. The price: a
warp's load touches 32 rows of W instead of one, and the next loads of those rows must find them in
L1. On the H200 (one decode row) that made it faster than "tiles" where Dout is small and slower
where it is large (``STREAM_MAX_OUTPUTS``): the engine runs whichever is faster for the shape
(``kernels.model.projection_version``), and since both give the same bits, the choice is free. Launch bounds
(``STREAM_RESIDENT``) let ptxas spend the registers to issue a batch's loads before the first
multiply-add; without them it kept 56 registers and issued about half. Its variants
(``STREAM_VARIANTS``: threads per block, loads in flight, launch bounds, whether neighbouring
threads take neighbouring columns or slices) trade L1 reuse, registers and the spread of a small
Dout's S * Dout chains over the SMs; none changes a bit.

``embed`` gathers table rows, one thread per output element. ``argmax`` runs one block per row
and reduces (value, index) pairs with ``kernels.blocks.block_argmax`` in numpy's order: the
first maximal index wins, and NaN counts as larger than everything (np.argmax returns the first
NaN).

Kernels whose shared arrays depend on TPB are built per block size and cached
(``gemv_kernel(TPB)``, ``argmax_kernel(TPB)``, ``tiles_gemm_kernel(tiles)``): a shared array
needs a size known when the kernel compiles. ``bytes_moved`` and ``flops`` give each operation's cost model.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from ddtree import linear as reference
from kernels.blocks import (
    MAX_TPB,
    block_argmax,
    block_sum,
    block_sums,
    blocks,
    check_threads,
    comes_first,
    pow2_threads,
)
from kernels.device import (
    SIMULATOR,
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

TILE = 16           # GEMM: a block computes a TILE x TILE tile of y with TILE x TILE threads
TILE_PADDED = 17    # TILE + 1 columns for the W tile (a shared array's shape must be a literal)
TPB = 128           # embed's threads per block (the GEMV and argmax size theirs from the work)
GEMV_MAX_ROWS = 4   # version=None uses GEMV up to this many rows, the tiled GEMM above
# argmax: the most threads its one block per row takes by default (one row of small's 32000 logits
# took 66 µs with 128 threads and 15 with 1024 on the H200, a graph of 10 launches; the simulator's
# threads are Python threads)
ARGMAX_MAX_THREADS = MAX_TPB if SIMULATOR else 1024
ARGMAX_BATCH = 8    # argmax: the logits a thread loads before it compares them
VERSIONS = ("gemm", "gemv", "rows", "tiles", "tiles_gemm", "warps", "stream", "lanes")
ROWS_PER_PASS = 8   # "rows": rows whose partial sums a thread keeps in registers at once
# "rows": output columns per block: one on a GPU (parallelism); several in the simulator, where
# every block costs Python threads. Each output's sum is the same either way.
COLUMNS_PER_BLOCK = 8 if SIMULATOR else 1


LANES = 32          # "tiles": output columns per block (one per lane) and Din per staged chunk
MAX_SLICES = 4      # "tiles": warps per block, each summing every S-th chunk of Din
LANES_PADDED = 33   # "tiles": a W tile row, one float longer than LANES (no bank conflicts)


# "warps": columns (one warp each) per block; each column's sums are the same at any count, so
# the simulator, where every thread is a Python thread, runs one
WARPS_PER_BLOCK = 1 if SIMULATOR else 4
UNROLL = 4          # "warps": W loads a lane issues before it adds them (in order)
# "lanes": "warps"' sums; its launch shapes (warps per block, C columns per warp, U loads of each
# column in flight per lane) change no bit, so ``lanes_shape`` picks the fastest measured one. The
# simulator runs one warp per block (each thread is a Python thread).
LANES_SIMULATED = (1, 8, 2)
LANES_WIDE_OUTPUTS = 8192    # Dout from which a row's many columns take more C per warp (an lm_head)

# "tiles_gemm": the register-tiled GEMM that sums exactly as "tiles" (tiles_gemm_kernel, GemmTiles)
GEMM_PAD = 4        # floats after each staged k-row of a tile: rows stay 16-byte aligned (float4 reads)
GEMM_ALIGN = None if SIMULATOR else 16   # the staged tiles' alignment (the simulator takes none)
GEMM_SHARED_BYTES = 48 * 1024            # numba's cap on a block's static shared memory
GEMM_WIDE_BLOCKS = 264   # GEMM_WIDE only where its tiles fill 2 blocks on each of the H200's 132 SMs

# "stream": threads per block (S per column); few in the simulator, where each is a Python thread
# (64 on a GPU, with 64 loads and 64 resident: of the variants timed on the H200 the fastest or
# within 2% of it at 7168 -> 2048 and 2048 -> 1408; at 256 -> 512, 32 threads were faster, 3.8
# against 4.7 µs; linear-versions-h200-2026-12-01.txt)
STREAM_THREADS = 32 if SIMULATOR else 64
STREAM_LOADS = 64   # "stream": W loads a thread issues before it adds them (in order)
STREAM_ADJACENT_CHOICES = ("columns", "slices")   # "stream": what neighbouring threads differ in
STREAM_ADJACENT = "columns"
STREAM_RESIDENT = 64   # "stream": threads per SM the launch bounds leave registers for (64: up to 255 each)
# "stream" is faster than "tiles" where Dout is small enough that its S * Dout chains, 64 threads a
# block, leave each SM a block or two; with many blocks per SM, each touching 32 rows of W at once,
# L1 no longer holds them (timings: ``kernels.model.projection_version``)
STREAM_MAX_OUTPUTS = 2048


def k_slices(depth: int) -> int:
    """"tiles": the warps (S) that split a sum over ``depth`` (Din) terms; a function of Din only,
    so a row's sums never depend on T. One in the simulator's small shapes would skip the slice
    merge, so it uses up to two."""
    return max(1, min(2 if SIMULATOR else MAX_SLICES, -(-depth // LANES)))


def row_passes(rows: int, per_pass: int = ROWS_PER_PASS) -> int:
    """Blocks along the rows for the "rows" kernels: one per pass of ``per_pass`` rows on a GPU
    (a tree verify then takes about as long as a decode step); one in the simulator."""
    return 1 if SIMULATOR else blocks(rows, per_pass)


def pass_rows(rows: int) -> int:
    """The rows of a pass ("lanes", MoE version 3) for a launch over T = ``rows`` rows: one for a
    decode row, whose kernel then keeps one row's sums in registers instead of ROWS_PER_PASS'
    (fewer registers, more warps per SM), else ROWS_PER_PASS. Each row's sums are the same."""
    return 1 if rows == 1 else ROWS_PER_PASS
F32, I64 = 4, 8


# --8<-- [start:gemm_tiled_kernel]
@cuda.jit
def gemm_tiled_kernel(x, weight, out):
    # one thread = one output y[t, n]; one block = a TILE x TILE tile of y (T, Dout)
    # shared memory, per step along Din: x_tile = x[rows of the tile, k0:k0+TILE] and
    # w_tile = W[columns of the tile, k0:k0+TILE]; each loaded element is then used TILE times
    x_tile = cuda.shared.array((TILE, TILE), float32)
    w_tile = cuda.shared.array((TILE, TILE_PADDED), float32)   # +1: column reads hit distinct banks
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    rows, depth = x.shape
    outputs = weight.shape[0]
    t = cuda.blockIdx.y * TILE + ty          # the output row this thread computes
    n = cuda.blockIdx.x * TILE + tx          # the output column this thread computes
    n_load = cuda.blockIdx.x * TILE + ty     # the W row this thread loads (coalesced along Din)

    acc = float32(0.0)
    for k0 in range(0, depth, TILE):
        k = k0 + tx
        if t < rows and k < depth:           # zeros outside x and W add nothing
            x_tile[ty, tx] = x[t, k]
        else:
            x_tile[ty, tx] = float32(0.0)
        if n_load < outputs and k < depth:
            w_tile[ty, tx] = weight[n_load, k]
        else:
            w_tile[ty, tx] = float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += x_tile[ty, kk] * w_tile[tx, kk]
        cuda.syncthreads()                   # before the next step overwrites the tiles
    if t < rows and n < outputs:
        out[t, n] = acc
# --8<-- [end:gemm_tiled_kernel]


# --8<-- [start:gemv_kernel]
@functools.cache
def gemv_kernel(threads: int):
    """The GEMV kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(x, weight, out):
        # one block = one output y[t, n]; one thread = k = tid, tid + TPB, ... of the dot product
        # (coalesced reads of the W row); shared memory: TPB float32 partial sums, block_sum
        partial = cuda.shared.array(threads, float32)
        rows, depth = x.shape
        n = cuda.blockIdx.x // rows          # blocks of the same W row are adjacent: W is read
        t = cuda.blockIdx.x % rows           # from memory once, the other rows hit the L2 cache
        tid = cuda.threadIdx.x

        acc = float32(0.0)
        for k in range(tid, depth, threads):
            acc += x[t, k] * weight[n, k]
        partial[tid] = acc
        block_sum(partial)
        if tid == 0:
            out[t, n] = partial[0]

    return kernel
# --8<-- [end:gemv_kernel]


# --8<-- [start:rows_kernel]
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
# --8<-- [end:rows_kernel]


# --8<-- [start:tile_dots]
@functools.cache
def tile_dots(rows: int, listed: bool = False, sliced: bool = False):
    """The device function of "tiles" for ``rows`` rows per pass (a literal: the sums live in
    registers). ``listed``: the pass's rows are x[row_ids[r]] (any rows, e.g. the tokens one
    expert serves: ``kernels.moe``) instead of x[t0 + r]; each row's sums are the same.
    ``sliced``: the function takes a depth range d0, d1 after n0 and sums x[., d0:d1] .
    weight[., d0:d1] only (``kernels.moe``'s router logits in depth slices); without it the range
    is all of Din. (Indices into the whole arrays, not views: a view's strides cost the kernel
    some 70 registers.)"""

    @cuda.jit(device=True)
    def dots_range(x, t0, count, row_ids, weight, n0, d0, d1, acc, w_tile, x_tile, partial):
        """acc[r] = weight[n0 + lane, d0:d1] . x[t0 + r, d0:d1] (or x[row_ids[r]]) for r < count,
        in lane's thread of slice 0.

        Thread (slice s, lane) sums chunks s, s + S, ... of the range, each sequentially in k,
        for every row at once; then slice 0 adds the S partial sums in slice order."""
        lane = cuda.threadIdx.x % LANES
        part = cuda.threadIdx.x // LANES
        parts = cuda.blockDim.x // LANES
        depth, outputs = d1 - d0, weight.shape[0]
        last_row = t0 + count - 1
        staged = cuda.local.array(LANES, float32)
        for r in range(rows):
            acc[r] = float32(0.0)
        for c0 in range(0, -(-depth // LANES), parts):       # the same trip count in every warp
            k0 = (c0 + part) * LANES
            width = min(LANES, depth - k0)                   # <= 0: this warp has no chunk left
            if lane < width:                                 # stage: lane = k, coalesced rows
                # all loads first, into registers, then all stores: the loads overlap instead of
                # waiting one by one (rows past the end re-read the last one, never used)
                for i in range(LANES):
                    staged[i] = weight[min(n0 + i, outputs - 1), d0 + k0 + lane]
                for i in range(LANES):
                    w_tile[part, i, lane] = staged[i]
                for r in range(rows):
                    row = row_ids[min(r, count - 1)] if listed else min(t0 + r, last_row)
                    staged[r] = x[row, d0 + k0 + lane]
                for r in range(rows):
                    x_tile[part, r, lane] = staged[r]
            cuda.syncthreads()
            if n0 + lane < outputs:
                for kk in range(width):
                    w = w_tile[part, lane, kk]
                    for r in range(rows):
                        acc[r] += x_tile[part, r, kk] * w
            cuda.syncthreads()
        for r in range(rows):
            partial[part, r, lane] = acc[r]
        cuda.syncthreads()
        if part == 0:
            for r in range(rows):
                total = partial[0, r, lane]
                for other in range(1, parts):
                    total += partial[other, r, lane]
                acc[r] = total
        cuda.syncthreads()                                   # tiles and partials are reused next

    @cuda.jit(device=True)
    def dots(x, t0, count, row_ids, weight, n0, acc, w_tile, x_tile, partial):
        """``dots_range`` over all of Din."""
        dots_range(x, t0, count, row_ids, weight, n0, 0, x.shape[1], acc, w_tile, x_tile, partial)

    return dots_range if sliced else dots


tile_dots_rows = tile_dots(ROWS_PER_PASS)                      # linear's: rows share each W tile
# --8<-- [end:tile_dots]


# --8<-- [start:tiles_kernel]
@cuda.jit
def tiles_kernel(x, weight, out):
    # one block = output columns n0 .. n0 + 31 (blockIdx.x; lane = column) for the passes of
    # ROWS_PER_PASS rows blockIdx.y, blockIdx.y + gridDim.y, ...; the block's S warps split Din
    # (tile_dots); shared memory: per warp a 32 x 33 W tile, the rows' 32-wide x chunk and the
    # partial sums
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    acc = cuda.local.array(ROWS_PER_PASS, float32)
    consecutive = cuda.local.array(1, int32)     # tile_dots' row list, unused: rows t0 .. t0 + count - 1
    lane = cuda.threadIdx.x % LANES
    n = cuda.blockIdx.x * LANES + lane
    for t0 in range(cuda.blockIdx.y * ROWS_PER_PASS, x.shape[0], cuda.gridDim.y * ROWS_PER_PASS):
        count = min(ROWS_PER_PASS, x.shape[0] - t0)
        tile_dots_rows(x, t0, count, consecutive, weight, cuda.blockIdx.x * LANES, acc, w_tile, x_tile,
                       partial)
        if cuda.threadIdx.x < LANES and n < weight.shape[0]:
            for r in range(ROWS_PER_PASS):
                if r < count:
                    out[t0 + r, n] = acc[r]
# --8<-- [end:tiles_kernel]


# --8<-- [start:tiles_gemm_kernel]
class GemmTiles(NamedTuple):
    """A launch shape of "tiles_gemm" (none of it changes a sum). A block computes a ``rows`` x
    ``cols`` tile of y with ``groups`` groups of threads, each group summing its own slice of Din;
    a group is (rows / thread_rows) x (cols / thread_cols) threads, each holding a thread_rows x
    thread_cols tile of y in registers. ``step``: Din staged at a time (a divisor of LANES)."""

    rows: int
    cols: int
    thread_rows: int
    thread_cols: int
    groups: int
    step: int

    @property
    def group_threads(self) -> int:
        return (self.rows // self.thread_rows) * (self.cols // self.thread_cols)

    @property
    def shared_bytes(self) -> int:
        # per group, two buffers (double-buffered) of ``step`` k-rows of the x and W tiles
        return F32 * self.groups * 2 * self.step * (self.rows + self.cols + 2 * GEMM_PAD)


# ptxas (sm_90) for the GPU's shapes: no spills; WIDE 128 registers and 33 KB of shared memory,
# NARROW 98 and 36 KB: two blocks of 256 threads per SM either way. The fastest of 12 shapes timed
# on the H200 at 64 and at 4096 rows (linear-versions-h200-2026-12-01.txt)
GEMM_WIDE = GemmTiles(128, 128, 8, 8, 1, 16)   # many rows: a slice per launch
GEMM_NARROW = GemmTiles(32, 32, 4, 4, 4, 16)   # few rows: 4 slices at once, so 64 rows fill the GPU
GEMM_SIMULATED = GemmTiles(8, 16, 4, 4, 2, 8)  # the simulator's: 16 threads per block


def check_gemm_tiles(tiles) -> None:
    """A GemmTiles the kernel can run: thread tiles of whole float4 fragments dividing the block's,
    a step of 8, 16 or 32 dividing a group's threads, whose load rows divide the tile's rows and
    columns (every staged element loaded once), at most 1024 threads and 48 KB of shared memory."""
    fits = isinstance(tiles, GemmTiles) and all(isinstance(v, int) and v > 0 for v in tiles)
    if fits:
        load_rows = tiles.group_threads // tiles.step
        fits = (tiles.thread_rows % 4 == 0 and tiles.thread_cols % 4 == 0
                and tiles.rows % tiles.thread_rows == 0 and tiles.cols % tiles.thread_cols == 0
                and tiles.step in (8, 16, 32) and tiles.group_threads % tiles.step == 0
                and tiles.rows % load_rows == 0 and tiles.cols % load_rows == 0
                and tiles.groups * tiles.group_threads <= 1024
                and tiles.shared_bytes <= GEMM_SHARED_BYTES)
    if not fits:
        raise ValueError("tiles must be a GemmTiles whose thread tiles are multiples of 4 dividing its "
                         "rows and cols, with step 8, 16 or 32 dividing a group's threads, at most 1024 "
                         f"threads and {GEMM_SHARED_BYTES} bytes of shared memory, got {tiles!r}")


@cuda.jit(device=True)
def non_negative(value):
    """``value`` (0 <= value < 2**32) as int64 by way of uint32: the compiler then knows it is not
    negative, and numba's negative-index wraparound and Python's floor-division sign fixups drop
    out of the index arithmetic built on it."""
    return int64(uint32(value))


def _as_is(value):
    return value


# an index the kernels may pass through ``non_negative`` on a GPU; the simulator, where that cast
# is a slow call, takes the value as it is (the same result either way)
index = _as_is if SIMULATOR else non_negative


@functools.cache
def tiles_gemm_kernel(tiles: GemmTiles):
    """The "tiles_gemm" kernel for one launch shape (shared and local array sizes are literals)."""
    check_gemm_tiles(tiles)
    tile_rows, tile_cols, thread_rows, thread_cols, most_groups, step = tiles
    down, across = tile_rows // thread_rows, tile_cols // thread_cols    # a group's threads
    group_threads = down * across
    load_rows = group_threads // step            # tile rows a group stages per load instruction
    x_loads, w_loads = tile_rows // load_rows, tile_cols // load_rows
    parts = LANES // step                        # steps per 32-wide chunk
    staged_rows = most_groups * 2 * step         # per group two buffers of ``step`` k-rows
    x_width, w_width = tile_rows + GEMM_PAD, tile_cols + GEMM_PAD

    @cuda.jit(device=True)
    def start(s, i, slices):
        """Where step i of slice s begins in Din: part i % parts of its chunk s + (i // parts) S."""
        return (s + i // parts * slices) * LANES + i % parts * step

    @cuda.jit(device=True)
    def load(matrix, first, k, loaded, staged, count, lr):
        """staged[p] = matrix[first + lr + p * load_rows, k] (a row past the end re-reads the last
        one, never used): a warp's loads are row segments along k, coalesced."""
        if loaded:
            last = matrix.shape[0] - 1
            for p in range(count):
                staged[p] = matrix[min(first + lr + p * load_rows, last), k]

    @cuda.jit(device=True)
    def store(tile, row, staged, count, lr):
        """The loaded elements into shared memory k-major: tile[k-row, tile row or column]."""
        for p in range(count):
            tile[row, lr + p * load_rows] = staged[p]

    @cuda.jit(device=True)
    def rank1(xs, ws, row, ty4, tx4, acc, xf, wf):
        """Every output's next term (k-row ``row`` of the staged tiles): acc[i, j] += x[i] * w[j].
        A thread's rows (columns) come in runs of 4, down * 4 (across * 4) apart, so its fragments
        are float4 reads and a warp reads consecutive float4s."""
        for i in range(thread_rows):
            xf[i] = xs[row, i // 4 * (down * 4) + ty4 + i % 4]
        for j in range(thread_cols):
            wf[j] = ws[row, j // 4 * (across * 4) + tx4 + j % 4]
        for i in range(thread_rows):
            for j in range(thread_cols):
                acc[i, j] += xf[i] * wf[j]

    @cuda.jit
    def kernel(x, weight, out, slices, first):
        # one block = the tile_rows x tile_cols tile of y at (blockIdx.y, blockIdx.x); its thread
        # group g sums slice s = first + g of Din: chunks s, s + S, ... as "tiles"' warp s, each
        # of the group's threads its thread_rows x thread_cols outputs in registers, k in order.
        # Shared memory, per group: the x and W tiles' `step` k-rows (k-major, two buffers; the
        # next step's loads wait in registers while this step's sums run). Then the groups add
        # their slices' sums into out in slice order (slice 0 writes its own): the launches for
        # first = 0, G, 2G, ... continue that order, so y = P_0 + P_1 + ... + P_{S-1} as in "tiles".
        xs = cuda.shared.array((staged_rows, x_width), float32, alignment=GEMM_ALIGN)
        ws = cuda.shared.array((staged_rows, w_width), float32, alignment=GEMM_ALIGN)
        acc = cuda.local.array((thread_rows, thread_cols), float32)
        xf = cuda.local.array(thread_rows, float32)
        wf = cuda.local.array(thread_cols, float32)
        x_next = cuda.local.array(x_loads, float32)
        w_next = cuda.local.array(w_loads, float32)
        tid = non_negative(cuda.threadIdx.x)
        group, member = tid // group_threads, tid % group_threads
        ty4, tx4 = member // across * 4, member % across * 4     # its first row and column in the tile
        kk, lr = member % step, member // step                   # what it stages: k and first row
        groups = non_negative(cuda.blockDim.x) // group_threads
        rows, depth = x.shape
        outputs = weight.shape[0]
        t0 = non_negative(cuda.blockIdx.y) * tile_rows
        n0 = non_negative(cuda.blockIdx.x) * tile_cols
        chunks = (depth + LANES - 1) // LANES
        steps = (chunks + slices - 1) // slices * parts          # slice 0's (the most): every group's
        s = first + group
        for i in range(thread_rows):
            for j in range(thread_cols):
                acc[i, j] = float32(0.0)
        k = start(s, 0, slices) + kk
        load(x, t0, k, s < slices and k < depth, x_next, x_loads, lr)
        load(weight, n0, k, s < slices and k < depth, w_next, w_loads, lr)
        for i in range(steps):
            at = non_negative(i)
            row = (group * 2 + at % 2) * step                    # this step's buffer
            store(xs, row + kk, x_next, x_loads, lr)
            store(ws, row + kk, w_next, w_loads, lr)
            cuda.syncthreads()
            if at + 1 < steps:
                k = start(s, at + 1, slices) + kk
                load(x, t0, k, s < slices and k < depth, x_next, x_loads, lr)
                load(weight, n0, k, s < slices and k < depth, w_next, w_loads, lr)
            width = min(step, depth - start(s, at, slices)) if s < slices else 0
            if width == step:                # 8 calls: numba leaves a loop over them rolled
                for k8 in range(step // 8):
                    r = row + non_negative(k8 * 8)
                    rank1(xs, ws, r, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 1, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 2, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 3, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 4, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 5, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 6, ty4, tx4, acc, xf, wf)
                    rank1(xs, ws, r + 7, ty4, tx4, acc, xf, wf)
            else:                            # the end of Din: `width` terms (none past it)
                for q in range(width):
                    rank1(xs, ws, row + non_negative(q), ty4, tx4, acc, xf, wf)
        for g in range(groups):              # slice order: group g adds slice first + g
            if g == group and s < slices:
                for i in range(thread_rows):
                    t = t0 + i // 4 * (down * 4) + ty4 + i % 4
                    for j in range(thread_cols):
                        n = n0 + j // 4 * (across * 4) + tx4 + j % 4
                        if t < rows and n < outputs:
                            out[t, n] = acc[i, j] if s == 0 else out[t, n] + acc[i, j]
            cuda.syncthreads()               # group g's sums are in out before group g + 1 reads them

    return kernel


def gemm_tiles(rows: int, outputs: int) -> GemmTiles:
    """"tiles_gemm"'s launch shape for a (rows, outputs) result: GEMM_WIDE where its tiles are full
    in rows and make GEMM_WIDE_BLOCKS blocks or more, else GEMM_NARROW; GEMM_SIMULATED in the
    simulator. Every shape gives the same bits."""
    if SIMULATOR:
        return GEMM_SIMULATED
    wide_blocks = blocks(rows, GEMM_WIDE.rows) * blocks(outputs, GEMM_WIDE.cols)
    return GEMM_WIDE if rows >= GEMM_WIDE.rows and wide_blocks >= GEMM_WIDE_BLOCKS else GEMM_NARROW


def launch_tiles_gemm(x, weight, out, stream=None, tiles: GemmTiles | None = None) -> None:
    """out = x @ weight.T by "tiles_gemm", device arrays x (T, Din), weight (Dout, Din), out
    (T, Dout): one launch per ``tiles.groups`` slices of Din, in slice order (``tiles``: None
    takes ``gemm_tiles``)."""
    rows, depth, outputs = x.shape[0], x.shape[1], weight.shape[0]
    tiles = tiles or gemm_tiles(rows, outputs)
    kernel = tiles_gemm_kernel(tiles)
    slices = k_slices(depth)
    groups = min(tiles.groups, slices)
    grid = (blocks(outputs, tiles.cols), blocks(rows, tiles.rows))      # x over Dout, y over T
    for first in range(0, slices, groups):
        kernel[grid, groups * tiles.group_threads, stream](x, weight, out, slices, first)
# --8<-- [end:tiles_gemm_kernel]


# --8<-- [start:warps_kernel]
@cuda.jit
def warps_kernel(x, weight, out):
    # one warp = output column n = blockIdx.x * WARPS_PER_BLOCK + warp, for the passes of
    # ROWS_PER_PASS rows blockIdx.y, blockIdx.y + gridDim.y, ...; lane l sums k = l, l + 32, ...
    # in order (a warp's W loads are one coalesced 128-byte row segment; UNROLL of them in flight
    # per lane), then lane r adds the 32 lanes' sums of row r in lane order, from lane 0's
    # (shared memory)
    partial = cuda.shared.array((WARPS_PER_BLOCK, ROWS_PER_PASS, LANES_PADDED), float32)
    acc = cuda.local.array(ROWS_PER_PASS, float32)
    w = cuda.local.array(UNROLL, float32)
    warp, lane = cuda.threadIdx.x // LANES, cuda.threadIdx.x % LANES
    n = cuda.blockIdx.x * WARPS_PER_BLOCK + warp
    depth = x.shape[1]
    step = LANES * UNROLL
    for t0 in range(cuda.blockIdx.y * ROWS_PER_PASS, x.shape[0], cuda.gridDim.y * ROWS_PER_PASS):
        count = min(ROWS_PER_PASS, x.shape[0] - t0)
        for r in range(ROWS_PER_PASS):
            acc[r] = float32(0.0)
        if n < weight.shape[0]:
            for k0 in range(lane, depth, step):
                for u in range(UNROLL):                  # the loads first ...
                    k = k0 + u * LANES
                    w[u] = weight[n, k] if k < depth else float32(0.0)
                for u in range(UNROLL):                  # ... then the sums, in k order
                    k = k0 + u * LANES
                    if k < depth:
                        for r in range(ROWS_PER_PASS):
                            if r < count:
                                acc[r] += x[t0 + r, k] * w[u]
        for r in range(ROWS_PER_PASS):
            partial[warp, r, lane] = acc[r]
        cuda.syncthreads()
        if lane < count and n < weight.shape[0]:
            total = partial[warp, lane, 0]
            for other in range(1, LANES):
                total += partial[warp, lane, other]
            out[t0 + lane, n] = total
        cuda.syncthreads()                               # partial is rewritten by the next pass
# --8<-- [end:warps_kernel]


# --8<-- [start:lane_dots]
@functools.cache
def lane_dots(rows: int, columns: int, unroll: int):
    """"warps"' dot products for passes of ``rows`` rows (a literal: the sums live in registers):
    acc[c, r] = this lane's share of weight[n0 + c] . x[row_ids[r]] for c < ``columns``, r < rows.
    Lane l sums k = l, l + 32, l + 64, ... in order, so a warp's loads of a W row are 128
    consecutive bytes; each lane has ``unroll`` loads of each of its ``columns`` rows in flight,
    and its x values of the same k, before the first add ("lanes" here, ``kernels.moe``'s version
    3). (With each x value loaded inside the add's guard, as in the first version, every add
    waited for its own x load: on the H200's PTX a load, then its FMA, one after another.)"""

    @cuda.jit(device=True)
    def dots(x, row_ids, weight, n0, acc, w):
        """(row_ids: ROWS_PER_PASS rows, the pass's last one repeated after its count.)"""
        xs = cuda.local.array((rows, unroll), float32)
        lane = index(cuda.threadIdx.x % LANES)
        depth, last = index(x.shape[1]), index(weight.shape[0] - 1)
        for c in range(columns):
            for r in range(rows):
                acc[c, r] = float32(0.0)
        for k_lane in range(lane, depth, LANES * unroll):
            for c in range(columns):                     # the loads first (a column past the end
                for u in range(unroll):                  # re-reads the last one, never written;
                    w[c, u] = weight[index(min(n0 + c, last)), index(min(k_lane + u * LANES, depth - 1))]
            for r in range(rows):                        # past Din: the last k again, never added)
                for u in range(unroll):
                    xs[r, u] = x[index(row_ids[r]), index(min(k_lane + u * LANES, depth - 1))]
            for u in range(unroll):                      # then the sums, k in order
                if k_lane + u * LANES < depth:
                    for r in range(rows):
                        for c in range(columns):
                            acc[c, r] += xs[r, u] * w[c, u]

    return dots
# --8<-- [end:lane_dots]


@functools.cache
def pass_dots(columns: int, unroll: int, per_pass: int = ROWS_PER_PASS):
    """``lane_dots`` for a pass of ``count`` of ``per_pass`` rows: one row alone skips the other
    rows' work (each row's sums are the same either way)."""
    dots_one, dots_pass = lane_dots(1, columns, unroll), lane_dots(per_pass, columns, unroll)

    @cuda.jit(device=True)
    def dots(x, row_ids, count, weight, n0, acc, w):
        if count == 1:
            dots_one(x, row_ids, weight, n0, acc, w)
        else:
            dots_pass(x, row_ids, weight, n0, acc, w)

    return dots


# --8<-- [start:lane_sums]
@functools.cache
def lane_sums(warps: int, columns: int, per_pass: int = ROWS_PER_PASS):
    """The device functions that finish "warps"' sums in blocks of ``warps`` warps, each with
    ``columns`` x R sums (R = ``per_pass`` rows; output o = c * R + r) spread over its lanes:
    ``share`` puts every lane's sums in shared memory, ``total`` adds one output's 32 lane sums in
    lane order, ``written`` says whether an output is a real one."""
    outputs = columns * per_pass

    @cuda.jit(device=True)
    def share(sums, acc):
        """Every lane's sums into sums[warp, c * R + r, lane], between two barriers (the block's
        readers of the last ones first)."""
        warp, lane = cuda.threadIdx.x // LANES, cuda.threadIdx.x % LANES
        cuda.syncthreads()
        for c in range(columns):
            for r in range(per_pass):
                sums[warp, c * per_pass + r, lane] = acc[c, r]
        cuda.syncthreads()

    @cuda.jit(device=True)
    def total(sums, output):
        """This warp's sum ``output``: its 32 lanes' sums added in lane order."""
        warp = cuda.threadIdx.x // LANES
        value = sums[warp, output, 0]
        for lane in range(1, LANES):
            value += sums[warp, output, lane]
        return value

    @cuda.jit(device=True)
    def written(n0, output, count, width):
        """Whether sum ``output`` = c * R + r is written: row r < count, column n0 + c < width."""
        return output < outputs and output % per_pass < count and n0 + output // per_pass < width

    return share, total, written
# --8<-- [end:lane_sums]


# --8<-- [start:lanes_kernel]
@functools.cache
def lanes_kernel(warps: int, columns: int, unroll: int, per_pass: int = ROWS_PER_PASS):
    """The "lanes" kernel for blocks of ``warps`` warps, ``columns`` output columns per warp,
    ``unroll`` W loads in flight per column and lane and passes of R = ``per_pass`` rows
    (literals: shared and local array sizes). None of them changes a sum: every output is added in
    "warps"' order."""
    outputs = columns * per_pass                         # a warp's (column, row) sums per pass
    per_lane = -(-outputs // LANES)                      # ... that each lane adds up
    dots = pass_dots(columns, unroll, per_pass)
    share, total, written = lane_sums(warps, columns, per_pass)

    @cuda.jit
    def kernel(x, weight, out, groups):
        # groups G (blockIdx.z = g): row t of group g is x[t G + g] and out[t G + g], its weight
        # rows g Dout .. (g + 1) Dout - 1 (one group: a linear; a head each: MLA's absorb_output).
        # One warp = C columns n0 + c (blockIdx.x: warps * C columns) for the passes of R rows
        # blockIdx.y, blockIdx.y + gridDim.y, ...; lane l = k = l, l + 32, ... of
        # every dot product (lane_dots); then lane c R + r adds column c's 32 lane sums of row r in
        # lane order (lane_sums)
        sums = cuda.shared.array((warps, outputs, LANES_PADDED), float32)
        acc = cuda.local.array((columns, per_pass), float32)
        w = cuda.local.array((columns, unroll), float32)
        rows = cuda.local.array(per_pass, int32)
        lane = cuda.threadIdx.x % LANES
        group = cuda.blockIdx.z
        width = out.shape[1]                             # Dout of each group
        n0 = (cuda.blockIdx.x * warps + cuda.threadIdx.x // LANES) * columns
        group_rows = x.shape[0] // groups
        for t0 in range(cuda.blockIdx.y * per_pass, group_rows, cuda.gridDim.y * per_pass):
            count = min(per_pass, group_rows - t0)
            for r in range(per_pass):                    # the pass's last row repeated after count
                rows[r] = (t0 + min(r, count - 1)) * groups + group
            dots(x, rows, count, weight, group * width + n0, acc, w)
            share(sums, acc)
            for i in range(per_lane):
                output = lane + i * LANES
                if written(n0, output, count, width):
                    out[rows[output % per_pass], n0 + output // per_pass] = total(sums, output)

    return kernel


def lanes_launch(x, weight, out, *, groups: int = 1, shape: tuple[int, int, int] | None = None,
                 stream=None) -> None:
    """out = x @ weight.T by "lanes", device arrays x (T G, Din), weight (G Dout, Din), out
    (T G, Dout): for each group g of ``groups``, rows t G + g times weight rows g Dout ... ``shape``
    (warps, columns, unroll): None takes ``lanes_shape``."""
    rows, outputs = x.shape[0] // groups, out.shape[1]
    warps, columns, unroll = shape or lanes_shape(rows, outputs)
    per_pass = pass_rows(rows)
    grid = (blocks(outputs, warps * columns), row_passes(rows, per_pass), groups)   # x over Dout, y over T
    lanes_kernel(warps, columns, unroll, per_pass)[grid, warps * LANES, stream](x, weight, out, groups)
# --8<-- [end:lanes_kernel]


# --8<-- [start:lanes_shape]
def lanes_shape(rows: int, outputs: int) -> tuple[int, int, int]:
    """"lanes"' launch shape (warps per block, C columns per warp, U loads in flight per column and
    lane) for T = ``rows`` rows and Dout = ``outputs``; the same bits whatever the shape. The
    fastest of those timed on the H200 at small's projections (lanes-h200-2026-12-02.txt; for one
    row, after x came to be loaded with W, decode-shapes-h200-2026-12-02.txt): few columns per
    warp and many loads while the rows are few (more warps, each with a long run of W in flight),
    more columns per warp as the rows grow (each x value loaded feeds C multiply-adds), and C = 8
    for a wide lm_head from a few rows on."""
    if SIMULATOR:
        return LANES_SIMULATED
    wide = outputs >= LANES_WIDE_OUTPUTS
    if rows == 1:
        return (4, 4, 4) if wide else (4, 2, 16)
    if rows < 16:
        return (4, 8, 2) if wide else (4, 2, 8)
    if rows < 48:
        return (4, 8, 2) if wide else (4, 4, 4)
    return (4, 8, 2)
# --8<-- [end:lanes_shape]


# --8<-- [start:stream_kernel]
@functools.cache
def stream_kernel(rows: int, threads: int = STREAM_THREADS, loads: int = STREAM_LOADS,
                  adjacent: str = STREAM_ADJACENT, resident: int | None = STREAM_RESIDENT,
                  max_l1: bool = False):
    """The "stream" kernel for passes of ``rows`` rows (a literal: the sums live in registers),
    blocks of ``threads // S * S`` threads, ``loads`` W loads in flight per thread (a divisor or a
    multiple of LANES) and ``adjacent`` threads taking adjacent "columns" or adjacent "slices".
    ``resident``: the threads per SM the compiler must leave registers for (launch bounds of
    resident // threads blocks; None: its own choice, which for sm_90 kept about 56 registers
    and issued only half of the loads before the first add); ``max_l1``: ask for the largest L1
    (the kernel needs little shared memory). None of them changes a bit of the result: every
    output is summed in "tiles"' order."""
    if not (isinstance(rows, int) and 1 <= rows <= ROWS_PER_PASS):
        raise ValueError(f"rows must be an int in [1, {ROWS_PER_PASS}], got {rows!r}")
    if not (isinstance(threads, int) and MAX_SLICES <= threads <= 1024):
        raise ValueError(f"threads must be an int in [{MAX_SLICES}, 1024], got {threads!r}")
    if not (isinstance(loads, int) and loads >= 1 and (LANES % loads == 0 or loads % LANES == 0)):
        raise ValueError(f"loads must divide {LANES} or be a multiple of it, got {loads!r}")
    if adjacent not in STREAM_ADJACENT_CHOICES:
        raise ValueError(f"adjacent must be one of {STREAM_ADJACENT_CHOICES}, got {adjacent!r}")
    if resident is not None and not (isinstance(resident, int) and 1 <= resident <= 2048):
        raise ValueError(f"resident must be None or an int in [1, 2048], got {resident!r}")
    slices_adjacent = adjacent == "slices"
    span = min(loads, LANES)              # a batch: `pieces` runs of `span` consecutive k, the runs
    pieces = max(1, loads // LANES)       # (whole chunks when pieces > 1) S chunks apart

    @cuda.jit(device=True)
    def add_batch(x, t0, last_row, weight, n, k1, step, acc, w):
        """acc[r] += x[t0 + r, k] * weight[n, k] in order over a whole batch's k: k1 + j * step + i
        for piece j < pieces, i < span (rows past last_row repeat it). No guards, and the views
        put every load at a constant offset from one address per piece."""
        for j in range(pieces):                  # all loads first, into registers: they overlap
            weights = weight[n, k1 + j * step:k1 + j * step + span]            # instead of waiting
            for i in range(span):                                              # one by one
                w[j * span + i] = weights[i]
        for r in range(rows):                    # then each row's sums, in k order
            total = acc[r]
            for j in range(pieces):
                xs = x[min(t0 + r, last_row), k1 + j * step:k1 + j * step + span]
                for i in range(span):
                    total += xs[i] * w[j * span + i]
            acc[r] = total

    @cuda.jit(device=True)
    def add_tail(x, t0, last_row, weight, n, k1, step, acc):
        """add_batch's sums for Din's last, partial batch: the same terms in the same order, one
        weight at a time (a plain loop: an unrolled, guarded copy would cost registers)."""
        depth = x.shape[1]
        for j in range(pieces):
            for k in range(k1 + j * step, min(k1 + j * step + span, depth)):
                w = weight[n, k]
                for r in range(rows):
                    acc[r] += x[min(t0 + r, last_row), k] * w

    options = {"shared_memory_carveout": "MaxL1" if max_l1 else None}
    if resident is not None and not SIMULATOR:      # (the simulator has no registers to bound)
        options["launch_bounds"] = (threads, max(1, resident // threads))

    @cuda.jit(**options)
    def kernel(x, weight, out):
        # one thread = output column n and slice s of Din ("tiles"' chunks s, s + S, ... of LANES
        # consecutive k), summed sequentially in k for the pass's rows at once; the block is
        # (columns, S) threads, or (S, columns) with adjacent slices, so blockDim holds
        # S = k_slices(Din); blockIdx.x = a group of columns, blockIdx.y = the passes
        # blockIdx.y, blockIdx.y + gridDim.y, ... of ``rows`` rows. W comes straight from global
        # memory, ``loads`` floats of the thread's row at a time; x by loads that the
        # column-adjacent threads share. Shared memory: every thread's partial sums, which slice
        # 0's thread adds in slice order.
        partial = cuda.shared.array((rows, threads), float32)
        acc = cuda.local.array(rows, float32)
        w = cuda.local.array(loads, float32)
        if slices_adjacent:
            s, c = cuda.threadIdx.x, cuda.threadIdx.y
            slices, columns = cuda.blockDim.x, cuda.blockDim.y
        else:
            c, s = cuda.threadIdx.x, cuda.threadIdx.y
            columns, slices = cuda.blockDim.x, cuda.blockDim.y
        tid = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        n = cuda.blockIdx.x * columns + c
        depth, outputs = x.shape[1], weight.shape[0]
        step = slices * LANES                                          # from a chunk to the slice's next
        for t0 in range(cuda.blockIdx.y * rows, x.shape[0], cuda.gridDim.y * rows):
            last_row = min(t0 + rows, x.shape[0]) - 1
            for r in range(rows):
                acc[r] = float32(0.0)
            if n < outputs:
                for k0 in range(s * LANES, depth, pieces * step):      # the slice's chunks, in order
                    for k1 in range(k0, min(k0 + LANES, depth), span):
                        if k1 + (pieces - 1) * step + span <= depth:
                            add_batch(x, t0, last_row, weight, n, k1, step, acc, w)
                        else:
                            add_tail(x, t0, last_row, weight, n, k1, step, acc)
            for r in range(rows):
                partial[r, tid] = acc[r]
            cuda.syncthreads()
            if s == 0 and n < outputs:
                for r in range(rows):                                  # (literal indices: acc stays
                    if t0 + r <= last_row:                             # in registers)
                        total = acc[r]                                 # slice 0's own partial
                        for other in range(1, slices):                 # (the tid of thread (c, other))
                            total += partial[r, c * slices + other if slices_adjacent else
                                             other * columns + c]
                        out[t0 + r, n] = total
            cuda.syncthreads()                                         # partial is rewritten next pass

    return kernel


def stream_launch(x, weight, out, *, threads: int = STREAM_THREADS, loads: int = STREAM_LOADS,
                  adjacent: str = STREAM_ADJACENT, resident: int | None = STREAM_RESIDENT,
                  max_l1: bool = False, stream=None):
    """out (T, Dout) = x (T, Din) @ weight.T, device arrays, by ``stream_kernel``: S = k_slices(Din)
    slices, ``threads // S`` columns per block, passes of min(T, ROWS_PER_PASS) rows (a last,
    partial pass repeats T's last row, never written)."""
    rows, depth = x.shape
    slices = k_slices(depth)
    columns = threads // slices
    block = (slices, columns) if adjacent == "slices" else (columns, slices)
    grid = (blocks(weight.shape[0], columns), row_passes(rows))
    kernel = stream_kernel(min(rows, ROWS_PER_PASS), threads, loads, adjacent, resident, max_l1)
    kernel[grid, block, stream](x, weight, out)
# --8<-- [end:stream_kernel]


# "stream": the variants offered for timing, as stream_launch's options besides the defaults
# (64 threads, 64 loads, adjacent columns, 64 resident). Fewer threads spread a small Dout's few
# chains over more SMs; more loads put more of W in flight per chain; a block alone on its SM
# (resident = threads) may take every register it wants.
STREAM_VARIANTS = (
    {}, {"threads": 32, "resident": 32}, {"threads": 128, "resident": 128},
    {"threads": 256, "loads": 32, "resident": 512}, {"adjacent": "slices"}, {"loads": 32},
    {"resident": None},
)


# --8<-- [start:pick_version]
def pick_version(rows: int) -> str:
    """The ``linear`` version for ``rows`` rows when none is forced: GEMV for a few rows, else GEMM."""
    return "gemv" if rows <= GEMV_MAX_ROWS else "gemm"
# --8<-- [end:pick_version]


def check_linear(x, weight, *, version=None, threads=None, out=None):
    """The reference's shape rules, then the launch's: version, block size, float32 on the device,
    ``out`` (..., Dout). Returns x and weight as numpy or device arrays."""
    x, weight = host_or_device(x, np.float32), host_or_device(weight, np.float32)
    reference.check_linear(x, weight)
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version must be None or one of {VERSIONS}, got {version!r}")
    if threads is not None:
        check_threads(threads)
    check_float32(x=x, weight=weight)
    check_out(out, (*x.shape[:-1], weight.shape[0]))
    return x, weight


# --8<-- [start:linear]
def linear(x, weight, *, version: str | None = None, threads: int | None = None, out=None, stream=None):
    """``x`` (T, Din) (or (..., Din)) times ``weight.T`` (Din, Dout) -> (T, Dout), float32.

    ``version``: None picks "gemv" for T <= 4 rows and "gemm" otherwise; "rows", "tiles",
    "tiles_gemm" and "stream" (both the bits of "tiles") and "warps" are the batch-invariant ones;
    ``threads`` is the GEMV / rows block size (default: the smallest power of two covering Din, at
    most 128; "tiles", "tiles_gemm", "warps" and "stream" size their own blocks). ``out`` receives
    the result; ``stream`` is where the kernel is launched (None: the default stream).
    numpy in -> numpy out; device arrays stay on the device.
    """
    x, weight = check_linear(x, weight, version=version, threads=threads, out=out)
    d_x = as_rows(to_device(x, np.float32), "x")                          # [T, Din]
    rows, depth, outputs = d_x.shape[0], d_x.shape[1], weight.shape[0]
    d_out = output(out, (*x.shape[:-1], outputs), stream=stream)          # [..., Dout] NaN until written
    if rows > 0 and outputs > 0:
        d_weight, d_y = to_device(weight, np.float32), as_rows(d_out, "out")   # [Dout, Din], [T, Dout]
        version = version or pick_version(rows)
        threads = threads or (reduction_threads(depth) if version == "rows" else pow2_threads(depth))
        if version == "tiles":                                            # x over Dout, y over T
            grid = (blocks(outputs, LANES), row_passes(rows))
            tiles_kernel[grid, LANES * k_slices(depth), stream](d_x, d_weight, d_y)
        elif version == "tiles_gemm":
            launch_tiles_gemm(d_x, d_weight, d_y, stream)
        elif version == "warps":                                          # x over Dout, y over T
            grid = (blocks(outputs, WARPS_PER_BLOCK), row_passes(rows))
            warps_kernel[grid, LANES * WARPS_PER_BLOCK, stream](d_x, d_weight, d_y)
        elif version == "stream":
            stream_launch(d_x, d_weight, d_y, stream=stream)
        elif version == "lanes":
            lanes_launch(d_x, d_weight, d_y, stream=stream)
        elif version == "gemm":
            grid = (blocks(outputs, TILE), blocks(rows, TILE))            # x over Dout, y over T
            gemm_tiled_kernel[grid, (TILE, TILE), stream](d_x, d_weight, d_y)
        elif version == "gemv":
            gemv_kernel(threads)[outputs * rows, threads, stream](d_x, d_weight, d_y)
        else:
            grid = (blocks(outputs, COLUMNS_PER_BLOCK), row_passes(rows))
            rows_kernel(threads)[grid, threads, stream](d_x, d_weight, d_y)
    return deliver(d_out, out, x, weight)
# --8<-- [end:linear]


# --8<-- [start:embed_kernel]
@cuda.jit
def embed_kernel(tokens, table, out, range_error):
    # one thread = one output element out[t, d] = table[tokens[t], d] (coalesced along D)
    # an id outside [0, V) is not read (that row stays as it was); thread d = 0 sets range_error[0]
    count, width = out.shape
    index = cuda.grid(1)
    if index >= count * width:
        return
    t = index // width
    d = index % width
    token = tokens[t]
    if token < 0 or token >= table.shape[0]:
        if d == 0:
            range_error[0] = 1
        return
    out[t, d] = table[token, d]
# --8<-- [end:embed_kernel]


def check_embed(tokens, table, *, out=None, range_error=None):
    """The reference's rules (numpy tokens in [0, V) too), then the launch's: float32 on the
    device, contiguous device tokens, ``out`` (..., D), ``range_error``."""
    tokens, table = host_or_device(tokens), host_or_device(table, np.float32)
    reference.check_embed(tokens, table)
    check_float32(table=table)
    if is_device_array(tokens) and tokens.ndim != 1 and not tokens.is_c_contiguous():
        raise ValueError("device tokens with more than one axis must be C-contiguous")
    check_out(out, (*tokens.shape, table.shape[1]))
    if range_error is not None and not (is_device_array(range_error) and range_error.shape == (1,)
                                        and range_error.dtype == np.int32):
        raise ValueError(f"range_error must be a device int32 array of shape (1,), got {range_error!r}")
    return tokens, table


# --8<-- [start:embed]
def embed(tokens, table, *, out=None, stream=None, range_error=None):
    """Rows of the embedding ``table`` (V, D) for ``tokens`` (T,) (any shape) -> (T, D).

    Ids outside [0, V) raise numpy's ValueError. Host tokens are checked before the launch;
    device tokens by the kernel, which raises a flag: by default a new one, read back after the
    launch (4 bytes and a synchronisation). Given ``range_error`` (a device int32 (1,) array, zero
    before the call), the kernel sets it to 1 instead and nothing is read back: with ``out`` too,
    nothing is allocated or copied, and the caller looks at the flag when it suits it.
    """
    tokens, table = check_embed(tokens, table, out=out, range_error=range_error)
    count, width = tokens.size, table.shape[1]
    d_out = output(out, (*tokens.shape, width), stream=stream)            # [..., D] NaN until written
    if count * width > 0:
        flag = cuda.to_device(np.zeros(1, np.int32)) if range_error is None else range_error
        embed_kernel[blocks(count * width, TPB), TPB, stream](
            to_device(tokens).reshape(count), to_device(table, np.float32), as_rows(d_out, "out"), flag)
        if range_error is None and is_device_array(tokens) and flag.copy_to_host()[0]:
            reference.check_embed(tokens.copy_to_host(), table)           # raises the reference's error
    return deliver(d_out, out, tokens, table)
# --8<-- [end:embed]


# --8<-- [start:argmax_kernel]
@functools.cache
def argmax_kernel(threads: int):
    """The argmax kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(logits, out):
        # one block = one row of logits (T, V); one thread scans v = tid, tid + TPB, ... keeping
        # its first (value, index) in np.argmax's order, its loads ARGMAX_BATCH at a time (in
        # flight together, not one wait per entry); shared memory: TPB values and TPB indices,
        # reduced by block_argmax
        values = cuda.shared.array(threads, float32)
        indices = cuda.shared.array(threads, int32)
        batch = cuda.local.array(ARGMAX_BATCH, float32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]

        best_value = float32(0.0)
        best_index = -1                      # nothing seen yet: comes after every entry
        for base in range(tid, vocab, threads * ARGMAX_BATCH):
            for b in range(ARGMAX_BATCH):    # past the row: its last entry again, never compared
                batch[b] = logits[row, min(base + b * threads, vocab - 1)]
            for b in range(ARGMAX_BATCH):
                v = base + b * threads
                if v < vocab and comes_first(batch[b], v, best_value, best_index):
                    best_value = batch[b]
                    best_index = v
        values[tid] = best_value
        indices[tid] = best_index
        block_argmax(values, indices)
        if tid == 0:
            out[row] = indices[0]

    return kernel
# --8<-- [end:argmax_kernel]


def check_argmax(logits, *, threads=None, out=None):
    """Rows of logits (T, V) or (..., V) with V in [1, int32 max], block size, float32 on the
    device, ``out`` (...,) int64. Returns logits as numpy or a device array."""
    logits = host_or_device(logits, np.float32)
    if logits.ndim < 2:
        raise ValueError(f"logits must have shape (T, V) or (..., V), got shape {logits.shape}")
    vocab = logits.shape[logits.ndim - 1]                         # (the simulator's shapes reject [-1])
    if vocab == 0:
        raise ValueError("attempt to get argmax of an empty sequence (V = 0)")
    if vocab > np.iinfo(np.int32).max:
        raise ValueError(f"V must fit in int32 (the kernel's indices), got {vocab}")
    if threads is not None:
        check_threads(threads)
    check_float32(logits=logits)
    check_out(out, logits.shape[:-1], np.int64)
    return logits


# --8<-- [start:argmax]
def argmax(logits, *, threads: int | None = None, out=None, stream=None):
    """Greedy token per row of ``logits`` (T, V) (or (..., V)) -> int64 (T,), numpy's tie order.

    The first maximal index wins; a row holding NaN returns its first NaN, as np.argmax does.
    """
    logits = check_argmax(logits, threads=threads, out=out)
    d_logits = as_rows(to_device(logits, np.float32), "logits")           # [T, V]
    rows, vocab = d_logits.shape
    d_out = output(out, logits.shape[:-1], np.int64, stream)              # [...] -1 until written
    if rows > 0:
        threads = threads or pow2_threads(vocab, ARGMAX_MAX_THREADS)
        argmax_kernel(threads)[rows, threads, stream](d_logits, d_out.reshape(rows))
    return deliver(d_out, out, logits)
# --8<-- [end:argmax]


def _linear_cost(*, T: int, Din: int, Dout: int) -> tuple[int, int]:
    # x (T, Din) and W (Dout, Din) read once, y (T, Dout) written once; a multiply-add per weight per row
    return F32 * (T * Din + Dout * Din + T * Dout), 2 * T * Din * Dout


def _embed_cost(*, T: int, D: int) -> tuple[int, int]:
    # the ids (int64) read once, T table rows read once and written once; no arithmetic
    return I64 * T + 2 * F32 * T * D, 0


def _argmax_cost(*, T: int, V: int) -> tuple[int, int]:
    # the logits read once, one id (int64) per row written; comparisons are not counted
    return F32 * T * V + I64 * T, 0


_COSTS = {"linear": _linear_cost, "embed": _embed_cost, "argmax": _argmax_cost}


def bytes_moved(operation: str = "linear", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once; float32 4 B, int64 8 B). Dimensions by the glossary: "linear" (T, Din, Dout),
    "embed" (T, D), "argmax" (T, V); e.g. ``bytes_moved("argmax", T=8, V=163840)``."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "linear", **dims: int) -> int:
    """Floating-point operations (a multiply-add counts 2), dimensions as in ``bytes_moved``."""
    return _COSTS[operation](**dims)[1]


def _linear_case(name: str, what: str, rows: int, depth: int, outputs: int, version: str):
    from kernels.bench import peers
    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    dims = {"T": rows, "Din": depth, "Dout": outputs}
    return Case(name, what, f"x ({rows}, {depth}) W ({outputs}, {depth})",
                setup=lambda seed: (uniform((rows, depth), seed),
                                    uniform((outputs, depth), seed + 1, 1 / math.sqrt(depth))),
                call=lambda inputs, **given: linear(*inputs, version=version, **given),
                bytes=bytes_moved("linear", **dims), flops=flops("linear", **dims), note=f"version={version}",
                peer=lambda inputs: peers.linear(*inputs))


def bench_cases(sizes):
    """This module's cases of ``python -m kernels.bench``: decode GEMVs (the lm_head also by
    "lanes", the engine's), a tree-rows GEMM, the batch-invariant versions ("tiles", "warps",
    "stream", "lanes") for a decode row and ("tiles", "warps", "tiles_gemm", "lanes") for tree
    rows, a prefill's GEMM ("gemm", "tiles" and "tiles_gemm"), argmax."""
    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    config = sizes.config
    hidden, rows, vocab = config.hidden_size, sizes.argmax_rows, config.vocab_size
    up_mb = config.intermediate_size * hidden * F32 / 1e6
    head_gb = vocab * hidden * F32 / 1e9
    return [
        _linear_case("linear_gemv_mlp_up", f"dense-MLP up projection, 1 decode row (W {up_mb:.0f} MB)",
                     1, hidden, config.intermediate_size, "gemv"),
        _linear_case("linear_gemv_lm_head", f"lm_head, 1 decode row (W {head_gb:.1f} GB)",
                     1, hidden, vocab, "gemv"),
        _linear_case("linear_lanes_lm_head", f"lm_head, 1 decode row, the engine's \"lanes\" "
                     f"(W {head_gb:.1f} GB)", 1, hidden, vocab, "lanes"),
        _linear_case("linear_gemm", f"{sizes.rows} tree rows through a {hidden} -> "
                     f"{config.moe_intermediate_size} projection (expert-sized)",
                     sizes.rows, hidden, config.moe_intermediate_size, "gemm"),
        *(_linear_case(f"linear_{version}_mlp_up", f"the up projection, 1 decode row, batch-invariant "
                       f"(W {up_mb:.0f} MB)", 1, hidden, config.intermediate_size, version)
          for version in ("tiles", "warps", "stream", "lanes")),
        *(_linear_case(f"linear_{version}_verify", f"{sizes.rows} tree rows, batch-invariant, "
                       f"{hidden} -> {config.moe_intermediate_size}", sizes.rows, hidden,
                       config.moe_intermediate_size, version)
          for version in ("tiles", "warps", "tiles_gemm", "lanes")),
        *(_linear_case(f"linear_{version}_prefill", f"{sizes.large_rows} prefill rows, {hidden} -> "
                       f"{config.moe_intermediate_size}", sizes.large_rows, hidden,
                       config.moe_intermediate_size, version)
          for version in ("gemm", "tiles", "tiles_gemm")),
        Case("argmax", f"greedy tokens of {rows} rows of logits", f"logits ({rows}, {vocab})",
             setup=lambda seed: (uniform((rows, vocab), seed),),
             call=lambda inputs, **given: argmax(*inputs, **given),
             bytes=bytes_moved("argmax", T=rows, V=vocab), flops=flops("argmax", T=rows, V=vocab)),
    ]
