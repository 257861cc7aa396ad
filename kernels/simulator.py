"""What the project changes in numba's CUDA simulator, and why: the simulator runs every test
without a GPU, and its speed sets how large the suite's shapes can be.

The simulator runs each CUDA thread of a block as a Python thread, one block at a time. Three of
its habits cost more than the kernels' own arithmetic:

- A barrier (``cuda.syncthreads``) is detected by polling: the block's manager loops over the
  block's threads, holding the GIL, until all of them wait, then wakes them one event at a time.
  ``BlockBarrier`` replaces the poller: the last live thread to arrive releases the others, and a
  thread that returned stops counting, as the poller counts it (and as on the hardware, where an
  exited thread no longer takes part in ``__syncthreads``).
- Every block starts ``blockDim`` new threads. ``install`` keeps a pool of worker threads instead,
  reused by every block of every launch; a worker takes a block's thread index, runs the kernel
  and waits for the next block.
- A device array reaches the kernel wrapped twice (``FakeWithinKernelCUDAArray`` around
  ``FakeCUDAArray``), so that every element access is a chain of Python calls. The kernel gets a
  numpy view of the array instead (``KernelArray``), whose indexing is numpy's own; only its
  ``shape`` is the simulator's, which refuses a negative index as CUDA Python does.

None of these changes what a kernel computes: blocks still run one after another, a block's threads
still run concurrently under the GIL with the same barrier semantics, and an exception in one
thread still stops the block's other threads at their next barrier and is raised with the
simulator's message (``tid=[x, y, z] ctaid=[x, y, z]: ...``).

``install`` also makes a block's threads agree on its shared arrays (``one_shared_array_per_line``).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np


class BlockBarrier:
    """One block's ``__syncthreads`` and its end: ``live`` threads still running, ``waiting`` the
    locks of those that wait at the barrier; the barrier opens when every live thread waits.

    Each waiter blocks on a lock of its own, and opening the barrier releases them all: a woken
    thread reacquires nothing shared (a ``threading.Condition`` would make each of them take its
    lock again, one after another)."""

    def __init__(self, threads: int):
        self.lock = threading.Lock()
        self.live = threads
        self.waiting: list = []
        self.aborted = False                # a thread raised: the others stop at their next barrier
        self.finished = threading.Lock()    # held until every thread returned or raised
        self.finished.acquire()

    def _open(self) -> None:
        waiting, self.waiting = self.waiting, []
        for gate in waiting:
            gate.release()

    def wait(self) -> None:
        with self.lock:
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads call")
            if len(self.waiting) + 1 == self.live:
                self._open()
                return
            gate = threading.Lock()
            gate.acquire()
            self.waiting.append(gate)
        gate.acquire()                      # released by _open
        if self.aborted:
            raise RuntimeError("abort flag set on syncthreads clear")

    def leave(self, failed: bool) -> None:
        with self.lock:
            self.live -= 1
            if failed:
                self.aborted = True
                self._open()
            elif self.waiting and len(self.waiting) == self.live:
                self._open()
            if self.live == 0:
                self.finished.release()


def install() -> None:
    """Patch the simulator (numba-cuda 0.30's ``BlockManager``, ``BlockThread`` and the kernel's
    array wrapper) as the module docstring says. Called once, by ``kernels.device``, when the
    kernels run in the simulator."""
    from numba.cuda.simulator import kernel as simulator
    from numba.cuda.simulator.cudadrv.devicearray import FakeShape

    class KernelArray(np.ndarray):
        """A device array as a kernel sees it: a numpy view (the same memory), whose ``shape``
        refuses negative indices like the simulator's own arrays."""

        @property
        def shape(self):
            return FakeShape(np.ndarray.shape.__get__(self))

    simulator.BlockManager.run = pooled_block_run(worker_class(simulator.BlockThread))
    simulator.FakeWithinKernelCUDAArray = lambda array: array._ary.view(KernelArray)
    one_shared_array_per_line()
    # Python's default interval: the poller needed a short one to let the block's threads run;
    # without it, shorter intervals only add thread switches
    sys.setswitchinterval(5e-3)


def worker_class(block_thread: type) -> type:
    """The pooled thread (a subclass of the simulator's ``BlockThread``, whose kernel API reads
    the attributes ``assign`` sets) that plays one CUDA thread of one block at a time."""
    from numba.cuda.simulator.kernelapi import Dim3

    class Worker(block_thread):
        def __init__(self):
            threading.Thread.__init__(self, daemon=True)
            self.wake = threading.Event()
            self.task = None

        def assign(self, manager, barrier, grid_point, block_point, function, args) -> None:
            self._manager, self.barrier, self.debug = manager, barrier, manager._debug
            self.blockIdx, self.threadIdx = Dim3(*grid_point), Dim3(*block_point)
            x, y, _ = manager._block_dim
            self.thread_id = self.threadIdx.x + x * (self.threadIdx.y + y * self.threadIdx.z)
            self.exception, self.abort = None, False
            self.task = (function, args)
            self.wake.set()

        def run(self) -> None:
            while True:
                self.wake.wait()
                self.wake.clear()
                function, args = self.task
                try:
                    with np.errstate(divide="raise") if self.debug else contextlib.nullcontext():
                        function(*args)
                except BaseException as error:     # the simulator's message: which thread, which block
                    message = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                    if str(error):
                        message += f": {error}"
                    self.exception = (type(error)(message), sys.exc_info()[2])
                finally:                           # a worker that stopped would leave its block waiting
                    self.task = None
                    self.barrier.leave(self.exception is not None)

        def syncthreads(self) -> None:
            self.barrier.wait()

    return Worker


def pooled_block_run(worker: type):
    """``BlockManager.run`` on pooled ``worker`` threads: a block takes idle workers (starting new
    ones when too few are idle), runs its grid point on them, and gives them back when every one
    returned; the first error that is not another thread's abort is raised."""
    idle: list = []                         # workers between blocks; a block takes its own
    idle_lock = threading.Lock()

    def take(count: int) -> list:
        with idle_lock:
            taken = [idle.pop() for _ in range(min(count, len(idle)))]
        while len(taken) < count:
            taken.append(worker())
            taken[-1].start()
        return taken

    def run(self, grid_point, *args) -> None:
        points = list(np.ndindex(*self._block_dim))
        barrier = BlockBarrier(len(points))
        threads = take(len(points))
        for thread, block_point in zip(threads, points, strict=True):
            thread.assign(self, barrier, grid_point, block_point, self._f, args)
        barrier.finished.acquire()
        with idle_lock:
            idle.extend(threads)
        failed = [t.exception for t in threads if t.exception is not None]
        if failed:                          # the first error that is not another thread's abort
            raised = next((e for e in failed if "abort flag set" not in str(e[0])), failed[0])
            raise raised[0].with_traceback(raised[1])

    return run


def one_shared_array_per_line() -> None:
    """Make the simulator's ``cuda.shared.array`` give every thread of a block the same array.

    The simulator keys a block's shared arrays by the source line that declares them, but looks
    the key up, creates a missing array and stores it in three steps with no lock: two threads
    that both miss get different arrays, and the kernel computes from memory its neighbours never
    see (under load, "tiles" and the router's slice kernel gave wrong logits now and then).
    ``dict.setdefault`` looks up and stores in one step under the GIL."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    declared = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:         # dynamic shared memory; refusals
            return declared(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        line = sys._getframe(1)
        return self._allocations.setdefault((line.f_code.co_filename, line.f_lineno), np.empty(shape, dtype))

    FakeCUDAShared.array = array
