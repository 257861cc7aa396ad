"""Command line: ``python -m ddtree demo`` runs AR and DDTree side by side on a random model,
greedy or, with ``--temperature``, sampled (``--sample-seed`` keys the draws)."""

from __future__ import annotations

import argparse
import inspect
import sys
import types

import numpy as np

from ddtree.config import PRESET_NAMES, preset
from ddtree.decode import DEFAULT_BUDGET, budget_limit, check_block_size, check_prompt, check_topk
from ddtree.drafters import DRAFTERS, check_seed, make_drafter
from ddtree.golden import DEFAULT_PROMPTS, WEIGHT_SEED, default_prompt
from ddtree.sampling import check_sampling_seed, check_temperature
from ddtree.tree import check_budget
from ddtree.weights import init_weights

BACKENDS = ("numpy", "numba")


SIMULATOR_NOTE = ("note: no GPU, so the kernels run in numba's CUDA simulator (every CUDA thread is a "
                  "Python thread): expect minutes; '--preset micro --tokens 4' is the quickest")


def load_backend(name: str) -> types.SimpleNamespace:
    """The model and decoders of ``name``: the numpy reference, or the numba engine (imported only
    when asked for, so the reference never loads numba); ``note`` says where the engine runs."""
    note = None
    if name == "numba":
        from kernels import decode, device, model  # the kernels package picks GPU or simulator first

        note = SIMULATOR_NOTE if device.SIMULATOR else None
    else:
        from ddtree import decode, model
    return types.SimpleNamespace(name=name, Transformer=model.Transformer, note=note,
                                 generate_ar=decode.generate_ar, generate_ddtree=decode.generate_ddtree)


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
    """Every flag, before anything is decoded; an error names its flag."""
    limit = model.config.max_position_embeddings
    checks = [
        ("--tokens", lambda: check_prompt(model, prompt, args.tokens)),
        ("--block-size", lambda: check_block_size(args.block_size, limit)),
        ("--budget", lambda: check_budget(args.budget, *budget_limit(model))),
        ("--topk", lambda: check_topk(args.topk)),
        ("--seed", lambda: check_seed(args.seed)),
        ("--temperature", lambda: check_temperature(args.temperature)),
        ("--sample-seed", lambda: check_sampling_seed(args.sample_seed)),
    ]
    if backend is not None:
        checks.append(("--temperature", lambda: check_sampling_backend(backend, args.temperature)))
    for flag, check in checks:
        try:
            check()
        except ValueError as error:
            raise ValueError(f"{flag}: {error}") from None


def run_demo(args) -> int:
    config = preset(args.preset)
    backend = load_backend(args.backend)
    if backend.note:
        print(backend.note, file=sys.stderr)
    model = backend.Transformer(config, init_weights(config, WEIGHT_SEED))
    prompt = default_prompt(args.preset)
    check_flags(args, model, prompt, backend)
    print(f"model: {config.describe()}  (preset {args.preset}, backend {backend.name})")
    print(f"prompt({prompt.size}): {format_tokens(prompt)}")
    sampling = sampling_options(args)
    if sampling:
        print(f"sampling: temperature {args.temperature}, sample seed {args.sample_seed} (the token at "
              f"position p is drawn with the random numbers of (seed, p))")

    ar_tokens = backend.generate_ar(model, prompt, args.tokens, **sampling)
    ar_forwards = model.forward_count
    print(f"AR     ({ar_forwards} target forwards): {format_tokens(ar_tokens)}")

    drafter = make_drafter(args.drafter, model, prompt, args.tokens, seed=args.seed, continuation=ar_tokens)
    model.forward_count = 0
    tokens, trace = backend.generate_ddtree(model, prompt, args.tokens, drafter, block_size=args.block_size,
                                    budget=args.budget, topk=args.topk, **sampling)
    print(f"DDTree ({trace.verify_forwards} verify forwards + {trace.prefill_forwards} prefill; "
          f"drafter {args.drafter}, block {args.block_size}, budget {args.budget}"
          f"{'' if args.topk is None else f', topk {args.topk}'}): {format_tokens(tokens)}")
    if args.rounds:
        for i, r in enumerate(trace.rounds):
            print(f"  round {i}: tree {r.tokens.size - 1} nodes, depth {int(r.depths.max())}, "
                  f"accepted {r.accepted.size - 1} + bonus {r.bonus} -> commits {r.committed}")
    print(f"tokens per verify forward: {trace.tokens_per_forward:.2f} "
          f"(AR: {args.tokens / max(ar_forwards, 1):.2f})")
    match = np.array_equal(tokens, ar_tokens)
    print(f"DDTree == AR: {'yes' if match else 'NO'}")
    return 0 if match else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="AR vs DDTree decoding (greedy or sampled) on a random tiny model")
    demo.add_argument("--preset", default="tiny", choices=[p for p in PRESET_NAMES if p in DEFAULT_PROMPTS])
    demo.add_argument("--drafter", default="oracle", choices=DRAFTERS)
    demo.add_argument("--block-size", type=int, default=8)
    demo.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    demo.add_argument("--topk", type=int, default=None, help="candidates per depth (1: single chain)")
    demo.add_argument("--tokens", type=int, default=24, help="new tokens to generate")
    demo.add_argument("--backend", default="numpy", choices=BACKENDS)
    demo.add_argument("--seed", type=int, default=0, help="drafter seed")
    demo.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature (0: greedy); the oracle drafters know the sampled tokens")
    demo.add_argument("--sample-seed", type=int, default=0,
                      help="the seed of the position-keyed sampling (with --temperature > 0)")
    demo.add_argument("--rounds", action="store_true", help="print one line per DDTree round")
    demo.set_defaults(run=run_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
