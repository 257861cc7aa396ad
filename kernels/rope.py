"""NeoX rotary position embedding, the numba.cuda twin of ``ddtree/rope.py``.

Legend: T rows, H heads, dr rotary width (qk_rope_head_dim), dr/2 frequencies, TPB threads per block.

Two kernel versions, the same bits (``version``):

* version 1 (``rope_kernel``, the readable one chapter 2 starts from): one thread per (row t,
  head h, frequency i). It rotates the pair (x[t, h, i], x[t, h, i + dr/2]) by the angle
  positions[t] * inv_freq[i] (NeoX rotate-halves).
* version 2 (``rope_heads_kernel``, the default, what the engine runs): one thread per (row t,
  frequency i, group of ROPE_HEADS heads). Every head of a row turns by the same angle, so
  version 1 computes each cos and sin H times; version 2 computes them once per group and
  rotates the group's heads with them, its 2 x ROPE_HEADS loads issued before the first store.

Positions are arbitrary integers per row: the nodes of a draft tree share positions, so nothing assumes
t == position. The shared rope key (T, dr) is the case H = 1. Each element is read once and written once, by
the same thread (``bytes_moved``), so ``out=x`` rotates in place safely: the engine rotates the queries' rope
parts in place, a strided (T, H, dr) view of its q buffer. The rope key is rotated inside
``kernels.kv_cache.write_new_rows``, on its way into the cache; every kernel turns a pair with the same device
functions (``cos_sin``, ``turned``), so their bits are the same.

Angles are float32, exactly as in the numpy reference (``np.outer`` of float32 positions and
float32 inv_freq): float32(position) * inv_freq[i] is one correctly rounded float32 multiply, so
both sides feed bit-identical angles to cos and sin. What remains is the difference between two
accurate float32 cos/sin implementations (a couple of ulp of a value <= 1, at any angle), hence
~1e-6 agreement even at position 262143. Computing the angle in float64 instead would move it by
up to half a float32 ulp of the angle (|angle| * 2^-24, 8e-3 rad at 262143): not a rounding
detail but a different answer, which is why both sides must agree on float32.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ddtree import rope as reference
from kernels.blocks import blocks
from kernels.device import (
    check_float32,
    check_out,
    check_version,
    deliver,
    host_or_device,
    is_device_array,
    output,
    to_device,
)
from kernels.tuning import ROPE_HEADS

TPB = 128   # threads per block; the grid covers T * H * dr/2 (row, head, frequency) triples
VERSIONS = (1, 2)


# --8<-- [start:rope_kernel]
@cuda.jit(device=True)
def cos_sin(position, frequency, scale):
    """cos and sin of the angle position * frequency, scaled: float32 throughout, like the numpy
    reference (one float32 multiply forms the angle)."""
    angle = float32(position) * frequency
    return math.cos(angle) * float32(scale), math.sin(angle) * float32(scale)


@cuda.jit(device=True)
def turned(first, second, cos, sin):
    """The pair (first, second) turned by (cos, sin): NeoX's rotate-halves, each output one fused
    multiply-add around one product, written out: left to the compiler, which of the two products
    it fuses depends on the code around it (and two kernels could differ in the last bit)."""
    return cuda.fma(first, cos, -(second * sin)), cuda.fma(second, cos, first * sin)


@cuda.jit(device=True)
def rotated(first, second, position, frequency, scale):
    """The pair (first, second) rotated by the angle position * frequency and scaled."""
    cos, sin = cos_sin(position, frequency, scale)
    return turned(first, second, cos, sin)


@cuda.jit
def rope_kernel(x, positions, inv_freq, scale, out):
    # one thread = one (row t, head h, frequency i): rotates x[t, h, i] with x[t, h, i + dr/2]
    # x, out (T, H, dr) float32 (out may be x); positions (T,) integers; inv_freq (dr/2,) float32
    # no shared memory: each thread reads its two elements once and writes them once
    rows, heads, width = x.shape
    half = width // 2
    index = cuda.grid(1)
    if index >= rows * heads * half:
        return
    t = index // (heads * half)
    h = (index // half) % heads
    i = index % half
    out[t, h, i], out[t, h, i + half] = rotated(x[t, h, i], x[t, h, i + half], positions[t], inv_freq[i],
                                                scale)
# --8<-- [end:rope_kernel]


# --8<-- [start:rope_heads_kernel]
@cuda.jit
def rope_heads_kernel(x, positions, inv_freq, scale, out):
    # one thread = one (row t, head group g, frequency i): one cos and sin for heads
    # g ROPE_HEADS .. g ROPE_HEADS + ROPE_HEADS - 1; neighbouring threads take neighbouring i, so a
    # warp's loads of one head are dr/2 consecutive floats. The group's 2 ROPE_HEADS loads come
    # first (registers; a head past H re-reads the last, never written), then the stores: with
    # out = x the compiler may not move a load past a store, so the batch is written out by hand
    firsts = cuda.local.array(ROPE_HEADS, float32)
    seconds = cuda.local.array(ROPE_HEADS, float32)
    rows, heads, width = x.shape
    half = width // 2
    groups = (heads + ROPE_HEADS - 1) // ROPE_HEADS
    index = cuda.grid(1)
    if index >= rows * groups * half:
        return
    t = index // (groups * half)
    h0 = (index // half) % groups * ROPE_HEADS
    i = index % half
    for j in range(ROPE_HEADS):
        h = min(h0 + j, heads - 1)
        firsts[j], seconds[j] = x[t, h, i], x[t, h, i + half]
    cos, sin = cos_sin(positions[t], inv_freq[i], scale)
    for j in range(ROPE_HEADS):
        if h0 + j < heads:
            out[t, h0 + j, i], out[t, h0 + j, i + half] = turned(firsts[j], seconds[j], cos, sin)
# --8<-- [end:rope_heads_kernel]


def check_rope(x, positions, inv_freq, scale, *, out=None):
    """The reference's rules, then the launch's: float32 on the device, ``out``, and device arrays of other
    than 3 dimensions C-contiguous (they are viewed as (T, H, dr); a (T, H, dr) view, such as the engine's
    queries, may have any strides). Returns x, positions and inv_freq as numpy or device arrays."""
    x, inv_freq = host_or_device(x, np.float32), host_or_device(inv_freq, np.float32)
    positions = host_or_device(positions)
    reference.check_rope(x, positions, inv_freq, scale)
    check_float32(x=x, inv_freq=inv_freq)
    check_out(out, x.shape, strided=len(x.shape) == 3)
    if is_device_array(x) and len(x.shape) != 3 and not x.is_c_contiguous():
        raise ValueError(f"a device x of shape {tuple(x.shape)} must be C-contiguous (it is viewed as "
                         f"(T, H, dr); a (T, H, dr) view may have any strides)")
    return x, positions, inv_freq


def as_triples(array, rows: int, heads: int, width: int):
    """``array`` as (T, H, dr): a 3-D array as it is (any strides), else a reshaped view."""
    return array if len(array.shape) == 3 else array.reshape(rows, heads, width)


# --8<-- [start:apply_rope]
def apply_rope(x, positions, inv_freq, scale: float = 1.0, *, out=None, stream=None, version: int = 2):
    """Rotate ``x`` (T, dr) or (T, H, dr) NeoX-style; row t uses ``positions[t]``.

    Returns a new array, or writes into ``out`` (x's shape, float32; may be x itself for an
    in-place rotation, also of a strided (T, H, dr) device view) and returns it. numpy in ->
    numpy out; device arrays stay on the device. ``stream``: where the kernel is launched (None:
    the default stream). ``version`` 1 or 2 (the module's docstring): the same bits.
    """
    check_version(version, VERSIONS)
    x, positions, inv_freq = check_rope(x, positions, inv_freq, scale, out=out)
    rows, width = x.shape[0], x.shape[x.ndim - 1]
    heads = math.prod(x.shape[1:x.ndim - 1])                      # (T, dr) is (T, 1, dr)
    d_out = output(out, x.shape, stream=stream)                   # NaN until written
    per_row = heads if version == 1 else -(-heads // ROPE_HEADS)  # threads per (row, frequency)
    count = rows * per_row * (width // 2)
    if count > 0:
        kernel = rope_kernel if version == 1 else rope_heads_kernel
        kernel[blocks(count, TPB), TPB, stream](
            as_triples(to_device(x, np.float32), rows, heads, width), to_device(positions),
            to_device(inv_freq, np.float32), float(scale), as_triples(d_out, rows, heads, width))
    return deliver(d_out, out, x, positions, inv_freq)
# --8<-- [end:apply_rope]
