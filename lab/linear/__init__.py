"""Versions of kernels.linear.linear that the engine does not run (``lab/harness.py``), and the
inputs their cases share."""

from __future__ import annotations

import numpy as np

from kernels.device import as_rows, deliver, output, to_device
from kernels.linear import check_linear
from lab.harness import Case


def linear_contract(x, weight, launch, *, out=None, stream=None, **checked):
    """``kernels.linear.linear``'s contract around a version's launch: the same checks (``checked``:
    check_linear's launch options), numpy in -> numpy out or device in -> device out, an output
    NaN-poisoned until written; ``launch(d_x, d_weight, d_out, stream)`` runs the version's kernels
    on (T, Din), (Dout, Din) and (T, Dout) device arrays, T and Dout > 0."""
    x, weight = check_linear(x, weight, out=out, **checked)
    d_x = as_rows(to_device(x, np.float32), "x")                          # [T, Din]
    d_out = output(out, (*x.shape[:-1], weight.shape[0]), stream=stream)  # [..., Dout] NaN until written
    if d_x.shape[0] > 0 and weight.shape[0] > 0:
        launch(d_x, to_device(weight, np.float32), as_rows(d_out, "out"), stream)
    return deliver(d_out, out, x, weight)


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
