"""The benchmark's cases of ``kernels.rope`` and its cost model: q_pe of a verified tree (the
model's size: launch-bound) and of a prefill's rows (large: bandwidth-bound), each by both
versions (the default, a cos and sin per group of heads, and version 1, one per head).

Legend: T rows, H heads, dr qk_rope_head_dim."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ddtree import rope as reference
from kernels.bench.case import Case, uniform
from kernels.rope import apply_rope

F32, I64 = 4, 8


def bytes_moved(*, T: int, H: int, dr: int) -> int:
    """Fewest bytes ``apply_rope`` moves: x (T, H, dr) read once and written once, inv_freq (dr/2,)
    read once (float32), positions (T,) read once (int64)."""
    return F32 * (2 * T * H * dr + dr // 2) + I64 * T


def flops(*, T: int, H: int, dr: int) -> int:
    """Floating-point operations of the rotation: 6 per (row, head, frequency) pair (four
    multiplies, two adds); the cos and sin are not counted."""
    return 6 * T * H * (dr // 2)


def _case(name: str, what: str, config, rows: int, first: int, version: int = 2):
    heads, rope_dim = config.num_attention_heads, config.qk_rope_head_dim
    frequencies, scale = reference.inv_freq(config), reference.cos_sin_scale(config)
    positions = np.arange(first, first + rows)
    return Case(name, what, f"x ({rows}, {heads}, {rope_dim})",
                setup=lambda seed: (uniform((rows, heads, rope_dim), seed), cuda.to_device(positions),
                                    cuda.to_device(frequencies), scale),
                call=lambda inputs, **given: apply_rope(*inputs, version=version, **given),
                bytes=bytes_moved(T=rows, H=heads, dr=rope_dim), flops=flops(T=rows, H=heads, dr=rope_dim),
                note=f"version {version}; FLOPs: the rotation, sin/cos not counted")


def bench_cases(sizes):
    """q_pe of a verified tree and of a prefill's rows, each by both versions."""
    config = sizes.config
    return [case for version, suffix in ((2, ""), (1, "_v1")) for case in (
        _case(f"rope_q_pe{suffix}", f"rotate q_pe of {sizes.rows} tree rows (YaRN)", config, sizes.rows,
              sizes.verify_prefix, version),
        _case(f"rope_q_pe_large{suffix}", f"rotate q_pe of {sizes.large_rows} prefill rows (YaRN)", config,
              sizes.large_rows, 0, version))]
