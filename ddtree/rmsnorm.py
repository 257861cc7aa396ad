"""RMSNorm, the numpy reference.

Legend (docs/glossary.md): T rows, D hidden_size (the latent norms normalise Rq or R features the
same way).

    y = x / sqrt(mean(x^2) + eps) * weight
"""

import math

import numpy as np


# --8<-- [start:rmsnorm]
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalise each row of ``x`` (T, D) by its root mean square, then scale by ``weight`` (D,)."""
    x = np.asarray(x, dtype=np.float32)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)        # [T, 1]
    inv_rms = np.float32(1.0) / np.sqrt(mean_square + np.float32(eps))
    return (x * inv_rms * weight).astype(np.float32)            # [T, D]
# --8<-- [end:rmsnorm]


def check_rmsnorm(x, weight, eps) -> None:
    """Validate ``x`` (T, D) or (..., D), ``weight`` (D,) and ``eps``; shapes only (device arrays too)."""
    if len(x.shape) < 1:
        raise ValueError(f"x must have shape (T, D) or (..., D), got a {len(x.shape)}-d array")
    width = x.shape[len(x.shape) - 1]                             # (the simulator's shapes reject [-1])
    if tuple(weight.shape) != (width,):
        raise ValueError(f"weight must have shape ({width},) to match x's last axis, "
                         f"got {tuple(weight.shape)}")
    if not (isinstance(eps, (int, float, np.floating)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a non-negative finite number, got {eps!r}")
