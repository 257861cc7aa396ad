"""Chapter 11: the DDTree loop, a whole generation round by round, and what the budget buys.

``generate_ddtree`` prefills the prompt minus its last token, then repeats ``ddtree_round``: draft
(L = block_size - 1 distributions), build the tree (best-first, at most ``budget`` nodes), verify it
in ONE target forward (ancestor mask, positions start + depth), accept (greedy walk + bonus token),
compact the KV cache. Each round commits between 1 and block_size tokens, always the target's own
greedy tokens: DDTree == AR == golden, whatever the drafter.

This chapter prints every round of one generation (preset tiny, golden prompt, 24 tokens, block 8,
budget 32, noisy oracle; the generation page draws each round), then sweeps the budget (1..64)
for a single chain (topk=1, the DFlash-style baseline) against a tree, for each drafter; every run
is asserted equal to AR. Last, the same loop runs with the tree operations on the numba kernels.

Run: .venv/bin/python walkthrough/11_ddtree_loop.py

Writes docs/assets/figures/11_ddtree_loop_budget_sweep.png and 11_ddtree_loop_report.txt (what it
prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from sweep import CHAIN, TREE, budget_sweep, plot_sweep

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.accept
import kernels.kv_cache
import kernels.tree
from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import DRAFTERS, make_drafter
from kernels.device import SIMULATOR

STEM = "11_ddtree_loop"
NEW_TOKENS, BLOCK_SIZE, BUDGET = 24, 8, 32
BUDGETS = (1, 2, 4, 8, 16, 32, 64)
NOISY_SEEDS = (0, 1)             # the noisy oracle's mistakes are seeded: average over seeds


def sibling_rank(parents: np.ndarray, node: int) -> int:
    """A node's rank among its siblings: siblings pop in rank order, so count the earlier ones."""
    return int(np.sum(parents[:node] == parents[node]))


def one_generation(setup) -> None:
    """AR, then DDTree with the noisy oracle; one short line per round."""
    model, prompt = setup.model, setup.prompt
    ar_tokens = generate_ar(model, prompt, NEW_TOKENS)
    assert np.array_equal(ar_tokens, setup.ar_tokens), "AR must reproduce the golden bundle"
    print(f"AR: {NEW_TOKENS} tokens in {NEW_TOKENS} forwards (1 prefill + {NEW_TOKENS - 1} decodes), "
          f"== golden: True")
    drafter = make_drafter("noisy", model, prompt, NEW_TOKENS)
    model.forward_count = 0
    tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=BLOCK_SIZE, budget=BUDGET)
    assert np.array_equal(tokens, ar_tokens)
    print(f"DDTree (noisy, block {BLOCK_SIZE}, budget {BUDGET}): {trace.prefill_forwards} prefill + "
          f"{trace.verify_forwards} verify = {model.forward_count} forwards, == AR: True")
    print(f"  {trace.tokens_per_forward:.2f} tokens per verify forward")
    with chapter.section("rounds"):
        print(f"{'round':>5} {'start':>5} {'nodes':>5} {'per depth':<23} {'accepted nodes, ranks':<31} "
              f"{'bonus':>5} {'commits':>7}")
        for i, r in enumerate(trace.rounds):
            ranks = [sibling_rank(r.parents, int(node)) for node in r.accepted[1:]]
            per_depth = str(np.bincount(r.depths)[1:].tolist())
            path = f"{r.accepted.tolist()} {ranks}"
            print(f"{i:>5} {r.start:>5} {r.tokens.size - 1:>5} {per_depth:<23} {path:<31} "
                  f"{r.bonus:>5} {r.committed:>7}")


def sweep(setup) -> dict:
    """Mean tokens per verify forward for every (drafter, chain or tree, budget); asserts == AR."""
    results = {}
    for name in DRAFTERS:
        seeds = NOISY_SEEDS if name == "noisy" else (0,)
        drafters = [make_drafter(name, setup.model, setup.prompt, NEW_TOKENS, seed=s) for s in seeds]
        for shape in (CHAIN, TREE):
            results[name, shape] = budget_sweep(setup.model, setup.prompt, setup.ar_tokens, drafters,
                                                BUDGETS, BLOCK_SIZE, shape)
    runs = sum(len(NOISY_SEEDS) if name == "noisy" else 1 for name in DRAFTERS) * 2 * len(BUDGETS)
    with chapter.section("sweep"):
        print(f"tokens per verify forward ({runs} generations, every one == AR; "
              f"noisy: mean of seeds {list(NOISY_SEEDS)}):")
        print(f"  {'drafter':<7} {'shape':<5} " + " ".join(f"{f'B={b}':>6}" for b in BUDGETS))
        for (name, shape), means in results.items():
            print(f"  {name:<7} {shape:<5} " + " ".join(f"{m:>6.2f}" for m in means))
    return results


def check_sweep(results) -> None:
    """The claims the page makes about the sweep, asserted so that they cannot go stale."""
    from_block = BUDGETS.index(BLOCK_SIZE)
    for name in DRAFTERS:
        chain = results[name, CHAIN]
        assert len(set(chain[from_block:])) == 1, f"{name}: a chain cannot grow past L nodes"
    assert results["oracle", CHAIN] == results["oracle", TREE], "the oracle's tree is its chain"
    assert results["noisy", TREE][-1] > max(results["noisy", CHAIN]), "trees pay off for the noisy oracle"
    assert max(results["ngram", CHAIN]) == 1.0, "the n-gram chain never hits on this model"


def draw_sweep(results) -> None:
    fig, axes = plt.subplots(len(DRAFTERS), 1, figsize=(8, 8.4), sharex=True)
    for ax, name in zip(axes, DRAFTERS, strict=True):
        seeds = f", mean of {len(NOISY_SEEDS)} seeds" if name == "noisy" else ""
        plot_sweep(ax, BUDGETS, results[name, CHAIN], results[name, TREE], BLOCK_SIZE, f"{name}{seeds}")
    axes[-1].set_xlabel("node budget B")
    fig.suptitle(f"Budget sweep: preset tiny, golden prompt, {NEW_TOKENS} tokens, block {BLOCK_SIZE}",
                 fontsize=11)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "budget_sweep")


# --8<-- [start:numba_tree_ops]
TREE_TWINS = {"build_tree": kernels.tree.build_tree, "visibility": kernels.tree.visibility,
              "accept": kernels.accept.accept, "compact": kernels.kv_cache.compact}


def numba_tree_ops(setup, new_tokens: int, budget: int) -> None:
    """The same loop with build_tree, visibility, accept and compact on the numba kernels."""
    drafter = make_drafter("noisy", setup.model, setup.prompt, new_tokens)
    with chapter.record_ops(setup.model, replace=TREE_TWINS), chapter.timed("numba tree ops"):
        tokens, trace = generate_ddtree(setup.model, setup.prompt, new_tokens, drafter,
                                        block_size=BLOCK_SIZE, budget=budget)
    same = np.array_equal(tokens, setup.ar_tokens[:new_tokens])
    print(f"numba tree ops ({'CUDA simulator' if SIMULATOR else 'GPU'}; the forward stays numpy):")
    print(f"  {new_tokens} tokens, budget {budget}, {trace.verify_forwards} rounds, committed "
          f"{[r.committed for r in trace.rounds]}: DDTree == AR: {same}")
    assert same
# --8<-- [end:numba_tree_ops]


def main() -> None:
    """One generation round by round, the budget sweep, the tree ops on the numba kernels."""
    setup = chapter.golden_model("tiny")
    one_generation(setup)
    print()
    with chapter.timed("budget sweep"):
        results = sweep(setup)
    check_sweep(results)
    draw_sweep(results)
    numba_tree_ops(setup, new_tokens=8, budget=8)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
