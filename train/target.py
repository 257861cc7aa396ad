"""Train the tiny-code target: tiny's dimensions (MLA + MoE, V3 routing) on the pre-tokenized corpus.

Legend (docs/glossary.md): Bq sequences of a batch, T rows of each, V vocab_size, E n_routed_experts.

    python -m train.target --corpus .corpus --out DIR --minutes 4 --device cuda

Random windows of ``--seq-len + 1`` tokens of ``train.npy`` (start offsets drawn from the seed),
AdamW with warmup and a cosine decay over the budget (steps or wall time), gradient clipping, bf16
autocast on CUDA over fp32 master weights, and V3's router-bias update after every step. At the
end: the held-out loss over all of ``heldout.npy`` and its bits per byte beside a unigram
baseline, each MoE layer's expert load, and the checkpoint (``ddtree.weights.save_pretrained``,
sharded past 12 MB) with ``training.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.config import PRESET_NAMES, ModelConfig, preset
from ddtree.weights import save_pretrained
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
from train.model import ROUTER_BIAS_RATE, Model, to_ddtree, update_router_bias

MAX_SHARD_BYTES = 12_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass
class TargetOptions:
    corpus: str
    out: str
    minutes: float = 4.0
    device: str = "cuda"
    steps: int | None = None
    seed: int = 0
    config: str = "tiny"
    seq_len: int = 256
    batch: int | None = None            # None: 256 on CUDA, 8 on the CPU
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_rate: float = ROUTER_BIAS_RATE
    eval_batch: int = 64
    log_every: int = 50


def parse_args(argv=None) -> TargetOptions:
    defaults = TargetOptions(corpus="", out="")
    p = argparse.ArgumentParser(prog="python -m train.target", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True, help="directory with train.npy, heldout.npy, corpus.json")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=defaults.minutes,
                   help="wall-time budget of the training loop")
    p.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (if sooner)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--config", default=defaults.config, choices=PRESET_NAMES, help="preset dimensions")
    for name in ("seq_len", "batch", "warmup", "eval_batch", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("lr", "weight_decay", "clip", "bias_rate"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    return TargetOptions(**vars(p.parse_args(argv)))


def config_for(options) -> ModelConfig:
    config = preset(options.config)
    if options.seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {options.seq_len} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}")
    return config


def loss_and_counts(model: Model, rows: torch.Tensor):
    """Mean next-token loss (nats) of rows (Bq, T+1) and the MoE layers' expert counts."""
    logits, counts = model(rows[:, :-1])                                       # [Bq, T, V]
    loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    return loss, counts


@torch.no_grad()
def evaluate(model: Model, tokens: np.ndarray, seq_len: int, batch: int, device) -> dict:
    """Summed next-token loss (nats) over every token of ``tokens`` but the first, in windows of
    ``seq_len`` predictions (each window's first token is context only; windows overlap by one
    token), with the MoE layers' expert counts over the same pass."""
    model.eval()
    stream = torch.as_tensor(tokens.astype(np.int64), device=device)
    starts = torch.arange(0, stream.numel() - 1, seq_len, device=device)   # windows' first tokens
    full = starts[starts + seq_len + 1 <= stream.numel()]
    total, counts = 0.0, None

    def add(rows):
        nonlocal total, counts
        with autocast(device):
            logits, layer_counts = model(rows[:, :-1])                       # [Bq, T, V]
        total += F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        stacked = torch.stack(layer_counts) if layer_counts else None       # [MoE layers, E]
        counts = stacked if counts is None else counts + stacked

    for i in range(0, full.numel(), batch):
        add(windows(stream, full[i:i + batch], seq_len + 1))
    tail = int(full[-1]) + seq_len if full.numel() else 0                   # first token not yet predicted
    if tail + 1 < stream.numel():
        add(stream[tail:][None])
    model.train()
    return {"nats": total, "predicted": stream.numel() - 1,
            "counts": None if counts is None else counts.cpu().numpy()}


def unigram_nats(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    """Summed loss (nats) over heldout[1:] of train's add-one unigram distribution."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0  # [V]
    log_p = np.log(counts / counts.sum())                                                   # [V]
    return float(-log_p[heldout[1:].astype(np.int64)].sum())


def load_shares(counts) -> list[dict]:
    """Per MoE layer: the smallest and largest expert's share of the routed (token, slot) pairs."""
    if counts is None:
        return []
    shares = counts / counts.sum(axis=1, keepdims=True)                    # [MoE layers, E]
    return [{"min": float(s.min()), "max": float(s.max())} for s in shares]


def train_target(options: TargetOptions) -> dict:
    """Train, evaluate and export; returns the training record (also ``DIR/training.json``)."""
    seed_everything(options.seed)
    device = pick_device(options.device)
    config = config_for(options)
    corpus = load_corpus(options.corpus)
    train_tokens, heldout = corpus["train"], corpus["heldout"]
    for split, tokens in (("train", train_tokens), ("heldout", heldout)):
        if tokens.size and tokens.max() >= config.vocab_size:
            raise ValueError(f"{options.corpus}/{split}.npy holds token {tokens.max()} >= vocab_size "
                             f"{config.vocab_size}")
    if train_tokens.size <= options.seq_len + 1:
        raise ValueError(f"train.npy has {train_tokens.size} tokens, fewer than --seq-len + 2")
    batch = options.batch or (256 if device.type == "cuda" else 8)
    model = Model(config).to(device)
    optimizer = make_optimizer(model, options.lr, options.weight_decay)
    stream = torch.as_tensor(train_tokens.astype(np.int32), device=device)
    order = np.random.default_rng(options.seed)              # the data order, from the seed alone
    budget = Budget(options.minutes, options.steps)
    step, history, loads = 0, [], None
    first_loss = last_loss = math.nan
    while not budget.done(step):
        lr = learning_rate(budget.progress(step), step, options.lr, options.warmup)
        starts = torch.as_tensor(order.integers(0, train_tokens.size - options.seq_len - 1, batch),
                                 device=device)
        with autocast(device):
            loss, counts = loss_and_counts(model, windows(stream, starts, options.seq_len + 1))
        apply_update(model, optimizer, loss, lr, options.clip)
        update_router_bias(model, counts, options.bias_rate)
        stacked = torch.stack(counts) if counts else None                     # [MoE layers, E]
        loads = stacked if loads is None else loads + stacked
        step += 1
        if logged(step, budget, options.log_every):
            last_loss = loss.item()
            first_loss = last_loss if step == 1 else first_loss
            history.append(history_entry(step, last_loss, lr, budget))
            print(f"step {step:6d}  loss {last_loss:.4f}  lr {lr:.2e}  "
                  f"{step * batch * options.seq_len / budget.elapsed():,.0f} tokens/s", flush=True)
    wall = budget.elapsed()
    result = evaluate(model, heldout, options.seq_len, options.eval_batch, device)
    nats_per_token = result["nats"] / result["predicted"]
    heldout_bytes = corpus["meta"]["heldout"]["bytes"]
    unigram = unigram_nats(train_tokens, heldout, config.vocab_size)
    record = {
        **run_facts("train.target"),
        "config": options.config, "steps": step, "tokens_seen": step * batch * options.seq_len,
        "wall_seconds": round(wall, 2), "tokens_per_second": round(step * batch * options.seq_len / wall),
        "device": device_name(device), "torch": torch.__version__,
        "first_train_loss": first_loss, "final_train_loss": last_loss,
        "heldout": {"tokens_predicted": result["predicted"], "bytes": heldout_bytes,
                    "loss_nats_per_token": nats_per_token,
                    "bits_per_byte": result["nats"] / heldout_bytes / math.log(2),
                    "unigram_nats_per_token": unigram / result["predicted"],
                    "unigram_bits_per_byte": unigram / heldout_bytes / math.log(2),
                    "context": f"windows of {options.seq_len} predictions overlapping by one token"},
        "expert_load_share": {
            "balanced": 1.0 / config.n_routed_experts,
            "train": load_shares(None if loads is None else loads.cpu().numpy()),
            "heldout": load_shares(result["counts"])},
        "hyperparameters": {**dataclasses.asdict(options), "batch": batch, "optimizer": "AdamW",
                            "betas": [0.9, 0.95], "schedule": "linear warmup, cosine to 0.1 x lr over "
                            "the budget (steps or wall time, whichever is nearer its end)",
                            "precision": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32"},
        "history": history,
    }
    out = pathlib.Path(options.out)
    save_pretrained(out, config, to_ddtree(model.cpu()), max_shard_bytes=MAX_SHARD_BYTES)
    for name in TOKENIZER_FILES:                             # the corpus's tokenizer, where it has one
        if (pathlib.Path(options.corpus) / name).is_file():
            shutil.copy(pathlib.Path(options.corpus) / name, out / name)
    baselines = pathlib.Path(options.corpus) / "baselines.json"      # the corpus's own (xz -9e ...)
    if baselines.is_file():
        record["heldout"]["corpus_baselines_bits_per_byte"] = json.loads(baselines.read_text()).get(
            "bits_per_byte")
    write_json(out / "training.json", record)
    print(f"held-out: {nats_per_token:.4f} nats/token, {record['heldout']['bits_per_byte']:.4f} bits/byte "
          f"(unigram {record['heldout']['unigram_bits_per_byte']:.4f}); {step} steps in {wall:.0f} s",
          flush=True)
    return record


def main(argv=None) -> int:
    return command(train_target, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
