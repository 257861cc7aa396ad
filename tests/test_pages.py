"""The site and the README as a newcomer meets them: chapters that agree everywhere, and commands
that run as written.

* **Numbering.** The chapters are ``walkthrough/NN_topic.py`` with NN from 00 up without a gap,
  each with its page ``docs/NN_topic.md`` titled ``# N. Title``; mkdocs.yml's nav lists them in that
  order under the same titles, the home page's map links every one, and the README's chapter list
  names every one. Scripts numbered 90 and up write reference pages, not chapters.
* **Commands.** Every command line of the pages and the README (fenced ``bash``/``console``/
  ``shell`` blocks, and inline code that starts with a program) follows the convention: run from
  the repository root after the quickstart, with the virtual environment's programs spelled
  ``.venv/bin/python``, ``.venv/bin/mkdocs``, ... Each one names what exists: a script file, a
  module, flags its command-line parser accepts (read from the parser itself, without running the
  command), test paths, the package's extras; ``-c`` and heredoc code compiles.
* **Cheap commands run.** Outside the exercises (tests/test_exercises.py runs those), the commands
  that finish in seconds in the simulator are run and must exit 0: ``--help``, the numpy demo
  (``-m ddtree demo`` without ``--backend numba``), ``-m ddtree.golden --check``, and inline
  ``-c``/heredoc Python. Chapter scripts (minutes), ``kernels.bench`` (a GPU), ``pytest`` (the
  suite runs itself), ``mkdocs`` (needs the chapters' outputs), ``pip`` and the browser check are
  only checked, not run.
* **Project-internal phrases** ("this session", "device tool", ...) do not appear on the site.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
import warnings
from unittest import mock

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
REFERENCE_SCRIPTS = 90                   # walkthrough/90_*.py and up write reference pages
NUMBERED = re.compile(r"^(?P<number>\d\d)_(?P<name>\w+)$")


# ---------------------------------------------------------------------------------------------------
# numbering


def numbered(paths) -> dict[int, str]:
    """{number: stem} of the NN_name files among ``paths``."""
    found = {}
    for path in paths:
        match = NUMBERED.match(path.stem)
        if match:
            assert int(match["number"]) not in found, f"two files numbered {match['number']}: {path.name}"
            found[int(match["number"])] = path.stem
    return found


def chapter_scripts() -> dict[int, str]:
    return {n: stem for n, stem in numbered((ROOT / "walkthrough").glob("*.py")).items()
            if n < REFERENCE_SCRIPTS}


def page_title(stem: str) -> tuple[int, str]:
    """(number, title) of a chapter page's first line ``# N. Title``."""
    first = (DOCS / f"{stem}.md").read_text(encoding="utf-8").splitlines()[0]
    match = re.fullmatch(r"# (\d+)\. (.+)", first)
    assert match, f"docs/{stem}.md: its first line {first!r} is not '# N. Title'"
    return int(match[1]), match[2]


def nav_entries(items=None) -> list[tuple[str, str]]:
    """(title, file) of every page of mkdocs.yml's nav, in reading order."""
    if items is None:
        items = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    entries = []
    for item in items:
        for title, value in item.items():
            entries += nav_entries(value) if isinstance(value, list) else [(title, value)]
    return entries


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same level."""
    level = heading.split(" ")[0]
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^{level} |\Z)", text, re.M | re.S)
    assert match, f"no {heading!r} section"
    return match.group(1)


def test_chapters_are_numbered_from_zero_without_a_gap_and_each_has_its_page():
    scripts = chapter_scripts()
    assert sorted(scripts) == list(range(len(scripts))), f"chapter scripts: {sorted(scripts)}"
    pages = numbered(DOCS.glob("*.md"))
    assert pages == scripts, "docs/NN_*.md and walkthrough/NN_*.py differ: " \
        f"{sorted(set(pages.items()) ^ set(scripts.items()))}"
    for number, stem in scripts.items():
        assert page_title(stem)[0] == number, f"docs/{stem}.md is titled as chapter {page_title(stem)[0]}"


def test_the_reference_scripts_write_no_chapter():
    scripts = numbered((ROOT / "walkthrough").glob("*.py"))
    reference = {n: stem for n, stem in scripts.items() if n >= REFERENCE_SCRIPTS}
    assert reference, "no reference script (walkthrough/90_errors.py writes the refused-inputs page)"
    assert not set(reference.values()) & {p.stem for p in DOCS.glob("*.md")}


def test_the_nav_lists_every_page_and_the_chapters_in_order_under_their_titles():
    entries = nav_entries()
    files = [file for _, file in entries]
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(files) == pages, f"pages not in the nav, or nav entries without a page: " \
        f"{sorted(set(files) ^ set(pages))}"
    chapters = [(title, file) for title, file in entries if NUMBERED.match(pathlib.Path(file).stem)]
    scripts = chapter_scripts()
    assert [file for _, file in chapters] == [f"{scripts[n]}.md" for n in sorted(scripts)]
    for title, file in chapters:
        number, heading = page_title(pathlib.Path(file).stem)
        assert title == f"{number}. {heading}", f"nav title {title!r} for {file}, page says {heading!r}"


def test_the_home_page_map_links_every_chapter_by_its_number():
    text = section((DOCS / "index.md").read_text(encoding="utf-8"), "## Map of the chapters")
    links = re.findall(r"\[(\d+)\. [^\]]+\]\((\d\d_\w+)\.md\)", text)
    scripts = chapter_scripts()
    assert [(int(n), stem) for n, stem in links] == sorted(scripts.items())


def test_the_readme_names_every_chapter():
    text = " ".join(section((ROOT / "README.md").read_text(encoding="utf-8"), "## Chapters").split()).lower()
    for number, stem in chapter_scripts().items():
        title = page_title(stem)[1].lower()
        assert f"{number} {title}" in text, f"README's chapter list lacks '{number} {title}'"


# ---------------------------------------------------------------------------------------------------
# command lines

FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)
SHELL = {"bash", "console", "shell", "sh"}
INLINE = re.compile(r"(?<!`)`(?P<code>[^`]+)`(?!`)")
PROGRAM = r"(?:\.venv/bin/\S+|python3?|pip3?|pytest|mkdocs|ruff)"
INLINE_COMMAND = re.compile(rf"(?:[A-Z_][A-Z0-9_]*=\S+\s+)*{PROGRAM}\s+\S")
BARE = {"python", "python3", "pip", "pip3", "pytest", "mkdocs", "ruff"}
SEPARATORS = {";", "&&", "||", "|", "&", "\n", "(", ")"}
KEYWORDS = {"do", "then", "else", "time", "!"}


@dataclasses.dataclass
class Command:
    """A command line as a page shows it: where, its text, heredoc bodies, and whether it is in an
    exercises section (tests/test_exercises.py runs those)."""
    where: str
    text: str
    heredocs: list[str]
    exercise: bool


def blank(text: str, start: int, end: int) -> str:
    """``text`` with [start, end) blanked, newlines kept: every offset and line number stays."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def split_heredocs(body: str) -> tuple[str, list[str]]:
    """The command text of a shell block, and the bodies of its heredocs (``<<'EOF' ... EOF``)."""
    lines, heredocs, terminator = [], [], None
    for line in body.splitlines(keepends=True):
        if terminator is not None:
            if line.strip() == terminator:
                terminator = None
            else:
                heredocs[-1] += line
            continue
        lines.append(line)
        opened = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if opened:
            terminator = opened.group(1)
            heredocs.append("")
    return "".join(lines), heredocs


def page_commands(path: pathlib.Path) -> list[Command]:
    text = path.read_text(encoding="utf-8")
    exercises = [(m.start(), m.end())
                 for m in re.finditer(r"^## Exercises\n.*?(?=^## |\Z)", text, re.M | re.S)]

    def where(offset):
        return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"

    def in_exercises(offset):
        return any(start <= offset < end for start, end in exercises)

    commands, prose = [], text
    for match in FENCE.finditer(text):
        if match["lang"] in SHELL:
            body = re.sub(r"^" + match["indent"], "", match["body"], flags=re.M)
            command, heredocs = split_heredocs(body)
            commands.append(Command(where(match.start()), command, heredocs, in_exercises(match.start())))
        prose = blank(prose, match.start(), match.end())
    for match in re.finditer(r"<!--.*?-->", text, re.S):
        prose = blank(prose, match.start(), match.end())
    for match in INLINE.finditer(prose):
        code = " ".join(match["code"].split())
        if INLINE_COMMAND.fullmatch(code) or INLINE_COMMAND.match(code):
            commands.append(Command(where(match.start()), code, [], in_exercises(match.start())))
    return commands


def all_commands() -> list[Command]:
    return [command for source in SOURCES for command in page_commands(source)]


def simple_commands(text: str) -> list[list[str]]:
    """The words of each simple command in a shell command line: split at ; && || | & and line
    ends, redirections dropped, leading ``VAR=value`` assignments and ``do``/``then`` dropped."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace = " \t"
    lexer.wordchars += "$[]{}%+,:^@!"
    words, commands = [], []
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in SEPARATORS:
            commands.append(words)
            words = []
        elif set(token) <= set("<>&") and ("<" in token or ">" in token):      # a redirection
            if words and words[-1].isdigit():
                words.pop()                                                  # its descriptor (2>&1)
            i += 1                                                           # its target
        else:
            words.append(token)
        i += 1
    commands.append(words)
    cleaned, loop = [], {}
    for words in commands:
        if words[:1] == ["for"] and len(words) > 3 and words[2] == "in":
            values = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(words[3])) or [words[3]]
            loop[words[1]] = values[0]                   # a loop variable stands for its first value
        words = [re.sub(r"\$\{?(\w+)\}?", lambda m: loop.get(m[1], m[0]), word) for word in words]
        while words and (words[0] in KEYWORDS or re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0])):
            words = words[1:]
        if words and words[0] not in {"for", "done", "fi", "while", "if"}:
            cleaned.append(words)
    return cleaned


def program(words: list[str]) -> str:
    return words[0].removeprefix(".venv/bin/")


class Parsed(Exception):
    """Raised by the patched ``parse_args``: the arguments parsed, the command was not run."""


@contextlib.contextmanager
def parse_only():
    """``argparse.ArgumentParser.parse_args`` that parses (exiting 2 on a bad flag, 0 on --help as
    usual) and then stops the program: its flags are checked against the parser, nothing runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def parse_with_the_parser(argv: list[str], run) -> str | None:
    """Run ``run`` (a module's or script's main) with sys.argv = argv under ``parse_only``; None if
    the arguments parse, else what the parser said."""
    saved = sys.argv[:]
    sys.argv = argv
    output = io.StringIO()
    try:
        with parse_only(), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), \
                warnings.catch_warnings(), mock.patch.dict(os.environ):        # a script may set variables
            warnings.simplefilter("ignore", RuntimeWarning)      # runpy: a package's module already imported
            run()
    except Parsed:
        return None
    except SystemExit as stop:
        return None if stop.code in (0, None) else f"exit {stop.code}: {output.getvalue().strip()[-500:]}"
    finally:
        sys.argv = saved
    return "the program ran past its argument parser"


CLI_MODULES = {"ddtree", "ddtree.golden", "kernels.bench", "lab.harness"}   # parse first, then work
PYTEST_VALUES = {"-k", "-m", "-n", "-p", "--dist", "-W", "--maxfail", "--durations", "-o"}


def extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project.get("optional-dependencies", {}))


def check_python(words: list[str], heredocs: list[str]) -> str | None:
    """What is wrong with one ``python ...`` command, or None."""
    args = words[1:]
    while args and args[0] in {"-u", "-B", "-X", "-W"}:
        args = args[2:] if args[0] in {"-X", "-W"} else args[1:]
    if not args:
        return "python with no script"
    if args[0] == "-c":
        try:
            compile(args[1], "<-c>", "exec")
        except SyntaxError as error:
            return f"its -c code does not compile: {error}"
        return None
    if args[0] == "-":
        for code in heredocs:
            try:
                compile(code, "<stdin>", "exec")
            except SyntaxError as error:
                return f"its heredoc does not compile: {error}"
        return None if heredocs else "python - without a heredoc"
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module in {"venv"}:
            return None
        if module == "pip":
            return check_pip(rest)
        if module == "pytest":
            return check_pytest(rest)
        if importlib.util.find_spec(module) is None:
            return f"no module {module}"
        if module in CLI_MODULES:
            def run():
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            return parse_with_the_parser([module, *rest], run)
        return None
    script = ROOT / args[0]
    if "$" in args[0] or "<" in args[0]:
        return None                                     # a variable or a placeholder: nothing to check
    if not script.is_file():
        return f"no script {args[0]}"
    rest = args[1:]
    if not rest:
        return None
    source = script.read_text(encoding="utf-8")
    if "argparse" in source:
        sys.path.insert(0, str(script.parent))
        try:
            return parse_with_the_parser([str(script), *rest],
                                         lambda: runpy.run_path(str(script), run_name="__main__"))
        finally:
            sys.path.remove(str(script.parent))
    sys.path.insert(0, str(script.parent))            # as python does for a script: its helpers import
    try:
        with mock.patch.dict(os.environ):
            demos = runpy.run_path(str(script), run_name="pages_check").get("DEMOS", {})
    finally:
        sys.path.remove(str(script.parent))
    return None if rest[0] in demos else \
        f"{args[0]} takes no argument {rest[0]!r} (its demos: {sorted(demos)})"


def check_pytest(args: list[str]) -> str | None:
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in PYTEST_VALUES:
            skip = True
        elif not arg.startswith("-") and not (ROOT / arg.split("::")[0]).exists():
            return f"pytest: no {arg}"
    return None


def check_pip(args: list[str]) -> str | None:
    for arg in args:
        match = re.fullmatch(r"\.\[(?P<extras>[\w,-]+)\]", arg)
        if match and not set(match["extras"].split(",")) <= extras():
            return f"pip: unknown extras in {arg} (pyproject has {sorted(extras())})"
    return None


def check_mkdocs(args: list[str]) -> str | None:
    # a machine without the docs extra (a GPU machine running the suite) cannot check these
    cli = pytest.importorskip("mkdocs.__main__", reason="mkdocs is not installed (the docs extra)").cli

    if not args or args[0] not in cli.commands:
        return f"mkdocs has no command {args[:1]} (it has {sorted(cli.commands)})"
    try:
        cli.commands[args[0]].make_context(args[0], list(args[1:]))
    except Exception as error:                          # click's usage errors
        return f"mkdocs {args[0]}: {error}"
    return None


def check_command(command: Command) -> list[str]:
    """What is wrong with a command line: the convention, then what each program is given."""
    problems = []
    for words in simple_commands(command.text):
        name = program(words)
        if words[0] in BARE and not (words[0] == "python3" and words[1:3] == ["-m", "venv"]):
            problems.append(f"{words[0]} is not spelled .venv/bin/{words[0]}")
            continue
        if name in {"python", "python3"}:
            problem = check_python(words, command.heredocs)
        elif name in {"pip", "pip3"}:
            problem = check_pip(words[1:])
        elif name == "mkdocs":
            problem = check_mkdocs(words[1:])
        elif words[0].startswith(".venv/bin/"):
            problem = None if name in {"ruff", "pytest"} else f"unknown program {words[0]}"
        else:
            problem = None
        if problem:
            problems.append(problem)
    return [f"{command.where}: {command.text.strip()[:120]!r}: {p}" for p in problems]


def test_pages_have_commands_to_check():
    commands = all_commands()
    assert len(commands) >= 60, f"only {len(commands)} command lines found"
    assert any(c.where.startswith("README.md") for c in commands)


def test_every_command_follows_the_convention_and_names_what_exists():
    problems = [problem for command in all_commands() for problem in check_command(command)]
    assert not problems, "command lines that would fail as written:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# running the cheap ones


def cheap(command: Command) -> bool:
    """Whether the command finishes in seconds in the simulator (see the module docstring)."""
    if command.exercise:
        return False
    commands = simple_commands(command.text)
    pythons = [words for words in commands if program(words) == "python"]
    if not pythons or any(program(words) in {"pip", "mkdocs", "pytest"} for words in commands):
        return False
    for words in pythons:
        args = words[1:]
        if "--help" in args or args[:1] in (["-c"], ["-"]):
            continue
        if args[:2] == ["-m", "ddtree"] and "numba" not in args:
            continue
        if args[:2] == ["-m", "ddtree.golden"]:
            continue
        return False
    return True


def as_run_here(command: str) -> str:
    """A page's command as this interpreter runs it: ``.venv/bin/`` is the folder of the Python
    running the tests (the quickstart's .venv in CI and on a reader's machine)."""
    return command.replace(".venv/bin/", f"{pathlib.Path(sys.executable).parent}/")


def run_here(command: str, heredocs=(), timeout: int = 120) -> subprocess.CompletedProcess:
    """The command in bash -e from the repository root, kernels in the CUDA simulator."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", MPLBACKEND="Agg")
    text = as_run_here(command)
    for body in heredocs:                               # put the heredoc bodies back
        text = re.sub(r"(<<-?\s*['\"]?(\w+)['\"]?[^\n]*\n)",
                      lambda m, b=body: m.group(1) + b + m.group(2) + "\n", text, count=1)
    return subprocess.run(["bash", "-e", "-c", text], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


CHEAP = list({command.text: command for command in all_commands() if cheap(command)}.values())  # each once


def test_the_cheap_set_is_what_it_says():
    assert len(CHEAP) >= 4, [c.text for c in CHEAP]
    assert not any("walkthrough/" in c.text or "kernels.bench" in c.text for c in CHEAP)


@pytest.mark.parametrize("command", CHEAP, ids=[c.where for c in CHEAP])
def test_a_cheap_command_runs_as_written(command):
    result = run_here(command.text, command.heredocs, timeout=60)
    assert result.returncode == 0, f"{command.text}\n-> exit {result.returncode}\n" \
        f"{(result.stdout + result.stderr)[-1500:]}"


# ---------------------------------------------------------------------------------------------------
# the checks themselves


def test_simple_commands_split_a_shell_line():
    line = 'for b in 2 4; do NUMBA_X=1 .venv/bin/python -m ddtree demo --block-size $b | tail -2; done'
    assert simple_commands(line) == [[".venv/bin/python", "-m", "ddtree", "demo", "--block-size", "2"],
                                     ["tail", "-2"]]
    assert simple_commands(".venv/bin/python w.py oob 2>&1 | tail -2\n") == \
        [[".venv/bin/python", "w.py", "oob"], ["tail", "-2"]]
    assert simple_commands('.venv/bin/python -c "\nprint(1 > 0)"') == \
        [[".venv/bin/python", "-c", "\nprint(1 > 0)"]]
    assert simple_commands("for c in walkthrough/[0-9]*.py; do .venv/bin/python $c; done") == \
        [[".venv/bin/python", "walkthrough/00_linear.py"]]
    assert split_heredocs(".venv/bin/python - <<'EOF'\nprint(1)\nEOF\necho\n") == \
        (".venv/bin/python - <<'EOF'\necho\n", ["print(1)\n"])


@pytest.mark.parametrize("text, problem", [
    ("python walkthrough/00_linear.py", "is not spelled .venv/bin/python"),
    ("mkdocs build", "is not spelled .venv/bin/mkdocs"),
    (".venv/bin/python walkthrough/99_nothing.py", "no script"),
    (".venv/bin/python -m ddtree demo --no-such-flag", "exit 2"),
    (".venv/bin/python -m ddtree demo --drafter nobody", "exit 2"),
    (".venv/bin/python -m kernels.bench no-such-subcommand", "exit 2"),
    (".venv/bin/python -m no_such_module", "no module"),
    (".venv/bin/python -m pytest -q tests/test_nothing.py", "pytest: no tests/test_nothing.py"),
    (".venv/bin/python -c 'print(('", "does not compile"),
    (".venv/bin/pip install -e '.[test,nothing]'", "unknown extras"),
    (".venv/bin/mkdocs bild", "no command"),
    (".venv/bin/python walkthrough/17_debugging.py nothing", "takes no argument"),
])
def test_a_broken_command_is_found(text, problem):
    problems = check_command(Command("here", text, [], False))
    assert problems and problem in problems[0], problems


@pytest.mark.parametrize("text", [
    ".venv/bin/python -m ddtree demo --drafter noisy --budget 0 --rounds",
    ".venv/bin/python -m kernels.bench engine --floor-only --presets small",
    ".venv/bin/python -m pytest -q tests/test_config.py -k preset",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test,docs,lint]'",
    ".venv/bin/mkdocs build --strict",
    ".venv/bin/python walkthrough/17_debugging.py race",
])
def test_a_good_command_passes(text):
    assert check_command(Command("here", text, [], False)) == []


# ---------------------------------------------------------------------------------------------------
# the site speaks of the project

INTERNAL = re.compile(r"\bsession's|(?<!pdb )\bsessions?\b|device tool|lent by|device notes", re.I)


def internal_phrases(text: str) -> list[str]:
    return [match.group(0) for match in INTERNAL.finditer(" ".join(text.split()))]


def test_the_site_speaks_of_the_project_only():
    found = {page.name: internal_phrases(page.read_text(encoding="utf-8"))
             for page in sorted(DOCS.glob("*.md"))}
    found = {name: phrases for name, phrases in found.items() if phrases}
    assert not found, f"project-internal phrases on the site: {found}"


@pytest.mark.parametrize("text, found", [
    ("as earlier sessions measured", ["sessions"]),
    ("this session's code", ["session's"]),
    ("lent by the project's device tool", ["lent by", "device tool"]),
    ("a scripted pdb session, and the pdb\nsession above", []),
])
def test_internal_phrases_are_found(text, found):
    assert internal_phrases(text) == found


# ---------------------------------------------------------------------------------------------------
# mkdocs in a fresh clone: one line saying to run the chapters (tools/figures_hook.py)


def test_the_build_hook_names_what_is_missing_and_what_to_run(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import figures_hook
    finally:
        sys.path.remove(str(ROOT / "tools"))
    docs, figures = tmp_path / "docs", tmp_path / "docs" / "assets" / "figures"
    figures.mkdir(parents=True)
    (docs / "01_x.md").write_text('# 1. X\n\n--8<-- "docs/assets/figures/01_x_report.txt:part"\n\n'
                                  '![a figure](assets/figures/01_x_plot.png)\n'
                                  '--8<-- "ddtree/tree.py:check_budget"\n')
    assert figures_hook.missing_outputs(tmp_path) == ["docs/assets/figures/01_x_plot.png",
                                                      "docs/assets/figures/01_x_report.txt"]
    (figures / "01_x_report.txt").write_text("--8<-- [start:other]\n--8<-- [end:other]\n")
    assert figures_hook.missing_outputs(tmp_path) == ["docs/assets/figures/01_x_plot.png",
                                                      "docs/assets/figures/01_x_report.txt:part"]
    (figures / "01_x_report.txt").write_text("--8<-- [start:part]\n--8<-- [end:part]\n")
    (figures / "01_x_plot.png").write_bytes(b"")
    assert figures_hook.missing_outputs(tmp_path) == []
    line = figures_hook.message(["docs/assets/figures/01_x_plot.png"])
    assert "\n" not in line and "walkthrough/[0-9]*.py" in line and ".venv/bin/python" in line
    with pytest.raises(SystemExit, match="run the chapters first"):
        (figures / "01_x_plot.png").unlink()
        figures_hook.on_pre_build({"config_file_path": str(tmp_path / "mkdocs.yml")})
