"""walkthrough/chapter.py, the helpers every chapter shares: recording a model's operations, the
golden model, the report file and the figure-width rule."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "walkthrough"))
import chapter  # noqa: E402  (walkthrough/chapter.py)

from ddtree.decode import generate_ddtree  # noqa: E402
from ddtree.drafters import make_drafter  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    return chapter.golden_model("tiny")


@pytest.fixture
def figures(tmp_path, monkeypatch):
    monkeypatch.setattr(chapter, "FIGURES", tmp_path)
    monkeypatch.setattr(chapter, "ROOT", tmp_path)
    return tmp_path


def test_golden_model_is_the_bundles_model(setup):
    assert setup.name == "tiny" and setup.ar_tokens.size == 24
    assert np.array_equal(setup.model.logits(setup.prompt).argmax(-1)[-1:], setup.ar_tokens[:1])
    assert chapter.golden_model("micro").ar_tokens is None          # no bundle for micro


def test_record_ops_records_arguments_as_they_were_and_restores(setup):
    model = setup.model
    original = {name: getattr(model.ops, name) for name in ("compact", "accept")}
    drafter = make_drafter("noisy", model, setup.prompt, 8)
    with chapter.record_ops(model, "compact", "accept") as calls:
        tokens, trace = generate_ddtree(model, setup.prompt, 8, drafter)
    assert np.array_equal(tokens, setup.ar_tokens[:8])
    assert [c.name for c in calls] == ["accept", "compact"] * len(trace.rounds)
    for (accepted, compacted), record in zip(zip(calls[::2], calls[1::2], strict=True), trace.rounds,
                                             strict=True):
        cache, start, path = compacted.args
        assert start == record.start and np.array_equal(path, record.accepted)
        assert np.array_equal(accepted.result[0], record.accepted) and accepted.result[1] == record.bonus
        assert cache.length == record.start + record.tokens.size     # the cache before compaction
    assert {name: getattr(model.ops, name) for name in original} == original


def test_record_ops_restores_after_an_exception_and_replaces(setup):
    model = setup.model
    original = model.ops.argmax

    def failing(logits):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with chapter.record_ops(model, "argmax", replace={"argmax": failing}):
            model.ops.argmax(np.zeros((1, 3), np.float32))
    assert model.ops.argmax is original


def test_record_ops_rejects_unknown_operations(setup):
    with pytest.raises(ValueError, match=r"no operation\(s\) \['nope'\]"):
        with chapter.record_ops(setup.model, "nope"):
            pass
    assert "nope" not in vars(setup.model.ops)


def test_report_writes_what_was_printed_and_refuses_long_lines(figures):
    with chapter.report("t_ok"):
        print("a line")
        with chapter.section("part"):
            print("in a section")
    text = (figures / "t_ok_report.txt").read_text()
    assert text == "a line\n--8<-- [start:part]\nin a section\n--8<-- [end:part]\n"
    with pytest.raises(ValueError, match="longer than 100 characters"):
        with chapter.report("t_long"):
            print("x" * (chapter.REPORT_WIDTH + 1))
    assert not (figures / "t_long_report.txt").exists()


def test_save_figure_refuses_figures_too_wide_for_the_column(figures):
    fig = chapter.plt.figure(figsize=(8, 2))
    assert chapter.save_figure(fig, "t", "narrow").exists()
    fig = chapter.plt.figure(figsize=(chapter.MAX_FIGURE_WIDTH / chapter.DPI + 1, 2))
    with pytest.raises(ValueError, match="px wide"):
        chapter.save_figure(fig, "t", "wide")
    assert not (figures / "t_wide.png").exists()


def test_time_floor_uses_the_benchmark_record_and_names_its_gpu():
    hw = chapter.gpu()
    assert chapter.time_floor(hw.bandwidth) == pytest.approx(1.0)          # one second of bytes
    assert chapter.time_floor(0, hw.fp32 * 2) == pytest.approx(2.0)        # two seconds of FLOPs
    record = (chapter.ROOT / "docs" / "results" / hw.record).read_text(encoding="utf-8")
    assert f"- GPU: {hw.name}\n" in record


def test_bench_cases_are_the_records_table_against_its_read_bandwidth():
    cases = chapter.bench_cases()
    assert {"rmsnorm", "rmsnorm_other_batch", "rope_q_pe", "rope_q_pe_v1"} <= set(cases)
    assert all("% of read BW" in row for row in cases.values())
