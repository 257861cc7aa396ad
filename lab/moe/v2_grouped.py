"""Expert kernels version 2, grouped by expert with "tiles"' sums: what the engine ran for many
rows before version 3. ``expert_lists_kernel`` (shipped) lists each expert's (token, slot) pairs;
``expert_hidden_kernel`` and ``expert_down_kernel`` give a block an expert and a pass of 8 of its
pairs, staging each weight tile in shared memory once per pass (``tile_dots`` over the listed
rows), and ``combine_kernel`` adds each token's slots in slot order. Every dot product is version
1's sum (``kernels.moe``'s readable version: a block per pair), so it gives version 1's bits
(``SAME_BITS`` against ``moe(version=1)``): an engine could switch between the two by row count
and keep DDTree == AR. It reads an expert once per pass where version 1 reads it once per pair,
but pays two launches more (the lists, the combine) and each pair's down projection written and
read back: on tiny's experts (0.4 MB) version 1 stayed faster up to 64 rows, version 2 from 72
(``docs/results/moe-crossover-h200-2026-12-03.md``, commit a843d7c); on small's (34.6 MB) version
2 was faster at every row count, 2.8 against 3.4 ms of expert kernels at one row
(``docs/results/profile-h200-2026-12-01b.md``, commit 6f964ed). Version 3 (shipped) keeps this
grouping but sums in "warps"' order, so a warp reads a weight row coalesced straight into
registers instead of turning a 32 x 32 tile around in shared memory between two barriers per
chunk: small's MoE layer took 201 µs against 396 at one token and 1879 against 2648 at 72 on the
H200 (``docs/results/moe-versions-h200-2026-12-02.txt``, last call, commit ea8fff7), and the
engine has run version 3 in every forward since commit 102f364.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda, float32, int32

from ddtree.config import ModelConfig, preset
from ddtree.moe import MoEParams
from kernels.blocks import blocks
from kernels.device import poisoned, to_device
from kernels.linear import LANES, LANES_PADDED, MAX_SLICES, ROWS_PER_PASS, k_slices, row_passes, tile_dots
from kernels.moe import (
    LIST_TPB,
    TPB,
    _launch_route,
    check_moe,
    combine_kernel,
    device_params,
    expert_lists_kernel,
    listed_dots_one,
    listed_rows,
    moe_scratch,
    silu_times,
)
from lab.harness import Case

SHIPPED = "kernels.moe.moe"
TWIN = "ddtree.moe.moe"
SAME_BITS = True                    # against moe(version=1): every case passes version=1 to both
TOLERANCE = (1e-5, 1e-5)            # O(1) outputs of D- and F-term sums, some cancelling to near 0

listed_dots_pass = tile_dots(ROWS_PER_PASS, listed=True)
_pass_rows = listed_rows(ROWS_PER_PASS)


@cuda.jit(device=True)
def _dots(x, rows, count, weight, n0, acc, w_tile, x_tile, partial):
    """``kernels.linear.tile_dots`` over the listed rows of a pass of ``count`` pairs: a lone pair
    (every expert of a decode step) skips the other rows' work. Each pair's dot is the same either
    way."""
    if count == 1:
        listed_dots_one(x, 0, count, rows, weight, n0, acc, w_tile, x_tile, partial)
    else:
        listed_dots_pass(x, 0, count, rows, weight, n0, acc, w_tile, x_tile, partial)


# --8<-- [start:expert_hidden_kernel]
@cuda.jit
def expert_hidden_kernel(x, gate_proj, up_proj, lists, slots, per_expert, hidden):
    # hidden[p, f] = silu(gate_proj[e, f] . x_t) * (up_proj[e, f] . x_t) for each pair p = t * k + j
    # of expert e (lists[:, e]); hidden is (T * k, F). One block = features f0 .. f0 + 31
    # (blockIdx.x; lane = f) of expert e = blockIdx.y // per_expert, for its passes of
    # ROWS_PER_PASS pairs blockIdx.y % per_expert, + per_expert, ...: each staged weight tile
    # serves every pair of a pass
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    gate = cuda.local.array(ROWS_PER_PASS, float32)
    up = cuda.local.array(ROWS_PER_PASS, float32)
    rows = cuda.local.array(ROWS_PER_PASS, int32)
    pairs = cuda.local.array(ROWS_PER_PASS, int32)
    expert, own = cuda.blockIdx.y // per_expert, cuda.blockIdx.y % per_expert      # own: the first pass
    f0 = cuda.blockIdx.x * LANES
    f = f0 + cuda.threadIdx.x
    for first in range(own * ROWS_PER_PASS, lists.shape[0], per_expert * ROWS_PER_PASS):
        if lists[first, expert] < 0:
            return                                       # the expert's pairs are done
        count = _pass_rows(lists, expert, first, slots, rows, pairs)   # x rows: the pairs' tokens
        _dots(x, rows, count, gate_proj[expert], f0, gate, w_tile, x_tile, partial)
        _dots(x, rows, count, up_proj[expert], f0, up, w_tile, x_tile, partial)
        if cuda.threadIdx.x < LANES and f < hidden.shape[1]:
            for r in range(count):
                hidden[pairs[r], f] = silu_times(gate[r], up[r])
# --8<-- [end:expert_hidden_kernel]


# --8<-- [start:expert_down_kernel]
@cuda.jit
def expert_down_kernel(hidden, down_proj, lists, per_expert, down):
    # down[p, d] = down_proj[e, d] . hidden[p] for each pair p of expert e; hidden (T * k, F),
    # down (T * k, D). The blocks as expert_hidden_kernel's, over output features d
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    dots = cuda.local.array(ROWS_PER_PASS, float32)
    rows = cuda.local.array(ROWS_PER_PASS, int32)
    pairs = cuda.local.array(ROWS_PER_PASS, int32)
    expert, own = cuda.blockIdx.y // per_expert, cuda.blockIdx.y % per_expert      # own: the first pass
    d0 = cuda.blockIdx.x * LANES
    d = d0 + cuda.threadIdx.x
    for first in range(own * ROWS_PER_PASS, lists.shape[0], per_expert * ROWS_PER_PASS):
        if lists[first, expert] < 0:
            return
        count = _pass_rows(lists, expert, first, 1, rows, pairs)   # hidden rows: the pairs
        _dots(hidden, rows, count, down_proj[expert], d0, dots, w_tile, x_tile, partial)
        if cuda.threadIdx.x < LANES and d < down.shape[1]:
            for r in range(count):
                down[rows[r], d] = dots[r]
# --8<-- [end:expert_down_kernel]


def _launch_grouped(x, stacks, lists, hidden, down) -> None:
    """The two grouped kernels: x (T, D), stacks = (gate, up (E, F, D), down (E, D, F)), lists
    (T, E) -> hidden (T, k, F) and down (T, k, D), each pair's rows."""
    (rows, slots, features), width = hidden.shape, x.shape[1]
    gate_proj, up_proj, down_proj = stacks
    experts = lists.shape[1]
    flat_hidden, flat_down = hidden.reshape(rows * slots, features), down.reshape(rows * slots, width)
    per_expert = row_passes(rows)                   # blocks along y per expert: a pass of 8 pairs each
    grid = (blocks(features, LANES), experts * per_expert)                  # x over F
    expert_hidden_kernel[grid, LANES * k_slices(width)](x, gate_proj, up_proj, lists, slots, per_expert,
                                                        flat_hidden)
    grid = (blocks(width, LANES), experts * per_expert)                     # x over D
    expert_down_kernel[grid, LANES * k_slices(features)](flat_hidden, down_proj, lists, per_expert, flat_down)


def run(x, params: MoEParams, config: ModelConfig, *, version: int = 1):
    """``kernels.moe.moe`` with the experts grouped by expert and "tiles"' sums, numpy in and out:
    the router, the shared expert (one "expert" listing every row), the lists, the grouped kernels,
    the combine. ``version`` names the shipped version whose bits these are (1)."""
    if version != 1:
        raise ValueError(f"version 2 gives version 1's bits, not version {version}'s")
    x = check_moe(x, params, config, version=version)
    rows, width = x.shape
    weights, d_x = device_params(params), to_device(x, np.float32)
    scratch = moe_scratch(rows, weights, config)
    out = poisoned((rows, width))
    _launch_route(d_x, weights.gate, weights.bias, config, None, scratch.logits, scratch.arrivals,
                  scratch.ids, scratch.weights, None)
    shared = weights.shared_gate_proj is not None
    if shared:                                      # every row's one pair: its down projection is out
        features = weights.shared_gate_proj.shape[0]
        stacks = (weights.shared_gate_proj.reshape(1, features, width),
                  weights.shared_up_proj.reshape(1, features, width),
                  weights.shared_down_proj.reshape(1, width, features))
        _launch_grouped(d_x, stacks, scratch.shared.lists, scratch.shared.hidden, out.reshape(rows, 1, width))
    expert_lists_kernel[config.n_routed_experts, LIST_TPB](scratch.ids, scratch.lists)
    _launch_grouped(d_x, (weights.gate_proj, weights.up_proj, weights.down_proj), scratch.lists,
                    scratch.hidden, scratch.down)
    combine_kernel[blocks(out.size, TPB), TPB](scratch.down, scratch.weights, shared, out)
    return out.copy_to_host()


def _layer(config: ModelConfig, rows: int, width: int, seed: int, shared: bool = True, favour_zero=False):
    rng = np.random.default_rng(seed)
    experts, features = config.n_routed_experts, config.moe_intermediate_size
    wide = config.n_shared_experts * features

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    bias = (rng.standard_normal(experts) * 0.1).astype(np.float32)
    if favour_zero:
        bias[0] = 10.0                              # expert 0 is every token's first choice
    params = MoEParams(gate=w(experts, width), bias=bias, gate_proj=w(experts, features, width),
                       up_proj=w(experts, features, width), down_proj=w(experts, width, features),
                       shared_gate_proj=w(wide, width) if shared else None,
                       shared_up_proj=w(wide, width) if shared else None,
                       shared_down_proj=w(width, wide) if shared else None)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    return x, params, config


def cases() -> list[Case]:
    """tiny-b's routing (12 experts in 4 groups, top-3) with small irregular experts: a decode
    token, 6 tokens (some experts with several pairs), expert 0 taking all 9 tokens (two passes of
    8, the second partial), and a layer without a shared expert."""
    base = preset("tiny-b")

    def sized(features: int, **change) -> ModelConfig:
        return dataclasses.replace(base, moe_intermediate_size=features, **change)

    one = {"version": 1}
    return [Case("one-token", _layer(sized(19), 1, 37, 1), one),
            Case("six-tokens", _layer(sized(45), 6, 21, 2), one),
            Case("expert-0-every-token", _layer(sized(20), 9, 16, 3, favour_zero=True), one),
            Case("no-shared-no-groups", _layer(sized(13, n_group=1, topk_group=1), 4, 21, 4, shared=False),
                 one)]
