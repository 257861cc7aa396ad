"""The lab's linear versions (``lab/linear/``) beyond the harness's checks (``tests/test_lab.py``:
each against the numpy twin, "rows" against "gemv" bit for bit): batch invariance, and the bits
that "tiles_gemm" (v3) and "stream" (v4) share with "tiles" (v2), which is not shipped. Each
version's output starts NaN-poisoned, so an unwritten element shows."""

import numpy as np
import pytest
from numba import cuda

from kernels import device
from lab.linear import v1_rows, v2_tiles, v3_tiles_gemm, v4_stream


def _inputs(rows, depth, outputs, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, depth)).astype(np.float32),
            rng.standard_normal((outputs, depth)).astype(np.float32))


def _bits(values):
    return np.asarray(values, np.float32).view(np.uint32)


# (version, T, Din, Dout): the rows span two passes of ROWS_PER_PASS; Din several 32-wide chunks and
# a partial one; Dout two column tiles of "tiles"
@pytest.mark.parametrize("version, rows, depth, outputs", [
    (v1_rows, 11, 45, 3), (v2_tiles, 11, 100, 37), (v2_tiles, 9, 33, 70)],
    ids=["rows", "tiles", "tiles-wide"])
def test_lab_versions_are_batch_invariant(version, rows, depth, outputs):
    """Every row equals the same row run alone and in another batch, bit for bit."""
    x, weight = _inputs(rows, depth, outputs, seed=3)
    together = version.run(x, weight)
    for t in (0, 7, 8, rows - 1):
        alone = version.run(x[t:t + 1], weight)
        assert np.array_equal(alone[0], together[t]), f"row {t} depends on its neighbours"
    assert np.array_equal(version.run(x[5:rows], weight), together[5:])


# (T, Din, Dout): Din = 70 is 3 chunks, 2 for slice 0 (the last one 6 wide) and 1 for slice 1; 100
# is 4 chunks, 2 each, the last 4 wide; rows and columns span partial tiles of the simulator's
# 8 x 16 tiles (and of a 16 x 8 one)
@pytest.mark.parametrize("rows, depth, outputs", [(11, 70, 19), (3, 100, 5)])
def test_tiles_gemm_equals_tiles_bit_for_bit(rows, depth, outputs):
    """"tiles_gemm" sums every output in "tiles"' order: the same bits, with the simulator's tile
    shape (two slices in one launch) and with one slice per launch (out carries the sum from one
    launch to the next)."""
    x, weight = _inputs(rows, depth, outputs, seed=4)
    tiles = v2_tiles.run(x, weight)
    assert np.array_equal(_bits(v3_tiles_gemm.run(x, weight)), _bits(tiles))
    out = device.poisoned((rows, outputs))
    v3_tiles_gemm.launch_tiles_gemm(cuda.to_device(x), cuda.to_device(weight), out,
                                    tiles=v3_tiles_gemm.GemmTiles(16, 8, 4, 4, 1, 8))
    assert np.array_equal(_bits(out.copy_to_host()), _bits(tiles))


def test_tiles_gemm_every_element_written():
    """Negative control for the poison: a grid one column tile short leaves those columns NaN."""
    x, weight = _inputs(3, 40, 20)
    out = device.poisoned((3, 20))
    v3_tiles_gemm.tiles_gemm_kernel(v3_tiles_gemm.GEMM_SIMULATED)[(1, 1), 16](
        cuda.to_device(x), cuda.to_device(weight), out, v3_tiles_gemm.k_slices(40), 0)
    written = ~np.isnan(out.copy_to_host())
    assert written[:, :16].all() and not written[:, 16:].any()


def test_tiles_gemm_shapes(monkeypatch):
    """The GPU's tile shapes fit (threads, 48 KB of shared memory) and are picked by the result's
    size (132 SMs in the simulator's plan); shapes the kernel cannot run are refused by name."""
    gemm = v3_tiles_gemm
    for tiles in (gemm.GEMM_WIDE, gemm.GEMM_NARROW, gemm.GEMM_SIMULATED):
        gemm.check_gemm_tiles(tiles)
    monkeypatch.setattr(gemm, "SIMULATOR", False)
    monkeypatch.setattr(gemm, "sm_count", lambda: 132)
    assert gemm.gemm_tiles(4096, 2048) == gemm.GEMM_WIDE                # 512 wide tiles
    assert gemm.gemm_tiles(128, 163840) == gemm.GEMM_WIDE
    for rows, outputs in ((4096, 576), (64, 2048), (100, 163840)):      # 160 tiles; rows < 128
        assert gemm.gemm_tiles(rows, outputs) == gemm.GEMM_NARROW
    for bad in (gemm.GemmTiles(32, 32, 4, 6, 4, 16),           # not whole float4 fragments
                gemm.GemmTiles(64, 64, 8, 8, 4, 16),           # 69632 bytes of shared memory
                gemm.GemmTiles(8, 8, 4, 4, 2, 8),              # a group of 4 threads, fewer than step
                (32, 32, 4, 4, 4, 16)):
        with pytest.raises(ValueError, match="tiles must be a GemmTiles"):
            gemm.check_gemm_tiles(bad)


# (T, Din, Dout, variant): Din not a multiple of 32 (a partial last chunk, and a partial batch of
# loads), 1-3 rows, Dout spanning 1-3 blocks; batches of two chunks (slice 1's second one past
# Din), adjacent slices with batches inside a chunk, blocks of 12 threads (6 columns of 2 slices)
@pytest.mark.parametrize("rows, depth, outputs, variant", [
    (1, 70, 5, {"loads": 64}), (3, 45, 37, {"adjacent": "slices", "loads": 16}),
    (2, 100, 9, {"threads": 12, "loads": 8})])
def test_stream_equals_tiles_bit_for_bit(rows, depth, outputs, variant):
    x, weight = _inputs(rows, depth, outputs, seed=9)
    tiled = v2_tiles.run(x, weight)
    streamed = v4_stream.run(x, weight, **variant)
    assert not np.isnan(streamed).any(), "an output was never written"
    assert np.array_equal(streamed, tiled)
    assert np.array_equal(v4_stream.run(x, weight), tiled)
    # the order is visible at these sizes: summing each dot product straight along Din differs
    straight = np.cumsum(x[:, None, :] * weight[None, :, :], axis=-1, dtype=np.float32)[..., -1]
    assert not np.array_equal(straight, tiled)


@pytest.mark.parametrize("option, message", [
    ({"loads": 12}, "loads must divide 32"), ({"adjacent": "rows"}, "adjacent must be one of"),
    ({"threads": 2}, r"threads must be an int in \[4, 1024\]"),
    ({"resident": 0}, r"resident must be None or an int in \[1, 2048\]")])
def test_stream_bad_variants(option, message):
    with pytest.raises(ValueError, match=message):
        v4_stream.stream_kernel(1, **option)
