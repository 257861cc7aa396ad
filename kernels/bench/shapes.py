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
import dataclasses
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


@dataclasses.dataclass
class SwigluCase:
    """The expert kernels' inputs for ``rows`` random tokens on (E, F, D) ``stacks`` (gate, up, down;
    E = 1 a dense SwiGLU), laid out as the engine lays them (``kernels.moe._launch_lanes``): a block per
    (token, slot) pair where ``kernels.moe.by_slot`` says so, else expert lists, passes of ``pass_rows``."""
    stacks: tuple
    rows: int
    top_k: int
    slotted: bool
    lists: object              # [1, T k] the pairs' experts (slotted), or [T, E] the lists
    per_pass: int
    per_expert: int
    distinct: int              # the experts the rows chose
    x: object                  # [T, D]
    hidden: object             # [T k, F]
    out: object                # [T k, D]


def swiglu_case(stacks, rows: int, top_k: int, rng) -> SwigluCase:
    from numba import cuda

    from kernels.bench.case import uniform
    from kernels.linear import pass_rows, row_passes
    from kernels.moe import LIST_TPB, by_slot, expert_lists_kernel

    experts, features, width = stacks[0].shape
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int64)
    slotted = by_slot(rows, experts, 3 * features * width * F32)
    if slotted:
        lists, per_pass, per_expert = cuda.to_device(ids.reshape(1, -1)), 1, 1     # [1, T k]
    else:
        lists = cuda.device_array((rows, experts), np.int32)                      # [T, E]
        expert_lists_kernel[experts, LIST_TPB](cuda.to_device(ids), lists)
        per_pass = pass_rows(rows)
        per_expert = row_passes(rows, per_pass)
    return SwigluCase(stacks, rows, top_k, slotted, lists, per_pass, per_expert, np.unique(ids).size,
                      uniform((rows, width), 7), cuda.device_array((rows * top_k, features), np.float32),
                      cuda.device_array((rows * top_k, width), np.float32))


def engine_shape(case: SwigluCase) -> tuple[int, int, int]:
    """The shape the engine launches ``case`` with (``kernels.moe.lane_shape``)."""
    from kernels.moe import lane_shape

    dense = case.stacks[0].shape[0] == 1 and not case.slotted
    return lane_shape(1 if case.slotted else case.rows, dense=dense)


def case_floor(case: SwigluCase, bandwidth: float) -> float:
    """Seconds to read the weights of the experts ``case``'s rows chose at ``bandwidth``."""
    _, features, width = case.stacks[0].shape
    return case.distinct * 3 * features * width * F32 / bandwidth


def launch_swiglu(stream, case: SwigluCase, shape: tuple[int, int, int]) -> None:
    """The hidden then the down kernel of ``case`` in ``shape`` (warps, C columns, U loads)."""
    from kernels.blocks import blocks
    from kernels.linear import LANES
    from kernels.moe import expert_lanes_kernels

    (warps, columns, unroll), (gate, up, down) = shape, case.stacks
    experts, features, width = gate.shape
    blocks_y = case.rows * case.top_k if case.slotted else experts * case.per_expert
    hidden_kernel, down_kernel = expert_lanes_kernels(warps, columns, unroll, case.per_pass, case.slotted)
    hidden_kernel[(blocks(features, warps * columns), blocks_y), LANES * warps, stream](
        case.x, gate, up, case.lists, case.top_k, case.per_expert, case.hidden)
    down_kernel[(blocks(width, warps * columns), blocks_y), LANES * warps, stream](
        case.hidden, down, case.lists, case.per_expert, case.out)


def launch_beside(stream, routed: SwigluCase, shared: SwigluCase, shape: tuple[int, int, int]) -> None:
    """``routed`` in the engine's shape and ``shared`` in ``shape`` on two branches, as the engine's MoE
    runs its shared experts beside its routed ones (``kernels.graphs.fork``), then joined."""
    from kernels.graphs import fork, join

    left, right = fork(stream)
    launch_swiglu(left, routed, engine_shape(routed))
    launch_swiglu(right, shared, shape)
    join(left, right)


def swiglu_rows(label: str, stacks, rows_list, top_k: int, shapes, bandwidth: float, rng) -> list[str]:
    """The expert kernels (hidden, then down) on ``stacks`` per row count and shape (``SwigluCase``)."""
    lines = []
    for rows in rows_list:
        case = swiglu_case(stacks, rows, top_k, rng)
        times = {shape: device_seconds(functools.partial(launch_swiglu, case=case, shape=shape))
                 for shape in shapes}
        experts = stacks[0].shape[0]
        what = "dense" if experts == 1 else f"{case.distinct} experts" + (", by slot" if case.slotted else "")
        floor = case_floor(case, bandwidth)
        lines.append(shape_row(f"{label}{rows} ({what})", times, floor, engine_shape(case)))
    return lines


def beside_rows(routed_stacks, shared_stacks, rows_list, top_k: int, shapes, bandwidth: float, rng
                ) -> list[str]:
    """The shared experts in each shape beside the routed experts in the engine's (``launch_beside``), per
    row count; the floor is both reads."""
    lines = []
    for rows in rows_list:
        routed = swiglu_case(routed_stacks, rows, top_k, rng)
        shared = swiglu_case(shared_stacks, rows, 1, rng)
        times = {shape: device_seconds(functools.partial(launch_beside, routed=routed, shared=shared,
                                                         shape=shape)) for shape in shapes}
        floor = case_floor(routed, bandwidth) + case_floor(shared, bandwidth)
        lines.append(shape_row(f"shared beside routed, {rows} ({routed.distinct} experts)", times, floor,
                               engine_shape(shared)))
    return lines


def expert_rows(config: ModelConfig, rows_list, shapes, bandwidth: float, rng) -> list[str]:
    """``swiglu_rows`` of one MoE layer's routed experts, its shared experts (a dense SwiGLU of
    n_shared x F features), if any, and the dense layers' SwiGLU, if any; then the shared experts'
    shapes beside the routed experts (``beside_rows``), as the engine runs them."""
    from kernels.bench.case import uniform

    def stacks(experts: int, features: int) -> tuple:
        return (uniform((experts, features, width), 1, 1 / math.sqrt(width)),
                uniform((experts, features, width), 2, 1 / math.sqrt(width)),
                uniform((experts, width, features), 3, 1 / math.sqrt(features)))

    width, features, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    routed = stacks(config.n_routed_experts, features)
    lines = swiglu_rows("", routed, rows_list, top_k, shapes, bandwidth, rng)
    if config.n_shared_experts:
        shared = stacks(1, config.n_shared_experts * features)
        lines += swiglu_rows("shared experts, ", shared, rows_list, 1, shapes, bandwidth, rng)
        lines += beside_rows(routed, shared, rows_list, top_k, shapes, bandwidth, rng)
        del shared
    del routed
    if config.first_k_dense_replace:
        lines += swiglu_rows("dense layer, ", stacks(1, config.intermediate_size), rows_list, 1, shapes,
                             bandwidth, rng)
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
