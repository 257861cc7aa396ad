"""Linear layers, embedding gather and greedy argmax: the numpy reference.

Legend: T rows, K input features, N output features, V vocabulary.
Weights are stored (N, K) as in Hugging Face state dicts, so ``y = x @ W.T``.
"""

import numpy as np


# --8<-- [start:linear]
def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x`` (T, K) times ``weight.T`` (K, N) -> (T, N), float32."""
    return np.matmul(x, weight.T, dtype=np.float32)             # [T, N]
# --8<-- [end:linear]


# --8<-- [start:embed]
def embed(tokens: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Rows of the embedding ``table`` (V, D) for ``tokens`` (T,) -> (T, D)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise ValueError(f"tokens must lie in [0, {table.shape[0]}), "
                         f"got min {tokens.min()} max {tokens.max()}")
    return table[tokens]                                        # [T, D]
# --8<-- [end:embed]


# --8<-- [start:argmax]
def argmax(logits: np.ndarray) -> np.ndarray:
    """Greedy token per row of ``logits`` (T, V): the first maximal index, as numpy breaks ties."""
    return np.argmax(logits, axis=-1).astype(np.int64)          # [T]
# --8<-- [end:argmax]
