"""Drafters on the GPU: the numba.cuda twin of ``ddtree/drafters.py``.

Legend: L draft depths (block_size - 1), V vocab_size, n committed tokens (the context, root
last), C the committed-token buffer's capacity, KMAX the longest ranking a device oracle holds.

The reference's drafters as kernels inside the round's graph: they read the committed tokens
where the engine keeps them (``committed[:n]``, n in ``context_length[0]``) and write the (L, V)
logits into its draft buffer, so no logits cross the bus. The oracles and the n-gram drafter give
the reference's bits (chapter 6): splitmix64 word for word, its uint64 sums and products through
32-bit halves (``wrapping_add``, ``wrapping_mul``: the simulator's numpy scalars warn where the
GPU wraps), the rankings' log-probabilities a table computed on the host (``scored``), the
n-gram votes small integers added by atomics (exact in any order).

The block drafter is a model: its forward is a second engine (``kernels.model.Transformer`` of the drafter's
config and weights, with its own cache and buffers), which the engine makes and hands to ``load``
(``make_forward``) and ``propose_block`` runs each round: its log-probabilities are within the model tests'
tolerance of the reference's, not its bits.

A drafter runs on the device when ``load`` knows its exact class and its constants fit
``DrafterBuffers`` (a ranking of at most KMAX tokens, a sequence of at most C tokens, a seed
below 2^63; a block drafter needs ``make_forward``); any other drafter runs on the host.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64, int64, uint64

from ddtree.drafters import (
    FLOOR_LOGIT,
    KEEP,
    RANK,
    TOKENS,
    TOP1,
    BlockDrafter,
    NGramDrafter,
    NoisyOracleDrafter,
    OracleDrafter,
)
from kernels.blocks import block_sum, blocks, pow2_threads
from kernels.device import filled, poisoned
from kernels.tree import _max_log_sum

KMAX = 32                                   # the longest ranking a device oracle writes
# the fields of DrafterBuffers.ints
SEED, SEQUENCE_LENGTH, RANKED, MAX_NGRAM, WINDOW, PAD_TOKEN, MASK_TOKEN = range(7)
KEEP_RATE, SMOOTHING = range(2)                         # ... and of DrafterBuffers.floats
KINDS = {OracleDrafter: "oracle", NoisyOracleDrafter: "noisy", NGramDrafter: "ngram", BlockDrafter: "block"}

LOW32 = uint64(0xFFFFFFFF)
SHIFT11, SHIFT27, SHIFT30, SHIFT31, SHIFT32 = uint64(11), uint64(27), uint64(30), uint64(31), uint64(32)
WEYL = uint64(0x9E3779B97F4A7C15)
MULTIPLIER0 = uint64(0xBF58476D1CE4E5B9)
MULTIPLIER1 = uint64(0x94D049BB133111EB)
UNIT53 = 2.0 ** -53
FLOOR = float32(FLOOR_LOGIT)


# --8<-- [start:keyed]
@cuda.jit(device=True)
def wrapping_add(a, b):
    """(a + b) mod 2^64 of two uint64, by 32-bit halves (no intermediate exceeds 2^34)."""
    low = (a & LOW32) + (b & LOW32)
    high = (a >> SHIFT32) + (b >> SHIFT32) + (low >> SHIFT32)
    return ((high & LOW32) << SHIFT32) | (low & LOW32)


@cuda.jit(device=True)
def wrapping_mul(a, b):
    """(a * b) mod 2^64 of two uint64: the low product plus the cross products' low halves,
    shifted up (the high product only reaches bits past 64)."""
    a0, a1, b0, b1 = a & LOW32, a >> SHIFT32, b & LOW32, b >> SHIFT32
    cross = (((a0 * b1) & LOW32) + ((a1 * b0) & LOW32)) & LOW32
    return wrapping_add(a0 * b0, cross << SHIFT32)


@cuda.jit(device=True)
def mix(state, word):
    """The reference's ``mix``: ``word`` folded into ``state`` by splitmix64's finaliser."""
    state = wrapping_add(state ^ word, WEYL)
    state = wrapping_mul(state ^ (state >> SHIFT30), MULTIPLIER0)
    state = wrapping_mul(state ^ (state >> SHIFT27), MULTIPLIER1)
    return state ^ (state >> SHIFT31)


@cuda.jit(device=True)
def keyed_state(seed, position, depth):
    """The reference's ``keyed_state(seed, position, depth)`` (three non-negative words)."""
    return mix(mix(mix(uint64(0), uint64(seed)), uint64(position)), uint64(depth))


@cuda.jit(device=True)
def uniform_of(state):
    """A uniform in [0, 1) from the state's top 53 bits (exact in float64, as in the reference)."""
    return float64(state >> SHIFT11) * UNIT53


@cuda.jit(device=True)
def tokens_of(state, count, vocab, exclude, chosen, start):
    """The reference's ``tokens_of`` into chosen[start:]: min(count, the tokens available) distinct
    tokens other than ``exclude`` (-1: none); returns how many it wrote."""
    count = min(count, vocab - (1 if exclude >= 0 else 0))
    found = 0
    index = 0
    while found < count:
        token = int64(mix(state, uint64(index)) % uint64(vocab))
        fresh = token != exclude
        for j in range(found):
            fresh = fresh and chosen[start + j] != token
        if fresh:
            chosen[start + found] = token
            found += 1
        index += 1
    return found
# --8<-- [end:keyed]


@cuda.jit(device=True)
def floor_row(logits, row):
    # the block's threads fill one row with the floor; the barrier orders the ranking's writes after
    for v in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        logits[row, v] = FLOOR
    cuda.syncthreads()


@cuda.jit(device=True)
def true_token(sequence, ints, position):
    return sequence[position] if position < ints[SEQUENCE_LENGTH] else int64(-1)


# --8<-- [start:oracle_kernel]
@cuda.jit
def oracle_kernel(context_length, sequence, ints, table, logits):
    # one block per depth d = row + 1, threads striding over V (the floor); then thread 0 ranks
    # the token at position n - 1 + d: the truth (sequence[p], if p is inside the sequence), then
    # the distractors keyed by (seed, p, 0, TOKENS); table[count] holds their log-probabilities
    row = cuda.blockIdx.x
    floor_row(logits, row)
    if cuda.threadIdx.x == 0:
        ranked = cuda.local.array(KMAX, int64)
        position = context_length[0] + row
        truth = true_token(sequence, ints, position)
        count = 0
        if truth >= 0:
            ranked[0] = truth
            count = 1
        state = mix(keyed_state(ints[SEED], position, 0), uint64(TOKENS))
        count += tokens_of(state, ints[RANKED], logits.shape[1], truth, ranked, count)
        for i in range(count):
            logits[row, ranked[i]] = table[count, i]
# --8<-- [end:oracle_kernel]


# --8<-- [start:noisy_kernel]
@cuda.jit
def noisy_kernel(context_length, sequence, ints, floats, thresholds, table, logits):
    # one block per depth d = row + 1, as oracle_kernel; thread 0 follows noisy_ranking: the
    # runners-up drawn with (seed, p, d), then the truth first (a uniform below thresholds[d]),
    # kept at a drawn rank 1..runners_up (below keep_rate), or left out; at most runners_up + 1
    row = cuda.blockIdx.x
    floor_row(logits, row)
    if cuda.threadIdx.x == 0:
        drawn = cuda.local.array(KMAX, int64)
        ranked = cuda.local.array(KMAX, int64)
        depth = row + 1
        position = context_length[0] + row
        runners_up = ints[RANKED]
        truth = true_token(sequence, ints, position)
        key = keyed_state(ints[SEED], position, depth)
        drawn_count = tokens_of(mix(key, uint64(TOKENS)), runners_up + 1, logits.shape[1], truth, drawn, 0)
        at = drawn_count + 1                         # where the truth goes (past the end: left out)
        if truth >= 0:
            if uniform_of(mix(key, uint64(TOP1))) < thresholds[depth]:
                at = 0
            elif runners_up > 0 and uniform_of(mix(key, uint64(KEEP))) < floats[KEEP_RATE]:
                at = min(1 + int64(uniform_of(mix(key, uint64(RANK))) * runners_up), drawn_count)
        count = 0
        for i in range(drawn_count + 1):
            if count <= runners_up:
                if i == at:
                    ranked[count] = truth
                    count += 1
                if i < drawn_count and count <= runners_up:
                    ranked[count] = drawn[i]
                    count += 1
        for i in range(count):
            logits[row, ranked[i]] = table[count, i]
# --8<-- [end:noisy_kernel]


# --8<-- [start:ngram_kernel]
@cuda.jit(device=True)
def match_weight(context, n, end, longest):
    """The reference's ``match_weights`` at one end: the sum of the suffix lengths s <= longest
    whose earlier copy ends just before context[end] (each length needs the shorter ones)."""
    weight = 0
    for s in range(1, longest + 1):
        if end < s or context[end - s] != context[n - s]:
            break
        weight += s
    return weight


@functools.cache
def ngram_kernel(threads: int):
    """The n-gram kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(committed, context_length, ints, floats, logits):
        # one block per depth row j (the token j + 1 after the root); threads stride over V (zero
        # the votes), then over the ends e of earlier copies (each adds its weight to the token
        # j places after it, committed[e + j], an atomic add of a small integer: exact in any
        # order), then over V again (the votes' exact sum, then each vote's log-share in place)
        totals = cuda.shared.array(threads, float64)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = context_length[0]
        vocab = logits.shape[1]
        for v in range(tid, vocab, threads):
            logits[row, v] = 0.0
        cuda.syncthreads()
        longest = min(ints[MAX_NGRAM], n - 1)
        for end in range(tid, n - row, threads):
            weight = match_weight(committed, n, end, longest)
            if weight > 0:
                cuda.atomic.add(logits, (row, committed[end + row]), float32(weight))
        cuda.syncthreads()
        partial = 0.0
        for v in range(tid, vocab, threads):
            partial += float64(logits[row, v])
        totals[tid] = partial
        block_sum(totals)                           # integers: the same sum in any order
        smoothing = floats[SMOOTHING]
        total = totals[0] + float64(vocab) * smoothing
        for v in range(tid, vocab, threads):
            logits[row, v] = float32(math.log((float64(logits[row, v]) + smoothing) / total))

    return kernel
# --8<-- [end:ngram_kernel]


NGRAM_THREADS = 128


# --8<-- [start:block_kernels]
@cuda.jit
def block_rows_kernel(committed, context_length, ints, tokens, parents, depths, prefix):
    # one thread per row i of the drafter's forward: ``block_rows`` of committed[:n] (the last
    # window tokens, left-padded with the pad token, then mask tokens) as a chain from position
    # 0 (parent i - 1, depth i); prefix[0] = 0, the drafter's cache length: it reads an empty cache
    i = cuda.grid(1)
    if i == 0:
        prefix[0] = 0
    if i < tokens.shape[0]:
        window = ints[WINDOW]
        source = context_length[0] - window + i              # the committed token row i carries
        if i >= window:
            tokens[i] = ints[MASK_TOKEN]
        elif source < 0:
            tokens[i] = ints[PAD_TOKEN]
        else:
            tokens[i] = committed[source]
        parents[i] = i - 1
        depths[i] = i


@functools.cache
def block_logprobs_kernel(threads: int):
    """The log-softmax kernel for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(logits, ints, out):
        # one block per depth row j (depth j + 1), threads striding over V: out[j] = the
        # log-softmax of the drafter's row window - 1 + j, in top_candidates' steps (``_max_log_sum``:
        # the float32 max, the float64 sum of exponentials, its log cast to float32)
        red = cuda.shared.array(threads, float32)
        red64 = cuda.shared.array(threads, float64)
        j = cuda.blockIdx.x
        row = ints[WINDOW] - 1 + j
        row_max, log_sum = _max_log_sum(logits, row, red, red64)
        for v in range(cuda.threadIdx.x, out.shape[1], threads):
            out[j, v] = (logits[row, v] - row_max) - log_sum

    return kernel
# --8<-- [end:block_kernels]


BLOCK_ROWS_THREADS = 128


class DrafterBuffers:
    """One drafter's constants on the device, at fixed addresses (a captured round reads them):
    the oracles' sequence (C,), ints [seed, sequence length, ranked count, max n-gram, window, pad
    token, mask token], floats [keep rate, smoothing], the noisy oracle's top-1 thresholds per
    depth (Lmax + 1,), and the log-probabilities of a ranking of each length (KMAX + 1, KMAX);
    a block drafter's forward (its model on the device, made by the engine)."""

    def __init__(self, capacity: int, max_depths: int):
        self.sequence = poisoned((capacity,), np.int64)
        self.ints = filled((7,), 0, np.int64)
        self.floats = filled((2,), 0.0, np.float64)
        self.thresholds = filled((max_depths + 1,), 0.0, np.float64)
        self.table = poisoned((KMAX + 1, KMAX))
        self.loaded = None                       # (drafter, its constants) as last uploaded
        self.kind = None                         # its kind: "oracle", "noisy", "ngram" or "block"
        self.forward = None                      # the block drafter's forward (make_forward's engine)
        self.forwards_made = 0                   # numbers each forward: its weights' addresses differ

    @property
    def graph_key(self):
        """What a captured round depends on of the loaded drafter: its kind (its constants sit in
        the buffers above, at fixed addresses), and for a block drafter which forward (a new one
        has new weights, cache and buffers, so a graph captured with the old one must not replay)."""
        return (self.kind, self.forwards_made) if self.kind == "block" else self.kind


def constants(drafter) -> tuple:
    """What the device holds of ``drafter``: compared before every round, so a changed drafter is
    uploaded again."""
    if isinstance(drafter, NGramDrafter):
        return (drafter.vocab_size, drafter.max_ngram, drafter.smoothing)
    if isinstance(drafter, BlockDrafter):
        return (drafter.vocab_size, id(drafter.config), id(drafter.weights), drafter.window,
                drafter.max_depths, drafter.pad_token, drafter.mask_token)
    noisy = isinstance(drafter, NoisyOracleDrafter)
    return (drafter.vocab_size, id(drafter.sequence), drafter.sequence.size, drafter.seed, drafter.confidence,
            drafter.distractors, *((drafter.top1_rate, drafter.decay, drafter.keep_rate,
                                    drafter.runner_up_mass) if noisy else ()))


def fits(drafter, vocab_size: int, buffers: DrafterBuffers, make_forward=None) -> bool:
    kind = KINDS.get(type(drafter))
    if kind is None or drafter.vocab_size != vocab_size:
        return False
    if kind == "ngram":
        return drafter.max_ngram < 1 << 62
    if kind == "block":
        return make_forward is not None
    return drafter.distractors + 2 <= KMAX and drafter.sequence.size <= buffers.sequence.size \
        and drafter.seed < 1 << 63


def load(drafter, vocab_size: int, buffers: DrafterBuffers, upload, make_forward=None) -> str | None:
    """Put ``drafter``'s constants on the device (``upload(host, device_array)``, the engine's
    copy) unless they are there already; returns its kind, or None where it must run on the host.
    A block drafter needs ``make_forward(config, weights, rows)``: the engine's forward of that
    model over up to ``rows`` rows (``kernels.model.Transformer``; without it, the host)."""
    loaded = buffers.loaded
    if loaded is not None and loaded[0] is drafter and loaded[1] == constants(drafter):
        return buffers.kind
    buffers.loaded, buffers.kind, buffers.forward = None, None, None
    if not fits(drafter, vocab_size, buffers, make_forward):
        return None
    kind = KINDS[type(drafter)]
    ints = np.zeros(7, np.int64)
    floats = np.zeros(2, np.float64)
    if kind == "ngram":
        ints[MAX_NGRAM], floats[SMOOTHING] = drafter.max_ngram, drafter.smoothing
    elif kind == "block":
        ints[WINDOW], ints[PAD_TOKEN], ints[MASK_TOKEN] = drafter.window, drafter.pad_token, \
            drafter.mask_token
        rows = drafter.window + drafter.max_depths - 1                  # the longest forward it runs
        buffers.forward = make_forward(drafter.config, drafter.weights, rows)
        buffers.forwards_made += 1
    else:
        ints[SEED], ints[SEQUENCE_LENGTH] = drafter.seed, drafter.sequence.size
        ints[RANKED] = drafter.distractors                       # the oracle's; the noisy's runners_up
        upload(drafter.sequence, buffers.sequence[:drafter.sequence.size])
        table = np.zeros((KMAX + 1, KMAX), np.float32)
        for count in range(1, drafter.distractors + 2):
            table[count, :count] = drafter.scored(list(range(count)))[1]
        upload(table, buffers.table)
        if kind == "noisy":
            floats[KEEP_RATE] = drafter.keep_rate
            depths = np.arange(buffers.thresholds.size)
            upload(np.array([drafter.top1_probability(int(d)) if d else 0.0 for d in depths], np.float64),
                   buffers.thresholds)
    upload(ints, buffers.ints)
    upload(floats, buffers.floats)
    buffers.loaded, buffers.kind = (drafter, constants(drafter)), kind
    return kind


def always_proposes(buffers: DrafterBuffers) -> bool:
    """Whether the loaded drafter ranks something at every position (``check_round`` never
    refuses it), so a round may be launched before the host knows its context."""
    return buffers.kind is not None and not (buffers.kind == "oracle" and buffers.loaded[0].distractors == 0)


def check_round(buffers: DrafterBuffers, context_size: int, depths: int) -> None:
    """The refusals of the reference's ``propose`` a kernel cannot raise: an oracle without distractors has
    nothing to rank past its sequence's end; a block drafter drafts at most max_depths."""
    drafter, last = buffers.loaded[0], context_size - 1 + depths          # the deepest position drafted
    if buffers.kind == "block":
        drafter.check_depths(depths)
    if buffers.kind == "oracle" and drafter.distractors == 0 and last >= drafter.sequence.size:
        raise ValueError(f"nothing to propose: 0 ranked tokens past the oracle's sequence (position {last} "
                         f">= {drafter.sequence.size}) and no distractors")


# --8<-- [start:propose]
def propose(buffers: DrafterBuffers, committed, context_length, *, out, stream=0) -> None:
    """The loaded drafter's logits for the committed tokens ``committed[:context_length[0]]`` into
    ``out`` (L, V) float32 on the device: the reference's ``propose(context, L + 1)``."""
    depths = out.shape[0]
    if depths == 0:
        return
    if buffers.kind == "block":
        propose_block(buffers, committed, context_length, out, stream)
        return
    if buffers.kind == "ngram":
        threads = pow2_threads(out.shape[1], NGRAM_THREADS)
        kernel = ngram_kernel(threads)
        kernel[depths, threads, stream](committed, context_length, buffers.ints, buffers.floats, out)
        return
    threads = pow2_threads(out.shape[1])
    if buffers.kind == "oracle":
        oracle_kernel[depths, threads, stream](context_length, buffers.sequence, buffers.ints, buffers.table,
                                               out)
    elif buffers.kind == "noisy":
        noisy_kernel[depths, threads, stream](context_length, buffers.sequence, buffers.ints, buffers.floats,
                                              buffers.thresholds, buffers.table, out)
    else:
        raise ValueError("propose needs a loaded drafter (load() returned None for it)")
# --8<-- [end:propose]


# --8<-- [start:propose_block]
def propose_block(buffers: DrafterBuffers, committed, context_length, out, stream) -> None:
    """The block drafter's round: its rows gathered, its forward, the log-softmax of its depth rows
    into ``out`` (L, V); three launches and the forward's, all reading device buffers only."""
    forward, window = buffers.forward, buffers.loaded[0].window
    rows = window + out.shape[0] - 1                                     # window + L - 1
    b = forward.buffers
    block_rows_kernel[blocks(rows, BLOCK_ROWS_THREADS), BLOCK_ROWS_THREADS, stream](
        committed, context_length, buffers.ints, b.tree.tokens[:rows], b.tree.parents[:rows],
        b.tree.depths[:rows], b.prefix)
    forward.forward_rows(stream, rows, outcome=False)                    # logits [window + L - 1, V]
    threads = pow2_threads(out.shape[1])
    block_logprobs_kernel(threads)[out.shape[0], threads, stream](b.logits, buffers.ints, out)
# --8<-- [end:propose_block]
