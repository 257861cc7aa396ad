"""Budget sweeps for the DDTree chapters (11 and the generation page): chain against tree.

``budget_sweep`` runs whole generations at each budget and returns the mean tokens committed per
verify forward; every generation is asserted equal to AR, so a sweep is also a test of the
invariant. ``plot_sweep`` draws one drafter's chain and tree curves on one axes.
"""

from __future__ import annotations

import numpy as np

from ddtree.decode import generate_ddtree

CHAIN, TREE = "chain", "tree"
TOPK = {CHAIN: 1, TREE: None}          # topk=1: a single chain (the DFlash-style baseline)


def budget_sweep(model, prompt, ar_tokens, drafters, budgets, block_size: int, shape: str) -> list[float]:
    """Tokens per verify forward at each budget, averaged over ``drafters`` (e.g. seeds of one kind).

    ``shape`` is 'chain' or 'tree'. Every generation must emit ``ar_tokens``.
    """
    means = []
    for budget in budgets:
        per_drafter = []
        for drafter in drafters:
            tokens, trace = generate_ddtree(model, prompt, len(ar_tokens), drafter, block_size=block_size,
                                            budget=budget, topk=TOPK[shape])
            assert np.array_equal(tokens, ar_tokens), f"{shape}, budget {budget}: DDTree != AR"
            per_drafter.append(trace.tokens_per_forward)
        means.append(float(np.mean(per_drafter)))
    return means


def plot_sweep(ax, budgets, chain: list[float], tree: list[float], block_size: int, title: str) -> None:
    """One drafter: tokens per verify forward against the budget, chain and tree."""
    ax.plot(budgets, tree, label="tree", color="#e6550d", marker="o")
    ax.plot(budgets, chain, label="chain (topk=1)", color="#444444", marker="s", ls="--", mfc="none",
            ms=8, zorder=3)                       # on top: where the two agree, the chain shows
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.axhline(block_size, color="#555555", ls=":", lw=1, label=f"ceiling: block size {block_size}")
    ax.set_ylim(0, block_size + 0.6)
    ax.set_ylabel("tokens per\nverify forward")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.9))
