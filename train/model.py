"""The model of ``ddtree/model.py`` in PyTorch, for training: a causal full-sequence forward.

Legend (docs/glossary.md): Bq sequences of a batch, T rows of each, D hidden_size, V vocab_size,
H num_attention_heads, dn/dr/dv head dims, Rq q_lora_rank, R kv_lora_rank, I intermediate_size,
E n_routed_experts, k num_experts_per_tok, G n_group, F moe_intermediate_size, Fs shared-expert
width.

Same numerics as the numpy reference in fp32: MLA with the naive (expanded) keys and values,
NeoX rope with YaRN's frequencies and scales taken from ``ddtree.rope``, RMSNorm (the latent norms
with eps 1e-6), V3 routing (sigmoid scores, a correction bias that only chooses, group-limited
top-k, normalised and scaled weights) and a shared expert. The router always runs in fp32, also
under bf16 autocast, so routing does not depend on the training precision.

Experts are stored stacked, (E, F, D) and (E, D, F), and computed by sorting the routed
(token, slot) pairs by expert: one matmul per expert over its tokens. The correction bias is a
buffer, not a parameter: no gradient reaches it; ``update_router_bias`` moves it by V3's
auxiliary-loss-free rule from the per-expert token counts each forward returns.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddtree.config import ModelConfig
from ddtree.model import LATENT_NORM_EPS
from ddtree.rope import cos_sin_scale, inv_freq, softmax_scale
from ddtree.weights import check_weights, weight_shapes

# V3's bias update speed (DeepSeek-V3 report, section 2.1.2: gamma = 0.001 for most of training)
ROUTER_BIAS_RATE = 1e-3
INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)        # [..., 1]
        return (x32 * inv_rms * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x, cos, sin):
    """NeoX rope on the last axis of x (..., T, [H,] dr) with cos/sin (T, dr/2) broadcast over heads."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Attention(nn.Module):
    """MLA, keys and values expanded per head (the reference's 'naive' form), causal."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        H, D = c.num_attention_heads, c.hidden_size
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, D, bias=False)
        self.scale = softmax_scale(c)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        H, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        if c.q_lora_rank is None:
            q = self.q_proj(x)                                                    # [Bq, T, H*(dn+dr)]
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))               # [Bq, T, H*(dn+dr)]
        q = q.view(B, T, H, dn + dr).transpose(1, 2)                              # [Bq, H, T, dn+dr]
        q_nope, q_pe = q[..., :dn], rotate(q[..., dn:], cos, sin)                 # [Bq, H, T, dn|dr]
        kv = self.kv_a_proj_with_mqa(x)                                           # [Bq, T, R+dr]
        latent = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])                    # [Bq, T, R]
        k_pe = rotate(kv[..., c.kv_lora_rank:], cos, sin)                         # [Bq, T, dr]
        kv = self.kv_b_proj(latent).view(B, T, H, dn + dv).transpose(1, 2)        # [Bq, H, T, dn+dv]
        k_nope, v = kv[..., :dn], kv[..., dn:]                                    # [Bq, H, T, dn|dv]
        k = torch.cat([k_nope, k_pe[:, None].expand(B, H, T, dr)], dim=-1)        # [Bq, H, T, dn+dr]
        q = torch.cat([q_nope, q_pe], dim=-1)                                     # [Bq, H, T, dn+dr]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [Bq, H, T, dv]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * dv))               # [Bq, T, D]


class Router(nn.Module):
    """The router's weight (E, D) and its correction bias (E,), a buffer outside autograd."""

    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))


class MoE(nn.Module):
    """Routed experts (V3 routing) plus the shared expert; forward returns (out, counts (E,))."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        E, D, Fe = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = Router(E, D)
        self.gate_proj = nn.Parameter(torch.empty(E, Fe, D))                     # [E, F, D]
        self.up_proj = nn.Parameter(torch.empty(E, Fe, D))                       # [E, F, D]
        self.down_proj = nn.Parameter(torch.empty(E, D, Fe))                     # [E, D, F]
        self.shared_experts = SwiGLU(D, Fe * c.n_shared_experts) if c.n_shared_experts else None

    def route(self, x):
        """x (N, D) -> expert ids (N, k) int64 and weights (N, k) fp32, as ``ddtree.moe.route``."""
        c = self.c
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(x.float() @ self.gate.weight.float().t())     # [N, E]
        choice = scores + self.gate.e_score_correction_bias      # [N, E] bias only chooses
        N, E = choice.shape
        if c.n_group > 1:
            grouped = choice.view(N, c.n_group, E // c.n_group)                  # [N, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)                  # [N, G]
            kept = group_score.topk(c.topk_group, dim=-1).indices                 # [N, topk_group]
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
            keep = keep.repeat_interleave(E // c.n_group, dim=-1)                 # [N, E]
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices                  # [N, k]
        weights = scores.gather(1, ids)                                           # [N, k] unbiased
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                              # [N, D]
        ids, weights = self.route(x)                                              # [N, k]
        k = ids.shape[1]
        flat = ids.reshape(-1)                                                    # [N*k]
        order = flat.argsort()                                                    # pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.c.n_routed_experts)          # [E]
        token = order // k                                                        # [N*k] row of each pair
        pair_weight = weights.reshape(-1)[order]                                  # [N*k]
        xs = x[token]                                                             # [N*k, D]
        out = torch.zeros_like(x)                                                 # [N, D]
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = F.silu(xs[rows] @ self.gate_proj[e].t()) * (xs[rows] @ self.up_proj[e].t())  # [n, F]
            y = h @ self.down_proj[e].t()                                         # [n, D]
            out.index_add_(0, token[rows], (y.float() * pair_weight[rows, None]).to(out.dtype))
            start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape), counts


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MoE(c) if c.is_moe_layer(layer) else SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)                 # [Bq, T, D]
        f = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            y, counts = self.mlp(f)
            return h + y, counts
        return h + self.mlp(f), None


class Model(nn.Module):
    """tokens (Bq, T) -> logits (Bq, T, V) and the per-expert token counts of each MoE layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.from_numpy(inv_freq(c)), persistent=False)
        self.rope_scale = cos_sin_scale(c)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Normal(0, 0.02) projections, residual outputs scaled by 1/sqrt(2 Ly), unit norms, zero bias."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, INIT_STD)
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.e_score_correction_bias.zero_()

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def forward(self, tokens, positions=None):
        """tokens (Bq, T) int64 -> (logits (Bq, T, V), [counts (E,) per MoE layer]); positions
        (T,) default to 0..T-1."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        angles = positions.float()[:, None] * self.inv_freq[None]                 # [T, dr/2]
        cos, sin = torch.cos(angles) * self.rope_scale, torch.sin(angles) * self.rope_scale
        h = self.embed_tokens(tokens)                                             # [Bq, T, D]
        counts = []
        for layer in self.layers:
            h, layer_counts = layer(h, cos, sin)
            if layer_counts is not None:
                counts.append(layer_counts)
        return self.lm_head(self.norm(h)), counts                                 # [Bq, T, V]


@torch.no_grad()
# --8<-- [start:router_bias]
def update_router_bias(model: Model, counts, rate: float = ROUTER_BIAS_RATE) -> None:
    """V3's auxiliary-loss-free balancing: bias_i += rate * sign(mean load - load_i) per MoE layer,
    from the per-expert token counts (E,) of each MoE layer (``Model.forward``'s second output)."""
    layers = model.moe_layers()
    if len(counts) != len(layers):
        raise ValueError(f"counts must hold one (E,) tensor per MoE layer ({len(layers)}), got {len(counts)}")
    for moe, load in zip(layers, counts, strict=True):
        bias = moe.gate.e_score_correction_bias                                    # [E]
        load = torch.as_tensor(load, dtype=torch.float32, device=bias.device)     # [E]
        if load.shape != bias.shape:
            raise ValueError(f"counts per layer must be (E,) = {tuple(bias.shape)}, got {tuple(load.shape)}")
        bias += rate * torch.sign(load.mean() - load)
# --8<-- [end:router_bias]


# ---------------------------------------------------------------------------------------------
# conversion with ddtree's weight dict (Hugging Face names, one tensor per expert)

def _torch_name(name: str):
    """A ddtree weight name -> (torch state-dict name, expert index or None)."""
    if name.startswith("model.layers.") and ".mlp.experts." in name:
        prefix, rest = name.split(".mlp.experts.")
        expert, part, _ = rest.split(".")                       # "3", "gate_proj", "weight"
        return f"{prefix.removeprefix('model.')}.mlp.{part}", int(expert)
    return name.removeprefix("model."), None


def from_ddtree(config: ModelConfig, weights: dict) -> Model:
    """A Model holding ``weights`` (ddtree's dict, checked against ``config``), float32 on the CPU."""
    check_weights(config, weights)
    model = Model(config)
    state = model.state_dict()
    with torch.no_grad():
        for name in weight_shapes(config):
            target, expert = _torch_name(name)
            value = torch.from_numpy(np.ascontiguousarray(weights[name], dtype=np.float32))
            if expert is None:
                state[target].copy_(value)
            else:
                state[target][expert].copy_(value)
    return model


def to_ddtree(model: Model) -> dict[str, np.ndarray]:
    """The model's weights as ddtree's dict of float32 numpy arrays (experts split per index)."""
    state = {name: value.detach().float().cpu() for name, value in model.state_dict().items()}
    weights = {}
    for name in weight_shapes(model.config):
        source, expert = _torch_name(name)
        value = state[source] if expert is None else state[source][expert]
        weights[name] = np.ascontiguousarray(value.numpy(), dtype=np.float32)
    check_weights(model.config, weights)
    return weights
