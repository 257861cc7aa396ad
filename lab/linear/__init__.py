"""Versions of kernels.linear.linear that the engine does not run (``lab/harness.py``), and the
inputs their cases share."""

from __future__ import annotations

import numpy as np

from lab.harness import Case


def inputs(rows: int, depth: int, outputs: int, seed: int):
    """x (T, Din) ~ N(0, 1), weight (Dout, Din) ~ N(0, 1 / Din), float32."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, depth)).astype(np.float32),
            (rng.standard_normal((outputs, depth)) / np.sqrt(depth)).astype(np.float32))


def poisoned():
    """NaN in x row 0 and weight row 2, +-inf in x row 1 (and inf * 0 = NaN at output (1, 4))."""
    x, weight = inputs(2, 20, 5, 4)
    x[0, 3], weight[2, 7], x[1, 11], weight[4, 11] = np.nan, np.nan, np.inf, 0.0
    return x, weight


def linear_cases(shapes: dict, options: dict | None = None) -> list[Case]:
    """A case per named (T, Din, Dout, seed[, options]) shape, then the NaN and inf case; ``options``
    for every case (a shape's own options added to them)."""
    cases = []
    for name, (rows, depth, outputs, seed, *own) in shapes.items():
        given = {**(options or {}), **(own[0] if own else {})}
        cases.append(Case(name, inputs(rows, depth, outputs, seed), given))
    return cases + [Case("nan_inf", poisoned(), dict(options or {}))]
