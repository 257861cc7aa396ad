"""RMSNorm, the numpy reference.

Legend: T rows (tokens), D features.

    y = x / sqrt(mean(x^2) + eps) * weight
"""

import numpy as np


# --8<-- [start:rmsnorm]
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalise each row of ``x`` (T, D) by its root mean square, then scale by ``weight`` (D,)."""
    x = np.asarray(x, dtype=np.float32)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)        # [T, 1]
    inv_rms = np.float32(1.0) / np.sqrt(mean_square + np.float32(eps))
    return (x * inv_rms * weight).astype(np.float32)            # [T, D]
# --8<-- [end:rmsnorm]
