"""``python -m kernels.bench variants``: launch-shape variants of one engine forward, each timed
beside the engine's own shapes in the same run.

A variant sets module constants that a launch reads (``kernels.tuning``'s thresholds, a kernel's
shape) while the forward's graph is captured, and restores them after. No such constant changes a
sum, so every variant's logits must equal the engine's bit for bit: the run checks them at each
context before timing, and a variant that differs, or whose launch the GPU refuses, leaves the
table with the reason printed. The cache holds ``--contexts`` tokens of random latents in turn
(``kernels.bench.case.fill_context``; a graph reads the length on the device, so one capture
serves every context); at each, the graphs of every variant and row count replay in turn, round
after round, so that clock and heat drift fall on all of them alike. The table gives each one's
median device µs and its difference from the engine's. GPU only: the simulator has no graphs.

    python -m kernels.bench variants --preset small --set scores --rows 1,2,3,4,8 \\
        --contexts 136,2048,4096,8192,16384
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pathlib
import shlex
import statistics
import sys

import numpy as np

from ddtree.config import PRESET_NAMES, preset
from kernels import tuning
from kernels.bench.ncu import positive_ints
from kernels.device import SIMULATOR


def unfused(**constants) -> dict:
    """A variant of ``kernels.mla_unfused``'s launch constants: {(module, constant): value}."""
    return {("kernels.mla_unfused", name): value for name, value in constants.items()}


def reach(rows: dict | None = None, staged: dict | None = None) -> dict:
    """A variant of the row kernel's key bounds: the engine's ``ROW_SCORES_KEYS`` and
    ``ROW_STAGED_SCORES_KEYS`` with the entries of ``rows`` and ``staged`` over them ("GEMM": that row
    count off the row kernel)."""
    bounds = {**tuning.ROW_SCORES_KEYS, **(rows or {})}
    return unfused(ROW_SCORES_KEYS={count: keys for count, keys in bounds.items() if keys != "GEMM"},
                   ROW_STAGED_SCORES_KEYS={**tuning.ROW_STAGED_SCORES_KEYS, **(staged or {})})


# a set's variants: {name: {(module, constant): value}}; the engine's shapes ({}) are always timed
VARIANT_SETS = {
    # the few rows' score kernel (kernels.mla_unfused.row_scores_kernel) against the GEMM: which rows it
    # serves, up to how many keys (the GEMM launched beside it for more), and queries side by side
    "scores": {
        "alone to 2 rows, 1 query a thread": unfused(ROW_SCORES_KEYS={1: None, 2: None}, ROW_QUERIES=1),
        "a decode row too to 4096 keys": reach(rows={1: 4096}),
        "2 rows to 16384 keys": reach(rows={2: 16384}),
        "3 rows to 8192, 4 rows to 4096 keys": reach(rows={3: 8192, 4: 4096}),
        "to 8 rows": reach(rows={8: 2048}),
        "2 queries a thread at most": unfused(ROW_QUERIES=2),
        "512 threads": unfused(ROW_THREADS=512),
    },
    # the few rows' score kernel: how far it stages its queries beside its tile (a row a block), how far it
    # reads them from global memory, where the GEMM takes over (kernels.tuning's bounds, a launch each)
    "row": {
        "queries from global memory": unfused(ROW_STAGED_KEYS=None),
        "2 to 4 rows staged to 256 keys": reach(staged={2: 256, 3: 256, 4: 256}),
        "2 to 4 rows staged to 1024 keys": reach(staged={2: 1024, 3: 1024, 4: 1024}, rows={4: 1024}),
        "a decode row staged to 1024 keys": reach(staged={1: 1024}),
        "a decode row's GEMM past 8192 keys": reach(rows={1: 8192}),
        "2 rows without the GEMM": reach(rows={2: None}),
        "4 rows unstaged to 2048 keys": reach(rows={4: 2048}),
        "4 rows on the GEMM": reach(rows={4: "GEMM"}),
        "128 threads, 5 blocks per SM": unfused(ROW_THREADS=128, ROW_BLOCKS_PER_SM=5),
    },
    # an MoE layer's routed experts added by the next norm (kernels.model.COMBINE_IN_NORM) or by their own
    # combine launch
    "moe": {
        "the combine launched apart": {("kernels.model", "COMBINE_IN_NORM"): False},
    },
    # the attention tail's (heads, threads, loads in flight) per block, for one row and for a few
    "tail": {
        "one row 1x32x16": unfused(UNFUSED_TAIL_ONE=(1, 32, 16)),
        "one row 1x64x32": unfused(UNFUSED_TAIL_ONE=(1, 64, 32)),
        "one row 2x64x16": unfused(UNFUSED_TAIL_ONE=(2, 64, 16)),
        "few rows 1x64x16": unfused(UNFUSED_TAIL_FEW=(1, 64, 16)),
        "few rows 2x64x16": unfused(UNFUSED_TAIL_FEW=(2, 64, 16)),
        "few rows 2x128x32": unfused(UNFUSED_TAIL_FEW=(2, 128, 32)),
    },
}
ENGINE = "engine"
ROUNDS = 15             # replays of each (variant, rows) graph per context, interleaved


@contextlib.contextmanager
def applied(changes: dict):
    """The module constants ``changes`` ({(module, name): value}) set, then restored, whatever
    happens inside; a name the module lacks is an error before anything is set."""
    targets = {(module, name): importlib.import_module(module) for module, name in changes}
    missing = [f"{module}.{name}" for (module, name), found in targets.items() if not hasattr(found, name)]
    if missing:
        raise ValueError(f"a variant sets constants that do not exist: {', '.join(missing)}")
    saved = {key: getattr(found, key[1]) for key, found in targets.items()}
    try:
        for key, value in changes.items():
            setattr(targets[key], key[1], value)
        yield
    finally:
        for key, value in saved.items():
            setattr(targets[key], key[1], value)


def table(times: dict, variants: list[str], rows_list: list[int], context: int) -> str:
    """The markdown table of one context: per variant and rows, the median µs of ``times[(variant,
    rows)]`` and its difference from the engine's."""
    lines = [f"| {context} cached tokens | " + " | ".join(f"T={rows}" for rows in rows_list) + " |",
             "|---|" + "---|" * len(rows_list)]
    for variant in variants:
        cells = []
        for rows in rows_list:
            median, engine = (statistics.median(times[name, rows]) for name in (variant, ENGINE))
            cells.append(f"{median:.1f}" if variant == ENGINE else f"{median:.1f} ({median - engine:+.1f})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(name: str, set_name: str, rows_list: list[int], contexts: list[int], log=print) -> list[str]:
    """Every variant of ``set_name`` beside the engine's shapes on ``name``'s forward: a table per
    context (``table``) between snippet markers (SET-CONTEXT), the lines about dropped variants before it."""
    from cuda.core import EventOptions

    from kernels.bench.engine import preset_weights, section
    from kernels.bench.profile import prepare
    from kernels.model import Transformer

    model = Transformer(preset(name), preset_weights(name))
    graphs, stream = model.graphs, model.graphs.stream
    options = EventOptions(timing_enabled=True)
    start, end = (stream.device.create_event(options=options) for _ in range(2))
    variants = {ENGINE: {}, **VARIANT_SETS[set_name]}
    alive, sections = list(variants), []
    for index, context in enumerate(contexts):
        prepare(model, name, context, max(rows_list))
        expected = {}
        for variant in list(alive):
            try:
                with applied(variants[variant]):
                    for rows in rows_list:
                        key = ("variants", variant, rows)
                        if index == 0:                        # the direct run, then the capture
                            graphs.run(key, lambda stream, rows=rows: model.forward_rows(stream, rows))
                        graphs.run(key, None)
                        graphs.synchronize()
                        logits = model.buffers.logits[:rows].copy_to_host().view(np.uint32)
                        if variant == ENGINE:
                            expected[rows] = logits
                        elif not np.array_equal(logits, expected[rows]):
                            raise AssertionError(f"its logits differ from the engine's at {rows} rows")
            except Exception as error:          # any failure drops the variant, said why
                alive.remove(variant)
                sections.append(f"- dropped at {context} cached tokens: {variant}: {type(error).__name__}: "
                                f"{str(error).splitlines()[0] if str(error) else ''}")
                log(sections[-1])
                if variant == ENGINE:
                    raise
        times = {(variant, rows): [] for variant in alive for rows in rows_list}
        for _ in range(ROUNDS):
            for rows in rows_list:
                for variant in alive:
                    stream.record(start)
                    graphs.run(("variants", variant, rows), None)
                    stream.record(end)
                    end.sync()
                    times[variant, rows].append((end - start) * 1e3)          # ms -> µs
        sections.append("\n".join(section(f"{set_name}-{context}", table(times, alive, rows_list, context)
                                           .splitlines())))
        log(sections[-1])
    return sections


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench variants",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES)
    parser.add_argument("--set", default="scores", choices=sorted(VARIANT_SETS), dest="set_name",
                        help="which variants (default: scores)")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8],
                        help="comma-separated forward sizes in rows (default: 1,2,4,8)")
    parser.add_argument("--contexts", type=positive_ints, default=[136],
                        help="comma-separated cached tokens (default: 136)")
    parser.add_argument("--out", type=pathlib.Path, help="also write the tables (markdown) here")
    args = parser.parse_args(argv)
    rows_list, contexts = args.rows, args.contexts
    from kernels.model import DEFAULT_MAX_TREE_NODES

    positions = preset(args.preset).max_position_embeddings
    if max(rows_list) > DEFAULT_MAX_TREE_NODES:
        parser.error(f"--rows must be at most the engine's {DEFAULT_MAX_TREE_NODES} rows, "
                     f"got {max(rows_list)}")
    if max(contexts) + max(rows_list) > positions:
        parser.error(f"--contexts plus the rows must fit {args.preset}'s {positions} positions, got "
                     f"{max(contexts)} + {max(rows_list)}")
    if SIMULATOR:
        parser.error("the variants bench needs a GPU (NUMBA_ENABLE_CUDASIM=0): the simulator has no graphs")
    from kernels.bench.environment import versions

    command = "python -m kernels.bench variants " + shlex.join(argv if argv is not None else sys.argv[1:])
    sections = run(args.preset, args.set_name, rows_list, contexts)
    if args.out:
        lines = [f"# Launch-shape variants of one {args.preset} forward ({args.set_name})", "",
                 f"Command: `{command}`", "", *[f"- {key}: {value}" for key, value in versions()],
                 "", "Graph replays, median device µs of " + str(ROUNDS) + " each (the difference from the "
                 "engine's shapes in brackets); every variant's logits equal the engine's, bit for bit.",
                 *["\n" + section for section in sections]]
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
