"""``train.budget_replay``: the auto budget replayed from one tree per position is the decoder
itself (the same verify forwards at fixed budgets, the same budgets round by round at auto), and
its record is written from the trained checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddtree import golden
from ddtree.budget import CostTable
from ddtree.config import preset
from ddtree.decode import generate_ar, generate_ddtree
from ddtree.drafters import make_drafter
from ddtree.model import Transformer
from ddtree.weights import init_weights
from train import budget_replay

# trees a little dearer than an AR step, growing with the budget: some pay, some do not
TABLE = CostTable(1.0, tuple(1.1 + 0.05 * b for b in range(1, 17)))
NEW = 20


@pytest.mark.parametrize("drafter_name", ["noisy", "ngram"])
def test_the_replay_is_the_decoder(drafter_name):
    config = preset("micro")
    model = Transformer(config, init_weights(config, 0))
    prompt = golden.default_prompt("micro")
    longer = generate_ar(model, prompt, NEW + 7)            # a last round's targets past the request
    ar = longer[:NEW]
    drafter = make_drafter(drafter_name, model, prompt, NEW, continuation=ar)
    with pytest.raises(ValueError, match="ar must hold tokens"):
        budget_replay.round_paths(prompt, ar, drafter, 8, TABLE.max_budget, config.vocab_size, NEW)
    paths = budget_replay.round_paths(prompt, longer, drafter, 8, TABLE.max_budget, config.vocab_size, NEW)
    assert len(paths) == NEW and all(np.all(np.diff(p) > 0) for p in paths)
    for budget in (1, 3, 16):
        _, trace = generate_ddtree(model, prompt, NEW, drafter, 8, budget=budget)
        assert budget_replay.replay(paths, TABLE, 8, budget)[1] == [budget] * trace.verify_forwards
    _, trace = generate_ddtree(model, prompt, NEW, drafter, 8, budget="auto", cost_table=TABLE)
    seconds, budgets, stats = budget_replay.replay(paths, TABLE, 8)
    assert budgets == trace.budgets and stats == trace.acceptance
    assert seconds == pytest.approx(sum(TABLE.seconds(b) for b in trace.budgets))
    switched = CostTable(TABLE.ar_step, TABLE.verify, switch=0.5)       # a tree round after AR pays it
    _, trace = generate_ddtree(model, prompt, NEW, drafter, 8, budget="auto", cost_table=switched)
    seconds, budgets, _ = budget_replay.replay(paths, switched, 8)
    switches = sum(1 for before, b in zip(budgets[:-1], budgets[1:], strict=True) if b and not before)
    assert budgets == trace.budgets
    assert seconds == pytest.approx(sum(switched.seconds(b) for b in budgets) + 0.5 * switches)
    budget_replay.check_against_decoder(model, prompt, NEW, drafter, 8, TABLE, paths, ar,
                                        (None, stats))                                # no exit
    _, carried = generate_ddtree(model, prompt, NEW, drafter, 8, budget="auto", cost_table=TABLE,
                                 acceptance=stats)
    assert budget_replay.replay(paths, TABLE, 8, acceptance=stats)[1] == carried.budgets


def test_the_record_on_the_trained_model(tmp_path):
    tables = tmp_path / "trained.json"
    tables.write_text(json.dumps({"header": [["GPU", "a test table"]], "result": {"cost_tables": {
        name: {"ar_step": 1.0, "verify": list(TABLE.verify)} for name in budget_replay.DRAFTERS}}}))
    out = tmp_path / "replay.md"
    assert budget_replay.main(["--cost-tables", str(tables), "--prompts", "1", "--tokens", "10",
                               "--out", str(out)]) == 0
    page = out.read_text()
    assert "[start:auto-replay]" in page and "| block |" in page and "| ngram |" in page
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["drafters"]) == {"block", "ngram"}
    assert len(result["drafters"]["ngram"]["fixed_seconds"]) == TABLE.max_budget + 1


def test_bad_options_are_refused_by_name(tmp_path, capsys):
    tables = tmp_path / "trained.json"
    tables.write_text(json.dumps({"header": [], "result": {"cost_tables": {"block": {
        "ar_step": 1.0, "verify": [1.0]}}}}))
    assert budget_replay.main(["--cost-tables", str(tables), "--out", str(tmp_path / "r.md")]) == 2
    assert "no cost table for ['ngram']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        budget_replay.parse_args(["--cost-tables", "x", "--out", "y", "--tokens", "0"])
    assert "--tokens must be >= 1" in capsys.readouterr().err
