"""Benchmark of every kernel at Kimi K2.6 per-layer dimensions: ``python -m kernels.bench``.

Usage:
    python -m kernels.bench                      # every case, Kimi K2.6 shapes, on the GPU
    python -m kernels.bench --out bench.md       # ... and write the report to a markdown file
    python -m kernels.bench --cases 'attention*,rmsnorm'   # names or shell patterns, comma-separated
    python -m kernels.bench --quick              # tiny shapes, one repeat (the simulator smoke test)

What is timed. Each case calls one *public* function of ``kernels`` (``rmsnorm``, ``linear``,
``attention_absorb``, ...) with device arrays in and device arrays out: exactly what an engine
calls. So a time includes the Python-side checks, the output allocation and the NaN poison fill
of ``kernels.device.poisoned`` (one extra launch per output on a GPU), and any small host->device
copy the function makes (a visibility mask, a row index list). The inputs are allocated once per
case, before timing, and filled with random values (never zeros: zeros can hide unwritten
outputs and run faster than real data).

How it is timed (per case):
  1. warm-up: one call, which compiles every kernel signature it needs and counts the kernel
     launches it makes ("launches" in the note; on a GPU the poison fills are launches too);
  2. two untimed calls on the host clock choose N: the case runs ~0.2 s, and at least 5 calls;
  3. N timed calls, each between two CUDA events on the default stream: record start, call,
     record end, wait for end. The time between the events is everything the stream saw: the
     kernels and, when the host is slower than the GPU, the gaps while Python prepares the next
     launch (a numba launch costs ~22 us of host time: small kernels are launch-bound).
     The report gives the median.
  4. Inputs that fit in the L2 cache would be timed from the cache: such cases get several input
     sets (together at least twice the L2 size, at most 16 GiB) and call i uses set i mod sets.
The tree-build cases also time the numpy reference (``ddtree.tree.build_tree``, a Python heap)
on the same requests, on the CPU with the host clock: the GPU's speed-up over it is in the note.

Bytes and FLOPs. ``bytes`` is the fewest bytes the work must move through device memory: every
input read once and every output written once (float32 = 4 B, int64 = 8 B). A kernel that
re-reads (attention reads the cache once per head, the GEMV's x) moves more; its GB/s is then an
*effective* rate, bytes / time. FLOPs count multiply-adds as 2 (softmax exps, sin/cos and
comparisons are not counted).

The two ceilings, measured in the same run:
  - copy bandwidth: a 1 GiB device-to-device copy (``d_dst.copy_to_device(d_src)``), counting
    read + write (2 GiB per copy); "% of copy BW" = the case's GB/s over it;
  - launch overhead: the median event time around one launch of an empty kernel.
A case is memory-bound when its FLOPs per byte are below FP32_PEAK / copy bandwidth (the ridge
of the roofline); a compute-bound case shows "-" under "% of copy BW" and its share of the fp32
peak (51 TFLOP/s, torch SGEMM with TF32 off on this H200, see numba-cuda-notes) in the note.

In the CUDA simulator timings are wall-clock seconds of Python threads: meaningless. The report
says so loudly, and ``--out`` is refused there unless ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import gc
import math
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import cuda, float32, uint64  # the kernels package has chosen GPU or simulator already

import ddtree.moe
import ddtree.rope
import ddtree.tree
from ddtree.config import ModelConfig, preset
from ddtree.kv_cache import LatentKVCache
from ddtree.moe import MoEParams
from kernels import accept as accept_kernels
from kernels import device
from kernels import kv_cache as kv_kernels
from kernels import linear as linear_kernels
from kernels import mla as mla_kernels
from kernels import moe as moe_kernels
from kernels import rmsnorm as rmsnorm_kernels
from kernels import rope as rope_kernels
from kernels import tree as tree_kernels
from kernels.device import SIMULATOR, blocks

F32, I64 = 4, 8                 # bytes per float32, per int64
FP32_PEAK = 51e12               # FLOP/s: torch SGEMM 8192^3, TF32 off, H200 (numba-cuda-notes, 2026-11-29)
TARGET_SECONDS = 0.2            # timed calls per case: about this long ...
MIN_REPEATS = 5                 # ... but at least this many
MAX_REPEATS = 2000              # ... and at most this many
MAX_SETS = 64                   # input sets rotated to keep small cases out of the L2 cache ...
SETS_MEMORY = 16 << 30          # ... holding at most this much device memory together
DEFAULT_L2_BYTES = 50 << 20     # when the device cannot say (H100/H200: 50 MiB)
DRAFTER_SHARPNESS = 4.0         # random drafter logits ~ N(0, 4^2): peaked, deep trees like a real drafter


# ----------------------------------------------------------------------------------------------
# sizes


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every dimension a case uses: Kimi K2.6 (``full_sizes``) or tiny (``quick_sizes``)."""
    config: ModelConfig           # model dimensions: hidden, heads, ranks, experts, vocab
    rows: int                     # T of the many-row cases: a tree of this many nodes is verified
    argmax_rows: int              # rows of logits for the argmax
    decode_prefixes: tuple        # (short, long) context lengths of a decode step
    verify_prefix: int            # context length under the verified tree
    route_tokens: int             # tokens routed by the MoE router alone
    moe_experts: int              # routed experts of the reduced MoE layer
    moe_tokens: int               # tokens through the reduced MoE layer
    requests: int                 # Bq: batched tree build and acceptance
    depths: int                   # L: draft depths per request
    budgets: tuple                # (small, medium, large) node budgets of the tree build
    accept_budget: int            # node budget of the accepted trees
    kv_layers: int                # layers of the cache compacted at once
    kv_capacity: int              # slots per layer of that cache
    accepted_len: int             # accepted path length (root included) in the compaction
    copy_bytes: int               # buffer of the device-to-device copy ceiling
    host_launches: int            # back-to-back launches timed on the host clock


def full_sizes() -> Sizes:
    """Kimi K2.6 per-layer dimensions (``ddtree.config.preset("kimi-k2.6")``)."""
    return Sizes(config=preset("kimi-k2.6"), rows=64, argmax_rows=8, decode_prefixes=(4096, 32768),
                 verify_prefix=4096, route_tokens=16, moe_experts=32, moe_tokens=16, requests=64,
                 depths=15, budgets=(16, 64, 256), accept_budget=256, kv_layers=61, kv_capacity=8192,
                 accepted_len=8, copy_bytes=1 << 30, host_launches=200)


def quick_sizes() -> Sizes:
    """Tiny shapes (preset "micro", vocab 16, MLP 8) that the CUDA simulator runs in seconds; the
    case names stay (a GEMV block per output: a small vocabulary keeps the simulator quick)."""
    config = dataclasses.replace(preset("micro"), vocab_size=16, intermediate_size=8)
    return Sizes(config=config, rows=5, argmax_rows=2, decode_prefixes=(8, 40),
                 verify_prefix=8, route_tokens=2, moe_experts=4, moe_tokens=2, requests=2,
                 depths=3, budgets=(2, 4, 8), accept_budget=8, kv_layers=2, kv_capacity=64,
                 accepted_len=3, copy_bytes=64 << 10, host_launches=3)


# ----------------------------------------------------------------------------------------------
# random device inputs


# --8<-- [start:fill_uniform_kernel]
@cuda.jit
def _fill_uniform_kernel(flat, seed, scale):
    # one thread = elements i = start, start + stride, ... of a flat view (grid-stride loop);
    # flat[i] = scale * (2u - 1) with u in [0, 1) from the top 24 bits of splitmix64(seed, i).
    # No shared memory. A counter-based hash: any element, any grid, the same value.
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, flat.size, stride):
        z = uint64(i) + uint64(seed) * uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
        z = z ^ (z >> uint64(31))
        u = float32(z >> uint64(40)) * float32(1.0 / 16777216.0)
        flat[i] = (u + u - float32(1.0)) * scale
# --8<-- [end:fill_uniform_kernel]


def uniform(shape, seed: int, scale: float = 1.0):
    """A new float32 device array, uniform in [-scale, scale).

    On a GPU the values are made on the device (no host array, no copy: the lm_head alone is
    4.7 GB); in the simulator, where every CUDA thread is a Python thread, numpy makes them.
    """
    if SIMULATOR:
        rng = np.random.default_rng(seed)
        return cuda.to_device(rng.uniform(-scale, scale, shape).astype(np.float32))
    out = cuda.device_array(shape, np.float32)
    flat = out.reshape(out.size)
    _fill_uniform_kernel[min(blocks(out.size, 256), 8192), 256](flat, seed, np.float32(scale))
    sample = flat[:min(out.size, 256)].copy_to_host()
    if not np.isfinite(sample).all() or (sample.size > 1 and np.ptp(sample) == 0):
        raise RuntimeError(f"the random fill of a {shape} array gave {sample[:8]}: not random")
    return out


def drafter_candidates(rng, requests: int, depths: int, k: int, vocab: int):
    """Random drafter output: top-K (log-prob, id) per depth, (Bq, L, K) float32 / int64.

    Log-probs: a log-softmax over K logits ~ N(0, DRAFTER_SHARPNESS^2), sorted descending (peaked
    like a trained drafter, so trees grow deep). Ids: distinct within a row, offset + i * (V // K).
    """
    logits = rng.standard_normal((requests, depths, k)) * DRAFTER_SHARPNESS
    logits -= logits.max(axis=-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    logprobs = -np.sort(-logprobs, axis=-1).astype(np.float32)                   # [Bq, L, K]
    offsets = rng.integers(0, vocab, (requests, depths, 1))
    ids = (offsets + np.arange(k) * (vocab // k)) % vocab                         # [Bq, L, K]
    return logprobs, ids.astype(np.int64)


def draft_tree(rng, sizes: Sizes, nodes: int) -> ddtree.tree.DraftTree:
    """A tree of ``nodes`` nodes (root included) from ``ddtree.tree.build_tree`` on random candidates."""
    budget = nodes - 1
    logprobs, ids = drafter_candidates(rng, 1, sizes.depths, budget, sizes.config.vocab_size)
    tree = ddtree.tree.build_tree(1, logprobs[0], ids[0], budget)
    if tree.size != nodes:
        raise RuntimeError(f"the draft tree has {tree.size} nodes, expected {nodes}")
    return tree


def accepted_path(tree: ddtree.tree.DraftTree, length: int):
    """An accepted walk of ``length`` nodes: root .. the last-popped node at depth ``length - 1``.

    The last-popped node's ancestors are rarely nodes 1, 2, ...: its rows must move in compaction.
    """
    deep = np.flatnonzero(tree.depths == length - 1)
    if deep.size == 0:
        raise RuntimeError(f"the draft tree is {tree.depths.max()} deep; an accepted path of "
                           f"{length} nodes needs depth {length - 1}")
    path = [int(deep[-1])]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return np.array(path[::-1], np.int64)                                       # [length] root first


# ----------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed call of a public ``kernels`` function."""
    name: str
    what: str                                 # what it models in the engine
    shape: str                                # the inputs, as the table shows them
    setup: Callable[[int], Any]               # seed -> device inputs, allocated once per input set
    call: Callable[[Any], Any]                # inputs -> outputs: the function under test
    bytes: int                                # fewest bytes moved: inputs read once + outputs written once
    flops: int                                # multiply-adds count 2
    note: str = ""                            # what else the time includes
    baseline: Callable[[], Any] | None = None  # the same work on the CPU, timed on the host clock
    baseline_name: str = ""
    footprint: int | None = None              # device bytes one setup allocates, if far more than bytes


def _norm_and_rope_cases(s: Sizes) -> list[Case]:
    c = s.config
    t, d = s.rows, c.hidden_size
    heads, rope_dim = c.num_attention_heads, c.qk_rope_head_dim
    inv_freq = ddtree.rope.inv_freq(c)                                          # [dr/2]
    rope_scale = ddtree.rope.cos_sin_scale(c)
    return [
        Case("rmsnorm", f"input norm of {t} tree rows", f"x ({t}, {d})",
             setup=lambda seed: (uniform((t, d), seed), uniform((d,), seed + 1), c.rms_norm_eps),
             call=lambda a: rmsnorm_kernels.rmsnorm(*a),
             bytes=F32 * (2 * t * d + d), flops=4 * t * d),
        Case("rope_q_pe", f"rotate q_pe of {t} tree rows (YaRN)", f"x ({t}, {heads}, {rope_dim})",
             setup=lambda seed: (uniform((t, heads, rope_dim), seed),
                                 cuda.to_device(np.arange(s.verify_prefix, s.verify_prefix + t)),
                                 cuda.to_device(inv_freq), rope_scale),
             call=lambda a: rope_kernels.apply_rope(*a),
             bytes=F32 * (2 * t * heads * rope_dim + rope_dim // 2) + I64 * t,
             flops=6 * t * heads * rope_dim // 2, note="FLOPs: the rotation, sin/cos not counted"),
    ]


def _linear_case(name: str, what: str, rows: int, depth: int, outputs: int, version: str) -> Case:
    return Case(name, what, f"x ({rows}, {depth}) W ({outputs}, {depth})",
                setup=lambda seed: (uniform((rows, depth), seed),
                                    uniform((outputs, depth), seed + 1, 1 / math.sqrt(depth))),
                call=lambda a: linear_kernels.linear(*a, version=version),
                bytes=F32 * (rows * depth + outputs * depth + rows * outputs),
                flops=2 * rows * depth * outputs, note=f"version={version}")


def _linear_cases(s: Sizes) -> list[Case]:
    c = s.config
    d, rows, vocab = c.hidden_size, s.argmax_rows, c.vocab_size
    up_mb = c.intermediate_size * d * F32 / 1e6
    head_gb = vocab * d * F32 / 1e9
    return [
        _linear_case("linear_gemv_mlp_up", f"dense-MLP up projection, 1 decode row (W {up_mb:.0f} MB)",
                     1, d, c.intermediate_size, "gemv"),
        _linear_case("linear_gemv_lm_head", f"lm_head, 1 decode row (W {head_gb:.1f} GB)",
                     1, d, vocab, "gemv"),
        _linear_case("linear_gemm", f"{s.rows} tree rows through a {d} -> {c.moe_intermediate_size} "
                     "projection (expert-sized)", s.rows, d, c.moe_intermediate_size, "gemm"),
        Case("argmax", f"greedy tokens of {rows} rows of logits", f"logits ({rows}, {vocab})",
             setup=lambda seed: (uniform((rows, vocab), seed),),
             call=lambda a: linear_kernels.argmax(*a),
             bytes=F32 * rows * vocab + I64 * rows, flops=0),
    ]


def _attention_case(name: str, what: str, s: Sizes, prefix: int, visible: np.ndarray) -> Case:
    """attention_absorb for T rows seeing ``prefix`` cached keys plus ``visible`` (T, T) new ones."""
    c = s.config
    t, heads, rank, rope_dim = visible.shape[0], c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    keys = prefix + t                                                           # S cache rows
    scale = ddtree.rope.softmax_scale(c)
    seen = t * prefix + int(visible.sum())                                      # (row, key) pairs scored
    return Case(name, what, f"q ({t}, {heads}, {rank}+{rope_dim}) cache ({keys}, {rank}+{rope_dim})",
                setup=lambda seed: (uniform((t, heads, rank), seed), uniform((t, heads, rope_dim), seed + 1),
                                    uniform((keys, rank), seed + 2), uniform((keys, rope_dim), seed + 3),
                                    prefix, visible, scale),
                call=lambda a: mla_kernels.attention_absorb(*a),
                bytes=F32 * (keys * (rank + rope_dim) + t * heads * (rank + rope_dim) + t * heads * rank)
                + t * t,
                flops=2 * heads * (2 * rank + rope_dim) * seen,
                note="the (T, T) mask is copied to the device per call")


def _mla_cases(s: Sizes, tree: ddtree.tree.DraftTree) -> list[Case]:
    c = s.config
    heads, nope, rank, value = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank, c.v_head_dim
    short, long = s.decode_prefixes
    decode = np.ones((1, 1), bool)
    cases = [
        _attention_case("attention_decode_short", f"absorbed MLA, 1 decode row, {short}-token context",
                        s, short, decode),
        _attention_case("attention_decode_long", f"absorbed MLA, 1 decode row, {long}-token context",
                        s, long, decode),
        _attention_case("attention_verify", f"verify a {tree.size}-node draft tree over a "
                        f"{s.verify_prefix}-token context", s, s.verify_prefix,
                        ddtree.tree.visibility(tree.parents)),
    ]
    for role, t in (("decode", 1), ("verify", s.rows)):
        cases.append(Case(
            f"absorb_query_{role}", f"q_nope -> latent query, {t} row(s)",
            f"q_nope ({t}, {heads}, {nope}) W_UK ({heads}, {nope}, {rank})",
            setup=lambda seed, t=t: (uniform((t, heads, nope), seed),
                                     uniform((heads, nope, rank), seed + 1, 1 / math.sqrt(nope))),
            call=lambda a: mla_kernels.absorb_query(*a),
            bytes=F32 * (t * heads * nope + heads * nope * rank + t * heads * rank),
            flops=2 * t * heads * nope * rank))
        cases.append(Case(
            f"absorb_output_{role}", f"latent output -> per-head values, {t} row(s)",
            f"o_lat ({t}, {heads}, {rank}) W_UV ({heads}, {value}, {rank})",
            setup=lambda seed, t=t: (uniform((t, heads, rank), seed),
                                     uniform((heads, value, rank), seed + 1, 1 / math.sqrt(rank))),
            call=lambda a: mla_kernels.absorb_output(*a),
            bytes=F32 * (t * heads * rank + heads * value * rank + t * heads * value),
            flops=2 * t * heads * value * rank))
    return cases


def _moe_cases(s: Sizes) -> list[Case]:
    c = s.config
    d, f, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    t, experts = s.route_tokens, c.n_routed_experts
    route_case = Case(
        "moe_route", f"router: sigmoid scores, top-{k} of {experts} experts, {t} tokens",
        f"x ({t}, {d}) gate ({experts}, {d})",
        # t and experts are bound now: the reduced layer below reuses the names
        setup=lambda seed, t=t, experts=experts: (
            uniform((t, d), seed), uniform((experts, d), seed + 1, 1 / math.sqrt(d)),
            uniform((experts,), seed + 2, 0.01), c),
        call=lambda a: moe_kernels.route(*a),
        bytes=F32 * (t * d + experts * d + experts) + t * k * (I64 + F32), flops=2 * t * experts * d)

    # the reduced layer: fewer routed experts, the same top-k, the real expert and shared sizes
    reduced = dataclasses.replace(c, n_routed_experts=s.moe_experts)
    t, experts, shared = s.moe_tokens, s.moe_experts, c.n_shared_experts * f
    rng = np.random.default_rng(zlib.crc32(b"moe_reduced"))
    x = rng.uniform(-1, 1, (t, d)).astype(np.float32)                           # [T, D] host copies:
    gate = rng.uniform(-1, 1, (experts, d)).astype(np.float32) / np.float32(math.sqrt(d))  # routing on
    bias = rng.uniform(-0.01, 0.01, experts).astype(np.float32)                 # the host counts experts
    used = np.unique(ddtree.moe.route(x, gate, bias, reduced)[0]).size         # distinct experts read

    def setup(seed):
        params = MoEParams(
            gate=cuda.to_device(gate), bias=cuda.to_device(bias),
            gate_proj=uniform((experts, f, d), seed, 1 / math.sqrt(d)),
            up_proj=uniform((experts, f, d), seed + 1, 1 / math.sqrt(d)),
            down_proj=uniform((experts, d, f), seed + 2, 1 / math.sqrt(f)),
            shared_gate_proj=uniform((shared, d), seed + 3, 1 / math.sqrt(d)),
            shared_up_proj=uniform((shared, d), seed + 4, 1 / math.sqrt(d)),
            shared_down_proj=uniform((d, shared), seed + 5, 1 / math.sqrt(shared)))
        return cuda.to_device(x), params, reduced

    weights_gb = (experts * 3 * f * d + 3 * shared * d) * F32 / 1e9
    moe_case = Case(
        "moe_reduced", f"MoE layer, {t} tokens, {experts} experts instead of {c.n_routed_experts} "
        f"(weights {weights_gb:.1f} GB), top-{k} + shared expert",
        f"x ({t}, {d}) experts ({experts}, {f}, {d})",
        setup=setup, call=lambda a: moe_kernels.moe(*a),
        bytes=F32 * (2 * t * d + experts * d + experts + 3 * (used + c.n_shared_experts) * f * d),
        flops=2 * t * experts * d + 2 * t * 3 * shared * d + 2 * t * k * 3 * f * d,
        note=f"bytes: the {used} experts chosen read once")
    return [route_case, moe_case]


def _tree_build_case(role: str, s: Sizes, budget: int) -> Case:
    requests, depths, vocab = s.requests, s.depths, s.config.vocab_size
    rng = np.random.default_rng(zlib.crc32(f"tree_build_{role}".encode()))
    logprobs, ids = drafter_candidates(rng, requests, depths, budget, vocab)     # K = budget
    roots = rng.integers(0, vocab, requests).astype(np.int64)                   # [Bq]
    width = budget + 1

    def heap():                                # the numpy reference, one request at a time
        return [ddtree.tree.build_tree(int(roots[b]), logprobs[b], ids[b], budget) for b in range(requests)]

    return Case(
        f"tree_build_{role}", f"best-first draft trees, {requests} requests, budget {budget}",
        f"Bq={requests} L={depths} K={budget}",
        setup=lambda seed: (cuda.to_device(roots), cuda.to_device(logprobs), cuda.to_device(ids), budget),
        call=lambda a: tree_kernels.build_trees_device(*a),
        bytes=I64 * requests + (F32 + I64) * requests * depths * budget
        + (4 * I64 + F32) * requests * width + I64 * requests,
        flops=0, note="6 poisoned outputs", baseline=heap,
        baseline_name=f"ddtree.tree.build_tree x {requests}")


def _accept_case(s: Sizes) -> Case:
    requests, budget, vocab = s.requests, s.accept_budget, s.config.vocab_size
    width = budget + 1
    rng = np.random.default_rng(zlib.crc32(b"accept_batch"))
    logprobs, ids = drafter_candidates(rng, requests, s.depths, budget, vocab)
    tokens = np.zeros((requests, width), np.int64)                              # [Bq, W] padding 0
    parents = np.full((requests, width), -1, np.int64)                          # [Bq, W] padding -1
    sizes = np.zeros(requests, np.int64)
    posterior = rng.integers(0, vocab, (requests, width)).astype(np.int64)      # [Bq, W] target's picks
    for b in range(requests):
        tree = ddtree.tree.build_tree(0, logprobs[b], ids[b], budget)
        tokens[b, :tree.size], parents[b, :tree.size], sizes[b] = tree.tokens, tree.parents, tree.size
        path = accepted_path(tree, 1 + int(tree.depths.max()))                  # a deepest walk ...
        posterior[b, path[:-1]] = tree.tokens[path[1:]]                         # ... is what the target picks
    return Case(
        "accept_batch", f"greedy acceptance of {requests} trees of {width} nodes (deepest path accepted)",
        f"Bq={requests} N={width}",
        setup=lambda seed: tuple(cuda.to_device(a) for a in (tokens, parents, sizes, posterior)),
        call=lambda a: accept_kernels.accept_batch(*a),
        bytes=I64 * (3 * requests * width + requests) + I64 * (requests * width + 2 * requests),
        flops=0, note="3 poisoned outputs")


def _kv_case(s: Sizes, tree: ddtree.tree.DraftTree) -> Case:
    c = s.config
    layers, capacity, rank, rope_dim = s.kv_layers, s.kv_capacity, c.kv_lora_rank, c.qk_rope_head_dim
    accepted = accepted_path(tree, s.accepted_len)                              # [m] node indices
    moved = int(np.count_nonzero(accepted != np.arange(accepted.size)))        # rows not in place
    if moved == 0:
        raise RuntimeError(f"the accepted path {accepted.tolist()} is already in place: nothing to time")
    start = capacity // 2                                                       # the tree's first slot

    def setup(seed):
        cache = LatentKVCache(layers, 1, 1, 1)             # a host shell; the rows live on the device
        cache.latent = uniform((layers, capacity, rank), seed)                  # [Ly, C, R]
        cache.rope = uniform((layers, capacity, rope_dim), seed + 1)            # [Ly, C, dr]
        return cache, start, accepted, tree.size

    def call(a):
        cache, first, path, nodes = a
        cache.length = first + nodes           # verification appended the tree; compaction cuts it back
        return kv_kernels.compact(cache, first, path)

    size_gb = layers * capacity * (rank + rope_dim) * F32 / 1e9
    return Case(
        "kv_compact", f"keep a {accepted.size}-node accepted path of a {tree.size}-node tree, "
        f"{layers} layers", f"cache ({layers}, {capacity}, {rank}+{rope_dim}) {size_gb:.2f} GB",
        setup=setup, call=call,
        bytes=2 * F32 * moved * layers * (rank + rope_dim) + I64 * accepted.size, flops=0,
        note=f"bytes: {moved} rows moved; the kernel gathers all {accepted.size} through scratch",
        footprint=round(size_gb * 1e9))


def make_cases(sizes: Sizes) -> list[Case]:
    """Every case, in report order."""
    rng = np.random.default_rng(zlib.crc32(b"draft_tree"))
    tree = draft_tree(rng, sizes, sizes.rows)                  # verified by attention, then compacted
    small, medium, large = sizes.budgets
    return [*_norm_and_rope_cases(sizes), *_linear_cases(sizes), *_mla_cases(sizes, tree),
            *_moe_cases(sizes), _tree_build_case("small", sizes, small),
            _tree_build_case("medium", sizes, medium), _tree_build_case("large", sizes, large),
            _accept_case(sizes), _kv_case(sizes, tree)]


def select(cases: list[Case], patterns: str | None) -> list[Case]:
    """The cases whose names match one of the comma-separated names or shell patterns."""
    if not patterns:
        return cases
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    for pattern in wanted:
        if not any(fnmatch.fnmatchcase(case.name, pattern) for case in cases):
            raise ValueError(f"--cases: {pattern!r} matches no case; the cases are "
                             f"{', '.join(case.name for case in cases)}")
    return [case for case in cases if any(fnmatch.fnmatchcase(case.name, p) for p in wanted)]


# ----------------------------------------------------------------------------------------------
# timing


@cuda.jit
def _empty_kernel():
    # one thread does nothing: the launch overhead alone
    pass


def time_once(call: Callable[[], Any], events) -> float:
    """Seconds of one call as the default stream sees it (two CUDA events); the host clock in the
    simulator, where events record nothing and simulation is synchronous.

    The outputs are kept until the end event has been waited for, so freeing them (numba frees
    device memory in batches, which synchronises) falls outside the timed region.
    """
    if SIMULATOR:
        begin = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - begin
        del out
        return seconds
    start, end = events
    start.record()
    out = call()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3    # elapsed_time is in milliseconds
    del out
    return seconds


def repeats_for(call: Callable[[], Any], quick: bool) -> int:
    """N timed calls: ~TARGET_SECONDS of wall clock, at least MIN_REPEATS (one with --quick)."""
    if quick:
        return 1
    begin = time.perf_counter()
    for _ in range(2):
        call()
    cuda.synchronize()
    per_call = (time.perf_counter() - begin) / 2
    return max(MIN_REPEATS, min(MAX_REPEATS, math.ceil(TARGET_SECONDS / max(per_call, 1e-9))))


def median_seconds(calls: list[Callable[[], Any]], repeats: int) -> float:
    """Median of ``repeats`` timed calls, cycling through ``calls`` (one per input set)."""
    events = (cuda.event(), cuda.event())
    return statistics.median(time_once(calls[i % len(calls)], events) for i in range(repeats))


@contextlib.contextmanager
def counting_launches():
    """Counts kernel launches inside the block: ``with counting_launches() as count: ...; count[0]``.

    It wraps numba's launch entry point (a private API: ``_LaunchConfiguration.__call__`` on a GPU,
    ``FakeCUDAKernel.__getitem__`` in the simulator); if that is gone, count[0] stays None.
    """
    count = [None]
    try:
        if SIMULATOR:
            from numba.cuda.simulator.kernel import FakeCUDAKernel as owner
            attribute = "__getitem__"
        else:
            from numba.cuda.dispatcher import _LaunchConfiguration as owner
            attribute = "__call__"
        original = getattr(owner, attribute)
    except (ImportError, AttributeError):
        yield count
        return

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    count[0] = 0
    setattr(owner, attribute, counted)
    try:
        yield count
    finally:
        setattr(owner, attribute, original)


def free_device_memory() -> None:
    """Release what the last case allocated (numba defers frees and runs them in batches)."""
    gc.collect()
    if not SIMULATOR:
        context = cuda.current_context()
        for owner in (context.memory_manager, context):     # device arrays; streams and events
            pending = getattr(owner, "deallocations", None)
            if pending is not None:
                pending.clear()


def l2_bytes() -> int:
    if SIMULATOR:
        return DEFAULT_L2_BYTES
    try:
        return int(cuda.get_current_device().L2_CACHE_SIZE) or DEFAULT_L2_BYTES
    except Exception:                          # an attribute this driver does not report
        return DEFAULT_L2_BYTES


# ----------------------------------------------------------------------------------------------
# running


@dataclasses.dataclass
class Result:
    case: Case
    seconds: float                             # median per call
    repeats: int
    sets: int                                  # input sets rotated through
    launches: int | None                       # kernel launches per call (None: could not count)
    baseline_seconds: float | None = None      # median of the CPU baseline, if the case has one


@dataclasses.dataclass
class Report:
    simulator: bool
    quick: bool
    header: list                               # (key, value) pairs
    copy_bytes: int                            # size of the copied buffer
    copy_seconds: float                        # median per copy
    launch_seconds: float                      # median event time around one empty launch
    host_launch_seconds: float                 # host time per launch, back to back
    results: list

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second of the device-to-device copy, read + write counted."""
        return 2 * self.copy_bytes / self.copy_seconds


def run_case(case: Case, quick: bool) -> Result:
    seed = zlib.crc32(case.name.encode())
    # enough input sets to touch at least twice the L2 between two uses of one set, so no timed
    # call finds its inputs in the cache; one set for cases that are larger than that anyway
    footprint = case.footprint or case.bytes
    sets = max(1, min(2 if quick else MAX_SETS, math.ceil(2 * l2_bytes() / max(case.bytes, 1)),
                      SETS_MEMORY // max(footprint, 1)))
    states = [case.setup(seed + 1000 * i) for i in range(sets)]
    calls = [lambda state=state: case.call(state) for state in states]
    with counting_launches() as count:                                          # warm-up: compiles,
        calls[0]()                                                              # and counts launches
    cuda.synchronize()
    repeats = repeats_for(calls[0], quick)
    seconds = median_seconds(calls, repeats)
    baseline_seconds = None
    if case.baseline is not None:
        begin = time.perf_counter()
        case.baseline()
        per_call = time.perf_counter() - begin
        runs = 1 if quick else max(3, min(MAX_REPEATS, math.ceil(TARGET_SECONDS / per_call)))
        timings = []
        for _ in range(runs):
            begin = time.perf_counter()
            case.baseline()
            timings.append(time.perf_counter() - begin)
        baseline_seconds = statistics.median(timings)
    del states, calls
    free_device_memory()
    return Result(case, seconds, repeats, sets, count[0], baseline_seconds)


def measure_copy(nbytes: int, quick: bool) -> float:
    """Median seconds of one device-to-device copy of ``nbytes`` (random data)."""
    src = uniform((nbytes // F32,), 1)
    dst = cuda.device_array(src.shape, np.float32)
    copy = lambda: dst.copy_to_device(src)
    copy()
    cuda.synchronize()
    return median_seconds([copy], repeats_for(copy, quick))


def measure_launch(quick: bool, host_launches: int) -> tuple[float, float]:
    """(median event seconds around one empty launch, host seconds per launch back to back)."""
    launch = lambda: _empty_kernel[1, 32]()
    launch()                                                                    # compiles
    cuda.synchronize()
    seconds = median_seconds([launch], repeats_for(launch, quick))
    begin = time.perf_counter()
    for _ in range(host_launches):
        launch()
    cuda.synchronize()
    return seconds, (time.perf_counter() - begin) / host_launches


def versions() -> list:
    """(key, value) lines of the report header: where and with what it ran."""
    import numba_cuda

    lines = [("date (UTC)", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")),
             ("GPU", device.where())]
    if not SIMULATOR:
        gpu = cuda.get_current_device()
        free, total = cuda.current_context().get_memory_info()
        lines.append(("device", f"cc {gpu.compute_capability[0]}.{gpu.compute_capability[1]}, "
                                f"{gpu.MULTIPROCESSOR_COUNT} SMs, L2 {l2_bytes() >> 20} MiB, "
                                f"{total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free)"))
        from numba.cuda.cudadrv import driver
        major, minor = driver.get_version()
        lines.append(("driver", f"{nvidia_driver()} (CUDA driver API {major}.{minor})"))
    lines.append(("versions", f"numba {numba.__version__}, numba-cuda {numba_cuda.__version__}, "
                              f"numpy {np.__version__}, Python {platform.python_version()}"))
    return lines


def nvidia_driver() -> str:
    """The NVIDIA driver version from nvidia-smi, or 'unknown'."""
    if shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.strip().splitlines()[0]
    except (subprocess.SubprocessError, OSError, IndexError):
        return "unknown"


@contextlib.contextmanager
def quiet_launches():
    """No low-occupancy warnings while timing: small grids are the point of several cases, and
    formatting a warning on every launch would add host time to them."""
    from numba.cuda.core import config

    saved = config.CUDA_LOW_OCCUPANCY_WARNINGS
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    try:
        yield
    finally:
        config.CUDA_LOW_OCCUPANCY_WARNINGS = saved


def benchmark(sizes: Sizes, cases: list[Case], quick: bool, log=print) -> Report:
    """Measure the two ceilings, then every case; ``log`` gets one progress line per step."""
    with quiet_launches():
        copy_seconds = measure_copy(sizes.copy_bytes, quick)
        free_device_memory()                                                    # the two buffers
        log(f"copy: {2 * sizes.copy_bytes / copy_seconds / 1e9:.1f} GB/s")
        launch_seconds, host_launch_seconds = measure_launch(quick, sizes.host_launches)
        log(f"empty launch: {launch_seconds * 1e6:.1f} us")
        results = []
        for case in cases:
            results.append(run_case(case, quick))
            log(f"{case.name}: {results[-1].seconds * 1e6:.1f} us")
    return Report(SIMULATOR, quick, versions(), sizes.copy_bytes, copy_seconds, launch_seconds,
                  host_launch_seconds, results)


# ----------------------------------------------------------------------------------------------
# report


def _number(value: float) -> str:
    """Three significant digits, no exponent below a million."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def table_row(result: Result, report: Report) -> list[str]:
    case = result.case
    rate = case.bytes / result.seconds                                          # bytes per second
    compute_bound = case.flops / case.bytes > FP32_PEAK / report.copy_bandwidth
    notes = [case.what] + ([case.note] if case.note else [])
    if compute_bound:
        notes.append(f"compute-bound: {100 * case.flops / result.seconds / FP32_PEAK:.1f}% of fp32 peak")
    if result.baseline_seconds is not None:
        notes.append(f"CPU {case.baseline_name}: {_number(result.baseline_seconds * 1e6)} us "
                     f"= {result.baseline_seconds / result.seconds:.3g}x the GPU time")
    launches = "?" if result.launches is None else result.launches
    notes.append(f"launches {launches}, n={result.repeats}"
                 + (f", {result.sets} input sets" if result.sets > 1 else ""))
    return [case.name, case.shape, _number(result.seconds * 1e6), _number(rate / 1e9),
            "-" if compute_bound else _number(100 * rate / report.copy_bandwidth),
            _number(case.flops / result.seconds / 1e9) if case.flops else "-", "; ".join(notes)]


TABLE_HEADER = ["case", "shape", "median µs", "GB/s", "% of copy BW", "GFLOP/s", "note"]


def simulator_warning() -> str:
    return ("**CUDA SIMULATOR: every time below is Python wall-clock of simulated threads and "
            "means NOTHING about GPU performance.**")


def format_report(report: Report, command: str) -> str:
    """The whole report as markdown: header, ceilings, the table, how to read it."""
    lines = ["## Benchmarks: `python -m kernels.bench`", ""]      # a section of a docs page
    if report.simulator:
        lines += [simulator_warning(), ""]
    lines += [f"- {key}: {value}" for key, value in report.header]
    lines += [f"- command: `{command}`", f"- shapes: {'--quick (tiny)' if report.quick else 'Kimi K2.6'}",
              "", "### Ceilings (measured in this run)", "",
              f"- device-to-device copy of {_size(report.copy_bytes)}: "
              f"{_number(report.copy_bandwidth / 1e9)} GB/s (read + write counted), "
              f"{_number(report.copy_seconds * 1e6)} µs per copy",
              f"- empty kernel launch: {_number(report.launch_seconds * 1e6)} µs between events; "
              f"{_number(report.host_launch_seconds * 1e6)} µs of host time per launch back to back",
              f"- fp32 peak used for compute-bound cases: {FP32_PEAK / 1e12:.0f} TFLOP/s (not measured "
              f"here: torch SGEMM on the H200, numba-cuda-notes); ridge "
              f"{FP32_PEAK / report.copy_bandwidth:.1f} FLOP/B", "", "### Cases", ""]
    rows = [TABLE_HEADER, ["---"] * len(TABLE_HEADER)] + [table_row(r, report) for r in report.results]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    lines += ["", "Times are per call of the public function with device arrays (output allocation, "
              "NaN poison fill and small host->device copies included), median of n calls between "
              "CUDA events after a warm-up. GB/s = fewest bytes (inputs read once, outputs written "
              "once) / time. See the docstring of kernels/bench.py for the method."]
    if report.simulator:
        lines += ["", simulator_warning()]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# command line


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and one repeat (smoke test)")
    parser.add_argument("--cases", help="comma-separated case names or shell patterns (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if SIMULATOR and args.out and not args.quick:
        parser.error("the CUDA simulator's timings are meaningless: --out is refused there unless "
                     "--quick (run on a GPU with NUMBA_ENABLE_CUDASIM=0)")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    sizes = quick_sizes() if args.quick else full_sizes()
    cases = make_cases(sizes)
    if args.list:
        for case in cases:
            print(f"{case.name:24s} {case.what}")
        return 0
    try:
        cases = select(cases, args.cases)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if SIMULATOR:
        print("!" * 100 + f"\n{simulator_warning()}\n" + "!" * 100, flush=True)
    report = benchmark(sizes, cases, args.quick, log=lambda line: print(line, flush=True))
    text = format_report(report, " ".join(["python -m kernels.bench", *map(shlex.quote, argv)]))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            file.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
