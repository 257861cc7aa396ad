"""numpy and numba accept and refuse the same inputs at the edges (the exact-and-robust issue's
item 8): each case runs the numpy function and its kernel twin and expects the same answer, or the
same ValueError naming the same thing."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree import accept as ref_accept
from ddtree import kv_cache as ref_kv
from ddtree import linear as ref_linear
from ddtree import rope as ref_rope
from ddtree.tree import DraftTree
from kernels import accept as gpu_accept
from kernels import kv_cache as gpu_kv
from kernels import linear as gpu_linear
from kernels import rope as gpu_rope


def test_argmax_compares_float32_on_both_sides():
    """1.0 and 1.0 + 1e-12 are one float32: both pick the first, whatever dtype came in."""
    logits = np.array([[1.0, 1.0 + 1e-12, 0.5], [0.0, -1.0, 2.0]], np.float64)
    assert ref_linear.argmax(logits).tolist() == gpu_linear.argmax(logits).tolist() == [0, 2]
    assert ref_linear.argmax(logits.astype(np.int64)).tolist() == [0, 2]


def test_fractional_rope_positions_are_refused_by_both():
    x = np.ones((2, 4), np.float32)
    inv_freq = np.array([1.0, 0.1], np.float32)
    for apply_rope in (ref_rope.apply_rope, gpu_rope.apply_rope):
        with pytest.raises(ValueError, match="positions must be integers"):
            apply_rope(x, np.array([0.5, 1.0]), inv_freq)


def test_duplicate_sibling_tokens_are_refused_by_both():
    tree = DraftTree(tokens=[7, 3, 3], parents=[-1, 0, 0], depths=[0, 1, 1], ranks=[-1, 0, 1],
                     logprobs=[0.0, -0.1, -0.2])
    for accept in (ref_accept.accept, gpu_accept.accept):
        with pytest.raises(ValueError, match="siblings must carry distinct tokens"):
            accept(tree, np.array([3, 1, 2]))


@pytest.mark.parametrize("start", [2.0, True, "2"])
def test_a_non_integer_compaction_start_is_refused_by_both(start):
    for compact in (ref_kv.compact, gpu_kv.compact):
        cache = ref_kv.LatentKVCache(1, 8, 4, 2)
        cache.latent[:] = 1.0
        cache.rope[:] = 1.0
        cache.length = 6
        with pytest.raises(ValueError, match="start must be an integer"):
            compact(cache, start, np.array([0, 2]))
        assert cache.length == 6
