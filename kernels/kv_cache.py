"""The latent KV cache on the GPU: writes and compaction, the numba.cuda twins of
``LatentKVCache.write`` and ``ddtree.kv_cache.compact``.

Legend: Ly layers, C capacity (slots), R kv_lora_rank, dr qk_rope_head_dim, m accepted nodes,
TPB threads per block.

Verification wrote the tree's rows at slots start..start+n in node order; only the accepted
path stays: slot ``start + j`` <- slot ``start + accepted[j]``, then length = start + m.

Why not one parallel in-place copy: ``accepted[j] >= j``, so a row that one thread reads can be
the row another thread writes. With accepted = [0, 2, 3, 5], thread 1 reads slot 2 while thread
2 overwrites slot 2 with slot 3; if thread 2 runs first, slot 1 receives row 3 instead of row 2.
numpy's sequential loop (increasing j) is safe because slot j is only overwritten by step j,
after every step that reads it; GPU threads have no such order, and blocks cannot wait for each
other inside one launch. So the kernel runs twice: launch 1 gathers the accepted rows into a
scratch buffer (reads only the cache), launch 2 writes the scratch back (reads only the scratch);
the launch boundary orders every read before every write. A row already in place
(``accepted[j] == j``) is skipped by both launches; if every row is in place, ``compact``
launches nothing.

Version 2 (the default) needs neither scratch nor a second launch: parallelise over the columns
instead of the rows. One thread owns one column of one layer (Ly x (R + dr) threads, every layer
in one launch) and replays numpy's loop for it, j = 0 .. m-1 in increasing order. No two threads
touch the same element, and within a thread the rule that makes numpy's loop safe holds: slot
P + s is written by step s only, after every step that reads it (``accepted`` increases strictly
from 0, so step j reads slot accepted[j] >= j). A thread issues COMPACT_BATCH reads before their
writes, so a batch's loads overlap: a batch reads slots accepted[j] >= j, all past what earlier
batches wrote.

Kernels:
- ``compact_columns_kernel`` (version 2): one thread per (layer, column), every layer in one
  launch, no scratch; P, accepted and m read from device arrays as below.
- ``compact_kernel`` (version 1): one block per (row j, layer), the threads stride over the R latent and then
  the dr rope columns; ``gather``: scratch[layer, j] <- cache[layer, P + accepted[j]], else
  cache[layer, P + j] <- scratch[layer, j]. P, accepted and m are read from device arrays and the
  grid may cover more rows than m (blocks past m return): the engine captures it in a CUDA graph
  sized for its bucket. Bytes: 2 launches x moved rows x Ly layers x (R + dr) x 4 bytes.
- ``new_rows_kernel`` (``write_new_rows``): a forward's new rows into one layer's cache at slots
  P .. P + T - 1 (P read from a device array; what ``LatentKVCache.write`` does), fused with what
  comes before it, one block per row: the query latent's and the key-value latent's RMSNorms
  (``rmsnorm_kernel``'s bits) and the rope key's rotation (``rotated``).

``compact`` decides the new length on the host: it takes a ``stream`` but no ``out`` (the cache
is compacted in place).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from ddtree.kv_cache import LatentKVCache, check_accepted
from kernels.blocks import block_sums
from kernels.device import (
    check_float32,
    check_version,
    is_device_array,
    poisoned,
    reduction_threads,
    to_device,
)
from kernels.rmsnorm import ROW_THREADS
from kernels.rope import rotated

TPB = 128
F32, I64 = 4, 8
COMPACT_BATCH = 8          # version 2: reads in flight per thread before their writes
VERSIONS = (1, 2)          # compact's kernel versions


# --8<-- [start:compact_kernel]
@cuda.jit
def compact_kernel(cache_latent, cache_rope, start, accepted, count, scratch_latent, scratch_rope, gather):
    """Block (j, layer): move accepted node j's row between slot P + accepted[0, j] of the cache
    and row j of the scratch (P = start[0], m = count[0]); rows in place or past m do nothing.

    A thread copies columns tid, tid + TPB, ...; no shared memory.
    """
    j = cuda.blockIdx.x
    layer = cuda.blockIdx.y
    if j >= count[0] or accepted[0, j] == j:
        return
    source = start[0] + accepted[0, j]
    target = start[0] + j
    for c in range(cuda.threadIdx.x, cache_latent.shape[2], cuda.blockDim.x):
        if gather:
            scratch_latent[layer, j, c] = cache_latent[layer, source, c]
        else:
            cache_latent[layer, target, c] = scratch_latent[layer, j, c]
    for c in range(cuda.threadIdx.x, cache_rope.shape[2], cuda.blockDim.x):
        if gather:
            scratch_rope[layer, j, c] = cache_rope[layer, source, c]
        else:
            cache_rope[layer, target, c] = scratch_rope[layer, j, c]
# --8<-- [end:compact_kernel]


def launch_compact(cache_latent, cache_rope, start, accepted, count, scratch_latent, scratch_rope,
                   rows: int, stream=None) -> None:
    """Both launches on device arrays: cache (Ly, C, R) / (Ly, C, dr), start and count (1,),
    accepted (1, >= rows), scratch (Ly, >= rows, R) / (Ly, >= rows, dr); ``rows`` blocks per layer."""
    grid = (rows, cache_latent.shape[0])
    for gather in (True, False):                                             # 1. gather, 2. write back
        compact_kernel[grid, TPB, stream](cache_latent, cache_rope, start, accepted, count,
                                          scratch_latent, scratch_rope, gather)


# --8<-- [start:compact_columns_kernel]
@cuda.jit(device=True)
def compact_column(cache_latent, cache_rope, index, first, accepted, kept):
    """Column ``index`` of the Ly x (R + dr) columns (R latent, then dr rope; past them: nothing)
    runs numpy's loop: slot first + j <- slot first + accepted[j], j = 0 .. kept - 1 in order
    (``accepted`` a 1-D row, global or shared), rows in place skipped. Reads COMPACT_BATCH rows
    into registers, then writes them."""
    rank = cache_latent.shape[2]
    width = rank + cache_rope.shape[2]
    layer = index // width
    column = index % width
    if layer >= cache_latent.shape[0]:
        return
    values = cuda.local.array(COMPACT_BATCH, float32)
    for base in range(0, kept, COMPACT_BATCH):
        for b in range(COMPACT_BATCH):                       # reads: slots accepted[j] >= j
            j = base + b
            if j < kept and accepted[j] != j:
                source = first + accepted[j]
                values[b] = cache_latent[layer, source, column] if column < rank \
                    else cache_rope[layer, source, column - rank]
        for b in range(COMPACT_BATCH):                       # writes: slots j, read before now
            j = base + b
            if j < kept and accepted[j] != j:
                if column < rank:
                    cache_latent[layer, first + j, column] = values[b]
                else:
                    cache_rope[layer, first + j, column - rank] = values[b]


@cuda.jit
def compact_columns_kernel(cache_latent, cache_rope, start, accepted, count):
    """Version 2: thread (layer, column) of the Ly x (R + dr) columns runs numpy's loop for its
    column (``compact_column``), P = start[0], m = count[0], the path accepted[0]. No shared
    memory; the grid may have spare threads (they return).
    """
    compact_column(cache_latent, cache_rope, cuda.grid(1), start[0], accepted[0], count[0])
# --8<-- [end:compact_columns_kernel]


def launch_compact_columns(cache_latent, cache_rope, start, accepted, count, stream=None) -> None:
    """Version 2's one launch on device arrays: cache (Ly, C, R) / (Ly, C, dr), start and count
    (1,), accepted (1, >= m)."""
    columns = cache_latent.shape[0] * (cache_latent.shape[2] + cache_rope.shape[2])
    compact_columns_kernel[(columns + TPB - 1) // TPB, TPB, stream](cache_latent, cache_rope, start,
                                                                    accepted, count)


# --8<-- [start:new_rows_kernel]
@functools.cache
def new_rows_kernel(threads: int, q_threads: int, kv_threads: int):
    """The kernel of ``write_new_rows`` for blocks of ``threads`` threads, the query latent's norm
    summed as ``rmsnorm_kernel(q_threads)`` sums it and the key-value latent's as
    ``rmsnorm_kernel(kv_threads)`` (powers of two <= ``threads``; q_threads 0: no query latent)."""

    @cuda.jit
    def kernel(projected, q_rank, q_weight, kv_weight, eps, positions, inv_freq, scale,
               cache_latent, cache_rope, start, q_normed):
        # one block = one row t of projected (T, Rq + R + dr): columns [0, Rq) the query latent,
        # [Rq, Rq + R) the key-value latent, [Rq + R, Rq + R + dr) the rope key. Thread tid sums
        # the squares of the query latent's columns tid, tid + q_threads, ... and of the kv
        # latent's tid, tid + kv_threads, ...: rmsnorm_kernel's partial sums for each width. One
        # tree (block_sums) over `threads` reduces both; the slots past a norm's own threads hold
        # zeros, which its first stages add exactly, so each total has rmsnorm_kernel's bits.
        # shared memory: 2 x TPB float32 partial sums
        sums = cuda.shared.array((2, threads), float32)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        rank = cache_latent.shape[1]
        half = cache_rope.shape[1] // 2
        slot = start[0] + t

        q_acc = float32(0.0)
        if tid < q_threads:
            for d in range(tid, q_rank, q_threads):
                q_acc += projected[t, d] * projected[t, d]
        kv_acc = float32(0.0)
        if tid < kv_threads:
            for d in range(q_rank + tid, q_rank + rank, kv_threads):
                kv_acc += projected[t, d] * projected[t, d]
        sums[0, tid] = q_acc
        sums[1, tid] = kv_acc
        for i in range(tid, half, threads):     # the rope key needs no sum: rotated meanwhile
            first = projected[t, q_rank + rank + i]
            second = projected[t, q_rank + rank + i + half]
            cache_rope[slot, i], cache_rope[slot, i + half] = rotated(first, second, positions[t],
                                                                      inv_freq[i], scale)
        block_sums(sums)

        # rmsnorm_kernel's float32 operations, in its order
        if q_rank > 0:
            mean_square = sums[0, 0] / float32(q_rank)
            inv_rms = float32(1.0) / math.sqrt(mean_square + float32(eps))
            for d in range(tid, q_rank, threads):
                q_normed[t, d] = projected[t, d] * inv_rms * q_weight[d]
        mean_square = sums[1, 0] / float32(rank)
        inv_rms = float32(1.0) / math.sqrt(mean_square + float32(eps))
        for d in range(tid, rank, threads):
            cache_latent[slot, d] = projected[t, q_rank + d] * inv_rms * kv_weight[d]

    return kernel
# --8<-- [end:new_rows_kernel]


def check_new_rows(projected, q_rank, q_weight, kv_weight, positions, inv_freq, cache_latent, cache_rope,
                   start, q_normed):
    """Device float32 arrays of matching shapes (the engine's buffers and weights)."""
    arrays = dict(projected=projected, kv_weight=kv_weight, positions=positions, inv_freq=inv_freq,
                  cache_latent=cache_latent, cache_rope=cache_rope, start=start)
    if q_rank:
        arrays.update(q_weight=q_weight, q_normed=q_normed)
    for name, array in arrays.items():
        if not is_device_array(array):
            raise ValueError(f"{name} must be a device array, got {type(array).__name__}")
    if isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank < 0:
        raise ValueError(f"q_rank must be an integer >= 0, got {q_rank!r}")
    rows = projected.shape[0]
    rank, rope_dim = cache_latent.shape[1], cache_rope.shape[1]
    expected = {"projected": (rows, q_rank + rank + rope_dim), "kv_weight": (rank,), "positions": (rows,),
                "inv_freq": (rope_dim // 2,), "cache_rope": (cache_latent.shape[0], rope_dim), "start": (1,)}
    if q_rank:
        expected.update(q_weight=(q_rank,), q_normed=(rows, q_rank))
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (projected (T, Rq + R + dr) with Rq = q_rank, "
                             f"R and dr from the cache), got {tuple(arrays[name].shape)}")
    check_float32(**{name: array for name, array in arrays.items() if name not in ("positions", "start")})


# --8<-- [start:write_new_rows]
def write_new_rows(projected, q_rank: int, q_weight, kv_weight, eps: float, positions, inv_freq,
                   scale: float, cache_latent, cache_rope, start, *, q_normed=None, stream=None) -> None:
    """A forward's new attention rows in one launch, from the stacked projection ``projected``
    (T, Rq + R + dr) of its rows (device arrays throughout):

    * q_normed (T, Rq) <- rmsnorm(projected[:, :Rq], q_weight, eps) (Rq = ``q_rank``; 0: none),
    * cache_latent slot P + t <- rmsnorm(projected[t, Rq:Rq + R], kv_weight, eps),
    * cache_rope slot P + t <- projected[t, Rq + R:] rotated at positions[t] (``rotated``),

    with P = start[0]: the bits of ``rmsnorm``, ``apply_rope`` and ``LatentKVCache.write`` in
    turn, in one launch instead of four (replayed in a graph, the forward got 1 to 13 µs shorter
    on the H200: ``docs/results/profile-h200-2026-12-03b.md``). The caller keeps the slots inside
    the cache.
    """
    check_new_rows(projected, q_rank, q_weight, kv_weight, positions, inv_freq, cache_latent, cache_rope,
                   start, q_normed)
    rank = cache_latent.shape[1]
    q_threads = reduction_threads(q_rank, ROW_THREADS) if q_rank else 0       # rmsnorm's defaults
    kv_threads = reduction_threads(rank, ROW_THREADS)
    threads = max(q_threads, kv_threads)
    if projected.shape[0]:
        new_rows_kernel(threads, q_threads, kv_threads)[projected.shape[0], threads, stream](
            projected, q_rank, q_weight if q_rank else kv_weight, kv_weight, float(eps), positions, inv_freq,
            float(scale), cache_latent, cache_rope, start,
            q_normed if q_rank else projected)           # Rq = 0: placeholders the kernel never reads
# --8<-- [end:write_new_rows]


def check_compact(cache: LatentKVCache, start: int, accepted):
    """``ddtree.kv_cache.check_accepted`` (a device ``accepted`` is copied to the host first: it
    decides the new length), and a cache whose latent and rope live on the same side."""
    if is_device_array(accepted):
        accepted = accepted.copy_to_host()
    accepted = check_accepted(cache, start, accepted)                         # [m] int64
    if is_device_array(cache.latent) != is_device_array(cache.rope):
        raise ValueError("cache.latent and cache.rope must both be numpy arrays or both device arrays")
    return accepted


# --8<-- [start:compact]
def compact(cache: LatentKVCache, start: int, accepted, *, stream=None, version: int = 2) -> None:
    """Keep only the accepted tree rows: slot ``start + j`` <- slot ``start + accepted[j]``.

    ``cache.latent`` / ``cache.rope`` may be numpy arrays (the tree's window of slots is copied
    to the device and back) or device arrays (compacted in place, no host copy of the cache).
    ``accepted`` is tiny and decides the new length on the host, so a device ``accepted`` is
    copied to the host. ``stream`` is where the kernels are launched (None: the default stream).
    ``version``: 2 (the default) one launch, a thread per column; 1 gathers through scratch and
    writes back (two launches). The same bits either way (a copy).
    """
    check_version(version, VERSIONS)
    accepted = check_compact(cache, start, accepted)                          # [m] int64
    kept = accepted.size
    if np.any(accepted != np.arange(kept)):                                   # fast path: nothing to move
        on_device = is_device_array(cache.latent)
        window = slice(start, start + int(accepted[-1]) + 1)                  # the tree rows that matter
        latent = cache.latent if on_device else to_device(cache.latent[:, window])   # [Ly, C or span, R]
        rope = cache.rope if on_device else to_device(cache.rope[:, window])         # [Ly, C or span, dr]
        layers = latent.shape[0]
        first, path = to_device(np.array([start if on_device else 0], np.int64)), to_device(accepted[None])
        count = to_device(np.array([kept], np.int64))
        if version == 2:
            launch_compact_columns(latent, rope, first, path, count, stream)
        else:
            scratch = (poisoned((layers, kept, latent.shape[2]), stream=stream),      # [Ly, m, R]
                       poisoned((layers, kept, rope.shape[2]), stream=stream))        # [Ly, m, dr]
            launch_compact(latent, rope, first, path, count, *scratch, kept, stream)
        if not on_device:
            cache.latent[:, start:start + kept] = latent.copy_to_host()[:, :kept]
            cache.rope[:, start:start + kept] = rope.copy_to_host()[:, :kept]
    cache.truncate(start + kept)
# --8<-- [end:compact]


def bytes_moved(*, Ly: int, R: int, dr: int, m: int, moved: int) -> int:
    """Fewest bytes ``compact`` moves: the ``moved`` accepted rows not already in place (of the m)
    read once and written once in each of the Ly layers (R + dr floats), and the m accepted
    indices (int64). Version 2 moves exactly these; version 1 moves the rows twice, through
    scratch."""
    return 2 * F32 * moved * Ly * (R + dr) + I64 * m


def flops(*, Ly: int, R: int, dr: int, m: int, moved: int) -> int:
    """Floating-point operations: none (a copy)."""
    return 0


def bench_cases(sizes):
    """This module's cases of ``python -m kernels.bench``: compact a verified tree's accepted path,
    version 2 (one launch) and version 1 (gather through scratch, then write back)."""
    return [_compact_case(sizes, 2), _compact_case(sizes, 1)]


def _compact_case(sizes, version: int):
    from kernels.bench.case import (  # lazily: kernels.bench imports this module
        Case,
        accepted_path,
        uniform,
        verified_tree,
    )

    config, tree = sizes.config, verified_tree(sizes)
    layers, capacity = sizes.kv_layers, sizes.kv_capacity
    rank, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
    accepted = accepted_path(tree, sizes.accepted_len)                          # [m] node indices
    moved = int(np.count_nonzero(accepted != np.arange(accepted.size)))        # rows not in place
    if moved == 0:
        raise RuntimeError(f"the accepted path {accepted.tolist()} is already in place: nothing to time")
    start = capacity // 2                                                       # the tree's first slot

    def setup(seed):
        cache = LatentKVCache(layers, 1, 1, 1)             # a host shell; the rows live on the device
        cache.latent = uniform((layers, capacity, rank), seed)                  # [Ly, C, R]
        cache.rope = uniform((layers, capacity, rope_dim), seed + 1)            # [Ly, C, dr]
        return cache, start, accepted, tree.size

    def call(inputs):
        cache, first, path, nodes = inputs
        cache.length = first + nodes           # verification appended the tree; compaction cuts it back
        return compact(cache, first, path, version=version)

    def prepare(inputs):                       # the engine's device buffers: start, path, count (+ scratch)
        kept = accepted.size
        given = (cuda.to_device(np.array([start], np.int64)), cuda.to_device(accepted[None]),
                 cuda.to_device(np.array([kept], np.int64)))
        return given if version == 2 else (*given, poisoned((layers, kept, rank)),
                                           poisoned((layers, kept, rope_dim)))

    def launch(inputs, given, stream):         # what the engine's round launches: no host copy
        cache = inputs[0]
        if version == 2:
            launch_compact_columns(cache.latent, cache.rope, *given, stream)
        else:
            launch_compact(cache.latent, cache.rope, *given, accepted.size, stream)

    size_gb = layers * capacity * (rank + rope_dim) * F32 / 1e9
    dims = {"Ly": layers, "R": rank, "dr": rope_dim, "m": accepted.size, "moved": moved}
    kernels = "one launch, a thread per column" if version == 2 else \
        f"two launches, all {accepted.size} rows through scratch"
    return Case("kv_compact" + ("" if version == 2 else "_v1"),
                f"keep a {accepted.size}-node accepted path of a {tree.size}-node tree, {layers} layers",
                f"cache ({layers}, {capacity}, {rank}+{rope_dim}) {size_gb:.2f} GB",
                setup=setup, call=call, bytes=bytes_moved(**dims), flops=flops(**dims),
                note=f"version {version}: {kernels}; bytes: {moved} rows moved",
                footprint=round(size_gb * 1e9), prepare=prepare, launch=launch)
