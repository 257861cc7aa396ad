"""The benchmark's cases of ``kernels.rmsnorm`` and its cost model: the input norm of a verified
tree (the model's size: launch-bound) and of a prefill's rows (large: bandwidth-bound), each by
the default batch (``row_batch``) and by the other one, in the same run."""

from __future__ import annotations

from kernels import tuning
from kernels.bench import peers
from kernels.bench.case import Case, uniform
from kernels.device import reduction_threads
from kernels.rmsnorm import ROW_THREADS, rmsnorm, row_batch

F32 = 4            # bytes per float32


def bytes_moved(*, T: int, D: int) -> int:
    """Fewest bytes RMSNorm moves through device memory: x (T, D) read once, y (T, D) written
    once, the weight (D,) read once; float32."""
    return F32 * (2 * T * D + D)


def flops(*, T: int, D: int) -> int:
    """Floating-point operations: per element a square, an add, and two multiplies."""
    return 4 * T * D


def _case(name: str, what: str, config, rows: int, batch: int | None = None):
    width = config.hidden_size
    batch = batch or row_batch(rows, reduction_threads(width, ROW_THREADS), width)
    return Case(name, what, f"x ({rows}, {width})",
                setup=lambda seed: (uniform((rows, width), seed), uniform((width,), seed + 1),
                                    config.rms_norm_eps),
                call=lambda inputs, **given: rmsnorm(*inputs, batch=batch, **given),
                bytes=bytes_moved(T=rows, D=width), flops=flops(T=rows, D=width), note=f"batch {batch}",
                peer=lambda inputs: peers.rmsnorm(*inputs))


def bench_cases(sizes):
    """The cases of ``python -m kernels.bench``: ``rmsnorm`` (a tree's rows) and ``rmsnorm_large``
    (a prefill's), by the default batch, and each ``_other_batch`` by the other batch."""
    config = sizes.config
    threads = reduction_threads(config.hidden_size, ROW_THREADS)
    cases = []
    for name, what, rows in (("rmsnorm", f"input norm of {sizes.rows} tree rows", sizes.rows),
                             ("rmsnorm_large", f"input norm of {sizes.large_rows} prefill rows",
                              sizes.large_rows)):
        few = tuning.RMSNORM_FEW_ROWS_BATCH
        default = row_batch(rows, threads, config.hidden_size)
        other = tuning.RMSNORM_MANY_ROWS_BATCH if default == few else few
        cases += [_case(name, what, config, rows), _case(f"{name}_other_batch", what, config, rows, other)]
    return cases
