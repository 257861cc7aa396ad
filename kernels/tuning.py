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


# ---------------------------------------------------------------------------------- tree, top-K, compaction

TOPK_CHUNK = 4096         # top-K's sort buffer of (log-prob, id) pairs (32 KB); longer rows stream through it
TREE_STAGE_FLOATS = 1536  # the builder copies the log-probs it can reach to shared memory if they fit (6 KB)
TREE_STAGE_BATCH = 8      # ... that many per thread at a time, so their loads overlap
KEYED_TREE_NODES = 257    # the keyed builder's tables (16 bytes more per entry) fit trees of this many nodes
VIS_TILE = 16             # visibility: 16 x 16 threads per block over (i, j)
COMPACT_BATCH = 8         # compaction: rows a thread reads into registers before it writes them
ROPE_HEADS = 8            # RoPE: heads a thread turns with one cos and sin (2 loads each in flight)


# ---------------------------------------------------------------------------------- engine
