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

# "lanes" (``kernels.linear.lanes_shape``): the more rows a launch has, the more output columns a
# warp takes (each x value loaded feeds that many multiply-adds) and the fewer loads of each it keeps
# in flight: 2 columns below LANES_FEW_ROWS rows, 4 below LANES_SOME_ROWS, 8 from there on; from
# LANES_WIDE_OUTPUTS outputs (an lm_head) 8 from two rows on. No shape changes a bit.
LANES_FEW_ROWS = 16
LANES_SOME_ROWS = 48
LANES_WIDE_OUTPUTS = 8192


# ---------------------------------------------------------------------------------- attention (mla)


# ---------------------------------------------------------------------------------- moe


# ---------------------------------------------------------------------------------- tree, top-K, compaction


# ---------------------------------------------------------------------------------- engine
