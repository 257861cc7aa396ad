"""NeoX rotary position embedding with YaRN frequencies: the numpy reference.

Legend (docs/glossary.md): T rows, H num_attention_heads, dr qk_rope_head_dim (dr/2 rotation
frequencies).

NeoX pairs feature i with feature i + dr/2 (rotate halves). YaRN keeps the high frequencies,
divides the low ones by ``factor`` and ramps linearly in between; attention logits are then
scaled by mscale^2 (see ``softmax_scale``).
"""

import math

import numpy as np

from ddtree.config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * ln(factor) * mscale + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# --8<-- [start:inv_freq]
def inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies (dr/2,) in float32, with YaRN's ramp when rope_scaling is set."""
    dim, theta = config.qk_rope_head_dim, config.rope_theta
    base = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)   # [dr/2]
    scaling = config.rope_scaling
    if scaling is None:
        return base.astype(np.float32)
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        # the feature index whose wavelength completes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001                      # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)  # [dr/2]
    return (base * (1 - ramp) + base / factor * ramp).astype(np.float32)
# --8<-- [end:inv_freq]


# --8<-- [start:cos_sin_scale]
def cos_sin_scale(config: ModelConfig) -> float:
    """Factor on cos/sin (Hugging Face's ``attention_factor``): mscale / mscale_all_dim under YaRN."""
    scaling = config.rope_scaling
    if scaling is None:
        return 1.0
    factor = scaling["factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
# --8<-- [end:cos_sin_scale]


# --8<-- [start:softmax_scale]
def softmax_scale(config: ModelConfig) -> float:
    """Attention logit scale ``1/sqrt(dn + dr) * m^2`` with ``m = yarn_mscale(factor, mscale_all_dim)``."""
    scale = config.qk_head_dim ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("mscale_all_dim"):
        m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= m * m
    return scale
# --8<-- [end:softmax_scale]


# --8<-- [start:rope_tables]
def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0):
    """cos and sin tables (T, dr/2) in float32 for integer ``positions`` (T,)."""
    angles = np.outer(np.asarray(positions, dtype=np.float32), inv_freq)  # [T, dr/2]
    return (np.cos(angles) * np.float32(scale)).astype(np.float32), \
           (np.sin(angles) * np.float32(scale)).astype(np.float32)
# --8<-- [end:rope_tables]


def check_rope(x, positions, inv_freq, scale) -> None:
    """Validate ``apply_rope``'s arguments; shapes and dtypes only (device arrays too)."""
    if len(x.shape) < 2:
        raise ValueError(f"x must have shape (T, dr) or (T, H, dr), got shape {tuple(x.shape)}")
    rows, width = x.shape[0], x.shape[len(x.shape) - 1]          # (the simulator's shapes reject [-1])
    if width % 2:
        raise ValueError(f"x's last axis (dr) must be even (NeoX rotates halves), got {width}")
    if tuple(positions.shape) != (rows,) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be integers of shape ({rows},), "
                         f"got {positions.dtype} of shape {tuple(positions.shape)}")
    if tuple(inv_freq.shape) != (width // 2,):
        raise ValueError(f"inv_freq must have shape ({width // 2},) (dr/2), got {tuple(inv_freq.shape)}")
    if not (isinstance(scale, (int, float, np.floating)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")


# --8<-- [start:apply_rope]
def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
               scale: float = 1.0) -> np.ndarray:
    """Rotate ``x`` (T, ..., dr) NeoX-style; row t uses ``positions[t]``. Returns a new array.

    Heads (any middle axes) share their row's position; tree nodes may share positions too.
    """
    x, positions = np.asarray(x, dtype=np.float32), np.asarray(positions)
    check_rope(x, positions, np.asarray(inv_freq), scale)        # integer positions, as the kernel
    cos, sin = rope_tables(positions, inv_freq, scale)          # [T, dr/2] each
    middle = (1,) * (x.ndim - 2)
    cos = cos.reshape(cos.shape[0], *middle, -1)                # [T, 1.., dr/2]
    sin = sin.reshape(sin.shape[0], *middle, -1)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]                # [T, .., dr/2] each
    return np.concatenate([first * cos - second * sin,
                           second * cos + first * sin], axis=-1).astype(np.float32)
# --8<-- [end:apply_rope]
