"""Held-out bits per byte of models that need no training run, for the trained model to beat.

    python -m train.baselines [--corpus .corpus]     # prints a table, writes .corpus/baselines.json

- unigram: the tokenizer's tokens counted on ``train.npy`` (separators included), add-one
  smoothed over the vocabulary, scoring ``heldout.npy[1:]``: the targets a language model
  reading the array as one stream predicts (each later ``<|endoftext|>`` is the target that ends
  the document before it; the first is only read).
- xz, concatenated: ``lzma`` with ``preset=9 | PRESET_EXTREME`` (what ``xz -9e`` does) over the
  held-out files' bytes concatenated in manifest order.
- xz, per file: each held-out file compressed alone, sizes summed (each pays the .xz container's
  header and footer, and none learns from another).

Every number divides by the held-out documents' UTF-8 bytes (``corpus.json``), separators not
counted, as the training's bits per byte do.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import pathlib

import numpy as np

from ddtree.config import preset
from train import corpus

XZ_PRESET = 9 | lzma.PRESET_EXTREME


def unigram_bits(train_tokens: np.ndarray, heldout_tokens: np.ndarray, vocab_size: int) -> float:
    """Bits of ``heldout_tokens[1:]`` under the add-one smoothed unigram of ``train_tokens``."""
    for name, tokens in (("train_tokens", train_tokens), ("heldout_tokens", heldout_tokens)):
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got max {tokens.max()}")
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)         # (V,)
    log2_p = np.log2(counts + 1) - math.log2(train_tokens.size + vocab_size)            # (V,)
    return float(-log2_p[heldout_tokens[1:].astype(np.int64)].sum())


def xz_bits(documents: list[bytes], per_file: bool) -> int:
    """Bits of the .xz stream(s) of ``documents``: one stream of their concatenation, or one per
    document summed."""
    if per_file:
        return 8 * sum(len(lzma.compress(data, preset=XZ_PRESET)) for data in documents)
    return 8 * len(lzma.compress(b"".join(documents), preset=XZ_PRESET))


def baselines(corpus_dir: pathlib.Path, root: pathlib.Path, vocab_size: int,
              manifest: pathlib.Path = corpus.MANIFEST) -> dict:
    corpus_dir = pathlib.Path(corpus_dir)
    summary = json.loads((corpus_dir / "corpus.json").read_text())
    heldout_bytes = summary["heldout"]["bytes"]
    documents = [(pathlib.Path(root) / relative).read_bytes()
                 for relative in corpus.require_heldout(root, manifest)]
    if sum(map(len, documents)) != heldout_bytes:
        raise RuntimeError(f"the held-out files under {root} hold {sum(map(len, documents))} bytes, "
                           f"{corpus_dir / 'corpus.json'} says {heldout_bytes}: pre-tokenize again")
    train = np.load(corpus_dir / "train.npy")
    heldout = np.load(corpus_dir / "heldout.npy")
    return {"python": summary["python"], "tokenizer_sha256": summary["tokenizer_sha256"],
            "heldout_bytes": heldout_bytes, "heldout_tokens": summary["heldout"]["tokens"],
            "bits_per_byte": {
                "unigram": unigram_bits(train, heldout, vocab_size) / heldout_bytes,
                "xz -9e, concatenated": xz_bits(documents, per_file=False) / heldout_bytes,
                "xz -9e, per file": xz_bits(documents, per_file=True) / heldout_bytes}}


def table(result: dict) -> str:
    lines = ["| held-out model | bits per byte |", "|---|---:|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in result["bits_per_byte"].items()]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.baselines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=pathlib.Path, default=pathlib.Path(".corpus"),
                        help="the pre-tokenized corpus (python -m train.corpus --out)")
    parser.add_argument("--root", type=pathlib.Path, default=corpus.stdlib_root(),
                        help="the standard library")
    parser.add_argument("--vocab-size", type=int, default=preset("tiny").vocab_size)
    args = parser.parse_args(argv)
    result = baselines(args.corpus, args.root, args.vocab_size)
    (args.corpus / "baselines.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"\n{result['heldout_tokens']} held-out tokens over {result['heldout_bytes']} bytes; "
          f"wrote {args.corpus / 'baselines.json'}")


if __name__ == "__main__":
    main()
