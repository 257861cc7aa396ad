"""Linear layers, embedding gather and greedy argmax: the numpy reference.

Legend (docs/glossary.md): T rows, Din input features, Dout output features, V vocab_size,
D hidden_size. Weights are stored (Dout, Din) as in Hugging Face state dicts, so ``y = x @ W.T``.

Every dot product in the reference goes through ``dot``, which sums in one order per output
whatever the number of rows: a row's result never depends on the rows it runs with (batch
invariance), the property that makes DDTree's tree forward give AR's logits bit for bit.
"""

import numpy as np

# ``linear`` multiplies several rows per numpy call (fewer calls) but holds at most this many
# products (16 MB) at once, or one row's if the weight alone is larger
PRODUCTS_PER_CALL = 1 << 22


# --8<-- [start:dot]
def dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sum of ``a * b`` over the last axis (the others broadcast), in float32.

    Each output is numpy's pairwise sum of its products in index order, an order fixed by the
    length of the last axis alone. ``np.matmul`` would hand the work to BLAS, which picks GEMV for
    one row and GEMM for more, with different summation orders: one row alone and the same row
    in a batch would then differ in the last bits.
    """
    products = np.multiply(a, b, dtype=np.float32, order="C")   # [..., n] last axis contiguous
    return np.add.reduce(products, axis=-1)                      # [...]
# --8<-- [end:dot]


# --8<-- [start:linear]
def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x`` (T, Din) (or (..., Din)) times ``weight.T`` (Din, Dout) -> (T, Dout), float32."""
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])                                # [T, Din]
    out = np.empty((flat.shape[0], weight.shape[0]), dtype=np.float32)  # [T, Dout]
    step = max(1, PRODUCTS_PER_CALL // weight.size)                  # rows per call
    for first in range(0, flat.shape[0], step):                      # a row's sums ignore the blocks
        out[first:first + step] = dot(flat[first:first + step, None, :], weight)  # [<=step, Dout]
    return out.reshape(*x.shape[:-1], weight.shape[0])               # [..., Dout]
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
    """Greedy token per row of ``logits`` (T, V): the first maximal index, as numpy breaks ties.

    Logits are compared as float32 (the model's dtype; the kernel's too), so 1.0 and 1.0 + 1e-12
    tie here as there."""
    return np.argmax(np.asarray(logits, np.float32), axis=-1).astype(np.int64)   # [T]
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
