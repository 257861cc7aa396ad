"""kernels.graphs: fork and join, the branches of a captured graph (the MoE's shared expert runs
beside its routed experts), and the same launches in order when nothing is captured."""

import numpy as np
import pytest
from numba import cuda

from kernels.graphs import Graphs, fork, join


@cuda.jit
def scaled_index_kernel(factor, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = factor * i


@cuda.jit
def sum_kernel(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


def test_without_capture_both_branches_are_the_stream():
    for stream in (0, None):
        first, second = fork(stream)
        assert first is stream and second is stream
        assert join(first, second) is stream


@pytest.mark.gpu                                     # the simulator has no graphs
@pytest.mark.parametrize("enabled", [True, False])
def test_the_joined_kernel_sees_both_branches(enabled):
    """Two branches write a and b, the kernel after the join reads both; graph replays (twice, the
    outputs poisoned in between) and direct launches give the same result."""
    size = 1000
    graphs = Graphs(enabled=enabled)
    a, b, c = (cuda.to_device(np.full(size, np.nan, np.float32)) for _ in range(3))

    def sequence(stream):
        left, right = fork(stream)
        scaled_index_kernel[4, 256, left](1.0, a)
        scaled_index_kernel[4, 256, right](2.0, b)
        sum_kernel[4, 256, join(left, right)](a, b, c)

    for _ in range(3):                                   # capture (and a direct run), then replays
        for buffer in (a, b, c):
            graphs.upload(np.full(size, np.nan, np.float32), buffer)
        graphs.run("fork", sequence)
        assert np.array_equal(graphs.download(c), 3.0 * np.arange(size, dtype=np.float32))


@pytest.mark.gpu
def test_the_engine_stream_is_on_numbas_device():
    """The stream comes from numba's device, named by its id (``kernels.device.core_device``): the
    engine's launches, copies and graph replays share numba's context."""
    graphs = Graphs()
    assert graphs.stream.device.device_id == cuda.get_current_device().id
    numbers = cuda.to_device(np.arange(3))
    cuda.synchronize()    # numba's copy runs on the default stream, which the engine's stream ignores
    assert graphs.download(numbers).tolist() == [0, 1, 2]


def test_a_prefix_copy_touches_the_buffer_s_first_elements_alone():
    """``upload(prefix=True)`` fills the first host.size elements of a 1-D buffer and leaves the rest;
    ``download(buffer, count)`` returns the first count; a bad count or a 2-D buffer is refused,
    naming what was expected, before anything is copied."""
    graphs = Graphs()
    buffer = cuda.to_device(np.full(6, -1, np.int64))
    cuda.synchronize()
    graphs.upload(np.array([5, 7, 9], np.int64), buffer, prefix=True)
    assert graphs.download(buffer, 2).tolist() == [5, 7]
    assert graphs.download(buffer, 0).tolist() == []
    assert graphs.download(buffer).tolist() == [5, 7, 9, -1, -1, -1]
    with pytest.raises(ValueError, match=r"count must be an integer in \[0, 6\]"):
        graphs.download(buffer, 7)
    with pytest.raises(ValueError, match=r"count must be an integer in \[0, 6\]"):
        graphs.upload(np.zeros(7, np.int64), buffer, prefix=True)
    with pytest.raises(ValueError, match="host must be int64"):
        graphs.upload(np.zeros(2, np.int32), buffer, prefix=True)
    with pytest.raises(ValueError, match="needs a 1-D device buffer"):
        graphs.download(cuda.to_device(np.zeros((2, 3), np.int64)), 2)
    assert graphs.download(buffer).tolist() == [5, 7, 9, -1, -1, -1]
