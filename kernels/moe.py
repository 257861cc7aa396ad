"""Mixture of experts with DeepSeek-V3 routing: the numba.cuda twin of ``ddtree/moe.py``.

Legend: T tokens, D hidden, E routed experts, G groups, k experts per token,
F moe_intermediate_size (the shared expert has Fs = n_shared_experts * F).

Kernels (one version each):
- ``route_kernel``: one block per token: gate GEMV + sigmoid, group-limited top-k by repeated
  block-wide argmax (exact ties -> lower index), normalised and scaled weights.
- ``expert_hidden_kernel``: h[t, j] = silu(gate_e x_t) * (up_e x_t) for expert e = ids[t, j],
  one thread per (token, slot, f).
- ``expert_down_kernel``: out[t] (+)= sum_j w[t, j] * down_e h[t, j], one thread per (token, d);
  the k slots are summed in slot order, so the result is deterministic without atomics.

A dense SwiGLU (the dense layers and the shared expert) is the same two kernels with one
"expert" (E = 1), one slot (k = 1) and weight 1. ``moe`` runs the shared expert first, then adds
the routed experts in place: four launches plus the router, nothing leaves the device.

Inputs are numpy arrays (results come back as numpy) or numba device arrays (results stay on the
device). MoE weights are large and reused every step, so ``moe`` copies a host ``MoEParams`` to
the device once and keeps the copy while that params object lives (``device_params``); weights
are treated as read-only from then on. ``swiglu`` copies host weights on every call: pass device
arrays to avoid it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numba import cuda, float32, int32, uint8

from ddtree.config import ModelConfig
from ddtree.moe import MoEParams
from kernels.device import (
    blocks,
    check_float32,
    is_device_array,
    poisoned,
    pow2_threads,
    row_threads,
    to_device,
    to_host_if,
)

MAX_THREADS = 128       # router block size (a power of two: tree reductions); static scratch size
MAX_EXPERTS = 1024      # router shared arrays hold one score per expert (DeepSeek 256, Kimi 384)
MAX_GROUPS = 64         # ... and one score per group (DeepSeek 8)
THREADS = 128           # most threads per block of the expert kernels








def _check_shape(name: str, x, expected: tuple, legend: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must be {legend} = {expected}, got shape {tuple(x.shape)}")


# --8<-- [start:sigmoid]
@cuda.jit(device=True)
def sigmoid(z):
    """1 / (1 + exp(-z)) without overflow: exp is only taken of a non-positive number."""
    if z >= float32(0.0):
        return float32(1.0) / (float32(1.0) + math.exp(-z))
    e = math.exp(z)
    return e / (float32(1.0) + e)
# --8<-- [end:sigmoid]


# --8<-- [start:block_argmax]
@cuda.jit(device=True)
def block_argmax(values, free, count, best_value, best_index):
    """The index i < count with free[i] != 0 and the largest values[i]; exact ties -> lowest i.

    Every thread of the block gets the answer (-1 if nothing is free). Thread t first scans
    i = t, t + blockDim.x, ... in increasing order (a strict > keeps the first of equal values),
    then a shared-memory tree merges the per-thread winners, preferring the lower index on ties.
    ``best_value``/``best_index`` are blockDim.x scratch slots; blockDim.x is a power of two.
    """
    tid = cuda.threadIdx.x
    mine_value = float32(0.0)
    mine_index = int32(-1)                   # -1: this thread has seen no free entry
    for i in range(tid, count, cuda.blockDim.x):
        if free[i] != 0 and (mine_index < 0 or values[i] > mine_value):
            mine_value = values[i]
            mine_index = i
    best_value[tid] = mine_value
    best_index[tid] = mine_index
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            other = best_index[tid + stride]
            here = best_index[tid]
            if other >= 0 and (here < 0 or best_value[tid + stride] > best_value[tid]
                               or (best_value[tid + stride] == best_value[tid] and other < here)):
                best_value[tid] = best_value[tid + stride]
                best_index[tid] = other
        cuda.syncthreads()
        stride //= 2
    winner = best_index[0]
    cuda.syncthreads()                       # everyone has read the winner before scratch is reused
    return winner
# --8<-- [end:block_argmax]


# --8<-- [start:route_kernel]
@cuda.jit
def route_kernel(x, gate, bias, n_group, topk_group, norm_topk_prob, scaling, ids, weights):
    """One block routes one token: ids[t, :] (k) and weights[t, :] (k).

    1. Thread e (strided over E) computes score[e] = sigmoid(x_t . gate[e]) with a float32 loop
       over D, and choice[e] = score[e] + bias[e] (the bias only chooses).
    2. With G > 1 groups, thread g scores group g by the sum of its two best choices; topk_group
       rounds of ``block_argmax`` over the groups keep the best ones; other groups' experts are
       no longer free.
    3. k rounds of ``block_argmax`` over the free experts pick ids in descending choice order
       (exact ties -> lower index, as numpy's stable argsort).
    4. Thread 0 weighs each pick by its unbiased score, normalised and scaled.

    Shared memory: score, choice (E floats each), free (E bytes), group score / kept (G each),
    and blockDim.x (value, index) argmax scratch slots. Cost: the block reads gate (E*D floats)
    once per token, each thread walking whole gate rows (neighbouring threads D floats apart);
    selection is k + topk_group block reductions of log2(blockDim.x) barriers each.
    """
    token = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    experts = gate.shape[0]
    hidden = gate.shape[1]
    top_k = ids.shape[1]

    score = cuda.shared.array(MAX_EXPERTS, dtype=float32)       # [E] sigmoid(gate x), unbiased
    choice = cuda.shared.array(MAX_EXPERTS, dtype=float32)      # [E] score + bias, picks only
    free = cuda.shared.array(MAX_EXPERTS, dtype=uint8)          # [E] 1 = may still be picked
    group_score = cuda.shared.array(MAX_GROUPS, dtype=float32)  # [G] sum of the top-2 choices
    group_free = cuda.shared.array(MAX_GROUPS, dtype=uint8)     # [G] 1 = not kept yet
    best_value = cuda.shared.array(MAX_THREADS, dtype=float32)  # argmax scratch
    best_index = cuda.shared.array(MAX_THREADS, dtype=int32)    # argmax scratch

    # 1. scores
    for e in range(tid, experts, threads):
        logit = float32(0.0)
        for d in range(hidden):
            logit += x[token, d] * gate[e, d]
        score[e] = sigmoid(logit)
        choice[e] = score[e] + bias[e]
        free[e] = 1
    cuda.syncthreads()

    # 2. group-limited routing: keep the topk_group groups with the best top-2 sums
    if n_group > 1:
        size = experts // n_group
        for g in range(tid, n_group, threads):
            first = choice[g * size]                              # the best two of the group
            second = choice[g * size + 1]
            if second > first:
                first, second = second, first
            for e in range(g * size + 2, (g + 1) * size):
                if choice[e] > first:
                    second = first
                    first = choice[e]
                elif choice[e] > second:
                    second = choice[e]
            group_score[g] = second + first
            group_free[g] = 1
        cuda.syncthreads()
        for _ in range(topk_group):
            g = block_argmax(group_score, group_free, n_group, best_value, best_index)
            if tid == 0:
                group_free[g] = 0                                 # kept: no longer free to pick
            cuda.syncthreads()
        for e in range(tid, experts, threads):
            free[e] = 1 - group_free[e // size]                   # experts of kept groups only
        cuda.syncthreads()

    # 3. top-k in descending choice order
    for j in range(top_k):
        e = block_argmax(choice, free, experts, best_value, best_index)
        if tid == 0:
            ids[token, j] = e
            free[e] = 0
        cuda.syncthreads()

    # 4. weights: unbiased scores, normalised, scaled
    if tid == 0:
        total = float32(0.0)
        for j in range(top_k):
            total += score[ids[token, j]]
        for j in range(top_k):
            w = score[ids[token, j]]
            if norm_topk_prob:
                w = w / (total + float32(1e-20))
            weights[token, j] = w * scaling
# --8<-- [end:route_kernel]


# --8<-- [start:expert_hidden_kernel]
@cuda.jit
def expert_hidden_kernel(x, gate_proj, up_proj, ids, hidden):
    """hidden[t, j, f] = silu(gate_proj[e, f] . x_t) * (up_proj[e, f] . x_t), e = ids[t, j].

    One thread computes one (token, slot, f) element with two float32 loops over D; blockIdx.y is
    the (token, slot) pair, so a block's threads share x_t (broadcast) and walk neighbouring rows
    of one expert. No shared memory. Cost: 2*D multiply-adds per thread; each (token, slot)
    reads its expert's gate and up rows (2*F*D floats), neighbouring threads D floats apart.
    """
    f = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    token = cuda.blockIdx.y // ids.shape[1]
    slot = cuda.blockIdx.y % ids.shape[1]
    if f >= hidden.shape[2]:
        return
    expert = ids[token, slot]
    g = float32(0.0)
    u = float32(0.0)
    for d in range(x.shape[1]):
        g += gate_proj[expert, f, d] * x[token, d]
        u += up_proj[expert, f, d] * x[token, d]
    hidden[token, slot, f] = g * sigmoid(g) * u
# --8<-- [end:expert_hidden_kernel]


# --8<-- [start:expert_down_kernel]
@cuda.jit
def expert_down_kernel(hidden, down_proj, ids, weights, accumulate, out):
    """out[t, d] = (out[t, d] if accumulate else 0) + sum_j weights[t, j] * (down_e[d] . hidden[t, j]).

    One thread computes one (token, d) element: for each slot j in order, a float32 loop over F.
    Fixed slot order and one writer per element: deterministic, no atomics. No shared memory.
    Cost: k*F multiply-adds per thread; each token reads its k experts' down rows (k*D*F floats).
    """
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    token = cuda.blockIdx.y
    if d >= out.shape[1]:
        return
    total = out[token, d] if accumulate else float32(0.0)
    for slot in range(ids.shape[1]):
        expert = ids[token, slot]
        y = float32(0.0)
        for f in range(hidden.shape[2]):
            y += down_proj[expert, d, f] * hidden[token, slot, f]
        total += weights[token, slot] * y
    out[token, d] = total
# --8<-- [end:expert_down_kernel]


def _launch_experts(x, gate_proj, up_proj, down_proj, ids, weights, out, accumulate):
    """Both expert kernels on device arrays: x (T, D), stacks (E, F, D) / (E, D, F), ids (T, k)."""
    rows, slots = ids.shape
    features = gate_proj.shape[1]
    width = out.shape[1]
    hidden = poisoned((rows, slots, features))                                # [T, k, F]
    threads = row_threads(features)
    expert_hidden_kernel[(blocks(features, threads), rows * slots), threads](
        x, gate_proj, up_proj, ids, hidden)
    threads = row_threads(width)
    expert_down_kernel[(blocks(width, threads), rows), threads](
        hidden, down_proj, ids, weights, accumulate, out)


def _dense_slots(rows: int):
    """ids (T, 1) = 0 and weights (T, 1) = 1: a dense SwiGLU as one always-chosen expert."""
    return (cuda.to_device(np.zeros((rows, 1), np.int64)),
            cuda.to_device(np.ones((rows, 1), np.float32)))


def _check_swiglu(x, gate_proj, up_proj, down_proj) -> None:
    if len(x.shape) != 2:
        raise ValueError(f"x must be (T, D), got shape {tuple(x.shape)}")
    width = x.shape[1]
    if len(gate_proj.shape) != 2 or gate_proj.shape[1] != width:
        raise ValueError(f"gate_proj must be (F, D) with D = {width}, got shape {tuple(gate_proj.shape)}")
    features = gate_proj.shape[0]
    _check_shape("up_proj", up_proj, (features, width), "(F, D)")
    _check_shape("down_proj", down_proj, (width, features), "(D, F)")
    check_float32(x=x, gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj)


def _check_router(x, gate, bias, config: ModelConfig) -> None:
    if len(x.shape) != 2:
        raise ValueError(f"x must be (T, D), got shape {tuple(x.shape)}")
    experts = config.n_routed_experts
    _check_shape("gate", gate, (experts, x.shape[1]), "(n_routed_experts, D)")
    _check_shape("bias", bias, (experts,), "(n_routed_experts,)")
    if experts > MAX_EXPERTS or config.n_group > MAX_GROUPS:
        raise ValueError(f"the router kernel holds at most {MAX_EXPERTS} experts and {MAX_GROUPS} "
                         f"groups, got {experts} and {config.n_group}")
    check_float32(x=x, gate=gate, bias=bias)


def _route_on_device(x, gate, bias, config: ModelConfig, threads: int | None):
    """Device arrays in, device (ids, weights) out."""
    rows = x.shape[0]
    top_k = config.num_experts_per_tok
    ids = poisoned((rows, top_k), np.int64)                                   # [T, k]
    weights = poisoned((rows, top_k))                                         # [T, k]
    if threads is None:
        threads = pow2_threads(config.n_routed_experts, MAX_THREADS)
    if rows:
        route_kernel[rows, threads](
            x, gate, bias, config.n_group, config.topk_group, config.norm_topk_prob,
            np.float32(config.routed_scaling_factor), ids, weights)
    return ids, weights


# --8<-- [start:route]
def route(x, gate, bias, config: ModelConfig, *, threads: int | None = None):
    """Choose k experts per token. x (T, D) -> (expert ids (T, k) int64, weights (T, k) float32).

    ``threads`` (32, 64 or 128) forces the router's block size; by default the smallest power of
    two that covers E, at most 128.
    """
    _check_router(x, gate, bias, config)
    if threads is not None and threads not in (32, 64, 128):
        raise ValueError(f"threads must be None or one of (32, 64, 128), got {threads!r}")
    ids, weights = _route_on_device(to_device(x, np.float32), to_device(gate, np.float32),
                                    to_device(bias, np.float32), config, threads)
    if any(is_device_array(a) for a in (x, gate, bias)):
        return ids, weights
    return ids.copy_to_host(), weights.copy_to_host()
# --8<-- [end:route]


# --8<-- [start:swiglu]
def swiglu(x, gate_proj, up_proj, down_proj):
    """down(silu(gate x) * up x): x (T, D), gate/up (F, D), down (D, F) -> (T, D)."""
    _check_swiglu(x, gate_proj, up_proj, down_proj)
    rows, width = x.shape
    features = gate_proj.shape[0]
    out = poisoned((rows, width))                                             # [T, D]
    if rows and width:
        ids, weights = _dense_slots(rows)
        _launch_experts(to_device(x, np.float32),
                        to_device(gate_proj, np.float32).reshape(1, features, width),
                        to_device(up_proj, np.float32).reshape(1, features, width),
                        to_device(down_proj, np.float32).reshape(1, width, features),
                        ids, weights, out, False)
    return to_host_if(out, x, gate_proj, up_proj, down_proj)
# --8<-- [end:swiglu]


# --8<-- [start:device_params]
def device_params(params: MoEParams) -> MoEParams:
    """``params`` with every array on the device (arrays already there are used as they are).

    Call it once and pass the result to ``moe`` to keep a layer's weights on the device; host
    ``params`` given to ``moe`` are copied on every call.
    """
    return MoEParams(**{
        field.name: None if getattr(params, field.name) is None
        else to_device(getattr(params, field.name), np.float32)
        for field in dataclasses.fields(params)})
# --8<-- [end:device_params]


def _check_moe(x, params: MoEParams, config: ModelConfig) -> None:
    _check_router(x, params.gate, params.bias, config)
    experts, width = params.gate.shape
    if len(params.gate_proj.shape) != 3 or tuple(params.gate_proj.shape[::2]) != (experts, width):
        raise ValueError(f"params.gate_proj must be (E, F, D) = ({experts}, F, {width}), "
                         f"got shape {tuple(params.gate_proj.shape)}")
    features = params.gate_proj.shape[1]
    _check_shape("params.up_proj", params.up_proj, (experts, features, width), "(E, F, D)")
    _check_shape("params.down_proj", params.down_proj, (experts, width, features), "(E, D, F)")
    shared = (params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    if any(a is None for a in shared) and not all(a is None for a in shared):
        raise ValueError("params.shared_gate_proj, shared_up_proj and shared_down_proj must be "
                         "all arrays or all None")
    if shared[0] is not None:
        try:
            _check_swiglu(x, *shared)
        except ValueError as error:
            raise ValueError(f"shared expert: {error}") from None
    check_float32(gate_proj=params.gate_proj, up_proj=params.up_proj, down_proj=params.down_proj)


# --8<-- [start:moe]
def moe(x, params: MoEParams, config: ModelConfig):
    """Routed experts plus the shared expert. x (T, D) -> (T, D).

    Route on the device, run the shared expert into ``out``, then add each token's k routed
    experts in slot order. Host ``params`` are copied to the device on each call; pass
    ``device_params(params)`` to keep them there.
    """
    _check_moe(x, params, config)
    rows, width = x.shape
    out = poisoned((rows, width))                                             # [T, D]
    if rows and width:
        weights_on_device = device_params(params)
        x_on_device = to_device(x, np.float32)
        ids, weights = _route_on_device(x_on_device, weights_on_device.gate, weights_on_device.bias,
                                        config, None)                         # [T, k], [T, k]
        accumulate = False
        if weights_on_device.shared_gate_proj is not None:
            features = weights_on_device.shared_gate_proj.shape[0]
            one_id, one_weight = _dense_slots(rows)
            _launch_experts(x_on_device,
                            weights_on_device.shared_gate_proj.reshape(1, features, width),
                            weights_on_device.shared_up_proj.reshape(1, features, width),
                            weights_on_device.shared_down_proj.reshape(1, width, features),
                            one_id, one_weight, out, False)
            accumulate = True
        _launch_experts(x_on_device, weights_on_device.gate_proj, weights_on_device.up_proj,
                        weights_on_device.down_proj, ids, weights, out, accumulate)
    arrays = [getattr(params, field.name) for field in dataclasses.fields(params)]
    return to_host_if(out, x, *[a for a in arrays if a is not None])
# --8<-- [end:moe]
