import subprocess
import sys

from ddtree import golden
from ddtree.cli import main


def test_demo_reproduces_the_seeds_picture(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    expected = " ".join(str(t) for t in golden.load_bundle("tiny")["tokens"])
    assert f"AR     (24 target forwards): {expected}" in out
    assert "DDTree (3 verify forwards + 1 prefill; drafter oracle, block 8, budget 32): " + expected in out
    assert "tokens per verify forward: 8.00" in out
    assert out.rstrip().endswith("DDTree == AR: yes")


def test_demo_shows_partial_acceptance_round_by_round(capsys):
    assert main(["demo", "--preset", "tiny-b", "--drafter", "noisy", "--rounds", "--budget", "16"]) == 0
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("  round ")]
    assert len(rounds) > 3                                  # fewer than 8 tokens per forward
    assert "DDTree == AR: yes" in out


def test_bad_values_are_reported_not_raised(capsys):
    assert main(["demo", "--block-size", "0"]) == 2
    assert "block_size must be an integer >= 1" in capsys.readouterr().err


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "ddtree", "demo", "--tokens", "4", "--drafter", "ngram"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "DDTree == AR: yes" in result.stdout


def test_readme_shows_what_the_demo_prints(capsys):
    """The README (and the site's home page, which includes it) quotes the demo verbatim."""
    readme = (golden.GOLDEN_DIR.parent.parent / "README.md").read_text()
    block = readme.split("[start:demo_output] -->\n```text\n")[1].split("```\n")[0]
    assert main(["demo"]) == 0
    assert capsys.readouterr().out == block
