"""KV compaction on the GPU: the numba.cuda twin of ``ddtree.kv_cache.compact``.

Legend: Ly layers, C capacity (slots), R kv_lora_rank, dr qk_rope_head_dim, m accepted nodes.

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

One kernel, ``_copy_rows_kernel``: one block per (row j, layer), the threads stride over the
R latent and then the dr rope columns: ``dst[layer, dst_rows[j]] = src[layer, src_rows[j]]``.
Bytes: 2 launches x m rows x Ly layers x (R + dr) x 4 bytes, each read once and written once.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ddtree.kv_cache import LatentKVCache, check_accepted
from kernels.device import is_device_array, poisoned, to_device

THREADS = 128


# --8<-- [start:copy_rows_kernel]
@cuda.jit
def _copy_rows_kernel(src_latent, src_rope, src_rows, dst_latent, dst_rope, dst_rows):
    """Block (j, layer): copy row src_rows[j] of src to row dst_rows[j] of dst, latent and rope.

    A thread copies columns tid, tid + blockDim, ...; no shared memory.
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


def _gather_then_write(latent, rope, start: int, accepted: np.ndarray) -> None:
    """Two launches on device arrays latent (Ly, S, R) and rope (Ly, S, dr), in place."""
    layers, kept = latent.shape[0], accepted.size
    grid = (kept, layers)
    scratch_latent = poisoned((layers, kept, latent.shape[2]))                # [Ly, m, R]
    scratch_rope = poisoned((layers, kept, rope.shape[2]))                    # [Ly, m, dr]
    rows = np.arange(kept, dtype=np.int64)                                    # [m] 0..m-1
    _copy_rows_kernel[grid, THREADS](latent, rope, to_device(start + accepted),         # 1. gather
                                     scratch_latent, scratch_rope, to_device(rows))
    _copy_rows_kernel[grid, THREADS](scratch_latent, scratch_rope, to_device(rows),     # 2. write back
                                     latent, rope, to_device(start + rows))


# --8<-- [start:compact]
def compact(cache: LatentKVCache, start: int, accepted) -> None:
    """Keep only the accepted tree rows: slot ``start + j`` <- slot ``start + accepted[j]``.

    ``cache.latent`` / ``cache.rope`` may be numpy arrays (the tree's window of slots is copied
    to the device and back) or device arrays (compacted in place, no host copy of the cache).
    ``accepted`` is tiny and decides the new length on the host, so a device ``accepted`` is
    copied to the host.
    """
    if is_device_array(accepted):
        accepted = accepted.copy_to_host()
    accepted = check_accepted(cache, start, accepted)                         # [m] int64
    kept = accepted.size
    on_device = is_device_array(cache.latent)
    if on_device != is_device_array(cache.rope):
        raise ValueError("cache.latent and cache.rope must both be numpy arrays or both device arrays")
    if np.any(accepted != np.arange(kept)):                                   # fast path: nothing to move
        if on_device:
            _gather_then_write(cache.latent, cache.rope, start, accepted)
        else:
            window = slice(start, start + int(accepted[-1]) + 1)              # the tree rows that matter
            latent = to_device(cache.latent[:, window])                       # [Ly, span, R]
            rope = to_device(cache.rope[:, window])                           # [Ly, span, dr]
            _gather_then_write(latent, rope, 0, accepted)
            cache.latent[:, start:start + kept] = latent.copy_to_host()[:, :kept]
            cache.rope[:, start:start + kept] = rope.copy_to_host()[:, :kept]
    cache.truncate(start + kept)
# --8<-- [end:compact]
