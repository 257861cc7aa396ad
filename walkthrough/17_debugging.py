"""Debugging a kernel: the simulator, one thread in pdb, out-of-bounds errors, and their limits.

numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) runs a kernel as plain Python: every CUDA
thread is a Python thread, every array access goes through numpy. So ``print``, ``breakpoint()``
and Python's tracebacks work inside a kernel, and an index past the end of an array raises an
``IndexError`` that names the thread. This chapter

* runs a real kernel (``kernels.rmsnorm``) in the simulator against numpy;
* stops one thread (blockIdx.x == 1, threadIdx.x == 0) of a small kernel in pdb, with a scripted
  pdb session run in a subprocess, and prints the session;
* runs an off-by-one kernel and prints the simulator's out-of-bounds error;
* shows what the simulator cannot do: a warp shuffle is missing from it (the error is printed),
  and a missing barrier's race (the kernel run ten times, its wrong elements counted); races and
  timing are the subject of the page, with the GPU tools that see them.

Each demo is also a command to try: ``.venv/bin/python walkthrough/17_debugging.py stop`` (interactive pdb),
``oob``, ``shuffle`` and ``race`` (a missing barrier, run a few times).

Writes docs/assets/figures/17_debugging_report.txt (what it prints).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

if len(sys.argv) > 1:                # a demo: the kernels below need the simulator
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import numpy as np

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from kernels.device import cuda, where

STEM = "17_debugging"
PDB_COMMANDS = ["p cuda.blockIdx.x, cuda.threadIdx.x", "p row, tid, acc", "p x[row, tid], x[row, tid + 4]",
                "l", "c"]


# --8<-- [start:stop_one_thread]
@cuda.jit
def row_sum_squares(x, out):
    """out[row] = sum of x[row, :]^2; one block per row, a strided partial sum per thread."""
    partial = cuda.shared.array(32, np.float32)
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    acc = np.float32(0.0)
    for d in range(tid, x.shape[1], cuda.blockDim.x):
        acc += x[row, d] * x[row, d]
    if cuda.blockIdx.x == 1 and cuda.threadIdx.x == 0:     # simulator only
        breakpoint()
    partial[tid] = acc
    cuda.syncthreads()
    if tid == 0:
        total = np.float32(0.0)
        for t in range(cuda.blockDim.x):
            total += partial[t]
        out[row] = total
# --8<-- [end:stop_one_thread]


# --8<-- [start:off_by_one]
@cuda.jit
def forward_difference(x, out):
    """out[i] = x[i + 1] - x[i]: one thread per element of x, so the last thread reads past the end."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x.size:                           # guards x[i], not x[i + 1]
        out[i] = x[i + 1] - x[i]
# --8<-- [end:off_by_one]


@cuda.jit
def warp_sum(x, out):
    """A warp-shuffle reduction: fine on a GPU, absent from the simulator."""
    value = x[cuda.threadIdx.x]
    offset = 16
    while offset > 0:
        value += cuda.shfl_down_sync(0xFFFFFFFF, value, offset)
        offset //= 2
    if cuda.threadIdx.x == 0:
        out[0] = value


# --8<-- [start:race]
@cuda.jit
def reverse_block(x, out):
    """Reverse one block's elements through shared memory, WITHOUT the barrier it needs."""
    tile = cuda.shared.array(64, np.float32)
    i = cuda.threadIdx.x
    tile[i] = x[i]
    # missing: cuda.syncthreads(), so thread i may read tile[63 - i] before thread 63 - i wrote it
    out[i] = tile[cuda.blockDim.x - 1 - i]
# --8<-- [end:race]


def demo_stop() -> None:
    x = np.arange(24, dtype=np.float32).reshape(3, 8) / 8                 # [3 rows, 8 columns]
    out = np.zeros(3, np.float32)
    row_sum_squares[3, 4](x, out)                                         # 3 blocks of 4 threads
    print(f"out = {out.tolist()}; numpy: {(x * x).sum(axis=1).tolist()}")


def demo_oob() -> None:
    x = np.arange(100, dtype=np.float32)
    out = np.zeros(100, np.float32)
    forward_difference[4, 25](x, out)                                     # 100 threads, one per element


def demo_shuffle() -> None:
    out = np.zeros(1, np.float32)
    warp_sum[1, 32](np.ones(32, np.float32), out)
    print(f"warp sum = {out[0]}")


def demo_race(trials: int = 10) -> None:
    x = np.arange(64, dtype=np.float32)
    for trial in range(trials):
        out = np.zeros(64, np.float32)
        reverse_block[1, 64](x, out)
        print(f"trial {trial}: {int((out != x[::-1]).sum())} of 64 elements wrong")


DEMOS = {"stop": demo_stop, "oob": demo_oob, "shuffle": demo_shuffle, "race": demo_race}


def run_demo(name: str, stdin: str = "") -> list[str]:
    """Run ``python walkthrough/17_debugging.py <name>`` in the simulator; its output, with the
    machine's paths replaced by short names so that the report is the same everywhere."""
    result = subprocess.run([sys.executable, __file__, name], input=stdin, capture_output=True, text=True,
                            cwd=chapter.ROOT, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout=300)
    text = result.stdout + result.stderr
    for path, short in ((os.path.dirname(np.__path__[0]), "<site-packages>"), (str(chapter.ROOT), ".")):
        text = text.replace(path, short)
    return text.expandtabs(4).splitlines()


def rmsnorm_in_the_simulator() -> None:
    """Any kernel runs in the simulator through its public function: here kernels.rmsnorm."""
    from ddtree.rmsnorm import rmsnorm as reference
    from kernels.rmsnorm import rmsnorm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40)).astype(np.float32)                  # [T, D]
    weight = rng.standard_normal(40).astype(np.float32)                  # [D]
    diff = np.abs(rmsnorm(x, weight, 1e-6, threads=32) - reference(x, weight, 1e-6)).max()
    with chapter.section("simulator"):
        print(f"kernels run on: {where()}")
        print(f"kernels.rmsnorm.rmsnorm, x {x.shape}, 3 blocks of 32 threads: max |numpy - numba| = "
              f"{diff:.1e}")


def main() -> None:
    """Run every demo in a subprocess (the simulator) and print what a reader would see."""
    rmsnorm_in_the_simulator()
    with chapter.section("pdb"):
        print(f"$ python walkthrough/{STEM}.py stop      # then, at the (Pdb) prompt:")
        print("  " + "; ".join(PDB_COMMANDS))
        for line in run_demo("stop", "\n".join(PDB_COMMANDS) + "\n"):
            print(line)
    with chapter.section("oob"):
        print_error("oob", "forward_difference", "IndexError")
    with chapter.section("shuffle"):
        print_error("shuffle", "warp_sum", "AttributeError")
    with chapter.section("race_trials"):
        print(f"$ python walkthrough/{STEM}.py race")
        for line in run_demo("race"):
            print(line)


def print_error(demo: str, kernel: str, error: str) -> None:
    """The demo's traceback, cut to the kernel's frame and the error line."""
    lines = run_demo(demo)
    assert lines[-1].startswith(error), lines[-3:]
    frame = next(i for i, line in enumerate(lines) if line.endswith(f"in {kernel}"))
    print(f"$ python walkthrough/{STEM}.py {demo}")
    print("Traceback (most recent call last):\n  ...")
    print("\n".join(lines[frame:frame + 3]))
    print("  ...")
    # "<error>: tid=[...] ctaid=[...]: message"; when several threads fail, the one that got there
    # first varies from run to run, so its thread number is left out unless only one thread fails
    where_, message = lines[-1].split(": ", 2)[1:]
    if demo == "shuffle":
        where_ = re.sub(r"tid=\[\d+, ", "tid=[.., ", where_)
    print(f"{error}: {where_}:\n    {message}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        if sys.argv[1] not in DEMOS:
            raise SystemExit(f"usage: python {sys.argv[0]} [{' | '.join(DEMOS)}]")
        DEMOS[sys.argv[1]]()
    else:
        with chapter.report(STEM):
            main()
