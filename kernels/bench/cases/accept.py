"""The benchmark's case of ``kernels.accept`` and its cost model: Bq trees whose deepest path is
accepted.

Legend: Bq requests, W padded tree width."""

from __future__ import annotations

import zlib

import numpy as np
from numba import cuda

from ddtree.tree import build_tree
from kernels.accept import accept_batch
from kernels.bench.case import Case, accepted_path, drafter_candidates

I64 = 8


def bytes_moved(*, Bq: int, W: int) -> int:
    """Fewest bytes ``accept_batch`` moves: tokens, parents, posterior (Bq, W) and sizes (Bq,) read
    once, accepted (Bq, W), lengths and bonus (Bq,) written once; all int64."""
    return I64 * (3 * Bq * W + Bq) + I64 * (Bq * W + 2 * Bq)


def flops(*, Bq: int, W: int) -> int:
    """Floating-point operations: none (acceptance compares token ids)."""
    return 0


def bench_cases(sizes):
    """Bq trees whose deepest path is accepted."""
    requests, budget, vocab = sizes.requests, sizes.accept_budget, sizes.config.vocab_size
    width = budget + 1
    rng = np.random.default_rng(zlib.crc32(b"accept_batch"))
    logprobs, ids = drafter_candidates(rng, requests, sizes.depths, budget, vocab)
    tokens = np.zeros((requests, width), np.int64)                            # [Bq, W] padding 0
    parents = np.full((requests, width), -1, np.int64)                        # [Bq, W] padding -1
    tree_sizes = np.zeros(requests, np.int64)
    posterior = rng.integers(0, vocab, (requests, width)).astype(np.int64)    # [Bq, W] target's picks
    for b in range(requests):
        tree = build_tree(0, logprobs[b], ids[b], budget)
        tokens[b, :tree.size], parents[b, :tree.size], tree_sizes[b] = tree.tokens, tree.parents, tree.size
        path = accepted_path(tree, 1 + int(tree.depths.max()))                # a deepest walk ...
        posterior[b, path[:-1]] = tree.tokens[path[1:]]                       # ... is what the target picks
    return [Case("accept_batch", f"greedy acceptance of {requests} trees of {width} nodes "
                 "(deepest path accepted)", f"Bq={requests} W={width}",
                 setup=lambda seed: tuple(cuda.to_device(a)
                                          for a in (tokens, parents, tree_sizes, posterior)),
                 call=lambda inputs, **given: accept_batch(*inputs, **given),
                 bytes=bytes_moved(Bq=requests, W=width), flops=flops(Bq=requests, W=width),
                 note="3 poisoned outputs")]
