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
- ``write_rows_kernel``: a forward's new rows into one layer's cache at slots P .. P + T - 1, P
  read from a device array (the twin of ``LatentKVCache.write``; the engine's graphs hold it).

``compact`` decides the new length on the host: it takes a ``stream`` but no ``out`` (the cache
is compacted in place).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from ddtree.kv_cache import LatentKVCache, check_accepted
from kernels.blocks import row_threads
from kernels.device import SIMULATOR, check_version, is_device_array, poisoned, to_device

TPB = 128
F32, I64 = 4, 8
COMPACT_BATCH = 8          # version 2: reads in flight per thread before their writes
WRITE_ROWS_MAX_THREADS = 32 if SIMULATOR else 1024   # write_rows: up to a thread per column
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
@cuda.jit
def compact_columns_kernel(cache_latent, cache_rope, start, accepted, count):
    """Version 2: thread (layer, column) of the Ly x (R + dr) columns (R latent, then dr rope)
    runs numpy's loop for its column: slot P + j <- slot P + accepted[0, j], j = 0 .. m - 1 in
    order (P = start[0], m = count[0]), rows in place skipped. Reads COMPACT_BATCH rows into
    registers, then writes them. No shared memory; the grid may have spare threads (they return).
    """
    index = cuda.grid(1)
    rank = cache_latent.shape[2]
    width = rank + cache_rope.shape[2]
    layer = index // width
    column = index % width
    if layer >= cache_latent.shape[0]:
        return
    first = start[0]
    kept = count[0]
    values = cuda.local.array(COMPACT_BATCH, float32)
    for base in range(0, kept, COMPACT_BATCH):
        for b in range(COMPACT_BATCH):                       # reads: slots accepted[j] >= j
            j = base + b
            if j < kept and accepted[0, j] != j:
                source = first + accepted[0, j]
                values[b] = cache_latent[layer, source, column] if column < rank \
                    else cache_rope[layer, source, column - rank]
        for b in range(COMPACT_BATCH):                       # writes: slots j, read before now
            j = base + b
            if j < kept and accepted[0, j] != j:
                if column < rank:
                    cache_latent[layer, first + j, column] = values[b]
                else:
                    cache_rope[layer, first + j, column - rank] = values[b]
# --8<-- [end:compact_columns_kernel]


def launch_compact_columns(cache_latent, cache_rope, start, accepted, count, stream=None) -> None:
    """Version 2's one launch on device arrays: cache (Ly, C, R) / (Ly, C, dr), start and count
    (1,), accepted (1, >= m)."""
    columns = cache_latent.shape[0] * (cache_latent.shape[2] + cache_rope.shape[2])
    compact_columns_kernel[(columns + TPB - 1) // TPB, TPB, stream](cache_latent, cache_rope, start,
                                                                    accepted, count)


# --8<-- [start:write_rows_kernel]
@cuda.jit
def write_rows_kernel(latent, rope, cache_latent, cache_rope, start):
    """Block t: slot start[0] + t <- (latent[t] (R), rope[t] (dr)); threads stride over columns
    (a thread per column up to WRITE_ROWS_MAX_THREADS, so that no thread waits for one copy's
    load before the next: 32 threads, 18 columns each in turn, took 8 µs of a decode step's layer)."""
    t = cuda.blockIdx.x
    slot = start[0] + t
    for c in range(cuda.threadIdx.x, latent.shape[1], cuda.blockDim.x):
        cache_latent[slot, c] = latent[t, c]
    for c in range(cuda.threadIdx.x, rope.shape[1], cuda.blockDim.x):
        cache_rope[slot, c] = rope[t, c]
# --8<-- [end:write_rows_kernel]


def write_rows(latent, rope, cache_latent, cache_rope, start, *, stream=None) -> None:
    """One layer's new rows into its cache (device arrays): latent (T, R), rope (T, dr) at slots
    start[0] .. start[0] + T - 1 of cache_latent (C, R) and cache_rope (C, dr). The caller keeps
    the slots inside the cache (the engine reserves them on the host)."""
    rows = latent.shape[0]
    if rope.shape[0] != rows or cache_latent.shape[1] != latent.shape[1] \
            or cache_rope.shape[1] != rope.shape[1]:
        raise ValueError(f"latent (T, R) and rope (T, dr) must match the cache's (C, R) and (C, dr), got "
                         f"{latent.shape}, {rope.shape}, {cache_latent.shape}, {cache_rope.shape}")
    if rows:
        threads = row_threads(max(latent.shape[1], rope.shape[1]), WRITE_ROWS_MAX_THREADS)
        write_rows_kernel[rows, threads, stream](latent, rope, cache_latent, cache_rope, start)


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
