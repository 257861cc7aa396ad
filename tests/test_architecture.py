"""The layers and the glossary, enforced: docs/architecture.md and docs/glossary.md.

* Imports point one way: ``ddtree`` <- ``kernels`` <- ``walkthrough``. The reference never
  imports ``kernels`` (parsed with ``ast``, so an import hidden in a function counts too), except
  the CLI's backend loader, lazily, inside ``load_backend``; neither package imports
  ``walkthrough`` or ``tests``.
* Inside ``kernels`` too: base modules (``BASE``) <- op modules <- the engine (``ENGINE``) <-
  ``kernels.bench`` <- ``walkthrough``, with ``lab`` beside the benchmark. An op module never
  imports the benchmark, the engine or the lab; a base module imports only base modules; the
  engine never imports the benchmark or the lab; the benchmark never imports the chapters; and
  no import circle joins ``kernels`` modules (``kernels.bench.*`` included).
* Every ``ddtree`` module's legend uses only the glossary's names (``ddtree/config.py``), and the
  glossary page's "where each name appears" table is exactly what the legends say.
"""

from __future__ import annotations

import ast
import importlib
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


TRAINING = sorted((ROOT / "train").glob("*.py"))
NOT_TESTS = (REFERENCE + KERNELS + sorted((ROOT / "walkthrough").glob("*.py"))
             + sorted((ROOT / "lab").rglob("*.py")))


@pytest.mark.parametrize("path", NOT_TESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_but_tests_imports_the_training_code(path):
    assert "train" not in {package for package, _ in imports(path)}, f"{path.relative_to(ROOT)} imports train"


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.name)
def test_the_training_code_imports_only_the_reference(path):
    packages = {package for package, _ in imports(path)}
    assert not packages & {"kernels", "walkthrough", "tests", "lab"}, f"train/{path.name} imports {packages}"


@pytest.mark.parametrize("path", REFERENCE, ids=lambda p: p.name)
def test_the_reference_never_imports_torch(path):
    assert "torch" not in {package for package, _ in imports(path)}, f"{path.name} imports torch"


# --------------------------------------------------------------------------------------------
# inside kernels: base <- ops <- engine <- bench

ENGINE = {"kernels.model", "kernels.decode", "kernels.graphs"}
BASE = {"kernels", "kernels.device", "kernels.blocks", "kernels.simulator", "kernels.tuning"}


def module_name(path: pathlib.Path) -> str:
    """``kernels/bench/case.py`` -> ``kernels.bench.case``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in KERNELS}
OPS = sorted(name for name in MODULES if name.count(".") == 1 and name not in ENGINE | BASE)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, by its dotted name, wherever the import stands (inside a
    function too): ``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                        # relative: from the file's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def within(name: str, *packages: str) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return any(name == package or name.startswith(package + ".") for package in packages)


@pytest.mark.parametrize("name", OPS)
def test_op_modules_import_neither_the_benchmark_nor_the_engine_nor_the_lab(name):
    wrong = sorted(m for m in imported_modules(MODULES[name])
                   if within(m, "kernels.bench", "kernels.model", "kernels.decode", "lab"))
    assert not wrong, f"{name} (an op module) imports {wrong}"


@pytest.mark.parametrize("name", sorted(BASE))
def test_base_modules_import_only_base_modules(name):
    wrong = sorted(m for m in imported_modules(MODULES[name]) if within(m, "kernels") and m not in BASE)
    assert not wrong, f"{name} (a base module) imports {wrong}"


@pytest.mark.parametrize("name", sorted(ENGINE))
def test_the_engine_imports_neither_the_benchmark_nor_the_lab(name):
    wrong = sorted(m for m in imported_modules(MODULES[name]) if within(m, "kernels.bench", "lab"))
    assert not wrong, f"{name} (the engine) imports {wrong}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, "kernels.bench")))
def test_the_benchmark_does_not_import_the_chapters(name):
    wrong = sorted(m for m in imported_modules(MODULES[name]) if within(m, "walkthrough"))
    assert not wrong, f"{name} imports {wrong}"


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of ``graph`` (module -> modules it imports) that
    has one: its path, first module repeated at the end (Tarjan's algorithm, then a walk)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for after in sorted(graph[node]):
            if after not in index:
                connect(after)
                low[node] = min(low[node], low[after])
            elif after in on_stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:                             # node is its group's root
            group = set()
            while node not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1 or node in graph[node]:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    circles = []
    for group in groups:                                          # a shortest way back to the first
        first = min(group)
        paths, seen = [[first]], {first}
        while paths:
            path = paths.pop(0)
            if first in graph[path[-1]]:
                circles.append(path + [first])
                break
            for after in sorted(graph[path[-1]] & group - seen):
                seen.add(after)
                paths.append(path + [after])
    return sorted(circles)


def test_import_circles_are_found_with_their_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_circles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_kernels_modules():
    graph = {name: imported_modules(path) & set(MODULES) for name, path in MODULES.items()}
    circles = import_circles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


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


# --------------------------------------------------------------------------------------------
# twins by name

# the engine's launches outside a forward's ops table (``kernels.model.round_phases``), by module
ROUND_OPERATIONS = {"tree": ("top_candidates", "positions_and_paths"), "sampling": ("rejection_step",)}


def test_every_kernel_the_engine_calls_has_a_numpy_twin_of_the_same_name():
    """``kernels.<stem>.<name>`` for every op the engine launches (its ops table and a round's)
    has ``ddtree.<stem>.<name>``: the pair the site shows side by side."""
    from kernels.model import ENGINE_OPERATIONS

    missing = [f"ddtree.{stem}.{name}" for table in (ENGINE_OPERATIONS, ROUND_OPERATIONS)
               for stem, names in table.items() for name in names
               if not callable(getattr(importlib.import_module(f"ddtree.{stem}"), name, None))]
    assert not missing, f"kernels the engine runs without a numpy twin: {missing}"
