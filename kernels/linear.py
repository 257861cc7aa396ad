"""Linear layers, embedding gather and greedy argmax: the numba.cuda twin of ``ddtree/linear.py``.

Legend: T rows, K input features, N output features, V vocabulary, D hidden, B threads per block.
Weights are stored (N, K) as in Hugging Face state dicts, so ``y = x @ W.T``.

``linear`` has two kernel versions; ``version=None`` picks by the number of rows:
    version "gemm": tiled shared-memory GEMM, 16 x 16 output tiles, one thread per output (T > 4)
    version "gemv": one block per output y[t, n], a block reduction over K (T <= 4: decode steps)
Bytes: W (N*K floats) dominates at decode sizes. The GEMM loads each W tile once per 16-row strip
of x and reuses every loaded element 16 times from shared memory, which pays off when many rows
share W; with T <= 4 most of its 16 x 16 threads would compute padding rows, so the GEMV instead
puts a whole block on each dot product and streams every W row once (the T blocks sharing a row
run back to back, so the rows after the first find it in L2).

``embed`` gathers table rows, one thread per output element. ``argmax`` runs one block per row
and reduces (value, index) pairs in shared memory with numpy's order: the first maximal index
wins, and NaN counts as larger than everything (np.argmax returns the first NaN).

Kernels whose shared arrays depend on B are built per block size and cached (``_gemv_kernel(B)``,
``_argmax_kernel(B)``): a shared array needs a size known when the kernel compiles.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from kernels.device import (
    blocks,
    check_float32,
    check_threads,
    is_device_array,
    poisoned,
    pow2_threads,
    to_device,
    to_host_if,
)

TILE = 16           # GEMM: a block computes a TILE x TILE tile of y with TILE x TILE threads
TILE_PADDED = 17    # TILE + 1 columns for the W tile (a shared array's shape must be a literal)
THREADS = 128       # embed: threads per block (GEMV and argmax size theirs from the work)
GEMV_MAX_ROWS = 4   # version=None uses GEMV up to this many rows, the tiled GEMM above
VERSIONS = ("gemm", "gemv")




def _host_or_device(array, dtype=None):
    """Device arrays as they are; anything else as a numpy array (of ``dtype`` when given)."""
    return array if is_device_array(array) else np.asarray(array, dtype=dtype)




def _as_rows(d_array, name: str):
    """View a device array (..., C) as (R, C): kernels index rows and columns."""
    if d_array.ndim == 2:
        return d_array
    if not d_array.is_c_contiguous():
        raise ValueError(f"a {d_array.ndim}-d device {name} must be C-contiguous (it is viewed as 2-D)")
    return d_array.reshape(-1, d_array.shape[d_array.ndim - 1])


# --8<-- [start:gemm_tiled_kernel]
@cuda.jit
def _gemm_tiled_kernel(x, weight, out):
    # one thread = one output y[t, n]; one block = a TILE x TILE tile of y (T, N)
    # shared memory, per step along K: x_tile = x[rows of the tile, k0:k0+TILE] and
    # w_tile = W[columns of the tile, k0:k0+TILE]; each loaded element is then used TILE times
    x_tile = cuda.shared.array((TILE, TILE), float32)
    w_tile = cuda.shared.array((TILE, TILE_PADDED), float32)   # +1: column reads hit distinct banks
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    rows, depth = x.shape
    outputs = weight.shape[0]
    t = cuda.blockIdx.y * TILE + ty          # the output row this thread computes
    n = cuda.blockIdx.x * TILE + tx          # the output column this thread computes
    n_load = cuda.blockIdx.x * TILE + ty     # the W row this thread loads (coalesced along K)

    acc = float32(0.0)
    for k0 in range(0, depth, TILE):
        k = k0 + tx
        if t < rows and k < depth:           # zeros outside x and W add nothing
            x_tile[ty, tx] = x[t, k]
        else:
            x_tile[ty, tx] = float32(0.0)
        if n_load < outputs and k < depth:
            w_tile[ty, tx] = weight[n_load, k]
        else:
            w_tile[ty, tx] = float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += x_tile[ty, kk] * w_tile[tx, kk]
        cuda.syncthreads()                   # before the next step overwrites the tiles
    if t < rows and n < outputs:
        out[t, n] = acc
# --8<-- [end:gemm_tiled_kernel]


# --8<-- [start:gemv_kernel]
@functools.cache
def _gemv_kernel(threads: int):
    """The GEMV kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def gemv_kernel(x, weight, out):
        # one block = one output y[t, n]; one thread = k = tid, tid + B, ... of the dot product
        # (coalesced reads of the W row); shared memory: B float32 partial sums, tree-reduced
        partial = cuda.shared.array(threads, float32)
        rows, depth = x.shape
        n = cuda.blockIdx.x // rows          # blocks of the same W row are adjacent: W is read
        t = cuda.blockIdx.x % rows           # from memory once, the other rows hit the L2 cache
        tid = cuda.threadIdx.x

        acc = float32(0.0)
        for k in range(tid, depth, threads):
            acc += x[t, k] * weight[n, k]
        partial[tid] = acc
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if tid < stride:
                partial[tid] += partial[tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            out[t, n] = partial[0]

    return gemv_kernel
# --8<-- [end:gemv_kernel]


# --8<-- [start:pick_version]
def pick_version(rows: int) -> str:
    """The ``linear`` version for ``rows`` rows when none is forced: GEMV for a few rows, else GEMM."""
    return "gemv" if rows <= GEMV_MAX_ROWS else "gemm"
# --8<-- [end:pick_version]


# --8<-- [start:linear]
def linear(x, weight, version: str | None = None, threads: int | None = None):
    """``x`` (T, K) (or (..., K)) times ``weight.T`` (K, N) -> (T, N), float32.

    ``version``: None picks "gemv" for T <= 4 rows and "gemm" otherwise; ``threads`` is the GEMV
    block size (default: the smallest power of two covering K, at most 128).
    numpy in -> numpy out; device arrays stay on the device.
    """
    x, weight = _host_or_device(x, np.float32), _host_or_device(weight, np.float32)
    if x.ndim < 1:
        raise ValueError(f"x must have shape (T, K) or (..., K), got a {x.ndim}-d array")
    depth = x.shape[x.ndim - 1]                                   # (the simulator's shapes reject [-1])
    if weight.ndim != 2 or weight.shape[1] != depth:
        raise ValueError(f"weight must have shape (N, {depth}) to match x's last axis (K), "
                         f"got {weight.shape}")
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version must be None or one of {VERSIONS}, got {version!r}")
    threads = pow2_threads(depth) if threads is None else threads
    check_threads(threads)
    check_float32(x=x, weight=weight)

    lead, outputs = x.shape[:-1], weight.shape[0]
    d_x, d_weight = _as_rows(to_device(x, np.float32), "x"), to_device(weight, np.float32)   # [T, K], [N, K]
    rows = d_x.shape[0]
    out = poisoned((rows, outputs))                               # [T, N], NaN until written
    version = pick_version(rows) if version is None else version
    if rows > 0 and outputs > 0:
        if version == "gemm":
            grid = (blocks(outputs, TILE), blocks(rows, TILE))    # x over N, y over T
            _gemm_tiled_kernel[grid, (TILE, TILE)](d_x, d_weight, out)
        else:
            _gemv_kernel(threads)[outputs * rows, threads](d_x, d_weight, out)
    if lead != (rows,):
        out = out.reshape(*lead, outputs)
    return to_host_if(out, x, weight)
# --8<-- [end:linear]


# --8<-- [start:embed_kernel]
@cuda.jit
def _embed_kernel(tokens, table, out, bad):
    # one thread = one output element out[t, d] = table[tokens[t], d] (coalesced along D)
    # an id outside [0, V) is not read (that row stays NaN); thread d = 0 raises the flag bad[0]
    count, width = out.shape
    index = cuda.grid(1)
    if index >= count * width:
        return
    t = index // width
    d = index % width
    token = tokens[t]
    if token < 0 or token >= table.shape[0]:
        if d == 0:
            bad[0] = 1
        return
    out[t, d] = table[token, d]
# --8<-- [end:embed_kernel]


def _token_range_error(tokens: np.ndarray, vocab: int) -> ValueError:
    return ValueError(f"tokens must lie in [0, {vocab}), got min {tokens.min()} max {tokens.max()}")


# --8<-- [start:embed]
def embed(tokens, table):
    """Rows of the embedding ``table`` (V, D) for ``tokens`` (T,) (any shape) -> (T, D).

    Ids outside [0, V) raise numpy's ValueError. Host tokens are checked before the launch;
    device tokens are checked by the kernel, which sets a one-int flag read back after it
    (4 bytes, and a synchronisation: the only copy to the host on the device path).
    """
    tokens, table = _host_or_device(tokens), _host_or_device(table, np.float32)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got {tokens.dtype}")
    if table.ndim != 2:
        raise ValueError(f"table must have shape (V, D), got {table.shape}")
    check_float32(table=table)
    vocab, width = table.shape
    if not is_device_array(tokens) and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise _token_range_error(tokens, vocab)

    lead = tokens.shape
    d_tokens, d_table = to_device(tokens), to_device(table, np.float32)
    if d_tokens.ndim != 1:
        if not d_tokens.is_c_contiguous():
            raise ValueError("device tokens with more than one axis must be C-contiguous")
        d_tokens = d_tokens.reshape(-1)                           # [T]
    count = d_tokens.shape[0]
    out = poisoned((count, width))                                # [T, D], NaN until written
    if count * width > 0:
        bad = cuda.to_device(np.zeros(1, dtype=np.int32))
        _embed_kernel[blocks(count * width, THREADS), THREADS](d_tokens, d_table, out, bad)
        if is_device_array(tokens) and bad.copy_to_host()[0]:
            raise _token_range_error(tokens.copy_to_host(), vocab)
    if lead != (count,):
        out = out.reshape(*lead, width)
    return to_host_if(out, tokens, table)
# --8<-- [end:embed]


# --8<-- [start:wins]
@cuda.jit(device=True)
def _wins(value, index, best_value, best_index):
    """True when (value, index) comes before (best_value, best_index) in np.argmax's order:
    NaN beats any number, a larger value beats a smaller one, and equals go to the lower index."""
    if math.isnan(value):
        return not math.isnan(best_value) or index < best_index
    if math.isnan(best_value):
        return False
    return value > best_value or (value == best_value and index < best_index)
# --8<-- [end:wins]


# --8<-- [start:argmax_kernel]
@functools.cache
def _argmax_kernel(threads: int):
    """The argmax kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def argmax_kernel(logits, out):
        # one block = one row of logits (T, V); one thread scans v = tid, tid + B, ... keeping its
        # best (value, index); shared memory: B values and B indices, tree-reduced with _wins
        best_values = cuda.shared.array(threads, float32)
        best_indices = cuda.shared.array(threads, int32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]

        best_value = float32(-math.inf)
        best_index = vocab                   # past the end: loses every tie, even with -inf
        for v in range(tid, vocab, threads):
            value = logits[row, v]
            if _wins(value, v, best_value, best_index):
                best_value = value
                best_index = v
        best_values[tid] = best_value
        best_indices[tid] = best_index
        cuda.syncthreads()

        stride = threads // 2
        while stride > 0:
            if tid < stride and _wins(best_values[tid + stride], best_indices[tid + stride],
                                      best_values[tid], best_indices[tid]):
                best_values[tid] = best_values[tid + stride]
                best_indices[tid] = best_indices[tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            out[row] = best_indices[0]

    return argmax_kernel
# --8<-- [end:argmax_kernel]


# --8<-- [start:argmax]
def argmax(logits, threads: int | None = None):
    """Greedy token per row of ``logits`` (T, V) (or (..., V)) -> int64 (T,), numpy's tie order.

    The first maximal index wins; a row holding NaN returns its first NaN, as np.argmax does.
    """
    logits = _host_or_device(logits, np.float32)
    if logits.ndim < 2:
        raise ValueError(f"logits must have shape (T, V) or (..., V), got shape {logits.shape}")
    vocab = logits.shape[logits.ndim - 1]                         # (the simulator's shapes reject [-1])
    if vocab == 0:
        raise ValueError("attempt to get argmax of an empty sequence (V = 0)")
    if vocab > np.iinfo(np.int32).max:
        raise ValueError(f"V must fit in int32 (the kernel's indices), got {vocab}")
    threads = pow2_threads(vocab) if threads is None else threads
    check_threads(threads)
    check_float32(logits=logits)

    lead = logits.shape[:-1]
    d_logits = _as_rows(to_device(logits, np.float32), "logits")   # [T, V]
    rows = d_logits.shape[0]
    out = poisoned((rows,), np.int64)                             # [T], -1 until written
    if rows > 0:
        _argmax_kernel(threads)[rows, threads](d_logits, out)
    if lead != (rows,):
        out = out.reshape(*lead)
    return to_host_if(out, logits)
# --8<-- [end:argmax]
