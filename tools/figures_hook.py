"""mkdocs hook: stop a build whose pages include chapter outputs that are not written yet.

The pages include the chapters' reports and figures from docs/assets/figures/ (``--8<--`` snippet
markers and image links). Those files are written by running the chapters, not committed, so in a
fresh clone they do not exist, and pymdownx.snippets would stop the build with a long traceback
about the first one. This hook looks before the build and, if any is missing (or lacks a section a
page asks for, as after a chapter changed), stops it with one line that says what to run.
"""

from __future__ import annotations

import re
from pathlib import Path

FIGURES = "docs/assets/figures"
RUN_THE_CHAPTERS = 'for c in walkthrough/[0-9]*.py; do .venv/bin/python "$c" || break; done'
SNIPPET = re.compile(r'^[ \t]*--8<-- "(?P<path>docs/assets/figures/[^":]+)(?::(?P<section>[^"]+))?"', re.M)
IMAGE = re.compile(r"\]\((?P<path>assets/figures/[^)\s]+)\)")


def missing_outputs(root: Path) -> list[str]:
    """What the pages of ``root``/docs include from docs/assets/figures/ and is not there: a path,
    or ``path:section`` where the file lacks the section; sorted, each once."""
    missing = set()
    for page in sorted((root / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in SNIPPET.finditer(text):
            path = root / match["path"]
            if not path.is_file():
                missing.add(match["path"])
            elif match["section"] and f"[start:{match['section']}]" not in path.read_text(encoding="utf-8"):
                missing.add(f"{match['path']}:{match['section']}")
        for match in IMAGE.finditer(text):
            if not (root / "docs" / match["path"]).is_file():
                missing.add(f"docs/{match['path']}")
    return sorted(missing)


def message(missing: list[str]) -> str:
    """The one line a build without the chapters' outputs stops with."""
    return (f"mkdocs: the pages include {len(missing)} chapter output(s) not written yet "
            f"(first: {missing[0]}); run the chapters first: {RUN_THE_CHAPTERS}")


def on_pre_build(config) -> None:
    missing = missing_outputs(Path(config["config_file_path"]).resolve().parent)
    if missing:
        raise SystemExit(message(missing))
