"""Chapter 9: greedy acceptance, the walk down the tree along the target's own choices.

After the verify forward, ``posterior[i] = argmax(logits[i])`` is the target's greedy next token
after the path root..i. The walk starts at the root: while some child of the current node carries
the target's choice, move there. Siblings carry distinct tokens, so at most one child matches. The
walk's last choice is the bonus token: a token the target produced itself, which the next round
uses as its root. Every committed token is the target's greedy choice after a prefix of real
(committed) tokens, so the output is plain AR greedy decoding, only in fewer forwards.

This chapter records (tree, posterior) for every round of a generation with the noisy oracle
(preset tiny, golden prompt, block 8, budget 32), prints the walk of one round whose accepted path
leaves the drafter's top-1 chain, draws it, and runs the numba accept (one tree) and accept_batch
(every round in one launch) against numpy.

Run: .venv/bin/python walkthrough/09_accept.py

Writes docs/assets/figures/09_accept_path.png and 09_accept_report.txt (what it prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from treeplot import ROW_INCHES, draw_tree, tree_height

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.accept as gpu
from ddtree.accept import accept
from ddtree.decode import generate_ddtree
from ddtree.drafters import make_drafter
from kernels.bench.cases import accept as accept_costs
from kernels.device import SIMULATOR

STEM = "09_accept"
BLOCK_SIZE, BUDGET, NEW_TOKENS = 8, 32, 24


def print_walk(tree, posterior) -> None:
    """The walk, step by step, as accept() does it."""
    node = 0
    while True:
        choice = int(posterior[node])
        kids = tree.children(node)
        offered = ", ".join(f"#{c} {int(tree.tokens[c])}" for c in kids) or "none"
        match = kids[tree.tokens[kids] == choice]
        verdict = f"#{match[0]} carries it (rank {int(tree.ranks[match[0]])}): accept" if match.size \
            else f"no child carries it: stop, bonus = {choice}"
        print(f"  at #{node} ({int(tree.tokens[node])}): the target says {choice}; children {offered}")
        print(f"    -> {verdict}")
        if not match.size:
            return
        node = int(match[0])


def record_rounds(setup):
    """A noisy-oracle generation; every round's (tree, posterior) as ops.accept received them."""
    drafter = make_drafter("noisy", setup.model, setup.prompt, NEW_TOKENS)
    with chapter.record_ops(setup.model, "accept") as calls:
        tokens, trace = generate_ddtree(setup.model, setup.prompt, NEW_TOKENS, drafter,
                                        block_size=BLOCK_SIZE, budget=BUDGET)
    assert np.array_equal(tokens, setup.ar_tokens), "DDTree must emit the AR tokens"
    print(f"noisy oracle, block {BLOCK_SIZE}, budget {BUDGET}: {len(calls)} rounds, "
          f"DDTree == AR: {np.array_equal(tokens, setup.ar_tokens)}")
    print(f"  committed per round {[r.committed for r in trace.rounds]}")
    return [call.args for call in calls], trace


def most_interesting(rounds) -> int:
    """The round to show: its accepted path leaves the top-1 chain (some rank > 0), longest first."""
    def interest(index):
        tree, posterior = rounds[index]
        accepted, _ = accept(tree, posterior)
        return (bool(np.any(tree.ranks[accepted[1:]] > 0)), accepted.size)

    shown = max(range(len(rounds)), key=interest)
    assert interest(shown)[0], "no round's accepted path leaves the top-1 chain"
    return shown


def walk_report(setup, rounds, trace, shown: int) -> None:
    tree, posterior = rounds[shown]
    accepted, bonus = accept(tree, posterior)
    record = trace.rounds[shown]
    done = sum(r.committed for r in trace.rounds[:shown])
    committed = [int(t) for t in tree.tokens[accepted[1:]]] + [bonus]
    with chapter.section("walk"):
        print(f"round {shown}: root {int(tree.tokens[0])} at position {record.start}, "
              f"{tree.size - 1} drafted nodes")
        print_walk(tree, posterior)
        print(f"  accepted nodes {accepted.tolist()} (ranks {tree.ranks[accepted].tolist()[1:]}),")
        print(f"  bonus {bonus}: commits {committed}")
        print(f"  AR tokens at those positions: {setup.ar_tokens[done:done + len(committed)].tolist()}")
        off_chain = int(np.flatnonzero(tree.ranks[accepted[1:]] > 0)[0]) + 1     # depth of the first rank > 0
        print(f"  a single chain (topk=1) would stop at depth {off_chain}, where the walk takes rank "
              f"{int(tree.ranks[accepted[off_chain]])},")
        print(f"  and commit {off_chain} tokens; the tree commits {len(committed)}")
    assert committed == setup.ar_tokens[done:done + len(committed)].tolist()
    assert np.array_equal(accepted, record.accepted) and bonus == record.bonus

    fig, ax = plt.subplots(figsize=(8, ROW_INCHES * tree_height(tree) + 1.6))
    draw_tree(ax, tree, accepted=accepted, bonus=bonus, fontsize=9, start=record.start, top1=True,
              title=f"round {shown}: accepted path (orange), bonus (green), top-1 chain (purple)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "path")


def check_kernels(rounds, shown: int) -> None:
    """numba: one tree, then every round in one launch (padded to the widest tree)."""
    tree, posterior = rounds[shown]
    accepted, bonus = accept(tree, posterior)
    print(f"numba ({'CUDA simulator' if SIMULATOR else 'GPU'}):")
    with chapter.timed("numba accept"):
        got, got_bonus = gpu.accept(tree, posterior)
    same = np.array_equal(got, accepted) and got_bonus == bonus
    print(f"  accept (round {shown}): accepted {got.tolist()}, bonus {got_bonus}: identical: {same}")
    assert same
    width = max(t.size for t, _ in rounds)
    padded = np.full((3, len(rounds), width), -1, np.int64)            # tokens, parents, posterior
    padded[0] = 0
    for b, (t, p) in enumerate(rounds):
        padded[:, b, :t.size] = t.tokens, t.parents, p
    sizes = np.array([t.size for t, _ in rounds], np.int64)
    with chapter.timed("numba accept_batch"):
        batch_accepted, lengths, bonuses = gpu.accept_batch(padded[0], padded[1], sizes, padded[2])
    expected = [accept(t, p) for t, p in rounds]
    same = all(np.array_equal(batch_accepted[b, :lengths[b]], walk) and bonuses[b] == last
               for b, (walk, last) in enumerate(expected))
    print(f"  accept_batch: {len(rounds)} trees of width {width} in one launch, lengths {lengths.tolist()}")
    print(f"    identical to numpy: {same}")
    assert same


def accept_bytes(nodes: int) -> None:
    """What accept_batch moves for one request of ``nodes`` tree nodes (its cost model)."""
    moved = accept_costs.bytes_moved(Bq=1, W=nodes)
    with chapter.section("bytes"):
        chapter.print_gpu()
        print(f"accept_batch, one request of {nodes} nodes: {moved} bytes in and out, "
              f"{chapter.time_floor(moved) * 1e9:.1f} ns at the read bandwidth")


def main() -> None:
    """Record every round of a noisy-oracle generation, walk one round, check the numba accept."""
    setup = chapter.golden_model("tiny")
    rounds, trace = record_rounds(setup)
    shown = most_interesting(rounds)
    print()
    walk_report(setup, rounds, trace, shown)
    check_kernels(rounds, shown)
    accept_bytes(65)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
