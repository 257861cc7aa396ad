"""The draft tree on the GPU: the top-K candidates, the builder (one block per request's tree),
the visibility mask and the rows' positions and paths.

Legend: Bq requests, L depths, K candidates per depth, V vocab_size, B node budget (root not
counted), W = B + 1 padded tree width, N tree nodes (root included), TPB threads per block.

Kernels:
- ``top_candidates_sort_kernel``: the twin of ``ddtree.tree.top_candidates``: one block per
  drafter row, log-softmax (max, then a float64 sum of exp), then a bitonic sort of (log-prob,
  id) pairs in shared memory under the order log-prob descending, id ascending. A row longer
  than the buffer (TOPK_CHUNK pairs) streams through it.
- ``build_trees_sorted_kernel`` and ``build_trees_keyed_kernel`` (``sorted_builder``): one block
  per request, the frontier kept sorted in shared memory (a pop costs one barrier); on equal
  weights the sorted kernel climbs both candidates' paths through the node table
  (``comes_before``), the keyed kernel compares integer keys (where they fit: ``key_shape``).
- ``visibility_kernel``: one thread per (request, i, j): is j on the path root..i?
- ``positions_kernel``: one thread per tree row: its position P + depth and its path root..i
  by depth (what the engine's attention enumerates instead of a mask).

The trees are bit-identical to ``ddtree.tree.build_tree``'s: the same float32 weights, summed root to leaf (a
sibling weighs ``w[parent] + lp``, never ``w - lp + lp``), and the same tie rule (equal weights: the
lexicographically smallest rank tuple pops first, a prefix before its extensions), one strict total order, so
the pop order does not depend on how the threads share the work. The sorted kernel's node table
(MAX_TREE_NODES entries), its two frontier buffers and the staged log-probs fill the 48 KB of static shared
memory, so a budget is at most MAX_TREE_NODES - 1 (``check_budget``).
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
from kernels.tuning import KEYED_TREE_NODES, TOPK_CHUNK, TREE_STAGE_BATCH, TREE_STAGE_FLOATS, VIS_TILE

MAX_TREE_NODES = 1025            # the builder's node table: the root + at most 1024 drafted nodes
BUDGET_LIMIT_IS = "MAX_TREE_NODES - 1: the GPU builder keeps the tree in shared memory"
_NEG_INF = np.float32(-np.inf)
_NO_TOKEN = 2**31 - 1            # an empty sort slot: (-inf, _NO_TOKEN) sorts after every real token
BUILD_VERSIONS = (2, 3)          # build_trees_device's kernels: sorted (2) and keyed (3)
MAX_KEYED_BUDGET = KEYED_TREE_NODES - 1
KEY_DEPTHS = 128                 # the depths the keys can hold (2 x the digits per word, + 1)
ZERO, ONE = uint64(0), uint64(1)    # the builder indexes shared memory with uint64


# --8<-- [start:comes_before]
@cuda.jit(device=True, inline="always")
def comes_before(weight_a, parent_a, rank_a, weight_b, parent_b, rank_b, node_parent, node_rank, node_depth):
    """True if candidate a = (weight_a, parent node parent_a, rank_a) pops before candidate b:
    heavier first, then the smaller rank tuple.

    Candidate a is the rank tuple path(parent_a) + (rank_a,). On a tie, lift the deeper candidate to the
    other's depth, then climb both until they share a parent: the ranks there decide. They always differ: one
    live candidate is never a prefix of another (the shorter one is not popped yet, so nothing below it
    exists). The walk costs at most L steps in shared memory. ``inline="always"``: numba pastes it into the
    kernel instead of a call that passes every array field by field.
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
# --8<-- [end:comes_before]


@cuda.jit(device=True)
def write_tree(request, root_tokens, top_ids, size, node_parent, node_rank, node_depth, node_weight,
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


# --8<-- [start:build_trees_sorted_kernel]
@cuda.jit(device=True, inline="always")
def _key_before(weight_a, high_a, low_a, weight_b, high_b, low_b):
    """The keyed order: heavier first, then the smaller key (high word, then low word)."""
    if weight_a != weight_b:
        return weight_a > weight_b
    return high_a < high_b or (high_a == high_b and low_a < low_b)


@cuda.jit(device=True, inline="always")
def _pops_first(keyed, a, b, nodes):
    """Candidate a pops before candidate b (each (weight, parent, rank, key high, key low)): by
    their keys (``keyed``), else by climbing the node table ``nodes`` (``comes_before``)."""
    if keyed:
        return _key_before(a[0], a[3], a[4], b[0], b[3], b[4])
    return comes_before(a[0], a[1], a[2], b[0], b[1], b[2], nodes[0], nodes[1], nodes[2])


@cuda.jit(device=True, inline="always")
def _read_front(front, slot, keyed):
    """The frontier entry at ``slot`` as a candidate (its key words 0 without ``keyed``)."""
    return (front[2][slot], front[0][slot], front[1][slot], front[3][slot] if keyed else int64(0),
            front[4][slot] if keyed else int64(0))


@cuda.jit(device=True, inline="always")
def _place(index, top, node, candidate, nodes, front, base, keyed):
    """``candidate`` lands at ``index`` of the merged frontier: the last index (``top``) pops next,
    so it becomes node ``node`` of the node table; the others go to the frontier buffer that
    starts at ``base`` (index, top, node and base are uint64)."""
    weight, parent, rank, high, low = candidate
    if index == top:
        nodes[0][node] = parent
        nodes[1][node] = rank
        nodes[2][node] = nodes[2][uint64(parent)] + 1
        nodes[3][node] = weight
        if keyed:
            nodes[4][node] = high
            nodes[5][node] = low
    else:
        slot = base + index
        front[0][slot] = parent
        front[1][slot] = rank
        front[2][slot] = weight
        if keyed:
            front[3][slot] = high
            front[4][slot] = low


@cuda.jit(device=True, inline="always")
def _stage_logprobs(top_logprobs, request, stage_depths, stage_width, stage):
    """Copy top_logprobs[request, :stage_depths, :stage_width] to shared ``stage`` (index depth *
    width + rank), TREE_STAGE_BATCH loads in flight per thread before their stores."""
    staged = cuda.local.array(TREE_STAGE_BATCH, float32)
    total = stage_depths * stage_width
    for base in range(cuda.threadIdx.x, total, cuda.blockDim.x * TREE_STAGE_BATCH):
        for b in range(TREE_STAGE_BATCH):
            i = min(base + b * cuda.blockDim.x, total - 1)    # past the end: re-read the last
            staged[b] = top_logprobs[request, i // stage_width, i % stage_width]
        for b in range(TREE_STAGE_BATCH):
            if base + b * cuda.blockDim.x < total:
                stage[base + b * cuda.blockDim.x] = staged[b]


@cuda.jit(device=True, inline="always")
def _logprob(stage, width, top_logprobs, request, depth, rank):
    """top_logprobs[request, depth, rank]: from the shared copy when it was staged (width > 0)."""
    if width > ZERO:
        return stage[depth * width + rank]
    return top_logprobs[request, depth, rank]


@cuda.jit(device=True, inline="always")
def _start_tree(top_logprobs, request, first, key_base, key_digits, unit, nodes, front, keyed):
    """(one thread) The keys' units (``keyed``: unit[d] = base^(D - d), then base^(2D - d)), the root as node
    0 (weight 0) and, where ``first`` is ONE, the candidate (depth 1, rank 0) as node 1, the first to pop."""
    if keyed:
        power = int64(1)
        for d in range(2 * key_digits, 0, -1):
            unit[d] = power
            power = int64(1) if d == key_digits + 1 else power * key_base
        nodes[4][0] = 0
        nodes[5][0] = 0
    nodes[0][0] = -1
    nodes[1][0] = -1
    nodes[2][0] = 0
    nodes[3][0] = float32(0.0)
    if first == ONE:
        _place(ZERO, ZERO, ONE, (nodes[3][0] + top_logprobs[request, 0, 0], int32(0), int32(0),
                                 unit[1] if keyed else int64(0), int64(0)), nodes, front, ZERO, keyed)


@cuda.jit(device=True, inline="always")
def _new_candidates(node, nodes, unit, digits, stage, width, top_logprobs, request, keyed):
    """Popping ``node`` frees its next sibling (parent's weight + the next rank's log-prob) and its
    first child (its weight + the next depth's best): (has_sibling, sibling, has_child, child),
    each candidate (weight, parent, rank, key high, key low). A key is the node's plus one unit
    at its depth (the sibling) or at the next depth (the child)."""
    parent = uint64(nodes[0][node])
    rank = uint64(nodes[1][node])
    depth = uint64(nodes[2][node])
    sibling = rank + ONE < uint64(top_logprobs.shape[2])
    child = depth < uint64(top_logprobs.shape[1])
    sibling_weight = float32(0.0)
    child_weight = float32(0.0)
    sibling_high = child_high = sibling_low = child_low = int64(0)
    if keyed:
        sibling_high = child_high = nodes[4][node]
        sibling_low = child_low = nodes[5][node]
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
        sibling_weight = nodes[3][parent] + _logprob(stage, width, top_logprobs, request, depth - ONE,
                                                     rank + ONE)
    if child:
        child_weight = nodes[3][node] + _logprob(stage, width, top_logprobs, request, depth, ZERO)
    return (sibling, (sibling_weight, int32(parent), int32(rank + ONE), sibling_high, sibling_low),
            child, (child_weight, int32(node), int32(0), child_high, child_low))


@cuda.jit(device=True, inline="always")
def _merge_gap(gap, rest, side, other, top, node, has_sibling, sibling, has_child, child, sibling_first,
               nodes, front, keyed):
    """Gap ``gap`` of the sorted frontier (between its entries gap - 1 and gap, read at ``side``)
    into the merged frontier (written at ``other``): old entry gap moves up by the new candidates
    that pop after it; a new candidate lands here when it pops before old entry gap - 1 (nothing
    below gap 0) and after old entry gap (nothing above gap ``rest``)."""
    sibling_here = has_sibling
    child_here = has_child
    if gap > ZERO:
        below = _read_front(front, side + gap - ONE, keyed)
        sibling_here = sibling_here and _pops_first(keyed, sibling, below, nodes)
        child_here = child_here and _pops_first(keyed, child, below, nodes)
    if gap < rest:
        old = _read_front(front, side + gap, keyed)
        over_sibling = has_sibling and _pops_first(keyed, old, sibling, nodes)
        over_child = has_child and _pops_first(keyed, old, child, nodes)
        sibling_here = sibling_here and over_sibling
        child_here = child_here and over_child
        _place(gap + (ONE if over_sibling else ZERO) + (ONE if over_child else ZERO), top, node + ONE, old,
               nodes, front, other, keyed)
    if sibling_here:                                          # above the child if it pops first
        _place(gap + (ONE if sibling_first else ZERO), top, node + ONE, sibling, nodes, front, other, keyed)
    if child_here:
        _place(gap + (ONE if has_sibling and not sibling_first else ZERO), top, node + ONE, child, nodes,
               front, other, keyed)


@functools.cache
def sorted_builder(keyed: bool):
    """The builder's kernel: sorted (``keyed`` False) or keyed (True), one body, two tie breaks.

    One block per request. The frontier (every live candidate but the next pop) sits in
    ``front[side:side + rest]`` in pop order reversed (index rest - 1 pops first), and the candidate that pops
    next is already node ``popped`` of the node table. Pop it: every thread computes its two new candidates
    (``_new_candidates``), and thread t merges gap t of the sorted frontier (``_merge_gap``) into the other
    buffer (reads and writes never share one), whose last entry, the best, goes straight to the node table as
    the next node: one ``cuda.syncthreads`` per pop. ``stage_width`` > 0: the log-probs
    [:stage_depths, :stage_width] were copied to shared memory first.

    The keyed kernel carries each candidate's rank tuple as a number, the digits rank + 1 in base ``key_base``
    (> every rank + 1), the first ``key_digits`` depths in the high word, the next ones in the low word, zeros
    past its depth (a prefix first): comparing keys compares the tuples. Every shared-memory index of the pop
    loop is a uint64 (``ZERO``, ``ONE``): numba tests a signed index for wraparound before each load and
    store. The node table is the tuple (parent, rank, depth, weight, key high, key low), the frontier (parent,
    rank, weight, key high, key low), both buffers in one flat array each, the second at ``other_side``.
    """
    slots = KEYED_TREE_NODES if keyed else MAX_TREE_NODES
    key_slots = KEYED_TREE_NODES if keyed else 1              # the sorted kernel keeps no keys
    unit_slots = KEY_DEPTHS if keyed else 1
    front_slots, front_key_slots = 2 * slots, 2 * key_slots   # two frontier buffers, one after the other
    other_side = uint64(slots)                                # the second buffer's first slot

    @cuda.jit
    def kernel(root_tokens, top_logprobs, top_ids, budget, stage_depths, stage_width, key_base, key_digits,
               tokens, parents, depths, ranks, logprobs, sizes):
        request = cuda.blockIdx.x
        tid = uint64(cuda.threadIdx.x)
        threads = uint64(cuda.blockDim.x)
        node_parent = cuda.shared.array(slots, int32)         # (one shared array per line: the simulator
        node_rank = cuda.shared.array(slots, int32)           # tells them apart by line)
        node_depth = cuda.shared.array(slots, int32)
        node_weight = cuda.shared.array(slots, float32)
        node_high = cuda.shared.array(key_slots, int64)
        node_low = cuda.shared.array(key_slots, int64)
        front_parent = cuda.shared.array(front_slots, int32)  # two buffers: read one, write the other
        front_rank = cuda.shared.array(front_slots, int32)
        front_weight = cuda.shared.array(front_slots, float32)
        front_high = cuda.shared.array(front_key_slots, int64)
        front_low = cuda.shared.array(front_key_slots, int64)
        unit = cuda.shared.array(unit_slots, int64)           # one key digit at depth d
        nodes = (node_parent, node_rank, node_depth, node_weight, node_high, node_low)
        front = (front_parent, front_rank, front_weight, front_high, front_low)
        stage = cuda.shared.array(TREE_STAGE_FLOATS, float32)
        if stage_width > 0:
            _stage_logprobs(top_logprobs, request, stage_depths, stage_width, stage)
        width = uint64(max(stage_width, 0))
        limit = uint64(max(budget, 0))
        popped = ONE if limit > ZERO and top_logprobs.shape[1] > 0 else ZERO   # node 1 pops first
        if tid == ZERO:
            _start_tree(top_logprobs, request, popped, key_base, key_digits, unit, nodes, front, keyed)
        cuda.syncthreads()
        rest = ZERO                                           # frontier entries besides the next pop
        side = ZERO                                           # this pop reads at side, writes at the other
        while ZERO < popped < limit:
            node = popped                                     # pop it: its sibling and child join
            has_sibling, sibling, has_child, child = _new_candidates(
                node, nodes, unit, uint64(key_digits), stage, width, top_logprobs, request, keyed)
            sibling_first = has_sibling and has_child and _pops_first(keyed, sibling, child, nodes)
            total = rest + (ONE if has_sibling else ZERO) + (ONE if has_child else ZERO)
            if total == ZERO:                                 # the heap is empty (same in every thread)
                break
            other = other_side - side
            gap = tid
            while gap <= rest:                                # (a while loop: no division per pop)
                _merge_gap(gap, rest, side, other, total - ONE, node, has_sibling, sibling, has_child, child,
                           sibling_first, nodes, front, keyed)
                gap += threads
            rest = total - ONE
            side = other
            popped += ONE
            cuda.syncthreads()                                # the merged frontier and the node are in
        cuda.syncthreads()
        size = int64(popped) + 1
        write_tree(request, root_tokens, top_ids, size, node_parent, node_rank, node_depth, node_weight,
                   tokens, parents, depths, ranks, logprobs)
        if tid == ZERO:
            sizes[request] = size

    return kernel


build_trees_sorted_kernel = sorted_builder(False)          # version 2
build_trees_keyed_kernel = sorted_builder(True)            # version 3


def key_shape(depths: int, k: int, budget: int) -> tuple[int, int]:
    """The keyed builder's keys for L = ``depths``, K = ``k``, B = ``budget``: (base, digits per
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


def check_build_trees(root_tokens, top_logprobs, top_ids, budget, *, threads=None, out=None, version=None):
    """Host arrays get the full value checks of ddtree.tree, device arrays shape and dtype; then
    the launch's: version (None: the one that fits), the budget (at most MAX_TREE_NODES - 1;
    version 3: ``key_shape`` fits), block size, ``out`` (a TreeBatch of width W = B + 1). Returns
    root_tokens, top_logprobs, top_ids, budget (an int) and the version."""
    if version is not None:
        check_version(version, BUILD_VERSIONS)
    budget = check_budget(budget, MAX_TREE_NODES - 1, BUDGET_LIMIT_IS)
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
        shape = (requests, max(width, budget + 1))                    # [Bq, W]
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
    """The log-probs the builder copies to shared memory, (depths, ranks) = (min(L, B), min(K, B +
    1)) (a pop reaches depth <= B and rank <= B), or (0, 0) when they exceed TREE_STAGE_FLOATS."""
    rows, width = min(depths, budget), min(k, budget + 1)
    return (rows, width) if 0 < rows * width <= TREE_STAGE_FLOATS else (0, 0)


# --8<-- [start:build_trees_device]
def build_trees_device(root_tokens, top_logprobs, top_ids, budget: int, *, threads: int | None = None,
                       out: TreeBatch | None = None, stream=None, version: int | None = None) -> TreeBatch:
    """Build Bq trees at once: root_tokens (Bq,), top_logprobs and top_ids (Bq, L, K).

    Returns a TreeBatch of device arrays of width W = budget + 1, no host copies, or writes into
    ``out`` (a TreeBatch of device arrays of width W >= budget + 1: padding past the tree, as the
    engine's buckets need). ``budget`` is shared by all requests, 0 <= budget <= MAX_TREE_NODES
    - 1; ``threads`` forces the block size (a power of two <= 128); ``stream`` is where the
    kernel is launched (None: the default stream); ``version`` picks the kernel: 2 breaks ties by
    climbing the node table, 3 by a key; None (the default) takes 3 where its keys fit
    (``key_shape``), else 2. Every version gives the same tree.
    """
    root_tokens, top_logprobs, top_ids, budget, version = check_build_trees(
        root_tokens, top_logprobs, top_ids, budget, threads=threads, out=out, version=version)
    shape = (top_logprobs.shape[0], budget + 1)                             # [Bq, W]
    out = out or TreeBatch(*(output(None, shape[:1] if name == "sizes" else shape,
                                    np.float32 if name == "logprobs" else np.int64, stream)
                             for name in TreeBatch._fields))              # -1 / NaN until written
    kernel = build_trees_keyed_kernel if version == 3 else build_trees_sorted_kernel
    dims = top_logprobs.shape[1], top_logprobs.shape[2], budget
    kernel[shape[0], threads or pow2_threads(budget), stream](           # about one frontier gap per thread
        to_device(root_tokens, np.int64), to_device(top_logprobs, np.float32), to_device(top_ids, np.int64),
        budget, *staged_shape(*dims), *(key_shape(*dims) if version == 3 else (0, 0)), *out)
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

    x indexes columns j (neighbouring threads write neighbouring bytes), y rows i, z requests. Ancestors have
    smaller indices than their descendants: walk up from i while above j; j is an ancestor (or i itself) iff
    the walk lands on it. A parent of -1 (root, padding) ends the walk. No shared memory.
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


# --8<-- [start:max_log_sum]
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
# --8<-- [end:max_log_sum]


# --8<-- [start:top_candidates_sort_kernel]
@cuda.jit(device=True, inline="always")
def _sort_pairs(values, ids, size):
    """Bitonic sort of (values, ids)[:size] (size a power of two) into the order log-prob descending, token id
    ascending. Stage (span, stride): pair i compares slots low and low + stride and puts the better one first
    in spans with (low & span) == 0, last in the others; one barrier per stage,
    log2(size) * (log2(size) + 1) / 2 stages. Unsigned indices, shifts and while loops: a stage is a few
    instructions per thread (numba tests every signed index for wraparound, a signed // 2 needs a sign fix-up,
    and a strided ``range`` divides to count its steps)."""
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
    """The top-K kernel, for blocks of ``threads`` threads and a shared sort buffer of
    ``slots`` (log-prob, id) pairs (both powers of two)."""

    @cuda.jit
    def kernel(logits, top_logprobs, top_ids):
        # one block = one drafter row: 1. the row max (float32); 2. the sum of exp(logit - max) in float64,
        # its log cast to float32 (numpy's steps, ``_max_log_sum``). Then the first ``slots`` tokens go into
        # the buffer (token s in slot s, empty slots (-inf, _NO_TOKEN) sort last); if V fits, one bitonic sort
        # and done. Otherwise sort, keep the best K and stream the rest of the row in tiles of (slots - K) / 2
        # tokens: a token joins the buffer (an atomic slot) only if it beats the K-th best so far; a full
        # buffer is sorted back to its best K first.
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


def check_top_candidates(logits, k, *, out=None, chunk=None):
    """Host logits get the reference's checks (NaN, +inf, a finite value per row); device logits
    must be (L, V) float32 (values unchecked: that would need a copy). ``out``: (top_logprobs
    (L, K) float32, top_ids (L, K) int64); ``chunk``: None or a power of two in [4, TOPK_CHUNK];
    a row longer than the sort buffer (``sort_slots``) needs K <= half the buffer."""
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
    slots = sort_slots(logits.shape[1], chunk)
    if logits.shape[1] > slots and k > slots // 2:
        raise ValueError(f"k must be <= {slots // 2} (half the sort buffer of {slots} pairs, which a row of "
                         f"vocab {logits.shape[1]} streams through), got {k}")
    if out is not None:
        check_out(out[0], (logits.shape[0], k), np.float32, "out[0] (top_logprobs)")
        check_out(out[1], (logits.shape[0], k), np.int64, "out[1] (top_ids)")
    return logits


def sort_slots(vocab: int, chunk: int | None = None) -> int:
    """Top-K's sort buffer: the smallest power of two >= V, at most ``chunk`` (TOPK_CHUNK)."""
    slots = 1
    while slots < min(vocab, chunk or TOPK_CHUNK):
        slots *= 2
    return slots


# --8<-- [start:top_candidates]
def top_candidates(logits, k: int, *, out=None, stream=None, chunk: int | None = None):
    """Drafter logits (L, V) -> the K best per depth: (top_logprobs (L, K) float32, top_ids (L, K)
    int64), sorted descending, equal log-probs lower id first: ``ddtree.tree.top_candidates``.

    ``out``: a pair of device arrays to write into; ``stream``: where the kernel is launched;
    ``chunk``: the sort buffer's pairs (default TOPK_CHUNK; smaller ones stream shorter rows).
    """
    logits = check_top_candidates(logits, k, out=out, chunk=chunk)
    depths, vocab = logits.shape
    out_logprobs, out_ids = out or (None, None)
    top_logprobs = output(out_logprobs, (depths, k), np.float32, stream)     # [L, K]
    top_ids = output(out_ids, (depths, k), np.int64, stream)                # [L, K]
    if depths:
        slots = sort_slots(vocab, chunk)
        threads = pow2_threads(slots // 2, 512)               # a pair per thread; 1024 run out of registers
        top_candidates_sort_kernel(threads, slots)[depths, threads, stream](to_device(logits), top_logprobs,
                                                                             top_ids)
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
