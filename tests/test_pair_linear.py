"""Equivalence: kernels/linear.py (numba.cuda) against ddtree/linear.py (numpy).

Tolerances:
- linear: float32 dot products of Din terms, summed in different orders (numpy's pairwise sum;
  the GEMM sequentially along Din; the GEMV strided, then a tree). Partial sums are
  O(sqrt(Din) |x| |w|) and each of the Din additions rounds by up to half an ulp, so the two
  results differ by about eps32 * Din * rms(x) * rms(w) / 3 (a random walk);
  atol = 2 * eps32 * Din * rms(x) * rms(w) covers
  that with margin (outputs near 0 by cancellation need it), rtol 1e-5 the rest.
- embed copies and argmax picks: both must be exact (assert_exact), ties included.
"""

import numpy as np
import pytest
from numba import cuda

from ddtree import linear as reference
from kernels import device
from kernels import linear as kernel
from tests.helpers import assert_close, assert_exact, no_transfers

RTOL = 1e-5
EPS32 = float(np.finfo(np.float32).eps)


def _atol(x, weight):
    depth = x.shape[-1]
    rms = lambda a: float(np.sqrt(np.mean(np.square(a[np.isfinite(a)], dtype=np.float64))))
    return 2 * EPS32 * depth * rms(x) * rms(weight)


def _inputs(rows, depth, outputs, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    weight = rng.standard_normal((outputs, depth)).astype(np.float32)
    return x, weight


# ---------------------------------------------------------------------------------------- linear

# (T, Din, Dout): Din, Dout not multiples of the 16-wide tile nor of the GEMV block; Din < one tile
@pytest.mark.parametrize("version", kernel.VERSIONS)
@pytest.mark.parametrize("rows, depth, outputs", [(1, 70, 5), (3, 45, 2), (5, 37, 2), (2, 9, 3)])
def test_linear_matches_reference(version, rows, depth, outputs):
    x, weight = _inputs(rows, depth, outputs)
    assert_close(kernel.linear(x, weight, version=version, threads=32), reference.linear(x, weight),
                 rtol=RTOL, atol=_atol(x, weight))


def test_gemm_several_tiles_each_way():
    x, weight = _inputs(17, 37, 19)                               # a 2 x 2 grid of partial tiles
    assert_close(kernel.linear(x, weight, version="gemm"), reference.linear(x, weight),
                 rtol=RTOL, atol=_atol(x, weight))


def test_gemv_block_larger_than_din():
    x, weight = _inputs(2, 50, 3)                                 # 64 threads, 50 products
    assert_close(kernel.linear(x, weight, version="gemv", threads=64), reference.linear(x, weight),
                 rtol=RTOL, atol=_atol(x, weight))


@pytest.mark.parametrize("version, rows, depth, outputs", [
    ("warps", 11, 100, 37), ("warps", 10, 290, 5), ("lanes", 11, 100, 37), ("lanes", 10, 290, 5)])
def test_invariant_versions_are_batch_invariant(version, rows, depth, outputs):
    """Every row of "warps" and "lanes" is bit-identical to the same row run alone and to the row
    in any other batch: Din spans more than one unrolled step of 4 x 32 and a partial one, Dout
    several blocks, the rows two passes of ROWS_PER_PASS."""
    x, weight = _inputs(rows, depth, outputs, seed=3)
    together = kernel.linear(x, weight, version=version)
    assert_close(together, reference.linear(x, weight), rtol=RTOL, atol=_atol(x, weight))
    for t in (0, 7, 8, rows - 1):
        alone = kernel.linear(x[t:t + 1], weight, version=version)
        assert np.array_equal(alone[0], together[t]), f"row {t} depends on its neighbours"
    assert np.array_equal(kernel.linear(x[5:rows], weight, version=version), together[5:])
    for first, last in ((1, 3), (2, 5)):                          # passes of two and of four rows
        assert np.array_equal(kernel.linear(x[first:last], weight, version=version), together[first:last])


def _bits(values):
    return np.asarray(values, np.float32).view(np.uint32)


def test_the_default_is_lanes_with_the_engines_launch_shape():
    """``linear(x, w)`` runs "lanes" at ``lanes_shape`` (the engine's projections call it so): the
    bits of "warps", its readable form, at one row and at several."""
    x, weight = _inputs(9, 100, 37, seed=16)
    for rows in (1, 9):
        default = kernel.linear(x[:rows], weight)
        d_out = device.poisoned((rows, 37))
        kernel.lanes_launch(cuda.to_device(x[:rows]), cuda.to_device(weight), d_out,
                            shape=kernel.lanes_shape(rows, 37))
        assert np.array_equal(_bits(default), _bits(d_out.copy_to_host()))
        assert np.array_equal(_bits(default), _bits(kernel.linear(x[:rows], weight, version="warps")))


def test_gemv_and_gemm_round_a_row_differently():
    """Chapter 0's lesson: the GEMV and the GEMM sum each output in different orders, so a library
    that picks one by the row count gives a row other bits alone (GEMV) than in a batch (GEMM)."""
    x, weight = _inputs(19, 300, 21, seed=17)
    alone = kernel.linear(x[:1], weight, version="gemv")
    batched = kernel.linear(x, weight, version="gemm")[:1]
    assert_close(alone, batched, rtol=RTOL, atol=_atol(x, weight))
    assert not np.array_equal(_bits(alone), _bits(batched))


def test_linear_vector_and_leading_axes():
    x, weight = _inputs(4, 9, 5, seed=1)
    vector = kernel.linear(x[0], weight, threads=32)               # (K,) -> (N,), as np.matmul
    assert vector.shape == (5,)
    assert_close(vector, reference.linear(x[0], weight), rtol=RTOL, atol=_atol(x, weight))
    stacked = x.reshape(2, 2, 9)                                  # (..., K) -> (..., N)
    actual = kernel.linear(stacked, weight, threads=32)
    assert actual.shape == (2, 2, 5)
    assert_close(actual, reference.linear(stacked, weight), rtol=RTOL, atol=_atol(x, weight))


def test_linear_every_element_written():
    """The output starts as NaN, so any unwritten element fails the NaN-mask check of every
    equivalence test above (both versions). Negative control: a GEMV grid one block short."""
    x, weight = _inputs(2, 20, 3)
    d_x, d_weight = cuda.to_device(x), cuda.to_device(weight)
    out = device.poisoned((2, 3))
    kernel.gemv_kernel(32)[5, 32](d_x, d_weight, out)            # 6 blocks needed: (t, n) = (1, 2) missing
    assert np.isnan(out.copy_to_host()).sum() == 1 and np.isnan(out.copy_to_host()[1, 2])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")           # the simulator's inf * 0
@pytest.mark.parametrize("version", kernel.VERSIONS)
def test_linear_nan_and_inf_propagate_like_numpy(version):
    x, weight = _inputs(2, 20, 5)
    x[0, 3] = np.nan                                              # poisons output row 0
    weight[2, 7] = np.nan                                         # poisons output column 2
    x[1, 11] = np.inf                                             # row 1: +-inf (finite weights)
    weight[4, 11] = 0.0                                           # ... except inf * 0 = NaN at (1, 4)
    with np.errstate(invalid="ignore"):
        expected = reference.linear(x, weight)
    assert_close(kernel.linear(x, weight, version=version, threads=32), expected,
                 rtol=RTOL, atol=_atol(x, weight))


@pytest.mark.parametrize("version", kernel.VERSIONS)
def test_linear_deterministic(version):
    x, weight = _inputs(2, 40, 3, seed=2)
    first = kernel.linear(x, weight, version=version, threads=32)
    second = kernel.linear(x, weight, version=version, threads=32)
    assert np.array_equal(first.view(np.uint32), second.view(np.uint32))


@pytest.mark.parametrize("version", kernel.VERSIONS)
def test_linear_device_arrays_stay_on_device(version, host_copies):
    x, weight = _inputs(2, 21, 2)
    d_y = kernel.linear(cuda.to_device(x), cuda.to_device(weight), version=version, threads=32)
    assert host_copies == [], "the device path copied to the host"
    assert device.is_device_array(d_y) and d_y.shape == (2, 2)
    assert_close(d_y.copy_to_host(), reference.linear(x, weight), rtol=RTOL, atol=_atol(x, weight))


@pytest.mark.parametrize("call, message", [
    (lambda x, w: kernel.linear(x, w[:, :-1]), r"weight must have shape \(Dout, 8\)"),
    (lambda x, w: kernel.linear(x, w[0]), r"weight must have shape \(Dout, 8\)"),
    (lambda x, w: kernel.linear(x, w, version="tiles"), "version must be one of"),
    (lambda x, w: kernel.linear(x, w, version=None), "version must be one of"),
    (lambda x, w: kernel.linear(x, w, threads=100), "threads must be a power of two"),
    (lambda x, w: kernel.linear(np.float32(2.0), w), "x must have shape"),
    (lambda x, w: kernel.linear(x, cuda.to_device(w.astype(np.float64))),
     "weight must be float32 on the device"),
])
def test_linear_bad_inputs(call, message):
    x, weight = _inputs(2, 8, 3)
    with pytest.raises(ValueError, match=message):
        call(x, weight)


@pytest.mark.parametrize("version", kernel.VERSIONS)
def test_linear_out_buffer_on_the_device_allocates_and_copies_nothing(version):
    x, weight = _inputs(3, 21, 5)
    d_x, d_weight = cuda.to_device(x), cuda.to_device(weight)
    d_out = cuda.to_device(np.zeros((3, 5), np.float32))
    with no_transfers():
        result = kernel.linear(d_x, d_weight, version=version, threads=32, out=d_out,
                               stream=cuda.default_stream())
    assert result is d_out
    assert_close(d_out.copy_to_host(), reference.linear(x, weight), rtol=RTOL, atol=_atol(x, weight))


# ----------------------------------------------------------------------------------------- embed

def test_embed_matches_reference():
    table = np.random.default_rng(3).standard_normal((50, 37)).astype(np.float32)
    for tokens in ([3, 0, 49, 3], np.array([[7, 7], [1, 48]], np.int32), np.array([5])):
        assert_exact(kernel.embed(tokens, table), reference.embed(tokens, table))


def test_embed_device_arrays_stay_on_device(host_copies):
    table = np.random.default_rng(3).standard_normal((50, 37)).astype(np.float32)
    tokens = np.array([9, 0, 49], np.int64)
    d_rows = kernel.embed(cuda.to_device(tokens), cuda.to_device(table))
    assert host_copies == [1], "expected only the one-int error flag to come back"
    assert device.is_device_array(d_rows)
    assert_exact(d_rows.copy_to_host(), table[tokens])


@pytest.mark.parametrize("tokens", [[3, 50], [-1, 2], [0, 60, -5]])
@pytest.mark.parametrize("on_device", [False, True])
def test_embed_bad_ids_raise_like_numpy(tokens, on_device):
    table = np.zeros((50, 4), np.float32)
    tokens = np.array(tokens)
    with pytest.raises(ValueError) as expected:
        reference.embed(tokens, table)
    with pytest.raises(ValueError) as actual:
        kernel.embed(cuda.to_device(tokens) if on_device else tokens, table)
    assert str(actual.value) == str(expected.value)


def test_embed_with_out_and_a_range_flag_allocates_and_copies_nothing():
    table = np.random.default_rng(3).standard_normal((50, 37)).astype(np.float32)
    tokens = np.array([[9, 0], [49, 3]], np.int64)
    d_tokens, d_table = cuda.to_device(tokens), cuda.to_device(table)
    d_out = cuda.to_device(np.zeros((2, 2, 37), np.float32))
    flag = cuda.to_device(np.zeros(1, np.int32))
    with no_transfers():
        assert kernel.embed(d_tokens, d_table, out=d_out, range_error=flag) is d_out
    assert_exact(d_out.copy_to_host(), table[tokens])
    assert flag.copy_to_host()[0] == 0
    kernel.embed(cuda.to_device(np.array([3, 50])), d_table, range_error=flag)   # no raise: the flag says
    assert flag.copy_to_host()[0] == 1


@pytest.mark.parametrize("call, message", [
    (lambda t: kernel.embed(np.array([1.0, 2.0]), t), "tokens must be integers"),
    (lambda t: kernel.embed([1, 2], t[0]), r"table must have shape \(V, D\)"),
    (lambda t: kernel.embed([1, 2], cuda.to_device(t.astype(np.float64))),
     "table must be float32 on the device"),
    (lambda t: kernel.embed([1, 2], t, range_error=np.zeros(1, np.int32)),
     "range_error must be a device int32"),
    (lambda t: kernel.embed([1, 2], t, out=np.zeros((2, 5), np.float32)),
     r"out must be float32 of shape \(2, 4\)"),
])
def test_embed_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.zeros((10, 4), np.float32))


# ---------------------------------------------------------------------------------------- argmax

def _tie_rows(vocab):
    """Rows with exact ties, -inf, +inf and NaN (vocab >= 72): each must match np.argmax exactly."""
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(vocab)]                           # generic
    rows.append(np.full(vocab, 0.25))                             # all equal -> 0
    tied = rng.standard_normal(vocab)                             # a maximum at 5 places, in different
    tied[[vocab - 1, 40, 9, 33, 64]] = 7.0                        # threads' strides -> 9
    rows.append(tied)
    late = rng.standard_normal(vocab) - 10                        # the maximum only at the last index
    late[-1] = 0.0
    rows.append(late)
    rows.append(np.full(vocab, -np.inf))                          # all -inf -> 0
    minus = np.full(vocab, -np.inf)                               # -inf and one finite value
    minus[57] = -1e30
    rows.append(minus)
    plus = rng.standard_normal(vocab)                             # +inf twice -> the first
    plus[[70, 12]] = np.inf
    rows.append(plus)
    nans = rng.standard_normal(vocab)                             # NaN after a larger value: first NaN
    nans[[3, 60]] = 100.0
    nans[[50, 20]] = np.nan
    rows.append(nans)
    rows.append(np.full(vocab, np.nan))                           # all NaN -> 0
    negzero = np.zeros(vocab)                                     # -0.0 == +0.0: a tie -> the first
    negzero[[0, 1]] = [-0.0, 0.0]
    negzero[2:] = -1.0
    rows.append(negzero)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("vocab, threads", [(77, 32), (130, 64), (600, 32)])   # 600: three batches
def test_argmax_ties_and_specials_match_numpy(vocab, threads):
    logits = _tie_rows(vocab)
    expected = reference.argmax(logits)
    assert expected.tolist()[1:6] == [0, 9, vocab - 1, 0, 57]    # the rows test what they say
    actual = kernel.argmax(logits, threads=threads)
    assert actual.dtype == np.int64
    assert_exact(actual, expected)


def test_argmax_ties_across_a_threads_batches():
    """32 threads load 8 logits each per batch: entries 7 and 263 (thread 7's first and second
    batch) tie for the maximum, and a NaN at 519 (its third) beats both: the first of each wins."""
    logits = np.zeros((2, 600), np.float32)
    logits[:, [7, 263]] = 5.0
    logits[1, 519] = np.nan
    assert_exact(kernel.argmax(logits, threads=32), [7, 519])


def test_argmax_vocab_smaller_than_block():
    logits = np.array([[1.0, 3.0, 3.0], [np.nan, 2.0, np.nan], [-np.inf, -np.inf, -5.0]], np.float32)
    assert_exact(kernel.argmax(logits, threads=32), [1, 0, 2])


def test_argmax_leading_axes_and_every_row_written():
    logits = _tie_rows(80)[:6].reshape(2, 3, 80)                  # out starts at -1: every row is written
    actual = kernel.argmax(logits, threads=32)
    assert actual.shape == (2, 3) and (actual >= 0).all()
    assert_exact(actual, reference.argmax(logits))


def test_argmax_poison_shows_unwritten_rows():
    logits = cuda.to_device(_tie_rows(80)[:3])
    out = device.poisoned((3,), np.int64)                         # -1 until written
    kernel.argmax_kernel(32)[2, 32](logits, out)                 # negative control: one block short
    assert out.copy_to_host().tolist() == [int(np.argmax(_tie_rows(80)[0])), 0, -1]


def test_argmax_deterministic_and_device_path(host_copies):
    logits = _tie_rows(90)[[0, 2, 7]]                             # generic, tied, NaN rows
    d_logits = cuda.to_device(logits)
    first = kernel.argmax(d_logits, threads=32)
    second = kernel.argmax(d_logits, threads=32)
    assert host_copies == [], "the device path copied to the host"
    assert device.is_device_array(first)
    assert_exact(first.copy_to_host(), second.copy_to_host())
    assert_exact(first.copy_to_host(), reference.argmax(logits))


def test_argmax_out_buffer_on_the_device_allocates_and_copies_nothing():
    logits = _tie_rows(90)[[0, 2, 7]]
    d_logits, d_out = cuda.to_device(logits), cuda.to_device(np.zeros(3, np.int64))
    with no_transfers():
        assert kernel.argmax(d_logits, threads=32, out=d_out, stream=cuda.default_stream()) is d_out
    assert_exact(d_out.copy_to_host(), reference.argmax(logits))


@pytest.mark.parametrize("call, message", [
    (lambda: kernel.argmax(np.zeros(5, np.float32)), r"logits must have shape \(T, V\)"),
    (lambda: kernel.argmax(np.zeros((2, 0), np.float32)), "empty sequence"),
    (lambda: kernel.argmax(np.zeros((2, 5), np.float32), threads=20), "threads must be a power of two"),
    (lambda: kernel.argmax(cuda.to_device(np.zeros((2, 5)))), "logits must be float32 on the device"),
])
def test_argmax_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------- Kimi K2.6 sizes (GPU only)

@pytest.mark.gpu
def test_kimi_k26_linear():
    """A (16 x 7168) @ (7168 x 2048).T projection (GEMM) and a 1 x 7168 x 18432 decode row (GEMV)."""
    for rows, depth, outputs in ((16, 7168, 2048), (1, 7168, 18432)):
        x, weight = _inputs(rows, depth, outputs, seed=6)
        d_weight = cuda.to_device(weight)
        for version in kernel.VERSIONS:
            actual = kernel.linear(x, d_weight, version=version).copy_to_host()
            assert_close(actual, reference.linear(x, weight), rtol=RTOL, atol=_atol(x, weight),
                         name=f"{version} {rows}x{depth}x{outputs}")


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["warps", "lanes"])
def test_invariant_versions_batch_invariant_at_kimi_sizes(version):
    """"warps" (four columns per block) and "lanes" (its wide shape for 72 rows, its one-row shape
    alone): 72 tree rows equal each row alone, bit for bit."""
    x, weight = _inputs(72, 7168, 300, seed=8)
    d_weight = cuda.to_device(weight)
    together = kernel.linear(x, d_weight, version=version).copy_to_host()
    for t in (0, 9, 40, 71):
        alone = kernel.linear(x[t:t + 1], d_weight, version=version).copy_to_host()
        assert np.array_equal(alone[0], together[t]), f"row {t} depends on its neighbours"


@pytest.mark.gpu
def test_kimi_k26_argmax_and_embed():
    """Greedy argmax over the 163840-token vocabulary for 8 rows, ties planted; an embedding gather."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((8, 163840)).astype(np.float32)
    logits[1, [163839, 99999, 5]] = 50.0                          # tie -> 5
    logits[2, :] = -np.inf                                        # -> 0
    logits[3, [77777, 160000]] = np.nan                           # -> 77777
    for threads in (128, 1024):
        assert_exact(kernel.argmax(logits, threads=threads), reference.argmax(logits))
    table = rng.standard_normal((163840, 64)).astype(np.float32)
    tokens = rng.integers(0, 163840, size=64)
    assert_exact(kernel.embed(tokens, table), reference.embed(tokens, table))


# ---------------------------------------------------------------- "lanes": "warps"' bits, in flight

def _lanes(x, weight, shape=None, groups=1):
    """"lanes" into a NaN-poisoned output (``shape``: lanes_launch's; ``groups``: x (T G, Din),
    weight (G Dout, Din)), on the host."""
    outputs = weight.shape[0] // groups
    d_out = device.poisoned((x.shape[0], outputs))
    kernel.lanes_launch(cuda.to_device(x), cuda.to_device(weight), d_out, groups=groups, shape=shape)
    return d_out.copy_to_host()


# (T, Din, Dout, shape): Din not a multiple of 32 and short of one unrolled step (45), or spanning
# several with a partial one (290); 1, 2, 9 rows (a pass of 8 and a lone row after it); Dout past
# the last warp's columns and over several blocks; blocks of 1 to 3 warps of 1 to 5 columns
@pytest.mark.parametrize("rows, depth, outputs, shape", [
    (1, 70, 5, None), (1, 290, 37, (2, 3, 4)), (2, 45, 9, (1, 5, 1)), (9, 290, 19, (3, 2, 3)),
    (9, 100, 37, (1, 8, 2))])
def test_lanes_equals_warps_bit_for_bit(rows, depth, outputs, shape):
    x, weight = _inputs(rows, depth, outputs, seed=12)
    lanes = _lanes(x, weight, shape)
    assert not np.isnan(lanes).any(), "an output was never written"
    warps = kernel.linear(x, weight, version="warps")
    assert np.array_equal(_bits(lanes), _bits(warps))
    assert np.array_equal(_bits(kernel.linear(x, weight, version="lanes")), _bits(warps))
    # the order is visible at these sizes: summing each dot product straight along Din differs
    straight = np.cumsum(x[:, None, :] * weight[None, :, :], axis=-1, dtype=np.float32)[..., -1]
    assert not np.array_equal(straight, lanes)


def test_lanes_groups_are_one_linear_each():
    """Groups (MLA's absorb_output: one per head): rows t G + g times weight rows g Dout ..., each
    group bit for bit the linear of its own rows and weight, every output written."""
    rows, groups, depth, outputs = 9, 3, 40, 7
    x, weight = _inputs(rows * groups, depth, groups * outputs, seed=13)
    together = _lanes(x, weight, (2, 2, 2), groups=groups)
    assert not np.isnan(together).any(), "an output was never written"
    for g in range(groups):
        own = kernel.linear(x[g::groups], weight[g * outputs:(g + 1) * outputs], version="warps")
        assert np.array_equal(_bits(together[g::groups]), _bits(own)), f"group {g}"


def test_lanes_shape_by_rows_and_outputs():
    """The launch shape follows the rows and Dout on a GPU; the simulator always runs its own. A
    pass holds the launch's rows rounded up to a power of two, at most ROWS_PER_PASS
    (``pass_rows``: a decode row's kernel keeps one row's sums, a tree of two or four computes no
    repeated row); up to two rows keep a decode row's shape."""
    assert [kernel.pass_rows(r) for r in (1, 2, 3, 4, 5, 8, 9, 72)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert kernel.ROWS_PER_PASS == 8
    if device.SIMULATOR:
        assert {kernel.lanes_shape(r, n) for r in (1, 8, 72) for n in (64, 32000)} == {kernel.LANES_SIMULATED}
        return
    assert {kernel.lanes_shape(r, 2048) for r in (1, 2)} == {(4, 2, 16)}
    assert {kernel.lanes_shape(r, 32000) for r in (1, 2)} == {(4, 4, 4)}
    assert kernel.lanes_shape(3, 2048) == (4, 2, 8) and kernel.lanes_shape(3, 32000) == (4, 8, 2)
    assert kernel.lanes_shape(8, 2048) == (4, 2, 8) and kernel.lanes_shape(24, 2048) == (4, 4, 4)
    assert {kernel.lanes_shape(r, 32000) for r in (5, 24, 72)} == {kernel.lanes_shape(72, 64)} == {(4, 8, 2)}


def test_lanes_passes_of_one_row_equal_warps():
    """The kernel of one-row passes (a decode row's) over several rows, a pass each: "warps"' bits
    for every row, every output written."""
    rows, depth, outputs, shape = 3, 100, 37, (2, 3, 4)
    x, weight = _inputs(rows, depth, outputs, seed=15)
    d_out = device.poisoned((rows, outputs))
    warps, columns, unroll = shape
    grid = (kernel.blocks(outputs, warps * columns), kernel.row_passes(rows, 1), 1)
    kernel.lanes_kernel(warps, columns, unroll, 1)[grid, warps * kernel.LANES](
        cuda.to_device(x), cuda.to_device(weight), d_out, 1)
    lanes = d_out.copy_to_host()
    assert not np.isnan(lanes).any(), "an output was never written"
    assert np.array_equal(_bits(lanes), _bits(kernel.linear(x, weight, version="warps")))


@pytest.mark.gpu
def test_lanes_equals_warps_at_real_sizes():
    """"lanes" at every shape ``lanes_shape`` picks and at those once timed (lanes-h200-2026-12-02.txt
    at commit 6fe9e42) equals "warps" bit for bit for 1, 2, 8, 16, 24 and 72 rows at small's
    projection sizes and an odd one (Din 511 -> 33), the GPU's fused multiply-adds included; every
    output written."""
    shapes = {(4, 1, 16), (4, 2, 16), (4, 2, 8), (4, 4, 4), (8, 1, 8), (8, 2, 8), (2, 2, 8), (4, 1, 8),
              (8, 1, 16), (4, 8, 2), (8, 4, 4), (2, 8, 2), (4, 8, 4), None}
    for depth, outputs in ((2048, 1536), (1536, 1024), (2048, 64), (2048, 32000), (511, 33)):
        x, weight = _inputs(72, depth, outputs, seed=14)
        d_weight = cuda.to_device(weight)
        for rows in (1, 2, 8, 16, 24, 72):
            d_x = cuda.to_device(x[:rows])
            warps = kernel.linear(d_x, d_weight, version="warps").copy_to_host()
            for shape in shapes:
                d_out = device.poisoned((rows, outputs))
                kernel.lanes_launch(d_x, d_weight, d_out, shape=shape)
                lanes = d_out.copy_to_host()
                where = f"{shape} at {rows}x{depth}x{outputs}"
                assert not np.isnan(lanes).any(), f"unwritten outputs: {where}"
                assert np.array_equal(_bits(lanes), _bits(warps)), where
