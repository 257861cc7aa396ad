"""The command line of ``python -m kernels.bench`` (see the package docstring)."""

from __future__ import annotations

import argparse
import shlex
import sys

import kernels.bench
from kernels.bench.case import full_sizes, make_cases, quick_sizes, select
from kernels.bench.harness import benchmark
from kernels.bench.report import format_report, simulator_warning
from kernels.device import SIMULATOR


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m kernels.bench",
                                     description=kernels.bench.__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and one repeat (smoke test)")
    parser.add_argument("--cases", help="comma-separated case names or shell patterns (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if SIMULATOR and args.out and not args.quick:
        parser.error("the CUDA simulator's timings are meaningless: --out is refused there unless "
                     "--quick (run on a GPU with NUMBA_ENABLE_CUDASIM=0)")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["engine"]:                          # the whole-engine benchmark (kernels.bench.engine)
        from kernels.bench import engine

        return engine.main(argv[1:])
    if argv[:1] == ["trained"]:                         # the trained model and its block drafter, timed
        from kernels.bench import trained

        return trained.main(argv[1:])
    if argv[:1] == ["profile"]:                         # per-kernel device time in a forward
        from kernels.bench import profile

        return profile.main(argv[1:])
    if argv[:1] == ["shapes"]:                          # launch shapes against their floor
        from kernels.bench import shapes

        return shapes.main(argv[1:])
    if argv[:1] == ["variants"]:                        # launch-shape variants of a forward, A/B
        from kernels.bench import variants

        return variants.main(argv[1:])
    if argv[:1] == ["sweep"]:                           # tokens/s against context length
        from kernels.bench import sweep

        return sweep.main(argv[1:])
    if argv[:1] == ["ncu"]:                             # Nsight Compute's CSV, summed per kernel
        from kernels.bench import ncu

        return ncu.main(argv[1:])
    if argv[:1] == ["digest"]:                          # fingerprints of every result, run to run
        from kernels.bench import digest

        return digest.main(argv[1:])
    args = parse_args(argv)
    sizes = quick_sizes() if args.quick else full_sizes()
    cases = make_cases(sizes)
    if args.list:
        for case in cases:
            print(f"{case.name:24s} {case.what}")
        return 0
    try:
        cases = select(cases, args.cases)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if SIMULATOR:
        print("!" * 100 + f"\n{simulator_warning()}\n" + "!" * 100, flush=True)
    report = benchmark(sizes, cases, args.quick, log=lambda line: print(line, flush=True))
    text = format_report(report, " ".join(["python -m kernels.bench", *map(shlex.quote, argv)]))
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            file.write(text)
    return 0
