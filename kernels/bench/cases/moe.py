"""The benchmark of ``kernels.moe``: the router alone and a MoE layer with fewer routed experts, as
the engine runs them, and the byte and FLOP counts they are measured against."""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
from numba import cuda

from ddtree import moe as reference
from ddtree.moe import MoEParams
from kernels.bench.case import Case, uniform
from kernels.device import filled, poisoned
from kernels.moe import logits_shape, moe, moe_scratch, route

F32, I64 = 4, 8


def _route_cost(*, T: int, D: int, E: int, k: int) -> tuple[int, int]:
    # x (T, D), gate (E, D), bias (E,) read once; ids (int64) and weights written; the gate GEMV
    return F32 * (T * D + E * D + E) + T * k * (I64 + F32), 2 * T * E * D


def _swiglu_cost(*, T: int, D: int, F: int) -> tuple[int, int]:
    # x (T, D) and the three (F, D) matrices read once, y (T, D) written once; three GEMVs
    return F32 * (2 * T * D + 3 * F * D), 2 * T * 3 * F * D


def _moe_cost(*, T: int, D: int, E: int, F: int, Fs: int, k: int, used: int) -> tuple[int, int]:
    # x read and y written, the router's gate and bias, the ``used`` routed experts the tokens
    # chose and the shared expert read once; the router, the shared expert, k experts per token
    return (F32 * (2 * T * D + E * D + E + 3 * used * F * D + 3 * Fs * D),
            2 * T * E * D + 2 * T * 3 * Fs * D + 2 * T * k * 3 * F * D)


_COSTS = {"route": _route_cost, "swiglu": _swiglu_cost, "moe": _moe_cost}


def bytes_moved(operation: str = "moe", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once; float32 4 B, int64 8 B). Dimensions by the glossary: "route" (T, D, E, k), "swiglu"
    (T, D, F), "moe" (T, D, E, F, Fs, k, used: the distinct routed experts the tokens chose)."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "moe", **dims: int) -> int:
    """Floating-point operations (a multiply-add counts 2; sigmoids not counted), dimensions as in
    ``bytes_moved``."""
    return _COSTS[operation](**dims)[1]


def _route_case(sizes) -> Case:
    config, rows = sizes.config, sizes.route_tokens
    hidden, experts, top_k = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    dims = {"T": rows, "D": hidden, "E": experts, "k": top_k}
    logits = logits_shape(rows, experts, hidden)
    return Case("moe_route", f"router: sigmoid scores, top-{top_k} of {experts} experts, {rows} tokens",
                f"x ({rows}, {hidden}) gate ({experts}, {hidden})",
                setup=lambda seed: (uniform((rows, hidden), seed),
                                    uniform((experts, hidden), seed + 1, 1 / math.sqrt(hidden)),
                                    uniform((experts,), seed + 2, 0.01), config),
                call=lambda inputs, **given: route(*inputs, **given),
                bytes=bytes_moved("route", **dims), flops=flops("route", **dims),
                note=f"sliced logits (S = {logits[1]}), top-k by rank",
                prepare=lambda inputs: (route(*inputs), poisoned(logits),       # + logits, block counts
                                        filled((rows,), 0, np.int32)),
                launch=lambda inputs, given, stream: route(*inputs, out=given[0], logits=given[1],
                                                           arrivals=given[2], stream=stream))


def _reduced_moe_case(sizes) -> Case:
    """The MoE layer with fewer routed experts (the real expert and shared sizes, the same top-k)."""
    full = sizes.config
    config = dataclasses.replace(full, n_routed_experts=sizes.moe_experts)
    rows, experts = sizes.moe_tokens, sizes.moe_experts
    hidden, features = full.hidden_size, full.moe_intermediate_size
    shared = full.n_shared_experts * features                                  # Fs
    rng = np.random.default_rng(zlib.crc32(b"moe_reduced"))
    x = rng.uniform(-1, 1, (rows, hidden)).astype(np.float32)                 # [T, D] host copies:
    gate = rng.uniform(-1, 1, (experts, hidden)).astype(np.float32) / np.float32(math.sqrt(hidden))
    bias = rng.uniform(-0.01, 0.01, experts).astype(np.float32)               # routing on the host
    used = np.unique(reference.route(x, gate, bias, config)[0]).size          # counts experts read

    def setup(seed):
        params = MoEParams(
            gate=cuda.to_device(gate), bias=cuda.to_device(bias),
            gate_proj=uniform((experts, features, hidden), seed, 1 / math.sqrt(hidden)),
            up_proj=uniform((experts, features, hidden), seed + 1, 1 / math.sqrt(hidden)),
            down_proj=uniform((experts, hidden, features), seed + 2, 1 / math.sqrt(features)),
            shared_gate_proj=uniform((shared, hidden), seed + 3, 1 / math.sqrt(hidden)),
            shared_up_proj=uniform((shared, hidden), seed + 4, 1 / math.sqrt(hidden)),
            shared_down_proj=uniform((hidden, shared), seed + 5, 1 / math.sqrt(shared)))
        return cuda.to_device(x), params, config

    weights_gb = (experts * 3 * features * hidden + 3 * shared * hidden) * F32 / 1e9
    dims = {"T": rows, "D": hidden, "E": experts, "F": features, "Fs": shared,
            "k": full.num_experts_per_tok}
    return Case("moe_reduced",
                f"MoE layer, {rows} tokens, {experts} experts instead of "
                f"{full.n_routed_experts} (weights {weights_gb:.1f} GB), top-{full.num_experts_per_tok} "
                "+ shared expert", f"x ({rows}, {hidden}) experts ({experts}, {features}, {hidden})",
                setup=setup, call=lambda inputs, **given: moe(*inputs, **given),
                bytes=bytes_moved("moe", **dims, used=used), flops=flops("moe", **dims, used=used),
                note=f"bytes: the {used} experts chosen read once",
                prepare=lambda inputs: (moe(*inputs), moe_scratch(rows, inputs[1], config)),
                launch=lambda inputs, given, stream: moe(*inputs, out=given[0], scratch=given[1],
                                                         stream=stream))


def bench_cases(sizes) -> list[Case]:
    """``python -m kernels.bench``'s cases of ``kernels.moe``: the router alone, a reduced MoE layer."""
    return [_route_case(sizes), _reduced_moe_case(sizes)]
