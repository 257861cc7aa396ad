"""The device-resident engine: the numba.cuda twin of ``ddtree/model.py``.

Legend: T rows of a forward (a bucket: 1, 2, 4, ... up to Tmax), D hidden, V vocab, H heads,
dn/dr/dv head dims, Rq q_lora_rank, R kv_lora_rank, E experts, k experts per token,
F moe_intermediate_size, Ly layers, C cache capacity, L draft depths, K candidates per depth,
B node budget, TPB threads per block.

Everything lives on the device from construction on: the weights (uploaded once), the latent KV
cache (``DeviceCache``), and every activation, in buffers allocated once for Tmax rows and
NaN-poisoned once. Kernels write into the buffers they are given. A forward over T rows is a
*launch sequence* (``forward_rows``) that reads every per-step value from device buffers:

    state[0]    P, the cache rows before this forward (the prefix every row sees)
    tokens      the rows' tokens (row 0 of the tree buffers)
    parents,    the rows as a tree: a prompt chunk is a chain, an AR step a single root, a
    depths      verify a draft tree; padding rows have no parent (they see only the prefix and
                themselves, and are never committed)
    positions,  derived on the device: position P + depth, and each row's path root..row
    paths

So one captured CUDA graph per bucket serves every step (``kernels.graphs``). Rows attend to the
prefix and their own path in position order (``attention_paths_kernel``), and every reduction
runs in an order fixed by the row alone, never by its neighbours: a tree node's logits are
bit-identical to the AR logits at the same position, so DDTree == AR holds exactly in the
engine, for any weights.

The order of operations in ``forward_rows`` and ``decoder_layer`` is the reference's, line for
line; ``kernels/decode.py`` drives it as ``ddtree/decode.py`` drives the reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddtree.config import ModelConfig
from ddtree.kv_cache import CacheOverflowError, LatentKVCache
from ddtree.model import LATENT_NORM_EPS
from ddtree.moe import MoEParams
from ddtree.rope import cos_sin_scale, inv_freq, softmax_scale
from kernels import linear as linear_kernels
from kernels import mla as mla_kernels
from kernels import pending
from kernels import rmsnorm as rmsnorm_kernels
from kernels import rope as rope_kernels
from kernels import tree as tree_kernels
from kernels.accept import _accept_kernel
from kernels.device import blocks, cuda, poisoned, pow2_threads, row_threads, to_device
from kernels.graphs import Graphs
from kernels.pending import STATE_SIZE

DEFAULT_MAX_TREE_NODES = 128    # Tmax: the largest bucket; budgets up to Tmax - 1 drafted nodes
ROW_THREADS = 128               # threads of the one-thread-per-row bookkeeping kernels
BUCKET_STEP = 8                 # buckets past 8 rows are multiples of this


def bucket_rows(rows: int, max_rows: int) -> int:
    """The bucket for ``rows`` rows (graphs are captured per bucket): 1, 2, 4, 8, then multiples of 8.

    Padding rows cost a whole row of work each, so buckets are finer than powers of two past 8: a
    budget-32 tree (33 nodes) runs 40 rows, not 64."""
    bucket = 1
    while bucket < min(rows, BUCKET_STEP):
        bucket *= 2
    if rows > BUCKET_STEP:
        bucket = -(-rows // BUCKET_STEP) * BUCKET_STEP
    return min(bucket, max_rows)


class DeviceCache:
    """The latent KV cache on the device: the twin of ``ddtree.kv_cache.LatentKVCache``.

    ``latent`` (Ly, C, R) and ``rope`` (Ly, C, dr) are device arrays; ``length`` mirrors the
    device's state[0] on the host (the engine updates both). Rows past ``length`` are scratch: a
    forward writes its bucket there, and only the committed rows count.
    """

    def __init__(self, num_layers: int, capacity: int, latent_dim: int, rope_dim: int):
        self.latent = poisoned((num_layers, capacity, latent_dim))   # [Ly, C, R]
        self.rope = poisoned((num_layers, capacity, rope_dim))       # [Ly, C, dr]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]

    def to_host(self) -> LatentKVCache:
        """A numpy copy of the committed rows (for tests and chapters; copies the whole cache)."""
        layers, capacity, rank = self.latent.shape
        host = LatentKVCache(layers, capacity, rank, self.rope.shape[2])
        host.latent[:] = self.latent.copy_to_host()
        host.rope[:] = self.rope.copy_to_host()
        host.length = self.length
        return host


@dataclasses.dataclass(frozen=True)
class DeviceLayer:
    """One layer's weights on the device (the twin of ``ddtree.model.LayerParams``)."""
    input_norm: object            # [D]
    post_attention_norm: object   # [D]
    q_a_proj: object | None       # [Rq, D]
    q_a_norm: object | None       # [Rq]
    q_proj: object                # [H*(dn+dr), Rq or D]
    kv_a_proj: object             # [R+dr, D]
    kv_a_norm: object             # [R]
    w_uk: object                  # [H, dn, R]
    w_uv: object                  # [H, dv, R]
    o_proj: object                # [D, H*dv]
    dense: tuple | None           # (gate [1, I, D], up [1, I, D], down [1, D, I]): one always-chosen expert
    moe: MoEParams | None         # device arrays; shared expert stacks as (1, Fs, D) / (1, D, Fs)


def device_layer(config: ModelConfig, weights: dict, layer: int) -> DeviceLayer:
    """Gather one layer's weights on the device (the twin of ``ddtree.model.layer_params``).

    Host tensors are copied to the device here, once; device tensors (``kernels.weights``) are
    used as they are. Experts are stacked (E, F, D) and kv_b_proj split per head into W_UK and
    W_UV with device-to-device copies; dense and shared-expert SwiGLUs get a leading expert axis
    of 1, so one pair of expert kernels runs every MLP.
    """
    prefix = f"model.layers.{layer}."

    def w(name):
        key = prefix + name
        if key not in weights:
            raise KeyError(f"weights are missing {key!r}")
        return to_device(weights[key], np.float32)

    def stack(arrays):                                          # [n, ...] on the device
        out = cuda.device_array((len(arrays), *arrays[0].shape), np.float32)
        for i, array in enumerate(arrays):
            out[i].copy_to_device(array)
        return out

    def swiglu(part_prefix):                                    # (gate, up, down), each [1, ...]
        return tuple(stack([w(f"{part_prefix}{part}.weight")]) for part in ("gate_proj", "up_proj",
                                                                             "down_proj"))

    c = config
    heads, nope = c.num_attention_heads, c.qk_nope_head_dim
    kv_b = w("self_attn.kv_b_proj.weight").reshape(heads, nope + c.v_head_dim, c.kv_lora_rank)
    w_uk = stack([kv_b[h, :nope] for h in range(heads)])        # [H, dn, R]
    w_uv = stack([kv_b[h, nope:] for h in range(heads)])        # [H, dv, R]
    lora = c.q_lora_rank is not None
    dense = moe = None
    if c.is_moe_layer(layer):
        experts = range(c.n_routed_experts)
        shared = swiglu("mlp.shared_experts.") if c.n_shared_experts else (None, None, None)
        moe = MoEParams(
            gate=w("mlp.gate.weight"), bias=w("mlp.gate.e_score_correction_bias"),
            gate_proj=stack([w(f"mlp.experts.{e}.gate_proj.weight") for e in experts]),
            up_proj=stack([w(f"mlp.experts.{e}.up_proj.weight") for e in experts]),
            down_proj=stack([w(f"mlp.experts.{e}.down_proj.weight") for e in experts]),
            shared_gate_proj=shared[0], shared_up_proj=shared[1], shared_down_proj=shared[2])
    else:
        dense = swiglu("mlp.")
    return DeviceLayer(
        input_norm=w("input_layernorm.weight"), post_attention_norm=w("post_attention_layernorm.weight"),
        q_a_proj=w("self_attn.q_a_proj.weight") if lora else None,
        q_a_norm=w("self_attn.q_a_layernorm.weight") if lora else None,
        q_proj=w("self_attn.q_b_proj.weight") if lora else w("self_attn.q_proj.weight"),
        kv_a_proj=w("self_attn.kv_a_proj_with_mqa.weight"), kv_a_norm=w("self_attn.kv_a_layernorm.weight"),
        w_uk=w_uk, w_uv=w_uv, o_proj=w("self_attn.o_proj.weight"), dense=dense, moe=moe)


class Buffers:
    """Every activation and bookkeeping array of the engine, allocated once for Tmax rows."""

    def __init__(self, config: ModelConfig, max_rows: int):
        c, t = config, max_rows
        heads, rank, rope = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        width = max(c.intermediate_size, c.moe_intermediate_size * max(c.n_shared_experts, 1),
                    c.moe_intermediate_size)
        self.max_rows = t
        self.max_candidates = t - 1                                   # K and L never need more (B <= Tmax-1)
        # the rows (a tree of up to Tmax nodes; also a prompt chunk or the AR step)
        self.tree_tokens = poisoned((1, t), np.int64)                 # [1, Tmax]
        self.tree_parents = poisoned((1, t), np.int64)
        self.tree_depths = poisoned((1, t), np.int64)
        self.tree_ranks = poisoned((1, t), np.int64)
        self.tree_logprobs = poisoned((1, t), np.float32)
        self.tree_sizes = poisoned((1,), np.int64)
        self.positions = poisoned((t,), np.int64)                      # [Tmax] P + depth
        self.paths = poisoned((t, t), np.int64)                        # [Tmax, Tmax] path by depth
        self.state = to_device(np.zeros(STATE_SIZE, np.int64))         # [length, count, step]
        self.host_rows = poisoned((t + 1,), np.int64)                  # [1 + Tmax] a prompt chunk
        self.root = poisoned((1,), np.int64)
        # activations
        self.h = poisoned((t, c.hidden_size))                          # [T, D] the residual stream
        self.a = poisoned((t, c.hidden_size))                          # [T, D] normalised
        self.f = poisoned((t, c.hidden_size))                          # [T, D] normalised, MLP input
        self.mlp = poisoned((t, c.hidden_size))                        # [T, D] MLP output
        self.q_a = poisoned((t, c.q_lora_rank or 1))                   # [T, Rq]
        self.q_a_normed = poisoned((t, c.q_lora_rank or 1))            # [T, Rq]
        self.q = poisoned((t, heads, c.qk_head_dim))                   # [T, H, dn+dr]
        self.kv = poisoned((t, 1, rank + rope))                        # [T, 1, R+dr] (1 = the shared head)
        self.latent = poisoned((t, rank))                              # [T, R]
        self.q_lat = poisoned((t, heads, rank))                        # [T, H, R]
        self.o_lat = poisoned((t, heads, rank))                        # [T, H, R]
        self.o = poisoned((t, heads, c.v_head_dim))                    # [T, H, dv]
        self.router_logits = poisoned((t, c.n_routed_experts))          # [T, E]
        self.expert_ids = poisoned((t, c.num_experts_per_tok), np.int64)     # [T, k]
        self.expert_weights = poisoned((t, c.num_experts_per_tok))          # [T, k]
        self.expert_hidden = poisoned((t, c.num_experts_per_tok, c.moe_intermediate_size))  # [T, k, F]
        self.single_hidden = poisoned((t, 1, width))                   # [T, 1, I or Fs]
        self.single_ids = to_device(np.zeros((t, 1), np.int64))        # [T, 1] expert 0, always
        self.single_weights = to_device(np.ones((t, 1), np.float32))   # [T, 1] weight 1
        self.logits = poisoned((t, c.vocab_size))                      # [T, V]
        self.posterior = poisoned((1, t), np.int64)                    # [1, T] argmax per row
        self.embed_bad = to_device(np.zeros(1, np.int32))
        # the DDTree round
        self.draft = poisoned((self.max_candidates, c.vocab_size))     # [L, V] drafter logits
        self.top_logprobs = poisoned((self.max_candidates ** 2,))      # [L*K] flat, viewed (1, L, K)
        self.top_ids = poisoned((self.max_candidates ** 2,), np.int64)
        self.accepted = poisoned((1, t), np.int64)                     # [1, T]
        self.accepted_count = poisoned((1,), np.int64)                 # m
        self.bonus = poisoned((1,), np.int64)
        self.record = poisoned((3 + 4 * t,), np.int64)                 # what the host reads per round
        self.generated = poisoned((c.max_position_embeddings,), np.int64)  # AR tokens, by step


class Transformer:
    """The engine: prefill, AR steps and tree verification, every step on the device.

    ``graphs=False`` launches every kernel from Python instead of replaying captured graphs (for
    debugging, and to measure what graphs save); the CUDA simulator always launches directly.
    ``max_tree_nodes`` (Tmax) bounds the verify buckets and so the budget (B <= Tmax - 1).
    """

    def __init__(self, config: ModelConfig, weights: dict, graphs: bool = True,
                 max_tree_nodes: int = DEFAULT_MAX_TREE_NODES):
        if isinstance(max_tree_nodes, bool) or not isinstance(max_tree_nodes, int) \
                or max_tree_nodes < 2 or max_tree_nodes & (max_tree_nodes - 1):
            raise ValueError(f"max_tree_nodes must be a power of two >= 2, got {max_tree_nodes!r}")
        if max_tree_nodes * config.num_experts_per_tok > pending.MAX_PAIRS:
            raise ValueError(f"max_tree_nodes * num_experts_per_tok must be <= {pending.MAX_PAIRS} (the "
                             f"expert kernels' shared memory), got {max_tree_nodes} * "
                             f"{config.num_experts_per_tok}")
        self.config = config
        self.graphs = Graphs(enabled=graphs)
        self.max_rows = max_tree_nodes
        self.embed_tokens = to_device(weights["model.embed_tokens.weight"], np.float32)
        self.final_norm = to_device(weights["model.norm.weight"], np.float32)
        self.lm_head = to_device(weights["lm_head.weight"], np.float32)
        self.layers = [device_layer(config, weights, i) for i in range(config.num_hidden_layers)]
        self.inv_freq = to_device(inv_freq(config), np.float32)
        self.rope_scale = float(cos_sin_scale(config))
        self.softmax_scale = np.float32(softmax_scale(config))
        # keys per attention tile: fixed by the dims, so tiles sit at the same positions in every call
        self.attention_tile = pending.attention_tile(config.kv_lora_rank, config.qk_rope_head_dim)
        self.attention_bytes = pending.attention_shared_bytes(config.kv_lora_rank, config.qk_rope_head_dim,
                                                              self.attention_tile)
        self.buffers = Buffers(config, self.max_rows)
        # one cache for the whole context, plus a bucket of scratch rows past its end
        self.cache = DeviceCache(config.num_hidden_layers, config.max_position_embeddings + self.max_rows,
                                 config.kv_lora_rank, config.qk_rope_head_dim)
        self.scratch_latent = poisoned((config.num_hidden_layers, self.max_rows, config.kv_lora_rank))
        self.scratch_rope = poisoned((config.num_hidden_layers, self.max_rows, config.qk_rope_head_dim))
        self.device_root = None       # the root token the device holds (set by the last round)
        self.forward_count = 0        # target forwards run so far (prefill chunks included)

    # ------------------------------------------------------------------------------------------
    # the cache

    def new_cache(self, capacity: int | None = None) -> DeviceCache:
        """Empty the engine's device cache and return it (the engine owns exactly one)."""
        limit = self.config.max_position_embeddings
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer))
                                     or not 1 <= capacity <= limit):
            raise ValueError(f"capacity must be an integer in [1, max_position_embeddings={limit}], "
                             f"got {capacity!r}")
        self.cache.length = 0
        self.graphs.upload(np.zeros(STATE_SIZE, np.int64), self.buffers.state)
        self.device_root = None
        return self.cache

    def _reserve(self, cache: DeviceCache, rows: int) -> None:
        if cache is not self.cache:
            raise ValueError("cache must be this engine's cache (from new_cache())")
        limit = self.config.max_position_embeddings
        if cache.length + rows > limit:
            raise CacheOverflowError(f"KV cache overflow: {cache.length} rows cached + {rows} new > "
                                     f"max_position_embeddings {limit}")

    # ------------------------------------------------------------------------------------------
    # one forward over the rows: the reference's forward and decoder_layer, in the same order

    # --8<-- [start:forward_rows]
    def forward_rows(self, stream, rows: int) -> None:
        """Launch a forward over ``rows`` rows (a bucket) into buffers.logits and buffers.posterior."""
        b, c = self.buffers, self.config
        tokens = b.tree_tokens[0, :rows]                                           # [T]
        self.launch_tree_rows(stream, rows)                                        # positions, paths
        linear_kernels._embed_kernel[blocks(rows * c.hidden_size, 128), 128, stream](
            tokens, self.embed_tokens, b.h[:rows], b.embed_bad)                    # [T, D]
        for index, layer in enumerate(self.layers):
            self.decoder_layer(stream, index, layer, rows)
        self.rmsnorm(stream, b.h[:rows], self.final_norm, c.rms_norm_eps, b.a[:rows])   # [T, D]
        self.linear(stream, b.a[:rows], self.lm_head, b.logits[:rows])                  # [T, V]
        threads = pow2_threads(c.vocab_size)
        linear_kernels._argmax_kernel(threads)[rows, threads, stream](
            b.logits[:rows], b.posterior[0, :rows])                               # [T]
    # --8<-- [end:forward_rows]

    # --8<-- [start:decoder_layer]
    def decoder_layer(self, stream, index: int, layer: DeviceLayer, rows: int) -> None:
        b, c, s = self.buffers, self.config, stream
        heads, nope, rank = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        h, a = b.h[:rows], b.a[:rows]                                              # [T, D]
        self.rmsnorm(s, h, layer.input_norm, c.rms_norm_eps, a)
        if layer.q_a_proj is not None:
            self.linear(s, a, layer.q_a_proj, b.q_a[:rows])                        # [T, Rq]
            self.rmsnorm(s, b.q_a[:rows], layer.q_a_norm, LATENT_NORM_EPS, b.q_a_normed[:rows])
            a_q = b.q_a_normed[:rows]
        else:
            a_q = a
        q = b.q[:rows]                                                             # [T, H, dn+dr]
        self.linear(s, a_q, layer.q_proj, b.q.reshape(self.max_rows, heads * c.qk_head_dim)[:rows])
        q_nope, q_pe = q[:, :, :nope], q[:, :, nope:]                              # views
        self.apply_rope(s, q_pe, rows)                                             # in place
        kv = b.kv[:rows]                                                           # [T, 1, R+dr]
        self.linear(s, a, layer.kv_a_proj, b.kv.reshape(self.max_rows, rank + c.qk_rope_head_dim)[:rows])
        self.rmsnorm(s, kv[:, 0, :rank], layer.kv_a_norm, LATENT_NORM_EPS, b.latent[:rows])  # [T, R]
        k_pe = kv[:, :, rank:]                                                     # [T, 1, dr]
        self.apply_rope(s, k_pe, rows)
        cache_latent, cache_rope = self.cache.latent[index], self.cache.rope[index]   # [C, R], [C, dr]
        pending.write_rows_kernel[rows, 32, s](b.latent[:rows], k_pe[:, 0, :], cache_latent,
                                               cache_rope, b.state)
        threads = row_threads(rank)
        mla_kernels.absorb_query_kernel[(blocks(rank, threads), rows * heads), threads, s](
            q_nope, layer.w_uk, b.q_lat[:rows])                                    # [T, H, R]
        pending.attention_paths_kernel[(heads, rows), self.attention_tile, s, self.attention_bytes](
            b.q_lat[:rows], q_pe, cache_latent, cache_rope, b.state, b.tree_depths[0, :rows],
            b.paths[:rows], self.softmax_scale, b.o_lat[:rows])                    # [T, H, R]
        threads = row_threads(c.v_head_dim)
        mla_kernels.absorb_output_kernel[(blocks(c.v_head_dim, threads), rows * heads), threads, s](
            b.o_lat[:rows], layer.w_uv, b.o[:rows])                                # [T, H, dv]
        self.linear(s, b.o.reshape(self.max_rows, heads * c.v_head_dim)[:rows], layer.o_proj, h,
                    residual=h)                                                    # h += o_proj(o)
        self.rmsnorm(s, h, layer.post_attention_norm, c.rms_norm_eps, b.f[:rows])  # [T, D]
        if layer.moe is not None:
            self.moe(s, b.f[:rows], layer.moe, b.mlp[:rows])                       # [T, D]
        else:
            self.swiglu(s, b.f[:rows], layer.dense, b.mlp[:rows])                  # [T, D]
        pending.add_kernel[blocks(rows * c.hidden_size, 128), 128, s](h, b.mlp[:rows])   # h += mlp
    # --8<-- [end:decoder_layer]

    # ------------------------------------------------------------------------------------------
    # the launches, one per operation (each kernel writes into the buffer it is given)

    def launch_tree_rows(self, stream, rows: int) -> None:
        b = self.buffers
        pending.tree_rows_kernel[blocks(rows, ROW_THREADS), ROW_THREADS, stream](
            b.tree_parents[0, :rows], b.tree_depths[0, :rows], b.state, b.positions[:rows], b.paths[:rows])

    def rmsnorm(self, stream, x, weight, eps, out) -> None:
        threads = pow2_threads(x.shape[1])
        rmsnorm_kernels._rmsnorm_kernel(threads)[x.shape[0], threads, stream](x, weight, float(eps), out)

    def linear(self, stream, x, weight, out, residual=None) -> None:
        threads = pow2_threads(x.shape[1])
        grid = blocks(weight.shape[0], pending.COLUMNS_PER_BLOCK)
        pending.linear_rows_kernel(threads)[grid, threads, stream](
            x, weight, out if residual is None else residual, residual is not None, out)

    def apply_rope(self, stream, x, rows: int) -> None:
        """Rotate x (T, H, dr) in place at the rows' positions (a view into q or kv)."""
        count = rows * x.shape[1] * (x.shape[2] // 2)
        rope_kernels._rope_kernel[blocks(count, 128), 128, stream](
            x, self.buffers.positions[:rows], self.inv_freq, self.rope_scale, x)

    def experts(self, stream, x, gate_proj, up_proj, down_proj, ids, weights, hidden, out,
                accumulate: bool) -> None:
        """Each row's experts ids (T, k): SwiGLU hidden (T, k, F), then the weighted down
        projections added in slot order (onto ``out`` with ``accumulate``)."""
        rows, slots = ids.shape
        features, width = gate_proj.shape[1], x.shape[1]
        threads = pow2_threads(width)
        columns = pending.COLUMNS_PER_BLOCK
        pending.expert_hidden_rows_kernel(threads)[blocks(features, columns), threads, stream](
            x, gate_proj, up_proj, ids, hidden)
        threads = pow2_threads(features)
        pending.expert_down_rows_kernel(threads)[blocks(width, columns), threads, stream](
            hidden, down_proj, ids, weights, accumulate, out)

    def swiglu(self, stream, x, experts, out, accumulate: bool = False) -> None:
        """One always-chosen expert (the dense MLP, the shared expert): stacks (1, F, D), (1, D, F)."""
        b, rows = self.buffers, x.shape[0]
        hidden = b.single_hidden[:rows, :, :experts[0].shape[1]]                  # [T, 1, F]
        self.experts(stream, x, *experts, b.single_ids[:rows], b.single_weights[:rows], hidden,
                     out, accumulate)

    def moe(self, stream, x, params: MoEParams, out) -> None:
        """Route (router logits, then the choice), the shared expert into ``out``, then the routed
        experts added in slot order."""
        c, b = self.config, self.buffers
        rows = x.shape[0]
        ids, weights = b.expert_ids[:rows], b.expert_weights[:rows]               # [T, k] each
        self.linear(stream, x, params.gate, b.router_logits[:rows])               # [T, E]
        threads = pow2_threads(c.n_routed_experts)
        pending.route_logits_kernel[rows, threads, stream](
            b.router_logits[:rows], params.bias, c.n_group, c.topk_group, c.norm_topk_prob,
            np.float32(c.routed_scaling_factor), ids, weights)
        shared = params.shared_gate_proj is not None
        if shared:
            self.swiglu(stream, x, (params.shared_gate_proj, params.shared_up_proj,
                                    params.shared_down_proj), out)
        self.experts(stream, x, params.gate_proj, params.up_proj, params.down_proj, ids, weights,
                     b.expert_hidden[:rows], out, accumulate=shared)

    # ------------------------------------------------------------------------------------------
    # the sequences the decoders run (each replayed from its graph)

    def prompt_sequence(self, rows: int, emit_token: bool):
        """A prompt chunk (its tokens uploaded to host_rows): forward, then commit its rows, and
        with ``emit_token`` the last row's argmax as the next token."""
        b = self.buffers

        def sequence(stream):
            pending.prompt_rows_kernel[blocks(rows, ROW_THREADS), ROW_THREADS, stream](
                b.host_rows, b.tree_tokens[0, :rows], b.tree_parents[0, :rows],
                b.tree_depths[0, :rows], b.state)
            self.forward_rows(stream, rows)
            if emit_token:
                pending.commit_token_kernel[1, 1, stream](b.state, b.posterior[0], b.tree_tokens[0],
                                                          b.generated)
            else:
                pending.commit_rows_kernel[1, 1, stream](b.state)
        return sequence

    def ar_step_sequence(self):
        """One AR step: the last token (already in tokens[0]) as a one-row forward."""
        b = self.buffers

        def sequence(stream):
            pending.single_row_kernel[1, 1, stream](b.tree_parents[0], b.tree_depths[0], b.state)
            self.forward_rows(stream, 1)
            pending.commit_token_kernel[1, 1, stream](b.state, b.posterior[0], b.tree_tokens[0],
                                                      b.generated)
        return sequence

    # --8<-- [start:round_phases]
    def round_phases(self, rows: int, depths: int, k: int, budget: int):
        """One DDTree round after the drafter's logits are uploaded, as named phases of launches:
        top-K, build, verify, accept, compact (which also commits). ``rows`` is the bucket,
        ``depths`` (L) and ``k`` (K) the candidates per depth, ``budget`` (B) the drafted nodes."""
        b, c = self.buffers, self.config
        top_logprobs = b.top_logprobs[:depths * k].reshape((1, depths, k))           # [1, L, K]
        top_ids = b.top_ids[:depths * k].reshape((1, depths, k))
        tree = (b.tree_tokens[:, :rows], b.tree_parents[:, :rows], b.tree_depths[:, :rows],
                b.tree_ranks[:, :rows], b.tree_logprobs[:, :rows], b.tree_sizes)   # [1, T] each

        def top_k(stream):
            if depths and budget:
                threads = pow2_threads(c.vocab_size, 1024)
                pending.top_candidates_kernel(threads)[depths, threads, stream](
                    b.draft[:depths], top_logprobs[0], top_ids[0])                 # [L, K]

        def build(stream):
            tree_kernels._build_trees_kernel[1, tree_kernels.builder_threads(budget), stream](
                b.root, top_logprobs, top_ids, budget, *tree)                      # padded to T

        def verify(stream):
            self.forward_rows(stream, rows)                                        # posterior [T]

        def accept(stream):
            _accept_kernel[1, pow2_threads(rows), stream](
                tree[0], tree[1], b.tree_sizes, b.posterior[:, :rows], b.accepted[:, :rows],
                b.accepted_count, b.bonus)                                         # path + bonus

        def compact(stream):
            for gather in (True, False):                                           # two launches
                pending.compact_rows_kernel[(rows, c.num_hidden_layers), 32, stream](
                    self.cache.latent, self.cache.rope, b.state, b.accepted, b.accepted_count,
                    self.scratch_latent, self.scratch_rope, gather)
            pending.commit_round_kernel[1, 1, stream](
                b.state, tree[0], tree[1], tree[2], b.tree_sizes, b.accepted, b.accepted_count,
                b.bonus, b.root, b.record[:3 + 4 * rows])

        return [("top-k", top_k), ("build", build), ("verify", verify), ("accept", accept),
                ("compact", compact)]
    # --8<-- [end:round_phases]

    def round_sequence(self, rows: int, depths: int, k: int, budget: int):
        phases = self.round_phases(rows, depths, k, budget)

        def sequence(stream):
            for _, launch in phases:
                launch(stream)
        return sequence

    # ------------------------------------------------------------------------------------------
    # host-side entry points

    def check_tokens(self, tokens, name: str = "tokens") -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{name} must be a non-empty 1-D integer array, got shape {tokens.shape} "
                             f"dtype {tokens.dtype}")
        vocab = self.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"{name} must lie in [0, {vocab}), got min {tokens.min()} max {tokens.max()}")
        return tokens.astype(np.int64)

    def prefill(self, cache: DeviceCache, tokens, emit_token: bool, return_logits: bool = False):
        """Causal forward over ``tokens`` in chunks of at most Tmax rows; commits them all.

        With ``emit_token`` the last row's argmax is the next token (buffers.generated[step]).
        Returns the logits (T, V) when asked for, else None.
        """
        tokens = self.check_tokens(tokens)
        self._reserve(cache, tokens.size)
        logits = []
        for begin in range(0, tokens.size, self.max_rows):
            chunk = tokens[begin:begin + self.max_rows]
            rows = bucket_rows(chunk.size, self.max_rows)
            last = begin + self.max_rows >= tokens.size
            host_rows = np.zeros(self.max_rows + 1, np.int64)
            host_rows[0], host_rows[1:1 + chunk.size] = chunk.size, chunk
            self.graphs.upload(host_rows, self.buffers.host_rows)
            self.graphs.run(("prompt", rows, last and emit_token),
                            self.prompt_sequence(rows, last and emit_token))
            cache.length += chunk.size
            self.forward_count += 1
            if return_logits:
                logits.append(self.graphs.download(self.buffers.logits[:chunk.size]))
        return np.concatenate(logits) if return_logits else None

    def forward(self, cache: DeviceCache, tokens) -> np.ndarray:
        """A causal forward over ``tokens`` after the cached rows; returns their logits (T, V)."""
        return self.prefill(cache, tokens, emit_token=False, return_logits=True)

    def logits(self, tokens) -> np.ndarray:
        """Logits (len(tokens), V) of one causal pass from an empty cache."""
        return self.forward(self.new_cache(), tokens)

    def ar_step(self, cache: DeviceCache) -> None:
        """One AR decode step on the device: the previous token in, the next one out."""
        self._reserve(cache, 1)
        self.graphs.run(("ar",), self.ar_step_sequence())
        cache.length += 1
        self.forward_count += 1

    def check_budget(self, budget: int) -> None:
        if budget > self.max_rows - 1:
            raise ValueError(f"budget must be <= {self.max_rows - 1} (max_tree_nodes - 1 of this engine), "
                             f"got {budget}")

    def verify_round(self, cache: DeviceCache, root: int, draft: np.ndarray, k: int, budget: int):
        """Upload the drafter's logits, run the round on the device, read back its record.

        Returns (accepted node indices, bonus, tree tokens, parents, depths) as numpy arrays.
        """
        self.check_budget(budget)
        depths = min(draft.shape[0], budget)          # deeper rows can never be reached
        k = min(k, max(budget, 1))                    # neither can ranks >= B
        drafted = min(budget, candidate_count(depths, k))
        rows = bucket_rows(drafted + 1, self.max_rows)
        self._reserve(cache, drafted + 1)
        if self.device_root != root:
            self.graphs.upload(np.array([root], np.int64), self.buffers.root)
        if depths:
            self.graphs.upload(np.ascontiguousarray(draft[:depths], np.float32), self.buffers.draft[:depths])
        self.graphs.run(("round", rows, depths, k, budget), self.round_sequence(rows, depths, k, budget))
        record = self.graphs.download(self.buffers.record[:3 + 4 * rows])
        self.forward_count += 1
        kept, bonus, size = int(record[0]), int(record[1]), int(record[2])
        fields = record[3:].reshape(4, rows)
        accepted, tokens, parents, node_depths = (field[:size] for field in fields)
        cache.length += kept
        self.device_root = bonus
        return accepted[:kept].copy(), bonus, tokens.copy(), parents.copy(), node_depths.copy()


def candidate_count(depths: int, k: int) -> int:
    """Candidates a tree of ``depths`` levels with ``k`` per level can hold (capped, no overflow)."""
    total, level = 0, 1
    for _ in range(depths):
        level *= k
        total += level
        if total > 1 << 20:
            break
    return total
