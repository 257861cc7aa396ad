"""Golden bundles: the prompt, the AR greedy tokens and the logits of every generated step.

Legend (docs/glossary.md): T rows (generated steps), V vocab_size.

    python -m ddtree.golden                 # (re)write tests/golden/<preset>.npz
    python -m ddtree.golden --check         # regenerate and compare with the committed bundles

Other implementations (the numba backend, the DDTree loop, an engine in another language) must
reproduce every token exactly. That is only fair if no step is a near-tie: each bundle records
``min_gap``, the smallest top-1 minus top-2 logit over the generated steps, and the default prompts
were picked (among 12 seeded random prompts per preset) for the largest min_gap, about 0.14 —
four orders of magnitude above the ~1e-5 float32 disagreement between implementations.

Beside the random presets, ``tiny-code`` is the trained model (``checkpoints/tiny-code``, read
with ``ddtree.weights.load_pretrained``) on one of the held-out prompts, picked the same way.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from ddtree.config import preset
from ddtree.decode import generate_ar
from ddtree.model import Transformer
from ddtree.text import TRAINED, encode, heldout_prompts, load_tokenizer
from ddtree.weights import init_weights, load_pretrained

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "golden"
GOLDEN_PRESETS = ("tiny", "tiny-b")               # random weights of a preset
TRAINED_NAME = "tiny-code"                         # the trained model ...
TRAINED_PROMPT = 0                                 # ... on this held-out prompt
GOLDEN_MODELS = GOLDEN_PRESETS + (TRAINED_NAME,)
NEW_TOKENS = 24
WEIGHT_SEED = 0
MIN_GAP_FLOOR = 1e-2       # a bundle with a closer race than this is refused

DEFAULT_PROMPTS = {
    "tiny": [309, 194, 397, 182, 458, 382, 313, 199],
    "tiny-b": [113, 72, 223, 98, 108, 189, 333, 253],
    "micro": [5, 17, 42, 8, 63, 29],
}


def default_prompt(name: str) -> np.ndarray:
    if name not in DEFAULT_PROMPTS:
        raise ValueError(f"no default prompt for preset {name!r}; expected one of {sorted(DEFAULT_PROMPTS)}")
    return np.array(DEFAULT_PROMPTS[name], dtype=np.int64)


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row of (T, V)."""
    top = np.sort(logits, axis=-1)[:, -2:]                       # [T, 2]
    return top[:, 1] - top[:, 0]


def golden_model(name: str):
    """(config, weights) of a golden model: a preset's random weights, or the trained checkpoint."""
    if name == TRAINED_NAME:
        return load_pretrained(TRAINED)
    config = preset(name)
    return config, init_weights(config, WEIGHT_SEED)


def golden_prompt(name: str) -> np.ndarray:
    """The golden prompt's token ids: a preset's default prompt, or the trained model's held-out one."""
    if name == TRAINED_NAME:
        return encode(load_tokenizer(TRAINED), heldout_prompts()[TRAINED_PROMPT]["text"])
    return default_prompt(name)


def make_bundle(name: str) -> dict[str, np.ndarray]:
    model = Transformer(*golden_model(name))
    prompt = golden_prompt(name)
    tokens, logits = generate_ar(model, prompt, NEW_TOKENS, return_logits=True)
    return {"preset": np.array(name), "seed": np.array(WEIGHT_SEED), "prompt": prompt,
            "tokens": tokens, "logits": logits.astype(np.float32),
            "min_gap": np.array(top2_gap(logits).min(), dtype=np.float32)}


def bundle_path(name: str, directory=GOLDEN_DIR) -> pathlib.Path:
    return pathlib.Path(directory) / f"{name}.npz"


def load_bundle(name: str, directory=GOLDEN_DIR) -> dict[str, np.ndarray]:
    path = bundle_path(name, directory)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no golden bundle (write them with python -m ddtree.golden)")
    try:
        with np.load(path) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"{path}: not a readable golden bundle ({error})") from None


def compare(fresh: dict, stored: dict, rtol: float = 1e-4) -> list[str]:
    """Differences between two bundles, as readable lines (empty when they agree)."""
    problems = []
    for key in ("prompt", "tokens"):
        if not np.array_equal(fresh[key], stored[key]):
            problems.append(f"{key}: {fresh[key].tolist()} != {stored[key].tolist()}")
    scale = float(np.abs(stored["logits"]).max())
    diff = float(np.abs(fresh["logits"] - stored["logits"]).max()) if \
        fresh["logits"].shape == stored["logits"].shape else np.inf
    if diff > rtol * scale:
        problems.append(f"logits: max |diff| {diff:.3g} > {rtol} * max|logit| {scale:.3g}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.golden", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--dir", default=str(GOLDEN_DIR), help="bundle directory")
    args = parser.parse_args(argv)
    if args.check and not pathlib.Path(args.dir).is_dir():
        print(f"error: --dir {args.dir}: no such directory", file=sys.stderr)
        return 2
    failed = False
    for name in GOLDEN_MODELS:
        if args.check:
            try:
                stored = load_bundle(name, args.dir)
            except (FileNotFoundError, ValueError) as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
        bundle = make_bundle(name)
        gap = float(bundle["min_gap"])
        line = f"{name}: {bundle['tokens'].size} tokens, min top-1/top-2 gap {gap:.4f}"
        if args.check:
            problems = compare(bundle, stored)
            failed |= bool(problems)
            print(line, "OK" if not problems else "MISMATCH\n  " + "\n  ".join(problems))
            continue
        if gap < MIN_GAP_FLOOR:
            print(f"{line}: below the floor {MIN_GAP_FLOOR}, not written", file=sys.stderr)
            return 1
        path = bundle_path(name, args.dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **bundle)
        print(f"{line} -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
