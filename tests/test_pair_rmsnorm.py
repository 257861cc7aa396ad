"""Equivalence: kernels/rmsnorm.py (numba.cuda) against ddtree/rmsnorm.py (numpy).

Tolerance: both sides compute in float32 and differ only in the order of the sum of squares
(numpy: pairwise; the kernel: strided per thread, then a tree). Sums of D positive terms in two
orders agree to a few float32 ulp (~1e-7 relative), the square root halves that, and the final
two products add an ulp each: rtol 1e-5 leaves a wide margin, atol 1e-6 covers outputs near 0.
"""

import numpy as np
import pytest
from numba import cuda

from ddtree import rmsnorm as reference
from kernels import device, tuning
from kernels import rmsnorm as kernel
from tests.helpers import assert_close, no_transfers

RTOL, ATOL = 1e-5, 1e-6


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
    return x, weight


# (T, D, threads): D below, above and not a multiple of the block; D = 1; one row
@pytest.mark.parametrize("rows, width, threads", [
    (3, 100, 32), (2, 257, 64), (2, 31, 32), (4, 1, 32), (1, 70, 128),
])
def test_matches_reference(rows, width, threads):
    x, weight = _inputs((rows, width))
    for eps in (1e-6, 1e-5):
        assert_close(kernel.rmsnorm(x, weight, eps, threads=threads),
                     reference.rmsnorm(x, weight, eps), rtol=RTOL, atol=ATOL)


def test_leading_axes_are_rows():
    x, weight = _inputs((2, 3, 40))                               # (..., D) is (6, D)
    actual = kernel.rmsnorm(x, weight, 1e-6, threads=32)
    assert actual.shape == (2, 3, 40)
    assert_close(actual, reference.rmsnorm(x, weight, 1e-6), rtol=RTOL, atol=ATOL)


def test_every_element_written():
    """The output starts as NaN: a full launch leaves none, one block short leaves a NaN row."""
    x, weight = _inputs((3, 45))
    d_x, d_weight = cuda.to_device(x), cuda.to_device(weight)
    launch = kernel.rmsnorm_kernel(32)

    out = device.poisoned(x.shape)
    launch[3, 32](d_x, d_x, d_x.reshape(3, 1, 45), d_x, d_weight, 1e-6, out)   # delta, slots: unused
    assert np.isfinite(out.copy_to_host()).all()

    out = device.poisoned(x.shape)                                # negative control: the poison shows
    launch[2, 32](d_x, d_x, d_x.reshape(3, 1, 45), d_x, d_weight, 1e-6, out)
    assert np.isnan(out.copy_to_host()[2]).all() and np.isfinite(out.copy_to_host()[:2]).all()


# (T, D, TPB), batch 8: the row in registers (45 <= 32 x 8), and spanning several batches (300 > 32 x 8)
@pytest.mark.parametrize("rows, width, threads", [(3, 45, 32), (2, 300, 32)])
def test_residual_is_the_add_then_the_norm_bit_for_bit(rows, width, threads):
    """rmsnorm(x, residual=delta): x becomes x + delta (every element, the add's bits), and the
    output is the norm of that sum, bit for bit the norm launched on its own after the add."""
    x, weight = _inputs((rows, width))
    delta = np.random.default_rng(7).standard_normal((rows, width)).astype(np.float32)
    d_x, d_delta = cuda.to_device(x), cuda.to_device(delta)
    fused = kernel.rmsnorm(d_x, weight, 1e-6, residual=d_delta, threads=threads, batch=8,
                           out=device.poisoned(x.shape)).copy_to_host()
    summed = x + delta                                            # float32: the add kernel's bits
    assert np.array_equal(d_x.copy_to_host().view(np.uint32), summed.view(np.uint32))
    apart = kernel.rmsnorm(cuda.to_device(summed), weight, 1e-6, threads=threads, batch=8).copy_to_host()
    assert np.array_equal(fused.view(np.uint32), apart.view(np.uint32))


# (T, D, k, TPB, batch, with the shared expert's output as delta): the row in registers or over batches
@pytest.mark.parametrize("rows, width, slots, threads, batch, shared", [
    (3, 45, 2, 32, 8, True), (2, 300, 3, 32, 8, True), (2, 70, 1, 32, 1, False), (1, 45, 6, 32, 16, False)])
def test_slots_are_the_combine_then_the_add_and_norm_bit_for_bit(rows, width, slots, threads, batch, shared):
    """rmsnorm(x, residual=delta, slots=(down, weights)): x becomes x + (delta + the weighed slots in slot
    order), or x + (0 + ...) without delta, and the output is its norm: bit for bit ``combine_kernel``
    (accumulating into delta or not), then the residual norm."""
    from kernels.moe import TPB, combine_kernel
    x, weight = _inputs((rows, width), seed=rows + slots)
    rng = np.random.default_rng(slots)
    delta = rng.standard_normal((rows, width)).astype(np.float32)
    down = rng.standard_normal((rows, slots, width)).astype(np.float32)
    weights = rng.random((rows, slots)).astype(np.float32)
    d_x, d_down, d_weights = cuda.to_device(x), cuda.to_device(down), cuda.to_device(weights)
    fused = kernel.rmsnorm(d_x, weight, 1e-6, residual=cuda.to_device(delta) if shared else None,
                           slots=(d_down, d_weights), threads=threads, batch=batch,
                           out=device.poisoned(x.shape)).copy_to_host()
    combined = cuda.to_device(delta if shared else np.full_like(delta, np.nan))
    combine_kernel[-(-rows * width // TPB), TPB](d_down, d_weights, shared, combined)
    apart_x = cuda.to_device(x)
    apart = kernel.rmsnorm(apart_x, weight, 1e-6, residual=combined, threads=threads, batch=batch)
    apart = apart.copy_to_host()
    assert np.isfinite(fused).all()
    assert np.array_equal(d_x.copy_to_host().view(np.uint32), apart_x.copy_to_host().view(np.uint32))
    assert np.array_equal(fused.view(np.uint32), apart.view(np.uint32))
    expected = x + ((delta if shared else 0) + np.einsum("tk,tkd->td", weights, down))
    assert_close(fused, reference.rmsnorm(expected, weight, 1e-6), rtol=RTOL, atol=ATOL)


def test_slots_refuse_host_arrays_and_other_shapes():
    x = cuda.to_device(np.ones((2, 40), np.float32))
    weight, weights = np.ones(40, np.float32), np.ones((2, 3), np.float32)
    down = np.ones((2, 3, 40), np.float32)
    with pytest.raises(ValueError, match="slots must be a pair"):
        kernel.rmsnorm(x, weight, 1e-6, slots=[cuda.to_device(down), cuda.to_device(weights)])
    with pytest.raises(ValueError, match="slots needs x, down and weights as device arrays"):
        kernel.rmsnorm(x, weight, 1e-6, slots=(down, cuda.to_device(weights)))
    with pytest.raises(ValueError, match=r"weights \(2, 2\)"):
        kernel.rmsnorm(x, weight, 1e-6, slots=(cuda.to_device(down), cuda.to_device(weights[:, :2].copy())))
    with pytest.raises(ValueError, match=r"down \(2, 0, 40\)"):
        kernel.rmsnorm(x, weight, 1e-6, slots=(cuda.to_device(down[:, :0].copy()),
                                               cuda.to_device(weights[:, :0].copy())))


def test_row_batch_keeps_few_rows_in_registers_and_fits_the_block():
    few, many = tuning.sm_count(), tuning.sm_count() + 1                # one block per SM at most
    wide = 512 * 32                                                     # more than any batch covers
    assert kernel.row_batch(few, 512, wide) == tuning.RMSNORM_FEW_ROWS_BATCH
    assert kernel.row_batch(many, 512, wide) == tuning.RMSNORM_MANY_ROWS_BATCH
    assert kernel.row_batch(1, 1024, wide) == min(tuning.RMSNORM_FEW_ROWS_BATCH, kernel.BATCH_SLOTS // 1024)
    assert all(kernel.row_batch(rows, threads, wide) * threads <= kernel.BATCH_SLOTS
               for rows in (1, few, many) for threads in (32, 256, 512, 1024))


@pytest.mark.parametrize("width, batch", [(2048, 4), (7168, 14), (2049, 5), (100, 1), (1, 1)])
def test_row_batch_loads_no_slot_past_the_row(width, batch):
    """A decode row of ``width`` elements in 512 threads: no more batch slots than a thread has
    elements (small's 2048: 4; Kimi's 7168: 14), at most the few rows' batch."""
    assert kernel.row_batch(1, 512, width) == min(batch, tuning.RMSNORM_FEW_ROWS_BATCH)


def test_batch_changes_no_bit():
    """A thread's loads per batch (1: a batch per element, 16: the row in registers) change what is
    in flight, never the order of a sum: the same bits, with and without the residual add."""
    x, weight = _inputs((2, 300), seed=2)
    delta = np.random.default_rng(8).standard_normal(x.shape).astype(np.float32)
    results = []
    for batch in (1, 3, 8, 16):
        d_x = cuda.to_device(x)
        plain = kernel.rmsnorm(d_x, weight, 1e-6, threads=32, batch=batch).copy_to_host()
        fused = kernel.rmsnorm(d_x, weight, 1e-6, threads=32, batch=batch, residual=cuda.to_device(delta))
        results.append(np.concatenate([plain, fused.copy_to_host(), d_x.copy_to_host()]).view(np.uint32))
    assert all(np.array_equal(results[0], other) for other in results[1:])
    assert_close(results[0][:2].view(np.float32), reference.rmsnorm(x, weight, 1e-6), rtol=RTOL, atol=ATOL)


def test_residual_refuses_host_arrays_and_other_shapes():
    x, weight = _inputs((2, 40))
    with pytest.raises(ValueError, match="residual needs x and residual as device arrays"):
        kernel.rmsnorm(x, weight, 1e-6, residual=x)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(2, 40\), got \(2, 39\)"):
        kernel.rmsnorm(cuda.to_device(x), weight, 1e-6, residual=cuda.to_device(x[:, :39].copy()))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")           # the simulator's float32 overflow
def test_nan_and_inf_propagate_like_numpy():
    x, weight = _inputs((4, 37))
    x[0, 5] = np.nan              # the whole row turns NaN
    x[1, 9] = np.inf              # inf * 1/sqrt(inf) = inf * 0: NaN there, 0 elsewhere
    x[2, :] = 3e19                # x^2 overflows float32 to inf: all zeros
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference.rmsnorm(x, weight, 1e-6)
    assert_close(kernel.rmsnorm(x, weight, 1e-6, threads=32), expected, rtol=RTOL, atol=ATOL)


def test_deterministic():
    x, weight = _inputs((3, 150), seed=1)
    first = kernel.rmsnorm(x, weight, 1e-6, threads=64)
    second = kernel.rmsnorm(x, weight, 1e-6, threads=64)
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


def test_device_arrays_stay_on_device(host_copies):
    x, weight = _inputs((2, 3, 33))
    d_x, d_weight = cuda.to_device(x), cuda.to_device(weight)
    d_out = kernel.rmsnorm(d_x, d_weight, 1e-6, threads=32)
    assert host_copies == [], "the device path copied to the host"
    assert device.is_device_array(d_out) and d_out.shape == x.shape
    assert_close(d_out.copy_to_host(), reference.rmsnorm(x, weight, 1e-6), rtol=RTOL, atol=ATOL)


def test_out_buffer_on_the_device_allocates_and_copies_nothing():
    x, weight = _inputs((2, 3, 33))
    d_x, d_weight = cuda.to_device(x), cuda.to_device(weight)
    d_out = cuda.to_device(np.full(x.shape, 7.0, np.float32))     # not poisoned: every element is written
    with no_transfers():
        result = kernel.rmsnorm(d_x, d_weight, 1e-6, threads=32, out=d_out, stream=cuda.default_stream())
    assert result is d_out
    assert_close(d_out.copy_to_host(), reference.rmsnorm(x, weight, 1e-6), rtol=RTOL, atol=ATOL)
    host_out = np.empty_like(x)                                   # a host out receives the result
    assert kernel.rmsnorm(x, weight, 1e-6, out=host_out) is host_out
    assert_close(host_out, reference.rmsnorm(x, weight, 1e-6), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: kernel.rmsnorm(x, w[:-1], 1e-6), r"weight must have shape \(8,\)"),
    (lambda x, w: kernel.rmsnorm(x, w, -1.0), "eps must be a non-negative finite number"),
    (lambda x, w: kernel.rmsnorm(x, w, float("nan")), "eps must be a non-negative finite number"),
    (lambda x, w: kernel.rmsnorm(x, w, 1e-6, threads=48), "threads must be a power of two"),
    (lambda x, w: kernel.rmsnorm(x, w, 1e-6, threads=16), "threads must be a power of two"),
    (lambda x, w: kernel.rmsnorm(x, w, 1e-6, batch=0), r"batch must be an int in \[1, 32\], got 0"),
    (lambda x, w: kernel.rmsnorm(x, w, 1e-6, batch=2.0), r"batch must be an int in \[1, 32\], got 2.0"),
    (lambda x, w: kernel.rmsnorm(x, w, 1e-6, threads=1024, batch=16),
     r"batch x threads must be at most 8192 \(a block's registers\), got 16 x 1024"),
    (lambda x, w: kernel.rmsnorm(np.float32(1.0), w, 1e-6), "x must have shape"),
    (lambda x, w: kernel.rmsnorm(cuda.to_device(x.astype(np.float64)), w, 1e-6),
     "x must be float32 on the device"),
    (lambda x, w: kernel.rmsnorm(x, w, 1e-6, out=cuda.device_array((2, 7), np.float32)),
     r"out must be float32 of shape \(2, 8\)"),
])
def test_bad_inputs(call, message):
    x, weight = _inputs((2, 8))
    with pytest.raises(ValueError, match=message):
        call(x, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [128, 1024])
def test_kimi_k26_dimensions(threads):
    """64 rows of the hidden state (D = 7168) with Kimi K2.6's eps 1e-5; the latent (512) too."""
    for shape in ((64, 7168), (64, 512)):
        x, weight = _inputs(shape, seed=2)
        actual = kernel.rmsnorm(x, weight, 1e-5, threads=threads)
        assert_close(actual, reference.rmsnorm(x, weight, 1e-5), rtol=RTOL, atol=ATOL)
        batch8 = kernel.rmsnorm(x, weight, 1e-5, threads=threads, batch=8)   # 7168 > 128 x 16: re-read
        assert np.array_equal(actual.view(np.uint32), batch8.view(np.uint32))
