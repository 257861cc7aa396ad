"""Version "tiles", the engine's batch-invariant order from commit 2c061a4 until "lanes" (commit
6fe9e42). A lane owns an output column and a block 32 columns; each lane sums its column
sequentially along 32-wide chunks of Din for 8 rows at once, in registers, and the block's S warps
take chunks s, s + S, ... whose partial sums are added in slice order (``kernels.linear.tile_dots``,
which the MoE router still runs; S = ``k_slices(Din)``, never a function of T). Each warp stages its
32 x 32 weight tile through shared memory, so the loads stay coalesced and every staged weight
serves all the rows. Against "rows" (v1) its fewer, fuller blocks took tiny's AR from 1090 to 1453
tok/s on the H200 and a 40-row verify from 1.6 to 1.3 AR steps (commit 2c061a4). It lost to "lanes"
because it keeps few warps busy, each waiting at two barriers per chunk: small's AR step spent 2.3
ms in it, 0.30 TB/s of a 3.5 TB/s copy bandwidth (docs/results/profile-h200-2026-12-01d.md at commit
551c111); one row through a layer's projections and the lm_head of small took 330 µs with the
engine's tiles-order kernels against 137 with "lanes" (docs/results/lanes-h200-2026-12-02.txt at
commit 6fe9e42), and small's AR step went from 4424 to 3032 µs with the switch (commit 6fe9e42). Its
order rounds differently from "lanes"' (``SAME_BITS`` False); v3 and v4 give its bits with other
kernels.
"""

from __future__ import annotations

from numba import cuda, float32, int32

from kernels.blocks import blocks
from kernels.linear import (
    LANES,
    LANES_PADDED,
    MAX_SLICES,
    ROWS_PER_PASS,
    k_slices,
    row_passes,
    tile_dots,
)
from lab.harness import Case
from lab.linear import linear_cases, linear_contract

SHIPPED = "kernels.linear.linear"
TWIN = "ddtree.linear.linear"
SAME_BITS = False           # "tiles"' order, not "lanes"'
TOLERANCE = (1e-5, 1e-5)

tile_dots_rows = tile_dots(ROWS_PER_PASS)      # rows share each staged W tile


@cuda.jit
def tiles_kernel(x, weight, out):
    # one block = output columns n0 .. n0 + 31 (blockIdx.x; lane = column) for the passes of
    # ROWS_PER_PASS rows blockIdx.y, blockIdx.y + gridDim.y, ...; the block's S warps split Din
    # (tile_dots); shared memory: per warp a 32 x 33 W tile, the rows' 32-wide x chunk and the
    # partial sums
    w_tile = cuda.shared.array((MAX_SLICES, LANES, LANES_PADDED), float32)
    x_tile = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    partial = cuda.shared.array((MAX_SLICES, ROWS_PER_PASS, LANES), float32)
    acc = cuda.local.array(ROWS_PER_PASS, float32)
    consecutive = cuda.local.array(1, int32)     # tile_dots' row list, unused: rows t0 .. t0 + count - 1
    lane = cuda.threadIdx.x % LANES
    n = cuda.blockIdx.x * LANES + lane
    for t0 in range(cuda.blockIdx.y * ROWS_PER_PASS, x.shape[0], cuda.gridDim.y * ROWS_PER_PASS):
        count = min(ROWS_PER_PASS, x.shape[0] - t0)
        tile_dots_rows(x, t0, count, consecutive, weight, cuda.blockIdx.x * LANES, acc, w_tile,
                       x_tile, partial)
        if cuda.threadIdx.x < LANES and n < weight.shape[0]:
            for r in range(ROWS_PER_PASS):
                if r < count:
                    out[t0 + r, n] = acc[r]


def run(x, weight, *, out=None, stream=None):
    """``kernels.linear.linear``'s contract by "tiles"."""
    def launch(d_x, d_weight, d_out, stream):
        grid = (blocks(d_out.shape[1], LANES), row_passes(d_x.shape[0]))  # x over Dout, y over T
        tiles_kernel[grid, LANES * k_slices(d_x.shape[1]), stream](d_x, d_weight, d_out)

    return linear_contract(x, weight, launch, out=out, stream=stream)


def cases() -> list[Case]:
    """Din not a multiple of 32 (a partial last chunk) or below it, one or two passes of rows,
    Dout over one and two column tiles, NaN and inf."""
    return linear_cases(SHAPES)


SHAPES = {"decode_row": (1, 70, 5, 0), "few_rows": (3, 45, 2, 1), "short_din": (2, 9, 3, 2),
          "two_passes": (11, 100, 37, 3)}


