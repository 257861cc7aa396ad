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
# which version of kernels.mla.attention_paths an engine runs, and how it cuts the keys (paths_plan)
UNFUSED_FROM_RANK = 512       # version 5 (unfused GEMMs, kernels.mla_unfused) from this kv_lora_rank R on
GROUPED_HEADS = 4             # version 3's G, a block per G heads, where G divides H (else versions 1 and 2)
SPLIT_TILES = 16              # Z, the splits of a row's keys: each walks at most this many tiles of a cache
MAX_SPLITS = 64               # ... and Z at most
SHARED_BUDGET = 44 * 1024     # attention's dynamic shared memory per block: 48 KB less the static arrays
# version 5's launch shapes (kernels.mla_unfused); none changes a sum
ROW_BLOCKS_PER_SM = 2         # a decode row's score kernel: its grid at most this many blocks per SM
STATS_FEW_FROM_BLOCKS_PER_SM = 4   # the statistics take fewer threads per block from this many blocks per SM
TAIL_MANY_ROWS = 16           # the tail kernel serves its most heads per block from this many rows on


# ---------------------------------------------------------------------------------- moe


# ---------------------------------------------------------------------------------- tree, top-K, compaction


# ---------------------------------------------------------------------------------- engine
