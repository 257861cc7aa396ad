"""The catalogue of refused inputs, written from the tests for docs/errors.md.

Every row of ``tests/test_errors.py``'s ``CASES`` is run against a fresh micro model; the table
records the call's area, what its message names, the bad input, and the error (its type and
message; temporary paths and the machine's free memory replaced by placeholders). The test module
checks the same rows (type, name, and that nothing changed), so the page shows what the code
raises today.

Run: .venv/bin/python walkthrough/90_errors.py

Writes docs/assets/figures/errors_catalogue.md (included by docs/errors.md).
"""

import pathlib
import sys
import tempfile

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend

sys.path.insert(0, str(chapter.ROOT))           # tests/ is a package of the repository, not installed
from tests.test_errors import catalogue  # noqa: E402

OUTPUT = chapter.FIGURES / "errors_catalogue.md"


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows) -> str:
    """Four columns, the error as Python prints it (type: message), so that the table fits the text
    column of the site."""
    lines = ["| area | the message names | bad input | the error |", "|---|---|---|---|"]
    for case, error, message in rows:
        lines.append(f"| {case.area} | `{cell(case.names)}` | {cell(case.bad)} | "
                     f"`{type(error).__name__}`: {cell(message)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        rows = catalogue(pathlib.Path(directory))
    chapter.FIGURES.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(f"{len(rows)} refused inputs.\n\n" + table(rows), encoding="utf-8")
    chapter.log(f"wrote {OUTPUT.relative_to(chapter.ROOT)} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
