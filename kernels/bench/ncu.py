"""Nsight Compute's kernel table of one forward, summed by kernel and launch shape:
``python -m kernels.bench ncu FILE.csv``.

FILE.csv is what ``ncu --csv --page details --section SpeedOfLight --section LaunchStats ...``
printed (the lines before its header, ncu's own messages, are skipped). Each kernel launch is one
ID with one row per metric; this module keeps a launch's duration, registers per thread and DRAM
throughput, and adds the launches of each (kernel, grid, block) up, the largest total first.

Kernel names: numba mangles a kernel as ``module::function[...]``, a closure built by a factory as
``factory::kernel[...]``; a name ending in ``::kernel`` is shown as its factory's (or module's)
name, any other as its function's.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import re
import sys

NANOSECONDS = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench ncu", description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --csv --page details output")
    args = parser.parse_args(argv)
    with open(args.csv, encoding="utf-8") as file:
        print("\n".join(table(launches(file))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
