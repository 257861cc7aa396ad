"""Random weights in Hugging Face DeepSeek-V3 state-dict layout, and checkpoint I/O.

``save_pretrained`` writes a directory that ``transformers.DeepseekV3ForCausalLM`` loads:
``config.json`` (model_type deepseek_v3, NeoX rope, untied embeddings) and ``model.safetensors``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from ddtree.config import ModelConfig

# the initial values shape the random model's greedy text: unit-variance embeddings, fan-in
# scaled projections, norms near 1 (not exactly 1, so a swapped norm weight shows in tests)
NORM_JITTER = 0.1
ROUTER_BIAS_STD = 0.05
LM_HEAD_GAIN = 4.0


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint and its shape, in a stable order."""
    c = config
    D, H = c.hidden_size, c.num_attention_heads
    shapes = {"model.embed_tokens.weight": (c.vocab_size, D)}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        if c.q_lora_rank is None:
            shapes[p + "self_attn.q_proj.weight"] = (H * c.qk_head_dim, D)
        else:
            shapes[p + "self_attn.q_a_proj.weight"] = (c.q_lora_rank, D)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[p + "self_attn.q_b_proj.weight"] = (H * c.qk_head_dim, c.q_lora_rank)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, D)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[p + "self_attn.o_proj.weight"] = (D, H * c.v_head_dim)
        if not c.is_moe_layer(layer):
            for name, shape in _swiglu_shapes(D, c.intermediate_size).items():
                shapes[p + f"mlp.{name}.weight"] = shape
            continue
        shapes[p + "mlp.gate.weight"] = (c.n_routed_experts, D)
        shapes[p + "mlp.gate.e_score_correction_bias"] = (c.n_routed_experts,)
        for e in range(c.n_routed_experts):
            for name, shape in _swiglu_shapes(D, c.moe_intermediate_size).items():
                shapes[p + f"mlp.experts.{e}.{name}.weight"] = shape
        if c.n_shared_experts:
            for name, shape in _swiglu_shapes(D, c.moe_intermediate_size * c.n_shared_experts).items():
                shapes[p + f"mlp.shared_experts.{name}.weight"] = shape
    shapes["model.norm.weight"] = (D,)
    shapes["lm_head.weight"] = (c.vocab_size, D)
    return shapes


def _swiglu_shapes(hidden: int, inner: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}


def init_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights keyed by Hugging Face names."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            value = 1.0 + NORM_JITTER * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            value = ROUTER_BIAS_STD * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            value = rng.standard_normal(shape)
        else:
            gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
            value = gain * rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[name] = value.astype(np.float32)
    return weights


def hf_config_dict(config: ModelConfig) -> dict:
    """The ``config.json`` contents for transformers' DeepseekV3Config."""
    values = config.to_dict()
    values.update(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
        num_key_value_heads=config.num_attention_heads, rope_interleave=False,
        tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
        attention_dropout=0.0, topk_method="noaux_tc", scoring_func="sigmoid",
        initializer_range=0.02, use_cache=True, torch_dtype="float32",
        bos_token_id=None, eos_token_id=None)          # a random model has no special tokens
    if config.rope_scaling is not None:
        values["rope_scaling"] = dict(config.rope_scaling, type="yarn", rope_type="yarn")
    return values


def save_pretrained(directory, config: ModelConfig, weights: dict[str, np.ndarray]) -> pathlib.Path:
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    expected = weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"weights are missing {len(missing)} tensors, e.g. {missing[0]!r}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {weights[name].shape}, expected {shape}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    tensors = {name: np.ascontiguousarray(weights[name], dtype=np.float32) for name in expected}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_pretrained(directory) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    directory = pathlib.Path(directory)
    values = json.loads((directory / "config.json").read_text())
    if values.get("model_type") != "deepseek_v3":
        raise ValueError(f"{directory}: model_type must be 'deepseek_v3', got {values.get('model_type')!r}")
    if values.get("rope_interleave", False):
        raise ValueError(f"{directory}: rope_interleave=true is not supported (this project uses NeoX rope)")
    # transformers 5 writes rope_theta and the scaling together as `rope_parameters`
    rope = dict(values.get("rope_scaling") or values.get("rope_parameters") or {})
    if "rope_theta" in rope:
        values["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type", rope.get("type", "default"))
    values["rope_scaling"] = None if kind == "default" else dict(rope, type=kind)
    config = ModelConfig.from_dict(values)
    weights = load_file(str(directory / "model.safetensors"))
    return config, {name: value.astype(np.float32) for name, value in weights.items()}
