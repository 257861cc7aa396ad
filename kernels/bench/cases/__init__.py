"""The benchmark's cases, one module per kernel module (``kernels.bench.cases.linear`` for
``kernels.linear``): each defines ``bench_cases(sizes) -> list[Case]`` and the byte and FLOP counts
its cases are measured against (``bytes_moved``, ``flops``). They live with the benchmark, so the
kernels never import it."""
