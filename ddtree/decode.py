"""Decoding: plain autoregressive (AR), and DDTree speculative decoding, greedy or sampled.

Legend (docs/glossary.md): V vocab_size, L draft depths (block_size - 1), K candidates per
depth, B node budget, N tree nodes (root included), m accepted nodes (root included).

Both emit exactly the target's greedy tokens; DDTree needs fewer target forwards. At a
temperature T > 0 both sample with position-keyed random numbers (``ddtree.sampling``): the token
at position p is drawn with the numbers of (seed, p), so DDTree still emits AR's tokens, token
for token (``verifier="rejection"``: a sampled tree, equal to AR in distribution only). Every
option is checked before the first forward, and a call that raises leaves ``model.forward_count``
as it found it. ``budget="auto"`` picks each round's budget by its cost (``ddtree.budget``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ddtree.budget import (
    AcceptanceStats,
    check_acceptance,
    check_auto,
    check_cost_table,
    choice_by_ar_run,
    choose_budget,
)
from ddtree.sampling import (
    KeyedRandom,
    check_sampling_seed,
    check_temperature,
    check_verifier,
    child_tokens,
    draw_children,
    rejection_step,
    sample,
)
from ddtree.tree import top_candidates, tree_size


def is_integer(value) -> bool:
    """Python and numpy integers; not bools."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))


def check_prompt(model, prompt, max_new_tokens: int) -> np.ndarray:
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt must be a non-empty 1-D integer array, got shape {prompt.shape} "
                         f"dtype {prompt.dtype}")
    vocab = model.config.vocab_size
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ValueError(f"prompt tokens must lie in [0, vocab_size={vocab}), got min {prompt.min()} "
                         f"max {prompt.max()}")
    if not is_integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    limit = model.config.max_position_embeddings
    if prompt.size + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.size}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({limit})")
    return prompt.astype(np.int64)


def keeps_forward_count_on_error(decode):
    """A decoder whose failed calls leave ``model.forward_count`` as they found it."""
    @functools.wraps(decode)
    def counted_on_success(model, *args, **kwargs):
        forwards = model.forward_count
        try:
            return decode(model, *args, **kwargs)
        except BaseException:
            model.forward_count = forwards
            raise
    return counted_on_success


# --8<-- [start:generate_ar]
@keeps_forward_count_on_error
def generate_ar(model, prompt, max_new_tokens: int, return_logits: bool = False,
                temperature: float = 0.0, seed: int = 0):
    """AR decoding: prefill the prompt, then one decode forward per new token.

    Returns the new tokens (int64); with ``return_logits`` also the logits that chose each.
    ``model.forward_count`` counts the target forwards (1 prefill + max_new_tokens - 1 decodes).
    Greedy at ``temperature`` 0; otherwise the token at position p is ``sample``d with the
    random numbers of (``seed``, p).
    """
    prompt = check_prompt(model, prompt, max_new_tokens)
    temperature, seed = check_temperature(temperature), check_sampling_seed(seed)
    tokens, step_logits = [], []
    if max_new_tokens == 0:
        return (np.zeros(0, np.int64), np.zeros((0, model.config.vocab_size), np.float32)) \
            if return_logits else np.zeros(0, np.int64)
    cache = model.new_cache(prompt.size + max_new_tokens)
    logits = model.forward(cache, prompt)[-1]                   # [V] next-token logits
    while True:
        if temperature == 0:
            token = int(model.ops.argmax(logits[None])[0])
        else:
            token = int(sample(logits[None], [prompt.size + len(tokens)], temperature, seed)[0])
        tokens.append(token)
        step_logits.append(logits)
        if len(tokens) == max_new_tokens:
            break
        logits = model.forward(cache, np.array([token]))[0]     # [V]
    tokens = np.array(tokens, dtype=np.int64)
    return (tokens, np.stack(step_logits)) if return_logits else tokens
# --8<-- [end:generate_ar]


# ----------------------------------------------------------------------------------------------
# DDTree: draft, build the tree, verify it in one forward, accept, compact.

DEFAULT_BUDGET = 32
# the reference verifies a tree in one forward whose mask and attention scores grow as B (P + B):
# its limit is what host memory holds comfortably (four times the largest budget DDTree is run at)
MAX_BUDGET = 4096


def budget_limit(model) -> tuple[int, str]:
    """The largest budget ``model`` verifies and what that limit is: the model's own
    ``budget_limit`` (the engine's: its buffers' rows), else the reference's MAX_BUDGET."""
    return getattr(model, "budget_limit", (MAX_BUDGET, "MAX_BUDGET of the reference decoder"))


@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One DDTree round: the tree (pop order), the accepted walk and what it committed."""
    start: int                 # cache slot (= position) of the root
    tokens: np.ndarray         # [n+1] tree tokens, root first
    parents: np.ndarray        # [n+1] parents[0] = -1
    depths: np.ndarray         # [n+1]
    accepted: np.ndarray       # [m] accepted node indices, starting with 0
    bonus: int                 # the target's token after the accepted path
    committed: int             # new tokens this round: m - 1 accepted drafts + the bonus


@dataclasses.dataclass
class DDTreeTrace:
    rounds: list[RoundTrace]
    prefill_forwards: int      # 1 if the prompt had more than its root token, else 0
    verify_forwards: int       # one per round
    budgets: list[int] = dataclasses.field(default_factory=list)   # each round's budget B
    acceptance: AcceptanceStats | None = None   # budget="auto": the statistics after every round

    @property
    def committed_tokens(self) -> int:
        return sum(r.committed for r in self.rounds)

    @property
    def tokens_per_forward(self) -> float:
        """Mean committed tokens per verify forward."""
        return self.committed_tokens / max(self.verify_forwards, 1)

    @property
    def accepted_lengths(self) -> np.ndarray:
        """Accepted drafted tokens per round (root excluded)."""
        return np.array([r.accepted.size - 1 for r in self.rounds], dtype=np.int64)


def describe_round(record: RoundTrace, index: int, words=None) -> list[str]:
    """One round as text, in the words ``python -m ddtree demo --rounds`` and the round-by-round
    page share: a header, the tree indented by depth (one node per line: ``* `` marks the
    accepted path, ``+ `` the bonus; ``#n`` the pop order, ``rank r`` the token's rank among the
    drafter's candidates at its depth), then what the round commits. ``words`` (token ids -> one
    string each, e.g. ``ddtree.text.tokens_as_text`` with its tokenizer) adds each token's text.

    A node's children are listed in pop order, which is rank order, so a node's rank is its place
    among its siblings: the drafter's top-1 chain is the path of rank 0 nodes."""
    parents, tokens = np.asarray(record.parents), np.asarray(record.tokens)
    accepted = [int(a) for a in record.accepted]
    children = [[] for _ in parents]
    for node in range(1, parents.size):
        children[int(parents[node])].append(node)
    rank = {child: r for kids in children for r, child in enumerate(kids)}
    shown = show_tokens(words)
    lines = [f"round {index}: root {shown(tokens[0])} at position {record.start}, {parents.size - 1} drafted "
             f"nodes, depth {int(np.max(record.depths))} (* accepted, + bonus)"]
    stack = [(0, 0)]                                              # (node, depth), depth first
    while stack:
        node, depth = stack.pop()
        mark = "* " if node in accepted else "  "
        label = "root" if node == 0 else f"#{node} rank {rank[node]}"
        lines.append("  " * (depth + 1) + f"{mark}{shown(tokens[node])}  {label}")
        if node == accepted[-1]:
            lines.append("  " * (depth + 2) + f"+ {shown(record.bonus)}  bonus")
        stack += [(child, depth + 1) for child in reversed(children[node])]
    if len(accepted) == 1:
        lines.append("  nothing accepted (the path is the root alone)")
    else:
        off = [depth for depth, node in enumerate(accepted[1:], start=1) if rank[node] > 0]
        path = f"off the drafter's top-1 chain from depth {off[0]}" if off else "the drafter's top-1 chain"
        lines.append(f"  accepted nodes {' '.join(f'#{a}' for a in accepted[1:])} ({path})")
    after = "the root" if len(accepted) == 1 else f"#{accepted[-1]}"
    committed = [int(tokens[a]) for a in accepted[1:]] + [record.bonus]
    lines.append(f"  bonus {shown(record.bonus)} (the target's own token after {after}); commits "
                 f"{len(committed)} token{'s' if len(committed) > 1 else ''}: "
                 f"{' '.join(shown(token) for token in committed)}")
    return lines


def show_tokens(words=None):
    """token id -> its printed form: the id, or with ``words`` the id and its text in quotes."""
    if words is None:
        return lambda token: str(int(token))
    return lambda token: f"{int(token)} '{words([int(token)])[0]}'"


def check_block_size(block_size, limit: int) -> int:
    if not is_integer(block_size) or not 1 <= block_size <= limit:
        raise ValueError(f"block_size must be an integer >= 1 and <= max_position_embeddings ({limit}), "
                         f"got {block_size!r}")
    return int(block_size)


def check_topk(topk) -> int | None:
    if topk is not None and (not is_integer(topk) or topk < 1):
        raise ValueError(f"topk must be None or an integer >= 1, got {topk!r}")
    return None if topk is None else int(topk)


def check_drafter(drafter, vocab: int) -> None:
    """A drafter proposes (L, V) logits for this model's vocabulary (checked again per round)."""
    if not callable(getattr(drafter, "propose", None)):
        raise ValueError(f"drafter must have a propose(context_tokens, block_size) method, "
                         f"got {type(drafter).__name__}")
    drafter_vocab = getattr(drafter, "vocab_size", vocab)
    if drafter_vocab != vocab:
        raise ValueError(f"drafter vocab_size ({drafter_vocab}) must equal the model's vocab_size ({vocab})")


def check_ddtree_options(model, prompt, max_new_tokens, block_size, budget, topk, temperature=0.0,
                         seed=0, verifier="node", cost_table=None):
    prompt = check_prompt(model, prompt, max_new_tokens)
    check_block_size(block_size, model.config.max_position_embeddings)
    check_auto(budget, cost_table, *budget_limit(model))
    check_topk(topk)
    check_temperature(temperature)
    check_sampling_seed(seed)
    check_verifier(verifier)
    return prompt


def candidates_per_depth(budget: int, topk: int | None, vocab: int) -> int:
    """K: ``topk``, or min(B, V) (all a budget of B could pop at one depth), at least 1."""
    return min(vocab, max(budget, 1) if topk is None else topk)


def largest_tree(block_size: int, budget: int, topk: int | None, vocab: int) -> int:
    """N of the largest tree a round can build (``ddtree.tree.tree_size``): the root + min(B, K +
    K^2 + ... + K^L) drafted nodes (each node has at most K children, the tree at most L levels)."""
    return tree_size(block_size - 1, candidates_per_depth(budget, topk, vocab), budget)


def check_draft(logits, depths: int, vocab: int, drafter=None) -> np.ndarray:
    """What ``drafter.propose`` returned, as float32 (L, V) logits; an error names the drafter."""
    who = f"{type(drafter).__name__}.propose" if drafter is not None else "the drafter"
    expected = f"real-valued (float) drafter logits of shape ({depths}, {vocab}) (L, V)"
    try:
        logits = np.asarray(logits)
    except ValueError as error:                                   # ragged nested lists
        raise ValueError(f"{who} must return {expected}, got a ragged sequence ({error})") from None
    if logits.dtype == np.bool_ or not (np.issubdtype(logits.dtype, np.floating)
                                        or np.issubdtype(logits.dtype, np.integer)):
        raise ValueError(f"{who} must return {expected}, got dtype {logits.dtype} shape {logits.shape}")
    if logits.shape != (depths, vocab):
        raise ValueError(f"{who} must return {expected}, got shape {logits.shape}")
    if depths and np.isnan(logits).any():
        raise ValueError(f"{who} returned drafter logits that contain NaN")
    return logits.astype(np.float32)


def auto_budget(budget, cost_table, block_size: int, acceptance=None):
    """(first budget, table, statistics): a fixed budget as given, with no table; ``"auto"``: the
    first choice from ``acceptance`` (``check_acceptance``) or empty statistics, the table and those
    statistics."""
    if not isinstance(budget, str):                 # check_auto let no other string through
        if acceptance is not None:
            raise ValueError(f"acceptance= is read by budget='auto' only, got budget={budget!r}")
        return budget, None, None
    table = check_cost_table(cost_table)
    stats = (AcceptanceStats.empty(table.max_budget, block_size) if acceptance is None
             else check_acceptance(acceptance, block_size, table.max_budget))
    return choose_budget(table, stats), table, stats


def round_block(model, length: int, block_size: int) -> int:
    """The block of the round rooted at ``length`` committed tokens: ``block_size``, also where the
    request ends sooner (the tokens past its end are dropped, so every round of a budget has one
    shape: one CUDA graph in the engine), unless its deepest node would pass the model's last
    position (depth d sits at position length - 1 + d)."""
    return min(block_size, model.config.max_position_embeddings - length + 1)


def commit(context, length: int, record: RoundTrace) -> tuple[RoundTrace, int]:
    """Append a round's accepted drafts and its bonus to ``context`` (committed so far:
    ``context[:length]``), up to the request's end; returns the record, its ``committed`` cut to
    what was appended, and the new length."""
    new = [int(t) for t in record.tokens[record.accepted[1:]]] + [record.bonus]
    new = new[:context.size - length]                      # past the request's end: dropped
    context[length:length + len(new)] = new
    if len(new) < record.committed:
        record = dataclasses.replace(record, committed=len(new))
    return record, length + len(new)


def observe(stats: AcceptanceStats, budget: int, record: RoundTrace, full_block: bool) -> AcceptanceStats:
    """The statistics after ``record``, a round of ``budget`` (an observation for every budget up to
    it: ``AcceptanceStats.observe_round``, from its accepted path, whole where the request ended in
    it); one cut short by the model's last position (not ``full_block``) is left out: its count says
    where the positions end, not what the drafter earns."""
    return stats.observe_round(budget, record.accepted) if full_block else stats


def retest(stats: AcceptanceStats, budget: int) -> bool:
    """Whether a round of ``budget`` after the rounds of ``stats`` is a tree after AR steps (a
    re-test): the engine launches it alone, so the next budget is chosen after its record is read,
    not from the rounds before it (a failed re-test costs one tree round, not two)."""
    return budget > 0 and stats.ar_run > 0


def plan_ar_run(model, table, stats: AcceptanceStats, length: int, end: int, block_size: int):
    """With budget 0 in hand at ``length`` committed tokens (of ``end``): how many budget-0 rounds the
    loop of ``generate_ddtree`` runs in a row from here, and its (budget, statistics) after them,
    found without running them: a budget-0 round commits one token and observes budget 0 alone
    (unless ``round_block`` cuts it at ``model``'s last position), so its observation is known before
    it runs. The engine runs such rounds as AR steps, back to back."""
    choice = choice_by_ar_run(table, stats)
    whole = whole_blocks(model, length, block_size)   # the first steps from here, those whose block is whole
    steps, budget = 0, 0
    while budget == 0 and length + steps < end:       # integers only: the device waits for this plan
        budget = choice(stats.ar_run + min(steps, whole))
        steps += 1
    return steps, budget, stats.observe(0, 1, times=min(steps, whole))


def whole_blocks(model, length: int, block_size: int) -> int:
    """How many rounds rooted at ``length``, ``length + 1``, ... committed tokens in a row have
    ``round_block``'s whole ``block_size``: those before the deepest node would pass the last position."""
    return max(0, model.config.max_position_embeddings + 2 - block_size - length)


# --8<-- [start:ddtree_round]
def ddtree_round(model, cache, context, drafter, block_size, budget, topk, temperature=0.0, seed=0,
                 verifier="node") -> RoundTrace:
    """One round from the root ``context[-1]`` (committed, not yet cached) at slot cache.length.

    At ``temperature`` > 0 node i's token for position start + depth + 1 is sampled with that
    position's numbers; ``verifier="rejection"`` first redraws the children without replacement
    from the drafter and verifies them by recursive rejection sampling (``ddtree.sampling``)."""
    ops, vocab = model.ops, model.config.vocab_size
    start, root = cache.length, int(context[-1])
    depths = block_size - 1
    draft = check_draft(drafter.propose(context, block_size), depths, vocab, drafter)  # [L, V]
    top_logprobs, top_ids = top_candidates(draft, candidates_per_depth(budget, topk, vocab))  # [L, K] each
    tree = ops.build_tree(root, top_logprobs, top_ids, budget)
    rejection = verifier == "rejection" and temperature > 0
    if rejection:                                                                  # drawn children
        tree = draw_children(tree, draft, start, temperature, KeyedRandom(seed))
    cache.reserve(tree.size)                                                       # fail before writing
    visible = ops.visibility(tree.parents)                                         # [n+1, n+1]
    logits = model.forward(cache, tree.tokens, positions=start + tree.depths, visible=visible)
    outcome_positions = start + tree.depths + 1                                    # [n+1] drawn tokens' slots
    if temperature == 0:
        posterior = ops.argmax(logits)                                             # [n+1]
    elif rejection:
        posterior = rejection_step(logits, outcome_positions, child_tokens(tree), draft, tree.depths,
                                   temperature, seed)                              # [n+1]
    else:
        posterior = sample(logits, outcome_positions, temperature, seed)           # [n+1]
    accepted, bonus = ops.accept(tree, posterior)
    ops.compact(cache, start, accepted)                                            # keep the path
    return RoundTrace(start, tree.tokens, tree.parents, tree.depths, np.asarray(accepted),
                      int(bonus), int(len(accepted)))
# --8<-- [end:ddtree_round]


# --8<-- [start:generate_ddtree]
@keeps_forward_count_on_error
def generate_ddtree(model, prompt, max_new_tokens: int, drafter, block_size: int = 8,
                    budget: int | str = DEFAULT_BUDGET, topk: int | None = None, temperature: float = 0.0,
                    seed: int = 0, verifier: str = "node", cost_table=None, acceptance=None):
    """Speculative decoding with draft trees. Returns (new tokens, DDTreeTrace).

    The tokens equal ``generate_ar``'s with the same ``temperature`` and ``seed``, for any drafter
    (``verifier="rejection"``: in distribution, not token for token). The prompt minus its last
    token is prefilled; the last prompt token is the first round's root. Each round verifies a
    tree of at most ``budget`` drafted nodes (``topk=1``: a single chain, the DFlash-style
    baseline) and commits the accepted drafts plus the bonus token: at most ``block_size`` tokens
    per forward.

    ``budget="auto"`` (with ``cost_table=``, a ``ddtree.budget.CostTable``): each round's budget is
    ``ddtree.budget.choose_budget`` of the table, of what the rounds before the last one
    committed and of the last one's budget (``trace.budgets`` lists them). The one-round lag is
    the engine's: it launches the next round before it reads the last one's record, and this loop
    chooses as it does, so both choose the same budgets; after a re-test (a tree after AR steps,
    ``retest``) both read first. A round cut short by the model's last position is not counted.
    ``trace.acceptance`` holds the statistics after every round; ``acceptance=`` starts a
    generation from another's (``ddtree.budget.check_acceptance``).
    """
    prompt = check_ddtree_options(model, prompt, max_new_tokens, block_size, budget, topk, temperature,
                                  seed, verifier, cost_table)
    temperature = check_temperature(temperature)
    check_drafter(drafter, model.config.vocab_size)
    budget, table, stats = auto_budget(budget, cost_table, block_size, acceptance)
    # the cache holds the committed context (the root excluded) and one tree at a time
    tree_rows = largest_tree(block_size, budget if table is None else table.max_budget, topk,
                             model.config.vocab_size)
    cache = model.new_cache(prompt.size + max_new_tokens + tree_rows - 1)
    trace = DDTreeTrace(rounds=[], prefill_forwards=0, verify_forwards=0)
    if prompt.size > 1:
        model.forward(cache, prompt[:-1])
        trace.prefill_forwards = 1
    context = np.empty(prompt.size + max_new_tokens, np.int64)   # the prompt, then the new tokens
    context[:prompt.size] = prompt                                # committed so far: context[:length]
    length = prompt.size                                          # (a view of it per round: no copy)
    while length < context.size:
        block = round_block(model, length, block_size)
        record = ddtree_round(model, cache, context[:length], drafter, block, budget, topk, temperature,
                              seed, verifier)
        record, length = commit(context, length, record)
        trace.rounds.append(record)
        trace.budgets.append(budget)
        trace.verify_forwards += 1
        if table is not None:                 # the next budget, from the rounds before this one
            observed = observe(stats, budget, record, block == block_size)
            # a re-test (a tree after AR steps) has no round to queue behind: read before choosing
            budget, stats = choose_budget(table, observed if retest(stats, budget) else stats,
                                          budget), observed    # budget: the round in use
    trace.acceptance = stats
    return context[prompt.size:].copy(), trace
# --8<-- [end:generate_ddtree]
