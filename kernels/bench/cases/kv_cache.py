"""The benchmark's case of ``kernels.kv_cache`` and its cost model: compact a verified tree's
accepted path in a Kimi-sized cache, as the engine's round does (one launch, a thread per column).

Legend: Ly layers, R kv_lora_rank, dr qk_rope_head_dim, m accepted nodes."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ddtree.kv_cache import LatentKVCache
from kernels.bench.case import Case, accepted_path, uniform, verified_tree
from kernels.kv_cache import compact, launch_compact_columns

F32, I64 = 4, 8


def bytes_moved(*, Ly: int, R: int, dr: int, m: int, moved: int) -> int:
    """Fewest bytes ``compact`` moves: the ``moved`` accepted rows not already in place (of the m)
    read once and written once in each of the Ly layers (R + dr floats), and the m accepted
    indices (int64). The kernel moves exactly these."""
    return 2 * F32 * moved * Ly * (R + dr) + I64 * m


def flops(*, Ly: int, R: int, dr: int, m: int, moved: int) -> int:
    """Floating-point operations: none (a copy)."""
    return 0


def bench_cases(sizes):
    """Compact a verified tree's accepted path."""
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

    def prepare(inputs):                       # the engine's device buffers: start, path, count
        return (cuda.to_device(np.array([start], np.int64)), cuda.to_device(accepted[None]),
                cuda.to_device(np.array([accepted.size], np.int64)))

    def launch(inputs, given, stream):         # what the engine's round launches: no host copy
        launch_compact_columns(inputs[0].latent, inputs[0].rope, *given, stream)

    size_gb = layers * capacity * (rank + rope_dim) * F32 / 1e9
    dims = {"Ly": layers, "R": rank, "dr": rope_dim, "m": accepted.size, "moved": moved}
    what = f"keep a {accepted.size}-node accepted path of a {tree.size}-node tree, {layers} layers"
    return [Case("kv_compact", what,
                 f"cache ({layers}, {capacity}, {rank}+{rope_dim}) {size_gb:.2f} GB",
                 setup=setup, call=call, bytes=bytes_moved(**dims), flops=flops(**dims),
                 note=f"one launch, a thread per column; bytes: {moved} rows moved",
                 footprint=round(size_gb * 1e9), prepare=prepare, launch=launch)]
