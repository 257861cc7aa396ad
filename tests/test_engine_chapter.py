"""walkthrough/14_engine.py's lesson on a mixture of experts: the verify-cost fit and uniform
routing's distinct experts, on numbers whose answer is known."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "walkthrough"))


def load_chapter():
    spec = importlib.util.spec_from_file_location("engine_chapter", ROOT / "walkthrough" / "14_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


engine_chapter = load_chapter()


def test_verify_fit_recovers_its_terms_and_leaves_the_one_row_path_out():
    a, b, c = 2000.0, 70.0, 175.0
    rows = [{"nodes": n, "experts_per_layer": e, "verify_us": a + b * e + c * n}
            for n, e in ((2, 10.5), (4, 18.3), (8, 26.7), (16, 36.4), (32, 46.0))]
    rows.insert(0, {"nodes": 1, "experts_per_layer": 6.0, "verify_us": 1.0})   # its own fast path
    fit = engine_chapter.verify_fit(rows)
    assert fit == pytest.approx([a, b, c], rel=1e-9)
    assert engine_chapter.fitted(fit, rows[3]) == pytest.approx(rows[3]["verify_us"])


def test_uniform_routing_wakes_k_experts_for_one_token_and_all_of_them_at_the_limit():
    uniform = engine_chapter.uniform_experts
    assert uniform(np.array(1), 64, 6) == pytest.approx(6.0)
    assert uniform(np.array(2), 64, 6) == pytest.approx(64 * (1 - (58 / 64) ** 2))
    assert uniform(np.array(10_000), 64, 6) == pytest.approx(64.0)


def run(decoder, budget, rate, system="engine, graphs"):
    return {"system": system, "decoder": decoder, "budget": budget, "tokens_per_second": rate}


def test_budget_curves_place_auto_at_its_most_chosen_budget_and_skip_other_systems():
    result = {"runs": [run("AR", None, 500.0), run("DDTree noisy", 16, 400.0), run("DDTree noisy", 4, 700.0),
                       run("DDTree noisy", "auto", 800.0), run("DDTree ngram", 16, 90.0),
                       run("DDTree ngram", "auto", 495.0), run("DDTree ngram", "auto, carried", 540.0),
                       run("DDTree noisy", 32, 1.0, "engine, no graphs")],
              "auto": {"noisy": {"budgets": [8, 3, 3, 0, 3, 8]}, "ngram": {"budgets": [3, 0, 0, 0]}}}
    curves = engine_chapter.budget_curves(result)
    assert curves["ar"] == 500.0
    assert curves["drafters"]["noisy"] == {"budgets": [16, 4], "rates": [400.0, 700.0], "auto": (3, 800.0)}
    assert curves["drafters"]["ngram"]["auto"] == (0, 495.0)
    tie = engine_chapter.budget_curves({**result, "auto": {"noisy": {"budgets": [8, 3]}}})
    assert tie["drafters"]["noisy"]["auto"] == (3, 800.0)        # equal counts: the smaller budget


def test_the_budget_figure_draws_auto_stars_including_an_ar_choice(tmp_path, monkeypatch):
    import chapter  # walkthrough/chapter.py, on the path above

    monkeypatch.setattr(chapter, "FIGURES", tmp_path)
    monkeypatch.setattr(chapter, "ROOT", tmp_path)
    result = {"preset": "small", "runs": [run("AR", None, 500.0), run("DDTree noisy", 16, 400.0),
                                          run("DDTree noisy", "auto", 800.0), run("DDTree ngram", 16, 90.0),
                                          run("DDTree ngram", "auto", 495.0)],
              "auto": {"noisy": {"budgets": [3, 3]}, "ngram": {"budgets": [0, 0]}}}
    engine_chapter.plot_budgets({"results": [result, {**result, "preset": "tiny"}]})
    assert (tmp_path / "14_engine_budgets.png").exists()

