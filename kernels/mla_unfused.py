"""Version 5 of ``kernels.mla.attention_paths``, unfused: the engine's attention where R >=
``kernels.tuning.UNFUSED_FROM_RANK`` (small, Kimi). ``kernels/mla.py`` calls ``unfused_partials``,
then merges the partials as in versions 2 and 3.

Legend: T new rows, P fully visible prefix rows, H heads, dr qk_rope_head_dim, R kv_lora_rank,
C the cache's capacity (slots), TPB threads per block.

Four kernels, each simple and batched over every row (no online softmax, no per-row staging of the prefix):

1. ``attention_scores_kernel`` (``scores_kernel``; a decode row or a few: ``attention_row_scores_kernel``,
   the same bits): every query row's scores against every slot below P + T, a GEMM into ``scores`` (T H, C).
2. ``attention_stats_kernel``: each (row, head)'s largest score M and each chunk's sum of exp(s - M).
3. ``attention_values_kernel``: P V for the chunks wholly inside the prefix, a second GEMM.
4. ``attention_tail_kernel`` (``tail_kernel``): the chunks from the one holding position P to the
   row's own, whose keys are the row's path, term for term the sums step 3 gives a prefix chunk.

Every chunk's maximum is M, so the merge rescales by e^0 = 1, and a tree row at position p adds
the same terms in the same order as the chain row at p: bit-identical (the tests check it with
the prefix two keys short of a chunk's end, where the tail and the GEMM meet). No launch shape
(``scores_shape``, ``tail_shape``, ``stats_threads``, ``row_blocks``) changes a sum. The scratch is
the price: T H C floats of scores and T H ceil(C / UNFUSED_CHUNK) (R + 2) of partials.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32  # the package __init__ has already chosen GPU or simulator

from kernels.blocks import block_max, blocks
from kernels.device import SIMULATOR, check_out, output
from kernels.linear import index
from kernels.tuning import (
    ROW_BLOCKS_PER_SM,
    ROW_SCORES_KEYS,
    ROW_STAGED_SCORES_KEYS,
    SHARED_BUDGET,
    STATS_FEW_FROM_BLOCKS_PER_SM,
    TAIL_MANY_ROWS,
    sm_count,
)

LANES = 32                                     # a warp: the statistics' lanes per chunk
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
ROW_THREADS = 16 if SIMULATOR else 256        # ... threads per block: KT keys x THREADS / KT queries at once
ROW_LOADS = 32                                # ... loads a thread issues before their adds (all its queries')
ROW_QUERIES = 4                               # ... and at most this many queries a thread adds side by side
ROW_STAGED_KEYS = 2                           # ... keys per tile where the queries are staged beside them
ROW_STAGED_LOADS = 36                         # ... and a thread's loads of them in flight at most
ALL_KEYS = np.int64(2**62)                    # a kernel's key bound that every context is under
NO_KEYS = np.int64(-1)                        # ... and one that every context is past
UNFUSED_CHUNK = 16 if SIMULATOR else 256       # keys per P V chunk: chunks at fixed positions, a partial each
UNFUSED_TAIL_BATCH = 4 if SIMULATOR else 16   # the tail kernel: cache loads a thread issues before its adds
# ... its (heads, output columns (a thread per column), BATCH) per block for one row, a few and many
# (``tail_shape``)
UNFUSED_TAIL_ONE = (1, 8, 2 * UNFUSED_TAIL_BATCH) if SIMULATOR else (1, 64, UNFUSED_TAIL_BATCH)
UNFUSED_TAIL_FEW = (2, 8 if SIMULATOR else 128, UNFUSED_TAIL_BATCH)
UNFUSED_TAIL_MANY = (4 if SIMULATOR else 8, 8 if SIMULATOR else 128, UNFUSED_TAIL_BATCH)
UNFUSED_STATS_THREADS = 32 if SIMULATOR else 512   # the statistics' most threads (a decode row's few blocks)
UNFUSED_STATS_FEW = 32 if SIMULATOR else 128       # ... and their threads where blocks are many
UNFUSED_LANE_KEYS = max(1, UNFUSED_CHUNK // LANES)  # the statistics: a lane's keys of a chunk (a warp's)
UNFUSED_STATS_LANE_SUMS = (UNFUSED_STATS_THREADS // LANES, LANES)   # ... and its warps' lane sums
F32 = 4

# indices ``kernels.linear.non_negative`` on a GPU (float4 shared reads need the compiler to know an
# index is not negative), as they are in the simulator (``kernels.linear.index``)
non_negative = index


# --8<-- [start:attention_unfused_kernels]
@cuda.jit(device=True)
def _key_slot(n_prefix, paths, row, position):
    """The cache slot of ``row``'s key at ``position``: a prefix key's own slot, then the nodes of
    the row's path (tree node m sits at slot P + m)."""
    return position if position < n_prefix else n_prefix + paths[row, index(position - n_prefix)]


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
    """The device function load(q_lat, q_pe, cache_latent, cache_rope, q_rows, q_heads, slots, keys, column,
    a_next, b_next): column ``column`` of the thread's ``query_loads`` query rows (q_rows[p] < 0: past the
    last query) into a_next and of its ``key_loads`` cache slots (past ``keys``: none) into b_next, 0 where
    there is none or the column lies past R + dr (a padded term adds nothing)."""
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
    def attention_scores_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores, fewest_keys):
        """scores[q, s] = scale * (q_lat | q_pe)[q] . (cache_latent | cache_rope)[s] for every
        query row q = row * H + head and every slot s < P + T (the prefix and the whole tree; the
        mask is the next steps' business), a register-tiled GEMM; nothing while P + T <= ``fewest_keys``
        (the row kernel's contexts where it is launched beside it, ``score_launches``).

        Block (x, y) computes the QT x KT scores of queries y QT .. and slots x KT ..; the grid covers the
        cache's capacity and a block past P + T (P read on the device) returns at once, so one launch shape
        serves every step. Thread (ty, tx) holds the TQ x TK scores of queries TQ ty + i and slots TK tx + j
        in registers. Per step the block stages STEP columns of both operands k-major in shared memory: a
        thread loads column tid % STEP of rows LOAD_ROWS apart (consecutive threads read consecutive columns
        of a row), two buffers, the next step's loads waiting in registers while this step's products run. A
        score adds its R + dr terms one at a time in column order whatever the launch, the tiles, the rows or
        the tree: batch-invariant.
        """
        tid = non_negative(cuda.threadIdx.x)
        ty, tx = tid // side, tid % side
        rows, heads, rank = q_lat.shape
        width = rank + q_pe.shape[2]
        keys = prefix[0] + rows
        q0 = non_negative(cuda.blockIdx.y) * query_tile
        s0 = non_negative(cuda.blockIdx.x) * key_tile
        if s0 >= keys or keys <= fewest_keys:             # the whole block: past the last key, or the
            return                                        # row kernel's context
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
    mostly empty), else WIDE. Every shape gives the same bits. (A decode row and a few take
    ``row_scores_kernel`` where its tile fits: ``row_scores``.)"""
    return UNFUSED_NARROW if queries <= UNFUSED_NARROW[0] else UNFUSED_WIDE


@functools.cache
def row_dots(unroll: int, queries: int, staged: bool = False):
    """The device function dots(acc, q, q_rows, q_heads, tile, first, count): for each i <
    ``queries``, acc[i] plus q[q_rows[i], q_heads[i], c] * tile[first + c] for c = 0 .. ``count`` - 1,
    added in order: runs of ``unroll`` columns (a literal: registers) with their loads issued before
    their adds, the queries side by side (each key value loaded once feeds them all, and their
    chains overlap), then the last columns one by one. (Each run's offsets are constants from one
    index, which the compiler then folds into the loads.) With ``staged`` the queries are in the
    tile too: query i's column c is tile[q_rows[i] + c] (q and q_heads unread)."""

    @cuda.jit(device=True)
    def query(q, q_rows, q_heads, tile, i, column):
        if staged:
            return tile[index(q_rows[i]) + column]
        return q[index(q_rows[i]), index(q_heads[i]), column]

    @cuda.jit(device=True)
    def dots(acc, q, q_rows, q_heads, tile, first, count):
        keys = cuda.local.array(unroll, float32)
        values = cuda.local.array((queries, unroll), float32)
        whole = count // unroll * unroll
        for c0 in range(0, whole, unroll):
            at = index(c0)
            key_at = index(first + c0)
            for u in range(unroll):
                keys[u] = tile[key_at + u]
            for i in range(queries):
                for u in range(unroll):
                    values[i, u] = query(q, q_rows, q_heads, tile, i, at + u)
            for u in range(unroll):
                for i in range(queries):
                    acc[i] += values[i, u] * keys[u]
        for column in range(whole, count):
            key = tile[index(first + column)]
            for i in range(queries):
                acc[i] += query(q, q_rows, q_heads, tile, i, index(column)) * key

    return dots


@functools.cache
def row_scores_kernel(key_tile: int, rank: int, rope_dim: int, threads: int, unroll: int, queries: int,
                      staged: tuple[int, int] = (0, 0), staged_loads: int = ROW_STAGED_LOADS):
    """Version 5, step 1 of 4, for a decode row or a few (a small tree), tiles of KT = ``key_tile``
    keys of R = ``rank`` + dr = ``rope_dim`` columns, blocks of ``threads`` threads, a score's loads
    ``unroll`` at a time, ``queries`` of them side by side per thread, and the QS = G H query rows of
    ``staged`` = (G, H) staged in shared memory beside the tile, a group of G rows per block ((0, 0):
    every query read from global memory), at most ``staged_loads`` of their loads in flight per thread
    (literals: the staged tile's, the loads' and the registers' sizes, H's divisions). A score's terms
    are added as ``scores_kernel`` adds them, whatever the shape."""
    group_rows, staged_heads = staged[0], max(1, staged[1])
    staged_queries = group_rows * staged[1]
    dots = row_dots(unroll, queries, staged_queries > 0)
    width = rank + rope_dim
    stride = width + 1                                # a staged key (+1: the tile's keys in distinct banks)
    queries_at = key_tile * stride                    # the staged queries after the tile's keys
    tile_size = queries_at + staged_queries * stride  # the tile (and the queries) in shared memory
    latent_loads = -(-rank // threads)                # a thread's columns of each key's latent
    rope_loads = -(-key_tile * rope_dim // threads)   # ... and its share of the tile's rope columns
    query_loads = min(staged_loads, max(1, -(-staged_queries * width // threads)))   # ... the queries
    head_lanes = threads // key_tile

    @cuda.jit(device=True)
    def load_tile(cache_latent, cache_rope, s0, keys, tid, latent, rope):
        """The thread's share of the tile at slot s0 into registers, every load issued before any
        is used (past the last key: the last key again, never written)."""
        for k in range(key_tile):
            slot = index(min(s0 + k, keys - 1))
            for j in range(latent_loads):
                latent[k, j] = cache_latent[slot, min(tid + j * threads, rank - 1)]
        for p in range(rope_loads):
            at = tid + p * threads
            rope[p] = cache_rope[index(min(s0 + at // rope_dim, keys - 1)), at % rope_dim]

    @cuda.jit
    def attention_row_scores_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores,
                                    fewest_keys, most_keys):
        """scores[q, s] = scale * (q_lat | q_pe)[q] . (cache_latent | cache_rope)[s] for every query
        q = row * H + head and slot s < P + T: ``attention_scores_kernel``'s scores of T rows; nothing
        unless ``fewest_keys`` < P + T <= ``most_keys`` (the contexts of the launches beside it).

        Thread (lane, key) = tid // KT, tid % KT: key s0 + key of the tile at s0, queries lane,
        lane + THREADS / KT, ... The block stages a whole tile, all R + dr columns, with every load issued
        before the first store (one memory round trip per tile, where the GEMM takes one per STEP columns;
        the next tile's loads are issued before this tile's adds, which their round trip overlaps), then each
        thread adds its scores' R + dr terms one at a time in column order, Q = ``queries`` of
        them side by side (``row_dots``), the queries' values read from global memory (every block reads
        the same rows), or, with QS > 0, from shared memory, where the block first stages the H query
        rows of each of its group's rows once, rows blockIdx.y G .. blockIdx.y G + G - 1 (each term then
        waits on shared memory, not on L2). Tiles s0 = blockIdx.x KT, + gridDim.x KT, ... below P + T (P
        read on the device):
        one launch shape serves every step, and the cache's empty capacity costs nothing. The same bits as
        the GEMM, whatever the tile and the rows."""
        tid = index(cuda.threadIdx.x)
        rows, heads = q_lat.shape[0], q_lat.shape[1]
        keys = prefix[0] + rows
        if keys <= fewest_keys or keys > most_keys:   # the whole block: another launch's context
            return
        tile = cuda.shared.array(tile_size, float32)
        latent = cuda.local.array((key_tile, latent_loads), float32)
        rope = cuda.local.array(rope_loads, float32)
        sums = cuda.local.array(queries, float32)         # [Q] the thread's scores side by side
        q_rows = cuda.local.array(queries, int32)         # ... their rows and heads (staged: offsets)
        q_heads = cuda.local.array(queries, int32)
        key, lane = tid % key_tile, tid // key_tile
        start, step = cuda.blockIdx.x * key_tile, cuda.gridDim.x * key_tile   # the block's tiles
        group = index(cuda.blockIdx.y)                # staged: rows group G .. group G + G - 1
        q0 = group * staged_queries                   # the group's first query (0 unstaged: one group)
        count = min(staged_queries, rows * heads - q0) if staged_queries else rows * heads   # its queries
        if staged_queries and start < keys:           # the group's query rows' R + dr columns, once,
            q_values = cuda.local.array(query_loads, float32)      # their loads before their stores
            total = count * width
            for base in range(tid, total, threads * query_loads):
                for p in range(query_loads):
                    at = index(min(base + p * threads, total - 1))
                    row = group * group_rows + at // width // staged_heads
                    head, column = at // width % staged_heads, at % width
                    q_values[p] = q_lat[row, head, column] if column < rank \
                        else q_pe[row, head, index(column - rank)]
                for p in range(query_loads):              # (seen after the tile loop's barriers)
                    at = index(base + p * threads)
                    if at < total:
                        tile[queries_at + at // width * stride + at % width] = q_values[p]
        if start < keys:
            load_tile(cache_latent, cache_rope, start, keys, tid, latent, rope)
        for s0 in range(start, keys, step):
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
            if s0 + step < keys:                      # the next tile's loads, in flight during the adds
                load_tile(cache_latent, cache_rope, s0 + step, keys, tid, latent, rope)
            # the group's queries lane + i HL (HL = THREADS / KT), i < Q, side by side
            for first in range(lane, count, head_lanes * queries):
                for i in range(queries):              # past the last query: the last again, not written
                    query = min(first + i * head_lanes, count - 1)
                    if staged_queries:                # its offset in the tile (q_heads unread)
                        q_rows[i] = queries_at + query * stride
                    else:
                        q_rows[i], q_heads[i] = query // heads, query % heads
                    sums[i] = float32(0.0)
                if staged_queries:                    # the R + dr columns in one run of dots
                    dots(sums, q_lat, q_rows, q_heads, tile, key * stride, width)
                else:
                    dots(sums, q_lat, q_rows, q_heads, tile, key * stride, rank)
                    dots(sums, q_pe, q_rows, q_heads, tile, key * stride + rank, rope_dim)
                for i in range(queries):
                    query = first + i * head_lanes
                    if query < count and s0 + key < keys:
                        scores[q0 + query, s0 + key] = sums[i] * scale

    return attention_row_scores_kernel


def row_group(rows: int, heads: int, rank: int, rope_dim: int) -> int:
    """G, the rows of queries a block of the row kernel stages beside its tile of ROW_STAGED_KEYS keys,
    the T = ``rows`` rows in groups of G on the grid's second side: the most of them whose H = ``heads``
    query rows of R + dr columns fit SHARED_BUDGET with the tile (small's 16 heads: one row a block).
    0, every query read from global memory: where not even one row's fit (Kimi's 64 heads), for rows
    ROW_STAGED_SCORES_KEYS does not list, or with ROW_STAGED_KEYS None."""
    if ROW_STAGED_KEYS is None or rows not in ROW_STAGED_SCORES_KEYS:
        return 0
    fit = (SHARED_BUDGET // (F32 * (rank + rope_dim + 1)) - ROW_STAGED_KEYS) // heads
    return max(0, min(rows, fit))


def row_scores(rows: int, rank: int, rope_dim: int) -> bool:
    """Whether version 5 takes ``row_scores_kernel`` for its scores: for the rows ROW_SCORES_KEYS
    lists (a decode row, a small tree: the GEMM's tiles would be mostly empty and its blocks few) with
    rope columns (dr >= 1: the kernel stages them apart), whose tile of ROW_KEYS keys of R = ``rank``
    + dr = ``rope_dim`` columns fits SHARED_BUDGET."""
    fits = F32 * ROW_KEYS * (rank + rope_dim + 1) <= SHARED_BUDGET
    return rows in ROW_SCORES_KEYS and rope_dim >= 1 and fits


def row_shape(queries: int, key_tile: int | None = None) -> tuple[int, int]:
    """The row kernel's (Q, unroll) for ``queries`` = T H query rows: Q side by side, a thread's share
    of them (ROW_THREADS / KT at once, KT = ``key_tile``, ROW_KEYS by default) and at most ROW_QUERIES,
    in runs of ROW_LOADS / Q columns rounded down to a power of two (runs that divide R and dr). No
    shape changes a score."""
    side_by_side = min(ROW_QUERIES, -(-queries // (ROW_THREADS // (key_tile or ROW_KEYS))))
    return side_by_side, ROW_LOADS >> (side_by_side - 1).bit_length()


@cuda.jit
def attention_stats_kernel(scores, prefix, depths, paths, partials):
    """Version 5, step 2 of 4: block (head, row) finds M, the largest score of the row's keys
    (positions 0 .. P + depth: the prefix, then its path, ``_key_slot``; exact in any order), then
    each chunk's sum of exp(s - M), a warp per chunk: lane l adds the chunk's keys l, l + 32, ...
    in position order (its loads all issued before its adds), then lane 0 adds the 32 lanes' sums
    in lane order: partials[row, head, c, R] = M and [R + 1] = the sum for c = 0 .. (P + depth) //
    CHUNK. The order depends on the key's position in its chunk alone, not on the rows or the
    tree. A warp per chunk, not a thread: a thread adding its chunk's keys in turn waits on each."""
    head = index(cuda.blockIdx.x)                         # every index below is >= 0 (``index``)
    row = index(cuda.blockIdx.y)
    tid = index(cuda.threadIdx.x)
    heads, rank = partials.shape[1], partials.shape[3] - 2
    query = row * heads + head
    n_prefix = index(prefix[0])
    keys = n_prefix + index(depths[row]) + 1
    threads = index(cuda.blockDim.x)
    red = cuda.shared.array(UNFUSED_STATS_THREADS, float32)
    top = float32(-math.inf)
    for j in range(tid, keys, threads):
        top = max(top, scores[query, index(_key_slot(n_prefix, paths, row, j))])
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
                staged[i] = scores[query, index(_key_slot(n_prefix, paths, row, key))]
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
        """Version 5, step 4 of 4: the chunks step 3 leaves, from the one holding position P to the one
        holding the row's own position P + depth, where the row's keys are prefix keys, then its path's nodes
        (``_key_slot``). Block (x, g, row): latent columns x TPB + tid of heads g HB .. of one row. Per chunk
        the block stages the keys' slots and the heads' exp(s - M) in shared memory, then each thread adds the
        chunk's keys in position order for its column and heads (its cache loads issued BATCH at a time, ahead
        of their adds): term for term the sums step 3's GEMM gives a chunk of the prefix, so a tree row equals
        the row at its position in the committed chain, bit for bit."""
        tid = index(cuda.threadIdx.x)                    # every index below is >= 0 (``index``)
        threads = index(cuda.blockDim.x)
        column = index(cuda.blockIdx.x) * threads + tid
        head0 = index(cuda.blockIdx.y) * heads_per_block
        row = index(cuda.blockIdx.z)
        heads, rank = partials.shape[1], cache_latent.shape[1]
        n_prefix = index(prefix[0])
        last = n_prefix + index(depths[row])              # the row's own position
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
            for h in range(heads_per_block):
                top = partials[row, min(head0 + h, heads - 1), chunk, rank]
                for k in range(tid, count, threads):
                    value = float32(0.0)
                    if head0 + h < heads:
                        value = math.exp(scores[row * heads + head0 + h, index(slots[k])] - top)
                    probs[h * UNFUSED_CHUNK + k] = value
            cuda.syncthreads()
            for h in range(heads_per_block):
                acc[h] = float32(0.0)
            if column < rank:
                whole = count - count % batch
                for k0 in range(0, whole, batch):   # BATCH loads, then their adds, k in order
                    for b in range(batch):
                        values[b] = cache_latent[index(slots[index(k0 + b)]), column]
                    for b in range(batch):          # a fixed trip count: values stay registers
                        for h in range(heads_per_block):
                            acc[h] += probs[index(h * UNFUSED_CHUNK + k0 + b)] * values[b]
                for b in range(batch):              # the last keys (fewer than BATCH), alike
                    values[b] = cache_latent[index(slots[index(min(whole + b, count - 1))]), column]
                for b in range(batch):              # (past count: the last key again, never added)
                    if whole + b < count:
                        for h in range(heads_per_block):
                            acc[h] += probs[index(h * UNFUSED_CHUNK + whole + b)] * values[b]
                for h in range(heads_per_block):
                    if head0 + h < heads:
                        partials[row, head0 + h, chunk, column] = acc[h]

    return attention_tail_kernel


def tail_shape(rows: int) -> tuple[int, int, int]:
    """The tail kernel's (HB heads, threads per block, BATCH) for T = ``rows`` rows: one head for a
    decode row (its tail is its whole context while that is short: more blocks, fewer sums per
    thread), two for a few rows, the most from TAIL_MANY_ROWS on (each cache load then feeds that
    many heads' sums). The same bits whatever the shape."""
    if rows == 1:
        return UNFUSED_TAIL_ONE
    return UNFUSED_TAIL_FEW if rows < TAIL_MANY_ROWS else UNFUSED_TAIL_MANY


def unfused_chunks(capacity: int) -> int:
    """The P V chunks for a cache of ``capacity`` slots: UNFUSED_CHUNK keys each, at fixed
    positions (a partial per chunk, merged in chunk order)."""
    return -(-capacity // UNFUSED_CHUNK)


def stats_threads(queries: int) -> int:
    """The statistics' threads for ``queries`` = T H blocks: STATS_THREADS while the blocks are few (a decode
    row: more chunks' warps at once), STATS_FEW once they fill the GPU (STATS_FEW_FROM_BLOCKS_PER_SM per SM).
    Neither changes a sum (the max is exact in any order, each chunk's sum is one warp's, in lane order)."""
    many = STATS_FEW_FROM_BLOCKS_PER_SM * sm_count()
    return UNFUSED_STATS_THREADS if queries < many else UNFUSED_STATS_FEW


def row_blocks() -> int:
    """The few rows' score kernel's grid at most: ROW_BLOCKS_PER_SM blocks per SM, which walk
    the tiles below P + T (the cache's empty capacity costs nothing)."""
    return ROW_BLOCKS_PER_SM * sm_count()


def keys_bound(keys: int | None) -> np.int64:
    """A kernel's most keys as its launch takes them (None, every context: ALL_KEYS)."""
    return ALL_KEYS if keys is None else np.int64(keys)


def score_launches(rows: int, heads: int, rank: int, rope_dim: int) -> list[tuple]:
    """Step 1's launches for T = ``rows`` rows of H = ``heads`` query rows of R = ``rank`` + dr =
    ``rope_dim`` columns, each (G, fewest, most keys): it scores the contexts fewest < P + T <= most
    and returns at once outside them (a graph reads P on the device, so it holds them all). In order:
    G > 0, the row kernel with its queries staged in groups of G rows (``row_group``), up to
    ROW_STAGED_SCORES_KEYS; G = 0, the row kernel reading them from global memory, up to
    ROW_SCORES_KEYS; G None, the GEMM past both. A launch whose contexts are empty is left out."""
    launches, split = [], NO_KEYS                     # split: the GEMM's fewest keys
    if row_scores(rows, rank, rope_dim):
        split = keys_bound(ROW_SCORES_KEYS[rows])
        group = row_group(rows, heads, rank, rope_dim)
        staged = min(keys_bound(ROW_STAGED_SCORES_KEYS[rows]), split) if group else NO_KEYS
        if group:
            launches.append((group, NO_KEYS, staged))
        if staged < split:
            launches.append((0, staged, split))
    if split != ALL_KEYS:
        launches.append((None, split, ALL_KEYS))
    return launches


def launch_row_scores(q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores, contexts, group, stream):
    """``row_scores_kernel``'s launch for the contexts (fewest, most keys) of P + T, its queries staged
    in groups of ``group`` rows (0: read from global memory)."""
    rows, heads, rank = q_lat.shape
    capacity, rope_dim = cache_latent.shape[0], q_pe.shape[2]
    staged = (group, heads) if group else (0, 0)
    key_tile = ROW_STAGED_KEYS if group else ROW_KEYS
    grid = (min(blocks(capacity, key_tile), row_blocks()), blocks(rows, group) if group else 1)
    queries, unroll = row_shape((group or rows) * heads, key_tile)
    kernel = row_scores_kernel(key_tile, rank, rope_dim, ROW_THREADS, unroll, queries, staged,
                               ROW_STAGED_LOADS)
    kernel[grid, ROW_THREADS, stream](q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores, *contexts)


def unfused_partials(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, *, scores=None,
                     partials=None, stream=None):
    """Steps 1 to 4 on device arrays: every row's scores into ``scores`` (T H, C) and a partial
    softmax per chunk into ``partials`` (T, H, ``unfused_chunks(C)``, R + 2), each allocated
    (NaN-poisoned) when not given; returns ``partials`` for ``kernels.mla``'s merge."""
    rows, heads, rank = q_lat.shape
    capacity, rope_dim = cache_latent.shape[0], q_pe.shape[2]
    chunks = unfused_chunks(capacity)
    check_out(scores, (rows * heads, capacity), name="scores")
    check_out(partials, (rows, heads, chunks, rank + 2), name="partials")
    scores = output(scores, (rows * heads, capacity), stream=stream)             # [T H, C]
    partials = output(partials, (rows, heads, chunks, rank + 2), stream=stream)  # [T, H, chunks, R + 2]
    scale = np.float32(scale)
    for group, fewest, most in score_launches(rows, heads, rank, rope_dim):           # step 1
        if group is None:
            shape = scores_shape(rows * heads)
            query_tile, key_tile, thread_queries, thread_keys, _ = shape
            scores_grid = (blocks(capacity, key_tile), blocks(rows * heads, query_tile))
            scores_threads = (query_tile // thread_queries) * (key_tile // thread_keys)
            scores_kernel(*shape)[scores_grid, scores_threads, stream](
                q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores, fewest)
        else:
            launch_row_scores(q_lat, q_pe, cache_latent, cache_rope, prefix, scale, scores, (fewest, most),
                              group, stream)
    attention_stats_kernel[(heads, rows), stats_threads(rows * heads), stream](   # step 2
        scores, prefix, depths, paths, partials)
    values_grid = (blocks(rank, UNFUSED_TILE), blocks(rows * heads, UNFUSED_TILE), chunks)
    attention_values_kernel[values_grid, UNFUSED_THREADS, stream](scores, cache_latent, prefix, partials)
    tail_heads, tail_threads, tail_batch = tail_shape(rows)                      # step 4
    tail_grid = (blocks(rank, tail_threads), blocks(heads, tail_heads), rows)
    tail_kernel(tail_heads, tail_batch)[tail_grid, tail_threads, stream](
        scores, cache_latent, prefix, depths, paths, partials)
    return partials
# --8<-- [end:attention_unfused_kernels]
