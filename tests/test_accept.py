"""Greedy acceptance: ddtree/accept.py against a greedy oracle, and kernels/accept.py against it.

Accepted indices, lengths and bonus tokens are discrete: compared with assert_exact.
"""

import numpy as np
import pytest
from numba import cuda

from ddtree import accept as reference
from ddtree.tree import DraftTree, build_tree, top_candidates
from kernels import accept as kernel
from kernels import tree as kernel_tree
from kernels.device import is_device_array
from tests.helpers import assert_exact, no_transfers
from tests.test_tree import make_candidates

VOCAB = 97


def oracle(prefix) -> int:
    """A deterministic 'target': its greedy next token after a token sequence."""
    return int((sum((t + 1) * 31 ** i for i, t in enumerate(prefix)) * 2654435761) % VOCAB)


def path_tokens(tree: DraftTree, node: int):
    tokens = []
    while node >= 0:
        tokens.append(int(tree.tokens[node]))
        node = tree.parents[node]
    return tokens[::-1]


def oracle_posterior(tree: DraftTree, context=(5, 6)) -> np.ndarray:
    """posterior[i] = the oracle's choice after context + path root..i: what verification returns."""
    return np.array([oracle([*context, *path_tokens(tree, i)]) for i in range(tree.size)], np.int64)


def steered_tree(rng, depths=4, k=3, budget=20, follow=3, context=(5, 6)):
    """A tree whose top-ranked tokens agree with the oracle for the first ``follow`` depths."""
    top_logprobs, top_ids = make_candidates(rng, depths, k, "random")
    prefix = [*context, 11]
    for d in range(min(follow, depths)):
        token = oracle(prefix)
        row = list(top_ids[d])
        if token in row:
            row.remove(token)
        top_ids[d] = [token, *row[:k - 1]]
        prefix.append(token)
    return build_tree(11, top_logprobs, top_ids, budget)


def check_greedy(tree, posterior, accepted, bonus):
    """The walk equals greedy decoding with the oracle until the tree stops matching."""
    assert accepted[0] == 0 and accepted.dtype == np.int64
    assert_exact(tree.depths[accepted], np.arange(accepted.size), "accepted node j has depth j")
    assert np.all(tree.parents[accepted[1:]] == accepted[:-1]), "the accepted nodes form a path"
    for j in range(1, accepted.size):
        assert tree.tokens[accepted[j]] == posterior[accepted[j - 1]]
    assert bonus == posterior[accepted[-1]]
    children = tree.children(accepted[-1])
    assert not np.any(tree.tokens[children] == bonus), "the walk stops only when no child matches"


# ----------------------------------------------------------------------------------------------
# numpy

def test_hand_example():
    # root 9 -> {1: 4, 2: 5}; 1 -> {3: 6}; 2 -> {4: 6}
    tree = DraftTree(tokens=np.array([9, 4, 5, 6, 6]), parents=np.array([-1, 0, 0, 1, 2]),
                     depths=np.array([0, 1, 1, 2, 2]), ranks=np.array([-1, 0, 1, 0, 0]),
                     logprobs=np.zeros(5, np.float32))
    accepted, bonus = reference.accept(tree, np.array([5, 0, 6, 0, 42]))
    assert_exact(accepted, [0, 2, 4])
    assert bonus == 42 and isinstance(bonus, int)
    accepted, bonus = reference.accept(tree, np.array([7, 0, 6, 0, 42]))       # no child carries 7
    assert_exact(accepted, [0])
    assert bonus == 7


@pytest.mark.parametrize("follow", [0, 1, 2, 4])
def test_walk_is_greedy_decoding(follow):
    tree = steered_tree(np.random.default_rng(follow), follow=follow)
    posterior = oracle_posterior(tree)
    accepted, bonus = reference.accept(tree, posterior)
    check_greedy(tree, posterior, accepted, bonus)
    assert accepted.size >= follow + 1                                         # steered depths accepted
    committed = [int(t) for t in tree.tokens[accepted[1:]]] + [bonus]
    expected, prefix = [], [5, 6, 11]
    for _ in committed:
        expected.append(oracle(prefix))
        prefix.append(expected[-1])
    assert committed == expected, "every committed token is the oracle's greedy choice"


def test_root_only_tree():
    tree = build_tree(3, np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int64), 4)
    accepted, bonus = reference.accept(tree, np.array([17]))
    assert_exact(accepted, [0])
    assert bonus == 17


@pytest.mark.parametrize("posterior, match", [
    (np.zeros(3, np.int64), "length"), (np.zeros((1, 5), np.int64), "length"),
    (np.zeros(5, np.float32), "integer"),
])
def test_bad_posterior(posterior, match):
    tree = steered_tree(np.random.default_rng(0), budget=4)
    with pytest.raises(ValueError, match=match):
        reference.accept(tree, posterior)
    with pytest.raises(ValueError, match=match):
        kernel.accept(tree, posterior)


# ----------------------------------------------------------------------------------------------
# kernel against numpy

@pytest.mark.parametrize("follow, budget", [(0, 9), (2, 20), (4, 20), (5, 13), (0, 0)])
def test_accept_matches_reference(follow, budget):
    tree = steered_tree(np.random.default_rng([follow, budget]), depths=5, follow=follow, budget=budget)
    posterior = oracle_posterior(tree)
    expected, expected_bonus = reference.accept(tree, posterior)
    accepted, bonus = kernel.accept(tree, posterior)
    assert_exact(accepted, expected, "accepted")
    assert bonus == expected_bonus and isinstance(bonus, int)


def padded_batch(trees, posteriors):
    width = max(t.size for t in trees) + 2                                     # extra padding columns
    tokens = np.zeros((len(trees), width), np.int64)
    parents = np.full((len(trees), width), -1, np.int64)
    posterior = np.zeros((len(trees), width), np.int64)
    for b, (tree, post) in enumerate(zip(trees, posteriors, strict=True)):
        tokens[b, :tree.size], parents[b, :tree.size] = tree.tokens, tree.parents
        posterior[b, :tree.size] = post
    return tokens, parents, np.array([t.size for t in trees], np.int64), posterior


def batch_case(seed=21):
    rng = np.random.default_rng(seed)
    trees = [steered_tree(rng, follow=f, budget=b) for f, b in ((3, 20), (0, 6), (1, 0), (4, 17))]
    return trees, [oracle_posterior(t) for t in trees]


def test_accept_batch_matches_reference_and_is_deterministic():
    trees, posteriors = batch_case()
    batch = padded_batch(trees, posteriors)
    accepted, lengths, bonus = kernel.accept_batch(*batch)
    for b, (tree, post) in enumerate(zip(trees, posteriors, strict=True)):
        expected, expected_bonus = reference.accept(tree, post)
        assert lengths[b] == expected.size and bonus[b] == expected_bonus
        assert_exact(accepted[b, :lengths[b]], expected, f"accepted[{b}]")
        assert np.all(accepted[b, lengths[b]:] == -1), "padded with -1"
    again = kernel.accept_batch(*batch)
    for first, second in zip((accepted, lengths, bonus), again, strict=True):
        assert_exact(second, first, "second run")


def test_accept_batch_writes_every_element():
    trees, posteriors = batch_case(22)
    tokens, parents, sizes, posterior = padded_batch(trees, posteriors)
    # prefill with a value the kernel never writes: any survivor is an unwritten element
    shapes = (tokens.shape, sizes.shape, sizes.shape)                        # accepted, lengths, bonus
    outs = [cuda.to_device(np.full(shape, 7777, np.int64)) for shape in shapes]
    inputs = [cuda.to_device(a) for a in (tokens, parents, sizes, posterior)]
    kernel.accept_kernel[tokens.shape[0], 32](*inputs, *outs)
    for out in outs:
        assert not np.any(out.copy_to_host() == 7777)
    expected = kernel.accept_batch(tokens, parents, sizes, posterior)
    for out, exp in zip(outs, expected, strict=True):
        assert_exact(out.copy_to_host(), exp)


def test_accept_batch_device_in_device_out():
    trees, posteriors = batch_case(23)
    batch = padded_batch(trees, posteriors)
    results = kernel.accept_batch(*(cuda.to_device(a) for a in batch))
    assert all(is_device_array(r) for r in results)
    for result, expected in zip(results, kernel.accept_batch(*batch), strict=True):
        assert_exact(result.copy_to_host(), expected)
    tree, post = trees[0], posteriors[0]
    accepted, bonus = kernel.accept(tree, cuda.to_device(post))
    assert_exact(accepted, reference.accept(tree, post)[0])


def test_accept_batch_into_out_buffers_allocates_and_copies_nothing():
    trees, posteriors = batch_case(25)
    batch = padded_batch(trees, posteriors)
    inputs = [cuda.to_device(a) for a in batch]
    shapes = (batch[0].shape, batch[2].shape, batch[2].shape)                 # accepted, lengths, bonus
    outs = tuple(cuda.to_device(np.zeros(shape, np.int64)) for shape in shapes)
    with no_transfers():
        results = kernel.accept_batch(*inputs, out=outs, stream=cuda.default_stream())
    assert all(result is out for result, out in zip(results, outs, strict=True))
    for out, expected in zip(outs, kernel.accept_batch(*batch), strict=True):
        assert_exact(out.copy_to_host(), expected)
    with pytest.raises(ValueError, match=r"out \(lengths\) must be int64"):
        kernel.accept_batch(*inputs, out=(outs[0], outs[0], outs[2]))


def test_accept_batch_bad_inputs():
    trees, posteriors = batch_case(24)
    tokens, parents, sizes, posterior = padded_batch(trees, posteriors)
    with pytest.raises(ValueError, match="sizes must lie"):
        kernel.accept_batch(tokens, parents, sizes + tokens.shape[1], posterior)
    with pytest.raises(ValueError, match="posterior must be"):
        kernel.accept_batch(tokens, parents, sizes, posterior[:, :-1])
    duplicate = tokens.copy()
    first, second = trees[0].children(0)[:2]                                  # two siblings
    duplicate[0, second] = duplicate[0, first]
    with pytest.raises(ValueError, match="distinct"):
        kernel.accept_batch(duplicate, parents, sizes, posterior)
    orphan = parents.copy()
    orphan[0, 3] = -1
    with pytest.raises(ValueError, match="only the root"):
        kernel.accept_batch(tokens, orphan, sizes, posterior)
    with pytest.raises(ValueError, match="all be host or all device"):
        kernel.accept_batch(cuda.to_device(tokens), parents, sizes, posterior)


# ----------------------------------------------------------------------------------------------
# the real GPU: the engine's sizes

def check_engine_batch(requests, depths, vocab, budget, seed):
    """Trees from the GPU builder, posteriors that walk a random path, accept_batch on device arrays."""
    rng = np.random.default_rng(seed)
    lp, ids = zip(*(top_candidates(rng.standard_normal((depths, vocab)).astype(np.float32) * 3, budget)
                    for _ in range(requests)), strict=True)
    roots = rng.integers(0, vocab, requests)
    batch = kernel_tree.build_trees_device(roots, np.stack(lp), np.stack(ids), budget)
    trees = kernel_tree.trees_from_batch(batch)
    # posterior: walk to a random child for a random number of steps, then a token (vocab) that
    # no child carries, so the walk must stop exactly there
    posterior = np.full((requests, budget + 1), vocab, np.int64)
    walked = np.zeros(requests, np.int64)
    for b, tree in enumerate(trees):
        node = 0
        for _ in range(rng.integers(0, depths + 1)):
            children = tree.children(node)
            if children.size == 0:
                break
            child = children[rng.integers(0, children.size)]
            posterior[b, node] = tree.tokens[child]
            node = child
            walked[b] += 1
    accepted, lengths, bonus = kernel.accept_batch(batch.tokens, batch.parents, batch.sizes,
                                                   cuda.to_device(posterior))
    accepted, lengths, bonus = accepted.copy_to_host(), lengths.copy_to_host(), bonus.copy_to_host()
    for b, tree in enumerate(trees):
        expected, expected_bonus = reference.accept(tree, posterior[b, :tree.size])
        assert_exact(accepted[b, :lengths[b]], expected, f"accepted[{b}]")
        assert bonus[b] == expected_bonus
    assert_exact(lengths, walked + 1, "lengths")


def test_accept_batch_engine_path_small():
    check_engine_batch(requests=3, depths=4, vocab=50, budget=12, seed=25)


@pytest.mark.gpu
def test_accept_batch_engine_size():
    check_engine_batch(requests=64, depths=15, vocab=4096, budget=256, seed=26)
