"""Chapter 6: drafters, the per-depth distributions a draft tree is built from.

A DDTree round starts from the root (the last committed token, not yet in the target's KV cache).
The drafter looks at the committed context and returns, for each depth d = 1..L (L = block_size - 1),
logits over the vocabulary for the token at position start + d. It proposes all L positions at once
and each row is a *marginal*: the drafter does not say how depth 2 depends on the token picked at
depth 1. ``top_candidates`` keeps the K best per depth as float32 log-probabilities.

This chapter draws those distributions for one round on preset ``tiny`` with the golden prompt,
for the three drafters of ``ddtree.drafters``: the oracle (knows the target's greedy continuation),
the noisy oracle (the oracle with seeded mistakes) and the n-gram drafter (copies what followed
earlier occurrences of the context's suffix). Their numba twins (``kernels/drafters.py``, the
same logits bit for bit) are what the engine runs in its round; this chapter calls the numpy ones.

Run: .venv/bin/python walkthrough/06_drafters.py

Writes docs/assets/figures/06_drafters_distributions.png and 06_drafters_report.txt (what it prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

from ddtree.drafters import DRAFTERS, NGramDrafter, NoisyOracleDrafter, make_drafter
from ddtree.tree import top_candidates

STEM = "06_drafters"
BLOCK_SIZE = 8          # L = 7 depths
K = 4                   # candidates shown per depth


def true_ranks(top_ids: np.ndarray, truth: np.ndarray) -> list[int | None]:
    """Rank of the true token among the top-K at each depth (None if it is not kept)."""
    ranks = []
    for row, token in zip(top_ids, truth, strict=True):
        hit = np.flatnonzero(row == token)
        ranks.append(int(hit[0]) if hit.size else None)
    return ranks


def draw_panel(ax, top_logprobs, top_ids, truth, title):
    """Grouped bars: K probabilities per depth, the true token's bar in orange."""
    depths, k = top_logprobs.shape
    width = 0.8 / k
    for d in range(depths):
        for r in range(k):
            x = d + 1 + (r - (k - 1) / 2) * width
            hit = top_ids[d, r] == truth[d]
            ax.bar(x, np.exp(top_logprobs[d, r]), width * 0.92, bottom=1e-4,
                   color="#e6550d" if hit else "#9ecae1", edgecolor="#444444", lw=0.4)
            if hit or r == 0:                      # label the truth, and the drafter's favourite
                ax.text(x, np.exp(top_logprobs[d, r]) * 1.25, str(int(top_ids[d, r])), ha="center",
                        fontsize=8.5, color="#e6550d" if hit else "#555555")
        if truth[d] not in top_ids[d]:
            ax.text(d + 1, 2.2e-4, "x", ha="center", fontsize=10, color="#c0392b", fontweight="bold")
    ax.set_yscale("log")
    ax.set_ylim(1e-4, 3)
    ax.set_xticks(range(1, depths + 1))
    ax.set_xlabel("depth d (token at position start + d)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def noisy_rates(vocab: int, depths: int, positions: int = 400):
    """How often the noisy oracle ranks the truth first / keeps it at all, per depth."""
    drafter = NoisyOracleDrafter(np.arange(positions) % vocab, vocab)
    first = np.zeros(depths)
    kept = np.zeros(depths)
    for p in range(positions):
        for d in range(1, depths + 1):
            ranked = drafter.noisy_ranking(p, d)
            first[d - 1] += ranked[0] == p % vocab
            kept[d - 1] += (p % vocab) in ranked
    expected = np.array([drafter.top1_probability(d) for d in range(1, depths + 1)])   # truth ranked first
    expected_kept = 1 - (1 - expected) * (1 - drafter.keep_rate)                   # not demoted and dropped
    return first / positions, kept / positions, expected, expected_kept


def first_round(setup) -> list:
    """Each drafter's top-K for round 0 (root = the prompt's last token); one figure panel each."""
    prompt, ar_tokens = setup.prompt, setup.ar_tokens                        # [8], [24]
    depths = BLOCK_SIZE - 1
    truth = ar_tokens[:depths]                # the token at position start + d is AR token d - 1
    print(f"preset tiny, vocab {setup.config.vocab_size}; prompt {prompt.tolist()}")
    print(f"  root {int(prompt[-1])} at position {prompt.size - 1}; the target's greedy tokens at "
          f"depths 1..{depths}:")
    print(f"  {truth.tolist()}")
    panels = []
    for name in DRAFTERS:
        drafter = make_drafter(name, setup.model, prompt, ar_tokens.size)
        logits = drafter.propose(prompt, BLOCK_SIZE)                              # [L, V]
        top_logprobs, top_ids = top_candidates(logits, K)                         # [L, K]
        ranks = true_ranks(top_ids, truth)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))               # [L, V]
        p_true = (probs / probs.sum(axis=-1, keepdims=True))[np.arange(depths), truth]  # [L]
        print(f"{name:>6}: logits {logits.shape}, rank of the true token per depth "
              f"{['-' if r is None else r for r in ranks]}")
        print(f"{'':>8}p(true) {np.array2string(p_true, precision=3, floatmode='fixed')}")
        panels.append((top_logprobs, top_ids, truth, f"{name} (round 0)"))
    return panels


def ngram_after_repeat(setup):
    """The n-gram drafter in the round whose root repeats an earlier token; one figure panel.

    AR token 6 repeats AR token 0 (301), so in the round whose root is that second 301 the suffix
    matches and the drafter votes for what followed the first one.
    """
    prompt, ar_tokens = setup.prompt, setup.ar_tokens
    depths = BLOCK_SIZE - 1
    repeat = int(np.flatnonzero(ar_tokens[1:] == ar_tokens[0])[0]) + 1
    context = np.concatenate([prompt, ar_tokens[:repeat + 1]])                    # ends with the repeat
    truth = ar_tokens[repeat + 1:repeat + 1 + depths]
    logits = NGramDrafter(setup.config.vocab_size).propose(context, BLOCK_SIZE)   # [L, V]
    top_logprobs, top_ids = top_candidates(logits, K)
    print(f" ngram after the repeated token {int(ar_tokens[repeat])}:")
    print(f"   proposes {top_ids[:, 0].tolist()} (what followed its first occurrence)")
    print(f"   truth    {truth.tolist()}, ranks "
          f"{['-' if r is None else r for r in true_ranks(top_ids, truth)]}")
    return top_logprobs, top_ids, truth, f"ngram (root = repeated token {int(ar_tokens[repeat])})"


def print_noisy_rates(vocab: int) -> None:
    depths = BLOCK_SIZE - 1
    first, kept, expected, expected_kept = noisy_rates(vocab, depths)
    with chapter.section("noisy_rates"):
        print("noisy oracle over 400 positions, per depth d:")
        print(f"  {'d':<42} " + " ".join(f"{d:>5}" for d in range(1, depths + 1)))
        for label, rates in (("truth ranked first, measured", first),
                             ("  promised: p = top1_rate * decay^(d-1)", expected),
                             ("truth in the top 4 at all, measured", kept),
                             ("  promised: 1 - (1 - p) * (1 - keep_rate)", expected_kept)):
            print(f"  {label:<42} " + " ".join(f"{r:>5.2f}" for r in rates))


def plot_distributions(panels) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(8.5, 7.4), sharey=True)
    for ax, panel in zip(axes.flat, panels, strict=True):
        draw_panel(ax, *panel)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"top-{K} probabilities (log)")
    fig.suptitle("Drafter distributions for one round (preset tiny, golden prompt, block 8)\n"
                 "orange = the target's true token, x = not in the top 4", fontsize=11)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "distributions")


def main() -> None:
    """One round of each drafter on preset tiny, the noisy oracle's rates, the figure."""
    setup = chapter.golden_model("tiny")
    panels = first_round(setup)
    panels.append(ngram_after_repeat(setup))
    print_noisy_rates(setup.config.vocab_size)
    plot_distributions(panels)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
