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
"""

from __future__ import annotations

import numpy as np

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


def check_tokens(name: str, tokens, vocab_size: int) -> np.ndarray:
    """A non-empty 1-D array of token ids in [0, vocab_size), as int64."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{name} must be a non-empty 1-D integer sequence, got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}) of this drafter, "
                         f"got min {tokens.min()} max {tokens.max()}")
    return tokens.astype(np.int64)


def check_block(context_tokens, block_size: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """(context as int64, L) for one ``propose`` call."""
    context = check_tokens("context_tokens", context_tokens, vocab_size)
    return context, check_positive("block_size", block_size) - 1


def _position_rng(seed: int, position: int) -> np.random.Generator:
    """A generator that depends only on (seed, absolute position): proposals never depend on history."""
    return np.random.default_rng([seed, position])


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
        self.ranked: dict[int, list[int]] = {}              # position -> ranked tokens, drawn once

    @classmethod
    def from_model(cls, model, prompt, max_new_tokens: int, **options) -> OracleDrafter:
        """Run the target's AR greedy decoding once and draft from it."""
        from ddtree.decode import generate_ar

        prompt = np.asarray(prompt, dtype=np.int64)
        continuation = generate_ar(model, prompt, max_new_tokens)
        return cls(np.concatenate([prompt, continuation]), model.config.vocab_size, **options)

    def true_token(self, position: int) -> int | None:
        return int(self.sequence[position]) if position < self.sequence.size else None

    def ranked_tokens(self, position: int) -> list[int]:
        """Tokens for one position, best first: the true token (if known), then distractors.

        A pure function of the position, so it is computed once per position (rounds draft the
        same positions again at smaller depths)."""
        if position not in self.ranked:
            self.ranked[position] = self.draw_ranking(position)
        return self.ranked[position]

    def draw_ranking(self, position: int) -> list[int]:
        truth = self.true_token(position)
        rng = _position_rng(self.seed, position)
        others = [int(t) for t in rng.permutation(self.vocab_size)[: self.distractors + 1] if t != truth]
        return ([truth] if truth is not None else []) + others[: self.distractors]

    def probabilities(self, ranked: list[int], position: int) -> list[float]:
        rest = (1 - self.confidence) / max(len(ranked) - 1, 1)
        return [self.confidence] + [rest] * (len(ranked) - 1)

    # --8<-- [start:propose]
    def propose(self, context_tokens, block_size: int) -> np.ndarray:
        context, depths = check_block(context_tokens, block_size, self.vocab_size)
        logits = np.full((depths, self.vocab_size), FLOOR_LOGIT, dtype=np.float32)  # [L, V]
        for d in range(1, depths + 1):
            position = context.size - 1 + d
            ranked = self.ranked_tokens(position)
            for token, p in zip(ranked, self.probabilities(ranked, position), strict=True):
                logits[d - 1, token] = np.log(p)
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

    def propose(self, context_tokens, block_size: int) -> np.ndarray:
        context, depths = check_block(context_tokens, block_size, self.vocab_size)
        logits = np.full((depths, self.vocab_size), FLOOR_LOGIT, dtype=np.float32)  # [L, V]
        for d in range(1, depths + 1):
            position = context.size - 1 + d
            ranked = self.noisy_ranking(position, d)
            for token, p in zip(ranked, self.probabilities(ranked, position), strict=True):
                logits[d - 1, token] = np.log(p)
        return logits

    # --8<-- [start:noisy_ranking]
    def noisy_ranking(self, position: int, depth: int) -> list[int]:
        truth = self.true_token(position)
        rng = _position_rng(self.seed + 1, position * 64 + depth)
        others = [int(t) for t in rng.permutation(self.vocab_size)[: self.runners_up + 2] if t != truth]
        ranked = others[: self.runners_up + 1]
        if truth is None:
            return ranked
        if rng.random() < self.top1_rate * self.decay ** (depth - 1):
            return [truth] + ranked[: self.runners_up]
        if self.runners_up and rng.random() < self.keep_rate:
            ranked.insert(int(rng.integers(1, self.runners_up + 1)), truth)
        return ranked[: self.runners_up + 1]
    # --8<-- [end:noisy_ranking]

    def probabilities(self, ranked: list[int], position: int) -> list[float]:
        shares = 0.5 ** np.arange(len(ranked) - 1)
        runners = (self.runner_up_mass * shares / shares.sum()).tolist() if len(ranked) > 1 else []
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
    def votes(self, context: np.ndarray, depths: int) -> np.ndarray:
        """Weighted counts (L, V) of the tokens that followed earlier copies of the suffix."""
        n = context.size
        votes = np.zeros((depths, self.vocab_size), dtype=np.float64)           # [L, V]
        for s in range(min(self.max_ngram, n - 1), 0, -1):
            suffix = context[n - s:]
            # an occurrence ending at e (exclusive) must leave at least one following token:
            # the windows starting at 0 .. n-s-1 end at s .. n-1
            windows = np.lib.stride_tricks.sliding_window_view(context[:n - 1], s)   # [n-s, s]
            for end in np.flatnonzero((windows == suffix).all(axis=1)) + s:
                following = context[end:end + depths]                            # [<= L]
                votes[np.arange(following.size), following] += s
        return votes

    def propose(self, context_tokens, block_size: int) -> np.ndarray:
        context, depths = check_block(context_tokens, block_size, self.vocab_size)
        votes = self.votes(context, depths)                                      # [L, V]
        probs = (votes + self.smoothing) / (votes + self.smoothing).sum(-1, keepdims=True)
        return np.log(probs).astype(np.float32)                                  # [L, V]
    # --8<-- [end:ngram]


DRAFTERS = ("oracle", "noisy", "ngram")


# --8<-- [start:make_drafter]
def make_drafter(name: str, model, prompt, max_new_tokens: int, seed: int = 0, continuation=None):
    """A drafter by name for ``model``.

    The oracles need the target's greedy continuation: pass it as ``continuation`` when it is
    already known (the demo has just decoded it), otherwise they run AR once to learn it.
    """
    if name in ("oracle", "noisy"):
        kind = OracleDrafter if name == "oracle" else NoisyOracleDrafter
        if continuation is None:
            return kind.from_model(model, prompt, max_new_tokens, seed=seed)
        sequence = np.concatenate([np.asarray(prompt, np.int64), np.asarray(continuation, np.int64)])
        return kind(sequence, model.config.vocab_size, seed=seed)
    if name == "ngram":
        return NGramDrafter(model.config.vocab_size)
    raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {name!r}")
# --8<-- [end:make_drafter]
