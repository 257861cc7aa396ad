"""Sampling on the GPU: the numba.cuda twin of ``ddtree/sampling.py``.

Legend: T rows (tree nodes or AR steps), V vocab_size, L draft depths, K children per node
(padded), C indices per row, TPB threads per block.

The random numbers are the reference's, bit for bit: Philox4x32-10 on (index, position lo, position hi,
purpose) with the seed as key, 52 bits to a float64 uniform (exact), Gumbel = -log(-log u). Philox needs only
32 x 32 -> 64-bit products, which never wrap, so the device functions below run unchanged on the GPU and in
the simulator (whose integers are numpy scalars). Everything after the bits is float64: division, addition and
conversion are correctly rounded everywhere, ``math.log`` and ``math.exp`` are not (CUDA's double log and exp
are within 1 ulp, numpy's SIMD versions too, and they differ now and then), which is the one place where numpy
and this module can disagree: a draw whose two best scores lie within an ulp or two of each other (chapter 13
counts how rarely; tests/test_pair_sampling.py too).

Kernels (one block per row, TPB threads strided over the vocabulary, block reductions from
``kernels.blocks`` in float64; the argmax in np.argmax's order):

* ``sample_kernel(TPB)``: logits (T, V) float32 -> tokens (T,) int64. Temperature and seed are read
  from (1,) device arrays, so a captured CUDA graph switches greedy (temperature 0) and sampling,
  or changes the seed, without recapture.
* ``rejection_kernel(TPB)``: every tree node's outcome under recursive rejection sampling: the
  accepted child's token, or a draw from the residual. ``work`` (T, 2, V) float64 holds each row's
  residual p_j and the draft's remaining q_j, updated in place, one pass per rejected child.
* ``noise_kernel``: the uniforms or Gumbel numbers themselves, one thread per entry (tests, chapter).

Public wrappers as in the other kernel modules: host in, host out; device in, device out; ``out``
(and ``work``) given on the device: no allocation, capturable.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float64, int32, uint64

from ddtree import sampling as reference
from ddtree.sampling import ACCEPT, DRAFT, PURPOSES, SAMPLE  # noqa: F401  (the purposes, re-exported)
from kernels.blocks import (
    block_argmax,
    block_max,
    block_sum,
    blocks,
    check_threads,
    comes_first,
    pow2_threads,
)
from kernels.device import check_out, deliver, host_or_device, is_device_array, output, poisoned, to_device

MULTIPLIER0 = uint64(reference.PHILOX_MULTIPLIERS[0])
MULTIPLIER1 = uint64(reference.PHILOX_MULTIPLIERS[1])
WEYL0 = uint64(reference.PHILOX_WEYL[0])
WEYL1 = uint64(reference.PHILOX_WEYL[1])
ROUNDS = reference.PHILOX_ROUNDS
LOW32 = uint64(0xFFFFFFFF)
SHIFT12, SHIFT20, SHIFT32 = uint64(12), uint64(20), uint64(32)
HALF = float64(0.5)
UNIT = float64(reference.UNIT)
ZERO = float64(0.0)
NEG_INF = float64(-math.inf)
NOISE_TPB = 128       # noise_kernel's threads per block (independent entries)


# --8<-- [start:philox]
@cuda.jit(device=True)
def philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 words < 2^32: the reference's ``philox``, word for word."""
    for round_ in range(ROUNDS):
        if round_ > 0:                                     # the key schedule: Weyl steps mod 2^32
            k0 = (k0 + WEYL0) & LOW32
            k1 = (k1 + WEYL1) & LOW32
        p0 = MULTIPLIER0 * c0                              # 32 x 32 -> 64 bits: never wraps
        p1 = MULTIPLIER1 * c2
        c0, c1, c2, c3 = (p1 >> SHIFT32) ^ c1 ^ k0, p1 & LOW32, (p0 >> SHIFT32) ^ c3 ^ k1, p0 & LOW32
    return c0, c1, c2, c3


@cuda.jit(device=True)
def uniform(seed, purpose, position, index):
    """The uniform in (0, 1) of (seed, purpose, position, index), float64 (seed, position: uint64)."""
    w0, w1, _, _ = philox(uint64(index), position & LOW32, position >> SHIFT32, uint64(purpose),
                          seed & LOW32, seed >> SHIFT32)
    bits = (w0 << SHIFT20) | (w1 >> SHIFT12)               # 52 random bits
    return (float64(bits) + HALF) * UNIT                   # exact


@cuda.jit(device=True)
def gumbel(seed, purpose, position, index):
    return -math.log(-math.log(uniform(seed, purpose, position, index)))
# --8<-- [end:philox]


# --8<-- [start:sampled_argmax]
@cuda.jit(device=True)
def sampled_argmax(logits, row, temperature, seed, position, values, indices):
    """indices[0] = the row's token: the first maximum of logits / T + Gumbel (T > 0), of the
    logits themselves otherwise. Thread tid scores v = tid, tid + TPB, ...; values/indices: TPB
    shared slots each, reduced by block_argmax."""
    tid = cuda.threadIdx.x
    best_value = ZERO
    best_index = -1                                        # nothing seen yet: comes after every entry
    for v in range(tid, logits.shape[1], cuda.blockDim.x):
        score = float64(logits[row, v])                    # exact: float32 -> float64
        if temperature > 0:
            score = score / temperature + gumbel(seed, SAMPLE, position, v)
        if comes_first(score, v, best_value, best_index):
            best_value = score
            best_index = v
    values[tid] = best_value
    indices[tid] = best_index
    block_argmax(values, indices)
# --8<-- [end:sampled_argmax]


# --8<-- [start:sample_kernel]
@functools.cache
def sample_kernel(threads: int):
    """The sampler for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(logits, positions, temperature, seed, out):
        # one block = one row of logits (T, V): out[row] = the token at positions[row];
        # temperature (1,) float64 and seed (1,) int64 live on the device (graph-safe)
        values = cuda.shared.array(threads, float64)
        indices = cuda.shared.array(threads, int32)
        row = cuda.blockIdx.x
        sampled_argmax(logits, row, temperature[0], uint64(seed[0]), uint64(positions[row]), values, indices)
        if cuda.threadIdx.x == 0:
            out[row] = indices[0]

    return kernel
# --8<-- [end:sample_kernel]


# --8<-- [start:rejection_kernel]
@cuda.jit(device=True)
def row_softmax(source, source_row, temperature, work, row, which, scratch):
    """work[row, which, :] = softmax(source[source_row] / T) in float64: exp(s - max) / sum, the
    reference's operations (the sum's order is the block's: strided partials, then a tree)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    vocab = source.shape[1]
    local = NEG_INF
    for v in range(tid, vocab, threads):
        local = max(local, float64(source[source_row, v]) / temperature)
    scratch[tid] = local
    block_max(scratch)
    top = scratch[0]
    cuda.syncthreads()                                     # every thread has read scratch[0]
    partial = ZERO
    for v in range(tid, vocab, threads):
        partial += math.exp(float64(source[source_row, v]) / temperature - top)
    scratch[tid] = partial
    block_sum(scratch)
    total = scratch[0]
    cuda.syncthreads()
    for v in range(tid, vocab, threads):
        work[row, which, v] = math.exp(float64(source[source_row, v]) / temperature - top) / total


@cuda.jit(device=True)
def residual_argmax(work, row, seed, position, values, indices):
    """indices[0] = the first maximum of log(residual) + Gumbel over the tokens with residual > 0."""
    tid = cuda.threadIdx.x
    best_value = ZERO
    best_index = -1
    for v in range(tid, work.shape[2], cuda.blockDim.x):
        left = work[row, 0, v]
        if left > 0:                                       # log(0): -inf never wins (the simulator raises)
            score = math.log(left) + gumbel(seed, SAMPLE, position, v)
            if comes_first(score, v, best_value, best_index):
                best_value = score
                best_index = v
    values[tid] = best_value
    indices[tid] = best_index
    block_argmax(values, indices)


@functools.cache
def rejection_kernel(threads: int):
    """Recursive rejection sampling for blocks of ``threads`` threads (a power of two)."""

    @cuda.jit
    def kernel(logits, positions, children, draft, depths, temperature, seed, work, out):
        # one block = one tree node (row of logits): out[row] = its outcome at positions[row].
        # Every thread reads the same values from global memory after a barrier and so takes the
        # same decisions: the control flow is uniform and the barriers inside the loop are safe.
        values = cuda.shared.array(threads, float64)
        indices = cuda.shared.array(threads, int32)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        t = temperature[0]
        key = uint64(seed[0])
        position = uint64(positions[row])
        vocab = logits.shape[1]
        count = 0                                          # children: listed first, then -1
        while count < children.shape[1] and children[row, count] >= 0:
            count += 1
        accepted = -1
        mass = float64(1.0)                                # p_j = work[row, 0] / mass
        remaining = float64(1.0)                           # q_j = work[row, 1] / remaining
        if t > 0 and count > 0:
            row_softmax(logits, row, t, work, row, 0, values)                 # p_1 = p
            row_softmax(draft, depths[row], t, work, row, 1, values)          # q_1 = q
            for j in range(count):
                cuda.syncthreads()                         # work's last writes are visible to all
                child = children[row, j]
                drawn = work[row, 1, child]
                if drawn <= 0 or remaining <= 0 or mass <= 0:
                    break                                  # q had nothing left (padding), or p nothing
                if uniform(key, ACCEPT, position, j) * (drawn / remaining) < work[row, 0, child] / mass:
                    accepted = child
                    break
                cuda.syncthreads()                         # every thread has read work[row, :, child]
                partial = ZERO
                for v in range(tid, vocab, threads):       # p_{j+1} = max(p_j - q_j, 0), unnormalised
                    left = max(work[row, 0, v] / mass - work[row, 1, v] / remaining, ZERO)
                    work[row, 0, v] = left
                    partial += left
                    if v == child:
                        work[row, 1, v] = ZERO             # q_{j+1} (p_{j+1} is 0 there already)
                remaining = remaining - drawn
                values[tid] = partial
                block_sum(values)
                mass = values[0]
        cuda.syncthreads()                                 # every thread has read values[0]
        if accepted >= 0:
            if tid == 0:
                out[row] = accepted
        else:
            if t > 0 and count > 0 and mass > 0:
                residual_argmax(work, row, key, position, values, indices)
            else:                                          # no children, greedy, or nothing left
                sampled_argmax(logits, row, t, key, position, values, indices)
            if tid == 0:
                out[row] = indices[0]

    return kernel
# --8<-- [end:rejection_kernel]


# --8<-- [start:noise_kernel]
@cuda.jit
def noise_kernel(positions, indices, seed, purpose, gumbel_numbers, out):
    # one thread = one entry out[t, c]: the uniform (or the Gumbel number) of
    # (seed, purpose, positions[t], indices[c]); blocks along c (x) and rows (y); no shared memory
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if c < out.shape[1]:
        if gumbel_numbers:
            out[t, c] = gumbel(uint64(seed), purpose, uint64(positions[t]), indices[c])
        else:
            out[t, c] = uniform(uint64(seed), purpose, uint64(positions[t]), indices[c])
# --8<-- [end:noise_kernel]


# ----------------------------------------------------------------------------------------------
# host side

def check_scalar(value, dtype, name: str, check):
    """A (1,) device array of ``dtype`` as it is (a captured graph reads it), or a host number
    checked by ``check`` and copied to a new (1,) device array."""
    if is_device_array(value):
        if tuple(value.shape) != (1,) or value.dtype != np.dtype(dtype):
            raise ValueError(f"{name} on the device must be a (1,) {np.dtype(dtype)} array, "
                             f"got {value.dtype} {tuple(value.shape)}")
        return value
    return cuda.to_device(np.array([check(value)], dtype))


def check_rows(logits, positions, name: str = "logits"):
    """logits (T, V) float32 and positions (T,) int64, host (value-checked) or device."""
    logits = host_or_device(logits)
    if is_device_array(logits):
        if len(logits.shape) != 2 or logits.shape[1] < 1 or logits.dtype != np.float32:
            raise ValueError(f"{name} on the device must be float32 (T, V) with V >= 1, "
                             f"got {logits.dtype} {tuple(logits.shape)}")
    else:
        logits = reference.check_logits(logits, name)
    rows = logits.shape[0]
    if logits.shape[1] > np.iinfo(np.int32).max:
        raise ValueError(f"V must fit in int32 (the kernel's indices), got {logits.shape[1]}")
    if is_device_array(positions):
        if tuple(positions.shape) != (rows,) or positions.dtype != np.int64:
            raise ValueError(f"positions on the device must be ({rows},) int64, "
                             f"got {positions.dtype} {tuple(positions.shape)}")
    else:
        positions = reference.check_positions(positions, rows)
    return logits, positions


def check_sample(logits, positions, temperature, seed, *, threads=None, out=None):
    logits, positions = check_rows(logits, positions)
    if threads is not None:
        check_threads(threads)
    check_out(out, logits.shape[:1], np.int64)
    return (logits, positions,
            check_scalar(temperature, np.float64, "temperature", reference.check_temperature),
            check_scalar(seed, np.int64, "seed", reference.check_sampling_seed))


# --8<-- [start:sample]
def sample(logits, positions, temperature, seed, *, threads: int | None = None, out=None, stream=None):
    """The token per row of ``logits`` (T, V) at ``positions`` (T,) (each drawn token's absolute
    position) -> (T,) int64: the reference's ``sample``. ``temperature`` and ``seed``: numbers, or
    (1,) float64 / int64 device arrays (what a captured graph reads; 0: greedy argmax)."""
    logits, positions, d_temperature, d_seed = check_sample(logits, positions, temperature, seed,
                                                            threads=threads, out=out)
    rows, vocab = logits.shape
    d_out = output(out, (rows,), np.int64, stream)                                # [T] -1 until written
    if rows > 0:
        threads = threads or pow2_threads(vocab)
        sample_kernel(threads)[rows, threads, stream](
            to_device(logits, np.float32), to_device(positions, np.int64), d_temperature, d_seed, d_out)
    return deliver(d_out, out, logits, positions)
# --8<-- [end:sample]


def check_rejection_step(logits, positions, children, draft_logits, depths, temperature, seed, *,
                         threads=None, out=None, work=None):
    arrays = (logits, positions, children, draft_logits, depths)
    on_device = [is_device_array(a) for a in arrays]
    if any(on_device) and not all(on_device):
        raise ValueError("logits, positions, children, draft_logits and depths must all be host or all "
                         "device arrays")
    if not any(on_device):                                    # every value check of the reference
        logits, positions, children, draft_logits, depths = reference.check_rejection(*arrays)
    else:
        logits, positions = check_rows(logits, positions)
        rows, vocab = logits.shape
        for name, array, ndim in (("children", children, 2), ("depths", depths, 1)):
            if len(array.shape) != ndim or array.shape[0] != rows or array.dtype != np.int64:
                raise ValueError(f"{name} on the device must be int64 with {rows} rows, "
                                 f"got {array.dtype} {tuple(array.shape)}")
        if len(draft_logits.shape) != 2 or draft_logits.shape[1] != vocab or draft_logits.dtype != np.float32:
            raise ValueError(f"draft_logits on the device must be float32 (L, {vocab}), "
                             f"got {draft_logits.dtype} {tuple(draft_logits.shape)}")
    if threads is not None:
        check_threads(threads)
    rows, vocab = logits.shape
    check_out(out, (rows,), np.int64)
    if work is not None and not is_device_array(work):
        raise ValueError("work must be a device array (the kernel's scratch)")
    check_out(work, (rows, 2, vocab), np.float64, "work")
    return (logits, positions, children, draft_logits, depths,
            check_scalar(temperature, np.float64, "temperature", reference.check_temperature),
            check_scalar(seed, np.int64, "seed", reference.check_sampling_seed))


# --8<-- [start:rejection_step]
def rejection_step(logits, positions, children, draft_logits, depths, temperature, seed, *,
                   threads: int | None = None, out=None, work=None, stream=None):
    """Every node's outcome under recursive rejection sampling: the reference's ``rejection_step``.

    logits (T, V), positions (T,), children (T, K) tokens padded with -1, draft_logits (L, V),
    depths (T,) (row depths[i] of draft_logits is node i's q). Returns (T,) int64. ``work``: a
    (T, 2, V) float64 device scratch (allocated when not given); with device inputs, ``out``,
    ``work`` and device ``temperature``/``seed``, nothing is allocated.
    """
    logits, positions, children, draft_logits, depths, d_temperature, d_seed = check_rejection_step(
        logits, positions, children, draft_logits, depths, temperature, seed, threads=threads, out=out,
        work=work)
    rows, vocab = logits.shape
    d_out = output(out, (rows,), np.int64, stream)                                # [T]
    if rows > 0:
        d_work = work if work is not None else poisoned((rows, 2, vocab), np.float64, stream)   # [T, 2, V]
        threads = threads or pow2_threads(vocab)
        d_children = to_device(children, np.int64) if children.shape[1] else to_device(
            np.full((rows, 1), -1, np.int64))
        d_draft = to_device(draft_logits, np.float32) if draft_logits.shape[0] else to_device(
            np.zeros((1, vocab), np.float32))                                     # never read
        rejection_kernel(threads)[rows, threads, stream](
            to_device(logits, np.float32), to_device(positions, np.int64), d_children, d_draft,
            to_device(depths, np.int64), d_temperature, d_seed, d_work, d_out)
    return deliver(d_out, out, logits, positions)
# --8<-- [end:rejection_step]


def random_numbers(positions, indices, seed, purpose: int, gumbel_numbers: bool, out=None, stream=None):
    seed = reference.check_sampling_seed(seed)
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    positions = host_or_device(positions)
    indices = host_or_device(indices)
    rows = positions.shape[0]
    if not is_device_array(positions):
        positions = reference.check_positions(positions, rows)
    if not is_device_array(indices):
        indices = np.asarray(indices)
        if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer) or (
                indices.size and (indices.min() < 0 or indices.max() > 0xFFFFFFFF)):
            raise ValueError(f"indices must be (C,) integers in [0, 2^32), "
                             f"got {indices.dtype} {indices.shape}")
    columns = indices.shape[0]
    check_out(out, (rows, columns), np.float64)
    d_out = output(out, (rows, columns), np.float64, stream)                      # [T, C]
    if rows and columns:
        noise_kernel[(blocks(columns, NOISE_TPB), rows), NOISE_TPB, stream](
            to_device(positions, np.int64), to_device(indices, np.int64), np.uint64(seed), purpose,
            gumbel_numbers, d_out)
    return deliver(d_out, out, positions, indices)


def uniforms(positions, indices, seed: int, purpose: int, *, out=None, stream=None):
    """Uniforms (T, C) float64 of (seed, purpose, positions[t], indices[c]): the reference's, bit for bit."""
    return random_numbers(positions, indices, seed, purpose, False, out, stream)


def gumbel_noise(positions, vocab: int, seed: int, purpose: int = SAMPLE, *, out=None, stream=None):
    """Gumbel numbers (T, V) float64 of tokens 0..V-1: the reference's up to ``log``'s last bit."""
    return random_numbers(positions, np.arange(vocab), seed, purpose, True, out, stream)
