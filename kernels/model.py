"""The device-resident engine: the numba.cuda twin of ``ddtree/model.py``.

Legend: T rows of a forward (a prompt chunk's bucket: 1, 2, 4, 8, then multiples of 8 up to
Tmax; a round's tree size), D hidden, V vocab, H heads, dn/dr/dv head dims, Rq q_lora_rank, R
kv_lora_rank, E experts, k experts per token, F moe_intermediate_size, Ly layers, C cache capacity,
L draft depths, K candidates per depth, B node budget, W tree width (= T).

Everything lives on the device from construction on: the weights (uploaded once), the latent KV cache
(``DeviceCache``), and every activation, in buffers allocated once for Tmax rows and NaN-poisoned once. Every
kernel writes into the buffer it is given (the public functions of ``kernels/`` with ``out=`` and
``stream=``). A forward over T rows is a *launch sequence* (``forward_rows``) that reads every per-step value
from device buffers whose addresses never change:

    state       [P, rows, AR step]: the cache rows before this forward (the prefix every row
                sees), the real rows of this forward, the AR tokens emitted so far
    tree_*      the rows as a tree: a prompt chunk is a chain, an AR step a single root, a
                verify a draft tree; padding rows have no parent (they see only the prefix and
                themselves, and are never committed)
    positions,  derived on the device (``kernels.tree.positions_and_paths``): position P + depth,
    paths       and each row's path root..row, which attention enumerates instead of a mask

So one captured CUDA graph per shape serves every step (``kernels.graphs``). Every reduction
runs in an order fixed by its own row: a tree node's logits are bit-identical to the AR logits at
the same position, so DDTree == AR holds exactly in the engine, for any weights.

``forward_rows`` and ``decoder_layer`` run the reference's operations in the reference's order, with four
differences of form, none of them changing a bit: q_a_proj is stacked on kv_a_proj_with_mqa at load
(``device_layer``); the latent norms, the rope key's rotation and the cache write are one launch
(``kernels.kv_cache.write_new_rows``), and the queries' rope parts are rotated in place; the MoE layer's
shared expert runs on a graph branch of its own (``kernels.moe.moe``); each residual addition is done by the
RMSNorm after it (``rmsnorm(..., residual=delta)``): the attention's by the post-attention norm, the MLP's by
the next layer's input norm or the final norm, which for an MoE layer also adds its routed experts in slot
order (``rmsnorm(..., slots=...)``, ``COMBINE_IN_NORM``) in place of the MoE's own combine launch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types

import numpy as np
from numba import cuda, int32, int64

from ddtree.config import ModelConfig
from ddtree.drafters import check_tokens as check_tokens_named
from ddtree.kv_cache import CacheOverflowError
from ddtree.model import LATENT_NORM_EPS, check_tokens
from ddtree.moe import MoEParams
from ddtree.rope import cos_sin_scale, inv_freq, softmax_scale
from ddtree.sampling import KeyedRandom, child_tokens, draw_children
from ddtree.tree import DraftTree, check_budget, tree_size
from ddtree.weights import check_weights
from kernels.accept import mark_walk
from kernels.blocks import blocks
from kernels.device import filled, poisoned, to_device
from kernels.drafters import DrafterBuffers, always_proposes, check_round, load, propose
from kernels.graphs import Graphs
from kernels.kv_cache import DeviceCache, compact_column
from kernels.mla import PathsPlan, check_plan, paths_plan
from kernels.moe import DenseScratch, MoEScratch, dense_scratch, moe_scratch
from kernels.sampling import rejection_step
from kernels.tree import BUDGET_LIMIT_IS, MAX_TREE_NODES, TreeBatch, build_trees_device, top_candidates
from kernels.tuning import BUCKET_STEP

# --8<-- [start:engine_operations]
# The kernels a forward launches, by module and name: the twin of ``ddtree.model.OPERATIONS``.
# ``Transformer.ops`` holds them (``engine_operations``); every launch of a forward goes through it,
# so replacing one there before the first forward (a lab version, say) runs the engine with it.
ENGINE_OPERATIONS = {
    "rmsnorm": ("rmsnorm",),
    "linear": ("linear", "embed", "argmax"),
    "mla": ("absorb_query", "attention_paths", "absorb_output"),    # absorb_query rotates the queries too
    "moe": ("moe", "swiglu"),
    "kv_cache": ("write_new_rows",),
    "tree": ("positions_and_paths",),
    "sampling": ("sample",),
}
# --8<-- [end:engine_operations]


def engine_operations() -> types.SimpleNamespace:
    """The engine's kernel functions, by name (a fresh namespace per engine, so patching one is local)."""
    ops = {}
    for stem, names in ENGINE_OPERATIONS.items():
        module = importlib.import_module(f"kernels.{stem}")
        ops.update({op: getattr(module, op) for op in names})
    return types.SimpleNamespace(**ops)


DEFAULT_MAX_TREE_NODES = 128    # Tmax: the largest bucket; budgets up to Tmax - 1 drafted nodes
COMBINE_IN_NORM = True          # an MoE layer's routed experts added by the next norm (one launch fewer)
TPB = 128                       # threads per block of the engine's own element-wise kernels
LENGTH, ROWS, STEP = 0, 1, 2    # the fields of the device state


def bucket_rows(rows: int, max_rows: int) -> int:
    """The bucket of a prompt chunk of ``rows`` rows (graphs are captured per bucket): 1, 2, 4, 8,
    then multiples of 8. Padding rows cost a whole row of work each, so buckets are finer than
    powers of two past 8: 33 tokens run 40 rows, not 64. (A round needs none: ``start_round``.)"""
    bucket = 1
    while bucket < min(rows, BUCKET_STEP):
        bucket *= 2
    if rows > BUCKET_STEP:
        bucket = -(-rows // BUCKET_STEP) * BUCKET_STEP
    return min(bucket, max_rows)


# ------------------------------------------------------------------------------------------------
# the engine's own kernels: the bookkeeping of a step

@cuda.jit
def add_one_kernel(positions, out):
    # one thread per row: the position of the token a row draws, one past the row's own
    i = cuda.grid(1)
    if i < positions.shape[0]:
        out[i] = positions[i] + 1


@cuda.jit
def prompt_rows_kernel(host_rows, tokens, parents, depths, state):
    # one thread per row i of a prompt chunk, uploaded as host_rows = [n, token_0 .. token_{n-1}]:
    # a chain (parent i - 1, depth i); rows past n are padding (token 0, no parent, depth 0)
    i = cuda.grid(1)
    count = host_rows[0]
    if i == 0:
        state[ROWS] = count
    if i < tokens.shape[0]:
        real = i < count
        tokens[i] = host_rows[1 + i] if real else 0
        parents[i] = i - 1 if real else -1
        depths[i] = i if real else 0


@cuda.jit
def single_row_kernel(parents, depths, state):
    # one thread: the AR step is one row, the root of a one-node tree (its token is in place)
    state[ROWS] = 1
    parents[0] = -1
    depths[0] = 0


@cuda.jit
def commit_rows_kernel(state):
    # one thread: a prompt chunk's real rows join the cache
    state[LENGTH] += state[ROWS]


@cuda.jit
def commit_token_kernel(state, posterior, tokens, generated):
    # one thread: the rows join the cache; the last row's argmax is the next token, the next
    # step's input (tokens[0]) and generated[step]
    count = state[ROWS]
    state[LENGTH] += count
    token = posterior[count - 1]
    generated[state[STEP]] = token
    state[STEP] += 1
    tokens[0] = token


@cuda.jit
def append_tokens_kernel(tokens, count, n, committed, context_length, root):
    # thread i < count: committed[n + i] = tokens[i]; thread 0 also sets the context's length n + count
    # and its root, the last token: a run of AR steps' tokens join the device's context as a round's do
    i = cuda.grid(1)
    if i < count:
        committed[n + i] = tokens[i]
    if i == 0:
        context_length[0] = n + count
        root[0] = tokens[count - 1]


# --8<-- [start:round_end_kernel]
@functools.cache
def round_end_kernel(width: int):
    """The round's end in one launch, for trees of ``width`` rows (W): acceptance, the cache's
    compaction and the commit."""

    @cuda.jit
    def kernel(state, tree_tokens, tree_parents, tree_depths, sizes, posterior, root, committed,
               context_length, record, cache_latent, cache_rope, arrivals):
        # block b = cache columns b * TPB .. of the Ly x (R + dr) (``compact_column``). Every block stages the
        # tree (tokens, parents, posterior) in shared memory and finds the walk itself (``mark_walk``: the
        # same path in every block; no block waits for another). After its columns it counts itself in
        # arrivals[0] behind a fence; the block that arrives last (every block has read P = state[LENGTH] by
        # then) commits: P += m; the bonus as the next root; the committed tokens (n of them, the root last)
        # gain the accepted nodes' tokens and the bonus; and the record the host reads back in one copy,
        # [m, bonus, N, accepted (W), tokens (W), parents (W), depths (W)] (the round's only copy of the path,
        # m and the bonus). It sets arrivals[0] back to 0 for the next round.
        # shared memory: 4 x W int64 (the tree, the drawn tokens, the path), 2 counters
        tokens = cuda.shared.array(width, int64)
        parents = cuda.shared.array(width, int64)
        drawn = cuda.shared.array(width, int64)
        path = cuda.shared.array(width, int64)
        count = cuda.shared.array(1, int32)
        last = cuda.shared.array(1, int32)
        tid, threads = cuda.threadIdx.x, cuda.blockDim.x
        first, n, size = state[LENGTH], context_length[0], sizes[0]     # read before any commit
        if tid == 0:
            count[0] = 0
        for i in range(tid, width, threads):
            tokens[i] = tree_tokens[0, i]
            parents[i] = tree_parents[0, i]
            drawn[i] = posterior[i]
            path[i] = -1
        cuda.syncthreads()
        mark_walk(tokens, parents, drawn, size, path, count)
        cuda.syncthreads()
        kept = count[0]
        compact_column(cache_latent, cache_rope, cuda.grid(1), first, path, kept)
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last[0] = cuda.atomic.add(arrivals, 0, 1) == cuda.gridDim.x - 1
        cuda.syncthreads()
        if not last[0]:
            return
        bonus_token = drawn[path[kept - 1]]
        for i in range(tid, width, threads):
            record[3 + i] = path[i]
            record[3 + width + i] = tokens[i]
            record[3 + 2 * width + i] = parents[i]
            record[3 + 3 * width + i] = tree_depths[0, i]
            if 1 <= i < kept:
                committed[n - 1 + i] = tokens[path[i]]
        if tid == 0:
            state[LENGTH] = first + kept
            root[0] = bonus_token
            committed[n - 1 + kept] = bonus_token
            context_length[0] = n + kept
            record[0] = kept
            record[1] = bonus_token
            record[2] = size
            arrivals[0] = 0

    return kernel
# --8<-- [end:round_end_kernel]


# ------------------------------------------------------------------------------------------------
# weights and buffers on the device (the cache: kernels.kv_cache.DeviceCache)

@dataclasses.dataclass(frozen=True)
class DeviceLayer:
    """One layer's weights on the device (the twin of ``ddtree.model.LayerParams``)."""
    input_norm: object            # [D]
    post_attention_norm: object   # [D]
    a_proj: object                # [Rq + R + dr, D] q_a_proj's rows, then kv_a_proj_with_mqa's
                                  # (without q_lora_rank: [R + dr, D], kv_a_proj_with_mqa alone)
    q_a_norm: object | None       # [Rq]
    q_proj: object                # [H*(dn+dr), Rq or D]  q_b_proj (or q_proj)
    kv_a_norm: object             # [R]
    w_uk: object                  # [H, dn, R]
    w_uv: object                  # [H, dv, R]
    o_proj: object                # [D, H*dv]
    dense: tuple | None           # (gate [I, D], up [I, D], down [D, I]) for dense layers
    moe: MoEParams | None


def _stack(arrays) -> object:
    """Device arrays of one shape stacked along a new first axis (device-to-device copies)."""
    out = cuda.device_array((len(arrays), *arrays[0].shape), np.float32)
    for i, array in enumerate(arrays):
        out[i].copy_to_device(array)
    return out


def _rows(arrays) -> object:
    """Device arrays (N_i, D) one under the other: (sum N_i, D) (device-to-device copies)."""
    out = cuda.device_array((sum(a.shape[0] for a in arrays), arrays[0].shape[1]), np.float32)
    first = 0
    for array in arrays:
        out[first:first + array.shape[0]].copy_to_device(array)
        first += array.shape[0]
    return out


def device_layer(config: ModelConfig, weights: dict, layer: int) -> DeviceLayer:
    """Gather one layer's weights on the device (the twin of ``ddtree.model.layer_params``).

    Host tensors are copied to the device here, once; device tensors (``kernels.weights``) are used as they
    are. Experts are stacked (E, F, D), kv_b_proj split per head into W_UK and W_UV, and q_a_proj stacked on
    kv_a_proj_with_mqa (both read the normed hidden state: one projection), with device-to-device copies.
    """
    prefix = f"model.layers.{layer}."

    def w(name):
        key = prefix + name
        if key not in weights:
            raise KeyError(f"weights are missing {key!r}")
        return to_device(weights[key], np.float32)

    c = config
    heads, nope, rank = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
    lora = c.q_lora_rank is not None
    kv_a = w("self_attn.kv_a_proj_with_mqa.weight")                                 # [R+dr, D]
    kv_b = w("self_attn.kv_b_proj.weight").reshape(heads, nope + c.v_head_dim, rank)  # [H, dn+dv, R]
    dense = moe_params = None
    if c.is_moe_layer(layer):
        experts = range(c.n_routed_experts)
        shared = [w(f"mlp.shared_experts.{part}.weight") if c.n_shared_experts else None
                  for part in ("gate_proj", "up_proj", "down_proj")]
        moe_params = MoEParams(
            gate=w("mlp.gate.weight"), bias=w("mlp.gate.e_score_correction_bias"),
            gate_proj=_stack([w(f"mlp.experts.{e}.gate_proj.weight") for e in experts]),
            up_proj=_stack([w(f"mlp.experts.{e}.up_proj.weight") for e in experts]),
            down_proj=_stack([w(f"mlp.experts.{e}.down_proj.weight") for e in experts]),
            shared_gate_proj=shared[0], shared_up_proj=shared[1], shared_down_proj=shared[2])
    else:
        dense = tuple(w(f"mlp.{part}.weight") for part in ("gate_proj", "up_proj", "down_proj"))
    return DeviceLayer(
        input_norm=w("input_layernorm.weight"), post_attention_norm=w("post_attention_layernorm.weight"),
        a_proj=_rows([w("self_attn.q_a_proj.weight"), kv_a]) if lora else kv_a,
        q_a_norm=w("self_attn.q_a_layernorm.weight") if lora else None,
        q_proj=w("self_attn.q_b_proj.weight" if lora else "self_attn.q_proj.weight"),
        kv_a_norm=w("self_attn.kv_a_layernorm.weight"),
        w_uk=_stack([kv_b[h, :nope] for h in range(heads)]),
        w_uv=_stack([kv_b[h, nope:] for h in range(heads)]),
        o_proj=w("self_attn.o_proj.weight"), dense=dense, moe=moe_params)


@dataclasses.dataclass
class PendingSteps:
    """A run of AR steps launched on the device whose tokens the host has not read yet."""
    start: int                 # the cache slot of the first step
    context: int               # the device's context before them (n tokens, the root last)
    count: int                 # its steps
    tokens: object             # their tokens' copy (Graphs.download_later)


@dataclasses.dataclass
class PendingRound:
    """A round launched on the device whose record the host has not read yet."""
    key: tuple                 # its graph's key
    phases: list               # its launches, by phase
    rows: int                  # its tree's size (W)
    followable: bool           # its drafter runs on the device, so a round may be queued after it
    record: object = None      # the record's copy (Graphs.download_later)


class Buffers:
    """Every activation and bookkeeping array of the engine, allocated once for Tmax rows."""

    def __init__(self, config: ModelConfig, max_rows: int):
        c, t = config, max_rows
        heads, rank, rope = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.state = filled((3,), 0, np.int64)                          # [P, rows, AR step]
        self.prefix = self.state[LENGTH:LENGTH + 1]                     # [1] a view: P
        # the rows, as a tree of up to Tmax nodes (also a prompt chunk or the AR step)
        self.tree = TreeBatch(*(poisoned((t,), np.float32 if name == "logprobs" else np.int64)
                                for name in TreeBatch._fields[:-1]), sizes=poisoned((1,), np.int64))
        self.positions = poisoned((t,), np.int64)                      # [Tmax] P + depth
        self.paths = poisoned((t, t), np.int64)                        # [Tmax, Tmax] path by depth
        self.host_rows = poisoned((t + 1,), np.int64)                  # [1 + Tmax] a prompt chunk
        self.root = poisoned((1,), np.int64)                           # the round's root token
        self.embed_error = filled((1,), 0, np.int32)                   # embed's range flag (ids come checked)
        # activations
        self.h = poisoned((t, c.hidden_size))                          # [T, D] the residual stream
        self.a = poisoned((t, c.hidden_size))                          # [T, D] normalised
        self.f = poisoned((t, c.hidden_size))                          # [T, D] normalised, MLP input
        self.delta = poisoned((t, c.hidden_size))                      # [T, D] attention or MLP output
        self.a_proj = poisoned((t, (c.q_lora_rank or 0) + rank + rope))  # [T, Rq + R + dr]
        self.q_a_normed = poisoned((t, c.q_lora_rank or 1))            # [T, Rq]
        self.q = poisoned((t, heads, c.qk_head_dim))                   # [T, H, dn + dr]
        self.q_lat = poisoned((t, heads, rank))                        # [T, H, R]
        self.o_lat = poisoned((t, heads, rank))                        # [T, H, R]
        self.o = poisoned((t, heads, c.v_head_dim))                    # [T, H, dv]
        self.logits = poisoned((t, c.vocab_size))                      # [T, V]
        self.posterior = poisoned((t,), np.int64)                      # [T] argmax (or sample) per row
        self.draw_positions = poisoned((t,), np.int64)                 # [T] where each row's draw goes
        self.temperature = filled((1,), 0.0, np.float64)               # sampling: read by the sampler
        self.seed = filled((1,), 0, np.int64)
        self.generated = poisoned((c.max_position_embeddings,), np.int64)  # AR tokens, by step
        # the DDTree round (K and L never need more than B <= Tmax - 1)
        self.committed = poisoned((c.max_position_embeddings + t,), np.int64)   # [C] context, root last
        self.context_length = filled((1,), 0, np.int64)                # n: committed[:n] is the context
        self.drafter = DrafterBuffers(self.committed.size, t - 1)     # a device drafter's constants
        self.draft = poisoned((t - 1, c.vocab_size))                   # [L, V] drafter logits
        self.top_logprobs = poisoned(((t - 1) ** 2,))                  # [L*K] flat, viewed (L, K)
        self.top_ids = poisoned(((t - 1) ** 2,), np.int64)
        self.record = poisoned((3 + 4 * t,), np.int64)                 # what the host reads per round
        self.round_arrivals = filled((1,), 0, np.int32)                # round_end_kernel's finished blocks
        # the sampled tree (verifier="rejection"): each node's children's tokens, -1 padded, flat
        # and viewed (W, K) per round shape
        self.children = poisoned((t * (t - 1),), np.int64)             # [Tmax * Kmax]
        self.rejection_work = None                                     # [Tmax, 2, V] float64, on first use

    def rows(self, name: str, rows: int):
        """Field ``name`` of the tree buffers as (1, T) for the tree functions."""
        return getattr(self.tree, name)[:rows].reshape((1, rows))


def rows_of(scratch, rows: int):
    """The first ``rows`` rows of every buffer of a (possibly nested) scratch tuple."""
    if scratch is None:
        return None
    nested = (MoEScratch, DenseScratch)
    return type(scratch)(*(rows_of(field, rows) if field is None or isinstance(field, nested)
                           else field[:rows] for field in scratch))


# ------------------------------------------------------------------------------------------------
# the engine

class Transformer:
    """The engine: prefill, AR steps and tree verification, every step on the device.

    ``graphs=False`` launches every kernel from Python instead of replaying captured graphs (for debugging,
    and to measure what graphs save; ``graphs.enabled`` may be switched later); the CUDA simulator always
    launches directly. ``max_tree_nodes`` (Tmax) bounds the buckets and so the budget (B <= Tmax - 1).
    ``attention_plan`` (a ``kernels.mla.PathsPlan``; None, the default: ``attention_paths``' own default) is
    how attention cuts its work, fixed per engine: any plan keeps DDTree == AR, but two engines with different
    plans round differently. ``device_drafters`` True (the default) runs the reference's own drafters as
    kernels inside the round (``kernels.drafters``); False, or any other drafter, runs ``propose`` on the host
    and uploads its logits, as the reference's loop does. Either way the same tokens, and the same trees
    except where a block drafter's candidates tie within the model tolerance.
    """

    def __init__(self, config: ModelConfig, weights: dict, graphs: bool = True,
                 max_tree_nodes: int = DEFAULT_MAX_TREE_NODES, attention_plan: PathsPlan | None = None,
                 device_drafters: bool = True):
        if isinstance(max_tree_nodes, bool) or not isinstance(max_tree_nodes, int) \
                or max_tree_nodes < 2 or max_tree_nodes & (max_tree_nodes - 1):
            raise ValueError(f"max_tree_nodes must be a power of two >= 2, got {max_tree_nodes!r}")
        if attention_plan is not None:
            check_plan(attention_plan, config.num_attention_heads)
        if not isinstance(device_drafters, bool):
            raise ValueError(f"device_drafters must be True or False, got {device_drafters!r}")
        check_weights(config, weights)                  # named errors before anything is uploaded
        self.config = config
        self.ops = engine_operations()
        self.graphs = Graphs(enabled=graphs)
        self.max_rows = max_tree_nodes
        self.device_drafters = device_drafters
        self.embed_tokens = to_device(weights["model.embed_tokens.weight"], np.float32)
        self.final_norm = to_device(weights["model.norm.weight"], np.float32)
        self.lm_head = to_device(weights["lm_head.weight"], np.float32)
        self.layers = [device_layer(config, weights, i) for i in range(config.num_hidden_layers)]
        self.inv_freq = to_device(inv_freq(config), np.float32)
        self.rope_scale = float(cos_sin_scale(config))
        self.softmax_scale = float(softmax_scale(config))
        self.buffers = Buffers(config, self.max_rows)
        self.moe_scratch = [None if layer.moe is None else moe_scratch(self.max_rows, layer.moe, config)
                            for layer in self.layers]
        dense_width = config.intermediate_size
        self.dense_scratch = dense_scratch(self.max_rows, dense_width)
        # one cache for the whole context, plus a bucket of scratch rows past its end
        self.cache = DeviceCache(config.num_hidden_layers, config.max_position_embeddings + self.max_rows,
                                 config.kv_lora_rank, config.qk_rope_head_dim)
        # attention_paths' plan (``kernels.mla.paths_plan``), its partials (versions 2, 3, 5) and
        # version 5's scores, for the largest bucket
        heads, capacity = config.num_attention_heads, self.cache.capacity
        self.attention_plan = paths_plan(heads, config.kv_lora_rank, config.qk_rope_head_dim, capacity) \
            if attention_plan is None else attention_plan
        groups = self.attention_plan.partial_groups(capacity)
        self.attention_partials = poisoned((self.max_rows, heads, groups, config.kv_lora_rank + 2)) \
            if groups else None
        self.attention_scores = poisoned((self.max_rows * heads, capacity)) if self.attention_plan.unfused \
            else None
        self.device_root = None       # the root token the device holds (the last round's bonus)
        # the host's copy of the committed tokens the device holds (buffers.committed[:n]): a
        # round's context equal to it needs no upload
        self.context_mirror = np.zeros(self.buffers.committed.size, np.int64)
        self.context_count = 0
        self.unread = 0               # rounds launched whose records the host has not read
        self.forward_count = 0        # target forwards run so far (prefill chunks included)
        self.round_timings = None     # a dict: time each round's phases (see start_round)
        self.cost_table = None        # budget="auto"'s table when a call gives none (kernels.decode)
        self.made = {}                # launch sequences and buffer views by key, made once
        self.sampling = False         # temperature > 0 (set_sampling): rows draw instead of argmax
        self.temperature, self.seed = 0.0, 0
        # the uploads and fills above ran on numba's default stream, which the engine's stream
        # (non-blocking) does not wait for: they finish before the engine's first launch reads them
        cuda.synchronize()

    def cached(self, key, make):
        """``make()`` the first time ``key`` is asked for, the same object after: the views and
        launch sequences of a step are built once, not every step (numba's slicing is host work)."""
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    # --8<-- [start:forward_rows]
    def forward_rows(self, stream, rows: int, sampling: bool = False, outcome: bool = True) -> None:
        """Launch a forward over ``rows`` rows into buffers.logits and .posterior: each
        row's argmax, or with ``sampling`` its token drawn at temperature (``kernels.sampling``);
        without ``outcome``, the logits only."""
        b, c, ops = self.buffers, self.config, self.ops
        ops.positions_and_paths(b.tree.parents[:rows], b.tree.depths[:rows], b.prefix,
                                positions=b.positions[:rows], paths=b.paths[:rows], stream=stream)
        ops.embed(b.tree.tokens[:rows], self.embed_tokens, out=b.h[:rows], stream=stream,
                  range_error=b.embed_error)                                       # [T, D]
        for index, layer in enumerate(self.layers):
            self.decoder_layer(stream, index, layer, rows)
        ops.rmsnorm(b.h[:rows], self.final_norm, c.rms_norm_eps, out=b.a[:rows], stream=stream,
                    **self.mlp_residual(len(self.layers) - 1, rows))  # h += the last mlp(f); [T, D]
        ops.linear(b.a[:rows], self.lm_head, out=b.logits[:rows], stream=stream)   # [T, V]
        if not outcome:
            return
        if sampling:                                                               # [T]
            add_one_kernel[blocks(rows, TPB), TPB, stream](b.positions[:rows], b.draw_positions[:rows])
            ops.sample(b.logits[:rows], b.draw_positions[:rows], b.temperature, b.seed,
                       out=b.posterior[:rows], stream=stream)
        else:
            ops.argmax(b.logits[:rows], out=b.posterior[:rows], stream=stream)
    # --8<-- [end:forward_rows]

    # --8<-- [start:decoder_layer]
    def decoder_layer(self, stream, index: int, layer: DeviceLayer, rows: int) -> None:
        b, c, s, ops = self.buffers, self.config, stream, self.ops
        h, a, delta = b.h[:rows], b.a[:rows], b.delta[:rows]                       # [T, D] each
        before = {} if index == 0 else self.mlp_residual(index - 1, rows)   # the layer before's mlp(f)
        ops.rmsnorm(h, layer.input_norm, c.rms_norm_eps, out=a, stream=s, **before)  # h += it
        lora, nope = c.q_lora_rank or 0, c.qk_nope_head_dim
        projected = ops.linear(a, layer.a_proj, out=b.a_proj[:rows], stream=s)     # [T, Rq + R + dr]
        cache_latent, cache_rope = self.cache.latent[index], self.cache.rope[index]  # [C, R], [C, dr]
        a_q = b.q_a_normed[:rows] if lora else a                                   # [T, Rq] or [T, D]
        # q_a_norm, kv_a_norm and the rope key, the latent and the key into slots P .. P+T-1
        ops.write_new_rows(projected, lora, layer.q_a_norm, layer.kv_a_norm, LATENT_NORM_EPS,
                           b.positions[:rows], self.inv_freq, self.rope_scale, cache_latent, cache_rope,
                           b.prefix, q_normed=a_q if lora else None, stream=s)
        q = b.q[:rows]                                                             # [T, H, dn+dr]
        ops.linear(a_q, layer.q_proj, out=q.reshape(rows, q.size // rows), stream=s)
        q_nope, q_pe = q[:, :, :nope], q[:, :, nope:]                              # [T, H, dn], [T, H, dr]
        rotation = (q_pe, b.positions[:rows], self.inv_freq, self.rope_scale)      # q_pe rotated in place,
        q_lat = ops.absorb_query(q_nope, layer.w_uk, out=b.q_lat[:rows], stream=s,   # in the same launch
                                 rope=rotation)                                    # [T, H, R]
        partials = None if self.attention_partials is None else self.attention_partials[:rows]
        scores = None if self.attention_scores is None \
            else self.attention_scores[:rows * c.num_attention_heads]                # [T H, C]
        o_lat = ops.attention_paths(q_lat, q_pe, cache_latent, cache_rope, b.prefix, b.tree.depths[:rows],
                                    b.paths[:rows], self.softmax_scale, plan=self.attention_plan,
                                    scores=scores, partials=partials, out=b.o_lat[:rows],
                                    stream=s)                                      # [T, H, R]
        o = ops.absorb_output(o_lat, layer.w_uv, out=b.o[:rows], stream=s)         # [T, H, dv]
        ops.linear(o.reshape(rows, o.size // rows), layer.o_proj, out=delta, stream=s)
        ops.rmsnorm(h, layer.post_attention_norm, c.rms_norm_eps, residual=delta, out=b.f[:rows],
                    stream=s)                                              # h += o_proj(o); [T, D]
        if layer.moe is not None:                  # h += mlp(f): the next norm's residual
            ops.moe(b.f[:rows], layer.moe, c, out=delta, stream=s, combine=not COMBINE_IN_NORM,
                    scratch=rows_of(self.moe_scratch[index], rows))
        else:
            ops.swiglu(b.f[:rows], *layer.dense, out=delta, stream=s,
                       scratch=rows_of(self.dense_scratch, rows))

    def mlp_residual(self, index: int, rows: int) -> dict:
        """What the norm after layer ``index`` adds to h, as ``rmsnorm``'s keywords: the MLP's output
        (delta); for an MoE layer with COMBINE_IN_NORM, delta holds the shared expert alone (nothing
        without one) and the routed experts come as ``slots``, added in slot order by the norm."""
        delta, layer = self.buffers.delta[:rows], self.layers[index]
        if layer.moe is None or not COMBINE_IN_NORM:
            return {"residual": delta}
        scratch = rows_of(self.moe_scratch[index], rows)
        shared = layer.moe.shared_gate_proj is not None
        return {"residual": delta if shared else None, "slots": (scratch.down, scratch.weights)}
    # --8<-- [end:decoder_layer]

    # ------------------------------------------------------------------------------------------
    # the sequences the decoders run, each replayed from its own graph

    def prompt_sequence(self, rows: int, emit_token: bool, sampling: bool = False):
        """A prompt chunk (its tokens uploaded to host_rows): forward, then commit its rows and,
        with ``emit_token``, the last row's argmax as the next token."""
        b = self.buffers

        def sequence(stream):
            prompt_rows_kernel[blocks(rows, TPB), TPB, stream](
                b.host_rows, b.tree.tokens[:rows], b.tree.parents[:rows], b.tree.depths[:rows], b.state)
            self.forward_rows(stream, rows, sampling and emit_token)
            if emit_token:
                commit_token_kernel[1, 1, stream](b.state, b.posterior, b.tree.tokens, b.generated)
            else:
                commit_rows_kernel[1, 1, stream](b.state)
        return sequence

    def ar_step_sequence(self, sampling: bool = False):
        """One AR step: the last token (already in tokens[0]) as a one-row forward."""
        b = self.buffers

        def sequence(stream):
            single_row_kernel[1, 1, stream](b.tree.parents, b.tree.depths, b.state)
            self.forward_rows(stream, 1, sampling)
            commit_token_kernel[1, 1, stream](b.state, b.posterior, b.tree.tokens, b.generated)
        return sequence

    # --8<-- [start:round_phases]
    def round_phases(self, rows: int, depths: int, k: int, budget: int, sampling: bool = False,
                     rejection: bool = False, drafter: str | None = None):
        """One DDTree round as named phases of launches: draft (with a ``drafter`` kind loaded on the device;
        otherwise its logits are uploaded before), top-K, build, verify, accept, accept+compact
        (``round_end_kernel``: the walk, the cache's compaction and the commit in one launch). ``rows`` is the
        tree's size (W), ``depths`` (L) and ``k`` (K) the candidates per depth, ``budget`` (B) the drafted
        nodes. With ``rejection`` (the sampled tree) the phases after the host has redrawn the children:
        verify (logits, then ``rejection_step`` per node), accept+compact."""
        b = self.buffers
        top_logprobs = b.top_logprobs[:depths * k].reshape((1, depths, k))           # [1, L, K]
        top_ids = b.top_ids[:depths * k].reshape((1, depths, k))
        tree = TreeBatch(*(b.rows(name, rows) for name in TreeBatch._fields[:-1]),
                         sizes=b.tree.sizes)                                        # [1, W] each

        def draft(stream):
            propose(b.drafter, b.committed, b.context_length, out=b.draft[:depths], stream=stream)

        def top_k(stream):
            if depths and budget:
                top_candidates(b.draft[:depths], k, out=(top_logprobs[0], top_ids[0]), stream=stream)

        def build(stream):
            build_trees_device(b.root, top_logprobs, top_ids, budget, out=tree, stream=stream)

        def verify(stream):
            self.forward_rows(stream, rows, sampling)                                # posterior [W]

        def verify_rejection(stream):                                                # the drawn tree
            self.forward_rows(stream, rows, outcome=False)                           # logits [W, V]
            add_one_kernel[blocks(rows, TPB), TPB, stream](b.positions[:rows], b.draw_positions[:rows])
            rejection_step(b.logits[:rows], b.draw_positions[:rows], self.children_view(rows, k),
                           b.draft[:max(depths, 1)], b.tree.depths[:rows], b.temperature, b.seed,
                           out=b.posterior[:rows], work=b.rejection_work[:rows], stream=stream)

        def accept_compact(stream):
            latent, rope = self.cache.latent, self.cache.rope
            columns = latent.shape[0] * (latent.shape[2] + rope.shape[2])
            round_end_kernel(rows)[blocks(columns, TPB), TPB, stream](
                b.state, tree.tokens, tree.parents, tree.depths, tree.sizes, b.posterior[:rows], b.root,
                b.committed, b.context_length, b.record[:3 + 4 * rows],
                latent, rope, b.round_arrivals)

        if rejection:
            return [("verify", verify_rejection), ("accept+compact", accept_compact)]
        drafting = [("draft", draft)] if drafter is not None and depths else []
        return drafting + [("top-k", top_k), ("build", build), ("verify", verify),
                           ("accept+compact", accept_compact)]
    # --8<-- [end:round_phases]

    def round_sequence(self, phases):
        """The round's phases as one launch sequence (one graph)."""
        def sequence(stream):
            for _, launch in phases:
                launch(stream)
        return sequence

    # ------------------------------------------------------------------------------------------
    # host-side entry points

    def new_cache(self, capacity: int | None = None) -> DeviceCache:
        """Empty the engine's device cache and return it (the engine owns exactly one, allocated
        for the whole context plus a bucket; ``capacity`` is checked against it)."""
        limit = self.cache.capacity
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer))
                                     or not 1 <= capacity <= limit):
            raise ValueError(f"capacity must be an integer in [1, {limit}] (max_position_embeddings + "
                             f"max_tree_nodes), got {capacity!r}")
        self.graphs.synchronize()                     # rounds launched and never read are dropped
        self.unread = 0
        self.cache.length = 0
        self.graphs.upload(np.zeros(3, np.int64), self.buffers.state)
        self.device_root = None
        self.context_count = 0
        return self.cache

    def set_sampling(self, temperature: float, seed: int) -> None:
        """Greedy at temperature 0; otherwise every forward draws each row's token with the numbers
        of (seed, position) (``kernels.sampling``). Two 8-byte uploads; graphs are kept per mode."""
        self.sampling = temperature > 0
        self.temperature, self.seed = temperature, seed        # the host's copies (the sampled tree)
        self.graphs.upload(np.array([temperature], np.float64), self.buffers.temperature)
        self.graphs.upload(np.array([seed], np.int64), self.buffers.seed)

    def _reserve(self, cache: DeviceCache, rows: int, positions: int | None = None) -> None:
        """Room for ``rows`` new rows from slot cache.length, at ``positions`` positions from
        cache.length (default ``rows``: a prefill's or an AR step's, a position each). A tree's rows
        share positions by depth, and its slots may pass the last position: the cache holds
        max_tree_nodes slots more than max_position_embeddings."""
        if cache is not self.cache:
            raise ValueError("cache must be this engine's cache (from new_cache())")
        limit = self.config.max_position_embeddings
        positions = rows if positions is None else positions
        if cache.length + positions > limit or cache.length + rows > cache.capacity:
            raise CacheOverflowError(f"KV cache overflow: {cache.length} rows cached + {rows} new (positions "
                                     f"up to {cache.length + positions}) > max_position_embeddings {limit} "
                                     f"positions and {cache.capacity} slots")

    @property
    def budget_limit(self) -> tuple[int, str]:
        """The largest budget a round takes, and what that limit is: a tree's rows fit the buffers
        of max_tree_nodes rows, and the builder's shared memory (``kernels.tree``)."""
        if self.max_rows - 1 <= MAX_TREE_NODES - 1:
            return self.max_rows - 1, "max_tree_nodes - 1 of this engine"
        return MAX_TREE_NODES - 1, BUDGET_LIMIT_IS

    def prefill(self, cache: DeviceCache, tokens, emit_token: bool, return_logits: bool = False):
        """Causal forward over ``tokens`` in chunks of at most Tmax rows; commits them all.

        With ``emit_token`` the last row's argmax is the next token (buffers.generated[step]).
        Returns the logits (T, V) when asked for, else None.
        """
        tokens = check_tokens(tokens, self.config.vocab_size)
        self._reserve(cache, tokens.size)
        logits = []
        for begin in range(0, tokens.size, self.max_rows):
            chunk = tokens[begin:begin + self.max_rows]
            rows = bucket_rows(chunk.size, self.max_rows)
            emit = emit_token and begin + self.max_rows >= tokens.size
            host_rows = np.zeros(self.max_rows + 1, np.int64)
            host_rows[0], host_rows[1:1 + chunk.size] = chunk.size, chunk
            self.graphs.upload(host_rows, self.buffers.host_rows)
            key = ("prompt", rows, emit, self.sampling)
            self.graphs.run(key, self.cached(key, functools.partial(self.prompt_sequence, rows, emit,
                                                                   self.sampling)))
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
        key = ("ar", self.sampling)
        self.graphs.run(key, self.cached(key, functools.partial(self.ar_step_sequence, self.sampling)))
        cache.length += 1
        self.forward_count += 1

    def ar_steps(self, cache: DeviceCache, context, count: int) -> np.ndarray:
        """``count`` AR steps after ``context`` (the committed tokens, the root last, not yet cached),
        launched back to back; returns their tokens (``launch_ar_steps``, then ``collect_ar_steps``)."""
        return self.collect_ar_steps(self.launch_ar_steps(cache, context, count))

    def launch_ar_steps(self, cache: DeviceCache, context, count: int) -> PendingSteps:
        """Launch ``count`` AR steps from the root ``context[-1]``: a DDTree loop's run of budget-0 rounds,
        each committing what a root-only round would. Their tokens then join the device's context
        (``append_tokens_kernel``), the last one its root, as a round's would: so a round may be
        launched after them before the host has read them (``start_round_after``). The tokens' copy is
        queued; ``collect_ar_steps`` waits for it."""
        if self.unread:
            raise ValueError("ar_steps: a launched round is unread (finish_round it first)")
        if not (isinstance(count, int | np.integer) and count >= 1):
            raise ValueError(f"count must be an integer >= 1 (AR steps), got {count!r}")
        self._reserve(cache, count)
        self.sync_context(context, count)                     # the device's context: uploaded if not there
        start, n, b = cache.length, self.context_count, self.buffers
        root = self.cached(("tokens", 1), lambda: b.tree.tokens[:1])          # the first step's input
        self.graphs.upload(np.array([context[-1]], np.int64), root)
        self.graphs.upload(np.array([cache.length, 1, 0], np.int64), b.state)        # [P, rows, AR step]
        for _ in range(count):
            self.ar_step(cache)
        append_tokens_kernel[blocks(count, TPB), TPB, self.graphs.stream](b.generated, count, n, b.committed,
                                                                          b.context_length, b.root)
        # known once the tokens are read; until then (or if they never are) a round's context is uploaded
        self.device_root, self.context_count = None, 0
        return PendingSteps(start, n, int(count), self.graphs.download_later(b.generated, count))

    def collect_ar_steps(self, steps: PendingSteps) -> np.ndarray:
        """Wait for a launched run's tokens (that copy alone) and commit them on the host, as the device did:
        the context's copy and its root. Returns the tokens."""
        tokens = self.graphs.collect(steps.tokens).copy()    # the pinned copy is reused
        n = steps.context
        self.context_mirror[n:n + steps.count] = tokens
        self.context_count = n + steps.count
        self.device_root = int(tokens[-1])
        return tokens

    def drafts_on_device(self, drafter) -> bool:
        """Whether ``drafter`` runs as kernels inside the round (``kernels.drafters``): with
        ``device_drafters`` on, for the reference's own drafters that fit; their constants are
        uploaded unless the device holds them already."""
        return self.device_drafters and load(drafter, self.config.vocab_size, self.buffers.drafter,
                                             self.graphs.upload, self.drafter_forward) is not None

    @staticmethod
    def drafter_forward(config: ModelConfig, weights: dict, rows: int) -> Transformer:
        """A block drafter's model as a second engine (its weights, cache and buffers for up to
        ``rows`` rows, on this device), whose ``forward_rows`` the round launches on the round's stream
        (``kernels.drafters.propose_block``); it never commits a row, so its cache stays empty."""
        return Transformer(config, weights, graphs=False, max_tree_nodes=max(2, 1 << (rows - 1).bit_length()),
                           device_drafters=False)

    def sync_context(self, context, rows: int) -> None:
        """Make buffers.committed[:n] the round's ``context`` (n tokens, the root last). After a round of this
        engine it is there already (``round_end_kernel`` appends what the round commits), so only a context
        the device has not seen (a generation's first round, a caller's own) is checked and uploaded."""
        n, capacity = len(context), self.buffers.committed.size
        if n + rows > capacity:
            raise ValueError(f"context must have at most {capacity - rows} tokens before a round of {rows} "
                             f"rows (max_position_embeddings + max_tree_nodes - rows), got {n}")
        if n == self.context_count and np.array_equal(self.context_mirror[:n], context):
            return
        context = check_tokens_named("context_tokens", context, self.config.vocab_size)
        self.graphs.upload(context, self.buffers.committed, prefix=True)   # no view of a new length
        self.graphs.upload(np.array([n], np.int64), self.buffers.context_length)
        self.context_mirror[:n] = context
        self.context_count = n

    def start_round(self, cache: DeviceCache, context, draft: np.ndarray | None, k: int, budget: int,
                    verifier: str = "node", depths: int | None = None) -> PendingRound:
        """Launch one round from the root ``context[-1]`` on the device; ``finish_round`` reads it.

        ``draft``: the drafter's (L, V) logits, computed on the host and uploaded here; or None:
        the drafter that ``drafts_on_device`` loaded proposes ``depths`` (L) rows inside the
        round's graph, from the committed tokens on the device. While ``round_timings`` is a dict
        (GPU only), each phase runs as its own graph between CUDA events and its device seconds
        are added to round_timings[phase] (the benchmark's round split). ``verifier="rejection"``
        at temperature > 0 (host logits only): after top-K and the build, the host redraws the
        children (``redraw_children``, the reference's draw) and the verify ends in rejection steps.
        """
        if self.unread:
            raise ValueError("start_round: a launched round is unread (finish_round it first)")
        check_budget(budget, *self.budget_limit)
        kind = None
        if draft is None:
            kind = self.buffers.drafter.kind
            if kind is None or (verifier == "rejection" and self.sampling):
                raise ValueError("draft may be None only after drafts_on_device(drafter), and not for the "
                                 "sampled tree (verifier='rejection' at temperature > 0)")
            check_round(self.buffers.drafter, len(context), depths)
        key, phases = self.round_shape(depths if kind else draft.shape[0], k, budget, kind)
        _, rows, depths, k, budget = key[:5]
        self._reserve(cache, rows, depths + 1)        # the root's position and one per depth
        self.sync_context(context, rows)
        root = int(context[-1])
        if self.device_root != root:
            self.graphs.upload(np.array([root], np.int64), self.buffers.root)
        if depths and kind is None:
            draft_rows = self.cached(("draft", depths), lambda: self.buffers.draft[:depths])
            self.graphs.upload(np.ascontiguousarray(draft[:depths], np.float32), draft_rows)
        if verifier == "rejection" and self.sampling:
            self.run_phases(("draft tree", *key), phases[:2])                      # top-K, build
            self.redraw_children(rows, k, draft, cache.length)
            key = ("rejection", *key)
            phases = self.cached(("phases", *key),
                                 lambda: self.round_phases(rows, depths, k, budget, True, rejection=True))
        followable = kind is not None and always_proposes(self.buffers.drafter)
        return self.launch_round(PendingRound(key, phases, rows, followable))

    def round_shape(self, depths: int, k: int, budget: int, kind) -> tuple[tuple, list]:
        """(graph key, phases) of a round of ``budget`` drafted nodes, ``depths`` (L) draft rows and
        K = ``k`` (``kind``: the device drafter's, None for a host draft). The key starts ("round",
        rows, L, K, budget) as the tree has them: rows the tree's nodes exactly (the key has the
        budget, L and K anyway, so buckets would save no graph)."""
        depths = min(depths, budget)                  # deeper rows can never be reached
        k = min(k, max(budget, 1))                    # neither can ranks >= B
        budget = tree_size(depths, k, budget) - 1     # the nodes the tree will have: the same tree
        rows = budget + 1
        drafter_key = None if kind is None else self.buffers.drafter.graph_key   # a block drafter's forward
        key = ("round", rows, depths, k, budget, self.sampling, drafter_key)
        phases = self.cached(("phases", *key),
                             lambda: self.round_phases(rows, depths, k, budget, self.sampling, drafter=kind))
        return key, phases

    def start_round_after(self, cache: DeviceCache, steps: PendingSteps, k: int, budget: int, depths: int
                          ) -> PendingRound | None:
        """Launch a round from the context a launched run of AR steps leaves on the device (``steps``),
        before the host has read their tokens: so the device goes straight from the steps to the round.
        Only with a drafter on the device that proposes whatever the context (``drafts_on_device`` loaded
        it; the host would need the context to draft); otherwise None (launch it after reading)."""
        drafter = self.buffers.drafter
        if self.unread or not always_proposes(drafter) or self.round_timings is not None:
            return None
        check_budget(budget, *self.budget_limit)
        size = steps.context + steps.count                    # the context the round drafts from
        check_round(drafter, size, depths)
        key, phases = self.round_shape(depths, k, budget, drafter.kind)
        rows = key[1]
        self._reserve(cache, rows, depths + 1)
        if size + rows > self.buffers.committed.size:
            return None
        return self.launch_round(PendingRound(key, phases, rows, True))

    def queue_round(self, cache: DeviceCache, pending: PendingRound, shape: tuple[int, int, int] | None = None
                    ) -> PendingRound | None:
        """Launch the round after ``pending`` before the host has read ``pending``'s record, from the
        context and root the device holds after ``pending``: of ``pending``'s shape, or of ``shape`` =
        (budget, K, L) (a budget that changes; the caller knows the block is whole). So the device goes
        straight on while the host reads the record; the round is the one the host would launch after
        reading it. Only with the drafter on the device (the host would need the context to draft),
        and only where the bounds hold whatever ``pending`` commits; otherwise None (launch it after
        reading)."""
        if self.unread != 1 or not pending.followable or self.round_timings is not None:
            return None
        following = pending
        if shape is not None:
            budget, k, depths = shape
            check_budget(budget, *self.budget_limit)
            key, phases = self.round_shape(depths, k, budget, self.buffers.drafter.kind)
            following = PendingRound(key, phases, key[1], True)
        if cache.length + pending.rows + following.rows > self.config.max_position_embeddings \
                or self.context_count + pending.rows + following.rows > self.buffers.committed.size:
            return None
        return self.launch_round(dataclasses.replace(following, record=None))

    def launch_round(self, pending: PendingRound) -> PendingRound:
        self.run_phases(pending.key, pending.phases)
        rows = pending.rows
        record_view = self.cached(("record", rows), lambda: self.buffers.record[:3 + 4 * rows])
        pending.record = self.graphs.download_later(record_view)
        self.unread += 1
        return pending

    def finish_round(self, cache: DeviceCache, pending: PendingRound):
        """Wait for a launched round's record (rounds are finished in the order they started) and
        commit it on the host: the cache length, the root and the copy of the committed tokens.
        Returns (start, accepted node indices, bonus, tree tokens, parents, depths)."""
        record = self.graphs.collect(pending.record)
        self.unread -= 1
        self.forward_count += 1
        rows, n, start = pending.rows, self.context_count, cache.length    # the context before the round
        kept, bonus, size = int(record[0]), int(record[1]), int(record[2])
        fields = record[3:].reshape(4, rows)                                 # the pinned copy: reused
        accepted, tokens, parents, node_depths = (field[:size].copy() for field in fields)
        accepted = accepted[:kept]
        cache.length += kept
        self.device_root = bonus
        self.context_mirror[n:n + kept - 1] = tokens[accepted[1:]]           # as round_end_kernel
        self.context_mirror[n + kept - 1] = bonus
        self.context_count = n + kept
        return start, accepted, bonus, tokens, parents, node_depths

    def run_phases(self, key, phases) -> None:
        """The phases as one graph, or (``round_timings``) each timed as its own."""
        if self.round_timings is None:
            self.graphs.run(key, self.cached(key, lambda: self.round_sequence(phases)))
        else:
            for phase, seconds in self.graphs.run_timed(key, phases).items():
                self.round_timings[phase] = self.round_timings.get(phase, 0.0) + seconds

    def children_view(self, rows: int, k: int):
        """The (W, K) view of the children buffer for a round of ``rows`` rows and K = ``k``."""
        width = max(k, 1)
        return self.cached(("children", rows, width),
                           lambda: self.buffers.children[:rows * width].reshape((rows, width)))

    def redraw_children(self, rows: int, k: int, draft: np.ndarray, start: int) -> None:
        """The sampled tree's tokens, drawn on the host as the reference draws them
        (``ddtree.sampling.draw_children``: the built tree's shape, each depth's tokens one draw
        without replacement from the drafter at that position), then uploaded with each node's
        children (-1 padded) for ``rejection_step``. The built tree's fields come down (the round's
        extra wait), two arrays go up."""
        b = self.buffers
        size = int(self.graphs.download(b.tree.sizes)[0])
        fields = {name: self.graphs.download(getattr(b.tree, name)[:rows])[:size]
                  for name in ("tokens", "parents", "depths", "ranks", "logprobs")}
        tree = draw_children(DraftTree(**fields), draft, start, self.temperature, KeyedRandom(self.seed))
        tokens = np.zeros(rows, np.int64)                                           # padding rows: 0
        tokens[:size] = tree.tokens
        self.graphs.upload(tokens, self.cached(("tokens", rows), lambda: b.tree.tokens[:rows]))
        kids = child_tokens(tree)                                                   # [N, c] c <= K
        children = np.full((rows, max(k, 1)), -1, np.int64)                        # [W, K]
        children[:size, :kids.shape[1]] = kids
        self.graphs.upload(children, self.children_view(rows, k))
        if b.rejection_work is None:
            b.rejection_work = poisoned((self.max_rows, 2, self.config.vocab_size), np.float64)
