"""Every size threshold the kernels choose a launch or a path by, in one place, and the GPU's
streaming multiprocessor count, read from the device.

A threshold here changes which kernel runs or how its work is cut, never what a row computes
unless its comment says so. Each op's thresholds sit under its own heading; what measured a value
is in ``docs/results/`` and ``docs/history.md``, not here.
"""

from __future__ import annotations

import functools

from kernels.device import SIMULATOR, cuda

SIMULATED_SMS = 132     # the simulator has no SMs: launch shapes are planned for this many


@functools.cache
def sm_count() -> int:
    """The current GPU's streaming multiprocessors (SIMULATED_SMS in the simulator)."""
    if SIMULATOR:
        return SIMULATED_SMS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


# ---------------------------------------------------------------------------------- rmsnorm
# A thread's row elements loaded together (``kernels.rmsnorm.row_batch``; every batch gives the
# same bits). A launch of at most one block per SM (rows <= sm_count()) has no other block beside
# its blocks to hide their loads behind: it takes the larger batch, so that a row of up to 512 x 16
# = 8192 floats (Kimi's 7168) sits in registers and is read once. A launch of more rows needs its
# blocks resident together more than each block's loads in flight: the smaller batch leaves them
# the registers. The simulator's rows are short: 8 (each slot of a batch is a Python loop step).
RMSNORM_FEW_ROWS_BATCH = 8 if SIMULATOR else 16
RMSNORM_MANY_ROWS_BATCH = 8


# ---------------------------------------------------------------------------------- linear


# ---------------------------------------------------------------------------------- attention (mla)


# ---------------------------------------------------------------------------------- moe

# the router, route_one_kernel: both of a token's kernels in one launch while its grid has at most
# this many blocks per SM (a larger grid's token routes faster on the two kernels' fewer blocks) ...
ROUTE_ONE_BLOCKS_PER_SM = 1
# ... and for T > 1 tokens only while T reads of the gate (each token's blocks stage it again) stay
# under this many bytes
ROUTE_ONE_MAX_BYTES = 1 << 20
# the expert kernels: up to SLOT_ROWS tokens run a block per (token, slot) pair, without the lists ...
SLOT_ROWS = 64
# ... unless one expert's weights take this many bytes: then they are read once per pass of its pairs,
# never once per pair
LARGE_EXPERT_BYTES = 4 << 20
# from this many rows on the expert kernels take 8 outputs per warp (each x value feeds 8), below 4
LANE_WIDE_FROM_ROWS = 16


# ---------------------------------------------------------------------------------- tree, top-K, compaction


# ---------------------------------------------------------------------------------- engine
