"""The draft tree: top-K candidates per depth, the best-first builder, the visibility mask.

Legend (docs/glossary.md): L draft depths (block_size - 1), K candidates per depth, V vocab_size,
B node budget (root not counted), n drafted nodes (n <= B), N = n + 1 tree nodes (root
included), Bq requests in a batch.

A candidate is a rank tuple (r1..rd): the token ``top_ids[i-1, r_i]`` at depth i. Its weight is
the sum of its log-probs ``top_logprobs[i-1, r_i]`` (the log of a product of marginals). The
builder pops the B heaviest candidates with a heap, so the tree is prefix-closed and maximises
the expected accepted length under the independence surrogate.

Two rules make every implementation (this one and ``kernels.tree``) give the same tree, bit for bit:

* **Weights** are float32 and are always summed root to leaf, in path order: a first child
  weighs ``w[node] + lp[d, 0]`` and a next sibling ``w[parent] + lp[d-1, r+1]``. The sibling is
  not computed as ``w - lp[d-1, r] + lp[d-1, r+1]`` (two roundings, and a value that depends on
  how the candidate was generated); so the weight of a node is exactly the float32 path sum,
  whichever route produced it, and the GPU kernel reproduces it bit for bit.
* **Ties**: among equal weights the candidate with the lexicographically smallest rank tuple
  pops first; a tuple that is a prefix of a longer one is the smaller (the reference's rule).

With log-probs <= 0 (any log-softmax output; ``check_candidates`` rejects others), a candidate
never weighs more than the entry that generated it, and with the tie rule that entry also sorts
first; so the pops come out in exactly the order of ``sorted(all candidates, key=(-weight, rank
tuple))``, cut after B.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


# --8<-- [start:DraftTree]
@dataclasses.dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree in pop order; node 0 is the root (the previous round's bonus token).

    The arrays are read-only copies (int64, logprobs float32). ``eq=False``: compare trees field
    by field (numpy arrays have no single truth value).
    """
    tokens: np.ndarray     # [N] int64, tokens[0] = root token
    parents: np.ndarray    # [N] int64, parents[0] = -1, parents[i] < i
    depths: np.ndarray     # [N] int64, root 0
    ranks: np.ndarray      # [N] int64, rank of the node's token at its depth; root -1
    logprobs: np.ndarray   # [N] float32, cumulative log-prob of the path root..i; root 0.0

    def __post_init__(self):
        size = len(self.tokens)
        for field in dataclasses.fields(self):
            dtype = np.float32 if field.name == "logprobs" else np.int64
            array = np.array(getattr(self, field.name), dtype=dtype)          # our own copy
            if array.shape != (size,) or size < 1:
                raise ValueError(f"DraftTree.{field.name} must be 1-D with tree.size = {size} >= 1 entries, "
                                 f"got shape {array.shape}")
            array.flags.writeable = False
            object.__setattr__(self, field.name, array)

    @property
    def size(self) -> int:
        """N = n + 1 nodes, the root included."""
        return int(self.tokens.shape[0])

    def children(self, i: int) -> np.ndarray:
        """Indices of node ``i``'s children, in pop order (= rank order)."""
        return np.flatnonzero(self.parents == i)
# --8<-- [end:DraftTree]


def check_candidates(top_logprobs, top_ids):
    """Validate (..., L, K) candidate arrays; returns (float32 log-probs, int64 ids).

    Works for one request (L, K) and for a batch (Bq, L, K).
    """
    lp = np.asarray(top_logprobs)
    ids = np.asarray(top_ids)
    if lp.ndim < 2 or lp.shape != ids.shape:
        raise ValueError(f"top_logprobs and top_ids must have the same (L, K) shape, "
                         f"got {lp.shape} and {ids.shape}")
    if lp.shape[-1] < 1:
        raise ValueError(f"top_logprobs must have K >= 1 candidates per depth, got shape {lp.shape}")
    if not np.issubdtype(lp.dtype, np.floating):
        raise ValueError(f"top_logprobs must be a float array, got {lp.dtype}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"top_ids must be an integer array, got {ids.dtype}")
    lp = lp.astype(np.float32)
    if np.isnan(lp).any() or np.isposinf(lp).any():
        raise ValueError("top_logprobs must not contain NaN or +inf")
    if np.any(lp > 0):
        raise ValueError("top_logprobs must be log-probabilities, <= 0 (a log-softmax's output)")
    if not np.all(lp[..., 1:] <= lp[..., :-1]):
        raise ValueError("top_logprobs rows must be sorted in descending (non-increasing) order")
    if ids.size and ids.min() < 0:
        raise ValueError(f"top_ids must be non-negative token ids, got min {ids.min()}")
    sorted_ids = np.sort(ids, axis=-1)
    if np.any(sorted_ids[..., 1:] == sorted_ids[..., :-1]):
        raise ValueError("top_ids must be distinct within each row (siblings carry distinct tokens)")
    return lp, ids.astype(np.int64)


# --8<-- [start:check_budget]
def check_budget(budget, limit: int | None = None, limit_is: str = "", name: str = "budget") -> int:
    """The node budget's one rule, wherever a budget enters: an integer (not a bool) with
    0 <= budget <= ``limit``. Each caller passes its real limit and says what it is in
    ``limit_is`` (an engine's buffers, the GPU builder's shared memory); None: no limit but memory."""
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)) or budget < 0 \
            or (limit is not None and budget > limit):
        bound = ">= 0" if limit is None else f"in [0, {limit}] ({limit_is})"
        raise ValueError(f"{name} must be an integer {bound}, got {budget!r}")
    return int(budget)
# --8<-- [end:check_budget]


def tree_size(depths: int, k: int, budget: int) -> int:
    """N of the largest tree of at most ``budget`` drafted nodes over ``depths`` levels of ``k``
    candidates: the root + min(B, K + K^2 + ... + K^L) (a node has at most K children)."""
    drafted, level = 0, 1
    for _ in range(depths):
        level *= k                                           # nodes at this depth
        drafted += level
        if drafted >= budget:
            break
    return 1 + min(budget, drafted)


def check_token(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer token id, got {value!r}")
    return int(value)


# --8<-- [start:top_candidates]
def top_candidates(logits: np.ndarray, k: int):
    """Drafter logits (L, V) -> the K best per depth: (top_logprobs (L, K) float32, top_ids (L, K) int64).

    log-softmax in float32: subtract the row max (float32), sum the exponentials in float64, take
    the log and cast it to float32, subtract. Rows are sorted descending by log-prob; equal
    log-probs keep the lower token id first (stable sort).
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or not np.issubdtype(logits.dtype, np.floating):
        raise ValueError(f"logits must be a 2-D float array (L, V), got {logits.dtype} {logits.shape}")
    depths, vocab = logits.shape
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an integer in [1, vocab {vocab}], got {k!r}")
    logits = logits.astype(np.float32)                                       # [L, V]
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise ValueError("logits must not contain NaN or +inf")
    if depths == 0:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    row_max = logits.max(axis=-1, keepdims=True)                              # [L, 1]
    if not np.isfinite(row_max).all():
        raise ValueError("every logits row needs at least one finite value")
    shifted = logits - row_max                                                # [L, V] <= 0
    log_sum = np.log(np.exp(shifted.astype(np.float64)).sum(axis=-1, keepdims=True))  # [L, 1] >= 0
    logprobs = shifted - log_sum.astype(np.float32)                           # [L, V]
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]              # [L, K] lower id first on ties
    return np.take_along_axis(logprobs, order, axis=-1), order.astype(np.int64)
# --8<-- [end:top_candidates]


# --8<-- [start:build_tree]
def build_tree(root_token: int, top_logprobs: np.ndarray, top_ids: np.ndarray, budget: int) -> DraftTree:
    """Pop the ``budget`` heaviest candidates best-first; returns the tree in pop order.

    The heap holds entries (-weight, rank tuple, parent node, rank, weight): Python compares the
    key (-weight, rank tuple), which is the tie rule. Popping node ``n`` (parent p, depth d,
    rank r) pushes its next sibling (p, r + 1) if r + 1 < K and its first child (n, 0) if d < L:
    every candidate has exactly one generator, and the heap never holds more than B + 1 entries.
    """
    root_token = check_token(root_token, "root_token")
    top_logprobs, top_ids = check_candidates(top_logprobs, top_ids)
    budget = check_budget(budget)
    if top_logprobs.ndim != 2:
        raise ValueError(f"top_logprobs must be (L, K) for one request, got shape {top_logprobs.shape}")
    depths_max, k = top_logprobs.shape                                        # L, K

    tokens, parents, depths, ranks = [root_token], [-1], [0], [-1]
    weights = [np.float32(0.0)]                                               # float32 path sums
    paths = [()]                                                              # rank tuple per node
    heap = []

    def push(parent: int, rank: int):
        weight = weights[parent] + top_logprobs[depths[parent], rank]         # float32 + float32
        heapq.heappush(heap, (-float(weight), paths[parent] + (rank,), parent, rank, weight))

    if budget > 0 and depths_max > 0:
        push(0, 0)                                                            # (depth 1, rank 0)
    while heap and len(tokens) <= budget:
        _, path, parent, rank, weight = heapq.heappop(heap)
        node, depth = len(tokens), depths[parent] + 1
        tokens.append(int(top_ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        weights.append(weight)
        paths.append(path)
        if rank + 1 < k:
            push(parent, rank + 1)                                            # next sibling
        if depth < depths_max:
            push(node, 0)                                                     # first child
    return DraftTree(tokens=np.array(tokens, np.int64), parents=np.array(parents, np.int64),
                     depths=np.array(depths, np.int64), ranks=np.array(ranks, np.int64),
                     logprobs=np.array(weights, np.float32))
# --8<-- [end:build_tree]


def check_parents(parents) -> np.ndarray:
    """Validate parents (N,) or (Bq, N): parents[..., 0] = -1 and -1 <= parents[..., i] < i.

    -1 past the root marks a padding row (it sees only itself).
    """
    parents = np.asarray(parents)
    if parents.ndim not in (1, 2) or parents.shape[-1] < 1 or not np.issubdtype(parents.dtype, np.integer):
        raise ValueError(f"parents must be a non-empty (N,) or (Bq, N) integer array, "
                         f"got {parents.dtype} {parents.shape}")
    index = np.arange(parents.shape[-1])
    if np.any(parents[..., 0] != -1) or np.any(parents < -1) or np.any(parents >= index):
        raise ValueError("parents must have parents[0] = -1 and -1 <= parents[i] < i")
    return parents.astype(np.int64)


# --8<-- [start:visibility]
def visibility(parents: np.ndarray) -> np.ndarray:
    """Ancestor-only mask (N, N) bool: row i sees itself and its ancestors.

    ``vis[i, :i] = vis[parents[i], :i]`` is valid because a parent comes before its child.
    A batch (Bq, N) gives (Bq, N, N).
    """
    parents = check_parents(parents)
    if parents.ndim == 2:
        return np.stack([visibility(row) for row in parents])
    size = parents.shape[0]
    vis = np.zeros((size, size), dtype=bool)                                  # [N, N]
    for i in range(size):
        if parents[i] >= 0:
            vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return vis
# --8<-- [end:visibility]


# --8<-- [start:positions]
def positions(tree: DraftTree, start: int) -> np.ndarray:
    """Rotary position of each node: start + depth (siblings share a position)."""
    return (start + tree.depths).astype(np.int64)                             # [N]
# --8<-- [end:positions]


# --8<-- [start:positions_and_paths]
def positions_and_paths(parents: np.ndarray, depths: np.ndarray, start: int):
    """The engine's form of a tree's rows for attention: each row's rotary position start + depth,
    and its path by depth, paths[i, d] = the ancestor of row i at depth d (paths[i, depths[i]] =
    i), -1 past its depth. A padding row (parent -1, depth 0) gets the path [i]: it sees the
    prefix and itself. Returns (positions (N,), paths (N, max depth + 1))."""
    parents, depths = np.asarray(parents, np.int64), np.asarray(depths, np.int64)
    positions = (int(start) + depths).astype(np.int64)                         # [N]
    paths = np.full((depths.size, int(depths.max(initial=0)) + 1), -1, np.int64)  # [N, L+1]
    for i, depth in enumerate(depths):
        node = i
        for d in range(depth, -1, -1):                                          # row i up to the root
            paths[i, d] = node
            node = parents[node]
    return positions, paths
# --8<-- [end:positions_and_paths]

