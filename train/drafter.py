"""Train a block drafter for a trained target (DDTree's drafter, DFlash-like): one causal forward
over the last ``window`` committed tokens and ``L - 1`` mask tokens gives the distributions of the
next L tokens (the contract's ``ddtree.drafters.block_rows``).

Legend (docs/glossary.md): Bq sequences of a batch, T rows of each, V vocab_size, L draft depths,
K candidates per depth (here: roots drawn per sequence).

    python -m train.drafter --target DIR --corpus .corpus --out DIR/drafter --minutes 3 --device cuda

Each step draws ``--batch`` windows of ``teacher_len + L`` tokens of ``train.npy`` and K roots in
each (every root with at least ``min_context`` real tokens before it in its window). The drafter
reads each root's block rows; the loss at row ``window - 2 + d`` is taken against the token at
depth d: ``--labels target`` (default) distils the frozen target's teacher-forced next-token
distribution at that token's position (one no-grad target forward per window serves all its
roots), ``--labels data`` uses the corpus token. A fraction of the contexts is cut short (left
padding, as early in a generation). The drafter starts from the target's embeddings, output head
and the first layers' attention (same dimensions), its dense MLPs fresh. The held-out report: per
depth, the drafter's top-1 agreement with the target's teacher-forced argmax, a quick proxy for
acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.config import ModelConfig
from ddtree.drafters import MASK, PAD, BlockDrafter, save_block_drafter
from ddtree.weights import load_pretrained
from train.common import (
    Budget,
    apply_update,
    autocast,
    command,
    device_name,
    history_entry,
    learning_rate,
    load_corpus,
    logged,
    make_optimizer,
    pick_device,
    run_facts,
    seed_everything,
    windows,
    write_json,
)
from train.model import Model, from_ddtree, to_ddtree


@dataclasses.dataclass
class DrafterOptions:
    target: str
    corpus: str
    out: str
    minutes: float = 3.0
    device: str = "cuda"
    steps: int | None = None
    seed: int = 0
    labels: str = "target"
    layers: int = 2
    window: int = 64
    max_depths: int = 15
    teacher_len: int = 256             # tokens of a teacher window before its last root's block
    min_context: int = 128             # real tokens before a root inside its teacher window
    roots: int = 16                    # roots drawn per teacher window
    batch: int | None = None           # teacher windows per step; None: 64 on CUDA, 2 on the CPU
    short_fraction: float = 0.1        # contexts cut to a random length below the window
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    init_from_target: bool = True
    eval_roots: int = 4096
    log_every: int = 50


def parse_args(argv=None) -> DrafterOptions:
    defaults = DrafterOptions(target="", corpus="", out="")
    p = argparse.ArgumentParser(prog="python -m train.drafter", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="the trained target's checkpoint directory")
    p.add_argument("--corpus", required=True, help="directory with train.npy, heldout.npy, corpus.json")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument("--minutes", type=float, default=defaults.minutes)
    p.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--labels", default=defaults.labels, choices=["target", "data"])
    p.add_argument("--no-init-from-target", dest="init_from_target", action="store_false")
    for name in ("seed", "layers", "window", "max_depths", "teacher_len", "min_context", "roots", "batch",
                 "warmup", "eval_roots", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("short_fraction", "lr", "weight_decay", "clip"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    return DrafterOptions(**vars(p.parse_args(argv)))


def check_options(o: DrafterOptions) -> None:
    if o.labels not in ("target", "data"):
        raise ValueError(f"--labels must be 'target' or 'data', got {o.labels!r}")
    for name in ("layers", "window", "max_depths", "roots", "teacher_len", "min_context", "eval_roots"):
        if getattr(o, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(o, name)}")
    if not o.window <= o.min_context <= o.teacher_len:
        raise ValueError(f"need --window ({o.window}) <= --min-context ({o.min_context}) <= --teacher-len "
                         f"({o.teacher_len}): a root's block rows come from its teacher window")
    if not 0.0 <= o.short_fraction <= 1.0:
        raise ValueError(f"--short-fraction must lie in [0, 1], got {o.short_fraction}")


def drafter_config(target: ModelConfig, layers: int) -> ModelConfig:
    """The target's dimensions with ``layers`` dense layers (the contract's default drafter: 2)."""
    return dataclasses.replace(target, num_hidden_layers=layers, first_k_dense_replace=layers)


# --8<-- [start:block_rows_batch]
def block_rows_batch(stream: torch.Tensor, roots: torch.Tensor, window: int, depths: int,
                     lengths: torch.Tensor | None = None, pad_token: int = PAD,
                     mask_token: int = MASK) -> torch.Tensor:
    """``ddtree.drafters.block_rows`` for many roots of one token stream at once: row b is
    ``block_rows(stream[roots[b] - lengths[b] + 1 : roots[b] + 1], window, depths)`` (lengths
    default to everything before the root). stream (n,), roots (Bq,) -> (Bq, window + L - 1)."""
    offsets = torch.arange(1 - window, 1, device=roots.device)                 # [window]
    index = roots[:, None] + offsets                                            # [Bq, window]
    first = torch.zeros_like(roots) if lengths is None else roots - lengths + 1  # [Bq] first kept token
    real = index >= first[:, None].clamp(min=0)                                 # [Bq, window]
    context = torch.where(real, stream[index.clamp(min=0)].long(), pad_token)  # [Bq, window]
    masks = torch.full((roots.numel(), depths - 1), mask_token, dtype=torch.long, device=roots.device)
    return torch.cat([context, masks], dim=1)                                   # [Bq, window + L - 1]
# --8<-- [end:block_rows_batch]


def draft_logits(drafter: Model, rows: torch.Tensor, window: int, depths: int) -> torch.Tensor:
    """The drafter's logits (Bq, L, V) at rows window - 2 + d, d = 1..L."""
    logits, _ = drafter(rows)                                                   # [Bq, window + L - 1, V]
    return logits[:, window - 1:window - 1 + depths]                           # [Bq, L, V]


class Batches:
    """Teacher windows and roots from a token stream: windows (Bq, teacher_len + L) of the
    stream, roots (Bq, K) inside them, their stream positions, and optional short lengths."""

    def __init__(self, tokens: np.ndarray, options: DrafterOptions, device, seed: int):
        self.o, self.device = options, device
        self.stream = torch.as_tensor(tokens.astype(np.int32), device=device)
        self.span = options.teacher_len + options.max_depths                   # tokens of a teacher window
        if tokens.size < self.span:
            raise ValueError(f"a token split of {tokens.size} tokens is shorter than --teacher-len + "
                             f"--max-depths = {self.span}")
        self.rng = np.random.default_rng(seed)

    def draw(self, count: int, short_fraction: float):
        o, rng = self.o, self.rng
        starts = rng.integers(0, self.stream.numel() - self.span + 1, count)                 # [Bq]
        local = rng.integers(o.min_context - 1, o.teacher_len, (count, o.roots))            # [Bq, K]
        lengths = np.where(rng.random((count, o.roots)) < short_fraction,
                           rng.integers(1, o.window + 1, (count, o.roots)), o.teacher_len)   # [Bq, K]
        as_tensor = lambda a: torch.as_tensor(a, device=self.device)
        starts, local, lengths = as_tensor(starts), as_tensor(local), as_tensor(lengths)
        return windows(self.stream, starts, self.span), local, starts[:, None] + local, lengths


def teacher_targets(target: Model, seqs, local, depths: int, labels: str):
    """Per root and depth: the target's teacher-forced distribution of the token at depth d (its
    logits at window position local + d - 1), or the corpus token. Returns (probs (Bq*K, L, V) or
    None, tokens (Bq*K, L), target argmax (Bq*K, L) or None)."""
    steps = torch.arange(depths, device=seqs.device)                            # [L]
    where = local[..., None] + steps                                            # [Bq, K, L] predicting rows
    tokens = seqs.gather(1, (where + 1).flatten(1)).view(-1, depths)            # [Bq*K, L]
    if labels == "data" and target is None:
        return None, tokens, None
    with torch.no_grad(), autocast(seqs.device):
        logits, _ = target(seqs)                                                # [Bq, T, V]
    vocab = logits.shape[-1]
    picked = logits.float().gather(1, where.flatten(1)[..., None].expand(-1, -1, vocab))  # [Bq, K*L, V]
    picked = picked.view(-1, depths, vocab)                                     # [Bq*K, L, V]
    return picked.softmax(-1), tokens, picked.argmax(-1)


# --8<-- [start:distill_loss]
def distill_loss(logits, probs, tokens, labels: str):
    """Mean over roots and depths: soft cross-entropy against ``probs`` or hard against ``tokens``."""
    log_q = F.log_softmax(logits.float(), dim=-1)                               # [Bq, L, V]
    if labels == "target":
        return -(probs * log_q).sum(-1).mean()
    return F.nll_loss(log_q.flatten(0, 1), tokens.flatten())
# --8<-- [end:distill_loss]


@torch.no_grad()
def evaluate(drafter, target, batches: Batches, options: DrafterOptions) -> dict:
    """Held-out, per depth: top-1 agreement with the target's teacher-forced argmax, top-1
    accuracy against the corpus token, and the drafter's loss (nats) on the corpus token."""
    drafter.eval()
    o, depths = options, options.max_depths
    agree = torch.zeros(depths, device=batches.device)
    correct = torch.zeros(depths, device=batches.device)
    nats = torch.zeros(depths, device=batches.device)
    seen, per_batch = 0, max(1, min(o.eval_roots, 1024) // o.roots)
    while seen < o.eval_roots:
        seqs, local, roots, _ = batches.draw(per_batch, 0.0)
        _, tokens, target_top = teacher_targets(target, seqs, local, depths, "target")
        rows = block_rows_batch(batches.stream, roots.flatten(), o.window, depths)
        with autocast(batches.device):
            logits = draft_logits(drafter, rows, o.window, depths).float()      # [Bq*K, L, V]
        top = logits.argmax(-1)                                                 # [Bq*K, L]
        agree += (top == target_top).float().sum(0)
        correct += (top == tokens).float().sum(0)
        nats += F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none").sum(0)
        seen += tokens.shape[0]
    drafter.train()
    per_depth = lambda x: [round(float(v) / seen, 4) for v in x]
    return {"roots": seen, "top1_agreement_with_target": per_depth(agree),
            "top1_accuracy_on_data": per_depth(correct), "loss_nats_on_data": per_depth(nats)}


def init_from(drafter: Model, target: Model) -> list[str]:
    """Copy every target tensor whose name and shape the drafter shares; returns their names."""
    source, copied = target.state_dict(), []
    with torch.no_grad():
        for name, value in drafter.state_dict().items():
            if name in source and source[name].shape == value.shape:
                value.copy_(source[name])
                copied.append(name)
    return copied


def train_drafter(options: DrafterOptions) -> dict:
    """Train and export the drafter; returns its record (also ``OUT/drafter_training.json``)."""
    check_options(options)
    seed_everything(options.seed)
    device = pick_device(options.device)
    target_config, target_weights = load_pretrained(options.target)
    corpus = load_corpus(options.corpus)
    target = from_ddtree(target_config, target_weights).to(device).eval().requires_grad_(False)
    config = drafter_config(target_config, options.layers)
    if options.window + options.max_depths - 1 > config.max_position_embeddings:
        raise ValueError(f"--window + --max-depths - 1 exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}")
    drafter = Model(config).to(device)
    copied = init_from(drafter, target) if options.init_from_target else []
    batch = options.batch or (64 if device.type == "cuda" else 2)
    optimizer = make_optimizer(drafter, options.lr, options.weight_decay)
    train = Batches(corpus["train"], options, device, options.seed)
    budget = Budget(options.minutes, options.steps)
    step, history, last_loss = 0, [], float("nan")
    teacher = target if options.labels == "target" else None
    while not budget.done(step):
        lr = learning_rate(budget.progress(step), step, options.lr, options.warmup)
        seqs, local, roots, lengths = train.draw(batch, options.short_fraction)
        probs, tokens, _ = teacher_targets(teacher, seqs, local, options.max_depths, options.labels)
        rows = block_rows_batch(train.stream, roots.flatten(), options.window, options.max_depths,
                                lengths.flatten())
        with autocast(device):
            logits = draft_logits(drafter, rows, options.window, options.max_depths)
        loss = distill_loss(logits, probs, tokens, options.labels)
        apply_update(drafter, optimizer, loss, lr, options.clip)
        step += 1
        if logged(step, budget, options.log_every):
            last_loss = loss.item()
            history.append(history_entry(step, last_loss, lr, budget))
            print(f"drafter step {step:6d}  loss {last_loss:.4f}  lr {lr:.2e}  "
                  f"{step * rows.shape[0] / budget.elapsed():,.0f} roots/s", flush=True)
    wall = budget.elapsed()
    heldout_batches = Batches(corpus["heldout"], options, device, options.seed + 1)
    heldout = evaluate(drafter, target, heldout_batches, options)
    out = pathlib.Path(options.out)
    save_block_drafter(out, BlockDrafter(config, to_ddtree(drafter.cpu()), options.window, options.max_depths,
                                         pad_token=PAD, mask_token=MASK))
    record = {
        **run_facts("train.drafter"),
        "steps": step, "roots_seen": step * batch * options.roots, "wall_seconds": round(wall, 2),
        "device": device_name(device), "torch": torch.__version__, "labels": options.labels,
        "final_train_loss": last_loss, "initialised_from_target": copied, "heldout": heldout,
        "hyperparameters": {**dataclasses.asdict(options), "batch": batch, "optimizer": "AdamW"},
        "history": history,
    }
    write_json(out / "drafter_training.json", record)
    agreement = heldout["top1_agreement_with_target"]
    print(f"drafter: {step} steps in {wall:.0f} s; held-out top-1 agreement with the target, depth 1: "
          f"{agreement[0]:.3f}, depth {len(agreement)}: {agreement[-1]:.3f}", flush=True)
    return record


def main(argv=None) -> int:
    return command(train_drafter, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
