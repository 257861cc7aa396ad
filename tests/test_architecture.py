"""The layers and the glossary, enforced: docs/architecture.md and docs/glossary.md.

* Imports point one way: ``ddtree`` <- ``kernels`` <- ``walkthrough``. The reference never
  imports ``kernels`` (parsed with ``ast``, so an import hidden in a function counts too), except
  the CLI's backend loader, lazily, inside ``load_backend``; neither package imports
  ``walkthrough`` or ``tests``.
* Every ``ddtree`` module's legend uses only the glossary's names (``ddtree/config.py``), and the
  glossary page's "where each name appears" table is exactly what the legends say.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = sorted((ROOT / "ddtree").glob("*.py"))
KERNELS = sorted((ROOT / "kernels").rglob("*.py"))
LEGEND = "Legend (docs/glossary.md):"


def imports(path: pathlib.Path):
    """(top-level package imported, enclosing function name or None) for every import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], function))
            visit(child, function)

    visit(tree, None)
    return found


@pytest.mark.parametrize("path", REFERENCE, ids=lambda p: p.name)
def test_the_reference_does_not_import_kernels(path):
    allowed = {("cli.py", "load_backend")}                   # the numba backend, when asked for
    for package, function in imports(path):
        if package == "kernels":
            where = function or "the module"
            assert (path.name, function) in allowed, f"{path.name} imports kernels in {where}"
        assert package not in ("walkthrough", "tests"), f"{path.name} imports {package}"


def test_only_the_backend_loader_reaches_kernels():
    reaching = [(path.name, function) for path in REFERENCE for package, function in imports(path)
                if package == "kernels"]
    assert reaching == [("cli.py", "load_backend")]


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_do_not_import_chapters_tests_or_the_lab(path):
    for package, _ in imports(path):
        assert package not in ("walkthrough", "tests", "lab"), f"{path.relative_to(ROOT)} imports {package}"


# --------------------------------------------------------------------------------------------
# the glossary

def glossary() -> dict[str, str]:
    """name -> meaning, from the table between the glossary markers of ddtree/config.py."""
    text = (ROOT / "ddtree" / "config.py").read_text()
    table = text.split("[start:glossary]")[1].split("# --8<-- [end:glossary]")[0]
    rows = [line.split("|")[1:3] for line in table.strip().splitlines()[2:]]
    return {name.strip(): meaning.strip() for name, meaning in rows}


def split_top_level(text: str, separator: str = ","):
    """``text`` split at separators outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


def legend_names(path: pathlib.Path) -> list[str] | None:
    """The names a module's legend defines (``dn/dr/dv`` counts three), or None without a legend."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    if LEGEND not in docstring:
        return None
    text = " ".join(docstring.split(LEGEND)[1].split("\n\n")[0].split())
    text = re.split(r"\.(\s|$)", text)[0]                       # the legend ends with its sentence
    names = []
    for entry in split_top_level(text):
        names += entry.split()[0].split("/")
    return names


def legends() -> dict[str, list[str]]:
    return {path.name: names for path in REFERENCE if (names := legend_names(path)) is not None}


SHAPELESS = {"__init__.py", "__main__.py", "cli.py", "config.py"}    # no arrays, or the glossary itself


def test_every_module_with_shapes_has_a_legend():
    assert set(legends()) == {path.name for path in REFERENCE} - SHAPELESS


@pytest.mark.parametrize("module", sorted(legends()))
def test_legends_use_glossary_names(module):
    unknown = [name for name in legends()[module] if name not in glossary()]
    assert not unknown, f"ddtree/{module}'s legend uses names that are not in the glossary: {unknown}"


def where_table() -> dict[str, list[str]]:
    """docs/glossary.md's "where each name appears" table: name -> modules."""
    text = (ROOT / "docs" / "glossary.md").read_text()
    section = text.split("## Where each name appears")[1]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return {name.strip().strip("`"): sorted(m.strip().strip("`") for m in modules.split(",") if m.strip())
            for name, modules in rows}


def test_the_glossary_page_says_where_each_name_appears():
    expected = {name: [] for name in glossary()}
    for module, names in legends().items():
        for name in set(names):
            expected[name].append(f"ddtree/{module}")
    expected = {name: sorted(modules) for name, modules in expected.items()}
    assert where_table() == expected
