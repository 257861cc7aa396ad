"""kernels/moe.py (numba.cuda) against ddtree/moe.py (numpy): routing, SwiGLU, the MoE layer.

Expert ids must match numpy exactly. The router's gate logits are float32 dots summed in a
different order than numpy's matmul, so random tests use data whose routing decisions are
separated by far more than that noise (checked as a precondition, in float64), and tie tests
build scores that are equal by construction (x = 0, or one shared logit, plus crafted biases).

The expert kernels come in two versions: 3 (the default, what the engine runs), grouped by expert
with every dot product in ``kernels.linear``'s "warps" order, and 1, the readable one, a block per
(token, slot) pair with "tiles"' sums. Each is checked against numpy and for its own batch
invariance (a token alone equals the same token in a batch); they round differently. (The lab's
versions, ``lab/moe/``, are checked by ``tests/test_lab.py``.)

Tolerance: weights are a few float32 operations on the sigmoid scores: rtol 1e-5. Layer outputs
are O(1) sums of D- and F-term float32 dots whose order differs from numpy's BLAS, and some
entries cancel to near zero: rtol 1e-5 with atol 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddtree import moe as ref
from ddtree.config import ModelConfig, preset
from kernels import moe as gpu
from kernels import tuning
from kernels.device import cuda, is_device_array, to_device
from tests.helpers import assert_close, assert_exact, no_transfers

RTOL, ATOL = 1e-5, 1e-5


def config_with(base: str = "tiny-b", **change) -> ModelConfig:
    """tiny-b: 12 experts in 4 groups of 3, keep 2 groups, top-3, scaled by 2.827."""
    values = preset(base).to_dict()
    values.update(change)
    return ModelConfig.from_dict(values)


def crafted_router(scores: np.ndarray, width: int = 5):
    """x (1, width) and gate (E, width) whose sigmoid scores are ``scores``: one logit per expert."""
    gate = np.zeros((scores.size, width), np.float32)
    gate[:, 0] = np.log(scores / (1 - scores))
    x = np.zeros((1, width), np.float32)
    x[0, 0] = 1.0
    return x, gate


def route_both(x, gate, bias, config, **kw):
    """Kernel and numpy routing; ids must agree exactly, weights to rtol."""
    ids, weights = gpu.route(x, gate, bias, config, **kw)
    ref_ids, ref_weights = ref.route(x, gate, bias, config)
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    assert_exact(ids, ref_ids, name="expert ids")
    assert_close(weights, ref_weights, rtol=RTOL, atol=1e-7, name="routing weights")
    return ids, weights


def assert_well_separated(x, gate, bias, config, gap=1e-4):
    """Test-data precondition: no routing decision is within ``gap`` of a tie (float64 recompute).

    Checks the group scores around the topk_group cut and the kept experts' choices among the
    top k + 1 (their order and the cut); float32 summation noise is ~1e-6 here.
    """
    logits = x.astype(np.float64) @ gate.astype(np.float64).T
    choice = 1 / (1 + np.exp(-logits)) + bias                         # [T, E]
    for row in choice:
        if config.n_group > 1:
            groups = np.sort(row.reshape(config.n_group, -1), axis=-1)[:, -2:].sum(-1)
            order = np.sort(groups)[::-1]
            assert -np.diff(order[:config.topk_group + 1]).min(initial=np.inf) > gap, "near-tie of groups"
            kept = np.argsort(-groups, kind="stable")[:config.topk_group]
            row = row.reshape(config.n_group, -1)[kept].ravel()
        top = np.sort(row)[::-1][:config.num_experts_per_tok + 1]
        assert -np.diff(top).min() > gap, "near-tie of experts: pick other test data"


def random_router(config: ModelConfig, rows: int, width: int, seed: int):
    rng = np.random.default_rng(seed)
    experts = config.n_routed_experts
    x = rng.standard_normal((rows, width)).astype(np.float32)
    gate = (rng.standard_normal((experts, width)) / np.sqrt(width)).astype(np.float32)
    bias = (rng.standard_normal(experts) * 0.1).astype(np.float32)
    assert_well_separated(x, gate, bias, config)
    return x, gate, bias


# --- routing: crafted cases ------------------------------------------------------------------

def test_groups_are_excluded_before_topk():
    config = config_with()
    # group 0 holds the single best expert but a weak second; groups 1 and 3 have two good ones
    scores = np.array([0.95, 0.1, 0.1, 0.8, 0.8, 0.1, 0.2, 0.2, 0.2, 0.7, 0.75, 0.1], np.float32)
    x, gate = crafted_router(scores)
    ids, _ = route_both(x, gate, np.zeros(12, np.float32), config)
    # group sums of top-2: g0 1.05, g1 1.6, g2 0.4, g3 1.45 -> keep g1, g3 ; expert 0 is excluded
    assert_exact(ids[0], [3, 4, 10])


def test_bias_changes_selection_but_not_weights():
    config = config_with(n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
                         routed_scaling_factor=1.0)
    scores = np.linspace(0.2, 0.8, 12).astype(np.float32)
    x, gate = crafted_router(scores)
    ids, _ = route_both(x, gate, np.zeros(12, np.float32), config)
    assert_exact(ids[0], [11, 10])
    bias = np.zeros(12, np.float32)
    bias[0] = 1.0                                   # expert 0 now wins the choice...
    ids, weights = route_both(x, gate, bias, config)
    assert_exact(ids[0], [0, 11])
    assert_close(weights[0], scores[[0, 11]], rtol=1e-6)   # ...but is weighed by its unbiased score


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2)])
def test_exact_ties_go_to_the_lower_index(n_group, topk_group):
    config = config_with(n_group=n_group, topk_group=topk_group)
    x = np.zeros((2, 7), np.float32)                # x = 0: every score is exactly sigmoid(0) = 0.5
    gate = np.random.default_rng(0).standard_normal((12, 7)).astype(np.float32)
    ids, _ = route_both(x, gate, np.zeros(12, np.float32), config)
    assert_exact(ids, [[0, 1, 2]] * 2)              # all tie: experts (and groups) by index
    # ties inside the bias: experts 4, 7 and 10 share the best choice, 5 and 8 the next one
    bias = np.zeros(12, np.float32)
    bias[[4, 7, 10]] = 0.5
    bias[[5, 8]] = 0.25
    ids, _ = route_both(x, gate, bias, config)
    # with groups: g1 and g2 score 1.0 + 0.75 (g3 1.5, g0 1.0) -> experts 3..8 -> 4, 7, then 5 before 8
    assert_exact(ids[0], [4, 7, 5] if n_group == 4 else [4, 7, 10])


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (8, 3)])
def test_ties_within_one_thread_go_to_the_lower_index(n_group, topk_group):
    """48 experts on 32 threads: columns 1 and 8 of 32 each hold two picks (experts 1 and 33, 8
    and 40): a kept column's others are ranked too."""
    config = config_with(n_routed_experts=48, n_group=n_group, topk_group=topk_group, num_experts_per_tok=4)
    x = np.zeros((1, 4), np.float32)
    gate = np.ones((48, 4), np.float32)
    bias = np.zeros(48, np.float32)
    bias[[33, 1]] = 0.5
    bias[[40, 8]] = 0.25
    ids, _ = route_both(x, gate, bias, config, threads=32)
    # 8 groups of 6: g0 (holds 1) and g5 (33) score 1.0 + 0.5, g1 (8) and g6 (40) tie at 0.75 + 0.5:
    # keep g0, g5 and g1; the fourth pick is the first of the 0.5 ties in a kept group, expert 0
    assert_exact(ids[0], [1, 33, 8, 0] if n_group == 8 else [1, 33, 8, 40])


def test_group_ties_go_to_the_lower_group():
    config = config_with()                          # keep 2 of 4 groups
    x = np.zeros((1, 3), np.float32)
    gate = np.zeros((12, 3), np.float32)            # every score is 0.5; biases are dyadic: exact sums
    bias = np.array([0, 0, 0, 0.375, 0.125, 0, 0.25, 0.25, 0, 0.125, 0.375, 0], np.float32)
    # group scores (top-2 of 0.5 + bias): g0 1.0, g1 0.875 + 0.625, g2 0.75 + 0.75, g3 0.625 + 0.875:
    # g1, g2 and g3 tie at 1.5 -> keep g1 and g2, so expert 10 (0.875, in g3) cannot be chosen
    ids, _ = route_both(x, gate, bias, config)
    assert_exact(ids[0], [3, 6, 7])


@pytest.mark.parametrize("config, expected", [
    (config_with(n_group=1, topk_group=1, num_experts_per_tok=12), [7, 11, 9, 8, 6, 5, 3, 2, 0, 1, 4, 10]),
    # groups g0, g1, g3 hold a NaN (score NaN, last), g2 an inf: keep g2, then g0 (NaNs by index);
    # the 6th pick is masked (-inf) expert 3 after kept -inf expert 0, before kept NaN expert 1
    (config_with(num_experts_per_tok=6), [7, 8, 6, 2, 0, 3]),
], ids=["no-groups-every-expert", "groups"])
def test_nan_and_inf_in_numpys_order(config, expected):
    """Choices in numpy's stable argsort order of -choice: +inf first, exact ties by index, -inf
    (also the masked groups') after every number, NaN last; a group holding a NaN scores NaN."""
    scores = np.linspace(0.2, 0.8, 12).astype(np.float32)       # increasing with the index
    x, gate = crafted_router(scores)
    bias = np.array([-np.inf, np.nan, 0, 0, np.nan, 0, 0, np.inf, 0, 0, np.nan, 0], np.float32)
    ids, _ = route_both(x, gate, bias, config)
    assert_exact(ids[0], expected)


@pytest.mark.parametrize("norm", [True, False])
def test_weights_normalised_and_scaled(norm):
    config = config_with(norm_topk_prob=norm)
    x, gate, bias = random_router(config, rows=5, width=16, seed=1)
    ids, weights = route_both(x, gate, bias, config)
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ gate.T.astype(np.float64))))   # [T, E] unbiased
    chosen = np.take_along_axis(scores, ids, axis=-1)                                  # [T, k]
    if norm:
        chosen = chosen / chosen.sum(-1, keepdims=True)
    assert_close(weights, chosen * config.routed_scaling_factor, rtol=1e-5, atol=1e-7)


# --- routing: random cases -----------------------------------------------------------------------

@pytest.mark.parametrize("change, rows, width, threads", [
    (dict(), 7, 33, None),                                                    # 4 groups, keep 2, k=3
    (dict(n_group=1, topk_group=1), 5, 20, None),
    (dict(n_group=1, topk_group=1, num_experts_per_tok=1), 3, 9, None),
    # 48 experts on 32 threads: every thread scans several experts and groups of 6
    (dict(n_routed_experts=48, n_group=8, topk_group=3, num_experts_per_tok=5), 3, 26, 32),
], ids=["groups", "no-groups", "top-1", "48-experts-32-threads"])
def test_route_matches_numpy(change, rows, width, threads):
    config = config_with(**change)
    x, gate, bias = random_router(config, rows, width, seed=rows + width)
    ids, weights = route_both(x, gate, bias, config, threads=threads)
    assert (ids >= 0).all() and np.isfinite(weights).all(), "unwritten router output (-1 / NaN poison)"
    again = gpu.route(x, gate, bias, config, threads=threads)
    assert_exact(again[0], ids, name="ids rerun")
    assert_exact(again[1].view(np.uint32), weights.view(np.uint32), name="weight bits rerun")


def test_route_sums_depth_slices_in_order():
    """D = LOGIT_SLICE + 8: the logits are two depth slices (512 and 8 wide), each
    x[:, d0:d1] . gate[:, d0:d1]; against numpy, and a token alone against the batch, bit for bit
    (the slices depend on D only)."""
    config = config_with()
    depth = gpu.LOGIT_SLICE + 8
    x, gate, bias = random_router(config, rows=2, width=depth, seed=3)
    logits = to_device(np.full(gpu.logits_shape(2, config.n_routed_experts, depth), np.nan, np.float32))
    ids, weights = route_both(x, gate, bias, config, logits=logits)
    for s, (d0, d1) in enumerate([(0, gpu.LOGIT_SLICE), (gpu.LOGIT_SLICE, depth)]):
        assert_close(logits.copy_to_host()[:, s], x[:, d0:d1] @ gate[:, d0:d1].T, rtol=RTOL, atol=ATOL,
                     name=f"slice {s}")
    alone = gpu.route(x[1:], gate, bias, config)
    assert_exact(alone[0], ids[1:], name="token 1 alone: ids")
    assert_exact(alone[1].view(np.uint32), weights[1:].view(np.uint32), name="token 1 alone: weight bits")


@pytest.mark.parametrize("change, width, threads", [
    (dict(), gpu.LOGIT_SLICE + 8, None),                             # 4 groups; a full and an 8-wide slice
    (dict(n_routed_experts=20, n_group=1, topk_group=1, num_experts_per_tok=4), 70, 32),   # a part block
    (dict(n_routed_experts=gpu.ROUTE_ONE_EXPERTS, n_group=1, topk_group=1, num_experts_per_tok=2), 40, None),
], ids=["groups-two-slices", "20-experts-32-threads", "one-block-a-token"])
def test_route_one_launch_gives_the_two_kernels_bits(change, width, threads, monkeypatch):
    """One token, or a few under tuning.ROUTE_ONE_MAX_BYTES, run ``route_one_kernel`` (the slices' sums,
    then each token's last block to arrive routes it); past it, logit_slices_kernel and
    route_ranks_kernel. The batch
    in one launch and each token alone give the two kernels' logit slices, ids and weights, bit for
    bit; every block count is back at zero, so a second launch with the same ``arrivals`` routes
    again. A token with one block (E <= ROUTE_ONE_EXPERTS, D <= LOGIT_SLICE) routes without counting."""
    config = config_with(**change)
    rows = 3
    x, gate, bias = random_router(config, rows=rows, width=width, seed=width)
    shape = gpu.logits_shape(rows, config.n_routed_experts, width)

    def routed(tokens, arrivals):
        logits = to_device(np.full((tokens.shape[0],) + shape[1:], np.nan, np.float32))
        out = (to_device(np.full((tokens.shape[0], config.num_experts_per_tok), -1, np.int64)),
               to_device(np.full((tokens.shape[0], config.num_experts_per_tok), np.nan, np.float32)))
        gpu.route(tokens, gate, bias, config, threads=threads, logits=logits, arrivals=arrivals, out=out)
        return logits.copy_to_host(), out[0].copy_to_host(), out[1].copy_to_host()

    with monkeypatch.context() as patch:
        patch.setattr(tuning, "ROUTE_ONE_MAX_BYTES", 0)
        two_kernels = routed(x, None)
    for t, tokens in [(slice(0, rows), x)] + [(slice(t, t + 1), x[t:t + 1]) for t in range(rows)]:
        arrivals = to_device(np.zeros(tokens.shape[0], np.int32))
        for launch in range(2):
            where = f"tokens {t.start}..{t.stop - 1}, launch {launch}: "
            for name, got, want in zip(("logit slice bits", "ids", "weight bits"), routed(tokens, arrivals),
                                       two_kernels, strict=True):
                bits = (lambda a: a.view(np.uint32)) if got.dtype == np.float32 else (lambda a: a)
                assert_exact(bits(got), bits(want[t]), name=where + name)
            assert not arrivals.copy_to_host().any(), where + "a block count was not reset"


def test_route_one_token_on_a_large_grid_takes_the_two_kernels(monkeypatch):
    """Past tuning.ROUTE_ONE_BLOCKS_PER_SM (here 0) one token runs logit_slices_kernel and route_ranks_kernel:
    arrivals is left as it is (7, which would stop route_one_kernel's last block from routing)."""
    monkeypatch.setattr(tuning, "ROUTE_ONE_BLOCKS_PER_SM", 0)
    config = config_with()
    x, gate, bias = random_router(config, rows=1, width=40, seed=40)
    arrivals = to_device(np.array([7], np.int32))
    route_both(x, gate, bias, config, arrivals=arrivals)
    assert arrivals.copy_to_host()[0] == 7


def test_route_arrivals_are_checked():
    config = config_with()
    x, gate, bias = random_router(config, rows=1, width=9, seed=9)
    with pytest.raises(ValueError, match="arrivals must be a device array"):
        gpu.route(x, gate, bias, config, arrivals=np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=r"arrivals must be int32 of shape \(1,\)"):
        gpu.route(x, gate, bias, config, arrivals=to_device(np.zeros(2, np.int32)))    # one per token


# --- SwiGLU and the MoE layer --------------------------------------------------------------------

def random_params(config: ModelConfig, width: int, seed: int, shared: bool = True) -> ref.MoEParams:
    rng = np.random.default_rng(seed)
    experts, features = config.n_routed_experts, config.moe_intermediate_size
    shared_features = config.n_shared_experts * features

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    return ref.MoEParams(
        gate=w(experts, width), bias=(rng.standard_normal(experts) * 0.1).astype(np.float32),
        gate_proj=w(experts, features, width), up_proj=w(experts, features, width),
        down_proj=w(experts, width, features),
        shared_gate_proj=w(shared_features, width) if shared else None,
        shared_up_proj=w(shared_features, width) if shared else None,
        shared_down_proj=w(width, shared_features) if shared else None)


@pytest.mark.parametrize("rows, width, features", [(5, 40, 24), (1, 33, 70), (3, 70, 5)])
def test_swiglu_matches_numpy(rows, width, features):
    rng = np.random.default_rng(width)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    gate_proj, up_proj = (rng.standard_normal((2, features, width)) / np.sqrt(width)).astype(np.float32)
    down_proj = (rng.standard_normal((width, features)) / np.sqrt(features)).astype(np.float32)
    actual = gpu.swiglu(x, gate_proj, up_proj, down_proj)
    assert np.isfinite(actual).all(), "some output was not written (the buffer starts as NaN)"
    assert_close(actual, ref.swiglu(x, gate_proj, up_proj, down_proj), rtol=RTOL, atol=ATOL)


MOE_CASES = {   # name: (config change, T, D, shared expert)
    "groups-shared": (dict(moe_intermediate_size=24), 5, 40, True),
    "no-groups-no-shared": (dict(moe_intermediate_size=13, n_group=1, topk_group=1), 4, 21, False),
    "norm-off-2-shared": (dict(moe_intermediate_size=9, norm_topk_prob=False, n_shared_experts=2),
                          3, 17, True),
}


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_matches_numpy(name):
    change, rows, width, shared = MOE_CASES[name]
    config = config_with(**change)
    params = random_params(config, width, seed=rows * width, shared=shared)
    x = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
    assert_well_separated(x, params.gate, params.bias, config)
    actual = gpu.moe(x, params, config)
    assert isinstance(actual, np.ndarray)
    assert np.isfinite(actual).all(), "some output was not written (the buffer starts as NaN)"
    assert_close(actual, ref.moe(x, params, config), rtol=RTOL, atol=ATOL, name=f"moe {name}")


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_without_combine_leaves_the_slots_for_the_next_norm(name):
    """``moe(combine=False)``: ``out`` holds the shared expert alone (untouched without one) and the
    scratch the routed slots and their weights; the next norm's ``slots`` then add them with the bits
    of ``moe`` and a residual norm apart, h and the normed output both."""
    from kernels.rmsnorm import rmsnorm
    change, rows, width, shared = MOE_CASES[name]
    config = config_with(**change)
    params = gpu.device_params(random_params(config, width, seed=rows * width, shared=shared))
    rng = np.random.default_rng(rows)
    x = to_device(rng.standard_normal((rows, width)).astype(np.float32))
    h = rng.standard_normal((rows, width)).astype(np.float32)
    norm = np.linspace(0.5, 1.5, width).astype(np.float32)
    whole = gpu.moe(x, params, config, out=to_device(np.full((rows, width), np.nan, np.float32)))
    h_apart = to_device(h)
    apart = rmsnorm(h_apart, norm, 1e-6, residual=whole).copy_to_host()
    scratch = gpu.moe_scratch(rows, params, config)
    out = to_device(np.full((rows, width), np.nan, np.float32))
    assert gpu.moe(x, params, config, out=out, scratch=scratch, combine=False) is out
    assert np.isfinite(out.copy_to_host()).all() == shared and np.isnan(out.copy_to_host()).all() != shared
    h_fused = to_device(h)
    fused = rmsnorm(h_fused, norm, 1e-6, residual=out if shared else None,
                    slots=(scratch.down, scratch.weights))
    assert_exact(h_fused.copy_to_host().view(np.uint32), h_apart.copy_to_host().view(np.uint32), name="h")
    assert_exact(fused.copy_to_host().view(np.uint32), apart.view(np.uint32), name="the normed h")


def test_moe_without_combine_needs_version_3_and_a_scratch():
    config = config_with(moe_intermediate_size=4)
    params = random_params(config, 8, seed=0)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="combine=False needs version 3 .* version 3 and scratch None"):
        gpu.moe(x, params, config, combine=False)
    with pytest.raises(ValueError, match="combine=False needs version 3 .* version 1 and scratch given"):
        gpu.moe(x, params, config, combine=False, version=1, scratch=gpu.moe_scratch(2, params, config))
    with pytest.raises(ValueError, match="combine must be a bool, got 0"):
        gpu.moe(x, params, config, combine=0)


def run_versions(call, rows: int, width: int) -> dict:
    """``call(out, version)`` for every version, each into a fresh device buffer poisoned with NaN:
    version -> host result, every element written."""
    results = {}
    for version in gpu.VERSIONS:
        out = to_device(np.full((rows, width), np.nan, np.float32))
        results[version] = call(out, version).copy_to_host()
        assert np.isfinite(results[version]).all(), f"version {version} left an output unwritten (NaN)"
    return results


def moe_versions(x, params, config):
    """``moe`` of every version on x through one scratch (it serves all): (version -> result, the
    scratch)."""
    scratch, d_x = gpu.moe_scratch(x.shape[0], params, config), to_device(x)
    results = run_versions(lambda out, version: gpu.moe(d_x, params, config, out=out, scratch=scratch,
                                                        version=version), *x.shape)
    return results, scratch


def assert_row_alone_same(run, x, batch: np.ndarray, rows, name: str):
    """``run(x[t:t + 1])`` equals row t of ``batch`` bit for bit, for each t in ``rows``."""
    for t in rows:
        alone = run(x[t:t + 1])
        assert np.array_equal(alone[0].view(np.uint32), batch[t].view(np.uint32)), f"{name}: row {t}"


def test_version_3_shape_by_rows():
    """Version 3's launch shape on a GPU: by its passes of pass_rows(T) pairs below LANE_WIDE_FROM_ROWS
    rows (a decode row's: passes of one), a dense SwiGLU's by its own table, WIDE for many rows; the
    simulator always runs its own."""
    if gpu.SIMULATOR:
        assert {gpu.lane_shape(r, dense) for r in (1, 2, 3, 8, 72) for dense in (False, True)} == \
            {gpu.LANES_SIMULATED_MOE}
        return
    assert [gpu.lane_shape(r) for r in (1, 2, 3, 4, 5, 8, 15, 16, 72)] == \
        [gpu.LANE_BY_PASS[1], gpu.LANE_BY_PASS[2]] + [gpu.LANE_BY_PASS[4]] * 2 + [gpu.LANE_BY_PASS[8]] * 3 + \
        [gpu.LANE_WIDE] * 2
    assert [gpu.lane_shape(r, dense=True) for r in (1, 2, 4, 8, 16)] == \
        [gpu.LANE_BY_PASS_DENSE[r] for r in (1, 2, 4, 8)] + [gpu.LANE_WIDE]


# --- the grouped expert kernels: lists, passes, invariance ------------------------------------------

def expert_lists(ids, experts: int) -> np.ndarray:
    """numpy: lists[i, e] = the i-th pair t * k + j with ids[t, j] = e (ascending), -1 after."""
    rows = ids.shape[0]
    lists = np.full((rows, experts), -1, np.int32)
    for e in range(experts):
        pairs = np.flatnonzero(ids.ravel() == e)
        lists[:pairs.size, e] = pairs
    return lists


@pytest.mark.parametrize("rows, experts, top_k", [(11, 6, 3), (1, 12, 3), (4, 3, 1), (70, 5, 2)])
def test_expert_lists_match_numpy(rows, experts, top_k):
    """Each token's k distinct experts; expert 0 gets every token (two passes of 8 at T = 11), and
    the last expert none; T = 70 spans several chunks of the kernel's tokens (LIST_TPB)."""
    rng = np.random.default_rng(rows)
    ids = np.stack([np.concatenate([[0], rng.permutation(np.arange(1, experts - 1))[:top_k - 1]])
                    for _ in range(rows)]).astype(np.int64)
    lists = cuda.to_device(np.full((rows, experts), 7777, np.int32))      # poison: neither a pair nor -1
    gpu.expert_lists_kernel[experts, gpu.LIST_TPB](to_device(ids), lists)
    assert_exact(lists.copy_to_host(), expert_lists(ids, experts), name="expert lists")


def favour_expert_zero(params: ref.MoEParams) -> ref.MoEParams:
    """Params whose router picks expert 0 for every token (its bias far above every choice)."""
    bias = params.bias.copy()
    bias[0] = 10.0
    return ref.MoEParams(**{**vars(params), "bias": bias})


@pytest.mark.parametrize("rows, width, features", [(9, 16, 20), (2, 65, 7)])
def test_moe_one_expert_takes_every_token(rows, width, features, monkeypatch):
    """Expert 0 gets all T tokens (at T = 9 two passes of 8 pairs, the second one partial);
    with T = 2 most experts get none (and D = 65 spans three 32-wide chunks). Version 3 lists the
    pairs here (tuning.SLOT_ROWS 0: the path of large experts). Every version through one scratch,
    against numpy, the outputs NaN-poisoned before the launch, and a token alone (each version, by
    slot for version 3) equal to the same token in the batch, as the engine's tree rows must equal
    its AR rows."""
    monkeypatch.setattr(tuning, "SLOT_ROWS", 0)
    config = config_with(moe_intermediate_size=features)
    host_params = favour_expert_zero(random_params(config, width, seed=rows + width))
    params = gpu.device_params(host_params)
    x = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
    assert_well_separated(x, host_params.gate, host_params.bias, config)
    results, scratch = moe_versions(x, params, config)
    ids = scratch.ids.copy_to_host()
    assert (ids[:, 0] == 0).all(), "test data: expert 0 is every token's first choice"
    assert_exact(scratch.lists.copy_to_host(), expert_lists(ids, config.n_routed_experts), name="lists")
    expected = ref.moe(x, host_params, config)
    for version in gpu.VERSIONS:
        assert_close(results[version], expected, rtol=RTOL, atol=ATOL, name=f"moe version {version}")
    for t, version in ((0, 1), (rows - 1, 1), (0, 3), (rows - 1, 3)):
        assert_row_alone_same(lambda xs, v=version: gpu.moe(xs, params, config, version=v), x,
                              results[version], [t], f"moe version {version}")


# --- versions: 1 per (token, slot) pair, 3 grouped with "warps"' sums ------------------------------

@pytest.mark.parametrize("rows, width, features", [(1, 37, 19), (6, 21, 45)])
def test_moe_versions_match_numpy(rows, width, features):
    """Every version against numpy, NaN-poisoned outputs, through one scratch (it serves every
    version). T = 1: a decode step, one pair per chosen expert;
    T = 6: 18 pairs over 12 experts, some experts with several (one expert with all of them:
    ``test_moe_one_expert_takes_every_token``)."""
    config = config_with(moe_intermediate_size=features)
    host_params = random_params(config, width, seed=rows * width + features)
    params = gpu.device_params(host_params)
    x = np.random.default_rng(rows + 20).standard_normal((rows, width)).astype(np.float32)
    assert_well_separated(x, host_params.gate, host_params.bias, config)
    results, scratch = moe_versions(x, params, config)
    busiest = np.bincount(scratch.ids.copy_to_host().ravel()).max()          # an expert's most pairs
    assert rows == 1 or busiest > 1, "test data: some expert serves several pairs"
    expected = ref.moe(x, host_params, config)
    for version, actual in results.items():
        assert_close(actual, expected, rtol=RTOL, atol=ATOL, name=f"moe version {version}")


def test_version_3_by_slot_gives_the_lists_bits(monkeypatch):
    """Version 3 with a block per (token, slot) pair for T <= tuning.SLOT_ROWS tokens (no lists) gives
    the lists' passes' bits: 4 tokens, 12 pairs, some experts with several. Large experts take the
    lists past one token."""
    assert not gpu.by_slot(2, 64, tuning.LARGE_EXPERT_BYTES) and gpu.by_slot(1, 64, tuning.LARGE_EXPERT_BYTES)
    config = config_with(moe_intermediate_size=12)
    params = gpu.device_params(random_params(config, 16, seed=9))
    x = np.random.default_rng(9).standard_normal((4, 16)).astype(np.float32)
    results = {}
    for slot_rows in (0, 4):
        monkeypatch.setattr(tuning, "SLOT_ROWS", slot_rows)
        assert gpu.by_slot(4, config.n_routed_experts, 100) == (slot_rows == 4)
        results[slot_rows] = gpu.moe(to_device(x), params, config).copy_to_host()
    ids = ref.route(x, params.gate.copy_to_host(), params.bias.copy_to_host(), config)[0]
    assert np.bincount(ids.ravel()).max() > 1, "test data: an expert serves several pairs"
    assert_exact(results[4].view(np.uint32), results[0].view(np.uint32), name="by slot against the lists")


@pytest.mark.parametrize("rows, width, features", [(1, 33, 70), (9, 40, 24)])
def test_swiglu_versions_match_numpy(rows, width, features):
    """A dense SwiGLU: version 1 weighs each row's one slot by 1, version 3 lists every row (9 rows:
    two passes of 8); both equal numpy, and each version's last row alone equals the same row in
    the batch."""
    rng = np.random.default_rng(features)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    gate_proj, up_proj = (rng.standard_normal((2, features, width)) / np.sqrt(width)).astype(np.float32)
    down_proj = (rng.standard_normal((width, features)) / np.sqrt(features)).astype(np.float32)
    weights = [to_device(a) for a in (gate_proj, up_proj, down_proj)]
    scratch, d_x = gpu.dense_scratch(rows, features), to_device(x)
    results = run_versions(lambda out, version: gpu.swiglu(d_x, *weights, out=out, scratch=scratch,
                                                           version=version), rows, width)
    expected = ref.swiglu(x, gate_proj, up_proj, down_proj)
    for version, actual in results.items():
        assert_close(actual, expected, rtol=RTOL, atol=ATOL, name=f"swiglu version {version}")
        assert_row_alone_same(lambda xs, v=version: gpu.swiglu(xs, *weights, version=v), x, actual,
                              [rows - 1], f"swiglu version {version}")


def test_bad_version_is_refused():
    config = config_with(moe_intermediate_size=4)
    params = random_params(config, 8, seed=0)
    x = np.ones((2, 8), np.float32)
    shared = (params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    for version in (0, 2, 4, True, "3", 2.5):
        with pytest.raises(ValueError, match=r"version must be one of \(1, 3\), got "):
            gpu.moe(x, params, config, version=version)
        with pytest.raises(ValueError, match=r"version must be one of \(1, 3\), got "):
            gpu.swiglu(x, *shared, version=version)


def test_moe_device_path_is_deterministic():
    config = config_with(moe_intermediate_size=11)
    params = random_params(config, 19, seed=4)
    x = np.random.default_rng(5).standard_normal((3, 19)).astype(np.float32)
    assert_well_separated(x, params.gate, params.bias, config)
    host = gpu.moe(x, params, config)
    on_device = gpu.device_params(params)
    assert all(is_device_array(a) for a in (on_device.gate, on_device.down_proj, on_device.shared_up_proj))
    assert gpu.device_params(on_device).gate is on_device.gate, "device arrays are used as they are"
    out = gpu.moe(to_device(x), params, config)
    assert is_device_array(out)
    assert_exact(out.copy_to_host().view(np.uint32), host.view(np.uint32), name="bits, device vs host, rerun")
    out = gpu.moe(to_device(x), on_device, config)                 # device-side params work as given
    assert_exact(out.copy_to_host().view(np.uint32), host.view(np.uint32), name="bits, device params")
    ids, weights = gpu.route(to_device(x), on_device.gate, on_device.bias, config)
    assert is_device_array(ids) and is_device_array(weights)
    assert_exact(ids.copy_to_host(), ref.route(x, params.gate, params.bias, config)[0])


def test_swiglu_device_arrays_stay_on_the_device():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 10)).astype(np.float32)
    gate_proj, up_proj = rng.standard_normal((2, 7, 10)).astype(np.float32)
    down_proj = rng.standard_normal((10, 7)).astype(np.float32)
    out = gpu.swiglu(to_device(x), to_device(gate_proj), to_device(up_proj), to_device(down_proj))
    assert is_device_array(out)
    assert_close(out.copy_to_host(), ref.swiglu(x, gate_proj, up_proj, down_proj), rtol=RTOL, atol=ATOL)


def test_out_and_scratch_on_the_device_allocate_and_copy_nothing():
    config = config_with(moe_intermediate_size=11)
    params = gpu.device_params(random_params(config, 19, seed=4))
    host_x = np.random.default_rng(5).standard_normal((3, 19)).astype(np.float32)
    x, stream = to_device(host_x), cuda.default_stream()
    ids, weights = to_device(np.zeros((3, 3), np.int64)), to_device(np.zeros((3, 3), np.float32))
    logits = to_device(np.zeros(gpu.logits_shape(3, config.n_routed_experts, 19), np.float32))
    arrivals = to_device(np.zeros(3, np.int32))                  # route_one_kernel's block counts
    layer_out, dense_out = to_device(np.zeros((3, 19), np.float32)), to_device(np.zeros((3, 19), np.float32))
    scratch = gpu.moe_scratch(3, params, config)
    dense = gpu.dense_scratch(3, params.shared_gate_proj.shape[0])
    shared = (params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    with no_transfers():
        routed = gpu.route(x, params.gate, params.bias, config, out=(ids, weights), stream=stream,
                           logits=logits, arrivals=arrivals)
        assert gpu.moe(x, params, config, out=layer_out, stream=stream, scratch=scratch) is layer_out
        assert gpu.swiglu(x, *shared, out=dense_out, stream=stream, scratch=dense) is dense_out
    assert routed[0] is ids and routed[1] is weights
    host_params = ref.MoEParams(**{name: None if a is None else a.copy_to_host()
                                   for name, a in vars(params).items()})
    expected_ids, expected_weights = ref.route(host_x, host_params.gate, host_params.bias, config)
    assert_exact(ids.copy_to_host(), expected_ids)
    assert_close(weights.copy_to_host(), expected_weights, rtol=RTOL, atol=1e-7)
    assert_close(layer_out.copy_to_host(), ref.moe(host_x, host_params, config), rtol=RTOL, atol=ATOL)
    expected = ref.swiglu(host_x, *(a.copy_to_host() for a in shared))
    assert_close(dense_out.copy_to_host(), expected, rtol=RTOL, atol=ATOL)


def test_bad_scratch_and_out_are_named():
    config = config_with(moe_intermediate_size=4)
    params = random_params(config, 8, seed=0)
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"scratch.hidden must be float32 of shape \(2, 3, 4\)"):
        gpu.moe(x, params, config, scratch=gpu.moe_scratch(2, params, config)._replace(
            hidden=to_device(np.zeros((2, 3, 5), np.float32))))
    with pytest.raises(ValueError, match="scratch.shared must be a dense_scratch"):
        gpu.moe(x, params, config, scratch=gpu.moe_scratch(2, params, config)._replace(shared=None))
    shared = (params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    with pytest.raises(ValueError, match="scratch.ids must be a device array"):
        gpu.swiglu(x, *shared, scratch=gpu.DenseScratch(np.zeros((2, 1), np.int64), None, None, None))
    dense = gpu.dense_scratch(2, shared[0].shape[0])
    with pytest.raises(ValueError, match=r"scratch.lists must be int32 of shape \(2, 1\)"):
        gpu.swiglu(x, *shared, scratch=dense._replace(lists=to_device(np.zeros((2, 1), np.int64))), version=1)
    with pytest.raises(ValueError, match=r"scratch.shared.weights must be float32 of shape \(2, 1\)"):
        gpu.moe(x, params, config, scratch=gpu.moe_scratch(2, params, config)._replace(
            shared=dense._replace(weights=to_device(np.ones((2, 2), np.float32)))))
    with pytest.raises(ValueError, match=r"scratch.down must be float32 of shape \(2, 3, 8\)"):
        gpu.moe(x, params, config, scratch=gpu.moe_scratch(2, params, config)._replace(
            down=to_device(np.zeros((2, 3, 4), np.float32))))
    with pytest.raises(ValueError, match=r"out\[1\] \(weights\) must be float32"):
        gpu.route(x, params.gate, params.bias, config, out=(np.zeros((2, 3), np.int64), np.zeros((2, 3))))


def test_bad_inputs_are_named():
    config = config_with()
    x = np.ones((2, 8), np.float32)
    gate, bias = np.ones((12, 8), np.float32), np.zeros(12, np.float32)
    with pytest.raises(ValueError, match="gate must be"):
        gpu.route(x, gate[:, :5], bias, config)
    with pytest.raises(ValueError, match="gate must be"):
        gpu.route(x, gate[:10], bias, config)                     # E != n_routed_experts
    with pytest.raises(ValueError, match="bias must be"):
        gpu.route(x, gate, bias[:11], config)
    with pytest.raises(ValueError, match="x must be"):
        gpu.route(x[0], gate, bias, config)
    with pytest.raises(ValueError, match="threads must be"):
        gpu.route(x, gate, bias, config, threads=48)
    with pytest.raises(ValueError, match=r"threads must be a power of two in \[32, 1024\]"):
        gpu.route(x, gate, bias, config, threads=2048)
    with pytest.raises(ValueError, match=r"logits must be float32 of shape \(2, 1, 12\)"):
        gpu.route(x, gate, bias, config, logits=to_device(np.zeros((2, 12), np.float32)))
    with pytest.raises(ValueError, match="x must be float32 on the device"):
        gpu.route(to_device(x.astype(np.float64)), gate, bias, config)
    with pytest.raises(ValueError, match="down_proj must be"):
        gpu.swiglu(x, np.ones((5, 8), np.float32), np.ones((5, 8), np.float32), np.ones((5, 8), np.float32))
    with pytest.raises(ValueError, match="up_proj must be"):
        gpu.swiglu(x, np.ones((5, 8), np.float32), np.ones((4, 8), np.float32), np.ones((8, 5), np.float32))
    params = random_params(config_with(moe_intermediate_size=4), 8, seed=0)
    with pytest.raises(ValueError, match="params.down_proj must be"):
        gpu.moe(x, ref.MoEParams(**{**vars(params), "down_proj": params.up_proj}), config)
    with pytest.raises(ValueError, match="all arrays or all None"):
        gpu.moe(x, ref.MoEParams(**{**vars(params), "shared_up_proj": None}), config)
    with pytest.raises(ValueError, match="shared expert: down_proj must be"):
        gpu.moe(x, ref.MoEParams(**{**vars(params), "shared_down_proj": params.shared_gate_proj}), config)


# --- Kimi K2.6 per-layer dimensions: real GPU only ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("change", [dict(), dict(n_routed_experts=256, n_group=8, topk_group=4,
                                                 routed_scaling_factor=2.5)], ids=["kimi", "deepseek-v3"])
def test_route_at_size(change, rows):
    """Kimi K2.6's routing (E = 384, k = 8, no groups) and DeepSeek-V3's (E = 256 in 8 groups, keep
    4, k = 8) at D = 7168: against numpy (ids exactly, weights to rtol); on 128 threads (6 experts
    per column) and tokens alone against the batch, bit for bit."""
    config = config_with("kimi-k2.6", **change)
    x, gate, bias = random_router(config, rows, config.hidden_size, seed=20 + rows)
    ids, weights = route_both(x, gate, bias, config)
    narrow = gpu.route(x, gate, bias, config, threads=128)
    assert_exact(narrow[0], ids, name="128 threads: ids")
    assert_exact(narrow[1].view(np.uint32), weights.view(np.uint32), name="128 threads: weight bits")
    for t in sorted({0, rows // 2, rows - 1}):
        alone = gpu.route(x[t:t + 1], gate, bias, config)
        assert_exact(alone[0][0], ids[t], name=f"token {t} alone: ids")
        assert_exact(alone[1][0].view(np.uint32), weights[t].view(np.uint32),
                     name=f"token {t} alone: weight bits")


@pytest.mark.gpu
@pytest.mark.parametrize("version", gpu.VERSIONS)
def test_moe_kimi_dims_reduced_experts(version):
    """D = 7168, F = 2048, k = 8 and the shared expert, with 16 routed experts instead of 384:
    the full stack is 384 * 3 * 2048 * 7168 floats = 67 GB, 16 experts keep it at 2.8 GB."""
    config = config_with("kimi-k2.6", n_routed_experts=16)
    params = random_params(config, config.hidden_size, seed=12)
    x = np.random.default_rng(13).standard_normal((4, config.hidden_size)).astype(np.float32)
    assert_well_separated(x, params.gate, params.bias, config)
    # 7168- and 2048-term sequential float32 dots: atol scaled to the output's size (a numpy
    # emulation of the kernels' summation order, without FMA, used a fifth of this budget)
    expected = ref.moe(x, params, config)
    assert_close(gpu.moe(x, params, config, version=version), expected, rtol=RTOL,
                 atol=1e-5 * float(np.abs(expected).max()), name="moe K2.6")
    shared = (params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    expected = ref.swiglu(x, *shared)
    assert_close(gpu.swiglu(x, *shared, version=version), expected, rtol=RTOL,
                 atol=1e-5 * float(np.abs(expected).max()), name="swiglu K2.6")


@pytest.mark.gpu
@pytest.mark.parametrize("version", gpu.VERSIONS)
def test_moe_at_size(version):
    """T = 64, E = 64, k = 6, D = 2048, F = 1408 (2.2 GB of experts): 384 pairs, several passes
    per expert (version 3). Against numpy, and tokens alone and 9 tokens against the batch, bit
    for bit."""
    config = config_with("tiny-b", hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                         n_group=1, topk_group=1, num_experts_per_tok=6)
    host_params = random_params(config, config.hidden_size, seed=14)
    params = gpu.device_params(host_params)
    x = np.random.default_rng(15).standard_normal((64, config.hidden_size)).astype(np.float32)
    assert_well_separated(x, host_params.gate, host_params.bias, config, gap=1e-5)
    together = gpu.moe(x, params, config, version=version)
    expected = ref.moe(x, host_params, config)
    assert_close(together, expected, rtol=RTOL, atol=1e-5 * float(np.abs(expected).max()), name="moe")
    assert_row_alone_same(lambda xs: gpu.moe(xs, params, config, version=version), x, together,
                          (0, 1, 31, 63), f"moe version {version}")
    pairs = gpu.moe(x[:9], params, config, version=version)        # a bucket of 9 rows
    assert np.array_equal(pairs.view(np.uint32), together[:9].view(np.uint32)), "first 9 tokens"
