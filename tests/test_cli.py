import re
import subprocess
import sys
import types

import numpy as np
import pytest

from ddtree import cli, golden
from ddtree.cli import main
from ddtree.config import preset
from ddtree.decode import RoundTrace, budget_limit, describe_round, generate_ar, generate_ddtree
from ddtree.drafters import make_drafter
from ddtree.model import Transformer
from ddtree.text import decode, encode, heldout_prompts, load_tokenizer
from ddtree.tree import check_budget
from ddtree.weights import init_weights, load_pretrained, save_pretrained
from tests.helpers import save_text_checkpoint


def test_demo_reproduces_the_seeds_picture(capsys):
    assert main(["demo", "--preset", "tiny"]) == 0
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


# ----------------------------------------------------------------------------------------------
# a round as text: the words demo --rounds and the round-by-round page share

def hand_made_round(accepted, bonus):
    """Root 7 at position 5; #1, #2 its children (ranks 0, 1); #3, #4 children of #1; #5 of #3."""
    return RoundTrace(start=5, tokens=np.array([7, 11, 12, 13, 14, 15]),
                      parents=np.array([-1, 0, 0, 1, 1, 3]), depths=np.array([0, 1, 1, 2, 2, 3]),
                      accepted=np.array(accepted), bonus=bonus,
                      committed=len(accepted))


def test_a_round_reads_as_an_indented_tree_with_its_path_and_bonus():
    assert describe_round(hand_made_round([0, 1, 4], 9), 2) == [
        "round 2: root 7 at position 5, 5 drafted nodes, depth 3 (* accepted, + bonus)",
        "  * 7  root",
        "    * 11  #1 rank 0",
        "        13  #3 rank 0",
        "          15  #5 rank 0",
        "      * 14  #4 rank 1",
        "        + 9  bonus",
        "      12  #2 rank 1",
        "  accepted nodes #1 #4 (off the drafter's top-1 chain from depth 2)",
        "  bonus 9 (the target's own token after #4); commits 3 tokens: 11 14 9",
    ]
    assert describe_round(hand_made_round([0, 1, 3, 5], 2), 0)[-2:] == [
        "  accepted nodes #1 #3 #5 (the drafter's top-1 chain)",
        "  bonus 2 (the target's own token after #5); commits 4 tokens: 11 13 15 2",
    ]


def test_a_round_that_accepts_nothing_says_so():
    lines = describe_round(hand_made_round([0], 9), 0)
    assert lines[1:3] == ["  * 7  root", "    + 9  bonus"]
    assert lines[-2:] == ["  nothing accepted (the path is the root alone)",
                          "  bonus 9 (the target's own token after the root); commits 1 token: 9"]


def test_demo_rounds_prints_every_rounds_tree(capsys):
    """A noisy generation on the random tiny: each round's text, as describe_round writes the
    decoder's trace."""
    assert main(["demo", "--preset", "tiny", "--drafter", "noisy", "--tokens", "12", "--budget", "16",
                 "--rounds"]) == 0
    out = capsys.readouterr().out
    model = Transformer(preset("tiny"), init_weights(preset("tiny"), golden.WEIGHT_SEED))
    prompt = golden.default_prompt("tiny")
    drafter = make_drafter("noisy", model, prompt, 12)
    _, trace = generate_ddtree(model, prompt, 12, drafter, block_size=8, budget=16)
    expected = [("  " + line) for i, r in enumerate(trace.rounds) for line in describe_round(r, i)]
    lines = out.splitlines()
    first = lines.index(expected[0])
    assert lines[first:first + len(expected)] == expected
    assert "    nothing accepted (the path is the root alone)" in lines        # the noisy oracle misses


# ----------------------------------------------------------------------------------------------
# --help, degenerate settings, refusals

def help_text(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_and_whole_sentences(capsys):
    out = help_text(["--help"], capsys)
    assert "`" not in out
    assert " ".join(cli.DESCRIPTION.split()) in " ".join(out.split())
    assert cli.DESCRIPTION.endswith(".")


def test_demo_help_gives_every_option_a_default(capsys):
    out = " ".join(help_text(["demo", "--help"], capsys).split())
    for action in cli.build_parser()._subparsers._group_actions[0].choices["demo"]._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings
    assert "(default: none, the trained model)" in out and "(default: 32)" in out
    assert "as the trained model does, else oracle)" in out
    assert "small is refused" in out and "numba engine on a GPU" in out


@pytest.mark.parametrize("flags, why", [(["--budget", "0"], "--budget 0 drafts no node"),
                                        (["--block-size", "1"], "--block-size 1 drafts no depth")])
def test_a_degenerate_setting_says_so_and_runs(flags, why, capsys):
    assert main(["demo", "--tokens", "3", *flags]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and why in notes[0] and "plain AR steps" in notes[0]
    assert "tokens per verify forward: 1.00" in out and "DDTree == AR: yes" in out


def test_the_budget_rule_is_check_budget(capsys):
    assert main(["demo", "--budget", "-3"]) == 2
    with pytest.raises(ValueError) as error:
        check_budget(-3, *budget_limit(Transformer(preset("tiny"), init_weights(preset("tiny")))))
    assert capsys.readouterr().err == f"error: --budget: {error.value}\n"


@pytest.mark.parametrize("name, why", [("small", "the numba engine on a GPU runs it"),
                                       ("kimi-k2.6", "shapes only")])
def test_a_preset_too_big_for_the_demo_is_refused_with_the_reason(name, why, capsys):
    assert main(["demo", "--preset", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --preset: {name}'s random weights take ") and "GiB of float32" in err
    assert why in err and "The demo takes tiny, tiny-b, micro" in err


def test_the_simulator_note_comes_before_a_slow_run(monkeypatch, capsys):
    numpy = cli.load_backend("numpy")
    assert cli.simulator_note(numpy, preset("tiny")) is None
    simulated = types.SimpleNamespace(**vars(numpy) | {"simulator": True})
    assert cli.simulator_note(simulated, preset("micro")) is None                     # micro is quick
    monkeypatch.setattr(cli, "load_backend", lambda name: simulated)
    assert main(["demo", "--tokens", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "expected to take minutes; use --preset micro --tokens 4 to try it" in err[0]


# ----------------------------------------------------------------------------------------------
# --checkpoint DIR and --prompt IDS

@pytest.fixture
def checkpoint(tmp_path):
    config = preset("micro")
    return save_pretrained(tmp_path / "micro", config, init_weights(config, seed=3))


def test_demo_runs_on_a_saved_checkpoint(checkpoint, capsys):
    assert main(["demo", "--checkpoint", str(checkpoint), "--prompt", "5, 17 42,8", "--tokens", "10",
                 "--drafter", "noisy"]) == 0
    out = capsys.readouterr().out
    assert f"(checkpoint {checkpoint}, backend numpy)" in out
    assert "prompt(4): 5 17 42 8" in out
    model = Transformer(*load_pretrained(checkpoint))
    ar = " ".join(str(t) for t in generate_ar(model, [5, 17, 42, 8], 10))
    assert f"AR     (10 target forwards): {ar}" in out
    assert "drafter noisy, block 8, budget 32): " + ar in out
    assert out.rstrip().endswith("DDTree == AR: yes")


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "{dir}/missing", "--prompt", "1"], "--checkpoint: {dir}/missing: no such directory"),
    (["--checkpoint", "{dir}", "--prompt", "1"], "--checkpoint: {dir}/config.json: no such file"),
    (["--checkpoint", "{dir}/micro", "--prompt", "1,96"],
     "--prompt: prompt tokens must lie in [0, vocab_size=96)"),
    (["--checkpoint", "{dir}/micro"],
     "--prompt: a checkpoint without a tokenizer.json has no default prompt"),
    (["--checkpoint", "{dir}/micro", "--prompt", "5;17"], "--prompt: the prompt must be token ids separated"),
])
def test_bad_checkpoint_inputs_are_refused_in_one_line(checkpoint, flags, message, capsys):
    directory = str(checkpoint.parent)
    assert main(["demo", *(f.format(dir=directory) for f in flags)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: " + message.format(dir=directory))


def test_the_generation_chapters_help_lists_its_settings_and_runs_nothing(tmp_path):
    """The round-by-round chapter's settings are arguments; --help prints them and writes nothing."""
    root = golden.GOLDEN_DIR.parent.parent
    (script,) = root.glob("walkthrough/*_generation.py")
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env={"MPLBACKEND": "Agg", "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    for setting in ("--model", "--checkpoint", "--prompt-index", "--drafters", "--tokens", "--block-size",
                    "--budget", "--budgets", "--seed"):
        assert setting in out
    assert "(default: 16)" in out and "(default: 12)" in out and "wrote" not in result.stdout + result.stderr


# --budget auto, --cost-table

def test_demo_budget_auto_reads_its_cost_table_and_stays_ar(tmp_path, capsys):
    from ddtree.budget import CostTable, save_cost_table

    path = tmp_path / "costs.json"
    save_cost_table(CostTable(1.0, tuple(1.0 + 0.25 * b for b in range(1, 16))), path)
    assert main(["demo", "--preset", "micro", "--drafter", "noisy", "--tokens", "12", "--budget", "auto",
                 "--cost-table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "budget auto): " in out and "auto budget, round by round: 7 7 " in out
    assert out.rstrip().endswith("DDTree == AR: yes")


@pytest.mark.parametrize("flags, message", [
    (["--budget", "auto"], "error: --cost-table: --budget auto needs --cost-table FILE"),
    (["--cost-table", "costs.json"], "error: --cost-table: used only with --budget auto, got --budget 32"),
    (["--budget", "auto", "--cost-table", "missing.json"],
     "error: --cost-table: cost table file missing.json"),
    (["--budget", "auto", "--cost-table", "bad.json"],
     "error: --cost-table: cost table file bad.json: CostTable.verify must hold finite seconds > 0"),
])
def test_budget_auto_errors_name_the_flag(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text('{"ar_step": 1.0, "verify": [1.0, 0]}')
    assert main(["demo", "--preset", "micro", "--tokens", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_budget_takes_an_integer_or_auto(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--budget", "big"])
    assert "argument --budget: must be an integer or auto, got 'big'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# a checkpoint with a tokenizer: text in, text out; a trained (here: random) block drafter

@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """Random tiny weights (vocab 512, the tokenizer's) beside the committed tokenizer, and a random
    block drafter in its drafter/ folder."""
    return save_text_checkpoint(tmp_path_factory.mktemp("text") / "model", preset("tiny"), seed=5,
                                drafter_layers=1, window=6, max_depths=7)


def test_demo_speaks_text_with_a_tokenizer(text_checkpoint, capsys):
    prompt = "def add(a, b):\n    return"
    assert main(["demo", "--checkpoint", str(text_checkpoint), "--prompt", prompt, "--tokens", "6",
                 "--drafter", "block", "--ids"]) == 0
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(text_checkpoint)
    ids = encode(tokenizer, prompt)
    model = Transformer(*load_pretrained(text_checkpoint))
    ar = generate_ar(model, ids, 6)
    shown = "\n".join("    " + line for line in decode(tokenizer, ar).split("\n"))
    listed = " ".join(map(str, ids))
    assert f"prompt ({ids.size} tokens, --prompt): {listed}\n    def add(a, b):\n        return" in out
    assert f"AR     (6 target forwards): {' '.join(map(str, ar))}\n{shown}\n" in out
    assert "drafter block, block 8, budget 32): " in out
    assert out.rstrip().endswith("DDTree == AR: yes")


def test_demo_with_a_tokenizer_defaults_to_the_first_held_out_prompt(text_checkpoint, capsys):
    assert main(["demo", "--checkpoint", str(text_checkpoint), "--tokens", "2", "--drafter", "ngram",
                 "--rounds"]) == 0
    out = capsys.readouterr().out
    first = heldout_prompts()[0]
    size = encode(load_tokenizer(text_checkpoint), first["text"]).size
    line = first["text"].splitlines()[0]
    assert f"prompt ({size} tokens, held-out file {first['file']}):\n    {line}" in out
    assert re.search(r"round 0: root \d+ '[^']*' at position", out)       # each token with its text


@pytest.mark.parametrize("flags, message", [
    (["--drafter", "oracle", "--drafter-dir", "x"], "--drafter-dir: read by --drafter block only"),
    (["--prompt", ""], "--prompt: the prompt must hold at least one token"),
])
def test_text_checkpoint_flags_are_checked(text_checkpoint, flags, message, capsys):
    assert main(["demo", "--checkpoint", str(text_checkpoint), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: " + message)


def test_the_block_drafter_needs_a_directory(checkpoint, capsys):
    assert main(["demo", "--checkpoint", str(checkpoint), "--prompt", "5", "--drafter", "block"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --drafter-dir: --drafter block needs a drafter directory")
