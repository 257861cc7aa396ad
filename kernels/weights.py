"""Random weights made on the device: the twin of ``ddtree.weights.init_weights`` for large presets.

``ddtree.weights.init_weights`` draws from numpy's generator on the host: fine for tiny models, minutes for
``small`` (4.8 G floats, ~19 GB). This module draws the same kind of values (the same tensor names, shapes and
scales: unit-variance embeddings, fan-in scaled projections, norms near 1, a small router bias) on the GPU,
from a counter-based generator, in seconds. The values differ from numpy's (another generator); they are a
function of (seed, tensor, index) alone, so they are the same on every run and every GPU.

Generator: splitmix64 of (seed, tensor number, element index) gives 64 random bits; two 24-bit
uniforms from them feed a Box-Muller transform (float32). One thread per element.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint64

from ddtree.config import ModelConfig
from ddtree.weights import LM_HEAD_GAIN, NORM_JITTER, ROUTER_BIAS_STD, weight_shapes
from kernels.blocks import blocks

TPB = 256


@cuda.jit(device=True)
def splitmix64(x):
    """The splitmix64 finaliser: 64 well-mixed bits from a 64-bit counter (wrapping arithmetic)."""
    x = x + uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> uint64(27))) * uint64(0x94D049BB133111EB)
    return x ^ (x >> uint64(31))


@cuda.jit
def normal_kernel(flat, seed, tensor, mean, std):
    # one thread per element i of a flat view: flat[i] = mean + std * N(0, 1)
    i = cuda.grid(1)
    if i >= flat.size:
        return
    bits = splitmix64(splitmix64(uint64(seed) * uint64(0x100000001B3) + uint64(tensor)) + uint64(i))
    u1 = (float32(bits >> uint64(40)) + float32(1.0)) / float32(16777217.0)   # (0, 1]: log is finite
    u2 = float32((bits >> uint64(16)) & uint64(0xFFFFFF)) / float32(16777216.0)
    z = math.sqrt(float32(-2.0) * math.log(u1)) * math.cos(float32(2.0 * math.pi) * u2)
    flat[i] = float32(mean) + float32(std) * z


def init_weights(config: ModelConfig, seed: int = 0) -> dict:
    """Device float32 weights keyed by Hugging Face names (``ddtree.weights.weight_shapes``)."""
    weights = {}
    for number, (name, shape) in enumerate(weight_shapes(config).items()):
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            mean, std = 1.0, NORM_JITTER
        elif name.endswith("e_score_correction_bias"):
            mean, std = 0.0, ROUTER_BIAS_STD
        elif name == "model.embed_tokens.weight":
            mean, std = 0.0, 1.0
        else:
            gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
            mean, std = 0.0, gain / math.sqrt(shape[1])
        array = cuda.device_array(shape, np.float32)
        normal_kernel[blocks(array.size, TPB), TPB](array.reshape(array.size), seed, number, mean, std)
        weights[name] = array
    return weights
