"""Version "stream": "tiles"' sums (v2) bit for bit with the W tile's detour through shared memory
taken out. A thread owns one (column n, slice s) chain and reads its own W row's 32 consecutive
floats of each chunk straight into registers, 64 loads before the first add; its rows' sums stay in
registers, and only the S partials meet in shared memory, once per pass, added in slice order. In v2
each lane stores its 32 loaded weights to shared memory and reads 32 back between two block-wide
barriers; here no barrier sits inside the sum, so warps run independently and more of W is in
flight. The price: a warp's load touches 32 rows of W instead of one, and the next loads of those
rows must find them in L1, which holds only while the chains are few. For one decode row on the H200
it took 4.7 / 26 / 85 µs where v2 took 7.5 / 38 / 124 (Dout 512 / 1408 / 2048) but 627 against 356
at Dout 18432 (docs/results/linear-versions-h200-2026-12-01.txt at commit d604ab9); an engine in
"tiles"' order ran it for one row where Dout <= 2048 (commit f1dcd85), tiny's AR step 486 µs against
523, while a 40-row verify was slower with it, 787 against 723 (docs/results/engine-
linear-h200-2026-12-01.txt at commit f61189f). Launch bounds (``resident``) let ptxas spend the
registers to issue a batch's loads before the first multiply-add (without them it kept 56 and issued
about half); ``STREAM_VARIANTS`` (threads, loads in flight, bounds, adjacent columns or slices)
change no bit. It left with "tiles"' order when the engine took "lanes" (commit 6fe9e42), which
keeps a warp's loads on one W row. Its bits are v2's, not "lanes"' (``SAME_BITS`` False; the tests
compare it with v2).
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from kernels.blocks import blocks
from kernels.device import SIMULATOR
from kernels.linear import LANES, MAX_SLICES, ROWS_PER_PASS, k_slices, row_passes
from lab.harness import Case
from lab.linear import linear_cases, linear_contract

SHIPPED = "kernels.linear.linear"
TWIN = "ddtree.linear.linear"
SAME_BITS = False           # "tiles"' order (v2), not "lanes"'
TOLERANCE = (1e-5, 1e-5)
# threads per block (S per column); few in the simulator, where each is a Python thread (64 on a GPU,
# with 64 loads and 64 resident: of the variants timed on the H200 the fastest or within 2% of it at
# 7168 -> 2048 and 2048 -> 1408; at 256 -> 512, 32 threads were faster, 3.8 against 4.7 µs)
STREAM_THREADS = 32 if SIMULATOR else 64
STREAM_LOADS = 64   # W loads a thread issues before it adds them (in order)
STREAM_ADJACENT_CHOICES = ("columns", "slices")   # what neighbouring threads differ in
STREAM_ADJACENT = "columns"
STREAM_RESIDENT = 64   # threads per SM the launch bounds leave registers for (64: up to 255 each)


@functools.cache
def stream_kernel(rows: int, threads: int = STREAM_THREADS, loads: int = STREAM_LOADS,
                  adjacent: str = STREAM_ADJACENT, resident: int | None = STREAM_RESIDENT,
                  max_l1: bool = False):
    """The "stream" kernel for passes of ``rows`` rows (a literal: the sums live in registers),
    blocks of ``threads // S * S`` threads, ``loads`` W loads in flight per thread (a divisor or a
    multiple of LANES) and ``adjacent`` threads taking adjacent "columns" or adjacent "slices".
    ``resident``: the threads per SM the compiler must leave registers for (launch bounds of
    resident // threads blocks; None: its own choice, which for sm_90 kept about 56 registers
    and issued only half of the loads before the first add); ``max_l1``: ask for the largest L1
    (the kernel needs little shared memory). None of them changes a bit of the result: every
    output is summed in "tiles"' order."""
    if not (isinstance(rows, int) and 1 <= rows <= ROWS_PER_PASS):
        raise ValueError(f"rows must be an int in [1, {ROWS_PER_PASS}], got {rows!r}")
    if not (isinstance(threads, int) and MAX_SLICES <= threads <= 1024):
        raise ValueError(f"threads must be an int in [{MAX_SLICES}, 1024], got {threads!r}")
    if not (isinstance(loads, int) and loads >= 1 and (LANES % loads == 0 or loads % LANES == 0)):
        raise ValueError(f"loads must divide {LANES} or be a multiple of it, got {loads!r}")
    if adjacent not in STREAM_ADJACENT_CHOICES:
        raise ValueError(f"adjacent must be one of {STREAM_ADJACENT_CHOICES}, got {adjacent!r}")
    if resident is not None and not (isinstance(resident, int) and 1 <= resident <= 2048):
        raise ValueError(f"resident must be None or an int in [1, 2048], got {resident!r}")
    slices_adjacent = adjacent == "slices"
    span = min(loads, LANES)              # a batch: `pieces` runs of `span` consecutive k, the runs
    pieces = max(1, loads // LANES)       # (whole chunks when pieces > 1) S chunks apart

    @cuda.jit(device=True)
    def add_batch(x, t0, last_row, weight, n, k1, step, acc, w):
        """acc[r] += x[t0 + r, k] * weight[n, k] in order over a whole batch's k: k1 + j * step + i
        for piece j < pieces, i < span (rows past last_row repeat it). No guards, and the views
        put every load at a constant offset from one address per piece."""
        for j in range(pieces):                  # all loads first, into registers: they overlap
            weights = weight[n, k1 + j * step:k1 + j * step + span]            # instead of waiting
            for i in range(span):                                              # one by one
                w[j * span + i] = weights[i]
        for r in range(rows):                    # then each row's sums, in k order
            total = acc[r]
            for j in range(pieces):
                xs = x[min(t0 + r, last_row), k1 + j * step:k1 + j * step + span]
                for i in range(span):
                    total += xs[i] * w[j * span + i]
            acc[r] = total

    @cuda.jit(device=True)
    def add_tail(x, t0, last_row, weight, n, k1, step, acc):
        """add_batch's sums for Din's last, partial batch: the same terms in the same order, one
        weight at a time (a plain loop: an unrolled, guarded copy would cost registers)."""
        depth = x.shape[1]
        for j in range(pieces):
            for k in range(k1 + j * step, min(k1 + j * step + span, depth)):
                w = weight[n, k]
                for r in range(rows):
                    acc[r] += x[min(t0 + r, last_row), k] * w

    options = {"shared_memory_carveout": "MaxL1" if max_l1 else None}
    if resident is not None and not SIMULATOR:      # (the simulator has no registers to bound)
        options["launch_bounds"] = (threads, max(1, resident // threads))

    @cuda.jit(**options)
    def kernel(x, weight, out):
        # one thread = output column n and slice s of Din ("tiles"' chunks s, s + S, ... of LANES
        # consecutive k), summed sequentially in k for the pass's rows at once; the block is
        # (columns, S) threads, or (S, columns) with adjacent slices, so blockDim holds
        # S = k_slices(Din); blockIdx.x = a group of columns, blockIdx.y = the passes
        # blockIdx.y, blockIdx.y + gridDim.y, ... of ``rows`` rows. W comes straight from global
        # memory, ``loads`` floats of the thread's row at a time; x by loads that the
        # column-adjacent threads share. Shared memory: every thread's partial sums, which slice
        # 0's thread adds in slice order.
        partial = cuda.shared.array((rows, threads), float32)
        acc = cuda.local.array(rows, float32)
        w = cuda.local.array(loads, float32)
        if slices_adjacent:
            s, c = cuda.threadIdx.x, cuda.threadIdx.y
            slices, columns = cuda.blockDim.x, cuda.blockDim.y
        else:
            c, s = cuda.threadIdx.x, cuda.threadIdx.y
            columns, slices = cuda.blockDim.x, cuda.blockDim.y
        tid = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        n = cuda.blockIdx.x * columns + c
        depth, outputs = x.shape[1], weight.shape[0]
        step = slices * LANES                                          # from a chunk to the slice's next
        for t0 in range(cuda.blockIdx.y * rows, x.shape[0], cuda.gridDim.y * rows):
            last_row = min(t0 + rows, x.shape[0]) - 1
            for r in range(rows):
                acc[r] = float32(0.0)
            if n < outputs:
                for k0 in range(s * LANES, depth, pieces * step):      # the slice's chunks, in order
                    for k1 in range(k0, min(k0 + LANES, depth), span):
                        if k1 + (pieces - 1) * step + span <= depth:
                            add_batch(x, t0, last_row, weight, n, k1, step, acc, w)
                        else:
                            add_tail(x, t0, last_row, weight, n, k1, step, acc)
            for r in range(rows):
                partial[r, tid] = acc[r]
            cuda.syncthreads()
            if s == 0 and n < outputs:
                for r in range(rows):                                  # (literal indices: acc stays
                    if t0 + r <= last_row:                             # in registers)
                        total = acc[r]                                 # slice 0's own partial
                        for other in range(1, slices):                 # (the tid of thread (c, other))
                            total += partial[r, c * slices + other if slices_adjacent else
                                             other * columns + c]
                        out[t0 + r, n] = total
            cuda.syncthreads()                                         # partial is rewritten next pass

    return kernel


def stream_launch(x, weight, out, *, threads: int = STREAM_THREADS, loads: int = STREAM_LOADS,
                  adjacent: str = STREAM_ADJACENT, resident: int | None = STREAM_RESIDENT,
                  max_l1: bool = False, stream=None):
    """out (T, Dout) = x (T, Din) @ weight.T, device arrays, by ``stream_kernel``: S = k_slices(Din)
    slices, ``threads // S`` columns per block, passes of min(T, ROWS_PER_PASS) rows (a last,
    partial pass repeats T's last row, never written)."""
    rows, depth = x.shape
    slices = k_slices(depth)
    columns = threads // slices
    block = (slices, columns) if adjacent == "slices" else (columns, slices)
    grid = (blocks(weight.shape[0], columns), row_passes(rows))
    kernel = stream_kernel(min(rows, ROWS_PER_PASS), threads, loads, adjacent, resident, max_l1)
    kernel[grid, block, stream](x, weight, out)


# "stream": the variants offered for timing, as stream_launch's options besides the defaults
# (64 threads, 64 loads, adjacent columns, 64 resident). Fewer threads spread a small Dout's few
# chains over more SMs; more loads put more of W in flight per chain; a block alone on its SM
# (resident = threads) may take every register it wants.
STREAM_VARIANTS = (
    {}, {"threads": 32, "resident": 32}, {"threads": 128, "resident": 128},
    {"threads": 256, "loads": 32, "resident": 512}, {"adjacent": "slices"}, {"loads": 32},
    {"resident": None},
)


def run(x, weight, *, out=None, stream=None, **variant):
    """``kernels.linear.linear``'s contract by "stream"; ``variant``: ``stream_launch``'s options."""
    def launch(d_x, d_weight, d_out, stream):
        stream_launch(d_x, d_weight, d_out, stream=stream, **variant)

    return linear_contract(x, weight, launch, out=out, stream=stream)


def cases() -> list[Case]:
    """Din not a multiple of 32 (a partial last chunk, a partial batch of loads) or below it, 1 to 11
    rows, Dout over 1 to 3 blocks, NaN and inf; variants: batches of two chunks (slice 1's second one
    past Din), adjacent slices with batches inside a chunk, blocks of 12 threads (6 columns of 2
    slices)."""
    return linear_cases(SHAPES)


SHAPES = {"decode_row": (1, 70, 5, 0, {}), "short_din": (2, 9, 3, 2, {}),
          "two_passes": (11, 100, 37, 3, {}), "two_chunk_batches": (1, 70, 5, 9, {"loads": 64}),
          "adjacent_slices": (3, 45, 37, 9, {"adjacent": "slices", "loads": 16}),
          "twelve_threads": (2, 100, 9, 9, {"threads": 12, "loads": 8})}


