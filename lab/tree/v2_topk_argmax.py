"""Top-K version 1, K block argmaxes: after the log-softmax (the shipped kernel's ``_max_log_sum``), K
picks, each a block argmax over the row's entries after the previous pick in the order (log-prob
descending, token id ascending), so no token needs a "taken" mark and V may be any size, K too. The
shipped kernel (``kernels.tree.top_candidates_sort_kernel``) sorts the (log-prob, id) pairs once in
shared memory instead: log2(S)(log2(S) + 1)/2 barrier stages for a buffer of S pairs whatever K is,
against K x (2 + log2 TPB) barriers and K scans of the row here. The same bits; at V = 512, K = 32
(7 rows) 69.22 against 13.62 µs (docs/results/tree-build-h200-2026-12-03b.txt at commit 4ec1155),
and at Kimi's V = 163840, K = 64 (15 rows) 2885 against 622 µs (top_candidates_v1 and _v2 in
docs/results/bench-tree-h200-2026-12-01.md at commit 551c111). Only a K over half the sort buffer on
a row longer than it needed this version; the engine's K never is.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, int32

from kernels.blocks import pow2_threads
from kernels.device import to_device
from kernels.tree import _max_log_sum
from lab.harness import Case

SHIPPED = "kernels.tree.top_candidates"
TWIN = "ddtree.tree.top_candidates"
SAME_BITS = True


@functools.cache
def top_candidates_kernel(threads: int):
    """The top-K kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(logits, top_logprobs, top_ids):
        # one block = one drafter row of logits (L, V); threads stride over V. 1. the row max
        # (float32); 2. the sum of exp(logit - max) in float64, its log cast to float32 (numpy's
        # steps); 3. K picks, each a block argmax over the entries after the previous pick in the
        # order (log-prob descending, token id ascending): no "taken" marks, so V may be large
        red = cuda.shared.array(threads, float32)
        red64 = cuda.shared.array(threads, float64)
        best = cuda.shared.array(threads, int32)
        row = cuda.blockIdx.x
        row_max, log_sum = _max_log_sum(logits, row, red, red64)
        previous_value = float32(math.inf)
        previous_index = -1
        for pick in range(top_ids.shape[1]):
            previous_value, previous_index = _next_candidate(logits, row, row_max, log_sum, previous_value,
                                                             previous_index, red, best)
            if cuda.threadIdx.x == 0:
                top_logprobs[row, pick] = previous_value
                top_ids[row, pick] = previous_index

    return kernel


@cuda.jit(device=True)
def _next_candidate(logits, row, row_max, log_sum, previous_value, previous_index, red, best):
    """The best (log-prob, id) after (previous_value, previous_index) in the order log-prob
    descending, id ascending: each thread's best of its share, then a shared-memory tree."""
    tid = cuda.threadIdx.x
    mine_value = float32(-math.inf)
    mine_index = -1
    for v in range(tid, logits.shape[1], cuda.blockDim.x):
        value = (logits[row, v] - row_max) - log_sum                        # float32, as numpy
        after = value < previous_value or (value == previous_value and v > previous_index)
        if after and (mine_index < 0 or value > mine_value):
            mine_value = value
            mine_index = v
    red[tid] = mine_value
    best[tid] = mine_index
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            other = best[tid + stride]
            if other >= 0 and (best[tid] < 0 or red[tid + stride] > red[tid]
                               or (red[tid + stride] == red[tid] and other < best[tid])):
                red[tid] = red[tid + stride]
                best[tid] = other
        cuda.syncthreads()
        stride //= 2
    value, index = red[0], best[0]
    cuda.syncthreads()                           # everyone has read the winner
    return value, index


def run(logits, k):
    """(top_logprobs (L, K) float32, top_ids (L, K) int64) of host logits (L, V), by version 1."""
    logits = np.asarray(logits, np.float32)
    depths, vocab = logits.shape
    top_logprobs = cuda.device_array((depths, k), np.float32)                 # [L, K]
    top_ids = cuda.device_array((depths, k), np.int64)                        # [L, K]
    threads = pow2_threads(vocab, 1024)
    top_candidates_kernel(threads)[depths, threads](to_device(logits), top_logprobs, top_ids)
    return top_logprobs.copy_to_host(), top_ids.copy_to_host()


def cases() -> list[Case]:
    """A tie at the top and masked tokens, tied rows, K = V, and a drafter's row (every token at
    one floor but a few above it)."""
    rng = np.random.default_rng(3)
    top = rng.normal(0, 3, (3, 37)).astype(np.float32)
    top[0, 4] = top[0, 7] = top[0].max() + 1                            # a tie at the top: lower id first
    top[-1, 10:20] = -np.inf                                             # masked tokens sort last, by id
    tied = rng.choice(np.array([2.0, 0.5, 0.0, -1.5, -np.inf], np.float32), (2, 50))
    tied[:, 3] = 2.0
    floor = np.full((2, 96), -3.0, np.float32)
    floor[:, rng.choice(96, 5, replace=False)] = rng.normal(0, 1, 5).astype(np.float32)
    return [Case("tie at the top", (top, 5)), Case("tied", (tied, 12)), Case("K = V", (tied[:, :23], 23)),
            Case("floor", (floor, 16))]
