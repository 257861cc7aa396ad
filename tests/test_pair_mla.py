"""kernels/mla.py and kernels/mla_unfused.py (numba.cuda) against ddtree/mla.py (numpy): absorbed MLA
attention and projections.

Tolerance: the kernels sum float32 dot products (R + dr terms, then up to S weighted rows) in a
different order from numpy's einsum, and rescale an online softmax tile by tile; both sides
stay within a few float32 ulps of the exact result. Outputs are O(0.1..1), so rtol 1e-5 with
atol 1e-6 (for entries that cancel to near zero) leaves ~10x headroom.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ddtree import mla as ref
from ddtree.config import preset
from ddtree.rope import softmax_scale
from ddtree.tree import visibility
from kernels import mla as gpu
from kernels import mla_unfused as unfused
from kernels.bench.case import ancestor_paths
from kernels.device import cuda, is_device_array, poisoned, to_device
from tests.helpers import assert_close, assert_exact, no_transfers

RTOL, ATOL = 1e-5, 1e-6


def dot_atol(terms: int) -> float:
    """A float32 dot of ``terms`` unit-variance products summed in two orders (numpy's pairwise
    sum; the kernel's sequential loop, fused multiply-adds on a GPU): the results differ by a
    random walk of about eps32 * terms / 3; twice eps32 * terms covers it (outputs near 0 by
    cancellation have no relative slack)."""
    return 2 * float(np.finfo(np.float32).eps) * terms


def tree_visibility(parents: np.ndarray) -> np.ndarray:
    """Ancestor mask by brute force, independent of ddtree.tree.visibility's recurrence: row i sees
    every node met walking the parent links up from i (itself included) to the root."""
    rows = parents.size
    visible = np.zeros((rows, rows), dtype=bool)
    for i in range(rows):
        node = i
        while node >= 0:
            visible[i, node] = True
            node = parents[node]
    return visible


def random_parents(rng: np.random.Generator, rows: int) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, rows)])


def make_mask(kind: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "causal":
        return ref.causal_visibility(rows)
    if kind == "tree":
        return tree_visibility(random_parents(rng, rows))
    if kind == "self":              # causal, but every other row is a padded row that sees only itself
        visible = ref.causal_visibility(rows)
        visible[1::2] = np.eye(rows, dtype=bool)[1::2]
        return visible
    if kind == "tail-self":         # the last two rows see only themselves: their first tile is all masked
        visible = ref.causal_visibility(rows)
        visible[-2:] = np.eye(rows, dtype=bool)[-2:]
        return visible
    if kind == "prefix-only":       # no new row visible at all: every row attends to the prefix only
        return np.zeros((rows, rows), dtype=bool)
    raise ValueError(kind)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    rows: int              # T
    prefix: int            # P
    mask: str
    heads: int = 3         # H
    rank: int = 24         # R
    rope: int = 6          # dr
    threads: int = 32      # block size = key tile
    spare: int = 3         # cache slots past S, poisoned with NaN (never read)

    def __str__(self):
        return self.name


CASES = [
    Case("prefill-causal", rows=7, prefix=0, mask="causal"),
    Case("causal-after-prefix", rows=5, prefix=37, mask="causal"),           # 42 keys: 2 tiles
    Case("decode-one-row", rows=1, prefix=45, mask="causal"),
    Case("tree-after-prefix", rows=9, prefix=20, mask="tree"),
    Case("tree-no-prefix", rows=6, prefix=0, mask="tree", heads=2),
    Case("self-only-no-prefix", rows=5, prefix=0, mask="self", heads=2),
    Case("self-only-after-prefix", rows=4, prefix=11, mask="self", rank=13, rope=4),
    Case("prefix-only", rows=3, prefix=5, mask="prefix-only", heads=2),
    Case("masked-first-tile", rows=34, prefix=0, mask="tail-self", heads=1, rank=8, rope=2),
    Case("tile-64", rows=3, prefix=70, mask="tree", heads=2, rank=10, rope=4, threads=64),
    Case("tile-128", rows=2, prefix=130, mask="causal", heads=1, rank=9, rope=2, threads=128),
]


def make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = case.prefix + case.rows
    q_lat = rng.standard_normal((case.rows, case.heads, case.rank)).astype(np.float32)
    q_pe = rng.standard_normal((case.rows, case.heads, case.rope)).astype(np.float32)
    cache_latent = np.full((keys + case.spare, case.rank), np.nan, np.float32)
    cache_rope = np.full((keys + case.spare, case.rope), np.nan, np.float32)
    cache_latent[:keys] = rng.standard_normal((keys, case.rank))
    cache_rope[:keys] = rng.standard_normal((keys, case.rope))
    visible = make_mask(case.mask, case.rows, rng)
    scale = 1.0 / np.sqrt(case.rank + case.rope)
    return q_lat, q_pe, cache_latent, cache_rope, case.prefix, visible, scale


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_absorb_matches_numpy(case):
    q_lat, q_pe, latent, rope, prefix, visible, scale = make_inputs(case)
    expected = ref.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale)
    actual = gpu.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale, threads=case.threads)
    assert isinstance(actual, np.ndarray)
    assert np.isfinite(actual).all(), "some output was not written (the buffer starts as NaN)"
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name=f"o_lat {case}")


def test_self_only_row_returns_its_own_latent():
    """A row that sees only itself (no prefix) puts probability 1 on its own cache row."""
    case = Case("self", rows=5, prefix=0, mask="self", heads=2)
    q_lat, q_pe, latent, rope, prefix, visible, scale = make_inputs(case)
    out = gpu.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale, threads=32)
    for row in (1, 3):
        assert_close(out[row], np.broadcast_to(latent[row], out[row].shape), rtol=RTOL, atol=ATOL)


def test_masked_cache_rows_are_never_read():
    """New key 2 is visible to no row; NaN in its cache row must not reach any output."""
    case = Case("hidden-key", rows=4, prefix=6, mask="causal", heads=2)
    q_lat, q_pe, latent, rope, prefix, visible, scale = make_inputs(case, seed=3)
    visible[:, 2] = False
    expected = ref.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale)
    latent[prefix + 2] = np.nan
    rope[prefix + 2] = np.nan
    actual = gpu.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale, threads=32)
    assert_close(actual, expected, rtol=RTOL, atol=ATOL)


SMALL = Case("small-tree", rows=4, prefix=33, mask="tree", heads=2)       # 37 keys: 2 tiles of 32


def test_attention_is_deterministic():
    inputs = make_inputs(SMALL, seed=5)
    first = gpu.attention_absorb(*inputs, threads=32)
    second = gpu.attention_absorb(*inputs, threads=32)
    assert_exact(first.view(np.uint32), second.view(np.uint32), name="bits of o_lat")


def test_device_arrays_stay_on_the_device():
    q_lat, q_pe, latent, rope, prefix, visible, scale = make_inputs(SMALL, seed=7)
    host = gpu.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale, threads=32)
    out = gpu.attention_absorb(to_device(q_lat), to_device(q_pe), to_device(latent), to_device(rope),
                               prefix, visible, scale, threads=32)
    assert is_device_array(out)
    assert_exact(out.copy_to_host().view(np.uint32), host.view(np.uint32), name="bits, device vs host")
    w_uk = np.random.default_rng(8).standard_normal((3, 5, 24)).astype(np.float32)
    q_nope = np.random.default_rng(9).standard_normal((5, 3, 5)).astype(np.float32)
    q_dev = gpu.absorb_query(to_device(q_nope), to_device(w_uk))
    assert is_device_array(q_dev)
    o_dev = gpu.absorb_output(q_dev, to_device(w_uk))
    assert is_device_array(o_dev)
    assert_close(o_dev.copy_to_host(), ref.absorb_output(ref.absorb_query(q_nope, w_uk), w_uk),
                 rtol=RTOL, atol=ATOL)


def test_device_mask_and_out_buffer_allocate_and_copy_nothing():
    q_lat, q_pe, latent, rope, prefix, visible, scale = make_inputs(SMALL, seed=7)
    expected = ref.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale)
    inputs = [to_device(a) for a in (q_lat, q_pe, latent, rope)]
    d_visible = to_device(visible)                                # bool, (T, T); P > 0: not copied back
    d_out = to_device(np.zeros(q_lat.shape, np.float32))
    with no_transfers():
        result = gpu.attention_absorb(*inputs, prefix, d_visible, scale, threads=32, out=d_out,
                                      stream=cuda.default_stream())
    assert result is d_out
    assert_close(d_out.copy_to_host(), expected, rtol=RTOL, atol=ATOL)


def test_projections_into_out_buffers_allocate_and_copy_nothing():
    rng = np.random.default_rng(10)
    q_nope = to_device(rng.standard_normal((3, 2, 5)).astype(np.float32))
    w_uk = to_device(rng.standard_normal((2, 5, 7)).astype(np.float32))
    w_uv = to_device(rng.standard_normal((2, 4, 7)).astype(np.float32))
    q_lat, o = to_device(np.zeros((3, 2, 7), np.float32)), to_device(np.zeros((3, 2, 4), np.float32))
    with no_transfers():
        assert gpu.absorb_query(q_nope, w_uk, out=q_lat, stream=cuda.default_stream()) is q_lat
        assert gpu.absorb_output(q_lat, w_uv, out=o, stream=cuda.default_stream()) is o
    expected = ref.absorb_output(ref.absorb_query(q_nope.copy_to_host(), w_uk.copy_to_host()),
                                 w_uv.copy_to_host())
    assert_close(o.copy_to_host(), expected, rtol=RTOL, atol=ATOL)


def test_device_mask_without_prefix_is_checked_like_numpy():
    visible = np.array([[True, False], [False, False]])          # row 1 sees nothing, no prefix
    q, q_pe = np.ones((2, 1, 4), np.float32), np.ones((2, 1, 2), np.float32)
    latent, rope = np.ones((2, 4), np.float32), np.ones((2, 2), np.float32)
    expected = numpy_error(lambda: ref.attention_absorb(q, q_pe, latent, rope, 0, visible, 1.0))
    actual = numpy_error(lambda: gpu.attention_absorb(q, q_pe, latent, rope, 0, to_device(visible), 1.0))
    assert actual == expected
    with pytest.raises(ValueError, match=r"visible must be a \(2, 2\) bool array"):
        gpu.attention_absorb(q, q_pe, latent, rope, 1, to_device(visible.astype(np.uint8)), 1.0)


# T, H, dn (or dv), R: irregular, and R or dv spanning more than one block of 32 threads
PROJECTION_SHAPES = [(1, 1, 3, 5), (5, 3, 7, 24), (2, 2, 33, 40), (3, 1, 70, 9)]


@pytest.mark.parametrize("rows, heads, width, rank", PROJECTION_SHAPES)
def test_absorb_query_matches_numpy(rows, heads, width, rank):
    rng = np.random.default_rng(rows * 100 + rank)
    q_nope = rng.standard_normal((rows, heads, width)).astype(np.float32)
    w_uk = rng.standard_normal((heads, width, rank)).astype(np.float32)
    actual = gpu.absorb_query(q_nope, w_uk)
    assert_close(actual, ref.absorb_query(q_nope, w_uk), rtol=RTOL, atol=dot_atol(width), name="q_lat")
    assert_exact(gpu.absorb_query(q_nope, w_uk).view(np.uint32), actual.view(np.uint32), name="rerun bits")


@pytest.mark.parametrize("rows, heads", [(1, 3), (11, 5)])
def test_absorb_query_rotates_the_queries_with_apply_ropes_bits(rows, heads):
    """``rope=``: the same launch rotates the rope columns of a strided (T, H, dr) view of the query
    buffer in place, with ``apply_rope``'s bits, leaves every other column alone (NaN there stays
    NaN) and gives q_lat the bits it has without the rotation."""
    from kernels.rope import apply_rope

    nope, rope_dim, rank = 7, 6, 9
    rng = np.random.default_rng(rows + heads)
    q = rng.standard_normal((rows, heads, nope + rope_dim)).astype(np.float32)
    q[:, :, 0] = np.nan                                          # a nope column the rotation must not touch
    w_uk = rng.standard_normal((heads, nope, rank)).astype(np.float32)
    positions = (np.arange(rows) * 7 + 3).astype(np.int64)
    freqs = (1.0 / 10000.0 ** (np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)   # [dr/2]
    d_q = to_device(q)
    q_nope, q_pe = d_q[:, :, :nope], d_q[:, :, nope:]
    q_lat = gpu.absorb_query(q_nope, w_uk, rope=(q_pe, to_device(positions), to_device(freqs), 0.75))
    rotated = d_q.copy_to_host()
    expected = apply_rope(np.ascontiguousarray(q[:, :, nope:]), positions, freqs, 0.75)
    assert_exact(rotated[:, :, nope:].view(np.uint32), expected.view(np.uint32), name="rotated q_pe")
    assert_exact(rotated[:, :, :nope].view(np.uint32), q[:, :, :nope].view(np.uint32),
                 name="q_nope untouched")
    alone = gpu.absorb_query(np.ascontiguousarray(q[:, :, :nope]), w_uk)
    assert_exact(q_lat.copy_to_host().view(np.uint32), alone.view(np.uint32), name="q_lat")


def test_absorb_query_names_a_wrong_rope():
    q_nope = to_device(np.zeros((2, 3, 4), np.float32))
    w_uk = np.zeros((3, 4, 5), np.float32)
    positions, freqs = to_device(np.arange(2)), to_device(np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"rope must be None or a tuple \(q_pe, positions, inv_freq"):
        gpu.absorb_query(q_nope, w_uk, rope=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="rope's q_pe must be a device array"):
        gpu.absorb_query(q_nope, w_uk, rope=(np.zeros((2, 3, 4), np.float32), positions, freqs, 1.0))
    with pytest.raises(ValueError, match=r"rope's q_pe must have shape \(2, 3, dr\)"):
        gpu.absorb_query(q_nope, w_uk, rope=(to_device(np.zeros((2, 2, 4), np.float32)), positions, freqs,
                                             1.0))


@pytest.mark.parametrize("rows, heads, width, rank", PROJECTION_SHAPES)
def test_absorb_output_matches_numpy(rows, heads, width, rank):
    rng = np.random.default_rng(rows * 100 + rank + 1)
    o_lat = rng.standard_normal((rows, heads, rank)).astype(np.float32)
    w_uv = rng.standard_normal((heads, width, rank)).astype(np.float32)
    actual = gpu.absorb_output(o_lat, w_uv)
    assert_close(actual, ref.absorb_output(o_lat, w_uv), rtol=RTOL, atol=dot_atol(rank), name="o")
    assert_exact(gpu.absorb_output(o_lat, w_uv).view(np.uint32), actual.view(np.uint32), name="rerun bits")


@pytest.mark.parametrize("projection", ["absorb_query", "absorb_output"])
def test_absorb_rows_are_batch_invariant_and_all_written(projection):
    """11 rows (a pass of ROWS_PER_PASS and a partial one), dn = 37 over uneven slices, R past a
    block of lanes: NaN-poisoned outputs all written, and each row bit-identical to itself run
    alone or in another batch (the engine's tree rows equal its AR rows)."""
    rng = np.random.default_rng(21)
    rows, heads, width, rank = 11, 3, 37, 45
    if projection == "absorb_query":
        x, weight = rng.standard_normal((rows, heads, width)), rng.standard_normal((heads, width, rank))
        call, shape = gpu.absorb_query, (rows, heads, rank)
    else:
        x, weight = rng.standard_normal((rows, heads, rank)), rng.standard_normal((heads, width, rank))
        call, shape = gpu.absorb_output, (rows, heads, width)
    x, weight = x.astype(np.float32), to_device(weight.astype(np.float32))
    together = poisoned(shape)
    call(x, weight, out=together)
    together = together.copy_to_host()
    assert not np.isnan(together).any(), "an output was never written"
    assert_close(together, getattr(ref, projection)(x, weight.copy_to_host()), rtol=RTOL,
                 atol=dot_atol(max(width, rank)))
    for t in (0, 7, 8, rows - 1):
        assert_exact(call(x[t:t + 1], weight)[0].view(np.uint32), together[t].view(np.uint32),
                     name=f"row {t} alone")
    for first, last in ((1, 3), (2, 5)):                          # passes of two and of four rows
        assert_exact(call(x[first:last], weight).view(np.uint32), together[first:last].view(np.uint32),
                     name=f"rows {first}..{last - 1}")
    assert_exact(call(x[3:], weight).view(np.uint32), together[3:].view(np.uint32), name="rows 3..")


def numpy_error(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("visible", [
    np.array([[True, False], [False, False]]),          # row 1 sees nothing and there is no prefix
    np.ones((2, 3), dtype=bool),                         # wrong shape
    np.ones((2, 2), dtype=np.int8),                      # wrong dtype
], ids=["all-masked-row", "shape", "dtype"])
def test_bad_masks_raise_like_numpy(visible):
    q = np.ones((2, 1, 4), np.float32)
    q_pe = np.ones((2, 1, 2), np.float32)
    latent, rope = np.ones((2, 4), np.float32), np.ones((2, 2), np.float32)
    expected = numpy_error(lambda: ref.attention_absorb(q, q_pe, latent, rope, 0, visible, 1.0))
    actual = numpy_error(lambda: gpu.attention_absorb(q, q_pe, latent, rope, 0, visible, 1.0))
    assert actual == expected


def test_bad_shapes_are_named():
    q, q_pe = np.ones((2, 1, 4), np.float32), np.ones((2, 1, 2), np.float32)
    latent, rope = np.ones((5, 4), np.float32), np.ones((5, 2), np.float32)
    visible = ref.causal_visibility(2)
    with pytest.raises(ValueError, match="cache_latent must be"):
        gpu.attention_absorb(q, q_pe, latent[:3], rope, 2, visible, 1.0)        # 4 keys, 3 rows
    with pytest.raises(ValueError, match="cache_rope must be"):
        gpu.attention_absorb(q, q_pe, latent, np.ones((5, 3), np.float32), 0, visible, 1.0)
    with pytest.raises(ValueError, match="q_pe must be"):
        gpu.attention_absorb(q, np.ones((2, 2, 2), np.float32), latent, rope, 0, visible, 1.0)
    with pytest.raises(ValueError, match="threads must be"):
        gpu.attention_absorb(q, q_pe, latent, rope, 0, visible, 1.0, threads=48)
    with pytest.raises(ValueError, match="prefix_len must be"):
        gpu.attention_absorb(q, q_pe, latent, rope, -1, visible, 1.0)
    with pytest.raises(ValueError, match="q_lat must be float32 on the device"):
        gpu.attention_absorb(to_device(q.astype(np.float64)), q_pe, latent, rope, 0, visible, 1.0)
    with pytest.raises(ValueError, match="w_uk must be"):
        gpu.absorb_query(np.ones((2, 3, 4), np.float32), np.ones((3, 5, 6), np.float32))
    with pytest.raises(ValueError, match="w_uv must be"):
        gpu.absorb_output(np.ones((2, 3, 4), np.float32), np.ones((3, 5, 6), np.float32))


def test_empty_rows():
    q = np.zeros((0, 2, 4), np.float32)
    out = gpu.attention_absorb(q, np.zeros((0, 2, 2), np.float32), np.ones((3, 4), np.float32),
                               np.ones((3, 2), np.float32), 3, np.zeros((0, 0), bool), 1.0)
    assert out.shape == (0, 2, 4)


# --- Kimi K2.6 per-layer dimensions: real GPU only ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_attention_absorb_kimi_dims(rows):
    config = preset("kimi-k2.6")
    heads, rank, rope_dim = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    prefix = 4096
    rng = np.random.default_rng(rows)
    keys = prefix + rows
    # q ~ 0.2 N(0, 1) gives scores with a standard deviation of ~0.7 at the YaRN softmax scale
    q_lat = rng.standard_normal((rows, heads, rank), dtype=np.float32) * np.float32(0.2)
    q_pe = rng.standard_normal((rows, heads, rope_dim), dtype=np.float32) * np.float32(0.2)
    latent = np.full((keys + 64, rank), np.nan, np.float32)
    rope = np.full((keys + 64, rope_dim), np.nan, np.float32)
    latent[:keys] = rng.standard_normal((keys, rank), dtype=np.float32)
    rope[:keys] = rng.standard_normal((keys, rope_dim), dtype=np.float32)
    visible = tree_visibility(random_parents(rng, rows))
    scale = softmax_scale(config)
    expected = ref.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale)
    actual = gpu.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale)
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name="o_lat, Kimi K2.6 dims")
    w_uk = rng.standard_normal((heads, config.qk_nope_head_dim, rank), dtype=np.float32)
    q_nope = rng.standard_normal((rows, heads, config.qk_nope_head_dim), dtype=np.float32)
    # 128-term (query) and 512-term (output) dots of O(1) values: rtol 1e-5 after an atol of 1e-5
    assert_close(gpu.absorb_query(q_nope, w_uk), ref.absorb_query(q_nope, w_uk), rtol=RTOL, atol=1e-5)
    w_uv = rng.standard_normal((heads, config.v_head_dim, rank), dtype=np.float32)
    assert_close(gpu.absorb_output(actual, w_uv), ref.absorb_output(actual, w_uv), rtol=RTOL, atol=1e-5)


# ------------------------------------------------------------------------- attention over paths

V1 = gpu.PathsPlan()                                  # one block per (row, head)


def V2(splits):                                       # noqa: N802 (a plan's name) Z splits
    return gpu.PathsPlan(splits=splits)


def V3(heads_per_block, splits=1):                    # noqa: N802 (a plan's name) G heads
    return gpu.PathsPlan(splits=splits, heads_per_block=heads_per_block)


V5 = gpu.PathsPlan(unfused=True)                      # unfused GEMMs


def run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, plan=None,
              partials_out=None, scores_out=None):
    """attention_paths on device copies with ``plan`` (None: its default, the engine's
    ``paths_plan`` for these dims and C), its outputs (partials, version 5's scores) poisoned with
    NaN first; ``partials_out`` and ``scores_out`` (lists), when given, receive the partials and
    version 5's scores as the kernels left them."""
    rows, heads, rank = q_lat.shape
    capacity = cache_latent.shape[0]
    chosen = plan or gpu.paths_plan(heads, rank, q_pe.shape[2], capacity)
    groups = chosen.partial_groups(capacity)
    partials = poisoned((rows, heads, groups, rank + 2)) if groups else None
    scores = poisoned((rows * heads, capacity)) if chosen.unfused else None
    out = gpu.attention_paths(*(to_device(a) for a in (q_lat, q_pe, cache_latent, cache_rope)),
                              to_device(np.array([prefix], np.int64)), to_device(depths), to_device(paths),
                              scale, plan=plan, scores=scores, partials=partials, out=poisoned(q_lat.shape))
    if partials_out is not None:
        partials_out.append(partials.copy_to_host())
    if scores_out is not None:
        scores_out.append(scores.copy_to_host())
    return out.copy_to_host()


def random_tree_inputs(rows: int, prefix: int, rank: int, rope: int, heads: int, spare: int = 3):
    """A random tree of ``rows`` nodes after ``prefix`` cached keys, ``spare`` NaN slots past S:
    (q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale) and its parents."""
    rng = np.random.default_rng(rows + prefix)
    parents = random_parents(rng, rows)
    depths, paths = ancestor_paths(parents)
    case = Case("paths", rows=rows, prefix=prefix, mask="causal", heads=heads, rank=rank, rope=rope,
                spare=spare)
    q_lat, q_pe, cache_latent, cache_rope, _, _, scale = make_inputs(case, seed=rows)
    return (q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale), parents


def check_random_tree(rows: int, prefix: int, rank: int, rope: int, heads: int, name: str, plan=None,
                      spare: int = 3) -> None:
    """attention_paths with ``plan`` on a random tree of ``rows`` nodes after ``prefix`` cached
    keys (outputs and buffers poisoned with NaN first) == the numpy attention_paths, which equals
    attention_absorb under the tree's ancestor mask."""
    inputs, parents = random_tree_inputs(rows, prefix, rank, rope, heads, spare)
    expected = ref.attention_paths(*inputs)
    actual = run_paths(*inputs, plan=plan)
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name=name)


# --- the numpy twin: the same computation as the masked attention, without the mask

@pytest.mark.parametrize("rows, prefix, heads", [(1, 0, 2), (1, 9, 3), (7, 0, 2), (9, 37, 3), (12, 5, 1)])
def test_numpy_attention_paths_equals_the_masked_attention(rows, prefix, heads):
    """ddtree.mla.attention_paths (each row's keys from its path) == attention_absorb under the
    tree's ancestor mask (ddtree.tree.visibility): one computation written two ways. The cache's
    slots past S hold NaN, which neither reads."""
    inputs, parents = random_tree_inputs(rows, prefix, 11, 3, heads)
    q_lat, q_pe, cache_latent, cache_rope, _, depths, paths, scale = inputs
    masked = ref.attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix, visibility(parents), scale)
    by_paths = ref.attention_paths(*inputs)
    assert np.isfinite(by_paths).all()
    assert_close(by_paths, masked, rtol=1e-5, atol=1e-5, name="numpy attention_paths vs attention_absorb")
    as_array = ref.attention_paths(q_lat, q_pe, cache_latent, cache_rope, np.array([prefix]), depths, paths,
                                   scale)                                 # the kernel's prefix: (1,)
    assert np.array_equal(as_array, by_paths), "an int prefix and a (1,) array agree"


# --- the engine's plan, and attention_paths' default

@pytest.mark.parametrize("name, version", [
    ("micro", 2), ("tiny", 3), ("tiny-b", 2), ("small", 5), ("kimi-k2.6", 5)])
def test_paths_plan_of_the_presets(name, version):
    """The engine's plan for each preset's dims and cache (max_position_embeddings + Tmax slots):
    versions 1 and 2 where 4 does not divide H, version 3 where it does, version 5 from R = 512."""
    config = preset(name)
    capacity = config.max_position_embeddings + 128
    plan = gpu.paths_plan(config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim, capacity)
    assert plan.version == version
    assert plan.splits == (1 if plan.unfused else gpu.paths_splits(
        capacity, config.kv_lora_rank, config.qk_rope_head_dim, plan.heads_per_block))


@pytest.mark.parametrize("rows, prefix, rank, rope, heads, spare, version", [
    (5, 20, 13, 4, 3, 3, 1),              # H = 3: G = 1; C = 28 slots: one split
    (4, 38, 9, 2, 2, 560, 2),             # C = 602 slots: 19 tiles, Z = 2; the keys' 2 tiles one each
    (3, 45, 11, 3, 4, 3, 3),              # H = 4: G = 4, Z = 1
    (2, 30, 7, 2, 8, 600, 3),             # G = 4, two blocks of heads, Z = 2
    (3, 21, 512, 8, 2, 3, 5)])            # R = 512: version 5
def test_attention_paths_default_is_the_engines_plan(rows, prefix, rank, rope, heads, spare, version):
    """attention_paths without a plan runs ``paths_plan`` for its dims and the cache's C (what the
    engine runs), equal to the numpy attention_paths (outputs and buffers poisoned with NaN, NaN
    cache slots past S), and bit for bit the call with that plan given."""
    inputs, _ = random_tree_inputs(rows, prefix, rank, rope, heads, spare)
    plan = gpu.paths_plan(heads, rank, rope, inputs[2].shape[0])
    assert plan.version == version
    default = run_paths(*inputs)
    assert_close(default, ref.attention_paths(*inputs), rtol=RTOL, atol=ATOL, name=f"version {version}")
    assert_exact(run_paths(*inputs, plan=plan).view(np.uint32), default.view(np.uint32), name="plan given")


def test_attention_paths_takes_host_arrays():
    """Host arrays in (the prefix as an int), numpy out, as the other wrappers: the same bits as
    device arrays."""
    inputs, _ = random_tree_inputs(4, 13, 6, 2, 2)
    q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale = inputs
    out = gpu.attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale)
    assert isinstance(out, np.ndarray)
    assert_exact(out.view(np.uint32), run_paths(*inputs).view(np.uint32), name="host vs device")


# --- versions 1 to 3, each plan

@pytest.mark.parametrize("rows, prefix, rank, rope, plan", [
    (7, 0, 24, 6, V1), (9, 37, 13, 4, V1), (5, 70, 9, 2, V1),
    (5, 70, 9, 2, V2(2)), (4, 75, 11, 3, V2(3)), (3, 40, 7, 2, V2(8))])   # 3 tiles dealt to 2, 3, 8 (5 idle)
def test_attention_paths_equals_the_masked_attention(rows, prefix, rank, rope, plan):
    """A random tree's rows over prefix + path == the numpy attention_paths (the masked attention)."""
    check_random_tree(rows, prefix, rank, rope, 2, f"o_lat, Z = {plan.splits}", plan=plan)


@pytest.mark.parametrize("plan, rank, rope", [                          # R = 512: the short tiles'
    (V1, 10, 4), (V2(2), 10, 4), (V3(2, 2), 10, 4), (V3(2, 2), 512, 64)])  # score parts (version 3)
def test_attention_paths_tree_row_equals_the_chain_row_bit_for_bit(plan, rank, rope):
    """A tree node and the same keys laid out as a committed chain (prefix + path as cache rows,
    one row, depth 0) give bit-identical outputs: tiles sit at the same positions (40 keys: 2;
    with 2 splits, one tile each and a merge; version 3 with G = 2 heads per block alike). At
    Kimi's R = 512, dr = 64 the tiles are short (16 keys, 8 in version 3): the keys' scores are
    summed in parallel parts, still the same for the node and its chain."""
    parents = np.array([-1, 0, 0, 1, 2, 3, 4, 5])
    depths, paths = ancestor_paths(parents)
    case = Case("paths", rows=8, prefix=35, mask="causal", heads=2, rank=rank, rope=rope)
    q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=5)
    tree_out = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, plan)
    for node in (6, 7):
        chain = [prefix + int(j) for j in paths[node, :depths[node] + 1]]
        rows_used = list(range(prefix)) + chain
        latent, rope_keys = cache_latent[rows_used], cache_rope[rows_used]
        alone = run_paths(q_lat[node:node + 1], q_pe[node:node + 1], latent, rope_keys, len(rows_used) - 1,
                          np.zeros(1, np.int64), np.zeros((1, 1), np.int64), scale, plan)
        assert np.array_equal(alone[0], tree_out[node]), f"node {node} differs from its chain"


@pytest.mark.parametrize("heads_per_block, splits, rows, prefix, rank, rope", [
    (2, 1, 5, 70, 9, 2), (2, 2, 4, 75, 11, 3), (2, 3, 3, 40, 7, 2),        # 3 tiles: dealt to 1, 2, 3 splits
    (4, 1, 3, 45, 13, 5), (4, 2, 4, 66, 5, 3), (4, 3, 3, 90, 6, 1),
    (4, 2, 2, 20, 512, 64)])                                              # short tiles: scores in parts
def test_attention_heads_equal_the_masked_attention(heads_per_block, splits, rows, prefix, rank, rope):
    """Version 3 (G heads per block): a random tree's rows == the numpy attention_paths. H = 2G:
    two blocks of heads per (row, split), so a head's place in the grid is exercised."""
    check_random_tree(rows, prefix, rank, rope, 2 * heads_per_block,
                      f"o_lat, G = {heads_per_block}, Z = {splits}", plan=V3(heads_per_block, splits))


def test_attention_paths_one_split_per_tile_equals_the_merge_of_single_tiles():
    """Version 2's merge is the softmax of the concatenated tiles: with as many splits as tiles,
    each partial is one tile's (max, sum, acc), and the merged rows match version 1 closely."""
    parents = np.array([-1, 0, 1])
    depths, paths = ancestor_paths(parents)
    case = Case("paths", rows=3, prefix=64, mask="causal", heads=1, rank=6, rope=2)
    q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=9)
    one = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V1)
    three = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V2(3))
    assert_close(three, one, rtol=RTOL, atol=ATOL, name="3 splits vs 1")


def test_attention_heads_round_like_version_2_where_the_tile_is_the_same():
    """A head's sums do not depend on G: its warp reduces its own 32 slots in version 2's pairs,
    so where the tile is the same (32 keys here), G = 2, G = 4 and version 2 agree bit for bit."""
    parents = np.array([-1, 0])
    depths, paths = ancestor_paths(parents)
    case = Case("heads", rows=2, prefix=40, mask="causal", heads=4, rank=5, rope=1)
    q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=3)
    inputs = (q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale)
    outputs = [run_paths(*inputs, V3(g, 2)).view(np.uint32) for g in (1, 2, 4)]
    assert_exact(outputs[1], outputs[0], name="G = 2 vs version 2 bits")
    assert_exact(outputs[2], outputs[0], name="G = 4 vs version 2 bits")


def _tiny_paths_arrays(heads: int = 2, rank: int = 4):
    return (to_device(np.zeros((1, heads, rank), np.float32)), to_device(np.zeros((1, heads, 2), np.float32)),
            to_device(np.zeros((4, rank), np.float32)), to_device(np.zeros((4, 2), np.float32)),
            to_device(np.zeros(1, np.int64)), to_device(np.zeros(1, np.int64)),
            to_device(np.zeros((1, 1), np.int64)))


@pytest.mark.parametrize("plan, message", [
    ((2, 1, False), "plan must be a kernels.mla.PathsPlan"),
    *((V2(splits), r"splits must be an integer in \[1, 64\]") for splits in (0, 65, 2.0, True)),
    *((V3(group), r"heads_per_block must be 1, 2 or 4 and divide the number of heads \(2\)")
      for group in (0, 3, 8, 2.0, True, 4)),                              # 4 does not divide H = 2
    (gpu.PathsPlan(unfused=1), "unfused must be True or False, got 1"),
    (gpu.PathsPlan(splits=2, unfused=True), "unfused=True takes splits=1 and heads_per_block=1"),
    (gpu.PathsPlan(heads_per_block=2, unfused=True), "unfused=True takes splits=1")])
def test_attention_paths_refuses_bad_plans(plan, message):
    with pytest.raises(ValueError, match=message):
        gpu.attention_paths(*_tiny_paths_arrays(), 1.0, plan=plan)


@pytest.mark.parametrize("heads, heads_per_block", [(16, 4), (64, 4), (4, 4), (8, 4), (6, 1), (2, 1), (3, 1)])
def test_paths_plan_groups_heads_in_fours(heads, heads_per_block):
    """G: 4 where 4 divides H, else 1 (versions 1 and 2)."""
    assert gpu.paths_plan(heads, 64, 16, 4224).heads_per_block == heads_per_block


@pytest.mark.parametrize("rank, unfused", [(512, True), (576, True), (64, False), (16, False), (511, False)])
def test_paths_plan_takes_version_5_from_rank_512(rank, unfused):
    plan = gpu.paths_plan(16, rank, 64, 32896)
    assert plan.unfused is unfused
    assert plan.partial_groups(32896) == (gpu.unfused_chunks(32896) if unfused else plan.splits)


@pytest.mark.parametrize("rank, rope, heads_per_block, tile", [
    (512, 64, 4, 8), (512, 64, 2, 8), (64, 16, 4, 32), (48, 8, 2, 32), (16, 4, 2, 32), (256, 32, 4, 16)])
def test_paths_heads_tile(rank, rope, heads_per_block, tile):
    """Version 3's tile: 32, 16 or 8 keys by the shared-memory budget; G = 1 takes version 1's tile."""
    assert gpu.paths_heads_tile(rank, rope, heads_per_block) == tile
    assert gpu.paths_shared_bytes(rank, rope, tile, heads_per_block) <= gpu.SHARED_BUDGET
    assert gpu.paths_heads_tile(rank, rope, 1) == gpu.paths_tile(rank, rope)


def test_attention_paths_names_a_wrong_partials_buffer():
    with pytest.raises(ValueError, match=r"partials must be float32 of shape \(1, 2, 2, 6\)"):
        gpu.attention_paths(*_tiny_paths_arrays(), 1.0, plan=V2(2),
                            partials=to_device(np.zeros((1, 2, 2, 4), np.float32)))


@pytest.mark.parametrize("capacity, rank, rope, splits", [
    (1, 64, 16, 1), (512, 64, 16, 1), (513, 64, 16, 2), (4224, 64, 16, 16), (32896, 512, 64, 64)])
def test_paths_splits_leave_each_split_a_bounded_walk(capacity, rank, rope, splits):
    assert gpu.paths_splits(capacity, rank, rope) == splits


def check_kimi_dims(rows: int, heads: int, seed: int, name: str, prefix: int = 4096 + 37, plan=None) -> None:
    """attention_paths with ``plan`` at Kimi K2.6 dims (latent 512 + rope 64, a 4k prefix, a
    random tree of ``rows`` nodes): equal to the masked reference, and the last row bit-identical
    to the same keys laid out as a chain."""
    config = preset("kimi-k2.6")
    rank, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
    rng = np.random.default_rng(seed)
    parents = random_parents(rng, rows)
    depths, paths = ancestor_paths(parents)
    keys = prefix + rows
    q_lat = rng.standard_normal((rows, heads, rank), dtype=np.float32) * np.float32(0.2)
    q_pe = rng.standard_normal((rows, heads, rope_dim), dtype=np.float32) * np.float32(0.2)
    latent = rng.standard_normal((keys, rank), dtype=np.float32)
    rope = rng.standard_normal((keys, rope_dim), dtype=np.float32)
    scale = softmax_scale(config)
    expected = ref.attention_absorb(q_lat, q_pe, latent, rope, prefix, tree_visibility(parents), scale)
    actual = run_paths(q_lat, q_pe, latent, rope, prefix, depths, paths, scale, plan)
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name=name)
    node = rows - 1
    chain = list(range(prefix)) + [prefix + int(j) for j in paths[node, :depths[node] + 1]]
    alone = run_paths(q_lat[node:node + 1], q_pe[node:node + 1], latent[chain], rope[chain], len(chain) - 1,
                      np.zeros(1, np.int64), np.zeros((1, 1), np.int64), scale, plan)
    assert np.array_equal(alone[0], actual[node]), "the tree row differs from its chain"


@pytest.mark.gpu
@pytest.mark.parametrize("heads_per_block", [1, 2, 4])
@pytest.mark.parametrize("rows, splits", [(1, 1), (1, 64), (16, 16), (64, 64)])
def test_attention_paths_kimi_dims(rows, splits, heads_per_block):
    """Versions 1 to 3 at Kimi K2.6 dims (64 heads; G = 1: versions 1 and 2, G = 2, 4: version 3,
    tile 8): equal to the masked reference, and a tree row equal to its chain bit for bit."""
    check_kimi_dims(rows, 64, rows + splits, f"o_lat, {splits} splits, G = {heads_per_block}",
                    plan=V3(heads_per_block, splits))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 8])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_attention_unfused_kimi_dims(rows, heads):
    """Version 5 (Kimi's default plan) at Kimi K2.6 dims (GPU tiles: 64 x 64, chunks of 256 keys),
    the prefix 2 keys short of a chunk's end so that a deep node's path runs into the next chunk:
    equal to the masked reference, and the last row (from the tail kernel) bit-identical to its
    chain (whose first of those chunks comes from the P V GEMM)."""
    prefix = 17 * unfused.UNFUSED_CHUNK - 2
    check_kimi_dims(rows, heads, rows + heads, f"o_lat, version 5, H = {heads}", prefix=prefix)


# --- version 5: unfused GEMMs (kernels/mla_unfused.py)

@pytest.mark.parametrize("rows, prefix, rank, rope, heads", [
    (3, 0, 13, 4, 2),             # no prefix: every chunk is the tail kernel's
    (5, 37, 9, 2, 3),             # 2 whole chunks (simulator: 16 keys) by the GEMM, the rest by the tail
    (4, 30, 20, 5, 10),           # paths cross a chunk boundary; 10 heads: 5 tail head groups; R past a tile
    (2, 48, 7, 1, 1),             # the prefix ends at a chunk boundary
    (6, 21, 16, 8, 9)])           # 54 query rows: 7 query tiles, the last one partial
def test_attention_unfused_equals_the_masked_attention(rows, prefix, rank, rope, heads):
    """Version 5: a random tree's rows over prefix + path == the numpy attention_paths (outputs,
    partials and scores poisoned with NaN first)."""
    check_random_tree(rows, prefix, rank, rope, heads, "o_lat, version 5", plan=V5)


def test_attention_unfused_writes_every_used_chunk_and_no_other():
    """Chunks holding a row's keys get every (acc, max, sum) entry, the others keep their poison
    (the merge never reads them): rows of 35 and 36 keys, chunks of 16, a cache of 60 slots."""
    parents = np.array([-1, 0])
    depths, paths = ancestor_paths(parents)
    case = Case("unfused", rows=2, prefix=34, mask="causal", heads=2, rank=7, rope=2)
    q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=4)
    cache_latent = np.concatenate([cache_latent, np.zeros((24, 7), np.float32)])
    cache_rope = np.concatenate([cache_rope, np.zeros((24, 2), np.float32)])
    partials = []
    out = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V5,
                    partials_out=partials)
    used = -(-(prefix + 2) // unfused.UNFUSED_CHUNK)
    assert np.isfinite(out).all()
    assert np.isfinite(partials[0][:, :, :used]).all(), "a used chunk left an entry unwritten"
    assert np.isnan(partials[0][:, :, used:]).all(), "a chunk past the keys was written"


@pytest.mark.parametrize("rank, rope, heads", [(10, 4, 2), (12, 3, 9)])
def test_attention_unfused_tree_row_equals_the_chain_row_bit_for_bit(rank, rope, heads):
    """Version 5: a tree node and the same keys laid out as a committed chain give bit-identical
    outputs. The prefix (30) stops 2 keys short of a chunk's end: the deep nodes' paths run into
    the next chunk, so the chunk at 16 .. 31 is the tail kernel's for the tree and the GEMM's for
    the chain; their sums must agree term for term."""
    parents = np.array([-1, 0, 0, 1, 2, 3, 4, 5])
    depths, paths = ancestor_paths(parents)
    case = Case("unfused", rows=8, prefix=2 * unfused.UNFUSED_CHUNK - 2, mask="causal", heads=heads,
                rank=rank, rope=rope)
    q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=5)
    tree_out = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V5)
    for node in (5, 7):
        chain = [prefix + int(j) for j in paths[node, :depths[node] + 1]]
        rows_used = list(range(prefix)) + chain
        latent, rope_keys = cache_latent[rows_used], cache_rope[rows_used]
        alone = run_paths(q_lat[node:node + 1], q_pe[node:node + 1], latent, rope_keys, len(rows_used) - 1,
                          np.zeros(1, np.int64), np.zeros((1, 1), np.int64), scale, V5)
        assert np.array_equal(alone[0], tree_out[node]), f"node {node} differs from its chain"


@pytest.mark.parametrize("rows, heads, prefix", [(3, 5, 21)])
def test_attention_unfused_launch_shapes_give_the_same_bits(monkeypatch, rows, heads, prefix):
    """Version 5 with each launch shape of its scores kernel (``scores_shape``: NARROW and WIDE)
    and of its tail kernel (``tail_shape``: ONE, FEW and MANY heads per block): the same output,
    partials and scores, bit for bit (every buffer poisoned with NaN first). The prefix reaches
    past a whole chunk, so that the P V GEMM and the tail both run."""
    rng = np.random.default_rng(rows * heads)
    depths, paths = ancestor_paths(random_parents(rng, rows))
    case = Case("unfused shapes", rows=rows, prefix=prefix, mask="causal", heads=heads, rank=9, rope=5)
    q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=rows)
    results = {}
    narrow, one = unfused.UNFUSED_NARROW, unfused.UNFUSED_TAIL_ONE
    for scores_shape, tail_shape in ((narrow, one), (unfused.UNFUSED_WIDE, one),
                                     (narrow, unfused.UNFUSED_TAIL_FEW), (narrow, unfused.UNFUSED_TAIL_MANY)):
        monkeypatch.setattr(unfused, "scores_shape", lambda queries, shape=scores_shape: shape)
        monkeypatch.setattr(unfused, "tail_shape", lambda rows, shape=tail_shape: shape)
        partials = []
        out = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V5,
                        partials_out=partials)
        assert np.isfinite(out).all(), f"{scores_shape} {tail_shape}: an output was not written"
        results[scores_shape, tail_shape] = (out, partials[0])
    first_out, first_partials = next(iter(results.values()))
    for shapes, (out, partials) in results.items():
        assert_exact(out.view(np.uint32), first_out.view(np.uint32), name=f"o_lat with the shapes {shapes}")
        assert_exact(partials.view(np.uint32), first_partials.view(np.uint32),       # unused chunks: NaN
                     name=f"partials with the shapes {shapes}")


@pytest.mark.parametrize("rows, heads, prefix, rank, rope",
                         [(1, 5, 21, 9, 5), (1, 3, 38, 12, 3), (3, 3, 22, 9, 2)])
def test_attention_unfused_row_scores_give_the_gemm_bits(monkeypatch, rows, heads, prefix, rank, rope):
    """A decode row's or a small tree's scores by ``row_scores_kernel`` (its usual grid, a single
    block walking every tile: ``row_blocks`` = 1, and 2 or 3 queries side by side in each thread,
    the queries staged beside the tile or read from global memory), by the GEMM (``row_scores``
    off), and by the staged and unstaged row kernels and the GEMM launched together, their key bounds
    set so that each in turn scores P + T: the same scores, partials and output, bit for bit, and no
    slot past P + T written (every buffer poisoned with NaN first)."""
    if rows == 1:
        depths, paths = np.zeros(1, np.int64), np.zeros((1, 1), np.int64)
        case = Case("row scores", rows=1, prefix=prefix, mask="causal", heads=heads, rank=rank, rope=rope)
        q_lat, q_pe, cache_latent, cache_rope, prefix, _, scale = make_inputs(case, seed=heads)
    else:
        inputs, _ = random_tree_inputs(rows, prefix, rank, rope, heads)
        q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale = inputs
    few = max(unfused.ROW_SCORES_KEYS)
    assert unfused.row_scores(few, rank, rope) and not unfused.row_scores(few + 1, rank, rope)
    assert not unfused.row_scores(1, rank, 0)                 # no rope columns: the GEMM
    staged, most = unfused.ROW_STAGED_KEYS, unfused.ROW_STAGED_LOADS
    assert unfused.row_group(rows, heads, rank, rope) == rows  # these shapes fit the budget: one group
    results = {}
    loads, keys = unfused.ROW_LOADS, prefix + rows
    # (name, row kernel, its grid, queries side by side at most, loads, its keys staged and in all (None:
    # every context), the staged queries' tile of keys (None: the queries read from global memory) and
    # their loads)
    every = (None, None)
    shapes = (("row", True, unfused.row_blocks(), 1, loads, every, staged, most),
              ("row, queries from global memory", True, unfused.row_blocks(), 1, loads, every, None, most),
              ("one block", True, 1, 1, loads, every, staged, most),
              ("gemm", False, 1, 1, loads, every, staged, most),
              ("row, 2 queries a thread", True, unfused.row_blocks(), 2, 8, every, None, most),
              ("row, 3 queries a thread", True, 1, 3, 8, every, None, most),   # runs of 2 columns, the rest
              ("row, 3 queries a thread, staged", True, 1, 3, 8, every, 8, most),
              ("row, staged 2 loads at a time", True, 1, 1, loads, every, staged, 2),
              ("staged beside the row kernel, the gemm", True, 1, 1, loads, (keys, keys + 1), staged, most),
              ("row kernel between staged and gemm", True, 1, 1, loads, (keys - 1, keys), staged, most),
              ("gemm beside both row kernels", True, 1, 1, loads, (keys - 2, keys - 1), staged, most),
              ("row beside the gemm, up to its keys", True, 1, 1, loads, (None, keys), None, most),
              ("gemm beside the row, past its keys", True, 1, 1, loads, (None, keys - 1), None, most))
    for name, row, grid, queries, loads, (staged_keys_most, most_keys), staged_keys, staged_loads in shapes:
        monkeypatch.setattr(unfused, "row_scores", lambda rows, rank, rope_dim, row=row: row)
        monkeypatch.setattr(unfused, "row_blocks", lambda grid=grid: grid)
        monkeypatch.setattr(unfused, "ROW_QUERIES", queries)
        monkeypatch.setattr(unfused, "ROW_LOADS", loads)
        monkeypatch.setattr(unfused, "ROW_SCORES_KEYS", {rows: most_keys})
        monkeypatch.setattr(unfused, "ROW_STAGED_SCORES_KEYS", {rows: staged_keys_most})
        monkeypatch.setattr(unfused, "ROW_STAGED_KEYS", staged_keys)
        monkeypatch.setattr(unfused, "ROW_STAGED_LOADS", staged_loads)
        inputs = (q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale)
        results[name] = run_scores(name, inputs)
    assert_same_as_gemm(results)


def run_scores(name: str, inputs: tuple) -> tuple:
    """Version 5 on ``inputs`` (as ``random_tree_inputs`` gives them): (output, partials, scores),
    every slot below P + T scored and none past it (the buffers poisoned with NaN first)."""
    rows, prefix = inputs[0].shape[0], inputs[4]
    partials, scores = [], []
    out = run_paths(*inputs, V5, partials_out=partials, scores_out=scores)
    assert np.isfinite(scores[0][:, :prefix + rows]).all(), f"{name}: a score was not written"
    assert np.isnan(scores[0][:, prefix + rows:]).all(), f"{name}: a slot past P + T was written"
    return out, partials[0], scores[0]


def assert_same_as_gemm(results: dict) -> None:
    """Every run of ``results`` ({name: (output, partials, scores)}) has the bits of its "gemm" run."""
    for name, arrays in results.items():
        for what, array, expected in zip(("o_lat", "partials", "scores"), arrays, results["gemm"],
                                         strict=True):
            assert_exact(array.view(np.uint32), expected.view(np.uint32), name=f"{what}, {name} scores")


def test_row_kernel_shape_sides_queries_by_share_and_loads_by_power_of_two(monkeypatch):
    """``row_shape`` with a GPU's 256 threads on tiles of 16 keys (16 queries at once): a thread's
    share of the queries side by side, at most ROW_QUERIES, and ROW_LOADS loads in flight split
    between them in runs of a power of two."""
    monkeypatch.setattr(unfused, "ROW_THREADS", 256)
    monkeypatch.setattr(unfused, "ROW_KEYS", 16)
    monkeypatch.setattr(unfused, "ROW_QUERIES", 4)
    monkeypatch.setattr(unfused, "ROW_LOADS", 32)
    shapes = [unfused.row_shape(16 * rows) for rows in (1, 2, 3, 4, 8)]     # small's 16 heads
    assert shapes == [(1, 32), (2, 16), (3, 8), (4, 8), (4, 8)]
    assert unfused.row_shape(1) == (1, 32)


def test_row_kernel_stages_a_row_of_small_a_block_where_it_fits():
    """Small's 16 heads of 512 + 64 columns: one row's query rows fit beside a tile of 2 keys in 44 KB
    of shared memory, so every row count the row kernel serves is staged a row a block, up to fewer
    keys than unstaged (``ROW_STAGED_SCORES_KEYS``); more rows, or Kimi's 64 heads, read their queries
    from global memory."""
    assert unfused.ROW_STAGED_KEYS == 2 and unfused.SHARED_BUDGET == 44 * 1024
    assert set(unfused.ROW_STAGED_SCORES_KEYS) == set(unfused.ROW_SCORES_KEYS)
    assert [unfused.row_group(rows, 16, 512, 64) for rows in (1, 2, 3, 4, 5)] == [1, 1, 1, 1, 0]
    assert unfused.row_group(1, 64, 512, 64) == 0


@pytest.mark.parametrize("rows", range(1, 10))
@pytest.mark.parametrize("heads", [16, 64])
def test_score_launches_serve_each_context_once(rows, heads):
    """Small's 16 heads and Kimi's 64 (R = 512, dr = 64), the engine's key bounds: step 1's launches
    cover every context P + T >= 1 once, in order, none of them empty; staged queries (G > 0) only
    where a row's queries fit (16 heads) and only first."""
    launches = unfused.score_launches(rows, heads, 512, 64)
    bounds = [unfused.NO_KEYS] + [most for _, _, most in launches]
    assert [fewest for _, fewest, _ in launches] == bounds[:-1] and bounds[-1] == unfused.ALL_KEYS
    assert all(fewest < most for _, fewest, most in launches)
    groups = [group for group, _, _ in launches]
    assert all(group == 0 or group is None for group in groups[1:])
    assert bool(groups[0]) == (heads == 16 and rows in unfused.ROW_STAGED_SCORES_KEYS)


@pytest.mark.parametrize("row_keys, staged_keys, expected", [
    ({2: 8192}, {2: 512}, [(1, -1, 512), (0, 512, 8192), (None, 8192, 2**62)]),
    ({2: None}, {2: 512}, [(1, -1, 512), (0, 512, 2**62)]),
    ({2: 768}, {2: 768}, [(1, -1, 768), (None, 768, 2**62)]),
    ({2: 512}, {2: 1024}, [(1, -1, 512), (None, 512, 2**62)]),      # staged no further than the row kernel
    ({2: None}, {2: None}, [(1, -1, 2**62)]),
    ({3: 4096}, {3: 512}, [(None, -1, 2**62)])])                    # 2 rows not listed: the GEMM alone
def test_score_launches_follow_the_key_bounds(monkeypatch, row_keys, staged_keys, expected):
    """Two rows of small's 16 heads (a row a block staged) under each pair of key bounds: the staged row
    kernel, the unstaged one and the GEMM, each where its contexts are not empty."""
    monkeypatch.setattr(unfused, "ROW_SCORES_KEYS", row_keys)
    monkeypatch.setattr(unfused, "ROW_STAGED_SCORES_KEYS", staged_keys)
    assert unfused.score_launches(2, 16, 512, 64) == expected


@pytest.mark.parametrize("rows, fit", [(3, 1), (3, 2), (4, 3), (2, 2)])
def test_row_kernel_stages_its_queries_in_groups_of_rows_with_the_gemms_bits(monkeypatch, rows, fit):
    """The shared memory budget set so that ``fit`` rows' queries fit a block: the T rows staged in
    groups of that many (the last one short where it does not divide T), on the grid's second side,
    beside one block walking every tile or the usual grid: the same scores, partials and output as
    the GEMM, bit for bit, every slot below P + T written and none past it."""
    heads, rank, rope, prefix = 3, 9, 2, 13
    inputs, _ = random_tree_inputs(rows, prefix, rank, rope, heads)
    monkeypatch.setattr(unfused, "SHARED_BUDGET",
                        unfused.F32 * (rank + rope + 1) * (unfused.ROW_STAGED_KEYS + fit * heads))
    assert unfused.row_group(rows, heads, rank, rope) == fit
    monkeypatch.setattr(unfused, "ROW_SCORES_KEYS", {rows: None})
    monkeypatch.setattr(unfused, "ROW_STAGED_SCORES_KEYS", {rows: None})
    results = {}
    for name, row, grid in (("gemm", False, 1), ("groups", True, unfused.row_blocks()),
                            ("groups, one block a group", True, 1)):
        monkeypatch.setattr(unfused, "row_scores", lambda rows, rank, rope_dim, row=row: row)
        monkeypatch.setattr(unfused, "row_blocks", lambda grid=grid: grid)
        results[name] = run_scores(name, inputs)
    assert_same_as_gemm(results)


@pytest.mark.parametrize("rows", [1, 2])
def test_small_shaped_rows_stage_their_queries_with_the_gemms_bits(monkeypatch, rows):
    """Small's decode row and a tree of 2 (16 heads, R = 512, dr = 64: the staged queries' loads in
    many batches, a row a block, q_pe a strided view of the query buffer) have the same scores by the
    staged row kernel as by the GEMM."""
    inputs, _ = random_tree_inputs(rows, 5, 512, 64, 16)
    q_lat, _, cache_latent, cache_rope, prefix, depths, paths, scale = inputs
    q = np.random.default_rng(3).standard_normal((rows, 16, 128 + 64)).astype(np.float32)
    q_pe = cuda.to_device(q)[:, :, 128:]                      # [T, H, dr] as the engine's view
    assert unfused.row_group(rows, 16, 512, 64) == 1
    scores = {}
    for row in (True, False):
        monkeypatch.setattr(unfused, "row_scores", lambda rows, rank, rope_dim, row=row: row)
        found = []
        run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V5, scores_out=found)
        scores[row] = found[0][:, :prefix + rows]
    assert np.isfinite(scores[True]).all()
    assert_exact(scores[True].view(np.uint32), scores[False].view(np.uint32), name="staged row scores")


def test_attention_unfused_decode_row_without_rope_columns():
    """dr = 0 (no rope columns, which ``row_scores_kernel`` stages apart): a decode row's scores
    come from the GEMM, and its output matches numpy."""
    case = Case("no rope", rows=1, prefix=20, mask="causal", heads=2, rank=9, rope=0)
    q_lat, q_pe, cache_latent, cache_rope, prefix, visible, scale = make_inputs(case, seed=1)
    out = run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, np.zeros(1, np.int64),
                    np.zeros((1, 1), np.int64), scale, V5)
    expected = ref.attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix, visible, scale)
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="o_lat, dr = 0")


def test_attention_unfused_names_a_wrong_scores_buffer():
    with pytest.raises(ValueError, match=r"scores must be float32 of shape \(2, 4\)"):
        gpu.attention_paths(*_tiny_paths_arrays(), 1.0, plan=V5,
                            scores=to_device(np.zeros((2, 5), np.float32)))


@pytest.mark.parametrize("rows, prefix, rank, rope, heads", [(5, 37, 9, 2, 3), (3, 0, 13, 4, 2)])
def test_attention_unfused_partials_match_numpy(rows, prefix, rank, rope, heads):
    """Version 5's partials (each row's chunks: sum exp(s - M) latent, M, sum exp(s - M)) against
    the numpy twin's, the same chunks used (the rest NaN on both sides), and the twin's merge equal
    to the numpy attention_paths."""
    from ddtree import mla_unfused as ref_unfused

    inputs, _ = random_tree_inputs(rows, prefix, rank, rope, heads)
    q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale = inputs
    partials = []
    run_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale, V5, partials_out=partials)
    expected = ref_unfused.unfused_partials(*inputs, chunk_keys=unfused.UNFUSED_CHUNK)
    assert expected.shape == partials[0].shape
    assert_exact(np.isnan(partials[0]), np.isnan(expected), name="the chunks used")
    used = ~np.isnan(expected)
    assert_close(partials[0][used], expected[used], rtol=RTOL, atol=ATOL * 10)
    assert_close(ref_unfused.merge_partials(expected),
                 ref.attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix, depths, paths, scale),
                 rtol=RTOL, atol=ATOL)
