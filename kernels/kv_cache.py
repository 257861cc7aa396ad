"""The latent KV cache on the GPU: the engine's cache (``DeviceCache``), a forward's new rows
(``write_new_rows``) and the compaction, the numba.cuda twins of ``LatentKVCache`` and
``ddtree.kv_cache.compact``.

Legend: Ly layers, C capacity (slots), R kv_lora_rank, dr qk_rope_head_dim, m accepted nodes,
TPB threads per block.

Kernels:
- ``compact_columns_kernel``: the accepted path kept, slot ``start + j`` <- slot
  ``start + accepted[j]``, then length = start + m; P, accepted and m read from device arrays (the
  engine's round end runs ``compact_column`` inside its own kernel). A thread per row would race
  (``accepted[j] >= j``: the row one thread reads can be the row another writes, chapter 10), so
  one thread owns a column of one layer (Ly x (R + dr) threads, no scratch) and replays numpy's
  loop for it, j in increasing order: slot P + s is written by step s only, after every step that
  reads it. Its batches of COMPACT_BATCH reads read slots accepted[j] >= j, past what earlier
  batches wrote.
- ``new_rows_kernel`` (``write_new_rows``): a forward's new rows into one layer's cache at slots
  P .. P + T - 1 (P read from a device array; what ``LatentKVCache.write`` does), fused with what
  comes before it, one block per row: the query latent's and the key-value latent's RMSNorms
  (``rmsnorm_kernel``'s bits) and the rope key's rotation (``rotated``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from ddtree.kv_cache import LatentKVCache, check_accepted
from kernels.blocks import block_sums
from kernels.device import check_float32, is_device_array, poisoned, reduction_threads, to_device
from kernels.rmsnorm import ROW_THREADS
from kernels.rope import rotated
from kernels.tuning import COMPACT_BATCH

TPB = 128
NEW_ROWS_BATCH = 4      # new_rows_kernel: a thread's loads issued before their adds (or stores)


# --8<-- [start:DeviceCache]
class DeviceCache:
    """The latent KV cache on the device: the twin of ``ddtree.kv_cache.LatentKVCache``.

    ``latent`` (Ly, C, R) and ``rope`` (Ly, C, dr) are device arrays; ``length`` mirrors the
    device's state[LENGTH] on the host (the engine updates both). Rows past ``length`` are
    scratch: a forward writes its whole bucket there, and only the committed rows count.
    """

    def __init__(self, num_layers: int, capacity: int, latent_dim: int, rope_dim: int):
        self.latent = poisoned((num_layers, capacity, latent_dim))   # [Ly, C, R]
        self.rope = poisoned((num_layers, capacity, rope_dim))       # [Ly, C, dr]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    def to_host(self) -> LatentKVCache:
        """A numpy copy (for tests and chapters; copies the whole cache)."""
        layers, capacity, rank = self.latent.shape
        host = LatentKVCache(layers, capacity, rank, self.rope.shape[2])
        host.latent[:] = self.latent.copy_to_host()
        host.rope[:] = self.rope.copy_to_host()
        host.length = self.length
        return host
# --8<-- [end:DeviceCache]


# --8<-- [start:compact_columns_kernel]
@cuda.jit(device=True)
def compact_column(cache_latent, cache_rope, index, first, accepted, kept):
    """Column ``index`` of the Ly x (R + dr) columns (R latent, then dr rope; past them: nothing) runs numpy's
    loop: slot first + j <- slot first + accepted[j], j = 0 .. kept - 1 in order (``accepted`` a 1-D row,
    global or shared), rows in place skipped. Reads COMPACT_BATCH rows into registers, then writes them."""
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
    """Thread (layer, column) of the Ly x (R + dr) columns runs numpy's loop for its column
    (``compact_column``), P = start[0], m = count[0], the path accepted[0]. No shared memory; the
    grid may have spare threads (they return)."""
    compact_column(cache_latent, cache_rope, cuda.grid(1), start[0], accepted[0], count[0])
# --8<-- [end:compact_columns_kernel]


def launch_compact_columns(cache_latent, cache_rope, start, accepted, count, stream=None) -> None:
    """The compaction's one launch on device arrays: cache (Ly, C, R) / (Ly, C, dr), start and
    count (1,), accepted (1, >= m)."""
    columns = cache_latent.shape[0] * (cache_latent.shape[2] + cache_rope.shape[2])
    compact_columns_kernel[(columns + TPB - 1) // TPB, TPB, stream](cache_latent, cache_rope, start,
                                                                    accepted, count)


# --8<-- [start:new_rows_kernel]
@cuda.jit(device=True)
def _squares(x, row, first, count, start, step, values):
    """The sum of x[row, first + d]^2 for d = start, start + step, ... < count, in that order, its
    loads issued NEW_ROWS_BATCH at a time before their adds (``values``: the batch's registers)."""
    acc = float32(0.0)
    for base in range(start, count, step * NEW_ROWS_BATCH):
        for b in range(NEW_ROWS_BATCH):                 # past count: the last column again, not added
            values[b] = x[row, first + min(base + b * step, count - 1)]
        for b in range(NEW_ROWS_BATCH):
            if base + b * step < count:
                acc += values[b] * values[b]
    return acc


@cuda.jit(device=True)
def _normed(x, row, first, count, start, step, inv_rms, weight, out, out_row, values, scales):
    """out[out_row, d] = x[row, first + d] * inv_rms * weight[d] for d = start, start + step, ... < count:
    rmsnorm_kernel's products, the loads of a batch of NEW_ROWS_BATCH issued before its stores."""
    for base in range(start, count, step * NEW_ROWS_BATCH):
        for b in range(NEW_ROWS_BATCH):
            d = min(base + b * step, count - 1)
            values[b], scales[b] = x[row, first + d], weight[d]
        for b in range(NEW_ROWS_BATCH):
            if base + b * step < count:
                out[out_row, base + b * step] = values[b] * inv_rms * scales[b]


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
        values = cuda.local.array(NEW_ROWS_BATCH, float32)   # a batch of loads in flight, then their use
        scales = cuda.local.array(NEW_ROWS_BATCH, float32)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        rank = cache_latent.shape[1]
        half = cache_rope.shape[1] // 2
        slot = start[0] + t

        q_acc = float32(0.0)
        if tid < q_threads:
            q_acc = _squares(projected, t, 0, q_rank, tid, q_threads, values)
        kv_acc = float32(0.0)
        if tid < kv_threads:
            kv_acc = _squares(projected, t, q_rank, rank, tid, kv_threads, values)
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
            _normed(projected, t, 0, q_rank, tid, threads, inv_rms, q_weight, q_normed, t, values, scales)
        mean_square = sums[1, 0] / float32(rank)
        inv_rms = float32(1.0) / math.sqrt(mean_square + float32(eps))
        _normed(projected, t, q_rank, rank, tid, threads, inv_rms, kv_weight, cache_latent, slot, values,
                scales)

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
    turn, in one launch instead of four. The caller keeps the slots inside the cache.
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
def compact(cache: LatentKVCache, start: int, accepted, *, stream=None) -> None:
    """Keep only the accepted tree rows: slot ``start + j`` <- slot ``start + accepted[j]``.

    ``cache.latent`` / ``cache.rope`` may be numpy arrays (the tree's window of slots is copied
    to the device and back) or device arrays (a ``DeviceCache``: compacted in place, no host copy
    of the cache). ``accepted`` is tiny and decides the new length on the host, so a device
    ``accepted`` is copied to the host. ``stream`` is where the kernel is launched (None: the
    default stream). One launch, a thread per column (``compact_columns_kernel``).
    """
    accepted = check_compact(cache, start, accepted)                          # [m] int64
    kept = accepted.size
    if np.any(accepted != np.arange(kept)):                                   # fast path: nothing to move
        on_device = is_device_array(cache.latent)
        window = slice(start, start + int(accepted[-1]) + 1)                  # the tree rows that matter
        latent = cache.latent if on_device else to_device(cache.latent[:, window])   # [Ly, C or span, R]
        rope = cache.rope if on_device else to_device(cache.rope[:, window])         # [Ly, C or span, dr]
        first, path = to_device(np.array([start if on_device else 0], np.int64)), to_device(accepted[None])
        launch_compact_columns(latent, rope, first, path, to_device(np.array([kept], np.int64)), stream)
        if not on_device:
            cache.latent[:, start:start + kept] = latent.copy_to_host()[:, :kept]
            cache.rope[:, start:start + kept] = rope.copy_to_host()[:, :kept]
    cache.truncate(start + kept)
# --8<-- [end:compact]
