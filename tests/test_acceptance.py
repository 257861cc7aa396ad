"""train.acceptance (the trained drafter's acceptance and routing record) and
ddtree.model.routed_experts, on a stand-in checkpoint: random tiny weights, the committed
tokenizer, a random block drafter. No torch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ddtree.config import preset
from ddtree.decode import generate_ar
from ddtree.model import Transformer, routed_experts
from ddtree.moe import sigmoid, swiglu
from ddtree.text import encode, heldout_prompts, load_tokenizer
from ddtree.tree import visibility
from ddtree.weights import init_weights, load_pretrained
from tests.helpers import save_text_checkpoint
from train import acceptance


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """What checkpoints/tiny-code will hold, with random weights: the target (tiny), the committed
    tokenizer, and a block drafter of the default architecture (2 dense layers, window 64, depths 15)."""
    return save_text_checkpoint(tmp_path_factory.mktemp("accept") / "model", preset("tiny"), seed=5)


@pytest.fixture(scope="module")
def record(stand_in, tmp_path_factory):
    out = tmp_path_factory.mktemp("record") / "acceptance.md"
    assert acceptance.main(["--checkpoint", str(stand_in), "--out", str(out), "--prompts", "2",
                            "--tokens", "7", "--budgets", "5,3"]) == 0
    return out, json.loads(out.with_suffix(".json").read_text())


def test_the_record_holds_every_run_equal_to_ar(stand_in, record):
    """The prompts are the first held-out ones, AR's tokens are the model's, and every run's
    accepted drafts plus one bonus per round make up the new tokens."""
    _, data = record
    model = Transformer(*load_pretrained(stand_in))
    tokenizer = load_tokenizer(stand_in)
    assert [p["file"] for p in data["prompts"]] == [p["file"] for p in heldout_prompts()[:2]]
    for entry, prompt in zip(data["prompts"], heldout_prompts()[:2], strict=True):
        ids = encode(tokenizer, prompt["text"])
        assert entry["prompt_tokens"] == ids.size
        assert entry["ar"] == generate_ar(model, ids, 7).tolist()
        assert sorted(entry["runs"]) == ["block/3", "block/5", "ngram/3", "ngram/5"]
        for run in entry["runs"].values():
            assert sum(run["accepted_lengths"]) + run["verify_forwards"] == 7      # drafts + bonuses
            assert run["tokens_per_forward"] == 7 / run["verify_forwards"]


def test_the_acceptance_rows_add_up(record):
    _, data = record
    rows = {(r["drafter"], r["budget"]): r for r in data["acceptance"]}
    assert list(rows) == [("AR", None), ("block", 3), ("block", 5), ("ngram", 3), ("ngram", 5)]
    assert rows["AR", None]["tokens_per_forward"] == 1.0
    for (name, budget), row in rows.items():
        if name == "AR":
            continue
        each = [p["runs"][f"{name}/{budget}"] for p in data["prompts"]]
        assert row["verify_forwards"] == sum(r["verify_forwards"] for r in each)
        assert row["tokens_per_forward"] == 14 / row["verify_forwards"]
        ratios = sorted(r["tokens_per_forward"] for r in each)
        assert (row["per_prompt"]["min"], row["per_prompt"]["max"]) == (ratios[0], ratios[-1])
    assert data["target"]["block"] is None and data["target"]["met"] is None   # budget 16 not run


def test_the_routing_table_summarises_the_trees(record):
    out, data = record
    routing = data["routing"]
    assert (routing["experts"], routing["topk"], routing["moe_layers"]) == (8, 2, [0, 1, 2, 3])
    trees = routing["trees"]
    forwards = sum(p["runs"][f"block/{b}"]["verify_forwards"] for p in data["prompts"] for b in (3, 5))
    assert len(trees) == forwards                              # one tree per verify forward of the block runs
    for tree in trees:
        for key in ("trained", "random"):
            assert len(tree[key]) == 4
            assert all(2 <= n <= min(8, 2 * tree["rows"]) for n in tree[key])
    for row in routing["by_rows"]:
        group = [t for t in trees if t["rows"] == row["rows"]]
        assert row["trees"] == len(group)
        assert row["trained_per_layer"] == pytest.approx(np.mean([t["trained"] for t in group], axis=0))
        assert row["random"] == pytest.approx(np.mean([t["random"] for t in group]))
        assert row["uniform"] == pytest.approx(acceptance.uniform_distinct(8, 2, row["rows"]))
    text = out.read_text()
    for snippet in ("acceptance", "routing"):
        assert text.count(f"<!-- --8<-- [start:{snippet}] -->") == 1
        assert text.count(f"<!-- --8<-- [end:{snippet}] -->") == 1
    assert "machine: numpy reference on the CPU" in text
    assert "does not stand in for small's 64 experts" in text


def test_the_replay_equals_a_fresh_prefill_per_tree(tree_forward):
    """replay_on grows one cache along the sequence and forgets each tree: the same counts as a
    fresh prefill of each tree's committed tokens (trees given out of order, one at the start)."""
    model, prefix, tokens, parents, depths = tree_forward
    sequence = np.concatenate([prefix, [9, 8, 7, 6]])
    trees = [{"start": start, "tokens": np.concatenate([[sequence[start]], tokens[1:]]), "parents": parents,
              "depths": depths, "rows": tokens.size} for start in (13, 4, 0, 4)]
    trees.append({"start": 14, "tokens": sequence[14:15], "parents": np.array([-1]), "depths": np.array([0]),
                  "rows": 1})
    expected = []
    for tree in trees:
        cache = model.new_cache(sequence.size + tokens.size)
        if tree["start"]:
            model.forward(cache, sequence[:tree["start"]])
        _, routed = routed_experts(model, cache, tree["tokens"], positions=tree["start"] + tree["depths"],
                                   visible=visibility(tree["parents"]))
        expected.append([np.unique(routed[layer]).size for layer in range(4)])
    assert acceptance.replay_on(model, sequence, trees) == expected
    assert expected[-1] == [2, 2, 2, 2]                           # one row wakes exactly k experts


def test_a_ddtree_run_that_differs_from_ar_is_refused():
    with pytest.raises(SystemExit, match="differs from AR at new token 2"):
        acceptance.check_equal("DDTree (block drafter, budget 4)", np.array([1, 2, 3]), np.array([1, 2, 4]))
    acceptance.check_equal("equal", np.array([1, 2]), np.array([1, 2]))


@pytest.mark.parametrize("experts, topk", [(8, 2), (64, 6), (5, 5), (3, 1)])
def test_the_uniform_expectation(experts, topk):
    assert acceptance.uniform_distinct(experts, topk, 0) == 0
    assert acceptance.uniform_distinct(experts, topk, 1) == pytest.approx(topk)
    assert acceptance.uniform_distinct(experts, topk, 10_000) == pytest.approx(experts)
    values = [acceptance.uniform_distinct(experts, topk, n) for n in range(1, 40)]
    assert values == sorted(values)


def test_the_uniform_expectation_by_enumeration():
    """E=4, k=2, N=2: all 6 x 6 pairs of rows; distinct experts counted exactly."""
    import itertools

    pairs = list(itertools.combinations(range(4), 2))
    counts = [len(set(a) | set(b)) for a in pairs for b in pairs]
    assert acceptance.uniform_distinct(4, 2, 2) == pytest.approx(sum(counts) / len(counts))
    assert acceptance.saturation_rows(8, 2) == math.ceil(math.log(0.05) / math.log(0.75))
    assert acceptance.uniform_distinct(8, 2, acceptance.saturation_rows(8, 2)) >= 0.95 * 8
    assert acceptance.uniform_distinct(8, 2, acceptance.saturation_rows(8, 2) - 1) < 0.95 * 8
    with pytest.raises(ValueError, match="topk must be in"):
        acceptance.uniform_distinct(4, 5, 1)


@pytest.fixture(scope="module")
def tree_forward():
    """A random tiny model, an 11-token prefix cached, and an irregular 6-node tree to verify."""
    config = preset("tiny")
    model = Transformer(config, init_weights(config, 3))
    prefix = np.random.default_rng(1).integers(0, config.vocab_size, 11)
    parents = np.array([-1, 0, 0, 1, 3, 2])
    depths = np.array([0, 1, 1, 2, 3, 2])
    tokens = np.array([7, 300, 41, 5, 511, 90])
    return model, prefix, tokens, parents, depths


def rebuilt(x, params, config, chosen):
    """A MoE layer's output (T, D) from the experts ``chosen`` (T, k) per row, one row and one
    expert at a time, weighed by the router's unbiased scores at those experts."""
    weights = np.take_along_axis(sigmoid(x @ params.gate.T), chosen, axis=-1)       # [T, k]
    weights = weights / weights.sum(-1, keepdims=True) * config.routed_scaling_factor
    total = swiglu(x, params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)  # [T, D]
    for row, slot in np.ndindex(chosen.shape):
        e = chosen[row, slot]
        expert = swiglu(x[row:row + 1], params.gate_proj[e], params.up_proj[e], params.down_proj[e])  # [1, D]
        total[row] += weights[row, slot] * expert[0]
    return total


def test_routed_experts_are_what_the_moe_forward_used(tree_forward):
    """Each MoE layer's output, rebuilt from the helper's ids (and the router's weights at those
    ids), equals what the layer returned in an ordinary forward; other ids give another output."""
    model, prefix, tokens, parents, depths = tree_forward
    seen, moe = [], model.ops.moe

    def keep(x, params, config):
        out = moe(x, params, config)
        seen.append((x, params, out))
        return out

    def verify(run):
        cache = model.new_cache(prefix.size + tokens.size)
        model.forward(cache, prefix)
        return run(cache, tokens, positions=prefix.size + depths, visible=visibility(parents))

    forwards = model.forward_count
    logits, routed = verify(lambda *a, **k: routed_experts(model, *a, **k))
    assert model.ops.moe is moe and model.forward_count == forwards + 1     # the prefix's forward only
    model.ops.moe = keep
    try:
        plain = verify(model.forward)
    finally:
        model.ops.moe = moe
    np.testing.assert_array_equal(logits, plain)
    assert sorted(routed) == [0, 1, 2, 3] and len(seen) == 8                 # prefix and tree, 4 layers
    config = model.config
    for layer, (x, params, out) in zip(range(4), seen[4:], strict=True):
        ids = routed[layer]
        assert ids.shape == (tokens.size, 2) and ids.dtype == np.int64
        assert all(len(set(row)) == 2 for row in ids.tolist())

        np.testing.assert_allclose(rebuilt(x, params, config, ids), out, rtol=1e-4, atol=1e-5)
        assert not np.allclose(rebuilt(x, params, config, (ids + 1) % 8), out, rtol=1e-4, atol=1e-5)


def test_the_script_checks_its_flags(stand_in, tmp_path, capsys):
    out = str(tmp_path / "a.md")
    with pytest.raises(SystemExit):
        acceptance.main(["--checkpoint", str(stand_in), "--out", out, "--budgets", "4,x"])
    assert "--budgets: expected comma-separated positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--block-size: 17 drafts 16 depths"):
        acceptance.main(["--checkpoint", str(stand_in), "--out", out, "--block-size", "17", "--prompts", "1"])
    assert not (tmp_path / "a.md").exists()
