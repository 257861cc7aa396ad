"""Version "tiles_gemm": a register-tiled GEMM that adds every output's terms in "tiles"' order (v2),
so it gives v2's bits at any T. Slice s of Din (chunks s, s + S, ...) is summed from zero, k in
order, into P_s, and y = P_0 + P_1 + ... + P_{S-1}; within that order it tiles freely: a block owns
a 32 x 32 or 128 x 128 tile of y (``GemmTiles``), each thread a 4 x 4 or 8 x 8 sub-tile in
registers, so every staged weight serves a whole tile of rows and every fragment read (one float4)
feeds 4 or 8 multiply-adds; the next step's tiles load into registers while the current step's sums
run. With 32 x 32 tiles a block's 4 thread groups sum the 4 slices at once and add them into y in
slice order; with 128 x 128 tiles one launch per slice continues the sum in y. An engine in "tiles"'
order ran it for forwards of 8 rows or more where W had 2^20 elements or more (commit f97fc93). On
the H200 its 64-row 7168 -> 2048 projection took 124 µs against v2's 309 and torch's 71, 4096
prefill rows 3587 against 16264 and 2354, 40 rows of 2048 -> 3072 60 against 83
(docs/results/linear-versions-h200-2026-12-01.txt at commit d604ab9, which also checked the bits
against v2 at every shape timed); at tiny's sizes it lost, a 40-row verify 780 µs with it against
723 without (docs/results/engine-linear-h200-2026-12-01.txt at commit f61189f). It left with
"tiles"' order when the engine took "lanes" (commit 6fe9e42), although at 72 rows small's lm_head
took 692 µs with it against "lanes"' 1076 (docs/results/lanes-h200-2026-12-02.txt at commit
6fe9e42): a register-tiled GEMM in "lanes"' order is the way left open for many rows. Its bits are
v2's, not "lanes"' (``SAME_BITS`` False; the tests compare it with v2).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from numba import cuda, float32

from kernels.blocks import blocks
from kernels.device import SIMULATOR
from kernels.linear import LANES, k_slices, non_negative
from kernels.tuning import sm_count
from lab.harness import Case
from lab.linear import linear_cases, linear_contract

SHIPPED = "kernels.linear.linear"
TWIN = "ddtree.linear.linear"
SAME_BITS = False           # "tiles"' order (v2), not "lanes"'
TOLERANCE = (1e-5, 1e-5)
F32 = 4
GEMM_PAD = 4        # floats after each staged k-row of a tile: rows stay 16-byte aligned (float4 reads)
GEMM_ALIGN = None if SIMULATOR else 16   # the staged tiles' alignment (the simulator takes none)
GEMM_SHARED_BYTES = 48 * 1024            # numba's cap on a block's static shared memory


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
# on the H200 at 64 and at 4096 rows (linear-versions-h200-2026-12-01.txt at commit d604ab9)
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
    in rows and fill two blocks on every SM, else GEMM_NARROW; GEMM_SIMULATED in the
    simulator. Every shape gives the same bits."""
    if SIMULATOR:
        return GEMM_SIMULATED
    wide_blocks = blocks(rows, GEMM_WIDE.rows) * blocks(outputs, GEMM_WIDE.cols)
    return GEMM_WIDE if rows >= GEMM_WIDE.rows and wide_blocks >= 2 * sm_count() else GEMM_NARROW


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


def run(x, weight, *, out=None, stream=None):
    """``kernels.linear.linear``'s contract by "tiles_gemm"."""
    return linear_contract(x, weight, launch_tiles_gemm, out=out, stream=stream)


def cases() -> list[Case]:
    """Din not a multiple of 32 (a partial last chunk) or below it, rows and columns over partial
    tiles of the simulator's 8 x 16 tiles, NaN and inf."""
    return linear_cases(SHAPES)


SHAPES = {"decode_row": (1, 70, 5, 0), "few_rows": (3, 45, 2, 1), "short_din": (2, 9, 3, 2),
          "partial_tiles": (11, 70, 19, 3)}


