"""Text in and out: a checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``) at run time.

Legend (docs/glossary.md): T rows (the tokens of a text), V vocab_size.

``tokens_as_text`` shows each token's text with one visible rule: a space is '·', a newline '⏎',
a tab '⇥', another control character its Unicode control picture ('␍', '␀', '␡'), every other
character itself; a token holding part of a multi-byte character
shows the replacement character '�'; a special token shows its name.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINED = ROOT / "checkpoints" / "tiny-code"             # the trained model (train/target.py)
HELDOUT_PROMPTS = ROOT / "corpus" / "prompts.json"       # prompts cut from held-out files (train/corpus.py)

TOKENIZER_FILE = "tokenizer.json"
# other control characters as their Unicode control pictures (U+2400 + code, U+2421 for DEL)
VISIBLE = str.maketrans({**{chr(code): chr(0x2400 + code) for code in range(32)}, "\x7f": "\u2421",
                         " ": "·", "\n": "⏎", "\t": "⇥"})


def heldout_prompts(path=HELDOUT_PROMPTS) -> list[dict]:
    """The held-out prompts: each {"file", "start", "text"}, in the committed order."""
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["prompts"]


def has_tokenizer(directory) -> bool:
    return (pathlib.Path(directory) / TOKENIZER_FILE).is_file()


def load_tokenizer(directory):
    """The ``tokenizers.Tokenizer`` of ``directory/tokenizer.json``."""
    from tokenizers import Tokenizer

    path = pathlib.Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"directory must hold a {TOKENIZER_FILE}: {path} does not exist")
    return Tokenizer.from_file(str(path))


def encode(tokenizer, text: str) -> np.ndarray:
    """Token ids (T,) int64 of ``text``; no special token is added."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)   # (T,)


def check_ids(tokenizer, ids) -> list[int]:
    ids = np.asarray(ids)
    vocab = tokenizer.get_vocab_size()
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"ids must be a 1-D integer sequence, got shape {ids.shape} dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"ids must lie in [0, V={vocab}), got min {ids.min()} max {ids.max()}")
    return [int(i) for i in ids]


def decode(tokenizer, ids) -> str:
    """The text of token ids (T,); special tokens appear by name."""
    return tokenizer.decode(check_ids(tokenizer, ids), skip_special_tokens=False)


def tokens_as_text(tokenizer, ids) -> list[str]:
    """Each token's readable text (T strings), by the module's visible rule."""
    return [tokenizer.decode([i], skip_special_tokens=False).translate(VISIBLE)
            for i in check_ids(tokenizer, ids)]
