"""The auto budget replayed on the trained model: what ``ddtree.budget.choose_budget`` picks on the
held-out prompts, and the tokens per second its choices would give under a measured cost table,
beside every fixed budget's, without a GPU.

Legend (docs/glossary.md): B node budget, L draft depths (block_size - 1), P positions of a
generation.

    python -m train.budget_replay --cost-tables docs/results/trained.json --prompts 16 \\
        --out docs/results/budget-replay.md

Greedy DDTree emits AR's tokens, so the round rooted after p new tokens starts from AR's context
whatever came before, and what it commits depends only on p and B: its tree's accepted path
against AR's continuation, plus the bonus. The tree of B' nodes is the first B' nodes of the
largest tree (``AcceptanceStats.observe_round`` rests on the same fact), so one draft and one tree
per position give ``committed[p, B]`` for every budget. A replay then walks the positions as the
decoder does (the choice lagging a round, every round a full block: its tokens past the end dropped),
summing the cost table's seconds of each round's budget, and its ``switch`` for each tree round
that follows an AR step (a tree round between two runs of AR steps): modelled seconds, from the
engine's measured table, not a timing. Each replay is checked against the decoder itself
(``generate_ddtree``'s verify forwards at fixed budgets, its budgets round by round at auto).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

from ddtree.accept import accept
from ddtree.budget import AcceptanceStats, CostTable, check_cost_table, choose_budget
from ddtree.decode import candidates_per_depth, check_draft, generate_ar, generate_ddtree, retest
from ddtree.drafters import make_drafter
from ddtree.model import Transformer
from ddtree.text import encode, heldout_prompts, load_tokenizer
from ddtree.tree import build_tree, top_candidates
from ddtree.weights import load_pretrained

DRAFTERS = ("block", "ngram")


def round_paths(prompt: np.ndarray, ar: np.ndarray, drafter, block_size: int, max_budget: int,
                vocab: int, tokens: int) -> list[np.ndarray]:
    """Per position p < ``tokens`` (the round rooted after p of AR's new tokens ``ar``): the accepted
    path's drafted node ids (ascending) in the tree of ``max_budget``; the tree of B keeps those <= B.
    Every round drafts a full block, as the decoder's do (``ddtree.decode.round_block``), so ``ar``
    holds ``block_size - 1`` tokens past the request: the targets of a last round's deeper nodes."""
    if ar.size < tokens + block_size - 1:
        raise ValueError(f"ar must hold tokens + block_size - 1 = {tokens + block_size - 1} tokens, "
                         f"got {ar.size}")
    paths = []
    for p in range(tokens):
        context = np.concatenate([prompt, ar[:p]])
        draft = check_draft(drafter.propose(context, block_size), block_size - 1, vocab, drafter)  # [L, V]
        tree = build_tree(int(context[-1]), *top_candidates(
            draft, candidates_per_depth(max_budget, None, vocab)), max_budget)
        accepted, _ = accept(tree, ar[p + tree.depths])    # node n's target token: AR's there
        paths.append(np.asarray(accepted, np.int64)[1:])
    return paths


# --8<-- [start:replay]
def replay(paths: list[np.ndarray], table: CostTable, block_size: int, budget=None, acceptance=None):
    """(modelled seconds, budgets round by round, statistics after) of a generation: ``budget``
    fixed, or None for auto, choosing as ``generate_ddtree`` does (from the rounds before the last
    one), from the statistics ``acceptance`` (a generation before it) or empty ones."""
    stats = AcceptanceStats.empty(table.max_budget, block_size) if acceptance is None else acceptance
    current = choose_budget(table, stats) if budget is None else budget
    p, seconds, budgets = 0, 0.0, []
    while p < len(paths):
        seconds += table.seconds(current) + (table.switch if current and budgets[-1:] == [0] else 0.0)
        budgets.append(current)
        accepted = np.concatenate([[0], paths[p][paths[p] <= current]])     # this round's path
        if budget is None:                              # a re-test is read before the choice
            observed = stats.observe_round(current, accepted)
            current, stats = choose_budget(table, observed if retest(stats, current) else stats,
                                           current), observed
        p += accepted.size                                                  # the drafts and the bonus
    return seconds, budgets, stats
# --8<-- [end:replay]


def check_against_decoder(target, prompt, tokens, drafter, block_size, table, paths, ar,
                          acceptances=(None,)) -> None:
    """The replay is the decoder: the same verify forwards at fixed budgets, the same budgets at auto
    from each statistics in ``acceptances`` (None: empty ones)."""
    runs = [(budget, None) for budget in (1, table.max_budget // 4, table.max_budget)]
    runs += [("auto", acceptance) for acceptance in acceptances]
    for budget, acceptance in runs:
        new, trace = generate_ddtree(target, prompt, tokens, drafter, block_size, budget=budget,
                                     cost_table=table if budget == "auto" else None, acceptance=acceptance)
        fixed = None if budget == "auto" else budget
        got = replay(paths, table, block_size, fixed, acceptance)[1]
        if not np.array_equal(new, ar) or got != trace.budgets:
            raise SystemExit(f"error: the replay differs from generate_ddtree at budget {budget}: "
                             "the record is not written")


def replay_drafter(target, prompts, drafter, table: CostTable, tokens: int, block_size: int) -> dict:
    """Modelled seconds of every fixed budget, of auto and of a drafter that never hits, summed over
    the prompts, with auto's budgets per prompt; auto and never-hits twice: each prompt from empty
    statistics, and the statistics carried from prompt to prompt (``acceptance=``, as a server
    keeps them)."""
    vocab = target.config.vocab_size
    fixed = np.zeros(table.max_budget + 1)                       # [B + 1], budget 0: AR steps
    runs = {kind: {"seconds": 0.0, "budgets": [], "stats": None}
            for kind in ("auto", "auto_carried", "never", "never_carried")}
    never_hits = [np.zeros(0, np.int64)] * tokens
    for prompt in prompts:
        ar = generate_ar(target, prompt, tokens + block_size - 1)     # a last round's targets too
        paths = round_paths(prompt, ar, drafter, block_size, table.max_budget, vocab, tokens)
        ar = ar[:tokens]
        carried = runs["auto_carried"]["stats"]                 # None before the first prompt
        check_against_decoder(target, prompt, tokens, drafter, block_size, table, paths, ar,
                              (None,) if carried is None else (None, carried))
        for budget in range(table.max_budget + 1):
            fixed[budget] += replay(paths, table, block_size, budget)[0]
        for kind, run in runs.items():
            seconds, budgets, stats = replay(never_hits if kind.startswith("never") else paths, table,
                                             block_size, None, run["stats"] if "carried" in kind else None)
            run["seconds"] += seconds
            run["budgets"].append(budgets)
            run["stats"] = stats
    return {"fixed_seconds": fixed.tolist(),
            **{f"{kind}_seconds": run["seconds"] for kind, run in runs.items()},
            **{f"{kind}_budgets": run["budgets"] for kind, run in runs.items()}}


def trees(run: dict, kind: str) -> int:
    """Rounds with a tree (budget > 0) in the ``kind`` replays of every prompt."""
    return sum(1 for budgets in run[f"{kind}_budgets"] for b in budgets if b)


def markdown(result: dict) -> str:
    largest = min(len(run["fixed_seconds"]) - 1 for run in result["drafters"].values())
    shown = [2 ** i for i in range(largest.bit_length()) if 2 ** i >= 4 or largest < 4]   # 4, 8, ...
    lines = ["# The auto budget replayed on the trained model", "",
             f"Command: `{result['command']}`", "",
             f"- date (UTC): {result['date_utc']}",
             f"- checkpoint: `{result['checkpoint']}`; cost tables: `{result['cost_tables']}` "
             f"(the engine's, measured on its GPU: {result['gpu']})",
             f"- held-out prompts: the first {result['prompts']} of `corpus/prompts.json`; "
             f"{result['tokens']} greedy new tokens each; block size {result['block_size']}", "",
             "<!-- --8<-- [start:auto-replay] -->",
             "Modelled tokens per second over AR's: the cost table's seconds of each round's budget, "
             "summed over the rounds the decoder would run (checked against `generate_ddtree`), against "
             "the table's AR step per token. *Never hits*: the same policy and table with a drafter "
             "whose every draft is rejected (one token a round), the price of looking. *Carried*: each "
             "prompt starts from the statistics the one before it left (`acceptance=`), as a server "
             "keeps them; otherwise each starts empty.", "",
             "| drafter | best fixed budget | x AR | " + " | ".join(f"budget {b}" for b in shown)
             + " | auto | auto, carried | auto's rounds at budget 0 | never hits: auto | its trees "
             "| never hits, carried | its trees |",
             "|---" * (len(shown) + 10) + "|"]
    for name, run in result["drafters"].items():
        ar = run["ar_seconds"]
        ratio = [ar / s for s in run["fixed_seconds"][1:]]                  # budgets 1, 2, ...
        best = 1 + int(np.argmax(ratio))
        zeros = sum(b.count(0) for b in run["auto_budgets"])
        rounds = sum(len(b) for b in run["auto_budgets"])
        lines.append(f"| {name} | {best} | {ratio[best - 1]:.2f} | "
                     + " | ".join(f"{ratio[b - 1]:.2f}" for b in shown)
                     + f" | **{ar / run['auto_seconds']:.2f}** | {ar / run['auto_carried_seconds']:.2f} | "
                     f"{zeros} of {rounds} | {ar / run['never_seconds']:.3f} | {trees(run, 'never')} | "
                     f"{ar / run['never_carried_seconds']:.3f} | {trees(run, 'never_carried')} |")
    lines += ["<!-- --8<-- [end:auto-replay] -->", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m train.budget_replay", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="checkpoints/tiny-code",
                   help="the trained target's directory (its block drafter in drafter/)")
    p.add_argument("--cost-tables", required=True,
                   help="a trained-bench JSON record (its cost_tables, one per drafter)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--out", required=True, help="the markdown record to write (and its .json)")
    options = p.parse_args(argv)
    for name in ("prompts", "tokens", "block_size"):
        if getattr(options, name) < (2 if name == "block_size" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'block_size' else 1}, "
                    f"got {getattr(options, name)}")
    return options


def main(argv=None) -> int:
    options = parse_args(argv)
    record = json.loads(pathlib.Path(options.cost_tables).read_text())
    tables = record["result"]["cost_tables"]
    missing = [name for name in DRAFTERS if name not in tables]
    if missing:
        print(f"error: --cost-tables {options.cost_tables} has no cost table for {missing}", file=sys.stderr)
        return 2
    config, weights = load_pretrained(options.checkpoint)
    target = Transformer(config, weights)
    tokenizer = load_tokenizer(options.checkpoint)
    prompts = [encode(tokenizer, entry["text"]) for entry in heldout_prompts()[:options.prompts]]
    result = {"command": " ".join(["python -m train.budget_replay", *(argv or sys.argv[1:])]),
              "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
              "checkpoint": options.checkpoint, "cost_tables": options.cost_tables,
              "gpu": dict(record["header"]).get("GPU", "not recorded"), "prompts": len(prompts),
              "tokens": options.tokens, "block_size": options.block_size, "drafters": {}}
    for name in DRAFTERS:
        table = check_cost_table(tables[name])
        directory = pathlib.Path(options.checkpoint) / "drafter" if name == "block" else None
        drafter = make_drafter(name, target, prompts[0], options.tokens, drafter_directory=directory)
        run = replay_drafter(target, prompts, drafter, table, options.tokens, options.block_size)
        run["ar_seconds"] = len(prompts) * options.tokens * table.ar_step
        result["drafters"][name] = run
        print(f"{name}: auto {run['ar_seconds'] / run['auto_seconds']:.2f}x AR (modelled)", flush=True)
    out = pathlib.Path(options.out)
    out.write_text(markdown(result))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
