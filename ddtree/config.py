"""Model configuration with Hugging Face ``DeepseekV3Config`` field names.

Dimension names (the legend used across the package): every module's legend, shape comment and
docs page uses each name below with exactly this meaning; docs/glossary.md shows the table and
where each name appears.

# --8<-- [start:glossary]
| name | meaning |
|---|---|
| T | rows of a forward (tokens or tree nodes run together) |
| D | hidden_size |
| V | vocab_size |
| H | num_attention_heads |
| dn | qk_nope_head_dim |
| dr | qk_rope_head_dim |
| dv | v_head_dim |
| Rq | q_lora_rank |
| R | kv_lora_rank |
| I | intermediate_size (the dense MLP) |
| E | n_routed_experts |
| k | num_experts_per_tok |
| G | n_group |
| F | moe_intermediate_size |
| Fs | shared-expert width (n_shared_experts * F) |
| Din | input features of a linear layer (weight (Dout, Din)) |
| Dout | output features of a linear layer |
| P | prefix rows every new row sees |
| S | P + T keys |
| St | keys row t attends to: P and the new rows it sees, in position order |
| C | cache capacity (slots) |
| Ly | layers (num_hidden_layers) |
| L | draft depths (block_size - 1) |
| K | candidates per depth |
| B | node budget (root not counted) |
| n | drafted nodes (n <= B) |
| N | n + 1 tree nodes (root included) |
| W | padded tree width |
| Bq | requests in a batch |
| m | accepted nodes (root included) |
| TPB | threads per block (a kernel's block size) |
# --8<-- [end:glossary]

Every field is checked when a config is built: integers are integers (numpy's too, never bools),
booleans are booleans (never strings), and YaRN's fields are finite numbers in range. Values are
stored as plain Python numbers, so a config compares and serialises the same however it
was made.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

_YARN_KEYS = {
    "type",
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        _validate(self)

    # derived sizes ---------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_cache_width(self) -> int:
        """Floats cached per token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def describe(self) -> str:
        """One line, in the seeds' demo format."""
        return (
            f"hidden={self.hidden_size} layers={self.num_hidden_layers} "
            f"heads={self.num_attention_heads} kv_lora={self.kv_lora_rank} "
            f"experts={self.n_routed_experts} topk={self.num_experts_per_tok} "
            f"vocab={self.vocab_size}"
        )

    # serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from a dict such as a Hugging Face ``config.json``; unknown keys are ignored."""
        if not isinstance(values, dict):
            raise ValueError(f"a config must be a dict (a JSON object), got {type(values).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - values.keys())
        if missing:
            raise ValueError(f"config is missing required fields: {', '.join(missing)}")
        return cls(**{key: value for key, value in values.items() if key in names})


_POSITIVE_INTEGERS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
    "n_group", "topk_group", "max_position_embeddings",
)
_NON_NEGATIVE_INTEGERS = ("n_shared_experts", "first_k_dense_replace")
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")


def integer(name: str, value, minimum: int) -> int:
    """``value`` as an int >= minimum; Python and numpy integers pass, bools and floats do not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return int(value)


def finite_number(name: str, value, minimum: float = 0.0, strict: bool = True) -> float:
    """``value`` as a finite float > minimum (>= with strict=False); bools and strings do not pass."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < minimum or (strict and value == minimum):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


def _validate(c: ModelConfig) -> None:
    """Check and normalise every field of ``c`` (plain ints, floats and bools)."""
    def store(name, value):
        object.__setattr__(c, name, value)

    for name in _POSITIVE_INTEGERS:
        store(name, integer(name, getattr(c, name), 1))
    for name in _NON_NEGATIVE_INTEGERS:
        store(name, integer(name, getattr(c, name), 0))
    if c.q_lora_rank is not None:
        store("q_lora_rank", integer("q_lora_rank", c.q_lora_rank, 1))          # or None
    for name in _POSITIVE_NUMBERS:
        store(name, finite_number(name, getattr(c, name)))
    if not isinstance(c.norm_topk_prob, (bool, np.bool_)):
        raise ValueError(f"norm_topk_prob must be a bool (true or false), got {c.norm_topk_prob!r}")
    store("norm_topk_prob", bool(c.norm_topk_prob))
    if c.rope_theta <= 1:
        raise ValueError(f"rope_theta must be > 1, got {c.rope_theta}")
    if c.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even (NeoX rotates halves), got {c.qk_rope_head_dim}")
    _validate_routing(c)
    if c.rope_scaling is not None:
        # a private, normalised copy, so the frozen config cannot be changed through the caller's dict
        store("rope_scaling", _validate_yarn(c.rope_scaling, c.max_position_embeddings))


def _validate_routing(c: ModelConfig) -> None:
    if c.n_routed_experts % c.n_group:
        raise ValueError(
            f"n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group})")
    if c.topk_group > c.n_group:
        raise ValueError(f"topk_group ({c.topk_group}) must be <= n_group ({c.n_group})")
    experts_per_group = c.n_routed_experts // c.n_group
    if c.n_group > 1 and experts_per_group < 2:
        raise ValueError(
            f"group-limited routing scores a group by its top-2 experts: n_routed_experts / n_group "
            f"must be >= 2, got {experts_per_group}")
    kept = c.topk_group * experts_per_group
    if c.num_experts_per_tok > kept:
        raise ValueError(
            f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds the {kept} experts held by the "
            f"topk_group={c.topk_group} kept groups")


def _validate_yarn(scaling, max_positions: int) -> dict:
    """Check a YaRN ``rope_scaling`` dict; returns a normalised copy."""
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be None or a dict, got {type(scaling).__name__} {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"unknown rope_scaling type {kind!r}: only 'yarn' is supported")
    unknown = sorted(set(scaling) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"unknown rope_scaling keys {unknown}; expected a subset of {sorted(_YARN_KEYS)}")
    for key in ["factor", "original_max_position_embeddings"]:
        if key not in scaling:
            raise ValueError(f"rope_scaling (yarn) needs {key!r}")
    checked = dict(scaling)
    checked["factor"] = factor = finite_number("rope_scaling.factor", scaling["factor"], 1.0, strict=False)
    original = integer("rope_scaling.original_max_position_embeddings",
                       scaling["original_max_position_embeddings"], 1)
    checked["original_max_position_embeddings"] = original
    # the ramp's ends are log(original / (2 pi beta)): both betas positive, beta_fast the larger
    for key in ("beta_fast", "beta_slow"):
        if key in scaling:
            checked[key] = finite_number(f"rope_scaling.{key}", scaling[key])
    if checked.get("beta_fast", 32.0) <= checked.get("beta_slow", 1.0):
        raise ValueError("rope_scaling.beta_fast must be larger than rope_scaling.beta_slow, got "
                         f"{checked.get('beta_fast', 32.0)} <= {checked.get('beta_slow', 1.0)}")
    for key in ("mscale", "mscale_all_dim"):                   # None (or 0) switches the correction off
        if scaling.get(key) is not None:
            checked[key] = finite_number(f"rope_scaling.{key}", scaling[key], strict=False)
    # Hugging Face derives YaRN's factor from max_position_embeddings / original when the latter
    # is given; a config where the two disagree would compute different frequencies there.
    if not math.isclose(max_positions / original, factor, rel_tol=1e-9):
        raise ValueError(
            f"rope_scaling.factor ({factor}) must equal max_position_embeddings / "
            f"original_max_position_embeddings ({max_positions} / {original})")
    return checked


_PRESETS: dict[str, dict[str, Any]] = {
    # the seeds' validation model
    "tiny": dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
    ),
    # what tiny does not exercise: q_proj path, groups, YaRN + mscale, a dense layer, other dims
    "tiny-b": dict(
        vocab_size=384, hidden_size=192, intermediate_size=384, moe_intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=6, q_lora_rank=None, kv_lora_rank=48,
        qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20, n_routed_experts=12,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=256,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=1024,
    ),
    # a whole forward in the CUDA simulator in seconds
    "micro": dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
    ),
    # a model that weighs something, for the GPU engine only (~17 GB of fp32 weights; never built in
    # CI): DeepSeek-V2-Lite's per-layer dims with V3's q_lora_rank and V3's sigmoid + bias routing
    "small": dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=8, num_attention_heads=16, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=32768,
    ),
    # Kimi K2.5 / K2.6 text model: shapes only, never materialised as weights
    "kimi-k2.6": dict(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=262144,
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str) -> ModelConfig:
    """A named configuration: one of ``PRESET_NAMES``."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESET_NAMES)}")
    return ModelConfig(**_PRESETS[name])
