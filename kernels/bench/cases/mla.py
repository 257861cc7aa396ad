"""The benchmark's cases of ``kernels.mla`` and its cost models: decode and tree-verify attention
with the masked kernel (``attention_absorb``) and with the engine's ``attention_paths`` in each
shipped version (``paths_cases``), and the absorbed projections for one decode row and for a
verified tree."""

from __future__ import annotations

import math

import numpy as np

from ddtree.rope import softmax_scale
from ddtree.tree import visibility
from kernels.bench import peers
from kernels.bench.case import Case, ancestor_paths, draft_tree, uniform, verified_tree
from kernels.device import cuda, poisoned
from kernels.mla import (
    PathsPlan,
    absorb_output,
    absorb_query,
    attention_absorb,
    attention_paths,
    paths_splits,
)
from kernels.mla_unfused import UNFUSED_CHUNK
from kernels.tuning import GROUPED_HEADS

F32 = 4            # bytes per float32


def _absorb_query_cost(*, T: int, H: int, dn: int, R: int) -> tuple[int, int]:
    # q_nope (T, H, dn) and W_UK (H, dn, R) read once, q_lat (T, H, R) written once
    return F32 * (T * H * dn + H * dn * R + T * H * R), 2 * T * H * dn * R


def _attention_cost(*, T: int, H: int, R: int, dr: int, S: int, pairs: int) -> tuple[int, int]:
    # the S cache rows (R + dr) read once, q_lat | q_pe read and o_lat written once, the (T, T)
    # mask (a byte per entry); per visible (row, key) pair and head: a dot over R + dr for the
    # score and a multiply-add over R for the value
    return (F32 * (S * (R + dr) + T * H * (R + dr) + T * H * R) + T * T,
            2 * H * (2 * R + dr) * pairs)


def _absorb_output_cost(*, T: int, H: int, dv: int, R: int) -> tuple[int, int]:
    # o_lat (T, H, R) and W_UV (H, dv, R) read once, o (T, H, dv) written once
    return F32 * (T * H * R + H * dv * R + T * H * dv), 2 * T * H * dv * R


_COSTS = {"absorb_query": _absorb_query_cost, "attention_absorb": _attention_cost,
          "absorb_output": _absorb_output_cost}


def bytes_moved(operation: str = "attention_absorb", **dims: int) -> int:
    """Fewest bytes an operation moves through device memory (inputs read once, outputs written
    once, float32). Dimensions by the glossary: "absorb_query" (T, H, dn, R), "attention_absorb"
    (T, H, R, dr, S, pairs: the (row, key) pairs a row sees, T * P plus the True entries of the
    (T, T) mask), "absorb_output" (T, H, dv, R). Every head re-reading the cache is not counted:
    at more bytes than this the rate is an effective one."""
    return _COSTS[operation](**dims)[0]


def flops(operation: str = "attention_absorb", **dims: int) -> int:
    """Floating-point operations (a multiply-add counts 2; the softmax's exp is not counted),
    dimensions as in ``bytes_moved``."""
    return _COSTS[operation](**dims)[1]


def _attention_case(name: str, what: str, sizes, prefix: int, visible: np.ndarray):
    """attention_absorb for T rows seeing ``prefix`` cached keys plus ``visible`` (T, T) new ones."""
    config, rows = sizes.config, visible.shape[0]
    heads, rank, rope_dim = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    keys, scale = prefix + rows, softmax_scale(config)                    # S cache rows
    dims = {"T": rows, "H": heads, "R": rank, "dr": rope_dim, "S": keys,
            "pairs": rows * prefix + int(visible.sum())}
    return Case(name, what, f"q ({rows}, {heads}, {rank}+{rope_dim}) cache ({keys}, {rank}+{rope_dim})",
                setup=lambda seed: (uniform((rows, heads, rank), seed),
                                    uniform((rows, heads, rope_dim), seed + 1),
                                    uniform((keys, rank), seed + 2), uniform((keys, rope_dim), seed + 3),
                                    prefix, cuda.to_device(visible), scale),
                call=lambda inputs, **given: attention_absorb(*inputs, **given),
                bytes=bytes_moved("attention_absorb", **dims), flops=flops("attention_absorb", **dims),
                note="the masked kernel (the engine runs attention_paths)",
                peer=lambda inputs: peers.attention(*inputs[:4], peers.prefix_mask(prefix, visible), scale))


def version_plan(version: int, heads: int, rank: int, rope_dim: int, keys: int) -> PathsPlan:
    """``attention_paths``' plan for ``version`` 1, 2, 3 or 5 with the engine's Z and G for it."""
    if version == 5:
        return PathsPlan(unfused=True)
    group = GROUPED_HEADS if version == 3 and heads % GROUPED_HEADS == 0 else 1                 # G
    return PathsPlan(1 if version == 1 else paths_splits(keys, rank, rope_dim, group), group)  # Z


# --8<-- [start:paths_cases]
def _paths_case(sizes, version: int, rows: int, heads: int, context: int, name: str):
    """attention_paths, ``version`` 1, 2, 3 or 5 with the engine's Z and G for it, for the ``rows``
    nodes of a draft tree (1: a decode row) over ``context`` cached keys, ``heads`` heads."""
    config = sizes.config
    rank, rope_dim, scale = config.kv_lora_rank, config.qk_rope_head_dim, softmax_scale(config)
    parents = np.array([-1]) if rows == 1 else draft_tree(np.random.default_rng(rows), sizes, rows).parents
    depths, paths = ancestor_paths(parents)                                   # [T], [T, max depth + 1]
    visible = visibility(parents)                                             # [T, T]
    keys = context + rows                                                     # S cache rows
    plan = version_plan(version, heads, rank, rope_dim, keys)
    groups = plan.partial_groups(keys)                                        # the partials' third axis

    def setup(seed):
        return (uniform((rows, heads, rank), seed), uniform((rows, heads, rope_dim), seed + 1),
                uniform((keys, rank), seed + 2), uniform((keys, rope_dim), seed + 3),
                cuda.to_device(np.array([context], np.int64)), cuda.to_device(depths),
                cuda.to_device(paths), scale)

    def prepare(inputs):                      # the buffers the engine keeps: out, partials, scores (5)
        partials = poisoned((rows, heads, groups, rank + 2)) if groups else None
        scores = poisoned((rows * heads, keys)) if plan.unfused else None
        return poisoned((rows, heads, rank)), partials, scores

    dims = {"T": rows, "H": heads, "R": rank, "dr": rope_dim, "S": keys,
            "pairs": rows * context + int(visible.sum())}
    what = "1 decode row" if rows == 1 else f"a {rows}-node draft tree"
    return Case(name, f"{what}, {heads} heads, {context}-token context",
                f"q ({rows}, {heads}, {rank}+{rope_dim}) cache ({keys}, {rank}+{rope_dim})", setup=setup,
                call=lambda inputs, **given: attention_paths(*inputs, plan=plan, **given),
                bytes=bytes_moved("attention_absorb", **dims), flops=flops("attention_absorb", **dims),
                note=f"version {version}: " + (f"{groups} chunks of {UNFUSED_CHUNK}" if plan.unfused
                                                 else f"Z={plan.splits} G={plan.heads_per_block}"),
                prepare=prepare,
                launch=lambda inputs, given, stream: attention_paths(
                    *inputs, plan=plan, partials=given[1], scores=given[2], out=given[0], stream=stream),
                peer=lambda inputs: peers.attention(*inputs[:4], peers.prefix_mask(context, visible), scale))


def paths_cases(sizes):
    """The engine's attention: versions 1 to 3 for a decode row at the short context; version 3 for
    a 16-node tree; versions 2 and 3 for a 64-node tree; version 3 at the long context and for one
    tensor-parallel rank's heads; version 5 (unfused, the engine's from R = 512) at every shape."""
    short, long = sizes.paths_contexts
    few, many = sizes.paths_trees
    every, rank = sizes.paths_heads
    plan = [(1, 1, every, short, "decode"), (2, 1, every, short, "decode"), (3, 1, every, short, "decode"),
            (3, 1, every, long, "decode_long"), (3, 1, rank, long, "decode_rank_long"),
            (3, few, every, short, "tree_few"), (2, many, every, short, "tree_many"),
            (3, many, every, short, "tree_many"), (3, many, rank, long, "tree_many_rank_long"),
            (5, 1, every, short, "decode"), (5, 1, every, long, "decode_long"),
            (5, 1, rank, long, "decode_rank_long"),
            (5, few, every, short, "tree_few"), (5, many, every, short, "tree_many"),
            (5, many, rank, long, "tree_many_rank_long")]
    return [_paths_case(sizes, version, rows, heads, context, f"paths_v{version}_{role}")
            for version, rows, heads, context, role in plan]
# --8<-- [end:paths_cases]


def _projection_cases(sizes, role: str, rows: int):
    config = sizes.config
    heads, nope, value = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    rank = config.kv_lora_rank
    query = {"T": rows, "H": heads, "dn": nope, "R": rank}
    output_dims = {"T": rows, "H": heads, "dv": value, "R": rank}
    return [
        Case(f"absorb_query_{role}", f"q_nope -> latent query, {rows} row(s)",
             f"q_nope ({rows}, {heads}, {nope}) W_UK ({heads}, {nope}, {rank})",
             setup=lambda seed: (uniform((rows, heads, nope), seed),
                                 uniform((heads, nope, rank), seed + 1, 1 / math.sqrt(nope))),
             call=lambda inputs, **given: absorb_query(*inputs, **given),
             bytes=bytes_moved("absorb_query", **query), flops=flops("absorb_query", **query)),
        Case(f"absorb_output_{role}", f"latent output -> per-head values, {rows} row(s)",
             f"o_lat ({rows}, {heads}, {rank}) W_UV ({heads}, {value}, {rank})",
             setup=lambda seed: (uniform((rows, heads, rank), seed),
                                 uniform((heads, value, rank), seed + 1, 1 / math.sqrt(rank))),
             call=lambda inputs, **given: absorb_output(*inputs, **given),
             bytes=bytes_moved("absorb_output", **output_dims), flops=flops("absorb_output", **output_dims)),
    ]


def bench_cases(sizes):
    """This module's cases of ``python -m kernels.bench``: decode and tree-verify attention with
    the masked kernel and with ``attention_paths`` (``paths_cases``), the absorbed projections for
    one decode row and for a verified tree."""
    tree = verified_tree(sizes)
    short = sizes.decode_prefix
    decode = np.ones((1, 1), bool)
    cases = [
        _attention_case("attention_decode_short", f"absorbed MLA, 1 decode row, {short}-token context",
                        sizes, short, decode),
        _attention_case("attention_verify", f"verify a {tree.size}-node draft tree over a "
                        f"{sizes.verify_prefix}-token context", sizes, sizes.verify_prefix,
                        visibility(tree.parents)),
    ]
    cases += paths_cases(sizes)
    for role, rows in (("decode", 1), ("verify", sizes.rows)):
        cases += _projection_cases(sizes, role, rows)
    return cases
