"""Benchmark of every kernel at Kimi K2.6 per-layer dimensions: ``python -m kernels.bench``.

Usage:
    python -m kernels.bench                      # every case, Kimi K2.6 shapes, on the GPU
    python -m kernels.bench --out bench.md       # ... and write the report to a markdown file
    python -m kernels.bench --cases 'attention*,rmsnorm'   # names or shell patterns, comma-separated
    python -m kernels.bench --quick              # tiny shapes, one repeat (the simulator smoke test)
    python -m kernels.bench engine --out r.md    # the whole engine, tok/s side by side (engine.py)
    python -m kernels.bench ncu ncu.csv          # Nsight Compute's CSV summed by kernel (ncu.py)

The package:
    case.py         ``Case`` (one timed call), the sizes, random device inputs, and ``make_cases``,
                    which collects each kernel module's ``bench_cases(sizes)``: a kernel's
                    benchmark (its shapes and its ``bytes_moved`` / ``flops``) lives beside it
    harness.py      timing, launch and allocation counting, the ceilings, ``benchmark``
    peers.py        PyTorch on the same inputs (optional: torch is not a dependency)
    environment.py  where it ran: GPU, driver, versions, L2 size
    report.py       the markdown report
    hardware.py     the H200 figures recorded in docs/results (read from the file, not retyped)
    engine.py       the device engine against numpy and transformers (``engine`` subcommand)
    ncu.py          Nsight Compute's per-launch CSV summed by kernel and shape (``ncu``)
    cli.py          the command line

What is timed: two things per case, side by side.

* **call µs**: one call of a *public* function of ``kernels`` (``rmsnorm``, ``linear``,
  ``attention_paths``, ...) with device arrays in and device arrays out, as a caller without
  buffers makes it. It includes the Python-side checks, the output allocation and the NaN poison
  fill of ``kernels.device.poisoned`` (one extra launch per output on a GPU), and any small
  host->device copy the function makes. **host µs** is that call's own host time.
* **device µs**: the same kernels with their outputs (and scratch) given, as the engine launches
  them (``Case.launch_given``), captured into a CUDA graph with ``cuda.core``'s graph builder and
  replayed: the kernels' device time, without Python. A launch with its outputs given must
  allocate and copy nothing; the harness counts both and the tests check for zero.

The inputs are allocated once per input set, before timing, and filled with random values (never
zeros: zeros can hide unwritten outputs and run faster than real data).

How it is timed (per case):
  1. warm-up: one call, which compiles every kernel signature it needs and counts the kernel
     launches it makes ("launches" in the note; on a GPU the poison fills are launches too);
  2. two untimed calls on the host clock choose N: the case runs ~0.2 s, and at least 5 calls;
  3. N timed calls, each between two CUDA events on the default stream: record start, call,
     record end, wait for end. The time between the events is everything the stream saw: the
     kernels and, when the host is slower than the GPU, the gaps while Python prepares the next
     launch (a numba launch costs ~22 us of host time: small kernels are launch-bound).
     The report gives the median.
  4. device time: one graph holds C copies of the outputs-given launches (C ~ 2 ms of work, at
     most 64, a multiple of the input sets), replayed between two events at least 5 times; the
     median replay over C.
  5. Inputs that fit in the L2 cache would be timed from the cache: such cases get several input
     sets (together at least twice the L2 size, at most 16 GiB) and call i (or copy i of the
     graph) uses set i mod sets.
  6. torch, where the case has a peer (``peers``) and torch runs here: the same work on the same
     device arrays, C copies in a torch CUDA graph, timed the same way.
With ``--quick`` (the simulator's smoke test) one input set; one call is the warm-up and the
timing, and the outputs-given launches run once into its outputs, directly (the simulator has
no graphs). Without it, input set 0's outputs-given launches also write into the warm-up's
outputs (when the case has no ``prepare``).
The tree-build cases also time the numpy reference (``ddtree.tree.build_tree``, a Python heap)
on the same requests, on the CPU with the host clock: the GPU's speed-up over it is in the note.

Bytes and FLOPs come from the kernel modules' cost models. ``bytes`` is the fewest bytes the
work must move through device memory: every input read once and every output written once
(float32 = 4 B, int64 = 8 B). A kernel that re-reads (attention reads the cache once per head,
the GEMV's x) moves more; its GB/s is then an *effective* rate, bytes / time. FLOPs count
multiply-adds as 2 (softmax exps, sin/cos and comparisons are not counted).

The ceilings, measured in the same run:
  - copy bandwidth: a 1 GiB device-to-device copy (``d_dst.copy_to_device(d_src)``), counting
    read + write (2 GiB per copy); "% of copy BW" = the case's GB/s over it;
  - launch overhead: the median event time around one launch of an empty kernel, its host time,
    and its device time replayed from a graph (the smallest device time any kernel can have);
  - the fp32 rate: torch's SGEMM (8192 cubed, TF32 off) from a graph when torch runs here, else
    the rate recorded in ``hardware``'s record (the report says which).
A case is memory-bound when its FLOPs per byte are below the fp32 rate / copy bandwidth (the
ridge of the roofline); a compute-bound case shows "-" under "% of copy BW" and its share of the
fp32 rate in the note. "% of floor" = max(bytes / copy bandwidth, FLOPs / fp32 rate) over the
device time.

In the CUDA simulator timings are wall-clock seconds of Python threads: meaningless. The report
says so loudly, and ``--out`` is refused there unless ``--quick``.
"""
