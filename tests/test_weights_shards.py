"""Sharded checkpoints the Hugging Face way: ``save_pretrained(..., max_shard_bytes)`` and
``load_pretrained`` reading either layout, with errors that name the file."""

import json
import math

import numpy as np
import pytest

from ddtree.config import preset
from ddtree.weights import (
    SHARD_INDEX,
    SINGLE_FILE,
    init_weights,
    load_pretrained,
    plan_shards,
    save_pretrained,
    shard_name,
    weight_shapes,
    weights_nbytes,
)
from tests.helpers import assert_exact


@pytest.fixture(scope="module")
def tiny_b():
    config = preset("tiny-b")
    return config, init_weights(config, seed=3)


def tensor_bytes(config, name):
    return 4 * math.prod(weight_shapes(config)[name])


def test_small_limit_gives_hf_shards_that_load_back(tmp_path, tiny_b):
    config, weights = tiny_b
    limit = weights_nbytes(config) // 3 + 1                    # not a multiple of any tensor size
    save_pretrained(tmp_path, config, weights, max_shard_bytes=limit)
    index = json.loads((tmp_path / SHARD_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count >= 3
    assert files == [shard_name(i, count) for i in range(1, count + 1)]
    assert files[0] == f"model-00001-of-{count:05d}.safetensors"
    assert not (tmp_path / SINGLE_FILE).exists()
    assert index["metadata"]["total_size"] == weights_nbytes(config)
    assert list(index["weight_map"]) == list(weight_shapes(config))
    for file in files:
        names = [n for n, f in index["weight_map"].items() if f == file]
        size = sum(tensor_bytes(config, n) for n in names)
        assert size <= limit or len(names) == 1, file
        assert (tmp_path / file).stat().st_size < size + 64 * 1024       # tensors plus a header
    loaded_config, loaded = load_pretrained(tmp_path)
    assert loaded_config == config and sorted(loaded) == sorted(weights)
    for name, value in weights.items():
        assert_exact(loaded[name], value, name=name)


def test_no_limit_or_a_large_one_writes_one_file(tmp_path, tiny_b):
    config, weights = tiny_b
    save_pretrained(tmp_path / "a", config, weights, max_shard_bytes=weights_nbytes(config))
    save_pretrained(tmp_path / "b", config, weights)
    for directory in (tmp_path / "a", tmp_path / "b"):
        assert (directory / SINGLE_FILE).is_file() and not (directory / SHARD_INDEX).exists()
        assert_exact(load_pretrained(directory)[1]["lm_head.weight"], weights["lm_head.weight"])


def test_plan_shards_keeps_order_and_isolates_an_oversized_tensor():
    config = preset("micro")
    names = list(weight_shapes(config))
    largest = max(tensor_bytes(config, n) for n in names)
    shards = plan_shards(config, largest - 1)                 # the largest tensors exceed the limit
    assert [n for shard in shards for n in shard] == names
    for shard in shards:
        if sum(tensor_bytes(config, n) for n in shard) > largest - 1:
            assert len(shard) == 1
    assert plan_shards(config, None) == [names]
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes must be None or a positive integer"):
            plan_shards(config, bad)


def test_resaving_removes_the_other_layout(tmp_path, tiny_b):
    config, weights = tiny_b
    save_pretrained(tmp_path, config, weights, max_shard_bytes=weights_nbytes(config) // 2)
    assert (tmp_path / SHARD_INDEX).is_file()
    save_pretrained(tmp_path, config, weights)
    assert not (tmp_path / SHARD_INDEX).exists() and not list(tmp_path.glob("model-*-of-*"))
    save_pretrained(tmp_path, config, weights, max_shard_bytes=weights_nbytes(config) // 2)
    assert not (tmp_path / SINGLE_FILE).exists()


@pytest.fixture
def sharded(tmp_path, tiny_b):
    config, weights = tiny_b
    save_pretrained(tmp_path, config, weights, max_shard_bytes=weights_nbytes(config) // 3 + 1)
    return tmp_path, json.loads((tmp_path / SHARD_INDEX).read_text())


def test_a_missing_shard_is_named(sharded):
    directory, index = sharded
    second = sorted(set(index["weight_map"].values()))[1]
    (directory / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"{second}: no such file"):
        load_pretrained(directory)


def test_a_tensor_missing_from_the_map_is_named(sharded):
    directory, index = sharded
    name = "model.layers.1.self_attn.o_proj.weight"
    file = index["weight_map"].pop(name)
    (directory / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{file}: holds 1 tensor.*missing from.*{name}"):
        load_pretrained(directory)


def test_a_tensor_the_map_places_in_the_wrong_shard_is_named(sharded):
    directory, index = sharded
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[1])
    index["weight_map"][name] = files[0]
    (directory / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{files[0]}: lacks 1 tensor.*{name}"):
        load_pretrained(directory)


def test_a_broken_index_is_named(sharded):
    directory, _ = sharded
    (directory / SHARD_INDEX).write_text("{not json")
    with pytest.raises(ValueError, match=f"{SHARD_INDEX}: not valid JSON"):
        load_pretrained(directory)
    (directory / SHARD_INDEX).write_text(json.dumps({"weight_map": [1, 2]}))
    with pytest.raises(ValueError, match="weight_map"):
        load_pretrained(directory)
    (directory / SHARD_INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(ValueError, match="must be a file name in the same directory"):
        load_pretrained(directory)


def test_a_shard_with_a_wrong_tensor_fails_the_weight_check(sharded, tiny_b):
    from safetensors.numpy import load_file, save_file

    directory, index = sharded
    config, _ = tiny_b
    file = index["weight_map"]["lm_head.weight"]
    tensors = load_file(str(directory / file))
    tensors["lm_head.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, str(directory / file))
    with pytest.raises(ValueError, match=f"{SHARD_INDEX}: .*lm_head.weight.*shape"):
        load_pretrained(directory)


def test_transformers_loads_the_shards(tmp_path, tiny_b):
    """transformers reads the index and every shard (load_hf asserts no missing key) and gives
    the numpy model's logits."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ddtree.model import Transformer
    from tests.test_transformers_crosscheck import compare_logits, fixed_prompt, hf_logits, load_hf

    config, weights = tiny_b
    save_pretrained(tmp_path, config, weights, max_shard_bytes=weights_nbytes(config) // 3 + 1)
    prompt = fixed_prompt(config)
    compare_logits(hf_logits(load_hf(tmp_path), prompt), Transformer(config, weights).logits(prompt),
                   "tiny-b sharded")
