"""tools/check_site.py, the CI's browser check: its verdicts on protocol events, and (where Debian's
chromium is installed) its self-test, a page with one of each defect that must trip every check."""

import shutil
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import check_site  # noqa: E402

URL = "http://127.0.0.1:8000/03_mla/"


def response(url, status, kind="Document"):
    params = {"type": kind, "response": {"url": url, "status": status}}
    return {"method": "Network.responseReceived", "params": params}


def test_a_clean_load_has_no_problems():
    assert check_site.event_problems([response(URL, 200), response(URL + "fig.png", 200, "Image")], URL) == []


def test_page_status_missing_files_and_console_errors_are_problems():
    events = [
        response(URL, 404),
        response(URL + "fig.png", 404, "Image"),
        {"method": "Runtime.consoleAPICalled", "params": {"type": "error", "args": [{"value": "boom"}]}},
        {"method": "Runtime.consoleAPICalled", "params": {"type": "log", "args": [{"value": "fine"}]}},
        {"method": "Runtime.exceptionThrown", "params": {"exceptionDetails": {"text": "Uncaught TypeError"}}},
        {"method": "Log.entryAdded", "params": {"entry": {"level": "error", "text": "net::ERR_FAILED"}}},
        {"method": "Log.entryAdded", "params": {"entry": {"level": "warning", "text": "deprecated"}}},
    ]
    assert check_site.event_problems(events, URL) == [
        "page answered HTTP 404",
        f"HTTP 404 for {URL}fig.png",
        "console error: boom",
        "uncaught exception: Uncaught TypeError",
        "console error: net::ERR_FAILED",
    ]


def test_a_page_that_never_answered_is_a_problem():
    assert check_site.event_problems([], URL) == ["page did not load (no HTTP response)"]


def test_late_events_need_no_document():
    late = [{"method": "Runtime.exceptionThrown", "params": {"exceptionDetails": {"text": "late"}}}]
    assert check_site.event_problems(late, URL, document=False) == ["uncaught exception: late"]


def test_write_png_is_a_valid_image(tmp_path):
    from PIL import Image  # matplotlib's dependency

    check_site.write_png(tmp_path / "grey.png", 7, 3)
    with Image.open(tmp_path / "grey.png") as image:
        assert image.size == (7, 3)
        assert image.getpixel((6, 2)) == 0x80


def test_png_text_reads_the_figure_record(tmp_path):
    check_site.write_png(tmp_path / "fig.png", 7, 3, {check_site.MIN_WIDTH_KEY: "640", "other": "x"})
    assert check_site.png_text(tmp_path / "fig.png") == {check_site.MIN_WIDTH_KEY: "640", "other": "x"}
    check_site.write_png(tmp_path / "plain.png", 7, 3)
    assert check_site.png_text(tmp_path / "plain.png") == {}
    (tmp_path / "page.html").write_text("<p>not a PNG</p>")
    assert check_site.png_text(tmp_path / "page.html") == {}


@pytest.mark.skipif(shutil.which("/usr/bin/chromium") is None, reason="Debian's chromium is not installed")
def test_self_test_catches_every_kind_of_defect(capsys):
    assert check_site.self_test("/usr/bin/chromium") == 0
    assert "self-test: all" in capsys.readouterr().out
