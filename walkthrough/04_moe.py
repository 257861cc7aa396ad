"""Chapter 4: mixture of experts with DeepSeek-V3 routing.

Every MoE layer sends each token to k of E routed experts plus one shared expert. The router
scores experts with a sigmoid, adds a correction bias that only *chooses* (it never weighs),
keeps the best groups of experts (group-limited routing), takes the top k, and weighs the chosen
experts by their unbiased scores, normalised to sum 1 and multiplied by routed_scaling_factor.

This chapter runs tiny-b (12 experts in 4 groups of 3, 2 groups kept, top-3) on its golden
prompt and continuation, records the *real* router inputs of its two MoE layers (layer 0 is
dense) by wrapping the model's ``moe`` operation, and draws the routing weights (tokens x experts)
and the load per expert. It then runs the numba.cuda router on the same inputs, which must pick
exactly the same experts, and the numba SwiGLU and MoE against numpy.

    .venv/bin/python walkthrough/04_moe.py

Writes docs/assets/figures/04_moe_routing.png, 04_moe_load.png and 04_moe_report.txt (what it prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from ddtree import moe as ref
from ddtree.config import preset
from ddtree.model import Transformer
from kernels import device
from kernels import moe as knl
from kernels.bench.cases import moe as costs

STEM = "04_moe"


# --8<-- [start:record_router_inputs]
def record_router_inputs(model: Transformer, tokens: np.ndarray) -> list[tuple[np.ndarray, ref.MoEParams]]:
    """One causal pass over ``tokens``; returns (x, params) for every MoE layer, in layer order.

    x (T, D) is what the router really sees: the post-attention RMSNorm of the residual stream.
    The model calls its operations through ``model.ops``, so recording ``ops.moe`` catches them.
    """
    with chapter.record_ops(model, "moe") as calls:
        model.logits(tokens)
    return [(call.args[0], call.args[1]) for call in calls]
# --8<-- [end:record_router_inputs]


def margin(x: np.ndarray, params: ref.MoEParams, config) -> float:
    """Smallest gap between the k-th chosen and the best unchosen biased score (same groups)."""
    scores = ref.sigmoid(np.matmul(x, params.gate.T, dtype=np.float32)) + params.bias  # [T, E]
    ids, _ = ref.route(x, params.gate, params.bias, config)
    gaps = []
    for row, chosen in zip(scores, ids, strict=True):
        groups = np.unique(chosen // (config.n_routed_experts // config.n_group))
        in_kept = np.isin(np.arange(row.size) // (config.n_routed_experts // config.n_group), groups)
        rest = np.setdiff1d(np.flatnonzero(in_kept), chosen)
        if rest.size:
            gaps.append(row[chosen].min() - row[rest].max())
    return float(min(gaps))


def plot_routing(layers, config) -> None:
    experts, size = config.n_routed_experts, config.n_routed_experts // config.n_group
    fig, axes = plt.subplots(1, len(layers), figsize=(5.2 * len(layers), 6.2), sharey=True)
    for ax, (layer, x, params) in zip(axes, layers, strict=True):
        ids, weights = ref.route(x, params.gate, params.bias, config)
        dense = np.zeros((x.shape[0], experts), np.float32)                     # [T, E]
        np.put_along_axis(dense, ids, weights, axis=-1)
        image = ax.imshow(dense, aspect="auto", cmap="magma_r", vmin=0,
                          vmax=config.routed_scaling_factor * 0.6, interpolation="nearest")
        for g in range(1, config.n_group):
            ax.axvline(g * size - 0.5, color="tab:blue", lw=1)
        ax.set_xticks(range(experts))
        ax.set_xlabel(f"routed expert (groups of {size}, blue lines)")
        ax.set_title(f"layer {layer}: weights of the {config.num_experts_per_tok} chosen experts")
    axes[0].set_ylabel("token (prompt 0-7, then the greedy continuation)")
    fig.colorbar(image, ax=axes, shrink=0.8,
                 label=f"routing weight (each row sums to {config.routed_scaling_factor})")
    fig.suptitle("tiny-b routing on the golden tokens (real post-attention hidden states)")
    chapter.save_figure(fig, STEM, "routing", bbox_inches="tight")


def plot_load(layers, config) -> None:
    experts, size = config.n_routed_experts, config.n_routed_experts // config.n_group
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(layers)
    for i, (layer, x, params) in enumerate(layers):
        ids, _ = ref.route(x, params.gate, params.bias, config)
        load = np.bincount(ids.ravel(), minlength=experts)
        ax.bar(np.arange(experts) + (i - (len(layers) - 1) / 2) * width, load, width, label=f"layer {layer}")
        print(f"  layer {layer} tokens per expert: {load.tolist()}")
    tokens = layers[0][1].shape[0]
    even = tokens * config.num_experts_per_tok / experts
    ax.axhline(even, color="gray", ls="--", lw=1, label=f"even load T*k/E = {even:g}")
    for g in range(1, config.n_group):
        ax.axvline(g * size - 0.5, color="tab:blue", lw=0.8, alpha=0.5)
    ax.set_xticks(range(experts))
    ax.set_xlabel("routed expert")
    ax.set_ylabel(f"tokens routed (of {tokens})")
    ax.set_title("tiny-b expert load on the golden tokens")
    ax.legend(fontsize=9)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "load")


def kernels_vs_numpy(layers, config) -> None:
    for layer, x, params in layers:
        with chapter.timed(f"numba route, layer {layer}"):
            ids, weights = knl.route(x, params.gate, params.bias, config)
        ref_ids, ref_weights = ref.route(x, params.gate, params.bias, config)
        print(f"route, layer {layer}, x {x.shape}: selected experts equal exactly: "
              f"{np.array_equal(ids, ref_ids)}")
        print(f"  max |weight diff| {np.abs(weights - ref_weights).max():.1e}; "
              f"smallest margin chosen vs unchosen {margin(x, params, config):.3f}")
        assert np.array_equal(ids, ref_ids), f"layer {layer}: numba and numpy chose different experts"
    layer, x, params = layers[0]
    x = x[:2]                       # two tokens: 6 routed slots + the shared expert, seconds in the simulator
    with chapter.timed("numba swiglu + moe"):
        shared = knl.swiglu(x, params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
        mixed = knl.moe(x, params, config)
    ref_shared = ref.swiglu(x, params.shared_gate_proj, params.shared_up_proj, params.shared_down_proj)
    ref_mixed = ref.moe(x, params, config)
    print(f"swiglu (shared expert) x {x.shape}: max |numpy - numba| = "
          f"{np.abs(shared - ref_shared).max():.1e}; moe: {np.abs(mixed - ref_mixed).max():.1e} "
          f"(max |y| {np.abs(ref_mixed).max():.2f})")


def kimi_bytes() -> None:
    """What one MoE layer reads at Kimi K2.6: one decode token against a 64-node tree."""
    kimi = preset("kimi-k2.6")
    D, E, F, k = kimi.hidden_size, kimi.n_routed_experts, kimi.moe_intermediate_size, kimi.num_experts_per_tok
    Fs = kimi.n_shared_experts * F
    expert = 3 * D * F * 4                                               # gate, up, down; fp32
    with chapter.section("bytes"):
        chapter.print_gpu()
        print(f"Kimi K2.6 MoE layer, fp32: one expert = 3 x {D} x {F} weights = {expert / 1e6:.0f} MB; "
              f"router {E} x {D}")
        for rows, used, what in ((1, k, "1 decode token"), (65, E, "65 tree rows, every expert reached")):
            moved = costs.bytes_moved("moe", T=rows, D=D, E=E, F=F, Fs=Fs, k=k, used=used)
            flops = costs.flops("moe", T=rows, D=D, E=E, F=F, Fs=Fs, k=k, used=used)
            print(f"  {what}: {used} routed experts + the shared one, {moved / 1e9:.2f} GB, "
                  f"floor {chapter.time_floor(moved, flops) * 1e3:.2f} ms")


def main() -> None:
    """Record tiny-b's router inputs on the golden tokens, draw the routing, check the kernels."""
    print(f"kernels run on: {device.where()}")
    setup = chapter.golden_model("tiny-b")
    config = setup.config
    tokens = np.concatenate([setup.prompt, setup.ar_tokens])
    recorded = record_router_inputs(setup.model, tokens)
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    layers = [(i, x, params) for i, (x, params) in zip(moe_layers, recorded, strict=True)]
    print(f"tiny-b: {config.n_routed_experts} experts in {config.n_group} groups, keep {config.topk_group} "
          f"groups, top-{config.num_experts_per_tok}, scaling {config.routed_scaling_factor}")
    print(f"  {tokens.size} golden tokens, MoE layers {moe_layers}")
    plot_routing(layers, config)
    plot_load(layers, config)
    kernels_vs_numpy(layers, config)
    kimi_bytes()


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
