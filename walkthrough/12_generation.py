"""A generation, round by round: what each DDTree round drafts, accepts and keeps in the KV cache.

One prompt, 12 new tokens, block 8, budget 16, two drafters. The default model is the trained one
(``ddtree.text.TRAINED``, checkpoints/tiny-code) on a held-out prompt, with its trained block
drafter (trees built from a trained drafter's distributions) and the n-gram drafter (which copies
what followed an earlier occurrence of the context's suffix: real code repeats itself). With
``--model <preset>`` it is the preset's random model on its golden prompt, with the noisy oracle
and the n-gram drafter. For every round the chapter records, with ``chapter.record_ops``, the tree
the builder returned (with each node's cumulative log-probability), the accepted walk and bonus,
and the KV cache before and after compaction, and draws them: one figure per round, and a
generated markdown file with one tab per round that the page includes. A model with a tokenizer
shows every token as its text (``ddtree.text.tokens_as_text``: '·' a space, '⏎' a newline). Then
the summary: tokens committed per round, tokens generated against target forwards (the prefill
counted for every decoder), and tokens per verify forward against the budget for a chain (topk=1)
and a tree. Everything runs on the numpy reference; every generation equals AR.

Run: .venv/bin/python walkthrough/12_generation.py (``--help``: its settings; the defaults are the
page's run)

Writes docs/assets/figures/12_generation_<drafter>_round_<i>.png, 12_generation_rounds.md (the
tabs), 12_generation_{commits,forwards,budget}.png and 12_generation_report.txt (what it prints).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import pathlib
import re
import textwrap

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from sweep import CHAIN, TREE, budget_sweep, plot_sweep
from treeplot import ACCEPTED, BONUS, LABEL_CHARS, draw_tree, labels, tree_height

from ddtree.decode import describe_round, generate_ar, generate_ddtree
from ddtree.drafters import DRAFTER_FILE, DRAFTERS, TRAINED_DRAFTERS, make_drafter
from ddtree.golden import DEFAULT_PROMPTS
from ddtree.kv_cache import compact
from ddtree.model import Transformer
from ddtree.text import TRAINED, decode, encode, heldout_prompts, load_tokenizer, tokens_as_text
from ddtree.weights import load_pretrained

STEM = "12_generation"
TITLES = {"oracle": "oracle", "noisy": "noisy oracle", "ngram": "n-gram drafter", "block": "block drafter"}
MODELS = ("trained", *DEFAULT_PROMPTS)          # the trained checkpoint, or a preset's random model
DEFAULT_DRAFTERS = {"trained": ("block", "ngram"), "preset": ("noisy", "ngram")}
STRIP_CHARS = LABEL_CHARS // 2  # a cache slot is narrower than a tree's column: a box's text on two lines


def names(text: str, choices=DRAFTERS + TRAINED_DRAFTERS) -> tuple[str, ...]:
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
    parser.add_argument("--model", default="trained", choices=MODELS,
                        help="trained: the checkpoint of --checkpoint on a held-out prompt; a preset name: "
                             "its random model on its golden prompt (default: %(default)s)")
    parser.add_argument("--checkpoint", type=pathlib.Path, default=TRAINED, metavar="DIR",
                        help="the trained model's directory (weights, tokenizer.json and the block "
                             "drafter in drafter/) (default: checkpoints/tiny-code)")
    parser.add_argument("--prompt-index", type=int, default=0, metavar="I",
                        help="which held-out prompt (corpus/prompts.json) the trained model continues "
                             "(default: %(default)s)")
    parser.add_argument("--drafters", type=names, metavar="NAMES",
                        help=f"comma-separated, among {', '.join(DRAFTERS + TRAINED_DRAFTERS)}; block needs "
                             "the trained model (default: block,ngram for the trained model, noisy,ngram "
                             "for a preset)")
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
    settings = parser.parse_args(argv)
    check_settings(parser, settings)
    return settings


def check_settings(parser, s) -> None:
    """The settings that need the files: the checkpoint, the prompt index, the block drafter."""
    trained = s.model == "trained"
    if s.drafters is None:
        s.drafters = DEFAULT_DRAFTERS["trained" if trained else "preset"]
    if not trained:
        if "block" in s.drafters:
            parser.error(f"--drafters: block is the trained model's drafter; use --model trained, "
                         f"got --model {s.model}")
        return
    for name in ("config.json", "tokenizer.json"):
        if not (s.checkpoint / name).is_file():
            parser.error(f"--checkpoint: {s.checkpoint} must hold {name} (train/target.py writes the "
                         f"trained model there); --model tiny runs the random model instead")
    if "block" in s.drafters and not (s.checkpoint / "drafter" / DRAFTER_FILE).is_file():
        parser.error(f"--drafters: block needs {s.checkpoint / 'drafter' / DRAFTER_FILE} (train/drafter.py "
                     "writes it); --drafters ngram runs without it")
    count = len(heldout_prompts())
    if not 0 <= s.prompt_index < count:
        parser.error(f"--prompt-index: must be in 0..{count - 1} (corpus/prompts.json holds {count} "
                     f"prompts), got {s.prompt_index}")


@dataclasses.dataclass(frozen=True)
class Setup:
    """The chapter's model, prompt and AR continuation."""
    model: Transformer
    prompt: np.ndarray          # [P]
    ar_tokens: np.ndarray       # [settings.tokens] the target's greedy continuation
    tokenizer: object           # tokenizers.Tokenizer, or None: tokens are shown as ids
    drafter_directory: object   # the block drafter's directory (pathlib.Path), or None
    origin: str                 # where the model and prompt come from, for the report

    def words(self, ids) -> list[str]:
        """Each token's text by ddtree.text's visible rule ('·' a space, '⏎' a newline)."""
        return tokens_as_text(self.tokenizer, ids)

    @property
    def speaks(self):
        """``words`` for the drawing and text helpers, or None without a tokenizer (ids only)."""
        return None if self.tokenizer is None else self.words


def trained_setup(s) -> Setup:
    """The trained checkpoint, its tokenizer and held-out prompt ``s.prompt_index``."""
    config, weights = load_pretrained(s.checkpoint)
    tokenizer = load_tokenizer(s.checkpoint)
    chosen = heldout_prompts()[s.prompt_index]
    prompt = encode(tokenizer, chosen["text"])                                   # [P]
    model = Transformer(config, weights)
    where = s.checkpoint.resolve()
    name = where.relative_to(chapter.ROOT) if where.is_relative_to(chapter.ROOT) else where
    return Setup(model, prompt, generate_ar(model, prompt, s.tokens), tokenizer, s.checkpoint / "drafter",
                 f"trained model {name}, held-out prompt {s.prompt_index} (from {chosen['file']})")


def preset_setup(s) -> Setup:
    """The preset's random model (the golden weights) on its golden prompt."""
    golden = chapter.golden_model(s.model)
    ar_tokens = generate_ar(golden.model, golden.prompt, s.tokens)
    if golden.ar_tokens is not None and s.tokens <= golden.ar_tokens.size:
        assert np.array_equal(ar_tokens, golden.ar_tokens[:s.tokens]), "AR != the golden bundle"
    return Setup(golden.model, golden.prompt, ar_tokens, None, None,
                 f"preset {s.model} (random weights), its golden prompt")


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
    drafter = drafter_for(setup, name, settings)
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


def drafter_for(setup, name: str, settings):
    """Drafter ``name``; the block drafter comes from the checkpoint's drafter/ folder."""
    directory = setup.drafter_directory if name in TRAINED_DRAFTERS else None
    return make_drafter(name, setup.model, setup.prompt, settings.tokens, seed=settings.seed,
                        continuation=setup.ar_tokens, drafter_directory=directory)


def slot_owners(cache, before, start: int, count: int) -> list[int]:
    """Which tree node's verify row each of slots start..start+count-1 really holds (-1: none)."""
    owners = []
    for slot in range(start, start + count):
        match = [i for i in range(before.length - start)
                 if np.array_equal(cache.latent[:, slot], before.latent[:, start + i])]
        owners.append(match[0] if match else -1)
    return owners


def slot_text(text: str) -> str:
    """A box's text (``treeplot.short``) as a cache slot shows it: STRIP_CHARS characters a line."""
    return "\n".join(text[i:i + STRIP_CHARS] for i in range(0, len(text), STRIP_CHARS))


def draw_cache(ax, r: Round, words=None) -> list[tuple]:
    """Two strips of slots: after the verify forward, and after compaction. Returns each slot's
    (text, box) pair, for ``fit_slots``."""
    nodes = r.before.length - r.start
    kept = r.after.length - r.start
    owners = slot_owners(r.after, r.before, r.start, kept)
    assert owners == r.accepted.tolist(), "compaction must leave the accepted rows in order"
    token = [slot_text(text) for text in labels(r.tree.tokens, words)]       # per node
    slots = []
    for y, title, texts, colors in (
            (1.45, f"after the verify forward: length {r.before.length}",
             [f"#{i}\n{token[i]}" for i in range(nodes)],
             [ACCEPTED if i in r.accepted else "#deebf7" for i in range(nodes)]),
            (0.0, f"after compaction: length {r.after.length}",
             [f"#{owners[j]}\n{token[owners[j]]}" if j < kept else "free" for j in range(nodes)],
             ["#a1d99b" if j < kept else "white" for j in range(nodes)])):
        ax.add_patch(Rectangle((-2.45, y - 0.45), 1.9, 0.9, fc="#bdbdbd", ec="#444444", lw=0.6))
        ax.text(-1.5, y, f"0..{r.start - 1}\ncommitted", ha="center", va="center", fontsize=8)
        for k, (text, color) in enumerate(zip(texts, colors, strict=True)):
            box = ax.add_patch(Rectangle((k - 0.45, y - 0.45), 0.9, 0.9, fc=color, ec="#444444", lw=0.6))
            slots.append((ax.text(k, y, text, ha="center", va="center", fontsize=8, linespacing=1.0,
                                  color="white" if color == ACCEPTED else "black"), box))
        ax.text(-2.45, y + 0.5, title, ha="left", va="bottom", fontsize=9)
    ax.set_xticks(range(0, nodes, 2))
    ax.set_xticklabels([str(r.start + k) for k in range(0, nodes, 2)], fontsize=8)
    ax.set_xlabel("cache slot", fontsize=9)
    ax.set_xlim(-2.6, max(nodes, 8) - 0.4)
    ax.set_ylim(-0.55, 2.3)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    return slots


def overlapping_boxes(fig, ax) -> list[tuple[str, str]]:
    """The pairs of token boxes of the drawn tree on ``ax`` that overlap (measured on the figure)."""
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_bbox_patch().get_window_extent(renderer)) for t in ax.texts
             if t.get_bbox_patch() is not None]
    return [(text, other) for i, (text, box) in enumerate(boxes) for other, other_box in boxes[i + 1:]
            if box.overlaps(other_box)]


def fit_slots(fig, slots) -> bool:
    """Keep the cache slots' token texts only if every one fits its slot (measured on the figure);
    else every slot shows its node number alone (many slots: a large --budget). Returns whether
    the texts stay."""
    renderer = fig.canvas.get_renderer()
    for text, slot in slots:
        inner, outer = text.get_window_extent(renderer), slot.get_window_extent(renderer)
        if inner.width > outer.width or inner.height > outer.height:
            chapter.log(f"  (cache slots too narrow for {text.get_text()!r}: node numbers only)")
            for each, _ in slots:
                each.set_text(each.get_text().split("\n")[0])
            return False
    return True


def round_figure(r: Round, name: str, index: int, words=None):
    """The round's tree and its cache strips in one figure; returns it and whether the cache slots
    keep their token texts (``fit_slots``)."""
    rows = tree_height(r.tree, bonus_of=int(r.accepted[-1]))
    tree_inches = 0.5 * rows + 1.2                          # a row holds #n, the token and the log-prob
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, tree_inches + 3.3), dpi=chapter.DPI,
                                      gridspec_kw=dict(height_ratios=[tree_inches, 2.8]))
    draw_tree(top, r.tree, accepted=r.accepted, bonus=r.bonus, fontsize=9, start=r.start, top1=True,
              weights=r.tree.logprobs, words=words,
              title=f"{TITLES[name]}, round {index}: token, #pop order, cumulative log-prob under the box")
    slots = draw_cache(bottom, r, words)
    fig.tight_layout()
    fig.canvas.draw()
    overlaps = overlapping_boxes(fig, top)
    if overlaps:
        raise ValueError(f"--block-size: {TITLES[name]}, round {index}: the tree's columns are too narrow "
                         f"for its boxes ({overlaps[0][0]!r} overlaps {overlaps[0][1]!r}); draw fewer "
                         f"depths or lower treeplot.LABEL_CHARS ({LABEL_CHARS})")
    return fig, words is None or fit_slots(fig, slots)


def draw_round(r: Round, name: str, index: int, words=None) -> str:
    """The round's figure (``round_figure``), saved; returns the image's file name."""
    fig, _ = round_figure(r, name, index, words)
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


def write_tabs(generations, words=None) -> None:
    """docs/assets/figures/12_generation_rounds.md: one snippet section per drafter, a tab per round."""
    lines = []
    for name, (rounds, trace) in generations.items():
        lines.append(f"<!-- --8<-- [start:{name}] -->")
        for index, (r, record) in enumerate(zip(rounds, trace.rounds, strict=True)):
            image = draw_round(r, name, index, words)
            lines += [f'=== "Round {index}"', "",
                      f"    ![{TITLES[name]}, round {index}: tree and KV cache](assets/figures/{image})",
                      "", "    ```text", *(f"    {line}" for line in describe_round(record, index, words)),
                      "    ```", "", f"    {cache_text(r)}", ""]
        lines.append(f"<!-- --8<-- [end:{name}] -->")
    path = chapter.FIGURES / f"{STEM}_rounds.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    chapter.log(f"wrote {path.relative_to(chapter.ROOT)}")


def report_lines(line: str, indent: str = "  ") -> list[str]:
    """One line of text cut at spaces into report lines (``chapter.REPORT_WIDTH``); a token's id and
    its quoted text stay together, later lines indented two more."""
    glued = re.sub(r"(\d) '", "\\1\xa0'", line)          # textwrap breaks at spaces, not at U+00A0
    return [part.replace("\xa0", " ") for part in
            textwrap.wrap(glued, chapter.REPORT_WIDTH, initial_indent=indent,
                          subsequent_indent=indent + "    ", break_long_words=False, break_on_hyphens=False)]


def print_rounds(generations, settings, setup) -> None:
    """Each round's first and last lines as ``demo --rounds`` prints them (the tabs show the tree)."""
    for name, (_, trace) in generations.items():
        with chapter.section(name):
            if name in TRAINED_DRAFTERS:
                drafter = drafter_for(setup, name, settings)
                print(f"{TITLES[name]}: {drafter.config.describe()},")
                print(f"  window {drafter.window} committed tokens, trained for up to {drafter.max_depths} "
                      "depths")
            print(f"{TITLES[name]}: {settings.tokens} tokens in 1 prefill + {trace.verify_forwards} verify "
                  f"forwards, == AR")
            for index, record in enumerate(trace.rounds):
                text = describe_round(record, index, setup.speaks)
                for line in [text[0], *text[-2:]]:
                    print("\n".join(report_lines(line)))


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
            drafter = drafter_for(setup, name, s)
            means = {shape: budget_sweep(setup.model, setup.prompt, setup.ar_tokens, [drafter], s.budgets,
                                         s.block_size, shape) for shape in (CHAIN, TREE)}
            for shape, values in means.items():
                print(f"  {name:<7} {shape:<5} " + " ".join(f"{v:>6.2f}" for v in values))
            plot_sweep(ax, s.budgets, means[CHAIN], means[TREE], s.block_size, TITLES[name])
    axes[-1].set_xlabel("node budget B")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "budget")


def print_text(setup) -> None:
    """The prompt's last line and AR's tokens, as tokens ('·' a space, '⏎' a newline) and as text."""
    tokenizer, prompt, ar = setup.tokenizer, setup.prompt, setup.ar_tokens
    print(f"AR's {ar.size} tokens, each as its text ('·' a space, '⏎' a newline):")
    print("\n".join(report_lines(" ".join(f"'{w}'" for w in setup.words(ar)))))
    before = decode(tokenizer, prompt)
    whole = decode(tokenizer, np.concatenate([prompt, ar]))                          # [P + N] -> text
    start = before.rstrip("\n").rfind("\n") + 1                   # where the prompt's last line begins
    print("the prompt's last line, then AR's text as it reads in the file:")
    for number, line in enumerate(whole[start:].rstrip("\n").split("\n")):
        shown = f"  {'prompt' if number == 0 else 'AR':<6} | {line}"
        print(shown if len(shown) <= chapter.REPORT_WIDTH else shown[:chapter.REPORT_WIDTH - 1] + "…")


def main(settings) -> None:
    """Two generations recorded round by round, their tabs and figures, then the budget sweep."""
    s = settings
    setup = trained_setup(s) if s.model == "trained" else preset_setup(s)
    print(f"{setup.origin}:")
    print(f"  {setup.model.config.describe()}")
    print(f"  prompt of {setup.prompt.size} tokens, {s.tokens} new tokens, block {s.block_size}, "
          f"budget {s.budget}")
    if setup.tokenizer is None:
        print(f"prompt: {setup.prompt.tolist()}")
        print(f"AR: {setup.ar_tokens.tolist()}")
    else:
        with chapter.section("text"):
            print_text(setup)
    generations = {name: record_generation(setup, name, s) for name in s.drafters}
    print_rounds(generations, s, setup)
    write_tabs(generations, setup.speaks)
    plot_commits(generations, s.block_size)
    plot_forwards(generations, s.tokens)
    budget_report(setup, s)


if __name__ == "__main__":
    arguments = parse_settings()                       # --help prints the settings and runs nothing
    with chapter.report(STEM):
        main(arguments)
