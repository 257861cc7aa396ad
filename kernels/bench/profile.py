"""``python -m kernels.bench profile``: each kernel's device time inside one engine forward.

The engine's graphs replay a forward as one unit, so the round split (``kernels.bench.engine``)
says how long verify takes, not which kernels make it long. This profile runs the same launch
sequences with graphs off and brackets every launch with a pair of CUDA events on the engine's
stream: the host is far slower than the device here, so each pair times one kernel alone. It
reports, per forward of T rows (the AR step's 1 row and the tree buckets), every kernel's median
device time summed over the layers, next to the graph replay of the same forward: the difference
is what the launches themselves cost inside a graph.

One catch: launched from Python, a kernel reaches the device tens of microseconds after the event
before it, and the idle gap would count as the kernel's time. So a ``hold_kernel`` first keeps the
stream busy (it sleeps) while the host queues the whole forward behind it: every kernel then
starts the moment the one before it ends, and each event pair brackets device work only.

The launch hook is ``kernels.bench.harness.patched_launches`` (a private numba entry point,
restored afterwards). GPU only: the simulator has no events. ``--out`` writes the sections as a
record, under a header that says where, when and with what they ran.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import pathlib
import shlex
import statistics
import sys

import numpy as np
from numba import cuda

from ddtree.config import preset
from kernels.bench.harness import patched_launches
from kernels.device import SIMULATOR

DEFAULT_ROWS = (1, 8, 16, 40, 72)
REPEATS = 7
HOLD_NANOSECONDS = 200_000_000   # longer than the host needs to queue a forward's launches


@cuda.jit
def hold_kernel(nanoseconds):
    # one thread: sleeps in 1 µs naps, so the launches queued behind it start back to back
    for _ in range(nanoseconds // 1000):
        cuda.nanosleep(1000)


def kernel_label(launch) -> str:
    """``rows_kernel grid (512, 5, 1) x 128``: the kernel (its factory's name for closures) and shape."""
    function = getattr(launch.dispatcher, "py_func", None)
    name = getattr(function, "__qualname__", "?").replace(".<locals>.kernel", "")
    grid, block = tuple(launch.griddim), tuple(launch.blockdim)
    return f"{name} grid {grid} x {block[0]}"


@contextlib.contextmanager
def timed_launches(stream, marks: list):
    """Brackets every kernel launch in the block with CUDA events recorded on ``stream``;
    appends (kernel label, start event, end event) to ``marks``."""
    from cuda.core import EventOptions

    device = stream.device
    options = EventOptions(timing_enabled=True)

    def wrap(original):
        def timed(self, *args):
            start, end = device.create_event(options=options), device.create_event(options=options)
            stream.record(start)
            result = original(self, *args)
            stream.record(end)
            marks.append((kernel_label(self), start, end))
            return result
        return timed

    with patched_launches(wrap) as patched:
        if not patched:
            raise RuntimeError("numba's launch entry point moved: the profile cannot time launches")
        yield marks


def kernel_times(model, rows: int) -> tuple[dict[str, float], dict[str, int]]:
    """Median device microseconds of each kernel (summed over its launches) in a forward of ``rows``."""
    stream, samples, counts = model.graphs.stream, collections.defaultdict(list), {}
    for _ in range(REPEATS):
        marks = []
        hold_kernel[1, 1, stream](HOLD_NANOSECONDS)
        with timed_launches(stream, marks):
            model.forward_rows(stream, rows)
        marks[-1][2].sync()
        totals = collections.Counter()
        launches = collections.Counter()
        for name, start, end in marks:
            totals[name] += (end - start) * 1e3                       # ms -> µs
            launches[name] += 1
        for name, value in totals.items():
            samples[name].append(value)
        counts = dict(launches)
    return {name: statistics.median(values) for name, values in samples.items()}, counts


def replay_time(model, rows: int) -> float:
    """Median device microseconds of one graph replay of the forward over ``rows``."""
    from cuda.core import EventOptions

    graphs, stream = model.graphs, model.graphs.stream
    key = ("profile", rows)
    graphs.enabled = True
    try:
        graphs.run(key, lambda s: model.forward_rows(s, rows))          # capture
        options = EventOptions(timing_enabled=True)
        start, end = (stream.device.create_event(options=options) for _ in range(2))
        times = []
        for _ in range(REPEATS):
            stream.record(start)
            graphs.run(key, None)
            stream.record(end)
            end.sync()
            times.append((end - start) * 1e3)
        return statistics.median(times)
    finally:
        graphs.enabled = False


def prepare(model, name: str, context: int, nodes: int) -> None:
    """``context`` tokens in the cache and a random tree of ``nodes`` nodes in the tree buffers (a
    real round: the profile's forwards then read a valid tree; parents precede children, so any
    prefix of the rows is a tree too). The host presets prefill random tokens; the others' caches
    are filled with random latents (``kernels.bench.case.fill_context``): attention reads them
    the same way, and a real prefill of 16k tokens on ``small`` would only cost minutes."""
    from kernels import decode as engine_decode
    from kernels.bench.case import fill_context
    from kernels.bench.engine import HOST_PRESETS, RandomDrafter

    if name in HOST_PRESETS:
        prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, context + 1)
        model.prefill(model.new_cache(), prompt[:-1], emit_token=False)
    else:
        fill_context(model, context)
        prompt = np.zeros(context + 1, np.int64)
    block = 8
    engine_decode.ddtree_round(model, model.cache, prompt, RandomDrafter(model.config.vocab_size),
                               block, nodes - 1, None)


def kernel_table(table: dict, rows_list) -> list[str]:
    """The profile's table rows from ``table`` = {T: (µs by launch label, launches by label)}: one
    row per kernel (labels' grids dropped, launches summed) of any T (a forward's kernels change
    with T: one decode row's projections are not a verify's), the costliest at the largest T first,
    its launches the most of any T, then the sum of every kernel per T."""
    def by_kernel(per_label):
        merged = collections.Counter()
        for label, value in per_label.items():
            merged[label.split(" grid")[0]] += value
        return merged

    times = {rows: by_kernel(table[rows][0]) for rows in rows_list}
    launches = collections.Counter()
    for rows in rows_list:
        for kernel, count in by_kernel(table[rows][1]).items():
            launches[kernel] = max(launches[kernel], count)
    names = sorted(launches, key=lambda n: tuple(-times[r].get(n, 0.0) for r in reversed(rows_list)))
    lines = ["| kernel | launches | " + " | ".join(f"T={r}" for r in rows_list) + " |",
             "|---|---|" + "---|" * len(rows_list)]
    for kernel in names:
        cells = [f"{times[r].get(kernel, 0.0):.1f}" for r in rows_list]
        lines.append(f"| {kernel} | {launches[kernel]} | " + " | ".join(cells) + " |")
    sums = [sum(table[r][0].values()) for r in rows_list]
    lines.append("| **sum of kernels** | | " + " | ".join(f"{s:.1f}" for s in sums) + " |")
    return lines


ENGINE_OPTIONS = ()


def profile(name: str, rows_list, context: int, **options) -> str:
    """The kernel table of ``name``'s forwards over ``rows_list``; ``options``: the engine's
    keywords of ENGINE_OPTIONS (None: the engine's choice)."""
    from kernels.bench.engine import preset_weights
    from kernels.model import Transformer

    chosen = {key: value for key, value in options.items() if value is not None}
    model = Transformer(preset(name), preset_weights(name), graphs=False, **chosen)
    prepare(model, name, context, max(rows_list))
    settings = ", ".join(f"{key} {getattr(model, key)}" for key in ("attention_plan", *ENGINE_OPTIONS))
    lines = [f"## {name}: device µs per kernel in one forward after {context} cached tokens (graphs "
             f"off, events around each launch; median of {REPEATS}; {settings})", ""]
    table = {}
    for rows in rows_list:
        kernel_times(model, rows)                                       # compile and warm
        table[rows] = kernel_times(model, rows)
    lines += kernel_table(table, rows_list)
    replays = [replay_time(model, r) for r in rows_list]
    lines.append("| **graph replay** | | " + " | ".join(f"{s:.1f}" for s in replays) + " |")
    for rows in (rows_list[0], rows_list[-1]):
        times, counts = table[rows]
        lines += ["", f"T={rows}, by launch shape (µs summed over the layers, launches):", ""]
        for label in sorted(times, key=lambda n: -times[n])[:16]:
            lines.append(f"    {times[label]:8.1f}  {counts[label]:3d}  {label}")
    return "\n".join(lines)


def format_record(sections: list[str], header: list, command: str) -> str:
    """The profile record: its title, the command, the environment header, then each preset's
    section (``profile``'s text) as it was printed."""
    lines = ["# Each kernel inside one engine forward", "", f"Command: `{command}`", ""]
    lines += [f"- {key}: {value}" for key, value in header]
    for text in sections:
        lines += ["", text]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny", help="comma-separated presets (default: tiny)")
    parser.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)),
                        help="comma-separated forward sizes in rows (buckets)")
    parser.add_argument("--context", type=int, default=136, help="cached tokens before the forward "
                        "(default 136: the middle of the engine benchmark's 8 + 256)")
    parser.add_argument("--out", type=pathlib.Path, help="also write the record (markdown) here")
    args = parser.parse_args(argv)
    if SIMULATOR:
        parser.error("the profile needs a GPU (NUMBA_ENABLE_CUDASIM=0): the simulator has no events")
    from kernels.bench.environment import versions

    rows_list = [int(r) for r in args.rows.split(",")]
    command = "python -m kernels.bench profile " + shlex.join(argv if argv is not None else sys.argv[1:])
    header, sections = versions(), []
    for name in args.presets.split(","):
        options = {key: getattr(args, key) for key in ENGINE_OPTIONS}
        sections.append(profile(name, rows_list, args.context, **options))
        print(sections[-1], flush=True)
        if args.out:                                    # rewritten after every preset
            args.out.write_text(format_record(sections, header, command), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
