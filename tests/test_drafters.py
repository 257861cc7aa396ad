import numpy as np
import pytest

from ddtree.drafters import (
    KEEP,
    RANK,
    TOKENS,
    TOP1,
    NGramDrafter,
    NoisyOracleDrafter,
    OracleDrafter,
    keyed_state,
    mix,
    tokens_of,
    uniform_of,
)


def test_oracle_ranks_the_true_continuation_first():
    sequence = np.arange(10, 30)
    drafter = OracleDrafter(sequence, 64)
    logits = drafter.propose(sequence[:6], 5)                       # root at position 5
    assert logits.shape == (4, 64) and logits.dtype == np.float32
    assert logits.argmax(-1).tolist() == [16, 17, 18, 19]
    past_the_end = drafter.propose(sequence, 3)                     # no truth known: distractors only
    assert np.isfinite(past_the_end).all()


def test_noisy_oracle_is_seeded_and_leaves_the_chain():
    sequence = np.arange(100) % 50
    a = NoisyOracleDrafter(sequence, 50, seed=3)
    b = NoisyOracleDrafter(sequence, 50, seed=3)
    assert np.array_equal(a.propose(sequence[:20], 9), b.propose(sequence[:20], 9))
    hits = [a.propose(sequence[:n], 9).argmax(-1) == sequence[n:n + 8] for n in range(1, 80)]
    rate = np.mean(hits, axis=0)
    assert 0.2 < rate[0] < 1.0 and rate[-1] < rate[0]             # mistakes, more of them deeper


def test_noisy_oracle_validates():
    with pytest.raises(ValueError, match="top1_rate"):
        NoisyOracleDrafter([1, 2], 8, top1_rate=1.5)


def test_mix_is_splitmix64():
    """mix(0, 0) and mix(golden, 0) are splitmix64's first two outputs from seed 0."""
    assert mix(0, 0) == 0xE220A8397B1DCDAF
    assert mix(0x9E3779B97F4A7C15, 0) == 0x6E789E6AA1B965F4


def test_keyed_tokens_are_distinct_uniform_and_capped():
    for vocab, exclude in ((8, 3), (8, None), (3, 1), (2, 0), (1, None)):
        for position in range(50):
            tokens = tokens_of(keyed_state(7, position, 0, TOKENS), 5, vocab, exclude)
            assert len(tokens) == min(5, vocab - (exclude is not None))       # capped by what is left
            assert len(set(tokens)) == len(tokens) and exclude not in tokens
            assert all(0 <= t < vocab for t in tokens)
            assert tokens == tokens_of(keyed_state(7, position, 0, TOKENS), 5, vocab, exclude)   # pure
    firsts = np.bincount([tokens_of(keyed_state(1, p, 0, TOKENS), 1, 8, None)[0] for p in range(16000)],
                         minlength=8)
    assert np.abs(firsts / 2000 - 1).max() < 0.08                          # each of 8 tokens ~1/8
    u = np.array([uniform_of(keyed_state(2, p, 1, TOP1)) for p in range(20000)])
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert abs(np.mean(u < 0.3) - 0.3) < 0.015


def test_a_key_folds_in_word_by_word():
    """A (position, depth)'s prefix state, mixed with a use, is the state of the whole key."""
    for key in ((0, 5, 1), (3, 2**40, 7), (2**70, 0, 0)):
        for use in (TOKENS, TOP1, KEEP, RANK):
            assert mix(keyed_state(*key), use) == keyed_state(*key, use)


def test_ngram_votes_for_what_followed_the_suffix():
    context = np.array([5, 6, 7, 9, 5, 6, 7, 1, 5, 6])
    drafter = NGramDrafter(16, max_ngram=2)
    logits = drafter.propose(context, 4)                            # suffix [5, 6] seen twice before
    assert logits.argmax(-1).tolist()[0] == 7
    flat = drafter.propose(np.array([3]), 3)
    assert np.allclose(flat, flat[0, 0])                           # nothing to match: flat rows


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        NGramDrafter(8).propose([1, 2], 0)


def test_make_drafter_takes_a_known_continuation():
    from ddtree import golden
    from ddtree.config import preset
    from ddtree.drafters import make_drafter
    from ddtree.model import Transformer
    from ddtree.weights import init_weights

    config = preset("micro")
    model = Transformer(config, init_weights(config))
    prompt = golden.default_prompt("micro")
    learned = make_drafter("noisy", model, prompt, 5, seed=1)
    assert model.forward_count == 5                                  # ran AR once
    given = make_drafter("noisy", model, prompt, 5, seed=1, continuation=learned.sequence[prompt.size:])
    assert model.forward_count == 5                                  # did not run it again
    context = learned.sequence[:prompt.size]
    assert np.array_equal(given.propose(context, 4), learned.propose(context, 4))


# The straightforward implementations (as ddtree/drafters.py had them before it cached proposals
# and vectorized the n-gram votes; the oracles' keyed draws by their definition): the fast ones
# must return the same bytes.

def slow_keyed_tokens(count, vocab_size, exclude, *key):
    """tokens_of by its definition: the hashes mod V of indices 0, 1, ..., repeats and
    ``exclude`` dropped, the first ``count`` kept (enough indices for these small vocabularies)."""
    state = keyed_state(*key)
    seen = []
    for index in range(64 * vocab_size + 256):
        token = mix(state, index) % vocab_size
        if token != exclude and token not in seen:
            seen.append(token)
    return seen[:count]


def slow_uniform(*key):
    """A uniform from the whole key's state, its top 53 bits."""
    return (keyed_state(*key) >> 11) / 2.0 ** 53


def slow_oracle_ranking(drafter, position):
    truth = int(drafter.sequence[position]) if position < drafter.sequence.size else None
    others = slow_keyed_tokens(drafter.distractors, drafter.vocab_size, truth, drafter.seed, position, 0,
                               TOKENS)
    return ([truth] if truth is not None else []) + others


def slow_oracle_probabilities(drafter, ranked):
    rest = (1 - drafter.confidence) / max(len(ranked) - 1, 1)
    return [drafter.confidence] + [rest] * (len(ranked) - 1)


def slow_noisy_ranking(drafter, position, depth):
    truth = int(drafter.sequence[position]) if position < drafter.sequence.size else None
    key = (drafter.seed, position, depth)
    ranked = slow_keyed_tokens(drafter.runners_up + 1, drafter.vocab_size, truth, *key, TOKENS)
    if truth is None:
        return ranked
    if slow_uniform(*key, TOP1) < drafter.top1_rate * drafter.decay ** (depth - 1):
        return [truth] + ranked[: drafter.runners_up]
    if drafter.runners_up and slow_uniform(*key, KEEP) < drafter.keep_rate:
        ranked.insert(1 + int(slow_uniform(*key, RANK) * drafter.runners_up), truth)
    return ranked[: drafter.runners_up + 1]


def slow_noisy_probabilities(drafter, ranked):
    shares = 0.5 ** np.arange(len(ranked) - 1)
    runners = (drafter.runner_up_mass * shares / shares.sum()).tolist() if len(ranked) > 1 else []
    return [1 - drafter.runner_up_mass] + runners


def slow_oracle_propose(drafter, context, block_size):
    noisy = isinstance(drafter, NoisyOracleDrafter)
    context = np.asarray(context, dtype=np.int64)
    logits = np.full((block_size - 1, drafter.vocab_size), -30.0, dtype=np.float32)
    for d in range(1, block_size):
        position = context.size - 1 + d
        if noisy:
            ranked = slow_noisy_ranking(drafter, position, d)
            probs = slow_noisy_probabilities(drafter, ranked)
        else:
            ranked = slow_oracle_ranking(drafter, position)
            probs = slow_oracle_probabilities(drafter, ranked)
        for token, p in zip(ranked, probs, strict=True):
            logits[d - 1, token] = np.log(p)
    return logits


def slow_ngram_propose(drafter, context, block_size):
    context, depths = np.asarray(context, dtype=np.int64), block_size - 1
    n = context.size
    votes = np.zeros((depths, drafter.vocab_size), dtype=np.float64)
    for s in range(min(drafter.max_ngram, n - 1), 0, -1):
        suffix = context[n - s:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:n - 1], s)
        for end in np.flatnonzero((windows == suffix).all(axis=1)) + s:
            following = context[end:end + depths]
            votes[np.arange(following.size), following] += s
    total = votes.sum(-1, keepdims=True) + drafter.vocab_size * drafter.smoothing
    return np.log((votes + drafter.smoothing) / total).astype(np.float32)


def assert_same_bytes(fast, slow):
    assert fast.dtype == slow.dtype == np.float32 and fast.shape == slow.shape
    assert fast.tobytes() == slow.tobytes()


def growing_contexts(sequence, rng, block_sizes):
    """(context, block size) rounds as a decode run makes them: the context grows by 1..block
    tokens a round (so positions come back at smaller depths), runs past the sequence's end (no
    truth), and is sometimes proposed again unchanged."""
    n = 1
    while n < sequence.size + 12:
        block_size = int(rng.choice(block_sizes))
        context = np.resize(sequence, n)                          # past the end: the sequence again
        yield (context.tolist() if rng.random() < 0.2 else context), block_size
        if rng.random() < 0.8:
            n += int(rng.integers(1, block_size + 1))


ORACLES = [
    (OracleDrafter, dict(vocab_size=64)),
    (OracleDrafter, dict(vocab_size=64, confidence=0.6, distractors=7, seed=5)),
    (OracleDrafter, dict(vocab_size=6, distractors=5, seed=2)),          # distractors cover the vocab
    (OracleDrafter, dict(vocab_size=2, distractors=1, seed=1)),
    (NoisyOracleDrafter, dict(vocab_size=64)),
    (NoisyOracleDrafter, dict(vocab_size=64, top1_rate=0.3, decay=0.5, keep_rate=0.5, seed=9)),
    (NoisyOracleDrafter, dict(vocab_size=6, runners_up=4, seed=4)),      # runners-up cover the vocab
    (NoisyOracleDrafter, dict(vocab_size=50, runners_up=0, keep_rate=1.0)),
    (NoisyOracleDrafter, dict(vocab_size=3, runners_up=2, top1_rate=0.0, seed=7)),
]


@pytest.mark.parametrize("kind, options", ORACLES)
def test_oracle_propose_matches_the_straightforward_version(kind, options):
    rng = np.random.default_rng(len(ORACLES) + options.get("seed", 0))
    sequence = rng.integers(0, options["vocab_size"], 40)
    drafter = kind(sequence, **options)
    for context, block_size in growing_contexts(sequence, rng, [1, 2, 3, 5, 8]):
        fast = drafter.propose(context, block_size)
        assert_same_bytes(fast, slow_oracle_propose(drafter, context, block_size))
        fast[:] = 0.0                                            # the caller owns the array: no cache in it
    assert_same_bytes(drafter.propose(sequence[:7], 8), slow_oracle_propose(drafter, sequence[:7], 8))


@pytest.mark.parametrize("vocab, alphabet, max_ngram", [(512, 8, 3), (512, 64, 3), (4, 4, 1), (16, 3, 5)])
def test_ngram_propose_matches_the_straightforward_version(vocab, alphabet, max_ngram):
    rng = np.random.default_rng(vocab + alphabet + max_ngram)
    sequence = rng.integers(0, alphabet, 300)                      # small alphabets: many matches
    sequence[150:180] = sequence[40:70]                            # and a long repeat
    drafter = NGramDrafter(vocab, max_ngram=max_ngram)
    for context, block_size in growing_contexts(sequence, rng, [1, 2, 4, 8]):
        slow = slow_ngram_propose(drafter, context, block_size)
        assert_same_bytes(drafter.propose(context, block_size), slow)
    for n in (1, 2, 3, 4, 10):                                     # contexts no longer than the suffixes
        context = np.full(n, 2, dtype=np.int32)
        assert_same_bytes(drafter.propose(context, 6), slow_ngram_propose(drafter, context, 6))


def test_an_empty_ranking_is_refused():
    drafter = OracleDrafter([1, 2, 3], 8, distractors=0)          # past the end: no truth, no distractor
    with pytest.raises(ValueError):
        slow_oracle_propose(drafter, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="nothing to propose"):
        drafter.propose([1, 2, 3], 2)


@pytest.mark.parametrize("context", [[], [[1, 2]], [1.0, 2.0], [1, -1], [1, 8]])
@pytest.mark.parametrize("drafter", [OracleDrafter([1, 2, 3], 8), NoisyOracleDrafter([1, 2, 3], 8),
                                     NGramDrafter(8)], ids=["oracle", "noisy", "ngram"])
def test_bad_contexts_are_refused_by_name(drafter, context):
    with pytest.raises(ValueError, match="context_tokens must"):
        drafter.propose(np.array(context), 3)
