"""Multi-head latent attention (MLA), absorbed form: the numba.cuda twin of ``ddtree/mla.py``.

Legend: T new rows, P fully visible prefix rows, S = P + T keys, H heads,
dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, R kv_lora_rank.

Kernels (one version each):
- ``absorb_query_kernel``: q_lat = W_UK^T q_nope, one thread per output element (t, h, r).
- ``attention_absorb_kernel``: masked softmax attention over the latent cache, one block per
  (row, head), online softmax over key tiles of one key per thread.
- ``absorb_output_kernel``: o = W_UV o_lat, one thread per output element (t, h, v).

Only the absorbed form is implemented here, on purpose. The numpy module also has
``attention_naive``, which expands every cached latent into per-head keys and values
(S * H * (dn + dv) floats per layer); it is there to prove the absorption exact, and the model
runs it only with the numpy backend, so it has no kernel twin.

Inputs are numpy arrays (the results come back as numpy) or numba device arrays (the results
stay on the device). ``visible`` (T, T) is a small bool mask that is checked on the host by
``ddtree.mla.check_visibility`` (a device mask is copied back first), so bad masks raise exactly
the numpy reference's errors; the kernel gets it as uint8.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32  # the package __init__ has already chosen GPU or simulator

from ddtree.mla import check_visibility
from kernels.device import (
    blocks,
    check_float32,
    is_device_array,
    poisoned,
    pow2_threads,
    row_threads,
    to_device,
    to_host_if,
)

THREADS = 128            # most threads per block of the element-wise projection kernels
MAX_TILE = 128           # largest attention block: keys per tile = threads per block
TILE_SIZES = (32, 64, 128)  # attention block sizes (powers of two, for the tree reductions)






def _check_ndim(name: str, x, ndim: int, legend: str) -> None:
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must be {legend}, got shape {tuple(x.shape)}")


# --8<-- [start:absorb_query_kernel]
@cuda.jit
def absorb_query_kernel(q_nope, w_uk, q_lat):
    """q_lat[t, h, r] = sum_n q_nope[t, h, n] * W_UK[h, n, r].

    One thread computes one output element (t, h, r) with a float32 loop over dn; blockIdx.y is
    the (row, head) pair, so a block's threads read one q_nope vector (broadcast) and consecutive
    r of each W_UK row (coalesced). No shared memory. Cost: T*H*R threads of dn multiply-adds;
    W_UK (H*dn*R floats) is read once per row t, from L2 after the first row.
    """
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row = cuda.blockIdx.y // q_nope.shape[1]
    head = cuda.blockIdx.y % q_nope.shape[1]
    if r >= q_lat.shape[2]:
        return
    acc = float32(0.0)
    for n in range(q_nope.shape[2]):
        acc += q_nope[row, head, n] * w_uk[head, n, r]
    q_lat[row, head, r] = acc
# --8<-- [end:absorb_query_kernel]


# --8<-- [start:absorb_output_kernel]
@cuda.jit
def absorb_output_kernel(o_lat, w_uv, out):
    """out[t, h, v] = sum_r o_lat[t, h, r] * W_UV[h, v, r].

    One thread computes one output element (t, h, v) with a float32 loop over R; blockIdx.y is the
    (row, head) pair. No shared memory. Cost: T*H*dv threads of R multiply-adds; each thread walks
    one contiguous W_UV row, so neighbouring threads read addresses R floats apart (served by L1
    lines, not coalesced); W_UV (H*dv*R floats) is read once per row t.
    """
    v = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row = cuda.blockIdx.y // o_lat.shape[1]
    head = cuda.blockIdx.y % o_lat.shape[1]
    if v >= out.shape[2]:
        return
    acc = float32(0.0)
    for r in range(o_lat.shape[2]):
        acc += o_lat[row, head, r] * w_uv[head, v, r]
    out[row, head, v] = acc
# --8<-- [end:absorb_output_kernel]


# --8<-- [start:block_max]
@cuda.jit(device=True)
def block_max(red):
    """Tree reduction: red[0] = max(red[:blockDim.x]); blockDim.x must be a power of two.

    Starts and ends with a barrier, so the caller may write ``red`` just before and read
    ``red[0]`` just after.
    """
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            red[tid] = max(red[tid], red[tid + stride])
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:block_max]


# --8<-- [start:block_sum]
@cuda.jit(device=True)
def block_sum(red):
    """Tree reduction: red[0] = sum(red[:blockDim.x]) in a fixed order (deterministic)."""
    tid = cuda.threadIdx.x
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            red[tid] = red[tid] + red[tid + stride]
        cuda.syncthreads()
        stride //= 2
# --8<-- [end:block_sum]


# --8<-- [start:attention_absorb_kernel]
@cuda.jit
def attention_absorb_kernel(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, scale, o_lat):
    """One block computes o_lat[row, head, :] (R) for one query row and one head.

    Online softmax over tiles of blockDim.x keys: in each tile, thread j scores key start + j
    (a float32 dot over R + dr against the query held in shared memory), the block reduces the
    tile's max and (after rescaling to the new running max) its sum of exp, and then thread i
    updates the accumulator entries r = i, i + blockDim.x, ...: acc[r] = acc[r] * alpha +
    sum_j p_j c_j[r]. A tile-at-a-time loop keeps shared memory independent of the context
    length (a whole score row would need S floats: 16 KiB at 4k keys, too much at 100k+).

    Masked keys are skipped, never computed with: their score is not formed, their
    probability is exactly 0 and their cache row is never read (it may even hold NaN). A tile
    without a visible key is skipped whole. Every row sees at least one key (checked on the
    host), so the running sum ends >= 1: no division by zero, no exp of -inf arithmetic.

    Shared memory: dynamic (2R + dr floats) = the query q_lat | q_pe (R + dr) and the output
    accumulator (R); static: p (the tile's probabilities) and red (reduction scratch), blockDim.x
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
    p = cuda.shared.array(MAX_TILE, dtype=float32)        # [tile] probabilities, 0 if masked
    red = cuda.shared.array(MAX_TILE, dtype=float32)      # [tile] reduction scratch

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
        visible_key = key < keys and (key < prefix_len or visible[row, key - prefix_len] != 0)
        score = float32(0.0)
        if visible_key:
            for i in range(rank):
                score += query[i] * cache_latent[key, i]
            for i in range(rope_dim):
                score += query[rank + i] * cache_rope[key, i]
            score *= scale
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

        count = min(tile, keys - start)
        for i in range(tid, rank, tile):
            total = acc[i] * alpha
            for j in range(count):
                if p[j] > float32(0.0):     # masked keys (p = 0) are never read
                    total += p[j] * cache_latent[start + j, i]
            acc[i] = total
        cuda.syncthreads()                   # p and red are rewritten by the next tile

    for i in range(tid, rank, tile):
        o_lat[row, head, i] = acc[i] / run_sum
# --8<-- [end:attention_absorb_kernel]


# --8<-- [start:absorb_query]
def absorb_query(q_nope, w_uk):
    """q_nope (T, H, dn), W_UK (H, dn, R) -> q_lat (T, H, R)."""
    _check_ndim("q_nope", q_nope, 3, "(T, H, dn)")
    rows, heads, nope = q_nope.shape
    if len(w_uk.shape) != 3 or tuple(w_uk.shape[:2]) != (heads, nope):
        raise ValueError(f"w_uk must be (H, dn, R) = ({heads}, {nope}, R), got shape {tuple(w_uk.shape)}")
    check_float32(q_nope=q_nope, w_uk=w_uk)
    rank = w_uk.shape[2]
    out = poisoned((rows, heads, rank))                                       # [T, H, R]
    if rows * heads * rank:
        threads = row_threads(rank)
        absorb_query_kernel[(blocks(rank, threads), rows * heads), threads](
            to_device(q_nope, np.float32), to_device(w_uk, np.float32), out)
    return to_host_if(out, q_nope, w_uk)
# --8<-- [end:absorb_query]


# --8<-- [start:absorb_output]
def absorb_output(o_lat, w_uv):
    """o_lat (T, H, R), W_UV (H, dv, R) -> o (T, H, dv)."""
    _check_ndim("o_lat", o_lat, 3, "(T, H, R)")
    rows, heads, rank = o_lat.shape
    if len(w_uv.shape) != 3 or w_uv.shape[0] != heads or w_uv.shape[2] != rank:
        raise ValueError(f"w_uv must be (H, dv, R) = ({heads}, dv, {rank}), got shape {tuple(w_uv.shape)}")
    check_float32(o_lat=o_lat, w_uv=w_uv)
    value_dim = w_uv.shape[1]
    out = poisoned((rows, heads, value_dim))                                  # [T, H, dv]
    if rows * heads * value_dim:
        threads = row_threads(value_dim)
        absorb_output_kernel[(blocks(value_dim, threads), rows * heads), threads](
            to_device(o_lat, np.float32), to_device(w_uv, np.float32), out)
    return to_host_if(out, o_lat, w_uv)
# --8<-- [end:absorb_output]


# --8<-- [start:attention_absorb]
def attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, scale, *, threads=None):
    """Absorbed attention over the latent cache.

    q_lat (T, H, R), q_pe (T, H, dr) rotated; cache_latent (>=S, R) and cache_rope (>=S, dr)
    hold the prefix in rows [0, P) and the new rows in [P, P+T). Returns o_lat (T, H, R).
    ``threads`` (32, 64 or 128) is the block size, which is also the key tile; by default the
    smallest that covers the S keys.
    """
    _check_ndim("q_lat", q_lat, 3, "(T, H, R)")
    rows, heads, rank = q_lat.shape
    if is_device_array(visible):
        visible = visible.copy_to_host()
    visible = check_visibility(prefix_len, visible, rows)        # the numpy reference's errors
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
        raise ValueError(f"prefix_len must be a non-negative integer, got {prefix_len!r}")
    prefix_len = int(prefix_len)
    keys = prefix_len + rows
    _check_ndim("q_pe", q_pe, 3, "(T, H, dr)")
    if tuple(q_pe.shape[:2]) != (rows, heads):
        raise ValueError(f"q_pe must be (T, H, dr) = ({rows}, {heads}, dr), got shape {tuple(q_pe.shape)}")
    rope_dim = q_pe.shape[2]
    for name, cache, width in (("cache_latent", cache_latent, rank), ("cache_rope", cache_rope, rope_dim)):
        if len(cache.shape) != 2 or cache.shape[1] != width or cache.shape[0] < keys:
            raise ValueError(f"{name} must be (>= prefix_len + T = {keys}, {width}), "
                             f"got shape {tuple(cache.shape)}")
    if threads is None:
        threads = pow2_threads(keys, MAX_TILE)
    if threads not in TILE_SIZES:
        raise ValueError(f"threads must be one of {TILE_SIZES}, got {threads!r}")
    check_float32(q_lat=q_lat, q_pe=q_pe, cache_latent=cache_latent, cache_rope=cache_rope)

    out = poisoned((rows, heads, rank))                                       # [T, H, R]
    if rows * heads * rank:
        if not is_device_array(cache_latent):
            cache_latent = cache_latent[:keys]     # copy only the S rows the kernel reads
        if not is_device_array(cache_rope):
            cache_rope = cache_rope[:keys]
        shared_bytes = (2 * rank + rope_dim) * 4
        attention_absorb_kernel[(heads, rows), threads, 0, shared_bytes](
            to_device(q_lat, np.float32), to_device(q_pe, np.float32),
            to_device(cache_latent, np.float32), to_device(cache_rope, np.float32),
            prefix_len, cuda.to_device(visible.astype(np.uint8)), np.float32(scale), out)
    return to_host_if(out, q_lat, q_pe, cache_latent, cache_rope)
# --8<-- [end:attention_absorb]
