"""The model in PyTorch the way an engine builder writes a fast decoder (gpt-fast style): the peer
of the engine's AR column. torch is optional and imported only when a peer is built.

Legend (docs/glossary.md): D hidden_size, V vocab_size, H num_attention_heads, dn/dr/dv head dims,
Rq q_lora_rank, R kv_lora_rank, E n_routed_experts, k num_experts_per_tok, G n_group,
F moe_intermediate_size, C cache capacity (slots), Ly layers.

What it is: one decode step for ONE token, every shape static, fp32 with TF32 off:

- a static KV cache per layer holding MLA's normalised latent (C, R) and rotated rope key (C, dr);
- the absorbed attention of the new token over all C slots, the slots after its position masked
  by comparing a fixed slot index with the position tensor: one shape for every step, so one
  captured graph serves them all (each step reads the whole capacity, the engine reads the
  prefix alone: C (R + dr) floats a layer, small beside the weights);
- NeoX rope from cos/sin tables of every slot, made once by ``ddtree.rope.rope_tables`` (YaRN's
  frequencies and scale included) and indexed by the position tensor;
- the V3 router (sigmoid scores, a bias that only chooses, group-limited top-k, normalised and
  scaled weights) and the shared expert;
- the routed experts by GATHERING the k chosen experts' weights: ``index_select`` on the stacked
  (E, 2F, D) gate+up and (E, D, F) down tensors, then two batched matmuls. A graph cannot
  branch on the router's choice, so the choice must become data: gathering reads the k experts'
  weights, writes them to a scratch copy and the batched matmul reads the copy again, 3 x the
  k experts' bytes (the engine reads them once); masking instead would run all E experts and
  zero the others' weights, E experts' bytes read once. Gather wins whenever 3 k < E. (Only a
  generated kernel, e.g. torch.compile's, could fuse the gather into the matvec and read the
  experts once; this peer stays with PyTorch's own kernels captured in a graph.)
- greedy argmax on the device, and the step's own bookkeeping in the graph: the step reads its
  token from a device sequence buffer at the position tensor, writes the argmax to the next
  slot unless that slot holds a prompt token (teacher forcing, ``torch.where``), and advances
  the position. Replaying the graph P + n - 1 times runs the prompt row by row (the prefill: P
  steps, where the engine's prefill is one forward; prefill time is part of the run, as in
  every column, and is not what is compared) and then n - 1 decode steps, with no host work
  between replays and one copy back at the end.

``TorchPeer(config, weights, capacity, device)`` takes ddtree's weight dict as numpy arrays or as
device arrays (anything with ``__cuda_array_interface__``, e.g. ``kernels.weights.init_weights``):
device arrays are viewed in place (no copy), except the experts, stacked once into the (E, ...)
tensors the gather needs (one device copy of the routed experts, as the engine makes).
``graphs=False`` runs the same static-shape step eagerly (the CPU path the tests use).

The decode path is written here rather than reusing ``train.model``: that model computes the naive
(expanded) attention over a whole sequence and sorts tokens by expert, with no cache; the
benchmark does not import the training package, and its loader copies weights to the host.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ddtree.config import ModelConfig
from ddtree.model import LATENT_NORM_EPS, check_tokens
from ddtree.rope import cos_sin_scale, inv_freq, rope_tables, softmax_scale
from ddtree.weights import check_weights

DEVICES = ("cuda", "cpu")


def import_torch():
    """torch with TF32 off (fp32 against fp32), imported on first use."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


class TorchPeer:
    """Weights, a static KV cache and the static buffers of one decode step; see the module doc."""

    def __init__(self, config: ModelConfig, weights: dict, capacity: int, device: str = "cuda",
                 graphs: bool | None = None):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) \
                or not 2 <= capacity <= config.max_position_embeddings:
            raise ValueError(f"capacity must be an integer in [2, max_position_embeddings="
                             f"{config.max_position_embeddings}], got {capacity!r}")
        graphs = device == "cuda" if graphs is None else graphs
        if graphs and device != "cuda":
            raise ValueError("graphs=True needs device='cuda' (a CUDA graph runs on a GPU)")
        check_weights(config, weights)
        self.torch = torch = import_torch()
        self.config, self.capacity, self.device, self.graphs = config, int(capacity), device, graphs
        self.scale = softmax_scale(config)
        tensor = self._tensor
        self.embed = tensor(weights["model.embed_tokens.weight"])                 # [V, D]
        self.final_norm = tensor(weights["model.norm.weight"])                    # [D]
        self.lm_head = tensor(weights["lm_head.weight"])                          # [V, D]
        self.layers = [self._layer(weights, i) for i in range(config.num_hidden_layers)]
        cos, sin = rope_tables(np.arange(capacity), inv_freq(config), cos_sin_scale(config))
        self.cos, self.sin = tensor(cos), tensor(sin)                             # [C, dr/2] each
        c = config
        shape = (c.num_hidden_layers, capacity)
        self.cache_latent = torch.zeros(*shape, c.kv_lora_rank, device=device)    # [Ly, C, R]
        self.cache_rope = torch.zeros(*shape, c.qk_rope_head_dim, device=device)  # [Ly, C, dr]
        self.slots = torch.arange(capacity, device=device)                        # [C]
        # the step's static inputs and outputs
        self.sequence = torch.zeros(capacity, dtype=torch.long, device=device)    # [C] tokens by position
        self.position = torch.zeros(1, dtype=torch.long, device=device)           # [1]
        self.prompt_len = torch.zeros(1, dtype=torch.long, device=device)         # [1]
        self.logits = torch.zeros(1, c.vocab_size, device=device)                 # [1, V]
        self.graph = None

    # ------------------------------------------------------------------------------------------
    # weights

    def _tensor(self, array):
        """A float32 torch tensor of ``array`` on the peer's device: device arrays viewed in place."""
        torch = self.torch
        if hasattr(array, "__cuda_array_interface__"):
            if self.device != "cuda":
                raise ValueError("weights on the GPU need device='cuda'")
            return torch.as_tensor(array, device="cuda")
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(self.device)

    def _layer(self, weights: dict, layer: int) -> dict:
        c, torch, tensor = self.config, self.torch, self._tensor
        H, dn, dv, R = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        prefix = f"model.layers.{layer}."

        def w(name):
            return tensor(weights[prefix + name])

        kv_b = w("self_attn.kv_b_proj.weight").view(H, dn + dv, R)                # [H, dn+dv, R]
        p = {"input_norm": w("input_layernorm.weight"),
             "post_norm": w("post_attention_layernorm.weight"),
             "kv_a_proj": w("self_attn.kv_a_proj_with_mqa.weight"),
             "kv_a_norm": w("self_attn.kv_a_layernorm.weight"),
             "w_uk": kv_b[:, :dn].contiguous(),                                   # [H, dn, R]
             "w_uv_t": kv_b[:, dn:].transpose(1, 2).contiguous(),                 # [H, R, dv]
             "o_proj": w("self_attn.o_proj.weight")}
        if c.q_lora_rank is None:
            p["q_proj"] = w("self_attn.q_proj.weight")
        else:
            p["q_a_proj"], p["q_a_norm"] = w("self_attn.q_a_proj.weight"), w("self_attn.q_a_layernorm.weight")
            p["q_proj"] = w("self_attn.q_b_proj.weight")
        if not c.is_moe_layer(layer):
            p["mlp"] = tuple(w(f"mlp.{part}_proj.weight") for part in ("gate", "up", "down"))
            return p
        E, Fe, D = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        p["router"], p["bias"] = w("mlp.gate.weight"), w("mlp.gate.e_score_correction_bias")
        # one device copy of the routed experts, stacked for the gather (gate and up side by side)
        gate_up = torch.empty(E, 2 * Fe, D, device=self.device)                  # [E, 2F, D]
        down = torch.empty(E, D, Fe, device=self.device)                         # [E, D, F]
        for e in range(E):
            gate_up[e, :Fe] = w(f"mlp.experts.{e}.gate_proj.weight")
            gate_up[e, Fe:] = w(f"mlp.experts.{e}.up_proj.weight")
            down[e] = w(f"mlp.experts.{e}.down_proj.weight")
        p["gate_up"], p["down"] = gate_up, down
        if c.n_shared_experts:
            p["shared"] = tuple(w(f"mlp.shared_experts.{part}_proj.weight")
                                for part in ("gate", "up", "down"))
        return p

    # ------------------------------------------------------------------------------------------
    # the step

    def rmsnorm(self, x, weight, eps: float):
        inv_rms = self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)        # [.., 1]
        return x * inv_rms * weight

    def swiglu(self, x, gate, up, down):
        F = self.torch.nn.functional
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T                         # [1, D]

    def rotate(self, x, cos, sin):
        """NeoX rope of x (.., dr) with cos/sin (1, dr/2) of its position."""
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        return self.torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def attention(self, index: int, p: dict, a, cos, sin):
        """Absorbed MLA of the token at ``self.position`` over the cache: a (1, D) -> (1, D)."""
        torch, c = self.torch, self.config
        H, dn, R = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            q = a @ p["q_proj"].T                                                  # [1, H*(dn+dr)]
        else:
            q_a = self.rmsnorm(a @ p["q_a_proj"].T, p["q_a_norm"], LATENT_NORM_EPS)  # [1, Rq]
            q = q_a @ p["q_proj"].T                                                # [1, H*(dn+dr)]
        q = q.view(H, c.qk_head_dim)                                               # [H, dn+dr]
        q_pe = self.rotate(q[:, dn:], cos, sin)                                    # [H, dr]
        kv = a @ p["kv_a_proj"].T                                                  # [1, R+dr]
        latent = self.rmsnorm(kv[:, :R], p["kv_a_norm"], LATENT_NORM_EPS)          # [1, R]
        k_pe = self.rotate(kv[:, R:], cos, sin)                                    # [1, dr]
        cache_latent, cache_rope = self.cache_latent[index], self.cache_rope[index]  # [C, R], [C, dr]
        cache_latent.index_copy_(0, self.position, latent)
        cache_rope.index_copy_(0, self.position, k_pe)
        q_lat = torch.bmm(q[:, None, :dn], p["w_uk"])[:, 0]                        # [H, R]
        scores = (q_lat @ cache_latent.T + q_pe @ cache_rope.T) * self.scale       # [H, C]
        scores = scores.masked_fill(self.slots > self.position, float("-inf"))    # later slots hidden
        o_lat = torch.softmax(scores, dim=-1) @ cache_latent                       # [H, R]
        o = torch.bmm(o_lat[:, None], p["w_uv_t"])                                 # [H, 1, dv]
        return o.view(1, -1) @ p["o_proj"].T                                       # [1, D]

    def route(self, p: dict, x):
        """V3 routing of one token x (1, D) -> expert ids (k,) and weights (k,)."""
        torch, c = self.torch, self.config
        scores = torch.sigmoid(x @ p["router"].T)[0]                               # [E]
        choice = scores + p["bias"]                                                # [E] bias only chooses
        if c.n_group > 1:
            grouped = choice.view(c.n_group, -1)                                   # [G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)                   # [G]
            kept = group_score.topk(c.topk_group).indices                          # [topk_group]
            keep = torch.zeros_like(group_score, dtype=torch.bool).index_fill_(0, kept, True)  # [G]
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[1]), float("-inf"))
        ids = choice.topk(c.num_experts_per_tok).indices                           # [k]
        weights = scores.index_select(0, ids)                                      # [k] unbiased
        if c.norm_topk_prob:
            weights = weights / (weights.sum() + 1e-20)
        return ids, weights * c.routed_scaling_factor

    def moe(self, p: dict, x):
        """Routed experts (gathered) plus the shared expert for one token x (1, D) -> (1, D)."""
        torch, F = self.torch, self.torch.nn.functional
        ids, weights = self.route(p, x)                                            # [k], [k]
        gate_up = p["gate_up"].index_select(0, ids)                                # [k, 2F, D] a copy
        down = p["down"].index_select(0, ids)                                      # [k, D, F]  a copy
        k, features = ids.shape[0], down.shape[2]
        h = torch.bmm(gate_up, x.T.expand(k, -1, 1))                               # [k, 2F, 1]
        h = F.silu(h[:, :features]) * h[:, features:]                              # [k, F, 1]
        y = torch.bmm(down, h)[..., 0]                                             # [k, D]
        out = (weights[:, None] * y).sum(0, keepdim=True)                          # [1, D]
        if "shared" in p:
            out = out + self.swiglu(x, *p["shared"])
        return out

    def step(self):
        """One token through the model: reads sequence[position], writes self.logits, the next
        token (unless position + 1 is a prompt slot) and position + 1. Static shapes, no host sync."""
        torch, c = self.torch, self.config
        token = self.sequence.index_select(0, self.position)                      # [1]
        cos, sin = self.cos.index_select(0, self.position), self.sin.index_select(0, self.position)
        h = self.embed.index_select(0, token)                                      # [1, D]
        for index, p in enumerate(self.layers):
            a = self.rmsnorm(h, p["input_norm"], c.rms_norm_eps)                   # [1, D]
            h = h + self.attention(index, p, a, cos, sin)                          # [1, D]
            f = self.rmsnorm(h, p["post_norm"], c.rms_norm_eps)                    # [1, D]
            h = h + (self.moe(p, f) if "gate_up" in p else self.swiglu(f, *p["mlp"]))
        logits = self.rmsnorm(h, self.final_norm, c.rms_norm_eps) @ self.lm_head.T  # [1, V]
        self.logits.copy_(logits)
        after = self.position + 1                                                  # [1]
        given = self.sequence.index_select(0, after.clamp(max=self.capacity - 1))  # [1]
        nxt = torch.where(after < self.prompt_len, given, logits.argmax(-1))       # [1] teacher forcing
        self.sequence.index_copy_(0, after.clamp(max=self.capacity - 1), nxt)
        self.position.copy_(after)

    def capture(self):
        """Warm up on a side stream (cuBLAS picks its kernels), then capture ``step`` in a graph."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self.position.zero_()
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.step()

    def run_step(self):
        if self.graphs:
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            with self.torch.no_grad():
                self.step()


def generate(peer: TorchPeer, prompt, new_tokens: int, return_logits: bool = False):
    """Greedy AR decoding: the new tokens (int64), and with ``return_logits`` the logits (n, V)
    that chose them. The prompt runs row by row through the same step (teacher-forced)."""
    prompt = check_tokens(prompt, peer.config.vocab_size)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens!r}")
    if prompt.size + new_tokens > peer.capacity:
        raise ValueError(f"prompt ({prompt.size}) + new_tokens ({new_tokens}) must fit the peer's "
                         f"capacity {peer.capacity}")
    torch = peer.torch
    if peer.graphs and peer.graph is None:
        peer.capture()                                       # before the state is set: warm-up writes it
    peer.sequence[:prompt.size].copy_(torch.from_numpy(prompt))
    peer.prompt_len.fill_(prompt.size)
    peer.position.zero_()
    logits = []
    for t in range(prompt.size + new_tokens - 1):
        peer.run_step()
        if return_logits and t >= prompt.size - 1:
            logits.append(peer.logits.clone())                                     # [1, V]
    tokens = peer.sequence[prompt.size:prompt.size + new_tokens].cpu().numpy()    # waits for the GPU
    if return_logits:
        return tokens, torch.cat(logits).cpu().numpy()                            # [n, V]
    return tokens


def peer_rate(config: ModelConfig, weights: dict, prompt, expected, repeats: int) -> tuple[float, bool]:
    """(median tok/s of ``repeats`` generations after a warm-up one (which captures the graph),
    whether the warm-up's tokens equal ``expected``), on the GPU with a CUDA graph."""
    expected = np.asarray(expected)
    peer = TorchPeer(config, weights, prompt.size + expected.size, "cuda")
    same = bool(np.array_equal(generate(peer, prompt, expected.size), expected))
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        generate(peer, prompt, expected.size)
        seconds.append(time.perf_counter() - begin)
    del peer
    import_torch().cuda.empty_cache()
    return expected.size / statistics.median(seconds), same
