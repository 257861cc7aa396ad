"""Greedy decoding: plain autoregressive (AR), and DDTree speculative decoding.

Both emit exactly the target's greedy tokens; DDTree needs fewer target forwards.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddtree.tree import top_candidates


def check_prompt(model, prompt, max_new_tokens: int) -> np.ndarray:
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt must be a non-empty 1-D integer array, got shape {prompt.shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    limit = model.config.max_position_embeddings
    if prompt.size + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.size}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({limit})")
    return prompt.astype(np.int64)


# --8<-- [start:generate_ar]
def generate_ar(model, prompt, max_new_tokens: int, return_logits: bool = False):
    """Greedy AR decoding: prefill the prompt, then one decode forward per new token.

    Returns the new tokens (int64); with ``return_logits`` also the logits that chose each.
    ``model.forward_count`` counts the target forwards (1 prefill + max_new_tokens - 1 decodes).
    """
    prompt = check_prompt(model, prompt, max_new_tokens)
    tokens, step_logits = [], []
    if max_new_tokens == 0:
        return (np.zeros(0, np.int64), np.zeros((0, model.config.vocab_size), np.float32)) \
            if return_logits else np.zeros(0, np.int64)
    cache = model.new_cache(prompt.size + max_new_tokens)
    logits = model.forward(cache, prompt)[-1]                   # [V] next-token logits
    while True:
        token = int(model.ops.argmax(logits[None])[0])
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


def check_ddtree_options(model, prompt, max_new_tokens, block_size, budget, topk):
    prompt = check_prompt(model, prompt, max_new_tokens)
    limit = model.config.max_position_embeddings
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if block_size > limit:
        raise ValueError(f"block_size ({block_size}) exceeds max_position_embeddings ({limit})")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget must be an integer, got {budget!r}")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, (int, np.integer))
                             or topk < 1):
        raise ValueError(f"topk must be None or an integer >= 1, got {topk!r}")
    return prompt


def check_draft(logits, depths: int, vocab: int) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.shape != (depths, vocab):
        raise ValueError(f"drafter logits must have shape ({depths}, {vocab}), got {logits.shape}")
    if depths and np.isnan(logits).any():
        raise ValueError("drafter logits contain NaN")
    return logits.astype(np.float32)


# --8<-- [start:ddtree_round]
def ddtree_round(model, cache, context, drafter, block_size, budget, topk) -> RoundTrace:
    """One round from the root ``context[-1]`` (committed, not yet cached) at slot cache.length."""
    ops, vocab = model.ops, model.config.vocab_size
    start, root = cache.length, int(context[-1])
    depths = block_size - 1
    draft = check_draft(drafter.propose(context, block_size), depths, vocab)       # [L, V]
    k = min(vocab, max(budget, 1) if topk is None else topk)                       # K=min(B, V) loses nothing
    top_logprobs, top_ids = top_candidates(draft, k)                               # [L, K] each
    tree = ops.build_tree(root, top_logprobs, top_ids, budget)
    cache.reserve(tree.size)                                                       # fail before writing
    visible = ops.visibility(tree.parents)                                         # [n+1, n+1]
    logits = model.forward(cache, tree.tokens, positions=start + tree.depths, visible=visible)
    posterior = ops.argmax(logits)                                                 # [n+1]
    accepted, bonus = ops.accept(tree, posterior)
    ops.compact(cache, start, accepted)                                            # keep the path
    return RoundTrace(start, tree.tokens, tree.parents, tree.depths, np.asarray(accepted),
                      int(bonus), int(len(accepted)))
# --8<-- [end:ddtree_round]


# --8<-- [start:generate_ddtree]
def generate_ddtree(model, prompt, max_new_tokens: int, drafter, block_size: int = 8,
                    budget: int = DEFAULT_BUDGET, topk: int | None = None):
    """Speculative greedy decoding with draft trees. Returns (new tokens, DDTreeTrace).

    The tokens equal ``generate_ar``'s for any drafter. The prompt minus its last token is
    prefilled; the last prompt token is the first round's root. Each round verifies a tree of at
    most ``budget`` drafted nodes (``topk=1``: a single chain, the DFlash-style baseline) and
    commits the accepted drafts plus the bonus token: at most ``block_size`` tokens per forward.
    """
    prompt = check_ddtree_options(model, prompt, max_new_tokens, block_size, budget, topk)
    cache = model.new_cache(prompt.size + max_new_tokens + max(budget, 0) + 1)
    trace = DDTreeTrace(rounds=[], prefill_forwards=0, verify_forwards=0)
    if prompt.size > 1:
        model.forward(cache, prompt[:-1])
        trace.prefill_forwards = 1
    context = list(prompt)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        # never draft past the request: the round commits at most depths + 1 tokens
        block = min(block_size, max_new_tokens - len(generated))
        record = ddtree_round(model, cache, np.array(context), drafter, block, budget, topk)
        new = [int(t) for t in record.tokens[record.accepted[1:]]] + [record.bonus]
        context += new
        generated += new
        trace.rounds.append(record)
        trace.verify_forwards += 1
    return np.array(generated, dtype=np.int64), trace
# --8<-- [end:generate_ddtree]
