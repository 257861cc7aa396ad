"""Greedy decoding on the device engine: the numba.cuda twin of ``ddtree/decode.py``.

Legend: L draft depths (block_size - 1), V vocab, K candidates per depth, B node budget,
N tree nodes (root included), m accepted nodes (root included).

The same two decoders, the same checks, the same trace types; what differs is where the work happens. AR: the
prompt is one forward (``prefill``), then every step replays one captured graph that reads the previous token
on the device and writes the next one there: the host waits only once, at the end, to copy the tokens back.
DDTree: per round, one graph runs the drafter's kernels (``kernels.drafters``, reading the committed tokens
the engine keeps on the device), top-K, tree build, the verify forward, argmax, accept and compaction, and one
copy brings back the round's record (m, the bonus, the accepted path and the tree): the round's only
synchronisation, since the host decides the next round's block from the committed count. A drafter the device
cannot run (any but the reference's own, or ``device_drafters=False``) runs on the host, as in the reference,
and its (L, V) logits cross the bus once per round.
"""

from __future__ import annotations

import time

import numpy as np

from ddtree.budget import CostTable, check_acceptance, choose_budget
from ddtree.decode import (
    DEFAULT_BUDGET,
    DDTreeTrace,
    RoundTrace,
    auto_budget,
    candidates_per_depth,
    check_block_size,
    check_ddtree_options,
    check_draft,
    check_drafter,
    check_prompt,
    commit,
    keeps_forward_count_on_error,
    largest_tree,
    observe,
    plan_ar_run,
    retest,
    round_block,
)
from ddtree.sampling import check_sampling_seed, check_temperature
from ddtree.tree import check_budget
from kernels.device import SIMULATOR

__all__ = ["DEFAULT_BUDGET", "DDTreeTrace", "RoundTrace", "ddtree_round", "generate_ar", "generate_ddtree",
           "measure_cost_table"]


# --8<-- [start:generate_ar]
@keeps_forward_count_on_error
def generate_ar(model, prompt, max_new_tokens: int, return_logits: bool = False,
                temperature: float = 0.0, seed: int = 0):
    """AR decoding on the engine; the same tokens as ``ddtree.decode.generate_ar``.

    With ``return_logits`` every step's logits are copied back too (a synchronisation per step).
    At ``temperature`` > 0 the token at position p is drawn with the numbers of (``seed``, p).
    """
    prompt = check_prompt(model, prompt, max_new_tokens)
    temperature, seed = check_temperature(temperature), check_sampling_seed(seed)
    if max_new_tokens == 0:
        return (np.zeros(0, np.int64), np.zeros((0, model.config.vocab_size), np.float32)) \
            if return_logits else np.zeros(0, np.int64)
    cache = model.new_cache(prompt.size + max_new_tokens)
    model.set_sampling(temperature, seed)
    logits = model.prefill(cache, prompt, emit_token=True, return_logits=return_logits)
    step_logits = [logits[-1]] if return_logits else []
    for _ in range(max_new_tokens - 1):
        model.ar_step(cache)                                        # token in, token out, on the device
        if return_logits:
            step_logits.append(model.graphs.download(model.buffers.logits[0]))
    tokens = model.graphs.download(model.buffers.generated, max_new_tokens)   # the one wait
    return (tokens, np.stack(step_logits)) if return_logits else tokens
# --8<-- [end:generate_ar]


# --8<-- [start:ddtree_round]
def ddtree_round(model, cache, context, drafter, block_size, budget, topk, verifier="node") -> RoundTrace:
    """One round from the root ``context[-1]`` (committed, not yet cached) at slot cache.length;
    ``verifier="rejection"`` (at temperature > 0): the sampled tree, as in the reference."""
    return finish_round(model, cache, start_round(model, cache, context, drafter, block_size, budget, topk,
                                                  verifier))


def start_round(model, cache, context, drafter, block_size, budget, topk, verifier="node"):
    """The round's host part before the device's: the draft, on the host unless the drafter's
    kernels run in the round; then the round's launch (``Transformer.start_round``)."""
    vocab = model.config.vocab_size
    depths = block_size - 1
    if not (verifier == "rejection" and model.sampling) and model.drafts_on_device(drafter):
        draft = None                           # its kernels draft inside the round, on the device
    else:
        draft = check_draft(drafter.propose(context, block_size), depths, vocab, drafter)  # [L, V] host
    k = candidates_per_depth(budget, topk, vocab)                                  # K
    return model.start_round(cache, context, draft, k, budget, verifier, depths=depths)


def finish_round(model, cache, pending) -> RoundTrace:
    """A launched round's record, read back and committed on the host, as a RoundTrace."""
    start, accepted, bonus, tokens, parents, node_depths = model.finish_round(cache, pending)
    return RoundTrace(start, tokens, parents, node_depths, accepted, bonus, int(accepted.size))
# --8<-- [end:ddtree_round]


# --8<-- [start:generate_ddtree]
@keeps_forward_count_on_error
def generate_ddtree(model, prompt, max_new_tokens: int, drafter, block_size: int = 8,
                    budget: int | str | None = None, topk: int | None = None, temperature: float = 0.0,
                    seed: int = 0, verifier: str = "node", cost_table=None, acceptance=None):
    """Speculative decoding with draft trees on the engine. Returns (new tokens, DDTreeTrace).

    The tokens equal ``generate_ar``'s with the same ``temperature`` and ``seed`` for any drafter,
    bit for bit: every row of a verify forward is computed exactly as the AR step at its position
    would compute it, and draws its token with that position's numbers. ``verifier="rejection"``:
    the reference's sampled tree (children redrawn from the drafter, recursive rejection
    sampling), equal to AR in distribution, and to the reference's rejection run token for token.

    ``budget``: an integer, or ``"auto"`` (``ddtree.budget``: the budget of the most tokens per second, 0 when
    no tree beats an AR step) with the cost table ``cost_table`` or, without one, ``model.cost_table``; on a
    GPU an ``"auto"`` without either times one at warm-up (``measure_cost_table``, kept in
    ``model.cost_table``); in the simulator it is refused, since simulated seconds say nothing. None
    (the default): ``"auto"`` when a table is at hand, else ``DEFAULT_BUDGET``, the fixed budget the engine
    has always run, so a call without a table behaves as it did and equals the reference's default. Queued
    rounds stay queued: the next round's budget is chosen from the records already read, those of the rounds
    before the one in flight, so a choice lags a round (the reference's loop lags alike: the same budgets);
    a tree of another size is queued in its own shape (``Transformer.queue_round``), and only a change to AR
    steps waits for the read. A run of budget-0 rounds (no tree pays) runs as AR steps back to back, read once
    (``plan_ar_run`` knows its length beforehand): the records of root-only rounds without a round's
    build, compaction and record copy each; a re-test after it is launched behind it, from the context
    the steps leave on the device (``Transformer.start_round_after``). ``acceptance``: the statistics to
    start from (another generation's ``trace.acceptance``), as in the reference.
    """
    if acceptance is not None:                      # refused before a table is timed
        check_acceptance(acceptance, block_size)
    budget, cost_table = engine_budget(model, prompt, drafter, block_size, budget, topk, temperature, seed,
                                       cost_table)
    prompt = check_ddtree_options(model, prompt, max_new_tokens, block_size, budget, topk, temperature,
                                  seed, verifier, cost_table)
    check_drafter(drafter, model.config.vocab_size)
    budget, table, stats = auto_budget(budget, cost_table, block_size, acceptance)
    tree_rows = largest_tree(block_size, budget if table is None else table.max_budget, topk,
                             model.config.vocab_size)
    cache = model.new_cache(prompt.size + max_new_tokens + tree_rows - 1)
    model.set_sampling(temperature, seed)
    trace = DDTreeTrace(rounds=[], prefill_forwards=0, verify_forwards=0)
    if prompt.size > 1:
        model.prefill(cache, prompt[:-1], emit_token=False)
        trace.prefill_forwards = 1
    context = np.empty(prompt.size + max_new_tokens, np.int64)   # the prompt, then the new tokens
    context[:prompt.size] = prompt                                # committed so far: context[:length]
    length = prompt.size                                          # (a view of it per round: no copy)
    pending = None                                                # a round launched, not yet read
    # auto's budget-0 rounds run as AR steps (the sampled tree's root-only round draws otherwise)
    ar_runs = table is not None and not (verifier == "rejection" and model.sampling)
    unwritten = []                    # the records of a run of AR steps, written once the next round runs
    while length < context.size:
        if ar_runs and budget == 0 and pending is None:
            steps, budget, stats = plan_ar_run(model, table, stats, length, context.size, block_size)
            write_ar_run(trace, unwritten)
            run = model.launch_ar_steps(cache, context[:length], steps)    # budget-0 rounds as AR steps
            if budget and length + steps < context.size and model.drafts_on_device(drafter):
                pending = model.start_round_after(    # the re-test behind them, from the device's context
                    cache, run, candidates_per_depth(budget, topk, model.config.vocab_size), budget,
                    round_block(model, length + steps, block_size) - 1)
            unwritten = ar_run(model, run, context, length)
            length += steps
            trace.verify_forwards += steps
            continue
        block = round_block(model, length, block_size)
        if pending is None:
            pending = start_round(model, cache, context[:length], drafter, block, budget, topk, verifier)
        unwritten = write_ar_run(trace, unwritten)                # while the device runs the round
        # the next round's budget, from the records read so far (those before the round in flight);
        # after a re-test, from its record: nothing is queued behind it
        reading = table is not None and retest(stats, budget)
        upcoming = budget if table is None or reading else choose_budget(table, stats, budget)
        following, room = None, length + block + block_size <= context.size
        if room and not reading and (upcoming == budget or upcoming > 0):
            shape = None if upcoming == budget else (   # another tree size: queued too, in its shape
                upcoming, candidates_per_depth(upcoming, topk, model.config.vocab_size), block_size - 1)
            following = model.queue_round(cache, pending, shape)  # whatever this round commits
        record = finish_round(model, cache, pending)
        pending = following
        record, length = commit(context, length, record)
        trace.rounds.append(record)
        trace.budgets.append(budget)
        trace.verify_forwards += 1
        if table is not None:
            observed = observe(stats, budget, record, block == block_size)
            budget, stats = choose_budget(table, observed, budget) if reading else upcoming, observed
    write_ar_run(trace, unwritten)
    trace.acceptance = stats
    return context[prompt.size:].copy(), trace
# --8<-- [end:generate_ddtree]


def ar_run(model, run, context, length: int) -> list:
    """The tokens of ``run``, budget-0 rounds launched as AR steps from the root ``context[length - 1]``
    (``Transformer.launch_ar_steps``), read into ``context``; returns what their records are made of
    (``write_ar_run``)."""
    steps = run.count
    context[length:length + steps] = model.collect_ar_steps(run)
    return [(run.start, context[length - 1:length + steps].copy())]  # [steps + 1] the root, then the tokens


def write_ar_run(trace, unwritten: list) -> list:
    """Append the records of the runs ``ar_run`` returned to ``trace`` (what root-only rounds record;
    views and shared read-only arrays, no array built per record); returns an empty list. The loop
    writes them once the next round is launched: the device runs it meanwhile."""
    for start, tokens in unwritten:
        roots = read_only(tokens[:-1])                  # [steps] each step's input: the one before
        trace.rounds.extend(RoundTrace(start + i, roots[i:i + 1], ROOT_PARENTS, ROOT_ONLY, ROOT_ONLY,
                                       token, 1) for i, token in enumerate(tokens[1:].tolist()))
        trace.budgets.extend([0] * roots.size)
    return []


def read_only(values) -> np.ndarray:
    """A read-only copy of ``values``."""
    copy = np.array(values)
    copy.flags.writeable = False
    return copy


ROOT_PARENTS = read_only([-1])      # a root-only round's parents
ROOT_ONLY = read_only([0])          # ... its depths, and its accepted path: the root


def engine_budget(model, prompt, drafter, block_size, budget, topk, temperature, seed, cost_table):
    """(budget, cost_table) for a call: None becomes ``"auto"`` when a table is at hand (given, or
    ``model.cost_table``), else ``DEFAULT_BUDGET``; ``"auto"`` without a table times one on a GPU
    and is refused in the simulator."""
    table = cost_table if cost_table is not None else model.cost_table
    if budget is None:
        return ("auto", table) if table is not None else (DEFAULT_BUDGET, None)
    if not (isinstance(budget, str) and budget == "auto"):
        return budget, cost_table                               # checked with the other options
    if table is None:
        if SIMULATOR:
            raise ValueError("budget='auto' needs cost_table= in the CUDA simulator (a "
                             "ddtree.budget.CostTable or load_cost_table(path)): simulated seconds cannot "
                             "be timed")
        model.set_sampling(check_temperature(temperature), check_sampling_seed(seed))
        table = model.cost_table = measure_cost_table(model, check_prompt(model, prompt, 0), drafter,
                                                      check_block_size(block_size,
                                                                       model.config.max_position_embeddings),
                                                      topk)
    return "auto", table


def measure_cost_table(model, prompt, drafter, block_size: int = 8, topk: int | None = None,
                       max_budget: int | None = None, repeats: int = 3, rounds: tuple[int, int] = (2, 10)
                       ) -> CostTable:
    """Time the engine's rounds at warm-up (on a GPU: simulated seconds mean nothing), queued as a
    generation queues them: for each budget 1..``max_budget`` (default: the engine's limit), runs of
    ``rounds[0]`` and of ``rounds[1]`` rounds from ``prompt`` (``timed_rounds``; ``repeats`` of each
    after an untimed one that captures the graphs), and a round's seconds are the difference of the
    two medians over the difference of the rounds: the prefill, the first launch and the last wait
    cancel, and what remains is what a round adds to a generation. A round launched alone and waited
    for costs more than that (its launch and its record's copy are not hidden behind the round
    before), and so looks dearer next to an AR step than it is. The AR step ``budget="auto"`` falls
    back to is timed alike, from runs of AR steps. What a run adds once, beyond its rounds (the run of
    ``rounds[0]`` less its rounds' seconds), gives ``switch``: a re-test is a tree round's run of its own
    (the median budget's) that splits a run of AR steps in two (one more AR run's). ``model.forward_count``
    is left as it was."""
    limit = model.budget_limit[0]
    max_budget = limit if max_budget is None else check_budget(max_budget, limit, "the engine's limit")
    few, many = rounds
    if not (isinstance(few, int) and isinstance(many, int) and 1 <= few < many):
        raise ValueError(f"rounds must be two round counts 1 <= few < many, got {rounds!r}")
    prompt = check_prompt(model, prompt, many * block_size)
    forwards, seconds, starts = model.forward_count, [], []
    for budget in range(max_budget + 1):
        timed_rounds(model, prompt, drafter, block_size, budget, topk, few)      # captures the graphs
        times = {count: float(np.median([timed_rounds(model, prompt, drafter, block_size, budget, topk, count)
                                         for _ in range(repeats)])) for count in rounds}
        added = (times[many] - times[few]) / (many - few)
        seconds.append(added if added > 0 else times[many] / many)   # noise that large: the plain mean
        starts.append(max(0.0, times[few] - few * seconds[-1]))      # a run's first launch and last wait
    model.new_cache()
    model.forward_count = forwards
    # a re-test: a tree round's run of one between two AR runs, where there was one
    return CostTable(seconds[0], seconds[1:], switch=starts[0] + float(np.median(starts[1:])))


def timed_rounds(model, prompt, drafter, block_size: int, budget: int, topk: int | None, count: int) -> float:
    """Seconds of ``count`` rounds of ``budget`` after ``prompt`` (budget 0: AR steps,
    ``Transformer.ar_steps``), queued as ``generate_ddtree`` queues them, from a fresh cache: from
    after the prefill to the last round's record on the host."""
    cache = model.new_cache()
    if prompt.size > 1:
        model.prefill(cache, prompt[:-1], emit_token=False)
    context = np.empty(prompt.size + count * block_size, np.int64)    # the prompt, then the new tokens
    context[:prompt.size] = prompt
    length = prompt.size
    model.graphs.synchronize()
    begin = time.perf_counter()
    if budget == 0:
        model.ar_steps(cache, prompt, count)
        return time.perf_counter() - begin
    pending = start_round(model, cache, context[:length], drafter, block_size, budget, topk)
    for done in range(1, count + 1):
        following = model.queue_round(cache, pending) if done < count else None
        _, length = commit(context, length, finish_round(model, cache, pending))
        pending = following
        if pending is None and done < count:
            pending = start_round(model, cache, context[:length], drafter, block_size, budget, topk)
    return time.perf_counter() - begin
