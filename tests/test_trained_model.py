"""The committed trained model (checkpoints/tiny-code) and its block drafter: they load, the numpy
reference reproduces the golden bundle with every drafter, transformers gives the same greedy
tokens (where torch and transformers import), the engine too (on a GPU), and the training record
is what its files say."""

import json
import pathlib

import pytest

from ddtree import golden
from ddtree.config import preset
from ddtree.decode import generate_ddtree
from ddtree.drafters import END_OF_TEXT, MASK, PAD, load_block_drafter, make_drafter
from ddtree.model import Transformer
from ddtree.text import TRAINED, decode, load_tokenizer
from tests.helpers import assert_exact

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRAFTER = TRAINED / "drafter"


@pytest.fixture(scope="module")
def trained():
    config, weights = golden.golden_model(golden.TRAINED_NAME)
    return Transformer(config, weights), golden.load_bundle(golden.TRAINED_NAME)


def test_the_trained_model_has_tiny_dimensions_and_the_tokenizers_vocabulary():
    config, _ = golden.golden_model(golden.TRAINED_NAME)
    assert config == preset("tiny")
    tokenizer = load_tokenizer(TRAINED)
    assert tokenizer.get_vocab_size() == config.vocab_size
    specials = [tokenizer.id_to_token(i) for i in (END_OF_TEXT, PAD, MASK)]
    assert specials == ["<|endoftext|>", "<|pad|>", "<|mask|>"]
    drafter = load_block_drafter(DRAFTER)
    assert drafter.vocab_size == config.vocab_size and drafter.max_depths >= 7


def test_the_golden_continuation_is_text(trained):
    """The trained model writes printable Python-like text after its held-out prompt."""
    _, bundle = trained
    text = decode(load_tokenizer(TRAINED), bundle["tokens"])
    assert text.isprintable() or set(text) - set(text.strip()) <= {"\n", " ", "\t"}
    assert sum(ch.isalpha() for ch in text) > len(text) / 3, text


@pytest.mark.parametrize("drafter_name", ["block", "ngram", "noisy"])
@pytest.mark.parametrize("block_size, budget", [(4, 3), (8, 16), (8, 32), (16, 8)])
def test_ddtree_with_every_drafter_equals_the_golden_tokens(trained, drafter_name, block_size, budget):
    model, bundle = trained
    prompt, expected = bundle["prompt"], bundle["tokens"]
    if drafter_name == "block" and block_size - 1 > load_block_drafter(DRAFTER).max_depths:
        pytest.skip("deeper than the drafter was trained for")
    drafter = make_drafter(drafter_name, model, prompt, expected.size, continuation=expected,
                           drafter_directory=DRAFTER if drafter_name == "block" else None)
    tokens, trace = generate_ddtree(model, prompt, expected.size, drafter, block_size=block_size,
                                    budget=budget)
    assert_exact(tokens, expected, name=f"{drafter_name} block {block_size} budget {budget}")
    assert trace.committed_tokens == expected.size


def test_the_training_record_is_rendered_from_the_committed_files():
    from train.record import render

    assert (ROOT / "docs" / "results" / "training.md").read_text(encoding="utf-8") == \
        render(TRAINED, ROOT / "corpus")
    record = json.loads((TRAINED / "training.json").read_text())
    assert record["heldout"]["bits_per_byte"] < record["heldout"]["unigram_bits_per_byte"]


def test_transformers_gives_the_same_greedy_tokens(trained):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kernels.bench.trained import transformers_tokens

    _, bundle = trained
    (produced,), _ = transformers_tokens((torch, transformers), TRAINED, [bundle["prompt"]],
                                         bundle["tokens"].size)
    assert_exact(produced, bundle["tokens"], name="transformers greedy tokens")


@pytest.mark.gpu
def test_the_engine_reproduces_the_golden_tokens_with_the_block_drafter_on_the_device():
    from kernels import decode as engine_decode
    from kernels.model import Transformer as EngineTransformer

    config, weights = golden.golden_model(golden.TRAINED_NAME)
    bundle = golden.load_bundle(golden.TRAINED_NAME)
    model = EngineTransformer(config, weights)
    prompt, expected = bundle["prompt"], bundle["tokens"]
    assert_exact(engine_decode.generate_ar(model, prompt, expected.size), expected)
    drafter = make_drafter("block", model, prompt, expected.size, drafter_directory=DRAFTER)
    assert model.drafts_on_device(drafter)
    for budget in (4, 16, 32):
        tokens, _ = engine_decode.generate_ddtree(model, prompt, expected.size, drafter, block_size=8,
                                                  budget=budget)
        assert_exact(tokens, expected, name=f"engine, block drafter, budget {budget}")
