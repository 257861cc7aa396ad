"""Chapter 10: KV compaction, keeping only the accepted path's cache rows.

Verification appended one latent-KV row per tree node at slots start..start+n, in node (pop)
order. Only the accepted path belongs to the sequence: slot start + j must receive the row of
accepted node j, then the cache length becomes start + m. Accepted node j sits at depth j, so its
rotary position (start + j) already equals its new slot: rows move, nothing is recomputed.

The copy is a gather with accepted[j] >= j. In increasing j, in place, it is safe: slot j is only
overwritten by step j, after every step that reads it. A parallel in-place copy is not: thread j
may overwrite slot j while thread j' < j still has to read it (when accepted[j'] = j). This chapter
finds such a round in a real generation, shows what one bad interleaving does, counts the fast path
(nothing to move), and runs the numba compaction (a thread per column, in one launch) against numpy.

Run: .venv/bin/python walkthrough/10_kv_compaction.py

Writes docs/assets/figures/10_kv_compaction_slots.png and 10_kv_compaction_report.txt (what it prints).
"""

import copy

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.kv_cache as gpu
from ddtree.config import preset
from ddtree.decode import generate_ddtree
from ddtree.drafters import make_drafter
from ddtree.kv_cache import compact
from kernels.bench.cases import kv_cache as kv_costs
from kernels.device import SIMULATOR

STEM = "10_kv_compaction"
BLOCK_SIZE, BUDGET, NEW_TOKENS = 8, 32, 24
MAX_SHOWN_SLOT = 12          # the figure shows slots start .. start + accepted[-1] + 2


# --8<-- [start:racy_compact]
def hazards(accepted: np.ndarray) -> list[int]:
    """Threads j whose source slot accepted[j] is also the destination of a later thread."""
    m = accepted.size
    return [j for j in range(m) if j < accepted[j] < m]


def racy_compact(cache, start: int, accepted: np.ndarray) -> None:
    """A parallel in-place copy under one legal schedule: the threads happen to run last-first."""
    for j in reversed(range(accepted.size)):
        cache.latent[:, start + j] = cache.latent[:, start + accepted[j]]
        cache.rope[:, start + j] = cache.rope[:, start + accepted[j]]
    cache.truncate(start + accepted.size)
# --8<-- [end:racy_compact]


def whose_rows(cache, before, start: int, count: int) -> list[int]:
    """For slots start..start+count-1: which tree node's verify row each now holds (-1: none)."""
    owners = []
    for s in range(start, start + count):
        match = [i for i in range(before.length - start)
                 if np.array_equal(cache.latent[:, s], before.latent[:, start + i])
                 and np.array_equal(cache.rope[:, s], before.rope[:, start + i])]
        owners.append(match[0] if match else -1)
    return owners


def draw_slots(ax, y, labels, colors, title, edges=None):
    for k, (label, color) in enumerate(zip(labels, colors, strict=True)):
        edge = (edges or {}).get(k, "#444444")
        ax.add_patch(Rectangle((k - 0.45, y - 0.3), 0.9, 0.6, fc=color, ec=edge,
                               lw=2.2 if k in (edges or {}) else 0.6))
        ax.text(k, y, label, ha="center", va="center", fontsize=8)
    ax.text(-0.7, y, title, ha="right", va="center", fontsize=9)


def kimi_compaction_bytes(kept: int) -> None:
    """Compaction at Kimi K2.6 scale: the fewest bytes (the cost model in kernels.bench.cases.kv_cache,
    what the column kernel moves), what a gather through scratch (two launches) would move, and the
    host time of launches."""
    kimi = preset("kimi-k2.6")
    dims = dict(Ly=kimi.num_hidden_layers, R=kimi.kv_lora_rank, dr=kimi.qk_rope_head_dim, m=kept)
    row = kimi.num_hidden_layers * kimi.latent_cache_width * 4         # one token, every layer, fp32
    fewest = kv_costs.bytes_moved(**dims, moved=kept - 1)                   # every accepted row but the root
    gathered = 2 * 2 * kept * row                                       # 2 launches x (read + write)
    hw = chapter.gpu()
    with chapter.section("kimi"):
        chapter.print_gpu()
        print(f"Kimi K2.6: one token's cache row = {kimi.num_hidden_layers} layers x "
              f"{kimi.latent_cache_width} floats x 4 B = {row / 1e3:.0f} KB; m = {kept} accepted rows")
        print(f"  fewest bytes (the {kept - 1} rows after the root move): {fewest / 1e6:.2f} MB, "
              f"{chapter.time_floor(fewest) * 1e6:.2f} us")
        print(f"  gather through scratch, then write back (all {kept} rows): {gathered / 1e6:.2f} MB, "
              f"{chapter.time_floor(gathered) * 1e6:.2f} us")
        print(f"  launches: a thread per column one, {hw.launch * 1e6:.1f} us of host time; through "
              f"scratch two, {2 * hw.launch * 1e6:.1f} us")


def compactions(setup, drafter_name: str, seed: int = 0):
    """One generation; the recorded compact calls: (cache before, start, accepted) per round."""
    drafter = make_drafter(drafter_name, setup.model, setup.prompt, NEW_TOKENS, seed=seed)
    with chapter.record_ops(setup.model, "compact") as calls:
        tokens, trace = generate_ddtree(setup.model, setup.prompt, NEW_TOKENS, drafter,
                                        block_size=BLOCK_SIZE, budget=BUDGET)
    assert np.array_equal(tokens, setup.ar_tokens)
    fast = sum(np.array_equal(call.args[2], np.arange(call.args[2].size)) for call in calls)
    print(f"{drafter_name} seed {seed}: fast path (nothing to move) in {fast} of {len(calls)} rounds; "
          f"accepted per round:")
    print("  " + " ".join(str(call.args[2].tolist()) for call in calls))
    return [call.args for call in calls], trace


def find_race(setup):
    """The first round, over noisy seeds 0, 1, ..., whose parallel in-place copy could race (and
    whose window fits the figure); also counts racy rounds among all rounds searched."""
    seen = racy = 0
    for seed in range(8):
        calls, trace = compactions(setup, "noisy", seed)
        seen += len(calls)
        racy += sum(bool(hazards(accepted)) for _, _, accepted in calls)
        racing = [r for r, (_, _, a) in enumerate(calls) if hazards(a) and a[-1] < MAX_SHOWN_SLOT]
        if racing:
            print(f"rounds whose parallel in-place copy could race, noisy seeds 0..{seed}: {racy} of {seen}")
            return seed, racing[0], calls[racing[0]], trace
    raise AssertionError("no round with a hazard found")


def replay_race(seed, shown, call):
    """Compact one round sequentially and under the last-first schedule; whose rows end where."""
    before, start, accepted = call
    good, bad = copy.deepcopy(before), copy.deepcopy(before)
    compact(good, start, accepted)
    racy_compact(bad, start, accepted)
    good_rows = whose_rows(good, before, start, accepted.size)
    bad_rows = whose_rows(bad, before, start, accepted.size)
    with chapter.section("race"):
        print(f"seed {seed}, round {shown}: tree rows at slots {start}..{before.length - 1}, "
              f"accepted {accepted.tolist()} -> slots {start}..{start + accepted.size - 1}")
        for j in hazards(accepted):
            print(f"  hazard: thread {j} reads slot {start + accepted[j]}, which thread {accepted[j]} "
                  f"overwrites with slot {start + accepted[accepted[j]]}")
        print(f"  sequential in place (j = 0, 1, ...): slots hold the rows of nodes {good_rows}")
        print(f"  parallel in place, threads last-first: slots hold the rows of nodes {bad_rows}  <- wrong")
    assert good_rows == accepted.tolist() and bad_rows != accepted.tolist()
    return good, good_rows, bad_rows


def plot_race(seed, shown, call, verify_tokens, good_rows, bad_rows) -> None:
    """Three rows of slots: after verify, after the sequential copy, after the last-first copy.

    Red fill: a slot that ends with the wrong row. Red outline: the source row that a later thread
    overwrote before the thread that needed it had read it.
    """
    _, start, accepted = call
    kept, width = accepted.size, int(accepted[-1]) + 3
    lost = {int(accepted[j]) for j in hazards(accepted)}                   # sources overwritten first
    orange, grey, red, green = "#fdae6b", "#f0f0f0", "#fb6a4a", "#a1d99b"
    fig, ax = plt.subplots(figsize=(8, 4.4))
    labels = [f"{start + i}\n#{i}\n{int(verify_tokens[i])}" for i in range(width)]
    draw_slots(ax, 2, labels, [orange if i in accepted else grey for i in range(width)],
               "after verify\n(tree rows,\nnode order)", edges={i: "#cb181d" for i in lost})
    labels = [f"{start + j}\n#{good_rows[j]}" if j < kept else f"{start + j}\nfree" for j in range(width)]
    draw_slots(ax, 0.6, labels, [green if j < kept else "white" for j in range(width)],
               "sequential,\nin place")
    labels = [f"{start + j}\n#{bad_rows[j]}" if j < kept else f"{start + j}\nfree" for j in range(width)]
    colors = [("white" if j >= kept else green if bad_rows[j] == accepted[j] else red) for j in range(width)]
    draw_slots(ax, -0.8, labels, colors, "parallel,\nlast-first")
    for j, a in enumerate(accepted):
        ax.annotate("", (j, 0.92), xytext=(a, 1.68),
                    arrowprops=dict(arrowstyle="->", color="#e6550d" if a != j else "#999999", lw=1.2))
    ax.set_xlim(-3.4, width)
    ax.set_ylim(-1.3, 2.5)
    ax.axis("off")
    ax.set_title(f"Round {shown} (noisy seed {seed}): slot start + j <- slot start + accepted[j], "
                 f"accepted = {accepted.tolist()}\nred outline: a row overwritten before it was read; "
                 "red fill: the slot that got a wrong row", fontsize=9)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "slots")


def check_kernel(call, good) -> None:
    """numba: a thread per column in one launch; the same cache afterwards."""
    before, start, accepted = call
    print(f"numba ({'CUDA simulator' if SIMULATOR else 'GPU'}):")
    print(f"  compact (cache {before.latent.shape} latent + {before.rope.shape} rope, m = {accepted.size}):")
    on_gpu = copy.deepcopy(before)
    with chapter.timed("numba compact"):
        gpu.compact(on_gpu, start, accepted)
    same = (on_gpu.length == good.length and np.array_equal(on_gpu.latent, good.latent, equal_nan=True)
            and np.array_equal(on_gpu.rope, good.rope, equal_nan=True))
    print(f"    identical to numpy, length {on_gpu.length}: {same}")
    assert same


def main() -> None:
    """Find a round whose parallel in-place copy races, replay it, check the numba compaction."""
    setup = chapter.golden_model("tiny")
    seed, shown, call, trace = find_race(setup)
    oracle_calls, _ = compactions(setup, "oracle")
    assert all(np.array_equal(a, np.arange(a.size)) for _, _, a in oracle_calls), \
        "the oracle's top-1 chain pops first (nodes 1..L): nothing to move"
    print()
    good, good_rows, bad_rows = replay_race(seed, shown, call)
    plot_race(seed, shown, call, trace.rounds[shown].tokens, good_rows, bad_rows)
    check_kernel(call, good)
    kimi_compaction_bytes(BLOCK_SIZE)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
