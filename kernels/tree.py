"""The draft tree on the GPU: the top-K candidates, the builder (one block per request's tree),
the visibility mask and the rows' positions and paths.

Legend: Bq requests, L depths, K candidates per depth, B node budget (root not counted),
W = B + 1 padded tree width, N tree nodes (root included), TPB threads per block.

Kernels:
- ``build_trees_kernel``: one block per request. The live frontier (at most B + 1 candidates)
  and the nodes popped so far sit in shared memory; every pop is a block-wide argmax over the
  frontier (``_best_candidate``: a strided scan per thread, then a shared-memory tree reduction)
  followed by one thread's bookkeeping (``_pop``).
- ``build_trees_sorted_kernel`` (version 2): the same tree from a frontier kept sorted.
- ``build_trees_keyed_kernel`` (version 3): version 2 with every candidate's rank tuple as an
  integer key, so ties need no climb through the node table.
- ``visibility_kernel``: one thread per (request, i, j): is j on the path root..i?
- ``top_candidates_kernel``: the twin of ``ddtree.tree.top_candidates``: one block per drafter
  row, log-softmax (max, then a float64 sum of exp) and the K best by repeated block argmax.
- ``top_candidates_sort_kernel`` (version 2): the same log-softmax, then a bitonic sort.
- ``positions_kernel``: one thread per tree row: its position P + depth and its path root..i
  by depth (what the engine's attention enumerates instead of a mask).

The result is bit-identical to ``ddtree.tree.build_tree``: the same float32 weights, summed root
to leaf (a sibling weighs ``w[parent] + lp``, never ``w - lp + lp``), and the same tie rule
(equal weights: the lexicographically smallest rank tuple pops first, a prefix before its
extensions). Both follow from comparing candidates with one strict total order (``_pops_before``),
so the argmax does not depend on how the reduction pairs them up. That order is not np.argmax's,
so the builder has its own reduction rather than ``kernels.blocks.block_argmax``.

Shared memory bounds the budget: ``MAX_BUDGET`` = 1024 nodes need 7 tables of 1025 entries
(4 bytes each, ~29 KB per block, under the 48 KB of static shared memory). ``bytes_moved`` and
``flops`` give each operation's cost model.

Versions (``version=``; every version exact, ties included; top-K's default 2, the builder's 3
where its keys fit, else 2). Version 1 of top-K
makes K passes, each a scan of V and a log2(TPB)-level block argmax: K x (2 + log2 TPB) barriers.
Version 2 sorts (log-prob, id) pairs in shared memory under the total order (log-prob
descending, id ascending), a bitonic sort of log2(S)(log2(S) + 1)/2 barrier stages for a buffer
of S = next power of two >= V pairs (at most TOPK_CHUNK = 4096, 32 KB), whatever K is; a longer
row streams through the buffer, a token entering only if it beats the K-th best so far (needs
K <= S / 2, else version 1 runs). V = 512, K = 32: ~370 barriers and 32 scans of the row become
~65 barriers and one scan. Version 1 of the builder pays per pop one block argmax (2 + log2 TPB
barriers) and a global load on thread 0's critical path; version 2 copies the log-probs it can
reach (min(L, B) x min(K, B + 1) floats, when <= _STAGE) to shared memory once and keeps the
frontier sorted, so the best of the merged frontier is known without a reduction: one barrier
per pop (B = 32: ~260 barriers become ~33). Version 3 keeps version 2's barriers; a tie (equal
weights: the drafters' floors, the oracles' equal distractors) costs it two integer compares where
version 2 climbs both candidates' paths.
"""

from __future__ import annotations

import functools
import math
import typing

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint64  # kernels chose GPU or simulator already

from ddtree import tree as reference
from ddtree.tree import DraftTree, check_budget, check_candidates, check_token
from ddtree.tree import check_parents as check_host_parents
from kernels.blocks import MAX_TPB, block_max, blocks, check_threads, pow2_threads
from kernels.device import check_out, check_version, deliver, is_device_array, output, to_device

MAX_BUDGET = 1024
_SLOTS = MAX_BUDGET + 1          # nodes (root + B) and live frontier entries (at most B + 1)
_NEG_INF = np.float32(-np.inf)
VIS_TILE = 16                    # visibility: 16 x 16 threads per block over (i, j)
F32, I64 = 4, 8
_STAGE = 1536                    # builder version 2: staged log-probs, L' x K' floats (6 KB)
STAGE_BATCH = 8                  # ... copied 8 per thread at a time (their loads overlap)
TOPK_CHUNK = 4096                # top-K version 2: (log-prob, id) pairs sorted in shared memory (32 KB)
_NO_TOKEN = 2**31 - 1            # an empty sort slot: (-inf, _NO_TOKEN) sorts after every real token
VERSIONS = (1, 2)                # kernel versions of top_candidates
BUILD_VERSIONS = (1, 2, 3)       # kernel versions of build_trees_device
KEY_SLOTS = 257                  # builder version 3: nodes and frontier entries (its keys: 16 B more each)
MAX_KEYED_BUDGET = KEY_SLOTS - 1
KEY_DEPTHS = 128                 # ... and the depths its keys can hold (2 x the digits per word, + 1)


# --8<-- [start:pops_before]
@cuda.jit(device=True, inline="always")
def _comes_before(weight_a, parent_a, rank_a, weight_b, parent_b, rank_b, node_parent, node_rank, node_depth):
    """True if candidate a = (weight_a, parent node parent_a, rank_a) pops before candidate b:
    heavier first, then the smaller rank tuple.

    Candidate a is the rank tuple path(parent_a) + (rank_a,). On a tie, lift the deeper candidate
    to the other's depth, then climb both until they share a parent: the ranks there decide. They
    always differ: one live candidate is never a prefix of another (the shorter one is not popped
    yet, so nothing below it exists). Ties are rare; the walk costs at most L steps in shared
    memory. ``inline="always"``: numba pastes it into the kernel instead of a call that passes
    every array field by field.
    """
    if weight_a != weight_b:
        return weight_a > weight_b
    depth_a = node_depth[parent_a]
    depth_b = node_depth[parent_b]
    while depth_a > depth_b:                     # lift a to b's depth
        rank_a = node_rank[parent_a]
        parent_a = node_parent[parent_a]
        depth_a -= 1
    while depth_b > depth_a:                     # lift b to a's depth
        rank_b = node_rank[parent_b]
        parent_b = node_parent[parent_b]
        depth_b -= 1
    while parent_a != parent_b:                  # climb both to their common parent
        rank_a = node_rank[parent_a]
        parent_a = node_parent[parent_a]
        rank_b = node_rank[parent_b]
        parent_b = node_parent[parent_b]
    return rank_a < rank_b


@cuda.jit(device=True)
def _pops_before(a, b, cand_weight, cand_parent, cand_rank, node_parent, node_rank, node_depth):
    """``_comes_before`` of frontier slots ``a`` and ``b`` (version 1 keeps its candidates in
    slot arrays; version 2 compares values it already holds)."""
    return _comes_before(cand_weight[a], cand_parent[a], cand_rank[a], cand_weight[b], cand_parent[b],
                         cand_rank[b], node_parent, node_rank, node_depth)
# --8<-- [end:pops_before]


# --8<-- [start:build_trees_kernel]
@cuda.jit(device=True)
def _start_tree(top_logprobs, request, budget, node_parent, node_rank, node_depth, node_weight,
                cand_parent, cand_rank, cand_weight, state):
    """(one thread) The root is node 0 (weight 0); the frontier starts with (depth 1, rank 0)."""
    node_parent[0] = -1
    node_rank[0] = -1
    node_depth[0] = 0
    node_weight[0] = float32(0.0)
    state[0] = 0
    state[1] = 0
    if budget > 0 and top_logprobs.shape[1] > 0:
        cand_parent[0] = 0
        cand_rank[0] = 0
        cand_weight[0] = node_weight[0] + top_logprobs[request, 0, 0]
        state[0] = 1


@cuda.jit(device=True)
def _best_candidate(live, best, cand_weight, cand_parent, cand_rank, node_parent, node_rank, node_depth):
    """The frontier slot that pops first, returned to every thread: each thread finds the best of
    its strided share (slots tid, tid + TPB, ...), then a tree reduction over ``best`` (TPB slots,
    -1 = none) keeps the one that ``_pops_before`` the other."""
    tid = cuda.threadIdx.x
    mine = -1
    for slot in range(tid, live, cuda.blockDim.x):
        if mine < 0 or _pops_before(slot, mine, cand_weight, cand_parent, cand_rank,
                                    node_parent, node_rank, node_depth):
            mine = slot
    best[tid] = mine
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            other = best[tid + stride]
            if other >= 0 and (best[tid] < 0 or _pops_before(
                    other, best[tid], cand_weight, cand_parent, cand_rank,
                    node_parent, node_rank, node_depth)):
                best[tid] = other
        cuda.syncthreads()
        stride //= 2
    return best[0]


@cuda.jit(device=True)
def _pop(slot, node, top_logprobs, request, node_parent, node_rank, node_depth, node_weight,
         cand_parent, cand_rank, cand_weight, state):
    """(one thread) Frontier slot ``slot`` becomes node ``node``; the last frontier entry fills the
    slot; the node's next sibling (parent's weight + its log-prob) and first child join the frontier."""
    live = state[0]
    parent = cand_parent[slot]
    rank = cand_rank[slot]
    depth = node_depth[parent] + 1
    node_parent[node] = parent
    node_rank[node] = rank
    node_depth[node] = depth
    node_weight[node] = cand_weight[slot]
    state[1] = node
    live -= 1
    cand_parent[slot] = cand_parent[live]
    cand_rank[slot] = cand_rank[live]
    cand_weight[slot] = cand_weight[live]
    if rank + 1 < top_logprobs.shape[2]:                  # next sibling
        cand_parent[live] = parent
        cand_rank[live] = rank + 1
        cand_weight[live] = node_weight[parent] + top_logprobs[request, depth - 1, rank + 1]
        live += 1
    if depth < top_logprobs.shape[1]:                     # first child
        cand_parent[live] = node
        cand_rank[live] = 0
        cand_weight[live] = node_weight[node] + top_logprobs[request, depth, 0]
        live += 1
    state[0] = live


@cuda.jit(device=True)
def _write_tree(request, root_tokens, top_ids, size, node_parent, node_rank, node_depth, node_weight,
                tokens, parents, depths, ranks, logprobs):
    """Row ``request`` of the outputs (W): the ``size`` nodes in pop order, then padding (token 0,
    parent -1, depth 0, rank -1, log-prob -inf); threads stride over the columns."""
    for i in range(cuda.threadIdx.x, tokens.shape[1], cuda.blockDim.x):
        if i < size:
            parents[request, i] = node_parent[i]
            depths[request, i] = node_depth[i]
            ranks[request, i] = node_rank[i]
            logprobs[request, i] = node_weight[i]
            if i == 0:
                tokens[request, i] = root_tokens[request]
            else:
                tokens[request, i] = top_ids[request, node_depth[i] - 1, node_rank[i]]
        else:
            tokens[request, i] = 0
            parents[request, i] = -1
            depths[request, i] = 0
            ranks[request, i] = -1
            logprobs[request, i] = _NEG_INF


@cuda.jit
def build_trees_kernel(root_tokens, top_logprobs, top_ids, budget,
                       tokens, parents, depths, ranks, logprobs, sizes):
    """One block per request; TPB a power of two <= MAX_TPB.

    Shared memory: the node table (parent, rank, depth, weight per popped node, root = 0), the
    live frontier (parent, rank, weight per candidate; its depth is the parent's + 1), one
    frontier slot per thread for the reduction, and [live count, popped count]. One pop:
    ``_best_candidate`` finds the block's best, thread 0 ``_pop``s it. Outputs (Bq, W):
    ``_write_tree``; sizes (Bq,) = n + 1.
    """
    request = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    node_parent = cuda.shared.array(_SLOTS, int32)
    node_rank = cuda.shared.array(_SLOTS, int32)
    node_depth = cuda.shared.array(_SLOTS, int32)
    node_weight = cuda.shared.array(_SLOTS, float32)
    cand_parent = cuda.shared.array(_SLOTS, int32)
    cand_rank = cuda.shared.array(_SLOTS, int32)
    cand_weight = cuda.shared.array(_SLOTS, float32)
    best = cuda.shared.array(MAX_TPB, int32)
    state = cuda.shared.array(2, int32)          # [live frontier entries, popped nodes]

    if tid == 0:
        _start_tree(top_logprobs, request, budget, node_parent, node_rank, node_depth, node_weight,
                    cand_parent, cand_rank, cand_weight, state)
    for step in range(budget):
        cuda.syncthreads()
        live = state[0]
        if live == 0:                            # the heap is empty (same value in every thread)
            break
        slot = _best_candidate(live, best, cand_weight, cand_parent, cand_rank,
                               node_parent, node_rank, node_depth)
        if tid == 0:                             # node number step + 1
            _pop(slot, step + 1, top_logprobs, request, node_parent, node_rank, node_depth,
                 node_weight, cand_parent, cand_rank, cand_weight, state)
    cuda.syncthreads()
    size = state[1] + 1
    _write_tree(request, root_tokens, top_ids, size, node_parent, node_rank, node_depth, node_weight,
                tokens, parents, depths, ranks, logprobs)
    if tid == 0:
        sizes[request] = size
# --8<-- [end:build_trees_kernel]


# --8<-- [start:build_trees_sorted_kernel]
ZERO, ONE = uint64(0), uint64(1)    # builder versions 2 and 3 index shared memory with uint64


@cuda.jit(device=True, inline="always")
def _logprob(stage, width, top_logprobs, request, depth, rank):
    """top_logprobs[request, depth, rank]: from the shared copy when it was staged (width > 0)."""
    if width > ZERO:
        return stage[depth * width + rank]
    return top_logprobs[request, depth, rank]


@cuda.jit(device=True, inline="always")
def _place(index, top, node, parent, rank, weight, high, low, node_parent, node_rank, node_depth,
           node_weight, node_high, node_low, front_parent, front_rank, front_weight, front_high,
           front_low, base, keyed):
    """Candidate (parent, rank: int32; weight; key words high, low with ``keyed``) lands at
    ``index`` of the merged frontier: the last index (``top``) pops next, so it becomes node
    ``node``; the others go to the frontier buffer that starts at ``base`` (index, top, node and
    base are uint64)."""
    if index == top:
        node_parent[node] = parent
        node_rank[node] = rank
        node_depth[node] = node_depth[uint64(parent)] + 1
        node_weight[node] = weight
        if keyed:
            node_high[node] = high
            node_low[node] = low
    else:
        slot = base + index
        front_parent[slot] = parent
        front_rank[slot] = rank
        front_weight[slot] = weight
        if keyed:
            front_high[slot] = high
            front_low[slot] = low


@cuda.jit(device=True, inline="always")
def _key_before(weight_a, high_a, low_a, weight_b, high_b, low_b):
    """Version 3's order: heavier first, then the smaller key (high word, then low word)."""
    if weight_a != weight_b:
        return weight_a > weight_b
    return high_a < high_b or (high_a == high_b and low_a < low_b)


@functools.cache
def sorted_builder(keyed: bool):
    """Builder version 2 (``keyed`` False) or 3 (True): one kernel body, two ways to break ties."""
    slots = KEY_SLOTS if keyed else _SLOTS
    key_slots = KEY_SLOTS if keyed else 1                     # version 2 keeps no keys
    unit_slots = KEY_DEPTHS if keyed else 1
    front_slots, front_key_slots = 2 * slots, 2 * key_slots   # two frontier buffers, one after the other
    other_side = uint64(slots)                                # the second buffer's first slot

    @cuda.jit(device=True, inline="always")
    def before(weight_a, parent_a, rank_a, high_a, low_a, weight_b, parent_b, rank_b, high_b, low_b,
               node_parent, node_rank, node_depth):
        if keyed:
            return _key_before(weight_a, high_a, low_a, weight_b, high_b, low_b)
        return _comes_before(weight_a, parent_a, rank_a, weight_b, parent_b, rank_b, node_parent, node_rank,
                             node_depth)

    @cuda.jit
    def kernel(root_tokens, top_logprobs, top_ids, budget, stage_depths, stage_width, key_base, key_digits,
               tokens, parents, depths, ranks, logprobs, sizes):
        """One block per request; the frontier is kept sorted, so a pop costs one barrier.

        The frontier (every live candidate but the next pop) sits in ``front_*[side:side + rest]`` in
        pop order reversed (index rest - 1 pops first), and the candidate that pops next is
        already written as node ``nodes`` of the node table. Pop ``nodes``: every thread computes
        its two new candidates (next sibling, first child), and thread t takes gap t of the
        sorted frontier (between entries t - 1 and t): the old entry t moves up by the number of
        new ones that pop after it, and a new one whose place is gap t goes there (gap + the new
        ones that pop after it). The merged list is written to the other buffer (reads and
        writes never share one: no barrier between them) and its last entry, the best, straight
        to the node table as the next node. One ``cuda.syncthreads`` per pop, no reduction.
        ``stage_width`` > 0: the log-probs [:stage_depths, :stage_width] were copied to shared
        memory first (index depth * width + rank).

        Version 3 (``keyed``) breaks ties without climbing the tree: every candidate carries its
        rank tuple as a number, the digits rank + 1 in base ``key_base`` (> every rank + 1), the
        first ``key_digits`` depths in the high word, the next ones in the low word, zeros past
        its depth (so a prefix comes first). Comparing two keys is comparing the tuples. A
        sibling's key is its node's plus one unit of the node's depth, a first child's plus one
        unit of the next depth.

        Every shared-memory index of the pop loop is a uint64 (``ZERO``, ``ONE``): numba tests a
        signed index for wraparound before each load and store, and the pop is one warp's chain
        of dependent instructions (``docs/results/ncu-round-h200-2026-12-03.txt``); the two
        frontier buffers are one flat array each, the second at ``other_side``.
        """
        request = cuda.blockIdx.x
        tid = uint64(cuda.threadIdx.x)
        threads = uint64(cuda.blockDim.x)
        node_parent = cuda.shared.array(slots, int32)
        node_rank = cuda.shared.array(slots, int32)
        node_depth = cuda.shared.array(slots, int32)
        node_weight = cuda.shared.array(slots, float32)
        front_parent = cuda.shared.array(front_slots, int32)  # two buffers: read one, write the other
        front_rank = cuda.shared.array(front_slots, int32)
        front_weight = cuda.shared.array(front_slots, float32)
        node_high = cuda.shared.array(key_slots, int64)
        node_low = cuda.shared.array(key_slots, int64)
        front_high = cuda.shared.array(front_key_slots, int64)
        front_low = cuda.shared.array(front_key_slots, int64)
        unit = cuda.shared.array(unit_slots, int64)           # version 3: one digit at depth d
        stage = cuda.shared.array(_STAGE, float32)

        if stage_width > 0:                                   # STAGE_BATCH loads in flight per thread
            staged = cuda.local.array(STAGE_BATCH, float32)
            total = stage_depths * stage_width
            for base in range(cuda.threadIdx.x, total, cuda.blockDim.x * STAGE_BATCH):
                for b in range(STAGE_BATCH):
                    i = min(base + b * cuda.blockDim.x, total - 1)    # past the end: re-read the last
                    staged[b] = top_logprobs[request, i // stage_width, i % stage_width]
                for b in range(STAGE_BATCH):
                    if base + b * cuda.blockDim.x < total:
                        stage[base + b * cuda.blockDim.x] = staged[b]
        width = uint64(max(stage_width, 0))
        depth_limit = uint64(top_logprobs.shape[1])           # L
        rank_limit = uint64(top_logprobs.shape[2])            # K
        digits = uint64(key_digits)
        limit = uint64(max(budget, 0))
        nodes = ONE if limit > ZERO and depth_limit > ZERO else ZERO   # node 1 = (depth 1, rank 0) pops first
        if tid == ZERO:
            if keyed:                                         # unit[d] = base^(D - d), then base^(2D - d)
                power = int64(1)
                for d in range(2 * key_digits, 0, -1):
                    unit[d] = power
                    power = int64(1) if d == key_digits + 1 else power * key_base
                node_high[0] = 0
                node_low[0] = 0
            node_parent[0] = -1
            node_rank[0] = -1
            node_depth[0] = 0
            node_weight[0] = float32(0.0)
            if nodes == ONE:
                _place(ZERO, ZERO, ONE, int32(0), int32(0), node_weight[0] + top_logprobs[request, 0, 0],
                       unit[1] if keyed else int64(0), int64(0), node_parent, node_rank, node_depth,
                       node_weight, node_high, node_low, front_parent, front_rank, front_weight, front_high,
                       front_low, ZERO, keyed)
        cuda.syncthreads()
        rest = ZERO                                           # frontier entries besides the next pop
        side = ZERO                                           # this pop reads at side, writes at the other
        while ZERO < nodes < limit:
            node = nodes                                      # pop it: its sibling and child join
            parent = uint64(node_parent[node])
            rank = uint64(node_rank[node])
            depth = uint64(node_depth[node])
            sibling = rank + ONE < rank_limit
            child = depth < depth_limit
            sibling_weight = float32(0.0)
            child_weight = float32(0.0)
            sibling_high = child_high = sibling_low = child_low = int64(0)
            if keyed:                                         # one unit more at depth, or at depth + 1
                sibling_high = child_high = node_high[node]
                sibling_low = child_low = node_low[node]
                if depth <= digits:
                    sibling_high += unit[depth]
                else:
                    sibling_low += unit[depth]
                if child:
                    if depth + ONE <= digits:
                        child_high += unit[depth + ONE]
                    else:
                        child_low += unit[depth + ONE]
            if sibling:
                sibling_weight = node_weight[parent] + _logprob(stage, width, top_logprobs, request,
                                                                depth - ONE, rank + ONE)
            if child:
                child_weight = node_weight[node] + _logprob(stage, width, top_logprobs, request, depth, ZERO)
            # the new candidates as (parent, rank) int32 pairs: what the node table and buffers hold
            sibling_parent, sibling_rank = int32(parent), int32(rank + ONE)
            child_parent, child_rank = int32(node), int32(0)
            sibling_first = sibling and child and before(
                sibling_weight, sibling_parent, sibling_rank, sibling_high, sibling_low, child_weight,
                child_parent, child_rank, child_high, child_low, node_parent, node_rank, node_depth)
            total = rest + (ONE if sibling else ZERO) + (ONE if child else ZERO)
            if total == ZERO:                                 # the heap is empty (same in every thread)
                break
            top = total - ONE
            other = other_side - side
            gap = tid
            while gap <= rest:                                # (a while loop: no division per pop)
                # a new candidate goes to gap t when it pops before old entry t - 1 (nothing below
                # gap 0) and after old entry t (nothing above gap rest): the frontier is sorted
                sibling_here = sibling
                child_here = child
                if gap > ZERO:
                    below = side + gap - ONE
                    below_parent = front_parent[below]
                    below_rank = front_rank[below]
                    below_weight = front_weight[below]
                    below_high = front_high[below] if keyed else int64(0)
                    below_low = front_low[below] if keyed else int64(0)
                    sibling_here = sibling_here and before(
                        sibling_weight, sibling_parent, sibling_rank, sibling_high, sibling_low, below_weight,
                        below_parent, below_rank, below_high, below_low, node_parent, node_rank, node_depth)
                    child_here = child_here and before(
                        child_weight, child_parent, child_rank, child_high, child_low, below_weight,
                        below_parent, below_rank, below_high, below_low, node_parent, node_rank, node_depth)
                if gap < rest:                                # old entry gap moves up past the new
                    old = side + gap                          # ones that pop after it
                    old_parent = front_parent[old]
                    old_rank = front_rank[old]
                    old_weight = front_weight[old]
                    old_high = front_high[old] if keyed else int64(0)
                    old_low = front_low[old] if keyed else int64(0)
                    over_sibling = sibling and before(old_weight, old_parent, old_rank, old_high, old_low,
                                                      sibling_weight, sibling_parent, sibling_rank,
                                                      sibling_high, sibling_low, node_parent, node_rank,
                                                      node_depth)
                    over_child = child and before(old_weight, old_parent, old_rank, old_high, old_low,
                                                  child_weight, child_parent, child_rank, child_high,
                                                  child_low, node_parent, node_rank, node_depth)
                    sibling_here = sibling_here and over_sibling
                    child_here = child_here and over_child
                    _place(gap + (ONE if over_sibling else ZERO) + (ONE if over_child else ZERO), top,
                           node + ONE, old_parent, old_rank, old_weight, old_high, old_low, node_parent,
                           node_rank, node_depth, node_weight, node_high, node_low, front_parent, front_rank,
                           front_weight, front_high, front_low, other, keyed)
                if sibling_here:                              # above the child if it pops first
                    _place(gap + (ONE if sibling_first else ZERO), top, node + ONE, sibling_parent,
                           sibling_rank, sibling_weight, sibling_high, sibling_low, node_parent, node_rank,
                           node_depth, node_weight, node_high, node_low, front_parent, front_rank,
                           front_weight, front_high, front_low, other, keyed)
                if child_here:
                    _place(gap + (ONE if sibling and not sibling_first else ZERO), top, node + ONE,
                           child_parent, child_rank, child_weight, child_high, child_low, node_parent,
                           node_rank, node_depth, node_weight, node_high, node_low, front_parent, front_rank,
                           front_weight, front_high, front_low, other, keyed)
                gap += threads
            rest = top
            side = other
            nodes += ONE
            cuda.syncthreads()                                # the merged frontier and the node are in
        cuda.syncthreads()
        size = int64(nodes) + 1
        _write_tree(request, root_tokens, top_ids, size, node_parent, node_rank, node_depth, node_weight,
                    tokens, parents, depths, ranks, logprobs)
        if tid == ZERO:
            sizes[request] = size

    return kernel


build_trees_sorted_kernel = sorted_builder(False)          # version 2
build_trees_keyed_kernel = sorted_builder(True)            # version 3


def key_shape(depths: int, k: int, budget: int) -> tuple[int, int]:
    """Builder version 3's keys for L = ``depths``, K = ``k``, B = ``budget``: (base, digits per
    word), the base one more than the reachable ranks + 1 (min(K, B + 1)); or (0, 0) where the
    reachable depths (min(L, B)) need more than two words or B exceeds MAX_KEYED_BUDGET."""
    if not 0 < budget <= MAX_KEYED_BUDGET:
        return 0, 0
    base = min(k, budget + 1) + 1                             # >= 2: K >= 1
    digits, power = 0, 1
    while power * base < 1 << 62:
        power *= base
        digits += 1
    return (base, digits) if min(depths, budget) <= min(2 * digits, KEY_DEPTHS - 1) else (0, 0)
# --8<-- [end:build_trees_sorted_kernel]


class TreeBatch(typing.NamedTuple):
    """Padded trees, one row per request (device arrays): row b holds sizes[b] nodes, then padding."""
    tokens: object      # [Bq, W] int64, padding 0
    parents: object     # [Bq, W] int64, padding -1 (a padding row sees only itself)
    depths: object      # [Bq, W] int64, padding 0
    ranks: object       # [Bq, W] int64, padding -1
    logprobs: object    # [Bq, W] float32, padding -inf
    sizes: object       # [Bq] int64


# --8<-- [start:builder_threads]
def builder_threads(budget: int) -> int:
    """TPB of the builder: a power of two in [32, 128], about one frontier entry (at most B + 1)
    per thread."""
    return pow2_threads(budget + 1)
# --8<-- [end:builder_threads]


def check_build_trees(root_tokens, top_logprobs, top_ids, budget, *, threads=None, out=None, version=None):
    """Host arrays get the full value checks of ddtree.tree, device arrays shape and dtype; then
    the launch's: version (None: the fastest that fits), budget <= MAX_BUDGET (version 3:
    ``key_shape`` fits), block size, ``out`` (a TreeBatch of width W = B + 1). Returns
    root_tokens, top_logprobs, top_ids, budget (an int) and the version."""
    if version is not None:
        check_version(version, BUILD_VERSIONS)
    budget = check_budget(budget)
    if budget > MAX_BUDGET:
        raise ValueError(f"budget must be <= {MAX_BUDGET} (the GPU builder keeps the frontier and "
                         f"the node table in shared memory), got {budget}")
    if is_device_array(top_logprobs) or is_device_array(top_ids):
        if top_logprobs.ndim != 3 or top_logprobs.shape != top_ids.shape or top_logprobs.shape[2] < 1:
            raise ValueError(f"top_logprobs and top_ids must have the same (Bq, L, K) shape with K >= 1, "
                             f"got {top_logprobs.shape} and {top_ids.shape}")
        if top_logprobs.dtype != np.float32 or top_ids.dtype != np.int64:
            raise ValueError(f"device top_logprobs/top_ids must be float32/int64, "
                             f"got {top_logprobs.dtype}/{top_ids.dtype}")
    else:
        top_logprobs, top_ids = check_candidates(top_logprobs, top_ids)
        if top_logprobs.ndim != 3:
            raise ValueError(f"top_logprobs must be (Bq, L, K), got shape {top_logprobs.shape}")
    requests = top_logprobs.shape[0]
    if is_device_array(root_tokens):
        if root_tokens.shape != (requests,) or root_tokens.dtype != np.int64:
            raise ValueError(f"device root_tokens must be int64 of shape ({requests},), "
                             f"got {root_tokens.dtype} {root_tokens.shape}")
    else:
        root_tokens = np.asarray(root_tokens)
        if root_tokens.shape != (requests,) or not np.issubdtype(root_tokens.dtype, np.integer) \
                or (root_tokens.size and root_tokens.min() < 0):
            raise ValueError(f"root_tokens must be ({requests},) non-negative integer token "
                             f"ids, got {root_tokens.dtype} {root_tokens.shape}")
    if requests < 1:
        raise ValueError("build_trees needs at least one request (Bq >= 1)")
    if threads is not None:
        check_threads(threads, MAX_TPB)
    if out is not None:                                                       # W >= B + 1: padded past it
        width = out.tokens.shape[1] if len(out.tokens.shape) == 2 else -1
        shape = (requests, max(width, max(budget, 0) + 1))                    # [Bq, W]
        for name in TreeBatch._fields:
            dtype = np.float32 if name == "logprobs" else np.int64
            check_out(getattr(out, name), shape[:1] if name == "sizes" else shape, dtype, f"out.{name}")
    keys = key_shape(top_logprobs.shape[1], top_logprobs.shape[2], budget) != (0, 0)
    if version == 3 and not keys and budget > 0:
        raise ValueError(f"version 3 needs budget <= {MAX_KEYED_BUDGET} and min(L, budget) depths that fit "
                         f"two key words (key_shape), got L={top_logprobs.shape[1]}, "
                         f"K={top_logprobs.shape[2]}, budget={budget}")
    return root_tokens, top_logprobs, top_ids, budget, version or (3 if keys else 2)


def staged_shape(depths: int, k: int, budget: int) -> tuple[int, int]:
    """Builder version 2: the log-probs it copies to shared memory, (depths, ranks) = (min(L, B),
    min(K, B + 1)) (a pop reaches depth <= B and rank <= B), or (0, 0) when they exceed _STAGE."""
    rows, width = min(depths, budget), min(k, budget + 1)
    return (rows, width) if 0 < rows * width <= _STAGE else (0, 0)


# --8<-- [start:build_trees_device]
def build_trees_device(root_tokens, top_logprobs, top_ids, budget: int, *, threads: int | None = None,
                       out: TreeBatch | None = None, stream=None, version: int | None = None) -> TreeBatch:
    """Build Bq trees at once: root_tokens (Bq,), top_logprobs and top_ids (Bq, L, K).

    Returns a TreeBatch of device arrays of width W = max(budget, 0) + 1, no host copies, or
    writes into ``out`` (a TreeBatch of device arrays of width W >= budget + 1: padding past the
    tree, as the engine's buckets need). ``budget`` is shared by
    all requests and at most ``MAX_BUDGET``; ``threads`` forces the block size (a power of two
    <= 128); ``stream`` is where the kernel is launched (None: the default stream); ``version``
    picks the kernel: 1 is the block argmax per pop, 2 keeps the frontier sorted, 3 does too and
    breaks ties by a key; None (the default) takes 3 where its keys fit (``key_shape``), else 2.
    """
    root_tokens, top_logprobs, top_ids, budget, version = check_build_trees(
        root_tokens, top_logprobs, top_ids, budget, threads=threads, out=out, version=version)
    shape = (top_logprobs.shape[0], max(budget, 0) + 1)                     # [Bq, W]
    out = out or TreeBatch(*(output(None, shape[:1] if name == "sizes" else shape,
                                    np.float32 if name == "logprobs" else np.int64, stream)
                             for name in TreeBatch._fields))              # -1 / NaN until written
    inputs = (to_device(root_tokens, np.int64), to_device(top_logprobs, np.float32),
              to_device(top_ids, np.int64), budget)
    if version == 1:
        build_trees_kernel[shape[0], threads or builder_threads(budget), stream](*inputs, *out)
    else:                                                     # about one frontier gap per thread
        kernel = build_trees_keyed_kernel if version == 3 else build_trees_sorted_kernel
        dims = top_logprobs.shape[1], top_logprobs.shape[2], budget
        kernel[shape[0], threads or pow2_threads(budget), stream](
            *inputs, *staged_shape(*dims), *(key_shape(*dims) if version == 3 else (0, 0)), *out)
    return out
# --8<-- [end:build_trees_device]


def trees_from_batch(batch: TreeBatch) -> list[DraftTree]:
    """Copy a TreeBatch to the host and cut each row to its size."""
    host = {name: array.copy_to_host() for name, array in batch._asdict().items()}
    return [DraftTree(tokens=host["tokens"][b, :size], parents=host["parents"][b, :size],
                      depths=host["depths"][b, :size], ranks=host["ranks"][b, :size],
                      logprobs=host["logprobs"][b, :size])
            for b, size in enumerate(host["sizes"])]


# --8<-- [start:build_trees]
def build_trees(root_tokens, top_logprobs, top_ids, budget: int, *,
                version: int | None = None) -> list[DraftTree]:
    """Bq trees, each equal to ``ddtree.tree.build_tree`` on its request (host DraftTrees)."""
    return trees_from_batch(build_trees_device(root_tokens, top_logprobs, top_ids, budget, version=version))
# --8<-- [end:build_trees]


# --8<-- [start:build_tree]
def build_tree(root_token: int, top_logprobs, top_ids, budget: int, *,
               version: int | None = None) -> DraftTree:
    """One request: top_logprobs and top_ids (L, K); the same tree as ``ddtree.tree.build_tree``."""
    root_token = check_token(root_token, "root_token")
    if not is_device_array(top_logprobs):
        top_logprobs, top_ids = check_candidates(top_logprobs, top_ids)
    if top_logprobs.ndim != 2:
        raise ValueError(f"top_logprobs must be (L, K) for one request, got shape {top_logprobs.shape}")
    return build_trees(np.array([root_token], np.int64), top_logprobs.reshape((1, *top_logprobs.shape)),
                       top_ids.reshape((1, *top_ids.shape)), budget, version=version)[0]
# --8<-- [end:build_tree]


# --8<-- [start:visibility_kernel]
@cuda.jit
def visibility_kernel(parents, vis):
    """One thread per (request, i, j): vis[request, i, j] = is j on the path root..i?

    x indexes columns j (neighbouring threads write neighbouring bytes), y rows i, z requests.
    Ancestors have smaller indices than their descendants: walk up from i while above j; j is
    an ancestor (or i itself) iff the walk lands on it. A parent of -1 (root, padding) ends the
    walk. No shared memory.
    """
    j, i = cuda.grid(2)
    request = cuda.blockIdx.z
    size = parents.shape[1]
    if i < size and j < size:
        node = i
        while node > j:
            node = parents[request, node]
        vis[request, i, j] = node == j
# --8<-- [end:visibility_kernel]


def check_parents(parents, *, out=None):
    """Host parents get ``ddtree.tree.check_parents``; device parents must be a non-empty (N,) or
    (Bq, N) int64 array (values unchecked: that would need a copy). ``out``: (..., N, N) bool."""
    if is_device_array(parents):
        if parents.ndim not in (1, 2) or parents.dtype != np.int64 or parents.size < 1:
            raise ValueError(f"device parents must be a non-empty (N,) or (Bq, N) int64 array, "
                             f"got {parents.dtype} {parents.shape}")
    else:
        parents = check_host_parents(parents)
    check_out(out, (*parents.shape, parents.shape[parents.ndim - 1]), np.bool_)
    return parents


# --8<-- [start:visibility]
def visibility(parents, *, out=None, stream=None):
    """Ancestor-only mask: parents (N,) -> (N, N) bool, or (Bq, N) -> (Bq, N, N).

    Host in, host out; device in, device out. -1 past the root marks a padding row. ``out``
    receives the mask; ``stream`` is where the kernel is launched (None: the default stream).
    """
    parents = check_parents(parents, out=out)
    width = parents.shape[parents.ndim - 1]                                 # N
    d_vis = output(out, (*parents.shape, width), np.bool_, stream)          # [(Bq,) N, N]
    d_parents = to_device(parents)
    batch = d_parents if d_parents.ndim == 2 else d_parents.reshape((1, width))   # [Bq, N]
    tiles = blocks(width, VIS_TILE)
    visibility_kernel[(tiles, tiles, batch.shape[0]), (VIS_TILE, VIS_TILE), stream](
        batch, d_vis if d_vis.ndim == 3 else d_vis.reshape((1, width, width)))
    return deliver(d_vis, out, parents)
# --8<-- [end:visibility]


# --8<-- [start:top_candidates_kernel]
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
def _max_log_sum(logits, row, red, red64):
    """The row's max (float32) and ``_log_sum_exp``: a token's log-prob is then
    (logits[row, v] - max) - log_sum in float32, numpy's steps."""
    local_max = float32(-math.inf)
    for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        local_max = max(local_max, logits[row, v])
    red[cuda.threadIdx.x] = local_max
    block_max(red)
    row_max = red[0]
    return row_max, _log_sum_exp(logits, row, row_max, red64)


@cuda.jit(device=True)
def _log_sum_exp(logits, row, row_max, red64):
    """float32(log(sum_v exp(float64(logits[row, v] - row_max)))), the sum reduced in float64."""
    tid = cuda.threadIdx.x
    total = float64(0.0)
    for v in range(tid, logits.shape[1], cuda.blockDim.x):
        total += math.exp(float64(logits[row, v] - row_max))
    red64[tid] = total
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            red64[tid] += red64[tid + stride]
        cuda.syncthreads()
        stride //= 2
    log_sum = float32(math.log(red64[0]))
    cuda.syncthreads()                           # everyone has read red64[0]
    return log_sum


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
# --8<-- [end:top_candidates_kernel]


# --8<-- [start:top_candidates_sort_kernel]
@cuda.jit(device=True, inline="always")
def _sort_pairs(values, ids, size):
    """Bitonic sort of (values, ids)[:size] (size a power of two) into the order log-prob
    descending, token id ascending. Stage (span, stride): pair i compares slots low and
    low + stride and puts the better one first in spans with (low & span) == 0, last in the
    others; one barrier per stage, log2(size) * (log2(size) + 1) / 2 stages. Unsigned indices,
    shifts and while loops: a stage is a few instructions per thread (numba tests every signed
    index for wraparound, a signed // 2 needs a sign fix-up, and a strided ``range`` divides to
    count its steps)."""
    one = uint64(1)
    half = uint64(size) >> one
    span = uint64(2)
    while span <= uint64(size):
        stride = span >> one
        while stride > uint64(0):
            pair = uint64(cuda.threadIdx.x)
            while pair < half:
                low = (pair << one) - (pair & (stride - one))      # pair's slot in its half-span
                high = low + stride
                high_first = values[high] > values[low] or (values[high] == values[low]
                                                            and ids[high] < ids[low])
                if high_first == ((low & span) == uint64(0)):
                    value = values[low]
                    values[low] = values[high]
                    values[high] = value
                    token = ids[low]
                    ids[low] = ids[high]
                    ids[high] = token
                pair += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            stride >>= one
        span <<= one


@functools.cache
def top_candidates_sort_kernel(threads: int, slots: int):
    """Version 2 of the top-K kernel, for blocks of ``threads`` threads and a shared sort buffer of
    ``slots`` (log-prob, id) pairs (both powers of two)."""

    @cuda.jit
    def kernel(logits, top_logprobs, top_ids):
        # one block = one drafter row; max and float64 log-sum as version 1. Then the first
        # ``slots`` tokens go into the buffer (token s in slot s, empty slots (-inf, _NO_TOKEN)
        # sort last); if V fits, one bitonic sort and done. Otherwise sort, keep the best K and
        # stream the rest of the row in tiles of (slots - K) / 2 tokens: a token joins the
        # buffer (an atomic slot) only if it beats the K-th best so far; a full buffer is
        # sorted back to its best K first. Random rows rarely refill it after the first chunk.
        red = cuda.shared.array(threads, float32)
        red64 = cuda.shared.array(threads, float64)
        values = cuda.shared.array(slots, float32)
        ids = cuda.shared.array(slots, int32)
        filled = cuda.shared.array(1, int32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]
        k = top_ids.shape[1]
        row_max, log_sum = _max_log_sum(logits, row, red, red64)
        for s in range(tid, slots, threads):
            if s < vocab:
                values[s] = (logits[row, s] - row_max) - log_sum            # float32, as numpy
                ids[s] = s
            else:
                values[s] = _NEG_INF
                ids[s] = _NO_TOKEN
        if tid == 0:
            filled[0] = min(vocab, slots)
        cuda.syncthreads()
        tile = (slots - k) // 2
        start = slots
        kth_value = _NEG_INF                                  # the K-th best so far (set by the first sort)
        kth_id = _NO_TOKEN
        while start < vocab:
            full = filled[0] + tile > slots
            cuda.syncthreads()                                # everyone has read filled[0]
            if full:                                          # keep the best K, empty the rest
                _sort_pairs(values, ids, slots)
                kth_value = values[k - 1]
                kth_id = ids[k - 1]
                for s in range(k + tid, slots, threads):
                    values[s] = _NEG_INF
                    ids[s] = _NO_TOKEN
                if tid == 0:
                    filled[0] = k
                cuda.syncthreads()
            for v in range(start + tid, min(start + tile, vocab), threads):
                value = (logits[row, v] - row_max) - log_sum
                if value > kth_value or (value == kth_value and v < kth_id):
                    slot = cuda.atomic.add(filled, 0, 1)
                    values[slot] = value
                    ids[slot] = v
            start += tile
            cuda.syncthreads()
        _sort_pairs(values, ids, slots)
        for r in range(tid, k, threads):
            top_logprobs[row, r] = values[r]
            top_ids[row, r] = ids[r]

    return kernel
# --8<-- [end:top_candidates_sort_kernel]


def check_top_candidates(logits, k, *, out=None, version=2, chunk=None):
    """Host logits get the reference's checks (NaN, +inf, a finite value per row); device logits
    must be (L, V) float32 (values unchecked: that would need a copy). ``out``: (top_logprobs
    (L, K) float32, top_ids (L, K) int64); ``version`` in VERSIONS; ``chunk``: None or a power of
    two in [4, TOPK_CHUNK]."""
    check_version(version, VERSIONS)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or not 4 <= chunk <= TOPK_CHUNK or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be None or a power of two in [4, {TOPK_CHUNK}], got {chunk!r}")
    if is_device_array(logits):
        if logits.ndim != 2 or logits.dtype != np.float32:
            raise ValueError(f"device logits must be a (L, V) float32 array, "
                             f"got {logits.dtype} {logits.shape}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= logits.shape[1]:
            raise ValueError(f"k must be an integer in [1, vocab {logits.shape[1]}], got {k!r}")
    else:
        reference.top_candidates(logits, k)                                 # the reference's errors
        logits = np.asarray(logits, np.float32)
    if out is not None:
        check_out(out[0], (logits.shape[0], k), np.float32, "out[0] (top_logprobs)")
        check_out(out[1], (logits.shape[0], k), np.int64, "out[1] (top_ids)")
    return logits


def sort_slots(vocab: int, chunk: int | None = None) -> int:
    """Top-K version 2's buffer: the smallest power of two >= V, at most ``chunk`` (TOPK_CHUNK)."""
    slots = 1
    while slots < min(vocab, chunk or TOPK_CHUNK):
        slots *= 2
    return slots


# --8<-- [start:top_candidates]
def top_candidates(logits, k: int, *, out=None, stream=None, version: int = 2, chunk: int | None = None):
    """Drafter logits (L, V) -> the K best per depth: (top_logprobs (L, K) float32, top_ids (L, K)
    int64), sorted descending, equal log-probs lower id first: ``ddtree.tree.top_candidates``.

    ``out``: a pair of device arrays to write into; ``stream``: where the kernel is launched.
    ``version``: 2 (the default) sorts, 1 picks the K best one block argmax at a time; a row
    longer than the sort buffer (``chunk``, default TOPK_CHUNK) with K > chunk / 2 runs version 1.
    """
    logits = check_top_candidates(logits, k, out=out, version=version, chunk=chunk)
    depths, vocab = logits.shape
    out_logprobs, out_ids = out or (None, None)
    top_logprobs = output(out_logprobs, (depths, k), np.float32, stream)     # [L, K]
    top_ids = output(out_ids, (depths, k), np.int64, stream)                # [L, K]
    if depths:
        threads = pow2_threads(vocab, 1024)
        slots = sort_slots(vocab, chunk)
        if version == 2 and (vocab <= slots or k <= slots // 2):
            threads = pow2_threads(slots // 2, 512)           # a pair per thread; 1024 run out of registers
            kernel = top_candidates_sort_kernel(threads, slots)
        else:
            kernel = top_candidates_kernel(threads)
        kernel[depths, threads, stream](to_device(logits), top_logprobs, top_ids)
    return deliver(top_logprobs, out_logprobs, logits), deliver(top_ids, out_ids, logits)
# --8<-- [end:top_candidates]


# --8<-- [start:positions_kernel]
@cuda.jit
def positions_kernel(parents, depths, start, positions, paths):
    """One thread per tree row i: positions[i] = P + depths[i] (P = start[0]) and its path by
    depth, paths[i, d] = the ancestor of i at depth d (paths[i, depths[i]] = i). A padding row
    (parent -1, depth 0) gets the path [i]: it sees the prefix and itself."""
    i = cuda.grid(1)
    if i >= parents.shape[0]:
        return
    depth = depths[i]
    positions[i] = start[0] + depth
    node = i
    for d in range(depth, -1, -1):
        paths[i, d] = node
        node = parents[node]
# --8<-- [end:positions_kernel]


def positions_and_paths(parents, depths, start, *, positions, paths, stream=None):
    """The rows of a tree (device arrays): parents, depths (T,), start (1,) = P -> positions (T,)
    and paths (T, >= max depth + 1), written into the given arrays (the twin of
    ``ddtree.tree.positions``; the paths replace the visibility mask in the engine)."""
    rows = parents.shape[0]
    if depths.shape != (rows,) or positions.shape != (rows,) or paths.shape[0] != rows \
            or start.shape != (1,):
        raise ValueError(f"parents, depths, positions (T,), paths (T, L + 1) and start (1,) must agree, "
                         f"got {parents.shape}, {depths.shape}, {positions.shape}, {paths.shape}, "
                         f"{start.shape}")
    positions_kernel[blocks(rows, MAX_TPB), MAX_TPB, stream](parents, depths, start, positions, paths)


def _build_cost(*, Bq: int, L: int, K: int, B: int) -> tuple[int, int]:
    # the roots and the candidates (float32 log-probs, int64 ids) read once; five (Bq, W) trees
    # (four int64 fields, float32 log-probs) and the sizes written once; comparisons only
    width = B + 1
    return I64 * Bq + (F32 + I64) * Bq * L * K + (4 * I64 + F32) * Bq * width + I64 * Bq, 0


def _visibility_cost(*, Bq: int, W: int) -> tuple[int, int]:
    # the parents (int64) read once, the (Bq, W, W) bool mask written once
    return I64 * Bq * W + Bq * W * W, 0


_COSTS = {"build_trees": _build_cost, "visibility": _visibility_cost}


def bytes_moved(operation: str = "build_trees", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once). Dimensions by the glossary: "build_trees" (Bq, L, K, B), "visibility" (Bq, W)."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "build_trees", **dims: int) -> int:
    """Floating-point operations: none counted (the builder adds one float32 per pushed candidate,
    its work is comparisons)."""
    return _COSTS[operation](**dims)[1]


def _build_case(role: str, sizes, budget: int, version: int | None = None, requests: int | None = None):
    import zlib

    import ddtree.tree
    from kernels.bench.case import Case, drafter_candidates  # lazily: kernels.bench imports this module

    requests = sizes.requests if requests is None else requests
    depths, vocab = sizes.depths, sizes.config.vocab_size
    rng = np.random.default_rng(zlib.crc32(f"tree_build_{role}".encode()))
    logprobs, ids = drafter_candidates(rng, requests, depths, budget, vocab)   # K = budget
    roots = rng.integers(0, vocab, requests).astype(np.int64)                 # [Bq]

    def heap():                                # the numpy reference, one request at a time
        return [ddtree.tree.build_tree(int(roots[b]), logprobs[b], ids[b], budget) for b in range(requests)]

    dims = {"Bq": requests, "L": depths, "K": budget, "B": budget}
    name = f"tree_build_{role}" + ("" if version is None else f"_v{version}")
    return Case(name, f"best-first draft trees, {requests} request{'s' * (requests > 1)}, budget {budget}",
                f"Bq={requests} L={depths} K={budget}",
                setup=lambda seed: (cuda.to_device(roots), cuda.to_device(logprobs), cuda.to_device(ids),
                                    budget),
                call=lambda inputs, **given: build_trees_device(*inputs, version=version, **given),
                bytes=bytes_moved("build_trees", **dims), flops=flops("build_trees", **dims),
                note=f"version={version or 'default'}, 6 poisoned outputs", baseline=heap,
                baseline_name=f"ddtree.tree.build_tree x {requests}")


def _top_case(sizes, version: int):
    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    depths, vocab, k = sizes.depths, sizes.config.vocab_size, sizes.budgets[1]
    bytes_ = F32 * depths * vocab + (F32 + I64) * depths * k    # logits read once, the top K written
    return Case(f"top_candidates_v{version}", f"the drafter's top-K per depth, K = {k}",
                f"L={depths} V={vocab} K={k}",
                setup=lambda seed: (uniform((depths, vocab), seed, 8.0),),
                call=lambda inputs, **given: top_candidates(*inputs, k, version=version, **given),
                bytes=bytes_, flops=0, note=f"version={version}, 2 poisoned outputs")


def bench_cases(sizes):
    """This module's cases of ``python -m kernels.bench``: batched tree builds at three budgets
    (the default version: 3 where its keys fit, else 2), the medium budget with version 1 and
    for one request alone (the default, versions 1 and 2), all against the numpy reference's heap
    on the CPU; the drafter's top-K, every version."""
    small, medium, large = sizes.budgets
    return [_build_case("small", sizes, small), _build_case("medium", sizes, medium),
            _build_case("large", sizes, large), _build_case("medium", sizes, medium, version=1),
            _build_case("one", sizes, medium, requests=1), _build_case("one", sizes, medium, version=1,
                                                                        requests=1),
            _build_case("one", sizes, medium, version=2, requests=1),
            *(_top_case(sizes, version) for version in VERSIONS)]
