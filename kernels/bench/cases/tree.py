"""The benchmark's cases of ``kernels.tree`` and its cost model: batched tree builds at three
budgets and for one request alone (the default and the sorted kernel), against the numpy
reference's heap on the CPU; the drafter's top-K.

Legend: Bq requests, L draft depths, K candidates per depth, V vocab_size, B node budget, W = B + 1
tree width."""

from __future__ import annotations

import zlib

import numpy as np
from numba import cuda

import ddtree.tree
from kernels.bench.case import Case, drafter_candidates, uniform
from kernels.tree import build_trees_device, top_candidates

F32, I64 = 4, 8


def _build_cost(*, Bq: int, L: int, K: int, B: int) -> tuple[int, int]:
    # the roots and the candidates (float32 log-probs, int64 ids) read once; five (Bq, W) trees
    # (four int64 fields, float32 log-probs) and the sizes written once; comparisons only
    width = B + 1
    return I64 * Bq + (F32 + I64) * Bq * L * K + (4 * I64 + F32) * Bq * width + I64 * Bq, 0


def _visibility_cost(*, Bq: int, W: int) -> tuple[int, int]:
    # the parents (int64) read once, the (Bq, W, W) bool mask written once
    return I64 * Bq * W + Bq * W * W, 0


_COSTS = {"build_trees": _build_cost, "visibility": _visibility_cost}


def bytes_moved(operation: str = "build_trees", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once). Dimensions by the glossary: "build_trees" (Bq, L, K, B), "visibility" (Bq, W)."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "build_trees", **dims: int) -> int:
    """Floating-point operations: none counted (the builder adds one float32 per pushed candidate,
    its work is comparisons)."""
    return _COSTS[operation](**dims)[1]


def _build_case(role: str, sizes, budget: int, version: int | None = None, requests: int | None = None):
    requests = sizes.requests if requests is None else requests
    depths, vocab = sizes.depths, sizes.config.vocab_size
    rng = np.random.default_rng(zlib.crc32(f"tree_build_{role}".encode()))
    logprobs, ids = drafter_candidates(rng, requests, depths, budget, vocab)   # K = budget
    roots = rng.integers(0, vocab, requests).astype(np.int64)                 # [Bq]

    def heap():                                # the numpy reference, one request at a time
        return [ddtree.tree.build_tree(int(roots[b]), logprobs[b], ids[b], budget) for b in range(requests)]

    dims = {"Bq": requests, "L": depths, "K": budget, "B": budget}
    name = f"tree_build_{role}" + ("" if version is None else f"_v{version}")
    return Case(name, f"best-first draft trees, {requests} request{'s' * (requests > 1)}, budget {budget}",
                f"Bq={requests} L={depths} K={budget}",
                setup=lambda seed: (cuda.to_device(roots), cuda.to_device(logprobs), cuda.to_device(ids),
                                    budget),
                call=lambda inputs, **given: build_trees_device(*inputs, version=version, **given),
                bytes=bytes_moved("build_trees", **dims), flops=flops("build_trees", **dims),
                note=f"version={version or 'default'}, 6 poisoned outputs", baseline=heap,
                baseline_name=f"ddtree.tree.build_tree x {requests}")


def _top_case(sizes):
    depths, vocab, k = sizes.depths, sizes.config.vocab_size, sizes.budgets[1]
    bytes_ = F32 * depths * vocab + (F32 + I64) * depths * k    # logits read once, the top K written
    return Case("top_candidates_v2", f"the drafter's top-K per depth, K = {k}",
                f"L={depths} V={vocab} K={k}",
                setup=lambda seed: (uniform((depths, vocab), seed, 8.0),),
                call=lambda inputs, **given: top_candidates(*inputs, k, **given),
                bytes=bytes_, flops=0, note="the bitonic sort, 2 poisoned outputs")


def bench_cases(sizes):
    """Batched tree builds at three budgets (the default kernel: keyed where its keys fit, else
    sorted), and for one request alone (the default and the sorted kernel), all against the
    numpy reference's heap on the CPU; the drafter's top-K."""
    small, medium, large = sizes.budgets
    return [_build_case("small", sizes, small), _build_case("medium", sizes, medium),
            _build_case("large", sizes, large), _build_case("one", sizes, medium, requests=1),
            _build_case("one", sizes, medium, version=2, requests=1), _top_case(sizes)]
