"""The timing harness: CUDA-event timing of one call, the number of timed calls, launch counting,
the two ceilings (copy bandwidth, empty launch), and ``benchmark``, which runs every case."""

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
from numba import cuda

from kernels.bench.case import Case, Sizes, uniform
from kernels.bench.environment import l2_bytes, versions
from kernels.device import SIMULATOR

F32 = 4                         # bytes per float32
TARGET_SECONDS = 0.2            # timed calls per case: about this long ...
MIN_REPEATS = 5                 # ... but at least this many
MAX_REPEATS = 2000              # ... and at most this many
MAX_SETS = 64                   # input sets rotated to keep small cases out of the L2 cache ...
SETS_MEMORY = 16 << 30          # ... holding at most this much device memory together


@cuda.jit
def empty_kernel():
    # one thread does nothing: the launch overhead alone
    pass


def time_once(call: Callable[[], Any], events) -> float:
    """Seconds of one call as the default stream sees it (two CUDA events); the host clock in the
    simulator, where events record nothing and simulation is synchronous.

    The outputs are kept until the end event has been waited for, so freeing them (numba frees
    device memory in batches, which synchronises) falls outside the timed region.
    """
    if SIMULATOR:
        begin = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - begin
        del out
        return seconds
    start, end = events
    start.record()
    out = call()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3    # elapsed_time is in milliseconds
    del out
    return seconds


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


def median_seconds(calls: list[Callable[[], Any]], repeats: int) -> float:
    """Median of ``repeats`` timed calls, cycling through ``calls`` (one per input set)."""
    events = (cuda.event(), cuda.event())
    return statistics.median(time_once(calls[i % len(calls)], events) for i in range(repeats))


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
    seconds: float                             # median per call
    repeats: int
    sets: int                                  # input sets rotated through
    launches: int | None                       # kernel launches per call (None: could not count)
    baseline_seconds: float | None = None      # median of the CPU baseline, if the case has one


@dataclasses.dataclass
class Report:
    simulator: bool
    quick: bool
    header: list                               # (key, value) pairs
    copy_bytes: int                            # size of the copied buffer
    copy_seconds: float                        # median per copy
    launch_seconds: float                      # median event time around one empty launch
    host_launch_seconds: float                 # host time per launch, back to back
    results: list

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second of the device-to-device copy, read + write counted."""
        return 2 * self.copy_bytes / self.copy_seconds


def run_case(case: Case, quick: bool) -> Result:
    seed = zlib.crc32(case.name.encode())
    # enough input sets to touch at least twice the L2 between two uses of one set, so no timed
    # call finds its inputs in the cache; one set for cases that are larger than that anyway
    footprint = case.footprint or case.bytes
    sets = max(1, min(2 if quick else MAX_SETS, math.ceil(2 * l2_bytes() / max(case.bytes, 1)),
                      SETS_MEMORY // max(footprint, 1)))
    states = [case.setup(seed + 1000 * i) for i in range(sets)]
    calls = [lambda state=state: case.call(state) for state in states]
    with counting_launches() as count:                                          # warm-up: compiles,
        calls[0]()                                                              # and counts launches
    cuda.synchronize()
    repeats = repeats_for(calls[0], quick)
    seconds = median_seconds(calls, repeats)
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
    del states, calls
    free_device_memory()
    return Result(case, seconds, repeats, sets, count[0], baseline_seconds)


def measure_copy(nbytes: int, quick: bool) -> float:
    """Median seconds of one device-to-device copy of ``nbytes`` (random data)."""
    src = uniform((nbytes // F32,), 1)
    dst = cuda.device_array(src.shape, np.float32)
    copy = lambda: dst.copy_to_device(src)
    copy()
    cuda.synchronize()
    return median_seconds([copy], repeats_for(copy, quick))


def measure_launch(quick: bool, host_launches: int) -> tuple[float, float]:
    """(median event seconds around one empty launch, host seconds per launch back to back)."""
    launch = lambda: empty_kernel[1, 32]()
    launch()                                                                    # compiles
    cuda.synchronize()
    seconds = median_seconds([launch], repeats_for(launch, quick))
    begin = time.perf_counter()
    for _ in range(host_launches):
        launch()
    cuda.synchronize()
    return seconds, (time.perf_counter() - begin) / host_launches


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
    """Measure the two ceilings, then every case; ``log`` gets one progress line per step."""
    with quiet_launches():
        copy_seconds = measure_copy(sizes.copy_bytes, quick)
        free_device_memory()                                                    # the two buffers
        log(f"copy: {2 * sizes.copy_bytes / copy_seconds / 1e9:.1f} GB/s")
        launch_seconds, host_launch_seconds = measure_launch(quick, sizes.host_launches)
        log(f"empty launch: {launch_seconds * 1e6:.1f} us")
        results = []
        for case in cases:
            results.append(run_case(case, quick))
            log(f"{case.name}: {results[-1].seconds * 1e6:.1f} us")
    return Report(SIMULATOR, quick, versions(), sizes.copy_bytes, copy_seconds, launch_seconds,
                  host_launch_seconds, results)
