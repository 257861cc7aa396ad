"""Chapter 11: the DDTree loop, a whole generation round by round, and what the budget buys.

``generate_ddtree`` prefills the prompt minus its last token, then repeats ``ddtree_round``: draft
(L = block_size - 1 distributions), build the tree (best-first, at most ``budget`` nodes), verify it
in ONE target forward (ancestor mask, positions start + depth), accept (greedy walk + bonus token),
compact the KV cache. Each round commits between 1 and block_size tokens, always the target's own
greedy tokens: DDTree == AR == golden, whatever the drafter.

This chapter draws every round of one generation (preset tiny, golden prompt, 24 tokens, block 8,
budget 32, noisy oracle), the tokens committed per round, and sweeps the budget (1..64) for a
single chain (topk=1, the DFlash-style baseline) against a tree, for each drafter; every run is
asserted equal to AR. Last, the same loop runs with the tree operations on the numba kernels.

Run: python walkthrough/11_ddtree_loop.py

Writes docs/assets/figures/11_ddtree_loop_{rounds,commits,budget_sweep}.png and
11_ddtree_loop_report.txt (what it prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from treeplot import draw_tree, tree_height

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.accept
import kernels.kv_cache
import kernels.tree
from ddtree import golden
from ddtree.config import preset
from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import DRAFTERS, make_drafter
from ddtree.model import Transformer
from ddtree.weights import init_weights
from kernels.device import SIMULATOR

STEM = "11_ddtree_loop"
NEW_TOKENS, BLOCK_SIZE, BUDGET = 24, 8, 32
BUDGETS = (1, 2, 4, 8, 16, 32, 64)
NOISY_SEEDS = (0, 1)             # the noisy oracle's mistakes are seeded: average over seeds


def sibling_rank(parents: np.ndarray, node: int) -> int:
    """A node's rank among its siblings: siblings pop in rank order, so count the earlier ones."""
    return int(np.sum(parents[:node] == parents[node]))


def draw_rounds(trace) -> None:
    """A grid of small tree plots, one per round, accepted path and bonus highlighted."""
    count = len(trace.rounds)
    columns = 3
    rows = (count + columns - 1) // columns
    tallest = max(tree_height(r) for r in trace.rounds)
    fig, axes = plt.subplots(rows, columns, figsize=(16, rows * (0.22 * tallest + 1.2)), squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index >= count:
            ax.axis("off")
            continue
        r = trace.rounds[index]
        draw_tree(ax, r, accepted=r.accepted, bonus=r.bonus, pop_order=False, fontsize=6, start=r.start,
                  title=f"round {index}: {r.tokens.size - 1} nodes, accepted {r.accepted.size - 1} "
                        f"+ bonus = {r.committed} tokens")
    fig.suptitle(f"Every round of one generation: noisy oracle, block {BLOCK_SIZE}, budget {BUDGET} "
                 f"(orange = accepted path, green = bonus token)", fontsize=11)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "rounds")


def draw_commits(trace) -> None:
    accepted = trace.accepted_lengths
    rounds = np.arange(len(trace.rounds))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    left.bar(rounds, accepted, color="#e6550d", label="accepted drafted tokens")
    left.bar(rounds, np.ones_like(accepted), bottom=accepted, color="#31a354", label="bonus token")
    left.axhline(BLOCK_SIZE, color="#555555", ls=":", lw=1, label=f"block size {BLOCK_SIZE} (the most)")
    left.set_xlabel("round (one verify forward each)")
    left.set_ylabel("tokens committed")
    left.set_xticks(rounds)
    left.legend(fontsize=8, loc="upper left")
    left.set_title("Tokens committed per step", fontsize=10)
    done = np.concatenate([[0], np.cumsum([r.committed for r in trace.rounds])])
    steps = np.arange(NEW_TOKENS + 1)
    right.plot(steps, steps, color="#777777", label="AR: one per forward")
    right.step(np.arange(done.size), done, where="post", color="#3182bd", lw=2, label="DDTree")
    right.set_xlabel("target forwards after the prefill")
    right.set_ylabel("tokens generated")
    right.set_xlim(0, NEW_TOKENS)
    right.legend(fontsize=8)
    right.set_title(f"{NEW_TOKENS} tokens: AR {NEW_TOKENS} forwards, DDTree {trace.verify_forwards}",
                    fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "commits")


def sweep(model, prompt, ar_tokens) -> dict:
    """Mean tokens per verify forward for every (drafter, chain or tree, budget); asserts == AR."""
    results = {}
    for name in DRAFTERS:
        seeds = NOISY_SEEDS if name == "noisy" else (0,)
        drafters = [make_drafter(name, model, prompt, NEW_TOKENS, seed=s) for s in seeds]
        for shape, topk in (("chain", 1), ("tree", None)):
            means = []
            for budget in BUDGETS:
                per_seed = []
                for drafter in drafters:
                    tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=BLOCK_SIZE,
                                                    budget=budget, topk=topk)
                    assert np.array_equal(tokens, ar_tokens), f"{name} {shape} budget {budget}: DDTree != AR"
                    per_seed.append(trace.tokens_per_forward)
                means.append(float(np.mean(per_seed)))
            results[name, shape] = means
    return results


def check_sweep(results) -> None:
    """The claims the page makes about the sweep, asserted so that they cannot go stale."""
    from_block = BUDGETS.index(BLOCK_SIZE)
    for name in DRAFTERS:
        chain = results[name, "chain"]
        assert len(set(chain[from_block:])) == 1, f"{name}: a chain cannot grow past L nodes"
    assert results["oracle", "chain"] == results["oracle", "tree"], "the oracle's tree is its chain"
    assert results["noisy", "tree"][-1] > max(results["noisy", "chain"]), "trees pay off for the noisy oracle"
    assert max(results["ngram", "chain"]) == 1.0, "the n-gram chain never hits on this model"


def draw_sweep(results) -> None:
    fig, axes = plt.subplots(1, len(DRAFTERS), figsize=(14, 3.8), sharey=True)
    for ax, name in zip(axes, DRAFTERS, strict=True):
        for shape, style in (("chain", dict(color="#777777", marker="s", ls="--")),
                             ("tree", dict(color="#e6550d", marker="o"))):
            ax.plot(BUDGETS, results[name, shape], label="chain (topk=1)" if shape == "chain" else "tree",
                    **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(BUDGETS)
        ax.set_xticklabels([str(b) for b in BUDGETS])
        ax.axhline(BLOCK_SIZE, color="#555555", ls=":", lw=1)
        ax.set_xlabel("node budget B")
        seeds = f", mean of {len(NOISY_SEEDS)} seeds" if name == "noisy" else ""
        ax.set_title(f"{name}{seeds}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("tokens per verify forward\n(mean acceptance length incl. bonus)")
    fig.suptitle(f"Budget sweep: preset tiny, golden prompt, {NEW_TOKENS} tokens, block {BLOCK_SIZE} "
                 f"(dotted: the ceiling, block size)", fontsize=10)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "budget_sweep")


# --8<-- [start:numba_tree_ops]
def numba_tree_ops(model, prompt, ar_tokens, new_tokens: int, budget: int) -> None:
    """The same loop with build_tree, visibility, accept and compact on the numba kernels."""
    saved = {name: getattr(model.ops, name) for name in ("build_tree", "visibility", "accept", "compact")}
    model.ops.build_tree, model.ops.visibility = kernels.tree.build_tree, kernels.tree.visibility
    model.ops.accept, model.ops.compact = kernels.accept.accept, kernels.kv_cache.compact
    try:
        drafter = make_drafter("noisy", model, prompt, new_tokens)
        with chapter.timed("numba tree ops"):
            tokens, trace = generate_ddtree(model, prompt, new_tokens, drafter, block_size=BLOCK_SIZE,
                                            budget=budget)
    finally:
        for name, op in saved.items():
            setattr(model.ops, name, op)
    same = np.array_equal(tokens, ar_tokens[:new_tokens])
    print(f"numba tree ops ({'CUDA simulator' if SIMULATOR else 'GPU'}; the forward stays numpy): "
          f"{new_tokens} tokens, budget {budget}, {trace.verify_forwards} rounds, committed "
          f"{[r.committed for r in trace.rounds]}: DDTree == AR: {same}")
    assert same
# --8<-- [end:numba_tree_ops]


def main() -> None:
    """One generation round by round, the budget sweep, the tree ops on the numba kernels."""
    config = preset("tiny")
    model = Transformer(config, init_weights(config, golden.WEIGHT_SEED))
    bundle = golden.load_bundle("tiny")
    prompt = bundle["prompt"]
    ar_tokens = generate_ar(model, prompt, NEW_TOKENS)
    assert np.array_equal(ar_tokens, bundle["tokens"]), "AR must reproduce the golden bundle"
    print(f"AR: {NEW_TOKENS} tokens in {NEW_TOKENS} forwards, == golden: True")

    drafter = make_drafter("noisy", model, prompt, NEW_TOKENS)
    model.forward_count = 0
    tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=BLOCK_SIZE, budget=BUDGET)
    assert np.array_equal(tokens, ar_tokens)
    print(f"DDTree (noisy, block {BLOCK_SIZE}, budget {BUDGET}): {trace.prefill_forwards} prefill + "
          f"{trace.verify_forwards} verify forwards (model.forward_count {model.forward_count}), "
          f"{trace.tokens_per_forward:.2f} tokens per forward, == AR: True")
    with chapter.section("rounds"):
        for i, r in enumerate(trace.rounds):
            ranks = [sibling_rank(r.parents, int(node)) for node in r.accepted[1:]]
            print(f"  round {i}: start {r.start}, {r.tokens.size - 1} nodes, per depth "
                  f"{np.bincount(r.depths)[1:].tolist()}; accepted nodes {r.accepted.tolist()} "
                  f"(ranks {ranks}), bonus {r.bonus} -> commits {r.committed}")
    draw_rounds(trace)
    draw_commits(trace)

    with chapter.timed("budget sweep"):
        results = sweep(model, prompt, ar_tokens)
    runs = sum(len(NOISY_SEEDS) if name == "noisy" else 1 for name in DRAFTERS) * 2 * len(BUDGETS)
    print()
    with chapter.section("sweep"):
        print(f"tokens per verify forward ({runs} generations, every one == AR; "
              f"noisy: mean of seeds {list(NOISY_SEEDS)}):")
        print(f"  {'drafter':<7} {'shape':<5} " + " ".join(f"{f'B={b}':>6}" for b in BUDGETS))
        for (name, shape), means in results.items():
            print(f"  {name:<7} {shape:<5} " + " ".join(f"{m:>6.2f}" for m in means))
    check_sweep(results)
    draw_sweep(results)

    numba_tree_ops(model, prompt, ar_tokens, new_tokens=8, budget=8)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
