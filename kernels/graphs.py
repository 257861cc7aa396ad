"""Streams and CUDA graphs for the engine: one place that knows how launches reach the GPU.

A *launch sequence* is a Python method that launches kernels on the stream it is given, reading
every per-step value (cache length, positions, the tree) from device buffers whose addresses
never change. ``Graphs.run(key, sequence)`` then either

* replays a CUDA graph captured from that sequence the first time ``key`` was run (graphs on), or
* calls the sequence again, launching each kernel directly from Python (graphs off, and always in
  the CUDA simulator, which has no graphs).

Both paths launch the same kernels with the same arguments in the same order, so their results
are bit-identical. A graph freezes grids, block sizes, pointers and scalar arguments as they were
at capture: nothing in a sequence may allocate or copy from the host, and nothing that changes
per step may be a launch argument.

Capture uses ``cuda.core``'s graph builder, which numba-cuda accepts wherever a stream goes
(``kernel[grid, block, builder](...)``). Capturing compiles nothing: the sequence runs once
directly first (``warm``), so every kernel signature is compiled before the capture starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import numpy as np

from kernels.device import SIMULATOR, core_device, cuda

if not SIMULATOR:
    from cuda.bindings import driver


class Graphs:
    """The engine's stream, and its captured graphs by key."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and not SIMULATOR
        self.captured: dict[Hashable, object] = {}
        self.marks: list = []                     # CUDA events of run_timed
        self.pinned: list = [None, None]          # download_later's two pinned host buffers ...
        self.copied: list = [None, None]          # ... and the events behind their copies
        self.next_slot = 0
        if SIMULATOR:
            self.stream = 0                       # the simulator's only stream
        else:
            self.stream = core_device().create_stream()   # launches, graph replays and copies
            self.stream_handle = int(self.stream.handle)

    # --8<-- [start:run]
    def run(self, key: Hashable, sequence: Callable[[object], None]) -> None:
        """Launch ``sequence``'s kernels: replay its graph (captured on first use) or launch directly."""
        if not self.enabled:
            sequence(self.stream)
            return
        graph = self.captured.get(key)
        if graph is None:
            sequence(self.stream)                 # compile every kernel outside the capture
            self.synchronize()
            builder = self.stream.create_graph_builder()
            builder.begin_building()
            sequence(builder)
            graph = builder.end_building().complete()
            self.captured[key] = graph
            return                                # the direct run above did the work once
        graph.launch(self.stream)
    # --8<-- [end:run]

    def run_timed(self, key: Hashable, phases) -> dict[str, float]:
        """Run named phases [(name, sequence), ...] as ``run`` would, each as its own graph, with a
        CUDA event between phases; returns each phase's device seconds (waits for the last one).

        The benchmark's view of one round: the same launches as one graph of all phases, plus one
        graph replay and one event per phase."""
        if SIMULATOR:
            raise RuntimeError("phase timing needs a GPU (the simulator has no events)")
        from cuda.core import EventOptions

        if len(self.marks) < len(phases) + 1:      # events made once, recorded again every round
            timing = EventOptions(timing_enabled=True)
            self.marks = [self.stream.device.create_event(options=timing) for _ in range(len(phases) + 1)]
        marks = self.marks[:len(phases) + 1]
        self.stream.record(marks[0])
        for mark, (name, sequence) in zip(marks[1:], phases, strict=True):
            self.run((key, name), sequence)
            self.stream.record(mark)
        marks[-1].sync()
        return {name: (marks[i + 1] - marks[i]) / 1e3 for i, (name, _) in enumerate(phases)}

    def synchronize(self) -> None:
        if not SIMULATOR:
            self.stream.sync()

    # --8<-- [start:copies]
    def upload(self, host, device_array, prefix: bool = False) -> None:
        """Copy a small host array into a fixed device buffer, ordered on the engine's stream; with
        ``prefix``, into the first ``host.size`` elements of a 1-D buffer (no device view is made:
        numba's slicing is host work, and a slice of a new length is a new view).

        On a GPU this is one driver call (``cuMemcpyHtoDAsync``): numba's ``copy_to_device`` builds and checks
        array wrappers first, which cost more host time than the copy of a round's few kilobytes. From
        pageable memory the driver stages the bytes before it returns, so ``host`` may be reused at once."""
        host = _matching_host(host, device_array, prefix)
        if SIMULATOR:
            (device_array[:host.size] if prefix else device_array).copy_to_device(host)
        elif host.nbytes:
            _check(driver.cuMemcpyHtoDAsync(_device_pointer(device_array), host.ctypes.data, host.nbytes,
                                            self.stream_handle))

    def download_later(self, device_array, count: int | None = None):
        """Queue a copy of a device buffer (or the first ``count`` elements of a 1-D one, as
        ``download``) to the host behind everything launched so far, without waiting;
        ``collect(ticket)`` waits for it and returns the host array. On a GPU the copy lands in one
        of two pinned host buffers, used in turn (a copy into pageable memory would make the host
        wait for the device right away), followed by an event; so two copies may be in flight, and a
        collected array is valid until two more are queued."""
        shape = device_array.shape if count is None else (_prefix_count(count, device_array),)
        if SIMULATOR:
            return (device_array if count is None else device_array[:count]).copy_to_host(), None
        size = math.prod(shape)
        slot = self.next_slot
        self.next_slot ^= 1
        if self.pinned[slot] is None or self.pinned[slot].size < size:
            self.pinned[slot] = cuda.pinned_array(max(size, 1), device_array.dtype)
            self.copied[slot] = self.stream.device.create_event()
        host = self.pinned[slot][:size].reshape(shape)
        if host.dtype != device_array.dtype:
            raise ValueError(f"download_later: {device_array.dtype} after {host.dtype} in the same slot")
        if host.nbytes:
            _check(driver.cuMemcpyDtoHAsync(host.ctypes.data, _device_pointer(device_array), host.nbytes,
                                            self.stream_handle))
        self.stream.record(self.copied[slot])
        return host, self.copied[slot]

    def collect(self, ticket):
        """The host array of a ``download_later``, once its copy is done (waits for that alone)."""
        host, copied = ticket
        if copied is not None:
            copied.sync()
        return host

    def download(self, device_array, count: int | None = None):
        """Copy a device buffer to the host, or the first ``count`` elements of a 1-D one (no device
        view: ``upload``); waits for everything launched before it (one driver call, then the
        stream's synchronisation)."""
        shape = device_array.shape if count is None else (_prefix_count(count, device_array),)
        if SIMULATOR:
            return (device_array if count is None else device_array[:count]).copy_to_host()
        host = np.empty(shape, device_array.dtype)
        if host.nbytes:
            _check(driver.cuMemcpyDtoHAsync(host.ctypes.data, _device_pointer(device_array), host.nbytes,
                                            self.stream_handle))
        self.stream.sync()
        return host
    # --8<-- [end:copies]


# --8<-- [start:branches]
def fork(stream):
    """Two launch queues whose work may overlap: while a graph is captured, two branches of it
    (``GraphBuilder.split``: the second waits for what the first had captured so far); otherwise
    (launches from Python, the simulator) the same stream twice, so the same launches run in the
    order they are issued. Either way every launch reads and writes the same buffers: the branches
    must not touch each other's outputs until ``join``."""
    if hasattr(stream, "split"):                  # cuda.core's GraphBuilder, capturing
        return stream.split(2)
    return stream, stream


def join(first, second):
    """The queue after both branches of ``fork``: ``first`` (the stream or builder forked), now
    waiting for ``second`` too."""
    if second is first:
        return first
    return type(first).join(first, second)        # returns the builder that was split
# --8<-- [end:branches]


def _check(result) -> None:
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {result[0]!r}")


def _device_pointer(device_array) -> int:
    if not device_array.is_c_contiguous():
        raise ValueError("device_array must be C-contiguous (a fixed engine buffer or a leading slice)")
    return device_array.device_ctypes_pointer.value


def _matching_host(host, device_array, prefix: bool = False) -> np.ndarray:
    """``host`` as a C-contiguous array of the device buffer's dtype and size, or (``prefix``) of at
    most its size, the buffer 1-D (no silent casts)."""
    host = np.ascontiguousarray(host)
    if prefix:
        _prefix_count(host.size, device_array)
    if host.dtype != device_array.dtype or (host.size != device_array.size and not prefix):
        raise ValueError(f"host must be {device_array.dtype} with {device_array.size} elements to fill the "
                         f"device buffer, got {host.dtype} with {host.size}")
    return host


def _prefix_count(count, device_array) -> int:
    """``count`` checked as the length of a prefix of the 1-D ``device_array``."""
    if device_array.ndim != 1:
        raise ValueError(f"a prefix copy needs a 1-D device buffer, got shape {device_array.shape}")
    if not (isinstance(count, int | np.integer) and 0 <= count <= device_array.size):
        raise ValueError(f"count must be an integer in [0, {device_array.size}] (the buffer's length), "
                         f"got {count!r}")
    return int(count)
