"""The lab: kernel versions that were tried and are not what the engine runs, one module each,
numbered per op (``lab/<op>/vN_<name>.py``, llm.c ``dev/cuda`` style), and this harness, which
runs any of them against the shipped kernel and the numpy twin.

A lab version opens with one paragraph: what it changes against the shipped kernel, why it was
faster or not, and the record that measured it. It defines

    SHIPPED    "kernels.<op>.<function>": the shipped function it stands beside
    TWIN       "ddtree.<op>.<function>": the numpy twin both must match
    SAME_BITS  True if it gives the shipped kernel's bits (it could replace it without changing
               an output), False if it rounds differently (then only the twin's tolerance holds)
    TOLERANCE  optional (rtol, atol) against the twin, default (1e-5, 1e-6)
    cases()    a list of ``Case``: positional arguments (numpy arrays and plain values) that the
               twin, the shipped function and ``run`` all take, ``options`` for the kernels alone
    run(*args, **options)   the version, called like SHIPPED (numpy in, numpy out)

``python -m lab.harness [PATH ...] [--time]`` checks every case of the versions named (all by
default): the inf/nan masks, then the tolerance against the twin; the shipped kernel's bits where
SAME_BITS; discrete outputs (ids, trees) exactly. With ``--time`` (a GPU) it also times the
version and the shipped function on device copies of the inputs, one line each. The engine never
imports the lab; ``tests/test_lab.py`` runs the check of every version in the simulator.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pathlib
import sys
from typing import Any, NamedTuple

import numpy as np

from kernels.bench.compare import assert_close, assert_exact
from kernels.device import SIMULATOR, is_device_array, to_device

LAB = pathlib.Path(__file__).resolve().parent
DEFAULT_TOLERANCE = (1e-5, 1e-6)


class Case(NamedTuple):
    name: str
    args: tuple                       # positional arguments of twin, shipped and run
    options: dict = {}                # keyword arguments of shipped and run only


def versions() -> list[pathlib.Path]:
    """Every lab version, in op and number order."""
    return sorted(path for path in LAB.glob("*/v[0-9]*.py"))


def load(path) -> Any:
    """The module of a lab version, by path (``lab/linear/v1_gemv.py``) or module name."""
    path = pathlib.Path(path)
    name = str(path.with_suffix("")).replace("/", ".") if path.suffix == ".py" else str(path)
    if path.is_absolute():
        name = "lab." + ".".join(path.resolve().relative_to(LAB).with_suffix("").parts)
    module = importlib.import_module(name)
    for field in ("SHIPPED", "TWIN", "SAME_BITS", "cases", "run"):
        if not hasattr(module, field):
            raise ValueError(f"lab version {name} must define {field} (lab/harness.py says how)")
    return module


def function(dotted: str):
    """The function named by "package.module.function"."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def compare(actual, expected, *, exact: bool, tolerance=DEFAULT_TOLERANCE, name: str = "output") -> None:
    """``actual`` against ``expected``, field by field for tuples and dataclasses: floats within
    ``tolerance`` (or bit for bit with ``exact``), everything else exactly."""
    if dataclasses.is_dataclass(expected):
        expected = tuple(getattr(expected, f.name) for f in dataclasses.fields(expected))
        actual = tuple(getattr(actual, f.name) for f in dataclasses.fields(actual))
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), \
            f"{name}: {len(expected)} fields expected"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            compare(a, e, exact=exact, tolerance=tolerance, name=f"{name}[{i}]")
        return
    expected = np.asarray(expected)
    actual = np.asarray(actual.copy_to_host() if is_device_array(actual) else actual)
    if np.issubdtype(expected.dtype, np.floating) and not exact:
        assert_close(actual, expected, *tolerance, name=name)
    elif np.issubdtype(expected.dtype, np.floating):
        assert_exact(actual.view(np.uint32 if actual.itemsize == 4 else np.uint64),
                     expected.view(np.uint32 if expected.itemsize == 4 else np.uint64), name=f"{name} (bits)")
    else:
        assert_exact(actual, expected, name=name)


def check(module) -> list[str]:
    """Check every case of one lab version; returns one line per case (raises on a mismatch)."""
    twin, shipped = function(module.TWIN), function(module.SHIPPED)
    tolerance = getattr(module, "TOLERANCE", DEFAULT_TOLERANCE)
    lines = []
    for case in module.cases():
        expected = twin(*case.args)
        result = module.run(*case.args, **case.options)
        compare(result, expected, exact=False, tolerance=tolerance, name=f"{case.name} against {module.TWIN}")
        if module.SAME_BITS:
            compare(result, shipped(*case.args, **case.options), exact=True,
                    name=f"{case.name} against {module.SHIPPED}")
        lines.append(f"{module.__name__} {case.name}: matches {module.TWIN}"
                     + (f" and {module.SHIPPED} bit for bit" if module.SAME_BITS else ""))
    return lines


def _on_device(value):
    return to_device(value) if isinstance(value, np.ndarray) else value


def time_version(module) -> list[str]:
    """Median device time of the version and of the shipped function, per case (a GPU only)."""
    from kernels.bench.harness import median_seconds, repeats_for  # the timing harness (GPU)

    shipped = function(module.SHIPPED)
    lines = []
    for case in module.cases():
        args = tuple(_on_device(a) for a in case.args)
        timed = {}
        for label, call in (("lab", module.run), ("shipped", shipped)):
            def once(call=call, args=args, options=case.options):
                return call(*args, **options)
            timed[label] = median_seconds([once], repeats_for(once, quick=False))[0]
        lines.append(f"{module.__name__} {case.name}: {timed['lab'] * 1e6:.1f} µs, shipped "
                     f"{timed['shipped'] * 1e6:.1f} µs ({timed['lab'] / timed['shipped']:.2f}x)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="lab versions (default: every lab/*/v*.py)")
    parser.add_argument("--time", action="store_true", help="also time each case on the GPU")
    args = parser.parse_args(argv)
    if args.time and SIMULATOR:
        parser.error("--time needs a GPU (the simulator's times mean nothing)")
    for path in args.paths or versions():
        module = load(path)
        for line in check(module) + (time_version(module) if args.time else []):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
