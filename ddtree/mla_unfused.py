"""Attention over tree paths in the unfused form (``kernels/mla_unfused.py``'s numpy twin): the
same result as ``ddtree.mla.attention_paths``, cut the way the engine's version 5 computes it.

Legend (docs/glossary.md): T rows, H heads, R kv_lora_rank, dr qk_rope_head_dim, P the prefix, St
the keys one row sees (P + depth + 1), C the cache's capacity in slots.

Each row's keys, in position order, fall into chunks of ``chunk_keys`` positions. With M the row's
largest score, chunk c holds sum exp(s - M) latent over its keys, M, and sum exp(s - M): every
chunk shares the row's M, so merging the chunks is one division, with no rescaling. The kernels
compute the chunks inside the prefix as one GEMM and the rest along each row's path; here each
row is a plain loop.
"""

from __future__ import annotations

import numpy as np

from ddtree.linear import dot
from ddtree.mla import path_keys

CHUNK_KEYS = 256        # key positions per chunk (the engine's on a GPU)


def unfused_chunks(capacity: int, chunk_keys: int = CHUNK_KEYS) -> int:
    """The chunks of a cache of ``capacity`` slots."""
    return -(-capacity // chunk_keys)


# --8<-- [start:unfused_partials]
def unfused_partials(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale,
                     chunk_keys: int = CHUNK_KEYS) -> np.ndarray:
    """partials (T, H, chunks of C, R + 2): for each row's chunk c of its key positions
    0 .. P + depth, [:R] = sum exp(s - M) latent, [R] = M, [R + 1] = sum exp(s - M); the chunks past
    a row's keys stay NaN. Inputs as ``ddtree.mla.attention_paths``'."""
    prefix_len = int(np.asarray(prefix).reshape(-1)[0])                       # P
    rows, heads, rank = q_lat.shape
    chunks = unfused_chunks(cache_latent.shape[0], chunk_keys)
    partials = np.full((rows, heads, chunks, rank + 2), np.nan, np.float32)   # [T, H, chunks, R + 2]
    for t in range(rows):
        keys = path_keys(prefix_len, paths[t, :depths[t] + 1])                # [St]
        scores = (dot(q_lat[t][:, None, :], cache_latent[keys][None])
                  + dot(q_pe[t][:, None, :], cache_rope[keys][None])) * np.float32(scale)   # [H, St]
        top = scores.max(axis=1)                                              # [H] M
        weights = np.exp(scores - top[:, None])                               # [H, St]
        for c in range(unfused_chunks(keys.size, chunk_keys)):
            part = slice(c * chunk_keys, (c + 1) * chunk_keys)
            partials[t, :, c, :rank] = weights[:, part] @ cache_latent[keys[part]]   # [H, R]
            partials[t, :, c, rank] = top
            partials[t, :, c, rank + 1] = weights[:, part].sum(axis=1)
    return partials


def merge_partials(partials: np.ndarray) -> np.ndarray:
    """o_lat (T, H, R): each row's chunks added (every chunk shares its row's M) and divided by
    their sum of exp(s - M); NaN chunks (past a row's keys) are left out."""
    rank = partials.shape[3] - 2
    used = np.nan_to_num(partials)                                            # [T, H, chunks, R + 2]
    return (used[..., :rank].sum(axis=2) / used[..., rank + 1].sum(axis=2)[..., None]).astype(np.float32)
# --8<-- [end:unfused_partials]
