"""Greedy decoding on the device engine: the numba.cuda twin of ``ddtree/decode.py``.

Legend: L draft depths (block_size - 1), V vocab, K candidates per depth, B node budget,
N tree nodes (root included), m accepted nodes (root included).

The same two decoders, the same checks, the same trace types; what differs is where the work
happens. AR: the prompt is one forward (``prefill``), then every step replays one captured graph
that reads the previous token on the device and writes the next one there: the host waits only
once, at the end, to copy the tokens back. DDTree: per round, one graph runs the drafter's
kernels (``kernels.drafters``, reading the committed tokens the engine keeps on the device),
top-K, tree build, the verify forward, argmax, accept and compaction, and one copy brings back the
round's record (m, the bonus, the accepted path and the tree): the round's only synchronisation,
since the host decides the next round's block from the committed count. A drafter the device
cannot run (any but the reference's own, or ``device_drafters=False``) runs on the host, as in
the reference, and its (L, V) logits cross the bus once per round.
"""

from __future__ import annotations

import numpy as np

from ddtree.decode import (
    DEFAULT_BUDGET,
    DDTreeTrace,
    RoundTrace,
    candidates_per_depth,
    check_ddtree_options,
    check_draft,
    check_drafter,
    check_prompt,
    keeps_forward_count_on_error,
    largest_tree,
)
from ddtree.sampling import check_sampling_seed, check_temperature

__all__ = ["DEFAULT_BUDGET", "DDTreeTrace", "RoundTrace", "ddtree_round", "generate_ar", "generate_ddtree"]


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
    tokens = model.graphs.download(model.buffers.generated[:max_new_tokens])   # the one wait
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
                    budget: int = DEFAULT_BUDGET, topk: int | None = None, temperature: float = 0.0,
                    seed: int = 0, verifier: str = "node"):
    """Speculative decoding with draft trees on the engine. Returns (new tokens, DDTreeTrace).

    The tokens equal ``generate_ar``'s with the same ``temperature`` and ``seed`` for any drafter,
    bit for bit: every row of a verify forward is computed exactly as the AR step at its position
    would compute it, and draws its token with that position's numbers. ``verifier="rejection"``:
    the reference's sampled tree (children redrawn from the drafter, recursive rejection
    sampling), equal to AR in distribution, and to the reference's rejection run token for token.
    """
    prompt = check_ddtree_options(model, prompt, max_new_tokens, block_size, budget, topk, temperature,
                                  seed, verifier)
    check_drafter(drafter, model.config.vocab_size)
    tree_rows = largest_tree(block_size, budget, topk, model.config.vocab_size)
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
    while length < context.size:
        block = min(block_size, context.size - length)
        if pending is None:
            pending = start_round(model, cache, context[:length], drafter, block, budget, topk, verifier)
        following = None
        if length + block + block_size <= context.size:           # the next block is block_size
            following = model.queue_round(cache, pending)         # whatever this round commits
        record = finish_round(model, cache, pending)
        pending = following
        new = [int(t) for t in record.tokens[record.accepted[1:]]] + [record.bonus]
        context[length:length + len(new)] = new
        length += len(new)
        trace.rounds.append(record)
        trace.verify_forwards += 1
    return context[prompt.size:].copy(), trace
# --8<-- [end:generate_ddtree]
