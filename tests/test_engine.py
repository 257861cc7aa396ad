"""The device-resident engine (kernels/model.py, kernels/decode.py) against the numpy reference.

In the CUDA simulator (CI): the engine on ``micro``, a prompt, a few AR steps and a DDTree round,
equal to numpy (logits within the whole-model bound, tokens and trees exactly). On a GPU
(``gpu``): the golden bundles for every drafter, block and budget with graphs on and off, graphs
on == off bit for bit, the cache after every round, and a 2,000-token n-gram generation.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np
import pytest
from numba import cuda

from ddtree import decode as reference_decode
from ddtree import golden
from ddtree.accept import accept
from ddtree.config import preset
from ddtree.drafters import make_drafter
from ddtree.kv_cache import CacheOverflowError, LatentKVCache, compact
from ddtree.model import Transformer as ReferenceTransformer
from ddtree.tree import tree_size
from ddtree.weights import init_weights
from kernels import decode as engine_decode
from kernels import model as engine_model
from kernels.mla import PathsPlan, paths_plan
from kernels.mla_unfused import UNFUSED_CHUNK
from kernels.model import (
    ENGINE_OPERATIONS,
    bucket_rows,
    rows_of,
)
from kernels.model import Transformer as EngineTransformer
from kernels.moe import MoEScratch
from tests.helpers import assert_close, assert_ddtree_equals, assert_exact
from tests.test_accept import oracle_posterior, steered_tree

# whole-model logits: hundreds of float32 reductions deep, in other orders than numpy's BLAS;
# 1e-4 of the largest logit is the project's whole-model bound
MODEL_RTOL = 1e-4


def assert_logits_close(actual, expected, name="logits"):
    scale = float(np.abs(expected).max())
    assert_close(actual, expected, rtol=MODEL_RTOL, atol=MODEL_RTOL * scale, name=name)


@functools.cache
def reference(name: str) -> ReferenceTransformer:
    config = preset(name)
    return ReferenceTransformer(config, init_weights(config, golden.WEIGHT_SEED))


@functools.cache
def engine(name: str, graphs: bool = True, max_tree_nodes: int = 128) -> EngineTransformer:
    return EngineTransformer(*golden.golden_model(name), graphs=graphs, max_tree_nodes=max_tree_nodes)


def assert_cache_rows_close(cache, ref_cache, name=""):
    """The engine's committed cache rows against the reference cache's: same length, rows within
    the kernels' tolerance."""
    host, rows = cache.to_host(), slice(0, cache.length)
    assert cache.length == ref_cache.length, f"{name}cache length"
    assert_close(host.latent[:, rows], ref_cache.latent[:, rows], rtol=1e-4, atol=1e-5, name=f"{name}latent")
    assert_close(host.rope[:, rows], ref_cache.rope[:, rows], rtol=1e-4, atol=1e-5, name=f"{name}rope")


def assert_cache_holds(model, ref, tokens):
    """The engine's cache holds what the reference caches for a causal forward over ``tokens``."""
    ref_cache = ref.new_cache(tokens.size + 1)
    ref.forward(ref_cache, tokens)
    assert_cache_rows_close(model.cache, ref_cache)


def assert_same_round(actual, expected, where=""):
    for field in ("start", "bonus", "committed"):
        assert getattr(actual, field) == getattr(expected, field), f"{where}{field}"
    for field in ("tokens", "parents", "depths", "accepted"):
        assert_exact(getattr(actual, field), getattr(expected, field), name=f"{where}{field}")


# ------------------------------------------------------------------------------------------------
# in the simulator: micro


def test_bucket_views_of_a_scratch_without_a_shared_expert():
    """A layer's scratch is viewed per bucket field by field; a missing shared expert stays None."""
    arrays = [np.arange(8 * (i + 1)).reshape(8, i + 1) for i in range(7)]
    scratch = MoEScratch(*arrays[:5], shared=None, lists=arrays[5], down=arrays[6])
    view = rows_of(scratch, 3)
    assert view.shared is None
    assert all(field.shape[0] == 3 for name, field in view._asdict().items() if name != "shared")


def test_buckets_and_tree_sizes():
    assert [bucket_rows(n, 64) for n in (1, 2, 3, 5, 9, 33, 64, 65)] == [1, 2, 4, 8, 16, 40, 64, 64]
    assert tree_size(3, 2, 100) == 1 + 2 + 4 + 8
    assert tree_size(0, 5, 100) == 1
    assert tree_size(60, 10, 127) == 128          # cut at the budget, not a 10^60 integer loop


def test_the_engines_budget_limit_is_its_buffers_or_the_builders():
    limit = EngineTransformer.budget_limit.fget     # only max_rows matters: no engine to build
    assert limit(types.SimpleNamespace(max_rows=128)) == (127, "max_tree_nodes - 1 of this engine")
    assert limit(types.SimpleNamespace(max_rows=2048))[0] == 1024     # the builder's shared memory




# Each simulated forward of micro is slow (this file is a large share of the suite's time), so the
# simulator tests below run as few and as narrow forwards as still reach their paths: the prompts
# are short (a 1-token prompt has no prefill), the trees have budget 3 (verify buckets of 4 rows), and the one
# prefill of each kind runs once (emit_token=True in the AR test, with a padding row;
# emit_token=False in the greedy DDTree test; the sampled and rejection tests' prefill would launch
# exactly the greedy one's: a prefill emits no token, so it never samples).
# These engines' forwards run the MoE kernels' version 3 as a block per (token, slot) pair (micro's
# experts are small).


def test_prompt_then_ar_steps_match_numpy():
    """A prompt (one bucketed forward with a padding row), then an AR step replayed on the device."""
    model, ref = engine("micro", max_tree_nodes=8), reference("micro")
    prompt = golden.default_prompt("micro")[:3]                  # 3 tokens: a bucket of 4, 1 padding row
    assert bucket_rows(prompt.size, model.max_rows) > prompt.size
    tokens, logits = engine_decode.generate_ar(model, prompt, 2, return_logits=True)
    expected_tokens, expected_logits = reference_decode.generate_ar(ref, prompt, 2, return_logits=True)
    assert_exact(tokens, expected_tokens)
    assert_logits_close(logits, expected_logits)
    assert model.cache.length == prompt.size + 1 and model.forward_count >= 2


def test_ddtree_generation_matches_numpy_round_by_round():
    """A branching round and its compaction: the same tree, path and tokens as numpy (and AR), and
    the engine's cache rows equal numpy's within the kernels' tolerance."""
    model, ref = engine("micro", max_tree_nodes=8), reference("micro")
    prompt = golden.default_prompt("micro")[:2]                  # a 1-row prefill, then the rounds
    # noisy seed 29, block 3, budget 3 (a verify bucket of 4 rows): round 1 branches and accepts the
    # root's second child (path [0, 3]), so its compaction moves a row; round 2 verifies one row
    new, options = 3, dict(block_size=3, budget=3)
    expected = reference_decode.generate_ar(ref, prompt, new)
    drafter = make_drafter("noisy", ref, prompt, new, continuation=expected, seed=29)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    wanted_tokens, wanted = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert_exact(wanted_tokens, expected)
    assert len(trace.rounds) == len(wanted.rounds) >= 2
    for actual_round, wanted_round in zip(trace.rounds, wanted.rounds, strict=True):
        assert_same_round(actual_round, wanted_round)
    first = trace.rounds[0]
    assert first.tokens.size > 3 and len(set(first.parents.tolist())) > 2          # it branched
    assert any(np.any(r.accepted != np.arange(r.accepted.size)) for r in trace.rounds)   # a row moved
    # the rows of the whole accepted path, the last round's past the request too (AR's tokens there)
    longer = reference_decode.generate_ar(ref, prompt, new + 2)
    assert model.cache.length >= prompt.size + new - 1
    assert_cache_holds(model, ref, np.concatenate([prompt, longer])[:model.cache.length])


def test_a_round_at_the_model_s_last_positions_is_cut_as_in_the_reference():
    """Where a block's deepest node would pass ``max_position_embeddings``, the engine's round drafts
    only the depths that fit (a shape of its own), as the reference's does: the same rounds."""
    config, weights = golden.golden_model("micro")
    prompt, new = golden.default_prompt("micro")[:2], 6
    config = dataclasses.replace(config, max_position_embeddings=prompt.size + new)
    model, ref = EngineTransformer(config, weights, max_tree_nodes=8), ReferenceTransformer(config, weights)
    expected = reference_decode.generate_ar(ref, prompt, new)
    drafter = make_drafter("oracle", ref, prompt, new, continuation=expected)
    options = dict(block_size=4, budget=3)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    _, wanted = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert [r.committed for r in trace.rounds] == [4, 2]                 # the second: 3 positions left
    assert trace.rounds[-1].depths.max() == 2
    for actual_round, wanted_round in zip(trace.rounds, wanted.rounds, strict=True):
        assert_same_round(actual_round, wanted_round)
    # a round whose deepest node would pass the last position is refused, the engine as it was
    context = np.concatenate([prompt, expected])[:-1]                  # root at the last position - 1
    cache = model.new_cache()
    model.prefill(cache, context[:-1], emit_token=False)
    with pytest.raises(CacheOverflowError, match="max_position_embeddings 8"):
        engine_decode.ddtree_round(model, cache, context, drafter, 3, 3, None)   # depths 2: position 8
    assert cache.length == context.size - 1 and model.unread == 0


@pytest.mark.parametrize("seed", [0, 3])
def test_round_end_kernel_is_accept_compact_and_commit(seed):
    """``round_end_kernel`` (several blocks, each finding the walk itself; the last one to finish
    commits) against the reference's accept and compact: the path, m, the bonus, the cache
    bit for bit, P, the next root, the committed tokens, the record; arrivals back at 0."""
    rng = np.random.default_rng(seed)
    tree = steered_tree(rng, depths=4, k=3, budget=13, follow=2 + seed % 2)
    posterior = oracle_posterior(tree)
    size, width = tree.size, tree.size + 3                       # 3 padding rows, as in a bucket
    layers, rank, rope_dim, prefix, context = 3, 40, 8, 6, [4, 9, 2, 11]
    cache = LatentKVCache(layers, prefix + width + 2, rank, rope_dim)
    cache.latent[:] = rng.standard_normal(cache.latent.shape, dtype=np.float32)
    cache.rope[:] = rng.standard_normal(cache.rope.shape, dtype=np.float32)
    latent, rope = cuda.to_device(cache.latent), cuda.to_device(cache.rope)
    cache.length = prefix + width
    path, bonus_token = accept(tree, posterior)
    compact(cache, prefix, path)
    kept = path.size

    def padded(values, fill):
        return np.concatenate([values, np.full(width - len(values), fill)]).astype(np.int64)

    tokens, parents, depths = (padded(tree.tokens, 0), padded(tree.parents, -1), padded(tree.depths, 0))
    committed = cuda.to_device(np.full(32, -7, np.int64))
    committed[:len(context)] = np.array(context, np.int64)
    state = cuda.to_device(np.array([prefix, width, 0], np.int64))
    root, record = (cuda.to_device(np.full(s, -9, np.int64)) for s in ((1,), (3 + 4 * width,)))
    context_length = cuda.to_device(np.array([len(context)], np.int64))
    arrivals = cuda.to_device(np.zeros(1, np.int32))
    columns = layers * (rank + rope_dim)
    grid = -(-columns // engine_model.TPB)
    assert grid >= 2                                             # the last-arriving block is exercised
    engine_model.round_end_kernel(width)[grid, engine_model.TPB](
        state, cuda.to_device(tokens[None]), cuda.to_device(parents[None]), cuda.to_device(depths[None]),
        cuda.to_device(np.array([size], np.int64)), cuda.to_device(padded(posterior, 3)), root, committed,
        context_length, record, latent, rope, arrivals)
    assert int(root[0]) == bonus_token
    assert_exact(latent.copy_to_host(), cache.latent, "latent")
    assert_exact(rope.copy_to_host(), cache.rope, "rope")
    assert_exact(state.copy_to_host(), np.array([prefix + kept, width, 0]), "state")
    grown = [*context, *tree.tokens[path[1:]], bonus_token]
    assert int(context_length[0]) == len(grown)
    assert_exact(committed.copy_to_host()[:len(grown) + 1], np.array([*grown, -7]), "committed")
    assert_exact(record.copy_to_host(), np.concatenate([[kept, bonus_token, size], padded(path, -1),
                                                         tokens, parents, depths]), "record")
    assert int(arrivals[0]) == 0


def test_rounds_queued_behind_an_unread_round_are_the_rounds_read_one_by_one(monkeypatch):
    """With the drafter on the device, the loop launches the next round before it reads the
    current one's record, wherever the next block is certain: the rounds and tokens stay the
    reference's. The drafter's kernels read the context from the device: each round appends what
    it commits there, and a caller's context the device has not seen is uploaded first. A
    one-token prompt, block 2, budget 1: rounds of 2 rows."""
    model, ref = engine("micro", max_tree_nodes=8), reference("micro")
    prompt, new = golden.default_prompt("micro")[:1], 5
    expected = reference_decode.generate_ar(ref, prompt, new)
    drafter = make_drafter("noisy", ref, prompt, new, continuation=expected, seed=3)
    queued = []
    queue_round = model.queue_round
    monkeypatch.setattr(model, "queue_round", lambda *args: queued.append(queue_round(*args)) or queued[-1])
    options = dict(block_size=2, budget=1)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    wanted_tokens, wanted = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert_exact(wanted_tokens, expected)
    for actual_round, wanted_round in zip(trace.rounds, wanted.rounds, strict=True):
        assert_same_round(actual_round, wanted_round)
    assert any(pending is not None for pending in queued) and model.unread == 0
    # the drafter's kernels read the committed tokens there: every round appended its own (the
    # last one its whole path, past the request too)
    n = model.context_count
    assert model.buffers.context_length.copy_to_host()[0] == n >= prompt.size + new
    assert_exact(model.buffers.committed.copy_to_host()[:prompt.size + new], np.concatenate([prompt, tokens]))
    # a context the device has not seen (the first round again, from a new cache) is uploaded
    again = engine_decode.ddtree_round(model, model.new_cache(), prompt, drafter, 2, 1, None)
    assert_same_round(again, trace.rounds[0])


def test_a_run_of_ar_steps_leaves_its_tokens_in_the_device_context():
    """``launch_ar_steps`` appends its tokens to the device's context and makes the last one the root, as
    a round does, so a round may follow before the host reads them (``start_round_after``): that round
    equals the one the host launches after reading. A bad count is refused before any launch."""
    model, ref = engine("micro", max_tree_nodes=8), reference("micro")
    prompt = golden.default_prompt("micro")[:2]
    expected = reference_decode.generate_ar(ref, prompt, 4)
    drafter = make_drafter("ngram", ref, prompt, 4)
    assert model.drafts_on_device(drafter)
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        model.launch_ar_steps(model.new_cache(), prompt, 0)
    rounds = []
    for queued in (True, False):
        cache = model.new_cache()
        model.prefill(cache, prompt[:-1], emit_token=False)
        run = model.launch_ar_steps(cache, prompt, 3)
        k = reference_decode.candidates_per_depth(2, None, model.config.vocab_size)   # budget 2, block 3
        pending = model.start_round_after(cache, run, k, 2, 2) if queued else None
        assert model.context_count == 0 and model.device_root is None     # unknown until read
        tokens = model.collect_ar_steps(run)
        assert_exact(tokens, expected[:3])
        context = np.concatenate([prompt, tokens])
        assert model.context_count == context.size and model.device_root == tokens[-1]
        if queued:
            assert pending is not None and model.unread == 1
            rounds.append(engine_decode.finish_round(model, cache, pending))
        else:
            n = model.buffers.context_length.copy_to_host()[0]
            assert_exact(model.buffers.committed.copy_to_host()[:n], context)
            assert model.buffers.root.copy_to_host()[0] == tokens[-1]
            rounds.append(engine_decode.ddtree_round(model, cache, context, drafter, 3, 2, None))
    assert_same_round(*rounds)
    assert model.unread == 0


def test_sampled_ddtree_matches_numpy_ar():
    """At temperature > 0 every verify row draws its token with its position's numbers: the
    engine's DDTree equals numpy's sampled AR token for token. (The engine's sampled AR step runs
    in the GPU tests: each simulated forward costs seconds here.) A one-token prompt: no prefill,
    one verify forward."""
    model, ref = engine("micro", max_tree_nodes=8), reference("micro")
    prompt = golden.default_prompt("micro")[:1]
    options = dict(temperature=1.0, seed=5)
    expected = reference_decode.generate_ar(ref, prompt, 2, **options)
    drafter = make_drafter("oracle", ref, prompt, 2, continuation=expected)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, 2, drafter, block_size=3, budget=3,
                                                  **options)
    assert_exact(tokens, expected)
    assert trace.verify_forwards == 1 and trace.prefill_forwards == 0   # the oracle: both tokens, one round


def test_rejection_verifier_matches_numpy():
    """The sampled tree (``verifier="rejection"``): children redrawn from the drafter and verified by
    recursive rejection sampling; the engine's rounds equal the reference's, tree for tree.

    A one-token prompt (no prefill) and two rounds of 4-row verifies: round 1 rejects its depth-2
    child and draws the bonus from the residual, round 2 rejects the first child and accepts its
    sibling (path [0, 2], so the compaction moves a row); the cache after them equals numpy's."""
    model, ref = engine("micro", max_tree_nodes=8), reference("micro")
    prompt = golden.default_prompt("micro")[:1]
    new, options = 4, dict(block_size=3, budget=3, temperature=1.0, seed=7, verifier="rejection")
    drafter = make_drafter("noisy", ref, prompt, new, seed=2,                 # seed: the rounds above
                           continuation=reference_decode.generate_ar(ref, prompt, new))
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    expected, expected_trace = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    for actual, wanted in zip(trace.rounds, expected_trace.rounds, strict=True):
        assert_same_round(actual, wanted)
    later_sibling = [any(np.flatnonzero(r.parents == r.parents[a])[0] != a for a in r.accepted[1:])
                     for r in expected_trace.rounds]
    assert len(later_sibling) >= 2 and any(later_sibling)        # a first child rejected, a sibling taken
    assert_cache_holds(model, ref, np.concatenate([prompt, expected[:-1]]))   # compacted: the committed rows


@pytest.mark.parametrize("option, value", [
    ("attention_plan", PathsPlan(splits=2, heads_per_block=2)), ("attention_plan", PathsPlan(unfused=True))])
def test_engine_options_ddtree_equals_ar_and_numpy(option, value):
    """An engine option's kernels in the whole engine: attention_paths' version 3 (G = 2: micro's
    2 heads in one block, Z = 2) or version 5 (unfused GEMMs). A branching DDTree round gives the
    engine's AR tokens, which are numpy's. A one-token prompt: no prefill; two AR forwards, and one
    verify forward (one round)."""
    config = preset("micro")
    model = EngineTransformer(config, init_weights(config, golden.WEIGHT_SEED), max_tree_nodes=8,
                              **{option: value})
    assert getattr(model, option) == value
    ref = reference("micro")
    prompt = golden.default_prompt("micro")[:1]
    expected = reference_decode.generate_ar(ref, prompt, 2)
    assert_exact(engine_decode.generate_ar(model, prompt, 2), expected, name="AR tokens")
    drafter = make_drafter("noisy", ref, prompt, 2, continuation=expected, seed=26)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, 2, drafter, block_size=3, budget=3)
    assert_exact(tokens, expected, name="DDTree tokens")
    assert trace.verify_forwards == 1 and np.bincount(trace.rounds[0].parents[1:]).max() > 1   # siblings


def test_attention_plan_is_the_kernels_default():
    """The engine runs kernels.mla.paths_plan for its dims and cache, attention_paths' own default:
    micro's R = 16 and 2 heads take version 2; micro with small's and Kimi's R = 512 takes version
    5, whose scores the engine keeps (only the choice: no forward)."""
    model = engine("micro", max_tree_nodes=8)
    config, capacity = model.config, model.cache.capacity
    assert model.attention_plan == paths_plan(config.num_attention_heads, config.kv_lora_rank,
                                              config.qk_rope_head_dim, capacity)
    assert model.attention_plan.version == 2 and model.attention_scores is None
    config = dataclasses.replace(preset("micro"), kv_lora_rank=512)
    model = EngineTransformer(config, init_weights(config, 0), max_tree_nodes=8)
    assert model.attention_plan == PathsPlan(unfused=True)
    assert model.attention_scores.shape == (8 * config.num_attention_heads, model.cache.capacity)


def test_engine_refuses_bad_input_before_running():
    model = engine("micro", max_tree_nodes=8)
    prompt = golden.default_prompt("micro")
    count = model.forward_count
    with pytest.raises(ValueError, match=r"budget must be an integer in \[0, 7\] \(max_tree_nodes - 1 of"):
        engine_decode.generate_ddtree(model, prompt, 2, make_drafter("ngram", model, prompt, 2),
                                      budget=8)
    with pytest.raises(ValueError, match="tokens must lie in"):
        model.logits(np.array([1, model.config.vocab_size]))
    with pytest.raises(ValueError, match="max_tree_nodes"):
        EngineTransformer(model.config, init_weights(model.config, 0), max_tree_nodes=6)
    with pytest.raises(ValueError, match="heads_per_block must be 1, 2 or 4"):
        EngineTransformer(model.config, {}, attention_plan=PathsPlan(heads_per_block=4))   # micro: 2 heads
    cache = model.new_cache()
    with pytest.raises(CacheOverflowError):
        model.prefill(cache, np.zeros(model.config.max_position_embeddings + 1, np.int64), emit_token=False)
    assert cache.length == 0 and model.forward_count == count


# ------------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("name", golden.GOLDEN_MODELS)
def test_golden_bundles(name, graphs):
    """AR and DDTree on the engine reproduce the golden tokens: every drafter, block and budget."""
    model, bundle = engine(name, graphs), golden.load_bundle(name)
    prompt, expected = bundle["prompt"], bundle["tokens"]
    tokens, logits = engine_decode.generate_ar(model, prompt, expected.size, return_logits=True)
    assert_exact(tokens, expected)
    assert_logits_close(logits, bundle["logits"])
    assert_ddtree_equals(engine_decode, model, prompt, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
def test_graphs_on_and_off_are_bit_identical(name):
    prompt = golden.default_prompt(name)
    on = engine_decode.generate_ar(engine(name, True), prompt, 12, return_logits=True)
    off = engine_decode.generate_ar(engine(name, False), prompt, 12, return_logits=True)
    assert np.array_equal(on[0], off[0]) and np.array_equal(on[1], off[1])
    runs = []
    for graphs in (True, False):
        model = engine(name, graphs)
        drafter = make_drafter("noisy", model, prompt, 12, continuation=on[0])
        runs.append(engine_decode.generate_ddtree(model, prompt, 12, drafter, block_size=6, budget=20))
    assert np.array_equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1].rounds, runs[1][1].rounds, strict=True):
        assert_same_round(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("device_drafters", [True, False], ids=["device drafter", "host drafter"])
@pytest.mark.parametrize("drafter_name", ["noisy", "ngram"])
@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
def test_every_round_matches_numpy(name, drafter_name, device_drafters):
    """After every round: the same tree, path and cache length as numpy, cache rows within
    tolerance; the drafter's kernels in the round, or its propose on the host."""
    model, ref = engine(name), reference(name)
    model.device_drafters = device_drafters
    prompt, new = golden.default_prompt(name), 24
    expected = reference_decode.generate_ar(ref, prompt, new)
    drafter = make_drafter(drafter_name, ref, prompt, new, continuation=expected)
    ref_cache = ref.new_cache(prompt.size + new + 70)
    ref.forward(ref_cache, prompt[:-1])
    cache = model.new_cache()
    model.prefill(cache, prompt[:-1], emit_token=False)
    context = list(prompt)
    while len(context) - prompt.size < new:
        block = min(8, new - (len(context) - prompt.size))
        args = (np.array(context), drafter, block, 32, None)
        actual = engine_decode.ddtree_round(model, cache, *args)
        wanted = reference_decode.ddtree_round(ref, ref_cache, *args)
        assert_same_round(actual, wanted, where=f"round at {wanted.start}: ")
        assert_cache_rows_close(cache, ref_cache, name=f"round at {wanted.start}: ")
        context += [int(t) for t in actual.tokens[actual.accepted[1:]]] + [actual.bonus]
    assert_exact(np.array(context[prompt.size:]), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
def test_sampled_ar_matches_numpy(name):
    """On hardware: the engine's sampled AR (prompt + steps replayed on the device) equals numpy's."""
    model, ref = engine(name), reference(name)
    prompt = golden.default_prompt(name)
    for temperature, seed in ((0.3, 0), (1.0, 7), (2.0, 3)):
        assert_exact(engine_decode.generate_ar(model, prompt, 24, temperature=temperature, seed=seed),
                     reference_decode.generate_ar(ref, prompt, 24, temperature=temperature, seed=seed))


@pytest.mark.gpu
@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
def test_sampled_ddtree_equals_sampled_ar(name):
    """On hardware: DDTree == AR token for token at temperatures {0.3, 1, 2}, several seeds, every
    drafter (the oracles built from the sampled AR continuation), blocks and budgets as above."""
    model = engine(name)
    prompt = golden.default_prompt(name)
    for temperature in (0.3, 1.0, 2.0):
        for seed in (0, 7):
            expected = engine_decode.generate_ar(model, prompt, 24, temperature=temperature, seed=seed)
            for drafter_name in ("oracle", "noisy", "ngram"):
                for block, budget in ((2, 1), (4, 5), (8, 64), (16, 0)):
                    drafter = make_drafter(drafter_name, model, prompt, 24, continuation=expected)
                    tokens, _ = engine_decode.generate_ddtree(
                        model, prompt, 24, drafter, block_size=block, budget=budget, temperature=temperature,
                        seed=seed)
                    assert_exact(tokens, expected, name=f"T={temperature} seed {seed} {drafter_name} "
                                                        f"block {block} budget {budget}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", golden.GOLDEN_PRESETS)
def test_rejection_verifier_equals_numpy_on_hardware(name):
    """On hardware: the engine's sampled tree equals the reference's, round for round, across
    temperatures, seeds, drafters and block/budget pairs."""
    model, ref = engine(name), reference(name)
    prompt = golden.default_prompt(name)
    for temperature, seed in ((0.5, 0), (1.0, 7), (2.0, 3)):
        continuation = reference_decode.generate_ar(ref, prompt, 16, temperature=temperature, seed=seed)
        for drafter_name in ("noisy", "ngram"):
            for block, budget in ((4, 5), (8, 32)):
                options = dict(block_size=block, budget=budget, temperature=temperature, seed=seed,
                               verifier="rejection")
                drafter = make_drafter(drafter_name, ref, prompt, 16, continuation=continuation)
                tokens, trace = engine_decode.generate_ddtree(model, prompt, 16, drafter, **options)
                expected, expected_trace = reference_decode.generate_ddtree(ref, prompt, 16, drafter,
                                                                            **options)
                where = f"T={temperature} seed {seed} {drafter_name} block {block} budget {budget}"
                assert_exact(tokens, expected, name=where)
                for actual, wanted in zip(trace.rounds, expected_trace.rounds, strict=True):
                    assert_same_round(actual, wanted, where=where + ": ")


@pytest.mark.gpu
def test_long_ngram_generation_equals_ar():
    model = engine("tiny")
    prompt = golden.default_prompt("tiny")
    expected = engine_decode.generate_ar(model, prompt, 2000)
    drafter = make_drafter("ngram", model, prompt, 2000)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, 2000, drafter)
    assert_exact(tokens, expected)
    assert trace.verify_forwards < 2000


def assert_option_keeps_golden_and_ddtree(new: int, budget: int | None = None, **option):
    """An engine option on tiny: the golden AR tokens and logits, every drafter's DDTree tokens,
    and a ``new``-token n-gram DDTree generation (``budget``: the default when None) equal to the
    engine's own AR."""
    config, bundle = preset("tiny"), golden.load_bundle("tiny")
    model = EngineTransformer(config, init_weights(config, golden.WEIGHT_SEED), **option)
    prompt, expected = bundle["prompt"], bundle["tokens"]
    tokens, logits = engine_decode.generate_ar(model, prompt, expected.size, return_logits=True)
    assert_exact(tokens, expected)
    assert_logits_close(logits, bundle["logits"])
    assert_ddtree_equals(engine_decode, model, prompt, expected)
    expected = engine_decode.generate_ar(model, prompt, new)
    drafter = make_drafter("ngram", model, prompt, new)
    options = {} if budget is None else {"budget": budget}
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert trace.verify_forwards < new


@pytest.mark.gpu
def test_unfused_attention_engine_equals_golden_and_ar():
    """attention_paths' version 5 in the whole engine on tiny: the golden AR tokens and logits, and
    a 600-token n-gram DDTree generation equal to its own AR: past two chunks of UNFUSED_CHUNK
    keys, so the P V GEMM's chunks and the tail kernel's meet in the same rows, bit for bit."""
    assert golden.load_bundle("tiny")["prompt"].size + 600 > 2 * UNFUSED_CHUNK
    assert_option_keeps_golden_and_ddtree(600, attention_plan=PathsPlan(unfused=True))




@pytest.mark.parametrize("shared_experts", [1, 0])
def test_the_routed_experts_added_by_the_next_norm_keep_every_bit(monkeypatch, shared_experts):
    """``COMBINE_IN_NORM``: an MoE layer's routed experts added in slot order by the next norm (the next
    layer's input norm, or the final one after the last layer), not by the MoE's combine launch: the
    same logits and the same residual stream h, bit for bit, with the shared expert and without."""
    config = dataclasses.replace(preset("micro"), n_shared_experts=shared_experts)
    assert config.is_moe_layer(config.num_hidden_layers - 1)          # the final norm adds slots too
    prompt = golden.default_prompt("micro")[:4]
    results = []
    for fused in (True, False):
        monkeypatch.setattr(engine_model, "COMBINE_IN_NORM", fused)
        model = EngineTransformer(config, init_weights(config, golden.WEIGHT_SEED), max_tree_nodes=8,
                                  graphs=False)
        logits = model.logits(prompt)
        results.append((logits, model.buffers.h[:prompt.size].copy_to_host()))
    for what, fused, apart in zip(("logits", "h"), *results, strict=True):
        assert np.isfinite(fused).all()
        assert_exact(fused.view(np.uint32), apart.view(np.uint32), name=what)


def test_the_engine_launches_its_ops_table():
    """Every kernel of a forward goes through ``model.ops`` (``ENGINE_OPERATIONS``, the twin of the
    reference's ``model.ops``): an op replaced there before the first forward is what runs."""
    config = preset("micro")
    # graphs off: a captured sequence runs twice on a GPU (once to compile, once into the graph)
    model = EngineTransformer(config, init_weights(config, golden.WEIGHT_SEED), max_tree_nodes=8,
                              graphs=False)
    assert sorted(vars(model.ops)) == sorted(op for ops in ENGINE_OPERATIONS.values() for op in ops)
    calls = {}

    def counting(name, launch):
        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return launch(*args, **kwargs)
        return wrapped

    for name, launch in vars(model.ops).items():
        setattr(model.ops, name, counting(name, launch))
    prompt = golden.default_prompt("micro")[:4]
    assert_logits_close(model.logits(prompt), reference("micro").logits(prompt))
    layers = config.num_hidden_layers
    moe_layers = sum(map(config.is_moe_layer, range(layers)))
    assert calls["attention_paths"] == layers and calls["moe"] == moe_layers
    assert calls["linear"] == 3 * layers + 1                               # a_proj, q_proj, o_proj; lm_head
    assert set(calls) == set(vars(model.ops)) - {"sample"}                 # greedy: no sampling
