"""``python -m kernels.bench shapes``: the launch shapes of "lanes" and the expert kernels, each
timed against its floor, beside the shape the engine picks (``kernels.tuning``'s thresholds).

No shape changes a sum (``kernels.linear.lanes_shape``, ``kernels.moe.lane_shape``), so which one a
launch takes is a question of time alone, and it moves with the rows: how many loads a warp keeps
in flight against how many multiply-adds each x value feeds. For each row count this times every
candidate shape on a preset's own matrices, in a CUDA graph of back-to-back launches
(``harness.graph_seconds``), and prints µs and the ratio to the floor: the bytes of weights read
(for the experts, those the rows chose: T random tokens, k distinct experts each) at the read
bandwidth measured in the same run. The shipped shape is marked ``*``. GPU only: the simulator's
seconds say nothing, and its shapes are one warp.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import shlex
import statistics
import sys

import numpy as np

from ddtree.config import ModelConfig, preset
from kernels.device import SIMULATOR

DEFAULT_ROWS = (1, 2, 3, 4, 8)
SHAPES = ((4, 2, 16), (4, 2, 8), (4, 4, 4), (4, 4, 8), (4, 1, 16), (8, 2, 16))   # (warps, C columns, U loads)
COPIES = 10             # launches per graph replay
READ_BYTES = 1 << 30    # the read bandwidth's buffer
F32 = 4


def projections(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The "lanes" matrices of one layer of ``config`` (Dout, Din): MLA's projections (q, or q_a and
    q_b) and the shared experts' gate (their up is alike), if any."""
    heads, rope, width = config.num_attention_heads, config.qk_rope_head_dim, config.hidden_size
    query = heads * (config.qk_nope_head_dim + rope)
    shared = config.n_shared_experts * config.moe_intermediate_size
    mats = ({"q": (query, width)} if config.q_lora_rank is None else
            {"q_a": (config.q_lora_rank, width), "q_b": (query, config.q_lora_rank)})
    mats |= {"kv_a": (config.kv_lora_rank + rope, width), "o": (width, heads * config.v_head_dim)}
    return mats | ({"shared gate": (shared, width)} if shared else {})


def shape_row(label: str, times: dict, floor: float, shipped: tuple) -> str:
    """A table row: the label, then each shape's µs and its ratio to ``floor`` (seconds), fastest
    first; the shipped shape marked ``*``."""
    ranked = sorted(times.items(), key=lambda item: item[1])
    cells = [f"{'x'.join(map(str, shape))}{'*' if shape == shipped else ''} {seconds * 1e6:.1f} µs "
             f"({seconds / floor:.2f}x)" for shape, seconds in ranked]
    return f"| {label} | " + " | ".join(cells) + " |"


def device_seconds(launch) -> float:
    """Seconds per ``launch(stream)``: once to compile, then ``COPIES`` in a CUDA graph, the median replay."""
    from numba import cuda

    from kernels.bench.harness import graph_seconds

    launch(0)
    cuda.synchronize()
    return graph_seconds([launch], COPIES, False).seconds


def launch_experts(stream, kernels, grids, threads, hidden_args, down_args) -> None:
    """The hidden then the down kernel of one shape (``swiglu_rows``)."""
    kernels[0][grids[0], threads, stream](*hidden_args)
    kernels[1][grids[1], threads, stream](*down_args)


def swiglu_rows(label: str, stacks, rows_list, top_k: int, shapes, bandwidth: float, rng) -> list[str]:
    """The expert kernels (hidden, then down) on the (E, F, D) ``stacks`` (gate, up, down: E = 1 a dense
    SwiGLU, each row's one pair) per row count and shape, launched as the engine launches them
    (``kernels.moe._launch_lanes``): a block per (token, slot) pair where ``kernels.moe.by_slot`` says so,
    else expert lists with passes of ``pass_rows`` pairs."""
    from numba import cuda

    from kernels.bench.case import uniform
    from kernels.blocks import blocks
    from kernels.linear import LANES, pass_rows, row_passes
    from kernels.moe import LIST_TPB, by_slot, expert_lanes_kernels, expert_lists_kernel, lane_shape

    gate, up, down = stacks
    experts, features, width = gate.shape
    lines = []
    for rows in rows_list:
        ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int64)
        slotted = by_slot(rows, experts, 3 * features * width * F32)
        if slotted:                                                           # [1, T k]: pair p's expert
            lists, per_pass, per_expert, blocks_y = cuda.to_device(ids.reshape(1, -1)), 1, 1, ids.size
        else:
            lists = cuda.device_array((rows, experts), np.int32)              # [T, E]
            expert_lists_kernel[experts, LIST_TPB](cuda.to_device(ids), lists)
            per_pass = pass_rows(rows)
            per_expert = row_passes(rows, per_pass)
            blocks_y = experts * per_expert
        x = uniform((rows, width), 7)                                         # [T, D]
        hidden = cuda.device_array((rows * top_k, features), np.float32)      # [T k, F]
        out = cuda.device_array((rows * top_k, width), np.float32)            # [T k, D]
        times = {}
        for warps, columns, unroll in shapes:
            grids = tuple((blocks(size, warps * columns), blocks_y) for size in (features, width))
            times[(warps, columns, unroll)] = device_seconds(functools.partial(
                launch_experts, kernels=expert_lanes_kernels(warps, columns, unroll, per_pass, slotted),
                grids=grids, threads=LANES * warps,
                hidden_args=(x, gate, up, lists, top_k, per_expert, hidden),
                down_args=(hidden, down, lists, per_expert, out)))
        distinct = np.unique(ids).size
        floor = distinct * 3 * features * width * F32 / bandwidth
        shipped = lane_shape(1 if slotted else rows, dense=experts == 1 and not slotted)
        what = "dense" if experts == 1 else f"{distinct} experts" + (", by slot" if slotted else "")
        lines.append(shape_row(f"{label}{rows} ({what})", times, floor, shipped))
    return lines


def expert_rows(config: ModelConfig, rows_list, shapes, bandwidth: float, rng) -> list[str]:
    """``swiglu_rows`` of one MoE layer's routed experts, its shared experts (a dense SwiGLU of
    n_shared x F features), if any, and the dense layers' SwiGLU, if any."""
    from kernels.bench.case import uniform

    width, features = config.hidden_size, config.moe_intermediate_size
    swiglus = [("", config.n_routed_experts, features, config.num_experts_per_tok)]
    if config.n_shared_experts:
        swiglus.append(("shared experts, ", 1, config.n_shared_experts * features, 1))
    if config.first_k_dense_replace:
        swiglus.append(("dense layer, ", 1, config.intermediate_size, 1))
    lines = []
    for label, experts, features, top_k in swiglus:
        stacks = (uniform((experts, features, width), 1, 1 / math.sqrt(width)),
                  uniform((experts, features, width), 2, 1 / math.sqrt(width)),
                  uniform((experts, width, features), 3, 1 / math.sqrt(features)))
        lines += swiglu_rows(label, stacks, rows_list, top_k, shapes, bandwidth, rng)
        del stacks
    return lines


def lanes_rows(config: ModelConfig, rows_list, shapes, bandwidth: float) -> list[str]:
    """"lanes" on each projection (``projections``) per row count and shape."""
    from numba import cuda

    from kernels.bench.case import uniform
    from kernels.linear import lanes_launch, lanes_shape

    lines = []
    for name, (outputs, depth) in projections(config).items():
        weight = uniform((outputs, depth), 11, 1 / math.sqrt(depth))         # [Dout, Din]
        for rows in rows_list:
            x, out = uniform((rows, depth), 12), cuda.device_array((rows, outputs), np.float32)
            times = {shape: device_seconds(lambda stream, args=(x, weight, out), shape=shape:
                                           lanes_launch(*args, shape=shape, stream=stream))
                     for shape in shapes}
            floor = outputs * depth * F32 / bandwidth
            lines.append(shape_row(f"{name} ({outputs} x {depth}), {rows} rows", times, floor,
                                   lanes_shape(rows, outputs)))
    return lines


def table(title: str, rows: list[str], columns: int) -> list[str]:
    return ["", f"## {title}", "", "| case | " + " | ".join(f"#{i + 1}" for i in range(columns)) + " |",
            "|---" * (columns + 1) + "|", *rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench shapes",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="the model whose matrices are timed")
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="comma-separated row counts")
    parser.add_argument("--out", type=pathlib.Path, help="also write the record (markdown) here")
    args = parser.parse_args(argv)
    if SIMULATOR:
        parser.error("shapes needs a GPU (NUMBA_ENABLE_CUDASIM=0): the simulator's seconds say nothing")
    from kernels.bench.environment import versions
    from kernels.bench.harness import read_batches

    config = preset(args.preset)
    rows_list = [int(r) for r in args.rows.split(",")]
    bandwidth = READ_BYTES / statistics.median(read_batches(READ_BYTES, False))
    command = "python -m kernels.bench shapes " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = ["# Launch shapes against their floor", "", f"Command: `{command}`", ""]
    lines += [f"- {key}: {value}" for key, value in versions()]
    lines.append(f"- read bandwidth: {bandwidth / 1e9:.0f} GB/s (``read_kernel`` over 1 GiB, median batch)")
    lines.append("")
    lines.append("Each cell: shape (warps x columns x loads in flight), µs per launch (a CUDA graph of "
                 f"{COPIES}, the median replay), its ratio to the floor; fastest first, * the engine's.")
    lines += table(f"{args.preset}: the expert kernels (hidden and down), routed then dense",
                   expert_rows(config, rows_list, SHAPES, bandwidth, np.random.default_rng(0)), len(SHAPES))
    lines += table(f"{args.preset}: \"lanes\"", lanes_rows(config, rows_list, SHAPES, bandwidth), len(SHAPES))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
