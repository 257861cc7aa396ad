"""Equivalence: kernels/drafters.py (numba.cuda) against ddtree/drafters.py (numpy).

The device's logits must be the reference's, bit for bit: the oracles' draws are the same
integer hashes and their log-probabilities the reference's own table, the n-gram votes exact
integers. Outputs are poisoned with NaN first, so a row or token the kernels skip shows.
"""

import numpy as np
import pytest

from ddtree.drafters import NGramDrafter, NoisyOracleDrafter, OracleDrafter, keyed_state, mix, tokens_of
from kernels import drafters as kernel
from kernels.device import cuda, poisoned, to_device
from tests.helpers import assert_close, assert_exact, no_transfers
from tests.test_drafters import ORACLES, growing_contexts


def upload(host, device_array):
    device_array.copy_to_device(np.ascontiguousarray(host))


def device_propose(drafter, context, block_size, buffers=None):
    """The device drafter's (L, V) logits for ``context``, through the engine's calls."""
    context = np.asarray(context, np.int64)
    buffers = buffers or kernel.DrafterBuffers(64, 16)
    assert kernel.load(drafter, drafter.vocab_size, buffers, upload) is not None
    kernel.check_round(buffers, context.size, block_size - 1)
    committed = to_device(np.concatenate([context, np.full(3, -7, np.int64)]))   # past n: never read
    out = poisoned((block_size - 1, drafter.vocab_size))
    kernel.propose(buffers, committed, to_device(np.array([context.size], np.int64)), out=out)
    return out.copy_to_host()


def check_contexts(drafter, contexts):
    buffers = kernel.DrafterBuffers(64, 16)                       # loaded once, reused: as the engine
    for context, block_size in contexts:
        expected = drafter.propose(context, block_size)
        actual = device_propose(drafter, context, block_size, buffers)
        assert_exact(np.isnan(actual), np.zeros_like(expected, bool), "unwritten logits")
        assert_exact(actual, expected, f"logits, {len(context)} tokens, block {block_size}")


@cuda.jit
def hash_kernel(words, out):
    # one thread: the keyed numbers of the reference's tests, and tokens_of into out[4:]
    state = kernel.keyed_state(words[0], words[1], words[2])
    out[0] = state
    out[1] = kernel.mix(state, np.uint64(words[3]))
    out[2] = np.uint64(kernel.tokens_of(state, 5, 7, 3, out, 4))
    out[3] = np.uint64(kernel.uniform_of(state) * 2.0 ** 53)


def test_the_keyed_numbers_are_the_references():
    words = np.array([2 ** 62 + 12345, 987654321, 7, 3], np.int64)
    out = to_device(np.zeros(9, np.uint64))
    hash_kernel[1, 1](to_device(words), out)
    out = out.copy_to_host()
    state = keyed_state(*(int(w) for w in words[:3]))
    assert int(out[0]) == state and int(out[1]) == mix(state, 3)
    assert [int(t) for t in out[4:4 + int(out[2])]] == tokens_of(state, 5, 7, 3)
    assert int(out[3]) == state >> 11


CASES = ORACLES[:4:2] + ORACLES[5:]                                # two oracles, every noisy case


@pytest.mark.parametrize("kind, options", CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_oracles_on_the_device_are_the_references(kind, options):
    rng = np.random.default_rng(11 + options.get("seed", 0))
    sequence = rng.integers(0, options["vocab_size"], 24)
    drafter = kind(sequence, **options)
    contexts = list(growing_contexts(sequence, rng, [2, 5, 8]))
    picked = [contexts[i] for i in sorted(rng.choice(len(contexts), 3, replace=False))]
    check_contexts(drafter, picked + [(sequence[:20], 8)])       # the last rounds pass the sequence's end


def test_ngram_on_the_device_is_the_reference():
    rng = np.random.default_rng(5)
    sequence = rng.integers(0, 4, 40)                             # a small alphabet: many matches
    sequence[25:33] = sequence[5:13]
    check_contexts(NGramDrafter(48, max_ngram=3), [(sequence[:1], 4), (sequence[:2], 3), (sequence, 8),
                                                   (sequence[:33], 5)])
    check_contexts(NGramDrafter(6, max_ngram=1, smoothing=0.5), [(sequence[:30], 4)])


def test_only_the_references_own_drafters_that_fit_run_on_the_device():
    buffers = kernel.DrafterBuffers(8, 4)

    class Custom(NGramDrafter):
        pass

    assert kernel.load(Custom(16), 16, buffers, upload) is None                 # a subclass: the host
    assert kernel.load(NGramDrafter(16), 32, buffers, upload) is None           # another vocabulary
    assert kernel.load(OracleDrafter(np.arange(9), 16), 16, buffers, upload) is None   # longer than C
    assert kernel.load(OracleDrafter([1], 64, distractors=kernel.KMAX - 1), 64, buffers, upload) is None
    assert kernel.load(NoisyOracleDrafter([1, 2], 16), 16, buffers, upload) == "noisy"
    drafter = NGramDrafter(16)
    assert kernel.load(drafter, 16, buffers, upload) == "ngram"
    drafter.max_ngram = 2                                         # a changed drafter is loaded again
    assert kernel.load(drafter, 16, buffers, upload) == "ngram"
    assert buffers.ints.copy_to_host()[kernel.MAX_NGRAM] == 2


def test_an_oracle_with_nothing_to_rank_is_refused_before_the_launch():
    drafter = OracleDrafter([1, 2, 3], 8, distractors=0)
    with pytest.raises(ValueError, match="nothing to propose"):
        device_propose(drafter, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="nothing to propose"):
        drafter.propose([1, 2, 3], 2)


# ------------------------------------------------------------------------------------------------
# the block drafter: its model's forward is an engine's (kernels.model), so the device's
# log-probabilities are the reference's within the whole-model tolerance, not bit for bit


def block_forward(config, weights, rows):
    """The engine's forward for a block drafter (``Transformer.drafter_forward``)."""
    from kernels.model import Transformer

    return Transformer.drafter_forward(config, weights, rows)


def test_the_block_drafter_on_the_device_is_the_references():
    from tests.test_block_drafter import MAX_DEPTHS, WINDOW, block_drafter

    drafter = block_drafter()
    buffers = kernel.DrafterBuffers(64, 16)
    assert kernel.load(drafter, 96, buffers, upload) is None                   # no forward: the host
    assert kernel.load(drafter, 96, buffers, upload, block_forward) == "block"
    assert kernel.always_proposes(buffers)
    rng = np.random.default_rng(3)
    cases = [(rng.integers(0, 96, 2), 3), (rng.integers(0, 96, WINDOW), 2),        # padded, exact window
             (rng.integers(0, 96, 15), MAX_DEPTHS + 1)]                             # longer, deepest
    for context, block_size in cases:
        kernel.check_round(buffers, context.size, block_size - 1)
        committed = to_device(np.concatenate([context, np.full(3, -7, np.int64)]))  # past n: never read
        out, n = poisoned((block_size - 1, 96)), to_device(np.array([context.size], np.int64))
        with no_transfers():                              # device buffers only: a graph captures it
            kernel.propose(buffers, committed, n, out=out)
        actual, expected = out.copy_to_host(), drafter.propose(context, block_size)
        assert not np.isnan(actual).any(), "unwritten log-probabilities"
        assert_close(actual, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()),
                     name=f"log-probs, {context.size} tokens, block {block_size}")
        assert_exact(actual.argmax(-1), expected.argmax(-1), "each depth's top token")


def test_a_block_drafter_deeper_than_trained_is_refused_and_a_new_one_is_a_new_graph():
    from tests.test_block_drafter import MAX_DEPTHS, block_drafter

    buffers = kernel.DrafterBuffers(64, 16)
    assert kernel.load(block_drafter(), 96, buffers, upload, block_forward) == "block"
    first = buffers.graph_key
    with pytest.raises(ValueError, match=r"block_size - 1 \(5\) must be <= max_depths \(4\)"):
        kernel.check_round(buffers, 3, MAX_DEPTHS + 1)
    assert kernel.load(block_drafter(), 96, buffers, upload, block_forward) == "block"
    assert buffers.graph_key == first                                           # loaded already
    assert kernel.load(block_drafter(layers=1), 96, buffers, upload, block_forward) == "block"
    assert buffers.graph_key != first                 # another forward: graphs captured with the first differ
    assert kernel.load(block_drafter(), 32, buffers, upload, block_forward) is None  # another vocabulary
