"""Random weights in Hugging Face DeepSeek-V3 state-dict layout, checks, and checkpoint I/O.

Legend (docs/glossary.md): D hidden_size, V vocab_size, H num_attention_heads, dn/dr/dv head
dims, Rq q_lora_rank, R kv_lora_rank, I intermediate_size, E n_routed_experts,
F moe_intermediate_size, Fs shared-expert width, Din/Dout a projection's input/output features.

``save_pretrained`` writes a directory that ``transformers.DeepseekV3ForCausalLM`` loads:
``config.json`` (model_type deepseek_v3, NeoX rope, untied embeddings) and ``model.safetensors``,
or its shards the Hugging Face way (``model-00001-of-00002.safetensors`` ... and
``model.safetensors.index.json``) when a shard size is given.
``check_weights`` refuses a state dict that does not match its config (a missing, extra,
transposed or non-finite tensor) before any of it is used: the numpy model and
``load_pretrained`` call it, and an engine that takes the same state dict can call it too.
"""

from __future__ import annotations

import json
import math
import os
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


# --8<-- [start:check_weights]
def check_weights(config: ModelConfig, weights) -> None:
    """Raise ValueError unless ``weights`` holds exactly the tensors of ``config``, each with its
    shape, float32, and (numpy arrays) finite; the message names the tensor, its shape and the
    expected one. Arrays on a device are checked for shape and dtype only (no copy back)."""
    if not isinstance(weights, dict):
        raise ValueError(f"weights must be a dict of tensor name -> array, got {type(weights).__name__}")
    expected = weight_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ValueError(f"weights are missing {len(missing)} tensor(s) the config needs, e.g. "
                         f"{missing[0]!r} with shape {expected[missing[0]]}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"weights hold {len(extra)} tensor(s) this config has no place for, e.g. "
                         f"{extra[0]!r} (weights of a config with other sizes?)")
    for name, shape in expected.items():
        value = weights[name]
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise ValueError(f"weight {name!r} must be an array, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {shape}")
        if value.dtype != np.float32:
            raise ValueError(f"weight {name!r} {shape} has dtype {value.dtype}, expected float32")
        if isinstance(value, np.ndarray) and not np.isfinite(value).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
            raise ValueError(f"weight {name!r} {shape} holds {int((~np.isfinite(value)).sum())} NaN or "
                             f"inf value(s), e.g. {value[where]} at {where}")
# --8<-- [end:check_weights]


def weights_nbytes(config: ModelConfig) -> int:
    """Bytes of ``config``'s weights in float32."""
    return 4 * sum(math.prod(shape) for shape in weight_shapes(config).values())


def available_memory() -> int:
    """Bytes this process can still allocate: Linux's MemAvailable, else the physical memory."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_in_memory(config: ModelConfig) -> None:
    """Refuse, before allocating anything, weights that ``init_weights`` could not hold."""
    largest = max(math.prod(shape) for shape in weight_shapes(config).values())
    needed = weights_nbytes(config) + 8 * largest            # + the float64 draw of the largest tensor
    available = available_memory()
    if needed > available:
        raise ValueError(f"init_weights needs {needed / 2**30:.2f} GiB for this config's weights "
                         f"({weights_nbytes(config) / 2**30:.2f} GiB in float32), but only "
                         f"{available / 2**30:.2f} GiB of memory is available")


def init_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights keyed by Hugging Face names (refused if they cannot fit)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    check_fits_in_memory(config)
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


SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def shard_name(index: int, count: int) -> str:
    """Hugging Face's shard file name: ``model-00001-of-00003.safetensors`` (index from 1)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(config: ModelConfig, max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per shard, in ``weight_shapes`` order: a shard is closed before a tensor that
    would take it past ``max_shard_bytes`` (a tensor larger than the limit gets a shard alone).
    One shard when the limit is None or the weights fit."""
    names = list(weight_shapes(config))
    if max_shard_bytes is None:
        return [names]
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, (int, np.integer)) \
            or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be None or a positive integer, got {max_shard_bytes!r}")
    shards, size = [[]], 0
    for name, shape in weight_shapes(config).items():
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_pretrained(directory, config: ModelConfig, weights: dict[str, np.ndarray],
                    max_shard_bytes: int | None = None) -> pathlib.Path:
    """Write ``config.json`` and the weights: ``model.safetensors``, or, when they exceed
    ``max_shard_bytes``, Hugging Face's sharded layout (``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` with ``metadata.total_size`` and ``weight_map``). Weight files
    of the other layout left in ``directory`` are removed, so a loader never reads stale ones."""
    from safetensors.numpy import save_file

    check_weights(config, weights)
    shards = plan_shards(config, max_shard_bytes)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stale = [directory / SINGLE_FILE, directory / SHARD_INDEX, *directory.glob("model-*-of-*.safetensors")]
    for path in stale:
        path.unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    if len(shards) == 1:
        tensors = {name: np.ascontiguousarray(weights[name]) for name in shards[0]}
        save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return directory
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        file = shard_name(index, len(shards))
        save_file({name: np.ascontiguousarray(weights[name]) for name in names}, str(directory / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": weights_nbytes(config)}, "weight_map": weight_map}
    (directory / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def read_json_object(path: pathlib.Path, holds: str) -> dict:
    """The JSON object in ``path``; errors name the file (``holds``: what its directory holds,
    for the message when it is missing)."""
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file ({holds})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(values).__name__}")
    return values


def read_config(path: pathlib.Path) -> ModelConfig:
    """A ``config.json`` (as transformers writes it) -> ModelConfig; errors name the file."""
    values = read_json_object(path, "a checkpoint directory holds config.json and model.safetensors")
    if values.get("model_type") != "deepseek_v3":
        raise ValueError(f"{path}: model_type must be 'deepseek_v3', got {values.get('model_type')!r}")
    if values.get("rope_interleave", False):
        raise ValueError(f"{path}: rope_interleave=true is not supported (this project uses NeoX rope)")
    # transformers 5 writes rope_theta and the scaling together as `rope_parameters`
    rope = values.get("rope_scaling") or values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{path}: rope_scaling must be a JSON object or null, got {rope!r}")
    rope = dict(rope)
    if "rope_theta" in rope:
        values["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type", rope.get("type", "default"))
    values["rope_scaling"] = None if kind == "default" else dict(rope, type=kind)
    try:
        return ModelConfig.from_dict(values)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a ``model.safetensors`` file as float32; errors name the file."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, TypeError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    return {name: value.astype(np.float32) for name, value in tensors.items()}


def read_sharded(index_path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a sharded checkpoint, by its ``model.safetensors.index.json``; errors name
    the file: the index, a missing shard, a tensor the map places in a shard that lacks it, or a
    tensor a shard holds that the map does not list."""
    index = read_json_object(index_path, "a sharded checkpoint's index of its shards")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: expected a JSON object with a 'weight_map' of tensor name -> "
                         "shard file name")
    weights = {}
    for file in sorted(set(weight_map.values())):
        if pathlib.Path(file).name != file:
            raise ValueError(f"{index_path}: shard {file!r} must be a file name in the same directory")
        path = index_path.parent / file
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a shard listed in {index_path})")
        tensors = read_tensors(path)
        listed = {name for name, where in weight_map.items() if where == file}
        absent = sorted(listed - set(tensors))
        if absent:
            raise ValueError(f"{path}: lacks {len(absent)} tensor(s) that {index_path.name} places there, "
                             f"e.g. {absent[0]!r}")
        unlisted = sorted(set(tensors) - listed)
        if unlisted:
            raise ValueError(f"{path}: holds {len(unlisted)} tensor(s) missing from {index_path.name}'s "
                             f"weight_map, e.g. {unlisted[0]!r}")
        weights.update(tensors)
    return weights


def load_pretrained(directory) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, float32 weights) of a checkpoint directory, both checked; errors name the file.
    The weights are ``model.safetensors`` or, without it, the shards of ``model.safetensors.index.json``."""
    directory = pathlib.Path(directory)
    config = read_config(directory / "config.json")
    path = directory / SINGLE_FILE
    if path.is_file() or not (directory / SHARD_INDEX).is_file():
        weights = read_tensors(path)
    else:
        path = directory / SHARD_INDEX
        weights = read_sharded(path)
    try:
        check_weights(config, weights)
    except ValueError as error:
        raise ValueError(f"{path}: {error} (config from {directory / 'config.json'})") from None
    return config, weights
