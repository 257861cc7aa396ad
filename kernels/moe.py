"""Mixture of experts with DeepSeek-V3 routing: the numba.cuda twin of ``ddtree/moe.py``.

Legend: T tokens, D hidden_size, E routed experts, G groups, k experts per token,
F moe_intermediate_size, Fs shared-expert width (n_shared_experts * F), TPB threads per block.

Kernels:
- the router's logits x . gate[e] come from ``kernels.linear`` (version "tiles"); then
  ``route_kernel``: one block per token: sigmoid (``_scores``), group-limited routing
  (``_keep_groups``), top-k by repeated block-wide argmax (``_pick_free``, exact ties -> lower
  index), normalised and scaled weights (``_weigh``). Both versions below route alike.
- version 1, per (token, slot) pair:
  - ``expert_hidden_pairs_kernel``: h[t, j, f] = silu(gate_e[f] x_t) * (up_e[f] x_t) for expert
    e = ids[t, j]: one block per 32 features (a lane each) and (token, slot) pair; the dot
    products are ``kernels.linear``'s "tiles" sums (``tile_dots``), for one row.
  - ``expert_down_pairs_kernel``: out[t, d] (+)= sum_j w[t, j] * down_e[d] h[t, j]: one block per
    32 output features and token; the k slots are added in slot order, so the result is
    deterministic without atomics.
- version 2, grouped by expert:
  - ``expert_lists_kernel``: one block per expert lists its (token, slot) pairs from the routed
    ids, in ascending token order (a thread per token; a pair's place = the pairs before it):
    lists (T, E), a column per expert (at most T pairs), -1 after.
  - ``expert_hidden_kernel``: the same h, grouped by expert: one block per 32 features and
    (expert, pass of ROWS_PER_PASS of its pairs); the expert's weight tile is staged once per pass
    and serves all its pairs (``tile_dots`` over the listed rows).
  - ``expert_down_kernel``: down[t, j, d] = down_e[d] h[t, j], the same grouping over output
    features.
  - ``combine_kernel``: out[t, d] (+)= sum_j w[t, j] * down[t, j, d], one thread per element, the
    k slots added in slot order.
  Blocks along y cover every expert's possible passes for the T rows (a fixed grid: the launches
  can be captured in a CUDA graph); a block past its expert's last pair returns.
Every sum runs in an order fixed by its own row: a token's result does not depend on the tokens
routed beside it, nor on how many share its experts (the engine's tree rows equal its AR rows, bit
for bit).

Versions (``version=`` of ``moe`` and ``swiglu``, default 2; the engine picks one per forward by
its row count, ``kernels.model.moe_version``). Both versions compute each pair's dot products with
the same ``tile_dots`` sums and add a token's slots in slot order from the same start, so they
give the same bits: a row's result does not depend on the version either.
Version 1 stages an expert's weight tiles once per (token, slot) pair that chose it: an expert
chosen by 20 tokens is read 20 times. The routed experts need no lists and no combine (two
launches, not four), so it is the faster one for few rows (a decode step, where most chosen
experts have one pair anyway).
Version 2 stages them once per pass of ROWS_PER_PASS of the expert's pairs: read 3 times, not 20.
It pays two extra launches (the lists, the combine) and each pair's down projection (T, k, D)
written and read back, so it is the faster one for many rows (a large tree's verify).

A dense SwiGLU (the dense layers and the shared expert) is the same two expert kernels with one
"expert" (E = 1) that every row chooses with weight 1, two launches in either version: version 1
reads ids = 0 and weights = 1 from the scratch; version 2 lists every row (lists[t, 0] = t, made
with the scratch) and its down projection is the output, no combine. ``moe`` runs the shared
expert first, then adds the routed experts in place: five launches (version 1) or seven
(version 2) plus the router's linear, nothing leaves the device.

Inputs are numpy arrays (results come back as numpy) or numba device arrays (results stay on the
device). ``moe`` calls ``device_params`` on every call: host weights in ``params`` are copied to
the device each time, device arrays are used as they are. MoE weights are large and reused every
step, so call ``device_params(params)`` once and pass its result to keep a layer's weights on the
device. The intermediate buffers (routed ids and weights, expert lists, the hidden states, the
pairs' down projections) are allocated per call unless a ``scratch`` from ``moe_scratch`` /
``dense_scratch`` is given (it holds both versions' buffers, so one scratch serves either): with
``out`` and ``scratch`` and device inputs nothing is allocated or copied. ``bytes_moved`` and
``flops`` give each operation's cost model.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
from numba import cuda, float32, int32, uint8

from ddtree import moe as reference
from ddtree.config import ModelConfig
from ddtree.moe import MoEParams
from kernels.blocks import (
    MAX_TPB,
    block_argmax,
    blocks,
    check_threads,
    comes_first,
    pow2_threads,
)
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
from kernels.linear import (
    LANES,
    LANES_PADDED,
    MAX_SLICES,
    ROWS_PER_PASS,
    k_slices,
    linear,
    row_passes,
    tile_dots,
)

MAX_EXPERTS = 1024      # router shared arrays hold one score per expert (DeepSeek 256, Kimi 384)
MAX_GROUPS = 64         # ... and one score per group (DeepSeek 8)
TPB = 128               # combine_kernel's threads per block (one per output element)
LIST_TPB = 32 if SIMULATOR else 128   # expert_lists_kernel's: tokens per chunk (any size: same lists)
VERSIONS = (1, 2)       # the expert kernels: 1 per (token, slot) pair, 2 grouped by expert
F32, I64 = 4, 8
# the expert kernels' dot products (kernels.linear's "tiles" sums over listed rows): one pair, or a
# pass of ROWS_PER_PASS pairs of one expert (version 2); each row's sums are the same either way
listed_dots_one, listed_dots_pass = tile_dots(1, listed=True), tile_dots(ROWS_PER_PASS, listed=True)


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
    """silu(gate) * up = gate * sigmoid(gate) * up, one hidden feature of a SwiGLU (both versions)."""
    return gate * sigmoid_scalar(gate) * up


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
    """1. Thread e (strided over E): score[e] = sigmoid(logits[t, e]); choice[e] = score[e] +
    bias[e] (the bias only chooses); every expert starts free."""
    for e in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        score[e] = sigmoid_scalar(logits[token, e])
        choice[e] = score[e] + bias[e]
        free[e] = 1
    cuda.syncthreads()


@cuda.jit(device=True)
def _top_two_sum(choice, first_expert, end):
    """The sum of the two largest choice[first_expert:end] (a group has at least two experts)."""
    first = choice[first_expert]
    second = choice[first_expert + 1]
    if second > first:
        first, second = second, first
    for e in range(first_expert + 2, end):
        if choice[e] > first:
            second = first
            first = choice[e]
        elif choice[e] > second:
            second = choice[e]
    return second + first


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
    total = float32(0.0)
    for j in range(ids.shape[1]):
        total += score[ids[token, j]]
    for j in range(ids.shape[1]):
        w = score[ids[token, j]]
        if norm_topk_prob:
            w = w / (total + float32(1e-20))
        weights[token, j] = w * scaling


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


# --- version 1: per (token, slot) pair ---------------------------------------------------------

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


# --- version 2: grouped by expert ----------------------------------------------------------------

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
        for other in range(LIST_TPB):                    # every thread counts the whole chunk
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


# --8<-- [start:listed_dots]
@cuda.jit(device=True)
def _pass_rows(lists, expert, first, per_row, rows):
    """rows[r] = the row (pair // per_row) of the pair lists[first + r, expert], for the up to
    ROWS_PER_PASS pairs of one pass (lists[first, expert] is one); the rows after its last pair
    repeat it (staged, never written). Returns the pass's pair count."""
    count = 0
    for r in range(ROWS_PER_PASS):
        if first + r < lists.shape[0] and lists[first + r, expert] >= 0:
            count = r + 1
        rows[r] = lists[first + count - 1, expert] // per_row
    return count


@cuda.jit(device=True)
def _dots(x, rows, count, weight, n0, acc, w_tile, x_tile, partial):
    """``kernels.linear.tile_dots`` over the listed rows of a pass of ``count`` pairs: a lone pair
    (every expert of a decode step) skips the other rows' work. Each pair's dot is the same either
    way. (More sizes, 2 and 4, measured slower on the H200: every size is inlined into the kernel.)"""
    if count == 1:
        listed_dots_one(x, 0, count, rows, weight, n0, acc, w_tile, x_tile, partial)
    else:
        listed_dots_pass(x, 0, count, rows, weight, n0, acc, w_tile, x_tile, partial)
# --8<-- [end:listed_dots]


# --8<-- [start:expert_hidden_kernel]
@cuda.jit
def expert_hidden_kernel(x, gate_proj, up_proj, lists, slots, per_expert, hidden):
    # hidden[p, f] = silu(gate_proj[e, f] . x_t) * (up_proj[e, f] . x_t) for each pair p = t * k + j
    # of expert e (lists[:, e]); hidden is (T * k, F). One block = features f0 .. f0 + 31
    # (blockIdx.x; lane = f) of expert e = blockIdx.y // per_expert, for its passes of
    # ROWS_PER_PASS pairs blockIdx.y % per_expert, + per_expert, ...: each staged weight tile
    # serves every pair of a pass
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    gate = cuda.local.array(ROWS_PER_PASS, float32)
    up = cuda.local.array(ROWS_PER_PASS, float32)
    rows = cuda.local.array(ROWS_PER_PASS, int32)
    expert, own = cuda.blockIdx.y // per_expert, cuda.blockIdx.y % per_expert      # own: the first pass
    f0 = cuda.blockIdx.x * LANES
    f = f0 + cuda.threadIdx.x
    for first in range(own * ROWS_PER_PASS, lists.shape[0], per_expert * ROWS_PER_PASS):
        if lists[first, expert] < 0:
            return                                       # the expert's pairs are done
        count = _pass_rows(lists, expert, first, slots, rows)      # x rows: the pairs' tokens
        _dots(x, rows, count, gate_proj[expert], f0, gate, w_tile, x_tile, partial)
        _dots(x, rows, count, up_proj[expert], f0, up, w_tile, x_tile, partial)
        if cuda.threadIdx.x < LANES and f < hidden.shape[1]:
            for r in range(count):
                hidden[lists[first + r, expert], f] = silu_times(gate[r], up[r])
# --8<-- [end:expert_hidden_kernel]


# --8<-- [start:expert_down_kernel]
@cuda.jit
def expert_down_kernel(hidden, down_proj, lists, per_expert, down):
    # down[p, d] = down_proj[e, d] . hidden[p] for each pair p of expert e; hidden (T * k, F),
    # down (T * k, D). The blocks as expert_hidden_kernel's, over output features d
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    dots = cuda.local.array(ROWS_PER_PASS, float32)
    rows = cuda.local.array(ROWS_PER_PASS, int32)
    expert, own = cuda.blockIdx.y // per_expert, cuda.blockIdx.y % per_expert      # own: the first pass
    d0 = cuda.blockIdx.x * LANES
    d = d0 + cuda.threadIdx.x
    for first in range(own * ROWS_PER_PASS, lists.shape[0], per_expert * ROWS_PER_PASS):
        if lists[first, expert] < 0:
            return
        count = _pass_rows(lists, expert, first, 1, rows)          # hidden rows: the pairs
        _dots(hidden, rows, count, down_proj[expert], d0, dots, w_tile, x_tile, partial)
        if cuda.threadIdx.x < LANES and d < down.shape[1]:
            for r in range(count):
                down[rows[r], d] = dots[r]
# --8<-- [end:expert_down_kernel]


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
    lists: object       # [T, 1] int32, lists[t, 0] = t: version 2's pairs of the one expert, the rows


class MoEScratch(typing.NamedTuple):
    """Device buffers of one MoE layer over T tokens, for either version (version 1 leaves lists
    and down alone)."""
    logits: object                  # [T, E] float32 router logits
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
    return MoEScratch(logits=poisoned((rows, config.n_routed_experts), stream=stream),
                      ids=poisoned((rows, top_k), np.int64, stream),
                      weights=poisoned((rows, top_k), stream=stream),
                      hidden=poisoned((rows, top_k, features), stream=stream),
                      shared=None if shared is None else dense_scratch(rows, shared.shape[0], stream),
                      lists=poisoned((rows, config.n_routed_experts), np.int32, stream),
                      down=poisoned((rows, top_k, width), stream=stream))


def _launch_route(x, gate, bias, config: ModelConfig, threads, logits, ids, weights, stream) -> None:
    """The router on device arrays: x (T, D), gate (E, D), bias (E,) -> logits (T, E), then
    ids and weights (T, k)."""
    linear(x, gate, version="tiles", out=logits, stream=stream)
    threads = threads or pow2_threads(config.n_routed_experts)
    route_kernel[x.shape[0], threads, stream](
        logits, bias, config.n_group, config.topk_group, config.norm_topk_prob,
        float32(config.routed_scaling_factor), ids, weights)


def _launch_pairs(x, stacks, ids, weights, hidden, out, accumulate, stream) -> None:
    """Version 1's two kernels on device arrays: x (T, D), stacks = (gate, up (E, F, D), down
    (E, D, F)), ids and weights (T, k), hidden (T, k, F) -> out (T, D), added to with ``accumulate``."""
    (rows, slots, features), width = hidden.shape, x.shape[1]
    gate_proj, up_proj, down_proj = stacks
    flat_hidden = hidden.reshape(rows * slots, features)
    spread = 1 if SIMULATOR else 0        # the simulator: one block walks all rows (fewer threads)
    grid = (blocks(features, LANES), spread or rows * slots)                 # x over F, y over pairs
    expert_hidden_pairs_kernel[grid, LANES * k_slices(width), stream](x, gate_proj, up_proj, ids,
                                                                      flat_hidden)
    grid = (blocks(width, LANES), spread or rows)                            # x over D, y over tokens
    expert_down_pairs_kernel[grid, LANES * k_slices(features), stream](flat_hidden, down_proj, ids,
                                                                       weights, accumulate, out)


def _launch_grouped(x, stacks, lists, hidden, down, stream) -> None:
    """Version 2's two grouped expert kernels on device arrays: x (T, D), stacks as
    ``_launch_pairs``', lists (T, E) -> hidden (T, k, F) and down (T, k, D), each pair's rows."""
    (rows, slots, features), width = hidden.shape, x.shape[1]
    gate_proj, up_proj, down_proj = stacks
    experts = lists.shape[1]
    # blocks along y: per_expert for each expert. An expert has at most T pairs: on a GPU one block
    # per pass of ROWS_PER_PASS of them (blocks past the expert's last pair return), in the
    # simulator one block per expert walks all its passes
    per_expert = row_passes(rows)
    flat_hidden, flat_down = hidden.reshape(rows * slots, features), down.reshape(rows * slots, width)
    grid = (blocks(features, LANES), experts * per_expert)                  # x over F
    expert_hidden_kernel[grid, LANES * k_slices(width), stream](x, gate_proj, up_proj, lists, slots,
                                                                per_expert, flat_hidden)
    grid = (blocks(width, LANES), experts * per_expert)                     # x over D
    expert_down_kernel[grid, LANES * k_slices(features), stream](flat_hidden, down_proj, lists,
                                                                 per_expert, flat_down)


def _launch_experts(x, params: MoEParams, scratch: MoEScratch, out, accumulate, version, stream) -> None:
    """The routed experts on device arrays, after the router, into out (T, D) (added to it with
    ``accumulate``). Version 1: the pair kernels; version 2: lists from ids, the grouped kernels,
    then each token's k slots weighed and added (the combine)."""
    stacks = params.gate_proj, params.up_proj, params.down_proj
    if version == 1:
        _launch_pairs(x, stacks, scratch.ids, scratch.weights, scratch.hidden, out, accumulate, stream)
        return
    experts = scratch.lists.shape[1]
    expert_lists_kernel[experts, LIST_TPB, stream](scratch.ids, scratch.lists)
    _launch_grouped(x, stacks, scratch.lists, scratch.hidden, scratch.down, stream)
    combine_kernel[blocks(out.size, TPB), TPB, stream](
        scratch.down, scratch.weights, accumulate, out)


def _launch_dense(x, gate_proj, up_proj, down_proj, scratch: DenseScratch, out, version, stream) -> None:
    """A dense SwiGLU on device arrays as one expert that every row chooses with weight 1: (F, D)
    weights viewed as (1, F, D). Version 1 weighs each row's one slot by 1 (exact: a dot product
    starts from +0.0, so it is never -0.0, and 0 + 1 * dot is dot, bit for bit); in version 2 each
    row's one pair's down projection is its output."""
    (rows, width), features = x.shape, gate_proj.shape[0]
    stacks = (gate_proj.reshape(1, features, width), up_proj.reshape(1, features, width),
              down_proj.reshape(1, width, features))
    if version == 1:
        _launch_pairs(x, stacks, scratch.ids, scratch.weights, scratch.hidden, out, False, stream)
    else:
        _launch_grouped(x, stacks, scratch.lists, scratch.hidden, out.reshape(rows, 1, width), stream)


def _check_router_limits(config: ModelConfig, threads) -> None:
    if config.n_routed_experts > MAX_EXPERTS or config.n_group > MAX_GROUPS:
        raise ValueError(f"the router kernel holds at most {MAX_EXPERTS} experts and {MAX_GROUPS} "
                         f"groups, got {config.n_routed_experts} and {config.n_group}")
    if threads is not None:
        check_threads(threads, MAX_TPB)


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


def check_route(x, gate, bias, config: ModelConfig, *, threads=None, out=None):
    """The reference's shapes, the router kernel's limits and block size, float32 on the device,
    ``out`` = (ids (T, k) int64, weights (T, k) float32). Returns x, gate, bias."""
    x, gate, bias = (host_or_device(a, np.float32) for a in (x, gate, bias))
    reference.check_route(x, gate, bias, config)
    _check_router_limits(config, threads)
    check_float32(x=x, gate=gate, bias=bias)
    if out is not None:
        shape = (x.shape[0], config.num_experts_per_tok)
        check_out(out[0], shape, np.int64, "out[0] (ids)")
        check_out(out[1], shape, np.float32, "out[1] (weights)")
    return x, gate, bias


# --8<-- [start:route]
def route(x, gate, bias, config: ModelConfig, *, threads: int | None = None, out=None, stream=None,
          logits=None):
    """Choose k experts per token. x (T, D) -> (expert ids (T, k) int64, weights (T, k) float32).

    ``threads`` (32, 64 or 128) forces the router's block size; by default the smallest power of
    two that covers E, at most 128. ``out``: a pair (ids, weights) to write into; ``logits``: a
    device (T, E) float32 buffer for the router logits (new by default); ``stream``: where the
    kernels are launched (None: the default stream).
    """
    x, gate, bias = check_route(x, gate, bias, config, threads=threads, out=out)
    check_out(logits, (x.shape[0], config.n_routed_experts), name="logits")
    out_ids, out_weights = out or (None, None)
    shape = (x.shape[0], config.num_experts_per_tok)
    ids, weights = output(out_ids, shape, np.int64, stream), output(out_weights, shape, stream=stream)
    if x.shape[0]:
        logits = output(logits, (x.shape[0], config.n_routed_experts), stream=stream)   # [T, E]
        _launch_route(to_device(x, np.float32), to_device(gate, np.float32), to_device(bias, np.float32),
                      config, threads, logits, ids, weights, stream)
    return deliver(ids, out_ids, x, gate, bias), deliver(weights, out_weights, x, gate, bias)
# --8<-- [end:route]


def check_swiglu(x, gate_proj, up_proj, down_proj, *, out=None, scratch=None, version=2):
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
           version: int = 2):
    """down(silu(gate x) * up x): x (T, D), gate/up (F, D), down (D, F) -> (T, D).

    ``scratch`` (from ``dense_scratch``) holds the intermediate buffers; new ones by default.
    ``version``: 2 (the default) stages the weights once per pass of ROWS_PER_PASS rows, 1 once per
    row (a block each); two launches and the same bits either way.
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


def check_moe(x, params: MoEParams, config: ModelConfig, *, out=None, scratch=None, version=2):
    """``version`` in VERSIONS, the reference's shapes, the router kernel's limits, float32 on the
    device, ``out`` (T, D), ``scratch`` (a ``moe_scratch``). Returns x as numpy or a device array."""
    check_version(version, VERSIONS)
    x = host_or_device(x, np.float32)
    reference.check_moe(x, params, config)
    _check_router_limits(config, None)
    check_float32(x=x, **_arrays(params))
    check_out(out, x.shape)
    if scratch is not None:
        (rows, width), top_k, features = x.shape, config.num_experts_per_tok, params.gate_proj.shape[1]
        experts = config.n_routed_experts
        _check_scratch(scratch, "scratch", logits=((rows, experts), np.float32),
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
        scratch: MoEScratch | None = None, version: int = 2):
    """Routed experts plus the shared expert. x (T, D) -> (T, D).

    Route on the device, run the shared expert into ``out``, then add each token's k routed
    experts in slot order. Host ``params`` are copied to the device on each call; pass
    ``device_params(params)`` to keep them there. ``scratch`` (from ``moe_scratch``) holds the
    intermediate buffers; new ones by default. ``version``: 2 (the default) groups the pairs by
    expert, 1 runs each (token, slot) pair on its own (see the module's docstring); the same bits
    either way.
    """
    x = check_moe(x, params, config, out=out, scratch=scratch, version=version)
    rows, width = x.shape
    d_out = output(out, (rows, width), stream=stream)                         # [T, D]
    if rows and width:
        weights, d_x = device_params(params), to_device(x, np.float32)
        scratch = scratch or moe_scratch(rows, weights, config, stream)
        _launch_route(d_x, weights.gate, weights.bias, config, None, scratch.logits, scratch.ids,
                      scratch.weights, stream)
        shared = weights.shared_gate_proj is not None
        if shared:
            _launch_dense(d_x, weights.shared_gate_proj, weights.shared_up_proj, weights.shared_down_proj,
                          scratch.shared, d_out, version, stream)
        _launch_experts(d_x, weights, scratch, d_out, shared, version, stream)   # added to the shared's
    return deliver(d_out, out, x, *_arrays(params).values())
# --8<-- [end:moe]


def _route_cost(*, T: int, D: int, E: int, k: int) -> tuple[int, int]:
    # x (T, D), gate (E, D), bias (E,) read once; ids (int64) and weights written; the gate GEMV
    return F32 * (T * D + E * D + E) + T * k * (I64 + F32), 2 * T * E * D


def _swiglu_cost(*, T: int, D: int, F: int) -> tuple[int, int]:
    # x (T, D) and the three (F, D) matrices read once, y (T, D) written once; three GEMVs
    return F32 * (2 * T * D + 3 * F * D), 2 * T * 3 * F * D


def _moe_cost(*, T: int, D: int, E: int, F: int, Fs: int, k: int, used: int) -> tuple[int, int]:
    # x read and y written, the router's gate and bias, the ``used`` routed experts the tokens
    # chose and the shared expert read once; the router, the shared expert, k experts per token
    return (F32 * (2 * T * D + E * D + E + 3 * used * F * D + 3 * Fs * D),
            2 * T * E * D + 2 * T * 3 * Fs * D + 2 * T * k * 3 * F * D)


_COSTS = {"route": _route_cost, "swiglu": _swiglu_cost, "moe": _moe_cost}


def bytes_moved(operation: str = "moe", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once; float32 4 B, int64 8 B). Dimensions by the glossary: "route" (T, D, E, k), "swiglu"
    (T, D, F), "moe" (T, D, E, F, Fs, k, used: the distinct routed experts the tokens chose)."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "moe", **dims: int) -> int:
    """Floating-point operations (a multiply-add counts 2; sigmoids not counted), dimensions as in
    ``bytes_moved``."""
    return _COSTS[operation](**dims)[1]


def _route_case(sizes):
    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    config, rows = sizes.config, sizes.route_tokens
    hidden, experts, top_k = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    dims = {"T": rows, "D": hidden, "E": experts, "k": top_k}
    return Case("moe_route", f"router: sigmoid scores, top-{top_k} of {experts} experts, {rows} tokens",
                f"x ({rows}, {hidden}) gate ({experts}, {hidden})",
                setup=lambda seed: (uniform((rows, hidden), seed),
                                    uniform((experts, hidden), seed + 1, 1 / math.sqrt(hidden)),
                                    uniform((experts,), seed + 2, 0.01), config),
                call=lambda inputs, **given: route(*inputs, **given),
                bytes=bytes_moved("route", **dims), flops=flops("route", **dims),
                prepare=lambda inputs: (route(*inputs), poisoned((rows, experts))),     # + logits [T, E]
                launch=lambda inputs, given, stream: route(*inputs, out=given[0], logits=given[1],
                                                           stream=stream))


def _reduced_moe_case(sizes):
    """The MoE layer with fewer routed experts (the real expert and shared sizes, the same top-k)."""
    import zlib

    from kernels.bench.case import Case, uniform  # lazily: kernels.bench imports this module

    full = sizes.config
    config = dataclasses.replace(full, n_routed_experts=sizes.moe_experts)
    rows, experts = sizes.moe_tokens, sizes.moe_experts
    hidden, features = full.hidden_size, full.moe_intermediate_size
    shared = full.n_shared_experts * features                                  # Fs
    rng = np.random.default_rng(zlib.crc32(b"moe_reduced"))
    x = rng.uniform(-1, 1, (rows, hidden)).astype(np.float32)                 # [T, D] host copies:
    gate = rng.uniform(-1, 1, (experts, hidden)).astype(np.float32) / np.float32(math.sqrt(hidden))
    bias = rng.uniform(-0.01, 0.01, experts).astype(np.float32)               # routing on the host
    used = np.unique(reference.route(x, gate, bias, config)[0]).size          # counts experts read

    def setup(seed):
        params = MoEParams(
            gate=cuda.to_device(gate), bias=cuda.to_device(bias),
            gate_proj=uniform((experts, features, hidden), seed, 1 / math.sqrt(hidden)),
            up_proj=uniform((experts, features, hidden), seed + 1, 1 / math.sqrt(hidden)),
            down_proj=uniform((experts, hidden, features), seed + 2, 1 / math.sqrt(features)),
            shared_gate_proj=uniform((shared, hidden), seed + 3, 1 / math.sqrt(hidden)),
            shared_up_proj=uniform((shared, hidden), seed + 4, 1 / math.sqrt(hidden)),
            shared_down_proj=uniform((hidden, shared), seed + 5, 1 / math.sqrt(shared)))
        return cuda.to_device(x), params, config

    weights_gb = (experts * 3 * features * hidden + 3 * shared * hidden) * F32 / 1e9
    dims = {"T": rows, "D": hidden, "E": experts, "F": features, "Fs": shared,
            "k": full.num_experts_per_tok}
    return Case("moe_reduced", f"MoE layer, {rows} tokens, {experts} experts instead of "
                f"{full.n_routed_experts} (weights {weights_gb:.1f} GB), top-{full.num_experts_per_tok} "
                "+ shared expert", f"x ({rows}, {hidden}) experts ({experts}, {features}, {hidden})",
                setup=setup, call=lambda inputs, **given: moe(*inputs, **given),
                bytes=bytes_moved("moe", **dims, used=used), flops=flops("moe", **dims, used=used),
                note=f"bytes: the {used} experts chosen read once",
                prepare=lambda inputs: (moe(*inputs), moe_scratch(rows, inputs[1], config)),
                launch=lambda inputs, given, stream: moe(*inputs, out=given[0], scratch=given[1],
                                                         stream=stream))


def bench_cases(sizes):
    """This module's cases of ``python -m kernels.bench``: the router alone, a reduced MoE layer."""
    return [_route_case(sizes), _reduced_moe_case(sizes)]
