"""PyTorch on the same inputs, for device times side by side with the kernels' (torch is optional).

torch is not a dependency of the project: ``available()`` says whether it can run here (not in
the CUDA simulator, not when it is missing), and every case's peer is skipped otherwise. A peer
reads the case's own device arrays through ``__cuda_array_interface__`` (no copy), so both sides
compute on the same bytes. TF32 is off: fp32 against fp32.

Peers (the same operation, written the way a PyTorch user would):
- ``rmsnorm``: ``torch.nn.functional.rms_norm``;
- ``linear``: ``x @ W.T`` (cuBLAS SGEMM / SGEMV);
- ``attention``: masked absorbed MLA: scores = (q_lat C^T + q_pe K^T) scale over the (T, S) mask,
  softmax, times C: two GEMMs over the latent cache, as FlashMLA-less PyTorch code does it.
``sgemm_flops`` is the fp32 rate of the machine: the best fp32 GEMM it has, torch's.
"""

from __future__ import annotations

import functools

import numpy as np

from kernels.device import SIMULATOR

SGEMM_SIZE = 8192               # the fp32 rate: an 8192 x 8192 x 8192 SGEMM


@functools.cache
def torch_or_none():
    """The torch module with TF32 off, or None (simulator, no torch, no CUDA in torch)."""
    if SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def available() -> bool:
    return torch_or_none() is not None


def tensor(array):
    """A torch view of a numba device array (no copy)."""
    return torch_or_none().as_tensor(array, device="cuda")


def rmsnorm(x, weight, eps: float):
    torch = torch_or_none()
    rows, weights = tensor(x), tensor(weight)
    return lambda: torch.nn.functional.rms_norm(rows, (rows.shape[-1],), weights, eps)


def linear(x, weight):
    rows, weights = tensor(x), tensor(weight)
    return lambda: rows @ weights.T


def prefix_mask(prefix: int, visible: np.ndarray) -> np.ndarray:
    """(T, P + T) bool: every cached key, then the tree's ancestor mask (T, T)."""
    return np.concatenate([np.ones((visible.shape[0], prefix), bool), visible], axis=1)


def attention(q_lat, q_pe, cache_latent, cache_rope, mask: np.ndarray, scale: float):
    """Absorbed MLA over the first S = mask.shape[1] cache rows: (T, H, R)."""
    torch = torch_or_none()
    query, query_pe = tensor(q_lat), tensor(q_pe)                       # [T, H, R], [T, H, dr]
    keys = mask.shape[1]
    latent, rope = tensor(cache_latent)[:keys], tensor(cache_rope)[:keys]   # [S, R], [S, dr]
    hidden = torch.as_tensor(~mask, device="cuda")[:, None, :]          # [T, 1, S]
    rows, heads, rank = query.shape

    def run():
        scores = query.reshape(rows * heads, rank) @ latent.T                       # [T*H, S]
        scores += query_pe.reshape(rows * heads, -1) @ rope.T
        scores = (scores * scale).view(rows, heads, keys).masked_fill(hidden, float("-inf"))
        return (torch.softmax(scores, -1).view(rows * heads, keys) @ latent).view(rows, heads, rank)
    return run


def graph_seconds(calls, copies: int, repeats: int) -> float:
    """Median device seconds of one call: ``copies`` calls (cycling through ``calls``, one per
    input set) captured into one torch CUDA graph, each replay between two CUDA events."""
    torch = torch_or_none()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                       # warm-up: cuBLAS picks kernels
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(copies):
            calls[k % len(calls)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats + 1):                                        # the first replay warms up
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    del graph
    torch.cuda.empty_cache()
    return float(np.median(times[1:]))


def sgemm_flops(repeats: int = 5) -> float:
    """FLOP/s of torch's fp32 GEMM (TF32 off), SGEMM_SIZE cubed, measured now."""
    torch = torch_or_none()
    n = SGEMM_SIZE
    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.rand((n, n), device="cuda", generator=generator) for _ in range(2))
    seconds = graph_seconds([lambda: a @ b], 3, repeats)
    return 2 * n ** 3 / seconds
