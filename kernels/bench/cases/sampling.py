"""The benchmark's cases of ``kernels.sampling`` and its cost model: the sampler over a verified
tree's rows, and rejection sampling over the same rows with up to 4 children per node."""

from __future__ import annotations

import zlib

import numpy as np
from numba import cuda

from kernels.bench.case import Case, uniform
from kernels.device import poisoned
from kernels.sampling import rejection_step, sample

F32, F64, I64 = 4, 8, 8


def bytes_moved(operation: str = "sample", *, T: int, V: int, K: int = 0) -> int:
    """Fewest bytes through device memory. "sample": logits (T, V) float32 read once, positions
    and tokens (T,) int64 once. "rejection_step" with K children per node, all rejected (the most
    work): logits and each node's draft row (T, V) float32 read once; work (T, 2, V) float64
    written once (the two softmaxes), then per child both rows read and the residual written, and
    the residual read by the final draw; children (T, K), positions, depths and tokens int64."""
    if operation == "sample":
        return F32 * T * V + 2 * I64 * T
    if operation == "rejection_step":
        return F32 * 2 * T * V + F64 * T * V * (2 + 3 * K + 1) + I64 * (T * K + 3 * T)
    raise ValueError(f"operation must be 'sample' or 'rejection_step', got {operation!r}")


def flops(operation: str = "sample", *, T: int, V: int, K: int = 0) -> int:
    """Floating-point operations (a log or exp counts 1, Philox's integer rounds 0): "sample" per
    entry a division, an addition and two logs; "rejection_step" (K children, all rejected) per
    entry the two softmaxes (a division, a subtraction and an exp for the sum, again and a division
    for the value: 7 each), per child two divisions, a subtraction, a max and an addition, and the
    final draw (a log, the Gumbel's two logs, an addition)."""
    if operation == "sample":
        return 4 * T * V
    if operation == "rejection_step":
        return T * V * (2 * 7 + 5 * K + 4)
    raise ValueError(f"operation must be 'sample' or 'rejection_step', got {operation!r}")


def bench_cases(sizes):
    """The cases of ``python -m kernels.bench``: ``sample`` (a tree's rows at temperature 0.8) and
    ``rejection_step`` (the same rows, half of them with 4 children, half with one)."""
    rows, vocab, depths = sizes.rows, sizes.config.vocab_size, sizes.depths
    children_per_node = min(4, vocab)
    rng = np.random.default_rng(zlib.crc32(b"rejection_step"))
    children = np.stack([rng.permutation(vocab)[:children_per_node] for _ in range(rows)]).astype(np.int64)
    children[rows // 2:, 1:] = -1                                                 # half the rows: one child
    node_depths = rng.integers(0, max(depths, 1), rows).astype(np.int64)
    positions = np.arange(1000, 1000 + rows, dtype=np.int64)

    def scalars():
        return cuda.to_device(np.array([0.8])), cuda.to_device(np.array([7], np.int64))

    return [
        Case("sample", f"sample {rows} rows of logits at temperature 0.8 (position-keyed Gumbel-max)",
             f"logits ({rows}, {vocab})",
             setup=lambda seed: (uniform((rows, vocab), seed, 4.0), cuda.to_device(positions), *scalars()),
             call=lambda inputs, **given: sample(*inputs, **given),
             bytes=bytes_moved("sample", T=rows, V=vocab), flops=flops("sample", T=rows, V=vocab)),
        Case("rejection_step", f"recursive rejection sampling at {rows} tree nodes, <= "
             f"{children_per_node} children each", f"logits ({rows}, {vocab}) draft ({depths}, {vocab})",
             setup=lambda seed: (uniform((rows, vocab), seed, 4.0), cuda.to_device(positions),
                                 cuda.to_device(children), uniform((max(depths, 1), vocab), seed + 1, 4.0),
                                 cuda.to_device(node_depths), *scalars()),
             call=lambda inputs, **given: rejection_step(*inputs, **given),
             bytes=bytes_moved("rejection_step", T=rows, V=vocab, K=children_per_node),
             flops=flops("rejection_step", T=rows, V=vocab, K=children_per_node),
             note="the public call allocates work (T, 2, V) float64", footprint=F64 * rows * 2 * vocab,
             prepare=lambda inputs: (rejection_step(*inputs), poisoned((rows, 2, vocab), np.float64)),
             launch=lambda inputs, given, stream: rejection_step(*inputs, out=given[0], work=given[1],
                                                                 stream=stream)),
    ]
