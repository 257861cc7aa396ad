"""The corpus: the Python standard library's own source, split into train and held-out files.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages`` is one
document, read as UTF-8 (files that do not decode are skipped and counted). A file is held out
by a rule of its relative path alone (``is_heldout``). Installations differ in which files they
have, so the held-out files this project measures on are committed as a manifest
(``corpus/heldout.tsv``: path, sha256 of the content, bytes) and the generation prompts as text
(``corpus/prompts.json``); ``check_heldout`` says where a machine's files differ from it.

    python -m train.corpus --write-manifest     # corpus/heldout.tsv and corpus/prompts.json
    python -m train.corpus --out .corpus        # train.npy, heldout.npy, corpus.json

The arrays are uint16 tokens of the committed tokenizer (``checkpoints/tiny-code``), every
document preceded by one ``<|endoftext|>``; ``corpus.json`` counts files, bytes (the documents'
UTF-8 bytes, separators not counted) and tokens per split.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import platform
import sys
import sysconfig

import numpy as np

from ddtree.drafters import END_OF_TEXT
from ddtree.text import HELDOUT_PROMPTS

ROOT = pathlib.Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "corpus" / "heldout.tsv"
PROMPTS = HELDOUT_PROMPTS
TOKENIZER_DIR = ROOT / "checkpoints" / "tiny-code"
MANIFEST_COLUMNS = ("path", "sha256", "bytes")

HELDOUT_MODULUS = 10
# sha256's first byte is uniform on 0..255 and 26 of those values are multiples of 10
HELDOUT_FRACTION = 26 / 256

PROMPT_COUNT = 16
PROMPT_CHARS = (200, 300)        # a prompt's length in characters: at least, at most


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return platform.python_version()


def source_files(root: pathlib.Path) -> list[str]:
    """Every ``*.py`` under ``root`` outside ``site-packages``: sorted relative posix paths."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"root must be a directory holding the standard library, got {root}")
    paths = (path.relative_to(root) for path in root.rglob("*.py") if path.is_file())
    return sorted(path.as_posix() for path in paths if "site-packages" not in path.parts)


def is_heldout(relative_path: str) -> bool:
    """Whether a file is held out: the first byte of sha256(relative posix path) is a multiple of
    10. A rule of the path alone, never of the content or of which other files exist, so a file
    lands in the same split on every installation and in every Python version that has it."""
    return hashlib.sha256(relative_path.encode("utf-8")).digest()[0] % HELDOUT_MODULUS == 0


def read_text(path: pathlib.Path) -> str | None:
    """A file's text as UTF-8 without newline translation (so its bytes are the text's UTF-8
    bytes), or None when it does not decode."""
    try:
        return pathlib.Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def split(root: pathlib.Path) -> tuple[list[str], list[str], list[str]]:
    """(train paths, held-out paths, undecodable paths) of the files under ``root``, each sorted."""
    train, heldout, skipped = [], [], []
    for relative in source_files(root):
        if read_text(pathlib.Path(root) / relative) is None:
            skipped.append(relative)
        else:
            (heldout if is_heldout(relative) else train).append(relative)
    return train, heldout, skipped


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# the held-out manifest

def write_manifest(path: pathlib.Path, root: pathlib.Path, heldout: list[str], python: str) -> None:
    """One header comment naming the Python version, the column names, then path, sha256, bytes."""
    lines = [f"# held-out files of the CPython {python} standard library: "
             f"sha256(path)[0] % {HELDOUT_MODULUS} == 0",
             "\t".join(MANIFEST_COLUMNS)]
    for relative in heldout:
        data = (pathlib.Path(root) / relative).read_bytes()
        lines.append(f"{relative}\t{sha256_hex(data)}\t{len(data)}")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_manifest(path: pathlib.Path = MANIFEST) -> tuple[str, list[tuple[str, str, int]]]:
    """(python version, [(path, sha256, bytes)]) from a manifest; a malformed one is refused."""
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    if len(lines) < 2 or not lines[0].startswith("# held-out files of the CPython "):
        raise ValueError(f"{path} must start with a '# held-out files of the CPython <version> ...' line")
    if tuple(lines[1].split("\t")) != MANIFEST_COLUMNS:
        raise ValueError(f"{path}'s second line must name the columns {MANIFEST_COLUMNS}, got {lines[1]!r}")
    python = lines[0].split()[6]
    rows = []
    for number, line in enumerate(lines[2:], start=3):
        fields = line.split("\t")
        if len(fields) != 3 or len(fields[1]) != 64 or not fields[2].isdigit():
            raise ValueError(f"{path} line {number} must be 'path<TAB>sha256<TAB>bytes', got {line!r}")
        rows.append((fields[0], fields[1], int(fields[2])))
    return python, rows


def check_heldout(root: pathlib.Path, manifest: pathlib.Path = MANIFEST) -> list[str]:
    """How this machine's held-out files differ from the manifest: one line per missing or
    changed file, and per held-out file the manifest lacks; empty when they match."""
    _, rows = read_manifest(manifest)
    problems = []
    for relative, digest, size in rows:
        path = pathlib.Path(root) / relative
        if not path.is_file():
            problems.append(f"missing: {relative}")
        elif sha256_hex(data := path.read_bytes()) != digest:
            problems.append(f"changed: {relative} ({len(data)} bytes here, {size} in the manifest)")
    listed = {row[0] for row in rows}
    problems += [f"not in the manifest: {relative}" for relative in split(root)[1] if relative not in listed]
    return problems


def require_heldout(root: pathlib.Path, manifest: pathlib.Path = MANIFEST) -> list[str]:
    """The manifest's held-out paths, after checking that ``root`` has exactly those files;
    refuses (naming the differences) otherwise, since held-out numbers from other files do not
    compare."""
    problems = check_heldout(root, manifest)
    if problems:
        python, _ = read_manifest(manifest)
        shown = "\n  ".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
        raise RuntimeError(f"the held-out files under {root} (Python {python_version()}) differ from "
                           f"{manifest} (Python {python}) in {len(problems)} places:\n  {shown}")
    return [row[0] for row in read_manifest(manifest)[1]]


# --------------------------------------------------------------------------------------------
# the prompts

def prompt_start(text: str) -> int | None:
    """Where a file's code begins: the first non-blank line after the module docstring (or the
    file's first non-blank line without one); None when the file does not parse."""
    try:
        body = ast.parse(text).body
    except (SyntaxError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    first = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        first = body[0].end_lineno                             # the docstring's last line, 1-based
    while first < len(lines) and not lines[first].strip():
        first += 1
    return sum(len(line) for line in lines[:first])


def prompt_of(text: str) -> tuple[int, str] | None:
    """(start, prompt): whole lines from ``prompt_start``, as many as fit in PROMPT_CHARS[1]
    characters, ending with a line break; None when that is shorter than PROMPT_CHARS[0]."""
    start = prompt_start(text)
    if start is None:
        return None
    end = text.rfind("\n", start, start + PROMPT_CHARS[1]) + 1
    if end - start < PROMPT_CHARS[0]:
        return None
    return start, text[start:end]


def choose_prompts(root: pathlib.Path, heldout: list[str], count: int = PROMPT_COUNT) -> list[dict]:
    """The prompts of ``count`` held-out files at evenly spaced places in manifest order among
    those that give one (``prompt_of``)."""
    eligible = []
    for relative in heldout:
        found = prompt_of(read_text(pathlib.Path(root) / relative))
        if found is not None:
            eligible.append({"file": relative, "start": found[0], "text": found[1]})
    if len(eligible) < count:
        raise ValueError(f"count must be at most the {len(eligible)} held-out files that give a prompt, "
                         f"got {count}")
    return [eligible[round(i * (len(eligible) - 1) / (count - 1))] for i in range(count)]


def write_prompts(path: pathlib.Path, prompts: list[dict], python: str) -> None:
    rule = (f"held-out files in manifest order that parse and give a prompt; {len(prompts)} at evenly "
            f"spaced places among them. A prompt: whole lines from the first non-blank line after the "
            f"module docstring, as many as fit in {PROMPT_CHARS[1]} characters, ending with a line "
            f"break, at least {PROMPT_CHARS[0]} characters. start: its character offset in the file.")
    document = {"python": python, "rule": rule, "prompts": prompts}
    pathlib.Path(path).write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# pre-tokenizing

def tokenize_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """uint16 tokens: each text preceded by one ``<|endoftext|>``."""
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"tokenizer's vocabulary must fit uint16, got {tokenizer.get_vocab_size()}")
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces += [[END_OF_TEXT], encoding.ids]
    return np.concatenate([np.asarray(piece, dtype=np.uint16) for piece in pieces]) if pieces \
        else np.zeros(0, np.uint16)


def pretokenize(out: pathlib.Path, root: pathlib.Path, tokenizer_dir: pathlib.Path = TOKENIZER_DIR,
                manifest: pathlib.Path = MANIFEST) -> dict:
    """Write ``train.npy``, ``heldout.npy`` and ``corpus.json`` to ``out``; return the summary."""
    from ddtree.text import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    train, _, skipped = split(root)
    heldout = require_heldout(root, manifest)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"python": python_version(),
               "tokenizer_sha256": sha256_hex((pathlib.Path(tokenizer_dir) / "tokenizer.json").read_bytes())}
    for name, paths in (("train", train), ("heldout", heldout)):
        texts = [read_text(pathlib.Path(root) / relative) for relative in paths]
        tokens = tokenize_documents(tokenizer, texts)
        np.save(out / f"{name}.npy", tokens)
        summary[name] = {"files": len(paths), "bytes": sum(len(text.encode("utf-8")) for text in texts),
                         "tokens": int(tokens.size)}
    (out / "corpus.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if skipped:
        print(f"skipped {len(skipped)} files that do not decode as UTF-8: {', '.join(skipped)}",
              file=sys.stderr)
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, help="write the pre-tokenized corpus here")
    parser.add_argument("--write-manifest", action="store_true",
                        help="write corpus/heldout.tsv and corpus/prompts.json from this machine's files")
    parser.add_argument("--root", type=pathlib.Path, default=stdlib_root(), help="the standard library")
    parser.add_argument("--tokenizer", type=pathlib.Path, default=TOKENIZER_DIR)
    args = parser.parse_args(argv)
    if not args.write_manifest and args.out is None:
        parser.error("give --out DIR, --write-manifest, or both")
    if args.write_manifest:
        train, heldout, skipped = split(args.root)
        write_manifest(MANIFEST, args.root, heldout, python_version())
        write_prompts(PROMPTS, choose_prompts(args.root, heldout), python_version())
        print(f"{len(train)} train files, {len(heldout)} held out, {len(skipped)} skipped (not UTF-8); "
              f"wrote {MANIFEST.relative_to(ROOT)} and {PROMPTS.relative_to(ROOT)}")
    if args.out is not None:
        print(json.dumps(pretokenize(args.out, args.root, args.tokenizer), indent=1))


if __name__ == "__main__":
    main()
