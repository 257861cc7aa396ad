"""The block drafter (ddtree.drafters.BlockDrafter): its rows, its forward, its checkpoint, and the
engine's round with it on the device (kernels.drafters' block kind): DDTree == AR, and each
round's tree the reference's build of the round's own draft.

The drafter is micro's dims with both layers dense (first_k_dense_replace == num_hidden_layers:
``ModelConfig`` accepts it, and the forward has no MoE layer) and random weights; the target is
micro. A random drafter proposes badly, which is what the engine test needs: trees that branch
and paths that stop early, and still AR's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest

from ddtree import decode as reference_decode
from ddtree import golden
from ddtree.config import preset
from ddtree.drafters import (
    MASK,
    PAD,
    BlockDrafter,
    block_rows,
    load_block_drafter,
    make_drafter,
)
from ddtree.model import Transformer as ReferenceTransformer
from ddtree.tree import build_tree, top_candidates
from ddtree.weights import init_weights, save_pretrained
from tests.helpers import assert_close, assert_exact

WINDOW, MAX_DEPTHS = 6, 4


def drafter_config(layers: int = 2):
    """micro's dims, every layer dense (the default drafter architecture's shape, at micro size)."""
    return dataclasses.replace(preset("micro"), num_hidden_layers=layers, first_k_dense_replace=layers)


@functools.cache
def block_drafter(layers: int = 2, seed: int = 7) -> BlockDrafter:
    config = drafter_config(layers)
    return BlockDrafter(config, init_weights(config, seed), WINDOW, MAX_DEPTHS)


def log_softmax_by_hand(logits):
    logits = logits.astype(np.float64)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


# ------------------------------------------------------------------------------------------------
# block_rows


def test_block_rows_pads_a_short_context_and_appends_masks():
    assert block_rows([5, 7, 9], 6, 4).tolist() == [PAD, PAD, PAD, 5, 7, 9, MASK, MASK, MASK]
    assert block_rows([5, 7, 9], 4, 2, pad_token=11, mask_token=12).tolist() == [11, 5, 7, 9, 12]


def test_block_rows_keeps_the_last_window_tokens():
    context = np.arange(20, 30)
    assert block_rows(context[-5:], 5, 3).tolist() == [25, 26, 27, 28, 29, MASK, MASK]   # exactly W
    assert block_rows(context, 5, 3).tolist() == [25, 26, 27, 28, 29, MASK, MASK]        # longer
    assert block_rows(context, 3, 1).tolist() == [27, 28, 29]                            # depth 1: no mask
    assert block_rows([4], 1, 1).tolist() == [4]


@pytest.mark.parametrize("args, match", [
    (([1, 2], 0, 3), "window must be a positive integer"),
    (([1, 2], 4, 0), "depths must be a positive integer"),
    (([1, 2], 4, 2.0), "depths must be a positive integer"),
    (([], 4, 2), "context_tokens must be a non-empty 1-D integer"),
    (([[1, 2]], 4, 2), "context_tokens must be a non-empty 1-D integer"),
    (([1.5], 4, 2), "context_tokens must be a non-empty 1-D integer"),
])
def test_block_rows_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        block_rows(*args)
    with pytest.raises(ValueError, match="mask_token must be a token id"):
        block_rows([1, 2], 4, 2, mask_token=-1)


# ------------------------------------------------------------------------------------------------
# the numpy drafter


def test_propose_is_the_log_softmax_of_a_causal_forward_over_the_rows():
    drafter = block_drafter()
    context = np.array([9, 40, 3, 77, 12, 5, 61, 8, 30])                 # longer than the window
    proposal = drafter.propose(context, MAX_DEPTHS + 1)
    assert proposal.shape == (MAX_DEPTHS, 96) and proposal.dtype == np.float32
    assert_close(np.exp(proposal.astype(np.float64)).sum(-1), np.ones(MAX_DEPTHS), rtol=0, atol=1e-5,
                 name="probabilities sum to one")
    # by hand: the window's tokens at positions 0..5, three masks at 6..8, a fresh model and cache
    model = ReferenceTransformer(drafter.config, drafter.weights)
    rows = np.concatenate([context[-WINDOW:], [MASK] * (MAX_DEPTHS - 1)])
    logits = model.forward(model.new_cache(rows.size), rows)             # [9, V]
    assert_close(proposal, log_softmax_by_hand(logits[WINDOW - 1:]), rtol=0, atol=1e-5, name="log-probs")


def test_propose_pads_a_short_context_and_depends_only_on_the_window():
    drafter = block_drafter(layers=1)
    short = drafter.propose([17, 4], 3)                                 # 2 tokens: 4 pads first
    model = ReferenceTransformer(drafter.config, drafter.weights)
    logits = model.logits(np.array([PAD] * 4 + [17, 4, MASK]))
    assert_close(short, log_softmax_by_hand(logits[WINDOW - 1:]), rtol=0, atol=1e-5, name="padded")
    context = np.arange(30, 50)
    assert_exact(drafter.propose(context, 4), drafter.propose(context[-WINDOW:], 4), "beyond the window")
    assert_exact(drafter.propose(context, 4), drafter.propose(context, 4), "no state between calls")
    # causal: a shorter block's rows are the longer block's first rows (within BLAS's reordering)
    assert_close(drafter.propose(context, 2), drafter.propose(context, 5)[:1], rtol=0, atol=1e-5,
                 name="depth 1 of a deeper block")
    assert drafter.propose(context, 1).shape == (0, 96)


def test_the_block_drafter_refuses_what_it_cannot_draft():
    drafter = block_drafter()
    with pytest.raises(ValueError, match=r"block_size - 1 \(5\) must be <= max_depths \(4\)"):
        drafter.propose([1, 2, 3], MAX_DEPTHS + 2)
    with pytest.raises(ValueError, match=r"context_tokens must lie in \[0, vocab_size=96\)"):
        drafter.propose([1, 96], 3)
    config, weights = drafter.config, drafter.weights
    with pytest.raises(ValueError, match=r"pad_token must be a token id in \[0, vocab_size=96\)"):
        BlockDrafter(config, weights, WINDOW, MAX_DEPTHS, pad_token=96)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        BlockDrafter(config, weights, 0, MAX_DEPTHS)
    with pytest.raises(ValueError, match=r"window \+ max_depths - 1 \(600\) must be <= the drafter's "
                                         r"max_position_embeddings \(512\)"):
        BlockDrafter(config, weights, 597, 4)
    with pytest.raises(ValueError, match="weights are missing"):
        BlockDrafter(config, {}, WINDOW, MAX_DEPTHS)


# ------------------------------------------------------------------------------------------------
# the checkpoint


def save_drafter(directory, drafter: BlockDrafter, **overrides):
    save_pretrained(directory, drafter.config, drafter.weights)
    values = {"kind": "block", "window": drafter.window, "max_depths": drafter.max_depths,
              "pad_token_id": drafter.pad_token, "mask_token_id": drafter.mask_token, **overrides}
    (directory / "drafter.json").write_text(json.dumps(values))
    return directory


def test_a_saved_block_drafter_loads_and_proposes_the_same(tmp_path):
    drafter = block_drafter()
    loaded = load_block_drafter(save_drafter(tmp_path, drafter))
    fields = (loaded.window, loaded.max_depths, loaded.pad_token, loaded.mask_token)
    assert fields == (WINDOW, MAX_DEPTHS, PAD, MASK)
    assert loaded.config == drafter.config
    context = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    assert_exact(loaded.propose(context, 4), drafter.propose(context, 4), "loaded drafter")
    target = ReferenceTransformer(preset("micro"), init_weights(preset("micro"), golden.WEIGHT_SEED))
    made = make_drafter("block", target, context, 4, drafter_directory=tmp_path)
    assert_exact(made.propose(context, 3), drafter.propose(context, 3), "make_drafter('block')")


@pytest.mark.parametrize("content, match", [
    (None, "drafter.json: no such file"),
    ("{not json", "drafter.json: not valid JSON"),
    ("[1, 2]", "drafter.json: expected a JSON object"),
    ({"kind": "block", "window": 6, "max_depths": 4, "pad_token_id": 1},
     "drafter.json: missing key 'mask_token_id'"),
    ({"kind": "tree"}, "drafter.json: missing key 'window'"),
    ({"kind": "tree", "window": 6, "max_depths": 4, "pad_token_id": 1, "mask_token_id": 2},
     "drafter.json: key 'kind' must be 'block', got 'tree'"),
    ({"kind": "block", "window": 6.0, "max_depths": 4, "pad_token_id": 1, "mask_token_id": 2},
     "drafter.json: key 'window' must be a positive integer, got 6.0"),
    ({"kind": "block", "window": 6, "max_depths": True, "pad_token_id": 1, "mask_token_id": 2},
     "drafter.json: key 'max_depths' must be a positive integer, got True"),
    ({"kind": "block", "window": 6, "max_depths": 4, "pad_token_id": -1, "mask_token_id": 2},
     "drafter.json: key 'pad_token_id' must be a non-negative integer, got -1"),
    ({"kind": "block", "window": 6, "max_depths": 4, "pad_token_id": 1, "mask_token_id": 96},
     r"drafter.json: mask_token must be a token id in \[0, vocab_size=96\)"),
])
def test_a_bad_drafter_json_is_refused_by_file_and_key(tmp_path, content, match):
    save_pretrained(tmp_path, block_drafter().config, block_drafter().weights)
    if content is not None:
        (tmp_path / "drafter.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_block_drafter(tmp_path)


def test_make_drafter_names_the_block_drafter_with_its_directory(tmp_path):
    target = ReferenceTransformer(preset("tiny-b"), init_weights(preset("tiny-b"), 0))   # vocab 384
    save_drafter(tmp_path, block_drafter())
    with pytest.raises(ValueError, match=r"vocab_size \(96.*must equal the model's vocab_size \(384\)"):
        make_drafter("block", target, [1, 2], 4, drafter_directory=tmp_path)
    with pytest.raises(ValueError, match="drafter 'block' needs drafter_directory="):
        make_drafter("block", target, [1, 2], 4)
    with pytest.raises(ValueError, match="drafter_directory is read by the block drafter only, not by 'ng"):
        make_drafter("ngram", target, [1, 2], 4, drafter_directory=tmp_path)
    with pytest.raises(ValueError, match="drafter must be one of oracle, noisy, ngram, block"):
        make_drafter("magic", target, [1, 2], 4)


# ------------------------------------------------------------------------------------------------
# the engine: the drafter's forward inside the round


@functools.cache
def engine_and_reference():
    from kernels.model import Transformer as EngineTransformer

    config = preset("micro")
    weights = init_weights(config, golden.WEIGHT_SEED)
    return EngineTransformer(config, weights, max_tree_nodes=8), ReferenceTransformer(config, weights)


def test_the_engine_with_the_block_drafter_on_the_device_is_ar():
    """DDTree == AR with the block drafter drafting inside the round; every round's tree is the
    reference's build from the round's own device draft, and the draft is the numpy drafter's
    within the whole-model tolerance."""
    from kernels import decode as engine_decode

    model, ref = engine_and_reference()
    drafter = block_drafter()
    prompt, new = golden.default_prompt("micro")[:3], 5
    expected = reference_decode.generate_ar(ref, prompt, new)
    cache = model.new_cache()
    model.prefill(cache, prompt[:-1], emit_token=False)
    context = list(prompt)
    while len(context) - prompt.size < new:
        block = min(4, new - (len(context) - prompt.size))          # the last round may draft nothing
        assert model.drafts_on_device(drafter) and model.buffers.drafter.kind == "block"
        model.buffers.draft.copy_to_device(np.full(model.buffers.draft.shape, np.nan, np.float32))
        record = engine_decode.ddtree_round(model, cache, np.array(context), drafter, block, 5, None)
        if block > 1:
            draft = model.buffers.draft[:block - 1].copy_to_host()                # [L, V]
            wanted = drafter.propose(np.array(context), block)
            assert_close(draft, wanted, rtol=0, atol=1e-4 * float(np.abs(wanted).max()), name="device draft")
            top_logprobs, top_ids = top_candidates(draft, 5)                      # K = min(B, V)
            tree = build_tree(int(context[-1]), top_logprobs, top_ids, 5)
            assert_exact(record.tokens, tree.tokens, "tree tokens")
            assert_exact(record.parents, tree.parents, "tree parents")
        context += [int(t) for t in record.tokens[record.accepted[1:]]] + [record.bonus]
    assert_exact(np.array(context[prompt.size:]), expected, "DDTree == AR")


def test_generate_ddtree_with_the_block_drafter_equals_ar_and_the_reference():
    from kernels import decode as engine_decode

    model, ref = engine_and_reference()
    drafter = block_drafter(layers=1)
    prompt, new = golden.default_prompt("micro")[:2], 4
    expected = reference_decode.generate_ar(ref, prompt, new)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, block_size=3, budget=3)
    wanted, wanted_trace = reference_decode.generate_ddtree(ref, prompt, new, drafter, block_size=3, budget=3)
    assert_exact(tokens, expected, "engine DDTree == AR")
    assert_exact(wanted, expected, "reference DDTree == AR")
    assert len(trace.rounds) == len(wanted_trace.rounds)
    for actual, reference in zip(trace.rounds, wanted_trace.rounds, strict=True):
        assert_exact(actual.tokens, reference.tokens, "round tokens")
        assert_exact(actual.accepted, reference.accepted, "round path")
