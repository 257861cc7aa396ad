"""Equivalence: kernels/kv_cache.py compact (numba.cuda) against ddtree/kv_cache.py compact (numpy).

Compaction only copies float32 rows, so the caches must be equal bit for bit: assert_exact.
The caches are filled with random values in every slot (no NaN): a row the kernel missed keeps
its old value, which differs from the one numpy moves there. The engine's ``DeviceCache`` starts
as NaN: a row never written shows up as NaN in its host copy.
"""

import numpy as np
import pytest
from numba import cuda

from ddtree import kv_cache as reference
from ddtree.kv_cache import LatentKVCache
from kernels import kv_cache as kernel
from kernels.device import is_device_array
from tests.helpers import assert_close, assert_exact


def filled_cache(layers, capacity, latent_dim, rope_dim, length, seed=0):
    rng = np.random.default_rng(seed)
    cache = LatentKVCache(layers, capacity, latent_dim, rope_dim)
    cache.latent[...] = rng.standard_normal(cache.latent.shape)
    cache.rope[...] = rng.standard_normal(cache.rope.shape)
    cache.commit(length)
    return cache


def copy_cache(cache):
    twin = LatentKVCache(cache.num_layers, cache.capacity, cache.latent.shape[2], cache.rope.shape[2])
    twin.latent[...], twin.rope[...], twin.length = cache.latent, cache.rope, cache.length
    return twin


def assert_same_cache(actual, expected):
    latent = actual.latent.copy_to_host() if is_device_array(actual.latent) else actual.latent
    rope = actual.rope.copy_to_host() if is_device_array(actual.rope) else actual.rope
    assert actual.length == expected.length
    assert_exact(latent, expected.latent, "latent")
    assert_exact(rope, expected.rope, "rope")


# (layers, R, dr, start, tree size, accepted): irregular widths; the race case; deep paths
CASES = [
    (2, 20, 6, 5, 8, [0, 2, 3, 5]),         # accepted[j] = j + 1 for j = 1, 2: the race case
    (3, 33, 5, 0, 13, [0, 3, 7, 8, 12]),
    (1, 7, 3, 9, 4, [0, 3]),
    (2, 130, 9, 2, 6, [0, 1, 4, 5]),        # the first rows stay, then a jump
    (2, 10, 3, 3, 30, [0, 1, 3, 4, 6, 9, 11, 14, 15, 19, 22, 27]),   # m = 12: version 2's 2 batches
]


@pytest.mark.parametrize("layers, latent_dim, rope_dim, start, tree, accepted", CASES)
def test_compact_matches_reference(layers, latent_dim, rope_dim, start, tree, accepted):
    cache = filled_cache(layers, start + tree + 3, latent_dim, rope_dim, start + tree, seed=tree)
    expected = copy_cache(cache)
    reference.compact(expected, start, np.array(accepted))
    kernel.compact(cache, start, np.array(accepted))
    assert_same_cache(cache, expected)


def test_device_cache_compacts_in_place_like_the_reference():
    # the engine's cache: NaN until written, compacted by the one launch the round makes (device
    # start, path and count), its host copy a LatentKVCache
    cache = kernel.DeviceCache(2, 12, 6, 4)
    assert cache.capacity == 12 and cache.length == 0
    assert np.isnan(cache.to_host().latent).all() and np.isnan(cache.to_host().rope).all()
    expected = filled_cache(2, 12, 6, 4, 10, seed=3)
    cache.latent, cache.rope = cuda.to_device(expected.latent), cuda.to_device(expected.rope)
    accepted = np.array([0, 2, 5])
    reference.compact(expected, 3, accepted)
    kernel.launch_compact_columns(cache.latent, cache.rope, cuda.to_device(np.array([3])),
                                  cuda.to_device(accepted[None]), cuda.to_device(np.array([3])))
    cache.length = 6
    host = cache.to_host()
    assert host.length == expected.length
    assert_exact(host.latent, expected.latent, "latent")
    assert_exact(host.rope, expected.rope, "rope")


def test_naive_parallel_in_place_copy_races():
    # any order of the per-row copies is a legal schedule for parallel threads; run them in
    # decreasing j: row 2 is overwritten (with row 3) before row 1 reads it
    accepted, start = np.array([0, 2, 3, 5]), 1
    cache = filled_cache(2, 10, 8, 4, 8, seed=1)
    naive = copy_cache(cache)
    for j in reversed(range(accepted.size)):
        naive.latent[:, start + j] = naive.latent[:, start + accepted[j]]
        naive.rope[:, start + j] = naive.rope[:, start + accepted[j]]
    expected = copy_cache(cache)
    reference.compact(expected, start, accepted)
    assert not np.array_equal(naive.latent, expected.latent), "the naive schedule should differ"
    kernel.compact(cache, start, accepted)
    assert_same_cache(cache, expected)


def test_fast_path_launches_nothing(monkeypatch):
    def fail(*args):
        raise AssertionError("compact launched a kernel for an in-place path")

    monkeypatch.setattr(kernel, "launch_compact_columns", fail)
    cache = filled_cache(2, 12, 8, 4, 10)
    expected = copy_cache(cache)
    kernel.compact(cache, 4, np.arange(3))
    reference.compact(expected, 4, np.arange(3))
    assert_same_cache(cache, expected)
    assert cache.length == 7


def test_device_cache_is_compacted_in_place_and_deterministic(host_copies):
    cache = filled_cache(2, 16, 12, 5, 14, seed=3)
    expected = copy_cache(cache)
    reference.compact(expected, 3, np.array([0, 1, 4, 6, 10]))
    runs = []
    for _ in range(2):
        device_cache = copy_cache(cache)
        device_cache.latent, device_cache.rope = cuda.to_device(cache.latent), cuda.to_device(cache.rope)
        latent = device_cache.latent
        host_copies.clear()
        kernel.compact(device_cache, 3, cuda.to_device(np.array([0, 1, 4, 6, 10])),
                       stream=cuda.default_stream())
        assert host_copies == [5], "only the accepted indices come to the host, never the cache"
        assert device_cache.latent is latent and is_device_array(device_cache.rope)
        assert_same_cache(device_cache, expected)
        runs.append(device_cache.latent.copy_to_host())
    assert_exact(runs[1], runs[0], "second run")


@pytest.mark.parametrize("accepted, match", [
    ([1, 2], "start at 0"), ([0, 2, 2], "increase strictly"), ([0, 9], "cache length"),
    ([], "non-empty"), ([0.0, 1.0], "integer"),
])
def test_bad_accepted_raise_like_the_reference(accepted, match):
    cache = filled_cache(1, 12, 4, 2, 8)
    for compact in (reference.compact, kernel.compact):
        with pytest.raises(ValueError, match=match):
            compact(cache, 2, np.array(accepted))


def test_mixed_host_and_device_cache_raises():
    cache = filled_cache(1, 12, 4, 2, 8)
    cache.rope = cuda.to_device(cache.rope)
    with pytest.raises(ValueError, match="both"):
        kernel.compact(cache, 2, np.array([0, 2]))


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True])
def test_compact_kimi_dims(on_device):
    # Kimi-K2 per-layer dims (R 512, dr 64), 4 layers instead of 61, 8192 slots, a 257-node tree
    layers, capacity, start, tree = 4, 8192, 7000, 257
    cache = filled_cache(layers, capacity, 512, 64, start + tree, seed=7)
    rng = np.random.default_rng(8)
    accepted = np.concatenate([[0], np.sort(rng.choice(np.arange(1, tree), 15, replace=False))])
    expected = copy_cache(cache)
    reference.compact(expected, start, accepted)
    if on_device:
        cache.latent, cache.rope = cuda.to_device(cache.latent), cuda.to_device(cache.rope)
    kernel.compact(cache, start, accepted)
    assert_same_cache(cache, expected)


# ---- write_new_rows: the latent norms, the rope key and the cache write in one launch

def new_rows_inputs(rows, q_rank, rank, rope_dim, seed=0):
    """projected (T, Rq + R + dr), the norms' weights, tree-like positions (siblings share one),
    inv_freq, and a NaN cache of 4 + T + 3 slots."""
    rng = np.random.default_rng(seed)
    projected = rng.standard_normal((rows, q_rank + rank + rope_dim)).astype(np.float32)
    q_weight = (1 + 0.1 * rng.standard_normal(max(q_rank, 1))).astype(np.float32)[:q_rank]
    kv_weight = (1 + 0.1 * rng.standard_normal(rank)).astype(np.float32)
    positions = rng.integers(0, 3000, rows)
    positions[1::2] = positions[0]
    inv_freq = (10000.0 ** -(np.arange(rope_dim // 2) * 2 / rope_dim)).astype(np.float32)
    capacity = 4 + rows + 3
    return projected, q_weight, kv_weight, positions, inv_freq, capacity


def bits(array):
    return np.asarray(array).view(np.uint32)


@pytest.mark.parametrize("rows, q_rank, rank, rope_dim", [
    (3, 96, 64, 16),        # tiny
    (5, 0, 48, 8),          # no query latent (tiny-b: q_proj reads the hidden state)
    (2, 37, 70, 12),        # irregular widths
    (1, 1536, 512, 64),     # small's and Kimi's
])
def test_new_rows_have_the_bits_of_their_parts(rows, q_rank, rank, rope_dim):
    """q_normed, the cache's latent and rope rows: bit for bit rmsnorm's and apply_rope's device
    results, within tolerance of numpy's; every other cache slot still NaN."""
    from ddtree import rmsnorm as reference_norm
    from ddtree import rope as reference_rope
    from kernels.rmsnorm import rmsnorm
    from kernels.rope import apply_rope

    projected, q_weight, kv_weight, positions, inv_freq, capacity = new_rows_inputs(rows, q_rank, rank,
                                                                                    rope_dim)
    eps, scale, start = 1e-6, 0.75, 4
    cache_latent = cuda.to_device(np.full((capacity, rank), np.nan, np.float32))
    cache_rope = cuda.to_device(np.full((capacity, rope_dim), np.nan, np.float32))
    q_normed = cuda.to_device(np.full((rows, q_rank), np.nan, np.float32)) if q_rank else None
    kernel.write_new_rows(cuda.to_device(projected), q_rank, cuda.to_device(q_weight) if q_rank else None,
                          cuda.to_device(kv_weight), eps, cuda.to_device(positions),
                          cuda.to_device(inv_freq), scale, cache_latent, cache_rope,
                          cuda.to_device(np.array([start])), q_normed=q_normed)
    latent_part, rope_part = projected[:, q_rank:q_rank + rank], projected[:, q_rank + rank:]
    expected_latent = rmsnorm(np.ascontiguousarray(latent_part), kv_weight, eps)
    expected_rope = apply_rope(np.ascontiguousarray(rope_part), positions, inv_freq, scale)
    latent, rope = cache_latent.copy_to_host(), cache_rope.copy_to_host()
    assert np.isnan(np.delete(latent, np.s_[start:start + rows], 0)).all()
    assert np.isnan(np.delete(rope, np.s_[start:start + rows], 0)).all()
    assert_exact(bits(latent[start:start + rows]), bits(expected_latent), "latent")
    assert_exact(bits(rope[start:start + rows]), bits(expected_rope), "rope")
    assert_close(latent[start:start + rows], reference_norm.rmsnorm(latent_part, kv_weight, eps), rtol=1e-5)
    assert_close(rope[start:start + rows], reference_rope.apply_rope(rope_part, positions, inv_freq, scale),
                 rtol=1e-5, atol=1e-6)
    if q_rank:
        expected_q = rmsnorm(np.ascontiguousarray(projected[:, :q_rank]), q_weight, eps)
        assert_exact(bits(q_normed.copy_to_host()), bits(expected_q), "q_normed")
    twin_latent = np.full((capacity, rank), np.nan, np.float32)                # the numpy twin
    twin_rope = np.full((capacity, rope_dim), np.nan, np.float32)
    twin_q = reference.write_new_rows(projected, q_rank, q_weight, kv_weight, eps, positions, inv_freq,
                                      scale, twin_latent, twin_rope, start)
    assert_close(latent, twin_latent, rtol=1e-5, name="latent against the numpy twin")   # NaN masks first
    assert_close(rope, twin_rope, rtol=1e-5, atol=1e-6, name="rope against the numpy twin")
    if q_rank:
        assert_close(q_normed.copy_to_host(), twin_q, rtol=1e-5, name="q_normed against the numpy twin")
    else:
        assert twin_q is None


@pytest.mark.parametrize("threads, q_threads, kv_threads", [(64, 32, 32), (64, 64, 32), (64, 32, 64)])
def test_a_larger_block_keeps_each_norms_bits(threads, q_threads, kv_threads):
    """A norm summed by fewer threads than the block's (the GPU's tiny: 128 for Rq = 96, 64 for
    R = 64) has the bits of rmsnorm with its own thread count: the tree's extra slots are zeros."""
    from kernels.rmsnorm import rmsnorm

    rows, q_rank, rank, rope_dim = 3, 96, 64, 16
    projected, q_weight, kv_weight, positions, inv_freq, capacity = new_rows_inputs(rows, q_rank, rank,
                                                                                    rope_dim, seed=1)
    cache_latent = cuda.to_device(np.full((capacity, rank), np.nan, np.float32))
    cache_rope = cuda.to_device(np.full((capacity, rope_dim), np.nan, np.float32))
    q_normed = cuda.to_device(np.full((rows, q_rank), np.nan, np.float32))
    kernel.new_rows_kernel(threads, q_threads, kv_threads)[rows, threads](
        cuda.to_device(projected), q_rank, cuda.to_device(q_weight), cuda.to_device(kv_weight), 1e-6,
        cuda.to_device(positions), cuda.to_device(inv_freq), 1.0, cache_latent, cache_rope,
        cuda.to_device(np.array([0])), q_normed)
    expected_q = rmsnorm(np.ascontiguousarray(projected[:, :q_rank]), q_weight, 1e-6, threads=q_threads)
    expected_latent = rmsnorm(np.ascontiguousarray(projected[:, q_rank:q_rank + rank]), kv_weight, 1e-6,
                              threads=kv_threads)
    assert_exact(bits(q_normed.copy_to_host()), bits(expected_q), "q_normed")
    assert_exact(bits(cache_latent.copy_to_host()[:rows]), bits(expected_latent), "latent")


def new_rows_arguments(**changes):
    projected, q_weight, kv_weight, positions, inv_freq, capacity = new_rows_inputs(2, 6, 8, 4)
    arguments = dict(projected=cuda.to_device(projected), q_rank=6, q_weight=cuda.to_device(q_weight),
                     kv_weight=cuda.to_device(kv_weight), eps=1e-6, positions=cuda.to_device(positions),
                     inv_freq=cuda.to_device(inv_freq), scale=1.0,
                     cache_latent=cuda.to_device(np.full((capacity, 8), np.nan, np.float32)),
                     cache_rope=cuda.to_device(np.full((capacity, 4), np.nan, np.float32)),
                     start=cuda.to_device(np.array([0])),
                     q_normed=cuda.to_device(np.zeros((2, 6), np.float32)))
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize("changes, message", [
    (lambda: dict(projected=np.zeros((2, 18), np.float32)), "projected must be a device array"),
    (lambda: dict(q_normed=None), "q_normed must be a device array"),
    (lambda: dict(q_rank=-1), r"q_rank must be an integer >= 0, got -1"),
    (lambda: dict(q_rank=True), r"q_rank must be an integer >= 0, got True"),
    (lambda: dict(q_rank=5), r"projected must have shape \(2, 17\)"),
    (lambda: dict(inv_freq=cuda.to_device(np.zeros(3, np.float32))), r"inv_freq must have shape \(2,\)"),
    (lambda: dict(start=cuda.to_device(np.array([0, 1]))), r"start must have shape \(1,\)"),
    (lambda: dict(kv_weight=cuda.to_device(np.zeros(8, np.float64))), "kv_weight must be float32"),
])
def test_new_rows_bad_inputs_are_refused_by_name(changes, message):
    arguments = new_rows_arguments(**changes())
    latent_before = arguments["cache_latent"].copy_to_host()
    with pytest.raises(ValueError, match=message):
        kernel.write_new_rows(**arguments)
    assert np.isnan(arguments["cache_latent"].copy_to_host()).all() and np.isnan(latent_before).all()
