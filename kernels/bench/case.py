"""What the benchmark runs: ``Case`` (one timed call of a public ``kernels`` function), the
sizes, random device inputs, and the collection of every kernel module's ``bench_cases``.

Each kernel module's benchmark is a module of ``kernels.bench.cases`` of the same name, defining
``bench_cases(sizes) -> list[Case]`` and its byte and FLOP counts. ``KERNEL_MODULES`` lists them
in report order; ``make_cases`` collects them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda, float32, uint64  # the kernels package has chosen GPU or simulator already

from ddtree.config import ModelConfig, preset
from ddtree.tree import DraftTree, build_tree
from kernels.blocks import blocks
from kernels.device import SIMULATOR

KERNEL_MODULES = ("rmsnorm", "rope", "linear", "mla", "moe", "tree", "accept", "kv_cache", "sampling")
LATENT_SCALE = 1.7              # a filled cache's latents: uniform in [-1.7, 1.7), about unit variance
DRAFTER_SHARPNESS = 4.0         # random drafter logits ~ N(0, 4^2): peaked, deep trees like a real drafter


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed call of a public ``kernels`` function, and the same work with its outputs given.

    Two timings per case (see the package docstring): ``call(inputs)``, the public call as a
    caller without buffers makes it, and the device time of ``launch(inputs, given, stream)``,
    the same kernels writing into ``given = prepare(inputs)`` (made once per input set), launched
    on ``stream`` (a CUDA graph builder on a GPU), which must allocate and copy nothing. By
    default ``given`` is one call's outputs and ``launch`` passes them back as ``out=``.
    """
    name: str
    what: str                                 # what it models in the engine
    shape: str                                # the inputs, as the table shows them
    setup: Callable[[int], Any]               # seed -> device inputs, allocated once per input set
    call: Callable[..., Any]                  # (inputs, **keywords) -> outputs: the function under test
    bytes: int                                # fewest bytes moved: inputs read once + outputs written once
    flops: int                                # multiply-adds count 2
    note: str = ""                            # what else the time includes
    baseline: Callable[[], Any] | None = None  # the same work on the CPU, timed on the host clock
    baseline_name: str = ""
    footprint: int | None = None              # device bytes one setup allocates, if far more than bytes
    prepare: Callable[[Any], Any] | None = None          # inputs -> the buffers ``launch`` writes
    launch: Callable[[Any, Any, Any], Any] | None = None  # (inputs, given, stream): outputs given
    peer: Callable[[Any], Callable[[], Any]] | None = None  # inputs -> the same work in torch

    def given(self, inputs):
        """The buffers the device-timed launch writes: ``prepare``'s, else one call's outputs."""
        return self.prepare(inputs) if self.prepare else self.call(inputs)

    def launch_given(self, inputs, given, stream):
        """The case's kernels writing into ``given`` on ``stream``: nothing allocated, nothing copied."""
        if self.launch:
            return self.launch(inputs, given, stream)
        return self.call(inputs, out=given, stream=stream)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every dimension a case uses: Kimi K2.6 (``full_sizes``) or tiny (``quick_sizes``)."""
    config: ModelConfig           # model dimensions: hidden, heads, ranks, experts, vocab
    rows: int                     # T of the many-row cases: a tree of this many nodes is verified
    large_rows: int               # T of the bandwidth-bound row cases (a prefill)
    argmax_rows: int              # rows of logits for the argmax
    decode_prefix: int            # context length of a decode step (masked attention)
    paths_contexts: tuple         # (short, long) context lengths of the engine's attention
    paths_trees: tuple            # (few, many) tree nodes verified by the engine's attention
    paths_heads: tuple            # (every head, one tensor-parallel rank's heads) of that attention
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
    read_bytes: int               # buffer of the read-bandwidth ceiling (read_kernel)
    host_launches: int            # back-to-back launches timed on the host clock


def full_sizes() -> Sizes:
    """Kimi K2.6 per-layer dimensions (``ddtree.config.preset("kimi-k2.6")``)."""
    return Sizes(config=preset("kimi-k2.6"), rows=64, large_rows=4096, argmax_rows=8,
                 decode_prefix=4096,
                 paths_contexts=(16384, 131072), paths_trees=(16, 64), paths_heads=(64, 8),
                 verify_prefix=4096, route_tokens=16, moe_experts=32, moe_tokens=16, requests=64,
                 depths=15, budgets=(16, 64, 256), accept_budget=256, kv_layers=61, kv_capacity=8192,
                 accepted_len=8, read_bytes=1 << 30, host_launches=200)


def quick_sizes() -> Sizes:
    """Tiny shapes (preset "micro", vocab 16, MLP 8) that the CUDA simulator runs in seconds; the
    case names stay (a GEMV block per output: a small vocabulary keeps the simulator quick)."""
    config = dataclasses.replace(preset("micro"), vocab_size=16, intermediate_size=8)
    return Sizes(config=config, rows=5, large_rows=7, argmax_rows=2, decode_prefix=8,
                 paths_contexts=(8, 24), paths_trees=(2, 3), paths_heads=(4, 4),
                 verify_prefix=8, route_tokens=2, moe_experts=4, moe_tokens=2, requests=2,
                 depths=3, budgets=(2, 4, 8), accept_budget=8, kv_layers=2, kv_capacity=64,
                 accepted_len=3, read_bytes=4 << 10, host_launches=3)


# --8<-- [start:fill_uniform_kernel]
@cuda.jit
def fill_uniform_kernel(flat, seed, scale):
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
    fill_uniform_kernel[min(blocks(out.size, 256), 8192), 256](flat, seed, np.float32(scale))
    sample = flat[:min(out.size, 256)].copy_to_host()
    if not np.isfinite(sample).all() or (sample.size > 1 and np.ptp(sample) == 0):
        raise RuntimeError(f"the random fill of a {shape} array gave {sample[:8]}: not random")
    return out


def fill_context(model, context: int, seed: int = 0) -> None:
    """The engine's cache holds ``context`` rows of random latents and rope keys, as if prefilled."""
    cache = model.cache
    for layer in range(cache.latent.shape[0]):
        for part, array in enumerate((cache.latent, cache.rope)):
            flat = array[layer, :context].reshape(context * array.shape[2])
            fill_uniform_kernel[min(blocks(flat.size, 256), 8192), 256](
                flat, seed * 1000 + 2 * layer + part, np.float32(LATENT_SCALE))
    cache.length = context
    model.graphs.upload(np.array([context, 0, 0], np.int64), model.buffers.state)
    model.device_root = None
    model.graphs.synchronize()


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


def draft_tree(rng, sizes: Sizes, nodes: int) -> DraftTree:
    """A tree of ``nodes`` nodes (root included) from ``ddtree.tree.build_tree`` on random candidates."""
    budget = nodes - 1
    logprobs, ids = drafter_candidates(rng, 1, sizes.depths, budget, sizes.config.vocab_size)
    tree = build_tree(1, logprobs[0], ids[0], budget)
    if tree.size != nodes:
        raise RuntimeError(f"the draft tree has {tree.size} nodes, expected {nodes}")
    return tree


def ancestor_paths(parents):
    """A tree's depths (N,) and path table (N, max depth + 1) int64: row i holds the nodes
    root .. i by depth, then -1 (what ``kernels.mla.attention_paths`` reads), from the parent links."""
    depths = np.zeros(len(parents), np.int64)
    chains = []
    for i in range(len(parents)):
        chain, node = [], i
        while node >= 0:
            chain.append(node)
            node = parents[node]
        depths[i] = len(chain) - 1
        chains.append(chain[::-1])
    paths = np.full((len(parents), int(depths.max(initial=0)) + 1), -1, np.int64)   # [N, D + 1]
    for i, chain in enumerate(chains):
        paths[i, :len(chain)] = chain
    return depths, paths


def accepted_path(tree: DraftTree, length: int):
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


def verified_tree(sizes: Sizes) -> DraftTree:
    """The draft tree of ``sizes.rows`` nodes that the attention case verifies and the compaction
    case compacts (the same seed, so every module that asks gets the same tree)."""
    return draft_tree(np.random.default_rng(zlib.crc32(b"draft_tree")), sizes, sizes.rows)


def make_cases(sizes: Sizes) -> list[Case]:
    """Every case, in report order: each kernel module's ``bench_cases(sizes)``, from its module of
    cases in ``kernels.bench.cases`` (the kernel modules never import the benchmark)."""
    return [case for name in KERNEL_MODULES for case in cases_module(name).bench_cases(sizes)]


def cases_module(name: str):
    """The benchmark cases of kernel module ``name``: ``kernels.bench.cases.<name>``, or, for a
    module not moved there yet, ``kernels.<name>`` itself."""
    try:
        return importlib.import_module(f"kernels.bench.cases.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"kernels.bench.cases.{name}":
            raise
        return importlib.import_module(f"kernels.{name}")


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
