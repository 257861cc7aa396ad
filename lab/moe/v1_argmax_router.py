"""Router version 1, k argmax rounds: the first router written, and the readable one. The logits
come from ``kernels.linear``'s "tiles" version (one block per 32 experts and pass of 8 rows), then
``route_kernel`` routes one token per block as numpy does, step by step: sigmoid scores, the
groups kept by ``topk_group`` rounds of a block argmax, then k rounds of a block argmax over the
free experts (``_pick_free``: exact ties to the lower index), each pick waiting on the one before.
It gives the shipped router's ids (``kernels.moe.route``) and its weights to rounding, not its
bits (the shipped logits are summed in depth slices), and it puts NaN choices first (np.argmax's
order) where numpy's sort and the shipped router put them last. It was slower on both counts:
"tiles" gives Kimi's 384 experts 12 blocks a pass on a GPU of 132 SMs, each streaming 32 rows of
the 11 MB gate, and the k rounds are k chains of log2(TPB) barriers. Sliced logits (S times the
blocks) and picks by rank replaced it: Kimi's router for 16 tokens took 30.1 µs against 150 on
the H200 (``docs/results/bench-h200-2026-12-02.md`` at commit ea8fff7, moe_route against
moe_route_v1; version 2 landed in commit 8af355f).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda, float32, int32, uint8

from ddtree.config import ModelConfig, preset
from kernels.blocks import MAX_TPB, block_argmax, check_threads, comes_first, pow2_threads
from kernels.device import poisoned, to_device
from kernels.moe import (
    MAX_EXPERTS,
    MAX_GROUPS,
    _choose,
    _picked_total,
    _top_two_sum,
    _weight,
    check_route,
)
from lab.harness import Case
from lab.linear.v2_tiles import run as tiles_linear

SHIPPED = "kernels.moe.route"
TWIN = "ddtree.moe.route"
SAME_BITS = False                   # the logits are summed in another order


# --8<-- [start:pick_free]
@cuda.jit(device=True)
def _pick_free(values, free, count, best_values, best_indices):
    """The index i < count with free[i] != 0 and the largest values[i]; exact ties -> lowest i.

    Every thread gets the answer (-1 if nothing is free). Thread t first scans i = t, t + TPB, ...
    in np.argmax's order (``comes_first``), then ``block_argmax`` merges the per-thread winners.
    ``best_values``/``best_indices`` are TPB scratch slots.
    """
    tid = cuda.threadIdx.x
    mine_value = float32(0.0)
    mine_index = -1                          # -1: this thread has seen no free entry
    for i in range(tid, count, cuda.blockDim.x):
        if free[i] != 0 and comes_first(values[i], i, mine_value, mine_index):
            mine_value = values[i]
            mine_index = i
    best_values[tid] = mine_value
    best_indices[tid] = mine_index
    block_argmax(best_values, best_indices)
    winner = best_indices[0]
    cuda.syncthreads()                       # everyone has read the winner before scratch is reused
    return winner
# --8<-- [end:pick_free]


# --8<-- [start:route_kernel]
@cuda.jit(device=True)
def _scores(logits, bias, token, score, choice, free):
    """1. Thread e (strided over E): score and choice from logits[t, e] (``_choose``); every
    expert starts free."""
    for e in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        _choose(logits[token, e], bias, e, score, choice)
        free[e] = 1
    cuda.syncthreads()


@cuda.jit(device=True)
def _keep_groups(choice, free, experts, n_group, topk_group, group_score, group_free, best_values,
                 best_indices):
    """2. Thread g scores group g by its two best choices; topk_group rounds of ``_pick_free``
    keep the best groups; only the kept groups' experts stay free."""
    tid = cuda.threadIdx.x
    size = experts // n_group
    for g in range(tid, n_group, cuda.blockDim.x):
        group_score[g] = _top_two_sum(choice, g * size, (g + 1) * size)
        group_free[g] = 1
    cuda.syncthreads()
    for _ in range(topk_group):
        g = _pick_free(group_score, group_free, n_group, best_values, best_indices)
        if tid == 0:
            group_free[g] = 0                                 # kept: no longer free to pick
        cuda.syncthreads()
    for e in range(tid, experts, cuda.blockDim.x):
        free[e] = 1 - group_free[e // size]                   # experts of kept groups only
    cuda.syncthreads()


@cuda.jit(device=True)
def _weigh(score, ids, token, norm_topk_prob, scaling, weights):
    """4. (one thread) Each pick weighs its unbiased score, normalised to sum 1 if asked, scaled."""
    total = _picked_total(score, ids[token], ids.shape[1])
    for j in range(ids.shape[1]):
        weights[token, j] = _weight(score, ids[token, j], total, norm_topk_prob, scaling)


@cuda.jit
def route_kernel(logits, bias, n_group, topk_group, norm_topk_prob, scaling, ids, weights):
    """One block routes one token from its router logits (T, E): ids[t, :] (k) and weights[t, :] (k).

    1. ``_scores``: sigmoid gate scores and biased choices. 2. With G > 1 groups,
    ``_keep_groups``. 3. k rounds of ``_pick_free`` over the free experts pick ids in descending
    choice order (exact ties -> lower index, as numpy's stable argsort). 4. ``_weigh``.

    Shared memory: score, choice (E floats each), free (E bytes), group score / kept (G each),
    and TPB (value, index) argmax scratch slots. Cost: selection is k + topk_group block
    reductions of log2(TPB) barriers each.
    """
    token = cuda.blockIdx.x
    experts = logits.shape[1]
    score = cuda.shared.array(MAX_EXPERTS, dtype=float32)       # [E] sigmoid(gate x), unbiased
    choice = cuda.shared.array(MAX_EXPERTS, dtype=float32)      # [E] score + bias, picks only
    free = cuda.shared.array(MAX_EXPERTS, dtype=uint8)          # [E] 1 = may still be picked
    group_score = cuda.shared.array(MAX_GROUPS, dtype=float32)  # [G] sum of the top-2 choices
    group_free = cuda.shared.array(MAX_GROUPS, dtype=uint8)     # [G] 1 = not kept yet
    best_values = cuda.shared.array(MAX_TPB, dtype=float32)     # argmax scratch
    best_indices = cuda.shared.array(MAX_TPB, dtype=int32)      # argmax scratch

    _scores(logits, bias, token, score, choice, free)
    if n_group > 1:
        _keep_groups(choice, free, experts, n_group, topk_group, group_score, group_free,
                     best_values, best_indices)
    for j in range(ids.shape[1]):                               # 3. top-k, descending choice
        e = _pick_free(choice, free, experts, best_values, best_indices)
        if cuda.threadIdx.x == 0:
            ids[token, j] = e
            free[e] = 0
        cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        _weigh(score, ids, token, norm_topk_prob, scaling, weights)
# --8<-- [end:route_kernel]



def run(x, gate, bias, config: ModelConfig, *, threads: int | None = None):
    """``kernels.moe.route`` with "tiles" logits and k argmax rounds: (ids (T, k), weights (T, k))."""
    x, gate, bias = check_route(x, gate, bias, config)
    if threads is not None:
        check_threads(threads, MAX_TPB)                   # the argmax scratch holds MAX_TPB slots
    rows, experts = x.shape[0], config.n_routed_experts
    ids = poisoned((rows, config.num_experts_per_tok), np.int64)
    weights = poisoned((rows, config.num_experts_per_tok))
    logits = tiles_linear(to_device(x, np.float32), to_device(gate, np.float32))   # [T, E] "tiles"
    flags = (config.n_group, config.topk_group, config.norm_topk_prob, float32(config.routed_scaling_factor))
    route_kernel[rows, threads or pow2_threads(experts)](logits, to_device(bias, np.float32), *flags, ids,
                                                          weights)
    return ids.copy_to_host(), weights.copy_to_host()


def _router(config: ModelConfig, rows: int, width: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    gate = (rng.standard_normal((config.n_routed_experts, width)) / np.sqrt(width)).astype(np.float32)
    bias = (rng.standard_normal(config.n_routed_experts) * 0.1).astype(np.float32)
    return x, gate, bias, config


def cases() -> list[Case]:
    """tiny-b's routing (12 experts in 4 groups, keep 2, top-3), without groups, and exact ties
    (x = 0: every score 0.5, so the lowest indices win); random data with well-separated choices."""
    groups = preset("tiny-b")
    no_groups = dataclasses.replace(groups, n_group=1, topk_group=1)
    x, gate, bias, _ = _router(groups, 2, 7, seed=0)
    return [Case("groups", _router(groups, 5, 33, seed=38)),
            Case("no-groups-32-threads", _router(no_groups, 3, 20, seed=25), {"threads": 32}),
            Case("ties", (np.zeros_like(x), gate, np.zeros_like(bias), groups))]
