"""Linear layers, embedding gather and greedy argmax: the numba.cuda twin of ``ddtree/linear.py``.

Legend: T rows, Din input features, Dout output features, V vocab_size, D hidden_size, TPB threads per block.
Weights are stored (Dout, Din) as in Hugging Face state dicts, so ``y = x @ W.T``.

``linear`` runs one of four kernels (``version``):
    "lanes" (the default, what the engine runs): a warp per C output columns; lane l sums
            k = l, l + 32, ... in order, with U loads of each column in flight, then one lane adds
            an output's 32 lane sums in lane order. The order depends on Din alone, so a row's
            result never depends on the rows launched with it (batch invariance)
    "warps" lanes' order in its plainest form, a warp per column: the same bits as "lanes"
    "gemv"  a block per output y[t, n], a block reduction over Din (chapter 0: a decode step)
    "gemm"  a tiled shared-memory GEMM, 16 x 16 output tiles, a thread per output (chapter 0:
            many rows)
"gemv" and "gemm" sum in different orders (chapter 0's lesson); "lanes"' launch shape
(``lanes_shape``) changes no bit. ``lanes_launch`` also serves MLA's absorb_output, and
``lane_dots`` / ``lane_sums`` the MoE's expert kernels. ``tile_dots`` is a second batch-invariant
order, the MoE router's: a lane per output column, S = ``k_slices(Din)`` warps (never a function of
T) over Din's 32-wide chunks, their sums added in slice order.

``embed`` gathers table rows, one thread per output element. ``argmax`` runs one block per row
and reduces (value, index) pairs in np.argmax's order (``kernels.blocks.block_argmax``).
Kernels whose shared or local arrays depend on a launch parameter are built per value and cached
(``gemv_kernel(TPB)``, ``lanes_kernel(warps, C, U, R)``, ``argmax_kernel(TPB)``): such an array
needs a size known when the kernel compiles.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from ddtree import linear as reference
from kernels.blocks import (
    MAX_TPB,
    block_argmax,
    block_sum,
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
    to_device,
)
from kernels.tuning import LANES_FEW_ROWS, LANES_ONE_ROW_SHAPE, LANES_SOME_ROWS, LANES_WIDE_OUTPUTS

VERSIONS = ("lanes", "warps", "gemv", "gemm")
TILE = 16           # GEMM: a block computes a TILE x TILE tile of y with TILE x TILE threads
TILE_PADDED = 17    # TILE + 1 columns for the W tile (a shared array's shape must be a literal)
TPB = 128           # embed's threads per block (the GEMV and argmax size theirs from the work)
# argmax: the most threads its one block per row takes by default (a long row wants many loads in
# flight; the simulator's threads are Python threads)
ARGMAX_MAX_THREADS = MAX_TPB if SIMULATOR else 1024
ARGMAX_BATCH = 8    # argmax: the logits a thread loads before it compares them
ROWS_PER_PASS = 8   # rows whose sums a thread keeps in registers at once
LANES = 32          # a warp's lanes: the stride along Din; tile_dots' columns per block and chunk width
MAX_SLICES = 4      # tile_dots: warps per block, each summing every S-th chunk of Din
LANES_PADDED = 33   # a shared row of LANES values, one float longer (no bank conflicts)
# "warps": columns (one warp each) per block; each column's sums are the same at any count, so
# the simulator, where every thread is a Python thread, runs one
WARPS_PER_BLOCK = 1 if SIMULATOR else 4
UNROLL = 4          # "warps": W loads a lane issues before it adds them (in order)
LANES_SIMULATED = (1, 8, 2)   # "lanes"' launch shape in the simulator: one warp per block


def row_passes(rows: int, per_pass: int = ROWS_PER_PASS) -> int:
    """Blocks along the rows for a kernel that walks passes of ``per_pass`` rows: one per pass on
    a GPU (a tree verify then takes about as long as a decode step); one in the simulator."""
    return 1 if SIMULATOR else blocks(rows, per_pass)


def pass_rows(rows: int) -> int:
    """The rows of a pass ("lanes", MLA's absorb_query, the MoE's expert lists) for a launch over
    T = ``rows`` rows: the smallest power of two >= T, at most ROWS_PER_PASS. A pass computes all
    its rows (those past T repeat the last one), so a pass no larger than the launch never computes
    a row for nothing, and holds fewer sums in registers (more warps per SM). Each row's sums are
    the same whatever the pass."""
    return min(ROWS_PER_PASS, 1 << max(rows - 1, 0).bit_length())


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


# --8<-- [start:warps_kernel]
@cuda.jit
def warps_kernel(x, weight, out):
    # one warp = output column n = blockIdx.x * WARPS_PER_BLOCK + warp, for the passes of ROWS_PER_PASS rows
    # blockIdx.y, blockIdx.y + gridDim.y, ...; lane l sums k = l, l + 32, ... in order (a warp's W loads are
    # one coalesced 128-byte row segment; UNROLL of them in flight per lane), then lane r adds the 32 lanes'
    # sums of row r in lane order, from lane 0's (shared memory)
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
    and its x values of the same k, before the first add ("lanes" here, the MoE's experts): an x
    value loaded under its add's own guard would make every add wait for its own load."""

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
    """``lane_dots`` for a pass of ``count`` of ``per_pass`` rows, sized to its count: 1, 2, 4 or
    ``per_pass`` rows, the fewest that hold it, so a pass of few rows (an expert two tokens chose,
    a launch's last pass) skips the other rows' work. Each row's sums are the same either way;
    the sums past the size are left as they were, and never written."""
    one, two, four = (lane_dots(min(size, per_pass), columns, unroll) for size in (1, 2, 4))
    full = lane_dots(per_pass, columns, unroll)

    @cuda.jit(device=True)
    def dots(x, row_ids, count, weight, n0, acc, w):
        if count == 1:
            one(x, row_ids, weight, n0, acc, w)
        elif count <= 2:
            two(x, row_ids, weight, n0, acc, w)
        elif count <= 4:
            four(x, row_ids, weight, n0, acc, w)
        else:
            full(x, row_ids, weight, n0, acc, w)

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
    """The "lanes" kernel for blocks of ``warps`` warps, ``columns`` output columns per warp, ``unroll`` W
    loads in flight per column and lane and passes of R = ``per_pass`` rows (literals: shared and local array
    sizes). None of them changes a sum: every output is added in "warps"' order."""
    outputs = columns * per_pass                         # a warp's (column, row) sums per pass
    per_lane = -(-outputs // LANES)                      # ... that each lane adds up
    dots = pass_dots(columns, unroll, per_pass)
    share, total, written = lane_sums(warps, columns, per_pass)

    @cuda.jit
    def kernel(x, weight, out, groups):
        # groups G (blockIdx.z = g): row t of group g is x[t G + g] and out[t G + g], its weight
        # rows g Dout .. (g + 1) Dout - 1 (one group: a linear; a head each: MLA's absorb_output).
        # One warp = C columns n0 + c (blockIdx.x: warps * C columns) for the passes of R rows
        # blockIdx.y, blockIdx.y + gridDim.y, ...; lane l = k = l, l + 32, ... of every dot product
        # (lane_dots); then lane c R + r adds column c's 32 lane sums of row r in lane order (lane_sums)
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
    lane) for T = ``rows`` rows and Dout = ``outputs``; the same bits whatever the shape. A decode
    row's shape up to a few rows (a small tree's verify streams its weights like a decode step),
    then more columns and fewer loads as the rows grow (each x value loaded feeds C multiply-adds),
    and C = 8 for a wide output (an lm_head). The thresholds: ``kernels.tuning``."""
    if SIMULATOR:
        return LANES_SIMULATED
    wide = outputs >= LANES_WIDE_OUTPUTS
    if rows <= LANES_ONE_ROW_SHAPE:
        return (4, 4, 4) if wide else (4, 2, 16)
    if rows < LANES_FEW_ROWS:
        return (4, 8, 2) if wide else (4, 2, 8)
    if rows < LANES_SOME_ROWS:
        return (4, 8, 2) if wide else (4, 4, 4)
    return (4, 8, 2)
# --8<-- [end:lanes_shape]


def k_slices(depth: int) -> int:
    """``tile_dots``: the warps (S) that split a sum over ``depth`` (Din) terms; a function of Din
    only, so a row's sums never depend on T. One in the simulator's small shapes would skip the
    slice merge, so it uses up to two."""
    return max(1, min(2 if SIMULATOR else MAX_SLICES, -(-depth // LANES)))


# --8<-- [start:tile_dots]
@functools.cache
def tile_dots(rows: int, listed: bool = False, sliced: bool = False):
    """The router's batch-invariant dot products (``kernels.moe``) for ``rows`` rows per pass (a
    literal: the sums live in registers). ``listed``: the pass's rows are x[row_ids[r]] (any rows,
    e.g. the tokens one expert serves) instead of x[t0 + r]; each row's sums are the same.
    ``sliced``: the function takes a depth range d0, d1 after n0 and sums x[., d0:d1] .
    weight[., d0:d1] only (the router's logits in depth slices); without it the range is all of
    Din. (Indices into the whole arrays, not views: a view's strides cost registers.)"""

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
            if n0 + lane < outputs and width == LANES:   # a whole chunk, a fixed trip count: its
                for kk in range(LANES):                    # loads issued together
                    w = w_tile[part, lane, kk]
                    for r in range(rows):
                        acc[r] += x_tile[part, r, kk] * w
            elif n0 + lane < outputs:
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
# --8<-- [end:tile_dots]


def check_linear(x, weight, *, version="lanes", threads=None, out=None):
    """The reference's shape rules, then the launch's: version, block size, float32 on the device,
    ``out`` (..., Dout). Returns x and weight as numpy or device arrays."""
    x, weight = host_or_device(x, np.float32), host_or_device(weight, np.float32)
    reference.check_linear(x, weight)
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if threads is not None:
        check_threads(threads)
    check_float32(x=x, weight=weight)
    check_out(out, (*x.shape[:-1], weight.shape[0]))
    return x, weight


# --8<-- [start:linear]
def linear(x, weight, *, version: str = "lanes", threads: int | None = None, out=None, stream=None):
    """``x`` (T, Din) (or (..., Din)) times ``weight.T`` (Din, Dout) -> (T, Dout), float32.

    ``version``: "lanes" (the default: the engine's kernel, launch shape and bits), "warps" (the same bits, a
    warp per column), "gemv" or "gemm" (the module's docstring says how each sums). ``threads``: the GEMV's
    block size (default: the smallest power of two covering Din, at most 128; the other versions size their
    own blocks). ``out`` receives the result; ``stream`` is where the kernel is launched
    (None: the default stream). numpy in -> numpy out; device arrays stay on the device.
    """
    x, weight = check_linear(x, weight, version=version, threads=threads, out=out)
    d_x = as_rows(to_device(x, np.float32), "x")                          # [T, Din]
    rows, depth, outputs = d_x.shape[0], d_x.shape[1], weight.shape[0]
    d_out = output(out, (*x.shape[:-1], outputs), stream=stream)          # [..., Dout] NaN until written
    if rows > 0 and outputs > 0:
        d_weight, d_y = to_device(weight, np.float32), as_rows(d_out, "out")   # [Dout, Din], [T, Dout]
        if version == "lanes":
            lanes_launch(d_x, d_weight, d_y, stream=stream)
        elif version == "warps":                                          # x over Dout, y over T
            grid = (blocks(outputs, WARPS_PER_BLOCK), row_passes(rows))
            warps_kernel[grid, LANES * WARPS_PER_BLOCK, stream](d_x, d_weight, d_y)
        elif version == "gemv":
            threads = threads or pow2_threads(depth)
            gemv_kernel(threads)[outputs * rows, threads, stream](d_x, d_weight, d_y)
        else:
            grid = (blocks(outputs, TILE), blocks(rows, TILE))            # x over Dout, y over T
            gemm_tiled_kernel[grid, (TILE, TILE), stream](d_x, d_weight, d_y)
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
        # one block = one row of logits (T, V); one thread scans v = tid, tid + TPB, ... keeping its first
        # (value, index) in np.argmax's order, its loads ARGMAX_BATCH at a time (in flight together, not one
        # wait per entry); shared memory: TPB values and TPB indices, reduced by block_argmax
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
