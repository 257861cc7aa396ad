"""Every exercise on the site runs: the commands of each page's "## Exercises" section, as a reader
would paste them.

The pages are the single home of the exercises: each has a ``bash`` block with the command to try
and a folded answer (``??? question``). This test collects the blocks from docs/*.md and runs
each in bash from the repository root as the page writes it (``.venv/bin/python``, the quickstart's
interpreter, being the one running the tests; tests/test_pages.py checks the convention), with the
kernels in the CUDA simulator. A command that stops working, or a page whose exercises lose their
command or their answer, fails here instead of on a reader's machine.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import subprocess

import pytest

from tests.test_pages import as_run_here

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>[ ]*)```bash\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)
TIMEOUT = 120                      # seconds per command; every one takes a few on two cores
# the pages that must have exercises: every chapter (docs/NN_topic.md)
PAGES_WITH_EXERCISES = sorted(page.name for page in DOCS.glob("[0-9][0-9]_*.md"))


def exercise_sections() -> dict[str, str]:
    """The text of each page's "## Exercises" section (up to the next "## " heading), by page."""
    sections = {}
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        match = re.search(r"^## Exercises\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        if match:
            sections[page.name] = match.group(1)
    return sections


def exercise_commands() -> list[tuple[str, str]]:
    """(page, command) for every bash block of every exercises section."""
    return [(page, match.group("body")) for page, section in exercise_sections().items()
            for match in FENCE.finditer(section)]


PYTEST = re.compile(r"^\.venv/bin/python -m pytest (?P<arguments>[^\n]*)\n?$")


def collecting_only(command: str) -> str:
    """An exercise that runs some of the suite's own tests (one ``python -m pytest`` line), as a
    collection: the suite runs those tests itself, so here they need only exist, and the line's
    selection must find some. Any other command as it is."""
    match = PYTEST.match(command)
    if match is None:
        return command
    return f".venv/bin/python -m pytest --collect-only -q -p no:cacheprovider {match['arguments']}"


def run(command: str) -> subprocess.CompletedProcess:
    """The command in bash from the repository root, ``.venv/bin/python`` being this interpreter."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", MPLBACKEND="Agg")
    return subprocess.run(["bash", "-e", "-c", as_run_here(collecting_only(command))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


def test_every_chapter_has_exercises_with_answers():
    sections = exercise_sections()
    missing = [name for name in PAGES_WITH_EXERCISES if name not in sections]
    assert not missing, f"pages without an '## Exercises' section: {missing}"
    for page, section in sections.items():
        commands = len(FENCE.findall(section))
        answers = len(re.findall(r'^\?\?\? question "Answer"$', section, re.M))
        assert 2 <= commands <= 3, f"{page}: {commands} exercise commands, expected two or three"
        assert answers == commands, f"{page}: {answers} folded answers for {commands} exercises"


def test_every_exercise_command_runs():
    commands = exercise_commands()
    assert len(commands) >= 24, f"only {len(commands)} exercise commands found"
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:   # two cores: half the wall time
        results = list(pool.map(lambda item: (item, run(item[1])), commands))
    failed = [f"{page}:\n{command}\n-> exit {result.returncode}\n{(result.stdout + result.stderr)[-1500:]}"
              for (page, command), result in results if result.returncode != 0]
    assert not failed, "exercise commands that fail:\n\n" + "\n\n".join(failed)


@pytest.mark.parametrize("command, expected", [
    ("```bash\n.venv/bin/python -c 'print(1)'\n```\n", [".venv/bin/python -c 'print(1)'\n"]),
    ("    ```bash\n    echo a\n    echo b\n    ```\n", ["    echo a\n    echo b\n"]),
    ("```text\nnot a command\n```\n", []),
])
def test_the_fence_pattern_finds_bash_blocks_only(command, expected):
    assert [m.group("body") for m in FENCE.finditer(command)] == expected


def test_a_pytest_exercise_is_collected_and_must_select_tests():
    """A line of the suite's own tests is collected, not run again; a selection that finds no
    test fails (pytest exits 5), as a missing file does (4)."""
    assert collecting_only(".venv/bin/python -m pytest -q tests/test_config.py\n") == \
        ".venv/bin/python -m pytest --collect-only -q -p no:cacheprovider -q tests/test_config.py"
    assert collecting_only(".venv/bin/python -m pytest -q a.py\necho b\n") == \
        ".venv/bin/python -m pytest -q a.py\necho b\n"
    found = run(".venv/bin/python -m pytest -q tests/test_config.py -k preset\n")
    assert found.returncode == 0 and "tests/test_config.py: " in found.stdout
    missing = run(".venv/bin/python -m pytest -q tests/test_config.py -k no_such_test_anywhere\n")
    assert missing.returncode == 5
    assert run(".venv/bin/python -m pytest -q tests/no_such_file.py\n").returncode == 4
