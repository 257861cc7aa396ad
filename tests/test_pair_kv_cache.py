"""Equivalence: kernels/kv_cache.py compact (numba.cuda) against ddtree/kv_cache.py compact (numpy).

Compaction only copies float32 rows, so the caches must be equal bit for bit: assert_exact.
The caches are filled with random values in every slot (no NaN), and version 1's scratch
buffers start as NaN: a row the gather missed would show up as NaN in the compacted cache.
Both versions (version 2: a thread per column, one launch) run every case.
"""

import numpy as np
import pytest
from numba import cuda

from ddtree import kv_cache as reference
from ddtree.kv_cache import LatentKVCache
from kernels import kv_cache as kernel
from kernels.device import is_device_array
from tests.helpers import assert_exact


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


@pytest.mark.parametrize("version", kernel.VERSIONS)
@pytest.mark.parametrize("layers, latent_dim, rope_dim, start, tree, accepted", CASES)
def test_compact_matches_reference(layers, latent_dim, rope_dim, start, tree, accepted, version):
    cache = filled_cache(layers, start + tree + 3, latent_dim, rope_dim, start + tree, seed=tree)
    expected = copy_cache(cache)
    reference.compact(expected, start, np.array(accepted))
    kernel.compact(cache, start, np.array(accepted), version=version)
    assert_same_cache(cache, expected)


def test_bad_version_is_refused():
    cache = filled_cache(1, 12, 4, 2, 8)
    with pytest.raises(ValueError, match="version"):
        kernel.compact(cache, 2, np.array([0, 2]), version=3)


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

    monkeypatch.setattr(kernel, "launch_compact", fail)
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
@pytest.mark.parametrize("version", kernel.VERSIONS)
@pytest.mark.parametrize("on_device", [False, True])
def test_compact_kimi_dims(on_device, version):
    # Kimi-K2 per-layer dims (R 512, dr 64), 4 layers instead of 61, 8192 slots, a 257-node tree
    layers, capacity, start, tree = 4, 8192, 7000, 257
    cache = filled_cache(layers, capacity, 512, 64, start + tree, seed=7)
    rng = np.random.default_rng(8)
    accepted = np.concatenate([[0], np.sort(rng.choice(np.arange(1, tree), 15, replace=False))])
    expected = copy_cache(cache)
    reference.compact(expected, start, accepted)
    if on_device:
        cache.latent, cache.rope = cuda.to_device(cache.latent), cuda.to_device(cache.rope)
    kernel.compact(cache, start, accepted, version=version)
    assert_same_cache(cache, expected)
