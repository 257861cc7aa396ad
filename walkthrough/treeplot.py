"""Drawing draft trees for the DDTree chapters (06-11): one helper, ``draw_tree``.

A tree is anything with ``tokens``, ``parents`` and ``depths`` arrays in pop order, root = node 0
(``ddtree.tree.DraftTree`` or a ``ddtree.decode.RoundTrace``). Depth runs left to right (the
reading direction of the sequence: node i sits at position start + depth[i]); siblings are
stacked top to bottom in rank order, each parent centred on its children.

Siblings pop in rank order (rank r is pushed when rank r - 1 pops), so a node's first child in
pop order is its rank-0 child, and the drafter's top-1 chain is the walk from the root along first
children: ``top1_chain`` finds it without the ranks (a ``RoundTrace`` does not keep them).

With ``words`` (token ids -> texts, e.g. ``ddtree.text.tokens_as_text`` with its tokenizer) a box
shows its token's text instead of its id, cut by one rule (``short``) so that neighbouring boxes
stay apart.
"""

from __future__ import annotations

import numpy as np

ACCEPTED = "#e6550d"       # accepted path: nodes and edges
BONUS = "#31a354"          # the bonus token (the target's own next token, not a tree node)
NODE = "#deebf7"           # every other node
EDGE = "#9ecae1"
TOP1 = "#9e9ac8"           # the drafter's top-1 chain: a wide band under its edges


def children_lists(parents: np.ndarray) -> list[list[int]]:
    """children[i] = node i's children in pop order (which is rank order among siblings)."""
    children = [[] for _ in range(len(parents))]
    for node in range(1, len(parents)):
        children[int(parents[node])].append(node)
    return children


def top1_chain(parents: np.ndarray) -> list[int]:
    """Node indices of the drafter's top-1 chain: from the root, always the first child."""
    children = children_lists(np.asarray(parents))
    chain = [0]
    while children[chain[-1]]:
        chain.append(children[chain[-1]][0])
    return chain


def with_bonus(parents: np.ndarray, depths: np.ndarray, bonus_of: int | None):
    """The tree's parents and depths with the bonus as one more node: the last child of the last
    accepted node ``bonus_of`` (None: the tree as it is). The bonus is the token at the next
    position, so it gets a column (and a row) of its own, after its parent's drafted children."""
    if bonus_of is None:
        return parents, depths
    return np.append(parents, bonus_of), np.append(depths, depths[bonus_of] + 1)


def layout(parents: np.ndarray, depths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) per node: x = depth; leaves get y = 0, 1, 2, ... in depth-first order, a parent the
    mean of its children's y. Returns y growing downwards (row 0 at the top)."""
    children = children_lists(parents)
    y = np.zeros(len(parents))
    next_leaf = 0
    stack = [(0, False)]
    while stack:                                   # iterative post-order: children before parents
        node, done = stack.pop()
        if done:
            y[node] = np.mean(y[children[node]]) if children[node] else y[node]
            continue
        if not children[node]:
            y[node] = next_leaf
            next_leaf += 1
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children[node]))
    return np.asarray(depths, dtype=float), y


BOX = dict(boxstyle="round,pad=0.25", lw=0.6)
SMALL = 0.9  # the pop index, a weight and "bonus", relative to the token's font size
# inches per row of leaves at fontsize 9: a node's box with its pop index above it (and its weight
# below); size a figure as ROW_INCHES * tree_height(tree) plus room for the title and the axis
ROW_INCHES = 0.36
# the most characters a box shows of a token's text: a longer text keeps LABEL_CHARS - 1 and ends
# in an ellipsis, so that a box stays inside its column (a column is about 85 px on the page)
LABEL_CHARS = 8


def short(text: str) -> str:
    """A token's text as a box shows it: at most LABEL_CHARS characters, the cut marked by '…'."""
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def labels(tokens, words=None) -> list[str]:
    """One box label per token id: the id, or with ``words`` the token's text (``short``)."""
    tokens = [int(t) for t in tokens]
    return [str(t) for t in tokens] if words is None else [short(w) for w in words(tokens)]


def draw_tree(ax, tree, accepted=None, pop_order=True, bonus=None, tokens=True, fontsize=8,
              title=None, start=None, top1=False, weights=None, words=None):
    """Draw ``tree`` on ``ax``.

    accepted: node indices of the accepted walk (starting at 0), drawn in orange.
    pop_order: label each node with its pop index (the heap's order; root = 0) above the box.
    bonus: the round's bonus token, a green box in the column after the last accepted node, below
        that node's drafted children (the bonus is the target's own token, not a tree node).
    tokens: write the token (its id, or its text with ``words``) in each node (off for very
        small plots).
    start: if given, the x axis is labelled with positions start + depth instead of depths.
    top1: mark the drafter's top-1 chain with a purple band under its edges.
    weights: per node, the cumulative log-probability, written under the box.
    words: token ids -> texts; the boxes show the texts (``short``) instead of the ids.
    """
    parents, depths = np.asarray(tree.parents), np.asarray(tree.depths)
    last = None if bonus is None or accepted is None or len(accepted) == 0 else int(np.asarray(accepted)[-1])
    x, y = layout(*with_bonus(parents, depths, last))            # the bonus, if any, is the last (x, y)
    texts = labels(tree.tokens, words) if tokens else [None] * len(parents)
    on_path = np.zeros(len(parents), dtype=bool)
    if accepted is not None:
        on_path[np.asarray(accepted, dtype=np.int64)] = True
    if top1:
        chain = top1_chain(parents)
        ax.plot(x[chain], y[chain], color=TOP1, lw=fontsize * 1.1, alpha=0.55, zorder=0,
                solid_capstyle="round")
    for node in range(1, len(parents)):            # edges first, boxes on top
        parent = int(parents[node])
        hot = on_path[node] and on_path[parent]
        ax.plot([x[parent], x[node]], [y[parent], y[node]], color=ACCEPTED if hot else EDGE,
                lw=2.2 if hot else 0.9, zorder=1)
    boxes = [_draw_node(ax, x[node], y[node], node, texts[node], on_path[node], fontsize, pop_order,
                        None if weights is None or node == 0 else float(weights[node]))
             for node in range(len(parents))]
    if last is not None:
        _draw_bonus(ax, boxes[last], (x[-1], y[-1]), labels([bonus], words)[0] if tokens else None, fontsize)
    columns = int(x.max()) + 1
    _style_axes(ax, columns, columns - 0.4, y.max(), start, fontsize, title)
    return ax


def _draw_node(ax, x, y, node, text, accepted, fontsize, pop_order, weight):
    """One node's box (its token), its pop index above and its weight below, when asked for;
    returns the box's text."""
    box = ax.text(x, y, "" if text is None else text, ha="center", va="center", fontsize=fontsize,
            zorder=3, color="white" if accepted else "black",
            bbox=dict(BOX, fc=ACCEPTED if accepted else NODE, ec="#444444" if node == 0 else "#6baed6"))
    small = dict(textcoords="offset points", ha="center", fontsize=fontsize * SMALL, color="#555555",
                 zorder=3)
    if pop_order:
        ax.annotate(f"#{node}", (x, y), xytext=(0, fontsize * 0.95), va="bottom", **small)
    if weight is not None:
        ax.annotate(f"{weight:.2f}", (x, y), xytext=(0, -fontsize * 0.95), va="top", **small)
    return box


def _draw_bonus(ax, parent, where, text, fontsize) -> None:
    """The bonus box at ``where`` (its own row in the column after the last accepted node, whose
    box is ``parent``), with an arrow from box edge to box edge."""
    bonus = ax.text(*where, "" if text is None else text, ha="center", va="center", fontsize=fontsize,
                    zorder=5, color="white", bbox=dict(BOX, fc=BONUS, ec=BONUS))
    ax.annotate("", where, xytext=parent.get_position(), zorder=4,
                arrowprops=dict(arrowstyle="-|>", color=BONUS, lw=1.5, shrinkA=1, shrinkB=1,
                                patchA=parent.get_bbox_patch(), patchB=bonus.get_bbox_patch()))
    ax.annotate("bonus", where, xytext=(0, fontsize * 0.95), textcoords="offset points",
                ha="center", va="bottom", fontsize=fontsize * SMALL, color=BONUS, zorder=5)


def _style_axes(ax, columns, right, bottom, start, fontsize, title) -> None:
    """Depth (or position) along x, rows top to bottom, no frame but the x axis."""
    ax.set_xlim(-0.6, right)
    ax.set_ylim(bottom + 0.7, -0.9)                # row 0 at the top
    ax.set_yticks([])
    ax.set_xticks(range(columns))
    ax.set_xticklabels([str(d if start is None else start + d) for d in range(columns)])
    ax.set_xlabel("depth" if start is None else "position (start + depth)", fontsize=fontsize)
    ax.tick_params(labelsize=fontsize * 0.9)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=fontsize + 1)


def tree_height(tree, bonus_of: int | None = None) -> float:
    """Rows the layout needs (leaves), to size a figure; ``bonus_of``: the last accepted node,
    when the figure draws a bonus (it takes a row of its own)."""
    _, y = layout(*with_bonus(np.asarray(tree.parents), np.asarray(tree.depths), bonus_of))
    return float(y.max() + 1)
