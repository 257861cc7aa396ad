"""Drafters: per-depth distributions over the next ``block_size - 1`` tokens.

Legend (docs/glossary.md): L draft depths (block_size - 1), V vocab_size.

Every drafter implements ``propose(context_tokens, block_size)`` -> float32 logits (L, V), where
``context_tokens`` is every committed token (prompt + generated) ending with the round's root, so
row d - 1 is about the token at position len(context_tokens) - 1 + d. A drafter also has a
``vocab_size``; tokens outside [0, vocab_size) are refused by name. A drafter only changes
speed: the DDTree loop emits the target's greedy tokens whatever it proposes.

- ``OracleDrafter`` knows the target's greedy continuation (as in the seeds' engine) and ranks it
  first at every depth, the remaining probability on a few seeded distractors.
- ``NoisyOracleDrafter`` is the oracle with tunable mistakes: the true token is top-1 with a
  probability that decays with depth, otherwise it is demoted to a runner-up rank or left out, so
  trees branch and accepted paths leave the top-1 chain.
- ``NGramDrafter`` is a real, training-free drafter: it finds earlier occurrences of the context's
  suffix and votes, per depth, for the tokens that followed them.
- ``BlockDrafter`` is a trained block drafter (DFlash-like, as in DDTree): a small model of the
  target's family reads the last ``window`` committed tokens then L - 1 mask tokens
  (``block_rows``) in one causal forward from an empty cache, and its rows give the next L
  distributions; it reads committed tokens only (no target hidden states). ``load_block_drafter``
  reads one from a checkpoint directory (``drafter.json`` beside the model's files).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from ddtree.config import ModelConfig
from ddtree.model import Transformer

# log-probability floor for tokens a drafter has no opinion about
FLOOR_LOGIT = np.float32(-30.0)


def check_positive(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_seed(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def check_token_id(name: str, token, vocab_size: int | None = None) -> int:
    """One token id: a non-negative integer, below ``vocab_size`` when it is given."""
    if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) or token < 0 \
            or (vocab_size is not None and token >= vocab_size):
        bound = f"in [0, vocab_size={vocab_size})" if vocab_size is not None else "a non-negative integer"
        raise ValueError(f"{name} must be a token id {bound}, got {token!r}")
    return int(token)


def check_tokens(name: str, tokens, vocab_size: int, copy: bool = True) -> np.ndarray:
    """A non-empty 1-D array of token ids in [0, vocab_size), as int64 (a copy unless ``copy=False``
    and ``tokens`` already is one)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{name} must be a non-empty 1-D integer sequence, got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}) of this drafter, "
                         f"got min {tokens.min()} max {tokens.max()}")
    return tokens.astype(np.int64, copy=copy)


def check_block(context_tokens, block_size: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """(context as int64, L) for one ``propose`` call; no copy: the context is only read."""
    context = check_tokens("context_tokens", context_tokens, vocab_size, copy=False)
    return context, check_positive("block_size", block_size) - 1


# --8<-- [start:keyed]
MASK64 = (1 << 64) - 1
# the words that keep a position's numbers apart by use (the key's last word before the index)
TOKENS, TOP1, KEEP, RANK = range(4)


def mix(state: int, word: int) -> int:
    """One step of a keyed hash: ``word`` (a non-negative integer) folded into the 64-bit
    ``state`` by splitmix64's finaliser. Pure Python: a round needs a few dozen numbers, and a
    numpy generator per position cost more than the whole rest of the oracle's round."""
    state = ((state ^ (word & MASK64)) + 0x9E3779B97F4A7C15) & MASK64
    state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & MASK64
    return state ^ (state >> 31)


def keyed_state(*key: int) -> int:
    """The hash state of a key (seed, position, depth, use): numbers that depend only on it, so
    proposals never depend on history. Words fold in one at a time, so mix(keyed_state(*key),
    use) is keyed_state(*key, use): a (position, depth) computes its prefix once."""
    state = 0
    for word in key:
        state = mix(state, word)
    return state


def uniform_of(state: int) -> float:
    """A uniform in [0, 1) from a hash state: its top 53 bits."""
    return (state >> 11) * 2.0 ** -53


def tokens_of(state: int, count: int, vocab_size: int, exclude: int | None) -> list[int]:
    """min(count, the tokens available) distinct tokens in [0, vocab_size) other than ``exclude``:
    mix(state, i) mod vocab_size for i = 0, 1, ..., repeats skipped (a random subset in a random
    order: the same as a permutation's first entries, but only a few hashes)."""
    count = min(count, vocab_size - (exclude is not None))
    chosen, index = [], 0
    while len(chosen) < count:
        token = mix(state, index) % vocab_size
        if token != exclude and token not in chosen:
            chosen.append(token)
        index += 1
    return chosen
# --8<-- [end:keyed]


class OracleDrafter:
    """Proposes the target's true greedy continuation ``sequence`` (prompt + AR tokens).

    ``sequence[p]`` is the token at absolute position p. At each depth the true token gets
    probability ``confidence``, ``distractors`` seeded random tokens share the rest.
    """

    def __init__(self, sequence, vocab_size: int, confidence: float = 0.9, distractors: int = 3,
                 seed: int = 0):
        self.vocab_size = check_positive("vocab_size", vocab_size)
        self.sequence = check_tokens("sequence", sequence, self.vocab_size)
        seed = check_seed(seed)
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {confidence}")
        if not 0 <= distractors < vocab_size:
            raise ValueError(f"distractors must be in [0, {vocab_size}), got {distractors}")
        self.confidence, self.distractors, self.seed = confidence, distractors, seed
        # position (the noisy oracle: (position, depth)) -> (tokens, log-probabilities), drawn once:
        # rounds draft the same positions again at smaller depths
        self.proposals: dict = {}
        self.logprobs: dict[int, np.ndarray] = {}           # ranking length -> float32 log-probabilities

    @classmethod
    def from_model(cls, model, prompt, max_new_tokens: int, **options) -> OracleDrafter:
        """Run the target's AR greedy decoding once and draft from it."""
        from ddtree.decode import generate_ar

        prompt = np.asarray(prompt, dtype=np.int64)
        continuation = generate_ar(model, prompt, max_new_tokens)
        return cls(np.concatenate([prompt, continuation]), model.config.vocab_size, **options)

    def true_token(self, position: int) -> int | None:
        return int(self.sequence[position]) if position < self.sequence.size else None

    def draw_ranking(self, position: int) -> list[int]:
        truth = self.true_token(position)
        others = tokens_of(keyed_state(self.seed, position, 0, TOKENS), self.distractors, self.vocab_size,
                           truth)
        return ([truth] if truth is not None else []) + others

    def probabilities(self, count: int) -> list[float]:
        """Probabilities of a ranking of ``count`` tokens, best first (they depend on the count only)."""
        rest = (1 - self.confidence) / max(count - 1, 1)
        return [self.confidence] + [rest] * (count - 1)

    def scored(self, ranked: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [ranked], float32 log-probabilities [ranked]) of one ranking, best first."""
        count = len(ranked)
        if count not in self.logprobs:
            # each value is np.log(p) rounded to float32, as one write of it into a float32 row rounds it
            self.logprobs[count] = np.array([np.log(p) for p in self.probabilities(count)], np.float32)
        logprobs = self.logprobs[count]
        if logprobs.size != count:
            raise ValueError(f"nothing to propose: {count} ranked tokens, {logprobs.size} probabilities")
        return np.array(ranked, dtype=np.int64), logprobs

    # --8<-- [start:propose]
    def proposal(self, position: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [ranked], float32 log-probabilities [ranked]) for the token at ``position``.
        The oracle's ignores the depth, so each position is drawn once."""
        if position not in self.proposals:
            self.proposals[position] = self.scored(self.draw_ranking(position))
        return self.proposals[position]

    def propose(self, context_tokens, block_size: int) -> np.ndarray:
        context, depths = check_block(context_tokens, block_size, self.vocab_size)
        logits = np.full((depths, self.vocab_size), FLOOR_LOGIT, dtype=np.float32)  # [L, V]
        for d in range(1, depths + 1):
            tokens, logprobs = self.proposal(context.size - 1 + d, d)     # [ranked], [ranked]
            logits[d - 1, tokens] = logprobs
        return logits
    # --8<-- [end:propose]


class NoisyOracleDrafter(OracleDrafter):
    """The oracle with seeded, tunable mistakes.

    At depth d the true token is top-1 with probability ``top1_rate * decay ** (d - 1)``.
    Otherwise it is demoted to a uniformly chosen runner-up rank (1..``runners_up``) with
    probability ``keep_rate``, or left out altogether. The top-1 gets ``1 - runner_up_mass`` of the
    probability; the runners-up share ``runner_up_mass`` geometrically (each half the previous).
    Decisions depend only on (seed, absolute position, depth), so a run is reproducible.
    """

    def __init__(self, sequence, vocab_size: int, top1_rate: float = 0.7, decay: float = 0.9,
                 keep_rate: float = 0.8, runners_up: int = 3, runner_up_mass: float = 0.35,
                 seed: int = 0):
        for name, value in (("top1_rate", top1_rate), ("decay", decay), ("keep_rate", keep_rate)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 0 < runner_up_mass < 1:
            raise ValueError(f"runner_up_mass must be in (0, 1), got {runner_up_mass}")
        super().__init__(sequence, vocab_size, confidence=1 - runner_up_mass,
                         distractors=runners_up, seed=seed)
        self.top1_rate, self.decay, self.keep_rate = top1_rate, decay, keep_rate
        self.runners_up, self.runner_up_mass = runners_up, runner_up_mass

    def proposal(self, position: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """As the oracle's, but the draw depends on the depth too: each (position, depth) once."""
        if (position, depth) not in self.proposals:
            self.proposals[position, depth] = self.scored(self.noisy_ranking(position, depth))
        return self.proposals[position, depth]

    # --8<-- [start:noisy_ranking]
    def noisy_ranking(self, position: int, depth: int) -> list[int]:
        truth = self.true_token(position)
        key = keyed_state(self.seed, position, depth)      # depth >= 1: apart from the oracle's keys
        ranked = tokens_of(mix(key, TOKENS), self.runners_up + 1, self.vocab_size, truth)
        if truth is None:
            return ranked
        if uniform_of(mix(key, TOP1)) < self.top1_probability(depth):
            return [truth] + ranked[: self.runners_up]
        if self.runners_up and uniform_of(mix(key, KEEP)) < self.keep_rate:
            ranked.insert(1 + int(uniform_of(mix(key, RANK)) * self.runners_up), truth)   # rank 1..runners_up
        return ranked[: self.runners_up + 1]
    # --8<-- [end:noisy_ranking]

    def top1_probability(self, depth: int) -> float:
        """How often the true token is ranked first at ``depth`` (>= 1)."""
        return self.top1_rate * self.decay ** (depth - 1)

    def probabilities(self, count: int) -> list[float]:
        shares = 0.5 ** np.arange(count - 1)
        runners = (self.runner_up_mass * shares / shares.sum()).tolist() if count > 1 else []
        return [1 - self.runner_up_mass] + runners


class NGramDrafter:
    """Drafts from the context itself: earlier continuations of the longest matching suffixes.

    For every suffix length s = ``max_ngram`` .. 1, each earlier occurrence of the last s tokens
    votes, with weight s, for the tokens that followed it at offsets 1..L. Logits are the log of
    the smoothed votes, so unseen tokens share a small floor; with no match at all the rows are flat.
    """

    def __init__(self, vocab_size: int, max_ngram: int = 3, smoothing: float = 1e-3):
        self.vocab_size = check_positive("vocab_size", vocab_size)
        self.max_ngram = check_positive("max_ngram", max_ngram)
        if not smoothing > 0:
            raise ValueError(f"smoothing must be > 0, got {smoothing}")
        self.smoothing = smoothing

    # --8<-- [start:ngram]
    def match_weights(self, context: np.ndarray) -> np.ndarray:
        """Per end e, the vote weight of the earlier copy that ends just before ``context[e]``: the
        sum of the suffix lengths s it matches (context[e - s:e] == context[-s:]), 0 for none."""
        n = context.size
        weights = np.zeros(n, dtype=np.int64)                                    # [len(context)]
        matched = np.ones(n, dtype=bool)                  # the copy of length s - 1 ending at e matched
        for s in range(1, min(self.max_ngram, n - 1) + 1):
            # the copy of length s ending at e adds context[e - s] == context[n - s] to that of
            # length s - 1; it needs e >= s (and e <= n - 1, so that a token follows it)
            matched[:s] = False
            matched[s:] &= context[:n - s] == context[n - s]
            weights += s * matched
        return weights

    def votes(self, context: np.ndarray, depths: int) -> np.ndarray:
        """Weighted counts (L, V) of the tokens that followed earlier copies of the suffix."""
        weights = self.match_weights(context)                                    # [len(context)]
        ends = np.flatnonzero(weights)                                           # [copies]
        following = ends[:, None] + np.arange(depths)              # [copies, L] followers' positions
        inside = following < context.size                # a copy near the end has fewer than L followers
        depth_of = np.broadcast_to(np.arange(depths), following.shape)          # [copies, L]
        weight_of = np.broadcast_to(weights[ends, None], following.shape)        # [copies, L]
        # one bin per (depth, token); the weights are small integers, so the float64 sums are exact
        # in any order: the same counts as adding each copy's weight s one suffix length at a time
        bins = depth_of[inside] * self.vocab_size + context[following[inside]]
        votes = np.bincount(bins, weights=weight_of[inside], minlength=depths * self.vocab_size)
        return votes.reshape(depths, self.vocab_size)                            # [L, V]

    def propose(self, context_tokens, block_size: int) -> np.ndarray:
        context, depths = check_block(context_tokens, block_size, self.vocab_size)
        votes = self.votes(context, depths)                                      # [L, V]
        # the row's total as the exact integer sum of its votes plus V smoothings: the same bits in
        # any summation order, so the device's drafter (kernels/drafters.py) reproduces it
        total = votes.sum(-1, keepdims=True) + self.vocab_size * self.smoothing  # [L, 1]
        return np.log((votes + self.smoothing) / total).astype(np.float32)       # [L, V]
    # --8<-- [end:ngram]


# --8<-- [start:block_rows]
# A block drafter's special tokens: the trained tokenizer (train/tokenizer.py) gives them these ids
END_OF_TEXT, PAD, MASK = 0, 1, 2


def block_rows(context_tokens, window: int, depths: int, pad_token: int = PAD,
               mask_token: int = MASK) -> np.ndarray:
    """The rows a block drafter reads in one forward: the last ``window`` committed tokens (root
    last; left-padded with ``pad_token`` while the context is shorter) then ``depths - 1`` mask
    tokens, at positions 0 .. window + depths - 2 whatever the context's length, so every round has
    the same shape. Row ``window - 2 + d`` carries the distribution of the token at depth ``d``:
    the root's row predicts depth 1, each mask row the depth after."""
    window, depths = check_positive("window", window), check_positive("depths", depths)
    check_token_id("pad_token", pad_token), check_token_id("mask_token", mask_token)
    context = np.asarray(context_tokens)
    if context.ndim != 1 or context.size == 0 or not np.issubdtype(context.dtype, np.integer):
        raise ValueError(f"context_tokens must be a non-empty 1-D integer sequence (the root last), got "
                         f"shape {context.shape} dtype {context.dtype}")
    context = context.astype(np.int64)[-window:]                                   # [<= window]
    rows = np.full(window + depths - 1, mask_token, dtype=np.int64)               # [window + L - 1]
    rows[:window] = pad_token
    rows[window - context.size:window] = context
    return rows
# --8<-- [end:block_rows]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Each row's log-probabilities in float32, in ``ddtree.tree.top_candidates``' steps: subtract
    the row max (float32), sum the exponentials in float64, subtract the log cast to float32."""
    logits = np.asarray(logits, np.float32)                                       # [L, V]
    shifted = logits - logits.max(axis=-1, keepdims=True)                         # [L, V] <= 0
    log_sum = np.log(np.exp(shifted.astype(np.float64)).sum(axis=-1, keepdims=True))  # [L, 1]
    return shifted - log_sum.astype(np.float32)                                   # [L, V]


# --8<-- [start:block_drafter]
class BlockDrafter:
    """A trained block drafter: ``config`` and ``weights`` are a ``ddtree.model`` model (MLA + dense
    or MoE layers) trained to read ``block_rows`` (``window`` committed tokens, then mask tokens).

    ``propose`` runs one causal forward over the rows from an empty cache and returns the
    log-softmax of rows window - 2 + d, d = 1..L (L <= ``max_depths``, the depths it was trained
    for). It keeps no state: the proposal is a function of the committed tokens alone.
    """

    def __init__(self, config: ModelConfig, weights: dict, window: int, max_depths: int,
                 pad_token: int = PAD, mask_token: int = MASK):
        self.model = Transformer(config, weights)                   # checks the config and weights
        self.config, self.weights = config, weights                 # the engine uploads them
        self.vocab_size = config.vocab_size
        self.window = check_positive("window", window)
        self.max_depths = check_positive("max_depths", max_depths)
        self.pad_token = check_token_id("pad_token", pad_token, self.vocab_size)
        self.mask_token = check_token_id("mask_token", mask_token, self.vocab_size)
        rows, limit = self.window + self.max_depths - 1, config.max_position_embeddings
        if rows > limit:
            raise ValueError(f"window + max_depths - 1 ({rows}) must be <= the drafter's "
                             f"max_position_embeddings ({limit})")

    def check_depths(self, depths: int) -> None:
        """A block of ``depths`` (L) drafted tokens is one this drafter was trained for."""
        if depths > self.max_depths:
            raise ValueError(f"block_size - 1 ({depths}) must be <= max_depths ({self.max_depths}) of this "
                             f"block drafter")

    def propose(self, context_tokens, block_size: int) -> np.ndarray:
        context, depths = check_block(context_tokens, block_size, self.vocab_size)
        self.check_depths(depths)
        if depths == 0:
            return np.zeros((0, self.vocab_size), np.float32)
        rows = block_rows(context, self.window, depths, self.pad_token, self.mask_token)  # [window + L - 1]
        logits = self.model.logits(rows)                                # [window + L - 1, V]
        return log_softmax(logits[self.window - 1:])                    # [L, V]
# --8<-- [end:block_drafter]


DRAFTER_FILE = "drafter.json"
DRAFTER_KEYS = ("kind", "window", "max_depths", "pad_token_id", "mask_token_id")


def save_block_drafter(directory, drafter: BlockDrafter) -> pathlib.Path:
    """Write ``drafter`` where ``load_block_drafter`` reads it: its model's checkpoint
    (``ddtree.weights.save_pretrained``) and ``drafter.json``."""
    from ddtree.weights import save_pretrained

    directory = save_pretrained(directory, drafter.config, drafter.weights)
    values = {"kind": "block", "window": drafter.window, "max_depths": drafter.max_depths,
              "pad_token_id": drafter.pad_token, "mask_token_id": drafter.mask_token}
    (directory / DRAFTER_FILE).write_text(json.dumps(values, indent=2) + "\n")
    return directory


def load_block_drafter(directory) -> BlockDrafter:
    """The block drafter saved in ``directory``: ``drafter.json`` ({"kind": "block", "window",
    "max_depths", "pad_token_id", "mask_token_id"}) beside its model's ``config.json`` and
    ``model.safetensors`` (``ddtree.weights.load_pretrained``); errors name the file and key."""
    from ddtree.weights import load_pretrained, read_json_object

    path = pathlib.Path(directory) / DRAFTER_FILE
    values = read_json_object(path, f"a block drafter's directory holds {DRAFTER_FILE}, config.json and "
                                    "model.safetensors")
    missing = [key for key in DRAFTER_KEYS if key not in values]
    if missing:
        raise ValueError(f"{path}: missing key {missing[0]!r} (expected {', '.join(DRAFTER_KEYS)})")
    if values["kind"] != "block":
        raise ValueError(f"{path}: key 'kind' must be 'block', got {values['kind']!r}")
    for key in DRAFTER_KEYS[1:]:
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key.endswith("_id") else 1):
            kind = "a non-negative integer" if key.endswith("_id") else "a positive integer"
            raise ValueError(f"{path}: key {key!r} must be {kind}, got {value!r}")
    config, weights = load_pretrained(directory)
    try:
        return BlockDrafter(config, weights, values["window"], values["max_depths"],
                            pad_token=values["pad_token_id"], mask_token=values["mask_token_id"])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


DRAFTERS = ("oracle", "noisy", "ngram")       # the drafters every model has (no checkpoint needed)
TRAINED_DRAFTERS = ("block",)                 # ... and those read from a checkpoint directory


# --8<-- [start:make_drafter]
def make_drafter(name: str, model, prompt, max_new_tokens: int, seed: int = 0, continuation=None,
                 drafter_directory=None):
    """A drafter by name for ``model``.

    The oracles need the target's greedy continuation: pass it as ``continuation`` when it is
    already known (the demo has just decoded it), otherwise they run AR once to learn it. The
    block drafter is read from ``drafter_directory`` (``load_block_drafter``); its vocabulary must
    be the model's.
    """
    if name in TRAINED_DRAFTERS:
        if drafter_directory is None:
            raise ValueError(f"drafter {name!r} needs drafter_directory= (a checkpoint directory with "
                             f"{DRAFTER_FILE})")
        drafter = load_block_drafter(drafter_directory)
        if drafter.vocab_size != model.config.vocab_size:
            raise ValueError(f"the block drafter's vocab_size ({drafter.vocab_size}, in {drafter_directory}) "
                             f"must equal the model's vocab_size ({model.config.vocab_size})")
        return drafter
    if drafter_directory is not None:
        raise ValueError(f"drafter_directory is read by the {', '.join(TRAINED_DRAFTERS)} drafter only, "
                         f"not by {name!r}")
    if name in ("oracle", "noisy"):
        kind = OracleDrafter if name == "oracle" else NoisyOracleDrafter
        if continuation is None:
            return kind.from_model(model, prompt, max_new_tokens, seed=seed)
        sequence = np.concatenate([np.asarray(prompt, np.int64), np.asarray(continuation, np.int64)])
        return kind(sequence, model.config.vocab_size, seed=seed)
    if name == "ngram":
        return NGramDrafter(model.config.vocab_size)
    raise ValueError(f"drafter must be one of {', '.join(DRAFTERS + TRAINED_DRAFTERS)}, got {name!r}")
# --8<-- [end:make_drafter]
