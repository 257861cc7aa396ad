"""walkthrough/chapter.py's save_figure keeps every text of a figure at least 10 px high on the page,
and writes that promise into the PNG for tools/check_site.py to hold the page to."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "walkthrough"))
sys.path.insert(0, str(ROOT / "tools"))
import chapter  # noqa: E402  (walkthrough/chapter.py)
import check_site  # noqa: E402  (tools/check_site.py)

plt = chapter.plt


@pytest.fixture
def figures(tmp_path, monkeypatch):
    monkeypatch.setattr(chapter, "FIGURES", tmp_path)
    monkeypatch.setattr(chapter, "ROOT", tmp_path)
    return tmp_path


def test_text_px_is_the_drawn_size_shrunk_with_the_figure():
    assert chapter.text_px(72, 500) == pytest.approx(chapter.DPI)          # 1 inch at DPI px per inch
    narrow = chapter.COLUMN_PX // 2                                         # shown at its own width
    assert chapter.text_px(9, narrow) == pytest.approx(9 * chapter.DPI / 72)
    wide = 2 * chapter.COLUMN_PX                                            # shown at half its width
    assert chapter.text_px(9, wide) == pytest.approx(9 * chapter.DPI / 72 / 2)


def figure(width_inches: float, fontsize: float, **text_options):
    fig, ax = plt.subplots(figsize=(width_inches, 2))
    ax.tick_params(labelsize=12)
    ax.text(0.5, 0.5, "the label", fontsize=fontsize, **text_options)
    return fig


def points_for_10px(width_inches: float) -> float:
    """The font size a figure of this width needs for 10 px text (the rule save_figure applies)."""
    width = width_inches * chapter.DPI
    return chapter.MIN_TEXT_PX * 72 / chapter.DPI / min(1.0, chapter.COLUMN_PX / width)


@pytest.mark.parametrize("width_inches", [5.0, 8.0, 10.0])
def test_save_figure_refuses_text_below_10px_and_writes_nothing(figures, width_inches):
    needed = points_for_10px(width_inches)
    with pytest.raises(ValueError, match=rf"less than 10 px high.*'the label'.*at least {needed:.1f} pt"):
        chapter.save_figure(figure(width_inches, needed - 0.3), "t", "small")
    assert not (figures / "t_small.png").exists()
    assert chapter.save_figure(figure(width_inches, needed + 0.1), "t", "readable").exists()


def test_a_wider_figure_needs_larger_fonts():
    assert points_for_10px(5) < points_for_10px(8) < points_for_10px(10)
    assert points_for_10px(10) == pytest.approx(10 * 72 * 10 / chapter.COLUMN_PX)  # = width * 72 / column


def test_texts_that_are_not_drawn_are_not_checked(figures):
    fig = figure(8, 12)
    ax = fig.axes[0]
    ax.text(0.1, 0.1, "hidden", fontsize=3, visible=False)
    ax.text(0.1, 0.2, "  ", fontsize=3)                                  # nothing to read
    ax.set_xticks([0.5, 5.0], ["in view", "outside"])
    ax.set_xlim(0, 1)                                                    # after set_xticks, which widens it
    ax.get_xticklabels()[1].set_fontsize(3)                              # the tick beyond the limit
    assert chapter.save_figure(fig, "t", "hidden").exists()
    fig = figure(8, 12)
    fig.axes[0].set_ylabel("tiny", fontsize=3)
    with pytest.raises(ValueError, match="'tiny'"):
        chapter.save_figure(fig, "t", "label")


def test_the_png_carries_the_narrowest_width_its_smallest_text_allows(figures):
    path = chapter.save_figure(figure(8, 12), "t", "record")          # tick labels 12 pt too
    width = plt.imread(path).shape[1]
    needed = int(check_site.png_text(path)[check_site.MIN_WIDTH_KEY])
    smallest_px = 12 * chapter.DPI / 72                                  # as drawn in the PNG
    assert needed * smallest_px / width >= chapter.MIN_TEXT_PX            # 10 px at that width
    assert (needed - 1) * smallest_px / width < chapter.MIN_TEXT_PX      # and no narrower
    assert needed <= min(width, chapter.COLUMN_PX)                        # the column shows it
    assert check_site.MIN_WIDTH_KEY == chapter.MIN_WIDTH_KEY


def test_a_figure_without_text_may_be_shown_at_any_width(figures):
    fig, ax = plt.subplots(figsize=(4, 2))
    ax.set_axis_off()
    path = chapter.save_figure(fig, "t", "blank")
    assert check_site.png_text(path) == {check_site.MIN_WIDTH_KEY: "0"}
