"""Reference layers on crafted inputs: RoPE/YaRN, RMSNorm, attention masks, the KV cache.

Routing on crafted inputs is tested against both implementations in test_pair_moe.py.
"""

import math

import numpy as np
import pytest

from ddtree.config import preset
from ddtree.kv_cache import CacheOverflowError, LatentKVCache, compact
from ddtree.mla import attention_absorb, causal_visibility
from ddtree.rmsnorm import rmsnorm
from ddtree.rope import apply_rope, inv_freq, softmax_scale
from tests.helpers import assert_close, assert_exact


def test_rmsnorm_unit_rms():
    x = np.random.default_rng(0).standard_normal((3, 37)).astype(np.float32) * 5
    y = rmsnorm(x, np.ones(37, np.float32), 1e-6)
    assert_close(np.sqrt((y * y).mean(-1)), np.ones(3, np.float32), rtol=1e-5)


def test_rope_is_a_rotation_that_depends_only_on_relative_position():
    config = preset("tiny-b")
    freqs = inv_freq(config)
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, config.qk_rope_head_dim)).astype(np.float32)
    norm = np.linalg.norm(apply_rope(q[None], np.array([77]), freqs))
    assert math.isclose(norm, np.linalg.norm(q), rel_tol=1e-5)
    dots = [apply_rope(q[None], np.array([p + 5]), freqs)[0] @ apply_rope(k[None], np.array([p]), freqs)[0]
            for p in (0, 31, 400)]
    assert np.allclose(dots, dots[0], rtol=1e-4)


def test_yarn_ramp_and_mscale():
    config = preset("tiny-b")
    base = 1.0 / config.rope_theta ** (np.arange(0, 8, 2) / 8)
    factor = config.rope_scaling["factor"]
    # for this config the ramp runs from feature pair 0 to 2 (see docs/02_rope.md)
    expected = base * (1 - np.array([0, 0.5, 1, 1])) + base / factor * np.array([0, 0.5, 1, 1])
    assert_close(inv_freq(config), expected.astype(np.float32))
    m = 0.1 * math.log(factor) + 1
    assert math.isclose(softmax_scale(config), m * m / math.sqrt(32), rel_tol=1e-12)
    assert math.isclose(softmax_scale(preset("tiny")), 1 / math.sqrt(48), rel_tol=1e-12)


def test_attention_without_prefix_needs_a_visible_key():
    q = np.ones((2, 1, 4), np.float32)
    cache = np.ones((2, 4), np.float32)
    rope = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="every row must see"):
        attention_absorb(q, np.ones((2, 1, 2), np.float32), cache, rope, 0,
                         np.array([[True, False], [False, False]]), 1.0)
    out = attention_absorb(q, np.ones((2, 1, 2), np.float32), cache, rope, 0, causal_visibility(2), 1.0)
    assert np.isfinite(out).all()


def test_cache_overflow_changes_nothing():
    cache = LatentKVCache(2, 4, 3, 2)
    cache.append(np.ones((2, 3, 3), np.float32), np.ones((2, 3, 2), np.float32))
    before = (cache.latent.copy(), cache.rope.copy(), cache.length)
    with pytest.raises(CacheOverflowError, match="3 rows cached \\+ 2 new > capacity 4"):
        cache.append(np.zeros((2, 2, 3), np.float32), np.zeros((2, 2, 2), np.float32))
    assert cache.length == before[2]
    assert_exact(np.isnan(cache.latent), np.isnan(before[0]))
    assert np.array_equal(cache.latent[:, :3], before[0][:, :3])


def test_model_forward_overflow_leaves_cache_unchanged():
    from ddtree.model import Transformer
    from ddtree.weights import init_weights
    config = preset("micro")
    model = Transformer(config, init_weights(config))
    cache = model.new_cache(5)
    model.forward(cache, np.array([1, 2, 3]))
    snapshot = cache.latent.copy()
    with pytest.raises(CacheOverflowError):
        model.forward(cache, np.array([4, 5, 6]))
    assert cache.length == 3
    assert np.array_equal(cache.latent, snapshot, equal_nan=True)


def test_compact_moves_accepted_rows_sequentially():
    cache = LatentKVCache(1, 8, 1, 1)
    rows = np.arange(7, dtype=np.float32)[None, :, None]
    cache.append(rows, rows)
    compact(cache, 1, np.array([0, 2, 3, 5]))
    assert cache.length == 5
    assert_exact(cache.latent[0, :5, 0], [0, 1, 3, 4, 6])
    with pytest.raises(ValueError, match="start at 0 and increase"):
        compact(cache, 1, np.array([0, 0]))
    assert cache.length == 5
