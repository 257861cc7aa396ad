"""The benchmark's cases of ``kernels.linear`` and their cost model (``bytes_moved``, ``flops``).

Dimensions by the glossary: T rows, Din input features, Dout output features, V vocab_size,
D hidden_size.
"""

from __future__ import annotations

import math

from kernels.bench import peers
from kernels.bench.case import Case, uniform
from kernels.linear import argmax, linear

F32, I64 = 4, 8


def _linear_cost(*, T: int, Din: int, Dout: int) -> tuple[int, int]:
    # x (T, Din) and W (Dout, Din) read once, y (T, Dout) written once; a multiply-add per weight per row
    return F32 * (T * Din + Dout * Din + T * Dout), 2 * T * Din * Dout


def _embed_cost(*, T: int, D: int) -> tuple[int, int]:
    # the ids (int64) read once, T table rows read once and written once; no arithmetic
    return I64 * T + 2 * F32 * T * D, 0


def _argmax_cost(*, T: int, V: int) -> tuple[int, int]:
    # the logits read once, one id (int64) per row written; comparisons are not counted
    return F32 * T * V + I64 * T, 0


_COSTS = {"linear": _linear_cost, "embed": _embed_cost, "argmax": _argmax_cost}


def bytes_moved(operation: str = "linear", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once; float32 4 B, int64 8 B). Dimensions by the glossary: "linear" (T, Din, Dout),
    "embed" (T, D), "argmax" (T, V); e.g. ``bytes_moved("argmax", T=8, V=163840)``."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "linear", **dims: int) -> int:
    """Floating-point operations (a multiply-add counts 2), dimensions as in ``bytes_moved``."""
    return _COSTS[operation](**dims)[1]


def _linear_case(name: str, what: str, rows: int, depth: int, outputs: int, version: str):
    dims = {"T": rows, "Din": depth, "Dout": outputs}
    return Case(name, what, f"x ({rows}, {depth}) W ({outputs}, {depth})",
                setup=lambda seed: (uniform((rows, depth), seed),
                                    uniform((outputs, depth), seed + 1, 1 / math.sqrt(depth))),
                call=lambda inputs, **given: linear(*inputs, version=version, **given),
                bytes=bytes_moved("linear", **dims), flops=flops("linear", **dims), note=f"version={version}",
                peer=lambda inputs: peers.linear(*inputs))


def bench_cases(sizes):
    """``kernels.linear``'s cases of ``python -m kernels.bench``: decode GEMVs (the lm_head also by
    "lanes", the engine's), a tree-rows GEMM, the batch-invariant versions ("warps", "lanes") for a
    decode row and for tree rows, a prefill's GEMM and "lanes", argmax. (The lab's versions are
    timed by ``python -m lab.harness --time``.)"""
    config = sizes.config
    hidden, rows, vocab = config.hidden_size, sizes.argmax_rows, config.vocab_size
    up_mb = config.intermediate_size * hidden * F32 / 1e6
    head_gb = vocab * hidden * F32 / 1e9
    return [
        _linear_case("linear_gemv_mlp_up", f"dense-MLP up projection, 1 decode row (W {up_mb:.0f} MB)",
                     1, hidden, config.intermediate_size, "gemv"),
        _linear_case("linear_gemv_lm_head", f"lm_head, 1 decode row (W {head_gb:.1f} GB)",
                     1, hidden, vocab, "gemv"),
        _linear_case("linear_lanes_lm_head", f"lm_head, 1 decode row, the engine's \"lanes\" "
                     f"(W {head_gb:.1f} GB)", 1, hidden, vocab, "lanes"),
        _linear_case("linear_gemm", f"{sizes.rows} tree rows through a {hidden} -> "
                     f"{config.moe_intermediate_size} projection (expert-sized)",
                     sizes.rows, hidden, config.moe_intermediate_size, "gemm"),
        *(_linear_case(f"linear_{version}_mlp_up", f"the up projection, 1 decode row, batch-invariant "
                       f"(W {up_mb:.0f} MB)", 1, hidden, config.intermediate_size, version)
          for version in ("warps", "lanes")),
        *(_linear_case(f"linear_{version}_verify", f"{sizes.rows} tree rows, batch-invariant, "
                       f"{hidden} -> {config.moe_intermediate_size}", sizes.rows, hidden,
                       config.moe_intermediate_size, version)
          for version in ("warps", "lanes")),
        *(_linear_case(f"linear_{version}_prefill", f"{sizes.large_rows} prefill rows, {hidden} -> "
                       f"{config.moe_intermediate_size}", sizes.large_rows, hidden,
                       config.moe_intermediate_size, version)
          for version in ("gemm", "lanes")),
        Case("argmax", f"greedy tokens of {rows} rows of logits", f"logits ({rows}, {vocab})",
             setup=lambda seed: (uniform((rows, vocab), seed),),
             call=lambda inputs, **given: argmax(*inputs, **given),
             bytes=bytes_moved("argmax", T=rows, V=vocab), flops=flops("argmax", T=rows, V=vocab)),
    ]
