"""mkdocs hook: serve MathJax from the site itself, so the formulas render without a network.

The pages write math as ``\\( ... \\)``, ``\\[ ... \\]`` or ``$$ ... $$``; pymdownx.arithmatex
(generic mode) wraps each formula in an element of class ``arithmatex``, and MathJax typesets those
in the browser (docs/javascripts/mathjax.js holds its configuration). MathJax's files come from the
PyPI package django-static-mathjax (MathJax 3.2.2's build, no Django needed), which the README's
``.[docs]`` install brings. This hook adds the few files the site loads to the build, under
``javascripts/mathjax/``, for ``mkdocs build`` and ``mkdocs serve`` alike.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

SITE_FOLDER = "javascripts/mathjax"
# tex-chtml-full: every TeX extension built in (nothing loaded on demand), HTML+CSS output whose
# fonts live in output/chtml/fonts; ui/ and a11y/ are what the right-click menu may load.
MATHJAX_PARTS = ("tex-chtml-full.js", "output/chtml", "ui", "a11y")


def mathjax_build() -> Path:
    """The es5/ folder of MathJax shipped by django-static-mathjax."""
    try:
        import mathjax  # the import name of django-static-mathjax
    except ImportError as error:
        raise SystemExit(
            "tools/mathjax_hook.py: MathJax is missing; install the docs extra: "
            '.venv/bin/pip install -e ".[docs]"'
        ) from error
    es5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (es5 / MATHJAX_PARTS[0]).is_file():
        raise SystemExit(f"tools/mathjax_hook.py: no {MATHJAX_PARTS[0]} in {es5} (django-static-mathjax 3.x)")
    return es5


def on_files(files: Files, config) -> Files:
    es5 = mathjax_build()
    for part in MATHJAX_PARTS:
        source = es5 / part
        for path in sorted([source] if source.is_file() else source.rglob("*")):
            if path.is_file():
                site_path = f"{SITE_FOLDER}/{path.relative_to(es5).as_posix()}"
                files.append(File.generated(config, site_path, abs_src_path=str(path)))
    return files
