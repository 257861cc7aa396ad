"""Chapter 8: verifying the whole tree with one target forward (ancestor mask, shared positions).

The N = n + 1 tree tokens go through the target as one batch of rows, written to the KV cache at
slots start..start+n. Two things make that batch behave like N separate sequences:

* visibility: row i attends to the committed prefix (every row sees it) and, among the tree rows,
  only to itself and its ancestors: ``vis[i, :i] = vis[parent[i], :i]; vis[i, i] = True``;
* positions: node i gets rotary position start + depth[i], the position it would have in its own
  sequence; siblings (same depth) share a position.

This chapter builds a real tree (noisy oracle, budget 12, preset tiny, golden prompt), draws the
mask, runs the verify forward and checks every node's logits against a plain causal forward over
prefix + its path alone. Then it runs the numba visibility kernel and the numba absorbed attention
(with the tree mask, on the layer-0 inputs of that verify forward) against numpy, and the engine's
attention_paths (each row's keys from its path, no mask) in numpy and numba on the same inputs.

Run: .venv/bin/python walkthrough/08_tree_attention.py

Writes docs/assets/figures/08_tree_attention_{tree,mask}.png and 08_tree_attention_report.txt (what it
prints).
"""

import chapter  # walkthrough/chapter.py: figures, the report file, the Agg backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from treeplot import ROW_INCHES, draw_tree, tree_height

import kernels  # noqa: F401  (picks GPU or simulator before numba loads)
import kernels.mla as gpu_mla
import kernels.tree as gpu_tree
from ddtree import tree as ref
from ddtree.drafters import make_drafter
from ddtree.mla import attention_paths, key_mask
from kernels.bench.cases import tree as tree_costs
from kernels.device import SIMULATOR

STEM = "08_tree_attention"
BLOCK_SIZE = 8
BUDGET = 12


def path_to(tree: ref.DraftTree, node: int) -> list[int]:
    """Node indices root..node."""
    path = [node]
    while path[-1] > 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def mask_bytes(budget: int, requests: int) -> None:
    """What the visibility kernel moves (kernels.tree's cost model): parents in, the mask out."""
    moved = tree_costs.bytes_moved("visibility", Bq=requests, W=budget + 1)
    print(f"  visibility, {requests:>2} requests x budget {budget}: {moved:>6} bytes in and out, "
          f"{chapter.time_floor(moved) * 1e9:.1f} ns")


def noisy_tree(setup) -> ref.DraftTree:
    """The noisy oracle's first round at budget BUDGET."""
    drafter = make_drafter("noisy", setup.model, setup.prompt, 24)
    top_logprobs, top_ids = ref.top_candidates(drafter.propose(setup.prompt, BLOCK_SIZE), BUDGET)
    return ref.build_tree(int(setup.prompt[-1]), top_logprobs, top_ids, BUDGET)


def print_tree(tree: ref.DraftTree, start: int, visible: np.ndarray, positions: np.ndarray) -> None:
    with chapter.section("tree"):
        print(f"tree: {tree.size} nodes (root + {tree.size - 1}), prefix of {start} cached tokens")
        print(f"  tokens    {tree.tokens.tolist()}")
        print(f"  parents   {tree.parents.tolist()}")
        print(f"  positions {positions.tolist()}")
        print("  (start + depth: siblings share a position)")
        for position in np.unique(positions):
            nodes = np.flatnonzero(positions == position)
            print(f"    position {position}: nodes {', '.join(f'#{i}' for i in nodes)}")
        deepest = int(np.argmax(tree.depths))
        seen = np.flatnonzero(visible[deepest])
        chain = " -> ".join(str(int(t)) for t in tree.tokens[seen])
        print(f"  mask row #{deepest} (the deepest node) sees the {start} prefix keys and the tree rows "
              f"{', '.join(f'#{i}' for i in seen)}:")
        print(f"    the path {chain}")
        assert seen.tolist() == path_to(tree, deepest)


def check_rows(setup, tree: ref.DraftTree, logits: np.ndarray) -> None:
    """Each row's logits against a causal forward over prefix + that node's own path."""
    worst, argmax_same = 0.0, True
    for i in range(tree.size):
        path = np.concatenate([setup.prompt[:-1], tree.tokens[path_to(tree, i)]])
        alone = setup.model.logits(path)[-1]                                           # [V]
        worst = max(worst, float(np.abs(alone - logits[i]).max()))
        argmax_same &= int(alone.argmax()) == int(logits[i].argmax())
    print(f"  each row vs a causal forward over prefix + its own path: max |diff| {worst:.1e} "
          f"(max |logit| {np.abs(logits).max():.2f})")
    print(f"  same argmax everywhere: {argmax_same}")
    assert argmax_same


def plot_tree_and_mask(tree: ref.DraftTree, start: int, visible: np.ndarray, positions: np.ndarray) -> None:
    """Two figures: the tree (x = position) and the key mask of every tree row."""
    fig, ax = plt.subplots(figsize=(8, ROW_INCHES * tree_height(tree) + 1.4))
    draw_tree(ax, tree, pop_order=True, fontsize=9, start=start, title=f"the tree (budget {BUDGET})")
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "tree")
    mask = key_mask(start, visible)                                                # [N, P + N]
    shade = mask.astype(int)                                                       # 1 = visible tree key
    shade[:, :start] *= 2                                                          # 2 = prefix key
    fig, ax = plt.subplots(figsize=(8, 5.2))
    ax.imshow(shade, cmap=ListedColormap(["white", "#3182bd", "#9e9ac8"]), vmin=0, vmax=2, aspect="auto")
    ax.axvline(start - 0.5, color="black", lw=1)
    ax.set_xticks(range(start + tree.size))
    ax.set_xticklabels([f"p{s}" for s in range(start)] + [f"#{j}" for j in range(tree.size)], fontsize=8)
    ax.set_yticks(range(tree.size))
    ax.set_yticklabels([f"#{i} {int(t)} @{int(p)}" for i, (t, p) in
                        enumerate(zip(tree.tokens, positions, strict=True))], fontsize=8)
    ax.set_xlabel("keys: the cached prefix (purple, seen by every row), then the tree rows")
    ax.set_ylabel("query row: #node token @position")
    ax.set_title("key_mask(start, visibility(parents)): blue = visible", fontsize=10)
    fig.tight_layout()
    chapter.save_figure(fig, STEM, "mask")


def check_kernels(tree: ref.DraftTree, visible: np.ndarray, attention_call) -> None:
    """The numba visibility kernel, and the absorbed attention on layer 0's recorded inputs."""
    print(f"numba ({'CUDA simulator' if SIMULATOR else 'GPU'}):")
    with chapter.timed("numba visibility"):
        same = np.array_equal(gpu_tree.visibility(tree.parents), visible)
    print(f"  visibility (one thread per (i, j)): identical: {same}")
    assert same
    q_lat, q_pe, cache_latent, cache_rope, prefix_len, mask_arg, scale = attention_call.args
    expected = attention_call.result                                                # [N, H, R]
    with chapter.timed("numba attention_absorb"):
        got = gpu_mla.attention_absorb(q_lat, q_pe, cache_latent, cache_rope, prefix_len, mask_arg, scale,
                                       threads=32)
    diff = float(np.abs(got - expected).max())
    print(f"  attention_absorb, layer 0 of the verify forward: q_lat {q_lat.shape}, prefix {prefix_len}, "
          f"mask {mask_arg.shape}:")
    print(f"    max |numpy - numba| {diff:.1e} (max |o_lat| {np.abs(expected).max():.2f})")
    assert diff < 1e-4
    check_paths(tree, attention_call)


def tree_paths(tree: ref.DraftTree) -> np.ndarray:
    """(N, max depth + 1) int64: row i holds the nodes root .. i by depth, then -1."""
    paths = np.full((tree.size, int(tree.depths.max()) + 1), -1, np.int64)
    for node in range(tree.size):
        path = path_to(tree, node)
        paths[node, :len(path)] = path
    return paths


def check_paths(tree: ref.DraftTree, attention_call) -> None:
    """The engine's attention on the same inputs: numpy's attention_paths equals the masked
    attention, and the kernel's (the engine's plan for tiny) equals numpy's."""
    q_lat, q_pe, cache_latent, cache_rope, prefix_len, _, scale = attention_call.args
    expected = attention_call.result                                                # [N, H, R]
    depths, paths = tree.depths.astype(np.int64), tree_paths(tree)                  # [N], [N, L + 1]
    by_paths = attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix_len, depths, paths, scale)
    with chapter.timed("numba attention_paths"):
        got = gpu_mla.attention_paths(q_lat, q_pe, cache_latent, cache_rope, prefix_len, depths, paths, scale)
    plan = gpu_mla.paths_plan(q_lat.shape[1], q_lat.shape[2], q_pe.shape[2], cache_latent.shape[0])
    masked = float(np.abs(by_paths - expected).max())
    diff = float(np.abs(got - by_paths).max())
    print(f"  attention_paths, the same inputs with paths {paths.shape} instead of the mask:")
    print(f"    numpy: max |attention_paths - attention_absorb| {masked:.1e}")
    print(f"    numba (version {plan.version}: Z={plan.splits}, G={plan.heads_per_block}): "
          f"max |numpy - numba| {diff:.1e}")
    assert masked <= 1e-5 and diff < 1e-4


def main() -> None:
    """Build a tree, verify it in one forward, check every row, draw the mask, run the kernels."""
    setup = chapter.golden_model("tiny")
    tree = noisy_tree(setup)
    cache = setup.model.new_cache(64)
    setup.model.forward(cache, setup.prompt[:-1])           # the committed prefix, root excluded
    start = cache.length
    visible = ref.visibility(tree.parents)                  # [N, N]
    positions = ref.positions(tree, start)                  # [N] start + depth
    print_tree(tree, start, visible, positions)
    # --8<-- [start:verify]
    with chapter.record_ops(setup.model, "attention_absorb") as calls:
        logits = setup.model.forward(cache, tree.tokens, positions=positions, visible=visible)  # [N, V]
    # --8<-- [end:verify]
    print(f"verify: ONE forward over {tree.size} rows -> logits {logits.shape}, "
          f"cache length {start} -> {cache.length}")
    check_rows(setup, tree, logits)
    plot_tree_and_mask(tree, start, visible, positions)
    check_kernels(tree, visible, calls[0])                  # layer 0
    with chapter.section("mask_bytes"):
        chapter.print_gpu()
        mask_bytes(64, 1)
        mask_bytes(64, 32)


if __name__ == "__main__":
    with chapter.report(STEM):
        main()
