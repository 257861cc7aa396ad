"""Reference layers on crafted inputs: routing rules, RoPE/YaRN, RMSNorm, the KV cache."""

import math

import numpy as np
import pytest

from ddtree.config import preset
from ddtree.kv_cache import CacheOverflowError, LatentKVCache, compact
from ddtree.mla import attention_absorb, causal_visibility
from ddtree.moe import route
from ddtree.rmsnorm import rmsnorm
from ddtree.rope import apply_rope, inv_freq, softmax_scale
from tests.helpers import assert_close, assert_exact


def routing_config(**change):
    values = preset("tiny-b").to_dict()        # 12 experts, 4 groups of 3, keep 2 groups, top-3
    values.update(change)
    return type(preset("tiny-b")).from_dict(values)


def crafted_router(scores: np.ndarray):
    """A gate whose sigmoid scores for x = e_0 are exactly ``scores``."""
    logits = np.log(scores / (1 - scores))
    gate = np.zeros((scores.size, 4), np.float32)
    gate[:, 0] = logits
    x = np.zeros((1, 4), np.float32)
    x[0, 0] = 1.0
    return x, gate


def test_groups_are_excluded_before_topk():
    config = routing_config()
    # group 0 holds the single best expert but a weak second; groups 1 and 3 have two good ones
    scores = np.array([0.95, 0.1, 0.1, 0.8, 0.8, 0.1, 0.2, 0.2, 0.2, 0.7, 0.75, 0.1], np.float32)
    x, gate = crafted_router(scores)
    ids, _ = route(x, gate, np.zeros(12, np.float32), config)
    # group sums of top-2: g0 1.05, g1 1.6, g2 0.4, g3 1.45 -> keep g1, g3 ; expert 0 is excluded
    assert_exact(ids[0], [3, 4, 10])


def test_bias_changes_selection_but_not_weights():
    config = routing_config(n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
                            routed_scaling_factor=1.0)
    scores = np.linspace(0.2, 0.8, 12).astype(np.float32)
    x, gate = crafted_router(scores)
    ids, weights = route(x, gate, np.zeros(12, np.float32), config)
    assert_exact(ids[0], [11, 10])
    bias = np.zeros(12, np.float32)
    bias[0] = 1.0                                   # expert 0 now wins the choice...
    ids, weights = route(x, gate, bias, config)
    assert_exact(ids[0], [0, 11])
    assert_close(weights[0], scores[[0, 11]])       # ...but is weighed by its unbiased score


def test_weights_normalised_and_scaled():
    config = routing_config()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    gate = rng.standard_normal((12, 16)).astype(np.float32)
    _, weights = route(x, gate, np.zeros(12, np.float32), config)
    assert_close(weights.sum(-1), np.full(5, config.routed_scaling_factor, np.float32))


def test_exact_ties_go_to_the_lower_index():
    config = routing_config(n_group=1, topk_group=1, num_experts_per_tok=3)
    x, gate = crafted_router(np.full(12, 0.5, np.float32))
    ids, _ = route(x, gate, np.zeros(12, np.float32), config)
    assert_exact(ids[0], [0, 1, 2])
    config = routing_config()                                   # groups tie too
    ids, _ = route(x, gate, np.zeros(12, np.float32), config)
    assert_exact(ids[0], [0, 1, 2])


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
