"""The cost-aware tree size (``budget="auto"``): which budget B to verify next, from what a round
costs and what it has been measured to commit.

Legend (docs/glossary.md): B node budget, L draft depths (block_size - 1).

A bigger tree commits more tokens a round, but its verify costs more: on a mixture of experts a
tree wakes more experts, so a round of a few nodes can cost several AR steps. The rule is Cascade's
(arXiv 2506.20675): a tree of budget B pays when its *utility*, tokens per second of its rounds
over tokens per second of AR steps, is above one::

    utility(B) = estimate(B) * ar_step / verify(B)

where ``verify(B)`` is the seconds of a round of budget B (``CostTable``) and ``estimate(B)`` the
tokens such a round has been measured to commit (``AcceptanceStats``; not the drafter's own
log-probs, which are miscalibrated). ``choose_budget`` returns the budget of the highest utility
(ties: the smaller), or 0 when none is above one: budget 0 is a root-only tree, one forward of
one row that commits the target's own next token, an AR step.

Estimates. A round of budget B also says what every smaller budget would have committed: the
tree of B' < B drafted nodes is the first B' nodes of B's tree (the builder pops best-first, and a
node comes after its parent), so B''s accepted path is the part of B's with node indices <= B'
(``AcceptanceStats.observe_round``). A round therefore adds one observation to every budget up to
its own. A budget's estimate is the mean of its observations with the guess "every draft accepted"
counted as ``PRIOR_ROUNDS`` of a round: one unlucky round does not condemn a size. The guess has a
price: with a drafter that never hits, a tree of r AR steps' time keeps paying on paper for about
``PRIOR_ROUNDS`` (block_size - r) / (r - 1) rounds of its own size. So that this price is not paid
again at every size above it, a size observed less often than a smaller one (fewer rounds were that
big) is held to at most the smaller one's estimate plus the observed curve's rise per node
(``rising``) for each node more (``held_to_better_observed``): the guess lifts the less observed
size more, and without the bound each size that two rounds of a bigger tree had observed stayed
ahead of its better measured neighbour below, so such a drafter ran a round or two at each size in
turn. One never observed borrows from the nearest budgets that have been: between two, the straight
line; below the smallest, the smallest's (an upper bound: a smaller tree commits no more); past the
largest, the straight line on from it through the upper half of the observed sizes (``rising``: from
the largest observed budget at most half the largest, or from budget 0's one token; the
observations' means, without the guess, which lifts a larger budget more). The curve of tokens
against tree size is concave, since the builder adds nodes by falling path probability, each worth
less than the ones before, so that line is an upper bound too: a bigger tree is tried once when even
its bound pays best, and its round turns the bound into a measurement, for it and every size below
it. Nothing observed yet: the most a round can commit. Every estimate is at most B + 1 (B accepted
drafts and the bonus) and at most block_size. So the first round tries the size that would pay best
if every draft were accepted, and the next rounds walk down from there to the size that pays for
this drafter.

Re-testing. While no tree pays, the decoder takes AR steps, and a drafter that starts paying
(another kind of text) would never be seen again. So every ``retest_after`` AR steps in a row the
best tree runs once more; its round updates its estimate (and ends the run of AR steps), and the
decoders read it before the next choice (``ddtree.decode.retest``: nothing is queued behind it). The
number of steps is chosen so that a re-test's extra time, ``verify(B) + switch - estimate(B) *
ar_step`` over the AR steps its tokens would have taken, is at most ``explore_share`` of the time of
the AR steps before it: exploring costs at most that share of an AR run. ``switch`` is what a round
costs beyond ``verify(B)`` when it runs between two runs of AR steps: nothing hides its launch and
its record's read behind the round before, and it splits the AR run in two, which adds a run's start
and end. Priced without it, a tree that almost pays (its extra seconds near zero) would be re-tested
every few steps, each re-test costing far more than its share.

Keeping a size. Near the best, several sizes promise about the same, and their estimates (and the
bound of a size not yet tried) move with every round: the argmax alone would trade places on noise.
So a tree size in use that still pays is kept unless another promises ``CHANGE_MARGIN`` more tokens
per second (in the engine a change stays queued, but a size's first round captures its graph: a
wait).

The policy is a pure function of (``CostTable``, ``AcceptanceStats``, the size in use): no clock,
no randomness, so the reference and the engine choose alike for the same table and the same
records, and a run with a given table is reproducible. The statistics are plain counts and sums,
updated with ``observe`` from each finished round's committed count.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import math

import numpy as np

from ddtree.tree import check_budget

# a re-test costs at most 0.5% of the AR steps' time before it: the first trees of a generation from
# empty statistics already cost a drafter that never hits more than that
EXPLORE_SHARE = 0.005
PRIOR_ROUNDS = 0.5          # the guess "every draft accepted" weighs half a round in each estimate
CHANGE_MARGIN = 0.1         # another tree size must promise 10% more tokens per second than the one in use


# --8<-- [start:CostTable]
@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds of one AR step (the round a decoder falls back to: budget 0, a root-only tree) and
    of a round at each budget B = 1, 2, ..., len(verify): ``verify[B - 1]``, each as a round adds
    them to a run of its kind. ``switch``: the seconds a tree round adds beyond that when it runs
    alone between two runs of AR steps (a re-test; module docstring). The largest budget the table
    knows is the largest ``budget="auto"`` may choose."""
    ar_step: float
    verify: tuple[float, ...]
    switch: float = 0.0

    def __post_init__(self):
        if not is_seconds(self.ar_step):
            raise ValueError(f"CostTable.ar_step must be a finite number of seconds > 0, "
                             f"got {self.ar_step!r}")
        try:
            verify = tuple(self.verify)
        except TypeError:
            raise ValueError(f"CostTable.verify must be a sequence of seconds (budgets 1, 2, ...), "
                             f"got {self.verify!r}") from None
        if not verify:
            raise ValueError("CostTable.verify must list at least budget 1's seconds, got none")
        bad = [b for b, seconds in enumerate(verify, start=1) if not is_seconds(seconds)]
        if bad:
            raise ValueError(f"CostTable.verify must hold finite seconds > 0, got {verify[bad[0] - 1]!r} "
                             f"at budget {bad[0]}")
        if not is_seconds(self.switch, zero_too=True):
            raise ValueError(f"CostTable.switch must be a finite number of seconds >= 0, got {self.switch!r}")
        object.__setattr__(self, "ar_step", float(self.ar_step))
        object.__setattr__(self, "switch", float(self.switch))
        object.__setattr__(self, "verify", tuple(float(s) for s in verify))

    @property
    def max_budget(self) -> int:
        return len(self.verify)

    def seconds(self, budget: int) -> float:
        """Seconds of a round of ``budget`` drafted nodes (0: the AR step)."""
        return self.ar_step if budget == 0 else self.verify[budget - 1]
# --8<-- [end:CostTable]


def is_seconds(value, zero_too: bool = False) -> bool:
    """A finite number of seconds > 0 (``zero_too``: >= 0), not a bool."""
    number = isinstance(value, (int, float, np.integer, np.floating)) \
        and not isinstance(value, (bool, np.bool_))
    return number and math.isfinite(value) and (value > 0 or zero_too and value == 0)


def check_cost_table(cost_table, limit: int | None = None, limit_is: str = "") -> CostTable:
    """A ``CostTable`` (or a dict in the file's format) whose largest budget the decoder can run."""
    if isinstance(cost_table, dict):
        cost_table = cost_table_from_dict(cost_table)
    if not isinstance(cost_table, CostTable):
        raise ValueError(f"cost_table must be a ddtree.budget.CostTable (or its dict, "
                         f"{{'ar_step': s, 'verify': [s, ...]}}), got {type(cost_table).__name__}")
    if limit is not None and cost_table.max_budget > limit:
        raise ValueError(f"cost_table lists budgets up to {cost_table.max_budget}, more than this decoder "
                         f"runs: {limit} ({limit_is})")
    return cost_table


# --8<-- [start:file_format]
# A cost table's file: JSON, one object {"ar_step": seconds, "verify": [seconds of budget 1,
# budget 2, ...], "switch": seconds (optional, default 0)}, and any other keys as notes (what was
# timed, where: "device", "preset", ...).
def cost_table_from_dict(data: dict) -> CostTable:
    missing = [key for key in ("ar_step", "verify") if key not in data]
    if missing:
        raise ValueError(f"cost_table must have the keys 'ar_step' and 'verify', missing {missing}")
    return CostTable(data["ar_step"], data["verify"], data.get("switch", 0.0))


def load_cost_table(path) -> CostTable:
    """A cost table from its JSON file (the format above); errors name the file."""
    try:
        with open(path) as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cost table file {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"cost table file {path}: must hold a JSON object, got {type(data).__name__}")
    try:
        return cost_table_from_dict(data)
    except ValueError as error:
        raise ValueError(f"cost table file {path}: {error}") from None


def cost_table_to_dict(table: CostTable) -> dict:
    return {"ar_step": table.ar_step, "verify": list(table.verify), "switch": table.switch}


def save_cost_table(table: CostTable, path, **notes) -> None:
    with open(path, "w") as file:
        json.dump({**cost_table_to_dict(table), **notes}, file, indent=1)
        file.write("\n")
# --8<-- [end:file_format]


# --8<-- [start:AcceptanceStats]
@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    """What the rounds so far committed, per budget: ``counts[B]`` rounds ran at budget B and
    committed ``sums[B]`` tokens together (B = 0..max_budget); ``ar_run`` AR steps (budget 0)
    in a row since the last tree; ``block_size`` the most a round commits (L + 1)."""
    block_size: int
    counts: tuple[int, ...]
    sums: tuple[int, ...]
    ar_run: int = 0

    @classmethod
    def empty(cls, max_budget: int, block_size: int) -> AcceptanceStats:
        return cls(block_size, (0,) * (max_budget + 1), (0,) * (max_budget + 1))

    def observe(self, budget: int, committed: int, times: int = 1) -> AcceptanceStats:
        """The statistics after ``times`` observations alike (one by default): a round of ``budget``
        committed ``committed`` tokens (an AR step: budget 0, one token)."""
        counts, sums = list(self.counts), list(self.sums)
        counts[budget] += times
        sums[budget] += committed * times
        return AcceptanceStats(self.block_size, tuple(counts), tuple(sums),
                               self.ar_run + times if budget == 0 else 0)

    def observe_round(self, budget: int, accepted) -> AcceptanceStats:
        """The statistics after a round of ``budget`` whose accepted path is the node indices
        ``accepted`` (root first, ascending): an observation for every budget b <= ``budget``, which
        would have committed the path's nodes <= b and the bonus."""
        path = set(np.asarray(accepted)[1:].tolist())               # drafted nodes on the path
        counts, sums, kept = list(self.counts), list(self.sums), 0
        for b in range(budget + 1):                   # one pass: the policy's host time per round
            kept += b in path                         # the path's nodes <= b
            counts[b] += 1
            sums[b] += 1 + kept
        return AcceptanceStats(self.block_size, tuple(counts), tuple(sums),
                               self.ar_run + 1 if budget == 0 else 0)
# --8<-- [end:AcceptanceStats]


# --8<-- [start:estimate]
@functools.lru_cache(maxsize=8)
def estimates(stats: AcceptanceStats) -> tuple[float, ...]:
    """Tokens a round of each budget 0..max_budget is expected to commit: its observations' mean
    with the guess ``cap`` as ``PRIOR_ROUNDS`` of a round, or borrowed from the nearest observed
    budgets, each observed budget then held to its better observed neighbour below (module
    docstring); at most cap = min(budget + 1, block_size). Kept for the last few statistics, since
    a decoder that has just chosen AR steps asks again when it plans their run, while the device
    waits."""
    tokens = unheld_estimates(stats)
    tried = [b for b in range(1, len(stats.counts)) if stats.counts[b]]
    return (1.0, *held_to_better_observed(stats, tried, tokens[1:])) if tried else tokens


def unheld_estimates(stats: AcceptanceStats) -> tuple[float, ...]:
    """``estimates`` before ``held_to_better_observed``, in one pass: the policy asks for every
    budget each round."""
    size, counts, sums = len(stats.counts), stats.counts, stats.sums
    few = min(size, stats.block_size)
    caps = list(range(1, few + 1)) + [stats.block_size] * (size - few)     # [B + 1] min(b + 1, block_size)
    tried = [b for b in range(1, size) if counts[b]]
    if not tried:                                             # nothing measured: every draft accepted
        return (1.0, *caps[1:])
    mean = {b: (sums[b] + PRIOR_ROUNDS * caps[b]) / (counts[b] + PRIOR_ROUNDS) for b in tried}
    first, last = tried[0], tried[-1]
    guesses = [1.0] + [mean[first]] * (first - 1)             # budget 0, an AR step: one token; below the
    for lo, hi in itertools.pairwise(tried):                  # smallest its mean; between two, the line
        low, rise, width = mean[lo], mean[hi] - mean[lo], hi - lo
        guesses += [low] + [low + rise * (b - lo) / width for b in range(lo + 1, hi)]
    slope = rising(stats, tried)                              # past the largest: the bounding line
    guesses += [mean[last] + slope * (b - last) for b in range(last, size)]
    capped = [guess if guess <= cap else cap for guess, cap in zip(guesses, caps, strict=True)]   # min()
    return (1.0, *capped[1:])


def held_to_better_observed(stats: AcceptanceStats, tried: list[int], tokens: list[float]) -> list[float]:
    """``tokens`` (budgets 1..max_budget) with each observed budget b held to at most a's estimate
    plus the observed rise per node up to a (``rising``) times b - a, where a is the largest
    smaller observed budget with more observations (module docstring). One pass: a stack of the
    observed budgets whose counts fall, each the nearest with a larger count of the ones after it."""
    counts, held, above, rises = stats.counts, list(tokens), [], {}   # above: indices into tried
    for i, b in enumerate(tried):
        count = counts[b]
        while above and counts[tried[above[-1]]] <= count:
            above.pop()
        if above:
            j = above[-1]
            a = tried[j]
            if j not in rises:                                    # many sizes share one neighbour
                rises[j] = rising(stats, tried, j)
            line = held[a - 1] + rises[j] * (b - a)
            if line < held[b - 1]:                                # min(), as ``estimates``
                held[b - 1] = line
        above.append(i)
    return held


def rising(stats: AcceptanceStats, tried: list[int], top_index: int = -1) -> float:
    """Tokens per node of the observed curve's upper half, from the observations alone (the guess
    would tilt it: it lifts a larger budget more): from the largest observed budget at most half the
    largest (budget 0, one token, if none) to the largest, ``tried[top_index]``; never below 0."""
    top = tried[top_index]
    below = bisect.bisect_right(tried, top // 2)                  # tried is ascending
    low = tried[below - 1] if below else 0
    mean_low = stats.sums[low] / stats.counts[low] if low else 1.0
    return max(0.0, (stats.sums[top] / stats.counts[top] - mean_low) / (top - low))


def estimate(stats: AcceptanceStats, budget: int) -> float:
    """Tokens a round of ``budget`` is expected to commit (``estimates``)."""
    return estimates(stats)[budget]
# --8<-- [end:estimate]


# --8<-- [start:choose_budget]
@functools.lru_cache(maxsize=8)
def utilities(table: CostTable, stats: AcceptanceStats) -> tuple[float, ...]:
    """Tokens per second of rounds of each budget 0..max_budget over those of AR steps (Cascade's
    utility; budget 0's is one); kept for the last few (table, statistics) as ``estimates``."""
    seconds = (table.ar_step, *table.verify)                  # [B + 1] table.seconds(b)
    return tuple(tokens * table.ar_step / cost                # the budgets both know
                 for tokens, cost in zip(estimates(stats), seconds, strict=False))


def utility(table: CostTable, stats: AcceptanceStats, budget: int) -> float:
    return utilities(table, stats)[budget]


def best_tree(table: CostTable, stats: AcceptanceStats) -> int:
    """The budget >= 1 of the highest utility (the smaller among equals)."""
    return best_of(utilities(table, stats))


def best_of(scores: list[float]) -> int:
    return max(range(1, len(scores)), key=scores.__getitem__)   # the first of equals


def retest_after(table: CostTable, stats: AcceptanceStats, budget: int,
                 explore_share: float = EXPLORE_SHARE) -> int:
    """AR steps in a row before the tree of ``budget`` is tried again: enough that the re-test's
    extra seconds (its switch between AR runs included) are at most ``explore_share`` of theirs."""
    rounds = stats.counts[budget]
    measured = stats.sums[budget] / rounds if rounds else estimate(stats, budget)
    extra = table.seconds(budget) + table.switch - measured * table.ar_step
    return max(1, math.ceil(extra / (explore_share * table.ar_step)))


def choose_budget(table: CostTable, stats: AcceptanceStats, current: int = 0,
                  explore_share: float = EXPLORE_SHARE) -> int:
    """The next round's budget after a round of ``current`` (the one in flight): the best tree if
    its utility is above one, else 0 (an AR step), except that every ``retest_after`` AR steps in a
    row the best tree runs once more; a tree in use that still pays is kept unless the best beats
    it by ``CHANGE_MARGIN`` (module docstring)."""
    return choice_by_ar_run(table, stats, current, explore_share)(stats.ar_run)


def choice_by_ar_run(table: CostTable, stats: AcceptanceStats, current: int = 0,
                     explore_share: float = EXPLORE_SHARE):
    """``choose_budget`` of ``stats`` with any number of AR steps observed after them, as a function
    of their ``ar_run``: an AR step changes no tree's statistics, so the best tree, its utility and
    its re-test period stay as they are (a decoder plans a run of AR steps with it)."""
    scores = utilities(table, stats)
    best = best_of(scores)
    in_use = 0 < current < len(scores) and scores[current] > 1
    if in_use and scores[best] <= scores[current] * (1 + CHANGE_MARGIN):
        best = current                                       # within the margin: noise
    if scores[best] > 1:
        return lambda ar_run: best
    every = retest_after(table, stats, best, explore_share)
    return lambda ar_run: best if ar_run and ar_run % every == 0 else 0
# --8<-- [end:choose_budget]


def check_acceptance(acceptance, block_size: int, max_budget: int | None = None) -> AcceptanceStats:
    """Statistics a generation starts from (another's ``trace.acceptance``: a server keeps them
    across requests, so a drafter that never pays costs its first rounds once, not per request):
    an ``AcceptanceStats`` of this ``block_size`` and, where known, of the table's budgets."""
    if not isinstance(acceptance, AcceptanceStats):
        raise ValueError(f"acceptance must be a ddtree.budget.AcceptanceStats (a trace's .acceptance), "
                         f"got {type(acceptance).__name__}")
    if acceptance.block_size != block_size:
        raise ValueError(f"acceptance holds statistics of block_size {acceptance.block_size}, "
                         f"but this call's block_size is {block_size}")
    if max_budget is not None and len(acceptance.counts) != max_budget + 1:
        raise ValueError(f"acceptance holds budgets 0..{len(acceptance.counts) - 1}, but the cost table's "
                         f"are 0..{max_budget}")
    return acceptance


def check_auto(budget, cost_table, limit: int, limit_is: str):
    """A decoder's (budget, cost_table) pair: an integer budget without a table (``check_budget``),
    or ``"auto"`` with one. Returns (budget, table or None)."""
    if isinstance(budget, str):
        if budget != "auto":
            raise ValueError(f"budget must be an integer or 'auto', got {budget!r}")
        if cost_table is None:
            raise ValueError("budget='auto' needs cost_table= (a ddtree.budget.CostTable, or "
                             "load_cost_table(path)): the seconds of an AR step and of a round per budget")
        return "auto", check_cost_table(cost_table, limit, limit_is)
    if cost_table is not None:
        raise ValueError(f"cost_table is used only with budget='auto', got budget={budget!r}")
    return check_budget(budget, limit, limit_is), None
