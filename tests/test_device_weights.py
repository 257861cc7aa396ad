"""kernels.weights: random weights made on the device (for presets too large for the host's
generator), checked on one small tensor in the simulator: deterministic, keyed by (seed, tensor),
and normal with the requested mean and spread."""

import warnings

import numpy as np

from kernels.device import cuda
from kernels.weights import TPB, normal_kernel


def draw(size: int, seed: int, tensor: int, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    out = cuda.to_device(np.full(size, np.nan, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)        # numpy's uint64 wrap in the simulator
        normal_kernel[(size + TPB - 1) // TPB, TPB](out, seed, tensor, mean, std)
    return out.copy_to_host()


def test_device_normals_are_keyed_and_normal():
    values = draw(1024, seed=0, tensor=3, mean=1.0, std=0.1)
    assert np.isfinite(values).all()                             # every element written
    assert np.array_equal(values, draw(1024, seed=0, tensor=3, mean=1.0, std=0.1))
    assert not np.array_equal(values, draw(1024, seed=0, tensor=4, mean=1.0, std=0.1))
    assert not np.array_equal(values, draw(1024, seed=1, tensor=3, mean=1.0, std=0.1))
    # 1024 draws: the sample mean is within 4 standard errors, the spread within 10%
    assert abs(values.mean() - 1.0) < 4 * 0.1 / 32
    assert abs(values.std() / 0.1 - 1.0) < 0.1
