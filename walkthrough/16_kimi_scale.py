"""Kimi K2.6 at full scale: parameters, bytes, the latent cache, and one rank of tensor-parallel 8.

Everything is computed from the ``kimi-k2.6`` preset (``ddtree.config.preset``) and the
checkpoint's tensor shapes (``ddtree.weights.weight_shapes``), never typed:

* parameters and bytes per layer (the dense layer 0, one MoE layer) and in total, grouped by role
  (attention, norms, dense MLP, router, routed experts, shared expert, embedding, lm_head);
* the same in three storage formats: fp32 (this project), bf16, and bf16 with INT4 routed
  experts (group size 32, one bf16 scale per group: 4.5 bits per weight);
* the parameters one token activates (k of E routed experts);
* the latent KV cache per token and per 128k-token context;
* what one rank of tensor-parallel 8 holds (8 heads, 1/8 of every expert or 48 whole experts, the
  whole latent cache) and the collectives each layer needs, in bytes, for a decode row and a tree.

Run: .venv/bin/python walkthrough/16_kimi_scale.py

Writes docs/assets/figures/16_kimi_scale_report.txt (what it prints).
"""

from __future__ import annotations

import collections

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import numpy as np

from ddtree.config import preset
from ddtree.weights import weight_shapes

STEM = "16_kimi_scale"
CONTEXT = 131072                     # a 128k-token context
TP = 8                               # tensor-parallel ranks
GROUP = 32                           # INT4 quantisation group (weights per scale)
TREE_ROWS = 65                       # a 64-node draft tree and its root
ROLES = ("attention", "norms", "dense MLP", "router", "routed experts", "shared expert")


# --8<-- [start:role]
def role(name: str) -> str:
    """What a checkpoint tensor is for, from its Hugging Face name."""
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if name == "model.norm.weight" or name.endswith("layernorm.weight") and ".self_attn." not in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared expert"
    if ".mlp.gate." in name:
        return "router"
    return "dense MLP"
# --8<-- [end:role]


# --8<-- [start:formats]
def bytes_per_weight(fmt: str, kind: str) -> float:
    """Storage per weight: fp32 everywhere; bf16 everywhere; or bf16 with INT4 routed experts, whose
    weights take 4 bits plus one bf16 scale per group of GROUP weights."""
    if fmt == "fp32":
        return 4.0
    if fmt == "bf16" or kind != "routed experts":
        return 2.0
    return 0.5 + 2.0 / GROUP
# --8<-- [end:formats]


FORMATS = ("fp32", "bf16", "int4 experts")


def count(shapes: dict, layer: int | None) -> collections.Counter:
    """Parameters per role, for one decoder layer (``layer``) or for the tensors outside the layers."""
    prefix = f"model.layers.{layer}." if layer is not None else None
    counts = collections.Counter()
    for name, shape in shapes.items():
        inside = name.startswith("model.layers.")
        if (prefix is None and not inside) or (prefix is not None and name.startswith(prefix)):
            counts[role(name)] += int(np.prod(shape))
    return counts


def gigabytes(counts: collections.Counter, fmt: str) -> float:
    return sum(n * bytes_per_weight(fmt, kind) for kind, n in counts.items()) / 1e9


def parameters_report(config, shapes) -> dict[str, collections.Counter]:
    dense, moe = count(shapes, 0), count(shapes, config.first_k_dense_replace)
    outside = count(shapes, None)
    layers_moe = config.num_hidden_layers - config.first_k_dense_replace
    total = outside + sum((dense,) * config.first_k_dense_replace, collections.Counter())
    for _ in range(layers_moe):
        total.update(moe)
    assert sum(total.values()) == sum(int(np.prod(s)) for s in shapes.values()), "every tensor counted once"
    with chapter.section("params"):
        print(f"Kimi K2.6: {config.num_hidden_layers} layers ({config.first_k_dense_replace} dense, "
              f"{layers_moe} MoE), {len(shapes)} tensors")
        print(f"{'':<26} {'params':>17} {'GB fp32':>8} {'GB bf16':>8} {'GB int4 experts':>16}")
        rows = [(f"layer 0 ({r})", {r: dense[r]}) for r in ROLES if dense[r]]
        rows += [("layer 0 in all", dense)]
        rows += [(f"MoE layer ({r})", {r: moe[r]}) for r in ROLES if moe[r]]
        rows += [("MoE layer in all", moe), ("embedding", {"embedding": outside["embedding"]}),
                 ("lm_head", {"lm_head": outside["lm_head"]}), ("whole model", total)]
        for label, counts in rows:
            counts = collections.Counter(counts)
            sizes = [gigabytes(counts, fmt) for fmt in FORMATS]
            print(f"{label:<26} {sum(counts.values()):>17,} "
                  f"{sizes[0]:>8.2f} {sizes[1]:>8.2f} {sizes[2]:>16.2f}")
    return {"dense": dense, "moe": moe, "outside": outside, "total": total}


def active_report(config, counts) -> None:
    """Parameters one token uses: everything but the routed experts, and k of E of those."""
    share = config.num_experts_per_tok / config.n_routed_experts
    active = counts["total"].copy()
    active["routed experts"] = round(active["routed experts"] * share)
    read = active.copy()
    read["embedding"] = config.hidden_size                              # a decode step gathers one row
    with chapter.section("active"):
        print(f"one token activates {config.num_experts_per_tok} of {config.n_routed_experts} routed "
              f"experts per MoE layer: {sum(active.values()) / 1e9:.1f} B of "
              f"{sum(counts['total'].values()) / 1e9:.1f} B parameters")
        print(f"  weights a decode step reads (one embedding row, not the table): "
              f"{gigabytes(read, 'fp32'):.0f} GB fp32,")
        print(f"  {gigabytes(read, 'bf16'):.1f} GB bf16, {gigabytes(read, 'int4 experts'):.1f} GB "
              f"with int4 experts")


def cache_report(config) -> None:
    width, layers = config.latent_cache_width, config.num_hidden_layers
    with chapter.section("cache"):
        print(f"latent cache per token: {config.kv_lora_rank} + {config.qk_rope_head_dim} = {width} values "
              f"x {layers} layers = {width * layers:,} values")
        for fmt, size in (("fp32", 4), ("bf16", 2)):
            per_token = width * layers * size
            print(f"  {fmt}: {per_token / 1e3:.1f} KB per token, {per_token * CONTEXT / 1e9:.2f} GB per "
                  f"{CONTEXT // 1024}k-token context")


def rank_report(config, counts) -> None:
    """What one rank of TP-8 holds (bf16, int4 experts), attention split by heads."""
    prefix = f"model.layers.{config.first_k_dense_replace}.self_attn."
    split_by_heads = {"q_b_proj", "kv_b_proj", "o_proj"}             # 1/TP each; q_a, kv_a replicated
    attention = sum(int(np.prod(shape)) / (TP if name.split(".")[-2] in split_by_heads else 1)
                    for name, shape in weight_shapes(config).items() if name.startswith(prefix))
    moe = counts["moe"]
    rank = collections.Counter({"attention": attention, "routed experts": moe["routed experts"] / TP,
                                "shared expert": moe["shared expert"] / TP, "router": moe["router"],
                                "norms": moe["norms"]})
    whole = gigabytes(counts["total"], "int4 experts")
    cache = config.latent_cache_width * config.num_hidden_layers * 2 * CONTEXT
    heads = config.num_attention_heads
    with chapter.section("tp8"):
        print(f"one rank of TP-{TP}: {heads // TP} of {heads} heads")
        print(f"  attention: q_b, kv_b, o_proj split by heads, q_a and kv_a replicated: "
              f"{attention / 1e6:.1f} M of {moe['attention'] / 1e6:.1f} M")
        print(f"  routed experts: 1/{TP} of their weights: 1/{TP} of every expert's F columns (TP)")
        print(f"    or {config.n_routed_experts // TP} whole experts (EP)")
        print(f"  one MoE layer (bf16, int4 experts): {gigabytes(rank, 'int4 experts'):.2f} GB on one rank "
              f"of {gigabytes(moe, 'int4 experts'):.2f} GB")
        print(f"  the whole model: {whole:.0f} GB, {whole / TP:.0f} GB per rank if every part split evenly")
        print(f"  the latent cache is shared by all heads, so every rank holds all of it: "
              f"{cache / 1e9:.2f} GB")
        print(f"    per {CONTEXT // 1024}k-token context (bf16)")


def collectives_report(config) -> None:
    """Bytes per layer: a ring all-reduce of (T, D) bf16 activations, or an EP dispatch + combine."""
    hidden, k = config.hidden_size, config.num_experts_per_tok
    ring = 2 * (TP - 1) / TP                                            # reduce-scatter + all-gather
    with chapter.section("collectives"):
        print(f"per layer, bf16 activations; a ring all-reduce over {TP} ranks sends 2 (p-1)/p of the data:")
        print(f"  {'rows T':<24} {'all-reduce (T, D)':>17} {'sent per rank':>14} {'EP: T k rows x 2':>17}")
        for rows, what in ((1, "decode row"), (TREE_ROWS, "tree of 64 + root")):
            data = rows * hidden * 2
            print(f"  {f'{rows} ({what})':<24} {data / 1e3:>14.1f} KB {ring * data / 1e3:>11.1f} KB "
                  f"{2 * rows * k * hidden * 2 / 1e3:>14.1f} KB")


def main() -> None:
    config = preset("kimi-k2.6")
    shapes = weight_shapes(config)
    counts = parameters_report(config, shapes)
    active_report(config, counts)
    cache_report(config)
    rank_report(config, counts)
    collectives_report(config)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
