"""Equivalence: kernels/tree.py (numba.cuda) against ddtree/tree.py (numpy).

Discrete results (tokens, parents, depths, ranks, sizes, masks) must be equal, and so must the
float32 weights, bit for bit: both sides add the same two float32 numbers for every node (the
path sum root to leaf) and break ties by the same rank-tuple rule. So everything is compared
with assert_exact, ties included, for both of the builder's kernels (``kernel.BUILD_VERSIONS``:
sorted and keyed) and top-K. The lab's builder and top-K versions are checked by tests/test_lab.py.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from numba import cuda

from ddtree import tree as reference
from kernels import tree as kernel
from kernels.device import is_device_array
from tests.helpers import assert_exact, no_transfers
from tests.test_tree import (
    BAD_INPUTS,
    ancestor_mask,
    bad_case,
    candidate_sets,
    check_tree,
    make_candidates,
    random_parents,
)

FIELDS = [field.name for field in dataclasses.fields(reference.DraftTree)]


def assert_same_tree(actual, expected):
    assert isinstance(actual, reference.DraftTree)
    for name in FIELDS:
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        assert_exact(a, e, name)


# (L, K, kind, budget): irregular sizes; ties; the heap emptying; a chain; root-only trees
CASES = [
    (3, 4, "random", 11),
    (4, 3, "equal", 17),       # equal weights per depth: the tie rule everywhere
    (3, 2, "zero", 20),        # all weights 0: pure rank-tuple order; 14 nodes, then the heap empties
    (3, 4, "repeated", 14),
    (3, 4, "neginf", 9),
    (5, 1, "random", 3),       # K = 1: a chain cut by the budget
    (2, 3, "random", 50),      # budget above the 12 possible nodes
    (3, 3, "random", 1),
    (3, 3, "random", 0),       # root only
    (0, 3, "random", 5),       # L = 0: root only
]


@pytest.mark.parametrize("version", kernel.BUILD_VERSIONS)
@pytest.mark.parametrize("depths, k, kind, budget", CASES)
def test_build_tree_matches_reference(depths, k, kind, budget, version):
    top_logprobs, top_ids = make_candidates(np.random.default_rng([depths, k, budget]), depths, k, kind)
    expected = reference.build_tree(7, top_logprobs, top_ids, budget)
    assert_same_tree(kernel.build_tree(7, top_logprobs, top_ids, budget, version=version), expected)


@pytest.mark.parametrize("version", kernel.BUILD_VERSIONS)
def test_build_trees_batch_of_different_trees(version):
    rng = np.random.default_rng(10)
    cases = [make_candidates(rng, 4, 3, kind) for kind in ("random", "equal", "repeated")]
    top_logprobs = np.stack([lp for lp, _ in cases])                         # [3, L, K]
    top_ids = np.stack([ids for _, ids in cases])
    roots = np.array([5, 0, 96])
    trees = kernel.build_trees(roots, top_logprobs, top_ids, 13, version=version)
    assert len(trees) == 3
    for b in range(3):
        assert_same_tree(trees[b], reference.build_tree(int(roots[b]), top_logprobs[b], top_ids[b], 13))


def test_heap_emptying_at_different_sizes_in_one_batch():
    rng = np.random.default_rng(11)
    chain_lp, chain_ids = make_candidates(rng, 3, 2, "random")
    chain_lp[:, 1] = -np.inf                      # rank 1 still counts as a candidate (weight -inf)
    lp2, ids2 = make_candidates(rng, 3, 2, "zero")
    trees = kernel.build_trees(np.array([1, 2]), np.stack([chain_lp, lp2]), np.stack([chain_ids, ids2]), 20)
    assert [t.size for t in trees] == [15, 15]
    for tree, (lp, ids) in zip(trees, [(chain_lp, chain_ids), (lp2, ids2)], strict=True):
        check_tree(tree, int(tree.tokens[0]), lp, ids, 20)


def max_frontier(tree: reference.DraftTree, depths: int, k: int) -> int:
    """Largest number of live candidates while building ``tree``: each pop frees one, pushes <= 2."""
    live = largest = 1
    for i in range(1, tree.size):
        live += -1 + int(tree.ranks[i] + 1 < k) + int(tree.depths[i] < depths)
        largest = max(largest, live)
    return largest


@pytest.mark.parametrize("version", kernel.BUILD_VERSIONS)
def test_strided_frontier_scan(version):
    # all 40 depth-1 tokens outweigh every depth-2 one: the frontier grows to 40 entries for 32
    # threads, so threads merge two gaps each; then 40 tied depth-2 candidates
    rng = np.random.default_rng(12)
    top_logprobs = np.array([[-0.1] * 40, [-5.0] * 40], np.float32)
    top_ids = np.stack([rng.permutation(100)[:40] for _ in range(2)])
    expected = reference.build_tree(3, top_logprobs, top_ids, 45)
    assert max_frontier(expected, 2, 40) > 32
    out = kernel.TreeBatch(*(cuda.device_array((1, 46), np.int64) for _ in range(4)),
                           logprobs=cuda.device_array((1, 46), np.float32),
                           sizes=cuda.device_array(1, np.int64))
    out = kernel.build_trees_device(np.array([3]), top_logprobs[None], top_ids[None], 45, threads=32, out=out,
                                    version=version)
    assert_same_tree(kernel.trees_from_batch(out)[0], expected)


@pytest.mark.parametrize("version", kernel.BUILD_VERSIONS)
def test_every_output_element_is_written(version):
    # prefill with values the kernel never writes: any survivor is an unwritten element
    rng = np.random.default_rng(13)
    cases = [make_candidates(rng, 3, 3, kind) for kind in ("random", "zero")]
    lp, ids = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases])
    budget, shape = 12, (2, 13)
    out = kernel.TreeBatch(*(cuda.to_device(np.full(shape, 7777, np.int64)) for _ in range(4)),
                           logprobs=cuda.to_device(np.full(shape, np.nan, np.float32)),
                           sizes=cuda.to_device(np.full(2, 7777, np.int64)))
    assert kernel.build_trees_device(np.array([1, 2]), lp, ids, budget, out=out, version=version) is out
    host = {name: array.copy_to_host() for name, array in out._asdict().items()}
    for name, array in host.items():
        assert not np.any(array == 7777) and not np.isnan(array).any(), f"{name} has unwritten elements"
    sizes = host["sizes"]
    assert sizes[1] == 13 and sizes[0] == reference.build_tree(1, lp[0], ids[0], budget).size
    pad = np.arange(13)[None] >= sizes[:, None]                              # [2, W] padding slots
    assert np.all(host["tokens"][pad] == 0) and np.all(host["parents"][pad] == -1)
    assert np.all(host["depths"][pad] == 0) and np.all(host["ranks"][pad] == -1)
    assert np.all(np.isneginf(host["logprobs"][pad]))


def test_build_is_deterministic():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(14), 4, 3, "equal")
    first = kernel.build_tree(0, top_logprobs, top_ids, 16)
    assert_same_tree(kernel.build_tree(0, top_logprobs, top_ids, 16), first)


def test_device_inputs_give_device_outputs():
    rng = np.random.default_rng(15)
    cases = [make_candidates(rng, 3, 3) for _ in range(2)]
    lp, ids = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases])
    batch = kernel.build_trees_device(cuda.to_device(np.array([4, 5])), cuda.to_device(lp),
                                      cuda.to_device(ids), 6)
    assert all(is_device_array(array) for array in batch)
    assert batch.tokens.shape == (2, 7)
    for b, tree in enumerate(kernel.trees_from_batch(batch)):
        assert_same_tree(tree, reference.build_tree(4 + b, lp[b], ids[b], 6))
    assert_same_tree(kernel.build_tree(4, cuda.to_device(lp[0]), cuda.to_device(ids[0]), 6),
                     reference.build_tree(4, lp[0], ids[0], 6))
    with pytest.raises(ValueError, match="float32/int64"):
        kernel.build_trees_device(np.array([4]), cuda.to_device(lp[:1].astype(np.float64)),
                                  cuda.to_device(ids[:1]), 6)


def test_builder_versions_agree_with_global_log_probs(monkeypatch):
    # the builder copies the log-probs to shared memory when min(L, B) x min(K, B + 1) fits
    # (TREE_STAGE_FLOATS) and reads them from global memory otherwise: force the second path
    rng = np.random.default_rng(22)
    cases = [make_candidates(rng, 4, 5, kind) for kind in ("random", "repeated", "zero")]
    lp, ids = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases])
    roots = np.array([1, 2, 3])
    assert kernel.staged_shape(4, 5, 18) == (4, 5) and kernel.staged_shape(15, 1024, 1024) == (0, 0)
    monkeypatch.setattr(kernel, "staged_shape", lambda *dims: (0, 0))
    for b, tree in enumerate(kernel.build_trees(roots, lp, ids, 18, version=2)):
        assert_same_tree(tree, reference.build_tree(int(roots[b]), lp[b], ids[b], 18))


def test_device_inputs_and_out_allocate_and_copy_nothing():
    rng = np.random.default_rng(21)
    cases = [make_candidates(rng, 3, 4) for _ in range(2)]
    lp, ids = np.stack([c[0] for c in cases]), np.stack([c[1] for c in cases])
    inputs = (cuda.to_device(np.array([4, 5])), cuda.to_device(lp), cuda.to_device(ids))
    shape = (2, 8)                                                            # [Bq, W], budget 7
    out = kernel.TreeBatch(*(cuda.to_device(np.zeros(shape, np.int64)) for _ in range(4)),
                           logprobs=cuda.to_device(np.zeros(shape, np.float32)),
                           sizes=cuda.to_device(np.zeros(2, np.int64)))
    vis = cuda.to_device(np.zeros((2, 8, 8), bool))
    with no_transfers():
        for version in kernel.BUILD_VERSIONS:
            assert kernel.build_trees_device(*inputs, 7, out=out, stream=cuda.default_stream(),
                                             version=version) is out
        assert kernel.visibility(out.parents, out=vis, stream=cuda.default_stream()) is vis
    trees = kernel.trees_from_batch(out)
    for b in range(2):
        assert_same_tree(trees[b], reference.build_tree(4 + b, lp[b], ids[b], 7))
    assert_exact(vis.copy_to_host(), reference.visibility(out.parents.copy_to_host()))
    with pytest.raises(ValueError, match=r"out.sizes must be int64 of shape \(2,\)"):
        kernel.build_trees_device(*inputs, 7, out=out._replace(sizes=cuda.to_device(np.zeros(3, np.int64))))


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise_like_the_reference(name):
    with pytest.raises(ValueError, match=BAD_INPUTS[name]):
        kernel.build_tree(*bad_case(name))


def test_budget_limit():
    lp, ids = make_candidates(np.random.default_rng(16), 2, 2)
    limit = r"budget must be an integer in \[0, 1024\] \(MAX_TREE_NODES - 1: the GPU builder keeps the tree"
    for budget in (kernel.MAX_TREE_NODES, -1):
        with pytest.raises(ValueError, match=limit + rf" in shared memory\), got {budget}"):
            kernel.build_tree(0, lp, ids, budget)
    assert kernel.build_tree(0, lp, ids, kernel.MAX_TREE_NODES - 1).size == 7     # every candidate
    with pytest.raises(ValueError, match="root_tokens"):
        kernel.build_trees(np.array([1, 2]), lp[None], ids[None], 3)
    with pytest.raises(ValueError, match=r"version must be one of \(2, 3\), got 1"):
        kernel.build_tree(0, lp, ids, 3, version=1)
    with pytest.raises(ValueError, match="version 3 needs budget <= 256"):
        kernel.build_tree(0, lp, ids, kernel.MAX_KEYED_BUDGET + 1, version=3)


def test_version_3_keys_fit_where_its_tables_do():
    # base: the reachable ranks + 1, min(K, B + 1) + 1; digits per int64 word: base^D < 2^62
    assert kernel.key_shape(7, 32, 32) == (33, 12) and 33 ** 12 < 2 ** 62 <= 33 ** 13
    assert kernel.key_shape(15, 512, 64) == (66, 10)                  # L = 15 <= 2 x 10 digits
    assert kernel.key_shape(40, 64, 64) == (0, 0)                     # 40 depths > 2 x 10
    assert kernel.key_shape(7, 32, kernel.MAX_KEYED_BUDGET + 1) == (0, 0)
    assert kernel.key_shape(3, 1, 5) == (2, 61)                       # one rank: base 2
    assert kernel.key_shape(3, 2, 0) == (0, 0)                        # no tree to key


@settings(max_examples=6, deadline=None)
@given(candidate_sets())
def test_property_matches_reference(case):
    top_logprobs, top_ids, budget = case
    expected = reference.build_tree(3, top_logprobs, top_ids, budget)
    for version in kernel.BUILD_VERSIONS:
        assert_same_tree(kernel.build_tree(3, top_logprobs, top_ids, budget, version=version), expected)


# ----------------------------------------------------------------------------------------------
# visibility

@pytest.mark.parametrize("size, padding", [(1, 0), (5, 2), (19, 0)])
def test_visibility_matches_reference(size, padding):
    parents = random_parents(np.random.default_rng(size), size, padding)
    vis = kernel.visibility(parents)
    assert isinstance(vis, np.ndarray) and vis.dtype == np.bool_
    assert_exact(vis, reference.visibility(parents))
    assert_exact(vis, ancestor_mask(parents))


def test_visibility_batch_device_and_every_element_written():
    rng = np.random.default_rng(17)
    batch = np.stack([random_parents(rng, 6, 3), random_parents(rng, 9)])
    expected = reference.visibility(batch)
    assert_exact(kernel.visibility(batch), expected)
    device_vis = kernel.visibility(cuda.to_device(batch))
    assert is_device_array(device_vis)
    assert_exact(device_vis.copy_to_host(), expected)
    assert_exact(kernel.visibility(cuda.to_device(batch[1])).copy_to_host(), expected[1])
    for fill in (True, False):                    # both prefills give the same mask: all written
        out = cuda.to_device(np.full((2, 9, 9), fill))
        assert_exact(kernel.visibility(cuda.to_device(batch), out=out).copy_to_host(), expected)
    with pytest.raises(ValueError, match="parents"):
        kernel.visibility(np.array([-1, 1]))


# ----------------------------------------------------------------------------------------------
# the real GPU: the engine's sizes

def check_batch_against_reference(requests, depths, vocab, k, budget, seed):
    rng = np.random.default_rng(seed)
    lp, ids = zip(*(reference.top_candidates(rng.standard_normal((depths, vocab)).astype(np.float32) * 3, k)
                    for _ in range(requests)), strict=True)
    lp, ids = np.stack(lp), np.stack(ids)
    roots = rng.integers(0, vocab, requests)
    expected = [reference.build_tree(int(roots[b]), lp[b], ids[b], budget) for b in range(requests)]
    keyed = kernel.key_shape(depths, k, budget) != (0, 0)                 # version 3 only where it fits
    for version in kernel.BUILD_VERSIONS if keyed else (2,):
        trees = kernel.build_trees(roots, lp, ids, budget, version=version)
        for b in range(requests):
            assert_same_tree(trees[b], expected[b])
    return trees


def test_batch_from_top_candidates_small():
    check_batch_against_reference(requests=2, depths=3, vocab=40, k=5, budget=9, seed=18)


@pytest.mark.gpu
def test_build_trees_engine_size():
    check_batch_against_reference(requests=64, depths=15, vocab=4096, k=256, budget=256, seed=19)


@pytest.mark.gpu
def test_build_trees_issue_size():
    # the issue's target: L = 15, budget 64, 64 requests (K = budget, as the engine runs it)
    check_batch_against_reference(requests=64, depths=15, vocab=4096, k=64, budget=64, seed=23)


@pytest.mark.gpu
def test_build_trees_max_budget():
    check_batch_against_reference(requests=4, depths=15, vocab=4096, k=1024, budget=kernel.MAX_TREE_NODES - 1,
                                  seed=20)


# ------------------------------------------------------------------------------- top candidates

def assert_same_top(actual, expected):
    """Log-probs bit for bit (compared as int32 bits: -inf and -0.0 included), ids exactly."""
    assert actual[0].dtype == np.float32 and actual[1].dtype == np.int64
    assert_exact(actual[0].view(np.int32), expected[0].view(np.int32), "top_logprobs bits")
    assert_exact(actual[1], expected[1], "top_ids")


@pytest.mark.parametrize("depths, vocab, k", [(3, 37, 5), (2, 70, 1), (1, 9, 9)])
def test_top_candidates_match_numpy_exactly(depths, vocab, k):
    logits = np.random.default_rng(vocab).normal(0, 3, (depths, vocab)).astype(np.float32)
    logits[0, 4] = logits[0, 7] = logits[0].max() + 1                   # a tie at the top: lower id first
    if vocab > 20:
        logits[-1, 10:20] = -np.inf                                      # masked tokens sort last, by id
    assert_same_top(kernel.top_candidates(logits, k), reference.top_candidates(logits, k))


def tied_logits(rng, depths, vocab):
    """Logits drawn from a handful of values (-inf included): exact ties everywhere."""
    logits = rng.choice(np.array([2.0, 0.5, 0.0, -1.5, -np.inf], np.float32), (depths, vocab))
    logits[:, rng.integers(vocab)] = 2.0                                 # a finite value per row
    return logits


# (vocab, k, chunk, kind): V < chunk, V not a power of two, K = 1, K = V, V = chunk + 37 (the
# streamed tiles), rising logits (every tile beats the running K-th: the buffer refills and is
# re-sorted again and again), K = chunk / 2 with V > chunk (the streamed tiles are one token
# long), a drafter's row (every token at one floor but a few above it)
TOP_CASES = [
    (37, 5, None, "tied"),
    (50, 1, None, "tied"),
    (23, 23, None, "tied"),
    (69, 7, 32, "tied"),
    (69, 16, 32, "normal"),
    (69, 1, 32, "tied"),
    (45, 3, 8, "rising"),
    (21, 8, 16, "normal"),
    (96, 16, None, "floor"),
    (96, 16, 32, "floor"),
]


@pytest.mark.parametrize("vocab, k, chunk, kind", TOP_CASES)
def test_top_candidates_versions_exact_with_ties_and_chunks(vocab, k, chunk, kind):
    rng = np.random.default_rng([vocab, k])
    if kind == "tied":
        logits = tied_logits(rng, 2, vocab)
    elif kind == "floor":
        logits = np.full((2, vocab), -3.0, np.float32)
        logits[:, rng.choice(vocab, 5, replace=False)] = rng.normal(0, 1, 5).astype(np.float32)
    elif kind == "rising":
        logits = np.tile(np.linspace(-4, 4, vocab, dtype=np.float32), (2, 1))
        logits[1, ::3] = logits[1, 0]                                    # and ties with the first token
    else:
        logits = rng.normal(0, 3, (2, vocab)).astype(np.float32)
    out = (cuda.to_device(np.full((2, k), np.nan, np.float32)),             # poisoned: all must be written
           cuda.to_device(np.full((2, k), -7, np.int64)))
    kernel.top_candidates(cuda.to_device(logits), k, out=out, chunk=chunk)
    assert_same_top((out[0].copy_to_host(), out[1].copy_to_host()), reference.top_candidates(logits, k))


def test_top_candidates_sort_buffer():
    assert [kernel.sort_slots(v) for v in (1, 9, 512, 4096, 163840)] == [1, 16, 512, 4096, kernel.TOPK_CHUNK]
    assert kernel.sort_slots(69, 32) == 32
    with pytest.raises(ValueError, match=r"chunk must be None or a power of two in \[4, 4096\], got 48"):
        kernel.top_candidates(np.zeros((1, 64), np.float32), 3, chunk=48)
    # a row longer than the buffer streams through it: K must leave room for a tile
    with pytest.raises(ValueError, match=r"k must be <= 8 \(half the sort buffer of 16 pairs"):
        kernel.top_candidates(np.zeros((1, 21), np.float32), 9, chunk=16)


def test_top_candidates_into_device_buffers_allocate_nothing():
    logits = np.random.default_rng(1).normal(0, 2, (2, 33)).astype(np.float32)
    d_logits = cuda.to_device(logits)
    out = (cuda.to_device(np.zeros((2, 4), np.float32)), cuda.to_device(np.zeros((2, 4), np.int64)))
    with no_transfers():
        result = kernel.top_candidates(d_logits, 4, out=out, stream=cuda.default_stream())
    assert result[0] is out[0] and result[1] is out[1]
    assert_exact(out[1].copy_to_host(), reference.top_candidates(logits, 4)[1])


def test_top_candidates_refuse_like_numpy():
    with pytest.raises(ValueError, match="k must be an integer in"):
        kernel.top_candidates(np.zeros((2, 5), np.float32), 6)
    with pytest.raises(ValueError, match="NaN"):
        kernel.top_candidates(np.full((1, 5), np.nan, np.float32), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 1024, 2048])
def test_top_candidates_kimi_vocab(k):
    # V = 163840 (Kimi): the kernel streams 40 sort buffers' worth; K = 2048 = TOPK_CHUNK / 2,
    # the largest K it streams. Rows of N(0, 3^2) logits with many exact ties
    rng = np.random.default_rng(k)
    logits = (np.round(rng.normal(0, 3, (15, 163840)) * 64) / 64).astype(np.float32)
    logits[1] = tied_logits(rng, 1, 163840)[0]
    logits[2] = np.linspace(-4, 4, 163840, dtype=np.float32)             # rising: the buffer refills
    expected = reference.top_candidates(logits, k)
    actual = kernel.top_candidates(cuda.to_device(logits), k)
    assert_same_top((actual[0].copy_to_host(), actual[1].copy_to_host()), expected)


def test_positions_and_paths_walk_the_parents():
    parents = np.array([-1, 0, 0, 1, 3, -1], np.int64)                  # the last row is padding
    depths = np.array([0, 1, 1, 2, 3, 0], np.int64)
    positions = cuda.to_device(np.full(6, -7, np.int64))
    paths = cuda.to_device(np.full((6, 6), -7, np.int64))
    kernel.positions_and_paths(cuda.to_device(parents), cuda.to_device(depths),
                               cuda.to_device(np.array([40], np.int64)), positions=positions, paths=paths)
    assert_exact(positions.copy_to_host(), 40 + depths)
    table = paths.copy_to_host()
    for i, chain in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 3, 4], [5]]):
        assert_exact(table[i, :len(chain)], np.array(chain))


def test_positions_and_paths_match_the_numpy_twin():
    """The kernel against ``ddtree.tree.positions_and_paths`` on a tree of 9 rows with padding
    rows at its end: the same positions, the same path of every row up to its depth."""
    parents = np.array([-1, 0, 0, 1, 1, 2, 4, -1, -1], np.int64)
    depths = np.array([0, 1, 1, 2, 2, 2, 3, 0, 0], np.int64)
    expected_positions, expected_paths = reference.positions_and_paths(parents, depths, 17)
    positions = cuda.to_device(np.full(9, -7, np.int64))
    paths = cuda.to_device(np.full((9, 4), -7, np.int64))
    kernel.positions_and_paths(cuda.to_device(parents), cuda.to_device(depths),
                               cuda.to_device(np.array([17], np.int64)), positions=positions, paths=paths)
    assert_exact(positions.copy_to_host(), expected_positions)
    table = paths.copy_to_host()
    for i, depth in enumerate(depths):
        assert_exact(table[i, :depth + 1], expected_paths[i, :depth + 1], name=f"path of row {i}")
        assert (expected_paths[i, depth + 1:] == -1).all()

