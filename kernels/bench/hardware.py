"""The GPU's figures, read from the committed benchmark record (never retyped).

Every number here comes from ``RESULTS`` (docs/results/bench.md), the report
``python -m kernels.bench`` wrote on the project's GPU (its date, GPU and command are inside); a
new run replaces the file, and the figures follow, on whichever GPU it ran. ``gpu_name()`` says
which one, from the record's ``- GPU:`` line. ``figure(name)`` gives each figure with where it
comes from, ``figures()`` all of them:

- ``read_bandwidth()``: bytes/s a read-only kernel reads from a 1 GiB buffer: the ceiling of a
  kernel that streams its weights, measured in that run (below the datasheet's bandwidth);
- ``launch_seconds()``: an empty kernel launch between two CUDA events, and
  ``host_launch_seconds()``: host time per launch, back to back, from Python;
- ``fp32_flops()``: the fp32 rate the report used for compute-bound cases: torch SGEMM with TF32
  off on the same GPU, as the record states it.

Each figure is read from its own line, when asked for. The record lives in the source tree
(docs/), so these work from a checkout, not an installed wheel.
"""

from __future__ import annotations

import functools
import re
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "bench.md"

_UNITS = {"GB/s": 1e9, "µs": 1e-6, "TFLOP/s": 1e12}
_PATTERNS = {   # figure -> (a regular expression: groups number, unit and a note if any; what it is)
    "read_bandwidth": (r"- read bandwidth \(`read_kernel`[^:]+\): ([\d.]+) (GB/s)",
                       "read-only kernel over a large buffer, bytes read (bytes/s)"),
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


def _read(record: Path) -> str:
    """The record's text, or an error that says why it is needed."""
    if not record.exists():
        raise FileNotFoundError(f"the benchmark record {record} is missing: the hardware figures "
                                "are read from it (run from a source checkout)")
    return record.read_text(encoding="utf-8")


@functools.cache
def gpu_name(record: Path = RESULTS) -> str:
    """The GPU ``record`` was measured on, as its ``- GPU:`` line names it."""
    match = re.search(r"^- GPU: (.+)$", _read(record), re.M)
    if match is None:
        raise ValueError(f"{record.name} has no '- GPU: <name>' line")
    return match.group(1).strip()


@functools.cache
def figure(name: str, record: Path = RESULTS) -> Figure:
    """One figure of ``record`` by name (see the module docstring), from the line that states it."""
    if name not in _PATTERNS:
        raise ValueError(f"name must be one of {sorted(_PATTERNS)}, got {name!r}")
    text = _read(record)
    pattern, what = _PATTERNS[name]
    match = re.search(pattern, text)
    if match is None:
        raise ValueError(f"{record.name} has no line matching {pattern!r} ({name})")
    line = text[text.rfind("\n", 0, match.start()) + 1:text.find("\n", match.end())]
    return Figure(float(match.group(1)) * _UNITS[match.group(2)],
                  f"{what}: {record.relative_to(ROOT) if record.is_relative_to(ROOT) else record}, "
                  f"line {line.strip()!r}",
                  match.group(3) if match.lastindex == 3 else "")


def figures(record: Path = RESULTS) -> dict[str, Figure]:
    """Every figure of ``record``, by name."""
    return {name: figure(name, record) for name in _PATTERNS}


def read_bandwidth() -> float:
    """Bytes per second a read-only kernel reads on the recorded GPU."""
    return figure("read_bandwidth").value


def launch_seconds() -> float:
    """Seconds of an empty numba kernel launch between two CUDA events on the recorded GPU."""
    return figure("launch_seconds").value


def host_launch_seconds() -> float:
    """Host seconds per numba kernel launch from Python, back to back, on the recorded GPU."""
    return figure("host_launch_seconds").value


def fp32_flops() -> float:
    """FLOP/s of fp32 on the recorded GPU (torch SGEMM with TF32 off)."""
    return figure("fp32_flops").value
