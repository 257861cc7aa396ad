"""Engine kernels waiting to move into their stem modules (linear, mla, kv_cache, tree, decode)."""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, float64, int32, uint8

from kernels.blocks import MAX_TPB, block_max, block_sum
from kernels.device import SIMULATOR
from kernels.moe import MAX_EXPERTS, MAX_GROUPS, _keep_groups, _pick_free, _weigh
from kernels.moe import sigmoid_scalar as sigmoid

ROWS_PER_PASS = 8        # linear_rows: rows whose partial sums a thread keeps in registers at once
# outputs per block of the row kernels: one on a GPU (parallelism); several in the simulator, where
# every block costs Python threads. Each output's sums are the same either way.
COLUMNS_PER_BLOCK = 8 if SIMULATOR else 1
STATE_LENGTH = 0         # state[0]: cache rows before this forward (P, the prefix every row sees)
STATE_COUNT = 1          # state[1]: real rows of this forward (the rest of the bucket is padding)
STATE_STEP = 2           # state[2]: AR tokens emitted so far (index into the generated buffer)
STATE_SIZE = 3


# --8<-- [start:linear_rows_kernel]
@functools.cache
def linear_rows_kernel(tpb: int):
    """y[t, n] = (residual[t, n] if add_residual else 0) + x[t] . W[n], batch-invariant.

    One block = one output column n for every row t; one thread = k = tid, tid + TPB, ... of each
    dot product (coalesced reads of the W row, which stays in L1 while the block walks the rows,
    ROWS_PER_PASS rows at a time). Shared memory: ROWS_PER_PASS x TPB float32 partial sums,
    tree-reduced per row. The sum for y[t, n] is the same sequence of float32 operations whatever
    the number of rows T: thread partials in k order, then the same tree. A row's result does not
    depend on the rows beside it, which is what makes a tree verify bit-identical to AR.
    """

    @cuda.jit
    def kernel(x, weight, residual, add_residual, out):
        partial = cuda.shared.array((ROWS_PER_PASS, tpb), float32)
        acc = cuda.local.array(ROWS_PER_PASS, float32)
        first = cuda.blockIdx.x * COLUMNS_PER_BLOCK
        for n in range(first, min(first + COLUMNS_PER_BLOCK, weight.shape[0])):
            _linear_column(x, weight, residual, add_residual, out, n, partial, acc, tpb)

    return kernel


@cuda.jit(device=True)
def _linear_column(x, weight, residual, add_residual, out, n, partial, acc, tpb):
    """Column n of y for every row, ROWS_PER_PASS rows per pass (see ``linear_rows_kernel``)."""
    tid = cuda.threadIdx.x
    rows, depth = x.shape
    for t0 in range(0, rows, ROWS_PER_PASS):
        for r in range(ROWS_PER_PASS):
            acc[r] = float32(0.0)
        for k in range(tid, depth, tpb):
            w = weight[n, k]
            for r in range(ROWS_PER_PASS):
                if t0 + r < rows:
                    acc[r] += x[t0 + r, k] * w
        for r in range(ROWS_PER_PASS):
            partial[r, tid] = acc[r]
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:
            if tid < stride:
                for r in range(ROWS_PER_PASS):
                    partial[r, tid] += partial[r, tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid < ROWS_PER_PASS and t0 + tid < rows:
            t = t0 + tid
            if add_residual:
                out[t, n] = residual[t, n] + partial[tid, 0]
            else:
                out[t, n] = partial[tid, 0]
        cuda.syncthreads()                   # the partials are rewritten by the next pass
# --8<-- [end:linear_rows_kernel]


@cuda.jit
def add_kernel(out, delta):
    # one thread per element of out (T, D): out += delta (the residual connection)
    i = cuda.grid(1)
    rows, width = out.shape
    if i < rows * width:
        out[i // width, i % width] += delta[i // width, i % width]


# --8<-- [start:attention_paths_kernel]
@cuda.jit
def attention_paths_kernel(q_lat, q_pe, cache_latent, cache_rope, state, depths, paths, scale, o_lat):
    """One block computes o_lat[row, head, :] (R) over the row's own keys, in position order.

    The keys of row i are the prefix (slots 0 .. P-1) and then its path root..i, which sits at
    slots P + paths[i, 0..depths[i]]: S_i = P + depths[i] + 1 keys, enumerated by their logical
    index j (= their position). Tiles of TPB keys start at fixed logical indices, so a tree node
    and the AR step at the same position combine the same keys in the same tiles: bit-identical
    outputs. Masked keys are never enumerated at all (no -inf arithmetic, no reads of other
    branches' rows).

    Per tile: the block copies the tile's key rows (R + dr floats each) into shared memory with
    coalesced loads (consecutive threads, consecutive columns), thread j scores key j from there,
    the block reduces the tile's max and (after rescaling to the new running max) its sum of exp,
    and thread i updates acc[r] for r = i, i + TPB, ... from the same shared rows: the cache is
    read once per (row, head). Shared memory (dynamic): the query (R + dr), the accumulator (R)
    and the tile's keys (TPB x (R + dr + 1); the +1 staggers rows across banks); static: p, red
    (TPB floats) and the tile's slots (TPB ints).
    """
    head = cuda.blockIdx.x
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    tile = cuda.blockDim.x
    rank = q_lat.shape[2]
    rope_dim = q_pe.shape[2]
    width = rank + rope_dim
    pitch = width + 1
    prefix = state[STATE_LENGTH]
    keys = prefix + depths[row] + 1

    smem = cuda.shared.array(0, dtype=float32)
    query = smem[:width]
    acc = smem[width:width + rank]
    tile_keys = smem[width + rank:]                       # [TPB, R + dr + 1], row-major
    p = cuda.shared.array(128, dtype=float32)
    red = cuda.shared.array(128, dtype=float32)
    slots = cuda.shared.array(128, dtype=int32)

    for i in range(tid, rank, tile):
        query[i] = q_lat[row, head, i]
        acc[i] = float32(0.0)
    for i in range(tid, rope_dim, tile):
        query[rank + i] = q_pe[row, head, i]

    run_max = float32(0.0)
    run_sum = float32(0.0)
    for start in range(0, keys, tile):
        count = min(tile, keys - start)
        j = start + tid
        if tid < count:
            slots[tid] = j if j < prefix else prefix + paths[row, j - prefix]
        cuda.syncthreads()
        for index in range(tid, count * width, tile):     # coalesced: a key row per `width` threads
            key = index // width
            column = index % width
            if column < rank:
                tile_keys[key * pitch + column] = cache_latent[slots[key], column]
            else:
                tile_keys[key * pitch + column] = cache_rope[slots[key], column - rank]
        cuda.syncthreads()
        score = float32(0.0)
        if tid < count:
            for i in range(width):
                score += query[i] * tile_keys[tid * pitch + i]
            score *= scale
            red[tid] = score
        else:
            red[tid] = -math.inf
        block_max(red)
        tile_max = red[0]
        cuda.syncthreads()
        new_max = max(run_max, tile_max) if start > 0 else tile_max
        alpha = math.exp(run_max - new_max) if start > 0 else float32(0.0)
        prob = math.exp(score - new_max) if tid < count else float32(0.0)
        p[tid] = prob
        red[tid] = prob
        block_sum(red)
        run_sum = run_sum * alpha + red[0]
        run_max = new_max
        for i in range(tid, rank, tile):
            total = acc[i] * alpha
            for key in range(count):
                total += p[key] * tile_keys[key * pitch + i]
            acc[i] = total
        cuda.syncthreads()                   # the tile's keys, p and red are rewritten next tile

    for i in range(tid, rank, tile):
        o_lat[row, head, i] = acc[i] / run_sum


def attention_tile(rank: int, rope_dim: int) -> int:
    """Keys per tile: 32, or 16 when 32 rows of R + dr floats would pass 48 KB of shared memory.

    Fixed by the model's dims alone, never by the call, so tiles sit at the same positions for
    every row count (the engine's bit-identity between a tree row and the AR step relies on it)."""
    width = rank + rope_dim
    return 32 if 4 * (width + rank + 32 * (width + 1)) <= 40 * 1024 else 16


def attention_shared_bytes(rank: int, rope_dim: int, tile: int) -> int:
    width = rank + rope_dim
    return 4 * (width + rank + tile * (width + 1))
# --8<-- [end:attention_paths_kernel]


@cuda.jit
def write_rows_kernel(latent, rope, cache_latent, cache_rope, state):
    # one block per row t: cache slot P + t <- (latent[t], rope[t]); threads stride over columns
    t = cuda.blockIdx.x
    slot = state[STATE_LENGTH] + t
    for c in range(cuda.threadIdx.x, latent.shape[1], cuda.blockDim.x):
        cache_latent[slot, c] = latent[t, c]
    for c in range(cuda.threadIdx.x, rope.shape[1], cuda.blockDim.x):
        cache_rope[slot, c] = rope[t, c]


@cuda.jit
def tree_rows_kernel(parents, depths, state, positions, paths):
    # one thread per row i: position P + depth, and the path root..i by depth (paths[i, d])
    i = cuda.grid(1)
    if i >= parents.shape[0]:
        return
    depth = depths[i]
    positions[i] = state[STATE_LENGTH] + depth
    node = i
    for d in range(depth, -1, -1):
        paths[i, d] = node
        node = parents[node]


@cuda.jit
def prompt_rows_kernel(host_rows, tokens, parents, depths, state):
    # one thread per row i of a prompt chunk: host_rows = [n, token_0 .. token_{n-1}]; rows past n
    # are padding (token 0, no parent, depth 0: they see the prefix and themselves only)
    i = cuda.grid(1)
    count = host_rows[0]
    if i == 0:
        state[STATE_COUNT] = count
    if i < tokens.shape[0]:
        real = i < count
        tokens[i] = host_rows[1 + i] if real else 0
        parents[i] = i - 1 if real else -1
        depths[i] = i if real else 0


@cuda.jit
def single_row_kernel(parents, depths, state):
    # the AR step: one row, the root of a one-node tree (its token was written by the last step)
    state[STATE_COUNT] = 1
    parents[0] = -1
    depths[0] = 0


@cuda.jit
def commit_rows_kernel(state):
    # a prefill chunk: its real rows join the cache
    state[STATE_LENGTH] += state[STATE_COUNT]


@cuda.jit
def commit_token_kernel(state, posterior, tokens, generated):
    # AR: the rows join the cache, the last row's argmax is the next token and the next input
    count = state[STATE_COUNT]
    state[STATE_LENGTH] += count
    token = posterior[count - 1]
    generated[state[STATE_STEP]] = token
    state[STATE_STEP] += 1
    tokens[0] = token


@cuda.jit
def compact_rows_kernel(cache_latent, cache_rope, state, accepted, lengths, scratch_latent,
                        scratch_rope, gather):
    """Block (j, layer): the accepted node j's row, slot P + accepted[j] -> slot P + j.

    Launched twice (gather into scratch, then write back): the launch boundary orders every read
    before every write. Rows already in place (accepted[j] == j) are skipped; so are j >= m.
    The grid covers the bucket, so a graph can hold it; m is read from the device.
    """
    j = cuda.blockIdx.x
    layer = cuda.blockIdx.y
    if j >= lengths[0] or accepted[0, j] == j:
        return
    start = state[STATE_LENGTH]
    for c in range(cuda.threadIdx.x, cache_latent.shape[2], cuda.blockDim.x):
        if gather:
            scratch_latent[layer, j, c] = cache_latent[layer, start + accepted[0, j], c]
        else:
            cache_latent[layer, start + j, c] = scratch_latent[layer, j, c]
    for c in range(cuda.threadIdx.x, cache_rope.shape[2], cuda.blockDim.x):
        if gather:
            scratch_rope[layer, j, c] = cache_rope[layer, start + accepted[0, j], c]
        else:
            cache_rope[layer, start + j, c] = scratch_rope[layer, j, c]


@cuda.jit
def commit_round_kernel(state, tree_tokens, tree_parents, tree_depths, sizes, accepted, lengths,
                        bonus, root, record):
    """The round's end, one thread: length P + m, the bonus becomes the next root, and ``record``
    gets everything the host reads back (one copy): [m, bonus, N, accepted (W), tokens (W),
    parents (W), depths (W)] with W the bucket."""
    width = tree_tokens.shape[1]
    kept = lengths[0]
    state[STATE_LENGTH] += kept
    root[0] = bonus[0]
    record[0] = kept
    record[1] = bonus[0]
    record[2] = sizes[0]
    for i in range(width):
        record[3 + i] = accepted[0, i]
        record[3 + width + i] = tree_tokens[0, i]
        record[3 + 2 * width + i] = tree_parents[0, i]
        record[3 + 3 * width + i] = tree_depths[0, i]


# --8<-- [start:top_candidates_kernel]
@functools.cache
def top_candidates_kernel(tpb: int):
    """The twin of ``ddtree.tree.top_candidates``: per drafter row, log-softmax and the K best.

    One block per row (L rows); threads stride over V. 1. the row max (float32); 2. the sum of
    exp(logit - max) in float64, reduced in a float64 tree, its log cast to float32 (as numpy);
    3. K picks, each a block-wide argmax over the entries that come after the previous pick in
    the order (log-prob descending, token id ascending): no "taken" marks, so V may be large.
    numpy's float64 sum adds in another order than this tree: the two float64 totals can differ in
    their last bits, which changes the float32 log-probs only when the total sits within ~1e-16
    of a float32 rounding boundary (about one row in 10^8).
    """

    @cuda.jit
    def kernel(logits, top_logprobs, top_ids):
        red = cuda.shared.array(tpb, float32)
        red64 = cuda.shared.array(tpb, float64)
        best_index = cuda.shared.array(tpb, int32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        vocab = logits.shape[1]

        local_max = float32(-math.inf)
        for v in range(tid, vocab, tpb):
            local_max = max(local_max, logits[row, v])
        red[tid] = local_max
        block_max(red)
        row_max = red[0]
        cuda.syncthreads()

        total = float64(0.0)
        for v in range(tid, vocab, tpb):
            total += math.exp(float64(logits[row, v] - row_max))
        red64[tid] = total
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:
            if tid < stride:
                red64[tid] += red64[tid + stride]
            cuda.syncthreads()
            stride //= 2
        log_sum = float32(math.log(red64[0]))
        cuda.syncthreads()

        previous_value = float32(math.inf)
        previous_index = -1
        for pick in range(top_ids.shape[1]):
            mine_value = float32(-math.inf)
            mine_index = -1
            for v in range(tid, vocab, tpb):
                value = (logits[row, v] - row_max) - log_sum
                after = value < previous_value or (value == previous_value and v > previous_index)
                if after and (mine_index < 0 or value > mine_value):
                    mine_value = value
                    mine_index = v
            red[tid] = mine_value
            best_index[tid] = mine_index
            cuda.syncthreads()
            stride = tpb // 2
            while stride > 0:
                if tid < stride:
                    other = best_index[tid + stride]
                    here = best_index[tid]
                    if other >= 0 and (here < 0 or red[tid + stride] > red[tid]
                                       or (red[tid + stride] == red[tid] and other < here)):
                        red[tid] = red[tid + stride]
                        best_index[tid] = other
                cuda.syncthreads()
                stride //= 2
            previous_value = red[0]
            previous_index = best_index[0]
            if tid == 0:
                top_logprobs[row, pick] = previous_value
                top_ids[row, pick] = previous_index
            cuda.syncthreads()

    return kernel
# --8<-- [end:top_candidates_kernel]


MAX_PAIRS = 1024         # expert_down_rows: (token, slot) dot products a block keeps in shared memory


@functools.cache
def expert_hidden_rows_kernel(tpb: int):
    """hidden[t, j, f] = silu(gate_e[f] . x_t) * (up_e[f] . x_t) for e = ids[t, j], batch-invariant.

    One block = one feature f for every (token, slot) pair, ROWS_PER_PASS pairs at a time; one
    thread = d = tid, tid + TPB, ... of each pair's two dot products (coalesced weight rows and
    x_t); shared memory: 2 x ROWS_PER_PASS x TPB partial sums, tree-reduced per pair. A pair's
    sums do not depend on which other pairs share the launch.
    """

    @cuda.jit
    def kernel(x, gate_proj, up_proj, ids, hidden):
        g_partial = cuda.shared.array((ROWS_PER_PASS, tpb), float32)
        u_partial = cuda.shared.array((ROWS_PER_PASS, tpb), float32)
        g = cuda.local.array(ROWS_PER_PASS, float32)
        u = cuda.local.array(ROWS_PER_PASS, float32)
        first = cuda.blockIdx.x * COLUMNS_PER_BLOCK
        for f in range(first, min(first + COLUMNS_PER_BLOCK, hidden.shape[2])):
            _expert_hidden_feature(x, gate_proj, up_proj, ids, hidden, f, g_partial, u_partial, g, u, tpb)

    return kernel


@cuda.jit(device=True)
def _expert_hidden_feature(x, gate_proj, up_proj, ids, hidden, f, g_partial, u_partial, g, u, tpb):
    """Feature f of every (token, slot) pair, ROWS_PER_PASS pairs per pass."""
    tid = cuda.threadIdx.x
    slots = ids.shape[1]
    pairs = ids.shape[0] * slots
    for p0 in range(0, pairs, ROWS_PER_PASS):
        for r in range(ROWS_PER_PASS):
            g[r] = float32(0.0)
            u[r] = float32(0.0)
        for r in range(min(ROWS_PER_PASS, pairs - p0)):
            token = (p0 + r) // slots
            expert = ids[token, (p0 + r) % slots]
            for d in range(tid, x.shape[1], tpb):
                g[r] += gate_proj[expert, f, d] * x[token, d]
                u[r] += up_proj[expert, f, d] * x[token, d]
        for r in range(ROWS_PER_PASS):
            g_partial[r, tid] = g[r]
            u_partial[r, tid] = u[r]
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:
            if tid < stride:
                for r in range(ROWS_PER_PASS):
                    g_partial[r, tid] += g_partial[r, tid + stride]
                    u_partial[r, tid] += u_partial[r, tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid < ROWS_PER_PASS and p0 + tid < pairs:
            gate = g_partial[tid, 0]
            hidden[(p0 + tid) // slots, (p0 + tid) % slots, f] = gate * sigmoid(gate) * u_partial[tid, 0]
        cuda.syncthreads()


@functools.cache
def expert_down_rows_kernel(tpb: int):
    """out[t, d] = (out[t, d] if accumulate else 0) + sum_j weights[t, j] * (down_e[d] . hidden[t, j]).

    One block = one output feature d for every token; the (token, slot) dot products run
    ROWS_PER_PASS at a time as in ``expert_hidden_rows_kernel`` and land in shared memory; then
    thread t adds its token's slots in slot order. Deterministic, no atomics, batch-invariant.
    """

    @cuda.jit
    def kernel(hidden, down_proj, ids, weights, accumulate, out):
        partial = cuda.shared.array((ROWS_PER_PASS, tpb), float32)
        dots = cuda.shared.array(MAX_PAIRS, float32)
        acc = cuda.local.array(ROWS_PER_PASS, float32)
        first = cuda.blockIdx.x * COLUMNS_PER_BLOCK
        for d in range(first, min(first + COLUMNS_PER_BLOCK, out.shape[1])):
            _expert_down_feature(hidden, down_proj, ids, weights, accumulate, out, d, partial, dots, acc, tpb)

    return kernel


@cuda.jit(device=True)
def _expert_down_feature(hidden, down_proj, ids, weights, accumulate, out, d, partial, dots, acc, tpb):
    """Output feature d of every token: the pairs' dot products, then each token's slots in order."""
    tid = cuda.threadIdx.x
    tokens, slots = ids.shape
    pairs = tokens * slots
    for p0 in range(0, pairs, ROWS_PER_PASS):
        for r in range(ROWS_PER_PASS):
            acc[r] = float32(0.0)
        for r in range(min(ROWS_PER_PASS, pairs - p0)):
            token = (p0 + r) // slots
            slot = (p0 + r) % slots
            expert = ids[token, slot]
            for f in range(tid, hidden.shape[2], tpb):
                acc[r] += down_proj[expert, d, f] * hidden[token, slot, f]
        for r in range(ROWS_PER_PASS):
            partial[r, tid] = acc[r]
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:
            if tid < stride:
                for r in range(ROWS_PER_PASS):
                    partial[r, tid] += partial[r, tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid < ROWS_PER_PASS and p0 + tid < pairs:
            dots[p0 + tid] = partial[tid, 0]
        cuda.syncthreads()
    for token in range(tid, tokens, tpb):
        total = out[token, d] if accumulate else float32(0.0)
        for slot in range(slots):
            total += weights[token, slot] * dots[token * slots + slot]
        out[token, d] = total
    cuda.syncthreads()                       # dots is rewritten for the next feature


@cuda.jit
def route_logits_kernel(logits, bias, n_group, topk_group, norm_topk_prob, scaling, ids, weights):
    """``route_kernel`` on precomputed router logits (T, E) (a batch-invariant linear made them)."""
    token = cuda.blockIdx.x
    experts = logits.shape[1]
    score = cuda.shared.array(MAX_EXPERTS, dtype=float32)
    choice = cuda.shared.array(MAX_EXPERTS, dtype=float32)
    free = cuda.shared.array(MAX_EXPERTS, dtype=uint8)
    group_score = cuda.shared.array(MAX_GROUPS, dtype=float32)
    group_free = cuda.shared.array(MAX_GROUPS, dtype=uint8)
    best_values = cuda.shared.array(MAX_TPB, dtype=float32)
    best_indices = cuda.shared.array(MAX_TPB, dtype=int32)
    for e in range(cuda.threadIdx.x, experts, cuda.blockDim.x):
        score[e] = sigmoid(logits[token, e])
        choice[e] = score[e] + bias[e]
        free[e] = 1
    cuda.syncthreads()
    if n_group > 1:
        _keep_groups(choice, free, experts, n_group, topk_group, group_score, group_free,
                     best_values, best_indices)
    for j in range(ids.shape[1]):
        e = _pick_free(choice, free, experts, best_values, best_indices)
        if cuda.threadIdx.x == 0:
            ids[token, j] = e
            free[e] = 0
        cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        _weigh(score, ids, token, norm_topk_prob, scaling, weights)
