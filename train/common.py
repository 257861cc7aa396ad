"""What the target and drafter scripts share: the corpus, seeding, the device, the schedule, the clock.

Legend (docs/glossary.md): Bq sequences of a batch, T rows of each, V vocab_size.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import random
import sys
import time

import numpy as np
import torch


def load_corpus(directory) -> dict:
    """``train.npy``, ``heldout.npy`` (uint16 tokens) and ``corpus.json`` of a pre-tokenized corpus."""
    directory = pathlib.Path(directory)
    corpus = {}
    for split in ("train", "heldout"):
        path = directory / f"{split}.npy"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a corpus directory holds train.npy, "
                                    "heldout.npy and corpus.json)")
        corpus[split] = np.load(path)
        if corpus[split].ndim != 1 or not np.issubdtype(corpus[split].dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer token array, got {corpus[split].dtype} "
                             f"{corpus[split].shape}")
    path = directory / "corpus.json"
    try:
        corpus["meta"] = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    for split in ("train", "heldout"):
        entry = corpus["meta"].get(split)
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or entry["bytes"] < 1:
            raise ValueError(f"{path}: needs {split}.bytes, a positive integer")
    return corpus


def seed_everything(seed: int) -> None:
    """Python's and torch's generators (numpy draws come from explicit default_rng(seed) generators)."""
    random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name not in ("cuda", "cpu"):
        raise ValueError(f"--device must be 'cuda' or 'cpu', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    if name == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True        # training GEMMs; bf16 autocast does the rest
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights), nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def learning_rate(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``floor * peak`` as
    ``progress`` (the budget's fraction spent, steps or time) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(max(progress, 0.0), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Budget:
    """Stop after ``steps`` steps (if given) or ``minutes`` of wall time, whichever comes first."""

    def __init__(self, minutes: float, steps: int | None):
        if not (minutes > 0 and math.isfinite(minutes)):
            raise ValueError(f"--minutes must be a positive number, got {minutes!r}")
        if steps is not None and steps < 1:
            raise ValueError(f"--steps must be a positive integer, got {steps!r}")
        self.seconds, self.steps = 60.0 * minutes, steps
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def progress(self, step: int) -> float:
        by_time = self.elapsed() / self.seconds
        return max(by_time, step / self.steps) if self.steps else by_time

    def done(self, step: int) -> bool:
        return (self.steps is not None and step >= self.steps) or self.elapsed() >= self.seconds


def apply_update(model: torch.nn.Module, optimizer, loss: torch.Tensor, lr: float, clip: float) -> None:
    """One step of both trainings: ``loss``'s gradients, clipped to norm ``clip``, applied at ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def logged(step: int, budget: Budget, every: int) -> bool:
    """Whether ``step`` is logged: the first, every ``every``-th and the last (reading the loss
    waits for the GPU, so not every step)."""
    return step == 1 or step % every == 0 or budget.done(step)


def history_entry(step: int, loss: float, lr: float, budget: Budget) -> dict:
    return {"step": step, "loss": round(loss, 4), "lr": lr, "seconds": round(budget.elapsed(), 1)}


def command(train, parse_args, argv=None) -> int:
    """A training script's ``main``: a refused option or a missing file is one line and exit 2."""
    try:
        train(parse_args(argv))
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; matrices decay, norms and embeddings do not."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (keep if p.ndim < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def windows(tokens: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Rows ``tokens[s : s + length]`` for each start s: (Bq,) -> (Bq, length) int64."""
    return tokens[starts[:, None] + torch.arange(length, device=tokens.device)].long()  # [Bq, length]


def run_facts(module: str) -> dict:
    """When and how this run was started (``python -m module`` with this process's arguments)."""
    return {"date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["python -m", module, *sys.argv[1:]])}


def write_json(path: pathlib.Path, values: dict) -> None:
    path.write_text(json.dumps(values, indent=2) + "\n")
