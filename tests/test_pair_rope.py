"""Equivalence: kernels/rope.py (numba.cuda) against ddtree/rope.py (numpy).

Tolerance: both sides form the angle float32(position) * inv_freq[i] with one float32 multiply,
so the angles are bit-identical at any position. cos and sin of the same float32 angle, from two
accurate implementations (numpy's float32 SIMD/libm, CUDA's cosf/sinf with full range
reduction, the simulator's float64 math.cos rounded), differ by an ulp or two of a value <= 1:
~2.4e-7 absolute, whatever the angle's size. Each output x1*c - x2*s (a fused multiply-add on the
GPU) adds about one ulp of |x| * scale. So rtol 1e-5 with atol = 1e-6 * max|x| * scale.

What that tolerance would NOT absorb is a different angle: test_float32_angles_are_the_contract
shows that float64 angles move the result by up to |angle| * 2^-24 * (|x1| + |x2|), far beyond
1e-6 at positions in the thousands (angles near 262143 move by up to 8e-3 rad).
"""

import numpy as np
import pytest
from numba import cuda

from ddtree import rope as reference
from ddtree.config import preset
from kernels import device
from kernels import rope as kernel
from tests.helpers import assert_close, no_transfers

RTOL = 1e-5


def _atol(x, scale):
    return 1e-6 * max(1.0, float(np.abs(x).max()) * abs(scale))


def _frequencies(name):
    config = preset(name)
    return reference.inv_freq(config), reference.cos_sin_scale(config)   # (dr/2,), float


def _inputs(shape, seed=0, top=4000):
    """x (T, ..., dr) and tree-like positions: a few repeated (siblings share a depth)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    positions = rng.integers(0, top, size=shape[0])
    positions[1::3] = positions[0]                                # shared positions
    return x, positions


# tiny: dr 16, plain frequencies; tiny-b: dr 8, YaRN frequencies (its mscale equals mscale_all_dim,
# so its cos/sin scale is 1: the explicit 1.25 covers scale != 1)
@pytest.mark.parametrize("name", ["tiny", "tiny-b"])
@pytest.mark.parametrize("heads", [None, 1, 3, 5])               # None: the shared key (T, dr)
@pytest.mark.parametrize("explicit_scale", [None, 1.25])
def test_matches_reference(name, heads, explicit_scale):
    freqs, scale = _frequencies(name)
    scale = scale if explicit_scale is None else explicit_scale
    width = 2 * len(freqs)
    shape = (7, width) if heads is None else (7, heads, width)
    x, positions = _inputs(shape)
    assert_close(kernel.apply_rope(x, positions, freqs, scale),
                 reference.apply_rope(x, positions, freqs, scale), rtol=RTOL, atol=_atol(x, scale))


@pytest.mark.parametrize("heads", [1, 3, kernel.ROPE_HEADS, kernel.ROPE_HEADS + 3, 2 * kernel.ROPE_HEADS + 1])
def test_versions_give_the_same_bits(heads):
    """Version 2 (a cos and sin per group of heads) against version 1 (one per head), bit for bit,
    with groups cut short and several groups a row; both within the reference's tolerance."""
    freqs, scale = _frequencies("tiny-b")
    x, positions = _inputs((3, heads, 2 * len(freqs)), seed=heads)
    first = kernel.apply_rope(x, positions, freqs, scale, version=1)
    second = kernel.apply_rope(x, positions, freqs, scale, version=2)
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))
    assert_close(second, reference.apply_rope(x, positions, freqs, scale), rtol=RTOL, atol=_atol(x, scale))


def test_position_zero_is_identity_times_scale():
    freqs, _ = _frequencies("tiny")
    x, _ = _inputs((3, 2, 16))
    assert_close(kernel.apply_rope(x, np.zeros(3, np.int64), freqs, 0.5), 0.5 * x, rtol=RTOL, atol=1e-7)


def test_float32_angles_are_the_contract():
    """float64 angles differ from numpy by ~|angle| * 2^-24: the kernel must use float32 ones."""
    freqs, scale = _frequencies("tiny")
    x, positions = _inputs((9, 2, 16), top=4000)
    positions[0] = 3999                           # measured here: max error 2.8e-5, 9x the tight atol
    actual = kernel.apply_rope(x, positions, freqs, scale)

    angles = positions.astype(np.float64)[:, None] * freqs.astype(np.float64)   # [T, dr/2] exact
    cos = (np.cos(angles) * scale)[:, None, :]
    sin = (np.sin(angles) * scale)[:, None, :]
    first, second = x[..., :8].astype(np.float64), x[..., 8:].astype(np.float64)
    exact = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)

    # |d out| <= |d angle| * (|x1| + |x2|) * scale, with |d angle| <= half an ulp = |angle| * 2^-24
    magnitude = np.tile((np.abs(first) + np.abs(second)) * abs(scale), 2)
    bound = (np.tile(angles[:, None, :], 2) * 2.0 ** -24 + 2.0 ** -21) * magnitude + 1e-7
    error = np.abs(actual - exact)
    assert (error <= bound).all()
    assert error.max() > 5 * _atol(x, scale)      # the float64 answer is far outside the tight tolerance
    assert_close(actual, reference.apply_rope(x, positions, freqs, scale), rtol=RTOL, atol=_atol(x, scale))


def test_every_element_written():
    """The output starts as NaN: a full grid leaves none, a grid one block short leaves some."""
    freqs, _ = _frequencies("tiny")
    x, positions = _inputs((6, 3, 16))                            # 6 * 3 * 8 = 144 pairs > 128
    d_x, d_positions, d_freqs = cuda.to_device(x), cuda.to_device(positions), cuda.to_device(freqs)

    out = device.poisoned(x.shape)
    kernel.rope_kernel[2, 128](d_x, d_positions, d_freqs, 1.0, out)
    assert np.isfinite(out.copy_to_host()).all()

    out = device.poisoned(x.shape)                                # negative control: the poison shows
    kernel.rope_kernel[1, 128](d_x, d_positions, d_freqs, 1.0, out)
    assert np.isnan(out.copy_to_host()).sum() == 2 * (144 - 128)


def test_every_element_written_by_version_2():
    """Version 2's threads: (row, head group, frequency); 3 groups of 11 heads, the last one short.
    One block short of the grid leaves the last rows' pairs NaN."""
    freqs, _ = _frequencies("tiny-b")                             # dr 8: 4 frequencies
    heads = 2 * kernel.ROPE_HEADS + 3
    x, positions = _inputs((11, heads, 8))                        # 11 * 3 * 4 = 132 threads > 128
    d_x, d_positions, d_freqs = cuda.to_device(x), cuda.to_device(positions), cuda.to_device(freqs)

    out = device.poisoned(x.shape)
    kernel.rope_heads_kernel[2, 128](d_x, d_positions, d_freqs, 1.0, out)
    assert np.isfinite(out.copy_to_host()).all()

    out = device.poisoned(x.shape)                                # thread 128: row 10, group 2, i 0
    kernel.rope_heads_kernel[1, 128](d_x, d_positions, d_freqs, 1.0, out)
    unwritten = np.isnan(out.copy_to_host())
    assert unwritten.sum() == 2 * 3 * 4 and unwritten[10, 2 * kernel.ROPE_HEADS:].all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")           # the simulator's inf * 0
def test_nan_and_inf_stay_in_their_pair():
    freqs, scale = _frequencies("tiny-b")
    x, positions = _inputs((4, 2, 8))
    x[0, 1, 2] = np.nan                                           # poisons out[0, 1, 2] and out[0, 1, 6]
    x[2, 0, 5] = np.inf                                           # inf * cos, inf * sin: +-inf (or NaN)
    positions[2] = 0                                              # sin(0) = 0: inf * 0 = NaN, like numpy
    with np.errstate(invalid="ignore"):
        expected = reference.apply_rope(x, positions, freqs, scale)
    actual = kernel.apply_rope(x, positions, freqs, scale)
    assert_close(actual, expected, rtol=RTOL, atol=_atol(np.nan_to_num(x, posinf=0), scale))
    assert np.isnan(actual).sum() == np.isnan(expected).sum() >= 2


def test_in_place():
    freqs, scale = _frequencies("tiny")
    x, positions = _inputs((5, 2, 16))
    expected = reference.apply_rope(x, positions, freqs, scale)

    d_x = cuda.to_device(x)                                       # device: out is x
    assert kernel.apply_rope(d_x, positions, freqs, scale, out=d_x) is d_x
    assert_close(d_x.copy_to_host(), expected, rtol=RTOL, atol=_atol(x, scale))

    host = x.copy()                                               # host: the result lands in x
    assert kernel.apply_rope(host, positions, freqs, scale, out=host) is host
    assert_close(host, expected, rtol=RTOL, atol=_atol(x, scale))

    d_out = device.poisoned(x.shape)                              # another device buffer
    kernel.apply_rope(x, positions, freqs, scale, out=d_out)
    assert_close(d_out.copy_to_host(), expected, rtol=RTOL, atol=_atol(x, scale))


def test_out_buffer_on_the_device_allocates_and_copies_nothing():
    freqs, scale = _frequencies("tiny-b")
    x, positions = _inputs((5, 3, 8))
    d_x, d_positions, d_freqs = cuda.to_device(x), cuda.to_device(positions), cuda.to_device(freqs)
    d_out = cuda.to_device(np.zeros(x.shape, np.float32))
    with no_transfers():
        result = kernel.apply_rope(d_x, d_positions, d_freqs, scale, out=d_out, stream=cuda.default_stream())
    assert result is d_out
    assert_close(d_out.copy_to_host(), reference.apply_rope(x, positions, freqs, scale),
                 rtol=RTOL, atol=_atol(x, scale))


def test_deterministic():
    freqs, scale = _frequencies("tiny-b")
    x, positions = _inputs((6, 3, 8), seed=3)
    first = kernel.apply_rope(x, positions, freqs, scale)
    second = kernel.apply_rope(x, positions, freqs, scale)
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


def test_device_arrays_stay_on_device(host_copies):
    freqs, scale = _frequencies("tiny")
    x, positions = _inputs((4, 3, 16))
    d_x = cuda.to_device(x)
    d_positions = cuda.to_device(positions.astype(np.int32))      # int32 positions work too
    d_out = kernel.apply_rope(d_x, d_positions, cuda.to_device(freqs), scale)
    assert host_copies == [], "the device path copied to the host"
    assert device.is_device_array(d_out) and d_out.shape == x.shape
    assert_close(d_out.copy_to_host(), reference.apply_rope(x, positions, freqs, scale),
                 rtol=RTOL, atol=_atol(x, scale))


@pytest.mark.parametrize("call, message", [
    (lambda x, p, f: kernel.apply_rope(x[..., :15], p, f), "must be even"),
    (lambda x, p, f: kernel.apply_rope(x, p[:-1], f), r"positions must be integers of shape \(3,\)"),
    (lambda x, p, f: kernel.apply_rope(x, p.astype(np.float32), f), "positions must be integers"),
    (lambda x, p, f: kernel.apply_rope(x, p, f[:-1]), r"inv_freq must have shape \(8,\)"),
    (lambda x, p, f: kernel.apply_rope(x[0, 0], p, f), "x must have shape"),
    (lambda x, p, f: kernel.apply_rope(x, p, f, scale=float("inf")), "scale must be a finite number"),
    (lambda x, p, f: kernel.apply_rope(x, p, f, out=np.empty((3, 2, 8), np.float32)), "out must be float32"),
    (lambda x, p, f: kernel.apply_rope(x, p, f, out=np.empty(x.shape, np.float64)), "out must be float32"),
    (lambda x, p, f: kernel.apply_rope(x, p, f, out=np.empty((3, 2, 32), np.float32)[..., ::2]),
     "out must be C-contiguous"),
    (lambda x, p, f: kernel.apply_rope(cuda.to_device(x.astype(np.float64)), p, f),
     "x must be float32 on the device"),
    (lambda x, p, f: kernel.apply_rope(x, p, f, version=3), r"version must be one of \(1, 2\), got 3"),
    (lambda x, p, f: kernel.apply_rope(x, p, f, version=True), r"version must be one of \(1, 2\), got True"),
])
def test_bad_inputs(call, message):
    freqs, _ = _frequencies("tiny")
    x, positions = _inputs((3, 2, 16))
    with pytest.raises(ValueError, match=message):
        call(x, positions, freqs)


def _queries(rows, heads, nope, width, seed):
    """The engine's layout: q (T, H, dn + dr), whose last dr columns of each head are rotated."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, heads, nope + width)).astype(np.float32)


@pytest.mark.parametrize("version", kernel.VERSIONS)
@pytest.mark.parametrize("name, heads", [("tiny", 4), ("tiny-b", 3), ("tiny", 1), ("tiny-b", 11)])
def test_in_place_on_a_strided_view(name, heads, version):
    """apply_rope with out=x on a strided (T, H, dr) view of a device buffer (the engine's
    queries' rope parts) gives the bits of a contiguous copy's rotation, and leaves every other
    element as it was (bit for bit, NaN included)."""
    freqs, scale = _frequencies(name)
    width, nope = 2 * len(freqs), 5
    q = _queries(6, heads, nope, width, seed=5)
    _, positions = _inputs((6, width), seed=6)
    expected = q.copy()
    expected[:, :, nope:] = kernel.apply_rope(np.ascontiguousarray(q[:, :, nope:]), positions, freqs, scale)
    d_q = cuda.to_device(q)
    view = d_q[:, :, nope:]
    assert kernel.apply_rope(view, cuda.to_device(positions), cuda.to_device(freqs), scale, out=view,
                             version=version) is view
    assert np.array_equal(d_q.copy_to_host().view(np.uint32), expected.view(np.uint32))
    reference_q = reference.apply_rope(q[:, :, nope:], positions, freqs, scale)
    assert_close(d_q.copy_to_host()[:, :, nope:], reference_q, rtol=RTOL, atol=_atol(q, scale))


def test_a_strided_two_dimensional_view_is_refused():
    """A (T, dr) view is reshaped to (T, 1, dr): it must be contiguous, x and out alike."""
    freqs, _ = _frequencies("tiny")
    x, positions = _inputs((3, 2 * 16))
    d_x = cuda.to_device(x)
    with pytest.raises(ValueError, match=r"a device x of shape \(3, 16\) must be C-contiguous"):
        kernel.apply_rope(d_x[:, 16:], positions, freqs)
    with pytest.raises(ValueError, match=r"out must be C-contiguous"):
        kernel.apply_rope(cuda.to_device(np.ascontiguousarray(x[:, 16:])), positions, freqs, out=d_x[:, :16])


@pytest.mark.gpu
def test_kimi_k26_dimensions():
    """64 heads x dr 64 with YaRN (factor 64), positions near max_position_embeddings - 1 = 262143."""
    config = preset("kimi-k2.6")
    freqs, scale = reference.inv_freq(config), reference.cos_sin_scale(config)
    rng = np.random.default_rng(4)
    positions = 262143 - rng.integers(0, 16, size=64)             # a tree: depths repeat
    for shape in ((64, 64, 64), (64, 64)):                        # queries (T, H, dr); the shared key
        x = rng.standard_normal(shape).astype(np.float32)
        versions = [kernel.apply_rope(x, positions, freqs, scale, version=v) for v in kernel.VERSIONS]
        assert np.array_equal(versions[0].view(np.uint32), versions[1].view(np.uint32))
        assert_close(versions[1], reference.apply_rope(x, positions, freqs, scale), rtol=RTOL,
                     atol=_atol(x, scale))
