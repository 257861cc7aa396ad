"""Command line: ``python -m ddtree demo`` runs AR and DDTree side by side on the trained model (its
tokenizer: text in and out; its block drafter), on a saved checkpoint or on a random model of a
preset, greedy or, with ``--temperature``, sampled (``--sample-seed`` keys the draws), and checks
that both emit the same tokens."""

from __future__ import annotations

import argparse
import inspect
import pathlib
import re
import sys
import types

import numpy as np

from ddtree.budget import check_cost_table, load_cost_table
from ddtree.config import PRESET_NAMES, preset
from ddtree.decode import (
    DEFAULT_BUDGET,
    budget_limit,
    check_block_size,
    check_prompt,
    check_topk,
    describe_round,
)
from ddtree.drafters import DRAFTER_FILE, DRAFTERS, TRAINED_DRAFTERS, check_seed, make_drafter
from ddtree.golden import DEFAULT_PROMPTS, WEIGHT_SEED, default_prompt
from ddtree.sampling import check_sampling_seed, check_temperature
from ddtree.text import (
    TRAINED,
    decode,
    encode,
    has_tokenizer,
    heldout_prompts,
    load_tokenizer,
    tokens_as_text,
)
from ddtree.tree import check_budget
from ddtree.weights import init_weights, load_pretrained, weights_nbytes

DESCRIPTION = ("Speculative decoding with draft trees (DDTree) on a DeepSeek-V3-style model. The demo "
               "command runs plain autoregressive (AR) decoding and DDTree side by side, on the trained "
               "model, a saved checkpoint or a random model of a preset, and checks that both emit the "
               "same tokens.")
BACKENDS = ("numpy", "numba")
DEMO_PRESETS = tuple(p for p in PRESET_NAMES if p in DEFAULT_PROMPTS)      # the ones with a golden prompt
# a random preset the demo cannot build (its weights would fill host memory), and where it runs instead
TOO_BIG = {
    "small": "the numba engine on a GPU runs it (python -m kernels.bench engine --presets small)",
    "kimi-k2.6": "it is shapes only, never built (the Kimi K2.6 at full scale page counts what it holds)",
}
QUICKEST = "--preset micro --tokens 4"


def load_backend(name: str) -> types.SimpleNamespace:
    """The model and decoders of ``name``: the numpy reference, or the numba engine (imported only
    when asked for, so the reference never loads numba); ``simulator``: the engine runs in numba's
    CUDA simulator."""
    simulator = False
    if name == "numba":
        from kernels import decode, device, model  # the kernels package picks GPU or simulator first

        simulator = device.SIMULATOR
    else:
        from ddtree import decode, model
    return types.SimpleNamespace(name=name, Transformer=model.Transformer, simulator=simulator,
                                 generate_ar=decode.generate_ar, generate_ddtree=decode.generate_ddtree)


def simulator_note(backend, config) -> str | None:
    """One line when the run will be slow: the engine in the simulator on a model larger than micro."""
    if not backend.simulator or weights_nbytes(config) <= weights_nbytes(preset("micro")):
        return None
    return ("note: no GPU, so the numba backend runs in numba's CUDA simulator (every CUDA thread a "
            f"Python thread): this run is expected to take minutes; use {QUICKEST} to try it")


def degenerate_note(args) -> str | None:
    """One line when the settings leave nothing to draft: every round is a plain AR step."""
    if args.block_size == 1:
        why = "--block-size 1 drafts no depth"
    elif args.budget == 0:
        why = "--budget 0 drafts no node"
    else:
        return None
    return (f"note: {why}: every round verifies the root alone and commits the target's own token, "
            "so DDTree runs plain AR steps (one token per verify forward)")


def budget_value(text: str):
    """--budget's value: ``auto`` or an integer (its range is ``check_budget``'s, with the model)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (the record commands' --prompts, --tokens, ...)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def budget_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated budgets >= 1, sorted, each once."""
    try:
        values = sorted({int(part) for part in text.split(",")})
    except ValueError:
        values = [0]
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return tuple(values)


def check_cost_table_flags(args, model, backend) -> None:
    """--budget auto takes its table from --cost-table; the engine on a GPU may time its own."""
    if args.budget != "auto":
        if args.cost_table is not None:
            raise ValueError(f"--cost-table: used only with --budget auto, got --budget {args.budget}")
        return
    if args.cost_table is None:
        if backend is not None and backend.name == "numba" and not backend.simulator:
            return                                               # timed at warm-up on the GPU
        raise ValueError("--cost-table: --budget auto needs --cost-table FILE (JSON: {\"ar_step\": seconds, "
                         "\"verify\": [seconds of budget 1, 2, ...], \"switch\": seconds (optional)}, as "
                         "ddtree.budget.save_cost_table writes it)")
    flagged("--cost-table", lambda: check_cost_table(load_cost_table(args.cost_table), *budget_limit(model)))


def check_preset(name: str) -> str:
    if name not in DEMO_PRESETS:
        gib = weights_nbytes(preset(name)) / 2**30
        where = TOO_BIG.get(name, "it has no golden prompt")
        raise ValueError(f"{name}'s random weights take {gib:.1f} GiB of float32, too many for this demo "
                         f"(which builds them in host memory); {where}. The demo takes "
                         f"{', '.join(DEMO_PRESETS)}")
    return name


def parse_prompt(text: str) -> np.ndarray:
    """Token ids separated by commas or spaces ("1,2,3" or "1 2 3")."""
    words = [w for w in re.split(r"[,\s]+", text.strip()) if w]
    if not words or not all(re.fullmatch(r"[+-]?\d+", w) for w in words):
        raise ValueError(f"the prompt must be token ids separated by commas or spaces (e.g. 5,17,42), "
                         f"got {text!r}")
    return np.array([int(w) for w in words], dtype=np.int64)


def load_checkpoint(directory: str):
    """(config, weights) of a checkpoint directory; errors say what is missing."""
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise ValueError(f"{directory}: no such directory (a checkpoint directory holds config.json and "
                         "model.safetensors, as ddtree.weights.save_pretrained writes them)")
    try:
        return load_pretrained(path)
    except FileNotFoundError as error:
        raise ValueError(str(error)) from None


def flagged(flag: str, check):
    """``check()``, its ValueError prefixed with ``flag``."""
    try:
        return check()
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def format_tokens(tokens) -> str:
    return " ".join(str(int(t)) for t in tokens)


def samples(backend) -> bool:
    """Whether the backend's decoders take ``temperature`` and ``seed``."""
    return all("temperature" in inspect.signature(decode).parameters
               for decode in (backend.generate_ar, backend.generate_ddtree))


def check_sampling_backend(backend, temperature) -> None:
    if temperature != 0 and not samples(backend):
        raise ValueError(f"the {backend.name} backend decodes greedily only (temperature 0), "
                         f"got {temperature!r}")


def sampling_options(args) -> dict:
    """The decoders' sampling arguments: none at temperature 0 (today's greedy calls)."""
    return {"temperature": args.temperature, "seed": args.sample_seed} if args.temperature else {}


def check_flags(args, model, prompt, backend=None) -> None:
    """Every flag that needs the model, before anything is decoded; an error names its flag."""
    limit = model.config.max_position_embeddings
    checks = [
        ("--prompt", lambda: check_prompt(model, prompt, 0)),
        ("--tokens", lambda: check_prompt(model, prompt, args.tokens)),
        ("--block-size", lambda: check_block_size(args.block_size, limit)),
        ("--budget", lambda: args.budget == "auto" or check_budget(args.budget, *budget_limit(model))),
        ("--topk", lambda: check_topk(args.topk)),
        ("--seed", lambda: check_seed(args.seed)),
        ("--temperature", lambda: check_temperature(args.temperature)),
        ("--sample-seed", lambda: check_sampling_seed(args.sample_seed)),
    ]
    if backend is not None:
        checks.append(("--temperature", lambda: check_sampling_backend(backend, args.temperature)))
    for flag, check in checks:
        flagged(flag, check)
    check_cost_table_flags(args, model, backend)


def text_prompt(args, tokenizer) -> tuple[np.ndarray, str]:
    """(prompt ids, where from) of a model with a tokenizer: --prompt as text, else the first
    held-out prompt (cut from a standard-library file the model never trained on)."""
    if args.prompt is not None:
        ids = encode(tokenizer, args.prompt)
        if ids.size == 0:
            raise ValueError("--prompt: the prompt must hold at least one token, got an empty text")
        return ids, "--prompt"
    first = heldout_prompts()[0]
    return encode(tokenizer, first["text"]), f"held-out file {first['file']}"


def has_drafter(checkpoint) -> bool:
    return checkpoint is not None and (pathlib.Path(checkpoint) / "drafter" / DRAFTER_FILE).is_file()


def chosen_drafter(args, checkpoint) -> str:
    """--drafter, else the trained block drafter where --drafter-dir or the model has one, else the
    oracle."""
    if args.drafter is not None:
        return args.drafter
    return "block" if args.drafter_dir is not None or has_drafter(checkpoint) else "oracle"


def drafter_directory(args, checkpoint) -> str | None:
    """--drafter-dir, else a trained drafter's default home: the checkpoint's drafter/ folder."""
    if chosen_drafter(args, checkpoint) not in TRAINED_DRAFTERS:
        if args.drafter_dir is not None:
            raise ValueError(f"--drafter-dir: read by --drafter {' or '.join(TRAINED_DRAFTERS)} only, "
                             f"got --drafter {chosen_drafter(args, checkpoint)}")
        return None
    if args.drafter_dir is not None:
        return args.drafter_dir
    if has_drafter(checkpoint):
        return str(pathlib.Path(checkpoint) / "drafter")
    raise ValueError(f"--drafter-dir: --drafter {chosen_drafter(args, checkpoint)} needs a drafter directory "
                     f"(with {DRAFTER_FILE}); none given and the model has no drafter/ folder")


def shown_path(path: pathlib.Path) -> str:
    """``path`` relative to the working directory where it lies below it (the README's run)."""
    here = pathlib.Path.cwd()
    return str(path.relative_to(here) if path.is_relative_to(here) else path)


def load_model(args) -> types.SimpleNamespace:
    """The demo's model: config, weights, prompt and where they come from, the tokenizer (None
    without one: prompts and output are token ids) and the trained drafter's directory, if any."""
    checkpoint = args.checkpoint
    if args.preset is None and checkpoint is None:
        checkpoint = shown_path(TRAINED)
    if checkpoint is not None:
        config, weights = flagged("--checkpoint", lambda: load_checkpoint(checkpoint))
        tokenizer = load_tokenizer(checkpoint) if has_tokenizer(checkpoint) else None
        source = f"checkpoint {checkpoint}"
    else:
        name = flagged("--preset", lambda: check_preset(args.preset))
        config, tokenizer, source = preset(name), None, f"preset {name}"
        weights = init_weights(config, WEIGHT_SEED)
    if tokenizer is not None:
        prompt, origin = text_prompt(args, tokenizer)
    elif args.prompt is not None:
        prompt, origin = flagged("--prompt", lambda: parse_prompt(args.prompt)), "--prompt"
    elif checkpoint is not None:
        raise ValueError("--prompt: a checkpoint without a tokenizer.json has no default prompt; give its "
                         "token ids (e.g. --prompt 5,17,42)")
    else:
        prompt, origin = default_prompt(args.preset), "the preset's golden prompt"
    return types.SimpleNamespace(config=config, weights=weights, prompt=prompt, source=source, origin=origin,
                                 tokenizer=tokenizer, drafter=chosen_drafter(args, checkpoint),
                                 drafter_dir=drafter_directory(args, checkpoint))


def show(tokens, tokenizer, show_ids: bool) -> str:
    """Tokens as the demo prints them: ids on one line, or the text indented under its line."""
    if tokenizer is None:
        return " " + format_tokens(tokens)
    text = "\n".join("    " + line for line in decode(tokenizer, tokens).split("\n"))
    return (f" {format_tokens(tokens)}" if show_ids else "") + "\n" + text


def run_demo(args) -> int:
    loaded = load_model(args)
    config, prompt, tokenizer = loaded.config, loaded.prompt, loaded.tokenizer
    backend = load_backend(args.backend)
    model = backend.Transformer(config, loaded.weights)
    check_flags(args, model, prompt, backend)
    for note in (simulator_note(backend, config), degenerate_note(args)):   # before the slow part
        if note:
            print(note, file=sys.stderr)
    print(f"model: {config.describe()}  ({loaded.source}, backend {backend.name})")
    if tokenizer is None:
        print(f"prompt({prompt.size}): {format_tokens(prompt)}")
    else:
        print(f"prompt ({prompt.size} tokens, {loaded.origin}):{show(prompt, tokenizer, args.ids)}")
    sampling = sampling_options(args)
    if sampling:
        print(f"sampling: temperature {args.temperature}, sample seed {args.sample_seed} (the token at "
              f"position p is drawn with the random numbers of (seed, p))")

    ar_tokens = backend.generate_ar(model, prompt, args.tokens, **sampling)
    ar_forwards = model.forward_count
    print(f"AR     ({ar_forwards} target forwards):{show(ar_tokens, tokenizer, args.ids)}")

    drafter = make_drafter(loaded.drafter, model, prompt, args.tokens, seed=args.seed, continuation=ar_tokens,
                           drafter_directory=loaded.drafter_dir)
    model.forward_count = 0
    if args.budget == "auto":
        sampling["budget"] = "auto"
        if args.cost_table is not None:
            sampling["cost_table"] = load_cost_table(args.cost_table)
    else:
        sampling["budget"] = args.budget
    tokens, trace = backend.generate_ddtree(model, prompt, args.tokens, drafter, block_size=args.block_size,
                                            topk=args.topk, **sampling)
    print(f"DDTree ({trace.verify_forwards} verify forwards + {trace.prefill_forwards} prefill; "
          f"drafter {loaded.drafter}, block {args.block_size}, budget {args.budget}"
          f"{'' if args.topk is None else f', topk {args.topk}'}):{show(tokens, tokenizer, args.ids)}")
    if args.budget == "auto":
        print(f"auto budget, round by round: {format_tokens(trace.budgets)} (0: an AR step)")
    if args.rounds:
        for i, r in enumerate(trace.rounds):
            words = None if tokenizer is None else (lambda ids: tokens_as_text(tokenizer, ids))
            print("\n".join("  " + line for line in describe_round(r, i, words)))
    print(f"tokens per verify forward: {trace.tokens_per_forward:.2f} "
          f"(AR: {args.tokens / max(ar_forwards, 1):.2f})")
    match = np.array_equal(tokens, ar_tokens)
    print(f"DDTree == AR: {'yes' if match else 'NO'}")
    return 0 if match else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddtree", description=DESCRIPTION,
                                     epilog="Options of the demo: python -m ddtree demo --help")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = sub.add_parser(
        "demo", help="run AR and DDTree side by side and check that they emit the same tokens",
        description="Run AR and DDTree side by side on the trained model (or a saved checkpoint, or "
                    "a random model of a preset) and check that they emit the same tokens. Every "
                    "option's default is shown; the default run is the one the README prints.")
    model = demo.add_mutually_exclusive_group()
    small_gib = weights_nbytes(preset("small")) / 2**30
    model.add_argument("--preset", default=None, choices=PRESET_NAMES, metavar="NAME",
                       help=f"a random model of a preset instead: {', '.join(DEMO_PRESETS)} (micro is "
                            f"the quickest); small is refused ({small_gib:.0f} GiB of weights: it runs in "
                            "the numba engine on a GPU, through python -m kernels.bench engine) and so is "
                            "kimi-k2.6 (shapes only) (default: none, the trained model)")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="a saved checkpoint directory: config.json + model.safetensors (or its shards), "
                            "as ddtree.weights.save_pretrained writes; with a tokenizer.json it speaks text "
                            f"(default: {TRAINED.relative_to(TRAINED.parents[1])}, the trained model)")
    demo.add_argument("--prompt", metavar="TEXT",
                      help="the prompt: text when the model has a tokenizer (a checkpoint with "
                           "tokenizer.json), else token ids separated by commas or spaces, e.g. 5,17,42 "
                           "(default: the first held-out prompt with a tokenizer, the preset's golden "
                           "prompt for a random preset)")
    demo.add_argument("--ids", action="store_true",
                      help="with a tokenizer, print the token ids beside the text (default: off)")
    demo.add_argument("--drafter", default=None, choices=DRAFTERS + TRAINED_DRAFTERS,
                      help="block: the trained block drafter (--drafter-dir); oracle: the target's own "
                           "continuation; noisy: it with seeded mistakes (trees branch); ngram: copies "
                           "what followed the context's suffix (default: block where the model has a "
                           "drafter/ folder, as the trained model does, else oracle)")
    demo.add_argument("--drafter-dir", metavar="DIR",
                      help="the block drafter's directory (config.json, model.safetensors, drafter.json) "
                           "(default: the checkpoint's drafter/ folder)")
    demo.add_argument("--block-size", type=int, default=8, metavar="N",
                      help="tokens a round can commit: N - 1 drafted depths + the bonus; 1 drafts nothing "
                           "(default: %(default)s)")
    demo.add_argument("--budget", type=budget_value, default=DEFAULT_BUDGET, metavar="B",
                      help="drafted tree nodes per round, 0 <= B <= the backend's limit; 0 drafts nothing; "
                           "auto: each round the size of the most tokens per second by --cost-table and "
                           "what the rounds so far committed, 0 (an AR step) when no tree pays "
                           "(default: %(default)s)")
    demo.add_argument("--cost-table", metavar="FILE",
                      help="with --budget auto: a JSON file {\"ar_step\": seconds, \"verify\": [seconds "
                           "of a round at budget 1, 2, ...], \"switch\": seconds (optional)} "
                           "(ddtree.budget.save_cost_table writes one); "
                           "the numba backend on a GPU times its own without it (default: none)")
    demo.add_argument("--topk", type=int, default=None, metavar="K",
                      help="candidates per depth; 1 is a single chain (default: as many as the budget "
                           "can use)")
    demo.add_argument("--tokens", type=int, default=24, metavar="N",
                      help="new tokens to generate (default: %(default)s)")
    demo.add_argument("--backend", default="numpy", choices=BACKENDS,
                      help="numpy: the reference; numba: the engine of kernels/model.py, on a GPU (without "
                           "one, numba's CUDA simulator: minutes, try " + QUICKEST.replace("%", "%%") +
                           ") (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0,
                      help="the oracle drafters' seed: their distractors, the noisy one's mistakes "
                           "(default: %(default)s)")
    demo.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="sampling temperature; 0 is greedy; the oracle drafters know the sampled tokens "
                           "(default: %(default)s)")
    demo.add_argument("--sample-seed", type=int, default=0, metavar="S",
                      help="the seed of the position-keyed sampling, with --temperature > 0 "
                           "(default: %(default)s)")
    demo.add_argument("--rounds", action="store_true",
                      help="print every DDTree round's tree, its accepted path and its bonus "
                           "(default: off)")
    demo.set_defaults(run=run_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
