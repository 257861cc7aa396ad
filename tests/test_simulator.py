"""kernels.simulator: the simulator's barrier and thread pool keep its semantics (every live thread
of a block meets at each barrier, a returned thread no longer counts, an error names its thread
and block and stops the others), and the workers are reused, not started anew for each block."""

import threading

import numpy as np
import pytest

from kernels import device
from kernels.device import cuda

pytestmark = pytest.mark.skipif(not device.SIMULATOR, reason="patches numba's CUDA simulator only")

LIVE = 40            # threads of a 64-thread block that do not return at once


@cuda.jit
def rotate_live_threads(out, rounds):
    """Threads >= LIVE return; the others pass their value one place left ``rounds`` times
    through shared memory, two barriers a round."""
    tile = cuda.shared.array(64, np.int64)
    tid = cuda.threadIdx.x
    if tid >= LIVE:
        return
    value = cuda.blockIdx.x * 1000 + tid
    for _ in range(rounds):
        tile[tid] = value
        cuda.syncthreads()
        value = tile[(tid + 1) % LIVE]
        cuda.syncthreads()
    out[cuda.blockIdx.x, tid] = value


def test_barriers_wait_for_every_live_thread_and_not_for_returned_ones():
    out = np.full((3, LIVE), -1, np.int64)
    rotate_live_threads[3, 64](out, 7)
    expected = np.arange(3)[:, None] * 1000 + (np.arange(LIVE) + 7) % LIVE
    np.testing.assert_array_equal(out, expected)


@cuda.jit
def fail_in_one_thread(x, out):
    """Thread 5 of block 1 reads past ``x`` while the block's other threads wait at a barrier."""
    tile = cuda.shared.array(32, np.float32)
    tid = cuda.threadIdx.x
    index = x.shape[0] if (cuda.blockIdx.x == 1 and tid == 5) else tid
    tile[tid] = x[index]
    cuda.syncthreads()
    out[cuda.blockIdx.x, tid] = tile[31 - tid]


def test_an_error_names_its_thread_and_block_and_releases_the_others():
    x = np.arange(32, dtype=np.float32)
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\] ctaid=\[1, 0, 0\]: index 32 is out of bounds"):
        fail_in_one_thread[3, 32](x, np.zeros((3, 32), np.float32))
    out = np.full((1, 32), np.nan, np.float32)                 # the pool is usable afterwards
    fail_in_one_thread[1, 32](x, out)
    np.testing.assert_array_equal(out[0], x[::-1])


@cuda.jit
def vote(flags, out):
    tid = cuda.threadIdx.x
    out[0] = cuda.syncthreads_count(flags[tid])
    out[1] = cuda.syncthreads_and(flags[tid])
    out[2] = cuda.syncthreads_or(flags[tid])


@pytest.mark.parametrize("flags", [np.arange(32) % 3 == 0, np.ones(32, bool), np.zeros(32, bool)],
                         ids=["every-third", "all", "none"])
def test_block_votes_count_every_thread(flags):
    out = np.full(3, -1, np.int64)
    vote[1, 32](flags.astype(np.int32), out)
    assert out.tolist() == [flags.sum(), int(flags.all()), int(flags.any())]


@cuda.jit
def thread_coordinates(out):
    x, y = cuda.threadIdx.x, cuda.threadIdx.y
    out[cuda.blockIdx.x, y, x, 0] = x
    out[cuda.blockIdx.x, y, x, 1] = y
    out[cuda.blockIdx.x, y, x, 2] = cuda.laneid


def test_a_reused_worker_takes_each_blocks_thread_index():
    out = np.full((2, 4, 16, 3), -1, np.int64)
    thread_coordinates[2, (16, 4)](out)
    y, x = np.meshgrid(np.arange(4), np.arange(16), indexing="ij")
    for block in range(2):
        np.testing.assert_array_equal(out[block, ..., 0], x)
        np.testing.assert_array_equal(out[block, ..., 1], y)
        np.testing.assert_array_equal(out[block, ..., 2], (x + 16 * y) % 32)


def test_workers_are_reused_across_blocks_and_launches(monkeypatch):
    out = np.zeros((3, LIVE), np.int64)
    rotate_live_threads[3, 64](out, 1)                          # the pool holds >= 64 workers now
    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda thread: (started.append(thread), start(thread)))
    for _ in range(5):
        rotate_live_threads[3, 64](out, 1)
    assert started == []                                        # the simulator alone starts 960


@cuda.jit
def row_lengths(x, out):
    row = x[cuda.threadIdx.x]                                   # a view of one row
    out[cuda.threadIdx.x] = row.shape[0] * 100 + row[2] + x.shape[1]


@cuda.jit
def last_axis(x, out):
    out[0] = x.shape[-1]


def test_a_kernels_arrays_index_like_device_arrays():
    """The kernel sees numpy views of its arrays: writes reach the caller's array, rows are views,
    and ``shape`` still refuses a negative index, as the simulator's own arrays do."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.full(3, np.nan, np.float32)
    row_lengths[1, 3](cuda.to_device(x), out)
    np.testing.assert_array_equal(out, 4 * 100 + x[:, 2] + 4)
    with pytest.raises(IndexError, match=r"ctaid=\[0, 0, 0\]: tuple index out of range"):
        last_axis[1, 1](x, out)
