import dataclasses

import pytest

from ddtree.config import PRESET_NAMES, ModelConfig, preset


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_round_trip_through_dict(name):
    config = preset(name)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_presets_cover_what_tiny_does_not():
    tiny, tiny_b = preset("tiny"), preset("tiny-b")
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads, tiny.kv_lora_rank,
            tiny.n_routed_experts, tiny.num_experts_per_tok, tiny.vocab_size) == (256, 4, 4, 64, 8, 2, 512)
    assert tiny_b.q_lora_rank is None and tiny.q_lora_rank is not None
    assert tiny_b.n_group > 1 and tiny_b.rope_scaling["type"] == "yarn"
    assert tiny_b.first_k_dense_replace == 1 and tiny.first_k_dense_replace == 0
    assert (tiny_b.qk_nope_head_dim, tiny_b.qk_rope_head_dim, tiny_b.v_head_dim) != \
           (tiny.qk_nope_head_dim, tiny.qk_rope_head_dim, tiny.v_head_dim)


def test_kimi_dimensions():
    kimi = preset("kimi-k2.6")
    assert (kimi.hidden_size, kimi.num_attention_heads, kimi.kv_lora_rank, kimi.n_routed_experts,
            kimi.num_experts_per_tok, kimi.vocab_size) == (7168, 64, 512, 384, 8, 163840)
    assert kimi.latent_cache_width == 576


def test_frozen_and_private_rope_dict():
    values = preset("tiny-b").to_dict()
    config = ModelConfig.from_dict(values)
    values["rope_scaling"]["factor"] = 99.0
    assert config.rope_scaling["factor"] == 4.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


BAD = [
    (dict(n_routed_experts=10, n_group=4), "divisible by n_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=4), "exceeds the 3 experts"),
    (dict(topk_group=5, n_group=4), "topk_group"),
    (dict(qk_rope_head_dim=7), "must be even"),
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "unknown rope_scaling type 'linear'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                        "bogus": 1}), "unknown rope_scaling keys"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}),
     "must equal max_position_embeddings"),
    (dict(n_routed_experts=4, n_group=4, topk_group=2, num_experts_per_tok=2), "top-2"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_validation_rejects_impossible_configs(change, message):
    values = preset("tiny-b").to_dict()
    values.update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(values)


def test_from_dict_names_missing_fields():
    with pytest.raises(ValueError, match="missing required fields: hidden_size"):
        ModelConfig.from_dict({k: v for k, v in preset("tiny").to_dict().items() if k != "hidden_size"})
