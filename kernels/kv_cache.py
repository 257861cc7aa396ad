"""KV compaction on the GPU: the numba.cuda twin of ``ddtree.kv_cache.compact``.

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
the launch boundary orders every read before every write. If ``accepted == arange(m)``, every
row is already in place: nothing is launched.

One kernel, ``copy_rows_kernel``: one block per (row j, layer), the threads stride over the
R latent and then the dr rope columns: ``dst[layer, dst_rows[j]] = src[layer, src_rows[j]]``.
Bytes: 2 launches x m rows x Ly layers x (R + dr) x 4 bytes, each read once and written once
(``bytes_moved`` counts the fewest: the rows that move, read and written once).

``compact`` decides the new length on the host and allocates its scratch and row lists per call:
it takes a ``stream`` but no ``out`` (the cache is compacted in place), and it cannot be captured
in a CUDA graph as it is.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ddtree.kv_cache import LatentKVCache, check_accepted
from kernels.device import is_device_array, poisoned, to_device

TPB = 128
F32, I64 = 4, 8


# --8<-- [start:copy_rows_kernel]
@cuda.jit
def copy_rows_kernel(src_latent, src_rope, src_rows, dst_latent, dst_rope, dst_rows):
    """Block (j, layer): copy row src_rows[j] of src to row dst_rows[j] of dst, latent and rope.

    A thread copies columns tid, tid + TPB, ...; no shared memory.
    """
    j = cuda.blockIdx.x
    layer = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    src = src_rows[j]
    dst = dst_rows[j]
    for c in range(tid, src_latent.shape[2], threads):
        dst_latent[layer, dst, c] = src_latent[layer, src, c]
    for c in range(tid, src_rope.shape[2], threads):
        dst_rope[layer, dst, c] = src_rope[layer, src, c]
# --8<-- [end:copy_rows_kernel]


def _gather_then_write(latent, rope, start: int, accepted: np.ndarray, stream) -> None:
    """Two launches on device arrays latent (Ly, S, R) and rope (Ly, S, dr), in place."""
    layers, kept = latent.shape[0], accepted.size
    grid = (kept, layers)
    scratch_latent = poisoned((layers, kept, latent.shape[2]), stream=stream)   # [Ly, m, R]
    scratch_rope = poisoned((layers, kept, rope.shape[2]), stream=stream)       # [Ly, m, dr]
    rows = np.arange(kept, dtype=np.int64)                                      # [m] 0..m-1
    copy_rows_kernel[grid, TPB, stream](latent, rope, to_device(start + accepted),        # 1. gather
                                        scratch_latent, scratch_rope, to_device(rows))
    copy_rows_kernel[grid, TPB, stream](scratch_latent, scratch_rope, to_device(rows),    # 2. write back
                                        latent, rope, to_device(start + rows))


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
    to the device and back) or device arrays (compacted in place, no host copy of the cache).
    ``accepted`` is tiny and decides the new length on the host, so a device ``accepted`` is
    copied to the host. ``stream`` is where the kernels are launched (None: the default stream).
    """
    accepted = check_compact(cache, start, accepted)                          # [m] int64
    kept = accepted.size
    if np.any(accepted != np.arange(kept)):                                   # fast path: nothing to move
        if is_device_array(cache.latent):
            _gather_then_write(cache.latent, cache.rope, start, accepted, stream)
        else:
            window = slice(start, start + int(accepted[-1]) + 1)              # the tree rows that matter
            latent = to_device(cache.latent[:, window])                       # [Ly, span, R]
            rope = to_device(cache.rope[:, window])                           # [Ly, span, dr]
            _gather_then_write(latent, rope, 0, accepted, stream)
            cache.latent[:, start:start + kept] = latent.copy_to_host()[:, :kept]
            cache.rope[:, start:start + kept] = rope.copy_to_host()[:, :kept]
    cache.truncate(start + kept)
# --8<-- [end:compact]


def bytes_moved(*, Ly: int, R: int, dr: int, m: int, moved: int) -> int:
    """Fewest bytes ``compact`` moves: the ``moved`` accepted rows not already in place (of the m)
    read once and written once in each of the Ly layers (R + dr floats), and the m accepted
    indices (int64). The kernel moves more: it gathers all m rows through scratch."""
    return 2 * F32 * moved * Ly * (R + dr) + I64 * m


def flops(*, Ly: int, R: int, dr: int, m: int, moved: int) -> int:
    """Floating-point operations: none (a copy)."""
    return 0


def bench_cases(sizes):
    """This module's case of ``python -m kernels.bench``: compact a verified tree's accepted path."""
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
        return compact(cache, first, path)

    size_gb = layers * capacity * (rank + rope_dim) * F32 / 1e9
    dims = {"Ly": layers, "R": rank, "dr": rope_dim, "m": accepted.size, "moved": moved}
    return [Case("kv_compact", f"keep a {accepted.size}-node accepted path of a {tree.size}-node tree, "
                 f"{layers} layers", f"cache ({layers}, {capacity}, {rank}+{rope_dim}) {size_gb:.2f} GB",
                 setup=setup, call=call, bytes=bytes_moved(**dims), flops=flops(**dims),
                 note=f"bytes: {moved} rows moved; the kernel gathers all {accepted.size} through scratch",
                 footprint=round(size_gb * 1e9))]
