"""The latent KV cache: per layer, the normalised latent and the rotated rope key of each token.

Legend (docs/glossary.md): Ly layers, C cache capacity (slots), R kv_lora_rank,
dr qk_rope_head_dim, T rows of a forward, m accepted nodes (root included).

A forward over T new tokens first ``reserve``s T slots (nothing changes if they do not fit),
each layer ``write``s its rows, and ``commit`` makes them part of the cache. A forward that
fails half-way leaves ``length`` where it was: rows past ``length`` are never read.
"""

from __future__ import annotations

import numpy as np

from ddtree.rmsnorm import rmsnorm
from ddtree.rope import apply_rope


class CacheOverflowError(ValueError):
    """Raised when new rows would not fit; the cache is left unchanged."""


class LatentKVCache:
    def __init__(self, num_layers: int, capacity: int, latent_dim: int, rope_dim: int):
        for name, value in (("num_layers", num_layers), ("capacity", capacity),
                            ("latent_dim", latent_dim), ("rope_dim", rope_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.latent = np.full((num_layers, capacity, latent_dim), np.nan, dtype=np.float32)  # [Ly, C, R]
        self.rope = np.full((num_layers, capacity, rope_dim), np.nan, dtype=np.float32)      # [Ly, C, dr]
        self.length = 0

    @classmethod
    def for_config(cls, config, capacity: int) -> LatentKVCache:
        return cls(config.num_hidden_layers, capacity, config.kv_lora_rank, config.qk_rope_head_dim)

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    @property
    def num_layers(self) -> int:
        return self.latent.shape[0]

    # --8<-- [start:reserve_write_commit]
    def reserve(self, rows: int) -> int:
        """Check that ``rows`` more slots fit; returns the first new slot. Changes nothing."""
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        if self.length + rows > self.capacity:
            raise CacheOverflowError(
                f"KV cache overflow: {self.length} rows cached + {rows} new > capacity {self.capacity}")
        return self.length

    def write(self, layer: int, start: int, latent: np.ndarray, rope: np.ndarray) -> None:
        """Store one layer's rows at slots [start, start + n); they are not visible until commit."""
        rows = latent.shape[0]
        if start < self.length or start + rows > self.capacity:
            raise CacheOverflowError(
                f"write of {rows} rows at slot {start} outside the free slots "
                f"[{self.length}, {self.capacity})")
        self.latent[layer, start:start + rows] = latent
        self.rope[layer, start:start + rows] = rope

    def commit(self, rows: int) -> None:
        self.reserve(rows)
        self.length += rows
    # --8<-- [end:reserve_write_commit]

    def append(self, latent: np.ndarray, rope: np.ndarray) -> None:
        """Append rows for every layer at once: latent (Ly, n, R), rope (Ly, n, dr)."""
        if latent.shape[0] != self.num_layers or rope.shape[0] != self.num_layers:
            raise ValueError(f"append needs one block per layer ({self.num_layers}), "
                             f"got {latent.shape[0]} and {rope.shape[0]}")
        start = self.reserve(latent.shape[1])
        for layer in range(self.num_layers):
            self.write(layer, start, latent[layer], rope[layer])
        self.commit(latent.shape[1])

    def truncate(self, length: int) -> None:
        """Forget every row at or after ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}")
        self.length = length


def check_accepted(cache: LatentKVCache, start: int, accepted: np.ndarray) -> np.ndarray:
    """Validate a compaction request; returns ``accepted`` as int64."""
    accepted = np.asarray(accepted)
    if accepted.ndim != 1 or accepted.size == 0 or not np.issubdtype(accepted.dtype, np.integer):
        raise ValueError(f"accepted must be a non-empty 1-D integer array, got {accepted!r}")
    if accepted[0] != 0 or np.any(np.diff(accepted) <= 0):
        raise ValueError(f"accepted must start at 0 and increase strictly, got {accepted.tolist()}")
    if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)):
        raise ValueError(f"start must be an integer cache slot, got {start!r}")
    if not 0 <= start or start + accepted[-1] >= cache.length:
        raise ValueError(f"accepted rows start + {accepted.tolist()} must lie in "
                         f"[0, cache length {cache.length})")
    return accepted.astype(np.int64)


# --8<-- [start:compact]
def compact(cache: LatentKVCache, start: int, accepted: np.ndarray) -> None:
    """Keep only the accepted tree rows: slot ``start + j`` <- slot ``start + accepted[j]``.

    Verification appended the tree's rows at slots start..start+n in node order. Accepted node j
    sits at depth j, so its rotary position already equals its new slot. ``accepted[j] >= j``:
    a sequential copy in increasing j never overwrites a row it still has to read.
    """
    accepted = check_accepted(cache, start, accepted)
    kept = accepted.size
    if np.any(accepted != np.arange(kept)):                     # fast path: nothing to move
        for j in range(kept):
            cache.latent[:, start + j] = cache.latent[:, start + accepted[j]]
            cache.rope[:, start + j] = cache.rope[:, start + accepted[j]]
    cache.truncate(start + kept)
# --8<-- [end:compact]


# --8<-- [start:write_new_rows]
def write_new_rows(projected, q_rank: int, q_weight, kv_weight, eps: float, positions, inv_freq,
                   scale: float, cache_latent, cache_rope, start: int):
    """A forward's new attention rows from the stacked projection ``projected`` (T, Rq + R + dr)
    of its rows, the reference's three steps in the engine's order: the query latent's norm
    (returned, (T, Rq); None when ``q_rank`` Rq is 0), then into slots start .. start + T - 1 of
    one layer's cache_latent (C, R) and cache_rope (C, dr) the normalised latent and the rope key
    rotated at ``positions``. The twin of ``kernels.kv_cache.write_new_rows`` (one launch there)."""
    projected = np.asarray(projected, np.float32)
    rows, rank, first = projected.shape[0], cache_latent.shape[1], int(start)
    q_normed = rmsnorm(projected[:, :q_rank], q_weight, eps) if q_rank else None   # [T, Rq]
    latent = projected[:, q_rank:q_rank + rank]                                     # [T, R]
    rope = projected[:, q_rank + rank:]                                             # [T, dr]
    cache_latent[first:first + rows] = rmsnorm(latent, kv_weight, eps)
    cache_rope[first:first + rows] = apply_rope(rope, positions, inv_freq, scale)
    return q_normed
# --8<-- [end:write_new_rows]

