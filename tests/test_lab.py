"""Every lab version (``lab/<op>/vN_*.py``) against its numpy twin and the shipped kernel, through
the lab's own harness (``python -m lab.harness``), on its small cases: in the simulator in CI, on
hardware on a GPU. The engine never imports the lab."""

from __future__ import annotations

import pytest

from lab import harness

VERSIONS = harness.versions()


@pytest.mark.parametrize("path", VERSIONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_lab_version_matches_twin_and_shipped(path):
    module = harness.load(path)
    assert module.__doc__ and module.__doc__.strip(), f"{path} opens with a paragraph"
    assert harness.check(module), f"{path} has no cases"


def test_every_lab_folder_names_a_shipped_op():
    for path in VERSIONS:
        module = harness.load(path)
        assert module.SHIPPED.startswith("kernels."), f"{path}: SHIPPED must name a function of kernels/"
        assert module.TWIN.startswith("ddtree."), f"{path}: TWIN must name a function of ddtree/"
