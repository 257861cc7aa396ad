"""Comparators shared by the equivalence tests and the lab harness: inf/nan masks first, then
a tolerance, the worst element named on failure; discrete results exactly."""

from __future__ import annotations

import numpy as np


def assert_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6, name: str = "output"):
    """inf/nan masks must match first; then |a - e| <= atol + rtol * |e| everywhere.

    On failure, name the worst element, its index and both values.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    for mask_name, mask in (("nan", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        a, e = mask(actual), mask(expected)
        if not np.array_equal(a, e):
            where = np.argwhere(a != e)[0]
            raise AssertionError(f"{name}: {mask_name} masks differ at {tuple(where)}: "
                                 f"actual {actual[tuple(where)]}, expected {expected[tuple(where)]} "
                                 f"({int((a != e).sum())} elements)")
    finite = np.isfinite(expected)
    err = np.where(finite, np.abs(actual.astype(np.float64) - expected), 0.0)
    bound = atol + rtol * np.abs(np.where(finite, expected, 0.0))
    bad = err > bound
    if bad.any():
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.size} elements outside rtol={rtol}, atol={atol}; "
            f"worst at {worst}: actual {actual[worst]!r}, expected {expected[worst]!r}, "
            f"|diff| {err[worst]:.3g}")


def assert_exact(actual, expected, name: str = "output"):
    """Discrete results (ids, indices, masks) must be equal element for element."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    if not np.array_equal(actual, expected):
        where = np.argwhere(actual != expected)[0]
        raise AssertionError(f"{name}: differs at {tuple(where)}: actual {actual[tuple(where)]}, "
                             f"expected {expected[tuple(where)]}")
