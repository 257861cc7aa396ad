"""Sampling at temperature > 0: position-keyed random numbers, per-node sampling in the tree, and
a sampled tree verified by recursive rejection sampling.

Legend (docs/glossary.md): T rows of a forward, V vocab_size, L draft depths (block_size - 1),
K candidates per depth (a node has at most K children), N tree nodes (root included).

**Position-keyed random numbers.** The token at absolute position p (its index in the whole
sequence, prompt included) is drawn with random numbers that are a pure function of
(seed, purpose, p, index): Philox4x32-10 (Salmon et al., SC'11; the counter-based generator of
cuRAND and Random123) maps the counter (index, p mod 2^32, p div 2^32, purpose) and the key
(seed mod 2^32, seed div 2^32) to four 32-bit words. Philox needs only 32 x 32 -> 64-bit products,
which never wrap in uint64, so numpy, numba on the GPU and numba's simulator (where integer
scalars are numpy's, and a wrapping 64-bit multiply warns) run the same arithmetic.

Bits to numbers, in float64: the first two words give 52 bits b (w0 << 20 | w1 >> 12), and
u = (b + 0.5) 2^-52 lies strictly inside (0, 1), exactly (b + 0.5 needs 53 bits); the Gumbel
number is g = -log(-log u), in [-3.6, 36.7]. float64 rather than float32: a float32 u has 24 bits,
so u would round to 1 (g = +inf) once in 2^25 draws, which a vocabulary of 163840 reaches every
200 tokens, and the scores logit / T + g would tie in float32 about 2^29 times more often. float32
logits convert to float64 exactly, and division, addition and conversion are correctly rounded on
every IEEE machine: only ``log`` and ``exp`` can differ between numpy and a GPU, by an ulp (see
docs/13_sampling.md for where that can move a draw, and how rarely).

**Sampling** (``sample``): token = argmax over v of logits[v] / T + g(seed, SAMPLE, p, v), ties to
the lower index (np.argmax): the Gumbel-max trick draws exactly from softmax(logits / T).
T = 0 is greedy argmax. Because the draw at p depends on nothing but (seed, p) and the logits
there, a tree node at position p, whose logits are bit-identical to AR's there (batch
invariance), draws AR's token: DDTree == AR token for token at any temperature.

**A sampled tree** (``draw_children``, ``rejection_step``): children drawn without replacement
from the drafter's distribution q (Gumbel-top-K with the DRAFT purpose), verified one after the
other by recursive rejection sampling (SpecInfer's multi-draft verification, drafts without
replacement as in Recursive Speculative Decoding): accept child x_j with probability
min(1, p_j(x_j) / q_j(x_j)); on rejection p_{j+1} = norm(max(p_j - q_j, 0)) and q_{j+1} = q_j
without x_j; if every child is rejected, draw from what is left of p. The committed tokens follow
the target's distribution exactly, but they are not AR's tokens for the same seed.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from ddtree import linear
from ddtree.tree import DraftTree

# Philox4x32-10's constants (Random123): the multipliers, and the Weyl increments of the key
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
LOW32 = np.uint64(0xFFFFFFFF)
UNIT = 2.0 ** -52                     # one step of a 52-bit uniform

# purposes: the fourth counter word, so the numbers of one position serve three independent uses
SAMPLE = 0      # the target's draws: Gumbel numbers per token (index = token id)
DRAFT = 1       # the children of a sampled tree: Gumbel numbers per token (index = token id)
ACCEPT = 2      # rejection sampling's accept tests: uniforms (index = the child's rank)
PURPOSES = (SAMPLE, DRAFT, ACCEPT)

MAX_SEED = 2 ** 63 - 1                # a seed fits an int64 device array
VERIFIERS = ("node", "rejection")     # per-node sampling (token for token), rejection sampling


# ----------------------------------------------------------------------------------------------
# checks

def check_temperature(temperature) -> float:
    """A finite real number >= 0 (0: greedy), as a Python float."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                                 np.floating)):
        raise ValueError(f"temperature must be a real number >= 0 (0: greedy), got {temperature!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    return float(temperature)


def check_sampling_seed(seed) -> int:
    """An integer in [0, 2^63) (it goes to the device as an int64)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    return int(seed)


def check_verifier(verifier) -> str:
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier must be one of {', '.join(VERIFIERS)}, got {verifier!r}")
    return verifier


def check_positions(positions, rows: int) -> np.ndarray:
    """Absolute positions (T,) of the tokens to draw: non-negative integers."""
    positions = np.asarray(positions)
    if positions.shape != (rows,) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be ({rows},) integers (one per row of logits), "
                         f"got {positions.dtype} {positions.shape}")
    if rows and positions.min() < 0:
        raise ValueError(f"positions must be >= 0, got min {positions.min()}")
    return positions.astype(np.int64)


def check_logits(logits, name: str = "logits") -> np.ndarray:
    """Rows of logits (T, V) with V >= 1, as float32."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] < 1 or not np.issubdtype(logits.dtype, np.floating):
        raise ValueError(f"{name} must be a float array (T, V) with V >= 1, "
                         f"got {logits.dtype} {logits.shape}")
    return logits.astype(np.float32)


def check_sample(logits, positions, temperature, seed):
    logits = check_logits(logits)
    return (logits, check_positions(positions, logits.shape[0]), check_temperature(temperature),
            check_sampling_seed(seed))


# ----------------------------------------------------------------------------------------------
# the counter-based generator

# --8<-- [start:philox]
def philox(counter, key):
    """Philox4x32-10: four 32-bit counter words and two key words (uint64 arrays that broadcast,
    each < 2^32) -> four 32-bit words, a pure function of (counter, key)."""
    c0, c1, c2, c3 = (np.asarray(word, np.uint64) for word in counter)
    k0, k1 = (np.asarray(word, np.uint64) for word in key)
    m0, m1 = (np.uint64(m) for m in PHILOX_MULTIPLIERS)
    for round_ in range(PHILOX_ROUNDS):
        if round_:                                            # the key schedule: Weyl steps mod 2^32
            k0, k1 = (k0 + np.uint64(PHILOX_WEYL[0])) & LOW32, (k1 + np.uint64(PHILOX_WEYL[1])) & LOW32
        p0, p1 = m0 * c0, m1 * c2                             # 32 x 32 -> 64 bits: never wraps
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & LOW32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & LOW32)
    return c0, c1, c2, c3
# --8<-- [end:philox]


# --8<-- [start:uniforms]
def uniforms(positions, indices, seed: int, purpose: int) -> np.ndarray:
    """Uniforms (T, C) in (0, 1), float64: entry [t, c] belongs to (seed, purpose, positions[t],
    indices[c]) and to nothing else."""
    seed = check_sampling_seed(seed)
    position = np.asarray(positions, np.int64).astype(np.uint64)[:, None]       # [T, 1]
    index = np.asarray(indices, np.int64).astype(np.uint64)[None, :]            # [1, C]
    w0, w1, _, _ = philox((index, position & LOW32, position >> np.uint64(32), np.uint64(purpose)),
                          (np.uint64(seed) & LOW32, np.uint64(seed) >> np.uint64(32)))   # [T, C] each
    bits = (w0 << np.uint64(20)) | (w1 >> np.uint64(12))                         # [T, C] 52 bits
    return (bits.astype(np.float64) + 0.5) * UNIT                                # [T, C] exact


def gumbel_noise(positions, vocab: int, seed: int, purpose: int = SAMPLE) -> np.ndarray:
    """Gumbel numbers (T, V), float64: -log(-log u) for the uniforms of tokens 0..V-1."""
    u = uniforms(positions, np.arange(vocab), seed, purpose)                    # [T, V]
    return -np.log(-np.log(u))                                                   # [T, V]
# --8<-- [end:uniforms]


# --8<-- [start:sample]
def sample(logits, positions, temperature: float, seed: int) -> np.ndarray:
    """The token per row of ``logits`` (T, V), drawn at ``positions`` (T,): the absolute
    position each drawn token will take. Greedy argmax at temperature 0; otherwise the Gumbel-max
    of logits / temperature, ties to the lower index. Returns (T,) int64."""
    logits, positions, temperature, seed = check_sample(logits, positions, temperature, seed)
    if temperature == 0:
        return linear.argmax(logits)                                             # [T]
    scores = logits.astype(np.float64) / temperature                             # [T, V]
    scores += gumbel_noise(positions, logits.shape[1], seed, SAMPLE)             # [T, V]
    return np.argmax(scores, axis=-1).astype(np.int64)                           # [T]
# --8<-- [end:sample]


# ----------------------------------------------------------------------------------------------
# random sources: the keyed one decodes; an enumeration takes every outcome once (tests, chapter)

class KeyedRandom:
    """What a sampled tree draws, from position-keyed numbers: every call is a pure function of
    (seed, its position, its arguments), so a round can be recomputed or run in any order."""

    def __init__(self, seed: int):
        self.seed = check_sampling_seed(seed)

    def choose(self, position: int, scores: np.ndarray) -> int:
        """A token with probability softmax(scores) (scores (V,) float64, -inf: never)."""
        gumbel = gumbel_noise([position], scores.size, self.seed, SAMPLE)[0]      # [V]
        return int(np.argmax(scores + gumbel))

    def draw(self, position: int, scores: np.ndarray, count: int) -> np.ndarray:
        """``count`` distinct tokens drawn one by one without replacement from softmax(scores):
        the ``count`` largest scores + Gumbel numbers (Gumbel-top-k), ties to the lower id."""
        gumbel = gumbel_noise([position], scores.size, self.seed, DRAFT)[0]       # [V]
        return np.argsort(-(scores + gumbel), kind="stable")[:count].astype(np.int64)

    def accepts(self, position: int, index: int, target: float, draft: float) -> bool:
        """True with probability min(1, target / draft): the accept test of child ``index``."""
        u = uniforms([position], [index], self.seed, ACCEPT)[0, 0]
        return bool(u * draft < target)


class Enumeration:
    """A random source that ``outcomes`` replays until every path of choices was taken once; each
    choice branches over its possible results, and ``probability`` is the path's exact probability."""

    def __init__(self, script: list[int]):
        self.script = script           # the branch to take at each choice (0 past its end)
        self.taken: list[int] = []
        self.branches: list[int] = []
        self.probability = 1.0

    def pick(self, options):
        """One of ``options`` ((result, probability > 0) pairs), the one the script names."""
        at = len(self.taken)
        index = self.script[at] if at < len(self.script) else 0
        self.taken.append(index)
        self.branches.append(len(options))
        result, probability = options[index]
        self.probability *= probability
        return result

    def choose(self, position: int, scores: np.ndarray) -> int:
        weights = np.exp(scores - scores.max())                                  # [V]
        weights /= weights.sum()
        return self.pick([(v, w) for v, w in enumerate(weights.tolist()) if w > 0])

    def draw(self, position: int, scores: np.ndarray, count: int) -> np.ndarray:
        scores, drawn = scores.copy(), []
        for _ in range(count):
            if np.isfinite(scores).any():
                drawn.append(self.choose(position, scores))
            else:                         # q is used up: the keyed draw's order (lower ids first)
                drawn.append(int(np.flatnonzero(~np.isin(np.arange(scores.size), drawn))[0]))
            scores[drawn[-1]] = -np.inf                                          # without replacement
        return np.array(drawn, np.int64)

    def accepts(self, position: int, index: int, target: float, draft: float) -> bool:
        # the keyed test u * draft < target, u uniform in (0, 1)
        chance = 0.0 if target <= 0 else 1.0 if target >= draft else target / draft
        return self.pick([(verdict, p) for verdict, p in ((True, chance), (False, 1 - chance)) if p > 0])


def outcomes(run):
    """Every outcome of ``run(random)`` with its exact probability, as (result, probability) pairs:
    ``run`` is replayed with an ``Enumeration`` that takes the next untried path each time."""
    script: list[int] = []
    while True:
        random = Enumeration(script)
        yield run(random), random.probability
        script, branches = random.taken, random.branches
        while script and script[-1] + 1 == branches[len(script) - 1]:             # last choice exhausted
            script.pop()
        if not script:
            return
        script[-1] += 1


def committed_distribution(round_outcomes, root: int, horizon: int) -> dict:
    """P(the first ``horizon`` committed tokens) from ``root``, over as many rounds as it takes:
    ``round_outcomes(last)`` lists one round's (committed tokens, probability) from the root
    ``last`` (``outcomes`` of a round whose target and drafter depend on the last token only)."""
    @functools.cache
    def ahead(last: int, remaining: int) -> dict:
        result = collections.defaultdict(float)
        for tokens, probability in round_outcomes(last):
            if len(tokens) >= remaining:
                result[tokens[:remaining]] += probability
            else:                                     # the next round starts from the bonus
                for rest, p in ahead(tokens[-1], remaining - len(tokens)).items():
                    result[tokens + rest] += probability * p
        return dict(result)
    return ahead(root, horizon)


# ----------------------------------------------------------------------------------------------
# the sampled tree and its verification

def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities (V,) float64: exp(scores - max) / their sum (the kernel's order of operations)."""
    weights = np.exp(scores - scores.max())                                      # [V]
    return weights / weights.sum()


# --8<-- [start:verify_node]
def verify_node(logits, draft_logits, children, temperature: float, position: int, random) -> int:
    """The token at ``position``, after one node: one of ``children`` (tokens in rank order,
    drawn without replacement from q = softmax(draft_logits / T)) when recursive rejection
    sampling accepts it, else a draw from what is left of the target p = softmax(logits / T)."""
    scores = np.asarray(logits, np.float64) / temperature                        # [V]
    if len(children) == 0:
        return random.choose(position, scores)                                   # plain sampling
    residual = softmax(scores)                                                   # [V] p_1 = p
    draft = softmax(np.asarray(draft_logits, np.float64) / temperature)         # [V] q_1 = q
    mass, remaining = 1.0, 1.0                      # p_j = residual / mass, q_j = draft / remaining
    for j, child in enumerate(children):
        if draft[child] <= 0 or remaining <= 0 or mass <= 0:
            break                         # q or p has nothing left: the rest of the children are padding
        if random.accepts(position, j, residual[child] / mass, draft[child] / remaining):
            return int(child)
        residual = np.maximum(residual / mass - draft / remaining, 0.0)          # [V] p_{j+1}, unnormalised
        remaining -= draft[child]
        draft[child] = 0.0                               # q_{j+1}: x_j drawn already (p_{j+1}(x_j) = 0)
        mass = residual.sum()
    if mass > 0:
        with np.errstate(divide="ignore"):
            return random.choose(position, np.log(residual))                     # -inf where nothing is left
    return random.choose(position, scores)           # p == q up to rounding: nothing left to correct
# --8<-- [end:verify_node]


def child_tokens(tree: DraftTree) -> np.ndarray:
    """Each node's children's tokens in rank order, padded with -1: (N, K) int64 (K >= 1)."""
    kids = [tree.tokens[tree.children(i)] for i in range(tree.size)]
    table = np.full((tree.size, max(1, max(k.size for k in kids))), -1, np.int64)   # [N, K]
    for i, k in enumerate(kids):
        table[i, :k.size] = k
    return table


def check_rejection(logits, positions, children, draft_logits, depths):
    logits = check_logits(logits)
    rows = logits.shape[0]
    positions = check_positions(positions, rows)
    draft_logits = check_logits(draft_logits, "draft_logits") if np.asarray(draft_logits).size \
        else np.zeros((0, logits.shape[1]), np.float32)
    children, depths = np.asarray(children), np.asarray(depths)
    if children.ndim != 2 or children.shape[0] != rows or not np.issubdtype(children.dtype, np.integer):
        raise ValueError(f"children must be ({rows}, K) integers (-1 pads), "
                         f"got {children.dtype} {children.shape}")
    if depths.shape != (rows,) or not np.issubdtype(depths.dtype, np.integer):
        raise ValueError(f"depths must be ({rows},) integers, got {depths.dtype} {depths.shape}")
    if draft_logits.shape[1] != logits.shape[1]:
        raise ValueError(f"draft_logits must have V = {logits.shape[1]} columns like logits, "
                         f"got shape {draft_logits.shape}")
    if children.size and (children.min() < -1 or children.max() >= logits.shape[1]):
        raise ValueError(f"children must be tokens in [0, {logits.shape[1]}) or -1, got min {children.min()} "
                         f"max {children.max()}")
    has_children = children[:, 0] >= 0 if children.shape[1] else np.zeros(rows, bool)
    if np.any(has_children & ((depths < 0) | (depths >= draft_logits.shape[0]))):
        raise ValueError(f"depths of nodes with children must index draft_logits' "
                         f"{draft_logits.shape[0]} rows")
    for name, array in (("logits", logits), ("draft_logits", draft_logits)):
        if not np.isfinite(array.max(axis=1, initial=-np.inf)).all() or np.isnan(array).any() \
                or np.isposinf(array).any():
            raise ValueError(f"{name} rows need a finite maximum and no NaN or +inf")
    for i, row in enumerate(children):
        kids = row[row >= 0]
        if np.any(row[kids.size:] >= 0) or np.unique(kids).size != kids.size:
            raise ValueError(f"children[{i}] must list distinct tokens first, then -1 padding")
    return logits, positions, children.astype(np.int64), draft_logits, depths.astype(np.int64)


# --8<-- [start:rejection_step]
def rejection_step(logits, positions, children, draft_logits, depths, temperature: float, seed: int):
    """Every node's outcome at once (what the kernel computes, one block per node): row i's
    children (children[i], -1 padded) verified against its logits, with the drafter's row
    depths[i] as q; positions[i] is where the outcome goes. Returns (T,) int64 tokens: the
    accepted child's, or a residual draw (then no child carries it). Temperature 0: argmax."""
    logits, positions, children, draft_logits, depths = check_rejection(logits, positions, children,
                                                                        draft_logits, depths)
    temperature = check_temperature(temperature)
    if temperature == 0:
        return linear.argmax(logits)                                             # [T]
    random = KeyedRandom(seed)
    tokens = np.empty(logits.shape[0], np.int64)                                 # [T]
    for i, row in enumerate(children):
        kids = row[row >= 0]
        draft_row = draft_logits[depths[i]] if kids.size else None
        tokens[i] = verify_node(logits[i], draft_row, kids, temperature, int(positions[i]), random)
    return tokens
# --8<-- [end:rejection_step]


# --8<-- [start:draw_children]
def draw_children(tree: DraftTree, draft_logits, start: int, temperature: float, random) -> DraftTree:
    """``tree``'s shape with new tokens: at each depth d, the tokens of ranks 0, 1, ... are one draw
    without replacement from softmax(draft_logits[d - 1] / T), made at position start + d (so a
    node with c children gets the first c draws). Log-probs are path sums of log q (float32)."""
    draft = np.asarray(draft_logits, np.float64) / temperature                   # [L, V]
    draws = {}
    for depth in range(1, int(tree.depths.max()) + 1):
        count = int(tree.ranks[tree.depths == depth].max()) + 1
        draws[depth] = random.draw(start + depth, draft[depth - 1], count)        # [count]
    with np.errstate(divide="ignore"):                                           # log 0 = -inf: q's holes
        log_q = np.log([softmax(row) for row in draft]).astype(np.float32)       # [L, V]
    tokens, logprobs = tree.tokens.copy(), np.zeros(tree.size, np.float32)       # [N] each
    for i in range(1, tree.size):
        depth = int(tree.depths[i])
        tokens[i] = draws[depth][tree.ranks[i]]
        logprobs[i] = logprobs[tree.parents[i]] + log_q[depth - 1, tokens[i]]    # root to leaf, float32
    return DraftTree(tokens, tree.parents, tree.depths, tree.ranks, logprobs)
# --8<-- [end:draw_children]


# --8<-- [start:rejection_walk]
def rejection_walk(tree: DraftTree, logits, draft_logits, start: int, temperature: float, random):
    """The walk, one node at a time: verify the node's children, move to the accepted one, stop at
    a residual draw (the bonus). Node i's outcome goes to position start + depth + 1. Returns
    (accepted node indices (m,) int64 starting with 0, bonus token), as ``accept`` does."""
    accepted = [0]
    while True:
        node = accepted[-1]
        kids = tree.children(node)                                               # [c] rank order
        depth = int(tree.depths[node])
        draft_row = draft_logits[depth] if kids.size else None
        token = verify_node(logits[node], draft_row, tree.tokens[kids], temperature, start + depth + 1,
                            random)
        match = kids[tree.tokens[kids] == token]
        if match.size == 0:
            return np.array(accepted, np.int64), token
        accepted.append(int(match[0]))
# --8<-- [end:rejection_walk]
