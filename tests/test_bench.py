"""Smoke test of ``kernels.bench``: every case runs at --quick sizes (one repeat) and is reported.

In the simulator the times are meaningless; the test only checks that the harness works: every
case ran, produced a positive time, a byte count and launched kernels, and the markdown table has
one row per case. On a GPU the same test also exercises the event timing and the device fill.
The byte and FLOP formulas (the kernel modules' cost models) are checked at Kimi K2.6 sizes
without running anything, the read-bandwidth kernel on a small buffer, and ``hardware``'s parsing
against a record the report code writes here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ddtree.config import preset
from kernels import device
from kernels.bench import hardware, peers
from kernels.bench.case import KERNEL_MODULES, cases_module, full_sizes, make_cases, quick_sizes
from kernels.bench.cli import main
from kernels.bench.harness import READ_THREADS, benchmark, read_kernel
from kernels.bench.report import TABLE_HEADER, format_report

CASE_NAMES = [
    "rmsnorm", "rmsnorm_other_batch", "rmsnorm_large", "rmsnorm_large_other_batch",
    "rope_q_pe", "rope_q_pe_large", "rope_q_pe_v1", "rope_q_pe_large_v1", "linear_gemv_mlp_up",
    "linear_gemv_lm_head", "linear_lanes_lm_head", "linear_gemm", "linear_warps_mlp_up",
    "linear_lanes_mlp_up", "linear_warps_verify", "linear_lanes_verify", "linear_gemm_prefill",
    "linear_lanes_prefill", "argmax",
    "attention_decode_short", "attention_verify",
    "paths_v1_decode", "paths_v2_decode", "paths_v3_decode", "paths_v3_decode_long",
    "paths_v3_decode_rank_long", "paths_v3_tree_few",
    "paths_v2_tree_many", "paths_v3_tree_many", "paths_v3_tree_many_rank_long",
    "paths_v5_decode", "paths_v5_decode_long", "paths_v5_decode_rank_long", "paths_v5_tree_few",
    "paths_v5_tree_many", "paths_v5_tree_many_rank_long",
    "absorb_query_decode", "absorb_output_decode", "absorb_query_verify", "absorb_output_verify",
    "moe_route", "moe_reduced",
    "tree_build_small", "tree_build_medium", "tree_build_large", "tree_build_one", "tree_build_one_v2",
    "top_candidates_v2",
    "accept_batch", "kv_compact", "sample", "rejection_step",
]


def table_rows(markdown: str) -> list[list[str]]:
    """The data rows of the report's cases table, as lists of cells (header and rule dropped)."""
    rows = [line.strip("|").split(" | ") for line in markdown.splitlines() if line.startswith("| ")]
    assert rows[0][0].strip() == "case" and rows[1][0].strip() == "---", rows[:2]
    return [[cell.strip() for cell in row] for row in rows[2:]]


@pytest.fixture(scope="module")
def quick_report():
    sizes = quick_sizes()
    progress = []
    report = benchmark(sizes, make_cases(sizes), quick=True, log=progress.append)
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
    assert len(report.read_seconds) == 1 and report.read_seconds[0] > 0     # --quick: one batch
    assert report.launch_repeats == 1 and report.launch_seconds > 0 and report.host_launch_seconds > 0
    assert report.graph_launch_seconds > 0 and report.fp32 > 0
    assert len(progress) == 3 + len(CASE_NAMES)                           # three ceilings, then the cases


def test_every_case_has_a_device_time_that_allocates_and_copies_nothing(quick_report):
    """The outputs-given form of each case (what a graph captures) ran its kernels with nothing
    allocated or copied to the device: in the simulator it runs directly, on a GPU from a graph."""
    report, _ = quick_report
    for result in report.results:
        name = result.case.name
        assert result.device is not None, (name, result.device_error)
        assert result.device_error == "", (name, result.device_error)
        assert result.device.seconds > 0 and result.device.allocations == 0, name
        assert result.device.launches is not None and 1 <= result.device.launches <= result.launches, name


def test_table_has_one_row_per_case(quick_report):
    report, _ = quick_report
    markdown = format_report(report, "python -m kernels.bench --quick")
    rows = table_rows(markdown)
    assert [row[0] for row in rows] == CASE_NAMES
    assert all(len(row) == len(TABLE_HEADER) for row in rows)
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows)   # device µs, call µs
    assert ("SIMULATOR" in markdown) == device.SIMULATOR


def test_case_names_do_not_depend_on_sizes():
    assert [case.name for case in make_cases(full_sizes())] == CASE_NAMES


def test_bytes_and_flops_at_kimi_sizes():
    # hand-counted: float32 = 4 B, int64 = 8 B, inputs read once, outputs written once
    cases = {case.name: case for case in make_cases(full_sizes())}
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
    assert main(["--quick", "--cases", "rmsnorm,absorb_query_*", "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert [row[0] for row in table_rows(text)] == ["rmsnorm", "absorb_query_decode", "absorb_query_verify"]
    for key in ("- date (UTC): ", "- GPU: ", "- versions: numba ",
                "- command: `python -m kernels.bench --quick --cases 'rmsnorm,absorb_query_*' --out "):
        assert key in text, key
    assert text in capsys.readouterr().out                                 # printed as well


def test_unknown_case_is_refused(capsys):
    assert main(["--quick", "--cases", "rmsnorm,no_such_case"]) == 2
    assert "no_such_case" in capsys.readouterr().err


@pytest.mark.skipif(not device.SIMULATOR, reason="the refusal applies to the CUDA simulator only")
def test_out_is_refused_in_the_simulator_without_quick(tmp_path):
    out = tmp_path / "bench.md"
    with pytest.raises(SystemExit):
        main(["--out", str(out)])
    assert not out.exists()


def test_every_kernel_module_has_its_cost_model_and_cases():
    for name in KERNEL_MODULES:
        module = cases_module(name)
        for attribute in ("bytes_moved", "flops", "bench_cases"):
            assert callable(getattr(module, attribute, None)), f"{module.__name__}.{attribute}"


def test_read_kernel_sums_every_element_once_into_its_blocks_partial():
    """The read-bandwidth kernel reads each element once: block b's partial is the sum of the
    elements its threads own (element k belongs to thread k mod stride), over a buffer that is
    not a multiple of the grid's stride, so both the 4-load steps and the tail run; every block
    writes its partial (the output starts as NaN)."""
    import numpy as np
    from numba import cuda

    blocks, count = 3, 4 * 3 * READ_THREADS + 2 * READ_THREADS + 37    # 4-load steps, then a ragged tail
    values = np.random.default_rng(7).uniform(-1, 1, count).astype(np.float32)
    partials = cuda.to_device(np.full(blocks, np.nan, np.float32))
    read_kernel[blocks, READ_THREADS](cuda.to_device(values), partials)
    owner = np.arange(count) % (blocks * READ_THREADS) // READ_THREADS          # block of each element
    expected = [values[owner == b].astype(np.float64).sum() for b in range(blocks)]
    np.testing.assert_allclose(partials.copy_to_host(), expected, rtol=0, atol=1e-4)


def test_hardware_reads_the_figures_of_a_record_the_report_writes(quick_report, tmp_path):
    """``hardware`` parses the lines ``format_report`` writes (here a --quick record of this run):
    each figure is the report's own, to the digits written, with the record's line as its source."""
    report, _ = quick_report
    record = tmp_path / "bench.md"
    record.write_text(format_report(report, "python -m kernels.bench --quick"), encoding="utf-8")
    text = record.read_text(encoding="utf-8")
    figures = hardware.figures(record)
    assert set(figures) == {"read_bandwidth", "launch_seconds", "host_launch_seconds", "fp32_flops"}
    for name, figure in figures.items():
        assert figure.source.split("line ")[1].strip("'") in text, name        # a line of the record
    read_line = next(line for line in text.splitlines() if line.startswith("- read bandwidth"))
    assert "`read_kernel` over 4 KiB of float32, 8 passes back to back per batch" in read_line
    assert "the median of 1 batches" in read_line                                # the batches it ran
    expected = {"read_bandwidth": report.read_bandwidth, "launch_seconds": report.launch_seconds,
                "host_launch_seconds": report.host_launch_seconds}
    for name, value in expected.items():
        assert figures[name].value == pytest.approx(value, rel=1e-2), name      # three digits written
    assert figures["fp32_flops"].note                                           # how it was obtained
    assert hardware.gpu_name(record) == device.where()                          # the header's GPU line
    with pytest.raises(ValueError, match="name must be one of"):
        hardware.figure("copy_bandwidth", record)


def test_a_record_without_a_figure_names_the_missing_line(tmp_path):
    record = tmp_path / "bench.md"
    record.write_text("- empty kernel launch: 20.5 µs between events (median of 9)\n", encoding="utf-8")
    assert hardware.figure("launch_seconds", record).value == pytest.approx(20.5e-6)
    with pytest.raises(ValueError, match=r"bench.md has no line matching .*\(read_bandwidth\)"):
        hardware.figure("read_bandwidth", record)
    with pytest.raises(ValueError, match="bench.md has no '- GPU: <name>' line"):
        hardware.gpu_name(record)


def test_the_report_says_where_its_fp32_rate_comes_from(quick_report):
    """Measured with torch's SGEMM when torch runs here; otherwise the recorded rate, stated as the
    record states it."""
    report, _ = quick_report
    fp32_line = next(line for line in format_report(report, "x").splitlines() if "fp32 peak" in line)
    if peers.available():
        assert "(measured here: torch SGEMM" in fp32_line
        assert 1e13 < report.fp32 < 1e15
        return
    recorded = next(line for line in hardware.RESULTS.read_text(encoding="utf-8").splitlines()
                    if "fp32 peak" in line)
    # the record's run measured it, this one did not
    expected = recorded.split("; ridge")[0].replace("(measured here", "(not measured here")
    assert fp32_line.split("; ridge")[0] == expected


def test_digest_hashes_values_not_where_they_live():
    """``kernels.bench digest``'s fingerprint: the same numbers on the device or the host, in a
    tuple or a named tuple, give the same digest; one changed bit gives another; objects that are
    not numbers (their bytes would be addresses) add nothing."""
    import numpy as np
    from numba import cuda

    from kernels.bench.digest import digest
    from kernels.tree import TreeBatch

    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert digest(cuda.to_device(values)) == digest(values) == digest((values,))
    fields = len(TreeBatch._fields)
    assert digest(TreeBatch(*([values] * fields))) == digest((values,) * fields)
    flipped = values.copy()
    flipped.view(np.int32)[1, 2] ^= 1                           # one bit of one element
    assert digest(flipped) != digest(values)
    assert digest((values, object())) == digest(values)


@pytest.mark.skipif(not device.SIMULATOR, reason="the refusal applies to the simulator")
@pytest.mark.parametrize("command", ["profile", "shapes", "sweep", "variants"])
def test_device_timings_are_refused_in_the_simulator(command, capsys):
    with pytest.raises(SystemExit):
        main([command])
    assert "needs a GPU" in capsys.readouterr().err


def test_every_variant_sets_constants_that_exist_and_puts_them_back():
    """``kernels.bench.variants``: each variant names constants its modules have (a rename fails
    here, not on a GPU), sets them inside ``applied`` and restores them after, an error included;
    a missing name is refused before anything is set."""
    import importlib

    from kernels import mla_unfused
    from kernels.bench.variants import VARIANT_SETS, applied

    def current(changes):
        return {key: getattr(importlib.import_module(key[0]), key[1]) for key in changes}

    for variants in VARIANT_SETS.values():
        for changes in variants.values():
            before = current(changes)
            assert before != changes                    # each variant differs from the engine's shape
            with applied(changes):
                assert current(changes) == changes
            assert current(changes) == before
    keys = mla_unfused.ROW_KEYS
    with pytest.raises(RuntimeError), applied({("kernels.mla_unfused", "ROW_KEYS"): keys + 1}):
        raise RuntimeError
    assert mla_unfused.ROW_KEYS == keys
    with pytest.raises(ValueError, match="do not exist: kernels.mla_unfused.NO_SUCH"):
        with applied({("kernels.mla_unfused", "ROW_KEYS"): keys + 1, ("kernels.mla_unfused", "NO_SUCH"): 1}):
            pass
    assert mla_unfused.ROW_KEYS == keys


def test_a_variant_changes_what_the_launch_reads():
    """The constants are read at launch: under "to 8 rows" an 8-row forward of small's attention
    takes the row kernel, which the engine's shapes leave to the GEMM, and under "alone to 2 rows"
    a 3-row forward the GEMM."""
    from kernels.bench.variants import VARIANT_SETS, applied
    from kernels.mla_unfused import row_scores

    config = preset("small")
    dims = (config.kv_lora_rank, config.qk_rope_head_dim)
    assert not row_scores(8, *dims) and row_scores(3, *dims)
    with applied(VARIANT_SETS["scores"]["to 8 rows"]):
        assert row_scores(8, *dims)
    with applied(VARIANT_SETS["scores"]["alone to 2 rows, 1 query a thread"]):
        assert not row_scores(3, *dims)


def test_the_variants_table_gives_each_median_and_its_difference():
    from kernels.bench.variants import table

    times = {("engine", 1): [10.0, 12.0, 11.0], ("faster", 1): [9.0, 9.5, 8.0],
             ("engine", 2): [20.0], ("faster", 2): [21.5]}
    assert table(times, ["engine", "faster"], [1, 2], 136).splitlines() == [
        "| 136 cached tokens | T=1 | T=2 |", "|---|---|---|", "| engine | 11.0 | 20.0 |",
        "| faster | 9.0 (-2.0) | 21.5 (+1.5) |"]


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "argument --rows: expected comma-separated integers >= 1, got '0'"),
    (["--contexts", "a"], "argument --contexts: expected comma-separated integers >= 1, got 'a'"),
    (["--rows", "256"], "--rows must be at most the engine's 128 rows, got 256"),
    (["--preset", "micro", "--contexts", "510"], "--contexts plus the rows must fit micro's 512 positions"),
])
def test_the_variants_refuse_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["variants", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_the_variants_run_on_a_gpu(tmp_path):
    out = tmp_path / "variants.md"
    assert main(["variants", "--preset", "micro", "--set", "tail", "--rows", "1,2", "--contexts", "8,20",
                 "--out", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [line for line in lines if line.startswith("| engine |")] and not \
        [line for line in lines if line.startswith("- dropped")]
    assert len([line for line in lines if line.startswith("| one row 1x32x16 |")]) == 2    # two contexts


def test_a_shape_row_ranks_the_shapes_and_marks_the_engine_s():
    from kernels.bench.shapes import shape_row

    times = {(4, 2, 16): 3e-6, (4, 4, 4): 2e-6}
    row = shape_row("2 rows", times, 1e-6, (4, 2, 16))
    assert row == "| 2 rows | 4x4x4 2.0 µs (2.00x) | 4x2x16* 3.0 µs (3.00x) |"


def test_the_shapes_time_a_layer_s_own_projections():
    from kernels.bench.shapes import projections

    config = preset("small")
    assert projections(config) == {"q_a": (1536, 2048), "q_b": (16 * 192, 1536), "kv_a": (512 + 64, 2048),
                                   "o": (2048, 16 * 128), "shared gate": (2 * 1408, 2048)}
    assert list(projections(preset("tiny-b"))) == ["q", "kv_a", "o", "shared gate"]   # no q_lora_rank


@pytest.mark.gpu
def test_the_shapes_run_on_a_gpu(tmp_path):
    out = tmp_path / "shapes.md"
    assert main(["shapes", "--preset", "micro", "--rows", "1,2", "--out", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    rows = [line for line in lines if line.startswith(("| 1 (", "| 2 (", "| shared experts, ", "| q_a ("))]
    assert rows[0].startswith("| 1 (2 experts, by slot) |")         # one token: a block per slot
    assert len(rows) == 6 and all(row.count("*") == 1 and row.count("µs") == 6 for row in rows)
    beside = [line for line in lines if line.startswith("| shared beside routed, ")]
    assert len(beside) == 2 and all(row.count("*") == 1 and row.count("µs") == 6 for row in beside)


def test_the_shared_experts_beside_the_routed_compute_what_each_computes_alone():
    """``kernels.bench.shapes``' two branches (the engine's fork of its MoE) launch the same kernels
    on the same inputs as each case alone: the same outputs, bit for bit (in the simulator one
    stream runs both, in order)."""
    from kernels.bench.case import uniform
    from kernels.bench.shapes import engine_shape, launch_beside, launch_swiglu, swiglu_case

    config = preset("micro")
    width, features, experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts

    def stacks(count: int, size: int, seed: int) -> tuple:                 # (gate, up, down)
        return (uniform((count, size, width), seed), uniform((count, size, width), seed + 1),
                uniform((count, width, size), seed + 2))

    rng = np.random.default_rng(3)
    routed = swiglu_case(stacks(experts, features, 1), 2, config.num_experts_per_tok, rng)
    shared = swiglu_case(stacks(1, 2 * features, 4), 2, 1, rng)
    launch_swiglu(0, routed, engine_shape(routed))
    launch_swiglu(0, shared, engine_shape(shared))
    alone = [case.out.copy_to_host() for case in (routed, shared)]
    for case in (routed, shared):
        case.out.copy_to_device(np.full(case.out.shape, np.nan, np.float32))
    launch_beside(0, routed, shared, engine_shape(shared))
    for case, expected in zip((routed, shared), alone, strict=True):
        assert np.all(np.isfinite(expected))
        assert np.array_equal(case.out.copy_to_host().view(np.uint32), expected.view(np.uint32))


def test_profile_record_is_the_sections_under_the_command_and_environment():
    """``profile --out``: a title, the command, the environment header, then each preset's
    section as printed, in order (the chapter reads the sections by their headings)."""
    from kernels.bench.profile import format_record

    sections = ["## tiny: device µs per kernel in one forward\n\n| kernel | launches | T=1 |",
                "## small: device µs per kernel in one forward\n\n| kernel | launches | T=1 |"]
    command = "python -m kernels.bench profile --presets tiny,small"
    text = format_record(sections, [("GPU", "test GPU")], command)
    lines = text.splitlines()
    assert lines[:4] == ["# Each kernel inside one engine forward", "",
                         "Command: `python -m kernels.bench profile --presets tiny,small`", ""]
    assert "- GPU: test GPU" in lines
    assert text.index("## tiny:") < text.index("## small:") and text.endswith("| T=1 |\n")


def test_profile_table_lists_every_kernel_of_any_row_count():
    """A kernel that runs at one T only (a decode row's "stream" projections) gets its row; launch
    shapes of one kernel merge; launches are the most of any T; the costliest at the largest T
    comes first; the sums add every launch label."""
    from kernels.bench.profile import kernel_table

    table = {1: ({"stream_kernel grid (4, 1, 1) x 64": 30.0, "stream_kernel grid (8, 1, 1) x 64": 10.0,
                  "rmsnorm_kernel grid (1, 1, 1) x 128": 5.0}, {"stream_kernel grid (4, 1, 1) x 64": 3,
                  "stream_kernel grid (8, 1, 1) x 64": 2, "rmsnorm_kernel grid (1, 1, 1) x 128": 4}),
             8: ({"tiles_gemm_kernel grid (2, 1, 1) x 256": 70.0, "rmsnorm_kernel grid (8, 1, 1) x 128": 6.0},
                 {"tiles_gemm_kernel grid (2, 1, 1) x 256": 5, "rmsnorm_kernel grid (8, 1, 1) x 128": 4})}
    lines = kernel_table(table, [1, 8])
    assert lines[:2] == ["| kernel | launches | T=1 | T=8 |", "|---|---|---|---|"]
    assert lines[2:] == ["| tiles_gemm_kernel | 5 | 0.0 | 70.0 |", "| rmsnorm_kernel | 4 | 5.0 | 6.0 |",
                         "| stream_kernel | 5 | 40.0 | 0.0 |", "| **sum of kernels** | | 45.0 | 76.0 |"]


def test_gc_pauses_times_the_collector_and_unhooks_itself():
    """The engine bench's round split reports the collector's pauses (a GPU run): the helper."""
    import gc

    from kernels.bench.engine import GcPauses

    with GcPauses() as pauses:
        gc.collect()
    assert pauses.collections >= 1 and pauses.seconds > 0
    assert pauses._callback not in gc.callbacks


def test_engine_bench_options_leave_out_columns_by_name():
    """--engine-only drops every peer column, --no-numpy only the CPU reference's."""
    from kernels.bench.engine import parse_args

    plain, no_numpy = parse_args([]), parse_args(["--no-numpy", "--presets", "tiny"])
    assert (plain.no_numpy, plain.engine_only) == (False, False)
    assert (no_numpy.no_numpy, no_numpy.engine_only, no_numpy.presets) == (True, False, "tiny")


NCU_CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","Grid Size","Block Size","Section Name","Metric Name","Metric Unit","Metric Value"
"0","rmsnorm::kernel[abc](Array<float>)","(1, 1, 1)","(512, 1, 1)","SOL","Duration","ns","4,000"
"0","rmsnorm::kernel[abc](Array<float>)","(1, 1, 1)","(512, 1, 1)","SOL","DRAM Throughput","%","0.19"
"0","rmsnorm::kernel[abc](Array<float>)","(1, 1, 1)","(512, 1, 1)","Launch","Registers Per Thread","","40"
"1","mla::attention_stats_kernel[x](Array<float>)","(16, 1, 1)","(512, 1, 1)","SOL","Duration","us","5.5"
"2","rmsnorm::kernel[abc](Array<float>)","(1, 1, 1)","(512, 1, 1)","SOL","Duration","ns","5,000"
'''


def test_ncu_table_sums_launches_by_kernel_and_shape():
    """kernels.bench.ncu: a launch per ID, its duration in any of ncu's units, closures named by
    their factory or module, the largest total first."""
    from kernels.bench.ncu import kernel_name, launches, table

    assert kernel_name("lanes_kernel::kernel[v1](Array<float>)") == "lanes_kernel"
    assert kernel_name("mla::absorb_query_kernel[v2]") == "absorb_query_kernel"
    lines = table(launches(NCU_CSV.splitlines()))
    assert lines[0] == "total 14.5 µs of kernel duration, 3 launches"
    assert lines[1].split() == ["9.0", "2", "4.50", "reg", "40", "dram%", "0.19", "rmsnorm", "(1,", "1,",
                                "1)x(512,", "1,", "1)"]
    assert lines[2].split()[:3] == ["5.5", "1", "5.50"] and "attention_stats_kernel (16, 1, 1)" in lines[2]
    with pytest.raises(ValueError, match="Duration in 'cycle'"):
        launches(NCU_CSV.replace('"us","5.5"', '"cycle","5.5"').splitlines())
    with pytest.raises(ValueError, match="no CSV header"):
        launches(["==PROF== nothing"])


NCU_RAW_CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","Block Size","Grid Size","gpu__time_duration.sum",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio"
"","","","","usecond","ratio","ratio","ratio"
"0","moe::route_one_kernel[x](Array<float>)","(512, 1, 1)","(8, 4, 1)","20.0","1.0","6.0","3.0"
"1","mla_unfused::row_scores_kernel::kernel[y]","(256, 1, 1)","(264, 1, 1)","12.5","2.0","1.0","0.5"
"2","moe::route_one_kernel[x](Array<float>)","(512, 1, 1)","(8, 4, 1)","22.0","3.0","4.0","1,000"
'''.replace("\\\n", "")


def test_ncu_stall_table_names_the_reasons_each_kernel_waits_on(tmp_path, capsys):
    """kernels.bench.ncu on ncu's raw page with the warp states: per kernel and shape, its launches'
    µs summed, the cycles an issued instruction takes (the reasons' sum, averaged over its launches)
    and the reasons that take most, the largest first; the command tells the two pages apart."""
    from kernels.bench.ncu import main, stall_launches, stall_table

    lines = stall_table(stall_launches(NCU_RAW_CSV.splitlines()), top=2)
    assert lines[1].split()[:3] == ["42.0", "2", "508.5"]                   # (10 + 1007) / 2 cycles
    assert lines[1].endswith("route_one_kernel (8, 4, 1)x(512, 1, 1): no_instruction 501.5, "
                             "long_scoreboard 5.0")
    assert lines[2].split()[:3] == ["12.5", "1", "3.5"]
    assert lines[2].endswith("row_scores_kernel (264, 1, 1)x(256, 1, 1): barrier 2.0, long_scoreboard 1.0")
    path = tmp_path / "raw.csv"
    path.write_text(NCU_RAW_CSV)
    assert main([str(path)]) == 0
    assert "route_one_kernel" in capsys.readouterr().out.splitlines()[1]
    with pytest.raises(ValueError, match="no stall columns"):
        stall_launches(['"ID","Kernel Name","Block Size","Grid Size","gpu__time_duration.sum"'])
    with pytest.raises(ValueError, match="gpu__time_duration.sum in 'cycle'"):
        stall_launches(NCU_RAW_CSV.replace('"usecond"', '"cycle"').splitlines())


def test_engine_record_gives_each_rows_runs_and_the_floor_at_the_read_bandwidth():
    """The engine report: each tok/s row says how many runs its median is of; the AR step's floor
    is the weight bytes over the median read batch, with the slowest and fastest batch beside it."""
    from ddtree.config import preset
    from kernels.bench.engine import READ_BYTES, Run, ar_floor, format_report, weight_bytes_per_token

    config = preset("small")
    seconds = [READ_BYTES / 4.0e12, READ_BYTES / 4.4e12, READ_BYTES / 3.9e12]   # per pass, three batches
    floor = ar_floor(config, 2e-3, 7, seconds)
    assert floor["read_bandwidth"] == pytest.approx(4.0e12)                       # the median batch
    assert floor["read_bandwidth_spread"] == [pytest.approx(3.9e12), pytest.approx(4.4e12)]
    assert floor["floor_us"] == pytest.approx(1e6 * weight_bytes_per_token(config) / 4.0e12)
    runs = [Run("engine, graphs", "AR", None, 500.0, 257, 7), Run("numpy (CPU)", "AR", None, 90.0, 257, 3)]
    result = {"preset": "small", "runs": [dataclasses.asdict(r) for r in runs], "floor": floor,
              "tree_sizes": [{"nodes": 1, "verify_us": 900.0, "rounds": 7, "experts_per_layer": 8.0}]}
    text = format_report([result], [("GPU", "test")], "python -m kernels.bench engine")
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| engine") or
            line.startswith("| numpy")]
    assert [row[4] for row in rows] == ["7", "3"]                                 # the runs column
    floor_line = next(line for line in text.splitlines() if line.startswith("AR step:"))
    assert "(the median of 7 generations)" in floor_line
    assert "at 4000 GB/s read bandwidth" in floor_line and "the median of 3 batches" in floor_line
    assert "batches 3900 to 4400 GB/s" in floor_line and "copy" not in text
    assert "| 1 | 900 | 862 | 1.04 | 7 | 8.0 |" in text                       # its floor: 8 experts a layer


def test_engine_bench_refuses_fewer_than_one_repeat(capsys):
    from kernels.bench.engine import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_engine_bench_auto_rows_time_a_table_per_drafter_and_stay_lossless(monkeypatch):
    """Budget auto's rows: the drafter's cost table timed at warm-up (simulated seconds here: only
    the plumbing is checked), then runs that must give AR's tokens; the report lists the budgets
    chosen and the >= 0.98 target."""
    from ddtree import golden
    from kernels import decode as engine_decode
    from kernels.bench import engine as bench
    from kernels.model import Transformer

    monkeypatch.setattr(bench, "NEW_TOKENS", 2)
    model = Transformer(*golden.golden_model("micro"), max_tree_nodes=4)
    prompt = golden.default_prompt("micro")[:2]
    continuation = engine_decode.generate_ar(model, prompt, 2)
    runs, chosen = bench.auto_runs(model, prompt, continuation, 1, 1, drafters=("oracle",))
    run, carried = runs
    assert (run.system, run.decoder, run.budget) == ("engine, graphs", "DDTree oracle", "auto")
    assert (carried.decoder, carried.budget) == ("DDTree oracle", "auto, carried")
    table = chosen["oracle"]["cost_table"]
    assert len(table["verify"]) == 1 and table["ar_step"] > 0
    assert set(chosen["oracle"]["budgets"]) <= {0, 1} and chosen["oracle"]["budgets"]
    ar = bench.Run("engine, graphs", "AR", None, run.tokens_per_second, 2, 1)
    result = {"preset": "micro", "runs": [dataclasses.asdict(r) for r in (ar, run, carried)], "auto": chosen}
    text = bench.format_report([result], [("GPU", "test")], "python -m kernels.bench engine")
    assert "DDTree oracle, budget auto: DDTree/AR 1.00 (target >= 0.98: met)" in text
    assert "DDTree oracle, budget auto, carried: DDTree/AR" in text
    assert "<!-- --8<-- [start:auto-micro] -->" in text and "| oracle | " in text


def test_a_verify_floor_reads_each_distinct_expert_once_and_the_targets_say_so():
    """A verify's floor: a decode token's bytes with its k experts per MoE layer replaced by the
    tree's distinct ones; an expert is its three matrices in every MoE layer."""
    from ddtree.config import preset
    from ddtree.weights import weight_shapes
    from kernels.bench.engine import expert_bytes, floor_targets, verify_floor_bytes, weight_bytes_per_token

    config = preset("small")
    expert = [shape for name, shape in weight_shapes(config).items() if ".mlp.experts.0." in name]
    assert expert_bytes(config) == 4 * sum(math.prod(shape) for shape in expert)
    k = config.num_experts_per_tok
    assert verify_floor_bytes(config, k) == weight_bytes_per_token(config)
    assert verify_floor_bytes(config, k + 2.5) == pytest.approx(weight_bytes_per_token(config)
                                                                + 2.5 * expert_bytes(config))
    floor = {"ar_step_us": 1500.0, "floor_us": 1000.0, "read_bandwidth": 1e12}
    two = 1e6 * verify_floor_bytes(config, 10.0) / 1e12
    rows = [{"nodes": 2, "verify_us": 1.4 * two, "experts_per_layer": 10.0},
            {"nodes": 16, "verify_us": 1.0, "experts_per_layer": 30.0}]
    assert floor_targets(config, floor, rows) == ["AR step / its floor: 1.50 (target <= 1.5: met)",
                                                  "verify of 2 nodes / its floor: 1.40 (target <= 1.4: met)"]


def test_budget_auto_targets_by_preset():
    """small: AR and budget auto's tok/s against their floors of AUTO_RATE_TARGETS; tiny: the noisy
    drafter's auto run at least 3x AR, every other auto run at least AUTO_AR_FLOOR x."""
    from kernels.bench.engine import Run, targets

    def result(name, runs):
        return {"preset": name, "runs": [dataclasses.asdict(r) for r in runs]}

    def graphs(decoder, budget, rate, forwards):
        return Run("engine, graphs", decoder, budget, rate, forwards, 3)

    small = [graphs("AR", None, 710.0, 256), graphs("DDTree noisy", "auto", 790.0, 90),
             graphs("DDTree oracle", "auto", 1900.0, 40), graphs("DDTree ngram", "auto", 690.0, 257)]
    lines = targets(result("small", small))
    assert "AR: 710 tok/s (target >= 700: met)" in lines
    assert "DDTree noisy, budget auto: 790 tok/s (target >= 800: missed)" in lines
    assert "DDTree oracle, budget auto: 1900 tok/s (target >= 1800: met)" in lines
    assert "DDTree ngram, budget auto: DDTree/AR 0.97 (target >= 0.98: missed)" in lines
    tiny = [graphs("AR", None, 1000.0, 256), graphs("DDTree noisy", "auto", 2900.0, 70)]
    tiny_lines = targets(result("tiny", tiny))
    assert "DDTree noisy, budget auto: DDTree/AR 2.90 (target >= 3.0: missed)" in tiny_lines


def test_ncu_forward_runs_the_forwards_to_profile(capsys):
    """``python -m kernels.bench ncu forward``: the program ncu profiles runs its forwards (in the
    simulator without a profiler range) and names what it profiled; bad options are refused by name."""
    from kernels.bench.cli import main

    assert main(["ncu", "forward", "--preset", "micro", "--rows", "1,2", "--context", "5"]) == 0
    assert "profiled: micro, forwards of [1, 2] rows after 5 cached tokens" in capsys.readouterr().err
    for bad, named in ((["--rows", "0,2"], "--rows"), (["--rows", "a"], "--rows"),
                       (["--preset", "kimi-k2.6"], "--preset"), (["--context", "-1"], "--context")):
        with pytest.raises(SystemExit):
            main(["ncu", "forward", "--preset", "micro", *bad])
        assert named in capsys.readouterr().err
