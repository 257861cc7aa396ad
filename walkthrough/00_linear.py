"""Chapter 0: linear layers, the embedding gather and greedy argmax.

Every projection of the model is ``y = x @ W.T`` with W stored (out, in) as in Hugging Face
state dicts. This chapter runs the numpy reference and the numba.cuda kernel versions (a GEMV
with one block per output for decode steps, a tiled shared-memory GEMM for many rows, and the
engine's batch-invariant "lanes" with its readable form "warps"), shows that the GEMV and the GEMM
round a row differently while "lanes" gives a row the same bits alone and in a batch, checks the
embedding gather and the first-index argmax (ties go to the lowest id), and counts the bytes a
decode step must move through the biggest matrix of Kimi K2.6, the lm_head: it is bandwidth
bound until a few dozen rows share every weight read.

    .venv/bin/python walkthrough/00_linear.py

Writes docs/assets/figures/00_linear_lm_head_roofline.png and 00_linear_report.txt (what it prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from ddtree import linear as ref
from ddtree.config import preset
from kernels import device
from kernels import linear as knl
from kernels.bench.cases import linear as costs

STEM = "00_linear"


# --8<-- [start:lm_head_cost]
def lm_head_cost(rows: int, vocab: int, hidden: int) -> tuple[int, int]:
    """(bytes, FLOPs) of the lm_head over ``rows`` rows: the benchmark's cost model."""
    dims = dict(T=rows, Din=hidden, Dout=vocab)
    return costs.bytes_moved("linear", **dims), costs.flops("linear", **dims)
# --8<-- [end:lm_head_cost]


def check_kernels(rng) -> None:
    """numpy reference vs every numba version on irregular shapes (not multiples of a block)."""
    weight = rng.standard_normal((21, 45)).astype(np.float32)          # [N, K]
    x = rng.standard_normal((19, 45)).astype(np.float32)               # [T, K]
    want = ref.linear(x, weight)
    for version in knl.VERSIONS:
        with chapter.timed(f"numba linear {version}"):
            got = knl.linear(x, weight, version=version)
        print(f"linear {version}: x {x.shape} @ W.T {weight.shape} -> {got.shape}, "
              f"max |numpy - numba| = {np.abs(got - want).max():.2e}")
    with chapter.section("batch_invariance"):
        batch_invariance(x, weight)

    table = rng.standard_normal((50, 24)).astype(np.float32)           # [V, D]
    tokens = np.array([7, 0, 49, 7, 13])
    same = np.array_equal(knl.embed(tokens, table), ref.embed(tokens, table))
    print(f"embed: tokens {tokens.tolist()} from a {table.shape} table -> rows equal exactly: {same}")

    logits = rng.standard_normal((3, 40)).astype(np.float32)           # [T, V]
    logits[0, [5, 17, 31]] = 9.0                                       # a three-way tie in row 0
    logits[2, :] = 1.0                                                 # row 2: all equal
    got, want = knl.argmax(logits, threads=32), ref.argmax(logits)
    print(f"argmax with ties: numpy {want.tolist()}, numba {got.tolist()} "
          f"(ties go to the lowest id: {np.array_equal(got, want)})")


# --8<-- [start:batch_invariance]
def batch_invariance(x, weight) -> None:
    """Row 0 of ``x`` alone and in its batch: the GEMV for the one row against the GEMM for the
    batch (a library that picks by the row count), then the engine's "lanes" (the default) both ways."""
    for name, alone, batched in (
            ("gemv alone, gemm in the batch", knl.linear(x[:1], weight, version="gemv"),
             knl.linear(x, weight, version="gemm")[:1]),
            ("lanes alone, lanes in the batch", knl.linear(x[:1], weight), knl.linear(x, weight)[:1])):
        print(f"row 0, {name}: {np.count_nonzero(alone != batched)} of {alone.size} outputs differ "
              f"(largest difference {np.abs(alone - batched).max():.1e})")
# --8<-- [end:batch_invariance]


def lm_head_report() -> None:
    kimi = preset("kimi-k2.6")
    vocab, hidden = kimi.vocab_size, kimi.hidden_size
    hw = chapter.gpu()

    def floor(rows):
        return chapter.time_floor(*lm_head_cost(rows, vocab, hidden))

    def compute_bound(rows):
        moved, flops = lm_head_cost(rows, vocab, hidden)
        return flops / hw.fp32 > moved / hw.bandwidth

    crossover = next(t for t in range(1, 4096) if compute_bound(t))
    with chapter.section("lm_head"):
        chapter.print_gpu()
        print(f"Kimi K2.6 lm_head ({vocab} x {hidden}, fp32):")
        print(f"  {'rows':>4} {'GB':>6} {'GFLOP':>7} {'FLOP/B':>7} {'floor ms':>9}")
        for rows in (1, 65):
            moved, flops = lm_head_cost(rows, vocab, hidden)
            print(f"  {rows:>4} {moved / 1e9:>6.2f} {flops / 1e9:>7.2f} {flops / moved:>7.2f} "
                  f"{floor(rows) * 1e3:>9.3f}")
        print(f"  65 rows cost {floor(65) / floor(1):.1f}x one row; compute-bound from {crossover} rows on")
    plot_roofline(vocab, hidden, crossover)


def plot_roofline(vocab: int, hidden: int, crossover: int) -> None:
    hw = chapter.gpu()
    rows = np.unique(np.logspace(0, 9, 200, base=2).astype(int))
    memory = np.array([lm_head_cost(t, vocab, hidden)[0] / hw.bandwidth for t in rows]) * 1e3
    compute = np.array([lm_head_cost(t, vocab, hidden)[1] / hw.fp32 for t in rows]) * 1e3
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.loglog(rows, memory, label=f"bytes / {hw.bandwidth / 1e12:.2f} TB/s (read W once)", color="tab:blue")
    ax.loglog(rows, compute, label=f"FLOPs / {hw.fp32 / 1e12:.0f} TFLOP/s (fp32)", color="tab:orange")
    ax.loglog(rows, np.maximum(memory, compute), color="black", lw=2.5, alpha=0.35, label="time floor")
    for t, name in ((1, "decode row"), (65, "64-node tree + root")):
        ax.axvline(t, color="gray", ls=":", lw=1)
        ax.annotate(name, (t, compute[0] * 1.4), rotation=90, fontsize=9, ha="right", va="bottom")
    ax.axvline(crossover, color="tab:red", ls="--", lw=1, label=f"crossover: {crossover} rows")
    ax.set_xlabel("rows T sharing one pass over W")
    ax.set_ylabel("ms per forward (lower bound)")
    ax.set_title(f"Kimi K2.6 lm_head {vocab} x {hidden}, fp32\n{hw.name} figures ({hw.record})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "lm_head_roofline")


if __name__ == "__main__":
    with chapter.report(STEM):
        print(f"kernels run on: {device.where()}")
        check_kernels(np.random.default_rng(0))
        lm_head_report()
