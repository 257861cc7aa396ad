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
    check_embed(tokens, table)
    return table[tokens]                                        # [T, D]
# --8<-- [end:embed]


# --8<-- [start:argmax]
def argmax(logits: np.ndarray) -> np.ndarray:
    """Greedy token per row of ``logits`` (T, V): the first maximal index, as numpy breaks ties."""
    return np.argmax(logits, axis=-1).astype(np.int64)          # [T]
# --8<-- [end:argmax]


def check_linear(x, weight) -> None:
    """Validate ``linear``'s shapes: x (T, Din) or (..., Din), weight (Dout, Din) (device arrays too)."""
    if len(x.shape) < 1:
        raise ValueError(f"x must have shape (T, Din) or (..., Din), got a {len(x.shape)}-d array")
    depth = x.shape[len(x.shape) - 1]                           # (the simulator's shapes reject [-1])
    if len(weight.shape) != 2 or weight.shape[1] != depth:
        raise ValueError(f"weight must have shape (Dout, {depth}) to match x's last axis (Din), "
                         f"got {tuple(weight.shape)}")


def check_embed(tokens, table) -> None:
    """Validate ``embed``'s arguments: integer tokens, a (V, D) table, and numpy tokens in [0, V)
    (token ids that live on a GPU are checked where they are, by the kernel)."""
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got {tokens.dtype}")
    if len(table.shape) != 2:
        raise ValueError(f"table must have shape (V, D), got {tuple(table.shape)}")
    vocab = table.shape[0]
    if isinstance(tokens, np.ndarray) and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"tokens must lie in [0, {vocab}), got min {tokens.min()} max {tokens.max()}")
