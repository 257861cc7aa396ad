"""Builder version 1, the block argmax: the frontier is an unordered array in shared memory and
every pop is a block-wide argmax over it (``_best_candidate``: a strided scan per thread, then a
shared-memory tree reduction under the strict total order ``_pops_before``), followed by one
thread's bookkeeping (``_pop``: the last entry fills the popped slot, the sibling and the child
are appended). The shipped builder (``kernels.tree.sorted_builder``) keeps the frontier sorted
instead, so the next pop is known without a reduction: one barrier per pop against
2 + log2(TPB) here, and no global load on thread 0's critical path. The same trees bit for bit,
ties included, but 1.3 to 2.1 times the shipped builder's time on one request from B = 8 up
(B = 32: 49.50 against 28.31 µs; B = 64: 107.7 against 50.5 µs, rows without ties; on tied rows
2 to 4 times the keyed builder's) in docs/results/tree-build-h200-2026-12-03b.txt at commit 4ec1155, and 110
against 59.3 µs as tree_build_one_v1 in docs/results/bench-tree-h200-2026-12-03.md at commit 4ec1155.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ddtree.tree import DraftTree, top_candidates
from kernels.blocks import MAX_TPB, pow2_threads
from kernels.device import to_device
from kernels.tree import (
    MAX_TREE_NODES,
    TreeBatch,
    check_build_trees,
    comes_before,
    trees_from_batch,
    write_tree,
)
from lab.harness import Case

SHIPPED = "kernels.tree.build_tree"
TWIN = "ddtree.tree.build_tree"
SAME_BITS = True


@cuda.jit(device=True)
def _pops_before(a, b, cand_weight, cand_parent, cand_rank, node_parent, node_rank, node_depth):
    """``comes_before`` (the shipped builder's order) of frontier slots ``a`` and ``b``."""
    return comes_before(cand_weight[a], cand_parent[a], cand_rank[a], cand_weight[b], cand_parent[b],
                         cand_rank[b], node_parent, node_rank, node_depth)


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


@cuda.jit
def build_trees_kernel(root_tokens, top_logprobs, top_ids, budget,
                       tokens, parents, depths, ranks, logprobs, sizes):
    """One block per request; TPB a power of two <= MAX_TPB.

    Shared memory: the node table (parent, rank, depth, weight per popped node, root = 0), the
    live frontier (parent, rank, weight per candidate; its depth is the parent's + 1), one
    frontier slot per thread for the reduction, and [live count, popped count]. One pop:
    ``_best_candidate`` finds the block's best, thread 0 ``_pop``s it. Outputs (Bq, W):
    ``write_tree``; sizes (Bq,) = n + 1.
    """
    request = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    node_parent = cuda.shared.array(MAX_TREE_NODES, int32)
    node_rank = cuda.shared.array(MAX_TREE_NODES, int32)
    node_depth = cuda.shared.array(MAX_TREE_NODES, int32)
    node_weight = cuda.shared.array(MAX_TREE_NODES, float32)
    cand_parent = cuda.shared.array(MAX_TREE_NODES, int32)
    cand_rank = cuda.shared.array(MAX_TREE_NODES, int32)
    cand_weight = cuda.shared.array(MAX_TREE_NODES, float32)
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
    write_tree(request, root_tokens, top_ids, size, node_parent, node_rank, node_depth, node_weight,
                tokens, parents, depths, ranks, logprobs)
    if tid == 0:
        sizes[request] = size


def run(root_token, top_logprobs, top_ids, budget, *, threads=None) -> DraftTree:
    """One request's tree (as ``kernels.tree.build_tree``), built by version 1."""
    roots, top_logprobs, top_ids, budget, _ = check_build_trees(
        np.array([root_token], np.int64), np.asarray(top_logprobs)[None], np.asarray(top_ids)[None], budget)
    out = TreeBatch(*(cuda.device_array((1, budget + 1), np.float32 if name == "logprobs" else np.int64)
                      for name in TreeBatch._fields[:-1]), cuda.device_array(1, np.int64))
    build_trees_kernel[1, threads or pow2_threads(budget + 1), 0](
        to_device(roots, np.int64), to_device(top_logprobs, np.float32), to_device(top_ids, np.int64), budget,
        *out)
    return trees_from_batch(out)[0]


def cases() -> list[Case]:
    """Rows without ties, tied rows (the tie rule everywhere), a frontier wider than the block,
    the heap running empty, and the root alone."""
    rng = np.random.default_rng(1)
    tied = np.tile(np.log(np.array([0.65, 0.2, 0.1, 0.05], np.float32)), (4, 1))       # [L=4, K=4]
    ids = np.stack([rng.permutation(50)[:4] for _ in range(4)])
    wide_lp = np.array([[-0.1] * 40, [-5.0] * 40], np.float32)                       # 40 > 32 threads
    wide_ids = np.stack([rng.permutation(100)[:40] for _ in range(2)])
    return [Case("random", (3, *top_candidates(rng.normal(0, 3, (3, 30)).astype(np.float32), 5), 11)),
            Case("ties", (0, tied, ids, 17)),
            Case("wide frontier", (5, wide_lp, wide_ids, 45)),
            Case("heap empties", (2, *top_candidates(rng.normal(0, 1, (3, 6)).astype(np.float32), 2), 20)),
            Case("root only", (7, tied, ids, 0))]
