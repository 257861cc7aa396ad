"""Attention version 4, register-tiled (``attention_paths(gemm=True)`` until it moved here): against
the shipped versions 1 to 3 it computes a tile's scores and its weighted sum as two small register-
tiled GEMMs: a block per (GH = ``gemm_heads(H)`` heads, row, split), tiles of 32 keys, the scores
summed over d-chunks of 192 staged columns with a 4-head x 4-key register tile per thread (8 shared
loads feed 16 FMAs, where versions 1 to 3 pay 2 loads per FMA), the softmax's max and sum by one
thread per head in key order, and O += P V with each thread's 4 heads x 8 columns of O in registers
for the whole kernel; the same partials and merge as versions 2 and 3. On the H200 it was 3.6x to 4x
faster than version 3 at Kimi's shapes (bench-h200-2026-12-01c.md at commit c6cfc10) and cut small's
forward at 16k context by 29% at T = 1 and 69% at T = 72 (profile-h200-2026-12-01f.md at commit
c6cfc10), so the engine took it from R = 512 until version 5 (unfused GEMMs, kernels/mla_unfused.py)
beat it 3x to 4.8x at the same shapes (bench-h200-2026-12-01e.md at commit 47a2538; small's graph
replay at 16k context 8.8 -> 7.1 ms at T = 1 and 127 -> 49 ms at T = 72, profile-h200-2026-12-01g.md
at commit 47a2538). At tiny's R = 64 its AR step was slower than version 3 (533 against 496 µs of
graph replay, profile-h200-2026-12-01f.md at commit c6cfc10 against -01e.md). Limiting it to 128
registers (two blocks per SM, 136 bytes of spills) cut its time by 10-24% at Kimi's shapes
(docs/results/attention-v4-registers-h200-2026-12-01.md at commit 485e3b7); that was never adopted,
since version 5 replaced it. Written in commit 3ad4bb1. Its sums depend on its own tile (32 keys, 8
column parts), so its bits differ from the shipped versions'.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from kernels.device import poisoned, to_device
from kernels.mla import attention_merge_kernel, check_attention_paths, merge_threads
from kernels.tuning import MAX_SPLITS, SHARED_BUDGET, SPLIT_TILES
from lab.harness import Case

SHIPPED = "kernels.mla.attention_paths"
TWIN = "ddtree.mla.attention_paths"
SAME_BITS = False
# a score sums its columns in 8 interleaved parts, not the twin's order: on a GPU (fused multiply-adds)
# an output entry far below the O(0.1..1) scale lands a few ulps of that scale away
TOLERANCE = (1e-5, 1e-5)

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
GEMM_SLOTS = 2 * GEMM_TILE                             # the tile's cache slots, double-buffered
GEMM_MAX_HEADS = 16           # GH at most (gemm_heads)
GEMM_STATS = 2 * GEMM_MAX_HEADS                        # each head's running max and rescale factor
GEMM_BATCH = 4                # _stage_chunk: loads a thread issues before it stores them
GEMM_OUTPUTS = GEMM_SCORE_HEADS * GEMM_COLUMNS         # a thread's output registers (32)
GEMM_SCORES = GEMM_SCORE_HEADS * GEMM_SCORE_KEYS       # a thread's score registers (16)
GEMM_HEADS = (16, 8, 4, 2, 1)  # GH candidates, largest first (gemm_heads), at most GEMM_MAX_HEADS
F32 = 4


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
    spills 136 bytes.
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


def gemm_heads(heads: int) -> int:
    """GH, the heads per block: the largest of 16, 8, 4, 2, 1 dividing H (Kimi's 64 and one
    rank's 8: 16 and 8). 16 is the most that fits: 256 threads (4 groups of 64, each a 4-head
    score and output tile), and the key and query chunks, S and P in 41.5 KB of shared memory
    (``gemm_shared_bytes``); 32 would take 512 threads and 58 KB, past numba's 48 KB. GH changes
    which heads share a block, never a head's sums."""
    return next(group for group in GEMM_HEADS if heads % group == 0)


def gemm_threads(heads_per_block: int) -> int:
    """TPB for GH heads: GEMM_LANES (64) per group of 4 heads (GH < 4: one group, its heads past GH
    phantoms): 256 for GH = 16, 128 for 8, 64 for 4 or fewer."""
    return GEMM_LANES * max(heads_per_block, GEMM_SCORE_HEADS) // GEMM_SCORE_HEADS


def gemm_shared_bytes(heads_per_block: int) -> int:
    """Dynamic shared memory for GH heads: the key chunk (KT rows) and the query chunk (GH rows) of
    GEMM_STRIDE floats each, which the score parts (8 x (GH x KT + 4)) reuse, then S and P."""
    group = max(heads_per_block, GEMM_SCORE_HEADS)       # phantom heads where GH < 4
    chunks = (GEMM_TILE + group) * GEMM_STRIDE
    assert GEMM_PARTS * (group * GEMM_TILE + GEMM_PART_PAD) <= chunks, "the score parts must fit the chunks"
    return F32 * (chunks + 2 * group * GEMM_TILE)


def gemm_splits(capacity: int) -> int:
    """Z for a cache of ``capacity`` keys, as ``kernels.mla.paths_splits`` chooses it, in tiles of
    GEMM_TILE keys."""
    tiles = -(-capacity // GEMM_TILE)
    splits = 1
    while splits < MAX_SPLITS and splits * SPLIT_TILES < tiles:
        splits *= 2
    return splits


def run(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, *, splits=None):
    """Version 4 called like ``kernels.mla.attention_paths`` (host arrays in, o_lat out as numpy):
    Z = ``splits`` (None: ``gemm_splits`` of the cache's capacity) blocks per (GH heads, row)
    into partials (T, H, Z, R + 2), then the shipped merge."""
    arrays = check_attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths)
    rows, heads, rank = arrays[0].shape
    if rank > GEMM_MAX_RANK:
        raise ValueError(f"version 4 needs a rank R <= {GEMM_MAX_RANK} (a thread holds {GEMM_COLUMNS} "
                         f"columns), got {rank}")
    arrays = tuple(to_device(a) for a in arrays)
    splits = splits or gemm_splits(arrays[2].shape[0])
    group = gemm_heads(heads)                                               # GH
    assert gemm_shared_bytes(group) <= SHARED_BUDGET
    partials = poisoned((rows, heads, splits, rank + 2))                    # [T, H, Z, R + 2]
    out = poisoned((rows, heads, rank))                                     # [T, H, R]
    grid, threads, shared = (heads // group, rows, splits), gemm_threads(group), gemm_shared_bytes(group)
    attention_gemm_kernel[grid, threads, 0, shared](*arrays, np.float32(scale), GEMM_TILE, partials)
    attention_merge_kernel[(heads, rows), merge_threads(rank)](partials, arrays[4], arrays[5], GEMM_TILE, out)
    return out.copy_to_host()


def _tree_case(name, rows, prefix, rank, rope_dim, heads, splits=None, seed=0):
    """A random tree of ``rows`` nodes after ``prefix`` cached keys, a cache of exactly S slots."""
    rng = np.random.default_rng(seed)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, rows)])
    depths = np.zeros(rows, np.int64)
    for i in range(1, rows):
        depths[i] = depths[parents[i]] + 1
    paths = np.full((rows, int(depths.max()) + 1), -1, np.int64)        # [T, max depth + 1]
    for i in range(rows):
        node = i
        for d in range(depths[i], -1, -1):
            paths[i, d] = node
            node = parents[node]
    keys = prefix + rows
    args = (rng.standard_normal((rows, heads, rank), dtype=np.float32),
            rng.standard_normal((rows, heads, rope_dim), dtype=np.float32),
            rng.standard_normal((keys, rank), dtype=np.float32),
            rng.standard_normal((keys, rope_dim), dtype=np.float32),
            np.array([prefix], np.int64), depths, paths, 0.3)
    return Case(name, args, {} if splits is None else {"splits": splits})


def cases():
    """Irregular trees: one split and three (tiles dealt 1, 1, 1 and idle splits), phantom heads
    (GH = 2, 1 < 4), GH = 4 with two head blocks, R + dr past one d-chunk."""
    return [_tree_case("one split", 5, 37, 9, 2, 2, seed=1),
            _tree_case("three splits", 4, 75, 11, 3, 2, splits=3, seed=2),
            _tree_case("eight heads", 3, 20, 7, 2, 8, splits=2, seed=3),
            _tree_case("three heads, wide rows", 2, 40, 190, 6, 3, seed=4)]
