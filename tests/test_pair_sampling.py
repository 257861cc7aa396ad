"""Equivalence: kernels/sampling.py (numba.cuda) against ddtree/sampling.py (numpy).

Tolerances:
- the random bits, and so the uniforms, must be equal bit for bit (integer arithmetic, an exact
  conversion and an exact scaling);
- the Gumbel numbers -log(-log u) go through two logs, each within an ulp of exact on both sides
  but not always the same ulp (numpy's SIMD log and libm's, which the simulator runs, disagree on
  about 0.4% of inputs; CUDA's log is another implementation): |diff| <= 4 eps64 |g| + eps64 covers
  two ulps through each log;
- the tokens must be equal. They can differ only when a row's two best scores lie within that
  rounding of each other: ``test_a_draw_moves_only_at_a_boundary`` counts how rarely that happens
  (P(gap < d) <= e^d - 1 for Gumbel-max), ``test_log_rounding_moves_a_handmade_boundary_draw``
  builds such a row and shows the draw move.
"""

import math

import numpy as np
import pytest
from numba import cuda

from ddtree import sampling as reference
from kernels import device
from kernels import sampling as kernel
from tests.helpers import assert_close, assert_exact, no_transfers

EPS64 = float(np.finfo(np.float64).eps)
SEED = 2 ** 62 + 5


def _logits(rows, vocab, seed=0, scale=2.0):
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


# --------------------------------------------------------------------------------------- numbers

@cuda.jit
def _philox_words(counters, keys, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        words = kernel.philox(counters[i, 0], counters[i, 1], counters[i, 2], counters[i, 3],
                              keys[i, 0], keys[i, 1])
        for w in range(4):
            out[i, w] = words[w]


def test_philox_device_function_matches_the_known_answers():
    from tests.test_sampling import PHILOX_KAT

    counters = np.array([c for c, _, _ in PHILOX_KAT], np.uint64)
    keys = np.array([k for _, k, _ in PHILOX_KAT], np.uint64)
    out = cuda.to_device(np.zeros((len(PHILOX_KAT), 4), np.uint64))
    _philox_words[1, 32](cuda.to_device(counters), cuda.to_device(keys), out)
    assert out.copy_to_host().tolist() == [list(e) for _, _, e in PHILOX_KAT]


@pytest.mark.parametrize("purpose", reference.PURPOSES)
def test_uniforms_match_bit_for_bit(purpose):
    positions = np.array([0, 9, 2 ** 40 + 3], np.int64)
    indices = np.array([0, 1, 2, 36, 163839, 2 ** 32 - 1], np.int64)
    assert_exact(kernel.uniforms(positions, indices, SEED, purpose),
                 reference.uniforms(positions, indices, SEED, purpose))


def test_gumbel_noise_matches_up_to_log_rounding():
    positions = np.array([3, 2 ** 33 + 1, 77], np.int64)
    expected = reference.gumbel_noise(positions, 150, 11)
    actual = kernel.gumbel_noise(positions, 150, 11)
    assert_close(actual, expected, rtol=4 * EPS64, atol=EPS64)


def test_uniforms_out_on_the_device_allocates_and_copies_nothing():
    positions = cuda.to_device(np.arange(2, dtype=np.int64))
    indices = cuda.to_device(np.arange(5, dtype=np.int64))
    out = cuda.to_device(np.full((2, 5), np.nan))
    with no_transfers():
        assert kernel.uniforms(positions, indices, 3, reference.DRAFT, out=out) is out
    assert_exact(out.copy_to_host(), reference.uniforms(np.arange(2), np.arange(5), 3, reference.DRAFT))


# --------------------------------------------------------------------------------------- sample

@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.0])
@pytest.mark.parametrize("rows, vocab, threads", [(5, 70, 32), (3, 13, 32), (2, 130, 64)])
def test_sample_matches_reference(temperature, rows, vocab, threads):
    logits = _logits(rows, vocab, seed=vocab)
    positions = np.array([5, 2 ** 40 + 1, 17, 0, 999][:rows], np.int64)
    expected = reference.sample(logits, positions, temperature, SEED)
    actual = kernel.sample(logits, positions, temperature, SEED, threads=threads)   # -1 poison until written
    assert actual.dtype == np.int64
    assert_exact(actual, expected)


def test_sample_ties_and_specials_match_numpy():
    logits = np.array([[1, 3, 3, 0], [np.nan, 1, np.nan, 2], [-np.inf] * 4, [np.inf, 0, np.inf, 1]],
                      np.float32)
    for temperature in (0.0, 0.7):
        assert_exact(kernel.sample(logits, [4, 5, 6, 7], temperature, 1),
                     reference.sample(logits, [4, 5, 6, 7], temperature, 1))


def test_sample_reads_temperature_and_seed_from_the_device():
    """With device inputs, out, temperature and seed nothing is allocated; writing new values into
    the (1,) arrays changes the draws (what a captured CUDA graph relies on)."""
    logits = _logits(4, 40, seed=3)
    positions = np.array([8, 9, 10, 11], np.int64)
    d_logits, d_positions = cuda.to_device(logits), cuda.to_device(positions)
    temperature, seed = cuda.to_device(np.array([0.0])), cuda.to_device(np.array([5], np.int64))
    out = cuda.to_device(np.full(4, -1, np.int64))
    for t, s in ((0.0, 5), (1.0, 5), (1.0, 6), (0.5, 6)):
        temperature.copy_to_device(np.array([t]))
        seed.copy_to_device(np.array([s], np.int64))
        with no_transfers():
            assert kernel.sample(d_logits, d_positions, temperature, seed, threads=32, out=out) is out
        assert_exact(out.copy_to_host(), reference.sample(logits, positions, t, s))


@pytest.mark.parametrize("call, message", [
    (lambda: kernel.sample(np.zeros((2, 4), np.float32), [0, 1], -1.0, 0), "temperature"),
    (lambda: kernel.sample(np.zeros((2, 4), np.float32), [0, 1], 1.0, -1), "seed"),
    (lambda: kernel.sample(np.zeros((2, 4), np.float32), [0], 1.0, 0), "positions"),
    (lambda: kernel.sample(np.zeros((2, 4), np.float32), [0, 1], cuda.to_device(np.zeros(1, np.float32)), 0),
     "temperature on the device must be a \\(1,\\) float64"),
    (lambda: kernel.sample(np.zeros((2, 4), np.float32), [0, 1], 1.0, cuda.to_device(np.zeros(2, np.int64))),
     "seed on the device"),
    (lambda: kernel.sample(cuda.to_device(np.zeros((2, 4))), [0, 1], 1.0, 0),
     "logits on the device must be float32"),
    (lambda: kernel.sample(np.zeros((2, 4), np.float32), [0, 1], 1.0, 0, threads=48), "threads"),
    (lambda: kernel.uniforms([0], [0], 0, 7), "purpose"),
])
def test_bad_inputs_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------- rejection_step

def _rejection_case(rows, vocab, depths, seed, holes=False, spread=0.9):
    """Logits near a drafter (``spread``: how far), 1-3 children per row, the last row a leaf."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(vocab) * 2
    logits = (base + rng.standard_normal((rows, vocab)) * 0.6).astype(np.float32)
    draft = (base + rng.standard_normal((depths, vocab)) * spread).astype(np.float32)
    children = np.full((rows, 3), -1, np.int64)
    for i in range(rows - 1):
        kids = rng.choice(vocab, size=3 if i % 3 else 1 + i % 2, replace=False)
        children[i, :kids.size] = kids
    if holes:
        draft[:, children[1, 1]] = -np.inf                                       # q(child) = 0: padding
        logits[:, children[2, 0]] = -np.inf                                     # p(child) = 0: rejected
    node_depths = rng.integers(0, depths, rows)
    positions = 1000 + node_depths + 1
    return logits, positions, children, draft, node_depths


class CountingRandom(reference.KeyedRandom):
    """The keyed random source, counting the rejected children per position."""

    def __init__(self, seed):
        super().__init__(seed)
        self.rejected = {}

    def accepts(self, position, index, target, draft):
        verdict = super().accepts(position, index, target, draft)
        self.rejected[position] = self.rejected.get(position, 0) + (not verdict)
        return verdict


def _rejections(case, temperature, seed) -> list[int]:
    """Children each row rejected (the reference's verify_node, one row at a time)."""
    logits, positions, children, draft, node_depths = case
    counts = []
    for i in range(len(logits)):
        random = CountingRandom(seed)
        kids = children[i][children[i] >= 0]
        reference.verify_node(logits[i], draft[node_depths[i]] if kids.size else None, kids, temperature,
                              int(positions[i]), random)
        counts.append(sum(random.rejected.values()))
    return counts


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 2.0])
def test_rejection_step_matches_reference(temperature):
    """Rows that accept their first child, rows that reject one, two or all three, leaves, and q or
    p holes: every branch of the kernel against the reference."""
    accepted, rejected = 0, []
    for seed, holes, spread in ((0, False, 0.5), (1, True, 1.5), (2, False, 3.0)):
        case = _rejection_case(8, 41, 3, seed, holes, spread)
        expected = reference.rejection_step(*case, temperature, seed)
        actual = kernel.rejection_step(*case, temperature, seed, threads=32)    # -1 poison until written
        assert_exact(actual, expected)
        accepted += sum(token in row for token, row in zip(expected, case[2], strict=True))
        rejected += _rejections(case, temperature, seed) if temperature > 0 else []
    if temperature > 0:                                   # the cases reach every branch
        assert accepted > 0 and max(rejected) == 3 and 2 in rejected


def test_rejection_step_with_device_buffers_allocates_and_copies_nothing():
    case = _rejection_case(5, 37, 2, seed=4)
    d_case = [cuda.to_device(np.ascontiguousarray(a)) for a in case]
    temperature, seed = cuda.to_device(np.array([0.8])), cuda.to_device(np.array([3], np.int64))
    out = cuda.to_device(np.full(5, -1, np.int64))
    work = cuda.to_device(np.full((5, 2, 37), np.nan))
    with no_transfers():
        assert kernel.rejection_step(*d_case, temperature, seed, threads=32, out=out, work=work) is out
    assert_exact(out.copy_to_host(), reference.rejection_step(*case, 0.8, 3))


@pytest.mark.parametrize("change, message", [
    (lambda c: (c[0], c[1], np.full((6, 2), 50), *c[3:]), "children must be tokens"),
    (lambda c: (c[0], c[1], np.array([[1, 1, -1]] * 6), *c[3:]), "distinct tokens first"),
    (lambda c: (c[0], c[1], c[2], c[3], np.full(6, 3)), "depths of nodes with children"),
    (lambda c: (np.full_like(c[0], np.nan), *c[1:]), "logits rows need a finite maximum"),
    (lambda c: (c[0], c[1], c[2], np.zeros((3, 40), np.float32), c[4]), "draft_logits must have V = 41"),
])
def test_rejection_step_refuses_bad_inputs_like_the_reference(change, message):
    case = change(_rejection_case(6, 41, 3, seed=0))
    for implementation in (reference.rejection_step, kernel.rejection_step):
        with pytest.raises(ValueError, match=message):
            implementation(*case, 1.0, 0)


# ------------------------------------------------------------------------------- where they differ

def _libm_gumbel(u):
    """-log(-log u) with libm's log: what the simulator's kernel computes."""
    return np.vectorize(lambda x: -math.log(-math.log(x)), otypes=[np.float64])(u)


def test_a_draw_moves_only_at_a_boundary():
    """2000 draws over 512 tokens, scored with numpy's log and with libm's. The two logs disagree
    on some inputs; a draw can move only when its two best scores lie within the largest score
    difference d of each other, which for Gumbel-max happens with probability <= e^d - 1 (the
    exponential race: the gap exceeds log(1 + Y / E1), Y ~ Exp(rest), E1 ~ Exp(total)): with d
    about 1e-14, about 2e-11 such draws are expected here. So: the logs differ, no draw sits
    within d of a tie, and no draw moved. (numpy's own float64 log is an AVX-512 one; on a CPU
    without AVX-512 numpy calls libm's log too, the scores are equal, and the test skips once it
    has checked that no draw moved.)"""
    rows, vocab, temperature = 2000, 512, 1.0
    logits = _logits(rows, vocab, seed=9).astype(np.float64)
    u = reference.uniforms(np.arange(rows), np.arange(vocab), 7, reference.SAMPLE)     # [T, V]
    numpy_scores = logits / temperature - np.log(-np.log(u))
    libm_scores = logits / temperature + _libm_gumbel(u)
    differing = int(np.count_nonzero(numpy_scores != libm_scores))
    d = float(np.abs(numpy_scores - libm_scores).max())
    top2 = np.sort(numpy_scores, axis=-1)[:, -2:]
    close_calls = int(np.count_nonzero(top2[:, 1] - top2[:, 0] <= 2 * d))
    moved = int(np.count_nonzero(np.argmax(numpy_scores, -1) != np.argmax(libm_scores, -1)))
    if differing == 0:                   # numpy without its AVX-512 log calls libm's: nothing can move
        assert moved == 0
        pytest.skip("numpy's log and libm's agree on every number here (this CPU's numpy uses libm's log)")
    assert d < 1e-13                                                    # the logs disagree, by an ulp or two
    assert moved <= close_calls
    assert close_calls <= rows * math.expm1(2 * d) + 0.5                # i.e. none: the bound rounds to 0


@pytest.mark.skipif(not device.SIMULATOR, reason="reproduces the simulator's libm log on the host")
def test_log_rounding_moves_a_handmade_boundary_draw():
    """Two tokens, logits (0, x): the temperature T* = x / (g0 - g1) puts the draw exactly on the
    boundary. Within a few ulps of T* there are temperatures at which numpy's log and libm's log
    (the kernel's, in the simulator) pick different tokens; a few hundred ulps away they agree."""
    seed = 7
    positions = np.arange(4000)
    u = reference.uniforms(positions, [0, 1], seed, reference.SAMPLE)                   # [P, 2]
    numpy_g, libm_g = -np.log(-np.log(u)), _libm_gumbel(u)
    for position, token in np.argwhere(numpy_g != libm_g):
        other = 1 - token
        gap = numpy_g[position, token] - numpy_g[position, other]
        logits = np.zeros((1, 2), np.float32)
        logits[0, other] = 1.0 if gap > 0 else -1.0                                    # a crossing T > 0
        boundary = float(logits[0, other]) / gap
        for step in range(-100, 100):
            t = boundary + step * np.spacing(boundary)
            numpy_token = int(reference.sample(logits, [position], t, seed)[0])
            libm_token = int(np.argmax(logits[0] / t + libm_g[position]))
            if numpy_token != libm_token:
                assert int(kernel.sample(logits, [position], t, seed, threads=32)[0]) == libm_token
                away = boundary * 1.001
                assert_exact(kernel.sample(logits, [position], away, seed, threads=32),
                             reference.sample(logits, [position], away, seed))
                return
    pytest.skip("numpy's log and libm's agree on every number tried here")
