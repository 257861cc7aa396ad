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
# the registers. Either is cut to a thread's elements of the row (small's 2048 in 512 threads: 4), since a
# slot past the row loads its last column again. The simulator's rows are short: 8 (each slot of a batch is
# a Python loop step).
RMSNORM_FEW_ROWS_BATCH = 8 if SIMULATOR else 16
RMSNORM_MANY_ROWS_BATCH = 8


# ---------------------------------------------------------------------------------- linear

# "lanes" (``kernels.linear.lanes_shape``): up to LANES_ONE_ROW_SHAPE rows a decode row's shape (a
# pass of two rows keeps its x values of 16 loads beside its W values in registers); then
# the more rows a launch has, the more output columns a warp takes (each x value loaded feeds that
# many multiply-adds) and the fewer loads of each it keeps in flight: 2 columns below LANES_FEW_ROWS
# rows, 4 below LANES_SOME_ROWS, 8 from there on; from LANES_WIDE_OUTPUTS outputs (an lm_head) 8.
# No shape changes a bit.
LANES_ONE_ROW_SHAPE = 2
LANES_FEW_ROWS = 16
LANES_SOME_ROWS = 48
LANES_WIDE_OUTPUTS = 8192


# ---------------------------------------------------------------------------------- attention (mla)
# which version of kernels.mla.attention_paths an engine runs, and how it cuts the keys (paths_plan)
UNFUSED_FROM_RANK = 512       # version 5 (unfused GEMMs, kernels.mla_unfused) from this kv_lora_rank R on
GROUPED_HEADS = 4             # version 3's G, a block per G heads, where G divides H (else versions 1 and 2)
SPLIT_TILES = 16              # Z, the splits of a row's keys: each walks at most this many tiles of a cache
MAX_SPLITS = 64               # ... and Z at most
SHARED_BUDGET = 44 * 1024     # attention's dynamic shared memory per block: 48 KB less the static arrays
# version 5's launch shapes (kernels.mla_unfused); none changes a sum
ROW_BLOCKS_PER_SM = 2         # a few rows' score kernel: its grid at most this many blocks per SM
# ... the rows it serves, each up to how many keys (P + T), the GEMM past them (None: every context, no
# GEMM); the more rows, the shorter the context where the GEMM overtakes it: at eight rows, at any
ROW_SCORES_KEYS = {1: None, 2: 8192, 3: 4096, 4: 768}
# ... and where its queries fit shared memory (kernels.mla_unfused.row_group: small's 16 heads), up to how
# many keys it stages them there, then reads them from global memory: a staged block walks tiles of 2 keys
# with one warp adding, fast while the keys are few. Each bound a launch of its own (``score_launches``)
ROW_STAGED_SCORES_KEYS = {1: 2048, 2: 256, 3: 256, 4: 768}
STATS_FEW_FROM_BLOCKS_PER_SM = 4   # the statistics take fewer threads per block from this many blocks per SM
TAIL_MANY_ROWS = 16           # the tail kernel serves its most heads per block from this many rows on


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
# from this many rows on the expert kernels take 8 outputs per warp (each x value feeds 8); below, the
# shape of their passes (``kernels.moe.LANE_BY_PASS``)
LANE_WIDE_FROM_ROWS = 16


# ---------------------------------------------------------------------------------- tree, top-K, compaction

TOPK_CHUNK = 4096         # top-K's sort buffer of (log-prob, id) pairs (32 KB); longer rows stream through it
TREE_STAGE_FLOATS = 1536  # the builder copies the log-probs it can reach to shared memory if they fit (6 KB)
TREE_STAGE_BATCH = 8      # ... that many per thread at a time, so their loads overlap
KEYED_TREE_NODES = 257    # the keyed builder's tables (16 bytes more per entry) fit trees of this many nodes
VIS_TILE = 16             # visibility: 16 x 16 threads per block over (i, j)
COMPACT_BATCH = 8         # compaction: rows a thread reads into registers before it writes them
ROPE_HEADS = 8            # RoPE: heads a thread turns with one cos and sin (2 loads each in flight)


# ---------------------------------------------------------------------------------- engine
# a prompt chunk's rows run in a bucket (one captured graph per bucket): 1, 2, 4, 8, then multiples
# of BUCKET_STEP, since each padding row costs a whole row of work (``kernels.model.bucket_rows``)
BUCKET_STEP = 8
