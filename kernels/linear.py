"""Linear layers, embedding gather and greedy argmax: the numba.cuda twin of ``ddtree/linear.py``.

Legend: T rows, Din input features, Dout output features, V vocab_size, D hidden_size,
TPB threads per block. Weights are stored (Dout, Din) as in Hugging Face state dicts, so
``y = x @ W.T``.

``linear`` has five kernel versions; ``version=None`` picks by the number of rows:
    version "gemm": tiled shared-memory GEMM, 16 x 16 output tiles, one thread per output (T > 4)
    version "gemv": one block per output y[t, n], a block reduction over Din (T <= 4: decode steps)
    version "rows": one block per output column n for every row, the GEMV's reduction per row;
                    batch-invariant
    version "tiles": one lane per output column, 32 columns per block, rows in registers, Din
                    cut into fixed slices summed in order; batch-invariant and far fewer blocks
                    (what the engine runs by default: never picked by ``version=None``)
    version "warps": one warp per output column, lanes striding Din with their loads unrolled,
                    rows in registers; batch-invariant, built to stream W near copy bandwidth
                    (an engine option: on the H200 it ran the AR step faster and tree rows
                    slower than "tiles", profile-h200-2026-12-01e.md)
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

``embed`` gathers table rows, one thread per output element. ``argmax`` runs one block per row
and reduces (value, index) pairs with ``kernels.blocks.block_argmax`` in numpy's order: the
first maximal index wins, and NaN counts as larger than everything (np.argmax returns the first
NaN).

Kernels whose shared arrays depend on TPB are built per block size and cached
(``gemv_kernel(TPB)``, ``argmax_kernel(TPB)``): a shared array needs a size known when the
kernel compiles. ``bytes_moved`` and ``flops`` give each operation's cost model.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from ddtree import linear as reference
from kernels.blocks import (
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
VERSIONS = ("gemm", "gemv", "rows", "tiles", "warps")
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


def k_slices(depth: int) -> int:
    """"tiles": the warps (S) that split a sum over ``depth`` (Din) terms; a function of Din only,
    so a row's sums never depend on T. One in the simulator's small shapes would skip the slice
    merge, so it uses up to two."""
    return max(1, min(2 if SIMULATOR else MAX_SLICES, -(-depth // LANES)))


def row_passes(rows: int) -> int:
    """Blocks along the rows for the "rows" kernels: one per pass of ROWS_PER_PASS rows on a GPU
    (a tree verify then takes about as long as a decode step); one in the simulator."""
    return 1 if SIMULATOR else blocks(rows, ROWS_PER_PASS)
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


# --8<-- [start:warps_kernel]
@cuda.jit
def warps_kernel(x, weight, out):
    # one warp = output column n = blockIdx.x * WARPS_PER_BLOCK + warp, for the passes of
    # ROWS_PER_PASS rows blockIdx.y, blockIdx.y + gridDim.y, ...; lane l sums k = l, l + 32, ...
    # in order (a warp's W loads are one coalesced 128-byte row segment; UNROLL of them in flight
    # per lane), then lane r adds the 32 lanes' sums of row r in lane order (shared memory)
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
            total = float32(0.0)
            for other in range(LANES):
                total += partial[warp, lane, other]
            out[t0 + lane, n] = total
        cuda.syncthreads()                               # partial is rewritten by the next pass
# --8<-- [end:warps_kernel]


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

    ``version``: None picks "gemv" for T <= 4 rows and "gemm" otherwise; "rows", "tiles" and
    "warps" are the batch-invariant ones; ``threads`` is the GEMV / rows block size (default: the smallest
    power of two covering Din, at most 128; "tiles" sizes its own blocks). ``out`` receives
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
        elif version == "warps":                                          # x over Dout, y over T
            grid = (blocks(outputs, WARPS_PER_BLOCK), row_passes(rows))
            warps_kernel[grid, LANES * WARPS_PER_BLOCK, stream](d_x, d_weight, d_y)
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
        # its first (value, index) in np.argmax's order; shared memory: TPB values and TPB
        # indices, reduced by block_argmax
        values = cuda.shared.array(threads, float32)
        indices = cuda.shared.array(threads, int32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x

        best_value = float32(0.0)
        best_index = -1                      # nothing seen yet: comes after every entry
        for v in range(tid, logits.shape[1], threads):
            if comes_first(logits[row, v], v, best_value, best_index):
                best_value = logits[row, v]
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
        threads = threads or pow2_threads(vocab)
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
    """This module's cases of ``python -m kernels.bench``: decode GEMVs, a tree-rows GEMM, the
    engine's batch-invariant versions ("tiles", "warps") for a decode row and for tree rows, a
    prefill's GEMM ("gemm" and "tiles"), argmax."""
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
        _linear_case("linear_gemm", f"{sizes.rows} tree rows through a {hidden} -> "
                     f"{config.moe_intermediate_size} projection (expert-sized)",
                     sizes.rows, hidden, config.moe_intermediate_size, "gemm"),
        *(_linear_case(f"linear_{version}_mlp_up", f"the up projection, 1 decode row, batch-invariant "
                       f"(W {up_mb:.0f} MB)", 1, hidden, config.intermediate_size, version)
          for version in ("tiles", "warps")),
        *(_linear_case(f"linear_{version}_verify", f"{sizes.rows} tree rows, batch-invariant, "
                       f"{hidden} -> {config.moe_intermediate_size}", sizes.rows, hidden,
                       config.moe_intermediate_size, version) for version in ("tiles", "warps")),
        *(_linear_case(f"linear_{version}_prefill", f"{sizes.large_rows} prefill rows, {hidden} -> "
                       f"{config.moe_intermediate_size}", sizes.large_rows, hidden,
                       config.moe_intermediate_size, version) for version in ("gemm", "tiles")),
        Case("argmax", f"greedy tokens of {rows} rows of logits", f"logits ({rows}, {vocab})",
             setup=lambda seed: (uniform((rows, vocab), seed),),
             call=lambda inputs, **given: argmax(*inputs, **given),
             bytes=bytes_moved("argmax", T=rows, V=vocab), flops=flops("argmax", T=rows, V=vocab)),
    ]
