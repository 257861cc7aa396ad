"""Mixture of experts with DeepSeek-V3 routing: the numpy reference.

Legend (docs/glossary.md): T rows, D hidden_size, E n_routed_experts, G n_group,
k num_experts_per_tok, F moe_intermediate_size, Fs shared-expert width (n_shared_experts * F).

Routing: sigmoid scores; a correction bias that only chooses (never weighs); with G > 1 groups,
keep the ``topk_group`` groups whose two best biased scores sum highest; take the top k biased
scores; weigh each chosen expert by its *unbiased* score, normalised to sum 1 and multiplied by
``routed_scaling_factor``. Exact ties go to the lower expert index, everywhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddtree.config import ModelConfig
from ddtree.linear import linear


@dataclasses.dataclass(frozen=True)
class MoEParams:
    """One MoE layer's weights, experts stacked along the first axis."""
    gate: np.ndarray            # [E, D] router
    bias: np.ndarray            # [E]    e_score_correction_bias
    gate_proj: np.ndarray       # [E, F, D]
    up_proj: np.ndarray         # [E, F, D]
    down_proj: np.ndarray       # [E, D, F]
    shared_gate_proj: np.ndarray | None  # [Fs, D], None without a shared expert
    shared_up_proj: np.ndarray | None    # [Fs, D]
    shared_down_proj: np.ndarray | None  # [D, Fs]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def topk_lowest_index(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries per row, descending; ties -> lower index first."""
    order = np.argsort(-values, axis=-1, kind="stable")          # stable: equal values keep index order
    return order[..., :k]


# --8<-- [start:route]
def route(x: np.ndarray, gate: np.ndarray, bias: np.ndarray, config: ModelConfig):
    """Choose k experts per token. x (T, D) -> (expert ids (T, k) int64, weights (T, k) float32)."""
    scores = sigmoid(linear(x, gate))                             # [T, E]
    choice = scores + bias                                        # [T, E] bias only chooses
    tokens, experts = choice.shape
    if config.n_group > 1:
        grouped = choice.reshape(tokens, config.n_group, -1)       # [T, G, E/G]
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [T, G] sum of the top 2
        kept = topk_lowest_index(group_score, config.topk_group)   # [T, topk_group]
        keep = np.zeros((tokens, config.n_group), dtype=bool)
        np.put_along_axis(keep, kept, True, axis=-1)
        keep = np.repeat(keep, experts // config.n_group, axis=-1)  # [T, E]
        choice = np.where(keep, choice, -np.inf)
    ids = topk_lowest_index(choice, config.num_experts_per_tok)   # [T, k]
    weights = np.take_along_axis(scores, ids, axis=-1)            # [T, k] unbiased
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + np.float32(1e-20))
    weights = weights * np.float32(config.routed_scaling_factor)
    return ids.astype(np.int64), weights.astype(np.float32)
# --8<-- [end:route]


# --8<-- [start:swiglu]
def swiglu(x: np.ndarray, gate_proj: np.ndarray, up_proj: np.ndarray, down_proj: np.ndarray):
    """down(silu(gate x) * up x): x (T, D), gate/up (F, D), down (D, F) -> (T, D)."""
    g = linear(x, gate_proj)                                      # [T, F]
    u = linear(x, up_proj)                                        # [T, F]
    hidden = g * sigmoid(g) * u                                   # [T, F]
    return linear(hidden, down_proj)                              # [T, D]
# --8<-- [end:swiglu]


# --8<-- [start:moe]
def moe(x: np.ndarray, params: MoEParams, config: ModelConfig) -> np.ndarray:
    """Routed experts plus the shared expert. x (T, D) -> (T, D)."""
    ids, weights = route(x, params.gate, params.bias, config)     # [T, k], [T, k]
    out = np.zeros_like(x, dtype=np.float32)                      # [T, D]
    if params.shared_gate_proj is not None:
        out += swiglu(x, params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    for expert in np.unique(ids):
        rows, slot = np.nonzero(ids == expert)                    # tokens routed to this expert
        y = swiglu(x[rows], params.gate_proj[expert], params.up_proj[expert],
                   params.down_proj[expert])                      # [rows routed here, D]
        out[rows] += weights[rows, slot, None] * y
    return out
# --8<-- [end:moe]


def _check_shape(name: str, x, expected: tuple, legend: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must be {legend} = {expected}, got shape {tuple(x.shape)}")


def check_route(x, gate, bias, config: ModelConfig) -> None:
    """x (T, D), gate (E, D), bias (E,) with E = n_routed_experts (device arrays too)."""
    if len(x.shape) != 2:
        raise ValueError(f"x must be (T, D), got shape {tuple(x.shape)}")
    experts = config.n_routed_experts
    _check_shape("gate", gate, (experts, x.shape[1]), "(n_routed_experts, D)")
    _check_shape("bias", bias, (experts,), "(n_routed_experts,)")


def check_swiglu(x, gate_proj, up_proj, down_proj) -> None:
    """x (T, D), gate_proj and up_proj (F, D), down_proj (D, F) (device arrays too)."""
    if len(x.shape) != 2:
        raise ValueError(f"x must be (T, D), got shape {tuple(x.shape)}")
    width = x.shape[1]
    if len(gate_proj.shape) != 2 or gate_proj.shape[1] != width:
        raise ValueError(f"gate_proj must be (F, D) with D = {width}, got shape {tuple(gate_proj.shape)}")
    features = gate_proj.shape[0]
    _check_shape("up_proj", up_proj, (features, width), "(F, D)")
    _check_shape("down_proj", down_proj, (width, features), "(D, F)")


def check_moe(x, params: MoEParams, config: ModelConfig) -> None:
    """The router's shapes, the stacked experts (E, F, D) / (E, D, F), and a shared expert that is
    all arrays or all None (device arrays too)."""
    check_route(x, params.gate, params.bias, config)
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
            check_swiglu(x, *shared)
        except ValueError as error:
            raise ValueError(f"shared expert: {error}") from None
