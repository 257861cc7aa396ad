"""The target model: a DeepSeek-V3 / Kimi-K2 style decoder over a latent KV cache.

Legend (docs/glossary.md): T rows of a forward, D hidden_size, V vocab_size, H num_attention_heads,
dn/dr/dv head dims, R kv_lora_rank, Rq q_lora_rank, I intermediate_size, C cache capacity.

This is the readable reference: every layer is a numpy function called through ``model.ops``
(a namespace of the layer operations, so a chapter can record or replace one). Its twin on the GPU
is ``kernels/model.py``, a device-resident engine with the same public names and the same order of
operations, whose weights, KV cache and activations stay on the device.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import types

import numpy as np

from ddtree import mla
from ddtree.config import ModelConfig
from ddtree.kv_cache import LatentKVCache
from ddtree.moe import MoEParams, route
from ddtree.rope import cos_sin_scale, inv_freq, softmax_scale
from ddtree.weights import check_weights

# module stem -> public operations the model and the decoders call
OPERATIONS = {
    "rmsnorm": ("rmsnorm",),
    "rope": ("apply_rope",),
    "linear": ("linear", "embed", "argmax"),
    "mla": ("absorb_query", "attention_absorb", "absorb_output"),
    "moe": ("moe", "swiglu"),
    "tree": ("build_tree", "visibility"),
    "accept": ("accept",),
    "kv_cache": ("compact",),
}
# q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps whatever rms_norm_eps says, as in
# DeepSeek's and Kimi's code and in transformers (RMSNorm(q_lora_rank), RMSNorm(kv_lora_rank))
LATENT_NORM_EPS = 1e-6


def numpy_operations() -> types.SimpleNamespace:
    """The numpy layer operations, by name (a fresh namespace per model, so patching one is local)."""
    ops = {}
    for stem, names in OPERATIONS.items():
        module = importlib.import_module(f"ddtree.{stem}")
        ops.update({op: getattr(module, op) for op in names})
    return types.SimpleNamespace(**ops)


def check_tokens(tokens, vocab: int) -> np.ndarray:
    """A forward's tokens: a non-empty 1-D integer array of ids in [0, vocab), as int64."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a non-empty 1-D integer array, got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"tokens must lie in [0, {vocab}), got min {tokens.min()} max {tokens.max()}")
    return tokens.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LayerParams:
    input_norm: np.ndarray                # [D]
    post_attention_norm: np.ndarray       # [D]
    q_a_proj: np.ndarray | None           # [Rq, D]        (q_lora_rank set)
    q_a_norm: np.ndarray | None           # [Rq]
    q_proj: np.ndarray                    # [H*(dn+dr), Rq or D]  q_b_proj or q_proj
    kv_a_proj: np.ndarray                 # [R+dr, D]
    kv_a_norm: np.ndarray                 # [R]
    w_uk: np.ndarray                      # [H, dn, R]
    w_uv: np.ndarray                      # [H, dv, R]
    o_proj: np.ndarray                    # [D, H*dv]
    dense: tuple | None                   # (gate [I, D], up [I, D], down [D, I]) for dense layers
    moe: MoEParams | None


def layer_params(config: ModelConfig, weights: dict, layer: int) -> LayerParams:
    """Gather one layer's weights from a Hugging Face style state dict."""
    prefix = f"model.layers.{layer}."

    def w(name):
        key = prefix + name
        if key not in weights:
            raise KeyError(f"weights are missing {key!r}")
        return np.ascontiguousarray(weights[key], dtype=np.float32)

    lora = config.q_lora_rank is not None
    w_uk, w_uv = mla.split_kv_b(w("self_attn.kv_b_proj.weight"), config.num_attention_heads,
                                config.qk_nope_head_dim, config.v_head_dim)
    dense = moe = None
    if config.is_moe_layer(layer):
        def stacked(part):
            return np.stack([w(f"mlp.experts.{e}.{part}.weight") for e in range(config.n_routed_experts)])

        shared = config.n_shared_experts > 0
        moe = MoEParams(
            gate=w("mlp.gate.weight"), bias=w("mlp.gate.e_score_correction_bias"),
            gate_proj=stacked("gate_proj"), up_proj=stacked("up_proj"), down_proj=stacked("down_proj"),
            shared_gate_proj=w("mlp.shared_experts.gate_proj.weight") if shared else None,
            shared_up_proj=w("mlp.shared_experts.up_proj.weight") if shared else None,
            shared_down_proj=w("mlp.shared_experts.down_proj.weight") if shared else None)
    else:
        dense = (w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight"))
    return LayerParams(
        input_norm=w("input_layernorm.weight"),
        post_attention_norm=w("post_attention_layernorm.weight"),
        q_a_proj=w("self_attn.q_a_proj.weight") if lora else None,
        q_a_norm=w("self_attn.q_a_layernorm.weight") if lora else None,
        q_proj=w("self_attn.q_b_proj.weight") if lora else w("self_attn.q_proj.weight"),
        kv_a_proj=w("self_attn.kv_a_proj_with_mqa.weight"),
        kv_a_norm=w("self_attn.kv_a_layernorm.weight"),
        w_uk=w_uk, w_uv=w_uv, o_proj=w("self_attn.o_proj.weight"), dense=dense, moe=moe)


class Transformer:
    """Prefill, decode and tree verification over a :class:`LatentKVCache`.

    ``attention`` picks the MLA form: 'absorb' (the cache is attended in latent space) or 'naive'
    (keys and values expanded per head); both give the same logits.
    """

    def __init__(self, config: ModelConfig, weights: dict, attention: str = "absorb"):
        if attention not in ("absorb", "naive"):
            raise ValueError(f"attention must be 'absorb' or 'naive', got {attention!r}")
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        check_weights(config, weights)
        self.config = config
        self.ops = numpy_operations()
        self.attention = attention
        self.embed_tokens = np.ascontiguousarray(weights["model.embed_tokens.weight"], dtype=np.float32)
        self.final_norm = np.ascontiguousarray(weights["model.norm.weight"], dtype=np.float32)
        self.lm_head = np.ascontiguousarray(weights["lm_head.weight"], dtype=np.float32)
        self.layers = [layer_params(config, weights, i) for i in range(config.num_hidden_layers)]
        self.inv_freq = inv_freq(config)
        self.rope_scale = cos_sin_scale(config)
        self.softmax_scale = softmax_scale(config)
        self.forward_count = 0      # target forwards run so far (prefill included)

    def new_cache(self, capacity: int | None = None) -> LatentKVCache:
        """An empty cache of ``capacity`` slots (default: max_position_embeddings)."""
        if capacity is None:
            capacity = self.config.max_position_embeddings
        return LatentKVCache.for_config(self.config, capacity)

    def check_inputs(self, cache: LatentKVCache, tokens, positions, visible):
        """Validate a forward's inputs before anything is written; returns them normalised."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        rows = tokens.size
        if positions is None:
            positions = cache.length + np.arange(rows)
        positions = np.asarray(positions)
        if positions.shape != (rows,) or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(f"positions must be {rows} integers, got shape {positions.shape}")
        limit = self.config.max_position_embeddings
        if positions.min() < 0 or positions.max() >= limit:
            raise ValueError(f"positions must lie in [0, max_position_embeddings={limit}), "
                             f"got {positions.min()}..{positions.max()}")
        visible = mla.causal_visibility(rows) if visible is None else visible
        visible = mla.check_visibility(cache.length, visible, rows)
        cache.reserve(rows)
        return tokens.astype(np.int64), positions.astype(np.int64), visible

    # --8<-- [start:forward]
    def forward(self, cache: LatentKVCache, tokens, positions=None, visible=None) -> np.ndarray:
        """Run T new tokens against the cache; returns logits (T, V) and commits T cache rows.

        ``positions`` default to the next slots; ``visible`` (T, T) defaults to causal. A tree
        verification passes node positions (start + depth) and the ancestor mask.
        """
        tokens, positions, visible = self.check_inputs(cache, tokens, positions, visible)
        start = cache.length                                        # the prefix every row sees
        h = self.ops.embed(tokens, self.embed_tokens)               # [T, D]
        for index, layer in enumerate(self.layers):
            h = self.decoder_layer(index, layer, h, cache, start, positions, visible)
        cache.commit(tokens.size)
        self.forward_count += 1
        h = self.ops.rmsnorm(h, self.final_norm, self.config.rms_norm_eps)  # [T, D]
        return self.ops.linear(h, self.lm_head)                     # [T, V]
    # --8<-- [end:forward]

    # --8<-- [start:decoder_layer]
    def decoder_layer(self, index, layer: LayerParams, h, cache, start, positions, visible):
        c, ops = self.config, self.ops
        rows, heads = h.shape[0], c.num_attention_heads
        a = ops.rmsnorm(h, layer.input_norm, c.rms_norm_eps)                      # [T, D]
        if layer.q_a_proj is not None:
            a_q = ops.rmsnorm(ops.linear(a, layer.q_a_proj), layer.q_a_norm, LATENT_NORM_EPS)  # [T, Rq]
        else:
            a_q = a
        q = ops.linear(a_q, layer.q_proj).reshape(rows, heads, c.qk_head_dim)    # [T, H, dn+dr]
        q_nope = np.ascontiguousarray(q[..., :c.qk_nope_head_dim])               # [T, H, dn]
        q_pe = ops.apply_rope(np.ascontiguousarray(q[..., c.qk_nope_head_dim:]),
                              positions, self.inv_freq, self.rope_scale)        # [T, H, dr]
        kv = ops.linear(a, layer.kv_a_proj)                                      # [T, R+dr]
        latent = ops.rmsnorm(np.ascontiguousarray(kv[:, :c.kv_lora_rank]), layer.kv_a_norm,
                             LATENT_NORM_EPS)                                    # [T, R]
        k_pe = ops.apply_rope(np.ascontiguousarray(kv[:, c.kv_lora_rank:]),
                              positions, self.inv_freq, self.rope_scale)        # [T, dr]
        cache.write(index, start, latent, k_pe)
        cache_latent, cache_rope = cache.latent[index], cache.rope[index]        # [C, R], [C, dr]
        if self.attention == "naive":
            o = mla.attention_naive(q_nope, q_pe, cache_latent, cache_rope, start, visible,
                                    self.softmax_scale, layer.w_uk, layer.w_uv)  # [T, H, dv]
        else:
            q_lat = ops.absorb_query(q_nope, layer.w_uk)                         # [T, H, R]
            o_lat = ops.attention_absorb(q_lat, q_pe, cache_latent, cache_rope, start, visible,
                                         self.softmax_scale)                     # [T, H, R]
            o = ops.absorb_output(o_lat, layer.w_uv)                             # [T, H, dv]
        h = h + ops.linear(o.reshape(rows, heads * c.v_head_dim), layer.o_proj)  # [T, D]
        f = ops.rmsnorm(h, layer.post_attention_norm, c.rms_norm_eps)            # [T, D]
        if layer.moe is not None:
            return h + ops.moe(f, layer.moe, c)                                  # [T, D]
        return h + ops.swiglu(f, *layer.dense)                                   # [T, D]
    # --8<-- [end:decoder_layer]

    def logits(self, tokens) -> np.ndarray:
        """Logits (len(tokens), V) of one causal pass from an empty cache."""
        tokens = np.asarray(tokens)
        return self.forward(self.new_cache(max(tokens.size, 1)), tokens)


def routed_experts(model: Transformer, cache: LatentKVCache, tokens, positions=None, visible=None):
    """``model.forward`` that also says which experts each MoE layer routed each row to:
    (logits (T, V), {MoE layer index: expert ids (T, num_experts_per_tok) int64}).

    The ids are ``ddtree.moe.route``'s for the very input the layer hands ``ops.moe``, so they are
    the choice ``moe`` makes inside. The forward runs on a shallow copy of ``model`` (the weights
    shared) whose ``ops.moe`` keeps them: ``model``'s ops and ``forward_count`` stay as they are,
    and the cache commits the T rows as ``forward`` does."""
    layer_of = {id(layer.moe): index for index, layer in enumerate(model.layers) if layer.moe is not None}
    routed, moe = {}, model.ops.moe

    def moe_keeping_ids(x, params, config):
        ids, _ = route(x, params.gate, params.bias, config)              # [T, num_experts_per_tok]
        routed[layer_of[id(params)]] = ids
        return moe(x, params, config)

    recorder = copy.copy(model)
    recorder.ops = types.SimpleNamespace(**{**vars(model.ops), "moe": moe_keeping_ids})
    logits = recorder.forward(cache, tokens, positions, visible)                 # [T, V]
    return logits, routed
