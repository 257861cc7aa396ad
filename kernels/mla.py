"""Multi-head latent attention (MLA), absorbed form: the numba.cuda twin of ``ddtree/mla.py``.

Legend: T new rows, P fully visible prefix rows, S = P + T keys, H heads, dn qk_nope_head_dim,
dr qk_rope_head_dim, dv v_head_dim, R kv_lora_rank, C the cache's capacity, TPB threads per block.

Kernels:
- ``absorb_query_kernel``: q_lat = W_UK^T q_nope, a thread per latent column and slice of dn.
- ``attention_absorb_kernel``: masked softmax attention over the latent cache, one block per
  (row, head), an online softmax over tiles of one key per thread: the readable version
  (chapter 3), the twin of the reference's ``attention_absorb``.
- ``attention_paths`` (the engine's attention): each row attends to the prefix and its own path
  (``paths``) in position order, in tiles at fixed positions, the prefix length read from a
  device array; a tree row's result is bit-identical to the AR row at the same position. Its
  versions, chosen per engine by ``paths_plan`` (a ``PathsPlan``):
  1. ``attention_paths_kernel``: one block per (row, head) walks every tile.
  2. ``attention_split_kernel`` + ``attention_merge_kernel``: the tiles dealt round-robin to Z
     blocks per (row, head), whose partial softmaxes are merged in split order.
  3. ``attention_heads_kernel`` (+ the merge): a block per (G heads, row, split), each tile
     staged once for its G heads (MLA's heads share the latent cache), a warp per head.
  5. unfused (``kernels/mla_unfused.py``, + the merge): every row's scores as one GEMM, the
     softmax's statistics, P V as a second GEMM over chunks at fixed positions.
  (Version 4, a register-tiled fused kernel, is in ``lab/attention/``.)
- ``absorb_output``: o = W_UV o_lat, ``kernels.linear``'s "lanes" kernel with a group per head.

Only the absorbed form has kernels: the reference's ``attention_naive`` is there to prove the
absorption exact (chapter 3). Inputs are numpy arrays (the results come back as numpy) or numba
device arrays (the results stay on the device); masks are checked by ``_check_mask``. Cost models
and benchmark cases are in ``kernels/bench/cases/mla.py``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

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
    to_device,
)
from kernels.linear import ROWS_PER_PASS, index, lanes_launch, pass_rows, row_passes
from kernels.mla_unfused import LANES, UNFUSED_CHUNK, unfused_chunks, unfused_partials
from kernels.rope import check_rope, rotated
from kernels.tuning import GROUPED_HEADS, MAX_SPLITS, SHARED_BUDGET, SPLIT_TILES, UNFUSED_FROM_RANK

# attention_paths' threads on a GPU: 4x its 32-key tiles, so that one decode row's few blocks keep
# enough loads in flight (with 32 threads, each thread's serial loads leave the GPU idle)
PATHS_THREADS = 128
STAGE_BATCH = 8         # attention_paths: cache loads a thread issues before it stores them
MAX_TILE = MAX_TPB       # largest attention block: keys per tile = TPB; the size of p and red
DOT_PARTS = 32           # attention_paths: a key's score is summed in 32 strided parts, in parallel
DOT_STRIDE = DOT_PARTS + 1    # a key's parts in shared memory (+1: the parts' readers hit distinct banks)
HEADS_PER_BLOCK = (1, 2, 4)   # version 3's G (1: versions 1 and 2), G * LANES <= MAX_TPB threads
# version 3's registers per thread: 3 blocks of 128 threads fit an SM's 64K (allocated 8 at a time)
HEADS_MAX_REGISTERS = 168
MERGE_BATCH = 4 if SIMULATOR else 8          # the merge: splits' loads a thread issues before it adds them
ABSORB_BATCH = 8               # absorb_query: W_UK loads a thread issues before it adds them
ABSORB_LANES = 8 if SIMULATOR else 32   # ... latent columns r per block (a thread each)
ABSORB_SLICES = 2 if SIMULATOR else 8   # ... and dn's slices of consecutive n (a thread each)
F32 = 4


# --8<-- [start:absorb_query_kernel]
@functools.cache
def absorb_query_kernel(per_pass: int = ROWS_PER_PASS, rope: bool = False):
    """The absorb_query kernel for passes of ``per_pass`` rows (a literal: the pass's sums and
    queries live in registers). A decode row's launch takes passes of one (``pass_rows``): a pass
    of 8 would load its one query 8 times and add 8 rows' products. Each row's sums are the same.
    With ``rope`` the kernel also rotates the queries' rope columns in place (``rope_query``): the
    engine's rotation without a launch of its own."""
    sums_shape = (per_pass, ABSORB_SLICES, ABSORB_LANES)            # the slices' sums of a pass's rows

    @cuda.jit(device=True)
    def absorb(q_nope, w_uk, q_lat):
        """q_lat[t, h, r] = sum_n q_nope[t, h, n] * W_UK[h, n, r].

        Block (x, head, y): latent columns r = x LANES + lane (threadIdx.x: consecutive r, so a warp's loads
        of a W_UK row are coalesced), dn cut into ABSORB_SLICES slices of consecutive n (threadIdx.y = s:
        slice s, its n in order), for the passes of PASS rows y, y + gridDim.z, ... Each thread issues
        ABSORB_BATCH loads of W_UK, and the same n of the pass's rows' queries, before it adds their products
        to all of the pass's rows; then the slices' sums meet in shared memory and thread (lane, s) adds those
        of rows s, s + ABSORB_SLICES, ... in slice order. The slices depend on dn only, so a row's sum does
        not depend on the rows beside it.
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

    if not rope:
        @cuda.jit
        def absorb_query_kernel(q_nope, w_uk, q_lat):
            """``absorb``: one launch of the absorbed queries."""
            absorb(q_nope, w_uk, q_lat)

        return absorb_query_kernel

    @cuda.jit
    def absorb_query_rope_kernel(q_nope, w_uk, q_lat, q_pe, positions, inv_freq, scale):
        """``absorb``, then the blocks of latent columns 0 (one per head) rotate their head's rope
        columns: the queries' rope columns, which ``absorb`` never reads."""
        absorb(q_nope, w_uk, q_lat)
        if cuda.blockIdx.x == 0 and cuda.blockIdx.z == 0:          # block (0, head, 0): the head's rope
            rope_query(q_pe, positions, inv_freq, scale, cuda.blockIdx.y)   # columns of every row

    return absorb_query_rope_kernel


@cuda.jit(device=True)
def rope_query(q_pe, positions, inv_freq, scale, head):
    """q_pe[t, head] rotated in place at positions[t] for every row t (a block's threads over its
    (row, pair) entries): ``rotated``, the device function of ``apply_rope``'s kernels, so the bits
    are apply_rope's. Nothing else reads or writes these columns in the launch."""
    half = q_pe.shape[2] // 2
    threads = cuda.blockDim.x * cuda.blockDim.y
    tid = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    for at in range(tid, q_pe.shape[0] * half, threads):
        t, i = at // half, at % half
        first, second = q_pe[t, head, i], q_pe[t, head, i + half]
        q_pe[t, head, i], q_pe[t, head, i + half] = rotated(first, second, positions[t], inv_freq[i], scale)
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

    Online softmax over tiles of TPB keys: in each tile, thread j scores key start + j (``_score``), the block
    reduces the tile's max and (after rescaling to the new running max) its sum of exp, and ``_accumulate``
    updates the accumulator: acc[r] = acc[r] * alpha + sum_j p_j c_j[r]. A tile-at-a-time loop keeps shared
    memory independent of the context length (a whole score row would need S floats).

    Masked keys are skipped, never computed with: their score is not formed, their
    probability is exactly 0 and their cache row is never read (it may even hold NaN). A tile
    without a visible key is skipped whole. Every row sees at least one key (checked on the
    host), so the running sum ends >= 1: no division by zero, no exp of -inf arithmetic.

    Shared memory: dynamic (2R + dr floats) = the query q_lat | q_pe (R + dr) and the output accumulator (R);
    static: p (the tile's probabilities) and red (reduction scratch), TPB floats each.
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
def absorb_query(q_nope, w_uk, *, out=None, stream=None, rope=None):
    """q_nope (T, H, dn), W_UK (H, dn, R) -> q_lat (T, H, R). ``rope`` = (q_pe, positions, inv_freq,
    scale): the same launch also rotates q_pe (T, H, dr), a device array, in place, with
    ``apply_rope``'s bits (the engine's queries: one launch a layer fewer)."""
    q_nope, w_uk = check_absorb_query(q_nope, w_uk, out=out)
    (rows, heads, _), rank = q_nope.shape, w_uk.shape[2]
    rotation = check_rope_query(rope, rows, heads)
    d_out = output(out, (rows, heads, rank), stream=stream)                 # [T, H, R]
    if rows * heads * rank:
        per_pass = pass_rows(rows)
        grid = (blocks(rank, ABSORB_LANES), heads, row_passes(rows, per_pass))
        kernel = absorb_query_kernel(per_pass, rotation is not None)
        arrays = (to_device(q_nope, np.float32), to_device(w_uk, np.float32), d_out)
        kernel[grid, (ABSORB_LANES, ABSORB_SLICES), stream](*arrays, *(rotation or ()))
    return deliver(d_out, out, q_nope, w_uk)
# --8<-- [end:absorb_query]


def check_rope_query(rope, rows: int, heads: int):
    """``absorb_query``'s ``rope``: None, or (q_pe, positions, inv_freq, scale) with q_pe a float32 device
    array (T, H, dr) of the queries' T and H, as ``apply_rope`` takes them; returns the kernel's arguments."""
    if rope is None:
        return None
    if not isinstance(rope, tuple) or len(rope) != 4:
        raise ValueError("rope must be None or a tuple (q_pe, positions, inv_freq, scale), "
                         f"got {type(rope).__name__}")
    q_pe, positions, inv_freq, scale = rope
    if not is_device_array(q_pe):
        raise ValueError(f"rope's q_pe must be a device array (rotated in place), got {type(q_pe).__name__}")
    if q_pe.ndim != 3 or tuple(q_pe.shape[:2]) != (rows, heads):
        raise ValueError(f"rope's q_pe must have shape ({rows}, {heads}, dr) (q_nope's T and H), "
                         f"got {tuple(q_pe.shape)}")
    q_pe, positions, inv_freq = check_rope(q_pe, positions, inv_freq, scale, out=q_pe)
    return q_pe, to_device(positions), to_device(inv_freq, np.float32), float(scale)


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

    q_lat (T, H, R), q_pe (T, H, dr) rotated; cache_latent (>=S, R) and cache_rope (>=S, dr) hold the prefix
    in rows [0, P) and the new rows in [P, P+T). Returns o_lat (T, H, R). ``threads`` (32, 64 or 128) is the
    block size, which is also the key tile; by default the smallest that covers the S keys. ``out`` receives
    the result; ``stream`` is where the kernel is launched (None: the default stream).
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
    """Version 1: one block computes o_lat[row, head, :] (R) over the row's own keys, in position order.

    The keys of row i are the prefix (slots 0 .. P-1, P = prefix[0]) and then its path root..i,
    at slots P + paths[i, 0..depths[i]]: S_i = P + depths[i] + 1 keys, enumerated by position.
    Tiles of ``tile`` keys start at fixed positions, so a tree node and the AR step at the same
    position combine the same keys in the same tiles: bit-identical outputs. Masked keys are never
    enumerated (no -inf arithmetic, no reads of other branches' rows).

    Per tile (``_fold_row``) the block's TPB >= tile threads stage the tile's key rows in shared
    memory (``_stage_tile``; more threads than keys: more loads in flight, which one row's few
    blocks need), then fold them into the running softmax (``_fold_tile``): the cache is read once
    per (row, head). Shared memory (dynamic): the query (R + dr), the accumulator (R), the score
    parts (tile x DOT_STRIDE) and the tile's keys (tile x (R + dr + 1); the +1 staggers rows across
    banks); static: p, red (TPB floats) and the tile's slots. The reductions run over all TPB
    entries, the ones past the tile neutral (-inf, 0): every max and sum is a tile-wide tree's.
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
            flat = min(base + b * threads + tid, total - 1)
            key, column = flat // width, flat % width
            staged[b] = cache_latent[slots[key], column] if column < rank \
                else cache_rope[slots[key], column - rank]
        for b in range(STAGE_BATCH):
            flat = base + b * threads + tid
            if flat < total:
                tile_keys[(flat // width) * (width + 1) + flat % width] = staged[b]
    cuda.syncthreads()


@cuda.jit(device=True)
def score_parts(tile):
    """Floats of a head's score parts in shared memory: [tile, DOT_STRIDE] for a tile shorter than
    LANES, none for longer ones (``_tile_score``). Called on the host as ``score_parts.py_func``."""
    return tile * DOT_STRIDE if tile < LANES else 0


@cuda.jit(device=True)
def _tile_score(query, tile_keys, dots, tile, count, scale, lane, segment):
    """Lane j's score of key j of the tile (a float32 dot over R + dr), or 0 past the tile.

    A tile of LANES keys or more gives every lane of a warp a key: lane j runs key j's products alone. A
    shorter tile (R = 512 leaves room for 8 or 16 keys) would leave most lanes idle while a few run R + dr
    dependent products, so the segment shares the work: part j of key k sums query[i] * key[i] for i = j,
    j + DOT_PARTS, ... in order (job k * DOT_PARTS + j; the threads stride over the jobs) into dots[k, j],
    then lane k adds its key's parts in order. Either way the sums depend on the tile alone
    (fixed by the model's dims), never on the segment's size or the rows: every version scores a key alike."""
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
    folds the row's tiles z, z + Z, z + 2Z, ... (version 1's tiles, dealt round-robin) into its own
    running softmax, left unnormalised in partials[row, head, z] = (acc[0..R-1], run_max, run_sum);
    ``attention_merge_kernel`` adds the Z partials in split order. A decode row keeps Z times more
    of the GPU busy; a split whose first tile lies past the row's keys does nothing (the merge
    skips it by the same rule). Which split gets a tile depends only on its position and Z, so a
    tree row still equals its AR row, bit for bit. Shared memory as version 1."""
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
    """One block per (head, row), a thread per latent column r (MERGE_THREADS on a GPU: Kimi's 512 columns one
    each): the splits that had keys (z * tile < S_i) combined in split order, each rescaled to the largest
    running max: o = sum_z acc_z e^(m_z - M) / sum_z s_z e^(m_z - M). Each loop issues MERGE_BATCH splits'
    loads before it adds them (in order), so a decode row's merge does not wait on one load at a time
    (version 5 merges up to hundreds of chunks). Thread 0 finds M and the denominator once for the block:
    every thread doing it would repeat the splits' loads R times."""
    head = index(cuda.blockIdx.x)                         # every index below is >= 0 (``index``)
    row = index(cuda.blockIdx.y)
    rank = o_lat.shape[2]
    keys = index(prefix[0]) + index(depths[row]) + 1
    used = min(partials.shape[2], (keys + tile - 1) // tile)
    staged = cuda.local.array(MERGE_BATCH, float32)
    weights = cuda.local.array(MERGE_BATCH, float32)
    shared = cuda.shared.array(2, float32)                # the largest max M and the total, thread 0's
    if cuda.threadIdx.x == 0:
        top = partials[row, head, 0, rank]
        for z0 in range(0, used, MERGE_BATCH):
            for b in range(MERGE_BATCH):
                staged[b] = partials[row, head, index(min(z0 + b, used - 1)), rank]
            for b in range(MERGE_BATCH):
                top = max(top, staged[b])                 # past used: split used - 1 again (max is exact)
        total = float32(0.0)
        for z0 in range(0, used, MERGE_BATCH):
            for b in range(MERGE_BATCH):
                z = index(min(z0 + b, used - 1))
                staged[b] = partials[row, head, z, rank + 1]
                weights[b] = partials[row, head, z, rank]
            for b in range(min(MERGE_BATCH, used - z0)):
                total += staged[b] * math.exp(weights[b] - top)
        shared[0] = top
        shared[1] = total
    cuda.syncthreads()
    top, total = shared[0], shared[1]
    for i in range(index(cuda.threadIdx.x), rank, index(cuda.blockDim.x)):
        value = float32(0.0)
        for z0 in range(0, used, MERGE_BATCH):
            for b in range(MERGE_BATCH):
                z = index(min(z0 + b, used - 1))
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
    warps, grid (H / G, T, Z); warp g serves head x * G + g. Per tile the whole block stages the
    tile's keys once (``_stage_tile``), then each warp folds them into its own head's running
    softmax (``_fold_tile`` with segment = LANES: lane j holds key j's score, the max and sum reduce
    over the warp's 32 slots, lanes stride over R): H / G stagings of each tile per row, not H.

    Tiles and splits as version 2 (partials[row, head, z], merged by ``attention_merge_kernel``, even for
    Z = 1). A head's sums depend on its own keys, the tile and Z only, never on G: a tree row still equals its
    AR row bit for bit. Shared memory (dynamic): G queries (R + dr) and accumulators (R), G heads' score
    parts, then the tile's keys (tile x (R + dr + 1)); static: p, red (MAX_TPB floats), slots (MAX_TILE ints).
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


# --8<-- [start:attention_paths]
class PathsPlan(NamedTuple):
    """How ``attention_paths`` cuts its work: Z splits of a row's key tiles, G heads per block, or
    version 5's unfused GEMMs. A plan sets the order of the sums, so an engine fixes one from its
    dims and its cache's capacity (``paths_plan``): every row of every step then adds its keys
    alike, and a tree row equals the AR row at its position, bit for bit."""
    splits: int = 1              # Z: blocks sharing one (row, head)'s key tiles (version 2 where > 1)
    heads_per_block: int = 1     # G: heads whose block stages each tile once (version 3 where > 1)
    unfused: bool = False        # version 5 (kernels/mla_unfused.py); Z = G = 1

    @property
    def version(self) -> int:
        """1, 2, 3 or 5 (the module docstring's list)."""
        return 5 if self.unfused else 3 if self.heads_per_block > 1 else 2 if self.splits > 1 else 1

    def partial_groups(self, capacity: int) -> int:
        """The partials' third axis for a cache of ``capacity`` slots: Z, or version 5's chunks;
        0 for version 1, which writes its output directly."""
        if self.unfused:
            return unfused_chunks(capacity)
        return 0 if self.version == 1 else self.splits


def paths_plan(heads: int, rank: int, rope_dim: int, capacity: int) -> PathsPlan:
    """The engine's plan for H = ``heads``, R = ``rank``, dr = ``rope_dim`` and a cache of
    ``capacity`` slots (``attention_paths``' default): version 5 from R = UNFUSED_FROM_RANK on;
    else G = GROUPED_HEADS heads per block where they divide H (version 3), else one (versions 1
    and 2), and Z from the cache's size (``paths_splits``)."""
    if rank >= UNFUSED_FROM_RANK:
        return PathsPlan(unfused=True)
    group = GROUPED_HEADS if heads % GROUPED_HEADS == 0 else 1
    return PathsPlan(paths_splits(capacity, rank, rope_dim, group), group)


def attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, *, plan=None,
                    scores=None, partials=None, out=None, stream=None):
    """Absorbed attention of each row over the prefix and its own path.

    q_lat (T, H, R), q_pe (T, H, dr); the cache (C, R), (C, dr); prefix (1,) = P; depths (T,) and paths
    (T, >= max depth + 1): row i sees slots 0 .. P-1, then P + paths[i, d] for d = 0 .. depths[i]. Returns
    o_lat (T, H, R): ``ddtree.mla.attention_paths``, which equals ``attention_absorb`` with the tree's
    ancestor mask; its sums depend on the plan (their order), never on the other rows. ``plan`` (a
    ``PathsPlan``; None: ``paths_plan`` for these dims and C, what the engine runs) picks the version.
    Versions 2, 3 and 5 write a partial softmax per split (or chunk) into ``partials`` (T, H,
    ``plan.partial_groups(C)``, R + 2) and merge them; version 5 first writes every row's scores into
    ``scores`` (T H, C); both are allocated when not given.
    """
    q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths = check_attention_paths(
        q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, out=out)
    (rows, heads, rank), rope_dim, capacity = q_lat.shape, q_pe.shape[2], cache_latent.shape[0]
    plan = paths_plan(heads, rank, rope_dim, capacity) if plan is None else check_plan(plan, heads)
    arrays = tuple(to_device(a) for a in (q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths))
    d_out = output(out, (rows, heads, rank), stream=stream)                 # [T, H, R]
    if plan.unfused:                                                        # version 5
        partials = unfused_partials(*arrays, scale, scores=scores, partials=partials, stream=stream)
        tile = UNFUSED_CHUNK
    else:
        tile = paths_heads_tile(rank, rope_dim, plan.heads_per_block)
        partials = _launch_paths(arrays, scale, plan, tile, partials, d_out, stream)
    if partials is not None:                                                # versions 2, 3 and 5
        attention_merge_kernel[(heads, rows), merge_threads(rank), stream](
            partials, arrays[4], arrays[5], tile, d_out)
    return deliver(d_out, out, q_lat, q_pe, cache_latent, cache_rope)


def _launch_paths(arrays, scale, plan, tile, partials, d_out, stream):
    """Versions 1 to 3: version 1 writes ``d_out``; 2 and 3 write ``partials`` (returned)."""
    q_lat, q_pe = arrays[:2]
    (rows, heads, rank), rope_dim = q_lat.shape, q_pe.shape[2]
    shared = paths_shared_bytes(rank, rope_dim, tile, plan.heads_per_block)
    threads = tile if SIMULATOR else PATHS_THREADS                          # versions 1 and 2
    args = (*arrays, np.float32(scale), tile)
    if plan.version == 1:
        attention_paths_kernel[(heads, rows), threads, stream, shared](*args, d_out)
        return None
    shape = (rows, heads, plan.splits, rank + 2)                            # [T, H, Z, R + 2]
    check_out(partials, shape, name="partials")
    partials = output(partials, shape, stream=stream)
    if plan.heads_per_block == 1:                                           # version 2
        attention_split_kernel[(heads, rows, plan.splits), threads, stream, shared](*args, partials)
    else:                                                                   # version 3: G warps
        group = plan.heads_per_block
        attention_heads_kernel[(heads // group, rows, plan.splits), group * LANES, stream, shared](
            *args, partials)
    return partials


def paths_splits(capacity: int, rank: int, rope_dim: int, heads_per_block: int = 1) -> int:
    """Z for a cache of ``capacity`` keys: the power of two that leaves each split at most
    SPLIT_TILES tiles (of ``paths_heads_tile``) of a full cache, in [1, MAX_SPLITS]. Fixed by the
    engine's sizes, never by the call, so every row of every step splits its keys the same way."""
    tiles = -(-capacity // paths_heads_tile(rank, rope_dim, heads_per_block))
    splits = 1
    while splits < MAX_SPLITS and splits * SPLIT_TILES < tiles:
        splits *= 2
    return splits


def paths_tile(rank: int, rope_dim: int) -> int:
    """Keys per tile of versions 1 and 2: 32, or 16 when 32 staged rows of R + dr floats would pass
    SHARED_BUDGET (48 KB is numba's limit; the static p, red and slots take 1.5 KB). Fixed by the model's dims
    alone, never by the call, so tiles sit at the same positions for every row count."""
    return 32 if paths_shared_bytes(rank, rope_dim, 32) <= SHARED_BUDGET else 16


def paths_heads_tile(rank: int, rope_dim: int, heads_per_block: int) -> int:
    """Keys per tile for G = ``heads_per_block``: versions 1 and 2 (G = 1) take ``paths_tile``; version 3
    takes 32, else 16, else 8: the largest whose G queries and accumulators and staged keys fit SHARED_BUDGET
    (Kimi's R = 512, dr = 64 at G = 4: 8). Fixed by the model's dims and G, never by the call."""
    if heads_per_block == 1:
        return paths_tile(rank, rope_dim)
    for tile in (32, 16):
        if paths_shared_bytes(rank, rope_dim, tile, heads_per_block) <= SHARED_BUDGET:
            return tile
    return 8


def paths_shared_bytes(rank: int, rope_dim: int, tile: int, heads_per_block: int = 1) -> int:
    """Dynamic shared memory of versions 1 to 3: a query, an accumulator and the score parts of a tile per
    head of the block (G = ``heads_per_block``; 1 in versions 1 and 2), then the staged keys."""
    width = rank + rope_dim
    return F32 * (heads_per_block * (width + rank + score_parts.py_func(tile)) + tile * (width + 1))


def merge_threads(rank: int) -> int:
    """The merge's threads for R latent columns: whole warps, one column each up to 512 on a GPU
    (the simulator's 128 at most keeps it quick)."""
    return row_threads(rank, MAX_TPB if SIMULATOR else 512)


def check_attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, *, out=None):
    """Shapes and dtypes (host or device arrays), and out (T, H, R). Returns the arrays, floats as
    float32 and a host prefix (an int or a (1,) array) as a (1,) int64 array."""
    q_lat, q_pe = host_or_device(q_lat, np.float32), host_or_device(q_pe, np.float32)
    cache_latent = host_or_device(cache_latent, np.float32)
    cache_rope = host_or_device(cache_rope, np.float32)
    prefix = prefix if is_device_array(prefix) else np.asarray(prefix, np.int64).reshape(-1)
    depths, paths = host_or_device(depths, np.int64), host_or_device(paths, np.int64)
    if len(q_lat.shape) != 3:
        raise ValueError(f"q_lat must be (T, H, R), got shape {tuple(q_lat.shape)}")
    rows, heads, rank = q_lat.shape
    if len(q_pe.shape) != 3 or q_pe.shape[:2] != (rows, heads) or cache_latent.shape[1:] != (rank,) \
            or cache_rope.shape[1:] != (q_pe.shape[2],) or cache_latent.shape[0] != cache_rope.shape[0]:
        raise ValueError(f"q_pe (T, H, dr), cache_latent (C, R) and cache_rope (C, dr) must match "
                         f"q_lat {q_lat.shape}, got {q_pe.shape}, {cache_latent.shape}, {cache_rope.shape}")
    if prefix.shape != (1,) or depths.shape != (rows,) or len(paths.shape) != 2 or paths.shape[0] != rows:
        raise ValueError(f"prefix must be (1,), depths ({rows},) and paths ({rows}, >= max depth + 1), "
                         f"got {prefix.shape}, {depths.shape}, {paths.shape}")
    check_float32(q_lat=q_lat, q_pe=q_pe, cache_latent=cache_latent, cache_rope=cache_rope)
    check_out(out, q_lat.shape)
    return q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths


def check_plan(plan, heads: int) -> PathsPlan:
    """A caller's plan: a ``PathsPlan`` whose Z is in [1, MAX_SPLITS], whose G is 1, 2 or 4 and
    divides the H heads, and whose version 5 leaves Z = G = 1 (it chunks its keys itself)."""
    if not isinstance(plan, PathsPlan):
        raise ValueError(f"plan must be a kernels.mla.PathsPlan, got {plan!r}")
    splits, group, unfused = plan
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be an integer in [1, {MAX_SPLITS}], got {splits!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group not in HEADS_PER_BLOCK or heads % group:
        raise ValueError(f"heads_per_block must be 1, 2 or 4 and divide the number of heads ({heads}), "
                         f"got {group!r}")
    if not isinstance(unfused, bool):
        raise ValueError(f"unfused must be True or False, got {unfused!r}")
    if unfused and (splits, group) != (1, 1):
        raise ValueError(f"unfused=True takes splits=1 and heads_per_block=1 (version 5 chunks its keys "
                         f"itself), got splits={splits!r}, heads_per_block={group!r}")
    return plan
# --8<-- [end:attention_paths]
