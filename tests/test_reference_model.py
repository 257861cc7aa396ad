"""The numpy reference model: absorb == naive, cache == recomputation, golden bundles, checkpoints."""

import numpy as np
import pytest

from ddtree import golden
from ddtree.config import preset
from ddtree.decode import generate_ar
from ddtree.model import Transformer
from ddtree.weights import init_weights, load_pretrained, save_pretrained, weight_shapes
from tests.helpers import assert_close, assert_exact

PRESETS = ["tiny", "tiny-b"]


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    config = preset(request.param)
    return Transformer(config, init_weights(config, seed=0))


@pytest.mark.parametrize("name", PRESETS)
def test_absorb_equals_naive(name):
    config = preset(name)
    weights = init_weights(config, seed=1)
    prompt = golden.default_prompt(name)
    absorb = Transformer(config, weights, attention="absorb").logits(prompt)
    naive = Transformer(config, weights, attention="naive").logits(prompt)
    # same math reassociated: (q W_UK^T) c vs q (W_UK c); fp32 rounding only
    assert_close(absorb, naive, rtol=1e-4, atol=1e-4 * np.abs(naive).max())


def test_cached_decode_equals_recomputation(model):
    name = "tiny" if model.config.hidden_size == 256 else "tiny-b"
    prompt = golden.default_prompt(name)
    tokens, step_logits = generate_ar(model, prompt, 12, return_logits=True)
    full = model.logits(np.concatenate([prompt, tokens]))              # one causal pass
    recomputed = full[prompt.size - 1:-1]                              # the logits that chose each token
    assert_close(step_logits, recomputed, rtol=1e-4, atol=1e-4 * np.abs(recomputed).max())
    assert_exact(recomputed.argmax(-1), tokens)


def test_ar_counts_forwards_and_is_not_degenerate():
    config = preset("tiny")
    model = Transformer(config, init_weights(config, seed=0))
    tokens = generate_ar(model, golden.default_prompt("tiny"), 24)
    assert model.forward_count == 24                                   # 1 prefill + 23 decodes
    assert len(set(tokens.tolist())) >= 8


def test_ar_is_deterministic(model):
    prompt = golden.default_prompt("tiny")[:5] % model.config.vocab_size
    assert_exact(generate_ar(model, prompt, 6), generate_ar(model, prompt, 6))


@pytest.mark.parametrize("name", golden.GOLDEN_MODELS)
def test_golden_regenerates(name):
    stored = golden.load_bundle(name)
    fresh = golden.make_bundle(name)
    assert golden.compare(fresh, stored) == []
    assert float(stored["min_gap"]) >= golden.MIN_GAP_FLOOR


def test_golden_compare_detects_a_changed_token():
    stored = golden.load_bundle("tiny")
    changed = dict(stored, tokens=stored["tokens"].copy())
    changed["tokens"][5] += 1
    assert any(line.startswith("tokens") for line in golden.compare(changed, stored))


@pytest.mark.parametrize("name", ["tiny-b", "micro"])
def test_checkpoint_round_trip(tmp_path, name):
    config = preset(name)
    weights = init_weights(config, seed=3)
    save_pretrained(tmp_path, config, weights)
    loaded_config, loaded = load_pretrained(tmp_path)
    assert loaded_config == config
    assert set(loaded) == set(weight_shapes(config))
    for key, value in weights.items():
        assert_exact(loaded[key], value, name=key)


def test_save_rejects_wrong_shapes(tmp_path):
    config = preset("micro")
    weights = init_weights(config)
    weights["lm_head.weight"] = weights["lm_head.weight"][:, :3]
    with pytest.raises(ValueError, match="lm_head.weight"):
        save_pretrained(tmp_path, config, weights)
    assert not (tmp_path / "model.safetensors").exists()


def test_init_weights_uses_hf_names_and_is_seeded():
    config = preset("tiny-b")
    a, b = init_weights(config, seed=0), init_weights(config, seed=0)
    assert "model.layers.0.mlp.gate_proj.weight" in a                  # dense first layer
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in a
    assert "model.layers.1.self_attn.q_proj.weight" in a               # q_lora_rank None
    assert all(np.array_equal(a[k], b[k]) and a[k].dtype == np.float32 for k in a)


def test_forward_rejects_bad_tokens_and_positions():
    config = preset("micro")
    model = Transformer(config, init_weights(config))
    cache = model.new_cache(16)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 96\)"):
        model.forward(cache, np.array([1, 96]))
    with pytest.raises(ValueError, match="positions must lie"):
        model.forward(cache, np.array([1, 2]), positions=np.array([0, 512]))
    with pytest.raises(ValueError, match="visible must be a"):
        model.forward(cache, np.array([1, 2]), visible=np.ones((3, 3), bool))
    assert cache.length == 0 and model.forward_count == 0
