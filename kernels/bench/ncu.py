"""Nsight Compute's kernel table of one forward, summed by kernel and launch shape:
``python -m kernels.bench ncu FILE.csv``; the program to profile: ``python -m kernels.bench ncu
forward --preset NAME --rows 1,4``.

``forward`` builds the preset's engine with graphs off, fills its cache and tree as the profile
record does (``kernels.bench.profile.prepare``), runs each forward twice (compiled, warm), then once
more each between ``cuda.profile_start()`` and ``cuda.profile_stop()``: run under ``ncu
--profile-from-start off``, only those forwards are profiled. FILE.csv is what ``ncu --csv --page
details --section SpeedOfLight --section LaunchStats ...`` printed (the lines before its header,
ncu's own messages, are skipped). Each kernel launch is one ID with one row per metric; this module
keeps a launch's duration, registers per thread and DRAM throughput, and adds the launches of each
(kernel, grid, block) up, the largest total first.

Kernel names: numba mangles a kernel as ``module::function[...]``, a closure built by a factory as
``factory::kernel[...]``; a name ending in ``::kernel`` is shown as its factory's (or module's)
name, any other as its function's.

What a kernel waits on: ``ncu ... --section WarpStateStats --csv --page raw -k regex:NAME ...`` (a few
kernels: each section adds replays of every kernel it profiles) gives one row per launch with a column per
stall reason, ``smsp__average_warps_issue_stalled_REASON_per_issue_active.ratio``: the warps waiting for that
reason per issued instruction, which add up to the cycles an instruction takes. Given that file, the same
command prints, per (kernel, grid, block), the cycles per issued instruction and the reasons that take most.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import re
import sys

NANOSECONDS = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
TOP_STALLS = 4                  # the reasons a stall table names per kernel


@dataclasses.dataclass
class Launch:
    kernel: str
    grid: str
    block: str
    nanoseconds: float = 0.0
    registers: str = "?"
    dram_percent: str = "?"


def kernel_name(mangled: str) -> str:
    """``mla::attention_stats_kernel[...]`` -> ``attention_stats_kernel``; ``rmsnorm::kernel[...]``
    -> ``rmsnorm``."""
    parts = re.sub(r"\[.*", "", mangled).split("::")
    return parts[-2] if parts[-1] == "kernel" and len(parts) > 1 else parts[-1]


def launches(lines) -> list[Launch]:
    """One Launch per ncu ID, in launch order."""
    rows = csv.reader(line for line in lines if line.startswith('"'))
    header = next(rows, None)
    if header is None:
        raise ValueError("no CSV header: is this ncu's --csv --page details output?")
    column = {name: i for i, name in enumerate(header)}
    missing = {"ID", "Kernel Name", "Grid Size", "Block Size", "Metric Name", "Metric Value"} - set(column)
    if missing:
        raise ValueError(f"ncu's CSV lacks the columns {sorted(missing)}")
    found: dict[str, Launch] = {}
    for row in rows:
        launch_id = row[column["ID"]]
        if launch_id not in found:
            found[launch_id] = Launch(kernel_name(row[column["Kernel Name"]]), row[column["Grid Size"]],
                                      row[column["Block Size"]])
        launch = found[launch_id]
        metric, value = row[column["Metric Name"]], row[column["Metric Value"]]
        if metric == "Duration":
            unit = row[column["Metric Unit"]] if "Metric Unit" in column else "ns"
            if unit not in NANOSECONDS:
                raise ValueError(f"Duration in {unit!r}, expected one of {sorted(NANOSECONDS)}")
            launch.nanoseconds = float(value.replace(",", "")) * NANOSECONDS[unit]
        elif metric == "Registers Per Thread":
            launch.registers = value
        elif metric == "DRAM Throughput":
            launch.dram_percent = value
    return list(found.values())


def table(found: list[Launch]) -> list[str]:
    """The summary: a total line, then µs summed, launches, µs per launch, registers, DRAM %,
    kernel and shape, one line per (kernel, grid, block), the largest total first."""
    groups: dict[tuple, list[Launch]] = {}
    for launch in found:
        groups.setdefault((launch.kernel, launch.grid, launch.block), []).append(launch)
    total = sum(launch.nanoseconds for launch in found) / 1e3
    lines = [f"total {total:.1f} µs of kernel duration, {len(found)} launches"]
    for (kernel, grid, block), members in sorted(groups.items(),
                                                 key=lambda item: -sum(m.nanoseconds for m in item[1])):
        summed = sum(m.nanoseconds for m in members) / 1e3
        first = members[0]
        lines.append(f"{summed:8.1f} {len(members):3d} {summed / len(members):7.2f}  "
                     f"reg {first.registers:>4} dram% {first.dram_percent:>6}  {kernel} {grid}x{block}")
    return lines


def stall_launches(lines) -> list[tuple[Launch, dict[str, float]]]:
    """ncu's raw page (``--page raw --csv``, a header, a row of units, a row per launch): each launch
    with its duration and its stall reasons (warps per issued instruction by reason)."""
    rows = csv.reader(line for line in lines if line.startswith('"'))
    header = next(rows, None)
    if header is None:
        raise ValueError("no CSV header: is this ncu's --csv --page raw output?")
    column = {name: i for i, name in enumerate(header)}
    stalls = {STALL.fullmatch(name).group(1): i for name, i in column.items() if STALL.fullmatch(name)}
    if not stalls:
        raise ValueError("no stall columns (smsp__average_warps_issue_stalled_*_per_issue_active.ratio): "
                         "profile with --section WarpStateStats --page raw")
    missing = {"ID", "Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum"} - set(column)
    if missing:
        raise ValueError(f"ncu's raw CSV lacks the columns {sorted(missing)}")
    found = []
    units = {}
    for row in rows:
        if not row[column["ID"]]:                                    # the units' row
            units = dict(zip(header, row, strict=False))
            continue
        unit = units.get("gpu__time_duration.sum") or "ns"
        if unit not in NANOSECONDS:
            raise ValueError(f"gpu__time_duration.sum in {unit!r}, expected one of {sorted(NANOSECONDS)}")
        launch = Launch(kernel_name(row[column["Kernel Name"]]), row[column["Grid Size"]],
                        row[column["Block Size"]],
                        float(row[column["gpu__time_duration.sum"]].replace(",", "")) * NANOSECONDS[unit])
        found.append((launch, {reason: float(row[i].replace(",", "") or 0) for reason, i in stalls.items()}))
    return found


def stall_table(found: list[tuple[Launch, dict[str, float]]], top: int = TOP_STALLS) -> list[str]:
    """Per (kernel, grid, block), the largest total first: µs summed, launches, the cycles an issued
    instruction takes (the reasons' sum, averaged over the launches) and the ``top`` reasons' shares."""
    groups: dict[tuple, list] = {}
    for launch, stalls in found:
        groups.setdefault((launch.kernel, launch.grid, launch.block), []).append((launch, stalls))
    lines = ["µs summed, launches, cycles per issued instruction, the reasons that take most of them"]
    for (kernel, grid, block), members in sorted(groups.items(),
                                                 key=lambda item: -sum(m[0].nanoseconds for m in item[1])):
        summed = sum(launch.nanoseconds for launch, _ in members) / 1e3
        mean = {reason: sum(stalls[reason] for _, stalls in members) / len(members)
                for reason in members[0][1]}
        cycles = sum(mean.values())
        named = sorted(mean.items(), key=lambda item: -item[1])[:top]
        reasons = ", ".join(f"{reason} {value:.1f}" for reason, value in named)
        lines.append(f"{summed:8.1f} {len(members):3d} {cycles:6.1f}  {kernel} {grid}x{block}: {reasons}")
    return lines


def profiled_forwards(name: str, rows_list: list[int], context: int) -> None:
    """One forward of each of ``rows_list`` rows on ``name``'s engine (graphs off) inside the
    profiler's range, after two of each outside it. The simulator has no profiler: there the
    forwards run without a range."""
    from numba import cuda

    from ddtree.config import preset
    from kernels.bench.engine import preset_weights
    from kernels.bench.profile import prepare
    from kernels.model import Transformer

    model = Transformer(preset(name), preset_weights(name), graphs=False)
    prepare(model, name, context, max(rows_list))
    stream = model.graphs.stream
    for rows in rows_list:                            # compile, then a warm forward
        model.forward_rows(stream, rows)
        model.forward_rows(stream, rows)
    cuda.synchronize()
    getattr(cuda, "profile_start", lambda: None)()
    for rows in rows_list:
        model.forward_rows(stream, rows)
        cuda.synchronize()
    getattr(cuda, "profile_stop", lambda: None)()


def positive_ints(text: str) -> list[int]:
    """``--rows``: comma-separated integers >= 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def forward_main(argv) -> int:
    from kernels.bench.engine import PRESETS

    parser = argparse.ArgumentParser(prog="python -m kernels.bench ncu forward",
                                     description=profiled_forwards.__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=("micro", *PRESETS),
                        help="a preset with weights (default: small)")
    parser.add_argument("--rows", type=positive_ints, default=[1], help="comma-separated forward sizes "
                        "in rows, each profiled once (default: 1)")
    parser.add_argument("--context", type=int, default=136, help="cached tokens before the forwards "
                        "(default 136, as the profile record)")
    args = parser.parse_args(argv)
    if args.context < 0:
        parser.error(f"--context must be >= 0, got {args.context}")
    profiled_forwards(args.preset, args.rows, args.context)
    print(f"profiled: {args.preset}, forwards of {args.rows} rows after {args.context} cached tokens",
          file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["forward"]:
        return forward_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m kernels.bench ncu", description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --csv output: --page details (the kernel table) or --page raw "
                        "with --section WarpStateStats (the stall reasons)")
    args = parser.parse_args(argv)
    with open(args.csv, encoding="utf-8") as file:
        lines = file.read().splitlines()
    raw = any(STALL.search(line) for line in lines if line.startswith('"ID"'))
    print("\n".join(stall_table(stall_launches(lines)) if raw else table(launches(lines))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
