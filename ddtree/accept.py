"""Acceptance: walk the draft tree along the target's own choices.

Legend (docs/glossary.md): N tree nodes (root included), m accepted nodes (root included).

``posterior[i]`` is the target's choice after the path root..i: its argmax (greedy), its
position-keyed sample (temperature > 0) or the outcome of rejection sampling at that node
(``ddtree.sampling``). Starting at the root, move to the child that carries the target's choice
while there is one; siblings carry distinct tokens, so there is at most one. The last choice is
the bonus token: every committed token is the one plain AR decoding would have produced.
"""

from __future__ import annotations

import numpy as np

from ddtree.tree import DraftTree


def check_siblings(parents: np.ndarray, tokens: np.ndarray, name: str = "tree") -> None:
    """Siblings carry distinct tokens (else two children could match the target's choice)."""
    edges = np.stack([parents[1:], tokens[1:]], axis=1)                       # [n, 2] (parent, token)
    if np.unique(edges, axis=0).shape[0] != edges.shape[0]:
        raise ValueError(f"{name}: siblings must carry distinct tokens")


def check_posterior(tree: DraftTree, posterior_tokens) -> np.ndarray:
    posterior = np.asarray(posterior_tokens)
    if posterior.shape != (tree.size,) or not np.issubdtype(posterior.dtype, np.integer):
        raise ValueError(f"posterior_tokens must be a 1-D integer array of length tree.size "
                         f"({tree.size}), got {posterior.dtype} {posterior.shape}")
    return posterior.astype(np.int64)


# --8<-- [start:accept]
def accept(tree: DraftTree, posterior_tokens: np.ndarray):
    """Returns (accepted node indices (m,) int64 starting with 0, bonus token int)."""
    posterior = check_posterior(tree, posterior_tokens)                       # [N]
    check_siblings(tree.parents, tree.tokens)
    accepted = [0]
    token = posterior[0]                                                      # target choice after the root
    while True:
        children = tree.children(accepted[-1])                                # [c] in rank order
        match = children[tree.tokens[children] == token]                      # at most one
        if match.size == 0:
            break
        accepted.append(int(match[0]))
        token = posterior[match[0]]
    return np.array(accepted, dtype=np.int64), int(token)
# --8<-- [end:accept]
