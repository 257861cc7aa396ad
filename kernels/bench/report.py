"""The benchmark's markdown report: where it ran, the ceilings, one table row per case."""

from __future__ import annotations

import math

from kernels.bench.harness import READ_BATCH, Report, Result


def _number(value: float) -> str:
    """Three significant digits (all digits from 100 on), never an exponent: a record's figures
    are read back by ``hardware``, the simulator's too."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1 or value <= 0:
        return f"{value:.2f}"
    return f"{value:.{2 - math.floor(math.log10(value))}f}"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


def floor_seconds(case, report: Report) -> float:
    """max(bytes / read bandwidth, FLOPs / fp32 rate), both measured in the run (the fp32 rate
    may be recorded)."""
    return max(case.bytes / report.read_bandwidth, case.flops / report.fp32)


def table_row(result: Result, report: Report) -> list[str]:
    case = result.case
    seconds = result.best_seconds                                               # device time if any
    rate = case.bytes / seconds                                                 # bytes per second
    compute_bound = case.flops / case.bytes > report.fp32 / report.read_bandwidth
    notes = [case.what] + ([case.note] if case.note else [])
    if compute_bound:
        notes.append(f"compute-bound: {100 * case.flops / seconds / report.fp32:.1f}% of fp32 rate")
    if result.peer_seconds is not None:
        notes.append(f"{result.peer_seconds / seconds:.3g}x torch's speed")
    if result.baseline_seconds is not None:
        notes.append(f"CPU {case.baseline_name}: {_number(result.baseline_seconds * 1e6)} us "
                     f"= {result.baseline_seconds / seconds:.3g}x the GPU time")
    launches = "?" if result.launches is None else result.launches
    given = "" if result.device is None else f" ({result.device.launches} with outputs given)"
    replays = "" if result.device is None else f", {result.device.replays} graph replays"
    notes.append(f"launches {launches}{given}, n={result.repeats}{replays}"
                 + (f", {result.sets} input sets" if result.sets > 1 else ""))
    if result.device_error:
        notes.append(f"no device time: {result.device_error}")
    if result.peer_error:
        notes.append(f"no torch time: {result.peer_error}")
    return [case.name, case.shape, _number(result.device.seconds * 1e6) if result.device else "-",
            _number(result.seconds * 1e6), _number(result.host_seconds * 1e6), _number(rate / 1e9),
            "-" if compute_bound else _number(100 * rate / report.read_bandwidth),
            _number(case.flops / seconds / 1e9) if case.flops else "-",
            _number(100 * floor_seconds(case, report) / seconds),
            "-" if result.peer_seconds is None else _number(result.peer_seconds * 1e6), "; ".join(notes)]


TABLE_HEADER = ["case", "shape", "device µs", "call µs", "host µs", "GB/s", "% of read BW", "GFLOP/s",
                "% of floor", "torch µs", "note"]


def simulator_warning() -> str:
    return ("**CUDA SIMULATOR: every time below is Python wall-clock of simulated threads and "
            "means NOTHING about GPU performance.**")


def format_report(report: Report, command: str) -> str:
    """The whole report as markdown: header, ceilings, the table, how to read it."""
    lines = ["## Benchmarks: `python -m kernels.bench`", ""]      # a section of a docs page
    slowest, fastest = report.read_spread
    if report.simulator:
        lines += [simulator_warning(), ""]
    lines += [f"- {key}: {value}" for key, value in report.header]
    lines += [f"- command: `{command}`", f"- shapes: {'--quick (tiny)' if report.quick else 'Kimi K2.6'}",
              "", "### Ceilings (measured in this run)", "",
              f"- read bandwidth (`read_kernel` over {_size(report.read_bytes)} of float32, {READ_BATCH} "
              f"passes back to back per batch): {_number(report.read_bandwidth / 1e9)} GB/s, the median "
              f"of {len(report.read_seconds)} batches (slowest {_number(slowest / 1e9)}, fastest "
              f"{_number(fastest / 1e9)} GB/s); bytes read counted, "
              f"{_number(report.read_bytes / report.read_bandwidth * 1e6)} µs per pass",
              f"- empty kernel launch: {_number(report.launch_seconds * 1e6)} µs between events (median "
              f"of {report.launch_repeats}); "
              f"{_number(report.host_launch_seconds * 1e6)} µs of host time per launch back to back; "
              f"{_number(report.graph_launch_seconds * 1e6)} µs of device time per launch replayed "
              f"from a CUDA graph",
              f"- fp32 peak used for compute-bound cases: {report.fp32 / 1e12:.0f} TFLOP/s "
              f"({report.fp32_source}); ridge {report.fp32 / report.read_bandwidth:.1f} FLOP/B",
              "", "### Cases", ""]
    rows = [TABLE_HEADER, ["---"] * len(TABLE_HEADER)] + [table_row(r, report) for r in report.results]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    lines += ["", "device µs: the case's kernels alone, outputs given, replayed from a CUDA graph "
              "(median per call). call µs: one call of the public function with device arrays "
              "(output allocation, NaN poison fill and small host->device copies included) between "
              "CUDA events, host µs: that call's own host time; medians of n calls after a warm-up "
              "(device µs: of the graph replays the note gives). GB/s, GFLOP/s and % of floor use the "
              "device time: floor = max(fewest bytes / read bandwidth, FLOPs / fp32 rate). torch µs: "
              "the same work in PyTorch fp32 on the same inputs, from a CUDA graph. See the docstring "
              "of kernels/bench/harness.py for the method."]
    if report.simulator:
        lines += ["", simulator_warning()]
    return "\n".join(lines) + "\n"
