"""Chapter 0: linear layers, the embedding gather and greedy argmax.

Every projection of the model is ``y = x @ W.T`` with W stored (out, in) as in Hugging Face
state dicts. This chapter runs the numpy reference and both numba.cuda kernel versions (a tiled
shared-memory GEMM for many rows, a GEMV with one block per output for decode steps), checks the
embedding gather and the first-index argmax (ties go to the lowest id), and counts the bytes a
decode step must move through the biggest matrix of Kimi K2.6, the lm_head: it is bandwidth
bound until a few dozen rows share every weight read.

    python walkthrough/00_linear.py

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

STEM = "00_linear"
FLOAT = 4                      # bytes per float32
H200_BANDWIDTH = 4.8e12        # bytes/s, the H200's HBM3e peak
FP32_GEMM_RATE = 51e12         # FLOP/s, torch fp32 SGEMM (TF32 off) measured on the project's H200


# --8<-- [start:lm_head_cost]
def linear_cost(rows: int, n_out: int, n_in: int) -> tuple[float, float]:
    """(bytes, FLOPs) of y (T, N) = x (T, K) @ W.T at float32: W, x and y each cross memory once."""
    bytes_moved = FLOAT * (n_out * n_in + rows * n_in + rows * n_out)
    flops = 2.0 * rows * n_out * n_in
    return bytes_moved, flops


def time_floor(rows: int, n_out: int, n_in: int) -> float:
    """Seconds the layer needs at best: the slower of moving its bytes and doing its FLOPs."""
    bytes_moved, flops = linear_cost(rows, n_out, n_in)
    return max(bytes_moved / H200_BANDWIDTH, flops / FP32_GEMM_RATE)
# --8<-- [end:lm_head_cost]


def check_kernels(rng) -> None:
    """numpy reference vs both numba versions on irregular shapes (not multiples of a block)."""
    weight = rng.standard_normal((21, 45)).astype(np.float32)          # [N, K]
    for rows, version in ((2, "gemv"), (19, "gemm")):
        x = rng.standard_normal((rows, 45)).astype(np.float32)         # [T, K]
        with chapter.timed(f"numba linear {version}"):
            got = knl.linear(x, weight, version=version, threads=32)
        want = ref.linear(x, weight)
        print(f"linear {version}: x {x.shape} @ W.T {weight.shape} -> {got.shape}, "
              f"max |numpy - numba| = {np.abs(got - want).max():.2e}")
    print(f"  version=None picks {knl.pick_version(1)!r} for 1 row and {knl.pick_version(19)!r} for 19")

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


def lm_head_report() -> None:
    kimi = preset("kimi-k2.6")
    vocab, hidden = kimi.vocab_size, kimi.hidden_size
    bytes_1, flops_1 = linear_cost(1, vocab, hidden)
    print(f"Kimi K2.6 lm_head ({vocab} x {hidden}, fp32), one decode row:")
    print(f"  {bytes_1 / 1e9:.2f} GB, {flops_1 / 1e9:.2f} GFLOP, {flops_1 / bytes_1:.2f} FLOP/byte "
          f"-> at least {bytes_1 / H200_BANDWIDTH * 1e3:.3f} ms at 4.8 TB/s")
    for rows in (1, 65):
        print(f"  {rows:3d} rows: time floor {time_floor(rows, vocab, hidden) * 1e3:.3f} ms")
    crossover = next(t for t in range(1, 4096) if
                     linear_cost(t, vocab, hidden)[1] / FP32_GEMM_RATE >
                     linear_cost(t, vocab, hidden)[0] / H200_BANDWIDTH)
    print(f"  compute-bound (fp32, 51 TFLOP/s) from {crossover} rows on")
    plot_roofline(vocab, hidden, crossover)


def plot_roofline(vocab: int, hidden: int, crossover: int) -> None:
    rows = np.unique(np.logspace(0, 9, 200, base=2).astype(int))
    memory = np.array([linear_cost(t, vocab, hidden)[0] / H200_BANDWIDTH for t in rows]) * 1e3
    compute = np.array([linear_cost(t, vocab, hidden)[1] / FP32_GEMM_RATE for t in rows]) * 1e3
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.loglog(rows, memory, label="bytes / 4.8 TB/s (read W once)", color="tab:blue")
    ax.loglog(rows, compute, label="FLOPs / 51 TFLOP/s (fp32)", color="tab:orange")
    ax.loglog(rows, np.maximum(memory, compute), color="black", lw=2.5, alpha=0.35, label="time floor")
    for t, name in ((1, "decode row"), (65, "64-node tree + root")):
        ax.axvline(t, color="gray", ls=":", lw=1)
        ax.annotate(name, (t, memory[0] * 0.35), rotation=90, fontsize=9, ha="right")
    ax.axvline(crossover, color="tab:red", ls="--", lw=1, label=f"crossover: {crossover} rows")
    ax.set_xlabel("rows T sharing one pass over W")
    ax.set_ylabel("ms per forward (lower bound)")
    ax.set_title(f"Kimi K2.6 lm_head {vocab} x {hidden}, fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "lm_head_roofline")


if __name__ == "__main__":
    with chapter.report(STEM):
        print(f"kernels run on: {device.where()}")
        check_kernels(np.random.default_rng(0))
        lm_head_report()
