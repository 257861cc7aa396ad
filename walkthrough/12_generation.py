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

Run: .venv/bin/python walkthrough/12_generation.py (``--help``: its settings; the defaults are the
page's run)

Writes docs/assets/figures/12_generation_<drafter>_round_<i>.png, 12_generation_rounds.md (the
tabs), 12_generation_{commits,forwards,budget}.png and 12_generation_report.txt (what it prints).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from sweep import CHAIN, TREE, budget_sweep, plot_sweep
from treeplot import ACCEPTED, BONUS, draw_tree, tree_height

from ddtree.decode import describe_round, generate_ar, generate_ddtree
from ddtree.drafters import DRAFTERS, make_drafter
from ddtree.golden import DEFAULT_PROMPTS
from ddtree.kv_cache import compact

STEM = "12_generation"
TITLES = {"oracle": "oracle", "noisy": "noisy oracle", "ngram": "n-gram drafter"}


def names(text: str, choices=DRAFTERS) -> tuple[str, ...]:
    """A comma-separated list of drafter names."""
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    wrong = [name for name in chosen if name not in choices]
    if not chosen or wrong:
        raise argparse.ArgumentTypeError(f"expected drafter names among {', '.join(choices)}, got {text!r}")
    return chosen


def budgets(text: str) -> tuple[int, ...]:
    """A comma-separated list of node budgets (each >= 0)."""
    try:
        values = tuple(int(b) for b in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected budgets >= 0 separated by commas, got {text!r}")
    return values


def parse_settings(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="walkthrough/12_generation.py",
        description="A generation, round by round: record every DDTree round of one prompt per drafter and "
                    "write the generation page's figures, tabs and report. The defaults are the page's run; "
                    "other settings rewrite the same files (run again without arguments to restore them).")
    parser.add_argument("--preset", default="tiny", choices=tuple(DEFAULT_PROMPTS),
                        help="the random model, with its golden prompt (default: %(default)s)")
    parser.add_argument("--drafters", type=names, default=("noisy", "ngram"), metavar="NAMES",
                        help=f"comma-separated, among {', '.join(DRAFTERS)} (default: noisy,ngram)")
    parser.add_argument("--tokens", type=int, default=12, metavar="N",
                        help="new tokens per generation (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=8, metavar="N",
                        help="tokens a round can commit (default: %(default)s)")
    parser.add_argument("--budget", type=int, default=16, metavar="B",
                        help="drafted nodes per round in the recorded generations (default: %(default)s)")
    parser.add_argument("--budgets", type=budgets, default=(1, 2, 4, 8, 16, 32, 64), metavar="LIST",
                        help="the summary's budget sweep, comma-separated (default: 1,2,4,8,16,32,64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the oracle drafters' seed (default: %(default)s)")
    return parser.parse_args(argv)


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
def record_generation(setup, name: str, settings):
    """Generate settings.tokens with drafter ``name``; every round's tree, walk and cache, recorded."""
    drafter = make_drafter(name, setup.model, setup.prompt, settings.tokens, seed=settings.seed)
    with chapter.record_ops(setup.model, "build_tree", "accept", "compact") as calls:
        tokens, trace = generate_ddtree(setup.model, setup.prompt, settings.tokens, drafter,
                                        block_size=settings.block_size, budget=settings.budget)
    assert np.array_equal(tokens, setup.ar_tokens), f"{name}: DDTree != AR"
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


def cache_text(r: Round) -> str:
    """What the round did to the KV cache, under the round's text."""
    moved = "nothing moves (the accepted rows already sit in order)" if \
        np.array_equal(r.accepted, np.arange(r.accepted.size)) else \
        f"slots {r.start}..{r.start + r.accepted.size - 1} receive the rows of nodes " \
        f"{', '.join(f'#{int(a)}' for a in r.accepted)}"
    return (f"KV cache: the verify forward wrote {r.before.length - r.start} rows at slots "
            f"{r.start}..{r.before.length - 1}; compaction keeps {r.accepted.size}: {moved}, and the "
            f"length becomes {r.after.length}.")


def write_tabs(generations) -> None:
    """docs/assets/figures/12_generation_rounds.md: one snippet section per drafter, a tab per round."""
    lines = []
    for name, (rounds, trace) in generations.items():
        lines.append(f"<!-- --8<-- [start:{name}] -->")
        for index, (r, record) in enumerate(zip(rounds, trace.rounds, strict=True)):
            image = draw_round(r, name, index)
            lines += [f'=== "Round {index}"', "",
                      f"    ![{TITLES[name]}, round {index}: tree and KV cache](assets/figures/{image})",
                      "", "    ```text", *(f"    {line}" for line in describe_round(record, index)),
                      "    ```", "", f"    {cache_text(r)}", ""]
        lines.append(f"<!-- --8<-- [end:{name}] -->")
    path = chapter.FIGURES / f"{STEM}_rounds.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    chapter.log(f"wrote {path.relative_to(chapter.ROOT)}")


def print_rounds(generations, settings) -> None:
    """Each round's first and last lines as ``demo --rounds`` prints them (the tabs show the tree)."""
    for name, (_, trace) in generations.items():
        with chapter.section(name):
            print(f"{TITLES[name]}: {settings.tokens} tokens in 1 prefill + {trace.verify_forwards} verify "
                  f"forwards, == AR")
            for index, record in enumerate(trace.rounds):
                text = describe_round(record, index)
                print("\n".join("  " + line for line in [text[0], *text[-2:]]))


def plot_commits(generations, block_size: int) -> None:
    """Tokens committed per round (accepted drafts + bonus), one panel per drafter."""
    fig, axes = plt.subplots(len(generations), 1, figsize=(8, 5.6), squeeze=False)
    axes = axes[:, 0]
    for ax, (name, (rounds, _)) in zip(axes, generations.items(), strict=True):
        index = np.arange(len(rounds))
        accepted = np.array([r.accepted.size - 1 for r in rounds])
        ax.bar(index, accepted, color=ACCEPTED, label="accepted drafted tokens")
        ax.bar(index, np.ones_like(accepted), bottom=accepted, color=BONUS, label="bonus token")
        ax.axhline(block_size, color="#555555", ls=":", lw=1, label=f"block size {block_size} (the most)")
        ax.set_xticks(index)
        ax.set_ylim(0, block_size + 0.5)
        ax.set_ylabel("tokens committed")
        ax.set_title(f"{TITLES[name]}: {len(rounds)} rounds", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("round (one verify forward each)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "commits")


def plot_forwards(generations, new_tokens: int) -> None:
    """Tokens generated against target forwards, the prefill counted for AR and DDTree alike."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    forwards = np.arange(new_tokens + 1)
    ax.step(forwards, forwards, where="post", color="#777777", label="AR: the prefill makes token 1")
    colors = ("#3182bd", "#756bb1", "#31a354")                     # one per drafter (DRAFTERS)
    for (name, (rounds, _)), color in zip(generations.items(), colors[:len(generations)], strict=True):
        done = np.concatenate([[0, 0], np.cumsum([r.accepted.size for r in rounds])])   # prefill: none
        ax.step(np.arange(done.size), done, where="post", color=color, lw=2,
                label=f"DDTree, {TITLES[name]}: {done.size - 1} forwards")
    ax.set_xlabel("target forwards, prefill included")
    ax.set_ylabel("tokens generated")
    ax.set_xlim(0, new_tokens + 1)
    ax.set_title(f"{new_tokens} tokens: AR {new_tokens} forwards (1 prefill + {new_tokens - 1} decodes); "
                 "DDTree 1 prefill + one per round", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "forwards")


def budget_report(setup, settings) -> None:
    """Tokens per verify forward against the budget, chain against tree, for the page's drafters."""
    s = settings
    fig, axes = plt.subplots(len(s.drafters), 1, figsize=(8, 6), sharex=True, squeeze=False)
    axes = axes[:, 0]
    with chapter.section("budget"):
        print(f"tokens per verify forward, {s.tokens} tokens, block {s.block_size} (every run == AR):")
        print(f"  {'drafter':<7} {'shape':<5} " + " ".join(f"{f'B={b}':>6}" for b in s.budgets))
        for ax, name in zip(axes, s.drafters, strict=True):
            drafter = make_drafter(name, setup.model, setup.prompt, s.tokens, seed=s.seed)
            means = {shape: budget_sweep(setup.model, setup.prompt, setup.ar_tokens, [drafter], s.budgets,
                                         s.block_size, shape) for shape in (CHAIN, TREE)}
            for shape, values in means.items():
                print(f"  {name:<7} {shape:<5} " + " ".join(f"{v:>6.2f}" for v in values))
            plot_sweep(ax, s.budgets, means[CHAIN], means[TREE], s.block_size, TITLES[name])
    axes[-1].set_xlabel("node budget B")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "budget")


def main(settings) -> None:
    """Two generations recorded round by round, their tabs and figures, then the budget sweep."""
    s = settings
    golden = chapter.golden_model(s.preset)
    ar_tokens = generate_ar(golden.model, golden.prompt, s.tokens)
    if golden.ar_tokens is not None and s.tokens <= golden.ar_tokens.size:
        assert np.array_equal(ar_tokens, golden.ar_tokens[:s.tokens]), "AR != the golden bundle"
    setup = dataclasses.replace(golden, ar_tokens=ar_tokens)
    print(f"preset {s.preset}, prompt {setup.prompt.tolist()}, {s.tokens} new tokens, block {s.block_size}, "
          f"budget {s.budget}")
    print(f"AR: {ar_tokens.tolist()}")
    generations = {name: record_generation(setup, name, s) for name in s.drafters}
    print_rounds(generations, s)
    write_tabs(generations)
    plot_commits(generations, s.block_size)
    plot_forwards(generations, s.tokens)
    budget_report(setup, s)


if __name__ == "__main__":
    arguments = parse_settings()                       # --help prints the settings and runs nothing
    with chapter.report(STEM):
        main(arguments)
