"""Multi-head latent attention (MLA), naive and absorbed: the numpy reference.

Legend (docs/glossary.md): T rows of the forward (the new rows), P prefix rows every new row
sees, S = P + T keys, St keys row t attends to, H num_attention_heads, dn qk_nope_head_dim,
dr qk_rope_head_dim, dv v_head_dim, R kv_lora_rank.

The cache holds, per token, the normalised latent c (R) and the rotated rope key k_pe (dr),
shared by all heads. ``kv_b_proj`` (H*(dn+dv), R) expands c into per-head keys (W_UK) and
values (W_UV). The absorbed form never expands the cache:

    q_lat[h]    = W_UK[h].T @ q_nope[h]                           (R)
    score[h, s] = (q_lat[h] . c_s + q_pe[h] . k_pe_s) * scale
    o_lat[h]    = sum_s softmax(score[h])_s c_s                   (R)
    o[h]        = W_UV[h] @ o_lat[h]                              (dv)

One attention function serves prefill (causal mask), decode (one row) and tree verification
(ancestor mask): the first P keys are visible to every row; the T new rows see each other
through ``visible`` (T, T). The engine's ``attention_paths`` computes the same on a tree from
each row's path (``paths``, ``depths``) instead of a mask.
"""

import numpy as np

from ddtree.linear import dot


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
def visible_keys(prefix_len: int, visible_row: np.ndarray) -> np.ndarray:
    """Cache slots one row attends to, in position order: the prefix, then its visible new rows."""
    return np.concatenate([np.arange(prefix_len), prefix_len + np.flatnonzero(visible_row)])  # [St]


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of ``scores`` (H, St): only visible keys were scored, so no
    mask is needed and a masked key's row is never read (it may even hold NaN)."""
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))   # [H, St] the row max is 1
    return (weights / np.add.reduce(weights, axis=-1, keepdims=True)).astype(np.float32)
# --8<-- [end:masked_softmax]


# --8<-- [start:absorb]
def absorb_query(q_nope: np.ndarray, w_uk: np.ndarray) -> np.ndarray:
    """q_nope (T, H, dn), W_UK (H, dn, R) -> q_lat (T, H, R)."""
    w_uk_t = np.ascontiguousarray(np.swapaxes(w_uk, 1, 2))             # [H, R, dn]
    return dot(q_nope[:, :, None, :], w_uk_t[None])                    # [T, H, R]


def absorb_output(o_lat: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """o_lat (T, H, R), W_UV (H, dv, R) -> o (T, H, dv)."""
    return dot(o_lat[:, :, None, :], w_uv[None])                        # [T, H, dv]


def attend(q_lat, q_pe, latent, rope, scale):
    """One row's absorbed attention over the keys it sees, in position order: q_lat (H, R), q_pe
    (H, dr), their latent (St, R) and rope (St, dr) rows -> o_lat (H, R)."""
    scores = (dot(q_lat[:, None, :], latent[None])
              + dot(q_pe[:, None, :], rope[None])) * np.float32(scale)  # [H, St]
    probs = softmax(scores)                                         # [H, St]
    return dot(probs[:, None, :], latent.T[None])                   # [H, R]


def attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix_len, visible, scale):
    """Absorbed attention over the latent cache.

    q_lat (T, H, R), q_pe (T, H, dr) rotated; cache_latent (>=S, R) and cache_rope (>=S, dr)
    hold the prefix in rows [0, P) and the new rows in [P, P+T). Returns o_lat (T, H, R).
    Each row gathers its own visible keys in position order and reduces exactly those, so its
    result is the same in a tree, in a prefill or alone (batch invariance).
    """
    rows = q_lat.shape[0]
    visible = check_visibility(prefix_len, visible, rows)
    o_lat = np.empty(q_lat.shape, dtype=np.float32)                     # [T, H, R]
    for t in range(rows):
        keys = visible_keys(prefix_len, visible[t])                     # [St]
        o_lat[t] = attend(q_lat[t], q_pe[t], cache_latent[keys], cache_rope[keys], scale)  # [H, R]
    return o_lat
# --8<-- [end:absorb]


# --8<-- [start:paths]
def path_keys(prefix_len: int, path: np.ndarray) -> np.ndarray:
    """Cache slots one tree row attends to, in position order: the prefix, then its path's nodes
    root .. row (tree node m sits at slot P + m)."""
    return np.concatenate([np.arange(prefix_len), prefix_len + path])  # [St]


def attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale):
    """The engine's form of ``attention_absorb`` on a tree: each row's keys from its path, no mask.

    q_lat (T, H, R), q_pe (T, H, dr) rotated; cache_latent (>=S, R) and cache_rope (>=S, dr)
    hold the prefix in rows [0, P) and tree node m in row P + m; prefix (1,) = P (or an int);
    depths (T,) and paths (T, >= max depth + 1): paths[t, :depths[t] + 1] are the nodes root ..
    t (``ddtree.tree.visibility``'s ancestors of t, by depth). Returns o_lat (T, H, R), equal to
    ``attention_absorb`` under the ancestor mask: the same keys in the same order.
    """
    prefix_len = int(np.asarray(prefix).reshape(-1)[0])                  # P
    o_lat = np.empty(q_lat.shape, dtype=np.float32)                     # [T, H, R]
    for t in range(q_lat.shape[0]):
        keys = path_keys(prefix_len, paths[t, :depths[t] + 1])          # [St]
        o_lat[t] = attend(q_lat[t], q_pe[t], cache_latent[keys], cache_rope[keys], scale)  # [H, R]
    return o_lat
# --8<-- [end:paths]


# --8<-- [start:naive]
def attention_naive(q_nope, q_pe, cache_latent, cache_rope, prefix_len, visible, scale, w_uk, w_uv):
    """The textbook form: expand every cached latent into per-head keys and values.

    q_nope (T, H, dn), q_pe (T, H, dr); returns o (T, H, dv). Same mask rules as the absorbed form.
    """
    rows = q_nope.shape[0]
    visible = check_visibility(prefix_len, visible, rows)
    o = np.empty((rows, w_uv.shape[0], w_uv.shape[1]), dtype=np.float32)  # [T, H, dv]
    for t in range(rows):
        keys = visible_keys(prefix_len, visible[t])                     # [St]
        latent, rope = cache_latent[keys], cache_rope[keys]             # [St, R], [St, dr]
        k_nope = dot(w_uk[:, None], latent[None, :, None])              # [H, St, dn]
        values = dot(w_uv[:, None], latent[None, :, None])              # [H, St, dv]
        scores = (dot(q_nope[t][:, None, :], k_nope)
                  + dot(q_pe[t][:, None, :], rope[None])) * np.float32(scale)  # [H, St]
        probs = softmax(scores)                                         # [H, St]
        o[t] = dot(probs[:, None, :], np.swapaxes(values, 1, 2))        # [H, dv]
    return o
# --8<-- [end:naive]
