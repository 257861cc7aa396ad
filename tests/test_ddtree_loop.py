"""The invariant that proves the engine: DDTree == AR == golden, for every drafter and shape."""

import dataclasses
import functools

import numpy as np
import pytest

from ddtree import golden
from ddtree.budget import CostTable
from ddtree.decode import (
    MAX_BUDGET,
    candidates_per_depth,
    ddtree_round,
    generate_ar,
    generate_ddtree,
    largest_tree,
)
from ddtree.drafters import DRAFTERS, NGramDrafter, OracleDrafter, make_drafter
from ddtree.kv_cache import CacheOverflowError
from ddtree.model import Transformer
from ddtree.tree import build_tree, top_candidates
from tests.helpers import assert_exact


@functools.cache
def model_for(name):
    return Transformer(*golden.golden_model(name))


@functools.cache
def ar_continuation(name, new_tokens):
    """The model's AR continuation of the bundle's prompt: what make_drafter would run once per
    oracle or noisy drafter without ``continuation`` (OracleDrafter.from_model, tested in
    tests/test_drafters.py), run once per preset for the whole grid."""
    return generate_ar(model_for(name), golden.load_bundle(name)["prompt"], new_tokens)


@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
@pytest.mark.parametrize("drafter_name", DRAFTERS)
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("budget", [0, 1, 5, 64])
def test_ddtree_equals_ar_equals_golden(name, drafter_name, block_size, budget):
    model, bundle = model_for(name), golden.load_bundle(name)
    prompt, expected = bundle["prompt"], bundle["tokens"]
    drafter = make_drafter(drafter_name, model, prompt, expected.size,
                           continuation=ar_continuation(name, expected.size))
    tokens, trace = generate_ddtree(model, prompt, expected.size, drafter, block_size=block_size,
                                    budget=budget)
    assert_exact(tokens, expected, name="DDTree tokens")
    assert trace.committed_tokens == expected.size
    assert all(1 <= r.committed <= block_size for r in trace.rounds)
    if budget == 0 or block_size == 1:
        assert trace.verify_forwards == expected.size                    # one AR token per round


@pytest.mark.parametrize("name", golden.GOLDEN_MODELS)
def test_ar_equals_golden(name):
    bundle = golden.load_bundle(name)
    assert_exact(generate_ar(model_for(name), bundle["prompt"], bundle["tokens"].size), bundle["tokens"])


def test_oracle_commits_eight_tokens_per_forward():
    model, bundle = model_for("tiny"), golden.load_bundle("tiny")
    drafter = OracleDrafter(np.concatenate([bundle["prompt"], bundle["tokens"]]), model.config.vocab_size)
    tokens, trace = generate_ddtree(model, bundle["prompt"], 24, drafter, block_size=8, budget=32)
    assert_exact(tokens, bundle["tokens"])
    assert trace.verify_forwards == 3 and trace.prefill_forwards == 1
    assert trace.tokens_per_forward == 8.0
    assert [r.committed for r in trace.rounds] == [8, 8, 8]


def test_the_last_round_drafts_a_full_block_and_drops_what_passes_the_request():
    """With fewer tokens than a block left, a round drafts as any other (one shape per budget: one
    CUDA graph in the engine); the tokens past the request are dropped, and its record counts the
    tokens kept."""
    model, bundle = model_for("tiny"), golden.load_bundle("tiny")
    drafter = OracleDrafter(np.concatenate([bundle["prompt"], bundle["tokens"]]), model.config.vocab_size)
    tokens, trace = generate_ddtree(model, bundle["prompt"], 20, drafter, block_size=8, budget=32)
    assert_exact(tokens, bundle["tokens"][:20])
    assert [r.committed for r in trace.rounds] == [8, 8, 4]
    last = trace.rounds[-1]
    assert last.depths.max() == 7 and last.accepted.size == 8       # a whole block drafted and accepted


def test_a_round_stops_at_the_model_s_last_position():
    """Where a block's deepest node would pass ``max_position_embeddings``, the round drafts only the
    depths that fit; a round cut short that way is not observed by ``budget="auto"``."""
    config, weights = golden.golden_model("tiny")
    prompt = golden.load_bundle("tiny")["prompt"]
    model = Transformer(dataclasses.replace(config, max_position_embeddings=prompt.size + 20), weights)
    expected = generate_ar(model, prompt, 20)
    drafter = OracleDrafter(np.concatenate([prompt, expected]), model.config.vocab_size)
    tokens, trace = generate_ddtree(model, prompt, 20, drafter, block_size=8, budget=32)
    assert_exact(tokens, expected)
    assert [r.committed for r in trace.rounds] == [8, 8, 4]
    assert trace.rounds[-1].depths.max() == 4               # its nodes at positions up to the last one
    table = CostTable(1.0, (0.5,) * 32)
    _, auto = generate_ddtree(model, prompt, 20, drafter, block_size=8, budget="auto", cost_table=table)
    assert sum(auto.acceptance.counts[1:2]) == len(auto.rounds) - 1    # the cut round: not observed


def test_single_chain_baseline_is_a_chain():
    model, bundle = model_for("tiny"), golden.load_bundle("tiny")
    drafter = make_drafter("noisy", model, bundle["prompt"], 24)
    tokens, trace = generate_ddtree(model, bundle["prompt"], 24, drafter, block_size=8, budget=64, topk=1)
    assert_exact(tokens, bundle["tokens"])
    for r in trace.rounds:
        assert_exact(r.parents, np.arange(-1, r.parents.size - 1))     # each node's parent is the previous


def test_trees_beat_the_chain_with_the_noisy_oracle():
    model, bundle = model_for("tiny"), golden.load_bundle("tiny")
    drafter = make_drafter("noisy", model, bundle["prompt"], 24)
    _, chain = generate_ddtree(model, bundle["prompt"], 24, drafter, block_size=8, budget=64, topk=1)
    _, tree = generate_ddtree(model, bundle["prompt"], 24, drafter, block_size=8, budget=64)
    assert tree.tokens_per_forward > chain.tokens_per_forward
    # the accepted path leaves the top-1 chain somewhere: some accepted node is not a first child
    left_chain = any(
        any(r.tokens[a] != r.tokens[np.flatnonzero(r.parents == r.parents[a])[0]] for a in r.accepted[1:])
        for r in tree.rounds)
    assert left_chain


# arbitrary drafters (and near-tie targets): tests/test_exactness.py


# rejected options: tests/test_errors.py (the catalogue of refused inputs)


def prefilled(name, capacity):
    model = model_for(name)
    prompt = golden.default_prompt(name)
    cache = model.new_cache(capacity)
    model.forward(cache, prompt[:-1])
    return model, prompt, cache


def assert_cache_unchanged(cache, before):
    assert cache.length == before[0]
    assert np.array_equal(cache.latent, before[1], equal_nan=True)
    assert np.array_equal(cache.rope, before[2], equal_nan=True)


class BadDrafter:
    def __init__(self, make):
        self.make = make

    def propose(self, context_tokens, block_size):
        return self.make(block_size)


@pytest.mark.parametrize("drafter, error, message", [
    (BadDrafter(lambda b: np.zeros((b, 512), np.float32)), ValueError, r"shape \(7, 512\)"),
    (BadDrafter(lambda b: np.full((b - 1, 512), np.nan, np.float32)), ValueError, "NaN"),
])
def test_bad_drafts_leave_the_cache_as_it_was(drafter, error, message):
    model, prompt, cache = prefilled("tiny", 64)
    before = (cache.length, cache.latent.copy(), cache.rope.copy())
    with pytest.raises(error, match=message):
        ddtree_round(model, cache, prompt, drafter, 8, 16, None)
    assert_cache_unchanged(cache, before)


def test_budget_larger_than_the_cache_leaves_it_as_it_was():
    model, prompt, cache = prefilled("tiny", 12)                        # 7 cached, room for 5
    before = (cache.length, cache.latent.copy(), cache.rope.copy())
    drafter = make_drafter("oracle", model, prompt, 8)
    with pytest.raises(CacheOverflowError, match="capacity 12"):
        ddtree_round(model, cache, prompt, drafter, 8, 16, None)
    assert_cache_unchanged(cache, before)


def test_out_of_range_root_leaves_the_cache_as_it_was():
    model, prompt, cache = prefilled("tiny", 64)
    before = (cache.length, cache.latent.copy(), cache.rope.copy())
    context = prompt.copy()
    context[-1] = 512
    with pytest.raises(ValueError, match=r"context_tokens must lie in \[0, vocab_size=512\)"):
        ddtree_round(model, cache, context, NGramDrafter(512), 4, 8, None)
    assert_cache_unchanged(cache, before)


@pytest.mark.parametrize("vocab", [1, 3, 5])
@pytest.mark.parametrize("topk", [None, 1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
def test_the_cache_is_sized_by_the_largest_tree(vocab, topk, block_size):
    """largest_tree is exact: flat drafts (every candidate equally likely) build trees that reach it."""
    for budget in range(0, 40, 3):
        k = candidates_per_depth(budget, topk, vocab)
        flat = np.zeros((block_size - 1, vocab), np.float32)
        tree = build_tree(0, *top_candidates(flat, k), budget)
        assert tree.size == largest_tree(block_size, budget, topk, vocab), (budget, k)


def test_a_huge_budget_with_a_narrow_tree_allocates_a_small_cache():
    model, bundle = model_for("tiny"), golden.load_bundle("tiny")
    sizes = []
    original = model.new_cache
    model.new_cache = lambda capacity=None: sizes.append(capacity) or original(capacity)
    try:
        tokens, _ = generate_ddtree(model, bundle["prompt"], 4, NGramDrafter(512), block_size=8,
                                    budget=MAX_BUDGET, topk=1)
    finally:
        del model.new_cache
    assert_exact(tokens, bundle["tokens"][:4])
    assert sizes == [bundle["prompt"].size + 4 + 8 - 1]                # a 7-node chain, not 4096 rows



def test_a_drafter_of_the_wrong_type_is_named_with_the_expected_logits():
    """Strings, or a list of the wrong length, from ``propose``: the error names the drafter's class
    and the dtype and shape a round expects, before the tree is built."""
    model, prompt = model_for("tiny"), golden.load_bundle("tiny")["prompt"]
    for make, got in ((lambda block: [["a"] * 512] * (block - 1), "got dtype <U1 shape (3, 512)"),
                      (lambda block: [[0.0] * 512] * block, "got shape (4, 512)")):
        with pytest.raises(ValueError) as error:
            generate_ddtree(model, prompt, 4, BadDrafter(make), block_size=4, budget=8)
        assert str(error.value) == ("BadDrafter.propose must return real-valued (float) drafter logits of "
                                    f"shape (3, 512) (L, V), {got}")
