import numpy as np
import pytest

from ddtree.drafters import NGramDrafter, NoisyOracleDrafter, OracleDrafter


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
