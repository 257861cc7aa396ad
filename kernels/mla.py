"""Multi-head latent attention (MLA), absorbed form: the numba.cuda twin of ``ddtree/mla.py``.

Legend: T new rows, P fully visible prefix rows, S = P + T keys, H heads,
dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, R kv_lora_rank, TPB threads per block.

Kernels:
- ``absorb_query_kernel``: q_lat = W_UK^T q_nope, one thread per output element (t, h, r).
- ``attention_absorb_kernel``: masked softmax attention over the latent cache, one block per
  (row, head), online softmax over key tiles of one key per thread.
- ``attention_paths_kernel``: the engine's attention, version 1. Each row attends to the prefix
  and its own path (``paths``), enumerated in position order, in tiles at fixed positions staged
  through shared memory; the prefix length comes from a device array. A tree row's result is
  then bit-identical to the AR row at the same position (batch- and mask-invariant).
- ``attention_split_kernel`` + ``attention_merge_kernel``: version 2, the same tiles dealt
  round-robin to Z blocks per (row, head), whose partial softmaxes are merged in split order
  (Z fixed per engine: still bit-identical tree and AR rows; Z times the blocks per row).
- ``attention_heads_kernel`` (+ the merge): version 3, a block per (G heads, row, split), each
  tile staged once for its G heads (MLA's heads share the latent cache), a warp per head.
- ``attention_gemm_kernel`` (+ the merge): version 4, a block per (GH heads, row, split) computes
  a tile's scores and its weighted sum as two small register-tiled GEMMs (``gemm=True``).
- ``attention_scores_kernel``, ``attention_stats_kernel``, ``attention_values_kernel``,
  ``attention_tail_kernel`` (+ the merge): version 5, unfused (``unfused=True``): every row's
  scores as one GEMM, the softmax's statistics, P V as a second GEMM over the prefix's whole
  chunks of keys and a gathering kernel for the chunks that hold the tree's paths. A decode row's
  scores come from ``attention_row_scores_kernel`` instead: the GEMM's bits, a whole key tile
  staged at once.
- ``absorb_output``: o = W_UV o_lat, a linear per head: ``kernels.linear``'s "lanes" kernel with
  a group per head (a warp per few outputs (h, v), lane l summing r = l, l + 32, ...).

Only the absorbed form is implemented here, on purpose. The numpy module also has
``attention_naive``, which expands every cached latent into per-head keys and values
(S * H * (dn + dv) floats per layer); it is there to prove the absorption exact, and the model
runs it only with the numpy backend, so it has no kernel twin.

Inputs are numpy arrays (the results come back as numpy) or numba device arrays (the results
stay on the device). ``visible`` (T, T) is a small bool mask. A host mask is checked by
``ddtree.mla.check_visibility`` (the numpy reference's errors) and copied to the device; a
device mask is used as it is, except that with no prefix (P = 0) it is copied back to check
that every row sees a key (with P > 0 every row sees the prefix). ``bytes_moved`` and
``flops`` give each operation's cost model.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32  # the package __init__ has already chosen GPU or simulator

from ddtree import mla as reference
from kernels.blocks import (
    MAX_TPB,
    block_max,
    block_sum,
    blocks,
    check_threads,
    pow2_threads,
    row_threads,
    segment_max,
    segment_sum,
)
from kernels.device import (
    SIMULATOR,
    as_rows,
    check_float32,
    check_out,
    deliver,
    hardware_options,
    host_or_device,
    is_device_array,
    output,
    poisoned,
    to_device,
)
from kernels.linear import ROWS_PER_PASS, index, lanes_launch, pass_rows, row_passes

# attention_paths' threads on a GPU: 4x its 32-key tiles, so that one decode row's few blocks keep
# enough loads in flight (with 32 threads, each thread's serial loads left the H200 idle)
PATHS_THREADS = 128
STAGE_BATCH = 8         # attention_paths: cache loads a thread issues before it stores them
MAX_TILE = MAX_TPB       # largest attention block: keys per tile = TPB; the size of p and red
MAX_SPLITS = 64          # attention_paths version 2: most blocks sharing one (row, head)'s keys
SPLIT_TILES = 16         # ... chosen so that a split walks at most this many tiles of a full cache
LANES = 32               # attention_paths version 3: threads per head (a warp), keys per tile at most
DOT_PARTS = 32           # attention_paths: a key's score is summed in 32 strided parts, in parallel
DOT_STRIDE = DOT_PARTS + 1    # a key's parts in shared memory (+1: the parts' readers hit distinct banks)
SHARED_BUDGET = 44 * 1024     # attention_paths' dynamic shared memory: 48 KB less the static arrays
HEADS_PER_BLOCK = (1, 2, 4)   # version 3's G (1: versions 1 and 2), G * LANES <= MAX_TPB threads
# version 3's registers per thread: ptxas (sm_90) gives it 170 once it carries both ways of scoring,
# which leaves room for 2 blocks of 128 threads per SM's 64K registers (allocated 8 at a time:
# 176 x 128 each); 168 fits 3 and spills nothing (ptxas -v). Not yet timed on the H200.
HEADS_MAX_REGISTERS = 168
# attention_paths version 4 (gemm=True), register-tiled: see attention_gemm_kernel
GEMM_TILE = 32                # KT, keys per tile (the merge is told it)
GEMM_CHUNK = 192              # columns of R + dr staged per d-chunk (Kimi's 576 = 3 chunks)
GEMM_STRIDE = GEMM_CHUNK + 8  # a staged row in shared memory: 200 = 8 (mod 32 banks), conflict-free reads
GEMM_PARTS = 8                # a score is summed in 8 parts, columns d = p (mod 8), added in part order
GEMM_PART_PAD = 4             # floats between two parts' [GH, KT] slabs (their writers hit distinct banks)
GEMM_SCORE_HEADS = 4          # SH: heads of a thread's score tile (and of its output rows), at most
GEMM_SCORE_KEYS = 4           # SK: keys of a thread's score tile
GEMM_KEY_TILES = GEMM_TILE // GEMM_SCORE_KEYS          # 8
GEMM_LANES = GEMM_KEY_TILES * GEMM_PARTS               # 64 threads per group of SH heads
GEMM_COLUMNS = 8              # output columns a thread holds per head: lane + 64 j
GEMM_MAX_RANK = GEMM_LANES * GEMM_COLUMNS              # 512
GEMM_FROM_RANK = 512          # the engine takes version 4 from this R on (``paths_gemm``)
GEMM_SLOTS = 2 * GEMM_TILE                             # the tile's cache slots, double-buffered
GEMM_MAX_HEADS = 16           # GH at most (gemm_heads)
GEMM_STATS = 2 * GEMM_MAX_HEADS                        # each head's running max and rescale factor
GEMM_BATCH = 4                # _stage_chunk: loads a thread issues before it stores them
GEMM_OUTPUTS = GEMM_SCORE_HEADS * GEMM_COLUMNS         # a thread's output registers (32)
GEMM_SCORES = GEMM_SCORE_HEADS * GEMM_SCORE_KEYS       # a thread's score registers (16)
GEMM_HEADS = (16, 8, 4, 2, 1)  # GH candidates, largest first (gemm_heads), at most GEMM_MAX_HEADS
# attention_paths version 5, unfused (``unfused=True``): register-tiled GEMMs for the scores and for
# P V, with the softmax's statistics between them
UNFUSED_TILE = 8 if SIMULATOR else 64          # a block's tile: TILE query rows x TILE keys (or columns)
UNFUSED_THREAD = 2 if SIMULATOR else 4         # a thread's register tile: THREAD x THREAD outputs
UNFUSED_SIDE = UNFUSED_TILE // UNFUSED_THREAD  # threads along each side of the block's tile
UNFUSED_THREADS = UNFUSED_SIDE * UNFUSED_SIDE  # 16 in the simulator, 256 on a GPU
UNFUSED_REGISTERS = (UNFUSED_THREAD, UNFUSED_THREAD)
UNFUSED_STEP = 4 if SIMULATOR else 16          # k-rows of each operand staged at a time
UNFUSED_LOADS = UNFUSED_TILE * UNFUSED_STEP // UNFUSED_THREADS   # elements a thread stages per step
UNFUSED_LOAD_ROWS = UNFUSED_THREADS // UNFUSED_STEP   # k-major staging: tile rows between a thread's loads
UNFUSED_LOAD_KEYS = UNFUSED_THREADS // UNFUSED_TILE   # P V's values: keys between a thread's loads
UNFUSED_PAD = 4                                # floats after a staged k-row (rows stay 16-byte aligned)
UNFUSED_ALIGN = None if SIMULATOR else 16
UNFUSED_STAGED = (2 * UNFUSED_STEP, UNFUSED_TILE + UNFUSED_PAD)   # an operand's two staged buffers
# the scores' (query tile, key tile, a thread's queries, its keys, STEP) for many query rows, and for
# a decode row's few (``scores_shape``)
UNFUSED_WIDE = (UNFUSED_TILE, UNFUSED_TILE, UNFUSED_THREAD, UNFUSED_THREAD, UNFUSED_STEP)
UNFUSED_NARROW = (4, 8, 1, 2, 8) if SIMULATOR else (32, 64, 2, 4, 32)
ROW_KEYS = 4 if SIMULATOR else 16             # row_scores_kernel: keys per tile (all R + dr columns staged)
ROW_THREADS = 16 if SIMULATOR else 256        # ... threads per block: KT keys x THREADS / KT heads at once
# ... its grid at most (2 blocks on each of the H200's 132 SMs) and a score's loads issued before
# their adds: of the shapes timed on the H200 (decode-shapes-h200-2026-12-02.txt) the fastest or
# within 3% of it from 136 to 16k keys (at 4k, 264 blocks took 27% less time than 528; at 32k,
# 2.6% more)
ROW_BLOCKS = 264
ROW_UNROLL = 32
UNFUSED_CHUNK = 16 if SIMULATOR else 256       # keys per P V chunk: chunks at fixed positions, a partial each
UNFUSED_TAIL_BATCH = 4 if SIMULATOR else 16   # the tail kernel: cache loads a thread issues before its adds
# ... its (heads, output columns (a thread per column), BATCH) per block for one row, a few and many
# (``tail_shape``)
UNFUSED_TAIL_ONE = (1, 8, 2 * UNFUSED_TAIL_BATCH) if SIMULATOR else (1, 64, UNFUSED_TAIL_BATCH)
UNFUSED_TAIL_FEW = (2, 8 if SIMULATOR else 128, UNFUSED_TAIL_BATCH)
UNFUSED_TAIL_MANY = (4 if SIMULATOR else 8, 8 if SIMULATOR else 128, UNFUSED_TAIL_BATCH)
UNFUSED_TAIL_MANY_ROWS = 16                        # ... MANY from this many rows on
UNFUSED_STATS_THREADS = 32 if SIMULATOR else 512   # the statistics' most threads (a decode row's few blocks)
UNFUSED_STATS_FEW = 32 if SIMULATOR else 128       # ... and their threads where blocks are many
UNFUSED_STATS_MANY_BLOCKS = 528                    # 4 per SM of the H200's 132: from here on, FEW threads
UNFUSED_LANE_KEYS = max(1, UNFUSED_CHUNK // LANES)  # the statistics: a lane's keys of a chunk (a warp's)
UNFUSED_STATS_LANE_SUMS = (UNFUSED_STATS_THREADS // LANES, LANES)   # ... and its warps' lane sums
MERGE_BATCH = 4 if SIMULATOR else 8          # the merge: splits' loads a thread issues before it adds them
UNFUSED_FROM_RANK = 512       # the engine takes version 5 from this R on (``paths_unfused``)
ABSORB_BATCH = 8               # absorb_query: W_UK loads a thread issues before it adds them
ABSORB_LANES = 8 if SIMULATOR else 32   # ... latent columns r per block (a thread each)
ABSORB_SLICES = 2 if SIMULATOR else 8   # ... and dn's slices of consecutive n (a thread each)
F32 = 4


# version 5's indices: ``kernels.linear.non_negative`` on a GPU (float4 shared reads need the
# compiler to know an index is not negative), as they are in the simulator (``kernels.linear.index``)
non_negative = index


# --8<-- [start:absorb_query_kernel]
@functools.cache
def absorb_query_kernel(per_pass: int = ROWS_PER_PASS):
    """The absorb_query kernel for passes of ``per_pass`` rows (a literal: the pass's sums and
    queries live in registers). A decode row's launch takes passes of one (``pass_rows``): a pass
    of 8 would load its one query 8 times and add 8 rows' products. Each row's sums are the same."""
    sums_shape = (per_pass, ABSORB_SLICES, ABSORB_LANES)            # the slices' sums of a pass's rows

    @cuda.jit
    def absorb_query_kernel(q_nope, w_uk, q_lat):
        """q_lat[t, h, r] = sum_n q_nope[t, h, n] * W_UK[h, n, r].

        Block (x, head, y): latent columns r = x LANES + lane (threadIdx.x: consecutive r, so a
        warp's loads of a W_UK row are coalesced), dn cut into ABSORB_SLICES slices of consecutive
        n (threadIdx.y = s: slice s, its n in order), for the passes of PASS rows y, y +
        gridDim.z, ... Each thread issues ABSORB_BATCH loads of W_UK, and the same n of the
        pass's rows' queries, before it adds their products to all of the pass's rows (a query
        loaded inside the add's guard made every add wait for its own load); then the slices' sums
        meet in shared memory and thread (lane, r) adds row r's in slice order. The slices depend
        on dn only, so a row's sum does not depend on the rows beside it. W_UK (H dn R floats) is
        read once per pass; a decode row's 16 heads x 512 r get H R S threads, a load each in
        flight per batch.
        """
        lane, part = cuda.threadIdx.x, cuda.threadIdx.y
        r = cuda.blockIdx.x * ABSORB_LANES + lane
        head = cuda.blockIdx.y
        rows, depth, rank = q_nope.shape[0], q_nope.shape[2], q_lat.shape[2]
        width = (depth + ABSORB_SLICES - 1) // ABSORB_SLICES           # n per slice
        first, last = min(part * width, depth), min(part * width + width, depth)
        sums = cuda.shared.array(sums_shape, float32)                   # [rows, slices, lanes]
        staged = cuda.local.array(ABSORB_BATCH, float32)
        queries = cuda.local.array((per_pass, ABSORB_BATCH), float32)
        acc = cuda.local.array(per_pass, float32)
        column = min(r, rank - 1)                                       # past R: R - 1 again, never written
        for t0 in range(cuda.blockIdx.z * per_pass, rows, cuda.gridDim.z * per_pass):
            count = min(per_pass, rows - t0)
            for i in range(per_pass):
                acc[i] = float32(0.0)
            for n0 in range(first, last, ABSORB_BATCH):
                for b in range(ABSORB_BATCH):                           # the loads first: W_UK's, and
                    staged[b] = w_uk[head, min(n0 + b, last - 1), column]   # the rows' q (past the
                for i in range(per_pass):                               # pass or the slice: the last
                    for b in range(ABSORB_BATCH):                       # again, never added)
                        queries[i, b] = q_nope[t0 + min(i, count - 1), head, min(n0 + b, last - 1)]
                for b in range(ABSORB_BATCH):                           # then the sums, n in order
                    if n0 + b < last:
                        for i in range(per_pass):
                            if i < count:
                                acc[i] += queries[i, b] * staged[b]
            cuda.syncthreads()                                          # the last pass's sums read
            for i in range(per_pass):
                sums[i, part, lane] = acc[i]
            cuda.syncthreads()
            if r < rank:                                   # thread (lane, part): rows part, part + S, ...
                for i in range(part, count, ABSORB_SLICES):
                    total = sums[i, 0, lane]
                    for other in range(1, ABSORB_SLICES):
                        total += sums[i, other, lane]
                    q_lat[t0 + i, head, r] = total

    return absorb_query_kernel
# --8<-- [end:absorb_query_kernel]


# --8<-- [start:attention_absorb_kernel]
@cuda.jit(device=True)
def _score(query, cache_latent, cache_rope, key, scale):
    """(q_lat . c_key + q_pe . k_pe_key) * scale: a float32 dot over R + dr, query in shared memory."""
    rank = cache_latent.shape[1]
    score = float32(0.0)
    for i in range(rank):
        score += query[i] * cache_latent[key, i]
    for i in range(cache_rope.shape[1]):
        score += query[rank + i] * cache_rope[key, i]
    return score * scale


@cuda.jit(device=True)
def _accumulate(acc, p, cache_latent, start, count, alpha):
    """acc[i] = acc[i] * alpha + sum_j p[j] * c_{start + j}[i] for this thread's i (strided over R).
    Keys with p = 0 (masked) are skipped: their cache rows are never read."""
    for i in range(cuda.threadIdx.x, acc.shape[0], cuda.blockDim.x):
        total = acc[i] * alpha
        for j in range(count):
            if p[j] > float32(0.0):
                total += p[j] * cache_latent[start + j, i]
        acc[i] = total


@cuda.jit
def attention_absorb_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, scale, o_lat):
    """One block computes o_lat[row, head, :] (R) for one query row and one head.

    Online softmax over tiles of TPB keys: in each tile, thread j scores key start + j
    (``_score``), the block reduces the tile's max and (after rescaling to the new running max)
    its sum of exp, and ``_accumulate`` updates the accumulator: acc[r] = acc[r] * alpha +
    sum_j p_j c_j[r]. A tile-at-a-time loop keeps shared memory independent of the context
    length (a whole score row would need S floats: 16 KiB at 4k keys, too much at 100k+).

    Masked keys are skipped, never computed with: their score is not formed, their
    probability is exactly 0 and their cache row is never read (it may even hold NaN). A tile
    without a visible key is skipped whole. Every row sees at least one key (checked on the
    host), so the running sum ends >= 1: no division by zero, no exp of -inf arithmetic.

    Shared memory: dynamic (2R + dr floats) = the query q_lat | q_pe (R + dr) and the output
    accumulator (R); static: p (the tile's probabilities) and red (reduction scratch), TPB
    floats each. Cost: each block reads the S visible cache rows twice (scores, then values),
    from L2 after the first head; a block per (row, group of heads) would share those reads.
    """
    head = cuda.blockIdx.x
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    tile = cuda.blockDim.x
    rank = q_lat.shape[2]                     # R
    rope_dim = q_pe.shape[2]                  # dr
    keys = prefix_len + visible.shape[0]      # S

    smem = cuda.shared.array(0, dtype=float32)            # dynamic: 2R + dr floats
    query = smem[:rank + rope_dim]                        # [R + dr] q_lat then q_pe
    acc = smem[rank + rope_dim:2 * rank + rope_dim]       # [R] running sum_s p_s c_s
    p = cuda.shared.array(MAX_TILE, dtype=float32)        # [TPB] probabilities, 0 if masked
    red = cuda.shared.array(MAX_TILE, dtype=float32)      # [TPB] reduction scratch

    for i in range(tid, rank, tile):
        query[i] = q_lat[row, head, i]
        acc[i] = float32(0.0)
    for i in range(tid, rope_dim, tile):
        query[rank + i] = q_pe[row, head, i]
    cuda.syncthreads()

    run_max = float32(0.0)                   # running max of the visible scores (once seen)
    run_sum = float32(0.0)                   # running sum of exp(score - run_max)
    seen = False                             # has any visible key been met yet?
    for start in range(0, keys, tile):
        key = start + tid
        visible_key = False
        if key < keys:
            visible_key = key < prefix_len or bool(visible[row, key - prefix_len])
        score = float32(0.0)
        if visible_key:
            score = _score(query, cache_latent, cache_rope, key, scale)
            red[tid] = score
        else:
            red[tid] = -math.inf             # compared only, never used in arithmetic
        block_max(red)
        tile_max = red[0]
        cuda.syncthreads()                   # everyone has read red[0] before it is reused
        if tile_max == -math.inf:            # the same for every thread: skip a fully masked tile
            continue

        new_max = max(run_max, tile_max) if seen else tile_max
        alpha = math.exp(run_max - new_max) if seen else float32(0.0)   # rescales the old state
        prob = math.exp(score - new_max) if visible_key else float32(0.0)
        p[tid] = prob
        red[tid] = prob
        block_sum(red)                       # also publishes p to the whole block
        run_sum = run_sum * alpha + red[0]
        run_max = new_max
        seen = True
        _accumulate(acc, p, cache_latent, start, min(tile, keys - start), alpha)
        cuda.syncthreads()                   # p and red are rewritten by the next tile

    for i in range(tid, rank, tile):
        o_lat[row, head, i] = acc[i] / run_sum
# --8<-- [end:attention_absorb_kernel]


def check_absorb_query(q_nope, w_uk, *, out=None):
    """The reference's shape rules, float32 on the device, ``out`` (T, H, R)."""
    q_nope, w_uk = host_or_device(q_nope, np.float32), host_or_device(w_uk, np.float32)
    reference.check_absorb_query(q_nope, w_uk)
    check_float32(q_nope=q_nope, w_uk=w_uk)
    check_out(out, (*q_nope.shape[:2], w_uk.shape[2]))
    return q_nope, w_uk


# --8<-- [start:absorb_query]
def absorb_query(q_nope, w_uk, *, out=None, stream=None):
    """q_nope (T, H, dn), W_UK (H, dn, R) -> q_lat (T, H, R)."""
    q_nope, w_uk = check_absorb_query(q_nope, w_uk, out=out)
    (rows, heads, _), rank = q_nope.shape, w_uk.shape[2]
    d_out = output(out, (rows, heads, rank), stream=stream)                 # [T, H, R]
    if rows * heads * rank:
        per_pass = pass_rows(rows)
        grid = (blocks(rank, ABSORB_LANES), heads, row_passes(rows, per_pass))
        absorb_query_kernel(per_pass)[grid, (ABSORB_LANES, ABSORB_SLICES), stream](
            to_device(q_nope, np.float32), to_device(w_uk, np.float32), d_out)
    return deliver(d_out, out, q_nope, w_uk)
# --8<-- [end:absorb_query]


def check_absorb_output(o_lat, w_uv, *, out=None):
    """The reference's shape rules, float32 on the device, ``out`` (T, H, dv)."""
    o_lat, w_uv = host_or_device(o_lat, np.float32), host_or_device(w_uv, np.float32)
    reference.check_absorb_output(o_lat, w_uv)
    check_float32(o_lat=o_lat, w_uv=w_uv)
    check_out(out, (*o_lat.shape[:2], w_uv.shape[1]))
    return o_lat, w_uv


# --8<-- [start:absorb_output]
def absorb_output(o_lat, w_uv, *, out=None, stream=None):
    """o_lat (T, H, R), W_UV (H, dv, R) -> o (T, H, dv)."""
    o_lat, w_uv = check_absorb_output(o_lat, w_uv, out=out)
    (rows, heads, _), value_dim = o_lat.shape, w_uv.shape[1]
    d_out = output(out, (rows, heads, value_dim), stream=stream)            # [T, H, dv]
    if rows * heads * value_dim:                                           # a linear per head
        lanes_launch(as_rows(to_device(o_lat, np.float32), "o_lat"),              # [T H, R]
                     as_rows(to_device(w_uv, np.float32), "w_uv"),                # [H dv, R]
                     as_rows(d_out, "out"), groups=heads, stream=stream)          # [T H, dv]
    return deliver(d_out, out, o_lat, w_uv)
# --8<-- [end:absorb_output]


def _check_mask(prefix_len, visible, rows):
    """``check_visibility`` on a host mask; a device mask must be (T, T) bool, and is copied back
    for the every-row-sees-a-key rule only when there is no prefix."""
    if not is_device_array(visible):
        return reference.check_visibility(prefix_len, visible, rows)
    if visible.shape != (rows, rows) or visible.dtype != np.bool_:
        raise ValueError(f"visible must be a ({rows}, {rows}) bool array, "
                         f"got {visible.shape} {visible.dtype}")
    if prefix_len == 0:
        reference.check_visibility(prefix_len, visible.copy_to_host(), rows)
    return visible


def check_attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, *,
                           threads=None, out=None):
    """The reference's rules (the mask's first, as numpy raises them), then the launch's: block
    size (at most MAX_TILE), float32 on the device, ``out`` (T, H, R). Returns the arrays as
    numpy or device arrays, and prefix_len as an int."""
    q_lat, q_pe = host_or_device(q_lat, np.float32), host_or_device(q_pe, np.float32)
    cache_latent, cache_rope = host_or_device(cache_latent), host_or_device(cache_rope)
    if len(q_lat.shape) == 3:
        visible = _check_mask(prefix_len, visible, q_lat.shape[0])
    prefix_len = reference.check_attention(q_lat, q_pe, cache_latent, cache_rope, prefix_len)
    if threads is not None:
        check_threads(threads, MAX_TILE)
    check_float32(q_lat=q_lat, q_pe=q_pe, cache_latent=cache_latent, cache_rope=cache_rope)
    check_out(out, q_lat.shape)
    return q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible


def _rows_read(cache, keys: int):
    """The cache rows the kernel reads: a host cache is copied up to its first S rows only."""
    return cache if is_device_array(cache) else cache[:keys]


# --8<-- [start:attention_absorb]
def attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, scale, *,
                     threads=None, out=None, stream=None):
    """Absorbed attention over the latent cache.

    q_lat (T, H, R), q_pe (T, H, dr) rotated; cache_latent (>=S, R) and cache_rope (>=S, dr)
    hold the prefix in rows [0, P) and the new rows in [P, P+T). Returns o_lat (T, H, R).
    ``threads`` (32, 64 or 128) is the block size, which is also the key tile; by default the
    smallest that covers the S keys. ``out`` receives the result; ``stream`` is where the kernel
    is launched (None: the default stream).
    """
    q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible = check_attention_absorb(
        q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, threads=threads, out=out)
    (rows, heads, rank), rope_dim = q_lat.shape, q_pe.shape[2]
    keys = prefix_len + rows                                                # S
    d_out = output(out, (rows, heads, rank), stream=stream)                 # [T, H, R]
    if rows * heads * rank:
        threads = threads or pow2_threads(keys, MAX_TILE)
        shared_bytes = F32 * (2 * rank + rope_dim)                          # query and accumulator
        attention_absorb_kernel[(heads, rows), threads, stream, shared_bytes](
            to_device(q_lat, np.float32), to_device(q_pe, np.float32),
            to_device(_rows_read(cache_latent, keys), np.float32),
            to_device(_rows_read(cache_rope, keys), np.float32),
            prefix_len, to_device(visible), np.float32(scale), d_out)
    return deliver(d_out, out, q_lat, q_pe, cache_latent, cache_rope)
# --8<-- [end:attention_absorb]


# --8<-- [start:attention_paths_kernel]
@cuda.jit
def attention_paths_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, tile, o_lat):
    """One block computes o_lat[row, head, :] (R) over the row's own keys, in position order.

    The keys of row i are the prefix (slots 0 .. P-1, P = prefix[0]) and then its path root..i,
    at slots P + paths[i, 0..depths[i]]: S_i = P + depths[i] + 1 keys, enumerated by their
    logical index j (= their position). Tiles of ``tile`` keys start at fixed logical indices, so a
    tree node and the AR step at the same position combine the same keys in the same tiles:
    bit-identical outputs. Masked keys are never enumerated (no -inf arithmetic, no reads of other
    branches' rows).

    Per tile: the block's TPB >= tile threads copy the tile's key rows (R + dr floats each) into
    shared memory with coalesced loads (more threads than keys: more loads in flight, which one
    row's few blocks need), the block scores the keys from there (``_tile_score``: 32 parts per
    key in parallel, thread j adds key j's), reduces the tile's max and (after rescaling to the new
    running max) its sum of exp, and thread i updates acc[r] for r = i, i + TPB, ... from the same
    shared rows: the cache is read once per (row, head).
    Shared memory (dynamic): the query (R + dr), the accumulator (R), the score parts
    (tile x DOT_STRIDE) and the tile's keys
    (tile x (R + dr + 1); the +1 staggers rows across banks); static: p, red (TPB floats) and
    the tile's slots. The reductions run over all TPB entries, the ones past the tile neutral
    (-inf, 0), which leaves every max and sum as a tile-wide tree gives it.
    """
    head = cuda.blockIdx.x
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    rank = q_lat.shape[2]
    width = rank + q_pe.shape[2]
    keys = prefix[0] + depths[row] + 1

    smem = cuda.shared.array(0, dtype=float32)
    query = smem[:width]                                  # q_lat | q_pe
    acc = smem[width:width + rank]                        # running sum_s p_s c_s
    parts = score_parts(tile)
    dots = smem[width + rank:width + rank + parts]        # [tile, DOT_STRIDE] score parts (short tiles)
    tile_keys = smem[width + rank + parts:]               # [tile, R + dr + 1], row-major
    p = cuda.shared.array(MAX_TILE, dtype=float32)
    red = cuda.shared.array(MAX_TILE, dtype=float32)
    slots = cuda.shared.array(MAX_TILE, dtype=int32)

    run_max, run_sum = _fold_row(q_lat, q_pe, cache_latent, cache_rope, prefix, paths, row, head, 0, tile,
                                 keys, tile, scale, query, acc, tile_keys, dots, p, red, slots, tid, threads)
    for i in range(tid, rank, threads):
        o_lat[row, head, i] = acc[i] / run_sum


@cuda.jit(device=True)
def _fold_row(q_lat, q_pe, cache_latent, cache_rope, prefix, paths, row, head, first_start, stride, keys,
              tile, scale, query, acc, tile_keys, dots, p, red, slots, lane, segment):
    """The walk every version shares: the (row, head) query into shared memory and the accumulator
    zeroed, then the row's tiles at first_start, first_start + stride, ... (below ``keys``) staged
    and folded in order by the segment (the block in versions 1 and 2, a warp in version 3; its
    thread ``lane``). Returns (run_max, run_sum); ``acc`` holds the unnormalised sum."""
    rank = q_lat.shape[2]
    width = rank + q_pe.shape[2]
    for i in range(lane, rank, segment):
        query[i] = q_lat[row, head, i]
        acc[i] = float32(0.0)
    for i in range(lane, width - rank, segment):
        query[rank + i] = q_pe[row, head, i]
    run_max = float32(0.0)
    run_sum = float32(0.0)
    for start in range(first_start, keys, stride):
        count = min(tile, keys - start)
        _stage_tile(cache_latent, cache_rope, prefix[0], paths, row, start, count, slots, tile_keys)
        run_max, run_sum = _fold_tile(query, acc, tile_keys, dots, p, red, tile, count, scale,
                                      start == first_start, run_max, run_sum, segment)
    return run_max, run_sum


@cuda.jit(device=True)
def _write_partial(partials, row, head, split, acc, run_max, run_sum, lane, segment):
    """partials[row, head, split] = (acc, run_max, run_sum): a split's unnormalised softmax, written
    by the segment that folded it (versions 2 and 3; ``attention_merge_kernel`` adds them)."""
    rank = partials.shape[3] - 2
    for i in range(lane, rank, segment):
        partials[row, head, split, i] = acc[i]
    if lane == 0:
        partials[row, head, split, rank] = run_max
        partials[row, head, split, rank + 1] = run_sum


@cuda.jit(device=True)
def _fold_tile(query, acc, tile_keys, dots, p, red, tile, count, scale, first, run_max, run_sum, segment):
    """One staged tile into a running softmax: score the keys, reduce the tile's max, rescale
    (acc, run_sum) to the new running max, add the tile's exp-weights and weighted keys.
    Returns the new (run_max, run_sum); ``acc`` is updated in place.

    The block folds in segments of ``segment`` threads, each into its own (query, acc): versions 1
    and 2 pass segment = TPB (the whole block, one head), version 3 passes LANES (a warp per head).
    The segment scores the tile's keys (``_tile_score``: ``dots``, its own [tile, DOT_STRIDE]
    scratch), then a thread's lane (tid mod segment) holds key lane's score and strides over R; its
    segment's scratch is red[base:base + segment] and p[base:base + tile], base = tid - lane.
    Every thread of the block calls it (its barriers are the whole block's)."""
    tid = cuda.threadIdx.x
    lane = tid % segment
    base = tid - lane                                 # the segment's first slot in p and red
    rank = acc.shape[0]
    width = query.shape[0]
    score = _tile_score(query, tile_keys, dots, tile, count, scale, lane, segment)
    red[tid] = score if lane < count else -math.inf
    segment_max(red, segment)
    tile_max = red[base]
    cuda.syncthreads()                                # everyone has read red[base]
    new_max = tile_max if first else max(run_max, tile_max)
    alpha = float32(0.0) if first else math.exp(run_max - new_max)
    prob = math.exp(score - new_max) if lane < count else float32(0.0)
    p[tid] = prob
    red[tid] = prob
    segment_sum(red, segment)                         # also publishes p to the segment
    run_sum = run_sum * alpha + red[base]
    for i in range(lane, rank, segment):
        total = acc[i] * alpha
        for key in range(count):
            total += p[base + key] * tile_keys[key * (width + 1) + i]
        acc[i] = total
    cuda.syncthreads()                                # the tile's keys, p, red rewritten next
    return new_max, run_sum


@cuda.jit(device=True)
def _stage_tile(cache_latent, cache_rope, prefix, paths, row, start, count, slots, tile_keys):
    """The tile's slots (prefix keys in place, then the row's path), and its key rows copied to
    shared memory: consecutive threads read consecutive columns of a row (coalesced)."""
    tid = cuda.threadIdx.x
    rank = cache_latent.shape[1]
    width = rank + cache_rope.shape[1]
    j = start + tid
    if tid < count:
        slots[tid] = j if j < prefix else prefix + paths[row, j - prefix]
    cuda.syncthreads()
    total = count * width
    threads = cuda.blockDim.x
    staged = cuda.local.array(STAGE_BATCH, float32)
    for base in range(0, total, threads * STAGE_BATCH):
        # STAGE_BATCH loads first, into registers, then their stores: the loads overlap instead
        # of waiting one by one (indices past the tile re-read its last element, never stored)
        for b in range(STAGE_BATCH):
            index = min(base + b * threads + tid, total - 1)
            key, column = index // width, index % width
            staged[b] = cache_latent[slots[key], column] if column < rank \
                else cache_rope[slots[key], column - rank]
        for b in range(STAGE_BATCH):
            index = base + b * threads + tid
            if index < total:
                tile_keys[(index // width) * (width + 1) + index % width] = staged[b]
    cuda.syncthreads()


@cuda.jit(device=True)
def score_parts(tile):
    """Floats of a head's score parts in shared memory: [tile, DOT_STRIDE] for a tile shorter than
    LANES, none for longer ones (``_tile_score``). Called on the host as ``score_parts.py_func``."""
    return tile * DOT_STRIDE if tile < LANES else 0


@cuda.jit(device=True)
def _tile_score(query, tile_keys, dots, tile, count, scale, lane, segment):
    """Lane j's score of key j of the tile (a float32 dot over R + dr), or 0 past the tile.

    A tile of LANES keys or more gives every lane of a warp a key: lane j runs key j's products
    alone. A shorter tile (R = 512 leaves room for 8 or 16 keys) would leave most lanes idle while
    a few run R + dr dependent products, so the segment shares the work: part j of key k sums
    query[i] * key[i] for i = j, j + DOT_PARTS, ... in order (job k * DOT_PARTS + j; the threads
    stride over the jobs) into dots[k, j], then lane k adds its key's parts in order. Either way
    the sums depend on the tile alone (fixed by the model's dims), never on the segment's size or
    the rows: every version scores a key alike."""
    width = query.shape[0]
    score = float32(0.0)
    if tile >= LANES:                                 # a key per lane
        if lane < count:
            for i in range(width):
                score += query[i] * tile_keys[lane * (width + 1) + i]
            score *= scale
        return score
    for job in range(lane, count * DOT_PARTS, segment):
        key, part = job // DOT_PARTS, job % DOT_PARTS
        total = float32(0.0)
        for i in range(part, width, DOT_PARTS):
            total += query[i] * tile_keys[key * (width + 1) + i]
        dots[key * DOT_STRIDE + part] = total
    cuda.syncthreads()                                # every part written
    if lane < count:
        for part in range(DOT_PARTS):
            score += dots[lane * DOT_STRIDE + part]
        score *= scale
    return score
# --8<-- [end:attention_paths_kernel]


# --8<-- [start:attention_split_kernel]
@cuda.jit
def attention_split_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, tile,
                           partials):
    """Version 2, split over the keys: block (head, row, z) of a grid with Z = gridDim.z splits
    folds the row's tiles z, z + Z, z + 2Z, ... (the same fixed-position tiles as version 1, dealt
    round-robin) into its own running softmax, and leaves it unnormalised in
    partials[row, head, z] = (acc[0..R-1], run_max, run_sum). ``attention_merge_kernel`` then adds
    the Z partials in split order. Z blocks share one row's keys, so a decode row keeps Z times
    more of the GPU busy; a split whose first tile lies past the row's keys does nothing (the
    merge skips it by the same rule). Which tile goes to which split depends only on the tile's
    position and Z, so a tree row and the AR row at its position still add the same keys in the
    same order: bit-identical. Shared memory as version 1.
    """
    head = cuda.blockIdx.x
    row = cuda.blockIdx.y
    split = cuda.blockIdx.z
    stride = tile * cuda.gridDim.z
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    rank = q_lat.shape[2]
    width = rank + q_pe.shape[2]
    keys = prefix[0] + depths[row] + 1
    first_start = split * tile
    if first_start >= keys:                               # the whole block: no tile for this split
        return

    smem = cuda.shared.array(0, dtype=float32)
    query = smem[:width]                                  # q_lat | q_pe
    acc = smem[width:width + rank]                        # running sum_s p_s c_s
    parts = score_parts(tile)
    dots = smem[width + rank:width + rank + parts]        # [tile, DOT_STRIDE] score parts (short tiles)
    tile_keys = smem[width + rank + parts:]               # [tile, R + dr + 1], row-major
    p = cuda.shared.array(MAX_TILE, dtype=float32)
    red = cuda.shared.array(MAX_TILE, dtype=float32)
    slots = cuda.shared.array(MAX_TILE, dtype=int32)

    run_max, run_sum = _fold_row(q_lat, q_pe, cache_latent, cache_rope, prefix, paths, row, head, first_start,
                                 stride, keys, tile, scale, query, acc, tile_keys, dots, p, red, slots, tid,
                                 threads)
    _write_partial(partials, row, head, split, acc, run_max, run_sum, tid, threads)


@cuda.jit
def attention_merge_kernel(partials, prefix, depths, tile, o_lat):
    """One block per (head, row), a thread per latent column r (MERGE_THREADS on a GPU: Kimi's 512
    columns one each): the splits that had keys (z * tile < S_i) combined in split order, each
    rescaled to the largest running max: o = sum_z acc_z e^(m_z - M) / sum_z s_z e^(m_z - M).
    Each loop issues MERGE_BATCH splits' loads before it adds them (in order): a decode row's
    merge was waiting on one load at a time (version 5 merges up to hundreds of chunks). Thread 0
    finds M and the denominator once for the block (every thread doing it cost a 72-row forward
    of small twice the merge time, profile-h200-2026-12-01g.md)."""
    head = cuda.blockIdx.x
    row = cuda.blockIdx.y
    rank = o_lat.shape[2]
    keys = prefix[0] + depths[row] + 1
    used = min(partials.shape[2], (keys + tile - 1) // tile)
    staged = cuda.local.array(MERGE_BATCH, float32)
    weights = cuda.local.array(MERGE_BATCH, float32)
    shared = cuda.shared.array(2, float32)                # the largest max M and the total, thread 0's
    if cuda.threadIdx.x == 0:
        top = partials[row, head, 0, rank]
        for z0 in range(0, used, MERGE_BATCH):
            for b in range(MERGE_BATCH):
                staged[b] = partials[row, head, min(z0 + b, used - 1), rank]
            for b in range(MERGE_BATCH):
                top = max(top, staged[b])                 # past used: split used - 1 again (max is exact)
        total = float32(0.0)
        for z0 in range(0, used, MERGE_BATCH):
            for b in range(MERGE_BATCH):
                z = min(z0 + b, used - 1)
                staged[b] = partials[row, head, z, rank + 1]
                weights[b] = partials[row, head, z, rank]
            for b in range(min(MERGE_BATCH, used - z0)):
                total += staged[b] * math.exp(weights[b] - top)
        shared[0] = top
        shared[1] = total
    cuda.syncthreads()
    top, total = shared[0], shared[1]
    for i in range(cuda.threadIdx.x, rank, cuda.blockDim.x):
        value = float32(0.0)
        for z0 in range(0, used, MERGE_BATCH):
            for b in range(MERGE_BATCH):
                z = min(z0 + b, used - 1)
                staged[b] = partials[row, head, z, i]
                weights[b] = partials[row, head, z, rank]
            for b in range(min(MERGE_BATCH, used - z0)):
                value += staged[b] * math.exp(weights[b] - top)
        o_lat[row, head, i] = value / total
# --8<-- [end:attention_split_kernel]


# --8<-- [start:attention_heads_kernel]
@cuda.jit(**hardware_options(max_registers=HEADS_MAX_REGISTERS))
def attention_heads_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, tile,
                           partials):
    """Version 3, a block per (group of heads, row, split): block (x, row, z) of G = TPB / LANES
    warps, grid (H / G, T, Z). Warp g serves head x * G + g. Per tile the whole block stages the
    tile's keys once (``_stage_tile``), then each warp folds them into its own head's running
    softmax (``_fold_tile`` with segment = LANES: lane j holds key j's score, the max and sum reduce over
    the warp's 32 slots, lanes stride over R). With MLA every head reads the same latent cache,
    so a tile staged once serves G heads: H / G stagings of each tile per row instead of H.

    Tiles and splits as version 2 (partials[row, head, z], merged by ``attention_merge_kernel``,
    even for Z = 1). A head's sums depend on its own keys, the tile and Z only (the reduction is
    over the warp's 32 slots whatever G), so a tree row still equals its AR row bit for bit.
    Shared memory (dynamic): G times (query R + dr, accumulator R), then the tile's keys
    (tile x (R + dr + 1)); static: p, red (MAX_TPB floats), slots (MAX_TILE ints).
    """
    group = cuda.threadIdx.x // LANES
    lane = cuda.threadIdx.x % LANES
    heads = cuda.blockDim.x // LANES                      # G
    head = cuda.blockIdx.x * heads + group
    row = cuda.blockIdx.y
    split = cuda.blockIdx.z
    stride = tile * cuda.gridDim.z
    rank = q_lat.shape[2]
    width = rank + q_pe.shape[2]
    keys = prefix[0] + depths[row] + 1
    first_start = split * tile
    if first_start >= keys:                               # the whole block: no tile for this split
        return

    smem = cuda.shared.array(0, dtype=float32)
    mine = group * (width + rank)                         # this head's query | accumulator
    query = smem[mine:mine + width]                       # q_lat | q_pe
    acc = smem[mine + width:mine + width + rank]          # running sum_s p_s c_s
    parts = score_parts(tile)
    own_parts = heads * (width + rank) + group * parts
    dots = smem[own_parts:own_parts + parts]              # this head's score parts (short tiles)
    tile_keys = smem[heads * (width + rank + parts):]     # [tile, R + dr + 1], row-major
    p = cuda.shared.array(MAX_TILE, dtype=float32)        # [G x LANES] each head's probabilities
    red = cuda.shared.array(MAX_TILE, dtype=float32)      # [G x LANES] each head's scratch
    slots = cuda.shared.array(MAX_TILE, dtype=int32)

    run_max, run_sum = _fold_row(q_lat, q_pe, cache_latent, cache_rope, prefix, paths, row, head, first_start,
                                 stride, keys, tile, scale, query, acc, tile_keys, dots, p, red, slots, lane,
                                 LANES)
    _write_partial(partials, row, head, split, acc, run_max, run_sum, lane, LANES)
# --8<-- [end:attention_heads_kernel]


# --8<-- [start:attention_gemm_kernel]
@cuda.jit(device=True)
def _stage_chunk(q_lat, q_pe, cache_latent, cache_rope, row, head0, heads, padded, c0, columns, count, slots,
                 chunk_keys, chunk_query):
    """Columns c0 .. c0 + columns - 1 of the tile's ``count`` key rows and of the block's ``heads``
    queries into shared memory (rows GEMM_STRIDE floats apart; columns past R + dr as 0, so that
    every part of a score adds the same number of terms; ``padded`` - ``heads`` phantom queries
    of zeros where GH < 4). A thread takes columns tid, tid + TPB,
    ... (consecutive threads read consecutive columns of a row: coalesced) and walks the keys,
    GEMM_BATCH loads issued before their stores."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    rank = cache_latent.shape[1]
    width = rank + cache_rope.shape[1]
    staged = cuda.local.array(GEMM_BATCH, float32)
    for offset in range(tid, columns, threads):
        column = c0 + offset
        for first in range(0, count, GEMM_BATCH):
            for b in range(GEMM_BATCH):
                key = min(first + b, count - 1)           # past the tile: its last key again, not stored
                if column < rank:
                    staged[b] = cache_latent[slots[key], column]
                elif column < width:
                    staged[b] = cache_rope[slots[key], column - rank]
                else:
                    staged[b] = float32(0.0)
            for b in range(GEMM_BATCH):
                if first + b < count:
                    chunk_keys[(first + b) * GEMM_STRIDE + offset] = staged[b]
        for h in range(padded):
            value = float32(0.0)
            if h >= heads:
                pass
            elif column < rank:
                value = q_lat[row, head0 + h, column]
            elif column < width:
                value = q_pe[row, head0 + h, column - rank]
            chunk_query[h * GEMM_STRIDE + offset] = value


@cuda.jit
def attention_gemm_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, tile,
                          partials):
    """Version 4, register-tiled: a tile's scores and its weighted sum as two small GEMMs.

    Block (x, row, z) of grid (H / GH, T, Z) serves heads x * GH .. x * GH + GH - 1 of one row and
    split z; its TPB = ``gemm_threads(GH)`` threads form groups of GEMM_LANES = 64, group g owning
    the 4 heads 4g + a (GH < 4: one group, its heads past GH phantoms with zero queries, computed
    and never written, so that no loop needs a guard). Tiles and splits as versions 2 and 3, with
    ``tile`` = GEMM_TILE = KT = 32 keys (the merge is told the same tile). Per tile:

    - scores S[GH, KT] = Q K^T over the R + dr columns, staged in d-chunks of GEMM_CHUNK columns
      (``_stage_chunk``: the KT key rows and the GH queries). Thread (g, key tile t, part p) holds
      a 4 x 4 register tile: heads of group g, keys t, t + 8, t + 16, t + 24, summing the columns
      d = p (mod GEMM_PARTS = 8); per column 4 + 4 shared loads feed 16 FMAs (versions 1 to 3: 2
      loads per FMA). The 8 parts go through shared memory, added in part order, times the scale.
    - online softmax, no reduction tree: thread h < GH walks head h's KT scores for the tile's
      max (exact in any order), keeps the head's running max and sum and publishes its max and
      rescale factor alpha; the block writes P = exp(S - max) (a thread per (head, key)); thread h
      adds head h's probabilities in key order.
    - O[GH, R] = O * alpha + P V, V the tile's latent rows read from the cache (global memory, L1):
      thread (g, lane) keeps O for its 4 heads x columns lane, lane + 64, ... (GEMM_COLUMNS = 8,
      R <= 512) in registers for the whole kernel; per key 4 shared (broadcast) + 8 cached loads
      feed 32 FMAs. Written to partials[row, head, z] at the end, merged by
      ``attention_merge_kernel``.

    Order of every sum: a score is the 8 parts (each in increasing column order) added in part
    order; the softmax sum and each output column add the tile's keys in order, tile by tile; Z
    splits merged in order. None of it depends on GH, TPB, the other rows or the tree: a tree
    row equals its chain row bit for bit. Barriers per tile: 2 per d-chunk and 5 (Kimi's 576
    columns: 3 chunks, 11 barriers per 32 keys; version 3: 5 to 10 per 8 keys).
    Shared memory (dynamic, ``gemm_shared_bytes``): the key chunk (KT x GEMM_STRIDE) and the query
    chunk (GH x GEMM_STRIDE), reused for the score parts, then S and P (GH x KT each); static: the
    tile's slots, two buffers (the next tile's are written while the last PV reads the others),
    and each head's max and alpha.
    Registers (ptxas, sm_90): 168, no spills; at most 128 (2 blocks of 256 threads per SM) it
    spills 136 bytes, so no limit is set. Not yet run on a GPU.
    """
    tid = cuda.threadIdx.x
    row = cuda.blockIdx.y
    split = cuda.blockIdx.z
    heads = q_lat.shape[1] // cuda.gridDim.x              # GH
    padded = max(heads, GEMM_SCORE_HEADS)                 # GH, or 4 with phantom heads past GH
    head0 = cuda.blockIdx.x * heads
    group = tid // GEMM_LANES                             # this thread's heads: 4 group + a (a < 4)
    lane = tid % GEMM_LANES                               # its columns lane + j * GEMM_LANES
    part = tid % GEMM_PARTS                               # its score columns d = part (mod PARTS)
    key_tile = (tid // GEMM_PARTS) % GEMM_KEY_TILES       # its score keys key_tile + b * KEY_TILES
    rank = q_lat.shape[2]
    width = rank + q_pe.shape[2]
    n_prefix = prefix[0]
    keys = n_prefix + depths[row] + 1
    first_start = split * tile
    stride = tile * cuda.gridDim.z
    if first_start >= keys:                               # the whole block: no tile for this split
        return

    smem = cuda.shared.array(0, dtype=float32)
    chunk_keys = smem[:GEMM_TILE * GEMM_STRIDE]                              # [KT, STRIDE]
    chunk_query = smem[GEMM_TILE * GEMM_STRIDE:(GEMM_TILE + padded) * GEMM_STRIDE]  # [GH, STRIDE]
    part_stride = padded * GEMM_TILE + GEMM_PART_PAD
    parts = smem[:GEMM_PARTS * part_stride]                                  # the chunks, reused
    base = (GEMM_TILE + padded) * GEMM_STRIDE
    scores = smem[base:base + padded * GEMM_TILE]                            # [GH, KT]
    probs = smem[base + padded * GEMM_TILE:base + 2 * padded * GEMM_TILE]    # [GH, KT]
    slots = cuda.shared.array(GEMM_SLOTS, dtype=int32)
    stats = cuda.shared.array(GEMM_STATS, dtype=float32)  # each head's running max, then its alpha
    mine = group * GEMM_SCORE_HEADS * GEMM_TILE           # this group's first row of scores, probs

    out = cuda.local.array(GEMM_OUTPUTS, float32)         # O[4 heads, 8 columns]
    acc = cuda.local.array(GEMM_SCORES, float32)          # S[4 heads, 4 keys], this thread's part
    key_values = cuda.local.array(GEMM_SCORE_KEYS, float32)
    values = cuda.local.array(GEMM_COLUMNS, float32)
    for i in range(GEMM_OUTPUTS):
        out[i] = float32(0.0)
    head_max = float32(0.0)                               # thread h < GH: head h's running max, sum
    head_sum = float32(0.0)
    head_alpha = float32(0.0)

    buffer = 0
    for start in range(first_start, keys, stride):
        count = min(tile, keys - start)
        first = start == first_start
        if tid < count:
            j = start + tid
            slots[buffer + tid] = j if j < n_prefix else n_prefix + paths[row, j - n_prefix]
        for i in range(GEMM_SCORES):
            acc[i] = float32(0.0)
        for c0 in range(0, width, GEMM_CHUNK):                            # S = Q K^T, chunk by chunk
            steps = (min(GEMM_CHUNK, width - c0) + GEMM_PARTS - 1) // GEMM_PARTS
            cuda.syncthreads()                            # slots written, the last chunk consumed
            _stage_chunk(q_lat, q_pe, cache_latent, cache_rope, row, head0, heads, padded, c0,
                         steps * GEMM_PARTS, count, slots[buffer:buffer + GEMM_TILE], chunk_keys, chunk_query)
            cuda.syncthreads()                            # the chunk staged
            for step in range(steps):
                column = part + GEMM_PARTS * step
                for b in range(GEMM_SCORE_KEYS):
                    key_values[b] = chunk_keys[(key_tile + b * GEMM_KEY_TILES) * GEMM_STRIDE + column]
                for a in range(GEMM_SCORE_HEADS):
                    query = chunk_query[(group * GEMM_SCORE_HEADS + a) * GEMM_STRIDE + column]
                    for b in range(GEMM_SCORE_KEYS):
                        acc[a * GEMM_SCORE_KEYS + b] += query * key_values[b]
        cuda.syncthreads()                                # the chunks read: their space takes the parts
        for a in range(GEMM_SCORE_HEADS):
            for b in range(GEMM_SCORE_KEYS):
                parts[part * part_stride + mine + a * GEMM_TILE + key_tile + b * GEMM_KEY_TILES] = \
                    acc[a * GEMM_SCORE_KEYS + b]
        cuda.syncthreads()
        for e in range(tid, padded * GEMM_TILE, cuda.blockDim.x):      # parts in order, then the scale
            total = parts[e]
            for p in range(1, GEMM_PARTS):
                total += parts[p * part_stride + e]
            scores[e] = total * scale
        cuda.syncthreads()
        if tid < padded:                                  # head tid's max and rescale factor
            h = tid * GEMM_TILE
            tile_max = scores[h]
            for k in range(1, count):
                tile_max = max(tile_max, scores[h + k])
            new_max = tile_max if first else max(head_max, tile_max)
            head_alpha = float32(0.0) if first else math.exp(head_max - new_max)
            head_max = new_max
            stats[tid] = new_max
            stats[GEMM_MAX_HEADS + tid] = head_alpha
        cuda.syncthreads()                                # the maxima published
        for e in range(tid, padded * GEMM_TILE, cuda.blockDim.x):
            if e % GEMM_TILE < count:
                probs[e] = math.exp(scores[e] - stats[e // GEMM_TILE])
        cuda.syncthreads()                                # P published
        if tid < padded:                                  # head tid's sum of exp weights, in key order
            h = tid * GEMM_TILE
            total = float32(0.0)
            for k in range(count):
                total += probs[h + k]
            head_sum = head_sum * head_alpha + total
        for a in range(GEMM_SCORE_HEADS):
            scale_a = stats[GEMM_MAX_HEADS + group * GEMM_SCORE_HEADS + a]
            for j in range(GEMM_COLUMNS):
                out[a * GEMM_COLUMNS + j] *= scale_a
        for k in range(count):                            # O += P V, a key at a time
            slot = slots[buffer + k]
            for j in range(GEMM_COLUMNS):                 # columns past R: column R - 1 again, not written
                values[j] = cache_latent[slot, min(lane + j * GEMM_LANES, rank - 1)]
            for a in range(GEMM_SCORE_HEADS):
                weight = probs[mine + a * GEMM_TILE + k]
                for j in range(GEMM_COLUMNS):
                    out[a * GEMM_COLUMNS + j] += weight * values[j]
        buffer = GEMM_TILE - buffer

    for a in range(GEMM_SCORE_HEADS):
        if group * GEMM_SCORE_HEADS + a < heads:          # not a phantom head
            head = head0 + group * GEMM_SCORE_HEADS + a
            for j in range(GEMM_COLUMNS):
                column = lane + j * GEMM_LANES
                if column < rank:
                    partials[row, head, split, column] = out[a * GEMM_COLUMNS + j]
    if tid < heads:
        partials[row, head0 + tid, split, rank] = head_max
        partials[row, head0 + tid, split, rank + 1] = head_sum
# --8<-- [end:attention_gemm_kernel]


# --8<-- [start:attention_unfused_kernels]
@cuda.jit(device=True)
def _key_slot(n_prefix, paths, row, position):
    """The cache slot of ``row``'s key at ``position``: a prefix key's own slot, then the nodes of
    the row's path (tree node m sits at slot P + m)."""
    return position if position < n_prefix else n_prefix + paths[row, position - n_prefix]


@functools.cache
def tile_products(thread_a: int, thread_b: int, step: int):
    """The device function products(a_tile, b_tile, first, ty, tx, acc, a_values, b_values) of a
    register tile of THREAD_A x THREAD_B = ``thread_a`` x ``thread_b``: acc[i, j] += a[k, THREAD_A
    ty + i] * b[k, THREAD_B tx + j] for the STEP = ``step`` staged k-rows from ``first`` on, k in
    order. A thread's rows (and its columns) are consecutive floats, 16-byte aligned: one float4
    read each where there are 4 (indices ``non_negative``, so that the compiler sees it); a warp's
    threads of one ty share their reads of a (a broadcast), its tx read consecutive bytes of b (no
    bank conflicts). Per k: 2 shared loads feed THREAD_A THREAD_B multiply-adds."""
    @cuda.jit(device=True)
    def products(a_tile, b_tile, first, ty, tx, acc, a_values, b_values):
        for k in range(step):
            at = non_negative(first + k)
            for i in range(thread_a):
                a_values[i] = a_tile[at, non_negative(ty * thread_a + i)]
            for j in range(thread_b):
                b_values[j] = b_tile[at, non_negative(tx * thread_b + j)]
            for i in range(thread_a):
                for j in range(thread_b):
                    acc[i, j] += a_values[i] * b_values[j]

    return products


@functools.cache
def staging(loads: int):
    """The device function stage(tile, first, values, k, row0, row_stride): the LOADS = ``loads``
    values a thread loaded into the k-major tile, tile[first + k, row0 + p row_stride]."""
    @cuda.jit(device=True)
    def stage(tile, first, values, k, row0, row_stride):
        for p in range(loads):
            tile[first + k, row0 + p * row_stride] = values[p]

    return stage


# the P V GEMM's (attention_values_kernel)
_tile_products = tile_products(UNFUSED_THREAD, UNFUSED_THREAD, UNFUSED_STEP)
_stage = staging(UNFUSED_LOADS)


@functools.cache
def score_loads(query_loads: int, key_loads: int):
    """The device function load(q_lat, q_pe, cache_latent, cache_rope, q_rows, q_heads, slots,
    keys, column, a_next, b_next): column ``column`` of the thread's ``query_loads`` query rows
    (q_rows[p] < 0: past the last query) into a_next and of its ``key_loads`` cache slots (past
    ``keys``: none) into b_next, 0 where there is none or the column lies past R + dr (a padded
    term adds nothing)."""
    @cuda.jit(device=True)
    def load(q_lat, q_pe, cache_latent, cache_rope, q_rows, q_heads, slots, keys, column, a_next, b_next):
        rank = q_lat.shape[2]
        for p in range(query_loads):
            row = q_rows[p]
            a_next[p] = float32(0.0)
            if row >= 0:
                if column < rank:
                    a_next[p] = q_lat[row, q_heads[p], column]
                elif column < rank + q_pe.shape[2]:
                    a_next[p] = q_pe[row, q_heads[p], column - rank]
        for p in range(key_loads):
            slot = slots[p]
            b_next[p] = float32(0.0)
            if slot < keys:
                if column < rank:
                    b_next[p] = cache_latent[slot, column]
                elif column < rank + q_pe.shape[2]:
                    b_next[p] = cache_rope[slot, column - rank]

    return load


@functools.cache
def scores_kernel(query_tile: int, key_tile: int, thread_queries: int, thread_keys: int, step: int):
    """Version 5, step 1 of 4, for tiles of QT = ``query_tile`` queries x KT = ``key_tile`` keys,
    register tiles of TQ = ``thread_queries`` x TK = ``thread_keys`` and STEP = ``step`` k-rows
    staged at a time (literals: shared and local array sizes). None of them changes a score: each
    adds its R + dr terms in column order (``scores_shape``)."""
    side = key_tile // thread_keys                        # threads along the keys
    threads = (query_tile // thread_queries) * side
    load_rows = threads // step                           # tile rows between a thread's loads
    query_loads, key_loads = query_tile // load_rows, key_tile // load_rows   # per step, per thread
    registers = (thread_queries, thread_keys)
    query_staged = (2 * step, query_tile + UNFUSED_PAD)   # each operand's two staged buffers
    key_staged = (2 * step, key_tile + UNFUSED_PAD)
    products = tile_products(thread_queries, thread_keys, step)
    stage_queries, stage_keys = staging(query_loads), staging(key_loads)
    load = score_loads(query_loads, key_loads)

    @cuda.jit
    def attention_scores_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores):
        """scores[q, s] = scale * (q_lat | q_pe)[q] . (cache_latent | cache_rope)[s] for every
        query row q = row * H + head and every slot s < P + T (the prefix and the whole tree; the
        mask is the next steps' business), a register-tiled GEMM.

        Block (x, y) computes the QT x KT scores of queries y QT .. and slots x KT ..; the grid
        covers the cache's capacity and a block past P + T (P read on the device) returns at once,
        so one launch shape serves every step. Thread (ty, tx) holds the TQ x TK scores of queries
        TQ ty + i and slots TK tx + j in registers. Per step the block stages STEP columns of both
        operands k-major in shared memory: a thread loads column tid % STEP of rows LOAD_ROWS
        apart (consecutive threads read consecutive columns of a row), two buffers, the next
        step's loads waiting in registers while this step's products run. A score adds its R + dr
        terms one at a time in column order whatever the launch, the tiles, the rows or the tree:
        batch-invariant.
        """
        tid = non_negative(cuda.threadIdx.x)
        ty, tx = tid // side, tid % side
        rows, heads, rank = q_lat.shape
        width = rank + q_pe.shape[2]
        keys = prefix[0] + rows
        q0 = non_negative(cuda.blockIdx.y) * query_tile
        s0 = non_negative(cuda.blockIdx.x) * key_tile
        if s0 >= keys:                                    # the whole block: past the last key
            return
        a_tile = cuda.shared.array(query_staged, float32, alignment=UNFUSED_ALIGN)
        b_tile = cuda.shared.array(key_staged, float32, alignment=UNFUSED_ALIGN)
        acc = cuda.local.array(registers, float32)
        a_values = cuda.local.array(thread_queries, float32)
        b_values = cuda.local.array(thread_keys, float32)
        a_next = cuda.local.array(query_loads, float32)
        b_next = cuda.local.array(key_loads, float32)
        q_rows = cuda.local.array(query_loads, int32)     # the staged queries' rows and heads
        q_heads = cuda.local.array(query_loads, int32)
        slots = cuda.local.array(key_loads, int32)        # ... and slots
        column, first_row = tid % step, tid // step
        for p in range(query_loads):
            query = q0 + first_row + p * load_rows
            q_rows[p] = query // heads if query < rows * heads else -1
            q_heads[p] = query % heads
        for p in range(key_loads):
            slots[p] = s0 + first_row + p * load_rows
        for i in range(thread_queries):
            for j in range(thread_keys):
                acc[i, j] = float32(0.0)
        load(q_lat, q_pe, cache_latent, cache_rope, q_rows, q_heads, slots, keys, column, a_next, b_next)
        steps = (width + step - 1) // step
        for at in range(steps):
            first = at % 2 * step                         # this step's buffer
            stage_queries(a_tile, first, a_next, column, first_row, load_rows)
            stage_keys(b_tile, first, b_next, column, first_row, load_rows)
            cuda.syncthreads()                            # staged (and the other buffer free again)
            if at + 1 < steps:
                load(q_lat, q_pe, cache_latent, cache_rope, q_rows, q_heads, slots, keys,
                     (at + 1) * step + column, a_next, b_next)
            products(a_tile, b_tile, first, ty, tx, acc, a_values, b_values)
        for i in range(thread_queries):
            query = q0 + ty * thread_queries + i
            for j in range(thread_keys):
                slot = s0 + tx * thread_keys + j
                if query < rows * heads and slot < keys:
                    scores[query, slot] = acc[i, j] * scale

    return attention_scores_kernel


def scores_shape(queries: int) -> tuple[int, int, int, int, int]:
    """The scores kernel's (QT, KT, TQ, TK, STEP) for ``queries`` = T H query rows: NARROW while
    they fit one of its query tiles (a few rows of small's 16 heads: WIDE's 64-query tile would be
    mostly empty), else WIDE; the faster of the shapes timed on the H200 at 136 and at 16k keys
    (``docs/results/unfused-shapes-h200-2026-12-02.txt``). Every shape gives the same bits. (A
    decode row takes ``row_scores_kernel`` where its tile fits: ``row_scores``.)"""
    return UNFUSED_NARROW if queries <= UNFUSED_NARROW[0] else UNFUSED_WIDE


@functools.cache
def row_dot(unroll: int):
    """The device function dot(acc, query, tile, first, count) = acc plus query[c] * tile[first + c]
    for c = 0 .. ``count`` - 1, added in order: runs of ``unroll`` columns (a literal: registers)
    with their loads issued before their adds, then the last columns one by one. (Each run's
    offsets are constants from one index, which the compiler then folds into the loads.)"""

    @cuda.jit(device=True)
    def dot(acc, query, tile, first, count):
        queries = cuda.local.array(unroll, float32)
        keys = cuda.local.array(unroll, float32)
        whole = count // unroll * unroll
        for c0 in range(0, whole, unroll):
            at = index(c0)
            key_at = index(first + c0)
            for u in range(unroll):
                queries[u] = query[at + u]
                keys[u] = tile[key_at + u]
            for u in range(unroll):
                acc += queries[u] * keys[u]
        for column in range(whole, count):
            acc += query[index(column)] * tile[index(first + column)]
        return acc

    return dot


@functools.cache
def row_scores_kernel(key_tile: int, rank: int, rope_dim: int, threads: int, unroll: int = ROW_UNROLL):
    """Version 5, step 1 of 4, for a single query row (a decode step), tiles of KT = ``key_tile``
    keys of R = ``rank`` + dr = ``rope_dim`` columns, blocks of ``threads`` threads, a score's loads
    ``unroll`` at a time (literals: the staged tile's, the loads' and the registers' sizes). A
    score's terms are added as ``scores_kernel`` adds them, whatever the shape."""
    dot = row_dot(unroll)
    width = rank + rope_dim
    stride = width + 1                                # a staged key (+1: the tile's keys in distinct banks)
    staged = key_tile * stride                        # the tile in shared memory
    latent_loads = -(-rank // threads)                # a thread's columns of each key's latent
    rope_loads = -(-key_tile * rope_dim // threads)   # ... and its share of the tile's rope columns
    head_lanes = threads // key_tile

    @cuda.jit
    def attention_row_scores_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores):
        """scores[head, s] = scale * (q_lat | q_pe)[0, head] . (cache_latent | cache_rope)[s] for
        every head and slot s < P + 1: ``attention_scores_kernel``'s scores of one row.

        Thread (lane, key) = tid // KT, tid % KT: key s0 + key of the tile at s0, heads lane, lane +
        THREADS / KT, ... The block stages a whole tile, all R + dr columns, with every load issued
        before the first store (one memory round trip per tile, where the GEMM takes one per STEP
        columns: 18 of them for small's 576, on a query tile that a decode row's 16 heads fill
        half), then each thread adds its score's R + dr terms one at a time in column order
        (``row_dot``), the query's values read from global memory (every block reads the same
        row: H (R + dr) floats, 36 KB for small). Tiles s0 = blockIdx.x KT, + gridDim.x KT, ...
        below P + 1 (P read on the device): one launch shape serves every step, and a grid of a
        few blocks per SM spends no time on the cache's empty capacity. The same bits as the GEMM,
        whatever the tile."""
        tid = index(cuda.threadIdx.x)
        heads = q_lat.shape[1]
        keys = prefix[0] + 1
        tile = cuda.shared.array(staged, float32)
        latent = cuda.local.array((key_tile, latent_loads), float32)
        rope = cuda.local.array(rope_loads, float32)
        key, lane = tid % key_tile, tid // key_tile
        for s0 in range(cuda.blockIdx.x * key_tile, keys, cuda.gridDim.x * key_tile):
            for k in range(key_tile):                 # the loads first (past the last key: the last
                slot = index(min(s0 + k, keys - 1))   # key again, never written)
                for j in range(latent_loads):
                    latent[k, j] = cache_latent[slot, min(tid + j * threads, rank - 1)]
            for p in range(rope_loads):
                at = tid + p * threads
                rope[p] = cache_rope[index(min(s0 + at // rope_dim, keys - 1)), at % rope_dim]
            cuda.syncthreads()                        # the last tile's readers are done with it
            for k in range(key_tile):
                for j in range(latent_loads):
                    if tid + j * threads < rank:
                        tile[k * stride + tid + j * threads] = latent[k, j]
            for p in range(rope_loads):
                at = tid + p * threads
                if at < key_tile * rope_dim:
                    tile[at // rope_dim * stride + rank + at % rope_dim] = rope[p]
            cuda.syncthreads()
            for head in range(lane, heads, head_lanes):
                acc = dot(float32(0.0), q_lat[0, head], tile, key * stride, rank)
                acc = dot(acc, q_pe[0, head], tile, key * stride + rank, rope_dim)
                if s0 + key < keys:
                    scores[head, s0 + key] = acc * scale

    return attention_row_scores_kernel


def row_scores(rows: int, rank: int, rope_dim: int) -> bool:
    """Whether version 5 takes ``row_scores_kernel`` for its scores: for a single row (T = 1)
    with rope columns (dr >= 1: the kernel stages them apart), whose tile of ROW_KEYS keys of R =
    ``rank`` + dr = ``rope_dim`` columns fits SHARED_BUDGET."""
    return rows == 1 and rope_dim >= 1 and ROW_KEYS * (rank + rope_dim + 1) * 4 <= SHARED_BUDGET


@cuda.jit
def attention_stats_kernel(scores, prefix, depths, paths, partials):
    """Version 5, step 2 of 4: block (head, row) finds M, the largest score of the row's keys
    (positions 0 .. P + depth: the prefix, then its path, ``_key_slot``; exact in any order), then
    each chunk's sum of exp(s - M), a warp per chunk: lane l adds the chunk's keys l, l + 32, ...
    in position order (its loads all issued before its adds), then lane 0 adds the 32 lanes' sums
    in lane order: partials[row, head, c, R] = M and [R + 1] = the sum for c = 0 .. (P + depth) //
    CHUNK. The order depends on the key's position in its chunk alone, not on the rows or the
    tree. (One thread per chunk, adding its 256 keys one after another, took most of a decode
    step's statistics: a row of 16 heads at 16k keys has 1024 chunks, a few per SM.)"""
    head = cuda.blockIdx.x
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    heads, rank = partials.shape[1], partials.shape[3] - 2
    query = row * heads + head
    n_prefix = prefix[0]
    keys = n_prefix + depths[row] + 1
    threads = cuda.blockDim.x
    red = cuda.shared.array(UNFUSED_STATS_THREADS, float32)
    top = float32(-math.inf)
    for j in range(tid, keys, threads):
        top = max(top, scores[query, _key_slot(n_prefix, paths, row, j)])
    red[tid] = top
    block_max(red)
    top = red[0]
    staged = cuda.local.array(UNFUSED_LANE_KEYS, float32)
    lane_sums = cuda.shared.array(UNFUSED_STATS_LANE_SUMS, float32)   # [warps, lanes]
    warp, lane, warps = tid // LANES, tid % LANES, threads // LANES
    chunks = (keys - 1) // UNFUSED_CHUNK + 1
    for first in range(0, chunks, warps):                 # the same trip count in every warp
        chunk = first + warp
        start = chunk * UNFUSED_CHUNK
        end = min(start + UNFUSED_CHUNK, keys)
        total = float32(0.0)
        if chunk < chunks:                                # lane's keys: start + lane, + LANES, ...
            for i in range(UNFUSED_LANE_KEYS):            # the loads first (past the end: the last
                key = min(start + lane + i * LANES, end - 1)   # key again, never added)
                staged[i] = scores[query, _key_slot(n_prefix, paths, row, key)]
            for i in range(UNFUSED_LANE_KEYS):            # then the sums, in position order
                if start + lane + i * LANES < end:
                    total += math.exp(staged[i] - top)
        lane_sums[warp, lane] = total
        cuda.syncthreads()
        if lane == 0 and chunk < chunks:                  # the lanes' sums, in lane order
            for other in range(1, LANES):
                total += lane_sums[warp, other]
            partials[row, head, chunk, rank] = top
            partials[row, head, chunk, rank + 1] = total
        cuda.syncthreads()                                # lane_sums is rewritten next


@cuda.jit
def attention_values_kernel(scores, cache_latent, prefix, partials):
    """Version 5, step 3 of 4: partials[row, head, c, :R] = sum over the keys j of chunk c (in
    position order) of exp(scores[q, j] - M) cache_latent[j], for the chunks wholly inside the
    prefix ((c + 1) CHUNK <= P: every row sees all of their keys, each at its own slot), as a
    register-tiled GEMM P V over all the launch's query rows at once. Block (x, y, c): latent
    columns x TILE .., queries y TILE .., chunk c; a block whose chunk reaches past the prefix
    returns at once (``attention_tail_kernel`` takes those). M is the row's max from step 2.
    Register tiles as ``attention_scores_kernel``; P is computed as it is staged (a thread: key
    tid % STEP of LOADS queries), V staged as it lies (a thread: column tid % TILE of LOADS keys)."""
    tid = non_negative(cuda.threadIdx.x)
    ty, tx = tid // UNFUSED_SIDE, tid % UNFUSED_SIDE
    heads, rank = partials.shape[1], cache_latent.shape[1]
    queries = partials.shape[0] * heads
    chunk = cuda.blockIdx.z
    start = chunk * UNFUSED_CHUNK
    if start + UNFUSED_CHUNK > prefix[0]:                 # the whole block: a chunk with path keys
        return
    q0 = non_negative(cuda.blockIdx.y) * UNFUSED_TILE
    c0 = non_negative(cuda.blockIdx.x) * UNFUSED_TILE
    a_tile = cuda.shared.array(UNFUSED_STAGED, float32, alignment=UNFUSED_ALIGN)
    b_tile = cuda.shared.array(UNFUSED_STAGED, float32, alignment=UNFUSED_ALIGN)
    acc = cuda.local.array(UNFUSED_REGISTERS, float32)
    a_values = cuda.local.array(UNFUSED_THREAD, float32)
    b_values = cuda.local.array(UNFUSED_THREAD, float32)
    a_next = cuda.local.array(UNFUSED_LOADS, float32)
    b_next = cuda.local.array(UNFUSED_LOADS, float32)
    staged = cuda.local.array(UNFUSED_LOADS, int32)      # the staged queries (-1: past the last)
    tops = cuda.local.array(UNFUSED_LOADS, float32)      # ... and their rows' max scores M
    key, first_row = tid % UNFUSED_STEP, tid // UNFUSED_STEP
    column, first_key = tid % UNFUSED_TILE, tid // UNFUSED_TILE
    for p in range(UNFUSED_LOADS):
        query = q0 + first_row + p * UNFUSED_LOAD_ROWS
        staged[p] = query if query < queries else -1
        tops[p] = partials[query // heads, query % heads, chunk, rank] if query < queries else float32(0.0)
    for i in range(UNFUSED_THREAD):
        for j in range(UNFUSED_THREAD):
            acc[i, j] = float32(0.0)
    steps = UNFUSED_CHUNK // UNFUSED_STEP
    for step in range(steps + 1):                         # stage step - 1, load step, multiply step - 1
        first = step % 2 * UNFUSED_STEP
        if step > 0:
            _stage(a_tile, first, a_next, key, first_row, UNFUSED_LOAD_ROWS)
            for p in range(UNFUSED_LOADS):
                b_tile[first + first_key + p * UNFUSED_LOAD_KEYS, column] = b_next[p]
            cuda.syncthreads()
        if step < steps:
            j0 = start + step * UNFUSED_STEP
            for p in range(UNFUSED_LOADS):
                a_next[p] = float32(0.0) if staged[p] < 0 else math.exp(scores[staged[p], j0 + key] - tops[p])
                b_next[p] = float32(0.0) if c0 + column >= rank else \
                    cache_latent[j0 + first_key + p * UNFUSED_LOAD_KEYS, c0 + column]
        if step > 0:
            _tile_products(a_tile, b_tile, first, ty, tx, acc, a_values, b_values)
    for i in range(UNFUSED_THREAD):
        query = q0 + ty * UNFUSED_THREAD + i
        for j in range(UNFUSED_THREAD):
            at = c0 + tx * UNFUSED_THREAD + j
            if query < queries and at < rank:
                partials[query // heads, query % heads, chunk, at] = acc[i, j]


@functools.cache
def tail_kernel(heads_per_block: int, batch: int = UNFUSED_TAIL_BATCH):
    """Version 5's tail kernel for HB = ``heads_per_block`` heads per block and BATCH = ``batch``
    cache loads in flight per thread (literals: its staged probabilities and its registers); neither
    changes a sum (``tail_shape``)."""
    probs_shape = heads_per_block * UNFUSED_CHUNK         # the staged exp(s - M), [HB, keys]

    @cuda.jit
    def attention_tail_kernel(scores, cache_latent, prefix, depths, paths, partials):
        """Version 5, step 4 of 4: the chunks step 3 leaves, from the one holding position P to the
        one holding the row's own position P + depth, where the row's keys are prefix keys, then
        its path's nodes (``_key_slot``). Block (x, g, row): latent columns x TPB + tid of heads
        g HB .. of one row. Per chunk the block stages the keys' slots and the heads' exp(s - M)
        in shared memory, then each thread adds the chunk's keys in position order for its column
        and heads (its cache loads issued BATCH at a time, ahead of their adds): term for
        term the sums step 3's GEMM gives a chunk of the prefix, so a tree row equals the row at
        its position in the committed chain, bit for bit."""
        tid = cuda.threadIdx.x
        threads = cuda.blockDim.x
        column = cuda.blockIdx.x * threads + tid
        head0 = cuda.blockIdx.y * heads_per_block
        row = cuda.blockIdx.z
        heads, rank = partials.shape[1], cache_latent.shape[1]
        n_prefix = prefix[0]
        last = n_prefix + depths[row]                     # the row's own position
        slots = cuda.shared.array(UNFUSED_CHUNK, int32)
        probs = cuda.shared.array(probs_shape, float32)   # [HB, keys]
        acc = cuda.local.array(heads_per_block, float32)
        values = cuda.local.array(batch, float32)
        for chunk in range(n_prefix // UNFUSED_CHUNK, last // UNFUSED_CHUNK + 1):
            start = chunk * UNFUSED_CHUNK
            count = min(UNFUSED_CHUNK, last + 1 - start)
            cuda.syncthreads()                            # the last chunk's slots and probs consumed
            for k in range(tid, count, threads):
                slots[k] = _key_slot(n_prefix, paths, row, start + k)
            cuda.syncthreads()
            for e in range(tid, heads_per_block * count, threads):
                h, k = e // count, e % count
                value = float32(0.0)
                if head0 + h < heads:
                    top = partials[row, head0 + h, chunk, rank]
                    value = math.exp(scores[row * heads + head0 + h, slots[k]] - top)
                probs[h * UNFUSED_CHUNK + k] = value
            cuda.syncthreads()
            for h in range(heads_per_block):
                acc[h] = float32(0.0)
            if column < rank:
                for k0 in range(0, count, batch):   # BATCH loads, then their adds, k in order
                    for b in range(batch):
                        values[b] = cache_latent[slots[min(k0 + b, count - 1)], column]
                    for b in range(batch):          # a fixed trip count: values stay registers
                        if k0 + b < count:
                            for h in range(heads_per_block):
                                acc[h] += probs[h * UNFUSED_CHUNK + k0 + b] * values[b]
                for h in range(heads_per_block):
                    if head0 + h < heads:
                        partials[row, head0 + h, chunk, column] = acc[h]

    return attention_tail_kernel


def tail_shape(rows: int) -> tuple[int, int, int]:
    """The tail kernel's (HB heads, threads per block, BATCH) for T = ``rows`` rows, the fastest measured
    on the H200 at small's 16 heads (``docs/results/unfused-shapes-h200-2026-12-02.txt``): one head
    for a decode row (its tail is its whole context while that is short: more blocks, fewer sums
    per thread), two for a few rows, eight from TAIL_MANY_ROWS on (each cache load then feeds
    eight heads' sums). The same bits whatever the shape."""
    if rows == 1:
        return UNFUSED_TAIL_ONE
    return UNFUSED_TAIL_FEW if rows < UNFUSED_TAIL_MANY_ROWS else UNFUSED_TAIL_MANY


# --8<-- [end:attention_unfused_kernels]


def paths_tile(rank: int, rope_dim: int) -> int:
    """Keys per tile of ``attention_paths``: 32, or 16 when 32 staged rows of R + dr floats would
    pass SHARED_BUDGET (48 KB is numba's limit; the static p, red and slots take 1.5 KB). Fixed by
    the model's dims alone, never by the call, so tiles sit at the same positions for every row
    count."""
    return 32 if paths_shared_bytes(rank, rope_dim, 32) <= SHARED_BUDGET else 16


def paths_shared_bytes(rank: int, rope_dim: int, tile: int, heads_per_block: int = 1) -> int:
    """Dynamic shared memory of ``attention_paths``' kernels: a query, an accumulator and the
    score parts of a tile per head of the block (G = ``heads_per_block``; 1 in versions 1 and 2),
    then the staged keys."""
    width = rank + rope_dim
    return F32 * (heads_per_block * (width + rank + score_parts.py_func(tile)) + tile * (width + 1))


def check_attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, *, out=None):
    """Device arrays only (the engine's buffers): shapes, dtypes, and out (T, H, R)."""
    arrays = dict(q_lat=q_lat, q_pe=q_pe, cache_latent=cache_latent, cache_rope=cache_rope,
                  prefix=prefix, depths=depths, paths=paths)
    for name, array in arrays.items():
        if not is_device_array(array):
            raise ValueError(f"{name} must be a device array (attention_paths reads the engine's buffers)")
    rows, heads, rank = q_lat.shape
    if q_pe.shape[:2] != (rows, heads) or cache_latent.shape[1] != rank \
            or cache_rope.shape[1] != q_pe.shape[2] or cache_latent.shape[0] != cache_rope.shape[0]:
        raise ValueError(f"q_pe (T, H, dr), cache_latent (C, R) and cache_rope (C, dr) must match "
                         f"q_lat {q_lat.shape}, got {q_pe.shape}, {cache_latent.shape}, {cache_rope.shape}")
    if prefix.shape != (1,) or depths.shape != (rows,) or len(paths.shape) != 2 or paths.shape[0] != rows:
        raise ValueError(f"prefix must be (1,), depths ({rows},) and paths ({rows}, >= max depth + 1), "
                         f"got {prefix.shape}, {depths.shape}, {paths.shape}")
    check_float32(q_lat=q_lat, q_pe=q_pe, cache_latent=cache_latent, cache_rope=cache_rope)
    check_out(out, q_lat.shape)


def check_heads_per_block(heads_per_block, heads: int, name: str = "heads_per_block") -> None:
    """G: 1, 2 or 4 (G warps of LANES threads <= MAX_TPB), dividing the H heads."""
    if isinstance(heads_per_block, bool) or not isinstance(heads_per_block, int) \
            or heads_per_block not in HEADS_PER_BLOCK or heads % heads_per_block:
        raise ValueError(f"{name} must be 1, 2 or 4 and divide the number of heads ({heads}), "
                         f"got {heads_per_block!r}")


# --8<-- [start:attention_paths]
def attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, *,
                    splits: int = 1, heads_per_block: int = 1, gemm: bool = False, unfused: bool = False,
                    scores=None, partials=None, out=None, stream=None):
    """Absorbed attention of each row over the prefix and its own path (device arrays).

    q_lat (T, H, R), q_pe (T, H, dr); the cache (C, R), (C, dr); prefix (1,) = P; depths (T,)
    and paths (T, >= max depth + 1): row i sees slots 0 .. P-1, then P + paths[i, d] for
    d = 0 .. depths[i]. Equals ``attention_absorb`` with the ancestor mask of that tree (within
    float32 rounding); unlike it, its sums do not depend on the other rows.

    ``splits`` = 1: version 1, one block per (row, head) walks every tile. ``splits`` = Z > 1:
    version 2, Z blocks per (row, head) each fold every Z-th tile into ``partials``
    (T, H, Z, R + 2) float32 (allocated when not given), then one merge. ``heads_per_block`` =
    G > 1 (2 or 4, dividing H): version 3, a block per (G heads, row, split) stages each tile once
    for its G heads, then the same merge (also for Z = 1), its tile from ``paths_heads_tile``.
    ``gemm`` = True: version 4 (``attention_gemm_kernel``, heads_per_block left at 1, R <= 512), a
    block per (GH = ``gemm_heads(H)`` heads, row, split), tiles of GEMM_TILE keys, the same merge.
    ``unfused`` = True: version 5 (``_attention_unfused``; Z, G and ``gemm`` left alone), the
    scores of all rows against every key as one GEMM into ``scores`` (T * H, C), the softmax's
    statistics, P V as a second GEMM in chunks of UNFUSED_CHUNK keys at fixed positions into
    ``partials`` (T, H, ``unfused_chunks(C)``, R + 2), then the same merge.
    Results depend on Z and the tile (the order of sums), never on the other rows: fix Z, G and
    the version per engine.
    """
    check_attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, out=out)
    (rows, heads, rank), rope_dim = q_lat.shape, q_pe.shape[2]
    check_splits(splits)
    check_gemm(gemm, heads_per_block, rank)
    check_heads_per_block(heads_per_block, heads)
    check_unfused(unfused, splits, heads_per_block, gemm)
    d_out = output(out, (rows, heads, rank), stream=stream)                 # [T, H, R]
    if unfused:                                                             # version 5
        return _attention_unfused(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale,
                                  scores, partials, d_out, stream)
    if gemm:                                                                # version 4
        return _attention_gemm(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale,
                               splits, partials, d_out, stream)
    tile = paths_heads_tile(rank, rope_dim, heads_per_block)
    shared = paths_shared_bytes(rank, rope_dim, tile, heads_per_block)
    threads = tile if SIMULATOR else PATHS_THREADS                          # versions 1 and 2
    args = (q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, np.float32(scale), tile)
    if splits == 1 and heads_per_block == 1:                                # version 1
        attention_paths_kernel[(heads, rows), threads, stream, shared](*args, d_out)
        return d_out
    check_out(partials, (rows, heads, splits, rank + 2), name="partials")
    partials = output(partials, (rows, heads, splits, rank + 2), stream=stream)   # [T, H, Z, R + 2]
    if heads_per_block == 1:                                                # version 2
        attention_split_kernel[(heads, rows, splits), threads, stream, shared](*args, partials)
    else:                                                                   # version 3: G warps
        attention_heads_kernel[(heads // heads_per_block, rows, splits), heads_per_block * LANES, stream,
                               shared](*args, partials)
    attention_merge_kernel[(heads, rows), merge_threads(rank), stream](partials, prefix, depths, tile, d_out)
    return d_out


def _attention_gemm(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, splits, partials,
                    d_out, stream):
    """Version 4: ``attention_gemm_kernel`` into ``partials`` (T, H, Z, R + 2), then the merge."""
    rows, heads, rank = q_lat.shape
    group = gemm_heads(heads)                                               # GH
    check_out(partials, (rows, heads, splits, rank + 2), name="partials")
    partials = output(partials, (rows, heads, splits, rank + 2), stream=stream)   # [T, H, Z, R + 2]
    grid, shared = (heads // group, rows, splits), gemm_shared_bytes(group)
    attention_gemm_kernel[grid, gemm_threads(group), stream, shared](
        q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, np.float32(scale), GEMM_TILE, partials)
    attention_merge_kernel[(heads, rows), merge_threads(rank), stream](
        partials, prefix, depths, GEMM_TILE, d_out)
    return d_out


def _attention_unfused(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, scores, partials,
                       d_out, stream):
    """Version 5: scores, statistics, P V over the prefix's whole chunks and over the rest, merge."""
    rows, heads, rank = q_lat.shape
    capacity = cache_latent.shape[0]
    chunks = unfused_chunks(capacity)
    check_out(scores, (rows * heads, capacity), name="scores")
    check_out(partials, (rows, heads, chunks, rank + 2), name="partials")
    scores = output(scores, (rows * heads, capacity), stream=stream)             # [T H, C]
    partials = output(partials, (rows, heads, chunks, rank + 2), stream=stream)  # [T, H, chunks, R + 2]
    if row_scores(rows, rank, q_pe.shape[2]):
        row_grid = min(blocks(capacity, ROW_KEYS), ROW_BLOCKS)
        row_scores_kernel(ROW_KEYS, rank, q_pe.shape[2], ROW_THREADS)[row_grid, ROW_THREADS, stream](
            q_lat, q_pe, cache_latent, cache_rope, prefix, np.float32(scale), scores)
    else:
        shape = scores_shape(rows * heads)
        query_tile, key_tile, thread_queries, thread_keys, _ = shape
        scores_grid = (blocks(capacity, key_tile), blocks(rows * heads, query_tile))
        scores_threads = (query_tile // thread_queries) * (key_tile // thread_keys)
        scores_kernel(*shape)[scores_grid, scores_threads, stream](
            q_lat, q_pe, cache_latent, cache_rope, prefix, np.float32(scale), scores)
    queries = blocks(rows * heads, UNFUSED_TILE)
    attention_stats_kernel[(heads, rows), stats_threads(rows * heads), stream](
        scores, prefix, depths, paths, partials)
    attention_values_kernel[(blocks(rank, UNFUSED_TILE), queries, chunks), UNFUSED_THREADS, stream](
        scores, cache_latent, prefix, partials)
    tail_heads, tail_threads, tail_batch = tail_shape(rows)
    tail_grid = (blocks(rank, tail_threads), blocks(heads, tail_heads), rows)
    tail_kernel(tail_heads, tail_batch)[tail_grid, tail_threads, stream](
        scores, cache_latent, prefix, depths, paths, partials)
    attention_merge_kernel[(heads, rows), merge_threads(rank), stream](
        partials, prefix, depths, UNFUSED_CHUNK, d_out)
    return d_out


def stats_threads(queries: int) -> int:
    """Version 5's statistics: a block per query row, STATS_THREADS of them while the blocks are
    few (a decode row: more chunks' warps at once), STATS_FEW once they fill the GPU. Neither
    changes a sum (the max is exact in any order, each chunk's sum is one warp's, in lane order)."""
    return UNFUSED_STATS_THREADS if queries < UNFUSED_STATS_MANY_BLOCKS else UNFUSED_STATS_FEW


def unfused_chunks(capacity: int) -> int:
    """Version 5's P V chunks for a cache of ``capacity`` slots: UNFUSED_CHUNK keys each, at fixed
    positions (a partial per chunk, merged in chunk order)."""
    return -(-capacity // UNFUSED_CHUNK)


def check_unfused(unfused, splits, heads_per_block, gemm) -> None:
    """``unfused``: True or False; with True, Z, G and ``gemm`` left at their defaults (version 5
    chunks its keys and groups its queries itself)."""
    if not isinstance(unfused, bool):
        raise ValueError(f"unfused must be True or False, got {unfused!r}")
    if unfused and (splits != 1 or heads_per_block != 1 or gemm):
        raise ValueError(f"unfused=True takes splits=1, heads_per_block=1 and gemm=False (version 5 chunks "
                         f"its keys itself), got splits={splits!r}, heads_per_block={heads_per_block!r}, "
                         f"gemm={gemm!r}")


def merge_threads(rank: int) -> int:
    """The merge's threads for R latent columns: whole warps, one column each up to 512 on a GPU
    (the simulator's 128 at most keeps it quick)."""
    return row_threads(rank, MAX_TPB if SIMULATOR else 512)


def check_gemm(gemm, heads_per_block, rank: int) -> None:
    """``gemm``: True or False; with True, ``heads_per_block`` left at 1 (version 4 groups its heads
    itself: ``gemm_heads``) and a rank R <= GEMM_MAX_RANK (a thread holds GEMM_COLUMNS columns)."""
    if not isinstance(gemm, bool):
        raise ValueError(f"gemm must be True or False, got {gemm!r}")
    if not gemm:
        return
    if heads_per_block != 1 or isinstance(heads_per_block, bool):
        raise ValueError(f"heads_per_block must be 1 with gemm=True (version 4 takes gemm_heads(H) heads "
                         f"per block), got {heads_per_block!r}")
    if rank > GEMM_MAX_RANK:
        raise ValueError(f"gemm=True needs a rank R <= {GEMM_MAX_RANK} (q_lat's last axis), got {rank}")


def gemm_heads(heads: int) -> int:
    """GH, version 4's heads per block: the largest of 16, 8, 4, 2, 1 dividing H (Kimi's 64 and one
    rank's 8: 16 and 8). 16 is the most that fits: 256 threads (4 groups of 64, each a 4-head
    score and output tile), and the key and query chunks, S and P in 41.5 KB of shared memory
    (``gemm_shared_bytes``); 32 would take 512 threads and 58 KB, past numba's 48 KB. Every head a
    block serves shares the block's staged keys: a row's tiles are staged H / GH times. GH
    changes which heads share a block, never a head's sums."""
    return next(group for group in GEMM_HEADS if heads % group == 0)


def gemm_threads(heads_per_block: int) -> int:
    """Version 4's TPB for GH heads: GEMM_LANES (64) per group of 4 heads (GH < 4: one group, its
    heads past GH phantoms): 256 for GH = 16, 128 for 8, 64 for 4 or fewer (GPU and simulator)."""
    return GEMM_LANES * max(heads_per_block, GEMM_SCORE_HEADS) // GEMM_SCORE_HEADS


def gemm_shared_bytes(heads_per_block: int) -> int:
    """Version 4's dynamic shared memory for GH heads: the key chunk (KT rows) and the query chunk
    (GH rows) of GEMM_STRIDE floats each, which the score parts (8 x (GH x KT + 4)) reuse, then
    S and P (GH x KT each)."""
    group = max(heads_per_block, GEMM_SCORE_HEADS)       # phantom heads where GH < 4
    chunks = (GEMM_TILE + group) * GEMM_STRIDE
    assert GEMM_PARTS * (group * GEMM_TILE + GEMM_PART_PAD) <= chunks, "the score parts must fit the chunks"
    return F32 * (chunks + 2 * group * GEMM_TILE)


def check_splits(splits, name: str = "splits") -> None:
    """Z of ``attention_paths``: an integer in [1, MAX_SPLITS] (``name``: how the caller calls it)."""
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_SPLITS}], got {splits!r}")


def paths_splits(capacity: int, rank: int, rope_dim: int, heads_per_block: int = 1,
                 gemm: bool = False) -> int:
    """Z for an engine whose cache holds ``capacity`` keys: the power of two that leaves each split
    at most ``SPLIT_TILES`` tiles of a full cache, in [1, MAX_SPLITS] (tiles of ``paths_heads_tile``,
    or version 4's GEMM_TILE with ``gemm``). Fixed by the engine's sizes, never by the call, so
    every row of every step splits its keys the same way."""
    tile = GEMM_TILE if gemm else paths_heads_tile(rank, rope_dim, heads_per_block)
    tiles = -(-capacity // tile)
    splits = 1
    while splits < MAX_SPLITS and splits * SPLIT_TILES < tiles:
        splits *= 2
    return splits


def paths_gemm(rank: int) -> bool:
    """Whether the engine takes version 4 (when version 5, ``paths_unfused``, is not taken): where
    R >= GEMM_FROM_RANK. Measured on the H200: at R = 512 it made small's forward at 16k context
    29% faster at T = 1 and 69% at T = 72 (profile-h200-2026-12-01f.md), and Kimi's attention
    3.6x to 4x faster than version 3
    (bench-h200-2026-12-01c.md); at tiny's R = 64 its AR step took 533 µs (record f) against
    version 3's 496 µs (record e, an earlier call)."""
    return rank >= GEMM_FROM_RANK


def paths_unfused(rank: int) -> bool:
    """Whether the engine takes version 5: where R >= UNFUSED_FROM_RANK. Measured on the H200 at
    R = 512, against version 4 in the same runs: Kimi's attention 3x to 4.8x faster
    (bench-h200-2026-12-01e.md), small's graph replay at 16k context 8.8 -> 7.1 ms at T = 1 and
    127 -> 49 ms at T = 72 (profile-h200-2026-12-01g.md, first call). Not measured at tiny's R."""
    return rank >= UNFUSED_FROM_RANK


def paths_heads(heads: int) -> int:
    """G, the heads per block the engine takes: 4 when 4 divides H, else 1 (versions 1 and 2).
    Measured on the H200 (docs/results/profile-h200-2026-12-01b.md): G = 4 cut small's forward at
    16k context by a fifth (T = 1) to a third (T = 24 to 72) and tiny's T = 72 forward by 11%, at
    T = 1 level; G = 2 on tiny-b's 6 heads made its AR step 6% slower, so 2 is not chosen."""
    return 4 if heads % 4 == 0 else 1


def paths_heads_tile(rank: int, rope_dim: int, heads_per_block: int) -> int:
    """Keys per tile for G = ``heads_per_block``: versions 1 and 2 (G = 1) take ``paths_tile``;
    version 3 takes 32, else 16, else 8: the largest whose G queries and accumulators and staged
    keys fit SHARED_BUDGET (Kimi's R = 512, dr = 64 at G = 4: 8). Fixed by the model's
    dims and G, never by the call."""
    if heads_per_block == 1:
        return paths_tile(rank, rope_dim)
    for tile in (32, 16):
        if paths_shared_bytes(rank, rope_dim, tile, heads_per_block) <= SHARED_BUDGET:
            return tile
    return 8
# --8<-- [end:attention_paths]


def _absorb_query_cost(*, T: int, H: int, dn: int, R: int) -> tuple[int, int]:
    # q_nope (T, H, dn) and W_UK (H, dn, R) read once, q_lat (T, H, R) written once
    return F32 * (T * H * dn + H * dn * R + T * H * R), 2 * T * H * dn * R


def _attention_cost(*, T: int, H: int, R: int, dr: int, S: int, pairs: int) -> tuple[int, int]:
    # the S cache rows (R + dr) read once, q_lat | q_pe read and o_lat written once, the (T, T)
    # mask (a byte per entry); per visible (row, key) pair and head: a dot over R + dr for the
    # score and a multiply-add over R for the value
    return (F32 * (S * (R + dr) + T * H * (R + dr) + T * H * R) + T * T,
            2 * H * (2 * R + dr) * pairs)


def _absorb_output_cost(*, T: int, H: int, dv: int, R: int) -> tuple[int, int]:
    # o_lat (T, H, R) and W_UV (H, dv, R) read once, o (T, H, dv) written once
    return F32 * (T * H * R + H * dv * R + T * H * dv), 2 * T * H * dv * R


_COSTS = {"absorb_query": _absorb_query_cost, "attention_absorb": _attention_cost,
          "absorb_output": _absorb_output_cost}


def bytes_moved(operation: str = "attention_absorb", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once, float32). Dimensions by the glossary: "absorb_query" (T, H, dn, R), "attention_absorb"
    (T, H, R, dr, S, pairs: the (row, key) pairs a row sees, T * P plus the True entries of the
    (T, T) mask), "absorb_output" (T, H, dv, R). Every head re-reading the cache is not counted:
    at more bytes than this the rate is an effective one."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "attention_absorb", **dims: int) -> int:
    """Floating-point operations (a multiply-add counts 2; the softmax's exp is not counted),
    dimensions as in ``bytes_moved``."""
    return _COSTS[operation](**dims)[1]


def _attention_case(name: str, what: str, sizes, prefix: int, visible: np.ndarray):
    """attention_absorb for T rows seeing ``prefix`` cached keys plus ``visible`` (T, T) new ones."""
    from ddtree.rope import softmax_scale
    from kernels.bench import peers
    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    config, rows = sizes.config, visible.shape[0]
    heads, rank, rope_dim = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    keys, scale = prefix + rows, softmax_scale(config)                    # S cache rows
    dims = {"T": rows, "H": heads, "R": rank, "dr": rope_dim, "S": keys,
            "pairs": rows * prefix + int(visible.sum())}
    return Case(name, what, f"q ({rows}, {heads}, {rank}+{rope_dim}) cache ({keys}, {rank}+{rope_dim})",
                setup=lambda seed: (uniform((rows, heads, rank), seed),
                                    uniform((rows, heads, rope_dim), seed + 1),
                                    uniform((keys, rank), seed + 2), uniform((keys, rope_dim), seed + 3),
                                    prefix, cuda.to_device(visible), scale),
                call=lambda inputs, **given: attention_absorb(*inputs, **given),
                bytes=bytes_moved("attention_absorb", **dims), flops=flops("attention_absorb", **dims),
                note="version 0: the masked kernel (the engine runs attention_paths)",
                peer=lambda inputs: peers.attention(*inputs[:4], peers.prefix_mask(prefix, visible), scale))


# --8<-- [start:paths_cases]
def _paths_case(sizes, version: int, rows: int, heads: int, context: int, name: str):
    """attention_paths, ``version`` 1 to 5 with the engine's Z and G for it, for the ``rows``
    nodes of a draft tree (1: a decode row) over ``context`` cached keys, ``heads`` heads."""
    from ddtree.rope import softmax_scale
    from ddtree.tree import visibility
    from kernels.bench import peers
    from kernels.bench.case import Case, ancestor_paths, draft_tree, uniform  # lazily (see above)

    config = sizes.config
    rank, rope_dim, scale = config.kv_lora_rank, config.qk_rope_head_dim, softmax_scale(config)
    parents = np.array([-1]) if rows == 1 else draft_tree(np.random.default_rng(rows), sizes, rows).parents
    depths, paths = ancestor_paths(parents)                                   # [T], [T, max depth + 1]
    visible = visibility(parents)                                             # [T, T]
    keys = context + rows                                                     # S cache rows
    heads_per_block = paths_heads(heads) if version == 3 else 1               # G
    gemm, unfused = version == 4, version == 5
    splits = 1 if version in (1, 5) else paths_splits(keys, rank, rope_dim, heads_per_block, gemm)   # Z
    options = {"splits": splits, "heads_per_block": heads_per_block, "gemm": gemm, "unfused": unfused}
    chunks = unfused_chunks(keys) if unfused else splits                      # the partials' third axis

    def setup(seed):
        return (uniform((rows, heads, rank), seed), uniform((rows, heads, rope_dim), seed + 1),
                uniform((keys, rank), seed + 2), uniform((keys, rope_dim), seed + 3),
                cuda.to_device(np.array([context], np.int64)), cuda.to_device(depths),
                cuda.to_device(paths), scale)

    def prepare(inputs):                      # the buffers the engine keeps: out, partials (2-5), scores (5)
        partials = poisoned((rows, heads, chunks, rank + 2)) if version > 1 else None
        scores = poisoned((rows * heads, keys)) if unfused else None
        return poisoned((rows, heads, rank)), partials, scores

    dims = {"T": rows, "H": heads, "R": rank, "dr": rope_dim, "S": keys,
            "pairs": rows * context + int(visible.sum())}
    what = "1 decode row" if rows == 1 else f"a {rows}-node draft tree"
    return Case(name, f"{what}, {heads} heads, {context}-token context",
                f"q ({rows}, {heads}, {rank}+{rope_dim}) cache ({keys}, {rank}+{rope_dim})", setup=setup,
                call=lambda inputs, **given: attention_paths(*inputs, **options, **given),
                bytes=bytes_moved("attention_absorb", **dims), flops=flops("attention_absorb", **dims),
                note=f"version {version}: " + (f"{chunks} chunks of {UNFUSED_CHUNK}" if unfused
                                                 else f"Z={splits} " + (f"GH={gemm_heads(heads)}" if gemm
                                                                        else f"G={heads_per_block}")),
                prepare=prepare,
                launch=lambda inputs, given, stream: attention_paths(
                    *inputs, **options, partials=given[1], scores=given[2], out=given[0], stream=stream),
                peer=lambda inputs: peers.attention(*inputs[:4], peers.prefix_mask(context, visible), scale))


def paths_cases(sizes):
    """The engine's attention: versions 1 to 3 for a decode row at the short context; version 3 for
    a 16-node tree; versions 2 and 3 for a 64-node tree; version 3 at the long context and for one
    tensor-parallel rank's heads; version 4 (register-tiled) beside it; version 5 (unfused, the
    engine's from R = 512) at every shape of the issue's targets. (Versions 1 and 2 on a 16-node
    tree are in bench-h200-2026-12-01b.md and -c.md.)"""
    short, long = sizes.paths_contexts
    few, many = sizes.paths_trees
    every, rank = sizes.paths_heads
    plan = [(1, 1, every, short, "decode"), (2, 1, every, short, "decode"), (3, 1, every, short, "decode"),
            (3, 1, every, long, "decode_long"), (3, 1, rank, long, "decode_rank_long"),
            (3, few, every, short, "tree_few"), (2, many, every, short, "tree_many"),
            (3, many, every, short, "tree_many"), (3, many, rank, long, "tree_many_rank_long"),
            (4, 1, every, short, "decode"), (4, 1, every, long, "decode_long"),
            (4, many, every, short, "tree_many"), (4, many, rank, long, "tree_many_rank_long"),
            (5, 1, every, short, "decode"), (5, 1, every, long, "decode_long"),
            (5, 1, rank, long, "decode_rank_long"),
            (5, few, every, short, "tree_few"), (5, many, every, short, "tree_many"),
            (5, many, rank, long, "tree_many_rank_long")]
    return [_paths_case(sizes, version, rows, heads, context, f"paths_v{version}_{role}")
            for version, rows, heads, context, role in plan]
# --8<-- [end:paths_cases]


def _projection_cases(sizes, role: str, rows: int):
    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    config = sizes.config
    heads, nope, value = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    rank = config.kv_lora_rank
    query = {"T": rows, "H": heads, "dn": nope, "R": rank}
    output_dims = {"T": rows, "H": heads, "dv": value, "R": rank}
    return [
        Case(f"absorb_query_{role}", f"q_nope -> latent query, {rows} row(s)",
             f"q_nope ({rows}, {heads}, {nope}) W_UK ({heads}, {nope}, {rank})",
             setup=lambda seed: (uniform((rows, heads, nope), seed),
                                 uniform((heads, nope, rank), seed + 1, 1 / math.sqrt(nope))),
             call=lambda inputs, **given: absorb_query(*inputs, **given),
             bytes=bytes_moved("absorb_query", **query), flops=flops("absorb_query", **query)),
        Case(f"absorb_output_{role}", f"latent output -> per-head values, {rows} row(s)",
             f"o_lat ({rows}, {heads}, {rank}) W_UV ({heads}, {value}, {rank})",
             setup=lambda seed: (uniform((rows, heads, rank), seed),
                                 uniform((heads, value, rank), seed + 1, 1 / math.sqrt(rank))),
             call=lambda inputs, **given: absorb_output(*inputs, **given),
             bytes=bytes_moved("absorb_output", **output_dims), flops=flops("absorb_output", **output_dims)),
    ]


def bench_cases(sizes):
    """This module's cases of ``python -m kernels.bench``: decode and tree-verify attention with
    the masked kernel (version 0) and with ``attention_paths`` (``paths_cases``), the absorbed
    projections for one decode row and for a verified tree."""
    from ddtree.tree import visibility
    from kernels.bench.case import verified_tree  # lazily: kernels.bench imports this module

    tree = verified_tree(sizes)
    short = sizes.decode_prefix
    decode = np.ones((1, 1), bool)
    cases = [
        _attention_case("attention_decode_short", f"absorbed MLA, 1 decode row, {short}-token context",
                        sizes, short, decode),
        _attention_case("attention_verify", f"verify a {tree.size}-node draft tree over a "
                        f"{sizes.verify_prefix}-token context", sizes, sizes.verify_prefix,
                        visibility(tree.parents)),
    ]
    cases += paths_cases(sizes)
    for role, rows in (("decode", 1), ("verify", sizes.rows)):
        cases += _projection_cases(sizes, role, rows)
    return cases
