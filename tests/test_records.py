"""The records under ``docs/results/``: one current record per kind, each cited by a page or a
chapter, and no citation of a record that has left the tree unless it names the commit that held
it (``docs/history.md`` lists those)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
MAX_RECORDS = 20
# a dated record name, as the records were named before one record per kind
DATED = re.compile(r"[a-z0-9-]*20[0-9]{2}-[0-9]{2}-[0-9]{2}[a-z]?(?:-partial)?\.(?:md|txt|json)")


def citing_files():
    yield from (ROOT / "docs").glob("*.md")
    yield ROOT / "README.md"
    for folder in ("walkthrough", "kernels", "ddtree", "lab", "tests"):
        yield from (ROOT / folder).rglob("*.py")


def test_one_record_per_kind_and_every_record_cited():
    records = sorted(path.name for path in RESULTS.iterdir())
    assert len(records) <= MAX_RECORDS, f"docs/results holds {len(records)} files: {records}"
    assert not [name for name in records if DATED.fullmatch(name)], "records are named by kind, not date"
    text = "\n".join(path.read_text(encoding="utf-8") for path in citing_files()
                     if path.name not in ("history.md", "test_records.py"))
    uncited = [name for name in records if name not in text]
    assert not uncited, f"records no page, chapter or module cites: {uncited}"


def test_a_superseded_record_is_cited_with_its_commit():
    present = {path.name for path in RESULTS.iterdir()}
    bad = []
    for path in citing_files():
        if path.name == "test_records.py":
            continue
        text = path.read_text(encoding="utf-8")
        for match in DATED.finditer(text):
            clause = re.split(r"\)|\.\s|\n\s*\n|;", text[match.end():match.end() + 400])[0]   # its clause
            if match.group(0) not in present and not re.search(r"commit\s+[0-9a-f]{7}", clause):
                bad.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not bad, "citations of records no longer in docs/results, without their commit:\n" + "\n".join(bad)
