""".ci/gpu's steps: a step or kind it does not know is refused with its usage, before any GPU work."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args", [["record", "nope"], ["record"], ["sanitize", "nope"], ["nope"]])
def test_an_unknown_step_or_kind_prints_the_usage(args, tmp_path):
    result = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), *args, str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "record KIND" in result.stderr and "sanitize TOOL" in result.stderr
    assert not (tmp_path / "out").exists()                      # refused before any work


def test_every_record_kind_names_a_record_the_pages_cite():
    """The kinds the record step makes are records under docs/results/."""
    text = (ROOT / ".ci" / "gpu").read_text()
    kinds = text.split("record) case \"${tool:-}\" in ")[1].split(")")[0].split(" | ")
    assert kinds == ["bench", "engine", "profile", "sweep", "trained"]
    for kind in kinds:
        assert (ROOT / "docs" / "results" / f"{kind}.md").exists(), kind
