"""Benchmark of every kernel at Kimi K2.6 per-layer dimensions: ``python -m kernels.bench``.

Usage:
    python -m kernels.bench                      # every case, Kimi K2.6 shapes, on the GPU
    python -m kernels.bench --out bench.md       # ... and write the report to a markdown file
    python -m kernels.bench --cases 'attention*,rmsnorm'   # names or shell patterns, comma-separated
    python -m kernels.bench --quick              # tiny shapes, one repeat (the simulator smoke test)
    python -m kernels.bench engine --out r.md    # the whole engine, tok/s side by side (engine.py)
    python -m kernels.bench trained --out t.md   # the trained model and its block drafter (trained.py)
    python -m kernels.bench profile | shapes | variants | sweep | digest | ncu FILE.csv | ncu forward

The package:
    case.py         ``Case`` (one timed call), the sizes, random device inputs, and ``make_cases``,
                    which collects each kernel module's ``bench_cases(sizes)`` from ``cases/``
    cases/          a module per kernel module: its cases and its ``bytes_moved`` / ``flops``
    harness.py      how a case is timed, launch and allocation counting, the ceilings, ``benchmark``
    peers.py        PyTorch on the same inputs (optional: torch is not a dependency)
    environment.py  where it ran: GPU, driver, versions, L2 size
    report.py       the markdown report
    hardware.py     the GPU figures recorded in the benchmark record (read from the file, not retyped)
    engine.py, trained.py, profile.py, shapes.py, variants.py, sweep.py, digest.py, ncu.py: the
                    subcommands; cli.py the command line

What is timed, per case: **call µs**, one call of a *public* ``kernels`` function with device
arrays in and out, as a caller without buffers makes it (checks, output allocation, NaN poison
fill and small host->device copies included; **host µs** is its host time); and **device µs**,
the same kernels with their outputs given (``Case.launch_given``), captured into a CUDA graph and
replayed: the kernels alone, without Python. A launch with its outputs given must allocate and
copy nothing; the harness counts both and the tests check for zero. ``harness`` says how.

Bytes and FLOPs come from the cost models in ``cases/``: ``bytes`` is the fewest bytes the work
must move through device memory (every input read once, every output written once); a kernel that
re-reads moves more, and its GB/s is then an effective rate. FLOPs count a multiply-add as 2. The
ceilings, measured in the same run: the read bandwidth (``harness.read_kernel`` reads a 1 GiB
buffer once, passes launched back to back in batches; bytes read per second of the median batch,
the slowest and fastest batch beside it), an empty kernel's launch, and the fp32 rate (torch's
SGEMM, else ``hardware``'s record). The floor of a kernel that streams its weights is their bytes
at the rate a kernel can read them: a copy's rate (read + write) is lower, and a GEMV beats it. A
case below the roofline's ridge (FLOPs per byte under fp32 rate / read bandwidth) is
memory-bound; a compute-bound one shows "-" under "% of read BW" and its share of the fp32 rate in
the note. "% of floor" = max(bytes / read bandwidth, FLOPs / fp32 rate) over the device time.

Every figure says how many repeats its median is of: n= timed calls and the graph replays in each
case's note, the batches of the read bandwidth, the launches of the empty-launch time; the engine
report gives each tok/s row's runs, the AR step's generations and each tree size's rounds.

In the CUDA simulator timings are wall-clock seconds of Python threads: meaningless. The report
says so loudly, and ``--out`` is refused there unless ``--quick``.
"""
