"""``python -m kernels.bench trained``: the trained model and its block drafter on the engine.

In the simulator: ``--smoke`` on a stand-in checkpoint (micro's dims with the trained model's
512-token vocabulary, random weights, the committed tokenizer, a random block drafter) runs every
code path and checks the engine's tokens against the numpy reference's; the record's formatter on
a hand-made result (every field, the verdict both ways); the refusals. On a GPU (``gpu``): the real
checkpoint, for a few tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import types

import numpy as np
import pytest

from ddtree import decode as reference_decode
from ddtree import golden
from ddtree.config import preset
from ddtree.drafters import BlockDrafter, save_block_drafter
from ddtree.model import Transformer as ReferenceTransformer
from ddtree.text import TRAINED, encode, heldout_prompts, load_tokenizer
from ddtree.weights import init_weights, load_pretrained
from kernels import device
from kernels.bench import trained
from kernels.bench.cli import main as cli_main
from tests.helpers import save_text_checkpoint

STAND_IN = dataclasses.replace(preset("micro"), vocab_size=512)


def save_stand_in(directory):
    """A checkpoint laid out as checkpoints/tiny-code/ (random weights, the committed tokenizer)
    with a random block drafter in drafter/: a short window keeps its forward small."""
    return save_text_checkpoint(directory, STAND_IN, golden.WEIGHT_SEED, window=4, max_depths=7,
                                drafter_seed=7)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    return save_stand_in(tmp_path_factory.mktemp("tiny-code"))


def run_main(argv):
    """(exit code, stdout, the result ``measure`` returned) of ``trained.main(argv)``."""
    results = []
    measure = trained.measure

    def keeping(*args, **kwargs):
        results.append(measure(*args, **kwargs))
        return results[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(trained, "measure", keeping)
        code = trained.main(argv)
    return code, out.getvalue(), results[0]


@pytest.fixture(scope="module")
def smoke(stand_in):
    before = sorted(p.name for p in stand_in.rglob("*"))
    code, out, result = run_main(["--smoke", "--checkpoint", str(stand_in)])
    assert sorted(p.name for p in stand_in.rglob("*")) == before          # --smoke writes nothing
    return code, out, result


# ------------------------------------------------------------------------------------------------
# --smoke on the stand-in


def test_smoke_runs_every_configuration_and_prints_the_record(smoke):
    code, out, result = smoke
    assert code == 0
    [prompt] = result["prompts"]
    assert [(r["decoder"], r["drafter"], r["budget"]) for r in prompt["runs"]] == [
        ("AR", None, None), ("DDTree", "block", 4), ("DDTree", "block", "auto"), ("DDTree", "ngram", 4),
        ("DDTree", "ngram", "auto")]
    for run in prompt["runs"][1:]:
        chosen = run.get("budgets_chosen")
        assert (chosen is None) == (run["budget"] != "auto")
        assert chosen is None or (len(chosen) == run["verify_forwards"] and set(chosen) <= {0, 1})
    assert {name: len(table["verify"]) for name, table in result["cost_tables"].items()} == {"block": 1,
                                                                                             "ngram": 1}
    for run in prompt["runs"][1:]:
        assert 1 <= run["verify_forwards"] <= trained.SMOKE.tokens
        assert run["tokens_per_verify"] == trained.SMOKE.tokens / run["verify_forwards"]
    assert out.startswith("# The trained model on the engine")
    assert "python -m kernels.bench trained --smoke --checkpoint" in out
    assert trained.verdict(result) in out and trained.agreement(result) in out


def test_smoke_tokens_are_the_numpy_reference_greedy_tokens(smoke, stand_in):
    """The engine's AR tokens (which every DDTree run was checked against) are the numpy
    reference's, recomputed here from the same prompt: the first held-out prompt's last tokens."""
    _, _, result = smoke
    [prompt] = result["prompts"]
    ids = encode(load_tokenizer(stand_in), heldout_prompts()[0]["text"])[-trained.SMOKE.prompt_tokens:]
    config, weights = load_pretrained(stand_in)
    truth = reference_decode.generate_ar(ReferenceTransformer(config, weights), ids, trained.SMOKE.tokens)
    assert prompt["prompt_tokens"] == ids.size
    assert prompt["numpy"] == truth.tolist()
    assert prompt["engine"] == truth.tolist()
    assert prompt["engine_first_difference"] is None
    if result["transformers"]["ran"]:
        assert prompt["transformers"] == truth.tolist()
    else:
        assert "transformers" not in prompt and result["transformers"]["where"].startswith("not run")


# ------------------------------------------------------------------------------------------------
# every DDTree run is checked equal to AR, with each drafter on the device


class FakeModel:
    def __init__(self, on_device=True):
        self.on_device = on_device

    def drafts_on_device(self, drafter):
        return self.on_device


def fake_decoders(monkeypatch, ddtree_tokens):
    ar = np.array([5, 6, 7], np.int64)
    trace = types.SimpleNamespace(verify_forwards=2)
    monkeypatch.setattr(trained.engine_decode, "generate_ar", lambda model, prompt, tokens: ar.copy())
    monkeypatch.setattr(trained.engine_decode, "generate_ddtree",
                        lambda model, prompt, tokens, drafter, block_size, budget:
                        (ddtree_tokens.copy(), trace))


def test_a_ddtree_run_that_differs_from_ar_is_refused(monkeypatch):
    fake_decoders(monkeypatch, np.array([5, 9, 7], np.int64))
    settings = dataclasses.replace(trained.SMOKE, budgets=(4, 8))
    with pytest.raises(SystemExit, match=r"DDTree \(block drafter, budget 4\) differs from the engine's AR "
                                         r"at new token 1: the record is not written"):
        trained.engine_prompt(FakeModel(), {"block": object()}, np.array([1, 2]), settings)


def test_a_drafter_off_the_device_is_refused(monkeypatch):
    fake_decoders(monkeypatch, np.array([5, 6, 7], np.int64))
    with pytest.raises(SystemExit, match="the ngram drafter does not run on the device"):
        trained.engine_prompt(FakeModel(on_device=False), {"ngram": object()}, np.array([1, 2]),
                              trained.SMOKE)


def test_equal_runs_give_rates_ratios_and_tokens_per_verify(monkeypatch):
    fake_decoders(monkeypatch, np.array([5, 6, 7], np.int64))
    settings = dataclasses.replace(trained.SMOKE, budgets=(4, 8), repeats=3, warm_up=True)
    result = trained.engine_prompt(FakeModel(), {"block": object(), "ngram": object()}, np.array([1, 2]),
                                   settings)
    assert result["engine"] == [5, 6, 7] and result["prompt_tokens"] == 2
    assert [(r["drafter"], r["budget"]) for r in result["runs"]] == [
        (None, None), ("block", 4), ("block", 8), ("ngram", 4), ("ngram", 8)]
    ar_rate = result["runs"][0]["tokens_per_second"]
    for run in result["runs"][1:]:
        assert run["verify_forwards"] == 2 and run["tokens_per_verify"] == 3 / 2
        assert run["ratio"] == pytest.approx(run["tokens_per_second"] / ar_rate)


# ------------------------------------------------------------------------------------------------
# the record


def run(drafter, budget, rate, ar_rate, forwards, tokens=10):
    return {"decoder": "AR" if drafter is None else "DDTree", "drafter": drafter, "budget": budget,
            "tokens_per_second": rate, "verify_forwards": forwards,
            "tokens_per_verify": None if forwards is None else tokens / forwards, "ratio": rate / ar_rate}


def hand_made(block_rates=((100.0, 200.0), (150.0, 500.0))) -> dict:
    """Two prompts of 10 new tokens, AR at 100 and 200 tok/s; block and ngram at budgets 4 and 8
    (``block_rates``: per prompt, the block drafter's rates at 4 and 8); transformers ran and
    differs from numpy on prompt 2 from new token 5."""
    prompts = []
    for index, (ar_rate, (at4, at8)) in enumerate(zip((100.0, 200.0), block_rates, strict=True)):
        runs = [run(None, None, ar_rate, ar_rate, None), run("block", 4, at4, ar_rate, 5),
                run("block", 8, at8, ar_rate, 4), run("ngram", 4, 110.0, ar_rate, 8),
                run("ngram", 8, 90.0, ar_rate, 9)]
        prompts.append({"index": index, "prompt_tokens": 70 + index, "engine": [1] * 10, "numpy": [1] * 10,
                        "engine_first_difference": None, "transformers": [1] * 10,
                        "transformers_first_difference": None if index == 0 else 5, "runs": runs})
    result = {"checkpoint": "checkpoints/tiny-code", "drafter_dir": "checkpoints/tiny-code/drafter",
              "config": "hidden=256 layers=4", "drafter_config": "hidden=256 layers=2", "window": 64,
              "max_depths": 15, "block": 8,
              "transformers": {"ran": True, "where": "torch 2, transformers 5 (cuda)"},
              "settings": dataclasses.asdict(trained.Settings(prompts=2, tokens=10, budgets=(4, 8), repeats=5,
                                                              warm_up=True)),
              "prompts": prompts}
    result["totals"] = trained.totals(prompts, 10)
    return result


def test_totals_sum_the_prompts_seconds_and_forwards():
    totals = {(row["drafter"], row["budget"]): row for row in hand_made()["totals"]}
    ar = totals[(None, None)]
    assert ar["tokens_per_second"] == pytest.approx(20 / (10 / 100 + 10 / 200))     # 133.3
    assert ar["verify_forwards"] is None and ar["ratio"] == 1.0
    block8 = totals[("block", 8)]
    assert block8["tokens_per_second"] == pytest.approx(20 / (10 / 200 + 10 / 500))
    assert block8["verify_forwards"] == 8 and block8["tokens_per_verify"] == 20 / 8
    assert block8["ratio"] == pytest.approx(block8["tokens_per_second"] / ar["tokens_per_second"])


def test_the_verdict_is_met_at_the_budget_of_the_best_ratio():
    result = hand_made()
    rate = 20 / (10 / 200 + 10 / 500)
    ratio = rate / (20 / (10 / 100 + 10 / 200))
    assert ratio >= trained.TARGET_RATIO
    assert trained.verdict(result) == (f"target: DDTree (block) >= 1.5x AR: met at budget 8 ({ratio:.2f}x "
                                       "AR; the best of budgets 4, 8)")


def test_the_verdict_is_not_met_below_the_target():
    result = hand_made(block_rates=((100.0, 130.0), (150.0, 250.0)))
    rate4, rate8 = 20 / (10 / 100 + 10 / 150), 20 / (10 / 130 + 10 / 250)
    ar = 20 / (10 / 100 + 10 / 200)
    assert max(rate4, rate8) / ar < trained.TARGET_RATIO and rate8 > rate4
    assert trained.verdict(result) == (f"target: DDTree (block) >= 1.5x AR: not met at budget 8 "
                                       f"({rate8 / ar:.2f}x AR; the best of budgets 4, 8)")


def test_the_record_shows_every_field():
    result = hand_made()
    header = [("date (UTC)", "2000-01-01 00:00:00"), ("GPU", "an H100")]
    text = trained.format_record(result, header, "python -m kernels.bench trained --out r.md")
    for line in ("# The trained model on the engine", "Command: `python -m kernels.bench trained --out r.md`",
                 "- date (UTC): 2000-01-01 00:00:00", "- GPU: an H100",
                 "- checkpoint: checkpoints/tiny-code (hidden=256 layers=4)",
                 "- block drafter: checkpoints/tiny-code/drafter (hidden=256 layers=2; window 64, max depths "
                 "15)",
                 "- transformers: torch 2, transformers 5 (cuda)", trained.verdict(result),
                 "numpy, engine and transformers agree token for token: no (1 of 2 prompts)",
                 "<!-- --8<-- [start:trained] -->", "<!-- --8<-- [end:trained] -->",
                 "| AR | - | 133 | - | - | 1.00 |",
                 "| DDTree (block) | 8 | 286 | 8 | 2.50 | 2.14 |",          # 20 / (10/200 + 10/500)
                 "| 1 | 70 | AR | - | 100 | - | - | 1.00 |",
                 "| 2 | 71 | DDTree (block) | 8 | 500 | 4 | 2.50 | 2.50 |",
                 "| 2 | 71 | DDTree (ngram) | 4 | 110 | 8 | 1.25 | 0.55 |",
                 "| 1 | yes | yes |", "| 2 | yes | no (from new token 5) |"):
        assert line in text.splitlines(), line
    assert "the median of 5 runs after a warm-up run" in text
    trained_section = text.split("[start:trained] -->")[1].split("<!--")[0].strip().splitlines()
    assert len(trained_section) == 2 + 5                   # header, rule, AR and 2 drafters x 2 budgets


def test_the_record_says_when_transformers_did_not_run(tmp_path):
    result = hand_made()
    result["transformers"] = {"ran": False, "where": "not run: No module named 'torch'"}
    for prompt in result["prompts"]:
        del prompt["transformers"], prompt["transformers_first_difference"]
    path = tmp_path / "records" / "trained.md"
    text = trained.write_record(path, result, [("GPU", "x")], "command")
    assert path.read_text() == text
    assert "numpy and engine agree token for token: yes (2 of 2 prompts)" in text
    assert "| 2 | yes | not run |" in text
    saved = json.loads(path.with_suffix(".json").read_text())
    assert saved["command"] == "command" and saved["result"]["totals"] == result["totals"]


# ------------------------------------------------------------------------------------------------
# refusals


OUT = ["--out", "r.md"]


@pytest.mark.parametrize("argv, message", [
    ([*OUT, "--prompts", "0"], "--prompts: expected a positive integer, got '0'"),
    ([*OUT, "--prompts", "17"], "--prompts: there are 16 held-out prompts, got 17"),
    ([*OUT, "--tokens", "x"], "--tokens: expected a positive integer, got 'x'"),
    ([*OUT, "--repeats", "-1"], "--repeats: expected a positive integer, got '-1'"),
    ([*OUT, "--budgets", "4,0"], "--budgets: expected comma-separated positive integers, got '4,0'"),
    ([*OUT, "--budgets", "4,,8"], "--budgets: expected comma-separated positive integers, got '4,,8'"),
    ([*OUT, "--budgets", "4,128"], "--budgets: each budget must be <= 127"),
    (["--prompts", "2"], "--out is required"),
    (["--smoke", "--out", "r.md"], "--out: --smoke writes nothing"),
])
def test_bad_flags_are_refused(argv, message, capsys):
    assert len(heldout_prompts()) == 16                    # the committed prompts, as the messages say
    with pytest.raises(SystemExit) as error:
        trained.parse_args(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_the_simulator_is_refused_without_smoke(tmp_path, capsys):
    if not device.SIMULATOR:
        pytest.skip("simulator only: on a GPU the command runs")
    assert cli_main(["trained", "--out", str(tmp_path / "r.md")]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_without_weights_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--checkpoint: .*config.json does not exist"):
        trained.main(["--smoke", "--checkpoint", str(tmp_path)])


def test_a_drafter_too_shallow_for_the_block_is_refused(tmp_path):
    directory = save_stand_in(tmp_path)
    config = dataclasses.replace(STAND_IN, num_hidden_layers=1, first_k_dense_replace=1)
    save_block_drafter(directory / "drafter", BlockDrafter(config, init_weights(config, 7), window=4,
                                                           max_depths=6))
    with pytest.raises(SystemExit, match="drafts up to 6 depths; block 8 needs 7"):
        trained.main(["--smoke", "--checkpoint", str(directory)])


# ------------------------------------------------------------------------------------------------
# the real checkpoint, on a GPU


def trained_weights_missing() -> str | None:
    """Why the trained checkpoint cannot run (the file it lacks), or None."""
    for path in (TRAINED / "config.json", TRAINED / "drafter" / "drafter.json",
                 TRAINED / "drafter" / "model.safetensors"):
        if not path.is_file():
            return f"the trained checkpoint's weights are absent: {path} does not exist"
    if not any((TRAINED / name).is_file() for name in ("model.safetensors.index.json", "model.safetensors")):
        return (f"the trained checkpoint's weights are absent: {TRAINED} holds neither "
                "model.safetensors.index.json nor model.safetensors")
    return None


@pytest.mark.gpu
def test_the_trained_checkpoint_runs_on_the_engine():
    """A few tokens of the trained model on the engine: DDTree (block and n-gram) == AR, and the
    engine's tokens (and transformers', where it imports) are the numpy reference's."""
    missing = trained_weights_missing()
    if missing:
        pytest.skip(missing)
    code, out, result = run_main(["--smoke", "--checkpoint", str(TRAINED)])
    assert code == 0, out
    [prompt] = result["prompts"]
    assert prompt["engine"] == prompt["numpy"]
    assert len(prompt["runs"]) == 1 + len(trained.DRAFTERS) * (len(trained.SMOKE.budgets) + 1)   # + auto
