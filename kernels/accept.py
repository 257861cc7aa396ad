"""Greedy acceptance on the GPU: the numba.cuda twin of ``ddtree/accept.py``.

Legend: Bq requests, W padded tree width (nodes, root included, then padding), m accepted nodes,
TPB threads per block.

One kernel, ``accept_kernel``: one block per request, one thread per node (strided). Instead of walking down
from the root one step at a time (a barrier per step), every thread checks its own node: node i is on the walk
iff every edge of its path matches, ``tokens[c] == posterior[parents[c]]`` for each node c on the path root..i
(at most L steps up). Siblings carry distinct tokens, so at most one child of a node matches and the matching
nodes form one chain root..deepest; the node at depth j is ``accepted[j]``. No barrier per step, one per
phase. The engine's round end runs ``mark_walk`` inside its own kernel.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ddtree.accept import check_posterior, check_siblings
from ddtree.tree import DraftTree, check_parents
from kernels.blocks import pow2_threads
from kernels.device import check_out, deliver, is_device_array, output, to_device


# --8<-- [start:accept_kernel]
@cuda.jit(device=True)
def mark_walk(tokens, parents, posterior, size, accepted, count):
    """The block's threads check nodes tid, tid + TPB, ... below ``size`` of one tree (1-D rows:
    global or shared memory): node i is on the walk iff every edge of its path root..i matches,
    tokens[c] == posterior[parents[c]]; then accepted[depth(i)] = i and count[0] += 1 (a shared
    counter). No barrier: the caller fills ``accepted`` with -1 and zeroes ``count`` before, and
    waits for every thread after."""
    for i in range(cuda.threadIdx.x, size, cuda.blockDim.x):
        node = i
        depth = 0
        on_walk = True
        while node > 0 and on_walk:                       # climb to the root, checking each edge
            parent = parents[node]
            on_walk = parent >= 0 and tokens[node] == posterior[parent]
            node = parent
            depth += 1
        if on_walk:
            accepted[depth] = i
            cuda.atomic.add(count, 0, 1)


@cuda.jit
def accept_kernel(tokens, parents, sizes, posterior, accepted, lengths, bonus):
    """One block per request; thread t checks nodes t, t + TPB, ... below sizes[request].

    Shared memory: one counter, the number of accepted nodes m. Phase 1 fills accepted[request] with -1;
    phase 2 (``mark_walk``) writes accepted[request, depth(i)] = i for every node i on the walk; phase 3
    (thread 0) reads the deepest one, accepted[request, m - 1], and its posterior, the bonus token.
    """
    request = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    count = cuda.shared.array(1, int32)
    if tid == 0:
        count[0] = 0
    for j in range(tid, accepted.shape[1], threads):
        accepted[request, j] = -1
    cuda.syncthreads()

    mark_walk(tokens[request], parents[request], posterior[request], sizes[request], accepted[request], count)
    cuda.syncthreads()

    if tid == 0:
        kept = count[0]
        lengths[request] = kept
        bonus[request] = posterior[request, accepted[request, kept - 1]]
# --8<-- [end:accept_kernel]


def check_accept_batch(tokens, parents, sizes, posterior, *, out=None):
    """Validate a batch; host arrays also get the tree checks (parents, distinct sibling tokens).
    ``out``: (accepted (Bq, W), lengths (Bq,), bonus (Bq,)), int64."""
    on_device = [is_device_array(a) for a in (tokens, parents, sizes, posterior)]
    if any(on_device) and not all(on_device):
        raise ValueError("tokens, parents, sizes and posterior must all be host or all device arrays")
    if not any(on_device):
        tokens, parents, sizes, posterior = (np.asarray(a) for a in (tokens, parents, sizes, posterior))
    shape = tokens.shape
    for name, array in (("tokens", tokens), ("parents", parents), ("posterior", posterior)):
        if len(array.shape) != 2 or array.shape != shape or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} must be a (Bq, W) integer array like tokens {shape}, "
                             f"got {array.dtype} {array.shape}")
    if sizes.shape != shape[:1] or not np.issubdtype(sizes.dtype, np.integer):
        raise ValueError(f"sizes must be {shape[:1]} integers, got {sizes.dtype} {sizes.shape}")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"accept_batch needs at least one request and one node, got shape {shape}")
    if out is not None:
        for name, array, expected in zip(("accepted", "lengths", "bonus"), out, (shape, shape[:1], shape[:1]),
                                         strict=True):
            check_out(array, expected, np.int64, f"out ({name})")
    if all(on_device):                           # value checks would need host copies
        if any(a.dtype != np.int64 for a in (tokens, parents, sizes, posterior)):
            raise ValueError("device tokens, parents, sizes and posterior must be int64")
        return tokens, parents, sizes, posterior
    if sizes.min() < 1 or sizes.max() > shape[1]:
        raise ValueError(f"sizes must lie in [1, {shape[1]}], got {sizes.tolist()}")
    check_parents(parents)
    for b, size in enumerate(sizes):
        if np.any(parents[b, 1:size] < 0):
            raise ValueError(f"parents[{b}, 1:{size}] must be >= 0 (only the root has no parent)")
        check_siblings(parents[b, :size], tokens[b, :size], f"tokens[{b}]")
    return tokens, parents, sizes, posterior


# --8<-- [start:accept_batch]
def accept_batch(tokens, parents, sizes, posterior, *, out=None, stream=None):
    """Bq trees at once: tokens, parents, posterior (Bq, W) padded, sizes (Bq,).

    Returns (accepted (Bq, W) int64 padded with -1, lengths (Bq,) = m, bonus (Bq,) tokens), or
    writes them into ``out`` (three int64 arrays of those shapes). Host in, host out; device in,
    device out. ``stream`` is where the kernel is launched (None: the default stream).
    """
    tokens, parents, sizes, posterior = check_accept_batch(tokens, parents, sizes, posterior, out=out)
    count, width = tokens.shape
    outs = out or (None, None, None)
    results = [output(given, shape, np.int64, stream)                        # -1 until written
               for given, shape in zip(outs, ((count, width), (count,), (count,)), strict=True)]
    accept_kernel[count, pow2_threads(width), stream](
        to_device(tokens, np.int64), to_device(parents, np.int64), to_device(sizes, np.int64),
        to_device(posterior, np.int64), *results)
    return tuple(deliver(result, given, tokens) for result, given in zip(results, outs, strict=True))
# --8<-- [end:accept_batch]


# --8<-- [start:accept]
def accept(tree: DraftTree, posterior_tokens):
    """One tree: (accepted node indices (m,) int64 starting with 0, bonus token int), on the host.

    A device ``posterior_tokens`` is copied to the host (N integers): the result is host-side.
    """
    if is_device_array(posterior_tokens):
        posterior_tokens = posterior_tokens.copy_to_host()
    posterior = check_posterior(tree, posterior_tokens)                       # [N]
    accepted, lengths, bonus = accept_batch(tree.tokens[None], tree.parents[None],
                                            np.array([tree.size], np.int64), posterior[None])
    return accepted[0, :lengths[0]].copy(), int(bonus[0])
# --8<-- [end:accept]
