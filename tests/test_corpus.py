"""The corpus (train.corpus) and its baselines (train.baselines): the split rule, the held-out
manifest and prompts, pre-tokenizing and the baselines' arithmetic, on small trees written here;
the committed manifest is checked against this machine's standard library where it is the same
Python version."""

from __future__ import annotations

import hashlib
import json
import lzma
import math

import numpy as np
import pytest

from ddtree.drafters import END_OF_TEXT
from ddtree.text import decode, heldout_prompts, load_tokenizer
from train import baselines, corpus


def paths_in(split: bool, count: int, prefix: str = "pkg/mod") -> list[str]:
    """The first ``count`` names ``{prefix}{i}.py`` whose is_heldout is ``split``."""
    names = (f"{prefix}{i}.py" for i in range(10_000))
    found = [name for name in names if corpus.is_heldout(name) == split]
    return found[:count]


CODE = '"""A module."""\n\nimport os\n' + "".join(f"value_{i} = os.sep * {i}\n" for i in range(20))


@pytest.fixture
def tree(tmp_path):
    """A small stdlib-like tree: 3 train and 2 held-out files, one undecodable, one in site-packages."""
    root = tmp_path / "lib"
    for name in paths_in(False, 3) + paths_in(True, 2):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(CODE + f"# {name} ü\n", encoding="utf-8")
    (root / "latin.py").write_bytes(b"x = '\xe9'\n")
    (root / "site-packages" / "other").mkdir(parents=True)
    (root / "site-packages" / "other" / "thing.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not python\n")
    return root


# --------------------------------------------------------------------------------------------
# the split rule

def test_the_split_is_the_first_byte_of_the_paths_sha256():
    for name in ["ast.py", "json/decoder.py", "test/test_ast.py", "a/b/c.py"]:
        assert corpus.is_heldout(name) == (hashlib.sha256(name.encode()).digest()[0] % 10 == 0)
    assert corpus.is_heldout("ast.py") and not corpus.is_heldout("json/decoder.py")


def test_the_stated_fraction_is_that_of_the_rule():
    assert corpus.HELDOUT_FRACTION == sum(byte % corpus.HELDOUT_MODULUS == 0 for byte in range(256)) / 256
    names = [f"dir{i % 37}/module_{i}.py" for i in range(20_000)]
    fraction = np.mean([corpus.is_heldout(name) for name in names])
    sigma = math.sqrt(corpus.HELDOUT_FRACTION * (1 - corpus.HELDOUT_FRACTION) / len(names))
    assert abs(fraction - corpus.HELDOUT_FRACTION) < 4 * sigma


def test_source_files_are_sorted_posix_paths_outside_site_packages(tree):
    files = corpus.source_files(tree)
    assert files == sorted(paths_in(False, 3) + paths_in(True, 2) + ["latin.py"])
    train, heldout, skipped = corpus.split(tree)
    assert (train, heldout, skipped) == (paths_in(False, 3), paths_in(True, 2), ["latin.py"])
    with pytest.raises(FileNotFoundError, match="root must be a directory"):
        corpus.source_files(tree / "absent")


# --------------------------------------------------------------------------------------------
# the manifest

def test_a_manifest_round_trips_and_finds_changed_missing_and_unlisted_files(tree, tmp_path):
    manifest = tmp_path / "heldout.tsv"
    heldout = corpus.split(tree)[1]
    corpus.write_manifest(manifest, tree, heldout, "3.99.1")
    python, rows = corpus.read_manifest(manifest)
    assert python == "3.99.1"
    assert rows == [(name, hashlib.sha256((tree / name).read_bytes()).hexdigest(),
                     (tree / name).stat().st_size) for name in heldout]
    assert corpus.check_heldout(tree, manifest) == []
    assert corpus.require_heldout(tree, manifest) == heldout

    (tree / heldout[0]).write_text("changed\n")
    (tree / heldout[1]).unlink()
    extra = paths_in(True, 1, prefix="extra/m")[0]
    (tree / extra).parent.mkdir()
    (tree / extra).write_text("x = 2\n")
    problems = corpus.check_heldout(tree, manifest)
    assert [line.split(":")[0] for line in problems] == ["changed", "missing", "not in the manifest"]
    with pytest.raises(RuntimeError, match="differ from .* in 3 places"):
        corpus.require_heldout(tree, manifest)


@pytest.mark.parametrize("text, complaint", [
    ("path\tsha256\tbytes\n", "must start with"),
    ("# held-out files of the CPython 3.11.7 x\npath\tbytes\n", "second line"),
    ("# held-out files of the CPython 3.11.7 x\npath\tsha256\tbytes\na.py\tabc\t12\n", "line 3"),
])
def test_a_malformed_manifest_is_refused(tmp_path, text, complaint):
    (tmp_path / "m.tsv").write_text(text)
    with pytest.raises(ValueError, match=complaint):
        corpus.read_manifest(tmp_path / "m.tsv")


def test_the_committed_manifest_matches_this_machines_standard_library():
    python, rows = corpus.read_manifest()
    if python != corpus.python_version():
        pytest.skip(f"the manifest is of Python {python}'s standard library, "
                    f"this is Python {corpus.python_version()}")
    assert len(rows) > 100 and [row[0] for row in rows] == sorted(row[0] for row in rows)
    assert all(corpus.is_heldout(row[0]) for row in rows)
    assert corpus.check_heldout(corpus.stdlib_root()) == []


# --------------------------------------------------------------------------------------------
# the prompts

def test_a_prompt_starts_after_the_docstring_and_ends_at_a_line_break():
    start, prompt = corpus.prompt_of(CODE)
    assert CODE[start:].startswith("import os\n") and CODE[start:start + len(prompt)] == prompt
    assert prompt.endswith("\n") and corpus.PROMPT_CHARS[0] <= len(prompt) <= corpus.PROMPT_CHARS[1]
    assert CODE[start + len(prompt):].startswith("value_")             # whole lines only
    assert corpus.prompt_of("import os\n") is None                     # too short
    assert corpus.prompt_of("def (:\n" * 60) is None                   # does not parse
    assert corpus.prompt_start("# comment\n\nx = 1\n") == 0


def test_prompts_are_chosen_evenly_in_manifest_order(tree):
    heldout = paths_in(True, 5, prefix="held/m")
    for name in heldout:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(CODE)
    chosen = corpus.choose_prompts(tree, heldout, count=3)
    assert [prompt["file"] for prompt in chosen] == [heldout[0], heldout[2], heldout[4]]
    with pytest.raises(ValueError, match="count must be at most the 5"):
        corpus.choose_prompts(tree, heldout, count=6)


def test_the_committed_prompts_are_slices_of_held_out_files():
    prompts = heldout_prompts()
    _, rows = corpus.read_manifest()
    digests = {row[0]: row[1] for row in rows}
    assert len(prompts) == corpus.PROMPT_COUNT
    assert len({prompt["file"] for prompt in prompts}) == len(prompts)
    for prompt in prompts:
        assert prompt["file"] in digests
        assert prompt["text"].endswith("\n")
        assert corpus.PROMPT_CHARS[0] <= len(prompt["text"]) <= corpus.PROMPT_CHARS[1]
    path = corpus.stdlib_root() / prompts[0]["file"]
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digests[prompts[0]["file"]]:
        pytest.skip(f"this machine's {prompts[0]['file']} is not the manifest's")
    for prompt in prompts:
        text = corpus.read_text(corpus.stdlib_root() / prompt["file"])
        assert corpus.prompt_of(text) == (prompt["start"], prompt["text"])


# --------------------------------------------------------------------------------------------
# pre-tokenizing and the baselines

def test_pretokenize_writes_the_contracts_arrays_and_counts(tree, tmp_path):
    manifest = tmp_path / "heldout.tsv"
    train, heldout, _ = corpus.split(tree)
    corpus.write_manifest(manifest, tree, heldout, "3.99.1")
    summary = corpus.pretokenize(tmp_path / "out", tree, manifest=manifest)
    assert json.loads((tmp_path / "out" / "corpus.json").read_text()) == summary
    tokenizer = load_tokenizer(corpus.TOKENIZER_DIR)
    for name, paths in (("train", train), ("heldout", heldout)):
        tokens = np.load(tmp_path / "out" / f"{name}.npy")
        texts = [(tree / path).read_text(encoding="utf-8") for path in paths]
        assert tokens.dtype == np.uint16 and tokens[0] == END_OF_TEXT
        assert np.sum(tokens == END_OF_TEXT) == len(paths)
        assert decode(tokenizer, tokens) == "".join("<|endoftext|>" + text for text in texts)
        assert summary[name] == {"files": len(paths), "tokens": tokens.size,
                                 "bytes": sum(len(text.encode("utf-8")) for text in texts)}
    assert summary["tokenizer_sha256"] == hashlib.sha256(
        (corpus.TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()


def test_the_unigram_bits_are_the_add_one_closed_form():
    # counts (1, 2, 1, 0) over 4 tokens: p = (2, 3, 2, 1) / 8; the first held-out token is only read
    train = np.array([0, 1, 1, 2], np.uint16)
    heldout = np.array([0, 3, 1], np.uint16)
    assert baselines.unigram_bits(train, heldout, 4) == pytest.approx(-math.log2(1 / 8) - math.log2(3 / 8))
    with pytest.raises(ValueError, match="heldout_tokens must lie in"):
        baselines.unigram_bits(train, heldout, 3)


def test_xz_concatenated_learns_across_files_and_per_file_does_not():
    document = bytes(range(256)) * 4
    one = baselines.xz_bits([document], per_file=False)
    assert one == baselines.xz_bits([document], per_file=True) == 8 * len(
        lzma.compress(document, preset=9 | lzma.PRESET_EXTREME))
    assert baselines.xz_bits([document] * 3, per_file=True) == 3 * one
    assert baselines.xz_bits([document] * 3, per_file=False) < 2 * one


def test_baselines_divide_by_the_held_out_bytes(tree, tmp_path):
    manifest = tmp_path / "heldout.tsv"
    corpus.write_manifest(manifest, tree, corpus.split(tree)[1], "3.99.1")
    corpus.pretokenize(tmp_path / "out", tree, manifest=manifest)
    result = baselines.baselines(tmp_path / "out", tree, 512, manifest=manifest)
    documents = [(tree / name).read_bytes() for name in corpus.split(tree)[1]]
    size = sum(map(len, documents))
    assert result["heldout_bytes"] == size
    assert result["bits_per_byte"]["xz -9e, per file"] == baselines.xz_bits(documents, True) / size
    train, heldout = (np.load(tmp_path / "out" / f"{name}.npy") for name in ("train", "heldout"))
    assert result["bits_per_byte"]["unigram"] == baselines.unigram_bits(train, heldout, 512) / size
    assert baselines.table(result).splitlines()[2].startswith("| unigram | ")
