import dataclasses
import json

import numpy as np
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


def test_small_is_deepseek_v2_lite_per_layer_with_v3_routing():
    small = preset("small")
    assert (small.hidden_size, small.num_attention_heads, small.kv_lora_rank, small.qk_rope_head_dim,
            small.qk_nope_head_dim, small.v_head_dim) == (2048, 16, 512, 64, 128, 128)
    assert (small.n_routed_experts, small.num_experts_per_tok, small.n_shared_experts,
            small.moe_intermediate_size, small.intermediate_size) == (64, 6, 2, 1408, 10944)
    assert (small.q_lora_rank, small.n_group, small.vocab_size) == (1536, 1, 32000)
    assert small.num_hidden_layers == 8
    assert small.first_k_dense_replace == 1 and small.rope_scaling is None
    assert small.max_position_embeddings == 32768


def test_frozen_and_private_rope_dict():
    values = preset("tiny-b").to_dict()
    config = ModelConfig.from_dict(values)
    values["rope_scaling"]["factor"] = 99.0
    assert config.rope_scaling["factor"] == 4.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1


def test_numpy_numbers_are_numbers_and_are_stored_as_python_numbers():
    values = preset("tiny-b").to_dict()
    values.update(hidden_size=np.int64(192), rms_norm_eps=np.float64(1e-5), norm_topk_prob=np.bool_(True),
                  rope_scaling=dict(values["rope_scaling"], factor=np.float64(4.0),
                                    original_max_position_embeddings=np.int32(256)))
    config = ModelConfig.from_dict(values)
    assert config == preset("tiny-b")
    assert type(config.hidden_size) is int and type(config.norm_topk_prob) is bool
    assert type(config.rope_scaling["original_max_position_embeddings"]) is int
    assert json.loads(json.dumps(config.to_dict())) == preset("tiny-b").to_dict()


# refused configurations: tests/test_errors.py (the catalogue of refused inputs)
