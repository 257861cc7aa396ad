"""The tiny-code tokenizer: byte-level BPE (Hugging Face ``tokenizers``) trained on the corpus's
train split only, vocab 512 (tiny's ``vocab_size``).

    python -m train.tokenizer      # checkpoints/tiny-code/tokenizer.json, tokenizer_config.json

Special tokens come first, so ``<|endoftext|>``, ``<|pad|>``, ``<|mask|>`` get ids 0, 1, 2
(``ddtree.drafters``), then the 256 byte symbols, then the merges. The same texts in the same
order give the same bytes of ``tokenizer.json``. ``tokenizer_config.json`` names
``PreTrainedTokenizerFast``: transformers maps ``deepseek_v3`` to the Llama tokenizer otherwise,
whose Metaspace pre-tokenizer breaks byte-level BPE.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ddtree.config import preset
from ddtree.drafters import END_OF_TEXT, MASK, PAD
from train import corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|mask|>")        # ids 0, 1, 2


def train_tokenizer(texts, vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts`` (an iterable of str)."""
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an integer of at least {minimum} (specials and bytes), "
                         f"got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    assert ids == [END_OF_TEXT, PAD, MASK], f"special token ids {ids}, expected {[END_OF_TEXT, PAD, MASK]}"
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL_TOKENS[END_OF_TEXT], "eos_token": SPECIAL_TOKENS[END_OF_TEXT],
            "pad_token": SPECIAL_TOKENS[PAD], "mask_token": SPECIAL_TOKENS[MASK],
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False}     # a clean-up would change decoded code's spaces


def save(tokenizer: Tokenizer, directory: pathlib.Path, model_max_length: int) -> None:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=1) + "\n", encoding="utf-8")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=corpus.stdlib_root(),
                        help="the standard library")
    parser.add_argument("--out", type=pathlib.Path, default=corpus.TOKENIZER_DIR)
    args = parser.parse_args(argv)
    tiny = preset("tiny")
    train, _, _ = corpus.split(args.root)
    texts = [corpus.read_text(args.root / relative) for relative in train]
    save(train_tokenizer(texts, tiny.vocab_size), args.out, tiny.max_position_embeddings)
    print(f"trained on {len(train)} train files; wrote {args.out}/tokenizer.json and tokenizer_config.json")


if __name__ == "__main__":
    main()
