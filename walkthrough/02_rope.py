"""Chapter 2: rotary position embedding (NeoX rotate-halves) with YaRN frequencies.

RoPE rotates feature pairs of the query and key by an angle proportional to the token's
position, so q . k depends only on the distance between the two positions. This chapter

* shows that NeoX (pair i with i + dr/2) and the interleaved form (pair 2i with 2i + 1) are the
  same rotation up to a fixed permutation of the features, which can be folded into the weights;
* plots YaRN's inverse frequencies against the base ones for tiny-b and Kimi K2.6 (the figure),
  and prints the mscale^2 factor that YaRN puts on the attention logits;
* runs the numba.cuda kernel against the numpy reference on a draft tree's positions, where
  siblings share a position, and at Kimi's last position (262143);
* prints the two kernel versions' device times on the GPU from the committed benchmark record.

    .venv/bin/python walkthrough/02_rope.py

Writes docs/assets/figures/02_rope_yarn_inv_freq.png and 02_rope_report.txt (what it prints).
"""

import dataclasses
import math

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from ddtree import rope as ref
from ddtree.config import preset
from ddtree.tree import visibility
from kernels import device
from kernels import rope as knl
from kernels.bench.cases import rope as rope_costs

STEM = "02_rope"


# --8<-- [start:interleaved]
def apply_rope_interleaved(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """DeepSeek's original layout: rotate the pairs (x[2i], x[2i+1]). x (T, dr) -> (T, dr)."""
    cos, sin = ref.rope_tables(positions, inv_freq)             # [T, dr/2] each
    even, odd = x[:, 0::2], x[:, 1::2]                          # [T, dr/2] each
    out = np.empty_like(x)
    out[:, 0::2] = even * cos - odd * sin
    out[:, 1::2] = odd * cos + even * sin
    return out


def neox_permutation(dim: int) -> np.ndarray:
    """[0, 2, 4, ..., 1, 3, 5, ...]: feature perm[j] of the interleaved layout is NeoX feature j."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])
# --8<-- [end:interleaved]


def layouts_demo(rng) -> None:
    config = preset("tiny-b")
    freqs = ref.inv_freq(config)
    dim = config.qk_rope_head_dim
    perm = neox_permutation(dim)
    q, k = rng.standard_normal((2, 1, dim)).astype(np.float32)
    p_q, p_k = np.array([300]), np.array([41])
    rotated_same = np.abs(ref.apply_rope(q[:, perm], p_q, freqs) -
                          apply_rope_interleaved(q, p_q, freqs)[:, perm]).max()
    score_interleaved = float(apply_rope_interleaved(q, p_q, freqs)[0] @
                              apply_rope_interleaved(k, p_k, freqs)[0])
    score_neox = float(ref.apply_rope(q[:, perm], p_q, freqs)[0] @ ref.apply_rope(k[:, perm], p_k, freqs)[0])
    print(f"NeoX vs interleaved, dr={dim}, perm={perm.tolist()}:")
    print(f"  max |neox(x[perm]) - interleaved(x)[perm]| = {rotated_same:.1e}")
    print(f"  q.k at positions 300/41: interleaved {score_interleaved:.6f}, neox {score_neox:.6f}")


def span(indices: np.ndarray) -> str:
    return f"{indices.min()}" if indices.size == 1 else f"{indices.min()}..{indices.max()}"


def yarn_report() -> None:
    with chapter.section("yarn"):
        for name in ("tiny-b", "kimi-k2.6"):
            yarn_lines(preset(name), name)


def yarn_lines(config, name: str) -> None:
    """Which pairs YaRN keeps and divides, and the logit scale, for one preset."""
    scaling = config.rope_scaling
    factor = scaling["factor"]
    base = ref.inv_freq(dataclasses.replace(config, rope_scaling=None)).astype(np.float64)
    yarn = ref.inv_freq(config).astype(np.float64)
    ramp = (1 - yarn / base) / (1 - 1 / factor)             # 0: kept, 1: divided by factor
    kept, scaled = np.flatnonzero(ramp < 1e-6), np.flatnonzero(ramp > 1 - 1e-6)
    m = ref.yarn_mscale(factor, scaling["mscale_all_dim"])
    print(f"{name}: {base.size} pairs, factor {factor:g}: pairs {span(kept)} keep the base "
          f"frequency, {span(scaled)} divide it by {factor:g}")
    print(f"  m = {m:.4f}, m^2 = {m * m:.4f}, softmax scale = 1/sqrt({config.qk_head_dim}) * m^2 "
          f"= {ref.softmax_scale(config):.5f}, cos/sin factor = {ref.cos_sin_scale(config):g}")


def plot_yarn() -> None:
    fig, axes = plt.subplots(2, 1, figsize=(8, 8.2))
    for ax, name in zip(axes, ("tiny-b", "kimi-k2.6"), strict=True):
        config = preset(name)
        factor = config.rope_scaling["factor"]
        original = config.rope_scaling["original_max_position_embeddings"]
        base = ref.inv_freq(dataclasses.replace(config, rope_scaling=None))
        yarn = ref.inv_freq(config)
        pairs = np.arange(base.size)
        ramp = (1 - yarn.astype(np.float64) / base) / (1 - 1 / factor)
        ax.semilogy(pairs, base, "o-", ms=4, label="base  theta^(-2i/dr)")
        ax.semilogy(pairs, yarn, "s-", ms=4, label=f"YaRN (factor {factor:g})")
        ax.semilogy(pairs, base / factor, ":", color="gray", label=f"base / {factor:g}")
        ax.axhline(2 * math.pi / original, color="tab:red", lw=0.8, ls="--",
                   label=f"one turn per original context ({original})")
        ramping = pairs[(ramp > 1e-6) & (ramp < 1 - 1e-6)]
        if ramping.size:
            ax.axvspan(ramping.min() - 0.5, ramping.max() + 0.5, color="tab:orange", alpha=0.12,
                       label="ramp 0 < r_i < 1")
        ax.set_title(f"{name}: dr = {config.qk_rope_head_dim}, theta = {config.rope_theta:g}")
        ax.set_xlabel("feature pair i")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("inverse frequency (rad / position)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("RoPE inverse frequencies, base vs YaRN (ddtree.rope.inv_freq)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "yarn_inv_freq")


def tree_positions_demo(rng) -> None:
    config = preset("tiny-b")
    freqs, scale = ref.inv_freq(config), ref.cos_sin_scale(config)
    parents = np.array([-1, 0, 0, 1, 1, 2])                     # root, two children, three grandchildren
    depths = np.array([0, 1, 1, 2, 2, 2])
    positions = 10 + depths                                     # siblings share a position
    heads, dim = 2, config.qk_rope_head_dim
    q_pe = rng.standard_normal((parents.size, heads, dim)).astype(np.float32)   # [T, H, dr]
    k_pe = rng.standard_normal((parents.size, dim)).astype(np.float32)          # [T, dr] shared key
    q_diff = np.abs(knl.apply_rope(q_pe, positions, freqs, scale) -
                    ref.apply_rope(q_pe, positions, freqs, scale)).max()
    k_diff = np.abs(knl.apply_rope(k_pe, positions, freqs, scale) -
                    ref.apply_rope(k_pe, positions, freqs, scale)).max()
    print(f"tree of {parents.size} nodes, positions {positions.tolist()}")
    print(f"  ancestor mask rows: {[np.flatnonzero(r).tolist() for r in visibility(parents)]}")
    print(f"  apply_rope q_pe {q_pe.shape}: max |numpy - numba| = {q_diff:.1e}; "
          f"shared key k_pe {k_pe.shape}: {k_diff:.1e}")

    kimi = preset("kimi-k2.6")
    far = np.array([0, 1, 4095, kimi.max_position_embeddings - 1])
    x = rng.standard_normal((far.size, kimi.qk_rope_head_dim)).astype(np.float32)
    kimi_freqs = ref.inv_freq(kimi)
    diff = np.abs(knl.apply_rope(x, far, kimi_freqs) - ref.apply_rope(x, far, kimi_freqs)).max()
    print(f"  Kimi K2.6 key at positions {far.tolist()}: max |numpy - numba| = {diff:.1e}")


def bytes_report() -> None:
    """A Kimi decode row's rotation (query heads and the shared key) against one launch."""
    kimi = preset("kimi-k2.6")
    heads, dim = kimi.num_attention_heads, kimi.qk_rope_head_dim
    moved = rope_costs.bytes_moved(T=1, H=heads, dr=dim) + rope_costs.bytes_moved(T=1, H=1, dr=dim)
    with chapter.section("bytes"):
        chapter.print_gpu()
        print(f"Kimi K2.6 decode row: q_pe (1, {heads}, {dim}) and k_pe (1, {dim}) rotated, "
              f"{moved / 1e3:.1f} KB read and written")
        print(f"  {chapter.time_floor(moved) * 1e6:.3f} us at the read bandwidth, against "
              f"{2 * chapter.gpu().launch * 1e6:.1f} us of host time for the two launches")


def versions_report() -> None:
    """Version 1 (a cos and sin per head) against version 2 (per group of heads), in one run."""
    cases, hw = chapter.bench_cases(), chapter.gpu()
    with chapter.section("versions"):
        print(f"{hw.name}, {hw.record} (read {hw.bandwidth / 1e9:.0f} GB/s):")
        for name in ("rope_q_pe", "rope_q_pe_large"):
            for version, case in ((1, f"{name}_v1"), (2, name)):
                row = cases[case]
                print(f"  {row['shape']:<20} version {version}: {row['device µs']:>6} us, "
                      f"{row['% of read BW']:>5}% of the read bandwidth")


if __name__ == "__main__":
    with chapter.report(STEM):
        print(f"kernels run on: {device.where()}")
        rng = np.random.default_rng(0)
        layouts_demo(rng)
        yarn_report()
        plot_yarn()
        tree_positions_demo(rng)
        bytes_report()
        versions_report()
