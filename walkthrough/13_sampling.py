"""Chapter 13: sampling at temperature > 0, checkable token for token, and a sampled tree.

The token at absolute position p is drawn with random numbers that are a pure function of
(seed, p) (Philox4x32-10, Gumbel-max). A tree node at position p has AR's logits there, bit for
bit, so it draws AR's token: DDTree == AR at any temperature, which this chapter checks, and shows
failing for the usual sampler that takes numbers from one generator in call order.

Then what a tree can accept. Per-node sampling accepts a node's fixed children with probability
sum p(children): one verify step at a time, at the 40 positions of a sampled run with 100 seeds
each, fixed top-K children against children drawn from the drafter and verified by recursive
rejection sampling, both against their predictions. The sampled tree is checked exact in
distribution by enumerating every outcome on a small table target. Whole generations compare the
chain, the tree, the sampled chain (classic speculative sampling) and the sampled tree in
committed tokens per verify forward against the temperature, for the noisy oracle and the n-gram
drafter (preset tiny, golden prompt, 40 tokens, block 8, budget 32, three sampling seeds). Last,
the numba sampler and rejection step against numpy, and how rarely log rounding can move a draw.

Run: .venv/bin/python walkthrough/13_sampling.py

Writes docs/assets/figures/13_sampling_acceptance.png, 13_sampling_one_step.png,
13_sampling_exact.png and 13_sampling_report.txt (what it prints).
"""

import collections
import contextlib
import functools
import itertools
import math

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.sampling as gpu
from ddtree import decode, sampling
from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import make_drafter
from ddtree.tree import build_tree, top_candidates
from kernels.bench.cases import sampling as cost
from kernels.device import SIMULATOR

STEM = "13_sampling"
NEW_TOKENS, BLOCK_SIZE, BUDGET = 40, 8, 32
TEMPERATURES = (0.0, 0.3, 0.6, 1.0, 1.5, 2.0)
SEEDS = (0, 1, 2)                 # sampling seeds: each point of the sweep averages over them
VERIFIERS = {                     # name -> (topk, verifier)
    "chain (topk 1)": (1, "node"),
    "tree, per-node sampling": (None, "node"),
    "sampled chain, rejection": (1, "rejection"),
    "sampled tree, rejection": (None, "rejection"),
}
STYLE = {"chain (topk 1)": ("#444444", "s", "--"), "tree, per-node sampling": ("#e6550d", "o", "-"),
         "sampled chain, rejection": ("#6baed6", "^", "--"), "sampled tree, rejection": ("#08519c", "D", "-")}


# ------------------------------------------------------------------------------- the keys

@contextlib.contextmanager
def stream_sampling():
    """Swap the decoders' sampler for the usual one: Gumbel numbers from one generator per seed,
    taken in call order (a tree round takes a row of numbers per node, AR one row per token)."""
    generators = {}

    def sample_in_call_order(logits, positions, temperature, seed):
        logits = np.asarray(logits, np.float64)
        generator = generators.setdefault(seed, np.random.default_rng(seed))
        return np.argmax(logits / temperature + generator.gumbel(size=logits.shape), axis=-1)

    saved = decode.sample
    decode.sample = sample_in_call_order
    try:
        yield generators
    finally:
        decode.sample = saved


def first_difference(a, b) -> int | None:
    differ = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(differ[0]) if differ.size else None


def keys_report(setup, temperature: float = 0.8, seed: int = 0) -> None:
    model, prompt = setup.model, setup.prompt
    with chapter.section("keys"):
        position = prompt.size
        words = sampling.philox((0, position, 0, sampling.SAMPLE), (seed, 0))
        u = sampling.uniforms([position], [0, 1, 2], seed, sampling.SAMPLE)[0]
        print(f"seed {seed}, position {position}, token 0: Philox words "
              + " ".join(f"{int(w):08x}" for w in words))
        print(f"  tokens 0, 1, 2: uniforms {', '.join(f'{x:.6f}' for x in u)}")
        print(f"                  Gumbel numbers {', '.join(f'{-math.log(-math.log(x)):+.4f}' for x in u)}")
        print(f"temperature {temperature}, sampling seed {seed}, {NEW_TOKENS} tokens, noisy oracle, block "
              f"{BLOCK_SIZE}, budget {BUDGET}:")
        for name, sampler in (("position-keyed", contextlib.nullcontext), ("one generator", stream_sampling)):
            with sampler():
                ar = generate_ar(model, prompt, NEW_TOKENS, temperature=temperature, seed=seed)
            with sampler():                                  # a fresh generator: DDTree starts where AR did
                drafter = make_drafter("noisy", model, prompt, NEW_TOKENS, continuation=ar)
                tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=BLOCK_SIZE,
                                                budget=BUDGET, temperature=temperature, seed=seed)
            where = first_difference(tokens, ar)
            verdict = "yes" if where is None else f"no: they part at token {where}"
            print(f"  {name:>14}: DDTree == AR: {verdict}")
            assert (where is None) == (name == "position-keyed"), name


# ------------------------------------------------------------------------- the sweep

SAMPLED_AR = {}


def sampled_ar(setup, temperature: float, seed: int):
    """AR's tokens and step logits at (temperature, seed): the oracles' truth, the target's p."""
    if (temperature, seed) not in SAMPLED_AR:
        SAMPLED_AR[temperature, seed] = generate_ar(setup.model, setup.prompt, NEW_TOKENS, return_logits=True,
                                                    temperature=temperature, seed=seed)
    return SAMPLED_AR[temperature, seed]


def verify_steps(trace):
    """Every verify step of a generation at a node with children (a node the walk reached):
    (round, depth j, the children's tokens, whether the walk moved on to a child)."""
    for record in trace.rounds:
        for j, node in enumerate(record.accepted):
            kids = np.flatnonzero(record.parents == node)
            if kids.size:                                # a leaf has nothing to accept
                yield record, j, record.tokens[kids], j + 1 < record.accepted.size


def predicted_steps(trace, ar_logits, prompt_size: int, temperature: float):
    """Per-node sampling: (sum p(children), accepted) per verify step, p from AR's logits at the
    drawn position (the tree's logits are the same, bit for bit)."""
    rows = []
    for record, j, kids, accepted in verify_steps(trace):
        step = record.start + j + 1 - prompt_size        # the AR step that drew this position
        p = sampling.softmax(ar_logits[step].astype(np.float64) / temperature)
        rows.append((float(p[kids].sum()), accepted))
    return rows


def sweep(setup):
    """Tokens per verify forward: every drafter x verifier x temperature, averaged over SEEDS."""
    model, prompt = setup.model, setup.prompt
    results = {}                                         # (drafter, verifier) -> [mean per temperature]
    calibration = collections.defaultdict(list)          # temperature -> [(sum p(children), accepted)]
    sampled_steps = collections.defaultdict(list)        # temperature -> [accepted]
    for drafter_name, verifier_name in itertools.product(("noisy", "ngram"), VERIFIERS):
        topk, verifier = VERIFIERS[verifier_name]
        means = []
        for temperature in TEMPERATURES:
            per_seed = []
            for seed in SEEDS:
                ar, ar_logits = sampled_ar(setup, temperature, seed)
                drafter = make_drafter(drafter_name, model, prompt, NEW_TOKENS, continuation=ar)
                tokens, trace = generate_ddtree(model, prompt, NEW_TOKENS, drafter, block_size=BLOCK_SIZE,
                                                budget=BUDGET, topk=topk, temperature=temperature, seed=seed,
                                                verifier=verifier)
                if verifier == "node" or temperature == 0:
                    assert np.array_equal(tokens, ar), f"{verifier_name}, T={temperature}: DDTree != AR"
                if drafter_name == "ngram" and temperature > 0 and verifier_name == "tree, per-node sampling":
                    calibration[temperature] += predicted_steps(trace, ar_logits, prompt.size, temperature)
                if drafter_name == "ngram" and temperature > 0 and verifier_name == "sampled tree, rejection":
                    sampled_steps[temperature] += [accepted for *_, accepted in verify_steps(trace)]
                per_seed.append(trace.tokens_per_forward)
            means.append(float(np.mean(per_seed)))
        results[drafter_name, verifier_name] = means
    return results, calibration, sampled_steps


def print_sweep(results) -> None:
    with chapter.section("acceptance"):
        print(f"committed tokens per verify forward (block {BLOCK_SIZE}, budget {BUDGET}, {NEW_TOKENS} "
              f"tokens, mean of seeds {list(SEEDS)}):")
        header = "".join(f"{'T=' + format(t, 'g'):>7}" for t in TEMPERATURES)
        for drafter_name in ("noisy", "ngram"):
            print(f"{drafter_name:<7}{'verifier':<26}{header}")
            for verifier_name in VERIFIERS:
                row = "".join(f"{m:7.2f}" for m in results[drafter_name, verifier_name])
                print(f"{'':<7}{verifier_name:<26}{row}")


def plot_sweep(results) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    for ax, drafter_name in zip(axes, ("noisy", "ngram"), strict=True):
        for verifier_name in VERIFIERS:
            color, marker, line = STYLE[verifier_name]
            ax.plot(TEMPERATURES, results[drafter_name, verifier_name], color=color, marker=marker, ls=line,
                    label=verifier_name, mfc="none" if line == "--" else color)
        ax.set_xlabel("temperature (0: greedy)")
        ax.set_title(f"{drafter_name} drafter", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylabel("committed tokens\nper verify forward")
    axes[0].set_ylim(0, 5)                    # the ceiling, block 8, is off the scale of both panels
    axes[1].set_ylim(0.9, 2.0)
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "acceptance")


def calibration_report(calibration, sampled_steps) -> None:
    """The decode sweep's verify steps (n-gram drafter): per-node sampling against its prediction."""
    with chapter.section("calibration"):
        print("n-gram drafter, every verify step of the sweep at a node with children: the share that")
        print("accepts a child; per-node sampling predicted by the mean sum p(children), +- one standard")
        print("error of the observed share; and the sampled tree's share (same drafter and seeds):")
        print(f"{'T':>5} {'steps':>6} {'predicted':>10} {'observed':>15}   {'sampled tree':>12}")
        for temperature in TEMPERATURES[1:]:
            rows = np.array(calibration[temperature])                           # [steps, 2]
            error = np.sqrt(rows[:, 0].mean() * (1 - rows[:, 0].mean()) / len(rows))
            print(f"{temperature:5g} {len(rows):6d} {rows[:, 0].mean():10.3f} {rows[:, 1].mean():9.3f} "
                  f"+- {error:.3f}   {np.mean(sampled_steps[temperature]):12.3f}")


ONE_STEP_SEEDS = 100              # draws per position in the one-step experiment
DRAFT_NOISE = 1.0                 # the drafter's logits: the target's plus N(0, 1)


def one_step_report(setup) -> None:
    """One verify step at a time, at the 40 positions of AR's sampled run, 100 seeds each: a
    drafter that knows the target's distribution up to noise (not its draws) offers K children.
    Fixed: its top K, accepted by per-node sampling with probability sum p(children). Sampled: K
    drawn from q, accepted by rejection sampling (K = 1: probability sum min(p, q))."""
    rng = np.random.default_rng(15)
    positions = setup.prompt.size + np.arange(NEW_TOKENS)
    results = {}
    for temperature in TEMPERATURES[1:]:
        _, logits = sampled_ar(setup, temperature, 0)                        # [40, V] the target's
        draft = logits + rng.standard_normal(logits.shape).astype(np.float32) * DRAFT_NOISE   # [40, V]
        for k in (1, 4):
            predicted_fixed = predicted_sampled = hits_fixed = hits_sampled = 0.0
            for step, position in enumerate(positions):
                p = sampling.softmax(logits[step].astype(np.float64) / temperature)
                q = sampling.softmax(draft[step].astype(np.float64) / temperature)
                fixed = np.argsort(-draft[step], kind="stable")[:k]             # the drafter's top K
                predicted_fixed += p[fixed].sum()
                predicted_sampled += np.minimum(p, q).sum()
                for seed in range(ONE_STEP_SEEDS):
                    random = sampling.KeyedRandom(seed)
                    token = sampling.sample(logits[step:step + 1], [position], temperature, seed)[0]
                    hits_fixed += token in fixed
                    drawn = random.draw(int(position), draft[step].astype(np.float64) / temperature, k)
                    token = sampling.verify_node(logits[step], draft[step], drawn, temperature, int(position),
                                                 random)
                    hits_sampled += token in drawn
            draws = len(positions) * ONE_STEP_SEEDS
            results[temperature, k] = (predicted_fixed / len(positions), hits_fixed / draws,
                                       predicted_sampled / len(positions), hits_sampled / draws)
    with chapter.section("one_step"):
        print(f"one verify step, {len(positions)} positions x {ONE_STEP_SEEDS} seeds; the drafter's logits: "
              f"the target's + N(0, {DRAFT_NOISE:g})")
        print(f"{'T':>5} {'K':>2}   {'fixed: predicted':>16} {'observed':>8}   "
              f"{'sampled: sum min(p,q)':>21} {'observed':>8}")
        for (temperature, k), (pf, of, ps, os_) in results.items():
            bound = f"{ps:21.3f}" if k == 1 else f"{'':>21}"
            print(f"{temperature:5g} {k:2d}   {pf:16.3f} {of:8.3f}   {bound} {os_:8.3f}")
    temperatures = TEMPERATURES[1:]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8), sharey=True)
    for ax, k in zip(axes, (1, 4), strict=True):
        rows = np.array([results[t, k] for t in temperatures])                  # [T, 4]
        ax.plot(temperatures, rows[:, 0], color="#e6550d", ls="-", label="fixed top-K: sum p(children)")
        ax.plot(temperatures, rows[:, 1], color="#e6550d", ls="none", marker="o", label="fixed: observed")
        if k == 1:
            ax.plot(temperatures, rows[:, 2], color="#08519c", ls="-", label="sampled: sum min(p, q)")
        ax.plot(temperatures, rows[:, 3], color="#08519c", ls="none", marker="D", label="sampled: observed")
        ax.set_xlabel("temperature")
        ax.set_title(f"K = {k} {'child' if k == 1 else 'children'} per node", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("probability that a verify\nstep accepts a child")
    axes[0].set_ylim(0, 1.05)
    axes[1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "one_step")


# ------------------------------------------------------------------ exact in distribution

class TableDrafter:
    """Per-depth logits conditioned on the context's last token (the hand-made drafter)."""

    def __init__(self, table):
        self.table = np.asarray(table, np.float32)                                   # [V, L, V]

    def propose(self, context, block_size):
        return self.table[int(context[-1]), :block_size - 1]                         # [L, V]


def exact_report() -> None:
    """Every outcome of the sampled tree on a bigram target (V = 4, block 3, budget 3, two
    candidates per depth), three tokens ahead, against the target's own distribution."""
    vocab, horizon, block_size, budget, topk = 4, 3, 3, 3, 2
    rng = np.random.default_rng(15)
    target = (rng.standard_normal((vocab, vocab)) * 1.5).astype(np.float32)          # [V, V] logits
    drafter = TableDrafter(target[:, None, :] + rng.standard_normal((vocab, block_size - 1, vocab)) * 1.5)

    def one_round(random, last, temperature):
        draft = drafter.propose([last], block_size)                                  # [L, V]
        shape = build_tree(last, *top_candidates(draft, topk), budget)
        tree = sampling.draw_children(shape, draft, 0, temperature, random)
        accepted, bonus = sampling.rejection_walk(tree, target[tree.tokens], draft, 0, temperature, random)
        return tuple(int(t) for t in tree.tokens[accepted[1:]]) + (bonus,)

    def committed(temperature):
        rounds = functools.cache(lambda last: list(sampling.outcomes(
            functools.partial(one_round, last=last, temperature=temperature))))
        return (sampling.committed_distribution(rounds, 0, horizon),
                sum(len(rounds(last)) for last in range(vocab)))

    sequences = list(itertools.product(range(vocab), repeat=horizon))
    with chapter.section("exact"):
        print(f"bigram target, V = {vocab}, block {block_size}, budget {budget}, {topk} candidates per "
              f"depth; P(first {horizon} tokens),")
        print(f"  every sequence of {horizon} tokens ({vocab ** horizon}) against the target's own product:")
        for temperature in (0.5, 1.0, 2.0):
            got, paths = committed(temperature)
            steps = {last: sampling.softmax(target[last].astype(np.float64) / temperature)
                     for last in range(vocab)}
            expected = [math.prod(steps[a][b] for a, b in zip((0,) + s[:-1], s, strict=True))
                        for s in sequences]
            error = max(abs(got.get(s, 0.0) - e) for s, e in zip(sequences, expected, strict=True))
            print(f"  T = {temperature:g}: {paths} outcome paths (one round, 4 roots); "
                  f"max |committed - target| = {error:.1e}")
            assert error < 1e-12
            if temperature == 1.0:
                shown_got, shown_expected = [got.get(s, 0.0) for s in sequences], expected
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = np.arange(len(sequences))
    ax.bar(x - 0.2, shown_expected, width=0.4, color="#bbbbbb", label="target, token by token")
    ax.bar(x + 0.2, shown_got, width=0.4, color="#08519c", label="sampled tree, every outcome enumerated")
    ax.set_xticks(x[::4])
    ax.set_xticklabels(["".join(map(str, sequences[i])) for i in x[::4]], fontsize=8)
    ax.set_xlabel("the first three committed tokens (root 0), T = 1")
    ax.set_ylabel("probability")
    ax.legend(fontsize=8)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "exact")


# ------------------------------------------------------------------------- the kernels

def kernels_report(setup, temperature: float = 0.8, seed: int = 0) -> None:
    """One round's first rows through the numba sampler and rejection step, against numpy."""
    model, prompt = setup.model, setup.prompt
    ar, _ = sampled_ar(setup, temperature, seed)
    draft = make_drafter("ngram", model, prompt, NEW_TOKENS).propose(prompt, BLOCK_SIZE)
    shape = build_tree(int(prompt[-1]), *top_candidates(draft, 4), 12)
    tree = sampling.draw_children(shape, draft, prompt.size - 1, temperature, sampling.KeyedRandom(seed))
    cache = model.new_cache(prompt.size + tree.size)
    model.forward(cache, prompt[:-1])
    logits = model.forward(cache, tree.tokens, positions=prompt.size - 1 + tree.depths,
                           visible=model.ops.visibility(tree.parents))
    rows = 4                                  # the simulator runs a Python thread per CUDA thread
    positions = prompt.size + tree.depths[:rows]
    children = sampling.child_tokens(tree)[:rows]
    with chapter.section("kernels"):
        print(f"numba ({'CUDA simulator' if SIMULATOR else 'GPU'}), the first {rows} rows of a verified tree "
              f"(V = {logits.shape[1]}), T = {temperature}, seed {seed}:")
        with chapter.timed("numba sample"):
            got = gpu.sample(logits[:rows], positions, temperature, seed)
        expected = sampling.sample(logits[:rows], positions, temperature, seed)
        print(f"  sample:         {got.tolist()}  numpy {expected.tolist()}  identical: "
              f"{np.array_equal(got, expected)}")
        with chapter.timed("numba rejection_step"):
            got = gpu.rejection_step(logits[:rows], positions, children, draft, tree.depths[:rows],
                                     temperature, seed)
        expected = sampling.rejection_step(logits[:rows], positions, children, draft, tree.depths[:rows],
                                           temperature, seed)
        print(f"  rejection_step: {got.tolist()}  numpy {expected.tolist()}  identical: "
              f"{np.array_equal(got, expected)}")
        assert np.array_equal(got, expected)


def boundary_report() -> None:
    """numpy's log against libm's (what the simulator's kernels run) over a million Gumbel numbers."""
    rows, vocab, seed = 2000, 512, 7
    logits = (np.random.default_rng(9).standard_normal((rows, vocab)) * 2).astype(np.float64)
    u = sampling.uniforms(np.arange(rows), np.arange(vocab), seed, sampling.SAMPLE)          # [T, V]
    numpy_scores = logits - np.log(-np.log(u))
    libm_scores = logits + np.vectorize(lambda x: -math.log(-math.log(x)), otypes=[np.float64])(u)
    d = float(np.abs(numpy_scores - libm_scores).max())
    top2 = np.sort(numpy_scores, axis=-1)[:, -2:]
    close = int(np.count_nonzero(top2[:, 1] - top2[:, 0] <= 2 * d))
    moved = int(np.count_nonzero(np.argmax(numpy_scores, -1) != np.argmax(libm_scores, -1)))
    with chapter.section("boundary"):
        print(f"{rows} draws over {vocab} tokens at T = 1: numpy's log and libm's differ on "
              f"{np.count_nonzero(numpy_scores != libm_scores)} of {rows * vocab} scores,")
        print(f"  by at most d = {d:.1e}; draws with their two best scores within 2d: {close} "
              f"(expected <= {rows * math.expm1(2 * d):.0e});")
        print(f"  draws that moved: {moved}")


def sampler_bytes() -> None:
    rows, vocab = 65, 163840
    moved = cost.bytes_moved("sample", T=rows, V=vocab)
    with chapter.section("bytes"):
        chapter.print_gpu()
        print(f"sample, {rows} tree rows of Kimi K2.6's vocabulary ({vocab}): {moved / 1e6:.1f} MB read,")
        print(f"  {chapter.time_floor(moved) * 1e6:.1f} us at the read bandwidth: a floor (Philox and two "
              "logs per entry")
        print("  are arithmetic on top, not measured here)")


def main() -> None:
    setup = chapter.golden_model("tiny")
    keys_report(setup)
    print()
    with chapter.timed("sweep"):
        results, calibration, sampled_steps = sweep(setup)
    print_sweep(results)
    plot_sweep(results)
    print()
    calibration_report(calibration, sampled_steps)
    print()
    with chapter.timed("one step"):
        one_step_report(setup)
    print()
    with chapter.timed("enumeration"):
        exact_report()
    print()
    kernels_report(setup)
    print()
    boundary_report()
    print()
    sampler_bytes()


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
