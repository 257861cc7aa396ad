"""Mixture of experts with DeepSeek-V3 routing: the numba.cuda twin of ``ddtree/moe.py``.

Legend: T tokens, D hidden_size, E routed experts, G groups, k experts per token,
F moe_intermediate_size, S the router's depth slices, TPB threads per block.

The router (``route``): the logits in S = ceil(D / LOGIT_SLICE) depth slices
(``logit_slices_kernel``), then one block per token picks its k experts by rank in numpy's order
(``route_ranks_kernel``, ``_route_parts``); a few tokens on a small grid run both steps in one
launch (``route_one_kernel``). A logit depends on D alone, never on T.

The routed experts (``version=`` of ``moe`` and ``swiglu``):
- version 3, the default and what the engine runs, grouped by expert: ``expert_lists_kernel``
  lists each expert's (token, slot) pairs from the routed ids; in the hidden and down kernels
  (``expert_lanes_kernels``) a block takes an expert and a pass of its pairs, so the expert's
  weights are read once per pass, not once per pair, each dot product in ``kernels.linear``'s
  "warps" order. ``combine_kernel`` adds each token's k slots in slot order. A few tokens need no
  lists: a block per (token, slot) pair, its expert read from the router's ids (``by_slot``,
  ``block_pairs``). The launch shape (``lane_shape``) changes no sum.
- version 1, the readable one: a block per (token, slot) pair and "tiles" sums (``tile_dots``),
  two launches, the slots added in slot order by the down kernel. Other bits than version 3's
  (another order of the same terms).
Every sum runs in an order fixed by its own row: a token's result depends neither on the tokens
beside it nor on how many share its experts (the engine's tree rows equal its AR rows, bit for
bit). No grid depends on the routing, so the launches can be captured in a CUDA graph.

A dense SwiGLU (the dense layers, the shared expert) is the same two expert kernels with one
"expert" that every row chooses with weight 1. Inputs are numpy or device arrays (results come
back alike); with ``device_params``, ``out``, a ``scratch`` (``moe_scratch``, ``dense_scratch``)
and device inputs nothing is allocated or copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import numpy as np
from numba import cuda, float32, int32

from ddtree import moe as reference
from ddtree.config import ModelConfig
from ddtree.moe import MoEParams
from kernels import tuning
from kernels.blocks import blocks, check_threads, pow2_threads
from kernels.device import (
    SIMULATOR,
    check_float32,
    check_out,
    check_version,
    deliver,
    filled,
    host_or_device,
    is_device_array,
    output,
    poisoned,
    to_device,
)
from kernels.graphs import fork, join
from kernels.linear import (
    LANES,
    LANES_PADDED,
    MAX_SLICES,
    ROWS_PER_PASS,
    index,
    k_slices,
    lane_sums,
    pass_dots,
    pass_rows,
    row_passes,
    tile_dots,
)

MAX_EXPERTS = 1024      # router shared arrays hold one score per expert (DeepSeek 256, Kimi 384)
MAX_GROUPS = 64         # ... and one score per group (DeepSeek 8)
TPB = 128               # combine_kernel's threads per block (one per output element)
LIST_TPB = 32 if SIMULATOR else 128   # expert_lists_kernel's: tokens per chunk (any size: same lists)
VERSIONS = (1, 3)       # the expert kernels: 1 per (token, slot) pair, 3 grouped by expert with "warps"' sums
LOGIT_SLICE = 512       # the router's depth slices (S = ceil(D / 512): a function of D only)
COLUMNS = 64            # the router's columns of experts, whose bests prune the ranking
MAX_CANDIDATES = MAX_EXPERTS + COLUMNS     # ... at most C columns of ceil(E / C) experts
ROUTE_TPB = 512         # route_ranks_kernel's largest default block (a thread per expert up to 512)
# route_ranks' default block: ROUTE_TPB on a GPU whatever E (more threads share each ranking's
# comparisons); in the simulator a thread per expert (each thread is a Python thread)
ROUTE_RANKS_THREADS = 32 if SIMULATOR else ROUTE_TPB
ROUTE_ONE_EXPERTS = 8          # route_one_kernel: experts per block (EB), a slice of their weights staged
ROUTE_ONE_CHUNKS = LOGIT_SLICE // LANES    # ... a slice's chunks of LANES columns
ROUTE_ONE_BATCH = 8            # ... weights a thread loads before it stores them (512 threads: all)
ROUTE_ONE_STAGED = ROUTE_ONE_CHUNKS * ROUTE_ONE_EXPERTS * LANES_PADDED   # ... its staged weights
ROUTE_ONE_X = ROUTE_ONE_CHUNKS * LANES_PADDED                            # ... and x's slice
F32 = 4
listed_dots_one = tile_dots(1, listed=True)          # version 1: one pair's "tiles" sums
slice_dots = tile_dots(ROWS_PER_PASS, sliced=True)    # the router: a pass of rows, one depth slice
# version 3's launch shapes (warps per block, outputs per warp, W loads in flight per output row and
# lane; ``lane_shape``): none changes a sum. The simulator's: one warp a block (each thread a Python
# thread), 16 outputs a warp.
# Below tuning.LANE_WIDE_FROM_ROWS rows the shape goes by the pass, R = pass_rows(T) pairs (a decode
# row's kernels: R = 1), each the fastest on small's matrices (``python -m kernels.bench shapes``); a
# dense SwiGLU (the shared experts, a dense layer: one "expert", no other experts' blocks beside its
# own) keeps more loads in flight per column.
LANES_SIMULATED_MOE = (1, 16, 2)
LANE_BY_PASS = {1: (4, 2, 16), 2: (4, 4, 8), 4: (4, 4, 4), 8: (4, 4, 8)}
LANE_BY_PASS_DENSE = {1: (4, 2, 16), 2: (4, 2, 16), 4: (4, 2, 8), 8: (4, 4, 8)}
LANE_WIDE = (4, 8, 2)


# --8<-- [start:sigmoid_scalar]
@cuda.jit(device=True)
def sigmoid_scalar(z):
    """1 / (1 + exp(-z)) of one float32 without overflow: exp is only taken of a non-positive number
    (``ddtree.moe.sigmoid`` is the array version)."""
    if z >= float32(0.0):
        return float32(1.0) / (float32(1.0) + math.exp(-z))
    e = math.exp(z)
    return e / (float32(1.0) + e)
# --8<-- [end:sigmoid_scalar]


@cuda.jit(device=True)
def silu_times(gate, up):
    """silu(gate) * up = gate * sigmoid(gate) * up, one hidden feature of a SwiGLU."""
    return gate * sigmoid_scalar(gate) * up


# --- the router: sliced logits, top-k by rank ----------------------------------------------------

@cuda.jit(device=True)
def _choose(logit, bias, e, score, choice):
    """score[e] = sigmoid(logit); choice[e] = score[e] + bias[e] (the bias only chooses)."""
    score[e] = sigmoid_scalar(logit)
    choice[e] = score[e] + bias[e]


@cuda.jit(device=True)
def _sorts_after(value, other):
    """True when ``value`` comes after ``other`` in np.sort's ascending order: NaN last."""
    return value > other or (math.isnan(value) and not math.isnan(other))


@cuda.jit(device=True)
def _top_two_sum(choice, first_expert, end):
    """The sum of the two largest choice[first_expert:end] (a group has at least two experts) in
    np.sort's order, as the reference's np.sort(...)[-2:].sum(): a group holding a NaN scores NaN."""
    first = choice[first_expert]
    second = choice[first_expert + 1]
    if _sorts_after(second, first):
        first, second = second, first
    for e in range(first_expert + 2, end):
        if _sorts_after(choice[e], first):
            second = first
            first = choice[e]
        elif _sorts_after(choice[e], second):
            second = choice[e]
    return second + first


@cuda.jit(device=True)
def _picked_total(score, picked, top_k):
    """The unbiased scores of the k picks, added in slot order."""
    total = float32(0.0)
    for j in range(top_k):
        total += score[picked[j]]
    return total


@cuda.jit(device=True)
def _weight(score, expert, total, norm_topk_prob, scaling):
    """A pick's weight: its unbiased score, over the picks' ``total`` if normalised, scaled."""
    w = score[expert]
    if norm_topk_prob:
        w = w / (total + float32(1e-20))
    return w * scaling


# --8<-- [start:logit_slices_kernel]
@cuda.jit
def logit_slices_kernel(x, gate, parts):
    # parts[t, s, e] = x[t, d0:d1] . gate[e, d0:d1] for depth slice s (d0 = s * LOGIT_SLICE): one
    # block = experts e0 .. e0 + 31 (blockIdx.x; lane = e) of slice blockIdx.y, for the passes of
    # ROWS_PER_PASS rows blockIdx.z, blockIdx.z + gridDim.z, ...; the block's warps split the slice
    # (kernels.linear's tile_dots over the slice: the "tiles" sums, with S times the blocks). S
    # and every slice's sums depend on D only: batch-invariant
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    acc = cuda.local.array(ROWS_PER_PASS, float32)
    consecutive = cuda.local.array(1, int32)     # slice_dots' row list, unused: rows t0 .. t0 + count - 1
    s = cuda.blockIdx.y
    d0 = s * LOGIT_SLICE
    d1 = min(d0 + LOGIT_SLICE, x.shape[1])
    e0 = cuda.blockIdx.x * LANES
    e = e0 + cuda.threadIdx.x
    for t0 in range(cuda.blockIdx.z * ROWS_PER_PASS, x.shape[0], cuda.gridDim.z * ROWS_PER_PASS):
        count = min(ROWS_PER_PASS, x.shape[0] - t0)
        slice_dots(x, t0, count, consecutive, gate, e0, d0, d1, acc, w_tile, x_tile, partial)
        if cuda.threadIdx.x < LANES and e < gate.shape[0]:
            for r in range(ROWS_PER_PASS):
                if r < count:
                    parts[t0 + r, s, e] = acc[r]
# --8<-- [end:logit_slices_kernel]


# --8<-- [start:route_ranks_kernel]
@cuda.jit(device=True)
def comes_before(value, index, other_value, other_index):
    """True when (value, index) comes before (other_value, other_index) in the reference's order,
    np.argsort(-values, kind="stable") (``ddtree.moe.topk_lowest_index``): a larger value first,
    equals by the lower index, NaN after every number (numpy sorts NaN last), NaNs by index.
    An index of -1 is "no entry": it comes after everything. (``kernels.blocks.comes_first`` is
    np.argmax's order, where NaN comes first.)"""
    if index < 0:
        return False
    if other_index < 0:
        return True
    if math.isnan(value):
        return math.isnan(other_value) and index < other_index
    if math.isnan(other_value):
        return True
    return value > other_value or (value == other_value and index < other_index)


@cuda.jit(device=True)
def _ranks(values, indices, count, ranks):
    """ranks[i] = how many of the ``count`` entries (values[j], indices[j]) come before entry i
    (``comes_before``): its place in the reference's descending order, exact, ties and NaN
    included, whatever order the entries are stored in.

    Entry i gets TPB // count threads (at least one), each counting the entries j of one stride;
    their counts are added with shared-memory atomics (integers: the same sum in any order).
    Starts with a barrier (entries written before the call are seen) and ends with one."""
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    for i in range(tid, count, threads):
        ranks[i] = 0
    cuda.syncthreads()
    parts = max(1, threads // count)
    for work in range(tid, count * parts, threads):
        i, part = work % count, work // count
        value, entry = values[i], indices[i]
        before = 0
        for j in range(part, count, parts):
            if comes_before(values[j], indices[j], value, entry):
                before += 1
        cuda.atomic.add(ranks, i, before)
    cuda.syncthreads()


@cuda.jit(device=True)
def _summed_scores(parts, bias, token, score, choice):
    """1. Thread e (strided over E): the logit is its S depth slices added in slice order;
    score and choice (``_choose``)."""
    for e in range(cuda.threadIdx.x, parts.shape[2], cuda.blockDim.x):
        logit = parts[token, 0, e]
        for s in range(1, parts.shape[1]):
            logit += parts[token, s, e]
        _choose(logit, bias, e, score, choice)
    cuda.syncthreads()


@cuda.jit(device=True)
def _mask_groups(choice, experts, n_group, topk_group, group_score, group_index, group_rank):
    """2. Thread g scores group g by its two best choices (``_top_two_sum``); ``_ranks`` orders
    the groups; the experts of all but the topk_group best get choice -inf, as the reference's
    np.where(keep, choice, -inf): still eligible, after every kept number and before a NaN."""
    tid = cuda.threadIdx.x
    size = experts // n_group
    for g in range(tid, n_group, cuda.blockDim.x):
        group_score[g] = _top_two_sum(choice, g * size, (g + 1) * size)
        group_index[g] = g
    _ranks(group_score, group_index, n_group, group_rank)
    for e in range(tid, experts, cuda.blockDim.x):
        if group_rank[e // size] >= topk_group:
            choice[e] = -math.inf
    cuda.syncthreads()


@cuda.jit(device=True)
def _candidates(choice, experts, top_k, best_value, best_index, column_rank, candidate_value,
                candidate_index):
    """3. The experts that can be among the top k, in at most k columns; returns their count.

    Column c holds experts c, c + C, ... (C = min(TPB, COLUMNS) columns of ceil(E / C)); thread c
    finds its best (``comes_before``) and ``_ranks`` orders the C bests. The column whose best has
    rank r < k copies its experts to slots r * ceil(E / C) + i (index -1 past E). A top-k expert
    is a candidate: every column best before its own column's best comes before it too, so fewer
    than k do. Its rank among the candidates is its rank: the experts before it are top-k ones,
    candidates all. Any other candidate has the k top-k experts before it."""
    tid = cuda.threadIdx.x
    columns = min(cuda.blockDim.x, COLUMNS)
    per_column = (experts + columns - 1) // columns
    if tid < columns:
        value, best = float32(0.0), -1                       # -1: no expert seen yet
        for e in range(tid, experts, columns):
            if comes_before(choice[e], e, value, best):
                value, best = choice[e], e
        best_value[tid] = value
        best_index[tid] = best
    _ranks(best_value, best_index, columns, column_rank)
    if tid < columns and column_rank[tid] < top_k:
        for i in range(per_column):
            e = tid + i * columns
            slot = column_rank[tid] * per_column + i
            candidate_value[slot] = choice[e] if e < experts else float32(0.0)
            candidate_index[slot] = e if e < experts else -1
    return min(top_k, columns) * per_column


@cuda.jit(device=True)
def _route_parts(parts, bias, token, n_group, topk_group, norm_topk_prob, scaling, ids, weights):
    """The block routes token ``token`` from its sliced router logits (T, S, E): ids[t, :] (k) and
    weights[t, :] (k), every pick by its rank: no pick waits on another.

    1. ``_summed_scores``. 2. With G > 1 groups, ``_mask_groups``. 3. ``_candidates``: the k best
    columns' experts. 4. ``_ranks`` of the candidates: the candidate of rank r < k is pick r. 5.
    Thread j < k weighs pick j (the total in slot order). With E <= C experts (COLUMNS) every
    expert is a column of its own, so 3 and 4 are one ``_ranks`` of all E (fewer barriers); more
    experts keep the columns (a ranking of all E would compare E^2 pairs). Cost: two rankings
    (columns, candidates; a third for groups) of a few comparisons per thread each, six barriers
    (nine with groups), none of them per pick.
    """
    tid = cuda.threadIdx.x
    experts, top_k = parts.shape[2], ids.shape[1]
    score = cuda.shared.array(MAX_EXPERTS, dtype=float32)               # [E] sigmoid(gate x)
    choice = cuda.shared.array(MAX_EXPERTS, dtype=float32)              # [E] score + bias, or -inf
    group_score = cuda.shared.array(MAX_GROUPS, dtype=float32)          # [G] sum of the top-2 choices
    group_index = cuda.shared.array(MAX_GROUPS, dtype=int32)            # [G] g
    group_rank = cuda.shared.array(MAX_GROUPS, dtype=int32)             # [G]
    best_value = cuda.shared.array(COLUMNS, dtype=float32)              # [C] a column's best choice
    best_index = cuda.shared.array(COLUMNS, dtype=int32)                # [C] ... and its expert
    column_rank = cuda.shared.array(COLUMNS, dtype=int32)               # [C]
    candidate_value = cuda.shared.array(MAX_CANDIDATES, dtype=float32)  # choices of the k best columns
    candidate_index = cuda.shared.array(MAX_CANDIDATES, dtype=int32)    # ... their experts (-1: none)
    candidate_rank = cuda.shared.array(MAX_CANDIDATES, dtype=int32)
    picked = cuda.shared.array(MAX_EXPERTS, dtype=int32)                # [k] the picks, in order

    _summed_scores(parts, bias, token, score, choice)
    if n_group > 1:
        _mask_groups(choice, experts, n_group, topk_group, group_score, group_index, group_rank)
    if experts <= COLUMNS:                  # a column per expert: the columns' ranks are the ranks
        for e in range(tid, experts, cuda.blockDim.x):
            candidate_index[e] = e
        _ranks(choice, candidate_index, experts, candidate_rank)
        count = experts
    else:
        count = _candidates(choice, experts, top_k, best_value, best_index, column_rank,
                            candidate_value, candidate_index)
        _ranks(candidate_value, candidate_index, count, candidate_rank)
    for i in range(tid, count, cuda.blockDim.x):
        if candidate_rank[i] < top_k:
            picked[candidate_rank[i]] = candidate_index[i]
    cuda.syncthreads()
    for j in range(tid, top_k, cuda.blockDim.x):                       # 5. weights, in parallel
        total = _picked_total(score, picked, top_k)
        ids[token, j] = picked[j]
        weights[token, j] = _weight(score, picked[j], total, norm_topk_prob, scaling)


@cuda.jit
def route_ranks_kernel(parts, bias, n_group, topk_group, norm_topk_prob, scaling, ids, weights):
    """One block routes one token (blockIdx.x) from its sliced router logits (``_route_parts``)."""
    _route_parts(parts, bias, cuda.blockIdx.x, n_group, topk_group, norm_topk_prob, scaling, ids, weights)
# --8<-- [end:route_ranks_kernel]


# --8<-- [start:route_one_kernel]
@cuda.jit(device=True)
def _staged_at(chunk, expert, column):
    """Where ``route_one_kernel`` stages weight (expert, chunk * LANES + column) of its slice: rows
    of LANES + 1 floats, so that a warp's 32 sums (8 experts x 4 parts) read 32 distinct banks."""
    return (chunk * ROUTE_ONE_EXPERTS + expert) * LANES_PADDED + column


@cuda.jit
def route_one_kernel(x, gate, bias, n_group, topk_group, norm_topk_prob, scaling, slice_parts, parts,
                     arrivals, ids, weights):
    """The router for a few tokens in one launch: ``logit_slices_kernel``'s sums, then the block
    of a token that finishes last routes that token (``_route_parts``).

    Block (x, y, z) = experts e0 = x EB .. e0 + EB - 1 of depth slice y for token z. Its threads stage the EB
    experts' weights of the slice (ROUTE_ONE_BATCH loads in flight each) and x's slice; thread
    (part p, expert e), p < W = ``slice_parts`` (the launch's ``k_slices``), sums chunks p, p + W, ... of
    LANES columns, each in column order, as warp p of ``tile_dots`` does; thread e adds its W sums in part
    order into parts[z, y, e]: logit_slices_kernel's bits. Then the block counts itself in arrivals[z] behind
    a fence; the token's block that arrives last sees every slice (a fence after its count orders its reads
    after the others' writes), routes the token and sets arrivals[z] back to 0. A token whose E and D fit one
    block routes itself after a barrier. EB = 8 experts per block where logit_slices_kernel has 32: four times
    the blocks reading the gate (``tuning.ROUTE_ONE_MAX_BYTES`` bounds the tokens, whose blocks each read it).
    """
    w_tile = cuda.shared.array(ROUTE_ONE_STAGED, float32)     # [chunk, EB, LANES + 1] (``_staged_at``)
    x_tile = cuda.shared.array(ROUTE_ONE_X, float32)          # [chunk, LANES + 1]
    partial = cuda.shared.array((MAX_SLICES, ROUTE_ONE_EXPERTS), float32)   # [W, EB] the parts' sums
    last = cuda.shared.array(1, int32)                                      # 1: this block came last
    staged = cuda.local.array(ROUTE_ONE_BATCH, float32)
    tid, threads = index(cuda.threadIdx.x), index(cuda.blockDim.x)   # every index below is >= 0
    experts, s, token = gate.shape[0], index(cuda.blockIdx.y), index(cuda.blockIdx.z)   # (``index``)
    d0 = s * LOGIT_SLICE
    depth = min(LOGIT_SLICE, x.shape[1] - d0)
    e0 = index(cuda.blockIdx.x) * ROUTE_ONE_EXPERTS
    for base in range(tid, ROUTE_ONE_EXPERTS * LOGIT_SLICE, threads * ROUTE_ONE_BATCH):
        for b in range(ROUTE_ONE_BATCH):    # all loads, then their stores; element i: expert i // SLICE,
            i = base + b * threads          # column i % SLICE (a constant divisor: shifts, not divisions)
            staged[b] = gate[min(e0 + i // LOGIT_SLICE, experts - 1), d0 + min(i % LOGIT_SLICE, depth - 1)]
        for b in range(ROUTE_ONE_BATCH):    # past the slice or the block's experts: loaded, not stored
            i = base + b * threads
            k = i % LOGIT_SLICE
            if i < ROUTE_ONE_EXPERTS * LOGIT_SLICE and k < depth:
                w_tile[_staged_at(k // LANES, i // LOGIT_SLICE, k % LANES)] = staged[b]
    for k in range(tid, depth, threads):
        x_tile[k // LANES * LANES_PADDED + k % LANES] = x[token, d0 + k]
    cuda.syncthreads()
    if tid < ROUTE_ONE_EXPERTS * slice_parts:
        e, p = tid % ROUTE_ONE_EXPERTS, tid // ROUTE_ONE_EXPERTS
        acc = float32(0.0)
        for c in range(p, (depth + LANES - 1) // LANES, slice_parts):
            width = min(LANES, depth - c * LANES)
            x_at, w_at = index(c * LANES_PADDED), index(_staged_at(c, e, 0))
            if width == LANES:              # a whole chunk, a fixed trip count: its loads issued together
                for kk in range(LANES):
                    acc += x_tile[x_at + kk] * w_tile[w_at + kk]
            else:
                for kk in range(width):
                    acc += x_tile[x_at + kk] * w_tile[w_at + kk]
        partial[p, e] = acc
    cuda.syncthreads()
    if tid < ROUTE_ONE_EXPERTS and e0 + tid < experts:
        total = partial[0, tid]
        for other in range(1, slice_parts):
            total += partial[other, tid]
        parts[token, s, e0 + tid] = total
    if cuda.gridDim.x * cuda.gridDim.y == 1:     # the token's only block: its own parts, no count
        cuda.syncthreads()
        _route_parts(parts, bias, token, n_group, topk_group, norm_topk_prob, scaling, ids, weights)
        return
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        last[0] = cuda.atomic.add(arrivals, token, 1) == cuda.gridDim.x * cuda.gridDim.y - 1
    cuda.syncthreads()
    if last[0]:
        cuda.threadfence()                  # the acquire side: the other blocks' parts, then the reads
        _route_parts(parts, bias, token, n_group, topk_group, norm_topk_prob, scaling, ids, weights)
        if tid == 0:
            arrivals[token] = 0
# --8<-- [end:route_one_kernel]


# --- the experts, version 1 (the readable one): a block per (token, slot) pair -------------------

# --8<-- [start:expert_hidden_pairs_kernel]
@cuda.jit
def expert_hidden_pairs_kernel(x, gate_proj, up_proj, ids, hidden):
    # hidden[p, f] = silu(gate_proj[e, f] . x_t) * (up_proj[e, f] . x_t) for each pair
    # p = t * k + j, e = ids[t, j]; hidden is (T * k, F). One block = features f0 .. f0 + 31
    # (blockIdx.x; lane = f) of the pairs blockIdx.y, blockIdx.y + gridDim.y, ...: the block's warps
    # split D (tile_dots over one listed row, the pair's token: the expert's W tile staged in shared
    # memory for this pair alone, each lane's sums sequential in d)
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    gate = cuda.local.array(1, float32)
    up = cuda.local.array(1, float32)
    token = cuda.local.array(1, int32)                   # the pair's x row
    slots = ids.shape[1]
    f0 = cuda.blockIdx.x * LANES
    f = f0 + cuda.threadIdx.x
    for pair in range(cuda.blockIdx.y, hidden.shape[0], cuda.gridDim.y):
        token[0] = pair // slots
        expert = ids[token[0], pair % slots]
        listed_dots_one(x, 0, 1, token, gate_proj[expert], f0, gate, w_tile, x_tile, partial)
        listed_dots_one(x, 0, 1, token, up_proj[expert], f0, up, w_tile, x_tile, partial)
        if cuda.threadIdx.x < LANES and f < hidden.shape[1]:
            hidden[pair, f] = silu_times(gate[0], up[0])
# --8<-- [end:expert_hidden_pairs_kernel]


# --8<-- [start:expert_down_pairs_kernel]
@cuda.jit
def expert_down_pairs_kernel(hidden, down_proj, ids, weights, accumulate, out):
    # out[t, d] = (out[t, d] if accumulate else 0) + sum_j weights[t, j] * (down_proj[e, d] . hidden[p])
    # for p = t * k + j, e = ids[t, j]; hidden is (T * k, F). One block = output features
    # d0 .. d0 + 31 (blockIdx.x; lane = d) of tokens blockIdx.y, blockIdx.y + gridDim.y, ...: the
    # token's k slot dot products one after another (tile_dots), each added in slot order by the
    # lane's thread, as combine_kernel adds them: one writer per element, no atomics
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    dot = cuda.local.array(1, float32)
    pair = cuda.local.array(1, int32)                    # the slot's hidden row
    slots = ids.shape[1]
    d0 = cuda.blockIdx.x * LANES
    d = d0 + cuda.threadIdx.x
    writer = cuda.threadIdx.x < LANES and d < out.shape[1]
    for token in range(cuda.blockIdx.y, out.shape[0], cuda.gridDim.y):
        total = out[token, d] if writer and accumulate else float32(0.0)
        for slot in range(slots):
            pair[0] = token * slots + slot
            listed_dots_one(hidden, 0, 1, pair, down_proj[ids[token, slot]], d0, dot, w_tile, x_tile,
                            partial)
            total += weights[token, slot] * dot[0]
        if writer:
            out[token, d] = total
# --8<-- [end:expert_down_pairs_kernel]


# --- the experts, version 3: grouped by expert, each dot product in linear's "warps" order -------

# --8<-- [start:expert_lists_kernel]
@cuda.jit
def expert_lists_kernel(ids, lists):
    # lists[i, e] = the i-th (token, slot) pair routed to expert e, as t * k + j, in ascending
    # token order; -1 after its last. A token picks k distinct experts, so an expert has at most T
    # pairs: the T rows of lists. One block per expert e; the tokens in chunks of LIST_TPB, one
    # thread each: thread i marks the slot where token c0 + i chose e (-1: none), and the pair's
    # place in the list is the number of pairs before the chunk plus the marks before thread i
    marks = cuda.shared.array(LIST_TPB, int32)
    expert, i = cuda.blockIdx.x, cuda.threadIdx.x
    rows, slots = ids.shape
    listed = 0                                           # pairs of the chunks before this one
    for c0 in range(0, rows, LIST_TPB):
        token = c0 + i
        mark = -1
        if token < rows:
            for slot in range(slots):
                if ids[token, slot] == expert:
                    mark = slot
        marks[i] = mark
        cuda.syncthreads()
        place = listed
        for other in range(min(LIST_TPB, rows - c0)):    # every thread counts the chunk's tokens
            if marks[other] >= 0:
                if other < i:
                    place += 1
                listed += 1
        if mark >= 0:
            lists[place, expert] = token * slots + mark
        cuda.syncthreads()                               # marks are rewritten by the next chunk
    for place in range(listed + i, rows, LIST_TPB):
        lists[place, expert] = -1
# --8<-- [end:expert_lists_kernel]


# --8<-- [start:listed_rows]
@functools.cache
def listed_rows(per_pass: int):
    """The device function rows_of(lists, expert, first, per_row, rows, pairs) for passes of R =
    ``per_pass`` pairs: pairs[r] = lists[first + r, expert] and rows[r] = its row (pair //
    per_row), for the up to R pairs of one pass (lists[first, expert] is one); the entries after
    its last pair repeat it (staged, never written). Returns the pass's pair count."""
    @cuda.jit(device=True)
    def rows_of(lists, expert, first, per_row, rows, pairs):
        count = 0
        for r in range(per_pass):
            if first + r < lists.shape[0] and lists[first + r, expert] >= 0:
                count = r + 1
            pairs[r] = lists[first + count - 1, expert]
            rows[r] = pairs[r] // per_row
        return count

    return rows_of


@functools.cache
def block_pairs(per_pass: int, by_slot: bool):
    """The device function pass_of(lists, first, per_expert, per_row, rows, pairs) -> (expert,
    count) of version 3's block y = blockIdx.y: its expert and its pass from ``first`` on
    (``listed_rows``; count 0: the expert's pairs are done). ``by_slot`` (a few tokens):
    ``lists`` holds the tokens' ids flat, (1, T k), instead, and block y serves pair y alone, the
    expert ids[0, y]: T k blocks along y, where the lists need E passes (and a launch of their own)."""
    rows_of = listed_rows(per_pass)

    @cuda.jit(device=True)
    def pass_of(lists, first, per_expert, per_row, rows, pairs):
        y = cuda.blockIdx.y
        if by_slot:
            for r in range(per_pass):
                pairs[r] = y
                rows[r] = y // per_row
            return lists[0, y], 1
        expert = y // per_expert
        if lists[first, expert] < 0:
            return expert, 0
        return expert, rows_of(lists, expert, first, per_row, rows, pairs)

    return pass_of
# --8<-- [end:listed_rows]


def lane_shape(rows: int, dense: bool = False) -> tuple[int, int, int]:
    """Version 3's launch shape for T = ``rows`` rows: LANE_WIDE from ``tuning.LANE_WIDE_FROM_ROWS`` rows
    on, else the shape of its passes of R = ``pass_rows(T)`` pairs, LANE_BY_PASS[R], or LANE_BY_PASS_DENSE[R]
    for a ``dense`` SwiGLU; the simulator's own always (the same bits whatever the shape)."""
    if SIMULATOR:
        return LANES_SIMULATED_MOE
    if rows >= tuning.LANE_WIDE_FROM_ROWS:
        return LANE_WIDE
    return (LANE_BY_PASS_DENSE if dense else LANE_BY_PASS)[pass_rows(rows)]


# --8<-- [start:expert_lanes_kernels]
@functools.cache
def expert_lanes_kernels(warps: int, columns: int, unroll: int, per_pass: int = ROWS_PER_PASS,
                         by_slot: bool = False):
    """Version 3's hidden and down kernels for blocks of ``warps`` warps, ``columns`` outputs per warp,
    ``unroll`` loads in flight per W row and lane and passes of R = ``per_pass`` pairs (literals: shared and
    local array sizes); with ``by_slot``, for one token, a block per slot given the token's ids where the
    lists would be (``block_pairs``). None of them changes a sum: every output is added in "warps"' order."""
    outputs = columns * per_pass                         # a warp's (output, row) sums per pass
    per_lane = -(-outputs // LANES)                      # ... that each lane adds up
    warp_dots = pass_dots(columns, unroll, per_pass)
    share, total, written = lane_sums(warps, columns, per_pass)
    pass_of = block_pairs(per_pass, by_slot)

    @cuda.jit
    def expert_hidden_lanes_kernel(x, gate_proj, up_proj, lists, slots, per_expert, hidden):
        # hidden[p, f] = silu(gate_proj[e, f] . x_t) * (up_proj[e, f] . x_t) for each pair p = t * k + j of
        # expert e (lists[:, e]); hidden is (T * k, F). Block y = expert e = y // per_expert, its passes of R
        # pairs y % per_expert, + per_expert, ... (``block_pairs``); one warp = C = ``columns`` features
        # f0 + c (blockIdx.x: warps * C features), lane l = k = l, l + 32, ... of every dot product; then lane
        # c * R + r adds feature c's 32 lane sums for pair r in lane order (shared memory)
        sums = cuda.shared.array((warps, outputs, LANES_PADDED), float32)
        gate = cuda.local.array((columns, per_pass), float32)
        up = cuda.local.array((columns, per_pass), float32)
        gate_totals = cuda.local.array(per_lane, float32)
        w = cuda.local.array((columns, unroll), float32)
        rows = cuda.local.array(per_pass, int32)
        pairs = cuda.local.array(per_pass, int32)
        lane = cuda.threadIdx.x % LANES
        own = cuda.blockIdx.y % per_expert
        f0 = (cuda.blockIdx.x * warps + cuda.threadIdx.x // LANES) * columns
        for first in range(own * per_pass, lists.shape[0], per_expert * per_pass):
            expert, count = pass_of(lists, first, per_expert, slots, rows, pairs)
            if count == 0:
                return
            warp_dots(x, rows, count, gate_proj[expert], f0, gate, w)
            warp_dots(x, rows, count, up_proj[expert], f0, up, w)
            share(sums, gate)
            for i in range(per_lane):                    # the gate's totals, then the up's
                if written(f0, lane + i * LANES, count, hidden.shape[1]):
                    gate_totals[i] = total(sums, lane + i * LANES)
            share(sums, up)
            for i in range(per_lane):
                output = lane + i * LANES
                if written(f0, output, count, hidden.shape[1]):
                    f, r = f0 + output // per_pass, output % per_pass
                    hidden[pairs[r], f] = silu_times(gate_totals[i], total(sums, output))

    @cuda.jit
    def expert_down_lanes_kernel(hidden, down_proj, lists, per_expert, down):
        # down[p, d] = down_proj[e, d] . hidden[p] for each pair p of expert e; hidden (T * k, F),
        # down (T * k, D). The blocks and sums as expert_hidden_lanes_kernel's, over output features
        sums = cuda.shared.array((warps, outputs, LANES_PADDED), float32)
        dots = cuda.local.array((columns, per_pass), float32)
        w = cuda.local.array((columns, unroll), float32)
        rows = cuda.local.array(per_pass, int32)
        pairs = cuda.local.array(per_pass, int32)
        lane = cuda.threadIdx.x % LANES
        own = cuda.blockIdx.y % per_expert
        d0 = (cuda.blockIdx.x * warps + cuda.threadIdx.x // LANES) * columns
        for first in range(own * per_pass, lists.shape[0], per_expert * per_pass):
            expert, count = pass_of(lists, first, per_expert, 1, rows, pairs)
            if count == 0:
                return
            warp_dots(hidden, rows, count, down_proj[expert], d0, dots, w)
            share(sums, dots)
            for i in range(per_lane):
                output = lane + i * LANES
                if written(d0, output, count, down.shape[1]):
                    down[rows[output % per_pass], d0 + output // per_pass] = total(sums, output)

    return expert_hidden_lanes_kernel, expert_down_lanes_kernel
# --8<-- [end:expert_lanes_kernels]


# --8<-- [start:combine_kernel]
@cuda.jit
def combine_kernel(down, weights, accumulate, out):
    # out[t, d] = (out[t, d] if accumulate else 0) + sum_j weights[t, j] * down[t, j, d], the k
    # slots added in slot order: one thread per output element, deterministic without atomics
    index = cuda.grid(1)
    rows, width = out.shape
    if index >= rows * width:
        return
    token, d = index // width, index % width
    total = out[token, d] if accumulate else float32(0.0)
    for slot in range(weights.shape[1]):
        total += weights[token, slot] * down[token, slot, d]
    out[token, d] = total
# --8<-- [end:combine_kernel]


class DenseScratch(typing.NamedTuple):
    """Device buffers of a dense SwiGLU over T rows, for either version: one "expert" that every
    row chooses with weight 1."""
    ids: object         # [T, 1] int64, all 0: version 1's routed ids
    weights: object     # [T, 1] float32, all 1: version 1's weights
    hidden: object      # [T, 1, F] float32
    lists: object       # [T, 1] int32, lists[t, 0] = t: version 3's pairs of the one expert, the rows


class MoEScratch(typing.NamedTuple):
    """Device buffers of one MoE layer over T tokens, for either version (version 1 leaves lists
    and down alone)."""
    logits: object                  # [T, S, E] float32 router logits in S depth slices
    arrivals: object                # [T] int32 zeros: route_one_kernel's count of its finished blocks
    ids: object                     # [T, k] int64 routed experts
    weights: object                 # [T, k] float32 their weights
    hidden: object                  # [T, k, F] float32
    shared: DenseScratch | None     # the shared expert's, None without one
    lists: object                   # [T, E] int32 each expert's (token, slot) pairs, -1 after
    down: object                    # [T, k, D] float32 each pair's down projection


def dense_scratch(rows: int, features: int, stream=None) -> DenseScratch:
    """New buffers for a dense SwiGLU of ``features`` (F or Fs) over ``rows`` rows."""
    return DenseScratch(ids=filled((rows, 1), 0, np.int64, stream),
                        weights=filled((rows, 1), 1, np.float32, stream),
                        hidden=poisoned((rows, 1, features), stream=stream),
                        lists=cuda.to_device(np.arange(rows, dtype=np.int32).reshape(rows, 1), stream=stream))


def moe_scratch(rows: int, params: MoEParams, config: ModelConfig, stream=None) -> MoEScratch:
    """New buffers for ``moe`` over ``rows`` tokens (allocate once, pass as ``scratch``)."""
    top_k, features, width = config.num_experts_per_tok, params.gate_proj.shape[1], params.gate.shape[1]
    shared = params.shared_gate_proj
    return MoEScratch(logits=poisoned(logits_shape(rows, config.n_routed_experts, width), stream=stream),
                      arrivals=filled((rows,), 0, np.int32, stream),
                      ids=poisoned((rows, top_k), np.int64, stream),
                      weights=poisoned((rows, top_k), stream=stream),
                      hidden=poisoned((rows, top_k, features), stream=stream),
                      shared=None if shared is None else dense_scratch(rows, shared.shape[0], stream),
                      lists=poisoned((rows, config.n_routed_experts), np.int32, stream),
                      down=poisoned((rows, top_k, width), stream=stream))


def logit_slices(depth: int) -> int:
    """S, the depth slices of the router's logits: a function of D only (batch invariance)."""
    return blocks(depth, LOGIT_SLICE)


def logits_shape(rows: int, experts: int, depth: int) -> tuple[int, int, int]:
    """The shape of ``route``'s ``logits`` for T rows, E experts and depth D: (T, S, E), S =
    ``logit_slices(D)``."""
    return rows, logit_slices(depth), experts


def _launch_route(x, gate, bias, config: ModelConfig, threads, logits, arrivals, ids, weights,
                  stream) -> None:
    """The router on device arrays: x (T, D), gate (E, D), bias (E,) -> ``logits`` (T, S, E), then
    ids and weights (T, k). One token, or T whose gate reads stay under
    ``tuning.ROUTE_ONE_MAX_BYTES``, on at most ``tuning.ROUTE_ONE_BLOCKS_PER_SM`` blocks per SM a
    token: ``route_one_kernel``, counting each token's blocks in ``arrivals`` (int32 (T,), 0 before
    the launch and after it); else ``logit_slices_kernel`` and ``route_ranks_kernel``."""
    rows, depth = x.shape
    experts = config.n_routed_experts
    flags = (config.n_group, config.topk_group, config.norm_topk_prob, float32(config.routed_scaling_factor))
    slice_parts = k_slices(min(depth, LOGIT_SLICE))                      # W, the warps of a slice's sums
    threads = threads or pow2_threads(max(experts, ROUTE_RANKS_THREADS), ROUTE_TPB)
    one_grid = (blocks(experts, ROUTE_ONE_EXPERTS), logits.shape[1], rows)    # x over E, y over S, z over T
    few = rows == 1 or rows * F32 * gate.shape[0] * gate.shape[1] <= tuning.ROUTE_ONE_MAX_BYTES
    if few and one_grid[0] * one_grid[1] <= tuning.ROUTE_ONE_BLOCKS_PER_SM * tuning.sm_count():
        route_one_kernel[one_grid, threads, stream](x, gate, bias, *flags, slice_parts, logits, arrivals, ids,
                                                     weights)
        return
    grid = (blocks(experts, LANES), logits.shape[1], row_passes(rows))     # x over E, y over S, z over T
    logit_slices_kernel[grid, LANES * slice_parts, stream](x, gate, logits)
    route_ranks_kernel[rows, threads, stream](logits, bias, *flags, ids, weights)


def _launch_pairs(x, stacks, ids, weights, hidden, out, accumulate, stream, out_queue=None) -> None:
    """Version 1's two kernels on device arrays: x (T, D), stacks = (gate, up (E, F, D), down
    (E, D, F)), ids and weights (T, k), hidden (T, k, F) -> out (T, D), added to with ``accumulate``.
    ``out_queue``: as ``_launch_experts``'."""
    (rows, slots, features), width = hidden.shape, x.shape[1]
    gate_proj, up_proj, down_proj = stacks
    flat_hidden = hidden.reshape(rows * slots, features)
    spread = 1 if SIMULATOR else 0        # the simulator: one block walks all rows (fewer threads)
    grid = (blocks(features, LANES), spread or rows * slots)                 # x over F, y over pairs
    expert_hidden_pairs_kernel[grid, LANES * k_slices(width), stream](x, gate_proj, up_proj, ids,
                                                                      flat_hidden)
    out_stream = stream if out_queue is None else out_queue()
    grid = (blocks(width, LANES), spread or rows)                            # x over D, y over tokens
    expert_down_pairs_kernel[grid, LANES * k_slices(features), out_stream](flat_hidden, down_proj, ids,
                                                                           weights, accumulate, out)


def by_slot(rows: int, experts: int, expert_bytes: int) -> bool:
    """Whether version 3 runs a block per (token, slot) pair (``block_pairs``) among several experts
    (not a dense SwiGLU's one): for one token, and for up to ``tuning.SLOT_ROWS`` tokens where one expert's
    weights (``expert_bytes``) are under ``tuning.LARGE_EXPERT_BYTES``, since every pair then reads its
    expert's weights again (the lists' launch saved costs more where an expert is large)."""
    few = rows == 1 or (rows <= tuning.SLOT_ROWS and expert_bytes < tuning.LARGE_EXPERT_BYTES)
    return experts > 1 and few


def _launch_lanes(x, stacks, lists, hidden, down, stream, slotted: bool = False) -> None:
    """Version 3's two expert kernels on device arrays: x (T, D), stacks as ``_launch_pairs``',
    lists (T, E) -> hidden (T, k, F) and down (T, k, D), each pair's rows. ``slotted``
    (``by_slot``): ``lists`` is the tokens' ids (T, k) instead, and the kernels run a block per
    pair along y, each a pass of one pair (the same sums as in a pass of the lists)."""
    (rows, slots, features), width = hidden.shape, x.shape[1]
    gate_proj, up_proj, down_proj = stacks
    experts = lists.shape[1]
    flat_hidden, flat_down = hidden.reshape(rows * slots, features), down.reshape(rows * slots, width)
    if slotted:
        lists = lists.reshape((1, rows * slots))            # [1, T k]: pair p's expert at p
        experts = rows * slots
    # blocks along y: per_expert for each expert, one per pass of its at most T pairs (blocks past
    # its last pair return); a decode row's kernels run passes of one; by slot, one per pair
    warps, columns, unroll = lane_shape(1 if slotted else rows, dense=experts == 1 and not slotted)
    per_pass = 1 if slotted else pass_rows(rows)
    per_expert = 1 if slotted else row_passes(rows, per_pass)
    hidden_kernel, down_kernel = expert_lanes_kernels(warps, columns, unroll, per_pass, slotted)
    grid = (blocks(features, warps * columns), experts * per_expert)     # x over F
    hidden_kernel[grid, LANES * warps, stream](x, gate_proj, up_proj, lists, slots, per_expert, flat_hidden)
    grid = (blocks(width, warps * columns), experts * per_expert)        # x over D
    down_kernel[grid, LANES * warps, stream](flat_hidden, down_proj, lists, per_expert, flat_down)


def _launch_experts(x, params: MoEParams, scratch: MoEScratch, out, accumulate, version, stream,
                    out_queue=None, combine=True) -> None:
    """The routed experts on device arrays, after the router, into out (T, D) (added to it with
    ``accumulate``). Version 1: the pair kernels; version 3: lists from ids (or a block per pair,
    ``by_slot``), the grouped kernels, then each token's k slots weighed and added (the combine;
    without ``combine``, left in scratch.down for the next norm). ``out_queue``: None, or a function
    called once every other kernel is launched, returning where to launch the one that writes ``out``
    (``moe`` joins the shared expert's branch there)."""
    stacks = params.gate_proj, params.up_proj, params.down_proj
    if version == 1:
        _launch_pairs(x, stacks, scratch.ids, scratch.weights, scratch.hidden, out, accumulate, stream,
                      out_queue)
        return
    experts, features, width = params.gate_proj.shape
    if by_slot(x.shape[0], experts, 3 * features * width * F32):           # no lists: a block per pair
        _launch_lanes(x, stacks, scratch.ids, scratch.hidden, scratch.down, stream, slotted=True)
    else:
        expert_lists_kernel[experts, LIST_TPB, stream](scratch.ids, scratch.lists)
        _launch_lanes(x, stacks, scratch.lists, scratch.hidden, scratch.down, stream)
    out_stream = stream if out_queue is None else out_queue()
    if combine:
        combine_kernel[blocks(out.size, TPB), TPB, out_stream](scratch.down, scratch.weights, accumulate, out)


def _launch_dense(x, gate_proj, up_proj, down_proj, scratch: DenseScratch, out, version, stream) -> None:
    """A dense SwiGLU on device arrays as one expert that every row chooses with weight 1: (F, D)
    weights viewed as (1, F, D). Version 1 weighs each row's one slot by 1 (exact: a dot product
    starts from +0.0, so it is never -0.0, and 0 + 1 * dot is dot, bit for bit); in version 3 each
    row's one pair's down projection is its output."""
    (rows, width), features = x.shape, gate_proj.shape[0]
    stacks = (gate_proj.reshape(1, features, width), up_proj.reshape(1, features, width),
              down_proj.reshape(1, width, features))
    if version == 1:
        _launch_pairs(x, stacks, scratch.ids, scratch.weights, scratch.hidden, out, False, stream)
    else:
        _launch_lanes(x, stacks, scratch.lists, scratch.hidden, out.reshape(rows, 1, width), stream)


def _check_router_limits(config: ModelConfig, threads) -> None:
    if config.n_routed_experts > MAX_EXPERTS or config.n_group > MAX_GROUPS:
        raise ValueError(f"the router kernel holds at most {MAX_EXPERTS} experts and {MAX_GROUPS} "
                         f"groups, got {config.n_routed_experts} and {config.n_group}")
    if threads is not None:
        check_threads(threads, 1024)


def _check_scratch(scratch, name: str, **expected) -> None:
    """Each field of ``scratch`` a device array of the given (shape, dtype)."""
    for field, (shape, dtype) in expected.items():
        buffer = getattr(scratch, field)
        if not is_device_array(buffer):
            raise ValueError(f"{name}.{field} must be a device array, got {type(buffer).__name__}")
        check_out(buffer, shape, dtype, f"{name}.{field}")


def _check_dense_scratch(scratch, name: str, rows: int, features: int) -> None:
    """A ``dense_scratch(rows, features)``: both versions' buffers."""
    _check_scratch(scratch, name, ids=((rows, 1), np.int64), weights=((rows, 1), np.float32),
                   hidden=((rows, 1, features), np.float32), lists=((rows, 1), np.int32))


def check_route(x, gate, bias, config: ModelConfig, *, threads=None, out=None, logits=None, arrivals=None):
    """The reference's shapes, the router kernel's limits and block size, float32 on the device,
    ``out`` = (ids (T, k) int64, weights (T, k) float32), ``logits`` (T, S, E) (``logits_shape``).
    Returns x, gate, bias."""
    x, gate, bias = (host_or_device(a, np.float32) for a in (x, gate, bias))
    reference.check_route(x, gate, bias, config)
    _check_router_limits(config, threads)
    check_float32(x=x, gate=gate, bias=bias)
    if out is not None:
        shape = (x.shape[0], config.num_experts_per_tok)
        check_out(out[0], shape, np.int64, "out[0] (ids)")
        check_out(out[1], shape, np.float32, "out[1] (weights)")
    check_out(logits, logits_shape(x.shape[0], *gate.shape), name="logits")
    if arrivals is not None and not is_device_array(arrivals):
        raise ValueError(f"arrivals must be a device array (the kernel counts its blocks there), got "
                         f"{type(arrivals).__name__}")
    check_out(arrivals, x.shape[:1], np.int32, "arrivals")
    return x, gate, bias


# --8<-- [start:route]
def route(x, gate, bias, config: ModelConfig, *, threads: int | None = None, out=None, stream=None,
          logits=None, arrivals=None):
    """Choose k experts per token. x (T, D) -> (expert ids (T, k) int64, weights (T, k) float32).

    ``threads`` forces the routing kernel's block size, a power of two from 32 to 1024; by
    default the smallest that covers E, at most 512. ``out``: a pair (ids, weights) to write into;
    ``logits``: a device float32 buffer for the router logits, of shape ``logits_shape(T, E, D)``
    (new by default); ``arrivals``: a device int32 (T,) of zeros, the block counts of the one
    launch for a few tokens (``route_one_kernel``; new by default, zeros again after the launch);
    ``stream``: where the kernels are launched (None: the default stream).
    """
    x, gate, bias = check_route(x, gate, bias, config, threads=threads, out=out, logits=logits,
                                arrivals=arrivals)
    out_ids, out_weights = out or (None, None)
    shape = (x.shape[0], config.num_experts_per_tok)
    ids, weights = output(out_ids, shape, np.int64, stream), output(out_weights, shape, stream=stream)
    if x.shape[0]:
        logits = output(logits, logits_shape(x.shape[0], *gate.shape), stream=stream)
        if arrivals is None:                                               # route_one_kernel's counts
            arrivals = filled(x.shape[:1], 0, np.int32, stream)
        _launch_route(to_device(x, np.float32), to_device(gate, np.float32), to_device(bias, np.float32),
                      config, threads, logits, arrivals, ids, weights, stream)
    return deliver(ids, out_ids, x, gate, bias), deliver(weights, out_weights, x, gate, bias)
# --8<-- [end:route]


def check_swiglu(x, gate_proj, up_proj, down_proj, *, out=None, scratch=None, version=3):
    """``version`` in VERSIONS, the reference's shapes, float32 on the device, ``out`` (T, D),
    ``scratch`` (a ``dense_scratch``). Returns the four arrays as numpy or device arrays."""
    check_version(version, VERSIONS)
    x, gate_proj, up_proj, down_proj = (host_or_device(a, np.float32)
                                        for a in (x, gate_proj, up_proj, down_proj))
    reference.check_swiglu(x, gate_proj, up_proj, down_proj)
    check_float32(x=x, gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj)
    check_out(out, x.shape)
    if scratch is not None:
        _check_dense_scratch(scratch, "scratch", x.shape[0], gate_proj.shape[0])
    return x, gate_proj, up_proj, down_proj


# --8<-- [start:swiglu]
def swiglu(x, gate_proj, up_proj, down_proj, *, out=None, stream=None, scratch: DenseScratch | None = None,
           version: int = 3):
    """down(silu(gate x) * up x): x (T, D), gate/up (F, D), down (D, F) -> (T, D).

    ``scratch`` (from ``dense_scratch``) holds the intermediate buffers; new ones by default.
    ``version``: 3 (the default, what the engine runs) passes of rows, "warps"' sums; 1 a block per
    row, "tiles"' sums. Two launches either way.
    """
    x, gate_proj, up_proj, down_proj = check_swiglu(x, gate_proj, up_proj, down_proj,
                                                    out=out, scratch=scratch, version=version)
    (rows, width), features = x.shape, gate_proj.shape[0]
    d_out = output(out, (rows, width), stream=stream)                         # [T, D]
    if rows and width:
        _launch_dense(to_device(x, np.float32), to_device(gate_proj, np.float32),
                      to_device(up_proj, np.float32), to_device(down_proj, np.float32),
                      scratch or dense_scratch(rows, features, stream), d_out, version, stream)
    return deliver(d_out, out, x, gate_proj, up_proj, down_proj)
# --8<-- [end:swiglu]


# --8<-- [start:device_params]
def device_params(params: MoEParams) -> MoEParams:
    """``params`` with every array on the device (arrays already there are used as they are).

    Call it once and pass the result to ``moe`` to keep a layer's weights on the device; host
    ``params`` given to ``moe`` are copied on every call.
    """
    return MoEParams(**{
        field.name: None if getattr(params, field.name) is None
        else to_device(getattr(params, field.name), np.float32)
        for field in dataclasses.fields(params)})
# --8<-- [end:device_params]


def _arrays(params: MoEParams) -> dict:
    """The arrays of ``params`` by field name (a missing shared expert left out)."""
    return {field.name: getattr(params, field.name) for field in dataclasses.fields(params)
            if getattr(params, field.name) is not None}


def check_moe(x, params: MoEParams, config: ModelConfig, *, out=None, scratch=None, version=3, combine=True):
    """``version`` in VERSIONS, the reference's shapes, the router kernel's limits, float32 on the
    device, ``out`` (T, D), ``scratch`` (a ``moe_scratch``), and ``combine`` (a bool; False needs
    version 3 and a scratch, which then holds the routed experts). Returns x as numpy or a device array."""
    check_version(version, VERSIONS)
    if not isinstance(combine, bool):
        raise ValueError(f"combine must be a bool, got {combine!r}")
    if not combine and (version != 3 or scratch is None):
        raise ValueError(f"combine=False needs version 3 and a scratch (where the slots stay), got version "
                         f"{version} and scratch {'None' if scratch is None else 'given'}")
    x = host_or_device(x, np.float32)
    reference.check_moe(x, params, config)
    _check_router_limits(config, None)
    check_float32(x=x, **_arrays(params))
    check_out(out, x.shape)
    if scratch is not None:
        (rows, width), top_k, features = x.shape, config.num_experts_per_tok, params.gate_proj.shape[1]
        experts = config.n_routed_experts
        _check_scratch(scratch, "scratch", logits=(logits_shape(rows, experts, width), np.float32),
                       arrivals=((rows,), np.int32),
                       ids=((rows, top_k), np.int64), weights=((rows, top_k), np.float32),
                       hidden=((rows, top_k, features), np.float32), lists=((rows, experts), np.int32),
                       down=((rows, top_k, width), np.float32))
        if (scratch.shared is None) != (params.shared_gate_proj is None):
            raise ValueError("scratch.shared must be a dense_scratch exactly when params has a shared expert")
        if scratch.shared is not None:
            _check_dense_scratch(scratch.shared, "scratch.shared", rows, params.shared_gate_proj.shape[0])
    return x


# --8<-- [start:moe]
def moe(x, params: MoEParams, config: ModelConfig, *, out=None, stream=None,
        scratch: MoEScratch | None = None, version: int = 3, combine: bool = True):
    """Routed experts plus the shared expert. x (T, D) -> (T, D).

    Route on the device, run the shared expert into ``out``, then add each token's k routed
    experts in slot order. While a graph is captured, the shared expert is a branch of its own
    (``kernels.graphs.fork``): it runs beside the router and the routed experts, and only the
    kernel that adds them to ``out`` waits for it (the same launches and bits). Host ``params``
    are copied to the device on each call; pass ``device_params(params)`` to keep them there.
    ``scratch`` (from ``moe_scratch``) holds the intermediate buffers; new ones by default.
    ``version``: 3 (the default, what the engine runs) or 1 (see the module's docstring).
    ``combine=False`` (version 3, a scratch given) leaves the routed experts in ``scratch.down`` and
    their weights in ``scratch.weights``, not added: ``out`` holds the shared expert alone (unwritten
    without one), and the next norm adds them (``kernels.rmsnorm.rmsnorm(slots=)``, the same bits).
    """
    x = check_moe(x, params, config, out=out, scratch=scratch, version=version, combine=combine)
    rows, width = x.shape
    d_out = output(out, (rows, width), stream=stream)                         # [T, D]
    if rows and width:
        weights, d_x = device_params(params), to_device(x, np.float32)
        scratch = scratch or moe_scratch(rows, weights, config, stream)
        shared = weights.shared_gate_proj is not None
        routed, beside = fork(stream) if shared else (stream, stream)
        _launch_route(d_x, weights.gate, weights.bias, config, None, scratch.logits, scratch.arrivals,
                      scratch.ids, scratch.weights, routed)
        if shared:
            _launch_dense(d_x, weights.shared_gate_proj, weights.shared_up_proj, weights.shared_down_proj,
                          scratch.shared, d_out, version, beside)
        _launch_experts(d_x, weights, scratch, d_out, shared, version, routed,
                        out_queue=lambda: join(routed, beside), combine=combine)
    return deliver(d_out, out, x, *_arrays(params).values())
# --8<-- [end:moe]
