"""Multi-head latent attention (MLA), naive and absorbed: the numpy reference.

Legend: T new rows, P fully visible prefix rows, S = P + T keys, H heads,
dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, R kv_lora_rank.

The cache holds, per token, the normalised latent c (R) and the rotated rope key k_pe (dr),
shared by all heads. ``kv_b_proj`` (H*(dn+dv), R) expands c into per-head keys (W_UK) and
values (W_UV). The absorbed form never expands the cache:

    q_lat[h]    = W_UK[h].T @ q_nope[h]                           (R)
    score[h, s] = (q_lat[h] . c_s + q_pe[h] . k_pe_s) * scale
    o_lat[h]    = sum_s softmax(score[h])_s c_s                   (R)
    o[h]        = W_UV[h] @ o_lat[h]                              (dv)

One attention function serves prefill (causal mask), decode (one row) and tree verification
(ancestor mask): the first P keys are visible to every row; the T new rows see each other
through ``visible`` (T, T).
"""

import numpy as np


def split_kv_b(kv_b_proj: np.ndarray, num_heads: int, nope_dim: int, v_dim: int):
    """``kv_b_proj.weight`` (H*(dn+dv), R) -> W_UK (H, dn, R) and W_UV (H, dv, R)."""
    per_head = kv_b_proj.reshape(num_heads, nope_dim + v_dim, -1)    # [H, dn+dv, R]
    return (np.ascontiguousarray(per_head[:, :nope_dim]),            # [H, dn, R]
            np.ascontiguousarray(per_head[:, nope_dim:]))            # [H, dv, R]


def check_visibility(prefix_len: int, visible: np.ndarray, num_rows: int) -> np.ndarray:
    """Validate ``visible`` (T, T) bool; every row must see at least one key."""
    visible = np.asarray(visible)
    if visible.shape != (num_rows, num_rows) or visible.dtype != np.bool_:
        raise ValueError(f"visible must be a ({num_rows}, {num_rows}) bool array, "
                         f"got {visible.shape} {visible.dtype}")
    if prefix_len == 0 and num_rows and not visible.any(axis=1).all():
        raise ValueError("visible: with an empty prefix every row must see at least one new row "
                         "(an all-masked row has no softmax)")
    return visible


def check_attention(q_lat, q_pe, cache_latent, cache_rope, prefix_len) -> int:
    """Validate the shapes of an attention call (device arrays too; ``visible`` is
    ``check_visibility``'s); returns ``prefix_len`` as an int."""
    if len(q_lat.shape) != 3:
        raise ValueError(f"q_lat must be (T, H, R), got shape {tuple(q_lat.shape)}")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
        raise ValueError(f"prefix_len must be a non-negative integer, got {prefix_len!r}")
    rows, heads, rank = q_lat.shape
    if len(q_pe.shape) != 3 or tuple(q_pe.shape[:2]) != (rows, heads):
        raise ValueError(f"q_pe must be (T, H, dr) = ({rows}, {heads}, dr), got shape {tuple(q_pe.shape)}")
    keys, rope_dim = int(prefix_len) + rows, q_pe.shape[2]
    for name, cache, width in (("cache_latent", cache_latent, rank), ("cache_rope", cache_rope, rope_dim)):
        if len(cache.shape) != 2 or cache.shape[1] != width or cache.shape[0] < keys:
            raise ValueError(f"{name} must be (>= prefix_len + T = {keys}, {width}), "
                             f"got shape {tuple(cache.shape)}")
    return int(prefix_len)


def check_absorb_query(q_nope, w_uk) -> None:
    """q_nope (T, H, dn) and W_UK (H, dn, R) (device arrays too)."""
    if len(q_nope.shape) != 3:
        raise ValueError(f"q_nope must be (T, H, dn), got shape {tuple(q_nope.shape)}")
    heads, nope = q_nope.shape[1:]
    if len(w_uk.shape) != 3 or tuple(w_uk.shape[:2]) != (heads, nope):
        raise ValueError(f"w_uk must be (H, dn, R) = ({heads}, {nope}, R), got shape {tuple(w_uk.shape)}")


def check_absorb_output(o_lat, w_uv) -> None:
    """o_lat (T, H, R) and W_UV (H, dv, R) (device arrays too)."""
    if len(o_lat.shape) != 3:
        raise ValueError(f"o_lat must be (T, H, R), got shape {tuple(o_lat.shape)}")
    heads, rank = o_lat.shape[1:]
    if len(w_uv.shape) != 3 or w_uv.shape[0] != heads or w_uv.shape[2] != rank:
        raise ValueError(f"w_uv must be (H, dv, R) = ({heads}, dv, {rank}), got shape {tuple(w_uv.shape)}")


def key_mask(prefix_len: int, visible: np.ndarray) -> np.ndarray:
    """(T, P+T) bool: the prefix is visible to all rows, new rows through ``visible``."""
    rows = visible.shape[0]
    return np.concatenate([np.ones((rows, prefix_len), dtype=bool), visible], axis=1)  # [T, S]


def causal_visibility(num_rows: int) -> np.ndarray:
    """(T, T) lower-triangular mask: row t sees new rows 0..t."""
    return np.tri(num_rows, dtype=bool)


# --8<-- [start:masked_softmax]
def masked_softmax(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of ``scores`` (T, H, S) where ``mask`` (T, S) is True."""
    scores = np.where(mask[:, None, :], scores, -np.inf)            # [T, H, S]
    scores = scores - scores.max(axis=-1, keepdims=True)            # the row max is finite
    weights = np.exp(scores)
    return (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)
# --8<-- [end:masked_softmax]


# --8<-- [start:absorb]
def absorb_query(q_nope: np.ndarray, w_uk: np.ndarray) -> np.ndarray:
    """q_nope (T, H, dn), W_UK (H, dn, R) -> q_lat (T, H, R)."""
    return np.einsum("thn,hnr->thr", q_nope, w_uk, dtype=np.float32)  # [T, H, R]


def absorb_output(o_lat: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """o_lat (T, H, R), W_UV (H, dv, R) -> o (T, H, dv)."""
    return np.einsum("thr,hvr->thv", o_lat, w_uv, dtype=np.float32)   # [T, H, dv]


def attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, scale):
    """Absorbed attention over the latent cache.

    q_lat (T, H, R), q_pe (T, H, dr) rotated; cache_latent (>=S, R) and cache_rope (>=S, dr)
    hold the prefix in rows [0, P) and the new rows in [P, P+T). Returns o_lat (T, H, R).
    """
    rows = q_lat.shape[0]
    visible = check_visibility(prefix_len, visible, rows)
    keys = prefix_len + rows
    latent, rope = cache_latent[:keys], cache_rope[:keys]               # [S, R], [S, dr]
    scores = (np.einsum("thr,sr->ths", q_lat, latent, dtype=np.float32)
              + np.einsum("thd,sd->ths", q_pe, rope, dtype=np.float32)) * np.float32(scale)  # [T, H, S]
    probs = masked_softmax(scores, key_mask(prefix_len, visible))       # [T, H, S]
    return np.einsum("ths,sr->thr", probs, latent, dtype=np.float32)    # [T, H, R]
# --8<-- [end:absorb]


# --8<-- [start:naive]
def attention_naive(q_nope, q_pe, cache_latent, cache_rope, prefix_len, visible, scale, w_uk, w_uv):
    """The textbook form: expand every cached latent into per-head keys and values.

    q_nope (T, H, dn), q_pe (T, H, dr); returns o (T, H, dv). Same mask rules as the absorbed form.
    """
    rows = q_nope.shape[0]
    visible = check_visibility(prefix_len, visible, rows)
    keys = prefix_len + rows
    latent, rope = cache_latent[:keys], cache_rope[:keys]               # [S, R], [S, dr]
    k_nope = np.einsum("sr,hnr->shn", latent, w_uk, dtype=np.float32)   # [S, H, dn]
    values = np.einsum("sr,hvr->shv", latent, w_uv, dtype=np.float32)   # [S, H, dv]
    scores = (np.einsum("thn,shn->ths", q_nope, k_nope, dtype=np.float32)
              + np.einsum("thd,sd->ths", q_pe, rope, dtype=np.float32)) * np.float32(scale)  # [T, H, S]
    probs = masked_softmax(scores, key_mask(prefix_len, visible))       # [T, H, S]
    return np.einsum("ths,shv->thv", probs, values, dtype=np.float32)   # [T, H, dv]
# --8<-- [end:naive]
