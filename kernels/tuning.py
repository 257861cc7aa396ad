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
