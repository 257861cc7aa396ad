"""The H200's figures, read from the committed benchmark record (never retyped).

Every number here comes from ``RESULTS`` (docs/results/bench.md), the report
``python -m kernels.bench`` wrote on the project's H200 (its date, GPU and command are inside); a
new run replaces the file, and the figures follow. ``figures()`` gives each one with where it comes from:

- ``copy_bandwidth()``: bytes/s of a 1 GiB device-to-device copy, read + write counted: the
  memory-bound ceiling measured in that run (below the 4.8 TB/s on the datasheet);
- ``launch_seconds()``: an empty kernel launch between two CUDA events, and
  ``host_launch_seconds()``: host time per launch, back to back, from Python;
- ``fp32_flops()``: the fp32 rate the report used for compute-bound cases: torch SGEMM with TF32
  off on the same H200, as the record states it.

The record lives in the source tree (docs/), so these work from a checkout, not an installed wheel.
"""

from __future__ import annotations

import functools
import re
import typing
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "bench.md"

_UNITS = {"GB/s": 1e9, "µs": 1e-6, "TFLOP/s": 1e12}
_PATTERNS = {   # figure -> (a regular expression: groups number, unit and a note if any; what it is)
    "copy_bandwidth": (r"- device-to-device copy of [^:]+: ([\d.]+) (GB/s)",
                       "device-to-device copy, read + write counted (bytes/s)"),
    "launch_seconds": (r"- empty kernel launch: ([\d.]+) (µs) between events",
                       "empty kernel launch between two CUDA events (s)"),
    "host_launch_seconds": (r"; ([\d.]+) (µs) of host time per launch back to back",
                            "host time per launch from Python, back to back (s)"),
    "fp32_flops": (r"- fp32 peak used for compute-bound cases: ([\d.]+) (TFLOP/s) "
                   r"\((?:not )?measured here: ([^)]*)\)",
                   "fp32 rate for compute-bound cases (FLOP/s)"),
}


class Figure(typing.NamedTuple):
    """One hardware figure in SI units, and where it comes from."""
    value: float
    source: str         # the record's file and line
    note: str = ""      # how the record says it was obtained, when it says so


@functools.cache
def figures() -> dict[str, Figure]:
    """Every figure of the record, by name (see the module docstring)."""
    if not RESULTS.exists():
        raise FileNotFoundError(f"the H200 benchmark record {RESULTS} is missing: the hardware figures "
                                "are read from it (run from a source checkout)")
    text = RESULTS.read_text(encoding="utf-8")
    found = {}
    for name, (pattern, what) in _PATTERNS.items():
        match = re.search(pattern, text)
        if match is None:
            raise ValueError(f"{RESULTS.name} has no line matching {pattern!r} ({name})")
        line = text[text.rfind("\n", 0, match.start()) + 1:text.find("\n", match.end())]
        found[name] = Figure(float(match.group(1)) * _UNITS[match.group(2)],
                             f"{what}: {RESULTS.relative_to(RESULTS.parents[2])}, line {line.strip()!r}",
                             match.group(3) if match.lastindex == 3 else "")
    return found


def copy_bandwidth() -> float:
    """Bytes per second of the H200's device-to-device copy (read + write counted), as recorded."""
    return figures()["copy_bandwidth"].value


def launch_seconds() -> float:
    """Seconds of an empty numba kernel launch between two CUDA events on the H200, as recorded."""
    return figures()["launch_seconds"].value


def host_launch_seconds() -> float:
    """Host seconds per numba kernel launch from Python, back to back, on the H200, as recorded."""
    return figures()["host_launch_seconds"].value


def fp32_flops() -> float:
    """FLOP/s of fp32 on the H200 (torch SGEMM with TF32 off), as recorded."""
    return figures()["fp32_flops"].value

