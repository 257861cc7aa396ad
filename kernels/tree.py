"""The draft tree on the GPU: one thread block builds one request's tree; the visibility mask.

Legend: Bq requests, L depths, K candidates per depth, B node budget (root not counted),
W = B + 1 padded tree width, N tree nodes (root included).

Kernels:
- ``_build_trees_kernel``: one block per request. The live frontier (at most B + 1 candidates)
  and the nodes popped so far sit in shared memory; every pop is a block-wide argmax over the
  frontier (a strided scan per thread, then a shared-memory tree reduction).
- ``_visibility_kernel``: one thread per (request, i, j): is j on the path root..i?

The result is bit-identical to ``ddtree.tree.build_tree``: the same float32 weights, summed root
to leaf (a sibling weighs ``w[parent] + lp``, never ``w - lp + lp``), and the same tie rule
(equal weights: the lexicographically smallest rank tuple pops first, a prefix before its
extensions). Both follow from comparing candidates with one strict total order, so the argmax
does not depend on how the reduction pairs them up.

Shared memory bounds the budget: ``MAX_BUDGET`` = 1024 nodes need 7 tables of 1025 entries
(4 bytes each, ~29 KB per block, under the 48 KB of static shared memory).
"""

from __future__ import annotations

import typing

import numpy as np
from numba import cuda, float32, int32  # the kernels package chose GPU or simulator already

from ddtree.tree import DraftTree, check_budget, check_candidates, check_parents, check_token
from kernels.device import is_device_array, poisoned, to_device

MAX_BUDGET = 1024
_SLOTS = MAX_BUDGET + 1          # nodes (root + B) and live frontier entries (at most B + 1)
_MAX_THREADS = 128               # threads per block of the builder (a power of two)
_NEG_INF = np.float32(-np.inf)


# --8<-- [start:pops_before]
@cuda.jit(device=True)
def _pops_before(a, b, cand_weight, cand_parent, cand_rank, node_parent, node_rank, node_depth):
    """True if frontier slot ``a`` pops before slot ``b``: heavier first, then the smaller rank tuple.

    Candidate a is the rank tuple path(cand_parent[a]) + (cand_rank[a],). On a tie, lift the
    deeper candidate to the other's depth, then climb both until they share a parent: the ranks
    there decide. They always differ: one live candidate is never a prefix of another (the
    shorter one is not popped yet, so nothing below it exists). Ties are rare; the walk costs at
    most L steps in shared memory.
    """
    if cand_weight[a] != cand_weight[b]:
        return cand_weight[a] > cand_weight[b]
    parent_a = cand_parent[a]
    rank_a = cand_rank[a]
    parent_b = cand_parent[b]
    rank_b = cand_rank[b]
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
# --8<-- [end:pops_before]


# --8<-- [start:build_trees_kernel]
@cuda.jit
def _build_trees_kernel(root_tokens, top_logprobs, top_ids, budget,
                        tokens, parents, depths, ranks, logprobs, sizes):
    """One block per request; blockDim.x is a power of two <= _MAX_THREADS.

    Shared memory: the node table (parent, rank, depth, weight per popped node, root = 0), the
    live frontier (parent, rank, weight per candidate; its depth is the parent's + 1), one
    frontier slot per thread for the reduction, and [live count, popped count].
    One pop: every thread finds the best of its strided share of the frontier, a tree
    reduction finds the block's best, thread 0 appends it to the node table, moves the last
    frontier entry into its slot and appends its next sibling and first child.
    Outputs (Bq, W): nodes in pop order, then padding (token 0, parent -1, depth 0, rank -1,
    log-prob -inf); sizes (Bq,) = n + 1.
    """
    request = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    depth_max = top_logprobs.shape[1]
    k = top_logprobs.shape[2]
    node_parent = cuda.shared.array(_SLOTS, int32)
    node_rank = cuda.shared.array(_SLOTS, int32)
    node_depth = cuda.shared.array(_SLOTS, int32)
    node_weight = cuda.shared.array(_SLOTS, float32)
    cand_parent = cuda.shared.array(_SLOTS, int32)
    cand_rank = cuda.shared.array(_SLOTS, int32)
    cand_weight = cuda.shared.array(_SLOTS, float32)
    best = cuda.shared.array(_MAX_THREADS, int32)
    state = cuda.shared.array(2, int32)          # [live frontier entries, popped nodes]

    if tid == 0:
        node_parent[0] = -1
        node_rank[0] = -1
        node_depth[0] = 0
        node_weight[0] = float32(0.0)
        state[0] = 0
        state[1] = 0
        if budget > 0 and depth_max > 0:         # the heap starts with (depth 1, rank 0)
            cand_parent[0] = 0
            cand_rank[0] = 0
            cand_weight[0] = node_weight[0] + top_logprobs[request, 0, 0]
            state[0] = 1

    for step in range(budget):
        cuda.syncthreads()
        live = state[0]
        if live == 0:                            # the heap is empty (same value in every thread)
            break
        mine = -1                                # 1. best of this thread's share
        for slot in range(tid, live, threads):
            if mine < 0 or _pops_before(slot, mine, cand_weight, cand_parent, cand_rank,
                                        node_parent, node_rank, node_depth):
                mine = slot
        best[tid] = mine
        cuda.syncthreads()
        stride = threads // 2                    # 2. tree reduction over the threads
        while stride > 0:
            if tid < stride:
                other = best[tid + stride]
                if other >= 0 and (best[tid] < 0 or _pops_before(
                        other, best[tid], cand_weight, cand_parent, cand_rank,
                        node_parent, node_rank, node_depth)):
                    best[tid] = other
            cuda.syncthreads()
            stride //= 2
        if tid == 0:                             # 3. pop it: node number step + 1
            slot = best[0]
            node = step + 1
            parent = cand_parent[slot]
            rank = cand_rank[slot]
            depth = node_depth[parent] + 1
            node_parent[node] = parent
            node_rank[node] = rank
            node_depth[node] = depth
            node_weight[node] = cand_weight[slot]
            state[1] = node
            live -= 1                            # the last entry fills the popped slot
            cand_parent[slot] = cand_parent[live]
            cand_rank[slot] = cand_rank[live]
            cand_weight[slot] = cand_weight[live]
            if rank + 1 < k:                     # next sibling: parent's weight + its log-prob
                cand_parent[live] = parent
                cand_rank[live] = rank + 1
                cand_weight[live] = node_weight[parent] + top_logprobs[request, depth - 1, rank + 1]
                live += 1
            if depth < depth_max:                # first child
                cand_parent[live] = node
                cand_rank[live] = 0
                cand_weight[live] = node_weight[node] + top_logprobs[request, depth, 0]
                live += 1
            state[0] = live

    cuda.syncthreads()
    size = state[1] + 1
    for i in range(tid, tokens.shape[1], threads):
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
    if tid == 0:
        sizes[request] = size
# --8<-- [end:build_trees_kernel]


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
    """A power of two in [32, 128], about one frontier entry per thread."""
    threads = 32
    while threads < min(budget + 1, _MAX_THREADS):
        threads *= 2
    return threads
# --8<-- [end:builder_threads]


def _check_batch(root_tokens, top_logprobs, top_ids, budget):
    """Validate; host arrays get the full value checks of ddtree.tree, device arrays shape and dtype."""
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
    if is_device_array(root_tokens):
        if root_tokens.shape != top_logprobs.shape[:1] or root_tokens.dtype != np.int64:
            raise ValueError(f"device root_tokens must be int64 of shape {top_logprobs.shape[:1]}, "
                             f"got {root_tokens.dtype} {root_tokens.shape}")
    else:
        root_tokens = np.asarray(root_tokens)
        if root_tokens.shape != top_logprobs.shape[:1] or not np.issubdtype(root_tokens.dtype, np.integer) \
                or (root_tokens.size and root_tokens.min() < 0):
            raise ValueError(f"root_tokens must be {top_logprobs.shape[:1]} non-negative integer token "
                             f"ids, got {root_tokens.dtype} {root_tokens.shape}")
    if top_logprobs.shape[0] < 1:
        raise ValueError("build_trees needs at least one request (Bq >= 1)")
    return root_tokens, top_logprobs, top_ids, budget


def _launch_build(root_tokens, top_logprobs, top_ids, budget, out: TreeBatch, threads=None) -> TreeBatch:
    """Launch on validated inputs into ``out``; ``threads`` (a power of two <= 128) for tests."""
    threads = builder_threads(budget) if threads is None else threads
    _build_trees_kernel[top_logprobs.shape[0], threads](
        to_device(root_tokens, np.int64), to_device(top_logprobs, np.float32),
        to_device(top_ids, np.int64), budget, *out)
    return out


# --8<-- [start:build_trees_device]
def build_trees_device(root_tokens, top_logprobs, top_ids, budget: int) -> TreeBatch:
    """Build Bq trees at once: root_tokens (Bq,), top_logprobs and top_ids (Bq, L, K).

    Returns a TreeBatch of device arrays of width W = max(budget, 0) + 1, no host copies.
    ``budget`` is shared by all requests and at most ``MAX_BUDGET``.
    """
    root_tokens, top_logprobs, top_ids, budget = _check_batch(root_tokens, top_logprobs, top_ids, budget)
    shape = (top_logprobs.shape[0], max(budget, 0) + 1)                     # [Bq, W]
    out = TreeBatch(tokens=poisoned(shape, np.int64), parents=poisoned(shape, np.int64),
                    depths=poisoned(shape, np.int64), ranks=poisoned(shape, np.int64),
                    logprobs=poisoned(shape, np.float32), sizes=poisoned(shape[:1], np.int64))
    return _launch_build(root_tokens, top_logprobs, top_ids, budget, out)
# --8<-- [end:build_trees_device]


def trees_from_batch(batch: TreeBatch) -> list[DraftTree]:
    """Copy a TreeBatch to the host and cut each row to its size."""
    host = {name: array.copy_to_host() for name, array in batch._asdict().items()}
    return [DraftTree(tokens=host["tokens"][b, :size], parents=host["parents"][b, :size],
                      depths=host["depths"][b, :size], ranks=host["ranks"][b, :size],
                      logprobs=host["logprobs"][b, :size])
            for b, size in enumerate(host["sizes"])]


# --8<-- [start:build_trees]
def build_trees(root_tokens, top_logprobs, top_ids, budget: int) -> list[DraftTree]:
    """Bq trees, each equal to ``ddtree.tree.build_tree`` on its request (host DraftTrees)."""
    return trees_from_batch(build_trees_device(root_tokens, top_logprobs, top_ids, budget))
# --8<-- [end:build_trees]


# --8<-- [start:build_tree]
def build_tree(root_token: int, top_logprobs, top_ids, budget: int) -> DraftTree:
    """One request: top_logprobs and top_ids (L, K); the same tree as ``ddtree.tree.build_tree``."""
    root_token = check_token(root_token, "root_token")
    if not is_device_array(top_logprobs):
        top_logprobs, top_ids = check_candidates(top_logprobs, top_ids)
    if top_logprobs.ndim != 2:
        raise ValueError(f"top_logprobs must be (L, K) for one request, got shape {top_logprobs.shape}")
    return build_trees(np.array([root_token], np.int64), top_logprobs.reshape((1, *top_logprobs.shape)),
                       top_ids.reshape((1, *top_ids.shape)), budget)[0]
# --8<-- [end:build_tree]


# --8<-- [start:visibility_kernel]
@cuda.jit
def _visibility_kernel(parents, vis):
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


_VIS_TILE = 16


def _launch_visibility(parents, vis):
    tiles = (parents.shape[1] + _VIS_TILE - 1) // _VIS_TILE
    _visibility_kernel[(tiles, tiles, parents.shape[0]), (_VIS_TILE, _VIS_TILE)](parents, vis)
    return vis


# --8<-- [start:visibility]
def visibility(parents):
    """Ancestor-only mask: parents (N,) -> (N, N) bool, or (Bq, N) -> (Bq, N, N).

    Host in, host out; device in, device out. -1 past the root marks a padding row.
    """
    if is_device_array(parents):
        if parents.ndim not in (1, 2) or parents.dtype != np.int64 or parents.size < 1:
            raise ValueError(f"device parents must be a non-empty (N,) or (Bq, N) int64 array, "
                             f"got {parents.dtype} {parents.shape}")
        batch = parents if parents.ndim == 2 else parents.reshape((1, parents.shape[0]))
        vis = _launch_visibility(batch, poisoned((*batch.shape, batch.shape[1]), np.bool_))
        return vis if parents.ndim == 2 else vis.reshape(vis.shape[1:])
    parents = check_parents(parents)
    batch = parents.reshape((-1, parents.shape[-1]))
    vis = _launch_visibility(to_device(batch), poisoned((*batch.shape, batch.shape[1]), np.bool_))
    return vis.copy_to_host().reshape((*parents.shape, parents.shape[-1]))
# --8<-- [end:visibility]
