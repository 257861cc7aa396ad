"""The numpy draft tree (ddtree/tree.py): builder against brute force, visibility, top candidates.

The brute force enumerates every rank tuple of at most L ranks below K, weighs it with the
float32 path sum (root to leaf, the builder's order) and sorts by (-weight, rank tuple). With
log-probs <= 0 the builder's pops must be exactly that list, in that order, cut after budget.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.tree import DraftTree, build_tree, check_budget, positions, top_candidates, visibility
from tests.helpers import assert_close, assert_exact

VOCAB = 97


# ----------------------------------------------------------------------------------------------
# shared with tests/test_pair_tree.py and tests/test_accept.py

def make_candidates(rng, depths: int, k: int, kind: str = "random", vocab: int = VOCAB):
    """(top_logprobs (L, K) float32 sorted descending, top_ids (L, K) int64 distinct per row).

    kinds: random (no ties), equal (all -0.5: every weight ties with others of its depth),
    zero (all 0.0: every candidate weighs 0, pure tie rule), repeated (a few values, many
    ties across depths), neginf (random with a -inf tail).
    """
    if kind == "random":
        values = -rng.exponential(1.0, (depths, k))
    elif kind == "equal":
        values = np.full((depths, k), -0.5)
    elif kind == "zero":
        values = np.zeros((depths, k))
    elif kind == "repeated":
        values = rng.choice([-0.25, -0.5, -1.0], (depths, k))
    elif kind == "neginf":
        values = -rng.exponential(1.0, (depths, k))
        values[:, k // 2:] = -np.inf
    else:
        raise ValueError(kind)
    top_logprobs = -np.sort(-values.astype(np.float32), axis=-1)             # descending
    top_ids = np.array([rng.permutation(vocab)[:k] for _ in range(depths)], np.int64).reshape(depths, k)
    return top_logprobs, top_ids


def brute_force(top_logprobs, budget: int):
    """Every candidate (rank tuple, float32 weight), sorted by (-weight, tuple), the first budget."""
    depths, k = top_logprobs.shape
    found = []

    def visit(path, weight):
        for rank in range(k):
            child = weight + top_logprobs[len(path), rank]                   # float32 path sum
            found.append((-float(child), path + (rank,), child))
            if len(path) + 1 < depths:
                visit(path + (rank,), child)

    if depths:
        visit((), np.float32(0.0))
    found.sort(key=lambda entry: entry[:2])
    return [(path, weight) for _, path, weight in found[:max(budget, 0)]]


def rank_paths(tree: DraftTree):
    paths = [()]
    for i in range(1, tree.size):
        paths.append(paths[tree.parents[i]] + (int(tree.ranks[i]),))
    return paths


def check_tree(tree: DraftTree, root: int, top_logprobs, top_ids, budget: int):
    """The brute-force order, plus every structural invariant of the spec."""
    expected = brute_force(top_logprobs, budget)
    assert tree.size == len(expected) + 1
    paths = rank_paths(tree)
    assert paths[1:] == [path for path, _ in expected], "pop order differs from the sorted candidates"
    assert_exact(tree.logprobs[1:], np.array([w for _, w in expected], np.float32).reshape(-1), "weights")
    assert tree.tokens[0] == root and tree.parents[0] == -1 and tree.depths[0] == 0
    assert tree.ranks[0] == -1 and tree.logprobs[0] == 0.0
    for name in ("tokens", "parents", "depths", "ranks"):
        assert getattr(tree, name).dtype == np.int64, name
    assert tree.logprobs.dtype == np.float32
    for i in range(1, tree.size):
        parent = tree.parents[i]
        assert 0 <= parent < i, "parent < child (prefix-closed: every ancestor is in the tree)"
        assert tree.depths[i] == tree.depths[parent] + 1
        assert tree.tokens[i] == top_ids[tree.depths[i] - 1, tree.ranks[i]]
        assert tree.logprobs[i] == tree.logprobs[parent] + top_logprobs[tree.depths[i] - 1, tree.ranks[i]]
    for i in range(tree.size):
        children = tree.children(i)
        assert np.unique(tree.tokens[children]).size == children.size, "siblings carry distinct tokens"
        assert_exact(tree.ranks[children], np.arange(children.size), "children are ranks 0, 1, ... in order")
    weights = tree.logprobs[1:]
    assert np.all(weights[1:] <= weights[:-1]), "pop order is non-increasing in weight"


# ----------------------------------------------------------------------------------------------
# the builder

def test_pop_order_is_by_weight_not_breadth_first():
    top_logprobs = np.array([[-0.1, -2.0], [-0.1, -0.2]], np.float32)
    top_ids = np.array([[5, 6], [7, 8]])
    tree = build_tree(3, top_logprobs, top_ids, 3)
    # (0) -0.1, (0,0) -0.2, (0,1) -0.3 all beat (1) -2.0: depth 2 before the second depth-1 token
    assert_exact(tree.tokens, [3, 5, 7, 8])
    assert_exact(tree.parents, [-1, 0, 1, 1])
    assert_exact(tree.depths, [0, 1, 2, 2])
    assert_exact(tree.ranks, [-1, 0, 0, 1])
    assert_exact(tree.logprobs, np.array([0.0, -0.1, np.float32(-0.1) + np.float32(-0.1),
                                          np.float32(-0.1) + np.float32(-0.2)], np.float32))


@pytest.mark.parametrize("kind", ["random", "equal", "zero", "repeated", "neginf"])
@pytest.mark.parametrize("depths, k", [(3, 3), (2, 4), (4, 2), (1, 5)])
@pytest.mark.parametrize("budget", [0, 1, 2, 7, 13, 100])
def test_matches_brute_force(kind, depths, k, budget):
    rng = np.random.default_rng([depths, k, budget])
    top_logprobs, top_ids = make_candidates(rng, depths, k, kind)
    tree = build_tree(11, top_logprobs, top_ids, budget)
    check_tree(tree, 11, top_logprobs, top_ids, budget)


def test_all_zero_logprobs_give_the_lexicographic_order():
    # every weight is 0: the tie rule alone orders the pops, a depth-first pre-order
    top_logprobs, top_ids = np.zeros((3, 2), np.float32), np.array([[1, 2], [3, 4], [5, 6]])
    tree = build_tree(0, top_logprobs, top_ids, 14)
    assert rank_paths(tree)[1:] == [(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 1), (0, 1, 0), (0, 1, 1),
                                    (1,), (1, 0), (1, 0, 0), (1, 0, 1), (1, 1), (1, 1, 0), (1, 1, 1)]


def test_zero_budget_gives_root_only():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(0), 3, 3)
    tree = build_tree(42, top_logprobs, top_ids, 0)
    assert tree.size == 1
    assert_exact(tree.tokens, [42])
    assert_exact(tree.parents, [-1])


@pytest.mark.parametrize("budget", [-1, -5, np.int64(-2)])
def test_negative_budget_is_refused(budget):
    top_logprobs, top_ids = make_candidates(np.random.default_rng(0), 3, 3)
    with pytest.raises(ValueError, match="budget must be an integer >= 0, got "):
        build_tree(42, top_logprobs, top_ids, budget)


def test_one_budget_rule_names_its_limit():
    assert check_budget(np.int64(7), 7, "a limit") == 7 and type(check_budget(np.int64(7))) is int
    for bad in (8, -1, True, np.bool_(True), 2.0, "3", None):
        with pytest.raises(ValueError, match=r"nodes must be an integer in \[0, 7\] \(the rows\), got "):
            check_budget(bad, 7, "the rows", name="nodes")


def test_no_depths_gives_root_only():
    tree = build_tree(42, np.zeros((0, 4), np.float32), np.zeros((0, 4), np.int64), 10)
    assert tree.size == 1 and tree.children(0).size == 0


def test_k1_is_a_chain():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(1), 5, 1)
    tree = build_tree(9, top_logprobs, top_ids, 3)                            # budget < L: cut
    assert_exact(tree.parents, [-1, 0, 1, 2])
    assert_exact(tree.tokens, [9, *top_ids[:3, 0]])
    tree = build_tree(9, top_logprobs, top_ids, 50)                           # the heap empties at L
    assert_exact(tree.parents, [-1, 0, 1, 2, 3, 4])
    assert_exact(tree.depths, np.arange(6))


def test_budget_larger_than_all_candidates_takes_them_all():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(2), 3, 3)
    tree = build_tree(1, top_logprobs, top_ids, 1000)
    assert tree.size == 1 + 3 + 9 + 27
    check_tree(tree, 1, top_logprobs, top_ids, 1000)


def test_numpy_integer_budget_and_float64_logprobs():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(3), 3, 3)
    a = build_tree(np.int64(5), top_logprobs.astype(np.float64), top_ids.astype(np.int32), np.int32(6))
    b = build_tree(5, top_logprobs, top_ids, 6)
    for field in dataclasses.fields(DraftTree):
        assert_exact(getattr(a, field.name), getattr(b, field.name), field.name)


VALUES = [0.0, -0.1, -0.2, -0.3, -0.25, -0.5, -1.0, -1.5, float("-inf")]


@st.composite
def candidate_sets(draw):
    depths = draw(st.integers(0, 3))
    k = draw(st.integers(1, 3))
    rows = [sorted(draw(st.lists(st.sampled_from(VALUES), min_size=k, max_size=k)), reverse=True)
            for _ in range(depths)]
    ids = [draw(st.permutations(range(8)))[:k] for _ in range(depths)]
    return (np.array(rows, np.float32).reshape(depths, k), np.array(ids, np.int64).reshape(depths, k),
            draw(st.integers(0, 45)))


@settings(max_examples=50, deadline=None)
@given(candidate_sets())
def test_property_matches_brute_force(case):
    top_logprobs, top_ids, budget = case
    tree = build_tree(3, top_logprobs, top_ids, budget)
    check_tree(tree, 3, top_logprobs, top_ids, budget)


def test_draft_tree_is_read_only():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(4), 2, 2)
    tree = build_tree(1, top_logprobs, top_ids, 3)
    with pytest.raises(ValueError, match="read-only"):
        tree.tokens[0] = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.tokens = np.zeros(4, np.int64)
    assert tree.size == 4
    mine = np.array([1, 2])
    copy = DraftTree(tokens=mine, parents=[-1, 0], depths=[0, 1], ranks=[-1, 0], logprobs=[0.0, -1.0])
    mine[1] = 5                                                 # the caller keeps a writable array
    assert copy.tokens[1] == 2 and copy.logprobs.dtype == np.float32 and copy.parents.dtype == np.int64
    with pytest.raises(ValueError, match="DraftTree.parents"):
        DraftTree(tokens=[1, 2], parents=[-1], depths=[0, 1], ranks=[-1, 0], logprobs=[0.0, -1.0])


GOOD_LP = np.array([[-0.1, -0.5, -2.0], [-0.3, -0.4, -0.9]], np.float32)
GOOD_IDS = np.array([[4, 1, 7], [0, 2, 9]], np.int64)


def bad_case(name):
    lp, ids, budget, root = GOOD_LP.copy(), GOOD_IDS.copy(), 4, 1
    if name == "shapes differ":
        ids = ids[:, :2]
    elif name == "k zero":
        lp, ids = lp[:, :0], ids[:, :0]
    elif name == "one dimension":
        lp, ids = lp[0], ids[0]
    elif name == "nan":
        lp[1, 2] = np.nan
    elif name == "plus inf":
        lp[0, 0] = np.inf
    elif name == "positive":
        lp[0, 0] = 0.5
    elif name == "unsorted":
        lp[1] = lp[1, ::-1]
    elif name == "float ids":
        ids = ids.astype(np.float32)
    elif name == "negative id":
        ids[1, 1] = -3
    elif name == "duplicate ids":
        ids[0, 2] = ids[0, 0]
    elif name == "float budget":
        budget = 4.0
    elif name == "bool budget":
        budget = True
    elif name == "negative root":
        root = -1
    elif name == "integer logprobs":
        lp = np.zeros((2, 3), np.int64)
    return root, lp, ids, budget


BAD_INPUTS = {
    "shapes differ": "same .*shape", "k zero": "K >= 1", "one dimension": "same .*shape",
    "nan": "NaN", "plus inf": r"\+inf", "positive": "<= 0", "unsorted": "descending",
    "float ids": "top_ids must be an integer",
    "negative id": "top_ids must be non-negative", "duplicate ids": "distinct",
    "float budget": "budget must be an integer", "bool budget": "budget must be an integer",
    "negative root": "root_token", "integer logprobs": "top_logprobs must be a float",
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise(name):
    with pytest.raises(ValueError, match=BAD_INPUTS[name]):
        build_tree(*bad_case(name))


def test_good_case_is_good():
    build_tree(*bad_case("none"))                                             # the base of bad_case


# ----------------------------------------------------------------------------------------------
# visibility and positions

def ancestor_mask(parents):
    """vis[i, j] = j is i or an ancestor of i, by walking up from i."""
    size = len(parents)
    vis = np.zeros((size, size), bool)
    for i in range(size):
        node = i
        while node >= 0:
            vis[i, node] = True
            node = parents[node]
    return vis


def random_parents(rng, size: int, padding: int = 0):
    parents = np.array([-1] + [rng.integers(0, i) for i in range(1, size)], np.int64)
    return np.concatenate([parents, np.full(padding, -1, np.int64)])


def test_visibility_matches_ancestor_walk():
    rng = np.random.default_rng(5)
    top_logprobs, top_ids = make_candidates(rng, 4, 3, "repeated")
    tree = build_tree(0, top_logprobs, top_ids, 20)
    assert_exact(visibility(tree.parents), ancestor_mask(tree.parents))
    for size in (1, 2, 9, 33):
        parents = random_parents(rng, size, padding=3)
        vis = visibility(parents)
        assert vis.dtype == np.bool_
        assert_exact(vis, ancestor_mask(parents))
    assert_exact(visibility(tree.parents)[tree.children(0)][:, 0], np.ones(tree.children(0).size, bool))


def test_visibility_padding_rows_see_only_themselves():
    vis = visibility(np.array([-1, 0, 1, -1, -1]))
    assert_exact(vis[3], [False, False, False, True, False])
    assert_exact(vis[4], [False, False, False, False, True])


def test_visibility_batch():
    rng = np.random.default_rng(6)
    batch = np.stack([random_parents(rng, 7), random_parents(rng, 4, padding=3)])
    vis = visibility(batch)
    assert vis.shape == (2, 7, 7)
    for b in range(2):
        assert_exact(vis[b], ancestor_mask(batch[b]))


@pytest.mark.parametrize("parents, match", [
    ([0, 0, 1], "parents"), ([-1, 1, 1], "parents"), ([-1, -2], "parents"), ([-1, 0, 3], "parents"),
    (np.array([-1.0, 0.0]), "integer"), (np.zeros((1, 1, 1), np.int64), "integer"), ([], "non-empty"),
])
def test_visibility_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        visibility(np.asarray(parents))


def test_positions_are_start_plus_depth():
    top_logprobs, top_ids = make_candidates(np.random.default_rng(7), 3, 2)
    tree = build_tree(0, top_logprobs, top_ids, 6)
    pos = positions(tree, 100)
    assert pos.dtype == np.int64
    assert_exact(pos, 100 + tree.depths)
    siblings = tree.children(0)
    assert np.all(pos[siblings] == 101)                                       # siblings share a position


# ----------------------------------------------------------------------------------------------
# top candidates

def test_top_candidates_matches_float64_log_softmax():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((5, 300)) * 4).astype(np.float32)
    top_logprobs, top_ids = top_candidates(logits, 17)
    assert top_logprobs.dtype == np.float32 and top_ids.dtype == np.int64
    assert top_logprobs.shape == top_ids.shape == (5, 17)
    x = logits.astype(np.float64)
    exact = x - x.max(-1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(-1, keepdims=True))
    assert_exact(top_ids, np.argsort(-x, axis=-1, kind="stable")[:, :17], "ids")     # no ties here
    # float32 log-softmax against float64: a subtraction and a cast, a few ulp of values <= ~20
    assert_close(top_logprobs, np.take_along_axis(exact, top_ids, -1), rtol=1e-5, atol=1e-6)
    assert np.all(top_logprobs <= 0) and np.all(np.diff(top_logprobs, axis=-1) <= 0)


def test_top_candidates_ties_keep_lower_ids_first():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    top_logprobs, top_ids = top_candidates(logits, 3)
    assert_exact(top_ids, [[1, 2, 4], [0, 1, 2]])
    assert top_logprobs[0, 0] == top_logprobs[0, 2]
    assert_close(top_logprobs[1], np.full(3, -np.log(5.0)), rtol=1e-6)


def test_top_candidates_masked_vocab_and_no_depths():
    logits = np.array([[0.0, -np.inf, 1.0, -np.inf]], np.float32)
    top_logprobs, top_ids = top_candidates(logits, 4)
    assert_exact(top_ids, [[2, 0, 1, 3]])
    assert np.isneginf(top_logprobs[0, 2:]).all() and np.isfinite(top_logprobs[0, :2]).all()
    top_logprobs, top_ids = top_candidates(np.zeros((0, 10), np.float32), 3)
    assert top_logprobs.shape == top_ids.shape == (0, 3)


def test_top_candidates_feed_the_builder():
    rng = np.random.default_rng(9)
    top_logprobs, top_ids = top_candidates(rng.standard_normal((4, 50)).astype(np.float32), 6)
    check_tree(build_tree(2, top_logprobs, top_ids, 30), 2, top_logprobs, top_ids, 30)


@pytest.mark.parametrize("logits, k, match", [
    (np.zeros((2, 5), np.float32), 0, "k must be"), (np.zeros((2, 5), np.float32), 6, "k must be"),
    (np.zeros((2, 5), np.float32), 2.0, "k must be"), (np.zeros(5, np.float32), 2, "2-D"),
    (np.zeros((2, 5), np.int64), 2, "float"), (np.full((1, 3), np.nan, np.float32), 2, "NaN"),
    (np.array([[0.0, np.inf]], np.float32), 1, r"\+inf"),
    (np.array([[0.0, 1.0], [-np.inf, -np.inf]], np.float32), 1, "finite"),
])
def test_top_candidates_bad_inputs(logits, k, match):
    with pytest.raises(ValueError, match=match):
        top_candidates(logits, k)
