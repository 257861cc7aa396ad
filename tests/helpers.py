"""Comparators and guards shared by the equivalence tests (numpy reference vs numba kernel)."""

from __future__ import annotations

import contextlib

import numpy as np

from kernels.bench.compare import assert_close, assert_exact  # noqa: F401  (the tests import them from here)
from kernels.device import cuda


@contextlib.contextmanager
def no_transfers():
    """Fail if anything inside the block allocates device memory or copies between host and device.

    Patches numba's allocation and copy entry points (``cuda.to_device``, ``cuda.device_array``,
    ``cuda.device_array_like`` and a device array's ``copy_to_host``): what a wrapper given device
    inputs and an ``out`` buffer must never call (a CUDA graph could not capture it).
    """
    array_type = type(cuda.to_device(np.zeros(1, np.float32)))
    calls = []

    def refuse(name):
        def refused(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called inside no_transfers()")
        return refused

    saved = [(cuda, name, getattr(cuda, name)) for name in ("to_device", "device_array", "device_array_like")]
    saved.append((array_type, "copy_to_host", array_type.copy_to_host))
    for owner, name, _ in saved:
        setattr(owner, name, refuse(name))
    try:
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    assert calls == [], f"device allocations or copies: {calls}"


def assert_ddtree_equals(decode, model, prompt, expected, label: str = "DDTree",
                         blocks=(2, 4, 8, 16), budgets=(0, 1, 5, 64)):
    """``decode.generate_ddtree`` (the numpy or the engine module) on ``model`` gives exactly
    ``expected`` for every drafter (each told the true continuation), block size and budget."""
    from ddtree.drafters import DRAFTERS, make_drafter

    for drafter_name in DRAFTERS:
        for block in blocks:
            for budget in budgets:
                drafter = make_drafter(drafter_name, model, prompt, expected.size, continuation=expected)
                tokens, _ = decode.generate_ddtree(model, prompt, expected.size, drafter, block_size=block,
                                                   budget=budget)
                where = f"{label}[{drafter_name}, block {block}, budget {budget}]"
                assert_exact(tokens, expected, name=where)


def save_text_checkpoint(directory, config, seed: int, drafter_layers: int = 2, window: int = 64,
                         max_depths: int = 15, drafter_seed: int | None = None):
    """A checkpoint laid out as checkpoints/tiny-code/ with random weights of ``config``: the
    committed tokenizer beside it and a random block drafter (``drafter_layers`` dense layers of
    the same dims) in drafter/; returns the directory."""
    import dataclasses
    import pathlib
    import shutil

    from ddtree.drafters import BlockDrafter, save_block_drafter
    from ddtree.text import TRAINED
    from ddtree.weights import init_weights, save_pretrained

    directory = pathlib.Path(directory)
    save_pretrained(directory, config, init_weights(config, seed))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TRAINED / name, directory / name)
    drafter_config = dataclasses.replace(config, num_hidden_layers=drafter_layers,
                                         first_k_dense_replace=drafter_layers)
    weights = init_weights(drafter_config, seed + 1 if drafter_seed is None else drafter_seed)
    save_block_drafter(directory / "drafter", BlockDrafter(drafter_config, weights, window, max_depths))
    return directory
