"""A generation, round by round: what each DDTree round drafts, accepts and keeps in the KV cache.

One prompt (preset tiny, its golden prompt), 12 new tokens, block 8, budget 16, two drafters: the
noisy oracle (trees that branch, partial acceptance) and the n-gram drafter (a real drafter that
finds nothing to copy on this random model). For every round the chapter records, with
``chapter.record_ops``, the tree the builder returned (with each node's cumulative log-probability),
the accepted walk and bonus, and the KV cache before and after compaction, and draws them: one
figure per round, and a generated markdown file with one tab per round that the page includes.
Then the summary: tokens committed per round, tokens generated against target forwards (the
prefill counted for every decoder), and tokens per verify forward against the budget for a chain
(topk=1) and a tree. Everything runs on the numpy reference; every generation equals AR.

Run: python walkthrough/13_generation.py

Writes docs/assets/figures/13_generation_<drafter>_round_<i>.png, 13_generation_rounds.md (the
tabs), 13_generation_{commits,forwards,budget}.png and 13_generation_report.txt (what it prints).
"""

from __future__ import annotations

import copy
import dataclasses

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from sweep import CHAIN, TREE, budget_sweep, plot_sweep
from treeplot import ACCEPTED, BONUS, draw_tree, top1_chain, tree_height

from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import make_drafter
from ddtree.kv_cache import compact

STEM = "13_generation"
NEW_TOKENS, BLOCK_SIZE, BUDGET = 12, 8, 16
DRAFTER_NAMES = ("noisy", "ngram")
BUDGETS = (1, 2, 4, 8, 16, 32, 64)
TITLES = {"noisy": "noisy oracle", "ngram": "n-gram drafter"}


@dataclasses.dataclass(frozen=True)
class Round:
    """What one round did, from the recorded operations."""
    tree: object               # ddtree.tree.DraftTree: tokens, parents, depths, ranks, logprobs
    accepted: np.ndarray       # [m] accepted node indices, root first
    bonus: int
    start: int                 # the root's slot (= position)
    before: object             # LatentKVCache after the verify forward, before compaction
    after: object              # the same cache after compaction


# --8<-- [start:record_generation]
def record_generation(setup, name: str):
    """Generate NEW_TOKENS with drafter ``name``; every round's tree, walk and cache, recorded."""
    drafter = make_drafter(name, setup.model, setup.prompt, NEW_TOKENS)
    with chapter.record_ops(setup.model, "build_tree", "accept", "compact") as calls:
        tokens, trace = generate_ddtree(setup.model, setup.prompt, NEW_TOKENS, drafter,
                                        block_size=BLOCK_SIZE, budget=BUDGET)
    assert np.array_equal(tokens, setup.ar_tokens[:NEW_TOKENS]), f"{name}: DDTree != AR"
    by_name = {op: [c for c in calls if c.name == op] for op in ("build_tree", "accept", "compact")}
    rounds = []
    for built, walked, compacted in zip(*by_name.values(), strict=True):
        before, start, accepted = compacted.args
        after = copy.deepcopy(before)
        compact(after, start, accepted)
        rounds.append(Round(built.result, np.asarray(walked.result[0]), int(walked.result[1]), start,
                            before, after))
    return rounds, trace
# --8<-- [end:record_generation]


def slot_owners(cache, before, start: int, count: int) -> list[int]:
    """Which tree node's verify row each of slots start..start+count-1 really holds (-1: none)."""
    owners = []
    for slot in range(start, start + count):
        match = [i for i in range(before.length - start)
                 if np.array_equal(cache.latent[:, slot], before.latent[:, start + i])]
        owners.append(match[0] if match else -1)
    return owners


def draw_cache(ax, r: Round) -> None:
    """Two strips of slots: after the verify forward, and after compaction."""
    nodes = r.before.length - r.start
    kept = r.after.length - r.start
    owners = slot_owners(r.after, r.before, r.start, kept)
    assert owners == r.accepted.tolist(), "compaction must leave the accepted rows in order"
    for y, title, labels, colors in (
            (1.0, f"after verify\nlength {r.before.length}",
             [f"#{i}\n{int(r.tree.tokens[i])}" for i in range(nodes)],
             [ACCEPTED if i in r.accepted else "#deebf7" for i in range(nodes)]),
            (0.0, f"after compaction\nlength {r.after.length}",
             [f"#{owners[j]}\n{int(r.tree.tokens[owners[j]])}" if j < kept else "free" for j in range(nodes)],
             ["#a1d99b" if j < kept else "white" for j in range(nodes)])):
        ax.add_patch(Rectangle((-2.45, y - 0.32), 1.9, 0.64, fc="#bdbdbd", ec="#444444", lw=0.6))
        ax.text(-1.5, y, f"0..{r.start - 1}\ncommitted", ha="center", va="center", fontsize=8)
        for k, (label, color) in enumerate(zip(labels, colors, strict=True)):
            ax.add_patch(Rectangle((k - 0.45, y - 0.32), 0.9, 0.64, fc=color, ec="#444444", lw=0.6))
            ax.text(k, y, label, ha="center", va="center", fontsize=8,
                    color="white" if color == ACCEPTED else "black")
        ax.text(-2.7, y, title, ha="right", va="center", fontsize=9)
    ax.set_xticks(range(0, nodes, 2))
    ax.set_xticklabels([str(r.start + k) for k in range(0, nodes, 2)], fontsize=8)
    ax.set_xlabel("cache slot", fontsize=9)
    ax.set_xlim(-6.2, max(nodes, 8) - 0.4)
    ax.set_ylim(-0.55, 1.55)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)


def draw_round(r: Round, name: str, index: int) -> str:
    """The round's tree and its cache strips in one figure; returns the image's file name."""
    tree_inches = 0.5 * tree_height(r.tree) + 1.2           # a row holds #n, the token and the log-prob
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, tree_inches + 2.4),
                                      gridspec_kw=dict(height_ratios=[tree_inches, 1.9]))
    draw_tree(top, r.tree, accepted=r.accepted, bonus=r.bonus, fontsize=9, start=r.start, top1=True,
              weights=r.tree.logprobs,
              title=f"{TITLES[name]}, round {index}: token, #pop order, cumulative log-prob under the box")
    draw_cache(bottom, r)
    fig.tight_layout()
    return chapter.save_figure(fig, STEM, f"{name}_round_{index}").name


def round_text(r: Round) -> str:
    """The tab's text under the figure, from the recorded round."""
    chain = top1_chain(r.tree.parents)
    path = " → ".join(str(int(t)) for t in r.tree.tokens[r.accepted])
    off = [j for j in range(1, r.accepted.size) if j >= len(chain) or r.accepted[j] != chain[j]]
    where = (f"It leaves the drafter's top-1 chain at depth {off[0]}." if off else
             "It follows the drafter's top-1 chain.")
    committed = [int(t) for t in r.tree.tokens[r.accepted[1:]]] + [r.bonus]
    moved = "nothing moves (the accepted rows already sit in order)" if \
        np.array_equal(r.accepted, np.arange(r.accepted.size)) else \
        f"slots {r.start}..{r.start + r.accepted.size - 1} receive the rows of nodes " \
        f"{', '.join(f'#{int(a)}' for a in r.accepted)}"
    return (f"Root **{int(r.tree.tokens[0])}** at position {r.start}; the builder drafted "
            f"{r.tree.size - 1} nodes. The target accepted the path {path} (nodes "
            f"{r.accepted.tolist()}). {where} Bonus: **{r.bonus}**, so the round commits "
            f"{len(committed)} token{'s' if len(committed) > 1 else ''}: {committed}. "
            f"KV cache: the verify forward wrote {r.before.length - r.start} rows at slots "
            f"{r.start}..{r.before.length - 1}; compaction keeps {r.accepted.size}: {moved}, and the "
            f"length becomes {r.after.length}.")


def write_tabs(generations) -> None:
    """docs/assets/figures/13_generation_rounds.md: one snippet section per drafter, a tab per round."""
    lines = []
    for name, (rounds, _) in generations.items():
        lines.append(f"<!-- --8<-- [start:{name}] -->")
        for index, r in enumerate(rounds):
            image = draw_round(r, name, index)
            lines += [f'=== "Round {index}"', "",
                      f"    ![{TITLES[name]}, round {index}: tree and KV cache](assets/figures/{image})",
                      "", f"    {round_text(r)}", ""]
        lines.append(f"<!-- --8<-- [end:{name}] -->")
    path = chapter.FIGURES / f"{STEM}_rounds.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    chapter.log(f"wrote {path.relative_to(chapter.ROOT)}")


def print_rounds(generations) -> None:
    for name, (rounds, trace) in generations.items():
        with chapter.section(name):
            print(f"{TITLES[name]}: {NEW_TOKENS} tokens in 1 prefill + {trace.verify_forwards} verify "
                  f"forwards, == AR")
            for index, r in enumerate(rounds):
                print(f"  round {index:>2}: root {int(r.tree.tokens[0]):>3} at {r.start:>2}, accepted "
                      f"{str(r.accepted.tolist()):<16} bonus {r.bonus:>3} -> commits {r.accepted.size}")


def plot_commits(generations) -> None:
    """Tokens committed per round (accepted drafts + bonus), one panel per drafter."""
    fig, axes = plt.subplots(len(generations), 1, figsize=(8, 5.6))
    for ax, (name, (rounds, _)) in zip(axes, generations.items(), strict=True):
        index = np.arange(len(rounds))
        accepted = np.array([r.accepted.size - 1 for r in rounds])
        ax.bar(index, accepted, color=ACCEPTED, label="accepted drafted tokens")
        ax.bar(index, np.ones_like(accepted), bottom=accepted, color=BONUS, label="bonus token")
        ax.axhline(BLOCK_SIZE, color="#555555", ls=":", lw=1, label=f"block size {BLOCK_SIZE} (the most)")
        ax.set_xticks(index)
        ax.set_ylim(0, BLOCK_SIZE + 0.5)
        ax.set_ylabel("tokens committed")
        ax.set_title(f"{TITLES[name]}: {len(rounds)} rounds", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("round (one verify forward each)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "commits")


def plot_forwards(generations) -> None:
    """Tokens generated against target forwards, the prefill counted for AR and DDTree alike."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    forwards = np.arange(NEW_TOKENS + 1)
    ax.step(forwards, forwards, where="post", color="#777777", label="AR: the prefill makes token 1")
    colors = ("#3182bd", "#756bb1")
    for (name, (rounds, _)), color in zip(generations.items(), colors, strict=True):
        done = np.concatenate([[0, 0], np.cumsum([r.accepted.size for r in rounds])])   # prefill: none
        ax.step(np.arange(done.size), done, where="post", color=color, lw=2,
                label=f"DDTree, {TITLES[name]}: {done.size - 1} forwards")
    ax.set_xlabel("target forwards, prefill included")
    ax.set_ylabel("tokens generated")
    ax.set_xlim(0, NEW_TOKENS + 1)
    ax.set_title(f"{NEW_TOKENS} tokens: AR {NEW_TOKENS} forwards (1 prefill + {NEW_TOKENS - 1} decodes); "
                 "DDTree 1 prefill + one per round", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "forwards")


def budget_report(setup) -> None:
    """Tokens per verify forward against the budget, chain against tree, for the page's drafters."""
    ar_tokens = setup.ar_tokens[:NEW_TOKENS]
    fig, axes = plt.subplots(len(DRAFTER_NAMES), 1, figsize=(8, 6), sharex=True)
    with chapter.section("budget"):
        print(f"tokens per verify forward, {NEW_TOKENS} tokens, block {BLOCK_SIZE} (every run == AR):")
        print(f"  {'drafter':<7} {'shape':<5} " + " ".join(f"{f'B={b}':>6}" for b in BUDGETS))
        for ax, name in zip(axes, DRAFTER_NAMES, strict=True):
            drafter = make_drafter(name, setup.model, setup.prompt, NEW_TOKENS)
            means = {shape: budget_sweep(setup.model, setup.prompt, ar_tokens, [drafter], BUDGETS,
                                         BLOCK_SIZE, shape) for shape in (CHAIN, TREE)}
            for shape, values in means.items():
                print(f"  {name:<7} {shape:<5} " + " ".join(f"{v:>6.2f}" for v in values))
            plot_sweep(ax, BUDGETS, means[CHAIN], means[TREE], BLOCK_SIZE, TITLES[name])
    axes[-1].set_xlabel("node budget B")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "budget")


def main() -> None:
    """Two generations recorded round by round, their tabs and figures, then the budget sweep."""
    setup = chapter.golden_model("tiny")
    assert np.array_equal(generate_ar(setup.model, setup.prompt, NEW_TOKENS), setup.ar_tokens[:NEW_TOKENS])
    print(f"preset tiny, prompt {setup.prompt.tolist()}, {NEW_TOKENS} new tokens, block {BLOCK_SIZE}, "
          f"budget {BUDGET}")
    print(f"AR: {setup.ar_tokens[:NEW_TOKENS].tolist()}")
    generations = {name: record_generation(setup, name) for name in DRAFTER_NAMES}
    print_rounds(generations)
    write_tabs(generations)
    plot_commits(generations)
    plot_forwards(generations)
    budget_report(setup)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
