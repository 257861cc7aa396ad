"""Smoke test of ``kernels.bench``: every case runs at --quick sizes (one repeat) and is reported.

In the simulator the times are meaningless; the test only checks that the harness works: every
case ran, produced a positive time, a byte count and launched kernels, and the markdown table has
one row per case. On a GPU the same test also exercises the event timing and the device fill.
The byte and FLOP formulas are checked at Kimi K2.6 sizes without running anything.
"""

from __future__ import annotations

import pytest

from kernels import bench, device

CASE_NAMES = [
    "rmsnorm", "rope_q_pe", "linear_gemv_mlp_up", "linear_gemv_lm_head", "linear_gemm", "argmax",
    "attention_decode_short", "attention_decode_long", "attention_verify",
    "absorb_query_decode", "absorb_output_decode", "absorb_query_verify", "absorb_output_verify",
    "moe_route", "moe_reduced", "tree_build_small", "tree_build_medium", "tree_build_large",
    "accept_batch", "kv_compact",
]


def table_rows(markdown: str) -> list[list[str]]:
    """The data rows of the report's cases table, as lists of cells (header and rule dropped)."""
    rows = [line.strip("|").split(" | ") for line in markdown.splitlines() if line.startswith("| ")]
    assert rows[0][0].strip() == "case" and rows[1][0].strip() == "---", rows[:2]
    return [[cell.strip() for cell in row] for row in rows[2:]]


@pytest.fixture(scope="module")
def quick_report():
    sizes = bench.quick_sizes()
    progress = []
    report = bench.benchmark(sizes, bench.make_cases(sizes), quick=True, log=progress.append)
    return report, progress


def test_every_case_ran(quick_report):
    report, progress = quick_report
    assert [r.case.name for r in report.results] == CASE_NAMES
    for result in report.results:
        assert result.seconds > 0, result.case.name
        assert isinstance(result.case.bytes, int) and result.case.bytes > 0, result.case.name
        assert result.case.flops >= 0, result.case.name
        assert result.repeats == 1, result.case.name                      # --quick: one repeat
        assert result.launches is not None and result.launches >= 1, result.case.name
        assert (result.baseline_seconds is not None) == result.case.name.startswith("tree_build")
        if result.baseline_seconds is not None:
            assert result.baseline_seconds > 0, result.case.name
    assert report.copy_seconds > 0 and report.launch_seconds > 0 and report.host_launch_seconds > 0
    assert len(progress) == 2 + len(CASE_NAMES)                           # two ceilings, then the cases


def test_table_has_one_row_per_case(quick_report):
    report, _ = quick_report
    markdown = bench.format_report(report, "python -m kernels.bench --quick")
    rows = table_rows(markdown)
    assert [row[0] for row in rows] == CASE_NAMES
    assert all(len(row) == len(bench.TABLE_HEADER) for row in rows)
    assert all(float(row[2]) > 0 for row in rows)                          # median µs
    assert ("SIMULATOR" in markdown) == device.SIMULATOR


def test_case_names_do_not_depend_on_sizes():
    assert [case.name for case in bench.make_cases(bench.full_sizes())] == CASE_NAMES


def test_bytes_and_flops_at_kimi_sizes():
    # hand-counted: float32 = 4 B, int64 = 8 B, inputs read once, outputs written once
    cases = {case.name: case for case in bench.make_cases(bench.full_sizes())}
    assert cases["rmsnorm"].bytes == 4 * (2 * 64 * 7168 + 7168)
    assert cases["linear_gemv_lm_head"].bytes == 4 * (7168 + 163840 * 7168 + 163840)   # 4.7 GB
    assert cases["linear_gemv_mlp_up"].bytes == 4 * (7168 + 18432 * 7168 + 18432)      # 528 MB
    assert cases["linear_gemm"].flops == 2 * 64 * 7168 * 2048
    assert cases["argmax"].bytes == 4 * 8 * 163840 + 8 * 8
    # one decode row sees its 4096 prefix keys and itself; 64 heads, score over 576, value over 512
    assert cases["attention_decode_short"].flops == 2 * 64 * (512 + 576) * 4097
    assert cases["attention_decode_short"].bytes == 4 * (4097 * 576 + 64 * 576 + 64 * 512) + 1
    assert cases["moe_route"].flops == 2 * 16 * 384 * 7168
    # the compaction moves some rows (its accepted path is not already in place), 61 layers x 576
    row_bytes = 2 * 4 * 61 * 576
    assert cases["kv_compact"].bytes % row_bytes == 8 * 8 and cases["kv_compact"].bytes > row_bytes


def test_main_writes_the_report(tmp_path, capsys):
    out = tmp_path / "bench.md"
    assert bench.main(["--quick", "--cases", "rmsnorm,absorb_query_*", "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert [row[0] for row in table_rows(text)] == ["rmsnorm", "absorb_query_decode", "absorb_query_verify"]
    for key in ("- date (UTC): ", "- GPU: ", "- versions: numba ",
                "- command: `python -m kernels.bench --quick --cases 'rmsnorm,absorb_query_*' --out "):
        assert key in text, key
    assert text in capsys.readouterr().out                                 # printed as well


def test_unknown_case_is_refused(capsys):
    assert bench.main(["--quick", "--cases", "rmsnorm,no_such_case"]) == 2
    assert "no_such_case" in capsys.readouterr().err


@pytest.mark.skipif(not device.SIMULATOR, reason="the refusal applies to the CUDA simulator only")
def test_out_is_refused_in_the_simulator_without_quick(tmp_path):
    out = tmp_path / "bench.md"
    with pytest.raises(SystemExit):
        bench.main(["--out", str(out)])
    assert not out.exists()
