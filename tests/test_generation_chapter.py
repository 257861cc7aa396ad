"""walkthrough/12_generation.py, the round-by-round chapter: on a checkpoint with a tokenizer it shows
every token as its text (trees, cache slots, tabs, report), and long texts stay legible.

The checkpoint here is a stand-in (random tiny weights, the committed tokenizer, a random block
drafter), so the tests run before and without the trained weights."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "walkthrough"))
import chapter  # noqa: E402  (walkthrough/chapter.py)
import matplotlib.pyplot as plt  # noqa: E402  (chapter chose the Agg backend)

from ddtree.config import preset  # noqa: E402
from ddtree.text import TRAINED, load_tokenizer, tokens_as_text  # noqa: E402
from tests.helpers import save_text_checkpoint  # noqa: E402

pytest.importorskip("tokenizers")


def load_chapter():
    path = ROOT / "walkthrough" / "12_generation.py"
    spec = importlib.util.spec_from_file_location("generation_chapter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = load_chapter()


@pytest.fixture
def figures(tmp_path, monkeypatch):
    monkeypatch.setattr(chapter, "FIGURES", tmp_path / "figures")
    monkeypatch.setattr(chapter, "ROOT", tmp_path)
    return tmp_path / "figures"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A checkpoint directory shaped like checkpoints/tiny-code, with random weights."""
    return save_text_checkpoint(tmp_path_factory.mktemp("stand_in"), preset("tiny"), seed=1)


def words(ids):
    return tokens_as_text(load_tokenizer(TRAINED), ids)


def test_defaults_follow_the_model(stand_in):
    trained = gen.parse_settings(["--checkpoint", str(stand_in)])
    assert trained.model == "trained" and trained.drafters == ("block", "ngram") and trained.prompt_index == 0
    assert gen.parse_settings(["--model", "tiny"]).drafters == ("noisy", "ngram")


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--drafters", "block"], "--drafters: block is the trained model's drafter"),
    (["--checkpoint", "{empty}"], "--checkpoint: {empty} must hold config.json"),
    (["--checkpoint", "{stand_in}", "--prompt-index", "99"], "--prompt-index: must be in 0.."),
])
def test_bad_settings_are_refused_naming_the_setting(argv, message, stand_in, tmp_path, capsys):
    fill = dict(stand_in=stand_in, empty=tmp_path)
    with pytest.raises(SystemExit) as stop:
        gen.parse_settings([a.format(**fill) for a in argv])
    assert stop.value.code == 2
    assert message.format(**fill) in capsys.readouterr().err


def test_the_chapter_shows_tokens_as_text(stand_in, figures, capsys):
    settings = gen.parse_settings(["--checkpoint", str(stand_in), "--tokens", "4", "--budgets", "2"])
    with chapter.report(gen.STEM):
        gen.main(settings)
    report = (figures / f"{gen.STEM}_report.txt").read_text(encoding="utf-8")
    setup = gen.trained_setup(settings)
    shown = " ".join(f"'{w}'" for w in setup.words(setup.ar_tokens))
    assert "--8<-- [start:text]" in report and shown in " ".join(report.split())
    assert "  prompt | " in report and "  AR     | " in report
    tabs = (figures / f"{gen.STEM}_rounds.md").read_text(encoding="utf-8")
    root = int(setup.prompt[-1])
    assert f"root {root} '{setup.words([root])[0]}' at position {setup.prompt.size - 1}" in tabs
    for name in ("block", "ngram"):
        assert f"<!-- --8<-- [start:{name}] -->" in tabs
        assert (figures / f"{gen.STEM}_{name}_round_0.png").is_file()


def test_report_lines_keep_a_token_whole_and_fit_the_report():
    line = "  bonus 7 '(' (the target's own token after #7); commits 8 tokens: " + \
        " ".join(f"{100 + i} '⏎·······{i}'" for i in range(8))
    lines = gen.report_lines(line.strip())
    assert all(len(part) <= chapter.REPORT_WIDTH for part in lines) and len(lines) > 1
    assert " ".join(" ".join(lines).split()) == " ".join(line.split())
    assert all(part.rstrip().endswith("'") or part.rstrip().endswith(":") for part in lines[:-1])


def longest_texts(count: int) -> list[int]:
    texts = words(list(range(512)))
    return sorted(range(512), key=lambda i: (-len(texts[i]), i))[:count]


def test_the_longest_token_texts_stay_apart_in_deep_trees():
    """An oracle's trees run block_size - 1 deep: with the vocabulary's longest texts in every box,
    no two boxes overlap (round_figure raises if they do) and every cache slot keeps its text."""
    settings = gen.parse_settings(["--model", "tiny", "--drafters", "oracle", "--tokens", "8"])
    setup = gen.preset_setup(settings)
    rounds, _ = gen.record_generation(setup, "oracle", settings)
    long = longest_texts(40)
    for index, r in enumerate(rounds[:2]):
        tokens = np.array([long[(7 * k + index) % len(long)] for k in range(r.tree.tokens.size)])
        fake = dataclasses.replace(r, tree=dataclasses.replace(r.tree, tokens=tokens))
        assert int(np.max(fake.tree.depths)) >= 2
        fig, kept = gen.round_figure(fake, "oracle", index, words)
        plt.close(fig)
        assert kept, "a cache slot's text does not fit its slot"


def test_overlapping_boxes_finds_texts_wider_than_their_column(monkeypatch):
    """A chain of long texts, one per depth: apart when cut to LABEL_CHARS, overlapping when the
    cut is lifted (the measure that round_figure raises on)."""
    import treeplot

    def long_words(ids):
        return ["abcdefghijklmnop"] * len(ids)

    chain = dataclasses.make_dataclass("Chain", ["tokens", "parents", "depths"])(
        np.arange(8), np.arange(-1, 7), np.arange(8))
    found = {}
    for limit in (treeplot.LABEL_CHARS, 16):
        monkeypatch.setattr(treeplot, "LABEL_CHARS", limit)
        fig, ax = plt.subplots(figsize=(8, 2), dpi=chapter.DPI)
        treeplot.draw_tree(ax, chain, fontsize=9, words=long_words)
        fig.tight_layout()
        fig.canvas.draw()
        found[limit] = gen.overlapping_boxes(fig, ax)
        plt.close(fig)
    assert found[8] == [] and len(found[16]) == 7          # every pair of neighbours
