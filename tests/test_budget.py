"""The cost-aware tree size (``ddtree/budget.py``, ``budget="auto"``).

The policy on hand-made tables and statistics: a round observes every budget up to its own (the
smaller trees are its tree's first nodes), each estimate weighs the guess "every draft accepted"
as ``PRIOR_ROUNDS`` of a round, it picks the budget of the most tokens per second, falls back to
AR steps (budget 0) when no tree pays, re-tests the best tree every bounded number of AR steps, is
a pure function, and refuses bad tables by name. Then the decoders: with tables that make trees
always pay, never pay, or pay for some drafters only, ``budget="auto"`` emits AR's tokens bit for
bit for every drafter, in the reference and (simulator, ``micro``) in the engine, with the same
budgets round by round. The table's timing on a GPU is marked ``gpu``.
"""

from __future__ import annotations

import functools
import json
import types

import numpy as np
import pytest

from ddtree import decode as reference_decode
from ddtree import golden
from ddtree.accept import accept
from ddtree.budget import (
    CHANGE_MARGIN,
    EXPLORE_SHARE,
    PRIOR_ROUNDS,
    AcceptanceStats,
    CostTable,
    best_tree,
    check_auto,
    choose_budget,
    estimate,
    estimates,
    load_cost_table,
    retest_after,
    save_cost_table,
    unheld_estimates,
    utilities,
    utility,
)
from ddtree.decode import plan_ar_run, round_block, whole_blocks
from ddtree.drafters import DRAFTERS, make_drafter
from ddtree.tree import build_tree, top_candidates
from tests.helpers import assert_exact

# a verify that grows with the tree, in AR steps: budget B costs 1 + 0.25 B
GROWING = CostTable(1.0, tuple(1.0 + 0.25 * b for b in range(1, 16)))
# trees as cheap as an AR step: any tree that accepts anything pays
CHEAP = CostTable(1.0, (1.0,) * 15)
# trees at three AR steps: only a drafter that commits more than 3 tokens a round pays
DEAR = CostTable(1.0, (3.0,) * 15)


def stats_with(block_size=8, max_budget=15, ar_run=0, rounds=1, **means):
    """Statistics of ``rounds`` observations per budget ``b<B>=tokens``."""
    stats = AcceptanceStats.empty(max_budget, block_size)
    for name, committed in means.items():
        for _ in range(rounds):
            stats = stats.observe(int(name[1:]), committed)
    return AcceptanceStats(stats.block_size, stats.counts, stats.sums, ar_run)


# ----------------------------------------------------------------------------------------------
# the policy

def test_nothing_measured_tries_the_size_that_pays_best_if_every_draft_is_accepted():
    stats = stats_with(block_size=8)
    assert [estimate(stats, b) for b in (0, 1, 3, 7, 12)] == [1, 2, 4, 8, 8]
    # (B + 1) / (1 + 0.25 B) grows to B = 7, where the block caps it: 8 tokens for 2.75 steps
    assert choose_budget(GROWING, stats) == 7


def test_an_estimate_is_the_mean_with_the_guess_as_part_of_a_round():
    stats = stats_with(b7=1)                                      # one unlucky round at 7
    assert estimate(stats, 7) == pytest.approx((1 + PRIOR_ROUNDS * 8) / (1 + PRIOR_ROUNDS))
    for _ in range(200):                                          # many rounds: the mean itself
        stats = stats.observe(7, 3)
    assert estimate(stats, 7) == pytest.approx(3, abs=0.03)
    assert estimate(stats_with(b2=9), 2) == 3                     # never above B + 1


def test_observations_alike_at_once_equal_them_one_by_one():
    stats = stats_with(b7=2, b3=1)
    for budget, committed in ((0, 1), (7, 3)):
        one_by_one = stats
        for _ in range(5):
            one_by_one = one_by_one.observe(budget, committed)
        assert stats.observe(budget, committed, times=5) == one_by_one
    assert stats.observe(0, 1, times=0) == stats


def test_the_choice_is_the_argmax_of_tokens_per_second():
    stats = stats_with(b2=3, b4=4, b8=5)
    rates = {b: estimate(stats, b) / GROWING.seconds(b) for b in range(1, 16)}
    # the means with the guess: 3, 13/3, 6 at budgets 2, 4, 8 (the guess lifts the larger more)
    assert choose_budget(GROWING, stats) == max(rates, key=rates.get) == 4
    assert utility(GROWING, stats, 4) == pytest.approx((13 / 3) / 2)
    assert choose_budget(GROWING, stats_with(rounds=50, b2=3, b4=3, b8=5)) == 2   # the means decide


def test_untried_sizes_borrow_from_their_nearest_measured_neighbours():
    stats = stats_with(rounds=3, b2=2, b6=4)                      # estimates 15/7 and 31/7
    assert estimate(stats, 4) == pytest.approx((15 / 7 + 31 / 7) / 2)   # the line between 2 and 6
    assert estimate(stats, 1) == 2                                # 15/7 borrowed, capped at B + 1
    # past the largest: on along the line of the means from 2 (the largest at most 6 // 2) to 6
    assert estimate(stats, 12) == pytest.approx(31 / 7 + 6 * (4 - 2) / 4)
    assert estimate(stats, 14) == 8                               # the block caps it


def halves(**pairs):
    """Statistics of budgets 0..16: 100 rounds per budget ``b<B>=(tokens, tokens)``, half each."""
    stats = AcceptanceStats.empty(16, 8)
    for name, (first, second) in pairs.items():
        for committed in (first, second) * 50:
            stats = stats.observe(int(name[1:]), committed)
    return stats


def test_past_the_largest_measured_size_the_upper_halfs_line_bounds_the_estimate():
    """A concave curve lies under the line through its upper half, so a bigger tree is tried when
    that bound pays best, and its round measures it: the noisy drafter's case, whose tree of 7 (the
    first round's) would otherwise hide that 16 pays more."""
    stats = halves(b3=(2, 3), b7=(3, 3))                          # the curve flattens: 1/8 a node
    assert estimate(stats, 16) == pytest.approx(estimate(stats, 7) + 9 * (3 - 2.5) / 4)
    table = CostTable(1.0, tuple(1.3 if b <= 8 else 1.42 for b in range(1, 17)))
    assert choose_budget(table, stats) == 16                      # its bound: 4.1 tokens for 1.42
    measured = halves(b3=(2, 3), b7=(3, 3), b16=(3, 3))           # it commits no more
    assert choose_budget(table, measured) == 7                    # 3 for 1.3 beats 3 for 1.42
    flat = halves(b3=(3, 3), b7=(3, 2))                           # noise: never a falling line
    assert estimate(flat, 16) == pytest.approx(estimate(flat, 7))
    one = halves(b1=(1, 2))                                       # from budget 0's one token
    assert estimate(one, 3) == pytest.approx(estimate(one, 1) + 2 * (1.5 - 1))


def test_a_size_observed_less_often_is_held_to_its_better_observed_neighbour():
    """Two rounds of 32 nodes, then rounds of 8, all committing one token (a drafter that never
    hits): size 9, observed only by the two big rounds, is held to size 8's estimate plus the
    observed rise (none), where the guess alone would put it far above and its tree would run next.
    A curve that rises keeps its rise; sizes observed equally often are not held to each other."""
    table = CostTable(1.0, tuple(1.2 + 0.01 * b for b in range(32)))
    stats = AcceptanceStats.empty(32, 8)
    for budget in (32, 32, 8, 8):
        stats = stats.observe_round(budget, [0])
    unheld = (2 + PRIOR_ROUNDS * 8) / (2 + PRIOR_ROUNDS)               # size 9's mean with the guess
    assert estimate(stats, 9) == estimate(stats, 8) < unheld
    assert best_tree(table, stats) <= 8                           # no walk on to 9
    rising_curve = stats_with(max_budget=16, rounds=4, b4=2, b8=3).observe(16, 8)   # 16 observed once
    rise = (3 - 2) / (8 - 4)                                      # from 4 (half of 8) to 8
    assert estimate(rising_curve, 16) == pytest.approx(estimate(rising_curve, 8) + rise * 8)
    assert estimate(rising_curve, 8) < estimate(rising_curve, 16) < unheld_estimates(rising_curve)[16]
    equal = stats_with(rounds=2, b4=1, b8=1)                      # as often: the guess alone
    assert estimate(equal, 8) == pytest.approx((2 + PRIOR_ROUNDS * 8) / (2 + PRIOR_ROUNDS))


def test_holding_sizes_matches_its_pairwise_definition():
    """The one-pass hold (a stack of falling counts) equals the definition on random statistics:
    each observed b held to est(a) + rise(a) (b - a), a the largest smaller observed size with more
    observations, counts in any order (``observe`` of any budget)."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        size, block = int(rng.integers(1, 34)), int(rng.integers(2, 11))
        stats = AcceptanceStats.empty(size, block)
        for _ in range(int(rng.integers(0, 25))):
            budget = int(rng.integers(0, size + 1))
            if rng.random() < 0.5:
                path = sorted(rng.choice(np.arange(1, size + 1), int(rng.integers(0, min(size, 7) + 1)),
                                         replace=False).tolist())
                stats = stats.observe_round(budget, [0, *path])
            else:
                stats = stats.observe(budget, int(rng.integers(1, block + 1)))
        held = estimates(stats)
        free = unheld_estimates(stats)
        tried = [b for b in range(1, size + 1) if stats.counts[b]]
        mean = {0: 1.0, **{b: stats.sums[b] / stats.counts[b] for b in tried}}
        want = list(free)
        for i, b in enumerate(tried):
            more = [a for a in tried[:i] if stats.counts[a] > stats.counts[b]]
            if more:
                a = more[-1]
                low = max([c for c in tried if c <= a // 2], default=0)
                rise = max(0.0, (mean[a] - mean[low]) / (a - low))
                want[b] = min(want[b], want[a] + rise * (b - a))
        assert held == tuple(want)


def test_a_round_observes_every_budget_up_to_its_own():
    stats = AcceptanceStats.empty(10, 8).observe_round(8, [0, 1, 3, 6])
    # budget b's tree is the round's first b nodes: its path is the nodes <= b, then the bonus
    assert stats.sums == (1, 2, 2, 3, 3, 3, 4, 4, 4, 0, 0)
    assert stats.counts == (1,) * 9 + (0, 0)
    assert stats.observe_round(0, [0]).ar_run == 1 and stats.ar_run == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_smaller_budgets_tree_is_the_first_nodes_and_its_path_the_first_accepted(seed):
    """What ``observe_round`` rests on: build the tree at B and at every B' < B from one draft
    (ties included, K = min(V, B) as the decoders take it) and accept against one target: the
    tree of B' is the first B' + 1 nodes of B's, and its commit count is what observe_round gives."""
    rng = np.random.default_rng(seed)
    depths, vocab, budget = 5, 6, 14
    draft = rng.integers(-3, 1, (depths, vocab)).astype(np.float32)   # coarse: many ties
    target = {}                                                   # the target's token after a path

    def posterior(tree):
        out = []
        for node in range(tree.tokens.size):
            path, n = [], node
            while n >= 0:
                path.append(int(tree.tokens[n]))
                n = int(tree.parents[n])
            out.append(target.setdefault(tuple(path), int(rng.integers(vocab))))
        return np.array(out, np.int64)

    def tree_of(b):
        return build_tree(7, *top_candidates(draft, reference_decode.candidates_per_depth(b, None, vocab)), b)

    big = tree_of(budget)
    accepted, _ = accept(big, posterior(big))
    stats = AcceptanceStats.empty(budget, depths + 1).observe_round(budget, accepted)
    for b in range(1, budget):
        small = tree_of(b)
        np.testing.assert_array_equal(small.tokens, big.tokens[:small.tokens.size])
        np.testing.assert_array_equal(small.parents, big.parents[:small.tokens.size])
        small_accepted, _ = accept(small, posterior(small))
        assert stats.sums[b] == len(small_accepted)               # its drafts and the bonus


def test_no_tree_that_pays_means_ar_steps():
    stats = stats_with(rounds=4, b7=2, b3=2)                      # ~1 token a round: nothing pays
    assert utility(DEAR, stats, best_tree(DEAR, stats)) < 1
    assert choose_budget(DEAR, stats) == 0
    assert choose_budget(CHEAP, stats_with(b7=2)) > 0            # the same tree at AR's price pays


def test_the_best_tree_is_retested_every_bounded_number_of_ar_steps():
    stats = stats_with(rounds=4, b7=2, b3=2)
    best = best_tree(DEAR, stats)
    every = retest_after(DEAR, stats, best)
    # its extra time over the AR steps of the tokens its rounds committed (the mean, no guess in
    # it) is at most EXPLORE_SHARE of the AR steps' time
    measured = stats.sums[best] / stats.counts[best]
    assert (DEAR.seconds(best) - measured * DEAR.ar_step) <= EXPLORE_SHARE * every * DEAR.ar_step + 1e-12
    assert (DEAR.seconds(best) - measured * DEAR.ar_step) > EXPLORE_SHARE * (every - 1) * DEAR.ar_step
    choices = []
    for _ in range(3 * every + 1):
        choice = choose_budget(DEAR, stats)
        choices.append(choice)
        stats = stats.observe(choice, 1) if choice == 0 else AcceptanceStats(
            stats.block_size, stats.counts, stats.sums, stats.ar_run + 1)   # the re-test, not yet read
    retests = [i for i, c in enumerate(choices) if c]
    assert retests == [every, 2 * every, 3 * every] and set(choices[i] for i in retests) == {best}
    # a drafter that starts paying: the re-test's round raises the estimate, and trees come back
    paying = stats_with(rounds=4, b7=2, b3=2).observe(best, 8).observe(best, 8).observe(best, 8)
    assert choose_budget(DEAR, paying) >= best                   # (or bigger: its curve still rises)


def test_a_retest_is_charged_its_switch_between_ar_runs():
    """A re-test runs alone between two runs of AR steps: its ``switch`` joins its extra seconds, so
    a tree that almost pays (a few hundredths of an AR step short on the queued table) is re-tested
    every two hundred-odd steps, not every few."""
    stats = stats_with(rounds=200, b7=2, b3=2)                    # the guess weighs next to nothing
    best = best_tree(DEAR, stats)
    measured = stats.sums[best] / stats.counts[best]
    near = CostTable(1.0, (measured + 0.025,) * 15)               # 0.025 AR steps short of paying
    assert utility(near, stats, best_tree(near, stats)) < 1
    assert EXPLORE_SHARE == 0.005
    assert retest_after(near, stats, best_tree(near, stats)) == 5            # 0.025 / 0.5%
    switched = CostTable(1.0, near.verify, switch=1.0)
    assert retest_after(switched, stats, best_tree(switched, stats)) == 205  # (0.025 + 1) / 0.5%
    assert choose_budget(switched, stats) == choose_budget(near, stats)      # the same choice else


def test_a_run_of_ar_steps_is_planned_as_the_loop_would_choose_round_by_round():
    """``plan_ar_run`` (the engine's run of AR steps) against the reference loop's update, one
    budget-0 round at a time: the same number of rounds, the budget after them, the statistics."""
    never = stats_with(rounds=4, b7=2, b3=2)                      # nothing pays: re-tests only
    every = retest_after(DEAR, never, best_tree(DEAR, never))
    cases = [(DEAR, never, 0, 500, 1000), (DEAR, never, 0, 5, 1000),   # a long run; one cut by the end
             (DEAR, AcceptanceStats(8, never.counts, never.sums, every - 1), 0, 500, 1000),
             (DEAR, never, 495, 500, 1000),                       # the last block, observed
             (DEAR, never, 495, 500, 500),                        # at the last positions: not observed
             (DEAR, AcceptanceStats(8, never.counts, never.sums, every - 3), 488, 500, 500),  # across them
             (CHEAP, stats_with(b7=2), 0, 500, 1000)]             # a tree pays: one round, then the tree
    for table, stats, length, end, positions in cases:
        model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=positions))
        budget, after, rounds = 0, stats, 0
        while budget == 0 and length + rounds < end:
            full_block = positions - (length + rounds) + 1 >= 8  # the deepest node's position fits
            budget, after = choose_budget(table, after), after.observe_round(0, [0]) if full_block else after
            rounds += 1
        assert plan_ar_run(model, table, stats, length, end, 8) == (rounds, budget, after)
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=1000))
    assert plan_ar_run(model, DEAR, never, 0, 500, 8)[:2] == (every + 1, best_tree(DEAR, never))


def test_whole_blocks_counts_the_rounds_round_block_leaves_whole():
    for positions, block_size in [(40, 8), (40, 1), (9, 8)]:
        model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=positions))
        for length in range(1, positions + 2):
            blocks = [round_block(model, at, block_size) for at in range(length, positions + 2)]
            whole = next((i for i, block in enumerate(blocks) if block < block_size), len(blocks))
            assert whole < len(blocks) and blocks[whole:] == sorted(blocks[whole:], reverse=True)
            assert whole_blocks(model, length, block_size) == whole, (positions, block_size, length)


def test_a_tree_size_in_use_is_kept_unless_another_promises_the_margin_more():
    """A change of size costs a round out of the queue: near-equal sizes do not trade places."""
    stats = halves(b3=(2, 3), b7=(3, 3), b16=(3, 3))
    table = CostTable(1.0, (1.0,) * 15 + (0.95,))                 # 16 a little cheaper
    scores = utilities(table, stats)
    assert best_tree(table, stats) == 16 and scores[16] < scores[7] * (1 + CHANGE_MARGIN)
    assert choose_budget(table, stats) == 16                      # nothing in use: the best
    assert choose_budget(table, stats, current=7) == 7            # 7 in use: kept
    assert choose_budget(table, stats, current=2) == 16           # the best beats it by more
    assert choose_budget(CostTable(1.0, (1.0,) * 6 + (3.0,) * 10), stats, current=7) == 6   # 7 now dear
    assert choose_budget(CostTable(1.0, (1.0,) * 6 + (4.0,) * 10), stats, current=7) == 6   # 7 not paying
    assert choose_budget(table, stats, current=0) == 16           # from AR steps: no size in use


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
    (dict(ar_step=1.0, verify=(1.0,), switch=-0.5), "CostTable.switch"),
    (dict(ar_step=1.0, verify=(1.0,), switch=float("inf")), "CostTable.switch"),
    (dict(ar_step=1.0, verify=(1.0,), switch=None), "CostTable.switch"),
])
def test_bad_tables_are_refused_by_name(table, names):
    with pytest.raises(ValueError, match=names):
        CostTable(**table)


def test_cost_table_files_round_trip_and_bad_files_are_named(tmp_path):
    path = tmp_path / "costs.json"
    save_cost_table(GROWING, path, device="hand-made")
    assert load_cost_table(path) == GROWING
    assert json.loads(path.read_text())["device"] == "hand-made"
    save_cost_table(CostTable(1.0, (2.0,), switch=0.5), path)
    assert load_cost_table(path).switch == 0.5
    path.write_text('{"ar_step": 1.0, "verify": [2.0]}')            # a file from before the switch
    assert load_cost_table(path) == CostTable(1.0, (2.0,), switch=0.0)
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
    wanted = [choose_budget(GROWING, stats)]                      # rounds 0 and 1: nothing read yet
    wanted.append(choose_budget(GROWING, stats, wanted[0]))      # (round 1: after round 0's size)
    for k, (round_, budget) in enumerate(zip(trace.rounds[:-2], trace.budgets, strict=False)):
        stats = stats.observe_round(budget, round_.accepted)
        wanted.append(choose_budget(GROWING, stats, trace.budgets[k + 1]))   # the size in use
    assert 0 not in trace.budgets                                # no AR steps, so no re-test read first
    assert trace.budgets == wanted[:len(trace.budgets)]


def test_a_retest_is_read_before_the_next_choice():
    """A tree after AR steps (a re-test) has no round to queue behind: the next budget is chosen
    from its record, so a re-test that fails costs one tree round, not two."""
    model = reference_model()
    prompt = golden.default_prompt("micro")
    new = 240
    expected = reference_decode.generate_ar(model, prompt, new)
    drafter = make_drafter("ngram", model, prompt, new, continuation=expected)
    table = CostTable(1.0, (1.4,) * 15)                           # trees, AR steps, re-tests
    _, trace = reference_decode.generate_ddtree(model, prompt, new, drafter, budget="auto",
                                                cost_table=table)
    budgets, stats = trace.budgets, [AcceptanceStats.empty(table.max_budget, 8)]
    for round_, budget in zip(trace.rounds, budgets, strict=True):
        stats.append(stats[-1].observe_round(budget, round_.accepted))   # stats[i]: before round i
    retests = [i for i in range(1, len(budgets) - 1) if budgets[i] and not budgets[i - 1]]
    assert retests and any(budgets[i + 1] == 0 for i in retests)        # one tree round, then AR
    for i in retests:
        assert budgets[i + 1] == choose_budget(table, stats[i + 1], budgets[i])   # its record read


def test_statistics_carried_to_the_next_generation():
    """A server keeps ``trace.acceptance`` across requests: the next generation starts from it, its
    first choice is the policy's on those statistics, and it is still AR bit for bit."""
    model = reference_model()
    prompt = golden.default_prompt("micro")
    expected = reference_decode.generate_ar(model, prompt, NEW)
    # the n-gram drafter on a random model: its trees at three AR steps never pay, but look as if
    # they might until they have run
    for drafter_name, table in (("noisy", GROWING), ("ngram", DEAR)):
        drafter = make_drafter(drafter_name, model, prompt, NEW, continuation=expected)
        _, first = reference_decode.generate_ddtree(model, prompt, NEW, drafter, budget="auto",
                                                    cost_table=table)
        # every round observed, the last ones too (each observes budget 0 and up)
        assert first.acceptance.counts[0] == len(first.rounds)
        tokens, second = reference_decode.generate_ddtree(model, prompt, NEW, drafter, budget="auto",
                                                          cost_table=table, acceptance=first.acceptance)
        assert_exact(tokens, expected, name=f"{drafter_name}, carried statistics")
        assert second.budgets[:2] == [choose_budget(table, first.acceptance)] * 2
        assert sum(second.acceptance.counts) > sum(first.acceptance.counts)   # they go on growing
    assert first.budgets[:2] != [0, 0] and second.budgets[:2] == [0, 0]   # the never-paying tree: once


def test_bad_carried_statistics_are_refused_by_name():
    model = reference_model()
    prompt = golden.default_prompt("micro")
    drafter = make_drafter("ngram", model, prompt, 4)
    good = AcceptanceStats.empty(GROWING.max_budget, 8)
    refused = [(good.counts, "acceptance must be a ddtree.budget.AcceptanceStats"),
               (AcceptanceStats.empty(GROWING.max_budget, 4), "block_size 4"),
               (AcceptanceStats.empty(7, 8), "budgets 0..7, but the cost table's are 0..15")]
    for acceptance, message in refused:
        with pytest.raises(ValueError, match=message):
            reference_decode.generate_ddtree(model, prompt, 4, drafter, budget="auto", cost_table=GROWING,
                                             acceptance=acceptance)
    with pytest.raises(ValueError, match="acceptance= is read by budget='auto' only, got budget=4"):
        reference_decode.generate_ddtree(model, prompt, 4, drafter, budget=4, acceptance=good)


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
    steps = []
    launch = model.launch_ar_steps
    monkeypatch.setattr(model, "launch_ar_steps", lambda cache, context, count: steps.append(count) or launch(
        cache, context, count))
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
    assert sum(steps) == trace.budgets.count(0)                   # every budget-0 round an AR step
    if drafter_name == "ngram":
        assert 0 in trace.budgets and len(steps) < trace.budgets.count(0)   # in runs, read once each
    if drafter_name == "oracle":
        assert any(pending is not None for pending in queued)    # unchanged budgets stay queued
    assert model.unread == 0


def test_a_change_of_tree_size_is_queued_and_the_engine_stays_the_reference(monkeypatch):
    """The round after a change of size is launched before the record of the one in flight is read,
    in its own shape (``Transformer.queue_round``'s shape): the same tokens, budgets and rounds."""
    from kernels import decode as engine_decode
    from tests.test_engine import assert_same_round, engine

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt, new = golden.default_prompt("micro")[:2], 12
    expected = reference_decode.generate_ar(ref, prompt, new)
    shapes = []
    queue_round = model.queue_round
    monkeypatch.setattr(model, "queue_round", lambda cache, pending, shape=None: shapes.append(
        (shape, queue_round(cache, pending, shape))) or shapes[-1][1])
    table = CostTable(1.0, tuple(1.0 + 0.1 * b for b in range(1, 8)))
    options = dict(block_size=3, budget="auto", cost_table=table)
    drafter = make_drafter("noisy", ref, prompt, new, continuation=expected, seed=29)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    wanted_tokens, wanted = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert trace.budgets == wanted.budgets == [2, 2, 2, 4, 4, 4]     # trees of 2, then of 4
    for actual_round, wanted_round in zip(trace.rounds, wanted.rounds, strict=True):
        assert_same_round(actual_round, wanted_round)
    changed = [pending for shape, pending in shapes if shape is not None]
    assert changed and all(pending is not None and pending.key[4] == 4 for pending in changed)
    assert model.unread == 0
    # the last round too, with fewer tokens left than a block: a full block's shape, no graph of its own
    run, keys = model.graphs.run, []
    monkeypatch.setattr(model.graphs, "run", lambda key, sequence: keys.append(key) or run(key, sequence))
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new - 1, drafter, **options)
    assert_exact(tokens, expected[:new - 1])
    assert trace.rounds[-1].committed < trace.rounds[-1].accepted.size      # cut at the request's end
    assert {key[2] for key in keys if key[0] == "round"} == {2}                          # depths L = 2


def test_the_engine_goes_from_a_run_of_ar_steps_back_to_a_tree_as_the_reference(monkeypatch):
    """A re-test after a run of AR steps: launched behind the run, from the context and root the AR
    steps left on the device, and the tokens, budgets and records stay the reference's."""
    from kernels import decode as engine_decode
    from tests.test_engine import assert_same_round, engine

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt = golden.default_prompt("micro")[:2]
    new = 40
    expected = reference_decode.generate_ar(ref, prompt, new)
    table = CostTable(1.0, (1.12,) * 7)          # trees, AR steps, a re-test, trees again
    options = dict(block_size=3, budget="auto", cost_table=table)
    drafter = make_drafter("ngram", ref, prompt, new, continuation=expected)
    behind, start_round_after = [], model.start_round_after
    monkeypatch.setattr(model, "start_round_after", lambda *args: behind.append(start_round_after(*args)) or
                        behind[-1])
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    assert behind and all(pending is not None for pending in behind)   # each re-test behind its AR run
    _, wanted = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert trace.budgets == wanted.budgets and trace.acceptance == wanted.acceptance
    pairs = zip(trace.budgets[:-1], trace.budgets[1:], strict=True)
    assert any(a == 0 and b > 0 for a, b in pairs)                # AR steps, then a tree
    for actual_round, wanted_round in zip(trace.rounds, wanted.rounds, strict=True):
        assert_same_round(actual_round, wanted_round)


def test_a_run_of_ar_steps_to_the_request_s_end_is_observed_as_in_the_reference():
    """The engine plans its last run of AR steps (``plan_ar_run``) as the reference's loop runs its
    last rounds: each observed, to the request's end (a block is cut by the last position only)."""
    from kernels import decode as engine_decode
    from tests.test_engine import engine

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt, new = golden.default_prompt("micro")[:2], 10
    expected = reference_decode.generate_ar(ref, prompt, new)
    table = CostTable(1.0, (3.0,) * 7)                            # no tree pays: AR steps to the end
    options = dict(block_size=3, budget="auto", cost_table=table)
    drafter = make_drafter("ngram", ref, prompt, new, continuation=expected)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, new, drafter, **options)
    _, wanted = reference_decode.generate_ddtree(ref, prompt, new, drafter, **options)
    assert_exact(tokens, expected)
    assert trace.budgets == wanted.budgets and trace.budgets[-3:] == [0, 0, 0]
    assert trace.acceptance == wanted.acceptance and wanted.acceptance.counts[0] == len(wanted.rounds)


def test_the_engine_carries_statistics_as_the_reference():
    from kernels import decode as engine_decode
    from tests.test_engine import engine

    model, ref = engine("micro", max_tree_nodes=8), reference_model()
    prompt = golden.default_prompt("micro")[:2]
    expected = reference_decode.generate_ar(ref, prompt, ENGINE_NEW)
    drafter = make_drafter("noisy", ref, prompt, ENGINE_NEW, continuation=expected, seed=29)
    options = dict(block_size=3, budget="auto", cost_table=SMALL)
    _, first = reference_decode.generate_ddtree(ref, prompt, ENGINE_NEW, drafter, **options)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, ENGINE_NEW, drafter,
                                                  acceptance=first.acceptance, **options)
    _, wanted = reference_decode.generate_ddtree(ref, prompt, ENGINE_NEW, drafter,
                                                 acceptance=first.acceptance, **options)
    assert_exact(tokens, expected)
    assert trace.budgets == wanted.budgets and trace.acceptance == wanted.acceptance
    with pytest.raises(ValueError, match="block_size 8"):
        engine_decode.generate_ddtree(model, prompt, ENGINE_NEW, drafter, block_size=3, budget="auto",
                                      acceptance=AcceptanceStats.empty(7, 8))
    assert model.cost_table is None                               # refused before any table


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
    steps = []
    launch = model.launch_ar_steps
    monkeypatch.setattr(model, "launch_ar_steps", lambda cache, context, count: steps.append(count) or launch(
        cache, context, count))
    table = engine_decode.measure_cost_table(model, prompt, drafter, block_size=2, max_budget=2, repeats=1,
                                             rounds=(1, 2))
    assert table.max_budget == 2 and model.forward_count == forwards and model.unread == 0
    assert np.isfinite(table.switch) and table.switch >= 0
    assert steps == [1, 1, 2]                                     # the AR step: runs of AR steps
    with pytest.raises(ValueError, match=r"rounds must be two round counts 1 <= few < many, got \(2, 2\)"):
        engine_decode.measure_cost_table(model, prompt, drafter, block_size=2, rounds=(2, 2))
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
    assert np.isfinite(table.switch) and table.switch > 0          # a run's first launch and last wait
    save_cost_table(table, tmp_path / "costs.json")
    expected = reference_decode.generate_ar(ref, prompt, 16)
    drafter = make_drafter("noisy", ref, prompt, 16, continuation=expected)
    tokens, trace = engine_decode.generate_ddtree(model, prompt, 16, drafter,
                                                  cost_table=load_cost_table(tmp_path / "costs.json"))
    assert_exact(tokens, expected)
