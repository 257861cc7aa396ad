"""The whole model through the numba kernels == the numpy reference (logits ~1e-4, tokens exact)."""

import functools

import numpy as np
import pytest

from ddtree import golden
from ddtree.config import preset
from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import make_drafter
from ddtree.model import Transformer
from ddtree.tree import build_tree, top_candidates, visibility
from ddtree.weights import init_weights
from tests.helpers import assert_close, assert_exact

# whole-model logits: a few hundred float32 reductions deep, summation orders differ between
# numpy's BLAS and the kernels; 1e-4 of the largest logit is the project's whole-model bound
MODEL_RTOL = 1e-4


@functools.cache
def models(name):
    config = preset(name)
    weights = init_weights(config, seed=golden.WEIGHT_SEED)
    return Transformer(config, weights, backend="numpy"), Transformer(config, weights, backend="numba")


def assert_logits_close(actual, expected):
    assert_close(actual, expected, rtol=MODEL_RTOL, atol=MODEL_RTOL * float(np.abs(expected).max()))


def random_tree(rng, root, vocab, depths=3, k=3, budget=7):
    logits = rng.normal(0, 2, (depths, vocab)).astype(np.float32)
    top_logprobs, top_ids = top_candidates(logits, k)
    return build_tree(root, top_logprobs, top_ids, budget)


def test_prefill_and_tree_verify_match():
    """A causal prefill, then one forward over a random tree under its ancestor mask.

    (Whole forwards are slow in the CUDA simulator: each of the two forwards is checked once.)
    """
    reference, kernel = models("micro")
    prompt = golden.default_prompt("micro")
    tree = random_tree(np.random.default_rng(1), int(prompt[-1]), reference.config.vocab_size)
    assert tree.size == 8 and tree.depths.max() == 3 and len(set(tree.parents.tolist())) > 2  # branches
    prefill, verify = [], []
    for model in (reference, kernel):
        cache = model.new_cache(32)
        prefill.append(model.forward(cache, prompt[:-1]))
        start = cache.length
        verify.append(model.forward(cache, tree.tokens, positions=start + tree.depths,
                                    visible=visibility(tree.parents)))
    assert_logits_close(prefill[1], prefill[0])
    assert_logits_close(verify[1], verify[0])
    assert_exact(verify[1].argmax(-1), verify[0].argmax(-1))


def test_ddtree_on_the_kernels_equals_ar():
    """Every step of a round on the kernels: tree build, verify forward, argmax, accept, compact."""
    reference, kernel = models("micro")
    prompt = golden.default_prompt("micro")
    expected = generate_ar(reference, prompt, 4)
    drafter = make_drafter("oracle", reference, prompt, 4)
    tokens, trace = generate_ddtree(kernel, prompt, 4, drafter, block_size=4, budget=6)
    assert_exact(tokens, expected)
    assert trace.verify_forwards == 1 and trace.rounds[0].tokens.size == 7


@pytest.mark.gpu
@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
def test_golden_on_the_gpu(name):
    """On hardware: AR and DDTree through every kernel reproduce the golden bundles."""
    _, kernel = models(name)
    bundle = golden.load_bundle(name)
    tokens, logits = generate_ar(kernel, bundle["prompt"], bundle["tokens"].size, return_logits=True)
    assert_exact(tokens, bundle["tokens"])
    assert_logits_close(logits, bundle["logits"])
    for drafter_name in ("oracle", "noisy", "ngram"):
        drafter = make_drafter(drafter_name, kernel, bundle["prompt"], bundle["tokens"].size)
        tokens, _ = generate_ddtree(kernel, bundle["prompt"], bundle["tokens"].size, drafter)
        assert_exact(tokens, bundle["tokens"], name=f"DDTree[{drafter_name}]")
