"""Chapter 3: multi-head latent attention (MLA), naive and absorbed, over one masked prefix.

MLA caches one normalised latent c (kv_lora_rank floats) and one rotated rope key k_pe
(qk_rope_head_dim floats) per token per layer, shared by every head. The textbook ("naive") form
expands each cached latent into per-head keys and values; the absorbed form moves W_UK onto the
query and W_UV after the softmax and attends in latent space. This chapter

* counts the cache (576 floats per token per layer at Kimi K2.6, against 20480 expanded);
* models the FLOPs and bytes of both forms against the context length for one decode row and for
  a 64-node draft tree (the figure);
* draws the three key masks that one attention function serves: prefill (causal), decode and
  tree verification (the second figure);
* runs the tiny model with both forms and prints the largest logit difference;
* runs the numba.cuda absorb kernels against numpy on a tree behind a cached prefix.

    .venv/bin/python walkthrough/03_mla.py

Writes docs/assets/figures/03_mla_cost.png, 03_mla_masks.png and 03_mla_report.txt (what it prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np

import kernels  # noqa: F401  (decides GPU or CUDA simulator before numba loads)
from ddtree import mla as ref
from ddtree.config import preset
from ddtree.model import Transformer
from ddtree.tree import visibility
from kernels import device
from kernels import mla as knl
from kernels.bench.cases import mla as costs

STEM = "03_mla"
FLOAT = 4
TREE_ROWS = 64                 # the tree size of the figure's second case


# --8<-- [start:mla_cost]
def mla_cost(config, rows: int, keys: int, form: str) -> tuple[int, int]:
    """(bytes, FLOPs) of one layer's attention core for ``rows`` queries over ``keys`` cached keys.

    Counted: q_nope -> scores -> softmax-weighted sum -> per-head output (o_proj and the
    projections that make q, c and k_pe are the same in both forms and left out); every row sees
    every key. 'absorb' is the three kernels of kernels/mla.py, their cost models
    (kernels/bench/cases/mla.py) summed.
    'naive' is ddtree.mla.attention_naive, which has no kernel: it expands k_nope and v for
    every key and writes them to memory before attending (as eager framework code does).
    """
    H, R, dr = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    dn, dv = config.qk_nope_head_dim, config.v_head_dim
    T, S = rows, keys
    if form == "absorb":
        steps = (("absorb_query", dict(T=T, H=H, dn=dn, R=R)),
                 ("attention_absorb", dict(T=T, H=H, R=R, dr=dr, S=S, pairs=T * S)),
                 ("absorb_output", dict(T=T, H=H, dv=dv, R=R)))
        return (sum(costs.bytes_moved(op, **dims) for op, dims in steps),
                sum(costs.flops(op, **dims) for op, dims in steps))
    if form == "naive":
        cache = S * (R + dr)                               # latent + shared rope key per token
        weights = H * (dn + dv) * R                        # W_UK and W_UV
        io = T * H * (dn + dr) + T * H * dv                # queries in, outputs out
        expanded = S * H * (dn + dv)                       # k_nope and v for every key
        flops = 2 * (S * R * H * (dn + dv)                 # expansion
                     + T * H * S * (dn + dr)               # scores
                     + T * H * S * dv)                     # weighted sum of v
        return FLOAT * (cache + weights + io + 2 * expanded), flops   # expanded: written, read back
    raise ValueError(f"form must be 'absorb' or 'naive', got {form!r}")
# --8<-- [end:mla_cost]


def cache_report() -> None:
    kimi = preset("kimi-k2.6")
    H = kimi.num_attention_heads
    latent = kimi.latent_cache_width
    expanded = H * kimi.qk_head_dim + H * kimi.v_head_dim
    layers, context = kimi.num_hidden_layers, kimi.max_position_embeddings
    with chapter.section("cache"):
        print(f"Kimi K2.6 cache per token per layer: latent {kimi.kv_lora_rank} + rope "
              f"{kimi.qk_rope_head_dim} = {latent} floats")
        print(f"  expanded K/V: {H}*({kimi.qk_nope_head_dim}+{kimi.qk_rope_head_dim}) + "
              f"{H}*{kimi.v_head_dim} = {expanded} floats ({expanded / latent:.1f}x)")
        tokens = layers * context * FLOAT
        print(f"  fp32, {layers} layers, {context} tokens: latent {latent * tokens / 1e9:.1f} GB, "
              f"expanded {expanded * tokens / 1e9:.0f} GB")


def cost_report() -> None:
    kimi = preset("kimi-k2.6")
    H, R, dr = kimi.num_attention_heads, kimi.kv_lora_rank, kimi.qk_rope_head_dim
    with chapter.section("cost"):
        chapter.print_gpu()
        print("one layer's attention core at Kimi K2.6 dims, fp32; floor = the slower of the bytes")
        print("at the read bandwidth and the FLOPs at the fp32 rate")
        print(f"  {'T':>3} {'S':>7}  {'form':<6} {'GFLOP':>8} {'MB':>8} {'floor ms':>9}  FLOP ratio")
        for rows in (1, TREE_ROWS):
            for keys in (4096, 131072):
                a_bytes, a_flops = mla_cost(kimi, rows, keys, "absorb")
                n_bytes, n_flops = mla_cost(kimi, rows, keys, "naive")
                for form, flops, moved in (("absorb", a_flops, a_bytes), ("naive", n_flops, n_bytes)):
                    ratio = f"  {n_flops / a_flops:.1f}x" if form == "naive" else ""
                    print(f"  {rows:>3} {keys:>7}  {form:<6} {flops / 1e9:>8.2f} {moved / 1e6:>8.1f} "
                          f"{chapter.time_floor(moved, flops) * 1e3:>9.3f}{ratio}")
        per_key_flops, per_key_bytes = 2 * H * (2 * R + dr), FLOAT * (R + dr)
        print(f"absorbed, per cached key: 2H(2R + dr) = {per_key_flops} FLOPs over 4(R + dr) = "
              f"{per_key_bytes} bytes = {per_key_flops / per_key_bytes:.0f} FLOP/byte")
        hw = chapter.gpu()
        print(f"against the fp32 ridge point of the first line, {hw.fp32 / hw.bandwidth:.1f} FLOP/byte")


def plot_cost() -> None:
    kimi = preset("kimi-k2.6")
    keys = np.unique(np.logspace(np.log2(512), np.log2(kimi.max_position_embeddings), 60, base=2).astype(int))
    fig, axes = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    styles = {("absorb", 1): ("tab:blue", "-"), ("absorb", TREE_ROWS): ("tab:blue", "--"),
              ("naive", 1): ("tab:red", "-"), ("naive", TREE_ROWS): ("tab:red", "--")}
    for (form, rows), (color, ls) in styles.items():
        cost = np.array([mla_cost(kimi, rows, s, form) for s in keys], dtype=np.float64)   # [len, 2]
        floor = np.array([chapter.time_floor(moved, flops) for moved, flops in cost])
        label = f"{form}, {'1 decode row' if rows == 1 else f'{rows}-node tree'}"
        axes[0].loglog(keys, cost[:, 1], color=color, ls=ls, label=label)
        axes[1].loglog(keys, cost[:, 0], color=color, ls=ls, label=label)
        axes[2].loglog(keys, floor * 1e3, color=color, ls=ls, label=label)
    titles = ("FLOPs", "bytes (fp32)", f"time floor on the {chapter.gpu().name}: the slower of the two")
    for ax, title, unit in zip(axes, titles,
                               ("FLOP per layer", "bytes per layer", "ms per layer"), strict=True):
        ax.set_title(title, fontsize=11)
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
    axes[-1].set_xlabel("cached tokens S (context)")
    axes[0].legend(fontsize=9)
    fig.suptitle("MLA attention core at Kimi K2.6 dims, one layer\n(64 heads, R=512, dr=64, dn=dv=128)")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "cost")


def plot_masks() -> None:
    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    cases = [("prefill: P = 0, causal", 0, ref.causal_visibility(6)),
             ("decode: P = 7, one row", 7, np.ones((1, 1), bool)),
             ("tree verify: P = 4, ancestors", 4, visibility(parents))]
    fig = plt.figure(figsize=(8, 7.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[6, 7], width_ratios=[6, 8])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
    for ax, (title, prefix, visible) in zip(axes, cases, strict=True):
        mask = ref.key_mask(prefix, visible)                                    # [T, P+T]
        ax.imshow(mask, cmap="Blues", vmin=-0.3, vmax=1.2)
        ax.axvline(prefix - 0.5, color="tab:red", lw=1.5)
        ax.set_xticks(range(mask.shape[1]))
        ax.set_yticks(range(mask.shape[0]))
        ax.set_xlabel("key slot s (prefix | new rows)")
        ax.set_ylabel("query row t")
        ax.set_title(title, fontsize=10)
    fig.suptitle("key_mask(prefix_len, visible), dark = visible:\n"
                 "the prefix to every row, new rows as visible says")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "masks")


def naive_vs_absorb_model() -> None:
    setup = chapter.golden_model("tiny")
    prompt = setup.prompt
    absorb = setup.model.logits(prompt)                                         # [T, V]
    naive = Transformer(setup.config, setup.weights, attention="naive").logits(prompt)
    same = np.array_equal(absorb.argmax(-1), naive.argmax(-1))
    print(f"tiny model, prompt of {prompt.size} tokens: max |absorb - naive| logit = "
          f"{np.abs(absorb - naive).max():.2e} (max |logit| {np.abs(naive).max():.1f})")
    print(f"  same greedy tokens: {same}")
    assert same, "absorbed and naive attention must pick the same greedy tokens"


def kernels_vs_numpy(rng) -> None:
    """A 6-node tree behind a 5-token prefix, at micro's attention dims, numpy vs numba.cuda."""
    c = preset("micro")
    H, R, dr, dn, dv = (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim,
                        c.qk_nope_head_dim, c.v_head_dim)
    parents = np.array([-1, 0, 0, 1, 2, 2])
    prefix, rows = 5, parents.size
    visible = visibility(parents)                                              # [T, T]
    q_nope = rng.standard_normal((rows, H, dn)).astype(np.float32)            # [T, H, dn]
    q_pe = rng.standard_normal((rows, H, dr)).astype(np.float32)              # [T, H, dr]
    w_uk = (rng.standard_normal((H, dn, R)) / np.sqrt(dn)).astype(np.float32)   # [H, dn, R]
    w_uv = (rng.standard_normal((H, dv, R)) / np.sqrt(R)).astype(np.float32)    # [H, dv, R]
    capacity = prefix + rows + 3
    latent = np.full((capacity, R), np.nan, np.float32)                       # unused slots: NaN
    rope = np.full((capacity, dr), np.nan, np.float32)
    latent[:prefix + rows] = rng.standard_normal((prefix + rows, R))
    rope[:prefix + rows] = rng.standard_normal((prefix + rows, dr))
    scale = 1 / np.sqrt(dn + dr)

    with chapter.timed("numba absorb chain"):
        q_lat = knl.absorb_query(q_nope, w_uk)
        o_lat = knl.attention_absorb(q_lat, q_pe, latent, rope, prefix, visible, scale, threads=32)
        out = knl.absorb_output(o_lat, w_uv)
    ref_q_lat = ref.absorb_query(q_nope, w_uk)
    ref_o_lat = ref.attention_absorb(ref_q_lat, q_pe, latent, rope, prefix, visible, scale)
    ref_out = ref.absorb_output(ref_o_lat, w_uv)
    naive = ref.attention_naive(q_nope, q_pe, latent, rope, prefix, visible, scale, w_uk, w_uv)
    print(f"tree of {rows} nodes behind {prefix} cached tokens, H={H} R={R} dr={dr} "
          f"(slots past {prefix + rows} hold NaN):")
    for name, got, want in (("absorb_query", q_lat, ref_q_lat), ("attention_absorb", o_lat, ref_o_lat),
                            ("absorb_output", out, ref_out)):
        print(f"  {name:16s} {str(got.shape):12s} max |numpy - numba| = {np.abs(got - want).max():.1e}")
    print(f"  numba absorb chain vs numpy naive: {np.abs(out - naive).max():.1e}")


if __name__ == "__main__":
    with chapter.report(STEM):
        print(f"kernels run on: {device.where()}")
        cache_report()
        cost_report()
        plot_cost()
        plot_masks()
        naive_vs_absorb_model()
        kernels_vs_numpy(np.random.default_rng(0))
