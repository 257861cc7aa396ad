"""Chapter 7: building the draft tree, best-first, with a heap (numpy) and one thread block (numba).

A candidate is a rank tuple (r1..rd): the token top_ids[i-1, r_i] at each depth i. Its weight is
the float32 sum of its log-probs, the log of a product of the drafter's marginals. The builder
pops the B heaviest candidates; popping a node pushes its next sibling and its first child, so
each candidate has exactly one generator and the heap never holds more than B + 1 entries.

This chapter builds trees from the noisy oracle's first round (preset tiny, golden prompt,
block 8) at budgets 4, 16 and 64 and draws them with the pop order; checks on a small example
that the pops are exactly the B best candidates of the whole (K^1 + ... + K^L)-candidate space,
sorted by (-weight, rank tuple); shows the tie rule; and runs the numba builder (one block per
request) against the heap, single and batched, requiring identical trees.

Run: .venv/bin/python walkthrough/07_tree_build.py

Writes docs/assets/figures/07_tree_build_budget_{4,16,64}.png, 07_tree_build_weights.png and
07_tree_build_report.txt (what it prints).
"""

import itertools
import time

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from treeplot import ROW_INCHES, draw_tree, tree_height

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.tree as gpu
from ddtree import tree as ref
from ddtree.drafters import make_drafter
from kernels.bench.cases import tree as tree_costs
from kernels.blocks import pow2_threads
from kernels.device import SIMULATOR

STEM = "07_tree_build"
BLOCK_SIZE = 8
BUDGETS = (4, 16, 64)


def rank_tuple(tree: ref.DraftTree, node: int) -> tuple[int, ...]:
    """The candidate a node stands for: ranks along the path root..node."""
    path = []
    while node > 0:
        path.append(int(tree.ranks[node]))
        node = int(tree.parents[node])
    return tuple(reversed(path))


def brute_force_order(top_logprobs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """Every candidate up to depth L, sorted by (-weight, rank tuple), cut after ``budget``.

    Weights are float32 sums in path order, exactly as the builder forms them.
    """
    depths, k = top_logprobs.shape
    candidates = []
    for d in range(1, depths + 1):
        for ranks in itertools.product(range(k), repeat=d):
            weight = np.float32(0.0)
            for i, r in enumerate(ranks):
                weight = weight + top_logprobs[i, r]
            candidates.append((-float(weight), ranks))
    return [ranks for _, ranks in sorted(candidates)[:budget]]


def same_tree(a: ref.DraftTree, b: ref.DraftTree) -> bool:
    """Field by field, bit for bit (log-probs included)."""
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("tokens", "parents", "depths", "ranks", "logprobs"))


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def builder_cost(depths: int, budget: int, requests: int) -> None:
    """Bytes the GPU builder moves (its cost model in kernels.bench.cases.tree) and barriers it waits on."""
    moved = tree_costs.bytes_moved("build_trees", Bq=requests, L=depths, K=budget, B=budget)
    threads = pow2_threads(budget + 1)                     # about one frontier entry per thread
    per_pop = 2 + int(np.log2(threads))                    # loop top, after the scan, one per level
    print(f"  L={depths}, K=B={budget}, {requests} requests: {moved / 1e3:.1f} KB in and out, "
          f"{chapter.time_floor(moved) * 1e9:.0f} ns at the read bandwidth")
    print(f"    a block argmax per pop ({threads} threads): {budget} sequential pops x {per_pop} barriers "
          f"= {budget * per_pop}")
    print(f"    a sorted frontier (kernels.tree): one barrier per pop, {budget + 1} with the start")


def print_pops(tree: ref.DraftTree, count: int) -> None:
    print(" node parent depth rank token   weight  rank tuple")
    for n in range(count):
        print(f" {n:>4} {int(tree.parents[n]):>6} {int(tree.depths[n]):>5} {int(tree.ranks[n]):>4} "
              f"{int(tree.tokens[n]):>5} {float(tree.logprobs[n]):>8.3f}  {rank_tuple(tree, n)}")


def trees_at_budgets(logits: np.ndarray, root: int, vocab: int) -> dict[int, ref.DraftTree]:
    """Trees at several budgets, K = min(B, V) candidates per depth (as ddtree_round does)."""
    trees = {}
    for budget in BUDGETS:
        top_logprobs, top_ids = ref.top_candidates(logits, min(budget, vocab))       # [L, K]
        trees[budget] = t = ref.build_tree(root, top_logprobs, top_ids, budget)
        micros = 1e6 * min(_timed(ref.build_tree, root, top_logprobs, top_ids, budget) for _ in range(20))
        leaves = t.size - np.unique(t.parents[1:]).size
        print(f"budget {budget:>2}: {t.size - 1} nodes, depth {int(t.depths.max())}, {leaves} leaves, "
              f"nodes per depth {np.bincount(t.depths)[1:].tolist()}")
        chapter.log(f"  (numpy heap, budget {budget}: {micros:.0f} us per tree, best of 20)")
        weights = t.logprobs[1:]
        assert np.all(weights[1:] <= weights[:-1]), "pops must come out heaviest first"
        assert np.all(t.logprobs[1:] <= t.logprobs[t.parents[1:]]), "a child never outweighs its parent"
    return trees


def print_first_pops(tree: ref.DraftTree) -> None:
    with chapter.section("pops"):
        print("the first 10 pops at budget 16 (weight = float32 sum of log-probs root..node):")
        print_pops(tree, 10)
        order = {rank_tuple(tree, n): n for n in range(tree.size)}
        a, b = order[0, 1], order[1, 0]
        print(f"a tie: (0, 1) is #{a} and (1, 0) is #{b}, both weigh {float(tree.logprobs[a]):.3f}; "
              f"the smaller rank tuple pops first")
        assert tree.logprobs[a] == tree.logprobs[b] and a < b


def plot_trees(trees: dict[int, ref.DraftTree]) -> None:
    """One figure per budget (a 64-node tree needs the whole column), then the weights."""
    for budget, tree in trees.items():
        fig, ax = plt.subplots(figsize=(8, ROW_INCHES * tree_height(tree) + 1.4))
        draw_tree(ax, tree, pop_order=True, fontsize=9, top1=True,
                  title=f"budget B = {budget}: token ids, #n = pop order, purple = top-1 chain")
        fig.tight_layout()
        chapter.save_figure(fig, STEM, f"budget_{budget}")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    big = trees[BUDGETS[-1]]
    ax.step(np.arange(1, big.size), big.logprobs[1:], where="mid", color="#3182bd")
    dots = ax.scatter(np.arange(1, big.size), big.logprobs[1:], c=big.depths[1:], cmap="viridis", s=14,
                      zorder=3)
    fig.colorbar(dots, ax=ax, label="depth")
    ax.set_xlabel("pop index n")
    ax.set_ylabel("weight (log of the path's probability)")
    ax.set_title(f"Budget {BUDGETS[-1]}: weights never increase along the pop order; flat runs are "
                 "exact ties", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "weights")


def check_brute_force(logits: np.ndarray, root: int) -> None:
    """The heap pops exactly the B best candidates of the whole space (small K and L to enumerate)."""
    small_lp, small_ids = ref.top_candidates(logits[:4], 3)                        # L = 4, K = 3
    small = ref.build_tree(root, small_lp, small_ids, 20)
    expected = brute_force_order(small_lp, 20)
    got = [rank_tuple(small, n) for n in range(1, small.size)]
    print(f"\nL=4, K=3: {sum(3 ** d for d in range(1, 5))} candidates; heap's 20 pops == the 20 best "
          f"by (-weight, rank tuple): {got == expected}")
    assert got == expected


def all_ties():
    """Equal log-probs everywhere: the lexicographically smaller rank tuple pops first."""
    tie_lp = np.full((3, 2), np.log(np.float32(0.5)), np.float32)                   # L = 3, K = 2
    tie_ids = np.array([[10, 11], [20, 21], [30, 31]])
    tie = ref.build_tree(0, tie_lp, tie_ids, 8)
    print("ties (every log-prob log 0.5), pop order:")
    print(f"  {[rank_tuple(tie, n) for n in range(1, tie.size)]}")
    return tie, tie_lp, tie_ids


def check_gpu_builder(setup, logits, trees, ties) -> None:
    """The GPU builder (one block per request) must build the heap's trees, single and batched."""
    root = int(setup.prompt[-1])
    print(f"\nnumba builder ({'CUDA simulator' if SIMULATOR else 'GPU'}):")
    begin = time.perf_counter()
    for budget in BUDGETS[:2]:
        lp, ids = ref.top_candidates(logits, budget)
        print(f"  build_tree budget {budget:>2}: identical to the heap: "
              f"{same_tree(gpu.build_tree(root, lp, ids, budget), trees[budget])}")
    tie, tie_lp, tie_ids = ties
    print(f"  ties: identical: {same_tree(gpu.build_tree(0, tie_lp, tie_ids, 8), tie)}")
    drafts = [make_drafter(name, setup.model, setup.prompt, 24) for name in ("oracle", "noisy", "ngram")]
    batch_lp, batch_ids = zip(*(ref.top_candidates(d.propose(setup.prompt, BLOCK_SIZE), 16) for d in drafts),
                              strict=True)
    roots = np.full(3, root, np.int64)
    batched = gpu.build_trees(roots, np.stack(batch_lp), np.stack(batch_ids), 16)    # [Bq=3] trees
    identical = [same_tree(t, ref.build_tree(root, lp, ids, 16))
                 for t, lp, ids in zip(batched, batch_lp, batch_ids, strict=True)]
    print(f"  build_trees, 3 requests (oracle, noisy, ngram) in one launch: identical: {identical}")
    chapter.log(f"  (numba builder checks: {time.perf_counter() - begin:.1f} s)")
    assert all(identical)


def main() -> None:
    """Trees at three budgets, the brute-force and tie checks, the numba builder against the heap."""
    setup = chapter.golden_model("tiny")
    drafter = make_drafter("noisy", setup.model, setup.prompt, 24)
    logits = drafter.propose(setup.prompt, BLOCK_SIZE)                           # [L, V]
    trees = trees_at_budgets(logits, int(setup.prompt[-1]), setup.config.vocab_size)
    print()
    print_first_pops(trees[16])
    plot_trees(trees)
    check_brute_force(logits, int(setup.prompt[-1]))
    ties = all_ties()
    check_gpu_builder(setup, logits, trees, ties)
    with chapter.section("builder_cost"):
        chapter.print_gpu()
        print("what the GPU builder moves:")
        builder_cost(15, 64, 32)
        builder_cost(15, 256, 32)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
