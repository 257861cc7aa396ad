"""Chapter 1: RMSNorm, one block per row and a shared-memory tree reduction.

    y = x / sqrt(mean(x^2) + eps) * weight

Each row's sum of squares is a reduction: the numba.cuda kernel gives a row to one block, lets
every thread accumulate a strided slice of the row in float32, then halves the number of partial
sums in shared memory (TPB/2, TPB/4, ..., 1) with a barrier after every step. This chapter replays
that reduction order in numpy for one row of 8 "threads" (the figure), checks the kernel against
the numpy reference on irregular shapes and block sizes, counts the bytes the layer moves at
Kimi K2.6's hidden size, and prints the two batches' device times on the GPU from the committed
benchmark record.

    .venv/bin/python walkthrough/01_rmsnorm.py

Writes docs/assets/figures/01_rmsnorm_tree_reduction.png and 01_rmsnorm_report.txt (what it prints).
"""

import re

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from ddtree import rmsnorm as ref
from ddtree.config import preset
from kernels import device
from kernels import rmsnorm as knl
from kernels.bench.cases import rmsnorm as cost

STEM = "01_rmsnorm"


# --8<-- [start:tree_reduction]
def tree_reduction(row: np.ndarray, threads: int) -> list[np.ndarray]:
    """The kernel's summation order, replayed in numpy: the partial sums after every step.

    Step 0: thread i sums x[d]^2 for d = i, i + TPB, i + 2 TPB, ... (float32).
    Step s: threads i < stride add partial[i + stride]; stride = TPB/2, TPB/4, ..., 1.
    """
    partial = np.zeros(threads, np.float32)
    for d in range(row.size):
        partial[d % threads] += row[d] * row[d]
    levels = [partial.copy()]
    stride = threads // 2
    while stride > 0:
        partial[:stride] += partial[stride:2 * stride]
        levels.append(partial[:stride].copy())
        stride //= 2
    return levels
# --8<-- [end:tree_reduction]


def check_kernel(rng) -> None:
    for rows, width, threads in ((5, 100, 32), (3, 37, 64)):
        x = (3 * rng.standard_normal((rows, width))).astype(np.float32)      # [T, D]
        weight = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)   # [D]
        with chapter.timed(f"numba rmsnorm {x.shape}"):
            got = knl.rmsnorm(x, weight, 1e-6, threads=threads)
        want = ref.rmsnorm(x, weight, 1e-6)
        rel = np.abs(got - want).max() / np.abs(want).max()
        print(f"rmsnorm x {x.shape}, {rows} blocks of {threads} threads: max |numpy - numba| / max|y| "
              f"= {rel:.2e}")


def plot_reduction(rng) -> None:
    row = rng.standard_normal(20).astype(np.float32)
    levels = tree_reduction(row, 8)
    total = float(levels[-1][0])
    print(f"tree reduction of a 20-float row with 8 threads: {total:.6f} "
          f"(numpy's pairwise sum: {float(np.sum(row * row)):.6f})")
    fig, ax = plt.subplots(figsize=(8.5, 3.9))
    width = 0.8
    for level, values in enumerate(levels):
        y = -level
        for i, value in enumerate(values):
            ax.add_patch(plt.Rectangle((i - width / 2, y - 0.3), width, 0.6, facecolor="#dfe6f7",
                                       edgecolor="#3b5bb5"))
            ax.text(i, y, f"{value:.2f}", ha="center", va="center", fontsize=9)
            if level > 0:
                stride = len(values)
                for source in (i, i + stride):
                    ax.annotate("", xy=(i, y + 0.3), xytext=(source, y + 0.7),
                                arrowprops=dict(arrowstyle="->", color="gray", lw=0.8))
        label = "thread partial sums\n(strided, float32)" if level == 0 else \
            f"stride {len(values)}:\np[i] += p[i + {len(values)}]"
        ax.text(8.0, y, label, va="center", fontsize=9)
        if level < len(levels) - 1:
            ax.text(9.9, y - 0.5, "syncthreads()", fontsize=9, color="tab:red", va="center")
    ax.set_xlim(-0.7, 11.3)
    ax.set_ylim(-len(levels) + 0.4, 0.6)
    ax.axis("off")
    ax.set_title("Shared-memory tree reduction of one row's sum of squares (TPB = 8 threads)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "tree_reduction")


def bytes_report() -> None:
    hidden = preset("kimi-k2.6").hidden_size
    with chapter.section("bytes"):
        chapter.print_gpu()
        print("Kimi K2.6 rmsnorm, fp32 (kernels.bench.cases.rmsnorm.bytes_moved):")
        for rows, what in ((1, "decode"), (65, "64-node tree + root"), (8192, "prefill chunk")):
            moved = cost.bytes_moved(T=rows, D=hidden)
            floor = chapter.time_floor(moved)
            print(f"  {rows:>5} x {hidden}: {moved / 1e6:8.3f} MB -> {floor * 1e6:7.2f} us at the read "
                  f"bandwidth ({what})")


def batch_report() -> None:
    """The default batch against the other one at Kimi's width, from one run of the benchmark."""
    cases, hw = chapter.bench_cases(), chapter.gpu()
    with chapter.section("batch"):
        print(f"{hw.name}, {hw.record} (read {hw.bandwidth / 1e9:.0f} GB/s):")
        # the default batch follows the row count (kernels.rmsnorm.row_batch); the "_other_batch"
        # cases run the other one at the same shapes
        for name in ("rmsnorm", "rmsnorm_other_batch", "rmsnorm_large", "rmsnorm_large_other_batch"):
            row = cases[name]
            note = re.search(r"batch \d+", row["note"]).group(0)
            print(f"  {row['shape']:<16} {note:<9} {row['device µs']:>6} us, {row['% of read BW']:>5}% "
                  f"of the read bandwidth; torch {row['torch µs']} us")


if __name__ == "__main__":
    with chapter.report(STEM):
        print(f"kernels run on: {device.where()}")
        rng = np.random.default_rng(0)
        check_kernel(rng)
        plot_reduction(rng)
        bytes_report()
        batch_report()
