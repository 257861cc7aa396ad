"""NeoX rotary position embedding, the numba.cuda twin of ``ddtree/rope.py``.

Legend: T rows, H heads, dr rotary width (qk_rope_head_dim), dr/2 frequencies.

One kernel: one thread per (row t, head h, frequency i). It rotates the pair
(x[t, h, i], x[t, h, i + dr/2]) by the angle positions[t] * inv_freq[i] (NeoX rotate-halves).
Positions are arbitrary integers per row: the nodes of a draft tree share positions, so nothing
assumes t == position. The shared rope key (T, dr) is the case H = 1. Each element is read
once and written once, so ``out=x`` rotates in place safely.

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

from kernels.device import blocks, is_device_array, poisoned, to_device, to_host_if

THREADS = 128  # threads per block; the grid covers T * H * dr/2 (row, head, frequency) triples


# --8<-- [start:rope_kernel]
@cuda.jit
def _rope_kernel(x, positions, inv_freq, scale, out):
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

    angle = float32(positions[t]) * inv_freq[i]      # float32, like the numpy reference
    cos = math.cos(angle) * float32(scale)
    sin = math.sin(angle) * float32(scale)
    first = x[t, h, i]
    second = x[t, h, i + half]
    out[t, h, i] = first * cos - second * sin
    out[t, h, i + half] = second * cos + first * sin
# --8<-- [end:rope_kernel]


# --8<-- [start:apply_rope]
def apply_rope(x, positions, inv_freq, scale: float = 1.0, out=None):
    """Rotate ``x`` (T, dr) or (T, H, dr) NeoX-style; row t uses ``positions[t]``.

    Returns a new array, or writes into ``out`` (same shape as x, float32; may be x itself for
    an in-place rotation) and returns it. numpy in -> numpy out; device arrays stay on the device.
    """
    x = x if is_device_array(x) else np.asarray(x, dtype=np.float32)
    positions = positions if is_device_array(positions) else np.asarray(positions)
    inv_freq = inv_freq if is_device_array(inv_freq) else np.asarray(inv_freq, dtype=np.float32)
    if x.ndim < 2:
        raise ValueError(f"x must have shape (T, dr) or (T, H, dr), got shape {x.shape}")
    rows, width = x.shape[0], x.shape[x.ndim - 1]                 # (the simulator's shapes reject [-1])
    if width % 2:
        raise ValueError(f"x's last axis (dr) must be even (NeoX rotates halves), got {width}")
    if positions.shape != (rows,) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be integers of shape ({rows},), "
                         f"got {positions.dtype} of shape {positions.shape}")
    if inv_freq.shape != (width // 2,):
        raise ValueError(f"inv_freq must have shape ({width // 2},) (dr/2), got {inv_freq.shape}")
    if not (isinstance(scale, (int, float, np.floating)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    for name, array in (("x", x), ("inv_freq", inv_freq)):
        if is_device_array(array) and array.dtype != np.float32:
            raise ValueError(f"{name} must be float32 on the device, got {array.dtype}")
    if is_device_array(x) and not x.is_c_contiguous():
        raise ValueError("a device x must be C-contiguous (it is viewed as (T, H, dr))")
    if out is not None and (out.shape != x.shape or out.dtype != np.float32):
        raise ValueError(f"out must be float32 of shape {x.shape} (x's shape), "
                         f"got {out.dtype} of shape {out.shape}")
    if out is not None and not (out.is_c_contiguous() if is_device_array(out) else out.flags.c_contiguous):
        raise ValueError("out must be C-contiguous")

    d_x = to_device(x, np.float32)
    if out is not None and is_device_array(out):
        d_out = out                                               # out=x rotates in place
    else:
        d_out = poisoned(x.shape)                                 # NaN until written
    heads = math.prod(x.shape[1:x.ndim - 1])                      # (T, dr) is (T, 1, dr)
    d_x3 = d_x.reshape(rows, heads, width)                        # [T, H, dr]
    d_out3 = d_out.reshape(rows, heads, width)
    count = rows * heads * (width // 2)                           # (row, head, frequency) triples
    if count > 0:
        _rope_kernel[blocks(count, THREADS), THREADS](
            d_x3, to_device(positions), to_device(inv_freq, np.float32), float(scale), d_out3)

    if out is None:
        return to_host_if(d_out, x, positions, inv_freq)
    if not is_device_array(out):                                  # a host out: copy the result into it
        d_out.copy_to_host(out)
    return out
# --8<-- [end:apply_rope]
