"""``python -m kernels.bench sweep``: the engine's tokens/s against context length.

A live service's throughput falls as its context grows, because every decode step reads the whole
KV cache. This sweep measures the engine on one preset (default ``small``) at contexts from 1k to
32k tokens: the cache is filled with random latents (a prefill of 32k tokens would only cost
time; attention reads the cache the same way whatever is in it), then

* AR: ``STEPS`` decode steps, replayed from the AR graph, timed on the host clock (one wait);
* DDTree: block 8, budget 32, with the oracle drafter over AR's own continuation (every round
  commits a whole block) and the noisy oracle (some mistakes), ``STEPS`` tokens, timed likewise;
* attention's share of the AR step: each kernel's device time with events around each launch
  (``kernels.bench.profile``), attention's over the sum.

GPU only. Writes a markdown record and its JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import numpy as np

from ddtree.config import preset
from ddtree.drafters import NoisyOracleDrafter, OracleDrafter
from kernels import decode as engine_decode
from kernels.bench.case import fill_context
from kernels.bench.environment import versions
from kernels.bench.profile import kernel_times
from kernels.device import SIMULATOR

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32256)   # the last leaves room for the steps and a tree
STEPS = 32                                          # tokens generated per measurement
BLOCK, BUDGET = 8, 32
ROOT_TOKEN = 1                                      # the first input token (the cache has no tokens)


def ar_rate(model, context: int, root: int) -> tuple[float, np.ndarray]:
    """Tokens/s of AR steps after ``context`` cached rows, and the tokens (the oracle's truth)."""
    model.set_sampling(0.0, 0)
    tokens = np.empty(STEPS, np.int64)
    for _ in range(2):                                           # the first pass captures the graph
        fill_context(model, context)
        model.graphs.upload(np.array([root], np.int64), model.buffers.tree.tokens[:1])
        begin = time.perf_counter()
        for _ in range(STEPS):
            model.ar_step(model.cache)
        tokens = model.graphs.download(model.buffers.generated[:STEPS])     # the one wait
        seconds = time.perf_counter() - begin
    return STEPS / seconds, tokens


def ddtree_rate(model, context: int, root: int, continuation: np.ndarray, drafter_kind) -> dict:
    """Tokens/s of DDTree rounds after ``context`` cached rows, drafting from ``continuation``."""
    sequence = np.concatenate([np.zeros(context, np.int64), [root], continuation])
    drafter = drafter_kind(sequence, model.config.vocab_size)
    for _ in range(2):                                           # the first pass captures the graphs
        fill_context(model, context)
        history = list(sequence[:context + 1])
        rounds, begin = 0, time.perf_counter()
        while len(history) - context - 1 < STEPS:
            block = min(BLOCK, STEPS - (len(history) - context - 1))
            record = engine_decode.ddtree_round(model, model.cache, np.array(history), drafter, block,
                                                BUDGET, None)
            history += [int(t) for t in record.tokens[record.accepted[1:]]] + [record.bonus]
            rounds += 1
        seconds = time.perf_counter() - begin
    made = np.array(history[context + 1:context + 1 + STEPS])
    if not np.array_equal(made, continuation[:STEPS]):
        raise AssertionError(f"context {context}: DDTree's tokens differ from AR's")
    return {"tokens_per_second": (len(history) - context - 1) / seconds, "rounds": rounds}


def attention_share(model, context: int) -> dict:
    """Device µs of the AR step's kernels, and attention's share of their sum."""
    fill_context(model, context)
    times, _ = kernel_times(model, 1)
    total = sum(times.values())
    attention = sum(v for label, v in times.items() if label.startswith("attention"))
    return {"kernels_us": total, "attention_us": attention, "attention_share": attention / total}


def sweep(name: str, contexts, log) -> dict:
    from kernels.bench.engine import preset_weights
    from kernels.model import Transformer

    model = Transformer(preset(name), preset_weights(name))
    root = ROOT_TOKEN
    rows = []
    for context in contexts:
        ar, continuation = ar_rate(model, context, root)
        row = {"context": context, "ar_tokens_per_second": ar}
        for label, kind in (("oracle", OracleDrafter), ("noisy", NoisyOracleDrafter)):
            row[f"ddtree_{label}"] = ddtree_rate(model, context, root, continuation, kind)
        row.update(attention_share(model, context))
        log(json.dumps(row))
        rows.append(row)
    return {"preset": name, "steps": STEPS, "block": BLOCK, "budget": BUDGET, "rows": rows}


def format_record(result: dict, header: list, command: str) -> str:
    lines = ["# The engine against context length", "", f"Command: `{command}`", ""]
    lines += [f"- {key}: {value}" for key, value in header]
    lines += ["", f"Preset {result['preset']}; the cache filled with random latents to each context; "
              f"{result['steps']} tokens per measurement after a warm-up pass; DDTree block "
              f"{result['block']}, budget {result['budget']}; attention's share from each kernel's "
              "device time in one AR step (events around each launch).", "",
              "<!-- --8<-- [start:sweep] -->",
              "| context | AR tok/s | DDTree oracle tok/s (rounds) | DDTree noisy tok/s (rounds) | "
              "AR step kernels µs | attention µs | attention share |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        oracle, noisy = r["ddtree_oracle"], r["ddtree_noisy"]
        lines.append(f"| {r['context']} | {r['ar_tokens_per_second']:.1f} | "
                     f"{oracle['tokens_per_second']:.1f} ({oracle['rounds']}) | "
                     f"{noisy['tokens_per_second']:.1f} ({noisy['rounds']}) | {r['kernels_us']:.0f} | "
                     f"{r['attention_us']:.0f} | {100 * r['attention_share']:.0f}% |")
    lines += ["<!-- --8<-- [end:sweep] -->", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench sweep",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--out", type=pathlib.Path, help="the markdown record (and its .json beside it)")
    args = parser.parse_args(argv)
    if SIMULATOR:
        parser.error("the sweep needs a GPU (NUMBA_ENABLE_CUDASIM=0)")
    contexts = [int(c) for c in args.contexts.split(",")]
    limit = preset(args.preset).max_position_embeddings - STEPS - BUDGET - 1
    if not contexts or min(contexts) < 1 or max(contexts) > limit:
        parser.error(f"--contexts must be in [1, {limit}] for {args.preset} (room for the steps and a tree)")
    command = "python -m kernels.bench sweep " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = sweep(args.preset, contexts, lambda text: print(text, file=sys.stderr, flush=True))
    header = versions()
    record = format_record(result, header, command)
    if args.out:
        args.out.write_text(record)
        args.out.with_suffix(".json").write_text(json.dumps({"header": header, "command": command,
                                                             "result": result}, indent=1))
    print(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
