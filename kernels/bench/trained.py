"""The trained model on the engine: ``python -m kernels.bench trained`` (a GPU only; ``--smoke`` runs
anywhere, tiny, and writes nothing).

For the first ``--prompts`` held-out prompts (``corpus/prompts.json``, encoded with the
checkpoint's tokenizer), ``--tokens`` greedy new tokens each, block BLOCK:

- the engine (CUDA graphs) AR, and DDTree with the checkpoint's block drafter and with the n-gram
  drafter at each budget of ``--budgets`` and at budget auto (each drafter's cost table timed from
  the first prompt, budgets 0 to the largest of ``--budgets``), both drafters' kernels inside the
  round: tokens/s (the
  median of ``--repeats`` runs after a warm-up run), verify forwards (DDTree's target forwards
  after the prefill), tokens per verify forward, and the ratio to the same prompt's AR. Every
  DDTree run's tokens must equal AR's: the record is not written otherwise;
- the same prompts' greedy tokens from the numpy reference (the truth), from the engine, and,
  where torch and transformers import, from transformers' ``DeepseekV3ForCausalLM`` (eager,
  fp32, TF32 off) loaded from the same checkpoint: do all three agree token for token?

The record (``--out``): markdown with the environment header, the command, the totals (a snippet
section ``trained``), the per-prompt table, the agreement table and the target's verdict line
"target: DDTree (block) >= 1.5x AR: met/not met at budget B"; the measurements as JSON beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys

import numpy as np

from ddtree import decode as reference_decode
from ddtree.budget import cost_table_to_dict
from ddtree.cli import budget_list, positive
from ddtree.drafters import load_block_drafter, make_drafter
from ddtree.model import Transformer as ReferenceTransformer
from ddtree.text import TRAINED, encode, heldout_prompts, load_tokenizer
from ddtree.weights import load_pretrained
from kernels import decode as engine_decode
from kernels import device
from kernels.bench.engine import AUTO, load_deepseek, median_rate, section
from kernels.bench.environment import versions

BLOCK = 8
BUDGETS = (4, 8, 16, 32)
PROMPTS = 4
NEW_TOKENS = 128
REPEATS = 5
DRAFTERS = ("block", "ngram")
TARGET_DRAFTER, TARGET_RATIO = "block", 1.5     # the target: DDTree (block) >= 1.5x AR tok/s on the engine
PROG = "python -m kernels.bench trained"


@dataclasses.dataclass(frozen=True)
class Settings:
    prompts: int
    tokens: int
    budgets: tuple[int, ...]
    repeats: int
    warm_up: bool
    prompt_tokens: int | None = None     # keep only each prompt's last tokens (the smoke run)
    table_budget: int | None = None      # budget auto's table up to this budget (None: the largest one)
    table_rounds: tuple[int, int] = (2, 10)   # ... each budget's seconds from runs of this many rounds


# --smoke: one prompt cut to its last few tokens, a few new tokens, one budget, each DDTree
# configuration run once without a warm-up, budget auto's tables over budgets 0 and 1 from runs of
# one and two rounds: every code path of the full run, in seconds in the simulator
SMOKE = Settings(prompts=1, tokens=3, budgets=(4,), repeats=1, warm_up=False, prompt_tokens=2, table_budget=1,
                 table_rounds=(1, 2))


# ------------------------------------------------------------------------------------------------
# the command line


def parse_args(argv):
    from kernels.model import DEFAULT_MAX_TREE_NODES

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=pathlib.Path, default=TRAINED,
                        help="the trained target (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--drafter-dir", type=pathlib.Path, default=None,
                        help="the block drafter (default: the checkpoint's drafter/)")
    parser.add_argument("--out", type=pathlib.Path,
                        help="the markdown record (required unless --smoke); the JSON goes beside it")
    parser.add_argument("--prompts", type=positive, default=PROMPTS, help="use the first N held-out prompts")
    parser.add_argument("--tokens", type=positive, default=NEW_TOKENS, help="new tokens per prompt")
    parser.add_argument("--budgets", type=budget_list, default=BUDGETS, help="e.g. 4,8,16,32")
    parser.add_argument("--repeats", type=positive, default=REPEATS, help="timed runs per configuration")
    parser.add_argument("--smoke", action="store_true",
                        help=f"one prompt cut to its last {SMOKE.prompt_tokens} tokens, {SMOKE.tokens} new "
                             f"tokens, budget {SMOKE.budgets[0]}, each run once: runs in the CUDA simulator "
                             "too, and writes nothing")
    args = parser.parse_args(argv)
    if args.smoke and args.out is not None:
        parser.error("--out: --smoke writes nothing (run without --smoke on a GPU to write a record)")
    if not args.smoke and args.out is None:
        parser.error("--out is required (the markdown record; the JSON goes beside it)")
    if args.budgets[-1] > DEFAULT_MAX_TREE_NODES - 1:
        parser.error(f"--budgets: each budget must be <= {DEFAULT_MAX_TREE_NODES - 1} (the engine's largest "
                     f"tree bucket holds {DEFAULT_MAX_TREE_NODES} nodes), got {args.budgets[-1]}")
    available = len(heldout_prompts())
    if args.prompts > available:
        parser.error(f"--prompts: there are {available} held-out prompts, got {args.prompts}")
    return args


def settings_of(args) -> Settings:
    if args.smoke:
        return SMOKE
    return Settings(prompts=args.prompts, tokens=args.tokens, budgets=args.budgets, repeats=args.repeats,
                    warm_up=True)


# ------------------------------------------------------------------------------------------------
# the checkpoint and the prompts


def load_checkpoint(checkpoint: pathlib.Path, drafter_dir: pathlib.Path):
    """(config, weights, block drafter, tokenizer); errors name the flag and the path."""
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"error: --checkpoint: {checkpoint / 'config.json'} does not exist (the trained "
                         "model's weights are not there)")
    config, weights = load_pretrained(checkpoint)
    drafter = load_block_drafter(drafter_dir)
    if drafter.max_depths < BLOCK - 1:
        raise SystemExit(f"error: the block drafter in {drafter_dir} drafts up to {drafter.max_depths} "
                         f"depths; block {BLOCK} needs {BLOCK - 1}")
    if drafter.vocab_size != config.vocab_size:
        raise SystemExit(f"error: the block drafter's vocab_size ({drafter.vocab_size}, in {drafter_dir}) "
                         f"must equal the model's ({config.vocab_size}, in {checkpoint})")
    return config, weights, drafter, load_tokenizer(checkpoint)


def prompt_ids(tokenizer, settings: Settings) -> list[np.ndarray]:
    """The first ``settings.prompts`` held-out prompts as token ids (T,), each cut to its last
    ``settings.prompt_tokens`` tokens where that is set."""
    prompts = [encode(tokenizer, entry["text"]) for entry in heldout_prompts()[:settings.prompts]]
    if settings.prompt_tokens is not None:
        prompts = [ids[-settings.prompt_tokens:] for ids in prompts]
    return prompts


# ------------------------------------------------------------------------------------------------
# the numpy reference and transformers: the greedy tokens the engine's must equal


def reference_tokens(config, weights, prompts, tokens: int) -> list[np.ndarray]:
    """The numpy reference's greedy continuation of each prompt (the truth)."""
    model = ReferenceTransformer(config, weights)
    return [reference_decode.generate_ar(model, prompt, tokens) for prompt in prompts]


def transformers_modules():
    """(torch, transformers), or (None, why not) when either does not import."""
    try:
        import torch
        import transformers
    except ImportError as error:
        return None, f"not run: {error}"
    return (torch, transformers), None


def transformers_tokens(modules, checkpoint: pathlib.Path, prompts, tokens: int):
    """transformers' greedy continuation of each prompt from the checkpoint (eager attention and
    experts, fp32, TF32 off; on the GPU where torch has one, else the CPU), by its own forward with
    its KV cache and an argmax per step, so no generation setting (end-of-text, minimum length)
    touches the tokens. Returns (tokens per prompt, where it ran)."""
    torch, transformers = modules
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    where = "cuda" if not device.SIMULATOR and torch.cuda.is_available() else "cpu"
    try:
        hf_model = load_deepseek(modules, checkpoint, where)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    continuations = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.as_tensor(prompt, dtype=torch.long, device=where)[None]           # [1, T]
            past, new = None, []
            for _ in range(tokens):
                out = hf_model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                ids = out.logits[:, -1].argmax(-1, keepdim=True)                            # [1, 1]
                new.append(int(ids))
            continuations.append(np.array(new, np.int64))
    del hf_model
    if where == "cuda":
        torch.cuda.empty_cache()
    return continuations, f"torch {torch.__version__}, transformers {transformers.__version__} ({where})"


def first_difference(tokens: np.ndarray, truth: np.ndarray) -> int | None:
    """The first new token where ``tokens`` differs from ``truth`` (None: the same tokens)."""
    if np.array_equal(tokens, truth):
        return None
    differ = np.flatnonzero(tokens[:truth.size] != truth[:tokens.size])
    return int(differ[0]) if differ.size else min(tokens.size, truth.size)


# ------------------------------------------------------------------------------------------------
# the engine, timed


def check_equal(name: str, tokens: np.ndarray, ar: np.ndarray) -> None:
    first = first_difference(tokens, ar)
    if first is not None:
        raise SystemExit(f"error: {name} differs from the engine's AR at new token {first}: the record is "
                         "not written (DDTree must equal AR token for token)")


def engine_prompt(model, drafters: dict, prompt: np.ndarray, settings: Settings, tables=None) -> dict:
    """One prompt on the engine: AR, then DDTree with each drafter at each budget, and at budget
    auto with the drafter's cost table where ``tables`` (drafter name -> CostTable) has one, timed;
    every run's tokens checked equal to the first AR run's."""
    tokens = settings.tokens
    # the tokens every run must equal; also AR's warm-up (compiled, graphs captured), run even
    # when settings.warm_up is off, since the timed runs are checked against it
    ar = engine_decode.generate_ar(model, prompt, tokens)

    def ar_run():
        new = engine_decode.generate_ar(model, prompt, tokens)
        check_equal("a repeated AR run", new, ar)
        return new

    ar_rate, _ = median_rate(ar_run, tokens, settings.repeats)
    runs = [{"decoder": "AR", "drafter": None, "budget": None, "tokens_per_second": ar_rate,
             "verify_forwards": None, "tokens_per_verify": None, "ratio": 1.0}]
    for name, drafter in drafters.items():
        if not model.drafts_on_device(drafter):
            raise SystemExit(f"error: the {name} drafter does not run on the device inside the round")
        auto = (AUTO,) if tables and name in tables else ()
        for budget in (*settings.budgets, *auto):
            def run(drafter=drafter, name=name, budget=budget):
                table = {"cost_table": tables[name]} if budget == AUTO else {}
                new, trace = engine_decode.generate_ddtree(model, prompt, tokens, drafter, block_size=BLOCK,
                                                           budget=budget, **table)
                check_equal(f"DDTree ({name} drafter, budget {budget})", new, ar)
                return trace
            if settings.warm_up:
                run()                                                       # compile and capture
            rate, trace = median_rate(run, tokens, settings.repeats)
            runs.append({"decoder": "DDTree", "drafter": name, "budget": budget, "tokens_per_second": rate,
                         "verify_forwards": trace.verify_forwards,
                         "tokens_per_verify": tokens / trace.verify_forwards, "ratio": rate / ar_rate})
            if budget == AUTO:
                runs[-1]["budgets_chosen"] = [int(b) for b in trace.budgets]
    return {"prompt_tokens": int(prompt.size), "engine": [int(t) for t in ar], "runs": runs}


def totals(prompts: list[dict], tokens: int) -> list[dict]:
    """Each configuration over every prompt: tokens/s = all new tokens / the sum of the prompts'
    median seconds; verify forwards summed; the ratio to AR's total rate."""
    count = len(prompts)
    rows = []
    for index, first in enumerate(prompts[0]["runs"]):
        runs = [p["runs"][index] for p in prompts]
        seconds = sum(tokens / r["tokens_per_second"] for r in runs)
        row = {key: first[key] for key in ("decoder", "drafter", "budget")}
        row["tokens_per_second"] = count * tokens / seconds
        forwards = None if first["verify_forwards"] is None else sum(r["verify_forwards"] for r in runs)
        row["verify_forwards"] = forwards
        row["tokens_per_verify"] = None if forwards is None else count * tokens / forwards
        rows.append(row)
    ar_rate = rows[0]["tokens_per_second"]
    for row in rows:
        row["ratio"] = row["tokens_per_second"] / ar_rate
    return rows


def verdict(result: dict) -> str:
    """The target's line: met at the budget of the best total ratio when it reaches TARGET_RATIO."""
    rows = [r for r in result["totals"] if r["drafter"] == TARGET_DRAFTER]
    best = max(rows, key=lambda r: r["ratio"])
    met = "met" if best["ratio"] >= TARGET_RATIO else "not met"
    budgets = ", ".join(str(r["budget"]) for r in rows)
    return (f"target: DDTree ({TARGET_DRAFTER}) >= {TARGET_RATIO}x AR: {met} at budget {best['budget']} "
            f"({best['ratio']:.2f}x AR; the best of budgets {budgets})")


def agrees(prompt: dict) -> bool:
    """The engine's greedy tokens, and transformers' where it ran, are the numpy reference's."""
    return prompt["engine_first_difference"] is None and prompt.get("transformers_first_difference") is None


def agreement(result: dict) -> str:
    prompts = result["prompts"]
    systems = "numpy, engine and transformers" if result["transformers"]["ran"] else "numpy and engine"
    count, total = sum(agrees(p) for p in prompts), len(prompts)
    answer = "yes" if count == total else "no"
    return f"{systems} agree token for token: {answer} ({count} of {total} prompt{plural(total)})"


def measure(args, settings: Settings, log) -> dict:
    """Every number of the record (see the module docstring)."""
    from kernels.model import Transformer

    drafter_dir = args.drafter_dir or args.checkpoint / "drafter"
    config, weights, block_drafter, tokenizer = load_checkpoint(args.checkpoint, drafter_dir)
    prompts = prompt_ids(tokenizer, settings)
    log(f"{len(prompts)} prompts of {', '.join(str(p.size) for p in prompts)} tokens; numpy reference ...")
    truth = reference_tokens(config, weights, prompts, settings.tokens)
    modules, missing = transformers_modules()
    peer, where = (None, missing) if modules is None else \
        transformers_tokens(modules, args.checkpoint, prompts, settings.tokens)
    log(f"transformers: {where}")
    model = Transformer(config, weights)
    drafters = {"block": block_drafter, "ngram": make_drafter("ngram", model, None, settings.tokens)}
    # budget auto's tables: each drafter's rounds timed from the first prompt, budgets 0 to the largest
    largest = settings.table_budget or settings.budgets[-1]
    tables = {name: engine_decode.measure_cost_table(model, prompts[0], drafter, BLOCK, max_budget=largest,
                                                     repeats=settings.repeats, rounds=settings.table_rounds)
              for name, drafter in drafters.items()}
    results = []
    for index, prompt in enumerate(prompts):
        result = engine_prompt(model, drafters, prompt, settings, tables)
        result["numpy"] = [int(t) for t in truth[index]]
        result["engine_first_difference"] = first_difference(np.array(result["engine"]), truth[index])
        if peer is not None:
            result["transformers"] = [int(t) for t in peer[index]]
            result["transformers_first_difference"] = first_difference(peer[index], truth[index])
        results.append({"index": index, **result})
        log(f"prompt {index + 1}/{len(prompts)}: " + ", ".join(
            f"{r['decoder']}{'' if r['drafter'] is None else ' ' + r['drafter'] + '/' + str(r['budget'])} "
            f"{r['tokens_per_second']:.0f} tok/s" for r in result["runs"]))
    return {"checkpoint": str(args.checkpoint), "drafter_dir": str(drafter_dir),
              "config": config.describe(), "drafter_config": block_drafter.config.describe(),
              "window": block_drafter.window, "max_depths": block_drafter.max_depths,
              "settings": dataclasses.asdict(settings), "block": BLOCK,
              "transformers": {"ran": peer is not None, "where": where},
              "cost_tables": {name: cost_table_to_dict(table)
                              for name, table in tables.items()},
              "prompts": results, "totals": totals(results, settings.tokens)}


# ------------------------------------------------------------------------------------------------
# the record


def decoder_name(row: dict) -> str:
    return "AR" if row["drafter"] is None else f"DDTree ({row['drafter']})"


def dash(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def run_cells(row: dict) -> str:
    return (f"{decoder_name(row)} | {dash(row['budget'], '')} | {row['tokens_per_second']:.0f} | "
            f"{dash(row['verify_forwards'], 'd')} | {dash(row['tokens_per_verify'], '.2f')} | "
            f"{row['ratio']:.2f} |")


def same(first_difference_at) -> str:
    return "yes" if first_difference_at is None else f"no (from new token {first_difference_at})"


def plural(count: int) -> str:
    return "" if count == 1 else "s"


def format_record(result: dict, header: list, command: str) -> str:
    """The markdown record of ``measure``'s result."""
    settings = result["settings"]
    tokens, count = settings["tokens"], len(result["prompts"])
    lines = ["# The trained model on the engine", "", f"Command: `{command}`", ""]
    lines += [f"- {key}: {value}" for key, value in header]
    lines += [f"- checkpoint: {result['checkpoint']} ({result['config']})",
              f"- block drafter: {result['drafter_dir']} ({result['drafter_config']}; window "
              f"{result['window']}, max depths {result['max_depths']})",
              f"- transformers: {result['transformers']['where']}", ""]
    cut = "" if settings["prompt_tokens"] is None else \
        f", each cut to its last {settings['prompt_tokens']} tokens"
    timing = (f"the median of {settings['repeats']} runs after a warm-up run (compiled, graphs captured)"
              if settings["warm_up"] else f"{settings['repeats']} run(s), no warm-up")
    lines += [f"{tokens} greedy new tokens after each of the first {count} held-out prompt{plural(count)} "
              f"(corpus/prompts.json, "
              f"encoded with the checkpoint's tokenizer{cut}), block {result['block']}; the engine with CUDA "
              f"graphs, each drafter's kernels inside the round; tok/s: {timing}. Verify forwards: DDTree's "
              "target forwards after the prefill; tokens per verify forward = new tokens / verify forwards; "
              "x AR: tok/s over the same prompts' AR tok/s in this run. Budget auto: each drafter's cost "
              "table timed from the first prompt (budgets 0 to the largest above; 0 is an AR step). Every "
              "DDTree run's tokens equal AR's.",
              "", verdict(result), "", agreement(result), "", "## Total", "",
              f"All {count} prompt{plural(count)}: tok/s = {count} x {tokens} new tokens / the sum of the "
              "prompts' median seconds.", ""]
    table = ["| decoder | budget | tok/s | verify forwards | tokens per verify forward | x AR |",
             "|---|---|---|---|---|---|"]
    table += [f"| {run_cells(row)}" for row in result["totals"]]
    lines += section("trained", table)
    lines += ["", "## Per prompt", "",
              "| prompt | prompt tokens | decoder | budget | tok/s | verify forwards | tokens per verify "
              "forward | x AR |", "|---|---|---|---|---|---|---|---|"]
    for prompt in result["prompts"]:
        lines += [f"| {prompt['index'] + 1} | {prompt['prompt_tokens']} | {run_cells(row)}"
                  for row in prompt["runs"]]
    peer = result["transformers"]["ran"]
    lines += ["", "## The same tokens", "",
              "Greedy new tokens against the numpy reference's (the truth).", "",
              "| prompt | engine = numpy | transformers = numpy |", "|---|---|---|"]
    lines += [f"| {p['index'] + 1} | {same(p['engine_first_difference'])} | "
              f"{same(p['transformers_first_difference']) if peer else 'not run'} |"
              for p in result["prompts"]]
    lines.append("")
    return "\n".join(lines)


def write_record(path: pathlib.Path, result: dict, header: list, command: str) -> str:
    """The markdown record at ``path`` and everything measured as JSON beside it; returns the record."""
    report = format_record(result, header, command)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report, encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps({"header": header, "command": command, "result": result},
                                                    indent=1), encoding="utf-8")
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if device.SIMULATOR and not args.smoke:
        print(f"error: {PROG} needs a GPU (the CUDA simulator's times mean nothing); --smoke runs it "
              "there, tiny, and writes nothing", file=sys.stderr)
        return 2
    log = lambda text: print(text, file=sys.stderr, flush=True)
    command = f"{PROG} {shlex.join(argv)}"
    header = versions()
    result = measure(args, settings_of(args), log)
    if args.smoke:
        print(format_record(result, header, command))
    else:
        print(write_record(args.out, result, header, command))
    if not all(agrees(p) for p in result["prompts"]):
        print("error: the greedy tokens differ from the numpy reference's (see 'The same tokens'"
              f"{'' if args.smoke else '; the record is written'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
