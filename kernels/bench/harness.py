"""The timing harness: CUDA-event timing of one public call and of the same kernels replayed from
a CUDA graph (device time), the number of timed calls, launch and allocation counting, the
ceilings (read bandwidth, empty launch, fp32 rate), torch beside each case that has a peer, and
``benchmark``, which runs every case.

How a case is timed (the inputs are allocated once per input set, before timing, and filled with
random values: zeros can hide unwritten outputs and run faster than real data):

1. warm-up: one call, which compiles every kernel signature it needs and counts the kernel
   launches it makes ("launches" in the note; on a GPU the poison fills are launches too);
2. two untimed calls on the host clock choose N: the case runs about 0.2 s, and at least 5 calls;
3. N timed calls, each between two CUDA events on the default stream: everything the stream saw,
   the kernels and, when the host is slower than the GPU, the gaps while Python prepares the
   next launch (small kernels are launch-bound). The report gives the median;
4. device time: one graph holds C copies of the outputs-given launches (about 2 ms of work, at
   most 64, a multiple of the input sets), replayed between two events at least 5 times; the
   median replay over C (input set 0's launches write into the warm-up's outputs when the case
   has no ``prepare``);
5. inputs that fit in the L2 cache would be timed from the cache: such cases get several input
   sets (together at least twice the L2 size, at most 16 GiB), and call i (or copy i of the
   graph) uses set i mod sets;
6. torch, where the case has a peer and torch runs here: the same work on the same device
   arrays, C copies in a torch CUDA graph, timed the same way.

The ceilings, measured first: the read bandwidth (``read_kernel`` reads a float32 buffer of 1 GiB
once, READ_BATCH passes launched back to back between two events, batches for about 0.2 s and at
least 5; the median batch, and the slowest and fastest as the spread; bytes read counted, not the
block partials written), the empty launch (median between events, host time back to back, device
time replayed from a graph) and the fp32 rate (``measure_fp32``). Weights are read, not copied, so
a weight-streaming kernel's floor is its bytes over the read bandwidth.

With ``--quick`` (the simulator's smoke test): one input set, one call as warm-up and timing, and
the outputs-given launches once, directly (the simulator has no graphs). The tree-build cases
also time the numpy reference on the same requests, on the host clock (the speed-up is in the
note).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda, float32

from kernels.bench import hardware, peers
from kernels.bench.case import Case, Sizes, uniform
from kernels.bench.environment import l2_bytes, versions
from kernels.blocks import block_sum
from kernels.device import SIMULATOR, core_device

F32 = 4                         # bytes per float32
TARGET_SECONDS = 0.2            # timed calls per case: about this long ...
MIN_REPEATS = 5                 # ... but at least this many
MAX_REPEATS = 2000              # ... and at most this many
MAX_SETS = 64                   # input sets rotated to keep small cases out of the L2 cache ...
SETS_MEMORY = 16 << 30          # ... holding at most this much device memory together
GRAPH_SECONDS = 2e-3            # device time: one graph holds about this much work ...
MAX_COPIES = 64                 # ... in at most this many copies of the case's launches
READ_BATCH = 8                  # read kernels back to back between two events (read bandwidth)
READ_THREADS = 256              # threads per block of the read kernel ...
READ_LOADS = 4                  # ... each with this many independent loads in flight per step ...
READ_BLOCKS_PER_SM = 8          # ... in at most this many blocks per SM (2048 threads: a full SM)


@cuda.jit
def empty_kernel():
    # one thread does nothing: the launch overhead alone
    pass


@cuda.jit
def read_kernel(values, partials):
    # thread: a grid-stride walk over values, READ_LOADS (4) strides a step into 4 float32 sums
    # (independent loads in flight); block: READ_THREADS sums added in shared memory, its partial
    # to partials[block] (a result the loads feed, so none can be dropped)
    thread, block = cuda.threadIdx.x, cuda.blockIdx.x
    stride = cuda.gridDim.x * READ_THREADS
    i = block * READ_THREADS + thread
    s0 = s1 = s2 = s3 = float32(0.0)
    while i + 3 * stride < values.size:
        s0 += values[i]
        s1 += values[i + stride]
        s2 += values[i + 2 * stride]
        s3 += values[i + 3 * stride]
        i += 4 * stride
    while i < values.size:                     # the tail: fewer than 4 strides left
        s0 += values[i]
        i += stride
    sums = cuda.shared.array(READ_THREADS, float32)
    sums[thread] = (s0 + s1) + (s2 + s3)
    block_sum(sums)
    if thread == 0:
        partials[block] = sums[0]


def read_blocks(count: int) -> int:
    """Blocks of ``read_kernel`` over ``count`` float32: enough for one step of READ_LOADS loads
    per thread, at most READ_BLOCKS_PER_SM per SM (the grid-stride walk covers the rest)."""
    sms = getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", None) or 1    # the simulator: None
    return max(1, min(-(-count // (READ_THREADS * READ_LOADS)), READ_BLOCKS_PER_SM * sms))


def time_once(call: Callable[[], Any], events) -> tuple[float, float]:
    """(seconds of one call as the default stream sees it (two CUDA events), host seconds of the
    call itself); both the host clock in the simulator, where events record nothing and
    simulation is synchronous.

    The outputs are kept until the end event has been waited for, so freeing them (numba frees
    device memory in batches, which synchronises) falls outside the timed region.
    """
    if SIMULATOR:
        begin = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - begin
        del out
        return seconds, seconds
    start, end = events
    start.record()
    begin = time.perf_counter()
    out = call()
    host = time.perf_counter() - begin
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3    # elapsed_time is in milliseconds
    del out
    return seconds, host


def repeats_for(call: Callable[[], Any], quick: bool) -> int:
    """N timed calls: ~TARGET_SECONDS of wall clock, at least MIN_REPEATS (one with --quick)."""
    if quick:
        return 1
    begin = time.perf_counter()
    for _ in range(2):
        call()
    cuda.synchronize()
    per_call = (time.perf_counter() - begin) / 2
    return max(MIN_REPEATS, min(MAX_REPEATS, math.ceil(TARGET_SECONDS / max(per_call, 1e-9))))


def median_seconds(calls: list[Callable[[], Any]], repeats: int) -> tuple[float, float]:
    """Medians of ``repeats`` timed calls, cycling through ``calls`` (one per input set): (event
    seconds, host seconds of the call)."""
    events = (cuda.event(), cuda.event())
    timings = [time_once(calls[i % len(calls)], events) for i in range(repeats)]
    return statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings)


@dataclasses.dataclass
class DeviceTime:
    seconds: float                             # median device seconds per call
    launches: int | None                       # kernel launches per call
    allocations: int                           # device allocations and host copies per call (0 expected)
    copies: int                                # calls per graph replay
    replays: int                               # timed replays the median is of


def graph_seconds(launches: list[Callable[[Any], Any]], copies: int, quick: bool) -> DeviceTime:
    """Device seconds of one call: ``copies`` calls of ``launches[k % len]`` (stream -> launches,
    one per input set) captured into one CUDA graph with ``cuda.core``'s graph builder, each
    replay between two events; the median per call. In the simulator (no graphs) one direct
    call, on the host clock."""
    if SIMULATOR:
        with counting_launches() as count, counting_allocations() as allocations:
            begin = time.perf_counter()
            launches[0](0)
            seconds = time.perf_counter() - begin
        return DeviceTime(seconds, count[0], allocations[0], 1, 1)
    from cuda.core import EventOptions

    device = core_device()
    stream = device.create_stream()
    cuda.synchronize()
    builder = stream.create_graph_builder()
    builder.begin_building()
    try:
        with counting_launches() as count, counting_allocations() as allocations:
            for k in range(copies):
                launches[k % len(launches)](builder)
    finally:
        graph = builder.end_building().complete()
    timing = EventOptions(timing_enabled=True)
    start, end = (device.create_event(options=timing) for _ in range(2))

    def replay() -> float:
        stream.record(start)
        graph.launch(stream)
        stream.record(end)
        end.sync()
        return (end - start) / 1e3 / copies                       # events subtract to milliseconds

    first = replay()                                              # warms the graph up
    repeats = 1 if quick else max(MIN_REPEATS, min(200, math.ceil(TARGET_SECONDS / (first * copies))))
    seconds = statistics.median(replay() for _ in range(repeats))
    stream.sync()
    return DeviceTime(seconds, None if count[0] is None else count[0] // copies, allocations[0] // copies,
                      copies, repeats)


@contextlib.contextmanager
def counting_allocations():
    """Counts device allocations and host-to-device copies made through ``numba.cuda``'s
    ``device_array`` / ``to_device`` inside the block (what a launch with its outputs given must
    not do): ``with counting_allocations() as count: ...; count[0]``."""
    count = [0]
    names = ("device_array", "to_device", "device_array_like")
    originals = {name: getattr(cuda, name) for name in names}

    def counted(original):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(cuda, name, counted(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(cuda, name, original)


@contextlib.contextmanager
def patched_launches(wrap):
    """Every kernel launch inside the block goes through ``wrap(original)``; yields False when the
    entry point is gone (then nothing is patched).

    Why a patch: numba has no global launch hook (its ``pre_launch_callbacks`` list belongs to each
    launch configuration, made anew by every ``kernel[grid, block]``), and what the benchmark
    measures is a property of the public functions, which it does not want to change. So this
    wraps the one entry point every launch goes through, a private API
    (``_LaunchConfiguration.__call__`` on a GPU, ``FakeCUDAKernel.__getitem__`` in the simulator),
    and restores it afterwards."""
    try:
        if SIMULATOR:
            from numba.cuda.simulator.kernel import FakeCUDAKernel as owner
            attribute = "__getitem__"
        else:
            from numba.cuda.dispatcher import _LaunchConfiguration as owner
            attribute = "__call__"
        original = getattr(owner, attribute)
    except (ImportError, AttributeError):
        yield False
        return
    setattr(owner, attribute, wrap(original))
    try:
        yield True
    finally:
        setattr(owner, attribute, original)


@contextlib.contextmanager
def counting_launches():
    """Counts kernel launches inside the block: ``with counting_launches() as count: ...; count[0]``
    (None, "?" in the report, if the launch entry point is gone; see ``patched_launches``)."""
    count = [None]

    def wrap(original):
        def counted(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)
        return counted

    with patched_launches(wrap) as patched:
        if patched:
            count[0] = 0
        yield count


def free_device_memory() -> None:
    """Release what the last case allocated (numba defers frees and runs them in batches)."""
    gc.collect()
    if not SIMULATOR:
        context = cuda.current_context()
        for owner in (context.memory_manager, context):     # device arrays; streams and events
            pending = getattr(owner, "deallocations", None)
            if pending is not None:
                pending.clear()


@dataclasses.dataclass
class Result:
    case: Case
    seconds: float                             # median per public call, between events
    repeats: int
    sets: int                                  # input sets rotated through
    launches: int | None                       # kernel launches per call (None: could not count)
    baseline_seconds: float | None = None      # median of the CPU baseline, if the case has one
    host_seconds: float = 0.0                  # median host time of the public call itself
    device: DeviceTime | None = None           # the kernels alone, outputs given, from a graph
    device_error: str = ""                     # why there is no device time
    peer_seconds: float | None = None          # torch's device time for the same work
    peer_error: str = ""                       # why torch has no time, when it has a peer and failed

    @property
    def best_seconds(self) -> float:
        """The device time when there is one, else the public call's."""
        return self.device.seconds if self.device else self.seconds


@dataclasses.dataclass
class Report:
    simulator: bool
    quick: bool
    header: list                               # (key, value) pairs
    read_bytes: int                            # size of the buffer the read kernel reads
    read_seconds: list                         # seconds per read, one per timed batch (read_batches)
    launch_seconds: float                      # median event time around one empty launch
    launch_repeats: int                        # launches that median is of
    host_launch_seconds: float                 # host time per launch, back to back
    results: list
    graph_launch_seconds: float = 0.0          # device time per empty launch replayed from a graph
    fp32_flops: float = 0.0                    # the fp32 rate of compute-bound floors
    fp32_source: str = ""                      # measured here (torch), or the recorded figure

    @property
    def read_bandwidth(self) -> float:
        """Bytes read per second by the read kernel: the median batch."""
        return self.read_bytes / statistics.median(self.read_seconds)

    @property
    def read_spread(self) -> tuple[float, float]:
        """(slowest, fastest) batch's read bandwidth, bytes per second."""
        return self.read_bytes / max(self.read_seconds), self.read_bytes / min(self.read_seconds)

    @property
    def fp32(self) -> float:
        """FLOP/s of the fp32 rate: measured in the run, else the recorded figure."""
        return self.fp32_flops or hardware.fp32_flops()


def graph_copies(seconds: float, sets: int) -> int:
    """Calls per graph replay for a call of about ``seconds``: GRAPH_SECONDS of work, at most
    MAX_COPIES, a multiple of the input sets (each set used equally often)."""
    copies = max(sets, min(MAX_COPIES, math.ceil(GRAPH_SECONDS / seconds)))
    return -(-copies // sets) * sets


def run_case(case: Case, quick: bool) -> Result:
    seed = zlib.crc32(case.name.encode())
    # enough input sets to touch at least twice the L2 between two uses of one set, so no timed
    # call finds its inputs in the cache; one set for cases that are larger than that anyway
    footprint = case.footprint or case.bytes
    sets = 1 if quick else max(1, min(MAX_SETS, math.ceil(2 * l2_bytes() / max(case.bytes, 1)),
                                      SETS_MEMORY // max(footprint, 1)))
    states = [case.setup(seed + 1000 * i) for i in range(sets)]
    calls = [lambda state=state: case.call(state) for state in states]
    with counting_launches() as count:                                          # warm-up: compiles,
        begin = time.perf_counter()                                             # counts launches and
        first = calls[0]()                                                      # keeps its outputs
        cuda.synchronize()
        warm_up = time.perf_counter() - begin
    if quick:                                   # one call (the warm-up) is the timing too
        seconds = host_seconds = warm_up
        repeats = 1
    else:
        repeats = repeats_for(calls[0], quick)
        seconds, host_seconds = median_seconds(calls, repeats)
    device, device_error, givens, launches = None, "", None, None
    try:                                        # set 0 reuses the warm-up's outputs when it can
        givens = [first if i == 0 and case.prepare is None else case.given(state)
                  for i, state in enumerate(states)]
        launches = [lambda stream, state=state, given=given: case.launch_given(state, given, stream)
                    for state, given in zip(states, givens, strict=True)]
        device = graph_seconds(launches, 1 if quick else graph_copies(seconds, sets), quick)
    except Exception as error:                                                  # reported, not fatal
        device_error = f"{type(error).__name__}: {error}"[:200]
    peer_seconds, peer_error = None, ""
    if case.peer is not None and peers.available():
        try:
            peer_seconds = peers.graph_seconds([case.peer(state) for state in states],
                                               graph_copies(device.seconds if device else seconds, sets),
                                               MIN_REPEATS)
        except Exception as error:                                              # reported, not fatal
            peer_error = f"{type(error).__name__}: {error}"[:200]
    baseline_seconds = None
    if case.baseline is not None:
        begin = time.perf_counter()
        case.baseline()
        per_call = time.perf_counter() - begin
        runs = 1 if quick else max(3, min(MAX_REPEATS, math.ceil(TARGET_SECONDS / per_call)))
        timings = []
        for _ in range(runs):
            begin = time.perf_counter()
            case.baseline()
            timings.append(time.perf_counter() - begin)
        baseline_seconds = statistics.median(timings)
    del states, calls, givens, launches, first
    free_device_memory()
    return Result(case, seconds, repeats, sets, count[0], baseline_seconds, host_seconds, device,
                  device_error, peer_seconds, peer_error)


def read_batches(nbytes: int, quick: bool) -> list[float]:
    """Seconds per ``read_kernel`` pass over ``nbytes`` of random float32, in each timed batch of
    READ_BATCH passes launched back to back between two events: the GPU stays busy through a
    batch, as it does through a forward (one pass alone after an idle GPU reads slower, and
    varies from run to run). A forward's weights are read, not copied: this is their ceiling."""
    values = uniform((nbytes // F32,), 1)
    partials = cuda.device_array(read_blocks(values.size), np.float32)
    batch = lambda: [read_kernel[partials.size, READ_THREADS](values, partials) for _ in range(READ_BATCH)]
    batch()                                                                     # compiles
    cuda.synchronize()
    repeats = repeats_for(batch, quick)
    events = (cuda.event(), cuda.event())
    return [time_once(batch, events)[0] / READ_BATCH for _ in range(repeats)]


def measure_launch(quick: bool, host_launches: int) -> tuple[float, int, float, float]:
    """(median event seconds around one empty launch, the launches it is the median of, host
    seconds per launch back to back, device seconds per empty launch replayed from a graph)."""
    launch = lambda: empty_kernel[1, 32]()
    launch()                                                                    # compiles
    cuda.synchronize()
    repeats = repeats_for(launch, quick)
    seconds = median_seconds([launch], repeats)[0]
    begin = time.perf_counter()
    for _ in range(host_launches):
        launch()
    cuda.synchronize()
    host = (time.perf_counter() - begin) / host_launches
    in_graph = graph_seconds([lambda stream: empty_kernel[1, 32, stream]()], 1 if quick else MAX_COPIES,
                             quick)
    return seconds, repeats, host, in_graph.seconds


def measure_fp32(quick: bool) -> tuple[float, str]:
    """(FLOP/s, where it comes from): torch's SGEMM measured now when torch runs here, else the
    rate recorded in ``hardware``'s record."""
    if peers.available():
        size = peers.SGEMM_SIZE
        return peers.sgemm_flops(1 if quick else MIN_REPEATS), (
            f"measured here: torch SGEMM {size}x{size}x{size}, TF32 off, from a CUDA graph")
    recorded = hardware.figure("fp32_flops")
    return recorded.value, f"not measured here: {recorded.note}"


@contextlib.contextmanager
def quiet_launches():
    """No low-occupancy warnings while timing: small grids are the point of several cases, and
    formatting a warning on every launch would add host time to them."""
    from numba.cuda.core import config

    saved = config.CUDA_LOW_OCCUPANCY_WARNINGS
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    try:
        yield
    finally:
        config.CUDA_LOW_OCCUPANCY_WARNINGS = saved


def benchmark(sizes: Sizes, cases: list[Case], quick: bool, log=print) -> Report:
    """Measure the ceilings, then every case; ``log`` gets one progress line per step."""
    with quiet_launches():
        read_seconds = read_batches(sizes.read_bytes, quick)
        free_device_memory()                                                    # the read buffer
        log(f"read: {sizes.read_bytes / statistics.median(read_seconds) / 1e9:.1f} GB/s")
        launch_seconds, launch_repeats, host_launch_seconds, graph_launch_seconds = measure_launch(
            quick, sizes.host_launches)
        log(f"empty launch: {launch_seconds * 1e6:.1f} us, {graph_launch_seconds * 1e6:.2f} us in a graph")
        fp32_flops, fp32_source = measure_fp32(quick)
        log(f"fp32: {fp32_flops / 1e12:.1f} TFLOP/s ({fp32_source})")
        results = []
        for case in cases:
            results.append(run_case(case, quick))
            device = results[-1].device
            log(f"{case.name}: {results[-1].seconds * 1e6:.1f} us per call, "
                + (f"{device.seconds * 1e6:.1f} us device" if device else results[-1].device_error))
    return Report(SIMULATOR, quick, versions(), sizes.read_bytes, read_seconds, launch_seconds,
                  launch_repeats, host_launch_seconds, results, graph_launch_seconds, fp32_flops, fp32_source)
