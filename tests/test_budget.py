"""The cost-aware tree size (``ddtree/budget.py``, ``budget="auto"``).

The policy on hand-made tables and statistics: it picks the budget of the most tokens per second,
falls back to AR steps (budget 0) when no tree pays, re-tests the best tree every bounded number
of AR steps, is a pure function, and refuses bad tables by name. Then the decoders: with tables
that make trees always pay, never pay, or pay for some drafters only, ``budget="auto"`` emits AR's
tokens bit for bit for every drafter, in the reference and (simulator, ``micro``) in the engine,
with the same budgets round by round. The table's timing on a GPU is marked ``gpu``.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from ddtree import decode as reference_decode
from ddtree import golden
from ddtree.budget import (
    AcceptanceStats,
    CostTable,
    best_tree,
    check_auto,
    choose_budget,
    estimate,
    load_cost_table,
    retest_after,
    save_cost_table,
    utility,
)
from ddtree.drafters import DRAFTERS, make_drafter
from tests.helpers import assert_exact

# a verify that grows with the tree, in AR steps: budget B costs 1 + 0.25 B
GROWING = CostTable(1.0, tuple(1.0 + 0.25 * b for b in range(1, 16)))
# trees as cheap as an AR step: any tree that accepts anything pays
CHEAP = CostTable(1.0, (1.0,) * 15)
# trees at three AR steps: only a drafter that commits more than 3 tokens a round pays
DEAR = CostTable(1.0, (3.0,) * 15)


def stats_with(block_size=8, max_budget=15, ar_run=0, **means):
    """Statistics of one round per budget ``b<B>=tokens``."""
    stats = AcceptanceStats.empty(max_budget, block_size)
    for name, committed in means.items():
        stats = stats.observe(int(name[1:]), committed)
    return AcceptanceStats(stats.block_size, stats.counts, stats.sums, ar_run)


# ----------------------------------------------------------------------------------------------
# the policy

def test_nothing_measured_tries_the_size_that_pays_best_if_every_draft_is_accepted():
    stats = stats_with(block_size=8)
    assert [estimate(stats, b) for b in (0, 1, 3, 7, 12)] == [1, 2, 4, 8, 8]
    # (B + 1) / (1 + 0.25 B) grows to B = 7, where the block caps it: 8 tokens for 2.75 steps
    assert choose_budget(GROWING, stats) == 7


def test_the_choice_is_the_argmax_of_tokens_per_second():
    stats = stats_with(b2=3, b4=4, b8=5)
    rates = {b: estimate(stats, b) / GROWING.seconds(b) for b in range(1, 16)}
    assert choose_budget(GROWING, stats) == max(rates, key=rates.get) == 2
    assert utility(GROWING, stats, 2) == pytest.approx(3 / 1.5)


def test_untried_sizes_borrow_from_their_nearest_measured_neighbours():
    stats = stats_with(b2=3, b6=5)
    assert estimate(stats, 4) == pytest.approx(4.0)             # on the line between 2 and 6
    assert estimate(stats, 1) == 2                                # 3 borrowed, capped at B + 1
    assert estimate(stats, 12) == 5                               # flat past the largest measured
    stats = stats.observe(2, 1)                                   # a second round at 2: the mean
    assert estimate(stats, 2) == 2.0


def test_no_tree_that_pays_means_ar_steps():
    stats = stats_with(b7=2, b3=1)                                # ~1 token a round: nothing pays
    assert utility(DEAR, stats, best_tree(DEAR, stats)) < 1
    assert choose_budget(DEAR, stats) == 0
    assert choose_budget(CHEAP, stats_with(b7=2)) > 0            # the same tree at AR's price pays


def test_the_best_tree_is_retested_every_bounded_number_of_ar_steps():
    stats = stats_with(b7=2, b3=1)
    best = best_tree(DEAR, stats)
    every = retest_after(DEAR, stats, best)
    # its extra time over the AR steps of its tokens is at most 1% of the AR steps' time
    assert (DEAR.seconds(best) - estimate(stats, best) * DEAR.ar_step) <= 0.01 * every * DEAR.ar_step + 1e-12
    choices = []
    for _ in range(3 * every + 1):
        choice = choose_budget(DEAR, stats)
        choices.append(choice)
        stats = stats.observe(choice, 1) if choice == 0 else AcceptanceStats(
            stats.block_size, stats.counts, stats.sums, stats.ar_run + 1)   # the re-test, not yet read
    retests = [i for i, c in enumerate(choices) if c]
    assert retests == [every, 2 * every, 3 * every] and set(choices[i] for i in retests) == {best}
    # a drafter that starts paying: the re-test's round raises the estimate, and trees come back
    paying = stats_with(b7=2, b3=1).observe(best, 8).observe(best, 8).observe(best, 8)
    assert choose_budget(DEAR, paying) == best


def test_the_policy_is_a_pure_function_of_table_and_statistics():
    stats = stats_with(b2=3, b5=2, ar_run=4)
    first = [choose_budget(table, stats) for table in (GROWING, CHEAP, DEAR)]
    assert [choose_budget(table, stats) for table in (GROWING, CHEAP, DEAR)] == first
    assert stats == stats_with(b2=3, b5=2, ar_run=4)             # observe makes new statistics


@pytest.mark.parametrize("table, names", [
    (dict(ar_step=0.0, verify=(1.0,)), "CostTable.ar_step"),
    (dict(ar_step=float("nan"), verify=(1.0,)), "CostTable.ar_step"),
    (dict(ar_step=True, verify=(1.0,)), "CostTable.ar_step"),
    (dict(ar_step=1.0, verify=()), "CostTable.verify"),
    (dict(ar_step=1.0, verify=5), "CostTable.verify"),
    (dict(ar_step=1.0, verify=(1.0, -2.0)), "at budget 2"),
    (dict(ar_step=1.0, verify=(1.0, "2")), "CostTable.verify"),
])
def test_bad_tables_are_refused_by_name(table, names):
    with pytest.raises(ValueError, match=names):
        CostTable(**table)


def test_cost_table_files_round_trip_and_bad_files_are_named(tmp_path):
    path = tmp_path / "costs.json"
    save_cost_table(GROWING, path, device="hand-made")
    assert load_cost_table(path) == GROWING
    assert json.loads(path.read_text())["device"] == "hand-made"
    path.write_text('{"ar_step": 1.0}')
    with pytest.raises(ValueError, match=r"costs.json.*'verify'"):
        load_cost_table(path)
    with pytest.raises(ValueError, match="missing.json"):
        load_cost_table(tmp_path / "missing.json")


def test_the_decoders_options_pair_budget_and_table():
    assert check_auto(5, None, 127, "limit") == (5, None)
    assert check_auto("auto", GROWING, 127, "limit") == ("auto", GROWING)
    assert check_auto("auto", {"ar_step": 1, "verify": [2]}, 127, "limit")[1] == CostTable(1, (2,))
    with pytest.raises(ValueError, match="cost_table="):
        check_auto("auto", None, 127, "limit")
    with pytest.raises(ValueError, match="cost_table is used only with budget='auto'"):
        check_auto(5, GROWING, 127, "limit")
    with pytest.raises(ValueError, match=r"budget must be an integer or 'auto', got 'big'"):
        check_auto("big", None, 127, "limit")
    with pytest.raises(ValueError, match=r"cost_table lists budgets up to 15, more than .* 7 \(the engine's"):
        check_auto("auto", GROWING, 7, "the engine's")


# ----------------------------------------------------------------------------------------------
# the reference decoder: lossless for every choice

NEW = 24


def reference_model(name="micro"):
    from tests.test_engine import reference

    return reference(name)


def regimes():
    """Tables that make trees always pay (a verify cheaper than an AR step: every tree commits at
    least one token), never pay past the first rounds (a verify of ten AR steps) or pay for the
    good drafters only (GROWING)."""
    return {"always tree": CostTable(1.0, (0.9,) * 15), "always AR": CostTable(1.0, (10.0,) * 15),
            "switching": GROWING}


@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_auto_is_ar_bit_for_bit_in_the_reference(drafter_name):
    model = reference_model()
    prompt = golden.default_prompt("micro")
    expected = reference_decode.generate_ar(model, prompt, NEW)
    seen = {}
    for regime, table in regimes().items():
        drafter = make_drafter(drafter_name, model, prompt, NEW, continuation=expected)
        tokens, trace = reference_decode.generate_ddtree(model, prompt, NEW, drafter, budget="auto",
                                                         cost_table=table)
        assert_exact(tokens, expected, name=f"{drafter_name}, {regime}")
        assert len(trace.budgets) == len(trace.rounds)
        seen[regime] = trace.budgets
    assert 0 not in seen["always tree"]
    assert set(seen["always AR"][2:]) == {0}                       # after the two unmeasured rounds
    if drafter_name == "oracle":
        assert 0 not in seen["switching"]                          # the oracle's trees always pay
    else:
        assert 0 in seen["switching"] or len(set(seen["switching"])) > 1


def test_auto_budgets_replay_the_policy_with_a_one_round_lag():
    model = reference_model()
    prompt = golden.default_prompt("micro")
    expected = reference_decode.generate_ar(model, prompt, NEW)
    drafter = make_drafter("noisy", model, prompt, NEW, continuation=expected)
    _, trace = reference_decode.generate_ddtree(model, prompt, NEW, drafter, budget="auto",
                                                cost_table=GROWING)
    stats = AcceptanceStats.empty(GROWING.max_budget, 8)
    wanted = [choose_budget(GROWING, stats)] * 2                  # rounds 0 and 1: nothing read yet
    for round_, budget in zip(trace.rounds[:-2], trace.budgets, strict=False):
        stats = stats.observe(budget, round_.committed)
        wanted.append(choose_budget(GROWING, stats))
    # the last rounds may be cut short by the request's end, and are not counted
    assert trace.budgets[:len(wanted) - 2] == wanted[:len(trace.budgets) - 2]


def test_a_fixed_budget_is_unchanged_and_records_its_budget():
    model = reference_model()
    prompt = golden.default_prompt("micro")
    expected = reference_decode.generate_ar(model, prompt, 8)
    drafter = make_drafter("ngram", model, prompt, 8, continuation=expected)
    tokens, trace = reference_decode.generate_ddtree(model, prompt, 8, drafter, budget=5)
    assert_exact(tokens, expected)
    assert set(trace.budgets) == {5}
    with pytest.raises(ValueError, match="cost_table="):
        reference_decode.generate_ddtree(model, prompt, 8, drafter, budget="auto")


# ----------------------------------------------------------------------------------------------
# the engine (simulator, micro): the same tokens and the same budgets as the reference

ENGINE_NEW = 8
SMALL = CostTable(1.0, tuple(1.0 + 0.4 * b for b in range(1, 8)))    # budgets up to Tmax - 1 = 7


@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_auto_in_the_engine_chooses_as_the_reference_and_is_ar(drafter_name, monkeypatch):
    from kernels import decode as engine_decode
    from tests.test_engine import assert_same_round, engine

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt = golden.default_prompt("micro")[:2]
    expected = reference_decode.generate_ar(ref, prompt, ENGINE_NEW)
    queued = []
    queue_round = model.queue_round
    monkeypatch.setattr(model, "queue_round", lambda *args: queued.append(queue_round(*args)) or queued[-1])
    table = {"oracle": SMALL, "noisy": SMALL, "ngram": CostTable(1.0, (10.0,) * 7)}[drafter_name]
    options = dict(block_size=3, budget="auto", cost_table=table)
    drafter = make_drafter(drafter_name, ref, prompt, ENGINE_NEW, continuation=expected, seed=29)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, ENGINE_NEW, drafter, **options)
    wanted_tokens, wanted = reference_decode.generate_ddtree(ref, prompt, ENGINE_NEW, drafter, **options)
    assert_exact(tokens, expected)
    assert_exact(wanted_tokens, expected)
    assert trace.budgets == wanted.budgets
    for actual_round, wanted_round in zip(trace.rounds, wanted.rounds, strict=True):
        assert_same_round(actual_round, wanted_round)
    if drafter_name == "ngram":
        assert 0 in trace.budgets
    if drafter_name == "oracle":
        assert any(pending is not None for pending in queued)    # unchanged budgets stay queued
    assert model.unread == 0


def test_the_engine_default_is_auto_only_with_a_table(monkeypatch):
    from kernels import decode as engine_decode
    from tests.test_engine import engine

    monkeypatch.setattr(engine_decode, "SIMULATOR", True)      # the refusal below is the simulator's

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt = golden.default_prompt("micro")[:2]
    expected = reference_decode.generate_ar(ref, prompt, 3)
    drafter = make_drafter("oracle", ref, prompt, 3, continuation=expected)
    with pytest.raises(ValueError, match="cost_table= in the CUDA simulator"):
        engine_decode.generate_ddtree(model, prompt, 3, drafter, budget="auto")
    with pytest.raises(ValueError, match="cost_table lists budgets up to 15, more than this decoder runs: 7"):
        engine_decode.generate_ddtree(model, prompt, 3, drafter, budget="auto", cost_table=GROWING)
    choose = functools.partial(engine_decode.engine_budget, model, prompt, drafter, 2, topk=None,
                               temperature=0.0, seed=0)
    assert choose(None, cost_table=None) == (reference_decode.DEFAULT_BUDGET, None)   # as before
    assert choose(None, cost_table=SMALL) == ("auto", SMALL)
    assert choose(5, cost_table=None) == (5, None)
    model.cost_table = SMALL
    try:
        tokens, trace = engine_decode.generate_ddtree(model, prompt, 3, drafter, block_size=2)
    finally:
        model.cost_table = None
    assert_exact(tokens, expected)
    assert trace.budgets[0] == choose_budget(SMALL, AcceptanceStats.empty(7, 2))


def test_the_timing_runs_every_budget_and_leaves_the_engine_as_it_was(monkeypatch):
    """``measure_cost_table``'s rounds in the simulator (its seconds mean nothing there: only the
    shape of the table and the engine's state are checked), and an ``"auto"`` without a table
    times one where a GPU would (the simulator's refusal lifted)."""
    from kernels import decode as engine_decode
    from tests.test_engine import engine

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt = golden.default_prompt("micro")[:2]
    expected = reference_decode.generate_ar(ref, prompt, 3)
    drafter = make_drafter("oracle", ref, prompt, 3, continuation=expected)
    forwards = model.forward_count
    table = engine_decode.measure_cost_table(model, prompt, drafter, block_size=2, max_budget=2, repeats=1)
    assert table.max_budget == 2 and model.forward_count == forwards and model.unread == 0
    timed = []
    monkeypatch.setattr(engine_decode, "SIMULATOR", False)
    monkeypatch.setattr(engine_decode, "measure_cost_table", lambda *args: timed.append(args) or SMALL)
    try:
        tokens, trace = engine_decode.generate_ddtree(model, prompt, 3, drafter, block_size=2, budget="auto")
        assert model.cost_table is SMALL and len(timed) == 1
    finally:
        model.cost_table = None
    assert_exact(tokens, expected)
    assert trace.budgets[0] == choose_budget(SMALL, AcceptanceStats.empty(7, 2))


@pytest.mark.gpu
def test_the_cost_table_is_timed_on_the_gpu(tmp_path):
    from kernels import decode as engine_decode
    from tests.test_engine import engine

    model, ref = engine("micro"), reference_model()
    prompt = golden.default_prompt("micro")
    drafter = make_drafter("noisy", ref, prompt, 16)
    forwards = model.forward_count
    table = engine_decode.measure_cost_table(model, prompt, drafter, block_size=8, max_budget=15, repeats=2)
    assert table.max_budget == 15 and model.forward_count == forwards
    assert all(np.isfinite(s) and s > 0 for s in (table.ar_step, *table.verify))
    save_cost_table(table, tmp_path / "costs.json")
    expected = reference_decode.generate_ar(ref, prompt, 16)
    drafter = make_drafter("noisy", ref, prompt, 16, continuation=expected)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, 16, drafter,
                                                  cost_table=load_cost_table(tmp_path / "costs.json"))
    assert_exact(tokens, expected)
