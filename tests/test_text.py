"""Text in and out (ddtree.text) with the committed tokenizer (checkpoints/tiny-code), and its
training (train.tokenizer): special ids, round trips of the committed prompts, determinism,
the transformers view of the same files (skipped without transformers), and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddtree.drafters import END_OF_TEXT, MASK, PAD
from ddtree.text import decode, encode, has_tokenizer, heldout_prompts, load_tokenizer, tokens_as_text
from train import corpus
from train.tokenizer import SPECIAL_TOKENS, train_tokenizer

DIRECTORY = corpus.TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DIRECTORY)


def test_the_committed_tokenizer_has_the_contracts_special_ids(tokenizer):
    assert tokenizer.get_vocab_size() == 512
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [END_OF_TEXT, PAD, MASK]
    assert [tokenizer.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|pad|>", "<|mask|>"]
    saved = json.loads((DIRECTORY / "tokenizer.json").read_text())
    assert saved["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                      "use_regex": True}
    assert saved["model"]["type"] == "BPE" and saved["decoder"]["type"] == "ByteLevel"


def test_the_committed_config_names_the_fast_tokenizer_and_its_specials():
    config = json.loads((DIRECTORY / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["mask_token"]) == \
        ("<|endoftext|>", "<|endoftext|>", "<|pad|>", "<|mask|>")
    assert config["model_max_length"] == 4096


@pytest.mark.parametrize("index", range(corpus.PROMPT_COUNT))
def test_every_committed_prompt_round_trips(tokenizer, index):
    text = heldout_prompts()[index]["text"]
    ids = encode(tokenizer, text)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert 3 <= ids.min() and ids.max() < 512                     # no special token inside code
    assert len(ids) < len(text.encode("utf-8"))                    # the merges compress
    assert decode(tokenizer, ids) == text


def test_round_trips_beyond_ascii_and_with_special_tokens(tokenizer):
    text = "naïve = 'µ∑😀'\r\n\tpass  # ☃\n"
    assert decode(tokenizer, encode(tokenizer, text)) == text
    assert decode(tokenizer, [END_OF_TEXT, *encode(tokenizer, "x")]) == "<|endoftext|>x"
    assert encode(tokenizer, "").shape == (0,) and decode(tokenizer, []) == ""


def test_tokens_as_text_shows_spaces_newlines_and_tabs(tokenizer):
    text = "def f(a, b):\n\treturn a  + b\n"
    ids = encode(tokenizer, text)
    shown = tokens_as_text(tokenizer, ids)
    assert len(shown) == len(ids)
    assert "".join(shown) == "def·f(a,·b):⏎⇥return·a··+·b⏎"
    assert tokens_as_text(tokenizer, [MASK, PAD]) == ["<|mask|>", "<|pad|>"]
    assert set(tokens_as_text(tokenizer, encode(tokenizer, "😀"))) == {"�"}      # bytes of one character
    assert "".join(tokens_as_text(tokenizer, encode(tokenizer, "a\r\n\x00\x7f"))) == "a␍⏎␀␡"


def test_text_helpers_refuse_bad_input_by_name(tokenizer, tmp_path):
    assert has_tokenizer(DIRECTORY) and not has_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(tmp_path)
    with pytest.raises(TypeError, match="text must be a str"):
        encode(tokenizer, b"bytes")
    with pytest.raises(ValueError, match=r"ids must lie in \[0, V=512\)"):
        decode(tokenizer, [5, 512])
    with pytest.raises(ValueError, match="ids must lie in"):
        tokens_as_text(tokenizer, [-1])
    with pytest.raises(ValueError, match="ids must be a 1-D integer sequence"):
        decode(tokenizer, [[1, 2]])
    with pytest.raises(ValueError, match="ids must be a 1-D integer sequence"):
        decode(tokenizer, [1.5])


SMALL = [prompt["text"] for prompt in heldout_prompts()] + ["x = 'héllo'\n" * 5, "\tpass\r\n"]


def test_training_is_deterministic_and_puts_the_specials_first():
    first, second = (train_tokenizer(SMALL, vocab_size=300) for _ in range(2))
    assert first.to_str(pretty=True) == second.to_str(pretty=True)
    assert first.get_vocab_size() == 300
    assert [first.token_to_id(token) for token in SPECIAL_TOKENS] == [END_OF_TEXT, PAD, MASK]
    reordered = train_tokenizer(SMALL[::-1], vocab_size=300)
    assert reordered.decode(reordered.encode(SMALL[0]).ids) == SMALL[0]
    with pytest.raises(ValueError, match="vocab_size must be an integer of at least 259"):
        train_tokenizer(SMALL, vocab_size=258)


def test_transformers_auto_tokenizer_reads_the_same_tokenizer(tokenizer):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(DIRECTORY))
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, auto.mask_token_id) == \
        (END_OF_TEXT, END_OF_TEXT, PAD, MASK)
    for prompt in heldout_prompts()[:4]:
        ids = auto(prompt["text"])["input_ids"]
        assert ids == encode(tokenizer, prompt["text"]).tolist()
        assert auto.decode(ids) == prompt["text"]
